#pragma once
/// \file process_group.hpp
/// Process group: rendezvous through rank 0's TCP store, TCP connections between ranks made on
/// first use, barrier, broadcast and all_gather. Options come explicitly or from the environment that torchrun-style
/// launchers, `ddprun`, `mpirun` (Open MPI, MPICH/PMI) and Slurm set.

#include <unistd.h>

#include <algorithm>
#include <atomic>
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
#include <type_traits>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/auth.hpp>
#include <ddp/detail/bytes.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/detail/kernels.hpp>
#include <ddp/detail/launcher.hpp>
#include <ddp/detail/mesh.hpp>
#include <ddp/detail/rendezvous.hpp>
#include <ddp/detail/socket.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/group/backend.hpp>
#include <ddp/group/init_options.hpp>
#include <ddp/group/verdict.hpp>
#include <ddp/store.hpp>

namespace ddp {
inline namespace v0 {

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
  process_group(const process_group&) = default;  ///< another handle on the same group
  process_group& operator=(const process_group&) = default;
  process_group(process_group&&) noexcept = default;  ///< leaves `other` empty
  process_group& operator=(process_group&&) noexcept = default;
  ~process_group() = default;  ///< the last handle closes the group

  /// This process's rank; -1 on an empty handle.
  int rank() const noexcept;
  /// The group size; 0 on an empty handle.
  int size() const noexcept;
  const init_options& options() const noexcept;
  std::chrono::milliseconds timeout() const noexcept;
  deadline_t deadline() const { return steady_clock::now() + timeout(); }

  /// The group's key-value store (hosted by rank 0).
  store_client& store();

  /// A group-unique id agreed at rendezvous (distinguishes this group's connections).
  std::uint64_t id() const noexcept;

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

  /// Largest contribution of one rank to all_reduce(), in bytes (8192 doubles): every rank
  /// receives every rank's values, so this is for a few scalars. Gradients and other large
  /// buffers go through a reducer (`ddp::ring`, `ddp::data_parallel`).
  static constexpr std::size_t max_all_reduce_bytes = std::size_t{64} << 10;

  /// Reduces a few values over every rank without building a reducer: a loss, an accuracy, a
  /// sample count. Every rank gets the same bits: each rank receives every rank's values and
  /// combines them in rank order with the reducers' kernels (`op::avg` divides by the group
  /// size; integer averages truncate). Collective; bounded by `until` (the group's timeout by
  /// default). Throws `errc::mismatch` on every rank when ranks disagree on the count, the
  /// element type or the op (the message names the ranks), `errc::invalid_argument` above
  /// `max_all_reduce_bytes` or for an unknown op, and timeout / peer_lost / aborted when a
  /// peer is gone. See docs/training-loop.md.
  ///
  /// \code
  /// double stats[2] = {loss_sum, correct};
  /// pg.all_reduce(std::span{stats}, ddp::op::sum);
  /// \endcode
  template <element T, std::size_t Extent>
  requires(!std::is_const_v<T>) void all_reduce(std::span<T, Extent> values, op o) {
    all_reduce(values, o, deadline());
  }
  template <element T, std::size_t Extent>
  requires(!std::is_const_v<T>) void all_reduce(std::span<T, Extent> values, op o, deadline_t until);

  /// One value: returns the reduction of every rank's `value`.
  ///
  /// \code
  /// const double mean_loss = pg.all_reduce(loss, ddp::op::avg);
  /// \endcode
  template <element T>
  T all_reduce(T value, op o) {
    all_reduce(std::span<T>(&value, 1), o, deadline());
    return value;
  }

  /// Connections this rank holds to its peers now: they are made on first use, so a group of
  /// thousands of ranks holds a handful per rank. 0 on an empty handle.
  int connections() const noexcept;

  /// Fails this rank's group on purpose: every call blocked on it, here or on a peer, ends with
  /// an error at once instead of at its deadline (errc::aborted naming this rank). Reducers
  /// have their own abort(); call both when a training step must stop everywhere. Does nothing
  /// on an empty handle or in a forked child.
  void abort(const std::string& why = "abort() called") noexcept;

  /// A failure as the group records it (group/verdict.hpp): its condition and a sentence that
  /// names the rank it happened on, so that any rank can raise it under its own prefix.
  using failure = group_failure;

  /// The same as abort(why), for a rank that gives up because of an exception: the peers'
  /// errors quote it.
  ///
  /// \code
  /// try { train(dp); } catch (const std::exception& e) { pg.abort(e); throw; }
  /// \endcode
  void abort(const std::exception& e) noexcept;

  /// True once abort() was called on this rank's group.
  bool aborted() const noexcept;

  /// Lets go of this handle (it becomes empty). The group closes when no handle is left: the
  /// last one closes the connections, and on rank 0 waits (bounded) for the others to leave
  /// its store first.
  void close() noexcept { s_.reset(); }

 private:
  class state;
  friend process_group init_process_group(const init_options&);
  friend class transport_context;  // hands transports the group's channels, links and verdict
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
  deadline_t deadline() const { return steady_clock::now() + opts_.timeout; }

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
                        "broadcast size differs: " + std::to_string(n) + " bytes here, " + std::to_string(theirs) +
                            " at rank " + std::to_string(from));
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
  std::vector<std::string> all_gather(const std::string& mine) { return all_gather(mine, deadline()); }
  std::vector<std::string> all_gather(const std::string& mine, deadline_t until) {
    if (mine.size() > max_gather_blob)
      detail::raise(
          errc::invalid_argument, rank_,
          "all_gather blob of " + std::to_string(mine.size()) + " bytes; at most " + std::to_string(max_gather_blob));
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
        detail::raise(errc::protocol, rank_,
                      "all_gather: rank " + std::to_string(child) + " announced " + std::to_string(n) + " bytes for " +
                          std::to_string(ranks) + " ranks");
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

  /// `n` values of type `t` at `values`, reduced with `o` over every rank (process_group::all_reduce).
  /// Each rank contributes a tagged record (tag, dtype, op, count, values) through all_gather;
  /// every rank checks all records, then combines them in rank order: the same inputs in the
  /// same order through the same kernel give the same bits on every rank.
  void all_reduce(void* values, std::size_t n, dtype t, op o, deadline_t until) {
    constexpr std::uint32_t tag = 0x64415231;  // "1RAd" on the wire: a record of all_reduce()
    // tag, dtype, op, 2 zero bytes, count: 16 bytes, so that the values that follow lie as
    // aligned as the string's heap buffer (16 bytes) and the kernels read them as T.
    constexpr std::size_t head = 16;
    if (static_cast<unsigned>(o) > static_cast<unsigned>(op::prod))
      detail::raise(errc::invalid_argument, rank_, "all_reduce: unknown op " + std::to_string(static_cast<int>(o)));
    const std::size_t es = detail::checked_size(t);
    if (n > process_group::max_all_reduce_bytes / es)
      detail::raise(errc::invalid_argument, rank_,
                    "all_reduce of " + std::to_string(n) + " " + dtype_name(t) + " values (" + std::to_string(n) +
                        " x " + std::to_string(es) + " bytes); at most " +
                        std::to_string(process_group::max_all_reduce_bytes) +
                        " bytes: use a reducer (ddp::ring) for larger buffers");
    std::string mine;
    detail::byte_writer(mine)
        .u32(tag)
        .u8(static_cast<std::uint8_t>(t))
        .u8(static_cast<std::uint8_t>(o))
        .zeros(2)
        .u64(n)
        .raw(std::span(static_cast<const std::byte*>(values), n * es));
    std::vector<std::string> all;
    try {
      all = all_gather(mine, until);
    } catch (const error& e) {
      // A lost or frozen peer: said as the failure of this call, with the cause.
      detail::raise(e.condition(), rank_, "all_reduce: " + std::string(e.message()), e.bucket(), e.parameter());
    }
    // Every rank reads every record the same way, so every rank raises the same error.
    struct record {
      bool ok = false;
      dtype t{};
      op o{};
      std::uint64_t n = 0;
    };
    const auto read = [&](const std::string& blob) {
      detail::byte_reader r(blob);
      record rec;
      const auto tg = r.u32();
      const auto ty = r.u8();
      const auto op_ = r.u8();
      r.zeros(2);
      rec.n = r.u64();
      rec.ok = r.ok() && tg == tag && ty <= static_cast<std::uint8_t>(dtype::i64) &&
               op_ <= static_cast<std::uint8_t>(op::prod);
      rec.t = static_cast<dtype>(ty);
      rec.o = static_cast<op>(op_);
      rec.ok = rec.ok && r.remaining() / dtype_size(rec.t) == rec.n && r.remaining() % dtype_size(rec.t) == 0;
      return rec;
    };
    const auto says = [](int q, const record& rec) {
      if (!rec.ok) return "rank " + std::to_string(q) + " is not in all_reduce() (another collective?)";
      return "rank " + std::to_string(q) + " reduces " + std::to_string(rec.n) + " " + dtype_name(rec.t) +
             (rec.n == 1 ? " value" : " values") + " with " + op_name(rec.o);
    };
    const record first = read(all[0]);
    std::string differ;
    int differing = 0;
    for (int q = 0; q < size_; ++q) {
      const record rec = q == 0 ? first : read(all[static_cast<std::size_t>(q)]);
      if (rec.ok && first.ok && rec.t == first.t && rec.o == first.o && rec.n == first.n) continue;
      if (++differing <= 4) differ += (differ.empty() ? "" : ", ") + says(q, rec);
    }
    if (differing > 0) {
      if (differing > 4) differ += " and " + std::to_string(differing - 4) + " more";
      detail::raise(errc::mismatch, rank_,
                    "all_reduce: ranks disagree: " + (first.ok ? says(0, first) + "; " : std::string()) + differ);
    }
    std::vector<const void*> ins(static_cast<std::size_t>(size_));
    for (std::size_t q = 0; q < ins.size(); ++q) ins[q] = all[q].data() + head;
    void* outs[1] = {values};
    detail::combine(outs, 1, ins.data(), size_, n, t, o, detail::avg_step{size_, 0, true});
  }

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

  /// The group's failure record and the judgement on failed links (group/verdict.hpp).
  failure_verdict& verdict() noexcept { return verdict_; }

  /// True once abort() was called here.
  bool aborted() const noexcept { return aborted_.load(); }

  /// Closes connections; rank 0 waits (bounded by the timeout) for the others to leave its
  /// store first. When the group failed (an error posted or raised here, abort(), an
  /// exception on its way out, or a failure any rank recorded) it waits at most
  /// min(500 ms, timeout / 4): long enough for the peers to read the posted reason, short
  /// enough that a frozen peer, which never leaves, does not hold this rank's error up by a
  /// whole timeout.
  void close() noexcept {
    const bool unwinding = std::uncaught_exceptions() > 0;
    // Leaving because of an exception: tell the peers why (the latest ddp::error alive here,
    // which is the one in flight or the one that caused it), rather than let them find a
    // closed connection and blame this rank.
    if (unwinding && !failed_.load() && !aborted_.load() && store_) {
      try {
        errc code{};
        std::string msg;
        const bool known = detail::latest_live_error(code, msg);
        // An error about the group itself (calls that do not match, a deadline, a lost peer)
        // is the peers' error too and keeps its code; one about this rank alone (a bad
        // argument, a misuse) is errc::aborted for them.
        const bool group_wide = known && (code == errc::mismatch || code == errc::timeout || code == errc::peer_lost);
        post_failure({group_wide ? code : errc::aborted,
                      known ? "rank " + std::to_string(rank_) + " left the group on its error (" +
                                  std::string(detail::errc_name(code)) + "): " + msg
                            : "rank " + std::to_string(rank_) + " left the group while an exception propagated"});
      } catch (...) {
      }
    }
    // A failure a transport on the group recorded counts too: a program that caught it and
    // leaves normally must not keep rank 0 waiting a whole timeout for a peer that is gone.
    const bool failing = failed_.load() || aborted_.load() || unwinding || (server_ && !verdict_.first().empty());
    launcher_.reset();  // its thread records through the verdict: stopped before the store goes
    links_.reset();
    verdict_.detach();
    store_.reset();
    if (server_) {
      const auto until = steady_clock::now() + (failing ? std::min<std::chrono::milliseconds>(
                                                              detail::timing::close_failing_wait, opts_.timeout / 4)
                                                        : opts_.timeout);
      while (server_->clients() > 0 && steady_clock::now() < until)
        std::this_thread::sleep_for(detail::timing::close_poll);
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
  /// Records why this rank's group failed (the first failure recorded wins) and shuts the
  /// mesh, so that peers blocked on this rank wake at once and report the same failure
  /// instead of naming us. Returns the failure that holds.
  failure post_failure(const failure& f) noexcept {
    failed_.exchange(true);
    auto held = verdict_.record(f);
    if (links_) links_->shutdown();
    return held;
  }

  /// A link failed (`ec`; `why`, when given, says how better than `ec`): report the group's
  /// first failure, or the rank that stopped, or the lost peer (the verdict, which records this
  /// rank's own), and shut the mesh so that peers blocked on this rank wake and report it too.
  [[noreturn]] void lost(int peer, const std::error_code& ec, const char* what, const std::string& why = {}) {
    if (aborted_.load()) detail::raise(errc::aborted, rank_, std::string(what) + ": this rank's group was aborted");
    const auto v = verdict_.judge(peer, ec, "waiting for rank " + std::to_string(peer), why);
    failed_.exchange(true);
    if (links_) links_->shutdown();
    detail::raise(v.failure.code, rank_, std::string(what) + ": " + v.failure.text);
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
  failure_verdict verdict_;  // kept in store_; detached before it closes
  std::unique_ptr<detail::peer_links> links_;
  std::unique_ptr<detail::launcher_watch> launcher_;  // DDP_LAUNCHER_FD: the launcher's note (detail/launcher.hpp)
  detail::owner_process owner_;                       // the process that joined: a forked child's copy only closes
};

inline process_group::state& process_group::live(const char* what) const {
  if (!s_)
    detail::raise(errc::usage, -1,
                  std::string(what) +
                      " on an empty process_group handle (it was moved from or closed); use "
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
inline void process_group::barrier(deadline_t until) { live("barrier()").barrier(until); }
inline void process_group::broadcast(std::span<std::byte> data, int root, deadline_t until) {
  live("broadcast()").broadcast(data, root, until);
}
inline std::vector<std::string> process_group::all_gather(const std::string& mine) {
  return live("all_gather()").all_gather(mine);
}
template <element T, std::size_t Extent>
requires(!std::is_const_v<T>) void process_group::all_reduce(std::span<T, Extent> values, op o, deadline_t until) {
  live("all_reduce()").all_reduce(static_cast<void*>(values.data()), values.size(), dtype_of_v<T>, o, until);
}
inline int process_group::connections() const noexcept { return s_ ? s_->connections() : 0; }
inline void process_group::abort(const std::string& why) noexcept {
  if (s_ && !s_->owner_.forked()) s_->abort(why);
}
inline bool process_group::aborted() const noexcept { return s_ && s_->aborted(); }
inline void process_group::abort(const std::exception& e) noexcept {
  if (s_ && !s_->owner_.forked()) s_->abort(e);
}

/// What a transport gets from its group, instead of the group's plumbing: rank, size, timeout,
/// the group's id, a channel of its own, the group's store and failure verdict, and a handle
/// that keeps the group open for as long as the transport lives. Built from a `process_group`
/// (implicitly, so `ddp::tcp t{pg}` and `ddp::shm s{pg}` read as they always did); a transport
/// opens its connections with it (`detail::open_links(ctx, prefix, bufsize)`).
///
/// Building one takes the group's next channel: every rank must build its transports in the
/// same order (as it must build them at all: their construction is collective).
/// \code
/// class my_transport {
///  public:
///   explicit my_transport(ddp::transport_context ctx) : ctx_(std::move(ctx)) {}
///   ...
/// };
/// \endcode
class transport_context {
 public:
  /// errc::usage on an empty handle or in a forked child.
  transport_context(process_group& pg)  // NOLINT(google-explicit-constructor): a group is a context
      : pg_(pg) {
    auto& st = pg_.live("transport_context");
    channel_ = st.next_channel_id();
    verdict_ = &st.verdict();
  }

  int rank() const noexcept { return pg_.rank(); }
  int size() const noexcept { return pg_.size(); }
  std::chrono::milliseconds timeout() const noexcept { return pg_.timeout(); }
  deadline_t deadline() const { return pg_.deadline(); }
  /// The group's id, agreed at rendezvous (distinguishes this group's connections).
  std::uint64_t group_id() const noexcept { return pg_.id(); }
  /// This transport's channel: a number unique in the group, the same on every rank. It names
  /// the transport's keys in the store and its shared segments.
  int channel() const noexcept { return channel_; }
  /// The transport's own handle on the group (collectives during setup: all_gather, barrier).
  process_group& group() noexcept { return pg_; }
  /// The group's store (hosted by rank 0): where a transport's ranks announce addresses.
  store_client& store() { return pg_.store(); }
  /// The group's failure verdict: record a failure, read the first one, judge a failed link.
  failure_verdict& verdict() noexcept { return *verdict_; }

 private:
  process_group pg_;
  int channel_ = 0;
  failure_verdict* verdict_ = nullptr;  // the group's; lives as long as pg_ does
};

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
  const auto until = steady_clock::now() + opts.timeout;
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
    pg.server_ = std::make_unique<store_server>(endpoint{opts.master_addr, opts.master_port}, 0, auth, store_limits{},
                                                "pg/rank/", static_cast<std::uint32_t>(opts.world_size));
  pg.store_ = std::make_unique<store_client>(opts.master_addr, opts.master_port, rank, until, auth);
  auto& st = *pg.store_;

  pg.group_id_ =
      detail::join_store(st,
                         {rank, opts.world_size, opts.job_id, opts.master_addr + ":" + std::to_string(opts.master_port),
                          static_cast<long long>(opts.timeout.count())},
                         until);
  pg.verdict_ = failure_verdict(pg.store_.get(), rank, opts.world_size, opts.timeout);
  pg.links_ = detail::open_links(st, pg.group_id_, rank, opts.world_size, opts.timeout, "pg/mesh", 0,
                                 [v = &pg.verdict_] { return v->recorded(); });
  // The first barrier makes each rank's first connections (log2(size) peers) and proves the
  // group can talk; a failure there is reported like any other.
  pg.barrier(until);
  // Under a launcher that ends a host's ranks when one fails (ddprun --nnodes), the launcher
  // says first which rank failed: recorded as the group's failure, so that the other hosts
  // name that rank rather than the ranks the launcher ended.
  if (const int fd = detail::launcher_fd(); fd >= 0)
    pg.launcher_ = std::make_unique<detail::launcher_watch>(fd, [v = &pg.verdict_](const std::string& note) {
      if (!note.empty()) v->record(group_failure::decode(note));
    });
  return process_group(std::move(group));
}

}  // namespace v0
}  // namespace ddp
