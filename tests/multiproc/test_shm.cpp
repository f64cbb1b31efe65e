#include <ddp/reducer/shm.hpp>
#include <ddp/data_parallel.hpp>
#include <ddp/memory/shm_allocator.hpp>
#include <ddp/planner/size_planner.hpp>
#include <ddp/reducer/ring.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <signal.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "harness.hpp"

using namespace std::chrono_literals;
using ddp_test::expect_ok;
using ddp_test::free_port;
using ddp_test::local_group;
using ddp_test::on_ranks;
using ddp_test::run_processes;
using ddp_test::run_ranks;
using ddp::dtype;
using ddp::op;

namespace {

constexpr ddp_test::local_group opts{20s};

using ddp_test::require;
using ddp_test::require_raises;

std::set<std::string> shm_entries() {
  std::set<std::string> names;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (std::strncmp(e->d_name, "ddp-", 4) == 0) names.insert(e->d_name);
    ::closedir(d);
  }
  return names;
}

// Checks, in the parent, that a test left no segment of its own behind. Other jobs on the
// machine may own entries: one that is still setting up its group holds its name until all its
// ranks have mapped it, so only names that appeared and are still there 5 s later count.
struct no_leftovers {
  std::set<std::string> before = shm_entries();
  ~no_leftovers() {
    std::string left;
    for (int tries = 0; tries < 50; ++tries) {
      left.clear();
      for (auto& n : shm_entries())
        if (!before.count(n)) left += n + " ";
      if (left.empty()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    CHECK_MESSAGE(left.empty(), "left in /dev/shm: " << left);
  }
};

// Each rank's input is a pure function of (rank, index, dtype, op), so every rank can compute
// the expected result on its own.
double input(dtype t, op o, int r, std::size_t i) {
  const bool integer = t == dtype::i32 || t == dtype::i64;
  if (o == op::prod) return integer ? static_cast<double>(static_cast<int>((r + i) % 4) - 1)
                                    : 1.0 + (static_cast<double>((r * 5 + i * 3) % 9) - 4.0) / 64.0;
  const double v = static_cast<double>(static_cast<int>((r * 31 + i * 17) % 23) - 11);
  return integer ? v : v * 0.1 + 0.01 * r;
}

// The value `v` becomes when stored as `t`.
double stored(dtype t, double v) {
  switch (t) {
    case dtype::f32: return static_cast<float>(v);
    case dtype::f64: return v;
    case dtype::f16: return static_cast<float>(ddp::half(static_cast<float>(v)));
    case dtype::bf16: return static_cast<float>(ddp::bfloat16(static_cast<float>(v)));
    case dtype::i32: return static_cast<double>(static_cast<std::int32_t>(v));
    case dtype::i64: return static_cast<double>(static_cast<std::int64_t>(v));
  }
  return v;
}

void store(void* p, dtype t, std::size_t i, double v) {
  switch (t) {
    case dtype::f32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case dtype::f64: static_cast<double*>(p)[i] = v; break;
    case dtype::f16: static_cast<ddp::half*>(p)[i] = ddp::half(static_cast<float>(v)); break;
    case dtype::bf16: static_cast<ddp::bfloat16*>(p)[i] = ddp::bfloat16(static_cast<float>(v)); break;
    case dtype::i32: static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v); break;
    case dtype::i64: static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v); break;
  }
}

double load(const void* p, dtype t, std::size_t i) {
  switch (t) {
    case dtype::f32: return static_cast<const float*>(p)[i];
    case dtype::f64: return static_cast<const double*>(p)[i];
    case dtype::f16: return static_cast<float>(static_cast<const ddp::half*>(p)[i]);
    case dtype::bf16: return static_cast<float>(static_cast<const ddp::bfloat16*>(p)[i]);
    case dtype::i32: return static_cast<const std::int32_t*>(p)[i];
    case dtype::i64: return static_cast<double>(static_cast<const std::int64_t*>(p)[i]);
  }
  return 0;
}

void fill(void* p, dtype t, op o, int r, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) store(p, t, i, input(t, o, r, i));
}

