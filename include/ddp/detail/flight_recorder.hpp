#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The flight recorder: every reducer's front end keeps a fixed ring of its last collectives
// (sequence number, kind, the wrapper's bucket and step, count, dtype, op, state, issue/start/
// end times), and the process writes all rings to a file when a collective times out, a peer
// is lost, a reducer aborts, or the signal a user chose arrives. tools/ddp_forensics.py reads
// every rank's file and says who waits where. See docs/forensics.md.
//
// Cost: a collective writes one 64-byte entry with relaxed atomic stores (no lock, no
// allocation) and reads the coarse clock two or three times (issue, start, end). Readers (a dump)
// run concurrently and skip an entry that is being rewritten (seqlock on `seq`).

#include <fcntl.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <ddp/detail/collective.hpp>
#include <ddp/detail/fd.hpp>
#include <ddp/detail/json.hpp>
#include <ddp/detail/output_file.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/version.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

enum class flight_state : std::uint8_t { empty = 0, queued, started, finished, failed };

inline const char* flight_state_name(flight_state s) noexcept {
  switch (s) {
    case flight_state::empty:
      return "empty";
    case flight_state::queued:
      return "queued";
    case flight_state::started:
      return "started";
    case flight_state::finished:
      return "finished";
    case flight_state::failed:
      return "failed";
  }
  return "?";
}

/// One collective. `seq` is written last (release) and cleared first, so a reader that sees
/// the same nonzero `seq` before and after reading the rest has a whole entry.
struct flight_entry {
  std::atomic<std::uint64_t> seq{0};
  std::atomic<std::uint64_t> count{0};
  std::atomic<std::int64_t> step{-1};
  std::atomic<std::int64_t> t_issue{0};  // steady clock, ns since its epoch
  std::atomic<std::int64_t> t_start{0};
  std::atomic<std::int64_t> t_end{0};
  std::atomic<std::int32_t> bucket{-1};
  std::atomic<std::int32_t> root{0};
  std::atomic<std::uint8_t> kind{0};
  std::atomic<std::uint8_t> type{0};
  std::atomic<std::uint8_t> oper{0};
  std::atomic<std::uint8_t> state{0};
  std::atomic<std::uint8_t> err{0};  // errc of a failed one
};

/// The recorder's clock: the steady clock's (CLOCK_MONOTONIC) coarse reading, at the kernel
/// tick's resolution (1 to 4 ms), which costs about 13 ns against 70-200 ns for a fine reading on
/// a VM. Enough to line ranks up on a hang that lasts seconds; the timeline (DDP_TIMELINE) is
/// the tool for the microseconds of a collective.
inline std::int64_t flight_now() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}
inline std::int64_t flight_wall_now() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME_COARSE, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

class flight_ring;

/// The rings alive in this process and the recorder's settings. Never destroyed: a dump may run
/// on the signal thread while the process exits.
struct flight_registry {
  std::mutex mu;
  flight_ring* head = nullptr;
  std::uint64_t made = 0;  // rings asked for so far in this process: the next ordinal
  std::string path;        // DDP_FLIGHT_RECORDER as the last reducer read it; empty: no automatic dumps
  int last_rank = -1;
  std::int64_t last_auto = 0;  // when the last automatic dump was written (flight_now)
  int signal = 0;              // DDP_FLIGHT_RECORDER_SIGNAL
  pid_t signal_installed_in = 0;
  int pipe_read = -1;
};
inline flight_registry& flight_rings() {
  static flight_registry* r = new flight_registry;
  return *r;
}

// What the signal handler touches (constant-initialized, lock-free).
inline std::atomic<int> flight_signal_fd{-1};
inline std::atomic<pid_t> flight_signal_pid{0};

/// The ring of one reducer front end. Entries are written by the thread that issues a
/// collective (issue) and the thread that runs it (start, end); a collective's slot is its
/// sequence number modulo the size, so the ring keeps the last `entries` collectives.
class flight_ring {
 public:
  /// Entries of a ring when DDP_FLIGHT_RECORDER_ENTRIES does not say.
  static constexpr std::size_t default_entries = 2048;

