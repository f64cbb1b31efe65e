#include <ddp/data_parallel.hpp>

#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"

// The timeline of real wrappers in forked ranks (dp_options::timeline): two wrappers of one
// process (copy and view mode) write two files, steps under no_sync() and hooks from two engine
// threads included, and the files pass tests/timeline/check_timeline.py; a rank whose file cannot
// be opened fails construction on every rank.

using namespace std::chrono_literals;
using namespace ddp::literals;

namespace {

using ddp_test::require;

// 8 parameters of different sizes; names that need escaping in JSON.
struct model {
  std::vector<std::vector<float>> data, grad;
  std::vector<std::string> names;
  std::vector<ddp::tensor_view> views;
  model() {
    for (int i = 0; i < 8; ++i) {
      const std::size_t n = 64u << (i % 4);
      data.emplace_back(n, 1.0f);
      grad.emplace_back(n, 0.0f);
      names.push_back("layer" + std::to_string(i) + (i == 3 ? ".we\"ird\\name" : ".weight"));
    }
    for (int i = 0; i < 8; ++i)
      views.push_back(ddp::make_tensor_view(std::span{data[i]}, std::span{grad[i]}, names[i]));
  }
};

// One backward: two engine threads, each completing every other parameter, last first.
template <class DP>
void backward(DP& dp, model& m, bool view, int rank) {
  const auto half = [&](std::size_t parity) {
    for (std::size_t i = 8; i-- > 0;) {
      if (i % 2 != parity) continue;
      float* g = view ? static_cast<float*>(dp.bucket_grad(i)) : m.grad[i].data();
      for (std::size_t k = 0; k < m.grad[i].size(); ++k) g[k] = static_cast<float>(rank + 1);
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
