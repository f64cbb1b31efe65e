// Joining at scale: 5000 simulated ranks (more than the 4096 fields a store frame holds) run
// the store half of joining a group, ddp::detail::join_store, against one real store_server,
// each over its own store_client socket, from a few forked processes with one thread per rank.
//
// The old rendezvous had every rank wait for world + 1 keys in one request, which no store
// frame holds past 4095 ranks. Building this file with -DDDP_TEST_OLD_RENDEZVOUS against the
// headers before join_store (git archive f6daf95~1 include) runs that protocol instead, and
// the first case fails there.
#include <ddp/store.hpp>
#ifndef DDP_TEST_OLD_RENDEZVOUS
#include <ddp/group/detail/rendezvous.hpp>
#endif

#include <doctest/doctest.h>

#include <pthread.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "harness.hpp"

using namespace std::chrono_literals;

namespace {

constexpr int world = 5000;
constexpr int procs = 4;

/// The join under test: join_store, or (for the comparison) the old protocol's store requests.
std::uint64_t join(ddp::store_client& st, int rank, int port, std::chrono::milliseconds timeout,
                   ddp::detail::deadline_t until) {
#ifndef DDP_TEST_OLD_RENDEZVOUS
  return ddp::detail::join_store(st, {rank, world, "", "127.0.0.1:" + std::to_string(port), timeout.count()}, until);
#else
  (void)port;
  (void)timeout;
  const std::string rk = "pg/rank/" + std::to_string(rank);
  if (rank == 0) st.set("pg/job", std::to_string(world) + " ", until);
  else if (!st.wait({"pg/job"}, until).empty()) ddp::detail::raise(ddp::errc::timeout, rank, "no job");
  st.compare_set(rk, "", "token" + std::to_string(rank), until);
  if (rank == 0) st.set("pg/id", ddp::detail::encode_i64(42), until);
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back("pg/rank/" + std::to_string(r));
  if (auto missing = st.wait(keys, until); !missing.empty())
    ddp::detail::raise(ddp::errc::timeout, rank, std::to_string(missing.size()) + " ranks never arrived");
  return static_cast<std::uint64_t>(ddp::detail::decode_i64(st.get("pg/id", until)));
#endif
}

/// What each simulated rank leaves for the test process to check (shared memory).
struct rank_result {
  std::uint64_t group;
  int errc;     // 0: joined
  int elapsed_ms;
  char message[400];
};

/// Shared between the test process and its children; unmapped when the case ends.
struct shared_results {
  static constexpr std::size_t size = sizeof(rank_result) * world + 64;
  rank_result* r;
  int* connected;  // child processes done connecting (the start line for all)
  shared_results() {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    REQUIRE(p != MAP_FAILED);
    std::memset(p, 0, size);
    r = static_cast<rank_result*>(p);
    connected = reinterpret_cast<int*>(r + world);
  }
  ~shared_results() { ::munmap(r, size); }
};

/// Raises RLIMIT_NOFILE's soft limit to the hard one; false when even that cannot hold a store
/// with one connection per simulated rank.
bool enough_descriptors() {
  rlimit r{};
  ::getrlimit(RLIMIT_NOFILE, &r);
  r.rlim_cur = r.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &r);
  if (r.rlim_cur >= static_cast<rlim_t>(world) + 256) return true;
  WARN_MESSAGE(false, "skipped: the store needs " << world + 256 << " descriptors and RLIMIT_NOFILE's hard limit is "
                                                  << r.rlim_max);
  return false;
}

struct sim_rank {
  int rank;
  int port;
  std::chrono::milliseconds timeout;
  ddp::detail::deadline_t until;
  std::unique_ptr<ddp::store_client> st;
  rank_result* out;
};

void* run_rank(void* arg) {
  auto& s = *static_cast<sim_rank*>(arg);
  const auto t0 = ddp::detail::clock::now();
  try {
    s.out->group = join(*s.st, s.rank, s.port, s.timeout, s.until);
  } catch (const ddp::error& e) {
    s.out->errc = e.code().value();
    std::snprintf(s.out->message, sizeof s.out->message, "%s", e.what());
  } catch (const std::exception& e) {
    s.out->errc = -1;
    std::snprintf(s.out->message, sizeof s.out->message, "%s", e.what());
  }
  s.out->elapsed_ms = static_cast<int>(
      std::chrono::duration_cast<std::chrono::milliseconds>(ddp::detail::clock::now() - t0).count());
  return nullptr;
}

