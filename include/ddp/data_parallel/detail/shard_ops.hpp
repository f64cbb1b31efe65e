#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/shard_ops.hpp
/// `shard_ops`: the sharded mode of the wrapper (`dp_options::shard`): each bucket's
/// reduce-scatter into this rank's shard of the averaged gradients, the optimizer state of the
/// shards, the step (`step(opt)`: the optimizer on each shard, then an all-gather of each
/// bucket's updated parameters into the engine's tensors, pipelined bucket by bucket), and the
/// state's gathering and re-sharding for checkpoints. See docs/sharded.md.
// IWYU pragma: private

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/bucket_tag.hpp>
#include <ddp/data_parallel/agreement.hpp>
#include <ddp/data_parallel/bucket_memory.hpp>
#include <ddp/data_parallel/detail/parameters.hpp>
#include <ddp/data_parallel/detail/step_context.hpp>
#include <ddp/data_parallel/detail/step_guard.hpp>
#include <ddp/data_parallel/detail/step_sync.hpp>
#include <ddp/data_parallel/detail/uneven.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/data_parallel/shard_layout.hpp>
#include <ddp/detail/bytes.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/optim/shard_optimizer.hpp>
#include <ddp/parameter.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/detail/tagged.hpp>
#include <ddp/request.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// f32 values of `n` elements of `t` (f32, f16, bf16) at `src`, into `dst`, and back.
inline void widen_to_f32(float* dst, const void* src, std::size_t n, dtype t) noexcept {
  const auto* h = static_cast<const std::uint16_t*>(src);
  if (t == dtype::f32)
    std::memcpy(dst, src, n * sizeof(float));
  else if (t == dtype::f16)
    for (std::size_t k = 0; k < n; ++k) dst[k] = half::to_float(h[k]);
  else
    for (std::size_t k = 0; k < n; ++k) dst[k] = bfloat16::to_float(h[k]);
}
inline void narrow_from_f32(void* dst, const float* src, std::size_t n, dtype t) noexcept {
  auto* h = static_cast<std::uint16_t*>(dst);
  if (t == dtype::f32)
    std::memcpy(dst, src, n * sizeof(float));
  else if (t == dtype::f16)
    for (std::size_t k = 0; k < n; ++k) h[k] = half::from_float(src[k]);
  else
    for (std::size_t k = 0; k < n; ++k) h[k] = bfloat16::from_float(src[k]);
}

/// The sharded mode's work, given references to the wrapper's parts (which outlive it).
template <class Reducer, class Allocator>
class shard_ops {
 public:
  shard_ops(const step_context<Reducer, Allocator>& c, const agreement& agree) : c_(c), agree_(agree) {}
  shard_ops(const shard_ops&) = delete;
  shard_ops& operator=(const shard_ops&) = delete;
  ~shard_ops() {
    if (grads_ != nullptr) c_.memory.allocator().deallocate(grads_, grad_bytes_);
  }

  /// Refuses what the sharded mode cannot do (after the construction's agreement, so alike on
  /// every rank): errc::unsupported for options it does not combine with, parameters that are
  /// not f32, f16 or bf16, and bucket memory the CPU cannot reach (the optimizers step on the
  /// host). Then tells the group that it holds a shard: an elastic group must not re-form
  /// without it (docs/elastic.md).
  void check(const bucket_policy& policy) {
    const dp_options& opts = c_.opts;
    const std::vector<tensor_view>& views = c_.views;
    const memory_kind where = c_.memory.allocator().location();
    const int rank = c_.pg.rank();
    const auto refuse = [&](const std::string& why, int param = -1) {
      detail::raise(errc::unsupported, rank, "dp_options::shard: " + why, -1, param);
    };
    if (opts.gradient_as_bucket_view)
      refuse("gradient_as_bucket_view is not supported (a bucket's memory is lent only while it reduces)");
    if (opts.uneven_inputs) refuse("uneven_inputs (join) is not supported in the sharded mode");
    if (policy.autotune) refuse("bucket_policy::autotune is not supported (the shards follow one fixed plan)");
    if (!host_accessible(where))
      refuse(std::string("bucket memory of kind '") + memory_kind_name(where) +
             "' is not reachable from the CPU, where the shard optimizers step; use a host, pinned or shm allocator");
    for (std::size_t i = 0; i < views.size(); ++i)
      if (views[i].type != dtype::f32 && views[i].type != dtype::f16 && views[i].type != dtype::bf16)
        refuse(parameter_label(i, views[i].name) + " is " + dtype_name(views[i].type) +
                   "; the shard optimizers step f32, f16 and bf16 parameters",
               static_cast<int>(i));
    c_.pg.note_sharded_state();
  }

