// The real elastic state machine (ddp::basic_elastic_group, group/elastic.hpp) run in a
// deterministic simulation: each simulated process is a thread running the same training loop
// as examples/05_elastic.cpp over `sim_env` (group/detail/elastic_env.hpp names what an
// environment provides): an in-process store, simulated process groups, fake time. One thread
// runs at a time, handed the baton by a scheduler that picks among the runnable processes with
// a seeded generator and advances the clock when none can run, so a seed replays exactly. At
// random the scheduler kills, freezes and thaws processes, starts newcomers and stalls the
// store, at every point of the protocol. Invariants, checked as the schedule runs and at its end:
//   - the committed step never goes backwards on any process;
//   - every committed step is applied with the same result everywhere (the state is a hash
//     chain of the steps: one wrong source or one step applied twice shows);
//   - each committed step's average is over exactly its generation's ranks;
//   - a newcomer never supplies state (its state is garbage: any process that took it diverges);
//   - a run that ends has every process done, left (a newcomer too late, a thawed rank after the
//     job), killed, or ended by an error: never hung, never done with the wrong state; when no
//     process holding the state survived, the others end with an error that says so.
// A failing schedule prints its seed; DDP_SIM_SEED=<seed> replays it alone.
#define DDP_ALLOW_DETAIL_HEADERS
#include <ddp/group/elastic.hpp>
#define DDP_ALLOW_DETAIL_HEADERS  // the store's table (group/detail/store_table.hpp), as the server holds it
#include <ddp/group/detail/store_table.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

using ddp::deadline_t;
using ddp::errc;
using ms = std::chrono::milliseconds;

constexpr ms lease = 500ms;     // the heartbeat's lease: a frozen or dead member is found after it
constexpr ms timeout = 6000ms;  // the group's timeout
constexpr ms op_cost = 1ms;     // a store request or a collective takes this much
constexpr ms step_time = 20ms;  // a step's forward and backward
constexpr std::uint64_t target_steps = 40;
constexpr int first_world = 4, min_size = 2, max_size = 4;

/// Thrown in a killed process's thread at its next call into the world (not a std::exception:
/// nothing in the library or the training loop catches it).
struct killed {};

/// The state after a step: a hash chain of the steps, each with the generation that committed
/// it and its average's contributions, so that a step applied by a rank that the others dropped
/// (and redid in another generation) shows as another chain.
std::uint64_t next_value(std::uint64_t v, std::uint64_t step, int gen, std::int64_t sum) {
  for (const std::uint64_t x : {step, static_cast<std::uint64_t>(gen), static_cast<std::uint64_t>(sum)})
    v = (v ^ (x + 0x9e3779b97f4a7c15ull)) * 0x100000001b3ull;
  return v;
}
constexpr std::uint64_t initial_value = 0x1234567;

class world;

/// The world's lock, held by the thread that holds the baton for as long as it holds it: a call
/// into the world adopts it (for waits on the world's condition) and never unlocks it.
struct adopted {
  std::unique_lock<std::mutex> lock;
  explicit adopted(std::mutex& m) : lock(m, std::adopt_lock) {}
  adopted(const adopted&) = delete;
  adopted& operator=(const adopted&) = delete;
  ~adopted() { (void)lock.release(); }
};

struct proc {
  int id = 0;
  bool newcomer = false;
  enum class st { waiting_start, runnable, blocked, done } state = st::waiting_start;
  std::function<bool()> ready;  // while blocked: may it go on before `wake`
  deadline_t wake{};
  bool killed = false;
  bool frozen = false;
  deadline_t frozen_at{}, thaw_at{}, killed_at{};
  std::thread th;
  std::condition_variable turn;  // signalled when the scheduler hands it the baton
  // What it did.
  std::string outcome;  // done, left, killed, error: <text>
  std::uint64_t last_step = 0;
};

/// One generation's group: formed by its members' form() calls, failed by the heartbeat's
/// finding (a member dead or frozen past the lease) or by a member's recover().
struct group_rec {
  std::string job;
  int world = 0;
  std::vector<int> pid;  // by rank; -1 until it arrived
  std::vector<bool> left, found_by_heartbeat;
  std::vector<int> found_dead;  // by rank: the predecessor its heartbeat found, -1
  std::vector<std::function<void(int)>> on_found;
  deadline_t first_arrival{};
  bool complete = false;
  bool failed = false;
  errc code = errc::aborted;
  std::string text;
  std::vector<std::uint64_t> done;  // by rank: collectives finished
  std::map<std::uint64_t, std::map<int, std::string>> colls;  // seq -> rank -> payload
};

class sim_group;

