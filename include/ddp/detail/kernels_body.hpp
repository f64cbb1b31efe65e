#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
/// \file detail/kernels_body.hpp
/// The host kernels' bodies: everything that depends on the vector width, compiled once per
/// instruction set (detail/isa.hpp, detail/isa_each.hpp) in namespace ddp::detail::DDP_KERN_NS.
/// No include guard and no includes of its own: detail/kernels.hpp includes it through
/// detail/isa_each.hpp, after every header it needs (a header first included inside the AVX2
/// region would compile its inline functions for AVX2). Semantics: detail/kernels.hpp.
#ifndef DDP_KERN_NS
#include <ddp/detail/kernels.hpp>
#else

namespace ddp {
inline namespace DDP_ABI {
namespace detail {
namespace DDP_KERN_NS {

inline constexpr std::size_t vector_bytes = DDP_KERN_VECTOR_BYTES;
typedef float f32v __attribute__((vector_size(DDP_KERN_VECTOR_BYTES)));
typedef double f64v __attribute__((vector_size(DDP_KERN_VECTOR_BYTES)));
typedef std::int32_t i32v __attribute__((vector_size(DDP_KERN_VECTOR_BYTES)));
typedef std::uint32_t u32v __attribute__((vector_size(DDP_KERN_VECTOR_BYTES)));
typedef std::int64_t i64v __attribute__((vector_size(DDP_KERN_VECTOR_BYTES)));
typedef std::uint64_t u64v __attribute__((vector_size(DDP_KERN_VECTOR_BYTES)));
// 16-bit storage of one f32v worth of lanes.
typedef std::uint16_t u16v __attribute__((vector_size(DDP_KERN_VECTOR_BYTES / 2)));

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
#if DDP_KERN_F16C
  // The hardware conversions are exact and round to nearest even like ddp::half; they differ
  // only in NaN payloads, and every NaN reaching `store` from an operation is canonical.
  // (The builtins rather than <immintrin.h>'s wrappers: no header to include, and they take the
  // target of the function that calls them.)
  typedef short h8 __attribute__((vector_size(16)));
  static_assert(sizeof(vec) == 32, "F16C's eight-lane conversions need 32-byte vectors");
  static vec load(const half* p) noexcept {
    h8 h;
    std::memcpy(&h, p, sizeof h);
    return __builtin_ia32_vcvtph2ps256(h);
  }
  static void store(half* p, vec v) noexcept {
    const h8 h = __builtin_ia32_vcvtps2ph256(v, 0);  // 0: round to nearest even
    std::memcpy(static_cast<void*>(p), &h, sizeof h);
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
template <class T, op O, bool Raw, fin_mode F, class Out, class In>
inline void combine_2(Out const* outs, int nouts, In in0, In in1, std::size_t n, const typename lanes<T>::vec pre0,
                      const typename lanes<T>::vec pre1, const typename lanes<T>::vec d) noexcept {
  constexpr std::size_t w = lanes<T>::width;
  std::size_t i = 0;
  for (; i + w <= n; i += w)
    put_out<T, F, true>(outs, nouts, i,
                        apply<T, O>(get_in<T, Raw, true>(in0, i, w, pre0), get_in<T, Raw, true>(in1, i, w, pre1)), w,
                        d);
  if (i < n) {
    const std::size_t k = n - i;
    put_out<T, F, false>(outs, nouts, i,
                         apply<T, O>(get_in<T, Raw, false>(in0, i, k, pre0), get_in<T, Raw, false>(in1, i, k, pre1)), k,
                         d);
  }
}

// Three or more inputs, tile by tile: the first two inputs into the accumulator, then each
// further one, then the last on the way out. `m` elements from `base`; the accumulator's last
// vector may be partial.
template <class T, op O, bool Raw, class In>
[[gnu::noinline]] void tile_first(typename lanes<T>::vec* acc, In in0, In in1, std::size_t base, std::size_t m,
                                  const typename lanes<T>::vec pre0, const typename lanes<T>::vec pre1) noexcept {
  constexpr std::size_t w = lanes<T>::width;
  std::size_t v = 0;
  for (; (v + 1) * w <= m; ++v)
    acc[v] =
        apply<T, O>(get_in<T, Raw, true>(in0, base + v * w, w, pre0), get_in<T, Raw, true>(in1, base + v * w, w, pre1));
  if (v * w < m)
    acc[v] = apply<T, O>(get_in<T, Raw, false>(in0, base + v * w, m - v * w, pre0),
                         get_in<T, Raw, false>(in1, base + v * w, m - v * w, pre1));
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

// In an average every input is multiplied on entry: a single rank's contribution by `pre`, a
// partial result by 1, which is exact (x * 1 == x for every value but NaN, whose payload it
// keeps, and every NaN result is made canonical anyway), so one loop serves every `raw_from`:
// a third of the instantiations that a compile-time flag per input took.
template <class T, op O, class Out, class In>
inline void combine_loop(Out const* outs, int nouts, In const* ins, int nins, std::size_t n,
                         const avg_vec<T>& av) noexcept {
  using L = lanes<T>;
  using V = typename L::vec;
  static_assert(combine_tile % L::width == 0);
  constexpr bool avg = O == op::avg;
  const fin_mode fin = avg ? finish_of(av) : fin_mode::none;
  const V d = finish_operand(av);
  V one{};
  if constexpr (L::is_float) one = one + 1;
  // Integers never scale on entry (avg_in is the identity for them).
  auto pre = [&](int j) { return j >= av.raw_from ? av.pre : one; };

  if (nins == 1) {
    if constexpr (avg)
      with_fin<O>(fin, [&](auto f) { combine_1<T, avg, decltype(f)::value>(outs, nouts, ins[0], n, pre(0), d); });
    return;
  }
  if (nins == 2) {
    with_fin<O>(fin, [&](auto f) {
      combine_2<T, O, avg, decltype(f)::value>(outs, nouts, ins[0], ins[1], n, pre(0), pre(1), d);
    });
    return;
  }
  alignas(64) V acc[combine_tile / L::width];
  for (std::size_t base = 0; base < n; base += combine_tile) {
    const std::size_t m = n - base < combine_tile ? n - base : combine_tile;
    tile_first<T, O, avg>(acc, ins[0], ins[1], base, m, pre(0), pre(1));
    for (int j = 2; j + 1 < nins; ++j) tile_next<T, O, avg>(acc, ins[j], base, m, pre(j));
    // Every input of this tile has been read before any output of it is written, so an output
    // may be one of the inputs.
    with_fin<O>(fin, [&](auto f) {
      tile_last<T, O, avg, decltype(f)::value>(outs, nouts, acc, ins[nins - 1], base, m, pre(nins - 1), d);
    });
  }
}

// `combine_any`'s loops (detail/kernels.hpp) for op O: requires a valid `a` for avg, and at
// least one input that is not a plain copy.
template <class T, op O, class Out, class In>
inline void combine_op(Out const* outs, int nouts, In const* ins, int nins, std::size_t n, const avg_step& a) noexcept {
  if constexpr (O == op::avg)
    combine_loop<T, O>(outs, nouts, ins, nins, n, make_avg<T>(a));
  else
    combine_loop<T, O>(outs, nouts, ins, nins, n, avg_vec<T>{});
}

// The same for any valid `o`.
template <class T, class Out, class In>
inline void combine_run(Out const* outs, int nouts, In const* ins, int nins, std::size_t n, op o,
                        const avg_step& a) noexcept {
  switch (o) {
    case op::sum:
      return combine_op<T, op::sum>(outs, nouts, ins, nins, n, a);
    case op::avg:
      return combine_op<T, op::avg>(outs, nouts, ins, nins, n, a);
    case op::min:
      return combine_op<T, op::min>(outs, nouts, ins, nins, n, a);
    case op::max:
      return combine_op<T, op::max>(outs, nouts, ins, nins, n, a);
    case op::prod:
      return combine_op<T, op::prod>(outs, nouts, ins, nins, n, a);
  }
}

// `reduce_into<T>`'s loop for op O (avg adds: averages are combine's).
template <class T, op O>
inline void reduce_op(T* dst, const T* src, std::size_t n) noexcept {
  reduce_loop<T, O == op::avg ? op::sum : O>(dst, src, n);
}

// The same for any valid `o`.
template <class T>
inline void reduce_run(T* dst, const T* src, std::size_t n, op o) noexcept {
  switch (o) {
    case op::sum:
    case op::avg:
      return reduce_op<T, op::sum>(dst, src, n);
    case op::min:
      return reduce_op<T, op::min>(dst, src, n);
    case op::max:
      return reduce_op<T, op::max>(dst, src, n);
    case op::prod:
      return reduce_op<T, op::prod>(dst, src, n);
  }
}

// `max_abs_finite`.
inline float max_abs_finite_run(const float* src, std::size_t n) noexcept {
  using L = lanes<float>;
  constexpr std::size_t w = L::width;
  const i32v sign = i32v{} + std::numeric_limits<std::int32_t>::min();  // the sign bit
  const f32v top = f32v{} + std::numeric_limits<float>::max();
  f32v m0{}, m1{};
  std::size_t i = 0;
  for (; i + 2 * w <= n; i += 2 * w) {
    const f32v a0 = reinterpret_cast<f32v>(reinterpret_cast<i32v>(L::load(src + i)) & ~sign);
    const f32v a1 = reinterpret_cast<f32v>(reinterpret_cast<i32v>(L::load(src + i + w)) & ~sign);
    m0 = select((a0 <= top) & (a0 > m0), a0, m0);  // NaN and inf compare false
    m1 = select((a1 <= top) & (a1 > m1), a1, m1);
  }
  for (; i + w <= n; i += w) {
    const f32v a = reinterpret_cast<f32v>(reinterpret_cast<i32v>(L::load(src + i)) & ~sign);
    m0 = select((a <= top) & (a > m0), a, m0);
  }
  if (i < n) {  // zero padding cannot raise the maximum
    const f32v a = reinterpret_cast<f32v>(reinterpret_cast<i32v>(load_n(src + i, n - i)) & ~sign);
    m0 = select((a <= top) & (a > m0), a, m0);
  }
  m0 = select(m1 > m0, m1, m0);
  float r = 0;
  for (std::size_t k = 0; k < w; ++k) r = m0[k] > r ? m0[k] : r;
  return r;
}

// ---- bulk conversions between f32 and a 16-bit wire type (compression hooks) ----------------
// `narrow_to_f16` and the others in detail/kernels.hpp.

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

template <class W, bool Saturate>
inline void narrow_run(W* dst, const float* src, std::size_t n, float scale) noexcept {
  using L = lanes<float>;
  constexpr std::size_t w = L::width;
  const f32v s = f32v{} + scale;
  std::size_t i = 0;
  for (; i + w <= n; i += w) lanes<W>::store(dst + i, narrow_prepare<W>(L::load(src + i), s, Saturate));
  if (i < n) store_n(dst + i, narrow_prepare<W>(load_n(src + i, n - i), s, Saturate), n - i);
}

template <class W>
inline void narrow_loop(W* dst, const float* src, std::size_t n, float scale, bool saturate) noexcept {
  if (saturate)
    narrow_run<W, true>(dst, src, n, scale);
  else
    narrow_run<W, false>(dst, src, n, scale);
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

}  // namespace DDP_KERN_NS
}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp

#endif  // DDP_KERN_NS
