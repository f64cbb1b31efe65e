#pragma once
/// \file data_parallel/fully_sharded.hpp
/// `ddp::fully_sharded`: the fully sharded mode (ZeRO-3, PyTorch's FSDP): the parameters are
/// sharded as well as the gradients and the optimizer state. The engine groups its parameters
/// into units (a block of layers each) and says where each unit's forward and backward run;
/// between them a unit's parameters and gradients are released from the engine's own tensors
/// (their pages given back to the kernel and, by default, made inaccessible), and each rank keeps
/// only its shard of every unit. See docs/sharded.md, "Fully sharded".
///
/// \code
/// ddp::fully_sharded fs{pg, params, {2, 2, 2}};  // three units of two parameters each
/// for (std::size_t u = 0; u < 3; ++u) { fs.gather(u); /* unit u's forward */ fs.release(u); }
/// for (std::size_t u = 3; u-- > 0;) { fs.begin_backward(u); /* unit u's backward */ fs.end_backward(u); }
/// fs.finish();
/// fs.step(opt);  // a ddp::shard_optimizer: ddp::adamw, ddp::sgd
/// \endcode

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/bucket_tag.hpp>
#include <ddp/clock.hpp>
#include <ddp/concepts.hpp>
#include <ddp/data_parallel/agreement.hpp>
#include <ddp/data_parallel/detail/failure_latch.hpp>
#include <ddp/data_parallel/detail/parameters.hpp>
#include <ddp/data_parallel/detail/released_pages.hpp>
#include <ddp/data_parallel/detail/setup_checks.hpp>
#include <ddp/data_parallel/detail/state_blob.hpp>
#include <ddp/data_parallel/detail/widen.hpp>
#include <ddp/data_parallel/detail/xxh64.hpp>
#include <ddp/data_parallel/shard_layout.hpp>
#include <ddp/data_parallel/timeline.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/fwd.hpp>
#include <ddp/optim/shard_optimizer.hpp>
#include <ddp/parameter.hpp>
#include <ddp/process_group.hpp>
#include <ddp/memory/auto_allocator.hpp>
#include <ddp/reducer/auto.hpp>
#include <ddp/reducer/detail/tagged.hpp>
#include <ddp/request.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Options of `ddp::fully_sharded`. Every rank passes the same (compared at construction).
struct fully_sharded_options {
  /// Release a unit's parameters after its forward (`release(u)`), gathering them again before
  /// its backward: the ZeRO-3 memory. Off, they stay from `gather(u)` to `end_backward(u)`: one
  /// all-gather per step, the gradients still sharded (ZeRO-2's memory while backward runs; FSDP's
  /// SHARD_GRAD_OP), from the same code path.
  bool reshard_after_forward = true;
  /// Start the all-gather of the next unit of the recorded order (the first step's) when a unit
  /// is gathered, so that it overlaps this unit's compute. A step whose order differs from the
  /// record prefetches nothing after the difference and records the new order.
  bool prefetch = true;
  /// A unit of fewer elements than this stays whole on every rank (its parameters are never
  /// released; the step all-gathers its update at once): tiny units would cost an all-gather's
  /// latency each for nothing (DeepSpeed's 1e5-element persistence threshold).
  std::size_t whole_below = 100000;
  /// Give a released unit's pages back to the kernel (madvise); off, the engine's tensors keep
  /// their memory and only the protection (below) applies.
  bool release_memory = true;
  /// Make a released unit's pages inaccessible, so that a touch outside the unit stops the
  /// process at once, naming the tensor and its unit; the partial pages at a tensor's ends are
  /// filled with NaN.
  bool protect_released = true;
  /// Average the gradients over the ranks (else sum them).
  bool average = true;
  /// The deadline of each wait for a collective; 0: the group's timeout.
  std::chrono::milliseconds timeout{0};
  /// A timeline file (a Chrome trace, as `dp_options::timeline`: rank r writes
  /// `<timeline>.rank<r>.json`; empty: the environment's `DDP_TIMELINE`, else none): each unit's
  /// gather, forward, release, begin_backward, backward and end_backward on the engine's thread,
  /// each all-gather and reduce-scatter on the thread that ran it, finish(), step() and the step.
  std::string timeline = {};
  /// Steps the timeline records before it stops; 0: `DDP_TIMELINE_STEPS`, else 1000.
  std::uint64_t timeline_steps = 0;
};

/// The fully sharded mode over `Reducer` (every reducer of ddp: ring and tree over tcp or shm,
/// shm, hierarchical, MPI), its collectives' buffers from `Allocator` bound to it (the host's
/// shared-memory segment under the default reducer on one host, where the all-gathers and
/// reduce-scatters read and write them in place). Collective: every rank makes the same calls
/// in the same order.
template <class Reducer, class Allocator>
class basic_fully_sharded {
  static_assert(reducer<Reducer>, "ddp: Reducer must satisfy ddp::reducer (concepts.hpp)");
  static_assert(device_allocator<Allocator>, "ddp: Allocator must satisfy ddp::device_allocator (concepts.hpp)");