  /// After the plan is fixed: this rank's layout, compared across ranks (collective; a mismatch
  /// names both layouts).
  void lay_out(const bucket_plan& plan) {
    layout_ = shard_layout::of(plan, c_.pg.rank(), c_.pg.size());
    agree_.check_same_text("the shard layout (dp_options::shard)", layout_.describe());
  }

  /// This rank's gradient shards, and f32 master weights for f16 and bf16 buckets (local: the
  /// wrapper shares the outcome).
  void allocate() {
    grad_off_.clear();
    std::size_t bytes = 0;
    for (const auto& b : layout_.buckets) {
      grad_off_.push_back(bytes);
      bytes += (b.per_rank * dtype_size(b.type) + 63) / 64 * 64;
    }
    grad_bytes_ = std::max<std::size_t>(bytes, 64);
    grads_ = c_.memory.allocator().allocate(grad_bytes_);
    std::size_t widest = 0;
    bool narrow = false;
    for (const auto& b : layout_.buckets) {
      widest = std::max(widest, b.per_rank);
      narrow = narrow || b.type != dtype::f32;
    }
    scratch_.assign(widest, 0.0f);
    if (narrow) {
      master_.assign(layout_.elements, 0.0f);
      refresh_master();
    }
  }

  /// bucket_ops' launch in the sharded mode: bucket b's reduce-scatter into its gradient shard.
  request reduce_scatter(std::size_t b, const bucket_tag& tag) {
    const auto& bk = layout_.buckets[b];
    return reduce_scatter_async_tagged(c_.red, c_.memory.buffer(b), grad_shard(b), bk.per_rank, bk.type,
                                       bucket_op(c_.opts.average, false, bk.type), tag);
  }

  /// The master weights of f16 and bf16 buckets from the engine's parameters (at set-up, and
  /// after the parameters were loaded).
  void refresh_master() {
    if (master_.empty()) return;
    for (const auto& b : layout_.buckets) {
      if (b.type == dtype::f32) continue;
      for (const auto& pc : b.pieces)
        widen_to_f32(master_.data() + b.offset + pc.shard_offset,
                     static_cast<const std::byte*>(c_.views[pc.param].data) + pc.param_offset * dtype_size(b.type),
                     pc.count, b.type);
    }
  }

  /// One optimizer step on this rank's shards, then the all-gather of the updated parameters
  /// into the engine's tensors, through one pooled buffer: each bucket's gather overlaps the
  /// next bucket's optimizer.
  /// Parameters for which `unused(i)` holds (no rank used them: find_unused_parameters) keep
  /// their values and state, as PyTorch's optimizers skip a parameter without a gradient.
  template <class Optimizer, class Unused>
  void step(Optimizer& opt, const Unused& unused) {
    const std::size_t k = opt.state_per_element();
    if (!started_) {
      // Ranks stepping different optimizers (or hyperparameters) would diverge in silence.
      agree_.check_same_text("the shard optimizer (its signature())", opt.signature() + " state=" + std::to_string(k));
      if (loaded_state_.empty()) {
        state_.assign(k * layout_.elements, 0.0f);
      } else {
        if (loaded_k_ != k)
          detail::raise(errc::mismatch, c_.pg.rank(),
                        "step(): the loaded shard state holds " + std::to_string(loaded_k_) +
                            " floats per element but the optimizer keeps " + std::to_string(k));
        state_ = std::move(loaded_state_);
      }
      k_ = k;
      started_ = true;
    } else if (k != k_) {
      detail::raise(errc::usage, c_.pg.rank(),
                    "step(): the optimizer keeps " + std::to_string(k) + " floats per element but the shards hold " +
                        std::to_string(k_) + " (pass the same optimizer every step)");
    }
    ++steps_;
    gather_updated(
        [&](std::size_t b) { c_.guarded("step (the shard optimizer)", -1, [&] { step_pieces(opt, b, unused); }); });
  }

