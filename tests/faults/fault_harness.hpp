#pragma once
// Fault-injection harness: forks the ranks of one trial, lets one of them (the victim) die
// (SIGKILL) or freeze (SIGSTOP) at a chosen point, and records what every survivor saw.
//
// Ranks and the parent share a board (anonymous shared memory mapped before fork): each rank
// publishes its pid, its progress (phase, iteration) and, once it caught its ddp::error, the
// time, the code and what(). The fault can come from the parent, from a sibling rank, or from
// the victim itself (synchronously at a chosen point, or from a helper thread after a delay),
// and its time is written to the board just before the signal is sent, so detection times are
// measured from the fault on one clock (CLOCK_MONOTONIC is shared by all processes).

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <ddp/error.hpp>

namespace ddp_faults {

using namespace std::chrono_literals;

inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

/// Where in a run the victim's progress is; set by the rank's own code.
enum phase : int {
  starting = 0,
  rendezvous,   ///< inside init_process_group / reducer construction
  working,      ///< in the collective loop, or in backward (between grad_ready calls)
  finishing,    ///< inside data_parallel::finish()
};

inline const char* phase_name(int p) {
  switch (p) {
    case starting: return "starting";
    case rendezvous: return "rendezvous";
    case working: return "working";
    case finishing: return "finish";
  }
  return "?";
}

/// One rank's line on the board. Only lock-free atomics and plain bytes: it lives in memory
/// shared by processes.
struct slot {
  std::atomic<int> pid;
  std::atomic<int> phase;
  std::atomic<std::int64_t> iter;        ///< collectives started, or steps begun
  std::atomic<std::int64_t> fault_ns;    ///< victim: when the signal was sent
  std::atomic<std::int64_t> start_ns;    ///< when the rank began to join the group
  std::atomic<int> fault_phase;          ///< victim: its phase at that moment
  std::atomic<std::int64_t> caught_ns;   ///< survivor: when its ddp::error was caught
  std::atomic<int> errc;                 ///< survivor: the error's code (0: none or another exception)
  std::atomic<int> noted;                ///< survivor: caught_ns/errc/what are written
  std::atomic<int> finished;             ///< the rank's body returned (resources checked)
  std::atomic<std::int64_t> cleanup_ns;  ///< survivor: time spent destroying its ddp objects
  std::atomic<std::uint64_t> group_id;   ///< pg.id() once the group exists (names shm segments)
  char what[768];
  char problem[512];
};

struct board {
  static constexpr int max_ranks = 8;
  slot s[max_ranks];
};

/// The board, mapped shared before the ranks are forked.
class shared_board {
 public:
  shared_board() {
    void* p = ::mmap(nullptr, sizeof(board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) std::abort();
    b_ = new (p) board{};
  }
  ~shared_board() { ::munmap(b_, sizeof(board)); }
  shared_board(const shared_board&) = delete;
  shared_board& operator=(const shared_board&) = delete;
  slot& operator[](int r) { return b_->s[r]; }
  void reset() {
    for (auto& x : b_->s) {
      x.pid = 0;
      x.phase = starting;
      x.iter = 0;
      x.fault_ns = 0;
      x.start_ns = 0;
      x.fault_phase = -1;
      x.caught_ns = 0;
      x.errc = 0;
      x.noted = 0;
      x.finished = 0;
      x.cleanup_ns = 0;
      x.group_id = 0;
      x.what[0] = '\0';
      x.problem[0] = '\0';
    }
  }

 private:
  board* b_;
};

inline void copy_text(char* dst, std::size_t cap, const std::string& s) {
  const std::size_t n = std::min(cap - 1, s.size());
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

// ---- what a process holds (checked after a survivor has dropped its ddp objects) -------------

inline int count_sockets() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (dirent* e = ::readdir(d)) {
      char path[300], target[128];
      std::snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
      const ssize_t k = ::readlink(path, target, sizeof target - 1);
      if (k > 0) {
        target[k] = '\0';
        if (std::strncmp(target, "socket:", 7) == 0) ++n;
      }
    }
    ::closedir(d);
  }
  return n;
}

#if defined(__SANITIZE_THREAD__)
inline constexpr bool under_tsan = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool under_tsan = true;
#else
inline constexpr bool under_tsan = false;
#endif
#else
inline constexpr bool under_tsan = false;
#endif

inline int count_threads() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  return -1;
}

inline bool maps_ddp_segment() {
  std::ifstream f("/proc/self/maps");
  std::string line;
  while (std::getline(f, line))
    if (line.find("/dev/shm/ddp-") != std::string::npos) return true;
  return false;
}

