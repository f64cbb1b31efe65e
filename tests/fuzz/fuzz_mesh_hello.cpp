// The accepting side of the transport handshake: rank 0 of a two-rank group opens the real
// detail::peer_links while a stranger connects first and sends arbitrary bytes, then either
// hangs up or stays connected and silent; then the real rank 1 connects to rank 0.
// Properties: nothing crashes; a stranger that stalls holds nobody up; both ranks end with a
// connection to each other; and rank 0's connection really is rank 1's unless the stranger sent
// a hello that a member could have sent (right magic, rank, size and group: without a secret
// nothing else proves membership). With authentication that exception goes: the responder's
// side of the challenge-response is fuzzed by fuzz_auth_handshake.cpp.
//
// Input: a mode byte (bit 0: the stranger stays connected), then the stranger's bytes.

#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/group/detail/mesh.hpp>
#include <ddp/store.hpp>
#include <ddp/group/detail/rendezvous.hpp>

#include <cstring>
#include <thread>

#include "fuzz_common.hpp"

namespace {

using namespace ddp::detail;

constexpr std::uint64_t group = 0x6a0b5e11f00dull;

struct fixture {
  ddp::store_server server{ddp::endpoint{"127.0.0.1", 0}, 0};
  ddp::store_client rank0{"127.0.0.1", server.port(), 0, ddp_fuzz::soon()};
  ddp::store_client rank1{"127.0.0.1", server.port(), 1, ddp_fuzz::soon()};
  reactor loop{0, "fuzz"};  // the ranks' background thread, shared by both (one process)
  std::uint64_t round = 0;
};

fixture& fx() {
  static auto* f = new fixture;  // never destroyed: the server thread outlives static destructors
  return *f;
}

/// Whether `bytes` start with a hello that rank 0 of this group accepts from rank 1.
bool member_hello(std::string_view bytes) {
  if (bytes.size() < sizeof(mesh_hello)) return false;
  mesh_hello h;
  std::memcpy(&h, bytes.data(), sizeof h);
  return h.magic == mesh_magic && h.rank == 1 && h.size == 2 && h.to == 0 && h.group == group;
}

/// Connects to where rank 0 announced it listens.
fd_handle connect_to_rank0(ddp::store_client& store, const std::string& prefix) {
  const auto v = store.get(prefix + "/addr/0", ddp_fuzz::soon());
  const auto sp = v.rfind(' ');
  return ddp_fuzz::connect_loopback(std::stoi(v.substr(sp + 1)));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  auto& f = fx();
  ddp_fuzz::reader in(data, size);
  const bool stays = in.byte() & 1;
  const auto bytes = in.rest();
  const std::string prefix = "fuzz/" + std::to_string(++f.round);

  // A listening port per round for each rank, as a new group would have.
  link_hub hub0{f.loop, local_address(f.rank0.native_handle()), nullptr, 0};
  link_hub hub1{f.loop, local_address(f.rank1.native_handle()), nullptr, 1};
  peer_links l0{hub0, store_directory(f.rank0, std::chrono::seconds(5)), 2, prefix, group, 0};
  auto stranger = connect_to_rank0(f.rank1, prefix);
  ddp_fuzz::send_bytes(stranger.get(), bytes);
  if (!stays) stranger.reset();  // a short hello then ends at once, not at the deadline

  if (member_hello(bytes)) {
    // Rank 0's acceptor took the stranger for rank 1. Its connection must be the stranger's:
    // what followed the hello, then the hang-up.
    const auto until = ddp_fuzz::soon();
    while (l0.connected(1) < 0 && clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const int c0 = l0.connected(1);
    ddp_fuzz::require(c0 >= 0, "rank 0 did not take a member's hello");
    const auto after = bytes.substr(sizeof(mesh_hello));
    std::string got(after.size() + 1, '\0');
    std::error_code ec;
    recv_all(c0, got.data(), after.size(), ddp_fuzz::soon(), ec);
    ddp_fuzz::require(!ec && got.substr(0, after.size()) == after, "rank 0 lost the bytes after the hello");
    stranger.reset();
    recv_all(c0, got.data(), 1, ddp_fuzz::soon(), ec);
    ddp_fuzz::require(static_cast<bool>(ec), "rank 0 took the stranger, yet hears someone else");
    return 0;
  }
  peer_links l1{hub1, store_directory(f.rank1, std::chrono::seconds(5)), 2, prefix, group, 0};
  // Rank 1 connects; a stalled stranger must not hold this up until the deadline.
  const auto t0 = clock::now();
  const int c1 = l1.get(0, ddp_fuzz::soon());
  const int c0 = l0.get(1, ddp_fuzz::soon());
  ddp_fuzz::require(clock::now() - t0 < std::chrono::seconds(2), "a stranger held the real peers up");

  // Rank 1 speaks; rank 0 must hear it on its connection to rank 1, not on the stranger's.
  const char ping = 'p';
  std::error_code ec;
  send_all(c1, &ping, 1, ddp_fuzz::soon(), ec);
  ddp_fuzz::require(!ec, "rank 1 cannot send to rank 0");
  char got = 0;
  recv_all(c0, &got, 1, ddp_fuzz::soon(), ec);
  ddp_fuzz::require(!ec && got == ping, "rank 0 let a stranger in");
  return 0;
}
