// A /dev/shm that is too small or fills up: every case is a clear errc::system, never SIGBUS.
//
// Each case runs its ranks in a private mount namespace with a small tmpfs of its own on
// /dev/shm, so filling it cannot disturb anything else running on the machine (tests run in
// parallel with this one). That needs root
// (CAP_SYS_ADMIN) or, for other users, unprivileged user namespaces; where the environment
// refuses both the suite exits 77 (SKIP) and says why.
#include <ddp/reducer/shm.hpp>
#include <ddp/data_parallel.hpp>
#include <ddp/memory/shm_allocator.hpp>
#include <ddp/planner/size_planner.hpp>
#include <ddp/reducer/ring.hpp>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness.hpp"
#include "private_dev_shm.hpp"

using namespace std::chrono_literals;
using ddp::dtype;
using ddp::op;
using ddp_test::free_port;
using ddp_test::run_ranks;
using ddp_test::run_ranks_with_dev_shm;

namespace {

constexpr int sigbus_exit = 128 + SIGBUS;

constexpr ddp_test::local_group opts{20s};

using ddp_test::require;


std::size_t shm_free() {
  struct statvfs v{};
  require(::statvfs("/dev/shm", &v) == 0, "statvfs(/dev/shm)");
  return static_cast<std::size_t>(v.f_bavail) * v.f_frsize;
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("a /dev/shm too small for the staging slots: errc::system at construction on every rank, no SIGBUS") {
  const std::size_t dev_shm = std::size_t{2} << 20;
  using dp_type = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::shm>, ddp::shm_allocator>;
  const int n = 3;
  const int port = free_port();
  auto outs = run_ranks_with_dev_shm(dev_shm, n, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, n, port));
    std::vector<float> data(1000, 1.0f), grad(1000, 1.0f);
    std::vector<ddp::tensor_view> views{ddp::tensor_view{data.data(), grad.data(), data.size(), dtype::f32}};
    dp_type dp{pg, views};  // default options: 3 ranks x 2 slots x 1 MiB do not fit in 2 MiB
  });
  INFO(ddp_test::summary(outs));
  for (auto& o : outs) {
    CHECK(o.exit_code == 1);
    CHECK(o.errc == static_cast<int>(ddp::errc::system));
    // Every rank names the segment, its size and what /dev/shm holds: rank 0's reason.
    CHECK(has(o.message, "shared-memory segment /ddp-"));
    CHECK(has(o.message, "could not be set up on rank 0: header and staging slots (6.0 MiB): cannot reserve 6.0 MiB"));
    CHECK(has(o.message, "/dev/shm is full"));
    CHECK(has(o.message, "free of 2.0 MiB"));
  }
}

TEST_CASE("a model larger than /dev/shm: errc::system at data_parallel construction on every rank, no SIGBUS") {
  const std::size_t dev_shm = std::size_t{48} << 20;
  using dp_type = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::shm>, ddp::shm_allocator>;
  const int n = 2;
  const int port = free_port();
  auto outs = run_ranks_with_dev_shm(dev_shm, n, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, n, port));
    // 50 MiB of gradients per rank: more than the whole /dev/shm, so each rank's buckets fail
    // whatever the other rank holds.
    const std::size_t count = std::size_t{50} << 18;
    std::vector<float> data(count, 1.0f), grad(count, 1.0f);
    std::vector<ddp::tensor_view> views;
    for (std::size_t k = 0; k < 5; ++k)
      views.push_back(ddp::tensor_view{data.data() + k * count / 5, grad.data() + k * count / 5, count / 5, dtype::f32});
    dp_type dp{pg, views};
  });
  INFO(ddp_test::summary(outs));
  for (auto& o : outs) {
    CHECK(o.exit_code == 1);
    CHECK(o.errc == static_cast<int>(ddp::errc::system));
    CHECK(has(o.message, "shared-memory segment /ddp-"));
    CHECK(has(o.message, "in this rank's part of the arena"));
    CHECK((has(o.message, "/dev/shm is full") || has(o.message, "would outgrow its part of the arena")));
    CHECK(has(o.message, "free of 48.0 MiB"));
  }
}

