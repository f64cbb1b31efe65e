// Data-parallel training of a dlib network, stepped by dlib's own solver: dlib computes the
// gradients (compute_parameter_gradients), ddp averages them across the ranks
// (ddp::dlib_parameters::average), and dlib's SGD with momentum steps the net
// (update_parameters), as it would without ddp.
//
//   ddprun -n 4 build/examples/08_dlib
//
// The net is a 16-64-64-1 MLP (fc, relu, fc, relu, fc under loss_mean_squared) on a synthetic
// regression set, generated from a fixed seed so that every rank can build the whole set and
// train on its shard. Each rank seeds std::rand (which dlib's fc layers draw their initial
// weights from) with its rank: the ranks start from different weights, and the wrapper makes
// them rank 0's. dlib allocates the parameters in the net's first forward, so the program runs
// one forward on its first batch before it wraps the net.
//
// At the end the program checks, and exits non-zero when a check fails:
//  - the final loss fell well below the first epoch's (below 1/4 of it);
//  - the final weights are bitwise equal on every rank (a hash of them, gathered from all);
//  - on rank 0: they are bitwise equal to one process that trains a copy of the net, at each
//    step computing the gradients of every rank's batch in turn, averaging them by hand (summed
//    in rank order, divided by the number of ranks: the arithmetic of ddp's shared-memory
//    reduction, the default for ranks on one host) and stepping with its own copy of the
//    solvers. A reducer that adds in another order (DDP_BACKEND=tcp, a ring, on 3 or more
//    ranks) rounds differently: there the check is a relative 1e-5.
// Rank 0's last line starts with "dlib: OK " when every check passed.
#include <ddp/adapters/dlib.hpp>

#include <ddp/ddp.hpp>

#include <dlib/dnn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

using net_type = dlib::loss_mean_squared<
    dlib::fc<1, dlib::relu<dlib::fc<64, dlib::relu<dlib::fc<64, dlib::input<dlib::matrix<float, 0, 1>>>>>>>>;

constexpr long input_dim = 16;
constexpr int samples_per_rank = 256;
constexpr int batch = 32;  // per rank
constexpr int epochs = 10;
constexpr double learning_rate = 0.05;

// The synthetic task: a smooth nonlinear function of the input, the same on every rank.
struct dataset {
  std::vector<dlib::matrix<float, 0, 1>> x;
  std::vector<float> y;
};

dataset make_dataset(int n) {
  std::mt19937 g(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> a(input_dim), b(input_dim);
  for (auto& v : a) v = u(g);
  for (auto& v : b) v = u(g);
  dataset d;
  for (int s = 0; s < n; ++s) {
    dlib::matrix<float, 0, 1> x(input_dim);
    float pa = 0, pb = 0;
    for (long j = 0; j < input_dim; ++j) {
      x(j) = u(g);
      pa += a[static_cast<std::size_t>(j)] * x(j);
      pb += b[static_cast<std::size_t>(j)] * x(j);
    }
    d.x.push_back(x);
    d.y.push_back(std::sin(pa) + 0.5f * std::tanh(pb) * pa);
  }
  return d;
}

std::vector<dlib::sgd> make_solvers() {
  return std::vector<dlib::sgd>(net_type::num_computational_layers, dlib::sgd(0.0005f, 0.9f));
}

// A hash of every parameter's bits.
std::uint64_t hash(const ddp::dlib_parameters<net_type>& params) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i < params.size(); ++i)
    for (std::size_t k = 0; k < params.numel(i); ++k) {
      std::uint32_t bits;
      std::memcpy(&bits, params.data(i) + k, 4);
      h = (h ^ bits) * 0x100000001b3ull;
    }
  return h;
}

}  // namespace

