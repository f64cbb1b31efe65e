#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The one front end of every reducer (ring<T>, tree<T>, ring<shm>, tree<shm>, mpi_reducer,
// nccl_reducer): the calls a user makes, their argument checks, the collective's descriptor
// (with its sequence number, stamped as it starts), the progress thread, requests and the
// bounded wait of the blocking calls. What moves the bytes is the Engine:
//
//   struct my_engine {
//     static constexpr const char* name = "my_reducer";  // in errors (e.g. use in a forked child)
//     static constexpr bool descriptors = false;  // true: collectives receive (const coll_desc&, deadline_t, ...)
//     static constexpr bool deadlines = false;    // true (and no descriptors): (deadline_t, ...)
//     static constexpr bool launches_at_call = false;  // true: a collective is started on the
//                                                       // caller's thread and returns the job
//                                                       // that completes it on the progress thread
//     int rank() const noexcept;  int size() const noexcept;
//     std::chrono::milliseconds timeout() const noexcept;   // bounds each collective
//     void allreduce(ctx..., void* data, std::size_t count, dtype, op);
//     void broadcast(ctx..., void* data, std::size_t count, dtype, int root);
//     void reduce_scatter(ctx..., const void* in, void* out, std::size_t count_per_rank, dtype, op);
//     void allgather(ctx..., const void* in, void* out, std::size_t count_per_rank, dtype);
//     void barrier(ctx...);
//     // optional: void abort() noexcept;  void check(coll_kind, std::size_t count) const;
//     // optional: static constexpr bool reads_sources = true; and
//     //   void allreduce_from(ctx..., void* data, std::size_t count, dtype, op,
//     //                       std::span<const comm_tensor>, std::span<void* const> sources);
//     // with descriptors: static constexpr coll_algo id; coll_variant variant(coll_kind, std::size_t bytes) const;
//   };
//
// The engine is a member of the front end, declared before the progress thread, so the thread
// has joined before the engine goes away. Dispatch is static (a template): no virtual call, no
// allocation beyond the request's own per collective. The progress thread is lent to
// decorators over the reducer (run_in_order, try_run_inline; ddp::hooked runs its hook on it).
//
// Every collective is also written to the reducer's flight recorder (detail/flight_recorder.hpp)
// as it is issued, starts and ends, and a timeout, a lost peer or an abort dumps the process's
// record (DDP_FLIGHT_RECORDER; docs/forensics.md).

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include <ddp/bucket_tag.hpp>
#include <ddp/clock.hpp>
#include <ddp/detail/collective.hpp>
#include <ddp/detail/consensus.hpp>
#include <ddp/detail/first_failure.hpp>
#include <ddp/detail/flight_recorder.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/detail/typed_collectives.hpp>
#include <ddp/reducer/detail/worker.hpp>
#include <ddp/request.hpp>
#include <ddp/detail/timing.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Every rank must run the same algorithm with the same schedule-changing options, or the
/// ranks would pair messages of different schedules (a hang, or wrong data where the sizes
/// happen to agree). Checked once, through the group, before the engine builds its transport
/// (so all ranks are in the same phase), and every rank raises the same errc::mismatch naming
/// both sides. `signature` names the algorithm and those options ("ring", "tree<shm>").
inline process_group& agree_on_reducer(process_group& pg, const std::string& signature) {
  agree([&](const std::string& s) { return pg.all_gather(s); }, pg.rank(), signature,
        [](const auto& all, const auto& differing) {
          const auto r = differing.front();
          return "reducer mismatch: rank 0 constructed " + all[0] + ", rank " + std::to_string(r) + " constructed " +
                 all[r] +
                 "; every rank must construct the same reducer with the same reducer_options (docs/reducers.md)";
        });
  return pg;
}

template <class Engine>
concept engine_aborts = requires(Engine& e) {
  { e.abort() }
  noexcept;
};

/// Threads. Any thread may issue collectives; they run one at a time, in the order their calls
/// reached the reducer on this rank. Two threads that issue at the same time are ordered by
/// whichever call gets there first, which may differ from rank to rank: then the collectives
/// are paired wrongly across ranks, which is errc::mismatch when their descriptors differ and
/// otherwise silently mixes the two calls' data. A program that issues from several threads
/// must make the order the same on every rank (one issuing thread, or a lock plus an agreed
/// order). See docs/reducers.md.
template <class Engine>
class reducer_front_end : public typed_collectives<reducer_front_end<Engine>> {
  friend class typed_collectives<reducer_front_end<Engine>>;

