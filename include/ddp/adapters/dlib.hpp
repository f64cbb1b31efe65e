#pragma once
/// \file adapters/dlib.hpp
/// `ddp::dlib_parameters`: a [dlib](http://dlib.net) network (`dlib::add_loss_layer<...>` or any
/// stack of `dlib::add_layer`) as a `ddp::parameter_set`, so that `ddp::data_parallel` averages
/// its gradients while dlib's own solvers (`dlib::sgd`, `dlib::adam`, ...) keep stepping it. The
/// only header of ddp that includes dlib's (`<dlib/dnn.h>`, Debian's libdlib-dev; link with
/// `pkg-config --libs dlib-1`). CPU builds of dlib only. See docs/engines.md, "dlib".
///
/// \code
/// using net_type = dlib::loss_mean_squared<dlib::fc<1, dlib::relu<dlib::fc<64, dlib::input<dlib::matrix<float>>>>>>;
/// net_type net;
/// std::vector<dlib::sgd> solvers(net_type::num_computational_layers, dlib::sgd(0.0005f, 0.9f));
/// dlib::resizable_tensor x;
/// net.to_tensor(samples.begin(), samples.end(), x);
/// net.forward(x);                        // dlib allocates the parameters in its first forward
/// ddp::dlib_parameters params{net};      // then wrap: forward order, input layer first
/// ddp::data_parallel dp{pg, params};     // rank 0's weights on every rank
/// for (int step = 0; step < 100; ++step) {
///   net.compute_parameter_gradients(x, labels.begin());  // this rank's batch
///   params.average(dp);                  // the gradients now hold the average over the ranks
///   net.update_parameters(solvers, 0.01);  // dlib's solvers step, as without ddp
/// }
/// \endcode

// First, so that below C++20 the one line that says so stops the compiler before dlib's headers.
#include <ddp/version.hpp>

#include <dlib/dnn.h>

#include <any>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <optional>
#include <type_traits>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/parameter.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Where a dlib layer's biases start in its parameter tensor, and their multipliers, as dlib's
/// solvers (dnn/solvers.h) split a layer: fc (with bias), con and cont at size minus outputs,
/// bn_ at half; other layers have no split (`offset` = the size).
struct dlib_bias {
  std::size_t offset = 0;
  double lr_mult = 1, wd_mult = 1;
};
template <class T>
dlib_bias dlib_bias_of(const T&, std::size_t n) {
  return {n, 1, 1};
}
template <unsigned long N>
dlib_bias dlib_bias_of(const dlib::fc_<N, dlib::FC_HAS_BIAS>& l, std::size_t n) {
  return {n - l.get_num_outputs(), l.get_bias_learning_rate_multiplier(), l.get_bias_weight_decay_multiplier()};
}
template <long F, long R, long C, int SY, int SX, int PY, int PX>
dlib_bias dlib_bias_of(const dlib::con_<F, R, C, SY, SX, PY, PX>& l, std::size_t n) {
  return {n - static_cast<std::size_t>(l.num_filters()), l.get_bias_learning_rate_multiplier(),
          l.get_bias_weight_decay_multiplier()};
}
template <long F, long R, long C, int SY, int SX, int PY, int PX>
dlib_bias dlib_bias_of(const dlib::cont_<F, R, C, SY, SX, PY, PX>& l, std::size_t n) {
  return {n - static_cast<std::size_t>(l.num_filters()), l.get_bias_learning_rate_multiplier(),
          l.get_bias_weight_decay_multiplier()};
}
template <dlib::layer_mode M>
dlib_bias dlib_bias_of(const dlib::bn_<M>& l, std::size_t n) {
  return {n / 2, l.get_bias_learning_rate_multiplier(), l.get_bias_weight_decay_multiplier()};
}

/// What a dlib solver reads of a layer, for a part of one layer's parameters (dlib's generic
/// solver path: no bias split of its own).
struct dlib_part_layer {
  const dlib::tensor* params;
  double lr_mult, wd_mult;
  const dlib::tensor& get_layer_params() const { return *params; }
  double get_learning_rate_multiplier() const { return lr_mult; }
  double get_weight_decay_multiplier() const { return wd_mult; }
};

