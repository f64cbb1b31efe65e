#pragma once
// IWYU pragma: private
// Full mesh of TCP connections between the ranks of a group, set up through the store: every
// rank listens on the interface that reaches the master, announces "host port" under
// `<prefix>/addr/<rank>`, accepts from higher ranks and connects to lower ones. A hello frame
// (magic, group id, rank) makes sure a stray connection is not mistaken for a peer.

#include <cstdint>
#include <string>
#include <vector>

#include "../error.hpp"
#include "../store.hpp"
#include "socket.hpp"

namespace ddp {
inline namespace v0 {
namespace detail {

inline constexpr std::uint32_t mesh_magic = 0x30504444u;  // "DDP0"

struct mesh_hello {
  std::uint32_t magic;
  std::uint32_t rank;
  std::uint32_t size;
  std::uint32_t pad;
  std::uint64_t group;
};

/// Connects every pair of ranks. Returns one socket per peer (invalid at [rank]).
inline std::vector<fd_handle> connect_mesh(store_client& store, int rank, int size, const std::string& prefix,
                                           std::uint64_t group, deadline_t until, int bufsize = 4 << 20) {
  std::vector<fd_handle> peers(static_cast<std::size_t>(size));
  if (size == 1) return peers;
  // Listen on the address our store connection leaves from: the interface that reaches the
  // master (loopback when the master is on loopback).
  sockaddr_storage local = local_address(store.native_handle());
  endpoint ep;
  ep.addr = local;
  ep.len = local.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  if (local.ss_family == AF_INET) reinterpret_cast<sockaddr_in&>(ep.addr).sin_port = 0;
  else reinterpret_cast<sockaddr_in6&>(ep.addr).sin6_port = 0;
  fd_handle lfd = listen_on(ep, rank);
  const auto me = local_address(lfd.get());
  store.set(prefix + "/addr/" + std::to_string(rank), to_string(me) + " " + std::to_string(port_of(me)), until);

  std::vector<std::string> keys;
  for (int r = 0; r < rank; ++r) keys.push_back(prefix + "/addr/" + std::to_string(r));
  if (!keys.empty()) {
    auto missing = store.wait(keys, until);
    if (!missing.empty()) {
      std::string names;
      for (auto& k : missing) names += (names.empty() ? "" : ", ") + k.substr(k.rfind('/') + 1);
      raise(errc::timeout, rank, "ranks " + names + " never announced their address");
    }
  }
  std::error_code ec;
  for (int r = 0; r < rank; ++r) {
    const auto v = store.get(prefix + "/addr/" + std::to_string(r), until);
    const auto sp = v.rfind(' ');
    const auto eps = resolve(v.substr(0, sp), std::stoi(v.substr(sp + 1)), rank);
    auto fd = connect_retry(eps, until, ec);
    if (!fd) raise(to_errc(ec) == errc::timeout ? errc::timeout : errc::peer_lost, rank,
                   "cannot connect to rank " + std::to_string(r) + " at " + v + ": " + describe(ec));
    tune_stream(fd.get(), bufsize);
    mesh_hello h{mesh_magic, static_cast<std::uint32_t>(rank), static_cast<std::uint32_t>(size), 0, group};
    send_all(fd.get(), &h, sizeof h, until, ec);
    if (ec) raise(errc::peer_lost, rank, "handshake with rank " + std::to_string(r) + ": " + describe(ec));
    peers[static_cast<std::size_t>(r)] = std::move(fd);
  }
  int expected = size - 1 - rank;
  while (expected > 0) {
    auto fd = accept_until(lfd.get(), until, ec);
    if (!fd) {
      std::string names;
      for (int r = rank + 1; r < size; ++r)
        if (!peers[static_cast<std::size_t>(r)]) names += (names.empty() ? "" : ", ") + std::to_string(r);
      raise(errc::timeout, rank, "ranks " + names + " never connected");
    }
    mesh_hello h{};
    recv_all(fd.get(), &h, sizeof h, until, ec);
    // Anything that is not a hello from a member of this group is dropped and ignored.
    if (ec || h.magic != mesh_magic || h.group != group || h.size != static_cast<std::uint32_t>(size) ||
        h.rank <= static_cast<std::uint32_t>(rank) || h.rank >= static_cast<std::uint32_t>(size) ||
        peers[h.rank])
      continue;
    tune_stream(fd.get(), bufsize);
    peers[h.rank] = std::move(fd);
    --expected;
  }
  return peers;
}

}  // namespace detail
}  // namespace v0
}  // namespace ddp