  /// The ring of a new reducer (rank `rank` of `size`, `name` for the dump), or nullptr when
  /// DDP_FLIGHT_RECORDER_ENTRIES=0. Reads the recorder's environment and installs the dump
  /// signal's handler on first need. Raises errc::invalid_argument for a malformed setting.
  static std::unique_ptr<flight_ring> make(int rank, int size, const char* name) {
    auto& reg = flight_rings();
    const std::size_t entries = entries_from_env(rank);
    const char* path = std::getenv("DDP_FLIGHT_RECORDER");
    const int sig = signal_from_env(rank);
    if (sig != 0 && (path == nullptr || *path == '\0'))
      raise(errc::invalid_argument, rank,
            "DDP_FLIGHT_RECORDER_SIGNAL is set but DDP_FLIGHT_RECORDER names no file to write the record to "
            "(docs/forensics.md)");
    std::lock_guard lock(reg.mu);
    const std::uint64_t ordinal = reg.made++;
    reg.path = path != nullptr ? path : "";
    reg.last_rank = rank;
    if (sig != 0) install_signal(reg, sig, rank);
    if (entries == 0) return nullptr;
    std::unique_ptr<flight_ring> r(new flight_ring(entries, rank, size, name, ordinal));
    r->next_ = reg.head;
    if (reg.head != nullptr) reg.head->prev_ = r.get();
    reg.head = r.get();
    return r;
  }

  flight_ring(const flight_ring&) = delete;
  flight_ring& operator=(const flight_ring&) = delete;
  ~flight_ring() {
    auto& reg = flight_rings();
    std::lock_guard lock(reg.mu);
    if (prev_ != nullptr) prev_->next_ = next_;
    if (next_ != nullptr) next_->prev_ = prev_;
    if (reg.head == this) reg.head = next_;
  }

