#pragma once
/// \file data_parallel.hpp
/// `ddp::basic_data_parallel<Planner, Reducer, Allocator>` and `ddp::data_parallel`: hook any
/// engine's parameters into synchronized data-parallel training. The engine calls
/// `grad_ready(i)` as each gradient is produced during backward, then `finish()`; when it
/// returns every gradient holds the average over all ranks, and the reduction of early buckets
/// ran while backward was still computing the later ones. See docs/data-parallel.md.
///
/// \code
/// using namespace ddp::literals;
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// ddp::data_parallel dp{pg, params, ddp::bucket_policy{.cap_bytes = 25_MiB, .first_cap_bytes = 1_MiB}};
/// for (auto& batch : shard) {
///   engine.forward(batch);
///   engine.backward([&](std::size_t i) { dp.grad_ready(i); });
///   dp.finish();  // gradients are now averaged on every rank
///   engine.step();
/// }
/// \endcode

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ddp/concepts.hpp>
#include <ddp/detail/copy.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/memory/host_allocator.hpp>
#include <ddp/parameter.hpp>
#include <ddp/planner/bucket_plan.hpp>
#include <ddp/planner/size_planner.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/request.hpp>
#include <ddp/transport/tcp.hpp>

namespace ddp {
inline namespace v0 {

/// Run-time options of the data-parallel wrapper. See docs/data-parallel.md.
/// \code
/// ddp::data_parallel dp{pg, params, {}, ddp::dp_options{.gradient_as_bucket_view = true}};
/// \endcode
struct dp_options {
  /// The engine writes gradient i straight into bucket memory (`bucket_grad(i)`), so nothing is
  /// copied in or out. The bucket layout is then fixed at construction (no rebuild from the
  /// ready order), so a pointer from `bucket_grad(i)` stays valid for the wrapper's lifetime.
  bool gradient_as_bucket_view = false;
  /// Parameters that never became ready by `finish()` count as a zero gradient instead of being
  /// an error (models whose forward skips parts of the network).
  bool find_unused_parameters = false;
  /// Copy rank 0's parameter values to every rank at construction.
  bool broadcast_parameters = true;
  /// Reduce with `op::avg` (true) or `op::sum` (false: the engine scales gradients itself).
  bool average = true;
  /// Bound on `finish()`'s wait for the reductions; zero means the process group's timeout.
  std::chrono::milliseconds timeout{0};

  friend bool operator==(const dp_options&, const dp_options&) = default;
};

/// Timing of one bucket in one step, in milliseconds from the step's first `grad_ready`.
struct bucket_timing {
  std::size_t bytes = 0;       ///< bytes reduced by this bucket's collective
  std::size_t parameters = 0;  ///< parameters in the bucket
  double ready_ms = 0;         ///< its last gradient arrived (the bucket became complete)
  double launch_ms = 0;        ///< handed to the reducer (later than ready when an earlier bucket lagged)
  double reduced_ms = 0;       ///< the reducer finished it

  /// Time from the bucket becoming complete to its reduction ending.
  double ready_to_reduced_ms() const noexcept { return reduced_ms - ready_ms; }
  /// Time the collective spent queued and running.
  double launch_to_reduced_ms() const noexcept { return reduced_ms - launch_ms; }
};

/// What one step cost; `last_step_stats()` after `finish()`.
struct step_stats {
  std::uint64_t step = 0;        ///< 0 for the first `finish()`
  bool synchronized = false;     ///< false for a step under `no_sync()`
  std::size_t bytes_reduced = 0; ///< sum of the bucket sizes reduced this step
  std::size_t unused = 0;        ///< parameters not ready in this step (mark_unused or the option)
  std::size_t launched_before_finish = 0;  ///< buckets launched while backward was still running
  double backward_ms = 0;  ///< first to last `grad_ready` (the backward window seen by ddp)
  double exposed_ms = 0;   ///< last `grad_ready` to `finish()` return: communication not hidden
  double finish_ms = 0;    ///< time spent inside `finish()`
  std::vector<bucket_timing> buckets;  ///< in plan (launch) order; empty for unsynchronized steps
};

namespace detail {
// Allocators that live inside the reducer's transport (shm_allocator) are built from it;
// everything else is default-constructed.
template <class Allocator, class Reducer>
Allocator make_allocator_for(Reducer& red) {
  if constexpr (requires {
                  typename Reducer::transport_type;
                  requires std::constructible_from<Allocator, typename Reducer::transport_type&>;
                  red.transport();
                }) {
    return Allocator(red.transport());
  } else {
    return Allocator{};
  }
}
}  // namespace detail

/// The data-parallel wrapper: one flat buffer per bucket from `Allocator`, one collective per
/// bucket through `Reducer`, buckets chosen by `Planner`.
///
/// Construction is collective (every rank constructs its wrappers in the same order): it
/// checks that every rank has the same parameter count, shapes and dtypes (else `errc::mismatch`
/// on every rank, naming the first differing parameter and the ranks that differ), copies rank
/// 0's parameter values everywhere, plans the buckets and allocates them.
///
/// A step is the `grad_ready`/`mark_unused` calls of one backward followed by `finish()`.
/// Buckets launch in plan order on every rank: a complete bucket waits for every earlier one to
/// launch, so ranks that see gradients in different orders still issue identical collectives.
/// `grad_ready` and `mark_unused` may be called from several threads at once (for different
/// parameters); `finish()`, `no_sync()` and the accessors must not overlap with them.
/// \code
/// ddp::basic_data_parallel<ddp::size_planner, ddp::tree<ddp::tcp>> dp{pg, params};
/// for (std::size_t i = params.size(); i-- > 0;) dp.grad_ready(i);
/// dp.finish();
/// \endcode
template <bucket_planner Planner = size_planner, reducer Reducer = ring<tcp>,
          device_allocator Allocator = host_allocator>
class basic_data_parallel {
 public:
  using planner_type = Planner;
  using reducer_type = Reducer;
  using allocator_type = Allocator;

  /// RAII scope of gradient accumulation: steps that *start* while a guard lives do no
  /// communication; the engine keeps accumulating into its gradients as it would alone, and the
  /// next synchronized step averages the accumulated sums.
  class [[nodiscard]] no_sync_guard {
   public:
    no_sync_guard(no_sync_guard&& o) noexcept : dp_(std::exchange(o.dp_, nullptr)) {}
    no_sync_guard(const no_sync_guard&) = delete;
    no_sync_guard& operator=(const no_sync_guard&) = delete;
    no_sync_guard& operator=(no_sync_guard&&) = delete;
    ~no_sync_guard() {
      if (dp_ != nullptr) --dp_->no_sync_depth_;
    }

   private:
    friend class basic_data_parallel;
    explicit no_sync_guard(basic_data_parallel& dp) noexcept : dp_(&dp) { ++dp.no_sync_depth_; }
    basic_data_parallel* dp_;
  };

  /// Wraps `params` (any `ddp::parameter_set`). `reducer_args` go to `Reducer{pg, reducer_args...}`
  /// (e.g. transport and reducer options). Throws `ddp::error`: mismatch (ranks disagree on the
  /// parameters or the plan), invalid_argument (a parameter with null pointers), unsupported
  /// (device parameters with an allocator that cannot copy them), and whatever the reducer or
  /// the group throw (timeout, peer_lost).
  /// \code
  /// ddp::data_parallel dp{pg, views, ddp::bucket_policy{.cap_bytes = 4_MiB}, {.find_unused_parameters = true}};
  /// \endcode
  template <parameter_set ParamSet, class... ReducerArgs>
  basic_data_parallel(process_group& pg, const ParamSet& params, bucket_policy policy = {}, dp_options opts = {},
                      ReducerArgs&&... reducer_args)
      : pg_(pg),
        policy_(std::move(policy)),
        opts_(opts),
        views_(to_views(params)),
        red_(pg, std::forward<ReducerArgs>(reducer_args)...),
        alloc_(detail::make_allocator_for<Allocator>(red_)) {
    names_.reserve(views_.size());
    for (auto& v : views_) names_.emplace_back(v.name);
    for (std::size_t i = 0; i < views_.size(); ++i) views_[i].name = names_[i];
    check_copyable();
    check_signatures();
    if (opts_.broadcast_parameters && pg.size() > 1) broadcast_parameters();
    infos_.reserve(views_.size());
    for (auto& v : views_) infos_.push_back(param_info{v.numel, v.type, v.device});
    // View mode hands bucket memory to the engine, which keeps the pointers: that layout must
    // never move, so it is final from the start (docs/data-parallel.md, "View mode").
    settled_ = opts_.gradient_as_bucket_view || !policy_.rebuild_from_ready_order;
    plan_ = planner_.plan(infos_, policy_, {});
    check_plan_agreement("at construction");
    set_up_buffers();
    ready_ = std::make_unique<std::atomic<bool>[]>(views_.size());
    unused_.assign(views_.size(), 0);
    accumulated_.assign(views_.size(), 0);
    order_.reserve(views_.size());
    reset_step();
  }

  basic_data_parallel(const basic_data_parallel&) = delete;
  basic_data_parallel& operator=(const basic_data_parallel&) = delete;

  /// Waits (bounded) for collectives a failed step left in flight, then frees the buckets. In a
  /// forked child it waits for nothing and aborts nothing (the collectives are the parent's).
  ~basic_data_parallel() {
    if (owner_.forked()) {
      // The child frees its copy of host memory; CUDA memory is the parent's driver's.
      const auto where = alloc_.location();
      if (where == memory_kind::host || where == memory_kind::shared) free_buffers(buffers_, plan_);
      return;
    }
    if (drain()) free_buffers(buffers_, plan_);
    // Otherwise a collective may still write into a bucket: leaking it is the safe choice.
  }

  // ---- the engine's hooks -------------------------------------------------------------------

  /// Gradient `i` is complete for this step. In copy mode it is copied into its bucket now (so
  /// the engine may reuse its gradient buffer until `finish()` writes the average back); in view
  /// mode the engine has written it at `bucket_grad(i)`. A bucket whose gradients are all ready
  /// is launched at once, after every earlier bucket. Throws `errc::invalid_argument` for an
  /// index out of range, `errc::usage` when `i` was already ready (or marked unused) this step.
  /// Any other exception (the allocator's copy, the reducer's launch) leaves the step half done:
  /// the wrapper is failed from then on (every later call raises, naming this first cause) and
  /// the peers are told, so that their `finish()` fails promptly naming this rank.
  /// \code
  /// engine.backward([&](std::size_t i) { dp.grad_ready(i); });
  /// \endcode
  void grad_ready(std::size_t i) {
    check_index(i, "grad_ready");
    claim(i, "grad_ready");
    guarded("grad_ready", i, [&] {
      const bool sync = open_step();
      if (!sync) accumulated_[i] = 1;
      if (sync && !opts_.gradient_as_bucket_view) copy_bytes(slot(i), views_[i].grad, views_[i].bytes());
      complete(i, sync);
    });
  }

  /// Parameter `i` produced no gradient in this step. It counts as a zero gradient, unless
  /// `no_sync()` steps since the last synchronized step made it ready: then its accumulated
  /// gradient (the engine's gradient in copy mode, the bucket slot in view mode) takes part in
  /// the average, as in PyTorch DDP. Same errors as `grad_ready`.
  /// \code
  /// if (!used_expert[e]) dp.mark_unused(expert_param[e]);
  /// \endcode
  void mark_unused(std::size_t i) {
    check_index(i, "mark_unused");
    claim(i, "mark_unused");
    guarded("mark_unused", i, [&] {
      const bool sync = open_step();
      unused_[i] = 1;
      if (sync) fill_unused(i);
      complete(i, sync);
    });
  }

  /// Ends the step: launches the remaining buckets in plan order, waits for every reduction
  /// (bounded by the timeout), copies the averages into the engine's gradients (copy mode) and
  /// resets for the next step. Under `no_sync()` it only resets. Parameters that never became
  /// ready are an `errc::usage` error naming them, raised before anything is launched (so the
  /// caller may `mark_unused` them and call `finish()` again), unless `find_unused_parameters`
  /// is set. A failed reduction (timeout, peer_lost) leaves the wrapper unusable, and so does
  /// any other exception from inside (the allocator's copy, the rebuild): every later call
  /// raises naming the first cause, and for a cause on this rank the peers are told.
  /// \code
  /// dp.finish();
  /// optimizer.step();
  /// \endcode
  void finish() {
    check_healthy();
    const auto t_call = clock::now();
    {
      std::lock_guard lock(mu_);
      if (!step_open_) {
        step_open_ = true;
        step_sync_ = no_sync_depth_ == 0;
        step_start_ = last_ready_ = t_call;
      }
    }
    step_stats st;
    st.step = step_;
    st.synchronized = step_sync_;
    if (!step_sync_) {
      const auto t_end = clock::now();
      fill_times(st, t_call, t_end);
      last_stats_ = std::move(st);
      reset_step();
      ++step_;
      return;
    }

    std::vector<std::size_t> missing;
    for (std::size_t i = 0; i < views_.size(); ++i)
      if (!ready_[i].load(std::memory_order_acquire)) missing.push_back(i);
    if (!missing.empty() && !opts_.find_unused_parameters) {
      std::string list;
      const std::size_t shown = std::min<std::size_t>(missing.size(), 8);
      for (std::size_t k = 0; k < shown; ++k) list += (k ? ", " : "") + label(missing[k]);
      if (shown < missing.size()) list += " and " + std::to_string(missing.size() - shown) + " more";
      detail::raise(errc::usage, pg_.rank(),
                    "finish() while " + std::to_string(missing.size()) + " parameter" +
                        (missing.size() > 1 ? "s" : "") + " never became ready this step: " + list +
                        "; call grad_ready(i) or mark_unused(i) for each, or set "
                        "dp_options::find_unused_parameters",
                    -1, static_cast<int>(missing.front()));
    }
    const auto last_hook = last_ready_;
    guarded("finish", -1, [&] {
      {
        std::lock_guard lock(mu_);
        finishing_ = true;
      }
      for (std::size_t i : missing) {
        ready_[i].store(true, std::memory_order_release);
        unused_[i] = 1;
        guarded("finish (a parameter never ready)", i, [&] { fill_unused(i); });
        complete(i, true);
      }
      {
        std::lock_guard lock(mu_);
        last_ready_ = last_hook;  // unused parameters filled in here are not backward's work
        launch_ready_buckets();
      }
    });
    const auto wait_for = opts_.timeout.count() > 0 ? opts_.timeout : pg_.timeout();
    const auto until = clock::now() + wait_for + std::chrono::seconds(2);
    for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
      try {
        requests_[b].wait(until);
      } catch (const error& e) {
        // The reducer already told the peers (its transport failed on every rank): record the
        // failure here without blaming this rank.
        if (e.rank() >= 0) {
          record_failure("finish", -1, false);
          throw;
        }
        // A request that timed out knows no rank; say which rank and bucket waited.
        guarded("finish", -1, [&] {
          detail::raise(e.condition(), pg_.rank(),
                        "bucket " + std::to_string(b) + " was not reduced within " +
                            std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(wait_for).count()) +
                            " ms (a peer stopped answering?)",
                        static_cast<int>(b));
        }, false);
      } catch (...) {
        record_failure("finish", -1, false);
        throw;
      }
      reduced_at_[b] = requests_[b].valid() ? requests_[b].finished_at() : launched_at_[b];
      if (!opts_.gradient_as_bucket_view) {
        // Copy back bucket by bucket: later buckets keep reducing meanwhile.
        for (const auto& e : plan_.buckets[b].entries)
          guarded("finish (copying the average back)", e.param, [&] {
            copy_bytes(views_[e.param].grad, slot(e.param), views_[e.param].bytes());
          });
      }
    }
    const auto t_end = clock::now();
    fill_times(st, t_call, t_end);
    st.bytes_reduced = bytes_launched_;
    st.launched_before_finish = launched_before_finish_;
    for (std::size_t i = 0; i < views_.size(); ++i) st.unused += unused_[i];
    st.buckets.resize(plan_.buckets.size());
    for (std::size_t b = 0; b < plan_.buckets.size(); ++b) {
      auto& bt = st.buckets[b];
      bt.bytes = plan_.buckets[b].bytes;
      bt.parameters = plan_.buckets[b].entries.size();
      bt.ready_ms = ms(ready_at_[b] - step_start_);
      bt.launch_ms = ms(launched_at_[b] - step_start_);
      bt.reduced_ms = ms(reduced_at_[b] - step_start_);
    }
    last_stats_ = std::move(st);
    // The accumulated gradients are in this step's average now.
    std::fill(accumulated_.begin(), accumulated_.end(), 0);
    if (!settled_) guarded("the bucket rebuild in finish", -1, [&] { rebuild_from_order(); });
    reset_step();
    ++step_;
  }

