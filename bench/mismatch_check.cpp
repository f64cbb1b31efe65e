// The CPU cost of one collective-descriptor check (detail::mismatch on two equal descriptors,
// the path every message of a tcp ring or tree and every shm collective takes when nothing is
// wrong), in nanoseconds; bench/mismatch_cost.sh turns it into a bound on the share of a 1 MiB
// allreduce.
#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/detail/collective.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

int main() {
  ddp::detail::coll_desc a{}, b{};
  a.count = b.count = 262144;
  std::vector<double> ns;
  std::size_t sink = 0;
  for (int round = 0; round < 15; ++round) {
    constexpr int n = 2'000'000;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) {
      a.seq = b.seq = static_cast<std::uint64_t>(i);  // a fresh pair each time, as on the wire
      asm volatile("" : : "r"(&a), "r"(&b) : "memory");
      sink += ddp::detail::mismatch(a, 0, b, 1).size();
    }
    ns.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n);
  }
  std::sort(ns.begin(), ns.end());
  std::printf("mismatch_check_ns,%.2f\n", ns[ns.size() / 2]);
  return sink == 0 ? 0 : 1;
}
