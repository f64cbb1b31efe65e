#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/shard_ops.hpp
/// `shard_ops`: the sharded mode of the wrapper (`dp_options::shard`): each bucket's
/// reduce-scatter into this rank's shard of the averaged gradients, the optimizer state of the
/// shards, the step (`step(opt)`: the optimizer on each shard, then an all-gather of each
/// bucket's updated parameters into the engine's tensors, pipelined bucket by bucket), and the
/// state's gathering and re-sharding for checkpoints; with replicas (`dp_options::shard_replicas`)
/// each shard on several ranks, parked when an elastic generation's wrapper goes and re-sharded
/// in memory by the next one. See docs/sharded.md.
// IWYU pragma: private

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
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
#include <ddp/data_parallel/detail/reshard_rules.hpp>
#include <ddp/data_parallel/detail/step_context.hpp>
#include <ddp/data_parallel/detail/step_guard.hpp>
#include <ddp/data_parallel/detail/state_blob.hpp>
#include <ddp/data_parallel/detail/step_sync.hpp>
#include <ddp/data_parallel/detail/uneven.hpp>
#include <ddp/data_parallel/detail/widen.hpp>
#include <ddp/data_parallel/detail/xxh64.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/data_parallel/shard_layout.hpp>
#include <ddp/detail/bytes.hpp>
#include <ddp/detail/parked.hpp>
#include <ddp/dtype.hpp>
#include <ddp/group/topology.hpp>
#include <ddp/error.hpp>
#include <ddp/optim/shard_optimizer.hpp>
#include <ddp/parameter.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/detail/tagged.hpp>
#include <ddp/request.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// What a replicated sharded wrapper of an elastic generation leaves, when it goes, for the next
/// generation's wrapper in this process to take (detail/parked.hpp): what it holds
/// (`reshard::holding`) and, for each shard it holds (in `held.shards`' order) and each bucket,
/// the shard's elements of the bucket as `1 + k` arrays of `len` floats: the values (the engine's
/// f32 ones, or the f32 master weights of f16 and bf16 buckets), then the k optimizer-state arrays.
struct parked_shards final : parked_object {
  reshard::holding held;
  std::vector<std::vector<std::vector<float>>> data;
  std::string untaken() const override {
    return "elastic: the last generation's sharded wrapper (dp_options::shard_replicas) left its shards of step " +
           std::to_string(held.steps) +
           " and no wrapper of the new generation took them: on_form must destroy the old wrapper before it builds "
           "the new one (dp.reset(); dp.emplace(g, ...)), else every shard's optimizer state would start afresh";
  }
};

/// The sharded mode's work, given references to the wrapper's parts (which outlive it).
template <class Reducer, class Allocator>
class shard_ops {
 public:
  shard_ops(const step_context<Reducer, Allocator>& c, const agreement& agree) : c_(c), agree_(agree) {}
  shard_ops(const shard_ops&) = delete;
  shard_ops& operator=(const shard_ops&) = delete;
  ~shard_ops() {
    park();
    if (grads_ != nullptr) c_.memory.allocator().deallocate(grads_, grad_bytes_);
  }

  /// Refuses what the sharded mode cannot do (after the construction's agreement, so alike on
  /// every rank): errc::unsupported for options it does not combine with, parameters that are
  /// not f32, f16 or bf16, and bucket memory the CPU cannot reach (the optimizers step on the
  /// host). Then tells the group that it holds a shard, and on how many ranks each: an elastic
  /// group must not re-form without a shard's every holder (docs/elastic.md).
  void check(const bucket_policy& policy) {
    const dp_options& opts = c_.opts;
    const std::vector<tensor_view>& views = c_.views;
    const memory_kind where = c_.memory.allocator().location();
    const int rank = c_.pg.rank();
    const auto refuse = [&](const std::string& why, int param = -1) {
      detail::raise(errc::unsupported, rank, "dp_options::shard: " + why, -1, param);
    };
    if (opts.shard_replicas < 0)
      detail::raise(errc::invalid_argument, rank,
                    "dp_options::shard_replicas is " + std::to_string(opts.shard_replicas) +
                        "; it must be 0 (2 on an elastic group, else 1) or the number of ranks holding each shard");
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
    asked_replicas_ = opts.shard_replicas != 0 ? opts.shard_replicas : (c_.pg.elastic() ? 2 : 1);
    replicas_ = std::min(asked_replicas_, std::max(c_.pg.size(), 1));
    c_.pg.note_sharded_state(asked_replicas_);
  }

