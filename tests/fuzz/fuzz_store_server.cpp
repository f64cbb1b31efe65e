// A real store_server fed arbitrary bytes by a stray client over loopback.
// Properties: the server never crashes (sanitizers watch its thread); it stops serving the stray
// client exactly when the frame parser says the stream is malformed; closed clients are reaped; and a
// well-behaved client is served correctly after every input.
//
// Input: one byte that chooses how many reads the stream is cut into, then the stream.
// Between reads the harness waits until the server has handled what it sent, so partial
// frames really arrive in separate reads.

#include <ddp/store.hpp>

#include <memory>

#include "fuzz_common.hpp"

namespace {

using namespace ddp::detail;

struct fixture {
  ddp::store_server server{resolve("127.0.0.1", 0, 0, true).front(), 0};
  ddp::store_client client{"127.0.0.1", server.port(), 0, ddp_fuzz::soon()};
  std::uint64_t round = 0;

  /// Returns once the server has finished a loop iteration that began after this call: three
  /// round trips, because a connection accepted in one iteration is first polled in the next.
  void sync() {
    for (int i = 0; i < 3; ++i) client.check("fuzz/sync", ddp_fuzz::soon());
  }
};

/// The server of the current round. A fresh one now and then, so that the keys earlier inputs
/// stored do not pile up over a long run.
fixture& fx() {
  static fixture* f = nullptr;  // never destroyed at exit: its server thread outlives statics
  static unsigned uses = 0;
  if (uses++ % 4096 == 0) {
    delete f;
    f = new fixture;
  }
  return *f;
}

/// What the server must conclude about a stream: whether it must drop the client, and whether
/// it may (the stream parks so many get/wait requests that it may hit store_max_waiting,
/// depending on which keys exist).
struct verdict {
  bool must = false;
  bool may = false;
};

verdict must_drop(std::string_view bytes) {
  std::string in(bytes);
  std::size_t parkable = 0;
  verdict v;
  for (;;) {
    std::uint32_t len = 0;
    const auto hr = check_header(in, len);
    if (hr == parse_result::need_more) break;
    frame f;
    if (hr == parse_result::invalid || parse_body(std::string_view(in).substr(4, len), f) != parse_result::ok ||
        !valid_request(f)) {
      v.must = true;
      break;
    }
    in.erase(0, 4 + static_cast<std::size_t>(len));
    if (f.code == static_cast<std::uint8_t>(store_cmd::get) || f.code == static_cast<std::uint8_t>(store_cmd::wait))
      ++parkable;
  }
  v.may = v.must || parkable >= store_max_waiting;
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto& f = fx();
  ddp_fuzz::reader in(data, size);
  const std::size_t reads = 1 + in.byte() % 4;
  const auto bytes = in.rest();
  // A client the server stops serving is either dropped (malformed request) or refused (it
  // offered a handshake this server does not take); either way the parser must reject it too.
  const int gone_before = f.server.dropped() + f.server.refused();

  {
    const auto stray = ddp_fuzz::connect_loopback(f.server.port());
    const std::size_t step = bytes.size() / reads + 1;
    for (std::size_t pos = 0; pos < bytes.size(); pos += step) {
      ddp_fuzz::send_bytes(stray.get(), bytes.substr(pos, step));
      f.sync();
    }
    f.sync();
    const int gone = f.server.dropped() + f.server.refused() - gone_before;
    const auto v = must_drop(bytes);
    ddp_fuzz::require(gone == 0 || gone == 1, "one client dropped more than once");
    ddp_fuzz::require(!v.must || gone == 1, "server kept a client whose stream the parser rejects");
    ddp_fuzz::require(v.may || gone == 0, "server dropped a client whose stream the parser accepts");
  }  // the stray client hangs up here, possibly with requests still waiting

  // A real client is still served correctly.
  const std::string key = "fuzz/sentinel";
  const std::string value = std::to_string(++f.round);
  f.client.set(key, value, ddp_fuzz::soon());
  ddp_fuzz::require(f.client.get(key, ddp_fuzz::soon()) == value, "store returned a wrong value");
  f.sync();
  ddp_fuzz::require(f.server.clients() == 1, "closed clients are not reaped");
  return 0;
}