/// The world: the store, the groups, the clock, the scheduler, the invariants.
class world {
 public:
  explicit world(std::uint64_t seed) : rng_(seed) {}

  std::mutex mu;
  std::condition_variable cv;  // the scheduler's: signalled when a process gives the baton back
  int current = -1;  // the process holding the baton; -1: the scheduler
  deadline_t now = deadline_t{} + std::chrono::hours(1);
  std::vector<std::unique_ptr<proc>> procs;
  ddp::detail::store_table data{0, std::size_t{1} << 30};  // the store: the real server's table
  deadline_t stall_until{};
  std::map<std::string, std::unique_ptr<group_rec>> groups;
  std::map<std::uint64_t, std::uint64_t> truth{{0, initial_value}};  // step -> value after it
  std::string violation;
  int faults = 0;

  /// With DDP_SIM_TRACE set (a replay), what happens, with the fake time.
  void trace(const std::string& what) {
    static const bool on = std::getenv("DDP_SIM_TRACE") != nullptr;
    if (on)
      std::fprintf(stderr, "%8.3f %s\n", std::chrono::duration<double>(now - (deadline_t{} + std::chrono::hours(1))).count(),
                   what.c_str());
  }

  void bad(const std::string& what) {
    std::lock_guard lock(bad_mu_);
    if (violation.empty()) violation = what;
  }


  /// Gives the baton back (to whom the scheduler picks next: this very process, maybe) and
  /// waits for it. In a killed process, throws `killed` (unless it is unwinding already: then it
  /// returns, and the world ignores what it does).
  void yield(std::unique_lock<std::mutex>& lock, proc& p) {
    schedule_next();
    p.turn.wait(lock, [&] { return current == p.id; });
    if (p.killed && std::uncaught_exceptions() == 0) throw killed{};
  }
  /// Blocks the calling process until `ready()` or `wake`, whichever first (fake time).
  void block(std::unique_lock<std::mutex>& lock, proc& p, std::function<bool()> ready, deadline_t wake) {
    p.state = proc::st::blocked;
    p.ready = std::move(ready);
    p.wake = wake;
    yield(lock, p);
  }
  /// A store request: takes op_cost, and waits out a stall of the store (until `until`).
  void store_op(std::unique_lock<std::mutex>& lock, proc& p, deadline_t until) {
    block(lock, p, nullptr, now + op_cost);
    while (stall_until > now && now < until)  // a stall may be extended by the next one
      block(lock, p, [this] { return now >= stall_until; }, std::min(stall_until, until));
    if (stall_until > now)
      ddp::detail::raise(errc::timeout, p.id,
                         "sim: the store did not answer within the request's deadline (stalled " +
                             std::to_string((stall_until - now).count() / 1000000) + " ms more)");
  }

  /// The process computes for `d` (its forward and backward): time passes, others run.
  void compute(proc& p, ms d) {
    adopted a(mu);
    block(a.lock, p, nullptr, now + d);
  }

  // ---- the scheduler ----------------------------------------------------------------------

  void start(proc& p) {
    p.th = std::thread([this, &p] { body(p); });
  }

  std::function<void(world&, proc&)> body_fn;
  void body(proc& p) {
    std::unique_lock lock(mu);  // held throughout: released only while waiting for the baton
    p.turn.wait(lock, [&] { return current == p.id; });
    try {
      body_fn(*this, p);
    } catch (const killed&) {
      p.outcome = "killed";
    } catch (const ddp::error& e) {
      p.outcome = std::string("error: ") + e.what();
    } catch (const std::exception& e) {
      p.outcome = std::string("exception: ") + e.what();
      bad("process " + std::to_string(p.id) + " ended with a non-ddp exception: " + e.what());
    }
    if (p.killed) p.outcome = "killed";
    p.state = proc::st::done;
    schedule_next();
  }

  /// Runs the schedule: `fault_rate` faults per second of fake time and `op_fault` per call into
  /// the world (kills, freezes, newcomers, store stalls), at most `max_faults`. Returns when
  /// every process ended; a process that has not by `limit` is hung (a violation).
  void run(double fault_rate, double op_fault, int max_faults, ms limit) {
    std::unique_lock lock(mu);
    end_ = now + limit;
    limit_ = limit;
    gap_ = std::exponential_distribution<double>(fault_rate);
    op_fault_ = op_fault;
    max_faults_ = max_faults;
    next_fault_ = now + ms(static_cast<long>(1000 * gap_(rng_)));
    schedule_next();
    cv.wait(lock, [&] { return finished_; });
    lock.unlock();
    for (auto& p : procs)
      if (p->th.joinable()) p->th.join();
  }