 public:
  // Typed overloads (spans of ddp's element types): reducer/detail/typed_collectives.hpp.
  using typed_collectives<reducer_front_end<Engine>>::allreduce;
  using typed_collectives<reducer_front_end<Engine>>::allreduce_async;

  reducer_front_end(const reducer_front_end&) = delete;
  reducer_front_end& operator=(const reducer_front_end&) = delete;

  int rank() const noexcept { return engine_.rank(); }
  int size() const noexcept { return engine_.size(); }

  /// Every reducer does every (dtype, op) pair of ddp (false only for values outside the enums);
  /// kept as a pre-check for generic code.
  static constexpr bool supports(dtype t, op o) noexcept { return valid_dtype(t) && valid_op(o); }

  // ---- untyped interface (what basic_data_parallel uses) ----------------------------------
  // Arguments are checked here, on the calling thread, before anything is queued: an unknown
  // dtype or op, a root that is not a rank, or overlapping buffers raise errc::invalid_argument
  // at the call.

  /// Starts an allreduce of `count` elements of `t` at `data`, in place. `tag`: the bucket it
  /// serves (ddp/bucket_tag.hpp), for the flight record.
  /// With `tag.sources` (the wrapper's copy mode, where reads_sources()), this rank's data is
  /// read, and its results written, where they say; for an engine that does not read them they
  /// are copied in here first and the results out after.
  request allreduce_async(void* data, std::size_t count, dtype t, op o, const bucket_tag& tag = {}) {
    if (!tag.sources.empty()) {
      check_sources(data, count, t, tag);
      if constexpr (engine_reads_sources) {
        return submit(describe(coll_kind::allreduce, t, o, 0, count), tag,
                      [=, this, tensors = tag.tensors, sources = tag.sources](auto... ctx) {
                        return engine_.allreduce_from(ctx..., data, count, t, o, tensors, sources);
                      });
      } else if constexpr (!Engine::launches_at_call) {
        gather_sources(data, t, tag);
        return submit(describe(coll_kind::allreduce, t, o, 0, count), tag,
                      [=, this, tensors = tag.tensors, sources = tag.sources](auto... ctx) {
                        engine_.allreduce(ctx..., data, count, t, o);
                        scatter_sources(data, t, tensors, sources);
                      });
      } else {
        raise(errc::unsupported, rank(),
              std::string("allreduce with bucket_tag::sources on ") + Engine::name +
                  ", which completes collectives after the call; pass the data in the buffer");
      }
    }
    return submit(describe(coll_kind::allreduce, t, o, 0, count), tag,
                  [=, this](auto... ctx) { return engine_.allreduce(ctx..., data, count, t, o); });
  }
  /// True when allreduce_async reads bucket_tag::sources in place (the ring over tcp): the
  /// wrapper's copy mode then passes the gradients' addresses instead of copying them in.
  static constexpr bool reads_sources() noexcept { return engine_reads_sources; }
  /// Copies `root`'s `count` elements into every rank's `data`.
  request broadcast_async(void* data, std::size_t count, dtype t, int root) {
    check_root(root);
    return submit(describe(coll_kind::broadcast, t, op::sum, root, count), {},
                  [=, this](auto... ctx) { return engine_.broadcast(ctx..., data, count, t, root); });
  }
  /// `in` holds size() * count_per_rank elements; rank r receives the reduction of slice r.
  /// `out` must not overlap `in`, except as exactly this rank's slice of it (in place).
  request reduce_scatter_async(const void* in, void* out, std::size_t count_per_rank, dtype t, op o,
                               const bucket_tag& tag = {}) {
    const auto d = describe(coll_kind::reduce_scatter, t, o, 0, count_per_rank);
    const std::size_t slice = count_per_rank * dtype_size(t);
    check_overlap("reduce_scatter", rank(), in, slice * static_cast<std::size_t>(size()), out, slice);
    return submit(d, tag,
                  [=, this](auto... ctx) { return engine_.reduce_scatter(ctx..., in, out, count_per_rank, t, o); });
  }
  /// Every rank's `count_per_rank` elements, concatenated in rank order into `out`. `in` must
  /// not overlap `out`, except as exactly this rank's slice of it (in place).
  request allgather_async(const void* in, void* out, std::size_t count_per_rank, dtype t, const bucket_tag& tag = {}) {
    const auto d = describe(coll_kind::allgather, t, op::sum, 0, count_per_rank);
    const std::size_t slice = count_per_rank * dtype_size(t);
    check_overlap("allgather", rank(), out, slice * static_cast<std::size_t>(size()), in, slice);
    return submit(d, tag, [=, this](auto... ctx) { return engine_.allgather(ctx..., in, out, count_per_rank, t); });
  }
  request barrier_async() {
    return submit(describe(coll_kind::barrier, dtype::i32, op::sum, 0, 0), {},
                  [this](auto... ctx) { return engine_.barrier(ctx...); });
  }

