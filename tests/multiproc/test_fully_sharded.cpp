// The fully sharded mode (ddp::fully_sharded, ZeRO-3) over real processes: units gathered for
// their forward and backward and released between, gradients reduce-scattered, shards stepped;
// the same weights as the unsharded wrapper with the same optimizer on every reducer, the memory
// really given back, prefetch from the recorded order, and the errors of bad use.
#include <ddp/ddp.hpp>

#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <regex>
#include <thread>
#include <string>
#include <vector>

#include "harness.hpp"
#include "hosts.hpp"
#include "toy_model.hpp"

using namespace std::chrono_literals;
using ddp_test::expect_ok;
using ddp_test::free_port;
using ddp_test::group_options;
using ddp_test::local_group;
using ddp_test::on_ranks;
using ddp_test::require;
using ddp_test::require_raises;
using ddp_test::run_ranks;

namespace {

const std::vector<std::size_t> sizes = {1001, 7, 4099, 1, 3333, 2500, 170000, 5, 20000};
// 1008, 4100, 5833 and 190005 elements: under the default whole_below (1e5) the first three stay whole.
const std::vector<std::size_t> units = {2, 2, 2, 3};

/// The forward of unit u: a number from its parameters (read while gathered), which its
/// backward's gradients depend on, with the parameters themselves.
double forward(const ddp_test::toy_model& m, std::size_t first, std::size_t count) {
  double s = 0;
  for (std::size_t i = first; i < first + count; ++i)
    for (float v : m.data<float>(i)) s += v;
  return s;
}
void backward(ddp_test::toy_model& m, std::size_t first, std::size_t count, double f, int rank, int step) {
  for (std::size_t i = first; i < first + count; ++i) {
    auto g = m.grad<float>(i);
    auto p = m.data<float>(i);
    for (std::size_t k = 0; k < g.size(); ++k)
      g[k] += std::sin(0.37f * static_cast<float>(k + 1) + 1.3f * static_cast<float>(i)) *
                  (0.5f + 0.25f * static_cast<float>(rank) + 0.1f * static_cast<float>(step)) *
                  static_cast<float>(1 + 1e-4 * f) +
              0.01f * p[k];
  }
}

struct model : ddp_test::toy_model {
  explicit model(const std::vector<std::size_t>& s = sizes) : toy_model(s) {
    fill_data([](std::size_t i, std::size_t k) { return 0.01f * static_cast<float>((k * 37 + i * 11) % 101) - 0.5f; });
  }
};

/// `steps` fully sharded steps from step `from` (the gradients depend on the step).
template <class FS, class Opt>
void zero3_steps(FS& fs, model& m, Opt& opt, int rank, int from, int steps) {
  std::vector<std::size_t> first(units.size());
  for (std::size_t u = 1; u < units.size(); ++u) first[u] = first[u - 1] + units[u - 1];
  std::vector<double> f(units.size());
  for (int s = from; s < from + steps; ++s) {
    for (std::size_t u = 0; u < units.size(); ++u) {
      fs.gather(u);
      f[u] = forward(m, first[u], units[u]);
      fs.release(u);
    }
    for (std::size_t u = units.size(); u-- > 0;) {
      fs.begin_backward(u);
      backward(m, first[u], units[u], f[u], rank, s);
      fs.end_backward(u);
    }
    fs.finish();
    fs.step(opt);
  }
}

/// The same steps with the unsharded wrapper and the whole optimizer.
template <class Reducer, class Opt>
void train_unsharded(ddp::process_group& pg, model& m, Opt opt, int steps) {
  ddp::basic_data_parallel<ddp::size_planner, Reducer, ddp::host_allocator> dp{pg, m.views};
  std::vector<std::vector<float>> state;
  for (std::size_t i = 0; i < m.size(); ++i) state.emplace_back(opt.state_per_element() * m.numel(i), 0.0f);
  std::size_t first = 0;
  std::vector<double> f(units.size());
  for (int s = 0; s < steps; ++s) {
    first = 0;
    for (std::size_t u = 0; u < units.size(); ++u) {
      f[u] = forward(m, first, units[u]);
      first += units[u];
    }
    for (std::size_t i = 0; i < m.size(); ++i) std::memset(m.grad(i), 0, m.views[i].bytes());
    for (std::size_t u = units.size(); u-- > 0;) {
      first -= units[u];
      backward(m, first, units[u], f[u], pg.rank(), s);
      for (std::size_t i = first + units[u]; i-- > first;) dp.grad_ready(i);
    }
    dp.finish();
    for (std::size_t i = 0; i < m.size(); ++i)
      opt.step(ddp::shard_step{
          0, static_cast<std::uint64_t>(s + 1), m.data<float>(i), m.grad<float>(i), std::span<float>(state[i]), {}});
  }
}

/// The largest difference between the fully sharded and the unsharded weights after `steps`
/// steps, having checked that every rank holds the same fully sharded weights.
template <class Reducer, class Opt>
float against_unsharded(ddp::process_group& pg, Opt opt, int steps, ddp::fully_sharded_options o) {
  model a, b;
  {
    ddp::basic_fully_sharded<Reducer> fs{pg, a.views, units, o};
    zero3_steps(fs, a, opt, pg.rank(), 0, steps);
    if (o.prefetch && steps > 2 && pg.size() > 1)
      require(fs.gathers_prefetched() > 0, "no gather was prefetched in " + std::to_string(steps) + " steps");
    fs.gather_all();  // the trained weights into the engine's tensors, kept when fs goes
  }
  train_unsharded<Reducer>(pg, b, opt, steps);
  const auto all = pg.all_gather(a.data_bytes());
  for (const auto& x : all) require(x == all[0], "ranks hold different fully sharded weights");
  float diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t k = 0; k < a.numel(i); ++k)
      diff = std::max(diff, std::fabs(a.data<float>(i)[k] - b.data<float>(i)[k]));
  return diff;
}

