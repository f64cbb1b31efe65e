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

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "harness.hpp"

using namespace std::chrono_literals;
using namespace ddp_test;
using namespace ddp::literals;

namespace {

// 24 float32 parameters of 1 Ki elements (4 KiB each, 96 KiB in all).
constexpr std::size_t kParams = 24, kElems = 1024;

// Rank r's gradient for element j of parameter i in step s: multiples of 1/8, exact in f32.
float grad_value(int r, std::size_t i, std::size_t j, int s) {
  return static_cast<float>(static_cast<long>(((static_cast<std::size_t>(r) + 1) * 31 + i * 17 + j * 7 +
                                               static_cast<std::size_t>(s) * 13) % 97) -
                            48) /
         8.0f;
}

struct engine {
  std::vector<std::vector<float>> data, grad;
  std::vector<ddp::tensor_view> views;
  engine() : data(kParams, std::vector<float>(kElems, 1.0f)), grad(kParams, std::vector<float>(kElems, 0.0f)) {
    for (std::size_t i = 0; i < kParams; ++i)
      views.push_back(ddp::tensor_view{data[i].data(), grad[i].data(), kElems, ddp::dtype::f32, -1,
                                       "layer" + std::to_string(i), {static_cast<std::int64_t>(kElems)}});
  }
};

// One backward: writes (or adds) step s's gradients, hooks in a per-rank shuffled order near
// reverse registration order. `stall` sleeps after the last hook (a rank slow to reach
// finish()): its own figure (first grad_ready to finish() return) holds the stall, while its
// peers' do not, since the progress thread reduces its buckets meanwhile.
template <class DP>
void backward(DP& dp, engine& e, int r, int s, bool accumulate, std::chrono::milliseconds stall = 0ms) {
  std::vector<std::size_t> order(kParams);
  std::iota(order.rbegin(), order.rend(), std::size_t{0});
  std::mt19937_64 g(static_cast<std::uint64_t>(r * 1000 + s));
  for (std::size_t k = 0; k + 1 < order.size(); k += 2)
    if (g() % 2) std::swap(order[k], order[k + 1]);
  for (std::size_t k = 0; k < order.size(); ++k) {
    const std::size_t i = order[k];
    for (std::size_t j = 0; j < kElems; ++j) {
      const float v = grad_value(r, i, j, s);
      e.grad[i][j] = accumulate ? e.grad[i][j] + v : v;
    }
    dp.grad_ready(i);
  }
  if (stall.count() > 0) std::this_thread::sleep_for(stall);
}

// Every gradient is the average over the n ranks of the sum of steps `steps`' values.
void check_average(const engine& e, int n, const std::vector<int>& steps, const std::string& when) {
  for (std::size_t i = 0; i < kParams; ++i)
    for (std::size_t j = 0; j < kElems; ++j) {
      double sum = 0;
      for (int r = 0; r < n; ++r)
        for (int s : steps) sum += grad_value(r, i, j, s);
      const double want = sum / n;
      if (std::fabs(e.grad[i][j] - want) > 1e-5 * std::max(1.0, std::fabs(want)))
        throw std::runtime_error(when + ": parameter " + std::to_string(i) + " element " + std::to_string(j) + " is " +
                                 std::to_string(e.grad[i][j]) + ", expected " + std::to_string(want));
    }
}

// The report as a string, to compare across ranks.
std::string encode(const ddp::autotune_report& r) {
  std::string s = std::to_string(r.done) + " " + std::to_string(r.chosen_cap_bytes) + " " +
                  std::to_string(r.decided_at_step) + ";";
  for (const auto& c : r.candidates) {
    s += std::to_string(c.cap_bytes) + ":" + std::to_string(c.buckets) + ":" + std::to_string(c.median_ms) + "[";
    for (double v : c.samples_ms) s += std::to_string(v) + ",";
    s += "]";
  }
  return s;
}

const std::vector<std::size_t> kCaps = {8_KiB, 16_KiB, 32_KiB, 1_MiB, 2_MiB};  // 2 MiB: same plan as 1 MiB
constexpr std::size_t kDistinct = 4;

ddp::bucket_policy tuned(std::size_t steps = 2) {
  return ddp::bucket_policy{
      .first_cap_bytes = 4_KiB, .autotune = true, .autotune_caps = kCaps, .autotune_steps = steps, .autotune_rounds = 1};
}

// This rank's figure of its last step, as the autotune takes it: first grad_ready to finish() return.
template <class DP>
double figure(const DP& dp) {
  const auto& st = dp.last_step_stats();
  return st.backward_ms + st.exposed_ms;
}

// The slow rank's stall, sized from what a step takes on this machine now: the slowest rank's
// figure over a few untuned steps with the smallest candidate, the worst of them, times 5 (60 ms
// at least; 2 s at most, which keeps the ten stalled steps within the group's timeout), so that
// a busy machine's unstalled steps stay well below a stalled one. Every rank returns the same.
template <class Reducer, class Allocator, class... Args>
std::chrono::milliseconds measured_stall(ddp::process_group& pg, engine& e, int r, Args... reducer_args) {
  ddp::basic_data_parallel<ddp::size_planner, Reducer, Allocator> dp{
      pg, e.views, ddp::bucket_policy{.cap_bytes = kCaps.front(), .first_cap_bytes = 4_KiB}, {}, reducer_args...};
  double worst = 0;
  for (int s = 0; s < 5; ++s) {
    backward(dp, e, r, s, false);
    dp.finish();
    worst = std::max(worst, pg.all_reduce(figure(dp), ddp::op::max));
  }
  const auto stall = std::clamp<std::chrono::milliseconds>(
      std::chrono::milliseconds(static_cast<long>(std::ceil(5 * worst))), 60ms, 2000ms);
  if (r == 0) std::fprintf(stderr, "slowest untuned step %.3f ms: the slow rank stalls %lld ms\n", worst,
                           static_cast<long long>(stall.count()));
  return stall;
}

// Tunes on n ranks and checks every step's averages, the schedule, and that every rank ends on
// one plan and one choice, rank 0's. With `slow_rank` >= 0 that rank stalls (measured_stall)
// before finish() in every step except with the 16 KiB cap: only the maximum over the ranks
// puts the stall in the other candidates' figures and makes 16 KiB the winner.
template <class Reducer, class Allocator, class... Args>
void tune_run(int n, int slow_rank, Args... reducer_args) {
  expect_ok(on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
    engine e;
    const auto stall_ms = slow_rank >= 0 ? measured_stall<Reducer, Allocator>(pg, e, r, reducer_args...) : 0ms;
    ddp::basic_data_parallel<ddp::size_planner, Reducer, Allocator> dp{pg, e.views, tuned(), {}, reducer_args...};
    require(dp.autotune_report().enabled && !dp.autotune_report().done, "report: enabled, not done");
    require(dp.policy().cap_bytes == 8_KiB, "the first steps run with the smallest candidate");
    const int tuning = static_cast<int>(1 + kDistinct * (1 + 2));  // first step + per candidate (skip + 2)
    std::vector<std::size_t> caps_seen;
    int s = 0;
    for (int step = 0; step < tuning + 3; ++step, ++s) {
      const std::size_t cap = dp.policy().cap_bytes;
      caps_seen.push_back(cap);
      const auto stall = r == slow_rank && cap != 16_KiB ? stall_ms : 0ms;
      std::vector<int> in_step{s};
      if (step == 5) {
        // An accumulation step in the middle of tuning: not a tuning step, and its gradients
        // count in the next synchronized one.
        auto guard = dp.no_sync();
        backward(dp, e, r, s, false);
        dp.finish();
        ++s;
        in_step.push_back(s);
      }
      backward(dp, e, r, s, step == 5, stall);
      dp.finish();
      check_average(e, n, in_step, "step " + std::to_string(step) + " (cap " + std::to_string(cap) + ")");
      require(dp.autotune_report().done == (step >= tuning - 1),
              "done after step " + std::to_string(step) + ": " + std::to_string(dp.autotune_report().done));
    }
    const auto& rep = dp.autotune_report();
    require(rep.candidates.size() == kDistinct, "2 MiB gives 1 MiB's plan and is not tried: " + encode(rep));
    for (std::size_t k = 0; k < kDistinct; ++k) {
      require(rep.candidates[k].cap_bytes == kCaps[k], "candidates in ascending order");
      require(rep.candidates[k].samples_ms.size() == 2, "two measured steps per candidate");
    }
    require(rep.decided_at_step == static_cast<std::uint64_t>(tuning), "decided at the last tuning step: " + encode(rep));
    // Schedule: 1 + 3 steps of 8 KiB (the first step), 3 of each other cap, then the choice.
    std::vector<std::size_t> want(4, 8_KiB);
    for (std::size_t k = 1; k < kDistinct; ++k) want.insert(want.end(), 3, kCaps[k]);
    want.insert(want.end(), 3, rep.chosen_cap_bytes);
    require(caps_seen == want, "the caps the steps ran with");
    require(dp.policy().cap_bytes == rep.chosen_cap_bytes, "policy() shows the chosen cap");
    require(dp.layout_version() >= kDistinct - 1, "each tried layout bumps layout_version(): " + std::to_string(dp.layout_version()));
    if (slow_rank >= 0) {
      // Every figure of a stalled candidate is the slow rank's, stall and all (this rank's own,
      // where it is not the slow one, does not hold the stall); so 16 KiB wins.
      const std::string why = " (stall " + std::to_string(stall_ms.count()) + " ms): " + encode(rep);
      for (const auto& c : rep.candidates)
        for (double ms : c.samples_ms)
          if (c.cap_bytes != 16_KiB)
            require(ms >= static_cast<double>(stall_ms.count()), "a figure without the slowest rank's stall" + why);
      require(rep.chosen_cap_bytes == 16_KiB, "the slowest rank's figures decide" + why);
    }
    // One plan, one report, everywhere.
    const auto fps = pg.all_gather(std::to_string(dp.plan().fingerprint()));
    for (auto& f : fps) require(f == fps[0], "plan fingerprints agree after tuning");
    const auto reps = pg.all_gather(encode(rep));
    for (auto& x : reps) require(x == reps[0], "reports agree: " + x + " vs rank 0's " + reps[0]);
  }, 120s));
}

