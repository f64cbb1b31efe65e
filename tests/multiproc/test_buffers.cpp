#include <ddp/checkpoint.hpp>
#include <ddp/data_parallel.hpp>
#include <ddp/memory/host_allocator.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/transport/tcp.hpp>

#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness.hpp"
#include "toy_model.hpp"

// The whole model on every rank (docs/engines.md, "What is synchronized"): frozen parameters and
// buffers are rank 0's after construction, buffers follow dp_options::buffers after each
// synchronized step (and sync_buffers()), the step record says which parameters no rank used,
// and checkpoints carry buffers.

using namespace std::chrono_literals;
using namespace ddp_test;

namespace {

// Two trained parameters (toy_model's), one frozen, and three buffers (f32 statistics, an f64 one, an i64 count).
struct model : toy_model {
  std::vector<float> frozen = std::vector<float>(4);
  std::vector<float> mean = std::vector<float>(5);
  std::vector<double> var = std::vector<double>(2);
  std::vector<std::int64_t> count = std::vector<std::int64_t>(1);

  explicit model(int r) {
    add(6, ddp::dtype::f32, {}, "w").add(3, ddp::dtype::f32, {}, "b");
    set(r);
  }
  // Every value of rank r's state, distinct per rank.
  void set(int r) {
    const auto w = data<float>(0), b = data<float>(1);
    for (std::size_t j = 0; j < w.size(); ++j) w[j] = static_cast<float>(r * 100 + j);
    for (std::size_t j = 0; j < b.size(); ++j) b[j] = static_cast<float>(r * 100 + 50 + j);
    for (std::size_t j = 0; j < frozen.size(); ++j) frozen[j] = static_cast<float>(r * 10 + j);
    set_buffers(r, 0);
  }
  void set_buffers(int r, int step) {
    for (std::size_t j = 0; j < mean.size(); ++j) mean[j] = static_cast<float>(r * 4 + step + j);
    for (std::size_t j = 0; j < var.size(); ++j) var[j] = r * 2.0 + step + 0.5;
    count[0] = 1000 * r + step;
  }
  std::vector<ddp::buffer_view> buffers(bool with_frozen = true) {
    std::vector<ddp::buffer_view> out;
    if (with_frozen)
      out.push_back(ddp::make_buffer_view(std::span{frozen}, "frozen", {2, 2}, ddp::buffer_kind::frozen_parameter));
    out.push_back(ddp::make_buffer_view(std::span{mean}, "bn.mean"));
    out.push_back(ddp::make_buffer_view(std::span{var}, "bn.var"));
    out.push_back(ddp::make_buffer_view(std::span{count}, "bn.count"));
    return out;
  }
  auto with_buffers() { return ddp::with_buffers(views, buffers()); }
};

// All gradients ready (value 1), then finish().
template <class DP>
void step(DP& dp) {
  for (std::size_t i = dp.size(); i-- > 0;) dp.grad_ready(i);
  dp.finish();
}

using ring_tcp = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, ddp::host_allocator>;

// Construction makes everything rank 0's; then each mode of dp_options::buffers over 3 steps.
template <class DP>
void buffers_run(ddp::buffer_sync how, const char* label) {
  const int n = 3;
  auto outs = on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
    model m(r);
    auto state = m.with_buffers();
    DP dp{pg, state, {}, {.buffers = how}};
    const model zero(0);
    require(m.values<float>(0) == zero.values<float>(0) && m.values<float>(1) == zero.values<float>(1),
            "parameters are rank 0's after construction");
    require(m.frozen == zero.frozen, "the frozen parameter is rank 0's after construction");
    require(m.mean == zero.mean && m.var == zero.var && m.count == zero.count, "buffers are rank 0's after construction");
    require(dp.buffers().size() == 4 && dp.buffers()[1].name == "bn.mean", "buffers() lists them");
    for (int s = 1; s <= 3; ++s) {
      m.set_buffers(r, s);  // what this rank's forward left
      for (auto& f : m.frozen) f = static_cast<float>(r);  // frozen parameters are not synchronized per step
      step(dp);
      const std::string at = std::string(label) + " step " + std::to_string(s) + " rank " + std::to_string(r) + ": ";
      model own(r), first(0);
      own.set_buffers(r, s);
      first.set_buffers(0, s);
      if (how == ddp::buffer_sync::broadcast) {
        require(m.mean == first.mean && m.var == first.var && m.count == first.count, at + "buffers are not rank 0's");
      } else if (how == ddp::buffer_sync::none) {
        require(m.mean == own.mean && m.var == own.var && m.count == own.count, at + "buffers changed");
      } else {
        for (std::size_t j = 0; j < m.mean.size(); ++j)  // the mean of r * 4 + s + j over r = 0, 1, 2
          require(m.mean[j] == static_cast<float>(4 + s + j), at + "bn.mean[" + std::to_string(j) + "] = " +
                                                                  std::to_string(m.mean[j]));
        require(m.var[0] == 2.0 + s + 0.5, at + "bn.var is not the average");
        require(m.count == first.count, at + "the integer buffer is not rank 0's");
      }
      require(m.frozen[0] == static_cast<float>(r), at + "the frozen parameter was changed after construction");
    }
    // sync_buffers() between steps: rank 0's, whatever the option.
    m.set_buffers(r, 9);
    dp.sync_buffers();
    model first(0);
    first.set_buffers(0, 9);
    require(m.mean == first.mean && m.count == first.count, "sync_buffers() gives rank 0's buffers");
    dp.grad_ready(0);
    require_raises([&] { dp.sync_buffers(); }, ddp::errc::usage, {"middle of a step"}, "sync_buffers() inside a step");
    dp.grad_ready(1);
    dp.finish();
  }, 60s);
  INFO(label << "\n" << summary(outs));
  CHECK(all_ok(outs));
}

}  // namespace

