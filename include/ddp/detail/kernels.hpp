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
/// 32 bytes under -mavx, 16 bytes (SSE2) on the x86-64 baseline.
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
///   instructions when the target has them (-mf16c, -march=x86-64-v3 or native). The software
///   f16 path costs about 25 instructions per element on SSE2, so f16 reductions are compute
///   bound there (~1.5 GB/s against ~19 GB/s with F16C); bf16 needs only shifts.
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

#if !defined(__GNUC__)
#error "ddp kernels need GNU vector extensions (gcc or clang)"
#endif

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

// A build for the x86-64 baseline (no -mf16c) still converts f16 with the F16C instructions
// when the CPU has them, chosen at run time (detail/kernels_f16c.hpp, "F16C at run time").
#if !(defined(__F16C__) && defined(__AVX__)) && (defined(__x86_64__) || defined(__i386__)) && \
    !defined(DDP_NO_F16C_DISPATCH)
#define DDP_DETAIL_F16C_DISPATCH 1  // detail/kernels_f16c.hpp
#else
#define DDP_DETAIL_F16C_DISPATCH 0
#endif

// Vector width follows the target: 32 bytes with AVX, else the 16 bytes of SSE2 (and NEON).
// Vectors wider than the target's registers would be split anyway, and passing them between
// the helpers below would change the calling convention (gcc's -Wpsabi), so they are not used.
#if defined(__AVX__)
#define DDP_DETAIL_VECTOR_BYTES 32
#else
#define DDP_DETAIL_VECTOR_BYTES 16
#endif

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

