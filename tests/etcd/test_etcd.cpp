// The group's store on a real three-member etcd cluster (scripts/etcd_cluster.sh): the kv_store
// contract on both backends, jobs kept apart, bad input and hostile neighbours, exactly-once
// counters across the loss of the leader, quorum lost and regained, and process groups whose
// only store is etcd.
#include <ddp/etcd.hpp>
#include <ddp/process_group.hpp>
#include <ddp/store.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <functional>
#include <numeric>
#include <random>
#include <thread>

#include "../multiproc/harness.hpp"
#include "etcd_cluster.hpp"

using namespace std::chrono_literals;
using ddp_test::raises;
using ddp_test::require;

namespace {

ddp::deadline_t soon(std::chrono::milliseconds d = 10s) { return ddp::steady_clock::now() + d; }

std::string fresh_job(const char* what) {
  std::random_device rd;
  return std::string(what) + "-" + std::to_string(::getpid()) + "-" + std::to_string(rd());
}

std::unique_ptr<ddp::kv_store> etcd(const std::string& job, int rank = 0, const std::string& suffix = "") {
  return std::make_unique<ddp::etcd_store>(ddp_test::etcd_cluster::get().url(suffix), job, rank, soon());
}

/// What every backend promises (group/kv_store.hpp), on two connections `a` and `b` to one store.
void contract(ddp::kv_store& a, ddp::kv_store& b) {
  a.set("k", "v1");
  CHECK(b.get("k", soon()) == "v1");
  CHECK(b.check("k"));
  CHECK_FALSE(b.check("absent"));
  // A look at an absent key answers at once; a wait answers when another connection sets it.
  const auto t0 = ddp::steady_clock::now();
  CHECK_FALSE(a.try_get("later", 0ms, soon()).has_value());
  CHECK(ddp::steady_clock::now() - t0 < 2s);
  std::thread setter([&] {
    std::this_thread::sleep_for(100ms);
    b.set("later", std::string("x\0y", 3));
  });
  const auto got = a.try_get("later", 5s, soon());
  setter.join();
  REQUIRE(got.has_value());
  CHECK(*got == std::string("x\0y", 3));
  // A wait that runs out answers nothing, after about its time.
  const auto t1 = ddp::steady_clock::now();
  CHECK_FALSE(a.try_get("never", 300ms, soon()).has_value());
  CHECK(ddp::steady_clock::now() - t1 >= 250ms);
  // Counters.
  CHECK(a.add("n", 5) == 5);
  CHECK(b.add("n", -2) == 3);
  CHECK(a.add("n", 0) == 3);
  // Compare-and-set: from absent, from a value, and a failed compare answering the value now.
  CHECK(a.compare_set("c", "", "one") == "one");
  CHECK(b.compare_set("c", "", "two") == "one");
  CHECK(b.compare_set("c", "one", "two") == "two");
  CHECK(a.compare_set("c", "one", "three") == "two");
  // Erase one key, and a prefix.
  CHECK(a.erase("c"));
  CHECK_FALSE(a.erase("c"));
  for (int i = 0; i < 10; ++i) a.set("p/" + std::to_string(i), "x");
  a.set("q", "keep");
  CHECK(b.erase_prefix("p/") == 10);
  CHECK_FALSE(a.check("p/3"));
  CHECK(a.check("q"));
  // Waiting for several keys names those still missing.
  a.set("w/1", "1");
  a.set("w/3", "3");
  const auto missing = b.wait({"w/1", "w/2", "w/3", "w/4"}, 200ms, soon());
  CHECK(missing == std::vector<std::string>{"w/2", "w/4"});
  CHECK(b.wait({"w/1", "w/3"}, soon()).empty());
  // A prefix keeps two groups' keys apart on one store.
  a.set_prefix("g1/");
  b.set_prefix("g2/");
  a.set("same", "1");
  b.set("same", "2");
  CHECK(a.get("same", soon()) == "1");
  CHECK(b.get("same", soon()) == "2");
  CHECK(b.wait({"same", "other"}, 100ms, soon()) == std::vector<std::string>{"other"});
  a.set_prefix("");
  b.set_prefix("");
  CHECK(a.get("g2/same", soon()) == "2");
  // Counters from many connections at once: each add counts once.
  std::atomic<bool> ok{true};
  std::vector<std::thread> ts;
  for (int t = 0; t < 2; ++t)
    ts.emplace_back([&, t] {
      auto& s = t == 0 ? a : b;
      for (int i = 0; i < 50; ++i)
        if (s.add("many", 1) < 1) ok = false;
    });
  for (auto& t : ts) t.join();
  CHECK(ok);
  CHECK(a.add("many", 0) == 100);
}

}  // namespace

