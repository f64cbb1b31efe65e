#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
/// \file detail/kernels.hpp
/// Host reduction kernels: elementwise `dst op= src`, the n-input `combine` at the heart of every
/// host allreduce, and the scaling of `op::avg` (see "Averages" below).
///
/// The kernels are single-threaded and pure: callers split work between threads or ranks with
/// `partition` (reducer/detail/schedule.hpp). They are written with GNU vector extensions rather than
/// left to the auto-vectorizer, because gcc's -O2 cost model ("very cheap") refuses loops that
/// need run-time alias checks, and these loops always would. Vectors are one register wide:
/// 32 bytes under -mavx, 16 bytes (SSE2) on the x86-64 baseline. The bodies live in
/// detail/kernels_body.hpp, compiled once per instruction set (detail/isa.hpp): a build for the
/// x86-64 baseline also has AVX2 + F16C and AVX-512 copies, the best the CPU has taken at run
/// time, so a plain -O2 build runs at -march=native's speed (bench/kernels, docs/tuning.md).
///
/// Semantics, identical in the vector body and in the tail (the tail runs the same vector code on
/// a zero-padded copy, so no element is ever computed by a different instruction sequence):
/// - sum / avg: IEEE addition, or wrapping two's-complement addition for integers.
/// - prod: IEEE multiplication, or wrapping multiplication for integers.
/// - min / max: comparisons that propagate NaN. `min(a, b)` is `b` when `b < a` or `b` is NaN,
///   otherwise `a`; so a NaN on either side yields a NaN, whatever the order in which ranks are
///   combined (a collective would otherwise report NaN or not depending on which rank held it).
///   For -0.0 against +0.0 the left operand `a` is kept, so the result depends on the operand
///   order; schedules fix that order (see reducer/detail/schedule.hpp).
/// - Every NaN an arithmetic kernel produces (op or avg) is the canonical positive quiet NaN
///   (0x7fc00000, 0x7ff8000000000000; 0x7e00 in f16, 0x7fc0 in bf16), so that NaN results are
///   bit-identical however operands were ordered and whichever conversion path was compiled.
///   Copies (one-input `combine`) keep bits.
/// - f16 / bf16: widened to float, combined in float. `reduce_into` rounds back after each
///   operation (it is one operation); `combine` accumulates all inputs in float and rounds once.
///   Rounding is to nearest even and matches `ddp::half` / `ddp::bfloat16` bit for bit,
///   subnormals included. Conversions are branch-free bit manipulation, or the F16C
///   instructions in the AVX2 copy and where the target has them (-mf16c, -march=x86-64-v3 or
///   native). The software f16 path costs about 25 instructions per element on SSE2, so f16
///   reductions are compute bound there (a CPU without AVX2 and F16C); bf16 needs only shifts.
///
/// Averages. A sum rounded to the element type before it is divided overflows whenever the sum
/// does (two ranks averaging f16 40000 would give inf), so floating-point `op::avg` never forms
/// the plain sum. Over a world of n >= 2 ranks, each rank's contribution enters the accumulator
/// multiplied by `pre` = 2^-(k+1), 2^k the smallest power of two >= n; partial results are sums
/// of scaled contributions, at most half the largest finite value even after rounding, so none
/// overflows; the step that finishes an element divides by `post` = n * 2^-(k+1), in (1/4, 1/2],
/// before its one rounding to the element type. Scaling by a power of two is exact (short of the
/// subnormal range), so wherever the plain sum did not overflow the result is bit for bit
/// `(sum) / n` as before, and where it did, it is the average. An average of finite values is
/// finite: a quotient that rounding alone carries past the type's largest value becomes that
/// value, not inf. See `avg_step`, and docs/reducers.md for the error bound. Integer avg is the
/// wrapping sum divided once, truncating toward zero.

#include <ddp/detail/compiled.hpp>
#include <ddp/dtype.hpp>
#include <ddp/detail/collective.hpp>
#include <ddp/detail/copy.hpp>
#include <ddp/detail/parallel.hpp>
#include <ddp/error.hpp>

#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include <ddp/detail/isa.hpp>

#if !defined(__GNUC__)
#error "ddp kernels need GNU vector extensions (gcc or clang)"
#endif

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// The scale factors of floating-point `op::avg` over `world` ranks (see "Averages" above):
/// each contribution is multiplied by `pre` = 2^-(k+1), 2^k the smallest power of two >= world,
/// and the finished sum is divided by `post` = world * pre. Both are exact in every float type.
/// A world of 1 has nothing to scale: {1, 1}.
struct avg_factors {
  double pre = 1.0;
  double post = 1.0;
};

constexpr avg_factors avg_factors_for(int world) noexcept {
  if (world <= 1) return {};
  double pre = 0.5;
  for (long long p2 = 1; p2 < world; p2 *= 2) pre /= 2;
  return {pre, world * pre};
}

