#pragma once
/// \file data_parallel/join_mode.hpp
/// `ddp::join_mode<Wrapper>`: the calls of uneven inputs (`dp_options::uneven_inputs`, as
/// PyTorch's `Join`) that `basic_data_parallel` offers: `join()` for a rank whose batches ran
/// out, and `joined_steps()`. The wrapper derives from it; the protocol is
/// `data_parallel/detail/join_protocol.hpp`'s. See docs/data-parallel.md, "Uneven inputs".
///
/// \code
/// ddp::data_parallel dp{pg, params, {}, {.uneven_inputs = true}};
/// for (const auto& batch : my_shard) { train_step(batch); dp.finish(); }
/// dp.join();  // the other ranks may still have batches
/// \endcode

#include <cstdint>

#include <ddp/version.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Uneven inputs' calls, a base of `basic_data_parallel` (CRTP: `Wrapper` is the wrapper, which
/// holds the join protocol and the buckets).
template <class Wrapper>
class join_mode {
 public:
  /// This rank has no batch left in the epoch (`dp_options::uneven_inputs`): until every rank has
  /// joined, answers each synchronized step of the others with zero gradients, so that their
  /// collectives complete and their averages count only the ranks that contributed; returns
  /// when every rank has joined (all ranks leave together). The wrapper can then start the next
  /// epoch. Every wait is bounded by the timeout, including the one for the next step of the
  /// ranks still training (a `no_sync()` window longer than the timeout fails the joined ranks).
  /// In copy mode this rank's gradients are left as they were; in view mode they are bucket
  /// memory, which the answers are made in: they are zero when `join()` returns. Gradients that
  /// `no_sync()` steps accumulated and no synchronized step averaged are dropped.
  /// Throws `errc::usage` without the option, in the middle of a step, or while this rank's
  /// `join()` already runs; a failure inside (timeout, peer_lost) fails the wrapper for good.
  void join() {
    Wrapper& w = static_cast<Wrapper&>(*this);
    w.check_healthy();
    w.join_.run(w.buckets_);
  }

  /// Steps of other ranks that this rank answered with zero gradients inside `join()`, summed
  /// over every `join()` so far.
  std::uint64_t joined_steps() const noexcept { return static_cast<const Wrapper&>(*this).join_.joined_steps(); }

 protected:
  join_mode() = default;
  ~join_mode() = default;
  join_mode(const join_mode&) = delete;
  join_mode& operator=(const join_mode&) = delete;
};

}  // namespace DDP_ABI
}  // namespace ddp
