#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/reducer/detail/schedule.hpp>

#include <ddp/detail/kernels.hpp>

#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using ddp::op;
namespace det = ddp::detail;

namespace {

using buffers = std::vector<std::vector<float>>;

// Rank r holds small integers, so every summation order gives the same exact float; `noisy`
// instead holds arbitrary floats, for which only cross-rank agreement can be checked.
buffers make_buffers(int n, std::size_t count, bool noisy, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> small(-100, 100);
  std::uniform_real_distribution<float> any(-1.0f, 1.0f);
  buffers b(static_cast<std::size_t>(n), std::vector<float>(count));
  for (auto& v : b)
    for (auto& x : v) x = noisy ? any(rng) * std::ldexp(1.0f, small(rng) / 8) : static_cast<float>(small(rng));
  return b;
}

std::vector<float> reference(const buffers& b, op o) {
  std::vector<float> r = b[0];
  for (std::size_t k = 1; k < b.size(); ++k) det::reduce_into(r.data(), b[k].data(), r.size(), o);
  return r;
}

bool all_ranks_agree(const buffers& b) {
  for (const auto& v : b)
    if (!v.empty() && std::memcmp(v.data(), b[0].data(), v.size() * sizeof(float)) != 0) return false;
  return true;
}

// `mine = lower op upper` where this rank's data is `lower` when `mine_is_lower`.
void combine_ordered(float* mine, const float* theirs, std::size_t n, op o, bool mine_is_lower) {
  if (mine_is_lower) {
    det::reduce_into(mine, theirs, n, o);
  } else {
    float* outs[] = {mine};
    const float* ins[] = {theirs, mine};
    det::combine(outs, 1, ins, 2, n, o);
  }
}

// Moves chunks between the n in-memory "ranks" exactly as the ring schedule says. All sends of
// a step are captured before any receive is applied, as on a real network.
void run_ring(buffers& b, op o) {
  const int n = static_cast<int>(b.size());
  const std::size_t count = b[0].size();
  for (int step = 0; step < det::ring_steps(n); ++step) {
    std::vector<std::vector<float>> wire(static_cast<std::size_t>(n));
    std::vector<det::ring_step> st(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      st[static_cast<std::size_t>(r)] = det::ring_schedule(r, n, step);
      const auto c = det::partition(count, n, st[static_cast<std::size_t>(r)].send_chunk);
      wire[static_cast<std::size_t>(r)].assign(b[static_cast<std::size_t>(r)].begin() + static_cast<std::ptrdiff_t>(c.begin),
                                               b[static_cast<std::size_t>(r)].begin() + static_cast<std::ptrdiff_t>(c.end));
    }
    for (int r = 0; r < n; ++r) {
      const auto& s = st[static_cast<std::size_t>(r)];
      const auto& from = st[static_cast<std::size_t>(s.recv_from)];
      REQUIRE(from.send_to == r);
      REQUIRE(from.send_chunk == s.recv_chunk);
      REQUIRE(from.reduce == s.reduce);
      const auto c = det::partition(count, n, s.recv_chunk);
      const auto& data = wire[static_cast<std::size_t>(s.recv_from)];
      float* dst = b[static_cast<std::size_t>(r)].data() + c.begin;
      if (s.reduce)
        det::reduce_into(dst, data.data(), c.size(), o);
      else
        std::copy(data.begin(), data.end(), dst);
    }
  }
}

float* at(buffers& b, int r, std::size_t off) { return b[static_cast<std::size_t>(r)].data() + off; }

// Walks plan_halving_doubling / plan_recursive_doubling in memory.
void run_hd(buffers& b, op o, bool halving) {
  const int n = static_cast<int>(b.size());
  const std::size_t count = b[0].size();
  std::vector<det::hd_plan> plan;
  for (int r = 0; r < n; ++r)
    plan.push_back(halving ? det::plan_halving_doubling(r, n) : det::plan_recursive_doubling(r, n));
  const int blocks = plan[0].blocks;

  // Fold in: even partner reduces `even op= odd`.
  for (int r = 0; r < n; ++r) {
    const auto& p = plan[static_cast<std::size_t>(r)];
    if (p.fold_partner >= 0 && !p.folded_out) {
      REQUIRE(plan[static_cast<std::size_t>(p.fold_partner)].folded_out);
      REQUIRE(plan[static_cast<std::size_t>(p.fold_partner)].fold_partner == r);
      det::reduce_into(at(b, r, 0), at(b, p.fold_partner, 0), count, o);
    }
  }
  auto exchange = [&](int k, bool gather) {
    std::vector<std::vector<float>> wire(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      const auto& p = plan[static_cast<std::size_t>(r)];
      if (p.folded_out) continue;
      const auto& l = p.level[static_cast<std::size_t>(k)];
      const auto s = gather ? det::block_span(count, blocks, l.keep_begin, l.keep_end)
                            : det::block_span(count, blocks, l.send_begin, l.send_end);
      wire[static_cast<std::size_t>(r)].assign(at(b, r, s.begin), at(b, r, s.end));
    }
    for (int r = 0; r < n; ++r) {
      const auto& p = plan[static_cast<std::size_t>(r)];
      if (p.folded_out) continue;
      const auto& l = p.level[static_cast<std::size_t>(k)];
      const auto& q = plan[static_cast<std::size_t>(l.peer)];
      REQUIRE_FALSE(q.folded_out);
      const auto& ql = q.level[static_cast<std::size_t>(k)];
      REQUIRE(ql.peer == r);
      REQUIRE(ql.lower != l.lower);
      REQUIRE(ql.send_begin == l.keep_begin);  // what the peer sends is what I keep
      REQUIRE(ql.send_end == l.keep_end);
      const auto& data = wire[static_cast<std::size_t>(l.peer)];
      if (gather) {
        const auto s = det::block_span(count, blocks, l.send_begin, l.send_end);
        REQUIRE(data.size() == s.size());
        std::copy(data.begin(), data.end(), at(b, r, s.begin));
      } else {
        const auto s = det::block_span(count, blocks, l.keep_begin, l.keep_end);
        REQUIRE(data.size() == s.size());
        combine_ordered(at(b, r, s.begin), data.data(), s.size(), o, l.lower);
      }
    }
  };
  const int levels = plan[0].num_levels;  // rank 0 is never folded out
  for (int k = 0; k < levels; ++k) exchange(k, false);
  if (halving) {
    // After the reduce-scatter virtual rank v holds block v alone.
    for (int r = 0; r < n; ++r) {
      const auto& p = plan[static_cast<std::size_t>(r)];
      if (p.folded_out || levels == 0) continue;
      const auto& l = p.level[static_cast<std::size_t>(levels - 1)];
      CHECK(l.keep_begin == p.vrank);
      CHECK(l.keep_end == p.vrank + 1);
    }
    for (int k = levels - 1; k >= 0; --k) exchange(k, true);
  }
  for (int r = 0; r < n; ++r) {
    const auto& p = plan[static_cast<std::size_t>(r)];
    if (p.folded_out) std::copy(b[static_cast<std::size_t>(p.fold_partner)].begin(), b[static_cast<std::size_t>(p.fold_partner)].end(), at(b, r, 0));
  }
}

}  // namespace