/// How one `combine` takes part in an `op::avg` (other ops ignore it). Inputs
/// `ins[0, raw_from)` are partial results, already sums of scaled contributions; inputs
/// `ins[raw_from, nins)` are single ranks' contributions, scaled as they enter the sum. With
/// `finish` the result is final: it is divided by `post` (floats) or `world` (integers,
/// truncating) before its one rounding to the element type.
///
/// A ring step that adds its own data to a received partial result passes `{n, 1, last_step}`;
/// its first step, where both inputs are single ranks' data, `{n, 0, n == 2}`; the n-input
/// shared-memory reduction `{n, 0, true}`. The default, a world of 1, is a plain sum.
struct avg_step {
  int world = 1;        ///< ranks averaged over, >= 1
  int raw_from = 0;     ///< first input that is a single rank's contribution, in [0, nins]
  bool finish = false;  ///< divide the result: it is the average
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp

// The kernels, once per instruction set: namespace kern (the build's target) and, where the
// build is for the x86-64 baseline, kern_v3 (AVX2 and F16C), chosen at run time (detail/isa.hpp).
#define DDP_ISA_BODY <ddp/detail/kernels_body.hpp>
#include <ddp/detail/isa_each.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

namespace kern {

// The element types whose kernels have a copy per instruction set (detail/isa.hpp): the wire's,
// with the ops the wire reduces with (sum, avg); min, max and prod, and f64 and integers, run the
// build's copy. Fewer instantiations in the copies is less compile time.
template <class T>
inline constexpr bool isa_copied = std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

// Requires a valid `o` (and, for avg, a valid `a`): the entry points check them.
template <class T, class Out, class In>
inline void combine_any(Out const* outs, int nouts, In const* ins, int nins, std::size_t n, op o,
                        const avg_step& a) noexcept {
  if (nins <= 0 || nouts <= 0 || n == 0) return;
  const bool scales = o == op::avg && a.world > 1 && (a.raw_from == 0 || a.finish);
  if (nins == 1 && !scales) {
    const void* src = ins[0];
    for (int k = 0; k < nouts; ++k)
      if (static_cast<const void*>(outs[k]) != src) copy_bytes(static_cast<void*>(outs[k]), src, n * sizeof(T));
    return;
  }
  if constexpr (isa_copied<T>) {
    if (o == op::sum) DDP_DETAIL_ISA_CALL(combine_op<T, op::sum>(outs, nouts, ins, nins, n, a));
    if (o == op::avg) DDP_DETAIL_ISA_CALL(combine_op<T, op::avg>(outs, nouts, ins, nins, n, a));
  }
  kern::combine_run<T>(outs, nouts, ins, nins, n, o, a);
}

// The dtype and op checks are collective.hpp's (check_dtype, check_op), shared by every reducer.
inline void check_world(int world) {
  if (world < 1) raise(errc::invalid_argument, -1, "avg over a world of " + std::to_string(world) + " ranks");
}
inline void check_avg(op o, const avg_step& a, int nins) {
  if (o != op::avg) return;
  check_world(a.world);
  if (a.raw_from < 0 || a.raw_from > nins)
    raise(errc::invalid_argument, -1,
          "avg step: raw_from " + std::to_string(a.raw_from) + " outside [0, " + std::to_string(nins) + "]");
}

template <class F>
inline void dispatch(dtype t, F&& f) {
  switch (t) {
    case dtype::f32:
      f(float{});
      return;
    case dtype::f64:
      f(double{});
      return;
    case dtype::f16:
      f(half{});
      return;
    case dtype::bf16:
      f(bfloat16{});
      return;
    case dtype::i32:
      f(std::int32_t{});
      return;
    case dtype::i64:
      f(std::int64_t{});
      return;
  }
  detail::check_dtype(t, -1, "reduction kernel");
}

}  // namespace kern

/// Size of one element of `t`; an unknown dtype is `errc::invalid_argument` (where
/// `dtype_size` would answer 0 and a caller dividing by it would trap).
inline std::size_t checked_size(dtype t) {
  check_dtype(t, -1, "reduction kernel");
  return dtype_size(t);
}

/// True when `op::avg` over `t` scales contributions (floating types); integer averages are a
/// sum divided once at the end.
constexpr bool avg_scales(dtype t) noexcept {
  return t == dtype::f32 || t == dtype::f64 || t == dtype::f16 || t == dtype::bf16;
}

/// `dst[i] = dst[i] op src[i]` for i in [0, n). `op::avg` adds (averages are `combine`'s, with
/// an `avg_step`). `dst` and `src` may be the same pointer but must not otherwise overlap. No
/// alignment needed. An unknown `o` is `errc::invalid_argument`.
template <element T>
inline void reduce_into(T* dst, const T* src, std::size_t n, op o) {
  check_op(o, -1, "reduction kernel");
  if constexpr (kern::isa_copied<T>)
    if (o == op::sum || o == op::avg) DDP_DETAIL_ISA_CALL(reduce_op<T, op::sum>(dst, src, n));
  kern::reduce_run<T>(dst, src, n, o);
}

/// Writes `((ins[0] op ins[1]) op ins[2]) ... op ins[nins-1]`, elementwise and in exactly that
/// order, to every `outs[k]`. f16/bf16 accumulate in float and round once. For `op::avg`, `a`
/// says which inputs are single ranks' contributions and whether this step finishes the average
/// (see `avg_step`); the default is a plain sum.
///
/// Works in L1-sized tiles so that each input is read from memory once and each output written
/// once: rank r of a shared-memory allreduce calls it on slice r of every rank's buffer, with
/// `outs == ins`. Each output must either be one of the inputs (same pointer) or overlap none.
/// Requires `nins >= 1`; with one input the outputs receive a copy of it (scaled, for an average
/// that scales it). An unknown `o` or an invalid `a` is `errc::invalid_argument`.
template <element T>
inline void combine(T* const* outs, int nouts, const T* const* ins, int nins, std::size_t n, op o, avg_step a = {}) {
  check_op(o, -1, "reduction kernel");
  kern::check_avg(o, a, nins);
  kern::combine_any<T>(outs, nouts, ins, nins, n, o, a);
}

/// The first half of an average computed by a library that only sums (MPI): `dst[i] = src[i] *
/// pre` for floating types (`avg_factors_for`; exact short of the subnormal range, rounded once
/// there), a copy for integers. `dst` may be `src`. Then sum, then `avg_finish`.
template <element T>
inline void avg_prescale(T* dst, const T* src, std::size_t n, int world) {
  kern::check_world(world);
  // The one-input combine of a single rank's contribution that does not finish.
  // Through the type-erased pointers, as combine(): one set of instantiations serves both.
  void* outs[1] = {dst};
  const void* ins[1] = {src};
  kern::combine_any<T>(outs, 1, ins, 1, n, op::avg, avg_step{world, 0, false});
}

/// The second half: divides a sum of `avg_prescale`d contributions by `post` (floats,
/// rounding once) or a plain sum by `world` (integers, truncating toward zero).
template <element T>
inline void avg_finish(T* p, std::size_t n, int world) {
  kern::check_world(world);
  // The one-input combine of a partial result that finishes.
  void* outs[1] = {p};
  const void* ins[1] = {p};
  kern::combine_any<T>(outs, 1, ins, 1, n, op::avg, avg_step{world, 1, true});
}

/// Type-erased `reduce_into`: `dst` and `src` hold `n` elements of `t`.
void reduce_into(void* dst, const void* src, std::size_t n, dtype t, op o);
/// Type-erased `combine`. Large reductions are split across the installed parallel hook
/// (ddp/parallel/tbb.hpp), when there is one; each piece keeps the fixed order of inputs, so the
/// bits do not depend on how it was split.
void combine(void* const* outs, int nouts, const void* const* ins, int nins, std::size_t n, dtype t, op o,
             avg_step a = {});
/// Type-erased `avg_prescale`.
void avg_prescale(void* dst, const void* src, std::size_t n, dtype t, int world);
/// Type-erased `avg_finish`.
void avg_finish(void* p, std::size_t n, dtype t, int world);
// Their definitions: detail/kernels_impl.hpp (compiled once by src/ddp.cpp in compiled mode,
// detail/compiled.hpp), so that a unit that only calls them instantiates no kernel.

/// The largest |src[i]| over the finite elements (0 when there is none): NaN and inf are left
/// out, so that a compression scale still fits the finite values next to them.
inline float max_abs_finite(const float* src, std::size_t n) noexcept {
  DDP_DETAIL_ISA_CALL(max_abs_finite_run(src, n));
}

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

/// `dst[i] = half(src[i] * scale)`, rounded to nearest even; NaN canonical; with `saturate`
/// finite values beyond 65504 become +-65504 instead of inf. `dst` must not overlap `src`.
inline void narrow_to_f16(half* dst, const float* src, std::size_t n, float scale = 1.0f,
                          bool saturate = false) noexcept {
  DDP_DETAIL_ISA_CALL(narrow_loop<half>(dst, src, n, scale, saturate));
}
/// `dst[i] = bfloat16(src[i] * scale)`, as `narrow_to_f16`.
inline void narrow_to_bf16(bfloat16* dst, const float* src, std::size_t n, float scale = 1.0f,
                           bool saturate = false) noexcept {
  DDP_DETAIL_ISA_CALL(narrow_loop<bfloat16>(dst, src, n, scale, saturate));
}
/// `dst[i] = float(src[i]) * scale`; NaN canonical. `dst` must not overlap `src`.
inline void widen_from_f16(float* dst, const half* src, std::size_t n, float scale = 1.0f) noexcept {
  DDP_DETAIL_ISA_CALL(widen_loop<half>(dst, src, n, scale));
}
/// `dst[i] = float(src[i]) * scale`, as `widen_from_f16`.
inline void widen_from_bf16(float* dst, const bfloat16* src, std::size_t n, float scale = 1.0f) noexcept {
  DDP_DETAIL_ISA_CALL(widen_loop<bfloat16>(dst, src, n, scale));
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp

#if !defined(DDP_SEPARATE_COMPILATION)
#include <ddp/detail/kernels_impl.hpp>
#endif