/// A fresh solver with `s`'s settings (its state starts empty, sized by its first call).
inline dlib::sgd dlib_fresh_solver(const dlib::sgd& s) { return dlib::sgd(s.get_weight_decay(), s.get_momentum()); }
inline dlib::adam dlib_fresh_solver(const dlib::adam& s) {
  return dlib::adam(s.get_weight_decay(), s.get_momentum1(), s.get_momentum2());
}

}  // namespace detail

/// The parameters of a dlib network, a `ddp::parameter_set`: one parameter per computational
/// layer that has any (a `fc`'s weights and bias are one dlib tensor, so one parameter), f32.
///
/// **Order.** dlib numbers its layers output first (`layer<0>(net)` is the loss); ddp expects
/// parameters in forward order, so that its buckets (planned last parameter first) go in the
/// order backward finishes them. Parameter 0 is therefore the layer nearest the input, and the
/// last one the layer under the loss. `layer_index(i)` is dlib's index of parameter `i`.
///
/// **Names** are `layer<K>.TYPE`, `K` dlib's layer index and `TYPE` the layer's name as dlib
/// prints it (`layer<3>.fc`, `layer<5>.con`); this object owns them, so it must outlive any wrapper
/// built from it (it cannot be copied; moving it keeps the names in place).
///
/// **Shapes** are dlib's, `{num_samples, k, nr, nc}` (an `fc<N>` over M inputs: `{M + 1, N, 1, 1}`).
///
/// **When to build it**: after dlib has allocated the parameters, which it does in the net's first
/// forward (`net.forward(x)`, `net(x)`, `compute_parameter_gradients`). Built before, it is empty,
/// and a `data_parallel` over it is `errc::invalid_argument` on every rank ("the parameter set is
/// empty ... wrap it after it has allocated them"). dlib allocates a layer's gradient in its first
/// backward; where that has not run yet, the constructor gives each gradient the parameter's size
/// (zeros), as that backward would, so a wrapper can be built between the first forward and
/// backward. The network must stay where it is (not moved or reassigned, not `clean()`ed) while
/// this object and a wrapper live: ddp keeps the tensors' addresses. `grad_ready(dp, i)` and
/// `average(dp)` read the tensors where dlib has them now and refuse, with `errc::usage` naming the
/// layer on every rank, a gradient or parameter dlib reallocated.
///
/// **Frozen layers.** A layer whose learning rate multiplier is 0 when this object is built
/// (`set_learning_rate_multiplier(0)`; dlib's solvers never step it) is a frozen parameter
/// (`buffer_kind::frozen_parameter`): rank 0's at construction, never averaged. Layers' private
/// state (`bn_`'s running statistics) is not reachable through dlib's API: each rank keeps its own.
/// \code
/// ddp::dlib_parameters params{net};
/// static_assert(ddp::parameter_set<ddp::dlib_parameters<net_type>>);
/// std::printf("%s\n", std::string(params.name(0)).c_str());  // "layer<4>.fc": the first layer
/// \endcode
template <class Net>
class dlib_parameters {
#ifdef DLIB_USE_CUDA
  // A CUDA build keeps the tensors on the device and copies them to the host on demand
  // (tensor::host()): the host addresses ddp keeps would go stale after each step.
  static_assert(sizeof(Net) == 0,
                "ddp::dlib_parameters: a dlib built with CUDA (DLIB_USE_CUDA) keeps tensors on the device; "
                "ddp's adapter needs a CPU build of dlib (Debian's libdlib-dev)");
#endif

