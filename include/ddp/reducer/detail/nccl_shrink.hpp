#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// When an elastic group re-forms, whether its NCCL communicator can be shrunk from the last
// generation's (ncclCommShrink) instead of built anew, and which of the old ranks it leaves out.
// Plain C++, no NCCL: every rank decides from the same gathered offers, so all take the same path.
//
// An offer is what one rank of the new group holds from the last generation, in new-rank order:
// "<group id> <old rank> <old size>" (the communicator it kept when that group failed), or ""
// when it holds none (a newcomer; a rank whose communicator was aborted; another device).
//
// The shrink is possible only when every rank offers a communicator of the same old group, and
// the old ranks rise with the new ones: NCCL gives the remaining ranks of a shrunk communicator
// their old order, closing the gaps, which must be the group's own new ranks. It is not used
// when nobody was left out (nothing to shrink: the communicator is built anew).

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// What a rank holds from the last generation; encoded as an offer.
struct nccl_parent_offer {
  std::uint64_t group = 0;
  int rank = -1;
  int size = 0;

  std::string encode() const { return std::to_string(group) + " " + std::to_string(rank) + " " + std::to_string(size); }
  /// nullopt for "" and for anything that is not three numbers with 0 <= rank < size.
  static std::optional<nccl_parent_offer> decode(const std::string& s) {
    nccl_parent_offer o;
    unsigned long long g = 0;
    int used = 0;
    if (s.empty() || std::sscanf(s.c_str(), "%llu %d %d%n", &g, &o.rank, &o.size, &used) != 3 ||
        used != static_cast<int>(s.size()) || o.rank < 0 || o.rank >= o.size)
      return std::nullopt;
    o.group = g;
    return o;
  }
};

/// The old ranks to leave out of the last generation's communicator, or nullopt when the new
/// group cannot be had by shrinking it (see the header comment). `offers[r]` is new rank r's.
inline std::optional<std::vector<int>> nccl_shrink_plan(const std::vector<std::string>& offers) {
  if (offers.empty()) return std::nullopt;
  std::vector<nccl_parent_offer> o;
  for (const auto& s : offers) {
    auto d = nccl_parent_offer::decode(s);
    if (!d) return std::nullopt;
    o.push_back(*d);
  }
  for (std::size_t r = 0; r < o.size(); ++r) {
    if (o[r].group != o[0].group || o[r].size != o[0].size) return std::nullopt;
    if (r > 0 && o[r].rank <= o[r - 1].rank) return std::nullopt;
  }
  std::vector<int> excluded;
  std::size_t next = 0;
  for (int old = 0; old < o[0].size; ++old) {
    if (next < o.size() && o[next].rank == old)
      ++next;
    else
      excluded.push_back(old);
  }
  if (excluded.empty()) return std::nullopt;
  return excluded;
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