/// Names in /dev/shm that belong to the group `id` (segments are "/ddp-<id hex>-<channel>").
inline std::vector<std::string> leftover_segments(std::uint64_t id) {
  std::vector<std::string> out;
  char prefix[32];
  std::snprintf(prefix, sizeof prefix, "ddp-%016" PRIx64 "-", id);
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d))
      if (std::strncmp(e->d_name, prefix, std::strlen(prefix)) == 0) out.emplace_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

/// True when nothing listens on 127.0.0.1:port any more.
inline bool port_released(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(fd, 1) == 0;
  ::close(fd);
  return ok;
}

// ---- the fault ------------------------------------------------------------------------------

enum class source { parent, sibling, self_sync, self_async };

inline const char* source_name(source s) {
  switch (s) {
    case source::parent: return "parent";
    case source::sibling: return "sibling";
    case source::self_sync: return "self";
    case source::self_async: return "self-thread";
  }
  return "?";
}

/// What one trial does to its victim.
struct fault {
  int victim = 0;
  int sig = SIGKILL;
  source from = source::parent;
  int sibling = -1;            ///< the rank that sends it, for source::sibling
  int at_phase = working;      ///< the victim must have reached this phase ...
  std::int64_t at_iter = 0;    ///< ... and this iteration (collective or step)
  std::chrono::microseconds delay{0};  ///< then the signal comes after this long
  std::size_t at_param = 0;    ///< self_sync between buckets: before grad_ready of this position
  std::function<bool()> when;  ///< parent/sibling: strike once this holds instead (targeted tests)

  std::string describe() const {
    return std::string(sig == SIGKILL ? "SIGKILL" : "SIGSTOP") + " rank " + std::to_string(victim) + " from " +
           source_name(from) + (from == source::sibling ? " " + std::to_string(sibling) : "") + " at " +
           phase_name(at_phase) + " iter " + std::to_string(at_iter) + " +" + std::to_string(delay.count()) + "us";
  }
};

/// Sends `f.sig` to the victim once it reached (f.at_phase, f.at_iter), after f.delay. Used by
/// the parent and by a sibling rank; gives up after `give_up`.
/// Progress is (iteration, phase) in lexicographic order.
inline void strike_when_ready(shared_board& b, const fault& f, std::chrono::steady_clock::time_point give_up,
                              const std::atomic<bool>* stop = nullptr) {
  auto& v = b[f.victim];
  auto reached = [&] {
    if (f.when) return v.pid.load() > 0 && f.when();
    const auto it = v.iter.load();
    return v.pid.load() > 0 && (it > f.at_iter || (it == f.at_iter && v.phase.load() >= f.at_phase));
  };
  auto stopped = [&] { return std::chrono::steady_clock::now() >= give_up || (stop != nullptr && stop->load()); };
  while (!reached() && !stopped()) std::this_thread::sleep_for(20us);
  if (stopped()) return;
  std::this_thread::sleep_for(f.delay);
  v.fault_phase = v.phase.load();
  v.fault_ns = now_ns();
  ::kill(v.pid.load(), f.sig);
}

/// In the victim: the signal to itself, now.
inline void strike_self(slot& me, int sig) {
  me.fault_phase = me.phase.load();
  me.fault_ns = now_ns();
  ::raise(sig);
}

/// In the victim: a helper thread that signals this process `delay` after arm() (the process
/// is somewhere inside a collective by then).
class self_striker {
 public:
  self_striker(slot& me, int sig) : me_(&me), sig_(sig) {
    thread_ = std::thread([this] {
      while (!armed_.load() && !stop_.load()) std::this_thread::sleep_for(20us);
      if (stop_.load()) return;
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us_.load()));
      strike_self(*me_, sig_);
    });
  }
  ~self_striker() {
    stop_ = true;
    thread_.join();
  }
  void arm(std::chrono::microseconds delay) {
    delay_us_ = delay.count();
    armed_ = true;
  }

 private:
  slot* me_;
  int sig_;
  std::atomic<long long> delay_us_{0};  // atomic: written by arm(), read by the striker thread
  std::atomic<bool> armed_{false}, stop_{false};
  std::thread thread_;
};

// ---- one trial ------------------------------------------------------------------------------

struct rank_result {
  int rank = -1;
  bool victim = false;
  bool hung = false;          ///< the harness had to kill it
  int exit_status = 0;
  int errc = 0;
  std::string what;
  std::string problem;
  double detect_s = -1;       ///< survivor: caught - fault
  double late_start_s = 0;    ///< survivor: how long after the fault it began to join (0: before)
  double cleanup_s = 0;
};