double expected(dtype t, op o, int world, std::size_t i) {
  double acc = stored(t, input(t, o, 0, i));
  for (int r = 1; r < world; ++r) {
    const double v = stored(t, input(t, o, r, i));
    switch (o) {
      case op::sum: case op::avg: acc += v; break;
      case op::prod: acc *= v; break;
      case op::min: acc = std::min(acc, v); break;
      case op::max: acc = std::max(acc, v); break;
    }
  }
  if (o == op::avg) {
    if (t == dtype::i32 || t == dtype::i64) acc = std::trunc(acc / world);
    else acc /= world;
  }
  return acc;
}

double tolerance(dtype t) {
  switch (t) {
    case dtype::f32: return 1e-5;
    case dtype::f64: return 1e-12;
    case dtype::f16: return 4e-3;
    case dtype::bf16: return 2e-2;
    default: return 0;
  }
}

void check_result(const void* p, dtype t, op o, int world, std::size_t n, const std::string& what) {
  const double tol = tolerance(t);
  for (std::size_t i = 0; i < n; ++i) {
    const double want = expected(t, o, world, i);
    const double got = load(p, t, i);
    if (!(std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want))))
      throw std::runtime_error(what + ": element " + std::to_string(i) + " is " + std::to_string(got) +
                               ", expected " + std::to_string(want));
  }
}

std::string fnv(const void* p, std::size_t bytes) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
  return std::to_string(h);
}

// Every rank holds the same bits: compare a hash through the process group.
void check_same_bits(ddp::process_group& pg, const void* p, std::size_t bytes, const std::string& what) {
  const auto all = pg.all_gather(fnv(p, bytes));
  for (auto& h : all) require(h == all[0], what + ": ranks hold different bits");
}

void check_unlinked(const ddp::shm& link) {
  require(::access(("/dev/shm" + link.name()).c_str(), F_OK) != 0, link.name() + " is still in /dev/shm");
}

// Runs one allreduce of `count` elements and checks values and cross-rank bits.
void allreduce_case(ddp::process_group& pg, ddp::shm& link, std::size_t count, dtype t, op o, ddp::shm_algo a,
                    bool in_arena) {
  const std::size_t bytes = count * ddp::dtype_size(t);
  std::vector<std::byte> heap(in_arena ? 0 : bytes + 1);
  void* buf = in_arena ? link.allocate(bytes) : heap.data();
  if (in_arena && count > 0) require(link.contains(buf), "arena buffer not in the arena");
  fill(buf, t, o, pg.rank(), count);
  link.allreduce(buf, count, t, o, pg.deadline(), a);
  const std::string what = std::string("allreduce ") + std::to_string(count) + " x " + ddp::dtype_name(t) + " " +
                           ddp::op_name(o) + " " + ddp::shm_algo_name(a) + (in_arena ? " arena" : " staged") +
                           " on " + std::to_string(pg.size()) + " ranks";
  check_result(buf, t, o, pg.size(), count, what);
  check_same_bits(pg, buf, bytes, what);
  if (in_arena) link.deallocate(buf, bytes);
}

// A real model's parameter shapes (tests/data/NAME.params, one `name dim dim ...` per line):
// the element count of each parameter, in registration order.
std::vector<std::size_t> model_numels(const std::string& name) {
  const std::string path = std::string(DDP_TEST_DATA) + "/" + name + ".params";
  std::ifstream in(path);
  require(static_cast<bool>(in), "cannot read " + path);
  std::vector<std::size_t> out;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string param;
    ls >> param;
    std::size_t n = 1;
    for (std::size_t d; ls >> d;) n *= d;
    out.push_back(n);
  }
  require(!out.empty(), "no parameters in " + path);
  return out;
}

}  // namespace

TEST_CASE("allreduce on 1, 2, 3, 4 and 8 ranks: counts 0, 1, 7, 13, 1000003, ring and tree, staged and in the arena") {
  no_leftovers guard;
  for (int n : {1, 2, 3, 4, 8}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
      ddp::shm link{pg, {.segment_bytes = std::size_t{64} << 20}};
      link.barrier(pg.deadline());  // rank 0 unlinks right after every rank mapped the segment
      check_unlinked(link);
      require(link.rank() == r && link.size() == n, "rank/size");
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{13},
                                std::size_t{1000003}, std::size_t{262144 + 3}})
        for (auto a : {ddp::shm_algo::ring, ddp::shm_algo::tree}) {
          allreduce_case(pg, link, count, dtype::f32, op::sum, a, false);
          if (a == ddp::shm_algo::ring) allreduce_case(pg, link, count, dtype::f32, op::sum, a, true);
        }
      allreduce_case(pg, link, 1000003, dtype::i32, op::sum, ddp::shm_algo::ring, false);
      allreduce_case(pg, link, 1000003, dtype::f64, op::avg, ddp::shm_algo::ring, true);
    }, 120s));
  }
}

