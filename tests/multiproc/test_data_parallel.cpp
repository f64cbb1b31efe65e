#include <ddp/data_parallel.hpp>

#include <ddp/concepts.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/tree.hpp>
#include <ddp/transport/tcp.hpp>
#if __has_include(<ddp/transport/shm.hpp>)
#include <ddp/memory/shm_allocator.hpp>
#include <ddp/transport/shm.hpp>
#define DDP_TEST_HAS_SHM 1
#endif

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"

using namespace std::chrono_literals;
using namespace ddp_test;
using namespace ddp::literals;

static_assert(ddp::reducer<ddp::ring<ddp::tcp>>);
static_assert(ddp::reducer<ddp::tree<ddp::tcp>>);
static_assert(!ddp::reducer<ddp::host_allocator>);
static_assert(!ddp::reducer<int>);

namespace {

ddp::init_options opts(int rank, int n, int port, std::chrono::milliseconds timeout = 30s) {
  ddp::init_options o;
  o.rank = rank;
  o.world_size = n;
  o.master_port = port;
  o.timeout = timeout;
  return o;
}

void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

// The gradient rank r produces for element j of parameter i in micro-step s: small multiples of
// 1/8, exact in f32 and f64, so sums are exact and only the final division can round.
double grad_value(int r, std::size_t i, std::size_t j, int s) {
  return static_cast<double>(static_cast<long>(((static_cast<std::size_t>(r) + 1) * 31 + i * 17 + j * 7 +
                                                static_cast<std::size_t>(s) * 13) % 97) - 48) / 8.0;
}

double data_value(int r, std::size_t i, std::size_t j) { return static_cast<double>(r * 1000 + static_cast<int>((i + j) % 500)); }

// A model as an engine would hold it: per parameter, values and a gradient of one dtype.
struct model {
  std::vector<std::size_t> numel;
  std::vector<ddp::dtype> types;
  std::vector<std::vector<std::int64_t>> shapes;
  std::vector<std::string> names;
  std::vector<std::unique_ptr<std::byte[]>> data, grad;
  std::vector<ddp::tensor_view> views;

