#pragma once
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

#include "../request.hpp"

namespace ddp {
inline namespace v0 {
namespace detail {

class worker {
 public:
  worker() : thread_([this] { run(); }) {}
  worker(const worker&) = delete;
  worker& operator=(const worker&) = delete;
  ~worker() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  /// Runs `job` on the calling thread when nothing is queued or running (the caller would only
  /// wait for the worker anyway, and a thread hand-off costs tens of microseconds on a busy
  /// machine). Returns false, without running it, when the worker has work: then the caller
  /// must submit() to keep the issue order.
  template <class F>
  bool try_run_inline(F&& job) {
    {
      std::lock_guard lock(mu_);
      if (busy_ || !jobs_.empty()) return false;
      busy_ = true;
    }
    struct release {
      worker* w;
      ~release() {
        {
          std::lock_guard lock(w->mu_);
          w->busy_ = false;
        }
        w->cv_.notify_all();
      }
    } r{this};
    job();
    return true;
  }

  /// Queues `job`; the returned request completes when it has run (with its exception, if any).
  request submit(std::function<void()> job) {
    auto st = std::make_shared<request_state>();
    {
      std::lock_guard lock(mu_);
      jobs_.push_back({std::move(job), st});
    }
    cv_.notify_one();
    return request(st);
  }

 private:
  struct item {
    std::function<void()> job;
    std::shared_ptr<request_state> state;
  };
  void run() {
    for (;;) {
      item it;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [&] { return (stop_ && !busy_) || (!jobs_.empty() && !busy_); });
        if (jobs_.empty()) return;
        it = std::move(jobs_.front());
        jobs_.pop_front();
        busy_ = true;
      }
      std::exception_ptr err;
      try {
        it.job();
      } catch (...) {
        err = std::current_exception();
      }
      {
        std::lock_guard lock(mu_);
        busy_ = false;
      }
      cv_.notify_all();
      it.state->complete(err);
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<item> jobs_;
  bool stop_ = false;
  bool busy_ = false;  // a job runs, on the worker or inline on a caller
  std::thread thread_;
};

}  // namespace detail
}  // namespace v0
}  // namespace ddp
