#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
/// \file detail/isa.hpp
/// Which instruction set the host kernels run with, chosen once at run time.
///
/// The kernels (detail/kernels_body.hpp, reducer/detail/fp8_body.hpp) are written once, with GNU
/// vector extensions, and compiled once per instruction set by detail/isa_each.hpp: for the
/// build's own target in namespace `kern`, and, where that target is the x86-64 baseline (no
/// -mavx2: what a vendoring user compiles with a plain -O2), a second time in namespace
/// `kern_v3` for AVX2 and F16C, and a third time in `kern_v4` for AVX-512 (F, VL, BW, DQ) as
/// well, both with 32-byte vectors as -march=native builds them, and without FMA, so that no
/// product is ever fused and every copy gives the same bits. The entry points
/// (detail/kernels.hpp, reducer/detail/fp8.hpp) call the best copy the CPU has (the OS keeping
/// the AVX state). A build with -mavx2 or -march=native compiles one copy.
///
/// The copies hold what the wire computes (f32, f16 and bf16 sums and averages, the
/// conversions, fp8); min, max and prod, and f64 and integer reductions, keep the build's copy,
/// which saves most of the copies' compile time. An unoptimized build (no __OPTIMIZE__) compiles no copy.
///
/// `DDP_KERNELS=baseline` (or `avx2`) in the environment caps the copy (for A/B timing; another
/// value is named on stderr and ignored);
/// `DDP_NO_ISA_DISPATCH` compiles the run-time copies out (clang, which has no `#pragma GCC
/// target`, never compiles them).

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

// Only in optimized builds: an unoptimized one would pay the copies' compile time (in each unit
// that instantiates the kernels) for no speed.
#if (defined(__x86_64__) || defined(__i386__)) && !defined(__AVX2__) && defined(__GNUC__) && !defined(__clang__) && \
    defined(__OPTIMIZE__) && !defined(DDP_NO_ISA_DISPATCH) && !defined(DDP_NO_F16C_DISPATCH)
#define DDP_DETAIL_ISA_DISPATCH 1
#else
#define DDP_DETAIL_ISA_DISPATCH 0
#endif

// The build's own copy: vectors one register wide (32 bytes under -mavx, else the 16 bytes of
// SSE2 and NEON), F16C's conversions where the target has them. Vectors wider than the target's
// registers would be split anyway, and passing them between the helpers would change the calling
// convention (gcc's -Wpsabi), so they are not used.
#if defined(__AVX__)
#define DDP_DETAIL_VECTOR_BYTES 32
#else
#define DDP_DETAIL_VECTOR_BYTES 16
#endif
#if defined(__F16C__) && defined(__AVX__)
#define DDP_DETAIL_BASE_F16C 1
#else
#define DDP_DETAIL_BASE_F16C 0
#endif

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// The copies of the kernels, from the build's own up.
enum class isa : int { build = 0, avx2 = 1, avx512 = 2 };

#if DDP_DETAIL_ISA_DISPATCH
/// The best copy this CPU runs: AVX-512 (F, VL, BW, DQ) or AVX2, both with F16C
/// (`__builtin_cpu_supports` checks that the OS keeps the AVX state).
inline isa isa_of_cpu() noexcept {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("f16c")) return isa::build;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq"))
    return isa::avx512;
  return isa::avx2;
}
/// The copy that runs: the CPU's best, capped by `DDP_KERNELS` (`baseline`, `avx2`) or by
/// `isa_use`.
inline std::atomic<int>& isa_state() noexcept {
  static std::atomic<int> s{[] {
    int level = static_cast<int>(isa_of_cpu());
    if (const char* e = std::getenv("DDP_KERNELS"); e != nullptr && *e != '\0') {
      if (std::strcmp(e, "baseline") == 0)
        level = 0;
      else if (std::strcmp(e, "avx2") == 0)
        level = level > 1 ? 1 : level;
      else if (std::strcmp(e, "avx512") != 0)  // the best the CPU has, as when unset
        std::fprintf(stderr, "ddp: DDP_KERNELS='%s' is none of baseline, avx2, avx512: ignored\n", e);
    }
    return level;
  }()};
  return s;
}
inline isa isa_level() noexcept { return static_cast<isa>(isa_state().load(std::memory_order_relaxed)); }
/// Runs copy `want`, or the best below it that the CPU has; for tests that compare the copies
/// and for A/B timing. Returns the copy that now runs.
inline isa isa_use(isa want) noexcept {
  const int cpu = static_cast<int>(isa_of_cpu()), w = static_cast<int>(want);
  isa_state().store(w < cpu ? w : cpu, std::memory_order_relaxed);
  return isa_level();
}
#else
inline constexpr isa isa_level() noexcept { return isa::build; }
inline isa isa_use(isa) noexcept { return isa::build; }
#endif

/// The copy that runs now, in words.
inline const char* isa_name() noexcept {
  switch (isa_level()) {
    case isa::avx512:
      return "avx512 (chosen at run time)";
    case isa::avx2:
      return "avx2 (chosen at run time)";
    case isa::build:
      break;
  }
  return DDP_DETAIL_VECTOR_BYTES == 32 ? "the build's (32-byte vectors)" : "the build's (16-byte vectors)";
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp

/// `return kern::CALL;`, or the same call of the copy that runs (kern_v3, kern_v4).
#if DDP_DETAIL_ISA_DISPATCH
#define DDP_DETAIL_ISA_CALL(...)          \
  do {                                    \
    switch (::ddp::detail::isa_level()) { \
      case ::ddp::detail::isa::avx512:    \
        return kern_v4::__VA_ARGS__;      \
      case ::ddp::detail::isa::avx2:      \
        return kern_v3::__VA_ARGS__;      \
      case ::ddp::detail::isa::build:     \
        break;                            \
    }                                     \
    return kern::__VA_ARGS__;             \
  } while (false)
#else
#define DDP_DETAIL_ISA_CALL(...) return kern::__VA_ARGS__
#endif
