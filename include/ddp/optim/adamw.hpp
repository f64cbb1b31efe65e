#pragma once
/// \file optim/adamw.hpp
/// `ddp::adamw`: Adam with decoupled weight decay, the update of PyTorch's `torch.optim.AdamW`
/// (docs/sharded.md, "The ready-made optimizers"), over flat f32 spans: a
/// `ddp::shard_optimizer` for the sharded wrapper, and callable on a whole parameter for the
/// unsharded one.
///
/// \code
/// ddp::adamw opt{{.lr = 1e-3, .weight_decay = 0.01}};
/// dp.finish();
/// dp.step(opt);
/// \endcode

#include <cmath>
#include <cstddef>
#include <string>

#include <ddp/version.hpp>
#include <ddp/optim/detail/lanes.hpp>
#include <ddp/optim/shard_optimizer.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// The hyperparameters of `ddp::adamw`, named and defaulted as `torch.optim.AdamW`'s.
struct adamw_options {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  friend bool operator==(const adamw_options&, const adamw_options&) = default;
};

/// AdamW over flat f32 spans; state: `exp_avg` then `exp_avg_sq` (2 floats per element). Per
/// element, in the order of PyTorch's single-tensor AdamW (the CPU default), with its scalars
/// computed in double and rounded to float: `p = p * (1 - lr * wd)`; `m = m * b1 + g * (1 - b1)`;
/// `v = v * b2 + ((1 - b2) * g) * g`; `d = sqrt(v) / sqrt(1 - b2^t) + eps`;
/// `p = p + ((-lr / (1 - b1^t)) * m) / d`. Each operation rounds once (no fused multiply-add).
/// PyTorch 1.13's scalar path computes the same; its AVX2 path fuses `m * b1 + g * (1 - b1)`,
/// and PyTorch 2.x updates `m` with `lerp` (`m + (1 - b1) * (g - m)`): one rounding apart per
/// step in `m` (docs/sharded.md gives the measured weight difference). Change `options.lr`
/// between steps.
struct adamw {
  adamw_options options{};

  std::size_t state_per_element() const noexcept { return 2; }
  std::string signature() const {
    const auto& o = options;
    return "adamw lr=" + exact_text(o.lr) + " betas=" + exact_text(o.beta1) + "," + exact_text(o.beta2) +
           " eps=" + exact_text(o.eps) + " weight_decay=" + exact_text(o.weight_decay);
  }

  void step(const shard_step& s) const {
    using detail::opt_splat;
    using detail::opt_vec;
    const auto& o = options;
    const double t = static_cast<double>(s.step);
    const double bc1 = 1 - std::pow(o.beta1, t), bc2 = 1 - std::pow(o.beta2, t);
    const opt_vec decay = opt_splat(static_cast<float>(1 - o.lr * o.weight_decay));
    const opt_vec b1 = opt_splat(static_cast<float>(o.beta1)), one_b1 = opt_splat(static_cast<float>(1 - o.beta1));
    const opt_vec b2 = opt_splat(static_cast<float>(o.beta2)), one_b2 = opt_splat(static_cast<float>(1 - o.beta2));
    const opt_vec bc2_sqrt = opt_splat(static_cast<float>(std::sqrt(bc2)));
    const opt_vec eps = opt_splat(static_cast<float>(o.eps));
    const opt_vec neg_step = opt_splat(static_cast<float>(-(o.lr / bc1)));
    const std::size_t n = s.params.size();
    float* m = s.state.data();
    float* v = m + n;
    detail::for_lanes(
        n,
        [&](opt_vec& p, const opt_vec& g, opt_vec& mv, opt_vec& vv) {
          p = p * decay;
          mv = mv * b1 + g * one_b1;
          vv = vv * b2 + (one_b2 * g) * g;
          const opt_vec d = detail::opt_sqrt(vv) / bc2_sqrt + eps;
          p = p + (neg_step * mv) / d;
        },
        s.params.data(), s.grads.data(), m, v);
  }
};

}  // namespace DDP_ABI
}  // namespace ddp