/// True when `what` names rank `r`: "rank 3", or "ranks 1, 3" / "ranks 1 and 3".
inline bool names_rank(const std::string& what, int r) {
  for (std::size_t p = what.find("rank"); p != std::string::npos; p = what.find("rank", p + 4)) {
    if (p > 0 && std::isalnum(static_cast<unsigned char>(what[p - 1]))) continue;
    std::size_t q = p + 4;
    if (q < what.size() && what[q] == 's') ++q;
    if (q >= what.size() || what[q] != ' ') continue;
    ++q;
    for (;;) {
      std::size_t e = q;
      while (e < what.size() && std::isdigit(static_cast<unsigned char>(what[e]))) ++e;
      if (e == q) break;
      if (std::stoi(what.substr(q, e - q)) == r) return true;
      if (what.compare(e, 2, ", ") == 0) q = e + 2;
      else if (what.compare(e, 5, " and ") == 0) q = e + 5;
      else break;
    }
  }
  return false;
}

struct trial_result {
  std::string fault;
  int fault_phase = -1;
  bool fault_happened = false;
  std::vector<rank_result> ranks;
  std::vector<std::string> failures;  ///< empty: every requirement held
  double seconds = 0;
};

/// Forks `n` ranks running body(rank, board), applies `f` and checks every requirement:
/// survivors raise ddp::error peer_lost/timeout/aborted naming the victim within
/// `timeout + 2 s` of the fault (or of their own start, for a rank that began to join later), nobody hangs, nothing stays in /dev/shm, the master port is
/// free again, and each survivor got rid of its sockets, segment mappings and threads.
inline trial_result run_trial(shared_board& b, int n, int port, std::chrono::milliseconds timeout, const fault& f,
                              const std::function<void(int)>& body) {
  trial_result res;
  res.fault = f.describe();
  b.reset();
  std::fflush(nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      b[r].pid = static_cast<int>(::getpid());
      body(r);
      b[r].finished = 1;
      std::fflush(nullptr);
      ::_exit(0);
    }
    pids.push_back(pid);
  }
  const auto limit_for_fault = timeout + 2s;
  // Generous: a survivor that has not caught anything by then is hung.
  const auto hard = t0 + 2 * timeout + 20s;
  std::thread striker;
  std::atomic<bool> all_ended{false};
  if (f.from == source::parent) striker = std::thread([&] { strike_when_ready(b, f, hard, &all_ended); });

  std::vector<int> status(static_cast<std::size_t>(n), -1);
  std::vector<bool> done(static_cast<std::size_t>(n), false), hung(static_cast<std::size_t>(n), false);
  bool victim_released = false;
  auto survivors_noted = [&] {
    for (int r = 0; r < n; ++r)
      if (r != f.victim && !done[r] && !b[r].noted.load()) return false;
    return true;
  };
  for (;;) {
    int left = 0;
    for (int r = 0; r < n; ++r) {
      if (done[r]) continue;
      int st = 0;
      if (::waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        done[r] = true;
        status[r] = st;
      } else {
        ++left;
      }
    }
    if (left == 0) break;
    // A frozen victim stays frozen until every survivor has reported; then it goes.
    if (f.sig == SIGSTOP && !victim_released && !done[f.victim] && b[f.victim].fault_ns.load() != 0 &&
        survivors_noted()) {
      ::kill(pids[f.victim], SIGKILL);
      victim_released = true;
    }
    if (std::chrono::steady_clock::now() > hard) {
      for (int r = 0; r < n; ++r)
        if (!done[r]) {
          ::kill(pids[r], SIGKILL);
          ::waitpid(pids[r], &status[r], 0);
          done[r] = true;
          hung[r] = !(f.sig == SIGSTOP && r == f.victim);
        }
      break;
    }
    std::this_thread::sleep_for(1ms);
  }
  all_ended = true;
  if (striker.joinable()) striker.join();
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // ---- verdict ----
  auto& v = b[f.victim];
  res.fault_happened = v.fault_ns.load() != 0;
  res.fault_phase = v.fault_phase.load();
  auto fail = [&](const std::string& s) { res.failures.push_back(res.fault + ": " + s); };
  if (!res.fault_happened) fail("the fault never happened (victim did not reach its fault point)");
  std::uint64_t gid = 0;
  for (int r = 0; r < n; ++r) {
    rank_result rr;
    rr.rank = r;
    rr.victim = r == f.victim;
    rr.hung = hung[r];
    rr.exit_status = status[r];
    rr.errc = b[r].errc.load();
    rr.what = b[r].what;
    rr.problem = b[r].problem;
    rr.cleanup_s = static_cast<double>(b[r].cleanup_ns.load()) * 1e-9;
    if (b[r].group_id.load() != 0) gid = b[r].group_id.load();
    if (!rr.victim && res.fault_happened && b[r].noted.load()) {
      rr.detect_s = static_cast<double>(b[r].caught_ns.load() - v.fault_ns.load()) * 1e-9;
      rr.late_start_s = std::max(0.0, static_cast<double>(b[r].start_ns.load() - v.fault_ns.load()) * 1e-9);
    }
    res.ranks.push_back(rr);
    const std::string who = "rank " + std::to_string(r);
    if (rr.victim) {
      const bool by_signal = WIFSIGNALED(status[r]) && WTERMSIG(status[r]) == SIGKILL;
      if (res.fault_happened && !by_signal)
        fail(who + " (victim) did not end by SIGKILL (status " + std::to_string(status[r]) + "): " + rr.what + " " +
             rr.problem);
      continue;
    }
    if (rr.hung) {
      fail(who + " hung (killed by the harness " + std::to_string(res.seconds) + " s into the trial)" +
           (b[r].noted.load() ? " after catching: " + rr.what : std::string(" without raising any error")));
      continue;
    }
    if (!WIFEXITED(status[r]) || WEXITSTATUS(status[r]) != 0 || !b[r].finished.load()) {
      fail(who + " crashed (status " + std::to_string(status[r]) + ")");
      continue;
    }
    if (!b[r].noted.load()) {
      fail(who + " raised nothing: " + rr.problem);
      continue;
    }
    const auto code = static_cast<ddp::errc>(rr.errc);
    if (code != ddp::errc::peer_lost && code != ddp::errc::timeout && code != ddp::errc::aborted)
      fail(who + " raised the wrong error: " + (rr.errc == 0 ? "(not a ddp::error) " : "") + rr.what);
    if (!names_rank(rr.what, f.victim)) fail(who + " did not name rank " + std::to_string(f.victim) + ": " + rr.what);
    // A rank's deadline runs from its own call: one that began to join the group after the
    // fault (a loaded machine may start a process late) is held to the limit from its start.
    if (rr.detect_s - rr.late_start_s > std::chrono::duration<double>(limit_for_fault).count())
      fail(who + " took " + std::to_string(rr.detect_s) + " s to notice (limit " +
           std::to_string(std::chrono::duration<double>(limit_for_fault).count()) + " s" +
           (rr.late_start_s > 0 ? ", from its start " + std::to_string(rr.late_start_s) + " s after the fault" : "") +
           "): " + rr.what);
    if (!rr.problem.empty()) fail(who + " left resources behind: " + rr.problem);
  }
  if (gid != 0)
    for (auto& s : leftover_segments(gid)) {
      fail("shared-memory segment /dev/shm/" + s + " left behind");
      ::unlink(("/dev/shm/" + s).c_str());
    }
  if (!port_released(port)) fail("master port " + std::to_string(port) + " still in use after every rank ended");
  int st = 0;
  if (::waitpid(-1, &st, WNOHANG) > 0) fail("a child process outlived the trial");
  return res;
}