  /// Starts a gradient-accumulation scope: steps that begin while the guard lives do no
  /// communication (call `grad_ready`/`finish` as usual; they are cheap). Throws `errc::usage`
  /// in the middle of a step.
  /// \code
  /// { auto guard = dp.no_sync(); micro_step(0); dp.finish(); }  // accumulates locally
  /// micro_step(1); dp.finish();                                // averages both micro-steps
  /// \endcode
  no_sync_guard no_sync() {
    check_healthy();
    if (step_open_)
      detail::raise(errc::usage, pg_.rank(), "no_sync() in the middle of a step; call it before the first grad_ready");
    return no_sync_guard(*this);
  }

  // ---- accessors ----------------------------------------------------------------------------

  /// Where the engine must write gradient `i` in view mode (in copy mode: where ddp stages it).
  /// In view mode the address never changes: the layout is fixed at construction, so an engine
  /// may take the pointer once and keep it. In copy mode the staging slot moves once, when the
  /// plan is rebuilt from the observed ready order after the first synchronized step
  /// (`generation()` changes then); a copy-mode engine has no reason to keep it.
  /// \code
  /// float* g = static_cast<float*>(dp.bucket_grad(i));  // view mode: backward writes here, every step
  /// \endcode
  void* bucket_grad(std::size_t i) {
    check_healthy();
    check_index(i, "bucket_grad");
    return slot(i);
  }

