#include <ddp/data_parallel.hpp>

#include <ddp/concepts.hpp>
#include <ddp/memory/host_allocator.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/tree.hpp>
#include <ddp/transport/tcp.hpp>
#if __has_include(<ddp/reducer/shm.hpp>)
#include <ddp/memory/shm_allocator.hpp>
#include <ddp/reducer/shm.hpp>
#define DDP_TEST_HAS_SHM 1
#endif

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include "harness.hpp"
#include "toy_model.hpp"

using namespace std::chrono_literals;
using namespace ddp_test;
using namespace ddp::literals;

static_assert(ddp::reducer<ddp::ring<ddp::tcp>>);
static_assert(ddp::reducer<ddp::tree<ddp::tcp>>);
static_assert(!ddp::reducer<ddp::host_allocator>);
static_assert(!ddp::reducer<int>);

namespace {

constexpr ddp_test::local_group opts{30s};

// The gradient rank r produces for element j of parameter i in micro-step s: small multiples of
// 1/8, exact in f32 and f64, so sums are exact and only the final division can round.
double grad_value(int r, std::size_t i, std::size_t j, int s) {
  return static_cast<double>(static_cast<long>(((static_cast<std::size_t>(r) + 1) * 31 + i * 17 + j * 7 +
                                                static_cast<std::size_t>(s) * 13) % 97) - 48) / 8.0;
}

double data_value(int r, std::size_t i, std::size_t j) { return static_cast<double>(r * 1000 + static_cast<int>((i + j) % 500)); }

// Random shapes shared by every rank (same seed): mostly small, log-uniform, a few f64.
toy_model random_model(std::uint64_t seed, std::size_t count, std::size_t max_numel) {
  std::mt19937_64 g(seed);
  toy_model m;
  std::uniform_real_distribution<double> u(0.0, std::log(static_cast<double>(max_numel)));
  for (std::size_t i = 0; i < count; ++i) {
    const auto n = static_cast<std::size_t>(std::exp(u(g)));
    m.add(std::max<std::size_t>(1, n), (g() % 8 == 0) ? ddp::dtype::f64 : ddp::dtype::f32);
  }
  return m;
}

// The engine's backward: writes each gradient (into its own buffer, or into bucket memory in
// view mode), accumulating when asked, and calls the hook in a per-rank random order.
template <class DP>
void backward(DP& dp, toy_model& m, int r, int s, bool view, bool accumulate, std::uint64_t order_seed,
              const std::vector<std::size_t>& skip = {}) {
  std::vector<std::size_t> order(m.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::reverse(order.begin(), order.end());
  std::mt19937_64 g(order_seed);
  std::shuffle(order.begin(), order.end(), g);
  for (std::size_t i : order) {
    if (std::find(skip.begin(), skip.end(), i) != skip.end()) continue;
    void* gp = view ? dp.bucket_grad(i) : m.grad(i);
    for (std::size_t j = 0; j < m.numel(i); ++j) {
      const double v = grad_value(r, i, j, s);
      toy_model::set(gp, m.type(i), j, accumulate ? toy_model::get(gp, m.type(i), j) + v : v);
    }
    dp.grad_ready(i);
  }
}

// Checks that gradient i now holds avg over ranks of sum over `steps` of grad_value, with the
// ranks in `zero_for(i)` contributing nothing.
template <class DP, class ZeroFor>
void check_average(DP& dp, toy_model& m, int n, const std::vector<int>& steps, bool view, ZeroFor zero_for,
                   const std::string& what) {
  for (std::size_t i = 0; i < m.size(); ++i) {
    const void* gp = view ? dp.bucket_grad(i) : m.grad(i);
    for (std::size_t j = 0; j < m.numel(i); ++j) {
      double expect = 0;
      for (int q = 0; q < n; ++q)
        if (!zero_for(i, q))
          for (int s : steps) expect += grad_value(q, i, j, s);
      expect /= n;
      const double got = toy_model::get(gp, m.type(i), j);
      if (std::abs(got - expect) > 1e-5 * (1 + std::abs(expect)))
        throw std::runtime_error(what + ": parameter " + std::to_string(i) + " element " + std::to_string(j) +
                                 " is " + std::to_string(got) + ", expected " + std::to_string(expect));
    }
  }
}

const auto none = [](std::size_t, int) { return false; };

template <class Reducer, class Allocator = ddp::host_allocator>
void random_run(int n, std::uint64_t seed, std::size_t count, std::size_t max_numel, ddp::bucket_policy policy,
                bool view, int steps = 3) {
  expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
    toy_model m = random_model(seed, count, max_numel);
    m.fill_data([&](std::size_t i, std::size_t j) { return data_value(r, i, j); });
    ddp::basic_data_parallel<ddp::size_planner, Reducer, Allocator> dp{pg, m.views, policy,
                                                            {.gradient_as_bucket_view = view}};
    for (std::size_t i = 0; i < m.size(); ++i)
      for (std::size_t j = 0; j < m.numel(i); ++j)
        require(toy_model::get(m.data(i), m.type(i), j) == data_value(0, i, j), "rank 0's parameters broadcast");
    // Copy mode on the ring over tcp reads the gradients where they are (no copy in).
    require(dp.gradients_read_in_place() == (!view && std::is_same_v<Reducer, ddp::ring<ddp::tcp>>),
            "gradients read in place exactly on ring<tcp> in copy mode");
    for (int s = 0; s < steps; ++s) {
      backward(dp, m, r, s, view, false, seed * 1000 + static_cast<std::uint64_t>(r * 10 + s));
      const std::size_t buckets = dp.plan().buckets.size();  // the rebuild may change it in finish()
      dp.finish();
      check_average(dp, m, n, {s}, view, none, "step " + std::to_string(s));
      const auto& st = dp.last_step_stats();
      require(st.synchronized, "stats: synchronized");
      require(st.bytes_reduced == m.bytes(), "stats: bytes reduced " + std::to_string(st.bytes_reduced) +
                                                 " != model bytes " + std::to_string(m.bytes()));
      require(st.buckets.size() == buckets, "stats: one timing per bucket");
      require(st.exposed_ms >= 0 && st.finish_ms >= 0 && st.backward_ms >= 0, "stats: times");
      for (auto& b : st.buckets) require(b.reduced_ms >= b.launch_ms && b.launch_ms >= b.ready_ms, "stats: bucket order of events");
    }
    // Every rank ended on the same plan (rank 0's ready order).
    std::string fp = std::to_string(dp.plan().fingerprint());
    auto all = pg.all_gather(fp);
    for (auto& f : all) require(f == fp, "plans agree after the rebuild");
  }, 60s));
}

}  // namespace

