#include <ddp/process_group.hpp>

#include <doctest/doctest.h>
#include <arpa/inet.h>
#include <ddp/reducer/shm.hpp>
#include <ddp/transport/tcp.hpp>
#include <ifaddrs.h>
#include <net/if.h>
#include <sys/socket.h>

#include <numeric>
#include <type_traits>
#include <stdexcept>
#include <thread>

#include "harness.hpp"

using namespace std::chrono_literals;

// Transports take a context, not the group's plumbing: the plumbing is gone from the group's
// public API, and `Transport(pg)` / `Transport(pg, options)` still build one.
template <class G>
concept has_plumbing = requires(G& pg) { pg.peer_socket(0, ddp::deadline_t{}); } ||
                       requires(G& pg) { pg.next_channel_id(); } || requires(G& pg) { pg.store_budget(); } ||
                       requires(G& pg) { pg.name_stopped(std::string(), 0); } ||
                       requires(G& pg) { pg.record_failure(ddp::group_failure{}); } ||
                       requires(G& pg) { pg.failure_recorded(); };
static_assert(!has_plumbing<ddp::process_group>);
static_assert(std::is_convertible_v<ddp::process_group&, ddp::transport_context>);
static_assert(std::is_constructible_v<ddp::tcp, ddp::process_group&>);
static_assert(std::is_constructible_v<ddp::tcp, ddp::process_group&, ddp::tcp_options>);
static_assert(std::is_constructible_v<ddp::shm, ddp::process_group&>);
static_assert(std::is_constructible_v<ddp::shm, ddp::process_group&, ddp::shm_options>);
static_assert(std::is_constructible_v<ddp::store_server, ddp::endpoint, int>);
using ddp_test::expect_ok;
using ddp_test::free_port;
using ddp_test::local_group;
using ddp_test::on_ranks;
using ddp_test::run_processes;
using ddp_test::run_ranks;

namespace {
constexpr ddp_test::local_group opts{20s};
using ddp_test::raises;
using ddp_test::require;
using ddp_test::require_raises;
}  // namespace

TEST_CASE("groups of 1, 2, 4 and 8 real processes join, barrier, broadcast and all_gather") {
  for (int n : {1, 2, 4, 8}) {
    CAPTURE(n);
    const int port = free_port();
    const auto t0 = std::chrono::steady_clock::now();
    auto outs = run_ranks(n, [&](int r) {
      auto pg = ddp::init_process_group(opts(r, n, port));
      require(pg.rank() == r && pg.size() == n, "rank/size");
      for (int i = 0; i < 20; ++i) pg.barrier();
      for (int root = 0; root < n; ++root) {
        std::vector<int> v(1000 + root);
        if (r == root) std::iota(v.begin(), v.end(), root * 7);
        pg.broadcast(std::span<int>(v), root);
        for (std::size_t i = 0; i < v.size(); ++i)
          require(v[i] == root * 7 + static_cast<int>(i), "broadcast value from root " + std::to_string(root));
      }
      auto all = pg.all_gather("rank-" + std::to_string(r));
      for (int q = 0; q < n; ++q) require(all[static_cast<std::size_t>(q)] == "rank-" + std::to_string(q), "all_gather");
    });
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    INFO(ddp_test::summary(outs));
    CHECK(ddp_test::all_ok(outs));
    // Waits block instead of spinning, so 8 processes on 2 cores still finish quickly.
    CHECK(secs < 10.0);
  }
}

TEST_CASE("a large broadcast crosses the mesh intact") {
  expect_ok(on_ranks(3, opts, [&](int r, ddp::process_group& pg) {
    std::vector<std::uint64_t> v(8 << 20);  // 64 MiB
    if (r == 1) std::iota(v.begin(), v.end(), 11u);
    pg.broadcast(std::span<std::uint64_t>(v), 1);
    require(v.front() == 11 && v.back() == 11 + v.size() - 1 && v[12345] == 11 + 12345, "payload");
  }));
}

