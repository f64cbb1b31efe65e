#pragma once
/// \file nccl.hpp
/// `ddp::nccl_reducer`: hands every collective to NCCL on one GPU per rank. Includes `<nccl.h>`
/// and `<cuda_runtime.h>`; link with `-lnccl -lcudart`. Needs NCCL 2.14 or newer. See
/// docs/mpi-nccl.md.
///
/// \code
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// ddp::nccl_reducer nccl{pg};                        // GPU local_rank % device count
/// ddp::cuda_allocator mem{.device = nccl.device(), .stream = nccl.stream()};
/// auto* g = static_cast<float*>(mem.allocate(n * sizeof(float)));
/// nccl.allreduce(std::span<float>{g, n}, ddp::op::avg);   // device memory
/// \endcode

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/detail/collective.hpp>
#include <ddp/detail/consensus.hpp>
#include <ddp/detail/cuda_check.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/reducer/detail/front_end.hpp>
#include <ddp/reducer/detail/nccl_shrink.hpp>
#include <ddp/error.hpp>
#include <ddp/group/verdict.hpp>
#include <ddp/dtype.hpp>
#include <ddp/process_group.hpp>
#include <ddp/request.hpp>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 14, 0)
#error "ddp/reducer/nccl.hpp needs NCCL 2.14 or newer (non-blocking communicators, ncclCommFinalize)"
#endif

// ncclCommRevoke and ncclCommShrink (NCCL 2.28): when an elastic group fails, its survivors stop
// the collectives stuck on the lost ranks (revoke) and shrink that communicator for the next
// generation instead of building a new one. (2.27's shrink alone would leave the stuck kernels
// running until then, and any cudaFree meanwhile waits for them.)
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
#define DDP_NCCL_SHRINK 1
#else
#define DDP_NCCL_SHRINK 0
#endif

namespace ddp {
inline namespace DDP_ABI {

/// The ddp condition of an NCCL result: `ncclInvalidArgument` is the caller's argument,
/// `ncclInvalidUsage` a misuse, `ncclRemoteError` a peer that failed or vanished; CUDA, system
/// and internal errors are `errc::system`.
/// \code
/// if (ddp::nccl_condition(r) == ddp::errc::peer_lost) restart_job();
/// \endcode
inline errc nccl_condition(ncclResult_t r) noexcept {
  switch (r) {
    case ncclInvalidArgument:
      return errc::invalid_argument;
    case ncclInvalidUsage:
      return errc::usage;
    case ncclRemoteError:
      return errc::peer_lost;
    case ncclInProgress:
      return errc::timeout;
    default:
      return errc::system;
  }
}

}  // namespace DDP_ABI
}  // namespace ddp

