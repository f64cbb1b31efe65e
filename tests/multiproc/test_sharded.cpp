// The sharded mode (dp_options::shard) over real processes: each bucket reduce-scattered, each
// rank stepping its shard, the parameters all-gathered; the same weights as the unsharded
// wrapper with the same optimizer, on every reducer; memory, checkpoints on another world size,
// and the errors.
#include <ddp/ddp.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "harness.hpp"
#include "hosts.hpp"
#include "toy_model.hpp"

using namespace std::chrono_literals;
using namespace ddp::literals;
using ddp_test::free_port;
using ddp_test::group_options;
using ddp_test::require;
using ddp_test::require_raises;
using ddp_test::run_ranks;
using ddp_test::expect_ok;
using ddp_test::local_group;
using ddp_test::on_ranks;

namespace {

/// Parameters of awkward sizes (none a multiple of 2, 3 or 4 ranks' shards), f32 or narrow.
template <class T>
struct model : ddp_test::toy_model {
  explicit model(const std::vector<std::size_t>& sizes = {1001, 7, 4099, 1, 333, 2500})
      : toy_model(sizes, ddp::dtype_of_v<T>) {
    fill_data([](std::size_t i, std::size_t k) { return 0.01f * static_cast<float>((k * 37 + i * 11) % 101) - 0.5f; });
  }
  /// This rank's gradient of step s: differs by rank, step and element.
  void grads(int rank, int s) {
    fill_grad([&](std::size_t i, std::size_t k) {
      return std::sin(0.37f * static_cast<float>(k + 1) + 1.3f * static_cast<float>(i)) *
             (0.5f + 0.25f * static_cast<float>(rank) + 0.1f * static_cast<float>(s));
    });
  }
};

/// Steps the whole parameter `i` with `opt` (its own state), as the unsharded wrapper's engine would.
template <class Opt>
struct whole_optimizer {
  Opt opt;
  std::vector<std::vector<float>> state;
  std::uint64_t t = 0;
  void step(model<float>& m) {
    ++t;
    if (state.empty())
      for (std::size_t i = 0; i < m.size(); ++i) state.emplace_back(opt.state_per_element() * m.numel(i), 0.0f);
    for (std::size_t i = 0; i < m.size(); ++i)
      opt.step(ddp::shard_step{0, t, m.data<float>(i), m.grad<float>(i), std::span<float>(state[i]), {}});
  }
};

/// `steps` steps of the sharded wrapper and of the unsharded one with the same optimizer; returns
/// the largest weight difference, and checks that every rank holds the same sharded weights.
template <class Reducer, class Allocator, class Opt>
float sharded_against_unsharded(ddp::process_group& pg, Opt opt, int steps, ddp::bucket_policy policy) {
  model<float> a, b;
  const int r = pg.rank();
  {
    ddp::basic_data_parallel<ddp::size_planner, Reducer, Allocator> dp{pg, a.views, policy, {.shard = true}};
    require(dp.shards().world == pg.size() && dp.shards().buckets.size() == dp.plan().buckets.size(), "layout");
    for (int s = 0; s < steps; ++s) {
      a.grads(r, s);
      for (std::size_t i = a.views.size(); i-- > 0;) dp.grad_ready(i);
      dp.finish();
      dp.step(opt);
    }
  }
  {
    ddp::basic_data_parallel<ddp::size_planner, Reducer, Allocator> dp{pg, b.views, policy};
    whole_optimizer<Opt> whole{opt, {}};
    for (int s = 0; s < steps; ++s) {
      b.grads(r, s);
      for (std::size_t i = b.views.size(); i-- > 0;) dp.grad_ready(i);
      dp.finish();
      whole.step(b);
    }
  }
  const auto all = pg.all_gather(a.data_bytes());
  for (const auto& x : all) require(x == all[0], "ranks hold different sharded weights");
  float diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    for (std::size_t k = 0; k < a.numel(i); ++k)
      diff = std::max(diff, std::fabs(a.data<float>(i)[k] - b.data<float>(i)[k]));
  return diff;
}

template <class Reducer, class Allocator = ddp::host_allocator>
void every_optimizer(int n, float bound, ddp::bucket_policy policy, const char* hosts = nullptr) {
  CAPTURE(n);
  const int port = free_port();
  auto outs = run_ranks(n, [&](int r) {
    if (hosts != nullptr) ddp_test::on_host(hosts, r);
    auto pg = ddp::init_process_group(group_options(r, n, port, 30s));
    const float d1 = sharded_against_unsharded<Reducer, Allocator>(pg, ddp::adamw{{.lr = 0.01, .weight_decay = 0.1}}, 4, policy);
    const float d2 = sharded_against_unsharded<Reducer, Allocator>(
        pg, ddp::sgd{{.lr = 0.05, .momentum = 0.9, .weight_decay = 0.01, .nesterov = true}}, 4, policy);
    const float d3 = sharded_against_unsharded<Reducer, Allocator>(pg, ddp::sgd{{.lr = 0.1}}, 3, policy);
    require(d1 <= bound && d2 <= bound && d3 <= bound,
            "sharded against unsharded: " + std::to_string(d1) + " " + std::to_string(d2) + " " + std::to_string(d3));
  }, 120s);
  expect_ok(outs);
}

const ddp::bucket_policy small{.cap_bytes = 8_KiB, .first_cap_bytes = 2_KiB, .rebuild_from_ready_order = true};

}  // namespace

