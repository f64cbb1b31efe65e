#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file memory/detail/cuda_release.hpp
/// Where the CUDA allocators keep a failed release: `deallocate` is noexcept (the wrapper frees
/// buckets in destructors and on error paths), so a cudaFree that fails is recorded, not thrown.
// IWYU pragma: private

#include <cuda_runtime.h>

#include <atomic>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

inline std::atomic<int>& cuda_release_error_slot() noexcept {
  static std::atomic<int> slot{static_cast<int>(cudaSuccess)};
  return slot;
}

/// Keeps the first failed release since the last `take_cuda_release_error()` and clears the
/// runtime's last-error slot, as DDP_CUDA_CHECK does, so that it does not resurface in an
/// unrelated later call.
inline void record_cuda_release_error(cudaError_t e) noexcept {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  int none = static_cast<int>(cudaSuccess);
  cuda_release_error_slot().compare_exchange_strong(none, static_cast<int>(e));
}

inline cudaError_t take_cuda_release_error() noexcept {
  return static_cast<cudaError_t>(cuda_release_error_slot().exchange(static_cast<int>(cudaSuccess)));
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
