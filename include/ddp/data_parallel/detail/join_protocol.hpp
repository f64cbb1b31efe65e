#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/join_protocol.hpp
/// `join_protocol`: uneven inputs (`dp_options::uneven_inputs`, docs/data-parallel.md, "Uneven
/// inputs"): the count of contributing ranks that opens each step, the average over those ranks,
/// and `join()`'s answers to the steps of the ranks still training.
// IWYU pragma: private

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <ddp/data_parallel/agreement.hpp>
#include <ddp/data_parallel/bucket_memory.hpp>
#include <ddp/data_parallel/bucket_state.hpp>
#include <ddp/data_parallel/buffers.hpp>
#include <ddp/data_parallel/detail/bucket_ops.hpp>
#include <ddp/data_parallel/detail/step_context.hpp>
#include <ddp/data_parallel/detail/step_guard.hpp>
#include <ddp/data_parallel/detail/step_sync.hpp>
#include <ddp/data_parallel/detail/uneven.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/parameter.hpp>
#include <ddp/process_group.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// The uneven-inputs protocol of one wrapper. Every synchronized step of an active rank, and
/// every round of a joined rank's join(), starts with an allreduce (op::sum) of one i64 through
/// the reducer, issued before any bucket: 1 from a rank that contributes gradients, 0 from a
/// joined one. The count tells a step's ranks how many contributed, and joined ranks whether to
/// answer one more step. Holds references to the wrapper's parts, which outlive it.
template <class Reducer, class Allocator>
class join_protocol {
 public:
  join_protocol(const step_context<Reducer, Allocator>& c, step_sync<Reducer, Allocator>& sync) noexcept
      : c_(c), sync_(sync) {}

  /// Starts the count's allreduce with this rank's `contribution` (under bucket_state's lock
  /// when a step opens, so before any of its buckets).
  void issue_count(std::int64_t contribution) {
    c_.memory.put_side(&contribution, sizeof contribution);
    c_.memory.track_side(c_.red.allreduce_async(c_.memory.side(), 1, dtype::i64, op::sum));
  }

  /// Waits (bounded) for the count and returns it.
  std::int64_t wait_count(const char* what) {
    std::int64_t count = 0;
    c_.guarded(
        what, -1,
        [&] {
          c_.memory.wait_side(wait_patience(c_.opts, c_.pg), c_.pg.rank(),
                              "the count of ranks contributing to the step was not reduced");
          c_.memory.get_side(&count, sizeof count);
        },
        false);
    if (count < 0 || count > c_.pg.size())
      c_.guarded(what, -1, [&] {
        detail::raise(errc::protocol, c_.pg.rank(),
                      "the count of ranks contributing to the step is " + std::to_string(count) + " of " +
                          std::to_string(c_.pg.size()) + " (a rank without dp_options::uneven_inputs?)");
      });
    return count;
  }

  /// Bucket b holds the reducer's result over every rank, joined ones contributing zeros: make
  /// it the average over the `count` contributors (floats: scaled by world / count unless they
  /// are all; integers: their sum divided by count).
  void finish_bucket(std::size_t b, int contributors) {
    const auto& bk = c_.memory.plan().buckets[b];
    if (!c_.opts.average || bk.numel == 0) return;
    const int count = c_.opts.divide_by == join_divisor::world_size ? c_.pg.size() : contributors;
    if (count == c_.pg.size() && detail::avg_scales(bk.type)) return;
    c_.guarded("finish (averaging over the contributing ranks)", -1, [&] {
      c_.memory.on_host(b, [&](void* p) { detail::uneven_finish(p, bk.numel, bk.type, c_.pg.size(), count); });
    });
  }

  /// join() blocks its caller until every rank has joined: another thread's step meanwhile
  /// would be collectives the peers never match.
  void check_not_joining(const char* what) const {
    if (joining_.load(std::memory_order_acquire))
      detail::raise(errc::usage, c_.pg.rank(),
                    std::string(what) +
                        " while this rank's join() is running (join() returns once every rank "
                        "has joined; the next epoch's steps may start then)");
  }

  /// Steps of other ranks answered with zero gradients, over every join() so far.
  std::uint64_t joined_steps() const noexcept { return joined_steps_; }

  /// The wrapper's join() after its health check: answers the steps of the ranks still training
  /// with zeros in every bucket (`buckets`: the wrapper's, as in a step) until every rank has joined.
  void run(bucket_ops<Reducer, Allocator>& buckets) {
    if (!c_.opts.uneven_inputs)
      detail::raise(errc::usage, c_.pg.rank(),
                    "join() needs dp_options::uneven_inputs = true (on every rank) when the wrapper is built");
    if (c_.state.is_open())
      detail::raise(errc::usage, c_.pg.rank(),
                    "join() in the middle of a step (after grad_ready or mark_unused, before finish()); finish the "
                    "step first");
    if (joining_.exchange(true, std::memory_order_acq_rel))
      detail::raise(errc::usage, c_.pg.rank(), "join() while this rank's join() is already running");
    struct clear_on_exit {
      std::atomic<bool>& flag;
      ~clear_on_exit() { flag.store(false, std::memory_order_release); }
    } clear{joining_};
    c_.state.clear_accumulated();  // never averaged: dropped (documented)
    const auto& plan = c_.memory.plan();
    std::uint64_t answered = 0;  // steps of others answered in this join()
    for (;;) {
      c_.guarded("join", -1, [&] { issue_count(0); });
      const std::int64_t count = wait_count("join");
      if (count > 0) {
        // One step of the ranks still training: every bucket, in plan order, zeros in.
        c_.guarded("join", -1, [&] {
          for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
            c_.memory.zero_bucket(b);
            buckets.launch(b);
          }
        });
        for (std::size_t b = 0; b < plan.buckets.size(); ++b) buckets.wait(b, "join");
        // The step's buffers, from the highest rank still training (PyTorch's Join does the same).
        const int source = sync_.exchange_record(true, "join");
        sync_.sync_buffer_values(source, sync_.step_buffer_mode(static_cast<int>(count)),
                                 "join (the buffers after the step)");
        ++joined_steps_;
      }
      c_.memory.clear_requests();
      if (count == 0) break;  // every rank has joined, and all of them saw it in this round
      ++answered;
    }
    // Ranks that joined early took no optimizer steps since: the last rank to join holds the
    // model every rank continues from (PyTorch's Join ends the same way, _sync_final_model).
    if (c_.pg.size() > 1)
      c_.guarded("join (the model of the last rank to join)", -1, [&] {
        const auto last =
            static_cast<int>(c_.pg.all_reduce(static_cast<std::int64_t>(answered == 0 ? c_.pg.rank() : -1), op::max));
        if (last < 0 || last >= c_.pg.size())
          detail::raise(errc::protocol, c_.pg.rank(),
                        "join(): no rank says it joined last (" + std::to_string(last) + ")");
        agreement::broadcast_values(plain_reducer(c_.red), std::span<const tensor_view>(c_.views), c_.pg.timeout(),
                                    last);
        agreement::broadcast_values(plain_reducer(c_.red), std::span<const buffer_view>(c_.buffers.buffers()),
                                    c_.pg.timeout(), last);
      });
    if (c_.opts.gradient_as_bucket_view)
      c_.guarded("join", -1, [&] {
        for (std::size_t b = 0; b < plan.buckets.size(); ++b) c_.memory.zero_bucket(b);
      });
  }

 private:
  step_context<Reducer, Allocator> c_;
  step_sync<Reducer, Allocator>& sync_;
  std::atomic<bool> joining_{false};  // join() runs (on some thread)
  std::uint64_t joined_steps_ = 0;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
