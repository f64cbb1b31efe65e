#include <ddp/data_parallel.hpp>

#include <ddp/memory/host_allocator.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/transport/tcp.hpp>
#if __has_include(<ddp/reducer/shm.hpp>)
#include <ddp/memory/shm_allocator.hpp>
#include <ddp/reducer/shm.hpp>
#define DDP_TEST_HAS_SHM 1
#endif

#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"
#include "toy_model.hpp"

// Uneven inputs (dp_options::uneven_inputs, join()): ranks with fewer batches answer the other
// ranks' steps with zeros, and every step averages over the ranks that contributed to it.

using namespace std::chrono_literals;
using namespace ddp_test;

namespace {

// A model of one parameter per dtype the wrapper reduces, several buckets (small caps).
struct model : toy_model {
  model() {
    add(37, ddp::dtype::f32, {}, "w").add(5, ddp::dtype::f64, {}, "w64").add(9, ddp::dtype::f16, {}, "h");
    add(6, ddp::dtype::i32, {}, "n").add(300, ddp::dtype::f32, {}, "big");
  }
};

// The gradient rank r produces for element j of parameter i at step s of epoch e: an integer
// in [-48, 48] for i32, that over 8 for the floats (exact in each), and f16's element 0 is
// 40000 + r * 32 (two of them sum past f16's largest value, 65504: only a scaled average
// stays finite).
double grad_value(const model& m, int r, std::size_t i, std::size_t j, int s, int e) {
  if (m.type(i) == ddp::dtype::f16 && j == 0) return 40000.0 + r * 32.0;
  const long k = static_cast<long>(((static_cast<std::size_t>(r) + 1) * 31 + i * 17 + j * 7 +
                                    static_cast<std::size_t>(s) * 13 + static_cast<std::size_t>(e) * 29) % 97) - 48;
  return m.type(i) == ddp::dtype::i32 ? static_cast<double>(k) : static_cast<double>(k) / 8.0;
}

// One unit in the last place of `v` as dtype t holds it (0 for integers: exact).
double ulp(ddp::dtype t, double v) {
  const double a = std::abs(v);
  switch (t) {
    case ddp::dtype::f32: return std::nextafter(static_cast<float>(a), 1e30f) - static_cast<float>(a);
    case ddp::dtype::f64: return std::nextafter(a, 1e300) - a;
    case ddp::dtype::f16: {
      const float h = static_cast<float>(ddp::half(static_cast<float>(a)));
      return a < 6.103515625e-05 ? 5.9604644775390625e-08 : std::ldexp(1.0, std::ilogb(h) - 10);
    }
    default: return 0;
  }
}

// Every gradient holds the average over the contributing ranks `who` of step s, epoch e:
// exact for i32 (the sum divided by their count, truncated), within one ulp for the floats.
// `divisor`: the ranks' count the average divides by (who.size(), or the world size: join_divisor).
void check_step(const model& m, const std::vector<const void*>& grads, const std::vector<int>& who, int s, int e,
                const std::string& what, std::size_t divisor = 0) {
  if (divisor == 0) divisor = who.size();
  for (std::size_t i = 0; i < m.size(); ++i)
    for (std::size_t j = 0; j < m.numel(i); ++j) {
      double expect = 0;
      if (m.type(i) == ddp::dtype::i32) {
        long sum = 0;
        for (int q : who) sum += static_cast<long>(grad_value(m, q, i, j, s, e));
        expect = static_cast<double>(sum / static_cast<long>(divisor));
      } else {
        for (int q : who) expect += grad_value(m, q, i, j, s, e);
        expect /= static_cast<double>(divisor);
      }
      const double got = model::get(grads[i], m.type(i), j);
      if (std::abs(got - expect) > ulp(m.type(i), expect))
        throw std::runtime_error(what + ": " + m.name(i) + "[" + std::to_string(j) + "] is " + std::to_string(got) +
                                 ", expected " + std::to_string(expect) + " (the sum over " +
                                 std::to_string(who.size()) + " ranks divided by " + std::to_string(divisor) + ")");
    }
}

const ddp::bucket_policy small_buckets{.cap_bytes = 256, .first_cap_bytes = 64};

// Epochs of `batches[e][r]` steps on rank r; every step's result checked on every active rank,
// then join(); then the next epoch with the same wrapper.
template <class DP>
void uneven_run(int n, const std::vector<std::vector<int>>& batches, bool view, const char* label,
                ddp::join_divisor divide_by = ddp::join_divisor::contributors) {
  auto outs = on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
    model m;
    DP dp{pg, m.views, small_buckets, {.gradient_as_bucket_view = view, .uneven_inputs = true, .divide_by = divide_by}};
    require(dp.layout_version() == 0, "the layout is settled at construction");
    std::uint64_t joined = 0;
    for (std::size_t e = 0; e < batches.size(); ++e) {
      const auto& b = batches[e];
      const int most = *std::max_element(b.begin(), b.end());
      const std::string ep = std::string(label) + " epoch " + std::to_string(e) + " rank " + std::to_string(r);
      for (int s = 0; s < b[static_cast<std::size_t>(r)]; ++s) {
        std::vector<const void*> grads;
        for (std::size_t k = m.size(); k-- > 0;) {
          void* g = view ? dp.bucket_grad(k) : m.grad(k);
          for (std::size_t j = 0; j < m.numel(k); ++j)
            model::set(g, m.type(k), j, grad_value(m, r, k, j, s, static_cast<int>(e)));
          dp.grad_ready(k);
        }
        dp.finish();
        for (std::size_t k = 0; k < m.size(); ++k) grads.push_back(view ? dp.bucket_grad(k) : m.grad(k));
        std::vector<int> who;
        for (int q = 0; q < n; ++q)
          if (b[static_cast<std::size_t>(q)] > s) who.push_back(q);
        const std::string what = ep + " step " + std::to_string(s);
        check_step(m, grads, who, s, static_cast<int>(e), what,
                   divide_by == ddp::join_divisor::world_size ? static_cast<std::size_t>(n) : who.size());
        require(dp.last_step_stats().contributors == static_cast<int>(who.size()),
                what + ": stats report " + std::to_string(dp.last_step_stats().contributors) + " contributors");
      }
      // A sentinel in this rank's own gradients: copy mode leaves them alone while answering.
      if (!view) m.fill_grad(7);
      dp.join();
      joined += static_cast<std::uint64_t>(most - b[static_cast<std::size_t>(r)]);
      require(dp.joined_steps() == joined, ep + ": answered " + std::to_string(dp.joined_steps()) + " steps, expected " +
                                               std::to_string(joined));
      for (std::size_t k = 0; k < m.size(); ++k) {
        const void* g = view ? dp.bucket_grad(k) : m.grad(k);
        for (std::size_t j = 0; j < m.numel(k); ++j)
          require(model::get(g, m.type(k), j) == (view ? 0 : 7),
                  ep + ": after join() " + m.name(k) + " holds " + std::to_string(model::get(g, m.type(k), j)));
      }
    }
  }, 90s);
  INFO(label << (view ? " (view mode)\n" : " (copy mode)\n") << summary(outs));
  CHECK(all_ok(outs));
}