/// Child process `p`: connects its share of ranks one at a time (this case is about the
/// protocol, not the kernel's accept queue: bench/store_scale connects them all at once), then
/// runs them all at once, one thread each, with the same deadline in every process.
void drive(int p, int port, const std::vector<int>& absent, std::chrono::milliseconds timeout, shared_results& sh) {
  rank_result* out = sh.r;
  const auto until = ddp::detail::clock::now() + timeout + 30s;  // connecting is not the case's deadline
  std::vector<sim_rank> ranks;
  ranks.reserve(world / procs + 1);
  for (int r = p; r < world; r += procs)
    if (std::find(absent.begin(), absent.end(), r) == absent.end()) {
      ranks.push_back({r, port, timeout, {}, std::make_unique<ddp::store_client>("127.0.0.1", port, r, until), &out[r]});
      // Connected once the store answers on it: a few connections wait for the store to accept
      // them at a time, never more than its listen backlog holds.
      ranks.back().st->check("pg/none", until);
    }
  pthread_attr_t attr;
  ::pthread_attr_init(&attr);
  ::pthread_attr_setstacksize(&attr, 256 * 1024);
  std::vector<pthread_t> ids(ranks.size());
  // Every process connected all its ranks: the deadline starts for all at once.
  std::atomic_ref<int> connected(*sh.connected);
  connected.fetch_add(1);
  while (connected.load() < procs) std::this_thread::sleep_for(1ms);
  const auto join_until = ddp::detail::clock::now() + timeout;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    ranks[i].until = join_until;
    if (::pthread_create(&ids[i], &attr, run_rank, &ranks[i]) != 0)
      throw std::runtime_error("pthread_create failed at rank " + std::to_string(ranks[i].rank));
  }
  for (auto id : ids) ::pthread_join(id, nullptr);
}

}  // namespace

TEST_CASE("5000 ranks join through one store: every rank gets the group id, no frame or limit in the way") {
  if (!enough_descriptors()) return;
  ddp::store_server server{ddp::endpoint{"127.0.0.1", 0}, 0};
  shared_results res;
  const int port = server.port();
  std::vector<int> procs_list;
  for (int p = 0; p < procs; ++p) procs_list.push_back(p);
  const auto outs = ddp_test::run_processes(
      procs_list, [&](int p) { drive(p, port, {}, 20s, res); }, 60s);
  INFO(ddp_test::summary(outs));
  REQUIRE(ddp_test::all_ok(outs));
  int joined = 0;
  std::string first_failure;
  for (int r = 0; r < world; ++r) {
    if (res.r[r].errc == 0 && res.r[r].group != 0 && res.r[r].group == res.r[0].group) ++joined;
    else if (first_failure.empty())
      first_failure = "rank " + std::to_string(r) + ": errc " + std::to_string(res.r[r].errc) + " " + res.r[r].message;
  }
  INFO(first_failure);
  CHECK(joined == world);
  CHECK(res.r[0].group != 0);
  // The store kept every client: none dropped for a frame or a buffer limit, none shed for
  // want of descriptors.
  CHECK(server.dropped() == 0);
  CHECK(server.shed() == 0);
  int slowest = 0;
  for (int r = 0; r < world; ++r) slowest = std::max(slowest, res.r[r].elapsed_ms);
  MESSAGE("slowest join_store: " << slowest << " ms");
}

TEST_CASE("3 of 5000 ranks never arrive: every rank fails within the timeout, rank 0 names the missing") {
  if (!enough_descriptors()) return;
  ddp::store_server server{ddp::endpoint{"127.0.0.1", 0}, 0};
  shared_results res;
  const int port = server.port();
  const std::vector<int> absent{17, 2500, 4999};
  const auto timeout = 3000ms;
  std::vector<int> procs_list;
  for (int p = 0; p < procs; ++p) procs_list.push_back(p);
  const auto outs = ddp_test::run_processes(
      procs_list, [&](int p) { drive(p, port, absent, timeout, res); }, 60s);
  INFO(ddp_test::summary(outs));
  REQUIRE(ddp_test::all_ok(outs));
  const std::string named = "ranks 17, 2500, 4999 of 5000 never arrived";
  INFO("rank 0: " << res.r[0].message);
  CHECK(res.r[0].errc == static_cast<int>(ddp::errc::timeout));
  CHECK(std::string(res.r[0].message).find(named) != std::string::npos);
  int quoted = 0, unnamed = 0, wrong = 0, late = 0;
  std::string first_wrong;
  for (int r = 1; r < world; ++r) {
    if (std::find(absent.begin(), absent.end(), r) != absent.end()) continue;
    const std::string m = res.r[r].message;
    const bool timed_out = res.r[r].errc == static_cast<int>(ddp::errc::timeout) &&
                           m.find("rendezvous timed out after 3000 ms") != std::string::npos;
    if (timed_out && m.find(named) != std::string::npos) ++quoted;
    // A rank whose store connection could not bring rank 0's list in time (a loaded machine,
    // thousands of answers due at once) still says that the rendezvous timed out.
    else if (timed_out && m.find("not every rank of 5000 arrived") != std::string::npos) ++unnamed;
    else if (wrong++ == 0) first_wrong = "rank " + std::to_string(r) + ": errc " + std::to_string(res.r[r].errc) + " " + m;
    // The deadline, then at most the 2 s the naming may take, and a margin for a loaded machine.
    if (res.r[r].elapsed_ms > 3000 + 2000 + 3000) ++late;
  }
  INFO(first_wrong);
  CHECK(wrong == 0);
  // The ranks quote rank 0's list, which it posts as it times out: every one on a quiet machine;
  // on a loaded one, a few of the 4,996 answers due at once may come too late to carry it.
  CHECK(quoted + unnamed == world - 1 - static_cast<int>(absent.size()));
  CHECK(quoted >= (world - 1 - static_cast<int>(absent.size())) * 9 / 10);
  CHECK(late == 0);
  CHECK(res.r[0].elapsed_ms <= 3000 + 2000 + 3000);
  MESSAGE("ranks quoting rank 0's list: " << quoted << ", saying only that ranks are missing: " << unnamed);
}
