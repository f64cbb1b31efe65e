#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The group's heartbeat (init_options::heartbeat, DDP_HEARTBEAT_MS): a frozen rank is found
// within the lease, however long the collective timeout is. The ranks form a ring on a channel
// of their own ("pg/hb"): each sends one byte to its successor every lease / 8 and watches its
// predecessor. A predecessor that is silent for a whole lease is frozen, stopped (SIGSTOP) or
// cut off (errc::timeout); one whose connection ends without a goodbye died (errc::peer_lost,
// at once). The watching rank then fails the group: its failure is recorded as the group's and
// every transport on the group is aborted with it, so the collectives blocked here end at
// once, and the peers blocked on this rank wake and report the same cause
// (docs/reliability.md). Timers and a watched descriptor on the group's reactor (reactor.hpp),
// whose thread never waits on the store, so a slow store cannot silence a beat; a rank that
// closes its group says goodbye first, so that ranks finishing at different times are never taken for
// dead ones. A rank whose group failed says a goodbye of its own kind ("left after a failure"),
// and its successor fails its group on it: a rank whose collective waits only on the lost rank
// (a send into a cut link) learns at once that the others have moved on.

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <utility>

#include <ddp/clock.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/error.hpp>
#include <ddp/group/detail/reactor.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Watches the predecessor's heartbeats and sends this rank's to the successor, on `loop`.
/// `on_lost(code, text, dead)` runs once, on the reactor's thread (it must not wait on the
/// store), when the predecessor froze or died (`dead`; text: "rank P ...", from this rank's
/// view) or left after its group failed (not dead: it is re-forming); the beats to the successor
/// go on until the group closes. `failed()` says whether this rank's group failed: its goodbye
/// then says so. The two descriptors belong to the caller's links and may be the same one (a
/// group of two).
class heartbeat_watch final : public reactor_handler {
 public:
  /// The byte that says "alive", the one that says "closing normally", and the one that says
  /// "closing after the group failed".
  static constexpr char beat = 'h';
  static constexpr char goodbye = 'b';
  static constexpr char goodbye_failed = 'f';

  heartbeat_watch(reactor& loop, int pred_fd, int pred, int succ_fd, std::chrono::milliseconds lease,
                  std::function<void(errc, const std::string&, bool dead)> on_lost, std::function<bool()> failed)
      : pred_fd_(pred_fd),
        pred_(pred),
        succ_fd_(succ_fd),
        lease_(lease),
        every_(std::max<std::chrono::milliseconds>(std::chrono::milliseconds(1), lease / 8)),
        on_lost_(std::move(on_lost)),
        failed_(std::move(failed)),
        heard_(steady_clock::now()),
        next_beat_(heard_) {
    reg_ = loop.add(*this, reactor::begin::paused);
    reg_.watch(pred_fd_, EPOLLIN, 0);
    watching_ = true;
    reg_.start();  // called from now on: reg_ and the rest are set
  }
  /// Leaving the group (an elastic group re-forms): says goodbye to the successor now, then
  /// waits up to `max` for the predecessor's word, its goodbye or its death, so that a death the
  /// transports saw first (a dead process's sockets close a moment after it is gone) is still
  /// reported before this rank moves on. Every leaving rank says goodbye before it waits, so the
  /// ranks leaving together never wait for each other.
  void leave(std::chrono::milliseconds max) noexcept {
    if (owner_.forked()) return;
    say_goodbye();
    const auto until = steady_clock::now() + max;
    while (pred_word_.load() == 0 && steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  heartbeat_watch(const heartbeat_watch&) = delete;
  heartbeat_watch& operator=(const heartbeat_watch&) = delete;
  /// Leaves the reactor, reads what the predecessor sent last, and says goodbye to the successor
  /// (a normal close, not a death).
  ~heartbeat_watch() override {
    if (owner_.forked()) return;  // the parent's reactor and links: nothing of ours runs there
    reg_.unwatch(pred_fd_);       // (again, if the reactor did: harmless; the descriptor is still open)
    reg_.reset();                 // from here on only this thread touches the watch
    last_look();
    say_goodbye();
  }

 private:
  deadline_t next_due(deadline_t) override {
    auto due = succ_gone_ ? deadline_t::max() : next_beat_;
    if (!pred_left_) due = std::min(due, heard_ + lease_ + std::chrono::milliseconds(1));
    return due;
  }

  void after_events(deadline_t now) override {
    if (!succ_gone_ && now >= next_beat_) {
      const ssize_t k = ::send(succ_fd_, &beat, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) succ_gone_ = true;
      next_beat_ = now + every_;
    }
    if (!pred_left_ && now - heard_ > lease_) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - heard_).count();
      // This rank keeps beating: its own watcher must not take it for the one that froze.
      lost(errc::timeout, "rank " + std::to_string(pred_) + " stopped answering: no heartbeat for " +
                              std::to_string(ms) + " ms (lease " + std::to_string(lease_.count()) +
                              " ms; the rank is frozen, stopped or cut off)");
    }
  }