  /// The parameters as ddp sees them; in view mode each `grad` points into bucket memory (as
  /// stable as `bucket_grad(i)`).
  std::vector<tensor_view> views() const {
    check_healthy();
    std::vector<tensor_view> out = views_;
    if (opts_.gradient_as_bucket_view)
      for (std::size_t i = 0; i < out.size(); ++i) out[i].grad = slot(i);
    return out;
  }

  /// Bumped when the bucket layout changes: once in copy mode, when the plan is rebuilt from the
  /// observed ready order; never in view mode, whose layout is fixed at construction (so that
  /// the bucket memory handed to the engine never moves).
  std::uint64_t generation() const noexcept { return generation_; }
  /// Statistics of the step the last `finish()` ended.
  const step_stats& last_step_stats() const noexcept { return last_stats_; }
  /// Number of `finish()` calls so far.
  std::uint64_t steps() const noexcept { return step_; }
  const bucket_plan& plan() const noexcept { return plan_; }
  const bucket_policy& policy() const noexcept { return policy_; }
  const dp_options& options() const noexcept { return opts_; }
  std::size_t size() const noexcept { return views_.size(); }
  int rank() const noexcept { return pg_.rank(); }
  int world_size() const noexcept { return pg_.size(); }
  Reducer& get_reducer() noexcept { return red_; }
  Allocator& get_allocator() noexcept { return alloc_; }
  process_group& group() noexcept { return pg_; }