  /// Hands the baton to the next process (called with the lock held by whoever gives it up):
  /// thaws who is due, runs the heartbeats, picks one of the processes that can move at
  /// random, or lets time pass to the next thing due, or ends the run.
  void schedule_next() {
    current = -1;
    for (;;) {
      for (auto& p : procs)
        if (p->frozen && now >= p->thaw_at) p->frozen = false;
      heartbeats();
      std::vector<proc*> can;
      for (auto& p : procs) {
        if (p->state == proc::st::done || p->frozen) continue;
        if (p->state == proc::st::waiting_start || p->state == proc::st::runnable || p->killed ||
            (p->state == proc::st::blocked && ((p->ready && p->ready()) || now >= p->wake)))
          can.push_back(p.get());
      }
      if (!can.empty()) {
        proc& p = *can[std::uniform_int_distribution<std::size_t>(0, can.size() - 1)(rng_)];
        // A fault at this very point of the protocol, now and then.
        if (faults < max_faults_ && !p.killed && std::bernoulli_distribution(op_fault_)(rng_)) {
          ++faults;
          if (std::bernoulli_distribution(0.6)(rng_))
            kill(p);
          else
            freeze(p);
          continue;
        }
        p.state = proc::st::runnable;
        p.ready = nullptr;
        current = p.id;
        p.turn.notify_one();
        return;
      }
      // Nobody can move: time passes to the next thing due.
      bool alive = false;
      deadline_t next = end_;
      for (auto& p : procs) {
        if (p->state == proc::st::done) continue;
        alive = true;
        if (p->frozen) next = std::min(next, p->thaw_at);
        else if (p->state == proc::st::blocked) next = std::min(next, p->wake);
      }
      if (!alive) {
        finished_ = true;
        cv.notify_one();
        return;
      }
      next = std::min(next, next_heartbeat());
      if (faults < max_faults_) next = std::min(next, next_fault_);
      if (next >= end_) {
        std::string who;
        for (auto& p : procs)
          if (p->state != proc::st::done) who += " " + std::to_string(p->id) + (p->frozen ? "(frozen)" : "");
        bad("hung: processes" + who + " had not ended " + std::to_string(limit_.count()) + " ms in");
        // Ends the hung ones: each is killed and unwinds.
        for (auto& p : procs)
          if (p->state != proc::st::done) kill(*p);
        end_ = deadline_t::max();
        continue;
      }
      now = std::max(now, next);
      if (faults < max_faults_ && now >= next_fault_) {
        fault();
        next_fault_ = now + ms(1 + static_cast<long>(1000 * gap_(rng_)));
      }
    }
  }

  proc& add_process(bool newcomer) {
    auto p = std::make_unique<proc>();
    p->id = static_cast<int>(procs.size());
    p->newcomer = newcomer;
    procs.push_back(std::move(p));
    start(*procs.back());
    return *procs.back();
  }

  void kill(proc& p) {
    if (p.killed || p.state == proc::st::done) return;
    trace("kill process " + std::to_string(p.id));
    p.killed = true;
    p.frozen = false;  // it ends (unwinds) at its next call into the world
    p.killed_at = now;
  }

  /// SIGSTOP: nothing of it runs until it thaws (after up to four leases).
  void freeze(proc& p) {
    p.frozen = true;
    p.frozen_at = now;
    p.thaw_at = now + ms(std::uniform_int_distribution<long>(100, 4 * lease.count())(rng_));
    trace("freeze process " + std::to_string(p.id) + " until " +
          std::to_string(std::chrono::duration<double>(p.thaw_at - (deadline_t{} + std::chrono::hours(1))).count()));
  }