  /// The engine's own optimizer instead (`data_parallel::step(update)`): `update()` steps this
  /// rank's slices (`slices()`) through the engine's views of them, then each bucket's updated
  /// parameters are all-gathered. The optimizer's state is the engine's: ddp keeps none.
  template <class Update>
  void step_engine(Update& update) {
    engine_ = true;
    ++steps_;
    c_.guarded("step (the engine's optimizer on this rank's shard)", -1, [&] { update(); });
    gather_updated([](std::size_t) {});
  }

  /// Refuses a step of the other kind than the earlier ones (before anything of the step runs).
  void check_kind(bool engine) const {
    if (engine && (started_ || !loaded_state_.empty()))
      detail::raise(errc::usage, c_.pg.rank(),
                    "step(update): this wrapper's shards were stepped by a ddp optimizer (step(optimizer)) or given "
                    "its state (load_sharded_state); use one kind of optimizer throughout");
    if (!engine && engine_)
      detail::raise(errc::usage, c_.pg.rank(),
                    "step(optimizer): this wrapper's shards were stepped by the engine's optimizer (step(update)); use "
                    "one kind of optimizer throughout");
  }

  /// Whether the engine's optimizer steps the shards (`step_engine` ran).
  bool engine_steps() const noexcept { return engine_; }

  /// This rank's slice of each parameter, in parameter order (a parameter lies in one bucket,
  /// so in one piece of a rank's shard at most).
  std::vector<shard_slice> slices() const {
    std::vector<shard_slice> out(c_.views.size());
    for (std::size_t i = 0; i < c_.views.size(); ++i) out[i] = {i, 0, 0, c_.views[i].data, nullptr, c_.views[i].type};
    for (std::size_t b = 0; b < layout_.buckets.size(); ++b) {
      const auto& L = layout_.buckets[b];
      const std::size_t esz = dtype_size(L.type);
      for (const auto& pc : L.pieces)
        out[pc.param] = {pc.param,
                         pc.param_offset,
                         pc.count,
                         static_cast<std::byte*>(c_.views[pc.param].data) + pc.param_offset * esz,
                         static_cast<const std::byte*>(grad_shard(b)) + pc.shard_offset * esz,
                         L.type};
    }
    return out;
  }

  /// Bucket by bucket, `before(b)` (the optimizer's work on bucket b), then this rank's slice of
  /// it into the pooled buffer and its all-gather into the engine's tensors: one buffer, so
  /// bucket b's optimizer runs on the engine's values while bucket b - 1 gathers.
  template <class Before>
  void gather_updated(const Before& before) {
    const auto patience = wait_patience(c_.opts, c_.pg);
    const std::size_t n = layout_.buckets.size();
    const auto gathered = [&](std::size_t b) {
      c_.guarded(
          "step (the all-gather of the parameters)", -1, [&] { c_.memory.wait(b, patience, c_.pg.rank()); }, false);
      copy_gathered(b);
      c_.memory.unbind(b);
    };
    for (std::size_t b = 0; b < n; ++b) {
      before(b);
      if (b > 0) gathered(b - 1);
      c_.guarded("step (the all-gather of the parameters)", -1, [&] { send(b); });
    }
    if (n > 0) gathered(n - 1);
  }

