// Adversarial cases for the LibTorch adapter: backward passes that fail outside ddp, tied
// weights, several backward passes over one graph, a wrapper that goes away while its module
// keeps training, modules with nothing to train, f64 parameters. Each case checks values or
// the error's code and text on real processes.

#include "torch_doctest.hpp"

#include "multiproc/harness.hpp"

using namespace std::chrono_literals;
using ddp_test::group_options;
using ddp_test::run_processes;

namespace {

// Two layers and a head whose weight is the first layer's (tied: one tensor, registered twice).
struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    a = register_module("a", torch::nn::Linear(torch::nn::LinearOptions(4, 4).bias(false)));
    b = register_module("b", torch::nn::Linear(4, 4));
    head = register_parameter("head", a->weight);
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::matmul(b(a(x)), head.t()); }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::Tensor head;
};
TORCH_MODULE(Tied);

struct SmallImpl : torch::nn::Module {
  SmallImpl() {
    l1 = register_module("l1", torch::nn::Linear(3, 5));
    l2 = register_module("l2", torch::nn::Linear(5, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return l2(torch::tanh(l1(x))); }
  torch::nn::Linear l1{nullptr}, l2{nullptr};
};
TORCH_MODULE(Small);

torch::Tensor input_of(int r, int s, int cols, torch::Dtype t = torch::kFloat) {
  torch::manual_seed(100 * s + r + 1);
  return torch::randn({6, cols}).to(t);
}

// The gradients of `loss(module, r)` for each rank r, averaged, from a copy of `module`'s weights.
template <class M, class Loss>
std::vector<torch::Tensor> average_grads(M& module, M& copy, int world, Loss&& loss) {
  {
    torch::NoGradGuard g;
    auto src = module->parameters(), dst = copy->parameters();
    for (std::size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  std::vector<torch::Tensor> sum;
  for (int r = 0; r < world; ++r) {
    for (auto& p : copy->parameters()) p.mutable_grad() = torch::Tensor();
    loss(copy, r).backward();
    auto ps = copy->parameters();
    for (std::size_t i = 0; i < ps.size(); ++i) {
      auto g = ps[i].grad().defined() ? ps[i].grad().clone() : torch::zeros_like(ps[i]);
      if (sum.size() <= i) sum.push_back(g); else sum[i] += g;
    }
  }
  for (auto& g : sum) g /= world;
  return sum;
}

template <class M>
void require_grads(M& module, const std::vector<torch::Tensor>& want, int rank, const char* what) {
  auto ps = module->parameters();
  if (ps.size() != want.size()) throw std::runtime_error("parameter count differs");
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const double err = (ps[i].grad() - want[i]).abs().max().template item<double>();
    const double scale = want[i].abs().max().template item<double>() + 1e-12;
    if (!(err <= 1e-5 * scale))
      throw std::runtime_error(std::string(what) + ": rank " + std::to_string(rank) + ": gradient " +
                               std::to_string(i) + " off by " + std::to_string(err));
  }
}

void check_all_ok(const std::vector<ddp_test::outcome>& outs) {
  for (const auto& o : outs) CHECK_MESSAGE(o.ok(), ("rank " + std::to_string(o.rank) + ": " + o.message));
}

}  // namespace

// A backward() that throws from a hook of the user's own (a NaN check, say) ends before autograd
// runs the end-of-backward callback ddp queued. The wrapper must notice: either nothing of the
// step reached ddp and the next backward() is an ordinary synchronized step, or the step was
// half done and every later backward() raises errc::usage saying an earlier backward() failed.
// It must never run a later backward() without averaging (the adapter used to keep its step
// flag set forever: no callback was queued again, finish() never ran, gradients stayed local).
TEST_CASE("torch: a backward() that a user's hook aborts never leaves a later step unsynchronized") {
  for (const bool view : {false, true}) {
    for (const bool before_any_gradient : {true, false}) {
      CAPTURE(view);
      CAPTURE(before_any_gradient);
      const int world = 2, port = ddp_test::free_port();
      auto outs = run_processes({0, 1}, [&](int rank) {
        torch::set_num_threads(1);
        torch::manual_seed(3);
        Small net, copy;
        auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
        ddp::torch_data_parallel dp{pg, *net, {}, {.gradient_as_bucket_view = view}};
        // l2.bias's accumulator runs first in backward (nearest the loss); l1.weight's last.
        auto& victim = before_any_gradient ? net->l2->bias : net->l1->weight;
        bool armed = true;
        victim.register_hook([&](const torch::Tensor& g) {
          if (armed) throw std::runtime_error("user hook: a NaN in the gradient");
          return g;
        });
        auto loss = [&](Small& m, int r) { return m->forward(input_of(r, 0, 3)).square().sum(); };
        try {
          loss(net, rank).backward();
          throw std::logic_error("the user's hook did not throw");
        } catch (const std::logic_error&) {
          throw;
        } catch (const std::exception& e) {
          if (std::string(e.what()).find("user hook") == std::string::npos) throw;
        }
        armed = false;
        for (int s = 0; s < 2; ++s) {
          auto want = average_grads(net, copy, world, loss);
          net->zero_grad();
          try {
            loss(net, rank).backward();
          } catch (const ddp::error& e) {
            if (before_any_gradient) throw;  // nothing of the failed step reached ddp: no reason to refuse
            if (e.code() != ddp::errc::usage || std::string(e.what()).find("an earlier backward() failed") == std::string::npos)
              throw;
            continue;  // refused, saying why: the promise holds
          }
          if (!before_any_gradient) throw std::runtime_error("a backward() after a half-done step was accepted");
          require_grads(net, want, rank, "after the aborted backward");
          if (dp.last_step_stats().step != static_cast<std::uint64_t>(s) || !dp.last_step_stats().synchronized)
            throw std::runtime_error("finish() did not run for backward " + std::to_string(s));
        }
      });
      check_all_ok(outs);
    }
  }
}

// Tied weights: `head` is `a.weight`. LibTorch's named_parameters() lists the tensor twice;
// PyTorch's DDP sees it once (Python's named_parameters() drops duplicates). ddp must too: one
// parameter, one gradient slot, reduced once; otherwise in view mode one gradient has two
// bucket slots and the second hook copies from the first slot while its bucket is reduced.
TEST_CASE("torch: a tensor registered twice (tied weights) is one parameter, averaged right") {
  {
    torch::set_num_threads(1);
    Tied net;
    REQUIRE(net->named_parameters().size() == 4);  // LibTorch lists the tied tensor twice
    ddp::torch_parameters params{*net};
    CHECK(params.size() == 3);
    // Under its first name in named_parameters() order (the module's own parameters first, as
    // Python lists them too): "head", and never again as "a.weight".
    REQUIRE(params.size() == 3);
    CHECK(params.name(0) == "head");
    CHECK(params.name(1) == "b.weight");
    CHECK(params.name(2) == "b.bias");
  }
  for (const bool view : {false, true}) {
    CAPTURE(view);
    const int world = 2, port = ddp_test::free_port();
    auto outs = run_processes({0, 1}, [&](int rank) {
      torch::set_num_threads(1);
      torch::manual_seed(rank + 11);
      Tied net, copy;
      auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
      // One parameter per bucket, so that a bucket is in flight while later hooks run.
      ddp::torch_data_parallel dp{pg, *net, ddp::bucket_policy{.cap_bytes = 1, .first_cap_bytes = 1},
                                  {.gradient_as_bucket_view = view}};
      torch::optim::SGD opt(net->parameters(), 0.05);
      auto loss = [&](Tied& m, int r) { return m->forward(input_of(r, 0, 4)).square().mean(); };
      for (int s = 0; s < 3; ++s) {
        auto want = average_grads(net, copy, world, loss);
        opt.zero_grad();
        loss(net, rank).backward();
        require_grads(net, want, rank, "tied");
        if (!net->head.grad().is_same(net->a->weight.grad())) throw std::runtime_error("tied gradients differ");
        opt.step();
      }
    });
    check_all_ok(outs);
  }
}

// retain_graph: two backward() calls over one graph are two synchronized steps, the second
// averaging (first average + local gradient), as PyTorch DDP's reducer averages whatever .grad holds.
TEST_CASE("torch: two backward() calls over one graph (retain_graph) are two averaged steps") {
  const int world = 2, port = ddp_test::free_port();
  auto outs = run_processes({0, 1}, [&](int rank) {
    torch::set_num_threads(1);
    Small net, copy;
    auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
    ddp::torch_data_parallel dp{pg, *net, {}, {.gradient_as_bucket_view = true}};
    auto loss = [&](Small& m, int r) { return m->forward(input_of(r, 1, 3)).square().sum(); };
    auto avg = average_grads(net, copy, world, loss);
    net->zero_grad();
    auto l = loss(net, rank);
    l.backward({}, /*retain_graph=*/true);
    require_grads(net, avg, rank, "first backward");
    l.backward();
    std::vector<torch::Tensor> twice;
    for (auto& g : avg) twice.push_back(2 * g);
    require_grads(net, twice, rank, "second backward");
    if (dp.wrapper().steps() != 2) throw std::runtime_error("expected two steps");
  });
  check_all_ok(outs);
}

// View mode, then the wrapper goes away: the module keeps gradients it owns and trains alone
// (no hook of the dead wrapper fires, no gradient points into freed bucket memory).
TEST_CASE("torch: the module trains alone after its view-mode wrapper is destroyed") {
  const int world = 2, port = ddp_test::free_port();
  auto outs = run_processes({0, 1}, [&](int rank) {
    torch::set_num_threads(1);
    torch::manual_seed(rank + 5);
    Small net;
    torch::optim::SGD opt(net->parameters(), 0.1);
    auto loss = [&](Small& m, int r) { return m->forward(input_of(r, 2, 3)).square().sum(); };
    {
      auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
      ddp::torch_data_parallel dp{pg, *net, {}, {.gradient_as_bucket_view = true}};
      opt.zero_grad();
      loss(net, rank).backward();
      opt.step();
    }
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      loss(net, rank).backward();
      Small copy;
      auto want = average_grads(net, copy, 1, [&](Small& m, int) { return loss(m, rank); });
      require_grads(net, want, rank, "alone");
      opt.step();
    }
  });
  check_all_ok(outs);
}

// f64 parameters, and a module with nothing to train (every parameter frozen): refused on every
// rank (errc::invalid_argument), as PyTorch's DistributedDataParallel refuses a module with no
// parameter that requires a gradient; it used to be an inert wrapper, a silent no-op (issue 45).
TEST_CASE("torch: f64 modules average; a module with no trainable parameter is refused") {
  const int world = 2, port = ddp_test::free_port();
  auto outs = run_processes({0, 1}, [&](int rank) {
    torch::set_num_threads(1);
    Small net, copy;
    net->to(torch::kDouble);
    copy->to(torch::kDouble);
    auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
    ddp::torch_data_parallel dp{pg, *net};
    auto loss = [&](Small& m, int r) { return m->forward(input_of(r, 3, 3, torch::kDouble)).square().sum(); };
    auto want = average_grads(net, copy, world, loss);
    net->zero_grad();
    loss(net, rank).backward();
    require_grads(net, want, rank, "f64");

    Small frozen;
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
    try {
      ddp::torch_data_parallel none{pg, *frozen};
      throw std::runtime_error("a wrapper over no trainable parameter was built");
    } catch (const ddp::error& e) {
      const std::string what = e.what();
      if (e.condition() != ddp::errc::invalid_argument || what.find("the parameter set is empty") == std::string::npos ||
          what.find("(4 buffers and frozen parameters came with this set)") == std::string::npos)
        throw;
    }
    auto x = torch::ones({2}, torch::requires_grad());
    (x * 3).sum().backward();
    if (x.grad().sum().item<float>() != 6.0f) throw std::runtime_error("unrelated backward changed");
  });
  check_all_ok(outs);
}

// Gradients set to None (zero_grad(true)) and a layer that only rank 0 uses this step
// (find_unused_parameters): rank 1 contributes zeros, and the average is that layer's gradient
// on rank 0 over 2. PyTorch's reducer writes the average into .grad on every rank where the
// parameter was used anywhere (creating it where it was None), so that every rank's optimizer
// takes the same step. The adapter left rank 1's .grad None (copy and view mode): rank 1's
// optimizer skipped the layer that rank 0's updated, and the replicas diverged.
TEST_CASE("torch: gradients set to None and a layer used on one rank only: every rank gets the average") {
  for (const bool view : {false, true}) {
    CAPTURE(view);
    const int world = 2, port = ddp_test::free_port();
    auto outs = run_processes({0, 1}, [&](int rank) {
      torch::set_num_threads(1);
      Small net, copy;
      auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
      ddp::torch_data_parallel dp{pg, *net, {}, {.gradient_as_bucket_view = view, .find_unused_parameters = true}};
      torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      // Rank 0 runs both layers; rank 1 only l1 (its loss does not depend on l2).
      auto loss = [&](Small& m, int r) {
        auto x = input_of(r, 4, 3);
        return r == 0 ? m->forward(x).square().sum() : torch::tanh(m->l1(x)).square().sum();
      };
      for (int s = 0; s < 2; ++s) {
        auto want = average_grads(net, copy, world, loss);
        for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();  // zero_grad(set_to_none)
        loss(net, rank).backward();
        for (auto& p : net->parameters())
          if (!p.grad().defined()) throw std::runtime_error("a gradient is None after a synchronized step");
        require_grads(net, want, rank, "locally unused");
        opt.step();
      }
      // The replicas agree.
      auto sum = torch::zeros({1}, torch::kDouble);
      for (auto& p : net->parameters()) sum += p.to(torch::kDouble).sum();
      const double mine = sum.item<double>();
      auto all = pg.all_gather(std::string(reinterpret_cast<const char*>(&mine), sizeof mine));
      if (all[0] != all[1]) throw std::runtime_error("the replicas' weights diverged");
    });
    check_all_ok(outs);
  }
}

// join() through wrapper() with the LibTorch adapter in view mode: rank 1 has one batch, rank 0
// three; rank 1's .grad() tensors (bucket memory) are zero after join(), rank 0's last two
// steps average over rank 0 alone; then both train the next epoch together.
TEST_CASE("torch: uneven inputs through wrapper().join(), view mode") {
  const int world = 2, port = ddp_test::free_port();
  auto outs = run_processes({0, 1}, [&](int rank) {
    torch::set_num_threads(1);
    Small net, copy;
    auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
    ddp::torch_data_parallel dp{pg, *net, {}, {.gradient_as_bucket_view = true, .uneven_inputs = true, .divide_by = ddp::join_divisor::contributors}};
    auto loss_at = [&](int s) { return [s](Small& m, int r) { return m->forward(input_of(r, 10 + s, 3)).square().sum(); }; };
    const int mine = rank == 0 ? 3 : 1;
    for (int s = 0; s < mine; ++s) {
      auto want = average_grads(net, copy, s == 0 ? world : 1, loss_at(s));
      net->zero_grad();
      loss_at(s)(net, rank).backward();
      require_grads(net, want, rank, "uneven");
      if (dp.last_step_stats().contributors != (s == 0 ? 2 : 1)) throw std::runtime_error("contributors");
    }
    dp.wrapper().join();
    if (rank == 1) {
      if (dp.wrapper().joined_steps() != 2) throw std::runtime_error("rank 1 answered " + std::to_string(dp.wrapper().joined_steps()));
      for (auto& p : net->parameters())
        if (p.grad().abs().max().item<float>() != 0.0f) throw std::runtime_error("a joined rank's gradient is not zero");
    }
    auto want = average_grads(net, copy, world, loss_at(5));
    net->zero_grad();
    loss_at(5)(net, rank).backward();
    require_grads(net, want, rank, "next epoch");
  });
  check_all_ok(outs);
}

// A parameter no rank used (find_unused_parameters) keeps an undefined .grad() after its
// gradients were set to None, so SGD with momentum and weight decay leaves it where it was (PyTorch's DDP
// leaves it None); a parameter one rank used gets the average on every rank.
TEST_CASE("torch: a parameter no rank used keeps no gradient, and the optimizer skips it") {
  struct ThreeImpl : torch::nn::Module {
    ThreeImpl() {
      a = register_module("a", torch::nn::Linear(3, 2));
      b = register_module("b", torch::nn::Linear(3, 2));
      c = register_module("c", torch::nn::Linear(3, 2));
    }
    torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  };
  const int world = 2, port = ddp_test::free_port();
  auto outs = run_processes({0, 1}, [&](int rank) {
    torch::set_num_threads(1);
    auto net = std::make_shared<ThreeImpl>();
    auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
    ddp::torch_data_parallel dp{pg, *net, {}, {.find_unused_parameters = true}};
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.1));
    const auto c_before = net->c->weight.detach().clone();
    for (int s = 0; s < 2; ++s) {
      for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();  // zero_grad(set_to_none)
      auto x = input_of(rank, s, 3);
      auto loss = net->a(x).sum() + (rank == 1 ? net->b(x).sum() : torch::zeros({}));  // b on rank 1 only
      loss.backward();
      if (net->c->weight.grad().defined() || net->c->bias.grad().defined())
        throw std::runtime_error("c, used by no rank, has a gradient");
      if (!net->b->weight.grad().defined()) throw std::runtime_error("b, used by rank 1, has no gradient on rank " +
                                                                     std::to_string(rank));
      if (!dp.wrapper().unused_on_every_rank(4) || dp.wrapper().unused_on_every_rank(2))
        throw std::runtime_error("unused_on_every_rank is wrong");
      opt.step();
    }
    if (!torch::equal(net->c->weight, c_before)) throw std::runtime_error("the optimizer moved c");
  });
  check_all_ok(outs);
}

