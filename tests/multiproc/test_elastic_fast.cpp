// Fast re-formation (docs/elastic.md, "Re-forming without a broadcast" and "Re-forming in the
// same memory"), in real processes over a store served outside the ranks: when every member of
// a new generation holds the state of the same committed step (survivors only), the wrappers
// built in on_form compare hashes of their values instead of broadcasting rank 0's
// (`construction()` says so), and the weights stay bitwise equal; a member whose values differ
// anyway gets rank 0's by a broadcast, which the construction reports; a newcomer's generation
// broadcasts as before. The survivors' shared-memory reducer takes over the last generation's
// segment (again after a second loss), unless a rank of it may still write there (frozen, not
// dead) or a newcomer joins.

#include <ddp/ddp.hpp>
#include <ddp/group/elastic.hpp>
#include <ddp/store.hpp>

#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"

using namespace std::chrono_literals;
using ddp_test::free_port;
using ddp_test::group_options;
using ddp_test::require;
using ddp_test::summary;

namespace {

constexpr int store_host = 100;  // the process that serves the store
constexpr int newcomer = 50;     // starts late and joins the running group
constexpr std::size_t count = 4096;

struct plan {
  int n = 4;
  int min = 2, max = 4;
  int victim = -1;   // SIGKILLs (or stops: sig) itself as step fail_at begins
  int sig = SIGKILL;
  int fail_at = 4;
  std::vector<std::pair<int, int>> kills;  // more ranks SIGKILLed: (rank, as this step begins)
  int steps = 10;
  int skewed = -1;   // nudges one of its weights by one ulp before its re-formed wrapper is built
  bool late = false;  // a newcomer joins after the first steps
  std::chrono::milliseconds step_pause{0};
  ddp::backend backend = ddp::backend::automatic;
};

// Serves the group's store until `finishers` processes have said they are done (test/done), at
// most 40 s.
void serve_store(int port, int finishers) {
  ddp::store_server server(ddp::endpoint{"127.0.0.1", port}, 0, nullptr, ddp::store_limits{}, "pg/rank/", 0);
  ddp::store_client probe("127.0.0.1", port, store_host, ddp::detail::clock::now() + 5s);
  (void)probe.compare_set("pg/rank/el.store_host", "", "1", ddp::detail::clock::now() + 5s);  // a seat: it writes
  for (int i = 0; i < 4000; ++i) {
    if (probe.add("test/done", 0, ddp::detail::clock::now() + 5s) >= finishers) break;
    std::this_thread::sleep_for(10ms);
  }
  std::this_thread::sleep_for(100ms);  // the last ones' goodbyes
}

std::string pid_file(int port) { return "/tmp/ddp-elastic-fast-victim-" + std::to_string(port); }

std::uint64_t hash_of(const std::vector<float>& w) { return ddp::detail::xxh64::of(w.data(), w.size() * sizeof(float)); }

// One process: trains `p.steps` committed steps of w -= 0.01 * avg(rank + 1) from its own initial
// weights (1 + code: only a broadcast makes them equal), and reports what each generation's
// wrapper construction did: "gen <g> compared <0|1> differed <0|1> bytes <n> ranks <r,...>;".
void member(const plan& p, int code, int port) {
  const bool is_newcomer = code == newcomer;
  auto o = group_options(is_newcomer ? 0 : code, p.n, port, 30s, p.backend);
  o.elastic_min = p.min;
  o.elastic_max = p.max;
  o.heartbeat = 500ms;
  o.external_store = true;
  if (is_newcomer) std::this_thread::sleep_for(1000ms);
  ddp::elastic_group eg{o};
  std::vector<float> w(count, 1.0f + static_cast<float>(code)), g(count, 0.0f);
  std::vector<ddp::tensor_view> params{ddp::make_tensor_view(w, g, "w")};
  std::optional<ddp::data_parallel> dp;
  std::string built;
  eg.on_form([&](ddp::process_group& pg) {
    dp.reset();
    // A broken promise, injected: this member's weights differ from everyone's by one ulp.
    if (code == p.skewed && eg.generation() > 0) w[100] = std::nextafter(w[100], 10.0f);
    dp.emplace(pg, params);
    const auto& c = dp->construction();
    std::string ranks;
    for (int r : c.differing) ranks += (ranks.empty() ? "" : ",") + std::to_string(r);
    built += "gen " + std::to_string(eg.generation()) + " compared " + std::to_string(c.hashes_compared ? 1 : 0) +
             " differed " + std::to_string(c.hashes_differed ? 1 : 0) + " bytes " +
             std::to_string(c.bytes_broadcast) + " ranks " + (ranks.empty() ? "-" : ranks) + " expects " +
             std::to_string(pg.expects_equal_state() ? 1 : 0) + " reused " +
             std::to_string(dp->get_reducer().segment() ? (dp->get_reducer().segment()->reused_segment() ? 1 : 0) : -1) +
             ";";
  });
  if (!eg.start()) throw std::runtime_error("the job finished before this process got a seat");
  bool failed_once = false;
  while (eg.step() < static_cast<std::uint64_t>(p.steps)) try {
      if (code == p.victim && !failed_once && eg.step() == static_cast<std::uint64_t>(p.fail_at)) {
        failed_once = true;
        std::ofstream(pid_file(port)) << ::getpid() << "\n";
        ::raise(p.sig);
      }
      for (const auto& [who, at] : p.kills)
        if (code == who && eg.step() == static_cast<std::uint64_t>(at)) ::raise(SIGKILL);
      if (p.step_pause.count() > 0) std::this_thread::sleep_for(p.step_pause);
      std::fill(g.begin(), g.end(), static_cast<float>(eg.rank() + 1));
      dp->grad_ready(0);
      dp->finish();
      eg.commit([&] {
        for (auto& v : w) v -= 0.01f * g[0];
      });
    } catch (const ddp::error& e) {
      if (!eg.recover(e)) throw std::runtime_error("the job finished without this rank");
    }
  // Every rank holds the same bits, and every element the same value (each step moved all
  // alike from rank 0's uniform start): the skewed element holds rank 0's bits again.
  char mine[32];
  std::snprintf(mine, sizeof mine, "%016llx", static_cast<unsigned long long>(hash_of(w)));
  const auto all = eg.group().all_gather(mine);
  for (const auto& h : all) require(h == all[0], "weights differ across ranks: " + h + " and " + all[0]);
  require(std::memcmp(&w[100], &w[0], sizeof(float)) == 0, "w[100] is not w[0]: " + std::to_string(w[100]));
  eg.group().barrier();
  eg.finish();
  // Done, said to the store's host (a client of its own, with a seat: the group's keys are
  // under the generation's prefix).
  ddp::store_client done("127.0.0.1", port, code, ddp::detail::clock::now() + 5s, nullptr, true);
  (void)done.compare_set("pg/rank/el.done" + std::to_string(code), "", "1", ddp::detail::clock::now() + 5s);
  (void)done.add("test/done", 1, ddp::detail::clock::now() + 5s);
  throw ddp::error(ddp::errc::aborted, eg.rank(),
                   "report " + std::to_string(eg.rank()) + " " + std::to_string(eg.size()) + " " +
                       std::to_string(eg.generation()) + " [" + built + "]");
}

std::vector<ddp_test::outcome> run(const plan& p) {
  const int port = free_port();
  std::vector<int> codes{store_host};
  for (int r = 0; r < p.n; ++r) codes.push_back(r);
  if (p.late) codes.push_back(newcomer);
  auto outs = ddp_test::run_processes(
      codes,
      [&](int code) {
        if (code == store_host)
          return serve_store(port, p.n + (p.late ? 1 : 0) - (p.victim >= 0 ? 1 : 0) - static_cast<int>(p.kills.size()));
        try {
          member(p, code, port);
        } catch (...) {
          // A frozen victim is ended once a survivor is done with it.
          if (code != p.victim && p.sig == SIGSTOP) {
            std::ifstream in(pid_file(port));
            pid_t pid = 0;
            if (in >> pid && pid > 0) ::kill(pid, SIGKILL);
          }
          throw;
        }
      },
      60s);
  std::remove(pid_file(port).c_str());
  return outs;
}

struct construction {
  int gen = -1, compared = -1, differed = -1;
  std::size_t bytes = 0;
  std::string ranks;
  int expects = -1;
  int reused = -2;  // the shared-memory reducer took over the last generation's segment; -1: no segment
};

struct report {
  int rank = -1, size = 0, generation = -1;
  std::vector<construction> built;  // one per generation this process formed
};

report report_of(const ddp_test::outcome& o) {
  report r;
  const auto at = o.message.find("report ");
  if (at == std::string::npos) return r;
  std::istringstream in(o.message.substr(at + 7));
  in >> r.rank >> r.size >> r.generation;
  const auto open = o.message.find('[', at), close = o.message.find(']', at);
  if (open == std::string::npos || close == std::string::npos) return r;
  std::istringstream list(o.message.substr(open + 1, close - open - 1));
  for (std::string item; std::getline(list, item, ';');) {
    construction c;
    char ranks[64] = {};
    unsigned long long bytes = 0;
    if (std::sscanf(item.c_str(), " gen %d compared %d differed %d bytes %llu ranks %63s expects %d reused %d", &c.gen,
                    &c.compared, &c.differed, &bytes, ranks, &c.expects, &c.reused) == 7) {
      c.bytes = static_cast<std::size_t>(bytes);
      c.ranks = ranks;
      r.built.push_back(c);
    }
  }
  return r;
}

// The reports of every process but the store's and the victims'.
std::vector<report> members(const std::vector<ddp_test::outcome>& outs, int victim, std::vector<int> also = {}) {
  std::vector<report> rs;
  for (const auto& o : outs) {
    if (o.rank == store_host || o.rank == victim || std::find(also.begin(), also.end(), o.rank) != also.end())
      continue;
    CAPTURE(o.rank);
    CAPTURE(o.message);
    const auto r = report_of(o);
    CHECK(r.rank >= 0);
    rs.push_back(r);
  }
  return rs;
}

constexpr std::size_t all_bytes = count * sizeof(float);

}  // namespace