  /// Every rank's shards of the optimizer state (and master weights), gathered into rank 0's
  /// result in parameter order, independent of the world size and the plan: see `state_blob`.
  /// Other ranks return an empty vector. Collective.
  std::vector<std::byte> gather_state() {
    const bool loaded = !started_ && !loaded_state_.empty();
    const std::vector<float>& state = loaded ? loaded_state_ : state_;
    const std::size_t k = loaded ? loaded_k_ : (started_ ? k_ : 0), m = master_.empty() ? 0 : 1, width = k + m;
    std::vector<std::vector<float>> full;  // rank 0: per parameter, width arrays of numel
    if (c_.pg.rank() == 0) {
      full.resize(c_.views.size());
      for (std::size_t i = 0; i < c_.views.size(); ++i) full[i].assign(width * c_.views[i].numel, 0.0f);
    }
    const int world = c_.pg.size();
    std::vector<shard_layout> all;
    if (c_.pg.rank() == 0)
      for (int r = 0; r < world; ++r) all.push_back(shard_layout::of(c_.memory.plan(), r, world));
    for (std::size_t b = 0; b < layout_.buckets.size() && width > 0; ++b) {
      const auto& mine = layout_.buckets[b];
      const std::size_t per = mine.per_rank;
      std::vector<float> in(width * per), out(width * per * static_cast<std::size_t>(world));
      std::copy_n(state.data() + k * mine.offset, k * per, in.data());
      if (m == 1) std::copy_n(master_.data() + mine.offset, per, in.data() + k * per);
      wait_collective(c_.red.allgather_async(in.data(), out.data(), width * per, dtype::f32), "gathering the state");
      if (c_.pg.rank() != 0) continue;
      for (int r = 0; r < world; ++r) {
        const float* chunk = out.data() + static_cast<std::size_t>(r) * width * per;
        for (const auto& pc : all[static_cast<std::size_t>(r)].buckets[b].pieces) {
          const std::size_t numel = c_.views[pc.param].numel;
          const bool narrow = mine.type != dtype::f32;
          for (std::size_t j = 0; j < k; ++j)
            std::copy_n(chunk + k * pc.shard_offset + j * pc.count, pc.count,
                        full[pc.param].data() + j * numel + pc.param_offset);
          if (m == 1 && narrow)  // an f32 bucket has no master weights
            std::copy_n(chunk + k * per + pc.shard_offset, pc.count,
                        full[pc.param].data() + k * numel + pc.param_offset);
        }
      }
    }
    if (c_.pg.rank() != 0) return {};
    std::string out = "ddpshard";
    put_u64(out, 1);  // format version
    put_u64(out, k);
    put_u64(out, m);
    put_u64(out, steps_);
    put_u64(out, c_.views.size());
    for (std::size_t i = 0; i < c_.views.size(); ++i) put_u64(out, c_.views[i].numel);
    for (const auto& f : full) out.append(reinterpret_cast<const char*>(f.data()), f.size() * sizeof(float));
    std::vector<std::byte> blob(out.size());
    std::memcpy(blob.data(), out.data(), out.size());
    return blob;
  }

