#include <ddp/data_parallel.hpp>

#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"
#include "toy_model.hpp"

// The timeline of real wrappers in forked ranks (dp_options::timeline): two wrappers of one
// process (copy and view mode) write two files, steps under no_sync() and hooks from two engine
// threads included, and the files pass tests/timeline/check_timeline.py; a rank whose file cannot
// be opened fails construction on every rank.

using namespace std::chrono_literals;
using namespace ddp::literals;

namespace {

using ddp_test::require;

// 8 parameters of different sizes; names that need escaping in JSON.
struct model : ddp_test::toy_model {
  model() {
    for (int i = 0; i < 8; ++i)
      add(64u << (i % 4), ddp::dtype::f32, {}, "layer" + std::to_string(i) + (i == 3 ? ".we\"ird\\name" : ".weight"));
    fill_data(1.0);
  }
};

// One backward: two engine threads, each completing every other parameter, last first.
template <class DP>
void backward(DP& dp, model& m, bool view, int rank) {
  const auto half = [&](std::size_t parity) {
    for (std::size_t i = 8; i-- > 0;) {
      if (i % 2 != parity) continue;
      float* g = view ? static_cast<float*>(dp.bucket_grad(i)) : m.grad<float>(i).data();
      for (std::size_t k = 0; k < m.numel(i); ++k) g[k] = static_cast<float>(rank + 1);
      dp.grad_ready(i);
    }
  };
  std::thread other(half, 1);
  half(0);
  other.join();
}

std::string checker_command(const std::string& files, const char* extra) {
  return std::string("python3 '") + DDP_TIMELINE_CHECKER + "' " + extra + " " + files;
}

}  // namespace

