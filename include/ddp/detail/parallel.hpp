#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The hook through which an optional thread pool (ddp/parallel/tbb.hpp) splits large
// reductions across the cores a rank has to itself. Nothing installs it but the program
// (ddp::use_tbb()): without the hook, every kernel runs on the calling thread.

#include <atomic>
#include <cstddef>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Runs body(begin, end, ctx) over [0, n) in pieces of at least `grain`, possibly in parallel.
using parallel_for_fn = void (*)(std::size_t n, std::size_t grain, void (*body)(std::size_t, std::size_t, void*),
                                 void* ctx);

inline std::atomic<parallel_for_fn>& parallel_hook() noexcept {
  static std::atomic<parallel_for_fn> hook{nullptr};
  return hook;
}

/// Bytes below which splitting costs more than it saves (thread wake-ups are microseconds).
inline constexpr std::size_t parallel_min_bytes = std::size_t{4} << 20;

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
