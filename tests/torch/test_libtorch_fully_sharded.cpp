// The LibTorch fully sharded wrapper (ddp::torch_fully_sharded, ZeRO-3) on real processes: a
// small pre-norm residual network whose blocks are units and whose root takes the rest, trained
// by autograd through the units' forward; the weights equal unsharded training (the gradients
// averaged in the same process from every rank's batch, the same AdamW) bit for bit on 2 ranks
// and within float rounding on 4; and what a LibTorch user can get wrong is a clear error.

#include "torch_doctest.hpp"

#include <ddp/optim/adamw.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/transport/tcp.hpp>

#include "multiproc/harness.hpp"
#include "raises.hpp"

#include <cmath>
#include <functional>
#include <string>
#include <vector>

using namespace std::chrono_literals;
using ddp_test::group_options;

namespace {

constexpr int dim = 64, hidden = 192, batch_rows = 8;

struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    fc1 = register_module("fc1", torch::nn::Linear(dim, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::gelu(fc1(ln(x)))); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

/// Runs each block through the fully sharded wrapper when `through` is set, else directly.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    in = register_module("in", torch::nn::Linear(16, dim));
    for (int b = 0; b < 3; ++b) blocks.push_back(register_module("block" + std::to_string(b), Block()));
    head = register_module("head", torch::nn::Linear(dim, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = in(x);
    for (auto& b : blocks) h = through ? through(b, h) : b->forward(h);
    return head(h);
  }
  torch::nn::Linear in{nullptr}, head{nullptr};
  std::vector<Block> blocks;
  std::function<torch::Tensor(Block&, const torch::Tensor&)> through;  // a block through the wrapper
};
TORCH_MODULE(Net);

Net make_net(int seed) {
  torch::manual_seed(seed);
  return Net();
}

std::vector<std::shared_ptr<torch::nn::Module>> units_of(Net& net) {
  return {net->blocks[0].ptr(), net->blocks[1].ptr(), net->blocks[2].ptr(), net.ptr()};
}

std::pair<torch::Tensor, torch::Tensor> batch(int r, int s) {
  torch::manual_seed(7000 + 100 * s + r);
  return {torch::randn({batch_rows, 16}), torch::randn({batch_rows, 4})};
}

torch::Tensor loss_of(const torch::Tensor& out, int r, int s) { return torch::mse_loss(out, batch(r, s).second); }

/// Unsharded training in one process: each step the gradients of every rank's batch, summed in
/// rank order and averaged, then ddp::adamw on every parameter, in the wrapper's (unit) order.
std::vector<torch::Tensor> reference(int world, int steps, const ddp::adamw& opt_in, int seed) {
  auto net = make_net(seed);
  ddp::adamw opt = opt_in;
  auto units = units_of(net);
  // The parameters in unit order, as the wrapper lays them out.
  std::vector<torch::Tensor> ps;
  {
    auto all = net->parameters();
    for (auto& b : net->blocks)
      for (auto& p : b->parameters()) ps.push_back(p);
    ps.push_back(net->in->weight);
    ps.push_back(net->in->bias);
    ps.push_back(net->head->weight);
    ps.push_back(net->head->bias);
    REQUIRE(ps.size() == all.size());
  }
  std::vector<std::vector<float>> state;
  for (auto& p : ps) state.emplace_back(opt.state_per_element() * static_cast<std::size_t>(p.numel()), 0.0f);
  for (int s = 0; s < steps; ++s) {
    std::vector<torch::Tensor> sum;
    for (int r = 0; r < world; ++r) {
      net->zero_grad();
      loss_of(net->forward(batch(r, s).first), r, s).backward();
      for (std::size_t i = 0; i < ps.size(); ++i) {
        if (sum.size() <= i)
          sum.push_back(ps[i].grad().clone());
        else
          sum[i] += ps[i].grad();
      }
    }
    torch::NoGradGuard g;
    for (std::size_t i = 0; i < ps.size(); ++i) {
      auto avg = (sum[i] * (1.0f / static_cast<float>(world))).contiguous();
      const auto n = static_cast<std::size_t>(ps[i].numel());
      opt.step(ddp::shard_step{0,
                               static_cast<std::uint64_t>(s + 1),
                               std::span<float>(ps[i].data_ptr<float>(), n),
                               std::span<const float>(avg.data_ptr<float>(), n),
                               std::span<float>(state[i]),
                               {}});
    }
  }
  std::vector<torch::Tensor> out;
  for (auto& p : ps) out.push_back(p.detach().clone());
  return out;
}

template <class Reducer>
void train_fully_sharded(int rank, int world, int port, int steps, ddp::fully_sharded_options o, float bound) {
  auto pg = ddp::init_process_group(group_options(rank, world, port, 60s));
  ddp::adamw opt{{.lr = 0.01, .weight_decay = 0.1}};
  auto net = make_net(rank == 0 ? 11 : 100 + rank);  // the wrapper makes rank 0's weights everyone's
  ddp::basic_torch_fully_sharded<Reducer> fs{pg, units_of(net), o};
  net->through = [&fs](Block& b, const torch::Tensor& h) { return fs.forward(b, h); };
  auto root = net;
  for (int s = 0; s < steps; ++s) {
    auto out = fs.forward(root, batch(rank, s).first);
    loss_of(out, rank, s).backward();
    fs.step(opt);
  }
  if (world > 1 && o.prefetch && fs.wrapper().gathers_prefetched() == 0)
    throw std::runtime_error("no gather was prefetched in " + std::to_string(steps) + " steps");
  fs.wrapper().gather_all();
  const auto want = reference(world, steps, opt, 11);
  const auto& p = fs.parameters();
  if (p.size() != want.size()) throw std::runtime_error("parameter count differs");
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double err = (p.tensor(i).detach() - want[i]).abs().max().template item<double>();
    const double scale = want[i].abs().max().template item<double>() + 1e-12;
    if (err > bound * scale)
      throw std::runtime_error("rank " + std::to_string(rank) + ": parameter '" + p.name(i) + "' off by " +
                               std::to_string(err) + " (scale " + std::to_string(scale) + ", bound " +
                               std::to_string(bound) + " relative)");
  }
  fs.wrapper().release_all();
  // Evaluation under NoGradGuard gathers and releases only; its output is the gathered model's.
  torch::NoGradGuard g;
  const auto x = batch(rank, steps).first;
  const auto through = fs.forward(root, x);
  fs.wrapper().gather_all();
  net->through = nullptr;
  const auto plain = net->forward(x);
  if (!torch::equal(through, plain)) throw std::runtime_error("the evaluation forward differs from the whole model's");
  fs.wrapper().release_all();
}

void check_all_ok(const std::vector<ddp_test::outcome>& outs) {
  for (const auto& o : outs) CHECK_MESSAGE(o.ok(), ("rank " + std::to_string(o.rank) + ": " + o.message));
}

}  // namespace

