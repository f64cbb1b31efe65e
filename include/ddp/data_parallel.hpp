#pragma once
/// \file data_parallel.hpp
/// `ddp::basic_data_parallel<Planner, Reducer, Allocator>` and `ddp::data_parallel`: the engine
/// calls `grad_ready(i)` as each gradient is produced during backward, then `finish()`; then
/// every gradient holds the average over all ranks, and early buckets were reduced while
/// backward was still running. The parts it is built from live in `ddp/data_parallel/`.
/// See docs/data-parallel.md.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/fwd.hpp>
#include <ddp/concepts.hpp>
#include <ddp/data_parallel/agreement.hpp>
#include <ddp/data_parallel/autotune.hpp>
#include <ddp/data_parallel/bucket_memory.hpp>
#include <ddp/data_parallel/bucket_state.hpp>
#include <ddp/data_parallel/buffers.hpp>
#include <ddp/data_parallel/detail/failure_latch.hpp>
#include <ddp/data_parallel/detail/parameters.hpp>
#include <ddp/data_parallel/detail/uneven.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/data_parallel/timeline.hpp>
#include <ddp/detail/flight_recorder.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/memory/auto_allocator.hpp>
#include <ddp/planner/size_planner.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/auto.hpp>

namespace ddp {
inline namespace v0 {

/// The data-parallel wrapper: one flat buffer per bucket from `Allocator`, one collective per
/// bucket through `Reducer`, buckets chosen by `Planner`. It joins three parts, each tested on
/// its own: `agreement` (what ranks must agree on), `bucket_memory` (the buffers) and
/// `bucket_state` (pending counts, in-order launch). Construction is collective (every rank
/// constructs its wrappers in the same order). A step is the `grad_ready`/`mark_unused` calls
/// of one backward followed by `finish()`; buckets launch in plan order on every rank, whatever
/// order gradients arrive in. `grad_ready` and `mark_unused` may run on several threads at once
/// (for different parameters); `finish()`, `no_sync()` and the accessors must not overlap them.
/// \code
/// ddp::basic_data_parallel<ddp::size_planner, ddp::tree<ddp::tcp>> dp{pg, params};
/// for (std::size_t i = params.size(); i-- > 0;) dp.grad_ready(i);
/// dp.finish();
/// \endcode
/// The defaults (`size_planner`, `auto_reducer`, `auto_allocator`) are given once, in fwd.hpp.
template <class Planner, class Reducer, class Allocator>
class basic_data_parallel {
  static_assert(bucket_planner<Planner>, "ddp: Planner must satisfy ddp::bucket_planner (concepts.hpp)");
  static_assert(reducer<Reducer>, "ddp: Reducer must satisfy ddp::reducer (concepts.hpp)");
  static_assert(device_allocator<Allocator>, "ddp: Allocator must satisfy ddp::device_allocator (concepts.hpp)");
  static_assert(!has_abort<Reducer> || reducer_with_abort<Reducer>,
                "ddp: Reducer::abort() must be noexcept (ddp::reducer_with_abort): the wrapper calls it on "
                "paths that must not throw");

 public:
  using planner_type = Planner;
  using reducer_type = Reducer;
  using allocator_type = Allocator;

  /// RAII scope of gradient accumulation: steps that *start* while a guard lives do no
  /// communication; the engine keeps accumulating into its gradients as it would alone, and the
  /// next synchronized step averages the accumulated sums.
  using no_sync_guard = detail::depth_guard;

  /// Wraps `params` (any `ddp::parameter_set`): checks that ranks agree on the parameters
  /// (count, shapes, dtypes), copies rank 0's values everywhere, plans and allocates the buckets.
  /// `reducer_args` go to `Reducer{pg, reducer_args...}`. Throws `ddp::error`: mismatch (naming
  /// the first differing parameter and the ranks), unsupported (memory the allocator cannot
  /// copy), and whatever the reducer or the group throw (timeout, peer_lost).
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
        buffers_(to_buffer_views(params)),
        names_(detail::own_names(views_)),
        infos_(detail::infos_of(views_)),
        red_(pg, std::forward<ReducerArgs>(reducer_args)...),
        agree_(agreement_channel{pg_.rank(), pg_.size(), [this](const std::string& s) { return pg_.all_gather(s); },
                                 [this](std::span<std::uint64_t> w, int root) { pg_.broadcast(w, root); }}),
        memory_(allocator_for<Allocator>(red_)),
        state_(
            views_.size(), [this](std::size_t b) { launch(b); },
            opts.uneven_inputs ? bucket_state::open_fn([this] { issue_count(1); }) : bucket_state::open_fn{}) {
    memory_.check_reachable(views_, pg_.rank());
    memory_.check_reachable(std::span<const buffer_view>(buffers_.buffers()), pg_.rank());
    agree_.check_signatures(views_);
    agree_.check_buffer_signatures(buffers_.buffers());
    agree_.check_same("dp_options::uneven_inputs", opts_.uneven_inputs ? 1 : 0);
    agree_.check_same("dp_options::find_unused_parameters", opts_.find_unused_parameters ? 1 : 0);
    agree_.check_same("dp_options::buffers (0 broadcast, 1 average, 2 none)",
                      static_cast<std::uint64_t>(opts_.buffers));
    agree_.check_same("dp_options::divide_by (0 world_size, 1 contributors)",
                      static_cast<std::uint64_t>(opts_.divide_by));
    set_up_autotune();
    if (opts_.broadcast_parameters && pg.size() > 1) {
      agreement::broadcast_values(red_, std::span<const tensor_view>(views_), pg_.timeout());
      agreement::broadcast_values(red_, std::span<const buffer_view>(buffers_.buffers()), pg_.timeout());
    }
    // View mode hands bucket memory to the engine, which keeps the pointers: that layout must
    // never move, so it is final from the start (docs/data-parallel.md, "View mode"). With
    // uneven inputs a rank may join before it ever ran a step, and rank 0 may be that rank:
    // there is no step every rank has seen to rebuild from ("Uneven inputs").
    settled_ = opts_.gradient_as_bucket_view || !policy_.rebuild_from_ready_order || opts_.uneven_inputs;
    bucket_plan plan = planner_.plan(infos_, policy_, {});
    agree_.check_plan(plan, settled_, "at construction");
    set_up_buffers(std::move(plan));
    reset_step();
  }

  basic_data_parallel(const basic_data_parallel&) = delete;
  basic_data_parallel& operator=(const basic_data_parallel&) = delete;

  /// Waits (bounded) for collectives a failed step left in flight, then frees the buckets. In a
  /// forked child it waits for nothing and aborts nothing (the collectives are the parent's).
  ~basic_data_parallel() {
    if (owner_.forked()) {
      // The child frees its copy of host memory; CUDA memory is the parent's driver's.
      const auto where = memory_.allocator().location();
      if (where != memory_kind::host && where != memory_kind::shared) memory_.leak();
      return;
    }
    // A collective that does not end may still write into a bucket: leaking it is the safe choice.
    if (!memory_.drain(pg_.timeout(), [this] { abort_reducer(); })) memory_.leak();
  }

  /// Gradient `i` is complete for this step: copied into its bucket now (copy mode) or already
  /// at `bucket_grad(i)` (view mode); a complete bucket launches after every earlier one.
  /// Throws `errc::invalid_argument` (index out of range), `errc::usage` (already ready or
  /// unused this step). Any other exception fails the wrapper for good (every later call raises
  /// naming this first cause) and tells the peers, whose `finish()` then fails naming this rank.
  /// \code
  /// engine.backward([&](std::size_t i) { dp.grad_ready(i); });
  /// \endcode
  void grad_ready(std::size_t i) {
    claim(i, "grad_ready");
    guarded("grad_ready", i, [&] {
      const bool sync = state_.open(no_sync_depth_ == 0);
      if (!sync) state_.set_accumulated(i);
      if (sync && !opts_.gradient_as_bucket_view) memory_.copy_in(i, views_[i].grad, views_[i].bytes());
      state_.complete(i, sync);
    });
  }

  /// Parameter `i` produced no gradient in this step: a zero gradient, or what `no_sync()` steps
  /// accumulated for it since the last synchronized step (as in PyTorch DDP). Errors as `grad_ready`.
  /// \code
  /// if (!used_expert[e]) dp.mark_unused(expert_param[e]);
  /// \endcode
  void mark_unused(std::size_t i) {
    claim(i, "mark_unused");
    guarded("mark_unused", i, [&] {
      const bool sync = state_.open(no_sync_depth_ == 0);
      state_.set_unused(i);
      if (sync) fill_unused(i);
      state_.complete(i, sync);
    });
  }

  /// Ends the step: launches the remaining buckets in order, waits for every reduction (bounded
  /// by the timeout), copies the averages back (copy mode) and resets; under `no_sync()` it only
  /// resets. Parameters never ready are an `errc::usage` error naming them, raised before any
  /// launch (unless `find_unused_parameters`); so is a second `finish()` with no hook since the
  /// previous one (and nothing `no_sync()` steps accumulated), whatever the options. Any failure
  /// inside (timeout, peer_lost, a copy, the rebuild) fails the wrapper for good, as in `grad_ready`.
  /// \code
  /// dp.finish();
  /// optimizer.step();
  /// \endcode
  void finish() {
    check_healthy();
    check_not_joining("finish()");
    if (state_.nothing_new(step_, no_sync_depth_ == 0))
      detail::raise_finish_twice(pg_.rank(), step_ - 1, opts_.find_unused_parameters);
    const auto t_call = steady_clock::now();
    bool sync = false;
    guarded("finish", -1, [&] { sync = state_.open(no_sync_depth_ == 0, t_call); });
    int contributors = 0;
    if (sync) {
      contributors = pg_.size();
      if (opts_.uneven_inputs) contributors = static_cast<int>(wait_count("finish"));
      const auto missing = state_.missing();
      if (!missing.empty() && !opts_.find_unused_parameters) detail::raise_missing(pg_.rank(), missing, names_);
      guarded("finish", -1, [&] {
        state_.begin_finish();
        for (std::size_t i : missing) {
          state_.claim(i);
          state_.set_unused(i);
          guarded("finish (a parameter never ready)", i, [&] { fill_unused(i); });
          state_.complete(i, true, false);  // not backward's work: the statistics ignore it
        }
        state_.launch_ready();
      });
      const auto& plan = memory_.plan();
      // Without the unused-parameter record, each bucket's hook runs as soon as its average is
      // in place, while later buckets still reduce; with it, once the record says which
      // parameters no rank used (docs/data-parallel.md, "Optimizer overlap").
      const bool hook_early = bucket_hook_ && !opts_.find_unused_parameters;
      for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
        wait_bucket(b);
        if (opts_.uneven_inputs) finish_uneven(b, contributors);
        if (!opts_.gradient_as_bucket_view)
          // Copy back bucket by bucket: later buckets keep reducing meanwhile.
          for (const auto& e : plan.buckets[b].entries)
            guarded("finish (copying the average back)", e.param,
                    [&] { memory_.copy_out(e.param, views_[e.param].grad, views_[e.param].bytes()); });
        if (hook_early) call_bucket_hook(b);
      }
      if (record_needed()) guarded("finish", -1, [&] { issue_record(false); });
      const int source = record_needed() ? wait_record("finish") : 0;
      if (opts_.find_unused_parameters && pg_.size() == 1) note_unused_alone();
      if (bucket_hook_ && !hook_early)
        for (std::size_t b = 0; b < plan.buckets.size(); ++b) call_bucket_hook(b);
      sync_buffer_values(source, step_buffer_mode(contributors), "finish (the buffers after the step)");
      state_.clear_accumulated();  // they are in this step's average now
    }
    if (timeline_) record_timeline(t_call);
    last_stats_ = state_.stats(step_, t_call, steady_clock::now());
    last_stats_.contributors = contributors;
    if (!settled_ && last_stats_.synchronized)
      guarded("the bucket rebuild in finish", -1, [&] { rebuild_from_order(); });
    autotune_after_step();
    reset_step();
    ++step_;
  }

  /// Starts a gradient-accumulation scope (`no_sync_guard`); `errc::usage` in the middle of a step.
  /// \code
  /// { auto guard = dp.no_sync(); micro_step(0); dp.finish(); }  // accumulates locally
  /// micro_step(1); dp.finish();                                // averages both micro-steps
  /// \endcode
  no_sync_guard no_sync() {
    check_healthy();
    check_not_joining("no_sync()");
    if (state_.is_open())
      detail::raise(errc::usage, pg_.rank(), "no_sync() in the middle of a step; call it before the first grad_ready");
    return no_sync_guard(no_sync_depth_);
  }

  /// This rank has no batch left in the epoch (`dp_options::uneven_inputs`): until every rank has
  /// joined, answers each synchronized step of the others with zero gradients, so that their
  /// collectives complete and their averages count only the ranks that contributed; returns
  /// when every rank has joined (all ranks leave together). The wrapper can then start the next
  /// epoch. Every wait is bounded by the timeout, including the one for the next step of the
  /// ranks still training (a `no_sync()` window longer than the timeout fails the joined ranks).
  /// In copy mode this rank's gradients are left as they were; in view mode they are bucket
  /// memory, which the answers are made in: they are zero when `join()` returns. Gradients that
  /// `no_sync()` steps accumulated and no synchronized step averaged are dropped.
  /// Throws `errc::usage` without the option, in the middle of a step, or while this rank's
  /// `join()` already runs; a failure inside (timeout, peer_lost) fails the wrapper for good.
  /// \code
  /// for (const auto& batch : my_shard) { train_step(batch); dp.finish(); }
  /// dp.join();  // the other ranks may still have batches
  /// \endcode
  void join() {
    check_healthy();
    if (!opts_.uneven_inputs)
      detail::raise(errc::usage, pg_.rank(),
                    "join() needs dp_options::uneven_inputs = true (on every rank) when the wrapper is built");
    if (state_.is_open())
      detail::raise(errc::usage, pg_.rank(),
                    "join() in the middle of a step (after grad_ready or mark_unused, before finish()); finish the "
                    "step first");
    if (joining_.exchange(true, std::memory_order_acq_rel))
      detail::raise(errc::usage, pg_.rank(), "join() while this rank's join() is already running");
    struct clear_on_exit {
      std::atomic<bool>& flag;
      ~clear_on_exit() { flag.store(false, std::memory_order_release); }
    } clear{joining_};
    state_.clear_accumulated();  // never averaged: dropped (documented)
    const auto& plan = memory_.plan();
    std::uint64_t answered = 0;  // steps of others answered in this join()
    for (;;) {
      guarded("join", -1, [&] { issue_count(0); });
      const std::int64_t count = wait_count("join");
      if (count > 0) {
        // One step of the ranks still training: every bucket, in plan order, zeros in.
        guarded("join", -1, [&] {
          for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
            memory_.zero_bucket(b);
            launch(b);
          }
        });
        for (std::size_t b = 0; b < plan.buckets.size(); ++b) wait_bucket(b, "join");
        // The step's buffers, from the highest rank still training (PyTorch's Join does the same).
        if (record_needed()) guarded("join", -1, [&] { issue_record(true); });
        const int source = record_needed() ? wait_record("join") : 0;
        sync_buffer_values(source, step_buffer_mode(static_cast<int>(count)), "join (the buffers after the step)");
        ++joined_steps_;
      }
      memory_.clear_requests();
      if (count == 0) break;  // every rank has joined, and all of them saw it in this round
      ++answered;
    }
    // Ranks that joined early took no optimizer steps since: the last rank to join holds the
    // model every rank continues from (PyTorch's Join ends the same way, _sync_final_model).
    if (pg_.size() > 1)
      guarded("join (the model of the last rank to join)", -1, [&] {
        const auto last =
            static_cast<int>(pg_.all_reduce(static_cast<std::int64_t>(answered == 0 ? pg_.rank() : -1), op::max));
        if (last < 0 || last >= pg_.size())
          detail::raise(errc::protocol, pg_.rank(),
                        "join(): no rank says it joined last (" + std::to_string(last) + ")");
        agreement::broadcast_values(plain_reducer(), std::span<const tensor_view>(views_), pg_.timeout(), last);
        agreement::broadcast_values(plain_reducer(), std::span<const buffer_view>(buffers_.buffers()), pg_.timeout(),
                                    last);
      });
    if (opts_.gradient_as_bucket_view)
      guarded("join", -1, [&] {
        for (std::size_t b = 0; b < plan.buckets.size(); ++b) memory_.zero_bucket(b);
      });
  }