 public:
  /// Wraps `params` (any `ddp::parameter_set`), grouped into units of `unit_params[u]`
  /// consecutive parameters each (all of one dtype: f32, f16 or bf16). Checks that ranks agree
  /// on the parameters, the units and the options, copies rank 0's values everywhere, keeps this
  /// rank's shard of each unit and releases the units (not the whole ones). The engine's tensors
  /// must outlive the wrapper, which gives their pages back when it goes.
  /// Throws `errc::invalid_argument` (no parameters, a parameter without elements or memory,
  /// units that do not cover the parameters), `errc::unsupported` (a dtype, a unit of mixed
  /// dtypes, memory on a device), `errc::mismatch` (ranks that differ).
  template <parameter_set ParamSet, class... ReducerArgs>
  basic_fully_sharded(process_group& pg, const ParamSet& params, std::vector<std::size_t> unit_params,
                      fully_sharded_options opts = {}, ReducerArgs&&... reducer_args)
      : pg_(pg),
        opts_(opts),
        views_(to_views(params)),
        names_(detail::own_names(views_)),
        red_(pg, std::forward<ReducerArgs>(reducer_args)...),
        alloc_(allocator_for<Allocator>(red_)),
        agree_(agreement_channel{pg_.rank(), pg_.size(), [this](const std::string& s) { return pg_.all_gather(s); },
                                 [this](std::span<std::uint64_t> w, int root) { pg_.broadcast(w, root); }}) {
    check_arguments(unit_params);
    if (!host_accessible(alloc_.location()))
      detail::raise(errc::unsupported, pg_.rank(),
                    std::string("fully_sharded: the allocator's memory (") + memory_kind_name(alloc_.location()) +
                        ") is not reachable from the CPU, which copies the units in and out; use a host, pinned or shm "
                        "allocator");
    agree_.check_signatures(views_);
    agree_.check_same_text("the fully sharded units and options", describe(unit_params));
    if (pg_.size() > 1) agreement::broadcast_values(red_, std::span<const tensor_view>(views_), pg_.timeout());
    lay_out(unit_params);
    for (std::size_t u = 0; u < units_.size(); ++u)
      if (!units_[u].whole) {
        release_params(u);
        release_grads(u);
      }
    timeline_ = timeline::open(opts_.timeline, opts_.timeline_steps, pg_.rank(), pg_.size());
  }

  basic_fully_sharded(const basic_fully_sharded&) = delete;
  basic_fully_sharded& operator=(const basic_fully_sharded&) = delete;

  /// Waits (bounded) for the collectives in flight; the engine's tensors get their pages back
  /// (accessible, holding zeros where released: gather_all() first to keep the values).
  ~basic_fully_sharded() {
    const auto until = detail::timing::collective_deadline(patience());
    bool stuck = false;
    for (auto* q : {&gathers_, &scatters_})
      for (auto& s : *q)
        if (s.req.valid()) try {
            s.req.wait(until);
          } catch (...) {
            stuck = stuck || !s.req.test();
          }
    if (stuck) {
      if constexpr (has_abort<Reducer>) red_.abort();
      // A collective may still write into them: leaked, never freed under it.
      for (auto* q : {&gathers_, &scatters_})
        for (auto& s : *q) s.buf = nullptr;
      for (auto& u : units_) (void)u.grad.release();
    }
    for (auto* q : {&gathers_, &scatters_})
      for (auto& s : *q)
        if (s.buf != nullptr) alloc_.deallocate(s.buf, s.bytes);
  }

  /// The number of units.
  std::size_t units() const noexcept { return units_.size(); }
  /// The parameters of unit `u`: [first, first + count).
  std::pair<std::size_t, std::size_t> unit_parameters(std::size_t u) const {
    const auto& U = at(u, "unit_parameters");
    return {U.first, U.count};
  }
  /// A gradient-accumulation scope (`no_sync()`).
  using no_sync_guard = detail::depth_guard;

  /// Gradient accumulation (PyTorch FSDP2's `set_requires_gradient_sync(False)`): a backward
  /// that begins while the guard lives reduces nothing; each unit's gradients stay whole in the
  /// engine's tensors (their memory held, the parameters still released) and add up over such
  /// backwards, until a backward without the guard reduce-scatters the sum. `finish()` ends an
  /// accumulating backward too; `step()` needs a synchronized one. errc::usage inside a backward.
  /// \code
  /// { auto acc = fs.no_sync(); micro_step(0); fs.finish(); }  // accumulates locally
  /// micro_step(1); fs.finish();                                // reduce-scatters both
  /// fs.step(opt);
  /// \endcode
  no_sync_guard no_sync() {
    live("no_sync");
    if (backward_) usage("no_sync() inside a backward (after its begin_backward): call it before the step's backward");
    return no_sync_guard(no_sync_depth_);
  }

  /// Whether unit `u` stays whole (fewer elements than `whole_below`).
  bool whole(std::size_t u) const { return at(u, "whole").whole; }

  /// Before unit `u`'s forward: its parameters into the engine's tensors (all-gathered from
  /// every rank's shard, or taken from the prefetch), then the next unit of the recorded order
  /// prefetched. Collective. errc::usage when `u` is gathered already and not released.
  void gather(std::size_t u) {
    live("gather");
    auto& U = at(u, "gather");
    if (U.forward_open)
      usage("gather(" + std::to_string(u) + "): unit " + std::to_string(u) + " is gathered already (its release(" +
            std::to_string(u) + ") is missing)");
    if (backward_) usage("gather(" + std::to_string(u) + ") after the backward began: begin_backward(unit) there");
    const auto t0 = steady_clock::now();
    if (!step_open_) step_open_ = true, step_begin_ = t0;
    guarded([&] {
      note('g', u);
      const bool had = U.present || U.prefetched != nullptr;
      bring(u);
      U.forward_open = true;
      advance(fwd_, u);
      U.since = mark("gather", u, t0, had);
    });
  }

  /// After unit `u`'s forward: its parameters are released (kept until its backward with
  /// `reshard_after_forward` off). errc::usage when `u` is not gathered (released twice).
  void release(std::size_t u) {
    live("release");
    auto& U = at(u, "release");
    if (!U.forward_open)
      usage("release(" + std::to_string(u) + "): unit " + std::to_string(u) +
            " is not gathered (released twice, or never gathered)");
    const auto t0 = steady_clock::now();
    if (timeline_) timeline_->thread_span("forward unit " + std::to_string(u), U.since, t0, unit_args(u));
    guarded([&] {
      note('r', u);
      U.forward_open = false;
      if (opts_.reshard_after_forward && !U.whole && !backward_begins_with(u)) release_params(u);
      mark("release", u, t0);
    });
  }