TEST_CASE("/dev/shm filled by someone else after construction: the allocation fails clearly, no SIGBUS later") {
  // Before pages were reserved, both ranks passed construction (the segment fitted), the filler
  // took the rest, and the first write into an arena block killed each rank with SIGBUS.
  const std::size_t dev_shm = std::size_t{300} << 20;
  const int n = 2;
  const int port = free_port();
  auto outs = run_ranks_with_dev_shm(dev_shm, n, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, n, port));
    ddp::shm link{pg};
    ddp::shm_allocator alloc{link};
    link.barrier(pg.deadline());
    if (r == 0) {
      // Another user of /dev/shm takes all but 8 MiB of it.
      const int fd = ::shm_open("/filler", O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
      require(fd >= 0, "shm_open(/filler)");
      const int e = ::posix_fallocate(fd, 0, static_cast<off_t>(shm_free() - (std::size_t{8} << 20)));
      ::close(fd);  // the file keeps its pages; the tmpfs goes with the namespace
      require(e == 0, std::string("posix_fallocate(filler): ") + std::strerror(e));
    }
    link.barrier(pg.deadline());
    const std::size_t big = std::size_t{32} << 20;
    try {
      auto* p = static_cast<float*>(alloc.allocate(big));
      std::fill(p, p + big / sizeof(float), 1.0f);
      throw std::runtime_error("allocated 32 MiB from a /dev/shm with 8 MiB free");
    } catch (const ddp::error& e) {
      require(e.condition() == ddp::errc::system, std::string("wrong errc: ") + e.what());
      const std::string m = e.what();
      require(has(m, "no room for a block of 32.0 MiB") && has(m, "/dev/shm is full") && has(m, "free of 300.0 MiB"),
              "unclear message: " + m);
    }
    // The transport is still whole: a block that fits works.
    const std::size_t count = 1000;
    auto* q = static_cast<float*>(alloc.allocate(count * sizeof(float)));
    for (std::size_t i = 0; i < count; ++i) q[i] = static_cast<float>(r + 1) * static_cast<float>(i);
    link.allreduce(q, count, dtype::f32, op::sum, pg.deadline());
    for (std::size_t i = 0; i < count; ++i)
      require(q[i] == 3.0f * static_cast<float>(i), "allreduce after the failed allocation: element " + std::to_string(i));
    alloc.deallocate(q, count * sizeof(float));
  });
  INFO(ddp_test::summary(outs));
  for (auto& o : outs) {
    CHECK(o.exit_code != sigbus_exit);
    CHECK(o.ok());
  }
}

TEST_CASE("buckets that fit one rank but not all: a clear error at construction on every rank, naming the one left without room") {
  const std::size_t dev_shm = std::size_t{48} << 20;
  using dp_type = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::shm>, ddp::shm_allocator>;
  const int n = 2;
  const int port = free_port();
  auto outs = run_ranks_with_dev_shm(dev_shm, n, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, n, port));
    // 30 MiB per rank: either rank alone fits in 48 MiB, both do not.
    const std::size_t count = std::size_t{30} << 18;
    std::vector<float> data(count, 1.0f), grad(count, 1.0f);
    std::vector<ddp::tensor_view> views;
    for (std::size_t k = 0; k < 3; ++k)
      views.push_back(ddp::tensor_view{data.data() + k * count / 3, grad.data() + k * count / 3, count / 3, dtype::f32});
    dp_type dp{pg, views};
    for (std::size_t i = views.size(); i-- > 0;) dp.grad_ready(i);
    dp.finish();
    throw std::runtime_error("a step completed on a /dev/shm too small for both ranks");
  });
  INFO(ddp_test::summary(outs));
  int no_room = 0;
  for (auto& o : outs) {
    CHECK(o.exit_code == 1);
    CHECK(o.seconds < 20.0 + 2.0);
    // Every rank fails at construction with the cause; the ranks whose buckets fitted name the
    // rank that had no room.
    CHECK(o.errc == static_cast<int>(ddp::errc::system));
    CHECK(has(o.message, "no room for a block of"));
    CHECK(has(o.message, "free of 48.0 MiB"));
    CHECK(!has(o.message, "a step completed"));
    if (!has(o.message, "could not set up its gradient buckets")) ++no_room;
  }
  CHECK(no_room >= 1);
}
