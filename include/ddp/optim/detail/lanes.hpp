#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
/// \file optim/detail/lanes.hpp
/// The loop of the shard optimizers: `for_lanes(n, f, arrays...)` calls `f` on one register of
/// floats from each array at a time (GNU vector extensions: 8 lanes under -mavx, 4 on the x86-64
/// baseline) and stores the non-const ones back. The tail runs the same `f` on zero-padded
/// copies, so every element is computed by the same instruction sequence wherever it sits: a
/// shard's update does not depend on where the shard starts, which is what makes the sharded
/// and the unsharded step agree bit for bit.

#include <cmath>
#include <cstddef>
#include <cstring>
#include <tuple>
#include <type_traits>

#if defined(__SSE2__) || defined(__AVX__)
#include <immintrin.h>
#endif

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

#if defined(__AVX__)
inline constexpr std::size_t opt_lanes = 8;
#else
inline constexpr std::size_t opt_lanes = 4;
#endif
using opt_vec = float __attribute__((vector_size(opt_lanes * sizeof(float))));

inline opt_vec opt_splat(float x) noexcept { return opt_vec{} + x; }

/// The correctly rounded square root of each lane (IEEE, as std::sqrt).
inline opt_vec opt_sqrt(opt_vec x) noexcept {
#if defined(__AVX__)
  return _mm256_sqrt_ps(x);
#elif defined(__SSE2__)
  return _mm_sqrt_ps(x);
#else
  for (std::size_t k = 0; k < opt_lanes; ++k) x[k] = std::sqrt(x[k]);
  return x;
#endif
}

/// Calls `f(v...)` with one `opt_vec&` per array over elements [0, n): see the file comment.
template <class F, class... T>
void for_lanes(std::size_t n, F&& f, T*... arrays) {
  static_assert((std::is_same_v<std::remove_const_t<T>, float> && ...));
  const auto run = [&](std::size_t at, std::size_t count) {
    std::tuple<std::conditional_t<true, opt_vec, T>...> v{};
    std::apply([&](auto&... x) { (std::memcpy(&x, arrays + at, count * sizeof(float)), ...); }, v);
    std::apply([&](auto&... x) { f(x...); }, v);
    std::apply(
        [&](auto&... x) {
          const auto store = [&](auto* p, const opt_vec& from) {
            if constexpr (!std::is_const_v<std::remove_pointer_t<decltype(p)>>)
              std::memcpy(p + at, &from, count * sizeof(float));
          };
          (store(arrays, x), ...);
        },
        v);
  };
  std::size_t i = 0;
  for (; i + opt_lanes <= n; i += opt_lanes) run(i, opt_lanes);
  if (i < n) run(i, n - i);
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
