#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
/// \file reducer/detail/schedule.hpp
/// Pure collective schedules: who sends which piece to whom, at which step. No sockets here;
/// the reducers walk these plans over a transport, and the unit tests walk them in memory.
///
/// Determinism. Every schedule below leaves all ranks with identical bits, for every op and
/// dtype, because each element of the result is computed exactly once, by one rank, along a
/// fixed order, and then only copied:
/// - ring: chunk c is reduced along the chain c, c+1, ..., c-1 and finished by its owner
///   `ring_owner(n, c)`; the allgather phase copies the owner's bits to everyone.
/// - halving-doubling: after the reduce-scatter, virtual rank v alone holds block v; the
///   allgather copies it. Folded-out ranks receive a copy of their partner's result.
/// - recursive doubling: both ranks of a pair compute the same expression, because the plan
///   says which side is the left operand (`hd_level::lower`): both evaluate
///   `lower_data op upper_data`. Commutativity alone would not be enough: IEEE a+b == b+a
///   (the kernels make NaN results canonical so that holds bitwise), but min(-0.0, +0.0)
///   depends on the operand order.

#include <array>
#include <cstddef>
#include <span>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Half-open element range [begin, end).
struct range {
  std::size_t begin = 0;
  std::size_t end = 0;
  constexpr std::size_t size() const noexcept { return end - begin; }
  friend constexpr bool operator==(const range&, const range&) = default;
};

/// Part `i` of `count` elements split into `parts` contiguous parts as evenly as possible: the
/// first `count % parts` parts hold one element more. Requires 0 <= i < parts.
constexpr range partition(std::size_t count, int parts, int i) noexcept {
  const auto p = static_cast<std::size_t>(parts);
  const auto k = static_cast<std::size_t>(i);
  const std::size_t base = count / p;
  const std::size_t rem = count % p;
  const std::size_t begin = k * base + (k < rem ? k : rem);
  return {begin, begin + base + (k < rem ? 1 : 0)};
}

/// Like `partition`, but every boundary except the final `count` is a multiple of
/// `align_elems` (so each part starts on a cache line or vector boundary). Balanced in units of
/// `align_elems`; parts at the end may be empty when there are fewer units than parts.
constexpr range partition_aligned(std::size_t count, int parts, int i, std::size_t align_elems) noexcept {
  if (align_elems <= 1) return partition(count, parts, i);
  const std::size_t units = (count + align_elems - 1) / align_elems;
  const range u = partition(units, parts, i);
  const std::size_t b = u.begin * align_elems;
  const std::size_t e = u.end * align_elems;
  return {b < count ? b : count, e < count ? e : count};
}

/// Elements of blocks [first, last) when `count` elements are split into `parts` blocks by
/// `partition`. Blocks are contiguous, so a run of blocks is one range.
constexpr range block_span(std::size_t count, int parts, int first, int last) noexcept {
  if (first >= last) {
    const std::size_t at = partition(count, parts, first < parts ? first : parts - 1).begin;
    return {at, at};
  }
  return {partition(count, parts, first).begin, partition(count, parts, last - 1).end};
}

// ---- segmenting -------------------------------------------------------------------------------

/// Number of pipeline segments for a message of `bytes` cut into pieces of `segment_bytes`:
/// 0 for an empty message, 1 when `segment_bytes` is 0 (unsegmented).
constexpr std::size_t num_segments(std::size_t bytes, std::size_t segment_bytes) noexcept {
  if (bytes == 0) return 0;
  if (segment_bytes == 0) return 1;
  return (bytes + segment_bytes - 1) / segment_bytes;
}

/// Byte range of segment `i` of `num_segments(bytes, segment_bytes)`.
constexpr range segment(std::size_t bytes, std::size_t segment_bytes, std::size_t i) noexcept {
  if (segment_bytes == 0) return {0, bytes};
  const std::size_t b = i * segment_bytes;
  const std::size_t e = b + segment_bytes;
  return {b < bytes ? b : bytes, e < bytes ? e : bytes};
}

// ---- ring allreduce ---------------------------------------------------------------------------
//
// The buffer is cut into n chunks (`partition(count, n, c)`). Reduce-scatter, steps
// s = 0 .. n-2: rank r sends chunk (r - s) mod n to r+1 and receives chunk (r - s - 1) mod n
// from r-1, reducing it into its own copy. After it, rank r holds the full reduction of chunk
// (r + 1) mod n (the convention of Gloo and NCCL). Allgather, steps s = n-1 .. 2n-3: rank r
// sends the finished chunk it got last, (r + 1 - s') mod n with s' = s - (n-1), and receives
// chunk (r - s') mod n, which overwrites its copy.