TEST_CASE("broadcast with different sizes on different ranks is a mismatch error") {
  auto outs = on_ranks(2, local_group{5s}, [&](int r, ddp::process_group& pg) {
    std::vector<char> v(r == 0 ? 10 : 12);
    pg.broadcast(std::span<char>(v), 0);
  });
  INFO(ddp_test::summary(outs));
  CHECK(outs[0].exit_code != 0 + 7);  // rank 0 may finish or see rank 1 leave
  REQUIRE(outs[1].exit_code == 1);
  CHECK(outs[1].errc == static_cast<int>(ddp::errc::mismatch));
  CHECK(outs[1].message.find("broadcast size differs") != std::string::npos);
}

TEST_CASE("invalid options are rejected with clear errors before any socket") {
  auto expect = [](ddp::init_options o, const char* text) {
    CHECK(raises([&] { (void)ddp::init_process_group(o); }, ddp::errc::invalid_argument, {text}) == "");
  };
  expect(opts(4, 4, 29500), "rank 4 is outside [0, 4)");
  expect(opts(-1, 4, 29500), "rank -1 is outside [0, 4)");
  expect(opts(0, 0, 29500), "world_size must be at least 1");
  expect(opts(0, 2, 70000), "master_port 70000 is outside [1, 65535]");
  expect(opts(0, 2, 0), "master_port 0 is outside");
  // At once, before any socket or allocation the size would drive (it once ended in
  // std::bad_alloc after 14 s).
  const auto t0 = std::chrono::steady_clock::now();
  expect(opts(1, 2147483647, 29500), "world_size 2147483647 is larger than the 1048576 ranks a group supports");
  CHECK(std::chrono::steady_clock::now() - t0 < 100ms);
}

TEST_CASE("an unresolvable master is an unresolvable error") {
  auto o = opts(1, 2, 29500, 3s);
  o.master_addr = "no-such-host.invalid";
  CHECK(raises([&] { (void)ddp::init_process_group(o); }, ddp::errc::unresolvable, {"no-such-host.invalid"}) == "");
}

TEST_CASE("rank 0's port already taken is an address_in_use error") {
  const int port = free_port();
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  CHECK(raises([&] { (void)ddp::init_process_group(opts(0, 2, port, 3s)); }, ddp::errc::address_in_use,
               {std::to_string(port)}) == "");
  ::close(fd);
}

TEST_CASE("two processes claiming the same rank: one gets rank_conflict") {
  const int port = free_port();
  auto outs = run_processes({0, 1, 1}, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, 2, port, 5s));
    pg.barrier();
    // Stay in the group long enough for the duplicate to reach the store.
    std::this_thread::sleep_for(1500ms);
  });
  INFO(ddp_test::summary(outs));
  CHECK(outs[0].ok());
  const int conflicts = (outs[1].errc == static_cast<int>(ddp::errc::rank_conflict)) +
                        (outs[2].errc == static_cast<int>(ddp::errc::rank_conflict));
  CHECK(conflicts == 1);
  CHECK((outs[1].ok() || outs[2].ok()));
  for (auto& o : outs)
    if (o.errc == static_cast<int>(ddp::errc::rank_conflict))
      CHECK(o.message.find("rank 1 is already taken") != std::string::npos);
}

TEST_CASE("a second job on the same port is told that another job holds the port, not rank_conflict") {
  const int port = free_port();
  // 0, 1: job "A" (2 ranks). 101: rank 1 of a job of 3 ranks. 201: rank 1 of job "C" (2 ranks).
  // 301: rank 1 of a job of 2 ranks without a job id: the same shape as A, so it cannot be told
  // apart from a duplicate of A's rank 1; its message says both.
  auto outs = run_processes({0, 1, 101, 201, 301}, [&](int code) {
    const int r = code % 100, job = code / 100;
    auto o = opts(r, job == 1 ? 3 : 2, port, 5s);
    o.job_id = job == 0 ? "A" : job == 2 ? "C" : "";
    if (job != 0) std::this_thread::sleep_for(500ms);  // job A's store is up by then
    auto pg = ddp::init_process_group(o);
    pg.barrier();
    if (job == 0) std::this_thread::sleep_for(2500ms);  // keep the port while the others try
  });
  INFO(ddp_test::summary(outs));
  CHECK(outs[0].ok());
  CHECK(outs[1].ok());
  for (int i : {2, 3}) {
    CHECK(outs[i].errc == static_cast<int>(ddp::errc::address_in_use));
    CHECK(outs[i].message.find("another job holds port " + std::to_string(port)) != std::string::npos);
    CHECK(outs[i].message.find("every process needs its own rank") == std::string::npos);
  }
  CHECK(outs[2].message.find("a group of 2 ranks, job 'A'") != std::string::npos);
  CHECK(outs[2].message.find("a group of 3 ranks") != std::string::npos);
  CHECK(outs[3].message.find("job 'C'") != std::string::npos);
  CHECK(outs[4].errc == static_cast<int>(ddp::errc::rank_conflict));
  CHECK(outs[4].message.find("give each job its own MASTER_PORT") != std::string::npos);
}

