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
//
// With --elastic the same two runs go on together in an elastic group under
// `ddprun -n 4 --elastic 2:4` (docs/sharded.md, "Surviving failures"):
//
//   ddprun -n 4 --elastic 2:4 --max-restarts 30 build/examples/06_sharded --elastic --min-seconds 30
//
// Each shard of the sharded run's AdamW state is held by two ranks (dp_options::shard_replicas,
// 2 by default on an elastic group); a rank killed or frozen costs the step in flight, and the
// survivors re-shard the state in memory, no checkpoint read and no step repeated; a replacement
// gets its shards from live holders. The unsharded run beside it keeps its whole AdamW state on
// every rank (a newcomer gets rank 0's). Training stops once --min-seconds passed (and the file
// of --stop-file exists, if given); then every rank checks that its sharded weights are the
// unsharded run's bit for bit, rank 0 that the sharded AdamW state (sharded_state()) is the
// unsharded state bit for bit, and that the loss fell. Rank 0's last line:
//   sharded elastic: OK steps=N failures=F sizes=4,3,... generations=G
#include <ddp/ddp.hpp>
#include <ddp/group/elastic.hpp>

#include "elastic_verdict.hpp"
#include "mlp_model.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
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
    loss =
        net.forward_backward(&data.x[static_cast<std::size_t>(first) * input_dim],
                             &data.y[static_cast<std::size_t>(first)], batch, [&](std::size_t i) { dp.grad_ready(i); });
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

/// The AdamW of the unsharded run: each weight of `views` stepped whole, its state in `state`.
void step_whole(const ddp::adamw& opt, const std::vector<ddp::tensor_view>& views,
                std::vector<std::vector<float>>& state, std::uint64_t t) {
  for (std::size_t i = 0; i < state.size(); ++i) {
    const auto& v = views[i];
    opt.step(ddp::shard_step{i,
                             t,
                             std::span<float>(static_cast<float*>(v.data), v.numel),
                             std::span<const float>(static_cast<const float*>(v.grad), v.numel),
                             std::span<float>(state[i]),
                             {}});
  }
}

double loss_over(mlp& net, const dataset& data) {
  double sum = 0;
  for (int first = 0; first + batch <= data.n; first += batch)
    sum += net.forward_backward(&data.x[static_cast<std::size_t>(first) * input_dim],
                                &data.y[static_cast<std::size_t>(first)], batch, [](std::size_t) {});
  return sum / (data.n / batch);
}