TEST_CASE("random shapes and per-rank ready orders: averages exact, on 1-4 ranks, ring and tree") {
  // 150 + 100 + 100 + 60 parameters of 1 element to 64 Ki elements, a few f64.
  random_run<ddp::ring<ddp::tcp>>(1, 1, 60, 1 << 12, {}, false);
  random_run<ddp::ring<ddp::tcp>>(2, 2, 150, 1 << 16, {.cap_bytes = 64_KiB, .first_cap_bytes = 4_KiB}, false);
  random_run<ddp::tree<ddp::tcp>>(3, 3, 100, 1 << 16, {.cap_bytes = 16_KiB, .first_cap_bytes = 1_KiB}, false);
  random_run<ddp::ring<ddp::tcp>>(4, 4, 100, 1 << 16, {.cap_bytes = 128_KiB, .first_cap_bytes = 8_KiB}, false);
  random_run<ddp::tree<ddp::tcp>>(4, 5, 100, 1 << 14, {}, false);
}

TEST_CASE("bucket caps from 1 byte (one parameter per bucket) to larger than the model") {
  for (std::size_t cap : {std::size_t{1}, std::size_t{4}, std::size_t{4_KiB}, std::size_t{1} << 30}) {
    CAPTURE(cap);
    random_run<ddp::ring<ddp::tcp>>(3, 10 + cap % 7, 80, 1 << 13, {.cap_bytes = cap, .first_cap_bytes = cap}, false, 2);
  }
  // Per-bucket caps list and no rebuild.
  random_run<ddp::ring<ddp::tcp>>(2, 17, 80, 1 << 13,
                                  {.caps = {512, 4_KiB, 32_KiB}, .rebuild_from_ready_order = false}, false, 2);
}

TEST_CASE("random shapes up to 4 M elements, 300 small shapes on 4 ranks") {
  random_run<ddp::ring<ddp::tcp>>(2, 7, 12, 4 << 20, {.cap_bytes = 4_MiB, .first_cap_bytes = 256_KiB}, false, 2);
  random_run<ddp::tree<ddp::tcp>>(2, 8, 12, 4 << 20, {}, true, 2);
  random_run<ddp::ring<ddp::tcp>>(4, 9, 300, 1 << 10, {.cap_bytes = 2_KiB, .first_cap_bytes = 256}, false, 2);
}

TEST_CASE("copy_gradients_at_ready: copy mode on ring<tcp> copies each gradient in at grad_ready") {
  // The engine reuses a gradient's memory after grad_ready: with the option, what it wrote
  // after grad_ready never reaches the average.
  const int n = 2;
  expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
    toy_model m = random_model(31, 40, 1 << 10);
    ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, ddp::host_allocator> dp{
        pg, m.views, {.cap_bytes = 1_MiB}, {.copy_gradients_at_ready = true}};
    require(!dp.gradients_read_in_place(), "copy_gradients_at_ready: not read in place");
    for (int s = 0; s < 2; ++s) {
      backward(dp, m, r, s, false, false, static_cast<std::uint64_t>(r + 3 * s));
      m.fill_grad([&](std::size_t, std::size_t) { return 1e9; });  // reused before finish()
      dp.finish();
      check_average(dp, m, n, {s}, false, none, "copied step " + std::to_string(s));
    }
  }, 60s));
}

TEST_CASE("copy mode read in place: an engine that reuses one buffer for two gradients is errc::usage naming both") {
  // The engine computes each gradient in one scratch buffer and hands it over from there: with
  // the copy at grad_ready that was fine; read in place it would average overwritten memory.
  const int n = 2;
  auto outs = on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
    toy_model m;
    for (int k = 0; k < 4; ++k) m.add(256, ddp::dtype::f32);
    std::vector<float> scratch(256);
    auto views = m.views;
    for (auto& v : views) v.grad = scratch.data();
    ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, ddp::host_allocator> dp{pg, views, {}};
    require(dp.gradients_read_in_place(), "read in place");
    for (std::size_t i = 4; i-- > 0;) {
      std::fill(scratch.begin(), scratch.end(), static_cast<float>(r + i));
      dp.grad_ready(i);
    }
    dp.finish();
  }, 60s);
  INFO(summary(outs));
  // Rank r fails at its second grad_ready naming gradients 2 and 3; or, when its peer failed
  // first, it fails naming that rank.
  for (auto& o : outs) {
    CHECK(o.exit_code == 1);
    const bool own = o.message.find("grad_ready(2): gradient 2 lies in the memory of gradient 3") != std::string::npos;
    CHECK((own || o.message.find("rank ") != std::string::npos));
  }
  CHECK(std::any_of(outs.begin(), outs.end(), [](const outcome& o) {
    return o.errc == static_cast<int>(ddp::errc::usage) &&
           o.message.find("copy_gradients_at_ready") != std::string::npos;
  }));
}

TEST_CASE("grad_ready from several threads at once") {
  const int n = 2;
  expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
    toy_model m = random_model(71, 200, 1 << 10);
    ddp::data_parallel dp{pg, m.views, {.cap_bytes = 2_KiB, .first_cap_bytes = 512}};
    for (int s = 0; s < 3; ++s) {
      m.fill_grad([&](std::size_t i, std::size_t j) { return grad_value(r, i, j, s); });
      std::vector<std::thread> threads;
      for (std::size_t t = 0; t < 4; ++t)
        threads.emplace_back([&, t] {
          for (std::size_t i = m.size() - 1 - t; i < m.size(); i -= 4) dp.grad_ready(i);
        });
      for (auto& t : threads) t.join();
      dp.finish();
      check_average(dp, m, n, {s}, false, none, "threaded step " + std::to_string(s));
    }
  }, 60s));
}

