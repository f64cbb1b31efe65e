#include "ddp/planner/size_planner.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <numeric>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "ddp/planner/planner_concept.hpp"

using namespace ddp::literals;

namespace {

// A minimal planner satisfying the concept: everything in one bucket (wrong, but well-formed).
struct one_bucket_planner {
  ddp::bucket_plan plan(std::span<const ddp::param_info>, const ddp::bucket_policy&,
                        std::span<const std::size_t>) const {
    return {};
  }
};
struct no_plan_planner {};
struct wrong_result_planner {
  int plan(std::span<const ddp::param_info>, const ddp::bucket_policy&, std::span<const std::size_t>) const {
    return 0;
  }
};
static_assert(ddp::bucket_planner<ddp::size_planner>);
static_assert(ddp::bucket_planner<one_bucket_planner>);
static_assert(!ddp::bucket_planner<no_plan_planner>);
static_assert(!ddp::bucket_planner<wrong_result_planner>);

std::vector<ddp::param_info> f32s(std::initializer_list<std::size_t> numels) {
  std::vector<ddp::param_info> v;
  for (auto n : numels) v.push_back({n, ddp::dtype::f32, -1});
  return v;
}

std::vector<std::size_t> params_of(const ddp::bucket& b) {
  std::vector<std::size_t> out;
  for (const auto& e : b.entries) out.push_back(e.param);
  return out;
}

std::vector<std::vector<std::size_t>> layout(const ddp::bucket_plan& p) {
  std::vector<std::vector<std::size_t>> out;
  for (const auto& b : p.buckets) out.push_back(params_of(b));
  return out;
}

// Checks everything a correct plan must satisfy, whatever the policy.
void check_invariants(const ddp::bucket_plan& plan, std::span<const ddp::param_info> params,
                      const ddp::bucket_policy& policy, std::span<const std::size_t> order = {}) {
  const std::size_t n = params.size();
  std::vector<std::size_t> walk(n);
  if (order.empty()) {
    for (std::size_t i = 0; i < n; ++i) walk[i] = n - 1 - i;
  } else {
    walk.assign(order.begin(), order.end());
  }
  std::vector<std::size_t> pos(n);
  for (std::size_t k = 0; k < n; ++k) pos[walk[k]] = k;

  REQUIRE(plan.where.size() == n);
  std::vector<int> seen(n, 0);
  std::size_t prev_last = 0;
  for (std::size_t bi = 0; bi < plan.buckets.size(); ++bi) {
    const auto& b = plan.buckets[bi];
    REQUIRE(!b.entries.empty());
    std::size_t off = 0;
    std::size_t last = 0;
    for (std::size_t ei = 0; ei < b.entries.size(); ++ei) {
      const auto& e = b.entries[ei];
      REQUIRE(e.param < n);
      ++seen[e.param];
      CHECK(params[e.param].type == b.type);
      CHECK(params[e.param].device == b.device);
      CHECK(e.numel == params[e.param].numel);
      CHECK(e.offset_elems == off);  // packed, no padding
      CHECK(plan.where[e.param] == std::pair<std::size_t, std::size_t>{bi, ei});
      if (ei > 0) CHECK(pos[e.param] > pos[b.entries[ei - 1].param]);  // walk order within a bucket
      off += e.numel;
      last = std::max(last, pos[e.param]);
    }
    CHECK(b.numel == off);
    CHECK(b.bytes == off * ddp::dtype_size(b.type));
    if (bi > 0) CHECK(last > prev_last);  // launch order = completion order
    prev_last = last;
    if (b.entries.size() > 1) {
      // Only a lone oversized parameter may exceed the cap; caps are counted per kind.
      std::size_t k = 0;
      for (std::size_t j = 0; j < bi; ++j) {
        k += plan.buckets[j].type == b.type && plan.buckets[j].device == b.device;
      }
      CHECK(b.bytes <= policy.cap_for(k));
    }
  }
  for (std::size_t i = 0; i < n; ++i) CHECK(seen[i] == 1);
}

}  // namespace

TEST_CASE("literals and policy defaults") {
  CHECK(1_KiB == 1024);
  CHECK(25_MiB == 25u * 1024 * 1024);
  const ddp::bucket_policy p{};
  CHECK(p.cap_bytes == 25_MiB);
  CHECK(p.first_cap_bytes == 1_MiB);
  CHECK(p.rebuild_from_ready_order);
  CHECK(p == ddp::bucket_policy{.cap_bytes = 25_MiB, .first_cap_bytes = 1_MiB});
  CHECK(p != ddp::bucket_policy{.cap_bytes = 24_MiB});
  CHECK(p.cap_for(0) == 1_MiB);
  CHECK(p.cap_for(1) == 25_MiB);
  CHECK(p.cap_for(7) == 25_MiB);
  const ddp::bucket_policy q{.caps = {10, 20, 30}};
  CHECK(q.cap_for(0) == 10);
  CHECK(q.cap_for(2) == 30);
  CHECK(q.cap_for(9) == 30);
}

