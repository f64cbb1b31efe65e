#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// Connections between the ranks of a group, made lazily: a rank connects to a peer the first
// time it talks to it, so a ring or a tree over thousands of ranks holds a handful of sockets
// per rank, not thousands. Every rank listens on one port (its link hub, link_hub.hpp, served by
// the group's reactor) and announces "host port" for each channel through a directory (the
// group's store); the hub takes a peer's connection whatever this rank's own thread is doing.
//
// Either side may connect first, and both may at once. One socket per pair survives: when both
// attempts meet, the one made by the lower rank wins. The acceptor answers each attempt with
// one byte after the handshake: link_accepted, or link_duplicate (this side is connecting too
// and its attempt wins, or a connection exists); an initiator told "duplicate" waits for the
// acceptor to hand over the peer's connection, which is then on its way. A peer whose attempt
// is dropped before its verdict (a crowd of strangers at the hub) tries again until its
// deadline.

#include <algorithm>
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <ddp/auth.hpp>
#include <ddp/error.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/group/detail/handshake.hpp>
#include <ddp/group/detail/link_hub.hpp>
#include <ddp/detail/socket.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/group/detail/keys.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Where ranks announce their listening address, and how a rank looks a peer's up.
struct link_directory {
  std::function<void(const std::string& key, const std::string& value)> publish;
  /// The value of `key` if it exists now (a short request), else nullopt.
  std::function<std::optional<std::string>(const std::string& key)> lookup;
};