 private:
  using clock = std::chrono::steady_clock;
  static double ms(clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

  std::string label(std::size_t i) const {
    std::string s = "parameter " + std::to_string(i);
    if (i < names_.size() && !names_[i].empty()) s += " ('" + names_[i] + "')";
    return s;
  }

  void check_healthy() const {
    owner_.check(pg_.rank(), "data_parallel wrapper");
    if (!failed_.load(std::memory_order_acquire)) return;
    std::lock_guard lock(fail_mu_);
    detail::raise(fail_code_, pg_.rank(),
                  "this data_parallel wrapper failed earlier and cannot be used again; the first cause: " + fail_what_);
  }

  // Runs the part of a call that changes step state. An exception from it leaves the step half
  // done (a parameter claimed whose bucket can then never launch, a bucket counted but not
  // launched, a gradient not copied back), which no later call could repair: the wrapper fails
  // for good, and the peers are told (tell_peers) so that they do not wait for this rank.
  template <class F>
  void guarded(const char* what, std::ptrdiff_t param, F&& body, bool tell_peers = true) {
    try {
      body();
    } catch (...) {
      record_failure(what, param, tell_peers);
      throw;
    }
  }

  // Called inside a catch block: keeps the first failure's cause (later calls name it) and, for
  // a cause on this rank, aborts the reducer and the group with that cause, so that peers
  // blocked on this rank fail now (errc::aborted naming this rank) instead of at their deadline.
  void record_failure(const char* what, std::ptrdiff_t param, bool tell_peers) noexcept {
    try {
      errc code = errc::aborted;
      std::string cause;
      try {
        throw;
      } catch (const error& e) {
        code = e.condition();
        cause = detail::message_of(e);  // without its "[ddp.x] rank N:" prefix: ours comes later
        // A lost peer, a timeout or an abort is a verdict about the group that its failure
        // machinery has already posted; blaming this rank for it would hide the true cause.
        if (code == errc::peer_lost || code == errc::timeout || code == errc::aborted) tell_peers = false;
      } catch (const std::exception& e) {
        cause = e.what();
      } catch (...) {
        cause = "an exception of unknown type";
      }
      std::string where = what;
      if (param >= 0) where += " for " + label(static_cast<std::size_t>(param));
      const std::string msg = "data_parallel failed in " + where + " at step " + std::to_string(step_) + ": " + cause;
      {
        std::lock_guard lock(fail_mu_);
        if (failed_.load(std::memory_order_relaxed)) return;  // keep the first cause
        fail_code_ = code;
        fail_what_ = msg;
        failed_.store(true, std::memory_order_release);
      }
      if (tell_peers) tell_peers_failed(msg);
    } catch (...) {
      failed_.store(true, std::memory_order_release);  // out of memory for the message: still failed
    }
  }

  void tell_peers_failed(const std::string& msg) noexcept {
    // A transport that can carry a reason (tcp) gives the peers the cause itself.
    if constexpr (requires(Reducer& r) { r.transport().fail(errc::aborted, msg); }) {
      try {
        red_.transport().fail(errc::aborted, msg);
      } catch (...) {
      }
    }
    if constexpr (requires(Reducer& r) { r.abort(); }) red_.abort();
    pg_.abort(msg);
  }

  // The bucket slot of a parameter that is not ready in a synchronized step: zero, or what
  // no_sync() steps accumulated (PyTorch DDP keeps an accumulated gradient the same way).
  void fill_unused(std::size_t i) {
    if (!accumulated_[i])
      zero_bytes(slot(i), views_[i].bytes());
    else if (!opts_.gradient_as_bucket_view)
      copy_bytes(slot(i), views_[i].grad, views_[i].bytes());
    // View mode: the slot already holds the accumulated gradient.
  }

  void check_index(std::size_t i, const char* what) const {
    owner_.check(pg_.rank(), "data_parallel wrapper");
    if (i >= views_.size())
      detail::raise(errc::invalid_argument, pg_.rank(),
                    std::string(what) + "(" + std::to_string(i) + "): there are only " +
                        std::to_string(views_.size()) + " parameters",
                    -1, static_cast<int>(i));
  }

  void claim(std::size_t i, const char* what) {
    check_healthy();
    if (ready_[i].exchange(true, std::memory_order_acq_rel))
      detail::raise(errc::usage, pg_.rank(),
                    std::string(what) + ": " + label(i) + " was already " +
                        (unused_[i] ? "marked unused" : "ready") + " in this step (step " + std::to_string(step_) +
                        "); call finish() between steps",
                    static_cast<int>(plan_.where[i].first), static_cast<int>(i));
  }

  // Opens the step on its first hook; a step keeps the synchronization mode it started with.
  bool open_step() {
    std::lock_guard lock(mu_);
    if (!step_open_) {
      step_open_ = true;
      step_sync_ = no_sync_depth_ == 0;
      step_start_ = clock::now();
    }
    return step_sync_;
  }

  void complete(std::size_t i, bool sync) {
    const auto t = clock::now();
    std::lock_guard lock(mu_);
    last_ready_ = t;
    if (!settled_) order_.push_back(i);
    if (!sync) return;
    const std::size_t b = plan_.where[i].first;
    if (--pending_[b] == 0) {
      ready_at_[b] = t;
      launch_ready_buckets();
    }
  }

  // Caller holds mu_. Launching strictly in plan order is what keeps ranks' collectives aligned.
  void launch_ready_buckets() {
    while (next_launch_ < plan_.buckets.size() && pending_[next_launch_] == 0) {
      const std::size_t b = next_launch_;
      const auto& bk = plan_.buckets[b];
      launched_at_[b] = clock::now();  // before the call: the reducer may finish before it returns
      if (bk.numel > 0)
        requests_[b] = red_.allreduce_async(buffers_[b], bk.numel, bk.type, opts_.average ? op::avg : op::sum);
      bytes_launched_ += bk.bytes;
      if (!finishing_) ++launched_before_finish_;
      ++next_launch_;
    }
  }

  void fill_times(step_stats& st, clock::time_point t_call, clock::time_point t_end) const {
    st.backward_ms = ms(last_ready_ - step_start_);
    st.exposed_ms = ms(t_end - std::max(last_ready_, step_start_));
    st.finish_ms = ms(t_end - t_call);
  }

  void reset_step() {
    for (std::size_t i = 0; i < views_.size(); ++i) ready_[i].store(false, std::memory_order_relaxed);
    std::fill(unused_.begin(), unused_.end(), 0);
    const std::size_t nb = plan_.buckets.size();
    pending_.resize(nb);
    for (std::size_t b = 0; b < nb; ++b) pending_[b] = plan_.buckets[b].entries.size();
    requests_.assign(nb, request{});
    ready_at_.assign(nb, clock::time_point{});
    launched_at_.assign(nb, clock::time_point{});
    reduced_at_.assign(nb, clock::time_point{});
    next_launch_ = 0;
    bytes_launched_ = 0;
    launched_before_finish_ = 0;
    finishing_ = false;
    step_open_ = false;
    if (!settled_) order_.clear();
  }

  void* slot(std::size_t i) const {
    const auto [b, e] = plan_.where[i];
    const auto& bk = plan_.buckets[b];
    return static_cast<std::byte*>(buffers_[b]) + bk.entries[e].offset_elems * dtype_size(bk.type);
  }

  // ---- memory -------------------------------------------------------------------------------

  void check_copyable() const {
    constexpr bool custom_copy = requires(Allocator& a, void* d, const void* s, std::size_t n) { a.copy(d, s, n); };
    if constexpr (!custom_copy) {
      if (!host_accessible(alloc_.location()))
        detail::raise(errc::unsupported, pg_.rank(),
                      std::string("bucket memory of kind '") + memory_kind_name(alloc_.location()) +
                          "' needs an allocator with copy(dst, src, bytes)");
      for (std::size_t i = 0; i < views_.size(); ++i)
        if (views_[i].device >= 0)
          detail::raise(errc::unsupported, pg_.rank(),
                        label(i) + " lives on device " + std::to_string(views_[i].device) +
                            " but the allocator policy cannot copy device memory (use cuda_allocator)",
                        -1, static_cast<int>(i));
    }
  }

  void copy_bytes(void* dst, const void* src, std::size_t n) {
    if (n == 0 || dst == src) return;
    if constexpr (requires(Allocator& a) { a.copy(dst, src, n); })
      alloc_.copy(dst, src, n);
    else
      detail::copy_bytes(dst, src, n);
  }

  void zero_bytes(void* dst, std::size_t n) {
    if (n == 0) return;
    if constexpr (requires(Allocator& a) { a.zero(dst, n); })
      alloc_.zero(dst, n);
    else
      std::memset(dst, 0, n);
  }

  // Allocates the buckets (and in view mode fills them with the engine's gradients), then tells
  // every rank whether every other rank managed: a rank whose buckets do not fit (a full
  // /dev/shm, device memory) fails here, and so do its peers, naming it, instead of learning
  // of it at their first step.
  void set_up_buffers() {
    std::exception_ptr mine;
    process_group::failure status;  // empty when fine
    try {
      allocate_buffers();
      if (opts_.gradient_as_bucket_view) {
        // The engine's current gradients become the bucket contents, so an engine that
        // switches to bucket_grad(i) keeps what it had accumulated.
        for (std::size_t i = 0; i < views_.size(); ++i) copy_bytes(slot(i), views_[i].grad, views_[i].bytes());
      }
    } catch (const error& e) {
      mine = std::current_exception();
      status = {e.condition(), detail::message_of(e)};
    } catch (const std::exception& e) {
      mine = std::current_exception();
      status = {errc::system, e.what()};
    }
    if (mine) free_buffers(buffers_, plan_);
    if (pg_.size() == 1) {
      if (mine) std::rethrow_exception(mine);
      return;
    }
    const auto all = pg_.all_gather(status.empty() ? std::string() : status.encode());
    if (mine) std::rethrow_exception(mine);  // this rank's own cause, as it was raised
    for (std::size_t r = 0; r < all.size(); ++r) {
      if (all[r].empty()) continue;
      free_buffers(buffers_, plan_);
      const auto theirs = process_group::failure::decode(all[r]);
      detail::raise(theirs.code, pg_.rank(),
                    "rank " + std::to_string(r) + " could not set up its gradient buckets: " + theirs.text);
    }
  }

  void allocate_buffers() {
    buffers_ = allocate_for(plan_);
  }

  std::vector<void*> allocate_for(const bucket_plan& plan) {
    std::vector<void*> out;
    out.reserve(plan.buckets.size());
    try {
      for (const auto& bk : plan.buckets) out.push_back(alloc_.allocate(bk.bytes));
    } catch (...) {
      for (std::size_t b = 0; b < out.size(); ++b) alloc_.deallocate(out[b], plan.buckets[b].bytes);
      throw;
    }
    return out;
  }

  void free_buffers(std::vector<void*>& bufs, const bucket_plan& plan) noexcept {
    for (std::size_t b = 0; b < bufs.size(); ++b) alloc_.deallocate(bufs[b], plan.buckets[b].bytes);
    bufs.clear();
  }

  // True when no collective can still touch bucket memory.
  bool drain() noexcept {
    const auto wait_all = [this](clock::time_point until) {
      bool all = true;
      for (auto& r : requests_) {
        if (!r.valid()) continue;
        try {
          r.wait(until);
        } catch (...) {
        }
        all = all && r.test();
      }
      return all;
    };
    bool pending = false;
    for (auto& r : requests_) pending = pending || (r.valid() && !r.test());
    if (!pending) return true;
    try {
      if (wait_all(clock::now() + pg_.timeout())) return true;
      if constexpr (requires(Reducer& r) { r.abort(); }) red_.abort();
      return wait_all(clock::now() + std::chrono::seconds(2));
    } catch (...) {
      return false;
    }
  }

  // ---- agreement across ranks -----------------------------------------------------------------

  // One record per parameter: dtype, host-or-device, shape. Device indices may differ per rank.
  struct signature {
    std::uint8_t type = 0;
    std::uint8_t on_device = 0;
    std::vector<std::int64_t> shape;
    bool operator==(const signature&) const = default;
  };

  static void put_u64(std::string& s, std::uint64_t v) {
    for (int k = 0; k < 8; ++k) s.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
  }
  static std::uint64_t get_u64(const std::string& s, std::size_t& pos) {
    if (pos + 8 > s.size()) detail::raise(errc::protocol, -1, "truncated parameter signature");
    std::uint64_t v = 0;
    for (int k = 0; k < 8; ++k) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(s[pos + k])) << (8 * k);
    pos += 8;
    return v;
  }