 private:
  /// A fault at random: kill or freeze a process, start a newcomer, stall the store.
  void fault() {
    ++faults;
    std::vector<proc*> live;
    for (auto& p : procs)
      if (p->state != proc::st::done && !p->killed && !p->frozen) live.push_back(p.get());
    const auto pick = std::uniform_int_distribution<int>(0, 99)(rng_);
    if (pick < 35 && !live.empty()) {
      kill(*live[std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng_)]);
    } else if (pick < 55 && !live.empty()) {
      freeze(*live[std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng_)]);
    } else if (pick < 85) {
      if (procs.size() < 16) trace("newcomer " + std::to_string(add_process(true).id));
    } else {
      stall_until = now + ms(std::uniform_int_distribution<long>(10, 2 * lease.count())(rng_));
      trace("store stalls for " + std::to_string((stall_until - now).count() / 1000000) + " ms");
    }
  }

  /// The heartbeats' findings: in a formed group that has not failed, a member dead or frozen
  /// for a lease fails it (peer_lost or timeout); its successor's heartbeat names it (found_dead,
  /// and the callback that writes the mark in the store, run here for that process).
  void heartbeats() {
    for (auto& [job, gp] : groups) {
      auto& g = *gp;
      if (!g.complete || g.failed) continue;
      for (int r = 0; r < g.world; ++r) {
        if (g.left[static_cast<std::size_t>(r)]) continue;
        const proc& p = *procs[static_cast<std::size_t>(g.pid[static_cast<std::size_t>(r)])];
        const bool dead = p.killed && now - p.killed_at >= lease;
        const bool silent = p.frozen && now - p.frozen_at >= lease;
        if (!dead && !silent) continue;
        trace("heartbeat fails " + job + ": rank " + std::to_string(r) + (dead ? " died" : " froze"));
        fail(g, dead ? errc::peer_lost : errc::timeout,
             "rank " + std::to_string(r) + (dead ? " died" : " stopped answering") + " (heartbeat, simulated)");
        // Its successor's heartbeat found it: the first live one after it.
        for (int k = 1; k < g.world; ++k) {
          const int s = (r + k) % g.world;
          const proc& q = *procs[static_cast<std::size_t>(g.pid[static_cast<std::size_t>(s)])];
          if (g.left[static_cast<std::size_t>(s)] || q.killed || q.frozen || q.state == proc::st::done) continue;
          g.found_dead[static_cast<std::size_t>(s)] = r;
          if (auto fn = g.on_found[static_cast<std::size_t>(s)]) {
            in_callback_ = true;
            try {
              fn(r);
            } catch (...) {
            }
            in_callback_ = false;
          }
          break;
        }
        break;
      }
    }
  }
  deadline_t next_heartbeat() const {
    deadline_t next = deadline_t::max();
    for (auto& [job, gp] : groups) {
      const auto& g = *gp;
      if (!g.complete || g.failed) continue;
      for (int r = 0; r < g.world; ++r) {
        if (g.left[static_cast<std::size_t>(r)]) continue;
        const proc& p = *procs[static_cast<std::size_t>(g.pid[static_cast<std::size_t>(r)])];
        if (p.killed) next = std::min(next, p.killed_at + lease);
        if (p.frozen) next = std::min(next, p.frozen_at + lease);
      }
    }
    return next;
  }

 public:
  static void fail(group_rec& g, errc code, const std::string& text) {
    if (g.failed) return;
    g.failed = true;
    g.code = code;
    g.text = text;
  }
  /// A store request made by the scheduler on a process's behalf (a heartbeat's callback).
  bool in_callback() const { return in_callback_; }

 private:
  std::mt19937_64 rng_;
  std::mutex bad_mu_;
  bool in_callback_ = false;
  bool finished_ = false;
  deadline_t end_{}, next_fault_{};
  ms limit_{0};
  std::exponential_distribution<double> gap_{1.0};
  double op_fault_ = 0;
  int max_faults_ = 0;
};

/// The simulated store: the operations of ddp::store_client that the elastic group uses.
class sim_store {
 public:
  sim_store(world& w, int pid) : w_(w), pid_(pid) {}

  void set(std::string_view k, std::string_view v, deadline_t until) {
    if (!op(until)) return;
    note("set " + std::string(k) + " '" + std::string(v) + "'");
    run(ddp::detail::store_cmd::set, {std::string(k), std::string(v)});
  }
  std::string get(std::string_view k, deadline_t until) {
    if (!op(until)) return {};
    if (!w_.in_callback() && !has(k)) {
      adopted a(w_.mu);
      w_.block(a.lock, self(), [&] { return has(k); }, until);
    }
    const auto* v = w_.data.find(k);
    if (v == nullptr) ddp::detail::raise(errc::timeout, pid_, "sim: store key '" + std::string(k) + "' never appeared");
    return *v;
  }
  std::optional<std::string> try_get(std::string_view k, ms wait, deadline_t until) {
    if (!op(until)) return std::nullopt;
    note("try_get " + std::string(k));
    if (!w_.in_callback() && !has(k) && wait.count() > 0) {
      adopted a(w_.mu);
      w_.block(a.lock, self(), [&] { return has(k); }, std::min(until, w_.now + wait));
    }
    const auto* v = w_.data.find(k);
    if (v == nullptr) return std::nullopt;
    return *v;
  }
  bool check(std::string_view k, deadline_t until) {
    if (!op(until)) return false;
    return has(k);
  }
  std::int64_t add(std::string_view k, std::int64_t d, deadline_t until) {
    if (!op(until)) return 0;
    note("add " + std::string(k) + " " + std::to_string(d));
    return ddp::detail::decode_i64(run(ddp::detail::store_cmd::add, {std::string(k), ddp::detail::encode_i64(d)}));
  }
  std::string compare_set(std::string_view k, std::string_view expected, std::string_view desired, deadline_t until) {
    if (!op(until)) return {};
    const auto* now = w_.data.find(k);
    note("cas " + std::string(k) + " '" + std::string(expected) + "' -> '" + std::string(desired) + "' (now '" +
         (now ? *now : std::string("<none>")) + "')");
    return run(ddp::detail::store_cmd::cas, {std::string(k), std::string(expected), std::string(desired)});
  }
  std::vector<std::string> wait(const std::vector<std::string>& keys, ms wait, deadline_t until) {
    if (!op(until)) return keys;
    const auto missing = [&] {
      std::vector<std::string> m;
      for (const auto& k : keys)
        if (!has(k)) m.push_back(k);
      return m;
    };
    if (!w_.in_callback() && !missing().empty() && wait.count() > 0) {
      adopted a(w_.mu);
      w_.block(a.lock, self(), [&] { return missing().empty(); }, std::min(until, w_.now + wait));
    }
    return missing();
  }
  std::size_t erase_prefix(std::string_view prefix, deadline_t until) {
    if (!op(until)) return 0;
    note("erase_prefix " + std::string(prefix));
    std::size_t n = 0;
    for (;;) {  // as store_client does: the server erases a bounded number a request
      const auto k = std::stoul(run(ddp::detail::store_cmd::del, {std::string(prefix), "*"}));
      n += k;
      if (k < ddp::detail::store_max_fields) return n;
    }
  }