  /// Steps of other ranks that this rank answered with zero gradients inside `join()`, summed
  /// over every `join()` so far.
  std::uint64_t joined_steps() const noexcept { return joined_steps_; }

  /// Where the engine must write gradient `i` in view mode (in copy mode: where ddp stages it).
  /// In view mode the address never changes; in copy mode it moves at the rebuild after the
  /// first synchronized step, and with `bucket_policy::autotune` at each cap the tuning tries
  /// and at its choice (`generation()` changes then).
  /// \code
  /// float* g = static_cast<float*>(dp.bucket_grad(i));  // view mode: backward writes here, every step
  /// \endcode
  void* bucket_grad(std::size_t i) {
    check_healthy();
    check_index(i, "bucket_grad");
    return memory_.slot(i);
  }

  /// The parameters as ddp sees them; in view mode each `grad` is `bucket_grad(i)`.
  std::vector<tensor_view> views() const {
    check_healthy();
    std::vector<tensor_view> out = views_;
    if (opts_.gradient_as_bucket_view)
      for (std::size_t i = 0; i < out.size(); ++i) out[i].grad = memory_.slot(i);
    return out;
  }

  /// Optimizer overlap: `fn` is called inside each synchronized `finish()` once per bucket, in plan
  /// order, as soon as that bucket's average is in the engine's gradients, while the later
  /// buckets still reduce, on the thread that calls `finish()` (LibTorch: the thread inside
  /// `loss.backward()`). An engine steps the bucket's parameters there, so the optimizer runs
  /// while communication goes on. With `find_unused_parameters` the calls come after the last
  /// bucket, once `unused_on_every_rank()` is known. An exception from `fn` fails the wrapper as
  /// any failure inside `finish()` does. Set it between steps; an empty function removes it.
  /// See docs/data-parallel.md, "Optimizer overlap".
  /// \code
  /// dp.on_bucket_reduced([&](const ddp::reduced_bucket& b) {
  ///   for (std::size_t i : b.parameters) sgd_step(i);  // the engine's own update of parameter i
  /// });
  /// \endcode
  void on_bucket_reduced(std::function<void(const reduced_bucket&)> fn) {
    check_healthy();
    if (state_.is_open())
      detail::raise(errc::usage, pg_.rank(), "on_bucket_reduced() in the middle of a step; set it between steps");
    bucket_hook_ = std::move(fn);
  }

