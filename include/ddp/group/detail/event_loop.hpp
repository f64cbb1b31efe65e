#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The one event loop of the group's listeners (the store's server and each rank's mesh
// acceptor): epoll over a listener, an eventfd that wakes it to stop, and the connections of a
// handler, on a thread of its own. The handler decides everything else (admission.hpp decides
// whom to let in):
//
//   bool busy()                                   work is left for the next round: do not sleep
//   deadline_t next_due(deadline_t now)           when the handler next has something to do
//   bool listening(deadline_t now)                whether the listener is watched now
//   void on_listener(deadline_t now)              connections wait on the listener
//   void on_event(std::uint64_t id, std::uint32_t events, deadline_t now)
//   void after_events(deadline_t now)             the round's events are handled
//
// Connections are watched by an id of the handler's that is never reused, so an event that
// was pending for a connection closed meanwhile cannot reach a new one that got the same
// descriptor.

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include <ddp/clock.hpp>
#include <ddp/error.hpp>
#include <ddp/detail/fd.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/detail/timing.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

template <class H>
concept loop_handler = requires(H& h, deadline_t now, std::uint64_t id, std::uint32_t ev) {
  { h.busy() } -> std::convertible_to<bool>;
  { h.next_due(now) } -> std::convertible_to<deadline_t>;
  { h.listening(now) } -> std::convertible_to<bool>;
  h.on_listener(now);
  h.on_event(id, ev, now);
  h.after_events(now);
};

class event_loop {
 public:
  /// Ids the loop keeps for itself; a handler's ids are below them.
  static constexpr std::uint64_t wake_id = ~std::uint64_t{0};
  static constexpr std::uint64_t listen_id = wake_id - 1;

  /// Watches `listener` (a listening socket the caller keeps open while the loop runs). `rank`
  /// and `what` name the owner in errors.
  event_loop(int listener, int rank, const char* what) : listener_(listener) {
    wake_ = fd_handle(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    epoll_ = fd_handle(::epoll_create1(EPOLL_CLOEXEC));
    if (!wake_ || !epoll_) raise(errc::system, rank, std::string(what) + ": eventfd/epoll: " + errno_text(errno));
    control(EPOLL_CTL_ADD, wake_.get(), EPOLLIN, wake_id);
    control(EPOLL_CTL_ADD, listener_, EPOLLIN, listen_id);
  }
  event_loop(const event_loop&) = delete;
  event_loop& operator=(const event_loop&) = delete;
  ~event_loop() { stop(); }

  /// Runs `h` on the loop's thread until stop().
  template <loop_handler H>
  void start(H& h) {
    thread_ = std::thread([this, &h] { run(h); });
  }

  /// Stops the loop and joins its thread. False in a forked child's copy, where the thread is
  /// the parent's and does not exist: then only this process's descriptors close, and the
  /// caller leaves the state the parent's thread worked on undestroyed (detail::abandon).
  bool stop() noexcept {
    if (!thread_.joinable()) return true;
    if (owner_.forked()) {
      thread_.detach();
      return false;
    }
    stopping_ = true;
    std::uint64_t one = 1;
    [[maybe_unused]] auto r = ::write(wake_.get(), &one, sizeof one);
    thread_.join();
    return true;
  }

  /// Watches connection `fd` for `events` under the handler's `id`.
  void watch(int fd, std::uint32_t events, std::uint64_t id) { control(EPOLL_CTL_ADD, fd, events, id); }
  /// Changes what `fd` is watched for.
  void change(int fd, std::uint32_t events, std::uint64_t id) { control(EPOLL_CTL_MOD, fd, events, id); }
  /// Stops watching `fd` (one that stays open, handed elsewhere; closing a descriptor leaves
  /// the set by itself).
  void unwatch(int fd) { ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, fd, nullptr); }

 private:
  void control(int op, int fd, std::uint32_t events, std::uint64_t id) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = id;
    ::epoll_ctl(epoll_.get(), op, fd, &ev);
  }

  template <class H>
  void run(H& h) {
    std::vector<epoll_event> events(1024);
    while (!stopping_) {
      const auto before = steady_clock::now();
      // A listener that rests (out of descriptors) is left alone rather than spun on.
      const bool listen_now = h.listening(before);
      if (listen_now != listening_) {
        control(EPOLL_CTL_MOD, listener_, listen_now ? EPOLLIN : 0u, listen_id);
        listening_ = listen_now;
      }
      const int n = ::epoll_wait(epoll_.get(), events.data(), static_cast<int>(events.size()),
                                 h.busy() ? 0 : timeout_ms(before, h.next_due(before)));
      if (stopping_) break;
      const auto now = steady_clock::now();
      for (int i = 0; i < n; ++i) {
        const std::uint64_t id = events[static_cast<std::size_t>(i)].data.u64;
        if (id == wake_id) continue;
        if (id == listen_id)
          h.on_listener(now);
        else
          h.on_event(id, events[static_cast<std::size_t>(i)].events, now);
      }
      h.after_events(now);
    }
  }

  /// Milliseconds from `now` until `due`, at most timing::listener_idle.
  static int timeout_ms(deadline_t now, deadline_t due) {
    const auto next = std::min(due, now + timing::listener_idle);
    if (next <= now) return 0;
    return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count()) + 1;
  }

  int listener_;
  fd_handle wake_;
  fd_handle epoll_;
  bool listening_ = true;
  std::atomic<bool> stopping_{false};
  owner_process owner_;
  std::thread thread_;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
