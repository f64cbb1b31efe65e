// ddprun: starts N local ranks of a program, torchrun/mpirun style.
//
//   ddprun -n 4 [--master-addr 127.0.0.1] [--port P] [--timeout S] [--] prog args...
//
// Picks a free port unless --port is given, sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
// LOCAL_RANK and LOCAL_WORLD_SIZE for each rank, prefixes every output line with "[rank] ", and
// when one rank fails, ends the others and exits with that rank's status.

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
#include <cstring>
#include <string>
#include <vector>

#include <ddp/detail/socket.hpp>

namespace {

volatile sig_atomic_t g_signal = 0;
void on_signal(int s) { g_signal = s; }

[[noreturn]] void usage(const char* msg) {
  std::fprintf(stderr,
               "ddprun: %s\nusage: ddprun -n N [--master-addr ADDR] [--port PORT] [--timeout SECONDS] [--] "
               "program [args...]\n",
               msg);
  std::exit(2);
}

int pick_port(const std::string& addr) {
  const auto eps = ddp::detail::resolve(addr, 0, -1, true);
  auto fd = ddp::detail::listen_on(eps.front(), -1, 1);
  return ddp::detail::port_of(ddp::detail::local_address(fd.get()));
}

struct rank_proc {
  pid_t pid = -1;
  int out = -1;
  std::string pending;
  bool exited = false;
  int status = 0;
};

void emit(int rank, std::string& pending, bool flush_all) {
  std::size_t pos;
  while ((pos = pending.find('\n')) != std::string::npos) {
    std::printf("[%d] %.*s\n", rank, static_cast<int>(pos), pending.data());
    pending.erase(0, pos + 1);
  }
  if (flush_all && !pending.empty()) {
    std::printf("[%d] %s\n", rank, pending.c_str());
    pending.clear();
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  int n = -1;
  int port = 0;
  std::string addr = "127.0.0.1";
  std::string timeout;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) -> std::string {
      if (i + 1 >= argc) usage((std::string(name) + " needs a value").c_str());
      return argv[++i];
    };
    if (a == "-n" || a == "--nproc" || a == "-np") n = std::atoi(value("-n").c_str());
    else if (a == "--master-addr") addr = value("--master-addr");
    else if (a == "--port") port = std::atoi(value("--port").c_str());
    else if (a == "--timeout") timeout = value("--timeout");
    else if (a == "-h" || a == "--help") usage("help");
    else if (a == "--") { ++i; break; }
    else if (!a.empty() && a[0] == '-') usage(("unknown option " + a).c_str());
    else break;
  }
  if (n < 1) usage("-n must be a positive number of ranks");
  if (i >= argc) usage("no program given");
  try {
    if (port == 0) port = pick_port(addr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddprun: %s\n", e.what());
    return 2;
  }

  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  std::vector<rank_proc> procs(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) { std::perror("ddprun: pipe"); return 2; }
    const pid_t pid = ::fork();
    if (pid == 0) {
      // Each rank leads its own process group, so ending a rank ends whatever it started.
      ::setpgid(0, 0);
      ::dup2(p[1], 1);
      ::dup2(p[1], 2);
      ::setenv("MASTER_ADDR", addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(n).c_str(), 1);
      if (!timeout.empty()) ::setenv("DDP_TIMEOUT", timeout.c_str(), 1);
      ::execvp(argv[i], argv + i);
      std::fprintf(stderr, "ddprun: cannot run %s: %s\n", argv[i], std::strerror(errno));
      ::_exit(127);
    }
    ::close(p[1]);
    ::setpgid(pid, pid);
    procs[static_cast<std::size_t>(r)].pid = pid;
    procs[static_cast<std::size_t>(r)].out = p[0];
  }

  int exit_code = 0;
  int failed_rank = -1;
  bool terminating = false;
  auto kill_deadline = std::chrono::steady_clock::time_point::max();
  auto end_all = [&](int sig) {
    for (auto& p : procs) ::kill(-p.pid, sig);
  };
  std::size_t running = procs.size();
  while (running > 0) {
    std::vector<pollfd> pf;
    for (auto& p : procs)
      if (p.out >= 0) pf.push_back({p.out, POLLIN, 0});
    if (!pf.empty()) ::poll(pf.data(), pf.size(), 50);
    else ::usleep(20000);
    for (std::size_t r = 0; r < procs.size(); ++r) {
      auto& p = procs[r];
      if (p.out < 0) continue;
      char buf[65536];
      for (;;) {
        pollfd one{p.out, POLLIN, 0};
        if (::poll(&one, 1, 0) <= 0) break;
        const ssize_t k = ::read(p.out, buf, sizeof buf);
        if (k <= 0) { ::close(p.out); p.out = -1; emit(static_cast<int>(r), p.pending, true); break; }
        p.pending.append(buf, static_cast<std::size_t>(k));
        emit(static_cast<int>(r), p.pending, false);
      }
    }
    for (std::size_t r = 0; r < procs.size(); ++r) {
      auto& p = procs[r];
      if (p.exited) continue;
      int st = 0;
      if (::waitpid(p.pid, &st, WNOHANG) != p.pid) continue;
      p.exited = true;
      --running;
      const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      if (code != 0 && failed_rank < 0 && !terminating) {
        failed_rank = static_cast<int>(r);
        exit_code = code;
        std::fprintf(stderr, "ddprun: rank %zu %s %d; ending the other ranks\n", r,
                     WIFEXITED(st) ? "exited with status" : "was killed by signal",
                     WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
        terminating = true;
        end_all(SIGTERM);
        kill_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      }
    }
    if (g_signal != 0 && !terminating) {
      terminating = true;
      exit_code = 128 + g_signal;
      end_all(g_signal);
      kill_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    }
    if (terminating && std::chrono::steady_clock::now() > kill_deadline) end_all(SIGKILL);
  }
  for (std::size_t r = 0; r < procs.size(); ++r) {
    if (procs[r].out >= 0) {
      // What the rank wrote before it ended; a grandchild that still holds the pipe open must
      // not keep the launcher waiting.
      ::fcntl(procs[r].out, F_SETFL, O_NONBLOCK);
      char buf[65536];
      ssize_t k;
      while ((k = ::read(procs[r].out, buf, sizeof buf)) > 0) procs[r].pending.append(buf, static_cast<std::size_t>(k));
      emit(static_cast<int>(r), procs[r].pending, true);
      ::close(procs[r].out);
    }
  }
  return exit_code;
}
