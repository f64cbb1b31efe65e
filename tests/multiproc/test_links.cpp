// Connections made on first use (group/detail/mesh.hpp, peer_links) under the timings that broke them
// once: threads sharing the group's store connection, a fork while threads wait for a link, an
// abort while a first contact is in flight, a peer that dies after promising its connection, and
// a rank that dies between its claim and its count while joining.

#include <ddp/process_group.hpp>
#include <ddp/transport/tcp.hpp>

#include <doctest/doctest.h>
#include <sys/wait.h>

#include <csignal>
#include <stdexcept>
#include <thread>

#include "footprint.hpp"
#include "harness.hpp"

using namespace std::chrono_literals;
using ddp_test::free_port;
using ddp_test::group_options;
using ddp_test::run_processes;
using ddp_test::run_ranks;
using ddp_test::expect_ok;
using ddp_test::local_group;
using ddp_test::on_ranks;
using dclock = ddp::detail::clock;

namespace {
using ddp_test::require;
double since(dclock::time_point t0) { return std::chrono::duration<double>(dclock::now() - t0).count(); }
}  // namespace

TEST_CASE("a first contact made while other threads use the group's store is not a failure") {
  SUBCASE("two threads of one rank first-contact a peer that opens its transport late") {
    expect_ok(on_ranks(2, local_group{30s}, [&](int r, ddp::process_group& pg) {
      if (r == 1) {
        std::this_thread::sleep_for(2s);
        ddp::tcp t{pg};
        int a = 0, b = 5;
        t.recv(0, &a, sizeof a, pg.deadline());
        t.send(0, &b, sizeof b, pg.deadline());
        require(a == 3, "rank 1 got " + std::to_string(a));
        return;
      }
      ddp::tcp t{pg};
      int a = 3, b = 0;
      std::string e1, e2;
      std::thread t1([&] {
        try { t.send(1, &a, sizeof a, pg.deadline()); } catch (const std::exception& e) { e1 = e.what(); }
      });
      std::thread t2([&] {
        try { t.recv(1, &b, sizeof b, pg.deadline()); } catch (const std::exception& e) { e2 = e.what(); }
      });
      t1.join();
      t2.join();
      require(e1.empty() && e2.empty(), "send: " + e1 + " | recv: " + e2);
      require(b == 5, "rank 0 got " + std::to_string(b));
    }, 60s));
  }
  SUBCASE("a user thread holds the store connection in a long wait") {
    expect_ok(on_ranks(2, local_group{30s}, [&](int r, ddp::process_group& pg) {
      ddp::tcp t{pg};
      pg.barrier();
      std::thread waiter;
      if (r == 1) {
        waiter = std::thread([&] { pg.store().get("ready", dclock::now() + 15s); });
        std::this_thread::sleep_for(300ms);
      }
      const auto t0 = dclock::now();
      int v = 42;
      if (r == 1) {
        t.send(0, &v, sizeof v, pg.deadline());
      } else {
        std::this_thread::sleep_for(1s);
        v = 0;
        t.recv(1, &v, sizeof v, pg.deadline());
        require(v == 42, "rank 0 got " + std::to_string(v));
        pg.store().set("ready", "1");
      }
      if (waiter.joinable()) waiter.join();
      require(since(t0) < 5.0, "the first exchange took " + std::to_string(since(t0)) + " s");
    }, 60s));
  }
}