template <class Reducer>
void every_optimizer(int n, float bound, ddp::fully_sharded_options o, const char* hosts = nullptr) {
  CAPTURE(n);
  const int port = free_port();
  expect_ok(run_ranks(
      n,
      [&](int r) {
        if (hosts != nullptr) ddp_test::on_host(hosts, r);
        auto pg = ddp::init_process_group(group_options(r, n, port, 30s));
        const float d1 = against_unsharded<Reducer>(pg, ddp::adamw{{.lr = 0.01, .weight_decay = 0.1}}, 5, o);
        const float d2 = against_unsharded<Reducer>(pg, ddp::sgd{{.lr = 0.05, .momentum = 0.9}}, 4, o);
        require(d1 <= bound && d2 <= bound, "fully sharded against unsharded: " + std::to_string(d1) + " " +
                                                std::to_string(d2) + " (bound " + std::to_string(bound) + ")");
      },
      120s));
}

const ddp::fully_sharded_options all_sharded{.whole_below = 0};

/// Resident bytes of this process (/proc/self/statm).
std::size_t resident() {
  std::ifstream in("/proc/self/statm");
  std::size_t total = 0, rss = 0;
  in >> total >> rss;
  return rss * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

}  // namespace

TEST_CASE(
    "fully sharded AdamW and SGD give the unsharded wrapper's weights: bit for bit on 2 ranks, ring and tree over "
    "tcp") {
  every_optimizer<ddp::ring<ddp::tcp>>(2, 0.0f, all_sharded);
  every_optimizer<ddp::tree<ddp::tcp>>(2, 0.0f, all_sharded);
  // The same code path without the release after forward (ZeRO-2's memory), without prefetch,
  // and with the default threshold (the three small units whole).
  every_optimizer<ddp::ring<ddp::tcp>>(2, 0.0f, {.reshard_after_forward = false, .whole_below = 0});
  every_optimizer<ddp::ring<ddp::tcp>>(2, 0.0f, {.prefetch = false, .whole_below = 0});
  every_optimizer<ddp::ring<ddp::tcp>>(2, 0.0f, {});
}

TEST_CASE("fully sharded on 3 and 4 ranks: every reducer, within float rounding of the unsharded wrapper") {
  every_optimizer<ddp::ring<ddp::tcp>>(3, 1e-5f, all_sharded);
  every_optimizer<ddp::tree<ddp::shm>>(4, 1e-5f, all_sharded);
  every_optimizer<ddp::ring<ddp::shm>>(3, 1e-5f, all_sharded);
  every_optimizer<ddp::auto_reducer>(4, 1e-5f, all_sharded);
  every_optimizer<ddp::auto_reducer>(4, 1e-5f, all_sharded, "aabb");  // hierarchical
}

