#pragma once
/// \file process_group.hpp
/// Process group: rendezvous through rank 0's TCP store, TCP connections between ranks made on
/// first use, barrier, broadcast and all_gather. Options come explicitly or from the environment that torchrun-style
/// launchers, `ddprun`, `mpirun` (Open MPI, MPICH/PMI) and Slurm set.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <ddp/clock.hpp>
#include <ddp/auth.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/detail/mesh.hpp>
#include <ddp/detail/rendezvous.hpp>
#include <ddp/detail/socket.hpp>
#include <ddp/error.hpp>
#include <ddp/store.hpp>

namespace ddp {
inline namespace v0 {

/// How a process joins its group. See docs/process-group.md.
///
/// \code
/// auto pg = ddp::init_process_group({.rank = 1, .world_size = 4, .master_addr = "10.0.0.1",
///                                    .master_port = 29500, .timeout = std::chrono::seconds(60)});
/// \endcode
struct init_options {
  int rank = 0;                                   ///< this process, in [0, world_size)
  int world_size = 1;                             ///< number of processes in the group
  std::string master_addr = "127.0.0.1";          ///< host name, IPv4 or IPv6 address of rank 0
  int master_port = 29500;                        ///< rank 0's store port
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};  ///< every blocking wait's bound
  std::string auth_token = {};                    ///< shared secret; needs an authenticator (docs/security.md)
  int local_rank = -1;                            ///< rank on this host, -1 when unknown
  std::string job_id = {};                        ///< names the job; tells two jobs on one port apart (optional)
  /// Lets a group without a secret serve its store beyond loopback (any host that reaches the
  /// port could then join or disturb the group). Off by default; DDP_INSECURE=1 sets it.
  bool insecure = false;

  /// Largest group: 2^20 ranks. Larger sizes are refused at once (errc::invalid_argument).
  static constexpr int max_world_size = 1 << 20;

  /// Reads the environment: `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`;
  /// when those are absent Open MPI's `OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK`, MPICH/PMI's
  /// `PMI_RANK/PMI_SIZE` (`MPI_LOCALRANKID`) and Slurm's `SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID`;
  /// `DDP_TIMEOUT` (seconds), `DDP_AUTH_TOKEN` and `DDP_JOB_ID` (set by `ddprun`). Throws
  /// errc::invalid_argument for a variable that is not a number.
  static init_options from_env() { return from_env([](const char* n) { return std::getenv(n); }); }

  /// The same, with a custom lookup (used by tests and by embedders with their own config).
  template <class Getenv>
  static init_options from_env(Getenv&& get) {
    init_options o;
    auto first = [&](std::initializer_list<const char*> names) -> std::pair<const char*, const char*> {
      for (const char* n : names) {
        const char* v = get(n);
        if (v != nullptr && *v != '\0') return {n, v};
      }
      return {nullptr, nullptr};
    };
    auto as_int = [](std::pair<const char*, const char*> nv, long long lo, long long hi) -> long long {
      long long x = 0;
      const std::string_view s(nv.second);
      auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
      if (ec != std::errc() || p != s.data() + s.size() || x < lo || x > hi)
        detail::raise(errc::invalid_argument, -1,
                      std::string("environment variable ") + nv.first + "='" + nv.second +
                          "' is not an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
      return x;
    };
    const auto rank_var = first({"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"});
    const auto size_var = first({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"});
    if (rank_var.first) o.rank = static_cast<int>(as_int(rank_var, -(1LL << 31), (1LL << 31) - 1));
    if (size_var.first) o.world_size = static_cast<int>(as_int(size_var, -(1LL << 31), (1LL << 31) - 1));
    if (!rank_var.first && !size_var.first) note_world_of_one();
    if (auto v = first({"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}); v.first)
      o.local_rank = static_cast<int>(as_int(v, 0, (1LL << 31) - 1));
    if (auto v = first({"MASTER_ADDR"}); v.first) o.master_addr = v.second;
    if (auto v = first({"MASTER_PORT"}); v.first) o.master_port = static_cast<int>(as_int(v, 0, 1LL << 31));
    if (auto v = first({"DDP_TIMEOUT"}); v.first)
      o.timeout = std::chrono::seconds(as_int(v, 1, 1LL << 31));
    if (auto v = first({"DDP_AUTH_TOKEN"}); v.first) o.auth_token = v.second;
    if (auto v = first({"DDP_JOB_ID"}); v.first) o.job_id = v.second;
    if (auto v = first({"DDP_INSECURE"}); v.first) o.insecure = as_int(v, 0, 1) == 1;
    return o;
  }

  /// Says once per process, on stderr, that no launcher set a rank: a program started by hand
  /// runs alone, which is easy to miss when several ranks were meant.
  static void note_world_of_one() noexcept {
    static std::atomic<bool> said{false};
    if (said.exchange(true)) return;
    std::fputs("ddp: no rank in the environment (RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/SIZE, PMI_RANK/SIZE or "
               "SLURM_PROCID/NTASKS): running as a world of 1 (rank 0); start the ranks with ddprun, torchrun, "
               "mpirun or srun to run more\n",
               stderr);
  }

  /// Cheap check before any socket is opened; empty when the options are usable.
  std::string validate() const {
    if (world_size < 1) return "world_size must be at least 1 (got " + std::to_string(world_size) + ")";
    if (world_size > max_world_size)
      return "world_size " + std::to_string(world_size) + " is larger than the " + std::to_string(max_world_size) +
             " ranks a group supports";
    if (rank < 0 || rank >= world_size)
      return "rank " + std::to_string(rank) + " is outside [0, " + std::to_string(world_size) + ")";
    if (master_port < 1 || master_port > 65535)
      return "master_port " + std::to_string(master_port) + " is outside [1, 65535]";
    if (master_addr.empty()) return "master_addr is empty";
    if (timeout.count() <= 0) return "timeout must be positive";
    return {};
  }
};

/// A joined group of processes, held through cheap handles: copies of a `process_group` share
/// one group, and every reducer, transport and wrapper built from it keeps a handle of its own.
/// The group closes (every connection; rank 0 keeps its store up until the other ranks have let
/// go of it, bounded by the timeout) when its last handle goes away, so the handle a program
/// got from `init_process_group` may be destroyed, moved or reassigned while those objects live.
/// A moved-from or closed handle is empty: its calls raise `errc::usage`. In a child made by
/// fork() every call that would communicate raises `errc::usage` too, and destroying the handle
/// touches nothing of the parent's (docs/process-group.md).
///
/// \code
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// ddp::ring<ddp::tcp> ring{pg};   // keeps the group alive for as long as it lives
/// \endcode
class process_group {
 public:
  process_group(const process_group&) = default;             ///< another handle on the same group
  process_group& operator=(const process_group&) = default;
  process_group(process_group&&) noexcept = default;         ///< leaves `other` empty
  process_group& operator=(process_group&&) noexcept = default;
  ~process_group() = default;  ///< the last handle closes the group

  /// This process's rank; -1 on an empty handle.
  int rank() const noexcept;
  /// The group size; 0 on an empty handle.
  int size() const noexcept;
  const init_options& options() const noexcept;
  std::chrono::milliseconds timeout() const noexcept;
  deadline_t deadline() const { return clock::now() + timeout(); }

  /// The group's key-value store (hosted by rank 0).
  store_client& store();

  /// A group-unique id agreed at rendezvous (distinguishes this group's connections).
  std::uint64_t id() const noexcept;

  /// Next id for a sub-mesh or shared segment; all ranks must create them in the same order.
  int next_channel_id();

  /// Blocks until every rank has called barrier(), or throws (timeout, peer_lost).
  void barrier() { barrier(deadline()); }
  void barrier(deadline_t until);

  /// Copies `root`'s bytes into every rank's `data`; sizes must agree (errc::mismatch).
  void broadcast(std::span<std::byte> data, int root = 0) { broadcast(data, root, deadline()); }
  void broadcast(std::span<std::byte> data, int root, deadline_t until);

  /// Typed convenience: broadcast a contiguous range of trivially copyable values.
  template <class T>
  void broadcast(std::span<T> data, int root = 0) {
    broadcast(std::as_writable_bytes(data), root, deadline());
  }

  /// Largest blob one rank may contribute to all_gather().
  static constexpr std::uint64_t max_gather_blob = 1ull << 30;

  /// Every rank contributes a blob; every rank gets all of them, indexed by rank.
  std::vector<std::string> all_gather(const std::string& mine);

  /// Socket connected to `peer`, connected now if this is the first exchange with it (both
  /// ranks must then talk to each other before `until`). -1 on an empty handle or in a forked
  /// child; throws errc::timeout / errc::peer_lost when the connection cannot be made.
  int peer_socket(int peer, deadline_t until);

  /// Connections this rank holds to its peers now: they are made on first use, so a group of
  /// thousands of ranks holds a handful per rank. 0 on an empty handle.
  int connections() const noexcept;

  /// Fails this rank's group on purpose: every call blocked on it, here or on a peer, ends with
  /// an error at once instead of at its deadline (errc::aborted naming this rank). Reducers
  /// have their own abort(); call both when a training step must stop everywhere. Does nothing
  /// on an empty handle or in a forked child.
  void abort(const std::string& why = "abort() called") noexcept;

  /// A failure as the group records it: its condition and a sentence that names the rank it
  /// happened on ("rank 2 reports: lost connection to rank 3 (...)"), so that any rank can
  /// raise it under its own prefix.
  struct failure {
    errc code{};
    std::string text;
    bool empty() const noexcept { return text.empty(); }
    /// "<errc> <text>": how a failure travels between ranks (store record, all_gather).
    std::string encode() const { return std::to_string(static_cast<int>(code)) + " " + text; }
    static failure decode(const std::string& v) {
      const auto sp = v.find(' ');
      if (sp == std::string::npos) return {errc::protocol, v};
      return {static_cast<errc>(std::atoi(v.substr(0, sp).c_str())), v.substr(sp + 1)};
    }
  };

  /// The same as abort(why), for a rank that gives up because of an exception: the peers'
  /// errors quote it.
  ///
  /// \code
  /// try { train(dp); } catch (const std::exception& e) { pg.abort(e); throw; }
  /// \endcode
  void abort(const std::exception& e) noexcept;

  /// "rank <this rank> reports: <msg>": the text of a failure this rank saw itself.
  std::string reported(const std::string& msg) const;

  /// Records `f` as the group's first failure unless one is recorded already, and returns the
  /// one that holds (the first writer wins). Transports that share the group's store record
  /// their failures here too.
  failure record_failure(const failure& f) noexcept;

  /// The group's first failure, or an empty one; sets *store_gone when the store does not
  /// answer. With `linger`, waits up to min(200 ms, timeout / 8) for one to be recorded.
  failure first_failure(bool* store_gone = nullptr, bool linger = false) noexcept;

  /// True when a rank recorded a failure, or the store does not answer.
  bool failure_recorded() noexcept;

  /// What to report for an error met while connecting to peers: the group's first failure when
  /// one is recorded, "rank 0 is lost" when its store does not answer either, else the error.
  failure explain(const error& e) noexcept;

  /// Bound of a store round trip made while failing: short, because the store's host (rank 0)
  /// may be the rank that is gone.
  deadline_t store_budget() const;

  /// After a timeout, finds who stopped; returns the sentence for the error. Transports that
  /// share the group's store use it too.
  std::string name_stopped(const std::string& prefix, int peer);

  /// True once abort() was called on this rank's group.
  bool aborted() const noexcept;

  /// Lets go of this handle (it becomes empty). The group closes when no handle is left: the
  /// last one closes the connections, and on rank 0 waits (bounded) for the others to leave
  /// its store first.
  void close() noexcept { s_.reset(); }

 private:
  class state;
  friend process_group init_process_group(const init_options&);
  explicit process_group(std::shared_ptr<state> s) noexcept : s_(std::move(s)) {}
  /// The group, for a call named `what`: errc::usage on an empty handle or in a forked child.
  state& live(const char* what) const;

  std::shared_ptr<state> s_;
};

/// What a group is; shared by its handles, destroyed (closing the group) with the last one.
class process_group::state {
 public:
  state() = default;
  state(const state&) = delete;
  state& operator=(const state&) = delete;
  ~state() {
    // In a forked child the members' destructors only close this process's copies of the
    // descriptors: no wait for the other ranks, no store traffic (the store server's own
    // destructor leaves the parent's thread alone).
    if (!owner_.forked()) close();
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const init_options& options() const noexcept { return opts_; }
  std::chrono::milliseconds timeout() const noexcept { return opts_.timeout; }
  deadline_t deadline() const { return clock::now() + opts_.timeout; }

  /// The group's key-value store (hosted by rank 0).
  store_client& store() { return *store_; }

  /// A group-unique id agreed at rendezvous (distinguishes this group's connections).
  std::uint64_t id() const noexcept { return group_id_; }

  /// Next id for a sub-mesh or shared segment; all ranks must create them in the same order.
  int next_channel_id() noexcept { return next_channel_++; }

  /// Blocks until every rank has called barrier(), or throws (timeout, peer_lost).
  void barrier() { barrier(deadline()); }
  void barrier(deadline_t until) {
    // Dissemination barrier: log2(n) rounds of one byte each way.
    for (int k = 1; k < size_; k <<= 1) {
      const int to = (rank_ + k) % size_, from = (rank_ - k + size_) % size_;
      const std::uint8_t b = 0xb7;
      send(to, &b, 1, until, "barrier");
      std::uint8_t got = 0;
      recv(from, &got, 1, until, "barrier");
      if (got != b) detail::raise(errc::mismatch, rank_, "rank " + std::to_string(from) + " is not in barrier()");
    }
  }

  /// Copies `root`'s bytes into every rank's `data`; sizes must agree (errc::mismatch).
  void broadcast(std::span<std::byte> data, int root = 0) { broadcast(data, root, deadline()); }
  void broadcast(std::span<std::byte> data, int root, deadline_t until) {
    if (root < 0 || root >= size_)
      detail::raise(errc::invalid_argument, rank_, "broadcast root " + std::to_string(root) + " is not a rank");
    // Binomial tree rooted at `root`, in virtual ranks relative to the root.
    const int vr = (rank_ - root + size_) % size_;
    const std::uint64_t n = data.size();
    int mask = 1;
    while (mask < size_) {
      if (vr & mask) {
        const int from = ((vr - mask) + root) % size_;
        std::uint64_t theirs = 0;
        recv(from, &theirs, sizeof theirs, until, "broadcast");
        if (theirs != n)
          detail::raise(errc::mismatch, rank_,
                        "broadcast size differs: " + std::to_string(n) + " bytes here, " +
                            std::to_string(theirs) + " at rank " + std::to_string(from));
        recv(from, data.data(), data.size(), until, "broadcast");
        break;
      }
      mask <<= 1;
    }
    mask >>= 1;
    while (mask > 0) {
      if (vr + mask < size_) {
        const int to = (vr + mask + root) % size_;
        send(to, &n, sizeof n, until, "broadcast");
        send(to, data.data(), data.size(), until, "broadcast");
      }
      mask >>= 1;
    }
  }

  /// Typed convenience: broadcast a contiguous range of trivially copyable values.
  template <class T>
  void broadcast(std::span<T> data, int root = 0) {
    broadcast(std::as_writable_bytes(data), root, deadline());
  }

  /// Largest blob one rank may contribute to all_gather().
  static constexpr std::uint64_t max_gather_blob = 1ull << 30;

  /// Every rank contributes a blob; every rank gets all of them, indexed by rank. A binomial
  /// tree gathers the blobs to rank 0 (each rank talks to log2(size) peers, never rank 0 to
  /// all), then a broadcast hands the result out.
  std::vector<std::string> all_gather(const std::string& mine) {
    const auto until = deadline();
    if (mine.size() > max_gather_blob)
      detail::raise(errc::invalid_argument, rank_,
                    "all_gather blob of " + std::to_string(mine.size()) + " bytes; at most " +
                        std::to_string(max_gather_blob));
    // `packed`: (u64 length, bytes) for ranks rank_, rank_ + 1, ... of this rank's subtree.
    std::string packed = detail::encode_i64(static_cast<std::int64_t>(mine.size())) + mine;
    for (int mask = 1; mask < size_; mask <<= 1) {
      if (rank_ & mask) {
        const std::uint64_t n = packed.size();
        send(rank_ - mask, &n, sizeof n, until, "all_gather");
        send(rank_ - mask, packed.data(), packed.size(), until, "all_gather");
        break;
      }
      const int child = rank_ + mask;
      if (child >= size_) continue;
      const auto ranks = static_cast<std::uint64_t>(std::min(mask, size_ - child));
      std::uint64_t n = 0;
      recv(child, &n, sizeof n, until, "all_gather");
      // Lengths from the wire are checked before anything is allocated with them.
      if (n > ranks * (8 + max_gather_blob))
        detail::raise(errc::protocol, rank_, "all_gather: rank " + std::to_string(child) + " announced " +
                                                 std::to_string(n) + " bytes for " + std::to_string(ranks) + " ranks");
      const auto at = packed.size();
      packed.resize(at + n);
      recv(child, packed.data() + at, n, until, "all_gather");
    }
    std::uint64_t len = packed.size();
    broadcast(std::as_writable_bytes(std::span(&len, 1)), 0, until);
    if (len > static_cast<std::uint64_t>(size_) * (8 + max_gather_blob))
      detail::raise(errc::protocol, rank_, "all_gather: rank 0 announced " + std::to_string(len) + " bytes");
    packed.resize(len);
    broadcast(std::as_writable_bytes(std::span(packed.data(), packed.size())), 0, until);
    std::vector<std::string> all(static_cast<std::size_t>(size_));
    std::size_t pos = 0;
    for (auto& s : all) {
      if (packed.size() - pos < 8) detail::raise(errc::protocol, rank_, "all_gather: truncated result from rank 0");
      const auto n = static_cast<std::uint64_t>(detail::decode_i64(std::string_view(packed).substr(pos, 8)));
      if (n > packed.size() - pos - 8) detail::raise(errc::protocol, rank_, "all_gather: malformed result from rank 0");
      s = packed.substr(pos + 8, n);
      pos += 8 + n;
    }
    if (pos != packed.size()) detail::raise(errc::protocol, rank_, "all_gather: malformed result from rank 0");
    return all;
  }

  /// Socket connected to `peer`, made now when this is the first exchange with it.
  int peer_socket(int peer, deadline_t until) { return links_->get(peer, until); }

  /// Connections this rank holds to its peers now (made on first use).
  int connections() const noexcept { return links_ ? links_->connections() : 0; }

  /// Fails this rank's group on purpose: every call blocked on it, here or on a peer, ends with
  /// an error at once instead of at its deadline. The reason goes to the store so peers report
  /// it (errc::aborted naming this rank); the mesh sockets are shut down so blocked peers wake.
  /// Reducers have their own abort(); call both when a training step must stop everywhere.
  void abort(const std::string& why = "abort() called") noexcept {
    if (aborted_.exchange(true)) return;
    post_failure({errc::aborted, "group aborted by rank " + std::to_string(rank_) + ": " + why});
  }

  /// The same, for a rank that gives up because of an exception: the peers' errors quote it.
  ///
  /// \code
  /// try { train(dp); } catch (const std::exception& e) { pg.abort(e); throw; }
  /// \endcode
  void abort(const std::exception& e) noexcept {
    try {
      abort(detail::message_of(e));
    } catch (...) {
      abort();
    }
  }


  /// "rank <this rank> reports: <msg>": the text of a failure this rank saw itself.
  std::string reported(const std::string& msg) const { return "rank " + std::to_string(rank_) + " reports: " + msg; }

  /// Records `f` as the group's first failure unless one is recorded already, and returns the
  /// one that holds: the first writer wins, so every rank that reads it before composing its
  /// own error reports the same cause. Returns `f` when the store does not answer. Transports
  /// that share the group's store record their failures here too.
  failure record_failure(const failure& f) noexcept {
    try {
      if (!store_) return f;
      return failure::decode(
          store_->compare_set(failure_key, "", f.encode(), store_budget()));
    } catch (...) {
      return f;
    }
  }

  /// The group's first failure, or an empty one; sets *store_gone when the store does not answer.
  /// With `linger`, waits up to min(200 ms, timeout / 8) for one to be recorded: a peer whose
  /// connection just closed records its failure before it closes, but a peer that leaves by
  /// an exception records it while it unwinds, which may come a moment later.
  failure first_failure(bool* store_gone = nullptr, bool linger = false) noexcept {
    const auto end = clock::now() +
                     (linger ? std::min<std::chrono::milliseconds>(std::chrono::milliseconds(200), opts_.timeout / 8)
                             : std::chrono::milliseconds(0));
    try {
      for (;;) {
        const auto until = store_budget();
        if (store_ && store_->check(failure_key, until)) return failure::decode(store_->get(failure_key, until));
        if (!store_ || clock::now() >= end) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } catch (const error& e) {
      // Gone when the connection broke; a request that only waited its turn behind another
      // thread's long wait says nothing about rank 0.
      if (store_gone != nullptr && (e.condition() != errc::timeout || store_->unusable())) *store_gone = true;
    } catch (...) {
      if (store_gone != nullptr) *store_gone = true;
    }
    return {};
  }

  /// True when a rank recorded a failure, or the store does not answer (a quick check, for
  /// waits that cannot see the failure otherwise, such as waiting for a peer to connect).
  bool failure_recorded() noexcept {
    try {
      return store_ && store_->check(failure_key, store_budget());
    } catch (const error& e) {
      // A request that timed out (the connection busy with another thread's long wait, or a
      // slow rank 0) says nothing yet; a connection that is gone says the group is.
      return e.condition() != errc::timeout || store_->unusable();
    } catch (...) {
      return true;
    }
  }

  /// What to report for an error met while connecting to peers (a peer that never connected,
  /// a connection refused or lost): the group's first failure when a rank recorded one; "rank 0
  /// is lost" when its store does not answer either (the peer that never connected may have
  /// failed on the store too: it is not the one to blame); else the error itself.
  failure explain(const error& e) noexcept {
    try {
      const auto code = e.condition();
      if (code != errc::timeout && code != errc::peer_lost) return {code, detail::message_of(e)};
      bool store_gone = false;
      if (auto f = first_failure(&store_gone); !f.empty()) return f;
      if (store_gone)
        return {errc::peer_lost, "rank 0 is lost (its store does not answer; " + detail::message_of(e) + ")"};
      return {code, detail::message_of(e)};
    } catch (...) {
      return {e.condition(), {}};
    }
  }

  /// Bound of a store round trip made while failing: short, because the store's host (rank 0)
  /// may be the rank that is gone.
  deadline_t store_budget() const {
    return clock::now() + std::min<std::chrono::milliseconds>(std::chrono::milliseconds(250), opts_.timeout / 8);
  }

  /// After a timeout, finds who stopped: the rank this one waits for (`peer`) may itself wait
  /// for another. Every rank that times out records under `prefix` whom it waits for; the
  /// chain of those records, from `peer` on, ends at the rank that stopped (frozen, swapping,
  /// or stuck outside ddp): a rank that is itself only waiting is never blamed. A rank at the
  /// end of the chain gets a grace of min(1 s, timeout / 4) to record that it waits too (its
  /// own deadline may come a little later). When the store (rank 0) does not answer either,
  /// rank 0 is the one. Returns the sentence for the error. Transports that share the group's
  /// store use it too.
  std::string name_stopped(const std::string& prefix, int peer) {
    const std::string waited = "rank " + std::to_string(rank_) + " waited for rank " + std::to_string(peer);
    const std::string store_silent = "rank 0 stopped answering (its store does not reply; " + waited + ")";
    if (!store_) return "rank " + std::to_string(peer) + " did not answer within the deadline";
    try {
      store_->set(prefix + "/waiting/" + std::to_string(rank_), std::to_string(peer), store_budget());
    } catch (const error&) {
      return store_silent;
    }
    const auto grace = std::min<std::chrono::milliseconds>(std::chrono::milliseconds(1000), opts_.timeout / 4);
    const auto end = clock::now() + grace;
    // Small groups read every rank's record, so the search can end as soon as the chain's end is
    // the only rank left silent; large ones read only the records along the chain (a thousand
    // ranks timing out together must not each read a thousand keys), and give its end the grace.
    const bool scan_all = size_ <= 64;
    std::unordered_map<int, int> waits_for{{rank_, peer}};
    auto record_of = [&](int r) {
      auto it = waits_for.find(r);
      if (it != waits_for.end()) return it->second;
      const std::string key = prefix + "/waiting/" + std::to_string(r);
      if (!store_->check(key, store_budget())) return -1;
      const int w = std::atoi(store_->get(key, store_budget()).c_str());
      waits_for[r] = w;
      return w;
    };
    std::vector<int> chain;
    for (;;) {
      int silent = 0;
      try {
        if (scan_all)
          for (int r = 0; r < size_; ++r)
            if (record_of(r) < 0) ++silent;
        // Follow "waits for" from `peer` until a rank that records nothing, or a cycle.
        chain.assign(1, peer);
        for (int r = peer; r >= 0 && r < size_ && record_of(r) >= 0;) {
          r = record_of(r);
          if (std::find(chain.begin(), chain.end(), r) != chain.end() || r < 0 || r >= size_) {
            chain.push_back(-1);  // a cycle: the ranks wait for each other
            break;
          }
          chain.push_back(r);
        }
      } catch (const error&) {
        return store_silent;
      }
      // Certain once the chain's end is the only rank left silent; else wait out the grace.
      if (chain.back() < 0 || (scan_all && silent <= 1) || clock::now() >= end) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    // chain: peer, whom peer waits for, ... ending at a silent rank, or at -1 after a cycle.
    std::string via = waited;
    for (std::size_t i = 1; i < chain.size() && chain[i] >= 0; ++i)
      via += ", which waited for rank " + std::to_string(chain[i]);
    if (chain.back() < 0) {
      std::string ring;
      for (std::size_t i = 0; i + 1 < chain.size(); ++i) ring += (ring.empty() ? "" : ", ") + std::to_string(chain[i]);
      return "ranks " + ring + " wait for each other and none of them stopped (" + via +
             "): their calls do not match";
    }
    return "rank " + std::to_string(chain.back()) + " stopped answering within the deadline (" + via + ")";
  }

  /// True once abort() was called here.
  bool aborted() const noexcept { return aborted_.load(); }

  /// Closes connections; rank 0 waits (bounded by the timeout) for the others to leave its
  /// store first. When the group failed (an error posted or raised here, abort(), or an
  /// exception on its way out) it waits at most min(500 ms, timeout / 4): long enough for the
  /// peers to read the posted reason, short enough that a frozen peer, which never leaves,
  /// does not hold this rank's error up by a whole timeout.
  void close() noexcept {
    const bool unwinding = std::uncaught_exceptions() > 0;
    // Leaving because of an exception: tell the peers why (the latest ddp::error alive here,
    // which is the one in flight or the one that caused it), rather than let them find a
    // closed connection and blame this rank.
    if (unwinding && !failed_.load() && !aborted_.load() && store_) {
      try {
        errc code{};
        std::string msg;
        post_failure({errc::aborted, detail::latest_live_error(code, msg)
                                         ? "rank " + std::to_string(rank_) + " left the group on its error (" +
                                               std::string(detail::errc_name(code)) + "): " + msg
                                         : "rank " + std::to_string(rank_) +
                                               " left the group while an exception propagated"});
      } catch (...) {
      }
    }
    const bool failing = failed_.load() || aborted_.load() || unwinding;
    links_.reset();
    store_.reset();
    if (server_) {
      const auto until = clock::now() + (failing ? std::min<std::chrono::milliseconds>(
                                                               std::chrono::milliseconds(500), opts_.timeout / 4)
                                                         : opts_.timeout);
      while (server_->clients() > 0 && clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      server_.reset();
    }
  }

 private:
  friend process_group init_process_group(const init_options&);
  friend class process_group;

  void send(int peer, const void* p, std::size_t n, deadline_t until, const char* what) {
    const int fd = link(peer, until, what);
    std::error_code ec;
    detail::send_all(fd, p, n, until, ec);
    if (ec) lost(peer, ec, what);
  }
  void recv(int peer, void* p, std::size_t n, deadline_t until, const char* what) {
    const int fd = link(peer, until, what);
    std::error_code ec;
    detail::recv_all(fd, p, n, until, ec);
    if (ec) lost(peer, ec, what);
  }
  /// The connection to `peer` for a call named `what`, made now if there is none yet.
  int link(int peer, deadline_t until, const char* what) {
    if (aborted_.load()) detail::raise(errc::aborted, rank_, std::string(what) + ": this rank's group was aborted");
    if (const int fd = links_->connected(peer); fd >= 0) return fd;
    try {
      return links_->get(peer, until);
    } catch (const error& e) {
      if (e.condition() != errc::timeout && e.condition() != errc::peer_lost) throw;
      lost(peer, make_error_code(e.condition()), what, detail::message_of(e));
    }
  }
  static constexpr const char* failure_key = "pg/failure";

  /// Records why this rank's group failed (the first failure recorded wins) and shuts the
  /// mesh, so that peers blocked on this rank wake at once and report the same failure
  /// instead of naming us. Returns the failure that holds.
  failure post_failure(const failure& f) noexcept {
    failed_.exchange(true);
    auto held = record_failure(f);
    if (links_) links_->shutdown();
    return held;
  }

  /// Raises `f` (recorded by some rank) as this rank's error: one verdict for everyone.
  [[noreturn]] void raise_failure(const failure& f, const char* what) {
    post_failure(f);
    detail::raise(f.code, rank_, std::string(what) + ": " + f.text);
  }

  /// A link failed (`ec`; `why`, when given, says how better than `ec`): report the group's
  /// first failure, or the rank that stopped, or the lost peer.
  [[noreturn]] void lost(int peer, const std::error_code& ec, const char* what, const std::string& why = {}) {
    if (aborted_.load()) detail::raise(errc::aborted, rank_, std::string(what) + ": this rank's group was aborted");
    bool store_gone = false;
    const bool timed_out = detail::to_errc(ec) == errc::timeout;
    if (auto f = first_failure(&store_gone, !timed_out); !f.empty()) raise_failure(f, what);
    std::string msg;
    if (store_gone) {
      msg = "rank 0 is lost (its store does not answer; noticed waiting for rank " + std::to_string(peer) + ")";
    } else if (timed_out) {
      msg = name_stopped("pg", peer);
    } else {
      msg = !why.empty() ? why : "lost connection to rank " + std::to_string(peer) + " (" + detail::describe(ec) + ")";
    }
    const errc code = timed_out && !store_gone ? errc::timeout : errc::peer_lost;
    // Another rank may have recorded its verdict meanwhile: the first one is everyone's.
    const auto held = post_failure({code, reported(msg)});
    if (held.text != reported(msg)) raise_failure(held, what);
    detail::raise(code, rank_, std::string(what) + ": " + msg);
  }

  init_options opts_;
  int rank_ = 0;
  int size_ = 1;
  std::uint64_t group_id_ = 0;
  int next_channel_ = 1;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> failed_{false};  // a failure was posted: close() does not wait for the others
  std::unique_ptr<store_server> server_;
  std::unique_ptr<store_client> store_;
  std::unique_ptr<detail::peer_links> links_;
  detail::owner_process owner_;  // the process that joined: a forked child's copy only closes
};

inline process_group::state& process_group::live(const char* what) const {
  if (!s_)
    detail::raise(errc::usage, -1,
                  std::string(what) + " on an empty process_group handle (it was moved from or closed); use "
                                      "the handle it was moved to, or one kept by a reducer or wrapper");
  s_->owner_.check(s_->rank_, std::string("process_group (") + what + ")");
  return *s_;
}

inline int process_group::rank() const noexcept { return s_ ? s_->rank() : -1; }
inline int process_group::size() const noexcept { return s_ ? s_->size() : 0; }
inline const init_options& process_group::options() const noexcept {
  static const init_options none{};
  return s_ ? s_->options() : none;
}
inline std::chrono::milliseconds process_group::timeout() const noexcept { return options().timeout; }
inline store_client& process_group::store() { return live("store()").store(); }
inline std::uint64_t process_group::id() const noexcept { return s_ ? s_->id() : 0; }
inline int process_group::next_channel_id() { return live("next_channel_id()").next_channel_id(); }
inline void process_group::barrier(deadline_t until) { live("barrier()").barrier(until); }
inline void process_group::broadcast(std::span<std::byte> data, int root, deadline_t until) {
  live("broadcast()").broadcast(data, root, until);
}
inline std::vector<std::string> process_group::all_gather(const std::string& mine) {
  return live("all_gather()").all_gather(mine);
}
inline int process_group::connections() const noexcept { return s_ ? s_->connections() : 0; }
inline int process_group::peer_socket(int peer, deadline_t until) {
  return s_ && !s_->owner_.forked() ? s_->peer_socket(peer, until) : -1;
}
inline void process_group::abort(const std::string& why) noexcept {
  if (s_ && !s_->owner_.forked()) s_->abort(why);
}
inline deadline_t process_group::store_budget() const { return live("store_budget()").store_budget(); }
inline std::string process_group::name_stopped(const std::string& prefix, int peer) {
  return live("name_stopped()").name_stopped(prefix, peer);
}
inline bool process_group::aborted() const noexcept { return s_ && s_->aborted(); }
inline void process_group::abort(const std::exception& e) noexcept {
  if (s_ && !s_->owner_.forked()) s_->abort(e);
}
inline std::string process_group::reported(const std::string& msg) const { return live("reported()").reported(msg); }
inline process_group::failure process_group::record_failure(const failure& f) noexcept {
  return s_ && !s_->owner_.forked() ? s_->record_failure(f) : f;
}
inline process_group::failure process_group::first_failure(bool* store_gone, bool linger) noexcept {
  return s_ && !s_->owner_.forked() ? s_->first_failure(store_gone, linger) : failure{};
}
inline bool process_group::failure_recorded() noexcept { return s_ && !s_->owner_.forked() && s_->failure_recorded(); }
inline process_group::failure process_group::explain(const error& e) noexcept {
  if (s_ && !s_->owner_.forked()) return s_->explain(e);
  return {e.condition(), detail::message_of(e)};
}

namespace detail {
/// Lazily made connections for a channel of the group (`prefix` names it in the store).
template <class Group>
std::unique_ptr<peer_links> open_links(Group& pg, const std::string& prefix, int bufsize) {
  auto& st = pg.store();
  // Each channel's hellos carry its own id (the group's, mixed with the channel's name): a late
  // first contact meant for a closed channel is never admitted into a new one on the same port.
  std::uint64_t channel = pg.id();
  for (unsigned char c : prefix) channel = (channel ^ c) * 0x100000001b3ull;
  return std::make_unique<peer_links>(store_directory(st, pg.timeout()), local_address(st.native_handle()), st.auth(),
                                      pg.rank(), pg.size(), prefix, channel, bufsize,
                                      [&pg] { return pg.failure_recorded(); });
}
}  // namespace detail

/// Joins the group described by `opts` and returns once every rank has joined.
///
/// Throws `ddp::error`: invalid_argument (bad rank, size, port), unresolvable (master address),
/// address_in_use (rank 0's port taken, or another job's store answers on it: a different world
/// size or job id), rank_conflict (two processes of this job claim one rank), timeout
/// (a rank never arrived; the message names the missing ranks).
/// \code
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// pg.barrier();
/// \endcode
inline process_group init_process_group(const init_options& opts) {
  if (auto why = opts.validate(); !why.empty()) detail::raise(errc::invalid_argument, opts.rank, why);
  // A token with no authenticator installed is errc::unsupported: never run unauthenticated
  // when a secret was asked for.
  std::shared_ptr<const authenticator> auth;
  if (!opts.auth_token.empty()) auth = make_authenticator(opts.auth_token, opts.rank);
  auto group = std::make_shared<process_group::state>();
  auto& pg = *group;
  pg.opts_ = opts;
  pg.rank_ = opts.rank;
  pg.size_ = opts.world_size;
  const auto until = clock::now() + opts.timeout;
  const int rank = opts.rank;

  // Resolve first, so an unresolvable master fails at once on every rank.
  const auto eps = detail::resolve(opts.master_addr, opts.master_port, rank);
  // Without a secret, anyone who reaches the store could join the group or disturb it: that is
  // only acceptable on loopback, unless the user says otherwise.
  if (!auth && !opts.insecure)
    for (const auto& ep : eps)
      if (!detail::is_loopback(ep.addr))
        detail::raise(errc::auth_failed, rank,
                      "the group's store at " + opts.master_addr + ":" + std::to_string(opts.master_port) + " (" +
                          detail::to_string(ep.addr) +
                          ") is reachable beyond this host and the group has no secret: any process that reaches "
                          "it could join or disturb the group. Give every rank the same secret in DDP_AUTH_TOKEN "
                          "(or init_options::auth_token; docs/security.md), or accept an unauthenticated network "
                          "with DDP_INSECURE=1 (or init_options::insecure = true)");
  // Only connections that claimed a rank (pg/rank/<r>) may write: a stranger can read, but can
  // neither plant a failure, an address or a record, nor hold rank 0's exit (docs/security.md).
  if (rank == 0)
    pg.server_ = std::make_unique<store_server>(eps.front(), 0, auth, store_limits{}, "pg/rank/",
                                                static_cast<std::uint32_t>(opts.world_size));
  pg.store_ = std::make_unique<store_client>(opts.master_addr, opts.master_port, rank, until, auth);
  auto& st = *pg.store_;

  pg.group_id_ = detail::join_store(
      st, {rank, opts.world_size, opts.job_id, opts.master_addr + ":" + std::to_string(opts.master_port),
           static_cast<long long>(opts.timeout.count())},
      until);
  pg.links_ = detail::open_links(pg, "pg/mesh", 0);
  // The first barrier makes each rank's first connections (log2(size) peers) and proves the
  // group can talk; a failure there is reported like any other.
  pg.barrier(until);
  return process_group(std::move(group));
}

}  // namespace v0
}  // namespace ddp
