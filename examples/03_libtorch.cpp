// Data-parallel training of a small LibTorch CNN: a torch::nn::Module, gradients from autograd,
// and ddp::torch_data_parallel averaging them across ranks while backward runs.
//
//   ddprun -n 4 build/examples/03_libtorch
//
// Rank 0's initial weights are copied to every rank when the wrapper is built (each rank starts
// from its own seed, to show it). Each step, rank r trains on its own batch of a generated
// dataset (samples ((s * world) + r) * batch ...); gradients arrive through autograd's hooks,
// and when loss.backward() returns they hold the average over the ranks, as with PyTorch's
// DistributedDataParallel. At the end the program checks that every rank holds bitwise the same
// weights and that the loss fell, and exits non-zero otherwise.
//
// The same run under PyTorch's own DistributedDataParallel (examples/03_libtorch_ddp.py):
//   ddprun -n 4 build/examples/03_libtorch --steps 20 --init init.bin --out ddp.bin
//   /usr/bin/python3 examples/03_libtorch_ddp.py --init init.bin --ranks 4 --steps 20 --compare ddp.bin
// --init writes (rank 0) the weights every rank starts from and the dataset; --out the weights
// after the last step. --bench K times K steps instead (CSV on stdout, see bench/torch_cnn.py).
//
// --sharded trains with AdamW sharded over the ranks (dp_options::shard, docs/sharded.md): each
// rank keeps the AdamW state of its shard, and dp.wrapper().step(ddp::adamw) replaces the
// optimizer's step; the Python side then uses PyTorch's ZeroRedundancyOptimizer over AdamW
// (--sharded there too), and the weights agree as they do for SGD.
//
// --powersgd R sends the gradients as rank-R PowerSGD factors (ddp::powersgd over the default
// reducer, plain allreduce for the first --powersgd-warmup steps, 10 by default); tests/torch/
// powersgd_loss.sh compares its final loss with the uncompressed run's (and with PyTorch's
// powerSGD_hook through 03_libtorch_ddp.py --powersgd R).
// --fp8 sends them as block-scaled e4m3 (ddp::fp8_compress with error feedback; --fp8-no-feedback
// without); tests/torch/fp8_loss.sh compares its loss with the uncompressed run's.
#include <ddp/adapters/libtorch.hpp>
#include <ddp/optim/adamw.hpp>
#include <ddp/reducer/fp8_compress.hpp>
#include <ddp/reducer/powersgd.hpp>

#include "tensor_file.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

struct options {
  int steps = 30;
  int batch = 16;
  int width = 1;        // channel multiplier: --width 4 has about 16x the parameters
  int batches = 8;      // distinct batches per rank; step s uses batch s % batches
  double lr = 0.05;
  double momentum = 0.9;
  int bench = 0;        // timed steps (0: train)
  int warmup = 3;
  bool view = false;    // gradient as bucket view
  bool sharded = false;  // AdamW sharded over the ranks (ZeRO-2)
  int powersgd = 0;      // PowerSGD's rank (0: uncompressed)
  int powersgd_warmup = 10;
  int fp8 = 0;  // 1: ddp::fp8_compress (e4m3, error feedback); 2: without error feedback
  double weight_decay = 0.01;  // AdamW's (PyTorch's default)
  std::string init, out;
};

// Conv(1 -> 8w, 3) relu maxpool2, conv(8w -> 16w, 3) relu, fc(16w*3*3 -> 64) relu, fc(64 -> 10),
// on 1x12x12 inputs. examples/03_libtorch_ddp.py builds the same layers in the same order.
struct CnnImpl : torch::nn::Module {
  explicit CnnImpl(int w)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8 * w, 3)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8 * w, 16 * w, 3)))),
        fc1(register_module("fc1", torch::nn::Linear(16 * w * 3 * 3, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);
    x = torch::relu(conv2(x));
    return fc2(torch::relu(fc1(x.flatten(1))));
  }
  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Cnn);

