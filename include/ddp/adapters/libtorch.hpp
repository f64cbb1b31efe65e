#pragma once
/// \file adapters/libtorch.hpp
/// LibTorch as a ddp engine: a `torch::nn::Module`'s parameters as a `ddp::parameter_set`
/// (`ddp::torch_parameters`) and a wrapper (`ddp::torch_data_parallel`) that hooks autograd the
/// way PyTorch's own DistributedDataParallel does: a post hook on each parameter's gradient
/// accumulator calls `grad_ready` when that gradient is final, and a callback queued on the
/// autograd engine calls `finish()` when backward ends. So `loss.backward()` returns with every
/// gradient averaged over the ranks, and early buckets were reduced while backward still ran.
/// The only header of ddp that includes LibTorch's (Meson: the `torch` feature; Debian:
/// `libtorch-dev`, headers under /usr/include/torch/csrc/api/include). See docs/engines.md.
/// \code
/// #include <ddp/adapters/libtorch.hpp>
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// auto net = std::make_shared<Net>();
/// ddp::torch_data_parallel dp{pg, *net};        // broadcasts rank 0's weights
/// torch::optim::SGD opt(net->parameters(), 0.1);
/// opt.zero_grad();
/// torch::mse_loss(net->forward(x), y).backward();  // gradients averaged when this returns
/// opt.step();
/// \endcode

#include <ddp/version.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/torch.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>

#include <ddp/data_parallel.hpp>
#include <ddp/data_parallel/fully_sharded.hpp>
#include <ddp/error.hpp>
#include <ddp/parameter.hpp>

namespace ddp {
inline namespace DDP_ABI {

namespace detail {
/// A post hook on a parameter's gradient accumulator: hands parameter `index` to `(owner->*Fn)`
/// once that gradient is final (both LibTorch wrappers hook autograd this way).
template <class Owner, void (Owner::*Fn)(std::size_t)>
struct grad_ready_hook final : torch::autograd::FunctionPostHook {
  grad_ready_hook(Owner* owner, std::size_t index) : owner_(owner), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    (owner_->*Fn)(index_);
    return outputs;
  }
  Owner* owner_;
  std::size_t index_;
};
/// The accumulator a parameter holds only weakly, kept alive with the key of the hook on it.
/// LibTorch 1.13 hands out a std::shared_ptr<Node>, later releases (2.15) a c10::intrusive_ptr<Node>:
/// the type is whatever grad_accumulator returns.
using grad_accumulator_ptr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const torch::Tensor&>()));
}  // namespace detail

/// The `ddp::dtype` of a LibTorch scalar type; `errc::unsupported` naming the type otherwise.
inline dtype torch_dtype(c10::ScalarType t, std::string_view what = "a tensor") {
  switch (t) {
    case c10::ScalarType::Float:
      return dtype::f32;
    case c10::ScalarType::Double:
      return dtype::f64;
    case c10::ScalarType::Half:
      return dtype::f16;
    case c10::ScalarType::BFloat16:
      return dtype::bf16;
    case c10::ScalarType::Int:
      return dtype::i32;
    case c10::ScalarType::Long:
      return dtype::i64;
    default:
      detail::raise(errc::unsupported, -1,
                    std::string(what) + " has scalar type " + c10::toString(t) +
                        "; ddp reduces float, double, half, bfloat16, int and long");
  }
}

/// A module's state (or a list of named tensors) as a `ddp::parameter_set` with buffers: the
/// parameters that require a gradient, in `named_parameters()` order (the order of
/// `module.parameters()`, which an optimizer sees too), are the trained parameters; the others
/// are frozen parameters and the module's `named_buffers()` its buffers (`ddp::has_buffers`), which
/// the wrapper makes rank 0's at construction and, for buffers, after every synchronized step
/// (`dp_options::buffers`), and which checkpoints save. Buffers and frozen parameters of a scalar
/// type ddp does not reduce (bool, uint8, ...) are left out: `skipped()` names them. A tensor registered under several
/// names (tied weights) is one parameter, under its first name, as PyTorch's DDP sees it (Python's `named_parameters()`
/// drops duplicates; LibTorch's lists them). Every gradient is made defined (zeros where autograd has not made one
/// yet), because ddp reads and writes gradients in place. Throws `ddp::error`: `errc::invalid_argument` for a tensor
/// that is not contiguous or not a leaf, `errc::unsupported` for a scalar type ddp does not reduce; the message names
/// it. A tensor on a CUDA device is a device parameter (`tensor_view::device` is its index). \code
/// ddp::torch_parameters params{*net};
/// static_assert(ddp::parameter_set<ddp::torch_parameters>);
/// \endcode
class torch_parameters {
 public:
  explicit torch_parameters(const torch::nn::Module& module) {
    for (const auto& item : module.named_parameters(/*recurse=*/true))
      if (item.value().requires_grad()) add(item.key(), item.value());
    for (const auto& item : module.named_parameters(/*recurse=*/true))
      if (!item.value().requires_grad()) add_state(item.key(), item.value(), buffer_kind::frozen_parameter);
    for (const auto& item : module.named_buffers(/*recurse=*/true))
      add_state(item.key(), item.value(), buffer_kind::buffer);
  }

  /// Tensors that require a gradient are parameters, the others frozen parameters; `buffers` (a
  /// module's `named_buffers()`, say) are buffers.
  explicit torch_parameters(const std::vector<std::pair<std::string, torch::Tensor>>& named,
                            const std::vector<std::pair<std::string, torch::Tensor>>& buffers = {}) {
    for (const auto& [name, t] : named)
      if (t.requires_grad()) add(name, t);
    for (const auto& [name, t] : named)
      if (!t.requires_grad()) add_state(name, t, buffer_kind::frozen_parameter);
    for (const auto& [name, t] : buffers) add_state(name, t, buffer_kind::buffer);
  }

