// ddp's allreduce sweep, nccl-tests style, in the CSV columns of bench/peers/sweep.hpp so that
// it plots and compares with Gloo, Open MPI and PyTorch runs of the same sweep.
//
//   allreduce --ranks 2 [--algo machine,ring_tcp,tree_tcp,ring_shm,tree_shm,ring_shm_zerocopy,default,default_alloc]
//             [--min-bytes 4096] [--max-bytes 268435456] [--factor 4] [--iters N]
//
// `default` is the reducer a user gets without naming one: `ddp::auto_reducer{pg}` (the engine
// `ddp::data_parallel` runs; on one host ring<shm> with default shm_options) reducing the caller's
// heap buffer; `default_alloc` the same with buffers from `ddp::auto_allocator::for_reducer`, where
// `ddp::data_parallel` puts its buckets (the segment, read in place). Rank 0 prints the
// reducer's describe() on stderr.
//
// Each algorithm gets a fresh set of processes (forked here) and its own process group. Time
// per iteration is the slowest rank's, each iteration starts after a barrier, and inputs are
// checked after the timed loop (rank+1 everywhere: the sum is n(n+1)/2).
//
// DDP_BENCH_BIND=1 binds rank r to the r-th core this process may use, when there are no more
// ranks than cores (what mpirun does by default, --bind-to core), and names the rows
// `<algo>_bound`. Unbound, the scheduler may keep two ranks on one core while another is idle
// (they hand the core back and forth and never sleep), and each step then costs a yield.
#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/detail/kernels.hpp>
#include <ddp/memory/auto_allocator.hpp>
#include <ddp/memory/shm_allocator.hpp>
#include <ddp/reducer/auto.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/tree.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/transport/tcp.hpp>

#include "free_port.hpp"

#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "sweep.hpp"

namespace {


// Collects per-iteration times from all ranks at rank 0 (after the timed loop, off the clock).
std::vector<double> max_over_ranks(ddp::process_group& pg, const std::vector<double>& mine) {
  std::string blob(reinterpret_cast<const char*>(mine.data()), mine.size() * sizeof(double));
  auto all = pg.all_gather(blob);
  std::vector<double> out = mine;
  for (auto& b : all)
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = std::max(out[i], reinterpret_cast<const double*>(b.data())[i]);
  return out;
}

template <class Reducer, class Alloc>
int sweep_one(ddp::process_group& pg, Reducer& red, Alloc alloc, const sweep::options& o, const std::string& name) {
  int bad = 0;
  for (std::size_t bytes : sweep::sizes(o)) {
    const std::size_t count = bytes / 4;
    float* v = alloc(bytes);
    std::fill(v, v + count, 0.0f);
    std::span<float> s(v, count);
    const int iters = sweep::iters_for(o, bytes), warm = sweep::warmup_for(o, bytes);
    for (int i = 0; i < warm; ++i) red.allreduce(s, ddp::op::sum);
    std::vector<double> t;
    for (int i = 0; i < iters; ++i) {
      red.barrier();  // the reducer's own barrier: shm ranks leave it within a microsecond
      const auto t0 = std::chrono::steady_clock::now();
      red.allreduce(s, ddp::op::sum);
      t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::fill(v, v + count, static_cast<float>(pg.rank() + 1));
    red.allreduce(s, ddp::op::sum);
    const std::size_t wrong = sweep::count_wrong(v, count, pg.size());
    bad += wrong != 0;
    const auto all = max_over_ranks(pg, t);
    if (pg.rank() == 0) {
      sweep::print_row("ddp", name, pg.size(), bytes, iters, sweep::summarize(all));
      if (wrong) std::fprintf(stderr, "ddp %s: %zu wrong elements at %zu bytes\n", name.c_str(), wrong, bytes);
    }
  }
  return bad;
}

// Binds the calling process to the rank-th core of its affinity mask (see DDP_BENCH_BIND above).
bool bind_to_core(int rank, int ranks) {
  const char* e = std::getenv("DDP_BENCH_BIND");
  if (e == nullptr || std::string(e) != "1") return false;
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (::sched_getaffinity(0, sizeof mask, &mask) != 0 || CPU_COUNT(&mask) < ranks) return false;
  for (int cpu = 0, seen = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &mask) || seen++ != rank) continue;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    return ::sched_setaffinity(0, sizeof one, &one) == 0;
  }
  return false;
}

// sweep_one over buffers from an allocator (`allocate(bytes)`, `deallocate(p, bytes)`), one size
// at a time and freed as it goes: one buffer per size would exhaust a segment's arena on big
// sweeps.
template <class Reducer, class Allocator>
int sweep_allocated(ddp::process_group& pg, Reducer& red, Allocator& a, const sweep::options& o,
                    const std::string& name) {
  std::vector<std::pair<void*, std::size_t>> blocks;
  auto from_alloc = [&](std::size_t bytes) {
    blocks.emplace_back(a.allocate(bytes), bytes);
    return static_cast<float*>(blocks.back().first);
  };
  int bad = 0;
  for (std::size_t bytes : sweep::sizes(o)) {
    sweep::options one = o;
    one.min_bytes = one.max_bytes = bytes;
    bad += sweep_one(pg, red, from_alloc, one, name);
    for (auto& [p, n] : blocks) a.deallocate(p, n);
    blocks.clear();
  }
  return bad;
}