// Embedding(sparse=true) after zero_grad(true) hands autograd's sparse gradient over: it is
// averaged as a dense one (it used to end backward() with LibTorch's "Cannot access data
// pointer of Tensor that doesn't have storage").
TEST_CASE("torch: a sparse gradient is averaged") {
  const int world = 2, port = ddp_test::free_port();
  auto outs = run_processes({0, 1}, [&](int rank) {
    torch::set_num_threads(1);
    auto emb = torch::nn::Embedding(torch::nn::EmbeddingOptions(6, 3).sparse(true));
    auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
    ddp::torch_data_parallel dp{pg, *emb};
    for (auto& p : emb->parameters()) p.mutable_grad() = torch::Tensor();
    emb->forward(torch::tensor({rank, 4}, torch::kLong)).sum().backward();
    auto g = emb->weight.grad();
    if (g.is_sparse()) throw std::runtime_error("the gradient is still sparse");
    // Row r was looked up by rank r alone (1 / 2 each), row 4 by both (1).
    for (int row = 0; row < 6; ++row) {
      const float want = row == 4 ? 1.0f : row < 2 ? 0.5f : 0.0f;
      if (g[row].sub(want).abs().max().item<float>() != 0.0f)
        throw std::runtime_error("row " + std::to_string(row) + " of the averaged sparse gradient is wrong");
    }
  });
  check_all_ok(outs);
}

