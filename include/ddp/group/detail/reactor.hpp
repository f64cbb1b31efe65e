#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The group's reactor: one thread that runs everything a rank does in the background, so that a
// rank costs its process one thread and one listening port whatever it runs (the group's mesh,
// its heartbeat, the launcher's link, each TCP transport's connections). epoll over the
// descriptors its handlers watch, their timers, an eventfd that wakes it for work posted from
// other threads, and a courier: a second thread, started the first time it is needed, for work
// that may wait on the group's store (recording a failure), so that no such wait ever holds up a
// heartbeat. The store server runs the same loop with itself as the one handler (event_loop).
//
// A handler (reactor_handler) says when it next has something to do on its own (next_due), takes
// the events of the descriptors it watches by ids of its own, and runs its timers once a round
// (after_events). Handlers are added and removed from any thread; removal waits for a round in
// progress, so a removed handler is never called again. Everything a handler does runs on the
// reactor's thread, one handler at a time.

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <concepts>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/clock.hpp>
#include <ddp/error.hpp>
#include <ddp/detail/fd.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/detail/timing.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// What runs on a reactor. Every call comes on the reactor's thread.
class reactor_handler {
 public:
  virtual ~reactor_handler() = default;
  /// Work is left for the next round: the reactor does not sleep.
  virtual bool busy() { return false; }
  /// When the handler next has something to do on its own (its timers).
  virtual deadline_t next_due(deadline_t /*now*/) { return deadline_t::max(); }
  /// Events on a descriptor the handler watches under `id`.
  virtual void on_event(std::uint64_t id, std::uint32_t events, deadline_t now) = 0;
  /// The round's events are handled: timers that are due run here.
  virtual void after_events(deadline_t /*now*/) {}
};

class reactor {
  struct state;

 public:
  /// A handler's ids are below this.
  static constexpr std::uint64_t id_limit = std::uint64_t{1} << 40;
  /// Handlers on one reactor at once (slots are reused once removed).
  static constexpr std::size_t max_handlers = 255;

  /// A handler on the reactor, as add() returns it: watches descriptors under the handler's ids,
  /// and removes the handler when reset or destroyed (waiting for a round in progress).
  class registration {
   public:
    registration() = default;
    registration(registration&& o) noexcept : r_(std::exchange(o.r_, nullptr)), tag_(o.tag_) {}
    registration& operator=(registration&& o) noexcept {
      if (this != &o) {
        reset();
        r_ = std::exchange(o.r_, nullptr);
        tag_ = o.tag_;
      }
      return *this;
    }
    ~registration() { reset(); }

    /// Watches `fd` for `events` under the handler's `id` (below id_limit).
    void watch(int fd, std::uint32_t events, std::uint64_t id) { r_->control(EPOLL_CTL_ADD, fd, events, key(id)); }
    /// Changes what `fd` is watched for.
    void change(int fd, std::uint32_t events, std::uint64_t id) { r_->control(EPOLL_CTL_MOD, fd, events, key(id)); }
    /// Stops watching `fd`. A handler unwatches what it watched before it closes it or goes.
    void unwatch(int fd) noexcept {
      if (r_ != nullptr && r_->s_) ::epoll_ctl(r_->s_->epoll.get(), EPOLL_CTL_DEL, fd, nullptr);
    }
    /// Lets a handler added paused be called from now on (see reactor::add).
    void start() {
      if (r_ != nullptr) r_->start(tag_);
    }
    /// Removes the handler now; on the reactor's thread it takes effect after the current call.
    void reset() noexcept {
      if (r_ != nullptr) r_->remove(tag_);
      r_ = nullptr;
    }
    reactor* owner() const noexcept { return r_; }

   private:
    friend class reactor;
    registration(reactor* r, std::uint64_t tag) noexcept : r_(r), tag_(tag) {}
    std::uint64_t key(std::uint64_t id) const noexcept { return tag_ << 40 | id; }
    reactor* r_ = nullptr;
    std::uint64_t tag_ = 0;
  };

