// The LibTorch adapter on real processes: gradients that autograd produces are averaged when
// backward() returns (copy mode and bucket-view mode, gradients set to None, no_sync
// accumulation, unused parameters), and what a LibTorch user can get wrong is a clear error.
// Each case checks the values against a reference computed in the same process: every rank can
// rebuild every other rank's batch (seeded), so the average of the local gradients is known.

#include "torch_doctest.hpp"

#include <ddp/optim/sgd.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/transport/tcp.hpp>

#include "multiproc/harness.hpp"

#include <numeric>

using namespace std::chrono_literals;
using ddp_test::group_options;
using ddp_test::run_processes;

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3)));
    fc1 = register_module("fc1", torch::nn::Linear(4 * 6 * 6, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
    spare = register_module("spare", torch::nn::Linear(3, 3));  // used only when asked
  }
  torch::Tensor forward(const torch::Tensor& x, bool use_spare = true) {
    auto h = torch::relu(conv(x));
    h = torch::relu(fc1(h.flatten(1)));
    h = fc2(h);
    return use_spare ? spare(h) : h;
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, spare{nullptr};
};
TORCH_MODULE(Net);

// Rank r's batch of step s (the same tensors on every rank that asks).
std::pair<torch::Tensor, torch::Tensor> batch(int r, int s) {
  torch::manual_seed(1000 * s + r);
  return {torch::randn({4, 1, 8, 8}), torch::randint(0, 3, {4})};
}

torch::Tensor loss_of(Net& net, int r, int s, bool use_spare = true) {
  auto [x, y] = batch(r, s);
  return torch::nn::functional::cross_entropy(net->forward(x, use_spare), y);
}

// The average over `world` ranks of the local gradients of step s, from `net`'s current weights.
std::vector<torch::Tensor> expected_grads(Net& net, int world, int s, bool use_spare = true) {
  auto copy = Net();
  {
    torch::NoGradGuard g;
    auto src = net->parameters();
    auto dst = copy->parameters();
    for (std::size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  std::vector<torch::Tensor> sum;
  for (int r = 0; r < world; ++r) {
    copy->zero_grad();
    loss_of(copy, r, s, use_spare).backward();
    auto ps = copy->parameters();
    for (std::size_t i = 0; i < ps.size(); ++i) {
      auto g = ps[i].grad().defined() ? ps[i].grad().clone() : torch::zeros_like(ps[i]);
      if (sum.size() <= i) sum.push_back(g); else sum[i] += g;
    }
  }
  for (auto& g : sum) g /= world;
  return sum;
}

void require_close(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want, int rank) {
  if (got.size() != want.size()) throw std::runtime_error("parameter count differs");
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = (got[i] - want[i]).abs().max().item<double>();
    const double scale = want[i].abs().max().item<double>() + 1e-12;
    if (err > 1e-5 * scale)
      throw std::runtime_error("rank " + std::to_string(rank) + ": gradient " + std::to_string(i) + " off by " +
                               std::to_string(err) + " (scale " + std::to_string(scale) + ")");
  }
}

// The gradients, an undefined one (a parameter no rank used, after zero_grad(true)) as zeros,
// as expected_grads counts it.
std::vector<torch::Tensor> grads_of(Net& net) {
  std::vector<torch::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  return out;
}

void check_all_ok(const std::vector<ddp_test::outcome>& outs) {
  for (const auto& o : outs) CHECK_MESSAGE(o.ok(), ("rank " + std::to_string(o.rank) + ": " + o.message));
}

template <class DP>
void train_and_check(int rank, int world, DP& dp, Net& net, torch::optim::SGD& opt, int steps, bool set_to_none) {
  for (int s = 0; s < steps; ++s) {
    auto want = expected_grads(net, world, s);
    opt.zero_grad();
    if (set_to_none)
      for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
    loss_of(net, rank, s).backward();
    require_close(grads_of(net), want, rank);
    if (dp.last_step_stats().step != static_cast<std::uint64_t>(s)) throw std::runtime_error("finish() did not run once per backward");
    opt.step();
  }
}

}  // namespace

TEST_CASE("torch_parameters: a module's trainable parameters, in order, with defined gradients") {
  torch::set_num_threads(1);
  Net net;
  net->spare->bias.set_requires_grad(false);
  ddp::torch_parameters params{*net};
  REQUIRE(params.size() == 7);  // conv w/b, fc1 w/b, fc2 w/b, spare w (spare.bias frozen)
  CHECK(params.name(0) == "conv.weight");
  CHECK(params.name(6) == "spare.weight");
  CHECK(params.shape(0) == std::vector<std::int64_t>{4, 1, 3, 3});
  const auto views = ddp::to_views(params);
  CHECK(views[2].numel == 16u * 144u);
  CHECK(views[2].type == ddp::dtype::f32);
  CHECK(views[2].device == -1);
  CHECK(views[2].grad == net->fc1->weight.grad().data_ptr());
  CHECK(net->fc1->weight.grad().abs().sum().item<float>() == 0.0f);

  try {
    ddp::torch_parameters bad{{{"flags", torch::zeros({3}, torch::kComplexFloat).requires_grad_(true)}}};
    FAIL("a complex parameter was accepted");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::unsupported);
    CHECK(std::string(e.what()).find("parameter 'flags' has scalar type ComplexFloat") != std::string::npos);
  }
  auto wide = torch::zeros({4, 6}).requires_grad_(true);
  try {
    ddp::torch_parameters bad{{{"strided", wide.t()}}};
    FAIL("a non-leaf/strided parameter was accepted");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::invalid_argument);
    CHECK(std::string(e.what()).find("parameter 'strided' is not a leaf tensor") != std::string::npos);
  }
  auto leaf_strided = torch::zeros({6, 4}).t().detach().requires_grad_(true);
  try {
    ddp::torch_parameters bad{{{"strided", leaf_strided}}};
    FAIL("a non-contiguous parameter was accepted");
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::invalid_argument);
    CHECK(std::string(e.what()).find("parameter 'strided' is not contiguous") != std::string::npos);
    CHECK(std::string(e.what()).find("p.set_data(p.contiguous())") != std::string::npos);
  }
  // The advice works: the same tensor, made contiguous in place, is accepted.
  {
    torch::NoGradGuard g;
    leaf_strided.set_data(leaf_strided.contiguous());
  }
  ddp::torch_parameters fixed{{{"strided", leaf_strided}}};
  CHECK(fixed.size() == 1);
  CHECK(fixed.tensor(0).is_same(leaf_strided));
}

