// The combinations of the data-parallel wrapper with CUDA policies that the docs list:
// basic_data_parallel<size_planner, nccl_reducer, cuda_allocator> (docs/mpi-nccl.md) and
// <size_planner, ring<tcp>, pinned_allocator> (pinned_allocator.hpp). Without a CUDA device the
// program checks that construction gets as far as the device itself (errc::unsupported "no
// CUDA device" from the reducer; a CUDA error from cudaHostAlloc), never a missing hook, and
// passes; with one it runs steps on a world of 1.
#include "ddp/data_parallel.hpp"

#include "ddp/memory/cuda_allocator.hpp"
#include "ddp/memory/pinned_allocator.hpp"
#include "ddp/reducer/nccl.hpp"

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "../multiproc/harness.hpp"

// What the wrapper needs from the CUDA policies, checked at compile time.
static_assert(ddp::copying_allocator<ddp::cuda_allocator>);
static_assert(ddp::has_nothrow_deallocate<ddp::cuda_allocator>);
static_assert(ddp::has_nothrow_deallocate<ddp::pinned_allocator>);
static_assert(ddp::allocator_bound_to<ddp::cuda_allocator, ddp::nccl_reducer>);
static_assert(ddp::reducer_with_abort<ddp::nccl_reducer>);

namespace {

using gpu_nccl = ddp::basic_data_parallel<ddp::size_planner, ddp::nccl_reducer, ddp::cuda_allocator>;
using pinned_tcp = ddp::basic_data_parallel<ddp::size_planner, ddp::ring<ddp::tcp>, ddp::pinned_allocator>;

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  (void)cudaGetLastError();
  return n;
}

ddp::init_options world(int rank, int n, int port) {
  ddp::init_options o;
  o.rank = rank;
  o.world_size = n;
  o.master_port = port;
  o.local_rank = rank;
  o.timeout = std::chrono::seconds(30);
  return o;
}

// Two host parameters of 3 and 5 floats, with gradients rank + 1 + i.
struct host_model {
  std::vector<std::vector<float>> data{std::vector<float>(3, 1.0f), std::vector<float>(5, 2.0f)};
  std::vector<std::vector<float>> grad;
  std::vector<ddp::tensor_view> views;
  explicit host_model(int rank) {
    for (std::size_t p = 0; p < data.size(); ++p) {
      grad.emplace_back(data[p].size());
      for (std::size_t i = 0; i < grad[p].size(); ++i) grad[p][i] = static_cast<float>(rank + 1 + i);
      views.push_back(ddp::make_tensor_view(data[p], grad[p], p == 0 ? "w" : "b"));
    }
  }
};

template <class Dp>
void one_step(Dp& dp) {
  for (std::size_t i = dp.size(); i-- > 0;) dp.grad_ready(i);
  dp.finish();
}

}  // namespace

TEST_CASE("nccl_reducer + cuda_allocator without a device: 'no CUDA device' on every rank, not a missing hook") {
  if (device_count() > 0) return;  // the device case below covers it
  const int port = ddp_test::free_port();
  auto out = ddp_test::run_processes(
      {0, 1},
      [&](int r) {
        auto pg = ddp::init_process_group(world(r, 2, port));
        host_model m(r);
        gpu_nccl dp{pg, m.views};
      },
      std::chrono::seconds(60));
  for (auto& o : out) {
    CHECK(o.exit_code == 1);
    CHECK(o.errc == static_cast<int>(ddp::errc::unsupported));
    CHECK(o.message.find("no CUDA device") != std::string::npos);
    CHECK(o.message.find("copy(dst, src, bytes)") == std::string::npos);
  }
}

TEST_CASE("the default wrapper with DDP_BACKEND=nccl and no device: 'no CUDA device' on every rank") {
  if (device_count() > 0) return;  // the device case below covers it
  const int port = ddp_test::free_port();
  auto out = ddp_test::run_processes(
      {0, 1},
      [&](int r) {
        auto o = world(r, 2, port);
        o.backend = ddp::backend::nccl;  // compiled in: Meson's ddp_nccl_dep defines DDP_WITH_NCCL
        auto pg = ddp::init_process_group(o);
        host_model m(r);
        ddp::data_parallel dp{pg, m.views};
      },
      std::chrono::seconds(60));
  for (auto& o : out) {
    CHECK(o.exit_code == 1);
    CHECK(o.errc == static_cast<int>(ddp::errc::unsupported));
    CHECK(o.message.find("no CUDA device") != std::string::npos);
  }
}

