// The Eigen adapter (ddp/adapters/eigen.hpp): what it registers and rejects, and a small Eigen
// MLP trained by ddp::data_parallel on real processes, step by step against one process.
#include <ddp/adapters/eigen.hpp>

#include <ddp/data_parallel.hpp>
#include <ddp/optim/sgd.hpp>
#include <ddp/process_group.hpp>

#include <doctest/doctest.h>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "multiproc/harness.hpp"

using namespace std::chrono_literals;
using namespace ddp_test;

static_assert(ddp::parameter_set<ddp::eigen_parameters>);

namespace {

// ---- a small MLP in Eigen: samples are columns; tanh after every layer but the last ----------

constexpr int in_dim = 8;
constexpr int batch = 8;  // per rank
constexpr int steps = 40;
constexpr float learning_rate = 0.2f;
const std::vector<int> dims{in_dim, 16, 16, 1};

struct layer {
  Eigen::MatrixXf W, gW;  // out x in
  Eigen::VectorXf b, gb;  // out
  Eigen::MatrixXf input;  // saved by forward for backward: in x n
  // View mode: the gradients live in bucket memory (eigen_parameters::grad_view).
  float* gW_bucket = nullptr;
  float* gb_bucket = nullptr;
};

class mlp {
 public:
  mlp(unsigned seed) {
    std::mt19937 g(seed);
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    for (std::size_t l = 0; l + 1 < dims.size(); ++l) {
      layer L;
      L.W = Eigen::MatrixXf::NullaryExpr(dims[l + 1], dims[l], [&] { return u(g); });
      L.b = Eigen::VectorXf::NullaryExpr(dims[l + 1], [&] { return u(g); });
      L.gW = Eigen::MatrixXf::Zero(dims[l + 1], dims[l]);
      L.gb = Eigen::VectorXf::Zero(dims[l + 1]);
      layers.push_back(std::move(L));
    }
  }

  // Registration order: weight then bias of each layer, first layer first. The layers no
  // longer move (the vector is complete), so their matrices keep their addresses.
  void register_with(ddp::eigen_parameters& params) {
    for (std::size_t l = 0; l < layers.size(); ++l) {
      params.add("fc" + std::to_string(l + 1) + ".weight", layers[l].W, layers[l].gW);
      params.add("fc" + std::to_string(l + 1) + ".bias", layers[l].b, layers[l].gb);
    }
  }

  // View mode: backward and the optimizer use the bucket memory ddp hands out.
  template <class DP>
  void use_buckets(const ddp::eigen_parameters& params, DP& dp) {
    for (std::size_t l = 0; l < layers.size(); ++l) {
      layers[l].gW_bucket = params.grad_view<Eigen::MatrixXf>(dp, 2 * l).data();
      layers[l].gb_bucket = params.grad_view<Eigen::VectorXf>(dp, 2 * l + 1).data();
    }
  }

  // Mean squared error over the columns of X; ready(i) as soon as gradient i is final.
  template <class Ready>
  float forward_backward(const Eigen::MatrixXf& X, const Eigen::RowVectorXf& y, Ready&& ready) {
    Eigen::MatrixXf a = X;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      auto& L = layers[l];
      L.input = a;
      Eigen::MatrixXf z = (L.W * a).colwise() + L.b;
      a = l + 1 < layers.size() ? Eigen::MatrixXf(z.array().tanh().matrix()) : z;
      (void)L;
    }
    const auto n = static_cast<float>(X.cols());
    const Eigen::MatrixXf err = a - y;
    const float loss = err.squaredNorm() / n;
    Eigen::MatrixXf delta = (2.0f / n) * err;
    for (std::size_t l = layers.size(); l-- > 0;) {
      auto& L = layers[l];
      grads(L, [&](auto& gW, auto& gb) {
        gW.noalias() = delta * L.input.transpose();
        gb = delta.rowwise().sum();
      });
      ready(2 * l + 1);
      ready(2 * l);
      if (l == 0) break;
      delta = (L.W.transpose() * delta).cwiseProduct((1.0f - L.input.array().square()).matrix());
    }
    return loss;
  }

  void sgd() {
    for (auto& L : layers)
      grads(L, [&](auto& gW, auto& gb) {
        L.W -= learning_rate * gW;
        L.b -= learning_rate * gb;
      });
  }

