#pragma once
/// \file reducer/hooked.hpp
/// `ddp::hooked<Inner, Hook>`: a reducer that hands every allreduce to a communication hook,
/// as PyTorch's `register_comm_hook` does for DDP's buckets. The hook receives the bucket
/// (`ddp::comm_bucket`: data, count, dtype, op, sequence number) and the inner reducer, and
/// leaves the reduced result in the bucket's memory; `ddp::fp16_compress` and
/// `ddp::bf16_compress` (reducer/compress.hpp) send half the bytes that way. The decorator
/// satisfies `ddp::reducer`, so it slots into `basic_data_parallel` in place of the reducer it
/// wraps, with the allocator the wrapper would have used for that reducer. See
/// docs/tuning.md, "Communication hooks and compression", and docs/reducers.md.
///
/// \code
/// struct count_calls {
///   int calls = 0;
///   template <class Inner>
///   void operator()(const ddp::comm_bucket& b, Inner& inner) {
///     ++calls;                                           // one call per allreduce, in issue order
///     inner.allreduce(b.data, b.count, b.type, b.oper, b.tag());  // the result in b.data on return
///   }
/// };
/// ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ddp::ring<ddp::tcp>, count_calls>> dp{pg, params};
/// \endcode

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include <ddp/version.hpp>
#include <ddp/bucket_tag.hpp>
#include <ddp/clock.hpp>
#include <ddp/dtype.hpp>
#include <ddp/detail/collective.hpp>
#include <ddp/error.hpp>
#include <ddp/fwd.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/detail/tagged.hpp>
#include <ddp/reducer/detail/typed_collectives.hpp>
#include <ddp/detail/first_failure.hpp>
#include <ddp/reducer/detail/worker.hpp>
#include <ddp/request.hpp>
#include <ddp/detail/timing.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// One allreduce as a communication hook receives it. The hook reduces `count` elements of
/// `type` at `data` with `oper` across the group, in place.
struct comm_bucket {
  void* data = nullptr;
  std::size_t count = 0;
  dtype type = dtype::f32;
  op oper = op::sum;
  /// 0 for the first allreduce through this reducer, then 1, 2, ... in issue order (the same
  /// on every rank). Inside a data-parallel step the wrapper issues its buckets in plan order,
  /// so bucket b of step s is a fixed offset from the step's first; the count runs on across
  /// steps and includes allreduces a program issues itself.
  std::uint64_t seq = 0;
  int rank = 0;  ///< this rank
  int size = 1;  ///< ranks in the group
  /// The hook's own waits (on requests it starts) should end by this: twice the group's
  /// timeout after the hook was called, as the reducers' blocking calls wait.
  steady_clock::time_point deadline{};
  /// The wrapper's bucket index (its plan's launch order; the same on every rank), or -1 for
  /// an allreduce a program issued itself.
  std::int32_t bucket = -1;
  /// The tensors packed in the bucket, in buffer order, back to back (empty for an allreduce
  /// a program issued itself). Valid during the call.
  std::span<const comm_tensor> tensors{};
  /// The wrapper's step (-1 for an allreduce a program issued itself).
  std::int64_t step = -1;

  /// What the collective was issued with: pass it on to the inner reducer's calls
  /// (`inner.allreduce(p, n, t, o, b.tag())`) so that its flight record names the bucket.
  bucket_tag tag() const noexcept { return {bucket, step, tensors}; }

  std::size_t bytes() const noexcept { return count * dtype_size(type); }
  /// The bucket as a span of `T`; errc::invalid_argument when `T` is not its dtype.
  template <class T>
  std::span<T> as() const {
    if (dtype_of_v<T> != type)
      detail::raise(
          errc::invalid_argument, rank,
          std::string("comm_bucket::as: the bucket holds ") + dtype_name(type) + ", not " + dtype_name(dtype_of_v<T>));
    return {static_cast<T*>(data), count};
  }
};

/// A communication hook for reducer `R`: `h(bucket, inner)` reduces the bucket through `inner`
/// (or any way it likes) and returns when the result is in `bucket.data` on this rank.
template <class H, class R>
concept comm_hook = requires(H& h, const comm_bucket& b, R& r) {
  h(b, r);
};

