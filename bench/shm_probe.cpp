// Probe of the shared-memory allreduce against the machine's memory bandwidth.
//
//   shm_probe [ranks=2] [iters=20] [sizes in KiB, default 4 1024 65536]
//
// For each size: f32 sum, ring staged (ordinary buffers), ring zero-copy (buffers from
// shm_allocator) and tree staged; the time of one iteration is the slowest rank's, and the
// table shows the median and p10 over iterations. The bandwidth limit of the zero-copy path is
// 2 x ranks x bytes (every input read once, every output written once) at the `a += b`
// bandwidth measured first in the same run.

#include <ddp/memory/shm_allocator.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/shm.hpp>

#include "free_port.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using clk = std::chrono::steady_clock;


// `a += b` over 64 MiB arrays, single thread; bytes touched: read a, read b, write a.
double add_bandwidth_gbs() {
  const std::size_t n = std::size_t{16} << 20;
  std::vector<float> a(n, 1.0f), b(n, 2.0f);
  std::vector<double> t;
  for (int it = 0; it < 7; ++it) {
    const auto t0 = clk::now();
    float* __restrict pa = a.data();
    const float* __restrict pb = b.data();
    for (std::size_t i = 0; i < n; ++i) pa[i] += pb[i];
    t.push_back(std::chrono::duration<double>(clk::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  std::printf("(a[0] = %g)\n", static_cast<double>(a[0]));
  return 3.0 * static_cast<double>(n * sizeof(float)) / t[t.size() / 2] / 1e9;
}

struct stats {
  double median_us, p10_us;
};

// Times `iters` calls of `body` on every rank; an iteration's time is the slowest rank's.
template <class F>
stats measure(ddp::process_group& pg, ddp::shm& link, int iters, F&& body) {
  body();  // warm-up: page faults, caches
  std::vector<double> mine;
  for (int it = 0; it < iters; ++it) {
    link.barrier(pg.deadline());
    const auto t0 = clk::now();
    body();
    mine.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count());
  }
  std::string blob(reinterpret_cast<const char*>(mine.data()), mine.size() * sizeof(double));
  const auto all = pg.all_gather(blob);
  std::vector<double> worst(static_cast<std::size_t>(iters), 0.0);
  for (auto& b : all)
    for (int it = 0; it < iters; ++it) {
      double v;
      std::memcpy(&v, b.data() + it * sizeof(double), sizeof v);
      worst[it] = std::max(worst[it], v);
    }
  std::sort(worst.begin(), worst.end());
  return {worst[worst.size() / 2], worst[worst.size() / 10]};
}

void rank_main(int r, int n, int port, int iters, const std::vector<std::size_t>& kib, double bw) {
  ddp::init_options o;
  o.rank = r;
  o.world_size = n;
  o.master_addr = "127.0.0.1";
  o.master_port = port;
  o.timeout = std::chrono::seconds(60);
  auto pg = ddp::init_process_group(o);
  std::size_t largest = 0;
  for (auto k : kib) largest = std::max(largest, k << 10);
  ddp::shm_options so;
  so.segment_bytes = static_cast<std::size_t>(n) * (largest + (1 << 20));
  // Tunables to sweep: SHM_SLOT_KIB, SHM_SPIN.
  if (const char* v = std::getenv("SHM_SLOT_KIB")) so.slot_bytes = static_cast<std::size_t>(std::atoll(v)) << 10;
  if (const char* v = std::getenv("SHM_SPIN")) so.spin = std::atoi(v);
  ddp::shm link{pg, so};
  ddp::shm_allocator alloc{link};
  for (auto k : kib) {
    const std::size_t bytes = k << 10, count = bytes / 4;
    std::vector<float> plain(count, 1.0f);
    auto* zc = static_cast<float*>(alloc.allocate(bytes));
    std::fill(zc, zc + count, 1.0f);
    const int it = bytes >= (std::size_t{16} << 20) ? iters : iters * 10;
    const auto ring = measure(pg, link, it, [&] {
      link.allreduce(plain.data(), count, ddp::dtype::f32, ddp::op::sum, pg.deadline());
    });
    const auto zero = measure(pg, link, it, [&] {
      link.allreduce(zc, count, ddp::dtype::f32, ddp::op::sum, pg.deadline());
    });
    const auto tree = measure(pg, link, it, [&] {
      link.allreduce(plain.data(), count, ddp::dtype::f32, ddp::op::sum, pg.deadline(), ddp::shm_algo::tree);
    });
    alloc.deallocate(zc, bytes);
    if (r == 0) {
      const double limit_us = 2.0 * n * static_cast<double>(bytes) / (bw * 1e9) * 1e6;
      auto row = [&](const char* name, stats s) {
        const double algbw = static_cast<double>(bytes) / (s.median_us * 1e-6) / 1e9;
        std::printf("%2d %9zu KiB  %-10s median %10.1f us  p10 %10.1f us  algbw %6.2f GB/s  busbw %6.2f GB/s  "
                    "x limit %5.2f\n",
                    n, k, name, s.median_us, s.p10_us, algbw, algbw * 2.0 * (n - 1) / n, s.median_us / limit_us);
      };
      row("staged", ring);
      row("zero-copy", zero);
      row("tree", tree);
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 2;
  const int iters = argc > 2 ? std::atoi(argv[2]) : 20;
  std::vector<std::size_t> kib;
  for (int i = 3; i < argc; ++i) kib.push_back(static_cast<std::size_t>(std::atoll(argv[i])));
  if (kib.empty()) kib = {4, 1024, 65536};
  const double bw = add_bandwidth_gbs();
  std::printf("a += b: %.1f GB/s touched; limit = 2 x ranks x bytes at that rate\n", bw);
  const int port = bench::free_port();
  std::fflush(stdout);  // children must not print the parent's buffered lines again
  std::vector<pid_t> kids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      try {
        rank_main(r, n, port, iters, kib, bw);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        std::_Exit(1);
      }
      std::_Exit(0);
    }
    kids.push_back(pid);
  }
  int bad = 0;
  for (pid_t p : kids) {
    int st = 0;
    ::waitpid(p, &st, 0);
    bad += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  }
  return bad == 0 ? 0 : 1;
}