  std::string hash() const {
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (const auto& L : layers)
      for (const float* p : {L.W.data(), L.b.data()})
        for (Eigen::Index k = 0; k < (p == L.W.data() ? L.W.size() : L.b.size()); ++k) {
          std::uint32_t bits;
          std::memcpy(&bits, p + k, 4);
          h = (h ^ bits) * 0x100000001b3ull;
        }
    return std::to_string(h);
  }

  // Largest |difference| of any weight or bias, relative to max(1, |reference|).
  double max_diff(const mlp& ref) const {
    double m = 0;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const auto& a = layers[l];
      const auto& b = ref.layers[l];
      const auto rel = [](const auto& x, const auto& y) {
        return ((x - y).array().abs() / y.array().abs().max(1.0f)).maxCoeff();
      };
      m = std::max({m, static_cast<double>(rel(a.W, b.W)), static_cast<double>(rel(a.b, b.b))});
    }
    return m;
  }

  std::vector<layer> layers;

 private:
  template <class F>
  static void grads(layer& L, F&& f) {
    if (L.gW_bucket != nullptr) {
      Eigen::Map<Eigen::MatrixXf> gW(L.gW_bucket, L.W.rows(), L.W.cols());
      Eigen::Map<Eigen::VectorXf> gb(L.gb_bucket, L.b.size());
      f(gW, gb);
    } else {
      f(L.gW, L.gb);
    }
  }
};

// The whole batch of a step (world * batch samples, the same on every rank); shard r is
// columns [r * batch, (r + 1) * batch).
struct step_data {
  Eigen::MatrixXf X;
  Eigen::RowVectorXf y;
};

step_data make_step(int step, int world) {
  std::mt19937 g(1000u + static_cast<unsigned>(step));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  step_data d;
  d.X = Eigen::MatrixXf::NullaryExpr(in_dim, world * batch, [&] { return u(g); });
  d.y.resize(world * batch);
  for (int s = 0; s < world * batch; ++s)
    d.y(s) = std::sin(2.0f * d.X(0, s)) * d.X(1, s) + 0.5f * std::tanh(d.X(2, s) - d.X(3, s));
  return d;
}

// One process, the full batch of every step: the model ddp's ranks must reproduce.
struct full_batch_reference {
  mlp model{1234u};  // rank 0's initialization: construction broadcasts it
  void step(const step_data& d) {
    model.forward_backward(d.X, d.y, [](std::size_t) {});
    model.sgd();
  }
};

// One process, each shard's gradient in turn, summed in rank order and divided by the world
// size: what ddp computes, up to the order of the additions (none to choose for 2 ranks).
struct per_shard_reference {
  mlp model{1234u};
  void step(const step_data& d, int world) {
    std::vector<Eigen::MatrixXf> sw(model.layers.size());
    std::vector<Eigen::VectorXf> sb(model.layers.size());
    for (int q = 0; q < world; ++q) {
      model.forward_backward(d.X.middleCols(q * batch, batch), d.y.segment(q * batch, batch), [](std::size_t) {});
      for (std::size_t l = 0; l < model.layers.size(); ++l) {
        if (q == 0) {
          sw[l] = model.layers[l].gW;
          sb[l] = model.layers[l].gb;
        } else {
          sw[l] += model.layers[l].gW;
          sb[l] += model.layers[l].gb;
        }
      }
    }
    for (std::size_t l = 0; l < model.layers.size(); ++l) {
      model.layers[l].gW = sw[l] / static_cast<float>(world);
      model.layers[l].gb = sb[l] / static_cast<float>(world);
    }
    model.sgd();
  }
};

// f32 tolerance against the full batch: the ranks' gradients are the same sums taken in
// another order (a per-rank mean, then the average), so each step differs by a few ulps, and
// 40 steps of SGD carry that along: relative 1e-6 (measured 1.2e-7, see the test's output).
constexpr double full_batch_tolerance = 1e-6;

