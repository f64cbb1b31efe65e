#pragma once
/// \file optim/sgd.hpp
/// `ddp::sgd`: stochastic gradient descent with momentum, dampening, weight decay and Nesterov,
/// the update of PyTorch's `torch.optim.SGD` (docs/sharded.md, "The ready-made optimizers"),
/// over flat f32 spans: a `ddp::shard_optimizer` for the sharded wrapper, and callable on a whole
/// parameter (`step(shard_step)` with its values, gradient and state) for the unsharded one.
///
/// \code
/// ddp::sgd opt{{.lr = 0.05, .momentum = 0.9}};
/// dp.finish();
/// dp.step(opt);  // dp_options::shard: each rank steps its shard, then the parameters are gathered
/// \endcode

#include <cstddef>
#include <string>

#include <ddp/version.hpp>
#include <ddp/optim/detail/lanes.hpp>
#include <ddp/optim/shard_optimizer.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// The hyperparameters of `ddp::sgd`, named and defaulted as `torch.optim.SGD`'s.
struct sgd_options {
  double lr = 0.01;
  double momentum = 0;
  double dampening = 0;
  double weight_decay = 0;
  bool nesterov = false;
  friend bool operator==(const sgd_options&, const sgd_options&) = default;
};

/// SGD over flat f32 spans. Per element, in PyTorch's order (scalars rounded to float as
/// PyTorch's kernels round them): `d = g + wd * p`; with momentum, `buf = d` at the first step and
/// `buf = buf * momentum + (1 - dampening) * d` after; `d = d + momentum * buf` (Nesterov) or
/// `d = buf`; `p = p + (-lr) * d`. Products and sums are rounded one at a time (no fused
/// multiply-add), so results match PyTorch's scalar path bit for bit and its AVX2 path (which
/// fuses `a + alpha * b`) within one rounding per operation. Change `options.lr` between steps.
struct sgd {
  sgd_options options{};

  std::size_t state_per_element() const noexcept { return options.momentum != 0 ? 1 : 0; }
  std::string signature() const {
    const auto& o = options;
    return "sgd lr=" + exact_text(o.lr) + " momentum=" + exact_text(o.momentum) +
           " dampening=" + exact_text(o.dampening) + " weight_decay=" + exact_text(o.weight_decay) +
           " nesterov=" + (o.nesterov ? "1" : "0");
  }

  void step(const shard_step& s) const {
    using detail::opt_splat;
    using detail::opt_vec;
    const auto& o = options;
    const opt_vec wd = opt_splat(static_cast<float>(o.weight_decay));
    const opt_vec mom = opt_splat(static_cast<float>(o.momentum));
    const opt_vec damp = opt_splat(static_cast<float>(1 - o.dampening));
    const opt_vec neg_lr = opt_splat(static_cast<float>(-o.lr));
    const bool decay = o.weight_decay != 0, first = s.step <= 1;
    float* p = s.params.data();
    const float* g = s.grads.data();
    const std::size_t n = s.params.size();
    if (o.momentum == 0) {
      detail::for_lanes(
          n,
          [&](opt_vec& pv, const opt_vec& gv) {
            const opt_vec d = decay ? gv + wd * pv : gv;
            pv = pv + neg_lr * d;
          },
          p, g);
      return;
    }
    detail::for_lanes(
        n,
        [&](opt_vec& pv, const opt_vec& gv, opt_vec& buf) {
          opt_vec d = decay ? gv + wd * pv : gv;
          buf = first ? d : buf * mom + damp * d;
          d = o.nesterov ? d + mom * buf : buf;
          pv = pv + neg_lr * d;
        },
        p, g, s.state.data());
  }
};

}  // namespace DDP_ABI
}  // namespace ddp
