// The group's heartbeat (init_options::heartbeat, group/detail/heartbeat.hpp): a frozen rank
// (SIGSTOP) fails every survivor's collective within the lease, though the collective timeout
// is a minute; a killed one at once; ranks that finish at different times are not taken for
// dead; every rank must run the same lease; a rank that leaves after its group failed says so,
// and its successor's group fails on it (the rank is not taken for dead).

#include <ddp/ddp.hpp>
#include <ddp/store.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/transport/tcp.hpp>
#include <ddp/group/detail/heartbeat.hpp>

#include <doctest/doctest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include "harness.hpp"

using namespace std::chrono_literals;
using ddp_test::free_port;
using ddp_test::group_options;
using ddp_test::run_ranks;
using ddp_test::expect_ok;
using ddp_test::summary;

namespace {

// The survivors' timing quote, " [after 0.004 s]": the seconds from the moment the victim
// stopped or died to the survivor's error. quote_elapsed writes it and quoted_elapsed reads it
// back, so the text and its parser cannot drift apart.
constexpr std::string_view elapsed_tag = " [after ";

std::string quote_elapsed(double s) { return std::string(elapsed_tag) + std::to_string(s) + " s]"; }

std::optional<double> quoted_elapsed(const std::string& msg) {
  const auto at = msg.rfind(elapsed_tag);
  if (at == std::string::npos) return std::nullopt;
  const char* from = msg.c_str() + at + elapsed_tag.size();
  char* end = nullptr;
  const double s = std::strtod(from, &end);
  if (end == from || std::string_view(end).rfind(" s]", 0) != 0) return std::nullopt;
  return s;
}

std::int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Rank `victim` stops itself (SIGSTOP) or dies (SIGKILL) once every survivor is inside its timed
// step; the others run an allreduce through `Reducer` and must fail, each quoting (quote_elapsed)
// how long after the victim's stop or death it failed. The victim writes its pid and the time
// of its end (steady_clock: one monotonic clock for every process on the machine) to
// `pid_file`; each survivor then kills a stopped victim, so that the run ends when they do.
// With `external_store` a process of its own serves the group's store, as ddprun does
// (init_options::external_store), until its clients are gone.
//
// The victim waits for the survivors' word (a byte each on a pipe) before it goes: a survivor
// still finishing the barrier before the step, descheduled on a busy machine, would otherwise
// fail in the barrier, outside the timed step and with no quote.
template <class Reducer>
std::vector<ddp_test::outcome> lose_a_rank(int n, int victim, int sig, std::chrono::milliseconds lease,
                                           bool external_store = false) {
  const int port = free_port();
  const std::string pid_file = "/tmp/ddp-heartbeat-victim-" + std::to_string(port);
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  constexpr int store_host = 100;
  std::vector<int> codes;
  for (int r = 0; r < n; ++r) codes.push_back(r);
  if (external_store) codes.push_back(store_host);
  auto outs = ddp_test::run_processes(codes, [&](int r) {
    if (r == store_host) {
      ddp::store_server server(ddp::endpoint{"127.0.0.1", port}, 0, nullptr, ddp::store_limits{}, "pg/rank/",
                               static_cast<std::uint32_t>(n));
      bool seen = false;
      for (int i = 0; i < 600; ++i) {  // 30 s at most
        std::this_thread::sleep_for(50ms);
        const auto c = server.clients();
        // A claim stores its seat's key: ranks faster than one look still count as seen.
        if (c > 0 || server.stored_bytes() > 0) seen = true;
        if (seen && c == 0) return;
      }
      return;
    }
    auto o = group_options(r, n, port, 60s);
    o.heartbeat = lease;
    o.external_store = external_store;
    auto pg = ddp::init_process_group(o);
    Reducer red{pg};
    std::vector<float> g(1 << 16, 1.0f);
    red.allreduce(std::span<float>(g), ddp::op::sum);  // a first step that every rank takes
    pg.barrier();
    if (r == victim) {
      for (int words = 0; words < n - 1;) {  // every survivor is in its step (20 s at most)
        pollfd p{ready[0], POLLIN, 0};
        if (::poll(&p, 1, 20000) <= 0) throw std::runtime_error("the survivors never reached their step");
        char c[8];
        const auto k = ::read(ready[0], c, std::min<std::size_t>(sizeof c, static_cast<std::size_t>(n - 1 - words)));
        if (k > 0) words += static_cast<int>(k);
      }
      std::ofstream(pid_file) << ::getpid() << " " << steady_ns() << "\n";
      ::raise(sig);
      return;
    }
    const auto t0 = steady_ns();
    if (::write(ready[1], "r", 1) != 1) throw std::runtime_error("could not tell the victim");
    try {
      red.allreduce(std::span<float>(g), ddp::op::sum);
    } catch (const ddp::error& e) {
      const auto failed = steady_ns();
      std::ifstream in(pid_file);
      pid_t pid = 0;
      std::int64_t gone = t0;  // the victim's end; the step's start where its record is missing
      if (in >> pid >> gone && pid > 0) ::kill(pid, SIGKILL);
      throw ddp::error(e.condition(), e.rank(), std::string(e.what()) + quote_elapsed(1e-9 * double(failed - gone)));
    }
    throw std::runtime_error("the step completed without rank " + std::to_string(victim));
  }, 40s);
  ::close(ready[0]);
  ::close(ready[1]);
  std::remove(pid_file.c_str());
  return outs;
}

// Every survivor (each rank but `victim`) raised one of `codes`, with one of `texts` in its
// message, and quoted (quote_elapsed) failing within `bound` seconds of the victim's end.
void check_survivors(const std::vector<ddp_test::outcome>& outs, int victim, std::vector<ddp::errc> codes,
                     std::vector<std::string> texts, std::chrono::duration<double> bound) {
  for (const auto& o : outs) {
    if (o.rank == victim || o.rank >= 100) continue;  // 100: the store's host
    CAPTURE(o.rank);
    CAPTURE(o.message);
    CHECK(std::any_of(codes.begin(), codes.end(), [&](ddp::errc c) { return o.errc == static_cast<int>(c); }));
    CHECK(std::any_of(texts.begin(), texts.end(),
                      [&](const std::string& t) { return o.message.find(t) != std::string::npos; }));
    const auto s = quoted_elapsed(o.message);
    CHECK_MESSAGE(s.has_value(), "the survivor failed outside its timed step");
    if (s) CHECK(*s < bound.count());
  }
}

// The lease of the frozen-rank cases: a survivor fails once the victim has been silent for a
// lease, then the aborts cascade; 3 leases bound both with room for a loaded machine, far below
// the collective timeout (60 s) that would end the step without a heartbeat.
constexpr std::chrono::milliseconds short_lease = 1000ms;
constexpr auto frozen_bound = 3 * short_lease;

}  // namespace

