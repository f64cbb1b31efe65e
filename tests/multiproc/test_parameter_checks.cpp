// No silent no-op: a wrapper over an empty parameter set, or over a set that differs from the
// engine's later gradients (a parameter that never reports, a gradient the engine reallocated),
// is an error naming what is missing, on every rank, and no rank hangs past its deadline. The
// engine here is an engine without an adapter, as a user writes one (dlib's glue, say): a
// parameter_traits specialization that reads the engine's tensors where they are now.
#include <ddp/data_parallel.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "harness.hpp"

using namespace std::chrono_literals;
using namespace ddp_test;

namespace {

constexpr local_group opts{10s};

// An engine that owns its tensors (and may reallocate them, as dlib does when it first runs).
struct engine {
  std::vector<std::string> names;
  std::vector<std::vector<float>> w, g;

  void add(std::string name, std::size_t n) {
    names.push_back(std::move(name));
    w.emplace_back(n, 1.0f);
    g.emplace_back(n, 0.0f);
  }
  std::size_t size() const { return w.size(); }
  // Rank r's gradient of step s: small integers, so the average is exact.
  void backward(int r, int s) {
    for (std::size_t i = 0; i < g.size(); ++i)
      for (std::size_t j = 0; j < g[i].size(); ++j) g[i][j] = static_cast<float>((r + 1) * 4 + static_cast<int>(i + j) + s);
  }
  // Gradient i gets new storage of the same size, as an engine that reallocates does: the old
  // storage is alive while the new one is made, so the address differs.
  void reallocate_grad(std::size_t i) {
    std::vector<float> fresh(g[i].size(), 0.0f);
    g[i].swap(fresh);
  }
};

engine small_engine() {
  engine e;
  e.add("fc1.weight", 12);
  e.add("fc1.bias", 3);
  e.add("fc2.weight", 6);
  e.add("fc2.bias", 2);
  return e;
}

// Every rank ended with a ddp::error of `code` whose message holds each of `parts` (checked in
// the parent: the harness carried each child's what() back), none hung or succeeded.
void check_every_rank(const std::vector<outcome>& outs, ddp::errc code, std::initializer_list<std::string_view> parts) {
  INFO(summary(outs));
  for (const auto& o : outs) {
    CAPTURE(o.rank);
    CHECK(!o.timed_out);
    CHECK(ended_with(o, code, parts) == "");
  }
}

}  // namespace

template <>
struct ddp::parameter_traits<engine> {
  static std::size_t size(const engine& e) { return e.size(); }
  static void* data(const engine& e, std::size_t i) { return const_cast<float*>(e.w[i].data()); }
  static void* grad(const engine& e, std::size_t i) { return const_cast<float*>(e.g[i].data()); }
  static std::size_t numel(const engine& e, std::size_t i) { return e.w[i].size(); }
  static ddp::dtype type(const engine&, std::size_t) { return ddp::dtype::f32; }
  static std::string_view name(const engine& e, std::size_t i) { return e.names[i]; }
};
static_assert(ddp::parameter_set<engine>);

// The dlib user's case: the engine had not allocated its parameters when it was wrapped. Each
// rank used to build a wrapper over nothing, finish() returned, and every rank trained alone.
TEST_CASE("parameter checks: an empty parameter set is errc::invalid_argument on every rank, saying when to wrap") {
  for (const int n : {1, 2, 3}) {
    CAPTURE(n);
    const auto outs = on_ranks(n, opts, [&](ddp::process_group& pg) {
      engine not_yet_allocated;
      ddp::data_parallel dp{pg, not_yet_allocated};
      dp.finish();  // reached only without the check: each rank alone, no error
    }, 40s);
    check_every_rank(outs, ddp::errc::invalid_argument,
                     {"the parameter set is empty", "each rank would train alone",
                      "wrap it after it has allocated them (after the first forward)"});
  }
  // With buffers beside it (a model whose every parameter is frozen): refused as well, as
  // PyTorch's DistributedDataParallel refuses a module with no parameter that requires a gradient.
  const auto outs = on_ranks(2, opts, [&](int r, ddp::process_group& pg) {
    std::vector<float> stats(4, static_cast<float>(r));
    std::vector<ddp::tensor_view> none;
    ddp::data_parallel dp{pg, ddp::with_buffers(none, {ddp::make_buffer_view(std::span{stats}, "bn.stats")})};
  });
  check_every_rank(outs, ddp::errc::invalid_argument,
                   {"the parameter set is empty", "(1 buffers and frozen parameters came with this set)"});
}

