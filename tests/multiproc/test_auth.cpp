#include <ddp/auth/sodium.hpp>

#include <ddp/process_group.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/store.hpp>
#include <ddp/data_parallel.hpp>
#include <ddp/group/elastic.hpp>
#include <ddp/transport/tcp.hpp>

#include <doctest/doctest.h>
#include <fcntl.h>

#include <signal.h>

#include <array>
#include <optional>
#include <cstdio>
#include <numeric>
#include <stdexcept>
#include <thread>

#include "harness.hpp"

using namespace std::chrono_literals;
using ddp_test::free_port;
using ddp_test::run_processes;
using ddp_test::run_ranks;
using ddp_test::expect_ok;
namespace detail = ddp::detail;

namespace {
const std::string secret = "0123456789abcdef-group-secret";
// This program chooses libsodium's authenticator (including its header installs nothing).
const bool sodium_chosen = (ddp::install_authenticator(&ddp::sodium_authenticator::make), true);

constexpr ddp_test::local_group opts{20s};
using ddp_test::require;
ddp::endpoint loopback_any_port() { return {"127.0.0.1", 0}; }
auto soon(std::chrono::milliseconds d = 5s) { return detail::clock::now() + d; }
detail::fd_handle raw_connect(int port) {
  std::error_code ec;
  auto fd = detail::connect_retry(detail::resolve("127.0.0.1", port, 0), soon(), ec);
  REQUIRE(fd);
  return fd;
}
void send_bytes(int fd, std::string_view s) {
  std::error_code ec;
  detail::send_all(fd, s.data(), s.size(), soon(), ec);
  REQUIRE_FALSE(ec);
}
std::string recv_bytes(int fd, std::size_t n, std::error_code& ec) {
  std::string s(n, '\0');
  detail::recv_all(fd, s.data(), n, soon(), ec);
  return s;
}
double seconds_since(detail::clock::time_point t0) {
  return std::chrono::duration<double>(detail::clock::now() - t0).count();
}
/// Everything the server sends until it closes (bounded by 5 s).
std::string read_until_closed(int fd) {
  std::string got;
  const auto until = soon();
  char buf[64];
  for (;;) {
    const ssize_t k = ::recv(fd, buf, sizeof buf, 0);
    if (k > 0) {
      got.append(buf, static_cast<std::size_t>(k));
      continue;
    }
    if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return got;
    pollfd p{fd, POLLIN, 0};
    if (detail::ms_left(until) == 0) return got + "<still open>";
    ::poll(&p, 1, detail::ms_left(until));
  }
}
bool sum_is_exact(const std::vector<float>& v, int n) {
  for (std::size_t i = 0; i < v.size(); ++i)
    if (v[i] != static_cast<float>(n * (n - 1) / 2 + n * static_cast<int>(i % 100))) return false;
  return true;
}
}  // namespace

TEST_CASE("groups of 2 and 4 ranks with the same token join, barrier, broadcast and ring-allreduce") {
  for (int n : {2, 4}) {
    CAPTURE(n);
    const int port = free_port();
    auto outs = run_ranks(n, [&](int r) {
      auto pg = ddp::init_process_group(opts(r, n, port, secret));
      require(pg.store().auth() != nullptr, "store connection is not authenticated");
      for (int i = 0; i < 10; ++i) pg.barrier();
      std::vector<int> b(4096);
      if (r == n - 1) std::iota(b.begin(), b.end(), 5);
      pg.broadcast(std::span<int>(b), n - 1);
      for (std::size_t i = 0; i < b.size(); ++i) require(b[i] == 5 + static_cast<int>(i), "broadcast value");
      // The transport opens its own mesh, which is authenticated too.
      ddp::ring<ddp::tcp> ring{pg};
      std::vector<float> v(100003);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(r + static_cast<int>(i % 100));
      ring.allreduce(std::span<float>(v), ddp::op::sum);
      require(sum_is_exact(v, n), "allreduce result");
    });
    expect_ok(outs);
  }
}

