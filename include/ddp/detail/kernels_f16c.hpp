#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The bulk conversions between f32 and f16/bf16 (narrow_to_f16, widen_from_f16, and their bf16
// twins, for the compression hooks), and the F16C path that they and the f16 kernels of
// detail/kernels.hpp take at run time where the CPU has it.
// Part of detail/kernels.hpp, which includes it at its end (the kernels there declare what they
// call of it); including it alone includes the kernels first.

#include <ddp/detail/kernels.hpp>

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#if DDP_DETAIL_F16C_DISPATCH
#include <cpuid.h>
#endif

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

// ---- bulk conversions between f32 and a 16-bit wire type (compression hooks) ----------------
//
// `narrow` writes round-to-nearest-even(src[i] * scale) as f16 or bf16, `widen` writes
// float(src[i]) * scale. With scale 1 and no saturation the rounding is bit for bit that of
// `ddp::half` / `ddp::bfloat16` (subnormals included) for every value but NaN: every NaN
// becomes the canonical quiet NaN (0x7e00, 0x7fc0; 0x7fc00000 when widened), as the arithmetic
// kernels produce it, so that the F16C and the software paths agree bit for bit. A power-of-two
// scale is exact short of the subnormal ranges, so then there is one rounding per element.
// `saturate`: a finite value whose rounding would overflow becomes the type's largest finite
// value of its sign (never a silent inf); infinities stay infinite.

namespace kern {

template <class W>
[[gnu::always_inline]] inline f32v narrow_prepare(f32v v, f32v scale, bool saturate) noexcept {
  v = canonical_nan<float>(v * scale);
  if (saturate) {
    const i32v sign = i32v{} + std::numeric_limits<std::int32_t>::min();  // the sign bit
    const f32v a = reinterpret_cast<f32v>(reinterpret_cast<i32v>(v) & ~sign);
    const f32v top = f32v{} + max_finite<W>();
    const i32v over = (a > top) & (a <= std::numeric_limits<float>::max());  // finite only
    v = select(over, reinterpret_cast<f32v>((reinterpret_cast<i32v>(v) & sign) | reinterpret_cast<i32v>(top)), v);
  }
  return v;
}

template <class W>
inline void narrow_loop(W* dst, const float* src, std::size_t n, float scale, bool saturate) noexcept {
  using L = lanes<float>;
  constexpr std::size_t w = L::width;
  const f32v s = f32v{} + scale;
  std::size_t i = 0;
  for (; i + w <= n; i += w) lanes<W>::store(dst + i, narrow_prepare<W>(L::load(src + i), s, saturate));
  if (i < n) store_n(dst + i, narrow_prepare<W>(load_n(src + i, n - i), s, saturate), n - i);
}

template <class W>
inline void widen_loop(float* dst, const W* src, std::size_t n, float scale) noexcept {
  using L = lanes<float>;
  constexpr std::size_t w = L::width;
  const f32v s = f32v{} + scale;
  std::size_t i = 0;
  for (; i + w <= n; i += w) L::store(dst + i, canonical_nan<float>(lanes<W>::load(src + i) * s));
  if (i < n) store_n(dst + i, canonical_nan<float>(load_n(src + i, n - i) * s), n - i);
}

}  // namespace kern

