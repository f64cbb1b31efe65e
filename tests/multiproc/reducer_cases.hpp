#pragma once
// The reducer cases written once and run over every transport (as Gloo's allreduce_test.cc runs
// one body over transports, sizes and algorithms): each case below takes the reducer type, loops
// over its sizes with CAPTURE, and test_tcp_reducers.cpp and test_shm_reducers.cpp run it with
// ring and tree over their transport (REDUCER_CASES). What differs by transport is in make() and
// the few `on_shm<R>` branches, each saying why.

#include <ddp/memory/shm_allocator.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/reducer/tree.hpp>
#include <ddp/transport/tcp.hpp>

#include <signal.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <thread>
#include <type_traits>
#include <vector>

#include "harness.hpp"
#include "reducer_checks.hpp"

TYPE_TO_STRING(ddp::ring<ddp::tcp>);
TYPE_TO_STRING(ddp::tree<ddp::tcp>);
TYPE_TO_STRING(ddp::ring<ddp::shm>);
TYPE_TO_STRING(ddp::tree<ddp::shm>);

namespace ddp_test {
using namespace std::chrono_literals;

template <class R>
constexpr bool on_shm = std::is_same_v<typename R::transport_type, ddp::shm>;
template <class R>
constexpr bool is_tree = std::is_same_v<R, ddp::tree<typename R::transport_type>>;

/// An R on `pg`: over shm with shm_options `s` (the shm engine ignores reducer options), over
/// tcp with reducer options `o`.
template <class R>
R make(ddp::process_group& pg, ddp::reducer_options o = {}, ddp::shm_options s = {}) {
  if constexpr (on_shm<R>)
    return R{pg, std::move(s), o};
  else
    return R{pg, o};
}
/// 4 KiB slots: a few thousand elements take several pipelined chunks of the shm engine.
inline ddp::shm_options small_slots() { return {.segment_bytes = std::size_t{8} << 20, .slot_bytes = 4096}; }

inline constexpr local_group reducer_opts{30s};

/// Every case of this file but the 64 MiB one, run with the reducer types given: ring and tree
/// over one transport. The 64 MiB case (allreduce_64mib) is invoked apart: over shm on the ring
/// only, since test_shm.cpp runs its engine's tree on 1,000,003 elements and 64 MiB would add 6 s.
#define REDUCER_CASES(...)                                          \
  TEST_CASE_TEMPLATE_INVOKE(every_dtype_and_op, __VA_ARGS__);       \
  TEST_CASE_TEMPLATE_INVOKE(async_in_order, __VA_ARGS__);           \
  TEST_CASE_TEMPLATE_INVOKE(mismatch_on_every_rank, __VA_ARGS__);   \
  TEST_CASE_TEMPLATE_INVOKE(other_algorithm, __VA_ARGS__);          \
  TEST_CASE_TEMPLATE_INVOKE(two_threads, __VA_ARGS__);              \
  TEST_CASE_TEMPLATE_INVOKE(broadcast_as_other_dtype, __VA_ARGS__); \
  TEST_CASE_TEMPLATE_INVOKE(rank_dies, __VA_ARGS__);                \
  TEST_CASE_TEMPLATE_INVOKE(invalid_arguments, __VA_ARGS__);        \
  TEST_CASE_TEMPLATE_INVOKE(overlapping_buffers, __VA_ARGS__);      \
  TEST_CASE_TEMPLATE_INVOKE(abort_from_another_thread, __VA_ARGS__)

TEST_CASE_TEMPLATE_DEFINE("every dtype and op, odd counts, 1 to 8 ranks (tree: doubling and halving-doubling)", R,
                          every_dtype_and_op) {
  // tree<tcp> on 5 ranks instead of 4: a power of two and one more, halving-doubling's remainder.
  for (int n : is_tree<R> && !on_shm<R> ? std::vector<int>{1, 2, 3, 5, 8} : std::vector<int>{1, 2, 3, 4, 8}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, reducer_opts, [&](ddp::process_group& pg) {
      auto red = make<R>(pg, {.segment_bytes = 4096, .small_bytes = 256}, small_slots());
      for (std::size_t count : {0, 1, 2, 7, 13, 61, 1000, 3001}) check_all_types_and_ops(pg, red, count);
      check_random_floats(pg, red, 1000003);
      check_exact<std::int64_t>(pg, red, 100003, ddp::op::sum);
    }, 240s));
  }
}

