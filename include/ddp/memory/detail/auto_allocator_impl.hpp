#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// `auto_allocator`'s use of the shared-memory segment (memory/auto_allocator.hpp): inline in a
// header-only build, compiled once in src/ddp.cpp in compiled mode (detail/compiled.hpp).

#include <cstddef>

#include <ddp/version.hpp>
#include <ddp/detail/compiled.hpp>
#include <ddp/error.hpp>
#include <ddp/memory/auto_allocator.hpp>
#include <ddp/reducer/shm.hpp>

namespace ddp {
inline namespace DDP_ABI {

DDP_DECL void* auto_allocator::from_segment(shm* segment, std::size_t bytes) {
  try {
    return segment->allocate(bytes);
  } catch (const error& e) {
    if (e.condition() != errc::system) throw;  // the segment is full: host memory instead
  }
  return nullptr;
}

DDP_DECL bool auto_allocator::to_segment(shm* segment, void* p, std::size_t bytes) noexcept {
  if (!segment->contains(p)) return false;
  segment->deallocate(p, bytes);
  return true;
}

}  // namespace DDP_ABI
}  // namespace ddp
