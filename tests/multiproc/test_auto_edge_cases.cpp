// Edge cases of the topology-aware default (ddp::auto_reducer, ddp::hierarchical,
// ddp::auto_allocator): the inputs, timings and call orders that its promises must survive.
// Hosts are faked with DDP_HOST_ID (set in each forked rank), as in test_auto.cpp.
#include <ddp/ddp.hpp>

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <dirent.h>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"
#include "hosts.hpp"
#include "private_dev_shm.hpp"

using namespace std::chrono_literals;
using ddp_test::free_port;
using ddp_test::on_host;
using ddp_test::require;
using ddp_test::run_ranks;
using ddp_test::expect_ok;
using ddp_test::local_group;
using ddp_test::on_hosts;
using ddp_test::on_ranks;
using ddp_test::run_ranks_with_dev_shm;
using ddp::dtype;
using ddp::op;

namespace {

constexpr ddp_test::local_group opts{20s};

/// Segments of the group in /dev/shm (their names start with /ddp-).
int shm_segments() {
  int n = 0;
  if (DIR* d = ::opendir("/dev/shm")) {
    while (auto* e = ::readdir(d)) n += std::strncmp(e->d_name, "ddp-", 4) == 0;
    ::closedir(d);
  }
  return n;
}

// A private /dev/shm of a given size for the ranks (as test_shm_full.cpp makes it).

std::string bits(const void* p, std::size_t n) { return std::string(static_cast<const char*>(p), n); }

/// Every collective of `red` from every root, with values that tell ranks apart; every rank
/// must end with the same bits.
template <class R>
void every_collective(R& red, ddp::process_group& pg) {
  const int r = pg.rank(), n = pg.size();
  // sum and avg over f32
  std::vector<float> v(30011);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i % 5) + 1) * static_cast<float>(r + 1);
  auto s = v;
  red.allreduce(std::span<float>{s}, op::sum);
  const float tri = static_cast<float>(n * (n + 1) / 2);
  for (std::size_t i = 0; i < s.size(); i += 101)
    require(s[i] == static_cast<float>((i % 5) + 1) * tri, "sum at " + std::to_string(i) + ": " + std::to_string(s[i]));
  auto a = v;
  red.allreduce(std::span<float>{a}, op::avg);
  for (std::size_t i = 0; i < a.size(); i += 101) {
    const float want = static_cast<float>((i % 5) + 1) * tri / static_cast<float>(n);
    require(std::fabs(a[i] - want) <= 1e-5f * want, "avg at " + std::to_string(i) + ": " + std::to_string(a[i]) +
                                                       " want " + std::to_string(want));
  }
  for (const auto& x : pg.all_gather(bits(a.data(), a.size() * 4))) require(x == bits(a.data(), a.size() * 4), "avg bits differ");
  // f16 avg whose sum would overflow
  std::vector<ddp::half> h(100, ddp::half(60000.0f));
  red.allreduce(std::span<ddp::half>{h}, op::avg);
  require(static_cast<float>(h[0]) == 60000.0f, "f16 avg of 60000 is " + std::to_string(static_cast<float>(h[0])));
  // integer avg: (0 + 10 + ... ) / n, truncated once
  std::vector<std::int64_t> iv(7, 10 * r + 1);
  red.allreduce(std::span<std::int64_t>{iv}, op::avg);
  std::int64_t isum = 0;
  for (int q = 0; q < n; ++q) isum += 10 * q + 1;
  require(iv[6] == isum / n, "integer avg " + std::to_string(iv[6]) + " want " + std::to_string(isum / n));
  // min / max
  std::vector<std::int32_t> mx(3, r == n - 1 ? 1000 : r);
  red.allreduce(std::span<std::int32_t>{mx}, op::max);
  require(mx[0] == 1000, "max");
  // broadcast from every root
  for (int root = 0; root < n; ++root) {
    std::vector<double> b(20011, r == root ? 7.0 + root : -1.0);
    red.broadcast(std::span<double>{b}, root);
    require(b[0] == 7.0 + root && b[20010] == 7.0 + root, "broadcast from rank " + std::to_string(root));
  }
  // allgather and reduce_scatter
  const std::size_t per = 1001;
  std::vector<float> mine(per, static_cast<float>(r + 1)), all(per * static_cast<std::size_t>(n), -1.0f);
  red.allgather(std::span<const float>{mine}, std::span<float>{all});
  for (int q = 0; q < n; ++q)
    require(all[static_cast<std::size_t>(q) * per + per - 1] == static_cast<float>(q + 1), "allgather slot " + std::to_string(q));
  std::vector<float> in(per * static_cast<std::size_t>(n)), out(per, -1.0f);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i / per + 1);  // slice q holds q + 1
  red.reduce_scatter(std::span<const float>{in}, std::span<float>{out}, op::sum);
  require(out[0] == static_cast<float>((r + 1) * n), "reduce_scatter " + std::to_string(out[0]));
  // zero-length collectives
  red.allreduce(std::span<float>{}, op::sum);
  red.broadcast(std::span<float>{}, n - 1);
  red.allgather(std::span<const float>{}, std::span<float>{});
  red.reduce_scatter(std::span<const float>{}, std::span<float>{}, op::sum);
  red.barrier();
  // a root that is no rank
  try {
    std::vector<float> b(4);
    red.broadcast(std::span<float>{b}, n);
    require(false, "broadcast from rank n was accepted");
  } catch (const ddp::error& e) {
    require(e.condition() == ddp::errc::invalid_argument, std::string("root n: ") + e.what());
  }
  red.barrier();
}

}  // namespace

