#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// Unguessable numbers for names other local users must not predict: claim tokens at the
// rendezvous, temporary files beside what ddp writes, shared-memory segments.

#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <random>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// 64 bits from the kernel's random source (getrandom(2)); std::random_device where that call
/// is refused (an old kernel, a seccomp filter).
inline std::uint64_t random_u64() noexcept {
  std::uint64_t v = 0;
  for (;;) {
    const ssize_t n = ::getrandom(&v, sizeof v, 0);
    if (n == static_cast<ssize_t>(sizeof v)) return v;
    if (n < 0 && errno == EINTR) continue;
    break;
  }
  try {
    std::random_device rd;
    return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  } catch (...) {
    return v;
  }
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
