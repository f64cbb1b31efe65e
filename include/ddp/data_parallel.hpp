#pragma once
/// \file data_parallel.hpp
/// `ddp::basic_data_parallel<Planner, Reducer, Allocator>` and `ddp::data_parallel`: the engine
/// calls `grad_ready(i)` as each gradient is produced during backward, then `finish()`; then
/// every gradient holds the average over all ranks, and early buckets were reduced while
/// backward was still running. The parts it is built from live in `ddp/data_parallel/`.
/// See docs/data-parallel.md.

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
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
#include <ddp/data_parallel/detail/autotune_driver.hpp>
#include <ddp/data_parallel/detail/bucket_ops.hpp>
#include <ddp/data_parallel/detail/failure_latch.hpp>
#include <ddp/data_parallel/detail/join_protocol.hpp>
#include <ddp/data_parallel/detail/parameters.hpp>
#include <ddp/data_parallel/detail/plan_keeper.hpp>
#include <ddp/data_parallel/detail/setup_checks.hpp>
#include <ddp/data_parallel/detail/shard_ops.hpp>
#include <ddp/data_parallel/detail/step_context.hpp>
#include <ddp/data_parallel/join_mode.hpp>
#include <ddp/data_parallel/detail/step_guard.hpp>
#include <ddp/data_parallel/detail/step_sync.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/data_parallel/shard_layout.hpp>
#include <ddp/data_parallel/sharded_mode.hpp>
#include <ddp/data_parallel/timeline.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/memory/auto_allocator.hpp>
#include <ddp/optim/shard_optimizer.hpp>
#include <ddp/planner/size_planner.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/auto.hpp>

namespace ddp {
inline namespace DDP_ABI {

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
class basic_data_parallel : public sharded_mode<basic_data_parallel<Planner, Reducer, Allocator>>,
                            public join_mode<basic_data_parallel<Planner, Reducer, Allocator>> {
  friend class sharded_mode<basic_data_parallel>;  // the modes' calls reach its parts
  friend class join_mode<basic_data_parallel>;
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
  /// (count, shapes, dtypes), copies rank 0's values everywhere (on a group that expects equal
  /// state, an elastic group's survivors, only where their hashes differ: `construction()`),
  /// plans and allocates the buckets.
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
            views_.size(), [this](std::size_t b) { buckets_.launch(b); },
            opts.uneven_inputs ? bucket_state::open_fn([this] { join_.issue_count(1); }) : bucket_state::open_fn{}) {
    detail::check_construction(agree_, memory_, views_, buffers_.buffers(), opts_, pg_.rank());
    if (shards_) shards_->check(policy_);
    tune_.set_up(agree_, policy_, opts_, pg_.rank());
    bucket_plan plan = plans_.first_plan(opts_);
    // The sharded mode's shards first: with replicas on an elastic group they bring the last
    // generation's parameters, rebuilt from their holders, which the construction then finds
    // equal everywhere (docs/sharded.md, "Surviving failures").
    if (shards_) shards_->lay_out(plan);
    if (opts_.broadcast_parameters && pg.size() > 1)
      built_ = detail::start_from_rank0(agree_, red_, pg_, views_, buffers_.buffers());
    if (shards_) shards_->parameters_set();
    // Every rank learns whether every other rank's buckets fit (a full /dev/shm, device memory):
    // if not, all fail here; a failed rank's buckets are freed with memory_ as construction unwinds.
    agree_.share_setup(detail::exception_of([&] { buckets_.set_up(std::move(plan), sync_); }));
    buckets_.reset_step(plans_.settled());
  }

  basic_data_parallel(const basic_data_parallel&) = delete;
  basic_data_parallel& operator=(const basic_data_parallel&) = delete;

  /// Waits (bounded) for collectives a failed step left in flight, then frees the buckets. In a
  /// forked child it waits for nothing and aborts nothing (the collectives are the parent's).
  ~basic_data_parallel() { buckets_.release(owner_.forked(), std::uncaught_exceptions() > 0); }

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
    guarded_("grad_ready", i, [&] {
      const bool sync = state_.open(no_sync_depth_ == 0);
      if (!sync) state_.set_accumulated(i);
      if (sync) buckets_.copy_in(i);
      state_.complete(i, sync);
    });
  }

