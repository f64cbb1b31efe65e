#pragma once
/// \file tbb.hpp
/// oneTBB-parallel host reductions, an explicit choice of the program: after `ddp::use_tbb()`
/// (and linking oneTBB), large reductions (4 MiB and up) run on the cores this rank has to
/// itself: the hardware threads divided by the local ranks (`LOCAL_WORLD_SIZE`, set by ddprun
/// and torchrun), at least one. With one core per rank, as with 2 ranks on 2 cores, it stays out
/// of the way. Including this header changes nothing by itself.
///
/// \code
/// #include <ddp/parallel/tbb.hpp>   // link oneTBB (Meson: dependency('tbb'))
/// ddp::use_tbb();                   // large reductions split across this rank's cores
/// ddp::set_kernel_threads(4);       // optional: override the share
/// \endcode

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string_view>
#include <system_error>
#include <thread>

#include <ddp/version.hpp>
#include <ddp/detail/parallel.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

inline int default_kernel_threads() {
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int local = 1;
  // Range-checked before any cast: a value that is not a number of ranks in [1, 2^20] counts as 1.
  if (const char* v = std::getenv("LOCAL_WORLD_SIZE")) {
    long long n = 0;
    const std::string_view s(v);
    const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
    if (ec == std::errc() && p == s.data() + s.size() && n >= 1 && n <= (1LL << 20)) local = static_cast<int>(n);
  }
  return std::max(1, hw / local);
}

struct tbb_pool {
  std::mutex mu;
  std::unique_ptr<oneapi::tbb::task_arena> arena;
  int threads = 0;
};
inline tbb_pool& tbb_state() {
  static tbb_pool p;
  return p;
}

inline void tbb_parallel_for(std::size_t n, std::size_t grain, void (*body)(std::size_t, std::size_t, void*),
                             void* ctx) {
  auto& st = tbb_state();
  oneapi::tbb::task_arena* arena;
  {
    std::lock_guard lock(st.mu);
    if (!st.arena) {
      st.threads = default_kernel_threads();
      st.arena = std::make_unique<oneapi::tbb::task_arena>(st.threads);
    }
    arena = st.arena.get();
    if (st.threads <= 1) arena = nullptr;
  }
  if (arena == nullptr) return body(0, n, ctx);
  arena->execute([&] {
    oneapi::tbb::parallel_for(oneapi::tbb::blocked_range<std::size_t>(0, n, grain),
                              [&](const oneapi::tbb::blocked_range<std::size_t>& r) { body(r.begin(), r.end(), ctx); });
  });
}

}  // namespace detail

/// Makes large host reductions of this process split across oneTBB threads (the share of
/// cores described above). Call it once, before the first collective; it is the only way the
/// pool gets used: including this header installs nothing.
///
/// \code
/// ddp::use_tbb();
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// \endcode
inline void use_tbb() noexcept { detail::parallel_hook().store(&detail::tbb_parallel_for); }

/// Sets how many threads a large reduction may use on this rank (1 turns splitting off), and
/// turns the oneTBB split on as `use_tbb()` does.
///
/// \code
/// ddp::set_kernel_threads(4);
/// \endcode
inline void set_kernel_threads(int threads) {
  auto& st = detail::tbb_state();
  {
    std::lock_guard lock(st.mu);
    st.threads = std::max(1, threads);
    st.arena = std::make_unique<oneapi::tbb::task_arena>(st.threads);
  }
  use_tbb();
}

}  // namespace DDP_ABI
}  // namespace ddp
