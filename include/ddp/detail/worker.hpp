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
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        it = std::move(jobs_.front());
        jobs_.pop_front();
      }
      try {
        it.job();
        it.state->complete();
      } catch (...) {
        it.state->complete(std::current_exception());
      }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<item> jobs_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace detail
}  // namespace v0
}  // namespace ddp