 public:
  /// Reads `net`'s computational layers; see the class comment for when. Throws `ddp::error`
  /// (`errc::invalid_argument`, naming the layer) when a gradient has a size other than its
  /// parameter's and is not empty.
  explicit dlib_parameters(Net& net) : net_(&net) {
    std::size_t comp = 0;  // the layer's index among the computational layers: its solver's
    dlib::visit_layers(net, [this, &comp]<class T, class U, class E>(std::size_t k, dlib::add_layer<T, U, E>& layer) {
      ++comp;
      dlib::tensor& values = layer.layer_details().get_layer_params();
      if (values.size() == 0) return;  // no parameters (relu, dropout), or not allocated yet
      entry e;
      e.layer = k;
      std::ostringstream printed;
      printed << layer.layer_details();
      std::string type = printed.str();
      type = type.substr(0, type.find_first_of(" \t\n("));
      e.name = "layer<" + std::to_string(k) + ">." + type;
      e.values = &values;
      e.grad = &layer.get_parameter_gradient();
      e.shape = {static_cast<std::int64_t>(values.num_samples()), static_cast<std::int64_t>(values.k()),
                 static_cast<std::int64_t>(values.nr()), static_cast<std::int64_t>(values.nc())};
      if (e.grad->size() == 0) {
        // What dlib's first back_propagate_error does (params_grad.copy_size(params)), and
        // nothing more: a later backward finds it sized and writes it where it is.
        if (auto* r = dynamic_cast<dlib::resizable_tensor*>(e.grad)) {
          r->copy_size(values);
          *r = 0;
        }
      }
      if (e.grad->size() != values.size())
        detail::raise(errc::invalid_argument, -1,
                      "dlib_parameters: " + e.name + ": the gradient holds " + std::to_string(e.grad->size()) +
                          " elements but the parameters " + std::to_string(values.size()) +
                          "; build dlib_parameters after the net's first forward (or forward and backward)");
      e.comp = comp - 1;
      e.lr_mult = dlib::get_learning_rate_multiplier(layer.layer_details());
      e.wd_mult = dlib::get_weight_decay_multiplier(layer.layer_details());
      e.bias = detail::dlib_bias_of(layer.layer_details(), static_cast<std::size_t>(values.size()));
      const bool frozen = dlib::get_learning_rate_multiplier(layer.layer_details()) == 0;
      // visit_layers goes output first; ddp wants forward order, input layer first.
      (frozen ? frozen_ : entries_).push_front(std::move(e));
    });
  }
  // The names back the string_views that ddp::to_views hands out: a copy would give views into
  // the copy; moving a deque keeps its elements in place.
  dlib_parameters(const dlib_parameters&) = delete;
  dlib_parameters& operator=(const dlib_parameters&) = delete;
  dlib_parameters(dlib_parameters&&) noexcept = default;
  dlib_parameters& operator=(dlib_parameters&&) noexcept = default;

  /// The network these parameters belong to.
  Net& net() const noexcept { return *net_; }

  /// Number of parameters (layers with parameters that are trained).
  std::size_t size() const noexcept { return entries_.size(); }
  bool empty() const noexcept { return entries_.empty(); }

  /// Parameter `i`'s name, `layer<K>.TYPE` (see the class comment).
  std::string_view name(std::size_t i) const { return at(i).name; }
  /// dlib's index of parameter `i`'s layer: `dlib::layer<K>(net)`.
  std::size_t layer_index(std::size_t i) const { return at(i).layer; }
  /// Always `dtype::f32`: dlib's tensors hold float.
  dtype type(std::size_t) const noexcept { return dtype::f32; }
  /// Parameter `i`'s element count, as dlib has it now.
  std::size_t numel(std::size_t i) const { return static_cast<std::size_t>(at(i).values->size()); }
  /// Parameter `i`'s shape, dlib's `{num_samples, k, nr, nc}` when this object was built.
  const std::vector<std::int64_t>& shape(std::size_t i) const { return at(i).shape; }
  /// Parameter `i`'s values, where dlib has them now.
  float* data(std::size_t i) const { return at(i).values->host(); }
  /// Parameter `i`'s gradient, where dlib has it now.
  float* grad(std::size_t i) const { return at(i).grad->host(); }