// Trains on `world` processes; on every step: the weights hash the same on every rank, and they
// match the references. Returns through exceptions (the harness reports them).
void train(int rank, int world, int port, bool view_mode, bool sharded = false) {
  auto pg = ddp::init_process_group(group_options(rank, world, port, 30s));
  mlp model(1234u + static_cast<unsigned>(rank));  // construction replaces it by rank 0's
  ddp::eigen_parameters params;
  model.register_with(params);
  ddp::data_parallel dp{pg, params, ddp::bucket_policy{.cap_bytes = 512, .first_cap_bytes = 128},
                        ddp::dp_options{.gradient_as_bucket_view = view_mode, .shard = sharded}};
  // The sharded mode steps each rank's shard with ddp::sgd, whose update (p + (-lr) * g) is
  // bitwise the model's own (W -= lr * gW), so every check below holds unchanged.
  ddp::sgd shard_sgd{{.lr = learning_rate}};
  require(dp.plan().buckets.size() > 1, "the plan has one bucket: nothing overlaps backward");
  if (view_mode) model.use_buckets(params, dp);
  full_batch_reference full;
  per_shard_reference shard;
  double worst_full = 0, worst_shard = 0;
  std::vector<double> losses;  // mean over the ranks, per step
  for (int s = 0; s < steps; ++s) {
    const step_data d = make_step(s, world);
    const float loss = model.forward_backward(d.X.middleCols(rank * batch, batch), d.y.segment(rank * batch, batch),
                                              [&](std::size_t i) { params.grad_ready(dp, i); });
    dp.finish();
    // Handing gradients over layer by layer lets the last layers' buckets go before finish().
    require(dp.last_step_stats().launched_before_finish >= 1, "no bucket was launched during backward");
    if (sharded)
      dp.step(shard_sgd);
    else
      model.sgd();
    params.check();
    const auto hashes = pg.all_gather(model.hash());
    double mean = 0;
    for (const auto& l : pg.all_gather(std::to_string(loss))) mean += std::stod(l) / world;
    losses.push_back(mean);
    for (int r = 1; r < world; ++r)
      require(hashes[static_cast<std::size_t>(r)] == hashes[0],
              "step " + std::to_string(s) + ": rank " + std::to_string(r) + "'s weights differ from rank 0's");
    full.step(d);
    shard.step(d, world);
    worst_full = std::max(worst_full, model.max_diff(full.model));
    worst_shard = std::max(worst_shard, model.max_diff(shard.model));
    require(worst_full <= full_batch_tolerance, "step " + std::to_string(s) + ": relative difference " +
                                                    std::to_string(worst_full) + " from the full batch");
    if (world == 2)
      require(model.hash() == shard.model.hash(),
              "step " + std::to_string(s) + ": 2 ranks are not bitwise the average of the 2 shards' gradients");
  }
  // Training works: the last steps' loss is well below the first steps'.
  const double early = (losses[0] + losses[1] + losses[2]) / 3;
  const double late = (losses[steps - 1] + losses[steps - 2] + losses[steps - 3]) / 3;
  require(late < early / 2, "the loss did not fall: " + std::to_string(early) + " -> " + std::to_string(late));
  if (rank == 0)
    std::printf("eigen MLP on %d processes (%s mode%s), %d steps, loss %.4f -> %.4f: the same weights on every rank "
                "each step; max relative difference from one process on the full batch %.3g (tolerance %.0e), "
                "from the per-shard average %.3g%s\n",
                world, view_mode ? "view" : "copy", sharded ? ", sharded SGD" : "", steps, early, late, worst_full, full_batch_tolerance, worst_shard,
                world == 2 ? " (bitwise equal, checked)" : "");
}

}  // namespace