TEST_CASE("torch_data_parallel: backward() returns with the average, copy and view mode, default and fixed reducers") {
  for (bool view : {false, true}) {
    for (bool set_to_none : {false, true}) {
      CAPTURE(view);
      CAPTURE(set_to_none);
      const int world = 3, port = ddp_test::free_port();
      auto outs = run_processes({0, 1, 2}, [&](int rank) {
        torch::set_num_threads(1);
        torch::manual_seed(rank);  // different initial weights: rank 0's must win
        Net net;
        auto pg = ddp::init_process_group(group_options(rank, world, port, 20s));
        ddp::torch_data_parallel dp{pg, *net, ddp::bucket_policy{.cap_bytes = 2048, .first_cap_bytes = 2048}, {.gradient_as_bucket_view = view}};
        torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
        train_and_check(rank, world, dp, net, opt, 4, set_to_none);
        if (dp.wrapper().plan().buckets.size() < 2) throw std::runtime_error("expected several buckets");
        if (view && net->fc1->weight.grad().data_ptr() != dp.wrapper().bucket_grad(2))
          throw std::runtime_error("view mode: .grad() is not the bucket slot");
      });
      check_all_ok(outs);
    }
  }
  const int world = 2, port = ddp_test::free_port();
  auto outs = run_processes({0, 1}, [&](int rank) {
    torch::set_num_threads(1);
    torch::manual_seed(rank);
    Net net;
    auto pg = ddp::init_process_group(group_options(rank, world, port, 20s));
    ddp::basic_torch_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, ddp::host_allocator> dp{pg, *net};
    torch::optim::SGD opt(net->parameters(), 0.05);
    train_and_check(rank, world, dp, net, opt, 3, false);
  });
  check_all_ok(outs);
}

