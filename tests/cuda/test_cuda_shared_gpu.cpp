// Several ranks on one GPU. NCCL refuses two ranks of one communicator on the same device, so
// on a machine with one GPU the multi-rank runs use ddp's own reducers: device gradients reach
// ring<shm> and the default reducer's shm engine through page-locked host buckets
// (staging_allocator.hpp), on 2 and 4 processes, and each step's averages are compared bit for
// bit with the same steps on host gradients through host buckets, and with the exact average.
// The default wrapper's own choices are checked too: device gradients with DDP_BACKEND=nccl on
// a world of 1 (buckets on the device), and refused by a host engine (docs/engines.md: "Host
// reducers refuse them at construction").
//
// A CUDA context does not survive fork, so this process never touches CUDA: a child counts the
// devices, and every device step runs in fresh children. Without a device: exit 77 (SKIP).
#include "ddp/data_parallel.hpp"

#include "ddp/memory/cuda_allocator.hpp"
#include "ddp/reducer/ring.hpp"
#include "ddp/reducer/shm.hpp"

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../multiproc/harness.hpp"
#include "../multiproc/reducer_checks.hpp"
#include "staging_allocator.hpp"

using namespace std::chrono_literals;

static_assert(ddp::copying_allocator<ddp_test::pinned_staging>);
static_assert(!ddp::allocates_device_memory<ddp_test::pinned_staging>());