TEST_CASE("fully sharded memory: 1/N of the parameters between steps, the released pages given back") {
  for (int n : {2, 4}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, local_group{30s}, [&](ddp::process_group& pg) {
      // 8 units of 8 MiB each: 64 MiB of parameters and 64 of gradients.
      ddp_test::toy_model m(std::vector<std::size_t>(8, std::size_t{2} << 20));
      for (std::size_t i = 0; i < m.size(); ++i) {
        std::memset(m.data(i), 1, m.views[i].bytes());
        std::memset(m.grad(i), 1, m.views[i].bytes());
      }
      const std::size_t before = resident();
      ddp::fully_sharded fs{pg, m.views, std::vector<std::size_t>(8, 1)};
      const std::size_t after = resident(), model = fs.model_bytes();
      require(model == std::size_t{64} << 20, "model bytes " + std::to_string(model));
      const std::size_t per_rank = model / static_cast<std::size_t>(pg.size());
      require(fs.param_bytes() <= per_rank + 8 * 2 * 4096,
              "param bytes " + std::to_string(fs.param_bytes()) + " for 1/N = " + std::to_string(per_rank));
      // Parameters and gradients given back, less this rank's shard of the values and the
      // gradient shards (each 1/N), with a margin for the process's own allocations.
      const std::size_t want_drop = 2 * model - 2 * per_rank;
      require(before > after && before - after >= want_drop * 9 / 10,
              "resident " + std::to_string(before >> 20) + " MiB before, " + std::to_string(after >> 20) +
                  " MiB after; expected a drop of " + std::to_string(want_drop >> 20) + " MiB");
      // A unit gathered is resident again, and released it is not.
      fs.gather(3);
      const std::size_t gathered = resident();
      fs.release(3);
      const std::size_t released = resident();
      require(gathered >= after + (8u << 20) * 9 / 10 && released + (8u << 20) * 9 / 10 <= gathered,
              "one unit: " + std::to_string(after >> 20) + " -> " + std::to_string(gathered >> 20) + " -> " +
                  std::to_string(released >> 20) + " MiB");
    }));
  }
}

