#pragma once
/// \file host_allocator.hpp
/// `ddp::host_allocator`: aligned pageable host memory.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <ddp/version.hpp>
#include <ddp/error.hpp>
#include <ddp/memory/allocator_concept.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Host memory from `std::aligned_alloc`: 64-byte (cache-line) alignment, and page alignment
/// from `page_threshold` bytes up, so that large buckets start on a page and can be registered
/// with a NIC or `cudaHostRegister` without spilling into a neighbour's page.
/// \code
/// ddp::host_allocator a;
/// void* p = a.allocate(4096);
/// a.deallocate(p, 4096);
/// \endcode
struct host_allocator {
  static constexpr std::size_t alignment = 64;
  static constexpr std::size_t page_alignment = 4096;
  static constexpr std::size_t page_threshold = std::size_t{1} << 20;

  /// Alignment used for a request of `bytes`.
  static constexpr std::size_t alignment_for(std::size_t bytes) noexcept {
    return bytes >= page_threshold ? page_alignment : alignment;
  }

  /// Returns `bytes` of uninitialized memory, or nullptr when `bytes` is 0. Throws `ddp::error`
  /// (`errc::system`) when the memory cannot be had.
  void* allocate(std::size_t bytes) const {
    if (bytes == 0) return nullptr;
    const std::size_t align = alignment_for(bytes);
    // aligned_alloc wants a size that is a multiple of the alignment.
    if (bytes > SIZE_MAX - (align - 1)) fail(bytes);
    const std::size_t rounded = (bytes + align - 1) / align * align;
    void* p = std::aligned_alloc(align, rounded);
    if (p == nullptr) fail(bytes);
    return p;
  }

  void deallocate(void* p, std::size_t /*bytes*/) const noexcept { std::free(p); }

  constexpr memory_kind location() const noexcept { return memory_kind::host; }

  friend constexpr bool operator==(const host_allocator&, const host_allocator&) noexcept = default;

 private:
  [[noreturn]] static void fail(std::size_t bytes) {
    detail::raise(errc::system, -1, "host_allocator: cannot allocate " + std::to_string(bytes) + " bytes");
  }
};

static_assert(device_allocator<host_allocator>);

}  // namespace DDP_ABI
}  // namespace ddp