namespace {

// The device count, asked in a child so that this process keeps no CUDA context.
int device_count_in_child() {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    ::_exit(n > 100 ? 100 : n);
  }
  int status = 0;
  if (pid < 0 || ::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
  return WEXITSTATUS(status);
}

struct spec {
  ddp::dtype type;
  std::size_t numel;
};
// Every floating dtype, sizes that split across buckets of 1 and 2 KiB and leave odd tails.
const std::vector<spec> specs{{ddp::dtype::f32, 3},    {ddp::dtype::f32, 1000}, {ddp::dtype::f64, 77},
                              {ddp::dtype::f16, 129},  {ddp::dtype::bf16, 64},  {ddp::dtype::f32, 4099}};

// Rank r's gradient at element i of parameter p in step s: a small integer, exact in every dtype.
double grad_value(int r, std::size_t p, std::size_t i, int s) {
  return static_cast<double>((r + 1) * static_cast<int>((i + p + static_cast<std::size_t>(s)) % 7 + 1));
}

void put(ddp::dtype t, void* at, std::size_t i, double x) {
  switch (t) {
    case ddp::dtype::f32: static_cast<float*>(at)[i] = static_cast<float>(x); break;
    case ddp::dtype::f64: static_cast<double*>(at)[i] = x; break;
    case ddp::dtype::f16: static_cast<ddp::half*>(at)[i] = ddp::half(static_cast<float>(x)); break;
    case ddp::dtype::bf16: static_cast<ddp::bfloat16*>(at)[i] = ddp::bfloat16(static_cast<float>(x)); break;
    default: throw std::runtime_error("unexpected dtype");
  }
}

// Parameters and gradients in host memory.
struct host_model {
  std::vector<std::vector<std::byte>> data, grad;
  host_model() {
    for (const auto& s : specs) {
      data.emplace_back(s.numel * ddp::dtype_size(s.type));
      grad.emplace_back(s.numel * ddp::dtype_size(s.type));
    }
  }
  void fill(int rank, int step) {
    for (std::size_t p = 0; p < specs.size(); ++p)
      for (std::size_t i = 0; i < specs[p].numel; ++i) put(specs[p].type, grad[p].data(), i, grad_value(rank, p, i, step));
  }
  // The exact average over `world` ranks, in each parameter's dtype.
  std::vector<std::vector<std::byte>> expected(int world, int step) const {
    auto out = grad;
    for (std::size_t p = 0; p < specs.size(); ++p)
      for (std::size_t i = 0; i < specs[p].numel; ++i) {
        double sum = 0;
        for (int r = 0; r < world; ++r) sum += grad_value(r, p, i, step);
        put(specs[p].type, out[p].data(), i, sum / world);
      }
    return out;
  }
  std::vector<ddp::tensor_view> views() {
    std::vector<ddp::tensor_view> v;
    for (std::size_t p = 0; p < specs.size(); ++p)
      v.push_back(ddp::tensor_view{data[p].data(), grad[p].data(), specs[p].numel, specs[p].type, -1,
                                   "p" + std::to_string(p), {static_cast<std::int64_t>(specs[p].numel)}});
    return v;
  }
};

// The same parameters in device memory of device 0 (cudaMalloc: no stream to order against).
struct device_model {
  std::vector<void*> data, grad;
  device_model() {
    for (const auto& s : specs) {
      void* d = nullptr;
      void* g = nullptr;
      DDP_CUDA_CHECK(cudaMalloc(&d, s.numel * ddp::dtype_size(s.type)));
      DDP_CUDA_CHECK(cudaMalloc(&g, s.numel * ddp::dtype_size(s.type)));
      DDP_CUDA_CHECK(cudaMemset(d, 0, s.numel * ddp::dtype_size(s.type)));
      data.push_back(d);
      grad.push_back(g);
    }
  }
  ~device_model() {
    for (void* p : data) (void)cudaFree(p);
    for (void* p : grad) (void)cudaFree(p);
  }
  device_model(const device_model&) = delete;
  device_model& operator=(const device_model&) = delete;
  void upload(const host_model& h) {
    for (std::size_t p = 0; p < specs.size(); ++p)
      DDP_CUDA_CHECK(cudaMemcpy(grad[p], h.grad[p].data(), h.grad[p].size(), cudaMemcpyHostToDevice));
  }
  std::vector<std::vector<std::byte>> download() const {
    std::vector<std::vector<std::byte>> out;
    for (std::size_t p = 0; p < specs.size(); ++p) {
      out.emplace_back(specs[p].numel * ddp::dtype_size(specs[p].type));
      DDP_CUDA_CHECK(cudaMemcpy(out.back().data(), grad[p], out.back().size(), cudaMemcpyDeviceToHost));
    }
    return out;
  }
  std::vector<ddp::tensor_view> views() const {
    std::vector<ddp::tensor_view> v;
    for (std::size_t p = 0; p < specs.size(); ++p)
      v.push_back(ddp::tensor_view{data[p], grad[p], specs[p].numel, specs[p].type, 0, "p" + std::to_string(p),
                                   {static_cast<std::int64_t>(specs[p].numel)}});
    return v;
  }
};

template <class Dp>
void one_step(Dp& dp) {
  for (std::size_t i = dp.size(); i-- > 0;) dp.grad_ready(i);  // backward's order
  dp.finish();
}

void require_same(const std::vector<std::vector<std::byte>>& got, const std::vector<std::vector<std::byte>>& want,
                  const std::string& what) {
  for (std::size_t p = 0; p < want.size(); ++p)
    for (std::size_t i = 0; i < specs[p].numel; ++i) {
      const std::size_t es = ddp::dtype_size(specs[p].type);
      if (std::memcmp(got[p].data() + i * es, want[p].data() + i * es, es) != 0)
        throw std::runtime_error(what + ": parameter " + std::to_string(p) + " (" + ddp::dtype_name(specs[p].type) +
                                 ") element " + std::to_string(i) + " differs");
    }
}

constexpr int steps = 3;  // the second rebuilds the plan from the ready order, the third runs on it

// One rank: steps on host gradients (host buckets), then the same steps on device gradients
// (page-locked buckets, CUDA copies); both against the exact average, the device run also
// bit for bit against the host run.
template <class Reducer>
void staged_against_host(int rank, int world, int port, ddp::backend b) {
  auto pg = ddp::init_process_group(ddp_test::group_options(rank, world, port, 30s, b));
  const ddp::bucket_policy policy{.cap_bytes = 2048, .first_cap_bytes = 1024};
  const ddp::dp_options opts{.broadcast_parameters = false};
  host_model h;
  std::vector<std::vector<std::vector<std::byte>>> host_results;
  {
    ddp::basic_data_parallel<ddp::size_planner, Reducer, ddp::host_allocator> dp{pg, h.views(), policy, opts};
    for (int s = 0; s < steps; ++s) {
      h.fill(rank, s);
      one_step(dp);
      require_same(h.grad, h.expected(world, s), "host buckets, step " + std::to_string(s));
      host_results.push_back(h.grad);
    }
  }
  device_model d;
  ddp::basic_data_parallel<ddp::size_planner, Reducer, ddp_test::pinned_staging> dp{pg, d.views(), policy, opts};
  for (int s = 0; s < steps; ++s) {
    h.fill(rank, s);
    d.upload(h);
    one_step(dp);
    const auto got = d.download();
    require_same(got, host_results[static_cast<std::size_t>(s)], "device gradients against host ones, step " + std::to_string(s));
  }
  if (ddp::pinned_allocator::release_error() != cudaSuccess) throw std::runtime_error("a pinned bucket was not freed");
}

template <class Reducer>
void run_staged(int world, ddp::backend b) {
  const int port = ddp_test::free_port();
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(r);
  auto out = ddp_test::run_processes(ranks, [&](int r) { staged_against_host<Reducer>(r, world, port, b); }, 120s);
  for (const auto& o : out) CHECK_MESSAGE(o.ok(), "rank " << o.rank << " exit " << o.exit_code << ": " << o.message);
}

}  // namespace

