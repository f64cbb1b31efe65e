#pragma once
/// \file data_parallel/shard_layout.hpp
/// `ddp::shard_layout`: which elements of each bucket a rank owns in the sharded mode
/// (`dp_options::shard`). Each bucket's flat buffer is padded with zeros to a multiple of the
/// world size and cut into equal contiguous shards, rank r owning shard r; the pieces say which
/// parameter elements a shard holds. Computed from the plan alone, so ranks that agree on the
/// plan agree on it; `describe()` is what they compare. See docs/sharded.md.
///
/// \code
/// auto layout = ddp::shard_layout::of(dp.plan(), pg.rank(), pg.size());
/// for (const auto& b : layout.buckets) std::printf("%zu elements of %zu\n", b.per_rank, b.numel);
/// \endcode

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/dtype.hpp>
#include <ddp/optim/shard_optimizer.hpp>
#include <ddp/planner/bucket_plan.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// This rank's slice of one parameter in the sharded mode (`data_parallel::shard_slices()`):
/// elements `[offset, offset + count)` of parameter `param` lie in this rank's shard; `values`
/// points at them in the engine's own tensor, `grads` at their average over the ranks after a
/// synchronized `finish()` (both of the parameter's dtype). An engine's own optimizer steps a
/// shard through views of these (the LibTorch adapter's `shard_of`). `count` is 0 for a
/// parameter whose elements all lie in other ranks' shards.
struct shard_slice {
  std::size_t param = 0;
  std::size_t offset = 0;
  std::size_t count = 0;
  void* values = nullptr;
  const void* grads = nullptr;
  dtype type = dtype::f32;
};

struct shard_layout {
  /// One bucket's shards.
  struct bucket {
    dtype type = dtype::f32;
    std::size_t numel = 0;            ///< the bucket's elements
    std::size_t padded = 0;           ///< numel rounded up to a multiple of the world size
    std::size_t per_rank = 0;         ///< padded / world: the elements of each shard
    std::size_t first = 0;            ///< this rank's first element in the bucket (rank * per_rank)
    std::size_t offset = 0;           ///< this shard's first element in the rank's flat shard of all buckets
    std::vector<shard_piece> pieces;  ///< the parameter elements of this rank's shard
  };
  int rank = 0;
  int world = 1;
  std::vector<bucket> buckets;
  std::size_t elements = 0;  ///< the elements of this rank's shards, all buckets together

  /// The layout of `plan` for `rank` of `world` ranks.
  static shard_layout of(const bucket_plan& plan, int rank, int world) {
    shard_layout l;
    l.rank = rank;
    l.world = world;
    const auto w = static_cast<std::size_t>(world);
    for (const auto& bk : plan.buckets) {
      bucket b;
      b.type = bk.type;
      b.numel = bk.numel;
      b.per_rank = (bk.numel + w - 1) / w;
      b.padded = b.per_rank * w;
      b.first = static_cast<std::size_t>(rank) * b.per_rank;
      b.offset = l.elements;
      const std::size_t lo = b.first, hi = b.first + b.per_rank;
      for (const auto& e : bk.entries) {
        const std::size_t from = std::max(lo, e.offset_elems), to = std::min(hi, e.offset_elems + e.numel);
        if (from < to) b.pieces.push_back({e.param, from - e.offset_elems, from - lo, to - from});
      }
      l.elements += b.per_rank;
      l.buckets.push_back(std::move(b));
    }
    return l;
  }

  /// The same on every rank of a group that agrees: the world size and each bucket's dtype,
  /// elements and shard size ("world 2: f32 1000/500, f16 7/4").
  std::string describe() const {
    std::string s = "world " + std::to_string(world) + ":";
    for (std::size_t b = 0; b < buckets.size(); ++b)
      s += (b == 0 ? " " : ", ") + std::string(dtype_name(buckets[b].type)) + " " + std::to_string(buckets[b].numel) +
           "/" + std::to_string(buckets[b].per_rank);
    return s;
  }
};

}  // namespace DDP_ABI
}  // namespace ddp