  void add(std::size_t n, ddp::dtype t, std::vector<std::int64_t> shape = {}) {
    numel.push_back(n);
    types.push_back(t);
    if (shape.empty()) shape.push_back(static_cast<std::int64_t>(n));
    shapes.push_back(std::move(shape));
    names.push_back("p" + std::to_string(numel.size() - 1));
    data.push_back(std::make_unique<std::byte[]>(std::max<std::size_t>(1, n * ddp::dtype_size(t))));
    grad.push_back(std::make_unique<std::byte[]>(std::max<std::size_t>(1, n * ddp::dtype_size(t))));
  }
  void make_views() {
    views.clear();
    for (std::size_t i = 0; i < numel.size(); ++i)
      views.push_back(ddp::tensor_view{data[i].get(), grad[i].get(), numel[i], types[i], -1, names[i], shapes[i]});
  }
  std::size_t size() const { return numel.size(); }
  std::size_t bytes() const {
    std::size_t b = 0;
    for (std::size_t i = 0; i < size(); ++i) b += numel[i] * ddp::dtype_size(types[i]);
    return b;
  }
  static double get(const void* p, ddp::dtype t, std::size_t j) {
    return t == ddp::dtype::f64 ? static_cast<const double*>(p)[j] : static_cast<const float*>(p)[j];
  }
  static void set(void* p, ddp::dtype t, std::size_t j, double v) {
    if (t == ddp::dtype::f64) static_cast<double*>(p)[j] = v;
    else static_cast<float*>(p)[j] = static_cast<float>(v);
  }
};

// Random shapes shared by every rank (same seed): mostly small, log-uniform, a few f64.
model random_model(std::uint64_t seed, std::size_t count, std::size_t max_numel) {
  std::mt19937_64 g(seed);
  model m;
  std::uniform_real_distribution<double> u(0.0, std::log(static_cast<double>(max_numel)));
  for (std::size_t i = 0; i < count; ++i) {
    const auto n = static_cast<std::size_t>(std::exp(u(g)));
    m.add(std::max<std::size_t>(1, n), (g() % 8 == 0) ? ddp::dtype::f64 : ddp::dtype::f32);
  }
  m.make_views();
  return m;
}

// The engine's backward: writes each gradient (into its own buffer, or into bucket memory in
// view mode), accumulating when asked, and calls the hook in a per-rank random order.
template <class DP>
void backward(DP& dp, model& m, int r, int s, bool view, bool accumulate, std::uint64_t order_seed,
              const std::vector<std::size_t>& skip = {}) {
  std::vector<std::size_t> order(m.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::reverse(order.begin(), order.end());
  std::mt19937_64 g(order_seed);
  std::shuffle(order.begin(), order.end(), g);
  for (std::size_t i : order) {
    if (std::find(skip.begin(), skip.end(), i) != skip.end()) continue;
    void* gp = view ? dp.bucket_grad(i) : m.grad[i].get();
    for (std::size_t j = 0; j < m.numel[i]; ++j) {
      const double v = grad_value(r, i, j, s);
      model::set(gp, m.types[i], j, accumulate ? model::get(gp, m.types[i], j) + v : v);
    }
    dp.grad_ready(i);
  }
}

// Checks that gradient i now holds avg over ranks of sum over `steps` of grad_value, with the
// ranks in `zero_for(i)` contributing nothing.
template <class DP, class ZeroFor>
void check_average(DP& dp, model& m, int n, const std::vector<int>& steps, bool view, ZeroFor zero_for,
                   const std::string& what) {
  for (std::size_t i = 0; i < m.size(); ++i) {
    const void* gp = view ? dp.bucket_grad(i) : m.grad[i].get();
    for (std::size_t j = 0; j < m.numel[i]; ++j) {
      double expect = 0;
      for (int q = 0; q < n; ++q)
        if (!zero_for(i, q))
          for (int s : steps) expect += grad_value(q, i, j, s);
      expect /= n;
      const double got = model::get(gp, m.types[i], j);
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
  const int port = free_port();
  auto outs = run_ranks(n, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, n, port));
    model m = random_model(seed, count, max_numel);
    for (std::size_t i = 0; i < m.size(); ++i)
      for (std::size_t j = 0; j < m.numel[i]; ++j) model::set(m.data[i].get(), m.types[i], j, data_value(r, i, j));
    ddp::basic_data_parallel<ddp::size_planner, Reducer, Allocator> dp{pg, m.views, policy,
                                                            {.gradient_as_bucket_view = view}};
    for (std::size_t i = 0; i < m.size(); ++i)
      for (std::size_t j = 0; j < m.numel[i]; ++j)
        require(model::get(m.data[i].get(), m.types[i], j) == data_value(0, i, j), "rank 0's parameters broadcast");
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
  }, 60s);
  INFO(summary(outs));
  CHECK(all_ok(outs));
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

TEST_CASE("grad_ready from several threads at once") {
  const int n = 2;
  const int port = free_port();
  auto outs = run_ranks(n, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, n, port));
    model m = random_model(71, 200, 1 << 10);
    ddp::data_parallel dp{pg, m.views, {.cap_bytes = 2_KiB, .first_cap_bytes = 512}};
    for (int s = 0; s < 3; ++s) {
      for (std::size_t i = 0; i < m.size(); ++i)
        for (std::size_t j = 0; j < m.numel[i]; ++j) model::set(m.grad[i].get(), m.types[i], j, grad_value(r, i, j, s));
      std::vector<std::thread> threads;
      for (std::size_t t = 0; t < 4; ++t)
        threads.emplace_back([&, t] {
          for (std::size_t i = m.size() - 1 - t; i < m.size(); i -= 4) dp.grad_ready(i);
        });
      for (auto& t : threads) t.join();
      dp.finish();
      check_average(dp, m, n, {s}, false, none, "threaded step " + std::to_string(s));
    }
  }, 60s);
  INFO(summary(outs));
  CHECK(all_ok(outs));
}