  /// Copies rank 0's buffers (`buffer_kind::buffer`) to every rank now (`buffer_sync::average`:
  /// averages the floating-point ones); a collective, between steps. `finish()` already does this
  /// after each synchronized step as `dp_options::buffers` says; call it where a model's buffers
  /// change outside a step, e.g. after loading statistics on rank 0 only. Every rank calls it, and
  /// none while another is in `join()`. `errc::usage` inside a step.
  /// \code
  /// dp.sync_buffers();  // every rank now holds rank 0's BatchNorm statistics
  /// \endcode
  void sync_buffers(buffer_sync how = buffer_sync::broadcast) {
    check_healthy();
    check_not_joining("sync_buffers()");
    if (state_.is_open())
      detail::raise(errc::usage, pg_.rank(),
                    "sync_buffers() in the middle of a step; call it before the first grad_ready or after finish()");
    sync_buffer_values(0, how, "sync_buffers");
  }

  /// The buffers and frozen parameters the wrapper keeps alike (from `ddp::has_buffers`).
  const std::vector<buffer_view>& buffers() const noexcept { return buffers_.buffers(); }

  /// With `dp_options::find_unused_parameters`: true when no rank used parameter `i` in the last
  /// synchronized step (nor accumulated it in the `no_sync()` steps before it). Its gradient then
  /// holds zero; an engine that can tell the optimizer "no gradient" (LibTorch's undefined
  /// `grad()`, which the adapter leaves so) skips it, as PyTorch's DDP does. False without the option.
  bool unused_on_every_rank(std::size_t i) const {
    check_index(i, "unused_on_every_rank");
    return i < unused_everywhere_.size() && unused_everywhere_[i] != 0;
  }

