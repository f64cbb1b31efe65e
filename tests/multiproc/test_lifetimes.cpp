#include <ddp/process_group.hpp>

#include <ddp/data_parallel.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/tree.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/transport/tcp.hpp>

#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "harness.hpp"
#include "toy_model.hpp"

// Who owns what: the group lives as long as any handle on it (the program's, or one a reducer,
// transport or wrapper keeps), and a forked child's copies touch nothing of the parent's. Run
// under AddressSanitizer by scripts/asan_quick.sh: the group is kept on the heap here so that a
// holder that still read the program's handle after it is gone is a heap-use-after-free.

using namespace std::chrono_literals;
using namespace ddp_test;

namespace {

constexpr ddp_test::local_group opts{20s};

// Rank r contributes r + 1 + j / 8 at j; the sum over n ranks is exact in f32.
std::vector<float> contribution(int r, std::size_t count) {
  std::vector<float> v(count);
  for (std::size_t j = 0; j < count; ++j) v[j] = static_cast<float>(r + 1) + static_cast<float>(j % 64) / 8.0f;
  return v;
}

void require_sum(const std::vector<float>& v, int n, const std::string& what) {
  for (std::size_t j = 0; j < v.size(); ++j) {
    const float want = static_cast<float>(n * (n + 1) / 2) + static_cast<float>(n) * static_cast<float>(j % 64) / 8.0f;
    if (v[j] != want)
      throw std::runtime_error(what + ": element " + std::to_string(j) + " is " + std::to_string(v[j]) + ", not " +
                               std::to_string(want));
  }
}

// A small model: a few f32 parameters, each with its own gradient buffer, values 1.
struct model : toy_model {
  explicit model(const std::vector<std::size_t>& sizes) : toy_model(sizes) { fill_data(1.0); }
};

// Step s of rank r: gradient i, element j is (r + 1) * (s + 1) + i + j % 8, marked ready in
// reverse order (as backward produces them).
template <class DP>
void backward(DP& dp, model& m, int r, int s) {
  for (std::size_t i = m.size(); i-- > 0;) {
    for (std::size_t j = 0; j < m.numel(i); ++j)
      m.grad<float>(i)[j] = static_cast<float>((r + 1) * (s + 1) + static_cast<int>(i) + static_cast<int>(j % 8));
    dp.grad_ready(i);
  }
}

void require_average(const model& m, int n, int s, const std::string& what) {
  for (std::size_t i = 0; i < m.size(); ++i)
    for (std::size_t j = 0; j < m.numel(i); ++j) {
      // mean over r of (r + 1)(s + 1) is (n + 1)(s + 1) / 2
      const double want = (n + 1) * (s + 1) / 2.0 + static_cast<double>(i) + static_cast<double>(j % 8);
      if (static_cast<double>(m.grad<float>(i)[j]) != want)
        throw std::runtime_error(what + ": gradient " + std::to_string(i) + "[" + std::to_string(j) + "] is " +
                                 std::to_string(m.grad<float>(i)[j]) + ", not " + std::to_string(want));
    }
}

template <class Reducer>
void reducer_outlives_group(int n, bool with_failure) {
  const int port = free_port();
  auto outs = run_ranks(n, [&](int r) {
    auto pg = std::make_unique<ddp::process_group>(ddp::init_process_group(opts(r, n, port, 10s)));
    Reducer red{*pg};
    pg.reset();  // the program lets go of its handle; the reducer keeps the group
    for (int k = 0; k < 3; ++k) {
      auto v = contribution(r, 100000);
      red.allreduce(std::span<float>(v), ddp::op::sum);
      require_sum(v, n, "allreduce " + std::to_string(k) + " after the program's handle is gone");
    }
    // The group itself is still there, store included.
    red.group().barrier();
    red.group().store().set("lifetimes/" + std::to_string(r), "here");
    for (int q = 0; q < n; ++q) require(red.group().store().get("lifetimes/" + std::to_string(q)) == "here", "store");
    red.group().barrier();
    if (!with_failure) return;
    // A failure still finds the group's store and names the rank that left.
    if (r == n - 1) return;
    auto v = contribution(r, 1000);
    require_raises([&] { red.allreduce(std::span<float>(v), ddp::op::sum); }, ddp::errc::peer_lost,
                   {"rank " + std::to_string(n - 1)}, "allreduce after rank " + std::to_string(n - 1) + " left");
  }, 60s);
  expect_ok(outs);
}

}  // namespace

