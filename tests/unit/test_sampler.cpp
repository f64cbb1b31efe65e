#include <ddp/sampler.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <numeric>
#include <ranges>
#include <set>
#include <string>
#include <vector>

using ddp::distributed_sampler;
using ddp::sampler_options;
using index_list = std::vector<std::uint64_t>;

static_assert(std::ranges::random_access_range<const distributed_sampler>);
static_assert(std::ranges::sized_range<const distributed_sampler>);

namespace {
std::vector<index_list> shares(std::uint64_t n, int world, sampler_options o, std::uint64_t epoch = 0) {
  std::vector<index_list> out;
  for (int r = 0; r < world; ++r) {
    distributed_sampler s{n, r, world, o};
    s.set_epoch(epoch);
    out.push_back(s.indices());
  }
  return out;
}

// The order the shares were cut from: position rank + i * world holds share[rank][i].
index_list interleave(const std::vector<index_list>& sh) {
  index_list all;
  const std::size_t per = sh.empty() ? 0 : sh[0].size();
  for (std::size_t i = 0; i < per; ++i)
    for (const auto& s : sh) all.push_back(s.at(i));
  return all;
}

struct group_like {
  int r, n;
  int rank() const { return r; }
  int size() const { return n; }
};

std::string what_of(std::uint64_t n, int rank, int world, sampler_options o = {}) {
  try {
    distributed_sampler s{n, rank, world, o};
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::invalid_argument);
    return e.what();
  }
  return "(no error)";
}
}  // namespace

TEST_CASE("shuffle = false lays indices out exactly as PyTorch's DistributedSampler") {
  // list(DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=False, drop_last=d))
  // for every rank, as PyTorch 1.13 computes them.
  struct want {
    std::uint64_t n;
    int world;
    bool drop_last;
    std::vector<index_list> per_rank;
  };
  const std::vector<want> cases = {
      {10, 4, false, {{0, 4, 8}, {1, 5, 9}, {2, 6, 0}, {3, 7, 1}}},
      {10, 4, true, {{0, 4}, {1, 5}, {2, 6}, {3, 7}}},
      {3, 5, false, {{0}, {1}, {2}, {0}, {1}}},
      {3, 5, true, {{}, {}, {}, {}, {}}},
      {0, 3, false, {{}, {}, {}}},
      {5, 1, false, {{0, 1, 2, 3, 4}}},
      {7, 3, false, {{0, 3, 6}, {1, 4, 0}, {2, 5, 1}}},
      {7, 3, true, {{0, 3}, {1, 4}, {2, 5}}},
      {2, 7, false, {{0}, {1}, {0}, {1}, {0}, {1}, {0}}},
  };
  for (const auto& c : cases) {
    CAPTURE(c.n);
    CAPTURE(c.world);
    CAPTURE(c.drop_last);
    const auto got = shares(c.n, c.world, {.shuffle = false, .drop_last = c.drop_last});
    CHECK(got == c.per_rank);
    distributed_sampler s{c.n, 0, c.world, {.shuffle = false, .drop_last = c.drop_last}};
    CHECK(s.size() == c.per_rank[0].size());
    CHECK(s.total_size() == c.per_rank[0].size() * static_cast<std::uint64_t>(c.world));
  }
}

TEST_CASE("the defaults are PyTorch's: shuffle, seed 0, padding") {
  const sampler_options o;
  CHECK(o.shuffle);
  CHECK(o.seed == 0);
  CHECK_FALSE(o.drop_last);
}

