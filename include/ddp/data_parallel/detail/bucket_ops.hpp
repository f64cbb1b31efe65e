#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/bucket_ops.hpp
/// `bucket_ops`: what a wrapper does with one bucket in a step (launch its collective, wait for
/// it, copy its average back, call the `on_bucket_reduced` hook) and with the slot of a parameter
/// that produced no gradient; the timeline's marks of those moments.
// IWYU pragma: private

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/bucket_tag.hpp>
#include <ddp/clock.hpp>
#include <ddp/data_parallel/bucket_memory.hpp>
#include <ddp/data_parallel/bucket_state.hpp>
#include <ddp/data_parallel/detail/shard_ops.hpp>
#include <ddp/data_parallel/detail/step_context.hpp>
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
  bucket_ops(const step_context<Reducer, Allocator>& c, std::unique_ptr<timeline>& tl,
             shard_ops<Reducer, Allocator>* shards) noexcept
      : c_(c), timeline_(tl), shards_(shards) {}

  /// Allocates the buckets of `plan` and the side buffer (in view mode holding the engine's current
  /// gradients, so nothing accumulated is lost), after opening the timeline: a rank that cannot
  /// open its file fails construction on every rank (docs/tuning.md, "See a step: the timeline").
  void set_up(bucket_plan plan, const step_sync<Reducer, Allocator>& sync) {
    timeline_ = timeline::open(c_.opts, c_.pg.rank(), c_.pg.size());
    if (timeline_) c_.state.on_ready([t = timeline_.get()](std::size_t b) { t->bucket_ready(b); });
    if (shards_ != nullptr)
      c_.memory.allocate_pooled(std::move(plan), static_cast<std::size_t>(c_.pg.size()));
    else
      c_.memory.allocate(std::move(plan));
    if (const std::size_t side = sync.side_bytes(); side > 0) c_.memory.allocate_side(side);
    if (c_.opts.gradient_as_bucket_view)
      for (std::size_t i = 0; i < c_.views.size(); ++i) c_.memory.copy_in(i, c_.views[i].grad, c_.views[i].bytes());
    if (shards_ != nullptr) shards_->allocate();
    in_place_ = reads_in_place();
    if (in_place_) sources_.assign(c_.views.size(), nullptr);
  }

  /// The wrapper's destructor: in a forked child, frees its copy of host memory only (CUDA
  /// memory is the parent's driver's) and waits for nothing; after an exception in the middle
  /// of a step (`unwinding`), tells the peers why; then waits (bounded) for collectives in
  /// flight and frees the buckets, or leaks them where a collective does not end (it may still
  /// write into them).
  void release(bool forked, bool unwinding) noexcept {
    if (forked) {
      const auto where = c_.memory.allocator().location();
      if (where != memory_kind::host && where != memory_kind::shared) c_.memory.leak();
      return;
    }
    if (c_.state.is_open() && unwinding) c_.guarded.leave_unfinished();
    if (!c_.memory.drain(c_.pg.timeout(), [this] { c_.guarded.abort_reducer(); })) {
      c_.memory.leak();
      if (shards_ != nullptr) shards_->leak();
    }
  }

  /// grad_ready's gradient i into its bucket now, in copy mode (the sharded mode copies a
  /// bucket's gradients when it launches, into one pooled buffer: docs/sharded.md).
  /// Where the reducer reads a bucket's data in place (dp_options::copy_gradients_at_ready), the
  /// gradient stays where it is and its address goes with the bucket's collective instead, which
  /// writes the average there too (copy_back skips it).
  void copy_in(std::size_t i) {
    if (shards_ == nullptr && !c_.opts.gradient_as_bucket_view) stage(i);
  }

  /// In finish(): the parameters never ready (`missing`) count as unused, then every bucket not
  /// launched yet is, in plan order.
  void launch_rest(const std::vector<std::size_t>& missing) {
    c_.guarded("finish", -1, [&] {
      c_.state.begin_finish();
      for (std::size_t i : missing) {
        c_.state.claim(i);
        c_.state.set_unused(i);
        c_.guarded("finish (a parameter never ready)", i, [&] { fill_unused(i); });
        c_.state.complete(i, true, false);  // not backward's work: the statistics ignore it
      }
      c_.state.launch_ready();
    });
  }

  /// Readies the step state and the buckets for the next step (`settled`: the layout is final).
  void reset_step(bool settled) {
    c_.state.reset(c_.memory.plan(), !settled);
    c_.memory.clear_requests();
    std::fill(sources_.begin(), sources_.end(), nullptr);
    staged_.clear();
  }

  /// bucket_state's launch: bucket b's collective, in plan order, under bucket_state's lock.
  /// The sharded mode copies a bucket's gradients only here, once the bucket is complete, into
  /// the one pooled buffer (after the previous bucket's reduce-scatter has released it): see
  /// docs/sharded.md, "Memory".
  void launch(std::size_t b) {
    const auto& bk = c_.memory.plan().buckets[b];
    // The flight record names the bucket (docs/forensics.md); a communication hook sees its tensors.
    const bucket_tag tag{static_cast<std::int32_t>(b), static_cast<std::int64_t>(c_.step), layout(b)};
    if (bk.numel > 0) {
      if (shards_ != nullptr) {
        shards_->before_bind(b);
        c_.memory.bind(b, true, wait_patience(c_.opts, c_.pg), c_.pg.rank());
        for (const auto& e : bk.entries) fill_slot(e.param);
      }
      c_.memory.track(b, shards_ != nullptr
                             ? shards_->launch(b, tag)
                             : allreduce_async_tagged(c_.red, c_.memory.buffer(b), bk.numel, bk.type,
                                                      bucket_op(c_.opts.average, c_.opts.uneven_inputs, bk.type),
                                                      in_place_ ? with_sources(b, tag) : tag));
    }
    if (timeline_) timeline_->bucket_launched(b, steady_clock::now());
  }

  /// Waits (bounded by the timeout) for bucket b's reduction. A failed collective is a verdict
  /// the reducer already posted to every rank: it is recorded without blaming this rank.
  void wait(std::size_t b, const char* what = "finish") {
    const auto t_wait = timeline_ ? steady_clock::now() : steady_clock::time_point{};
    c_.guarded(
        what, -1, [&] { c_.memory.wait(b, wait_patience(c_.opts, c_.pg), c_.pg.rank()); }, false);
    const auto& req = c_.memory.in_flight(b);
    c_.state.set_reduced(b, req.valid() ? req.finished_at() : c_.state.launched_at(b));
    if (timeline_) timeline_->bucket_waited(b, t_wait, steady_clock::now());
  }

  /// Copy mode: bucket b's averages back into the engine's gradients. The sharded mode: bucket
  /// b's buffer goes back to the pool (its average is in this rank's gradient shards).
  void copy_back(std::size_t b) {
    if (shards_ != nullptr) {
      shards_->reduced(b);
      return;
    }
    if (c_.opts.gradient_as_bucket_view) return;
    for (const auto& e : c_.memory.plan().buckets[b].entries) {
      if (in_place_ && sources_[e.param] != nullptr) continue;  // the reducer wrote it there
      c_.guarded("finish (copying the average back)", e.param,
                 [&] { c_.memory.copy_out(e.param, c_.views[e.param].grad, c_.views[e.param].bytes()); });
    }
  }

  /// The bucket slot of a parameter that is not ready in a synchronized step: zero, or what
  /// no_sync() steps accumulated (PyTorch DDP keeps an accumulated gradient the same way).
  void fill_unused(std::size_t i) {
    if (shards_ == nullptr) fill_slot(i);  // the sharded mode fills slots at launch
  }

  /// The timeline's record of the step finish() ends, before the plan can change (the rebuild).
  void record_timeline(steady_clock::time_point t_call, const std::vector<std::string>& names,
                       std::uint64_t generation) noexcept {
    if (!timeline_) return;
    timeline_->end_step(c_.step, c_.state, c_.memory.plan(), names, generation, t_call,
                        !c_.opts.gradient_as_bucket_view,
                        [this](std::size_t b) -> const request& { return c_.memory.in_flight(b); });
  }

  /// The `on_bucket_reduced` hook (empty: none); the sharded mode refuses one.
  void set_hook(std::function<void(const reduced_bucket&)> fn) {
    if (shards_ != nullptr && fn)
      raise(errc::unsupported, c_.pg.rank(),
            "on_bucket_reduced() in the sharded mode (dp_options::shard): the engine's gradients are not averaged; "
            "step(optimizer) steps the shards");
    hook_ = std::move(fn);
  }
  bool has_hook() const noexcept { return static_cast<bool>(hook_); }
  /// True when the buckets' collectives read the gradients where they are (reads_in_place()).
  bool in_place() const noexcept { return in_place_; }

  /// In a synchronized finish(), bucket by bucket in plan order (later buckets keep reducing
  /// meanwhile): waits for it, `counted(b)` (uneven inputs), copies its average back and, without
  /// the unused-parameter record, calls the on_bucket_reduced hook at once; with it, once
  /// `exchange()` (the record) has said which parameters no rank used (docs/data-parallel.md,
  /// "Optimizer overlap"). Returns what `exchange()` returned.
  template <class Counted, class Exchange>
  auto complete(Counted&& counted, Exchange&& exchange) {
    const std::size_t n = c_.memory.plan().buckets.size();
    const bool hook_early = has_hook() && !c_.opts.find_unused_parameters;
    for (std::size_t b = 0; b < n; ++b) {
      wait(b);
      counted(b);
      copy_back(b);
      if (hook_early) call_hook(b);
    }
    auto out = exchange();
    if (has_hook() && !hook_early)
      for (std::size_t b = 0; b < n; ++b) call_hook(b);
    return out;
  }

  /// The bucket hook for bucket b (its parameters in plan order).
  void call_hook(std::size_t b) {
    hook_params_.clear();
    for (const auto& e : c_.memory.plan().buckets[b].entries) hook_params_.push_back(e.param);
    c_.guarded("finish (the bucket hook, on_bucket_reduced)", -1, [&] {
      hook_(reduced_bucket{b, std::span<const std::size_t>(hook_params_), c_.step});
    });
  }

 private:
  /// Bucket b's tensors as a communication hook sees them (reducer/hooked.hpp's comm_tensor),
  /// rebuilt at each launch (the plan may have changed; no allocation once each bucket's list
  /// has grown). Only for a hooked reducer: nothing else reads them.
  std::span<const comm_tensor> layout(std::size_t b) {
    if constexpr (requires { typename Reducer::hook_type; })
      return build_layout(b);
    else
      return in_place_ ? build_layout(b) : std::span<const comm_tensor>{};
  }
  std::span<const comm_tensor> build_layout(std::size_t b) {
    const auto& bk = c_.memory.plan().buckets[b];
    if (layouts_.size() <= b) layouts_.resize(c_.memory.plan().buckets.size());
    auto& out = layouts_[b];
    out.clear();
    for (const auto& e : bk.entries) {
      const auto& shape = c_.views[e.param].shape;
      const std::size_t rows = shape.empty() ? e.numel : static_cast<std::size_t>(shape.front());
      out.push_back(comm_tensor{e.param, e.offset_elems, e.numel, rows});
    }
    return out;
  }

  /// True when the buckets' collectives read the gradients where they are (copy mode, host
  /// memory, a reducer whose reads_sources() says so, dp_options::copy_gradients_at_ready unset).
  /// Not with uneven_inputs: a step with joined ranks rescales each bucket's result in the
  /// bucket (detail/uneven.hpp) before it is copied back.
  bool reads_in_place() {
    if (shards_ != nullptr || c_.opts.gradient_as_bucket_view || c_.opts.copy_gradients_at_ready ||
        c_.opts.uneven_inputs)
      return false;
    const auto where = c_.memory.allocator().location();
    if (where != memory_kind::host && where != memory_kind::pinned && where != memory_kind::shared) return false;
    // An allocator whose copies are its own (a device, a test's counting) moves every byte;
    // auto_allocator's hooks do only when its buckets are on a device.
    if constexpr (bucket_memory<Allocator>::hooks) {
      if constexpr (requires { bool(c_.memory.allocator().copies_device_memory()); }) {
        if (c_.memory.allocator().copies_device_memory()) return false;
      } else {
        return false;
      }
    }
    if constexpr (requires { c_.red.reads_sources(); })
      return static_cast<bool>(c_.red.reads_sources());
    else
      return false;
  }

  /// Copy mode: gradient i into its slot, or (reading in place) its address noted for the launch.
  void stage(std::size_t i) {
    void* grad = c_.views[i].grad;
    if (in_place_ && grad != c_.memory.slot(i)) {
      check_kept(i, grad, c_.views[i].bytes());
      sources_[i] = grad;
    } else {
      c_.memory.copy_in(i, grad, c_.views[i].bytes());
    }
  }

  /// Reading in place needs each gradient kept until finish(). An engine that computes gradients
  /// in one scratch buffer and hands it over again and again (what the copy at grad_ready used
  /// to allow) shows as two gradients of one step in the same memory: errc::usage naming both,
  /// at the first step, never an average of overwritten memory.
  void check_kept(std::size_t i, const void* grad, std::size_t bytes) {
    if (bytes == 0) return;
    const auto* b = static_cast<const char*>(grad);
    const char* e = b + bytes;
    std::lock_guard lock(staged_mu_);
    auto next = staged_.upper_bound(b);
    std::size_t other = i;
    if (next != staged_.end() && next->first < e) other = next->second.second;
    if (next != staged_.begin() && std::prev(next)->second.first > b) other = std::prev(next)->second.second;
    if (other != i)
      raise(errc::usage, c_.pg.rank(),
            "grad_ready(" + std::to_string(i) + "): gradient " + std::to_string(i) +
                " lies in the memory of gradient " + std::to_string(other) +
                ", handed over earlier in this step; in copy mode the reducer reads each gradient where it is "
                "until finish() returns, so keep each gradient's memory until then, or set "
                "dp_options::copy_gradients_at_ready (a copy at grad_ready)",
            -1, static_cast<int>(i));
    staged_.emplace(b, std::pair{e, i});
  }

  /// `tag` with bucket b's sources: each tensor's gradient where it was staged in place, else
  /// (zero for an unused parameter, or copied) nullptr: in the buffer.
  bucket_tag with_sources(std::size_t b, bucket_tag tag) {
    if (bucket_sources_.size() <= b) bucket_sources_.resize(c_.memory.plan().buckets.size());
    auto& out = bucket_sources_[b];
    out.clear();
    bool any = false;
    for (const auto& x : tag.tensors) {
      out.push_back(sources_[x.param]);
      any = any || out.back() != nullptr;
    }
    if (any) tag.sources = out;
    return tag;
  }

  /// Parameter i's slot: its gradient, or zero when unused (and nothing accumulated for it;
  /// PyTorch DDP keeps an accumulated gradient the same way). View mode: the slot already holds it.
  void fill_slot(std::size_t i) {
    if (c_.state.unused(i) && !c_.state.accumulated(i))
      c_.memory.zero(i, c_.views[i].bytes());
    else if (!c_.opts.gradient_as_bucket_view)
      stage(i);
  }

  step_context<Reducer, Allocator> c_;
  std::unique_ptr<timeline>& timeline_;              // null unless DDP_TIMELINE or dp_options::timeline
  std::function<void(const reduced_bucket&)> hook_;  // on_bucket_reduced
  std::vector<std::size_t> hook_params_;             // the hook's current bucket
  shard_ops<Reducer, Allocator>* shards_;            // the sharded mode's, else null
  std::vector<std::vector<comm_tensor>> layouts_;    // layout(): per bucket, for a hooked reducer or in place
  bool in_place_ = false;                            // reads_in_place(), decided at set_up
  std::vector<void*> sources_;                       // per parameter: its gradient, read in place (this step)
  std::vector<std::vector<void*>> bucket_sources_;   // with_sources(): per bucket, for its collective
  std::mutex staged_mu_;                             // grad_ready may run on several threads
  std::map<const char*, std::pair<const char*, std::size_t>> staged_;  // this step's gradients read in place
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
