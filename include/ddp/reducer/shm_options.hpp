#pragma once
/// \file reducer/shm_options.hpp
/// The options of `ddp::shm` (reducer/shm.hpp) and its allreduce algorithms, apart from the
/// engine, so that what sets up its segment (reducer/detail/shm_session.hpp) and what builds
/// one (`ddp::hierarchical`) need not see the engine. See docs/reducers.md.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <ddp/version.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Allreduce algorithm of `ddp::shm`.
enum class shm_algo : std::uint8_t {
  /// Reduce-scatter + allgather: rank r reduces slice r of every rank's input and writes it to
  /// every rank's output. Reads and writes each byte once per rank: the bandwidth path.
  ring,
  /// Every rank reduces the whole message from all ranks' staging slots into its own buffer:
  /// one synchronization less per chunk, n times the reads. The latency path for small messages.
  tree,
};

constexpr const char* shm_algo_name(shm_algo a) noexcept { return a == shm_algo::tree ? "tree" : "ring"; }

/// Tunables of `ddp::shm`; see docs/reducers.md. Geometry (segment and slot sizes) is taken
/// from rank 0; `spin` and `host_id` are per rank.
struct shm_options {
  /// Bytes of the zero-copy arena that `ddp::shm_allocator` hands out; each rank owns
  /// segment_bytes / world of it. 0 (the default): each rank's part is as large as /dev/shm, so
  /// the arena holds whatever fits in /dev/shm. Either way pages are reserved only as blocks are
  /// handed out. See "Shared-memory sizing" in docs/reducers.md.
  std::size_t segment_bytes = 0;
  /// Staging bytes per rank per pipeline slot (two slots). Cache-sized, so staged chunks stay
  /// in L2/L3 between the copy-in, the reduction and the copy-out.
  std::size_t slot_bytes = std::size_t{1} << 20;
  /// Polls of a peer's counter before sleeping on it. When there are more ranks than cores a
  /// spinning waiter steals the core its peer needs, so the engine spins less then.
  int spin = 2000;
  /// Overrides the host identity compared across ranks (empty: `DDP_HOST_ID` when set, else the
  /// host name, boot id, network namespace and /dev/shm's device). Lets tests pretend ranks
  /// live on different hosts.
  std::string host_id{};
  /// The group's ranks that share this segment, ascending (empty: every rank of the group).
  /// Every rank of the group constructs its `shm` at the same time, each naming its own host's
  /// ranks (`ddp::topology`): one segment per host, as `ddp::hierarchical` builds them.
  /// `rank()` and `size()` are then this host's; errors name the group's ranks.
  std::vector<int> members{};
  friend bool operator==(const shm_options&, const shm_options&) = default;
};

}  // namespace DDP_ABI
}  // namespace ddp
