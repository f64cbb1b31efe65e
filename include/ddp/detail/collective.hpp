#pragma once
// IWYU pragma: private
// The descriptor every collective carries on the wire (kind, sequence number, count, dtype,
// op, root). Peers compare descriptors before they touch each other's data, so ranks that call
// different collectives, sizes, dtypes or ops get errc::mismatch instead of a hang or wrong
// numbers, even when the byte counts agree (f32 against i32, sum against max).

#include <cstdint>
#include <string>

#include "../dtype.hpp"

namespace ddp {
inline namespace v0 {
namespace detail {

enum class coll_kind : std::uint8_t { allreduce = 1, broadcast, reduce_scatter, allgather, barrier };

inline const char* coll_name(coll_kind k) noexcept {
  switch (k) {
    case coll_kind::allreduce: return "allreduce";
    case coll_kind::broadcast: return "broadcast";
    case coll_kind::reduce_scatter: return "reduce_scatter";
    case coll_kind::allgather: return "allgather";
    case coll_kind::barrier: return "barrier";
  }
  return "?";
}

inline constexpr std::uint32_t coll_magic = 0x43504444u;  // "DDPC"

struct coll_desc {
  std::uint32_t magic = coll_magic;
  coll_kind kind = coll_kind::allreduce;
  dtype type = dtype::f32;
  op oper = op::sum;
  std::uint8_t pad = 0;
  std::int32_t root = 0;
  std::uint32_t pad2 = 0;
  std::uint64_t seq = 0;
  std::uint64_t count = 0;

  friend bool operator==(const coll_desc&, const coll_desc&) = default;
};
static_assert(sizeof(coll_desc) == 32);

/// "allreduce #12 of 1024 x f32 sum" (root shown for rooted collectives).
inline std::string describe(const coll_desc& d) {
  if (d.magic != coll_magic) return "a corrupt collective header";
  std::string s = std::string(coll_name(d.kind)) + " #" + std::to_string(d.seq) + " of " + std::to_string(d.count) +
                  " x " + dtype_name(d.type);
  if (d.kind == coll_kind::allreduce || d.kind == coll_kind::reduce_scatter) s += std::string(" ") + op_name(d.oper);
  if (d.kind == coll_kind::broadcast) s += " from root " + std::to_string(d.root);
  return s;
}

/// Empty when `theirs` matches `mine`, else the message for errc::mismatch.
inline std::string mismatch(const coll_desc& mine, int my_rank, const coll_desc& theirs, int their_rank) {
  if (mine == theirs) return {};
  return "collective mismatch: rank " + std::to_string(my_rank) + " called " + describe(mine) + ", rank " +
         std::to_string(their_rank) + " called " + describe(theirs);
}

}  // namespace detail
}  // namespace v0
}  // namespace ddp