  /// Before unit `u`'s backward: its parameters present (gathered again where released), its
  /// gradients accessible and zero, and the next unit of the backward's recorded order
  /// prefetched. Collective. errc::usage when its forward is still open, or its backward is.
  void begin_backward(std::size_t u) {
    live("begin_backward");
    auto& U = at(u, "begin_backward");
    if (U.forward_open)
      usage("begin_backward(" + std::to_string(u) + "): unit " + std::to_string(u) +
            " is still gathered for its forward (release it first)");
    if (U.backward_open || U.reduced)
      usage("begin_backward(" + std::to_string(u) + "): unit " + std::to_string(u) + "'s backward " +
            (U.backward_open ? "is already open" : "ran already in this step"));
    const auto t0 = steady_clock::now();
    if (!step_open_) step_open_ = true, step_begin_ = t0;
    guarded([&] {
      note('b', u);
      if (!backward_) sync_ = no_sync_depth_ == 0;  // the first unit of this backward decides
      backward_ = true;
      const bool had = U.present || U.prefetched != nullptr;
      bring(u);
      open_grads(u);
      U.backward_open = true;
      advance(bwd_, u);
      U.since = mark("begin_backward", u, t0, had);
    });
  }

  /// After unit `u`'s backward: its gradients are complete. They are reduce-scattered into
  /// this rank's gradient shard (asynchronously; `finish()` waits), and the unit's parameters
  /// and gradients released. errc::usage without `begin_backward(u)`.
  void end_backward(std::size_t u) {
    live("end_backward");
    auto& U = at(u, "end_backward");
    if (!U.backward_open)
      usage("end_backward(" + std::to_string(u) + ") without begin_backward(" + std::to_string(u) + ")");
    const auto t0 = steady_clock::now();
    if (timeline_) timeline_->thread_span("backward unit " + std::to_string(u), U.since, t0, unit_args(u));
    guarded([&] {
      note('e', u);
      U.backward_open = false;
      U.reduced = true;
      if (!sync_) {  // accumulating: the gradients stay whole and held for the next backward
        U.accumulated = true;
        if (!U.whole) release_params(u);
      } else {
        U.accumulated = false;
        scatter(u);
        if (!U.whole) {
          release_params(u);
          release_grads(u);
        }
      }
      mark("end_backward", u, t0);
    });
  }

