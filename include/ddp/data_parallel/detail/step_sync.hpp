#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/step_sync.hpp
/// `step_sync`: the collectives that end a synchronized step besides the buckets: the step
/// record (which parameters no rank used, which rank the buffers come from) and the buffers'
/// values (docs/engines.md, "What is synchronized").
// IWYU pragma: private

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ddp/data_parallel/bucket_memory.hpp>
#include <ddp/data_parallel/bucket_state.hpp>
#include <ddp/data_parallel/buffers.hpp>
#include <ddp/data_parallel/detail/step_guard.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/detail/kernels.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/process_group.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// How long the wrapper waits for one of its collectives: `dp_options::timeout`, or the group's.
inline std::chrono::milliseconds wait_patience(const dp_options& opts, const process_group& pg) noexcept {
  return opts.timeout.count() > 0 ? opts.timeout : pg.timeout();
}

/// The step record and the buffers' synchronization of one wrapper, over its side buffer. The
/// side buffer holds, one after the other in time, the uneven-inputs count, the step record and
/// the buffers' staging: each collective on it ends before the next one is put there. Holds
/// references to the wrapper's parts, which outlive it.
template <class Reducer, class Allocator>
class step_sync {
 public:
  step_sync(process_group& pg, const dp_options& opts, std::size_t params, const buffer_layout& buffers,
            bucket_memory<Allocator>& memory, const bucket_state& state, Reducer& red,
            step_guard<Reducer>& guarded) noexcept
      : pg_(pg),
        opts_(opts),
        params_(params),
        buffers_(buffers),
        memory_(memory),
        state_(state),
        red_(red),
        guarded_(guarded) {}

  /// The side buffer's size: the largest of what it holds in turn.
  std::size_t side_bytes() const {
    std::size_t bytes = opts_.uneven_inputs ? sizeof(std::int64_t) : 0;
    if (record_needed()) bytes = std::max(bytes, step_record::bytes(params_));
    return std::max(bytes, buffers_.bytes());  // also with buffer_sync::none, for sync_buffers()
  }

  /// The step record is reduced when some rank may not use a parameter (which ones no rank used)
  /// or when ranks may join and buffers follow one rank (which rank that is).
  bool record_needed() const noexcept {
    return pg_.size() > 1 &&
           (opts_.find_unused_parameters ||
            (opts_.uneven_inputs && opts_.buffers != buffer_sync::none && !buffers_.groups().empty()));
  }

  /// After this step's buckets (or a joined rank's zeros), under the guard.
  void issue_record(bool joined) {
    std::vector<bool> used(params_, false);
    if (!joined)
      for (std::size_t i = 0; i < params_; ++i) used[i] = !state_.unused(i) || state_.accumulated(i);
    const auto words = step_record::encode(used, joined ? -1 : pg_.rank());
    memory_.put_side(words.data(), words.size() * sizeof(std::int64_t));
    memory_.track_side(plain_reducer(red_).allreduce_async(memory_.side(), words.size(), dtype::i64, op::max));
  }

  /// Waits (bounded) for the record; keeps which parameters no rank used and returns the source
  /// of the buffers (the highest rank that took part in the step).
  int wait_record(const char* what) {
    std::vector<std::int64_t> words(params_ + 1, 0);
    guarded_(
        what, -1,
        [&] {
          memory_.wait_side(wait_patience(opts_, pg_), pg_.rank(),
                            "the step record (parameters used, the buffers' source) was not reduced");
          memory_.get_side(words.data(), words.size() * sizeof(std::int64_t));
        },
        false);
    unused_everywhere_.assign(params_, 0);
    if (opts_.find_unused_parameters)
      for (std::size_t i = 0; i < params_; ++i) unused_everywhere_[i] = words[i] == 0 ? 1 : 0;
    // The buffers' source: the highest rank in the step with uneven inputs (PyTorch's Join picks
    // it so too), rank 0 otherwise.
    const std::int64_t source = opts_.uneven_inputs ? words.back() : 0;
    if (source < 0 || source >= pg_.size())
      guarded_(what, -1, [&] {
        detail::raise(errc::protocol, pg_.rank(),
                      "the step record names rank " + std::to_string(source) + " of " + std::to_string(pg_.size()) +
                          " as the buffers' source");
      });
    return static_cast<int>(source);
  }

  /// The step record after the step's buckets (`joined`: a joined rank's zeros): issued when
  /// needed, awaited, kept; returns the buffers' source (rank 0 without a record).
  int exchange_record(bool joined, const char* what) {
    if (record_needed()) guarded_(what, -1, [&] { issue_record(joined); });
    const int source = record_needed() ? wait_record(what) : 0;
    if (!joined && opts_.find_unused_parameters && pg_.size() == 1) note_unused_alone();
    return source;
  }

  /// With find_unused_parameters on a world of one: the record is this rank's own.
  void note_unused_alone() {
    unused_everywhere_.assign(params_, 0);
    for (std::size_t i = 0; i < params_; ++i)
      unused_everywhere_[i] = state_.unused(i) && !state_.accumulated(i) ? 1 : 0;
  }

  /// True when the last record said no rank used parameter `i`.
  bool unused_everywhere(std::size_t i) const noexcept {
    return i < unused_everywhere_.size() && unused_everywhere_[i] != 0;
  }

  /// How this step's buffers are made alike: dp_options::buffers, except that averaging while
  /// ranks have joined would mix in their stale buffers: the highest training rank's then.
  buffer_sync step_buffer_mode(int contributors) const noexcept {
    if (opts_.buffers == buffer_sync::average && opts_.uneven_inputs && contributors < pg_.size())
      return buffer_sync::broadcast;
    return opts_.buffers;
  }

  /// Makes the buffers alike: rank `source`'s everywhere, or the floating-point ones averaged.
  /// One collective per dtype over the side buffer, each awaited before the next is put there.
  void sync_buffer_values(int source, buffer_sync how, const char* what) {
    if (how == buffer_sync::none || buffers_.groups().empty() || pg_.size() == 1) return;
    const auto& bufs = buffers_.buffers();
    guarded_(what, -1, [&] {
      for (const auto& sl : buffers_.slots())
        memory_.put_side(sl.offset, bufs[sl.buffer].data, bufs[sl.buffer].bytes());
    });
    for (const auto& g : buffers_.groups()) {
      void* p = static_cast<std::byte*>(memory_.side()) + g.offset;
      guarded_(what, -1, [&] {
        auto& red = plain_reducer(red_);
        memory_.track_side(how == buffer_sync::average && detail::avg_scales(g.type)
                               ? red.allreduce_async(p, g.numel, g.type, op::avg)
                               : red.broadcast_async(p, g.numel, g.type, source));
      });
      guarded_(
          what, -1,
          [&] {
            memory_.wait_side(wait_patience(opts_, pg_), pg_.rank(),
                              std::string("the ") + dtype_name(g.type) + " buffers were not " +
                                  (how == buffer_sync::average ? "averaged" : "broadcast"));
          },
          false);
    }
    guarded_(what, -1, [&] {
      for (const auto& sl : buffers_.slots())
        memory_.get_side(sl.offset, bufs[sl.buffer].data, bufs[sl.buffer].bytes());
    });
  }

 private:
  process_group& pg_;
  const dp_options& opts_;
  std::size_t params_;
  const buffer_layout& buffers_;
  bucket_memory<Allocator>& memory_;
  const bucket_state& state_;
  Reducer& red_;
  step_guard<Reducer>& guarded_;
  std::vector<std::uint8_t> unused_everywhere_;  // per parameter, after a synchronized step (the record)
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
