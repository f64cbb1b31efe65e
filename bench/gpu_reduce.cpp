// What ddp adds on a GPU, each against the plain CUDA or NCCL call that moves the same bytes:
//
//   nccl     nccl_reducer::allreduce against ncclAllReduce on the reducer's own communicator and
//            stream (world of 1, f32 sum, in place), 4 KiB to 256 MiB; each call waits for its
//            result (the reducer: its request; the raw call: cudaStreamSynchronize).
//   pack     the wrapper's copy of device gradients into a device bucket (bucket_memory::copy_in
//            through cuda_allocator::copy: one cudaMemcpyAsync and a stream synchronize per
//            parameter) and back out, against one cudaMemcpyDeviceToDevice of all the bytes;
//            parameter shapes of ResNet-50 and BERT-base (tests/data/*.params).
//   staging  device gradients copied into page-locked host buckets and back (cudaMemcpy per
//            parameter, as an allocator for a host reducer does: tests/cuda/staging_allocator.hpp)
//            against host gradients into host buckets (ddp's streaming copy): the price of
//            reducing device gradients with a host engine.
//
//   gpu_reduce [--max-bytes N] [--min-bytes N] [--params DIR] [--quick]
//
// Times are medians. Lines starting with "result" are the figures scripts/gpu_check.sh puts in
// its summary, with the targets of docs/gpu.md: the reducer within 3% of ncclAllReduce at 64 MiB
// and above, the pack at 80% or more of the single copy's bandwidth. Without a CUDA device it
// says so and exits 77.
#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/detail/copy.hpp>
#include <ddp/memory/cuda_allocator.hpp>
#include <ddp/memory/pinned_allocator.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/nccl.hpp>

#include "free_port.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#ifndef DDP_BENCH_DATA
#define DDP_BENCH_DATA "tests/data"
#endif

namespace {

using clock_type = std::chrono::steady_clock;


double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Median seconds of `f`, after warm-up, with as many runs as fit in about `budget` seconds.
double time_median(const std::function<void()>& f, double budget, int min_iters = 5, int max_iters = 200) {
  for (int i = 0; i < 2; ++i) f();
  const auto t0 = clock_type::now();
  f();
  const double once = std::chrono::duration<double>(clock_type::now() - t0).count();
  const int iters = std::clamp(static_cast<int>(budget / std::max(once, 1e-7)), min_iters, max_iters);
  std::vector<double> t;
  t.reserve(static_cast<std::size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    const auto a = clock_type::now();
    f();
    t.push_back(std::chrono::duration<double>(clock_type::now() - a).count());
  }
  return median(t);
}

// Byte sizes of a model's f32 parameters, from a tests/data/*.params file (name, then shape).
std::vector<std::size_t> param_bytes(const std::string& file) {
  std::ifstream in(file);
  std::vector<std::size_t> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream s(line);
    std::string name;
    s >> name;
    std::size_t n = 1, d = 0;
    while (s >> d) n *= d;
    out.push_back(n * sizeof(float));
  }
  return out;
}

std::string mib(std::size_t bytes) {
  char b[32];
  if (bytes >= (1u << 20))
    std::snprintf(b, sizeof b, "%zu MiB", bytes >> 20);
  else
    std::snprintf(b, sizeof b, "%zu KiB", bytes >> 10);
  return b;
}