 private:
  proc& self() { return *w_.procs[static_cast<std::size_t>(pid_)]; }
  bool has(std::string_view k) const { return w_.data.find(k) != nullptr; }
  /// One request to the table that the real server holds (set, add, cas, del: answered at
  /// once); its first field, or "" (a request of a member: every process claims its seat).
  std::string run(ddp::detail::store_cmd code, std::vector<std::string> fields) {
    std::string first;
    ddp::detail::store_status status = ddp::detail::store_status::ok;
    const auto o = w_.data.execute(
        static_cast<std::uint64_t>(pid_), true, ddp::detail::frame{static_cast<std::uint8_t>(code), std::move(fields)},
        w_.now, [&](std::uint64_t, ddp::detail::store_status st, const std::vector<std::string_view>& f) {
          status = st;
          if (!f.empty()) first = f[0];
        });
    if (o == ddp::detail::store_table::outcome::parked || o == ddp::detail::store_table::outcome::overflow ||
        status != ddp::detail::store_status::ok)
      ddp::detail::raise(errc::protocol, pid_, "sim: the store refused a request: " + first);
    return first;
  }
  /// Every request: a scheduling point and op_cost of time (and a stall's wait), from the
  /// process's own thread; none when the scheduler runs a heartbeat's callback. False: a
  /// killed process, unwinding, whose requests the world ignores.
  bool op(deadline_t until) {
    if (w_.in_callback()) return true;
    adopted a(w_.mu);
    w_.store_op(a.lock, self(), until);
    return !self().killed;
  }
  void note(const std::string& what) {
    static const bool on = std::getenv("DDP_SIM_TRACE_OPS") != nullptr;
    if (on) w_.trace("  process " + std::to_string(pid_) + " " + what);
  }

  world& w_;
  int pid_;
};

/// A process's handle on a simulated generation's group.
class sim_group {
 public:
  sim_group() = default;
  sim_group(world* w, group_rec* g, int rank, int pid) : w_(w), g_(g), rank_(rank), pid_(pid) {}
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return g_ ? g_->world : 0; }
  bool has_sharded_state() const noexcept { return false; }
  bool shards_whole() const noexcept { return false; }
  bool exists() const noexcept { return g_ != nullptr; }
  group_rec* rec() const noexcept { return g_; }

  /// Rank 0's bytes to every rank (a collective of the group).
  void broadcast(std::span<std::uint64_t> v, int root) {
    auto out = collective(std::string(reinterpret_cast<const char*>(v.data()), v.size_bytes()));
    const auto& theirs = out.at(root);
    std::copy_n(theirs.data(), std::min(theirs.size(), v.size_bytes()), reinterpret_cast<char*>(v.data()));
  }
  void broadcast(std::span<std::byte> v, int root) {
    auto out = collective(std::string(reinterpret_cast<const char*>(v.data()), v.size()));
    const auto& theirs = out.at(root);
    std::copy_n(theirs.data(), std::min(theirs.size(), v.size()), reinterpret_cast<char*>(v.data()));
  }
  /// The training step's allreduce: the sum of every rank's `x`, and which processes gave it.
  std::int64_t allreduce(std::int64_t x) {
    auto out = collective(std::to_string(x));
    std::int64_t sum = 0;
    for (const auto& [r, s] : out) sum += std::stoll(s);
    return sum;
  }

 private:
  std::map<int, std::string> collective(std::string mine) {
    auto& w = *w_;
    adopted a(w.mu);
    auto& self = *w.procs[static_cast<std::size_t>(pid_)];
    w.block(a.lock, self, nullptr, w.now + op_cost);
    auto& g = *g_;
    const auto seq = g.done[static_cast<std::size_t>(rank_)];
    if (!g.failed) {
      g.colls[seq][rank_] = std::move(mine);
      const auto ready = [&] { return g.failed || static_cast<int>(g.colls[seq].size()) == g.world; };
      if (!ready()) w.block(a.lock, self, ready, w.now + timeout);
    }
    if (g.failed) ddp::detail::raise(g.code, rank_, "sim group: " + g.text);
    if (static_cast<int>(g.colls[seq].size()) != g.world) {
      w.fail(g, errc::timeout, "a collective timed out (simulated)");
      ddp::detail::raise(errc::timeout, rank_, "sim group: a collective timed out");
    }
    ++g.done[static_cast<std::size_t>(rank_)];
    return g.colls[seq];
  }

  world* w_ = nullptr;
  group_rec* g_ = nullptr;
  int rank_ = -1;
  int pid_ = -1;
};