  std::size_t size() const noexcept { return tensors_.size(); }
  const torch::Tensor& tensor(std::size_t i) const { return tensors_.at(i); }
  const std::string& name(std::size_t i) const { return names_.at(i); }
  dtype type(std::size_t i) const { return types_.at(i); }
  const std::vector<std::int64_t>& shape(std::size_t i) const { return shapes_.at(i); }

  /// Buffers and frozen parameters, in that order of registration: frozen parameters first.
  std::size_t buffer_count() const noexcept { return state_.size(); }
  const torch::Tensor& buffer_tensor(std::size_t i) const { return state_.at(i).tensor; }
  buffer_view buffer(std::size_t i) const {
    const auto& s = state_.at(i);
    return buffer_view{s.tensor.data_ptr(),
                       static_cast<std::size_t>(s.tensor.numel()),
                       s.type,
                       s.tensor.is_cuda() ? static_cast<int>(s.tensor.device().index()) : -1,
                       s.name,
                       std::vector<std::int64_t>(s.tensor.sizes().begin(), s.tensor.sizes().end()),
                       s.kind};
  }
  /// Buffers and frozen parameters left out for their scalar type, as "name (type)".
  const std::vector<std::string>& skipped() const noexcept { return skipped_; }

 private:
  struct state_entry {
    std::string name;
    torch::Tensor tensor;
    dtype type;
    buffer_kind kind;
  };

  void add_state(const std::string& name, const torch::Tensor& t, buffer_kind kind) {
    if (!t.defined()) return;  // a buffer registered as None
    if (!seen_.insert(t.unsafeGetTensorImpl()).second) return;
    const std::string label = std::string(kind == buffer_kind::buffer ? "buffer '" : "frozen parameter '") + name + "'";
    switch (t.scalar_type()) {
      case c10::ScalarType::Float:
      case c10::ScalarType::Double:
      case c10::ScalarType::Half:
      case c10::ScalarType::BFloat16:
      case c10::ScalarType::Int:
      case c10::ScalarType::Long:
        break;
      default:
        skipped_.push_back(name + " (" + c10::toString(t.scalar_type()) + ")");
        return;
    }
    if (t.layout() != c10::kStrided || !t.is_contiguous())
      detail::raise(errc::invalid_argument, -1,
                    label + " is not a contiguous dense tensor; call .contiguous() before wrapping");
    state_.push_back({name, t, torch_dtype(t.scalar_type(), label), kind});
  }

  void add(const std::string& name, const torch::Tensor& t) {
    if (!seen_.insert(t.unsafeGetTensorImpl()).second) return;  // tied: already wrapped under its first name
    const std::string label = "parameter '" + name + "'";
    if (!t.is_leaf())
      detail::raise(errc::invalid_argument, -1,
                    label + " is not a leaf tensor (autograd never accumulates its gradient)");
    if (!t.is_contiguous())
      detail::raise(errc::invalid_argument, -1,
                    label +
                        " is not contiguous; make the module's parameter itself contiguous before wrapping "
                        "(torch::NoGradGuard g; p.set_data(p.contiguous());): a contiguous copy would not be the "
                        "tensor autograd gives a gradient");
    const dtype type = torch_dtype(t.scalar_type(), label);
    if (!t.grad().defined()) {
      torch::NoGradGuard no_grad;
      t.mutable_grad() = torch::zeros_like(t, torch::MemoryFormat::Contiguous);
    } else if (!t.grad().is_contiguous() || t.grad().sizes() != t.sizes() ||
               t.grad().scalar_type() != t.scalar_type()) {
      detail::raise(errc::invalid_argument, -1,
                    label + ": its gradient is not a contiguous tensor of the parameter's shape and type");
    }
    tensors_.push_back(t);
    names_.push_back(name);
    types_.push_back(type);
    shapes_.emplace_back(t.sizes().begin(), t.sizes().end());
  }

  std::vector<torch::Tensor> tensors_;
  std::vector<std::string> names_;
  std::vector<dtype> types_;
  std::vector<std::vector<std::int64_t>> shapes_;
  std::vector<state_entry> state_;
  std::vector<std::string> skipped_;
  std::unordered_set<const c10::TensorImpl*> seen_;
};

template <>
struct parameter_traits<torch_parameters> {
  static std::size_t size(const torch_parameters& p) { return p.size(); }
  static void* data(const torch_parameters& p, std::size_t i) { return p.tensor(i).data_ptr(); }
  static void* grad(const torch_parameters& p, std::size_t i) { return p.tensor(i).grad().data_ptr(); }
  static std::size_t numel(const torch_parameters& p, std::size_t i) {
    return static_cast<std::size_t>(p.tensor(i).numel());
  }
  static dtype type(const torch_parameters& p, std::size_t i) { return p.type(i); }
  static int device(const torch_parameters& p, std::size_t i) {
    const auto& t = p.tensor(i);
    return t.is_cuda() ? static_cast<int>(t.device().index()) : -1;
  }
  static std::string_view name(const torch_parameters& p, std::size_t i) { return p.name(i); }
  static const std::vector<std::int64_t>& shape(const torch_parameters& p, std::size_t i) { return p.shape(i); }
  static std::size_t buffer_count(const torch_parameters& p) { return p.buffer_count(); }
  static buffer_view buffer(const torch_parameters& p, std::size_t i) { return p.buffer(i); }
};