int main() try {
  auto pg = ddp::init_process_group(ddp::init_options::from_env());
  const int rank = pg.rank(), world = pg.size();
  const dataset data = make_dataset(samples_per_rank * world);
  const int steps_per_epoch = samples_per_rank / batch;
  const auto first = [&](int q, int s) { return static_cast<std::size_t>(q * samples_per_rank + s * batch); };
  // Batch s of rank q's shard, as dlib's input tensor.
  dlib::resizable_tensor x;
  const auto load = [&](net_type& n, int q, int s) {
    n.to_tensor(data.x.begin() + static_cast<std::ptrdiff_t>(first(q, s)),
                data.x.begin() + static_cast<std::ptrdiff_t>(first(q, s) + batch), x);
    return data.y.begin() + static_cast<std::ptrdiff_t>(first(q, s));
  };

  std::srand(1234u + static_cast<unsigned>(rank));  // dlib's fc layers draw their weights from std::rand
  net_type net;
  std::vector<dlib::sgd> solvers = make_solvers();
  load(net, rank, 0);
  net.forward(x);                    // dlib allocates the parameters here
  ddp::dlib_parameters params{net};  // so wrap now: forward order, input layer first
  ddp::bucket_policy buckets;        // small buckets, so that this small net has several
  buckets.cap_bytes = 8 << 10;
  buckets.first_cap_bytes = 1 << 10;
  ddp::data_parallel dp{pg, params, buckets};  // every rank now holds rank 0's weights
  std::size_t count = 0;
  for (std::size_t i = 0; i < params.size(); ++i) count += params.numel(i);
  if (rank == 0)
    std::printf(
        "ddp + dlib: %d ranks, %zu parameters in %zu layers (%s first), %zu buckets, %d samples per rank, "
        "batch %d per rank, dlib::sgd with momentum\n",
        world, count, params.size(), std::string(params.name(0)).c_str(), dp.plan().buckets.size(), samples_per_rank,
        batch);

  // Rank 0's reference: the same net and solvers from the same start, trained in one process.
  net_type ref;
  std::vector<dlib::sgd> ref_solvers;
  if (rank == 0) {
    ref = net;
    ref_solvers = solvers;
  }

  std::vector<double> epoch_loss;
  for (int e = 0; e < epochs; ++e) {
    double sum = 0;
    for (int s = 0; s < steps_per_epoch; ++s) {
      const auto labels = load(net, rank, s);
      sum += net.compute_parameter_gradients(x, labels);  // this rank's gradients
      params.average(dp);                                 // now the average over the ranks
      net.update_parameters(solvers, learning_rate);      // dlib's solver steps
    }
    double loss = sum / steps_per_epoch;
    dp.get_reducer().allreduce(std::span<double>(&loss, 1), ddp::op::avg);  // mean over all shards
    epoch_loss.push_back(loss);
    if (rank == 0) std::printf("epoch %2d  loss %.6f\n", e + 1, loss);
  }

  bool ok = true;
  const double first_loss = epoch_loss.front(), last_loss = epoch_loss.back();
  const bool fell = last_loss < first_loss / 4;
  if (rank == 0)
    std::printf("loss fell from %.6f to %.6f (%.1fx): %s\n", first_loss, last_loss, first_loss / last_loss,
                fell ? "OK" : "FAILED");
  ok = ok && fell;

  // Bitwise equality of the weights: every rank's hash, gathered everywhere.
  char mine[32];
  std::snprintf(mine, sizeof mine, "%016llx", static_cast<unsigned long long>(hash(params)));
  const auto hashes = pg.all_gather(mine);
  const bool equal = std::all_of(hashes.begin(), hashes.end(), [&](const std::string& h) { return h == hashes[0]; });
  if (rank == 0)
    std::printf("final weights bitwise equal on all %d ranks (hash %s): %s\n", world, mine, equal ? "OK" : "FAILED");
  ok = ok && equal;

  if (rank == 0) {
    // One process: each step, every rank's batch in turn through the same net, the gradients
    // summed in rank order and divided by the number of ranks, then the same solver step.
    ddp::dlib_parameters rp{ref};
    std::vector<std::vector<float>> acc(rp.size());
    for (int e = 0; e < epochs; ++e)
      for (int s = 0; s < steps_per_epoch; ++s) {
        for (int q = 0; q < world; ++q) {
          ref.compute_parameter_gradients(x, load(ref, q, s));
          for (std::size_t i = 0; i < rp.size(); ++i) {
            const float* g = rp.grad(i);
            if (q == 0)
              acc[i].assign(g, g + rp.numel(i));
            else
              for (std::size_t k = 0; k < acc[i].size(); ++k) acc[i][k] += g[k];
          }
        }
        for (std::size_t i = 0; i < rp.size(); ++i)
          for (std::size_t k = 0; k < acc[i].size(); ++k) rp.grad(i)[k] = acc[i][k] / static_cast<float>(world);
        ref.update_parameters(ref_solvers, learning_rate);
      }
    const std::uint64_t ref_hash = hash(rp);
    double max_diff = 0;
    for (std::size_t i = 0; i < rp.size(); ++i)
      for (std::size_t k = 0; k < rp.numel(i); ++k)
        max_diff = std::max(max_diff, std::fabs(static_cast<double>(params.data(i)[k]) - rp.data(i)[k]) /
                                          std::max(1.0, std::fabs(static_cast<double>(rp.data(i)[k]))));
    // Two ranks' average is one addition, the same in any order; more need the rank order.
    const bool rank_order = world <= 2 || dp.get_reducer().chosen() == ddp::backend::shm;
    const bool bitwise = ref_hash == hash(params);
    const bool same = rank_order ? bitwise : max_diff <= 1e-5;
    std::printf(
        "one process hand-averaging the %d shards' gradients (%s reducer): %s%s (max relative difference "
        "%.3g)\n",
        world, ddp::backend_name(dp.get_reducer().chosen()), bitwise ? "bitwise equal" : "not bitwise equal",
        same ? ", OK" : ", FAILED", max_diff);
    ok = ok && same;
    if (ok)
      std::printf(
          "dlib: OK %d ranks, %zu parameters, %d steps of dlib::sgd, loss %.4f -> %.4f, weights bitwise equal "
          "on every rank and %s the one-process hand-averaged run (hash %s)\n",
          world, count, epochs * steps_per_epoch, first_loss, last_loss,
          bitwise ? "bitwise equal to" : "within relative 1e-5 of", mine);
    else
      std::printf("dlib: FAILED (see above)\n");
  }
  // Every rank exits with the verdict of all checks.
  double verdict = ok ? 0.0 : 1.0;
  dp.get_reducer().allreduce(std::span<double>(&verdict, 1), ddp::op::max);
  return verdict == 0.0 ? 0 : 1;
} catch (const ddp::error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
