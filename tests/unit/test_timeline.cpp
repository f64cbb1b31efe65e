#include "ddp/data_parallel/timeline.hpp"

#include <doctest/doctest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dp_plan.hpp"

namespace {

std::string json(std::string_view s) {
  std::string out;
  ddp::detail::append_json_string(out, s);
  return out;
}

std::string micros(std::int64_t ns) {
  std::string out;
  ddp::detail::append_micros(out, ns);
  return out;
}

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

// A fresh directory for one test's files, removed at the end.
struct temp_dir {
  std::string path;
  temp_dir() {
    char tmpl[] = "/tmp/ddp-unit-timeline-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    path = tmpl;
  }
  ~temp_dir() { std::system(("rm -rf '" + path + "'").c_str()); }
};

// True when python3 parses `path` as JSON (the judge of validity that is independent of ours).
bool python_parses(const std::string& path) {
  if (std::system("python3 -c 'pass' >/dev/null 2>&1") != 0) return true;  // no python3: not judged here
  return std::system(("python3 -c 'import json,sys; json.load(open(sys.argv[1], encoding=\"utf-8\"))' '" + path + "'")
                         .c_str()) == 0;
}

// One synchronized step of dp_plan's three buckets through `tl`, with no reducer (no requests).
void one_step(ddp::timeline& tl, ddp::bucket_state& st, const ddp::bucket_plan& plan,
              const std::vector<std::string>& names, std::uint64_t step, bool sync = true) {
  st.reset(plan, false);
  st.open(sync);
  for (std::size_t i = 4; i-- > 0;) {
    REQUIRE(st.claim(i));
    st.complete(i, sync);
  }
  const auto t_call = ddp::steady_clock::now();
  if (sync)
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
      const auto t = ddp::steady_clock::now();
      tl.bucket_waited(b, t, ddp::steady_clock::now());
    }
  static const ddp::request none;
  tl.end_step(step, st, plan, names, 0, t_call, true, [](std::size_t) -> const ddp::request& { return none; });
}

}  // namespace

TEST_CASE("timeline JSON: quotes, backslashes and control characters are escaped") {
  CHECK(json("fc1.weight") == "\"fc1.weight\"");
  CHECK(json("a\"b") == "\"a\\\"b\"");
  CHECK(json("a\\b") == "\"a\\\\b\"");
  CHECK(json("\\\"") == "\"\\\\\\\"\"");
  CHECK(json("line\nnext\ttab\rcr\bbs\fff") == "\"line\\nnext\\ttab\\rcr\\bbs\\fff\"");
  CHECK(json(std::string_view("nul\0x", 5)) == "\"nul\\u0000x\"");
  CHECK(json("\x01\x1f") == "\"\\u0001\\u001f\"");
  CHECK(json("del\x7f") == "\"del\x7f\"");  // DEL is allowed in JSON strings
  CHECK(json("") == "\"\"");
}

TEST_CASE("timeline JSON: UTF-8 is kept, bytes that are not UTF-8 become U+FFFD") {
  CHECK(json("caf\xc3\xa9") == "\"caf\xc3\xa9\"");                 // é
  CHECK(json("\xe6\x97\xa5\xe6\x9c\xac") == "\"\xe6\x97\xa5\xe6\x9c\xac\"");  // 日本
  CHECK(json("\xf0\x9f\x98\x80") == "\"\xf0\x9f\x98\x80\"");       // an emoji (4 bytes)
  CHECK(json("a\xff" "b") == "\"a\\ufffdb\"");                     // never a UTF-8 byte
  CHECK(json("\x80") == "\"\\ufffd\"");                            // a lone continuation byte
  CHECK(json("\xe6\x97") == "\"\\ufffd\\ufffd\"");                 // truncated at the end
  CHECK(json("\xc0\xaf") == "\"\\ufffd\\ufffd\"");                 // overlong '/'
  CHECK(json("\xed\xa0\x80") == "\"\\ufffd\\ufffd\\ufffd\"");      // a surrogate
  CHECK(json("\xf4\x90\x80\x80") == "\"\\ufffd\\ufffd\\ufffd\\ufffd\"");  // above U+10FFFF
}