  /// Takes this rank's shards from a blob of `gather_state` (any world size, any plan); the
  /// optimizer's first `step` after it checks that it keeps as many floats per element.
  void load_state(std::span<const std::byte> blob) {
    const auto bad = [&](const std::string& why) {
      detail::raise(errc::invalid_argument, c_.pg.rank(), "load_sharded_state: " + why);
    };
    std::size_t at = 8;
    const auto u64 = [&]() -> std::uint64_t {
      if (blob.size() < at + 8) bad("the blob ends early (" + std::to_string(blob.size()) + " bytes)");
      std::uint64_t v = 0;
      for (int b = 0; b < 8; ++b) v |= static_cast<std::uint64_t>(std::to_integer<unsigned>(blob[at + b])) << (8 * b);
      at += 8;
      return v;
    };
    if (blob.size() < 8 || std::memcmp(blob.data(), "ddpshard", 8) != 0)
      bad("not a shard state (it must come from sharded_state())");
    if (const auto version = u64(); version != 1) bad("format version " + std::to_string(version) + ", expected 1");
    const std::uint64_t k = u64(), m = u64(), steps = u64(), count = u64();
    if (k > 64 || m > 1) bad("a header that no sharded_state() writes");
    if (count != c_.views.size())
      detail::raise(errc::mismatch, c_.pg.rank(),
                    "load_sharded_state: the state is of " + std::to_string(count) + " parameters, the wrapper has " +
                        std::to_string(c_.views.size()));
    std::vector<std::size_t> start(c_.views.size());
    std::size_t data = at + 8 * count;
    for (std::size_t i = 0; i < c_.views.size(); ++i) {
      const std::uint64_t numel = u64();
      if (numel != c_.views[i].numel)
        detail::raise(errc::mismatch, c_.pg.rank(),
                      "load_sharded_state: " + parameter_label(i, c_.views[i].name) + " has " +
                          std::to_string(c_.views[i].numel) + " elements, the state " + std::to_string(numel),
                      -1, static_cast<int>(i));
      start[i] = data;
      data += (k + m) * numel * sizeof(float);
    }
    if (blob.size() != data) bad(std::to_string(blob.size()) + " bytes where the header says " + std::to_string(data));
    std::vector<float> state(k * layout_.elements, 0.0f);
    for (const auto& b : layout_.buckets)
      for (const auto& pc : b.pieces) {
        const std::size_t numel = c_.views[pc.param].numel;
        const auto read = [&](std::size_t j, float* dst) {
          std::memcpy(dst, blob.data() + start[pc.param] + (j * numel + pc.param_offset) * sizeof(float),
                      pc.count * sizeof(float));
        };
        for (std::size_t j = 0; j < k; ++j) read(j, state.data() + k * b.offset + k * pc.shard_offset + j * pc.count);
        if (m == 1 && b.type != dtype::f32 && !master_.empty()) read(k, master_.data() + b.offset + pc.shard_offset);
      }
    if (m == 0) refresh_master();
    loaded_state_ = std::move(state);
    loaded_k_ = k;
    started_ = false;
    steps_ = steps;
  }

  /// The wrapper leaks its buckets (a collective may still write): so are the gradient shards.
  void leak() noexcept { grads_ = nullptr; }

  const shard_layout& layout() const noexcept { return layout_; }
  /// Optimizer steps taken (`shard_step::step` of the last one).
  std::uint64_t steps() const noexcept { return steps_; }
  /// Bytes of optimizer state and master weights this rank holds for its shards.
  std::size_t state_bytes() const noexcept {
    return (std::max(state_.size(), loaded_state_.size()) + master_.size()) * sizeof(float);
  }
  /// Bytes of this rank's averaged-gradient shards.
  std::size_t gradient_bytes() const noexcept { return grad_bytes_; }
  /// This rank's averaged gradient shard of bucket b (after `finish()`), in the bucket's dtype.
  void* grad_shard(std::size_t b) const noexcept { return static_cast<std::byte*>(grads_) + grad_off_[b]; }

 private:
  /// Bucket b's shard: the optimizer once per piece, on the engine's own values (f32) or the
  /// master weights (f16, bf16, then rounded into the engine's tensor), each piece's state a
  /// block of `k` arrays. Pieces of parameters that `unused` names are not stepped.
  template <class Optimizer, class Unused>
  void step_pieces(Optimizer& opt, std::size_t b, const Unused& unused) {
    const auto& L = layout_.buckets[b];
    const std::size_t esz = dtype_size(L.type);
    const bool narrow = L.type != dtype::f32;
    const float* grads = static_cast<const float*>(grad_shard(b));
    if (narrow) {
      widen_to_f32(scratch_.data(), grad_shard(b), L.per_rank, L.type);
      grads = scratch_.data();
    }
    float* state = state_.data() + k_ * L.offset;
    for (const auto& pc : L.pieces) {
      if (unused(pc.param)) continue;
      std::byte* engine = static_cast<std::byte*>(c_.views[pc.param].data) + pc.param_offset * esz;
      float* values = narrow ? master_.data() + L.offset + pc.shard_offset : reinterpret_cast<float*>(engine);
      opt.step(shard_step{
          b, steps_, std::span<float>(values, pc.count), std::span<const float>(grads + pc.shard_offset, pc.count),
          std::span<float>(state + k_ * pc.shard_offset, k_ * pc.count), std::span<const shard_piece>(&pc, 1)});
      if (narrow) narrow_from_f32(engine, values, pc.count, L.type);
    }
  }