int bench_nccl(std::size_t min_bytes, std::size_t max_bytes, double budget) {
  ddp::init_options o;
  o.rank = 0;
  o.world_size = 1;
  o.master_port = bench::free_port();
  o.timeout = std::chrono::seconds(60);
  auto pg = ddp::init_process_group(o);
  ddp::nccl_reducer red{pg};
  ddp::cuda_allocator mem{.device = red.device(), .stream = red.stream()};
  std::printf("# nccl: nccl_reducer::allreduce against ncclAllReduce, same communicator and stream, world 1, f32 sum\n");
  std::printf("%-10s %12s %12s %12s %12s %9s\n", "bytes", "raw_us", "ddp_us", "raw_GBps", "ddp_GBps", "ddp/raw");
  double worst_large = 0;
  for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 4) {
    const std::size_t count = bytes / sizeof(float);
    auto* buf = static_cast<float*>(mem.allocate(bytes));
    DDP_CUDA_CHECK(cudaMemsetAsync(buf, 0, bytes, red.stream()));
    DDP_CUDA_CHECK(cudaStreamSynchronize(red.stream()));
    const auto raw = [&] {
      DDP_NCCL_CHECK(ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, red.comm(), red.stream()));
      DDP_CUDA_CHECK(cudaStreamSynchronize(red.stream()));
    };
    const auto ours = [&] { red.allreduce(buf, count, ddp::dtype::f32, ddp::op::sum); };
    // Alternated in rounds, so that a clock or power change reaches both alike.
    std::vector<double> r, d;
    for (int round = 0; round < 3; ++round) {
      r.push_back(time_median(raw, budget / 3));
      d.push_back(time_median(ours, budget / 3));
    }
    const double tr = median(r), td = median(d);
    const double ratio = td / tr;
    if (bytes >= (std::size_t{64} << 20)) worst_large = std::max(worst_large, ratio);
    std::printf("%-10s %12.1f %12.1f %12.2f %12.2f %9.3f\n", mib(bytes).c_str(), tr * 1e6, td * 1e6, bytes / tr / 1e9,
                bytes / td / 1e9, ratio);
    mem.deallocate(buf, bytes);
    DDP_CUDA_CHECK(cudaStreamSynchronize(red.stream()));
  }
  if (worst_large > 0)
    std::printf("result nccl_vs_raw_ge_64MiB %.3f target<=1.03 %s\n", worst_large, worst_large <= 1.03 ? "pass" : "fail");
  else
    std::printf("result nccl_vs_raw_ge_64MiB n/a target<=1.03 skip\n");
  return 0;
}

struct device_params {
  std::vector<void*> grads;
  std::vector<std::size_t> bytes;
  std::size_t total = 0;
  explicit device_params(const std::vector<std::size_t>& sizes) : bytes(sizes) {
    for (std::size_t b : sizes) {
      void* p = nullptr;
      DDP_CUDA_CHECK(cudaMalloc(&p, b));
      DDP_CUDA_CHECK(cudaMemset(p, 1, b));
      grads.push_back(p);
      total += b;
    }
  }
  ~device_params() {
    for (void* p : grads) (void)cudaFree(p);
  }
  device_params(const device_params&) = delete;
  device_params& operator=(const device_params&) = delete;
};

double bench_pack(const std::string& model, const std::vector<std::size_t>& sizes, double budget) {
  device_params g(sizes);
  cudaStream_t s = nullptr;
  DDP_CUDA_CHECK(cudaStreamCreate(&s));
  ddp::cuda_allocator alloc{.device = 0, .stream = s};
  auto* bucket = static_cast<std::byte*>(alloc.allocate(g.total));
  auto* flat = static_cast<std::byte*>(alloc.allocate(g.total));
  const auto pack = [&] {
    std::size_t off = 0;
    for (std::size_t i = 0; i < g.grads.size(); ++i) {
      alloc.copy(bucket + off, g.grads[i], g.bytes[i]);
      off += g.bytes[i];
    }
  };
  const auto unpack = [&] {
    std::size_t off = 0;
    for (std::size_t i = 0; i < g.grads.size(); ++i) {
      alloc.copy(g.grads[i], bucket + off, g.bytes[i]);
      off += g.bytes[i];
    }
  };
  const auto one_copy = [&] {
    DDP_CUDA_CHECK(cudaMemcpyAsync(bucket, flat, g.total, cudaMemcpyDeviceToDevice, s));
    DDP_CUDA_CHECK(cudaStreamSynchronize(s));
  };
  const double tc = time_median(one_copy, budget), tp = time_median(pack, budget), tu = time_median(unpack, budget);
  std::printf("%-10s %6zu %10s %10.1f %10.1f %10.1f %8.3f %8.3f\n", model.c_str(), g.grads.size(), mib(g.total).c_str(),
              g.total / tc / 1e9, g.total / tp / 1e9, g.total / tu / 1e9, tc / tp, tc / tu);
  alloc.deallocate(bucket, g.total);
  alloc.deallocate(flat, g.total);
  DDP_CUDA_CHECK(cudaStreamSynchronize(s));
  DDP_CUDA_CHECK(cudaStreamDestroy(s));
  return std::min(tc / tp, tc / tu);
}

