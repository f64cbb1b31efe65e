// The whole model under ddp::torch_data_parallel, for the side-by-side run against PyTorch's
// DistributedDataParallel (tests/torch/whole_model.sh, whole_model_ddp.py): a CNN with a frozen
// first convolution and two BatchNorm layers, on ranks that each start from their own weights and
// their own running statistics, trained with SGD and momentum, optionally with gradient
// accumulation (--accumulate K: K - 1 micro-batches under no_sync(), then a synchronized one).
//
//   ddprun -n 4 whole_model --init init.bin --out out --steps 12 --accumulate 2 --buffers broadcast
//
// Rank 0 writes (--init) its state and the dataset before wrapping: what every rank must start
// from. Every rank writes its state after the last step to <out>.rank<r>: parameters (frozen ones
// too) and buffers, which the Python side compares with its own ranks'.
#include <ddp/adapters/libtorch.hpp>

#include "../../examples/tensor_file.hpp"

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

struct options {
  int steps = 12;
  int batch = 8;
  int batches = 6;
  int accumulate = 1;
  double lr = 0.05;
  double momentum = 0.9;
  ddp::buffer_sync buffers = ddp::buffer_sync::broadcast;
  std::string init, out;
};

// conv1 (frozen) bn1 relu maxpool2, conv2 bn2 relu, fc; whole_model_ddp.py builds the same.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(8))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(16))),
        fc(register_module("fc", torch::nn::Linear(16 * 3 * 3, 10))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);
    x = torch::relu(bn2(conv2(x)));
    return fc(x.flatten(1));
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Linear fc;
};
TORCH_MODULE(Net);

std::pair<torch::Tensor, torch::Tensor> make_dataset(std::int64_t n) {
  torch::manual_seed(4321);
  auto patterns = torch::randn({10, 1, 12, 12});
  auto y = torch::randint(0, 10, {n});
  return {patterns.index_select(0, y) + torch::randn({n, 1, 12, 12}), y};
}

std::vector<std::pair<std::string, torch::Tensor>> state_of(Net& net) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : net->named_parameters()) out.emplace_back(p.key(), p.value().detach());
  for (const auto& b : net->named_buffers()) out.emplace_back(b.key(), b.value().detach());
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
    else if (a == "--accumulate") o.accumulate = std::stoi(next());
    else if (a == "--init") o.init = next();
    else if (a == "--out") o.out = next();
    else if (a == "--buffers") {
      const std::string v = next();
      o.buffers = v == "broadcast" ? ddp::buffer_sync::broadcast
                  : v == "none"    ? ddp::buffer_sync::none
                  : v == "average" ? ddp::buffer_sync::average
                                   : throw std::runtime_error("--buffers broadcast|none|average");
    } else throw std::runtime_error("unknown argument " + a);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  torch::set_num_threads(1);
  auto pg = ddp::init_process_group(ddp::init_options::from_env());
  const int rank = pg.rank(), world = pg.size();
  const auto [x, y] = make_dataset(static_cast<std::int64_t>(o.batch) * world * o.batches);

  torch::manual_seed(100 + rank);  // every rank its own weights and statistics: rank 0's must win
  Net net;
  {
    torch::NoGradGuard no_grad;
    for (auto* bn : {&*net->bn1, &*net->bn2}) {
      bn->running_mean.fill_(rank == 0 ? 7.0 : -3.0 * rank);
      bn->running_var.fill_(1.0 + rank);
      bn->num_batches_tracked.fill_(10 * rank);
    }
  }
  for (auto& p : net->conv1->parameters()) p.set_requires_grad(false);  // a frozen layer
  if (rank == 0 && !o.init.empty()) {
    auto ts = state_of(net);
    ts.emplace_back("data.x", x);
    ts.emplace_back("data.y", y);
    example::write_tensors(o.init, ts);
  }
  ddp::torch_data_parallel dp{pg, *net, ddp::bucket_policy{}, {.buffers = o.buffers}};
  std::vector<torch::Tensor> trained;
  for (const auto& p : net->parameters())
    if (p.requires_grad()) trained.push_back(p);
  torch::optim::SGD opt(trained, torch::optim::SGDOptions(o.lr).momentum(o.momentum));

  for (int step = 0; step < o.steps; ++step) {
    opt.zero_grad();
    for (int k = 0; k < o.accumulate; ++k) {
      const std::int64_t micro = static_cast<std::int64_t>(step) * o.accumulate + k;
      const std::int64_t first = ((micro % o.batches) * world + rank) * o.batch;
      const auto loss = torch::nn::functional::cross_entropy(net->forward(x.narrow(0, first, o.batch)),
                                                             y.narrow(0, first, o.batch));
      if (k + 1 < o.accumulate) {
        auto local = dp.no_sync();
        loss.backward();
      } else {
        loss.backward();
      }
    }
    opt.step();
  }
  if (!o.out.empty()) example::write_tensors(o.out + ".rank" + std::to_string(rank), state_of(net));
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "whole_model: %s\n", e.what());
  return 1;
}