TEST_CASE("large parameters: 4 M elements next to single elements") {
  const int n = 2;
  expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
    toy_model m;
    for (std::size_t k : {std::size_t{1}, std::size_t{4} << 20, std::size_t{3}, std::size_t{1} << 20, std::size_t{1}})
      m.add(k, ddp::dtype::f32);
    ddp::data_parallel dp{pg, m.views, {.cap_bytes = 2_MiB, .first_cap_bytes = 64_KiB}};
    for (int s = 0; s < 2; ++s) {
      backward(dp, m, r, s, false, false, static_cast<std::uint64_t>(r + 7 * s));
      dp.finish();
      check_average(dp, m, n, {s}, false, none, "large step " + std::to_string(s));
    }
  }, 60s));
}

TEST_CASE("gradient as bucket view: the engine writes into bucket memory, nothing is copied") {
  random_run<ddp::ring<ddp::tcp>>(2, 21, 120, 1 << 14, {.cap_bytes = 32_KiB, .first_cap_bytes = 2_KiB}, true);
  random_run<ddp::tree<ddp::tcp>>(4, 22, 60, 1 << 12, {.cap_bytes = 1, .first_cap_bytes = 1}, true);
  // The views hand out bucket memory as the gradient.
  expect_ok(on_ranks(2, opts, [&](ddp::process_group& pg) {
    toy_model m = random_model(5, 10, 100);
    ddp::data_parallel dp{pg, m.views, {}, {.gradient_as_bucket_view = true}};
    auto vs = dp.views();
    for (std::size_t i = 0; i < m.size(); ++i) require(vs[i].grad == dp.bucket_grad(i), "views point into buckets");
  }, 30s));
}

TEST_CASE("no_sync: micro-steps accumulate locally, the next synchronized step averages the sum") {
  for (bool view : {false, true}) {
    CAPTURE(view);
    const int n = 3;
    expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
      toy_model m = random_model(31, 40, 1 << 12);
      ddp::data_parallel dp{pg, m.views, {.cap_bytes = 8_KiB, .first_cap_bytes = 1_KiB},
                            {.gradient_as_bucket_view = view}};
      for (int round = 0; round < 2; ++round) {
        const int s0 = round * 10;
        {
          auto guard = dp.no_sync();
          backward(dp, m, r, s0, view, false, static_cast<std::uint64_t>(r + round));
          dp.finish();
          require(!dp.last_step_stats().synchronized && dp.last_step_stats().bytes_reduced == 0, "no_sync step");
          backward(dp, m, r, s0 + 1, view, true, static_cast<std::uint64_t>(r + 5 + round));
          dp.finish();
        }
        backward(dp, m, r, s0 + 2, view, true, static_cast<std::uint64_t>(r + 9 + round));
        dp.finish();
        require(dp.last_step_stats().synchronized, "synchronized after the guard");
        check_average(dp, m, n, {s0, s0 + 1, s0 + 2}, view, none, "accumulated round " + std::to_string(round));
      }
      // no_sync in the middle of a step is refused.
      dp.grad_ready(0);
      require_raises([&] { auto g = dp.no_sync(); }, ddp::errc::usage, {}, "no_sync mid-step");
      for (std::size_t i = 1; i < m.size(); ++i) dp.grad_ready(i);
      dp.finish();
    }, 60s));
  }
}

TEST_CASE("unused parameters: mark_unused per rank, and find_unused_parameters") {
  for (bool option : {false, true}) {
    CAPTURE(option);
    const int n = 4;
    expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
      toy_model m = random_model(41, 50, 1 << 12);
      ddp::data_parallel dp{pg, m.views, {.cap_bytes = 4_KiB, .first_cap_bytes = 1_KiB},
                            {.find_unused_parameters = option}};
      // Rank q leaves out parameters q, q+4, q+8 (and every rank leaves out parameter 49).
      const auto unused = [](std::size_t i, int q) { return i == 49 || (i < 12 && i % 4 == static_cast<std::size_t>(q)); };
      std::vector<std::size_t> skip;
      for (std::size_t i = 0; i < m.size(); ++i)
        if (unused(i, r)) skip.push_back(i);
      for (int s = 0; s < 3; ++s) {
        if (!option)
          for (std::size_t i : skip) dp.mark_unused(i);
        backward(dp, m, r, s, false, false, static_cast<std::uint64_t>(r * 3 + s), skip);
        dp.finish();
        require(dp.last_step_stats().unused == skip.size(), "stats: unused count");
        check_average(dp, m, n, {s}, false, unused, "unused step " + std::to_string(s));
      }
    }, 60s));
  }
}

TEST_CASE("shape, dtype or count mismatch: errc::mismatch on every rank, naming the parameter and ranks") {
  struct variant { const char* what; const char* text; };
  for (variant v : {variant{"shape", "parameter 3 ('p3')"}, variant{"dtype", "parameter 5 ('p5')"},
                    variant{"count", "number of parameters"}}) {
    CAPTURE(v.what);
    const int n = 3;
    auto outs = on_ranks(n, local_group{10s}, [&](int r, ddp::process_group& pg) {
      toy_model m;
      const std::string what = v.what;
      for (std::size_t i = 0; i < 8; ++i) {
        if (r == 2 && what == "count" && i == 7) break;
        std::vector<std::int64_t> shape{4, 6};
        if (r == 2 && what == "shape" && i == 3) shape = {6, 4};
        m.add(24, (r == 2 && what == "dtype" && i == 5) ? ddp::dtype::f64 : ddp::dtype::f32, shape);
      }
      ddp::data_parallel dp{pg, m.views};
    }, 30s);
    INFO(summary(outs));
    for (auto& o : outs) {
      CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
      CHECK(o.message.find(v.text) != std::string::npos);
      CHECK(o.message.find("rank 2 has") != std::string::npos);
    }
  }
}