  std::string encode_signatures() const {
    std::string s;
    put_u64(s, views_.size());
    for (const auto& v : views_) {
      put_u64(s, static_cast<std::uint64_t>(v.type) | (v.device >= 0 ? 0x100u : 0u));
      put_u64(s, v.shape.size());
      for (auto d : v.shape) put_u64(s, static_cast<std::uint64_t>(d));
    }
    return s;
  }

  static std::vector<signature> decode_signatures(const std::string& s) {
    std::size_t pos = 0;
    const std::uint64_t n = get_u64(s, pos);
    if (n > s.size()) detail::raise(errc::protocol, -1, "malformed parameter signature");
    std::vector<signature> out(n);
    for (auto& sig : out) {
      const std::uint64_t td = get_u64(s, pos);
      sig.type = static_cast<std::uint8_t>(td & 0xff);
      sig.on_device = static_cast<std::uint8_t>(td >> 8);
      const std::uint64_t nd = get_u64(s, pos);
      if (nd > s.size()) detail::raise(errc::protocol, -1, "malformed parameter signature");
      for (std::uint64_t k = 0; k < nd; ++k) sig.shape.push_back(static_cast<std::int64_t>(get_u64(s, pos)));
    }
    return out;
  }

  static std::string describe(const signature& s) {
    std::string d = dtype_name(static_cast<dtype>(s.type));
    d += s.on_device ? "@device[" : "[";
    for (std::size_t k = 0; k < s.shape.size(); ++k) d += (k ? ", " : "") + std::to_string(s.shape[k]);
    return d + "]";
  }

