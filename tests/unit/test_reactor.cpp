// The group's reactor (group/detail/reactor.hpp) in one process: handlers come and go on one
// reactor for as long as it runs (their slots are reused), and an event that a removed handler's
// descriptor raises never reaches the handler that took its slot. The multiprocess suites
// (links, heartbeat, auth) run it under real groups; tests/fuzz/fuzz_mesh_hello adds and removes
// two listeners per input on one reactor for as long as it runs.
#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/group/detail/reactor.hpp>

#include <doctest/doctest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

using namespace std::chrono_literals;
using ddp::detail::reactor;

namespace {
/// Counts the events it is given, and the last id.
struct counter final : ddp::detail::reactor_handler {
  std::atomic<int> events{0};
  std::atomic<std::uint64_t> last_id{0};
  void on_event(std::uint64_t id, std::uint32_t, ddp::deadline_t) override {
    last_id = id;
    ++events;
  }
};

/// A pipe whose read end is readable until drained.
struct pipe_pair {
  int fd[2] = {-1, -1};
  pipe_pair() { REQUIRE(::pipe(fd) == 0); }
  ~pipe_pair() {
    ::close(fd[0]);
    ::close(fd[1]);
  }
  void fill() const { REQUIRE(::write(fd[1], "x", 1) == 1); }
};

/// Waits up to 10 s (a busy machine) for `done`.
template <class F>
bool eventually(F done) {
  const auto until = std::chrono::steady_clock::now() + 10s;
  while (!done()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}
}  // namespace

TEST_CASE("reactor: handlers added and removed in turn for as long as it runs, far past its 255 slots") {
  reactor r{0, "test"};
  for (int i = 0; i < 1000; ++i) {
    CAPTURE(i);
    counter c;
    pipe_pair p;
    auto reg = r.add(c);
    reg.watch(p.fd[0], EPOLLIN, 42);
    p.fill();
    REQUIRE(eventually([&] { return c.events > 0; }));
    CHECK(c.last_id == 42);
    reg.unwatch(p.fd[0]);
  }
}

TEST_CASE("reactor: at most 255 handlers at once, and the 256th is a usage error that says so") {
  reactor r{3, "test"};
  std::vector<counter> cs(reactor::max_handlers + 1);
  std::vector<reactor::registration> regs;
  for (std::size_t i = 0; i < reactor::max_handlers; ++i) regs.push_back(r.add(cs[i]));
  try {
    (void)r.add(cs.back());
    FAIL("the 256th handler was taken");
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::usage);
    CHECK(e.rank() == 3);
    CHECK(std::string(e.what()).find("more than 255 handlers") != std::string::npos);
  }
  regs.pop_back();  // one slot free again
  CHECK_NOTHROW(regs.push_back(r.add(cs.back())));
}

TEST_CASE("reactor: an event a removed handler's descriptor still raises never reaches the handler in its slot") {
  reactor r{0, "test"};
  pipe_pair old_pipe;
  counter gone;
  {
    auto reg = r.add(gone);
    reg.watch(old_pipe.fd[0], EPOLLIN, 7);
    old_pipe.fill();  // readable, level-triggered: an event every round from now on
    REQUIRE(eventually([&] { return gone.events > 0; }));
    // Removed without unwatching its descriptor, so that the old key keeps firing.
  }
  counter next;
  auto reg = r.add(next);  // takes the freed slot
  std::this_thread::sleep_for(100ms);
  CHECK(next.events == 0);
  pipe_pair own;
  reg.watch(own.fd[0], EPOLLIN, 9);
  own.fill();
  REQUIRE(eventually([&] { return next.events > 0; }));
  CHECK(next.last_id == 9);
  reg.unwatch(own.fd[0]);
  reg.reset();
}

TEST_CASE("reactor: a handler added paused is not called, its descriptors' events included, until started") {
  reactor r{0, "test"};
  counter c;
  pipe_pair p;
  auto reg = r.add(c, reactor::begin::paused);
  reg.watch(p.fd[0], EPOLLIN, 5);
  p.fill();
  std::this_thread::sleep_for(100ms);
  CHECK(c.events == 0);
  reg.start();
  REQUIRE(eventually([&] { return c.events > 0; }));
  CHECK(c.last_id == 5);
  reg.unwatch(p.fd[0]);
}