/// DistributedDataParallel for LibTorch: `basic_data_parallel<Planner, Reducer, Allocator>`
/// over a module's parameters, driven by autograd. At construction (collective) it checks that
/// the ranks' parameters agree, copies rank 0's values everywhere and registers one post hook
/// per parameter on its gradient accumulator (kept alive here, as PyTorch's reducer keeps
/// them). During `backward()` each hook calls `grad_ready(i)` once that gradient is final, and
/// the first one queues a callback that calls `finish()` when the autograd engine is done: when
/// `backward()` returns, the gradients hold the average. With `gradient_as_bucket_view` each
/// parameter's `.grad()` is a tensor over bucket memory, so nothing is copied.
///
/// The module must be where it will train (device, dtype) before wrapping. Gradients set to
/// None (`zero_grad(true)`) are fine: the hook puts the fresh gradient back into the tensor
/// ddp reduces, and after a synchronized step every parameter's `.grad()` holds the average,
/// also one this rank did not use (`find_unused_parameters`; zeros where no rank used it, which
/// PyTorch's DDP leaves None). A parameter moved after wrapping (`module->to(...)`, `set_data()`) makes the
/// next `backward()` throw `errc::usage` naming it, before anything is reduced. An error inside
/// a hook or the final callback leaves `backward()` as that exception (a `ddp::error` when ddp
/// raised it) and fails the wrapper for good: autograd runs no end-of-backward callback after
/// an error, so every later `backward()` raises the first cause.
/// \code
/// ddp::torch_data_parallel dp{pg, *net, ddp::bucket_policy{}, {.gradient_as_bucket_view = true}};
/// { auto acc = dp.no_sync(); loss1.backward(); }  // accumulates locally
/// loss2.backward();                                // averages both
/// \endcode
template <class Planner = size_planner, class Reducer = auto_reducer, class Allocator = auto_allocator>
class basic_torch_data_parallel {
 public:
  using wrapper_type = basic_data_parallel<Planner, Reducer, Allocator>;

  template <class... ReducerArgs>
  basic_torch_data_parallel(process_group& pg, const torch::nn::Module& module, bucket_policy policy = {},
                            dp_options opts = {}, ReducerArgs&&... reducer_args)
      : basic_torch_data_parallel(pg, torch_parameters{module}, std::move(policy), opts,
                                  std::forward<ReducerArgs>(reducer_args)...) {}

