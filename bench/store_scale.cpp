// Joining at scale: N simulated ranks run the store half of joining a group
// (ddp::detail::join_store, include/ddp/group/detail/rendezvous.hpp) against one real store_server, each
// over its own real store_client socket, and we time it.
//
//   store_scale [--ranks 1024,4096,16384] [--procs 8] [--reps 3] [--timeout-ms 120000]
//               [--stack-kb 128] [--connect-first] [--no-header]
//
// Processes: the "rank 0" process hosts the store_server and runs rank 0's join_store; `procs`
// forked processes drive ranks 1..N-1, one thread per rank (small stacks), all released at
// once. Per N and repetition:
//   join_ms    from the release to the last rank's join_store return: connecting included, or,
//              with --connect-first, every process connects its ranks one after another before
//              the release (as bench/peers/torch_store_scale.py must), and the time is joining alone
//   rss_mib    rank 0's resident memory growth from before the release until every rank joined
//   fds        descriptors rank 0 holds then (/proc/self/fd)
//   req/rank   store requests per rank (send() calls per client thread: one frame each), max
// Medians over `reps` (noisy machine). CSV on stdout, one line per N, the same columns as
// bench/peers/torch_store_scale.py, so bench/run_store_scale.sh can set them side by side:
//   system,ranks,procs,reps,join_median_ms,join_min_ms,join_max_ms,rank0_rss_mib,rank0_fds,requests_per_rank,failed
// Every process raises RLIMIT_NOFILE's soft limit to its hard limit; rank 0 needs N + slack
// descriptors, so an N the hard limit cannot hold is skipped with a line on stderr.
#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/group/detail/rendezvous.hpp>
#include <ddp/store.hpp>

#include <dirent.h>
#include <dlfcn.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

// ---- counting store requests ----------------------------------------------------------------
// The client sends each request frame with one send() (send_all loops only on a partial send,
// which a frame of a few dozen bytes never is); counting this thread's send() calls counts its
// requests. The definition here takes precedence over libc's, which it forwards to.
namespace {
thread_local long t_sends = 0;
thread_local long t_bytes = 0;
}  // namespace
extern "C" ssize_t send(int fd, const void* buf, size_t n, int flags) {
  using send_fn = ssize_t (*)(int, const void*, size_t, int);
  static const auto real = reinterpret_cast<send_fn>(::dlsym(RTLD_NEXT, "send"));
  ++t_sends;
  const ssize_t k = real(fd, buf, n, flags);
  if (k > 0) t_bytes += k;
  return k;
}

namespace {

using clk = std::chrono::steady_clock;  // CLOCK_MONOTONIC: one clock for all processes

long long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(clk::now().time_since_epoch()).count();
}

rlim_t raise_nofile() {
  rlimit r{};
  ::getrlimit(RLIMIT_NOFILE, &r);
  r.rlim_cur = r.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &r);
  return r.rlim_cur;
}

int open_fds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (auto* e = ::readdir(d))
      if (e->d_name[0] != '.') ++n;
    ::closedir(d);
    --n;  // the directory stream's own descriptor
  }
  return n;
}

long rss_kib() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * (::sysconf(_SC_PAGESIZE) / 1024);
}