/// One step of the ring schedule, seen from one rank.
struct ring_step {
  int send_to;     ///< rank this step sends to (r + 1)
  int recv_from;   ///< rank this step receives from (r - 1)
  int send_chunk;  ///< chunk index sent
  int recv_chunk;  ///< chunk index received
  bool reduce;     ///< true: `mine op= received` (reduce-scatter); false: `mine = received`
  friend constexpr bool operator==(const ring_step&, const ring_step&) = default;
};

/// Steps of a ring allreduce over `n` ranks: 2(n - 1).
constexpr int ring_steps(int n) noexcept { return n > 1 ? 2 * (n - 1) : 0; }

/// Rank that holds the finished chunk `chunk` after the reduce-scatter.
constexpr int ring_owner(int n, int chunk) noexcept { return (chunk + n - 1) % n; }

/// Step `step` (0 <= step < ring_steps(n)) of the ring allreduce, for rank `rank`.
constexpr ring_step ring_schedule(int rank, int n, int step) noexcept {
  auto mod = [n](int x) { return ((x % n) + n) % n; };
  ring_step st{mod(rank + 1), mod(rank - 1), 0, 0, step < n - 1};
  if (st.reduce) {
    st.send_chunk = mod(rank - step);
    st.recv_chunk = mod(rank - step - 1);
  } else {
    const int s = step - (n - 1);
    st.send_chunk = mod(rank + 1 - s);
    st.recv_chunk = mod(rank - s);
  }
  return st;
}

// ---- halving-doubling and recursive doubling --------------------------------------------------
//
// Both work on p2 = the largest power of two <= n. The other n - p2 ranks are folded in first:
// among ranks 0 .. 2(n - p2) - 1, each odd rank sends its whole buffer to the even rank below it
// (which reduces `even op= odd`), sits out, and at the end receives the finished buffer from it.
// The remaining p2 ranks take virtual ranks 0 .. p2-1 in rank order.

/// Largest power of two <= n (n >= 1).
constexpr int floor_pow2(int n) noexcept {
  int p = 1;
  while (p <= n / 2) p *= 2;
  return p;
}

/// Real rank of virtual rank `v` in a group of `n`.
constexpr int hd_real_rank(int n, int v) noexcept {
  const int extra = n - floor_pow2(n);
  return v < extra ? 2 * v : v + extra;
}

/// One exchange level, seen from one (non-folded) rank. Blocks are of `hd_plan::blocks`, mapped
/// to elements with `block_span(count, blocks, ...)`.
struct hd_level {
  int peer;        ///< real rank exchanged with
  bool lower;      ///< this rank's virtual rank is the lower of the pair: its data is the left operand
  int keep_begin;  ///< blocks [keep_begin, keep_end) are received from the peer and reduced into
  int keep_end;    ///<   (halving) or, in the allgather, sent to the peer
  int send_begin;  ///< blocks [send_begin, send_end) are sent to the peer (halving) or, in the
  int send_end;    ///<   allgather, received from it
};

/// A rank's part in halving-doubling or recursive doubling.
///
/// Walk: (1) fold: if `folded_out`, send everything to `fold_partner`, skip to (4); if
/// `fold_partner >= 0` (not folded out), receive its buffer and reduce `mine op= theirs`.
/// (2) levels in order: send blocks `send`, receive blocks `keep` and combine them as
/// `lower_side op upper_side`. (3) halving-doubling only: levels in reverse order, send `keep`,
/// receive `send` (copy). (4) fold: a rank with a partner sends the result to it; the folded-out
/// rank receives it.
struct hd_plan {
  int n = 1;      ///< group size
  int p2 = 1;     ///< ranks that take part in the levels
  int vrank = 0;  ///< virtual rank, -1 if folded out
  bool folded_out = false;
  int fold_partner = -1;  ///< the rank this one folds with, or -1
  int blocks = 1;         ///< blocks the buffer is split into (p2 for halving-doubling, else 1)
  int num_levels = 0;
  std::array<hd_level, 31> level{};

