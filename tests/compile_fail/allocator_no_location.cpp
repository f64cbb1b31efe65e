// An allocator must say where its memory lives.
#include <cstddef>
#include <cstdlib>

#include "ddp/memory/allocator_concept.hpp"

struct anywhere_allocator {
  void* allocate(std::size_t n) { return std::malloc(n); }
  void deallocate(void* p, std::size_t) noexcept { std::free(p); }
};

template <ddp::device_allocator A>
void* get(A& a) {
  return a.allocate(64);
}

int main() {
  anywhere_allocator a;
  return get(a) != nullptr;
}
