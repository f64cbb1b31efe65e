#pragma once
/// \file data_parallel/options.hpp
/// The values of `ddp::basic_data_parallel`: its run-time options (`dp_options`) and what a
/// step cost (`step_stats`, `bucket_timing`). See docs/data-parallel.md.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <ddp/version.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// How the wrapper keeps a model's buffers (`buffer_kind::buffer`: BatchNorm statistics and the
/// like) alike across ranks after construction, where every buffer and frozen parameter becomes
/// rank 0's. See docs/engines.md, "What is synchronized".
enum class buffer_sync : std::uint8_t {
  /// Rank 0's buffers are copied to every rank at the end of each synchronized step (`finish()`),
  /// so the next forward starts from them on every rank: PyTorch's `broadcast_buffers=True`.
  broadcast,
  /// Floating-point buffers are averaged over the ranks at the end of each synchronized step,
  /// integer ones (step counters) copied from rank 0.
  average,
  /// Each rank keeps its own after construction: PyTorch's `broadcast_buffers=False`.
  none,
};

/// What a step's average divides by when ranks have joined (`dp_options::uneven_inputs`).
enum class join_divisor : std::uint8_t {
  /// The world size: joined ranks count as zero gradients, as PyTorch's `Join` does by default
  /// (`divide_by_initial_world_size=True`).
  world_size,
  /// The ranks that contributed gradients to the step (`step_stats::contributors`).
  contributors,
};

/// Run-time options of the data-parallel wrapper. See docs/data-parallel.md.
/// \code
/// ddp::data_parallel dp{pg, params, {}, ddp::dp_options{.gradient_as_bucket_view = true}};
/// \endcode
struct dp_options {
  /// The engine writes gradient i straight into bucket memory (`bucket_grad(i)`), so nothing is
  /// copied in or out. The bucket layout is then fixed at construction (no rebuild from the
  /// ready order), so a pointer from `bucket_grad(i)` stays valid for the wrapper's lifetime.
  bool gradient_as_bucket_view = false;
  /// Parameters that never became ready by `finish()` count as a zero gradient instead of being
  /// an error (models whose forward skips parts of the network).
  bool find_unused_parameters = false;
  /// Copy rank 0's parameter values to every rank at construction.
  bool broadcast_parameters = true;
  /// Reduce with `op::avg` (true) or `op::sum` (false: the engine scales gradients itself).
  bool average = true;
  /// Bound on `finish()`'s wait for the reductions; zero means the process group's timeout.
  std::chrono::milliseconds timeout{0};
  /// Ranks may run out of batches at different steps (PyTorch's `Join`): a rank with no batch
  /// left calls `join()`, which answers the other ranks' synchronized steps with zero gradients
  /// until every rank has joined, and each step averages over the ranks that contributed to it.
  /// Every rank must pass the same value; the bucket layout is then fixed at construction (no
  /// rebuild from the ready order). See docs/data-parallel.md, "Uneven inputs".
  bool uneven_inputs = false;
  /// With `uneven_inputs`: a step's average is the sum over the ranks that contributed divided
  /// by the world size (PyTorch's default), or by the number of contributors.
  join_divisor divide_by = join_divisor::world_size;
  /// How buffers stay alike after construction: rank 0's after every synchronized step
  /// (PyTorch's default), averaged, or not at all.
  buffer_sync buffers = buffer_sync::broadcast;
  /// Record every step into a Chrome trace file (Perfetto, chrome://tracing): rank r writes
  /// `<timeline>.rank<r>.json` (or the name with `{rank}` replaced by r). Empty: the environment
  /// variable `DDP_TIMELINE`, and no timeline when that is unset too. See docs/tuning.md,
  /// "See a step: the timeline".
  std::string timeline = {};
  /// Steps the timeline records before it stops; 0: `DDP_TIMELINE_STEPS`, else 1000.
  std::uint64_t timeline_steps = 0;
  /// Sharded data parallel (ZeRO-2): each bucket ends with a reduce-scatter, so after `finish()`
  /// each rank holds the average of its shard of every bucket (the engine's own gradients stay
  /// this rank's); `step(optimizer)` then steps the shard with a `ddp::shard_optimizer`
  /// (`ddp::sgd`, `ddp::adamw` or the engine's) and all-gathers the updated parameters into the
  /// engine's tensors. Optimizer state and averaged gradients per rank shrink by the world size.
  /// Every rank must pass the same value; the bucket layout is fixed at construction; not with
  /// `gradient_as_bucket_view`, `uneven_inputs` or the autotune. See docs/sharded.md.
  bool shard = false;
  /// With `shard`: how many ranks hold each shard of the optimizer state (and master weights),
  /// each stepping it from the same averaged gradient to the same bits, so that an elastic group
  /// that loses up to `shard_replicas - 1` of a shard's holders re-shards in memory, with no
  /// checkpoint read and no step repeated. 0: 2 on an elastic group's generation, else 1. Capped
  /// at the world size; holders lie on different hosts where there are enough. Every rank must
  /// pass the same value. See docs/sharded.md, "Surviving failures".
  int shard_replicas = 0;

