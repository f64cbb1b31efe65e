#pragma once
// IWYU pragma: private
// Full mesh of TCP connections between the ranks of a group, set up through the store: every
// rank listens on the interface that reaches the master, announces "host port" under
// `<prefix>/addr/<rank>`, accepts from higher ranks and connects to lower ones. A hello frame
// (magic, group id, rank) makes sure a stray connection is not mistaken for a peer; when the
// store connection is authenticated, the hello is the challenge-response of handshake.hpp
// instead, so only holders of the secret get in. Incoming connections are served from one poll
// loop, so a stranger that connects and stalls does not hold up the real peers.

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "../error.hpp"
#include "../store.hpp"
#include "handshake.hpp"
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

/// Accepts the higher ranks of the mesh on `lfd` until each has arrived. Connections that are
/// not a valid hello (or that fail authentication, or stall past the handshake limit) are
/// dropped, all from one poll loop so none of them delays the others.
inline void accept_peers(int lfd, std::vector<fd_handle>& peers, const authenticator* auth, int rank, int size,
                         std::uint64_t group, deadline_t until, int bufsize,
                         const std::function<bool()>& group_failed = {}) {
#ifdef POLLRDHUP
  constexpr short poll_rdhup = POLLRDHUP;
#else
  constexpr short poll_rdhup = 0;
#endif
  std::vector<bool> closed(static_cast<std::size_t>(size), false);
  auto next_ask = clock::now() + std::chrono::milliseconds(100);
  struct pending {
    fd_handle fd;
    std::string in, out;
    std::optional<auth_responder> hs;
    deadline_t limit;
  };
  constexpr std::size_t max_pending = 256;
  std::vector<pending> pend;
  int expected = size - 1 - rank;
  auto admit = [&](std::uint32_t from, std::uint32_t to, std::uint32_t sz, std::uint64_t grp) {
    return grp == group && sz == static_cast<std::uint32_t>(size) && to == static_cast<std::uint32_t>(rank) &&
           from > static_cast<std::uint32_t>(rank) && from < static_cast<std::uint32_t>(size) && !peers[from];
  };
  while (expected > 0) {
    if (clock::now() >= until) {
      std::string names;
      for (int r = rank + 1; r < size; ++r)
        if (!peers[static_cast<std::size_t>(r)]) names += (names.empty() ? "" : ", ") + std::to_string(r);
      raise(errc::timeout, rank,
            (names.find(',') == std::string::npos ? "rank " : "ranks ") + names + " never connected");
    }
    std::vector<pollfd> pfds{{lfd, POLLIN, 0}};
    int timeout = ms_left(until);
    for (auto& p : pend) {
      pfds.push_back({p.fd.get(), POLLIN, 0});
      timeout = std::min(timeout, ms_left(p.limit) + 1);
    }
    // While waiting, ask `group_failed` now and then whether a rank recorded a failure (the
    // ranks still awaited may have failed, or be waiting for one that did): then stop now, for
    // the caller to report that failure, instead of blaming the awaited ranks at the deadline.
    // A peer connected already that closes its end is a reason to ask at once. (Data from such
    // a peer is its traffic: not read here.)
    const std::size_t first_peer = pfds.size();
    if (group_failed) {
      timeout = std::min(timeout, 100);
      for (int r = 0; r < size; ++r)
        if (r != rank && peers[static_cast<std::size_t>(r)] && !closed[static_cast<std::size_t>(r)])
          pfds.push_back({peers[static_cast<std::size_t>(r)].get(), poll_rdhup, 0});
    }
    ::poll(pfds.data(), pfds.size(), std::max(timeout, 1));
    bool ask = group_failed && clock::now() >= next_ask;
    for (std::size_t i = first_peer; i < pfds.size(); ++i)
      if (pfds[i].revents & (poll_rdhup | POLLHUP | POLLERR)) {
        for (int r = 0; r < size; ++r)
          if (peers[static_cast<std::size_t>(r)].get() == pfds[i].fd) closed[static_cast<std::size_t>(r)] = true;
        ask = group_failed != nullptr;
      }
    if (ask) {
      next_ask = clock::now() + std::chrono::milliseconds(100);
      if (group_failed()) {
        std::string names;
        for (int r = rank + 1; r < size; ++r)
          if (!peers[static_cast<std::size_t>(r)]) names += (names.empty() ? "" : ", ") + std::to_string(r);
        raise(errc::peer_lost, rank,
              "the group failed while this rank waited for " +
                  std::string(names.find(',') == std::string::npos ? "rank " : "ranks ") + names + " to connect");
      }
    }
    pfds.resize(first_peer);
    // Pending connections first (pfds[i + 1] is pend[i]); new ones are appended after.
    std::vector<bool> drop(pend.size(), false);
    for (std::size_t i = 0; i < pend.size(); ++i) {
      auto& p = pend[i];
      if (clock::now() >= p.limit) { drop[i] = true; continue; }
      if (!(pfds[i + 1].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      // Read only what the current step needs: whatever follows belongs to the peer's traffic.
      std::size_t want = sizeof(mesh_hello);
      if (p.hs) want = p.hs->current() == auth_responder::state::hello ? auth_hello_size : auth_proof_size;
      char buf[auth_hello_size];
      const ssize_t k = ::recv(p.fd.get(), buf, want - p.in.size(), 0);
      if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) { drop[i] = true; continue; }
      if (k < 0) continue;
      p.in.append(buf, static_cast<std::size_t>(k));
      if (!p.hs) {
        if (p.in.size() < sizeof(mesh_hello)) continue;
        mesh_hello h{};
        std::memcpy(&h, p.in.data(), sizeof h);
        drop[i] = true;
        if (h.magic != mesh_magic || !admit(h.rank, static_cast<std::uint32_t>(rank), h.size, h.group)) continue;
        tune_stream(p.fd.get(), bufsize);
        peers[h.rank] = std::move(p.fd);
        --expected;
        continue;
      }
      const auto st = p.hs->feed(p.in, p.out, [&](const auth_hello& h) { return admit(h.from, h.to, h.size, h.group); });
      if (!p.out.empty()) {
        // One short message at a time, into an empty socket buffer: this does not block.
        std::error_code ec;
        send_all(p.fd.get(), p.out.data(), p.out.size(), std::min(until, clock::now() + std::chrono::seconds(1)), ec);
        p.out.clear();
        if (ec) { drop[i] = true; continue; }
      }
      if (st == auth_responder::state::done) {
        tune_stream(p.fd.get(), bufsize);
        peers[p.hs->hello().from] = std::move(p.fd);
        --expected;
        drop[i] = true;
      } else if (st == auth_responder::state::failed || st == auth_responder::state::foreign) {
        drop[i] = true;
      }
    }
    std::size_t j = 0;
    for (std::size_t i = 0; i < pend.size(); ++i) {
      if (drop[i]) continue;
      if (i != j) pend[j] = std::move(pend[i]);  // never self-move: it may empty the strings
      ++j;
    }
    pend.resize(j);
    if (pfds[0].revents & POLLIN) {
      for (;;) {
        const int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) break;
        // A flood of strangers pushes out the oldest of them, never the listener.
        if (pend.size() >= max_pending) pend.erase(pend.begin());
        pending p{fd_handle(fd), {}, {}, std::nullopt, clock::now() + auth_handshake_limit};
        if (auth) p.hs.emplace(auth, auth_kind::mesh);
        pend.push_back(std::move(p));
      }
    }
  }
}