/// The environment of group/detail/elastic_env.hpp, simulated. Every call comes from the
/// process's own thread, which holds the world's lock while it holds the baton.
class sim_env {
 public:
  using group = sim_group;
  using store = sim_store;

  sim_env() = default;
  sim_env(world* w, int pid, bool restarted) : w_(w), pid_(pid), restarted_(restarted) {}

  std::unique_ptr<store> open_store(const ddp::init_options&, bool, deadline_t) {
    return std::make_unique<store>(*w_, pid_);
  }
  static group no_group() { return {}; }
  static bool exists(const group& g) noexcept { return g.exists(); }
  group form(const ddp::init_options& o, bool /*equal_state*/) {
    auto& w = *w_;
    adopted a(w.mu);
    auto& self = *w.procs[static_cast<std::size_t>(pid_)];
    w.block(a.lock, self, nullptr, w.now + op_cost);
    auto& gp = w.groups[o.job_id];
    if (!gp) {
      gp = std::make_unique<group_rec>();
      gp->job = o.job_id;
      gp->world = o.world_size;
      gp->pid.assign(static_cast<std::size_t>(o.world_size), -1);
      gp->left.assign(static_cast<std::size_t>(o.world_size), false);
      gp->found_by_heartbeat.assign(static_cast<std::size_t>(o.world_size), false);
      gp->found_dead.assign(static_cast<std::size_t>(o.world_size), -1);
      gp->on_found.assign(static_cast<std::size_t>(o.world_size), nullptr);
      gp->done.assign(static_cast<std::size_t>(o.world_size), 0);
      gp->first_arrival = w.now;
    }
    auto& g = *gp;
    if (g.world != o.world_size || g.pid[static_cast<std::size_t>(o.rank)] != -1) {
      w.bad("form: generation " + o.job_id + " joined twice as rank " + std::to_string(o.rank) +
            " or with another size");
    }
    g.pid[static_cast<std::size_t>(o.rank)] = pid_;
    const auto arrived = [&] {
      return std::count_if(g.pid.begin(), g.pid.end(), [](int p) { return p >= 0; }) == g.world;
    };
    // The rendezvous completes when every rank arrived (and the barrier with it, when all are
    // alive); a rank that never comes fails it at the rendezvous deadline.
    const auto deadline = w.now + o.rendezvous_timeout;
    const auto ok = [&] {
      if (!arrived()) return false;
      for (int p : g.pid)
        if (w.procs[static_cast<std::size_t>(p)]->killed || w.procs[static_cast<std::size_t>(p)]->frozen) return false;
      return true;
    };
    if (!g.complete && !g.failed) {
      if (ok()) g.complete = true;
      else w.block(a.lock, self, [&] { return g.complete || g.failed || ok(); }, deadline);
      if (!g.complete && !g.failed && ok()) g.complete = true;
    }
    w.trace("process " + std::to_string(pid_) + " " + (g.complete ? "joined " : "failed to join ") + o.job_id +
            " as rank " + std::to_string(o.rank) + " of " + std::to_string(g.world));
    if (!g.complete) {
      if (!g.failed) w.fail(g, errc::timeout, "not every rank of " + std::to_string(g.world) + " arrived (simulated)");
      ddp::detail::raise(g.code, o.rank, "sim: rendezvous of " + o.job_id + " failed: " + g.text);
    }
    return group(&w, &g, o.rank, pid_);
  }
  void close(group& g) {
    if (!g.exists()) return;
    auto& self = *w_->procs[static_cast<std::size_t>(pid_)];
    auto* r = g.rec();
    r->on_found[static_cast<std::size_t>(g.rank())] = nullptr;
    if (!self.killed) r->left[static_cast<std::size_t>(g.rank())] = true;  // a goodbye, no death
    // Ranks still in a collective of it find this one gone.
    if (!self.killed && r->complete) {
      for (auto& [seq, arrivals] : r->colls)
        if (static_cast<int>(arrivals.size()) < r->world && !arrivals.count(g.rank()))
          world::fail(*r, errc::peer_lost, "rank " + std::to_string(g.rank()) + " left the group");
    }
    g = group();
  }
  void leave_heartbeat(group& g) {
    if (g.exists() && !w_->procs[static_cast<std::size_t>(pid_)]->killed)
      g.rec()->left[static_cast<std::size_t>(g.rank())] = true;
  }
  bool failed(group& g) { return !g.exists() || g.rec()->failed; }
  std::string failure_text(group& g) { return g.exists() && g.rec()->failed ? g.rec()->text : "a rank failed"; }
  void fail_all(group& g, errc code, const std::string& text, bool) {
    if (g.exists()) world::fail(*g.rec(), code, text);
  }
  int found_dead(const group& g) const noexcept {
    return g.exists() ? g.rec()->found_dead[static_cast<std::size_t>(g.rank())] : -1;
  }
  void on_found_dead(group& g, std::function<void(int)> fn) {
    if (g.exists()) g.rec()->on_found[static_cast<std::size_t>(g.rank())] = std::move(fn);
  }
  deadline_t now() const noexcept { return w_->now; }
  bool restarted() const noexcept { return restarted_; }
  std::string uid() const { return "sim." + std::to_string(pid_); }
  static std::string drop_parked() { return {}; }