TEST_CASE("auto: hosts of 2, 1, 1 ranks and interleaved hosts: every collective from every root") {
  for (const std::string hosts : {"aabc", "aba", "abab", "abca"}) {
    CAPTURE(hosts);
    const int n = static_cast<int>(hosts.size());
    expect_ok(on_ranks(n, on_hosts(hosts, opts), [&](ddp::process_group& pg) {
      ddp::auto_reducer red{pg};
      require(red.chosen() == ddp::backend::hierarchical, red.describe());
      every_collective(red, pg);
    }, 60s));
  }
}

TEST_CASE("auto: hierarchical by name with one rank per host, and on one host") {
  for (const std::string hosts : {"abc", "aaa"}) {
    CAPTURE(hosts);
    const int n = static_cast<int>(hosts.size());
    expect_ok(on_ranks(n, on_hosts(hosts, local_group{20s, ddp::backend::hierarchical}), [&](ddp::process_group& pg) {
      ddp::auto_reducer red{pg};
      every_collective(red, pg);
    }, 60s));
  }
}

TEST_CASE("auto: two auto_reducers in a row, then a ring over tcp, on the same group") {
  expect_ok(on_ranks(4, on_hosts("aabb", opts), [&](int r, ddp::process_group& pg) {
    ddp::auto_reducer a{pg};
    ddp::auto_reducer b{pg};
    ddp::ring<ddp::tcp> c{pg};
    ddp::shm s{pg, ddp::shm_options{.members = r < 2 ? std::vector<int>{0, 1} : std::vector<int>{2, 3}}};
    for (int i = 0; i < 2; ++i) {
      std::vector<float> v(5000, 1.0f);
      a.allreduce(std::span<float>{v}, op::sum);
      b.allreduce(std::span<float>{v}, op::sum);
      c.allreduce(std::span<float>{v}, op::sum);
      require(v[4999] == 64.0f, "4 * 4 * 4 = " + std::to_string(v[4999]));
      s.allreduce(v.data(), v.size(), dtype::f32, op::sum, pg.deadline());
      require(v[0] == 128.0f, "then 2 per host");
    }
  }, 60s));
}

TEST_CASE("auto: DDP_HOST_ID set on only some ranks") {
  const int port = free_port();
  auto outs = run_ranks(4, [&](int r) {
    on_host("a a ", r);  // ranks 0, 2 say "a"; ranks 1, 3 keep the machine's identity
    auto pg = ddp::init_process_group(opts(r, 4, port));
    ddp::auto_reducer red{pg};
    require(red.topology().hosts() == 2 && red.topology().ranks_on(1) == std::vector<int>{1, 3}, red.describe());
    every_collective(red, pg);
  }, 60s);
  expect_ok(outs);
}