TEST_CASE("processes with a wrong token or no token are refused and the real group still completes") {
  const int port = free_port();
  // Ranks 0-2 are the group; 11 and 12 claim ranks 1 and 2 with a wrong token and with none.
  // The intruders start with the group, so they race it for the store.
  const auto t0 = detail::clock::now();
  auto outs = run_processes({0, 1, 2, 11, 12}, [&](int who) {
    if (who < 10) {
      auto pg = ddp::init_process_group(opts(who, 3, port, secret));
      for (int i = 0; i < 5; ++i) pg.barrier();
      auto all = pg.all_gather("r" + std::to_string(who));
      require(all == std::vector<std::string>{"r0", "r1", "r2"}, "all_gather");
      ddp::ring<ddp::tcp> ring{pg};
      std::vector<float> v(1000);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(who + static_cast<int>(i % 100));
      ring.allreduce(std::span<float>(v), ddp::op::sum);
      require(sum_is_exact(v, 3), "allreduce result");
      return;
    }
    auto o = opts(who - 10, 3, port, who == 11 ? "not-the-secret" : "");
    auto pg = ddp::init_process_group(o);
    throw std::runtime_error("an intruder joined the group");
  });
  INFO(ddp_test::summary(outs));
  for (auto& o : outs) {
    CAPTURE(o.rank);
    if (o.rank < 10) {
      CHECK(o.ok());
    } else {
      CHECK(o.exit_code == 1);
      CHECK(o.errc == static_cast<int>(ddp::errc::auth_failed));
      CHECK(o.seconds < 10.0);  // refused at once, not at the 20 s deadline
    }
  }
  CHECK(outs[3].message.find("secret") != std::string::npos);
  CHECK(outs[4].message.find("DDP_AUTH_TOKEN") != std::string::npos);
  CHECK(seconds_since(t0) < 15.0);
}

TEST_CASE("store: client and server disagreeing about the secret fail with auth_failed on the client") {
  auto auth = ddp::make_authenticator(secret, 0);
  auto other = ddp::make_authenticator("another secret", 0);
  {
    ddp::store_server server{loopback_any_port(), 0, auth};
    CHECK_THROWS_WITH_AS(ddp::store_client("127.0.0.1", server.port(), 1, soon(), other), doctest::Contains("prove"),
                         ddp::error);
    try {
      // Its hello (the first request) is answered with auth_required.
      ddp::store_client plain{"127.0.0.1", server.port(), 2, soon()};
      FAIL("a client without the secret was served");
    } catch (const ddp::error& e) {
      CHECK(e.condition() == ddp::errc::auth_failed);
      CHECK(std::string(e.what()).find("DDP_AUTH_TOKEN") != std::string::npos);
    }
    ddp::store_client good{"127.0.0.1", server.port(), 0, soon(), auth};
    CHECK_FALSE(good.check("k"));
    good.set("k", "v");
    CHECK(good.get("k", soon()) == "v");
    // The client with the wrong secret hung up by itself; the one without was refused.
    CHECK(server.refused() == 1);
  }
  {
    ddp::store_server plain_server{loopback_any_port(), 0};
    try {
      ddp::store_client c{"127.0.0.1", plain_server.port(), 1, soon(), auth};
      FAIL("a client with a secret accepted a server without one");
    } catch (const ddp::error& e) {
      CHECK(e.condition() == ddp::errc::auth_failed);
      CHECK(std::string(e.what()).find("does not use authentication") != std::string::npos);
    }
  }
}

