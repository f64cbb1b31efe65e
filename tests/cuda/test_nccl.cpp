// The NCCL reducer. Host-side checks (error conversion, refusal without a GPU) run everywhere;
// without a CUDA device the program then exits 77 (meson: SKIP). With one device it runs the
// reducer on a world of 1; with two or more it also runs 2 ranks as 2 processes, one GPU each
// (NCCL refuses two ranks of one communicator on the same GPU). The ranks are fresh processes
// (fork + exec of this program), because a CUDA context does not survive fork.
#include "ddp/reducer/nccl.hpp"

#include "ddp/concepts.hpp"
#include "ddp/memory/cuda_allocator.hpp"

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../multiproc/harness.hpp"
#include "../multiproc/reducer_checks.hpp"

static_assert(ddp::reducer<ddp::nccl_reducer>);
// The one reducer front end offers abort() where the engine can stop a running collective.
static_assert(requires(ddp::nccl_reducer& r) { r.abort(); });

namespace {

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

ddp::errc code_of(auto&& f) {
  try {
    f();
  } catch (const ddp::error& e) {
    return e.condition();
  }
  return ddp::errc{};
}

// Device copy of exact inputs, reduced through the reducer, compared with the reference.
// ncclAvg scales floats before summing; with inputs of small integers and a world of 1 or 2
// (division by 1 or 2 is exact) the result equals the reference bit for bit.
template <class T>
std::string check_exact(ddp::process_group& pg, ddp::nccl_reducer& red, std::size_t count, ddp::op o) {
  std::vector<T> host(count);
  for (std::size_t i = 0; i < count; ++i) host[i] = ddp_test::from_double<T>(ddp_test::exact_input(pg.rank(), i, o));
  ddp::cuda_allocator mem{.device = red.device(), .stream = red.stream()};
  auto* dev = static_cast<T*>(mem.allocate(count * sizeof(T)));
  DDP_CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), count * sizeof(T), cudaMemcpyHostToDevice, red.stream()));
  red.allreduce(std::span<T>(dev, count), o);
  std::vector<T> out(count);
  DDP_CUDA_CHECK(cudaMemcpyAsync(out.data(), dev, count * sizeof(T), cudaMemcpyDeviceToHost, red.stream()));
  DDP_CUDA_CHECK(cudaStreamSynchronize(red.stream()));
  mem.deallocate(dev, count * sizeof(T));
  DDP_CUDA_CHECK(cudaStreamSynchronize(red.stream()));
  for (std::size_t i = 0; i < count; ++i) {
    const T e = ddp_test::exact_expected<T>(pg.size(), i, o);
    if (std::memcmp(&out[i], &e, sizeof(T)) != 0)
      return std::string(ddp::dtype_name(ddp::dtype_of_v<T>)) + " " + ddp::op_name(o) + " count " +
             std::to_string(count) + ": element " + std::to_string(i) + " is " +
             std::to_string(ddp_test::to_double(out[i])) + ", expected " + std::to_string(ddp_test::to_double(e));
  }
  return {};
}

std::string check_all(ddp::process_group& pg, ddp::nccl_reducer& red, std::size_t count) {
  for (auto o : {ddp::op::sum, ddp::op::avg, ddp::op::min, ddp::op::max, ddp::op::prod}) {
    for (const auto& why : {check_exact<float>(pg, red, count, o), check_exact<double>(pg, red, count, o),
                            check_exact<ddp::half>(pg, red, count, o), check_exact<ddp::bfloat16>(pg, red, count, o),
                            check_exact<std::int32_t>(pg, red, count, o), check_exact<std::int64_t>(pg, red, count, o)})
      if (!why.empty()) return why;
  }
  return {};
}

// One rank of the multi-GPU run; the exit code is the verdict.
int child_main(int rank, int n, int port) {
  try {
    auto pg = ddp::init_process_group(world(rank, n, port));
    ddp::nccl_reducer red{pg};
    if (red.device() != rank) throw std::runtime_error("rank " + std::to_string(rank) + " is on the wrong device");
    for (std::size_t count : {std::size_t{1}, std::size_t{1000}, std::size_t{1} << 20})
      if (auto why = check_all(pg, red, count); !why.empty()) throw std::runtime_error(why);
    red.barrier();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
}

// Runs `n` ranks of this program; true when every one exits 0 within the limit.
bool run_ranks(int n, std::chrono::seconds limit) {
  const int port = ddp_test::free_port();
  std::vector<pid_t> kids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const std::string a = std::to_string(r), b = std::to_string(n), c = std::to_string(port);
      ::execl("/proc/self/exe", "test_nccl", "--ddp-rank", a.c_str(), b.c_str(), c.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    kids.push_back(pid);
  }
  bool ok = true;
  const auto until = std::chrono::steady_clock::now() + limit;
  for (pid_t pid : kids) {
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() >= until) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        ok = false;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok;
}

}  // namespace

