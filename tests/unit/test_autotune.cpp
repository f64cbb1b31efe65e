#include "ddp/data_parallel/autotune.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <string>
#include <vector>

#include "ddp/error.hpp"
#include "ddp/planner/size_planner.hpp"

namespace {

using namespace ddp::literals;

// n float32 parameters of `elems` elements each.
std::vector<ddp::param_info> params(std::size_t n, std::size_t elems) {
  return std::vector<ddp::param_info>(n, ddp::param_info{elems, ddp::dtype::f32, -1});
}

// Feeds `t` one figure per step for the current candidate from `ms_of(cap)` until measuring
// ends; returns the caps the steps ran with, in order.
template <class F>
std::vector<std::size_t> run(ddp::bucket_autotuner& t, F ms_of) {
  std::vector<std::size_t> ran;
  for (int guard = 0; guard < 1000 && !t.measuring_done(); ++guard) {
    ran.push_back(t.cap());
    t.record(ms_of(t.cap()));
  }
  return ran;
}

}  // namespace

TEST_CASE("autotune: the default candidates are 1 to 100 MiB, PyTorch's 25 MiB among them") {
  const auto caps = ddp::default_autotune_caps();
  CHECK(caps == std::vector<std::size_t>{1_MiB, 2_MiB, 4_MiB, 8_MiB, 16_MiB, 25_MiB, 50_MiB, 100_MiB});
  ddp::bucket_autotuner t({}, 3);
  CHECK(t.first_cap() == 1_MiB);
  CHECK(t.report().enabled);
  CHECK_FALSE(t.report().done);
  CHECK_FALSE(t.started());
}

TEST_CASE("autotune: with_cap sets the cap and keeps a smaller first bucket") {
  const ddp::bucket_policy base{};  // 25 MiB, first 1 MiB
  auto p = ddp::with_cap(base, 8_MiB);
  CHECK(p.cap_bytes == 8_MiB);
  CHECK(p.first_cap_bytes == 1_MiB);
  p = ddp::with_cap(base, 512_KiB);
  CHECK(p.cap_bytes == 512_KiB);
  CHECK(p.first_cap_bytes == 512_KiB);
}

TEST_CASE("autotune: caps above the model size give the same plan as a smaller one and are dropped") {
  // 10 parameters of 256 KiB: 2.5 MiB in all. 1 MiB: buckets of 4, 4 and 2 parameters; 2 MiB:
  // 4 (the 1 MiB first bucket) and 6; 4 MiB and up: the same 4 and 6, so they are dropped.
  const auto ps = params(10, 64 * 1024);
  const auto caps = ddp::distinct_caps(ddp::size_planner{}, ps, ddp::bucket_policy{}, {},
                                       {100_MiB, 4_MiB, 1_MiB, 2_MiB, 8_MiB, 4_MiB});
  CHECK(caps == std::vector<std::size_t>{1_MiB, 2_MiB});
  // The order matters to the plan but not to which caps differ here.
  std::vector<std::size_t> order{0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  CHECK(ddp::distinct_caps(ddp::size_planner{}, ps, ddp::bucket_policy{}, order, ddp::default_autotune_caps()) ==
        std::vector<std::size_t>{1_MiB, 2_MiB});
  // A first bucket as large as the rest changes which caps differ: 512 KiB, 1 MiB, 2 MiB, 4 MiB.
  CHECK(ddp::distinct_caps(ddp::size_planner{}, ps, ddp::bucket_policy{.first_cap_bytes = 100_MiB}, {},
                           {512_KiB, 1_MiB, 2_MiB, 4_MiB, 8_MiB}) ==
        std::vector<std::size_t>{512_KiB, 1_MiB, 2_MiB, 4_MiB});
  // A single candidate stays.
  CHECK(ddp::distinct_caps(ddp::size_planner{}, ps, ddp::bucket_policy{}, {}, {16_MiB}) ==
        std::vector<std::size_t>{16_MiB});
}

TEST_CASE("autotune: each candidate runs one unmeasured step then `steps` measured ones, ascending") {
  ddp::bucket_autotuner t({4_MiB, 1_MiB, 2_MiB}, 2);  // unsorted on purpose
  CHECK(t.first_cap() == 1_MiB);
  CHECK(t.cap() == 1_MiB);  // the first step, before start
  t.start({1_MiB, 2_MiB, 4_MiB}, {7, 4, 2});
  CHECK(t.started());
  CHECK(t.tuning_steps(3) == 1 + 3 * 3);
  int step = 0;
  std::vector<std::size_t> ran;
  std::vector<bool> switched;
  while (!t.measuring_done()) {
    ran.push_back(t.cap());
    switched.push_back(t.record(100.0 + step++));
  }
  CHECK(ran == std::vector<std::size_t>{1_MiB, 1_MiB, 1_MiB, 2_MiB, 2_MiB, 2_MiB, 4_MiB, 4_MiB, 4_MiB});
  CHECK(switched == std::vector<bool>{false, false, true, false, false, true, false, false, true});
  const auto& r = t.report();
  REQUIRE(r.candidates.size() == 3);
  // The first step of each candidate (100, 103, 106) is not recorded.
  CHECK(r.candidates[0].samples_ms == std::vector<double>{101, 102});
  CHECK(r.candidates[1].samples_ms == std::vector<double>{104, 105});
  CHECK(r.candidates[2].samples_ms == std::vector<double>{107, 108});
  CHECK(r.candidates[0].median_ms == doctest::Approx(101.5));
  CHECK(r.candidates[0].buckets == 7);
  CHECK(r.candidates[2].buckets == 2);
  CHECK(t.pick() == 1_MiB);
  // Recording after the end changes nothing.
  CHECK_FALSE(t.record(1.0));
  CHECK(r.candidates[2].samples_ms.size() == 2);
}

TEST_CASE("autotune: with several rounds the passes interleave and each candidate's median spans them") {
  ddp::bucket_autotuner t({1_MiB, 2_MiB}, 1, 3);
  t.start({1_MiB, 2_MiB}, {});
  CHECK(t.tuning_steps(2) == 1 + 3 * 2 * 2);
  int step = 0;
  std::vector<std::size_t> ran;
  while (!t.measuring_done()) {
    ran.push_back(t.cap());
    // A burst of load during the whole first visit of 2 MiB: one sample of three, outvoted.
    const double ms = t.cap() == 1_MiB ? 20.0 : (step < 4 ? 90.0 : 10.0);
    t.record(ms + step++ * 0.01);
  }
  CHECK(ran == std::vector<std::size_t>{1_MiB, 1_MiB, 2_MiB, 2_MiB, 1_MiB, 1_MiB, 2_MiB, 2_MiB, 1_MiB, 1_MiB, 2_MiB,
                                        2_MiB});
  REQUIRE(t.report().candidates.size() == 2);
  CHECK(t.report().candidates[0].samples_ms.size() == 3);
  CHECK(t.report().candidates[1].samples_ms.size() == 3);
  CHECK(t.report().candidates[1].samples_ms[0] == doctest::Approx(90.03));
  CHECK(t.report().candidates[1].median_ms == doctest::Approx(10.11));
  CHECK(t.pick() == 2_MiB);
  try {
    ddp::bucket_autotuner bad({}, 1, 0);
    FAIL("no error");
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::invalid_argument);
    CHECK(std::string(e.what()).find("autotune_rounds") != std::string::npos);
  }
}

