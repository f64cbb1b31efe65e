#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// A rank's one listening port: every channel of the group (its mesh, its heartbeat's ring, each
// TCP transport) takes its peers' connections here, on the group's reactor. A first contact's
// hello names the channel (the group's id mixed with the channel's name, so that a late hello
// meant for a closed channel is never admitted into a new one), the initiator, the rank it means
// to reach and the group's size; with a secret the hello is the challenge-response of
// handshake.hpp instead, so only holders of the secret get in. A proven connection leaves the
// reactor and goes to its channel (a link_sink: peer_links, mesh.hpp), which answers it.
//
// Strangers are served from the same loop as the peers, under the admission policy
// (admission.hpp): capped in number (the oldest goes first) and in time, so they cannot hold up
// or crowd out a real peer; a peer whose attempt is dropped before its verdict tries again.

#include <sys/epoll.h>
#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include <ddp/auth.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/detail/socket.hpp>
#include <ddp/group/detail/admission.hpp>
#include <ddp/group/detail/handshake.hpp>
#include <ddp/group/detail/reactor.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

inline constexpr std::uint32_t mesh_magic = 0x30504444u;  // "DDP0"

/// A first contact without a secret.
struct mesh_hello {
  std::uint32_t magic;
  std::uint32_t rank;   ///< initiator
  std::uint32_t size;   ///< group size
  std::uint32_t to;     ///< rank it means to reach
  std::uint64_t group;  ///< the channel: the group's id mixed with the channel's name
};

/// The acceptor's one-byte answer after the handshake.
inline constexpr char link_accepted = 'A';
inline constexpr char link_duplicate = 'D';

/// A channel's end of the hub: says whom it admits, and takes a proven connection (answering it
/// with link_accepted or link_duplicate). Called on the reactor's thread.
class link_sink {
 public:
  virtual ~link_sink() = default;
  virtual bool admit(std::uint32_t from, std::uint32_t to, std::uint32_t size) const = 0;
  virtual void take(std::uint32_t from, fd_handle& fd) = 0;
};

/// The listening port of one rank and the handshakes of its incoming connections.
class link_hub {
 public:
  /// Listens on `local`'s address (any port) and serves on `loop`.
  link_hub(reactor& loop, const sockaddr_storage& local, std::shared_ptr<const authenticator> auth, int rank)
      : auth_(std::move(auth)), rank_(rank), acceptor_(std::make_unique<acceptor>(*this)) {
    endpoint ep;
    ep.addr = local;
    ep.len = local.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (local.ss_family == AF_INET)
      reinterpret_cast<sockaddr_in&>(ep.addr).sin_port = 0;
    else
      reinterpret_cast<sockaddr_in6&>(ep.addr).sin6_port = 0;
    listen_ = listen_on(ep, rank_, 4096);
    const auto me = local_address(listen_.get());
    address_ = to_string(me) + " " + std::to_string(port_of(me));
    on_ = std::make_unique<listener_on<acceptor>>(loop, listen_.get(), *acceptor_, reactor::begin::paused);
    on_->start();  // the acceptor reaches the reactor through on_: called only once it is set
  }
  link_hub(const link_hub&) = delete;
  link_hub& operator=(const link_hub&) = delete;
  ~link_hub() {
    if (owner_.forked()) {
      // The reactor's thread is the parent's and may have held the routes' lock at the fork.
      abandon(std::move(on_));
      abandon(std::move(acceptor_));
      return;
    }
    on_->close();  // off the reactor first, waiting for a round in progress (which may use on_)
    on_.reset();
  }

  /// "host port", as a channel announces it.
  const std::string& address() const noexcept { return address_; }
  const std::shared_ptr<const authenticator>& auth() const noexcept { return auth_; }
  int rank() const noexcept { return rank_; }

  /// Connections whose hello names `channel` go to `sink` from now on. A channel has one sink:
  /// a second is errc::usage (two transports would take each other's connections).
  void attach(std::uint64_t channel, link_sink& sink) {
    std::lock_guard lock(routes_mu_);
    if (!routes_.try_emplace(channel, &sink).second)
      raise(errc::usage, rank_,
            "channel " + std::to_string(channel) +
                " has a transport already: each transport needs a transport_context of its own (a copy takes a "
                "new channel)");
  }
  /// And no more: when this returns, `sink` is not called again.
  void detach(std::uint64_t channel, const link_sink& sink) noexcept {
    if (owner_.forked()) return;
    std::lock_guard lock(routes_mu_);
    if (auto it = routes_.find(channel); it != routes_.end() && it->second == &sink) routes_.erase(it);
  }

  /// Connections closed unserved (out of descriptors, or past the cap with no stranger to close).
  int shed() const noexcept { return acceptor_->shed.load(); }