TEST_CASE("fully sharded bad use: a clear error, on every rank where it is collective") {
  SUBCASE("release twice, gather twice, backward out of turn, a unit without backward") {
    expect_ok(on_ranks(2, local_group{30s}, [&](ddp::process_group& pg) {
      model m;
      ddp::fully_sharded fs{pg, m.views, units, all_sharded};
      fs.gather(0);
      require_raises([&] { fs.gather(0); }, ddp::errc::usage, {"unit 0 is gathered already"});
      fs.release(0);
      require_raises([&] { fs.release(0); }, ddp::errc::usage, {"release(0)", "released twice"});
      require_raises([&] { fs.end_backward(1); }, ddp::errc::usage, {"end_backward(1) without begin_backward(1)"});
      require_raises([&] { fs.gather(9); }, ddp::errc::invalid_argument, {"there are 4 units"});
      for (std::size_t u = 4; u-- > 1;) {
        fs.begin_backward(u);
        fs.end_backward(u);
      }
      require_raises([&] { fs.finish(); }, ddp::errc::usage, {"unit(s) 0 had no backward"});
      fs.begin_backward(0);
      fs.end_backward(0);
      fs.finish();
      fs.gather(2);  // its tensors would keep the values of before the step
      ddp::sgd sgd{{.lr = 0.1}};
      require_raises([&] { fs.step(sgd); }, ddp::errc::usage, {"unit 2 is gathered"});
      fs.release(2);
      require_raises(
          [&] {
            fs.begin_backward(0);
            fs.end_backward(0);
            fs.begin_backward(0);
          },
          ddp::errc::usage, {"ran already in this step"});
    }));
  }
  SUBCASE("units that do not cover the parameters, a parameter without memory") {
    expect_ok(on_ranks(2, local_group{30s}, [&](ddp::process_group& pg) {
      model m;
      require_raises(
          [&] {
            ddp::fully_sharded fs(pg, m.views, {2, 2});
          },
          ddp::errc::invalid_argument, {"the units hold 4 parameters, the model has 9"});
      ddp_test::toy_model lazy;
      lazy.add(0);  // an engine that allocates its parameters at its first forward
      require_raises([&] { ddp::fully_sharded fs(pg, lazy.views, {1}); }, ddp::errc::invalid_argument,
                     {"parameter 0 ('p0') has no elements or no memory yet"});
    }));
  }
  SUBCASE("ranks that gather the units in another order: errc::mismatch on both, naming the units") {
    const auto outs = on_ranks(2, local_group{30s}, [&](ddp::process_group& pg) {
      ddp_test::toy_model m(std::vector<std::size_t>(2, 1000));  // two units of the same size
      ddp::fully_sharded fs{pg, m.views, {1, 1}, all_sharded};
      fs.gather(pg.rank() == 0 ? 0 : 1);
    });
    CHECK(ddp_test::ended_with(outs[0], ddp::errc::mismatch,
                               {"rank 1 gathered unit 1 for its forward", "same order"}) == "");
    CHECK(ddp_test::ended_with(outs[1], ddp::errc::mismatch, {"rank 0 gathered unit 0 for its forward"}) == "");
  }
  SUBCASE("ranks that run the backward in another order: errc::mismatch at finish(), naming both sequences") {
    const auto outs = on_ranks(2, local_group{30s}, [&](ddp::process_group& pg) {
      ddp_test::toy_model m(std::vector<std::size_t>(2, 1000));
      ddp::fully_sharded fs{pg, m.views, {1, 1}, {.reshard_after_forward = false, .whole_below = 0}};
      fs.gather(0), fs.release(0), fs.gather(1), fs.release(1);
      for (std::size_t u : pg.rank() == 0 ? std::vector<std::size_t>{1, 0} : std::vector<std::size_t>{0, 1}) {
        fs.begin_backward(u);
        fs.end_backward(u);
      }
      fs.finish();
    });
    CHECK(ddp_test::ended_with(outs[0], ddp::errc::mismatch, {"different orders", "b1 e1 b0 e0"}) == "");
    CHECK(ddp_test::ended_with(outs[1], ddp::errc::mismatch, {"different orders", "b0 e0 b1 e1"}) == "");
  }
  SUBCASE("a parameter touched while its unit is released stops the process, naming it") {
    expect_ok(on_ranks(2, local_group{30s}, [&](ddp::process_group& pg) {
      ddp_test::toy_model m(std::vector<std::size_t>{50000, 3});
      ddp::fully_sharded fs{pg, m.views, {2}, all_sharded};
      int err[2];
      require(::pipe(err) == 0, "pipe");
      const pid_t child = ::fork();
      if (child == 0) {
        ::dup2(err[1], 2);
        // The fault goes on to the default action, not to the test framework's crash report.
        struct sigaction dfl {};
        dfl.sa_handler = SIG_DFL;
        ddp::detail::released::previous() = dfl;
        volatile float x = m.data<float>(0)[20000];  // in a whole page of a released tensor
        std::printf("%f\n", static_cast<double>(x));
        ::_exit(0);
      }
      ::close(err[1]);
      std::string said;
      char buf[512];
      for (ssize_t k; (k = ::read(err[0], buf, sizeof buf)) > 0;) said.append(buf, static_cast<std::size_t>(k));
      int status = 0;
      ::waitpid(child, &status, 0);
      require(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV, "the child was not stopped by SIGSEGV: " + said);
      require(said.find("parameter 0 ('p0') of unit 0 was touched while its unit is released") != std::string::npos,
              "the message: " + said);
      // The partial pages at the ends read as NaN, never a stale value.
      require(std::isnan(m.data<float>(1)[2]), "a released small tensor holds a number");
      fs.gather(0);
      require(!std::isnan(m.data<float>(0)[20000]) && !std::isnan(m.data<float>(1)[2]), "gathered: values");
      fs.release(0);
    }));
  }
}