  /// Starts the thread. `rank` and `what` name the owner in errors.
  reactor(int rank, const char* what) : s_(std::make_unique<state>()), rank_(rank), what_(what) {
    s_->wake = fd_handle(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    s_->epoll = fd_handle(::epoll_create1(EPOLL_CLOEXEC));
    if (!s_->wake || !s_->epoll) raise(errc::system, rank, std::string(what) + ": eventfd/epoll: " + errno_text(errno));
    control(EPOLL_CTL_ADD, s_->wake.get(), EPOLLIN, wake_key);
    s_->thread = std::thread([s = s_.get()] { s->run(); });
    s_->loop_id = s_->thread.get_id();
  }
  reactor(const reactor&) = delete;
  reactor& operator=(const reactor&) = delete;
  ~reactor() { stop(); }

  /// Whether add() lets the reactor call the handler at once, or only once its registration's
  /// start() says it is wired (its owner holds the registration, and whatever it reaches the
  /// handler through is assigned): the reactor's thread may run a round the moment add() returns.
  enum class begin : bool { now, paused };

  /// Adds `h`, which must outlive the registration (declare it after what the handler uses).
  registration add(reactor_handler& h, begin b = begin::now) {
    std::lock_guard lock(s_->mu);
    auto& slots = s_->handlers;
    auto free = std::find_if(slots.begin(), slots.end(), [](const slot& x) { return x.h == nullptr; });
    if (free == slots.end()) {
      if (slots.size() >= max_handlers)
        raise(errc::usage, rank_,
              std::string(what_) + ": more than " + std::to_string(max_handlers) + " handlers on one reactor at once");
      free = slots.insert(slots.end(), slot{});
    }
    // A reused slot takes the next generation: an event its former handler's descriptors raised
    // in a round already gathered carries the old one and reaches nobody.
    free->h = &h;
    free->active = b == begin::now;
    ++free->gen;
    s_->poke();  // a sleeping reactor learns the new handler's timers now, not at its next wake
    return registration(this, tag_of(static_cast<std::size_t>(free - slots.begin()), free->gen));
  }

  /// Runs `job` on the reactor's thread, soon; at once on the caller's thread once stopped.
  /// The job must not wait on anything slow: a heartbeat waits for it.
  void post(std::function<void()> job) {
    {
      std::lock_guard lock(s_->post_mu);
      if (!s_->stopped) {
        s_->posted.push_back(std::move(job));
        s_->poke();
        return;
      }
    }
    run_quietly(job);
  }

  /// Runs `job` on the reactor's thread and returns when it ran (on this thread when called from
  /// the reactor's, or once stopped).
  void call(const std::function<void()>& job) {
    if (on_thread()) return run_quietly(job);
    struct done_flag {
      std::mutex mu;
      std::condition_variable cv;
      bool done = false;
    };
    auto d = std::make_shared<done_flag>();
    post([&job, d] {
      run_quietly(job);
      std::lock_guard lock(d->mu);
      d->done = true;
      d->cv.notify_all();
    });
    std::unique_lock lock(d->mu);
    d->cv.wait(lock, [&] { return d->done; });
  }

  /// Runs `job` on the courier, the thread for work that may wait on the group's store, in the
  /// order given; started the first time it is needed. Once stopped, on the caller's thread.
  void post_blocking(std::function<void()> job) {
    {
      std::lock_guard lock(s_->courier_mu);
      if (!s_->courier_stop) {
        if (!s_->courier.joinable()) try {
            s_->courier = std::thread([s = s_.get()] { s->deliver(); });
          } catch (...) {
            s_->courier_stop = true;  // no thread to be had: the caller's then
          }
        if (!s_->courier_stop) {
          s_->jobs.push_back(std::move(job));
          s_->courier_cv.notify_all();
          return;
        }
      }
    }
    run_quietly(job);
  }

  /// Waits until the courier has done everything handed to it so far (each job bounds its own
  /// waits). At once on the courier's own thread.
  void settle() {
    std::unique_lock lock(s_->courier_mu);
    if (std::this_thread::get_id() == s_->courier.get_id()) return;
    s_->courier_cv.wait(lock, [&] { return s_->jobs.empty() && !s_->delivering; });
  }

  /// True on the reactor's own thread.
  bool on_thread() const noexcept { return std::this_thread::get_id() == s_->loop_id; }

  /// Stops the thread, lets the courier finish what it was given, and runs what is still posted,
  /// here. False in a forked child's copy, where the threads are the parent's: then the state is
  /// left undestroyed (detail::abandon) and only this process's descriptors close.
  bool stop() noexcept {
    if (!s_) return true;
    if (owner_.forked()) {
      abandon(std::move(s_));
      return false;
    }
    if (s_->thread.joinable()) {
      s_->stopping = true;
      s_->poke();
      s_->thread.join();
    }
    // What is still posted runs here, and whatever is posted from now on runs where it is posted:
    // the courier may be waiting for a fan-out it posted (call) before it can finish.
    run_left();
    {
      std::lock_guard lock(s_->courier_mu);
      s_->courier_stop = true;
    }
    s_->courier_cv.notify_all();
    if (s_->courier.joinable()) s_->courier.join();
    return true;
  }

 private:
  static constexpr std::uint64_t wake_key = ~std::uint64_t{0};

  struct slot {
    reactor_handler* h = nullptr;
    std::uint16_t gen = 0;
    bool active = false;  // called by the rounds (a handler added paused: once started)
  };

  struct state {
    std::recursive_mutex mu;     // held while handlers run: add and remove wait for a round
    std::vector<slot> handlers;  // by slot; a removed handler's slot is null until reused
    std::mutex post_mu;
    std::vector<std::function<void()>> posted;
    bool stopped = false;
    mutable std::mutex courier_mu;
    std::condition_variable courier_cv;
    std::deque<std::function<void()>> jobs;
    bool delivering = false;  // a job is running on the courier
    bool courier_stop = false;
    std::thread courier;
    std::atomic<bool> stopping{false};
    fd_handle wake;
    fd_handle epoll;
    std::thread thread;
    std::thread::id loop_id;

    /// The slot that `tag` (see tag_of) names, if its handler is still there.
    slot* find(std::uint64_t tag) noexcept {
      const auto at = static_cast<std::size_t>(tag >> 16);
      if (at >= handlers.size() || handlers[at].gen != static_cast<std::uint16_t>(tag) || handlers[at].h == nullptr)
        return nullptr;
      return &handlers[at];
    }

    void poke() noexcept {
      const std::uint64_t one = 1;
      [[maybe_unused]] auto r = ::write(wake.get(), &one, sizeof one);
    }

    void run() noexcept {
      std::vector<epoll_event> events(256);
      std::vector<std::function<void()>> jobs_now;
      while (!stopping) {
        {
          std::lock_guard lock(post_mu);
          jobs_now.swap(posted);
        }
        for (auto& job : jobs_now) run_quietly(job);
        jobs_now.clear();
        const auto before = steady_clock::now();
        auto due = before + timing::listener_idle;
        bool busy = false;
        {
          std::lock_guard lock(mu);
          for (const auto& x : handlers)
            if (x.h != nullptr && x.active) {
              busy = busy || x.h->busy();
              due = std::min(due, x.h->next_due(before));
            }
        }
        const int n = ::epoll_wait(epoll.get(), events.data(), static_cast<int>(events.size()),
                                   busy ? 0 : timeout_ms(before, due));
        if (stopping) break;
        const auto now = steady_clock::now();
        std::lock_guard lock(mu);
        for (int i = 0; i < n; ++i) {
          const auto& e = events[static_cast<std::size_t>(i)];
          if (e.data.u64 == wake_key) {
            std::uint64_t count = 0;
            [[maybe_unused]] auto r = ::read(wake.get(), &count, sizeof count);
            continue;
          }
          if (auto* x = find(e.data.u64 >> 40); x != nullptr && x->active)
            x->h->on_event(e.data.u64 & (id_limit - 1), e.events, now);
        }
        for (std::size_t t = 0; t < handlers.size(); ++t)
          if (handlers[t].h != nullptr && handlers[t].active) handlers[t].h->after_events(now);
      }
    }

    void deliver() noexcept {
      std::unique_lock lock(courier_mu);
      for (;;) {
        courier_cv.wait(lock, [&] { return courier_stop || !jobs.empty(); });
        if (jobs.empty()) return;  // stopped, and nothing is left
        auto job = std::move(jobs.front());
        jobs.pop_front();
        delivering = true;
        lock.unlock();
        run_quietly(job);
        lock.lock();
        delivering = false;
        courier_cv.notify_all();  // settle() waits for this
      }
    }
  };

  void run_left() noexcept {
    std::vector<std::function<void()>> left;
    {
      std::lock_guard lock(s_->post_mu);
      s_->stopped = true;
      left.swap(s_->posted);
    }
    for (auto& job : left) run_quietly(job);
  }

  void remove(std::uint64_t tag) noexcept {
    if (!s_ || owner_.forked()) return;
    std::lock_guard lock(s_->mu);
    if (auto* x = s_->find(tag)) *x = {nullptr, x->gen, false};
  }

  void start(std::uint64_t tag) {
    if (!s_ || owner_.forked()) return;
    std::lock_guard lock(s_->mu);
    if (auto* x = s_->find(tag)) x->active = true;
    s_->poke();  // its timers count from now
  }

  /// A registration's tag: the slot (8 bits) and the slot's generation (16 bits).
  static std::uint64_t tag_of(std::size_t at, std::uint16_t gen) noexcept { return std::uint64_t{at} << 16 | gen; }

  void control(int op, int fd, std::uint32_t events, std::uint64_t key) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = key;
    if (::epoll_ctl(s_->epoll.get(), op, fd, &ev) != 0 && op == EPOLL_CTL_ADD)
      raise(errc::system, rank_, std::string(what_) + ": epoll_ctl: " + errno_text(errno));
  }