TEST_CASE("autotune: the pick is the lowest median, robust to one slow outlier; ties go to the smaller cap") {
  ddp::bucket_autotuner t({}, 3);
  t.start({1_MiB, 2_MiB, 4_MiB, 8_MiB}, {});
  // 4 MiB is fastest (10 ms) but one of its steps hit a 500 ms stall: the median ignores it.
  int k = 0;
  run(t, [&](std::size_t cap) {
    ++k;
    if (cap == 4_MiB) return k % 4 == 2 ? 500.0 : 10.0;
    if (cap == 8_MiB) return 12.0;
    return 20.0;
  });
  CHECK(t.report().candidates[2].median_ms == doctest::Approx(10.0));
  CHECK(t.pick() == 4_MiB);

  ddp::bucket_autotuner tie({}, 1);
  tie.start({1_MiB, 2_MiB}, {});
  run(tie, [](std::size_t) { return 5.0; });
  CHECK(tie.pick() == 1_MiB);
}

TEST_CASE("autotune: decide adopts the cap it is given (rank 0's) and ends the tuning") {
  ddp::bucket_autotuner t({}, 1);
  t.start({1_MiB, 2_MiB}, {3, 2});
  run(t, [](std::size_t cap) { return cap == 1_MiB ? 3.0 : 4.0; });
  CHECK(t.pick() == 1_MiB);
  t.decide(2_MiB, 17);  // another rank's choice wins over this rank's own pick
  CHECK(t.done());
  CHECK(t.cap() == 2_MiB);
  CHECK(t.report().chosen_cap_bytes == 2_MiB);
  CHECK(t.report().decided_at_step == 17);
  const std::string log = ddp::bucket_autotuner::describe(t.report());
  CHECK(log.find("ddp: autotune: cap 1 MiB") != std::string::npos);
  CHECK(log.find("ddp: autotune: chose cap 2 MiB at step 17") != std::string::npos);
  CHECK(log.find("3.000") != std::string::npos);
  ddp::autotune_report small;
  small.candidates.push_back({8_KiB, 5, {1.0}, 1.0});
  small.chosen_cap_bytes = 512;
  const std::string log2 = ddp::bucket_autotuner::describe(small);
  CHECK(log2.find("cap 8 KiB") != std::string::npos);
  CHECK(log2.find("chose cap 512 B") != std::string::npos);
}