TEST_CASE("bucket policies that differ between ranks: errc::mismatch on every rank") {
  auto outs = on_ranks(2, local_group{10s}, [&](int r, ddp::process_group& pg) {
    toy_model m = random_model(3, 20, 1000);
    ddp::data_parallel dp{pg, m.views, {.cap_bytes = r == 0 ? 1_KiB : 2_KiB, .first_cap_bytes = 1_KiB}};
  }, 30s);
  INFO(summary(outs));
  for (auto& o : outs) {
    CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
    CHECK(o.message.find("bucket plans differ") != std::string::npos);
  }
}

TEST_CASE("misuse: double grad_ready, index out of range, finish with parameters never ready") {
  const int n = 2;
  expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
    toy_model m = random_model(51, 12, 300);
    ddp::data_parallel dp{pg, m.views, {.cap_bytes = 512, .first_cap_bytes = 512}};
    m.fill_grad([&](std::size_t i, std::size_t j) { return grad_value(r, i, j, 0); });
    // Parameter 11 is ready twice: refused, and the step goes on unharmed.
    dp.grad_ready(11);
    require_raises([&] { dp.grad_ready(11); }, ddp::errc::usage, {"parameter 11 ('p11') was already ready"});
    require_raises([&] { dp.grad_ready(12); }, ddp::errc::invalid_argument, {"grad_ready(12): there are only 12"});
    require_raises([&] { dp.mark_unused(99); }, ddp::errc::invalid_argument, {"mark_unused(99)"});
    for (std::size_t i = 10; i-- > 3;) dp.grad_ready(i);
    // 0, 1, 2 and 10 never became ready: finish names them and launches nothing more.
    require_raises([&] { dp.finish(); }, ddp::errc::usage,
                   {"4 parameters never became ready this step: parameter 0 ('p0'), parameter 1 ('p1'), "
                    "parameter 2 ('p2'), parameter 10 ('p10')"});
    require_raises([&] { dp.mark_unused(5); }, ddp::errc::usage, {"parameter 5 ('p5') was already ready"});
    // Fixing the step and calling finish again works.
    for (std::size_t i : {10, 2, 1, 0}) dp.grad_ready(i);
    dp.finish();
    check_average(dp, m, n, {0}, false, none, "after recovering");
    // A parameter marked unused cannot also be ready.
    dp.mark_unused(4);
    require_raises([&] { dp.grad_ready(4); }, ddp::errc::usage, {"parameter 4 ('p4') was already marked unused"});
    for (std::size_t i = 0; i < m.size(); ++i)
      if (i != 4) dp.grad_ready(i);
    dp.finish();
  }, 60s));
}

// A loop that calls finish() twice used to be told "N parameters never became ready ... or set
// dp_options::find_unused_parameters"; following that advice averaged zeros into every
// gradient. The doubled call is its own usage error, with the option too, and leaves the
// averages of the step before in place.
TEST_CASE("misuse: a second finish() with nothing new is errc::usage, with or without find_unused_parameters") {
  for (bool find_unused : {false, true}) {
    CAPTURE(find_unused);
    const int n = 2;
    expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
      toy_model m = random_model(53, 10, 300);
      ddp::data_parallel dp{pg, m.views, {.cap_bytes = 512, .first_cap_bytes = 512},
                            {.find_unused_parameters = find_unused}};
      const auto expect_twice = [&](const std::string& text) {
        try {
          dp.finish();
        } catch (const ddp::error& e) {
          const std::string msg = e.what();
          require(e.condition() == ddp::errc::usage, "wrong errc: " + msg);
          require(msg.find(text) != std::string::npos, "message lacks '" + text + "': " + msg);
          require(msg.find("never became ready") == std::string::npos, "told of missing parameters: " + msg);
          require((msg.find("would have averaged a zero gradient") != std::string::npos) == find_unused,
                  "what the option would have done: " + msg);
          return;
        }
        throw std::runtime_error("a second finish() with nothing new was accepted");
      };
      backward(dp, m, r, 0, false, false, static_cast<std::uint64_t>(r));
      dp.finish();
      check_average(dp, m, n, {0}, false, none, "step 0");
      expect_twice("finish() called twice with nothing new: no grad_ready or mark_unused since the previous "
                   "finish(), which ended step 0");
      check_average(dp, m, n, {0}, false, none, "step 0's averages after the refused finish()");
      // The wrapper is not failed: the next step runs as usual, and is refused again after it.
      backward(dp, m, r, 1, false, false, static_cast<std::uint64_t>(r + 7));
      dp.finish();
      check_average(dp, m, n, {1}, false, none, "step 1");
      expect_twice("which ended step 1");
      // A finish() with no hook after no_sync() steps is not doubled: it synchronizes what they
      // accumulated (find_unused_parameters), or names the parameters never ready.
      {
        auto guard = dp.no_sync();
        backward(dp, m, r, 2, false, false, static_cast<std::uint64_t>(r + 3));
        dp.finish();
      }
      if (find_unused) {
        dp.finish();
        require(dp.last_step_stats().synchronized, "the accumulated step is synchronized");
        check_average(dp, m, n, {2}, false, none, "the accumulated micro-step");
      } else {
        try {
          dp.finish();
          throw std::runtime_error("finish() with parameters never ready was accepted");
        } catch (const ddp::error& e) {
          const std::string msg = e.what();
          require(msg.find("10 parameters never became ready this step") != std::string::npos, msg);
          require(msg.find("its gradient is then zero, or what no_sync() steps accumulated") != std::string::npos,
                  "the hint says what marking unused does: " + msg);
        }
        for (std::size_t i = 0; i < m.size(); ++i) dp.mark_unused(i);
        dp.finish();
        check_average(dp, m, n, {2}, false, none, "the accumulated micro-step, marked unused");
      }
    }, 60s));
  }
}