int run_rank(int rank, int port, const sweep::options& o, const std::string& algo_name) {
  const std::string algo = algo_name;
  const std::string name = bind_to_core(rank, o.ranks) ? algo + "_bound" : algo;
  ddp::init_options io;
  io.rank = rank;
  io.world_size = o.ranks;
  io.master_port = port;
  io.timeout = std::chrono::seconds(120);
  auto pg = ddp::init_process_group(io);
  std::vector<std::unique_ptr<float[], void (*)(float*)>> keep;
  auto heap = [&](std::size_t bytes) {
    keep.emplace_back(static_cast<float*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096)),
                      [](float* p) { std::free(p); });
    return keep.back().get();
  };
  if (algo == "default" || algo == "default_alloc") {
    ddp::auto_reducer r{pg};
    if (pg.rank() == 0) std::fprintf(stderr, "# %s: %s\n", name.c_str(), r.describe().c_str());
    if (algo == "default") return sweep_one(pg, r, heap, o, name);
    auto a = ddp::auto_allocator::for_reducer(r);
    return sweep_allocated(pg, r, a, o, name);
  }
  if (algo == "ring_tcp") { ddp::ring<ddp::tcp> r{pg}; return sweep_one(pg, r, heap, o, name); }
  if (algo == "tree_tcp") { ddp::tree<ddp::tcp> r{pg}; return sweep_one(pg, r, heap, o, name); }
  const ddp::shm_options so{.segment_bytes = std::max<std::size_t>(o.max_bytes * 2, 64 << 20) * static_cast<std::size_t>(o.ranks)};
  if (algo == "ring_shm") { ddp::ring<ddp::shm> r{pg, so, {}}; return sweep_one(pg, r, heap, o, name); }
  if (algo == "tree_shm") { ddp::tree<ddp::shm> r{pg, so, {}}; return sweep_one(pg, r, heap, o, name); }
  if (algo == "ring_shm_zerocopy") {
    ddp::ring<ddp::shm> r{pg, so, {}};
    ddp::shm_allocator a{r.transport()};
    return sweep_allocated(pg, r, a, o, name);
  }
  std::fprintf(stderr, "allreduce: unknown algo %s\n", algo.c_str());
  return 2;
}

// The machine's limits in the same run: memcpy (bytes moved) and `a += b` on float32 (bytes
// touched: read a, read b, write a), single thread, arrays of `bytes` each. Rows use
// system=machine so bench/report.py can compute the memory-bandwidth limit of an allreduce:
// 2 x ranks x bytes / (a += b touched bandwidth).
void machine_rows(std::size_t bytes, int reps) {
  const std::size_t n = bytes / sizeof(float);
  auto* a = static_cast<float*>(std::aligned_alloc(4096, bytes));
  auto* b = static_cast<float*>(std::aligned_alloc(4096, bytes));
  std::fill(a, a + n, 1.0f);
  std::fill(b, b + n, 2.0f);
  auto time = [&](auto&& f) {
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      f();
      t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    return sweep::summarize(t);
  };
  const auto cp = time([&] { std::memcpy(a, b, bytes); });
  const auto add = time([&] { ddp::detail::reduce_into(a, b, n, ddp::op::sum); });
  // algbw column: bytes moved (memcpy: 2x) or touched (add: 3x) per second, in GB/s.
  std::printf("machine,memcpy,1,%zu,%d,%.2f,%.2f,%.4f,%.4f\n", bytes, reps, cp.median_us, cp.p10_us,
              2.0 * static_cast<double>(bytes) / (cp.median_us * 1e3), 2.0 * static_cast<double>(bytes) / (cp.median_us * 1e3));
  std::printf("machine,add,1,%zu,%d,%.2f,%.2f,%.4f,%.4f\n", bytes, reps, add.median_us, add.p10_us,
              3.0 * static_cast<double>(bytes) / (add.median_us * 1e3), 3.0 * static_cast<double>(bytes) / (add.median_us * 1e3));
  std::fflush(stdout);
  std::free(a);
  std::free(b);
}

}  // namespace

int main(int argc, char** argv) {
  const char* algos = "machine,ring_tcp,tree_tcp,ring_shm,tree_shm,ring_shm_zerocopy";
  auto o = sweep::parse(argc, argv, algos);
  if (o.algo.empty()) o.algo = algos;
  sweep::print_header();
  int status = 0;
  for (const auto& algo : sweep::split(o.algo)) {
    if (algo == "machine") {
      machine_rows(std::size_t{64} << 20, 9);
      continue;
    }
    const int port = bench::free_port();
    std::vector<pid_t> kids;
    for (int r = 0; r < o.ranks; ++r) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        int rc = 1;
        try {
          rc = run_rank(r, port, o, algo);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "allreduce %s rank %d: %s\n", algo.c_str(), r, e.what());
        }
        std::fflush(nullptr);
        ::_exit(rc);
      }
      kids.push_back(pid);
    }
    for (pid_t k : kids) {
      int st = 0;
      ::waitpid(k, &st, 0);
      if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) status = 1;
    }
  }
  return status;
}