TEST_CASE("a rank of a job's next run waits for the earlier run's store to go, then joins its own run") {
  const int port = free_port();
  // What a restarting launcher (ddprun --max-restarts) leaves: run 0 of job "J" still holds the
  // port when a rank of run 1 ("J+restart.1") arrives. 0: run 0's rank 0, whose rank 1 never
  // comes (it times out and its store goes). 1: run 1's rank 1, early. 2: run 1's rank 0, once
  // the port is free. 3: a rank of run 0 that comes when run 1 holds the port: refused, as any
  // other job is (an earlier run never waits for a later one).
  auto outs = run_processes({0, 1, 2, 3}, [&](int code) {
    const int r = code == 0 || code == 2 ? 0 : 1;
    auto o = opts(r, 2, port, code == 0 ? 1500ms : 10s);
    o.job_id = code == 1 || code == 2 ? "J+restart.1" : "J";
    if (code == 1) std::this_thread::sleep_for(300ms);
    if (code == 2) std::this_thread::sleep_for(4500ms);
    if (code == 3) std::this_thread::sleep_for(6000ms);
    const auto t0 = std::chrono::steady_clock::now();
    auto pg = ddp::init_process_group(o);
    pg.barrier();
    if (code == 1) {
      const auto waited = std::chrono::steady_clock::now() - t0;
      if (waited < 3s) throw std::runtime_error("joined run 1 before run 1's store was up");
    }
    if (code == 1 || code == 2) std::this_thread::sleep_for(3000ms);  // hold the port while 3 tries
  }, 30s);
  INFO(ddp_test::summary(outs));
  CHECK(outs[0].errc == static_cast<int>(ddp::errc::timeout));
  CHECK(outs[1].ok());
  CHECK(outs[2].ok());
  CHECK(outs[3].errc == static_cast<int>(ddp::errc::address_in_use));
  CHECK(outs[3].message.find("job 'J+restart.1'") != std::string::npos);
}

TEST_CASE("ranks that never arrive: every waiting rank fails within the timeout and names them") {
  const int port = free_port();
  const auto timeout = 2s;
  // World of 4, but ranks 1 and 3 never start.
  auto outs = run_processes({0, 2}, [&](int r) { (void)ddp::init_process_group(opts(r, 4, port, timeout)); },
                            20s);
  INFO(ddp_test::summary(outs));
  for (auto& o : outs) {
    CHECK(o.exit_code == 1);
    CHECK(o.errc == static_cast<int>(ddp::errc::timeout));
    CHECK(o.message.find("ranks 1, 3") != std::string::npos);
    CHECK(o.seconds < 2.0 + 2.0);
  }
}

TEST_CASE("rank 0 never arrives: the others fail within the timeout naming rank 0") {
  const int port = free_port();
  auto outs = run_processes({1, 2}, [&](int r) { (void)ddp::init_process_group(opts(r, 3, port, 2s)); }, 20s);
  INFO(ddp_test::summary(outs));
  for (auto& o : outs) {
    CHECK(o.errc == static_cast<int>(ddp::errc::timeout));
    CHECK(o.message.find("rank 0") != std::string::npos);
    CHECK(o.seconds < 4.0);
  }
}

