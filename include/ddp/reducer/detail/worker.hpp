#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// One progress thread per reducer stack: collectives run in the order they were issued, which
// is what keeps every rank's sequence of collectives identical. Waiting for work blocks on a
// condition variable; it never spins. A decorator (ddp::hooked) runs its jobs on the thread of
// the reducer it wraps (progress_of below) instead of a thread of its own; its jobs call that
// reducer's collectives, which then run at once, on the thread already running the job (a job
// waiting for one queued behind it would never end).

#include <chrono>
#include <concepts>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include <ddp/error.hpp>
#include <ddp/request.hpp>
#include <ddp/detail/fork.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

class worker {
 public:
  /// `rank` and `what` name the owner in errors (a call in a forked child).
  explicit worker(int rank = -1, const char* what = "reducer")
      : rank_(rank), what_(what), s_(std::make_unique<state>()) {
    s_->thread = std::thread([s = s_.get()] { s->run(); });
  }
  worker(const worker&) = delete;
  worker& operator=(const worker&) = delete;
  ~worker() {
    if (owner_.forked()) {
      // The parent's copy: the thread does not exist here, and the condition variable it waited
      // on could never be destroyed (its waiter would never leave). Leave it all as it is.
      abandon(std::move(s_));
      return;
    }
    {
      std::lock_guard lock(s_->mu);
      s_->stop = true;
    }
    s_->cv.notify_all();
    s_->thread.join();
  }

  /// Runs `job` on the calling thread when nothing is queued or running (the caller would only
  /// wait for the worker anyway, and a thread hand-off costs tens of microseconds on a busy
  /// machine), or when the calling thread is the one running the current job (a job's nested
  /// collective: it must not wait behind itself). Returns false, without running it, when the
  /// worker has work: then the caller must submit() to keep the issue order. Raises errc::usage
  /// in a forked child.
  template <class F>
  bool try_run_inline(F&& job) {
    owner_.check(rank_, what_);
    const auto me = std::this_thread::get_id();
    bool nested = false;
    {
      std::lock_guard lock(s_->mu);
      if (s_->runner == me) {
        nested = true;
      } else if (s_->busy || !s_->jobs.empty()) {
        return false;
      } else {
        s_->busy = true;
        s_->runner = me;
      }
    }
    if (nested) {
      job();  // part of the job this thread runs, which holds the worker
      return true;
    }
    // Only the progress thread waits on the condition variable, and only for queued work or
    // the stop: waking it for nothing would cost a futex wake-up and a context switch, on a
    // core the caller's peers may need, after every inline collective.
    struct release {
      state* s;
      ~release() {
        bool wake = false;
        {
          std::lock_guard lock(s->mu);
          s->busy = false;
          s->runner = {};
          wake = s->stop || !s->jobs.empty();
        }
        if (wake) s->cv.notify_all();
      }
    } r{s_.get()};
    job();
    return true;
  }

  /// Queues `job`; the returned request completes when it has run (with its exception, if any).
  /// Called from the thread running the current job (a nested collective), it runs `job` at
  /// once and returns a completed request. Raises errc::usage in a forked child, where the
  /// thread does not exist.
  request submit(std::function<void()> job) {
    owner_.check(rank_, what_);
    auto st = std::make_shared<request_state>();
    bool nested = false;
    {
      std::lock_guard lock(s_->mu);
      nested = s_->runner == std::this_thread::get_id();
      if (!nested) s_->jobs.push_back({std::move(job), st});
    }
    if (nested)
      st->complete(run_job(job, *st));
    else
      s_->cv.notify_one();
    return request(st);
  }

 private:
  struct item {
    std::function<void()> job;
    std::shared_ptr<request_state> state;
  };
  // On the heap, so that a forked child can leave it undestroyed (see ~worker).
  struct state {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<item> jobs;
    bool stop = false;
    bool busy = false;         // a job runs, on the worker or inline on a caller
    std::thread::id runner{};  // the thread running it, while busy
    std::thread thread;

    void run() {
      for (;;) {
        item it;
        {
          std::unique_lock lock(mu);
          cv.wait(lock, [&] { return (stop && !busy) || (!jobs.empty() && !busy); });
          if (jobs.empty()) return;
          it = std::move(jobs.front());
          jobs.pop_front();
          busy = true;
          runner = std::this_thread::get_id();
        }
        std::exception_ptr err = run_job(it.job, *it.state);
        {
          std::lock_guard lock(mu);
          busy = false;
          runner = {};
        }
        cv.notify_all();
        it.state->complete(err);
      }
    }
  };
  static std::exception_ptr run_job(std::function<void()>& job, request_state& st) noexcept {
    if (timed_collectives().load(std::memory_order_relaxed) > 0) st.start();  // for timelines
    try {
      job();
    } catch (...) {
      return std::current_exception();
    }
    return nullptr;
  }

  int rank_;
  const char* what_;
  owner_process owner_;
  std::unique_ptr<state> s_;
};

/// A reducer that lends its progress thread to a decorator: `run_in_order(job)` queues `job`
/// behind every collective issued before it (a request, as submit), `try_run_inline(job)` runs it
/// at once when nothing is queued (false: not run). Every reducer built on front_end.hpp lends
/// its worker, `auto_reducer` its engine's, `hooked` the one it borrowed.
template <class R>
concept lends_progress_thread = requires(R& r, std::function<void()> job) {
  { r.run_in_order(std::move(job)) } -> std::same_as<request>;
  { r.try_run_inline(job) } -> std::same_as<bool>;
};

/// The progress thread of a decorator over `R`, with worker's submit and try_run_inline: R's own
/// where R lends it (one thread per reducer stack), else a worker of the decorator's own (this
/// primary template), whose jobs then call R's collectives from that second thread.
template <class R>
class progress_of {
 public:
  progress_of(R&, int rank, const char* what) : own_(rank, what) {}
  request submit(std::function<void()> job) { return own_.submit(std::move(job)); }
  template <class F>
  bool try_run_inline(F&& job) {
    return own_.try_run_inline(std::forward<F>(job));
  }

 private:
  worker own_;
};

template <lends_progress_thread R>
class progress_of<R> {
 public:
  progress_of(R& lender, int, const char*) : r_(lender) {}
  progress_of(const progress_of&) = delete;
  progress_of& operator=(const progress_of&) = delete;
  /// The decorator's jobs still queued on the lender's thread use the decorator: wait for them
  /// here, as the join of a worker of its own would. In a forked child there is nothing to wait
  /// for (the thread is the parent's; run_in_order raises errc::usage).
  ~progress_of() {
    try {
      r_.run_in_order([] {}).wait(std::chrono::steady_clock::now() + std::chrono::hours(24));
    } catch (...) {
    }
  }
  request submit(std::function<void()> job) { return r_.run_in_order(std::move(job)); }
  template <class F>
  bool try_run_inline(F&& job) {
    return r_.try_run_inline(std::forward<F>(job));
  }

 private:
  R& r_;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