// overlap_optimizer: every parameter's optimizer steps inside backward() as its bucket is
// averaged; the weights after three steps are those of one SGD (momentum) over all of them,
// stepped after an ordinary backward(), on a second module with the same start.
TEST_CASE("torch: overlap_optimizer steps inside backward() as one optimizer after it would") {
  const int world = 2, port = ddp_test::free_port();
  auto outs = run_processes({0, 1}, [&](int rank) {
    torch::set_num_threads(1);
    Small a, b;
    auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
    ddp::torch_data_parallel da{pg, *a, ddp::bucket_policy{.cap_bytes = 64, .first_cap_bytes = 32}};
    ddp::torch_data_parallel db{pg, *b};
    {
      torch::NoGradGuard g;
      auto pa = a->parameters(), pb = b->parameters();
      for (std::size_t i = 0; i < pa.size(); ++i) pb[i].copy_(pa[i]);
    }
    const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
    da.overlap_optimizer([&](std::vector<torch::Tensor> p) { return std::make_unique<torch::optim::SGD>(p, sgd); });
    torch::optim::SGD ob(b->parameters(), sgd);
    if (da.optimizers().size() != 4) throw std::runtime_error("one optimizer per parameter");
    for (int s = 0; s < 3; ++s) {
      a->zero_grad();
      a->forward(input_of(rank, s, 3)).square().sum().backward();  // averaged and stepped
      ob.zero_grad();
      b->forward(input_of(rank, s, 3)).square().sum().backward();
      ob.step();
    }
    auto pa = a->parameters(), pb = b->parameters();
    for (std::size_t i = 0; i < pa.size(); ++i)
      if (!torch::allclose(pa[i], pb[i], 1e-6, 1e-7))
        throw std::runtime_error("parameter " + std::to_string(i) + " differs from the sequential optimizer's");
    if (da.wrapper().plan().buckets.size() < 2) throw std::runtime_error("the test needs several buckets");
  });
  check_all_ok(outs);
}