// ---- F16C at run time ------------------------------------------------------------------------
//
// In a build for the x86-64 baseline the f16 paths of detail/kernels.hpp and the conversions
// above convert in software (about 25 instructions an element); nearly every x86-64 CPU since
// 2012 converts 4 or 8 at a time with F16C. Where the CPU has it (and the OS keeps the AVX state), the f16 entry points
// run these instead, compiled for that one target with a function attribute: the bulk conversions, and `reduce_into` /
// `combine` over L1-sized tiles: widen the inputs (exact), run the float kernel on the tiles (the f16 kernels compute
// in float anyway, by the same operations), round once to f16. The one place the float kernel differs, the clamp of a
// finished average that rounding carried past the largest value, is the narrowing's `saturate`. Same bits as the
// software path for every input (tests/unit/test_kernels.cpp runs both). DDP_NO_F16C_DISPATCH compiles it out.
#if DDP_DETAIL_F16C_DISPATCH
namespace kern {

/// Whether the run-time F16C path is taken: the CPU has F16C and AVX, the OS saves the AVX
/// state, and `f16c_disable` has not turned it off.
inline std::atomic<int>& f16c_state() noexcept {
  static std::atomic<int> s{[] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(1, &a, &b, &c, &d) == 0) return 0;
    const bool osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u, f16c = (c >> 29) & 1u;
    if (!osxsave || !avx || !f16c) return 0;
    unsigned lo = 0, hi = 0;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0u));  // XCR0: SSE and AVX state enabled
    return (lo & 6u) == 6u ? 1 : 0;
  }()};
  return s;
}
inline bool f16c_on() noexcept { return f16c_state().load(std::memory_order_relaxed) == 1; }
/// Turns the run-time F16C path off (or back on where the CPU has it); for tests that compare
/// it with the software path. Returns whether it was on.
inline bool f16c_enable(bool on) noexcept {
  static const bool cpu = f16c_on();
  return f16c_state().exchange(on && cpu ? 1 : 0) == 1;
}

namespace f16c {

typedef float f4 __attribute__((vector_size(16)));
typedef std::int32_t i4 __attribute__((vector_size(16)));
typedef short h8 __attribute__((vector_size(16)));

typedef long long q2 __attribute__((vector_size(16)));

// Eight halves at a time: one 16-byte load or store, two conversions of four. (Four at a time
// through an 8-byte memcpy went through the stack: a store-forwarding stall per vector.)
[[gnu::target("avx,f16c"), gnu::always_inline]] inline void load8(const half* p, f4& lo, f4& hi) noexcept {
  h8 h;
  std::memcpy(&h, p, sizeof h);
  lo = __builtin_ia32_vcvtph2ps(h);
  hi = __builtin_ia32_vcvtph2ps(
      reinterpret_cast<h8>(__builtin_shufflevector(reinterpret_cast<q2>(h), reinterpret_cast<q2>(h), 1, 1)));
}
[[gnu::target("avx,f16c"), gnu::always_inline]] inline void store8(half* p, f4 lo, f4 hi) noexcept {
  const q2 l = reinterpret_cast<q2>(__builtin_ia32_vcvtps2ph(lo, 0));  // round to nearest even
  const q2 u = reinterpret_cast<q2>(__builtin_ia32_vcvtps2ph(hi, 0));
  const q2 h = __builtin_shufflevector(l, u, 0, 2);
  std::memcpy(static_cast<void*>(p), &h, sizeof h);
}
[[gnu::target("avx,f16c"), gnu::always_inline]] inline f4 canonical(f4 v) noexcept {
  const i4 nan = v != v;
  return reinterpret_cast<f4>((nan & (i4{} + 0x7fc00000)) | (~nan & reinterpret_cast<i4>(v)));
}
// narrow_prepare<half>'s clamp: a finite value beyond 65504 becomes +-65504.
[[gnu::target("avx,f16c"), gnu::always_inline]] inline f4 clamp(f4 v) noexcept {
  const i4 sign = i4{} + std::numeric_limits<std::int32_t>::min();
  const f4 a = reinterpret_cast<f4>(reinterpret_cast<i4>(v) & ~sign);
  const i4 over = (a > 65504.0f) & (a <= std::numeric_limits<float>::max());
  const i4 top = (reinterpret_cast<i4>(v) & sign) | std::bit_cast<std::int32_t>(65504.0f);
  return reinterpret_cast<f4>((over & top) | (~over & reinterpret_cast<i4>(v)));
}

// One vector of `narrow`: round(v * s), NaN canonical, with `Saturate` the clamp. (No lambdas
// here: a lambda would not inherit the target attribute.)
template <bool Saturate>
[[gnu::target("avx,f16c"), gnu::always_inline]] inline f4 narrow_one(f4 v, f4 s) noexcept {
  v = canonical(v * s);
  if constexpr (Saturate) v = clamp(v);
  return v;
}
template <bool Saturate>
[[gnu::target("avx,f16c"), gnu::always_inline]] inline void narrow_loop(half* dst, const float* src, std::size_t n,
                                                                        float scale) noexcept {
  const f4 s = f4{} + scale;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    f4 lo, hi;
    std::memcpy(&lo, src + i, sizeof lo);
    std::memcpy(&hi, src + i + 4, sizeof hi);
    store8(dst + i, narrow_one<Saturate>(lo, s), narrow_one<Saturate>(hi, s));
  }
  if (i < n) {  // the same code on a zero-padded copy
    float t[8] = {};
    half u[8];
    std::memcpy(t, src + i, (n - i) * sizeof(float));
    f4 lo, hi;
    std::memcpy(&lo, t, sizeof lo);
    std::memcpy(&hi, t + 4, sizeof hi);
    store8(u, narrow_one<Saturate>(lo, s), narrow_one<Saturate>(hi, s));
    std::memcpy(static_cast<void*>(dst + i), u, (n - i) * sizeof(half));
  }
}