TEST_CASE("a reducer outlives the program's process_group handle: it keeps working, failures still name the rank") {
  SUBCASE("ring<tcp>") { reducer_outlives_group<ddp::ring<ddp::tcp>>(3, true); }
  SUBCASE("tree<tcp>") { reducer_outlives_group<ddp::tree<ddp::tcp>>(3, true); }
  SUBCASE("ring<shm>") { reducer_outlives_group<ddp::ring<ddp::shm>>(3, false); }
}

TEST_CASE("data_parallel: finish() after the program's process_group handle is destroyed") {
  const int n = 2, port = free_port();
  auto outs = run_ranks(n, [&](int r) {
    auto pg = std::make_unique<ddp::process_group>(ddp::init_process_group(opts(r, n, port, 10s)));
    model m({1000, 17, 4096, 3});
    ddp::data_parallel dp{*pg, m.views, ddp::bucket_policy{.cap_bytes = 8192, .first_cap_bytes = 4096}};
    pg.reset();
    for (int s = 0; s < 3; ++s) {
      backward(dp, m, r, s);
      dp.finish();
      require_average(m, n, s, "step " + std::to_string(s));
    }
    require(dp.group().rank() == r && dp.group().size() == n, "the wrapper's handle names the group");
  }, 60s);
  expect_ok(outs);
}

TEST_CASE("collectives in flight on the progress thread while the program's handle is destroyed") {
  const int n = 2, port = free_port();
  auto outs = run_ranks(n, [&](int r) {
    auto pg = std::make_unique<ddp::process_group>(ddp::init_process_group(opts(r, n, port, 10s)));
    ddp::ring<ddp::tcp> red{*pg};
    // Rank 1 comes late, so rank 0's requests are still queued on its progress thread when its
    // handle goes; each one reads the group's timeout as it starts.
    if (r == 1) std::this_thread::sleep_for(300ms);
    auto big = contribution(r, 2 << 20), small = contribution(r, 1000);
    auto a = red.allreduce_async(std::span<float>(big), ddp::op::sum);
    auto b = red.allreduce_async(std::span<float>(small), ddp::op::sum);
    auto c = red.barrier_async();
    pg.reset();
    const auto until = std::chrono::steady_clock::now() + 30s;
    a.wait(until);
    b.wait(until);
    c.wait(until);
    require_sum(big, n, "big allreduce");
    require_sum(small, n, "small allreduce");
  }, 60s);
  expect_ok(outs);
}

TEST_CASE("moving or copying the process_group after building a reducer") {
  const int n = 2;
  expect_ok(on_ranks(n, local_group{10s}, [&](int r, ddp::process_group& pg) {
    ddp::ring<ddp::tcp> red{pg};
    ddp::process_group moved = std::move(pg);
    // The moved-from handle is empty and says so.
    require(pg.rank() == -1 && pg.size() == 0, "a moved-from handle reports rank -1, size 0");
    require_raises([&] { pg.barrier(); }, ddp::errc::usage, {"empty process_group handle"}, "barrier() on it");
    require_raises([&] { pg.store(); }, ddp::errc::usage, {"empty process_group handle"}, "store() on it");
    pg.abort("ignored");  // a no-op on an empty handle
    auto v = contribution(r, 50000);
    red.allreduce(std::span<float>(v), ddp::op::sum);
    require_sum(v, n, "allreduce after the move");
    red.group().barrier();
    moved.barrier();
    // Copies are handles on the same group: closing one leaves the others working.
    [&](auto& g) {
      if constexpr (std::is_copy_constructible_v<std::remove_cvref_t<decltype(g)>>) {
        auto copy = g;
        require(copy.rank() == r && copy.id() == g.id(), "a copy is the same group");
        copy.close();
        require_raises([&] { copy.barrier(); }, ddp::errc::usage, {"empty process_group handle"},
                       "barrier() after close()");
        g.barrier();
      } else {
        throw std::runtime_error("process_group handles cannot be copied");
      }
    }(moved);
    // abort() goes through the reducer's own handle on the group's store.
    if (r == 0) {
      red.abort();
      require_raises([&] { red.allreduce(std::span<float>(v), ddp::op::sum); }, ddp::errc::aborted, {"abort"},
                     "allreduce after abort() here");
    } else {
      require_raises([&] { red.allreduce(std::span<float>(v), ddp::op::sum); }, ddp::errc::aborted, {"rank 0"},
                     "allreduce after rank 0's abort()");
    }
  }, 60s));
}