TEST_CASE("etcd URLs: endpoints, prefix, credentials and options, and clear errors") {
  auto u = ddp::detail::parse_etcd_url("etcd://10.0.0.1:2379,10.0.0.2:2379,host-c:2379/team/a?ttl=30");
  CHECK(u.endpoints == std::vector<std::string>{"10.0.0.1:2379", "10.0.0.2:2379", "host-c:2379"});
  CHECK(u.prefix == "/team/a");
  CHECK(u.ttl_s == 30);
  CHECK_FALSE(u.tls);
  u = ddp::detail::parse_etcd_url("etcd://ddp:s3cret@[::1]:2379?cacert=/ca.pem");
  CHECK(u.user == "ddp");
  CHECK(u.password == "s3cret");
  CHECK(u.endpoints == std::vector<std::string>{"[::1]:2379"});
  CHECK(u.prefix == "/ddp");
  CHECK(u.tls);
  CHECK(u.shown().find("s3cret") == std::string::npos);
  using ddp::errc;
  CHECK(raises([] { ddp::detail::parse_etcd_url("http://h:1"); }, errc::invalid_argument, {"does not start with etcd://"}) == "");
  CHECK(raises([] { ddp::detail::parse_etcd_url("etcd:///x"); }, errc::invalid_argument, {"names no endpoint"}) == "");
  CHECK(raises([] { ddp::detail::parse_etcd_url("etcd://h1:2379,h2"); }, errc::invalid_argument, {"is not host:port"}) == "");
  CHECK(raises([] { ddp::detail::parse_etcd_url("etcd://h:99999"); }, errc::invalid_argument, {"no port in [1, 65535]"}) == "");
  CHECK(raises([] { ddp::detail::parse_etcd_url("etcd://h:1?tsl=1"); }, errc::invalid_argument, {"unknown option 'tsl'"}) == "");
  CHECK(raises([] { ddp::detail::parse_etcd_url("etcd://nobody@h:1"); }, errc::invalid_argument, {"credentials are not user:password"}) == "");
  // A password never appears in an error.
  try {
    ddp::detail::parse_etcd_url("etcd://u:hunter2@h");
    FAIL("no error");
  } catch (const ddp::error& e) {
    CHECK(std::string(e.what()).find("hunter2") == std::string::npos);
  }
  // Base64 both ways, and the end of a prefix's range.
  for (std::string s : {std::string(), std::string("a"), std::string("ab"), std::string("abc"), std::string("\0\xff\x01z", 4)})
    CHECK(ddp::detail::unbase64(ddp::detail::base64(s)) == s);
  CHECK_FALSE(ddp::detail::unbase64("abc").has_value());
  CHECK_FALSE(ddp::detail::unbase64("ab!=").has_value());
  CHECK(ddp::detail::prefix_end("ab") == "ac");
  CHECK(ddp::detail::prefix_end(std::string("a\xff", 2)) == "b");
}

TEST_CASE("the store URL picks the backend; an unknown scheme or a program without it is a clear error") {
  ddp::init_options o;
  o.store_url = "zk://h:1";
  CHECK(raises([&] { ddp::connect_store(o, nullptr, soon()); }, ddp::errc::usage, {"names the store backend 'zk'"}) == "");
  o.store_url = "h:1";
  CHECK(raises([&] { ddp::connect_store(o, nullptr, soon()); }, ddp::errc::invalid_argument, {"is not a store URL"}) == "");
  // DDP_STORE reaches init_options.
  auto env = ddp::init_options::from_env([](const char* n) -> const char* {
    return std::string_view(n) == "DDP_STORE" ? "etcd://h:1" : nullptr;
  });
  CHECK(env.store_url == "etcd://h:1");
}