using ring_tcp = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, ddp::host_allocator>;

// Host memory that reports a device's location, with copy and zero hooks (as cuda_allocator):
// the wrapper never touches bucket memory itself, so the average over the contributors goes
// through a host copy of each bucket.
struct far_allocator {
  void* allocate(std::size_t bytes) { return ddp::host_allocator{}.allocate(bytes); }
  void deallocate(void* p, std::size_t bytes) noexcept { ddp::host_allocator{}.deallocate(p, bytes); }
  ddp::memory_kind location() const noexcept { return ddp::memory_kind::cuda; }
  void copy(void* dst, const void* src, std::size_t n) { std::memcpy(dst, src, n); }
  void zero(void* dst, std::size_t n) { std::memset(dst, 0, n); }
};
static_assert(ddp::copying_allocator<far_allocator>);
using ring_far = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, far_allocator>;

// Shards of 0, 1 and N batches; rank 0 with none; all alike; all empty; then a second epoch.
const std::vector<std::vector<int>> three_ranks{{0, 1, 5}, {2, 2, 2}, {0, 0, 0}, {3, 0, 1}};
const std::vector<std::vector<int>> four_ranks{{5, 0, 1, 3}, {0, 4, 4, 1}};

}  // namespace

TEST_CASE("uneven shards (0, 1, N batches): every step averages over its contributors, default reducer") {
  uneven_run<ddp::data_parallel>(3, three_ranks, false, "data_parallel, 3 ranks");
  uneven_run<ddp::data_parallel>(4, four_ranks, true, "data_parallel, 4 ranks");
}