  /// Copy mode: copy gradient i into its bucket at `grad_ready(i)` even where the reducer could
  /// read it in place. By default a reducer that reads a bucket's data where it is (`auto_reducer`
  /// on ring<tcp>, `ring<tcp>`: several hosts, one rank each) is handed the gradients' addresses
  /// instead (not with `uneven_inputs`), and reads them and writes the averages there: two
  /// copies of every gradient less per step
  /// (docs/performance.md, "Across hosts"). The engine must then leave gradient i as it is from
  /// `grad_ready(i)` until `finish()` returns (which writes the average there); set this when it
  /// reuses that memory in between.
  bool copy_gradients_at_ready = false;
  friend bool operator==(const dp_options&, const dp_options&) = default;
};

/// Timing of one bucket in one step, in milliseconds from the step's first `grad_ready`.
struct bucket_timing {
  std::size_t bytes = 0;       ///< bytes reduced by this bucket's collective
  std::size_t parameters = 0;  ///< parameters in the bucket
  double ready_ms = 0;         ///< its last gradient arrived (the bucket became complete)
  double launch_ms = 0;        ///< handed to the reducer (later than ready when an earlier bucket lagged)
  double reduced_ms = 0;       ///< the reducer finished it

  /// Time from the bucket becoming complete to its reduction ending.
  double ready_to_reduced_ms() const noexcept { return reduced_ms - ready_ms; }
  /// Time the collective spent queued and running.
  double launch_to_reduced_ms() const noexcept { return reduced_ms - launch_ms; }
};

/// A bucket whose average has just reached the engine's gradients, as the bucket hook
/// (`basic_data_parallel::on_bucket_reduced`) sees it: its index in the plan and the parameters
/// whose gradients it holds (indices into the parameter set), valid during the call.
struct reduced_bucket {
  std::size_t bucket = 0;
  std::span<const std::size_t> parameters;
  std::uint64_t step = 0;  ///< the step `finish()` is ending (`steps()` before it returns)
};

/// What one step cost; `last_step_stats()` after `finish()`.
struct step_stats {
  std::uint64_t step = 0;                  ///< 0 for the first `finish()`
  bool synchronized = false;               ///< false for a step under `no_sync()`
  std::size_t bytes_reduced = 0;           ///< sum of the bucket sizes reduced this step
  std::size_t unused = 0;                  ///< parameters not ready in this step (mark_unused or the option)
  int contributors = 0;                    ///< ranks whose gradients this step averaged (the world size, or fewer
                                           ///< when ranks had joined: `dp_options::uneven_inputs`); 0 unsynchronized
  std::size_t launched_before_finish = 0;  ///< buckets launched while backward was still running
  double backward_ms = 0;                  ///< first to last `grad_ready` (the backward window seen by ddp)
  double exposed_ms = 0;                   ///< last `grad_ready` to `finish()` return: communication not hidden
  double finish_ms = 0;                    ///< time spent inside `finish()`
  std::vector<bucket_timing> buckets;      ///< in plan (launch) order; empty for unsynchronized steps
};

/// How a wrapper's construction made every rank start from rank 0's parameters and buffers
/// (`construction()`): a broadcast, or, on a group that expects every rank to hold the same
/// state already (an elastic group re-formed from ranks that all hold the state of one step,
/// `process_group::expects_equal_state`), a comparison of hashes, with a broadcast only where
/// they differ. The same on every rank. See docs/elastic.md, "Re-forming without a broadcast".
/// \code
/// if (dp.construction().bytes_broadcast == 0) std::puts("the survivors' parameters were already equal");
/// \endcode
struct construction_stats {
  bool hashes_compared = false;  ///< every rank hashed its values (XXH64) and the ranks compared the hashes
  /// Some rank's hash differed from rank 0's although the group expected equal values: the
  /// elastic protocol's promise did not hold (rank 0 says so on stderr), and rank 0's values
  /// were broadcast.
  bool hashes_differed = false;
  std::vector<int> differing;       ///< the ranks whose hash differed, ascending
  std::size_t bytes_broadcast = 0;  ///< bytes of parameters and buffers copied from rank 0; 0: none
};

/// One candidate cap of the bucket-cap autotune (`bucket_policy::autotune`) and what it measured.
struct autotune_candidate {
  std::size_t cap_bytes = 0;
  std::size_t buckets = 0;         ///< buckets in its plan
  std::vector<double> samples_ms;  ///< per measured step: the slowest rank's first `grad_ready` to `finish()` return
  double median_ms = 0;            ///< the median of `samples_ms`: what the choice compares
};

/// What the bucket-cap autotune measured and chose; `autotune_report()` of the wrapper. Every
/// rank holds the same figures (each sample is already the maximum over the ranks).
/// \code
/// const auto& r = dp.autotune_report();
/// if (r.done) std::printf("cap %zu bytes\n", r.chosen_cap_bytes);
/// \endcode
struct autotune_report {
  bool enabled = false;                        ///< `bucket_policy::autotune` was set
  bool done = false;                           ///< the choice is made and in place
  std::size_t chosen_cap_bytes = 0;            ///< rank 0's choice, adopted by every rank (0 until done)
  std::uint64_t decided_at_step = 0;           ///< the `finish()` (step number) that made the choice
  std::vector<autotune_candidate> candidates;  ///< in the order they were tried (ascending caps)
};

}  // namespace DDP_ABI
}  // namespace ddp
