// A reducer whose abort() may throw is rejected by the wrapper, naming the hook's concept: the
// wrapper calls abort() on paths that must not throw.
#include "ddp/data_parallel.hpp"

struct throwing_abort_ring : ddp::ring<ddp::tcp> {
  using ddp::ring<ddp::tcp>::ring;
  void abort() {}  // not noexcept
};

using dp = ddp::basic_data_parallel<ddp::size_planner, throwing_abort_ring>;

int main() { return sizeof(dp) > 0 ? 0 : 1; }