  void on_event(std::uint64_t, std::uint32_t, deadline_t now) override {
    if (pred_left_) return;
    char buf[256];
    const ssize_t k = ::recv(pred_fd_, buf, sizeof buf, MSG_DONTWAIT);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (k <= 0)
      return lost(errc::peer_lost,
                  "rank " + std::to_string(pred_) + " died: its heartbeat connection ended without a goodbye");
    heard_ = now;
    bool left = false, left_failed = false;
    for (ssize_t i = 0; i < k; ++i) {
      if (buf[i] == goodbye) left = true;
      if (buf[i] == goodbye_failed) left = left_failed = true;
    }
    if (!left) return;
    stop_watching();
    // Not a death: the predecessor is re-forming; this rank's collectives end now too.
    if (left_failed)
      report(errc::aborted, "rank " + std::to_string(pred_) + " left the group after it failed (its heartbeat said so)",
             false);
    pred_word_.store(1);
  }

  /// Nothing more to hear from the predecessor: its descriptor leaves the reactor (an ended
  /// connection would wake it for ever).
  void stop_watching() noexcept {
    pred_left_ = true;
    if (watching_) reg_.unwatch(pred_fd_);
    watching_ = false;
  }

  void say_goodbye() noexcept {
    bool failed = false;
    try {
      failed = failed_ && failed_();
    } catch (...) {
    }
    const char word = failed ? goodbye_failed : goodbye;
    (void)!::send(succ_fd_, &word, 1, MSG_DONTWAIT | MSG_NOSIGNAL);
  }

  /// As the group closes: what the predecessor sent and did not yet read is read now, so that a
  /// death that came just before (its connection ended without a goodbye) or a lease run out is
  /// still reported; a rank leaving right after a peer died must not take that news with it.
  void last_look() noexcept {
    if (pred_left_) return;
    char buf[256];
    for (;;) {
      const ssize_t k = ::recv(pred_fd_, buf, sizeof buf, MSG_DONTWAIT);
      if (k > 0) {
        heard_ = steady_clock::now();
        for (ssize_t i = 0; i < k; ++i)
          if (buf[i] == goodbye || buf[i] == goodbye_failed) return;
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;  // nothing more now
      // The end (a FIN) or a reset (the peer died with bytes unread): no goodbye came.
      return lost(errc::peer_lost,
                  "rank " + std::to_string(pred_) + " died: its heartbeat connection ended without a goodbye");
    }
    if (steady_clock::now() - heard_ > lease_)
      lost(errc::timeout, "rank " + std::to_string(pred_) + " stopped answering: no heartbeat for more than " +
                              std::to_string(lease_.count()) + " ms (the rank is frozen, stopped or cut off)");
  }

  void lost(errc code, const std::string& text) noexcept {
    stop_watching();
    report(code, text, true);
    pred_word_.store(2);
  }
  void report(errc code, const std::string& text, bool dead) noexcept {
    try {
      on_lost_(code, text, dead);
    } catch (...) {
    }
  }

  int pred_fd_;
  int pred_;
  int succ_fd_;
  std::chrono::milliseconds lease_;
  std::chrono::milliseconds every_;
  std::function<void(errc, const std::string&, bool)> on_lost_;
  std::function<bool()> failed_;
  // On the reactor's thread while registered; on the destroying thread after.
  deadline_t heard_;
  deadline_t next_beat_;
  bool pred_left_ = false;  // the predecessor said goodbye, or was found gone: nothing more to watch
  bool succ_gone_ = false;  // the successor's end is closed: its own watcher, or its exit, says why
  bool watching_ = false;
  std::atomic<int> pred_word_{0};  // 1: the predecessor said goodbye; 2: it was found dead or frozen
  owner_process owner_;
  reactor::registration reg_;  // last: off the reactor before the rest goes
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
