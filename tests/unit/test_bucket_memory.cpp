#include "ddp/data_parallel/bucket_memory.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ddp/data_parallel/detail/uneven.hpp"
#include "ddp/memory/host_allocator.hpp"
#include "dp_plan.hpp"
#include "raises.hpp"

namespace {

using ddp_test::error_of;

// Host memory with the copy and zero hooks, counting what goes through them.
struct counting_allocator {
  struct counts {
    int allocated = 0, freed = 0, copies = 0, zeroes = 0, fail_at = -1;
  };
  std::shared_ptr<counts> c = std::make_shared<counts>();
  void* allocate(std::size_t bytes) {
    if (c->allocated == c->fail_at) throw ddp::error(ddp::errc::system, -1, "counting_allocator: full");
    ++c->allocated;
    return ddp::host_allocator{}.allocate(bytes);
  }
  void deallocate(void* p, std::size_t bytes) noexcept {
    ++c->freed;
    ddp::host_allocator{}.deallocate(p, bytes);
  }
  ddp::memory_kind location() const noexcept { return ddp::memory_kind::host; }
  void copy(void* dst, const void* src, std::size_t n) {
    ++c->copies;
    std::memcpy(dst, src, n);
  }
  void zero(void* dst, std::size_t n) {
    ++c->zeroes;
    std::memset(dst, 0, n);
  }
};
static_assert(ddp::copying_allocator<counting_allocator>);

// Says its memory is a device's, at run time only (so the wrapper can only check it then).
struct unreachable_allocator {
  void* allocate(std::size_t bytes) { return ddp::host_allocator{}.allocate(bytes); }
  void deallocate(void* p, std::size_t bytes) noexcept { ddp::host_allocator{}.deallocate(p, bytes); }
  ddp::memory_kind location() const noexcept { return ddp::memory_kind::cuda; }
};

ddp::request pending_request() { return ddp::request(std::make_shared<ddp::detail::request_state>()); }

}  // namespace

TEST_CASE("bucket_memory: one buffer per bucket, slots where the plan puts them") {
  ddp::bucket_memory<ddp::host_allocator> mem{{}};
  mem.allocate(dp_test::three_buckets());
  REQUIRE(mem.size() == 3);
  CHECK(mem.slot(3) == mem.buffer(0));
  CHECK(static_cast<std::byte*>(mem.slot(2)) == static_cast<std::byte*>(mem.buffer(0)) + 16);
  CHECK(mem.slot(1) == mem.buffer(1));
  CHECK(mem.slot(0) == mem.buffer(2));
  CHECK(mem.plan() == dp_test::three_buckets());
}

TEST_CASE("bucket_memory: copy in, copy out, zero (memcpy without hooks)") {
  ddp::bucket_memory<ddp::host_allocator> mem{{}};
  mem.allocate(dp_test::three_buckets());
  const float g3[4] = {1, 2, 3, 4}, g2[4] = {5, 6, 7, 8};
  mem.copy_in(3, g3, sizeof g3);
  mem.copy_in(2, g2, sizeof g2);
  const auto* b0 = static_cast<const float*>(mem.buffer(0));
  CHECK(std::vector<float>(b0, b0 + 8) == std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8});
  mem.zero(3, sizeof g3);  // only parameter 3's slot
  CHECK(std::vector<float>(b0, b0 + 8) == std::vector<float>{0, 0, 0, 0, 5, 6, 7, 8});
  float out[4] = {};
  mem.copy_out(2, out, sizeof out);
  CHECK(std::vector<float>(out, out + 4) == std::vector<float>{5, 6, 7, 8});
}

TEST_CASE("bucket_memory: an allocator's copy and zero hooks do every copy; release frees each bucket") {
  counting_allocator a;
  auto c = a.c;
  {
    ddp::bucket_memory<counting_allocator> mem{a};
    mem.allocate(dp_test::three_buckets());
    CHECK(c->allocated == 3);
    const float g[4] = {1, 2, 3, 4};
    float out[4] = {};
    mem.copy_in(1, g, sizeof g);
    mem.copy_out(1, out, sizeof out);
    mem.zero(0, sizeof g);
    mem.zero(0, 0);        // nothing to do
    mem.copy_in(0, g, 0);  // nothing to do
    CHECK(c->copies == 2);
    CHECK(c->zeroes == 1);
    CHECK(out[3] == 4);
    mem.allocate(dp_test::three_buckets());  // a new plan: the old buffers are freed first
    CHECK(c->freed == 3);
    CHECK(c->allocated == 6);
  }
  CHECK(c->freed == 6);  // the destructor frees what is left
}