TEST_CASE("heartbeat: a frozen rank fails every survivor within the lease, naming it, though the timeout is 60 s") {
  for (int n : {2, 4}) {
    CAPTURE(n);
    SUBCASE("ring<tcp>") {
      auto outs = lose_a_rank<ddp::ring<ddp::tcp>>(n, 1, SIGSTOP, short_lease);
      INFO(summary(outs));
      check_survivors(outs, 1, {ddp::errc::timeout}, {"rank 1 stopped answering: no heartbeat for"}, frozen_bound);
    }
    SUBCASE("the default reducer (shared memory on one host)") {
      auto outs = lose_a_rank<ddp::auto_reducer>(n, 1, SIGSTOP, short_lease);
      INFO(summary(outs));
      check_survivors(outs, 1, {ddp::errc::timeout}, {"rank 1 stopped answering: no heartbeat for"}, frozen_bound);
    }
  }
}

TEST_CASE("heartbeat: rank 0, the store's host, frozen is found too") {
  // The group's store is on the frozen rank, so the watcher's verdict cannot be shared through
  // it: each survivor finds the store silent and names rank 0 lost, as soon as the watcher's
  // abort has woken it.
  auto outs = lose_a_rank<ddp::ring<ddp::tcp>>(3, 0, SIGSTOP, short_lease);
  INFO(summary(outs));
  check_survivors(outs, 0, {ddp::errc::timeout, ddp::errc::peer_lost}, {"rank 0 stopped answering", "rank 0 is lost"},
                  frozen_bound);
}