TEST_CASE("rank 0 freezes after another rank claimed its place: that rank names rank 0, not 'not every rank'") {
  // Rank 0's process serves the store: frozen (SIGSTOP), it answers nothing, so rank 1 cannot
  // even ask which ranks are missing. Its error must still say who stopped the group.
  const int port = free_port();
  auto outs = run_processes(
      {0, 1},
      [&](int r) {
        std::thread freezer;
        if (r == 0)
          freezer = std::thread([&] {
            // A stranger's connection may read: once rank 1's claim is in, rank 0 freezes.
            const auto until = std::chrono::steady_clock::now() + 10s;
            ddp::store_client watch("127.0.0.1", port, 0, until);
            (void)watch.wait({"pg/rank/1"}, until);
            ::kill(::getpid(), SIGSTOP);
          });
        (void)ddp::init_process_group(opts(r, 3, port, 2s));  // rank 2 never starts
        if (freezer.joinable()) freezer.join();
      },
      6s);
  INFO(ddp_test::summary(outs));
  REQUIRE(outs.size() == 2);
  CHECK(outs[0].timed_out);  // frozen until the harness killed it
  CHECK(outs[1].errc == static_cast<int>(ddp::errc::timeout));
  CHECK(outs[1].message.find("rank 0, whose process serves the group's store") != std::string::npos);
  CHECK(outs[1].seconds < 2.0 + 2.0 + 1.0);
}

TEST_CASE("ranks started before rank 0 keep retrying and join") {
  const int port = free_port();
  auto outs = run_ranks(3, [&](int r) {
    if (r == 0) std::this_thread::sleep_for(700ms);
    auto pg = ddp::init_process_group(opts(r, 3, port, 10s));
    pg.barrier();
  });
  expect_ok(outs);
}

TEST_CASE("a peer that dies turns a barrier into peer_lost on the survivors") {
  auto outs = on_ranks(3, local_group{10s}, [&](int r, ddp::process_group& pg) {
    pg.barrier();
    if (r == 2) ::_exit(0);  // vanish without cleanup
    for (;;) pg.barrier();
  }, 30s);
  INFO(ddp_test::summary(outs));
  for (int r : {0, 1}) {
    CHECK(outs[static_cast<std::size_t>(r)].errc == static_cast<int>(ddp::errc::peer_lost));
    CHECK(outs[static_cast<std::size_t>(r)].seconds < 8.0);
  }
}

TEST_CASE("hostname and IPv6 master addresses work") {
  for (const char* addr : {"localhost", "::1", "[::1]"}) {
    CAPTURE(addr);
    // Skip IPv6 where the kernel has no ::1.
    if (std::string(addr).find(':') != std::string::npos) {
      int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_loopback;
      const bool v6 = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
      if (fd >= 0) ::close(fd);
      if (!v6) continue;
    }
    const int port = free_port();
    auto outs = run_ranks(2, [&](int r) {
      auto o = opts(r, 2, port, 10s);
      o.master_addr = addr;
      auto pg = ddp::init_process_group(o);
      int v = r == 0 ? 42 : 0;
      pg.broadcast(std::span<int>(&v, 1), 0);
      require(v == 42, "value");
    });
    expect_ok(outs);
  }
}

TEST_CASE("abort() on one rank wakes the others at once with errc::aborted naming it") {
  auto outs = on_ranks(3, local_group{30s}, [&](int r, ddp::process_group& pg) {
    pg.barrier();
    if (r == 1) {
      std::this_thread::sleep_for(200ms);
      pg.abort("giving up");
      try {
        pg.barrier();
      } catch (const ddp::error& e) {
        require(e.code() == ddp::errc::aborted, "local call after abort");
        throw;
      }
    }
    for (;;) pg.barrier();  // rank 1 never arrives: only the abort can end this early
  }, 60s);
  INFO(summary(outs));
  for (auto& o : outs) {
    CHECK(o.errc == static_cast<int>(ddp::errc::aborted));
    CHECK(o.seconds < 5.0);  // far below the 30 s timeout
  }
  CHECK(outs[0].message.find("rank 1: giving up") != std::string::npos);
  CHECK(outs[2].message.find("rank 1: giving up") != std::string::npos);
}