/// Connects every pair of ranks into `peers`: one socket per peer (invalid at [rank]). When it
/// throws, the connections made so far stay in `peers`, open: the caller records why before
/// it closes them, so that a peer which sees the connection close finds the reason first.
/// `group_failed`, when given, says whether a rank recorded a failure (or the store is gone):
/// waiting for peers to connect then stops early (errc::peer_lost), for the caller to report it.
inline void connect_mesh(std::vector<fd_handle>& peers, store_client& store, int rank, int size,
                         const std::string& prefix, std::uint64_t group, deadline_t until, int bufsize = 4 << 20,
                         const std::function<bool()>& group_failed = {}) {
  peers.clear();
  peers.resize(static_cast<std::size_t>(size));
  if (size == 1) return;
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
      raise(errc::timeout, rank,
            (missing.size() > 1 ? "ranks " : "rank ") + names + " never announced their address");
    }
  }
  std::error_code ec;
  for (int r = 0; r < rank; ++r) {
    const auto v = store.get(prefix + "/addr/" + std::to_string(r), until);
    const auto sp = v.rfind(' ');
    int port = 0;
    const char* end = v.data() + v.size();
    if (sp == std::string::npos || std::from_chars(v.data() + sp + 1, end, port).ptr != end || port < 1 || port > 65535)
      raise(errc::protocol, rank, "rank " + std::to_string(r) + " announced a malformed address '" + v + "'");
    const auto eps = resolve(v.substr(0, sp), port, rank);
    // The peer listened before it announced, and listens until its mesh is complete: a refused
    // connection means it is gone, so say so now instead of retrying until the deadline.
    fd_handle fd;
    for (const auto& ep : eps)
      if ((fd = try_connect(ep, until, ec)) || ec != std::errc::connection_refused) break;
    if (!fd && ec == std::errc::connection_refused)
      raise(errc::peer_lost, rank,
            "rank " + std::to_string(r) + " is gone: its announced address " + v + " refused the connection");
    if (!fd) fd = connect_retry(eps, until, ec);
    if (!fd) raise(to_errc(ec) == errc::timeout ? errc::timeout : errc::peer_lost, rank,
                   "cannot connect to rank " + std::to_string(r) + " at " + v + ": " + describe(ec));
    tune_stream(fd.get(), bufsize);
    if (const authenticator* auth = store.auth().get()) {
      auth_hello h;
      h.kind = auth_kind::mesh;
      h.from = static_cast<std::uint32_t>(rank);
      h.to = static_cast<std::uint32_t>(r);
      h.size = static_cast<std::uint32_t>(size);
      h.group = group;
      auth_initiate(fd.get(), *auth, h, until, rank, "rank " + std::to_string(r) + " at " + v);
    } else {
      mesh_hello h{mesh_magic, static_cast<std::uint32_t>(rank), static_cast<std::uint32_t>(size), 0, group};
      send_all(fd.get(), &h, sizeof h, until, ec);
      if (ec) raise(errc::peer_lost, rank, "handshake with rank " + std::to_string(r) + ": " + describe(ec));
    }
    peers[static_cast<std::size_t>(r)] = std::move(fd);
  }
  accept_peers(lfd.get(), peers, store.auth().get(), rank, size, group, until, bufsize, group_failed);
}

/// The same, returning the sockets (closed at once when it throws).
inline std::vector<fd_handle> connect_mesh(store_client& store, int rank, int size, const std::string& prefix,
                                           std::uint64_t group, deadline_t until, int bufsize = 4 << 20) {
  std::vector<fd_handle> peers;
  connect_mesh(peers, store, rank, size, prefix, group, until, bufsize);
  return peers;
}

}  // namespace detail
}  // namespace v0
}  // namespace ddp
