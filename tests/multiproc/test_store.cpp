#include <ddp/store.hpp>

#include <doctest/doctest.h>

#include <sys/resource.h>

#include <atomic>
#include <sstream>
#include <thread>

#include "harness.hpp"

using namespace std::chrono_literals;

namespace {
ddp::detail::endpoint loopback_any_port() { return ddp::detail::resolve("127.0.0.1", 0, 0, true).front(); }
auto soon(std::chrono::milliseconds d = 5s) { return ddp::detail::clock::now() + d; }
int raw_connect(int port) {
  std::error_code ec;
  auto fd = ddp::detail::connect_retry(ddp::detail::resolve("127.0.0.1", port, 0), soon(), ec);
  return fd.release();
}
}  // namespace

TEST_CASE("set, get, add, compare_set, erase, check and wait") {
  ddp::store_server server{loopback_any_port(), 0};
  ddp::store_client c{"127.0.0.1", server.port(), 0, soon()};
  c.set("a", "1");
  CHECK(c.get("a", soon()) == "1");
  CHECK(c.add("n", 5) == 5);
  CHECK(c.add("n", -2) == 3);
  CHECK(c.compare_set("x", "", "first") == "first");
  CHECK(c.compare_set("x", "", "second") == "first");
  CHECK(c.compare_set("x", "first", "third") == "third");
  CHECK(c.check("x"));
  CHECK(c.erase("x"));
  CHECK_FALSE(c.check("x"));
  CHECK_FALSE(c.erase("x"));
  auto missing = c.wait({"a", "b", "c"}, soon(300ms));
  CHECK(missing == std::vector<std::string>{"b", "c"});
  c.set("b", "");
  c.set("c", "z");
  CHECK(c.wait({"a", "b", "c"}, soon()).empty());
  const std::string big(8 << 20, 'q');
  c.set("big", big);
  CHECK(c.get("big", soon()) == big);
}

TEST_CASE("get waits for a key set later by another client, and times out with an error") {
  ddp::store_server server{loopback_any_port(), 0};
  ddp::store_client a{"127.0.0.1", server.port(), 0, soon()};
  ddp::store_client b{"127.0.0.1", server.port(), 1, soon()};
  std::thread t([&] {
    std::this_thread::sleep_for(100ms);
    b.set("late", "here");
  });
  CHECK(a.get("late", soon()) == "here");
  t.join();
  const auto t0 = ddp::detail::clock::now();
  CHECK_THROWS_WITH_AS(a.get("never", soon(300ms)), doctest::Contains("never"), ddp::error);
  CHECK(ddp::detail::clock::now() - t0 < 2s);
  // The connection is still usable after a timed-out wait.
  CHECK(a.get("late", soon()) == "here");
}

TEST_CASE("garbage and stalled clients are dropped or ignored while real clients are served") {
  ddp::store_server server{loopback_any_port(), 0};
  ddp::store_client good{"127.0.0.1", server.port(), 0, soon()};
  good.set("k", "v");

  // 1. A client that claims a 1 GiB frame: dropped, nothing allocated for it.
  int huge = raw_connect(server.port());
  std::string hdr;
  ddp::detail::put_u32(hdr, 1u << 30);
  REQUIRE(::send(huge, hdr.data(), hdr.size(), MSG_NOSIGNAL) == 4);
  // 2. A client that sends random bytes.
  int junk = raw_connect(server.port());
  const char noise[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n\x00\x01\x02";
  REQUIRE(::send(junk, noise, sizeof noise, MSG_NOSIGNAL) > 0);
  // 3. A client that sends half a valid frame and stalls.
  int stall = raw_connect(server.port());
  auto f = ddp::detail::encode_frame(1, {"stalled", "value"});
  REQUIRE(::send(stall, f.data(), f.size() / 2, MSG_NOSIGNAL) > 0);

  // The real client is served at once, and the garbage clients are closed by the server.
  const auto t0 = ddp::detail::clock::now();
  for (int i = 0; i < 100; ++i) CHECK(good.get("k", soon()) == "v");
  CHECK(ddp::detail::clock::now() - t0 < 1s);
  char buf[16];
  std::error_code ec;
  ddp::detail::recv_all(huge, buf, 1, soon(2s), ec);
  CHECK(ec == ddp::errc::peer_lost);
  ddp::detail::recv_all(junk, buf, 1, soon(2s), ec);
  CHECK(ec == ddp::errc::peer_lost);
  CHECK(server.dropped() >= 2);
  CHECK_FALSE(good.check("stalled"));
  ::close(huge);
  ::close(junk);
  ::close(stall);
}

TEST_CASE("store clients in separate processes see each other's writes") {
  ddp::store_server server{loopback_any_port(), 0};
  const int port = server.port();
  auto outs = ddp_test::run_ranks(4, [&](int r) {
    ddp::store_client c{"127.0.0.1", port, r, soon()};
    c.set("from/" + std::to_string(r), std::to_string(r * r));
    if (c.add("count", 1) > 4) throw std::runtime_error("count overflow");
    for (int q = 0; q < 4; ++q)
      if (c.get("from/" + std::to_string(q), soon()) != std::to_string(q * q)) throw std::runtime_error("value");
  });
  INFO(ddp_test::summary(outs));
  CHECK(ddp_test::all_ok(outs));
  ddp::store_client c{"127.0.0.1", port, 0, soon()};
  CHECK(c.add("count", 0) == 4);
}

namespace {
// Every frame the server sent on `fd` until it closed the connection.
std::vector<ddp::detail::frame> read_until_closed(int fd, std::chrono::milliseconds limit = 5s) {
  std::string got;
  char buf[4096];
  const auto until = soon(limit);
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, std::max(0, ddp::detail::ms_left(until))) <= 0) break;
    const ssize_t k = ::recv(fd, buf, sizeof buf, 0);
    if (k <= 0) break;
    got.append(buf, static_cast<std::size_t>(k));
  }
  std::vector<ddp::detail::frame> out;
  std::string_view rest = got;
  for (;;) {
    std::uint32_t len = 0;
    if (ddp::detail::check_header(rest, len) != ddp::detail::parse_result::ok) break;
    ddp::detail::frame f;
    if (ddp::detail::parse_body(rest.substr(4, len), f) != ddp::detail::parse_result::ok) break;
    out.push_back(std::move(f));
    rest.remove_prefix(4 + len);
  }
  return out;
}