/// --elastic: both runs in one elastic group, checked against each other at the end.
int run_elastic(double min_seconds, const std::string& stop_file) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto options = ddp::init_options::from_env();
  ddp::elastic_group eg{options, {.verbose = true}};
  const dataset data = make_dataset(samples_per_rank * 4);
  const ddp::adamw opt{{.lr = 1e-3, .weight_decay = 0.01}};
  // Each process starts apart; each generation's wrappers give every rank the group's weights.
  const unsigned seed = 7 + static_cast<unsigned>(options.rank) + static_cast<unsigned>(::getpid() % 1000);
  mlp net_s(wide_dims, seed), net_u(wide_dims, seed);
  // The same buckets for both (an extra parameter in one would cut its buckets elsewhere, and
  // the allreduce would add some elements' ranks in another order).
  const auto views_s = net_s.parameters(), views_u = net_u.parameters();
  std::vector<std::vector<float>> state_u;
  for (const auto& v : views_u) state_u.emplace_back(2 * v.numel, 0.0f);
  double first_loss = -1;
  bool stop = false;
  // A newcomer's unsharded AdamW state and the counts come from rank 0; the sharded state from
  // the shards' holders (the wrapper's construction).
  eg.on_state(
      [&] {
        std::string s(reinterpret_cast<const char*>(&first_loss), sizeof first_loss);
        s += stop ? '1' : '0';
        for (const auto& st : state_u) s.append(reinterpret_cast<const char*>(st.data()), st.size() * sizeof(float));
        return s;
      },
      [&](std::string_view s) {
        std::memcpy(&first_loss, s.data(), sizeof first_loss);
        stop = s[sizeof first_loss] == '1';
        std::size_t at = sizeof first_loss + 1;
        for (auto& st : state_u) {
          std::memcpy(st.data(), s.data() + at, st.size() * sizeof(float));
          at += st.size() * sizeof(float);
        }
      });
  std::optional<ddp::data_parallel> dp_s, dp_u;
  eg.on_form([&](ddp::process_group& g) {
    dp_s.reset();  // first: its shards move into the next wrapper
    dp_u.reset();
    dp_s.emplace(g, views_s, ddp::bucket_policy{}, ddp::dp_options{.shard = true});
    dp_u.emplace(g, views_u);
  });
  const auto left = [] {
    std::printf("the job finished while this process had no seat in the group\n");
    return 0;
  };
  if (!eg.start()) return left();
  std::vector<float> x(static_cast<std::size_t>(batch) * input_dim), y(batch);
  while (!stop) try {
      const int rank = eg.rank(), world = eg.size();
      // This step's batch: the ranks of the world take consecutive batches of the data.
      for (int i = 0; i < batch; ++i) {
        const auto idx = static_cast<std::size_t>(
            ((eg.step() * static_cast<std::uint64_t>(world) + static_cast<std::uint64_t>(rank)) * batch +
             static_cast<std::uint64_t>(i)) %
            static_cast<std::uint64_t>(data.n));
        std::memcpy(&x[static_cast<std::size_t>(i) * input_dim], &data.x[idx * input_dim], input_dim * sizeof(float));
        y[static_cast<std::size_t>(i)] = data.y[idx];
      }
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // Rank 0 says "stop" in a small allreduce of the group, which ends every rank's loop at the
      // same committed step.
      float stop_vote = rank == 0 && elapsed >= min_seconds && (stop_file.empty() || std::filesystem::exists(stop_file))
                            ? 1.0f
                            : 0.0f;
      eg.group().all_reduce(std::span<float>(&stop_vote, 1), ddp::op::max);
      const float loss = net_s.forward_backward(x.data(), y.data(), batch, [&](std::size_t i) { dp_s->grad_ready(i); });
      dp_s->finish();
      net_u.forward_backward(x.data(), y.data(), batch, [&](std::size_t i) { dp_u->grad_ready(i); });
      dp_u->finish();
      eg.commit([&] {
        // The step is committed: the unsharded run's step, then the sharded run's (its shards
        // are stepped whole even when its all-gather fails; the next generation rebuilds the
        // weights from them).
        step_whole(opt, views_u, state_u, eg.step());
        stop = stop_vote == 1.0f;
        if (first_loss < 0) first_loss = loss;
        dp_s->step(opt);
      });
    } catch (const ddp::error& e) {
      std::fprintf(stderr, "[ddp.elastic] rank %d: %s\n", eg.rank(), e.what());
      if (!eg.recover(e)) return left();
    }
  for (;;) try {
      // Every rank: the sharded weights are the unsharded run's, bit for bit, and alike everywhere.
      bool same = true;
      for (std::size_t i = 0; i < views_s.size(); ++i)
        same = same && std::memcmp(views_s[i].data, views_u[i].data, views_s[i].bytes()) == 0;
      const auto all = eg.group().all_gather(weight_bytes(views_s));
      const bool equal = std::all_of(all.begin(), all.end(), [&](const std::string& w) { return w == all[0]; });
      double bad = same && equal ? 0 : 1;
      eg.group().all_reduce(std::span<double>(&bad, 1), ddp::op::max);
      // Rank 0: the sharded AdamW state, gathered, is the unsharded state, bit for bit.
      const auto blob = dp_s->sharded_state();
      int code = bad == 0 ? 0 : 1;
      if (eg.rank() == 0) {
        std::size_t at = 8 + 5 * 8 + 8 * views_s.size();
        bool state_same = blob.size() >= at;
        for (const auto& st : state_u) {
          state_same = state_same && blob.size() >= at + st.size() * 4 &&
                       std::memcmp(blob.data() + at, st.data(), st.size() * 4) == 0;
          at += st.size() * 4;
        }
        state_same = state_same && at == blob.size();
        const double final_loss = loss_over(net_s, data);
        const bool fell = final_loss < first_loss;
        std::printf("sharded weights bitwise the unsharded run's on every rank: %s; alike on all %d ranks: %s\n",
                    bad == 0 ? "OK" : "FAILED", eg.size(), equal ? "OK" : "FAILED");
        std::printf("sharded AdamW state (%llu steps) bitwise the unsharded state: %s\n",
                    static_cast<unsigned long long>(dp_s->sharded_steps()), state_same ? "OK" : "FAILED");
        std::printf("loss %.6f at the first step, %.6f over the data at the end: %s\n", first_loss, final_loss,
                    fell ? "OK" : "FAILED");
        if (!state_same || !fell) code = 1;
      }
      return elastic_example::conclude(eg, "sharded elastic", code);
    } catch (const ddp::error& e) {
      std::fprintf(stderr, "[ddp.elastic] rank %d (final checks): %s\n", eg.rank(), e.what());
      if (!eg.recover(e)) return left();
    }
}

}  // namespace

int main(int argc, char** argv) try {
  bool elastic = false;
  double min_seconds = 0;
  std::string stop_file;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--elastic") {
      elastic = true;
    } else if (a == "--min-seconds" && i + 1 < argc) {
      min_seconds = std::atof(argv[++i]);
    } else if (a == "--stop-file" && i + 1 < argc) {
      stop_file = argv[++i];
    } else {
      std::fprintf(stderr, "usage: 06_sharded [--elastic [--min-seconds S] [--stop-file F]]\n");
      return 2;
    }
  }
  if (elastic) return run_elastic(min_seconds, stop_file);
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
      opt.step(ddp::shard_step{i,
                               t,
                               std::span<float>(static_cast<float*>(v.data), v.numel),
                               std::span<const float>(static_cast<const float*>(v.grad), v.numel),
                               std::span<float>(state[i]),
                               {}});
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
