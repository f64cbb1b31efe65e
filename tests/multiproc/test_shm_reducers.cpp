#include <doctest/doctest.h>

#include <cmath>
#include <span>
#include <vector>

#include "harness.hpp"
#include "reducer_cases.hpp"

using namespace std::chrono_literals;
using namespace ddp_test;

// ring<shm> and tree<shm> through the reducer front-end: the cases of every reducer
// (reducer_cases.hpp), then the arena's own.
REDUCER_CASES(ddp::ring<ddp::shm>, ddp::tree<ddp::shm>);
TEST_CASE_TEMPLATE_INVOKE(allreduce_64mib, ddp::ring<ddp::shm>);

TEST_CASE("ring<shm>: async requests in flight, zero-copy buffers from the allocator") {
  expect_ok(on_ranks(4, reducer_opts, [&](int r, ddp::process_group& pg) {
    ddp::ring<ddp::shm> ring{pg, ddp::shm_options{.segment_bytes = 64 << 20}, ddp::reducer_options{}};
    ddp::shm_allocator alloc{ring.transport()};
    std::vector<float*> bufs;
    std::vector<ddp::request> reqs;
    for (std::size_t k = 0; k < 6; ++k) {
      const std::size_t n = 100000 * (k + 1);
      auto* p = static_cast<float*>(alloc.allocate(n * sizeof(float)));
      std::fill(p, p + n, static_cast<float>(r + k));
      bufs.push_back(p);
      reqs.push_back(ring.allreduce_async(std::span<float>(p, n), ddp::op::avg));
    }
    for (std::size_t k = 0; k < bufs.size(); ++k) {
      reqs[k].wait(std::chrono::steady_clock::now() + 30s);
      const float expect = (0 + 1 + 2 + 3 + 4.0f * static_cast<float>(k)) / 4.0f;
      for (std::size_t i = 0; i < 100000 * (k + 1); ++i) require(bufs[k][i] == expect, "zero-copy avg value");
      alloc.deallocate(bufs[k], 100000 * (k + 1) * sizeof(float));
    }
  }));
}

TEST_CASE("ring<shm>: reduce_scatter and allgather of buffers in the arena read peers in place, with the staged path's bits") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, reducer_opts, [&](int r, ddp::process_group& pg) {
      ddp::ring<ddp::shm> ring{pg, ddp::shm_options{.segment_bytes = 32 << 20, .slot_bytes = 4096}, ddp::reducer_options{}};
      ddp::shm_allocator alloc{ring.transport()};
      const std::size_t per = 70001, all = per * static_cast<std::size_t>(n);
      const auto value = [&](int rank, std::size_t i) {
        return static_cast<float>((i * 2654435761u + static_cast<std::size_t>(rank) * 97) % 1009) * 0.37f - 150.0f;
      };
      auto* arena = static_cast<float*>(alloc.allocate(all * sizeof(float)));
      std::vector<float> host(all);
      for (std::size_t i = 0; i < all; ++i) arena[i] = host[i] = value(r, i);
      for (auto o : {ddp::op::avg, ddp::op::sum, ddp::op::max}) {
        std::vector<float> staged(per), direct(per), mixed(per);
        ring.reduce_scatter(std::span<const float>(host), std::span<float>(staged), o);   // staged: not in the arena
        ring.reduce_scatter(std::span<const float>(arena, all), std::span<float>(direct), o);  // every rank in the arena
        // Rank 0's input not in the arena: every rank takes the staged path.
        ring.reduce_scatter(std::span<const float>(r == 0 ? host.data() : arena, all), std::span<float>(mixed), o);
        require(staged == direct && staged == mixed, "reduce_scatter: the arena path's bits differ");
        if (o == ddp::op::sum)
          for (std::size_t i = 0; i < per; i += 977) {
            float want = 0;
            for (int q = 0; q < n; ++q) want += value(q, static_cast<std::size_t>(r) * per + i);
            require(std::fabs(direct[i] - want) <= 1e-3f * (1 + std::fabs(want)), "reduce_scatter sum value");
          }
      }
      // In place in the arena: this rank's slice of its input is the output.
      ring.reduce_scatter(std::span<const float>(arena, all), std::span<float>(arena + static_cast<std::size_t>(r) * per, per),
                          ddp::op::sum);
      // Allgather in place in the arena, against a staged one.
      std::vector<float> mine(per), gathered(all);
      for (std::size_t i = 0; i < per; ++i) mine[i] = arena[static_cast<std::size_t>(r) * per + i] = value(r + 7, i);
      ring.allgather(std::span<const float>(arena + static_cast<std::size_t>(r) * per, per), std::span<float>(arena, all));
      ring.allgather(std::span<const float>(mine), std::span<float>(gathered));
      for (int q = 0; q < n; ++q)
        for (std::size_t i = 0; i < per; i += 331)
          require(arena[static_cast<std::size_t>(q) * per + i] == value(q + 7, i) &&
                      gathered[static_cast<std::size_t>(q) * per + i] == value(q + 7, i),
                  "allgather: rank " + std::to_string(q) + "'s slice");
      alloc.deallocate(arena, all * sizeof(float));
    }));
  }
}

TEST_CASE("the shm engine with ring on some ranks and tree on others: every collective's descriptor names both, a mismatch") {
  const int n = 3;
  for (const char* kind : {"allreduce", "reduce_scatter", "allgather", "broadcast", "barrier"}) {
    CAPTURE(kind);
    auto outs = on_ranks(n, local_group{10s}, [&](int r, ddp::process_group& pg) {
      ddp::shm link{pg};
      const auto a = r == 1 ? ddp::shm_algo::tree : ddp::shm_algo::ring;
      const std::string k = kind;
      std::vector<float> in(3 * 100, 1.0f), out(100, 0.0f);
      const auto until = pg.deadline();
      if (k == "allreduce") link.allreduce(in.data(), in.size(), ddp::dtype::f32, ddp::op::sum, until, a);
      if (k == "reduce_scatter") link.reduce_scatter(in.data(), out.data(), 100, ddp::dtype::f32, ddp::op::sum, until, a);
      if (k == "allgather") link.allgather(out.data(), in.data(), 100, ddp::dtype::f32, until, a);
      if (k == "broadcast") link.broadcast(out.data(), 400, 0, until, a);
      if (k == "barrier") link.barrier(until, a);
    }, 30s);
    INFO(summary(outs));
    for (auto& o : outs) {
      CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
      CHECK(o.message.find("collective mismatch: rank 0 called " + std::string(kind)) != std::string::npos);
      CHECK(o.message.find(" by ring, rank 1 called " + std::string(kind)) != std::string::npos);
      CHECK(o.message.find(" by tree") != std::string::npos);
      CHECK(o.seconds < 12.0);
    }
  }
}