// Every rank constructs with its own (policy, options); all must fail with `code` naming `what`.
void expect_construction_error(int n, ddp::errc code, const std::string& what,
                               const std::function<ddp::bucket_policy(int)>& policy,
                               const std::function<ddp::dp_options(int)>& options) {
  expect_ok(on_ranks(n, local_group{10s}, [&](int r, ddp::process_group& pg) {
    engine e;
    try {
      ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, ddp::host_allocator> dp{pg, e.views, policy(r),
                                                                                               options(r)};
    } catch (const ddp::error& err) {
      require(err.condition() == code, std::string("errc of: ") + err.what());
      require(std::string(err.what()).find(what) != std::string::npos, std::string("message: ") + err.what());
      return;
    }
    throw std::runtime_error("construction succeeded");
  }, 30s));
}

}  // namespace

TEST_CASE("autotune over ring<tcp>: exact averages every step, one plan and rank 0's choice on 1 to 3 ranks") {
  tune_run<ddp::ring<ddp::tcp>, ddp::host_allocator>(1, -1);
  tune_run<ddp::ring<ddp::tcp>, ddp::host_allocator>(2, -1);
  tune_run<ddp::ring<ddp::tcp>, ddp::host_allocator>(3, -1);
}

TEST_CASE("autotune: the slowest rank's time decides (rank 1 stalls except with one cap)") {
  tune_run<ddp::ring<ddp::tcp>, ddp::host_allocator>(2, 1);
}