  // Every rank sees every rank's signatures, so every rank raises the same error.
  void check_signatures() {
    const auto all = pg_.all_gather(encode_signatures());
    if (std::all_of(all.begin(), all.end(), [&](const std::string& s) { return s == all[0]; })) return;
    std::vector<std::vector<signature>> sigs;
    for (const auto& s : all) sigs.push_back(decode_signatures(s));
    std::size_t common = sigs[0].size();
    for (const auto& s : sigs) common = std::min(common, s.size());
    for (std::size_t i = 0; i < common; ++i) {
      std::string differing;
      for (std::size_t r = 1; r < sigs.size(); ++r)
        if (!(sigs[r][i] == sigs[0][i]))
          differing += (differing.empty() ? "" : ", ") + ("rank " + std::to_string(r) + " has " + describe(sigs[r][i]));
      if (!differing.empty())
        detail::raise(errc::mismatch, pg_.rank(),
                      "ranks disagree on " + label(i) + ": rank 0 has " + describe(sigs[0][i]) + ", " + differing,
                      -1, static_cast<int>(i));
    }
    std::string counts;
    for (std::size_t r = 0; r < sigs.size(); ++r)
      if (sigs[r].size() != sigs[0].size() || r == 0)
        counts += (counts.empty() ? "" : ", ") + ("rank " + std::to_string(r) + " has " + std::to_string(sigs[r].size()));
    detail::raise(errc::mismatch, pg_.rank(),
                  "ranks disagree on the number of parameters: " + counts + "; the first differing is " +
                      label(common),
                  -1, static_cast<int>(common));
  }

