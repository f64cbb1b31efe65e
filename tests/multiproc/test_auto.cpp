// The default reducer (ddp::auto_reducer) and allocator, the hierarchical reducer, backends by
// name. Hosts are told apart by DDP_HOST_ID here (set in each forked rank), the way containers
// on one machine or a test say which ranks form a host; tests/netns runs real network
// namespaces.
#include <ddp/ddp.hpp>
// Named here: in compiled mode (the auto_compiled suite) the umbrella stops at the default path.
#include <ddp/memory/shm_allocator.hpp>
#include <ddp/reducer/hierarchical.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/transport/tcp.hpp>

#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness.hpp"
#include "hosts.hpp"

using namespace std::chrono_literals;
using ddp_test::free_port;
using ddp_test::on_host;
using ddp_test::require;
using ddp_test::run_ranks;
using ddp_test::expect_ok;
using ddp_test::local_group;
using ddp_test::on_hosts;
using ddp_test::on_ranks;
using ddp::dtype;
using ddp::op;

namespace {

constexpr ddp_test::local_group opts{20s};

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

struct one_param {
  std::vector<float> w, g;
  explicit one_param(std::size_t n) : w(n, 0.0f), g(n, 0.0f) {}
  std::vector<ddp::tensor_view> views() { return {ddp::make_tensor_view(std::span{w}, std::span{g}, "w")}; }
};

}  // namespace

TEST_CASE("auto: one rank needs no communication") {
  expect_ok(on_ranks(1, opts, [&](ddp::process_group& pg) {
    ddp::auto_reducer red{pg};
    require(starts_with(red.describe(), "none: 1 rank"), red.describe());
    std::vector<float> v{1.5f, -2.0f};
    red.allreduce(std::span<float>{v}, op::avg);
    require(v[0] == 1.5f && v[1] == -2.0f, "one rank's average is its own data");
    one_param p(8);
    std::fill(p.g.begin(), p.g.end(), 3.0f);
    ddp::data_parallel dp{pg, p.views()};
    dp.grad_ready(0);
    dp.finish();
    require(p.g[7] == 3.0f, "the wrapper on one rank leaves the gradient");
  }));
}

TEST_CASE("auto: ranks on one host get shared memory, with the buckets in the segment") {
  expect_ok(on_ranks(3, opts, [&](int r, ddp::process_group& pg) {
    one_param p(1000);
    std::fill(p.g.begin(), p.g.end(), static_cast<float>(r + 1));
    ddp::data_parallel dp{pg, p.views()};
    auto& red = dp.get_reducer();
    require(red.chosen() == ddp::backend::shm, "chose " + red.describe());
    require(starts_with(red.describe(), "shm: 1 host, 3 ranks"), red.describe());
    require(red.segment() != nullptr, "no segment");
    require(dp.get_allocator().location() == ddp::memory_kind::shared, "buckets are not in the segment");
    dp.grad_ready(0);
    dp.finish();
    for (float x : p.g) require(x == 2.0f, "average of 1, 2, 3 is 2; got " + std::to_string(x));
  }));
}

TEST_CASE("auto: ranks on several hosts get the hierarchical reducer, with the same bits everywhere") {
  expect_ok(on_ranks(4, on_hosts("aabb", opts), [&](int r, ddp::process_group& pg) {
    ddp::auto_reducer red{pg};
    require(red.chosen() == ddp::backend::hierarchical, "chose " + red.describe());
    require(starts_with(red.describe(), "hierarchical: 2 hosts x 2 ranks") &&
                red.describe().find("ranks 0, 2") != std::string::npos,
            red.describe());
    // sum, avg, max over f32; avg over f16 whose sum would overflow; integer avg truncates.
    std::vector<float> v(100003);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i % 7) * (r + 1)) * 0.1f;
    auto s = v;
    red.allreduce(std::span<float>{s}, op::sum);
    for (std::size_t i = 0; i < v.size(); i += 997) {
      const float want = static_cast<float>(i % 7) * 0.1f * 10.0f;
      require(std::fabs(s[i] - want) <= 1e-4f * (1 + want), "sum at " + std::to_string(i));
    }
    auto a = v;
    red.allreduce(std::span<float>{a}, op::avg);
    require(std::fabs(a[6] - 0.6f * 2.5f) < 1e-5f, "avg " + std::to_string(a[6]));
    auto m = v;
    red.allreduce(std::span<float>{m}, op::max);
    require(m[6] == v[6] / static_cast<float>(r + 1) * 4.0f || std::fabs(m[6] - 2.4f) < 1e-6f, "max");
    std::vector<ddp::half> h(64, ddp::half(60000.0f));
    red.allreduce(std::span<ddp::half>{h}, op::avg);
    require(static_cast<float>(h[0]) == 60000.0f, "f16 avg of 60000 is " + std::to_string(static_cast<float>(h[0])));
    std::vector<std::int32_t> iv(5, r);  // (0 + 1 + 2 + 3) / 4 = 1 (truncated 1.5)
    red.allreduce(std::span<std::int32_t>{iv}, op::avg);
    require(iv[4] == 1, "integer avg " + std::to_string(iv[4]));
    // broadcast from a non-leader of the second host
    std::vector<double> b(70000, r == 3 ? 42.5 : -1.0);
    red.broadcast(std::span<double>{b}, 3);
    require(b[0] == 42.5 && b[69999] == 42.5, "broadcast from rank 3");
    red.barrier();
    // Every rank's result carries the same bits.
    std::string mine(reinterpret_cast<const char*>(a.data()), a.size() * sizeof(float));
    const auto all = pg.all_gather(mine);
    for (const auto& x : all) require(x == mine, "ranks differ in the bits of the average");
  }));
}