TEST_CASE("large parameters: 4 M elements next to single elements") {
  const int n = 2;
  const int port = free_port();
  auto outs = run_ranks(n, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, n, port));
    model m;
    for (std::size_t k : {std::size_t{1}, std::size_t{4} << 20, std::size_t{3}, std::size_t{1} << 20, std::size_t{1}})
      m.add(k, ddp::dtype::f32);
    m.make_views();
    ddp::data_parallel dp{pg, m.views, {.cap_bytes = 2_MiB, .first_cap_bytes = 64_KiB}};
    for (int s = 0; s < 2; ++s) {
      backward(dp, m, r, s, false, false, static_cast<std::uint64_t>(r + 7 * s));
      dp.finish();
      check_average(dp, m, n, {s}, false, none, "large step " + std::to_string(s));
    }
  }, 60s);
  INFO(summary(outs));
  CHECK(all_ok(outs));
}

TEST_CASE("gradient as bucket view: the engine writes into bucket memory, nothing is copied") {
  random_run<ddp::ring<ddp::tcp>>(2, 21, 120, 1 << 14, {.cap_bytes = 32_KiB, .first_cap_bytes = 2_KiB}, true);
  random_run<ddp::tree<ddp::tcp>>(4, 22, 60, 1 << 12, {.cap_bytes = 1, .first_cap_bytes = 1}, true);
  // The views hand out bucket memory as the gradient.
  const int port = free_port();
  auto outs = run_ranks(2, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, 2, port));
    model m = random_model(5, 10, 100);
    ddp::data_parallel dp{pg, m.views, {}, {.gradient_as_bucket_view = true}};
    auto vs = dp.views();
    for (std::size_t i = 0; i < m.size(); ++i) require(vs[i].grad == dp.bucket_grad(i), "views point into buckets");
  }, 30s);
  INFO(summary(outs));
  CHECK(all_ok(outs));
}

TEST_CASE("no_sync: micro-steps accumulate locally, the next synchronized step averages the sum") {
  for (bool view : {false, true}) {
    CAPTURE(view);
    const int n = 3;
    const int port = free_port();
    auto outs = run_ranks(n, [&](int r) {
      auto pg = ddp::init_process_group(opts(r, n, port));
      model m = random_model(31, 40, 1 << 12);
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
      bool refused = false;
      try {
        auto g = dp.no_sync();
      } catch (const ddp::error& e) {
        refused = e.condition() == ddp::errc::usage;
      }
      require(refused, "no_sync mid-step is errc::usage");
      for (std::size_t i = 1; i < m.size(); ++i) dp.grad_ready(i);
      dp.finish();
    }, 60s);
    INFO(summary(outs));
    CHECK(all_ok(outs));
  }
}

TEST_CASE("unused parameters: mark_unused per rank, and find_unused_parameters") {
  for (bool option : {false, true}) {
    CAPTURE(option);
    const int n = 4;
    const int port = free_port();
    auto outs = run_ranks(n, [&](int r) {
      auto pg = ddp::init_process_group(opts(r, n, port));
      model m = random_model(41, 50, 1 << 12);
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
    }, 60s);
    INFO(summary(outs));
    CHECK(all_ok(outs));
  }
}

