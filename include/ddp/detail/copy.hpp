#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// Bulk byte copies for the data paths (staging, bucket copy-in and copy-out).

#include <cstddef>
#include <cstring>

namespace ddp {
inline namespace v0 {
namespace detail {

/// Copies `n` bytes with plain vector loads and stores. glibc's memcpy uses `rep movsb` for
/// these sizes, which on AMD Zen runs over 10x slower when the destination sits 1-63 bytes
/// past the source modulo 4 KiB; that is exactly a page-aligned slot copied to a malloc'd
/// buffer (page + 16), the staged allreduce's copy-out.
inline void copy_bytes(void* dst, const void* src, std::size_t n) noexcept {
  typedef char block __attribute__((vector_size(32)));
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  std::size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    block x0, x1, x2, x3;
    __builtin_memcpy(&x0, s + i, 32);
    __builtin_memcpy(&x1, s + i + 32, 32);
    __builtin_memcpy(&x2, s + i + 64, 32);
    __builtin_memcpy(&x3, s + i + 96, 32);
    __builtin_memcpy(d + i, &x0, 32);
    __builtin_memcpy(d + i + 32, &x1, 32);
    __builtin_memcpy(d + i + 64, &x2, 32);
    __builtin_memcpy(d + i + 96, &x3, 32);
  }
  if (i < n) std::memcpy(d + i, s + i, n - i);  // under 128 bytes: no rep movsb
}

}  // namespace detail
}  // namespace v0
}  // namespace ddp