TEST_CASE("uneven shards, the default divisor: the sum over the contributors divided by the world size (PyTorch's)") {
  uneven_run<ddp::data_parallel>(3, three_ranks, false, "data_parallel, 3 ranks, divide by the world",
                                 ddp::join_divisor::world_size);
  uneven_run<ring_tcp>(4, four_ranks, true, "ring<tcp>, 4 ranks, divide by the world", ddp::join_divisor::world_size);
  CHECK(ddp::dp_options{}.divide_by == ddp::join_divisor::world_size);
}

TEST_CASE("uneven shards: ring<tcp>, copy and view mode") {
  uneven_run<ring_tcp>(1, {{3}, {0}}, false, "ring<tcp>, 1 rank");  // join() alone returns at once
  uneven_run<ring_tcp>(4, four_ranks, false, "ring<tcp>, 4 ranks");
  uneven_run<ring_tcp>(3, three_ranks, true, "ring<tcp>, 3 ranks");
  uneven_run<ring_far>(3, three_ranks, false, "ring<tcp>, memory the CPU may not touch, 3 ranks");
}

#ifdef DDP_TEST_HAS_SHM
TEST_CASE("uneven shards: ring<shm>, buckets from shm_allocator, copy and view mode") {
  using ring_shm = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::shm>, ddp::shm_allocator>;
  uneven_run<ring_shm>(3, three_ranks, false, "ring<shm>, 3 ranks");
  uneven_run<ring_shm>(4, four_ranks, true, "ring<shm>, 4 ranks");
}
#endif

TEST_CASE("every rank contributing: uneven_inputs gives the bits the wrapper gives without it") {
  // Gradients with every mantissa bit in use, on 3 ranks (the average divides by 3, rounding).
  const int n = 3;
  expect_ok(on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
    model m;
    ring_tcp plain{pg, m.views, small_buckets};
    ring_tcp uneven{pg, m.views, small_buckets, {.uneven_inputs = true}};
    ddp::data_parallel plain_auto{pg, m.views, small_buckets};
    ddp::data_parallel uneven_auto{pg, m.views, small_buckets, {.uneven_inputs = true}};
    const auto fill = [&](int s) {
      m.fill_grad([&](std::size_t k, std::size_t j) {
        return m.type(k) == ddp::dtype::i32 ? (r * 7919 + static_cast<int>(j) * 104729 + s) % 20011 - 10000
                                            : std::sin(1.0 + r * 0.37 + static_cast<double>(j) * 1.3 + s) * 1000;
      });
    };
    const auto step = [&](auto& dp, int s) {
      fill(s);
      for (std::size_t k = m.size(); k-- > 0;) dp.grad_ready(k);
      dp.finish();
      return m.grad_bytes();  // the averages, copied
    };
    for (int s = 0; s < 3; ++s) {
      // One wrapper after the other, in the same order on every rank (their collectives pair up).
      const auto a = step(plain, s);
      const auto b = step(uneven, s);
      require(a == b, "ring<tcp> step " + std::to_string(s) + ": the bits differ");
      const auto c = step(plain_auto, s);
      const auto d = step(uneven_auto, s);
      require(c == d, "data_parallel step " + std::to_string(s) + ": the bits differ");
      require(uneven.last_step_stats().contributors == n && plain.last_step_stats().contributors == n,
              "stats: every rank contributed");
    }
    uneven.join();
    uneven_auto.join();
    require(uneven.joined_steps() == 0, "nobody had batches left to answer");
  }, 60s));
}

TEST_CASE("uneven_inputs differing between ranks: errc::mismatch on every rank, naming the option and rank") {
  const int n = 3;
  auto outs = on_ranks(n, local_group{10s}, [&](int r, ddp::process_group& pg) {
    model m;
    ring_tcp dp{pg, m.views, small_buckets, {.uneven_inputs = r != 1}};
  }, 30s);
  INFO(summary(outs));
  for (const auto& o : outs) {
    CHECK(o.exit_code == 1);
    CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
    CHECK(o.message.find("dp_options::uneven_inputs") != std::string::npos);
    CHECK(o.message.find("rank 1 has 0") != std::string::npos);
  }
}