TEST_CASE("timeline JSON: times are exact microseconds with three decimals") {
  CHECK(micros(0) == "0.000");
  CHECK(micros(5) == "0.005");
  CHECK(micros(1234567) == "1234.567");
  CHECK(micros(86400000000000123) == "86400000000000.123");
  CHECK(micros(-1500) == "-1.500");
}

TEST_CASE("timeline file names: .rank<r>.json, {rank}, and a suffix for further wrappers") {
  CHECK(ddp::timeline_file("/tmp/t", 0) == "/tmp/t.rank0.json");
  CHECK(ddp::timeline_file("/tmp/t", 12) == "/tmp/t.rank12.json");
  CHECK(ddp::timeline_file("/tmp/t-{rank}.json", 3) == "/tmp/t-3.json");
  CHECK(ddp::timeline_file("/tmp/{rank}/t{rank}", 3) == "/tmp/3/t3");
  CHECK(ddp::timeline_file("/tmp/t", 1, 1) == "/tmp/t.rank1.1.json");
  CHECK(ddp::timeline_file("/tmp/t-{rank}.json", 2, 3) == "/tmp/t-2.3.json");
  CHECK(ddp::timeline_file("/tmp/t-{rank}", 2, 3) == "/tmp/t-2.3");
}

TEST_CASE("timeline: a step's events, with names that need escaping, make a valid trace") {
  temp_dir d;
  const auto plan = dp_test::three_buckets();
  const std::vector<std::string> names{"p0", "we\"ird\\name\n", "caf\xc3\xa9", "bad\xff"};
  const std::string path = d.path + "/t.json";
  {
    ddp::timeline tl{path, 3, 4};
    ddp::bucket_state st{4, [](std::size_t) {}};
    st.on_ready([&](std::size_t b) { tl.bucket_ready(b); });
    one_step(tl, st, plan, names, 0);
    one_step(tl, st, plan, names, 1, false);
    CHECK(tl.steps_recorded() == 2);
    CHECK(tl.recording());
  }
  const std::string text = read(path);
  CHECK(text.rfind("{\"traceEvents\":[\n", 0) == 0);
  CHECK(text.find("\"process_name\",\"ph\":\"M\",\"pid\":3,\"args\":{\"name\":\"rank 3\"}") != std::string::npos);
  CHECK(text.find("\"thread_name\"") != std::string::npos);
  CHECK(count(text, "\"name\":\"step 0\"") == 1);
  CHECK(count(text, "\"name\":\"step 1 (no_sync)\"") == 1);
  CHECK(count(text, "\"name\":\"wait bucket ") == 3);
  CHECK(count(text, "\"name\":\"copy back bucket ") == 3);
  CHECK(count(text, "\"name\":\"bucket 2 ready\"") == 1);
  CHECK(text.find("\"names\":[\"bad\\ufffd\",\"caf\xc3\xa9\"]") != std::string::npos);  // bucket 0 = {p3, p2}
  CHECK(text.find("\"names\":[\"we\\\"ird\\\\name\\n\"]") != std::string::npos);      // bucket 1 = {p1}
  CHECK(text.find("\"steps_recorded\":2") != std::string::npos);
  CHECK(text.find("\"stopped_at_limit\":false") != std::string::npos);
  CHECK(text.substr(text.size() - 3) == "}}\n");
  CHECK(python_parses(path));
}