TEST_CASE("rebuild from the ready order (copy mode): rank 0's order wins, plans agree, done once") {
  const int n = 3;
  expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
    toy_model m = random_model(61, 30, 2000);
    ddp::data_parallel dp{pg, m.views, {.cap_bytes = 4_KiB, .first_cap_bytes = 1_KiB}};
    const auto before = dp.plan();
    // Step 0 in registration order (not the reverse order the initial plan assumed).
    for (std::size_t i = 0; i < m.size(); ++i) {
      for (std::size_t j = 0; j < m.numel(i); ++j) toy_model::set(m.grad(i), m.type(i), j, grad_value(r, i, j, 0));
      dp.grad_ready(i);
    }
    dp.finish();
    require(dp.layout_version() == 1, "the plan was rebuilt once");
    std::vector<ddp::param_info> infos;
    for (std::size_t i = 0; i < m.size(); ++i) infos.push_back({m.numel(i), m.type(i), -1});
    std::vector<std::size_t> order(m.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    require(dp.plan() == ddp::size_planner{}.plan(infos, dp.policy(), order), "plan follows the observed order");
    require(!(dp.plan() == before), "plan changed");
    check_average(dp, m, n, {0}, false, none, "step 0");
    backward(dp, m, r, 1, false, false, static_cast<std::uint64_t>(r));
    dp.finish();
    require(dp.layout_version() == 1, "rebuilt only once");
    check_average(dp, m, n, {1}, false, none, "second step");
  }, 60s));
}

#ifdef DDP_TEST_HAS_SHM
TEST_CASE("shared memory: ring<shm> and tree<shm>, buckets from shm_allocator, copy and view mode") {
  using shm_alloc = ddp::shm_allocator;
  random_run<ddp::ring<ddp::shm>, shm_alloc>(2, 81, 120, 1 << 14, {.cap_bytes = 32_KiB, .first_cap_bytes = 2_KiB}, true);
  random_run<ddp::ring<ddp::shm>, shm_alloc>(3, 82, 100, 1 << 14, {.cap_bytes = 16_KiB, .first_cap_bytes = 1_KiB}, false);
  random_run<ddp::tree<ddp::shm>, shm_alloc>(4, 83, 80, 1 << 13, {.cap_bytes = 1, .first_cap_bytes = 1}, true);
  random_run<ddp::ring<ddp::shm>>(4, 84, 60, 1 << 12, {}, false);  // shm reducer, host buckets
  random_run<ddp::ring<ddp::shm>, shm_alloc>(2, 85, 8, 4 << 20, {.cap_bytes = 4_MiB, .first_cap_bytes = 256_KiB}, true, 2);
}
#endif

// ---- trust: no stale pointer, no lost accumulation, no trap, no silent success ---------------

namespace {

// Host memory behind an allocator with its own copy()/zero(), as device allocators have. It
// can report a device location (the wrapper then never touches bucket memory itself, as with
// cuda_allocator) and can be told to fail its Nth copy or zero. Counters are per process, and
// every rank is its own process.
struct test_allocator {
  static inline long copy_countdown = -1;  // the copy that finds it at 0 throws; -1: never
  static inline long zero_countdown = -1;
  static inline long allocate_countdown = -1;
  bool on_device = false;