  /// After the plan is fixed: the shards this rank holds (its own, and with replicas those of
  /// others: `reshard::holders_of`), compared across ranks (collective; a mismatch names both
  /// layouts), their state's memory, and on an elastic group with replicas the last
  /// generation's state re-sharded into them (`adopt`), the engine's parameters with it. Before
  /// the construction's broadcast of rank 0's parameters.
  void lay_out(const bucket_plan& plan) {
    const int world = c_.pg.size(), rank = c_.pg.rank();
    host_of_.assign(static_cast<std::size_t>(world), 0);
    if (replicas_ > 1) host_of_ = topology::of(c_.pg).host_index;
    shards_ = reshard::shards_of(reshard::holders_of(host_of_, replicas_), rank);
    held_.clear();
    for (int s : shards_) held_.push_back({shard_layout::of(plan, s, world), {}, {}, {}});
    agree_.check_same_text("the shard layout (dp_options::shard)",
                           primary().describe() + " replicas " + std::to_string(replicas_));
    xxh64 fp;
    for (const auto& b : plan.buckets) {
      const std::uint64_t v[2] = {static_cast<std::uint64_t>(b.type), b.numel};
      fp.update(v, sizeof v);
    }
    plan_fp_ = fp.digest() >> 1;  // it travels as text: a value that reads back the same
    bool narrow = false;
    for (const auto& b : plan.buckets) narrow = narrow || b.type != dtype::f32;
    if (narrow)
      for (auto& h : held_) h.master.assign(h.lay.elements, 0.0f);
    refresh_master();
    if (c_.pg.elastic() && asked_replicas_ > 1) adopt(plan);
  }

  /// After the construction set the engine's parameters (rank 0's, broadcast): the master
  /// weights of f16 and bf16 buckets from them, unless the shards were adopted (their master
  /// weights came from their holders, and the parameters are their rounding).
  void parameters_set() {
    if (!adopted_) refresh_master();
  }

  /// This rank's gradient shards (one per shard it holds), from the allocator, and the scratch
  /// of a narrow bucket's widened gradients (local: the wrapper shares the outcome).
  void allocate() {
    std::size_t bytes = 0, widest = 0;
    for (auto& h : held_) {
      h.grad_off.clear();
      for (const auto& b : h.lay.buckets) {
        h.grad_off.push_back(bytes);
        bytes += (b.per_rank * dtype_size(b.type) + 63) / 64 * 64;
        widest = std::max(widest, b.per_rank);
      }
    }
    grad_bytes_ = std::max<std::size_t>(bytes, 64);
    grads_ = c_.memory.allocator().allocate(grad_bytes_);
    scratch_.assign(widest, 0.0f);
  }

  /// Before bucket b is bound to the pooled buffer (bucket_ops' launch): with replicas, the
  /// buckets launched before it give their averages' slices of the shards this rank holds
  /// (`take_slices`) and their buffer back, so that the pool keeps one buffer.
  void before_bind(std::size_t) {
    if (replicas_ < 2) return;
    const auto patience = wait_patience(c_.opts, c_.pg);
    for (std::size_t k : unsliced_) {
      c_.memory.wait(k, patience, c_.pg.rank());
      take_slices(k);
      c_.memory.unbind(k);
    }
    unsliced_.clear();
  }

