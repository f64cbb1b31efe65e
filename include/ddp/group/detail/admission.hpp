#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// Who a listener lets in, and whom it closes to make room: the one admission policy of every
// listener of a group (the store's and each rank's mesh acceptor, docs/security.md).
//
// A listener holds connections in standings, from the stranger most readily closed to a
// connection never closed for room:
//   refused (told why, lingering) < handshaking < unconfirmed (no valid request yet)
//   < not_member (a store with members, no secret: never claimed a rank) < trusted.
// The policy:
// - room: at most `capacity` connections; a newcomer that finds none closes the stranger most
//   readily closed (the lowest standing, then the lowest order: the oldest), or is shed.
// - handshake limits: a handshake ends `handshake_limit` after its accept, and
//   `crowded_handshake_limit` after it while the listener is crowded (at least `crowded_at`
//   connections) or under pressure (out of descriptors lately): a peer finishes its hello in
//   milliseconds, a stranger stalled mid-handshake must not hold what real ranks need.
// - descriptors: out of them (EMFILE), the listener keeps to what it holds less a reserve left
//   to the rest of the process for a while, closes strangers to get there, and when none can go
//   accepts the waiting connections on a spare descriptor and closes them at once (their
//   clients see the connection closed and retry), then rests its listener rather than spin.

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ddp/clock.hpp>
#include <ddp/detail/fd.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/group/detail/handshake.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Standing of a connection at a listener: lower is closed first to make room.
enum class standing : int { refused = 0, handshaking = 1, unconfirmed = 2, not_member = 3, trusted = 4 };

/// The numbers of one listener's policy.
struct admission_rules {
  std::size_t capacity = 65536;    ///< connections held at once, handshakes included
  std::size_t crowded_at = 49152;  ///< from this many on, handshakes get the short limit
  std::chrono::milliseconds handshake_limit = auth_handshake_limit;
  std::chrono::milliseconds crowded_handshake_limit = timing::crowded_handshake_limit;
  std::size_t descriptor_reserve = 16;  ///< left to the rest of the process when out of descriptors
};

/// One listener's admission state: the strangers by standing, the descriptor pressure, the
/// listener's rest. Owned by the listener's loop thread (not thread-safe).
class admission {
 public:
  using id_type = std::uint64_t;
  /// How a handshake ended for the policy: past its usual limit, or past the short one.
  enum class ended { timed_out, crowded_out };

  explicit admission(admission_rules rules = {}) : rules_(rules) {}

  const admission_rules& rules() const noexcept { return rules_; }

  /// Records (or updates) where connection `id` stands; `order` ranks it among its standing
  /// (lower goes first; among handshakes it must be the order of arrival). Trusted connections are not kept: they are
  /// never closed for room.
  void place(id_type id, standing s, std::uint64_t order, deadline_t accepted) {
    auto it = entries_.find(id);
    if (it != entries_.end()) {
      if (it->second.s == s && it->second.order == order) return;
      ranked_.erase({it->second.s, it->second.order, id});
      if (s == standing::trusted) {
        entries_.erase(it);
        return;
      }
      it->second.s = s;
      it->second.order = order;
    } else {
      if (s == standing::trusted) return;
      entries_.emplace(id, entry{s, order, accepted});
    }
    ranked_.insert({s, order, id});
  }
  /// Connection `id` is closed.
  void forget(id_type id) {
    auto it = entries_.find(id);
    if (it == entries_.end()) return;
    ranked_.erase({it->second.s, it->second.order, id});
    entries_.erase(it);
  }

  /// The stranger most readily closed, if any.
  std::optional<id_type> victim() const {
    if (ranked_.empty()) return std::nullopt;
    return std::get<2>(*ranked_.begin());
  }

  /// Connections the listener may hold now: the capacity, or fewer for a while after the
  /// process ran out of descriptors.
  std::size_t room(deadline_t now) const noexcept {
    return now < fd_room_until_ ? std::min(rules_.capacity, fd_room_) : rules_.capacity;
  }
  /// Crowded or out of descriptors lately: handshakes get the short limit.
  bool pressed(deadline_t now, std::size_t held) const noexcept {
    return now < pressure_until_ || held >= rules_.crowded_at;
  }
  /// Whether the listener should be watched now (false while it rests).
  bool listening(deadline_t now) const noexcept { return now >= rest_until_; }