  /// `grad_ready(i)` after checking, for a few pointer compares, that `params` (the set this
  /// wrapper was built from, as the engine describes it now) holds parameter `i` where the
  /// wrapper captured it: the same parameter count, element count, values and gradient (in view
  /// mode also `bucket_grad(i)`). For an engine that may reallocate its tensors (dlib): a moved
  /// gradient is `errc::usage` naming the parameter and both addresses, not a silent read of
  /// memory the engine no longer uses; it fails the wrapper for good, as in `grad_ready`.
  /// \code
  /// engine.backward([&](std::size_t i) { dp.grad_ready(params, i); });
  /// \endcode
  template <parameter_set ParamSet>
  void grad_ready(const ParamSet& params, std::size_t i) {
    check_index(i, "grad_ready");
    check_healthy();
    guarded_("grad_ready", static_cast<std::ptrdiff_t>(i), [&] {
      const void* slot = opts_.gradient_as_bucket_view ? memory_.slot(i) : nullptr;
      detail::check_unmoved(params, i, views_[i], slot, views_.size(), pg_.rank());
    });
    grad_ready(i);
  }

  /// Parameter `i` produced no gradient in this step: a zero gradient, or what `no_sync()` steps
  /// accumulated for it since the last synchronized step (as in PyTorch DDP). Errors as `grad_ready`.
  /// \code
  /// if (!used_expert[e]) dp.mark_unused(expert_param[e]);
  /// \endcode
  void mark_unused(std::size_t i) {
    claim(i, "mark_unused");
    guarded_("mark_unused", i, [&] {
      const bool sync = state_.open(no_sync_depth_ == 0);
      state_.set_unused(i);
      if (sync) buckets_.fill_unused(i);
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
    join_.check_not_joining("finish()");
    if (state_.nothing_new(step_, no_sync_depth_ == 0))
      detail::raise_finish_twice(pg_.rank(), step_ - 1, opts_.find_unused_parameters);
    const auto t_call = steady_clock::now();
    bool sync = false;
    guarded_("finish", -1, [&] { sync = state_.open(no_sync_depth_ == 0, t_call); });
    int contributors = 0;
    if (sync) {
      contributors = opts_.uneven_inputs ? static_cast<int>(join_.wait_count("finish")) : pg_.size();
      const auto missing = state_.missing();
      sync_.check_missing(missing, names_);
      buckets_.launch_rest(missing);
      const int source = buckets_.complete(
          [&](std::size_t b) {
            if (opts_.uneven_inputs) join_.finish_bucket(b, contributors);
          },
          [&] { return sync_.exchange_record(false, "finish"); });
      sync_.sync_buffer_values(source, sync_.step_buffer_mode(contributors), "finish (the buffers after the step)");
      state_.clear_accumulated();  // they are in this step's average now
      this->gradients_reduced(shards_ != nullptr);
    }
    buckets_.record_timeline(t_call, names_, plans_.layout_version());
    last_stats_ = state_.stats(step_, t_call, steady_clock::now());
    last_stats_.contributors = contributors;
    if (!plans_.settled() && last_stats_.synchronized)
      guarded_("the bucket rebuild in finish", -1, [&] { plans_.rebuild(state_.order(), tune_.order()); });
    tune_.after_step(guarded_, planner_, infos_, policy_, last_stats_, agree_, pg_, step_,
                     [this](bucket_plan p, const char* when) { plans_.install(std::move(p), when); });
    buckets_.reset_step(plans_.settled());
    ++step_;
  }

  /// Starts a gradient-accumulation scope (`no_sync_guard`); `errc::usage` in the middle of a step.
  /// \code
  /// { auto guard = dp.no_sync(); micro_step(0); dp.finish(); }  // accumulates locally
  /// micro_step(1); dp.finish();                                // averages both micro-steps
  /// \endcode
  no_sync_guard no_sync() {
    between_steps("no_sync()", "call it before the first grad_ready");
    return no_sync_guard(no_sync_depth_);
  }

  /// Copy mode: true when the reducer reads each gradient where the engine keeps it (ring<tcp>,
  /// `auto_reducer` on several hosts of one rank each) instead of ddp copying it into its bucket
  /// at `grad_ready`; the engine then leaves gradient i as it is from `grad_ready(i)` until
  /// `finish()` returns. dp_options::copy_gradients_at_ready turns it off.
  bool gradients_read_in_place() const noexcept { return buckets_.in_place(); }

  /// Where the engine must write gradient `i` in view mode (in copy mode: where ddp stages it).
  /// In view mode the address never changes; in copy mode it moves at the rebuild after the
  /// first synchronized step, and with `bucket_policy::autotune` at each cap the tuning tries
  /// and at its choice (`layout_version()` changes then).
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
    between_steps("on_bucket_reduced()", "set it between steps");
    buckets_.set_hook(std::move(fn));
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
    between_steps("sync_buffers()", "call it before the first grad_ready or after finish()");
    sync_.sync_buffer_values(0, how, "sync_buffers");
  }

  /// Bytes of bucket buffers held now: one per bucket, or in the sharded mode the pool's few.
  std::size_t bucket_bytes_held() const noexcept { return memory_.held_bytes(); }
  /// The buffers and frozen parameters the wrapper keeps alike (from `ddp::has_buffers`).
  const std::vector<buffer_view>& buffers() const noexcept { return buffers_.buffers(); }

  /// With `dp_options::find_unused_parameters`: true when no rank used parameter `i` in the last
  /// synchronized step (nor accumulated it in the `no_sync()` steps before it). Its gradient then
  /// holds zero; an engine that can tell the optimizer "no gradient" (LibTorch's undefined
  /// `grad()`, which the adapter leaves so) skips it, as PyTorch's DDP does. False without the option.
  bool unused_on_every_rank(std::size_t i) const {
    check_index(i, "unused_on_every_rank");
    return sync_.unused_everywhere(i);
  }

  /// Bumped when the bucket layout changes: once in copy mode (the rebuild), plus once per
  /// layout the bucket-cap autotune moves to; never in view mode.
  std::uint64_t layout_version() const noexcept { return plans_.layout_version(); }
  /// What the bucket-cap autotune (`bucket_policy::autotune`) measured and chose; the same on
  /// every rank. `enabled` is false without the option, `done` false while it still tunes.
  /// \code
  /// if (dp.autotune_report().done) std::printf("cap %zu\n", dp.autotune_report().chosen_cap_bytes);
  /// \endcode
  const ddp::autotune_report& autotune_report() const noexcept { return tune_.report(); }
  /// Statistics of the step the last `finish()` ended.
  const step_stats& last_step_stats() const noexcept { return last_stats_; }
  /// How the construction made every rank start from rank 0's values: the bytes it broadcast,
  /// or the hashes it compared instead (docs/elastic.md, "Re-forming without a broadcast").
  const construction_stats& construction() const noexcept { return built_; }
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
    guarded_.check(pg_.rank());
  }