TEST_CASE("eigen: registered matrices, vectors, arrays and views give their dtype, memory-order shape and storage") {
  Eigen::MatrixXf W(3, 4), gW(3, 4);                           // column-major: {4, 3}
  Eigen::Matrix<double, 2, 3, Eigen::RowMajor> D, gD;          // fixed, row-major: {2, 3}
  Eigen::VectorXf b(5), gb(5);                                 // {5}
  Eigen::RowVectorXf r(5), gr(5);                              // {5}
  Eigen::Array<std::int32_t, Eigen::Dynamic, 1> ai(3), gai(3);  // {3}
  Eigen::Matrix<Eigen::half, 2, 2> h, gh;
  Eigen::Matrix<Eigen::bfloat16, Eigen::Dynamic, 1> bf(4), gbf(4);
  Eigen::Matrix<std::int64_t, 2, 2> li, gli;
  std::vector<float> flat(26), gflat(26);  // one flat buffer, parameters as Maps into it
  Eigen::Map<Eigen::MatrixXf> m(flat.data(), 4, 5), gm(gflat.data(), 4, 5);
  Eigen::MatrixXf big(4, 6), gbig(4, 6);
  Eigen::Ref<Eigen::MatrixXf> rf(big), grf(gbig);

  ddp::eigen_parameters p;
  CHECK(p.add("W", W, gW) == 0);
  CHECK(p.add("D", D, gD) == 1);
  p.add("b", b, gb);
  p.add("r", r, gr);
  p.add("ai", ai, gai);
  p.add("h", h, gh);
  p.add("bf", bf, gbf);
  p.add("li", li, gli);
  p.add("m", m, gm);
  p.add("cols", big.middleCols(1, 2), gbig.middleCols(1, 2));       // whole columns: contiguous
  p.add("seg", Eigen::Map<Eigen::VectorXf>(flat.data() + 20, 6).segment(2, 3),
        Eigen::Map<Eigen::VectorXf>(gflat.data() + 20, 6).segment(2, 3));
  p.add("ref", rf, grf);
  REQUIRE(p.size() == 12);

  const auto v = ddp::to_views(p);
  using shape = std::vector<std::int64_t>;
  const std::vector<std::tuple<const char*, ddp::dtype, shape, const void*, const void*>> want{
      {"W", ddp::dtype::f32, shape{4, 3}, W.data(), gW.data()},
      {"D", ddp::dtype::f64, shape{2, 3}, D.data(), gD.data()},
      {"b", ddp::dtype::f32, shape{5}, b.data(), gb.data()},
      {"r", ddp::dtype::f32, shape{5}, r.data(), gr.data()},
      {"ai", ddp::dtype::i32, shape{3}, ai.data(), gai.data()},
      {"h", ddp::dtype::f16, shape{2, 2}, h.data(), gh.data()},
      {"bf", ddp::dtype::bf16, shape{4}, bf.data(), gbf.data()},
      {"li", ddp::dtype::i64, shape{2, 2}, li.data(), gli.data()},
      {"m", ddp::dtype::f32, shape{5, 4}, flat.data(), gflat.data()},
      {"cols", ddp::dtype::f32, shape{2, 4}, big.data() + 4, gbig.data() + 4},
      {"seg", ddp::dtype::f32, shape{3}, flat.data() + 22, gflat.data() + 22},
      {"ref", ddp::dtype::f32, shape{6, 4}, big.data(), gbig.data()},
  };
  for (std::size_t i = 0; i < want.size(); ++i) {
    const auto& [name, type, sh, data, grad] = want[i];
    const std::string label = name;  // clang: a structured binding cannot be captured by CAPTURE's lambda
    CAPTURE(label);
    CHECK(v[i].name == name);
    CHECK(v[i].type == type);
    CHECK(v[i].shape == sh);
    CHECK(v[i].data == data);
    CHECK(v[i].grad == grad);
    CHECK(v[i].device == -1);
    CHECK(v[i].numel == p.numel(i));
  }
  // The names outlive more registrations (the views keep string_views into them).
  const char* first_name = v[0].name.data();
  for (int k = 0; k < 64; ++k) p.add("extra" + std::to_string(k), W.col(0), gW.col(0));
  CHECK(p.name(0).data() == first_name);
  CHECK(v[0].name == "W");
}

