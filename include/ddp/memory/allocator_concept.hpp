#pragma once
/// \file allocator_concept.hpp
/// The `device_allocator` policy concept: where bucket buffers live.

#include <concepts>
#include <cstddef>

#include <ddp/version.hpp>

namespace ddp {
inline namespace v0 {

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
    case memory_kind::host: return "host";
    case memory_kind::pinned: return "pinned";
    case memory_kind::shared: return "shared";
    case memory_kind::cuda: return "cuda";
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
concept has_deallocate = requires(A& a, void* p, std::size_t bytes) { a.deallocate(p, bytes); };

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
concept device_allocator =
    std::copy_constructible<A> && has_allocate<A> && has_deallocate<A> && has_memory_location<A>;

}  // namespace v0
}  // namespace ddp
