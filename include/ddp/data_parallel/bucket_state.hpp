#pragma once
/// \file data_parallel/bucket_state.hpp
/// `ddp::bucket_state`: the step bookkeeping of `basic_data_parallel` (which gradients are in,
/// how many each bucket still waits for, which bucket launches next), with no group, reducer or
/// memory, so that it can be tested in one process. See docs/data-parallel.md.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/planner/bucket_plan.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Per parameter: ready (or unused) in this step; per bucket: how many of its gradients are
/// still pending. A bucket whose count reaches zero is handed to `launch` as soon as every
/// earlier bucket of the plan has been: buckets launch strictly in plan order, whatever order
/// the gradients arrive in, which is what keeps ranks' collectives aligned.
///
/// `claim` may run on several threads at once (for different parameters); `complete`,
/// `launch_ready` and `open` lock, and `launch` runs with the lock held. The plan passed to
/// `reset` must outlive the step.
/// \code
/// std::vector<std::size_t> launched;
/// ddp::bucket_state st{plan.where.size(), [&](std::size_t b) { launched.push_back(b); }};
/// st.reset(plan, false);
/// for (std::size_t i = 0; i < plan.where.size(); ++i)
///   if (st.claim(i)) st.complete(i, true);  // launched == 0, 1, ... in plan order
/// \endcode
class bucket_state {
 public:
  /// Starts bucket b's collective (called once per bucket and step, in plan order).
  using launch_fn = std::function<void(std::size_t bucket)>;
  /// Called once when a synchronized step opens, before any of its buckets can launch (under
  /// the same lock): what must precede every bucket of the step (the uneven-inputs count).
  using open_fn = std::function<void()>;
  /// Called when bucket b becomes complete, on the thread whose `complete` did it, under the lock
  /// (the wrapper's timeline notes which thread that was).
  using ready_fn = std::function<void(std::size_t bucket)>;

  bucket_state(std::size_t parameters, launch_fn launch, open_fn on_sync_open = {})
      : n_(parameters),
        ready_(std::make_unique<std::atomic<bool>[]>(parameters)),
        unused_(parameters, 0),
        accumulated_(parameters, 0),
        launch_(std::move(launch)),
        on_sync_open_(std::move(on_sync_open)) {
    order_.reserve(parameters);
  }

  /// A fresh step over `plan`: no parameter ready, every bucket waiting for all its entries.
  /// With `record_order` the step remembers the order parameters complete in (`order()`).
  void reset(const bucket_plan& plan, bool record_order) {
    std::lock_guard lock(mu_);
    plan_ = &plan;
    for (std::size_t i = 0; i < n_; ++i) ready_[i].store(false, std::memory_order_relaxed);
    std::fill(unused_.begin(), unused_.end(), 0);
    const std::size_t nb = plan.buckets.size();
    pending_.resize(nb);
    for (std::size_t b = 0; b < nb; ++b) pending_[b] = plan.buckets[b].entries.size();
    ready_at_.assign(nb, steady_clock::time_point{});
    launched_at_.assign(nb, steady_clock::time_point{});
    reduced_at_.assign(nb, steady_clock::time_point{});
    next_launch_ = bytes_launched_ = launched_before_finish_ = 0;
    finishing_ = open_ = false;
    record_order_ = record_order;
    if (record_order_) order_.clear();
  }

  /// Opens the step at its first hook (or at `finish()`); the step keeps the mode it opened
  /// with, `sync_if_new`. Returns the step's mode (true: synchronized). A synchronized step
  /// that opens here calls `on_sync_open` first; if that throws, the step stays open.
  bool open(bool sync_if_new, steady_clock::time_point now = steady_clock::now()) {
    std::lock_guard lock(mu_);
    if (!open_) {
      open_ = true;
      sync_ = sync_if_new;
      step_start_ = last_ready_ = now;
      if (sync_ && on_sync_open_) on_sync_open_();
    }
    return sync_;
  }
  /// Sets the observer of buckets becoming complete (empty: none; one test of it per bucket).
  void on_ready(ready_fn f) {
    std::lock_guard lock(mu_);
    on_ready_ = std::move(f);
  }
  bool is_open() const {
    std::lock_guard lock(mu_);
    return open_;
  }