  constexpr std::span<const hd_level> levels() const& noexcept {
    return {level.data(), static_cast<std::size_t>(num_levels)};
  }
  // A span into a temporary plan would dangle (e.g. `for (auto& l : plan_...(r, n).levels())`).
  void levels() const&& = delete;
};

namespace sched {
constexpr hd_plan fold(int rank, int n) noexcept {
  hd_plan p;
  p.n = n;
  p.p2 = floor_pow2(n);
  const int extra = n - p.p2;
  if (rank < 2 * extra) {
    p.fold_partner = rank ^ 1;
    p.folded_out = (rank & 1) != 0;
    p.vrank = p.folded_out ? -1 : rank / 2;
  } else {
    p.vrank = rank - extra;
  }
  return p;
}
}  // namespace sched

/// Recursive halving (reduce-scatter) then recursive doubling (allgather), Rabenseifner's
/// algorithm: bandwidth 2(p2-1)/p2 of the buffer per rank, latency 2 log2(p2) steps, plus the
/// fold when n is not a power of two. Level k pairs virtual ranks differing in bit
/// log2(p2)-1-k; the lower one keeps the lower half of the current block range, so after the
/// reduce-scatter virtual rank v holds block v.
constexpr hd_plan plan_halving_doubling(int rank, int n) noexcept {
  hd_plan p = sched::fold(rank, n);
  p.blocks = p.p2;
  if (p.folded_out) return p;
  int lo = 0;
  int hi = p.p2;
  for (int mask = p.p2 / 2; mask >= 1; mask /= 2) {
    const int peer_v = p.vrank ^ mask;
    const int mid = (lo + hi) / 2;
    hd_level& l = p.level[static_cast<std::size_t>(p.num_levels++)];
    l.peer = hd_real_rank(n, peer_v);
    l.lower = p.vrank < peer_v;
    if (l.lower) {
      l.keep_begin = lo, l.keep_end = mid, l.send_begin = mid, l.send_end = hi;
      hi = mid;
    } else {
      l.keep_begin = mid, l.keep_end = hi, l.send_begin = lo, l.send_end = mid;
      lo = mid;
    }
  }
  return p;
}

/// Recursive doubling for small messages: log2(p2) levels, each a full-buffer exchange with the
/// virtual rank differing in bit k (k = 0, 1, ...); both sides compute `lower op upper`. No
/// allgather phase (`blocks` is 1; keep and send are both the whole buffer).
constexpr hd_plan plan_recursive_doubling(int rank, int n) noexcept {
  hd_plan p = sched::fold(rank, n);
  p.blocks = 1;
  if (p.folded_out) return p;
  for (int mask = 1; mask < p.p2; mask *= 2) {
    const int peer_v = p.vrank ^ mask;
    hd_level& l = p.level[static_cast<std::size_t>(p.num_levels++)];
    l.peer = hd_real_rank(n, peer_v);
    l.lower = p.vrank < peer_v;
    l.keep_begin = 0, l.keep_end = 1, l.send_begin = 0, l.send_end = 1;
  }
  return p;
}

// ---- binomial tree ----------------------------------------------------------------------------

/// A rank's place in a binomial broadcast tree rooted at `root`.
struct binomial_tree {
  int parent = -1;  ///< -1 at the root
  int num_children = 0;
  std::array<int, 31> child{};  ///< largest subtree first: send to them in this order

  constexpr std::span<const int> children() const& noexcept {
    return {child.data(), static_cast<std::size_t>(num_children)};
  }
  void children() const&& = delete;  // the span would outlive a temporary tree
};

/// Binomial tree over `n` ranks: with relative rank q = (rank - root) mod n, the parent is q
/// without its highest set bit and the children are q + 2^k for every 2^k > q with q + 2^k < n.
/// Depth is ceil(log2 n); a broadcast takes that many rounds.
constexpr binomial_tree tree_for(int rank, int n, int root) noexcept {
  binomial_tree t;
  const int q = ((rank - root) % n + n) % n;
  if (q != 0) {
    int high = 1;
    while (high <= q / 2) high *= 2;
    t.parent = (q - high + root) % n;
  }
  int top = 1;
  while (top < n) top *= 2;
  for (int mask = top / 2; mask >= 1 && mask > q; mask /= 2) {
    if (q + mask < n) t.child[static_cast<std::size_t>(t.num_children++)] = (q + mask + root) % n;
  }
  return t;
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