  void* allocate(std::size_t bytes) {
    if (allocate_countdown >= 0 && allocate_countdown-- == 0)
      throw ddp::error(ddp::errc::system, -1, "test_allocator: injected allocate failure");
    return ddp::host_allocator{}.allocate(bytes);
  }
  void deallocate(void* p, std::size_t bytes) noexcept { ddp::host_allocator{}.deallocate(p, bytes); }
  ddp::memory_kind location() const noexcept { return on_device ? ddp::memory_kind::cuda : ddp::memory_kind::host; }
  void copy(void* dst, const void* src, std::size_t n) {
    if (copy_countdown >= 0 && copy_countdown-- == 0) throw std::runtime_error("test_allocator: injected copy failure");
    std::memcpy(dst, src, n);
  }
  void zero(void* dst, std::size_t n) {
    if (zero_countdown >= 0 && zero_countdown-- == 0) throw std::runtime_error("test_allocator: injected zero failure");
    std::memset(dst, 0, n);
  }
};
static_assert(ddp::device_allocator<test_allocator>);

// The same, reporting device memory: the wrapper plans device buckets.
struct device_test_allocator : test_allocator {
  device_test_allocator() { on_device = true; }
};
static_assert(ddp::device_allocator<device_test_allocator>);

// ring<tcp> whose Nth launch throws, as a reducer refusing a collective would.
struct flaky_ring : ddp::ring<ddp::tcp> {
  static inline long launch_countdown = -1;
  using ddp::ring<ddp::tcp>::ring;
  ddp::request allreduce_async(void* data, std::size_t count, ddp::dtype t, ddp::op o) {
    if (launch_countdown >= 0 && launch_countdown-- == 0) throw std::runtime_error("flaky_ring: injected launch failure");
    return ddp::ring<ddp::tcp>::allreduce_async(data, count, t, o);
  }
};
static_assert(ddp::reducer<flaky_ring>);

// Rank `failing` keeps its process (and so its sockets) alive until the others are done, so
// that what the others see comes from the failure itself, not from the process exiting.
struct done_marks {
  std::string prefix;
  explicit done_marks(int port) : prefix("/tmp/ddp_dp_trust_" + std::to_string(::getpid()) + "_" + std::to_string(port) + "_") {}
  void mark(int r) const { std::fclose(std::fopen((prefix + std::to_string(r)).c_str(), "w")); }
  void wait_others(int n, int me, std::chrono::milliseconds limit) const {
    const auto until = std::chrono::steady_clock::now() + limit;
    for (int q = 0; q < n; ++q) {
      if (q == me) continue;
      while (::access((prefix + std::to_string(q)).c_str(), F_OK) != 0 && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(20ms);
    }
  }
  void clear(int n) const {
    for (int q = 0; q < n; ++q) std::remove((prefix + std::to_string(q)).c_str());
  }
};

enum class fault { copy_in_grad_ready, zero_in_mark_unused, copy_back_in_finish, zero_in_finish_unused, allocate_in_rebuild, launch };

const char* fault_name(fault f) {
  switch (f) {
    case fault::copy_in_grad_ready: return "copy in grad_ready";
    case fault::zero_in_mark_unused: return "zero in mark_unused";
    case fault::copy_back_in_finish: return "copy back in finish";
    case fault::zero_in_finish_unused: return "zero in finish (find_unused_parameters)";
    case fault::allocate_in_rebuild: return "allocate in the rebuild";
    case fault::launch: return "the reducer's launch";
  }
  return "?";
}

template <class DP>
void expect_failed_with_cause(DP& dp, const std::string& cause) {
  const auto check = [&](const char* what, auto&& f) {
    try {
      f();
    } catch (const ddp::error& e) {
      const std::string msg = e.what();
      require(msg.find("failed earlier") != std::string::npos && msg.find(cause) != std::string::npos,
              std::string(what) + " after the failure does not name the first cause: " + msg);
      return;
    }
    throw std::runtime_error(std::string(what) + " after the failure did not raise");
  };
  check("grad_ready", [&] { dp.grad_ready(dp.size() - 1); });
  check("mark_unused", [&] { dp.mark_unused(dp.size() - 1); });
  check("finish", [&] { dp.finish(); });
  check("no_sync", [&] { auto g = dp.no_sync(); });
  check("bucket_grad", [&] { (void)dp.bucket_grad(0); });
  check("finish again", [&] { dp.finish(); });
}

// Step 0 is clean; in step 1 (after the rebuild) rank `failing`'s allocator throws once at the
// place `f` names (for the rebuild: at the end of step 0). That rank's call raises the allocator's error, every later call raises
// naming it, and the other ranks' finish() fails within timeout + 2 s naming that rank (or, when
// their step could still complete, returns the right average and the next step fails).
template <class Reducer>
void flaky_run(int n, int failing, fault f) {
  const int port = free_port();
  const done_marks marks(port);
  const auto timeout = 4s;
  auto outs = run_ranks(n, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, n, port, timeout));
    toy_model m = random_model(91, 24, 300);
    const bool find_unused = f == fault::zero_in_finish_unused;
    ddp::basic_data_parallel<ddp::size_planner, Reducer, test_allocator> dp{
        pg, m.views, {.cap_bytes = 1_KiB, .first_cap_bytes = 256}, {.find_unused_parameters = find_unused}};
    const std::vector<std::size_t> skip =
        (f == fault::zero_in_mark_unused || f == fault::zero_in_finish_unused) ? std::vector<std::size_t>{0}
                                                                              : std::vector<std::size_t>{};
    const auto zero_for = [&](std::size_t i, int) { return !skip.empty() && i == 0; };
    const auto step = [&](int s) {
      if (!find_unused)
        for (std::size_t i : skip) dp.mark_unused(i);
      backward(dp, m, r, s, false, false, static_cast<std::uint64_t>(r * 7 + s), skip);
      dp.finish();
    };
    const int fail_step = f == fault::allocate_in_rebuild ? 0 : 1;
    if (fail_step > 0) {
      step(0);
      check_average(dp, m, n, {0}, false, zero_for, "step 0");
    }
    const std::string cause = f == fault::copy_in_grad_ready || f == fault::copy_back_in_finish ? "injected copy failure"
                              : f == fault::allocate_in_rebuild                                 ? "injected allocate failure"
                              : f == fault::launch                                              ? "injected launch failure"
                                                                                                : "injected zero failure";
    if (r == failing) {
      switch (f) {
        case fault::allocate_in_rebuild: test_allocator::allocate_countdown = 0; break;
        case fault::launch: flaky_ring::launch_countdown = 1; break;
        case fault::copy_in_grad_ready: test_allocator::copy_countdown = 3; break;
        case fault::zero_in_mark_unused: test_allocator::zero_countdown = 0; break;
        case fault::copy_back_in_finish: test_allocator::copy_countdown = static_cast<long>(m.size()) + 2; break;
        case fault::zero_in_finish_unused: test_allocator::zero_countdown = 0; break;
      }
      bool threw = false;
      try {
        step(fail_step);
      } catch (const std::runtime_error& e) {
        threw = std::string(e.what()).find(cause) != std::string::npos;
      }
      require(threw, "the failing call raises the allocator's own error");
      expect_failed_with_cause(dp, cause);
      marks.mark(r);
      marks.wait_others(n, r, timeout + 3s);
      return;
    }
    // The others: a step either completes with the right average (nothing of the failing rank
    // was missing) or fails naming the failing rank within timeout + 2 s.
    for (int s = fail_step; s <= fail_step + 1; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        step(s);
      } catch (const ddp::error& e) {
        const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const std::string msg = e.what();
        marks.mark(r);
        require(took <= std::chrono::duration<double>(timeout).count() + 2.0,
                "the error came after " + std::to_string(took) + " s: " + msg);
        require(msg.find("rank " + std::to_string(failing)) != std::string::npos,
                "the error does not name rank " + std::to_string(failing) + ": " + msg);
        require(e.condition() == ddp::errc::aborted || e.condition() == ddp::errc::peer_lost,
                std::string("errc: ") + msg);
        if (std::is_same_v<typename Reducer::transport_type, ddp::tcp> || f == fault::allocate_in_rebuild)
          require(msg.find(cause) != std::string::npos, "tcp (or the group, in the rebuild) carries the cause: " + msg);
        // And it stays failed.
        bool again = false;
        try {
          dp.finish();
        } catch (const ddp::error&) {
          again = true;
        }
        require(again, "the wrapper stays failed on the peers too");
        return;
      }
      require(f == fault::copy_back_in_finish && s == 1, "step " + std::to_string(s) + " returned success");
      check_average(dp, m, n, {s}, false, zero_for, "a step that completed");
    }
    marks.mark(r);
    throw std::runtime_error("no error within two steps of the failure");
  }, 60s);
  marks.clear(n);
  expect_ok(outs);
}

}  // namespace

