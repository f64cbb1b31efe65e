// An allocator that cannot give memory back is rejected.
#include <cstddef>
#include <cstdlib>

#include "ddp/memory/allocator_concept.hpp"

struct leaky_allocator {
  void* allocate(std::size_t n) { return std::malloc(n); }
  ddp::memory_kind location() const { return ddp::memory_kind::host; }
};

template <ddp::device_allocator A>
void* get(A& a) {
  return a.allocate(64);
}

int main() {
  leaky_allocator a;
  return get(a) != nullptr;
}