TEST_CASE_TEMPLATE_DEFINE("64 MiB allreduce on 2 and 4 ranks (shm: staged and zero-copy in the arena)", R,
                          allreduce_64mib) {
  const std::size_t count = std::size_t{16} << 20;  // 64 MiB of f32
  for (int n : {2, 4}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, reducer_opts, [&](ddp::process_group& pg) {
      auto red = make<R>(pg, {}, {.segment_bytes = static_cast<std::size_t>(n) * (count * 4 + (1 << 20))});
      check_random_floats(pg, red, count);
      if constexpr (on_shm<R>) {
        ddp::shm_allocator alloc{red.transport()};
        auto* p = static_cast<float*>(alloc.allocate(count * sizeof(float)));
        require(red.transport().contains(p), "arena buffer not in the arena");
        check_random_floats(pg, red, std::span<float>(p, count));
        alloc.deallocate(p, count * sizeof(float));
      }
    }, 240s));
  }
}

TEST_CASE_TEMPLATE_DEFINE("async requests: several in flight complete in issue order with the right values", R,
                          async_in_order) {
  expect_ok(on_ranks(3, reducer_opts, [&](int r, ddp::process_group& pg) {
    auto red = make<R>(pg);
    std::vector<std::vector<float>> bufs(8);
    std::vector<ddp::request> reqs;
    for (std::size_t k = 0; k < bufs.size(); ++k) {
      bufs[k].assign(1000 * (k + 1), static_cast<float>(r + 1 + k));
      reqs.push_back(red.allreduce_async(std::span<float>(bufs[k]), ddp::op::sum));
    }
    for (std::size_t k = 0; k < bufs.size(); ++k) {
      reqs[k].wait(std::chrono::steady_clock::now() + 30s);
      require(reqs[k].test(), "test() after wait");
      const float expect = 1 + 2 + 3 + 3.0f * static_cast<float>(k);
      for (float x : bufs[k]) require(x == expect, "async value");
      if (k > 0) require(reqs[k - 1].finished_at() <= reqs[k].finished_at(), "issue order");
    }
    std::vector<double> b(10, r == 2 ? 3.5 : 0.0);
    red.broadcast(std::span<double>(b), 2);
    for (double x : b) require(x == 3.5, "broadcast");
    std::vector<std::int32_t> all(3 * 5), mine(5, r);
    red.allgather(std::span<const std::int32_t>(mine), std::span<std::int32_t>(all));
    for (int q = 0; q < 3; ++q)
      for (int i = 0; i < 5; ++i) require(all[static_cast<std::size_t>(q * 5 + i)] == q, "allgather");
    std::vector<float> in(3 * 4), out(4);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i) * static_cast<float>(r + 1);
    red.reduce_scatter(std::span<const float>(in), std::span<float>(out), ddp::op::sum);
    for (std::size_t i = 0; i < 4; ++i)
      require(out[i] == static_cast<float>(static_cast<std::size_t>(r) * 4 + i) * 6.0f, "reduce_scatter");
    red.barrier();
  }));
}

TEST_CASE_TEMPLATE_DEFINE("mismatched count, dtype or op is an error on every rank, also when byte counts agree", R,
                          mismatch_on_every_rank) {
  struct variant { const char* name; const char* text; };
  for (variant v : {variant{"count", "1024 x f32"}, variant{"dtype", "x i32"}, variant{"op", "f32 max"}}) {
    CAPTURE(v.name);
    for (int n : {2, 4}) {
      CAPTURE(n);
      auto outs = on_ranks(n, local_group{10s}, [&](int r, ddp::process_group& pg) {
        auto red = make<R>(pg);
        const bool odd = r == n - 1;
        std::vector<float> f(odd && std::string(v.name) == "count" ? 1000 : 1024, 1.0f);
        std::vector<std::int32_t> i(1024, 1);
        if (odd && std::string(v.name) == "dtype") red.allreduce(std::span<std::int32_t>(i), ddp::op::sum);
        else red.allreduce(std::span<float>(f), odd && std::string(v.name) == "op" ? ddp::op::max : ddp::op::sum);
      }, 30s);
      INFO(summary(outs));
      for (auto& o : outs) CHECK(ended_with(o, ddp::errc::mismatch, {"collective mismatch", v.text}) == "");
      for (auto& o : outs) CHECK(o.seconds < 12.0);
    }
  }
}

