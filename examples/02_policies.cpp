// Swapping the data-parallel policies at compile time: the same training loop runs with
// different reducers (ring or tree over TCP, shared memory where available), a custom bucket
// planner, and copy or view mode; tunables such as the bucket cap stay run-time values.
//
//   ddprun -n 4 build/examples/02_policies
//
// Every variant trains the same linear model from the same start on the same shards, so they
// must end within rounding of each other; the program checks that and exits non-zero if not.
#include <ddp/concepts.hpp>
#include <ddp/data_parallel.hpp>
#include <ddp/ddp.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/tree.hpp>
#include <ddp/transport/tcp.hpp>
#if __has_include(<ddp/reducer/shm.hpp>)
#include <ddp/memory/shm_allocator.hpp>
#include <ddp/reducer/shm.hpp>
#define DDP_EXAMPLE_HAS_SHM 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

// A planner policy of our own: the whole model in one bucket (one collective per step, no
// overlap with backward). Anything with a matching plan() satisfies ddp::bucket_planner.
struct one_bucket_planner {
  ddp::bucket_plan plan(std::span<const ddp::param_info> params, const ddp::bucket_policy&,
                        std::span<const std::size_t> order) const {
    constexpr auto all = std::numeric_limits<std::size_t>::max();
    return ddp::size_planner{}.plan(params, ddp::bucket_policy{.cap_bytes = all, .first_cap_bytes = all}, order);
  }
};
static_assert(ddp::bucket_planner<one_bucket_planner>);

// Linear least squares y = W x, W of 8 layers x 64 x 64 (so there are several buckets).
constexpr int dim = 64, layers = 8, samples = 64, steps = 15;

struct result {
  std::string name;
  double first_loss = 0, loss = 0, sync_ms = 0;
  std::vector<float> weights;
};

// One training run with the policies of `DP`; the loop itself does not depend on them.
template <class DP>
result train(ddp::process_group& pg, const char* name, ddp::bucket_policy policy, ddp::dp_options opts) {
  std::vector<std::vector<float>> w(layers, std::vector<float>(dim * dim, 0.0f)), g = w;
  std::vector<ddp::tensor_view> params;
  for (int l = 0; l < layers; ++l) params.push_back(ddp::make_tensor_view(w[l], g[l], "", {dim, dim}));
  DP dp{pg, params, policy, opts};

  // Layer l's target is a fixed matrix; each rank sees its own inputs.
  std::mt19937 gen(7u + static_cast<unsigned>(pg.rank()));
  std::normal_distribution<float> nd;
  std::vector<float> x(samples * dim);
  for (auto& v : x) v = nd(gen);
  const auto target = [](int l, int o, int i) { return 0.01f * static_cast<float>((l + 3 * o + 5 * i) % 11 - 5); };

  result res{name, 0, 0, 0, {}};
  for (int s = 0; s < steps; ++s) {
    double loss = 0;
    for (int l = layers; l-- > 0;) {  // backward: last layer first
      float* grad = opts.gradient_as_bucket_view ? static_cast<float*>(dp.bucket_grad(static_cast<std::size_t>(l)))
                                                 : g[static_cast<std::size_t>(l)].data();
      std::fill(grad, grad + dim * dim, 0.0f);
      for (int n = 0; n < samples; ++n)
        for (int o = 0; o < dim; ++o) {
          float err = 0;
          for (int i = 0; i < dim; ++i) err += (w[l][o * dim + i] - target(l, o, i)) * x[n * dim + i];
          loss += err * err / samples;
          for (int i = 0; i < dim; ++i) grad[o * dim + i] += 2 * err * x[n * dim + i] / samples;
        }
      dp.grad_ready(static_cast<std::size_t>(l));
    }
    dp.finish();
    res.sync_ms += dp.last_step_stats().exposed_ms / steps;
    for (int l = 0; l < layers; ++l) {
      const float* grad = opts.gradient_as_bucket_view ? static_cast<const float*>(dp.bucket_grad(static_cast<std::size_t>(l)))
                                                       : g[static_cast<std::size_t>(l)].data();
      for (int k = 0; k < dim * dim; ++k) w[l][k] -= 0.005f * grad[k];
    }
    if (s == 0) res.first_loss = loss;
    res.loss = loss;
  }
  for (auto& v : w) res.weights.insert(res.weights.end(), v.begin(), v.end());
  return res;
}

#ifdef DDP_EXAMPLE_HAS_SHM
// The shared-memory reducers come with the shm transport; this stays false until they exist.
template <class Transport>
constexpr bool shm_reducers_ready = requires { sizeof(typename ddp::engine_for<ddp::ring_algorithm, Transport>::type); };

template <class Transport>
void train_shm(ddp::process_group& pg, std::vector<result>& out, ddp::bucket_policy policy) {
  if constexpr (shm_reducers_ready<Transport>) {
    // Buckets inside the shared segment: the allocator is built from the reducer's transport.
    using local_dp = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<Transport>, ddp::shm_allocator>;
    out.push_back(train<local_dp>(pg, "ring<shm> + shm_allocator, view", policy, {.gradient_as_bucket_view = true}));
  } else {
    if (pg.rank() == 0) std::printf("(ring<shm> is not available in this build yet)\n");
  }
}
#endif

}  // namespace

int main() try {
  using namespace ddp::literals;
  auto pg = ddp::init_process_group(ddp::init_options::from_env());
  const ddp::bucket_policy policy{.cap_bytes = 32_KiB, .first_cap_bytes = 16_KiB};

  using default_dp = ddp::data_parallel;  // size_planner, ring<tcp>, host_allocator
  using tree_dp = ddp::basic_data_parallel<ddp::size_planner, ddp::tree<ddp::tcp>>;
  using single_bucket_dp = ddp::basic_data_parallel<one_bucket_planner, ddp::ring<ddp::tcp>>;

  std::vector<result> runs;
  runs.push_back(train<default_dp>(pg, "ring<tcp>, copy", policy, {}));
  runs.push_back(train<default_dp>(pg, "ring<tcp>, view", policy, {.gradient_as_bucket_view = true}));
  runs.push_back(train<tree_dp>(pg, "tree<tcp>, copy", policy, {}));
  runs.push_back(train<single_bucket_dp>(pg, "one bucket, ring<tcp>", policy, {}));
#ifdef DDP_EXAMPLE_HAS_SHM
  train_shm<ddp::shm>(pg, runs, policy);
#endif

  bool ok = true;
  for (const auto& r : runs) {
    double diff = 0;
    for (std::size_t k = 0; k < r.weights.size(); ++k)
      diff = std::max(diff, static_cast<double>(std::abs(r.weights[k] - runs[0].weights[k])));
    ok = ok && diff <= 1e-5;
    if (pg.rank() == 0)
      std::printf("%-34s loss %.3f -> %.3f  exposed sync %6.3f ms/step  max |w - w(ring<tcp>)| %.2g\n",
                  r.name.c_str(), r.first_loss, r.loss, r.sync_ms, diff);
  }
  if (pg.rank() == 0) std::printf("all policies agree within 1e-5: %s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
} catch (const ddp::error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