TEST_CASE("a rank's background work runs on one thread, and every channel's peers connect to one port") {
  // The group's mesh, its heartbeat's ring and two TCP transports: one reactor thread and one
  // listening port (group/detail/reactor.hpp, link_hub.hpp). Rank 0 also hosts the group's store,
  // a server with a thread and a port of its own.
  const int port = free_port();
  expect_ok(run_ranks(3, [&](int r) {
    const int before = ddp_test::threads_now();
    auto o = group_options(r, 3, port, 30s);
    o.heartbeat = 1s;
    auto pg = ddp::init_process_group(o);
    ddp::tcp a{pg}, b{pg};
    const int next = (r + 1) % 3, prev = (r + 2) % 3;
    for (auto* t : {&a, &b}) {
      int out = r, in = -1;
      if (r % 2 == 0) {
        t->send(next, &out, sizeof out, pg.deadline());
        t->recv(prev, &in, sizeof in, pg.deadline());
      } else {
        t->recv(prev, &in, sizeof in, pg.deadline());
        t->send(next, &out, sizeof out, pg.deadline());
      }
      require(in == prev, "rank " + std::to_string(r) + " got " + std::to_string(in));
    }
    const int store = r == 0 ? 1 : 0;
    const int threads = ddp_test::threads_now() - before;
    const auto ports = ddp_test::listening_ports();
    require(threads == 1 + store, "rank " + std::to_string(r) + " runs " + std::to_string(threads) +
                                      " threads of ddp's, not " + std::to_string(1 + store));
    require(static_cast<int>(ports.size()) == 1 + store, "rank " + std::to_string(r) + " listens on " +
                                                             std::to_string(ports.size()) + " ports, not " +
                                                             std::to_string(1 + store));
    pg.barrier();
  }));
}

TEST_CASE("two transports built from one transport_context get channels of their own, never each other's bytes") {
  // A copy of a context takes the group's next channel (group/transport_context.hpp). Before,
  // both took the context's one channel: the last attached got every connection, and rank 0's
  // `a` spoke to rank 1's `b` (or both ranks waited out their timeout).
  expect_ok(on_ranks(2, local_group{20s}, [&](int r, ddp::process_group& pg) {
    ddp::transport_context ctx{pg};
    ddp::tcp a{ctx}, b{ctx};
    const int peer = 1 - r;
    for (auto [t, mine] : {std::pair{&a, 'A'}, std::pair{&b, 'B'}}) {
      char in = 0;
      if (r == 0) {
        t->send(peer, &mine, 1, pg.deadline());
        t->recv(peer, &in, 1, pg.deadline());
      } else {
        t->recv(peer, &in, 1, pg.deadline());
        t->send(peer, &mine, 1, pg.deadline());
      }
      require(in == mine, std::string("rank ") + std::to_string(r) + " got '" + in + "' on the transport that sent '" +
                              mine + "'");
    }
    pg.barrier();
  }, 40s));
}

TEST_CASE("a forked child destroys its copy of a transport while the parent's threads wait for a link") {
  expect_ok(on_ranks(2, local_group{30s}, [&](int r, ddp::process_group& pg) {
    if (r == 1) {
      ddp::tcp t{pg};
      pg.store().set("pid1", std::to_string(::getpid()));
      pg.barrier();
      ::raise(SIGSTOP);  // rank 0's threads are then stuck connecting to us
      int a = 0, b = 5;
      t.recv(0, &a, sizeof a, pg.deadline());
      t.send(0, &b, sizeof b, pg.deadline());
      return;
    }
    auto t = std::make_unique<ddp::tcp>(pg);
    const pid_t pid1 = std::stoi(pg.store().get("pid1"));
    pg.barrier();
    std::this_thread::sleep_for(300ms);
    int a = 3, b = 0;
    std::string e1, e2;
    std::thread t1([&] {
      try { t->send(1, &a, sizeof a, pg.deadline()); } catch (const std::exception& e) { e1 = e.what(); }
    });
    std::this_thread::sleep_for(200ms);
    std::thread t2([&] {
      try { t->recv(1, &b, sizeof b, pg.deadline()); } catch (const std::exception& e) { e2 = e.what(); }
    });
    std::this_thread::sleep_for(200ms);
    const pid_t c = ::fork();
    if (c == 0) {
      t.reset();
      ::_exit(0);
    }
    int st = 0;
    bool done = false;
    for (int i = 0; i < 300 && !done; ++i) {
      if (::waitpid(c, &st, WNOHANG) == c) done = true;
      else std::this_thread::sleep_for(10ms);
    }
    if (!done) {
      ::kill(c, SIGKILL);
      ::waitpid(c, &st, 0);
    }
    ::kill(pid1, SIGCONT);
    t1.join();
    t2.join();
    require(done, "the forked child hung destroying its copy of the transport");
    require(e1.empty() && e2.empty() && b == 5, "parent: send: " + e1 + " | recv: " + e2);
  }, 60s));
}