/// Evaluates an NCCL call; any result but `ncclSuccess` throws `ddp::error` naming the NCCL
/// error, the expression, file and line (condition from `ddp::nccl_condition`). Calls on a
/// non-blocking communicator may return `ncclInProgress`: poll `ncclCommGetAsyncError` instead.
#define DDP_NCCL_CHECK(expr)                                                                   \
  do {                                                                                         \
    const ncclResult_t ddp_nccl_status_ = (expr);                                              \
    if (ddp_nccl_status_ != ncclSuccess)                                                       \
      ::ddp::detail::raise(::ddp::nccl_condition(ddp_nccl_status_), -1,                        \
                           std::string("NCCL ") + ncclGetErrorString(ddp_nccl_status_) +       \
                               " from " #expr " at " __FILE__ ":" + std::to_string(__LINE__)); \
  } while (false)

namespace ddp {
inline namespace DDP_ABI {

/// The engine of `nccl_reducer`: the communicator, its stream and device. A collective is
/// enqueued on the caller's thread (NCCL orders it on the stream) and completed on the reducer's
/// progress thread (reducer/detail/front_end.hpp calls it; use `nccl_reducer`).
class nccl_engine {
 public:
  static constexpr const char* name = "nccl_reducer";
  static constexpr bool descriptors = false;  ///< NCCL matches collectives itself
  static constexpr bool deadlines = false;    ///< each request's deadline starts at the GPU (await)
  static constexpr bool launches_at_call = true;

  /// See nccl_reducer(process_group&, int, cudaStream_t).
  nccl_engine(process_group& pg, int device, cudaStream_t stream)
      : rank_(pg.rank()),
        size_(pg.size()),
        timeout_(pg.timeout()),
        elastic_(pg.options().elastic_max > 0),
        group_(pg.id()),
        ctx_(pg) {
    ncclUniqueId id{};
    std::exception_ptr local_failure;
    std::unique_ptr<resources> parent;  // the last generation's communicator, kept for a shrink
    detail::nccl_parent_offer offer;    // and what it was
    try {
      setup_device(pg, device, stream);
      if (elastic_) parent = take_parent(res_->device, offer);
      if (rank_ == 0) DDP_NCCL_CHECK(ncclGetUniqueId(&id));
    } catch (...) {
      local_failure = std::current_exception();
    }
    // Every rank learns whether every other could set up, so a failure on one rank ends all of
    // them at once instead of leaving the others in initialization until the timeout.
    // A rank that failed sends its message along, so the others quote it.
    const auto failed = detail::first_failed([&](const std::string& m) { return pg.all_gather(m); },
                                             detail::failure_of(local_failure, rank_));
    if (local_failure) std::rethrow_exception(local_failure);
    if (failed.rank >= 0)
      detail::raise(errc::aborted, rank_,
                    "nccl_reducer: rank " + std::to_string(failed.rank) +
                        " could not set up its GPU or the NCCL id: " + failed.what.text);
    // An elastic group's survivors shrink the communicator they kept from the last generation
    // when every rank kept one of it (detail/nccl_shrink.hpp); otherwise it is built anew.
    std::optional<std::vector<int>> excluded;
    if (elastic_ && DDP_NCCL_SHRINK)
      excluded = detail::nccl_shrink_plan(pg.all_gather(parent ? offer.encode() : std::string()));
    if (!excluded) parent.reset();  // aborted: it failed with its group
    pg.broadcast(std::span<std::byte>(reinterpret_cast<std::byte*>(&id), sizeof id), 0);

    const auto until = std::chrono::steady_clock::now() + timeout_;
    detail::cuda_device_guard on(res_->device);
    ncclResult_t r = ncclSuccess;
#if DDP_NCCL_SHRINK
    if (excluded) {
      // The parent was revoked when its group failed: it may be shrunk once it is quiescent.
      // The new communicator inherits its (non-blocking) configuration.
      std::unique_lock lock(mu_);
      settle_locked(parent->comm, until, "ncclCommRevoke");
      formed_by_ = "ncclCommShrink";
      r = ncclCommShrink(parent->comm, excluded->data(), static_cast<int>(excluded->size()), &res_->comm, nullptr,
                         NCCL_SHRINK_DEFAULT);
    }
#endif
    if (!excluded) {
      ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
      // Non-blocking: initialization and connection setup can then be bounded by the deadline
      // and abandoned with ncclCommAbort when a peer never shows up.
      cfg.blocking = 0;
      r = ncclCommInitRankConfig(&res_->comm, size_, id, rank_, &cfg);
    }
    std::unique_lock lock(mu_);
    if (r != ncclSuccess && r != ncclInProgress) fail_locked(r, formed_by_);
    settle_locked(res_->comm, until, formed_by_);
    int n = 0, me = 0;
    if (excluded && (ncclCommCount(res_->comm, &n) != ncclSuccess || ncclCommUserRank(res_->comm, &me) != ncclSuccess ||
                     n != size_ || me != rank_)) {
      abort_locked();
      detail::raise(errc::mismatch, rank_,
                    "nccl_reducer: ncclCommShrink made rank " + std::to_string(me) + " of " + std::to_string(n) +
                        ", not the group's rank " + std::to_string(rank_) + " of " + std::to_string(size_));
    }
    lock.unlock();
    parent.reset();  // aborted: the shrunk communicator does not need it
    // The group failed as a whole (its heartbeat found a rank frozen or dead): end the
    // collective in flight at once with the group's cause, not at its deadline.
    watch_ = ctx_.watch([this](const group_failure& f) { fail_with_group(f); });
  }

  /// An elastic group's engine whose group failed keeps its communicator (revoked) for the next
  /// generation's shrink (take_parent); any other ends it (finalized, or aborted).
  ~nccl_engine() {
    watch_.reset();  // no call from the group's failure while this goes
#if DDP_NCCL_SHRINK
    if (!elastic_ || !res_ || res_->comm == nullptr || res_->owner.forked()) return;
    if (!kept_for_shrink_ && !ctx_.verdict().recorded()) return;  // ended as any other
    res_->failed = true;  // its group failed: aborted, not finalized, unless it is kept
    if (!kept_for_shrink_ && ncclCommRevoke(res_->comm, NCCL_REVOKE_DEFAULT) != ncclSuccess) return;
    try {
      std::lock_guard lock(parking().mu);
      parking().offer = {group_, rank_, size_};
      parking().res = std::move(res_);  // ends the one kept before, if any
    } catch (...) {
      // res_ still owns it: it is aborted
    }
#endif
  }

  nccl_engine(const nccl_engine&) = delete;
  nccl_engine& operator=(const nccl_engine&) = delete;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  int device() const noexcept { return res_->device; }
  cudaStream_t stream() const noexcept { return res_->stream; }
  ncclComm_t comm() const noexcept { return res_->comm; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  /// How the communicator was made: "ncclCommInitRankConfig", or "ncclCommShrink" (an elastic
  /// group's survivors, from the last generation's).
  const char* formed_by() const noexcept { return formed_by_; }

  /// What the progress thread runs to complete a launched collective: waits for its event.
  struct completion {
    nccl_engine* engine;
    cudaEvent_t event;
    const char* what;
    void operator()() const { engine->await(event, what); }
  };

  completion allreduce(void* data, std::size_t count, dtype t, op o) {
    const auto nt = nccl_type(t);
    const auto no = nccl_op(o);
    return launch("ncclAllReduce", [&] { return ncclAllReduce(data, data, count, nt, no, res_->comm, res_->stream); });
  }
  completion broadcast(void* data, std::size_t count, dtype t, int root) {
    const auto nt = nccl_type(t);
    return launch("ncclBroadcast",
                  [&] { return ncclBroadcast(data, data, count, nt, root, res_->comm, res_->stream); });
  }
  completion reduce_scatter(const void* in, void* out, std::size_t count_per_rank, dtype t, op o) {
    const auto nt = nccl_type(t);
    const auto no = nccl_op(o);
    return launch("ncclReduceScatter",
                  [&] { return ncclReduceScatter(in, out, count_per_rank, nt, no, res_->comm, res_->stream); });
  }
  completion allgather(const void* in, void* out, std::size_t count_per_rank, dtype t) {
    const auto nt = nccl_type(t);
    return launch("ncclAllGather",
                  [&] { return ncclAllGather(in, out, count_per_rank, nt, res_->comm, res_->stream); });
  }
  /// NCCL has no barrier: a one-element allreduce on the reducer's stream. It completes when
  /// every rank has reached it and every earlier collective of this reducer has finished.
  completion barrier() {
    return launch("ncclAllReduce (barrier)", [&] {
      return ncclAllReduce(res_->scratch, res_->scratch, 1, ncclInt32, ncclSum, res_->comm, res_->stream);
    });
  }

  /// Aborts the communicator (`ncclCommAbort`: running NCCL kernels stop); pending and later
  /// requests fail with `errc::aborted`. Peers notice through their own deadline.
  void abort() noexcept {
    if (res_->owner.forked()) return;  // the communicator is the parent's
    std::lock_guard lock(mu_);
    abort_locked();
  }

 private:
  // Owns the CUDA and NCCL handles; the engine outlives the front end's progress thread, so
  // they are destroyed after it has finished every request.
  struct resources {
    int device = -1;
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;
    bool own_stream = false;
    void* scratch = nullptr;  // barrier's one int
    std::chrono::milliseconds timeout{0};
    bool failed = false;          // its group failed: aborted, not finalized (its peers may be gone)
    detail::owner_process owner;  // CUDA and NCCL handles are of no use in a forked child

    resources() = default;
    resources(const resources&) = delete;
    resources& operator=(const resources&) = delete;
    ~resources() {
      if (device < 0 || owner.forked()) return;
      int previous = -1;
      (void)cudaGetDevice(&previous);
      (void)cudaSetDevice(device);
      if (comm != nullptr && failed) {
        (void)ncclCommAbort(comm);
      } else if (comm != nullptr) {
        // Finalize flushes what is still in flight and waits for the peers; bounded, then the
        // communicator is torn down either way.
        ncclResult_t st = ncclCommFinalize(comm);
        const auto until = std::chrono::steady_clock::now() + timeout;
        while (st == ncclInProgress || st == ncclSuccess) {
          if (ncclCommGetAsyncError(comm, &st) != ncclSuccess) break;
          if (st != ncclInProgress || std::chrono::steady_clock::now() >= until) break;
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        if (st == ncclSuccess)
          (void)ncclCommDestroy(comm);
        else
          (void)ncclCommAbort(comm);
      }
      if (scratch != nullptr) (void)cudaFree(scratch);
      if (own_stream && stream != nullptr) (void)cudaStreamDestroy(stream);
      if (previous >= 0) (void)cudaSetDevice(previous);
    }
  };

  void setup_device(process_group& pg, int device, cudaStream_t stream) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      (void)cudaGetLastError();
      detail::raise(errc::unsupported, rank_, "nccl_reducer: no CUDA device");
    }
    if (device < 0) {
      const int local = pg.options().local_rank >= 0 ? pg.options().local_rank : pg.rank();
      device = local % count;
    }
    if (device >= count)
      detail::raise(
          errc::invalid_argument, rank_,
          "nccl_reducer: device " + std::to_string(device) + " does not exist (" + std::to_string(count) + " devices)");
    res_->timeout = timeout_;
    detail::cuda_device_guard on(device);
    res_->device = device;
    if (stream == nullptr) {
      // A blocking stream (not cudaStreamNonBlocking): it waits for work the program put on the
      // legacy default stream, so gradients computed there are complete before they are reduced.
      DDP_CUDA_CHECK(cudaStreamCreate(&res_->stream));
      res_->own_stream = true;
    } else {
      res_->stream = stream;
    }
    DDP_CUDA_CHECK(cudaMalloc(&res_->scratch, sizeof(std::int32_t)));
  }

  static ncclDataType_t nccl_type(dtype t) {
    switch (t) {
      case dtype::f32:
        return ncclFloat32;
      case dtype::f64:
        return ncclFloat64;
      case dtype::f16:
        return ncclFloat16;
      case dtype::bf16:
        return ncclBfloat16;
      case dtype::i32:
        return ncclInt32;
      case dtype::i64:
        return ncclInt64;
    }
    detail::raise(errc::invalid_argument, -1, "nccl_reducer: unknown dtype " + std::to_string(static_cast<int>(t)));
  }
  static ncclRedOp_t nccl_op(op o) {
    switch (o) {
      case op::sum:
        return ncclSum;
      case op::avg:
        return ncclAvg;
      case op::min:
        return ncclMin;
      case op::max:
        return ncclMax;
      case op::prod:
        return ncclProd;
    }
    detail::raise(errc::invalid_argument, -1, "unknown reduction op " + std::to_string(static_cast<int>(o)));
  }
  // Enqueues one NCCL call and an event behind it, on the caller's thread; returns the job the
  // progress thread runs to complete the request when the event has.
  template <class Call>
  completion launch(const char* what, Call&& call) {
    res_->owner.check(rank_, "nccl_reducer");
    cudaEvent_t ev = nullptr;
    {
      std::unique_lock lock(mu_);
      if (aborted_) raise_aborted_locked(what, " after abort");
      detail::cuda_device_guard on(res_->device);
      const ncclResult_t r = call();
      if (r != ncclSuccess && r != ncclInProgress) fail_locked(r, what);
      // A non-blocking communicator may still be connecting: wait for it, bounded.
      if (r == ncclInProgress) settle_locked(res_->comm, std::chrono::steady_clock::now() + timeout_, what);
      DDP_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
      const cudaError_t e = cudaEventRecord(ev, res_->stream);
      if (e != cudaSuccess) {
        (void)cudaEventDestroy(ev);
        detail::raise_cuda(e, "cudaEventRecord", __FILE__, __LINE__);
      }
    }
    return {this, ev, what};
  }

  // On the progress thread: requests are awaited in issue order, and a request's deadline
  // starts when the previous one has finished, i.e. when its collective reached the GPU's head.
  void await(cudaEvent_t ev, const char* what) {
    struct event_guard {
      cudaEvent_t e;
      ~event_guard() { (void)cudaEventDestroy(e); }
    } guard{ev};
    const auto start = std::chrono::steady_clock::now();
    const auto until = start + timeout_;
    auto nap = std::chrono::microseconds(0);
    for (;;) {
      const cudaError_t e = cudaEventQuery(ev);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) detail::raise_cuda(e, "cudaEventQuery", __FILE__, __LINE__);
      {
        std::lock_guard lock(mu_);
        if (aborted_) raise_aborted_locked(what, " aborted");
        ncclResult_t st = ncclSuccess;
        const ncclResult_t q = ncclCommGetAsyncError(res_->comm, &st);
        if (q != ncclSuccess) fail_locked(q, "ncclCommGetAsyncError");
        if (st != ncclSuccess && st != ncclInProgress) fail_locked(st, what);
        if (std::chrono::steady_clock::now() >= until) {
          abort_locked();
          detail::raise(errc::timeout, rank_,
                        std::string("nccl_reducer: ") + what + " did not complete within " +
                            std::to_string(timeout_.count()) +
                            " ms (a peer is missing or stuck); communicator aborted");
        }
      }
      // Spin briefly (small collectives finish in microseconds), then sleep with a growing
      // nap: a rank that waits on a slower peer must not take the core that peer needs.
      if (std::chrono::steady_clock::now() - start < std::chrono::microseconds(50)) {
        std::this_thread::yield();
        continue;
      }
      nap = nap < std::chrono::microseconds(20) ? std::chrono::microseconds(20)
                                                : std::min(nap * 2, std::chrono::microseconds(1000));
      std::this_thread::sleep_for(nap);
    }
  }

  // Waits until the communicator's pending operation (init, a connecting collective) is done.
  void settle_locked(ncclComm_t comm, std::chrono::steady_clock::time_point until, const char* what) {
    auto nap = std::chrono::microseconds(20);
    for (;;) {
      ncclResult_t st = ncclInProgress;
      const ncclResult_t q = ncclCommGetAsyncError(comm, &st);
      if (q != ncclSuccess) fail_locked(q, "ncclCommGetAsyncError");
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) fail_locked(st, what);
      if (std::chrono::steady_clock::now() >= until) {
        abort_locked();
        detail::raise(errc::timeout, rank_,
                      std::string("nccl_reducer: ") + what + " not ready within " + std::to_string(timeout_.count()) +
                          " ms (a rank did not join?); communicator aborted");
      }
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(2000));
    }
  }

  // An NCCL failure leaves the communicator unusable: abort it, then report.
  [[noreturn]] void fail_locked(ncclResult_t r, const char* what) {
    std::string detail_text;
    if (res_->comm != nullptr) {
      const char* last = ncclGetLastError(res_->comm);
      if (last != nullptr && *last != '\0') detail_text = std::string(": ") + last;
    }
    abort_locked();
    detail::raise(nccl_condition(r), rank_,
                  std::string("nccl_reducer: ") + what + " failed with NCCL " + ncclGetErrorString(r) + detail_text);
  }

  void abort_locked() noexcept {
    aborted_ = true;
    if (res_->comm != nullptr) {
      (void)ncclCommAbort(res_->comm);
      res_->comm = nullptr;
    }
  }

  // A request that finds the engine aborted: with the group's cause when its failure did it.
  [[noreturn]] void raise_aborted_locked(const char* what, const char* how) {
    if (!cause_.empty()) detail::raise(cause_.code, rank_, std::string("nccl_reducer: ") + what + ": " + cause_.text);
    detail::raise(errc::aborted, rank_, std::string("nccl_reducer: ") + what + how);
  }

  // On the group's reactor thread (its fan-out), when the group failed as a whole. An elastic group's engine
  // revokes the communicator (its collectives stuck on the lost ranks stop) and keeps it for the
  // next generation's shrink; any other engine, or a failed revoke, aborts it.
  void fail_with_group(const group_failure& f) noexcept {
    std::lock_guard lock(mu_);
    if (aborted_) return;
    try {
      cause_ = f;
    } catch (...) {
    }
#if DDP_NCCL_SHRINK
    if (elastic_ && res_->comm != nullptr && ncclCommRevoke(res_->comm, NCCL_REVOKE_DEFAULT) == ncclSuccess) {
      aborted_ = true;
      kept_for_shrink_ = true;
      return;
    }
#endif
    abort_locked();
  }

  // The one communicator a process keeps between generations (of its last elastic engine whose
  // group failed). Never destroyed: at exit, CUDA may be gone before static destructors run.
  struct parked {
    std::mutex mu;
    detail::nccl_parent_offer offer;
    std::unique_ptr<resources> res;
  };
  static parked& parking() {
    static auto* p = new parked;
    return *p;
  }
  // Takes the kept communicator if it is on `device` (and sets `offer`); one on another
  // device, or of the parent process, is ended.
  std::unique_ptr<resources> take_parent(int device, detail::nccl_parent_offer& offer) {
    if (!DDP_NCCL_SHRINK) return nullptr;
    std::unique_ptr<resources> r;
    {
      std::lock_guard lock(parking().mu);
      r = std::move(parking().res);
      offer = parking().offer;
    }
    if (r && (r->device != device || r->owner.forked())) r.reset();
    return r;
  }

  int rank_;
  int size_;
  std::chrono::milliseconds timeout_;
  bool elastic_;
  std::uint64_t group_;
  transport_context ctx_;  // the group's failure verdict and watch
  std::mutex mu_;          // NCCL calls on one communicator must not overlap; guards comm and aborted_
  bool aborted_ = false;
  bool kept_for_shrink_ = false;  // aborted by the group's failure, communicator kept
  group_failure cause_;           // the group's failure, when it aborted the engine
  const char* formed_by_ = "ncclCommInitRankConfig";
  std::unique_ptr<resources> res_ = std::make_unique<resources>();
  group_watch watch_;  // last: it goes first
};

