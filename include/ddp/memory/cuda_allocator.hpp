#pragma once
/// \file cuda_allocator.hpp
/// `ddp::cuda_allocator`: device memory from the stream-ordered allocator (`cudaMallocAsync`).
/// Includes `<cuda_runtime.h>`; link with `-lcudart`.

#include <cuda_runtime.h>

#include <cstddef>

#include <ddp/version.hpp>
#include <ddp/detail/cuda_check.hpp>
#include <ddp/memory/allocator_concept.hpp>

namespace ddp {
inline namespace v0 {

/// Device memory on one GPU, allocated and freed in the order of `stream`.
///
/// Stream-ordered allocation reuses the device's memory pool instead of calling the driver, and
/// a free never synchronizes the device. Devices without memory-pool support fall back to
/// `cudaMalloc`/`cudaFree`. The device is switched for the call only; the caller's current
/// device is left as it was. Results are aligned to at least 256 bytes.
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

  void deallocate(void* p, std::size_t /*bytes*/) const {
    if (p == nullptr) return;
    detail::cuda_device_guard on(device);
    if (pools_supported()) {
      DDP_CUDA_CHECK(cudaFreeAsync(p, stream));
    } else {
      DDP_CUDA_CHECK(cudaFree(p));
    }
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

static_assert(device_allocator<cuda_allocator>);

}  // namespace v0
}  // namespace ddp
