#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// Bulk byte copies for the data paths (staging, bucket copy-in and copy-out).

#include <cstddef>
#include <cstdint>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace ddp {
inline namespace DDP_ABI {
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

/// Copies below this many bytes go through the cache (copy_bytes) even when streaming is asked.
inline constexpr std::size_t stream_min_bytes = std::size_t{256} << 10;

/// Copies `n` bytes, writing large destinations with non-temporal stores: the destination's
/// lines are not read first (a plain store reads each line before it writes it), which saves
/// a third of the memory traffic of a copy that does not fit in the cache. For data that is not
/// read again soon (a bucket's result copied back to a gradient, a gradient copied into a
/// bucket that fills and is reduced later); small copies take copy_bytes.
inline void copy_bytes_streaming(void* dst, const void* src, std::size_t n) noexcept {
#if defined(__SSE2__)
  if (n >= stream_min_bytes) {
    auto* d = static_cast<char*>(dst);
    const auto* s = static_cast<const char*>(src);
    const std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(d) & 15)) & 15;
    copy_bytes(d, s, head);
    std::size_t i = head;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    _mm_sfence();  // the stores are visible before anyone is told the copy is done
    copy_bytes(d + i, s + i, n - i);
    return;
  }
#endif
  copy_bytes(dst, src, n);
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
