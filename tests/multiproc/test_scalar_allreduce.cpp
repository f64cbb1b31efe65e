// process_group::all_reduce: a few scalars reduced over real processes without a reducer.
#include <ddp/process_group.hpp>

#include <doctest/doctest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"

using namespace std::chrono_literals;
using ddp_test::free_port;
using ddp_test::group_options;
using ddp_test::run_ranks;
using ddp_test::expect_ok;
using ddp_test::local_group;
using ddp_test::on_ranks;

namespace {
using ddp_test::require;
using ddp_test::require_raises;

// Every rank's bytes of `v`, checked to be the same everywhere (the bits every rank got).
template <class T>
void require_same_bits(ddp::process_group& pg, const std::vector<T>& v, const std::string& what) {
  const std::string mine(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  const auto all = pg.all_gather(mine);
  for (std::size_t q = 0; q < all.size(); ++q)
    require(all[q] == mine, what + ": rank " + std::to_string(q) + " got other bits than rank " +
                                std::to_string(pg.rank()));
}

// Values with inexact sums, so that the order of addition shows in the bits.
double value(int rank, int i) { return 0.1 * (rank + 1) + 1e-3 * i + 1.0 / (3.0 + rank * 7 + i); }
}  // namespace

TEST_CASE("all_reduce of a few scalars: every op and type, rank-order results, the same bits on every rank") {
  for (int n : {1, 2, 3, 4}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
      constexpr int k = 5;
      // f64: sum, avg, min, max, prod against a left fold in rank order.
      for (ddp::op o : {ddp::op::sum, ddp::op::avg, ddp::op::min, ddp::op::max, ddp::op::prod}) {
        std::vector<double> v(k);
        for (int i = 0; i < k; ++i) v[static_cast<std::size_t>(i)] = value(r, i);
        pg.all_reduce(std::span<double>(v), o);
        for (int i = 0; i < k; ++i) {
          double want = value(0, i);
          for (int q = 1; q < n; ++q) {
            const double x = value(q, i);
            switch (o) {
              case ddp::op::sum: case ddp::op::avg: want = want + x; break;
              case ddp::op::min: want = x < want ? x : want; break;
              case ddp::op::max: want = x > want ? x : want; break;
              case ddp::op::prod: want = want * x; break;
            }
          }
          if (o == ddp::op::avg) want = want / n;
          require(std::bit_cast<std::uint64_t>(v[static_cast<std::size_t>(i)]) == std::bit_cast<std::uint64_t>(want),
                  std::string("f64 ") + ddp::op_name(o) + " element " + std::to_string(i));
        }
        require_same_bits(pg, v, std::string("f64 ") + ddp::op_name(o));
      }
      // f32 and integers; integer avg truncates toward zero.
      std::vector<float> f = {0.25f * static_cast<float>(r), 1.0f};
      pg.all_reduce(std::span<float>(f), ddp::op::sum);
      require(f[0] == 0.25f * static_cast<float>(n * (n - 1) / 2) && f[1] == static_cast<float>(n), "f32 sum");
      std::vector<std::int64_t> c = {r + 1, -(r + 1), (std::int64_t{1} << 40) * r};
      pg.all_reduce(std::span<std::int64_t>(c), ddp::op::avg);
      require(c[0] == (n + 1) / 2 && c[1] == -((n + 1) / 2), "i64 avg truncates: " + std::to_string(c[0]));
      require(c[2] == ((std::int64_t{1} << 40) * (n * (n - 1) / 2)) / n, "i64 avg of large values");
      std::int32_t count[2] = {r == 0 ? 7 : 1, r};
      pg.all_reduce(std::span{count}, ddp::op::max);  // a static extent
      require(count[0] == 7 && count[1] == n - 1, "i32 max");
      // The one-value forms.
      const double loss = pg.all_reduce(1.5 * (r + 1), ddp::op::avg);
      require(loss == 1.5 * (n + 1) / 2.0, "one double, avg: " + std::to_string(loss));
      require(pg.all_reduce(r, ddp::op::sum) == n * (n - 1) / 2, "one int, sum");
      require(pg.all_reduce(static_cast<float>(r), ddp::op::min) == 0.0f, "one float, min");
      // NaN anywhere: NaN everywhere, with the same bits.
      std::vector<double> nan = {r == n - 1 ? std::numeric_limits<double>::quiet_NaN() : 1.0};
      pg.all_reduce(std::span<double>(nan), ddp::op::max);
      require(std::isnan(nan[0]), "NaN propagates");
      require_same_bits(pg, nan, "NaN");
      // Nothing to reduce is allowed (and still collective).
      pg.all_reduce(std::span<double>(), ddp::op::sum);
    }));
  }
}