TEST_CASE("a cap of one element puts every parameter in its own bucket, last layer first") {
  const auto ps = f32s({1, 1, 1, 1});
  const ddp::bucket_policy pol{.cap_bytes = 4, .first_cap_bytes = 4};
  const auto plan = ddp::size_planner{}.plan(ps, pol);
  CHECK(layout(plan) == std::vector<std::vector<std::size_t>>{{3}, {2}, {1}, {0}});
  check_invariants(plan, ps, pol);

  const ddp::bucket_policy zero{.cap_bytes = 0, .first_cap_bytes = 0};
  const auto bigger = f32s({5, 7, 9});
  const auto plan0 = ddp::size_planner{}.plan(bigger, zero);
  CHECK(layout(plan0) == std::vector<std::vector<std::size_t>>{{2}, {1}, {0}});
}

TEST_CASE("a cap larger than the model gives one bucket in reverse registration order") {
  const auto ps = f32s({10, 20, 30});
  const ddp::bucket_policy pol{.cap_bytes = 1_MiB, .first_cap_bytes = 1_MiB};
  const auto plan = ddp::size_planner{}.plan(ps, pol);
  REQUIRE(plan.buckets.size() == 1);
  const auto& b = plan.buckets[0];
  CHECK(params_of(b) == std::vector<std::size_t>{2, 1, 0});
  CHECK(b.entries[0].offset_elems == 0);
  CHECK(b.entries[1].offset_elems == 30);
  CHECK(b.entries[2].offset_elems == 50);
  CHECK(b.numel == 60);
  CHECK(b.bytes == 240);
  CHECK(plan.where[0] == std::pair<std::size_t, std::size_t>{0, 2});
  check_invariants(plan, ps, pol);
}

TEST_CASE("the first bucket uses first_cap_bytes, later ones cap_bytes") {
  // Ten parameters of 400 bytes; first cap 400 bytes, then 1000 bytes.
  const auto ps = f32s({100, 100, 100, 100, 100, 100, 100, 100, 100, 100});
  const ddp::bucket_policy pol{.cap_bytes = 1000, .first_cap_bytes = 400};
  const auto plan = ddp::size_planner{}.plan(ps, pol);
  CHECK(layout(plan) ==
        std::vector<std::vector<std::size_t>>{{9}, {8, 7}, {6, 5}, {4, 3}, {2, 1}, {0}});
  CHECK(plan.buckets[0].bytes == 400);
  CHECK(plan.buckets[1].bytes == 800);
  check_invariants(plan, ps, pol);

  const ddp::bucket_policy explicit_caps{.caps = {400, 1200, 2000}};
  const auto plan2 = ddp::size_planner{}.plan(ps, explicit_caps);
  CHECK(layout(plan2) == std::vector<std::vector<std::size_t>>{{9}, {8, 7, 6}, {5, 4, 3, 2, 1}, {0}});
  check_invariants(plan2, ps, explicit_caps);
}

TEST_CASE("a parameter larger than the cap gets its own bucket") {
  const auto ps = f32s({10, 1000, 10, 10});
  const ddp::bucket_policy pol{.cap_bytes = 100, .first_cap_bytes = 100};
  const auto plan = ddp::size_planner{}.plan(ps, pol);
  CHECK(layout(plan) == std::vector<std::vector<std::size_t>>{{3, 2}, {1}, {0}});
  CHECK(plan.buckets[1].bytes == 4000);
  check_invariants(plan, ps, pol);
}