  static void run_quietly(const std::function<void()>& job) noexcept {
    try {
      job();
    } catch (...) {
    }
  }

  /// Milliseconds from `now` until `due`, at most timing::listener_idle.
  static int timeout_ms(deadline_t now, deadline_t due) {
    const auto next = std::min(due, now + timing::listener_idle);
    if (next <= now) return 0;
    return static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count()) + 1;
  }

  std::unique_ptr<state> s_;  // on the heap: a forked child abandons it (stop())
  int rank_;
  const char* what_;
  owner_process owner_;
};

/// A handler of the loop_handler kind (below) that owns a listening socket, on a reactor: the
/// store server's view of itself, and the group's link hub's.
///
///   bool busy()                                   work is left for the next round: do not sleep
///   deadline_t next_due(deadline_t now)           when the handler next has something to do
///   bool listening(deadline_t now)                whether the listener is watched now
///   void on_listener(deadline_t now)              connections wait on the listener
///   void on_event(std::uint64_t id, std::uint32_t events, deadline_t now)
///   void after_events(deadline_t now)             the round's events are handled
///
/// Connections are watched by an id of the handler's that is never reused, so an event that was
/// pending for a connection closed meanwhile cannot reach a new one that got the same descriptor.
template <class H>
concept loop_handler = requires(H& h, deadline_t now, std::uint64_t id, std::uint32_t ev) {
  { h.busy() } -> std::convertible_to<bool>;
  { h.next_due(now) } -> std::convertible_to<deadline_t>;
  { h.listening(now) } -> std::convertible_to<bool>;
  h.on_listener(now);
  h.on_event(id, ev, now);
  h.after_events(now);
};

