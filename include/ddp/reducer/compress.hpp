#pragma once
/// \file reducer/compress.hpp
/// Gradient compression as communication hooks for `ddp::hooked`: `ddp::fp16_compress` and
/// `ddp::bf16_compress` send each f32 bucket as 16-bit floats, half the bytes on the wire.
///
/// What happens to an f32 bucket reduced with `op::sum` or `op::avg` over 2 or more ranks:
/// 1. fp16 only: every rank takes the largest finite |x| of its bucket, and one allreduce (max,
///    a single f32) gives the group's M. The bucket is scaled by s = 2^e, the power of two that
///    puts f * M in [2^14, 2^15) (f = 1 for avg, n for sum): no value, partial sum or average
///    can overflow f16 (largest 65504), and the values keep f16's 29 binades below M before
///    they reach its subnormals. Every rank computes the same s from the same M.
/// 2. Each element is rounded once to the 16-bit type (round to nearest even; NaN stays NaN,
///    inf stays inf) into a scratch buffer, which the inner reducer allreduces as f16 or bf16
///    with the bucket's op. Its kernels widen to f32 for each reduction step and round back
///    once per step (tcp: once per hop; shm: once in all); avg scales contributions first, as
///    for any f16 average (docs/reducers.md, "Averages").
/// 3. The result is widened back to f32 and multiplied by 1/s, exact (but in f32's own subnormal
///    range), into the bucket, with the same bits on every rank.
///
/// Bound, n ranks, mean = (sum of |x_r|) / n for avg (the sum itself for sum), u the unit
/// roundoff (2^-11 f16, 2^-8 bf16):
///   |result - exact| <= (n + 2) u mean + (4n + 1) t,  t = 2^-38 f M (fp16), 2^-133 (bf16)
/// the u-term one rounding per contribution and per reduction step, the t-term what the
/// 16-bit subnormal range absorbs. bf16 has f32's exponent range, so it needs no scale and no
/// extra collective; a finite value that bf16 rounding would carry past its largest value
/// (3.39e38) saturates to that value rather than becoming inf.
///
/// Other buckets pass through unchanged (the inner reducer's allreduce): other dtypes, ops
/// min, max and prod, and groups of one rank.
///
/// \code
/// using compressed = ddp::basic_data_parallel<ddp::size_planner,
///                                             ddp::hooked<ddp::ring<ddp::tcp>, ddp::fp16_compress>,
///                                             ddp::host_allocator>;
/// compressed dp{pg, params};
/// \endcode

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

#include <ddp/version.hpp>
#include <ddp/detail/kernels.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/fwd.hpp>
#include <ddp/reducer/hooked.hpp>

namespace ddp {
inline namespace DDP_ABI {

namespace detail {

/// The scale exponent e of fp16 compression: f * M * 2^e in [2^14, 2^15), clamped to the
/// exponents f32 holds (M = 0: e = 0).
inline int compress_exponent(float max_abs, double factor) noexcept {
  if (!(max_abs > 0.0f)) return 0;
  int q = 0;
  std::frexp(static_cast<double>(max_abs) * factor, &q);  // f*M in [2^(q-1), 2^q)
  int e = 15 - q;
  return e < -126 ? -126 : (e > 127 ? 127 : e);
}

/// f32 buckets through a 16-bit wire type `Wire` (half or bfloat16); see the file comment.
template <class Wire>
class compress_hook {
 public:
  template <class R>
  void operator()(const comm_bucket& b, R& inner) {
    require_host_buckets(b, inner, "fp16_compress/bf16_compress");
    if (b.type != dtype::f32 || b.size < 2 || b.count == 0 || (b.oper != op::sum && b.oper != op::avg)) {
      allreduce_now(inner, b.data, b.count, b.type, b.oper, b.deadline, b.tag());
      return;
    }
    auto* x = static_cast<float*>(b.data);
    float scale = 1.0f, unscale = 1.0f;
    if constexpr (std::is_same_v<Wire, half>) {
      float m = max_abs_finite(x, b.count);
      allreduce_now(inner, &m, 1, dtype::f32, op::max, b.deadline, b.tag());  // the same M on every rank
      const int e = compress_exponent(m, b.oper == op::sum ? static_cast<double>(b.size) : 1.0);
      scale = std::ldexp(1.0f, e);
      unscale = std::ldexp(1.0f, -e);
    }
    Wire* w = scratch(b.count);
    if constexpr (std::is_same_v<Wire, half>)
      narrow_to_f16(w, x, b.count, scale, true);
    else
      narrow_to_bf16(w, x, b.count, scale, true);
    allreduce_now(inner, w, b.count, dtype_of_v<Wire>, b.oper, b.deadline, b.tag());
    if constexpr (std::is_same_v<Wire, half>)
      widen_from_f16(x, w, b.count, unscale);
    else
      widen_from_bf16(x, w, b.count, unscale);
  }

  /// Bytes of scratch held (the largest bucket compressed so far, at 2 bytes an element).
  std::size_t scratch_bytes() const noexcept { return capacity_ * sizeof(Wire); }

 private:
  // Grows only: buckets repeat every step, so the memory is touched once and reused.
  Wire* scratch(std::size_t n) {
    if (n > capacity_) {
      buf_.reset();
      buf_ = std::make_unique_for_overwrite<std::uint16_t[]>(n);  // not zeroed: written before read
      capacity_ = n;
    }
    // The kernels load and store 16-bit elements through memcpy, so the storage's type is moot.
    return reinterpret_cast<Wire*>(buf_.get());
  }
  std::unique_ptr<std::uint16_t[]> buf_;
  std::size_t capacity_ = 0;
};

}  // namespace detail

/// Communication hook: f32 sum/avg buckets travel as f16 (half the bytes), scaled by a power of
/// two agreed across ranks so that nothing overflows; accumulation in f32 within each step.
/// Other buckets pass through. See this file's comment for the bound.
/// \code
/// ddp::hooked<ddp::auto_reducer, ddp::fp16_compress> red{pg};
/// red.allreduce(std::span<float>{grads}, ddp::op::avg);   // 2 bytes per element on the wire
/// \endcode
struct fp16_compress : detail::compress_hook<half> {};

/// Communication hook: f32 sum/avg buckets travel as bf16 (half the bytes; f32's range, 8
/// significant bits). No scale, no extra collective. Other buckets pass through.
/// \code
/// ddp::hooked<ddp::ring<ddp::tcp>, ddp::bf16_compress> red{pg};
/// red.allreduce(std::span<float>{grads}, ddp::op::avg);
/// \endcode
struct bf16_compress : detail::compress_hook<bfloat16> {};

}  // namespace DDP_ABI
}  // namespace ddp
