#pragma once
/// \file request.hpp
/// `ddp::request`: the handle of an asynchronous collective. `wait(deadline)` blocks until it
/// completed (rethrowing its error), `test()` polls.
///
/// \code
/// auto req = ring.allreduce_async(std::span<float>{v}, ddp::op::avg);
/// // ... compute ...
/// req.wait(std::chrono::steady_clock::now() + std::chrono::seconds(30));
/// \endcode

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>

#include <ddp/version.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/detail/thread_id.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {

namespace detail {
/// Timelines alive in this process (ddp/data_parallel/timeline.hpp). Workers note when and on
/// which thread each collective starts only while there is one: a clock read costs 20-200 ns
/// (200 on a VM's kvm-clock), which a program without a timeline should not pay per collective.
inline std::atomic<int>& timed_collectives() noexcept {
  static std::atomic<int> count{0};
  return count;
}

/// Completion state shared by a request and the worker that runs it.
struct request_state {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::chrono::steady_clock::time_point finished_at{};
  // Set by the thread that runs the collective as it starts (start()), while timed_collectives().
  std::chrono::steady_clock::time_point started_at{};
  long thread = 0;  // OS id of that thread
  // After fork() a parent's thread may have been waiting on `cv`: destroying it in the child
  // would wait for that waiter forever (see ~request).
  unsigned fork_generation = detail::fork_generation();

  /// The collective starts now, on the calling thread (for timelines: one clock read per collective).
  void start() noexcept {
    const auto now = std::chrono::steady_clock::now();
    const long id = os_thread_id();
    std::lock_guard lock(mu);
    started_at = now;
    thread = id;
  }

  void complete(std::exception_ptr e = nullptr) {
    {
      std::lock_guard lock(mu);
      done = true;
      error = std::move(e);
      finished_at = std::chrono::steady_clock::now();
    }
    cv.notify_all();
  }
};
}  // namespace detail

/// Handle of an asynchronous collective; requests of one reducer complete in issue order.
class request {
 public:
  request() = default;
  explicit request(std::shared_ptr<detail::request_state> s) noexcept : state_(std::move(s)) {}
  request(const request&) = default;
  request(request&&) noexcept = default;
  request& operator=(const request&) = default;
  request& operator=(request&&) noexcept = default;
  /// In a child made by fork() the state is left alive: a thread of the parent may have been
  /// waiting on it, and destroying its condition variable would wait for that thread forever.
  ~request() {
    if (state_ && state_->fork_generation != detail::fork_generation())
      detail::abandon(std::make_unique<std::shared_ptr<detail::request_state>>(std::move(state_)));
  }

  /// True when the collective has finished (successfully or not); never blocks.
  bool test() const {
    if (!state_) return true;
    std::lock_guard lock(state_->mu);
    return state_->done;
  }

  /// Blocks until done or `deadline`; rethrows the collective's error. errc::timeout when the
  /// deadline passes first (the collective keeps its buffer until it ends: do not free it).
  void wait(std::chrono::steady_clock::time_point deadline) const {
    if (!state_) return;
    std::unique_lock lock(state_->mu);
    if (!state_->cv.wait_until(lock, deadline, [&] { return state_->done; }))
      detail::raise(errc::timeout, -1, "request not completed before its deadline");
    if (state_->error) std::rethrow_exception(state_->error);
  }

  /// Waits with a relative timeout.
  template <class Rep, class Period>
  void wait_for(std::chrono::duration<Rep, Period> d) const {
    wait(std::chrono::steady_clock::now() + d);
  }

  /// When the collective finished (valid once test() is true).
  std::chrono::steady_clock::time_point finished_at() const {
    if (!state_) return {};
    std::lock_guard lock(state_->mu);
    return state_->finished_at;
  }

  /// When the collective started running (valid once test() is true). The epoch if it never ran,
  /// or if no timeline was alive in the process then (`detail::timed_collectives()`).
  std::chrono::steady_clock::time_point started_at() const {
    if (!state_) return {};
    std::lock_guard lock(state_->mu);
    return state_->started_at;
  }

  /// The OS id (Linux gettid) of the thread that ran the collective: the reducer's progress
  /// thread. Valid once test() is true; 0 when started_at() is the epoch.
  long thread_id() const {
    if (!state_) return 0;
    std::lock_guard lock(state_->mu);
    return state_->thread;
  }

  bool valid() const noexcept { return state_ != nullptr; }

 private:
  std::shared_ptr<detail::request_state> state_;
};

}  // namespace DDP_ABI
}  // namespace ddp