TEST_CASE("elastic fast: the survivors of a SIGKILL compare hashes; nothing is broadcast and the bits stay equal") {
  for (auto b : {ddp::backend::automatic, ddp::backend::tcp}) {
    CAPTURE(static_cast<int>(b));
    plan p;
    p.victim = 2;
    p.backend = b;
    const auto outs = run(p);
    INFO(summary(outs));
    const auto rs = members(outs, p.victim);
    REQUIRE(rs.size() == 3);
    for (const auto& r : rs) {
      CHECK(r.size == 3);
      REQUIRE(r.built.size() == 2);
      // The first generation: each rank's own initial weights, rank 0's broadcast.
      CHECK(r.built[0].gen == 0);
      CHECK(r.built[0].expects == 0);
      CHECK(r.built[0].compared == 0);
      CHECK(r.built[0].bytes == all_bytes);
      // The survivors: equal state expected, hashes compared and equal, nothing broadcast.
      CHECK(r.built[1].gen == 1);
      CHECK(r.built[1].expects == 1);
      CHECK(r.built[1].compared == 1);
      CHECK(r.built[1].differed == 0);
      CHECK(r.built[1].bytes == 0);
      // On one host the default reducer is ring<shm>: the survivors' takes the last
      // generation's segment over (the victim is dead); tcp has none.
      CHECK(r.built[0].reused == (b == ddp::backend::automatic ? 0 : -1));
      CHECK(r.built[1].reused == (b == ddp::backend::automatic ? 1 : -1));
    }
  }
}