  /// Number of frozen layers (learning rate multiplier 0 when this object was built).
  std::size_t buffer_count() const noexcept { return frozen_.size(); }
  /// Frozen layer `i` as ddp sees it: rank 0's values at construction.
  buffer_view buffer(std::size_t i) const {
    if (i >= frozen_.size())
      detail::raise(errc::invalid_argument, -1,
                    "dlib_parameters: buffer " + std::to_string(i) + " does not exist (" +
                        std::to_string(frozen_.size()) + " frozen layers)");
    const entry& e = frozen_[i];
    return buffer_view{e.values->host(),
                       static_cast<std::size_t>(e.values->size()),
                       dtype::f32,
                       -1,
                       e.name,
                       e.shape,
                       buffer_kind::frozen_parameter};
  }

  /// Hands gradient `i` over through `dp.grad_ready(*this, i)`, which first checks that dlib
  /// still has it (and the values) where the wrapper captured them; a refusal fails the wrapper
  /// and reaches the peers.
  /// \code
  /// params.grad_ready(dp, params.size() - 1);  // the layer under the loss
  /// \endcode
  template <class DataParallel>
  void grad_ready(DataParallel& dp, std::size_t i) const {
    dp.grad_ready(*this, i);
  }

  /// After dlib's backward (`compute_parameter_gradients`, `back_propagate_error`), before its
  /// solvers step (`update_parameters`): hands every gradient over, the output layer's first (the
  /// order backward finished them), then `dp.finish()`. On return every gradient holds the
  /// average over the ranks. dlib's backward is one call with no per-layer hook, so the buckets
  /// are reduced after it, not during it.
  /// \code
  /// net.compute_parameter_gradients(x, labels.begin());
  /// params.average(dp);
  /// net.update_parameters(solvers, learning_rate);
  /// \endcode
  template <class DataParallel>
  void average(DataParallel& dp) const {
    for (std::size_t i = entries_.size(); i-- > 0;) grad_ready(dp, i);
    dp.finish();
  }

  /// The sharded mode (`dp_options::shard`) with dlib's own solvers (`dlib::sgd`, `dlib::adam`),
  /// in place of `net.update_parameters(solvers, learning_rate)`, after `average(dp)`: each rank
  /// steps only its slice of each layer, with solvers of `solvers`' settings that keep the state
  /// of that slice alone (made at the first call; `solvers` themselves keep no state then), and
  /// the wrapper all-gathers the updated weights (`data_parallel::step(update)`). The results
  /// are those of `update_parameters` on the averaged gradients: bitwise, dlib's solvers being
  /// elementwise, where the layers' learning rate and weight decay multipliers keep their
  /// defaults (other multipliers are multiplied in another order: within a rounding of the
  /// rate). A layer's bias multipliers are read when this object is built. Collective.
  /// Throws `errc::invalid_argument` when `solvers` has fewer than the net's computational
  /// layers, `errc::usage` for another solver type than the first call's, and as `step(update)`.
  /// \code
  /// ddp::data_parallel dp{pg, params, {}, {.shard = true}};
  /// net.compute_parameter_gradients(x, labels.begin());
  /// params.average(dp);                      // this rank's shard of the averaged gradients
  /// params.step(dp, solvers, learning_rate);  // instead of net.update_parameters(...)
  /// \endcode
  template <class DataParallel, class Solver>
  void step(DataParallel& dp, const std::vector<Solver>& solvers, double learning_rate) {
    static_assert(std::is_same_v<Solver, dlib::sgd> || std::is_same_v<Solver, dlib::adam>,
                  "dlib_parameters::step: dlib::sgd or dlib::adam (a solver whose update of an element reads only "
                  "that element)");
    using parts = std::vector<std::array<std::optional<Solver>, 2>>;
    if (solvers.size() < Net::num_computational_layers)
      detail::raise(errc::invalid_argument, dp.rank(),
                    "dlib_parameters::step: " + std::to_string(solvers.size()) + " solvers for a net of " +
                        std::to_string(Net::num_computational_layers) + " computational layers");
    if (!shard_solvers_.has_value()) shard_solvers_ = parts(entries_.size());
    auto* mine = std::any_cast<parts>(&shard_solvers_);
    if (mine == nullptr)
      detail::raise(errc::usage, dp.rank(), "dlib_parameters::step: another solver type than at the first step");
    const auto slices = dp.shard_slices();
    dp.step([&] {
      for (std::size_t i = 0; i < entries_.size() && i < slices.size(); ++i) {
        const auto& sl = slices[i];
        const entry& e = entries_[i];
        if (sl.count == 0) continue;
        // The averaged slice into dlib's own gradient tensor (this rank's local one is spent).
        std::memcpy(e.grad->host() + sl.offset, sl.grads, sl.count * sizeof(float));
        // dlib's solvers treat a layer's biases apart unless both bias multipliers are 1.
        const bool split = e.bias.offset < numel(i) && !(e.bias.lr_mult == 1 && e.bias.wd_mult == 1);
        const std::size_t lo = sl.offset, hi = sl.offset + sl.count;
        const std::size_t cut = split ? std::clamp(e.bias.offset, lo, hi) : hi;
        for (int part = 0; part < 2; ++part) {
          const std::size_t a = part == 0 ? lo : cut, b = part == 0 ? cut : hi;
          if (a == b) continue;
          auto& solver = (*mine)[i][static_cast<std::size_t>(part)];
          if (!solver) solver.emplace(detail::dlib_fresh_solver(solvers[e.comp]));
          const dlib::alias_tensor piece(static_cast<long long>(b - a));
          auto values = piece(*e.values, a);
          auto grads = piece(*e.grad, a);
          const detail::dlib_part_layer layer{&values, part == 0 ? e.lr_mult : e.lr_mult * e.bias.lr_mult,
                                              part == 0 ? e.wd_mult : e.wd_mult * e.bias.wd_mult};
          const dlib::tensor& update = (*solver)(static_cast<float>(learning_rate), layer, grads);
          dlib::tt::add(values, values, update);
        }
      }
    });
  }