  /// bucket_ops' launch in the sharded mode: bucket b's reduce-scatter into its gradient shard;
  /// with replicas, an allreduce of the bucket (every holder of a shard then has its average,
  /// bit for bit the same), whose slices `take_slices` keeps.
  request launch(std::size_t b, const bucket_tag& tag) {
    const auto& bk = primary().buckets[b];
    const op o = bucket_op(c_.opts.average, false, bk.type);
    if (replicas_ < 2)
      return reduce_scatter_async_tagged(c_.red, c_.memory.buffer(b), grad_shard(b), bk.per_rank, bk.type, o, tag);
    unsliced_.push_back(b);
    return allreduce_async_tagged(c_.red, c_.memory.buffer(b), bk.numel, bk.type, o, tag);
  }

  /// After bucket b's collective ended (finish()): its slices of this rank's shards are kept
  /// (with replicas), and its buffer goes back to the pool.
  void reduced(std::size_t b) {
    if (replicas_ > 1 && c_.memory.buffer(b) != nullptr) {
      take_slices(b);
      std::erase(unsliced_, b);
    }
    c_.memory.unbind(b);
  }

  /// The master weights of f16 and bf16 buckets from the engine's parameters (at set-up, and
  /// after the parameters were loaded).
  void refresh_master() {
    for (auto& h : held_) {
      if (h.master.empty()) continue;
      for (const auto& b : h.lay.buckets) {
        if (b.type == dtype::f32) continue;
        for (const auto& pc : b.pieces)
          widen_to_f32(h.master.data() + b.offset + pc.shard_offset,
                       static_cast<const std::byte*>(c_.views[pc.param].data) + pc.param_offset * dtype_size(b.type),
                       pc.count, b.type);
      }
    }
  }

