#include "ddp/data_parallel/bucket_memory.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ddp/memory/host_allocator.hpp"
#include "dp_plan.hpp"

namespace {

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

template <class F>
ddp::error error_of(F&& f) {
  try {
    f();
  } catch (const ddp::error& e) {
    return e;
  }
  FAIL("expected ddp::error");
  return ddp::error(ddp::errc::aborted, -1, "");
}

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
