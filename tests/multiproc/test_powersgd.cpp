// ddp::powersgd through the data-parallel wrapper, on real processes over tcp and shared memory.
#include <ddp/reducer/powersgd.hpp>

#include <ddp/data_parallel.hpp>
#include <ddp/memory/host_allocator.hpp>
#include <ddp/reducer/auto.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/transport/tcp.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "harness.hpp"
#include "reducer_checks.hpp"
#include "toy_model.hpp"

using namespace std::chrono_literals;
using namespace ddp_test;

namespace {

constexpr ddp_test::local_group opts{20s};

// A small model: two matrices PowerSGD compresses at rank 1 and 2 (48 x 40, and 32 x 4 x 2 x 2 as
// 32 x 16) and two tensors it sends as they are (a bias of 48, a 3 x 3 matrix too small to pay).
struct model : toy_model {
  model() {
    add(48 * 40, ddp::dtype::f32, {48, 40}).add(48).add(9, ddp::dtype::f32, {3, 3});
    add(32 * 16, ddp::dtype::f32, {32, 4, 2, 2});
  }
  static bool compressed(std::size_t i) { return i == 0 || i == 3; }
  std::size_t rows(std::size_t i) const { return static_cast<std::size_t>(views[i].shape[0]); }
  std::size_t cols(std::size_t i) const { return numel(i) / rows(i); }
};

// Rank q's gradient of parameter i, element j: a fixed rank-1 matrix times (1 + q) for the
// compressed tensors when `rank1`, else values that differ everywhere (full rank).
float input(int q, std::size_t i, std::size_t j, std::size_t cols, bool rank1, unsigned salt) {
  if (rank1 && model::compressed(i)) {
    const std::size_t a = j / cols, b = j % cols;
    return (1.0f + static_cast<float>(q)) * std::sin(0.3f * static_cast<float>(a + 1) + static_cast<float>(i)) *
           std::cos(0.17f * static_cast<float>(b) - static_cast<float>(salt));
  }
  return exact_input(q, j + 1000 * i + 7 * salt, ddp::op::avg) > 0 ? 1.0f + 0.01f * static_cast<float>(j % 13)
                                                                    : -0.5f - 0.02f * static_cast<float>((j + q) % 11);
}

double exact_avg(int n, std::size_t i, std::size_t j, std::size_t cols, bool rank1, unsigned salt) {
  double s = 0;
  for (int q = 0; q < n; ++q) s += input(q, i, j, cols, rank1, salt);
  return s / n;
}

// Runs `steps` steps of the wrapper `dp` on `m` with rank r's inputs; `check(step)` after each.
template <class DP, class Check>
void train(DP& dp, model& m, int r, int steps, bool rank1, Check&& check) {
  for (int s = 0; s < steps; ++s) {
    m.fill_grad(
        [&](std::size_t i, std::size_t j) { return input(r, i, j, m.cols(i), rank1, static_cast<unsigned>(s % 3)); });
    for (std::size_t i = m.size(); i-- > 0;) dp.grad_ready(i);
    dp.finish();
    check(s);
  }
}

using ring_tcp = ddp::ring<ddp::tcp>;
template <class Inner>
using psgd_dp = ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<Inner, ddp::powersgd>, ddp::host_allocator>;

}  // namespace

TEST_CASE("powersgd: plain steps first, then rank-1 gradients come through exactly, the same bits on every rank") {
  for (int n : {2, 3}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
      model m;
      // Buckets of 4 KiB: the 48 x 40 matrix alone, the rest in others (state per bucket).
      psgd_dp<ring_tcp> dp{pg, m.views, ddp::bucket_policy{.cap_bytes = 4096, .first_cap_bytes = 4096},
                           ddp::dp_options{}, ddp::powersgd{{.rank = 1, .start_iter = 2}}};
      require(dp.plan().buckets.size() >= 2, "several buckets");
      const auto& hook = dp.get_reducer().hook();
      train(dp, m, r, 6, true, [&](int s) {
        require((hook.elements_in() > 0) == (s >= 2), "compressed from step start_iter on, step " + std::to_string(s));
        for (std::size_t i = 0; i < m.size(); ++i) {
          const auto g = m.grad<float>(i);
          double big = 0;
          for (std::size_t j = 0; j < g.size(); ++j)
            big = std::max(big, std::fabs(exact_avg(n, i, j, m.cols(i), true, static_cast<unsigned>(s % 3))));
          const double tol = model::compressed(i) && s >= 2 ? 2e-5 * big : 1e-6 * big;
          for (std::size_t j = 0; j < g.size(); ++j) {
            const double want = exact_avg(n, i, j, m.cols(i), true, static_cast<unsigned>(s % 3));
            require(std::fabs(g[j] - want) <= tol, "step " + std::to_string(s) + " parameter " + std::to_string(i) +
                                                       " element " + std::to_string(j) + ": " + std::to_string(g[j]) +
                                                       " instead of " + std::to_string(want));
          }
          require_same_bits(pg, g.data(), g.size() * 4, "parameter " + std::to_string(i));
        }
      });
      require(hook.elements_on_wire() * 4 < hook.elements_in(), "fewer elements on the wire");
    }));
  }
}