  /// This rank's updated values of bucket b into its slice of the pooled buffer, and the
  /// bucket's all-gather in place.
  void send(std::size_t b) {
    const auto& L = layout_.buckets[b];
    c_.memory.bind(b, false, wait_patience(c_.opts, c_.pg), c_.pg.rank());
    const std::size_t esz = dtype_size(L.type);
    std::byte* mine = static_cast<std::byte*>(c_.memory.buffer(b)) + L.first * esz;
    for (const auto& pc : L.pieces)
      std::memcpy(mine + pc.shard_offset * esz,
                  static_cast<const std::byte*>(c_.views[pc.param].data) + pc.param_offset * esz, pc.count * esz);
    const bucket_tag tag{static_cast<std::int32_t>(b), static_cast<std::int64_t>(c_.step), {}};
    c_.memory.track(b, allgather_async_tagged(c_.red, mine, c_.memory.buffer(b), L.per_rank, L.type, tag));
  }

  /// After bucket b's all-gather: the other ranks' slices into the engine's parameters (this
  /// rank's own are there already).
  void copy_gathered(std::size_t b) {
    const auto& L = layout_.buckets[b];
    const std::size_t esz = dtype_size(L.type), lo = L.first, hi = L.first + L.per_rank;
    const auto* buf = static_cast<const std::byte*>(c_.memory.buffer(b));
    for (const auto& e : c_.memory.plan().buckets[b].entries) {
      auto* dst = static_cast<std::byte*>(c_.views[e.param].data);
      const std::size_t from = e.offset_elems, to = e.offset_elems + e.numel;
      // [from, to) less [lo, hi): what lies before this rank's slice, and what lies after it.
      if (from < std::min(to, lo)) std::memcpy(dst, buf + from * esz, (std::min(to, lo) - from) * esz);
      if (std::max(from, hi) < to)
        std::memcpy(dst + (std::max(from, hi) - from) * esz, buf + std::max(from, hi) * esz,
                    (to - std::max(from, hi)) * esz);
    }
  }

  void wait_collective(const request& r, const char* what) const {
    try {
      r.wait(steady_clock::now() + wait_patience(c_.opts, c_.pg) + std::chrono::seconds(2));
    } catch (const error& e) {
      if (e.rank() >= 0) throw;
      detail::raise(e.condition(), c_.pg.rank(), std::string("sharded_state: ") + what + ": " + e.what());
    }
  }

  step_context<Reducer, Allocator> c_;
  const agreement& agree_;
  shard_layout layout_;
  void* grads_ = nullptr;  // the gradient shards, from the allocator
  std::size_t grad_bytes_ = 0;
  std::vector<std::size_t> grad_off_;  // bucket b's shard at grads_ + grad_off_[b]
  // k_ floats per element: bucket b's at k_ * offset; in it, each piece's block of k_ arrays of
  // its count at k_ * shard_offset (array j at k_ * shard_offset + j * count)
  std::vector<float> state_;
  std::vector<float> master_;        // f16 and bf16 buckets' f32 weights (empty when every bucket is f32)
  std::vector<float> scratch_;       // a narrow bucket's gradients widened
  std::vector<float> loaded_state_;  // load_state's, adopted by the next step
  std::size_t loaded_k_ = 0;
  std::size_t k_ = 0;
  bool started_ = false;
  bool engine_ = false;  // the engine's optimizer steps the shards (step_engine)
  std::uint64_t steps_ = 0;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
