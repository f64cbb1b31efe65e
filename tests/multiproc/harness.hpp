#pragma once
// Runs a function in N real child processes (fork) and collects each one's outcome: exit code,
// and the what() of a ddp::error it threw, carried back over a pipe. Children that outlive the
// limit are killed, so a hang shows up as a failed test rather than a stuck suite.
//
// The usual case is one line around its body (on_ranks builds each rank's group on a fresh
// port, expect_ok checks every rank ended well and shows them all when one did not):
//   expect_ok(on_ranks(3, opts, [&](int r, ddp::process_group& pg) { ... }));
// and "raises X with text Y" is raises() in the test's own process, require_raises() in a child
// (tests/raises.hpp), ended_with() on a child's outcome.

#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdlib.h>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <functional>
#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/process_group.hpp>

#include <doctest/doctest.h>

#include "../raises.hpp"

namespace ddp_test {

struct outcome {
  int rank = -1;
  int exit_code = -1;      ///< 0 success, 1 threw, 2 other exception, 128+sig when signalled
  bool timed_out = false;  ///< killed by the harness
  std::string message;     ///< what() of the exception, or what the child reported
  int errc = 0;            ///< ddp::errc value when a ddp::error was thrown
  double seconds = 0;      ///< wall time until the child ended
  bool ok() const { return exit_code == 0; }
};

/// An integer from the environment (DDP_SOAK_COUNT, DDP_FAULT_TRIALS, ...), or `dflt`.
inline long env_long(const char* name, long dflt) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtol(v, nullptr, 10) : dflt;
}

/// Options for rank `rank` of a group of `n` on localhost:`port`, asking for backend `b`.
inline ddp::init_options group_options(int rank, int n, int port, std::chrono::milliseconds timeout,
                                       ddp::backend b = ddp::backend::automatic) {
  ddp::init_options o;
  o.rank = rank;
  o.world_size = n;
  o.master_port = port;
  o.timeout = timeout;
  o.backend = b;
  return o;
}

/// group_options with a suite's own default timeout, so that each call names only what differs:
/// `constexpr ddp_test::local_group opts{20s};`, then `opts(r, n, port)`, `opts(r, n, port, 3s)`,
/// `opts(r, n, port, 20s, ddp::backend::tcp)` or `opts(r, n, port, secret)`; on_ranks takes
/// `opts`, or `local_group{3s}` and `local_group{20s, ddp::backend::tcp}` for one case's own.
struct local_group {
  std::chrono::milliseconds timeout;
  ddp::backend backend = ddp::backend::automatic;

  ddp::init_options operator()(int rank, int n, int port) const {
    return group_options(rank, n, port, timeout, backend);
  }
  ddp::init_options operator()(int rank, int n, int port, std::chrono::milliseconds t,
                               ddp::backend b = ddp::backend::automatic) const {
    return group_options(rank, n, port, t, b);
  }
  /// With the group's shared secret (docs/security.md).
  ddp::init_options operator()(int rank, int n, int port, std::string auth_token) const {
    auto o = group_options(rank, n, port, timeout);
    o.auth_token = std::move(auth_token);
    return o;
  }
};

/// An ephemeral port that was free a moment ago (the kernel hands out a fresh one each call).
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