  /// Handshakes whose time is up at `now` with `held` connections, oldest first, with why.
  std::vector<std::pair<id_type, ended>> handshakes_over(deadline_t now, std::size_t held) const {
    std::vector<std::pair<id_type, ended>> over;
    const bool short_limit = pressed(now, held);
    for (auto it = ranked_.lower_bound({standing::handshaking, 0, 0});
         it != ranked_.end() && std::get<0>(*it) == standing::handshaking; ++it) {
      const auto id = std::get<2>(*it);
      const auto age = now - entries_.at(id).accepted;
      if (age >= rules_.handshake_limit)
        over.emplace_back(id, ended::timed_out);
      else if (short_limit && age >= rules_.crowded_handshake_limit)
        over.emplace_back(id, ended::crowded_out);
      else
        break;  // the rest are younger
    }
    return over;
  }

  /// When the policy next has something to do (a handshake's end, the end of the rest).
  deadline_t next_due(deadline_t now, std::size_t held) const {
    auto next = deadline_t::max();
    if (now < rest_until_) next = rest_until_;
    const auto limit = pressed(now, held) ? rules_.crowded_handshake_limit : rules_.handshake_limit;
    for (auto it = ranked_.lower_bound({standing::handshaking, 0, 0});
         it != ranked_.end() && std::get<0>(*it) == standing::handshaking; ++it) {
      next = std::min(next, entries_.at(std::get<2>(*it)).accepted + limit);
      break;  // the oldest ends first
    }
    return next;
  }

  /// Accepts one connection from `listener`, or returns -1 when none is waiting (or the listener
  /// must rest). `held()` says how many connections the caller holds; `evict()` closes the
  /// victim() (the caller's bookkeeping) and returns false when there is none; `shed` counts
  /// connections closed unserved.
  template <class Held, class Evict>
  int accept(int listener, deadline_t now, Held&& held, Evict&& evict, std::atomic<int>& shed) {
    for (;;) {
      const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        if (held() >= room(now) && !evict()) {
          ::close(fd);
          ++shed;
          continue;
        }
        return fd;
      }
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return -1;
      const bool out_of_descriptors = errno == EMFILE || errno == ENFILE;
      if (out_of_descriptors) {
        // Keep to what is held now, less a reserve for the rest of the process (the group's
        // mesh, files), for a while; strangers go to make that room.
        pressure_until_ = now + timing::listener_pressure_linger;
        fd_room_ = held() > rules_.descriptor_reserve ? held() - rules_.descriptor_reserve : 0;
        fd_room_until_ = now + timing::listener_fd_room_linger;
        bool freed = false;
        while (held() > fd_room_ && evict()) freed = true;
        if (freed) continue;
      }
      bool drained = false;
      if (out_of_descriptors && spare_) {
        spare_.reset();
        for (;;) {
          const int extra = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
          if (extra < 0) {
            if (errno == EINTR || errno == ECONNABORTED) continue;
            drained = errno == EAGAIN || errno == EWOULDBLOCK;
            break;
          }
          ::close(extra);
          ++shed;
        }
        spare_ = fd_handle(::open("/dev/null", O_RDONLY | O_CLOEXEC));
      }
      if (!drained || !spare_) rest_until_ = now + timing::listener_fd_rest;
      return -1;
    }
  }

 private:
  struct entry {
    standing s;
    std::uint64_t order;
    deadline_t accepted;
  };
  admission_rules rules_;
  std::unordered_map<id_type, entry> entries_;
  std::set<std::tuple<standing, std::uint64_t, id_type>> ranked_;
  fd_handle spare_{::open("/dev/null", O_RDONLY | O_CLOEXEC)};  // given up when out of descriptors
  deadline_t rest_until_{};
  deadline_t pressure_until_{};
  deadline_t fd_room_until_{};
  std::size_t fd_room_ = 0;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
