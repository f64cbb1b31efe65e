#include <ddp/reducer/flight_recorder.hpp>

#include <doctest/doctest.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ddp/data_parallel.hpp>
#include <ddp/reducer/auto.hpp>
#include <ddp/reducer/hooked.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/transport/tcp.hpp>

#include "harness.hpp"

// Hang forensics (docs/forensics.md): a rank that stops in the middle of a
// step (here: it sleeps before one of its gradients) leaves the others waiting in that bucket's
// allreduce; they time out and write their flight records, the stuck rank writes its own on
// DDP_FLIGHT_RECORDER_SIGNAL, and tools/ddp_forensics.py names the rank, the collective and the
// bucket. Also the record of one process (entries, tags, states), its switch, and its file.

using namespace std::chrono_literals;
using namespace ddp::literals;
using ddp_test::require;

namespace {

std::string temp_dir() {
  char tmpl[] = "/tmp/ddp-forensics-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  return tmpl;
}

bool exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

std::string read_file(const std::string& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Runs the reader; its stdout and stderr, and its exit status in `status`.
std::string forensics(const std::string& args, int& status) {
  const std::string cmd = std::string("python3 '") + DDP_FORENSICS_TOOL + "' " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = ::pclose(p);
  status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}

// Waits up to `limit` for `path` to exist.
bool wait_for(const std::string& path, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!exists(path)) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

}  // namespace

namespace {

// One run: ranks 0 and 2 of 3 wait in the bucket rank 1 stopped before, over `backend`.
void stuck_rank_verdict(ddp::backend backend) {
  const std::string which = std::string("backend ") + ddp::backend_name(backend);
  INFO(which);
  const std::string dir = temp_dir();
  const int n = 3, port = ddp_test::free_port();
  constexpr int stuck = 1;         // the rank that stops
  constexpr std::size_t stop = 3;  // before this gradient, in its third step
  auto outs = ddp_test::run_ranks(
      n,
      [&](int r) {
        ::setenv("DDP_FLIGHT_RECORDER", (dir + "/fr-{rank}.json").c_str(), 1);
        ::setenv("DDP_FLIGHT_RECORDER_SIGNAL", "SIGUSR1", 1);
        auto o = ddp_test::group_options(r, n, port, 1s);
        o.backend = backend;
        auto pg = ddp::init_process_group(o);
        // 6 parameters of 4 KiB, one bucket each: backward (last first) launches bucket b as
        // parameter 5 - b becomes ready.
        std::vector<std::vector<float>> data(6, std::vector<float>(1024, 1.0f)), grad = data;
        std::vector<ddp::tensor_view> views;
        for (std::size_t i = 0; i < 6; ++i)
          views.push_back(ddp::make_tensor_view(std::span{data[i]}, std::span{grad[i]}));
        ddp::data_parallel dp{pg, views, ddp::bucket_policy{.cap_bytes = 4_KiB, .first_cap_bytes = 4_KiB}};
        try {
          for (int step = 0; step < 3; ++step) {
            for (std::size_t i = 6; i-- > 0;) {
              if (step == 2 && r == stuck && i == stop) {
                // Stopped in compute: say which bucket waits, then sleep until the peers have
                // failed and this rank's own record (on the signal) is written.
                std::ofstream(dir + "/stuck.tmp") << ::getpid() << " " << dp.plan().where[stop].first << "\n";
                require(::rename((dir + "/stuck.tmp").c_str(), (dir + "/stuck").c_str()) == 0, "rename");
                require(wait_for(dir + "/fr-" + std::to_string(stuck) + ".json", 20s), "no record after the signal");
                return;
              }
              dp.grad_ready(i);
            }
            dp.finish();
          }
        } catch (const ddp::error&) {
          // A survivor: its record was written as its collective failed. Once both are there,
          // rank 0 signals the stopped rank, as a person at the console would.
          require(wait_for(dir + "/fr-0.json", 10s) && wait_for(dir + "/fr-2.json", 10s), "no survivor's record");
          if (r == 0) {
            require(wait_for(dir + "/stuck", 10s), "the stopped rank never said where it stopped");
            int pid = 0;
            std::ifstream(dir + "/stuck") >> pid;
            require(pid > 0 && ::kill(pid, SIGUSR1) == 0, "cannot signal the stopped rank");
          }
          throw;
        }
        throw std::runtime_error("the step with the stopped rank completed");
      },
      60s);
  INFO(ddp_test::summary(outs));
  // The survivors failed (a timeout, or the abort of the first one to time out); the stopped
  // rank ended when its record was there.
  for (const auto& o : outs) {
    CHECK(!o.timed_out);
    if (o.rank == stuck) {
      CHECK(o.exit_code == 0);
      continue;
    }
    CHECK(o.exit_code == 1);
    const auto c = static_cast<ddp::errc>(o.errc);
    CHECK((c == ddp::errc::timeout || c == ddp::errc::aborted || c == ddp::errc::peer_lost));
  }
  int pid = 0, bucket = -1;
  std::ifstream(dir + "/stuck") >> pid >> bucket;
  REQUIRE(bucket >= 0);
  CHECK(read_file(dir + "/fr-1.json").find("\"reason\":\"signal SIGUSR1\"") != std::string::npos);
  CHECK(read_file(dir + "/fr-0.json").find("\"state\":\"failed\"") != std::string::npos);

  int status = 0;
  const std::string out = forensics("'" + dir + "/fr-0.json' '" + dir + "/fr-1.json' '" + dir + "/fr-2.json'", status);
  MESSAGE(out);        // the verdict, in the test's log
  CHECK(status == 1);  // a collective is stuck
  // "ranks 0, 2 wait in allreduce #K (bucket B, step 2); rank 1 never entered it; its last was
  // #K-1 (bucket B-1, step 2, finished)"
  std::smatch m;
  const std::regex verdict(R"(^ranks 0, 2 wait in allreduce #(\d+) \(bucket (\d+), step 2\); rank 1 never entered it; )"
                           R"(its last was #(\d+) \(bucket (\d+), step 2, finished\)$)");
  const std::string first = out.substr(0, out.find('\n'));
  REQUIRE(std::regex_match(first, m, verdict));
  CHECK(std::stoi(m[2]) == bucket);
  CHECK(std::stoi(m[4]) == bucket - 1);
  CHECK(std::stoull(m[3]) + 1 == std::stoull(m[1]));
  CHECK(out.find("  rank 1: never issued #" + m[1].str()) != std::string::npos);
  CHECK(out.find("record: signal SIGUSR1") != std::string::npos);

  // Without the stopped rank's file (frozen for good), the survivors' records still say it.
  const std::string partial = forensics("--world 3 '" + dir + "/fr-0.json' '" + dir + "/fr-2.json'", status);
  INFO(partial);
  CHECK(status == 1);
  CHECK(partial.rfind("ranks 0, 2 wait in allreduce #" + m[1].str() + " (bucket " + m[2].str() +
                          ", step 2); rank 1 left no record\n",
                      0) == 0);
  std::system(("rm -rf '" + dir + "'").c_str());
}

}  // namespace

TEST_CASE("forensics: a rank stopped before a bucket; the reader names it, the collective and the bucket") {
  stuck_rank_verdict(ddp::backend::automatic);  // ring<shm>: every rank on one host
  stuck_rank_verdict(ddp::backend::tcp);
}

TEST_CASE("forensics: one process's record: entries, the bucket tag, states, the switch, the file") {
  const std::string dir = temp_dir();
  auto outs = ddp_test::run_ranks(1, [&](int) {
    ::unsetenv("DDP_FLIGHT_RECORDER");
    ::unsetenv("DDP_FLIGHT_RECORDER_SIGNAL");
    ::unsetenv("DDP_FLIGHT_RECORDER_ENTRIES");
    auto pg = ddp::init_process_group(ddp_test::group_options(0, 1, ddp_test::free_port(), 5s));
    ddp::auto_reducer red{pg};
    std::vector<float> v(100, 1.0f);
    red.allreduce(std::span<float>{v}, ddp::op::sum);
    // The bucket travels in the call (ddp/bucket_tag.hpp).
    red.allreduce_async(v.data(), v.size(), ddp::dtype::f32, ddp::op::avg, ddp::bucket_tag{.bucket = 7, .step = 3})
        .wait_for(5s);
    red.barrier();
    const std::string t = ddp::flight_recorder::text("checked");
    require(t.find("\"reason\":\"checked\"") != std::string::npos, t);
    require(t.find("{\"seq\":1,\"kind\":\"allreduce\",\"state\":\"finished\",\"error\":null,\"bucket\":-1,"
                   "\"step\":-1,\"count\":100,\"bytes\":400,\"dtype\":\"f32\",\"op\":\"sum\"") != std::string::npos,
            t);
    require(t.find("{\"seq\":2,\"kind\":\"allreduce\",\"state\":\"finished\",\"error\":null,\"bucket\":7,"
                   "\"step\":3,") != std::string::npos,
            t);
    require(t.find("{\"seq\":3,\"kind\":\"barrier\",\"state\":\"finished\"") != std::string::npos, t);
    require(t.find("\"issued\":3,\"capacity\":2048") != std::string::npos, t);
    require(ddp::flight_recorder::file().empty(), "a file without DDP_FLIGHT_RECORDER");
    {
      // A hooked reducer's hook runs as a job on the inner reducer's progress thread: the hook
      // receives the issuer's tag and passes it to the inner collective.
      ddp::hooked<ddp::auto_reducer> hk{pg};
      hk.allreduce_async(v.data(), v.size(), ddp::dtype::f32, ddp::op::sum, ddp::bucket_tag{.bucket = 5, .step = 9})
          .wait_for(5s);
      const std::string h = ddp::flight_recorder::text();
      require(h.find("{\"seq\":1,\"kind\":\"allreduce\",\"state\":\"finished\",\"error\":null,\"bucket\":5,"
                     "\"step\":9,") != std::string::npos,
              h);
    }

    // Written whole, and a link planted at the name is replaced, not written through.
    const std::string target = dir + "/target", link = dir + "/record.json";
    std::ofstream(target) << "untouched";
    require(::symlink(target.c_str(), link.c_str()) == 0, "symlink");
    ddp::flight_recorder::write(link, "planted");
    require(read_file(target) == "untouched", "the dump wrote through a link");
    struct stat st {};
    require(::lstat(link.c_str(), &st) == 0 && S_ISREG(st.st_mode), "the link was not replaced by the record");
    require(read_file(link).find("\"reason\":\"planted\"") != std::string::npos, "the record's reason");
    bool threw = false;
    try {
      ddp::flight_recorder::write(dir + "/no/such/dir/x.json");
    } catch (const ddp::error& e) {
      threw = e.condition() == ddp::errc::system &&
              std::string(e.what()).find(dir + "/no/such/dir/x.json") != std::string::npos;
    }
    require(threw, "an unwritable record raises errc::system naming the file");

    // Off for reducers built afterwards; a malformed setting names itself.
    ::setenv("DDP_FLIGHT_RECORDER_ENTRIES", "0", 1);
    {
      ddp::auto_reducer quiet{pg};
      quiet.allreduce(std::span<float>{v}, ddp::op::sum);
      const std::string q = ddp::flight_recorder::text();
      require(q.find("\"issued\":1,") == std::string::npos && q.find("\"issued\":3,") != std::string::npos, q);
    }
    ::setenv("DDP_FLIGHT_RECORDER_ENTRIES", "lots", 1);
    threw = false;
    try {
      ddp::auto_reducer bad{pg};
    } catch (const ddp::error& e) {
      threw = e.condition() == ddp::errc::invalid_argument &&
              std::string(e.what()).find("DDP_FLIGHT_RECORDER_ENTRIES=lots") != std::string::npos;
    }
    require(threw, "DDP_FLIGHT_RECORDER_ENTRIES=lots is refused, naming it");
    ::setenv("DDP_FLIGHT_RECORDER_ENTRIES", "16", 1);
    ::setenv("DDP_FLIGHT_RECORDER_SIGNAL", "SIGKILL", 1);
    ::setenv("DDP_FLIGHT_RECORDER", (dir + "/x").c_str(), 1);
    threw = false;
    try {
      ddp::auto_reducer bad{pg};
    } catch (const ddp::error& e) {
      threw = e.condition() == ddp::errc::invalid_argument &&
              std::string(e.what()).find("DDP_FLIGHT_RECORDER_SIGNAL=SIGKILL") != std::string::npos;
    }
    require(threw, "DDP_FLIGHT_RECORDER_SIGNAL=SIGKILL is refused, naming it");
  });
  INFO(ddp_test::summary(outs));
  CHECK(ddp_test::all_ok(outs));
  std::system(("rm -rf '" + dir + "'").c_str());
}