namespace {
bool in_forked_child = false;
}  // namespace

// LeakSanitizer consults this at exit. A forked child cannot free what only its parent's threads
// knew about (their stacks and thread-local buffers are not in the child): that is the nature of
// fork, not a leak of the child's, so the children made below are not leak-checked. Everything
// else in this file is.
extern "C" int __lsan_is_turned_off() { return in_forked_child ? 1 : 0; }

namespace {

enum class child_exit { destructors, exit, underscore_exit };

// What a forked child may and may not do with its parent's objects. Returns 0 when every rule
// held, else the number of the first that did not (the child reports it on stderr).
template <class DP, class Shm>
int child_rules(ddp::process_group& pg, DP& dp, Shm& sh, float* arena) {
  int rule = 0;
  auto usage = [&](auto&& call, const char* what) {
    ++rule;
    const std::string why = raises(call, ddp::errc::usage, {"used in a forked child"});
    if (!why.empty()) std::fprintf(stderr, "child: %s: %s\n", what, why.c_str());
    return why.empty();
  };
  std::vector<float> v(100, 1.0f);
  if (!usage([&] { dp.finish(); }, "data_parallel::finish()")) return rule;
  if (!usage([&] { dp.grad_ready(0); }, "data_parallel::grad_ready()")) return rule;
  if (!usage([&] { dp.get_reducer().allreduce(std::span<float>(v), ddp::op::sum); }, "ring<tcp>::allreduce()"))
    return rule;
  if (!usage([&] { sh.allreduce(std::span<float>(v), ddp::op::sum); }, "ring<shm>::allreduce()")) return rule;
  if (!usage([&] { sh.transport().barrier(pg.deadline()); }, "shm::barrier()")) return rule;
  if (!usage([&] { sh.transport().allocate(64); }, "shm::allocate()")) return rule;
  if (!usage([&] { pg.barrier(); }, "process_group::barrier()")) return rule;
  if (!usage([&] { pg.store().set("child", "1"); }, "process_group::store()")) return rule;
  if (!usage([&] { dp.get_reducer().group().all_gather("x"); }, "the reducer's group")) return rule;
  // abort() is noexcept: in a child it must do nothing at all to the parent's group.
  pg.abort("from a forked child");
  dp.get_reducer().abort();
  sh.abort();
  (void)arena;
  return 0;
}

// One rank: trains with a wrapper over ring<tcp> and a ring<shm> reducer; ranks 0 and 1 fork a
// child in the middle of a step (buckets and an shm allreduce in flight) for each way of
// exiting, then go on training. Returns -1 in the parent, the child's exit code in a child
// that returned (its destructors have run by then).
int train_and_fork(int r, int n, int port) {
  auto pg = ddp::init_process_group(opts(r, n, port, 20s));
  model m({3000, 5, 70000, 64});
  ddp::data_parallel dp{pg, m.views, ddp::bucket_policy{.cap_bytes = 64 << 10, .first_cap_bytes = 16 << 10}};
  ddp::ring<ddp::shm> sh{pg};
  const std::size_t count = 1 << 16;
  auto* arena = static_cast<float*>(sh.transport().allocate(count * sizeof(float)));
  int s = 0;
  auto shm_step = [&] {
    auto v = contribution(r, count);
    std::copy(v.begin(), v.end(), arena);
    return sh.allreduce_async(arena, count, ddp::dtype::f32, ddp::op::sum);
  };
  auto shm_check = [&](ddp::request& q) {
    q.wait(std::chrono::steady_clock::now() + 30s);
    require_sum(std::vector<float>(arena, arena + count), n, "shm allreduce");
  };
  backward(dp, m, r, s);
  dp.finish();
  require_average(m, n, s++, "step before any fork");

  for (auto mode : {child_exit::destructors, child_exit::exit, child_exit::underscore_exit}) {
    const bool forks = r < 2;  // rank 2 never forks: its peers' children must not disturb it
    backward(dp, m, r, s);     // every bucket launched: collectives in flight on the progress thread
    auto q = shm_step();
    pid_t child = -1;
    if (forks) {
      std::fflush(nullptr);
      child = ::fork();
      if (child == 0) {
        in_forked_child = true;
        const int code = child_rules(pg, dp, sh, arena);
        if (mode == child_exit::destructors) return code;  // like returning from main
        if (mode == child_exit::exit) std::exit(code);
        ::_exit(code);
      }
      require(child > 0, "fork failed");
    }
    dp.finish();
    require_average(m, n, s++, "step with a forked child");
    shm_check(q);
    if (forks) {
      // The child must end on its own, promptly.
      int st = 0;
      const auto until = std::chrono::steady_clock::now() + 15s;
      while (::waitpid(child, &st, WNOHANG) == 0) {
        if (std::chrono::steady_clock::now() > until) {
          ::kill(child, SIGKILL);
          ::waitpid(child, &st, 0);
          throw std::runtime_error("the forked child hung on its way out (mode " +
                                   std::to_string(static_cast<int>(mode)) + ")");
        }
        std::this_thread::sleep_for(5ms);
      }
      require(WIFEXITED(st) && WEXITSTATUS(st) == 0,
              "the forked child (mode " + std::to_string(static_cast<int>(mode)) + ") ended with " +
                  (WIFEXITED(st) ? "exit code " + std::to_string(WEXITSTATUS(st))
                                 : "signal " + std::to_string(WTERMSIG(st))));
    }
    // Everything still works after the child is gone, on every rank.
    backward(dp, m, r, s);
    dp.finish();
    require_average(m, n, s++, "step after the child ended");
    auto q2 = shm_step();
    shm_check(q2);
    pg.barrier();
    pg.store().set("fork/" + std::to_string(r) + "/" + std::to_string(s), "ok");
  }
  sh.transport().deallocate(arena, count * sizeof(float));
  return -1;
}

}  // namespace