  /// Bumped when the bucket layout changes: once in copy mode (the rebuild), plus once per
  /// layout the bucket-cap autotune moves to; never in view mode.
  std::uint64_t generation() const noexcept { return generation_; }
  /// What the bucket-cap autotune (`bucket_policy::autotune`) measured and chose; the same on
  /// every rank. `enabled` is false without the option, `done` false while it still tunes.
  /// \code
  /// if (dp.autotune_report().done) std::printf("cap %zu\n", dp.autotune_report().chosen_cap_bytes);
  /// \endcode
  const ddp::autotune_report& autotune_report() const noexcept {
    static const ddp::autotune_report off{};
    return tuner_ ? tuner_->report() : off;
  }
  /// Statistics of the step the last `finish()` ended.
  const step_stats& last_step_stats() const noexcept { return last_stats_; }
  /// Number of `finish()` calls so far.
  std::uint64_t steps() const noexcept { return step_; }
  const bucket_plan& plan() const noexcept { return memory_.plan(); }
  const bucket_policy& policy() const noexcept { return policy_; }
  const dp_options& options() const noexcept { return opts_; }
  std::size_t size() const noexcept { return views_.size(); }
  int rank() const noexcept { return pg_.rank(); }
  int world_size() const noexcept { return pg_.size(); }
  Reducer& get_reducer() noexcept { return red_; }
  Allocator& get_allocator() noexcept { return memory_.allocator(); }
  /// The timeline this wrapper records into (`DDP_TIMELINE`, `dp_options::timeline`), or nullptr.
  const timeline* get_timeline() const noexcept { return timeline_.get(); }
  process_group& group() noexcept { return pg_; }

