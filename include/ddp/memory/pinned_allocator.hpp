#pragma once
/// \file pinned_allocator.hpp
/// `ddp::pinned_allocator`: page-locked host memory from `cudaHostAlloc`. Includes
/// `<cuda_runtime.h>`; link with `-lcudart`.

#include <cuda_runtime.h>

#include <cstddef>

#include <ddp/version.hpp>
#include <ddp/detail/cuda_check.hpp>
#include <ddp/memory/allocator_concept.hpp>
#include <ddp/memory/detail/cuda_release.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Page-locked host memory: the CPU reads it like any host buffer, and GPUs and NICs reach it by
/// DMA without a staging copy. Pinning is slow and limited, so it suits long-lived bucket
/// buffers, not per-step scratch. The result is page aligned.
/// \code
/// ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, ddp::pinned_allocator> model{pg, params};
/// \endcode
struct pinned_allocator {
  /// `cudaHostAlloc` flags; portable by default so that every device in the process sees the
  /// memory as pinned, not only the current one.
  unsigned int flags = cudaHostAllocPortable;

  /// Returns `bytes` of page-locked memory, or nullptr for 0 bytes; throws `ddp::error`
  /// (`errc::system`) when CUDA refuses.
  void* allocate(std::size_t bytes) const {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    DDP_CUDA_CHECK(cudaHostAlloc(&p, bytes, flags));
    return p;
  }

  /// Frees `p`. Never throws: a CUDA error is recorded (`release_error()` returns it) and the
  /// runtime's last-error slot cleared.
  void deallocate(void* p, std::size_t /*bytes*/) const noexcept {
    if (p != nullptr) detail::record_cuda_release_error(cudaFreeHost(p));
  }

  /// The first CUDA error a `deallocate` recorded since the last call, or cudaSuccess; taking
  /// it clears it (one record for every CUDA allocator of ddp).
  static cudaError_t release_error() noexcept { return detail::take_cuda_release_error(); }

  constexpr memory_kind location() const noexcept { return memory_kind::pinned; }

  friend constexpr bool operator==(const pinned_allocator&, const pinned_allocator&) noexcept = default;
};

static_assert(device_allocator<pinned_allocator>);

}  // namespace DDP_ABI
}  // namespace ddp