TEST_CASE("buffers: rank 0's at construction, then broadcast, averaged or left alone after each step") {
  buffers_run<ddp::data_parallel>(ddp::buffer_sync::broadcast, "default reducer, broadcast");
  buffers_run<ring_tcp>(ddp::buffer_sync::broadcast, "ring<tcp>, broadcast");
  buffers_run<ring_tcp>(ddp::buffer_sync::average, "ring<tcp>, average");
  buffers_run<ddp::data_parallel>(ddp::buffer_sync::average, "default reducer, average");
  buffers_run<ring_tcp>(ddp::buffer_sync::none, "ring<tcp>, none");
  CHECK(ddp::dp_options{}.buffers == ddp::buffer_sync::broadcast);
}

TEST_CASE("buffers: ranks with other buffers fail at construction naming the buffer") {
  const int n = 2;
  auto outs = on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
    model m(r);
    auto bufs = m.buffers();
    if (r == 1) bufs[2] = ddp::make_buffer_view(std::span{m.var}.first(1), "bn.var");
    ring_tcp dp{pg, ddp::with_buffers(m.views, bufs)};
  }, 30s);
  for (const auto& o : outs) {
    CAPTURE(o.message);
    CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
    CHECK(o.message.find("buffer 2 ('bn.var')") != std::string::npos);
    CHECK(o.message.find("rank 0 has f64[2], rank 1 has f64[1]") != std::string::npos);
  }
  outs = on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
    model m(r);
    auto bufs = m.buffers();
    if (r == 1) bufs.pop_back();
    ring_tcp dp{pg, ddp::with_buffers(m.views, bufs)};
  }, 30s);
  for (const auto& o : outs) {
    CAPTURE(o.message);
    CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
    CHECK(o.message.find("ranks disagree on the number of buffers: rank 0 has 4, rank 1 has 3; the first differing is "
                         "buffer 3") != std::string::npos);
  }
}

TEST_CASE("find_unused_parameters: unused_on_every_rank() after the step, no_sync() accumulation counts as used") {
  const int n = 3;
  expect_ok(on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
    std::vector<float> d(12), g(12);
    std::vector<ddp::tensor_view> views;
    for (int i = 0; i < 4; ++i)
      views.push_back(ddp::make_tensor_view(std::span{d}.subspan(3 * i, 3), std::span{g}.subspan(3 * i, 3),
                                            i == 0 ? "a" : i == 1 ? "b" : i == 2 ? "c" : "d"));
    ring_tcp dp{pg, views, {}, {.find_unused_parameters = true}};
    // Step 1: every rank uses a; rank 1 also b; nobody c or d.
    dp.grad_ready(0);
    if (r == 1) dp.grad_ready(1);
    dp.finish();
    require(!dp.unused_on_every_rank(0) && !dp.unused_on_every_rank(1), "a and b were used");
    require(dp.unused_on_every_rank(2) && dp.unused_on_every_rank(3), "c and d were used by no rank");
    // Step 2: rank 2 accumulates c under no_sync(), then the synchronized step uses only a.
    if (r == 2) {
      auto acc = dp.no_sync();
      dp.grad_ready(2);
      dp.finish();
    } else {
      auto acc = dp.no_sync();
      dp.grad_ready(0);
      dp.finish();
    }
    dp.grad_ready(0);
    dp.finish();
    require(!dp.unused_on_every_rank(2), "c, accumulated on rank 2, counts as used");
    require(dp.unused_on_every_rank(1) && dp.unused_on_every_rank(3), "b and d were used by no rank in step 2");
  }, 30s));
}