 private:
  void check_healthy() const {
    owner_.check(pg_.rank(), "data_parallel wrapper");
    failure_.check(pg_.rank());
  }

  // join() blocks its caller until every rank has joined: another thread's step meanwhile
  // would be collectives the peers never match.
  void check_not_joining(const char* what) const {
    if (joining_.load(std::memory_order_acquire))
      detail::raise(errc::usage, pg_.rank(),
                    std::string(what) +
                        " while this rank's join() is running (join() returns once every rank "
                        "has joined; the next epoch's steps may start then)");
  }

  void check_index(std::size_t i, const char* what) const {
    owner_.check(pg_.rank(), "data_parallel wrapper");
    if (i >= views_.size()) detail::raise_bad_index(pg_.rank(), what, i, views_.size());
  }

  void claim(std::size_t i, const char* what) {
    check_index(i, what);
    failure_.check(pg_.rank());
    check_not_joining(what);
    if (!state_.claim(i))
      detail::raise_already(pg_.rank(), what, i, names_[i], state_.unused(i), step_, plan().where[i].first);
  }

  // Runs the part of a call that changes step state. An exception from it leaves the step half
  // done, which no later call could repair: the wrapper fails for good, and for a cause on this
  // rank (tell_peers) the reducer's transport and the group fail with it, so that peers blocked
  // on this rank fail now, naming it, not at a deadline.
  template <class F>
  void guarded(const char* what, std::ptrdiff_t param, F&& body, bool tell_peers = true) {
    const auto i = static_cast<std::size_t>(param);
    failure_.guard(what, param, param >= 0 && i < names_.size() ? std::string_view(names_[i]) : "", step_, tell_peers,
                   body, [this](const std::string& msg) noexcept {
                     if constexpr (reducer_with_failable_transport<Reducer>)
                       detail::exception_of([&] { red_.transport().fail(errc::aborted, msg); });  // tcp: to the peers
                     abort_reducer();
                     pg_.abort(msg);
                   });
  }

  void abort_reducer() noexcept {
    if constexpr (reducer_with_abort<Reducer>) red_.abort();
  }

  // Waits (bounded by the timeout) for bucket b's reduction. A failed collective is a verdict
  // the reducer already posted to every rank: it is recorded without blaming this rank.
  void wait_bucket(std::size_t b, const char* what = "finish") {
    const auto t_wait = timeline_ ? steady_clock::now() : steady_clock::time_point{};
    guarded(
        what, -1, [&] { memory_.wait(b, wait_patience(), pg_.rank()); }, false);
    const auto& req = memory_.in_flight(b);
    state_.set_reduced(b, req.valid() ? req.finished_at() : state_.launched_at(b));
    if (timeline_) timeline_->bucket_waited(b, t_wait, steady_clock::now());
  }

  std::chrono::milliseconds wait_patience() const { return opts_.timeout.count() > 0 ? opts_.timeout : pg_.timeout(); }

  // ---- uneven inputs (docs/data-parallel.md, "Uneven inputs") -------------------------------
  // Every synchronized step of an active rank, and every round of a joined rank's join(),
  // starts with an allreduce (op::sum) of one i64 through the reducer, issued before any
  // bucket: 1 from a rank that contributes gradients, 0 from a joined one. The count tells a
  // step's ranks how many contributed, and joined ranks whether to answer one more step.

  // Starts the count's allreduce with this rank's `contribution` (under bucket_state's lock
  // when a step opens, so before any of its buckets).
  void issue_count(std::int64_t contribution) {
    memory_.put_side(&contribution, sizeof contribution);
    memory_.track_side(red_.allreduce_async(memory_.side(), 1, dtype::i64, op::sum));
  }

  // Waits (bounded) for the count and returns it.
  std::int64_t wait_count(const char* what) {
    std::int64_t count = 0;
    guarded(
        what, -1,
        [&] {
          memory_.wait_side(wait_patience(), pg_.rank(), "the count of ranks contributing to the step was not reduced");
          memory_.get_side(&count, sizeof count);
        },
        false);
    if (count < 0 || count > pg_.size())
      guarded(what, -1, [&] {
        detail::raise(errc::protocol, pg_.rank(),
                      "the count of ranks contributing to the step is " + std::to_string(count) + " of " +
                          std::to_string(pg_.size()) + " (a rank without dp_options::uneven_inputs?)");
      });
    return count;
  }