/// `narrow_to_f16`: round(src * scale), NaN canonical, with `saturate` the clamp.
[[gnu::target("avx,f16c")]] inline void narrow(half* dst, const float* src, std::size_t n, float scale,
                                               bool saturate) noexcept {
  if (saturate)
    narrow_loop<true>(dst, src, n, scale);
  else
    narrow_loop<false>(dst, src, n, scale);
}

template <bool Canonical>
[[gnu::target("avx,f16c"), gnu::always_inline]] inline void widen_loop(float* dst, const half* src, std::size_t n,
                                                                       float scale) noexcept {
  const f4 s = f4{} + scale;
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    f4 lo, hi;
    load8(src + i, lo, hi);
    if constexpr (Canonical) {
      lo = canonical(lo * s);
      hi = canonical(hi * s);
    }
    std::memcpy(dst + i, &lo, sizeof lo);
    std::memcpy(dst + i + 4, &hi, sizeof hi);
  }
  if (i < n) {
    half t[8] = {};
    std::memcpy(static_cast<void*>(t), src + i, (n - i) * sizeof(half));
    f4 lo, hi;
    load8(t, lo, hi);
    if constexpr (Canonical) {
      lo = canonical(lo * s);
      hi = canonical(hi * s);
    }
    float u[8];
    std::memcpy(u, &lo, sizeof lo);
    std::memcpy(u + 4, &hi, sizeof hi);
    std::memcpy(dst + i, u, (n - i) * sizeof(float));
  }
}

/// `widen_from_f16` (`canonical_nan`: NaN canonical, then times `scale`), or the exact widening
/// of `lanes<half>::load` (`canonical_nan` false, scale 1: NaN payloads kept, quieted).
[[gnu::target("avx,f16c")]] inline void widen(float* dst, const half* src, std::size_t n, float scale,
                                              bool canonical_nan) noexcept {
  if (canonical_nan)
    widen_loop<true>(dst, src, n, scale);
  else
    widen_loop<false>(dst, src, n, scale);
}

// Floats of tile scratch on the stack: inputs and one output, each `tile` long.
inline constexpr std::size_t scratch_floats = 8192;

}  // namespace f16c