/// Runs fn(rank) in `n` processes; `ranks` lets a test start a chosen subset or duplicates.
/// The child's report: "<errc> <message>" written to a pipe.
inline std::vector<outcome> run_processes(const std::vector<int>& ranks, const std::function<void(int)>& fn,
                                          std::chrono::milliseconds limit = std::chrono::seconds(60)) {
  std::fflush(nullptr);
  struct child {
    pid_t pid;
    int fd;
    outcome out;
    bool done = false;
  };
  std::vector<child> kids;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r : ranks) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) std::abort();
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(p[0]);
      int code = 0;
      std::string msg;
      try {
        fn(r);
      } catch (const ddp::error& e) {
        code = 1;
        msg = std::to_string(e.code().value()) + " " + e.what();
      } catch (const std::exception& e) {
        code = 2;
        msg = "0 " + std::string(e.what());
      }
      if (!msg.empty()) {
        [[maybe_unused]] auto w = ::write(p[1], msg.data(), msg.size());
      }
      ::close(p[1]);
      std::fflush(nullptr);
      ::_exit(code);
    }
    ::close(p[1]);
    kids.push_back({pid, p[0], {}});
    kids.back().out.rank = r;
  }
  std::size_t left = kids.size();
  while (left > 0) {
    for (auto& k : kids) {
      if (k.done) continue;
      int st = 0;
      if (::waitpid(k.pid, &st, WNOHANG) == k.pid) {
        k.done = true;
        --left;
        k.out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        k.out.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        char buf[4096];
        ssize_t n;
        while ((n = ::read(k.fd, buf, sizeof buf)) > 0) k.out.message.append(buf, static_cast<std::size_t>(n));
        ::close(k.fd);
        if (auto sp = k.out.message.find(' '); sp != std::string::npos) {
          k.out.errc = std::atoi(k.out.message.substr(0, sp).c_str());
          k.out.message.erase(0, sp + 1);
        }
      }
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() - t0 > limit) {
      for (auto& k : kids)
        if (!k.done) {
          ::kill(k.pid, SIGKILL);
          ::waitpid(k.pid, nullptr, 0);
          ::close(k.fd);
          k.done = true;
          k.out.timed_out = true;
          k.out.exit_code = 128 + SIGKILL;
        }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  std::vector<outcome> outs;
  for (auto& k : kids) outs.push_back(k.out);
  return outs;
}

/// Runs fn(rank) for ranks 0..n-1.
inline std::vector<outcome> run_ranks(int n, const std::function<void(int)>& fn,
                                      std::chrono::milliseconds limit = std::chrono::seconds(60)) {
  std::vector<int> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(r);
  return run_processes(ranks, fn, limit);
}

/// Runs body(rank, group), or body(group), on ranks 0..n-1, each in its own process with a group
/// built from `options(rank, n, port)` on a fresh ephemeral port (a suite's local_group, or any
/// callable of that signature); each rank's outcome. Cases that need the port itself, or do
/// something before the group exists, use run_ranks.
template <class Options, class Body>
std::vector<outcome> on_ranks(int n, const Options& options, Body&& body,
                              std::chrono::milliseconds limit = std::chrono::seconds(60)) {
  const int port = free_port();
  return run_ranks(
      n,
      [&](int r) {
        auto pg = ddp::init_process_group(options(r, n, port));
        if constexpr (std::is_invocable_v<Body&, int, ddp::process_group&>)
          body(r, pg);
        else
          body(pg);
      },
      limit);
}

/// A readable line per rank: exit, whether it was killed, its message.
inline std::string summary(const std::vector<outcome>& outs) {
  std::string s;
  for (auto& o : outs)
    s += "rank " + std::to_string(o.rank) + ": exit " + std::to_string(o.exit_code) +
         (o.timed_out ? " (killed: hung)" : "") + (o.message.empty() ? "" : " " + o.message) + "\n";
  return s;
}

inline bool all_ok(const std::vector<outcome>& outs) {
  for (auto& o : outs)
    if (!o.ok()) return false;
  return true;
}

/// CHECKs that every rank ended well; a failure shows each rank's summary and the caller's line.
inline void expect_ok(const std::vector<outcome>& outs,
                      const std::source_location at = std::source_location::current()) {
  INFO("ranks run at " << std::string(at.file_name()) << ":" << at.line() << "\n" << summary(outs));
  CHECK(all_ok(outs));
}

/// raises() for a child's outcome: it ended by raising a ddp::error of `code` (carried back by
/// the harness) whose message holds every one of `texts`; empty when it did.
inline std::string ended_with(const outcome& o, ddp::errc code, std::initializer_list<std::string_view> texts = {}) {
  if (o.exit_code != 1 || o.errc != static_cast<int>(code))
    return "rank " + std::to_string(o.rank) + " exit " + std::to_string(o.exit_code) + ", errc " +
           std::to_string(o.errc) + " instead of " + ddp::detail::errc_name(code) + ": " + o.message;
  for (auto t : texts)
    if (o.message.find(t) == std::string::npos)
      return "rank " + std::to_string(o.rank) + "'s message lacks '" + std::string(t) + "': " + o.message;
  return {};
}

/// A fresh directory for one test case, removed with it.
struct temp_dir {
  std::filesystem::path path;
  temp_dir() {
    char tmpl[] = "/tmp/ddp_test_XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  ~temp_dir() { std::filesystem::remove_all(path); }
};

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
inline void write_file(const std::filesystem::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(s.data(), static_cast<std::streamsize>(s.size()));
}

}  // namespace ddp_test