  // Bucket b holds the reducer's result over every rank, joined ones contributing zeros: make
  // it the average over the `count` contributors (floats: scaled by world / count unless they
  // are all; integers: their sum divided by count).
  void finish_uneven(std::size_t b, int contributors) {
    const auto& bk = memory_.plan().buckets[b];
    if (!opts_.average || bk.numel == 0) return;
    const int count = opts_.divide_by == join_divisor::world_size ? pg_.size() : contributors;
    if (count == pg_.size() && detail::avg_scales(bk.type)) return;
    guarded("finish (averaging over the contributing ranks)", -1, [&] {
      memory_.on_host(b, [&](void* p) { detail::uneven_finish(p, bk.numel, bk.type, pg_.size(), count); });
    });
  }

  // The bucket hook for bucket b (its parameters in plan order).
  void call_bucket_hook(std::size_t b) {
    hook_params_.clear();
    for (const auto& e : memory_.plan().buckets[b].entries) hook_params_.push_back(e.param);
    guarded("finish (the bucket hook, on_bucket_reduced)", -1, [&] {
      bucket_hook_(reduced_bucket{b, std::span<const std::size_t>(hook_params_), step_});
    });
  }

  // ---- buffers and the step record (docs/engines.md, "What is synchronized") ---------------
  // The side buffer holds, one after the other in time, the uneven-inputs count, the step record
  // and the buffers' staging: each collective on it ends before the next one is put there.
  std::size_t side_bytes() const {
    std::size_t bytes = opts_.uneven_inputs ? sizeof(std::int64_t) : 0;
    if (record_needed()) bytes = std::max(bytes, step_record::bytes(views_.size()));
    return std::max(bytes, buffers_.bytes());  // also with buffer_sync::none, for sync_buffers()
  }

  // The step record is reduced when some rank may not use a parameter (which ones no rank used)
  // or when ranks may join and buffers follow one rank (which rank that is).
  bool record_needed() const noexcept {
    return pg_.size() > 1 &&
           (opts_.find_unused_parameters ||
            (opts_.uneven_inputs && opts_.buffers != buffer_sync::none && !buffers_.groups().empty()));
  }

  // After this step's buckets (or a joined rank's zeros), under guarded().
  void issue_record(bool joined) {
    std::vector<bool> used(views_.size(), false);
    if (!joined)
      for (std::size_t i = 0; i < views_.size(); ++i) used[i] = !state_.unused(i) || state_.accumulated(i);
    const auto words = step_record::encode(used, joined ? -1 : pg_.rank());
    memory_.put_side(words.data(), words.size() * sizeof(std::int64_t));
    memory_.track_side(plain_reducer().allreduce_async(memory_.side(), words.size(), dtype::i64, op::max));
  }

  // With find_unused_parameters on a world of one: the record is this rank's own.
  void note_unused_alone() {
    unused_everywhere_.assign(views_.size(), 0);
    for (std::size_t i = 0; i < views_.size(); ++i)
      unused_everywhere_[i] = state_.unused(i) && !state_.accumulated(i) ? 1 : 0;
  }

  // The collectives of the record and the buffers bypass a communication hook (ddp::hooked):
  // hooks are for gradient buckets. They are issued only once every bucket has been waited
  // for, so the hook's queue holds nothing of this wrapper's then.
  auto& plain_reducer() noexcept {
    if constexpr (requires { red_.inner(); })
      return red_.inner();
    else
      return red_;
  }

  // How this step's buffers are made alike: dp_options::buffers, except that averaging while
  // ranks have joined would mix in their stale buffers: the highest training rank's then.
  buffer_sync step_buffer_mode(int contributors) const noexcept {
    if (opts_.buffers == buffer_sync::average && opts_.uneven_inputs && contributors < pg_.size())
      return buffer_sync::broadcast;
    return opts_.buffers;
  }

  // Waits (bounded) for the record; keeps which parameters no rank used and returns the source
  // of the buffers (the highest rank that took part in the step).
  int wait_record(const char* what) {
    std::vector<std::int64_t> words(views_.size() + 1, 0);
    guarded(
        what, -1,
        [&] {
          memory_.wait_side(wait_patience(), pg_.rank(),
                            "the step record (parameters used, the buffers' source) was not reduced");
          memory_.get_side(words.data(), words.size() * sizeof(std::int64_t));
        },
        false);
    unused_everywhere_.assign(views_.size(), 0);
    if (opts_.find_unused_parameters)
      for (std::size_t i = 0; i < views_.size(); ++i) unused_everywhere_[i] = words[i] == 0 ? 1 : 0;
    // The buffers' source: the highest rank in the step with uneven inputs (PyTorch's Join picks
    // it so too), rank 0 otherwise.
    const std::int64_t source = opts_.uneven_inputs ? words.back() : 0;
    if (source < 0 || source >= pg_.size())
      guarded(what, -1, [&] {
        detail::raise(errc::protocol, pg_.rank(),
                      "the step record names rank " + std::to_string(source) + " of " + std::to_string(pg_.size()) +
                          " as the buffers' source");
      });
    return static_cast<int>(source);
  }