TEST_CASE("eigen: add rejects a gradient of another size, shape or storage order, a view with gaps, a duplicate name") {
  Eigen::MatrixXf W(3, 4), gW(3, 4);
  ddp::eigen_parameters p;
  p.add("fc1.weight", W, gW);
  Eigen::MatrixXf wrong_size(3, 5), transposed(4, 3);
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> row_major(3, 4);
  CHECK(raises([&] { p.add("fc2.weight", W, wrong_size); }, ddp::errc::invalid_argument,
               {"eigen_parameters::add: parameter 1 ('fc2.weight'): the gradient is 3x5 column-major but the "
                "parameter is 3x4 column-major; give the gradient the parameter's shape"}) == "");
  CHECK(raises([&] { p.add("fc2.weight", W, transposed); }, ddp::errc::invalid_argument,
               {"parameter 1 ('fc2.weight'): the gradient is 4x3 column-major but the parameter is 3x4",
                "and storage order"}) == "");
  CHECK(raises([&] { p.add("fc2.weight", W, row_major); }, ddp::errc::invalid_argument,
               {"the gradient is 3x4 row-major but the parameter is 3x4 column-major", "storage order"}) == "");
  Eigen::MatrixXf big(4, 4), gbig(4, 4);
  CHECK(raises([&] { p.add("corner", big.topLeftCorner(2, 2), gbig.topLeftCorner(2, 2)); },
               ddp::errc::invalid_argument,
               {"parameter 1 ('corner'): the parameter is a view with gaps (2x2 column-major, inner stride 1, outer "
                "stride 4); ddp needs contiguous storage"}) == "");
  CHECK(raises([&] { p.add("rows", big.topRows(2), gbig.topRows(2)); }, ddp::errc::invalid_argument,
               {"('rows'): the parameter is a view with gaps"}) == "");
  CHECK(raises([&] { p.add("fc1.weight", W, gW); }, ddp::errc::invalid_argument,
               {"parameter 1 ('fc1.weight'): a parameter of this name is already registered"}) == "");
  // A vector and an n x 1 matrix agree; nothing was registered by the failed calls.
  Eigen::VectorXf b(3);
  Eigen::MatrixXf gb(3, 1);
  CHECK(p.add("fc1.bias", b, gb) == 1);
  CHECK(p.size() == 2);
  CHECK(raises([&] { (void)p.shape(2); }, ddp::errc::invalid_argument, {"parameter 2 does not exist (2 registered)"}) == "");
}

TEST_CASE("eigen: a gradient resized or swapped after registration is an errc::usage error naming it") {
  mlp model(1u);
  ddp::eigen_parameters p;
  model.register_with(p);
  p.check();
  model.layers[1].gW.resize(3, 3);
  CHECK(raises([&] { p.check(); }, ddp::errc::usage,
               {"parameter 2 ('fc2.weight'): its gradient no longer has the storage registered for it (was 16x16, "
                "now 3x3: resized); a data_parallel wrapper built from these parameters still points at the old memory"}) == "");
  // A wrapper built now would take the stale address: to_views (its first step) refuses too.
  CHECK(raises([&] { (void)ddp::to_views(p); }, ddp::errc::usage, {"('fc2.weight')", "resized"}) == "");
  // Same size, other memory: fc3.weight's gradient swapped with a matrix alive at the same time.
  Eigen::MatrixXf other = Eigen::MatrixXf::Zero(1, 16);
  model.layers[2].gW.swap(other);
  CHECK(raises([&] { p.check(4); }, ddp::errc::usage,
               {"parameter 4 ('fc3.weight'): its gradient", "same size 1x16, other memory: reassigned or swapped"}) == "");
  p.check(0);  // the others are as registered
  model.layers[2].gW.swap(other);
  p.check(4);
  // The parameter side is watched as well.
  model.layers[0].b.resize(1);
  CHECK(raises([&] { p.check(1); }, ddp::errc::usage, {"parameter 1 ('fc1.bias'): the parameter", "was 16x1, now 1x1"}) == "");
}

TEST_CASE("eigen: an MLP on 2 processes: every step, the same weights on each rank, bitwise the average of the "
          "shards' gradients, and one process on the full batch within relative 1e-6") {
  const int port = free_port();
  const auto outs = run_ranks(2, [&](int r) { train(r, 2, port, false); });
  CHECK_MESSAGE(all_ok(outs), summary(outs));
}

TEST_CASE("eigen: an MLP on 4 processes: every step, the same weights on each rank, and one process on the full "
          "batch within relative 1e-6") {
  const int port = free_port();
  const auto outs = run_ranks(4, [&](int r) { train(r, 4, port, false); });
  CHECK_MESSAGE(all_ok(outs), summary(outs));
}

TEST_CASE("eigen: gradient as bucket view: backward writes through grad_view's Maps; the same training") {
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = free_port();
    const auto outs = run_ranks(world, [&](int r) { train(r, world, port, true); });
    CHECK_MESSAGE(all_ok(outs), summary(outs));
  }
}

TEST_CASE("eigen: sharded (dp_options::shard, ddp::sgd): the same training, bitwise on 2 ranks") {
  for (int world : {2, 4}) {
    CAPTURE(world);
    const int port = free_port();
    const auto outs = run_ranks(world, [&](int r) { train(r, world, port, false, true); });
    CHECK_MESSAGE(all_ok(outs), summary(outs));
  }
}

