// An allocator whose memory is a device's (known at compile time) but that has no copy hook
// is rejected by the wrapper, naming the missing hook, instead of failing at construction.
#include <cstddef>

#include "ddp/data_parallel.hpp"

struct device_allocator_without_copy {
  void* allocate(std::size_t) { return nullptr; }
  void deallocate(void*, std::size_t) noexcept {}
  constexpr ddp::memory_kind location() const noexcept { return ddp::memory_kind::cuda; }
};

using dp = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, device_allocator_without_copy>;

int main() { return sizeof(dp) > 0 ? 0 : 1; }