TEST_CASE("a replayed or reflected handshake is refused") {
  auto auth = ddp::make_authenticator(secret, 0);
  ddp::store_server server{loopback_any_port(), 0, auth};
  std::error_code ec;

  // 1. A genuine handshake, done by hand and recorded.
  detail::auth_hello h;
  h.from = 3;
  auth->random(h.nonce);
  const std::string hello = detail::encode_hello(h);
  std::string proof, first_nonce;
  {
    auto fd = raw_connect(server.port());
    send_bytes(fd.get(), hello);
    const auto c = recv_bytes(fd.get(), detail::auth_challenge_size, ec);
    REQUIRE_FALSE(ec);
    REQUIRE(static_cast<detail::auth_status>(c[4]) == detail::auth_status::challenge);
    first_nonce = c.substr(8, 32);
    std::array<std::byte, 32> tag;
    auth->mac(detail::bytes_of(detail::auth_transcript('I', hello, detail::bytes_of(first_nonce))), tag);
    detail::put_u32(proof, detail::auth_magic);
    detail::put_u32(proof, 0);
    detail::put_bytes(proof, tag);
    send_bytes(fd.get(), proof);
    const auto v = recv_bytes(fd.get(), detail::auth_verdict_size, ec);
    REQUIRE_FALSE(ec);
    CHECK(static_cast<detail::auth_status>(v[4]) == detail::auth_status::accepted);
    // Authenticated: a request is served.
    send_bytes(fd.get(), detail::encode_frame(static_cast<std::uint8_t>(detail::store_cmd::check), {"x"}));
    const auto r = recv_bytes(fd.get(), 4 + 1 + 4 + 1, ec);
    CHECK_FALSE(ec);
    CHECK(r[4] == static_cast<char>(detail::store_status::ok));
  }
  CHECK(server.refused() == 0);

  // 2. The recording replayed: the server's nonce is new, so the old proof fails.
  {
    auto fd = raw_connect(server.port());
    send_bytes(fd.get(), hello);
    const auto c = recv_bytes(fd.get(), detail::auth_challenge_size, ec);
    REQUIRE_FALSE(ec);
    CHECK(c.substr(8, 32) != first_nonce);
    send_bytes(fd.get(), proof);
    const auto v = recv_bytes(fd.get(), detail::auth_verdict_size, ec);
    REQUIRE_FALSE(ec);
    CHECK(static_cast<detail::auth_status>(v[4]) == detail::auth_status::refused);
    // ... and the server hangs up; a request is never served.
    send_bytes(fd.get(), detail::encode_frame(static_cast<std::uint8_t>(detail::store_cmd::set), {"evil", "1"}));
    recv_bytes(fd.get(), 1, ec);
    CHECK(ec == ddp::errc::peer_lost);
  }
  // 3. The server's own MAC reflected back as the proof.
  {
    auto fd = raw_connect(server.port());
    auth->random(h.nonce);
    const std::string hello2 = detail::encode_hello(h);
    send_bytes(fd.get(), hello2);
    const auto c = recv_bytes(fd.get(), detail::auth_challenge_size, ec);
    REQUIRE_FALSE(ec);
    std::string reflected;
    detail::put_u32(reflected, detail::auth_magic);
    detail::put_u32(reflected, 0);
    reflected += c.substr(40, 32);
    send_bytes(fd.get(), reflected);
    const auto v = recv_bytes(fd.get(), detail::auth_verdict_size, ec);
    REQUIRE_FALSE(ec);
    CHECK(static_cast<detail::auth_status>(v[4]) == detail::auth_status::refused);
  }
  CHECK(server.refused() == 2);
  ddp::store_client good{"127.0.0.1", server.port(), 0, soon(), auth};
  CHECK_FALSE(good.check("evil"));
}

TEST_CASE("clients stalled mid-handshake, garbage and huge lengths delay no other rank's store calls") {
  auto auth = ddp::make_authenticator(secret, 0);
  ddp::store_server server{loopback_any_port(), 0, auth};
  const int port = server.port();
  // 1. Half a hello, then silence.
  auto half = raw_connect(port);
  detail::auth_hello h;
  auth->random(h.nonce);
  const auto hello = detail::encode_hello(h);
  send_bytes(half.get(), std::string_view(hello).substr(0, 10));
  // 2. A whole hello, then no proof.
  auto no_proof = raw_connect(port);
  send_bytes(no_proof.get(), hello);
  // 3. A 1 GiB length claim without a handshake.
  auto huge = raw_connect(port);
  std::string hdr;
  detail::put_u32(hdr, 1u << 30);
  send_bytes(huge.get(), hdr);
  // 4. Noise.
  auto junk = raw_connect(port);
  send_bytes(junk.get(), std::string(100000, '\x7f'));

  // Another rank, in its own process, authenticates and runs store calls meanwhile.
  auto outs = run_ranks(
      1,
      [&](int) {
        const auto t0 = detail::clock::now();
        ddp::store_client c{"127.0.0.1", port, 1, soon(), auth};
        for (int i = 0; i < 100; ++i) {
          const auto v = std::to_string(i);
          const auto k = std::string("k").append(v);
          c.set(k, v);
          require(c.get(k, soon()) == v, "value");
        }
        require(seconds_since(t0) < 1.0, "store calls took " + std::to_string(seconds_since(t0)) + " s");
      },
      20s);
  INFO(ddp_test::summary(outs));
  CHECK(ddp_test::all_ok(outs));
  // The unauthenticated ones are told so and closed; the stalled ones are still waited for.
  std::error_code ec;
  for (int fd : {huge.get(), junk.get()}) {
    const auto got = read_until_closed(fd);
    REQUIRE(got.size() >= 5);
    CHECK(got[4] == static_cast<char>(detail::store_status::auth_required));
  }
  const auto c = recv_bytes(no_proof.get(), detail::auth_challenge_size, ec);
  CHECK_FALSE(ec);
  CHECK(static_cast<detail::auth_status>(c[4]) == detail::auth_status::challenge);
  CHECK(server.refused() == 2);
}