TEST_CASE("partition covers [0, count) exactly and is balanced") {
  for (std::size_t count : {0u, 1u, 5u, 7u, 64u, 1000u, 1001u}) {
    for (int parts = 1; parts <= 9; ++parts) {
      std::size_t next = 0;
      for (int i = 0; i < parts; ++i) {
        const auto r = det::partition(count, parts, i);
        CHECK(r.begin == next);
        const std::size_t want = count / static_cast<std::size_t>(parts) +
                                 (static_cast<std::size_t>(i) < count % static_cast<std::size_t>(parts) ? 1 : 0);
        CHECK(r.size() == want);
        next = r.end;
      }
      CHECK(next == count);
      for (std::size_t align : {1u, 4u, 16u}) {
        std::size_t at = 0;
        for (int i = 0; i < parts; ++i) {
          const auto r = det::partition_aligned(count, parts, i, align);
          CHECK(r.begin == at);
          CHECK((r.begin % align == 0 || r.begin == count));
          CHECK((r.end % align == 0 || r.end == count));
          CHECK(r.size() <= (count / align / static_cast<std::size_t>(parts) + 1) * align);
          at = r.end;
        }
        CHECK(at == count);
      }
    }
  }
  CHECK(det::partition(10, 3, 0) == det::range{0, 4});
  CHECK(det::partition(10, 3, 2) == det::range{7, 10});
  CHECK(det::partition_aligned(100, 3, 0, 16) == det::range{0, 48});
  CHECK(det::partition_aligned(100, 3, 2, 16) == det::range{80, 100});
  CHECK(det::block_span(10, 3, 1, 3) == det::range{4, 10});
  CHECK(det::block_span(10, 3, 2, 2).size() == 0);
}