// A learnable task: ten classes, each a fixed random 12x12 pattern; a sample is its class's
// pattern under noise.
std::pair<torch::Tensor, torch::Tensor> make_dataset(std::int64_t n) {
  torch::manual_seed(1234);
  auto patterns = torch::randn({10, 1, 12, 12});
  auto y = torch::randint(0, 10, {n});
  auto x = patterns.index_select(0, y) + torch::randn({n, 1, 12, 12});
  return {x, y};
}

std::vector<std::pair<std::string, torch::Tensor>> named(Cnn& net) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : net->named_parameters()) out.emplace_back(p.key(), p.value().detach());
  return out;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--steps") o.steps = std::stoi(next());
    else if (a == "--batch") o.batch = std::stoi(next());
    else if (a == "--width") o.width = std::stoi(next());
    else if (a == "--lr") o.lr = std::stod(next());
    else if (a == "--bench") o.bench = std::stoi(next());
    else if (a == "--warmup") o.warmup = std::stoi(next());
    else if (a == "--view") o.view = true;
    else if (a == "--sharded") o.sharded = true;
    else if (a == "--powersgd") o.powersgd = std::stoi(next());
    else if (a == "--powersgd-warmup") o.powersgd_warmup = std::stoi(next());
    else if (a == "--fp8") o.fp8 = 1;
    else if (a == "--fp8-no-feedback") o.fp8 = 2;
    else if (a == "--init") o.init = next();
    else if (a == "--out") o.out = next();
    else throw std::runtime_error("unknown argument " + a);
  }
  return o;
}

// The slowest rank's time per step: a synchronized step ends when its last rank does.
std::vector<double> slowest(ddp::process_group& pg, std::vector<double> ms) {
  pg.all_reduce(std::span<double>(ms), ddp::op::max);
  return ms;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : (v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]));
}

}  // namespace

template <class DP>
int run(const options& o, ddp::process_group& pg, Cnn& net, const torch::Tensor& x, const torch::Tensor& y, DP& dp);

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  torch::set_num_threads(1);  // one core per rank, as the PyTorch side
  auto pg = ddp::init_process_group(ddp::init_options::from_env());
  const int rank = pg.rank(), world = pg.size();

  const auto [x, y] = make_dataset(static_cast<std::int64_t>(o.batch) * world * o.batches);
  torch::manual_seed(100 + rank);  // each rank its own initial weights: rank 0's must win
  Cnn net(o.width);
  const ddp::dp_options dpo{.gradient_as_bucket_view = o.view, .shard = o.sharded};
  const auto train = [&](auto& dp) { return run(o, pg, net, x, y, dp); };
  if (o.powersgd > 0) {
    const ddp::powersgd_options po{.rank = static_cast<std::size_t>(o.powersgd),
                                   .start_iter = static_cast<std::uint64_t>(o.powersgd_warmup)};
    ddp::basic_torch_data_parallel<ddp::size_planner, ddp::hooked<ddp::auto_reducer, ddp::powersgd>> dp{
        pg, *net, ddp::bucket_policy{}, dpo, ddp::powersgd{po}};
    return train(dp);
  }
  if (o.fp8 > 0) {
    ddp::basic_torch_data_parallel<ddp::size_planner, ddp::hooked<ddp::auto_reducer, ddp::fp8_compress>> dp{
        pg, *net, ddp::bucket_policy{}, dpo, ddp::fp8_compress{{.error_feedback = o.fp8 == 1}}};
    return train(dp);
  }
  ddp::torch_data_parallel dp{pg, *net, ddp::bucket_policy{}, dpo};
  return train(dp);
} catch (const std::exception& e) {
  std::fprintf(stderr, "03_libtorch: %s\n", e.what());
  return 1;
}

