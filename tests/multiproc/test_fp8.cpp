// ddp::fp8_compress over real processes: averages and sums within the stated bound for e4m3 and
// e5m2 and odd block sizes over ring (tcp, shm) and the default reducer, the same bits on every
// rank, NaN and infinities that make their block non-finite everywhere, all-zero blocks exact,
// error feedback that keeps the mean of many steps on the exact value, ranks with other options
// an error on every rank, and the data-parallel wrapper's buckets through it.
#include <ddp/data_parallel.hpp>
#include <ddp/reducer/auto.hpp>
#include <ddp/reducer/fp8_compress.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/transport/tcp.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "harness.hpp"

using namespace std::chrono_literals;
using ddp_test::expect_ok;
using ddp_test::local_group;
using ddp_test::on_ranks;
using ddp_test::require;

namespace {

template <class Body>
void with_reducer(const std::string& kind, ddp::process_group& pg, ddp::fp8_options o, Body&& body) {
  if (kind == "ring_tcp") {
    ddp::hooked<ddp::ring<ddp::tcp>, ddp::fp8_compress> red{pg, ddp::fp8_compress{o}};
    body(red);
  } else if (kind == "ring_shm") {
    ddp::hooked<ddp::ring<ddp::shm>, ddp::fp8_compress> red{
        pg, ddp::fp8_compress{o}, ddp::shm_options{.segment_bytes = 32 << 20}, ddp::reducer_options{}};
    body(red);
  } else {
    ddp::hooked<ddp::auto_reducer, ddp::fp8_compress> red{pg, ddp::fp8_compress{o}};
    body(red);
  }
}

const char* kinds[] = {"ring_tcp", "ring_shm", "auto"};

// Rank r's value of element j: mixed signs and magnitudes (10^-5 .. 10^2), some exact zeros.
float value(int r, std::size_t j) {
  if (j % 97 == 5) return 0.0f;
  const float mag = std::pow(10.0f, static_cast<float>((j * 7 + static_cast<std::size_t>(r) * 3) % 8) - 5.0f);
  return std::sin(0.7f * static_cast<float>(j) + 1.3f * static_cast<float>(r)) * mag;
}

void require_same_bits(ddp::process_group& pg, const std::vector<float>& v, const std::string& what) {
  const auto all = pg.all_gather(std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float)));
  for (std::size_t r = 1; r < all.size(); ++r)
    require(all[r] == all[0], what + ": rank " + std::to_string(r) + " differs from rank 0");
}

/// The stated bound of one element (reducer/fp8_compress.hpp), for avg.
float bound(const std::vector<std::vector<float>>& inputs, std::size_t j, std::size_t block, ddp::fp8_format f) {
  const float u = f == ddp::fp8_format::e4m3 ? 1.0f / 16 : 1.0f / 8;
  const float sub = f == ddp::fp8_format::e4m3 ? std::ldexp(1.0f, -9) : std::ldexp(1.0f, -16);
  const float largest = f == ddp::fp8_format::e4m3 ? 448.0f : 57344.0f;
  float b = 0.0f, mags = 0.0f;
  for (const auto& x : inputs) {
    float amax = 0.0f;
    for (std::size_t i = j / block * block; i < std::min(x.size(), (j / block + 1) * block); ++i)
      amax = std::max(amax, std::fabs(x[i]));
    b += u * std::fabs(x[j]) + sub * amax / largest;
    mags += std::fabs(x[j]);
  }
  const float n = static_cast<float>(inputs.size());
  return (b + (n - 1) * std::ldexp(1.0f, -24) * mags) / n * 1.0001f;
}

}  // namespace