TEST_CASE("auto: DDP_HOST_ID joins ranks whose own identities differ (containers that share memory)") {
  // Rank 1 gets a host name of its own (a UTS namespace: what a container has), with the same
  // /dev/shm and network. DDP_HOST_ID says both are one host: the documented override.
  for (auto b : {ddp::backend::automatic, ddp::backend::hierarchical}) {
    CAPTURE(static_cast<int>(b));
    const int port = free_port();
    auto outs = run_ranks(3, [&](int r) {
      if (r == 1) {
        require(::unshare(CLONE_NEWUTS) == 0 && ::sethostname("other-host", 10) == 0, "cannot unshare UTS (needs root)");
      }
      on_host("aab", r);
      auto pg = ddp::init_process_group(opts(r, 3, port, 20s, b));
      ddp::auto_reducer red{pg};
      require(red.topology().hosts() == 2, red.describe());
      std::vector<float> v(100, static_cast<float>(r));
      red.allreduce(std::span<float>{v}, op::sum);
      require(v[99] == 3.0f, "sum");
    }, 30s);
    expect_ok(outs);
  }
}

TEST_CASE("auto: the default wrapper over hosts of different sizes, view and copy mode, rebuild in the segment") {
  for (bool view : {false, true}) {
    CAPTURE(view);
    expect_ok(on_ranks(3, on_hosts("aba", opts), [&](int r, ddp::process_group& pg) {
      const std::size_t sizes[] = {3000, 17, 40000, 5};
      std::vector<std::vector<float>> w, g;
      std::vector<ddp::tensor_view> views;
      for (std::size_t i = 0; i < 4; ++i) {
        w.emplace_back(sizes[i], 0.0f);
        g.emplace_back(sizes[i], 0.0f);
        views.push_back(ddp::make_tensor_view(std::span{w[i]}, std::span{g[i]}, "p"));
      }
      ddp::data_parallel dp{pg, views, {.cap_bytes = 16 * 1024, .first_cap_bytes = 4096},
                            {.gradient_as_bucket_view = view}};
      require(dp.get_reducer().chosen() == ddp::backend::hierarchical, dp.get_reducer().describe());
      require(dp.get_allocator().location() == ddp::memory_kind::shared, "buckets in the segment");
      for (int step = 0; step < 4; ++step) {
        auto vs = dp.views();
        // ranks finish their parameters in different orders: the rebuild follows rank 0's
        for (std::size_t k = 0; k < 4; ++k) {
          const std::size_t i = r == 0 ? 3 - k : (k + static_cast<std::size_t>(r)) % 4;
          auto* gp = static_cast<float*>(vs[i].grad);
          for (std::size_t j = 0; j < sizes[i]; ++j) gp[j] = static_cast<float>(3 * r + step + static_cast<int>(i));
          dp.grad_ready(i);
        }
        dp.finish();
        vs = dp.views();
        for (std::size_t i = 0; i < 4; ++i) {
          const auto* gp = static_cast<const float*>(vs[i].grad);
          const float want = static_cast<float>(3 + step + static_cast<int>(i));  // mean of 0, 3, 6 is 3
          for (std::size_t j = 0; j < sizes[i]; j += 7)
            require(gp[j] == want, "step " + std::to_string(step) + " param " + std::to_string(i) + " got " +
                                       std::to_string(gp[j]) + " want " + std::to_string(want));
        }
      }
    }, 60s));
  }
}

TEST_CASE("auto: buffers in the segment on some ranks and in host memory on others") {
  expect_ok(on_ranks(4, on_hosts("aabb", opts), [&](int r, ddp::process_group& pg) {
    ddp::hierarchical red{pg};
    const std::size_t n = 300007;
    std::vector<float> host(n);
    float* p = host.data();
    void* blk = nullptr;
    if (r == 0 || r == 3) p = static_cast<float*>(blk = red.transport().allocate(n * sizeof(float)));
    for (int step = 0; step < 3; ++step) {
      for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<float>(r + 1 + step) + static_cast<float>(i % 3);
      red.allreduce(std::span<float>{p, n}, op::sum);
      for (std::size_t i = 0; i < n; i += 89)
        require(p[i] == static_cast<float>(10 + 4 * step + 4 * static_cast<int>(i % 3)), "sum at " + std::to_string(i) +
                                                                                         ": " + std::to_string(p[i]));
    }
    if (blk) red.transport().deallocate(blk, n * sizeof(float));
  }, 60s));
}