  // Makes the buffers alike: rank `source`'s everywhere, or the floating-point ones averaged.
  // One collective per dtype over the side buffer, each awaited before the next is put there.
  void sync_buffer_values(int source, buffer_sync how, const char* what) {
    if (how == buffer_sync::none || buffers_.groups().empty() || pg_.size() == 1) return;
    const auto& bufs = buffers_.buffers();
    guarded(what, -1, [&] {
      for (const auto& sl : buffers_.slots())
        memory_.put_side(sl.offset, bufs[sl.buffer].data, bufs[sl.buffer].bytes());
    });
    for (const auto& g : buffers_.groups()) {
      void* p = static_cast<std::byte*>(memory_.side()) + g.offset;
      guarded(what, -1, [&] {
        auto& red = plain_reducer();
        memory_.track_side(how == buffer_sync::average && detail::avg_scales(g.type)
                               ? red.allreduce_async(p, g.numel, g.type, op::avg)
                               : red.broadcast_async(p, g.numel, g.type, source));
      });
      guarded(
          what, -1,
          [&] {
            memory_.wait_side(wait_patience(), pg_.rank(),
                              std::string("the ") + dtype_name(g.type) + " buffers were not " +
                                  (how == buffer_sync::average ? "averaged" : "broadcast"));
          },
          false);
    }
    guarded(what, -1, [&] {
      for (const auto& sl : buffers_.slots())
        memory_.get_side(sl.offset, bufs[sl.buffer].data, bufs[sl.buffer].bytes());
    });
  }

  // bucket_state's launch: bucket b's collective, in plan order, under bucket_state's lock.
  void launch(std::size_t b) {
    const auto& bk = memory_.plan().buckets[b];
    const detail::flight_tag_scope tag(b, step_);  // the flight record names the bucket (docs/forensics.md)
    if (bk.numel > 0)
      memory_.track(b, red_.allreduce_async(memory_.buffer(b), bk.numel, bk.type,
                                            detail::bucket_op(opts_.average, opts_.uneven_inputs, bk.type)));
    if (timeline_) timeline_->bucket_launched(b, steady_clock::now());
  }

  // ---- the timeline (docs/tuning.md, "See a step: the timeline") ---------------------------
  // Opened with the buckets: a rank that cannot open its file fails construction on every rank.
  void open_timeline() {
    timeline_ = timeline::open(opts_, pg_.rank(), pg_.size());
    if (timeline_) state_.on_ready([t = timeline_.get()](std::size_t b) { t->bucket_ready(b); });
  }
  // The step finish() ends, before the plan can change (the rebuild).
  void record_timeline(steady_clock::time_point t_call) noexcept {
    timeline_->end_step(step_, state_, memory_.plan(), names_, generation_, t_call, !opts_.gradient_as_bucket_view,
                        [this](std::size_t b) -> const request& { return memory_.in_flight(b); });
  }

  void reset_step() {
    state_.reset(memory_.plan(), !settled_);
    memory_.clear_requests();
  }

  // The bucket slot of a parameter that is not ready in a synchronized step: zero, or what
  // no_sync() steps accumulated (PyTorch DDP keeps an accumulated gradient the same way).
  void fill_unused(std::size_t i) {
    if (!state_.accumulated(i))
      memory_.zero(i, views_[i].bytes());
    else if (!opts_.gradient_as_bucket_view)
      memory_.copy_in(i, views_[i].grad, views_[i].bytes());
    // View mode: the slot already holds the accumulated gradient.
  }

  // Allocates the buckets (in view mode holding the engine's current gradients, so nothing
  // accumulated is lost), then tells every rank whether every other rank managed: a rank whose
  // buckets do not fit (a full /dev/shm, device memory) fails here, and so do its peers.
  void set_up_buffers(bucket_plan plan) {
    agree_.share_setup(detail::exception_of([&] {
      open_timeline();
      memory_.allocate(std::move(plan));
      if (const std::size_t side = side_bytes(); side > 0) memory_.allocate_side(side);
      if (opts_.gradient_as_bucket_view)
        for (std::size_t i = 0; i < views_.size(); ++i) memory_.copy_in(i, views_[i].grad, views_[i].bytes());
    }));  // a failed rank's buckets are freed with memory_ as construction unwinds
  }

  // Re-plan once from rank 0's observed ready order. Runs inside finish(), with no collective in
  // flight, only in copy mode (slots hold nothing between steps and no pointer into them was
  // handed out); the old buckets are freed first, so an arena sized for one plan fits the other.
  void rebuild_from_order() {
    settled_ = true;
    if (state_.order().size() != views_.size()) return;  // cannot happen: every parameter was ready or unused
    install_plan(agree_.rebuilt_plan(planner_, infos_, policy_, state_.order(), &tune_order_), "after the rebuild");
  }

  // Puts `fresh` in place when it differs from the plan in use (new buckets, a new generation),
  // then every rank confirms one plan. Copy mode only, with no collective in flight: nothing
  // lives in the buckets between steps and no pointer into them was handed out.
  void install_plan(bucket_plan fresh, const char* when) {
    if (!(fresh == memory_.plan())) {
      memory_.allocate(std::move(fresh));
      ++generation_;
    }
    agree_.check_plan(memory_.plan(), settled_, when);
  }

  // ---- the bucket-cap autotune (docs/tuning.md, "Autotune") -------------------------------
  // Every rank runs the same schedule: the first synchronized step with the smallest candidate
  // (unmeasured), then autotune_rounds passes over the candidates, each visit one unmeasured
  // step on fresh buckets and autotune_steps measured ones. Each tuning step ends with an all_reduce (max) of this
  // rank's figure, so all ranks record the same numbers; rank 0's pick is broadcast all the same, and check_plan
  // confirms one plan after every re-plan.