  // Ranks agree on the plan and on whether it will be rebuilt (a collective of the group that
  // a rank skipping it would leave its peers waiting on).
  void check_plan_agreement(const char* when) {
    std::string mine;
    put_u64(mine, plan_.fingerprint());
    put_u64(mine, settled_ ? 1 : 0);
    const auto all = pg_.all_gather(mine);
    std::string plans, rebuilds;
    for (std::size_t r = 1; r < all.size(); ++r) {
      if (all[r].compare(0, 8, all[0], 0, 8) != 0) plans += (plans.empty() ? "rank " : ", rank ") + std::to_string(r);
      else if (all[r] != all[0]) rebuilds += (rebuilds.empty() ? "rank " : ", rank ") + std::to_string(r);
    }
    if (!plans.empty())
      detail::raise(errc::mismatch, pg_.rank(),
                    std::string("bucket plans differ ") + when + " between rank 0 and " + plans +
                        " (different bucket_policy or planner on those ranks?)");
    if (!rebuilds.empty()) {
      const bool rank0_rebuilds = all[0][8] == 0;
      detail::raise(errc::mismatch, pg_.rank(),
                    std::string("ranks disagree ") + when + " on rebuilding the bucket plan after the first step: rank 0 " +
                        (rank0_rebuilds ? "does, " : "does not, ") + rebuilds + (rank0_rebuilds ? " do not" : " do") +
                        " (bucket_policy::rebuild_from_ready_order or dp_options::gradient_as_bucket_view differ)");
    }
  }