TEST_CASE("the kv_store contract holds on the built-in store and on etcd alike") {
  SUBCASE("built-in") {
    ddp::store_server server{ddp::endpoint{"127.0.0.1", 0}, 0};
    ddp::store_client a{"127.0.0.1", server.port(), 0, soon()};
    ddp::store_client b{"127.0.0.1", server.port(), 1, soon()};
    contract(a, b);
  }
  SUBCASE("etcd") {
    const auto job = fresh_job("contract");
    auto a = etcd(job, 0);
    auto b = etcd(job, 1);
    contract(*a, *b);
    // Both connections of the job share its one lease; the job's keys live under its name.
    auto& ea = dynamic_cast<ddp::etcd_store&>(*a);
    CHECK(ea.lease() == dynamic_cast<ddp::etcd_store&>(*b).lease());
    CHECK(ea.key_space() == "/ddp/" + job + "/");
  }
}

TEST_CASE("jobs that share an etcd cluster never see each other's keys") {
  auto a = etcd(fresh_job("one"));
  auto b = etcd(fresh_job("two"));
  auto c = etcd(fresh_job("one"), 0, "/elsewhere");
  a->set("pg/job", "mine");
  CHECK_FALSE(b->check("pg/job"));
  CHECK_FALSE(c->check("pg/job"));
  CHECK(a->add("n", 1) == 1);
  CHECK(b->add("n", 1) == 1);
  CHECK(b->erase_prefix("") >= 1);  // all of b's job, nothing of a's
  CHECK(a->get("pg/job", soon()) == "mine");
}

TEST_CASE("bad input and hostile neighbours on etcd get clear errors naming the store and the key") {
  const auto job = fresh_job("hostile");
  auto s = etcd(job);
  // Another program wrote a counter's key with something that is not a counter.
  s->set("el/r1/n/+/stranger", "not a counter");
  CHECK(raises([&] { s->add("el/r1/n", 1); }, ddp::errc::protocol, {"key 'el/r1/n' holds 13 bytes, not a counter"}) == "");
  // A value larger than etcd takes.
  const std::string huge(2u << 20, 'x');
  CHECK(raises([&] { s->set("big", huge); }, ddp::errc::invalid_argument, {"store value for key 'big' is 2097152 bytes"}) == "");
  CHECK(raises([&] { s->compare_set("big", "", huge); }, ddp::errc::invalid_argument, {"for key 'big'"}) == "");
  CHECK_FALSE(s->unusable());
  s->set("after", "fine");
  CHECK(s->get("after", soon()) == "fine");
  // A bad job id.
  CHECK(raises([] { etcd("a/b"); }, ddp::errc::invalid_argument, {"job id 'a/b'"}) == "");
  // Nothing listens: a timeout naming the endpoints, within the deadline.
  const int port = ddp_test::free_port();
  const auto t0 = ddp::steady_clock::now();
  CHECK(raises([&] {
    ddp::etcd_store x("etcd://127.0.0.1:" + std::to_string(port), "x", 3, soon(1500ms));
  }, ddp::errc::timeout, {"127.0.0.1:" + std::to_string(port)}) == "");
  CHECK(ddp::steady_clock::now() - t0 < 4s);
  // Something that is not etcd answers on the port: a clear error, not a hang.
  ddp::store_server other{ddp::endpoint{"127.0.0.1", 0}, 0};
  CHECK(raises([&] {
    ddp::etcd_store x("etcd://127.0.0.1:" + std::to_string(other.port()), "x", 3, soon(1500ms));
  }, ddp::errc::timeout, {"etcd://127.0.0.1:" + std::to_string(other.port())}) == "");
}