  template <class... ReducerArgs>
  basic_torch_data_parallel(process_group& pg, torch_parameters params, bucket_policy policy = {}, dp_options opts = {},
                            ReducerArgs&&... reducer_args)
      : params_(std::move(params)),
        dp_(pg, params_, std::move(policy), opts, std::forward<ReducerArgs>(reducer_args)...),
        grads_(params_.size()),
        data_(params_.size()) {
    torch::NoGradGuard no_grad;
    const auto views = dp_.views();  // in view mode each grad is the bucket slot
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto& t = params_.tensor(i);
      data_[i] = views[i].data;
      if (opts.gradient_as_bucket_view)
        grads_[i] = torch::from_blob(views[i].grad, t.sizes(), t.options().requires_grad(false));
      else
        grads_[i] = t.grad();
      t.mutable_grad() = grads_[i];
    }
    if (opts.shard) {
      // This rank's slice of each parameter: a 1-D view of the parameter's own memory, and its
      // averaged gradient shard in the wrapper's memory (step() hands it over each time).
      for (const auto& sl : dp_.shard_slices()) {
        const auto& t = params_.tensor(sl.param);
        const auto off = static_cast<std::int64_t>(sl.offset), n = static_cast<std::int64_t>(sl.count);
        shard_views_.push_back(t.detach().view(-1).narrow(0, off, n));
        shard_grads_.push_back(
            n == 0 ? torch::zeros({0}, t.options().requires_grad(false))
                   : torch::from_blob(const_cast<void*>(sl.grads), {n}, t.options().requires_grad(false)));
        shard_impls_.insert(shard_views_.back().unsafeGetTensorImpl());
        shard_offset_.push_back(off);
      }
    }
    try {
      for (std::size_t i = 0; i < params_.size(); ++i) {
        const auto& t = params_.tensor(i);
        auto acc = torch::autograd::impl::grad_accumulator(t);
        const auto key = acc->add_post_hook(
            std::make_unique<detail::grad_ready_hook<basic_torch_data_parallel, &basic_torch_data_parallel::ready>>(
                this, i));
        hooks_.push_back({std::move(acc), key, 0});
        // Runs before accumulation even where the accumulator above was replaced (a change of
        // dtype or device), so that such a step is refused instead of silently not reduced.
        hooks_.back().tensor_hook = t.register_hook([this](const torch::Tensor&) { begin_step(); });
      }
    } catch (...) {
      remove_hooks();
      throw;
    }
  }

  basic_torch_data_parallel(const basic_torch_data_parallel&) = delete;
  basic_torch_data_parallel& operator=(const basic_torch_data_parallel&) = delete;

  /// Removes the hooks; in view mode each `.grad()` becomes a copy of its bucket slot, so the
  /// module outlives the wrapper with gradients it owns.
  ~basic_torch_data_parallel() {
    remove_hooks();
    // The slices' gradients are the wrapper's memory: an optimizer that outlives it finds none.
    for (auto& v : shard_views_) v.mutable_grad() = torch::Tensor();
    if (dp_.options().gradient_as_bucket_view) {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < params_.size(); ++i) {
        const auto& t = params_.tensor(i);
        if (t.grad().defined() && t.grad().data_ptr() == grads_[i].data_ptr()) t.mutable_grad() = grads_[i].clone();
      }
    }
  }

  /// Gradient accumulation: backward passes that start while the guard lives do no communication.
  typename wrapper_type::no_sync_guard no_sync() { return dp_.no_sync(); }

  /// Optimizer overlap (docs/engines.md, "Optimizer overlap"): `make` builds a `torch::optim`
  /// optimizer over the one parameter it is given, once per trained parameter; from then on
  /// each synchronized `backward()` steps every parameter's optimizer as soon as its bucket is
  /// averaged, while later buckets still reduce, so `loss.backward()` returns with the step
  /// taken: do not call a `step()` of your own. Optimizers whose update is per parameter (SGD,
  /// Adam, AdamW, RMSprop, Adagrad) step exactly as one optimizer over all parameters would;
  /// `optimizers()` gives them (to change a learning rate). A parameter no rank used
  /// (`find_unused_parameters`) is not stepped. Call between steps; `errc::usage` inside one.
  /// \code
  /// dp.overlap_optimizer([](std::vector<torch::Tensor> p) {
  ///   return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.05).momentum(0.9));
  /// });
  /// net->zero_grad();
  /// loss.backward();  // averaged and stepped
  /// \endcode
  void overlap_optimizer(
      const std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>& make) {
    std::vector<std::unique_ptr<torch::optim::Optimizer>> made;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      made.push_back(make(std::vector<torch::Tensor>{params_.tensor(i)}));
      if (!made.back())
        detail::raise(errc::invalid_argument, dp_.rank(),
                      "overlap_optimizer: the factory returned no optimizer for parameter '" + params_.name(i) + "'");
    }
    dp_.on_bucket_reduced([this](const reduced_bucket& b) {
      torch::NoGradGuard no_grad;
      for (const std::size_t i : b.parameters)
        if (settle_grad(i)) optimizers_[i]->step();
    });
    optimizers_ = std::move(made);
  }
  /// The per-parameter optimizers of `overlap_optimizer`, in parameter order.
  const std::vector<std::unique_ptr<torch::optim::Optimizer>>& optimizers() const noexcept { return optimizers_; }

  /// The sharded mode (`dp_options::shard`) with a `torch::optim` optimizer: this rank's slice
  /// of each of `params` (the module's parameters, in any grouping), as 1-D tensors over the
  /// parameter's own memory. Build the optimizer, its parameter groups and scheduler over these,
  /// then call `step(optimizer)` after each backward: each rank keeps the optimizer state of its
  /// slices only, and the results are the unsharded run's for optimizers whose update of an
  /// element reads only that element (SGD, Adam, AdamW, with momentum, weight decay, groups).
  /// Throws `errc::invalid_argument` for a tensor that is not a parameter of this wrapper,
  /// `errc::usage` without the option.
  /// \code
  /// ddp::torch_data_parallel dp{pg, *net, {}, {.shard = true}};
  /// torch::optim::AdamW opt(dp.shard_of(net->parameters()), torch::optim::AdamWOptions(1e-3));
  /// loss.backward();  // this rank's shard of the averaged gradients
  /// dp.step(opt);     // opt steps this rank's slices, then every rank holds the whole update
  /// \endcode
  std::vector<torch::Tensor> shard_of(const std::vector<torch::Tensor>& params) const {
    std::vector<torch::Tensor> out;
    out.reserve(params.size());
    for (const auto& p : params) out.push_back(shard_of(p));
    return out;
  }
  torch::Tensor shard_of(const torch::Tensor& param) const {
    if (!dp_.options().shard)
      detail::raise(errc::usage, dp_.rank(),
                    "shard_of() needs the sharded mode (dp_options::shard); without it build the optimizer over the "
                    "module's parameters");
    if (const int i = index_of(param); i >= 0) return shard_views_[static_cast<std::size_t>(i)];
    detail::raise(errc::invalid_argument, dp_.rank(),
                  "shard_of(): a tensor of shape " + c10::str(param.sizes()) +
                      " that is not a trained parameter of this wrapper (a frozen parameter, a buffer, or another "
                      "module's)");
  }

  /// The sharded mode's step with a `torch::optim` optimizer built over `shard_of(...)`: sets
  /// each slice's `.grad()` to this rank's shard of the averaged gradient (for a parameter no
  /// rank used, with `find_unused_parameters`, the slice of the gradient it kept, or none, as
  /// the unsharded wrapper leaves it), runs `opt.step()` and all-gathers the updated parameters into the module,
  /// then zeroes the module's own gradients (this rank's local ones, now spent), so the next
  /// backward starts afresh whether or not the user's loop calls `opt.zero_grad()`.
  /// Collective, once per synchronized backward. `errc::usage` when the optimizer holds a
  /// tensor that is not a slice of this wrapper (the module's own parameter would be stepped
  /// with this rank's local gradient), and as `basic_data_parallel::step(update)`.
  void step(torch::optim::Optimizer& opt) {
    if (!dp_.options().shard)
      detail::raise(errc::usage, dp_.rank(),
                    "step(optimizer) needs the sharded mode (dp_options::shard); without it call the optimizer's "
                    "own step() after backward()");
    for (const auto& group : opt.param_groups())
      for (const auto& p : group.params())
        if (!shard_impls_.contains(p.unsafeGetTensorImpl())) {
          const int i = index_of(p);
          const std::string what =
              i >= 0 ? "parameter '" + params_.name(static_cast<std::size_t>(i)) +
                           "' itself, whose .grad() is this rank's local gradient"
                     : "a tensor of shape " + c10::str(p.sizes()) + " that is not a slice of this wrapper";
          detail::raise(errc::usage, dp_.rank(),
                        "step(optimizer): the optimizer holds " + what +
                            "; build it over dp.shard_of(parameters) in the sharded mode");
        }
    dp_.step([&] {
      torch::NoGradGuard no_grad;
      for (std::size_t i = 0; i < params_.size(); ++i) {
        // A parameter no rank used keeps the gradient it had, as unsharded (settle_grad): the
        // optimizer sees the slice of it (over its memory, not an autograd view, which an
        // optimizer's zero_grad() could not detach), or none when it is None.
        const auto& g = params_.tensor(i).grad();
        if (dp_.options().find_unused_parameters && dp_.unused_on_every_rank(i))
          shard_views_[i].mutable_grad() =
              g.defined()
                  ? torch::from_blob(static_cast<std::byte*>(g.data_ptr()) + shard_offset_[i] * g.element_size(),
                                     {shard_views_[i].numel()}, g.options().requires_grad(false))
                  : torch::Tensor();
        else
          shard_views_[i].mutable_grad() = shard_grads_[i];
      }
      opt.step();
    });
    // The module's gradients (this rank's local ones) are spent: zeroed, so that the next
    // backward starts afresh, as the unsharded optimizer's zero_grad() makes it (the user's
    // zero_grad() now clears the slices' gradients, not these).
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (const auto& g = params_.tensor(i).grad(); g.defined()) params_.tensor(i).mutable_grad().zero_();
  }

  /// The `basic_data_parallel` underneath (statistics, plan, reducer).
  wrapper_type& wrapper() noexcept { return dp_; }
  const torch_parameters& parameters() const noexcept { return params_; }
  const step_stats& last_step_stats() const noexcept { return dp_.last_step_stats(); }
  int rank() const noexcept { return dp_.rank(); }
  int world_size() const noexcept { return dp_.world_size(); }

 private:
  struct registration {
    detail::grad_accumulator_ptr accumulator;
    std::uintptr_t key;    // the post hook on the accumulator
    unsigned tensor_hook;  // the parameter's own hook, which survives module->to()
  };

  // The first hook of a backward (a parameter's tensor hook or its accumulator's post hook)
  // opens the step: it checks that no parameter moved since wrapping, before any gradient is
  // handed over, so a refusal leaves nothing half done, and queues the end-of-backward callback.
  void begin_step() {
    if (step_open_.exchange(true)) return;
    check_not_failed();
    try {
      check_parameters();
      handed_.store(0);
      auto watch = std::make_shared<step_watch>(this);
      torch::autograd::Engine::get_default_engine().queue_callback([this, watch] {
        watch->ran = true;
        end_step();
      });
    } catch (...) {
      step_open_.store(false);
      throw;
    }
  }

  // Gradient i is final for this backward: make sure it sits in the tensor ddp reduces, then
  // hand it over.
  void ready(std::size_t i) {
    begin_step();
    failing([&] {
      torch::NoGradGuard no_grad;
      const auto& t = params_.tensor(i);
      const auto& g = t.grad();
      handed_.fetch_add(1);
      if (!g.is_same(grads_[i])) {  // set to None, then made afresh by autograd
        if (g.defined() && g.layout() != c10::kStrided)
          grads_[i].copy_(g.to_dense());  // a sparse gradient (Embedding(sparse=true)): averaged dense
        else if (g.defined() && g.data_ptr() != grads_[i].data_ptr())
          grads_[i].copy_(g);
        t.mutable_grad() = grads_[i];
      }
      dp_.grad_ready(i);
    });
  }

  // Autograd keeps the callback queued above until its backward ends, and runs it only if that
  // backward succeeded: the callback's copy of this watch dies unrun when an exception from
  // outside ddp (a user's hook, an operator) ended it. Without it the step would stay open for
  // good: no later backward would queue a callback again, so none would be averaged.
  struct step_watch {
    explicit step_watch(basic_torch_data_parallel* owner) : owner_(owner) {}
    step_watch(const step_watch&) = delete;
    step_watch& operator=(const step_watch&) = delete;
    ~step_watch() {
      if (!ran) owner_->abandon_step();
    }
    basic_torch_data_parallel* owner_;
    bool ran = false;
  };

  // A backward ended by an exception before its end-of-backward callback. When no gradient of it
  // reached ddp, nothing happened: the next backward is a fresh step. Otherwise ddp holds a
  // half-done step that no later call can complete: the wrapper fails for good, saying so.
  void abandon_step() noexcept {
    step_open_.store(false);
    const std::size_t handed = handed_.load();
    if (handed == 0) return;
    try {
      std::lock_guard lock(failure_mutex_);
      if (failure_.empty()) {
        failure_code_ = errc::usage;
        failure_ = "a backward() ended by an exception from outside ddp (a hook, an operator) after " +
                   std::to_string(handed) + " of " + std::to_string(params_.size()) +
                   " gradients had been handed to ddp; that step can never finish";
      }
    } catch (...) {  // no memory for the message: the step stays open and the next backward says so
    }
  }

  void end_step() {
    step_open_.store(false);
    failing([&] {
      dp_.finish();
      if (!dp_.last_step_stats().synchronized) return;
      torch::NoGradGuard no_grad;  // settle_grad says what each parameter's .grad() becomes
      for (std::size_t i = 0; i < params_.size(); ++i) settle_grad(i);
    });
  }

  // After a synchronized step: parameter i's .grad() is the tensor holding its average, also
  // for a parameter this rank did not use (find_unused_parameters), which may have no gradient
  // or one the engine never handed over (PyTorch's reducer creates it from the bucket likewise).
  // A parameter no rank used keeps the gradient it had, an undefined one included, which
  // optimizers skip, as PyTorch's reducer leaves it: false then.
  bool settle_grad(std::size_t i) {
    const auto& t = params_.tensor(i);
    if (dp_.options().find_unused_parameters && dp_.unused_on_every_rank(i)) return false;
    if (!t.grad().is_same(grads_[i])) t.mutable_grad() = grads_[i];
    return true;
  }

  // Runs part of a step. An exception leaves the step half done (autograd runs no queued
  // callback after an error, so finish() never comes): every later backward raises it.
  template <class F>
  void failing(F&& body) {
    try {
      body();
    } catch (const std::exception& e) {
      std::lock_guard lock(failure_mutex_);
      if (failure_.empty()) {
        const auto* d = dynamic_cast<const error*>(&e);
        failure_code_ = d != nullptr ? d->condition() : errc::aborted;
        failure_ = d != nullptr ? std::string(d->message()) : std::string(e.what());
      }
      throw;
    }
  }

  void check_not_failed() {
    std::lock_guard lock(failure_mutex_);
    if (!failure_.empty()) {
      step_open_.store(false);
      detail::raise(failure_code_, dp_.rank(),
                    "torch_data_parallel: an earlier backward() failed and left its step unfinished, so this "
                    "wrapper cannot be used again (build a new one); the first failure: " +
                        failure_);
    }
  }

  // Every parameter still has the storage and the gradient accumulator it had at wrapping
  // (module->to(...) or set_data() would leave ddp reducing memory the module no longer uses),
  // and every buffer its storage.
  void check_parameters() const {
    const auto& bufs = dp_.buffers();
    for (std::size_t i = 0; i < bufs.size() && i < params_.buffer_count(); ++i)
      if (params_.buffer_tensor(i).data_ptr() != bufs[i].data)
        detail::raise(errc::usage, dp_.rank(),
                      std::string(bufs[i].kind == buffer_kind::buffer ? "buffer '" : "frozen parameter '") +
                          std::string(bufs[i].name) +
                          "' was moved or replaced after wrapping (module->to(), a new tensor assigned); move or load "
                          "the module first, then wrap it");
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto& t = params_.tensor(i);
      if (t.data_ptr() != data_[i] || torch::autograd::impl::try_get_grad_accumulator(t) != hooks_[i].accumulator)
        detail::raise(errc::usage, dp_.rank(),
                      "parameter '" + params_.name(i) +
                          "' was moved or reallocated after wrapping (module->to(), set_data()); move the module "
                          "first, then wrap it",
                      -1, static_cast<int>(i));
    }
  }

  void remove_hooks() noexcept {
    for (std::size_t i = 0; i < hooks_.size(); ++i) {
      hooks_[i].accumulator->del_post_hook(hooks_[i].key);
      try {
        params_.tensor(i).remove_hook(hooks_[i].tensor_hook);
      } catch (...) {  // the tensor lost its autograd state: nothing left to remove
      }
    }
    hooks_.clear();
  }

  /// The index of parameter `t` in the wrapper's set, -1 when it is none of them.
  int index_of(const torch::Tensor& t) const {
    for (std::size_t i = 0; i < params_.size(); ++i)
      if (params_.tensor(i).unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return static_cast<int>(i);
    return -1;
  }

  torch_parameters params_;
  wrapper_type dp_;
  std::vector<torch::Tensor> shard_views_;  // the sharded mode: this rank's slice of each parameter
  std::vector<torch::Tensor> shard_grads_;  // and its averaged gradient shard
  std::vector<std::int64_t> shard_offset_;  // where each slice starts in its parameter
  std::unordered_set<const c10::TensorImpl*> shard_impls_;
  std::vector<torch::Tensor> grads_;  // the gradient tensor ddp reduces, per parameter
  std::vector<void*> data_;           // each parameter's storage at wrapping
  std::vector<registration> hooks_;
  std::vector<std::unique_ptr<torch::optim::Optimizer>> optimizers_;  // overlap_optimizer
  std::atomic<bool> step_open_{false};
  std::atomic<std::size_t> handed_{0};  // gradients of the open step given to ddp
  std::mutex failure_mutex_;
  std::string failure_;  // the first exception that left a step half done
  errc failure_code_ = errc::aborted;
};

