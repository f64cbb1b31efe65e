// Pure plans of the group and the sharded mode, in one process with no socket or device: the
// sharded mode's layout (data_parallel/shard_layout.hpp: which elements of which parameters each
// rank's shard holds) and the NCCL shrink plan (reducer/detail/nccl_shrink.hpp: which old ranks
// an elastic group's communicator leaves out, decided alike on every rank from their offers).
#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/data_parallel/shard_layout.hpp>
#include <ddp/planner/bucket_plan.hpp>
#include <ddp/reducer/detail/nccl_shrink.hpp>

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace {

// Two buckets: f32 of parameters 0 (7 elements) and 1 (3), f16 of parameter 2 (5).
ddp::bucket_plan two_buckets() {
  ddp::bucket_plan p;
  ddp::bucket a;
  a.type = ddp::dtype::f32;
  a.numel = 10;
  a.bytes = 40;
  a.entries = {{0, 0, 7}, {1, 7, 3}};
  ddp::bucket b;
  b.type = ddp::dtype::f16;
  b.numel = 5;
  b.bytes = 10;
  b.entries = {{2, 0, 5}};
  p.buckets = {a, b};
  return p;
}

}  // namespace

TEST_CASE("shard layout: each rank's slice of each bucket, padded to the world, every element in one shard") {
  const auto plan = two_buckets();
  for (int world : {1, 2, 3, 4, 16}) {
    CAPTURE(world);
    // Per parameter, how many shards hold each element: exactly one, for every element.
    std::vector<std::vector<int>> held = {std::vector<int>(7), std::vector<int>(3), std::vector<int>(5)};
    std::string described;
    for (int r = 0; r < world; ++r) {
      const auto l = ddp::shard_layout::of(plan, r, world);
      REQUIRE(l.buckets.size() == 2);
      CHECK(l.rank == r);
      CHECK(l.world == world);
      std::size_t offset = 0;
      for (std::size_t b = 0; b < 2; ++b) {
        const auto& s = l.buckets[b];
        const std::size_t numel = plan.buckets[b].numel;
        CHECK(s.type == plan.buckets[b].type);
        CHECK(s.numel == numel);
        CHECK(s.per_rank == (numel + static_cast<std::size_t>(world) - 1) / static_cast<std::size_t>(world));
        CHECK(s.padded == s.per_rank * static_cast<std::size_t>(world));
        CHECK(s.padded >= numel);
        CHECK(s.padded - numel < static_cast<std::size_t>(world));
        CHECK(s.first == static_cast<std::size_t>(r) * s.per_rank);
        CHECK(s.offset == offset);
        offset += s.per_rank;
        for (const auto& pc : s.pieces) {
          CHECK(pc.count > 0);
          CHECK(pc.shard_offset + pc.count <= s.per_rank);
          for (std::size_t k = 0; k < pc.count; ++k) ++held[pc.param].at(pc.param_offset + k);
        }
      }
      CHECK(l.elements == offset);
      // The text ranks compare to agree on the layout is the same on every rank.
      if (r == 0) described = l.describe();
      CHECK(l.describe() == described);
    }
    for (const auto& h : held)
      for (int n : h) CHECK(n == 1);
    if (world == 2) CHECK(described == "world 2: f32 10/5, f16 5/3");
  }
  // Rank 1 of 3: elements [4, 8) of the f32 bucket: parameter 0's [4, 7), parameter 1's [0, 1).
  const auto l = ddp::shard_layout::of(plan, 1, 3);
  REQUIRE(l.buckets[0].pieces.size() == 2);
  CHECK(l.buckets[0].pieces[0] == ddp::shard_piece{0, 4, 0, 3});
  CHECK(l.buckets[0].pieces[1] == ddp::shard_piece{1, 0, 3, 1});
  // Of the f16 bucket (5 elements, 2 per rank): [2, 4) of parameter 2.
  REQUIRE(l.buckets[1].pieces.size() == 1);
  CHECK(l.buckets[1].pieces[0] == ddp::shard_piece{2, 2, 0, 2});
  // A rank whose slice is all padding holds no piece: 16 ranks, 5 elements, rank 9 of the f16 bucket.
  CHECK(ddp::shard_layout::of(plan, 9, 16).buckets[1].pieces.empty());
}

TEST_CASE("the shrink plan: the lost old ranks when every rank kept the last generation's communicator") {
  using ddp::detail::nccl_shrink_plan;
  auto offer = [](std::uint64_t g, int r, int n) { return ddp::detail::nccl_parent_offer{g, r, n}.encode(); };
  // Old ranks 1 and 3 of 5 lost: the survivors 0, 2, 4 are the new 0, 1, 2.
  auto p = nccl_shrink_plan({offer(7, 0, 5), offer(7, 2, 5), offer(7, 4, 5)});
  REQUIRE(p.has_value());
  CHECK(*p == std::vector<int>{1, 3});
  p = nccl_shrink_plan({offer(7, 1, 4), offer(7, 2, 4), offer(7, 3, 4)});  // old rank 0 lost
  REQUIRE(p.has_value());
  CHECK(*p == std::vector<int>{0});
  // No shrink: a newcomer (no offer), another old group, another old size, an order NCCL
  // would not give, nobody lost, garbage, no ranks.
  CHECK_FALSE(nccl_shrink_plan({offer(7, 0, 3), ""}).has_value());
  CHECK_FALSE(nccl_shrink_plan({offer(7, 0, 3), offer(8, 2, 3)}).has_value());
  CHECK_FALSE(nccl_shrink_plan({offer(7, 0, 3), offer(7, 2, 4)}).has_value());
  CHECK_FALSE(nccl_shrink_plan({offer(7, 2, 3), offer(7, 0, 3)}).has_value());
  CHECK_FALSE(nccl_shrink_plan({offer(7, 0, 3), offer(7, 0, 3)}).has_value());
  CHECK_FALSE(nccl_shrink_plan({offer(7, 0, 2), offer(7, 1, 2)}).has_value());
  CHECK_FALSE(nccl_shrink_plan({"7 0 2 junk", offer(7, 1, 2)}).has_value());
  CHECK_FALSE(nccl_shrink_plan({"7 2 2"}).has_value());  // rank out of its size
  CHECK_FALSE(nccl_shrink_plan({}).has_value());
  CHECK(ddp::detail::nccl_parent_offer::decode(offer(18446744073709551615ull, 3, 9))->group ==
        18446744073709551615ull);
}