TEST_CASE("buckets never mix dtype or device") {
  std::vector<ddp::param_info> ps{
      {100, ddp::dtype::f32, -1},  // 0
      {100, ddp::dtype::f16, -1},  // 1
      {100, ddp::dtype::f32, 0},   // 2
      {100, ddp::dtype::f32, -1},  // 3
      {100, ddp::dtype::f16, -1},  // 4
      {100, ddp::dtype::f32, 0},   // 5
  };
  const ddp::bucket_policy pol{.cap_bytes = 1_MiB, .first_cap_bytes = 1_MiB};
  const auto plan = ddp::size_planner{}.plan(ps, pol);
  REQUIRE(plan.buckets.size() == 3);
  check_invariants(plan, ps, pol);
  // All stay open until the end; they complete when their last parameter (lowest index) arrives.
  CHECK(layout(plan) == std::vector<std::vector<std::size_t>>{{5, 2}, {4, 1}, {3, 0}});
  CHECK(plan.buckets[0].device == 0);
  CHECK(plan.buckets[1].type == ddp::dtype::f16);
  CHECK(plan.buckets[1].bytes == 400);
  CHECK(plan.buckets[2].type == ddp::dtype::f32);
  CHECK(plan.buckets[2].device == -1);

  // Caps count per kind: each kind's first bucket is small.
  const ddp::bucket_policy small_first{.cap_bytes = 1_MiB, .first_cap_bytes = 200};
  const auto plan2 = ddp::size_planner{}.plan(ps, small_first);
  check_invariants(plan2, ps, small_first);
  CHECK(layout(plan2) == std::vector<std::vector<std::size_t>>{{5}, {4}, {3}, {2}, {1}, {0}});
}

TEST_CASE("a custom order is followed and decides the launch order") {
  const auto ps = f32s({100, 100, 100, 100});
  const ddp::bucket_policy pol{.cap_bytes = 800, .first_cap_bytes = 400};
  const std::vector<std::size_t> order{1, 3, 0, 2};
  const auto plan = ddp::size_planner{}.plan(ps, pol, order);
  CHECK(layout(plan) == std::vector<std::vector<std::size_t>>{{1}, {3, 0}, {2}});
  check_invariants(plan, ps, pol, order);
  CHECK(plan != ddp::size_planner{}.plan(ps, pol));
}

TEST_CASE("an order that is not a permutation is rejected") {
  const auto ps = f32s({1, 2, 3});
  const ddp::bucket_policy pol{};
  const auto message_of = [&](std::vector<std::size_t> order) -> std::string {
    try {
      (void)ddp::size_planner{}.plan(ps, pol, order);
    } catch (const ddp::error& e) {
      CHECK(e.condition() == ddp::errc::invalid_argument);
      return e.what();
    }
    return "no error";
  };
  CHECK(message_of({0, 1}).find("2 entries for 3 parameters") != std::string::npos);
  CHECK(message_of({0, 1, 2, 0}).find("4 entries for 3 parameters") != std::string::npos);
  CHECK(message_of({0, 5, 1}).find("names parameter 5") != std::string::npos);
  CHECK(message_of({2, 0, 2}).find("parameter 2 appears twice") != std::string::npos);
  CHECK(message_of({2, 0, 1}) == "no error");
}

TEST_CASE("empty model and zero-sized parameters") {
  const std::vector<ddp::param_info> none;
  const auto plan = ddp::size_planner{}.plan(none, ddp::bucket_policy{});
  CHECK(plan.buckets.empty());
  CHECK(plan.where.empty());
  const auto ps = f32s({0, 4, 0});
  const auto plan2 = ddp::size_planner{}.plan(ps, ddp::bucket_policy{});
  check_invariants(plan2, ps, ddp::bucket_policy{});
  CHECK(plan2.buckets.size() == 1);
  CHECK(plan2.buckets[0].numel == 4);
}

