#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// A file descriptor's owner and the text of an errno, for every part of ddp that holds a
// descriptor (sockets, the store, the mesh, checkpoint files, shared memory).

#include <unistd.h>

#include <cerrno>
#include <string>
#include <system_error>
#include <utility>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// An errno as a message: its text and its number ("No such file or directory (errno 2)").
inline std::string errno_text(int e) {
  return std::generic_category().message(e) + " (errno " + std::to_string(e) + ")";
}

/// Owns a file descriptor: closed when the owner goes, movable, not copyable.
class fd_handle {
 public:
  fd_handle() = default;
  explicit fd_handle(int fd) noexcept : fd_(fd) {}
  fd_handle(fd_handle&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  fd_handle& operator=(fd_handle&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  fd_handle(const fd_handle&) = delete;
  fd_handle& operator=(const fd_handle&) = delete;
  ~fd_handle() { reset(); }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  /// Closes now; returns close()'s errno, 0 when it succeeded or nothing was held.
  int reset() noexcept {
    if (fd_ < 0) return 0;
    const int rc = ::close(fd_);
    fd_ = -1;
    return rc == 0 ? 0 : errno;
  }
  /// Holds `fd` from now on (closing what it held).
  void reset(int fd) noexcept {
    reset();
    fd_ = fd;
  }
  int release() noexcept { return std::exchange(fd_, -1); }

 private:
  int fd_ = -1;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
