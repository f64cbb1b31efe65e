// The sharded mode's replica decisions (data_parallel/detail/reshard_rules.hpp), in one process:
// who holds each shard (on other hosts where there are enough), the holding's text, and the
// re-sharding plan after shrinks and grows: every element from a holder at the newest step, the
// lowest new rank first, older holders ignored, and a part nobody holds named with its shard,
// step and holders.
#define DDP_ALLOW_DETAIL_HEADERS
#include <ddp/version.hpp>
#include <ddp/data_parallel/detail/reshard_rules.hpp>

#include <doctest/doctest.h>

#include <cstddef>
#include <string>
#include <vector>

namespace rs = ddp::detail::reshard;

namespace {

// Rank `rank`'s holding of a group of `world` ranks on `host_of`, replicas `r`, at `steps`.
rs::holding holding_of(const std::vector<int>& host_of, int r, int rank, std::uint64_t steps) {
  rs::holding h;
  h.any = true;
  h.steps = steps;
  h.plan = 77;
  h.k = 2;
  h.world = static_cast<int>(host_of.size());
  h.rank = rank;
  h.replicas = r;
  h.host_of = host_of;
  h.shards = rs::shards_of(rs::holders_of(host_of, r), rank);
  return h;
}

// Every element of every bucket is provided exactly once, by a rank whose holding covers it.
void check_cover(const rs::plan& p, const std::vector<rs::holding>& all, const std::vector<std::size_t>& numel) {
  for (std::size_t b = 0; b < numel.size(); ++b) {
    std::vector<int> seen(numel[b], 0);
    for (const auto& s : p.segments) {
      if (s.bucket != b) continue;
      const auto& h = all[static_cast<std::size_t>(s.provider)];
      bool inside = false;
      for (int sh : h.shards) {
        const auto e = rs::elements_of(numel[b], h.world, sh);
        inside = inside || (e.lo <= s.lo && s.hi <= e.hi);
      }
      CHECK(inside);
      for (std::size_t x = s.lo; x < s.hi; ++x) ++seen[x];
    }
    for (std::size_t x = 0; x < numel[b]; ++x) REQUIRE(seen[x] == 1);
  }
}

}  // namespace

TEST_CASE("reshard: holders on one host are the next ranks; across hosts each on another host") {
  const auto one = rs::holders_of({0, 0, 0, 0}, 2);
  CHECK(one == std::vector<std::vector<int>>{{0, 1}, {1, 2}, {2, 3}, {3, 0}});
  CHECK(rs::shards_of(one, 2) == std::vector<int>{2, 1});
  const auto two = rs::holders_of({0, 0, 1, 1}, 2);
  CHECK(two == std::vector<std::vector<int>>{{0, 2}, {1, 3}, {2, 0}, {3, 1}});
  // Uneven hosts: the holder's place wraps within the smaller host.
  const auto uneven = rs::holders_of({0, 0, 0, 1}, 2);
  CHECK(uneven == std::vector<std::vector<int>>{{0, 3}, {1, 3}, {2, 3}, {3, 0}});
  // More replicas than hosts: the next ranks; capped at the world size.
  CHECK(rs::holders_of({0, 0, 1, 1}, 3)[3] == std::vector<int>{3, 0, 1});
  CHECK(rs::holders_of({0, 0}, 5) == std::vector<std::vector<int>>{{0, 1}, {1, 0}});
  CHECK(rs::holders_of({0, 0, 0}, 1) == std::vector<std::vector<int>>{{0}, {1}, {2}});
}

TEST_CASE("reshard: a holding reads back as written; malformed text is refused") {
  const auto h = holding_of({0, 0, 1, 1}, 2, 3, 41);
  const auto back = rs::decode(rs::encode(h));
  REQUIRE(back);
  CHECK(*back == h);
  CHECK(rs::decode("-")->any == false);
  CHECK(!rs::decode("1 2 3"));
  CHECK(!rs::decode("1 2 2 4 9 2 0,0,0,0 0"));  // rank beyond the world
  CHECK(!rs::decode("1 2 2 4 1 2 0,0,0 0"));    // hosts of 3 ranks in a world of 4
  CHECK(!rs::decode("1 2 2 4 1 2 0,0,0,0 7"));  // a shard beyond the world
}