/// The LibTorch wrapper with ddp's defaults (`size_planner`, `auto_reducer`, `auto_allocator`).
using torch_data_parallel = basic_torch_data_parallel<>;

/// Fully sharded data parallel (ZeRO-3, PyTorch's FSDP2) for LibTorch: `basic_fully_sharded`
/// over the parameters of `units` (modules; a parameter belongs to the innermost listed module
/// holding it, so the root module listed last takes what no block holds), driven by autograd.
/// The model's forward runs each unit through `forward(unit, args...)` (or `run(u, f, args...)`):
/// the unit's parameters are all-gathered into its tensors, the unit runs, and they are released;
/// each floating-point output carries an identity autograd function whose backward gathers the
/// unit again before its own backward (`begin_backward`). A post hook on each parameter's gradient
/// accumulator counts the unit's gradients; the last one ends the unit's backward (its gradients
/// reduce-scattered while autograd goes on), and a callback queued on the autograd engine ends
/// the rest and calls `finish()`: when `loss.backward()` returns, each rank holds its averaged
/// gradient shard of every unit. `step(opt)` then steps the shards with a `ddp::shard_optimizer`
/// (`ddp::adamw`, `ddp::sgd`). Under `torch::NoGradGuard` a unit is gathered and released only.
///
/// Between a unit's uses its tensors' pages are released (and, by default, inaccessible): do not
/// read parameters or gradients outside their unit, nor call a `torch::optim` optimizer or
/// `zero_grad()` on them (the wrapper zeroes each unit's gradients as its backward begins). Buffers
/// and frozen parameters in a unit are refused (`errc::unsupported`): this mode does not keep them in step.
/// The wrapper must outlive every autograd graph built through it.
/// \code
/// ddp::torch_fully_sharded fs{pg, {net->block1.ptr(), net->block2.ptr(), net.ptr()}};
/// // in Net::forward:  h = fs.forward(block1, h);  (net's own forward: fs.forward(net, x))
/// auto loss = torch::mse_loss(fs.forward(net, x), y);
/// loss.backward();  // every unit's gradients reduce-scattered
/// fs.step(adamw);   // ddp::adamw adamw{{.lr = 1e-3}};
/// \endcode
template <class Reducer = auto_reducer, class Allocator = auto_allocator>
class basic_torch_fully_sharded {
 public:
  using wrapper_type = basic_fully_sharded<Reducer, Allocator>;

