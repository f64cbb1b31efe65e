// A real store_server fed arbitrary bytes by a stray client over loopback.
// Properties: the server never crashes (sanitizers watch its thread); it stops serving the stray
// client exactly when the frame parser says the stream is malformed; closed clients are reaped; and a
// well-behaved client is served correctly after every input.
//
// With members (store_server's member_prefix, as process_group runs it): the stray client is
// never a member unless it claims a rank, so a stream without a claim changes nothing stored
// (its writes are refused with `forbidden`, which does not drop it).
//
// Input: one byte that chooses how many reads the stream is cut into (bits 0-1) and whether
// the store has members (bit 4), then the stream. Between reads the harness waits until the
// server has handled what it sent, so partial frames really arrive in separate reads.

#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/store.hpp>

#include <memory>

#include "fuzz_common.hpp"

namespace {

using namespace ddp::detail;

constexpr std::string_view member_prefix = "pg/rank/";

struct fixture {
  explicit fixture(bool members)
      : server{ddp::endpoint{"127.0.0.1", 0}, 0, nullptr, {}, std::string(members ? member_prefix : "")} {
    if (members) client.compare_set("pg/rank/0", "", "fixture", ddp_fuzz::soon());
  }
  ddp::store_server server;
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
fixture& fx(bool members) {
  static fixture* f[2] = {};  // never destroyed at exit: their server threads outlive statics
  static unsigned uses[2] = {};
  if (uses[members]++ % 4096 == 0) {
    delete f[members];
    f[members] = new fixture(members);
  }
  return *f[members];
}

/// What the server must conclude about a stream: whether it must drop the client, and whether
/// it may (the stream parks so many get/wait requests that it may hit store_max_waiting,
/// depending on which keys exist).
struct verdict {
  bool must = false;
  bool may = false;
  bool claims = false;  // holds a claim of a rank (compare_set under member_prefix from "")
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
    if (is_claim(f, member_prefix)) v.claims = true;
    if (f.code == static_cast<std::uint8_t>(store_cmd::get) || f.code == static_cast<std::uint8_t>(store_cmd::wait))
      ++parkable;
  }
  v.may = v.must || parkable >= store_max_waiting;
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  ddp_fuzz::reader in(data, size);
  const std::uint8_t mode = in.byte();
  const bool members = (mode & 0x10) != 0;
  auto& f = fx(members);
  const std::size_t reads = 1 + mode % 4;
  const auto bytes = in.rest();
  // A client the server stops serving is either dropped (malformed request) or refused (it
  // offered a handshake this server does not take); either way the parser must reject it too.
  const int gone_before = f.server.dropped() + f.server.refused();
  const std::size_t stored_before = f.server.stored_bytes();

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
    ddp_fuzz::require(!members || v.claims || f.server.stored_bytes() == stored_before,
                      "a client that never claimed a rank changed the store");
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