TEST_CASE("segments cover the message") {
  CHECK(det::num_segments(0, 4096) == 0);
  CHECK(det::num_segments(1, 0) == 1);
  CHECK(det::num_segments(4096, 4096) == 1);
  CHECK(det::num_segments(4097, 4096) == 2);
  const std::size_t bytes = 10000;
  std::size_t at = 0;
  for (std::size_t i = 0; i < det::num_segments(bytes, 3000); ++i) {
    const auto s = det::segment(bytes, 3000, i);
    CHECK(s.begin == at);
    CHECK(s.size() > 0);
    at = s.end;
  }
  CHECK(at == bytes);
}

TEST_CASE("ring schedule: reduce-scatter leaves chunk (r+1)%n on rank r") {
  CHECK(det::ring_steps(1) == 0);
  CHECK(det::ring_steps(4) == 6);
  for (int n = 2; n <= 9; ++n) {
    for (int r = 0; r < n; ++r) {
      CHECK(det::ring_owner(n, (r + 1) % n) == r);
      const auto last_rs = det::ring_schedule(r, n, n - 2);
      CHECK(last_rs.reduce);
      CHECK(last_rs.recv_chunk == (r + 1) % n);
      const auto first_ag = det::ring_schedule(r, n, n - 1);
      CHECK_FALSE(first_ag.reduce);
      CHECK(first_ag.send_chunk == (r + 1) % n);
    }
  }
  CHECK(det::ring_schedule(0, 4, 0) == det::ring_step{1, 3, 0, 3, true});
}

TEST_CASE("ring allreduce simulated for n = 1..9 gives the sum on every rank, bit-identical") {
  for (int n = 1; n <= 9; ++n) {
    for (std::size_t count : {0u, 1u, 5u, 37u, 1000u}) {
      CAPTURE(n);
      CAPTURE(count);
      auto b = make_buffers(n, count, false, static_cast<std::uint32_t>(n * 31 + count));
      const auto want = reference(b, op::sum);
      run_ring(b, op::sum);
      for (int r = 0; r < n; ++r) CHECK(b[static_cast<std::size_t>(r)] == want);

      auto noisy = make_buffers(n, count, true, static_cast<std::uint32_t>(n * 17 + count));
      run_ring(noisy, op::sum);
      CHECK(all_ranks_agree(noisy));
      for (op o : {op::min, op::max, op::prod}) {
        auto m = make_buffers(n, count, true, 3);
        const auto w = reference(m, o);
        run_ring(m, o);
        if (o != op::prod) CHECK(m[0] == w);  // min/max are exact in any order
        CHECK(all_ranks_agree(m));
      }
    }
  }
}

TEST_CASE("halving-doubling plan: fold and virtual ranks") {
  const auto p = det::plan_halving_doubling(3, 6);  // p2 = 4, ranks 0..3 fold in pairs
  CHECK(p.p2 == 4);
  CHECK(p.folded_out);
  CHECK(p.fold_partner == 2);
  CHECK(p.vrank == -1);
  CHECK(p.num_levels == 0);
  const auto q = det::plan_halving_doubling(2, 6);
  CHECK_FALSE(q.folded_out);
  CHECK(q.vrank == 1);
  CHECK(q.num_levels == 2);
  CHECK(q.level[0].peer == 5);  // virtual 1 ^ 2 = 3 -> real 3 + 2
  CHECK(q.level[0].lower);
  CHECK(q.level[0].keep_begin == 0);
  CHECK(q.level[0].keep_end == 2);
  CHECK(q.level[1].peer == 0);  // virtual 0 -> real 0
  CHECK_FALSE(q.level[1].lower);
  CHECK(q.level[1].keep_begin == 1);
  CHECK(q.level[1].keep_end == 2);
  const auto one = det::plan_halving_doubling(0, 1);
  CHECK(one.num_levels == 0);
  CHECK(one.levels().empty());
  CHECK(q.levels().size() == 2);
  CHECK(q.levels()[1].peer == 0);
  CHECK(one.fold_partner == -1);
  for (int n = 1; n <= 40; ++n)
    for (int v = 0; v < det::floor_pow2(n); ++v) {
      const int r = det::hd_real_rank(n, v);
      CHECK(det::plan_halving_doubling(r, n).vrank == v);
      CHECK(det::plan_recursive_doubling(r, n).vrank == v);
    }
}