/// `H` with its listener on a reactor: the listener is watched while the handler listens (one
/// that rests, out of descriptors, is left alone rather than spun on).
template <loop_handler H>
class listener_on final : public reactor_handler {
 public:
  /// The id the listener is watched by; the handler's own ids are below it.
  static constexpr std::uint64_t listen_id = reactor::id_limit - 1;

  /// `b`: begin::paused when the handler reaches the listener through something its owner
  /// assigns after this returns; the owner calls start() once it has.
  listener_on(reactor& r, int listener, H& h, reactor::begin b = reactor::begin::now)
      : h_(h), listener_(listener), reg_(r.add(*this, reactor::begin::paused)) {
    reg_.watch(listener_, EPOLLIN, listen_id);
    if (b == reactor::begin::now) reg_.start();
  }
  /// The handler is called from now on (after a paused construction).
  void start() { reg_.start(); }
  listener_on(const listener_on&) = delete;
  listener_on& operator=(const listener_on&) = delete;
  ~listener_on() { close(); }
  /// Stops watching the listener and leaves the reactor.
  void close() noexcept {
    if (reg_.owner() == nullptr) return;
    reg_.unwatch(listener_);
    reg_.reset();
  }

  void watch(int fd, std::uint32_t events, std::uint64_t id) { reg_.watch(fd, events, id); }
  void change(int fd, std::uint32_t events, std::uint64_t id) { reg_.change(fd, events, id); }
  void unwatch(int fd) noexcept { reg_.unwatch(fd); }

 private:
  bool busy() override { return h_.busy(); }
  deadline_t next_due(deadline_t now) override { return h_.next_due(now); }
  void on_event(std::uint64_t id, std::uint32_t events, deadline_t now) override {
    if (id == listen_id)
      h_.on_listener(now);
    else
      h_.on_event(id, events, now);
  }
  void after_events(deadline_t now) override {
    h_.after_events(now);
    const bool listen_now = h_.listening(now);
    if (listen_now != listening_) {
      reg_.change(listener_, listen_now ? EPOLLIN : 0u, listen_id);
      listening_ = listen_now;
    }
  }

  H& h_;
  int listener_;
  bool listening_ = true;
  reactor::registration reg_;  // last: removed before the rest goes
};

/// A listener's loop on a reactor of its own (the store server): watch, change and unwatch its
/// connections; stop() joins the thread (false in a forked child's copy, see reactor::stop).
template <loop_handler H>
class event_loop {
 public:
  /// Serves nothing until start(): the handler may reach the loop through its owner's handle,
  /// assigned once this returns.
  event_loop(int listener, H& h, int rank, const char* what)
      : reactor_(rank, what), on_(reactor_, listener, h, reactor::begin::paused) {}
  void start() { on_.start(); }
  void watch(int fd, std::uint32_t events, std::uint64_t id) { on_.watch(fd, events, id); }
  void change(int fd, std::uint32_t events, std::uint64_t id) { on_.change(fd, events, id); }
  void unwatch(int fd) noexcept { on_.unwatch(fd); }
  bool stop() noexcept {
    if (!reactor_.stop()) return false;
    on_.close();
    return true;
  }

 private:
  reactor reactor_;
  listener_on<H> on_;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