/// The hook that does what the inner reducer would: one allreduce, unchanged.
struct plain_allreduce {
  template <class R>
  void operator()(const comm_bucket& b, R& inner) {
    detail::allreduce_now(inner, b.data, b.count, b.type, b.oper, b.deadline, b.tag());
  }
};

namespace detail {
template <class R>
struct transport_type_of {};
template <class R>
requires requires { typename R::transport_type; }
struct transport_type_of<R> {
  using transport_type = typename R::transport_type;
};

/// A hook that computes on the CPU (compression) refuses buckets in GPU memory: at compile time
/// for nccl_reducer, at run time when an auto_reducer chose NCCL.
template <class R>
void require_host_buckets(const comm_bucket& b, R& inner, const char* hook) {
  static_assert(!std::is_same_v<R, nccl_reducer>,
                "ddp: this communication hook computes on the CPU; nccl_reducer's buckets live in GPU memory");
  if constexpr (requires { inner.nccl(); })
    if (inner.nccl() != nullptr)
      raise(errc::unsupported, b.rank,
            std::string(hook) +
                " computes on the CPU, but the auto_reducer chose NCCL, whose buckets live in GPU memory; use a host "
                "engine (DDP_BACKEND=shm, tcp, mpi) or reduce uncompressed");
}

}  // namespace detail

/// A reducer that runs each allreduce through `Hook` on top of the reducer `Inner`.
///
/// Contract of the hook (docs/tuning.md):
/// - it is called once per allreduce issued through this reducer (each bucket the wrapper
///   launches, and a program's own `allreduce` calls), in issue order, one call at a time: on
///   the inner reducer's progress thread (this reducer has none of its own: one progress
///   thread per reducer stack), or on the thread of a blocking call when nothing is queued. So
///   a hook may keep state (scratch buffers) without locks. The inner collectives it calls,
///   blocking or `allreduce_async(...).wait(...)`, run at once on that same thread (they do not
///   queue behind the hook). Where `Inner` lends no progress thread (a reducer not built on
///   reducer/detail/front_end.hpp, without `run_in_order` and `try_run_inline`), this reducer
///   keeps a progress thread of its own and the hook runs there instead.
/// - it receives the bucket and the inner reducer, and must leave the reduced result in the
///   bucket's memory before it returns. It may run any number of collectives on the inner
///   reducer, provided every rank runs the same sequence for the same bucket (decide from
///   values every rank shares: the descriptor, or the result of a collective). Passing the
///   bucket's `b.tag()` to them (every reducer of ddp takes it as the last argument) makes the
///   flight record name the bucket and step of each (docs/forensics.md).
/// - an exception from it becomes the error of the allreduce's request (a `ddp::error` as it
///   is; any other exception as errc::aborted naming the hook, the bucket and what()). The
///   ranks' sequences of collectives may then differ, so the inner reducer is aborted on this
///   rank (its peers fail at once, not at their deadline) and every later collective of this
///   reducer fails with errc::aborted quoting that first failure.
/// Broadcast, reduce_scatter, allgather and barrier are not hooked; they go through the same
/// queue, so every collective keeps its place in the issue order.
///
/// Do not issue collectives on `inner()` directly while this reducer may be running one
/// (except from inside the hook): they would not be hooked, and with a progress thread of this
/// reducer's own (see above) they would bypass its queue and order.
/// \code
/// ddp::hooked<ddp::ring<ddp::tcp>, ddp::plain_allreduce> red{pg};
/// red.allreduce(std::span<float>{v}, ddp::op::avg);
/// \endcode
template <class Inner, class Hook = plain_allreduce>
class hooked : public detail::typed_collectives<hooked<Inner, Hook>>, public detail::transport_type_of<Inner> {
  friend class detail::typed_collectives<hooked<Inner, Hook>>;
  static_assert(comm_hook<Hook, Inner>, "ddp: Hook must be callable as hook(const ddp::comm_bucket&, Inner&)");

 public:
  using inner_type = Inner;
  using hook_type = Hook;
  using detail::typed_collectives<hooked<Inner, Hook>>::allreduce;
  using detail::typed_collectives<hooked<Inner, Hook>>::allreduce_async;