#ifdef DDP_TEST_HAS_SHM
TEST_CASE("autotune over ring<shm> with shm_allocator buckets, 2 and 3 ranks") {
  tune_run<ddp::ring<ddp::shm>, ddp::shm_allocator>(2, -1, ddp::shm_options{}, ddp::reducer_options{});
  tune_run<ddp::ring<ddp::shm>, ddp::shm_allocator>(3, 2, ddp::shm_options{}, ddp::reducer_options{});
}
#endif

TEST_CASE("autotune: ranks that disagree on it, or on its candidates, fail at construction naming it") {
  expect_construction_error(
      3, ddp::errc::mismatch, "bucket_policy::autotune: rank 0 has 1, rank 2 has 0",
      [](int r) { return r == 2 ? ddp::bucket_policy{} : tuned(); }, [](int) { return ddp::dp_options{}; });
  // The values, not a hash of them.
  expect_construction_error(
      2, ddp::errc::mismatch,
      "ranks disagree on bucket_policy::autotune_caps, autotune_steps and autotune_rounds: rank 0 has autotune_caps "
      "[8 KiB, 16 KiB, 32 KiB, 1 MiB, 2 MiB], autotune_steps 2, autotune_rounds 1; rank 1 has autotune_caps [8 KiB, "
      "16 KiB, 32 KiB, 1 MiB, 2 MiB], autotune_steps 3, autotune_rounds 1",
      [](int r) { return tuned(r == 0 ? 2 : 3); }, [](int) { return ddp::dp_options{}; });
  expect_construction_error(
      3, ddp::errc::mismatch, "rank 0 has autotune_caps [8 KiB, 16 KiB, 32 KiB, 1 MiB, 2 MiB], autotune_steps 2, "
      "autotune_rounds 1; rank 2 has autotune_caps [8 KiB, 16 KiB, 1 MiB, 2 MiB]",
      [](int r) {
        auto p = tuned();
        if (r == 2) p.autotune_caps = {8_KiB, 16_KiB, 1_MiB, 2_MiB};
        return p;
      },
      [](int) { return ddp::dp_options{}; });
}