  /// Makes parameter `i` ready; false when it already was (or was marked unused) in this step.
  bool claim(std::size_t i) noexcept { return !ready_[i].exchange(true, std::memory_order_acq_rel); }
  bool ready(std::size_t i) const noexcept { return ready_[i].load(std::memory_order_acquire); }
  void set_unused(std::size_t i) noexcept { unused_[i] = 1; }
  bool unused(std::size_t i) const noexcept { return unused_[i] != 0; }
  /// Parameter `i` was made ready in an unsynchronized (`no_sync()`) step since the last
  /// synchronized one: its accumulated gradient counts even if it is unused when synchronizing.
  /// Kept across `reset`, until `clear_accumulated()`.
  void set_accumulated(std::size_t i) noexcept { accumulated_[i] = 1; }
  bool accumulated(std::size_t i) const noexcept { return accumulated_[i] != 0; }
  void clear_accumulated() noexcept { std::fill(accumulated_.begin(), accumulated_.end(), 0); }
  /// Some parameter has an accumulated gradient that no synchronized step averaged yet.
  bool any_accumulated() const noexcept {
    return std::any_of(accumulated_.begin(), accumulated_.end(), [](std::uint8_t a) { return a != 0; });
  }
  /// A `finish()` that would open a synchronized step now would have nothing new to reduce:
  /// no hook since the last `reset` (`!is_open()`), after at least one step (`steps_done`), and
  /// no gradient that `no_sync()` steps accumulated. The wrapper refuses it (a doubled call).
  bool nothing_new(std::uint64_t steps_done, bool sync) const {
    return sync && steps_done > 0 && !is_open() && !any_accumulated();
  }
  /// Parameters not ready yet, in index order.
  std::vector<std::size_t> missing() const {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < n_; ++i)
      if (!ready(i)) out.push_back(i);
    return out;
  }

  /// Parameter `i`'s gradient is in its bucket. In a synchronized step its bucket's count drops,
  /// and every bucket whose turn has come launches. `hook`: false for parameters `finish()`
  /// fills in, which do not move the end of backward in the statistics.
  void complete(std::size_t i, bool sync, bool hook = true) {
    const auto t = steady_clock::now();
    std::lock_guard lock(mu_);
    if (hook) last_ready_ = t;
    if (record_order_) order_.push_back(i);
    if (!sync) return;
    const std::size_t b = plan_->where[i].first;
    if (--pending_[b] == 0) {
      ready_at_[b] = t;
      if (on_ready_) on_ready_(b);
      launch_locked();
    }
  }

  /// `finish()` has begun: later launches no longer count as overlapped with backward.
  void begin_finish() {
    std::lock_guard lock(mu_);
    finishing_ = true;
  }
  /// Launches every complete bucket whose earlier buckets have all launched.
  void launch_ready() {
    std::lock_guard lock(mu_);
    launch_locked();
  }
  /// Bucket b's reduction ended at `t` (for the statistics).
  void set_reduced(std::size_t b, steady_clock::time_point t) { reduced_at_[b] = t; }

  std::size_t pending(std::size_t b) const {
    std::lock_guard lock(mu_);
    return pending_[b];
  }
  /// Number of buckets launched in this step (they are buckets 0 .. launched()-1).
  std::size_t launched() const {
    std::lock_guard lock(mu_);
    return next_launch_;
  }
  steady_clock::time_point launched_at(std::size_t b) const { return launched_at_[b]; }
  /// When bucket b became complete (the epoch while it is not; always for a bucket with no entries).
  steady_clock::time_point ready_at(std::size_t b) const { return ready_at_[b]; }
  /// When the step opened (its first hook, or `finish()`), and when its last hook ran.
  steady_clock::time_point step_start() const { return step_start_; }
  steady_clock::time_point last_ready() const { return last_ready_; }
  /// The mode the step opened with (true: synchronized).
  bool synchronized() const { return sync_; }
  /// The order parameters completed in, when the step records it.
  const std::vector<std::size_t>& order() const noexcept { return order_; }

  /// What the step cost, as `last_step_stats()` reports it; `t_call` is when `finish()` was
  /// called, `t_end` when it returns.
  step_stats stats(std::uint64_t step, steady_clock::time_point t_call, steady_clock::time_point t_end) const {
    step_stats st;
    st.step = step;
    st.synchronized = sync_;
    st.backward_ms = ms(last_ready_ - step_start_);
    st.exposed_ms = ms(t_end - std::max(last_ready_, step_start_));
    st.finish_ms = ms(t_end - t_call);
    if (!sync_) return st;
    st.bytes_reduced = bytes_launched_;
    st.launched_before_finish = launched_before_finish_;
    for (std::size_t i = 0; i < n_; ++i) st.unused += unused_[i];
    st.buckets.resize(plan_->buckets.size());
    for (std::size_t b = 0; b < st.buckets.size(); ++b) {
      auto& bt = st.buckets[b];
      bt.bytes = plan_->buckets[b].bytes;
      bt.parameters = plan_->buckets[b].entries.size();
      bt.ready_ms = ms(ready_at_[b] - step_start_);
      bt.launch_ms = ms(launched_at_[b] - step_start_);
      bt.reduced_ms = ms(reduced_at_[b] - step_start_);
    }
    return st;
  }

 private:
  static double ms(steady_clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

  void launch_locked() {
    while (next_launch_ < plan_->buckets.size() && pending_[next_launch_] == 0) {
      const std::size_t b = next_launch_;
      launched_at_[b] = steady_clock::now();  // before the call: the collective may end before it returns
      launch_(b);
      bytes_launched_ += plan_->buckets[b].bytes;
      if (!finishing_) ++launched_before_finish_;
      ++next_launch_;
    }
  }

  std::size_t n_;
  const bucket_plan* plan_ = nullptr;
  // Per parameter; atomic so that concurrent hooks detect a duplicate without the lock.
  std::unique_ptr<std::atomic<bool>[]> ready_;
  std::vector<std::uint8_t> unused_, accumulated_;
  launch_fn launch_;
  open_fn on_sync_open_;
  ready_fn on_ready_;
  mutable std::mutex mu_;  // guards what follows
  std::vector<std::size_t> pending_;
  std::vector<steady_clock::time_point> ready_at_, launched_at_, reduced_at_;
  std::vector<std::size_t> order_;
  std::size_t next_launch_ = 0, bytes_launched_ = 0, launched_before_finish_ = 0;
  steady_clock::time_point step_start_{}, last_ready_{};
  bool open_ = false, sync_ = true, finishing_ = false, record_order_ = false;
};

}  // namespace DDP_ABI
}  // namespace ddp