TEST_CASE("sharded AdamW and SGD give the unsharded wrapper's weights: bit for bit on 2 ranks, ring and tree over tcp") {
  every_optimizer<ddp::ring<ddp::tcp>>(2, 0.0f, small);
  every_optimizer<ddp::tree<ddp::tcp>>(2, 0.0f, small);
  every_optimizer<ddp::ring<ddp::tcp>>(2, 0.0f, {});  // one bucket of the default cap after a 1 MiB one
}

TEST_CASE("sharded on 3 and 4 ranks: every reducer, weights within float rounding of the unsharded wrapper's") {
  // Three or more ranks sum in an order that depends on where a shard boundary falls: the
  // reduce-scatter's and the allreduce's orders may differ by one rounding per step.
  every_optimizer<ddp::ring<ddp::tcp>>(3, 1e-5f, small);
  every_optimizer<ddp::tree<ddp::tcp>>(4, 1e-5f, small);
  every_optimizer<ddp::ring<ddp::shm>, ddp::shm_allocator>(3, 1e-5f, small);
  every_optimizer<ddp::tree<ddp::shm>>(4, 1e-5f, small);
  every_optimizer<ddp::auto_reducer, ddp::auto_allocator>(4, 1e-5f, small);
  every_optimizer<ddp::auto_reducer, ddp::auto_allocator>(4, 1e-5f, small, "aabb");  // hierarchical
}