TEST_CASE("fp8 averages: within the stated bound, the same bits on every rank, e4m3 and e5m2, odd blocks") {
  for (const char* kind : kinds)
    for (int n : {2, 3}) {
      CAPTURE(kind);
      CAPTURE(n);
      expect_ok(on_ranks(n, local_group{30s}, [&](int r, ddp::process_group& pg) {
        for (const auto f : {ddp::fp8_format::e4m3, ddp::fp8_format::e5m2})
          for (const std::size_t block : {std::size_t{256}, std::size_t{37}}) {
            // No error feedback here: one step's rounding is what the bound states.
            with_reducer(kind, pg, {.format = f, .block = block, .error_feedback = false}, [&](auto& red) {
              const std::size_t count = 5000;
              std::vector<std::vector<float>> in(static_cast<std::size_t>(n), std::vector<float>(count));
              for (int q = 0; q < n; ++q)
                for (std::size_t j = 0; j < count; ++j) in[static_cast<std::size_t>(q)][j] = value(q, j);
              auto v = in[static_cast<std::size_t>(r)];
              red.allreduce(v.data(), v.size(), ddp::dtype::f32, ddp::op::avg);
              for (std::size_t j = 0; j < count; ++j) {
                double exact = 0;
                for (const auto& x : in) exact += x[j];
                exact /= n;
                const float b = bound(in, j, block, f);
                if (std::fabs(v[j] - exact) > b)
                  require(false, "element " + std::to_string(j) + ": " + std::to_string(v[j]) + " against " +
                                     std::to_string(exact) + ", bound " + std::to_string(b));
                if (j % 97 == 5 && n == 2) require(v[j] == 0.0f, "a zero of every rank is not exactly 0");
              }
              require_same_bits(pg, v, "fp8 avg");
              // A sum: the same, times n (other dtypes and ops pass through exactly).
              std::vector<double> d(10, 1.5 * (r + 1));
              red.allreduce(d.data(), d.size(), ddp::dtype::f64, ddp::op::sum);
              require(d[0] == 1.5 * n * (n + 1) / 2, "an f64 sum went through the compression");
            });
          }
      }));
    }
}

TEST_CASE("fp8: NaN and infinities make their block non-finite on every rank; all-zero blocks are exact") {
  expect_ok(on_ranks(2, local_group{30s}, [&](int r, ddp::process_group& pg) {
    with_reducer("auto", pg, {.block = 64}, [&](auto& red) {
      const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
      std::vector<float> v(64 * 5, 1.0f);
      for (std::size_t j = 64; j < 128; ++j) v[j] = 0.0f;  // block 1: zeros on both ranks
      if (r == 1) v[130] = inf;                            // block 2: +inf on rank 1
      if (r == 0) v[200] = nan;                            // block 3: NaN on rank 0
      if (r == 0) v[260] = inf;                            // block 4: +inf and -inf
      if (r == 1) v[270] = -inf;
      red.allreduce(v.data(), v.size(), ddp::dtype::f32, ddp::op::avg);
      for (std::size_t j = 0; j < 64; ++j) require(v[j] == 1.0f, "block 0 is not exactly 1");
      for (std::size_t j = 64; j < 128; ++j) require(v[j] == 0.0f, "an all-zero block is not 0");
      for (std::size_t j = 128; j < 192; ++j) require(v[j] == inf, "block 2 is not +inf throughout");
      for (std::size_t j = 192; j < 320; ++j) require(std::isnan(v[j]), "blocks 3 and 4 are not NaN throughout");
      // The next step is finite again: a non-finite block leaves no residual behind.
      std::vector<float> w(64 * 5, 2.0f);
      red.allreduce(w.data(), w.size(), ddp::dtype::f32, ddp::op::avg);
      for (float x : w) require(x == 2.0f, "a step after a non-finite one is not exact");
      require_same_bits(pg, w, "after non-finite");
    });
  }));
}