TEST_CASE("a rank that fails with an exception: its peers learn its message") {
  for (const bool by_abort : {false, true}) {
    CAPTURE(by_abort);
    auto outs = on_ranks(3, local_group{30s}, [&](int r, ddp::process_group& pg) {
      pg.barrier();
      if (r == 1) {
        std::this_thread::sleep_for(200ms);
        if (by_abort) {
          // Not a ddp error: the program hands it to the group before it leaves.
          try {
            throw std::runtime_error("the data loader ran out of files");
          } catch (const std::exception& e) {
            pg.abort(e);
            throw;
          }
        }
        // A ddp error only this rank raises; the group goes while it propagates.
        std::uint64_t v = 0;
        pg.broadcast(std::span<std::uint64_t>(&v, 1), 7);
      }
      for (;;) pg.barrier();
    }, 60s);
    INFO(summary(outs));
    for (int r : {0, 2}) {
      CHECK(outs[r].errc == static_cast<int>(ddp::errc::aborted));
      CHECK(outs[r].seconds < 5.0);
      CHECK(outs[r].message.find("lost connection") == std::string::npos);
      if (by_abort) {
        CHECK(outs[r].message.find("group aborted by rank 1: the data loader ran out of files") != std::string::npos);
      } else {
        CHECK(outs[r].message.find("rank 1 left the group on its error (invalid_argument): broadcast root 7 is not a rank") !=
              std::string::npos);
      }
    }
  }
}

TEST_CASE("an auth token in a program without an authenticator is errc::unsupported, never ignored") {
  // This program does not include <ddp/auth/sodium.hpp>, so no authenticator is installed.
  REQUIRE_FALSE(ddp::authentication_available());
  auto o = opts(0, 1, free_port());
  o.auth_token = "s3cret";
  CHECK(raises([&] { ddp::init_process_group(o); }, ddp::errc::unsupported, {"<ddp/auth/sodium.hpp>"}) == "");
}

TEST_CASE("connections are made on first use: a rank holds its barrier peers, a ring over tcp two more") {
  const int n = 16;
  expect_ok(on_ranks(n, local_group{60s}, [&](int r, ddp::process_group& pg) {
    // Joining ends with a dissemination barrier: peers r +- 1, 2, 4, 8, seven in all.
    require(pg.connections() <= 7, "after joining, rank " + std::to_string(r) + " holds " +
                                       std::to_string(pg.connections()) + " connections");
    auto all = pg.all_gather(std::to_string(r));  // a binomial tree: the same peers
    for (int q = 0; q < n; ++q) require(all[static_cast<std::size_t>(q)] == std::to_string(q), "all_gather");
    require(pg.connections() <= 7, "all_gather opened more connections than its tree needs");
    ddp::tcp t{pg};
    int out = r, in = -1;
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    t.sendrecv(next, &out, sizeof out, prev, &in, sizeof in, pg.deadline());
    require(in == prev, "ring exchange");
    require(t.connections() == 2, "a ring step holds " + std::to_string(t.connections()) + " connections");
    pg.barrier();
  }, 120s));
}

TEST_CASE("two ranks that first talk to each other at the same moment end with one working connection") {
  expect_ok(on_ranks(2, opts, [&](int r, ddp::process_group& pg) {
    for (int round = 0; round < 40; ++round) {
      ddp::tcp t{pg};  // a fresh channel: both ranks connect at once, each to the other
      std::uint64_t out = static_cast<std::uint64_t>(round * 2 + r), in = 0;
      t.sendrecv(1 - r, &out, sizeof out, 1 - r, &in, sizeof in, pg.deadline());
      require(in == static_cast<std::uint64_t>(round * 2 + 1 - r), "round " + std::to_string(round) + ": wrong value");
      require(t.connections() == 1, "round " + std::to_string(round) + ": " + std::to_string(t.connections()) +
                                        " connections to the one peer");
    }
  }));
}

TEST_CASE("a crowd of idle strangers at a rank's listener does not keep a real peer out") {
  expect_ok(on_ranks(2, opts, [&](int r, ddp::process_group& pg) {
    ddp::tcp t{pg};
    std::vector<ddp::detail::fd_handle> strangers;
    if (r == 1) {
      // 400 idle connections to rank 0's listener for this channel (more than it keeps
      // handshakes for), then the real first exchange.
      const auto v = pg.store().get(std::string("tcp/1/addr/0"), pg.deadline());
      const auto sp = v.rfind(' ');
      const auto eps = ddp::detail::resolve(v.substr(0, sp), std::stoi(v.substr(sp + 1)), 1);
      std::error_code ec;
      for (int i = 0; i < 400; ++i) {
        strangers.push_back(ddp::detail::connect_retry(eps, pg.deadline(), ec));
        require(static_cast<bool>(strangers.back()), "stranger " + std::to_string(i) + " could not connect");
      }
      pg.store().set("crowd", "1");
    } else {
      pg.store().get("crowd");
    }
    const auto t0 = std::chrono::steady_clock::now();
    int out = r, in = -1;
    t.sendrecv(1 - r, &out, sizeof out, 1 - r, &in, sizeof in, pg.deadline());
    require(in == 1 - r, "exchange");
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    require(secs < 3.0, "the first exchange took " + std::to_string(secs) + " s behind the strangers");
  }));
}

