#include <ddp/store.hpp>

#include <doctest/doctest.h>

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