  template <class... ReducerArgs>
  basic_torch_fully_sharded(process_group& pg, std::vector<std::shared_ptr<torch::nn::Module>> units,
                            fully_sharded_options opts = {}, ReducerArgs&&... reducer_args)
      : rank_(pg.rank()),
        modules_(std::move(units)),
        lay_(lay_out(modules_, pg.rank())),
        fs_(pg, lay_.params, lay_.counts, opts, std::forward<ReducerArgs>(reducer_args)...),
        arrived_(modules_.size(), 0),
        open_(modules_.size(), false) {
    try {
      for (std::size_t i = 0; i < lay_.params.size(); ++i) {
        const auto& t = lay_.params.tensor(i);
        grads_.push_back(t.grad());
        auto acc = torch::autograd::impl::grad_accumulator(t);
        const auto key = acc->add_post_hook(
            std::make_unique<detail::grad_ready_hook<basic_torch_fully_sharded, &basic_torch_fully_sharded::arrived>>(
                this, i));
        hooks_.push_back({std::move(acc), key});
      }
    } catch (...) {
      remove_hooks();
      throw;
    }
  }

  basic_torch_fully_sharded(const basic_torch_fully_sharded&) = delete;
  basic_torch_fully_sharded& operator=(const basic_torch_fully_sharded&) = delete;
  ~basic_torch_fully_sharded() { remove_hooks(); }