TEST_CASE("parameter checks: a set empty on one rank only is errc::mismatch on every rank, naming the count and cause") {
  const auto outs = on_ranks(3, opts, [&](int r, ddp::process_group& pg) {
    engine e = r == 1 ? engine{} : small_engine();  // rank 1 wrapped before its engine allocated
    ddp::data_parallel dp{pg, e};
  });
  check_every_rank(outs, ddp::errc::mismatch,
                   {"ranks disagree on the number of parameters: rank 0 has 4, rank 1 has 0",
                    "rank(s) 1 have no parameters at all: wrapped before the engine allocated them?"});
}

// A parameter the engine never reports (its hook loop skips it): finish() names it, by index
// and name, on every rank, before anything is launched; and the step can still be completed.
TEST_CASE("parameter checks: a parameter that never reports is errc::usage naming it on every rank") {
  const auto outs = on_ranks(2, opts, [&](int r, ddp::process_group& pg) {
    engine e = small_engine();
    ddp::data_parallel dp{pg, e};
    e.backward(r, 0);
    for (std::size_t i = e.size(); i-- > 0;)
      if (i != 2) dp.grad_ready(e, i);
    require_raises([&] { dp.finish(); }, ddp::errc::usage,
                 {"finish() while 1 parameter never became ready this step: parameter 2 ('fc2.weight')"});
    throw ddp::error(ddp::errc::usage, r, "reported");  // every rank got it: the parent checks that all did
  });
  check_every_rank(outs, ddp::errc::usage, {"reported"});
}

// The same on one rank only: that rank names the parameter; the ranks that reported everything
// wait in finish() for a collective it never issued, and must fail, not succeed nor hang: at once,
// naming that rank and the parameter, when its error ends its process (its wrapper, destroyed in
// the middle of the step, posts why before its transports close), and at the deadline, quoting
// its error, when it carries on without finishing the step.
TEST_CASE("parameter checks: a parameter missing on one rank fails that rank naming it, and its peers within the deadline") {
  for (const auto [exits, backend] : {std::pair{true, ddp::backend::automatic}, std::pair{true, ddp::backend::tcp},
                                      std::pair{false, ddp::backend::automatic}, std::pair{false, ddp::backend::tcp}}) {
    CAPTURE(exits);
    CAPTURE(static_cast<int>(backend));
    const auto outs = on_ranks(3, local_group{3s, backend}, [&](int r, ddp::process_group& pg) {
      engine e = small_engine();
      ddp::data_parallel dp{pg, e};
      e.backward(r, 0);
      for (std::size_t i = e.size(); i-- > 0;)
        if (r != 2 || i != 1) dp.grad_ready(e, i);
      if (r != 2) {
        dp.finish();
        throw std::runtime_error("finish() succeeded although rank 2 never reported a parameter");
      }
      if (exits) dp.finish();  // raises, naming the parameter; the process ends with it
      require_raises([&] { dp.finish(); }, ddp::errc::usage, {"parameter 1 ('fc1.bias')"});
      std::this_thread::sleep_for(6s);  // alive, the step never completed: the peers' deadline ends it
      throw ddp::error(ddp::errc::usage, r, "parameter 1 ('fc1.bias') reported missing, then waited");
    }, 40s);
    INFO(summary(outs));
    REQUIRE(outs.size() == 3);
    const auto& bad = outs[2];
    CHECK(bad.errc == static_cast<int>(ddp::errc::usage));
    CHECK_MESSAGE(bad.message.find("parameter 1 ('fc1.bias')") != std::string::npos, bad.message);
    for (int r : {0, 1}) {
      const auto& o = outs[static_cast<std::size_t>(r)];
      CAPTURE(r);
      CHECK(!o.timed_out);
      CHECK(o.exit_code == 1);  // a ddp::error, not the "succeeded" runtime_error (exit 2)
      CHECK(o.seconds < 15);
      // Its wrapper, destroyed mid-step by the error, told them why first; or, alive, it left
      // its error where their timeout quotes it.
      CHECK_MESSAGE(o.message.find("rank 2") != std::string::npos, o.message);
      CHECK_MESSAGE(o.message.find("parameter 1 ('fc1.bias')") != std::string::npos, o.message);
    }
  }
}

