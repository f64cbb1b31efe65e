// The LibTorch adapter with CUDA tensors. A module on the GPU is wrapped and trained on 2 ranks;
// when backward() returns, every parameter's .grad() holds the average of the ranks' local
// gradients, which each rank computes itself on the same device from every rank's batch (seeded).
// One GPU: the 2 ranks share it through ring<shm> with page-locked buckets filled by CUDA copies
// (tests/cuda/staging_allocator.hpp), since NCCL refuses two ranks on one device; NCCL runs a
// world of 1 there (buckets on the device), and 2 ranks where there are 2 GPUs.
//
// A CUDA context does not survive fork: this process never touches CUDA (a child asks LibTorch
// whether CUDA is there) and each rank is a fresh child. Without CUDA (no device, or a LibTorch
// built for the CPU only): exit 77 (SKIP).

#define DOCTEST_CONFIG_IMPLEMENT
#include "../torch/torch_doctest.hpp"

#include <ddp/memory/cuda_allocator.hpp>
#include <ddp/reducer/nccl.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/shm.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "staging_allocator.hpp"
#include "../multiproc/harness.hpp"

using namespace std::chrono_literals;

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 32));
    fc3 = register_module("fc3", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

// CUDA devices LibTorch sees, asked in a child so that this process keeps no CUDA context.
int cuda_devices_in_child() {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    int n = 0;
    try {
      n = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
    } catch (...) {
    }
    ::_exit(n > 100 ? 100 : n);
  }
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
  return WEXITSTATUS(status);
}

// The same weights on every rank (no initial broadcast: see staging_allocator.hpp).
Mlp make_model(const torch::Device& dev) {
  torch::manual_seed(7);
  Mlp net;
  net->to(dev);
  return net;
}

std::pair<torch::Tensor, torch::Tensor> batch(int rank, int step, const torch::Device& dev) {
  torch::manual_seed(1000 * step + rank);
  return {torch::randn({8, 16}).to(dev), torch::randint(0, 4, {8}).to(dev)};
}

torch::Tensor loss_of(Mlp& net, int rank, int step, const torch::Device& dev) {
  auto [x, y] = batch(rank, step, dev);
  return torch::nn::functional::cross_entropy(net->forward(x), y);
}

// The average over `world` ranks of the local gradients of `step`, from `net`'s weights.
std::vector<torch::Tensor> expected_grads(Mlp& net, int world, int step, const torch::Device& dev) {
  Mlp copy = make_model(dev);
  {
    torch::NoGradGuard g;
    auto src = net->parameters();
    auto dst = copy->parameters();
    for (std::size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  std::vector<torch::Tensor> sum;
  for (int r = 0; r < world; ++r) {
    copy->zero_grad();
    loss_of(copy, r, step, dev).backward();
    auto ps = copy->parameters();
    for (std::size_t i = 0; i < ps.size(); ++i) {
      if (sum.size() <= i) sum.push_back(ps[i].grad().clone());
      else sum[i] += ps[i].grad();
    }
  }
  for (auto& g : sum) g /= world;
  return sum;
}

void require_close(Mlp& net, const std::vector<torch::Tensor>& want, int rank, int step) {
  auto ps = net->parameters();
  for (std::size_t i = 0; i < ps.size(); ++i) {
    ddp_test::require(ps[i].grad().is_cuda(), "gradient " + std::to_string(i) + " left the device");
    const double err = (ps[i].grad() - want[i]).abs().max().item<double>();
    const double scale = want[i].abs().max().item<double>() + 1e-12;
    ddp_test::require(err <= 1e-5 * scale, "rank " + std::to_string(rank) + " step " + std::to_string(step) +
                                               ": gradient " + std::to_string(i) + " off by " + std::to_string(err) +
                                               " (scale " + std::to_string(scale) + ")");
  }
}

// One rank: 3 steps of SGD on device `dev` under wrapper type Dp.
template <class Dp>
void train(int rank, int world, int port, int device, ddp::backend b, bool staged) {
  const torch::Device dev(torch::kCUDA, static_cast<c10::DeviceIndex>(device));
  auto net = make_model(dev);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  auto o = ddp_test::group_options(rank, world, port, 30s, b);
  o.local_rank = rank;  // the NCCL reducer's device: local rank % device count
  auto pg = ddp::init_process_group(o);
  Dp dp{pg, *net, ddp::bucket_policy{.cap_bytes = 4096, .first_cap_bytes = 4096},
        ddp::dp_options{.broadcast_parameters = !staged}};
  for (int s = 0; s < 3; ++s) {
    const auto want = expected_grads(net, world, s, dev);
    opt.zero_grad();
    loss_of(net, rank, s, dev).backward();
    require_close(net, want, rank, s);
    opt.step();
  }
}

using staged_shm = ddp::basic_torch_data_parallel<ddp::size_planner, ddp::ring<ddp::shm>, ddp_test::pinned_staging>;
using on_nccl = ddp::basic_torch_data_parallel<ddp::size_planner, ddp::nccl_reducer, ddp::cuda_allocator>;

void check_all(const std::vector<ddp_test::outcome>& outs) {
  for (const auto& o : outs) CHECK_MESSAGE(o.ok(), "rank " << o.rank << " exit " << o.exit_code << ": " << o.message);
}

int devices = 0;

}  // namespace

TEST_SUITE("torch_cuda") {
  TEST_CASE("CUDA tensors, 2 ranks sharing one GPU: ring<shm> through page-locked buckets") {
    const int port = ddp_test::free_port();
    check_all(ddp_test::run_processes(
        {0, 1}, [&](int r) { train<staged_shm>(r, 2, port, 0, ddp::backend::automatic, true); }, 180s));
  }

  TEST_CASE("CUDA tensors, nccl_reducer + cuda_allocator: a world of 1; 2 ranks where there are 2 GPUs") {
    const int port = ddp_test::free_port();
    check_all(ddp_test::run_processes(
        {0}, [&](int r) { train<on_nccl>(r, 1, port, 0, ddp::backend::nccl, false); }, 180s));
    if (devices < 2) {
      MESSAGE("one GPU: NCCL needs one GPU per rank, so only the world of 1 ran");
      return;
    }
    const int port2 = ddp_test::free_port();
    check_all(ddp_test::run_processes(
        {0, 1}, [&](int r) { train<on_nccl>(r, 2, port2, r, ddp::backend::nccl, false); }, 180s));
  }
}

int main(int argc, char** argv) {
  doctest::Context ctx(argc, argv);
  devices = cuda_devices_in_child();
  if (devices == 0) ctx.addFilter("test-suite-exclude", "torch_cuda");
  const int rc = ctx.run();
  if (ctx.shouldExit() || rc != 0) return rc;
  if (devices == 0) {
    std::fprintf(stderr, "LibTorch sees no CUDA device (none here, or a LibTorch built for the CPU only): skipped\n");
    return 77;
  }
  return 0;
}