namespace {
/// An address of this host that is not loopback, or empty when there is none.
std::string outside_address() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string found;
  for (auto* a = list; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET || (a->ifa_flags & IFF_LOOPBACK)) continue;
    char buf[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, buf, sizeof buf);
    found = buf;
  }
  ::freeifaddrs(list);
  return found;
}
}  // namespace

TEST_CASE("a store reachable beyond loopback without a secret is refused unless the user opts in") {
  const std::string addr = outside_address();
  if (addr.empty()) {
    WARN_MESSAGE(false, "this host has no IPv4 address besides loopback: the non-loopback case is not exercised");
    return;
  }
  for (int rank : {0, 1}) {
    CAPTURE(rank);
    auto o = opts(rank, 2, free_port(), 5s);
    o.master_addr = addr;
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(raises([&] { (void)ddp::init_process_group(o); }, ddp::errc::auth_failed,
                 {"is reachable beyond this host and the group has no secret", "DDP_AUTH_TOKEN",
                  "DDP_INSECURE=1"}) == "");
    CHECK(std::chrono::steady_clock::now() - t0 < 1s);  // at once, not at the timeout
  }
  // Opting in: the group forms on that address.
  const int port = free_port();
  auto outs = run_ranks(2, [&](int r) {
    auto o = opts(r, 2, port);
    o.master_addr = addr;
    o.insecure = true;
    auto pg = ddp::init_process_group(o);
    pg.barrier();
  });
  expect_ok(outs);
}

TEST_CASE("a stranger without a token can neither plant the group's failure nor hold rank 0's exit") {
  const int port = free_port();
  auto outs = run_processes({0, 1, 2}, [&](int who) {
    if (who == 2) {
      // A stranger: connects to rank 0's store, tries to decide the group's error, then idles.
      ddp::store_client st("127.0.0.1", port, 99, ddp::detail::clock::now() + 10s);
      st.wait({"pg/complete"}, ddp::detail::clock::now() + 10s);
      for (const char* key : {"pg/failure", "pg/abort", "tcp/1/abort", "pg/mesh/addr/1"})
        require_raises([&] { st.set(key, "9 group aborted by rank 1: planted"); }, ddp::errc::auth_failed, {},
                       std::string("a stranger writing ") + key);
      // Every seat is taken; a key that is not a seat is no claim: refused like any write.
      for (const char* key : {"pg/rank/1", "pg/rank/999", "pg/rank/01"}) {
        try {
          const auto owner = st.compare_set(key, "", "x", ddp::detail::clock::now() + 1s);
          require(std::string(key) == "pg/rank/1" && owner != "x", std::string("a stranger claimed ") + key);
        } catch (const ddp::error& e) {
          require(e.condition() == ddp::errc::auth_failed, e.what());
        }
      }
      require_raises([&] { st.set("pg/failure", "9 planted"); }, ddp::errc::auth_failed, {},
                     "a stranger becoming a member");
      std::this_thread::sleep_for(5s);  // idle, connected, while the group closes
      return;
    }
    auto pg = ddp::init_process_group(opts(who, 2, port, 20s));
    std::this_thread::sleep_for(300ms);
    require(!ddp::transport_context{pg}.verdict().recorded(), "a failure was recorded");
    pg.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    pg.close();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    require(secs < 2.0, "closing took " + std::to_string(secs) + " s");
  }, 60s);
  expect_ok(outs);
}

