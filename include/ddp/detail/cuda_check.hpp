#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
/// \file cuda_check.hpp
/// Conversion of CUDA runtime errors into `ddp::error`, and a scoped current-device switch.

#include <cuda_runtime.h>

#include <string>

#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

[[noreturn]] inline void raise_cuda(cudaError_t e, const char* expr, const char* file, int line) {
  // Reset the runtime's last-error slot so the failure is not reported again by an unrelated
  // later call; errors that poison the context (kernel faults) stay, and the next call says so.
  (void)cudaGetLastError();
  raise(errc::system, -1,
        std::string("CUDA ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ") from " + expr + " at " + file +
            ":" + std::to_string(line));
}

/// Makes `device` current for the scope and restores the previous device on exit, so that an
/// allocator bound to one GPU leaves the caller's device selection alone.
class cuda_device_guard {
 public:
  explicit cuda_device_guard(int device) {
    cudaError_t e = cudaGetDevice(&previous_);
    if (e != cudaSuccess) raise_cuda(e, "cudaGetDevice", __FILE__, __LINE__);
    if (previous_ != device) {
      e = cudaSetDevice(device);
      if (e != cudaSuccess) raise_cuda(e, "cudaSetDevice", __FILE__, __LINE__);
      switched_ = true;
    }
  }
  ~cuda_device_guard() {
    if (switched_) (void)cudaSetDevice(previous_);
  }
  cuda_device_guard(const cuda_device_guard&) = delete;
  cuda_device_guard& operator=(const cuda_device_guard&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp

/// Evaluates a CUDA runtime call; on failure clears the last error and throws `ddp::error`
/// (`errc::system`) naming the CUDA error, the expression, file and line.
#define DDP_CUDA_CHECK(expr)                                                                                     \
  do {                                                                                                           \
    const cudaError_t ddp_cuda_status_ = (expr);                                                                 \
    if (ddp_cuda_status_ != cudaSuccess) ::ddp::detail::raise_cuda(ddp_cuda_status_, #expr, __FILE__, __LINE__); \
  } while (false)