TEST_CASE("sharded f16 and bf16 parameters step f32 master weights; every rank holds the same bits") {
  const int n = 2;
  expect_ok(on_ranks(n, local_group{30s}, [&](int r, ddp::process_group& pg) {
    model<ddp::half> h({513, 9, 2000});
    model<ddp::bfloat16> b({300, 77});
    std::vector<ddp::tensor_view> views = h.views;
    views.insert(views.end(), b.views.begin(), b.views.end());
    // The reference: f32 master weights, gradients averaged as the reducer does (widened, summed
    // in float, rounded once to the element type), the same AdamW.
    std::vector<std::vector<float>> master, state, grad;
    for (const auto& v : views) {
      master.emplace_back(v.numel), state.emplace_back(2 * v.numel, 0.0f), grad.emplace_back(v.numel);
    }
    const auto widen = [&](std::size_t i, std::size_t k) {
      return i < h.size() ? static_cast<float>(h.data<ddp::half>(i)[k])
                          : static_cast<float>(b.data<ddp::bfloat16>(i - h.size())[k]);
    };
    for (std::size_t i = 0; i < views.size(); ++i)
      for (std::size_t k = 0; k < views[i].numel; ++k) master[i][k] = widen(i, k);
    ddp::adamw opt{{.lr = 0.02}};
    ddp::data_parallel dp{pg, views, {.cap_bytes = 2_KiB, .first_cap_bytes = 1_KiB}, {.shard = true}};
    for (int s = 0; s < 3; ++s) {
      h.grads(r, s), b.grads(r, s);
      for (std::size_t i = views.size(); i-- > 0;) dp.grad_ready(i);
      dp.finish();
      dp.step(opt);
      // reference
      model<ddp::half> h0({513, 9, 2000}), h1({513, 9, 2000});
      model<ddp::bfloat16> b0({300, 77}), b1({300, 77});
      h0.grads(0, s), h1.grads(1, s), b0.grads(0, s), b1.grads(1, s);
      const auto avg = [](auto x, auto y) { return (static_cast<float>(x) + static_cast<float>(y)) / 2; };
      for (std::size_t i = 0; i < views.size(); ++i) {
        for (std::size_t k = 0; k < views[i].numel; ++k) {
          if (i < h.size())
            grad[i][k] = static_cast<float>(ddp::half(avg(h0.grad<ddp::half>(i)[k], h1.grad<ddp::half>(i)[k])));
          else
            grad[i][k] = static_cast<float>(
                ddp::bfloat16(avg(b0.grad<ddp::bfloat16>(i - h.size())[k], b1.grad<ddp::bfloat16>(i - h.size())[k])));
        }
        opt.step(ddp::shard_step{0, static_cast<std::uint64_t>(s + 1), std::span<float>(master[i]),
                                 std::span<const float>(grad[i]), std::span<float>(state[i]), {}});
      }
      for (std::size_t i = 0; i < views.size(); ++i)
        for (std::size_t k = 0; k < views[i].numel; ++k) {
          const float want = i < h.size() ? static_cast<float>(ddp::half(master[i][k]))
                                          : static_cast<float>(ddp::bfloat16(master[i][k]));
          require(widen(i, k) == want, "step " + std::to_string(s) + " parameter " + std::to_string(i) + "[" +
                                           std::to_string(k) + "]: " + std::to_string(widen(i, k)) + " against " +
                                           std::to_string(want));
        }
    }
    const auto all = pg.all_gather(h.data_bytes() + b.data_bytes());
    require(all[0] == all[1], "ranks differ");
    // Master weights are state: 4 bytes per element of this rank's shards, beside AdamW's 8.
    require(dp.shard_state_bytes() == 12 * dp.shards().elements, "state bytes " + std::to_string(dp.shard_state_bytes()));
  }, 60s));
}

TEST_CASE("sharded memory: state and gradient shards are 1/N, and one bucket buffer, not one per bucket") {
  const int port = free_port();
  for (int n : {2, 4}) {
    expect_ok(on_ranks(n, local_group{30s}, [&](int r, ddp::process_group& pg) {
      model<float> m(std::vector<std::size_t>(40, 1000));  // 40 parameters of 4000 bytes
      ddp::data_parallel dp{pg, m.views, {.cap_bytes = 8000, .first_cap_bytes = 8000}, {.shard = true}};
      require(dp.plan().buckets.size() == 20, "buckets " + std::to_string(dp.plan().buckets.size()));
      ddp::adamw opt;
      for (int s = 0; s < 3; ++s) {
        m.grads(r, s);
        for (std::size_t i = m.views.size(); i-- > 0;) dp.grad_ready(i);
        dp.finish();
        dp.step(opt);
      }
      const std::size_t total = 40 * 1000, per = total / static_cast<std::size_t>(n);
      require(dp.shards().elements == per, "elements " + std::to_string(dp.shards().elements));
      require(dp.shard_state_bytes() == 8 * per, "AdamW state " + std::to_string(dp.shard_state_bytes()));
      require(dp.shard_gradient_bytes() <= 4 * per + 64 * 20, "gradient shards " + std::to_string(dp.shard_gradient_bytes()));
      // One buffer of the largest bucket, lent to each bucket from its launch to the end of its
      // reduce-scatter, and in step() from the copy of its slice to the end of its all-gather.
      require(dp.bucket_bytes_held() == 8000, "bucket memory held " + std::to_string(dp.bucket_bytes_held()));
    }, 60s));
  }
  (void)port;
}

