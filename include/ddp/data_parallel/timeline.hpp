#pragma once
/// \file data_parallel/timeline.hpp
/// `ddp::timeline`: what `basic_data_parallel` did in each step, as a Chrome trace file (the
/// "JSON Object Format" that Perfetto and chrome://tracing open). It is on when
/// `dp_options::timeline` or the environment variable `DDP_TIMELINE` names a file; each rank
/// writes its own. See docs/tuning.md, "See a step: the timeline".

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/data_parallel/bucket_state.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/detail/fd.hpp>
#include <ddp/detail/json.hpp>
#include <ddp/detail/output_file.hpp>
#include <ddp/detail/thread_id.hpp>
#include <ddp/error.hpp>
#include <ddp/planner/bucket_plan.hpp>
#include <ddp/request.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// The file rank `rank` records into, for the path `base` given in `DDP_TIMELINE` or
/// `dp_options::timeline`: `{rank}` in `base` is replaced by the rank; a `base` without it gets
/// `.rank<r>.json` appended. The `instance`-th wrapper of a process that records into the same
/// file (counting from 0) gets `.<instance>` before a final `.json` (or at the end), so that a
/// second wrapper never overwrites the first one's file.
/// \code
/// ddp::timeline_file("/tmp/t", 1, 0);             // "/tmp/t.rank1.json"
/// ddp::timeline_file("/tmp/t-{rank}.json", 1, 2);  // "/tmp/t-1.2.json"
/// \endcode
inline std::string timeline_file(std::string_view base, int rank, unsigned instance = 0) {
  return detail::rank_file(base, rank, instance);
}

/// Records the steps of one data-parallel wrapper into a Chrome trace file. The wrapper makes it
/// (`timeline::open`) and calls its hooks; a user only chooses the file. One track per rank
/// (pid = rank) and per thread (tid = the OS thread id): the engine's threads (the steps,
/// `finish()`, each bucket becoming ready and being launched) and the reducer's progress thread
/// (each bucket's collective). Events of a step are written when the step ends; the JSON is
/// closed when the wrapper is destroyed. After `steps` steps recording stops, and the file says
/// so. A write that fails stops recording with one line on stderr; training goes on.
/// \code
/// setenv("DDP_TIMELINE", "/tmp/ddp-trace", 1);  // before the wrapper is built
/// ddp::data_parallel dp{pg, params};            // rank r writes /tmp/ddp-trace.rank<r>.json
/// \endcode
class timeline {
 public:
  /// Recorded steps when neither `dp_options::timeline_steps` nor `DDP_TIMELINE_STEPS` says.
  static constexpr std::uint64_t default_steps = 1000;

  /// The timeline `opts` ask for: `opts.timeline`, else the environment's `DDP_TIMELINE`; none
  /// (nullptr) when both are empty. Throws `ddp::error` (errc::system) naming the file when it
  /// cannot be opened or written, and errc::invalid_argument for a `DDP_TIMELINE_STEPS` that is
  /// not a positive number.
  static std::unique_ptr<timeline> open(const dp_options& opts, int rank, int world_size) {
    return open(opts.timeline, opts.timeline_steps, rank, world_size);
  }
  /// The same from a file name and a step limit (`fully_sharded_options`' timeline fields).
  static std::unique_ptr<timeline> open(std::string base, std::uint64_t steps, int rank, int world_size) {
    if (base.empty())
      if (const char* env = std::getenv("DDP_TIMELINE")) base = env;
    if (base.empty()) return nullptr;
    if (steps == 0) steps = steps_from_env(rank);
    // The k-th timeline of this process with the same file name gets a suffix (timeline_file),
    // and so does one whose file another process records into (a process can be rank 0 of one
    // group and rank 1 of another while its peer is the reverse: both would name the same two
    // files). The file lock tells; it is held until the timeline closes its file.
    static std::mutex mu;
    static std::map<std::string, unsigned> used;
    for (int tries = 0;; ++tries) {
      std::string path;
      unsigned serial = 0;
      {
        std::lock_guard lock(mu);
        const std::string first = timeline_file(base, rank);
        const unsigned k = used[first]++;
        path = timeline_file(base, rank, k);
        static unsigned made = 0;
        serial = made++;
      }
      std::string why;
      const int fd = open_locked(path, why);
      if (fd < 0 && errno == EWOULDBLOCK && tries < 100) continue;
      if (fd < 0)
        fail_to_open(path, rank, errno == EWOULDBLOCK ? "100 files of that name are in use" : "cannot open it", errno,
                     why);
      return std::unique_ptr<timeline>(new timeline(adopt_fd{fd}, path, rank, world_size, steps, serial));
    }
  }

