#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/uneven.hpp
/// The arithmetic of uneven inputs (`dp_options::uneven_inputs`): which op a bucket reduces
/// with, and how its result becomes the average over the ranks that contributed.
// IWYU pragma: private

#include <cmath>
#include <cstddef>

#include <ddp/detail/kernels.hpp>
#include <ddp/dtype.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// The op a bucket of `t` reduces with. Floating averages stay `op::avg`, whose scaled
/// accumulation keeps f16/bf16 sums from overflowing; with uneven inputs an integer average is
/// a plain sum, divided by the number of contributors once it is known (`uneven_finish`), so
/// that it is exact (a truncated average over the world cannot be rescaled).
constexpr op bucket_op(bool average, bool uneven, dtype t) noexcept {
  if (!average) return op::sum;
  return uneven && !avg_scales(t) ? op::sum : op::avg;
}

namespace uneven_kern {

// p[j] * num / den, computed in C (wider than T, so x * num is exact): one rounding in C, one to T.
template <class T, class C>
void rescale(T* p, std::size_t n, C num, C den) {
  const C top = static_cast<C>(kern::max_finite<T>());
  for (std::size_t j = 0; j < n; ++j) {
    const C x = static_cast<C>(static_cast<typename kern::lanes<T>::scalar>(p[j]));
    C q = x * num / den;
    // The average of finite values is finite: a quotient that rounding carried past T's largest
    // value becomes that value, as op::avg's own finish does.
    if (std::isfinite(x) && std::fabs(q) > top) q = std::copysign(top, q);
    p[j] = T(static_cast<typename kern::lanes<T>::scalar>(q));
  }
}

}  // namespace uneven_kern

/// Turns a bucket's reduced values into the average over the `count` ranks (of `world`) that
/// contributed, the others having contributed zeros: floats hold `op::avg`'s sum / world and
/// are scaled by world / count (in a wider type, so rounding twice at most: within an ulp of
/// the average); integers hold the plain sum (`bucket_op`) and are divided by `count`,
/// truncating, as `op::avg` divides by the world. With `count == world` floats are untouched
/// and integers divided by the world, bit for bit what `op::avg` gives.
inline void uneven_finish(void* p, std::size_t n, dtype t, int world, int count) {
  if (!avg_scales(t)) {
    avg_finish(p, n, t, count);
    return;
  }
  if (count == world) return;
  switch (t) {
    case dtype::f32:
      uneven_kern::rescale(static_cast<float*>(p), n, double(world), double(count));
      return;
    case dtype::f64:
      uneven_kern::rescale(static_cast<double*>(p), n, (long double)world, (long double)count);
      return;
    case dtype::f16:
      uneven_kern::rescale(static_cast<half*>(p), n, float(world), float(count));
      return;
    case dtype::bf16:
      uneven_kern::rescale(static_cast<bfloat16*>(p), n, float(world), float(count));
      return;
    default:
      return;
  }
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
