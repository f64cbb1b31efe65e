#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/bucket_ops.hpp
/// `bucket_ops`: what a wrapper does with one bucket in a step (launch its collective, wait for
/// it, copy its average back, call the `on_bucket_reduced` hook) and with the slot of a parameter
/// that produced no gradient; the timeline's marks of those moments.
// IWYU pragma: private

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/bucket_tag.hpp>
#include <ddp/clock.hpp>
#include <ddp/data_parallel/bucket_memory.hpp>
#include <ddp/data_parallel/bucket_state.hpp>
#include <ddp/data_parallel/detail/shard_ops.hpp>
#include <ddp/data_parallel/detail/step_guard.hpp>
#include <ddp/data_parallel/detail/step_sync.hpp>
#include <ddp/data_parallel/detail/uneven.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/data_parallel/timeline.hpp>
#include <ddp/parameter.hpp>
#include <ddp/planner/bucket_plan.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/detail/tagged.hpp>
#include <ddp/reducer/hooked.hpp>
#include <ddp/request.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// The per-bucket and per-slot work of one wrapper's steps. Holds references to the wrapper's
/// parts (and its timeline and step counter), which outlive it.
template <class Reducer, class Allocator>
class bucket_ops {
 public:
  bucket_ops(process_group& pg, const dp_options& opts, const std::vector<tensor_view>& views,
             bucket_memory<Allocator>& memory, bucket_state& state, Reducer& red, step_guard<Reducer>& guarded,
             std::unique_ptr<timeline>& tl, const std::uint64_t& step, shard_ops<Reducer, Allocator>* shards) noexcept
      : pg_(pg),
        opts_(opts),
        views_(views),
        memory_(memory),
        state_(state),
        red_(red),
        guarded_(guarded),
        timeline_(tl),
        step_(step),
        shards_(shards) {}

  /// Allocates the buckets of `plan` and the side buffer (in view mode holding the engine's current
  /// gradients, so nothing accumulated is lost), after opening the timeline: a rank that cannot
  /// open its file fails construction on every rank (docs/tuning.md, "See a step: the timeline").
  void set_up(bucket_plan plan, const step_sync<Reducer, Allocator>& sync) {
    timeline_ = timeline::open(opts_, pg_.rank(), pg_.size());
    if (timeline_) state_.on_ready([t = timeline_.get()](std::size_t b) { t->bucket_ready(b); });
    if (shards_ != nullptr)
      memory_.allocate_pooled(std::move(plan), static_cast<std::size_t>(pg_.size()));
    else
      memory_.allocate(std::move(plan));
    if (const std::size_t side = sync.side_bytes(); side > 0) memory_.allocate_side(side);
    if (opts_.gradient_as_bucket_view)
      for (std::size_t i = 0; i < views_.size(); ++i) memory_.copy_in(i, views_[i].grad, views_[i].bytes());
  }

  /// In finish(): the parameters never ready (`missing`) count as unused, then every bucket not
  /// launched yet is, in plan order.
  void launch_rest(const std::vector<std::size_t>& missing) {
    guarded_("finish", -1, [&] {
      state_.begin_finish();
      for (std::size_t i : missing) {
        state_.claim(i);
        state_.set_unused(i);
        guarded_("finish (a parameter never ready)", i, [&] { fill_unused(i); });
        state_.complete(i, true, false);  // not backward's work: the statistics ignore it
      }
      state_.launch_ready();
    });
  }

  /// Readies the step state and the buckets for the next step (`settled`: the layout is final).
  void reset_step(bool settled) {
    state_.reset(memory_.plan(), !settled);
    memory_.clear_requests();
  }

  /// bucket_state's launch: bucket b's collective, in plan order, under bucket_state's lock.
  /// The sharded mode copies a bucket's gradients only here, once the bucket is complete, into
  /// the one pooled buffer (after the previous bucket's reduce-scatter has released it): see
  /// docs/sharded.md, "Memory".
  void launch(std::size_t b) {
    const auto& bk = memory_.plan().buckets[b];
    // The flight record names the bucket (docs/forensics.md); a communication hook sees its tensors.
    const bucket_tag tag{static_cast<std::int32_t>(b), static_cast<std::int64_t>(step_), layout(b)};
    if (bk.numel > 0) {
      if (shards_ != nullptr) {
        memory_.bind(b, true, wait_patience(opts_, pg_), pg_.rank());
        for (const auto& e : bk.entries) fill_slot(e.param);
      }
      memory_.track(b, shards_ != nullptr
                           ? shards_->reduce_scatter(b, tag)
                           : allreduce_async_tagged(red_, memory_.buffer(b), bk.numel, bk.type,
                                                    bucket_op(opts_.average, opts_.uneven_inputs, bk.type), tag));
    }
    if (timeline_) timeline_->bucket_launched(b, steady_clock::now());
  }

