#pragma once
/// \file data_parallel/sharded_mode.hpp
/// `ddp::sharded_mode<Wrapper>`: the calls of the sharded mode (`dp_options::shard`, ZeRO-2) that
/// `basic_data_parallel` offers: `step()` with a shard optimizer or the engine's own update,
/// the shards' state for checkpoints, and what the shards hold. The wrapper derives from it;
/// its work is `data_parallel/detail/shard_ops.hpp`'s. See docs/sharded.md.
///
/// \code
/// ddp::data_parallel dp{pg, params, {}, {.shard = true}};
/// ddp::adamw opt{{.lr = 1e-3}};
/// // backward: dp.grad_ready(i) ...
/// dp.finish();
/// dp.step(opt);  // every rank now holds the same updated parameters
/// \endcode

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/data_parallel/shard_layout.hpp>
#include <ddp/error.hpp>
#include <ddp/optim/shard_optimizer.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// The sharded mode's calls, a base of `basic_data_parallel` (CRTP: `Wrapper` is the wrapper,
/// which holds the shards). Without the option the accessors answer empty and the steps raise
/// `errc::usage`.
template <class Wrapper>
class sharded_mode {
 public:
  /// The sharded mode (`dp_options::shard`): after a synchronized `finish()`, steps this rank's
  /// shard of every bucket with `opt` (a `ddp::shard_optimizer`: `ddp::sgd`, `ddp::adamw`, the
  /// engine's own) and all-gathers the updated parameters into the engine's tensors, bucket by
  /// bucket, the gathers of earlier buckets overlapping the steps of later ones. Collective:
  /// every rank calls it once per synchronized step, with an optimizer of the same `signature()`
  /// (compared at the first call: errc::mismatch naming both). Throws `errc::usage` without the
  /// option, inside a step, or without a synchronized `finish()` since the last `step()`; a
  /// failure inside (timeout, peer_lost) fails the wrapper for good, as in `finish()`. With
  /// `find_unused_parameters`, a parameter no rank used keeps its value and optimizer state (as
  /// PyTorch's optimizers skip a parameter whose gradient is None).
  /// \code
  /// ddp::adamw opt{{.lr = 1e-3}};
  /// dp.finish();
  /// dp.step(opt);  // every rank now holds the same updated parameters
  /// \endcode
  template <shard_optimizer Optimizer>
  void step(Optimizer& opt) {
    Wrapper& w = begin("step(optimizer)", false);
    w.guarded_("step", -1, [&] { w.shards_->step(opt, [&w](std::size_t i) { return w.sync_.unused_everywhere(i); }); });
  }

  /// The sharded mode with the engine's own optimizer: after a synchronized `finish()`,
  /// `update()` steps this rank's slice of each parameter (`shard_slices()`: the engine's values
  /// and the averaged gradients there) through views the engine made of them, e.g. a
  /// `torch::optim` optimizer built over them (the LibTorch adapter's `shard_of` and `step`);
  /// then the wrapper all-gathers the updated parameters into the engine's tensors. An
  /// optimizer whose update of an element reads only that element (SGD, Adam, AdamW) gives the
  /// unsharded run's results. Its state is the engine's: `sharded_state()` refuses
  /// (errc::usage), and mixing it with `step(optimizer)` is errc::usage. Preconditions and
  /// failures as `step(optimizer)`; an exception from `update()` fails the wrapper for good.
  /// \code
  /// dp.finish();
  /// dp.step([&] { my_engine_optimizer.step(); });  // over views of dp.shard_slices()
  /// \endcode
  template <class Update>
  requires(std::invocable<Update&> && !shard_optimizer<std::remove_cvref_t<Update>>) void step(Update&& update) {
    Wrapper& w = begin("step(update)", true);
    w.guarded_("step", -1, [&] { w.shards_->step_engine(update); });
  }

  /// This rank's slice of each parameter in the sharded mode, in parameter order (see
  /// `ddp::shard_slice`; empty without the option). The pointers stay valid for the wrapper's life.
  std::vector<shard_slice> shard_slices() const {
    return ops() != nullptr ? ops()->slices() : std::vector<shard_slice>{};
  }

