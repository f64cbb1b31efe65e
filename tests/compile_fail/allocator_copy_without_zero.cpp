// An allocator with the copy hook but no zero hook is rejected by the wrapper, naming the
// missing hook: the wrapper could not clear memory it does not copy itself.
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "ddp/data_parallel.hpp"

struct copy_only_allocator {
  void* allocate(std::size_t n) { return std::malloc(n); }
  void deallocate(void* p, std::size_t) noexcept { std::free(p); }
  ddp::memory_kind location() const noexcept { return ddp::memory_kind::host; }
  void copy(void* dst, const void* src, std::size_t n) { std::memcpy(dst, src, n); }
};

using dp = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, copy_only_allocator>;

int main() { return sizeof(dp) > 0 ? 0 : 1; }