/// One channel's connections, made on first use; the peers' connections arrive through `hub`
/// (the rank's one listening port). Thread-safe: any thread may ask for a link.
class peer_links final : public link_sink {
 public:
  /// Opens the channel `channel` on `hub` and announces the hub's address under
  /// `<prefix>/addr/<rank>`. `group_failed`, when given, says whether a rank recorded a failure: a
  /// wait for a peer's connection then stops early (errc::peer_lost) instead of blaming that peer
  /// at its deadline.
  peer_links(link_hub& hub, link_directory dir, int size, std::string prefix, std::uint64_t channel,
             int bufsize = 4 << 20, std::function<bool()> group_failed = {})
      : sync_(std::make_unique<sync>()),
        mu_(sync_->mu),
        cv_(sync_->cv),
        hub_(hub),
        dir_(std::move(dir)),
        auth_(hub.auth()),
        rank_(hub.rank()),
        size_(size),
        prefix_(std::move(prefix)),
        group_(channel),
        bufsize_(bufsize),
        group_failed_(std::move(group_failed)) {
    if (size_ == 1) return;
    hub_.attach(group_, *this);
    attached_ = true;
    try {
      dir_.publish(keys::address(prefix_, rank_), hub_.address());
    } catch (...) {
      stop();
      throw;
    }
  }
  peer_links(const peer_links&) = delete;
  peer_links& operator=(const peer_links&) = delete;
  ~peer_links() override { stop(); }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }

  /// The socket connected to `peer`, connecting first when there is none. Throws errc::timeout
  /// (no connection before `until`), errc::peer_lost (the peer is gone, or the group failed
  /// meanwhile, see shutdown()), errc::auth_failed.
  int get(int peer, deadline_t until) {
    if (peer < 0 || peer >= size_ || peer == rank_)
      raise(errc::invalid_argument, rank_,
            "no connection to rank " + std::to_string(peer) + " in a group of " + std::to_string(size_));
    std::unique_lock lk(mu_);
    auto& s = slots_[peer];
    backoff wait;  // between attempts the peer's hub dropped before their verdict
    for (;;) {
      if (s.state == link::ready) return s.fd.get();
      if (shut_)
        raise(errc::peer_lost, rank_,
              "the group failed before a connection to rank " + std::to_string(peer) + " was made");
      if (s.state == link::none) {
        s.state = link::connecting;
        lk.unlock();
        attempt_result r{};
        try {
          r = attempt(peer, until);
        } catch (...) {
          lk.lock();
          if (s.state == link::connecting) s.state = link::none;
          cv_.notify_all();
          throw;
        }
        lk.lock();
        if (r.verdict == link_accepted) {
          s.fd = std::move(r.fd);
          s.state = link::ready;
          cv_.notify_all();
          if (shut_) {
            // shutdown() ran while this attempt was in flight: this link must not escape it.
            ::shutdown(s.fd.get(), SHUT_RDWR);
            raise(errc::peer_lost, rank_,
                  "the group failed before a connection to rank " + std::to_string(peer) + " was made");
          }
          return s.fd.get();
        }
        if (r.verdict == link_duplicate) {
          // The peer's own attempt wins and is on its way to our acceptor (or already here).
          if (s.state == link::connecting) s.state = link::awaiting;
        } else if (s.state == link::connecting) {
          // Dropped before its verdict (a crowd of strangers at the peer's listener): again.
          s.state = link::none;
          cv_.notify_all();
          lk.unlock();
          if (!wait.pause(until))
            raise(errc::timeout, rank_,
                  "could not connect to rank " + std::to_string(peer) +
                      " before the deadline (its listener dropped every attempt)");
          lk.lock();
        }
        continue;
      }
      // Another of our threads is connecting, or the peer's connection is on its way.
      const auto step = std::min(until, clock::now() + timing::link_wait_slice);
      if (cv_.wait_until(lk, step) == std::cv_status::timeout) {
        if (s.state == link::ready) continue;
        if (clock::now() >= until) raise(errc::timeout, rank_, "rank " + std::to_string(peer) + " never connected");
        if (s.state == link::awaiting && clock::now() >= s.next_probe) {
          // A peer that died after promising its connection never sends it; its listener,
          // closed with it, refuses. Ask now and then rather than wait for the deadline.
          s.next_probe = clock::now() + timing::link_probe_every;
          const std::string addr = s.addr;
          lk.unlock();
          const bool gone = refuses(addr);
          lk.lock();
          if (gone && s.state != link::ready)
            raise(errc::peer_lost, rank_,
                  "rank " + std::to_string(peer) + " is gone: its announced address " + addr +
                      " refused the connection it had promised");
        }
        if (group_failed_) {
          lk.unlock();
          const bool failed = group_failed_();
          lk.lock();
          if (failed && s.state != link::ready) group_failed_while_waiting(peer);
        }
      }
    }
  }

  /// The socket to `peer` when connected, else -1 (never connects).
  int connected(int peer) const noexcept {
    if (owner_.forked()) return -1;  // the parent's connections; its threads may hold the lock
    std::lock_guard lk(mu_);
    if (peer < 0 || peer >= size_) return -1;
    const auto it = slots_.find(peer);
    return it != slots_.end() && it->second.state == link::ready ? it->second.fd.get() : -1;
  }

  /// Number of peers connected now.
  int connections() const noexcept {
    if (owner_.forked()) return 0;
    std::lock_guard lk(mu_);
    return static_cast<int>(
        std::count_if(slots_.begin(), slots_.end(), [](const auto& kv) { return kv.second.state == link::ready; }));
  }

  /// Shuts every connection down (peers blocked on this rank wake) and stops new ones: later
  /// get() calls for a peer not yet connected raise errc::peer_lost.
  void shutdown() noexcept {
    if (owner_.forked()) return;  // never shut the parent's connections from a child
    std::lock_guard lk(mu_);
    shut_ = true;
    for (auto& [peer, s] : slots_)
      if (s.fd) ::shutdown(s.fd.get(), SHUT_RDWR);
    cv_.notify_all();
  }

 private:
  enum class link { none, connecting, awaiting, ready };
  struct slot {
    link state = link::none;
    fd_handle fd;
    std::string addr;  // the peer's announced address, once looked up
    deadline_t next_probe{};
  };
  struct attempt_result {
    fd_handle fd;
    char verdict = 0;  // 0: dropped before the verdict
  };

  void stop() noexcept {
    if (!attached_) return;
    attached_ = false;
    // In a forked child the hub's thread is the parent's and does not exist here, and the
    // parent's threads may have been inside the mutex or waiting on the condition variable at the
    // fork (destroying it would wait for them forever). Only this process's copies of the
    // descriptors close.
    if (owner_.forked()) {
      abandon(std::move(sync_));
      return;
    }
    hub_.detach(group_, *this);
  }

  [[noreturn]] void group_failed_while_waiting(int peer) const {
    raise(errc::peer_lost, rank_,
          "the group failed while this rank waited for rank " + std::to_string(peer) + " to connect");
  }

  /// True when the announced address `v` refuses a connection: the peer's process is gone.
  bool refuses(const std::string& v) const {
    try {
      const auto sp = v.rfind(' ');
      if (sp == std::string::npos) return false;
      const auto eps = resolve(v.substr(0, sp), std::atoi(v.c_str() + sp + 1), rank_);
      std::error_code ec;
      for (const auto& ep : eps) {
        // Closed at once: the peer's acceptor sees a connection that ends before its hello.
        auto fd = try_connect(ep, clock::now() + timing::link_probe_connect, ec);
        if (fd || ec != std::errc::connection_refused) return false;
      }
      return !eps.empty();
    } catch (...) {
      return false;
    }
  }

  /// One connection attempt to `peer`, through the handshake, up to the acceptor's verdict.
  attempt_result attempt(int peer, deadline_t until) {
    const std::string key = keys::address(prefix_, peer);
    std::string v;
    {
      std::lock_guard lk(mu_);
      v = slots_[peer].addr;
    }
    auto pause = timing::lookup_pause;
    for (int round = 0; v.empty(); ++round) {
      // The peer announces its address when it opens this channel; it may not have yet. Ask
      // with short requests (the directory may be shared with other threads), and between
      // them see whether the peer's own connection arrived meanwhile, or the group failed.
      if (auto a = dir_.lookup(key)) {
        v = std::move(*a);
        std::lock_guard lk(mu_);
        slots_[peer].addr = v;
        break;
      }
      {
        std::lock_guard lk(mu_);
        if (slots_[peer].state == link::ready) return {};  // the peer connected to us: done
      }
      if (clock::now() >= until)
        raise(errc::timeout, rank_, "rank " + std::to_string(peer) + " never connected (it never opened this channel)");
      if (group_failed_ && round % 8 == 7 && group_failed_()) group_failed_while_waiting(peer);
      std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(pause, until - clock::now()));
      pause = std::min(pause * 2, timing::lookup_pause_max);
    }
    const auto sp = v.rfind(' ');
    int port = 0;
    const char* end = v.data() + v.size();
    if (sp == std::string::npos || std::from_chars(v.data() + sp + 1, end, port).ptr != end || port < 1 || port > 65535)
      raise(errc::protocol, rank_, "rank " + std::to_string(peer) + " announced a malformed address '" + v + "'");
    const auto eps = resolve(v.substr(0, sp), port, rank_);
    // The peer listened before it announced, and listens for as long as it is in the group: a
    // refused connection means it is gone, so say so now instead of retrying until the deadline.
    std::error_code ec;
    fd_handle fd;
    for (const auto& ep : eps)
      if ((fd = try_connect(ep, until, ec)) || ec != std::errc::connection_refused) break;
    if (!fd && ec == std::errc::connection_refused)
      raise(errc::peer_lost, rank_,
            "rank " + std::to_string(peer) + " is gone: its announced address " + v + " refused the connection");
    if (!fd) fd = connect_retry(eps, until, ec);
    if (!fd)
      raise(to_errc(ec) == errc::timeout ? errc::timeout : errc::peer_lost, rank_,
            "cannot connect to rank " + std::to_string(peer) + " at " + v + ": " + describe(ec));
    tune_stream(fd.get(), bufsize_);
    attempt_result r;
    if (auth_) {
      auth_hello h;
      h.kind = auth_kind::mesh;
      h.from = static_cast<std::uint32_t>(rank_);
      h.to = static_cast<std::uint32_t>(peer);
      h.size = static_cast<std::uint32_t>(size_);
      h.group = group_;
      try {
        auth_initiate(fd.get(), *auth_, h, until, rank_, "rank " + std::to_string(peer) + " at " + v);
      } catch (const error& e) {
        if (e.condition() == errc::peer_lost) return r;  // dropped mid-handshake: try again
        throw;
      }
    } else {
      mesh_hello h{mesh_magic, static_cast<std::uint32_t>(rank_), static_cast<std::uint32_t>(size_),
                   static_cast<std::uint32_t>(peer), group_};
      send_all(fd.get(), &h, sizeof h, until, ec);
      if (ec) {
        if (to_errc(ec) == errc::peer_lost) return r;
        raise(to_errc(ec) == errc::timeout ? errc::timeout : errc::peer_lost, rank_,
              "handshake with rank " + std::to_string(peer) + ": " + describe(ec));
      }
    }
    char verdict = 0;
    recv_all(fd.get(), &verdict, 1, until, ec);
    if (ec) {
      if (to_errc(ec) == errc::peer_lost) return r;
      raise(errc::timeout, rank_, "rank " + std::to_string(peer) + " never answered this rank's connection");
    }
    if (verdict != link_accepted && verdict != link_duplicate)
      raise(errc::protocol, rank_, "rank " + std::to_string(peer) + " answered a connection with a bad verdict");
    r.verdict = verdict;
    if (verdict == link_accepted) r.fd = std::move(fd);
    return r;
  }

  /// The hub's hand-over of a proven connection from `from` (on the reactor's thread): takes
  /// `fd` when accepted, and answers the initiator either way.
  void take(std::uint32_t from, fd_handle& fd) override {
    std::lock_guard lk(mu_);
    auto& s = slots_[static_cast<int>(from)];
    const bool accepted = !shut_ && (s.state == link::none || s.state == link::awaiting ||
                                     (s.state == link::connecting && static_cast<int>(from) < rank_));
    const char verdict = accepted ? link_accepted : link_duplicate;
    // One byte into an empty socket buffer: this does not block.
    [[maybe_unused]] auto k = ::send(fd.get(), &verdict, 1, MSG_NOSIGNAL);
    if (accepted) {
      tune_stream(fd.get(), bufsize_);
      s.fd = std::move(fd);
      s.state = link::ready;
      cv_.notify_all();
    }
  }

  bool admit(std::uint32_t from, std::uint32_t to, std::uint32_t sz) const override {
    return sz == static_cast<std::uint32_t>(size_) && to == static_cast<std::uint32_t>(rank_) &&
           from < static_cast<std::uint32_t>(size_) && from != static_cast<std::uint32_t>(rank_);
  }

  struct sync {
    std::mutex mu;
    std::condition_variable cv;
  };
  std::unique_ptr<sync> sync_;  // on the heap: a forked child abandons it (stop())
  std::mutex& mu_;
  std::condition_variable& cv_;
  link_hub& hub_;
  link_directory dir_;
  std::shared_ptr<const authenticator> auth_;
  int rank_;
  int size_;
  std::string prefix_;
  std::uint64_t group_;
  int bufsize_;
  std::function<bool()> group_failed_;
  std::unordered_map<int, slot> slots_;  // only the peers this rank has dealt with (node-stable)

  bool shut_ = false;
  bool attached_ = false;
  owner_process owner_;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