  /// After the backward: every unit's gradient reduce-scatter ended; this rank holds the
  /// averaged gradient shard of every unit. Checks that every rank ran the units in the same
  /// order. errc::usage when a unit is still open or had no backward in this step.
  void finish() {
    live("finish");
    std::string missing;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      const auto& U = units_[u];
      if (U.forward_open || U.backward_open)
        usage("finish(): unit " + std::to_string(u) + " is still open (" +
              (U.forward_open ? "gathered, not released" : "begin_backward without end_backward") + ")");
      if (!U.reduced) missing += (missing.empty() ? "" : ", ") + std::to_string(u);
    }
    if (!missing.empty())
      usage("finish(): unit(s) " + missing +
            " had no backward in this step (begin_backward and end_backward for every unit)");
    const auto t0 = steady_clock::now();
    guarded([&] {
      for (auto& s : scatters_) wait(s, "the gradients' reduce-scatter");
      for (auto& s : gathers_) {  // a prefetch nobody took (the order changed): dropped
        wait(s, "a prefetched all-gather");
        s.unit = npos;
      }
      for (auto& U : units_) U.prefetched = nullptr;
      check_order();
      for (auto& U : units_) U.reduced = false;
      backward_ = false;
      fwd_.finish_step();
      bwd_.finish_step();
      fresh_ = sync_;
      accumulated_ = !sync_;
    });
    if (timeline_) timeline_->thread_span("finish()", t0, steady_clock::now(), {});
  }

  /// After `finish()`: one optimizer step on every shard this rank holds (a
  /// `ddp::shard_optimizer` of the same `signature()` on every rank), the updated values kept in
  /// the shards until each unit's next gather; whole units are all-gathered at once. Collective.
  template <shard_optimizer Optimizer>
  void step(Optimizer& opt) {
    live("step");
    if (!fresh_)
      usage(accumulated_
                ? "step(): the last backward accumulated under no_sync(); run one without it, then finish(), first"
                : "step(): no finish() since the last step (or none at all)");
    for (std::size_t u = 0; u < units_.size(); ++u)
      if (units_[u].forward_open)  // its tensors would keep the values of before the step
        usage("step(): unit " + std::to_string(u) + " is gathered (release it, or release_all(), first)");
    const std::size_t k = opt.state_per_element();
    if (!agreed_) {
      agree_.check_same_text("the shard optimizer (its signature())", opt.signature() + " state=" + std::to_string(k));
      agreed_ = true;
    }
    if (k_ == npos) {
      for (auto& U : units_) U.state.assign(k * U.values.size(), 0.0f);
      k_ = k;
    } else if (k != k_) {
      usage("step(): the optimizer keeps " + std::to_string(k) + " floats per element, the shards hold " +
            std::to_string(k_) + " (pass the same optimizer every step)");
    }
    fresh_ = false;
    ++steps_;
    const auto t0 = steady_clock::now();
    guarded([&] {
      for (std::size_t u = 0; u < units_.size(); ++u) step_unit(opt, u);
      for (std::size_t u = 0; u < units_.size(); ++u)
        if (units_[u].whole) {
          issue_gather(u);
          take_gather(u);
        }
    });
    if (timeline_) {
      timeline_->thread_span("step() (optimizer)", t0, steady_clock::now(), {});
      timeline_->step_span(steps_, step_open_ ? step_begin_ : t0, "\"units\":" + std::to_string(units_.size()));
    }
    step_open_ = false;
  }

  /// Every unit's parameters into the engine's tensors, kept there (as if each were gathered)
  /// until `release_all()`: to evaluate, or to save a checkpoint of the whole model. Collective.
  void gather_all() {
    for (std::size_t u = 0; u < units_.size(); ++u)
      if (!units_[u].forward_open) gather(u);
  }
  /// Releases every gathered unit.
  void release_all() {
    for (std::size_t u = 0; u < units_.size(); ++u)
      if (units_[u].forward_open) release(u);
  }

  /// The optimizer state (and the f32 master weights of f16 and bf16 units) of every rank's
  /// shards, gathered on rank 0 in parameter order: the sharded wrapper's blob
  /// (`data_parallel::sharded_state()`), which either mode's `load_sharded_state` takes back on
  /// any world size. Empty on the other ranks. Collective, between steps. A checkpoint:
  /// \code
  /// fs.gather_all();
  /// ddp::save_checkpoint(pg, "ckpt.ddp", params, fs.sharded_state());
  /// fs.release_all();
  /// \endcode
  std::vector<std::byte> sharded_state() {
    between("sharded_state");
    const std::size_t k = k_ == npos ? 0 : k_;
    bool narrow = false;
    for (const auto& U : units_) narrow = narrow || U.type != dtype::f32;
    const std::size_t m = narrow ? 1 : 0, width = k + m;
    const int world = pg_.size();
    std::vector<std::vector<float>> full;
    std::vector<shard_layout> all;
    if (pg_.rank() == 0) {
      for (const auto& v : views_) full.emplace_back(width * v.numel, 0.0f);
      for (int r = 0; r < world; ++r) all.push_back(shard_layout::of(plan_, r, world));
    }
    guarded([&] {
      for (std::size_t u = 0; u < units_.size() && width > 0; ++u) {
        const auto& U = units_[u];
        const std::size_t per = U.lay.per_rank;
        std::vector<float> in(width * per), out(width * per * static_cast<std::size_t>(world));
        if (k > 0) std::copy_n(U.state.data(), k * per, in.data());
        if (m == 1) std::copy_n(U.values.data(), per, in.data() + k * per);
        s_check_.req = red_.allgather_async(in.data(), out.data(), width * per, dtype::f32);
        wait(s_check_, "sharded_state: gathering the state");
        if (pg_.rank() != 0) continue;
        for (int r = 0; r < world; ++r)
          detail::state_blob::scatter_chunk(full, out.data() + static_cast<std::size_t>(r) * width * per, k, m,
                                            U.type != dtype::f32, per,
                                            all[static_cast<std::size_t>(r)].buckets[u].pieces, views_);
      }
    });
    if (pg_.rank() != 0) return {};
    return detail::state_blob::encode(k, m, steps_, views_, full);
  }

  /// Takes this rank's shards of a `sharded_state()` blob (of either sharded mode, written at any
  /// world size): the optimizer state, and the values, from the engine's tensors (the loaded
  /// parameters: every unit gathered) or, for f16 and bf16 units, from the blob's master weights.
  /// Local; every rank calls it with the same blob. errc::usage while a unit is released,
  /// errc::invalid_argument for a blob that is not one, errc::mismatch for other parameters.
  /// \code
  /// fs.gather_all();
  /// fs.load_sharded_state(ddp::load_checkpoint(pg, "ckpt.ddp", params));
  /// fs.release_all();
  /// \endcode
  void load_sharded_state(std::span<const std::byte> blob) {
    between("load_sharded_state");
    for (std::size_t u = 0; u < units_.size(); ++u)
      if (!units_[u].present)
        usage("load_sharded_state(): unit " + std::to_string(u) +
              " is released; gather_all() before loading the parameters and their state (the values of f32 units "
              "come from the engine's tensors)");
    const detail::state_blob::reader in(blob, views_, pg_.rank(), "load_sharded_state");
    for (auto& U : units_) {
      const bool narrow = U.type != dtype::f32;
      const std::size_t esz = dtype_size(U.type);
      U.state.assign(in.k * U.lay.per_rank, 0.0f);
      for (const auto& pc : U.lay.pieces) {
        in.read_piece(pc, U.state.data() + in.k * pc.shard_offset,
                      narrow ? U.values.data() + pc.shard_offset : nullptr);
        if (!narrow || in.m == 0)
          detail::widen_to_f32(U.values.data() + pc.shard_offset,
                               static_cast<const std::byte*>(views_[pc.param].data) + pc.param_offset * esz, pc.count,
                               U.type);
      }
    }
    k_ = in.k;
    steps_ = in.steps;
  }

  /// Bytes of parameters this rank holds between steps: its shard of every unit (f32 values),
  /// the whole units' tensors and the partial pages at the released tensors' ends.
  std::size_t param_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& U : units_) n += U.values.size() * sizeof(float) + (U.whole ? U.bytes : U.kept_bytes);
    return n;
  }
  /// The part of `param_bytes()` that is the partial pages at the released tensors' ends (an
  /// engine whose tensors are not page-aligned keeps up to two pages of each).
  std::size_t partial_page_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& U : units_) n += U.whole ? 0 : U.kept_bytes;
    return n;
  }
  /// The model's parameter bytes (every unit whole).
  std::size_t model_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& U : units_) n += U.bytes;
    return n;
  }
  /// Bytes of optimizer state this rank holds, and of its gradient shards.
  std::size_t state_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& U : units_) n += U.state.size() * sizeof(float);
    return n;
  }
  std::size_t gradient_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& U : units_) n += U.lay.per_rank * dtype_size(U.type);
    return n;
  }
  /// The optimizer steps so far.
  std::uint64_t steps() const noexcept { return steps_; }
  /// All-gathers issued so far (prefetches included), and those that a gather found done or in
  /// flight already (prefetched).
  std::uint64_t gathers_issued() const noexcept { return issued_; }
  std::uint64_t gathers_prefetched() const noexcept { return prefetch_hits_; }
  /// The time gathers waited for their all-gather to end, in all: what the prefetch did not
  /// hide behind the previous unit's compute.
  std::chrono::nanoseconds gather_wait() const noexcept { return gather_wait_; }
  /// This rank's averaged gradient shard of unit `u` after `finish()` (the unit's dtype,
  /// `shard_elements(u)` elements), and its f32 values.
  const void* grad_shard(std::size_t u) const { return at(u, "grad_shard").grad.get(); }
  std::span<const float> shard_values(std::size_t u) const { return at(u, "shard_values").values; }
  std::size_t shard_elements(std::size_t u) const { return at(u, "shard_elements").lay.per_rank; }

 private:
  static constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

  /// A buffer of a collective in flight: a gather's (all ranks' chunks) or a scatter's (the
  /// unit's flat gradients).
  struct slot {
    std::byte* buf = nullptr;  // from the allocator
    std::size_t bytes = 0;
    request req;
    std::size_t unit = npos;
    const char* kind = "";  // for the timeline: "all-gather" or "reduce-scatter"
  };

  struct unit_state {
    std::size_t first = 0, count = 0;  // parameters [first, first + count)
    dtype type = dtype::f32;
    std::size_t numel = 0, bytes = 0;
    bool whole = false;
    shard_layout::bucket lay;                                  // this rank's shard of the unit's flat, padded vector
    std::vector<std::pair<std::size_t, std::size_t>> entries;  // per parameter: (offset in the unit, numel)
    std::vector<float> values;                                 // this rank's shard, f32
    std::vector<float> state;                                  // k floats per element
    std::unique_ptr<std::byte[]> grad;                         // the averaged gradient shard
    std::vector<detail::released::region> params, grads;       // per parameter
    std::size_t kept_bytes = 0;                                // the released tensors' partial pages
    bool present = false;                                      // the parameters are in the engine's tensors
    bool forward_open = false, backward_open = false, reduced = false;
    bool accumulated = false;          // its gradients hold a no_sync backward's sum (kept accessible)
    slot* prefetched = nullptr;        // its gather in flight
    steady_clock::time_point since{};  // for the timeline: when its forward or backward began
  };

  /// The recorded order of one pass (forward or backward) and where this step is in it.
  struct order {
    std::vector<std::size_t> record, now;
    std::size_t pos = 0;
    bool valid = false;   // record holds a whole step's order
    bool broken = false;  // this step left the record
    void finish_step() {
      if (!valid || broken) {
        record = now;
        valid = true;
      }
      now.clear();
      pos = 0;
      broken = false;
    }
  };

  // ---- construction -------------------------------------------------------------------------

  void check_arguments(const std::vector<std::size_t>& unit_params) const {
    const int rank = pg_.rank();
    if (views_.empty())
      detail::raise(errc::invalid_argument, rank,
                    "fully_sharded: no parameters (an engine that allocates its parameters lazily must run once, or "
                    "build them, before it is wrapped)");
    for (std::size_t i = 0; i < views_.size(); ++i) {
      const auto& v = views_[i];
      if (v.numel == 0 || v.data == nullptr || v.grad == nullptr)
        detail::raise(errc::invalid_argument, rank,
                      "fully_sharded: " + detail::parameter_label(i, v.name) +
                          " has no elements or no memory yet (build the engine's parameters before wrapping them)",
                      -1, static_cast<int>(i));
      if (v.device >= 0)
        detail::raise(errc::unsupported, rank,
                      "fully_sharded: " + detail::parameter_label(i, v.name) +
                          " lives on a device; the fully sharded mode shards host memory",
                      -1, static_cast<int>(i));
      if (v.type != dtype::f32 && v.type != dtype::f16 && v.type != dtype::bf16)
        detail::raise(errc::unsupported, rank,
                      "fully_sharded: " + detail::parameter_label(i, v.name) + " is " + dtype_name(v.type) +
                          "; the shard optimizers step f32, f16 and bf16 parameters",
                      -1, static_cast<int>(i));
    }
    std::size_t total = 0;
    for (std::size_t u = 0; u < unit_params.size(); ++u) {
      if (unit_params[u] == 0)
        detail::raise(errc::invalid_argument, rank, "fully_sharded: unit " + std::to_string(u) + " has no parameters");
      for (std::size_t i = total; i < total + unit_params[u] && i < views_.size(); ++i)
        if (views_[i].type != views_[total].type)
          detail::raise(errc::unsupported, rank,
                        "fully_sharded: unit " + std::to_string(u) + " mixes dtypes (" +
                            detail::parameter_label(total, views_[total].name) + " is " +
                            dtype_name(views_[total].type) + ", " + detail::parameter_label(i, views_[i].name) +
                            " is " + dtype_name(views_[i].type) + "): one dtype per unit",
                        -1, static_cast<int>(i));
      total += unit_params[u];
    }
    if (total != views_.size())
      detail::raise(errc::invalid_argument, rank,
                    "fully_sharded: the units hold " + std::to_string(total) + " parameters, the model has " +
                        std::to_string(views_.size()) +
                        " (unit_params lists each unit's count of consecutive "
                        "parameters)");
  }

  std::string describe(const std::vector<std::size_t>& unit_params) const {
    std::string s = "units";
    for (auto n : unit_params) s += " " + std::to_string(n);
    s += " reshard_after_forward=" + std::to_string(opts_.reshard_after_forward) +
         " prefetch=" + std::to_string(opts_.prefetch) + " whole_below=" + std::to_string(opts_.whole_below) +
         " average=" + std::to_string(opts_.average);
    return s;
  }

  /// Each unit's shard (a plan of one bucket per unit: `shard_layout` cuts it), its f32 values
  /// from the engine's (rank 0's) parameters, its gradient shard and its tensors' regions.
  void lay_out(const std::vector<std::size_t>& unit_params) {
    bucket_plan plan;
    std::size_t first = 0;
    for (std::size_t count : unit_params) {
      bucket b;
      b.type = views_[first].type;
      for (std::size_t i = first; i < first + count; ++i) {
        b.entries.push_back({i, b.numel, views_[i].numel});
        b.numel += views_[i].numel;
        b.bytes += views_[i].bytes();
      }
      plan.buckets.push_back(std::move(b));
      first += count;
    }
    const auto layout = shard_layout::of(plan, pg_.rank(), pg_.size());
    plan_ = plan;
    first = 0;
    units_.resize(unit_params.size());
    std::size_t widest = 0;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      auto& U = units_[u];
      U.first = first;
      U.count = unit_params[u];
      U.type = plan.buckets[u].type;
      U.numel = plan.buckets[u].numel;
      U.bytes = plan.buckets[u].bytes;
      U.whole = U.numel < opts_.whole_below;
      U.lay = layout.buckets[u];
      for (const auto& e : plan.buckets[u].entries) U.entries.emplace_back(e.offset_elems, e.numel);
      U.values.assign(U.lay.per_rank, 0.0f);
      const std::size_t esz = dtype_size(U.type);
      for (const auto& pc : U.lay.pieces)
        detail::widen_to_f32(U.values.data() + pc.shard_offset,
                             static_cast<const std::byte*>(views_[pc.param].data) + pc.param_offset * esz, pc.count,
                             U.type);
      U.grad = std::make_unique<std::byte[]>(std::max<std::size_t>(U.lay.per_rank * esz, 1));
      U.present = true;
      for (std::size_t i = U.first; i < U.first + U.count; ++i) {
        const std::string what = detail::parameter_label(i, views_[i].name) + " of unit " + std::to_string(u);
        U.params.emplace_back(views_[i].data, views_[i].bytes(), what);
        U.grads.emplace_back(views_[i].grad, views_[i].bytes(), "the gradient of " + what);
        U.kept_bytes += views_[i].bytes() - U.params.back().releasable_bytes();
      }
      widest = std::max(widest, U.lay.padded * esz);
      first += U.count;
    }
    // Each rank's chunk of a gather carries a 4-byte trailer: the unit and the pass, which every
    // rank checks (the same order on every rank, or a clear error).
    gather_bytes_ = 0;
    for (const auto& U : units_)
      gather_bytes_ = std::max(gather_bytes_, (U.lay.per_rank + trailer(U.type)) * dtype_size(U.type) *
                                                  static_cast<std::size_t>(pg_.size()));
    scatter_bytes_ = std::max<std::size_t>(widest, 1);
    gathers_.resize(2);
    scatters_.resize(2);
  }

  // ---- the gathers --------------------------------------------------------------------------

  static std::size_t trailer(dtype t) noexcept { return 4 / dtype_size(t); }

  /// Unit u's parameters present in the engine's tensors: from its prefetch, or gathered now.
  void bring(std::size_t u) {
    auto& U = units_[u];
    if (U.present) return;
    if (U.prefetched == nullptr)
      issue_gather(u);
    else
      ++prefetch_hits_;
    take_gather(u);
  }

  /// The all-gather of unit u's shards into a gather slot, tagged with the unit and the pass.
  void issue_gather(std::size_t u) {
    auto& U = units_[u];
    slot& s = gather_slot();
    const std::size_t esz = dtype_size(U.type), chunk = U.lay.per_rank + trailer(U.type);
    std::byte* mine = s.buf + static_cast<std::size_t>(pg_.rank()) * chunk * esz;
    detail::narrow_from_f32(mine, U.values.data(), U.lay.per_rank, U.type);
    const std::uint32_t mark = marker(u);
    std::memcpy(mine + U.lay.per_rank * esz, &mark, 4);
    s.unit = u;
    s.kind = "all-gather";
    s.req = detail::allgather_async_tagged(red_, mine, s.buf, chunk, U.type, tag(u));
    U.prefetched = &s;
    ++issued_;
  }

  /// The unit's gather ends: every rank's trailer checked, its pages accessible again, the
  /// chunks copied into the engine's tensors.
  void take_gather(std::size_t u) {
    auto& U = units_[u];
    slot& s = *U.prefetched;
    const auto t0 = steady_clock::now();
    wait(s, "the all-gather of a unit's parameters");
    gather_wait_ += steady_clock::now() - t0;
    U.prefetched = nullptr;
    const std::size_t esz = dtype_size(U.type), chunk = U.lay.per_rank + trailer(U.type);
    std::uint32_t mark = 0;  // what this rank sent: the unit, and the pass it was issued in
    std::memcpy(&mark, s.buf + (static_cast<std::size_t>(pg_.rank()) * chunk + U.lay.per_rank) * esz, 4);
    for (int r = 0; r < pg_.size(); ++r) {
      std::uint32_t theirs = 0;
      std::memcpy(&theirs, s.buf + (static_cast<std::size_t>(r) * chunk + U.lay.per_rank) * esz, 4);
      if (theirs != mark) {
        failed_ = std::make_exception_ptr(error(errc::mismatch, pg_.rank(),
                                                "fully_sharded: rank " + std::to_string(r) + " gathered " +
                                                    describe_marker(theirs) + " where rank " +
                                                    std::to_string(pg_.rank()) + " gathered " + describe_marker(mark) +
                                                    ": every rank must run the units in the same order",
                                                static_cast<int>(u), -1));
        s.unit = npos;
        std::rethrow_exception(failed_);
      }
    }
    for (std::size_t j = 0; j < U.count; ++j) {
      U.params[j].reopen(pg_.rank());
      auto* dst = static_cast<std::byte*>(views_[U.first + j].data);
      const auto [offset, numel] = U.entries[j];
      // Element i of the unit lies in rank i / per_rank's chunk.
      for (std::size_t i = offset; i < offset + numel;) {
        const std::size_t r = i / U.lay.per_rank, in = i % U.lay.per_rank;
        const std::size_t n = std::min(offset + numel - i, U.lay.per_rank - in);
        std::memcpy(dst + (i - offset) * esz, s.buf + (r * chunk + in) * esz, n * esz);
        i += n;
      }
    }
    s.unit = npos;
    U.present = true;
  }

  std::uint32_t marker(std::size_t u) const noexcept {
    return static_cast<std::uint32_t>(u) << 2 | (backward_ ? 2u : 0u) | 1u;
  }
  static std::string describe_marker(std::uint32_t m) {
    if ((m & 1u) == 0) return "something that is not a unit";
    return "unit " + std::to_string(m >> 2) + ((m & 2u) != 0 ? " for its backward" : " for its forward");
  }

  /// After gathering unit u in a pass: the pass's order recorded or followed, and the next unit
  /// of the record prefetched.
  void advance(order& o, std::size_t u) {
    o.now.push_back(u);
    if (!o.valid || o.broken) return;
    if (o.pos >= o.record.size() || o.record[o.pos] != u) {
      o.broken = true;  // the order changed: no prefetch until the next step records it
      return;
    }
    ++o.pos;
    if (!opts_.prefetch || o.pos >= o.record.size()) return;
    const std::size_t next = o.record[o.pos];
    auto& N = units_[next];
    if (N.present || N.prefetched != nullptr || N.whole) return;
    issue_gather(next);
  }

  /// Whether `u`, just released, ends the recorded forward (every unit of the record gathered,
  /// no other still open: the last one, or a root unit whose forward holds the others) and
  /// begins the recorded backward: kept then (as FSDP keeps its root), its backward's gather saved.
  bool backward_begins_with(std::size_t u) const noexcept {
    if (!fwd_.valid || fwd_.broken || fwd_.pos != fwd_.record.size() || fwd_.record.empty() || !bwd_.valid ||
        bwd_.record.empty() || bwd_.record.front() != u)
      return false;
    for (std::size_t v = 0; v < units_.size(); ++v)
      if (v != u && units_[v].forward_open) return false;
    return true;
  }

  // ---- the gradients ------------------------------------------------------------------------

  /// Unit u's gradients accessible and zero: pages released read as zero, the ends are zeroed.
  void open_grads(std::size_t u) {
    auto& U = units_[u];
    if (U.accumulated) return;  // they hold the sum of the no_sync backwards, and stay held
    for (std::size_t j = 0; j < U.count; ++j) {
      auto& g = U.grads[j];
      g.reopen(pg_.rank());
      if (!U.whole && g.reads_zero())
        g.edges([](std::byte* p, std::size_t n) { std::memset(p, 0, n); });
      else
        std::memset(views_[U.first + j].grad, 0, views_[U.first + j].bytes());
    }
  }

  /// Unit u's gradients into a scatter slot (packed in unit order, padded with zeros) and their
  /// reduce-scatter into the unit's gradient shard.
  void scatter(std::size_t u) {
    auto& U = units_[u];
    slot& s = scatter_slot();
    const std::size_t esz = dtype_size(U.type);
    for (std::size_t j = 0; j < U.count; ++j)
      std::memcpy(s.buf + U.entries[j].first * esz, views_[U.first + j].grad, U.entries[j].second * esz);
    std::memset(s.buf + U.numel * esz, 0, (U.lay.padded - U.numel) * esz);
    s.unit = u;
    s.kind = "reduce-scatter";
    const op o = opts_.average ? op::avg : op::sum;
    s.req = detail::reduce_scatter_async_tagged(red_, s.buf, U.grad.get(), U.lay.per_rank, U.type, o, tag(u));
  }

  // ---- release ------------------------------------------------------------------------------

  /// Unit u's parameters leave the engine's tensors: the ends NaN, the pages given back and
  /// protected (as the options say).
  void release_params(std::size_t u) {
    auto& U = units_[u];
    for (auto& r : U.params) {
      r.edges([&](std::byte* p, std::size_t n) { fill_nan(p, n, U.type); });
      r.release(opts_.release_memory, opts_.protect_released, pg_.rank());
    }
    U.present = false;
  }
  /// Unit u's gradients, after their reduce-scatter took them (and at construction).
  void release_grads(std::size_t u) {
    for (auto& r : units_[u].grads) r.release(opts_.release_memory, opts_.protect_released, pg_.rank());
  }

  static void fill_nan(std::byte* p, std::size_t n, dtype t) noexcept {
    if (t == dtype::f32) {
      const float q = std::numeric_limits<float>::quiet_NaN();
      for (std::size_t k = 0; k + 4 <= n; k += 4) std::memcpy(p + k, &q, 4);
    } else {
      const std::uint16_t q = t == dtype::f16 ? 0x7e00 : 0x7fc0;
      for (std::size_t k = 0; k + 2 <= n; k += 2) std::memcpy(p + k, &q, 2);
    }
  }

  // ---- the step -----------------------------------------------------------------------------

  template <class Optimizer>
  void step_unit(Optimizer& opt, std::size_t u) {
    auto& U = units_[u];
    if (U.lay.per_rank == 0) return;
    const float* grads = reinterpret_cast<const float*>(U.grad.get());
    if (U.type != dtype::f32) {
      scratch_.resize(U.lay.per_rank);
      detail::widen_to_f32(scratch_.data(), U.grad.get(), U.lay.per_rank, U.type);
      grads = scratch_.data();
    }
    float* state = U.state.data();
    for (const auto& pc : U.lay.pieces)
      opt.step(shard_step{u, steps_, std::span<float>(U.values.data() + pc.shard_offset, pc.count),
                          std::span<const float>(grads + pc.shard_offset, pc.count),
                          std::span<float>(state + k_ * pc.shard_offset, k_ * pc.count),
                          std::span<const shard_piece>(&pc, 1)});
  }

  // ---- collectives, order, failures ---------------------------------------------------------

  /// A gather slot free for a new all-gather: one whose gather was taken, else a new one (the
  /// slots in flight are prefetches not yet taken: the current unit and the next, two at most
  /// unless the order changed).
  slot& gather_slot() {
    slot* pick = nullptr;
    for (auto& s : gathers_)
      if (s.unit == npos) {
        pick = &s;
        break;
      }
    if (pick == nullptr) pick = &gathers_.emplace_back();
    wait(*pick, "an all-gather");
    return sized(*pick, gather_bytes_);
  }
  /// The scatter slot of the oldest reduce-scatter (they are issued in turn), once it ended.
  slot& scatter_slot() {
    slot& s = scatters_[next_scatter_];
    next_scatter_ = (next_scatter_ + 1) % scatters_.size();
    wait(s, "the gradients' reduce-scatter");
    s.unit = npos;
    return sized(s, scatter_bytes_);
  }
  slot& sized(slot& s, std::size_t bytes) {
    if (s.bytes < bytes || s.buf == nullptr) {
      if (s.buf != nullptr) alloc_.deallocate(s.buf, s.bytes);
      s.buf = nullptr;
      s.buf = static_cast<std::byte*>(alloc_.allocate(bytes));
      s.bytes = bytes;
    }
    return s;
  }

  void wait(slot& s, const char* what) {
    if (!s.req.valid()) return;
    try {
      s.req.wait(detail::timing::collective_deadline(patience()));
      if (timeline_ && *s.kind != '\0' && s.unit != npos)
        timeline_->collective_span(std::string(s.kind) + " unit " + std::to_string(s.unit), s.req,
                                   unit_args(s.unit) + ",\"bytes\":" + std::to_string(s.bytes));
    } catch (const error& e) {
      s.buf = nullptr;  // the collective may still write into it: leaked
      s.bytes = 0;
      if (e.rank() >= 0) throw;
      detail::raise(e.condition(), pg_.rank(), std::string("fully_sharded: ") + what + ": " + e.what());
    }
    s.req = request{};
  }

  /// Every rank ran the same sequence of gathers and backward calls in this step: their hashes
  /// compared (one small all-gather); where they differ, the sequences are gathered and named.
  void check_order() {
    order_words_.assign(static_cast<std::size_t>(pg_.size()), 0);
    std::uint64_t* out = order_words_.data();
    out[pg_.rank()] = sequence_hash_ | 1u;
    s_check_.req = red_.allgather_async(out + pg_.rank(), out, 1, dtype::i64);
    wait(s_check_, "the check of the units' order");
    bool same = true;
    for (int r = 0; r < pg_.size(); ++r) same = same && out[r] == out[0];
    const std::string seq = std::move(sequence_);
    sequence_.clear();
    sequence_hash_ = 0;
    if (same) return;
    const auto seqs = pg_.all_gather(seq);
    int other = 0;
    while (other < pg_.size() && seqs[static_cast<std::size_t>(other)] == seq) ++other;
    failed_ = std::make_exception_ptr(
        error(errc::mismatch, pg_.rank(),
              "fully_sharded: the ranks ran the units in different orders in step " + std::to_string(steps_ + 1) +
                  ": rank " + std::to_string(pg_.rank()) + " ran" + seq + ", rank " + std::to_string(other) + " ran" +
                  seqs[static_cast<std::size_t>(std::min(other, pg_.size() - 1))] +
                  " (g gather, r release, b begin_backward, e end_backward): every rank must make the same calls"));
    std::rethrow_exception(failed_);
  }

  /// The timeline's span of call `what` on unit u from `t0` to now (`had`: its parameters were
  /// there or on their way: prefetched); returns now.
  steady_clock::time_point mark(const char* what, std::size_t u, steady_clock::time_point t0, int had = -1) {
    const auto now = steady_clock::now();
    if (timeline_)
      timeline_->thread_span(std::string(what) + " unit " + std::to_string(u), t0, now,
                             unit_args(u) + (had < 0 ? ""
                                             : had   ? ",\"prefetched\":true"
                                                     : ",\"prefetched\":false"));
    return now;
  }
  std::string unit_args(std::size_t u) const {
    return "\"step\":" + std::to_string(steps_ + 1) + ",\"unit\":" + std::to_string(u);
  }

  void note(char what, std::size_t u) {
    if (sequence_.size() < 4096) {
      const char head[2] = {' ', what};
      sequence_.append(head, 2).append(std::to_string(u));
    }
    sequence_hash_ = (sequence_hash_ ^ (static_cast<std::uint64_t>(what) << 32 | u)) * 0x100000001b3ull;
  }

  bucket_tag tag(std::size_t u) const noexcept {
    return bucket_tag{static_cast<std::int32_t>(u), static_cast<std::int64_t>(steps_), {}};
  }

  std::chrono::milliseconds patience() const noexcept {
    return opts_.timeout.count() > 0 ? opts_.timeout : pg_.timeout();
  }

  /// Runs `f`; a failure of it fails the wrapper for good (a collective's buffers may be in use).
  template <class F>
  void guarded(F&& f) {
    try {
      f();
    } catch (const error& e) {
      if (e.condition() != errc::usage && !failed_) failed_ = std::current_exception();
      throw;
    } catch (...) {
      if (!failed_) failed_ = std::current_exception();
      throw;
    }
  }

  void live(const char* what) const {
    if (!failed_) return;
    try {
      std::rethrow_exception(failed_);
    } catch (const error& e) {
      detail::raise(
          e.condition(), pg_.rank(),
          std::string("fully_sharded: ") + what + "() after an earlier failure, which ended this wrapper: " + e.what());
    } catch (const std::exception& e) {
      detail::raise(errc::usage, pg_.rank(),
                    std::string("fully_sharded: ") + what + "() after an earlier failure: " + e.what());
    }
  }

  /// The checks of the state's calls: a working wrapper, no backward under way.
  void between(const char* what) const {
    live(what);
    if (backward_) usage(std::string(what) + "() inside a step (after its backward began): call it between steps");
  }

  [[noreturn]] void usage(const std::string& why) const {
    detail::raise(errc::usage, pg_.rank(), "fully_sharded: " + why);
  }

  const unit_state& at(std::size_t u, const char* what) const {
    if (u >= units_.size())
      detail::raise(errc::invalid_argument, pg_.rank(),
                    std::string("fully_sharded: ") + what + "(" + std::to_string(u) + "): there are " +
                        std::to_string(units_.size()) + " units");
    return units_[u];
  }
  unit_state& at(std::size_t u, const char* what) { return const_cast<unit_state&>(std::as_const(*this).at(u, what)); }

  process_group& pg_;
  fully_sharded_options opts_;
  std::vector<tensor_view> views_;
  std::vector<std::string> names_;
  Reducer red_;
  Allocator alloc_;
  agreement agree_;
  bucket_plan plan_;  // one bucket per unit
  std::vector<unit_state> units_;
  std::deque<slot> gathers_, scatters_;  // deque: a slot stays put when another is added
  slot s_check_;
  std::size_t gather_bytes_ = 0, scatter_bytes_ = 0;
  order fwd_, bwd_;
  std::string sequence_;
  std::uint64_t sequence_hash_ = 0;
  std::vector<float> scratch_;
  std::size_t k_ = npos;
  std::uint64_t steps_ = 0, issued_ = 0, prefetch_hits_ = 0;
  std::chrono::nanoseconds gather_wait_{0};
  bool backward_ = false, fresh_ = false, agreed_ = false;
  int no_sync_depth_ = 0;                // no_sync() guards alive
  bool sync_ = true;                     // this backward reduces (no guard when it began)
  bool accumulated_ = false;             // the last finish() ended an accumulating backward
  bool step_open_ = false;               // for the timeline: a gather or begin_backward since the last step()
  steady_clock::time_point step_begin_;  // and when the first of them came
  std::unique_ptr<timeline> timeline_;
  std::size_t next_scatter_ = 0;
  std::vector<std::uint64_t> order_words_;
  std::exception_ptr failed_;
};

}  // namespace DDP_ABI
}  // namespace ddp