TEST_CASE("sharded state saved on 3 ranks comes back on 2 (re-sharded), and training goes on") {
  ddp_test::temp_dir dir;
  const auto path = dir.path / "sharded.ddp";
  std::string saved_blob_path = (dir.path / "blob").string();
  {
    const int n = 3;
    auto outs = on_ranks(n, local_group{30s}, [&](int r, ddp::process_group& pg) {
      model<float> m;
      ddp::data_parallel dp{pg, m.views, small, {.shard = true}};
      ddp::adamw opt;
      for (int s = 0; s < 3; ++s) {
        m.grads(r, s);
        for (std::size_t i = m.views.size(); i-- > 0;) dp.grad_ready(i);
        dp.finish();
        dp.step(opt);
      }
      const auto blob = dp.sharded_state();
      require(r == 0 ? !blob.empty() : blob.empty(), "the blob is rank 0's alone");
      ddp::save_checkpoint(pg, path, m.views, blob);
      if (r == 0) ddp_test::write_file(saved_blob_path, std::string(reinterpret_cast<const char*>(blob.data()), blob.size()));
    }, 60s);
    INFO(ddp_test::summary(outs));
    REQUIRE(ddp_test::all_ok(outs));
  }
  const int n = 2;
  expect_ok(on_ranks(n, local_group{30s}, [&](int r, ddp::process_group& pg) {
    model<float> m;
    ddp::data_parallel dp{pg, m.views, {.cap_bytes = 4_KiB, .first_cap_bytes = 4_KiB}, {.shard = true}};
    dp.load_sharded_state(ddp::load_checkpoint(pg, path, m.views));
    // Gathered again from 2 ranks and another plan: the very bytes 3 ranks saved.
    const auto again = dp.sharded_state();
    if (r == 0)
      require(std::string(reinterpret_cast<const char*>(again.data()), again.size()) == ddp_test::read_file(saved_blob_path),
              "the re-sharded state differs from the saved one");
    ddp::adamw opt;
    m.grads(r, 3);
    for (std::size_t i = m.views.size(); i-- > 0;) dp.grad_ready(i);
    dp.finish();
    dp.step(opt);
    // The step count went on from the saved 3: AdamW's bias correction of step 4, not 1.
    require(dp.sharded_steps() == 4, "steps " + std::to_string(dp.sharded_steps()));
  }, 60s));
}

TEST_CASE("sharded with find_unused_parameters: a parameter no rank used keeps its value; the others step") {
  const int n = 2;
  expect_ok(on_ranks(n, local_group{30s}, [&](int r, ddp::process_group& pg) {
    model<float> m;
    ddp::data_parallel dp{pg, m.views, small, {.find_unused_parameters = true, .shard = true}};
    std::vector<std::vector<float>> before;
    for (std::size_t i = 0; i < m.size(); ++i) before.push_back(m.values<float>(i));
    ddp::adamw opt{{.lr = 0.01, .weight_decay = 0.1}};
    m.grads(r, 0);
    for (std::size_t i = m.views.size(); i-- > 0;)
      if (i == 2)
        dp.mark_unused(i);
      else if (i != 4 || r == 0)  // parameter 4: used on rank 0 only, so stepped
        dp.grad_ready(i);
    dp.finish();
    dp.step(opt);
    require(m.values<float>(2) == before[2], "the parameter no rank used moved");
    require(m.values<float>(4) != before[4] && m.values<float>(0) != before[0] && m.values<float>(5) != before[5],
            "a used parameter did not move");
  }, 60s));
}