TEST_CASE("autotune: an empty candidate list after pruning still tries the first cap; zero steps is rejected") {
  ddp::bucket_autotuner t({3_MiB}, 1);
  t.start({}, {});
  CHECK(t.cap() == 3_MiB);
  run(t, [](std::size_t) { return 1.0; });
  CHECK(t.pick() == 3_MiB);
  try {
    ddp::bucket_autotuner bad({}, 0);
    FAIL("no error");
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::invalid_argument);
    CHECK(std::string(e.what()).find("autotune_steps") != std::string::npos);
  }
}

TEST_CASE("autotune: bucket_policy keeps its defaults and equality with the new knobs") {
  ddp::bucket_policy a{}, b{};
  CHECK_FALSE(a.autotune);
  CHECK(a.autotune_caps.empty());
  CHECK(a.autotune_steps == 2);
  CHECK(a.autotune_rounds == 2);
  CHECK(a == b);
  b.autotune = true;
  CHECK_FALSE(a == b);
  b = a;
  b.autotune_caps = {1_MiB};
  CHECK_FALSE(a == b);
}

TEST_CASE("autotune: steps or rounds too large to count are rejected, not wrapped around") {
  // skip + steps and rounds * candidates * (skip + steps) would wrap: a candidate would end
  // after one step with no sample, or measuring would count as done before it began.
  for (auto [steps, rounds] : {std::pair<std::size_t, std::size_t>{SIZE_MAX, 1}, {1, SIZE_MAX / 2 + 1},
                               {std::size_t{1} << 40, 1}, {1, std::size_t{1} << 40}}) {
    CAPTURE(steps);
    CAPTURE(rounds);
    try {
      ddp::bucket_autotuner bad({1_MiB, 2_MiB}, steps, rounds);
      FAIL("no error");
    } catch (const ddp::error& e) {
      CHECK(e.condition() == ddp::errc::invalid_argument);
      CHECK(std::string(e.what()).find(rounds > 1 ? "autotune_rounds" : "autotune_steps") != std::string::npos);
    }
  }
  // The largest accepted values still schedule every candidate in full.
  ddp::bucket_autotuner t({1_MiB, 2_MiB}, ddp::bucket_autotuner::max_steps, 1);
  t.start({1_MiB, 2_MiB}, {2, 1});
  CHECK_FALSE(t.measuring_done());
  CHECK_FALSE(t.record(1.0));  // the unmeasured step of candidate 0
  CHECK_FALSE(t.record(1.0));  // its first measured one: candidate 0 goes on
  CHECK(t.cap() == 1_MiB);
  CHECK(t.tuning_steps(8) == 1 + 8 * (1 + ddp::bucket_autotuner::max_steps));
}

TEST_CASE("autotune: the settings ranks compare are normalised as the tuner takes them, and exact") {
  ddp::bucket_policy a{.autotune = true, .autotune_caps = {4_MiB, 1_MiB, 4_MiB, 3_KiB}, .autotune_steps = 3,
                       .autotune_rounds = 2};
  ddp::bucket_policy b = a;
  b.autotune_caps = {1_MiB, 3_KiB, 4_MiB};  // the same candidates, in another order, each once
  CHECK(ddp::autotune_settings(a) == "autotune_caps [3 KiB, 1 MiB, 4 MiB], autotune_steps 3, autotune_rounds 2");
  CHECK(ddp::autotune_settings(a) == ddp::autotune_settings(b));
  CHECK(ddp::normalized_autotune_caps(a.autotune_caps) == std::vector<std::size_t>{3_KiB, 1_MiB, 4_MiB});
  // The tuner tries exactly these, smallest first.
  ddp::bucket_autotuner t(a.autotune_caps, 3, 2);
  CHECK(t.first_cap() == 3_KiB);
  // An empty list is the default candidates, written out.
  ddp::bucket_policy d{.autotune = true};
  ddp::bucket_policy e = d;
  e.autotune_caps = ddp::default_autotune_caps();
  CHECK(ddp::autotune_settings(d) == ddp::autotune_settings(e));
  CHECK(ddp::autotune_settings(d).find("[1 MiB, 2 MiB, 4 MiB, 8 MiB, 16 MiB, 25 MiB, 50 MiB, 100 MiB]") !=
        std::string::npos);
  // Caps one byte apart read differently (no rounding to a unit).
  b.autotune_caps = {1_MiB + 1, 3_KiB, 4_MiB};
  CHECK(ddp::autotune_settings(b) == "autotune_caps [3 KiB, 1048577 B, 4 MiB], autotune_steps 3, autotune_rounds 2");
  CHECK(ddp::exact_size(0) == "0 B");
}