TEST_CASE("uneven inputs: the buffers come from the highest rank still training") {
  const int n = 3;
  expect_ok(on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
    model m(r);
    auto state = m.with_buffers();
    ring_tcp dp{pg, state, {}, {.uneven_inputs = true}};
    const int batches = r == 1 ? 3 : 1;  // rank 1 trains alone for two steps, ranks 0 and 2 join
    for (int s = 0; s < batches; ++s) {
      m.set_buffers(r, s + 1);
      step(dp);
      model want(0);
      want.set_buffers(s == 0 ? 2 : 1, s + 1);
      require(m.mean == want.mean && m.count == want.count,
              "step " + std::to_string(s) + ": the buffers are not rank " + (s == 0 ? "2" : "1") + "'s");
    }
    dp.join();
    model want(0);
    want.set_buffers(1, 3);
    require(m.mean == want.mean && m.count == want.count, "after join(): every rank holds rank 1's last buffers");
  }, 30s));
}

TEST_CASE("checkpoints carry buffers and frozen parameters") {
  const int n = 2, port = free_port();
  const auto path = std::filesystem::temp_directory_path() / ("ddp_buffers_" + std::to_string(::getpid()) + ".ddp");
  auto outs = run_ranks(n, [&](int r) {
    auto pg = ddp::init_process_group(group_options(r, n, port, 20s));
    model m(0);
    auto state = m.with_buffers();
    ddp::save_checkpoint(pg, path, state);
    model other(r + 5);
    auto into = other.with_buffers();
    ddp::load_checkpoint(pg, path, into);
    require(other.frozen == m.frozen && other.mean == m.mean && other.var == m.var && other.count == m.count,
            "the loaded buffers are the saved ones");
    require_raises([&] { ddp::load_checkpoint(pg, path, other.views); }, ddp::errc::mismatch, {},
                   "without buffers: another model");
  }, 30s);
  std::filesystem::remove(path);
  expect_ok(outs);
}

TEST_CASE("buffers with find_unused_parameters are rank 0's; a world of one knows which parameters it left unused") {
  const int n = 3;
  auto outs = on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
    model m(r);
    auto state = m.with_buffers();
    ring_tcp dp{pg, state, {}, {.find_unused_parameters = true}};
    m.set_buffers(r, 1);
    dp.grad_ready(0);  // b unused everywhere
    dp.finish();
    model first(0);
    first.set_buffers(0, 1);
    require(m.mean == first.mean && m.count == first.count, "the buffers are not rank 0's");
    require(dp.unused_on_every_rank(1) && !dp.unused_on_every_rank(0), "b unused, w used");
  }, 30s);
  INFO(summary(outs));
  CHECK(all_ok(outs));
  outs = on_ranks(1, local_group{20s}, [&](int r, ddp::process_group& pg) {
    model m(r);
    ring_tcp dp{pg, m.views, {}, {.find_unused_parameters = true}};
    dp.grad_ready(0);
    dp.finish();
    require(dp.unused_on_every_rank(1) && !dp.unused_on_every_rank(0), "alone: b unused, w used");
  }, 30s);
  expect_ok(outs);
}

TEST_CASE("join(): the last rank to join gives every rank its parameters and buffers; averaging yields to it") {
  for (const auto how : {ddp::buffer_sync::broadcast, ddp::buffer_sync::average}) {
    CAPTURE(static_cast<int>(how));
    const int n = 3;
    expect_ok(on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
      model m(r);
      auto state = m.with_buffers();
      ring_tcp dp{pg, state, {}, {.uneven_inputs = true, .buffers = how}};
      const int batches = r == 1 ? 3 : 1;
      for (int s = 0; s < batches; ++s) {
        m.set_buffers(r, s + 1);
        step(dp);
        for (auto& x : m.data<float>(0)) x += static_cast<float>(r + 1);  // this rank's optimizer step
      }
      dp.join();
      // Rank 1 joined last: its weights (0..5 plus 2 per step, 3 steps) and its step-3 buffers.
      const auto w = m.data<float>(0);
      for (std::size_t j = 0; j < w.size(); ++j)
        require(w[j] == static_cast<float>(j) + 6.0f, "w[" + std::to_string(j) + "] is " + std::to_string(w[j]) +
                                                          ", not the last joiner's");
      model want(0);
      want.set_buffers(1, 3);
      require(m.count == want.count, "the integer buffer is not the last joiner's: " + std::to_string(m.count[0]));
      require(m.mean == want.mean, "the buffers are not the last joiner's");
    }, 30s));
  }
}
