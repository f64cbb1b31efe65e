// A /dev/shm of its own for a test's ranks (a private tmpfs in a mount namespace), shared by the
// suites that need a small or empty /dev/shm.
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "harness.hpp"

namespace ddp_test {

inline bool write_file(const char* path, const std::string& text) {
  const int fd = ::open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  return ok;
}

// Gives this process a mount namespace of its own with a tmpfs of `bytes` on /dev/shm. Root
// needs only that; anyone else first needs a user namespace in which it is root. Returns why
// it could not, or an empty string.
inline std::string make_private_dev_shm(std::size_t bytes) {
  const bool user_ns = ::geteuid() != 0;
  const std::string uid = std::to_string(::getuid()), gid = std::to_string(::getgid());
  const std::string size = "size=" + std::to_string(bytes);
  if (::unshare(CLONE_NEWNS | (user_ns ? CLONE_NEWUSER : 0)) != 0)
    return std::string(user_ns ? "unshare(CLONE_NEWUSER|CLONE_NEWNS)" : "unshare(CLONE_NEWNS)") + ": " +
           std::strerror(errno);
  if (user_ns && !(write_file("/proc/self/setgroups", "deny") && write_file("/proc/self/uid_map", "0 " + uid + " 1") &&
                   write_file("/proc/self/gid_map", "0 " + gid + " 1")))
    return std::string("writing the user namespace's id maps: ") + std::strerror(errno);
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0)
    return std::string("mount(/, MS_REC|MS_PRIVATE): ") + std::strerror(errno);
  if (::mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, size.c_str()) != 0)
    return "mount(tmpfs, /dev/shm, " + size + "): " + std::strerror(errno);
  return {};
}

// run_ranks(n, fn) with a /dev/shm of `bytes` that only these ranks see: a driver process makes
// the namespace and forks the ranks inside it, then sends their outcomes back. Ends the suite as
// SKIP (exit 77), saying why, where the environment cannot make the namespace.
inline std::vector<ddp_test::outcome> run_ranks_with_dev_shm(std::size_t bytes, int n, const std::function<void(int)>& fn) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0) std::abort();
  std::fflush(nullptr);
  const pid_t driver = ::fork();
  if (driver == 0) {
    ::close(p[0]);
    std::string report;
    if (const std::string why = make_private_dev_shm(bytes); !why.empty()) {
      report = "skip " + why;
    } else {
      for (const auto& o : run_ranks(n, fn, std::chrono::seconds(120))) {
        char head[160];
        std::snprintf(head, sizeof head, "%d %d %d %d %.3f %zu\n", o.rank, o.exit_code, o.timed_out ? 1 : 0, o.errc,
                      o.seconds, o.message.size());
        report += head + o.message;
      }
    }
    for (std::size_t off = 0; off < report.size();) {
      const ssize_t w = ::write(p[1], report.data() + off, report.size() - off);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;
      off += static_cast<std::size_t>(w);
    }
    ::_exit(0);
  }
  ::close(p[1]);
  std::string report;
  char buf[4096];
  for (ssize_t r; (r = ::read(p[0], buf, sizeof buf)) != 0;)
    if (r > 0) report.append(buf, static_cast<std::size_t>(r));
    else if (errno != EINTR) break;
  ::close(p[0]);
  int st = 0;
  ::waitpid(driver, &st, 0);
  if (report.rfind("skip ", 0) == 0) {
    std::fprintf(stderr, "SKIP: this environment cannot give a test its own /dev/shm (%s)\n", report.c_str() + 5);
    std::fflush(nullptr);
    std::_Exit(77);
  }
  std::vector<ddp_test::outcome> outs;
  std::size_t at = 0;
  while (at < report.size()) {
    const std::size_t nl = report.find('\n', at);
    if (nl == std::string::npos) break;
    ddp_test::outcome o;
    int timed_out = 0;
    std::size_t len = 0;
    if (std::sscanf(report.c_str() + at, "%d %d %d %d %lf %zu", &o.rank, &o.exit_code, &timed_out, &o.errc, &o.seconds,
                    &len) != 6)
      break;
    o.timed_out = timed_out != 0;
    o.message = report.substr(nl + 1, len);
    at = nl + 1 + len;
    outs.push_back(std::move(o));
  }
  REQUIRE_MESSAGE(static_cast<int>(outs.size()) == n, "the driver process reported " << outs.size() << " of " << n
                                                                                       << " ranks (status " << st << ")");
  return outs;
}

}  // namespace ddp_test