TEST_CASE("misuse: join() without the option, in the middle of a step, and from a second thread") {
  const int n = 2;
  expect_ok(on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
    model m;
    const auto usage = [&](auto&& f, const char* needle, const std::string& what) {
      require_raises(f, ddp::errc::usage, {needle}, what);
    };
    {
      ring_tcp dp{pg, m.views, small_buckets};
      usage([&] { dp.join(); }, "needs dp_options::uneven_inputs", "join() without the option");
    }
    ring_tcp dp{pg, m.views, small_buckets, {.uneven_inputs = true}};
    dp.grad_ready(0);
    usage([&] { dp.join(); }, "in the middle of a step", "join() mid-step");
    for (std::size_t k = 1; k < m.size(); ++k) dp.grad_ready(k);
    dp.finish();  // the refusal changed nothing: the step completes on both ranks
    require(dp.last_step_stats().contributors == 2, "the step after a refused join() counts both ranks");
    if (r == 0) {
      // join() blocks until rank 1 joins (in 1.5 s); meanwhile this thread tries to step.
      std::thread t([&] { dp.join(); });
      std::this_thread::sleep_for(300ms);
      usage([&] { dp.grad_ready(0); }, "while this rank's join() is running", "grad_ready during join()");
      usage([&] { dp.finish(); }, "while this rank's join() is running", "finish during join()");
      usage([&] { dp.join(); }, "join() is already running", "a second join()");
      t.join();
    } else {
      std::this_thread::sleep_for(1500ms);
      dp.join();
    }
    // After join() the next epoch starts: one more step on both ranks works.
    for (std::size_t k = 0; k < m.size(); ++k) dp.grad_ready(k);
    dp.finish();
    require(dp.last_step_stats().contributors == 2, "the next epoch's step counts both ranks");
    dp.join();
  }, 60s));
}

namespace {

// Rank `victim` dies (SIGKILL, no goodbye) after `victim_steps` steps, or `in_join` after it
// joined; the others have `steps` batches (0: they joined at once). Every survivor must end
// with an error naming a lost peer or a deadline, well before the harness's limit.
template <class DP>
void kill_run(int n, int victim, int victim_steps, bool in_join, int steps, const char* label) {
  auto outs = on_ranks(n, local_group{3s}, [&](int r, ddp::process_group& pg) {
    model m;
    DP dp{pg, m.views, small_buckets, {.uneven_inputs = true}};
    const auto one_step = [&] {
      for (std::size_t k = m.size(); k-- > 0;) dp.grad_ready(k);
      dp.finish();
      std::this_thread::sleep_for(20ms);
    };
    if (r == victim) {
      for (int s = 0; s < victim_steps; ++s) one_step();
      if (!in_join) ::raise(SIGKILL);
      std::thread([] {
        std::this_thread::sleep_for(300ms);
        ::raise(SIGKILL);
      }).detach();
      dp.join();
      throw std::runtime_error("the victim's join() returned");
    }
    for (int s = 0; s < steps; ++s) one_step();
    dp.join();
  }, 40s);
  INFO(label << "\n" << summary(outs));
  for (const auto& o : outs) {
    if (o.rank == victim) {
      CHECK(o.exit_code == 128 + SIGKILL);
      continue;
    }
    CHECK_FALSE(o.timed_out);
    CHECK(o.exit_code == 1);
    const bool lost = o.errc == static_cast<int>(ddp::errc::peer_lost) ||
                      o.errc == static_cast<int>(ddp::errc::timeout) || o.errc == static_cast<int>(ddp::errc::aborted);
    CHECK(lost);
    CHECK(o.seconds < 25);
  }
}

}  // namespace

TEST_CASE("a rank killed while the others are joined, or killed inside join(): errors on every survivor, no hang") {
  kill_run<ring_tcp>(3, 2, 1, false, 0, "ring<tcp>: the last active rank dies, two ranks joined");
  kill_run<ring_tcp>(3, 0, 0, true, 1000, "ring<tcp>: a joined rank dies while two ranks train");
  kill_run<ddp::data_parallel>(3, 1, 2, false, 0, "data_parallel: the last active rank dies");
#ifdef DDP_TEST_HAS_SHM
  using ring_shm = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::shm>, ddp::shm_allocator>;
  kill_run<ring_shm>(3, 2, 1, false, 0, "ring<shm>: the last active rank dies, two ranks joined");
#endif
}