  /// Blocking allreduce; runs on the calling thread when no async work is pending (host
  /// engines), else waits for its request.
  void allreduce(void* data, std::size_t count, dtype t, op o, const bucket_tag& tag = {}) {
    if (!tag.sources.empty()) check_sources(data, count, t, tag);
    gather_sources(data, t, tag);
    run(describe(coll_kind::allreduce, t, o, 0, count), tag,
        [=, this](auto... ctx) { return engine_.allreduce(ctx..., data, count, t, o); });
    scatter_sources(data, t, tag.tensors, tag.sources);
  }
  void barrier() {
    run(describe(coll_kind::barrier, dtype::i32, op::sum, 0, 0), {},
        [this](auto... ctx) { return engine_.barrier(ctx...); });
  }

  /// Wakes every waiter on this rank and tells the peers (errc::aborted); pending and later
  /// collectives fail. Only where the engine can be interrupted (not MPI).
  void abort() noexcept requires engine_aborts<Engine> {
    flight_record_failure("abort() of a reducer on this rank");
    engine_.abort();
  }

  // ---- the progress thread, lent to decorators (ddp::hooked) -------------------------------
  // A decorator runs its own jobs (a hook, and the collectives it passes through) on this
  // reducer's progress thread, in the one queue with this reducer's collectives, rather than
  // on a thread of its own: one progress thread per reducer stack. A job may call this
  // reducer's collectives, blocking or async; they run at once on the thread running the job.

  /// Queues `job` behind every collective issued before it; the request completes when it
  /// has run (with its exception, if any). Called from within a job, it runs `job` at once.
  request run_in_order(std::function<void()> job) { return worker_.submit(std::move(job)); }
  /// Runs `job` on the calling thread when nothing is queued or running (or from within a job);
  /// false, without running it, otherwise: then run_in_order keeps the order.
  template <class F>
  bool try_run_inline(F&& job) {
    return worker_.try_run_inline(std::forward<F>(job));
  }

 protected:
  /// `worker_rank` names this rank in the progress thread's errors; the rest builds the engine
  /// (a collective for every engine: every rank constructs its reducers in the same order).
  template <class... Args>
  explicit reducer_front_end(int worker_rank, Args&&... args)
      : engine_(std::forward<Args>(args)...),
        rec_(flight_ring::make(engine_.rank(), engine_.size(), Engine::name)),
        worker_(worker_rank, Engine::name) {}
  ~reducer_front_end() = default;

  Engine& engine() noexcept { return engine_; }
  const Engine& engine() const noexcept { return engine_; }

 private:
  static constexpr bool engine_reads_sources = requires { requires Engine::reads_sources; };

  /// bucket_tag::sources: one per tensor, each tensor inside the buffer, and a source that is
  /// not the tensor's own slot outside the buffer (the ring writes the buffer while it reads them).
  void check_sources(const void* data, std::size_t count, dtype t, const bucket_tag& tag) const {
    const std::size_t es = dtype_size(t);
    const auto* b = static_cast<const char*>(data);
    if (tag.sources.size() != tag.tensors.size())
      raise(errc::invalid_argument, rank(),
            "allreduce: bucket_tag has " + std::to_string(tag.sources.size()) + " sources for " +
                std::to_string(tag.tensors.size()) + " tensors");
    for (std::size_t k = 0; k < tag.tensors.size(); ++k) {
      const auto& x = tag.tensors[k];
      if (x.offset > count || x.numel > count - x.offset)
        raise(errc::invalid_argument, rank(),
              "allreduce: bucket_tag tensor " + std::to_string(k) + " (parameter " + std::to_string(x.param) +
                  ") lies outside the buffer of " + std::to_string(count) + " elements");
      const auto* src = static_cast<const char*>(tag.sources[k]);
      if (src == nullptr || src == b + x.offset * es) continue;
      if (src < b + count * es && b < src + x.numel * es)
        raise(errc::invalid_argument, rank(),
              "allreduce: the source of bucket_tag tensor " + std::to_string(k) + " (parameter " +
                  std::to_string(x.param) + ") overlaps the buffer");
    }
  }