TEST_CASE("shape, dtype or count mismatch: errc::mismatch on every rank, naming the parameter and ranks") {
  struct variant { const char* what; const char* text; };
  for (variant v : {variant{"shape", "parameter 3 ('p3')"}, variant{"dtype", "parameter 5 ('p5')"},
                    variant{"count", "number of parameters"}}) {
    CAPTURE(v.what);
    const int n = 3;
    const int port = free_port();
    auto outs = run_ranks(n, [&](int r) {
      auto pg = ddp::init_process_group(opts(r, n, port, 10s));
      model m;
      const std::string what = v.what;
      for (std::size_t i = 0; i < 8; ++i) {
        if (r == 2 && what == "count" && i == 7) break;
        std::vector<std::int64_t> shape{4, 6};
        if (r == 2 && what == "shape" && i == 3) shape = {6, 4};
        m.add(24, (r == 2 && what == "dtype" && i == 5) ? ddp::dtype::f64 : ddp::dtype::f32, shape);
      }
      m.make_views();
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
  const int port = free_port();
  auto outs = run_ranks(2, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, 2, port, 10s));
    model m = random_model(3, 20, 1000);
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
  const int port = free_port();
  auto outs = run_ranks(n, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, n, port));
    model m = random_model(51, 12, 300);
    ddp::data_parallel dp{pg, m.views, {.cap_bytes = 512, .first_cap_bytes = 512}};
    const auto expect_error = [&](auto&& f, ddp::errc code, const std::string& text) {
      try {
        f();
      } catch (const ddp::error& e) {
        require(e.condition() == code, std::string("wrong errc: ") + e.what());
        require(std::string(e.what()).find(text) != std::string::npos, std::string("message lacks '") + text + "': " + e.what());
        return;
      }
      throw std::runtime_error("no error for: " + text);
    };
    for (std::size_t i = 0; i < m.size(); ++i) {
      for (std::size_t j = 0; j < m.numel[i]; ++j) model::set(m.grad[i].get(), m.types[i], j, grad_value(r, i, j, 0));
    }
    // Parameter 11 is ready twice: refused, and the step goes on unharmed.
    dp.grad_ready(11);
    expect_error([&] { dp.grad_ready(11); }, ddp::errc::usage, "parameter 11 ('p11') was already ready");
    expect_error([&] { dp.grad_ready(12); }, ddp::errc::invalid_argument, "grad_ready(12): there are only 12");
    expect_error([&] { dp.mark_unused(99); }, ddp::errc::invalid_argument, "mark_unused(99)");
    for (std::size_t i = 10; i-- > 3;) dp.grad_ready(i);
    // 0, 1, 2 and 10 never became ready: finish names them and launches nothing more.
    expect_error([&] { dp.finish(); }, ddp::errc::usage, "4 parameters never became ready this step: parameter 0 ('p0'), parameter 1 ('p1'), parameter 2 ('p2'), parameter 10 ('p10')");
    expect_error([&] { dp.mark_unused(5); }, ddp::errc::usage, "parameter 5 ('p5') was already ready");
    // Fixing the step and calling finish again works.
    for (std::size_t i : {10, 2, 1, 0}) dp.grad_ready(i);
    dp.finish();
    check_average(dp, m, n, {0}, false, none, "after recovering");
    // A parameter marked unused cannot also be ready.
    dp.mark_unused(4);
    expect_error([&] { dp.grad_ready(4); }, ddp::errc::usage, "parameter 4 ('p4') was already marked unused");
    for (std::size_t i = 0; i < m.size(); ++i)
      if (i != 4) dp.grad_ready(i);
    dp.finish();
  }, 60s);
  INFO(summary(outs));
  CHECK(all_ok(outs));
}

TEST_CASE("rebuild from the ready order: rank 0's order wins, plans agree, view pointers move") {
  const int n = 3;
  const int port = free_port();
  auto outs = run_ranks(n, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, n, port));
    model m = random_model(61, 30, 2000);
    ddp::data_parallel dp{pg, m.views, {.cap_bytes = 4_KiB, .first_cap_bytes = 1_KiB}, {.gradient_as_bucket_view = true}};
    const auto before = dp.plan();
    // Step 0 in registration order (not the reverse order the initial plan assumed).
    for (std::size_t i = 0; i < m.size(); ++i) {
      for (std::size_t j = 0; j < m.numel[i]; ++j) model::set(dp.bucket_grad(i), m.types[i], j, grad_value(r, i, j, 0));
      dp.grad_ready(i);
    }
    dp.finish();
    require(dp.generation() == 1, "the plan was rebuilt once");
    std::vector<ddp::param_info> infos;
    for (std::size_t i = 0; i < m.size(); ++i) infos.push_back({m.numel[i], m.types[i], -1});
    std::vector<std::size_t> order(m.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    require(dp.plan() == ddp::size_planner{}.plan(infos, dp.policy(), order), "plan follows the observed order");
    require(!(dp.plan() == before), "plan changed");
    // The averaged gradients moved with their parameters into the new layout.
    check_average(dp, m, n, {0}, true, none, "after the rebuild");
    backward(dp, m, r, 1, true, false, static_cast<std::uint64_t>(r));
    dp.finish();
    require(dp.generation() == 1, "rebuilt only once");
    check_average(dp, m, n, {1}, true, none, "second step");
  }, 60s);
  INFO(summary(outs));
  CHECK(all_ok(outs));
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