TEST_CASE("allreduce: all 6 dtypes x 5 ops, ring and tree, across chunk boundaries") {
  no_leftovers guard;
  for (int n : {2, 3}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, opts, [&](ddp::process_group& pg) {
      // Small slots, so 5003 elements take several pipelined chunks.
      ddp::shm link{pg, {.segment_bytes = std::size_t{8} << 20, .slot_bytes = 4096}};
      for (auto t : {dtype::f32, dtype::f64, dtype::f16, dtype::bf16, dtype::i32, dtype::i64})
        for (auto o : {op::sum, op::avg, op::min, op::max, op::prod})
          for (std::size_t count : {std::size_t{5}, std::size_t{5003}}) {
            allreduce_case(pg, link, count, t, o, ddp::shm_algo::ring, false);
            allreduce_case(pg, link, count, t, o, ddp::shm_algo::ring, true);
            allreduce_case(pg, link, count, t, o, ddp::shm_algo::tree, false);
          }
    }, 120s));
  }
}

TEST_CASE("zero-copy through shm_allocator, and a mix of arena and ordinary buffers") {
  no_leftovers guard;
  const int n = 3;
  expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
    ddp::shm link{pg, {.segment_bytes = std::size_t{48} << 20, .slot_bytes = 8192}};
    ddp::shm_allocator alloc{link};
    static_assert(ddp::device_allocator<ddp::shm_allocator>);
    require(alloc.location() == ddp::memory_kind::shared, "location");
    require(alloc.allocate(0) == nullptr, "allocate(0)");
    alloc.deallocate(nullptr, 0);
    const std::size_t count = 100003;
    auto* a = static_cast<float*>(alloc.allocate(count * sizeof(float)));
    require(reinterpret_cast<std::uintptr_t>(a) % 64 == 0, "alignment");
    for (auto o : {op::sum, op::avg, op::max}) {
      fill(a, dtype::f32, o, r, count);
      link.allreduce(a, count, dtype::f32, o, pg.deadline());
      check_result(a, dtype::f32, o, n, count, "zero-copy");
      check_same_bits(pg, a, count * sizeof(float), "zero-copy");
    }
    // Rank 1 uses an ordinary buffer: its data goes through its slots, the others' stay put.
    std::vector<float> plain(count);
    float* mine = r == 1 ? plain.data() : a;
    for (auto t : {ddp::shm_algo::ring, ddp::shm_algo::tree}) {
      fill(mine, dtype::f32, op::sum, r, count);
      link.allreduce(mine, count, dtype::f32, op::sum, pg.deadline(), t);
      check_result(mine, dtype::f32, op::sum, n, count, "mixed");
      check_same_bits(pg, mine, count * sizeof(float), "mixed");
    }
    alloc.deallocate(a, count * sizeof(float));
    // Freed blocks coalesce: the whole part is one block again.
    void* big = alloc.allocate((std::size_t{48} << 20) / n - 4096);
    alloc.deallocate(big, (std::size_t{48} << 20) / n - 4096);
    require_raises([&] { (void)alloc.allocate(std::size_t{64} << 20); }, ddp::errc::system, {"arena exhausted"},
                   "an oversized allocation");
  }));
}