// The engine reallocated a gradient after wrapping: the wrapper's captured address is stale.
// grad_ready(params, i) compares where the engine has it now and refuses, naming it; the rank's
// failure reaches its peers, whose finish() fails at once quoting it (on the default reducer's
// shared memory and on tcp).
TEST_CASE("parameter checks: a gradient the engine reallocated is errc::usage naming it; the peers fail quoting it") {
  for (const auto backend : {ddp::backend::automatic, ddp::backend::tcp}) {
    for (const bool everywhere : {true, false}) {
      CAPTURE(static_cast<int>(backend));
      CAPTURE(everywhere);
      const auto outs = on_ranks(2, local_group{5s, backend}, [&](int r, ddp::process_group& pg) {
        engine e = small_engine();
        ddp::data_parallel dp{pg, e};
        for (int s = 0; s < 3; ++s) {
          if (s == 1 && (everywhere || r == 1)) e.reallocate_grad(3);
          e.backward(r, s);
          for (std::size_t i = e.size(); i-- > 0;) dp.grad_ready(e, i);
          dp.finish();
          for (std::size_t j = 0; j < e.g[0].size(); ++j)  // the average reached the engine's gradient
            require(e.g[0][j] == 6.0f + static_cast<float>(j) + static_cast<float>(s),
                    "step " + std::to_string(s) + ": not the average");
        }
        throw std::runtime_error("a reallocated gradient went unnoticed");
      }, 40s);
      INFO(summary(outs));
      const auto& bad = outs[1];
      CHECK(bad.exit_code == 1);
      CHECK(bad.errc == static_cast<int>(ddp::errc::usage));
      CHECK_MESSAGE(bad.message.find("rank 1: grad_ready(params, 3): parameter 3 ('fc2.bias'): its gradient moved: "
                                     "the wrapper captured it at 0x") != std::string::npos,
                    bad.message);
      CHECK_MESSAGE(bad.message.find("(reallocated after wrapping)") != std::string::npos, bad.message);
      const auto& peer = outs[0];
      CHECK(!peer.timed_out);
      CHECK(peer.exit_code == 1);
      CHECK(peer.seconds < 4);  // told at once, not at its 5 s deadline
      CHECK_MESSAGE(peer.message.find("parameter 3 ('fc2.bias'): its gradient moved") != std::string::npos,
                    peer.message);
      if (!everywhere)
        CHECK_MESSAGE(peer.message.find("rank 1 reports: data_parallel failed in grad_ready for parameter 3") !=
                          std::string::npos,
                      peer.message);
    }
  }
}

TEST_CASE("parameter checks: grad_ready(params, i) refuses moved values, a changed size or count, and the wrapper "
          "stays failed") {
  expect_ok(on_ranks(1, opts, [&](int r, ddp::process_group& pg) {
    const auto refused = [&](auto change, std::initializer_list<std::string_view> parts) {
      engine e = small_engine();
      ddp::data_parallel dp{pg, e};
      e.backward(r, 0);
      dp.grad_ready(e, 3);
      change(e);
      require_raises([&] { dp.grad_ready(e, 2); }, ddp::errc::usage, parts);
      // Failed for good: the step is half done, and every later call says why.
      require_raises([&] { dp.grad_ready(e, 1); }, ddp::errc::usage, {"failed earlier", "its"});
    };
    refused([](engine& e) { std::vector<float>(e.w[2].size()).swap(e.w[2]); },
            {"grad_ready(params, 2): parameter 2 ('fc2.weight'): its values moved: the wrapper captured them at 0x"});
    refused([](engine& e) { e.w[2].resize(7); e.g[2].resize(7); },
            {"parameter 2 ('fc2.weight'): it now has 7 elements, the wrapper captured 6"});
    refused([](engine& e) { e.add("fc3.weight", 5); },
            {"the parameter set now holds 5 parameters, the wrapper was built over 4"});
    refused([](engine& e) { e.reallocate_grad(2); }, {"parameter 2 ('fc2.weight'): its gradient moved"});
    // Unchanged: every step goes through, and the plain form is unaffected.
    engine e = small_engine();
    ddp::data_parallel dp{pg, e};
    for (int s = 0; s < 3; ++s) {
      e.backward(r, s);
      for (std::size_t i = e.size(); i-- > 0;) dp.grad_ready(e, i);
      dp.finish();
    }
  }, 40s));
}

// View mode: the engine's gradient may be the captured one (the engine writes bucket_grad(i)
// itself) or bucket memory (an engine pointed at it, as the LibTorch adapter points .grad()).
TEST_CASE("parameter checks: in view mode grad_ready(params, i) accepts the captured gradient and the bucket slot") {
  expect_ok(on_ranks(2, opts, [&](int r, ddp::process_group& pg) {
    engine e = small_engine();
    ddp::data_parallel dp{pg, e, {}, {.gradient_as_bucket_view = true}};
    for (int s = 0; s < 2; ++s) {
      for (std::size_t i = e.size(); i-- > 0;) {
        auto* slot = static_cast<float*>(dp.bucket_grad(i));
        for (std::size_t j = 0; j < e.g[i].size(); ++j) slot[j] = static_cast<float>(r + s);
        dp.grad_ready(e, i);
      }
      dp.finish();
      require(static_cast<float*>(dp.bucket_grad(0))[0] == 0.5f + static_cast<float>(s), "view mode: not the average");
    }
    // The engine's tensors now point at the buckets: still where the wrapper expects them.
    std::vector<ddp::tensor_view> views = dp.views();
    for (std::size_t i = views.size(); i-- > 0;) dp.grad_ready(views, i);
    dp.finish();
  }, 40s));
}
