#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The launcher's note: a launcher that ends a host's ranks because one of them failed (ddprun
// with --nnodes) first tells them why, so that the group's failure record names the rank that
// failed first, not the ranks it ended. The launcher passes one end of a socket in
// DDP_LAUNCHER_FD; a group watches it from a thread of its own and, when a line arrives
// ("rank 3 was killed by signal 9 ..."), records it as the group's failure (the first writer
// wins) and answers one byte, after which the launcher ends the rank. See docs/reliability.md.

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include <ddp/detail/fork.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// The descriptor named by DDP_LAUNCHER_FD, or -1 when unset, malformed or not open.
inline int launcher_fd() noexcept {
  const char* v = std::getenv("DDP_LAUNCHER_FD");
  if (v == nullptr || *v == '\0') return -1;
  char* end = nullptr;
  const long fd = std::strtol(v, &end, 10);
  if (*end != '\0' || fd < 0 || fd > 1 << 20) return -1;
  return ::fcntl(static_cast<int>(fd), F_GETFD) < 0 ? -1 : static_cast<int>(fd);
}

/// Watches the launcher's descriptor from a thread; `on_note(line)` runs on that thread for
/// each line, then one byte goes back. Stops (joins) on destruction; in a forked child the
/// thread is the parent's and is left alone.
class launcher_watch {
 public:
  launcher_watch(int fd, std::function<void(const std::string&)> on_note)
      : fd_(fd), stop_(::eventfd(0, EFD_CLOEXEC)), on_note_(std::move(on_note)) {
    if (stop_ >= 0) thread_ = std::thread([this] { run(); });
  }
  launcher_watch(const launcher_watch&) = delete;
  launcher_watch& operator=(const launcher_watch&) = delete;
  ~launcher_watch() {
    if (owner_.forked()) {
      if (thread_.joinable()) abandon(std::make_unique<std::thread>(std::move(thread_)));  // the parent's thread
      if (stop_ >= 0) ::close(stop_);
      return;
    }
    if (thread_.joinable()) {
      const std::uint64_t one = 1;
      (void)!::write(stop_, &one, sizeof one);
      thread_.join();
    }
    if (stop_ >= 0) ::close(stop_);
  }

 private:
  void run() noexcept {
    std::string line;
    for (;;) {
      pollfd p[2] = {{fd_, POLLIN, 0}, {stop_, POLLIN, 0}};
      if (::poll(p, 2, -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (p[1].revents != 0) return;
      if (p[0].revents == 0) continue;
      char buf[512];
      const ssize_t k = ::read(fd_, buf, sizeof buf);
      if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (k <= 0) return;  // the launcher is gone
      line.append(buf, static_cast<std::size_t>(k));
      for (std::size_t nl; (nl = line.find('\n')) != std::string::npos; line.erase(0, nl + 1)) {
        try {
          on_note_(line.substr(0, nl));
        } catch (...) {
        }
        const char ack = '1';
        (void)!::write(fd_, &ack, 1);
      }
    }
  }

  int fd_;
  int stop_;
  std::function<void(const std::string&)> on_note_;
  std::thread thread_;
  owner_process owner_;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