/// Reducer that enqueues each collective on one CUDA stream of one GPU, in issue order, and
/// completes its request when the GPU has finished it (an event, polled by the reducer's
/// progress thread with a growing sleep, so a waiting rank does not take a core).
///
/// Buffers are device memory of this reducer's device (`cuda_allocator{.device = device()}`),
/// or managed memory. Work on the caller's stream is ordered before a collective when the
/// reducer was given that stream; with no stream the reducer creates its own blocking stream,
/// which orders it after work on the legacy default stream only.
///
/// One GPU per rank: NCCL refuses two ranks of one communicator on the same device.
///
/// Deadlines: every request must complete within the group's timeout of reaching the GPU;
/// otherwise the reducer aborts the communicator (`ncclCommAbort`, which also stops the
/// kernels) and the request fails with `errc::timeout`; later calls fail with `errc::aborted`.
/// `ncclRemoteError` and other asynchronous NCCL errors end it the same way. Semantics are
/// NCCL's: `avg` is `ncclAvg` (floats are scaled before summing, so the last bit can differ
/// from the host reducers), integer sums wrap, and min/max follow CUDA's `fmin`/`fmax` (a NaN
/// loses against a number).
class nccl_reducer : public detail::reducer_front_end<nccl_engine> {
 public:
  /// NCCL moves the bytes itself: there is no ddp transport for an allocator to be built from.
  struct engine_transport {};
  using transport_type = engine_transport;

