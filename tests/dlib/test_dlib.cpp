// The dlib adapter (ddp/adapters/dlib.hpp): what it presents of a dlib network (forward order,
// names, shapes, the tensors dlib steps), when it is empty, and a small dlib MLP trained on real
// processes with dlib's own solver, step by step against one process that averages by hand.
#include <ddp/adapters/dlib.hpp>

#include <ddp/data_parallel.hpp>
#include <ddp/process_group.hpp>

#include <doctest/doctest.h>

#include <dlib/dnn.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "multiproc/harness.hpp"

using namespace std::chrono_literals;
using namespace ddp_test;

namespace {

// layer<0> the loss, layer<1> fc<1>, layer<2> relu, layer<3> fc<8>, layer<4> relu, layer<5>
// fc<8>, layer<6> the input: three layers with parameters, dlib's layers 5, 3, 1 in forward order.
using net_type = dlib::loss_mean_squared<
    dlib::fc<1, dlib::relu<dlib::fc<8, dlib::relu<dlib::fc<8, dlib::input<dlib::matrix<float, 0, 1>>>>>>>>;
static_assert(ddp::parameter_set<ddp::dlib_parameters<net_type>>);

constexpr long in_dim = 4;
constexpr int batch = 8;  // per rank
constexpr int steps = 20;
constexpr double learning_rate = 0.05;

// The batches of step `s` for every rank: rank q's are samples [q * batch, (q + 1) * batch).
struct step_data {
  std::vector<dlib::matrix<float, 0, 1>> x;
  std::vector<float> y;
};

step_data make_step(int s, int world) {
  std::mt19937 g(1000u + static_cast<unsigned>(s));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  step_data d;
  for (int k = 0; k < world * batch; ++k) {
    dlib::matrix<float, 0, 1> x(in_dim);
    float t = 0;
    for (long j = 0; j < in_dim; ++j) {
      x(j) = u(g);
      t += static_cast<float>(j + 1) * x(j);
    }
    d.x.push_back(x);
    d.y.push_back(std::tanh(t));
  }
  return d;
}

// Rank q's batch of `d` as dlib's input tensor, and its labels.
const float* load(net_type& net, const step_data& d, int q, dlib::resizable_tensor& x) {
  const auto b = d.x.begin() + q * batch;
  net.to_tensor(b, b + batch, x);
  return d.y.data() + q * batch;
}

std::uint64_t hash(const ddp::dlib_parameters<net_type>& p) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i < p.size(); ++i)
    for (std::size_t k = 0; k < p.numel(i); ++k) {
      std::uint32_t bits;
      std::memcpy(&bits, p.data(i) + k, 4);
      h = (h ^ bits) * 0x100000001b3ull;
    }
  return h;
}

std::vector<dlib::sgd> make_solvers() {
  return std::vector<dlib::sgd>(net_type::num_computational_layers, dlib::sgd(0.0005f, 0.9f));
}

// A net whose parameters dlib has allocated (one forward), its weights drawn from std::rand
// seeded with `seed`.
void allocate(net_type& net, unsigned seed) {
  std::srand(seed);
  dlib::resizable_tensor x;
  load(net, make_step(0, 1), 0, x);
  net.forward(x);
}

// Trains on `world` processes with dlib::sgd; every step the weights hash the same on every
// rank and, on rank 0, the same as one process that runs every rank's batch through a copy of
// the net, sums the gradients in rank order, divides by the world size and steps a copy of the
// solvers. Returns through exceptions (the harness reports them).
void train(int rank, int world, int port) {
  auto pg = ddp::init_process_group(group_options(rank, world, port, 30s));
  net_type net;
  allocate(net, 77u + static_cast<unsigned>(rank));  // a different start on every rank
  ddp::dlib_parameters params{net};
  ddp::bucket_policy buckets;  // one bucket per layer
  buckets.cap_bytes = 256;
  buckets.first_cap_bytes = 64;
  ddp::data_parallel dp{pg, params, buckets};
  require(dp.plan().buckets.size() == 3, "the plan does not have one bucket per layer");
  auto solvers = make_solvers();
  net_type ref = net;  // rank 0's weights, now on every rank
  auto ref_solvers = solvers;
  ddp::dlib_parameters rp{ref};
  std::vector<std::vector<float>> acc(rp.size());
  dlib::resizable_tensor x;
  double first_loss = 0, last_loss = 0;
  for (int s = 0; s < steps; ++s) {
    const step_data d = make_step(s, world);
    const double loss = net.compute_parameter_gradients(x, load(net, d, rank, x));
    params.average(dp);
    net.update_parameters(solvers, learning_rate);
    const auto hashes = pg.all_gather(std::to_string(hash(params)));
    for (int r = 1; r < world; ++r)
      require(hashes[static_cast<std::size_t>(r)] == hashes[0],
              "step " + std::to_string(s) + ": rank " + std::to_string(r) + "'s weights differ from rank 0's");
    const double mean = pg.all_reduce(loss, ddp::op::avg);
    (s == 0 ? first_loss : last_loss) = mean;
    if (rank != 0) continue;
    for (int q = 0; q < world; ++q) {
      ref.compute_parameter_gradients(x, load(ref, d, q, x));
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
    require(hash(rp) == hash(params), "step " + std::to_string(s) +
                                          ": the weights are not bitwise those of one process averaging the " +
                                          std::to_string(world) + " ranks' gradients by hand");
  }
  require(last_loss < first_loss,
          "the loss did not fall: " + std::to_string(first_loss) + " -> " + std::to_string(last_loss));
  if (rank == 0)
    std::printf(
        "dlib MLP on %d processes, %d steps of dlib::sgd, loss %.4f -> %.4f: bitwise the same weights on "
        "every rank and as one process averaging by hand, every step\n",
        world, steps, first_loss, last_loss);
}

}  // namespace