TEST_CASE("fork: a child may exit either way without touching its parent's group; the parent and its peers train on") {
  const int n = 3, port = free_port();
  auto outs = run_ranks(n, [&](int r) {
    const int child = train_and_fork(r, n, port);
    if (child >= 0) {
      // A child whose train_and_fork() returned: its copies of the group, wrapper and reducers
      // are destroyed. Leave as main() would.
      std::fflush(nullptr);
      std::exit(child);
    }
  }, 120s);
  expect_ok(outs);
}

TEST_CASE("fork: a child may drop a request that a thread of its parent is waiting on") {
  // The parent's thread blocks on the request's condition variable; the child's copy of that
  // variable still counts the waiter, which does not exist in the child, so destroying it there
  // would wait forever. The child must be able to let go of the request and exit.
  auto state = std::make_shared<ddp::detail::request_state>();
  ddp::request req(state);
  std::atomic<bool> waiting{false};
  std::thread waiter([&] {
    waiting = true;
    req.wait(std::chrono::steady_clock::now() + 20s);
  });
  while (!waiting) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(100ms);  // inside wait() by now
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::alarm(5);  // a hang ends as SIGALRM
    state.reset();
    { ddp::request last = std::move(req); }  // the child's last reference
    ::_exit(0);
  }
  int status = -1;
  const auto until = std::chrono::steady_clock::now() + 10s;
  pid_t got = 0;
  while ((got = ::waitpid(child, &status, WNOHANG)) == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(10ms);
  if (got == 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
  }
  state->complete();
  waiter.join();
  CHECK(got == child);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}
