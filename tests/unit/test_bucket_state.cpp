#include "ddp/data_parallel/bucket_state.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "dp_plan.hpp"

namespace {

struct recorder {
  std::vector<std::size_t> launched;
  ddp::bucket_state::launch_fn fn() {
    return [this](std::size_t b) { launched.push_back(b); };
  }
};

}  // namespace

TEST_CASE("bucket_state: a bucket launches when its last gradient arrives, in plan order") {
  const auto plan = dp_test::three_buckets();
  recorder rec;
  ddp::bucket_state st{4, rec.fn()};
  st.reset(plan, false);
  CHECK(st.pending(0) == 2);
  CHECK(st.pending(1) == 1);
  REQUIRE(st.open(true));
  REQUIRE(st.claim(3));
  st.complete(3, true);
  CHECK(st.pending(0) == 1);
  CHECK(rec.launched.empty());
  REQUIRE(st.claim(2));
  st.complete(2, true);
  CHECK(rec.launched == std::vector<std::size_t>{0});
  REQUIRE(st.claim(1));
  st.complete(1, true);
  REQUIRE(st.claim(0));
  st.complete(0, true);
  CHECK(rec.launched == std::vector<std::size_t>{0, 1, 2});
  CHECK(st.launched() == 3);
  CHECK(st.missing().empty());
}

TEST_CASE("bucket_state: gradients out of order still launch buckets in plan order") {
  const auto plan = dp_test::three_buckets();
  recorder rec;
  ddp::bucket_state st{4, rec.fn()};
  st.reset(plan, false);
  st.open(true);
  // Buckets 2 and 1 become complete first, but bucket 0 has not launched: they wait.
  for (std::size_t i : {0u, 1u, 3u}) {
    REQUIRE(st.claim(i));
    st.complete(i, true);
  }
  CHECK(st.pending(2) == 0);
  CHECK(st.pending(1) == 0);
  CHECK(st.pending(0) == 1);
  CHECK(rec.launched.empty());
  CHECK(st.missing() == std::vector<std::size_t>{2});
  REQUIRE(st.claim(2));
  st.complete(2, true);
  CHECK(rec.launched == std::vector<std::size_t>{0, 1, 2});
}

TEST_CASE("bucket_state: a gradient marked twice is refused, and a new step accepts it again") {
  const auto plan = dp_test::three_buckets();
  recorder rec;
  ddp::bucket_state st{4, rec.fn()};
  st.reset(plan, false);
  CHECK(st.claim(1));
  CHECK_FALSE(st.claim(1));
  st.set_unused(2);
  CHECK(st.claim(2));
  CHECK_FALSE(st.claim(2));
  CHECK(st.unused(2));
  CHECK_FALSE(st.unused(1));
  st.reset(plan, false);
  CHECK(st.claim(1));
  CHECK_FALSE(st.unused(2));
}

TEST_CASE("bucket_state: an unsynchronized step launches nothing and keeps its mode") {
  const auto plan = dp_test::three_buckets();
  recorder rec;
  ddp::bucket_state st{4, rec.fn()};
  st.reset(plan, true);
  CHECK_FALSE(st.open(false));
  CHECK(st.is_open());
  CHECK_FALSE(st.open(true));  // a step keeps the mode it opened with
  for (std::size_t i : {2u, 3u, 1u, 0u}) {
    REQUIRE(st.claim(i));
    st.complete(i, false);
  }
  CHECK(rec.launched.empty());
  CHECK(st.pending(0) == 2);
  CHECK(st.order() == std::vector<std::size_t>{2, 3, 1, 0});  // recorded for the rebuild
  st.set_accumulated(2);
  const auto stats = st.stats(5, std::chrono::steady_clock::now(), std::chrono::steady_clock::now());
  CHECK(stats.step == 5);
  CHECK_FALSE(stats.synchronized);
  CHECK(stats.buckets.empty());
  st.reset(plan, false);
  CHECK_FALSE(st.is_open());
  CHECK(st.open(true));
  CHECK(st.accumulated(2));  // kept until the synchronized step has averaged it
  CHECK_FALSE(st.accumulated(1));
  st.clear_accumulated();
  CHECK_FALSE(st.accumulated(2));
}

