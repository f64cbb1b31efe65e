#pragma once
/// \file allocator_concept.hpp
/// The `device_allocator` policy concept (where bucket buffers live) and the named concepts of
/// its optional hooks: `allocator_with_copy`, `allocator_with_zero` (memory the CPU cannot
/// touch) and `copying_allocator` (both).

#include <concepts>
#include <cstddef>
#include <type_traits>

#include <ddp/version.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Where an allocator's memory lives; the wrapper and reducers pick their copy path from it.
enum class memory_kind {
  host,    ///< pageable host memory
  pinned,  ///< page-locked host memory (cudaHostAlloc), DMA-capable
  shared,  ///< host memory mapped by several processes (one segment for all local ranks)
  cuda,    ///< device memory of one CUDA device
};

/// True when the CPU may read and write the memory directly.
constexpr bool host_accessible(memory_kind k) noexcept { return k != memory_kind::cuda; }

constexpr const char* memory_kind_name(memory_kind k) noexcept {
  switch (k) {
    case memory_kind::host:
      return "host";
    case memory_kind::pinned:
      return "pinned";
    case memory_kind::shared:
      return "shared";
    case memory_kind::cuda:
      return "cuda";
  }
  return "?";
}

/// `a.allocate(bytes)` returns `void*`.
template <class A>
concept has_allocate = requires(A& a, std::size_t bytes) {
  { a.allocate(bytes) } -> std::same_as<void*>;
};

/// `a.deallocate(p, bytes)` releases what `allocate(bytes)` returned.
template <class A>
concept has_deallocate = requires(A& a, void* p, std::size_t bytes) {
  a.deallocate(p, bytes);
};

/// `a.deallocate(p, bytes)` is `noexcept`: the wrapper frees buckets in destructors and on
/// error paths, where an exception would end the program. An allocator whose release can fail
/// (CUDA) records the failure instead of throwing it.
template <class A>
concept has_nothrow_deallocate = has_deallocate<A> && requires(A& a, void* p, std::size_t bytes) {
  { a.deallocate(p, bytes) }
  noexcept;
};

/// `a.location()` says which `memory_kind` the allocator hands out.
template <class A>
concept has_memory_location = requires(const A& a) {
  { a.location() } -> std::same_as<memory_kind>;
};

/// An allocator policy for bucket buffers, e.g. `ddp::host_allocator`.
///
/// Semantic requirements the compiler cannot check: a non-null result is aligned to at least 64
/// bytes (a cache line, so vectorized reductions never split one); `allocate(0)` may return
/// nullptr, and `deallocate(nullptr, 0)` does nothing; failures throw `ddp::error`.
/// \code
/// static_assert(ddp::device_allocator<ddp::host_allocator>);
/// \endcode
template <class A>
concept device_allocator = std::copy_constructible<A> && has_allocate<A> && has_deallocate<A> &&
    has_nothrow_deallocate<A> && has_memory_location<A>;

/// Optional hook: `a.copy(dst, src, bytes)` copies between bucket memory and a parameter's
/// gradient (either side may be device memory). The wrapper then never copies bucket memory
/// itself; without it the wrapper uses `memcpy` and refuses memory the CPU cannot touch.
template <class A>
concept allocator_with_copy = requires(A& a, void* dst, const void* src, std::size_t bytes) {
  a.copy(dst, src, bytes);
};

/// Optional with `copy`: `a.copies_device_memory()`, false when this allocator's copy cannot
/// reach device memory (auto_allocator over a host engine); the wrapper then refuses device
/// gradients at construction. Without it, `copy` is taken to reach every memory.

/// Optional hook: `a.zero(dst, bytes)` clears bucket memory (the slot of an unused parameter).
/// An allocator with `copy` must have it too: the wrapper could not clear such memory itself.
template <class A>
concept allocator_with_zero = requires(A& a, void* dst, std::size_t bytes) {
  a.zero(dst, bytes);
};

/// An allocator that moves bucket bytes itself: both hooks, as `cuda_allocator` has.
/// \code
/// static_assert(ddp::copying_allocator<ddp::cuda_allocator>);
/// \endcode
template <class A>
concept copying_allocator = device_allocator<A> && allocator_with_copy<A> && allocator_with_zero<A>;

/// `A{}.location()` is a constant expression (a default-constructible allocator whose memory
/// kind is fixed), so the wrapper can check at compile time what the memory needs.
template <class A>
concept allocator_with_constant_location = requires {
  typename std::integral_constant<memory_kind, A{}.location()>;
};

/// True when `A`'s memory is known at compile time to be out of the CPU's reach (it then needs
/// `allocator_with_copy` and `allocator_with_zero`).
template <class A>
constexpr bool allocates_device_memory() noexcept {
  if constexpr (allocator_with_constant_location<A>)
    return !host_accessible(A{}.location());
  else
    return false;
}

}  // namespace DDP_ABI
}  // namespace ddp