TEST_CASE("padding gives every rank ceil(n / world), drop_last floor(n / world); shares are disjoint and cover") {
  for (std::uint64_t n : {0u, 1u, 2u, 3u, 7u, 10u, 64u, 97u, 1000u}) {
    for (int world : {1, 2, 3, 4, 7, 8, 13}) {
      for (bool shuffle : {false, true}) {
        CAPTURE(n);
        CAPTURE(world);
        CAPTURE(shuffle);
        const auto w = static_cast<std::uint64_t>(world);
        // Padding: the first n positions of the order are a permutation of [0, n), the rest
        // repeats the order from its start.
        const auto padded = shares(n, world, {.shuffle = shuffle, .seed = 5, .drop_last = false}, 3);
        for (const auto& s : padded) CHECK(s.size() == (n + w - 1) / w);
        const auto order = interleave(padded);
        REQUIRE(order.size() == ((n + w - 1) / w) * w);
        index_list head(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(std::min<std::uint64_t>(n, order.size())));
        std::sort(head.begin(), head.end());
        index_list iota(n);
        std::iota(iota.begin(), iota.end(), 0u);
        CHECK(head == iota);
        for (std::size_t p = n; p < order.size(); ++p) CHECK(order[p] == order[p % n]);
        // Dropping: floor(n / world) each, all distinct.
        const auto dropped = shares(n, world, {.shuffle = shuffle, .seed = 5, .drop_last = true}, 3);
        std::set<std::uint64_t> seen;
        for (const auto& s : dropped) {
          CHECK(s.size() == n / w);
          for (auto i : s) {
            CHECK(i < n);
            CHECK(seen.insert(i).second);
          }
        }
        CHECK(seen.size() == (n / w) * w);
        // The dropped order is the padded order cut at world * floor(n / world).
        const auto cut = interleave(dropped);
        CHECK(std::equal(cut.begin(), cut.end(), order.begin()));
      }
    }
  }
}

TEST_CASE("the shuffle is fixed by seed + epoch: the same on every rank and every run, new each epoch") {
  // The generators, against the reference outputs of Vigna's splitmix64.c and an independent
  // implementation of xoshiro256** seeded from it.
  ddp::splitmix64 sm{0};
  CHECK(sm() == 0xe220a8397b1dcdafull);
  CHECK(sm() == 0x6e789e6aa1b965f4ull);
  CHECK(sm() == 0x06c45d188009454full);
  ddp::xoshiro256ss x{0};
  CHECK(x() == 0x99ec5f36cb75f2b4ull);
  CHECK(x() == 0xbf6e1f784956452aull);
  CHECK(x() == 0x1a5f849d4933e6e0ull);

  // The documented Fisher-Yates shuffle, pinned: a change of the order is a change of format.
  CHECK(distributed_sampler(10, 0, 1, {.seed = 0}).indices() == index_list{4, 2, 1, 7, 5, 6, 3, 9, 8, 0});
  CHECK(distributed_sampler(10, 0, 1, {.seed = 1}).indices() == index_list{3, 8, 0, 9, 2, 5, 6, 4, 1, 7});
  distributed_sampler e3{10, 0, 1, {.seed = 42}};
  e3.set_epoch(3);  // seed + epoch = 45
  CHECK(e3.indices() == index_list{7, 1, 4, 9, 6, 5, 0, 2, 3, 8});
  // As PyTorch's: the generator is seeded with seed + epoch.
  distributed_sampler s1e0{10, 0, 1, {.seed = 1}}, s0e1{10, 0, 1, {.seed = 0}};
  s0e1.set_epoch(1);
  CHECK(s1e0.indices() == s0e1.indices());

  // Every rank cuts its share from the same permutation: the interleaved shares are one.
  const std::uint64_t n = 1000;
  const auto a = interleave(shares(n, 4, {.seed = 7}, 2));
  CHECK(a == interleave(shares(n, 4, {.seed = 7}, 2)));        // deterministic
  distributed_sampler one{n, 0, 1, {.seed = 7}};
  one.set_epoch(2);
  CHECK(a == one.indices());                                     // world 4 cuts world 1's order

  // A new epoch or seed gives a new order; going back gives the old one again.
  distributed_sampler s{n, 1, 4, {.seed = 7}};
  s.set_epoch(2);
  const auto e2 = s.indices();
  s.set_epoch(4);
  const auto e4 = s.indices();
  CHECK(e2 != e4);
  CHECK(s.epoch() == 4);
  s.set_epoch(2);
  CHECK(s.indices() == e2);
  CHECK(interleave(shares(n, 4, {.seed = 8}, 2)) != a);
  // Without shuffle, epochs do not matter.
  distributed_sampler plain{n, 1, 4, {.shuffle = false}};
  const auto p0 = plain.indices();
  plain.set_epoch(9);
  CHECK(plain.indices() == p0);
}