  /// A collective issued now by this thread; its sequence number (1, 2, ...). `started`: it
  /// starts at once, on this thread. `bucket` and `step`: the wrapper's bucket it serves, from
  /// the call's ddp::bucket_tag (-1: none).
  std::uint64_t issue(coll_kind k, dtype t, op o, int root, std::uint64_t count, bool started, std::int32_t bucket,
                      std::int64_t step) noexcept {
    const std::uint64_t n = issued_.fetch_add(1, std::memory_order_relaxed) + 1;
    flight_entry& e = slot(n);
    const std::int64_t now = flight_now();
    e.seq.store(0, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    e.count.store(count, std::memory_order_relaxed);
    e.step.store(step, std::memory_order_relaxed);
    e.t_issue.store(now, std::memory_order_relaxed);
    e.t_start.store(started ? now : 0, std::memory_order_relaxed);
    e.t_end.store(0, std::memory_order_relaxed);
    e.bucket.store(bucket, std::memory_order_relaxed);
    e.root.store(root, std::memory_order_relaxed);
    e.kind.store(static_cast<std::uint8_t>(k), std::memory_order_relaxed);
    e.type.store(static_cast<std::uint8_t>(t), std::memory_order_relaxed);
    e.oper.store(static_cast<std::uint8_t>(o), std::memory_order_relaxed);
    e.state.store(static_cast<std::uint8_t>(started ? flight_state::started : flight_state::queued),
                  std::memory_order_relaxed);
    e.err.store(0, std::memory_order_relaxed);
    e.seq.store(n, std::memory_order_release);
    return n;
  }
  void started(std::uint64_t n) noexcept {
    flight_entry& e = slot(n);
    if (e.seq.load(std::memory_order_relaxed) != n) return;  // overwritten: the ring wrapped
    e.t_start.store(flight_now(), std::memory_order_relaxed);
    e.state.store(static_cast<std::uint8_t>(flight_state::started), std::memory_order_release);
  }
  void finished(std::uint64_t n) noexcept { end(n, flight_state::finished, 0); }
  void failed(std::uint64_t n, errc c) noexcept { end(n, flight_state::failed, static_cast<std::uint8_t>(c)); }

  /// Appends this ring as one JSON object of the dump.
  void write_json(std::string& out) const {
    const std::uint64_t last = issued_.load(std::memory_order_acquire);
    const std::uint64_t first = last > entries_ ? last - entries_ + 1 : 1;
    out += "{\"ordinal\":" + std::to_string(ordinal_) + ",\"name\":";
    append_json_string(out, name_);
    out += ",\"rank\":" + std::to_string(rank_) + ",\"world_size\":" + std::to_string(size_) +
           ",\"issued\":" + std::to_string(last) + ",\"capacity\":" + std::to_string(entries_) + ",\"entries\":[";
    bool comma = false;
    for (std::uint64_t n = first; n <= last && n != 0; ++n) {
      const flight_entry& e = slot(n);
      if (e.seq.load(std::memory_order_acquire) != n) continue;
      const auto count = e.count.load(std::memory_order_relaxed);
      const auto step = e.step.load(std::memory_order_relaxed);
      const auto t0 = e.t_issue.load(std::memory_order_relaxed);
      const auto t1 = e.t_start.load(std::memory_order_relaxed);
      const auto t2 = e.t_end.load(std::memory_order_relaxed);
      const auto bucket = e.bucket.load(std::memory_order_relaxed);
      const auto root = e.root.load(std::memory_order_relaxed);
      const auto kind = static_cast<coll_kind>(e.kind.load(std::memory_order_relaxed));
      const auto type = static_cast<dtype>(e.type.load(std::memory_order_relaxed));
      const auto oper = static_cast<op>(e.oper.load(std::memory_order_relaxed));
      const auto state = static_cast<flight_state>(e.state.load(std::memory_order_acquire));
      const auto err = static_cast<errc>(e.err.load(std::memory_order_relaxed));
      std::atomic_thread_fence(std::memory_order_acquire);
      if (e.seq.load(std::memory_order_relaxed) != n) continue;  // rewritten while read
      char b[512];
      std::snprintf(b, sizeof b,
                    "%s\n{\"seq\":%llu,\"kind\":\"%s\",\"state\":\"%s\",\"error\":%s%s%s,\"bucket\":%d,\"step\":%lld,"
                    "\"count\":%llu,\"bytes\":%llu,\"dtype\":\"%s\",\"op\":\"%s\",\"root\":%d,\"t_issue\":%lld,"
                    "\"t_start\":%lld,\"t_end\":%lld}",
                    comma ? "," : "", static_cast<unsigned long long>(n), coll_name(kind), flight_state_name(state),
                    state == flight_state::failed ? "\"" : "", state == flight_state::failed ? errc_name(err) : "null",
                    state == flight_state::failed ? "\"" : "", bucket, static_cast<long long>(step),
                    static_cast<unsigned long long>(count), static_cast<unsigned long long>(count * dtype_size(type)),
                    dtype_name(type), op_name(oper), root, static_cast<long long>(t0), static_cast<long long>(t1),
                    static_cast<long long>(t2));
      out += b;
      comma = true;
    }
    out += "]}";
  }

  int rank() const noexcept { return rank_; }
  std::uint64_t ordinal() const noexcept { return ordinal_; }
  const flight_ring* next() const noexcept { return next_; }

 private:
  flight_ring(std::size_t entries, int rank, int size, const char* name, std::uint64_t ordinal)
      : entries_(entries),
        mask_(entries - 1),
        e_(new flight_entry[entries]),
        rank_(rank),
        size_(size),
        name_(name),
        ordinal_(ordinal) {}

  flight_entry& slot(std::uint64_t n) const noexcept { return e_[n & mask_]; }
  void end(std::uint64_t n, flight_state s, std::uint8_t err) noexcept {
    flight_entry& e = slot(n);
    if (e.seq.load(std::memory_order_relaxed) != n) return;
    e.t_end.store(flight_now(), std::memory_order_relaxed);
    e.err.store(err, std::memory_order_relaxed);
    e.state.store(static_cast<std::uint8_t>(s), std::memory_order_release);
  }

  static std::size_t entries_from_env(int rank) {
    const char* v = std::getenv("DDP_FLIGHT_RECORDER_ENTRIES");
    if (v == nullptr || *v == '\0') return default_entries;
    char* end = nullptr;
    errno = 0;
    const unsigned long long n = std::strtoull(v, &end, 10);
    if (errno != 0 || *end != '\0' || *v == '-' || n > (1u << 20))
      raise(errc::invalid_argument, rank,
            std::string("DDP_FLIGHT_RECORDER_ENTRIES=") + v + " is not a number of entries from 0 (off) to 1048576");
    std::size_t p = n == 0 ? 0 : 1;
    while (p != 0 && p < n) p <<= 1;  // a power of two: the slot is a mask
    return p;
  }

  static int signal_from_env(int rank) {
    const char* v = std::getenv("DDP_FLIGHT_RECORDER_SIGNAL");
    if (v == nullptr || *v == '\0') return 0;
    std::string_view s(v);
    if (s.substr(0, 3) == "SIG") s.remove_prefix(3);
    static constexpr struct {
      const char* name;
      int number;
    } names[] = {{"USR1", SIGUSR1}, {"USR2", SIGUSR2},   {"HUP", SIGHUP}, {"QUIT", SIGQUIT},
                 {"PWR", SIGPWR},   {"WINCH", SIGWINCH}, {"URG", SIGURG}};
    for (const auto& n : names)
      if (s == n.name) return n.number;
    if (!s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; }) && s.size() < 4) {
      const int n = std::atoi(std::string(s).c_str());
      if (n == SIGUSR1 || n == SIGUSR2 || n == SIGHUP || n == SIGQUIT || n == SIGPWR || n == SIGWINCH || n == SIGURG ||
          (n >= SIGRTMIN && n <= SIGRTMAX))
        return n;
    }
    raise(errc::invalid_argument, rank,
          std::string("DDP_FLIGHT_RECORDER_SIGNAL=") + v +
              " is not a signal the recorder can take: SIGUSR1, SIGUSR2, SIGHUP, SIGQUIT, SIGPWR, SIGWINCH, SIGURG or "
              "a real-time signal's number");
  }

  static void on_signal(int) noexcept {
    // Async-signal-safe: one write(2) to a pipe; the recorder's thread writes the dump.
    const int saved = errno;
    if (flight_signal_pid.load(std::memory_order_relaxed) == ::getpid()) {
      const int fd = flight_signal_fd.load(std::memory_order_relaxed);
      const char c = 1;
      if (fd >= 0) [[maybe_unused]]
        auto w = ::write(fd, &c, 1);
    }
    errno = saved;
  }

  // Under reg.mu. Once per process (again in a child made by fork(): the parent's thread is not
  // there). The pipe's write end is non-blocking: a burst of signals never blocks the handler.
  static void install_signal(flight_registry& reg, int sig, int rank);

  std::size_t entries_, mask_;
  std::unique_ptr<flight_entry[]> e_;
  std::atomic<std::uint64_t> issued_{0};
  int rank_, size_;
  std::string name_;
  std::uint64_t ordinal_;
  flight_ring* prev_ = nullptr;  // the registry's list, under its mutex
  flight_ring* next_ = nullptr;
};