  /// Creates (or truncates) `path` and writes the trace's header. `serial` tells apart the
  /// flow ids of several timelines of one process. Throws errc::system naming the file (also
  /// when another timeline, of this process or another, records into it).
  timeline(const std::string& path, int rank, int world_size, std::uint64_t steps = default_steps, unsigned serial = 0)
      : timeline(adopt_fd{open_or_raise(path, rank)}, path, rank, world_size, steps, serial) {}

  timeline(const timeline&) = delete;
  timeline& operator=(const timeline&) = delete;

 private:
  struct adopt_fd {
    int fd;
  };

  // Opens `path` for writing and locks it (flock, exclusive): -1 with errno EWOULDBLOCK when
  // another open file holds the lock, -1 with errno when it cannot be opened. The file is
  // truncated only once locked, so a trace another process writes is never cut short. Where the
  // file system has no such locks, the file is used unlocked.
  static int open_locked(const std::string& path, std::string& why) {
    // open_own_file: never through a link planted at the name, never into a FIFO, socket,
    // device or another user's file (what is there goes to `why`); a new file is owner-only.
    const int fd = detail::open_own_file(path, why);
    if (fd < 0) return -1;
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
      ::close(fd);
      errno = EWOULDBLOCK;
      return -1;
    }
    struct stat st {};
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && ::ftruncate(fd, 0) != 0) {
      const int e = errno;
      ::close(fd);
      errno = e;
      return -1;
    }
    return fd;
  }
  static int open_or_raise(const std::string& path, int rank) {
    std::string why;
    const int fd = open_locked(path, why);
    if (fd < 0)
      fail_to_open(path, rank, errno == EWOULDBLOCK ? "another timeline records into it" : "cannot open it", errno,
                   why);
    return fd;
  }

  timeline(adopt_fd f, const std::string& path, int rank, int world_size, std::uint64_t steps, unsigned serial)
      : path_(path), rank_(rank), world_(world_size), max_steps_(steps), serial_(serial & 0xff), fd_(f.fd) {
    buf_.reserve(flush_bytes * 2);
    buf_ += "{\"traceEvents\":[\n";
    metadata("process_name", -1, "\"name\":" + quoted("rank " + std::to_string(rank_)));
    metadata("process_sort_index", -1, "\"sort_index\":" + std::to_string(rank_));
    if (const int e = write_all()) {
      ::close(fd_);
      fd_ = -1;
      fail_to_open(path_, rank_, "cannot write to it", e);
    }
    detail::timed_collectives().fetch_add(1, std::memory_order_relaxed);  // workers time collectives now
  }

 public:
  /// Writes what is buffered and closes the JSON. In a child made by fork() it writes nothing
  /// (the file is the parent's) and only closes the child's descriptor.
  ~timeline() {
    if (fd_ < 0) return;
    detail::timed_collectives().fetch_sub(1, std::memory_order_relaxed);
    if (!owner_.forked() && !failed_) {
      buf_ += "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"library\":\"ddp " + std::to_string(DDP_VERSION_MAJOR) +
              "." + std::to_string(DDP_VERSION_MINOR) + "." + std::to_string(DDP_VERSION_PATCH) +
              "\",\"rank\":" + std::to_string(rank_) + ",\"world_size\":" + std::to_string(world_) +
              ",\"steps_recorded\":" + std::to_string(recorded_) + ",\"steps_limit\":" + std::to_string(max_steps_) +
              ",\"stopped_at_limit\":" + (stopped_ ? "true" : "false") + "}}\n";
      flush();
    }
    ::close(fd_);
  }

  /// The file this timeline writes.
  const std::string& path() const noexcept { return path_; }
  /// Steps written so far.
  std::uint64_t steps_recorded() const noexcept { return recorded_; }
  /// False once recording stopped (the step limit, or a failed write).
  bool recording() const noexcept { return !stopped_ && !failed_; }

  // ---- hooks of basic_data_parallel ------------------------------------------------------
  // bucket_ready and bucket_launched run under bucket_state's lock (or, for launches in
  // join(), with no hook running): never two at once.

  // ---- hooks of basic_fully_sharded: events written as they happen -----------------------

  /// A span `name` on the calling thread's track from `begin` to `end`; `args`: the inside of a
  /// JSON object. Never throws: a failure stops recording.
  void thread_span(std::string_view name, steady_clock::time_point begin, steady_clock::time_point end,
                   std::string_view args) noexcept {
    if (!recording()) return;
    try {
      const long me = detail::os_thread_id();
      track(me, false);
      span(name, me, ns(begin), ns(end), args);
    } catch (...) {
      stop_failed("out of memory while formatting an event");
    }
  }
  /// Collective `req`'s run, named `name`, on the track of the thread that ran it (when it was
  /// timed: a timeline was alive as it started).
  void collective_span(std::string_view name, const request& req, std::string_view args) noexcept {
    if (!recording() || !req.valid() || req.started_at() == steady_clock::time_point{} ||
        req.finished_at() == steady_clock::time_point{})
      return;
    try {
      const long progress = req.thread_id();
      track(progress, true);
      span(name, progress, ns(req.started_at()), ns(req.finished_at()), args);
    } catch (...) {
      stop_failed("out of memory while formatting an event");
    }
  }
  /// Step `step` ended now, begun at `begin`: its span on the calling thread; counts toward
  /// the step limit.
  void step_span(std::uint64_t step, steady_clock::time_point begin, std::string_view args) noexcept {
    if (!recording()) return;
    try {
      const long me = detail::os_thread_id();
      track(me, false);
      const std::string s = std::to_string(step);
      span("step " + s, me, ns(begin), ns(steady_clock::now()),
           "\"step\":" + s + (args.empty() ? "" : ",") + std::string(args));
      count_step();
    } catch (...) {
      stop_failed("out of memory while formatting a step");
    }
  }

  /// Bucket `b` became complete, on the calling thread.
  void bucket_ready(std::size_t b) noexcept {
    if (!recording()) return;
    if (auto* m = marks_of(b)) m->ready_thread = detail::os_thread_id();
  }
  /// Bucket `b`'s collective was handed to the reducer, on the calling thread; the call returned
  /// at `returned`.
  void bucket_launched(std::size_t b, steady_clock::time_point returned) noexcept {
    if (!recording()) return;
    if (auto* m = marks_of(b)) {
      m->launch_thread = detail::os_thread_id();
      m->launch_returned = returned;
    }
  }
  /// `finish()` waited for bucket `b` from `begin` to `end`.
  void bucket_waited(std::size_t b, steady_clock::time_point begin, steady_clock::time_point end) noexcept {
    if (!recording()) return;
    if (auto* m = marks_of(b)) {
      m->wait_begin = begin;
      m->wait_end = end;
    }
  }

  /// What the step that `finish()` ends did: called on the thread that runs `finish()`, after its
  /// last copy back and before the plan can change. `in_flight(b)` is bucket b's request;
  /// `plan_generation` changes whenever the plan does (it keys the cached parameter names);
  /// `copy_back`: the averages were copied out (copy mode). Never throws: a failure stops
  /// recording.
  template <class InFlight>
  void end_step(std::uint64_t step, const bucket_state& st, const bucket_plan& plan,
                const std::vector<std::string>& names, std::uint64_t plan_generation, steady_clock::time_point t_call,
                bool copy_back, InFlight&& in_flight) noexcept {
    const auto t_end = steady_clock::now();
    if (!recording()) return;
    try {
      write_step(step, st, plan, names, plan_generation, t_call, t_end, copy_back, in_flight);
    } catch (...) {
      stop_failed("out of memory while formatting a step");
    }
    for (auto& m : marks_) m = {};
  }

 private:
  static constexpr std::size_t flush_bytes = 64 * 1024;
  static constexpr std::size_t names_shown = 32;  // per bucket: all, or the first and last 16

  struct marks {
    long ready_thread = 0, launch_thread = 0;
    steady_clock::time_point launch_returned{}, wait_begin{}, wait_end{};
  };

  static std::uint64_t steps_from_env(int rank) {
    const char* env = std::getenv("DDP_TIMELINE_STEPS");
    if (!env || !*env) return default_steps;
    char* end = nullptr;
    errno = 0;
    const unsigned long long v = std::strtoull(env, &end, 10);
    if (errno != 0 || *end != '\0' || v == 0 || env[0] == '-')
      detail::raise(errc::invalid_argument, rank,
                    std::string("DDP_TIMELINE_STEPS=") + env +
                        " is not a positive number of steps (the timeline records that many steps, then stops; "
                        "docs/tuning.md)");
    return v;
  }

  /// `found`: what open_own_file found at the name (a link, a FIFO, another user's file).
  [[noreturn]] static void fail_to_open(const std::string& path, int rank, const char* what, int err,
                                        const std::string& found = {}) {
    detail::raise(errc::system, rank,
                  "the timeline file '" + path + "' (from DDP_TIMELINE or dp_options::timeline): " + what + ": " +
                      (found.empty() ? detail::errno_text(err)
                                     : found + " (a timeline writes only into a regular file of its own user, never "
                                               "through a link)") +
                      "; name a file in a writable directory, or leave DDP_TIMELINE unset");
  }

  marks* marks_of(std::size_t b) noexcept {
    try {
      if (b >= marks_.size()) marks_.resize(b + 1);
    } catch (...) {
      return nullptr;
    }
    return &marks_[b];
  }

  static std::int64_t ns(steady_clock::time_point t) noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  }
  static std::string quoted(std::string_view s) {
    std::string out;
    detail::append_json_string(out, s);
    return out;
  }

  void begin_event() {
    if (events_ > 0) buf_ += ",\n";
    ++events_;
  }
  void metadata(const char* name, long tid, const std::string& args) {
    begin_event();
    buf_ += "{\"name\":\"";
    buf_ += name;
    buf_ += "\",\"ph\":\"M\",\"pid\":";
    detail::append_int(buf_, rank_);
    if (tid >= 0) {
      buf_ += ",\"tid\":";
      detail::append_int(buf_, tid);
    }
    buf_ += ",\"args\":{" + args + "}}";
  }
  // Names a thread's track the first time it appears.
  void track(long tid, bool progress) {
    if (tid <= 0) return;
    for (const auto& t : threads_)
      if (t == tid) return;
    threads_.push_back(tid);
    const std::string r = "rank " + std::to_string(rank_) + ": ";
    metadata("thread_name", tid,
             "\"name\":" + quoted(r + (progress ? "progress thread" : "backward/finish (engine thread)")));
    metadata("thread_sort_index", tid,
             "\"sort_index\":" + std::to_string(progress ? 1000 + threads_.size() : threads_.size()));
  }
  // The start of an event: name, phase, pid, tid, ts.
  void head(std::string_view name, const char* ph, long tid, std::int64_t ts) {
    begin_event();
    buf_ += "{\"name\":";
    detail::append_json_string(buf_, name);
    buf_ += ",\"cat\":\"ddp\",\"ph\":\"";
    buf_ += ph;
    buf_ += "\",\"pid\":";
    detail::append_int(buf_, rank_);
    buf_ += ",\"tid\":";
    detail::append_int(buf_, tid);
    buf_ += ",\"ts\":";
    detail::append_micros(buf_, ts);
  }
  // A complete event ("X") from `b` to `e` (nanoseconds), with `args` (the inside of an object).
  void span(std::string_view name, long tid, std::int64_t b, std::int64_t e, std::string_view args) {
    head(name, "X", tid, b);
    buf_ += ",\"dur\":";
    detail::append_micros(buf_, std::max<std::int64_t>(0, e - b));
    buf_ += ",\"args\":{";
    buf_ += args;
    buf_ += "}}";
  }
  void instant(std::string_view name, long tid, std::int64_t t, std::string_view args, const char* scope = "t") {
    head(name, "i", tid, t);
    buf_ += ",\"s\":\"";
    buf_ += scope;
    buf_ += "\",\"args\":{";
    buf_ += args;
    buf_ += "}}";
  }
  // One end of a flow arrow ("s" at its start, "f" bound to the slice enclosing its end).
  void flow(const char* ph, long tid, std::int64_t t, std::uint64_t id) {
    head("launch to allreduce", ph, tid, t);
    buf_ += ",\"id\":";
    detail::append_int(buf_, static_cast<long long>(id));
    if (ph[0] == 'f') buf_ += ",\"bp\":\"e\"";
    buf_ += "}";
  }

  // "params":N,"names":[...] of every bucket, rebuilt when the plan changes.
  void cache_names(const bucket_plan& plan, const std::vector<std::string>& names, std::uint64_t generation) {
    if (names_cached_ && generation == names_generation_ && names_json_.size() == plan.buckets.size()) return;
    names_json_.assign(plan.buckets.size(), std::string());
    for (std::size_t b = 0; b < plan.buckets.size(); ++b) {
      const auto& entries = plan.buckets[b].entries;
      std::string& s = names_json_[b];
      s = ",\"names\":[";
      const std::size_t n = entries.size();
      const std::size_t half = names_shown / 2;
      bool first = true;
      for (std::size_t k = 0; k < n; ++k) {
        if (n > names_shown && k == half) k = n - half;  // the first and the last ones
        if (!first) s += ',';
        first = false;
        const std::size_t p = entries[k].param;
        detail::append_json_string(s, p < names.size() ? std::string_view(names[p]) : std::string_view());
      }
      s += ']';
      if (n > names_shown) s += ",\"names_omitted\":" + std::to_string(n - names_shown);
    }
    names_generation_ = generation;
    names_cached_ = true;
  }

  template <class InFlight>
  void write_step(std::uint64_t step, const bucket_state& st, const bucket_plan& plan,
                  const std::vector<std::string>& names, std::uint64_t generation, steady_clock::time_point t_call,
                  steady_clock::time_point t_end, bool copy_back, InFlight& in_flight) {
    const long me = detail::os_thread_id();
    track(me, false);
    const std::int64_t start = ns(st.step_start()), end = ns(t_end), call = ns(t_call);
    const std::string s = std::to_string(step);
    if (!st.synchronized()) {
      span("step " + s + " (no_sync)", me, start, end, "\"step\":" + s + ",\"synchronized\":false");
      return count_step();
    }
    cache_names(plan, names, generation);
    const std::size_t nb = plan.buckets.size();
    marks_of(nb);  // every bucket has its marks (a bucket never launched has empty ones)
    std::size_t bytes = 0;
    for (const auto& bk : plan.buckets) bytes += bk.bytes;
    span("step " + s, me, start, end,
         "\"step\":" + s + ",\"synchronized\":true,\"buckets\":" + std::to_string(nb) +
             ",\"bytes\":" + std::to_string(bytes));
    // Backward as ddp saw it: first hook to the last one, including the launches those hooks made.
    std::int64_t backward_end = ns(st.last_ready());
    for (std::size_t b = 0; b < nb; ++b) {
      const auto r = ns(marks_[b].launch_returned);
      if (marks_[b].launch_thread == me && r <= call) backward_end = std::max(backward_end, r);
    }
    backward_end = std::min(backward_end, call);
    if (backward_end > start) span("backward", me, start, backward_end, "\"step\":" + s);
    span("finish()", me, call, end, "\"step\":" + s);
    for (std::size_t b = 0; b < nb; ++b) {
      const auto& bk = plan.buckets[b];
      const auto& m = marks_[b];
      const std::string bs = std::to_string(b);
      const std::string basic = "\"step\":" + s + ",\"bucket\":" + bs + ",\"bytes\":" + std::to_string(bk.bytes) +
                                ",\"params\":" + std::to_string(bk.entries.size());
      const std::string named = basic + names_json_[b];
      const std::int64_t launched = ns(st.launched_at(b));
      const long launcher = m.launch_thread > 0 ? m.launch_thread : me;
      std::int64_t ready = ns(st.ready_at(b));
      if (st.ready_at(b) == steady_clock::time_point{}) ready = launched;  // a bucket with no entries
      const long readier = m.ready_thread > 0 ? m.ready_thread : launcher;
      track(readier, false);
      track(launcher, false);
      instant("bucket " + bs + " ready", readier, ready, basic);
      const bool was_launched = st.launched_at(b) != steady_clock::time_point{};
      if (was_launched) {
        const std::int64_t returned =
            m.launch_returned == steady_clock::time_point{} ? launched : ns(m.launch_returned);
        span("launch bucket " + bs, launcher, launched, returned, named);
        const request& req = in_flight(b);
        if (req.valid() && req.started_at() != steady_clock::time_point{} &&
            req.finished_at() != steady_clock::time_point{}) {
          const long progress = req.thread_id();
          track(progress, true);
          const std::int64_t a = ns(req.started_at()), z = ns(req.finished_at());
          span("allreduce bucket " + bs, progress, a, z,
               named + ",\"queued_us\":" + std::to_string(std::max<std::int64_t>(0, a - launched) / 1000));
          const std::uint64_t id =
              (static_cast<std::uint64_t>(rank_) << 32) | (std::uint64_t{serial_} << 24) | (flow_seq_++ & 0xffffff);
          flow("s", launcher, launched, id);
          flow("f", progress, a, id);
        }
      }
      if (m.wait_end != steady_clock::time_point{}) {
        span("wait bucket " + bs, me, ns(m.wait_begin), ns(m.wait_end), basic);
        if (copy_back) {
          // The copy of bucket b ends where the wait for the next one begins.
          std::int64_t copy_end = end;
          if (b + 1 < nb && marks_[b + 1].wait_begin != steady_clock::time_point{})
            copy_end = ns(marks_[b + 1].wait_begin);
          span("copy back bucket " + bs, me, ns(m.wait_end), copy_end, basic);
        }
      }
    }
    count_step();
  }

  void count_step() {
    ++recorded_;
    if (recorded_ >= max_steps_ && !stopped_) {
      instant("timeline stopped after " + std::to_string(recorded_) + " steps", detail::os_thread_id(),
              ns(steady_clock::now()),
              "\"steps_limit\":" + std::to_string(max_steps_) +
                  ",\"why\":\"the step limit (dp_options::timeline_steps or DDP_TIMELINE_STEPS) was reached\"",
              "p");
      stopped_ = true;
    }
    if (buf_.size() >= flush_bytes || stopped_) flush();
  }

  void stop_failed(const std::string& why) noexcept {
    if (failed_) return;
    failed_ = true;
    std::fprintf(stderr,
                 "ddp: rank %d: the timeline file '%s' is incomplete: %s; recording stopped, training goes on\n", rank_,
                 path_.c_str(), why.c_str());
    buf_.clear();
  }

  // Writes and empties the buffer; the errno of a failed write, else 0. EAGAIN (a pipe whose
  // reader does not keep up) is a failure too: waiting for the reader could stall training.
  int write_all() noexcept {
    std::size_t done = 0;
    while (done < buf_.size()) {
      const ssize_t n = ::write(fd_, buf_.data() + done, buf_.size() - done);
      if (n > 0)
        done += static_cast<std::size_t>(n);
      else if (n < 0 && errno == EINTR)
        continue;
      else
        return n < 0 ? errno : EIO;
    }
    buf_.clear();
    return 0;
  }
  // As write_all; a failure stops recording, with one line on stderr.
  void flush() noexcept {
    if (const int e = write_all()) stop_failed("writing failed: " + detail::errno_text(e));
  }

  std::string path_;
  int rank_, world_;
  std::uint64_t max_steps_;
  unsigned serial_;
  int fd_ = -1;
  detail::owner_process owner_;
  std::string buf_;
  std::size_t events_ = 0;
  std::uint64_t recorded_ = 0, flow_seq_ = 0;
  bool stopped_ = false, failed_ = false;
  std::vector<marks> marks_;
  std::vector<long> threads_;
  std::vector<std::string> names_json_;
  std::uint64_t names_generation_ = 0;
  bool names_cached_ = false;
};

}  // namespace DDP_ABI
}  // namespace ddp