TEST_CASE("an allocator that throws once mid-step: that rank stays failed naming the cause, peers fail naming it") {
  for (fault f : {fault::copy_in_grad_ready, fault::zero_in_mark_unused, fault::copy_back_in_finish,
                  fault::zero_in_finish_unused, fault::allocate_in_rebuild}) {
    CAPTURE(fault_name(f));
    flaky_run<ddp::ring<ddp::tcp>>(3, 1, f);
  }
  flaky_run<ddp::tree<ddp::tcp>>(3, 2, fault::copy_in_grad_ready);
  flaky_run<flaky_ring>(3, 1, fault::launch);
#ifdef DDP_TEST_HAS_SHM
  flaky_run<ddp::ring<ddp::shm>>(3, 1, fault::copy_in_grad_ready);
  flaky_run<ddp::ring<ddp::shm>>(2, 0, fault::copy_back_in_finish);
#endif
}

namespace {

// The engine of the issue: it takes each bucket_grad(i) once and keeps it, and produces its
// gradients in registration order (not the reverse order the first plan assumed), which is
// what used to trigger the rebuild that moved the memory under its pointers.
template <class Reducer, class Allocator>
void cached_view_run(int n, int steps) {
  expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
    toy_model m = random_model(101, 40, 1500);
    ddp::basic_data_parallel<ddp::size_planner, Reducer, Allocator> dp{
        pg, m.views, {.cap_bytes = 2_KiB, .first_cap_bytes = 512}, {.gradient_as_bucket_view = true}};
    std::vector<void*> g(m.size());
    for (std::size_t i = 0; i < m.size(); ++i) g[i] = dp.bucket_grad(i);
    for (int s = 0; s < steps; ++s) {
      for (std::size_t i = 0; i < m.size(); ++i) {
        for (std::size_t j = 0; j < m.numel(i); ++j) toy_model::set(g[i], m.type(i), j, grad_value(r, i, j, s));
        dp.grad_ready(i);
      }
      dp.finish();
      // The single-process reference: the mean over ranks of each rank's gradient.
      for (std::size_t i = 0; i < m.size(); ++i) {
        require(dp.bucket_grad(i) == g[i], "bucket_grad(" + std::to_string(i) + ") moved");
        for (std::size_t j = 0; j < m.numel(i); ++j) {
          double expect = 0;
          for (int q = 0; q < n; ++q) expect += grad_value(q, i, j, s);
          expect /= n;
          const double got = toy_model::get(g[i], m.type(i), j);
          require(std::abs(got - expect) <= 1e-5 * (1 + std::abs(expect)),
                  "step " + std::to_string(s) + " parameter " + std::to_string(i) + " element " + std::to_string(j) +
                      " is " + std::to_string(got) + ", expected " + std::to_string(expect));
        }
      }
      require(dp.layout_version() == 0, "view mode never moves its layout");
    }
  }, 60s));
}

}  // namespace

TEST_CASE("view mode: pointers taken once stay valid, gradients in registration order, every allocator") {
  cached_view_run<ddp::ring<ddp::tcp>, ddp::host_allocator>(3, 4);
  cached_view_run<ddp::tree<ddp::tcp>, test_allocator>(2, 4);
  cached_view_run<ddp::ring<ddp::tcp>, device_test_allocator>(2, 3);
#ifdef DDP_TEST_HAS_SHM
  cached_view_run<ddp::ring<ddp::shm>, ddp::shm_allocator>(3, 4);
  cached_view_run<ddp::tree<ddp::shm>, ddp::shm_allocator>(2, 3);
#endif
  // pinned_allocator and cuda_allocator need a GPU: tests/cuda.
}

TEST_CASE("view and copy mode disagreeing between ranks: errc::mismatch at construction, not a hang") {
  auto outs = on_ranks(2, local_group{10s}, [&](int r, ddp::process_group& pg) {
    toy_model m = random_model(3, 20, 1000);
    ddp::data_parallel dp{pg, m.views, {}, {.gradient_as_bucket_view = r == 1}};
  }, 30s);
  INFO(summary(outs));
  for (auto& o : outs) {
    CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
    CHECK(o.message.find("rebuilding the bucket plan") != std::string::npos);
    CHECK(o.message.find("rank 0 does, rank 1 do not") != std::string::npos);
  }
}