TEST_CASE("fp8 error feedback: what one step loses the next carries; the mean of many steps is the exact value") {
  expect_ok(on_ranks(2, local_group{30s}, [&](int r, ddp::process_group& pg) {
    for (const bool ef : {true, false}) {
      // The wrapper is what gives buckets an identity; drive the hook as it does, bucket 0 each time.
      ddp::fp8_compress hook{{.error_feedback = ef}};
      ddp::ring<ddp::tcp> inner{pg};
      const std::size_t count = 1024, steps = 64;
      std::vector<float> g(count), mean(count, 0.0f);
      for (std::size_t j = 0; j < count; ++j) g[j] = value(r, j);
      for (std::size_t s = 0; s < steps; ++s) {
        auto v = g;
        ddp::comm_bucket b;
        b.data = v.data();
        b.count = count;
        b.oper = ddp::op::avg;
        b.seq = s;
        b.rank = r;
        b.size = 2;
        b.deadline = ddp::steady_clock::now() + 30s;
        b.bucket = 0;
        b.step = static_cast<std::int64_t>(s);
        hook(b, inner);
        for (std::size_t j = 0; j < count; ++j) mean[j] += v[j] / steps;
      }
      std::vector<float> exact(count);
      for (std::size_t j = 0; j < count; ++j) exact[j] = (value(0, j) + value(1, j)) / 2;
      double err = 0, one = 0;
      for (std::size_t j = 0; j < count; ++j) err += std::fabs(mean[j] - exact[j]), one += std::fabs(exact[j]);
      // With error feedback the mean error falls as 1/steps; without, it stays one step's rounding.
      if (ef)
        require(err / one < 2e-3, "error feedback: relative error of the mean " + std::to_string(err / one));
      else
        require(err / one > 4e-3, "no error feedback, yet the mean is as good: " + std::to_string(err / one));
    }
  }));
}

TEST_CASE("fp8: ranks with other options are an error on every rank naming the rank, not wrong numbers") {
  auto outs = on_ranks(2, local_group{10s}, [&](int r, ddp::process_group& pg) {
    with_reducer("ring_tcp", pg, {.format = r == 0 ? ddp::fp8_format::e4m3 : ddp::fp8_format::e5m2}, [&](auto& red) {
      std::vector<float> v(1000, 1.0f);
      red.allreduce(v.data(), v.size(), ddp::dtype::f32, ddp::op::avg);
    });
  });
  for (const auto& o : outs) {
    CAPTURE(o.message);
    CHECK(o.exit_code == 1);
    CHECK(o.message.find("fp8_compress: rank " + std::to_string(1 - o.rank) + " sent " +
                         (o.rank == 0 ? "e5m2" : "e4m3")) != std::string::npos);
  }
  CHECK_THROWS_AS(ddp::fp8_compress(ddp::fp8_options{.block = 0}), ddp::error);
}

TEST_CASE(
    "fp8 through the data_parallel wrapper: buckets averaged within the bound, the same bits, residuals per bucket") {
  expect_ok(on_ranks(3, local_group{30s}, [&](int r, ddp::process_group& pg) {
    std::vector<std::vector<float>> data(4), grad(4);
    std::vector<ddp::tensor_view> views;
    for (std::size_t i = 0; i < 4; ++i) {
      data[i].assign(3000 + 1000 * i, 0.5f);
      grad[i].assign(data[i].size(), 0.0f);
      views.push_back(ddp::make_tensor_view(std::span{data[i]}, std::span{grad[i]}, "p" + std::to_string(i)));
    }
    ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ddp::auto_reducer, ddp::fp8_compress>> dp{
        pg, views, ddp::bucket_policy{.cap_bytes = 16 << 10}};
    for (int s = 0; s < 3; ++s) {
      for (std::size_t i = 0; i < 4; ++i)
        for (std::size_t j = 0; j < grad[i].size(); ++j) grad[i][j] = value(r, j + 10000 * i);
      for (std::size_t i = 4; i-- > 0;) dp.grad_ready(i);
      dp.finish();
      for (std::size_t i = 0; i < 4; ++i) {
        for (std::size_t j = 0; j < grad[i].size(); ++j) {
          const float exact = (value(0, j + 10000 * i) + value(1, j + 10000 * i) + value(2, j + 10000 * i)) / 3;
          float mags = 0;
          for (int q = 0; q < 3; ++q) mags += std::fabs(value(q, j + 10000 * i));
          // One step's rounding (1/16 of each value) plus what the previous step carried (as much).
          require(std::fabs(grad[i][j] - exact) <= 2.0f * mags / 16 / 3 + 1e-3f,
                  "bucket element off: " + std::to_string(grad[i][j]) + " against " + std::to_string(exact));
        }
        require_same_bits(pg, grad[i], "wrapper bucket");
      }
    }
    require(dp.get_reducer().hook().residual_bytes() > 0, "no residual kept for the wrapper's buckets");
  }));
}