  /// The checks of a call made between steps (`what`): healthy, not inside join(), no step open
  /// (else errc::usage with `when`, the advice).
  void between_steps(const char* what, const char* when) {
    check_healthy();
    join_.check_not_joining(what);
    if (state_.is_open())
      detail::raise(errc::usage, pg_.rank(), std::string(what) + " in the middle of a step; " + when);
  }

  void check_index(std::size_t i, const char* what) const {
    owner_.check(pg_.rank(), "data_parallel wrapper");
    if (i >= views_.size()) detail::raise_bad_index(pg_.rank(), what, i, views_.size());
  }

  void claim(std::size_t i, const char* what) {
    check_index(i, what);
    guarded_.check(pg_.rank());
    join_.check_not_joining(what);
    if (!state_.claim(i))
      detail::raise_already(pg_.rank(), what, i, names_[i], state_.unused(i), step_, plan().where[i].first);
  }

  process_group pg_;  // the wrapper's own handle: the group stays open while this lives
  detail::owner_process owner_;
  std::unique_ptr<timeline> timeline_;  // null unless DDP_TIMELINE or dp_options::timeline
  bucket_policy policy_;
  dp_options opts_;
  std::vector<tensor_view> views_;
  buffer_layout buffers_;  // the buffers and frozen parameters, and the per-step staging layout
  std::vector<std::string> names_;
  std::vector<param_info> infos_;
  Reducer red_;
  agreement agree_;
  Planner planner_{};
  bucket_memory<Allocator> memory_;  // after red_: destroyed first (shm_allocator draws from red_'s transport)
  bucket_state state_;
  int no_sync_depth_ = 0;
  std::uint64_t step_ = 0;
  step_stats last_stats_;
  construction_stats built_;
  detail::step_guard<Reducer> guarded_{names_, step_, red_, pg_};  // the first failure: every later call raises it
  // What every step's part works on, given to each once.
  detail::step_context<Reducer, Allocator> ctx_{pg_, opts_, views_, buffers_, memory_, state_, red_, guarded_, step_};
  detail::step_sync<Reducer, Allocator> sync_{ctx_};
  using shard_type = detail::shard_ops<Reducer, Allocator>;
  std::unique_ptr<shard_type> shards_ =  // dp_options::shard only
      opts_.shard ? std::make_unique<shard_type>(ctx_, agree_) : nullptr;
  detail::bucket_ops<Reducer, Allocator> buckets_{ctx_, timeline_, shards_.get()};
  detail::join_protocol<Reducer, Allocator> join_{ctx_, sync_};
  detail::plan_keeper<Planner, Allocator> plans_{agree_, memory_, planner_, infos_, policy_};
  detail::autotune_driver tune_;  // with bucket_policy::autotune
};

}  // namespace DDP_ABI
}  // namespace ddp