TEST_CASE("autotune: candidate lists that differ only in order or repetition agree, and tune alike") {
  const int n = 2;
  expect_ok(on_ranks(n, local_group{10s}, [&](int r, ddp::process_group& pg) {
    engine e;
    auto policy = tuned();
    if (r == 1) policy.autotune_caps = {2_MiB, 32_KiB, 8_KiB, 1_MiB, 16_KiB, 8_KiB};  // the tuner sorts them
    ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, ddp::host_allocator> dp{pg, e.views, policy};
    require(dp.policy().cap_bytes == 8_KiB, "both start with the smallest candidate");
    // Construction agreed; the whole tuning runs in step on both ranks and ends on one choice.
    for (int s = 0; !dp.autotune_report().done && s < 40; ++s) {
      backward(dp, e, r, s, false);
      dp.finish();
      check_average(e, n, {s}, "step " + std::to_string(s));
    }
    const auto& rep = dp.autotune_report();
    require(rep.done && rep.candidates.size() == kDistinct, "tuned over the same candidates: " + encode(rep));
    const auto reps = pg.all_gather(encode(rep));
    require(reps[0] == reps[1], "reports agree: " + reps[1] + " vs rank 0's " + reps[0]);
  }, 30s));
}

TEST_CASE("autotune with view mode, uneven inputs or a caps list: a clear error on every rank") {
  expect_construction_error(
      2, ddp::errc::usage, "gradient_as_bucket_view", [](int) { return tuned(); },
      [](int) { return ddp::dp_options{.gradient_as_bucket_view = true}; });
  expect_construction_error(
      2, ddp::errc::mismatch, "dp_options::gradient_as_bucket_view: rank 0 has 0, rank 1 has 1",
      [](int) { return tuned(); }, [](int r) { return ddp::dp_options{.gradient_as_bucket_view = r == 1}; });
  expect_construction_error(
      2, ddp::errc::usage, "uneven_inputs", [](int) { return tuned(); },
      [](int) { return ddp::dp_options{.uneven_inputs = true}; });
  expect_construction_error(
      2, ddp::errc::invalid_argument, "bucket_policy::caps",
      [](int) {
        auto p = tuned();
        p.caps = {4_KiB, 8_KiB};
        return p;
      },
      [](int) { return ddp::dp_options{}; });
  expect_construction_error(
      2, ddp::errc::invalid_argument, "autotune_steps is 0", [](int) { return tuned(0); },
      [](int) { return ddp::dp_options{}; });
}

TEST_CASE("autotune: a peer killed during tuning is an error on the survivors, not a hang") {
  // Rank 2 dies at different points of the tuning: mid-backward, just before finish(), and
  // right after the finish() that switched from the first candidate to the second.
  for (int where : {0, 1, 2}) {
    CAPTURE(where);
    const int n = 3;
    const int port = free_port();
    const auto timeout = 3s;
    auto outs = run_ranks(n, [&](int r) {
      auto pg = ddp::init_process_group(group_options(r, n, port, timeout));
      engine e;
      ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, ddp::host_allocator> dp{pg, e.views, tuned()};
      const int die_at = 5;  // the second step of the 16 KiB candidate
      for (int s = 0; s < 20; ++s) {
        if (r == 2 && s == die_at && where == 0) {
          dp.grad_ready(kParams - 1);
          ::_exit(0);
        }
        const auto t0 = std::chrono::steady_clock::now();
        try {
          backward(dp, e, r, s, false);
          if (r == 2 && s == die_at && where == 1) ::_exit(0);
          dp.finish();
        } catch (const ddp::error& err) {
          const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          require(s >= (where == 2 ? die_at - 1 : die_at), std::string("failed before the peer died: ") + err.what());
          require(took < 2 * std::chrono::duration<double>(timeout).count() + 3,
                  "the error took " + std::to_string(took) + " s: " + err.what());
          require(err.condition() == ddp::errc::peer_lost || err.condition() == ddp::errc::aborted ||
                      err.condition() == ddp::errc::timeout,
                  std::string("errc: ") + err.what());
          bool again = false;
          try {
            dp.finish();
          } catch (const ddp::error&) {
            again = true;
          }
          require(again, "the wrapper stays failed");
          return;
        }
        if (r == 2 && s == die_at - 2 && where == 2) ::_exit(0);  // after step 3's finish (8 KiB -> 16 KiB)
        check_average(e, n, {s}, "step " + std::to_string(s));
      }
      if (r != 2) throw std::runtime_error("no error after the peer died");
    }, 60s);
    INFO(summary(outs));
    for (const auto& o : outs) {
      CHECK_MESSAGE(!o.timed_out, summary(outs));
      CHECK_MESSAGE(o.ok(), summary(outs));
    }
  }
}
