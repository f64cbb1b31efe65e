#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The one place of group consensus:
// - agreeing on a value (a setting, a reducer's signature, a backend): every rank's value
//   gathered, compared with rank 0's, and when some differ every rank raises the same
//   errc::mismatch (agree, differing_ranks);
// - one rank's failure, every rank's error: settling a step each rank took alone (setting up a
//   segment, a device, buckets, a checkpoint file), so that every rank raises the same first
//   cause instead of some ranks going on (first_failed, settle);
// - a blob from one rank to all: its length, bounded, then its bytes (broadcast_blob).
// Generic over the group: any `all_gather` of strings, or a group with all_reduce and broadcast
// (settle).

#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/clock.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// What a rank's part of a step came to, as the failure that crosses ranks (error.hpp): empty
/// when it succeeded. The failure of `e` (null: success): a ddp::error keeps its condition, parameter and message
/// (without its "[ddp.x] rank N:" prefix), any other exception is errc::system with its what();
/// a failure's text is never empty (an empty one would read as success). `origin`: this rank.
inline group_failure failure_of(const std::exception_ptr& e, int origin = -1) {
  if (!e) return {};
  group_failure o;
  try {
    std::rethrow_exception(e);
  } catch (const error& x) {
    o = {x.condition(), std::string(x.message()), x.parameter()};
  } catch (const std::exception& x) {
    o = {errc::system, x.what()};
  } catch (...) {
    o = {errc::system, "an exception of unknown type"};
  }
  if (o.text.empty()) o.text = "an error without a message";
  o.origin = origin;
  return o;
}

/// The ranks whose value differs from rank 0's in `all` (every rank's, gathered), in rank order;
/// `key` picks what must agree out of each (the whole value by default).
template <class Key = std::identity>
std::vector<std::size_t> differing_ranks(const std::vector<std::string>& all, Key&& key = {}) {
  std::vector<std::size_t> out;
  for (std::size_t r = 1; r < all.size(); ++r)
    if (key(all[r]) != key(all[0])) out.push_back(r);
  return out;
}

/// Every rank passes `mine` (a collective through `all_gather`: std::string ->
/// std::vector<std::string>, one per rank); when some rank's differs from rank 0's, every rank
/// raises errc::mismatch with `describe(all, differing)`: the same text on every rank, since
/// every rank sees every value.
template <class AllGather, class Describe>
void agree(AllGather&& all_gather, int rank, const std::string& mine, Describe&& describe) {
  const std::vector<std::string> all = all_gather(mine);
  const auto differing = differing_ranks(all);
  if (!differing.empty()) raise(errc::mismatch, rank, describe(all, differing));
}

/// The lowest rank whose outcome failed (`rank` -1: none) and that outcome.
struct failed_rank {
  int rank = -1;
  group_failure what;
};

/// Every rank's outcome, gathered through `all_gather` (a collective: std::string ->
/// std::vector<std::string>, one per rank), and the lowest failing rank among them.
template <class AllGather>
failed_rank first_failed(AllGather&& all_gather, const group_failure& mine) {
  const std::vector<std::string> all = all_gather(mine.encode());
  for (std::size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty()) {
      auto what = group_failure::decode(all[r]);
      what.origin = static_cast<int>(r);
      return {static_cast<int>(r), std::move(what)};
    }
  return {};
}

/// Every rank learns whether every rank's part succeeded; when one did not, every rank raises
/// the error of the lowest failing rank (its condition, parameter and message, under each
/// rank's own prefix). Collective over `pg` (a process_group): a scalar all_reduce, then one
/// broadcast from the failing rank; no string is gathered when every rank succeeded.
/// Sends `blob` from rank `root` to every rank: its length first, then its bytes; afterwards
/// every rank's `blob` holds root's. `bcast(std::span<std::byte>)` broadcasts from `root` (the
/// group's broadcast with its deadline). A length outside [`min_bytes`, `max_bytes`] is refused
/// on every rank, root included, with errc::protocol naming `what`, before anything is
/// allocated with it: a length from the wire never sizes memory unchecked.
template <class Broadcast>
void broadcast_blob(Broadcast&& bcast, std::string& blob, int rank, int root, std::size_t min_bytes,
                    std::size_t max_bytes, std::string_view what) {
  std::uint64_t len = rank == root ? blob.size() : 0;
  bcast(std::as_writable_bytes(std::span(&len, 1)));
  if (len < min_bytes || len > max_bytes)
    raise(errc::protocol, rank,
          std::string(what) + ": rank " + std::to_string(root) + " announced " + std::to_string(len) +
              " bytes, outside the " + std::to_string(min_bytes) + " to " + std::to_string(max_bytes) + " it may send");
  blob.resize(static_cast<std::size_t>(len));
  bcast(std::as_writable_bytes(std::span(blob.data(), blob.size())));
}

template <class Group>
void settle(Group& pg, const group_failure& mine, deadline_t until) {
  constexpr std::int32_t none = std::numeric_limits<std::int32_t>::max();
  std::int32_t first = mine.empty() ? none : pg.rank();
  pg.all_reduce(std::span<std::int32_t>(&first, 1), op::min, until);
  if (first == none) return;
  std::string frame = pg.rank() == first ? mine.encode() : std::string();
  broadcast_blob([&](std::span<std::byte> b) { pg.broadcast(b, first, until); }, frame, pg.rank(), first, 8,
                 std::size_t{1} << 20, "an error of a step each rank took alone");
  auto f = group_failure::decode(frame);
  if (f.empty()) f = {errc::protocol, "rank " + std::to_string(first) + " failed, yet sent no failure"};
  f.raise_on(pg.rank());
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