TEST_CASE("dlib: parameters in forward order, named layer<K>.TYPE, dlib's shapes, the tensors dlib steps") {
  net_type net;
  allocate(net, 1u);
  ddp::dlib_parameters params{net};
  REQUIRE(params.size() == 3);
  CHECK(params.buffer_count() == 0);
  // Forward order: the layer nearest the input first, the one under the loss last.
  CHECK(params.layer_index(0) == 5);
  CHECK(params.layer_index(1) == 3);
  CHECK(params.layer_index(2) == 1);
  CHECK(params.name(0) == "layer<5>.fc");
  CHECK(params.name(1) == "layer<3>.fc");
  CHECK(params.name(2) == "layer<1>.fc");
  // A fc over M inputs with N outputs: (M + 1) x N, the bias its last row.
  CHECK(params.shape(0) == std::vector<std::int64_t>{in_dim + 1, 8, 1, 1});
  CHECK(params.shape(1) == std::vector<std::int64_t>{9, 8, 1, 1});
  CHECK(params.shape(2) == std::vector<std::int64_t>{9, 1, 1, 1});
  CHECK(params.numel(0) == 40);
  CHECK(params.type(0) == ddp::dtype::f32);
  CHECK(params.data(0) == dlib::layer<5>(net).layer_details().get_layer_params().host());
  CHECK(params.data(2) == dlib::layer<1>(net).layer_details().get_layer_params().host());
  // After a forward only, dlib has no gradients yet: the adapter sizes them as dlib's first
  // backward would (zeros), and that backward then writes where they are.
  float* g0 = params.grad(0);
  REQUIRE(g0 != nullptr);
  CHECK(dlib::layer<5>(net).get_parameter_gradient().size() == 40);
  CHECK(g0[0] == 0.0f);
  dlib::resizable_tensor x;
  net.compute_parameter_gradients(x, load(net, make_step(1, 1), 0, x));
  CHECK(params.grad(0) == g0);
  CHECK(g0[0] != 0.0f);
  // The views the wrapper takes: names owned by the adapter, which a move keeps in place.
  const auto views = ddp::to_views(params);
  const char* name0 = views[0].name.data();
  ddp::dlib_parameters moved = std::move(params);
  CHECK(moved.name(0).data() == name0);
  CHECK(views[1].name == "layer<3>.fc");
  CHECK(views[2].grad == dlib::layer<1>(net).get_parameter_gradient().host());
}

TEST_CASE("dlib: a layer with learning rate multiplier 0 is a frozen parameter, not averaged") {
  net_type net;
  allocate(net, 1u);
  dlib::layer<3>(net).layer_details().set_learning_rate_multiplier(0);
  ddp::dlib_parameters params{net};
  REQUIRE(params.size() == 2);
  CHECK(params.name(0) == "layer<5>.fc");
  CHECK(params.name(1) == "layer<1>.fc");
  REQUIRE(params.buffer_count() == 1);
  const ddp::buffer_view b = params.buffer(0);
  CHECK(b.name == "layer<3>.fc");
  CHECK(b.kind == ddp::buffer_kind::frozen_parameter);
  CHECK(b.numel == 72);
  CHECK(b.data == dlib::layer<3>(net).layer_details().get_layer_params().host());
}