/// The rank a process's record names (and its file): that of its oldest live reducer, else of
/// the last one built. Under reg.mu.
inline int flight_process_rank(const flight_registry& reg) noexcept {
  int rank = reg.last_rank;
  std::uint64_t oldest = ~std::uint64_t{0};
  for (const flight_ring* r = reg.head; r != nullptr; r = r->next())
    if (r->ordinal() < oldest) {
      oldest = r->ordinal();
      rank = r->rank();
    }
  return rank;
}

/// The dump: every live ring of the process, as one JSON document (docs/forensics.md).
inline std::string flight_record_text(std::string_view reason) {
  auto& reg = flight_rings();
  std::lock_guard lock(reg.mu);
  const std::int64_t wall = flight_wall_now();
  const std::int64_t steady = flight_now();
  const int rank = flight_process_rank(reg);
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  std::string out = "{\"ddp_flight_recorder\":1,\"library\":\"ddp " + std::to_string(DDP_VERSION_MAJOR) + "." +
                    std::to_string(DDP_VERSION_MINOR) + "." + std::to_string(DDP_VERSION_PATCH) +
                    "\",\"rank\":" + std::to_string(rank) + ",\"pid\":" + std::to_string(::getpid()) + ",\"host\":";
  append_json_string(out, host);
  out += ",\"reason\":";
  append_json_string(out, reason);
  out += ",\"steady_ns\":" + std::to_string(steady) + ",\"wall_ns\":" + std::to_string(wall) + ",\"reducers\":[";
  // Oldest first: the order the ranks constructed them in, the same on every rank.
  std::vector<const flight_ring*> rings;
  for (const flight_ring* r = reg.head; r != nullptr; r = r->next()) rings.push_back(r);
  std::sort(rings.begin(), rings.end(), [](auto* a, auto* b) { return a->ordinal() < b->ordinal(); });
  for (std::size_t i = 0; i < rings.size(); ++i) {
    if (i > 0) out += ",\n";
    rings[i]->write_json(out);
  }
  out += "]}\n";
  return out;
}