  /// One optimizer step on the shards this rank holds, then the all-gather of the updated
  /// parameters into the engine's tensors, through one pooled buffer: each bucket's gather
  /// overlaps the next bucket's optimizer. Parameters for which `unused(i)` holds (no rank used
  /// them: find_unused_parameters) keep their values and state, as PyTorch's optimizers skip a
  /// parameter without a gradient. With replicas, a failed gather does not stop the shards'
  /// own steps: they are finished before the failure is raised, so that every shard this rank
  /// holds is of this step (the next generation rebuilds the parameters from the shards), and
  /// the group is told so (process_group::note_shards_whole).
  template <class Optimizer, class Unused>
  void step(Optimizer& opt, const Unused& unused) {
    const std::size_t k = opt.state_per_element();
    if (!started_) {
      // Ranks stepping different optimizers (or hyperparameters) would diverge in silence.
      agree_.check_same_text("the shard optimizer (its signature())", opt.signature() + " state=" + std::to_string(k));
      if (loaded_ && !(loaded_k_ == 0 && steps_ == 0)) {
        if (loaded_k_ != k)
          detail::raise(errc::mismatch, c_.pg.rank(),
                        "step(): the loaded shard state holds " + std::to_string(loaded_k_) +
                            " floats per element but the optimizer keeps " + std::to_string(k));
      } else {
        for (auto& h : held_) h.state.assign(k * h.lay.elements, 0.0f);
      }
      loaded_ = false;
      k_ = k;
      started_ = true;
    } else if (k != k_) {
      detail::raise(errc::usage, c_.pg.rank(),
                    "step(): the optimizer keeps " + std::to_string(k) + " floats per element but the shards hold " +
                        std::to_string(k_) + " (pass the same optimizer every step)");
    }
    ++steps_;
    c_.pg.note_shards_whole(false);
    torn_ = true;
    if (replicas_ >= c_.pg.size()) {
      // Every rank holds every shard (2 ranks with 2 replicas, say) and has stepped each in the
      // engine's tensors, to the same bits as every other rank: nothing to gather.
      for (std::size_t b = 0; b < primary().buckets.size(); ++b)
        c_.guarded("step (the shard optimizer)", -1, [&] { step_bucket(opt, b, unused); });
      torn_ = false;
      return;
    }
    std::size_t stepped = 0;  // buckets whose shards are all stepped
    bool local = false;       // the failure came from the optimizer itself
    try {
      gather_updated([&](std::size_t b) {
        local = true;
        c_.guarded("step (the shard optimizer)", -1, [&] { step_bucket(opt, b, unused); });
        local = false;
        stepped = b + 1;
      });
    } catch (...) {
      if (replicas_ > 1 && !local) try {
          for (std::size_t b = stepped; b < primary().buckets.size(); ++b) step_bucket(opt, b, unused);
          torn_ = false;
          c_.pg.note_shards_whole(true);
        } catch (...) {  // the optimizer failed too: the shards are torn, and the first failure is raised
        }
      throw;
    }
    torn_ = false;
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

  /// Refuses a step of the other kind than the earlier ones (before anything of the step runs),
  /// and the engine's optimizer with replicas (it holds the state of this rank's own slices only).
  void check_kind(bool engine) const {
    if (engine && replicas_ > 1)
      detail::raise(errc::unsupported, c_.pg.rank(),
                    "step(update) with dp_options::shard_replicas " + std::to_string(replicas_) +
                        " (2 is the default on an elastic group): the engine's optimizer holds the state of this "
                        "rank's own slices only, so no other rank could step a replica of them; step a ddp "
                        "shard_optimizer (ddp::adamw, ddp::sgd), or set shard_replicas = 1");
    if (engine && (started_ || loaded_))
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
    for (std::size_t b = 0; b < primary().buckets.size(); ++b) {
      const auto& L = primary().buckets[b];
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
    const std::size_t n = primary().buckets.size();
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
    const auto& own = held_.front();
    const std::size_t k = loaded_ ? loaded_k_ : (started_ ? k_ : 0), m = own.master.empty() ? 0 : 1, width = k + m;
    const std::vector<float>& state = own.state;
    const shard_layout& layout = own.lay;
    std::vector<std::vector<float>> full;  // rank 0: per parameter, width arrays of numel
    if (c_.pg.rank() == 0) {
      full.resize(c_.views.size());
      for (std::size_t i = 0; i < c_.views.size(); ++i) full[i].assign(width * c_.views[i].numel, 0.0f);
    }
    const int world = c_.pg.size();
    std::vector<shard_layout> all;
    if (c_.pg.rank() == 0)
      for (int r = 0; r < world; ++r) all.push_back(shard_layout::of(c_.memory.plan(), r, world));
    for (std::size_t b = 0; b < layout.buckets.size() && width > 0; ++b) {
      const auto& mine = layout.buckets[b];
      const std::size_t per = mine.per_rank;
      std::vector<float> in(width * per), out(width * per * static_cast<std::size_t>(world));
      std::copy_n(state.data() + k * mine.offset, k * per, in.data());
      if (m == 1) std::copy_n(own.master.data() + mine.offset, per, in.data() + k * per);
      wait_collective(c_.red.allgather_async(in.data(), out.data(), width * per, dtype::f32),
                      "sharded_state: gathering the state");
      if (c_.pg.rank() != 0) continue;
      for (int r = 0; r < world; ++r)  // an f32 bucket has no master weights
        state_blob::scatter_chunk(full, out.data() + static_cast<std::size_t>(r) * width * per, k, m,
                                  mine.type != dtype::f32, per, all[static_cast<std::size_t>(r)].buckets[b].pieces,
                                  c_.views);
    }
    if (c_.pg.rank() != 0) return {};
    return state_blob::encode(k, m, steps_, c_.views, full);
  }

  /// Takes the shards this rank holds from a blob of `gather_state` (any world size, any plan);
  /// the optimizer's first `step` after it checks that it keeps as many floats per element.
  void load_state(std::span<const std::byte> blob) {
    const state_blob::reader in(blob, c_.views, c_.pg.rank(), "load_sharded_state");
    const std::size_t k = in.k, m = in.m;
    for (auto& h : held_) {
      std::vector<float> state(k * h.lay.elements, 0.0f);
      for (const auto& b : h.lay.buckets)
        for (const auto& pc : b.pieces)
          in.read_piece(
              pc, state.data() + k * b.offset + k * pc.shard_offset,
              b.type != dtype::f32 && !h.master.empty() ? h.master.data() + b.offset + pc.shard_offset : nullptr);
      h.state = std::move(state);
    }
    if (m == 0) refresh_master();
    loaded_ = true;
    loaded_k_ = k;
    started_ = false;
    steps_ = in.steps;
  }

  /// The wrapper leaks its buckets (a collective may still write): so are the gradient shards.
  void leak() noexcept { grads_ = nullptr; }

  /// This rank's own shard of each bucket.
  const shard_layout& layout() const noexcept { return primary(); }
  /// The ranks holding each shard (1 without replicas).
  int replicas() const noexcept { return replicas_; }
  /// Optimizer steps taken (`shard_step::step` of the last one).
  std::uint64_t steps() const noexcept { return steps_; }
  /// Bytes of optimizer state and master weights this rank holds for its shards (replicas included).
  std::size_t state_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& h : held_) n += (h.state.size() + h.master.size()) * sizeof(float);
    return n;
  }
  /// Bytes of this rank's averaged-gradient shards (replicas included).
  std::size_t gradient_bytes() const noexcept { return grad_bytes_; }
  /// This rank's averaged gradient shard of bucket b (after `finish()`), in the bucket's dtype.
  void* grad_shard(std::size_t b) const noexcept { return grad_of(0, b); }