TEST_CASE(
    "dlib: a net not yet run forward has no parameters: a wrapper over it is errc::invalid_argument on every "
    "rank") {
  {
    net_type net;
    ddp::dlib_parameters params{net};
    CHECK(params.empty());
  }
  const auto outs = on_ranks(2, local_group{10s}, [&](ddp::process_group& pg) {
    net_type net;
    ddp::dlib_parameters params{net};  // before net.forward: dlib has allocated nothing
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

TEST_CASE(
    "dlib: an MLP on 2 processes with dlib::sgd: every step the same weights on each rank, bitwise one "
    "process averaging the two gradients by hand") {
  const int port = free_port();
  const auto outs = run_ranks(2, [&](int r) { train(r, 2, port); });
  CHECK_MESSAGE(all_ok(outs), summary(outs));
}

TEST_CASE("dlib: the same on 4 processes (the gradients summed in rank order, as the shared-memory reduction does)") {
  const int port = free_port();
  const auto outs = run_ranks(4, [&](int r) { train(r, 4, port); });
  CHECK_MESSAGE(all_ok(outs), summary(outs));
}

TEST_CASE("dlib: a gradient dlib reallocated after wrapping is errc::usage naming the layer, and the peer is told") {
  const auto outs = on_ranks(2, local_group{10s}, [&](int r, ddp::process_group& pg) {
    net_type net;
    allocate(net, 5u);
    ddp::dlib_parameters params{net};
    ddp::data_parallel dp{pg, params};
    auto solvers = make_solvers();
    dlib::resizable_tensor x;
    for (int s = 0; s < 3; ++s) {
      net.compute_parameter_gradients(x, load(net, make_step(s, 2), r, x));
      if (r == 1 && s == 1) {
        // The engine's bug: layer<3>'s gradient moves to new memory (a copy swapped in).
        auto& g = dynamic_cast<dlib::resizable_tensor&>(dlib::layer<3>(net).get_parameter_gradient());
        g = dlib::resizable_tensor(g);
      }
      params.average(dp);
      net.update_parameters(solvers, learning_rate);
    }
  });
  REQUIRE(outs.size() == 2);
  const auto& bad = outs[1];
  CHECK(bad.exit_code == 1);
  CHECK(bad.errc == static_cast<int>(ddp::errc::usage));
  CHECK_MESSAGE(bad.message.find("parameter 1 ('layer<3>.fc'): its gradient moved") != std::string::npos, bad.message);
  const auto& peer = outs[0];
  CHECK_MESSAGE((!peer.ok() && !peer.timed_out && peer.seconds < 8), summary(outs));
  CHECK_MESSAGE(
      peer.message.find("rank 1 reports: data_parallel failed in grad_ready for parameter 1 ('layer<3>.fc')") !=
          std::string::npos,
      peer.message);
}

namespace {

// Trains `steps` steps with copies of `proto`, unsharded (dlib's update_parameters on the
// averaged gradients) or sharded (params.step: dlib's solvers on this rank's slices); returns
// the weights.
template <class Solver>
std::vector<std::vector<float>> train_with(ddp::process_group& pg, bool sharded, const Solver& proto) {
  net_type net;
  allocate(net, 77u + static_cast<unsigned>(pg.rank()));
  ddp::dlib_parameters params{net};
  ddp::bucket_policy buckets;  // one bucket per layer, so shards cut layers and their biases
  buckets.cap_bytes = 256;
  buckets.first_cap_bytes = 64;
  ddp::dp_options o;
  o.shard = sharded;
  ddp::data_parallel dp{pg, params, buckets, o};
  std::vector<Solver> solvers(net_type::num_computational_layers, proto);
  dlib::resizable_tensor x;
  for (int s = 0; s < steps; ++s) {
    const step_data d = make_step(s, pg.size());
    net.compute_parameter_gradients(x, load(net, d, pg.rank(), x));
    params.average(dp);
    if (sharded)
      params.step(dp, solvers, learning_rate);
    else
      net.update_parameters(solvers, learning_rate);
  }
  std::vector<std::vector<float>> out;
  for (std::size_t i = 0; i < params.size(); ++i) out.emplace_back(params.data(i), params.data(i) + params.numel(i));
  return out;
}

void sharded_solvers(int rank, int world, int port) {
  auto pg = ddp::init_process_group(group_options(rank, world, port, 30s));
  const auto same = [&](const char* what, const auto& u, const auto& s) {
    for (std::size_t i = 0; i < u.size(); ++i)
      require(std::memcmp(u[i].data(), s[i].data(), u[i].size() * sizeof(float)) == 0,
              std::string(what) + ": layer " + std::to_string(i) + " differs from update_parameters' on rank " +
                  std::to_string(rank));
  };
  same("dlib::sgd", train_with(pg, false, dlib::sgd(0.0005f, 0.9f)), train_with(pg, true, dlib::sgd(0.0005f, 0.9f)));
  same("dlib::adam", train_with(pg, false, dlib::adam(0.0005f, 0.9f, 0.999f)),
       train_with(pg, true, dlib::adam(0.0005f, 0.9f, 0.999f)));
}

}  // namespace

TEST_CASE("dlib sharded: dlib::sgd and dlib::adam step each rank's slices, bitwise update_parameters' result") {
  for (const int world : {2, 3}) {
    CAPTURE(world);
    const int port = free_port();
    const auto outs = run_ranks(world, [&](int r) { sharded_solvers(r, world, port); });
    CHECK_MESSAGE(all_ok(outs), summary(outs));
  }
}