double bench_staging(const std::string& model, const std::vector<std::size_t>& sizes, double budget) {
  device_params g(sizes);
  ddp::pinned_allocator pinned;
  auto* staged = static_cast<std::byte*>(pinned.allocate(g.total));
  std::vector<std::vector<std::byte>> host_grads;
  for (std::size_t b : sizes) host_grads.emplace_back(b, std::byte{1});
  std::vector<std::byte> host_bucket(g.total);
  const auto device_round = [&] {
    std::size_t off = 0;
    for (std::size_t i = 0; i < g.grads.size(); ++i) {
      DDP_CUDA_CHECK(cudaMemcpy(staged + off, g.grads[i], g.bytes[i], cudaMemcpyDefault));
      off += g.bytes[i];
    }
    off = 0;
    for (std::size_t i = 0; i < g.grads.size(); ++i) {
      DDP_CUDA_CHECK(cudaMemcpy(g.grads[i], staged + off, g.bytes[i], cudaMemcpyDefault));
      off += g.bytes[i];
    }
  };
  const auto host_round = [&] {
    std::size_t off = 0;
    for (auto& h : host_grads) {
      ddp::detail::copy_bytes_streaming(host_bucket.data() + off, h.data(), h.size());
      off += h.size();
    }
    off = 0;
    for (auto& h : host_grads) {
      ddp::detail::copy_bytes_streaming(h.data(), host_bucket.data() + off, h.size());
      off += h.size();
    }
  };
  const double td = time_median(device_round, budget), th = time_median(host_round, budget);
  std::printf("%-10s %10s %14.2f %14.2f %10.3f\n", model.c_str(), mib(g.total).c_str(), 2 * g.total / td / 1e9,
              2 * g.total / th / 1e9, th / td);
  pinned.deallocate(staged, g.total);
  return th / td;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t min_bytes = 4096, max_bytes = std::size_t{256} << 20;
  std::string data = DDP_BENCH_DATA;
  double budget = 0.3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--max-bytes" && has_value) max_bytes = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--min-bytes" && has_value) min_bytes = std::strtoull(argv[++i], nullptr, 10);
    else if (a == "--params" && has_value) data = argv[++i];
    else if (a == "--quick") budget = 0.05;
    else {
      std::fprintf(stderr, "usage: gpu_reduce [--max-bytes N] [--min-bytes N] [--params DIR] [--quick]\n");
      return 2;
    }
  }
  if (min_bytes < 4 || min_bytes > max_bytes) {
    std::fprintf(stderr, "gpu_reduce: --min-bytes must be at least 4 and at most --max-bytes\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  (void)cudaGetLastError();
  if (devices == 0) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  cudaDeviceProp prop{};
  DDP_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  int nccl_version = 0;
  DDP_NCCL_CHECK(ncclGetVersion(&nccl_version));
  std::printf("# device 0: %s; NCCL %d; CUDA runtime %d\n", prop.name, nccl_version, CUDART_VERSION);
  try {
    bench_nccl(min_bytes, max_bytes, budget);
    std::printf("\n# pack: cuda_allocator::copy per parameter (the wrapper's copy in and out) against one D2D copy\n");
    std::printf("%-10s %6s %10s %10s %10s %10s %8s %8s\n", "model", "params", "bytes", "d2d_GBps", "pack_GBps",
                "unpk_GBps", "pack/d2d", "unpk/d2d");
    double worst_pack = 1e9;
    std::vector<std::pair<std::string, std::vector<std::size_t>>> models;
    for (const char* m : {"resnet50", "bert_base"}) {
      auto sizes = param_bytes(data + "/" + m + ".params");
      if (sizes.empty()) {
        std::fprintf(stderr, "gpu_reduce: no parameters in %s/%s.params (--params DIR)\n", data.c_str(), m);
        return 2;
      }
      models.emplace_back(m, std::move(sizes));
    }
    for (const auto& [m, sizes] : models) worst_pack = std::min(worst_pack, bench_pack(m, sizes, budget));
    std::printf("\n# staging: device gradients through page-locked host buckets and back, against host gradients\n");
    std::printf("%-10s %10s %14s %14s %10s\n", "model", "bytes", "staged_GBps", "host_GBps", "staged/host");
    double worst_staging = 1e9;
    for (const auto& [m, sizes] : models) worst_staging = std::min(worst_staging, bench_staging(m, sizes, budget));
    std::printf("\nresult pack_vs_d2d %.3f target>=0.80 %s\n", worst_pack, worst_pack >= 0.80 ? "pass" : "fail");
    std::printf("result staging_vs_host %.3f info\n", worst_staging);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_reduce: %s\n", e.what());
    return 1;
  }
  return 0;
}