/// `reduce_into<half>` over tiles: dst and src widened, the float loop, rounded once to dst.
[[gnu::target("avx,f16c")]] inline void reduce_into_f16c(half* dst, const half* src, std::size_t n, op o) noexcept {
  constexpr std::size_t tile = f16c::scratch_floats / 2;
  alignas(64) float a[tile], b[tile];
  for (std::size_t base = 0; base < n; base += tile) {
    const std::size_t m = n - base < tile ? n - base : tile;
    f16c::widen(a, dst + base, m, 1.0f, false);
    f16c::widen(b, src + base, m, 1.0f, false);
    switch (o) {
      case op::sum:
      case op::avg:
        reduce_loop<float, op::sum>(a, b, m);
        break;
      case op::min:
        reduce_loop<float, op::min>(a, b, m);
        break;
      case op::max:
        reduce_loop<float, op::max>(a, b, m);
        break;
      case op::prod:
        reduce_loop<float, op::prod>(a, b, m);
        break;
    }
    f16c::narrow(dst + base, a, m, 1.0f, false);
  }
}

/// `combine_any<half>` over tiles (false: too many inputs for the scratch; the caller then runs
/// the software path). Every input of a tile is read before any output of it is written, as in
/// `combine_loop`, so an output may be an input.
template <class Out, class In>
[[gnu::target("avx,f16c")]] bool combine_f16c(Out const* outs, int nouts, In const* ins, int nins, std::size_t n, op o,
                                              const avg_step& a) noexcept {
  const std::size_t tile = (f16c::scratch_floats / static_cast<std::size_t>(nins + 1)) & ~std::size_t{7};
  if (tile < 64) return false;
  alignas(64) float scratch[f16c::scratch_floats];
  // A finished average that the float kernel leaves beyond 65504 is clamped, as avg_out<half>.
  const bool saturate = o == op::avg && a.finish && a.world > 1;
  float* out = scratch + static_cast<std::size_t>(nins) * tile;
  const void* fins[f16c::scratch_floats / 64];
  for (int j = 0; j < nins; ++j) fins[j] = scratch + static_cast<std::size_t>(j) * tile;
  void* fout[1] = {out};
  for (std::size_t base = 0; base < n; base += tile) {
    const std::size_t m = n - base < tile ? n - base : tile;
    for (int j = 0; j < nins; ++j)
      f16c::widen(scratch + static_cast<std::size_t>(j) * tile, static_cast<const half*>(ins[j]) + base, m, 1.0f,
                  false);
    combine_any<float>(fout, 1, fins, nins, m, o, a);
    for (int k = 0; k < nouts; ++k) f16c::narrow(static_cast<half*>(outs[k]) + base, out, m, 1.0f, saturate);
  }
  return true;
}

}  // namespace kern
#endif

/// `dst[i] = half(src[i] * scale)`, rounded to nearest even; NaN canonical; with `saturate`
/// finite values beyond 65504 become +-65504 instead of inf. `dst` must not overlap `src`.
inline void narrow_to_f16(half* dst, const float* src, std::size_t n, float scale = 1.0f,
                          bool saturate = false) noexcept {
#if DDP_DETAIL_F16C_DISPATCH
  if (kern::f16c_on()) return kern::f16c::narrow(dst, src, n, scale, saturate);
#endif
  kern::narrow_loop<half>(dst, src, n, scale, saturate);
}
/// `dst[i] = bfloat16(src[i] * scale)`, as `narrow_to_f16`.
inline void narrow_to_bf16(bfloat16* dst, const float* src, std::size_t n, float scale = 1.0f,
                           bool saturate = false) noexcept {
  kern::narrow_loop<bfloat16>(dst, src, n, scale, saturate);
}
/// `dst[i] = float(src[i]) * scale`; NaN canonical. `dst` must not overlap `src`.
inline void widen_from_f16(float* dst, const half* src, std::size_t n, float scale = 1.0f) noexcept {
#if DDP_DETAIL_F16C_DISPATCH
  if (kern::f16c_on()) return kern::f16c::widen(dst, src, n, scale, true);
#endif
  kern::widen_loop<half>(dst, src, n, scale);
}
/// `dst[i] = float(src[i]) * scale`, as `widen_from_f16`.
inline void widen_from_bf16(float* dst, const bfloat16* src, std::size_t n, float scale = 1.0f) noexcept {
  kern::widen_loop<bfloat16>(dst, src, n, scale);
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
