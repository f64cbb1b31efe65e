#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/autotune_driver.hpp
/// `autotune_driver`: runs the bucket-cap autotune (`bucket_policy::autotune`, docs/tuning.md,
/// "Autotune") for a wrapper: the checks at construction, then one step of the tuning schedule
/// after each synchronized step, re-planning through the wrapper when the schedule says so.
// IWYU pragma: private

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <utility>
#include <vector>

#include <ddp/data_parallel/agreement.hpp>
#include <ddp/data_parallel/autotune.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/error.hpp>
#include <ddp/planner/bucket_plan.hpp>
#include <ddp/process_group.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Every rank runs the same schedule: the first synchronized step with the smallest candidate
/// (unmeasured), then autotune_rounds passes over the candidates, each visit one unmeasured step
/// on fresh buckets and autotune_steps measured ones. Each tuning step ends with an all_reduce
/// (max) of this rank's figure, so all ranks record the same numbers; rank 0's pick is broadcast
/// all the same, and the wrapper's check_plan confirms one plan after every re-plan.
class autotune_driver {
 public:
  /// At construction, on every rank: ranks agree on the option and its settings, then reject
  /// the modes whose bucket layout cannot move (the same error on every rank). With the option,
  /// `policy` becomes the smallest candidate's.
  void set_up(const agreement& agree, bucket_policy& policy, const dp_options& opts, int rank) {
    agree.check_same("bucket_policy::autotune", policy.autotune ? 1 : 0);
    if (!policy.autotune) return;
    // Compared as the tuner takes them (caps sorted, each once): a mismatch shows the values.
    agree.check_same_text("bucket_policy::autotune_caps, autotune_steps and autotune_rounds",
                          autotune_settings(policy));
    agree.check_same("dp_options::gradient_as_bucket_view", opts.gradient_as_bucket_view ? 1 : 0);
    if (opts.gradient_as_bucket_view)
      detail::raise(errc::usage, rank,
                    "bucket_policy::autotune with dp_options::gradient_as_bucket_view: view mode hands bucket memory "
                    "to the engine, so the layout cannot move while caps are tried; tune in copy mode and set the "
                    "chosen cap_bytes for view mode, or turn one of them off");
    if (opts.uneven_inputs)
      detail::raise(errc::usage, rank,
                    "bucket_policy::autotune with dp_options::uneven_inputs: the layout is fixed at construction with "
                    "uneven inputs; set cap_bytes instead, or turn one of them off");
    if (!policy.caps.empty())
      detail::raise(errc::invalid_argument, rank,
                    "bucket_policy::autotune with a non-empty bucket_policy::caps: the autotune tries values of "
                    "cap_bytes, which caps replaces; list the candidates in autotune_caps instead");
    tuner_.emplace(policy.autotune_caps, policy.autotune_steps, policy.autotune_rounds);
    base_ = policy;
    policy = with_cap(base_, tuner_->first_cap());
  }

  /// After the stats of every step (`last`): one step of the tuning schedule (a no-op once it is
  /// done), under the wrapper's `guarded`. A new cap goes into `policy`, and its plan (from the
  /// agreed order) to `install(plan, when)`.
  template <class Guard, class Planner, class Install>
  void after_step(Guard& guarded, Planner& planner, const std::vector<param_info>& infos, bucket_policy& policy,
                  const step_stats& last, const agreement& agree, process_group& pg, std::uint64_t step,
                  Install&& install) {
    if (!tuner_ || tuner_->done() || !last.synchronized) return;
    guarded("the bucket-cap autotune in finish", -1,
            [&] { schedule_step(planner, infos, policy, last, agree, pg, step, install); });
  }

  /// Where the rebuild leaves rank 0's ready order for the candidates' plans.
  std::vector<std::size_t>* order() noexcept { return &order_; }

  /// What the autotune measured and chose (`enabled` false without the option).
  const autotune_report& report() const noexcept {
    static const autotune_report off{};
    return tuner_ ? tuner_->report() : off;
  }

 private:
  template <class Planner, class Install>
  void schedule_step(Planner& planner, const std::vector<param_info>& infos, bucket_policy& policy,
                     const step_stats& last, const agreement& agree, process_group& pg, std::uint64_t step,
                     Install& install) {
    auto& t = *tuner_;
    if (!t.started()) {
      // The first synchronized step: rank 0's ready order is known (order_, or empty without
      // the rebuild), and the plan in place is the smallest candidate's.
      auto caps = distinct_caps(planner, infos, base_, order_,
                                policy.autotune_caps.empty() ? default_autotune_caps() : policy.autotune_caps);
      std::vector<std::size_t> buckets;
      for (auto c : caps) buckets.push_back(planner.plan(infos, with_cap(base_, c), order_).buckets.size());
      t.start(std::move(caps), buckets);
      return;
    }
    // This rank's first grad_ready to finish() return; a step is as slow as its slowest rank.
    const double mine = last.backward_ms + last.exposed_ms;
    const double slowest = pg.all_reduce(mine, op::max);
    if (!t.record(slowest)) return;
    // Plans with the cap from the agreed order (install: new buckets only when the layout differs).
    const auto replan = [&](std::size_t cap, const char* when) {
      policy = with_cap(base_, cap);
      install(planner.plan(infos, policy, order_), when);
    };
    if (!t.measuring_done()) {
      replan(t.cap(), "during the bucket-cap autotune");
      return;
    }
    const auto pick = static_cast<std::size_t>(agree.rank0_value(t.pick()));
    t.decide(pick, step);
    replan(pick, "after the bucket-cap autotune");
    if (pg.rank() == 0) {
      std::fputs(bucket_autotuner::describe(t.report()).c_str(), stderr);
      std::fflush(stderr);
    }
  }

  std::optional<bucket_autotuner> tuner_;  // with bucket_policy::autotune
  bucket_policy base_;                     // the policy as given; candidates replace its cap
  std::vector<std::size_t> order_;         // rank 0's ready order from the rebuild (empty: none)
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