  void broadcast_parameters() {
    std::vector<request> reqs;
    reqs.reserve(views_.size());
    for (auto& v : views_)
      if (v.numel > 0) reqs.push_back(red_.broadcast_async(v.data, v.numel, v.type, 0));
    const auto until = clock::now() + 2 * pg_.timeout() + std::chrono::seconds(2);
    for (auto& r : reqs) r.wait(until);
  }

  // Re-plan once from rank 0's observed ready order so that buckets fill in the order backward
  // really produces gradients. Runs inside finish(), when no collective is in flight, and only
  // in copy mode: bucket slots then hold nothing between steps (each step fills them first),
  // and no pointer into them was handed out to keep.
  void rebuild_from_order() {
    settled_ = true;
    const std::size_t n = views_.size();
    std::vector<std::uint64_t> order(n);
    if (order_.size() != n) return;  // cannot happen: every parameter was ready or unused
    for (std::size_t k = 0; k < n; ++k) order[k] = order_[k];
    pg_.broadcast(std::span<std::uint64_t>(order), 0);
    std::vector<std::size_t> walk(order.begin(), order.end());
    bucket_plan fresh = planner_.plan(infos_, policy_, walk);
    if (fresh == plan_) {
      check_plan_agreement("after the rebuild");
      return;
    }
    // Free first: an arena sized for one plan (shm) still fits the other.
    free_buffers(buffers_, plan_);
    plan_ = std::move(fresh);
    buffers_ = allocate_for(plan_);
    ++generation_;
    check_plan_agreement("after the rebuild");
  }

  process_group pg_;  // the wrapper's own handle: the group stays open while this lives
  detail::owner_process owner_;
  bucket_policy policy_;
  dp_options opts_;
  std::vector<tensor_view> views_;
  std::vector<std::string> names_;
  std::vector<param_info> infos_;
  Reducer red_;
  Allocator alloc_;
  Planner planner_{};
  bucket_plan plan_;
  std::vector<void*> buffers_;

  // Step state. ready_ is per parameter and atomic so that concurrent hooks detect duplicates
  // without the lock; the rest is guarded by mu_.
  std::mutex mu_;
  std::unique_ptr<std::atomic<bool>[]> ready_;
  std::vector<std::uint8_t> unused_;
  std::vector<std::size_t> pending_;
  std::vector<request> requests_;
  std::vector<clock::time_point> ready_at_, launched_at_, reduced_at_;
  std::vector<std::size_t> order_;
  std::size_t next_launch_ = 0;
  std::size_t bytes_launched_ = 0;
  std::size_t launched_before_finish_ = 0;
  clock::time_point step_start_{}, last_ready_{};
  bool step_open_ = false;
  bool step_sync_ = true;
  bool finishing_ = false;
  bool settled_ = true;  // the bucket layout can no longer change (view mode, or after the rebuild)
  int no_sync_depth_ = 0;
  std::uint64_t step_ = 0;
  std::uint64_t generation_ = 0;
  step_stats last_stats_;
  // Parameters made ready in no_sync() steps since the last synchronized step: their
  // accumulated gradient counts even when they are not ready in the synchronized step.
  std::vector<std::uint8_t> accumulated_;
  // The first failure: every later call raises it (record_failure).
  std::atomic<bool> failed_{false};
  mutable std::mutex fail_mu_;
  errc fail_code_ = errc::aborted;
  std::string fail_what_;
};

/// The default wrapper: greedy size planner, ring allreduce over TCP, aligned host buckets.
/// \code
/// ddp::data_parallel dp{pg, params};
/// \endcode
using data_parallel = basic_data_parallel<>;

}  // namespace v0
}  // namespace ddp