  /// The unit of `module` (a listed module, its holder or its pointer); errc::invalid_argument
  /// for one that is not listed.
  std::size_t unit_of(const torch::nn::Module& module) const {
    for (std::size_t u = 0; u < modules_.size(); ++u)
      if (modules_[u].get() == &module) return u;
    detail::raise(errc::invalid_argument, rank(),
                  "torch_fully_sharded: module '" + module.name() + "' is not one of the " +
                      std::to_string(modules_.size()) + " listed units");
  }

  /// Unit `module`'s forward, `module->forward(args...)`, with the unit gathered around it.
  template <class Module, class... Args>
  auto forward(Module& module, Args&&... args) {
    return run(
        unit_of(*module), [&](auto&&... a) { return module->forward(std::forward<decltype(a)>(a)...); },
        std::forward<Args>(args)...);
  }

  /// Unit `u`'s forward as `f(args...)`, returning a tensor or a `std::vector` of tensors: gathered
  /// before, released after (also when `f` throws); with gradients enabled, every floating-point
  /// output that requires a gradient gathers the unit again before the unit's backward.
  template <class F, class... Args>
  auto run(std::size_t u, F&& f, Args&&... args) {
    using result = std::decay_t<std::invoke_result_t<F, Args...>>;
    static_assert(std::is_same_v<result, torch::Tensor> || std::is_same_v<result, std::vector<torch::Tensor>>,
                  "ddp: a unit's forward returns a torch::Tensor or a std::vector<torch::Tensor>");
    fs_.gather(u);
    result out;
    try {
      out = std::invoke(std::forward<F>(f), std::forward<Args>(args)...);
    } catch (...) {
      try {
        fs_.release(u);
      } catch (...) {  // the forward's own failure is the one to report
      }
      throw;
    }
    fs_.release(u);
    if (!torch::GradMode::is_enabled()) return out;
    if constexpr (std::is_same_v<result, torch::Tensor>) {
      return mark(out, u);
    } else {
      for (auto& t : out) t = mark(t, u);
      return out;
    }
  }

  /// One optimizer step on every shard this rank holds (`basic_fully_sharded::step`), after a
  /// `backward()` that ran every unit's backward.
  template <shard_optimizer Optimizer>
  void step(Optimizer& opt) {
    fs_.step(opt);
  }

  /// Gradient accumulation: backwards that begin while the guard lives reduce nothing; the
  /// gradients add up whole in the module's tensors until a backward without it
  /// (`basic_fully_sharded::no_sync`).
  typename wrapper_type::no_sync_guard no_sync() { return fs_.no_sync(); }

  /// The `basic_fully_sharded` underneath (gather_all, sharded_state, statistics).
  wrapper_type& wrapper() noexcept { return fs_; }
  /// The parameters, in unit order: unit 0's, then unit 1's, ...
  const torch_parameters& parameters() const noexcept { return lay_.params; }
  int rank() const noexcept { return rank_; }

 private:
  struct layout {
    torch_parameters params;
    std::vector<std::size_t> counts, first;  // per unit: its parameters, and the first of them
    std::size_t unit_of(std::size_t i) const {
      return static_cast<std::size_t>(std::upper_bound(first.begin(), first.end(), i) - first.begin()) - 1;
    }
  };