TEST_CASE("torch_fully_sharded: autograd drives the units; AdamW gives the unsharded weights (bitwise on 2 ranks)") {
  const ddp::fully_sharded_options all_sharded{.whole_below = 0};
  for (const auto& o : {all_sharded, ddp::fully_sharded_options{.reshard_after_forward = false, .whole_below = 0}}) {
    const int port = ddp_test::free_port();
    check_all_ok(ddp_test::run_ranks(
        2, [&](int r) { train_fully_sharded<ddp::ring<ddp::tcp>>(r, 2, port, 6, o, 0.0f); }, 180s));
  }
  const int port = ddp_test::free_port();
  check_all_ok(ddp_test::run_ranks(
      4, [&](int r) { train_fully_sharded<ddp::auto_reducer>(r, 4, port, 6, all_sharded, 1e-5f); }, 180s));
}

TEST_CASE("torch_fully_sharded: a gradient set to None is taken back; bad units are clear errors") {
  const int port = ddp_test::free_port();
  check_all_ok(ddp_test::run_ranks(
      2,
      [&](int rank) {
        auto pg = ddp::init_process_group(group_options(rank, 2, port, 60s));
        {  // a module that is no unit
          auto net = make_net(1);
          ddp::torch_fully_sharded fs{pg, units_of(net), {.whole_below = 0}};
          net->through = [&fs](Block& b, const torch::Tensor& h) { return fs.forward(b, h); };
          auto stray = torch::nn::Linear(4, 4);
          ddp_test::require_raises(
              [&] {
                (void)fs.forward(stray, torch::zeros({1, 4}));
              },
              ddp::errc::invalid_argument, {"is not one of the 4 listed units"});
          // Gradients set to None between steps (an optimizer's zero_grad(true) would): the
          // fresh gradient autograd makes is copied into the tensor the wrapper reduces.
          ddp::adamw opt{{.lr = 0.01}};
          auto root = net;
          fs.forward(root, batch(rank, 0).first).sum().backward();
          fs.step(opt);
          net->blocks[0]->fc1->weight.mutable_grad() = torch::Tensor();
          fs.forward(root, batch(rank, 1).first).sum().backward();
          fs.step(opt);
          if (!net->blocks[0]->fc1->weight.grad().defined())
            throw std::runtime_error("the gradient set to None was not taken back");
          // no_sync: the first backward accumulates, the second reduce-scatters the sum; step()
          // between them is refused.
          {
            auto acc = fs.no_sync();
            fs.forward(root, batch(rank, 2).first).sum().backward();
          }
          ddp_test::require_raises([&] { fs.step(opt); }, ddp::errc::usage, {"accumulated under no_sync()"});
          fs.forward(root, batch(rank, 3).first).sum().backward();
          fs.step(opt);
        }
        {  // a unit listed twice
          auto net = make_net(1);
          ddp_test::require_raises(
              [&] {
                ddp::torch_fully_sharded fs{pg, {net->blocks[0].ptr(), net->blocks[0].ptr()}};
              },
              ddp::errc::invalid_argument, {"is listed twice"});
        }
        {  // a unit with buffers (BatchNorm's running statistics)
          auto bn = torch::nn::BatchNorm1d(4);
          ddp_test::require_raises(
              [&] {
                ddp::torch_fully_sharded fs{pg, {bn.ptr()}};
              },
              ddp::errc::unsupported, {"has buffer 'running_mean'"});
        }
        {  // a unit whose parameters an inner unit holds
          auto net = make_net(1);
          torch::nn::Sequential seq(net->blocks[0]->fc1);  // holds the same two tensors
          ddp_test::require_raises(
              [&] {
                ddp::torch_fully_sharded fs{pg, {net->blocks[0]->fc1.ptr(), seq.ptr()}};
              },
              ddp::errc::invalid_argument, {"has no parameters of its own"});
        }
      },
      120s));
}