TEST_CASE("halving-doubling and recursive doubling simulated for n = 1..9") {
  for (bool halving : {true, false}) {
    for (int n = 1; n <= 9; ++n) {
      for (std::size_t count : {0u, 1u, 3u, 16u, 37u, 1000u}) {
        CAPTURE(halving);
        CAPTURE(n);
        CAPTURE(count);
        for (op o : {op::sum, op::min, op::max, op::prod}) {
          auto b = make_buffers(n, count, false, static_cast<std::uint32_t>(n * 13 + count));
          if (o == op::prod)  // keep products exact: values in {-1, 1, 2}
            for (auto& v : b)
              for (auto& x : v) x = (static_cast<int>(x) % 3 == 0) ? -1.0f : (x > 0 ? 2.0f : 1.0f);
          const auto want = reference(b, o);
          run_hd(b, o, halving);
          for (int r = 0; r < n; ++r) CHECK(b[static_cast<std::size_t>(r)] == want);
        }
        auto noisy = make_buffers(n, count, true, static_cast<std::uint32_t>(n * 7 + count));
        run_hd(noisy, op::sum, halving);
        CHECK(all_ranks_agree(noisy));
      }
    }
  }
}

TEST_CASE("recursive doubling agrees bitwise where the operand order shows") {
  // min(-0.0, +0.0) keeps its left operand, so both ranks of a pair must evaluate the same
  // `lower op upper`; NaN payloads differ per rank and must still come out identical.
  for (int n = 2; n <= 9; ++n) {
    CAPTURE(n);
    buffers b(static_cast<std::size_t>(n), std::vector<float>(3));
    for (int r = 0; r < n; ++r) {
      auto& v = b[static_cast<std::size_t>(r)];
      v[0] = (r % 2) ? -0.0f : 0.0f;
      v[1] = (r % 3) ? 0.0f : -0.0f;
      v[2] = std::bit_cast<float>(((r % 2) ? 0xffc00000u : 0x7fc00000u) | static_cast<std::uint32_t>(r + 1));
    }
    run_hd(b, op::min, false);
    CHECK(all_ranks_agree(b));
    CHECK(std::isnan(b[0][2]));
    CHECK(b[0][0] == 0.0f);
  }
}

TEST_CASE("binomial tree reaches every rank once, within ceil(log2 n) rounds") {
  for (int n = 1; n <= 33; ++n) {
    for (int root = 0; root < n; ++root) {
      CAPTURE(n);
      CAPTURE(root);
      CHECK(det::tree_for(root, n, root).parent == -1);
      std::vector<int> depth(static_cast<std::size_t>(n), -1);
      std::vector<int> frontier{root};
      depth[static_cast<std::size_t>(root)] = 0;
      int seen = 1;
      while (!frontier.empty()) {
        std::vector<int> next;
        for (int r : frontier) {
          const auto tr = det::tree_for(r, n, root);
          for (int c : tr.children()) {
            REQUIRE(c >= 0);
            REQUIRE(c < n);
            REQUIRE(depth[static_cast<std::size_t>(c)] == -1);  // reached once (and no cycle)
            CHECK(det::tree_for(c, n, root).parent == r);
            depth[static_cast<std::size_t>(c)] = depth[static_cast<std::size_t>(r)] + 1;
            ++seen;
            next.push_back(c);
          }
        }
        frontier = std::move(next);
      }
      CHECK(seen == n);
      int max_depth = 0;
      for (int d : depth) max_depth = d > max_depth ? d : max_depth;
      int log2n = 0;
      while ((1 << log2n) < n) ++log2n;
      CHECK(max_depth <= log2n);
      // Largest subtree first: a binomial broadcast finishes in log2n rounds only if the root
      // serves its deepest child first.
      const auto t = det::tree_for(root, n, root);
      for (int i = 1; i < t.num_children; ++i)
        CHECK((t.child[static_cast<std::size_t>(i - 1)] - root + n) % n > (t.child[static_cast<std::size_t>(i)] - root + n) % n);
    }
  }
}
