#include "ddp/memory/host_allocator.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ddp/memory/allocator_concept.hpp"

namespace {

// The smallest type that models the concept.
struct minimal_allocator {
  void* allocate(std::size_t) { return nullptr; }
  void deallocate(void*, std::size_t) noexcept {}
  ddp::memory_kind location() const { return ddp::memory_kind::shared; }
};
struct throwing_deallocate {  // a release that may throw: the wrapper frees on paths that must not
  void* allocate(std::size_t) { return nullptr; }
  void deallocate(void*, std::size_t) {}
  ddp::memory_kind location() const { return ddp::memory_kind::host; }
};
struct copy_only : minimal_allocator {  // copy without zero: the hooks come in pairs
  void copy(void*, const void*, std::size_t) {}
};
struct copying : copy_only {
  void zero(void*, std::size_t) {}
};
struct device_memory {  // memory kind known at compile time
  void* allocate(std::size_t) { return nullptr; }
  void deallocate(void*, std::size_t) noexcept {}
  constexpr ddp::memory_kind location() const noexcept { return ddp::memory_kind::cuda; }
};
struct no_deallocate {
  void* allocate(std::size_t) { return nullptr; }
  ddp::memory_kind location() const { return ddp::memory_kind::host; }
};
struct no_location {
  void* allocate(std::size_t) { return nullptr; }
  void deallocate(void*, std::size_t) {}
};
struct typed_allocate {  // std::allocator-like: returns T*, not void*
  float* allocate(std::size_t) { return nullptr; }
  void deallocate(void*, std::size_t) {}
  ddp::memory_kind location() const { return ddp::memory_kind::host; }
};

static_assert(ddp::device_allocator<ddp::host_allocator>);
static_assert(ddp::device_allocator<minimal_allocator>);
static_assert(!ddp::has_deallocate<no_deallocate> && !ddp::device_allocator<no_deallocate>);
static_assert(ddp::has_deallocate<throwing_deallocate> && !ddp::has_nothrow_deallocate<throwing_deallocate> &&
              !ddp::device_allocator<throwing_deallocate>);
static_assert(!ddp::allocator_with_copy<minimal_allocator> && !ddp::copying_allocator<minimal_allocator>);
static_assert(ddp::allocator_with_copy<copy_only> && !ddp::allocator_with_zero<copy_only> &&
              !ddp::copying_allocator<copy_only>);
static_assert(ddp::copying_allocator<copying>);
static_assert(ddp::allocates_device_memory<device_memory>() && !ddp::allocates_device_memory<ddp::host_allocator>());
static_assert(!ddp::allocates_device_memory<minimal_allocator>());  // location() not constexpr: unknown
static_assert(!ddp::has_memory_location<no_location> && !ddp::device_allocator<no_location>);
static_assert(!ddp::has_allocate<typed_allocate> && !ddp::device_allocator<typed_allocate>);
static_assert(ddp::host_accessible(ddp::memory_kind::pinned) && !ddp::host_accessible(ddp::memory_kind::cuda));

bool aligned(const void* p, std::size_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

}  // namespace

TEST_CASE("host_allocator hands out cache-line aligned, writable memory") {
  ddp::host_allocator a;
  CHECK(a.location() == ddp::memory_kind::host);
  CHECK(std::string(ddp::memory_kind_name(a.location())) == "host");
  std::vector<std::pair<void*, std::size_t>> blocks;
  for (std::size_t bytes : {std::size_t{1}, std::size_t{3}, std::size_t{63}, std::size_t{64},
                            std::size_t{65}, std::size_t{1000}, std::size_t{4097}}) {
    void* p = a.allocate(bytes);
    REQUIRE(p != nullptr);
    CHECK(aligned(p, 64));
    std::memset(p, 0xab, bytes);
    CHECK(static_cast<unsigned char*>(p)[bytes - 1] == 0xab);
    blocks.emplace_back(p, bytes);
  }
  // Live blocks never overlap.
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    for (std::size_t j = i + 1; j < blocks.size(); ++j) {
      auto* bi = static_cast<char*>(blocks[i].first);
      auto* bj = static_cast<char*>(blocks[j].first);
      CHECK((bi + blocks[i].second <= bj || bj + blocks[j].second <= bi));
    }
  }
  for (auto [p, n] : blocks) a.deallocate(p, n);
}

TEST_CASE("host_allocator: zero bytes gives nullptr, and nullptr is released quietly") {
  ddp::host_allocator a;
  CHECK(a.allocate(0) == nullptr);
  a.deallocate(nullptr, 0);
}

TEST_CASE("host_allocator page-aligns large buffers") {
  ddp::host_allocator a;
  CHECK(ddp::host_allocator::alignment_for(100) == 64);
  CHECK(ddp::host_allocator::alignment_for(ddp::host_allocator::page_threshold) == 4096);
  const std::size_t bytes = (std::size_t{64} << 20) + 3;  // 64 MiB and a bit
  void* p = a.allocate(bytes);
  REQUIRE(p != nullptr);
  CHECK(aligned(p, 4096));
  auto* c = static_cast<unsigned char*>(p);
  c[0] = 1;
  c[bytes / 2] = 2;
  c[bytes - 1] = 3;
  CHECK(c[0] + c[bytes / 2] + c[bytes - 1] == 6);
  a.deallocate(p, bytes);
}

TEST_CASE("host_allocator reports impossible requests as ddp::error") {
  ddp::host_allocator a;
  for (std::size_t bytes : {SIZE_MAX, SIZE_MAX - 10, SIZE_MAX / 2}) {
    CAPTURE(bytes);
    try {
      void* p = a.allocate(bytes);
      a.deallocate(p, bytes);
      FAIL("expected ddp::error");
    } catch (const ddp::error& e) {
      CHECK(e.condition() == ddp::errc::system);
      CHECK(std::string(e.what()).find(std::to_string(bytes)) != std::string::npos);
    }
  }
}