  void check_root(int root) const {
    if (root < 0 || root >= size())
      raise(errc::invalid_argument, rank(), "root " + std::to_string(root) + " is not a rank");
  }
  void wait(const request& r) const { r.wait(timing::collective_deadline(engine_.timeout())); }
  /// Checks the arguments and builds the descriptor, all but its sequence number: that is
  /// taken when the collective starts (stamp), in the order collectives run. A broadcast carries
  /// its count and dtype like the others: ranks broadcasting the same bytes as different types
  /// are a mismatch, not a silent reinterpretation.
  coll_desc describe(coll_kind k, dtype t, op o, int root, std::size_t count) const {
    check_dtype(t, rank(), coll_name(k));
    check_op(o, rank(), coll_name(k));
    if constexpr (requires { engine_.check(k, count); }) engine_.check(k, count);
    coll_desc d;
    d.kind = k;  // what every engine's flight record shows
    d.type = t;
    d.oper = o;
    d.root = root;
    d.count = count;
    if constexpr (Engine::descriptors) {
      d.algo = Engine::id;
      d.variant = engine_.variant(k, count * dtype_size(t));
    }
    return d;
  }
  /// The sequence number, taken by the collective as it starts. Collectives run one at a time
  /// (on the progress thread, or inline on a caller while the progress thread is idle), so the
  /// numbers follow the order in which they run, whichever threads issued them.
  coll_desc stamp(coll_desc d) {
    d.seq = seq_.fetch_add(1, std::memory_order_relaxed) + 1;
    return d;
  }
  /// Starts the collective `job` now, on this thread, with what its engine takes.
  template <class Job>
  decltype(auto) start(const coll_desc& d, Job& job) {
    if constexpr (Engine::descriptors)
      return job(stamp(d), steady_clock::now() + engine_.timeout());
    else if constexpr (Engine::deadlines)
      return job(steady_clock::now() + engine_.timeout());
    else
      return job();
  }
  // ---- the flight record -------------------------------------------------------------------
  // `record` notes a collective as it is issued (0 when recording is off); `recorded` runs a
  // part of it and notes its end: finished, or failed with its errc, which for a timeout, a
  // lost peer or an abort also dumps the record (before the error reaches any waiter).
  std::uint64_t record(const coll_desc& d, const bucket_tag& tag, bool started) noexcept {
    return rec_ ? rec_->issue(d.kind, d.type, d.oper, d.root, d.count, started, tag.bucket, tag.step) : 0;
  }
  template <class F>
  decltype(auto) recorded(std::uint64_t n, bool last, F&& f) {
    if (n == 0) return f();
    try {
      if constexpr (std::is_void_v<decltype(f())>) {
        f();
        if (last) rec_->finished(n);
      } else {
        decltype(auto) r = f();
        if (last) rec_->finished(n);
        return r;
      }
    } catch (const error& e) {
      rec_->failed(n, e.condition());
      if (is_group_verdict(e.condition())) flight_record_failure(e.what());
      throw;
    } catch (...) {
      rec_->failed(n, errc::system);
      throw;
    }
  }

  template <class Job>
  request submit(const coll_desc& d, const bucket_tag& tag, Job job) {
    if constexpr (Engine::launches_at_call) {
      // Started here (on the stream); it ends when the progress thread has seen it complete.
      const std::uint64_t n = record(d, tag, true);
      auto done = recorded(n, false, job);
      if (n == 0) return worker_.submit(std::move(done));
      return worker_.submit([this, n, done = std::move(done)]() mutable { recorded(n, true, done); });
    } else {
      const std::uint64_t n = record(d, tag, false);
      return worker_.submit([this, d, job, n]() mutable {
        if (n != 0) rec_->started(n);
        recorded(n, true, [&] { start(d, job); });
      });
    }
  }
  template <class Job>
  void run(const coll_desc& d, const bucket_tag& tag, Job job) {
    if constexpr (Engine::launches_at_call) {
      wait(submit(d, tag, std::move(job)));
    } else {
      if (!worker_.try_run_inline([&] { recorded(record(d, tag, true), true, [&] { start(d, job); }); }))
        wait(submit(d, tag, std::move(job)));
    }
  }

  Engine engine_;
  std::atomic<std::uint64_t> seq_{0};  ///< collectives started (see stamp); descriptor engines only
  std::unique_ptr<flight_ring> rec_;   ///< null when DDP_FLIGHT_RECORDER_ENTRIES=0
  worker worker_;                      // last: joins before the engine goes away
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