TEST_CASE("powersgd: full-rank gradients give rank-r results; error feedback brings their running mean to the average") {
  const int n = 2;
  expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
    model m;
    // The running mean's error after 30 steps (inputs cycling through three), relative to the first
    // step's: 0.23 with error feedback, 0.78 without (ring over tcp, 2 ranks).
    auto mean_error = [&](bool feedback) {
      psgd_dp<ring_tcp> dp{pg, m.views, ddp::bucket_policy{.cap_bytes = 1 << 20}, ddp::dp_options{},
                           ddp::powersgd{{.rank = 1, .start_iter = 0, .error_feedback = feedback}}};
      std::vector<double> sum(m.numel(0), 0.0);
      double first = 0, mean = 0;
      const std::size_t rows = m.rows(0), cols = m.cols(0);
      train(dp, m, r, 30, false, [&](int s) {
        const auto g = m.grad<float>(0);
        double scale = 0;
        for (float v : g) scale = std::max(scale, static_cast<double>(std::fabs(v)));
        // Rank 1: every 2 x 2 minor vanishes.
        for (std::size_t a = 1; a < rows; a += 7)
          for (std::size_t b = 1; b < cols; b += 5) {
            const double minor = static_cast<double>(g[0]) * g[a * cols + b] - static_cast<double>(g[b]) * g[a * cols];
            require(std::fabs(minor) <= 1e-4 * scale * scale, "a rank-1 result, step " + std::to_string(s));
          }
        // The plain tensors are the exact average.
        const auto bias = m.grad<float>(1);
        for (std::size_t j = 0; j < bias.size(); ++j)
          require(std::fabs(bias[j] - exact_avg(n, 1, j, 1, false, static_cast<unsigned>(s % 3))) <= 1e-6,
                  "the bias is averaged exactly");
        for (std::size_t j = 0; j < g.size(); ++j) sum[j] += g[j];
        if (s == 0 || s == 29) {
          double num = 0, den = 0;
          for (std::size_t j = 0; j < g.size(); ++j) {
            // The inputs repeat every 3 steps: the mean of 30 steps is the mean of the three.
            double want = 0;
            for (unsigned k = 0; k < 3; ++k) want += exact_avg(n, 0, j, cols, false, s == 0 ? 0 : k) / (s == 0 ? 1 : 3);
            const double got = s == 0 ? g[j] : sum[j] / 30;
            num += (got - want) * (got - want);
            den += want * want;
          }
          (s == 0 ? first : mean) = std::sqrt(num / den);
        }
        require_same_bits(pg, g.data(), g.size() * 4, "the compressed matrix");
      });
      require(first > 0.05, "rank 1 loses information on a full-rank matrix: " + std::to_string(first));
      return mean / first;
    };
    const double with = mean_error(true), without = mean_error(false);
    require(with < 0.3, "with error feedback the mean approaches the average: " + std::to_string(with));
    require(without > 2 * with, "without it, it does not: " + std::to_string(without) + " against " + std::to_string(with));
  }));
}

TEST_CASE("powersgd: the wire carries the plain tensors and (rows + cols) x rank per compressed matrix") {
  const int n = 2;
  expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
    model m;
    for (std::size_t rank : {1u, 2u, 4u}) {
      // The default engine underneath (shared memory on one host); one bucket for the model.
      ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ddp::auto_reducer, ddp::powersgd>> dp{
          pg, m.views, ddp::bucket_policy{.cap_bytes = 1 << 20, .first_cap_bytes = 1 << 20}, ddp::dp_options{},
          ddp::powersgd{{.rank = rank, .start_iter = 1}}};
      require(dp.plan().buckets.size() == 1, "one bucket");
      train(dp, m, r, 3, false, [](int) {});
      const auto& h = dp.get_reducer().hook();
      const std::size_t plain = 48 + 9, per_step = plain + (48 + 40) * rank + (32 + 16) * rank;
      require(h.elements_in() == 2 * (1920 + 48 + 9 + 512), "two compressed steps in");
      require(h.elements_on_wire() == 2 * per_step,
              "rank " + std::to_string(rank) + ": " + std::to_string(h.elements_on_wire()) + " on the wire");
      require(h.state_bytes() == ((1920 + 512) + per_step) * 4, "state: errors, P with the plain tensors, Q");
      // A program's own allreduce through the same reducer passes through, exactly.
      std::vector<float> v(100, static_cast<float>(r + 1));
      dp.get_reducer().allreduce(std::span<float>{v}, ddp::op::avg);
      for (float x : v) require(x == 0.5f * static_cast<float>(n + 1), "a plain allreduce is exact");
    }
  }));
}

TEST_CASE("powersgd: ranks with different options get errc::mismatch naming them, not wrong numbers") {
  const int n = 2;
  auto outs = on_ranks(n, local_group{5s}, [&](int r, ddp::process_group& pg) {
    model m;
    psgd_dp<ring_tcp> dp{pg, m.views, ddp::bucket_policy{.cap_bytes = 1 << 20}, ddp::dp_options{},
                         ddp::powersgd{{.rank = r == 0 ? 1u : 2u, .start_iter = 0}}};
    train(dp, m, r, 2, false, [](int) {});
  }, 60s);
  for (auto& o : outs) {
    CAPTURE(o.rank);
    CAPTURE(o.message);
    CHECK(o.exit_code == 1);
    CHECK(o.message.find("powersgd: the ranks' options") != std::string::npos);
    CHECK(o.seconds < 4.5);  // at once, not the timeout
  }
}

TEST_CASE("powersgd: bad options are refused at construction") {
  CHECK_THROWS_WITH_AS(ddp::powersgd({.rank = 0}), doctest::Contains("rank must be at least 1"), ddp::error);
  CHECK_THROWS_WITH_AS(ddp::powersgd({.min_compression_rate = -1}), doctest::Contains("non-negative"), ddp::error);
}
