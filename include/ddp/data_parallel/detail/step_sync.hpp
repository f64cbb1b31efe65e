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
#include <ddp/data_parallel/detail/parameters.hpp>
#include <ddp/data_parallel/detail/step_context.hpp>
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
  explicit step_sync(const step_context<Reducer, Allocator>& c) noexcept : c_(c) {}

  /// finish()'s parameters never ready, without find_unused_parameters: errc::usage naming
  /// them, left for the peers as well (process_group::note_error), which wait for this rank's
  /// buckets: should it not repair the step, their timeout quotes why. A later whole step
  /// clears it.
  void check_missing(const std::vector<std::size_t>& missing, const std::vector<std::string>& names) {
    if (!missing.empty() && !c_.opts.find_unused_parameters) {
      c_.pg.note_error("step " + std::to_string(c_.step) + ": " + missing_text(missing, names));
      noted_error_ = true;
      raise_missing(c_.pg.rank(), missing, names);
    }
    if (noted_error_) c_.pg.note_error({});  // repaired
    noted_error_ = false;
  }

  /// The side buffer's size: the largest of what it holds in turn.
  std::size_t side_bytes() const {
    std::size_t bytes = c_.opts.uneven_inputs ? sizeof(std::int64_t) : 0;
    if (record_needed()) bytes = std::max(bytes, step_record::bytes(c_.views.size()));
    return std::max(bytes, c_.buffers.bytes());  // also with buffer_sync::none, for sync_buffers()
  }

  /// The step record is reduced when some rank may not use a parameter (which ones no rank used)
  /// or when ranks may join and buffers follow one rank (which rank that is).
  bool record_needed() const noexcept {
    return c_.pg.size() > 1 &&
           (c_.opts.find_unused_parameters ||
            (c_.opts.uneven_inputs && c_.opts.buffers != buffer_sync::none && !c_.buffers.groups().empty()));
  }

  /// After this step's buckets (or a joined rank's zeros), under the guard.
  void issue_record(bool joined) {
    std::vector<bool> used(c_.views.size(), false);
    if (!joined)
      for (std::size_t i = 0; i < c_.views.size(); ++i) used[i] = !c_.state.unused(i) || c_.state.accumulated(i);
    const auto words = step_record::encode(used, joined ? -1 : c_.pg.rank());
    c_.memory.put_side(words.data(), words.size() * sizeof(std::int64_t));
    c_.memory.track_side(plain_reducer(c_.red).allreduce_async(c_.memory.side(), words.size(), dtype::i64, op::max));
  }

  /// Waits (bounded) for the record; keeps which parameters no rank used and returns the source
  /// of the buffers (the highest rank that took part in the step).
  int wait_record(const char* what) {
    std::vector<std::int64_t> words(c_.views.size() + 1, 0);
    c_.guarded(
        what, -1,
        [&] {
          c_.memory.wait_side(wait_patience(c_.opts, c_.pg), c_.pg.rank(),
                              "the step record (parameters used, the buffers' source) was not reduced");
          c_.memory.get_side(words.data(), words.size() * sizeof(std::int64_t));
        },
        false);
    unused_everywhere_.assign(c_.views.size(), 0);
    if (c_.opts.find_unused_parameters)
      for (std::size_t i = 0; i < c_.views.size(); ++i) unused_everywhere_[i] = words[i] == 0 ? 1 : 0;
    // The buffers' source: the highest rank in the step with uneven inputs (PyTorch's Join picks
    // it so too), rank 0 otherwise.
    const std::int64_t source = c_.opts.uneven_inputs ? words.back() : 0;
    if (source < 0 || source >= c_.pg.size())
      c_.guarded(what, -1, [&] {
        detail::raise(errc::protocol, c_.pg.rank(),
                      "the step record names rank " + std::to_string(source) + " of " + std::to_string(c_.pg.size()) +
                          " as the buffers' source");
      });
    return static_cast<int>(source);
  }

  /// The step record after the step's buckets (`joined`: a joined rank's zeros): issued when
  /// needed, awaited, kept; returns the buffers' source (rank 0 without a record).
  int exchange_record(bool joined, const char* what) {
    if (record_needed()) c_.guarded(what, -1, [&] { issue_record(joined); });
    const int source = record_needed() ? wait_record(what) : 0;
    if (!joined && c_.opts.find_unused_parameters && c_.pg.size() == 1) note_unused_alone();
    return source;
  }

  /// With find_unused_parameters on a world of one: the record is this rank's own.
  void note_unused_alone() {
    unused_everywhere_.assign(c_.views.size(), 0);
    for (std::size_t i = 0; i < c_.views.size(); ++i)
      unused_everywhere_[i] = c_.state.unused(i) && !c_.state.accumulated(i) ? 1 : 0;
  }

  /// True when the last record said no rank used parameter `i`.
  bool unused_everywhere(std::size_t i) const noexcept {
    return i < unused_everywhere_.size() && unused_everywhere_[i] != 0;
  }

  /// How this step's buffers are made alike: dp_options::buffers, except that averaging while
  /// ranks have joined would mix in their stale buffers: the highest training rank's then.
  buffer_sync step_buffer_mode(int contributors) const noexcept {
    if (c_.opts.buffers == buffer_sync::average && c_.opts.uneven_inputs && contributors < c_.pg.size())
      return buffer_sync::broadcast;
    return c_.opts.buffers;
  }

  /// Makes the buffers alike: rank `source`'s everywhere, or the floating-point ones averaged.
  /// One collective per dtype over the side buffer, each awaited before the next is put there.
  void sync_buffer_values(int source, buffer_sync how, const char* what) {
    if (how == buffer_sync::none || c_.buffers.groups().empty() || c_.pg.size() == 1) return;
    const auto& bufs = c_.buffers.buffers();
    c_.guarded(what, -1, [&] {
      for (const auto& sl : c_.buffers.slots())
        c_.memory.put_side(sl.offset, bufs[sl.buffer].data, bufs[sl.buffer].bytes());
    });
    for (const auto& g : c_.buffers.groups()) {
      void* p = static_cast<std::byte*>(c_.memory.side()) + g.offset;
      c_.guarded(what, -1, [&] {
        auto& red = plain_reducer(c_.red);
        c_.memory.track_side(how == buffer_sync::average && detail::avg_scales(g.type)
                                 ? red.allreduce_async(p, g.numel, g.type, op::avg)
                                 : red.broadcast_async(p, g.numel, g.type, source));
      });
      c_.guarded(
          what, -1,
          [&] {
            c_.memory.wait_side(wait_patience(c_.opts, c_.pg), c_.pg.rank(),
                                std::string("the ") + dtype_name(g.type) + " buffers were not " +
                                    (how == buffer_sync::average ? "averaged" : "broadcast"));
          },
          false);
    }
    c_.guarded(what, -1, [&] {
      for (const auto& sl : c_.buffers.slots())
        c_.memory.get_side(sl.offset, bufs[sl.buffer].data, bufs[sl.buffer].bytes());
    });
  }

 private:
  step_context<Reducer, Allocator> c_;
  bool noted_error_ = false;                     // check_missing left its error for the peers
  std::vector<std::uint8_t> unused_everywhere_;  // per parameter, after a synchronized step (the record)
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