TEST_CASE("elastic fast: a segment taken over is taken over again after a second loss, and reduces right") {
  plan p;
  p.victim = 1;
  p.fail_at = 3;
  p.kills = {{3, 6}};
  p.steps = 12;
  const auto outs = run(p);
  INFO(summary(outs));
  const auto rs = members(outs, p.victim, {3});
  REQUIRE(rs.size() == 2);
  for (const auto& r : rs) {
    CHECK(r.size == 2);
    REQUIRE(r.built.size() == 3);
    for (int g = 1; g <= 2; ++g) {
      CAPTURE(g);
      CHECK(r.built[static_cast<std::size_t>(g)].gen == g);
      CHECK(r.built[static_cast<std::size_t>(g)].bytes == 0);
      CHECK(r.built[static_cast<std::size_t>(g)].reused == 1);
    }
  }
}

TEST_CASE("elastic fast: a frozen rank of the last generation may still write there: a new segment is made") {
  plan p;
  p.victim = 2;
  p.sig = SIGSTOP;
  const auto outs = run(p);
  INFO(summary(outs));
  const auto rs = members(outs, p.victim);
  REQUIRE(rs.size() == 3);
  for (const auto& r : rs) {
    REQUIRE(r.built.size() == 2);
    // The survivors hold equal state (the frozen rank is no member), but its pid lives.
    CHECK(r.built[1].compared == 1);
    CHECK(r.built[1].bytes == 0);
    CHECK(r.built[1].reused == 0);
  }
}

TEST_CASE("elastic fast: a survivor whose weights differ gets rank 0's by a broadcast, and the construction says so") {
  plan p;
  p.victim = 1;
  p.skewed = 3;  // rank 2 of the survivors' generation
  const auto outs = run(p);
  INFO(summary(outs));
  const auto rs = members(outs, p.victim);
  REQUIRE(rs.size() == 3);
  for (const auto& r : rs) {
    REQUIRE(r.built.size() == 2);
    CHECK(r.built[1].expects == 1);
    CHECK(r.built[1].compared == 1);
    CHECK(r.built[1].differed == 1);
    CHECK(r.built[1].ranks == "2");
    CHECK(r.built[1].bytes == all_bytes);
  }
}

TEST_CASE("elastic fast: a generation with a newcomer broadcasts rank 0's values, as before") {
  plan p;
  p.n = 2;
  p.max = 3;
  p.steps = 60;
  p.late = true;
  p.step_pause = 30ms;  // about 2 s: the newcomer comes after 1 s
  const auto outs = run(p);
  INFO(summary(outs));
  const auto rs = members(outs, -1);
  REQUIRE(rs.size() == 3);
  for (const auto& r : rs) {
    CHECK(r.size == 3);
    REQUIRE_FALSE(r.built.empty());
    const auto& last = r.built.back();
    CHECK(last.gen == 1);
    CHECK(last.expects == 0);
    CHECK(last.compared == 0);
    CHECK(last.bytes == all_bytes);
    CHECK(last.reused == 0);  // the newcomer holds no segment of the last generation
  }
}