TEST_CASE("hierarchical: hosts of different sizes still average over every rank") {
  expect_ok(on_ranks(3, on_hosts("aab", opts), [&](int r, ddp::process_group& pg) {
    ddp::hierarchical red{pg};
    require(red.topology().describe() == "2 hosts (2 + 1 ranks)", red.topology().describe());
    require(red.leader() == (r == 0 || r == 2), "leaders are the hosts' lowest ranks");
    std::vector<float> v(1000, static_cast<float>(3 * r));  // 0, 3, 6: the mean is 3
    red.allreduce(std::span<float>{v}, op::avg);
    for (float x : v) require(std::fabs(x - 3.0f) < 1e-6f, "mean over 3 ranks is 3; got " + std::to_string(x));
    std::vector<std::int64_t> iv(3, 10 * r + 1);  // 1, 11, 21: mean 11
    red.allreduce(std::span<std::int64_t>{iv}, op::avg);
    require(iv[0] == 11, "integer mean " + std::to_string(iv[0]));
    // The wrapper over it, buckets in each host's segment.
    one_param p(5000);
    std::fill(p.g.begin(), p.g.end(), static_cast<float>(r));
    ddp::basic_data_parallel<ddp::size_planner, ddp::hierarchical, ddp::shm_allocator> dp{pg, p.views()};
    dp.grad_ready(0);
    dp.finish();
    for (float x : p.g) require(std::fabs(x - 1.0f) < 1e-6f, "wrapper mean of 0, 1, 2");
  }));
}

TEST_CASE("hierarchical on one host is the shared-memory reducer, integer averages included") {
  expect_ok(on_ranks(3, local_group{20s, ddp::backend::hierarchical}, [&](int r, ddp::process_group& pg) {
    ddp::auto_reducer red{pg};
    require(red.chosen() == ddp::backend::hierarchical, red.describe());
    std::vector<std::int32_t> iv(7, 3 * r);  // 0, 3, 6: the mean is 3
    red.allreduce(std::span<std::int32_t>{iv}, op::avg);
    require(iv[6] == 3, "integer mean on one host " + std::to_string(iv[6]));
    std::vector<float> v(9, static_cast<float>(r));
    red.allreduce(std::span<float>{v}, op::prod);
    require(v[0] == 0.0f, "product");
  }));
}

TEST_CASE("auto: one rank per host is a ring over tcp") {
  expect_ok(on_ranks(3, on_hosts("abc", opts), [&](ddp::process_group& pg) {
    ddp::auto_reducer red{pg};
    require(red.chosen() == ddp::backend::tcp, red.describe());
    require(starts_with(red.describe(), "tcp: 3 hosts x 1 rank"), red.describe());
    require(red.segment() == nullptr, "no segment for tcp");
    std::vector<float> v(10, 1.0f);
    red.allreduce(std::span<float>{v}, op::sum);
    require(v[9] == 3.0f, "sum");
  }));
}