TEST_CASE("all_reduce: ranks that disagree on count, type or op get errc::mismatch naming them, on every rank") {
  struct variant {
    std::string name;
    std::function<void(ddp::process_group&, int)> call;
    std::string want;
    int bystander = -1;  // a rank that is not in all_reduce() and learns nothing
  };
  const std::vector<variant> cases = {
      {"count",
       [](ddp::process_group& pg, int r) {
         std::vector<double> v(r == 1 ? 2 : 1, 1.0);
         pg.all_reduce(std::span<double>(v), ddp::op::sum);
       },
       "all_reduce: ranks disagree: rank 0 reduces 1 f64 value with sum; rank 1 reduces 2 f64 values with sum"},
      {"type",
       [](ddp::process_group& pg, int r) {
         if (r == 2) pg.all_reduce(1.0f, ddp::op::sum);
         else pg.all_reduce(1.0, ddp::op::sum);
       },
       "all_reduce: ranks disagree: rank 0 reduces 1 f64 value with sum; rank 2 reduces 1 f32 value with sum"},
      {"op",
       [](ddp::process_group& pg, int r) { pg.all_reduce(1.0, r == 0 ? ddp::op::max : ddp::op::sum); },
       "all_reduce: ranks disagree: rank 0 reduces 1 f64 value with max; rank 1 reduces 1 f64 value with sum, "
       "rank 2 reduces 1 f64 value with sum"},
      {"another collective",
       [](ddp::process_group& pg, int r) {
         if (r == 1) {
           (void)pg.all_gather("not a reduction");
           return;
         }
         pg.all_reduce(1.0, ddp::op::sum);
       },
       "all_reduce: ranks disagree: rank 0 reduces 1 f64 value with sum; rank 1 is not in all_reduce() (another "
       "collective?)",
       1},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name);
    auto outs = on_ranks(3, local_group{20s}, [&](int r, ddp::process_group& pg) {
      c.call(pg, r);
    });
    INFO(ddp_test::summary(outs));
    for (const auto& o : outs) {
      if (o.rank == c.bystander) continue;
      CAPTURE(o.rank);
      CHECK(o.exit_code == 1);
      CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
      CHECK(o.message.find(c.want) != std::string::npos);
      CHECK(o.seconds < 15.0);
    }
  }
}

TEST_CASE("all_reduce: a peer that died or froze is an error within the group timeout, not a hang") {
  for (bool frozen : {false, true}) {
    CAPTURE(frozen);
    const int port = free_port();
    const auto timeout = 2s;
    auto outs = run_ranks(3, [&](int r) {
      auto pg = ddp::init_process_group(group_options(r, 3, port, timeout));
      if (r == 2) {
        if (frozen) std::this_thread::sleep_for(6s);
        ::_exit(frozen ? 0 : 9);  // dies without a word
      }
      pg.all_reduce(1.0, ddp::op::sum);
      throw std::runtime_error("all_reduce returned without rank 2");
    }, 30s);
    INFO(ddp_test::summary(outs));
    for (const auto& o : outs) {
      if (o.rank == 2) continue;
      CAPTURE(o.rank);
      CHECK_FALSE(o.timed_out);
      CHECK(o.exit_code == 1);
      if (frozen) {
        CHECK((o.errc == static_cast<int>(ddp::errc::timeout) || o.errc == static_cast<int>(ddp::errc::peer_lost)));
        CHECK(o.seconds < 2.0 + 4.0);  // about the timeout, never the frozen rank's 6 s
      } else {
        CHECK(o.errc == static_cast<int>(ddp::errc::peer_lost));
        CHECK(o.seconds < 2.0 + 2.0);
      }
      CHECK(o.message.find("all_reduce: ") != std::string::npos);
    }
  }
}

TEST_CASE("all_reduce: more than max_all_reduce_bytes, or an unknown op, is errc::invalid_argument") {
  expect_ok(on_ranks(2, local_group{20s}, [&](ddp::process_group& pg) {
    static_assert(ddp::process_group::max_all_reduce_bytes == 65536);
    std::vector<double> ok(ddp::process_group::max_all_reduce_bytes / sizeof(double), 1.0);
    pg.all_reduce(std::span<double>(ok), ddp::op::sum);
    require(ok.front() == 2.0 && ok.back() == 2.0, "the largest all_reduce");
    std::vector<double> big(ok.size() + 1);
    require_raises([&] { pg.all_reduce(std::span<double>(big), ddp::op::sum); }, ddp::errc::invalid_argument,
                   {"all_reduce of 8193 f64 values (8193 x 8 bytes); at most 65536 bytes"}, "too large an all_reduce");
    require_raises([&] { pg.all_reduce(1.0, static_cast<ddp::op>(9)); }, ddp::errc::invalid_argument, {},
                   "an unknown op");
    // The group still works: nothing was sent.
    require(pg.all_reduce(1, ddp::op::sum) == 2, "after refusals");
  }));
}

TEST_CASE("all_reduce on an empty handle is errc::usage") {
  expect_ok(on_ranks(1, local_group{20s}, [&](ddp::process_group& pg) {
    auto moved = std::move(pg);
    // NOLINTNEXTLINE(bugprone-use-after-move): the point
    require_raises([&] { (void)pg.all_reduce(1.0, ddp::op::sum); }, ddp::errc::usage, {}, "the moved-from handle");
    require(moved.all_reduce(3.0, ddp::op::avg) == 3.0, "world of one");
  }));
}