namespace kern {

inline constexpr std::size_t vector_bytes = DDP_DETAIL_VECTOR_BYTES;
typedef float f32v __attribute__((vector_size(DDP_DETAIL_VECTOR_BYTES)));
typedef double f64v __attribute__((vector_size(DDP_DETAIL_VECTOR_BYTES)));
typedef std::int32_t i32v __attribute__((vector_size(DDP_DETAIL_VECTOR_BYTES)));
typedef std::uint32_t u32v __attribute__((vector_size(DDP_DETAIL_VECTOR_BYTES)));
typedef std::int64_t i64v __attribute__((vector_size(DDP_DETAIL_VECTOR_BYTES)));
typedef std::uint64_t u64v __attribute__((vector_size(DDP_DETAIL_VECTOR_BYTES)));
// 16-bit storage of one f32v worth of lanes.
typedef std::uint16_t u16v __attribute__((vector_size(DDP_DETAIL_VECTOR_BYTES / 2)));

template <class V, class M>
[[gnu::always_inline]] inline V select(M mask, V yes, V no) noexcept {
  return reinterpret_cast<V>((reinterpret_cast<M>(yes) & mask) | (reinterpret_cast<M>(no) & ~mask));
}

// ---- 16-bit float conversions, branch-free so they vectorize --------------------------------

// binary16 -> binary32; `h` holds the half in its low 16 bits.
[[gnu::always_inline]] inline f32v half_to_float(u32v h) noexcept {
  const u32v sign = (h & 0x8000u) << 16;
  u32v o = (h & 0x7fffu) << 13;  // exponent and mantissa in float position
  const i32v e = reinterpret_cast<i32v>(o & 0x0f800000u);
  o += (127u - 15u) << 23;                  // rebias the exponent
  const i32v is_special = e == 0x0f800000;  // inf / nan: exponent goes to 255
  o += reinterpret_cast<u32v>(is_special) & ((128u - 16u) << 23);
  // Zero and subnormal: exponent field is 1 after rebias plus 1; subtracting 2^-14 leaves
  // mantissa * 2^-24 exactly.
  const i32v is_small = e == 0;
  const f32v small = reinterpret_cast<f32v>(o + (1u << 23)) - 6.103515625e-05f;  // 2^-14
  o = select(is_small, reinterpret_cast<u32v>(small), o);
  return reinterpret_cast<f32v>(o | sign);
}

// binary32 -> binary16 (round to nearest even), result in the low 16 bits.
[[gnu::always_inline]] inline u32v float_to_half(f32v f) noexcept {
  const u32v x = reinterpret_cast<u32v>(f);
  const u32v sign = (x >> 16) & 0x8000u;
  const u32v absx = x & 0x7fffffffu;
  const i32v sabs = reinterpret_cast<i32v>(absx);  // < 2^31, so a signed compare is exact
  // Normal range: rebias by -112 and round to nearest even on the 13 dropped bits.
  const u32v normal = (absx + 0xc8000fffu + ((absx >> 13) & 1u)) >> 13;
  // Half subnormals: adding 0.5 puts the value's units of 2^-24 in the low mantissa bits and
  // lets the float adder do the round-to-nearest-even.
  const f32v absf = reinterpret_cast<f32v>(absx);
  const u32v sub = reinterpret_cast<u32v>(absf + 0.5f) - 0x3f000000u;
  u32v r = select(sabs < 0x38800000, sub, normal);
  r = select(sabs >= 0x477ff000, u32v{} + 0x7c00u, r);  // overflow and inf
  r = select(sabs > 0x7f800000, u32v{} + 0x7e00u, r);   // nan -> quiet nan
  return r | sign;
}

[[gnu::always_inline]] inline f32v bf16_to_float(u32v b) noexcept { return reinterpret_cast<f32v>(b << 16); }

[[gnu::always_inline]] inline u32v float_to_bf16(f32v f) noexcept {
  const u32v x = reinterpret_cast<u32v>(f);
  const u32v rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const u32v quiet = (x >> 16) | 0x40u;
  const i32v is_nan = reinterpret_cast<i32v>(x & 0x7fffffffu) > 0x7f800000;
  return select(is_nan, quiet, rounded);
}

// ---- lanes: how one element type is loaded, computed and stored ------------------------------
//
// `vec` is the compute vector (float for the 16-bit types), `width` its lane count; `load` and
// `store` move `width` stored elements. Integer lanes compute as signed (for min/max) and switch
// to unsigned for +/* so that overflow wraps instead of being undefined.

template <class T>
struct lanes;

template <>
struct lanes<float> {
  using scalar = float;
  using vec = f32v;
  using mask = i32v;
  static constexpr std::size_t width = vector_bytes / 4;
  static constexpr bool is_float = true;
  static vec load(const float* p) noexcept {
    vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(float* p, vec v) noexcept { std::memcpy(p, &v, sizeof v); }
};

template <>
struct lanes<double> {
  using scalar = double;
  using vec = f64v;
  using mask = i64v;
  static constexpr std::size_t width = vector_bytes / 8;
  static constexpr bool is_float = true;
  static vec load(const double* p) noexcept {
    vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(double* p, vec v) noexcept { std::memcpy(p, &v, sizeof v); }
};

template <>
struct lanes<std::int32_t> {
  using vec = i32v;
  using uvec = u32v;
  static constexpr std::size_t width = vector_bytes / 4;
  static constexpr bool is_float = false;
  static vec load(const std::int32_t* p) noexcept {
    vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(std::int32_t* p, vec v) noexcept { std::memcpy(p, &v, sizeof v); }
};

template <>
struct lanes<std::int64_t> {
  using vec = i64v;
  using uvec = u64v;
  static constexpr std::size_t width = vector_bytes / 8;
  static constexpr bool is_float = false;
  static vec load(const std::int64_t* p) noexcept {
    vec v;
    std::memcpy(&v, p, sizeof v);
    return v;
  }
  static void store(std::int64_t* p, vec v) noexcept { std::memcpy(p, &v, sizeof v); }
};

template <>
struct lanes<half> {
  using scalar = float;
  using vec = f32v;
  using mask = i32v;
  static constexpr std::size_t width = vector_bytes / 4;
  static constexpr bool is_float = true;
#if defined(__F16C__) && defined(__AVX__)
  // The hardware conversions are exact and round to nearest even like ddp::half; they differ
  // only in NaN payloads, and every NaN reaching `store` from an operation is canonical.
  static vec load(const half* p) noexcept {
    return reinterpret_cast<vec>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void store(half* p, vec v) noexcept {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(reinterpret_cast<__m256>(v), _MM_FROUND_TO_NEAREST_INT));
  }
#else
  static vec load(const half* p) noexcept {
    u16v h;
    std::memcpy(&h, p, sizeof h);
    return half_to_float(__builtin_convertvector(h, u32v));
  }
  static void store(half* p, vec v) noexcept {
    const u16v h = __builtin_convertvector(float_to_half(v), u16v);
    std::memcpy(static_cast<void*>(p), &h, sizeof h);
  }
#endif
};

template <>
struct lanes<bfloat16> {
  using scalar = float;
  using vec = f32v;
  using mask = i32v;
  static constexpr std::size_t width = vector_bytes / 4;
  static constexpr bool is_float = true;
  static vec load(const bfloat16* p) noexcept {
    u16v h;
    std::memcpy(&h, p, sizeof h);
    return bf16_to_float(__builtin_convertvector(h, u32v));
  }
  static void store(bfloat16* p, vec v) noexcept {
    const u16v h = __builtin_convertvector(float_to_bf16(v), u16v);
    std::memcpy(static_cast<void*>(p), &h, sizeof h);
  }
};

static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2, "16-bit storage types must be packed");

// Partial vectors for the tail: the same vector code runs on a zero-padded copy.
template <class T>
[[gnu::always_inline]] inline typename lanes<T>::vec load_n(const T* p, std::size_t k) noexcept {
  T tmp[lanes<T>::width];
  std::memset(static_cast<void*>(tmp), 0, sizeof tmp);
  std::memcpy(static_cast<void*>(tmp), p, k * sizeof(T));
  return lanes<T>::load(tmp);
}
template <class T>
[[gnu::always_inline]] inline void store_n(T* p, typename lanes<T>::vec v, std::size_t k) noexcept {
  T tmp[lanes<T>::width];
  lanes<T>::store(tmp, v);
  std::memcpy(static_cast<void*>(p), tmp, k * sizeof(T));
}

// ---- the operations, on compute vectors; `a` is the left (accumulated) operand -------------

// The compiler may swap the operands of a commutative +/*, and x86 returns the payload and sign
// of the first NaN operand, so a raw NaN result is not a function of the operand order written
// in the source. The canonical NaN is.
template <class T>
[[gnu::always_inline]] inline typename lanes<T>::vec canonical_nan(typename lanes<T>::vec r) noexcept {
  using L = lanes<T>;
  return select(r != r, typename L::vec{} + std::numeric_limits<typename L::scalar>::quiet_NaN(), r);
}

template <class T, op O>
[[gnu::always_inline]] inline typename lanes<T>::vec apply(typename lanes<T>::vec a,
                                                           typename lanes<T>::vec b) noexcept {
  using L = lanes<T>;
  using V = typename L::vec;
  if constexpr (L::is_float) {
    V r;
    if constexpr (O == op::sum || O == op::avg)
      r = a + b;
    else if constexpr (O == op::prod)
      r = a * b;
    else if constexpr (O == op::min)
      r = select((b < a) | (b != b), b, a);
    else
      r = select((b > a) | (b != b), b, a);
    return canonical_nan<T>(r);
  } else {
    using U = typename L::uvec;
    if constexpr (O == op::sum || O == op::avg)
      return reinterpret_cast<V>(reinterpret_cast<U>(a) + reinterpret_cast<U>(b));
    else if constexpr (O == op::prod)
      return reinterpret_cast<V>(reinterpret_cast<U>(a) * reinterpret_cast<U>(b));
    else if constexpr (O == op::min)
      return select(b < a, b, a);
    else
      return select(b > a, b, a);
  }
}

template <class T, op O>
inline void reduce_loop(T* dst, const T* src, std::size_t n) noexcept {
  using L = lanes<T>;
  constexpr std::size_t w = L::width;
  std::size_t i = 0;
  // Two vectors per iteration keeps two independent load-op-store chains in flight.
  for (; i + 2 * w <= n; i += 2 * w) {
    const auto r0 = apply<T, O>(L::load(dst + i), L::load(src + i));
    const auto r1 = apply<T, O>(L::load(dst + i + w), L::load(src + i + w));
    L::store(dst + i, r0);
    L::store(dst + i + w, r1);
  }
  for (; i + w <= n; i += w) L::store(dst + i, apply<T, O>(L::load(dst + i), L::load(src + i)));
  if (i < n) {
    const std::size_t k = n - i;
    store_n(dst + i, apply<T, O>(load_n(dst + i, k), load_n(src + i, k)), k);
  }
}

// Elements per tile of `combine`: the float accumulator of one tile is 4-8 KiB, well inside L1,
// so each input crosses the memory bus once and each output is written once.
inline constexpr std::size_t combine_tile = 1024;

}  // namespace kern

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

namespace kern {

// Largest finite value of a floating element type, in its compute type.
template <class T>
constexpr typename lanes<T>::scalar max_finite() noexcept {
  if constexpr (std::is_same_v<T, half>)
    return 65504.0f;
  else if constexpr (std::is_same_v<T, bfloat16>)
    return std::bit_cast<float>(0x7f7f0000u);
  else
    return std::numeric_limits<T>::max();
}

// `avg_step` with its factors broadcast to compute vectors.
template <class T>
struct avg_vec {
  using V = typename lanes<T>::vec;
  V pre{};   // floats: 2^-(k+1)
  V post{};  // floats: world * pre; integers: world
  V inv{};   // floats: 1 / post, used when it is exact (post a power of two)
  int raw_from = 0;
  bool finish = false;
  bool divide = false;  // post != 1
  bool by_inv = false;  // x * inv == x / post bit for bit
};

template <class T>
inline avg_vec<T> make_avg(const avg_step& a) noexcept {
  using L = lanes<T>;
  using V = typename L::vec;
  avg_vec<T> v;
  v.raw_from = a.raw_from;
  v.finish = a.finish;
  if constexpr (L::is_float) {
    using S = typename L::scalar;
    const avg_factors f = avg_factors_for(a.world);
    v.pre = V{} + static_cast<S>(f.pre);
    v.post = V{} + static_cast<S>(f.post);
    v.inv = V{} + static_cast<S>(1.0 / f.post);
    v.divide = f.post != 1.0;
    v.by_inv = (a.world & (a.world - 1)) == 0;  // post is then a power of two too
  } else {
    v.post = V{} + a.world;
    v.divide = a.world != 1;
  }
  return v;
}

// How a finishing step divides: not at all (a world of 1), by a multiply with the exact
// reciprocal (`post` a power of two), or by a true division.
enum class fin_mode { none, mul, div };

template <class T>
constexpr fin_mode finish_of(const avg_vec<T>& a) noexcept {
  if (!a.finish || !a.divide) return fin_mode::none;
  if constexpr (lanes<T>::is_float)
    return a.by_inv ? fin_mode::mul : fin_mode::div;
  else
    return fin_mode::div;
}

// A single rank's contribution entering an average.
template <class T>
[[gnu::always_inline]] inline typename lanes<T>::vec avg_in(typename lanes<T>::vec x,
                                                            typename lanes<T>::vec pre) noexcept {
  if constexpr (lanes<T>::is_float)
    return x * pre;
  else
    return x;
}

// The division that finishes an average: `d` is `post` (div) or its reciprocal (mul). Floats
// divide (a multiply by the reciprocal would differ in the last bit when `post` is not a power
// of two); integers truncate toward zero. A finite sum whose quotient lies beyond the type's
// largest value got there by rounding (the average of finite values is finite): it becomes
// that largest value rather than inf.
template <class T, fin_mode F>
[[gnu::always_inline]] inline typename lanes<T>::vec avg_out(typename lanes<T>::vec x,
                                                             typename lanes<T>::vec d) noexcept {
  using L = lanes<T>;
  using V = typename L::vec;
  if constexpr (F == fin_mode::none) {
    return x;
  } else if constexpr (L::is_float) {
    using M = typename L::mask;
    using S = typename L::scalar;
    V q;
    if constexpr (F == fin_mode::mul)
      q = x * d;
    else
      q = x / d;
    const M sign = reinterpret_cast<M>(-V{});  // -0.0: the sign bit alone (0.0 + -0.0 is +0.0)
    const V ax = reinterpret_cast<V>(reinterpret_cast<M>(x) & ~sign);
    const V aq = reinterpret_cast<V>(reinterpret_cast<M>(q) & ~sign);
    const V top = V{} + max_finite<T>();
    const M over = (aq > top) & (ax <= std::numeric_limits<S>::max());  // false for NaN
    const V clamped = reinterpret_cast<V>((reinterpret_cast<M>(q) & sign) | reinterpret_cast<M>(top));
    return canonical_nan<T>(select(over, clamped, q));
  } else {
    return x / d;
  }
}

// The finishing operand of `avg_out<T, F>`.
template <class T>
constexpr typename lanes<T>::vec finish_operand(const avg_vec<T>& a) noexcept {
  return finish_of(a) == fin_mode::mul ? a.inv : a.post;
}

// The loops of `combine`, one function each, with the average's loop-invariant flags as
// template arguments and its factors as vector arguments: no loop branches on them or reloads
// them, other ops compile to exactly the plain loops, and each loop's variables stay in
// registers (in one large function with lambdas, gcc kept a loop counter in a vector register
// and ran 3x slower).
//
// `Out`/`In` are `T*`/`const T*` or `void*`/`const void*` (the type-erased entry point): each
// pointer is converted on use, so a `void*` array is never read through a `T*` lvalue.

// Elements [i, i+k) of input `p` (k == width: a whole vector); `Raw`: a single rank's
// contribution, scaled on entry.
template <class T, bool Raw, bool Whole, class In>
[[gnu::always_inline]] inline typename lanes<T>::vec get_in(In p, std::size_t i, std::size_t k,
                                                            typename lanes<T>::vec pre) noexcept {
  using L = lanes<T>;
  const T* q = static_cast<const T*>(p) + i;
  typename L::vec x;
  if constexpr (Whole)
    x = L::load(q);
  else
    x = load_n(q, k);
  if constexpr (Raw) x = avg_in<T>(x, pre);
  return x;
}

// Writes `v` (elements [i, i+k) of the result) to every output, finishing an average first.
template <class T, fin_mode F, bool Whole, class Out>
[[gnu::always_inline]] inline void put_out(Out const* outs, int nouts, std::size_t i, typename lanes<T>::vec v,
                                           std::size_t k, typename lanes<T>::vec d) noexcept {
  using L = lanes<T>;
  v = avg_out<T, F>(v, d);
  if constexpr (Whole) {
    for (int o = 0; o < nouts; ++o) L::store(static_cast<T*>(outs[o]) + i, v);
  } else {
    for (int o = 0; o < nouts; ++o) store_n(static_cast<T*>(outs[o]) + i, v, k);
  }
}

// One input: only an average that scales or divides it gets here (combine_any copies otherwise).
template <class T, bool Raw, fin_mode F, class Out, class In>
inline void combine_1(Out const* outs, int nouts, In in0, std::size_t n, const typename lanes<T>::vec pre,
                      const typename lanes<T>::vec d) noexcept {
  using L = lanes<T>;
  constexpr std::size_t w = L::width;
  auto one = [&](auto whole, std::size_t i, std::size_t k) {
    auto x = get_in<T, Raw, decltype(whole)::value>(in0, i, k, pre);
    if constexpr (L::is_float) x = canonical_nan<T>(x);
    put_out<T, F, decltype(whole)::value>(outs, nouts, i, x, k, d);
  };
  std::size_t i = 0;
  for (; i + w <= n; i += w) one(std::true_type{}, i, w);
  if (i < n) one(std::false_type{}, i, n - i);
}

// Two inputs: no accumulator needed, one pass reads both inputs and writes every output.
template <class T, op O, bool Raw0, bool Raw1, fin_mode F, class Out, class In>
inline void combine_2(Out const* outs, int nouts, In in0, In in1, std::size_t n, const typename lanes<T>::vec pre,
                      const typename lanes<T>::vec d) noexcept {
  constexpr std::size_t w = lanes<T>::width;
  std::size_t i = 0;
  for (; i + w <= n; i += w)
    put_out<T, F, true>(outs, nouts, i,
                        apply<T, O>(get_in<T, Raw0, true>(in0, i, w, pre), get_in<T, Raw1, true>(in1, i, w, pre)), w,
                        d);
  if (i < n) {
    const std::size_t k = n - i;
    put_out<T, F, false>(outs, nouts, i,
                         apply<T, O>(get_in<T, Raw0, false>(in0, i, k, pre), get_in<T, Raw1, false>(in1, i, k, pre)), k,
                         d);
  }
}

// Three or more inputs, tile by tile: the first two inputs into the accumulator, then each
// further one, then the last on the way out. `m` elements from `base`; the accumulator's last
// vector may be partial.
template <class T, op O, bool Raw0, bool Raw1, class In>
[[gnu::noinline]] void tile_first(typename lanes<T>::vec* acc, In in0, In in1, std::size_t base, std::size_t m,
                                  const typename lanes<T>::vec pre) noexcept {
  constexpr std::size_t w = lanes<T>::width;
  std::size_t v = 0;
  for (; (v + 1) * w <= m; ++v)
    acc[v] =
        apply<T, O>(get_in<T, Raw0, true>(in0, base + v * w, w, pre), get_in<T, Raw1, true>(in1, base + v * w, w, pre));
  if (v * w < m)
    acc[v] = apply<T, O>(get_in<T, Raw0, false>(in0, base + v * w, m - v * w, pre),
                         get_in<T, Raw1, false>(in1, base + v * w, m - v * w, pre));
}
template <class T, op O, bool Raw, class In>
[[gnu::noinline]] void tile_next(typename lanes<T>::vec* acc, In in, std::size_t base, std::size_t m,
                                 const typename lanes<T>::vec pre) noexcept {
  constexpr std::size_t w = lanes<T>::width;
  std::size_t v = 0;
  for (; (v + 1) * w <= m; ++v) acc[v] = apply<T, O>(acc[v], get_in<T, Raw, true>(in, base + v * w, w, pre));
  if (v * w < m) acc[v] = apply<T, O>(acc[v], get_in<T, Raw, false>(in, base + v * w, m - v * w, pre));
}
template <class T, op O, bool Raw, fin_mode F, class Out, class In>
[[gnu::noinline]] void tile_last(Out const* outs, int nouts, const typename lanes<T>::vec* acc, In in, std::size_t base,
                                 std::size_t m, const typename lanes<T>::vec pre,
                                 const typename lanes<T>::vec d) noexcept {
  constexpr std::size_t w = lanes<T>::width;
  std::size_t v = 0;
  for (; (v + 1) * w <= m; ++v)
    put_out<T, F, true>(outs, nouts, base + v * w, apply<T, O>(acc[v], get_in<T, Raw, true>(in, base + v * w, w, pre)),
                        w, d);
  if (v * w < m)
    put_out<T, F, false>(outs, nouts, base + v * w,
                         apply<T, O>(acc[v], get_in<T, Raw, false>(in, base + v * w, m - v * w, pre)), m - v * w, d);
}

// Calls f(std::bool_constant<b>{}); for ops other than avg every flag is false.
template <op O, class F>
[[gnu::always_inline]] inline void with_flag(bool b, F&& f) {
  if constexpr (O == op::avg) {
    if (b)
      f(std::true_type{});
    else
      f(std::false_type{});
  } else {
    f(std::false_type{});
  }
}
// Calls f(std::integral_constant<fin_mode, m>{}); for ops other than avg, none.
template <op O, class F>
[[gnu::always_inline]] inline void with_fin(fin_mode m, F&& f) {
  if constexpr (O == op::avg) {
    switch (m) {
      case fin_mode::none:
        f(std::integral_constant<fin_mode, fin_mode::none>{});
        return;
      case fin_mode::mul:
        f(std::integral_constant<fin_mode, fin_mode::mul>{});
        return;
      case fin_mode::div:
        f(std::integral_constant<fin_mode, fin_mode::div>{});
        return;
    }
  } else {
    f(std::integral_constant<fin_mode, fin_mode::none>{});
  }
}

template <class T, op O, class Out, class In>
inline void combine_loop(Out const* outs, int nouts, In const* ins, int nins, std::size_t n,
                         const avg_vec<T>& av) noexcept {
  using V = typename lanes<T>::vec;
  static_assert(combine_tile % lanes<T>::width == 0);
  constexpr bool avg = O == op::avg;
  const fin_mode fin = avg ? finish_of(av) : fin_mode::none;
  const V pre = av.pre, d = finish_operand(av);
  auto raw = [&](int j) { return avg && j >= av.raw_from; };

  if (nins == 1) {
    if constexpr (avg) {
      with_flag<O>(raw(0), [&](auto r0) {
        with_fin<O>(fin, [&](auto f) {
          combine_1<T, decltype(r0)::value, decltype(f)::value>(outs, nouts, ins[0], n, pre, d);
        });
      });
    }
    return;
  }
  if (nins == 2) {
    with_flag<O>(raw(0), [&](auto r0) {
      with_flag<O>(raw(1), [&](auto r1) {
        with_fin<O>(fin, [&](auto f) {
          combine_2<T, O, decltype(r0)::value, decltype(r1)::value, decltype(f)::value>(outs, nouts, ins[0], ins[1], n,
                                                                                        pre, d);
        });
      });
    });
    return;
  }
  alignas(64) V acc[combine_tile / lanes<T>::width];
  for (std::size_t base = 0; base < n; base += combine_tile) {
    const std::size_t m = n - base < combine_tile ? n - base : combine_tile;
    with_flag<O>(raw(0), [&](auto r0) {
      with_flag<O>(raw(1), [&](auto r1) {
        tile_first<T, O, decltype(r0)::value, decltype(r1)::value>(acc, ins[0], ins[1], base, m, pre);
      });
    });
    for (int j = 2; j + 1 < nins; ++j)
      with_flag<O>(raw(j), [&](auto r) { tile_next<T, O, decltype(r)::value>(acc, ins[j], base, m, pre); });
    // Every input of this tile has been read before any output of it is written, so an output
    // may be one of the inputs.
    with_flag<O>(raw(nins - 1), [&](auto r) {
      with_fin<O>(fin, [&](auto f) {
        tile_last<T, O, decltype(r)::value, decltype(f)::value>(outs, nouts, acc, ins[nins - 1], base, m, pre, d);
      });
    });
  }
}

#if DDP_DETAIL_F16C_DISPATCH
inline bool f16c_on() noexcept;
template <class Out, class In>
[[gnu::target("avx,f16c")]] bool combine_f16c(Out const* outs, int nouts, In const* ins, int nins, std::size_t n, op o,
                                              const avg_step& a) noexcept;
#endif

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
#if DDP_DETAIL_F16C_DISPATCH
  if constexpr (std::is_same_v<T, half>)
    if (f16c_on() && combine_f16c(outs, nouts, ins, nins, n, o, a)) return;
#endif
  const avg_vec<T> none{};
  switch (o) {
    case op::sum:
      combine_loop<T, op::sum>(outs, nouts, ins, nins, n, none);
      return;
    case op::avg:
      combine_loop<T, op::avg>(outs, nouts, ins, nins, n, make_avg<T>(a));
      return;
    case op::min:
      combine_loop<T, op::min>(outs, nouts, ins, nins, n, none);
      return;
    case op::max:
      combine_loop<T, op::max>(outs, nouts, ins, nins, n, none);
      return;
    case op::prod:
      combine_loop<T, op::prod>(outs, nouts, ins, nins, n, none);
      return;
  }
}

// ---- argument checks: a bad dtype, op or world is errc::invalid_argument, never UB ----------

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
#if DDP_DETAIL_F16C_DISPATCH
namespace kern {
[[gnu::target("avx,f16c")]] inline void reduce_into_f16c(half* dst, const half* src, std::size_t n, op o) noexcept;
}
#endif

template <element T>
inline void reduce_into(T* dst, const T* src, std::size_t n, op o) {
  check_op(o, -1, "reduction kernel");
#if DDP_DETAIL_F16C_DISPATCH
  if constexpr (std::is_same_v<T, half>)
    if (kern::f16c_on()) return kern::reduce_into_f16c(dst, src, n, o);
#endif
  switch (o) {
    case op::sum:
    case op::avg:
      kern::reduce_loop<T, op::sum>(dst, src, n);
      return;
    case op::min:
      kern::reduce_loop<T, op::min>(dst, src, n);
      return;
    case op::max:
      kern::reduce_loop<T, op::max>(dst, src, n);
      return;
    case op::prod:
      kern::reduce_loop<T, op::prod>(dst, src, n);
      return;
  }
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
  using namespace kern;
  using L = lanes<float>;
  constexpr std::size_t w = L::width;
  const i32v sign = i32v{} + std::numeric_limits<std::int32_t>::min();  // the sign bit
  const f32v top = f32v{} + std::numeric_limits<float>::max();
  f32v m0{}, m1{};
  auto step = [&](f32v m, f32v v) {
    const f32v a = reinterpret_cast<f32v>(reinterpret_cast<i32v>(v) & ~sign);
    return select((a <= top) & (a > m), a, m);  // NaN and inf compare false
  };
  std::size_t i = 0;
  for (; i + 2 * w <= n; i += 2 * w) {
    m0 = step(m0, L::load(src + i));
    m1 = step(m1, L::load(src + i + w));
  }
  for (; i + w <= n; i += w) m0 = step(m0, L::load(src + i));
  if (i < n) m0 = step(m0, load_n(src + i, n - i));  // zero padding cannot raise the maximum
  m0 = select(m1 > m0, m1, m0);
  float r = 0;
  for (std::size_t k = 0; k < w; ++k) r = m0[k] > r ? m0[k] : r;
  return r;
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp

// The bulk f16/bf16 conversions, and F16C at run time.
#include <ddp/detail/kernels_f16c.hpp>

#if !defined(DDP_SEPARATE_COMPILATION)
#include <ddp/detail/kernels_impl.hpp>
#endif