 private:
  /// One shard this rank holds: its layout (`lay.rank` is the shard's index), its optimizer
  /// state (k floats per element: bucket b's at k * offset; in it, each piece's block of k
  /// arrays of its count at k * shard_offset, array j at k * shard_offset + j * count), the
  /// f32 master weights of f16 and bf16 buckets, and where its gradient slices lie in grads_.
  struct holding_state {
    shard_layout lay;
    std::vector<float> state;
    std::vector<float> master;
    std::vector<std::size_t> grad_off;
  };

  const shard_layout& primary() const noexcept {
    static const shard_layout none{};
    return held_.empty() ? none : held_.front().lay;
  }
  void* grad_of(std::size_t h, std::size_t b) const noexcept {
    return static_cast<std::byte*>(grads_) + held_[h].grad_off[b];
  }

  /// With replicas: bucket b's average (in its pooled buffer) into the gradient slices of the
  /// shards this rank holds.
  void take_slices(std::size_t b) {
    const auto* buf = static_cast<const std::byte*>(c_.memory.buffer(b));
    for (std::size_t h = 0; h < held_.size(); ++h) {
      const auto& L = held_[h].lay.buckets[b];
      const std::size_t esz = dtype_size(L.type);
      std::memcpy(grad_of(h, b), buf + L.first * esz, L.per_rank * esz);
    }
  }

  template <class Optimizer, class Unused>
  void step_bucket(Optimizer& opt, std::size_t b, const Unused& unused) {
    for (std::size_t h = 0; h < held_.size(); ++h) step_pieces(opt, b, h, unused);
  }