  /// The sharded mode's optimizer state (and f32 master weights of f16 and bf16 parameters),
  /// gathered on rank 0 in parameter order: a blob to pass to `save_checkpoint` as its extra
  /// bytes, which `load_sharded_state` takes back on any world size. Empty on the other ranks.
  /// Collective, between steps. `errc::usage` without the option.
  /// \code
  /// ddp::save_checkpoint(pg, "ckpt.ddp", params, dp.sharded_state());
  /// \endcode
  std::vector<std::byte> sharded_state() {
    Wrapper& w = check("sharded_state()");
    if (w.shards_->engine_steps())
      detail::raise(errc::usage, w.pg_.rank(),
                    "sharded_state(): the engine's optimizer steps the shards (step(update)) and holds their state; "
                    "save it with the engine on every rank (each rank's is of its own shard, at this world size)");
    std::vector<std::byte> out;
    w.guarded_("sharded_state", -1, [&] { out = w.shards_->gather_state(); });
    return out;
  }

  /// Takes this rank's shards of a `sharded_state()` blob (written at any world size), after the
  /// parameters were loaded: the next `step()` continues from it. Local; every rank calls it
  /// with the same blob (`load_checkpoint` hands rank 0's extra bytes to every rank). Throws
  /// `errc::invalid_argument` for a blob that is not one, `errc::mismatch` for one of other
  /// parameters, `errc::usage` without the option or inside a step.
  /// \code
  /// dp.load_sharded_state(ddp::load_checkpoint(pg, "ckpt.ddp", params));
  /// \endcode
  void load_sharded_state(std::span<const std::byte> blob) { check("load_sharded_state()").shards_->load_state(blob); }

  /// The sharded mode's layout: each bucket's shard on this rank (empty without the option).
  const shard_layout& shards() const noexcept {
    static const shard_layout none{};
    return ops() != nullptr ? ops()->layout() : none;
  }
  /// Bytes of optimizer state (and master weights) this rank holds for its shards, and of its
  /// averaged-gradient shards (with replicas, those of every shard it holds); 0 without the option.
  std::size_t shard_state_bytes() const noexcept { return ops() != nullptr ? ops()->state_bytes() : 0; }
  std::size_t shard_gradient_bytes() const noexcept { return ops() != nullptr ? ops()->gradient_bytes() : 0; }
  /// How many ranks hold each shard (`dp_options::shard_replicas`, resolved and capped at the
  /// world size); 0 without the option.
  int shard_replicas() const noexcept { return ops() != nullptr ? ops()->replicas() : 0; }
  /// The sharded mode's optimizer steps so far (continued from a loaded or re-sharded state).
  std::uint64_t sharded_steps() const noexcept { return ops() != nullptr ? ops()->steps() : 0; }
  /// This rank's averaged gradient shard of bucket `b` after a synchronized `finish()` (the
  /// bucket's dtype, `shards().buckets[b].per_rank` elements): for a gradient norm, say.
  const void* grad_shard(std::size_t b) const { return ops() != nullptr ? ops()->grad_shard(b) : nullptr; }

 protected:
  sharded_mode() = default;
  ~sharded_mode() = default;
  sharded_mode(const sharded_mode&) = delete;
  sharded_mode& operator=(const sharded_mode&) = delete;

  /// The wrapper's finish() after a synchronized step: its gradient shards await one step().
  void gradients_reduced(bool sharded) noexcept { fresh_ = sharded; }

 private:
  Wrapper& self() noexcept { return static_cast<Wrapper&>(*this); }
  const auto* ops() const noexcept { return static_cast<const Wrapper&>(*this).shards_.get(); }

  /// The checks of a step: the option, between steps, a synchronized finish() since the last
  /// step(), and the same kind of optimizer as before.
  Wrapper& begin(const char* what, bool engine) {
    Wrapper& w = self();
    w.between_steps(what, "call it after finish()");
    if (!w.shards_)
      detail::raise(errc::usage, w.pg_.rank(),
                    std::string(what) +
                        " needs the sharded mode (dp_options::shard); without it every rank holds the averaged "
                        "gradients after finish(): step the engine's optimizer");
    if (!fresh_)
      detail::raise(errc::usage, w.pg_.rank(),
                    std::string(what) +
                        " with no synchronized finish() since the last step (its gradient shards were already "
                        "applied)");
    w.shards_->check_kind(engine);
    fresh_ = false;
    return w;
  }

  /// The checks of the state's calls: the option, between steps.
  Wrapper& check(const char* what) {
    Wrapper& w = self();
    w.between_steps(what, "call it between steps");
    if (!w.shards_)
      detail::raise(errc::usage, w.pg_.rank(), std::string(what) + " needs the sharded mode (dp_options::shard)");
    return w;
  }

  bool fresh_ = false;  // a synchronized finish() since the last step()
};

}  // namespace DDP_ABI
}  // namespace ddp