// ---- host side: no device needed ----------------------------------------------------------

TEST_SUITE("nccl_host") {
  TEST_CASE("DDP_NCCL_CHECK turns NCCL results into ddp::error") {
    int n = 0;
    std::string what;
    ddp::errc code{};
    try {
      DDP_NCCL_CHECK(ncclCommCount(nullptr, &n));
    } catch (const ddp::error& e) {
      what = e.what();
      code = e.condition();
    }
    CHECK(code == ddp::errc::invalid_argument);
    CHECK(what.find("[ddp.invalid_argument] NCCL invalid argument") == 0);
    CHECK(what.find("ncclCommCount") != std::string::npos);
    CHECK_NOTHROW(DDP_NCCL_CHECK(ncclGetVersion(&n)));
    CHECK(n >= 21400);
    CHECK(ddp::nccl_condition(ncclRemoteError) == ddp::errc::peer_lost);
    CHECK(ddp::nccl_condition(ncclInvalidUsage) == ddp::errc::usage);
    CHECK(ddp::nccl_condition(ncclUnhandledCudaError) == ddp::errc::system);
  }

  TEST_CASE("nccl_reducer: without a device every rank is refused, none hangs") {
    if (device_count() > 0) return;  // covered by the device cases
    const int port = ddp_test::free_port();
    auto out = ddp_test::run_processes({0, 1}, [&](int r) {
      auto pg = ddp::init_process_group(world(r, 2, port));
      ddp::nccl_reducer red{pg};
    }, std::chrono::seconds(60));
    for (auto& o : out) {
      CHECK(o.exit_code == 1);
      CHECK(o.errc == static_cast<int>(ddp::errc::unsupported));
      CHECK(o.message.find("no CUDA device") != std::string::npos);
    }
  }

  TEST_CASE("nccl_reducer on an elastic group: accepted (it shrinks or rebuilds), refused only for want of a device") {
    if (device_count() > 0) return;
    const int port = ddp_test::free_port();
    auto out = ddp_test::run_processes({0, 1}, [&](int r) {
      auto o = world(r, 2, port);
      o.elastic_min = 1;
      o.elastic_max = 2;
      o.backend = ddp::backend::nccl;
      auto pg = ddp::init_process_group(o);
      ddp::nccl_reducer red{pg};
    }, std::chrono::seconds(60));
    for (auto& o : out) {
      CHECK(o.errc == static_cast<int>(ddp::errc::unsupported));
      CHECK_MESSAGE(o.message.find("no CUDA device") != std::string::npos, o.message);
    }
  }
  // The shrink plan, pure, runs everywhere: tests/unit/test_plans.cpp.
}

// ---- device: a world of 1 in this process, 2 processes on 2 GPUs ---------------------------