TEST_CASE("a transport context: a channel of its own, the same on every rank, and the group's verdict") {
  expect_ok(on_ranks(2, opts, [&](int r, ddp::process_group& pg) {
    ddp::transport_context a{pg};
    ddp::transport_context b{pg};
    require(a.rank() == r && a.size() == 2 && a.group_id() == pg.id() && a.timeout() == pg.timeout(), "context");
    require(b.channel() == a.channel() + 1, "channels " + std::to_string(a.channel()) + ", " + std::to_string(b.channel()));
    const auto all = pg.all_gather(std::to_string(a.channel()));
    require(all[0] == all[1], "rank 0 got channel " + all[0] + ", rank 1 channel " + all[1]);
    require(!a.verdict().recorded(), "a failure was recorded");
    pg.barrier();
    if (r == 1) {
      const auto held = b.verdict().record({ddp::errc::aborted, b.verdict().reported("given up on purpose")});
      require(held.code == ddp::errc::aborted && held.text == "rank 1 reports: given up on purpose", held.text);
    }
    pg.barrier();
    // One record for the group, whichever context wrote it: the first writer wins.
    const auto f = a.verdict().first();
    require(f.code == ddp::errc::aborted && f.text == "rank 1 reports: given up on purpose", "read: " + f.text);
    const auto later = a.verdict().record({ddp::errc::timeout, a.verdict().reported("too late")});
    require(later.text == "rank 1 reports: given up on purpose", "a later record won: " + later.text);
    pg.barrier();
  }));
}

// The verdict the group and every transport share (group/verdict.hpp), in one process over a real
// store: whom a timeout blames, what a closed link reports, who wins, and a store that is gone.
TEST_CASE("failure_verdict: the chain of waiting ranks, the first record, a store that is gone") {
  auto server = std::make_unique<ddp::store_server>(ddp::endpoint{"127.0.0.1", 0}, 0);
  const auto until = ddp::steady_clock::now() + 5s;
  ddp::store_client c0{"127.0.0.1", server->port(), 0, until}, c1{"127.0.0.1", server->port(), 1, until};
  ddp::failure_verdict v0{&c0, 0, 3, 800ms}, v1{&c1, 1, 3, 800ms};
  CHECK_FALSE(v0.recorded());
  CHECK(v0.first().empty());

  // Rank 1 waits for rank 2, which records nothing: rank 2 stopped, rank 1 is not blamed.
  c1.set("x/waiting/1", "2");
  CHECK(v0.name_stopped("x", 1) ==
        "rank 2 stopped answering within the deadline (rank 0 waited for rank 1, which waited for rank 2)");
  // Ranks that wait for each other are calls that do not match.
  c1.set("y/waiting/1", "2");
  c1.set("y/waiting/2", "1");
  CHECK(v0.name_stopped("y", 1) ==
        "ranks 1, 2 wait for each other and none of them stopped (rank 0 waited for rank 1, which waited for "
        "rank 2): their calls do not match");

  // A closed link: this rank's own verdict, recorded; the next rank to judge adopts it.
  const auto own = v0.judge(1, make_error_code(ddp::errc::peer_lost), "waiting for rank 1");
  CHECK_FALSE(own.adopted);
  CHECK(own.failure.code == ddp::errc::peer_lost);
  CHECK(own.failure.text == "lost connection to rank 1 (peer_lost)");
  CHECK(v1.recorded());
  const auto theirs = v1.judge(2, make_error_code(ddp::errc::timeout), "waiting for rank 2");
  CHECK(theirs.adopted);
  CHECK(theirs.failure.code == ddp::errc::peer_lost);
  CHECK(theirs.failure.text == "rank 0 reports: lost connection to rank 1 (peer_lost)");
  CHECK(v1.record({ddp::errc::aborted, v1.reported("later")}).text == theirs.failure.text);

  // Rank 0 (the store) gone: rank 0 is the one lost, whatever link noticed.
  server.reset();
  bool gone = false;
  CHECK(v1.first(&gone).empty());
  CHECK(gone);
  const auto lost = v1.judge(2, make_error_code(ddp::errc::timeout), "on the link to rank 2");
  CHECK_FALSE(lost.adopted);
  CHECK(lost.failure.code == ddp::errc::peer_lost);
  CHECK(lost.failure.text == "rank 0 is lost (its store does not answer; noticed on the link to rank 2)");
}
