#pragma once
/// \file group/process_group.hpp
/// `ddp::process_group`, the group itself: rendezvous through rank 0's TCP store
/// (`init_process_group`), TCP connections between ranks made on first use, barrier,
/// broadcast, all_gather and a small all_reduce; the group closes with its last handle. Its
/// options are in group/init_options.hpp, what a transport gets from it in
/// group/transport_context.hpp; <ddp/process_group.hpp> gives all three. See docs/process-group.md.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/detail/compiled.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/group/init_options.hpp>
#include <ddp/group/kv_store.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {
struct group_state;     // group/detail/group_state.hpp
class generation_link;  // group/detail/generation.hpp
}  // namespace detail

/// A joined group of processes, held through cheap handles: copies of a `process_group` share
/// one group, and every reducer, transport and wrapper built from it keeps a handle of its own.
/// The group closes (every connection; rank 0 keeps its store up until the other ranks have let
/// go of it, bounded by the timeout) when its last handle goes away, so the handle a program
/// got from `init_process_group` may be destroyed, moved or reassigned while those objects live.
/// A moved-from or closed handle is empty: its calls raise `errc::usage`. In a child made by
/// fork() every call that would communicate raises `errc::usage` too, and destroying the handle
/// touches nothing of the parent's (docs/process-group.md).
///
/// \code
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// ddp::ring<ddp::tcp> ring{pg};   // keeps the group alive for as long as it lives
/// \endcode
class process_group {
 public:
  process_group(const process_group&) = default;  ///< another handle on the same group
  process_group& operator=(const process_group&) = default;
  process_group(process_group&&) noexcept = default;  ///< leaves `other` empty
  process_group& operator=(process_group&&) noexcept = default;
  ~process_group() = default;  ///< the last handle closes the group

  /// This process's rank; -1 on an empty handle.
  int rank() const noexcept;
  /// The group size; 0 on an empty handle.
  int size() const noexcept;
  const init_options& options() const noexcept;
  std::chrono::milliseconds timeout() const noexcept;
  deadline_t deadline() const { return steady_clock::now() + timeout(); }

  /// The group's key-value store (the built-in store, hosted by rank 0 or the launcher, or
  /// the backend init_options::store_url names).
  kv_store& store();

  /// A group-unique id agreed at rendezvous (distinguishes this group's connections).
  std::uint64_t id() const noexcept;

  /// Blocks until every rank has called barrier(), or throws (timeout, peer_lost).
  void barrier() { barrier(deadline()); }
  void barrier(deadline_t until);

  /// Copies `root`'s bytes into every rank's `data`; sizes must agree (errc::mismatch).
  void broadcast(std::span<std::byte> data, int root = 0) { broadcast(data, root, deadline()); }
  void broadcast(std::span<std::byte> data, int root, deadline_t until);

  /// Typed convenience: broadcast a contiguous range of trivially copyable values.
  template <class T>
  void broadcast(std::span<T> data, int root = 0) {
    broadcast(std::as_writable_bytes(data), root, deadline());
  }

  /// Largest blob one rank may contribute to all_gather().
  static constexpr std::uint64_t max_gather_blob = 1ull << 30;

  /// Every rank contributes a blob; every rank gets all of them, indexed by rank.
  std::vector<std::string> all_gather(const std::string& mine);

  /// Largest contribution of one rank to all_reduce(), in bytes (8192 doubles): every rank
  /// receives every rank's values, so this is for a few scalars. Gradients and other large
  /// buffers go through a reducer (`ddp::ring`, `ddp::data_parallel`).
  static constexpr std::size_t max_all_reduce_bytes = std::size_t{64} << 10;

  /// Reduces a few values over every rank without building a reducer: a loss, an accuracy, a
  /// sample count. Every rank gets the same bits: each rank receives every rank's values and
  /// combines them in rank order with the reducers' kernels (`op::avg` divides by the group
  /// size; integer averages truncate). Collective; bounded by `until` (the group's timeout by
  /// default). Throws `errc::mismatch` on every rank when ranks disagree on the count, the
  /// element type or the op (the message names the ranks), `errc::invalid_argument` above
  /// `max_all_reduce_bytes` or for an unknown op, and timeout / peer_lost / aborted when a
  /// peer is gone. See docs/training-loop.md.
  ///
  /// \code
  /// double stats[2] = {loss_sum, correct};
  /// pg.all_reduce(std::span{stats}, ddp::op::sum);
  /// \endcode
  template <element T, std::size_t Extent>
  requires(!std::is_const_v<T>) void all_reduce(std::span<T, Extent> values, op o) {
    all_reduce(values, o, deadline());
  }
  template <element T, std::size_t Extent>
  requires(!std::is_const_v<T>) void all_reduce(std::span<T, Extent> values, op o, deadline_t until);

  /// One value: returns the reduction of every rank's `value`.
  ///
  /// \code
  /// const double mean_loss = pg.all_reduce(loss, ddp::op::avg);
  /// \endcode
  template <element T>
  T all_reduce(T value, op o) {
    all_reduce(std::span<T>(&value, 1), o, deadline());
    return value;
  }

  /// Connections this rank holds to its peers now: they are made on first use, so a group of
  /// thousands of ranks holds a handful per rank. 0 on an empty handle.
  int connections() const noexcept;

  /// Fails this rank's group on purpose: every call blocked on it, here or on a peer, ends with
  /// an error at once instead of at its deadline (errc::aborted naming this rank). Reducers
  /// have their own abort(); call both when a training step must stop everywhere. Does nothing
  /// on an empty handle or in a forked child.
  void abort(const std::string& why = "abort() called") noexcept;

