#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The descriptor every collective carries on the wire (kind, sequence number, count, dtype,
// op, root, algorithm and its variant). Peers compare descriptors before they touch each
// other's data, so ranks that call different collectives, sizes, dtypes or ops, or run
// different algorithms (ring against tree, recursive doubling against halving-doubling), get
// errc::mismatch instead of a hang or wrong numbers, even when the byte counts agree (f32
// against i32, sum against max).
//
// One descriptor type and one check (mismatch) for every engine that compares descriptors: the
// ring and tree algorithms send it ahead of each message, the shared-memory engine publishes it
// in its segment.
//
// Also the argument checks every reducer runs at the call, before anything is queued or sent:
// a valid dtype and op (an unknown dtype has size 0, which nothing may divide by) and buffers
// that do not overlap where the collective cannot allow it.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include <ddp/dtype.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

enum class coll_kind : std::uint8_t { allreduce = 1, broadcast, reduce_scatter, allgather, barrier };

inline const char* coll_name(coll_kind k) noexcept {
  switch (k) {
    case coll_kind::allreduce:
      return "allreduce";
    case coll_kind::broadcast:
      return "broadcast";
    case coll_kind::reduce_scatter:
      return "reduce_scatter";
    case coll_kind::allgather:
      return "allgather";
    case coll_kind::barrier:
      return "barrier";
  }
  return "?";
}

/// The algorithm that moves a collective's bytes; ranks must agree on it.
enum class coll_algo : std::uint8_t { none = 0, ring = 1, tree = 2 };
/// How the algorithm runs this particular call (tree allreduce: by message size against
/// reducer_options::small_bytes); ranks must agree on it too.
enum class coll_variant : std::uint8_t { none = 0, recursive_doubling = 1, halving_doubling = 2 };

inline const char* algo_name(coll_algo a) noexcept {
  switch (a) {
    case coll_algo::none:
      return "";
    case coll_algo::ring:
      return "ring";
    case coll_algo::tree:
      return "tree";
  }
  return "?";
}
inline const char* variant_name(coll_variant v) noexcept {
  switch (v) {
    case coll_variant::none:
      return "";
    case coll_variant::recursive_doubling:
      return "recursive doubling";
    case coll_variant::halving_doubling:
      return "halving-doubling";
  }
  return "?";
}

inline constexpr std::uint32_t coll_magic = 0x43504444u;  // "DDPC"

struct coll_desc {
  std::uint32_t magic = coll_magic;
  coll_kind kind = coll_kind::allreduce;
  dtype type = dtype::f32;
  op oper = op::sum;
  coll_algo algo = coll_algo::none;
  std::int32_t root = 0;
  coll_variant variant = coll_variant::none;
  /// 1 for a broadcast of raw bytes (`ddp::shm::broadcast(data, bytes, ...)`): `count` is bytes
  /// and `type` unused. Typed collectives (every reducer's) carry count and dtype, so ranks that
  /// broadcast the same bytes as different types (f32 on one, i32 on another) are a mismatch.
  std::uint8_t bytes = 0;
  std::uint8_t pad[2] = {};
  std::uint64_t seq = 0;
  std::uint64_t count = 0;

  friend bool operator==(const coll_desc&, const coll_desc&) = default;
};
static_assert(sizeof(coll_desc) == 32);

/// "allreduce #12 of 1024 x f32 sum by tree (recursive doubling)", "broadcast #3 of 1024 x f32
/// from root 0", "broadcast #4 of 4096 bytes from root 1" (raw bytes).
inline std::string describe(const coll_desc& d) {
  if (d.magic != coll_magic) return "a corrupt collective header";
  std::string s = std::string(coll_name(d.kind)) + " #" + std::to_string(d.seq);
  if (d.kind != coll_kind::barrier)  // a barrier has no data: its count and type say nothing
    s += " of " + std::to_string(d.count) +
         (d.bytes != 0 ? std::string(" bytes") : std::string(" x ") + dtype_name(d.type));
  if (d.kind == coll_kind::allreduce || d.kind == coll_kind::reduce_scatter) s += std::string(" ") + op_name(d.oper);
  if (d.kind == coll_kind::broadcast) s += " from root " + std::to_string(d.root);
  if (d.algo != coll_algo::none) s += std::string(" by ") + algo_name(d.algo);
  if (d.variant != coll_variant::none) s += std::string(" (") + variant_name(d.variant) + ")";
  return s;
}