TEST_CASE("reshard: every loss of one rank of 4 (2 replicas) re-shards without a gap, at the newest step") {
  const std::vector<std::size_t> numel{1000, 7, 3, 4096};
  for (int lost = 0; lost < 4; ++lost) {
    CAPTURE(lost);
    std::vector<rs::holding> all;
    for (int r = 0; r < 4; ++r)
      if (r != lost) all.push_back(holding_of({0, 0, 0, 0}, 2, r, 12));
    const auto p = rs::decide(all, numel, 77);
    CHECK(p.lost.empty());
    CHECK(!p.fresh);
    CHECK(p.steps == 12);
    CHECK(p.k == 2);
    check_cover(p, all, numel);
    // The lowest new rank that holds an element provides it.
    for (const auto& s : p.segments)
      for (int q = 0; q < s.provider; ++q)
        for (int sh : all[static_cast<std::size_t>(q)].shards) {
          const auto e = rs::elements_of(numel[s.bucket], 4, sh);
          CHECK(!(e.lo <= s.lo && s.hi <= e.hi));
        }
  }
}

TEST_CASE("reshard: a grow from 3 holders (one world) plus a newcomer, and holders from two older worlds") {
  const std::vector<std::size_t> numel{1001, 64};
  std::vector<rs::holding> all;
  for (int r = 0; r < 3; ++r) all.push_back(holding_of({0, 0, 0}, 2, r, 30));
  all.emplace_back();  // the newcomer
  auto p = rs::decide(all, numel, 77);
  CHECK(p.lost.empty());
  check_cover(p, all, numel);
  for (const auto& s : p.segments) CHECK(s.provider != 3);
  // A rank left behind holds step 29 of the world of 4: ignored, even where it alone would do.
  all[3] = holding_of({0, 0, 0, 0}, 2, 3, 29);
  p = rs::decide(all, numel, 77);
  CHECK(p.lost.empty());
  CHECK(p.steps == 30);
  for (const auto& s : p.segments) CHECK(s.provider != 3);
  // Holders of the same step from worlds of 4 and 3 (a generation that formed and failed
  // before its first step): their intervals cut each other, and still every element is covered.
  std::vector<rs::holding> mixed{holding_of({0, 0, 0, 0}, 2, 0, 8), holding_of({0, 0, 0}, 2, 1, 8),
                                 holding_of({0, 0, 0, 0}, 2, 2, 8)};
  p = rs::decide(mixed, numel, 77);
  CHECK(p.lost.empty());
  check_cover(p, mixed, numel);
}

TEST_CASE("reshard: both holders of a shard lost: named with the shard, the bucket, the step and the ranks") {
  std::vector<rs::holding> all{holding_of({0, 0, 0, 0}, 2, 0, 5), holding_of({0, 0, 0, 0}, 2, 3, 5)};
  const auto p = rs::decide(all, {4096}, 77);
  REQUIRE(!p.lost.empty());
  CHECK(p.code == ddp::errc::state_lost);
  CHECK(p.segments.empty());
  CHECK(p.lost.find("every rank holding the state of shard 1 of bucket 0 (elements 1024 to 2048) at step 5") !=
        std::string::npos);
  CHECK(p.lost.find("ranks 1 and 2 of the last 4") != std::string::npos);
  // Across hosts the holders of a shard are on two hosts: one whole host lost loses nothing.
  std::vector<rs::holding> hosts{holding_of({0, 0, 1, 1}, 2, 0, 5), holding_of({0, 0, 1, 1}, 2, 1, 5)};
  CHECK(rs::decide(hosts, {4096, 9}, 77).lost.empty());
}

TEST_CASE("reshard: nothing held is fresh; another plan or another optimizer is a mismatch") {
  CHECK(rs::decide({rs::holding{}, rs::holding{}}, {10}, 77).fresh);
  auto a = holding_of({0, 0}, 2, 0, 3), b = holding_of({0, 0}, 2, 1, 3);
  b.plan = 78;
  auto p = rs::decide({a, b}, {10}, 77);
  CHECK(p.code == ddp::errc::mismatch);
  CHECK(p.lost.find("another bucket plan") != std::string::npos);
  b.plan = 77;
  b.k = 1;
  p = rs::decide({a, b}, {10}, 77);
  CHECK(p.code == ddp::errc::mismatch);
  CHECK(p.lost.find("floats of optimizer state") != std::string::npos);
}