TEST_CASE(
    "fully sharded checkpoints: written at 2 ranks, loaded at 3, go on as the sharded wrapper loaded from the same "
    "file") {
  ddp_test::temp_dir dir;
  const auto path = dir.path / "ckpt.ddp";
  ddp::adamw opt{{.lr = 0.01, .weight_decay = 0.1}};
  expect_ok(on_ranks(2, local_group{30s}, [&](int r, ddp::process_group& pg) {
    model m;
    ddp::fully_sharded fs{pg, m.views, units, all_sharded};
    zero3_steps(fs, m, opt, r, 0, 3);
    fs.gather_all();
    ddp::save_checkpoint(pg, path, m.views, fs.sharded_state());
    fs.release_all();
  }));
  expect_ok(on_ranks(3, local_group{30s}, [&](int r, ddp::process_group& pg) {
    model a, b;
    {
      ddp::fully_sharded fs{pg, a.views, units, all_sharded};
      fs.gather_all();
      fs.load_sharded_state(ddp::load_checkpoint(pg, path, a.views));
      require(fs.steps() == 3, "steps " + std::to_string(fs.steps()));
      fs.release_all();
      zero3_steps(fs, a, opt, r, 3, 2);
      fs.gather_all();
    }
    {
      // The sharded wrapper (ZeRO-2) from the same file, the same gradients.
      const auto extra = ddp::load_checkpoint(pg, path, b.views);
      ddp::data_parallel dp{pg, b.views, {.cap_bytes = 16 << 10}, {.shard = true}};
      dp.load_sharded_state(extra);
      std::size_t first = 0;
      std::vector<double> f(units.size());
      for (int s = 3; s < 5; ++s) {
        first = 0;
        for (std::size_t u = 0; u < units.size(); ++u) f[u] = forward(b, first, units[u]), first += units[u];
        for (std::size_t i = 0; i < b.size(); ++i) std::memset(b.grad(i), 0, b.views[i].bytes());
        for (std::size_t u = units.size(); u-- > 0;) {
          first -= units[u];
          backward(b, first, units[u], f[u], r, s);
          for (std::size_t i = first + units[u]; i-- > first;) dp.grad_ready(i);
        }
        dp.finish();
        dp.step(opt);
      }
    }
    float diff = 0;
    for (std::size_t i = 0; i < a.size(); ++i)
      for (std::size_t k = 0; k < a.numel(i); ++k)
        diff = std::max(diff, std::fabs(a.data<float>(i)[k] - b.data<float>(i)[k]));
    require(diff <= 1e-5f, "fully sharded against sharded after the checkpoint: " + std::to_string(diff));
    // A blob that is not a state, and a unit released while loading.
    ddp::fully_sharded fs{pg, a.views, units, all_sharded};
    require_raises([&] { fs.load_sharded_state(std::vector<std::byte>(16)); }, ddp::errc::usage,
                   {"unit 0 is released", "gather_all()"});
    fs.gather_all();
    require_raises([&] { fs.load_sharded_state(std::vector<std::byte>(16)); }, ddp::errc::invalid_argument,
                   {"not a shard state"});
  }));
}

