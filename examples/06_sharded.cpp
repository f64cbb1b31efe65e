// Sharded data parallel (ZeRO-2): the MLP of 01_mlp, four times wider, trained with AdamW whose
// state (two floats per weight) is split over the ranks, and, in the same run, with the
// unsharded wrapper and the same AdamW stepping every weight on every rank.
//
//   ddprun -n 4 build/examples/06_sharded
//
// The sharded run: dp_options::shard, so each bucket ends with a reduce-scatter and this rank
// holds the average of its shard of the gradients; dp.step(opt) steps that shard with
// ddp::adamw and gathers the updated weights into the model. The unsharded run: the default
// wrapper averages every gradient on every rank, and each rank steps the whole model with the
// same ddp::adamw and its own full state.
//
// Rank 0's last line:
//   sharded: OK state_bytes_per_rank=B unsharded_state_bytes=U max_weight_diff=D
// B is the AdamW state this rank holds (about U / N), U the state one unsharded rank holds, D
// the largest difference of any weight between the two runs after the last step. The program
// exits non-zero when D exceeds the bound (1e-5: the two runs differ only where the
// reduce-scatter and the allreduce add the ranks' gradients in another order, which on 2 ranks
// never changes a bit), when the state is not within 5% of U / N, when the ranks' weights differ,
// or when the loss did not fall.
#include <ddp/ddp.hpp>

#include "mlp_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

namespace {

using namespace mlp_example;

constexpr int samples_per_rank = 256;
constexpr int batch = 16;
constexpr int steps = 20;
constexpr double bound = 1e-5;
const std::vector<int> wide_dims = {input_dim, 512, 512, 512, 1};  // 534,017 weights: 4.3 MB of AdamW state

/// One run of `steps` steps on this rank's shard of the data; returns the last step's loss
/// averaged over the ranks.
template <class Step>
float train(ddp::process_group& pg, mlp& net, ddp::data_parallel& dp, const dataset& data, Step&& step) {
  float loss = 0;
  for (int s = 0; s < steps; ++s) {
    const int first = pg.rank() * samples_per_rank + (s * batch) % samples_per_rank;
    loss = net.forward_backward(&data.x[static_cast<std::size_t>(first) * input_dim], &data.y[static_cast<std::size_t>(first)],
                                batch, [&](std::size_t i) { dp.grad_ready(i); });
    dp.finish();
    step();
  }
  std::vector<float> l{loss};
  pg.all_reduce(std::span<float>(l), ddp::op::avg);
  return l[0];
}

std::string weight_bytes(const std::vector<ddp::tensor_view>& views) {
  std::string out;
  for (const auto& v : views) out.append(static_cast<const char*>(v.data), v.bytes());
  return out;
}

}  // namespace

int main() try {
  auto pg = ddp::init_process_group(ddp::init_options::from_env());
  const int rank = pg.rank(), world = pg.size();
  const dataset data = make_dataset(samples_per_rank * world);
  const ddp::adamw opt{{.lr = 1e-3, .weight_decay = 0.01}};

  // Sharded: each rank keeps the AdamW state of its shard only. Ranks start apart; the wrapper
  // copies rank 0's weights to all.
  mlp net_s(wide_dims, 7 + static_cast<unsigned>(rank));
  const auto views_s = net_s.parameters();
  ddp::data_parallel dp_s(pg, views_s, {}, {.shard = true});
  float loss_first = 0;
  {
    const int first = rank * samples_per_rank;
    loss_first = net_s.forward_backward(&data.x[static_cast<std::size_t>(first) * input_dim],
                                        &data.y[static_cast<std::size_t>(first)], batch, [](std::size_t) {});
    std::vector<float> l{loss_first};
    pg.all_reduce(std::span<float>(l), ddp::op::avg);
    loss_first = l[0];
  }
  ddp::adamw sharded_opt = opt;
  const float loss_s = train(pg, net_s, dp_s, data, [&] { dp_s.step(sharded_opt); });
  const std::size_t state_sharded = dp_s.shard_state_bytes();

  // Unsharded: the same AdamW over every weight, its state whole on every rank.
  mlp net_u(wide_dims, 7 + static_cast<unsigned>(rank));
  const auto views_u = net_u.parameters();
  ddp::data_parallel dp_u(pg, views_u);
  std::vector<std::vector<float>> state;
  for (const auto& v : views_u) state.emplace_back(2 * v.numel, 0.0f);
  std::uint64_t t = 0;
  const float loss_u = train(pg, net_u, dp_u, data, [&] {
    ++t;
    for (std::size_t i = 0; i < views_u.size(); ++i) {
      const auto& v = views_u[i];
      opt.step(ddp::shard_step{i, t, std::span<float>(static_cast<float*>(v.data), v.numel),
                               std::span<const float>(static_cast<const float*>(v.grad), v.numel),
                               std::span<float>(state[i]), {}});
    }
  });
  std::size_t state_unsharded = 0;
  for (const auto& s : state) state_unsharded += s.size() * sizeof(float);

  double diff = 0;
  for (std::size_t i = 0; i < views_s.size(); ++i)
    for (std::size_t k = 0; k < views_s[i].numel; ++k)
      diff = std::max(diff, std::fabs(static_cast<double>(static_cast<const float*>(views_s[i].data)[k]) -
                                      static_cast<double>(static_cast<const float*>(views_u[i].data)[k])));
  const auto all = pg.all_gather(weight_bytes(views_s));
  const bool same_everywhere = std::all_of(all.begin(), all.end(), [&](const std::string& w) { return w == all[0]; });
  const double ideal = static_cast<double>(state_unsharded) / world;
  const bool state_ok = static_cast<double>(state_sharded) <= 1.05 * ideal + 64.0 * 8 * world;
  const bool loss_ok = loss_s < loss_first;
  const bool ok = diff <= bound && same_everywhere && state_ok && loss_ok;
  if (rank == 0) {
    std::printf("%d ranks: loss %.5f -> %.5f (sharded), %.5f (unsharded); pool %zu bytes of bucket buffers\n", world,
                static_cast<double>(loss_first), static_cast<double>(loss_s), static_cast<double>(loss_u),
                dp_s.bucket_bytes_held());
    if (!same_everywhere) std::printf("the ranks' sharded weights differ\n");
    if (!state_ok) std::printf("state %zu bytes is not within 5%% of %.0f\n", state_sharded, ideal);
    if (!loss_ok) std::printf("the loss did not fall\n");
    std::printf("sharded: %s state_bytes_per_rank=%zu unsharded_state_bytes=%zu max_weight_diff=%.3g\n",
                ok ? "OK" : "FAILED", state_sharded, state_unsharded, diff);
  }
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "06_sharded: %s\n", e.what());
  return 1;
}