 private:
  world* w_ = nullptr;
  int pid_ = -1;
  bool restarted_ = false;
};

/// The training loop of examples/05_elastic.cpp, its state a hash chain of the steps.
void train(world& w, proc& p) {
  ddp::init_options o;
  o.rank = p.id % first_world;  // a replacement takes a launcher's rank, as under ddprun
  o.world_size = first_world;
  o.elastic_min = min_size;
  o.elastic_max = max_size;
  o.external_store = true;
  o.heartbeat = lease;
  o.timeout = timeout;
  o.job_id = "sim";
  ddp::elastic_options eo;
  ddp::basic_elastic_group<sim_env> eg(o, eo, sim_env(&w, p.id, p.newcomer));
  // A newcomer's own state is garbage: were it ever a source, every process that took it
  // would leave the hash chain.
  std::uint64_t value = p.newcomer ? 0xdeadbeef00000000ull + static_cast<std::uint64_t>(p.id) : initial_value;
  sim_group* g = nullptr;
  eg.on_form([&](sim_group& grp) { g = &grp; });
  eg.on_state([&] { return std::to_string(value); }, [&](std::string_view s) { value = std::stoull(std::string(s)); });
  const auto check_state = [&](const char* when) {
    if (eg.step() < p.last_step)
      w.bad("process " + std::to_string(p.id) + ": the committed step went backwards " + when + " (" +
            std::to_string(p.last_step) + " -> " + std::to_string(eg.step()) + ")");
    p.last_step = eg.step();
    auto it = w.truth.find(eg.step());
    if (it == w.truth.end())
      w.bad("process " + std::to_string(p.id) + " holds step " + std::to_string(eg.step()) + " that nobody committed");
    else if (it->second != value)
      w.bad("process " + std::to_string(p.id) + " holds the wrong state of step " + std::to_string(eg.step()) + " " +
            when + (value >> 32 == 0xdeadbeef ? " (a newcomer's garbage)" : ""));
  };
  if (!eg.start()) {
    p.outcome = "left";
    return;
  }
  check_state("after joining");
  while (eg.step() < target_steps) {
    try {
      w.compute(p, step_time);
      const auto sum = g->allreduce(1);
      eg.commit([&] {
        // Each committed average is over exactly this generation's ranks.
        if (sum != eg.size())
          w.bad("process " + std::to_string(p.id) + ": step " + std::to_string(eg.step()) + " averaged " +
                std::to_string(sum) + " contributions in a generation of " + std::to_string(eg.size()));
        value = next_value(value, eg.step(), eg.generation(), sum);
        w.trace("process " + std::to_string(p.id) + " applies step " + std::to_string(eg.step()) + " in generation " +
                std::to_string(eg.generation()) + " (rank " + std::to_string(eg.rank()) + " of " + std::to_string(eg.size()) + ")");
        auto [it, fresh] = w.truth.emplace(eg.step(), value);
        if (!fresh && it->second != value)
          w.bad("process " + std::to_string(p.id) + " applied step " + std::to_string(eg.step()) +
                " to another state than the first process that applied it");
      });
      check_state("after a commit");
    } catch (const ddp::error& e) {
      w.trace("process " + std::to_string(p.id) + " recovers from: " + e.what());
      if (!eg.recover(e)) {
        p.outcome = "left";
        return;
      }
      check_state("after a recovery");
    }
  }
  eg.finish();
  p.outcome = "done";
}

}  // namespace