  /// A failure as the group records it (error.hpp): its condition and a sentence that
  /// names the rank it happened on, so that any rank can raise it under its own prefix.
  using failure = group_failure;

  /// The same as abort(why), for a rank that gives up because of an exception: the peers'
  /// errors quote it.
  ///
  /// \code
  /// try { train(dp); } catch (const std::exception& e) { pg.abort(e); throw; }
  /// \endcode
  void abort(const std::exception& e) noexcept;

  /// True once abort() was called on this rank's group.
  bool aborted() const noexcept;

  /// Says that a wrapper keeps state sharded over this group's ranks (`dp_options::shard`),
  /// each shard held by `replicas` ranks. With one (each rank alone holds its shard's optimizer
  /// state) an elastic group of such generations ends with an error rather than re-form without
  /// a shard, or with every shard's state reset; with two or more it re-forms, and the next
  /// generation's sharded wrapper re-shards the state from the ranks that hold it, or raises
  /// `errc::state_lost` where none does (docs/sharded.md, "Surviving failures"). The sharded
  /// wrapper calls it; so may an engine's own.
  void note_sharded_state(int replicas = 1) noexcept;
  /// Said by a sharded wrapper whose step failed after this rank's shards were all stepped (in
  /// the all-gather of the parameters): its shards hold the step whole, though the engine's
  /// parameters may not (the next generation's wrapper rebuilds them from the shards), so an
  /// elastic group keeps this rank a source of the state. `false` at the start of each step.
  void note_shards_whole(bool whole) noexcept;
  /// Whether the last note_shards_whole() said true.
  bool shards_whole() const noexcept;
  /// Leaves `e`'s message where a peer's timeout while waiting for this rank quotes it ("...
  /// (its last error: ...)"): for an error that does not fail the group, a misuse this rank may
  /// still repair (the wrapper's finish() with a parameter that never became ready). Empty
  /// `text`: withdraws it. Best effort.
  void note_error(const std::string& text) noexcept;
  /// True once note_sharded_state() was called on this group with one replica: each rank alone
  /// holds its shard.
  bool has_sharded_state() const noexcept;
  /// True when the group was formed by an `elastic_group` from ranks that all hold the
  /// group's state as of one committed step, and nothing else (no newcomer, no rank left behind):
  /// by the elastic protocol their parameters are then bitwise equal. A wrapper's construction
  /// then compares a hash of each rank's values instead of broadcasting rank 0's, and
  /// broadcasts only where they differ (docs/elastic.md, "Re-forming without a broadcast").
  /// False for every other group.
  bool expects_equal_state() const noexcept;
  /// True when the group is a generation of an `elastic_group` (it may fail and re-form, and
  /// what its wrappers hold may move into the next generation's).
  bool elastic() const noexcept;

  /// Lets go of this handle (it becomes empty). The group closes when no handle is left: the
  /// last one closes the connections, and on rank 0 waits (bounded) for the others to leave
  /// its store first.
  void close() noexcept { s_.reset(); }

 private:
  friend process_group init_process_group(const init_options&);
  friend class transport_context;        // hands transports the group's channels, links and verdict
  friend class detail::generation_link;  // what an elastic group may ask of its generations' groups
  explicit process_group(std::shared_ptr<detail::group_state> s) noexcept : s_(std::move(s)) {}
  /// The group, for a call named `what`: errc::usage on an empty handle or in a forked child.
  detail::group_state& live(const char* what) const;

  /// all_gather() bounded by the caller's deadline (all_reduce's).
  std::vector<std::string> all_gather_until(const std::string& mine, deadline_t until);
  /// all_reduce() of `n` values of type `t` at `values`.
  void all_reduce_erased(void* values, std::size_t n, dtype t, op o, deadline_t until);

  void send(int peer, const void* p, std::size_t n, deadline_t until, const char* what);
  void recv(int peer, void* p, std::size_t n, deadline_t until, const char* what);
  /// The connection to `peer` for a call named `what`, made now if there is none yet.
  int link(int peer, deadline_t until, const char* what);
  /// A link failed (`ec`; `why`, when given, says how better than `ec`): report the group's
  /// first failure, or the rank that stopped, or the lost peer (the verdict, which records this
  /// rank's own), and shut the mesh so that peers blocked on this rank wake and report it too.
  [[noreturn]] void lost(int peer, const std::error_code& ec, const char* what, const std::string& why = {});

  std::shared_ptr<detail::group_state> s_;  // shared by the group's handles; empty once moved from or closed
};

template <element T, std::size_t Extent>
requires(!std::is_const_v<T>) void process_group::all_reduce(std::span<T, Extent> values, op o, deadline_t until) {
  live("all_reduce()");
  all_reduce_erased(static_cast<void*>(values.data()), values.size(), dtype_of_v<T>, o, until);
}

/// Joins the group described by `opts` and returns once every rank has joined.
///
/// Throws `ddp::error`: invalid_argument (bad rank, size, port), unresolvable (master address),
/// address_in_use (rank 0's port taken, or another job's store answers on it: a different world
/// size or job id), rank_conflict (two processes of this job claim one rank), timeout
/// (a rank never arrived; the message names the missing ranks).
/// \code
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// pg.barrier();
/// \endcode
process_group init_process_group(const init_options& opts);

}  // namespace DDP_ABI
}  // namespace ddp

#if !defined(DDP_SEPARATE_COMPILATION)
#include <ddp/group/store_client.hpp>  // store()'s type, complete where the group's code is
#include <ddp/group/detail/process_group_impl.hpp>
#endif
