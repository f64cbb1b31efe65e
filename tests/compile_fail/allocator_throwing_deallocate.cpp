// An allocator whose deallocate may throw is rejected: the wrapper frees buckets in destructors
// and on error paths, where an exception would end the program.
#include <cstddef>
#include <cstdlib>

#include "ddp/memory/allocator_concept.hpp"

struct throwing_allocator {
  void* allocate(std::size_t n) { return std::malloc(n); }
  void deallocate(void* p, std::size_t) { std::free(p); }  // not noexcept
  ddp::memory_kind location() const { return ddp::memory_kind::host; }
};

template <ddp::device_allocator A>
void* get(A& a) {
  return a.allocate(64);
}

int main() {
  throwing_allocator a;
  return get(a) != nullptr;
}