TEST_CASE("bucket_memory: an allocation that fails part way leaves nothing allocated") {
  counting_allocator a;
  a.c->fail_at = 2;
  ddp::bucket_memory<counting_allocator> mem{a};
  const auto e = error_of([&] { mem.allocate(dp_test::three_buckets()); });
  CHECK(e.condition() == ddp::errc::system);
  CHECK(std::string(e.what()).find("counting_allocator: full") != std::string::npos);
  CHECK(a.c->allocated == 2);
  CHECK(a.c->freed == 2);
  CHECK(mem.size() == 0);
}

TEST_CASE("bucket_memory: memory or parameters the CPU cannot reach need the copy hook") {
  std::vector<ddp::tensor_view> views(2);
  views[1].device = 0;
  views[1].name = "fc.weight";
  {
    ddp::bucket_memory<unreachable_allocator> mem{{}};
    const auto e = error_of([&] { mem.check_reachable(std::span<const ddp::tensor_view>(views.data(), 1), 3); });
    CHECK(e.condition() == ddp::errc::unsupported);
    CHECK(e.rank() == 3);
    CHECK(std::string(e.what()).find("bucket memory of kind 'cuda' needs an allocator with copy(dst, src, bytes)") !=
          std::string::npos);
  }
  ddp::bucket_memory<ddp::host_allocator> host{{}};
  const auto e = error_of([&] { host.check_reachable(views, 0); });
  CHECK(e.condition() == ddp::errc::unsupported);
  CHECK(e.parameter() == 1);
  CHECK(std::string(e.what()).find("parameter 1 ('fc.weight') lives on device 0") != std::string::npos);
  ddp::bucket_memory<counting_allocator> hooked{{}};
  hooked.check_reachable(views, 0);  // it copies device memory itself
}

TEST_CASE("bucket_memory: drain waits for the collectives, aborts those that do not end, and says so") {
  using namespace std::chrono_literals;
  counting_allocator a;
  ddp::bucket_memory<counting_allocator> mem{a};
  mem.allocate(dp_test::three_buckets());
  int aborts = 0;
  CHECK(mem.drain(10ms, [&] { ++aborts; }));  // nothing in flight
  CHECK(aborts == 0);

  // A collective that ends within the patience.
  auto s = std::make_shared<ddp::detail::request_state>();
  mem.track(0, ddp::request(s));
  std::thread ender([&] {
    std::this_thread::sleep_for(20ms);
    s->complete();
  });
  CHECK(mem.drain(5s, [&] { ++aborts; }));
  ender.join();
  CHECK(aborts == 0);

  // One that only the abort ends.
  auto stuck = std::make_shared<ddp::detail::request_state>();
  mem.track(1, ddp::request(stuck));
  CHECK(mem.drain(10ms, [&] {
    ++aborts;
    stuck->complete(std::make_exception_ptr(ddp::error(ddp::errc::aborted, 0, "aborted")));
  }));
  CHECK(aborts == 1);

  // One that nothing ends: the buffers must not be freed.
  mem.clear_requests();
  mem.track(2, pending_request());
  CHECK_FALSE(mem.drain(10ms, [&] { ++aborts; }));
  CHECK(aborts == 2);
  std::vector<void*> kept{mem.buffer(0), mem.buffer(1), mem.buffer(2)};
  mem.leak();
  CHECK(mem.size() == 0);
  CHECK(a.c->freed == 0);
  for (void* p : kept) ddp::host_allocator{}.deallocate(p, 0);  // the test's own cleanup
}

// ---- uneven inputs: the side buffer of the contribution count, and the average over contributors

namespace {

// Host memory that reports a device location: every access must go through the hooks.
struct far_allocator : counting_allocator {
  ddp::memory_kind location() const noexcept { return ddp::memory_kind::cuda; }
};

}  // namespace