TEST_CASE("timeline: the step limit stops recording and the file says so") {
  temp_dir d;
  const auto plan = dp_test::three_buckets();
  const std::vector<std::string> names{"a", "b", "c", "d"};
  const std::string path = d.path + "/t.json";
  {
    ddp::timeline tl{path, 0, 1, 2};
    ddp::bucket_state st{4, [](std::size_t) {}};
    for (std::uint64_t s = 0; s < 5; ++s) one_step(tl, st, plan, names, s);
    CHECK(tl.steps_recorded() == 2);
    CHECK_FALSE(tl.recording());
  }
  const std::string text = read(path);
  CHECK(count(text, "\"name\":\"step ") == 2);
  CHECK(text.find("\"name\":\"timeline stopped after 2 steps\"") != std::string::npos);
  CHECK(text.find("\"stopped_at_limit\":true") != std::string::npos);
  CHECK(python_parses(path));
}

TEST_CASE("timeline: a file that cannot be opened is an error naming it and the reason") {
  try {
    ddp::timeline tl{"/nonexistent-ddp-dir/t.json", 2, 4};
    FAIL("no error");
  } catch (const ddp::error& e) {
    const std::string msg = e.what();
    CHECK(e.code() == ddp::errc::system);
    CHECK(msg.find("rank 2") != std::string::npos);
    CHECK(msg.find("'/nonexistent-ddp-dir/t.json'") != std::string::npos);
    CHECK(msg.find("No such file or directory") != std::string::npos);
  }
  // A FIFO nobody reads, and one somebody reads: an error, never a constructor blocked for
  // ever, nor a trace into a pipe.
  temp_dir d;
  const std::string fifo = d.path + "/fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH_AS(ddp::timeline(fifo, 0, 1), doctest::Contains("cannot open it: a FIFO is there"), ddp::error);
  const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  REQUIRE(reader >= 0);
  CHECK_THROWS_WITH_AS(ddp::timeline(fifo, 0, 1), doctest::Contains("cannot open it: a FIFO is there"), ddp::error);
  ::close(reader);
  // A device: refused before anything is written to it.
  if (::access("/dev/full", W_OK) == 0)
    CHECK_THROWS_WITH_AS(ddp::timeline("/dev/full", 0, 1), doctest::Contains("cannot open it: a device is there"),
                         ddp::error);
}

TEST_CASE("timeline::open: dp_options::timeline, DDP_TIMELINE, DDP_TIMELINE_STEPS, and a second wrapper's file") {
  temp_dir d;
  ::unsetenv("DDP_TIMELINE");
  ::unsetenv("DDP_TIMELINE_STEPS");
  CHECK(ddp::timeline::open(ddp::dp_options{}, 0, 1) == nullptr);
  ddp::dp_options o;
  o.timeline = d.path + "/opt";
  auto a = ddp::timeline::open(o, 1, 2);
  auto b = ddp::timeline::open(o, 1, 2);  // the same process, the same name: a suffix
  REQUIRE(a);
  REQUIRE(b);
  CHECK(a->path() == d.path + "/opt.rank1.json");
  CHECK(b->path() == d.path + "/opt.rank1.1.json");
  ::setenv("DDP_TIMELINE", (d.path + "/env-{rank}.json").c_str(), 1);
  auto c = ddp::timeline::open(ddp::dp_options{}, 5, 8);
  REQUIRE(c);
  CHECK(c->path() == d.path + "/env-5.json");
  ::setenv("DDP_TIMELINE_STEPS", "0", 1);
  CHECK_THROWS_WITH_AS(ddp::timeline::open(ddp::dp_options{}, 0, 1), doctest::Contains("DDP_TIMELINE_STEPS=0"),
                       ddp::error);
  ::setenv("DDP_TIMELINE_STEPS", "12x", 1);
  CHECK_THROWS_WITH_AS(ddp::timeline::open(ddp::dp_options{}, 0, 1), doctest::Contains("not a positive number"),
                       ddp::error);
  ::unsetenv("DDP_TIMELINE_STEPS");
  ::unsetenv("DDP_TIMELINE");
}