TEST_CASE("reduce_scatter, allgather, broadcast and barrier on 1 to 4 ranks") {
  no_leftovers guard;
  for (int n : {1, 2, 3, 4}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
      ddp::shm link{pg, {.segment_bytes = std::size_t{1} << 20, .slot_bytes = 4096}};
      for (std::size_t cpr : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{3001}}) {
        const std::string tag = " cpr " + std::to_string(cpr);
        // reduce_scatter: slice q of the full vector is reduced; rank r keeps slice r.
        std::vector<double> in(cpr * n), out(cpr + 1, -1);
        fill(in.data(), dtype::f64, op::sum, r, in.size());
        link.reduce_scatter(in.data(), out.data(), cpr, dtype::f64, op::sum, pg.deadline());
        for (std::size_t i = 0; i < cpr; ++i)
          require(std::fabs(out[i] - expected(dtype::f64, op::sum, n, r * cpr + i)) < 1e-9, "reduce_scatter" + tag);
        require(out[cpr] == -1, "reduce_scatter wrote past its slice");
        std::vector<std::int32_t> mine(cpr), all(cpr * n, -7);
        for (std::size_t i = 0; i < cpr; ++i) mine[i] = static_cast<std::int32_t>(r * 100000 + i);
        link.allgather(mine.data(), all.data(), cpr, dtype::i32, pg.deadline());
        for (int q = 0; q < n; ++q)
          for (std::size_t i = 0; i < cpr; ++i)
            require(all[q * cpr + i] == static_cast<std::int32_t>(q * 100000 + i), "allgather" + tag);
        // In place: the input is this rank's slice of the output.
        std::vector<std::int32_t> inplace(cpr * n, -7);
        for (std::size_t i = 0; i < cpr; ++i) inplace[r * cpr + i] = static_cast<std::int32_t>(r * 100000 + i);
        link.allgather(inplace.data() + r * cpr, inplace.data(), cpr, dtype::i32, pg.deadline());
        require(inplace == all, "in-place allgather" + tag);
        for (int root = 0; root < n; ++root) {
          std::vector<char> b(cpr * 5 + 3, 0);
          if (r == root) for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<char>(i * 7 + root);
          link.broadcast(b.data(), b.size(), root, pg.deadline());
          for (std::size_t i = 0; i < b.size(); ++i)
            require(b[i] == static_cast<char>(i * 7 + root), "broadcast from " + std::to_string(root) + tag);
        }
        link.barrier(pg.deadline());
      }
      // Broadcast in the arena (an ordinary path; buffers anywhere are fine).
      auto* p = static_cast<std::uint64_t*>(link.allocate(9000 * 8));
      if (r == n - 1) std::iota(p, p + 9000, std::uint64_t{5});
      link.broadcast(p, 9000 * 8, n - 1, pg.deadline());
      require(p[0] == 5 && p[8999] == 9004, "broadcast in the arena");
      link.deallocate(p, 9000 * 8);
    }));
  }
}

TEST_CASE("mismatched collectives raise errc::mismatch on every rank, with the same message") {
  no_leftovers guard;
  struct variant { const char* name; const char* text; };
  const variant variants[] = {
      {"count", "collective mismatch: rank 0 called allreduce #2 of 1024 x f32 sum by ring, rank 2 called allreduce #2 of 1000 x f32 sum by ring"},
      {"dtype", "collective mismatch: rank 0 called allreduce #2 of 1024 x f32 sum by ring, rank 2 called allreduce #2 of 1024 x i32 sum by ring"},
      {"op", "collective mismatch: rank 0 called allreduce #2 of 1024 x f32 sum by ring, rank 2 called allreduce #2 of 1024 x f32 max by ring"},
      {"kind", "rank 0 called allreduce #2 of 1024 x f32 sum by ring, rank 2 called broadcast #2 of 4096 bytes from root 0 by ring"},
      {"algo", "rank 0 called allreduce #2 of 1024 x f32 sum by ring, rank 2 called allreduce #2 of 1024 x f32 sum by tree (every rank must use the same reducer"},
      {"arena", "collective mismatch: rank 0 called allreduce #2 of 1024 x f32 sum by ring, rank 2 called allreduce #2 of 1000 x f32 sum by ring"},
  };
  for (const auto& v : variants) {
    CAPTURE(v.name);
    const int port = free_port();
    const std::string which = v.name;
    auto outs = run_ranks(3, [&](int r) {
      auto pg = ddp::init_process_group(opts(r, 3, port, 5s));
      ddp::shm link{pg};
      std::vector<float> f(1024, 1.0f);
      std::vector<std::int32_t> i(1024, 1);
      link.allreduce(f.data(), f.size(), dtype::f32, op::sum, pg.deadline());  // in step first
      float* arena = static_cast<float*>(link.allocate(1024 * 4));
      const bool odd = r == 2;
      if (!odd) link.allreduce(which == "arena" ? arena : f.data(), 1024, dtype::f32, op::sum, pg.deadline());
      else if (which == "count") link.allreduce(f.data(), 1000, dtype::f32, op::sum, pg.deadline());
      else if (which == "dtype") link.allreduce(i.data(), 1024, dtype::i32, op::sum, pg.deadline());
      else if (which == "op") link.allreduce(f.data(), 1024, dtype::f32, op::max, pg.deadline());
      else if (which == "kind") link.broadcast(f.data(), 4096, 0, pg.deadline());
      else if (which == "algo") link.allreduce(f.data(), 1024, dtype::f32, op::sum, pg.deadline(), ddp::shm_algo::tree);
      else if (which == "arena") link.allreduce(arena, 1000, dtype::f32, op::sum, pg.deadline());
    });
    INFO(ddp_test::summary(outs));
    for (auto& o : outs) {
      CHECK(o.exit_code == 1);
      CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
      CHECK(o.message.find(v.text) != std::string::npos);
    }
  }
}