// Trains (or times, --bench) with the wrapper `dp`; returns the exit code.
template <class DP>
int run(const options& o, ddp::process_group& pg, Cnn& net, const torch::Tensor& x, const torch::Tensor& y, DP& dp) {
  const int rank = pg.rank(), world = pg.size();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(o.lr).momentum(o.momentum));
  ddp::adamw sharded_opt{{.lr = o.lr, .weight_decay = o.weight_decay}};
  if (rank == 0 && !o.init.empty()) {
    auto ts = named(net);
    ts.emplace_back("data.x", x);
    ts.emplace_back("data.y", y);
    example::write_tensors(o.init, ts);
  }
  const auto batch_of = [&](int step) {
    const std::int64_t first = (static_cast<std::int64_t>(step % o.batches) * world + rank) * o.batch;
    return std::pair{x.narrow(0, first, o.batch), y.narrow(0, first, o.batch)};
  };
  const auto loss_at = [&](int step) {
    const auto [bx, by] = batch_of(step);
    return torch::nn::functional::cross_entropy(net->forward(bx), by);
  };

  if (o.bench > 0) {
    // Each step twice, interleaved: under no_sync() (backward alone) and synchronized; the
    // difference of the medians is what synchronizing costs.
    std::vector<double> sync, local;
    const auto timed = [&](int step) {
      pg.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      loss_at(step).backward();
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    };
    for (int i = 0; i < o.warmup + o.bench; ++i) {
      opt.zero_grad();
      double t_local;
      {
        auto guard = dp.no_sync();
        t_local = timed(i);
      }
      opt.zero_grad();
      const double t_sync = timed(i);
      if (i >= o.warmup) {
        local.push_back(t_local);
        sync.push_back(t_sync);
      }
    }
    sync = slowest(pg, sync);
    local = slowest(pg, local);
    std::size_t elems = 0;
    for (const auto& p : net->parameters()) elems += static_cast<std::size_t>(p.numel());
    if (rank == 0)
      std::printf("ddp,%d,%d,%zu,%d,%.3f,%.3f,%.3f\n", world, o.width, elems, o.bench, median(sync), median(local),
                  median(sync) - median(local));
    return 0;
  }

  double first_loss = 0, last_loss = 0, tail_loss = 0;  // tail: the mean over the last (up to) 10 steps
  const int tail_steps = std::min(10, o.steps);
  for (int step = 0; step < o.steps; ++step) {
    opt.zero_grad();
    auto loss = loss_at(step);
    loss.backward();  // when it returns, every gradient holds the average over the ranks
    if (o.sharded)
      dp.wrapper().step(sharded_opt);  // this rank's shard of the average steps; the weights are gathered
    else
      opt.step();
    // The mean loss over the ranks, for the log: a scalar allreduce from the group.
    const double mean_loss = pg.all_reduce(loss.template item<double>(), ddp::op::avg);
    if (step == 0) first_loss = mean_loss;
    last_loss = mean_loss;
    if (step >= o.steps - tail_steps) tail_loss += mean_loss / tail_steps;
    if (rank == 0 && (step % 5 == 0 || step + 1 == o.steps))
      std::printf("step %3d  loss %.4f  (%zu buckets)\n", step, mean_loss, dp.wrapper().plan().buckets.size());
  }
  if (rank == 0 && !o.out.empty()) example::write_tensors(o.out, named(net));

  // Every rank must hold the same weights, bit for bit.
  std::string bytes;
  for (const auto& p : net->parameters())
    bytes.append(static_cast<const char*>(p.data_ptr()), static_cast<std::size_t>(p.numel()) * sizeof(float));
  const auto all = pg.all_gather(std::string(std::to_string(std::hash<std::string>{}(bytes))));
  const bool same = std::all_of(all.begin(), all.end(), [&](const std::string& h) { return h == all[0]; });
  const bool learned = o.steps < 30 || last_loss < 0.5 * first_loss;  // 30 steps end near 0.15-0.3 of it
  if (rank == 0)
    std::printf("loss %.4f -> %.4f (mean of the last %d steps %.4f); weights %s on all %d ranks\n", first_loss,
                last_loss, tail_steps, tail_loss, same ? "bitwise equal" : "DIFFER", world);
  return same && learned ? 0 : 1;
}