long cpu_ticks(pid_t pid) {
  std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return -1;
  char buf[1024] = {};
  const std::size_t k = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  std::string s(buf, k);
  // Fields after the command name, which ends with the last ')': state is field 3, utime 14, stime 15.
  std::istringstream in(s.substr(s.rfind(')') + 2));
  std::string field;
  long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && in >> field; ++i) {
    if (i == 14) utime = std::stol(field);
    if (i == 15) stime = std::stol(field);
  }
  return utime + stime;
}
}  // namespace

TEST_CASE("a client that shuts its side after sending still gets every answer, parked ones included") {
  ddp::store_server server{loopback_any_port(), 0};
  ddp::store_client other{"127.0.0.1", server.port(), 1, soon()};
  const int fd = raw_connect(server.port());
  const auto ms = ddp::detail::encode_ms(5000);
  std::string req = ddp::detail::encode_frame(static_cast<std::uint8_t>(ddp::detail::store_cmd::set), {"hc", "v1"}) +
                    ddp::detail::encode_frame(static_cast<std::uint8_t>(ddp::detail::store_cmd::get), {"hc", ms}) +
                    ddp::detail::encode_frame(static_cast<std::uint8_t>(ddp::detail::store_cmd::get), {"later", ms});
  REQUIRE(::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size()));
  REQUIRE(::shutdown(fd, SHUT_WR) == 0);
  std::thread t([&] {
    std::this_thread::sleep_for(200ms);
    other.set("later", "v2");
  });
  const auto frames = read_until_closed(fd);
  t.join();
  ::close(fd);
  REQUIRE(frames.size() == 3);
  CHECK(frames[0].code == static_cast<std::uint8_t>(ddp::detail::store_status::ok));
  REQUIRE(frames[1].fields.size() == 1);
  CHECK(frames[1].fields[0] == "v1");
  REQUIRE(frames[2].fields.size() == 1);
  CHECK(frames[2].fields[0] == "v2");
  // ... and the server then closed it (read_until_closed returned before its 5 s).
  CHECK(other.get("hc", soon()) == "v1");
}