TEST_CASE("eigen: grad_view refuses copy mode and a Map type that does not fit the parameter") {
  expect_ok(on_ranks(1, local_group{10s}, [&](ddp::process_group& pg) {
    mlp model(7u);
    ddp::eigen_parameters params;
    model.register_with(params);
    {
      ddp::data_parallel copy{pg, params};
      require_raises([&] { (void)params.grad_view<Eigen::MatrixXf>(copy, 0); }, ddp::errc::usage,
                   {"rank 0: eigen_parameters::grad_view: parameter 0 ('fc1.weight'): the wrapper is in copy mode"});
    }
    ddp::data_parallel dp{pg, params, {}, {.gradient_as_bucket_view = true}};
    require_raises([&] { (void)params.grad_view<Eigen::MatrixXd>(dp, 0); }, ddp::errc::invalid_argument,
                 {"('fc1.weight'): Map of f64 over a f32 gradient"});
    require_raises([&] { (void)params.grad_view<Eigen::Matrix<float, -1, -1, Eigen::RowMajor>>(dp, 0); },
                 ddp::errc::invalid_argument, {"('fc1.weight'): a -1x-1 row-major type (-1: dynamic) over 16x8 column-major"});
    require_raises([&] { (void)params.grad_view<Eigen::Matrix<float, 8, 16>>(dp, 0); }, ddp::errc::invalid_argument,
                 {"a 8x16 column-major type"});
    require_raises([&] { (void)params.grad_view<Eigen::Vector4f>(dp, 1); }, ddp::errc::invalid_argument,
                 {"('fc1.bias'): a vector type of 4 elements over 16x1 (a vector)"});
    auto gW = params.grad_view<Eigen::MatrixXf>(dp, 0);
    require(gW.data() == dp.bucket_grad(0) && gW.rows() == 16 && gW.cols() == 8, "grad_view's Map is not the bucket slot");
    // The bucket held the registered gradient at construction (so nothing accumulated is lost).
    require(gW == model.layers[0].gW, "the bucket slot does not hold the registered gradient");
  }));
}

TEST_CASE("eigen: a rank whose gradient was resized mid-training fails naming it, and its peer fails too, not hangs") {
  const auto outs = on_ranks(2, local_group{10s}, [&](int r, ddp::process_group& pg) {
    mlp model(1234u);
    ddp::eigen_parameters params;
    model.register_with(params);
    ddp::data_parallel dp{pg, params};
    for (int s = 0; s < 3; ++s) {
      const step_data d = make_step(s, 2);
      model.forward_backward(d.X.middleCols(r * batch, batch), d.y.segment(r * batch, batch), [&](std::size_t i) {
        // The engine's bug: between computing fc1.weight's gradient and handing it over, it
        // reallocates the matrix; the wrapper would copy from freed memory.
        if (r == 1 && s == 1 && i == 0) model.layers[0].gW.resize(4, 4);
        params.grad_ready(dp, i);
      });
      dp.finish();
      model.sgd();
    }
  });
  REQUIRE(outs.size() == 2);
  const auto& bad = outs[1];
  CHECK(bad.exit_code == 1);
  CHECK(bad.errc == static_cast<int>(ddp::errc::usage));
  CHECK_MESSAGE(bad.message.find("rank 1: parameter 0 ('fc1.weight'): its gradient no longer has the storage "
                                 "registered for it (was 16x8, now 4x4: resized)") != std::string::npos,
                bad.message);
  const auto& peer = outs[0];
  CHECK_MESSAGE((!peer.ok() && !peer.timed_out && peer.seconds < 20), summary(outs));
  // Told at once (params.grad_ready goes through the wrapper's check, which fails the wrapper
  // and tells the peers), quoting the parameter, not at its 10 s deadline.
  CHECK_MESSAGE(peer.seconds < 8, summary(outs));
  CHECK_MESSAGE(peer.message.find("rank 1 reports: data_parallel failed in grad_ready for parameter 0 ('fc1.weight')") !=
                    std::string::npos,
                peer.message);
}