TEST_CASE_TEMPLATE_DEFINE("this reducer on some ranks, the other algorithm on the last: mismatch naming both, never wrong data",
                          R, other_algorithm) {
  using T = typename R::transport_type;
  using other = std::conditional_t<is_tree<R>, ddp::ring<T>, ddp::tree<T>>;
  const std::string shm = on_shm<R> ? "<shm>" : "";
  const std::string mine = (is_tree<R> ? "tree" : "ring") + shm, theirs = (is_tree<R> ? "ring" : "tree") + shm;
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    const std::string last = "rank " + std::to_string(n - 1) + " constructed " + theirs;
    auto outs = on_ranks(n, local_group{10s}, [&](int r, ddp::process_group& pg) {
      std::vector<float> x(1024, static_cast<float>(r + 1));
      auto run = [&](auto&& red) {
        red.allreduce(std::span<float>(x), ddp::op::sum);
        // Not reached: but if it were, the data must at least be right.
        for (float e : x) require(e == static_cast<float>(n * (n + 1) / 2), "wrong data without an error");
      };
      const ddp::reducer_options o{.segment_bytes = 1024, .small_bytes = 256};
      if (r == n - 1) run(make<other>(pg, o));
      else run(make<R>(pg, o));
    }, 30s);
    INFO(summary(outs));
    for (auto& o : outs) {
      const std::string first = "rank 0 constructed " + mine;
      CHECK(ended_with(o, ddp::errc::mismatch, {"reducer mismatch", first, last, "same reducer"}) == "");
      if (on_shm<R>) CHECK(o.message.find(first + ", " + last) != std::string::npos);
      CHECK(o.seconds < 12.0);
    }
  }
}

TEST_CASE_TEMPLATE_DEFINE("two threads issuing blocking and async collectives at once: sequence numbers follow the run order",
                          R, two_threads) {
  // Both threads reduce identical data, so any pairing across ranks gives the right values;
  // what must not happen is a descriptor pairing by a sequence number taken in another order
  // than the collectives ran in (a spurious mismatch), or a lost count.
  const int n = 2;
  expect_ok(on_ranks(n, reducer_opts, [&](ddp::process_group& pg) {
    auto red = make<R>(pg);
    auto body = [&](bool async) {
      for (int i = 0; i < 300; ++i) {
        std::vector<float> x(16, 1.0f);
        if (async)
          red.allreduce_async(std::span<float>(x), ddp::op::sum).wait(std::chrono::steady_clock::now() + 30s);
        else
          red.allreduce(std::span<float>(x), ddp::op::sum);
        for (float e : x) require(e == static_cast<float>(n), "value");
      }
    };
    std::exception_ptr err;
    std::thread t([&] {
      try {
        body(true);
      } catch (...) {
        err = std::current_exception();
      }
    });
    body(false);
    t.join();
    if (err) std::rethrow_exception(err);
  }, 120s));
}

TEST_CASE_TEMPLATE_DEFINE("a broadcast of the same bytes as another dtype is a mismatch on every rank, not reinterpreted data",
                          R, broadcast_as_other_dtype) {
  // Over tcp only a receiver can see the difference (the root sends and is done): the barrier
  // after it brings the detecting rank's verdict to the others. Over shm every rank reads the
  // broadcast's descriptor in the segment: no collective after it needed.
  for (int odd : {1, 2}) {
    CAPTURE(odd);
    auto outs = run_broadcast_dtype_mismatch<R>(reducer_opts, 3, odd, !on_shm<R>);
    INFO(summary(outs));
    for (auto& o : outs) CHECK(broadcast_dtype_mismatch_seen(o) == "");
  }
}

TEST_CASE_TEMPLATE_DEFINE("a rank that dies mid-collective: peer_lost on every survivor, within the timeout", R,
                          rank_dies) {
  // Rank 1 ends by _exit(3) between large allreduces on 4 ranks, or is killed by SIGKILL during
  // small ones on 3 (those shm runs inline on the caller's thread).
  for (const bool kill : {false, true}) {
    CAPTURE(kill);
    const int n = kill ? 3 : 4;
    auto outs = on_ranks(n, local_group{5s}, [&](int r, ddp::process_group& pg) {
      auto red = make<R>(pg, {}, {.segment_bytes = std::size_t{8} << 20});
      std::vector<float> x(kill ? 1024 : std::size_t{1} << 20, 1.0f);
      red.allreduce(std::span<float>(x), ddp::op::sum);
      if (r == 1 && !kill) ::_exit(3);
      if (r == 1)
        std::thread([] {
          std::this_thread::sleep_for(30ms);
          ::raise(SIGKILL);
        }).detach();
      for (int i = 0; i < (kill ? 100000000 : 100); ++i) red.allreduce(std::span<float>(x), ddp::op::sum);
      require(false, "the collectives went on without rank 1");
    }, 60s);
    INFO(summary(outs));
    CHECK(outs[1].exit_code == (kill ? 128 + SIGKILL : 3));
    for (int r : {0, 2, 3}) {
      if (r >= n) continue;
      auto& o = outs[static_cast<std::size_t>(r)];
      const auto lost = ended_with(o, ddp::errc::peer_lost, {"rank 1"});
      if (on_shm<R>) CHECK(lost == "");
      else CHECK((lost == "" || ended_with(o, ddp::errc::timeout, {"rank 1"}) == ""));  // tcp: or a timeout naming it
      CHECK(o.seconds < 5.0 + 2.0);
    }
  }
}