TEST_CASE("torch_data_parallel: weights start equal, no_sync accumulates, unused parameters keep what the optimizer left") {
  const int world = 2, port = ddp_test::free_port();
  auto outs = run_processes({0, 1}, [&](int rank) {
    torch::set_num_threads(1);
    torch::manual_seed(rank + 7);
    Net net;
    auto pg = ddp::init_process_group(group_options(rank, world, port, 20s));
    ddp::torch_data_parallel dp{pg, *net, {}, {.find_unused_parameters = true}};
    // Rank 0's weights everywhere: compare a checksum over the group.
    auto sum = torch::zeros({1}, torch::kDouble);
    for (auto& p : net->parameters()) sum += p.to(torch::kDouble).sum();
    std::vector<double> mine{sum.item<double>()};
    auto all = pg.all_gather(std::string(reinterpret_cast<const char*>(mine.data()), sizeof(double)));
    if (all[0] != all[1]) throw std::runtime_error("weights differ after construction");

    // Two micro-batches: the first under no_sync, then a synchronized one: the average of the sums.
    auto want0 = expected_grads(net, world, 0);
    auto want1 = expected_grads(net, world, 1);
    net->zero_grad();
    {
      auto guard = dp.no_sync();
      loss_of(net, rank, 0).backward();
    }
    if (dp.last_step_stats().synchronized) throw std::runtime_error("no_sync step communicated");
    loss_of(net, rank, 1).backward();
    std::vector<torch::Tensor> want;
    for (std::size_t i = 0; i < want0.size(); ++i) want.push_back(want0[i] + want1[i]);
    require_close(grads_of(net), want, rank);

    // A forward that skips `spare` on every rank (find_unused_parameters): its gradient is left
    // as the optimizer had it, as PyTorch's DDP leaves it: zero after zero_grad(false), none
    // after zero_grad(true) (LibTorch 2's default), so that the optimizer skips it.
    for (const bool to_none : {false, true}) {
      net->zero_grad(to_none);
      loss_of(net, rank, 2, false).backward();
      const auto& g = net->spare->weight.grad();
      if (to_none && g.defined()) throw std::runtime_error("a gradient no rank made was defined");
      if (!to_none && (!g.defined() || g.abs().max().item<float>() != 0.0f))
        throw std::runtime_error("unused gradient not zero");
      require_close(grads_of(net), expected_grads(net, world, 2, false), rank);
      if (dp.last_step_stats().unused != 2) throw std::runtime_error("expected 2 unused parameters");
    }
  });
  check_all_ok(outs);
}

TEST_CASE("torch_data_parallel: what a LibTorch user can get wrong is a clear error on every rank") {
  SUBCASE("a parameter never used, without find_unused_parameters: backward() throws naming it") {
    const int world = 2, port = ddp_test::free_port();
    auto outs = run_processes({0, 1}, [&](int rank) {
      torch::set_num_threads(1);
      Net net;
      auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
      ddp::torch_data_parallel dp{pg, *net};
      try {
        loss_of(net, rank, 0, false).backward();
      } catch (const ddp::error& e) {
        if (std::string(e.what()).find("spare.weight") == std::string::npos) throw;
      }
      loss_of(net, rank, 1).backward();  // the wrapper stays failed, saying why
    });
    for (const auto& o : outs) {
      CHECK(o.errc == static_cast<int>(ddp::errc::usage));
      CHECK_MESSAGE(o.message.find("an earlier backward() failed") != std::string::npos, o.message);
      CHECK_MESSAGE(o.message.find("spare.weight") != std::string::npos, o.message);
    }
  }
  SUBCASE("a module moved after wrapping: errc::usage naming the parameter, before anything is reduced") {
    const int world = 2, port = ddp_test::free_port();
    auto outs = run_processes({0, 1}, [&](int rank) {
      torch::set_num_threads(1);
      Net net;
      auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
      ddp::torch_data_parallel dp{pg, *net};
      net->to(torch::kDouble);
      auto [x, y] = batch(rank, 0);
      try {
        torch::nn::functional::cross_entropy(net->forward(x.to(torch::kDouble)), y).backward();
      } catch (const c10::Error& e) {
        throw std::runtime_error(e.what());  // autograd wrapped it: report what it says
      }
    });
    for (const auto& o : outs) {
      CHECK(o.errc == static_cast<int>(ddp::errc::usage));
      CHECK_MESSAGE(o.message.find("parameter 'conv.weight' was moved or reallocated after wrapping") != std::string::npos,
                    o.message);
    }
  }
  SUBCASE("a parameter given new storage of the same type (set_data): refused, and on the next backward too") {
    const int world = 2, port = ddp_test::free_port();
    auto outs = run_processes({0, 1}, [&](int rank) {
      torch::set_num_threads(1);
      Net net;
      auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
      ddp::torch_data_parallel dp{pg, *net};
      net->fc2->bias.set_data(torch::zeros({3}));
      for (int k = 0; k < 2; ++k) {
        try {
          loss_of(net, rank, 0).backward();
          throw std::runtime_error("backward after set_data did not throw");
        } catch (const ddp::error& e) {
          if (std::string(e.what()).find("parameter 'fc2.bias' was moved or reallocated") == std::string::npos) throw;
        }
      }
      if (dp.last_step_stats().step != 0 || dp.wrapper().steps() != 0) throw std::runtime_error("a refused step ran");
    });
    check_all_ok(outs);
  }
  SUBCASE("ranks whose modules differ: errc::mismatch at construction naming the parameter") {
    const int world = 2, port = ddp_test::free_port();
    auto outs = run_processes({0, 1}, [&](int rank) {
      torch::set_num_threads(1);
      torch::nn::Linear lin(rank == 0 ? 4 : 5, 2);
      auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
      ddp::torch_data_parallel dp{pg, *lin};
    });
    for (const auto& o : outs) {
      CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
      CHECK_MESSAGE(o.message.find("weight") != std::string::npos, o.message);
    }
  }
}