  /// Bucket b's piece of held shard h: the optimizer once per piece, on the engine's own
  /// values (f32) or the master weights (f16, bf16, then rounded into the engine's tensor), each
  /// piece's state a block of `k` arrays. Pieces of parameters that `unused` names are not
  /// stepped. A replica's values in the engine's tensor are overwritten by the all-gather with
  /// its owner's, the same bits.
  template <class Optimizer, class Unused>
  void step_pieces(Optimizer& opt, std::size_t b, std::size_t h, const Unused& unused) {
    auto& H = held_[h];
    const auto& L = H.lay.buckets[b];
    const std::size_t esz = dtype_size(L.type);
    const bool narrow = L.type != dtype::f32;
    const float* grads = static_cast<const float*>(grad_of(h, b));
    if (narrow) {
      widen_to_f32(scratch_.data(), grad_of(h, b), L.per_rank, L.type);
      grads = scratch_.data();
    }
    float* state = H.state.data() + k_ * L.offset;
    for (const auto& pc : L.pieces) {
      if (unused(pc.param)) continue;
      std::byte* engine = static_cast<std::byte*>(c_.views[pc.param].data) + pc.param_offset * esz;
      float* values = narrow ? H.master.data() + L.offset + pc.shard_offset : reinterpret_cast<float*>(engine);
      opt.step(shard_step{
          b, steps_, std::span<float>(values, pc.count), std::span<const float>(grads + pc.shard_offset, pc.count),
          std::span<float>(state + k_ * pc.shard_offset, k_ * pc.count), std::span<const shard_piece>(&pc, 1)});
      if (narrow) narrow_from_f32(engine, values, pc.count, L.type);
    }
  }