TEST_CASE("auto: abort() from another thread on a non-leader ends every rank, bounded") {
  const auto timeout = 4s;
  for (int who : {3, 2}) {
    CAPTURE(who);
    auto outs = on_ranks(4, on_hosts("aabb", local_group{timeout}), [&](int r, ddp::process_group& pg) {
      ddp::auto_reducer red{pg};
      std::thread t;
      if (r == who) t = std::thread([&] { std::this_thread::sleep_for(300ms); red.abort(); });
      struct joiner { std::thread& t; ~joiner() { if (t.joinable()) t.join(); } } j{t};
      std::vector<float> v(1 << 18, 1.0f);
      for (;;) red.allreduce(std::span<float>{v}, op::avg);
    }, 30s);
    MESSAGE(ddp_test::summary(outs));
    for (const auto& o : outs) {
      CAPTURE(o.rank);
      CHECK(o.exit_code == 1);
      CHECK(o.seconds < std::chrono::duration<double>(timeout).count() + 2.0 + 1.5);
      CHECK((o.errc == static_cast<int>(ddp::errc::aborted) || o.errc == static_cast<int>(ddp::errc::peer_lost)));
      CHECK(o.message.find("rank " + std::to_string(who)) != std::string::npos);
      // The rank that called abort() learned it from no one.
      if (o.rank == who) CHECK(o.message.find("reported to this rank by its host's leader") == std::string::npos);
    }
  }
}

// Rank 0, host a's leader and the store's host, times out on rank 1 at about the moment the
// other hosts' leaders time out on rank 0: they follow the "waits for" records (rank 0's shared
// memory wait recorded its own ahead of the deadline) or adopt rank 0's verdict, read before
// rank 0 exits and takes the store with it, never "rank 0 stopped answering".
TEST_CASE("auto: a late non-leader is named by every rank within timeout + 2 s") {
  const auto timeout = 3s;
  for (const std::string hosts : {"aabb", "aabc"}) {
    CAPTURE(hosts);
    auto outs = on_ranks(4, on_hosts(hosts, local_group{timeout}), [&](int r, ddp::process_group& pg) {
      ddp::auto_reducer red{pg};
      std::vector<float> v(1 << 14, 1.0f);
      red.allreduce(std::span<float>{v}, op::sum);
      if (r == 1) std::this_thread::sleep_for(timeout + 4s);
      red.allreduce(std::span<float>{v}, op::sum);
      red.allreduce(std::span<float>{v}, op::sum);
    }, 30s);
    MESSAGE(ddp_test::summary(outs));
    for (const auto& o : outs) {
      if (o.rank == 1) continue;
      CAPTURE(o.rank);
      CHECK(o.exit_code == 1);
      CHECK(o.seconds < std::chrono::duration<double>(timeout).count() + 2.0 + 1.5);
      CHECK(o.message.find("rank 1") != std::string::npos);
    }
  }
}

TEST_CASE("auto: a killed rank on hosts of 2, 1, 1 is named by every survivor; no segment stays in /dev/shm") {
  for (int victim : {1, 2, 0}) {
    CAPTURE(victim);
    const int before = shm_segments();
    const int port = free_port();
    const auto timeout = 4s;
    auto outs = run_ranks(4, [&](int r) {
      on_host("aabc", r);
      auto pg = ddp::init_process_group(opts(r, 4, port, timeout));
      ddp::auto_reducer red{pg};
      std::vector<float> v(1 << 16, 1.0f);
      for (int step = 0;; ++step) {
        if (step == 10 && r == victim) ::raise(SIGKILL);
        red.allreduce(std::span<float>{v}, op::avg);
      }
    }, 30s);
    MESSAGE(ddp_test::summary(outs));
    for (const auto& o : outs) {
      if (o.rank == victim) continue;
      CAPTURE(o.rank);
      CHECK(o.exit_code == 1);
      CHECK(o.seconds < std::chrono::duration<double>(timeout).count() + 2.0 + 1.5);
      if (victim != 0) CHECK(o.message.find("rank " + std::to_string(victim)) != std::string::npos);
    }
    CHECK(shm_segments() <= before);
  }
}

TEST_CASE("auto: a rank killed while the reducer is being built leaves no segment in /dev/shm") {
  for (int victim : {1, 3}) {
    CAPTURE(victim);
    const int before = shm_segments();
    auto outs = on_ranks(4, on_hosts("aabb", local_group{3s}), [&](int r, ddp::process_group& pg) {
      ddp::auto_reducer first{pg};  // so that the next one's segments are not the first
      if (r == victim) { std::this_thread::sleep_for(200ms); ::raise(SIGKILL); }
      ddp::auto_reducer red{pg};
    }, 30s);
    MESSAGE(ddp_test::summary(outs));
    for (const auto& o : outs) {
      if (o.rank == victim) continue;
      CAPTURE(o.rank);
      CHECK(o.exit_code == 1);
    }
    CHECK(shm_segments() <= before);
  }
}

