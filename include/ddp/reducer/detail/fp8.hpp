#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
/// \file reducer/detail/fp8.hpp
/// The 8-bit float kernels of `ddp::fp8_compress` (reducer/fp8_compress.hpp): block-scaled
/// quantization of f32 into OCP e4m3 (e4m3fn: 4 exponent bits, bias 7, largest 448, no inf) or
/// e5m2 (bias 15, largest 57344), and the dequantizing accumulation that sums them in f32.
///
/// A block of `block` elements has one f32 scale s = max|x| / largest (0 for an all-zero block);
/// each element is stored as the code of x / s rounded to nearest even (subnormals included,
/// saturating at the largest finite value, which rounding at the top can otherwise pass), so
/// |x - code * s| <= 2^-(m+1) |x| for normals (m = 3 or 2 mantissa bits) and 2^-(m+1) * 2^(1 -
/// bias - m) * s below them. A block holding a NaN or an infinity gets a non-finite scale
/// (NaN, or the infinity's sign: NaN when both signs occur) and its codes are 0: its every
/// element decodes to that value, so a non-finite gradient makes its block non-finite on every
/// rank, never a finite wrong value.
///
/// The kernels are GNU vector code over u32 lanes (8 under AVX, 4 on the SSE2 baseline), with
/// the tail run through the same vector code on a padded copy, as in detail/kernels.hpp: the
/// same bits whatever the length and alignment. Their bodies are reducer/detail/fp8_body.hpp,
/// compiled once per instruction set like detail/kernels.hpp's (detail/isa.hpp): a build for the
/// x86-64 baseline runs the AVX2 copy where the CPU has it. The functions below choose.

#include <ddp/detail/kernels.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

namespace ddp {
inline namespace DDP_ABI {

/// The 8-bit formats of `ddp::fp8_compress`: OCP e4m3 (e4m3fn) and e5m2.
enum class fp8_format : std::uint8_t { e4m3 = 0, e5m2 = 1 };

namespace detail::fp8 {

/// A format's constants.
struct spec {
  int mant;           // mantissa bits
  int bias;           // exponent bias
  std::uint32_t top;  // the largest finite code's magnitude (sign bit clear)
  float largest;      // its value
};
constexpr spec spec_of(fp8_format f) noexcept {
  return f == fp8_format::e4m3 ? spec{3, 7, 0x7e, 448.0f} : spec{2, 15, 0x7b, 57344.0f};
}

}  // namespace detail::fp8
}  // namespace DDP_ABI
}  // namespace ddp

#define DDP_ISA_BODY <ddp/reducer/detail/fp8_body.hpp>
#include <ddp/detail/isa_each.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail::fp8 {

/// The block's scale: max |x| / `largest` over its finite values (0 for an all-zero block; a
/// NaN, or the infinity's sign, for a block holding NaN or infinities: see above).
inline float block_scale(const float* x, std::size_t n, float largest) noexcept {
  DDP_DETAIL_ISA_CALL(fp8k::block_scale(x, n, largest));
}
/// `codes[i]` = x[i] / scale rounded to format F; with `residual`, x[i] minus what the code
/// decodes to (x may be the residual's own memory). A non-finite or zero scale writes zero codes
/// and a zero residual.
template <fp8_format F>
inline void quantize(const float* x, std::size_t n, float scale, std::uint8_t* codes, float* residual) noexcept {
  DDP_DETAIL_ISA_CALL(fp8k::quantize<F>(x, n, scale, codes, residual));
}
/// `acc[i]` (+)= code i times `scale` (`first`: assigns); a non-finite scale gives that value.
template <fp8_format F>
inline void accumulate(float* acc, const std::uint8_t* codes, std::size_t n, float scale, bool first) noexcept {
  DDP_DETAIL_ISA_CALL(fp8k::accumulate<F>(acc, codes, n, scale, first));
}
/// `r[i] += x[i]`: error feedback's y = x + residual.
inline void add_into(float* r, const float* x, std::size_t n) noexcept { DDP_DETAIL_ISA_CALL(fp8k::add_into(r, x, n)); }
/// `out[i]` = the sum over ranks, in rank order, of rank r's code i times `scales[r]`, divided by
/// `divisor` (1: not at all): accumulate's bits, rank by rank, in one pass.
template <fp8_format F>
inline void sum_ranks(float* out, std::size_t n, const std::uint8_t* const* codes, const float* scales, int ranks,
                      float divisor) noexcept {
  DDP_DETAIL_ISA_CALL(fp8k::sum_ranks<F>(out, n, codes, scales, ranks, divisor));
}
/// A whole bucket: error feedback's add, every block's scale and codes (fp8_body.hpp).
template <fp8_format F>
inline void quantize_blocks(const float* x, std::size_t n, std::size_t block, float* residual, float* scales,
                            std::uint8_t* codes) noexcept {
  DDP_DETAIL_ISA_CALL(fp8k::quantize_blocks<F>(x, n, block, residual, scales, codes));
}
/// A whole bucket of `sum_ranks`, every rank's blocks (fp8_body.hpp).
template <fp8_format F>
inline void sum_blocks(float* out, std::size_t n, std::size_t block, const std::uint8_t* const* codes,
                       const void* const* scales, int ranks, float divisor, const std::uint8_t** rows,
                       float* s) noexcept {
  DDP_DETAIL_ISA_CALL(fp8k::sum_blocks<F>(out, n, block, codes, scales, ranks, divisor, rows, s));
}
/// One value's code, and one code's value (tests).
template <fp8_format F>
inline std::uint8_t encode_one(float v) noexcept {
  DDP_DETAIL_ISA_CALL(fp8k::encode_one<F>(v));
}
template <fp8_format F>
inline float decode_one(std::uint8_t c) noexcept {
  DDP_DETAIL_ISA_CALL(fp8k::decode_one<F>(c));
}

}  // namespace detail::fp8
}  // namespace DDP_ABI
}  // namespace ddp
