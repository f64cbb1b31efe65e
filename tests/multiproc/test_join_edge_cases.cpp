#include <ddp/data_parallel.hpp>

#include <ddp/memory/host_allocator.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/transport/tcp.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"
#include "toy_model.hpp"

// Adversarial cases for uneven inputs (dp_options::uneven_inputs, join()): gradients with every
// mantissa bit in use and tiny f16 values when one rank of four contributes, integer averages of
// mixed signs, no_sync() windows on either side of join(), a rank that joins while the others
// are slower than the timeout.

using namespace std::chrono_literals;
using namespace ddp_test;

namespace {

// One parameter per dtype, each `n` elements, named "a", "b", ...
struct params : ddp_test::toy_model {
  std::vector<ddp::dtype> types;
  params(std::vector<ddp::dtype> t, std::size_t n) : types(std::move(t)) {
    for (std::size_t i = 0; i < types.size(); ++i) add(n, types[i], {}, std::string(1, static_cast<char>('a' + i)));
  }
  double get(std::size_t i, std::size_t j) const { return toy_model::get(grad(i), types[i], j); }
  // Stores v as the dtype holds it and returns the stored value.
  double set(std::size_t i, std::size_t j, double v) {
    toy_model::set(grad(i), types[i], j, v);
    return get(i, j);
  }
};

// One unit in the last place at |v| for dtype t (subnormal spacing below the normal range).
double ulp(ddp::dtype t, double v) {
  const double a = std::abs(v);
  int mant = 0, emin = 0;
  switch (t) {
    case ddp::dtype::f32: mant = 23; emin = -126; break;
    case ddp::dtype::f64: mant = 52; emin = -1022; break;
    case ddp::dtype::f16: mant = 10; emin = -14; break;
    case ddp::dtype::bf16: mant = 7; emin = -126; break;
    default: return 0;
  }
  const int e = a == 0 ? emin : std::max(emin, std::ilogb(a));
  return std::ldexp(1.0, e - mant);
}

// Rank 0 alone trains one step with the values `value(i, j)` (stored as each dtype holds them);
// ranks 1..n-1 join at once. Rank 0's gradients must be its own, within one ulp (the docs'
// bound: "within one unit in the last place of sum / c"), exact for integers.
template <class DP, class Value>
void lone_contributor(int n, const std::vector<ddp::dtype>& types, std::size_t numel, Value value) {
  expect_ok(on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
    params m(types, numel);
    DP dp{pg, m.views, {}, {.uneven_inputs = true, .divide_by = ddp::join_divisor::contributors}};
    if (r != 0) {
      dp.join();
      require(dp.joined_steps() == 1, "answered one step");
      return;
    }
    std::vector<std::vector<double>> want(types.size(), std::vector<double>(numel));
    for (std::size_t i = 0; i < types.size(); ++i)
      for (std::size_t j = 0; j < numel; ++j) want[i][j] = m.set(i, j, value(i, j));
    for (std::size_t i = types.size(); i-- > 0;) dp.grad_ready(i);
    dp.finish();
    require(dp.last_step_stats().contributors == 1, "one contributor");
    std::string bad;
    int shown = 0;
    for (std::size_t i = 0; i < types.size(); ++i)
      for (std::size_t j = 0; j < numel; ++j) {
        const double got = m.get(i, j), w = want[i][j];
        if (std::abs(got - w) > ulp(types[i], w) && shown++ < 4) {
          char line[160];
          std::snprintf(line, sizeof line, "%s[%zu]: %.9g instead of %.9g (%g ulp off); ", ddp::dtype_name(types[i]),
                        j, got, w, std::abs(got - w) / ulp(types[i], w));
          bad += line;
        }
      }
    dp.join();
    require(bad.empty(), "the lone contributor's average is not its gradient: " + bad);
  }, 60s));
}

using ring_tcp = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, ddp::host_allocator>;

}  // namespace

// Every mantissa bit in use, a world of 3 (n / c = 3 is not a power of two): the rescale of
// sum / 3 by 3 stays within an ulp. Holds.
TEST_CASE("join: one contributor of 3, random normal values of every float type: within one ulp") {
  const std::vector<ddp::dtype> types{ddp::dtype::f32, ddp::dtype::f64, ddp::dtype::f16, ddp::dtype::bf16};
  auto value = [](std::size_t i, std::size_t j) {
    std::mt19937_64 g(1000 * i + j);
    const double mag = std::ldexp(1.0, static_cast<int>(g() % 20) - 10);  // 2^-10 .. 2^9: normal in every type
    return (g() % 2 ? -1 : 1) * mag * (1.0 + static_cast<double>(g() % (1u << 30)) / (1u << 30));
  };
  lone_contributor<ddp::data_parallel>(3, types, 257, value);
  lone_contributor<ring_tcp>(3, types, 257, value);
}

// f16 gradients below 2^-11 (about 4.9e-4; loss-scaled f16 gradients are often this small) from
// the one rank of four that still trains. op::avg scales each contribution by 2^-3 before it is
// rounded to f16 between ranks, so x / 8 falls into f16's subnormal range and loses up to 8 of
// its 11 bits; uneven_finish then multiplies sum / 4 by 4, which cannot bring them back: the
// result is several ulps off, and values under 2^-25 * 8 come back as 0. The docs promise one
// ulp of sum / c. Not fixed here: the loss happens inside the reducer's scaled accumulation (a
// fix would reduce f16/bf16 buckets of uneven steps with op::sum in f32, or pre-scale by
// 2^-(k+1) only where no overflow can happen); left as may_fail.
TEST_CASE("join: one contributor of 4, tiny f16 gradients: within one ulp" * doctest::may_fail()) {
  auto value = [](std::size_t, std::size_t j) {
    return std::ldexp(1.0 + static_cast<double>(j % 7) / 8.0, -24 + static_cast<int>(j % 14));  // 6e-8 .. 1.7e-4
  };
  lone_contributor<ring_tcp>(4, {ddp::dtype::f16}, 64, value);
}