TEST_CASE("heartbeat: with the store served outside the ranks, a frozen rank 0's verdict reaches every survivor") {
  // As under ddprun, which serves the store itself: rank 0's loss leaves the failure record in
  // place, so every survivor raises the watcher's words, not "the store does not answer".
  auto outs = lose_a_rank<ddp::ring<ddp::tcp>>(3, 0, SIGSTOP, short_lease, true);
  INFO(summary(outs));
  check_survivors(outs, 0, {ddp::errc::timeout}, {"rank 0 stopped answering: no heartbeat for"}, frozen_bound);
  CHECK(outs[3].ok());  // the store's host
}

TEST_CASE("heartbeat: a killed rank fails every survivor at once") {
  // The lease is long (20 s) and the timeout longer (60 s): the step can end within a quarter
  // of the lease only because the death itself was seen (measured from the death: 1-11 ms, with
  // a busy loop on every core beside it; the quote in each message shows it).
  constexpr std::chrono::milliseconds lease = 20000ms;
  for (int n : {2, 4}) {
    CAPTURE(n);
    auto outs = lose_a_rank<ddp::auto_reducer>(n, 1, SIGKILL, lease);
    INFO(summary(outs));
    check_survivors(outs, 1, {ddp::errc::peer_lost}, {"rank 1"}, lease / 4);
  }
}

TEST_CASE("heartbeat: ranks that finish at different times are not taken for dead") {
  const int port = free_port();
  // Rank 2 closes its group first, saying goodbye to its successor, rank 0; ranks 0 and 1 keep
  // theirs open, and their heartbeat watches running, for five leases more, and must find
  // nothing wrong: no failure in the group's store (rank 0's), whose record any verdict writes.
  auto outs = run_ranks(3, [&](int r) {
    auto o = group_options(r, 3, port, 20s);
    o.heartbeat = 300ms;
    auto pg = ddp::init_process_group(o);
    ddp::ring<ddp::tcp> red{pg};
    std::vector<float> g(1000, 1.0f);
    red.allreduce(std::span<float>(g), ddp::op::sum);
    ddp_test::require(g[0] == 3.0f, "the allreduce is wrong");
    if (r == 2) return;  // closes its group now
    std::this_thread::sleep_for(1500ms);
    if (pg.store().check("pg/failure"))
      throw std::runtime_error("a failure was recorded: " + pg.store().get("pg/failure"));
  });
  expect_ok(outs);
}

TEST_CASE("heartbeat: every rank must run the same lease") {
  const int port = free_port();
  auto outs = run_ranks(2, [&](int r) {
    auto o = group_options(r, 2, port, 3s);
    o.heartbeat = r == 0 ? 1000ms : 0ms;
    auto pg = ddp::init_process_group(o);
  });
  INFO(summary(outs));
  CHECK(outs[1].errc == static_cast<int>(ddp::errc::mismatch));
  CHECK(outs[1].message.find("heartbeat mismatch: rank 0 runs a heartbeat lease of 1000 ms, rank 1 one of 0 ms") !=
        std::string::npos);
  CHECK(!outs[0].ok());  // rank 1 never arrived
}

TEST_CASE("heartbeat: a negative lease is refused; DDP_HEARTBEAT_MS and DDP_EXTERNAL_STORE set the options") {
  ddp::init_options o;
  o.heartbeat = -5ms;
  CHECK(o.validate().find("heartbeat must not be negative") != std::string::npos);
  const auto e = ddp::init_options::from_env([](const char* k) -> const char* {
    const std::string key = k;
    return key == "DDP_HEARTBEAT_MS" ? "1500" : key == "DDP_EXTERNAL_STORE" ? "1" : nullptr;
  });
  CHECK(e.heartbeat == 1500ms);
  CHECK(e.external_store);
  CHECK(!ddp::init_options{}.external_store);
}

