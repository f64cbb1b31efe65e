#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// One progress thread per reducer: collectives run in the order they were issued, which is
// what keeps every rank's sequence of collectives identical. Waiting for work blocks on a
// condition variable; it never spins.

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include <ddp/error.hpp>
#include <ddp/request.hpp>
#include <ddp/detail/fork.hpp>

namespace ddp {
inline namespace v0 {
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
  /// machine). Returns false, without running it, when the worker has work: then the caller
  /// must submit() to keep the issue order. Raises errc::usage in a forked child.
  template <class F>
  bool try_run_inline(F&& job) {
    owner_.check(rank_, what_);
    {
      std::lock_guard lock(s_->mu);
      if (s_->busy || !s_->jobs.empty()) return false;
      s_->busy = true;
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
          wake = s->stop || !s->jobs.empty();
        }
        if (wake) s->cv.notify_all();
      }
    } r{s_.get()};
    job();
    return true;
  }

  /// Queues `job`; the returned request completes when it has run (with its exception, if any).
  /// Raises errc::usage in a forked child, where the thread does not exist.
  request submit(std::function<void()> job) {
    owner_.check(rank_, what_);
    auto st = std::make_shared<request_state>();
    {
      std::lock_guard lock(s_->mu);
      s_->jobs.push_back({std::move(job), st});
    }
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
    bool busy = false;  // a job runs, on the worker or inline on a caller
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
        }
        std::exception_ptr err;
        if (timed_collectives().load(std::memory_order_relaxed) > 0) it.state->start();  // for timelines
        try {
          it.job();
        } catch (...) {
          err = std::current_exception();
        }
        {
          std::lock_guard lock(mu);
          busy = false;
        }
        cv.notify_all();
        it.state->complete(err);
      }
    }
  };
  int rank_;
  const char* what_;
  owner_process owner_;
  std::unique_ptr<state> s_;
};

}  // namespace detail
}  // namespace v0
}  // namespace ddp