TEST_CASE("auto: a count that differs between hosts, or within one, is errc::mismatch on every rank") {
  // Host a's ranks agree with each other, host b's with each other, the hosts disagree; then
  // the ranks of host b disagree among themselves.
  for (const std::string which : {"between hosts", "within host b"}) {
    CAPTURE(which);
    auto outs = on_ranks(4, on_hosts("aabb", local_group{5s}), [&](int r, ddp::process_group& pg) {
      ddp::auto_reducer red{pg};
      std::size_t n = 1000;
      if (which == "between hosts" && r >= 2) n = 2000;
      if (which == "within host b" && r == 3) n = 2000;
      std::vector<float> v(n, 1.0f);
      red.allreduce(std::span<float>{v}, op::sum);
    }, 30s);
    MESSAGE(ddp_test::summary(outs));
    for (const auto& o : outs) {
      CAPTURE(o.rank);
      CHECK(o.exit_code == 1);
      CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
      // The rank that called 2000 elements, by its rank in the group (not its place among the
      // hosts' leaders): rank 2, host b's leader, between hosts; rank 3 within host b.
      const std::string culprit = which == "between hosts" ? "rank 2 called allreduce #1 of 2000"
                                                           : "rank 3 called allreduce #1 of 2000";
      CHECK(o.message.find(culprit) != std::string::npos);
      CHECK(o.message.find("rank 1 called") == std::string::npos);
    }
  }
}

TEST_CASE("auto: the default wrapper on a /dev/shm that holds some buckets: host memory for the rest, exact averages") {
  // 48 MiB of /dev/shm; 30 MiB of gradients per rank: either rank's buckets alone would fit,
  // not every rank's. The default allocator puts what does not fit in host memory, and the
  // allreduce stages those buckets (docs/cluster.md).
  const std::size_t dev_shm = std::size_t{48} << 20;
  for (const std::string hosts : {"aa", "aabb"}) {
    for (bool view : {false, true}) {
      CAPTURE(hosts);
      CAPTURE(view);
      const int n = static_cast<int>(hosts.size());
      const int port = free_port();
      auto outs = run_ranks_with_dev_shm(dev_shm, n, [&](int r) {
        on_host(hosts, r);
        auto pg = ddp::init_process_group(opts(r, n, port));
        const std::size_t count = std::size_t{30} << 18;
        std::vector<float> data(count, 1.0f), grad(count, 0.0f);
        std::vector<ddp::tensor_view> views;
        for (std::size_t k = 0; k < 3; ++k)
          views.push_back(ddp::tensor_view{data.data() + k * count / 3, grad.data() + k * count / 3, count / 3, dtype::f32});
        ddp::data_parallel dp{pg, views, {}, {.gradient_as_bucket_view = view}};
        for (int step = 0; step < 3; ++step) {
          auto vs = dp.views();
          for (std::size_t i = vs.size(); i-- > 0;) {
            auto* g = static_cast<float*>(vs[i].grad);
            for (std::size_t j = 0; j < vs[i].numel; ++j) g[j] = static_cast<float>(2 * r + step) + static_cast<float>(j % 4);
            dp.grad_ready(i);
          }
          dp.finish();
          vs = dp.views();
          for (std::size_t i = 0; i < vs.size(); ++i) {
            const auto* g = static_cast<const float*>(vs[i].grad);
            for (std::size_t j = 0; j < vs[i].numel; j += 613) {
              const float want = static_cast<float>(n - 1 + step) + static_cast<float>(j % 4);
              require(g[j] == want, "step " + std::to_string(step) + " param " + std::to_string(i) + " element " +
                                        std::to_string(j) + ": " + std::to_string(g[j]) + " want " + std::to_string(want));
            }
          }
        }
      });
      expect_ok(outs);
    }
  }
}

