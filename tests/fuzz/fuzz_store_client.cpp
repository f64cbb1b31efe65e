// A real store_client talking to a fake store that answers with arbitrary bytes (a broken or
// hostile master, or a stranger on the master's port).
// Property: every call either returns or throws ddp::error; nothing else escapes (an uncaught
// std::out_of_range or a crash fails the input), and no allocation exceeds the frame limit.
//
// Input: one byte that chooses the call, then the fake store's answer. The fake store sends
// the answer and hangs up, so a short answer ends the call at once with peer_lost.

#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/store.hpp>

#include <optional>
#include <thread>

#include "fuzz_common.hpp"

namespace {

using namespace ddp::detail;

struct fake_store {
  fd_handle listener = listen_on(resolve("127.0.0.1", 0, 0, true).front(), 0);
  int port = port_of(local_address(listener.get()));
};

fake_store& fx() {
  static auto* f = new fake_store;
  return *f;
}

void call(ddp::store_client& c, std::uint8_t which) {
  const auto until = ddp_fuzz::soon(std::chrono::seconds(2));
  switch (which % 8) {
    case 0: c.set("k", "v", until); break;
    case 1: (void)c.get("k", until); break;
    case 2: (void)c.add("k", 1, until); break;
    case 3: (void)c.compare_set("k", "", "v", until); break;
    case 4: (void)c.erase("k", until); break;
    case 5: (void)c.check("k", until); break;
    case 6: (void)c.wait({"a", "b"}, until); break;
    default: (void)c.erase_prefix("p/", until); break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto& f = fx();
  ddp_fuzz::reader in(data, size);
  const std::uint8_t which = in.byte();
  const auto answer = in.rest();

  // The client's constructor waits for the answer to its hello (a check), so the fake store
  // answers from another thread: ok to the hello, then the fuzzed answer, then it hangs up.
  // Small answers fit the socket buffer: all is sent before the client asks.
  fd_handle server_side;
  std::thread fake([&] {
    std::error_code ec;
    server_side = accept_until(f.listener.get(), ddp_fuzz::soon(), ec);
    if (!server_side) return;
    ddp_fuzz::send_bytes(server_side.get(), encode_frame(static_cast<std::uint8_t>(store_status::ok), {"0"}));
    ddp_fuzz::send_bytes(server_side.get(), answer);
    ::shutdown(server_side.get(), SHUT_WR);
  });
  std::optional<ddp::store_client> made;
  try {
    made.emplace("127.0.0.1", f.port, 0, ddp_fuzz::soon());
  } catch (const ddp::error&) {
  }
  fake.join();
  ddp_fuzz::require(made.has_value() && static_cast<bool>(server_side), "fake store cannot serve the hello");
  auto& client = *made;
  try {
    call(client, which);
  } catch (const ddp::error&) {
    // The expected outcome for most answers: a protocol, peer_lost or timeout error.
  }
  return 0;
}
