#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
/// \file reducer/detail/fp8_body.hpp
/// The fp8 kernels' bodies (reducer/detail/fp8.hpp says what they compute), compiled once per
/// instruction set (detail/isa.hpp) in namespace ddp::detail::DDP_KERN_NS::fp8k. No include
/// guard and no includes of its own: reducer/detail/fp8.hpp includes it through
/// detail/isa_each.hpp, after every header it needs.
#ifndef DDP_KERN_NS
#include <ddp/reducer/detail/fp8.hpp>
#else

namespace ddp {
inline namespace DDP_ABI {
namespace detail::DDP_KERN_NS::fp8k {

using fp8::spec;
using fp8::spec_of;
inline constexpr std::size_t width = sizeof(f32v) / sizeof(float);
typedef std::uint8_t u8v __attribute__((vector_size(width)));

[[gnu::always_inline]] inline u32v bits(f32v v) noexcept { return reinterpret_cast<u32v>(v); }
[[gnu::always_inline]] inline f32v flt(u32v v) noexcept { return reinterpret_cast<f32v>(v); }
[[gnu::always_inline]] inline f32v fsplat(float x) noexcept { return f32v{} + x; }
[[gnu::always_inline]] inline u32v usplat(std::uint32_t x) noexcept { return u32v{} + x; }

/// `v`, materialized: a product passed through it is never fused with a following addition
/// (gcc contracts a * b + c into an FMA where the target has one), so that a baseline build
/// and a -march=native one sum the same codes to the same bits.
template <class V>
[[gnu::always_inline]] inline V unfused(V v) noexcept {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
  return v;
}

/// The codes of `v` (|v| at most the format's largest, up to rounding), round to nearest even.
template <fp8_format F>
[[gnu::always_inline]] inline u32v encode(f32v v) noexcept {
  constexpr spec S = spec_of(F);
  const u32v b = bits(v);
  const u32v sign = (b >> 24) & 0x80u;
  const u32v a = b & 0x7fffffffu;
  // Normals: round the f32 mantissa to S.mant bits (a carry moves into the exponent), re-bias.
  constexpr unsigned sh = 23u - static_cast<unsigned>(S.mant);
  const u32v r = (a + ((1u << (22 - S.mant)) - 1u) + ((a >> sh) & 1u)) >> sh;
  const u32v normal = r - static_cast<std::uint32_t>((127 - S.bias) << S.mant);
  // Below the smallest normal 2^(1 - bias): multiples of 2^(1 - bias - mant), rounded by adding
  // a float whose unit in the last place is that step (round to nearest even in hardware).
  const float step_big = std::ldexp(1.0f, 23 + 1 - S.bias - S.mant);  // ulp(step_big) = the step
  const f32v sum = flt(a) + step_big;
  const u32v sub = bits(sum) - bits(fsplat(step_big));
  const i32v is_sub = reinterpret_cast<i32v>(a < static_cast<std::uint32_t>((127 + 1 - S.bias) << 23));
  u32v code = DDP_KERN_NS::select(is_sub, sub, normal);
  code = DDP_KERN_NS::select(reinterpret_cast<i32v>(code > S.top), usplat(S.top), code);
  return code | sign;
}

/// The values of `codes` (finite codes only), times `scale`.
template <fp8_format F>
[[gnu::always_inline]] inline f32v decode(u32v c, f32v scale) noexcept {
  constexpr spec S = spec_of(F);
  const u32v sign = (c & 0x80u) << 24;
  const u32v mag = c & 0x7fu;
  const u32v e = mag >> static_cast<std::uint32_t>(S.mant);
  const u32v normal = ((mag + static_cast<std::uint32_t>((127 - S.bias) << S.mant)) << (23 - S.mant));
  const f32v sub = __builtin_convertvector(reinterpret_cast<i32v>(mag), f32v) *
                   std::ldexp(1.0f, 1 - S.bias - S.mant);  // exact: a few bits times a power of two
  const f32v v = DDP_KERN_NS::select(reinterpret_cast<i32v>(e == 0u), sub, flt(normal));
  return unfused(flt(bits(v) | sign) * scale);
}

/// One block's scale: max |x| / largest over its finite elements (0 when all are zero), or a
/// non-finite value when the block holds one (see the file comment).
inline float block_scale(const float* x, std::size_t n, float largest) noexcept {
  f32v m = {};
  std::size_t i = 0;
  f32v bad = {};
  for (; i + width <= n; i += width) {
    f32v v;
    std::memcpy(&v, x + i, sizeof v);
    const f32v a = flt(bits(v) & 0x7fffffffu);
    const i32v fin = a <= std::numeric_limits<float>::max();
    m = DDP_KERN_NS::select(fin & (a > m), a, m);
    bad = DDP_KERN_NS::select(fin, bad, fsplat(1.0f));
  }
  float amax = 0.0f;
  bool any_bad = false;
  for (std::size_t l = 0; l < width; ++l) amax = std::max(amax, m[l]), any_bad = any_bad || bad[l] != 0.0f;
  for (; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a <= std::numeric_limits<float>::max())
      amax = std::max(amax, a);
    else
      any_bad = true;
  }
  if (any_bad) {
    bool nan = false, pos = false, neg = false;
    for (std::size_t k = 0; k < n; ++k) {
      if (std::isnan(x[k]))
        nan = true;
      else if (std::isinf(x[k]))
        (x[k] > 0 ? pos : neg) = true;
    }
    if (nan || (pos && neg)) return std::numeric_limits<float>::quiet_NaN();
    return pos ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::infinity();
  }
  if (amax == 0.0f) return 0.0f;
  // A block of only tiny values (below 2^-100) gets the scale of 2^-100: no overflow of the
  // inverse, its values quantized toward 0 (error feedback keeps them).
  return std::max(amax, 0x1p-100f) / largest;
}

/// codes[i] = encode(x[i] / scale) for a block with a finite scale (all 0 otherwise); with a
/// residual (error feedback), residual[i] = x[i] - decode(codes[i]) * scale (0 for a
/// non-finite block).
template <fp8_format F>
inline void quantize(const float* x, std::size_t n, float scale, std::uint8_t* codes, float* residual) noexcept {
  if (!std::isfinite(scale) || scale == 0.0f) {
    std::memset(codes, 0, n);
    // All zeros leave no error; a non-finite block carries nothing on to the next step.
    if (residual != nullptr) std::memset(residual, 0, n * sizeof(float));
    return;
  }
  const f32v iv = fsplat(1.0f / scale), sv = fsplat(scale);
  const auto body = [&](const float* xp, std::uint8_t* cp, float* rp) {
    f32v v;
    std::memcpy(&v, xp, sizeof v);
    const u32v c = encode<F>(v * iv);
    const u8v c8 = __builtin_convertvector(c, u8v);
    std::memcpy(cp, &c8, sizeof c8);
    if (rp != nullptr) {
      const f32v back = decode<F>(c, sv);
      const f32v r = v - back;
      std::memcpy(rp, &r, sizeof r);
    }
  };
  std::size_t i = 0;
  for (; i + width <= n; i += width) body(x + i, codes + i, residual != nullptr ? residual + i : nullptr);
  if (i < n) {
    float xt[width] = {}, rt[width];
    std::uint8_t ct[width];
    std::memcpy(xt, x + i, (n - i) * sizeof(float));
    body(xt, ct, residual != nullptr ? rt : nullptr);
    std::memcpy(codes + i, ct, n - i);
    if (residual != nullptr) std::memcpy(residual + i, rt, (n - i) * sizeof(float));
  }
}

/// acc[i] (+)= decode(codes[i]) * scale: `first` stores instead of adding. A non-finite scale
/// adds (stores) the scale itself to every element.
template <fp8_format F>
inline void accumulate(float* acc, const std::uint8_t* codes, std::size_t n, float scale, bool first) noexcept {
  const f32v sv = fsplat(scale);
  const bool odd = !std::isfinite(scale);
  const auto body = [&](float* ap, const std::uint8_t* cp) {
    u8v c8;
    std::memcpy(&c8, cp, sizeof c8);
    const f32v d = odd ? sv : decode<F>(__builtin_convertvector(c8, u32v), sv);  // unfused
    if (first) {
      std::memcpy(ap, &d, sizeof d);
    } else {
      f32v a;
      std::memcpy(&a, ap, sizeof a);
      a += d;
      std::memcpy(ap, &a, sizeof a);
    }
  };
  std::size_t i = 0;
  for (; i + width <= n; i += width) body(acc + i, codes + i);
  if (i < n) {
    float at[width] = {};
    std::uint8_t ct[width] = {};
    std::memcpy(at, acc + i, (n - i) * sizeof(float));
    std::memcpy(ct, codes + i, n - i);
    body(at, ct);
    std::memcpy(acc + i, at, (n - i) * sizeof(float));
  }
}

/// r[i] += x[i] (error feedback's y = x + r), as vector code: a plain loop is left scalar at
/// -O2, where gcc's cost model refuses the run-time alias check.
inline void add_into(float* r, const float* x, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + width <= n; i += width) {
    f32v a, b;
    std::memcpy(&a, r + i, sizeof a);
    std::memcpy(&b, x + i, sizeof b);
    a += b;
    std::memcpy(r + i, &a, sizeof a);
  }
  for (; i < n; ++i) r[i] += x[i];  // the same IEEE addition, one lane
}

/// out[i] = (sum over r in rank order of decode(codes[r][i]) * scales[r]) / divisor, in one pass
/// (divisor 1: the sum; no division then): each product rounded on its own, the sum formed in
/// rank order from rank 0's term, as `accumulate` from `first` would, so the same bits. A
/// non-finite scales[r] stands for its every element.
template <fp8_format F>
inline void sum_ranks(float* out, std::size_t n, const std::uint8_t* const* codes, const float* scales, int ranks,
                      float divisor) noexcept {
  const bool divide = divisor != 1.0f;
  const f32v dv = fsplat(divisor);
  const auto body = [&](float* op, std::size_t at, const std::uint8_t* const* cs) {
    f32v acc = {};
    for (int r = 0; r < ranks; ++r) {
      const float s = scales[r];
      f32v d;
      if (!std::isfinite(s)) {
        d = fsplat(s);
      } else {
        u8v c8;
        std::memcpy(&c8, cs[r] + at, sizeof c8);
        d = decode<F>(__builtin_convertvector(c8, u32v), fsplat(s));
      }
      acc = r == 0 ? d : acc + d;
    }
    if (divide) acc = acc / dv;
    std::memcpy(op, &acc, sizeof acc);
  };
  std::size_t i = 0;
  for (; i + width <= n; i += width) body(out + i, i, codes);
  if (i < n) {
    // The tail through the same code: each rank's last codes copied into a padded row.
    constexpr int most = 64;
    std::uint8_t pad[most][width] = {};
    const std::uint8_t* rows[most];
    for (int r = 0; r < ranks && r < most; ++r) {
      std::memcpy(pad[r], codes[r] + i, n - i);
      rows[r] = pad[r];
    }
    if (ranks <= most) {
      float t[width];
      body(t, 0, rows);
      std::memcpy(out + i, t, (n - i) * sizeof(float));
    } else {  // more ranks than the padded rows hold: element by element through accumulate
      for (int r = 0; r < ranks; ++r) accumulate<F>(out + i, codes[r] + i, n - i, scales[r], r == 0);
      if (divide)
        for (std::size_t k = i; k < n; ++k) out[k] /= divisor;
    }
  }
}

/// A whole bucket, block by block (`block` elements a scale): with `residual` (error feedback)
/// y = x + residual in the residual's memory, then its scale into `scales[blk]` and its codes;
/// the residual becomes what the codes lost. One call a bucket, so the caller's choice of copy
/// (detail/isa.hpp) is made once, not per block.
template <fp8_format F>
inline void quantize_blocks(const float* x, std::size_t n, std::size_t block, float* residual, float* scales,
                            std::uint8_t* codes) noexcept {
  constexpr float largest = spec_of(F).largest;
  for (std::size_t at = 0, blk = 0; at < n; at += block, ++blk) {
    const std::size_t len = n - at < block ? n - at : block;
    const float* y = x + at;
    if (residual != nullptr) {
      add_into(residual + at, x + at, len);
      y = residual + at;
    }
    scales[blk] = block_scale(y, len, largest);
    quantize<F>(y, len, scales[blk], codes + at, residual != nullptr ? residual + at : nullptr);
  }
}

/// A whole bucket of `sum_ranks`: rank r's codes start at `codes[r]` and its block scales at
/// `scales[r]` (read with memcpy: they may sit in another type's buffer); `rows` and `s` are
/// scratch of `ranks` entries each.
template <fp8_format F>
inline void sum_blocks(float* out, std::size_t n, std::size_t block, const std::uint8_t* const* codes,
                       const void* const* scales, int ranks, float divisor, const std::uint8_t** rows,
                       float* s) noexcept {
  for (std::size_t at = 0, blk = 0; at < n; at += block, ++blk) {
    for (int r = 0; r < ranks; ++r) {
      std::memcpy(&s[r], static_cast<const char*>(scales[r]) + blk * sizeof(float), sizeof(float));
      rows[r] = codes[r] + at;
    }
    sum_ranks<F>(out + at, n - at < block ? n - at : block, rows, s, ranks, divisor);
  }
}

/// One element's code, for tests: the vector code on one lane.
template <fp8_format F>
inline std::uint8_t encode_one(float v) noexcept {
  f32v x = {};
  x[0] = v;
  return static_cast<std::uint8_t>(encode<F>(x)[0]);
}
template <fp8_format F>
inline float decode_one(std::uint8_t c) noexcept {
  u32v x = {};
  x[0] = c;
  return decode<F>(x, fsplat(1.0f))[0];
}

}  // namespace detail::DDP_KERN_NS::fp8k
}  // namespace DDP_ABI
}  // namespace ddp

#endif  // DDP_KERN_NS