TEST_CASE("no_sync then unused in the synchronized step: the accumulated gradient is averaged, not lost") {
  // Rank q leaves out V_q in both micro-steps and U_q in the synchronized step. A parameter's
  // contribution from rank q is the sum of the steps it was used in: U_q \ V_q contribute the
  // micro-steps' sum, U_q ∩ V_q nothing (whatever stale value the engine's buffer holds).
  for (bool view : {false, true}) {
    for (bool find_unused : {false, true}) {
      CAPTURE(view);
      CAPTURE(find_unused);
      const int n = 3;
      expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
        toy_model m = random_model(111, 30, 1000);
        ddp::data_parallel dp{pg, m.views, {.cap_bytes = 2_KiB, .first_cap_bytes = 512},
                              {.gradient_as_bucket_view = view, .find_unused_parameters = find_unused}};
        const auto in_v = [](std::size_t i, int q) { return i % 5 == static_cast<std::size_t>(q); };
        const auto in_u = [](std::size_t i, int q) { return i % 3 == static_cast<std::size_t>(q) || i == 29; };
        for (int round = 0; round < 2; ++round) {
          const int s0 = round * 10;
          const std::vector<int> micro{s0, s0 + 1};
          // The engine's gradient for parameter i this round: undefined until first used
          // (like PyTorch's grad = None after zero_grad(set_to_none)), then accumulated.
          std::vector<bool> defined(m.size(), false);
          const auto run_step = [&](int s, auto skipped) {
            for (std::size_t k = m.size(); k-- > 0;) {
              if (skipped(k)) {
                if (!find_unused) dp.mark_unused(k);
                continue;
              }
              void* gp = view ? dp.bucket_grad(k) : m.grad(k);
              for (std::size_t j = 0; j < m.numel(k); ++j) {
                const double v = grad_value(r, k, j, s);
                toy_model::set(gp, m.type(k), j, defined[k] ? toy_model::get(gp, m.type(k), j) + v : v);
              }
              defined[k] = true;
              dp.grad_ready(k);
            }
            dp.finish();
          };
          {
            auto guard = dp.no_sync();
            for (int s : micro) run_step(s, [&](std::size_t k) { return in_v(k, r); });
          }
          run_step(s0 + 2, [&](std::size_t k) { return in_u(k, r); });
          require(dp.last_step_stats().synchronized, "synchronized step");
          for (std::size_t i = 0; i < m.size(); ++i) {
            const void* gp = view ? dp.bucket_grad(i) : m.grad(i);
            for (std::size_t j = 0; j < m.numel(i); ++j) {
              double expect = 0;
              for (int q = 0; q < n; ++q) {
                if (!in_v(i, q))
                  for (int s : micro) expect += grad_value(q, i, j, s);
                if (!in_u(i, q)) expect += grad_value(q, i, j, s0 + 2);
              }
              expect /= n;
              const double got = toy_model::get(gp, m.type(i), j);
              require(std::abs(got - expect) <= 1e-5 * (1 + std::abs(expect)),
                      "round " + std::to_string(round) + " parameter " + std::to_string(i) + " element " +
                          std::to_string(j) + " is " + std::to_string(got) + ", expected " + std::to_string(expect));
            }
          }
        }
      }, 60s));
    }
  }
}

TEST_CASE("one device per rank (device = rank): plans agree, averages exact, copy and view mode") {
  for (bool view : {false, true}) {
    CAPTURE(view);
    const int n = 3;
    expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
      toy_model m = random_model(121, 30, 1000);
      for (auto& v : m.views) v.device = r;  // this rank's device index
      ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, device_test_allocator> dp{
          pg, m.views, {.cap_bytes = 2_KiB, .first_cap_bytes = 512}, {.gradient_as_bucket_view = view}};
      for (const auto& bk : dp.plan().buckets) require(bk.device == r, "buckets on this rank's device");
      for (int s = 0; s < 3; ++s) {
        backward(dp, m, r, s, view, false, static_cast<std::uint64_t>(r * 5 + s));
        dp.finish();
        check_average(dp, m, n, {s}, view, none, "device step " + std::to_string(s));
      }
      require(view ? dp.layout_version() == 0 : dp.layout_version() == 1, "rebuilt in copy mode only");
      for (const auto& bk : dp.plan().buckets) require(bk.device == r, "buckets on this rank's device after the rebuild");
    }, 60s));
  }
}

// ---- every combination the docs list, constructed for real --------------------------------

namespace {

// One step of the documented type `Dp` on rank r of 2: gradients r + 1 + j become 1.5 + j.
template <class Dp>
void documented_step(int r, int port, const char* what) {
  auto pg = ddp::init_process_group(opts(r, 2, port));
  std::vector<float> w(6, 1.0f), b(3, 2.0f), gw(6), gb(3);
  for (std::size_t j = 0; j < gw.size(); ++j) gw[j] = static_cast<float>(r + 1 + j);
  for (std::size_t j = 0; j < gb.size(); ++j) gb[j] = static_cast<float>(r + 1 + j);
  std::vector<ddp::tensor_view> params{ddp::make_tensor_view(w, gw, "w", {2, 3}), ddp::make_tensor_view(b, gb, "b")};
  Dp dp{pg, params};
  if constexpr (std::is_same_v<typename Dp::allocator_type, ddp::shm_allocator>)
    require(&dp.get_allocator().transport() == &dp.get_reducer().transport(),
            std::string(what) + ": the allocator is bound to the reducer's transport");
  dp.grad_ready(1);
  dp.grad_ready(0);
  dp.finish();
  for (std::size_t j = 0; j < gw.size(); ++j)
    require(gw[j] == 1.5f + static_cast<float>(j), std::string(what) + ": w's average");
  for (std::size_t j = 0; j < gb.size(); ++j)
    require(gb[j] == 1.5f + static_cast<float>(j), std::string(what) + ": b's average");
}

template <class Dp>
void documented(const char* what) {
  const int port = free_port();
  auto outs = run_processes({0, 1}, [&](int r) { documented_step<Dp>(r, port, what); }, 60s);
  INFO(what << ": " << summary(outs));
  CHECK(all_ok(outs));
}

}  // namespace

TEST_CASE("every combination the docs list constructs on 2 processes and averages a step") {
  static_assert(std::is_same_v<ddp::data_parallel,
                               ddp::basic_data_parallel<ddp::size_planner, ddp::auto_reducer, ddp::auto_allocator>>);
  documented<ddp::data_parallel>("data_parallel (auto_reducer, auto_allocator)");
  documented<ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>>>("ring<tcp>, auto_allocator on host");
  documented<ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, ddp::host_allocator>>("ring<tcp>");
  documented<ddp::basic_data_parallel<ddp::size_planner, ddp::hierarchical, ddp::shm_allocator>>(
      "hierarchical + shm_allocator");
  documented<ddp::basic_data_parallel<ddp::size_planner, ddp::tree<ddp::tcp>>>("tree<tcp>");
#ifdef DDP_TEST_HAS_SHM
  static_assert(ddp::allocator_bound_to<ddp::shm_allocator, ddp::ring<ddp::shm>>);
  static_assert(!ddp::allocator_bound_to<ddp::shm_allocator, ddp::ring<ddp::tcp>>);
  documented<ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::shm>, ddp::shm_allocator>>(
      "ring<shm> + shm_allocator");
  documented<ddp::basic_data_parallel<ddp::size_planner, ddp::tree<ddp::shm>, ddp::shm_allocator>>(
      "tree<shm> + shm_allocator");
#endif
}