TEST_CASE("the store refuses writes past its byte limit, and drops the clients that buffer the most") {
  ddp::store_server server{loopback_any_port(), 0, nullptr, ddp::store_limits{.max_bytes = 1 << 20, .max_buffered = 4 << 20}};
  ddp::store_client c{"127.0.0.1", server.port(), 0, soon()};
  const std::string big(600 << 10, 'a'), half(300 << 10, 'b');
  c.set("a", big);
  constexpr auto entry = ddp::store_limits::entry_overhead;
  CHECK(server.stored_bytes() == 1 + big.size() + entry);
  CHECK_THROWS_WITH_AS(c.set("b", big), doctest::Contains("is full"), ddp::error);
  try {
    c.set("b", big);
  } catch (const ddp::error& e) {
    CHECK(e.code() == ddp::errc::system);
    CHECK(std::string(e.what()).find("'b'") != std::string::npos);
  }
  CHECK_FALSE(c.check("b"));
  CHECK_THROWS_AS(c.compare_set("b", "", big), ddp::error);
  c.set("a", half);  // overwriting with less frees the difference
  c.set("b", big);
  CHECK(server.stored_bytes() == 2 + half.size() + big.size() + 2 * entry);
  CHECK(c.add("n", 3) == 3);
  CHECK(c.erase("a"));
  CHECK(server.stored_bytes() == 2 + big.size() + 8 + 2 * entry);

  // A stranger claims a 32 MiB frame and sends 6 MiB of it: past max_buffered, it is dropped;
  // the real client is served throughout.
  const int flood = raw_connect(server.port());
  std::string hdr;
  ddp::detail::put_u32(hdr, 32u << 20);
  REQUIRE(::send(flood, hdr.data(), hdr.size(), MSG_NOSIGNAL) == 4);
  std::thread t([&] {
    const std::string chunk(1 << 20, 'x');
    std::error_code ec;
    for (int i = 0; i < 6 && !ec; ++i) ddp::detail::send_all(flood, chunk.data(), chunk.size(), soon(3s), ec);
  });
  for (int i = 0; i < 50; ++i) CHECK(c.get("b", soon()) == big);
  t.join();
  const auto deadline = soon(3s);
  while (server.dropped() < 1 && ddp::detail::clock::now() < deadline) std::this_thread::sleep_for(10ms);
  CHECK(server.dropped() == 1);
  char b1;
  std::error_code ec;
  ddp::detail::recv_all(flood, &b1, 1, soon(2s), ec);
  CHECK(ec == ddp::errc::peer_lost);
  ::close(flood);
  CHECK(c.get("b", soon()) == big);
}

TEST_CASE("out of file descriptors, the store sheds new connections without spinning and recovers") {
  int to_parent[2], to_child[2];
  REQUIRE(::pipe(to_parent) == 0);
  REQUIRE(::pipe(to_child) == 0);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Keep only stdio and the two pipe ends (as fds 3 and 4), then allow the server its
    // listener, eventfd, epoll and spare, plus room for 4 clients (the hard limit too: the
    // server raises the soft limit to it).
    if (::dup2(to_parent[1], 3) < 0 || ::dup2(to_child[0], 4) < 0) ::_exit(2);
    to_parent[1] = 3;
    to_child[0] = 4;
    for (int fd = 5; fd < 4096; ++fd) ::close(fd);
    rlimit rl{};
    ::getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = rl.rlim_max = 5 + 4 + 4;
    if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) ::_exit(3);
    try {
      ddp::store_server server{loopback_any_port(), 0};
      const int port = server.port();
      if (::write(to_parent[1], &port, sizeof port) != sizeof port) ::_exit(4);
      char go;
      if (::read(to_child[0], &go, 1) != 1) ::_exit(5);  // the parent is done
      const int shed = server.shed() + server.evicted();
      if (::write(to_parent[1], &shed, sizeof shed) != sizeof shed) ::_exit(6);
    } catch (...) {
      ::_exit(7);
    }
    ::_exit(0);
  }
  ::close(to_parent[1]);
  ::close(to_child[0]);
  int port = 0;
  REQUIRE(::read(to_parent[0], &port, sizeof port) == sizeof port);
  ddp::store_client good{"127.0.0.1", port, 0, soon()};
  good.set("k", "v");
  std::vector<int> flood;
  for (int i = 0; i < 40; ++i) flood.push_back(raw_connect(port));
  std::this_thread::sleep_for(300ms);
  // While the flood lasts the server does not spin on its listener ...
  const long t0 = cpu_ticks(pid);
  std::this_thread::sleep_for(1s);
  const long used = cpu_ticks(pid) - t0;
  CHECK(used >= 0);
  CHECK(used < ::sysconf(_SC_CLK_TCK) / 4);
  // ... the client it already had is served ...
  CHECK(good.get("k", soon()) == "v");
  // ... and connections it cannot take are closed, not left hanging.
  int closed = 0;
  for (int fd : flood) {
    char b;
    std::error_code ec;
    ddp::detail::recv_all(fd, &b, 1, soon(50ms), ec);
    if (ec == ddp::errc::peer_lost) ++closed;
  }
  CHECK(closed >= 25);
  for (int fd : flood) ::close(fd);
  std::this_thread::sleep_for(300ms);
  // Descriptors free again: new clients get in.
  ddp::store_client late{"127.0.0.1", port, 1, soon()};
  CHECK(late.get("k", soon()) == "v");
  REQUIRE(::write(to_child[1], "x", 1) == 1);
  int shed = 0;
  REQUIRE(::read(to_parent[0], &shed, sizeof shed) == sizeof shed);
  CHECK(shed >= 25);
  int st = 0;
  ::waitpid(pid, &st, 0);
  CHECK((WIFEXITED(st) && WEXITSTATUS(st) == 0));
  ::close(to_parent[0]);
  ::close(to_child[1]);
}

