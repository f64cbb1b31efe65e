// Needs a CUDA device; exits 77 (meson: SKIP) when none is present.
#include "ddp/memory/cuda_allocator.hpp"

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ddp/concepts.hpp"
#include "ddp/memory/pinned_allocator.hpp"

static_assert(ddp::copying_allocator<ddp::cuda_allocator>);
static_assert(ddp::has_nothrow_deallocate<ddp::cuda_allocator> && ddp::has_nothrow_deallocate<ddp::pinned_allocator>);

namespace {
struct device_and_stream {  // what cuda_allocator::for_reducer reads from a reducer
  int device() const { return 0; }
  cudaStream_t stream() const { return nullptr; }
};
static_assert(ddp::allocator_bound_to<ddp::cuda_allocator, device_and_stream>);

bool aligned(const void* p, std::size_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }
int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  (void)cudaGetLastError();
  return n;
}
}  // namespace

TEST_CASE("pinned_allocator: page-locked, page-aligned, host-writable") {
  ddp::pinned_allocator a;
  CHECK(a.location() == ddp::memory_kind::pinned);
  CHECK(a.allocate(0) == nullptr);
  a.deallocate(nullptr, 0);
  const std::size_t bytes = (std::size_t{8} << 20) + 5;
  void* p = a.allocate(bytes);
  REQUIRE(p != nullptr);
  CHECK(aligned(p, 4096));
  std::memset(p, 7, bytes);
  CHECK(static_cast<unsigned char*>(p)[bytes - 1] == 7);
  cudaPointerAttributes attr{};
  DDP_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
  CHECK(attr.type == cudaMemoryTypeHost);
  a.deallocate(p, bytes);
}

TEST_CASE("cuda_allocator: device memory on the chosen device, stream ordered") {
  cudaStream_t s = nullptr;
  DDP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int last = device_count() - 1;
  ddp::cuda_allocator a{.device = last, .stream = s};
  CHECK(a.location() == ddp::memory_kind::cuda);
  CHECK(a.allocate(0) == nullptr);

  DDP_CUDA_CHECK(cudaSetDevice(0));
  const std::size_t n = 1 << 20;
  std::vector<float> in(n), out(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) in[i] = static_cast<float>(i) * 0.5f;
  void* d = a.allocate(n * sizeof(float));
  REQUIRE(d != nullptr);
  CHECK(aligned(d, 256));
  int current = -1;
  DDP_CUDA_CHECK(cudaGetDevice(&current));
  CHECK(current == 0);  // the caller's device is restored
  cudaPointerAttributes attr{};
  DDP_CUDA_CHECK(cudaPointerGetAttributes(&attr, d));
  CHECK(attr.type == cudaMemoryTypeDevice);
  CHECK(attr.device == last);

  DDP_CUDA_CHECK(cudaMemcpyAsync(d, in.data(), n * sizeof(float), cudaMemcpyHostToDevice, s));
  DDP_CUDA_CHECK(cudaMemcpyAsync(out.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, s));
  a.deallocate(d, n * sizeof(float));
  DDP_CUDA_CHECK(cudaStreamSynchronize(s));
  CHECK(out == in);

  // Many small buckets: all distinct and aligned.
  std::vector<void*> ps;
  for (std::size_t b : {1u, 3u, 64u, 1000u, 4096u}) {
    ps.push_back(a.allocate(b));
    CHECK(aligned(ps.back(), 256));
  }
  for (std::size_t i = 1; i < ps.size(); ++i) CHECK(ps[i] != ps[i - 1]);
  for (void* p : ps) a.deallocate(p, 0);
  DDP_CUDA_CHECK(cudaStreamSynchronize(s));
  DDP_CUDA_CHECK(cudaStreamDestroy(s));
}

TEST_CASE("cuda_allocator: an absurd request throws ddp::error and leaves CUDA usable") {
  ddp::cuda_allocator a{};
  try {
    void* p = a.allocate(std::size_t{1} << 60);
    a.deallocate(p, 0);
    FAIL("expected ddp::error");
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::system);
    CHECK(std::string(e.what()).find("cudaErrorMemoryAllocation") != std::string::npos);
  }
  // DDP_CUDA_CHECK cleared the recorded error, so it does not resurface in the next call.
  CHECK(cudaPeekAtLastError() == cudaSuccess);
  void* p = a.allocate(64);
  CHECK(p != nullptr);
  a.deallocate(p, 64);
  DDP_CUDA_CHECK(cudaDeviceSynchronize());
}

TEST_CASE("cuda_allocator: a device that does not exist is reported") {
  ddp::cuda_allocator a{.device = device_count() + 3};
  CHECK_THROWS_AS((void)a.allocate(64), ddp::error);
}

TEST_CASE("cuda_allocator: copy and zero move bytes between host and device and return when done") {
  ddp::cuda_allocator a = ddp::cuda_allocator::for_reducer(device_and_stream{});
  const std::size_t n = 1000;
  std::vector<float> in(n), out(n, -1.0f);
  for (std::size_t i = 0; i < n; ++i) in[i] = static_cast<float>(i);
  void* d = a.allocate(n * sizeof(float));
  void* d2 = a.allocate(n * sizeof(float));
  a.copy(d, in.data(), n * sizeof(float));    // host to device
  a.copy(d2, d, n * sizeof(float));           // device to device
  a.zero(d2, 10 * sizeof(float));
  a.copy(out.data(), d2, n * sizeof(float));  // device to host, complete on return
  for (std::size_t i = 0; i < n; ++i) CHECK(out[i] == (i < 10 ? 0.0f : in[i]));
  a.deallocate(d, n * sizeof(float));
  a.deallocate(d2, n * sizeof(float));
  DDP_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(ddp::cuda_allocator::release_error() == cudaSuccess);
}

TEST_CASE("cuda_allocator: a failed release is recorded, not thrown") {
  ddp::cuda_allocator a{.device = device_count() + 3};  // a device that does not exist
  int never_freed = 0;
  a.deallocate(&never_freed, sizeof never_freed);  // noexcept: cudaSetDevice refuses first
  CHECK(ddp::cuda_allocator::release_error() == cudaErrorInvalidDevice);
  CHECK(ddp::cuda_allocator::release_error() == cudaSuccess);  // taking it cleared it
  CHECK(cudaPeekAtLastError() == cudaSuccess);
}

int main(int argc, char** argv) {
  if (device_count() == 0) {
    std::puts("no CUDA device: skipped");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