TEST_CASE("backend by name: DDP_BACKEND, init_options::backend, and errors") {
  auto env = [](const char* b) {
    return ddp::init_options::from_env([b](const char* n) -> const char* {
      return std::strcmp(n, "DDP_BACKEND") == 0 ? b : nullptr;
    });
  };
  CHECK(env("tcp").backend == ddp::backend::tcp);
  CHECK(env("shm").backend == ddp::backend::shm);
  CHECK(env("auto").backend == ddp::backend::automatic);
  CHECK(env("hierarchical").backend == ddp::backend::hierarchical);
  CHECK(env("nccl").backend == ddp::backend::nccl);
  CHECK(ddp::init_options{}.backend == ddp::backend::automatic);
  try {
    (void)env("gloo");
    FAIL("DDP_BACKEND=gloo was accepted");
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::invalid_argument);
    CHECK(std::string(e.what()).find("DDP_BACKEND='gloo' names no backend: use auto, shm, tcp") != std::string::npos);
  }

  expect_ok(on_ranks(2, local_group{20s, ddp::backend::tcp}, [&](ddp::process_group& pg) {
    ddp::auto_reducer red{pg};
    require(red.chosen() == ddp::backend::tcp && red.requested() == ddp::backend::tcp, red.describe());
    require(red.describe().find("(asked for by name)") != std::string::npos, red.describe());
    std::vector<float> v(4, 1.0f);
    red.allreduce(std::span<float>{v}, op::sum);
    require(v[0] == 2.0f, "sum");
  }));
}

TEST_CASE("backend by name: ranks that ask for different backends all fail naming both") {
  const int port = free_port();
  auto outs = run_ranks(2, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, 2, port, 20s, r == 0 ? ddp::backend::tcp : ddp::backend::shm));
    ddp::auto_reducer red{pg};
  });
  INFO(ddp_test::summary(outs));
  for (const auto& o : outs) {
    CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
    CHECK(o.message.find("backend mismatch") != std::string::npos);
    CHECK(o.message.find("'tcp'") != std::string::npos);
    CHECK(o.message.find("'shm'") != std::string::npos);
  }
}

#if !defined(DDP_WITH_MPI) && !defined(DDP_WITH_NCCL)
TEST_CASE("backend by name: a backend not compiled in is an error naming what it needs") {
  const int port = free_port();
  auto outs = run_ranks(2, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, 2, port, 20s, r == 0 ? ddp::backend::mpi : ddp::backend::mpi));
    ddp::auto_reducer red{pg};
  });
  INFO(ddp_test::summary(outs));
  for (const auto& o : outs) {
    CHECK(o.errc == static_cast<int>(ddp::errc::unsupported));
    CHECK(o.message.find("backend 'mpi' is not compiled in") != std::string::npos);
    CHECK(o.message.find("DDP_WITH_MPI") != std::string::npos);
    CHECK(o.message.find("<ddp/reducer/mpi.hpp>") != std::string::npos);
  }
  outs = on_ranks(2, on_hosts("ab", opts), [&](ddp::process_group& pg) {
    ddp::hierarchical h{pg, ddp::hierarchical_options{.between = ddp::backend::mpi}};
  });
  INFO(ddp_test::summary(outs));
  for (const auto& o : outs) {
    CHECK(o.errc == static_cast<int>(ddp::errc::unsupported));
    CHECK(o.message.find("MPI between the leaders is not compiled in") != std::string::npos);
  }
  outs = on_ranks(2, local_group{20s, ddp::backend::nccl}, [&](ddp::process_group& pg) {
    ddp::data_parallel dp{pg, std::vector<ddp::tensor_view>{}};
  });
  INFO(ddp_test::summary(outs));
  for (const auto& o : outs) {
    CHECK(o.errc == static_cast<int>(ddp::errc::unsupported));
    CHECK(o.message.find("backend 'nccl' is not compiled in") != std::string::npos);
    CHECK(o.message.find("<ddp/reducer/nccl.hpp>") != std::string::npos);
  }
}
#endif

TEST_CASE("hierarchical: a rank killed mid-step is named by every survivor, within timeout + 2 s") {
  for (int victim : {3, 2}) {  // a host's second rank, then a host's leader
    CAPTURE(victim);
    const int port = free_port();
    const auto timeout = 4s;
    auto outs = run_ranks(
        4,
        [&](int r) {
          on_host("aabb", r);
          auto pg = ddp::init_process_group(opts(r, 4, port, timeout));
          ddp::auto_reducer red{pg};
          std::vector<float> v(1 << 16, 1.0f);
          for (int step = 0;; ++step) {
            if (step == 20 && r == victim) ::raise(SIGKILL);
            red.allreduce(std::span<float>{v}, op::avg);
          }
        },
        30s);
    MESSAGE(ddp_test::summary(outs));
    for (const auto& o : outs) {
      if (o.rank == victim) continue;
      CAPTURE(o.rank);
      CHECK(o.exit_code == 1);
      CHECK(o.seconds < 2.0 + std::chrono::duration<double>(timeout).count() + 1.5);  // + setup
      CHECK(o.message.find("rank " + std::to_string(victim)) != std::string::npos);
    }
  }
}