  /// Builds `Inner{pg, inner_args...}` (a collective, as every reducer's construction) and a
  /// default-constructed hook.
  template <class... Args>
  requires std::constructible_from<Inner, process_group&, Args...> && std::default_initializable<Hook>
  explicit hooked(process_group& pg, Args&&... inner_args) : hooked(pg, Hook{}, std::forward<Args>(inner_args)...) {}
  /// The same with the hook given.
  template <class... Args>
  requires std::constructible_from<Inner, process_group&, Args...> hooked(process_group& pg, Hook hook,
                                                                          Args&&... inner_args)
      : pg_(pg),
        inner_(pg, std::forward<Args>(inner_args)...),
        hook_(std::move(hook)),
        progress_(inner_, pg.rank(), "hooked reducer") {}

  hooked(const hooked&) = delete;
  hooked& operator=(const hooked&) = delete;

  int rank() const noexcept { return inner_.rank(); }
  int size() const noexcept { return inner_.size(); }
  /// The reducer the hook runs on.
  Inner& inner() noexcept { return inner_; }
  const Inner& inner() const noexcept { return inner_; }
  /// The hook (touch it only while no collective of this reducer runs).
  Hook& hook() noexcept { return hook_; }
  const Hook& hook() const noexcept { return hook_; }
  /// The inner reducer's transport (where it has one: shm_allocator draws from it).
  decltype(auto) transport() noexcept requires requires(Inner& r) { r.transport(); }
  { return inner_.transport(); }
  /// The reducer's own handle on its group.
  process_group& group() noexcept { return pg_; }

  /// Starts an allreduce: the hook runs it, after every collective issued before it. `tag`: the
  /// bucket it serves (the hook receives it in its comm_bucket).
  request allreduce_async(void* data, std::size_t count, dtype t, op o, const bucket_tag& tag = {}) {
    check(t, o, "allreduce");
    detail::gather_sources(data, t, tag);  // the hook works on the bucket: it holds everything now
    return progress_.submit([=, this, held = detail::without_sources(tag)] {
      run_hook(data, count, t, o, held);
      detail::scatter_sources(data, t, tag.tensors, tag.sources);
    });
  }
  /// Blocking allreduce through the hook; on the calling thread when nothing is queued.
  void allreduce(void* data, std::size_t count, dtype t, op o, const bucket_tag& tag = {}) {
    check(t, o, "allreduce");
    detail::gather_sources(data, t, tag);
    const bucket_tag held = detail::without_sources(tag);
    if (!progress_.try_run_inline([&] { run_hook(data, count, t, o, held); }))
      wait(allreduce_async(data, count, t, o, held));
    detail::scatter_sources(data, t, tag.tensors, tag.sources);
  }
  request broadcast_async(void* data, std::size_t count, dtype t, int root) {
    check(t, op::sum, "broadcast");
    return progress_.submit([=, this] { pass([&] { return inner_.broadcast_async(data, count, t, root); }); });
  }
  request reduce_scatter_async(const void* in, void* out, std::size_t count_per_rank, dtype t, op o,
                               const bucket_tag& tag = {}) requires requires(Inner& r) {
    r.reduce_scatter_async(in, out, count_per_rank, t, o);
  }
  {
    check(t, o, "reduce_scatter");
    return progress_.submit([=, this] {
      pass([&] { return detail::reduce_scatter_async_tagged(inner_, in, out, count_per_rank, t, o, tag); });
    });
  }
  request allgather_async(const void* in, void* out, std::size_t count_per_rank, dtype t,
                          const bucket_tag& tag = {}) requires requires(Inner& r) {
    r.allgather_async(in, out, count_per_rank, t);
  }
  {
    check(t, op::sum, "allgather");
    return progress_.submit(
        [=, this] { pass([&] { return detail::allgather_async_tagged(inner_, in, out, count_per_rank, t, tag); }); });
  }
  request barrier_async() {
    return progress_.submit([this] { pass([&] { return barrier_request(); }); });
  }
  void barrier() {
    if (!progress_.try_run_inline([&] { pass([&] { return barrier_request(); }); })) wait(barrier_async());
  }