TEST_CASE("elastic simulation: the real elastic group under random kills, freezes, joins and store stalls") {
  const char* seed_env = std::getenv("DDP_SIM_SEED");
  const std::uint64_t first = seed_env ? std::strtoull(seed_env, nullptr, 10) : 1;
  const char* count_env = std::getenv("DDP_SIM_SCHEDULES");
  const int schedules = seed_env ? 1 : count_env ? std::atoi(count_env) : 1500;
  const char* from_env = std::getenv("DDP_SIM_FIRST");  // a long run's own seeds
  const char* faults_env = std::getenv("DDP_SIM_FAULTS");
  const int max_faults = faults_env ? std::atoi(faults_env) : 6;
  int done = 0, lost = 0, below = 0;
  std::string others;  // seeds that ended otherwise
  for (int i = 0; i < schedules; ++i) {
    const auto seed = (seed_env || !from_env ? first : std::strtoull(from_env, nullptr, 10)) + static_cast<std::uint64_t>(i);
    world w(seed);
    w.body_fn = train;
    for (int r = 0; r < first_world; ++r) w.add_process(false);
    w.run(1.0 + static_cast<double>(seed % 4), 0.002, max_faults, 120s);
    // The end: nobody done with the wrong state, and when the state was lost, said so.
    bool any_done = false;
    for (const auto& p : w.procs) {
      if (p->outcome == "done") {
        any_done = true;
        if (p->last_step != target_steps) w.bad("process " + std::to_string(p->id) + " finished at step " + std::to_string(p->last_step));
      }
    }
    if (any_done) {
      ++done;
      // The job finished: every process not killed finished it too, or left (a newcomer that
      // came too late, a thawed rank after the end): none ends with an error, which would
      // burn a replacement or fail the launcher for a job that succeeded.
      for (const auto& p : w.procs)
        if (p->outcome != "killed" && p->outcome != "done" && p->outcome != "left")
          w.bad("the job finished, but process " + std::to_string(p->id) + " ended with " + p->outcome);
    } else {
      // No process finished: each one that was not killed must have ended loudly, saying why
      // (the state lost, or the group below its minimum), never with another error or quietly.
      for (const auto& p : w.procs)
        if (p->outcome != "killed" && p->outcome.find(ddp::detail::elastic::state_lost_words) == std::string::npos &&
            p->outcome.find("below its minimum") == std::string::npos)
          w.bad("nobody finished the job, and process " + std::to_string(p->id) + " ended without saying why: " +
                p->outcome);
      bool said = false;
      for (const auto& p : w.procs)
        said = said || p->outcome.find("holding the state") != std::string::npos;
      bool small = false;
      for (const auto& p : w.procs) small = small || p->outcome.find("below its minimum") != std::string::npos;
      if (said) ++lost;
      else if (small) ++below;
      else if (others.size() < 200) others += " " + std::to_string(seed);
    }
    if (seed_env) {
      std::string outcomes;
      for (const auto& p : w.procs) outcomes += "\n  process " + std::to_string(p->id) + (p->newcomer ? " (newcomer)" : "") + ": step " + std::to_string(p->last_step) + ", " + p->outcome;
      MESSAGE("seed " << seed << ": " << w.faults << " faults, " << (w.now - (deadline_t{} + std::chrono::hours(1))).count() / 1000000 << " ms" << outcomes);
    }
    if (!w.violation.empty()) {
      std::string outcomes;
      for (const auto& p : w.procs) outcomes += "\n  process " + std::to_string(p->id) + ": " + p->outcome;
      FAIL_CHECK("seed " << seed << " (replay: DDP_SIM_SEED=" << seed << (max_faults != 6 ? " DDP_SIM_FAULTS=" + std::to_string(max_faults) : std::string()) << "; DDP_SIM_TRACE=1 shows what happened): " << w.violation << outcomes);
      break;
    }
  }
  MESSAGE(schedules << " schedules: " << done << " finished the job, " << lost << " ended saying the state was lost, "
                    << below << " with the group below its minimum; other ends:" << (others.empty() ? " none" : others));
}
