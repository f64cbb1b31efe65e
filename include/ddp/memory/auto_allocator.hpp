#pragma once
/// \file memory/auto_allocator.hpp
/// `ddp::auto_allocator`: the default allocator of `ddp::data_parallel`, the partner of
/// `ddp::auto_reducer`. Buckets go where the chosen engine reads them fastest: into the host's
/// shared-memory segment (shm, hierarchical: the allreduce reads each rank's bucket in place),
/// onto the CUDA device (nccl), else into aligned host memory (tcp, mpi, one rank).

#include <cstddef>
#include <cstring>

#include <ddp/version.hpp>
#include <ddp/detail/copy.hpp>
#include <ddp/error.hpp>
#include <ddp/memory/allocator_concept.hpp>
#include <ddp/memory/host_allocator.hpp>
#include <ddp/detail/compiled.hpp>
#include <ddp/reducer/auto.hpp>
#if defined(DDP_WITH_NCCL)
#include <ddp/memory/cuda_allocator.hpp>
#include <ddp/reducer/nccl.hpp>  // for_reducer reads its device and stream
#endif

namespace ddp {
inline namespace DDP_ABI {

/// Segment memory when the reducer has a segment, device memory for NCCL, host memory
/// otherwise. A block the segment cannot hold (a small /dev/shm, as containers have by
/// default) comes from host memory instead: the allreduce then stages it, and stays correct.
/// \code
/// ddp::auto_reducer red{pg};
/// auto alloc = ddp::auto_allocator::for_reducer(red);
/// void* p = alloc.allocate(1 << 20);   // in the segment when red runs on shared memory
/// alloc.deallocate(p, 1 << 20);
/// \endcode
class auto_allocator {
 public:
  /// Host memory (what a default-constructed one hands out).
  auto_allocator() = default;
  /// The allocator for `r`'s buckets (the wrapper builds it so: `ddp::allocator_bound_to`).
  static auto_allocator for_reducer(auto_reducer& r) noexcept {
    auto_allocator a;
    a.link_ = r.segment();
#if defined(DDP_WITH_NCCL)
    if (auto* n = r.nccl()) a.cuda_ = cuda_allocator::for_reducer(*n), a.on_device_ = true;
#endif
    return a;
  }

  void* allocate(std::size_t bytes) const {
#if defined(DDP_WITH_NCCL)
    if (on_device_) return cuda_.allocate(bytes);
#endif
    if (link_ != nullptr && bytes > 0)
      if (void* p = from_segment(link_, bytes)) return p;
    return host_allocator{}.allocate(bytes);
  }
  void deallocate(void* p, std::size_t bytes) const noexcept {
#if defined(DDP_WITH_NCCL)
    if (on_device_) return cuda_.deallocate(p, bytes);
#endif
    if (link_ == nullptr || !to_segment(link_, p, bytes)) host_allocator{}.deallocate(p, bytes);
  }
  memory_kind location() const noexcept {
#if defined(DDP_WITH_NCCL)
    if (on_device_) return memory_kind::cuda;
#endif
    return link_ != nullptr ? memory_kind::shared : memory_kind::host;
  }
#if defined(DDP_WITH_NCCL)
  // Hooks (ddp::copying_allocator): device memory needs CUDA's copies.
  void copy(void* dst, const void* src, std::size_t bytes) const {
    if (on_device_) return cuda_.copy(dst, src, bytes);
    detail::copy_bytes_streaming(dst, src, bytes);
  }
  void zero(void* dst, std::size_t bytes) const {
    if (on_device_) return cuda_.zero(dst, bytes);
    if (bytes > 0) std::memset(dst, 0, bytes);
  }
  /// Whether copy() reaches device memory: only with buckets on the device. The wrapper refuses
  /// device gradients otherwise (data_parallel/bucket_memory.hpp).
  bool copies_device_memory() const noexcept { return on_device_; }
#endif
  /// The segment blocks come from, or nullptr.
  shm* segment() const noexcept { return link_; }

  friend bool operator==(const auto_allocator&, const auto_allocator&) = default;

 private:
  // A block of `segment`, or nullptr when it is full (memory/detail/auto_allocator_impl.hpp).
  static void* from_segment(shm* segment, std::size_t bytes);
  // Gives `p` back to `segment` when it came from there; false otherwise.
  static bool to_segment(shm* segment, void* p, std::size_t bytes) noexcept;

  shm* link_ = nullptr;
#if defined(DDP_WITH_NCCL)
  cuda_allocator cuda_{};
  bool on_device_ = false;
#endif
};

static_assert(device_allocator<auto_allocator>);

}  // namespace DDP_ABI
}  // namespace ddp

#if !defined(DDP_SEPARATE_COMPILATION)
#include <ddp/memory/detail/auto_allocator_impl.hpp>
#endif