 private:
  struct entry {
    std::string name;
    std::size_t layer = 0;
    dlib::tensor* values = nullptr;
    dlib::tensor* grad = nullptr;
    std::vector<std::int64_t> shape;
    std::size_t comp = 0;  // among the computational layers, output first: its solver's index
    double lr_mult = 1, wd_mult = 1;
    detail::dlib_bias bias;
  };

  const entry& at(std::size_t i) const {
    if (i >= entries_.size())
      detail::raise(errc::invalid_argument, -1,
                    "dlib_parameters: parameter " + std::to_string(i) + " does not exist (" +
                        std::to_string(entries_.size()) + " layers with parameters)",
                    -1, static_cast<int>(i));
    return entries_[i];
  }

  Net* net_;
  std::deque<entry> entries_;  // forward order; a deque: the names stay put
  std::deque<entry> frozen_;   // learning rate multiplier 0
  std::any shard_solvers_;     // step(): per parameter, the solvers of its slice's parts
};

/// `dlib_parameters` as a `ddp::parameter_set` (include/ddp/parameter.hpp).
template <class Net>
struct parameter_traits<dlib_parameters<Net>> {
  using self = dlib_parameters<Net>;
  static std::size_t size(const self& p) noexcept { return p.size(); }
  static void* data(const self& p, std::size_t i) { return p.data(i); }
  static void* grad(const self& p, std::size_t i) { return p.grad(i); }
  static std::size_t numel(const self& p, std::size_t i) { return p.numel(i); }
  static dtype type(const self& p, std::size_t i) { return p.type(i); }
  static std::string_view name(const self& p, std::size_t i) { return p.name(i); }
  static const std::vector<std::int64_t>& shape(const self& p, std::size_t i) { return p.shape(i); }
  static std::size_t buffer_count(const self& p) noexcept { return p.buffer_count(); }
  static buffer_view buffer(const self& p, std::size_t i) { return p.buffer(i); }
};

}  // namespace DDP_ABI
}  // namespace ddp