// No silent no-op (issue 45), with LibTorch.
// A parameter whose gradient one rank never produces (its layer unused there, without
// find_unused_parameters): that rank's backward() names it; the rank that reduced everything
// fails too, naming that rank, and none hangs or succeeds.
TEST_CASE("torch: a gradient one rank never produces fails that rank naming it, and its peer within the deadline") {
  const int world = 2, port = ddp_test::free_port();
  auto outs = run_processes({0, 1}, [&](int rank) {
    torch::set_num_threads(1);
    Small net;
    auto pg = ddp::init_process_group(group_options(rank, world, port, 5s));
    ddp::torch_data_parallel dp{pg, *net};
    auto x = input_of(rank, 0, 3);
    auto loss = rank == 0 ? net->forward(x).square().sum() : torch::tanh(net->l1(x)).square().sum();
    loss.backward();
    throw std::runtime_error("backward() returned although rank 1 never produced l2's gradients");
  });
  INFO(outs[0].message);
  INFO(outs[1].message);
  for (const auto& o : outs) {
    CHECK(o.exit_code == 1);  // a ddp::error, not the runtime_error of a step that went through
    CHECK(!o.timed_out);
    CHECK(o.seconds < 15);
  }
  CHECK(outs[1].errc == static_cast<int>(ddp::errc::usage));
  CHECK(outs[1].message.find("parameter 2 ('l2.weight'), parameter 3 ('l2.bias')") != std::string::npos);
  CHECK(outs[0].message.find("rank 1") != std::string::npos);
}