TEST_CASE(
    "fully sharded timeline: the gathers on the progress thread, a prefetched one inside the previous unit's forward") {
  ddp_test::temp_dir dir;
  const std::string base = (dir.path / "fs").string();
  constexpr int steps = 4;
  expect_ok(on_ranks(2, local_group{30s}, [&](ddp::process_group& pg) {
    model m;
    ddp::fully_sharded_options o = all_sharded;
    o.timeline = base;
    ddp::fully_sharded fs{pg, m.views, units, o};
    ddp::adamw opt{{.lr = 0.01}};
    std::vector<std::size_t> first(units.size());
    for (std::size_t u = 1; u < units.size(); ++u) first[u] = first[u - 1] + units[u - 1];
    for (int s = 0; s < steps; ++s) {
      for (std::size_t u = 0; u < units.size(); ++u) {
        fs.gather(u);
        std::this_thread::sleep_for(30ms);  // the unit's compute, under which the next one is gathered
        fs.release(u);
      }
      for (std::size_t u = units.size(); u-- > 0;) {
        fs.begin_backward(u);
        backward(m, first[u], units[u], 1.0, pg.rank(), s);
        fs.end_backward(u);
      }
      fs.finish();
      fs.step(opt);
    }
  }));
  const std::regex event(
      R"re("name":"([^"]+)","cat":"ddp","ph":"X","pid":(\d+),"tid":(\d+),"ts":([0-9.]+),"dur":([0-9.]+))re");
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    std::ifstream in(base + ".rank" + std::to_string(r) + ".json");
    REQUIRE(in.good());
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    CHECK(text.find("\"steps_recorded\":" + std::to_string(steps)) != std::string::npos);
    struct span {
      std::string name;
      long tid;
      double a, z;
    };
    std::vector<span> spans;
    for (auto it = std::sregex_iterator(text.begin(), text.end(), event); it != std::sregex_iterator(); ++it)
      spans.push_back({(*it)[1], std::stol((*it)[3]), std::stod((*it)[4]), std::stod((*it)[4]) + std::stod((*it)[5])});
    int step_spans = 0, gathers = 0, scatters = 0, inside = 0;
    for (const auto& g : spans) {
      step_spans += g.name.rfind("step ", 0) == 0 ? 1 : 0;
      scatters += g.name.rfind("reduce-scatter unit ", 0) == 0 ? 1 : 0;
      if (g.name.rfind("all-gather unit ", 0) != 0) continue;
      ++gathers;
      const std::size_t u = std::stoul(g.name.substr(16));
      for (const auto& f : spans)  // the previous unit's forward, on another thread, holds this all-gather
        if (u > 0 && f.name == "forward unit " + std::to_string(u - 1) && f.tid != g.tid && f.a <= g.a && g.z <= f.z)
          ++inside;
    }
    CHECK(step_spans == steps);
    CHECK(scatters == steps * static_cast<int>(units.size()));
    CHECK(gathers >= steps * static_cast<int>(units.size()));
    // From the second step the order is recorded and the next unit's gather runs under this
    // unit's 30 ms of compute: at least one of the 3 x 3 such gathers inside it even on a busy machine.
    CHECK(inside >= 1);
  }
}

TEST_CASE(
    "fully sharded no_sync: micro-batches accumulated locally, then reduce-scattered, give the unsharded no_sync "
    "weights") {
  constexpr int steps = 3, micro = 3;
  expect_ok(on_ranks(2, local_group{30s}, [&](ddp::process_group& pg) {
    std::vector<std::size_t> first(units.size());
    for (std::size_t u = 1; u < units.size(); ++u) first[u] = first[u - 1] + units[u - 1];
    ddp::adamw opt{{.lr = 0.01, .weight_decay = 0.1}};
    // The backward of micro-batch k of step s (its gradients differ with k).
    const auto pass = [&](model& m, int s, int k, auto&& around) {
      for (std::size_t u = units.size(); u-- > 0;)
        around(u, [&] { backward(m, first[u], units[u], 1.0 + k, pg.rank(), 10 * s + k); });
    };
    model a, b;
    {
      ddp::fully_sharded fs{pg, a.views, units, all_sharded};
      for (int s = 0; s < steps; ++s) {
        for (int k = 0; k < micro; ++k) {
          std::optional<ddp::fully_sharded::no_sync_guard> acc;
          if (k + 1 < micro) acc.emplace(fs.no_sync());
          for (std::size_t u = 0; u < units.size(); ++u) fs.gather(u), fs.release(u);
          pass(a, s, k, [&](std::size_t u, auto&& bwd) {
            fs.begin_backward(u);
            bwd();
            fs.end_backward(u);
          });
          fs.finish();
          if (k + 1 < micro) require_raises([&] { fs.step(opt); }, ddp::errc::usage, {"accumulated under no_sync()"});
        }
        fs.step(opt);
      }
      fs.gather_all();
    }
    {
      ddp::basic_data_parallel<ddp::size_planner, ddp::auto_reducer, ddp::host_allocator> dp{pg, b.views};
      std::vector<std::vector<float>> state;
      for (std::size_t i = 0; i < b.size(); ++i) state.emplace_back(2 * b.numel(i), 0.0f);
      for (int s = 0; s < steps; ++s) {
        for (std::size_t i = 0; i < b.size(); ++i) std::memset(b.grad(i), 0, b.views[i].bytes());
        for (int k = 0; k < micro; ++k) {
          std::optional<ddp::data_parallel::no_sync_guard> acc;
          if (k + 1 < micro) acc.emplace(dp.no_sync());
          pass(b, s, k, [&](std::size_t u, auto&& bwd) {
            bwd();
            for (std::size_t i = first[u] + units[u]; i-- > first[u];) dp.grad_ready(i);
          });
          dp.finish();
        }
        for (std::size_t i = 0; i < b.size(); ++i)
          opt.step(ddp::shard_step{0,
                                   static_cast<std::uint64_t>(s + 1),
                                   b.data<float>(i),
                                   b.grad<float>(i),
                                   std::span<float>(state[i]),
                                   {}});
      }
    }
    require(a.data_bytes() == b.data_bytes(), "the fully sharded no_sync weights differ from the unsharded ones");
  }));
}