// A leader that times out waiting for another host's leader follows the group's "waits for"
// chain (group/verdict.hpp name_stopped); that leader, waiting within its host (shm) for the
// late rank, recorded so after min(1 s, timeout / 4), long before its own deadline, which comes
// later than this rank's grace.
TEST_CASE("auto: a late rank is named even by a rank whose own deadline ends first") {
  // Rank 2 (host b's leader) enters the collective 1.5 s before ranks 0 and 3; rank 1 never
  // comes in time. Rank 2's deadline ends first, while rank 0 still waits for rank 1.
  const auto timeout = 3s;
  for (const std::string hosts : {"aabb", "abcd"}) {
    CAPTURE(hosts);
    auto outs = on_ranks(4, on_hosts(hosts, local_group{timeout}), [&](int r, ddp::process_group& pg) {
      ddp::auto_reducer red{pg};
      std::vector<float> v(1 << 14, 1.0f);
      red.allreduce(std::span<float>{v}, op::sum);
      if (r == 0 || r == 3) std::this_thread::sleep_for(1500ms);
      if (r == 1) std::this_thread::sleep_for(timeout + 5s);
      red.allreduce(std::span<float>{v}, op::sum);
    }, 30s);
    MESSAGE(ddp_test::summary(outs));
    for (const auto& o : outs) {
      if (o.rank == 1) continue;
      CAPTURE(o.rank);
      CHECK(o.exit_code == 1);
      CHECK(o.seconds < std::chrono::duration<double>(timeout).count() + 1.5 + 2.0 + 1.5);  // + setup
      CHECK(o.message.find("rank 1") != std::string::npos);
    }
  }
}

TEST_CASE("auto: a DDP_HOST_ID with a line break in it") {
  const int port = free_port();
  auto outs = run_ranks(2, [&](int r) {
    ::setenv("DDP_HOST_ID", "rack 1\nnode 7", 1);
    auto pg = ddp::init_process_group(opts(r, 2, port));
    ddp::auto_reducer red{pg};
    require(red.chosen() == ddp::backend::shm, red.describe());
    std::vector<float> v(10, 1.0f);
    red.allreduce(std::span<float>{v}, op::sum);
    require(v[9] == 2.0f, "sum");
  }, 30s);
  expect_ok(outs);
}

TEST_CASE("auto: averages on hosts of different sizes stay within docs/reducers.md's bound") {
  // Hosts of different sizes add roundings (the host's mean, its weight, the leaders' sum): the
  // result may differ from a flat reducer's, but stays within (n + 1) u S of the exact mean.
  for (const std::string hosts : {"aab", "aaaab", "abbbb", "aaa"}) {
    CAPTURE(hosts);
    const int n = static_cast<int>(hosts.size());
    expect_ok(on_ranks(n, on_hosts(hosts, local_group{20s, ddp::backend::hierarchical}), [&](int r, ddp::process_group& pg) {
      ddp::auto_reducer red{pg};
      std::vector<float> v(4096);
      std::vector<ddp::half> h(4096);
      auto x32 = [&](std::size_t i, int q) { return 0.1f + static_cast<float>(i) * 0.37f + static_cast<float>(q) * 0.01f; };
      auto x16 = [&](std::size_t i, int q) { return static_cast<float>(ddp::half(static_cast<float>(i % 300) * 0.013f + 0.1f * static_cast<float>(q + 1))); };
      for (std::size_t i = 0; i < v.size(); ++i) {
        v[i] = x32(i, r);
        h[i] = ddp::half(x16(i, r));
      }
      red.allreduce(std::span<float>{v}, op::avg);
      red.allreduce(std::span<ddp::half>{h}, op::avg);
      for (std::size_t i = 0; i < v.size(); ++i) {
        double m32 = 0, m16 = 0;
        for (int q = 0; q < n; ++q) m32 += x32(i, q), m16 += x16(i, q);
        m32 /= n, m16 /= n;
        require(std::fabs(v[i] - m32) <= (n + 1) * std::ldexp(1.0, -24) * std::fabs(m32),
                "f32 mean at " + std::to_string(i) + ": " + std::to_string(v[i]) + " vs " + std::to_string(m32));
        require(std::fabs(static_cast<float>(h[i]) - m16) <= (n + 1) * std::ldexp(1.0, -11) * std::fabs(m16) + 4 * n * std::ldexp(1.0, -24),
                "f16 mean at " + std::to_string(i) + ": " + std::to_string(static_cast<float>(h[i])) + " vs " + std::to_string(m16));
      }
    }, 30s));
  }
}