  /// This rank's updated values of bucket b into its slice of the pooled buffer, and the
  /// bucket's all-gather in place.
  void send(std::size_t b) {
    const auto& L = primary().buckets[b];
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
    const auto& L = primary().buckets[b];
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

  /// What this rank holds, as the next generation's wrapper reads it (`reshard::holding`).
  reshard::holding describe_holding(std::size_t k) const {
    reshard::holding d;
    d.any = true;
    d.steps = steps_;
    d.plan = plan_fp_;
    d.k = k;
    d.world = c_.pg.size();
    d.rank = c_.pg.rank();
    d.replicas = replicas_;
    d.host_of = host_of_;
    d.shards = shards_;
    return d;
  }

  /// The wrapper goes: with replicas on an elastic generation, its shards are parked for the
  /// next generation's wrapper (values and state of every shard it holds, see `parked_shards`);
  /// a shard state torn by a failed optimizer is not (this rank then holds nothing), and the
  /// last generation's state this wrapper took but did not adopt (its construction failed) is
  /// parked again as it was.
  void park() noexcept {
    try {
      if (taken_) {
        detail::park(std::move(taken_));
        return;
      }
      if (!c_.pg.elastic() || asked_replicas_ < 2 || torn_ || engine_ || held_.empty()) return;
      const std::size_t k = started_ ? k_ : (loaded_ ? loaded_k_ : 0);
      const bool has_state = started_ || loaded_;
      auto p = std::make_unique<parked_shards>();
      p->held = describe_holding(has_state ? k : 0);
      for (const auto& h : held_) {
        auto& per_bucket = p->data.emplace_back();
        for (std::size_t b = 0; b < h.lay.buckets.size(); ++b) {
          const auto& L = h.lay.buckets[b];
          const auto e = reshard::elements_of(L.numel, h.lay.world, h.lay.rank);
          const std::size_t len = e.hi - e.lo, kk = has_state ? k : 0;
          auto& a = per_bucket.emplace_back((1 + kk) * len, 0.0f);
          for (const auto& pc : L.pieces) {
            if (L.type == dtype::f32)
              std::memcpy(a.data() + pc.shard_offset,
                          static_cast<const std::byte*>(c_.views[pc.param].data) + pc.param_offset * sizeof(float),
                          pc.count * sizeof(float));
            else
              std::copy_n(h.master.data() + L.offset + pc.shard_offset, pc.count, a.data() + pc.shard_offset);
            for (std::size_t j = 0; j < kk; ++j)
              std::copy_n(h.state.data() + kk * (L.offset + pc.shard_offset) + j * pc.count, pc.count,
                          a.data() + (1 + j) * len + pc.shard_offset);
          }
        }
      }
      detail::park(std::move(p));
    } catch (...) {  // no memory to park: this rank holds nothing for the next generation
    }
  }

  /// The last generation's state, re-sharded into the shards this rank holds now (collective,
  /// in `lay_out`): every rank says what it holds (`reshard::holding`), `reshard::decide` says
  /// from whom each element comes, and each such segment (values and state together) is
  /// broadcast from its provider; every rank takes the values into the engine's parameters
  /// (the step's parameters rebuilt from the shards, even where a failed all-gather left them
  /// torn) and the state of the elements it holds. A part that nobody holds raises
  /// errc::state_lost on every rank, naming it.
  void adopt(const bucket_plan& plan) {
    const int rank = c_.pg.rank();
    taken_ = take_parked<parked_shards>();
    const reshard::holding mine = taken_ ? taken_->held : reshard::holding{};
    const auto texts = c_.pg.all_gather(reshard::encode(mine));
    std::vector<reshard::holding> all;
    for (std::size_t q = 0; q < texts.size(); ++q) {
      auto h = reshard::decode(texts[q]);
      if (!h)
        detail::raise(
            errc::protocol, rank,
            "dp_options::shard_replicas: rank " + std::to_string(q) + " described its shards as '" + texts[q] + "'");
      all.push_back(std::move(*h));
    }
    std::vector<std::size_t> numel;
    for (const auto& b : plan.buckets) numel.push_back(b.numel);
    const auto d = reshard::decide(all, numel, plan_fp_);
    if (!d.lost.empty()) detail::raise(d.code, rank, "dp_options::shard_replicas: " + d.lost);
    if (d.fresh) return;
    const std::size_t k = d.k, width = 1 + k;
    for (auto& h : held_) h.state.assign(k * h.lay.elements, 0.0f);
    constexpr std::size_t chunk_floats = std::size_t{1} << 22;  // 16 MB a broadcast
    const std::size_t step_elems = std::max<std::size_t>(1, chunk_floats / width);
    std::vector<float> buf;
    for (const auto& s : d.segments)
      for (std::size_t lo = s.lo; lo < s.hi; lo += step_elems) {
        const std::size_t len = std::min(step_elems, s.hi - lo);
        buf.assign(width * len, 0.0f);
        if (s.provider == rank) pack(s.bucket, numel[s.bucket], lo, len, width, buf);
        wait_collective(c_.red.broadcast_async(buf.data(), buf.size(), dtype::f32, s.provider),
                        "dp_options::shard_replicas: re-sharding the state of the last generation");
        unpack(plan.buckets[s.bucket], s.bucket, lo, len, k, buf);
      }
    steps_ = d.steps;
    loaded_ = true;
    loaded_k_ = k;
    started_ = false;
    adopted_ = true;
    taken_.reset();
  }

  /// Elements [lo, lo + len) of bucket b (of `numel`) from the parked shard that holds them, as
  /// `width` arrays of len.
  void pack(std::size_t b, std::size_t numel, std::size_t lo, std::size_t len, std::size_t width,
            std::vector<float>& out) const {
    const auto& h = taken_->held;
    for (std::size_t i = 0; i < h.shards.size(); ++i) {
      const auto e = reshard::elements_of(numel, h.world, h.shards[i]);
      if (lo < e.lo || lo + len > e.hi) continue;
      const std::size_t n = e.hi - e.lo;
      if (i >= taken_->data.size() || b >= taken_->data[i].size() || taken_->data[i][b].size() < width * n)
        detail::raise(
            errc::protocol, c_.pg.rank(),
            "dp_options::shard_replicas: this rank's parked shard " + std::to_string(h.shards[i]) + " holds " +
                std::to_string(i < taken_->data.size() && b < taken_->data[i].size() ? taken_->data[i][b].size() : 0) +
                " floats of bucket " + std::to_string(b) + ", not " + std::to_string(width) + " x " +
                std::to_string(n));
      const auto& a = taken_->data[i][b];
      for (std::size_t j = 0; j < width; ++j) std::copy_n(a.data() + j * n + (lo - e.lo), len, out.data() + j * len);
      return;
    }
    detail::raise(errc::protocol, c_.pg.rank(),
                  "dp_options::shard_replicas: this rank was to send elements " + std::to_string(lo) + " to " +
                      std::to_string(lo + len) + " of bucket " + std::to_string(b) + ", which it does not hold");
  }

  /// A broadcast segment into the engine's parameters (every element) and the state (and
  /// master weights) of the shards this rank holds.
  void unpack(const bucket& bk, std::size_t b, std::size_t lo, std::size_t len, std::size_t k,
              const std::vector<float>& in) {
    const std::size_t hi = lo + len;
    const std::size_t esz = dtype_size(bk.type);
    for (const auto& e : bk.entries) {
      const std::size_t from = std::max(lo, e.offset_elems), to = std::min(hi, e.offset_elems + e.numel);
      if (from >= to) continue;
      narrow_from_f32(static_cast<std::byte*>(c_.views[e.param].data) + (from - e.offset_elems) * esz,
                      in.data() + (from - lo), to - from, bk.type);
    }
    for (auto& H : held_) {
      const auto& L = H.lay.buckets[b];
      for (const auto& pc : L.pieces) {
        const std::size_t p0 = L.first + pc.shard_offset;
        const std::size_t from = std::max(lo, p0), to = std::min(hi, p0 + pc.count);
        if (from >= to) continue;
        const std::size_t t = from - p0, n = to - from;
        for (std::size_t j = 0; j < k; ++j)
          std::copy_n(in.data() + (1 + j) * len + (from - lo), n,
                      H.state.data() + k * (L.offset + pc.shard_offset) + j * pc.count + t);
        if (!H.master.empty() && L.type != dtype::f32)
          std::copy_n(in.data() + (from - lo), n, H.master.data() + L.offset + pc.shard_offset + t);
      }
    }
  }

  void wait_collective(const request& r, const char* what) const {
    try {
      r.wait(steady_clock::now() + wait_patience(c_.opts, c_.pg) + std::chrono::seconds(2));
    } catch (const error& e) {
      if (e.rank() >= 0) throw;
      detail::raise(e.condition(), c_.pg.rank(), std::string(what) + ": " + e.what());
    }
  }

  step_context<Reducer, Allocator> c_;
  const agreement& agree_;
  std::vector<holding_state> held_;  // [0]: this rank's own shard; then the replicas it holds
  std::vector<int> shards_;          // the shard index of each of held_
  std::vector<int> host_of_;         // the group's hosts, per rank (all 0 without replicas)
  int replicas_ = 1;                 // ranks holding each shard (capped at the world size)
  int asked_replicas_ = 1;           // dp_options::shard_replicas, resolved: an elastic group's
                                     // state moves from generation to generation when above 1,
                                     // even at a world of 1
  std::uint64_t plan_fp_ = 0;        // the plan's fingerprint (a holding's `plan`)
  void* grads_ = nullptr;            // the gradient shards, from the allocator
  std::size_t grad_bytes_ = 0;
  std::vector<std::size_t> unsliced_;     // replicas: buckets launched whose slices are not taken yet
  std::unique_ptr<parked_shards> taken_;  // the last generation's, until adopted
  std::vector<float> scratch_;            // a narrow bucket's gradients widened
  std::size_t loaded_k_ = 0;              // the loaded (or adopted) state's floats per element
  std::size_t k_ = 0;
  bool loaded_ = false;   // the shards hold a loaded or adopted state, which the next step adopts
  bool adopted_ = false;  // the last generation's state, re-sharded at construction
  bool started_ = false;  // a step ran since
  bool torn_ = false;     // inside a step's optimizer work (or it failed there)
  bool engine_ = false;   // the engine's optimizer steps the shards (step_engine)
  std::uint64_t steps_ = 0;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