TEST_CASE("bucket_memory: the side buffer goes through the hooks, outlives a re-plan, and is drained") {
  using namespace std::chrono_literals;
  far_allocator a;
  ddp::bucket_memory<far_allocator> mem{a};
  mem.allocate(dp_test::three_buckets());
  mem.allocate_side(8);
  mem.allocate_side(8);  // once only
  CHECK(a.c->allocated == 4);
  const std::int64_t one = 1;
  mem.put_side(&one, 8);
  void* side = mem.side();
  mem.allocate(dp_test::three_buckets());  // a re-plan keeps it, and its value
  CHECK(mem.side() == side);
  std::int64_t back = 0;
  mem.get_side(&back, 8);
  CHECK(back == 1);
  CHECK(a.c->copies == 2);

  // A whole bucket zeroed through the hook; edited on a host copy, written back.
  const float twos[8] = {2, 2, 2, 2, 2, 2, 2, 2};
  mem.copy_in(3, twos, 16);
  mem.copy_in(2, twos, 16);
  mem.zero_bucket(0);
  CHECK(a.c->zeroes == 1);
  mem.copy_in(3, twos, 16);
  mem.on_host(0, [&](void* p) {
    CHECK(p != mem.buffer(0));  // the CPU may not touch "device" memory
    static_cast<float*>(p)[0] *= 3;
  });
  float out[4] = {};
  mem.copy_out(3, out, 16);
  CHECK(out[0] == 6.0f);
  CHECK(out[1] == 2.0f);
  mem.copy_out(2, out, 16);
  CHECK(out[0] == 0.0f);  // zeroed with the bucket

  // The count's collective is drained with the buckets'.
  int aborts = 0;
  mem.track_side(pending_request());
  CHECK_FALSE(mem.drain(10ms, [&] { ++aborts; }));
  CHECK(aborts == 1);
  const auto e = error_of([&] { mem.wait_side(1ms, 2, "the count was not reduced"); });
  CHECK(e.condition() == ddp::errc::timeout);
  CHECK(std::string(e.what()).find("rank 2: the count was not reduced within 1 ms") != std::string::npos);
  mem.clear_requests();
  CHECK(mem.drain(10ms, [&] { ++aborts; }));
}

TEST_CASE("uneven_finish: floats scaled by world / count, integers divided by count, count == world untouched") {
  using ddp::detail::uneven_finish;
  // op::avg over 4 ranks of whom 3 contributed 1, 2 and 4 (one contributed 0): 7 / 4.
  float f[2] = {7.0f / 4, -7.0f / 4};
  uneven_finish(f, 2, ddp::dtype::f32, 4, 3);
  CHECK(f[0] == 7.0f / 3);  // 1.75 * 4 / 3, one rounding (in double) short of float
  CHECK(f[1] == -7.0f / 3);
  double d[1] = {7.0 / 4};
  uneven_finish(d, 1, ddp::dtype::f64, 4, 3);
  CHECK(std::abs(d[0] - 7.0 / 3) <= std::nextafter(7.0 / 3, 10.0) - 7.0 / 3);
  float same[1] = {0.1f};
  uneven_finish(same, 1, ddp::dtype::f32, 3, 3);
  CHECK(same[0] == 0.1f);

  // f16: the average over 2 of 3 ranks of 60000 is finite even though the sum is not.
  ddp::half h[1] = {ddp::half(40000.0f)};  // 2 * 60000 / 3
  uneven_finish(h, 1, ddp::dtype::f16, 3, 2);
  CHECK(static_cast<float>(h[0]) == 60000.0f);
  ddp::half top[1] = {ddp::half(65504.0f)};  // rounding past the largest value: clamped, not inf
  uneven_finish(top, 1, ddp::dtype::f16, 65, 64);
  CHECK(static_cast<float>(top[0]) == 65504.0f);

  // Integers hold the plain sum (bucket_op): divided by the contributors, truncating.
  std::int32_t n[3] = {7, -7, 9};
  uneven_finish(n, 3, ddp::dtype::i32, 4, 3);
  CHECK(n[0] == 2);
  CHECK(n[1] == -2);
  CHECK(n[2] == 3);
  std::int64_t w[1] = {10};
  uneven_finish(w, 1, ddp::dtype::i64, 4, 4);  // everyone: what op::avg gives, 10 / 4
  CHECK(w[0] == 2);

  CHECK(ddp::detail::bucket_op(true, true, ddp::dtype::i32) == ddp::op::sum);
  CHECK(ddp::detail::bucket_op(true, true, ddp::dtype::f16) == ddp::op::avg);
  CHECK(ddp::detail::bucket_op(true, false, ddp::dtype::i32) == ddp::op::avg);
  CHECK(ddp::detail::bucket_op(false, true, ddp::dtype::f32) == ddp::op::sum);
}