TEST_CASE("a rank that dies mid-collective: peer_lost on the others within the timeout, nothing left in /dev/shm") {
  no_leftovers guard;
  for (const char* how : {"sigkill", "exit", "throw"}) {
    CAPTURE(how);
    const std::string h = how;
    const int port = free_port();
    const auto t0 = std::chrono::steady_clock::now();
    auto outs = run_ranks(3, [&](int r) {
      auto pg = ddp::init_process_group(opts(r, 3, port, 5s));
      ddp::shm link{pg};
      link.barrier(pg.deadline());
      check_unlinked(link);
      std::vector<float> v(std::size_t{1} << 20, 1.0f);
      if (r == 1) {
        std::thread([h] {
          std::this_thread::sleep_for(30ms);
          if (h == "sigkill") ::raise(SIGKILL);
          if (h == "exit") ::_exit(3);
        }).detach();
      }
      const auto start = std::chrono::steady_clock::now();
      for (int it = 0; it < 100000; ++it) {
        if (r == 1 && h == "throw" && std::chrono::steady_clock::now() - start > 30ms)
          throw std::runtime_error("rank 1 gives up");  // unwinds: ~shm tells the peers
        link.allreduce(v.data(), v.size(), dtype::f32, op::sum, pg.deadline());
        std::fill(v.begin(), v.end(), 1.0f);
      }
      require(false, "the collectives went on without rank 1");
    });
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    INFO(ddp_test::summary(outs));
    CHECK(secs < 5.0 + 2.0);
    for (int r : {0, 2}) {
      CHECK(outs[r].exit_code == 1);
      CHECK(outs[r].errc == static_cast<int>(ddp::errc::peer_lost));
      CHECK(outs[r].message.find("rank 1") != std::string::npos);
    }
  }
}

TEST_CASE("timeout: a peer that never arrives is a timeout error") {
  no_leftovers guard;
  auto outs = on_ranks(2, local_group{5s}, [&](int r, ddp::process_group& pg) {
    ddp::shm link{pg};
    if (r == 1) std::this_thread::sleep_for(1500ms);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      link.barrier(std::chrono::steady_clock::now() + 300ms);
      // Rank 0 did enter that barrier before giving up, so rank 1 passes it; the next one
      // waits on rank 0, which failed: rank 1 learns it at once, not at its deadline.
      link.barrier(pg.deadline());
    } catch (const ddp::error&) {
      const auto took = std::chrono::steady_clock::now() - t0;
      require(took < 1000ms, "the error took too long");
      throw;
    }
  });
  INFO(ddp_test::summary(outs));
  CHECK(outs[0].errc == static_cast<int>(ddp::errc::timeout));
  CHECK(outs[0].message.find("rank 1 did not arrive before the deadline") != std::string::npos);
  CHECK(outs[1].errc == static_cast<int>(ddp::errc::peer_lost));
  CHECK(outs[1].message.find("rank 0") != std::string::npos);
}

TEST_CASE("abort() wakes every waiter on every rank with errc::aborted") {
  no_leftovers guard;
  auto outs = on_ranks(3, local_group{10s}, [&](int r, ddp::process_group& pg) {
    ddp::shm link{pg};
    link.barrier(pg.deadline());
    if (r == 0) {
      std::this_thread::sleep_for(200ms);  // ranks 1 and 2 are asleep in the barrier by now
      link.abort();
    }
    const auto t0 = std::chrono::steady_clock::now();
    link.barrier(pg.deadline());
    (void)t0;
  });
  INFO(ddp_test::summary(outs));
  for (auto& o : outs) {
    CHECK(o.errc == static_cast<int>(ddp::errc::aborted));
    CHECK(o.seconds < 5.0);
  }
  CHECK(outs[1].message.find("aborted by rank 0") != std::string::npos);
}