TEST_SUITE("nccl_gpu") {
  TEST_CASE("nccl_reducer: world of 1, every dtype and op") {
    auto pg = ddp::init_process_group(world(0, 1, ddp_test::free_port()));
    ddp::nccl_reducer red{pg};
    CHECK(red.rank() == 0);
    CHECK(red.size() == 1);
    CHECK(red.device() == 0);
    CHECK(red.comm() != nullptr);
    for (std::size_t count : {std::size_t{1}, std::size_t{4097}}) CHECK(check_all(pg, red, count).empty());
  }

  TEST_CASE("nccl_reducer: async requests, broadcast, reduce_scatter, allgather, barrier") {
    auto pg = ddp::init_process_group(world(0, 1, ddp_test::free_port()));
    ddp::nccl_reducer red{pg};
    ddp::cuda_allocator mem{.device = red.device(), .stream = red.stream()};
    const std::size_t n = 1 << 16;
    std::vector<float> host(n);
    for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 251);
    auto* a = static_cast<float*>(mem.allocate(n * sizeof(float)));
    auto* b = static_cast<float*>(mem.allocate(n * sizeof(float)));
    DDP_CUDA_CHECK(cudaMemcpyAsync(a, host.data(), n * sizeof(float), cudaMemcpyHostToDevice, red.stream()));
    std::vector<ddp::request> reqs;
    for (int k = 0; k < 8; ++k) reqs.push_back(red.allreduce_async(std::span<float>(a, n), ddp::op::sum));
    reqs.push_back(red.broadcast_async(a, n, ddp::dtype::f32, 0));
    reqs.push_back(red.reduce_scatter_async(a, b, n, ddp::dtype::f32, ddp::op::max));
    reqs.push_back(red.allgather_async(b, a, n, ddp::dtype::f32));
    reqs.back().wait_for(std::chrono::seconds(30));
    for (auto& r : reqs) CHECK(r.test());  // completed in issue order
    red.barrier();
    std::vector<float> out(n);
    DDP_CUDA_CHECK(cudaMemcpy(out.data(), a, n * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(out == host);
    mem.deallocate(a, n * sizeof(float));
    mem.deallocate(b, n * sizeof(float));
    DDP_CUDA_CHECK(cudaStreamSynchronize(red.stream()));
  }

  TEST_CASE("nccl_reducer: argument errors, abort") {
    auto pg = ddp::init_process_group(world(0, 1, ddp_test::free_port()));
    ddp::nccl_reducer red{pg};
    ddp::cuda_allocator mem{.device = red.device(), .stream = red.stream()};
    auto* a = static_cast<float*>(mem.allocate(64 * sizeof(float)));
    CHECK(code_of([&] { (void)red.broadcast_async(a, 64, ddp::dtype::f32, 1); }) == ddp::errc::invalid_argument);
    CHECK(code_of([&] { red.allreduce(a, 64, ddp::dtype::f32, static_cast<ddp::op>(9)); }) ==
          ddp::errc::invalid_argument);
    CHECK(code_of([&] { red.allreduce(a, 64, static_cast<ddp::dtype>(99), ddp::op::sum); }) ==
          ddp::errc::invalid_argument);
    red.allreduce(std::span<float>(a, 64), ddp::op::sum);  // still usable after refused arguments
    red.abort();
    CHECK(red.comm() == nullptr);
    CHECK(code_of([&] { red.allreduce(std::span<float>(a, 64), ddp::op::sum); }) == ddp::errc::aborted);
    mem.deallocate(a, 64 * sizeof(float));
    DDP_CUDA_CHECK(cudaStreamSynchronize(red.stream()));
  }

  TEST_CASE("nccl_reducer: a user stream orders the collective after the program's work") {
    cudaStream_t s = nullptr;
    DDP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    {
      auto pg = ddp::init_process_group(world(0, 1, ddp_test::free_port()));
      ddp::nccl_reducer red{pg, 0, s};
      CHECK(red.stream() == s);
      ddp::cuda_allocator mem{.device = 0, .stream = s};
      std::vector<std::int64_t> host(1000, 42), out(1000);
      auto* a = static_cast<std::int64_t*>(mem.allocate(1000 * sizeof(std::int64_t)));
      DDP_CUDA_CHECK(cudaMemcpyAsync(a, host.data(), 1000 * sizeof(std::int64_t), cudaMemcpyHostToDevice, s));
      red.allreduce(std::span<std::int64_t>(a, 1000), ddp::op::prod);
      DDP_CUDA_CHECK(cudaMemcpyAsync(out.data(), a, 1000 * sizeof(std::int64_t), cudaMemcpyDeviceToHost, s));
      DDP_CUDA_CHECK(cudaStreamSynchronize(s));
      CHECK(out == host);
      mem.deallocate(a, 1000 * sizeof(std::int64_t));
      DDP_CUDA_CHECK(cudaStreamSynchronize(s));
    }
    DDP_CUDA_CHECK(cudaStreamDestroy(s));
  }

  TEST_CASE("nccl_reducer: 2 ranks on 2 GPUs, exact references") {
    if (device_count() < 2) {
      MESSAGE("one GPU: NCCL needs one GPU per rank, so only the world of 1 ran");
      return;
    }
    CHECK(run_ranks(2, std::chrono::seconds(120)));
  }
}

int main(int argc, char** argv) {
  if (argc == 5 && std::strcmp(argv[1], "--ddp-rank") == 0)
    return child_main(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]));
  doctest::Context ctx(argc, argv);
  const bool gpu = device_count() > 0;
  if (!gpu) ctx.addFilter("test-suite-exclude", "nccl_gpu");
  const int rc = ctx.run();
  if (ctx.shouldExit() || rc != 0) return rc != 0 ? rc : 0;
  if (!gpu) {
    std::fprintf(stderr, "no CUDA device: host-side checks passed, device checks skipped\n");
    return 77;
  }
  return 0;
}