/// Empty when `theirs` matches `mine`, else the message for errc::mismatch.
inline std::string mismatch(const coll_desc& mine, int my_rank, const coll_desc& theirs, int their_rank) {
  if (mine == theirs) return {};
  std::string s = "collective mismatch: rank " + std::to_string(my_rank) + " called " + describe(mine) + ", rank " +
                  std::to_string(their_rank) + " called " + describe(theirs);
  if (mine.magic == coll_magic && theirs.magic == coll_magic && mine.kind == theirs.kind &&
      mine.count == theirs.count && mine.type == theirs.type && mine.bytes == theirs.bytes) {
    if (mine.algo != theirs.algo)
      s += " (every rank must use the same reducer: ring on all, or tree on all)";
    else if (mine.variant != theirs.variant)
      s += " (the ranks' reducer_options::small_bytes differ)";
  }
  return s;
}

// ---- argument checks, shared by every reducer ---------------------------------------------

constexpr bool valid_dtype(dtype t) noexcept { return dtype_size(t) != 0; }
constexpr bool valid_op(op o) noexcept { return static_cast<unsigned>(o) <= static_cast<unsigned>(op::prod); }

/// Raises errc::invalid_argument unless `t` is one of ddp's dtypes.
inline void check_dtype(dtype t, int rank, const char* what) {
  if (!valid_dtype(t))
    raise(errc::invalid_argument, rank,
          std::string(what) + ": unknown dtype " + std::to_string(static_cast<int>(t)) + " (ddp::dtype is f32 .. i64)");
}
/// Raises errc::invalid_argument unless `o` is one of ddp's reduction ops.
inline void check_op(op o, int rank, const char* what) {
  if (!valid_op(o))
    raise(errc::invalid_argument, rank,
          std::string(what) + ": unknown reduction op " + std::to_string(static_cast<int>(o)) +
              " (ddp::op is sum .. prod)");
}

/// "[0x7f00, 0x7f40) (64 bytes)"
inline std::string byte_range(const void* p, std::size_t n) {
  char b[96];
  std::snprintf(b, sizeof b, "[%p, %p) (%zu bytes)", p, static_cast<const void*>(static_cast<const char*>(p) + n), n);
  return b;
}

/// reduce_scatter and allgather read one buffer while they write the other, in pieces, so
/// overlapping buffers would read bytes already overwritten. The one overlap every reducer
/// handles is the in-place form (as NCCL's): the small buffer is exactly this rank's slice of
/// the large one (`large + rank * small_bytes`). Any other overlap raises
/// errc::invalid_argument naming the collective and both byte ranges.
inline void check_overlap(const char* what, int rank, const void* large, std::size_t large_bytes, const void* small,
                          std::size_t small_bytes) {
  if (large_bytes == 0 || small_bytes == 0) return;
  const auto l = reinterpret_cast<std::uintptr_t>(large), s = reinterpret_cast<std::uintptr_t>(small);
  if (s >= l + large_bytes || l >= s + small_bytes) return;
  if (s == l + static_cast<std::uintptr_t>(rank) * small_bytes) return;  // in place
  const bool rs = std::string(what) == "reduce_scatter";                 // large is the input
  const std::string in = byte_range(rs ? large : small, rs ? large_bytes : small_bytes);
  const std::string out = byte_range(rs ? small : large, rs ? small_bytes : large_bytes);
  const std::string slice =
      byte_range(static_cast<const char*>(large) + static_cast<std::size_t>(rank) * small_bytes, small_bytes);
  raise(errc::invalid_argument, rank,
        std::string(what) + ": input " + in + " and output " + out + " overlap; pass disjoint buffers, or (in place) " +
            (rs ? "an output that is exactly this rank's slice of the input "
                : "an input that is exactly this rank's slice of the output ") +
            slice);
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