 private:
  /// `sink` of `channel` if it admits the hello, under the routes' lock.
  bool admitted(std::uint64_t channel, std::uint32_t from, std::uint32_t to, std::uint32_t size) {
    std::lock_guard lock(routes_mu_);
    const auto it = routes_.find(channel);
    return it != routes_.end() && it->second->admit(from, to, size);
  }
  /// A proven connection leaves the reactor and goes to its channel, if that is still open.
  void hand_over(std::uint64_t channel, std::uint32_t from, std::uint32_t to, std::uint32_t size, fd_handle& fd) {
    on_->unwatch(fd.get());
    std::lock_guard lock(routes_mu_);
    const auto it = routes_.find(channel);
    if (it != routes_.end() && it->second->admit(from, to, size)) it->second->take(from, fd);
  }

  // Runs the handshakes of incoming connections, under the admission policy: past `capacity`
  // handshakes the oldest is dropped (its initiator, if a peer, tries again), and while crowded
  // they get the short limit.
  struct acceptor {
    struct pending {
      fd_handle fd;
      std::string in, out;
      std::optional<auth_responder> hs;
    };
    link_hub& hub;
    admission policy;
    std::unordered_map<std::uint64_t, pending> pend;  // by id, in order of arrival
    std::uint64_t seq = 0;
    std::atomic<int> shed{0};

    static admission_rules rules() {
      admission_rules r;
      r.capacity = 256;
      r.crowded_at = r.capacity / 4;
      return r;
    }
    explicit acceptor(link_hub& h) : hub(h), policy(rules()) {}

    bool busy() const { return false; }
    deadline_t next_due(deadline_t now) const { return policy.next_due(now, pend.size()); }
    bool listening(deadline_t now) const { return policy.listening(now); }
    void after_events(deadline_t now) {
      for (const auto& [id, why] : policy.handshakes_over(now, pend.size())) drop(id);
    }
    void drop(std::uint64_t id) {
      policy.forget(id);
      const auto it = pend.find(id);
      if (it == pend.end()) return;
      if (it->second.fd) hub.on_->unwatch(it->second.fd.get());
      pend.erase(it);  // closes the descriptor
    }
    bool evict() {
      const auto id = policy.victim();
      if (!id) return false;
      drop(*id);
      return true;
    }
    void on_listener(deadline_t now) {
      for (;;) {
        const int fd = policy.accept(
            hub.listen_.get(), now, [this] { return pend.size(); }, [this] { return evict(); }, shed);
        if (fd < 0) return;
        pending p{fd_handle(fd), {}, {}, std::nullopt};
        if (hub.auth_) p.hs.emplace(hub.auth_.get(), auth_kind::mesh);
        const auto id = ++seq;
        pend.emplace(id, std::move(p));
        policy.place(id, standing::handshaking, id, now);
        hub.on_->watch(fd, EPOLLIN, id);
      }
    }
    void on_event(std::uint64_t id, std::uint32_t ev, deadline_t) {
      auto it = pend.find(id);
      if (it == pend.end()) return;
      if (!(ev & (EPOLLIN | EPOLLHUP | EPOLLERR))) return;
      auto& p = it->second;
      // Read only what the current step needs: whatever follows belongs to the peer's traffic.
      std::size_t want = sizeof(mesh_hello);
      if (p.hs) want = p.hs->current() == auth_responder::state::hello ? auth_hello_size : auth_proof_size;
      char buf[auth_hello_size];
      const ssize_t k = ::recv(p.fd.get(), buf, want - p.in.size(), 0);
      if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return drop(id);
      if (k < 0) return;
      p.in.append(buf, static_cast<std::size_t>(k));
      if (!p.hs) {
        if (p.in.size() < sizeof(mesh_hello)) return;
        mesh_hello h{};
        std::memcpy(&h, p.in.data(), sizeof h);
        if (h.magic == mesh_magic) hub.hand_over(h.group, h.rank, h.to, h.size, p.fd);
        return drop(id);
      }
      const auto st =
          p.hs->feed(p.in, p.out, [&](const auth_hello& h) { return hub.admitted(h.group, h.from, h.to, h.size); });
      if (!p.out.empty()) {
        // One short message at a time, into an empty socket buffer: this does not block.
        [[maybe_unused]] auto s = ::send(p.fd.get(), p.out.data(), p.out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        p.out.clear();
      }
      if (st == auth_responder::state::done) {
        const auto& h = p.hs->hello();
        hub.hand_over(h.group, h.from, h.to, h.size, p.fd);
        drop(id);
      } else if (st == auth_responder::state::failed || st == auth_responder::state::foreign) {
        drop(id);
      }
    }
  };

  std::shared_ptr<const authenticator> auth_;
  int rank_;
  fd_handle listen_;
  std::string address_;
  std::mutex routes_mu_;
  std::unordered_map<std::uint64_t, link_sink*> routes_;  // by channel
  owner_process owner_;
  std::unique_ptr<acceptor> acceptor_;         // on the heap: a forked child abandons it
  std::unique_ptr<listener_on<acceptor>> on_;  // last: off the reactor before the rest goes
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