// The engine replaced a gradient tensor with a new one (other storage) between steps: the
// adapter follows it (autograd accumulates into the new tensor; the hook hands that gradient
// over and puts the tensor ddp reduces back), so every rank holds the average, in copy and view
// mode, never a stale buffer's values.
TEST_CASE("torch: a gradient replaced by a new tensor between steps still receives the average") {
  for (const bool view : {false, true}) {
    CAPTURE(view);
    const int world = 2, port = ddp_test::free_port();
    auto outs = run_processes({0, 1}, [&](int rank) {
      torch::set_num_threads(1);
      Small net, copy;
      auto pg = ddp::init_process_group(group_options(rank, world, port, 10s));
      ddp::torch_data_parallel dp{pg, *net, {}, {.gradient_as_bucket_view = view}};
      auto loss = [&](Small& m, int r) { return m->forward(input_of(r, 5, 3)).square().sum(); };
      for (int s = 0; s < 3; ++s) {
        auto want = average_grads(net, copy, world, loss);
        for (auto& p : net->parameters()) {
          const void* before = p.grad().defined() ? p.grad().data_ptr() : nullptr;
          p.mutable_grad() = torch::zeros_like(p);  // new storage, as an engine that reallocates
          if (p.grad().data_ptr() == before) throw std::runtime_error("the test needs new storage");
        }
        loss(net, rank).backward();
        require_grads(net, want, rank, "replaced gradient");
      }
    });
    check_all_ok(outs);
  }
}
