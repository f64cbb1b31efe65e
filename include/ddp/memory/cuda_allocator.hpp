#pragma once
/// \file cuda_allocator.hpp
/// `ddp::cuda_allocator`: device memory from the stream-ordered allocator (`cudaMallocAsync`).
/// Includes `<cuda_runtime.h>`; link with `-lcudart`.

#include <cuda_runtime.h>

#include <concepts>
#include <cstddef>

#include <ddp/version.hpp>
#include <ddp/detail/cuda_check.hpp>
#include <ddp/memory/allocator_concept.hpp>
#include <ddp/memory/detail/cuda_release.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Device memory on one GPU, allocated and freed in the order of `stream`.
///
/// Stream-ordered allocation reuses the device's memory pool instead of calling the driver, and
/// a free never synchronizes the device. Devices without memory-pool support fall back to
/// `cudaMalloc`/`cudaFree`. The device is switched for the call only; the caller's current
/// device is left as it was. Results are aligned to at least 256 bytes.
///
/// It has the hooks of `ddp::copying_allocator` (`copy`, `zero`), so `basic_data_parallel`
/// can fill and read its buckets, and the wrapper builds it from an `nccl_reducer` with the
/// reducer's device and stream (`for_reducer`).
/// \code
/// ddp::cuda_allocator a{.device = 1, .stream = my_stream};
/// void* p = a.allocate(bytes);   // ready for use on my_stream
/// a.deallocate(p, bytes);
/// \endcode
struct cuda_allocator {
  int device = 0;
  cudaStream_t stream = nullptr;  ///< nullptr: the legacy default stream

  /// Returns `bytes` of device memory, usable in the order of `stream`, or nullptr for 0 bytes.
  /// Throws `ddp::error` (`errc::system`) when CUDA refuses.
  void* allocate(std::size_t bytes) const {
    if (bytes == 0) return nullptr;
    detail::cuda_device_guard on(device);
    void* p = nullptr;
    if (pools_supported()) {
      DDP_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream));
    } else {
      DDP_CUDA_CHECK(cudaMalloc(&p, bytes));
    }
    return p;
  }

  /// Frees `p` in the order of `stream`. Never throws: a CUDA error (a context already torn
  /// down at exit, a poisoned context) is recorded, not raised, and `release_error()` returns
  /// it; the runtime's last-error slot is cleared so that it does not resurface elsewhere.
  void deallocate(void* p, std::size_t /*bytes*/) const noexcept {
    if (p == nullptr) return;
    int previous = 0;
    cudaError_t e = cudaGetDevice(&previous);
    if (e == cudaSuccess && previous != device) e = cudaSetDevice(device);
    if (e == cudaSuccess) {
      int pools = 0;
      e = cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device);
      if (e == cudaSuccess) e = pools != 0 ? cudaFreeAsync(p, stream) : cudaFree(p);
      if (previous != device) (void)cudaSetDevice(previous);
    }
    detail::record_cuda_release_error(e);
  }

  /// The first CUDA error a `deallocate` (of any CUDA allocator of ddp) recorded since the last
  /// call, or cudaSuccess; taking it clears it.
  static cudaError_t release_error() noexcept { return detail::take_cuda_release_error(); }

  /// Copies `bytes` from `src` to `dst`, each in device or host memory (`cudaMemcpyDefault`:
  /// the direction follows the pointers, so a parameter on the host or on a device both work),
  /// in the order of `stream`, and returns when the copy is done (the caller may then reuse
  /// `src` or read `dst`). Throws `ddp::error` (`errc::system`) when CUDA refuses.
  void copy(void* dst, const void* src, std::size_t bytes) const {
    if (bytes == 0) return;
    detail::cuda_device_guard on(device);
    DDP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
    DDP_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  /// Sets `bytes` of device memory at `dst` to zero in the order of `stream` and returns when
  /// done. Throws `ddp::error` (`errc::system`) when CUDA refuses.
  void zero(void* dst, std::size_t bytes) const {
    if (bytes == 0) return;
    detail::cuda_device_guard on(device);
    DDP_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream));
    DDP_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  /// The allocator for a reducer's buckets: its device and stream (`nccl_reducer`). The
  /// wrapper builds its allocator this way (`ddp::allocator_bound_to`).
  template <class Reducer>
  requires requires(const Reducer& r) {
    { r.device() } -> std::convertible_to<int>;
    { r.stream() } -> std::convertible_to<cudaStream_t>;
  }
  static cuda_allocator for_reducer(const Reducer& r) noexcept {
    return cuda_allocator{.device = r.device(), .stream = r.stream()};
  }

  constexpr memory_kind location() const noexcept { return memory_kind::cuda; }

  friend bool operator==(const cuda_allocator&, const cuda_allocator&) noexcept = default;

 private:
  // Asked on every call rather than cached, so the allocator stays a plain aggregate; the query
  // is a cheap attribute read next to an allocation.
  bool pools_supported() const {
    int supported = 0;
    DDP_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device));
    return supported != 0;
  }
};

static_assert(copying_allocator<cuda_allocator>);

}  // namespace DDP_ABI
}  // namespace ddp