TEST_CASE("sharded errors: misuse is errc::usage, unsupported combinations errc::unsupported, disagreement errc::mismatch") {
  const int n = 2;
  expect_ok(on_ranks(n, local_group{30s}, [&](int r, ddp::process_group& pg) {
    model<float> m;
    ddp::adamw opt;
    {
      ddp::data_parallel plain{pg, m.views};
      require_raises([&] { plain.step(opt); }, ddp::errc::usage, {"needs the sharded mode"});
      require_raises([&] { (void)plain.sharded_state(); }, ddp::errc::usage, {"needs the sharded mode"});
    }
    require_raises([&] { ddp::data_parallel dp{pg, m.views, {}, {.gradient_as_bucket_view = true, .shard = true}}; },
                   ddp::errc::unsupported, {"gradient_as_bucket_view"});
    {
      std::vector<double> w(10), g(10);
      std::vector<ddp::tensor_view> v{ddp::make_tensor_view(w, g, "double_weight", {10})};
      require_raises([&] { ddp::data_parallel dp{pg, v, {}, {.shard = true}}; }, ddp::errc::unsupported,
                     {"double_weight"});
    }
    ddp::data_parallel dp{pg, m.views, small, {.shard = true}};
    require_raises([&] { dp.step(opt); }, ddp::errc::usage, {"no synchronized finish()"});
    require_raises([&] { dp.on_bucket_reduced([](const ddp::reduced_bucket&) {}); }, ddp::errc::unsupported,
                   {"on_bucket_reduced"});
    const std::vector<std::byte> junk(40, std::byte{7});
    require_raises([&] { dp.load_sharded_state(junk); }, ddp::errc::invalid_argument, {"not a shard state"});
    // Ranks that step different optimizers would diverge in silence: a mismatch naming both.
    m.grads(r, 0);
    for (std::size_t i = m.views.size(); i-- > 0;) dp.grad_ready(i);
    dp.finish();
    ddp::adamw other{{.lr = r == 0 ? 1e-3 : 2e-3}};
    require_raises([&] { dp.step(other); }, ddp::errc::mismatch, {"rank 1 has adamw lr=0.002 "});
  }, 60s));
}

TEST_CASE("sharded: hyperparameters that six decimals print alike (lr 1e-6, 1.4e-6) are a mismatch on every rank") {
  // Compared as "0.000001" both, the ranks would step different learning rates in silence.
  const int n = 2;
  expect_ok(on_ranks(n, local_group{30s}, [&](int r, ddp::process_group& pg) {
    model<float> m;
    ddp::data_parallel dp{pg, m.views, small, {.shard = true}};
    m.grads(r, 0);
    for (std::size_t i = m.views.size(); i-- > 0;) dp.grad_ready(i);
    dp.finish();
    ddp::sgd opt{{.lr = r == 0 ? 1e-6 : 1.4e-6}};
    // Both sides, each exactly and readably.
    require_raises([&] { dp.step(opt); }, ddp::errc::mismatch,
                   {"ranks disagree on the shard optimizer (its signature()): rank 0 has sgd lr=1e-06 momentum=0 "
                    "dampening=0 weight_decay=0 nesterov=0 state=0; rank 1 has sgd lr=1.4e-06 momentum=0 dampening=0 "
                    "weight_decay=0 nesterov=0 state=0"},
                   "step() with lr 1e-6 on rank 0 and 1.4e-6 on rank 1");
  }, 60s));
}

TEST_CASE("sharded: a rank that dies before the step is an error on the survivors' step, not a hang") {
  const int n = 3;
  auto outs = on_ranks(n, local_group{5s}, [&](int r, ddp::process_group& pg) {
    model<float> m;
    ddp::data_parallel dp{pg, m.views, small, {.shard = true}};
    ddp::adamw opt;
    m.grads(r, 0);
    for (std::size_t i = m.views.size(); i-- > 0;) dp.grad_ready(i);
    dp.finish();
    if (r == 2) ::_exit(0);
    try {
      dp.step(opt);
    } catch (const ddp::error& e) {
      require(e.condition() == ddp::errc::peer_lost || e.condition() == ddp::errc::timeout ||
                  e.condition() == ddp::errc::aborted,
              std::string("unexpected: ") + e.what());
      return;
    }
    throw std::runtime_error("step() returned although rank 2 died");
  }, 60s);
  INFO(ddp_test::summary(outs));
  for (const auto& o : outs) CHECK(o.exit_code == 0);
}