TEST_CASE("shm across hosts is an unsupported error on every rank") {
  no_leftovers guard;
  auto outs = on_ranks(3, local_group{5s}, [&](int r, ddp::process_group& pg) {
    ddp::shm link{pg, {.host_id = r == 2 ? "node-b" : "node-a"}};
  });
  INFO(ddp_test::summary(outs));
  for (auto& o : outs) {
    CHECK(o.errc == static_cast<int>(ddp::errc::unsupported));
    CHECK(o.message.find("shm needs all its ranks on one host; ranks 0 and 2 are on different hosts") != std::string::npos);
  }
}

#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
TEST_CASE("under an address-space limit the automatic arena says what sized it") {
  no_leftovers guard;
  const int port = free_port();
  auto outs = run_ranks(2, [&](int r) {
    // 2 GiB of address space: the automatic arena takes a quarter, 256 MiB per rank.
    const rlimit lim{std::size_t{2} << 30, std::size_t{2} << 30};
    if (::setrlimit(RLIMIT_AS, &lim) != 0) throw std::runtime_error("setrlimit failed");
    auto pg = ddp::init_process_group(opts(r, 2, port, 10s));
    ddp::shm link{pg};
    void* small = link.allocate(1 << 20);  // what fits still works
    link.deallocate(small, 1 << 20);
    (void)link.allocate(std::size_t{300} << 20);
  });
  INFO(ddp_test::summary(outs));
  for (auto& o : outs) {
    CHECK(o.errc == static_cast<int>(ddp::errc::system));
    CHECK(o.message.find("no room for a block of 300.0 MiB") != std::string::npos);
    CHECK(o.message.find("would outgrow its part of the arena (256.0 MiB, sized by a quarter of the "
                         "address-space limit (RLIMIT_AS, ulimit -v)") != std::string::npos);
    CHECK(o.message.find("outgrow /dev/shm") == std::string::npos);
  }
}
#endif

TEST_CASE("bad options are an invalid_argument error on every rank") {
  no_leftovers guard;
  auto outs = on_ranks(2, local_group{5s}, [&](int r, ddp::process_group& pg) {
    ddp::shm_options o;
    if (r == 1) o.slot_bytes = 100;
    ddp::shm link{pg, o};
  });
  INFO(ddp_test::summary(outs));
  for (auto& o : outs) {
    CHECK(o.errc == static_cast<int>(ddp::errc::invalid_argument));
    CHECK(o.message.find("rank 1: shm_options::slot_bytes must be at least 4096") != std::string::npos);
  }
}

TEST_CASE("8 ranks on 2 cores stay fast: waits block instead of spinning") {
  no_leftovers guard;
  const int n = 8;
  const int port = free_port();
  const auto t0 = std::chrono::steady_clock::now();
  auto outs = run_ranks(n, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, n, port));
    ddp::shm link{pg};
    std::vector<float> small(1024), big(std::size_t{256} << 10);
    link.barrier(pg.deadline());
    const auto s0 = std::chrono::steady_clock::now();
    for (int it = 0; it < 200; ++it) link.allreduce(small.data(), small.size(), dtype::f32, op::sum, pg.deadline(), ddp::shm_algo::tree);
    const auto s1 = std::chrono::steady_clock::now();
    for (int it = 0; it < 50; ++it) link.allreduce(big.data(), big.size(), dtype::f32, op::sum, pg.deadline());
    const auto s2 = std::chrono::steady_clock::now();
    if (r == 0)
      std::printf("8 ranks: 4 KiB tree %.1f us, 1 MiB ring %.1f us per allreduce\n",
                  std::chrono::duration<double, std::micro>(s1 - s0).count() / 200,
                  std::chrono::duration<double, std::micro>(s2 - s1).count() / 50);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(ddp_test::summary(outs));
  CHECK(ddp_test::all_ok(outs));
  CHECK(secs < 20.0);
}