  /// Waits (bounded by the timeout) for bucket b's reduction. A failed collective is a verdict
  /// the reducer already posted to every rank: it is recorded without blaming this rank.
  void wait(std::size_t b, const char* what = "finish") {
    const auto t_wait = timeline_ ? steady_clock::now() : steady_clock::time_point{};
    guarded_(
        what, -1, [&] { memory_.wait(b, wait_patience(opts_, pg_), pg_.rank()); }, false);
    const auto& req = memory_.in_flight(b);
    state_.set_reduced(b, req.valid() ? req.finished_at() : state_.launched_at(b));
    if (timeline_) timeline_->bucket_waited(b, t_wait, steady_clock::now());
  }

  /// Copy mode: bucket b's averages back into the engine's gradients. The sharded mode: bucket
  /// b's buffer goes back to the pool (its average is in this rank's gradient shard).
  void copy_back(std::size_t b) {
    if (shards_ != nullptr) {
      memory_.unbind(b);
      return;
    }
    if (opts_.gradient_as_bucket_view) return;
    for (const auto& e : memory_.plan().buckets[b].entries)
      guarded_("finish (copying the average back)", e.param,
               [&] { memory_.copy_out(e.param, views_[e.param].grad, views_[e.param].bytes()); });
  }

  /// The bucket slot of a parameter that is not ready in a synchronized step: zero, or what
  /// no_sync() steps accumulated (PyTorch DDP keeps an accumulated gradient the same way).
  void fill_unused(std::size_t i) {
    if (shards_ == nullptr) fill_slot(i);  // the sharded mode fills slots at launch
  }

  /// Whether copies into the bucket wait for its launch (the sharded mode).
  bool deferred_copies() const noexcept { return shards_ != nullptr; }

  /// The timeline's record of the step finish() ends, before the plan can change (the rebuild).
  void record_timeline(steady_clock::time_point t_call, const std::vector<std::string>& names,
                       std::uint64_t generation) noexcept {
    if (!timeline_) return;
    timeline_->end_step(step_, state_, memory_.plan(), names, generation, t_call, !opts_.gradient_as_bucket_view,
                        [this](std::size_t b) -> const request& { return memory_.in_flight(b); });
  }

  /// The `on_bucket_reduced` hook (empty: none).
  void set_hook(std::function<void(const reduced_bucket&)> fn) { hook_ = std::move(fn); }
  bool has_hook() const noexcept { return static_cast<bool>(hook_); }

  /// The bucket hook for bucket b (its parameters in plan order).
  void call_hook(std::size_t b) {
    hook_params_.clear();
    for (const auto& e : memory_.plan().buckets[b].entries) hook_params_.push_back(e.param);
    guarded_("finish (the bucket hook, on_bucket_reduced)", -1, [&] {
      hook_(reduced_bucket{b, std::span<const std::size_t>(hook_params_), step_});
    });
  }

 private:
  /// Bucket b's tensors as a communication hook sees them (reducer/hooked.hpp's comm_tensor),
  /// rebuilt at each launch (the plan may have changed; no allocation once each bucket's list
  /// has grown). Only for a hooked reducer: nothing else reads them.
  std::span<const comm_tensor> layout(std::size_t b) {
    if constexpr (requires { typename Reducer::hook_type; }) {
      const auto& bk = memory_.plan().buckets[b];
      if (layouts_.size() <= b) layouts_.resize(memory_.plan().buckets.size());
      auto& out = layouts_[b];
      out.clear();
      for (const auto& e : bk.entries) {
        const auto& shape = views_[e.param].shape;
        const std::size_t rows = shape.empty() ? e.numel : static_cast<std::size_t>(shape.front());
        out.push_back(comm_tensor{e.param, e.offset_elems, e.numel, rows});
      }
      return out;
    } else {
      return {};
    }
  }

  /// Parameter i's slot: its gradient, or zero when unused (and nothing accumulated for it;
  /// PyTorch DDP keeps an accumulated gradient the same way). View mode: the slot already holds it.
  void fill_slot(std::size_t i) {
    if (state_.unused(i) && !state_.accumulated(i))
      memory_.zero(i, views_[i].bytes());
    else if (!opts_.gradient_as_bucket_view)
      memory_.copy_in(i, views_[i].grad, views_[i].bytes());
  }

  process_group& pg_;
  const dp_options& opts_;
  const std::vector<tensor_view>& views_;
  bucket_memory<Allocator>& memory_;
  bucket_state& state_;
  Reducer& red_;
  step_guard<Reducer>& guarded_;
  std::unique_ptr<timeline>& timeline_;  // null unless DDP_TIMELINE or dp_options::timeline
  const std::uint64_t& step_;
  std::function<void(const reduced_bucket&)> hook_;  // on_bucket_reduced
  std::vector<std::size_t> hook_params_;             // the hook's current bucket
  shard_ops<Reducer, Allocator>* shards_;            // the sharded mode's, else null
  std::vector<std::vector<comm_tensor>> layouts_;    // layout(): per bucket, for a hooked reducer
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