/// The file this process dumps to for the setting `base` (DDP_FLIGHT_RECORDER): `{rank}`
/// replaced, else `.rank<r>.json` appended (the naming of DDP_TIMELINE).
inline std::string flight_record_file(std::string_view base) {
  int rank;
  {
    auto& reg = flight_rings();
    std::lock_guard lock(reg.mu);
    rank = flight_process_rank(reg);
  }
  return rank_file(base, rank);
}

/// Writes the dump to `path` (replace_file: never through a planted link); 0 or an errno.
inline int flight_record_write(const std::string& path, std::string_view reason) noexcept {
  try {
    return replace_file(path, flight_record_text(reason));
  } catch (...) {
    return ENOMEM;
  }
}

/// Writes the dump to DDP_FLIGHT_RECORDER's file, when it names one; a failure is one line on
/// stderr (training is failing already; the record must not add an error of its own).
inline void flight_record_dump(std::string_view reason) noexcept {
  try {
    std::string base;
    {
      auto& reg = flight_rings();
      std::lock_guard lock(reg.mu);
      base = reg.path;
    }
    if (base.empty()) return;
    const std::string path = flight_record_file(base);
    if (const int e = flight_record_write(path, reason))
      std::fprintf(stderr, "ddp: cannot write the flight record to %s: %s\n", path.c_str(), errno_text(e).c_str());
  } catch (...) {
  }
}

/// A dump after a failure (timeout, lost peer, abort): one per second at most, since one hang
/// fails every collective behind it, on several threads, within moments; the first dump holds
/// the state that matters.
inline void flight_record_failure(std::string_view reason) noexcept {
  auto& reg = flight_rings();
  {
    std::lock_guard lock(reg.mu);
    if (reg.path.empty()) return;
    const std::int64_t now = flight_now();
    if (reg.last_auto != 0 && now - reg.last_auto < 1'000'000'000) return;
    reg.last_auto = now;
  }
  flight_record_dump(reason);
}

inline void flight_ring::install_signal(flight_registry& reg, int sig, int rank) {
  const pid_t me = ::getpid();
  if (reg.signal_installed_in == me && reg.signal == sig) return;
  if (reg.signal_installed_in != me) {
    if (reg.pipe_read >= 0) ::close(reg.pipe_read);  // the parent's, in a child made by fork()
    if (const int w = flight_signal_fd.load(std::memory_order_relaxed); w >= 0) ::close(w);
    reg.pipe_read = -1;
    flight_signal_fd.store(-1, std::memory_order_relaxed);
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) raise(errc::system, rank, "flight recorder: pipe2: " + errno_text(errno));
    ::fcntl(p[1], F_SETFL, O_NONBLOCK);
    reg.pipe_read = p[0];
    flight_signal_fd.store(p[1], std::memory_order_relaxed);
    flight_signal_pid.store(me, std::memory_order_relaxed);
    std::thread([fd = p[0], &reg] {
      char buf[64];
      for (;;) {
        const ssize_t n = ::read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        int s = 0;
        {
          std::lock_guard lock(reg.mu);
          s = reg.signal;
        }
        const char* abbrev = sigabbrev_np(s);
        flight_record_dump(std::string("signal SIG") + (abbrev != nullptr ? abbrev : std::to_string(s).c_str()));
      }
    }).detach();
  }
  struct sigaction sa {};
  sa.sa_handler = &flight_ring::on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (::sigaction(sig, &sa, nullptr) != 0)
    raise(errc::system, rank, "flight recorder: sigaction: " + errno_text(errno));
  reg.signal = sig;
  reg.signal_installed_in = me;
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
