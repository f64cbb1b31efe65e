#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/plan_keeper.hpp
/// `plan_keeper`: the life of a wrapper's bucket plan: the first plan, whether the layout may
/// still move, the rebuild from rank 0's ready order and each new plan put in place (with its
/// layout version), every one confirmed by every rank.
// IWYU pragma: private

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <ddp/data_parallel/agreement.hpp>
#include <ddp/data_parallel/bucket_memory.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/planner/bucket_plan.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Holds references to the wrapper's agreement, bucket memory, planner, parameters and policy
/// (read as they are when called: the autotune changes the policy), which outlive it.
template <class Planner, class Allocator>
class plan_keeper {
 public:
  plan_keeper(const agreement& agree, bucket_memory<Allocator>& memory, Planner& planner,
              const std::vector<param_info>& infos, const bucket_policy& policy) noexcept
      : agree_(agree), memory_(memory), planner_(planner), infos_(infos), policy_(policy) {}

  /// The plan at construction, confirmed by every rank (not yet allocated).
  bucket_plan first_plan(const dp_options& opts) {
    // View mode hands bucket memory to the engine, which keeps the pointers: that layout must
    // never move, so it is final from the start (docs/data-parallel.md, "View mode"). With
    // uneven inputs a rank may join before it ever ran a step, and rank 0 may be that rank:
    // there is no step every rank has seen to rebuild from ("Uneven inputs").
    // The sharded mode's optimizer state follows the plan's shards: it never moves either.
    settled_ = opts.gradient_as_bucket_view || !policy_.rebuild_from_ready_order || opts.uneven_inputs || opts.shard;
    bucket_plan plan = planner_.plan(infos_, policy_, {});
    agree_.check_plan(plan, settled_, "at construction");
    return plan;
  }

  /// The bucket layout can no longer change (view mode, or after the rebuild).
  bool settled() const noexcept { return settled_; }
  /// Bumped at each new layout put in place.
  std::uint64_t layout_version() const noexcept { return layout_version_; }

  /// Re-plan once from rank 0's observed ready order (`order`, this rank's; rank 0's goes to
  /// `agreed`). Runs inside finish(), with no collective in flight, only in copy mode (slots hold
  /// nothing between steps and no pointer into them was handed out); the old buckets are freed
  /// first, so an arena sized for one plan fits the other.
  void rebuild(const std::vector<std::size_t>& order, std::vector<std::size_t>* agreed) {
    settled_ = true;
    if (order.size() != infos_.size()) return;  // cannot happen: every parameter was ready or unused
    install(agree_.rebuilt_plan(planner_, infos_, policy_, order, agreed), "after the rebuild");
  }

  /// Puts `fresh` in place when it differs from the plan in use (new buckets, a new layout version),
  /// then every rank confirms one plan. Copy mode only, with no collective in flight: nothing
  /// lives in the buckets between steps and no pointer into them was handed out.
  void install(bucket_plan fresh, const char* when) {
    if (!(fresh == memory_.plan())) {
      memory_.allocate(std::move(fresh));
      ++layout_version_;
    }
    agree_.check_plan(memory_.plan(), settled_, when);
  }

 private:
  const agreement& agree_;
  bucket_memory<Allocator>& memory_;
  Planner& planner_;
  const std::vector<param_info>& infos_;
  const bucket_policy& policy_;
  bool settled_ = true;
  std::uint64_t layout_version_ = 0;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