TEST_CASE("a value too large for the store fails on the writer with invalid_argument; the connection stays usable") {
  ddp::store_server server{loopback_any_port(), 0, nullptr, ddp::store_limits{.max_bytes = 1 << 20}};
  ddp::store_client c{"127.0.0.1", server.port(), 0, soon()};
  auto refused = [&](auto&& f, const std::vector<std::string>& texts) {
    try {
      f();
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::invalid_argument);
      for (const auto& t : texts) CHECK_MESSAGE(std::string(e.what()).find(t) != std::string::npos, e.what());
      return;
    }
    FAIL("not refused");
  };
  // Larger than a frame: refused before it is sent (the server would drop the connection).
  const std::string frame_plus((64u << 20) + 1, 'f');
  refused([&] { c.set("model/blob", frame_plus); }, {"'model/blob'", "too large", "67108864"});
  refused([&] { c.compare_set("model/blob", "", frame_plus); }, {"'model/blob'", "67108864"});
  // A key longer than keys may be.
  refused([&] { c.set(std::string(5000, 'k'), "v"); }, {"5000 bytes", "4096"});
  // Larger than store_limits::max_bytes however empty the store is: invalid_argument too.
  const std::string two_mib(2 << 20, 'm');
  refused([&] { c.set("weights", two_mib); }, {"'weights'", "too large", "1048576", "store_limits::max_bytes"});
  // Nothing broke: the same connection serves the next calls, and the server dropped nobody.
  c.set("k", "v");
  CHECK(c.get("k", soon()) == "v");
  CHECK(server.dropped() == 0);
}

TEST_CASE("a store client that saw a bad frame length or an unknown status is broken: every later call fails at once naming why") {
  struct bad_reply {
    std::string bytes, why;
  };
  std::string bad_length;
  ddp::detail::put_u32(bad_length, 0xffffffffu);
  const bad_reply cases[] = {
      {bad_length, "store sent a bad frame length"},
      {ddp::detail::encode_frame(99, {}), "store sent an unknown status 99"},
  };
  for (const auto& bad : cases) {
    CAPTURE(bad.why);
    // A fake store: answers the first request with the bad reply, the next ones with ok.
    auto listener = ddp::detail::listen_on(loopback_any_port(), 0);
    const int port = ddp::detail::port_of(ddp::detail::local_address(listener.get()));
    std::atomic<int> served{0};
    std::thread fake([&] {
      pollfd p{listener.get(), POLLIN, 0};
      if (::poll(&p, 1, 5000) != 1) return;
      const int fd = ::accept(listener.get(), nullptr, nullptr);
      if (fd < 0) return;
      for (int i = 0; i < 3; ++i) {
        char req[256];
        pollfd q{fd, POLLIN, 0};
        if (::poll(&q, 1, 1000) != 1 || ::recv(fd, req, sizeof req, 0) <= 0) break;
        // The first request is the client's hello (a check): answered ok.
        const std::string out =
            i == 1 ? bad.bytes : ddp::detail::encode_frame(static_cast<std::uint8_t>(ddp::detail::store_status::ok), {"1"});
        (void)::send(fd, out.data(), out.size(), MSG_NOSIGNAL);
        ++served;
      }
      ::close(fd);
    });
    ddp::store_client c{"127.0.0.1", port, 0, soon()};
    CHECK_THROWS_WITH_AS(c.check("a", soon(2s)), doctest::Contains(bad.why.c_str()), ddp::error);
    const auto t0 = ddp::detail::clock::now();
    try {
      c.check("b", soon(2s));
      FAIL("a broken client answered");
    } catch (const ddp::error& e) {
      CHECK(e.code() == ddp::errc::protocol);
      CHECK(std::string(e.what()).find("unusable after an earlier failure: " + bad.why) != std::string::npos);
    }
    CHECK(ddp::detail::clock::now() - t0 < 500ms);
    fake.join();
    CHECK(served.load() == 2);  // the hello and the first call; the second call never went out
  }
}
