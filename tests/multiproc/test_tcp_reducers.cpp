#include <doctest/doctest.h>

#include "harness.hpp"
#include "reducer_cases.hpp"

using namespace std::chrono_literals;
using namespace ddp_test;

// ring<tcp> and tree<tcp>: the cases of every reducer (reducer_cases.hpp), then tcp's own.
REDUCER_CASES(ddp::ring<ddp::tcp>, ddp::tree<ddp::tcp>);
TEST_CASE_TEMPLATE_INVOKE(allreduce_64mib, ddp::ring<ddp::tcp>, ddp::tree<ddp::tcp>);

TEST_CASE("a rank that comes late to a failed group still reports the failure, not 'rank 0 is lost'") {
  // Ranks 0 and 2 fail and leave while rank 1 sleeps (a loaded machine's slow rank, made
  // certain): rank 0 keeps its store up until rank 1 has read why, so rank 1 reports the
  // mismatch too, not the store that was gone when it came.
  auto outs = run_broadcast_dtype_mismatch<ddp::tree<ddp::tcp>>(reducer_opts, 3, 2, true, std::chrono::milliseconds(1500));
  INFO(summary(outs));
  for (auto& o : outs) CHECK(broadcast_dtype_mismatch_seen(o) == "");
  // Rank 0 left once rank 1 had read it, not at its bound: min(5 s, 10 s / 4) = 2.5 s from its
  // own failure, which comes about when rank 1 begins its 1.5 s sleep, so a rank 0 that waited
  // the bound out would end about 1 s after rank 1.
  CHECK(outs[0].seconds < outs[1].seconds + 0.8);
}

TEST_CASE("tree<tcp> with different small_bytes: mismatch naming both, never wrong data; segment_bytes may differ") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    auto outs = on_ranks(n, local_group{10s}, [&](int r, ddp::process_group& pg) {
      std::vector<float> x(1024, static_cast<float>(r + 1));
      ddp::tree<ddp::tcp> red{pg, ddp::reducer_options{.small_bytes = r == n - 1 ? std::size_t{8192} : std::size_t{1024}}};
      red.allreduce(std::span<float>(x), ddp::op::sum);
      for (float e : x) require(e == static_cast<float>(n * (n + 1) / 2), "wrong data without an error");  // not reached
    }, 30s);
    INFO(summary(outs));
    for (auto& o : outs) CHECK(ended_with(o, ddp::errc::mismatch, {"reducer mismatch", "small_bytes 8192", "small_bytes 1024"}) == "");
    for (auto& o : outs) CHECK(o.seconds < 12.0);
  }
  // segment_bytes does not change the ring's wire schedule: ranks may differ in it.
  expect_ok(on_ranks(3, local_group{10s}, [&](int r, ddp::process_group& pg) {
    ddp::ring<ddp::tcp> red{pg, ddp::reducer_options{.segment_bytes = r == 0 ? std::size_t{4096} : std::size_t{256 << 10}}};
    std::vector<float> x(100000, 1.0f);
    red.allreduce(std::span<float>(x), ddp::op::sum);
    for (float e : x) require(e == 3.0f, "segment_bytes differ");
  }, 30s));
}

TEST_CASE("every descriptor carries the algorithm and its variant; a difference is a mismatch naming both") {
  using namespace ddp::detail;
  coll_desc a;
  a.kind = coll_kind::allreduce;
  a.count = 1024;
  a.seq = 3;
  a.algo = coll_algo::tree;
  a.variant = coll_variant::recursive_doubling;
  coll_desc b = a;
  CHECK(mismatch(a, 0, b, 1).empty());
  b.variant = coll_variant::halving_doubling;
  auto why = mismatch(a, 0, b, 1);
  CHECK(why.find("rank 0 called allreduce #3 of 1024 x f32 sum by tree (recursive doubling)") != std::string::npos);
  CHECK(why.find("rank 1 called allreduce #3 of 1024 x f32 sum by tree (halving-doubling)") != std::string::npos);
  CHECK(why.find("small_bytes") != std::string::npos);
  b = a;
  b.algo = coll_algo::ring;
  b.variant = coll_variant::none;
  why = mismatch(a, 0, b, 1);
  CHECK(why.find("by ring,") == std::string::npos);
  CHECK(why.find("rank 1 called allreduce #3 of 1024 x f32 sum by ring") != std::string::npos);
  CHECK(why.find("same reducer") != std::string::npos);
}
