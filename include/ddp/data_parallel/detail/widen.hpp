#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/widen.hpp
/// The sharded modes' conversions of a bucket's or unit's values between its dtype (f32, f16,
/// bf16) and the f32 the shard optimizers step (detail/shard_ops.hpp, fully_sharded.hpp).
// IWYU pragma: private

#include <cstddef>
#include <cstdint>
#include <cstring>

#include <ddp/dtype.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// f32 values of `n` elements of `t` (f32, f16, bf16) at `src`, into `dst`, and back.
inline void widen_to_f32(float* dst, const void* src, std::size_t n, dtype t) noexcept {
  const auto* h = static_cast<const std::uint16_t*>(src);
  if (t == dtype::f32)
    std::memcpy(dst, src, n * sizeof(float));
  else if (t == dtype::f16)
    for (std::size_t k = 0; k < n; ++k) dst[k] = half::to_float(h[k]);
  else
    for (std::size_t k = 0; k < n; ++k) dst[k] = bfloat16::to_float(h[k]);
}
inline void narrow_from_f32(void* dst, const float* src, std::size_t n, dtype t) noexcept {
  auto* h = static_cast<std::uint16_t*>(dst);
  if (t == dtype::f32)
    std::memcpy(dst, src, n * sizeof(float));
  else if (t == dtype::f16)
    for (std::size_t k = 0; k < n; ++k) h[k] = half::from_float(src[k]);
  else
    for (std::size_t k = 0; k < n; ++k) h[k] = bfloat16::from_float(src[k]);
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