TEST_CASE("planning is deterministic and the fingerprint tells plans apart") {
  std::mt19937 rng(1234);
  std::vector<ddp::param_info> ps;
  const ddp::dtype types[] = {ddp::dtype::f32, ddp::dtype::bf16, ddp::dtype::f64};
  for (int i = 0; i < 300; ++i) {
    ps.push_back({static_cast<std::size_t>(rng() % 50000), types[rng() % 3], static_cast<int>(rng() % 2) - 1});
  }
  std::vector<std::size_t> order(ps.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::shuffle(order.begin(), order.end(), rng);
  const ddp::bucket_policy pol{.cap_bytes = 256_KiB, .first_cap_bytes = 16_KiB};

  const auto a = ddp::size_planner{}.plan(ps, pol, order);
  const auto b = ddp::size_planner{}.plan(ps, pol, order);
  CHECK(a == b);
  CHECK(a.fingerprint() == b.fingerprint());
  check_invariants(a, ps, pol, order);

  const auto c = ddp::size_planner{}.plan(ps, pol);
  check_invariants(c, ps, pol);
  CHECK(a != c);
  CHECK(a.fingerprint() != c.fingerprint());

  auto d = a;
  d.buckets.back().device = d.buckets.back().device >= 0 ? -1 : 7;  // host <-> device
  CHECK(d.fingerprint() != a.fingerprint());
  auto e = a;
  e.buckets.back().type = e.buckets.back().type == ddp::dtype::f64 ? ddp::dtype::f32 : ddp::dtype::f64;
  CHECK(e.fingerprint() != a.fingerprint());
  auto f = a;
  f.buckets.back().numel += 1;
  CHECK(f.fingerprint() != a.fingerprint());
  CHECK(ddp::bucket_plan{}.fingerprint() != a.fingerprint());
}

TEST_CASE("the fingerprint compares host or device, not the device index (one GPU per rank)") {
  // Rank r keeps its device parameters on device r (device = local rank): same plan structure.
  const auto params_on = [](int dev) {
    return std::vector<ddp::param_info>{{100, ddp::dtype::f32, dev}, {300, ddp::dtype::f16, -1},
                                        {50, ddp::dtype::f32, dev},  {70, ddp::dtype::f16, dev}};
  };
  const ddp::bucket_policy pol{.cap_bytes = 1_MiB, .first_cap_bytes = 256};
  const auto p0 = ddp::size_planner{}.plan(params_on(0), pol);
  check_invariants(p0, params_on(0), pol);
  for (int dev = 1; dev < 8; ++dev) {
    CAPTURE(dev);
    const auto p = ddp::size_planner{}.plan(params_on(dev), pol);
    check_invariants(p, params_on(dev), pol);
    CHECK(p.fingerprint() == p0.fingerprint());
    for (const auto& bk : p.buckets) CHECK((bk.device == -1 || bk.device == dev));
  }
  // Host instead of device is a different plan.
  const auto host = ddp::size_planner{}.plan(params_on(-1), pol);
  CHECK(host.fingerprint() != p0.fingerprint());
  // Within one rank, buckets still never mix devices: two devices make more buckets, and a
  // different structure.
  std::vector<ddp::param_info> two{{100, ddp::dtype::f32, 0}, {100, ddp::dtype::f32, 1}, {100, ddp::dtype::f32, 0}};
  std::vector<ddp::param_info> one{{100, ddp::dtype::f32, 1}, {100, ddp::dtype::f32, 1}, {100, ddp::dtype::f32, 1}};
  const ddp::bucket_policy big{.cap_bytes = 1_MiB, .first_cap_bytes = 1_MiB};
  const auto p2 = ddp::size_planner{}.plan(two, big);
  const auto p1 = ddp::size_planner{}.plan(one, big);
  check_invariants(p2, two, big);
  CHECK(p2.buckets.size() == 2);
  for (const auto& bk : p2.buckets)
    for (const auto& en : bk.entries) CHECK(two[en.param].device == bk.device);
  CHECK(p1.buckets.size() == 1);
  CHECK(p2.fingerprint() != p1.fingerprint());
}

TEST_CASE("real model shapes from tests/data") {
  for (const std::string model : {"resnet50", "bert_base"}) {
    const std::string path = std::string(DDP_TEST_DATA) + "/" + model + ".params";
    std::ifstream in(path);
    INFO(path);
    REQUIRE(in);
    std::vector<ddp::param_info> ps;
    std::size_t model_bytes = 0;
    std::size_t max_param = 0;
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty() || line[0] == '#') continue;
      std::istringstream ls(line);
      std::string name;
      ls >> name;
      std::size_t numel = 1;
      std::size_t d = 0;
      while (ls >> d) numel *= d;
      ps.push_back({numel, ddp::dtype::f32, -1});
      model_bytes += numel * 4;
      max_param = std::max(max_param, numel * 4);
    }
    CAPTURE(model);
    REQUIRE(!ps.empty());
    if (model == "resnet50") {
      CHECK(ps.size() == 161);
      CHECK(model_bytes == 25557032u * 4);
    }
    for (const auto& pol : {ddp::bucket_policy{}, ddp::bucket_policy{.cap_bytes = 4_MiB, .first_cap_bytes = 256_KiB},
                            ddp::bucket_policy{.cap_bytes = 1, .first_cap_bytes = 1}}) {
      const auto plan = ddp::size_planner{}.plan(ps, pol);
      check_invariants(plan, ps, pol);
      std::size_t sum = 0;
      for (const auto& b : plan.buckets) sum += b.bytes;
      CHECK(sum == model_bytes);
      // Caps bound every bucket that holds more than one parameter, so when no parameter exceeds
      // cap_bytes at least this many buckets are needed.
      if (pol.cap_bytes >= max_param) {
        const std::size_t first = std::min(model_bytes, std::max(pol.first_cap_bytes, max_param));
        CHECK(plan.buckets.size() >= 1 + (model_bytes - first) / pol.cap_bytes);
      }
      if (pol.cap_bytes == 1) CHECK(plan.buckets.size() == ps.size());
      MESSAGE(model << ": cap " << pol.cap_bytes << " -> " << plan.buckets.size() << " buckets");
    }
  }
}