  // At construction, on every rank: ranks agree on the option and its settings, then reject the
  // modes whose bucket layout cannot move (the same error on every rank).
  void set_up_autotune() {
    agree_.check_same("bucket_policy::autotune", policy_.autotune ? 1 : 0);
    if (!policy_.autotune) return;
    // Compared as the tuner takes them (caps sorted, each once): a mismatch shows the values.
    agree_.check_same_text("bucket_policy::autotune_caps, autotune_steps and autotune_rounds",
                           autotune_settings(policy_));
    agree_.check_same("dp_options::gradient_as_bucket_view", opts_.gradient_as_bucket_view ? 1 : 0);
    if (opts_.gradient_as_bucket_view)
      detail::raise(errc::usage, pg_.rank(),
                    "bucket_policy::autotune with dp_options::gradient_as_bucket_view: view mode hands bucket memory "
                    "to the engine, so the layout cannot move while caps are tried; tune in copy mode and set the "
                    "chosen cap_bytes for view mode, or turn one of them off");
    if (opts_.uneven_inputs)
      detail::raise(errc::usage, pg_.rank(),
                    "bucket_policy::autotune with dp_options::uneven_inputs: the layout is fixed at construction with "
                    "uneven inputs; set cap_bytes instead, or turn one of them off");
    if (!policy_.caps.empty())
      detail::raise(errc::invalid_argument, pg_.rank(),
                    "bucket_policy::autotune with a non-empty bucket_policy::caps: the autotune tries values of "
                    "cap_bytes, which caps replaces; list the candidates in autotune_caps instead");
    tuner_.emplace(policy_.autotune_caps, policy_.autotune_steps, policy_.autotune_rounds);
    tune_base_ = policy_;
    policy_ = with_cap(tune_base_, tuner_->first_cap());
  }

  // After the stats of every step: one step of the tuning schedule (a no-op once it is done).
  void autotune_after_step() {
    if (!tuner_ || tuner_->done() || !last_stats_.synchronized) return;
    guarded("the bucket-cap autotune in finish", -1, [&] {
      auto& t = *tuner_;
      if (!t.started()) {
        // The first synchronized step: rank 0's ready order is known (tune_order_, or empty
        // without the rebuild), and the plan in place is the smallest candidate's.
        auto caps = distinct_caps(planner_, infos_, tune_base_, tune_order_,
                                  policy_.autotune_caps.empty() ? default_autotune_caps() : policy_.autotune_caps);
        std::vector<std::size_t> buckets;
        for (auto c : caps)
          buckets.push_back(planner_.plan(infos_, with_cap(tune_base_, c), tune_order_).buckets.size());
        t.start(std::move(caps), buckets);
        return;
      }
      // This rank's first grad_ready to finish() return; a step is as slow as its slowest rank.
      const double mine = last_stats_.backward_ms + last_stats_.exposed_ms;
      const double slowest = pg_.all_reduce(mine, op::max);
      if (!t.record(slowest)) return;
      if (!t.measuring_done()) {
        replan(t.cap(), "during the bucket-cap autotune");
        return;
      }
      const auto pick = static_cast<std::size_t>(agree_.rank0_value(t.pick()));
      t.decide(pick, step_);
      replan(pick, "after the bucket-cap autotune");
      if (pg_.rank() == 0) {
        std::fputs(bucket_autotuner::describe(t.report()).c_str(), stderr);
        std::fflush(stderr);
      }
    });
  }

  // Plans with `cap` from the agreed order (install_plan: new buckets only when the layout differs).
  void replan(std::size_t cap, const char* when) {
    policy_ = with_cap(tune_base_, cap);
    install_plan(planner_.plan(infos_, policy_, tune_order_), when);
  }

  process_group pg_;  // the wrapper's own handle: the group stays open while this lives
  detail::owner_process owner_;
  std::unique_ptr<timeline> timeline_;  // null unless DDP_TIMELINE or dp_options::timeline
  bucket_policy policy_;
  dp_options opts_;
  std::vector<tensor_view> views_;
  buffer_layout buffers_;                        // the buffers and frozen parameters, and the per-step staging layout
  std::vector<std::uint8_t> unused_everywhere_;  // per parameter, after a synchronized step (the record)
  std::function<void(const reduced_bucket&)> bucket_hook_;  // on_bucket_reduced
  std::vector<std::size_t> hook_params_;                    // the hook's current bucket
  std::vector<std::string> names_;
  std::vector<param_info> infos_;
  Reducer red_;
  agreement agree_;
  Planner planner_{};
  bucket_memory<Allocator> memory_;  // after red_: destroyed first (shm_allocator draws from red_'s transport)
  bucket_state state_;
  bool settled_ = true;  // the bucket layout can no longer change (view mode, or after the rebuild)
  int no_sync_depth_ = 0;
  std::atomic<bool> joining_{false};  // join() runs (on some thread)
  std::uint64_t joined_steps_ = 0;
  std::uint64_t step_ = 0;
  std::uint64_t generation_ = 0;
  step_stats last_stats_;
  detail::failure_latch failure_;          // the first failure: every later call raises it
  std::optional<bucket_autotuner> tuner_;  // with bucket_policy::autotune
  bucket_policy tune_base_;                // the policy as given; candidates replace its cap
  std::vector<std::size_t> tune_order_;    // rank 0's ready order from the rebuild (empty: none)
};

}  // namespace v0
}  // namespace ddp
