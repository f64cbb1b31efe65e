#pragma once
// Host buckets for device gradients: page-locked memory that the wrapper fills from, and reads
// back into, device gradients through CUDA copies (the ddp::copying_allocator hooks). What a
// program writes to reduce device gradients with one of ddp's host reducers (ring<shm>, the
// default reducer's shm engine) when NCCL cannot run, as on one GPU shared by several ranks.
// Such a program also passes dp_options{.broadcast_parameters = false}: the initial broadcast
// hands the parameters themselves (device memory) to the reducer.

#include <ddp/memory/allocator_concept.hpp>
#include <ddp/memory/pinned_allocator.hpp>

#include <cstddef>
#include <cstring>

namespace ddp_test {

struct pinned_staging {
  void* allocate(std::size_t bytes) const { return ddp::pinned_allocator{}.allocate(bytes); }
  void deallocate(void* p, std::size_t bytes) const noexcept { ddp::pinned_allocator{}.deallocate(p, bytes); }
  // cudaMemcpy with cudaMemcpyDefault: the direction follows the pointers, and the call returns
  // when the bytes have arrived. On the legacy default stream, so it follows the gradients a
  // program computed there (LibTorch's default).
  void copy(void* dst, const void* src, std::size_t bytes) const {
    if (bytes > 0) DDP_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  }
  void zero(void* dst, std::size_t bytes) const { std::memset(dst, 0, bytes); }
  constexpr ddp::memory_kind location() const noexcept { return ddp::memory_kind::pinned; }
  friend constexpr bool operator==(const pinned_staging&, const pinned_staging&) noexcept = default;
};

static_assert(ddp::copying_allocator<pinned_staging>);

}  // namespace ddp_test