  /// Creates the communicator of `pg` (a collective: every rank constructs its reducers in the
  /// same order). `device` < 0 picks `local_rank % device count` (`pg.rank()` when the local
  /// rank is unknown); `stream` nullptr makes the reducer create one. Rank 0 creates the NCCL
  /// unique id and broadcasts it through the group. Throws `errc::unsupported` without a CUDA
  /// device, `errc::invalid_argument` for a device that does not exist, `errc::timeout` when
  /// the communicator is not ready within the group's timeout.
  /// \code
  /// ddp::nccl_reducer nccl{pg, /*device=*/-1, my_stream};
  /// \endcode
  explicit nccl_reducer(process_group& pg, int device = -1, cudaStream_t stream = nullptr)
      : reducer_front_end(pg.rank(), pg, device, stream) {}

  /// The CUDA device the communicator runs on.
  int device() const noexcept { return engine().device(); }
  /// The stream collectives are enqueued on.
  cudaStream_t stream() const noexcept { return engine().stream(); }
  /// The communicator (nullptr once aborted); for NCCL calls of the program's own, which must
  /// not overlap with this reducer's requests.
  ncclComm_t comm() const noexcept { return engine().comm(); }
  std::chrono::milliseconds timeout() const noexcept { return engine().timeout(); }
};

}  // namespace DDP_ABI
}  // namespace ddp