TEST_CASE("a link accepted after the transport was aborted does not escape the abort") {
  expect_ok(on_ranks(2, local_group{10s}, [&](int r, ddp::process_group& pg) {
    ddp::tcp t{pg};
    if (r == 1) {
      pg.store().set("pid1", std::to_string(::getpid()));
      pg.barrier();
      ::raise(SIGSTOP);
      std::this_thread::sleep_for(200ms);
      int x = 11, y = 0;
      const auto t0 = dclock::now();
      try {
        t.send(0, &x, sizeof x, pg.deadline());
        t.recv(0, &y, sizeof y, pg.deadline());
      } catch (const ddp::error& e) {
        // Told at once that rank 0 aborted, not at the deadline.
        require(e.condition() == ddp::errc::aborted, e.what());
        require(since(t0) < 3.0, "rank 1 learned of the abort after " + std::to_string(since(t0)) + " s");
        return;
      }
      throw std::runtime_error("rank 1 exchanged data with an aborted transport");
    }
    const pid_t pid1 = std::stoi(pg.store().get("pid1"));
    pg.barrier();
    std::this_thread::sleep_for(300ms);
    int got = 0;
    std::string err;
    std::thread a([&] {
      try { t.recv(1, &got, sizeof got, pg.deadline()); } catch (const std::exception& e) { err = e.what(); }
    });
    std::this_thread::sleep_for(300ms);
    t.abort();
    ::kill(pid1, SIGCONT);
    a.join();
    require(!err.empty(), "a receive in flight when the transport was aborted succeeded (got " + std::to_string(got) + ")");
    std::this_thread::sleep_for(4s);  // alive, holding its sockets, while rank 1 finds out
  }, 60s));
}

TEST_CASE("a peer that dies after promising its connection is lost at once, not at the deadline") {
  auto outs = on_ranks(3, local_group{8s}, [&](int r, ddp::process_group& pg) {
    ddp::tcp t{pg};
    pg.barrier();
    if (r == 0) {
      std::this_thread::sleep_for(5s);
      return;
    }
    int v = 7;
    if (r == 1) {
      // Rank 1's first contact with rank 2 is held up (a user thread holds the store connection
      // in a long wait) while rank 2, told that rank 1's connection wins, waits for it; then
      // rank 1 dies.
      std::thread([&] {
        try { pg.store().get("never", dclock::now() + 30s); } catch (...) {}
      }).detach();
      std::thread([] {
        std::this_thread::sleep_for(1500ms);
        ::raise(SIGKILL);
      }).detach();
      std::this_thread::sleep_for(200ms);
      t.send(2, &v, sizeof v, pg.deadline());
      std::this_thread::sleep_for(10s);
      return;
    }
    std::this_thread::sleep_for(700ms);
    const auto t0 = dclock::now();
    try {
      t.recv(1, &v, sizeof v, pg.deadline());
    } catch (const ddp::error& e) {
      require(e.condition() == ddp::errc::peer_lost, e.what());
      require(std::string(e.what()).find("rank 1 is gone") != std::string::npos, e.what());
      require(since(t0) < 4.0, "noticed after " + std::to_string(since(t0)) + " s");
      return;
    }
    throw std::runtime_error("a receive from a dead rank succeeded");
  }, 60s);
  INFO(ddp_test::summary(outs));
  CHECK(outs[0].ok());
  CHECK(outs[1].exit_code == 128 + SIGKILL);
  CHECK(outs[2].ok());
}

TEST_CASE("a rank that dies right after its claim: the others name it at the timeout") {
  const int port = free_port();
  auto outs = run_processes({0, 1, 2}, [&](int r) {
    if (r == 2) {
      ddp::store_client st("127.0.0.1", port, 2, dclock::now() + 10s);
      st.wait({"pg/job"}, dclock::now() + 10s);
      st.compare_set("pg/rank/2", "", "host:1:2", dclock::now() + 10s);
      ::_exit(9);  // its claim is its arrival: the group forms, and then waits for it
    }
    (void)ddp::init_process_group(group_options(r, 3, port, 2s));
  }, 30s);
  INFO(ddp_test::summary(outs));
  for (int r : {0, 1}) {
    CHECK(outs[r].errc == static_cast<int>(ddp::errc::timeout));
    CHECK_MESSAGE(outs[r].message.find("rank 2 stopped answering within the deadline") != std::string::npos,
                  outs[r].message);
  }
}