  /// Ends the inner reducer's collectives in flight on every rank (where it can be aborted).
  void abort() noexcept requires requires(Inner& r) {
    { r.abort() }
    noexcept;
  }
  { inner_.abort(); }

  /// True once a hook failed: every later collective raises errc::aborted quoting it.
  bool failed() const noexcept { return failure_.failed(); }

  /// The progress thread this reducer runs on, lent in turn to a decorator over it (a hooked
  /// over a hooked): reducer/detail/front_end.hpp.
  request run_in_order(std::function<void()> job) { return progress_.submit(std::move(job)); }
  template <class F>
  bool try_run_inline(F&& job) {
    return progress_.try_run_inline(std::forward<F>(job));
  }

 private:
  steady_clock::time_point deadline() const { return detail::timing::collective_deadline(pg_.timeout()); }
  void wait(const request& r) const { r.wait(deadline()); }

  void check(dtype t, op o, const char* what) const {
    detail::check_dtype(t, rank(), what);
    detail::check_op(o, rank(), what);
  }
  void check_usable() const { failure_.check(rank(), "this hooked reducer failed earlier; the first cause: "); }

  request barrier_request() {
    if constexpr (requires { inner_.barrier_async(); }) {
      return inner_.barrier_async();
    } else {
      inner_.barrier();
      return request{};
    }
  }

  // A collective that is not hooked: started on the inner reducer and waited for here, so that
  // the next one starts after it.
  template <class Start>
  void pass(Start&& start) {
    check_usable();
    start().wait(deadline());
  }

  void run_hook(void* data, std::size_t count, dtype t, op o, const bucket_tag& tag) {
    check_usable();
    comm_bucket b{data, count, t, o, seq_++, rank(), size(), deadline(), tag.bucket, tag.tensors, tag.step};
    try {
      hook_(static_cast<const comm_bucket&>(b), inner_);
    } catch (const error& e) {
      // A lost peer, a timeout or an abort is a verdict the inner reducer has posted to the
      // peers already: passing it on again would only blur who failed first.
      fail(detail::message_of(e), !detail::is_group_verdict(e.condition()));
      throw;
    } catch (const std::exception& e) {
      const std::string msg = hook_failure(b, e.what());
      fail(msg);
      detail::raise(errc::aborted, rank(), msg);
    } catch (...) {
      const std::string msg = hook_failure(b, "an exception of unknown type");
      fail(msg);
      detail::raise(errc::aborted, rank(), msg);
    }
  }

  static std::string hook_failure(const comm_bucket& b, const std::string& what) {
    return "the communication hook threw on allreduce " + std::to_string(b.seq) + " (" + std::to_string(b.count) + " " +
           dtype_name(b.type) + ", " + op_name(b.oper) + "): " + what;
  }

  // After a failed hook the ranks may have run different collectives: fail the inner reducer
  // here, so that peers blocked on this rank fail now (quoting `why` where the transport can
  // carry it), and refuse every later collective.
  void fail(const std::string& why, bool tell_peers = true) noexcept {
    failure_.set(errc::aborted, why);
    if constexpr (requires {
                    { inner_.abort(errc::aborted, why) }
                    noexcept;
                  }) {
      // The inner reducer carries the reason itself (auto_reducer, hierarchical: shm within a
      // host, the group's record across hosts).
      if (tell_peers)
        inner_.abort(errc::aborted, why);
      else
        inner_.abort();
      return;
    } else if constexpr (requires { inner_.transport().fail(errc::aborted, why); }) {
      if (tell_peers) {
        try {
          inner_.transport().fail(errc::aborted, why);  // peers quote it: "rank r reports: ..."
        } catch (...) {
        }
      }
    }
    if constexpr (requires {
                    { inner_.abort() }
                    noexcept;
                  })
      inner_.abort();
  }

  process_group pg_;
  Inner inner_;
  Hook hook_;
  std::uint64_t seq_ = 0;          // hooks run one at a time (progress_), so no atomic is needed
  detail::first_failure failure_;  // later collectives raise errc::aborted quoting it
  // Last: before the hook and the inner reducer go away, it waits for this reducer's jobs still
  // queued on the inner reducer's thread (or joins the thread of its own).
  detail::progress_of<Inner> progress_;
};

}  // namespace DDP_ABI
}  // namespace ddp