TEST_CASE("huge datasets: sizes and positions do not overflow 64 bits") {
  constexpr std::uint64_t n = std::numeric_limits<std::uint64_t>::max();
  // n = 6k + 3: ceil(n / 6) * 6 = n + 3 does not fit in 64 bits; ranks 3, 4, 5 wrap around.
  const std::uint64_t per = 3074457345618258603ull;  // ceil((2^64 - 1) / 6)
  const std::uint64_t want_last[6] = {n - 3, n - 2, n - 1, 0, 1, 2};
  for (int r = 0; r < 6; ++r) {
    CAPTURE(r);
    distributed_sampler s{n, r, 6, {.shuffle = false}};
    CHECK(s.size() == per);
    CHECK(s[per - 1] == want_last[r]);
    CHECK(*(s.end() - 1) == want_last[r]);
    CHECK(s[0] == static_cast<std::uint64_t>(r));
    CHECK(s.total_size() == n);  // saturated: the true total, n + 3, does not fit
  }
  distributed_sampler d{n, 5, 6, {.shuffle = false, .drop_last = true}};
  CHECK(d.size() == n / 6);
  CHECK(d[d.size() - 1] == 5 + (n / 6 - 1) * 6);
  // A shuffled order of 2^64 - 1 samples cannot be held: said at once, nothing allocated.
  CHECK(what_of(n, 0, 2, {.shuffle = true}).find("does not fit in memory") != std::string::npos);
}

TEST_CASE("bad arguments are errc::invalid_argument that say what is wrong") {
  CHECK(what_of(10, 0, 0) == "[ddp.invalid_argument] rank 0: distributed_sampler: world size 0 (must be at least 1)");
  CHECK(what_of(10, 4, 4) == "[ddp.invalid_argument] rank 4: distributed_sampler: rank 4 is outside [0, 4)");
  CHECK(what_of(10, -1, 4).find("distributed_sampler: rank -1 is outside [0, 4)") != std::string::npos);
}

TEST_CASE("a group gives rank and world size; the sampler iterates and indexes like a range") {
  distributed_sampler s{group_like{2, 4}, 10, {.shuffle = false}};
  CHECK(s.rank() == 2);
  CHECK(s.world_size() == 4);
  index_list seen;
  for (std::uint64_t i : s) seen.push_back(i);
  CHECK(seen == index_list{2, 6, 0});
  CHECK(std::ranges::distance(s) == 3);
  CHECK(std::ranges::equal(s | std::views::reverse, index_list{0, 6, 2}));
  auto it = s.begin();
  CHECK(it[1] == 6);
  CHECK(*(it + 2) == 0);
  CHECK(s.end() - s.begin() == 3);
  CHECK(!s.empty());
  CHECK(distributed_sampler(0, 0, 3).empty());
  CHECK(distributed_sampler(0, 0, 3).begin() == distributed_sampler(0, 0, 3).end());
}

TEST_CASE("resume deals the rest of an epoch over a new world: nothing skipped, nothing seen twice") {
  const std::uint64_t n = 1000, b = 7;
  for (const bool shuffle : {false, true}) {
    std::vector<int> seen(n, 0);
    std::uint64_t consumed = 0;
    // Four ranks take 10 steps, then three ranks the rest of the epoch, then five.
    const auto run = [&](int world, std::uint64_t steps) {
      for (int r = 0; r < world; ++r) {
        distributed_sampler s{n, r, world, {.shuffle = shuffle, .seed = 9, .drop_last = true}};
        s.resume(2, consumed);
        CHECK(s.start() == consumed);
        REQUIRE(s.size() >= steps * b);
        for (std::uint64_t i = 0; i < steps * b; ++i) ++seen[static_cast<std::size_t>(s[i])];
      }
      consumed += steps * b * static_cast<std::uint64_t>(world);
    };
    run(4, 10);
    run(3, 12);
    const std::uint64_t left = (n - consumed) / (5 * b);
    run(5, left);
    CHECK(n - consumed < 5 * b);
    std::uint64_t once = 0;
    for (int c : seen) {
      CHECK(c <= 1);
      once += static_cast<std::uint64_t>(c);
    }
    CHECK(once == consumed);
    // The positions the three phases took are the first `consumed` of epoch 2's order.
    distributed_sampler all{n, 0, 1, {.shuffle = shuffle, .seed = 9}};
    all.set_epoch(2);
    for (std::uint64_t i = 0; i < consumed; ++i) CHECK(seen[static_cast<std::size_t>(all[i])] == 1);
    // set_epoch starts an epoch from its beginning again.
    all.resume(2, 10);
    CHECK(all.size() == n - 10);
    all.set_epoch(2);
    CHECK(all.size() == n);
  }
  CHECK_THROWS_WITH_AS(distributed_sampler(10, 0, 2).resume(0, 11), doctest::Contains("resume after 11 samples"),
                       ddp::error);
}