TEST_CASE_TEMPLATE_DEFINE("unknown dtype or op: invalid_argument at the call, never SIGFPE", R, invalid_arguments) {
  for (int n : {1, 2, 3}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, reducer_opts, [&](ddp::process_group& pg) {
      auto red = make<R>(pg);
      check_invalid_arguments(pg, red);
    }, 60s));
  }
}

TEST_CASE_TEMPLATE_DEFINE("overlapping reduce_scatter and allgather buffers: refused, in place works", R,
                          overlapping_buffers) {
  // The ring's 100,003 floats per rank cross many 4 KiB-slot chunks of shm: where an overlap
  // used to go wrong.
  for (int n : {1, 2, 3}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, reducer_opts, [&](ddp::process_group& pg) {
      auto red = make<R>(pg, {}, small_slots());
      check_overlap_rules(pg, red, is_tree<R> ? 7 : 100003);
      if constexpr (on_shm<R>) {  // the engine itself (used without a reducer) refuses the same
        std::vector<float> buf(static_cast<std::size_t>(n) * 10 + 1);
        auto& link = red.transport();
        require_raises([&] {
          link.reduce_scatter(buf.data(), buf.data() + 1, 10, ddp::dtype::f32, ddp::op::sum, pg.deadline());
        },
                       ddp::errc::invalid_argument, {"reduce_scatter", "overlap"}, "shm::reduce_scatter overlapping");
      }
    }, 120s));
  }
}

TEST_CASE_TEMPLATE_DEFINE("abort() from another thread while collectives run: errc::aborted on every rank, no race", R,
                          abort_from_another_thread) {
  // Over tcp every rank reads "rank 0 called abort()"; over shm rank 0 "aborted by this rank".
  auto said = [](int r) {
    return !on_shm<R> ? "rank 0 called abort()" : r == 0 ? "aborted by this rank" : "aborted by rank 0";
  };
  // Async requests in flight on the progress thread (under ThreadSanitizer: the abort reason is
  // published race-free).
  auto outs = on_ranks(2, local_group{10s}, [&](int r, ddp::process_group& pg) {
    auto red = make<R>(pg, {}, {.segment_bytes = std::size_t{8} << 20});
    std::vector<std::vector<float>> bufs(100, std::vector<float>(16384, 1.0f));
    std::vector<ddp::request> reqs;
    for (auto& b : bufs) reqs.push_back(red.allreduce_async(std::span<float>(b), ddp::op::sum));
    std::thread stopper([&] {
      if (r == 0) red.abort();
    });
    stopper.join();
    for (auto& q : reqs) q.wait(std::chrono::steady_clock::now() + 20s);  // the last one raises
  }, 60s);
  INFO(summary(outs));
  for (auto& o : outs) CHECK(ended_with(o, ddp::errc::aborted, {said(o.rank)}) == "");
  if constexpr (on_shm<R> && !is_tree<R>) {
    // A blocking call run inline on rank 0's thread, waiting for rank 1, which comes later (a
    // small allreduce: the tree path, so not again for tree<shm>).
    outs = on_ranks(2, local_group{10s}, [&](int r, ddp::process_group& pg) {
      auto red = make<R>(pg, {}, {.segment_bytes = std::size_t{8} << 20});
      std::vector<float> v(1024, 1.0f);
      red.barrier();
      if (r == 0) {
        std::thread t([&] {
          std::this_thread::sleep_for(200ms);  // the main thread waits inline for rank 1 by now
          red.abort();
        });
        const auto start = std::chrono::steady_clock::now();
        try {
          red.allreduce(std::span<float>(v), ddp::op::sum);
        } catch (...) {
          t.join();
          require(std::chrono::steady_clock::now() - start < 2s, "the abort took too long to reach the caller");
          throw;
        }
        t.join();
      } else {
        std::this_thread::sleep_for(1s);  // enters after the abort
        red.allreduce(std::span<float>(v), ddp::op::sum);
      }
    });
    INFO(summary(outs));
    for (auto& o : outs) CHECK(ended_with(o, ddp::errc::aborted, {said(o.rank)}) == "");
    for (auto& o : outs) CHECK(o.seconds < 5.0);
  }
}

}  // namespace ddp_test
