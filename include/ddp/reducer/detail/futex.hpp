#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
/// \file reducer/detail/futex.hpp
/// Cross-process futex wait and wake on a 32-bit word in shared memory, and the CPU's spin hint.
///
/// The words live in a MAP_SHARED segment mapped by several processes, so the calls must use the
/// shared futex operations: FUTEX_PRIVATE_FLAG keys the wait queue by virtual address in one
/// process and a waker in another process would never find the sleeper.

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

static_assert(std::atomic<std::uint32_t>::is_always_lock_free && sizeof(std::atomic<std::uint32_t>) == 4,
              "futex words must be plain lock-free 32-bit atomics");

/// Tells the core we are spinning: frees pipeline resources for a sibling hyperthread and
/// avoids the memory-order mis-speculation penalty when the awaited line finally changes.
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

/// Sleeps while `*word == expected`, at most `slice`. Returns on a wake, on a value change, on
/// the timeout or on a signal; callers recheck their condition in every case.
inline void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected,
                       std::chrono::nanoseconds slice) noexcept {
  if (slice.count() <= 0) return;
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(slice.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(slice.count() % 1000000000);
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

/// Wakes every process sleeping on `word`.
inline void futex_wake_all(std::atomic<std::uint32_t>* word) noexcept {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
