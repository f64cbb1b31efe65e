#pragma once
/// \file memory/shm_allocator.hpp
/// `ddp::shm_allocator`: bucket buffers inside a `ddp::shm` segment, so that the shared-memory
/// allreduce reads each rank's bucket in place and writes each result once (no staging copies).

#include <cstddef>

#include <ddp/version.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/memory/allocator_concept.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Allocates from this rank's part of a `ddp::shm` arena. A cheap handle: copies share the
/// transport, which must outlive them and every block they handed out.
///
/// When every rank's buffer comes from here, `shm::allreduce` takes its zero-copy path.
/// \code
/// ddp::shm link{pg};
/// ddp::shm_allocator alloc{link};
/// auto* g = static_cast<float*>(alloc.allocate(n * sizeof(float)));
/// link.allreduce(g, n, ddp::dtype::f32, ddp::op::sum, pg.deadline());  // in place, no copies
/// alloc.deallocate(g, n * sizeof(float));
/// \endcode
class shm_allocator {
 public:
  explicit shm_allocator(shm& link) noexcept : link_(&link) {}

  /// 64-byte aligned block of `bytes`; nullptr for 0. Throws `ddp::error` (errc::system) when
  /// this rank's part of the arena is full.
  void* allocate(std::size_t bytes) { return link_->allocate(bytes); }
  /// Returns a block from allocate(); nullptr is ignored.
  void deallocate(void* p, std::size_t bytes) noexcept { link_->deallocate(p, bytes); }
  /// Host memory mapped by every local rank.
  memory_kind location() const noexcept { return memory_kind::shared; }
  /// The transport whose arena this allocator draws from.
  shm& transport() const noexcept { return *link_; }

  friend bool operator==(const shm_allocator&, const shm_allocator&) = default;

 private:
  shm* link_;
};

static_assert(device_allocator<shm_allocator>);

}  // namespace DDP_ABI
}  // namespace ddp
