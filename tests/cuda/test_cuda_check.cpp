// Runs with or without a GPU: only the CUDA runtime library is needed.
#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include "ddp/detail/cuda_check.hpp"

#include <doctest/doctest.h>

#include <string>

#include "ddp/memory/pinned_allocator.hpp"

namespace {
int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  (void)cudaGetLastError();
  return n;
}
}  // namespace

TEST_CASE("DDP_CUDA_CHECK passes success through and turns failures into ddp::error") {
  CHECK_NOTHROW(DDP_CUDA_CHECK(cudaSuccess));
  const int line = __LINE__ + 2;
  try {
    DDP_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL("expected ddp::error");
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::system);
    const std::string what = e.what();
    CHECK(what.find("[ddp.system]") == 0);
    CHECK(what.find("cudaErrorInvalidValue") != std::string::npos);
    CHECK(what.find("test_cuda_check.cpp:" + std::to_string(line)) != std::string::npos);
  }
}

TEST_CASE("pinned_allocator without a device reports ddp::error") {
  if (device_count() > 0) {
    MESSAGE("a CUDA device is present; covered by cuda_allocator");
    return;
  }
  ddp::pinned_allocator a;
  CHECK(a.allocate(0) == nullptr);
  try {
    void* p = a.allocate(4096);
    a.deallocate(p, 4096);
    FAIL("expected ddp::error");
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::system);
    CHECK(std::string(e.what()).find("cudaHostAlloc") != std::string::npos);
  }
}