void write_all(int fd, const void* p, std::size_t n) {
  auto c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t k = ::write(fd, c, n);
    if (k <= 0) std::_Exit(3);
    c += k;
    n -= static_cast<std::size_t>(k);
  }
}
bool read_all(int fd, void* p, std::size_t n) {
  auto c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t k = ::read(fd, c, n);
    if (k <= 0) return false;
    c += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

struct options {
  std::vector<int> ranks{1024, 4096, 16384};
  int procs = 8;
  int reps = 3;
  long long timeout_ms = 120000;
  std::size_t stack_kb = 128;
  bool header = true;
  bool connect_first = false;  // connections made before the clock starts (TCPStore's script does)
};

// What a client process reports once all its ranks returned.
struct client_report {
  long long last_ns = 0;  // latest join_store return
  int failed = 0;
  long max_requests = 0;
  long long requests = 0;
  long long bytes = 0;
  char first_error[256] = {};
  char other_error[256] = {};  // the first that is not the rendezvous timeout itself
};

// What the rank 0 process reports once every rank joined.
struct rank0_report {
  long long joined_ns = 0;
  long rss_growth_kib = 0;
  int fds = 0;
  int failed = 0;
  std::uint64_t group = 0;
  char error[256] = {};
};

struct rank_thread {
  int rank;
  int world;
  int port;
  long long timeout_ms;
  std::atomic<int>* go;
  std::atomic<int>* finished;  // ranks that returned, joined or not
  long long done_ns = 0;
  long requests = 0;
  long bytes = 0;
  std::uint64_t group = 0;
  std::string error;
  std::unique_ptr<ddp::store_client> st;  // made before the release with --connect-first
};

void* run_rank(void* arg) {
  auto& t = *static_cast<rank_thread*>(arg);
  while (t.go->load(std::memory_order_acquire) == 0) t.go->wait(0, std::memory_order_acquire);
  try {
    const auto until = ddp::detail::clock::now() + std::chrono::milliseconds(t.timeout_ms);
    if (!t.st) t.st = std::make_unique<ddp::store_client>("127.0.0.1", t.port, t.rank, until);
    ddp::detail::join_request req{t.rank, t.world, "store_scale", "127.0.0.1:" + std::to_string(t.port),
                                  t.timeout_ms};
    t.group = ddp::detail::join_store(*t.st, req, until);
    t.done_ns = now_ns();
    t.requests = t_sends;
    t.bytes = t_bytes;
    t.finished->fetch_add(1);
    t.finished->notify_all();
    // Hold the connection until the process is told to go, as a real rank holds its store.
    while (t.go->load(std::memory_order_acquire) == 1) t.go->wait(1, std::memory_order_acquire);
  } catch (const std::exception& e) {
    t.done_ns = now_ns();
    t.requests = t_sends;
    t.error = e.what();
    t.st.reset();
    t.finished->fetch_add(1);
    t.finished->notify_all();
  }
  return nullptr;
}

// A process driving ranks [lo, hi): reports on `out` once all returned, exits when `in` closes.
[[noreturn]] void client_process(int lo, int hi, int world, int port, const options& o, int in, int out) {
  raise_nofile();
  std::atomic<int> go{0}, finished{0};
  std::vector<rank_thread> ts(static_cast<std::size_t>(hi - lo));
  std::vector<pthread_t> ids(ts.size());
  pthread_attr_t attr;
  ::pthread_attr_init(&attr);
  ::pthread_attr_setstacksize(&attr, o.stack_kb * 1024);
  for (std::size_t i = 0; i < ts.size(); ++i) {
    ts[i].rank = lo + static_cast<int>(i);
    ts[i].world = world;
    ts[i].port = port;
    ts[i].timeout_ms = o.timeout_ms;
    ts[i].go = &go;
    ts[i].finished = &finished;
    if (o.connect_first)
      ts[i].st = std::make_unique<ddp::store_client>(
          "127.0.0.1", port, ts[i].rank, ddp::detail::clock::now() + std::chrono::milliseconds(o.timeout_ms));
    if (::pthread_create(&ids[i], &attr, run_rank, &ts[i]) != 0) {
      std::fprintf(stderr, "store_scale: pthread_create failed at rank %d: %s\n", lo + static_cast<int>(i),
                   std::strerror(errno));
      std::_Exit(4);
    }
  }
  char c;
  write_all(out, "r", 1);        // threads are up
  if (!read_all(in, &c, 1)) std::_Exit(5);  // release
  go.store(1, std::memory_order_release);
  go.notify_all();
  // Wait until every rank returned (joined or failed), then report.
  client_report rep;
  for (int n = finished.load(); n < static_cast<int>(ts.size()); n = finished.load()) finished.wait(n);
  for (auto& t : ts) {
    rep.last_ns = std::max(rep.last_ns, t.done_ns);
    if (!t.error.empty()) {
      if (rep.failed++ == 0) std::snprintf(rep.first_error, sizeof rep.first_error, "%s", t.error.c_str());
      if (!rep.other_error[0] && t.error.find("rendezvous timed out") == std::string::npos)
        std::snprintf(rep.other_error, sizeof rep.other_error, "%s", t.error.c_str());
    }
    rep.max_requests = std::max(rep.max_requests, t.requests);
    rep.requests += t.requests;
    rep.bytes += t.bytes;
  }
  write_all(out, &rep, sizeof rep);
  (void)read_all(in, &c, 1);  // told to go (or the parent is gone)
  go.store(2, std::memory_order_release);
  go.notify_all();
  for (auto id : ids) ::pthread_join(id, nullptr);
  std::_Exit(0);
}

// The process hosting the store and rank 0: reports its port, joins on release, and measures
// itself when told every rank joined.
[[noreturn]] void rank0_process(int world, const options& o, int in, int out) {
  raise_nofile();
  rank0_report rep;
  ddp::store_server server{ddp::endpoint{"127.0.0.1", 0}, 0};
  const int port = server.port();
  write_all(out, &port, sizeof port);
  const long rss0 = rss_kib();
  char c;
  std::unique_ptr<ddp::store_client> early;
  if (o.connect_first)
    early = std::make_unique<ddp::store_client>("127.0.0.1", port, 0,
                                                ddp::detail::clock::now() + std::chrono::milliseconds(o.timeout_ms));
  if (!read_all(in, &c, 1)) std::_Exit(5);
  try {
    const auto until = ddp::detail::clock::now() + std::chrono::milliseconds(o.timeout_ms);
    if (!early) early = std::make_unique<ddp::store_client>("127.0.0.1", port, 0, until);
    auto& st = *early;
    ddp::detail::join_request req{0, world, "store_scale", "127.0.0.1:" + std::to_string(port), o.timeout_ms};
    rep.group = ddp::detail::join_store(st, req, until);
    rep.joined_ns = now_ns();
    write_all(out, "j", 1);
    if (!read_all(in, &c, 1)) std::_Exit(5);  // every rank joined: measure
    rep.fds = open_fds();
    rep.rss_growth_kib = rss_kib() - rss0;
    write_all(out, &rep, sizeof rep);
    (void)read_all(in, &c, 1);
  } catch (const std::exception& e) {
    rep.failed = 1;
    rep.joined_ns = now_ns();
    std::snprintf(rep.error, sizeof rep.error, "%s", e.what());
    write_all(out, "j", 1);
    (void)read_all(in, &c, 1);
    rep.fds = open_fds();
    rep.rss_growth_kib = rss_kib() - rss0;
    write_all(out, &rep, sizeof rep);
    (void)read_all(in, &c, 1);
  }
  std::_Exit(0);
}

struct pipe_pair {
  int to_child[2];
  int from_child[2];
};

pid_t spawn(pipe_pair& p, auto&& body) {
  if (::pipe(p.to_child) != 0 || ::pipe(p.from_child) != 0) {
    std::perror("pipe");
    std::exit(1);
  }
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(p.to_child[1]);
    ::close(p.from_child[0]);
    body(p.to_child[0], p.from_child[1]);
  }
  ::close(p.to_child[0]);
  ::close(p.from_child[1]);
  return pid;
}

