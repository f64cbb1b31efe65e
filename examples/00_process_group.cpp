// Joins a process group from the launcher's environment, runs barriers and broadcasts, and
// prints a check. Run with: ddprun -n 4 ./00_process_group
#include <ddp/ddp.hpp>

#include <cstdio>
#include <numeric>
#include <vector>

int main() try {
  auto pg = ddp::init_process_group(ddp::init_options::from_env());
  for (int i = 0; i < 10; ++i) pg.barrier();

  // Every rank takes a turn as root; everyone checks what arrived.
  long bad = 0;
  for (int root = 0; root < pg.size(); ++root) {
    std::vector<double> v(1 << 16);
    if (pg.rank() == root) std::iota(v.begin(), v.end(), 1000.0 * root);
    pg.broadcast(std::span<double>(v), root);
    for (std::size_t i = 0; i < v.size(); ++i) bad += v[i] != 1000.0 * root + static_cast<double>(i);
  }
  auto names = pg.all_gather("hello from rank " + std::to_string(pg.rank()));
  pg.barrier();
  std::printf("rank %d of %d: %zu greetings, broadcast check %s\n", pg.rank(), pg.size(), names.size(),
              bad == 0 ? "OK" : "FAILED");
  return bad == 0 ? 0 : 1;
} catch (const ddp::error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