// Integer averages over the contributors truncate toward zero, with sums of mixed sign; holds.
TEST_CASE("join: integer averages over 3 contributors of 4, mixed signs, truncated toward zero") {
  const int n = 4;
  expect_ok(on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
    params m({ddp::dtype::i32, ddp::dtype::i64}, 5);
    ring_tcp dp{pg, m.views, {}, {.uneven_inputs = true, .divide_by = ddp::join_divisor::contributors}};
    if (r == 3) {
      dp.join();
      return;
    }
    // Element j of rank r: sums -7, -2, 0, 2, 7 (over ranks 0..2), and i64 values past 2^32.
    const long vals[3][5] = {{-5, -1, 4, 0, 3}, {-1, -2, -9, 1, 2}, {-1, 1, 5, 1, 2}};
    for (std::size_t j = 0; j < 5; ++j) {
      m.set(0, j, static_cast<double>(vals[r][j]));
      m.grad<std::int64_t>(1)[j] = vals[r][j] * (std::int64_t{1} << 40);
    }
    dp.grad_ready(1);
    dp.grad_ready(0);
    dp.finish();
    const long want[5] = {-2, 0, 0, 0, 2};  // -7/3, -2/3, 0/3, 2/3, 7/3 truncated
    for (std::size_t j = 0; j < 5; ++j) {
      require(m.get(0, j) == static_cast<double>(want[j]), "i32[" + std::to_string(j) + "] " + std::to_string(m.get(0, j)));
      const std::int64_t sum = (vals[0][j] + vals[1][j] + vals[2][j]) * (std::int64_t{1} << 40);
      require(m.grad<std::int64_t>(1)[j] == sum / 3,
              "i64[" + std::to_string(j) + "]");
    }
    dp.join();
  }, 60s));
}

// no_sync() on both sides: rank 0 accumulates a micro-step, then synchronizes while rank 1 has
// joined (from inside a no_sync() scope of its own, with a micro-step it accumulated and never
// averaged: dropped). Rank 0's result is its own accumulated sum (one contributor); then a
// second epoch where both train averages over both. Holds.
TEST_CASE("join: no_sync() windows on the active and on the joining rank") {
  for (const bool view : {false, true}) {
    CAPTURE(view);
    const int n = 2;
    expect_ok(on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
      params m({ddp::dtype::f32}, 8);
      ring_tcp dp{pg, m.views, {}, {.gradient_as_bucket_view = view, .uneven_inputs = true, .divide_by = ddp::join_divisor::contributors}};
      float* g = view ? static_cast<float*>(dp.bucket_grad(0)) : m.grad<float>(0).data();
      const auto put = [&](float base, bool add) {
        for (int j = 0; j < 8; ++j) g[j] = (add ? g[j] : 0.0f) + base + static_cast<float>(j);
      };
      if (r == 0) {
        {
          auto acc = dp.no_sync();
          put(1, false);
          dp.grad_ready(0);
          dp.finish();
        }
        put(10, true);  // accumulates: 11 + 2j
        dp.grad_ready(0);
        dp.finish();
        for (int j = 0; j < 8; ++j) require(g[j] == 11.0f + 2.0f * static_cast<float>(j), "rank 0 accumulated sum");
        require(dp.last_step_stats().contributors == 1, "one contributor");
        dp.join();
      } else {
        auto acc = dp.no_sync();
        put(100, false);
        dp.grad_ready(0);
        dp.finish();
        dp.join();
        require(dp.joined_steps() == 1, "answered rank 0's step");
      }
      // Epoch 2: both train; rank r's gradient r + j: the average 0.5 + j.
      put(static_cast<float>(r), false);
      dp.grad_ready(0);
      dp.finish();
      for (int j = 0; j < 8; ++j) require(g[j] == 0.5f + static_cast<float>(j), "epoch 2 average");
      dp.join();
    }, 60s));
  }
}

// A joined rank whose peer is slower than the timeout (alive, not dead): join() raises
// errc::timeout on the joined rank within about the timeout, and the slow rank's next step
// fails too (the joined rank's process ends), neither hangs.
TEST_CASE("join: a joined rank whose peer is slower than the timeout fails at the deadline, no hang") {
  const int n = 2;
  auto outs = on_ranks(n, local_group{1500ms}, [&](int r, ddp::process_group& pg) {
    params m({ddp::dtype::f32}, 4);
    ring_tcp dp{pg, m.views, {}, {.uneven_inputs = true, .divide_by = ddp::join_divisor::contributors}};
    if (r == 1) {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        dp.join();
      } catch (const ddp::error& e) {
        const auto waited = std::chrono::steady_clock::now() - t0;
        require(waited < 5s, "join() waited far past the timeout");
        throw;
      }
      throw std::runtime_error("join() returned although rank 0 never stepped");
    }
    std::this_thread::sleep_for(3s);
    dp.grad_ready(0);
    dp.finish();
  }, 30s);
  INFO(summary(outs));
  REQUIRE(outs.size() == 2);
  CHECK(outs[1].exit_code == 1);
  CHECK(outs[1].errc == static_cast<int>(ddp::errc::timeout));
  CHECK(outs[1].message.find("rank 1") != std::string::npos);
  CHECK(outs[0].exit_code == 1);  // a ddp::error, not a hang or a crash
  CHECK(!outs[0].timed_out);
  CHECK(!outs[1].timed_out);
}