TEST_SUITE("shared_gpu") {
  TEST_CASE("ring<shm>: device gradients through page-locked buckets, 2 and 4 ranks on one GPU") {
    for (int world : {2, 4}) {
      CAPTURE(world);
      run_staged<ddp::ring<ddp::shm>>(world, ddp::backend::automatic);
    }
  }

  TEST_CASE("the default reducer (shm on one host): device gradients through page-locked buckets, 2 and 4 ranks") {
    for (int world : {2, 4}) {
      CAPTURE(world);
      run_staged<ddp::auto_reducer>(world, ddp::backend::automatic);
    }
  }

  TEST_CASE("the default wrapper, DDP_BACKEND=nccl, world of 1: device gradients, buckets on the device") {
    auto out = ddp_test::run_processes({0}, [](int) {
      auto pg = ddp::init_process_group(ddp_test::group_options(0, 1, ddp_test::free_port(), 30s, ddp::backend::nccl));
      host_model h;
      device_model d;
      ddp::data_parallel dp{pg, d.views()};
      ddp_test::require(dp.get_reducer().chosen() == ddp::backend::nccl, "the default reducer did not choose nccl");
      ddp_test::require(dp.get_allocator().location() == ddp::memory_kind::cuda, "the buckets are not on the device");
      for (int s = 0; s < steps; ++s) {
        h.fill(0, s);
        d.upload(h);
        one_step(dp);
        require_same(d.download(), h.expected(1, s), "step " + std::to_string(s));
      }
      // find_unused_parameters: the slot of a parameter that was not ready is zeroed on the device.
      ddp::data_parallel unused{pg, d.views(), {}, ddp::dp_options{.find_unused_parameters = true}};
      h.fill(0, 0);
      d.upload(h);
      unused.grad_ready(0);
      unused.finish();
      const auto got = d.download();
      require_same({got[0]}, {h.grad[0]}, "the used parameter");
      for (std::size_t p = 1; p < specs.size(); ++p)
        for (std::byte x : got[p])
          ddp_test::require(x == std::byte{0}, "parameter " + std::to_string(p) + " was not zeroed");
      ddp_test::require(ddp::cuda_allocator::release_error() == cudaSuccess, "a device bucket was not freed");
    });
    CHECK_MESSAGE(out[0].ok(), "exit " << out[0].exit_code << ": " << out[0].message);
  }

  TEST_CASE("the default wrapper on a host engine (shm, 2 ranks on one GPU): device gradients refused at construction") {
    const int port = ddp_test::free_port();
    auto out = ddp_test::run_processes({0, 1}, [&](int r) {
      auto pg = ddp::init_process_group(ddp_test::group_options(r, 2, port, 30s, ddp::backend::shm));
      device_model d;
      ddp::data_parallel dp{pg, d.views()};
      one_step(dp);
    }, 60s);
    for (const auto& o : out) {
      CHECK_MESSAGE(o.errc == static_cast<int>(ddp::errc::unsupported),
                    "rank " << o.rank << " exit " << o.exit_code << ": " << o.message);
      CHECK_MESSAGE(o.message.find("lives on device 0") != std::string::npos, o.message);
    }
  }
}

int main(int argc, char** argv) {
  doctest::Context ctx(argc, argv);
  const int devices = device_count_in_child();
  if (devices == 0) ctx.addFilter("test-suite-exclude", "shared_gpu");
  const int rc = ctx.run();
  if (ctx.shouldExit() || rc != 0) return rc;
  if (devices == 0) {
    std::fprintf(stderr, "no CUDA device: compile-time checks passed, device steps skipped\n");
    return 77;
  }
  return 0;
}