/// The survivor's side: notes the first error that reaches the caller, with its time (before
/// the ddp objects are destroyed: destructors may wait, bounded, for work still in flight), and
/// checks what the process still holds once those objects are gone.
struct survivor_guard {
  slot* me;
  int sockets_before = count_sockets();
  int threads_before = count_threads();

  static void note(slot& me, const ddp::error& e) {
    if (me.noted.load()) return;
    me.caught_ns = now_ns();
    me.errc = e.code().value();
    copy_text(me.what, sizeof me.what, e.what());
    me.noted = 1;
  }
  static void note_other(slot& me, const std::exception& e) {
    if (me.noted.load()) return;
    me.caught_ns = now_ns();
    me.errc = 0;
    copy_text(me.what, sizeof me.what, std::string("not a ddp::error: ") + e.what());
    me.noted = 1;
  }
  void check_resources(std::int64_t cleanup_started) {
    me->cleanup_ns = now_ns() - cleanup_started;
    std::string p;
    if (const int s = count_sockets(); s != sockets_before)
      p += std::to_string(s - sockets_before) + " socket(s) still open; ";
    if (maps_ddp_segment()) p += "a ddp shared-memory segment is still mapped; ";
    // A joined thread can stay listed for a moment while the kernel finishes its exit: a leak
    // is a thread still there 200 ms later. Under ThreadSanitizer the runtime starts a thread
    // of its own when it pleases, so the count means nothing there; TSan itself reports a
    // thread that was never joined ("thread leak").
    if (!under_tsan) {
      int t = count_threads();
      for (int i = 0; i < 20 && t != threads_before; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        t = count_threads();
      }
      if (t != threads_before) p += std::to_string(t - threads_before) + " extra thread(s); ";
    }
    copy_text(me->problem, sizeof me->problem, p);
  }
};

}  // namespace ddp_faults