TEST_CASE("a stranger at a rank's mesh port, stalled or with a wrong secret, neither gets in nor delays peers") {
  auto auth = ddp::make_authenticator(secret, 0);
  ddp::store_server server{loopback_any_port(), 0, auth};
  const int port = server.port();
  // who 0 and 1 form a 2-rank mesh; who 2 is a stranger that found rank 0's mesh port.
  auto outs = run_processes(
      {0, 1, 2},
      [&](int who) {
        ddp::store_client st{"127.0.0.1", port, who, soon(), auth};
        if (who == 2) {
          const auto v = st.get("m/addr/0", soon());
          const auto sp = v.rfind(' ');
          const auto eps = detail::resolve(v.substr(0, sp), std::stoi(v.substr(sp + 1)), 2);
          std::error_code ec;
          auto stalled = detail::connect_retry(eps, soon(), ec);
          const auto hello = detail::encode_hello({});
          detail::send_all(stalled.get(), hello.data(), 20, soon(), ec);
          auto wrong = detail::connect_retry(eps, soon(), ec);
          auto bad = ddp::make_authenticator("wrong", 2);
          detail::auth_hello h;
          h.kind = detail::auth_kind::mesh;
          h.from = 1;
          h.to = 0;
          h.size = 2;
          h.group = 77;
          try {
            detail::auth_initiate(wrong.get(), *bad, h, soon(), 2, "rank 0");
            throw std::runtime_error("a wrong secret passed the mesh handshake");
          } catch (const ddp::error& e) {
            require(e.condition() == ddp::errc::auth_failed, e.what());
          }
          st.set("stranger/done", "1", soon());
          st.get("m/done", soon(10s));  // keep the stalled connection open until the mesh is up
          return;
        }
        if (who == 1) st.get("stranger/done", soon());  // rank 1 comes after the stranger
        const auto t0 = detail::clock::now();
        detail::reactor loop{who, "test"};
        detail::link_hub hub{loop, detail::local_address(st.native_handle()), auth, who};
        detail::peer_links links{hub, detail::store_directory(st, 10s), 2, "m", 77, 0};
        const int other = links.get(1 - who, soon(10s));
        const char out = static_cast<char>('a' + who);
        char in = 0;
        std::error_code ec;
        detail::send_all(other, &out, 1, soon(), ec);
        detail::recv_all(other, &in, 1, soon(), ec);
        require(!ec && in == static_cast<char>('a' + 1 - who), "mesh data");
        if (who == 1) {
          require(seconds_since(t0) < 2.0, "mesh took " + std::to_string(seconds_since(t0)) + " s");
          st.set("m/done", "1", soon());
        }
      },
      30s);
  expect_ok(outs);
}

TEST_CASE("with a secret, a connection to a transport its peer closed is a lost peer, not a wrong secret") {
  // The peer proves the secret, then finds nothing that takes the connection: the initiator
  // retries as it does without a secret, and ends with the group's verdict at its deadline,
  // never errc::auth_failed (which an elastic group would not re-form after).
  const int port = free_port();
  auto outs = run_ranks(2, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, 2, port, secret));
    std::optional<ddp::tcp> t{std::in_place, pg};
    pg.barrier();
    if (r == 0) {
      t.reset();  // closed before rank 1 ever used it
      pg.barrier();
      std::this_thread::sleep_for(3s);
      return;
    }
    pg.barrier();
    int v = 1;
    try {
      t->send(0, &v, sizeof v, detail::clock::now() + 2s);
      require(false, "a send to a closed transport succeeded");
    } catch (const ddp::error& e) {
      require(e.condition() == ddp::errc::timeout || e.condition() == ddp::errc::peer_lost,
              std::string("raised ") + e.what());
    }
  });
  expect_ok(outs);
}