TEST_CASE("default options hold real models: ResNet-50 on 4 ranks, BERT-base on 2 (data_parallel, ring<shm>, shm_allocator)") {
  // Before the arena was sized from /dev/shm, its default 256 MiB gave each rank 64 MiB (4
  // ranks) or 128 MiB (2 ranks): "shm arena exhausted" for ResNet-50's 97.5 MiB of f32
  // gradients and BERT-base's 417.6 MiB.
  no_leftovers guard;
  using dp_type = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::shm>, ddp::shm_allocator>;
  for (const auto& [name, n] : {std::pair<const char*, int>{"resnet50", 4}, {"bert_base", 2}}) {
    const std::string model = name;
    CAPTURE(model);
    const auto numel = model_numels(model);
    const int port = free_port();
    auto outs = run_ranks(n, [&, name = name, n = n](int r) {
      auto pg = ddp::init_process_group(opts(r, n, port, 60s));
      std::vector<std::vector<float>> data(numel.size()), grad(numel.size());
      std::vector<ddp::tensor_view> views;
      for (std::size_t i = 0; i < numel.size(); ++i) {
        data[i].assign(numel[i], static_cast<float>(r * 1000 + static_cast<int>(i)));
        grad[i].resize(numel[i]);
        views.push_back(ddp::tensor_view{data[i].data(), grad[i].data(), numel[i], dtype::f32});
      }
      dp_type dp{pg, views};
      for (std::size_t i = 0; i < numel.size(); ++i)
        require(data[i].front() == static_cast<float>(i) && data[i].back() == static_cast<float>(i),
                std::string(name) + ": parameter " + std::to_string(i) + " is not rank 0's");
      // Step 1 marks gradients in registration order, the reverse of the plan's, so the wrapper
      // re-plans and re-allocates every bucket after it; step 2 runs on the new buckets.
      for (int step = 0; step < 2; ++step) {
        for (std::size_t i = 0; i < numel.size(); ++i)
          std::fill(grad[i].begin(), grad[i].end(), static_cast<float>((r + 1) * (1 + step) + static_cast<int>(i % 8)));
        for (std::size_t k = 0; k < numel.size(); ++k) dp.grad_ready(step == 0 ? k : numel.size() - 1 - k);
        dp.finish();
        // The average over ranks of (r + 1) * (1 + step) + i % 8, exact in f32.
        const float want_base = static_cast<float>(n + 1) / 2.0f * static_cast<float>(1 + step);
        for (std::size_t i = 0; i < numel.size(); ++i) {
          const float want = want_base + static_cast<float>(i % 8);
          for (float g : grad[i])
            if (g != want)
              throw std::runtime_error(std::string(name) + " step " + std::to_string(step) + ": parameter " +
                                       std::to_string(i) + " has " + std::to_string(g) + ", expected " +
                                       std::to_string(want));
        }
      }
    }, 240s);
    expect_ok(outs);
  }
}

// Before, a segment's name was the group id and a channel number: another local user who read
// the id from the store (no secret needed) could create that name first, and the job failed
// with "File exists". Now its random part travels only over the group's connections.
TEST_CASE("shm: the names another user could predict do not stop a job; a name that is taken names its owner") {
  expect_ok(on_ranks(2, opts, [&](int r, ddp::process_group& pg) {
    std::vector<std::string> planted;
    if (r == 0) {
      char idhex[17];
      std::snprintf(idhex, sizeof idhex, "%016llx", static_cast<unsigned long long>(pg.id()));
      for (int k = 0; k < 32; ++k) {
        const std::string name = "/ddp-" + std::string(idhex) + "-" + std::to_string(k);
        const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
        require(fd >= 0, "could not plant " + name);
        ::close(fd);
        planted.push_back(name);
      }
    }
    pg.barrier();
    {
      ddp::shm link{pg};
      std::vector<float> v(1000, static_cast<float>(r + 1));
      link.allreduce(v.data(), v.size(), dtype::f32, op::sum, pg.deadline());
      require(v[0] == 3.0f && v[999] == 3.0f, "sum");
    }
    for (const auto& n : planted) ::shm_unlink(n.c_str());
  }));

  // A name that is taken (here by this user, so that the test needs no second account).
  const std::string name = "/ddp-test-taken-" + std::to_string(::getpid());
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  REQUIRE(fd >= 0);
  ::close(fd);
  ddp::detail::shm_mapping m;
  const std::string why = m.create(name, 1 << 16, 4096);
  ::shm_unlink(name.c_str());
  CHECK(why == "another process holds /dev/shm" + name + " (owner uid " + std::to_string(::geteuid()) +
                   ", this user: a segment left by an earlier run; remove it)");
}