TEST_CASE("etcd: SIGKILL of the leader while counters run costs latency, never a lost or doubled add") {
  auto& cl = ddp_test::etcd_cluster::get();
  const auto job = fresh_job("leader");
  const int leader = cl.leader();
  REQUIRE(leader >= 1);
  constexpr int threads = 4, adds = 150;
  std::vector<std::unique_ptr<ddp::kv_store>> conns;
  for (int t = 0; t < threads; ++t) conns.push_back(etcd(job, t));
  std::atomic<int> done{0};
  std::atomic<bool> failed{false};
  std::string why;
  std::mutex mu;
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&, t] {
      try {
        for (int i = 0; i < adds; ++i) {
          (void)conns[static_cast<std::size_t>(t)]->add("votes", 1, soon(20s));
          ++done;
        }
      } catch (const std::exception& e) {
        failed = true;
        std::lock_guard lk(mu);
        why = e.what();
      }
    });
  while (done.load() < threads * adds / 4 && !failed) std::this_thread::sleep_for(1ms);
  (void)cl.ctl("kill " + std::to_string(leader));
  for (auto& t : ts) t.join();
  INFO(why);
  CHECK_FALSE(failed.load());
  CHECK(conns[0]->add("votes", 0, soon(20s)) == threads * adds);
  // The killed member comes back and catches up.
  CHECK(cl.ctl("restart " + std::to_string(leader)).empty());
  CHECK(cl.ctl("health").find("down") == std::string::npos);
}

TEST_CASE("etcd: without quorum every call fails naming the store within its deadline; quorum back, calls go on") {
  auto& cl = ddp_test::etcd_cluster::get();
  auto s = etcd(fresh_job("quorum"));
  s->set("before", "1");
  (void)cl.ctl("kill 2");
  (void)cl.ctl("kill 3");
  const auto t0 = ddp::steady_clock::now();
  CHECK(raises([&] { s->set("during", "1", soon(2s)); }, ddp::errc::timeout, {"did not answer a request on key 'during' before the deadline"}) == "");
  const auto took = ddp::steady_clock::now() - t0;
  CHECK(took < 5s);
  // Quorum returns within a call's deadline: the call succeeds.
  std::thread back([&] {
    std::this_thread::sleep_for(1s);
    (void)cl.ctl("restart 2");
  });
  s->set("during", "2", soon(30s));
  back.join();
  CHECK(s->get("during", soon()) == "2");
  CHECK(cl.ctl("restart 3").empty());
}

TEST_CASE("process groups of 2 and 4 real processes whose only store is etcd: join, barrier, broadcast, all_gather") {
  const auto url = ddp_test::etcd_cluster::get().url();
  for (int n : {2, 4}) {
    CAPTURE(n);
    const auto job = fresh_job("pg");
    auto outs = ddp_test::run_ranks(n, [&](int r) {
      ddp::init_options o;
      o.rank = r;
      o.world_size = n;
      o.timeout = 20s;
      o.store_url = url;
      o.job_id = job;
      o.master_port = 1;  // unused: nobody serves a store
      auto pg = ddp::init_process_group(o);
      require(pg.rank() == r && pg.size() == n, "rank/size");
      for (int i = 0; i < 5; ++i) pg.barrier();
      std::vector<int> v(1000);
      if (r == n - 1) std::iota(v.begin(), v.end(), 7);
      pg.broadcast(std::span<int>(v), n - 1);
      require(v[999] == 1006, "broadcast");
      auto all = pg.all_gather("rank-" + std::to_string(r));
      for (int q = 0; q < n; ++q) require(all[static_cast<std::size_t>(q)] == "rank-" + std::to_string(q), "all_gather");
      require(pg.store().where().find("etcd://") != std::string::npos, "the group's store is etcd");
    });
    ddp_test::expect_ok(outs);
  }
}