struct result {
  double join_ms = 0;
  double rss_mib = 0;
  int fds = 0;
  long requests = 0;
  int failed = 0;
  std::string error;
  std::string other;
};

result one_run(int world, const options& o) {
  result res;
  pipe_pair r0p;
  const pid_t r0 = spawn(r0p, [&](int in, int out) { rank0_process(world, o, in, out); });
  int port = 0;
  if (!read_all(r0p.from_child[0], &port, sizeof port)) {
    std::fprintf(stderr, "store_scale: the rank 0 process died before serving\n");
    std::exit(1);
  }
  const int procs = std::max(1, std::min(o.procs, world - 1));
  std::vector<pipe_pair> cps(static_cast<std::size_t>(procs));
  std::vector<pid_t> pids;
  for (int p = 0; p < procs; ++p) {
    const int lo = 1 + static_cast<int>(static_cast<long long>(world - 1) * p / procs);
    const int hi = 1 + static_cast<int>(static_cast<long long>(world - 1) * (p + 1) / procs);
    pids.push_back(spawn(cps[static_cast<std::size_t>(p)],
                         [&](int in, int out) { client_process(lo, hi, world, port, o, in, out); }));
  }
  char c;
  for (auto& cp : cps)
    if (!read_all(cp.from_child[0], &c, 1)) {
      std::fprintf(stderr, "store_scale: a client process died while starting its threads\n");
      std::exit(1);
    }
  const long long t0 = now_ns();
  write_all(r0p.to_child[1], "g", 1);
  for (auto& cp : cps) write_all(cp.to_child[1], "g", 1);
  long long last = 0;
  for (auto& cp : cps) {
    client_report rep;
    if (!read_all(cp.from_child[0], &rep, sizeof rep)) {
      std::fprintf(stderr, "store_scale: a client process died\n");
      std::exit(1);
    }
    last = std::max(last, rep.last_ns);
    res.failed += rep.failed;
    res.requests = std::max(res.requests, rep.max_requests);
    if (rep.failed && res.error.empty()) res.error = rep.first_error;
    if (rep.other_error[0] && res.other.empty()) res.other = rep.other_error;
  }
  if (!read_all(r0p.from_child[0], &c, 1)) std::exit(1);
  write_all(r0p.to_child[1], "m", 1);
  rank0_report r0rep;
  if (!read_all(r0p.from_child[0], &r0rep, sizeof r0rep)) std::exit(1);
  last = std::max(last, r0rep.joined_ns);
  res.failed += r0rep.failed;
  if (r0rep.failed && res.error.empty()) res.error = r0rep.error;
  res.join_ms = static_cast<double>(last - t0) / 1e6;
  res.rss_mib = static_cast<double>(r0rep.rss_growth_kib) / 1024.0;
  res.fds = r0rep.fds;
  // Release everyone: clients hang up first, then the store goes.
  for (auto& cp : cps) {
    ::close(cp.to_child[1]);
    ::close(cp.from_child[0]);
  }
  for (auto pid : pids) ::waitpid(pid, nullptr, 0);
  ::close(r0p.to_child[1]);
  ::close(r0p.from_child[0]);
  ::waitpid(r0, nullptr, 0);
  return res;
}

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p == ',') ++p;
  }
  return v;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "store_scale: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--ranks") o.ranks = parse_list(next());
    else if (a == "--procs") o.procs = std::atoi(next());
    else if (a == "--reps") o.reps = std::atoi(next());
    else if (a == "--timeout-ms") o.timeout_ms = std::atoll(next());
    else if (a == "--stack-kb") o.stack_kb = static_cast<std::size_t>(std::atoll(next()));
    else if (a == "--no-header") o.header = false;
    else if (a == "--connect-first") o.connect_first = true;
    else {
      std::fprintf(stderr,
                   "usage: store_scale [--ranks 1024,4096,16384] [--procs 8] [--reps 3] [--timeout-ms 120000] "
                   "[--stack-kb 128] [--connect-first] [--no-header]\n");
      return 2;
    }
  }
  const rlim_t limit = raise_nofile();
  if (o.header)
    std::printf("system,ranks,procs,reps,join_median_ms,join_min_ms,join_max_ms,rank0_rss_mib,rank0_fds,"
                "requests_per_rank,failed\n");
  int bad = 0;
  for (int world : o.ranks) {
    // Rank 0 holds one descriptor per rank plus a few of its own; each client process one per
    // rank it drives.
    const int per_proc = (world - 1 + o.procs - 1) / std::max(1, o.procs);
    if (static_cast<rlim_t>(world) + 64 > limit || static_cast<rlim_t>(per_proc) + 64 > limit) {
      std::fprintf(stderr,
                   "# store_scale: skipping %d ranks: rank 0 needs about %d descriptors and the hard "
                   "RLIMIT_NOFILE is %llu\n",
                   world, world + 64, static_cast<unsigned long long>(limit));
      continue;
    }
    std::vector<double> join, rss, fds, req;
    int failed = 0;
    for (int r = 0; r < o.reps; ++r) {
      const auto res = one_run(world, o);
      std::fprintf(stderr, "# ranks %d rep %d: join %.1f ms, rank 0 rss +%.1f MiB, %d fds, %ld requests/rank%s%s\n",
                   world, r, res.join_ms, res.rss_mib, res.fds, res.requests, res.failed ? ", FAILED: " : "",
                   res.error.c_str());
      if (!res.other.empty()) std::fprintf(stderr, "#   and, for example: %s\n", res.other.c_str());
      join.push_back(res.join_ms);
      rss.push_back(res.rss_mib);
      fds.push_back(res.fds);
      req.push_back(static_cast<double>(res.requests));
      failed = std::max(failed, res.failed);
    }
    if (failed) ++bad;
    std::printf("%s,%d,%d,%d,%.1f,%.1f,%.1f,%.1f,%.0f,%.0f,%d\n", o.connect_first ? "ddp_connected" : "ddp", world, o.procs, o.reps, median(join),
                *std::min_element(join.begin(), join.end()), *std::max_element(join.begin(), join.end()),
                median(rss), median(fds), median(req), failed);
    std::fflush(stdout);
  }
  return bad ? 1 : 0;
}
