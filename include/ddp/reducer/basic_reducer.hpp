#pragma once
/// \file basic_reducer.hpp
/// `ddp::basic_reducer<Algorithm, Transport>`: the front-end every reducer shares. Collectives
/// run on one progress thread per reducer, in issue order, so several async requests can be in
/// flight and every rank issues the same sequence. Blocking calls are async + wait.
///
/// \code
/// ddp::ring<ddp::tcp> ring{pg};
/// ring.allreduce(std::span<float>{v}, ddp::op::sum);
/// auto req = ring.allreduce_async(std::span<float>{v}, ddp::op::avg);
/// req.wait(deadline);
/// \endcode

#include <atomic>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

#include <ddp/clock.hpp>
#include <ddp/detail/collective.hpp>
#include <ddp/reducer/detail/typed_collectives.hpp>
#include <ddp/reducer/detail/worker.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/process_group.hpp>
#include <ddp/request.hpp>

namespace ddp {
inline namespace v0 {

/// Run-time tunables of ring and tree reducers. See docs/reducers.md.
struct reducer_options {
  /// Ring: the receive side reduces each segment of this many bytes as soon as it has arrived.
  std::size_t segment_bytes = 256 << 10;
  /// Tree: messages up to this size use recursive doubling (latency, log2 n steps, full buffer
  /// each step); larger ones use recursive halving-doubling (bandwidth).
  std::size_t small_bytes = 64 << 10;
  friend bool operator==(const reducer_options&, const reducer_options&) = default;
};

/// Tag: ring allreduce (reduce-scatter + allgather), bandwidth-optimal: 2(n-1)/n of the buffer
/// per rank, 2(n-1) steps.
struct ring_algorithm {};
/// Tag: tree allreduce: recursive doubling for small messages (log2 n steps), recursive
/// halving-doubling for large ones.
struct tree_algorithm {};

/// The algorithm half of a reducer: `Algorithm::run(transport, desc, ...)`. Specialized by
/// ring.hpp and tree.hpp for point-to-point transports, and by transports with their own
/// collective engine (shm).
template <class Algorithm, class Transport>
struct algorithm_for;

/// Reducer front-end: `Algorithm` is `ring_algorithm` or `tree_algorithm`, `Transport` is
/// `tcp` or `shm`. Constructing one is a collective: every rank constructs its reducers in the
/// same order.
///
/// Threads. Any thread may issue collectives; they run one at a time, in the order their calls
/// reached the reducer on this rank. Two threads that issue at the same time are ordered by
/// whichever call gets there first, which may differ from rank to rank: then the collectives
/// are paired wrongly across ranks, which is errc::mismatch when their descriptors differ and
/// otherwise silently mixes the two calls' data. A program that issues from several threads
/// must make the order the same on every rank (one issuing thread, or a lock plus an agreed
/// order). See docs/reducers.md.
template <class Algorithm, class Transport>
class basic_reducer : public detail::typed_collectives<basic_reducer<Algorithm, Transport>> {
  friend class detail::typed_collectives<basic_reducer<Algorithm, Transport>>;
  using algo = algorithm_for<Algorithm, Transport>;

 public:
  // Typed overloads (spans of ddp's element types): detail/typed_collectives.hpp.
  using detail::typed_collectives<basic_reducer<Algorithm, Transport>>::allreduce;
  using detail::typed_collectives<basic_reducer<Algorithm, Transport>>::allreduce_async;

  using transport_type = Transport;

  /// Keeps a handle on `pg` of its own: the group stays open while the reducer lives.
  explicit basic_reducer(process_group& pg, reducer_options o = {})
      : pg_(agree(pg, o)), transport_(pg), opts_(o), worker_(pg.rank()) {}
  template <class TransportOptions>
  basic_reducer(process_group& pg, TransportOptions t, reducer_options o)
      : pg_(agree(pg, o)), transport_(pg, t), opts_(o), worker_(pg.rank()) {}
  basic_reducer(const basic_reducer&) = delete;
  basic_reducer& operator=(const basic_reducer&) = delete;

  int rank() const noexcept { return pg_.rank(); }
  int size() const noexcept { return pg_.size(); }
  Transport& transport() noexcept { return transport_; }
  process_group& group() noexcept { return pg_; }
  const reducer_options& options() const noexcept { return opts_; }

  /// Every reducer does every (dtype, op) pair of ddp (false only for values outside the enums);
  /// kept as a pre-check for generic code.
  static constexpr bool supports(dtype t, op o) noexcept { return detail::valid_dtype(t) && detail::valid_op(o); }

  // ---- untyped interface (what basic_data_parallel uses) ----------------------------------
  // Arguments are checked here, on the calling thread, before anything is queued: an unknown
  // dtype or op, or overlapping buffers, raise errc::invalid_argument at the call.

  /// Starts an allreduce of `count` elements of `t` at `data`, in place.
  request allreduce_async(void* data, std::size_t count, dtype t, op o) {
    return submit(describe(detail::coll_kind::allreduce, t, o, 0, count),
                  [=, this](const detail::coll_desc& d, deadline_t until) {
                    algo::allreduce(transport_, d, data, count, t, o, opts_, until);
                  });
  }
  /// Copies `root`'s `count` elements into every rank's `data`.
  request broadcast_async(void* data, std::size_t count, dtype t, int root) {
    check_root(root);
    return submit(describe(detail::coll_kind::broadcast, t, op::sum, root, count),
                  [=, this](const detail::coll_desc& d, deadline_t until) {
                    algo::broadcast(transport_, d, data, count * dtype_size(t), root, until);
                  });
  }
  /// `in` holds size() * count_per_rank elements; rank r receives the reduction of slice r.
  /// `out` must not overlap `in`, except as exactly this rank's slice of it (in place).
  request reduce_scatter_async(const void* in, void* out, std::size_t count_per_rank, dtype t, op o) {
    const auto desc = describe(detail::coll_kind::reduce_scatter, t, o, 0, count_per_rank);
    const std::size_t slice = count_per_rank * dtype_size(t);
    detail::check_overlap("reduce_scatter", rank(), in, slice * static_cast<std::size_t>(size()), out, slice);
    return submit(desc, [=, this](const detail::coll_desc& d, deadline_t until) {
      algo::reduce_scatter(transport_, d, in, out, count_per_rank, t, o, opts_, until);
    });
  }
  /// Every rank's `count_per_rank` elements, concatenated in rank order into `out`. `in` must
  /// not overlap `out`, except as exactly this rank's slice of it (in place).
  request allgather_async(const void* in, void* out, std::size_t count_per_rank, dtype t) {
    const auto desc = describe(detail::coll_kind::allgather, t, op::sum, 0, count_per_rank);
    const std::size_t slice = count_per_rank * dtype_size(t);
    detail::check_overlap("allgather", rank(), out, slice * static_cast<std::size_t>(size()), in, slice);
    return submit(desc, [=, this](const detail::coll_desc& d, deadline_t until) {
      algo::allgather(transport_, d, in, out, count_per_rank, t, until);
    });
  }
  request barrier_async() {
    return submit(describe(detail::coll_kind::barrier, dtype::i32, op::sum, 0, 0),
                  [this](const detail::coll_desc& d, deadline_t until) { algo::barrier(transport_, d, until); });
  }

  /// Blocking allreduce; runs on the calling thread when no async work is pending.
  void allreduce(void* data, std::size_t count, dtype t, op o) {
    run(describe(detail::coll_kind::allreduce, t, o, 0, count),
        [=, this](const detail::coll_desc& d, deadline_t until) {
          algo::allreduce(transport_, d, data, count, t, o, opts_, until);
        });
  }
  void barrier() {
    run(describe(detail::coll_kind::barrier, dtype::i32, op::sum, 0, 0),
        [this](const detail::coll_desc& d, deadline_t until) { algo::barrier(transport_, d, until); });
  }

  /// Wakes every waiter on this rank and tells the peers (errc::aborted).
  void abort() noexcept { transport_.abort(); }

 private:
  /// Every rank must run the same algorithm with the same schedule-changing options, or the
  /// ranks would pair messages of different schedules (a hang, or wrong data where the sizes
  /// happen to agree). Checked once, through the group, before the transport is built (so all
  /// ranks are in the same phase), and every rank raises the same errc::mismatch naming both
  /// sides; each descriptor carries the algorithm too.
  static process_group& agree(process_group& pg, const reducer_options& o) {
    const auto all = pg.all_gather(algo::signature(o));
    for (int r = 1; r < pg.size(); ++r)
      if (all[static_cast<std::size_t>(r)] != all[0])
        detail::raise(errc::mismatch, pg.rank(),
                      "reducer mismatch: rank 0 constructed " + all[0] + ", rank " + std::to_string(r) + " constructed " +
                          all[static_cast<std::size_t>(r)] +
                          "; every rank must construct the same reducer with the same reducer_options (docs/reducers.md)");
    return pg;
  }
  void check_root(int root) const {
    if (root < 0 || root >= size())
      detail::raise(errc::invalid_argument, rank(), "root " + std::to_string(root) + " is not a rank");
  }
  void wait(const request& r) const {
    // The collective itself is bounded by the timeout once it starts; queued work ahead of it
    // is too, so twice the timeout bounds the whole wait.
    r.wait(clock::now() + 2 * pg_.timeout() + std::chrono::seconds(2));
  }
  /// Checks the arguments and builds the descriptor, all but its sequence number: that is
  /// taken when the collective starts (stamp), in the order collectives run.
  detail::coll_desc describe(detail::coll_kind k, dtype t, op o, int root, std::size_t count) const {
    detail::check_dtype(t, rank(), detail::coll_name(k));
    detail::check_op(o, rank(), detail::coll_name(k));
    detail::coll_desc d;
    d.kind = k;
    d.type = t;
    d.oper = o;
    d.root = root;
    d.count = count;
    d.algo = algo::id;
    d.variant = algo::variant(k, count * dtype_size(t), opts_);
    return d;
  }
  /// The sequence number, taken by the collective as it starts. Collectives run one at a time
  /// (on the progress thread, or inline on a caller while the progress thread is idle), so the
  /// numbers follow the order in which they run, whichever threads issued them.
  detail::coll_desc stamp(detail::coll_desc d) {
    d.seq = seq_.fetch_add(1, std::memory_order_relaxed) + 1;
    return d;
  }
  template <class Job>
  request submit(const detail::coll_desc& d, Job job) {
    return worker_.submit([this, d, job] { job(stamp(d), clock::now() + pg_.timeout()); });
  }
  template <class Job>
  void run(const detail::coll_desc& d, Job job) {
    if (!worker_.try_run_inline([&] { job(stamp(d), clock::now() + pg_.timeout()); }))
      wait(worker_.submit([this, d, job] { job(stamp(d), clock::now() + pg_.timeout()); }));
  }

  process_group pg_;  // the reducer's own handle: the group stays open while this lives
  Transport transport_;
  reducer_options opts_;
  std::atomic<std::uint64_t> seq_{0};  ///< collectives started (see stamp)
  detail::worker worker_;  // last: joins before the transport goes away
};

/// Ring reducer over `Transport` (`ddp::tcp` or `ddp::shm`).
template <class Transport>
using ring = basic_reducer<ring_algorithm, Transport>;
/// Tree reducer over `Transport` (`ddp::tcp` or `ddp::shm`).
template <class Transport>
using tree = basic_reducer<tree_algorithm, Transport>;

}  // namespace v0
}  // namespace ddp