TEST_CASE("bucket_state: statistics count bytes, unused parameters and launches before finish") {
  const auto plan = dp_test::three_buckets();
  recorder rec;
  ddp::bucket_state st{4, rec.fn()};
  st.reset(plan, false);
  const auto t0 = std::chrono::steady_clock::now();
  st.open(true, t0);
  for (std::size_t i : {3u, 2u}) {
    st.claim(i);
    st.complete(i, true);
  }
  st.begin_finish();
  for (std::size_t i : st.missing()) {  // finish() fills in the rest as unused
    st.claim(i);
    st.set_unused(i);
    st.complete(i, true, false);
  }
  st.launch_ready();
  const auto now = std::chrono::steady_clock::now();
  for (std::size_t b = 0; b < 3; ++b) st.set_reduced(b, now);
  const auto stats = st.stats(0, now, now);
  CHECK(stats.synchronized);
  CHECK(stats.bytes_reduced == 64);
  CHECK(stats.unused == 2);
  CHECK(stats.launched_before_finish == 1);
  REQUIRE(stats.buckets.size() == 3);
  CHECK(stats.buckets[0].bytes == 32);
  CHECK(stats.buckets[0].parameters == 2);
  CHECK(stats.buckets[2].launch_ms >= stats.buckets[0].launch_ms);
  CHECK(rec.launched == std::vector<std::size_t>{0, 1, 2});
}

TEST_CASE("bucket_state: hooks on many threads launch every bucket once, in plan order") {
  // 64 parameters, one bucket per 4 of them, completed by 8 threads in an interleaved order.
  ddp::bucket_plan plan;
  const std::size_t n = 64;
  plan.where.resize(n);
  for (std::size_t b = 0; b < n / 4; ++b) {
    ddp::bucket bk{ddp::dtype::f32, -1, 4, 16, {}};
    for (std::size_t k = 0; k < 4; ++k) {
      const std::size_t p = n - 1 - (b * 4 + k);
      plan.where[p] = {b, k};
      bk.entries.push_back({p, k, 1});
    }
    plan.buckets.push_back(bk);
  }
  for (int round = 0; round < 20; ++round) {
    std::vector<std::size_t> launched;  // under the state's lock
    ddp::bucket_state st{n, [&](std::size_t b) { launched.push_back(b); }};
    st.reset(plan, false);
    st.open(true);
    std::vector<std::thread> ts;
    for (std::size_t t = 0; t < 8; ++t)
      ts.emplace_back([&, t] {
        for (std::size_t i = t; i < n; i += 8)
          if (st.claim(i)) st.complete(i, true);
      });
    for (auto& t : ts) t.join();
    std::vector<std::size_t> want(n / 4);
    std::iota(want.begin(), want.end(), 0);
    REQUIRE(launched == want);
  }
}

TEST_CASE("bucket_state: a synchronized step calls on_sync_open once, before its first launch") {
  const auto plan = dp_test::three_buckets();
  std::vector<std::string> events;
  ddp::bucket_state st{4, [&](std::size_t b) { events.push_back("launch " + std::to_string(b)); },
                       [&] { events.push_back("open"); }};
  st.reset(plan, false);
  REQUIRE(st.open(true));
  REQUIRE(st.open(true));  // already open: not again
  for (std::size_t i = 4; i-- > 0;) {
    REQUIRE(st.claim(i));
    st.complete(i, true);
  }
  CHECK(events == std::vector<std::string>{"open", "launch 0", "launch 1", "launch 2"});
  events.clear();
  st.reset(plan, false);
  REQUIRE_FALSE(st.open(false));  // an unsynchronized step: nothing to precede
  CHECK(events.empty());
}

TEST_CASE("bucket_state: nothing_new tells a doubled finish() from a step that has something to reduce") {
  const auto plan = dp_test::three_buckets();
  recorder rec;
  ddp::bucket_state st{4, rec.fn()};
  st.reset(plan, false);
  CHECK_FALSE(st.nothing_new(0, true));  // the first step: not a second finish()
  CHECK(st.nothing_new(1, true));        // after a step, no hook yet
  CHECK_FALSE(st.nothing_new(1, false));  // under no_sync() a finish() only resets
  st.open(true);
  CHECK_FALSE(st.nothing_new(1, true));  // a hook opened the step
  st.reset(plan, false);
  st.set_accumulated(2);                 // a no_sync() step accumulated parameter 2
  CHECK_FALSE(st.nothing_new(1, true));
  st.clear_accumulated();
  CHECK(st.nothing_new(1, true));
}
