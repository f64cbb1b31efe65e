#include <ddp/transport/shm.hpp>

#include <ddp/memory/shm_allocator.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/tree.hpp>

#include <doctest/doctest.h>

#include "harness.hpp"
#include "reducer_checks.hpp"

using namespace std::chrono_literals;
using namespace ddp_test;

// ring<shm> and tree<shm> through the reducer front-end (async requests, typed API), with the
// same checks as the TCP reducers.

namespace {
ddp::init_options opts(int rank, int n, int port, std::chrono::milliseconds timeout = 30s) {
  ddp::init_options o;
  o.rank = rank;
  o.world_size = n;
  o.master_port = port;
  o.timeout = timeout;
  return o;
}
template <class Reducer>
void correctness_suite(int n) {
  const int port = free_port();
  auto outs = run_ranks(n, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, n, port));
    Reducer red{pg, ddp::shm_options{.segment_bytes = 8 << 20, .slot_bytes = 4096}, ddp::reducer_options{}};
    for (std::size_t count : {0, 1, 7, 13, 61, 3001}) check_all_types_and_ops(pg, red, count);
    check_random_floats(pg, red, 1000003);
  }, 240s);
  INFO(summary(outs));
  CHECK(all_ok(outs));
}
}  // namespace

TEST_CASE("ring<shm> and tree<shm>: every dtype and op, 1 2 3 4 8 ranks") {
  for (int n : {1, 2, 3, 4, 8}) {
    CAPTURE(n);
    correctness_suite<ddp::ring<ddp::shm>>(n);
    correctness_suite<ddp::tree<ddp::shm>>(n);
  }
}

TEST_CASE("ring<shm>: async requests in flight, zero-copy buffers from the allocator") {
  const int port = free_port();
  auto outs = run_ranks(4, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, 4, port));
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
  });
  INFO(summary(outs));
  CHECK(all_ok(outs));
}