  // Each parameter of the listed modules goes to the innermost listed module holding it (the one
  // with the fewest parameters); the parameters are laid out unit by unit, each in its module's
  // order.
  static layout lay_out(const std::vector<std::shared_ptr<torch::nn::Module>>& mods, int rank) {
    if (mods.empty()) detail::raise(errc::invalid_argument, rank, "torch_fully_sharded: no units");
    std::vector<std::vector<std::pair<std::string, torch::Tensor>>> named(mods.size());
    std::vector<std::unordered_set<const c10::TensorImpl*>> holds(mods.size());
    for (std::size_t u = 0; u < mods.size(); ++u) {
      if (!mods[u])
        detail::raise(errc::invalid_argument, rank, "torch_fully_sharded: unit " + std::to_string(u) + " is null");
      for (std::size_t v = 0; v < u; ++v)
        if (mods[v] == mods[u])
          detail::raise(errc::invalid_argument, rank,
                        "torch_fully_sharded: module '" + mods[u]->name() + "' is listed twice (units " +
                            std::to_string(v) + " and " + std::to_string(u) + ")");
      for (const auto& item : mods[u]->named_parameters(/*recurse=*/true))
        holds[u].insert(item.value().unsafeGetTensorImpl());
      if (const auto bufs = mods[u]->named_buffers(true); !bufs.is_empty())
        detail::raise(errc::unsupported, rank,
                      "torch_fully_sharded: unit " + std::to_string(u) + " ('" + mods[u]->name() + "') has buffer '" +
                          bufs.keys().front() + "'; the fully sharded mode does not keep buffers in step across ranks");
    }
    for (std::size_t u = 0; u < mods.size(); ++u)
      for (const auto& item : mods[u]->named_parameters(/*recurse=*/true)) {
        const auto* impl = item.value().unsafeGetTensorImpl();
        std::size_t best = u;
        for (std::size_t v = 0; v < mods.size(); ++v)
          if (holds[v].contains(impl) && holds[v].size() < holds[best].size()) best = v;
        if (best != u) continue;
        if (!item.value().requires_grad())
          detail::raise(errc::unsupported, rank,
                        "torch_fully_sharded: unit " + std::to_string(u) + " has frozen parameter '" + item.key() +
                            "'; the fully sharded mode shards trained parameters only");
        named[u].emplace_back(item.key(), item.value());
      }
    layout out{torch_parameters{flatten(named)}, {}, {}};
    std::unordered_set<const c10::TensorImpl*> seen;  // torch_parameters keeps a tied tensor once
    for (std::size_t u = 0; u < mods.size(); ++u) {
      std::size_t n = 0;
      for (const auto& item : named[u]) n += seen.insert(item.second.unsafeGetTensorImpl()).second ? 1 : 0;
      if (n == 0)
        detail::raise(errc::invalid_argument, rank,
                      "torch_fully_sharded: unit " + std::to_string(u) + " ('" + mods[u]->name() +
                          "') has no parameters of its own (an inner listed unit holds them all)");
      out.first.push_back(out.counts.empty() ? 0 : out.first.back() + out.counts.back());
      out.counts.push_back(n);
    }
    return out;
  }
  static std::vector<std::pair<std::string, torch::Tensor>> flatten(
      const std::vector<std::vector<std::pair<std::string, torch::Tensor>>>& named) {
    std::vector<std::pair<std::string, torch::Tensor>> all;
    for (const auto& v : named) all.insert(all.end(), v.begin(), v.end());
    return all;
  }

  // The identity on a unit's output whose backward begins the unit's backward.
  struct entry : torch::autograd::Function<entry> {
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                                  std::int64_t owner, std::int64_t u) {
      ctx->saved_data["owner"] = owner;
      ctx->saved_data["unit"] = u;
      return {x};
    }
    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
      auto* self = reinterpret_cast<basic_torch_fully_sharded*>(ctx->saved_data["owner"].toInt());
      self->enter(static_cast<std::size_t>(ctx->saved_data["unit"].toInt()));
      return {grads.at(0), torch::Tensor(), torch::Tensor()};
    }
  };

  torch::Tensor mark(const torch::Tensor& t, std::size_t u) {
    if (!t.defined() || !t.requires_grad() || !t.is_floating_point()) return t;
    return entry::apply(t, static_cast<std::int64_t>(reinterpret_cast<std::intptr_t>(this)),
                        static_cast<std::int64_t>(u))[0];
  }

  // The first output gradient of unit u in this backward: the unit gathered again, its
  // gradients opened; the first unit of a backward queues the end-of-backward callback.
  void enter(std::size_t u) {
    if (open_[u]) return;
    if (!backward_open_) {
      backward_open_ = true;
      torch::autograd::Engine::get_default_engine().queue_callback([this] { leave(); });
    }
    open_[u] = true;
    arrived_[u] = 0;
    fs_.begin_backward(u);
  }

  // Parameter i's gradient is final: in the tensor ddp reads (autograd made a new one when the
  // engine set it to None), and the last of its unit ends the unit's backward.
  void arrived(std::size_t i) {
    const std::size_t u = lay_.unit_of(i);
    if (!open_[u])
      detail::raise(errc::usage, rank_,
                    "torch_fully_sharded: parameter '" + lay_.params.name(i) + "' of unit " + std::to_string(u) +
                        " got a gradient outside its unit's backward (used outside forward(unit, ...), or the "
                        "unit's output reached the loss without passing through it)",
                    -1, static_cast<int>(i));
    const auto& t = lay_.params.tensor(i);
    if (const auto& g = t.grad(); !g.is_same(grads_[i])) {
      torch::NoGradGuard no_grad;
      if (g.defined() && g.data_ptr() != grads_[i].data_ptr()) grads_[i].copy_(g);
      t.mutable_grad() = grads_[i];
    }
    if (++arrived_[u] == lay_.counts[u]) close(u);
  }

  void close(std::size_t u) {
    open_[u] = false;
    fs_.end_backward(u);
  }

  // The backward ended: units with a parameter that got no gradient end now, then finish().
  void leave() {
    backward_open_ = false;
    for (std::size_t u = 0; u < open_.size(); ++u)
      if (open_[u]) close(u);
    fs_.finish();
  }

  struct registration {
    detail::grad_accumulator_ptr accumulator;
    std::uintptr_t key;
  };

  void remove_hooks() noexcept {
    for (auto& h : hooks_) h.accumulator->del_post_hook(h.key);
    hooks_.clear();
  }

  int rank_;
  std::vector<std::shared_ptr<torch::nn::Module>> modules_;
  layout lay_;
  wrapper_type fs_;
  std::vector<torch::Tensor> grads_;  // each parameter's gradient tensor, which the wrapper reads
  std::vector<registration> hooks_;
  std::vector<std::size_t> arrived_;  // per unit: its parameters whose gradient is final
  std::vector<bool> open_;            // per unit: its backward began and has not ended
  bool backward_open_ = false;
};

/// The LibTorch fully sharded wrapper with ddp's defaults.
using torch_fully_sharded = basic_torch_fully_sharded<>;

}  // namespace DDP_ABI
}  // namespace ddp