TEST_CASE("timeline: two wrappers of each rank, copy and view mode, no_sync steps, two engine threads") {
  char tmpl[] = "/tmp/ddp-timeline-wrapper-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  const int n = 2, port = ddp_test::free_port();
  auto outs = ddp_test::run_ranks(n, [&](int r) {
    auto pg = ddp::init_process_group(ddp_test::group_options(r, n, port, 30s));
    model m;
    const ddp::bucket_policy policy{.cap_bytes = 2_KiB, .first_cap_bytes = 512};
    ddp::data_parallel copy{pg, m.views, policy, {.timeline = dir + "/w-{rank}.json"}};
    ddp::data_parallel view{pg, m.views, policy, {.gradient_as_bucket_view = true, .timeline = dir + "/w-{rank}.json"}};
    require(copy.get_timeline() && copy.get_timeline()->path() == dir + "/w-" + std::to_string(r) + ".json",
            "the first wrapper's file");
    require(view.get_timeline() && view.get_timeline()->path() == dir + "/w-" + std::to_string(r) + ".1.json",
            "the second wrapper's file gets .1");
    for (int s = 0; s < 4; ++s) {
      if (s == 1) {
        auto guard = copy.no_sync();
        backward(copy, m, false, r);
        copy.finish();
      } else {
        backward(copy, m, false, r);
        copy.finish();
      }
      backward(view, m, true, r);
      view.finish();
    }
    require(copy.get_timeline()->steps_recorded() == 4, "4 steps recorded");
  });
  INFO(ddp_test::summary(outs));
  REQUIRE(ddp_test::all_ok(outs));
  CHECK(std::system(checker_command(dir + "/w-0.json " + dir + "/w-1.json", "--steps 4").c_str()) == 0);
  CHECK(std::system(checker_command(dir + "/w-0.1.json " + dir + "/w-1.1.json", "--steps 4 --view").c_str()) == 0);
  // The checker can tell the two apart: a view-mode file has no copy back.
  CHECK(std::system(checker_command(dir + "/w-0.1.json", "--steps 4 > /dev/null").c_str()) != 0);
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST_CASE("timeline: a rank whose file cannot be opened fails construction, and so do the others") {
  const int n = 2, port = ddp_test::free_port();
  auto outs = ddp_test::run_ranks(n, [&](int r) {
    auto pg = ddp::init_process_group(ddp_test::group_options(r, n, port, 30s));
    model m;
    const std::string path = r == 1 ? "/nonexistent-ddp-dir/t" : "/tmp/ddp-timeline-wrapper-ok";
    ddp::data_parallel dp{pg, m.views, {}, {.timeline = path}};
  });
  std::remove("/tmp/ddp-timeline-wrapper-ok.rank0.json");
  REQUIRE(outs.size() == 2);
  CHECK_FALSE(outs[0].ok());
  CHECK_FALSE(outs[1].ok());
  CHECK(outs[1].errc == static_cast<int>(ddp::errc::system));
  CHECK(outs[1].message.find("'/nonexistent-ddp-dir/t.rank1.json'") != std::string::npos);
  CHECK(outs[1].message.find("No such file or directory") != std::string::npos);
  CHECK(outs[0].message.find("rank 1 could not set up") != std::string::npos);
  CHECK(outs[0].message.find("timeline file") != std::string::npos);
}

// What another local user can plant at a trace's name (docs/security.md): a link to a file of
// the victim's, a FIFO, a file of their own. Each is refused with what is there, and left as it
// was; a trace that is created is the user's alone (0600).
TEST_CASE("timeline: a link, a FIFO or another user's file at the trace's name is refused and left as it was") {
  char tmpl[] = "/tmp/ddp_timeline_plant_XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string victim = dir + "/victim", base = dir + "/trace", file = base + ".rank0.json";
  auto slurp = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  std::ofstream(victim) << "precious";
  const bool root = ::geteuid() == 0;
  struct plant {
    const char* what;
    const char* found;
  };
  // One rank builds a wrapper that records to `base`.
  auto build = [&] {
    const int port = ddp_test::free_port();
    return ddp_test::run_ranks(1, [&](int r) {
      auto pg = ddp::init_process_group(ddp_test::group_options(r, 1, port, 10s));
      model m;
      ddp::data_parallel dp{pg, m.views, {}, {.timeline = base}};
    }, 30s);
  };
  std::vector<plant> plants = {{"link", "a symbolic link is there"}, {"fifo", "a FIFO is there"}};
  if (root) plants.push_back({"other user's file", "a file of uid 65534 is there"});
  for (const auto& p : plants) {
    CAPTURE(p.what);
    std::remove(file.c_str());
    const std::string what = p.what;
    if (what == "link") REQUIRE(::symlink(victim.c_str(), file.c_str()) == 0);
    if (what == "fifo") REQUIRE(::mkfifo(file.c_str(), 0666) == 0);
    if (what == "other user's file") {
      std::ofstream(file) << "theirs";
      REQUIRE(::chmod(file.c_str(), 0666) == 0);
      REQUIRE(::chown(file.c_str(), 65534, 65534) == 0);
    }
    const auto outs = build();
    INFO(ddp_test::summary(outs));
    REQUIRE(outs.size() == 1);
    CHECK(outs[0].errc == static_cast<int>(ddp::errc::system));
    CHECK(outs[0].message.find("'" + file + "'") != std::string::npos);
    CHECK(outs[0].message.find(p.found) != std::string::npos);
    CHECK(outs[0].seconds < 5.0);
    CHECK(slurp(victim) == "precious");
    if (what == "other user's file") CHECK(slurp(file) == "theirs");
  }
  // Nothing planted: the trace is created owner-only.
  std::remove(file.c_str());
  REQUIRE(ddp_test::all_ok(build()));
  struct stat st {};
  REQUIRE(::lstat(file.c_str(), &st) == 0);
  CHECK(S_ISREG(st.st_mode));
  CHECK((st.st_mode & 0777) == 0600);
  std::system(("rm -rf '" + dir + "'").c_str());
}