TEST_CASE("heartbeat: a goodbye after a failure fails the successor's group, without taking the rank for dead") {
  // The watch of one rank over socket pairs: its predecessor's end and its successor's end.
  using call = std::tuple<ddp::errc, std::string, bool>;  // on_lost's code, text and `dead`
  struct seen {
    std::mutex mu;
    std::vector<call> calls;
  };
  ddp::detail::reactor loop{0, "test"};
  const auto watch = [&loop](int pred_fd, int succ_fd, seen& s, bool failed) {
    return std::make_unique<ddp::detail::heartbeat_watch>(
        loop, pred_fd, 3, succ_fd, 2000ms,
        [&s](ddp::errc c, const std::string& t, bool dead) {
          std::lock_guard lock(s.mu);
          s.calls.emplace_back(c, t, dead);
        },
        [failed] { return failed; });
  };
  const auto pair = [] {
    int fd[2];
    REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, fd) == 0);
    return std::array<ddp::detail::fd_handle, 2>{ddp::detail::fd_handle(fd[0]), ddp::detail::fd_handle(fd[1])};
  };
  // The one call on_lost made, waiting up to a second for it.
  const auto only_call = [](seen& s) {
    for (int i = 0; i < 200; ++i) {
      {
        std::lock_guard lock(s.mu);
        if (!s.calls.empty()) break;
      }
      std::this_thread::sleep_for(5ms);
    }
    std::lock_guard lock(s.mu);
    REQUIRE(s.calls.size() == 1);
    return s.calls[0];
  };
  const auto read_word = [](int fd) {
    char buf[64];
    std::string got;
    for (int i = 0; i < 200; ++i) {
      const auto k = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      if (k > 0) got.append(buf, static_cast<std::size_t>(k));
      if (got.find_first_of("bf") != std::string::npos) break;
      std::this_thread::sleep_for(5ms);
    }
    return got.find('f') != std::string::npos ? 'f' : got.find('b') != std::string::npos ? 'b' : '?';
  };
  const auto p = pair(), q = pair();

  SUBCASE("the predecessor left after a failure: aborted, not dead") {
    seen s;
    auto w = watch(p[0].get(), q[0].get(), s, false);
    const char f = ddp::detail::heartbeat_watch::goodbye_failed;
    REQUIRE(::send(p[1].get(), &f, 1, MSG_NOSIGNAL) == 1);
    const auto [code, text, dead] = only_call(s);
    CHECK(code == ddp::errc::aborted);
    CHECK(text.find("rank 3 left the group after it failed") != std::string::npos);
    CHECK_FALSE(dead);
  }
  SUBCASE("a normal goodbye is no failure; the end of the connection without one is a death") {
    seen s;
    auto w = watch(p[0].get(), q[0].get(), s, false);
    const char b = ddp::detail::heartbeat_watch::goodbye;
    REQUIRE(::send(p[1].get(), &b, 1, MSG_NOSIGNAL) == 1);
    std::this_thread::sleep_for(100ms);
    {
      std::lock_guard lock(s.mu);
      CHECK(s.calls.empty());
    }
    w.reset();
    auto p2 = pair();
    auto w2 = watch(p2[0].get(), q[0].get(), s, false);
    p2[1].reset();
    const auto [code, text, dead] = only_call(s);
    CHECK(code == ddp::errc::peer_lost);
    CHECK(dead);
  }
  SUBCASE("this rank's goodbye says whether its group failed") {
    for (const bool f : {false, true}) {
      CAPTURE(f);
      const auto q2 = pair();
      seen s;
      auto w = watch(p[0].get(), q2[0].get(), s, f);
      w->leave(10ms);
      CHECK(read_word(q2[1].get()) == (f ? 'f' : 'b'));
    }
  }
}