TEST_CASE("timeline: a forked child never writes into the parent's file") {
  temp_dir d;
  const auto plan = dp_test::three_buckets();
  const std::vector<std::string> names{"a", "b", "c", "d"};
  const std::string path = d.path + "/t.json";
  {
    auto tl = std::make_unique<ddp::timeline>(path, 0, 1);
    ddp::bucket_state st{4, [](std::size_t) {}};
    one_step(*tl, st, plan, names, 0);  // buffered, not written yet
    std::fflush(nullptr);  // the child must not print what the parent buffered
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      // The child's copy: destroying it and a normal exit must leave the file alone.
      tl.reset();
      std::exit(0);
    }
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    REQUIRE(WIFEXITED(status));
    one_step(*tl, st, plan, names, 1);
  }
  const std::string text = read(path);
  CHECK(count(text, "\"name\":\"step 0\"") == 1);
  CHECK(count(text, "\"name\":\"step 1\"") == 1);
  CHECK(count(text, "\"otherData\"") == 1);
  CHECK(python_parses(path));
}

TEST_CASE("timeline: reducers note when collectives start only while a timeline lives") {
  temp_dir d;
  const int before = ddp::detail::timed_collectives().load();
  {
    ddp::timeline a{d.path + "/a.json", 0, 1};
    CHECK(ddp::detail::timed_collectives().load() == before + 1);
    {
      ddp::timeline b{d.path + "/b.json", 0, 1};
      CHECK(ddp::detail::timed_collectives().load() == before + 2);
    }
    CHECK(ddp::detail::timed_collectives().load() == before + 1);
  }
  CHECK(ddp::detail::timed_collectives().load() == before);
  CHECK_THROWS_AS(ddp::timeline(d.path + "/no-such-dir/c.json", 0, 1), ddp::error);
  CHECK(ddp::detail::timed_collectives().load() == before);  // a failed open counts nothing
  // What a worker records for a timeline: the start, and the thread it ran on.
  ddp::request r{std::make_shared<ddp::detail::request_state>()};
  CHECK(r.started_at() == ddp::steady_clock::time_point{});
  CHECK(r.thread_id() == 0);
  auto s = std::make_shared<ddp::detail::request_state>();
  std::thread([&] {
    s->start();
    s->complete();
  }).join();
  ddp::request done{s};
  CHECK(done.test());
  CHECK(done.started_at() <= done.finished_at());
  CHECK(done.started_at() != ddp::steady_clock::time_point{});
  CHECK(done.thread_id() > 0);
  CHECK(done.thread_id() != ddp::detail::os_thread_id());
}

TEST_CASE("timeline: a file another process records into is never shared; the next suffix is used") {
  // A process can be rank 0 of one group and rank 1 of another while its peer is the reverse:
  // per-process counting alone gives both the same two names, and two writers corrupt both files.
  temp_dir d;
  ddp::dp_options o;
  o.timeline = d.path + "/x";
  int ready[2], done[2];
  REQUIRE(::pipe(ready) == 0);
  REQUIRE(::pipe(done) == 0);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int code = 0;
    {
      auto mine = ddp::timeline::open(o, 0, 2);  // the other process's rank 0 file
      code = mine && mine->path() == d.path + "/x.rank0.json" ? 0 : 3;
      char c = 1;
      if (::write(ready[1], &c, 1) != 1 || ::read(done[0], &c, 1) != 1) code = 4;
    }
    std::_Exit(code);
  }
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  {
    auto a = ddp::timeline::open(o, 0, 2);  // this process's first one with that name
    REQUIRE(a);
    CHECK(a->path() == d.path + "/x.rank0.1.json");
    // The constructor that takes a path says so rather than truncating the other's trace.
    CHECK_THROWS_WITH_AS(ddp::timeline(d.path + "/x.rank0.json", 0, 2), doctest::Contains("another timeline records into it"),
                         ddp::error);
    REQUIRE(::write(done[1], &c, 1) == 1);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  }
  CHECK(python_parses(d.path + "/x.rank0.json"));
  CHECK(python_parses(d.path + "/x.rank0.1.json"));
  for (int fd : {ready[0], ready[1], done[0], done[1]}) ::close(fd);
}