TEST_CASE("etcd's own users: the right password works (its token renewed when it expires); others get clear errors") {
  // A cluster of its own, whose tokens expire after a second, with auth on: user ddp may read
  // and write /ddp/, user outsider nothing.
  ddp_test::etcd_cluster cl("--auth-token-ttl 1");
  const std::string ctl = "ETCDCTL_API=3 etcdctl --command-timeout=5s --endpoints=" + cl.first_endpoint() + " ";
  for (const std::string c :
       {"user add root --new-user-password=rootpw", "role add ddp",
        "role grant-permission ddp --prefix=true readwrite /ddp/", "user add ddp --new-user-password=ddppw",
        "user grant-role ddp ddp", "user add outsider --new-user-password=outpw", "auth enable"})
    REQUIRE_MESSAGE(std::system((ctl + c + " >/dev/null 2>&1").c_str()) == 0, c);
  const auto with = [&](const std::string& cred) {
    auto u = cl.url();
    return "etcd://" + cred + "@" + u.substr(7);
  };
  {
    ddp::etcd_store s(with("ddp:ddppw"), fresh_job("auth"), 0, soon());
    s.set("k", "v");
    CHECK(s.add("n", 2) == 2);
    std::this_thread::sleep_for(2500ms);  // the token expired: the store authenticates again
    CHECK(s.get("k", soon()) == "v");
    CHECK(s.add("n", 1) == 3);
  }
  CHECK(raises([&] { ddp::etcd_store s(with("ddp:wrong"), "x", 0, soon(3s)); }, ddp::errc::auth_failed,
               {"refused user 'ddp'"}) == "");
  CHECK(raises([&] { ddp::etcd_store s(cl.url(), "x", 0, soon(3s)); }, ddp::errc::auth_failed,
               {"requires authentication", "etcd://user:password@"}) == "");
  CHECK(raises([&] { ddp::etcd_store s(with("outsider:outpw"), "x", 0, soon(3s)); }, ddp::errc::auth_failed,
               {"permission denied", "read and write on the prefix /ddp/"}) == "");
}

TEST_CASE("etcd over TLS with client certificates: the URL's files reach libcurl; without them, a clear error") {
  // A one-member cluster of the test's own on HTTPS, with certificates made here by openssl.
  if (std::system("command -v openssl >/dev/null 2>&1") != 0) {
    MESSAGE("openssl is not installed: the TLS case is skipped");
    return;
  }
  char tmpl[] = "/tmp/ddp-etcd-tls-XXXXXX";
  const std::string d = ::mkdtemp(tmpl);
  const std::string make =
      "cd " + d +
      " && openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=ddp-test-ca"
      " && openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1"
      " && printf 'subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth,clientAuth\\n' > ext.cnf"
      " && openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2"
      " -extfile ext.cnf"
      " && openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=ddp"
      " && printf 'extendedKeyUsage=clientAuth\\n' > cext.cnf"
      " && openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2"
      " -extfile cext.cnf";
  REQUIRE(std::system((make + " >/dev/null 2>&1").c_str()) == 0);
  const int client = ddp_test::free_port(), peer = ddp_test::free_port();
  const std::string c = "127.0.0.1:" + std::to_string(client), p = "http://127.0.0.1:" + std::to_string(peer);
  const std::string start = "etcd --name t1 --data-dir " + d + "/data --listen-client-urls https://" + c +
                            " --advertise-client-urls https://" + c + " --listen-peer-urls " + p +
                            " --initial-advertise-peer-urls " + p + " --initial-cluster t1=" + p + " --cert-file " + d +
                            "/server.pem --key-file " + d + "/server.key --client-cert-auth --trusted-ca-file " + d +
                            "/ca.pem >" + d + "/etcd.log 2>&1 & echo $! >" + d + "/pid";
  REQUIRE(std::system(start.c_str()) == 0);
  const std::string files = "?cacert=" + d + "/ca.pem&cert=" + d + "/client.pem&key=" + d + "/client.key";
  {
    ddp::etcd_store s("etcd://" + c + files, fresh_job("tls"), 0, soon(20s));  // retries while it starts
    s.set("k", "v");
    CHECK(s.get("k", soon()) == "v");
    CHECK(s.add("n", 3) == 3);
  }
  // Without the client's certificate the member refuses the handshake: a timeout naming it.
  CHECK(raises([&] { ddp::etcd_store s("etcd://" + c + "?cacert=" + d + "/ca.pem", "x", 0, soon(1500ms)); },
               ddp::errc::timeout, {c}) == "");
  (void)std::system(("kill $(cat " + d + "/pid) 2>/dev/null; sleep 0.3; rm -rf " + d).c_str());
}