namespace {

// Two parameter groups (conv and fc1; fc2 and spare) with their own learning rate and weight
// decay, and a StepLR scheduler over them: the optimizer a LibTorch user brings.
enum class optim_kind { sgd_momentum, adam, adamw };

std::unique_ptr<torch::optim::Optimizer> make_optimizer(optim_kind kind, std::vector<torch::Tensor> a,
                                                        std::vector<torch::Tensor> b) {
  using namespace torch::optim;
  std::vector<OptimizerParamGroup> groups;
  switch (kind) {
    case optim_kind::sgd_momentum: {
      groups.emplace_back(std::move(a), std::make_unique<SGDOptions>(SGDOptions(0.05).momentum(0.9).weight_decay(1e-3)));
      groups.emplace_back(std::move(b), std::make_unique<SGDOptions>(SGDOptions(0.02).momentum(0.9).nesterov(true)));
      return std::make_unique<SGD>(std::move(groups), SGDOptions(0.1));
    }
    case optim_kind::adam:
      groups.emplace_back(std::move(a), std::make_unique<AdamOptions>(AdamOptions(1e-2).weight_decay(1e-3)));
      groups.emplace_back(std::move(b), std::make_unique<AdamOptions>(AdamOptions(3e-3).amsgrad(true)));
      return std::make_unique<Adam>(std::move(groups), AdamOptions(1e-3));
    case optim_kind::adamw:
      groups.emplace_back(std::move(a), std::make_unique<AdamWOptions>(AdamWOptions(1e-2).weight_decay(0.05)));
      groups.emplace_back(std::move(b), std::make_unique<AdamWOptions>(AdamWOptions(3e-3).weight_decay(0.0)));
      return std::make_unique<AdamW>(std::move(groups), AdamWOptions(1e-3));
  }
  return nullptr;
}

std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> groups_of(Net& net) {
  std::vector<torch::Tensor> a, b;
  for (auto& p : net->conv->parameters()) a.push_back(p);
  for (auto& p : net->fc1->parameters()) a.push_back(p);
  for (auto& p : net->fc2->parameters()) b.push_back(p);
  for (auto& p : net->spare->parameters()) b.push_back(p);
  return {a, b};
}

// Trains `steps` steps, unsharded (the optimizer over the module) or sharded (over shard_of),
// with a StepLR scheduler; the spare layer unused on every rank when `unused`.
std::vector<torch::Tensor> train_torch_optim(ddp::process_group& pg, optim_kind kind, bool sharded, bool unused,
                                             int steps, std::int64_t* state_numel) {
  torch::manual_seed(100 + pg.rank());  // rank 0's weights win in both runs
  Net net;
  ddp::dp_options o;
  o.shard = sharded;
  o.find_unused_parameters = unused;
  ddp::torch_data_parallel dp{pg, *net, ddp::bucket_policy{.cap_bytes = 4096, .first_cap_bytes = 4096}, o};
  auto [a, b] = groups_of(net);
  auto opt = sharded ? make_optimizer(kind, dp.shard_of(a), dp.shard_of(b)) : make_optimizer(kind, a, b);
  torch::optim::StepLR sched(*opt, 2, 0.5);
  for (int s = 0; s < steps; ++s) {
    opt->zero_grad();
    loss_of(net, pg.rank(), s, !unused).backward();
    if (sharded)
      dp.step(*opt);
    else
      opt->step();
    sched.step();
  }
  *state_numel = 0;
  for (const auto& [key, st] : opt->state()) {
    (void)key;
    if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(st.get())) *state_numel += s->exp_avg().numel();
    if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(st.get())) *state_numel += s->exp_avg().numel();
    if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(st.get())) *state_numel += s->momentum_buffer().numel();
  }
  if (sharded && dp.wrapper().plan().buckets.size() < 2) throw std::runtime_error("expected several buckets");
  std::vector<torch::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace

TEST_CASE("sharded torch_data_parallel: torch::optim with parameter groups and a scheduler steps the shards, "
          "bitwise the unsharded run") {
  for (const int world : {2, 3}) {
    CAPTURE(world);
    const int port = ddp_test::free_port();
    std::vector<int> ranks(static_cast<std::size_t>(world));
    std::iota(ranks.begin(), ranks.end(), 0);
    auto outs = run_processes(ranks, [&](int rank) {
      torch::set_num_threads(1);
      auto pg = ddp::init_process_group(group_options(rank, world, port, 20s));
      for (const auto kind : {optim_kind::sgd_momentum, optim_kind::adam, optim_kind::adamw})
        for (const bool unused : {false, true}) {
          const std::string what = "optimizer " + std::to_string(static_cast<int>(kind)) +
                                   (unused ? " (spare layer unused)" : "") + " on rank " + std::to_string(rank);
          std::int64_t whole = 0, mine = 0;
          const auto u = train_torch_optim(pg, kind, false, unused, 5, &whole);
          const auto s = train_torch_optim(pg, kind, true, unused, 5, &mine);
          for (std::size_t i = 0; i < u.size(); ++i)
            if (!torch::equal(u[i], s[i]))
              throw std::runtime_error(what + ": parameter " + std::to_string(i) + " differs from the unsharded run by " +
                                       std::to_string((u[i] - s[i]).abs().max().item<double>()));
          // Each rank keeps the state of its slices only: about 1/world of the whole.
          std::vector<std::int64_t> all{mine};
          pg.all_reduce(std::span<std::int64_t>(all), ddp::op::sum);
          if (mine * world > whole + 64 * world || all[0] != whole)
            throw std::runtime_error(what + ": optimizer state of " + std::to_string(mine) + " elements here, " +
                                     std::to_string(all[0]) + " over the ranks, " + std::to_string(whole) +
                                     " unsharded");
        }
    });
    check_all_ok(outs);
  }
}

TEST_CASE("sharded torch_data_parallel: an optimizer over the module itself, a foreign tensor, the state it holds") {
  const int world = 2, port = ddp_test::free_port();
  auto outs = run_processes({0, 1}, [&](int rank) {
    torch::set_num_threads(1);
    auto pg = ddp::init_process_group(group_options(rank, world, port, 20s));
    Net net;
    ddp::torch_data_parallel dp{pg, *net, {}, {.shard = true}};
    ddp_test::require_raises([&] { (void)dp.shard_of(torch::zeros({3})); }, ddp::errc::invalid_argument, {"not a trained parameter of this wrapper"});
    // The module's own parameters hold this rank's local gradients in the sharded mode.
    torch::optim::SGD whole(net->parameters(), 0.1);
    loss_of(net, rank, 0).backward();
    ddp_test::require_raises([&] { dp.step(whole); }, ddp::errc::usage, {"parameter 'conv.weight' itself"});
    torch::optim::SGD mine(dp.shard_of(net->parameters()), 0.1);
    dp.step(mine);  // the refusal above stepped nothing: this step's shards are still fresh
    ddp_test::require_raises([&] { dp.step(mine); }, ddp::errc::usage, {"with no synchronized finish() since the last step"});
    ddp_test::require_raises([&] { (void)dp.wrapper().sharded_state(); }, ddp::errc::usage, {"the engine's optimizer steps the shards"});
    ddp::sgd own{{.lr = 0.1}};
    loss_of(net, rank, 1).backward();
    ddp_test::require_raises([&] { dp.wrapper().step(own); }, ddp::errc::usage, {"use one kind of optimizer throughout"});
  });
  check_all_ok(outs);
}