TEST_CASE("the default wrapper on a host engine (shm) with device gradients: refused at construction on every rank") {
  // A build with NCCL gives auto_allocator copy hooks; over the shm engine its buckets are host
  // memory the CPU reduces, so device gradients must be refused as without NCCL, before the
  // broadcast reads them. The memory here is host memory labelled device 0: the refusal must
  // come before anything reads it.
  const int port = ddp_test::free_port();
  auto out = ddp_test::run_processes(
      {0, 1},
      [&](int r) {
        auto o = world(r, 2, port);
        o.backend = ddp::backend::shm;
        auto pg = ddp::init_process_group(o);
        host_model m(r);
        for (auto& v : m.views) v.device = 0;
        ddp::data_parallel dp{pg, m.views};
        one_step(dp);
      },
      std::chrono::seconds(60));
  for (auto& o : out) {
    CHECK(o.exit_code == 1);
    CHECK(o.errc == static_cast<int>(ddp::errc::unsupported));
    CHECK_MESSAGE(o.message.find("parameter 0 ('w') lives on device 0 but the buckets are shared memory") !=
                      std::string::npos,
                  o.message);
    CHECK(o.message.find("DDP_BACKEND=nccl") != std::string::npos);
  }
}

TEST_CASE("ring<tcp> + pinned_allocator without a device: construction fails in cudaHostAlloc, on every rank") {
  if (device_count() > 0) return;
  const int port = ddp_test::free_port();
  auto out = ddp_test::run_processes(
      {0, 1},
      [&](int r) {
        auto pg = ddp::init_process_group(world(r, 2, port));
        host_model m(r);
        pinned_tcp dp{pg, m.views};
      },
      std::chrono::seconds(60));
  for (auto& o : out) {
    CHECK(o.exit_code == 1);
    CHECK(o.errc == static_cast<int>(ddp::errc::system));
    // Each rank names its own cudaHostAlloc failure or the peer that could not set up its buckets.
    CHECK((o.message.find("cudaHostAlloc") != std::string::npos ||
           o.message.find("could not set up its gradient buckets") != std::string::npos));
  }
}

TEST_SUITE("cuda_gpu") {
  TEST_CASE("nccl_reducer + cuda_allocator: buckets on the reducer's device, a step through the copy hooks") {
    auto pg = ddp::init_process_group(world(0, 1, ddp_test::free_port()));
    host_model m(0);
    const auto want = m.grad;
    gpu_nccl dp{pg, m.views, ddp::bucket_policy{.cap_bytes = 16, .first_cap_bytes = 16}};
    CHECK(dp.get_allocator().device == dp.get_reducer().device());
    CHECK(dp.get_allocator().stream == dp.get_reducer().stream());
    for (int step = 0; step < 3; ++step) one_step(dp);  // the third after the rebuild
    CHECK(m.grad == want);                              // the average over one rank
    CHECK(dp.last_step_stats().bytes_reduced == 8 * sizeof(float));
    // find_unused_parameters: the unused slot is zeroed on the device (the zero hook).
    gpu_nccl unused{pg, m.views, {}, ddp::dp_options{.find_unused_parameters = true}};
    unused.grad_ready(1);
    unused.finish();
    CHECK(m.grad[0] == std::vector<float>(3, 0.0f));
    CHECK(m.grad[1] == want[1]);
    CHECK(ddp::cuda_allocator::release_error() == cudaSuccess);
  }

  TEST_CASE("the default wrapper with DDP_BACKEND=nccl: buckets on the device, a step through the copy hooks") {
    auto o = world(0, 1, ddp_test::free_port());
    o.backend = ddp::backend::nccl;
    auto pg = ddp::init_process_group(o);
    host_model m(0);
    const auto want = m.grad;
    ddp::data_parallel dp{pg, m.views};
    CHECK(dp.get_reducer().chosen() == ddp::backend::nccl);
    CHECK(dp.get_allocator().location() == ddp::memory_kind::cuda);
    for (int step = 0; step < 3; ++step) one_step(dp);
    CHECK(m.grad == want);  // the average over one rank
  }

  TEST_CASE("ring<tcp> + pinned_allocator: a step over page-locked buckets") {
    auto pg = ddp::init_process_group(world(0, 1, ddp_test::free_port()));
    host_model m(0);
    const auto want = m.grad;
    pinned_tcp dp{pg, m.views};
    one_step(dp);
    CHECK(m.grad == want);
  }
}

int main(int argc, char** argv) {
  doctest::Context ctx(argc, argv);
  const bool gpu = device_count() > 0;
  if (!gpu) ctx.addFilter("test-suite-exclude", "cuda_gpu");
  const int rc = ctx.run();
  if (!gpu && rc == 0) std::fprintf(stderr, "no CUDA device: the no-device checks passed, device steps not run\n");
  return rc;
}