TEST_CASE("a token without an installed authenticator is errc::unsupported") {
  const auto saved = ddp::install_authenticator(nullptr);
  CHECK_FALSE(ddp::authentication_available());
  try {
    ddp::init_process_group(opts(0, 1, free_port(), secret));
    FAIL("a token was ignored");
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::unsupported);
    CHECK(std::string(e.what()).find("ddp/auth/sodium.hpp") != std::string::npos);
    CHECK(std::string(e.what()).find("ddp::install_authenticator") != std::string::npos);
  }
  CHECK(sodium_chosen);
  ddp::install_authenticator(saved);
  CHECK(ddp::authentication_available());
  auto pg = ddp::init_process_group(opts(0, 1, free_port(), secret));
  pg.barrier();
}

TEST_CASE("a store without a secret warns once when it listens beyond loopback") {
  auto outs = run_ranks(1, [&](int) {
    char path[] = "/tmp/ddp-auth-warnXXXXXX";
    const int fd = ::mkstemp(path);
    ::unlink(path);
    ::dup2(fd, 2);
    {
      ddp::store_server loop{loopback_any_port(), 0};
      ddp::store_server any{ddp::endpoint{"0.0.0.0", 0}, 0};
      ddp::store_server any_auth{ddp::endpoint{"0.0.0.0", 0}, 0, ddp::make_authenticator(secret, 0)};
      std::fflush(stderr);
      std::string text(4096, '\0');
      const auto n = ::pread(fd, text.data(), text.size(), 0);
      text.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
      const std::string want = "ddp: store listening on 0.0.0.0:" + std::to_string(any.port()) +
                               " without authentication; set DDP_AUTH_TOKEN\n";
      require(text == want, "stderr was '" + text + "'");
    }
  });
  expect_ok(outs);
}

TEST_CASE("auth: an elastic group with a secret re-forms after a loss; a process without it takes no seat") {
  // The store on the launcher's rank 0 (ddprun cannot prove a secret), authenticated like every
  // connection of the group's generations: the stranger, with a wrong secret, is refused at the
  // store before it could register, vote or mark a rank dead.
  const int port = free_port();
  constexpr int stranger = 9;
  auto outs = run_processes({0, 1, 2, stranger}, [&](int code) {
    auto o = opts(code == stranger ? 1 : code, 3, port);
    o.auth_token = code == stranger ? std::string("not-the-group-secret-0123456789") : secret;
    o.elastic_min = 2;
    o.elastic_max = 3;
    o.heartbeat = 500ms;
    if (code == stranger) {
      std::this_thread::sleep_for(500ms);  // the group is training (12 steps of 200 ms)
      ddp::elastic_group eg{o};
      (void)eg.start();
      throw std::runtime_error("a process without the secret took a seat");
    }
    ddp::elastic_group eg{o};
    std::vector<float> w(256, 1.0f + static_cast<float>(code)), g(256, 0.0f);
    std::vector<ddp::tensor_view> params{ddp::make_tensor_view(w, g, "w")};
    std::optional<ddp::data_parallel> dp;
    eg.on_form([&](ddp::process_group& pg) {
      dp.reset();
      dp.emplace(pg, params);
    });
    require(eg.start(), "the first generation formed");
    while (eg.step() < 12) try {
        if (code == 2 && eg.step() == 5) ::raise(SIGKILL);
        std::this_thread::sleep_for(200ms);
        std::fill(g.begin(), g.end(), static_cast<float>(eg.rank() + 1));
        dp->grad_ready(0);
        dp->finish();
        eg.commit([&] {
          for (auto& v : w) v -= 0.01f * g[0];
        });
      } catch (const ddp::error& e) {
        require(eg.recover(e), "the job finished without this rank");
      }
    require(eg.size() == 2 && eg.failures() == 1 && eg.generation() == 1,
            "ended in a group of " + std::to_string(eg.size()) + ", generation " + std::to_string(eg.generation()));
    const auto all = eg.group().all_gather(std::to_string(w[0]));
    require(all[0] == all[1], "weights differ: " + all[0] + " and " + all[1]);
    eg.group().barrier();
    eg.finish();
  }, 60s);
  INFO(ddp_test::summary(outs));
  for (const auto& o : outs) {
    CAPTURE(o.rank);
    CAPTURE(o.message);
    if (o.rank == stranger) {
      CHECK(o.errc == static_cast<int>(ddp::errc::auth_failed));
    } else if (o.rank == 2) {
      CHECK(o.exit_code == 128 + SIGKILL);
    } else {
      CHECK(o.ok());
    }
  }
}
