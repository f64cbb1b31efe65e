#pragma once
/// \file optim/shard_optimizer.hpp
/// What an optimizer of flat f32 shards sees (`ddp::shard_step`, `ddp::shard_piece`) and the
/// concept it satisfies (`ddp::shard_optimizer`): the sharded wrapper (`dp_options::shard`)
/// hands each rank's shard of each bucket to one, and the same optimizer steps a whole
/// parameter when called on it directly. Ready-made: `ddp::sgd` (optim/sgd.hpp) and
/// `ddp::adamw` (optim/adamw.hpp). See docs/sharded.md.
///
/// \code
/// struct my_sgd {
///   float lr = 0.1f;
///   std::size_t state_per_element() const { return 0; }
///   std::string signature() const { return "my_sgd lr=" + ddp::exact_text(lr); }
///   void step(const ddp::shard_step& s) {
///     for (std::size_t k = 0; k < s.params.size(); ++k) s.params[k] -= lr * s.grads[k];
///   }
/// };
/// static_assert(ddp::shard_optimizer<my_sgd>);
/// \endcode

#include <bit>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include <ddp/version.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Elements `[shard_offset, shard_offset + count)` of a rank's shard of a bucket are elements
/// `[param_offset, param_offset + count)` of parameter `param` (an index into the parameter
/// set): how an optimizer that treats parameters differently (no weight decay on biases) knows
/// which one it steps.
struct shard_piece {
  std::size_t param = 0;
  std::size_t param_offset = 0;
  std::size_t shard_offset = 0;
  std::size_t count = 0;
  friend bool operator==(const shard_piece&, const shard_piece&) = default;
};

/// One call of a shard optimizer: the elements of one parameter that this rank's shard of a
/// bucket holds (`pieces` names that parameter and where the elements lie). The sharded wrapper
/// calls the optimizer once per such piece, with `params` pointing at the engine's own values
/// (f32) or at the piece's f32 master weights (f16, bf16 parameters); an unsharded engine may
/// call it on a whole parameter, `pieces` empty.
struct shard_step {
  std::size_t bucket = 0;        ///< the bucket this shard belongs to (plan order)
  std::uint64_t step = 1;        ///< 1 at the first step, as PyTorch's `state["step"]` after its increment
  std::span<float> params;       ///< the values to update (f32 master weights for f16 and bf16 parameters)
  std::span<const float> grads;  ///< the average of the shard's gradients over the ranks
  /// `state_per_element() * params.size()` floats, zero before the first step: array k is
  /// `state[k * n, (k + 1) * n)` for n = `params.size()`. The wrapper keeps, checkpoints and
  /// re-shards it (docs/sharded.md, "Checkpoints").
  std::span<float> state;
  std::span<const shard_piece> pieces;  ///< the parameter piece this call steps (one; empty when called directly)
};

/// A hyperparameter as `signature()` writes it: the shortest text that reads back as the same
/// double (`std::to_chars`), so two values give the same text exactly when they have the same
/// bits, and the text still reads as the number ("1e-06", "1.4e-06", "0.9"). Six fixed decimals
/// (`std::to_string`) would make lr 1e-6 and 1.4e-6 agree. A NaN carries its bit pattern.
/// \code
/// std::string signature() const { return "my_sgd lr=" + ddp::exact_text(lr); }
/// \endcode
inline std::string exact_text(double v) {
  char buf[64];  // the longest shortest form is 24 characters ("-2.2250738585072014e-308")
  if (std::isnan(v)) {
    const auto bits = std::bit_cast<std::uint64_t>(v);
    const auto r = std::to_chars(buf, buf + sizeof buf, bits, 16);
    return "nan(0x" + std::string(buf, r.ptr) + ")";
  }
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}

/// An optimizer the sharded wrapper can step: `state_per_element()` f32 values of state per
/// parameter element (0 for plain SGD, 1 for SGD with momentum, 2 for AdamW), a `signature()`
/// that ranks compare before the first step (the name and every hyperparameter, each written
/// with `exact_text` so that values a digit apart differ: ranks stepping different optimizers
/// is an errc::mismatch), and `step(shard_step)`, which must compute each
/// element from that element alone (so that a shard's result does not depend on where the
/// shard starts).
template <class O>
concept shard_optimizer = requires(O& o, const O& co, const shard_step& s) {
  { co.state_per_element() } -> std::convertible_to<std::size_t>;
  { co.signature() } -> std::convertible_to<std::string>;
  o.step(s);
};

}  // namespace DDP_ABI
}  // namespace ddp