// No silent no-op (issue 45): an engine wrapped before it registered anything (as dlib's net
// before its first forward) is refused on every rank, and the message says when to wrap.
TEST_CASE("eigen: an eigen_parameters with nothing registered is errc::invalid_argument on every rank") {
  const auto outs = on_ranks(2, local_group{10s}, [&](ddp::process_group& pg) {
    mlp model(7u);
    ddp::eigen_parameters params;  // model.register_with(params) not called yet
    ddp::data_parallel dp{pg, params};
    dp.finish();
  });
  for (const auto& o : outs) {
    CAPTURE(o.message);
    CHECK(o.exit_code == 1);
    CHECK(o.errc == static_cast<int>(ddp::errc::invalid_argument));
    CHECK(o.message.find("the parameter set is empty") != std::string::npos);
    CHECK(o.message.find("wrap it after it has allocated them") != std::string::npos);
  }
}

// A registered parameter whose gradient backward never hands over (the engine's hook loop
// misses it): finish() names it, by index and name, on every rank.
TEST_CASE("eigen: a gradient the engine never hands over is errc::usage naming it on every rank") {
  const auto outs = on_ranks(2, local_group{10s}, [&](int r, ddp::process_group& pg) {
    mlp model(1234u);
    ddp::eigen_parameters params;
    model.register_with(params);
    ddp::data_parallel dp{pg, params};
    const step_data d = make_step(0, 2);
    model.forward_backward(d.X.middleCols(r * batch, batch), d.y.segment(r * batch, batch), [&](std::size_t i) {
      if (i != 3) params.grad_ready(dp, i);
    });
    dp.finish();
  });
  for (const auto& o : outs) {
    CAPTURE(o.message);
    CHECK(o.exit_code == 1);
    CHECK(!o.timed_out);
    CHECK(o.errc == static_cast<int>(ddp::errc::usage));
    CHECK(o.message.find("1 parameter never became ready this step: parameter 3 ('fc2.bias')") != std::string::npos);
  }
}

TEST_CASE("eigen: ranks holding a matrix in different storage orders disagree at construction (errc::mismatch)") {
  const auto outs = on_ranks(2, local_group{10s}, [&](int r, ddp::process_group& pg) {
    Eigen::MatrixXf cw(4, 6), gcw(4, 6);
    Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rw(4, 6), grw(4, 6);
    ddp::eigen_parameters params;
    if (r == 0)
      params.add("w", cw, gcw);  // {6, 4} in memory order
    else
      params.add("w", rw, grw);  // {4, 6}
    ddp::data_parallel dp{pg, params};
  });
  for (const auto& o : outs) {
    CAPTURE(o.message);
    CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
    CHECK(o.message.find("'w'") != std::string::npos);
  }
}

TEST_CASE("eigen: buffers and a frozen matrix are rank 0's at construction; buffers rank 0's after each step") {
  const auto outs = on_ranks(3, local_group{10s}, [&](int r, ddp::process_group& pg) {
    Eigen::MatrixXf w = Eigen::MatrixXf::Constant(3, 2, static_cast<float>(r)), gw = Eigen::MatrixXf::Zero(3, 2);
    Eigen::VectorXf mean = Eigen::VectorXf::Constant(4, 7.0f + static_cast<float>(r));
    Eigen::MatrixXd frozen = Eigen::MatrixXd::Constant(2, 2, 1.0 + r);
    Eigen::Matrix<std::int64_t, Eigen::Dynamic, 1> count = Eigen::Matrix<std::int64_t, Eigen::Dynamic, 1>::Constant(1, 10 * r);
    ddp::eigen_parameters params;
    params.add("w", w, gw);
    params.add_buffer("bn.mean", mean);
    params.add_buffer("frozen", frozen, ddp::buffer_kind::frozen_parameter);
    params.add_buffer("bn.count", count);
    ddp::data_parallel dp{pg, params};
    if (w(0, 0) != 0.0f || mean(3) != 7.0f || frozen(1, 1) != 1.0 || count(0) != 0)
      throw std::runtime_error("not rank 0's state after construction");
    mean.setConstant(100.0f + static_cast<float>(r));  // what this rank's forward left
    frozen.setConstant(-1.0 * r);
    count(0) = r + 1;
    params.grad_ready(dp, 0);
    dp.finish();
    if (mean(0) != 100.0f || count(0) != 1) throw std::runtime_error("buffers are not rank 0's after the step");
    if (frozen(0, 0) != -1.0 * r) throw std::runtime_error("the frozen matrix changed after construction");
  });
  for (const auto& o : outs) {
    CAPTURE(o.message);
    CHECK(o.ok());
  }
}
