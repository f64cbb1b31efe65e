#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The launcher's note: a launcher that ends a host's ranks because one of them failed (ddprun
// with --nnodes) first tells them why, so that the group's failure record names the rank that
// failed first, not the ranks it ended. The launcher passes one end of a socket in
// DDP_LAUNCHER_FD; a group watches it on its reactor (reactor.hpp) and, when a line arrives
// ("rank 3 was killed by signal 9 ..."), records it as the group's failure (the first writer
// wins; on the reactor's courier, since that waits on the store) and answers one byte
// (launcher_watch::ack), after which the launcher ends the rank. See docs/reliability.md.

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/group/detail/reactor.hpp>

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

/// Watches the launcher's descriptor on `loop`; `on_note(line)` runs on the reactor's thread for
/// each line (it must not wait: it hands the record to the courier), and whoever handles the
/// note answers with ack(fd) once it is recorded.
class launcher_watch final : public reactor_handler {
 public:
  /// Only the newest watch of a process reads the descriptor (an elastic group's next
  /// generation forms while the last one's group still lives, and a program may hold two
  /// groups): each note goes to one group, the newest, whole; the one before takes over again
  /// when the newest goes.
  launcher_watch(reactor& loop, int fd, std::function<void(const std::string&)> on_note)
      : fd_(fd), on_note_(std::move(on_note)) {
    reg_ = loop.add(*this, reactor::begin::paused);
    auto& w = watches();
    std::lock_guard lock(w.mu);
    w.stack.reserve(w.stack.size() + 1);
    launcher_watch* older = !w.stack.empty() && w.stack.back()->fd_ == fd_ ? w.stack.back() : nullptr;
    if (older != nullptr) older->reg_.unwatch(fd_);
    try {
      reg_.watch(fd_, EPOLLIN, 0);
    } catch (...) {
      if (older != nullptr) older->reg_.watch(fd_, EPOLLIN, 0);
      throw;
    }
    w.stack.push_back(this);
    reg_.start();  // called from now on: reg_ is set
  }
  launcher_watch(const launcher_watch&) = delete;
  launcher_watch& operator=(const launcher_watch&) = delete;
  ~launcher_watch() override {
    if (owner_.forked()) return;  // the parent's reactor: nothing of ours runs there
    auto& w = watches();
    {
      std::lock_guard lock(w.mu);
      const bool newest = !w.stack.empty() && w.stack.back() == this;
      std::erase(w.stack, this);
      reg_.unwatch(fd_);
      if (newest && !w.stack.empty() && w.stack.back()->fd_ == fd_) try {
          w.stack.back()->reg_.watch(fd_, EPOLLIN, 0);
        } catch (...) {
        }
    }
    reg_.reset();
  }

  /// The one byte that tells the launcher the note is recorded.
  static void ack(int fd) noexcept {
    const char one = '1';
    (void)!::write(fd, &one, 1);
  }

 private:
  void on_event(std::uint64_t, std::uint32_t, deadline_t) override {
    char buf[512];
    // Never blocks the reactor, whether or not the launcher made the descriptor non-blocking.
    const ssize_t k = ::recv(fd_, buf, sizeof buf, MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (k <= 0) {  // the launcher is gone
      reg_.unwatch(fd_);
      return;
    }
    line_.append(buf, static_cast<std::size_t>(k));
    if (line_.size() > max_note && line_.find('\n') == std::string::npos) {
      // Not a note of ddprun's (a line of a few hundred bytes): the group's failure says so.
      line_ = group_failure{errc::protocol, "the launcher sent more than " + std::to_string(max_note) +
                                                " bytes without ending its note; is DDP_LAUNCHER_FD ddprun's?"}
                  .encode() +
              '\n';
    }
    for (std::size_t nl; (nl = line_.find('\n')) != std::string::npos; line_.erase(0, nl + 1)) try {
        on_note_(line_.substr(0, nl));
      } catch (...) {
      }
  }

  /// The process's watches, oldest first.
  struct registry {
    std::mutex mu;
    std::vector<launcher_watch*> stack;
  };
  static registry& watches() {
    static auto* r = new registry;  // never destroyed: a group may close during static destruction
    return *r;
  }

  static constexpr std::size_t max_note = 64 * 1024;  // a note's bound
  int fd_;
  std::function<void(const std::string&)> on_note_;
  std::string line_;
  owner_process owner_;
  reactor::registration reg_;  // last: off the reactor before the rest goes
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
