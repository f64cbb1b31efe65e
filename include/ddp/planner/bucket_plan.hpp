#pragma once
/// \file bucket_plan.hpp
/// The vocabulary every bucket planner speaks: the run-time `bucket_policy`, the per-parameter
/// `param_info` a planner reads, and the `bucket_plan` it returns.

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/dtype.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Run-time bucketing knobs; a value, never a template argument.
///
/// Caps count per bucket kind, i.e. per (dtype, device): the first bucket of each kind is capped
/// at `first_cap_bytes` so that communication starts early in backward, later ones at
/// `cap_bytes`. When `caps` is non-empty it replaces both: bucket k of a kind is capped at
/// `caps[k]`, the last entry repeating. A cap of 0 puts every parameter in its own bucket.
/// `rebuild_from_ready_order` lets the wrapper re-plan once from the gradient-ready order it
/// observed in the first iteration (agreed across ranks).
/// \code
/// using namespace ddp::literals;
/// ddp::bucket_policy p{.cap_bytes = 25_MiB, .first_cap_bytes = 1_MiB};
/// \endcode
struct bucket_policy {
  std::size_t cap_bytes = std::size_t{25} << 20;
  std::size_t first_cap_bytes = std::size_t{1} << 20;
  std::vector<std::size_t> caps = {};
  bool rebuild_from_ready_order = true;
  /// Let the wrapper pick `cap_bytes` by measuring: during the first synchronized steps it
  /// re-plans with each candidate cap in turn, times every step on every rank, and adopts the
  /// cap whose median slowest-rank step time is lowest, as rank 0 decides (every rank the same).
  /// Copy mode only; `caps` must be empty. Bucket memory moves during tuning (`layout_version()`).
  /// See docs/tuning.md, "Autotune".
  bool autotune = false;
  /// Candidate caps for `autotune`, in bytes; empty: 1, 2, 4, 8, 16, 25, 50 and 100 MiB. A
  /// candidate whose plan equals a smaller candidate's (caps above the model size) is skipped.
  std::vector<std::size_t> autotune_caps = {};
  /// Steps measured per candidate in each pass (after one unmeasured step on fresh buckets);
  /// at most a million, as `autotune_rounds`.
  std::size_t autotune_steps = 2;
  /// Passes over the candidates; a candidate's figure is the median of its steps over all
  /// passes, so that a burst of load on the machine does not land on one candidate only.
  std::size_t autotune_rounds = 2;

  /// Cap of the k-th bucket (counted within one dtype/device kind).
  std::size_t cap_for(std::size_t k) const noexcept {
    if (!caps.empty()) return caps[k < caps.size() ? k : caps.size() - 1];
    return k == 0 ? first_cap_bytes : cap_bytes;
  }

  friend bool operator==(const bucket_policy&, const bucket_policy&) = default;
};

/// Byte-size literals for policies: `25_MiB`, `512_KiB`.
inline namespace literals {
constexpr std::size_t operator""_KiB(unsigned long long v) noexcept { return static_cast<std::size_t>(v) << 10; }
constexpr std::size_t operator""_MiB(unsigned long long v) noexcept { return static_cast<std::size_t>(v) << 20; }
}  // namespace literals

/// What a planner knows about one parameter.
struct param_info {
  std::size_t numel = 0;
  dtype type = dtype::f32;
  int device = -1;  ///< -1 for host, else the CUDA device index

  std::size_t bytes() const noexcept { return numel * dtype_size(type); }
  friend bool operator==(const param_info&, const param_info&) = default;
};

/// Where one parameter's gradient sits inside its bucket.
struct bucket_entry {
  std::size_t param = 0;         ///< parameter index (registration order)
  std::size_t offset_elems = 0;  ///< first element inside the bucket's flat buffer
  std::size_t numel = 0;
  friend bool operator==(const bucket_entry&, const bucket_entry&) = default;
};

/// One flat buffer reduced by one collective. Entries are in the order the plan walked them
/// (gradient-ready order), packed back to back with no padding.
struct bucket {
  dtype type = dtype::f32;
  int device = -1;  ///< -1 for host, else this rank's CUDA device index (may differ across ranks)
  std::size_t numel = 0;
  std::size_t bytes = 0;
  std::vector<bucket_entry> entries;
  friend bool operator==(const bucket&, const bucket&) = default;
};

/// The assignment of parameters to buckets. Buckets are listed in launch order: every rank
/// issues their collectives in exactly this order.
struct bucket_plan {
  std::vector<bucket> buckets;
  /// `where[param] = {bucket index, entry index}`.
  std::vector<std::pair<std::size_t, std::size_t>> where;

  /// 64-bit hash of the plan's structure (dtypes, host or device, sizes, entries), cheap to
  /// exchange so that ranks can confirm they planned alike before launching any collective.
  /// It hashes whether a bucket is on a device, not which device: with one GPU per rank each
  /// rank's gradients live on its own device index, and the collectives still match.
  std::uint64_t fingerprint() const noexcept {
    // FNV-1a over 64-bit words: stable across compilers and platforms, unlike std::hash.
    std::uint64_t h = 0xcbf29ce484222325ull;
    const auto mix = [&h](std::uint64_t w) {
      for (int b = 0; b < 8; ++b) {
        h ^= (w >> (8 * b)) & 0xffu;
        h *= 0x100000001b3ull;
      }
    };
    mix(buckets.size());
    for (const auto& bk : buckets) {
      mix(static_cast<std::uint64_t>(bk.type));
      mix(bk.device >= 0 ? 1u : 0u);
      mix(bk.numel);
      mix(bk.entries.size());
      for (const auto& e : bk.entries) {
        mix(e.param);
        mix(e.offset_elems);
        mix(e.numel);
      }
    }
    return h;
  }

  friend bool operator==(const bucket_plan&, const bucket_plan&) = default;
};

}  // namespace DDP_ABI
}  // namespace ddp
