#pragma once
/// \file group/verdict.hpp
/// The failure verdict of a group, written once for the group and every transport on it: the
/// first failure any rank records in the group's store is everyone's error, so all ranks of a
/// failed step report the same cause; after a timeout the ranks find together which rank
/// stopped, so that a rank that was only waiting is never blamed. See docs/process-group.md.
///
/// A transport gets the group's verdict from its `ddp::transport_context`:
/// \code
/// auto& v = ctx.verdict();
/// if (auto f = v.first(); !f.empty()) throw ddp::error(f.code, ctx.rank(), f.text);
/// \endcode

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/detail/socket.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/error.hpp>
#include <ddp/group/store_client.hpp>
#include <ddp/group/detail/keys.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// The group's failure record and the judgement on a failed link, for one rank. One per group,
/// shared by the group and every transport on it (through `transport_context::verdict()`).
/// Thread-safe as the store client is. In a child made by fork() it touches nothing: records
/// are not written, and nothing is found recorded.
class failure_verdict {
 public:
  /// A verdict without a store: records nothing, finds nothing.
  failure_verdict() = default;
  /// The verdict of rank `rank` of a group of `size`, kept in `store` (the group's store, which
  /// must outlive it or be detached first); `timeout` is the group's.
  /// `launcher_store`: the store is served by the launcher (init_options::external_store), not
  /// by rank 0, so a store that does not answer is no verdict on rank 0.
  failure_verdict(kv_store* store, int rank, int size, std::chrono::milliseconds timeout,
                  bool launcher_store = false) noexcept
      : store_(store), rank_(rank), size_(size), timeout_(timeout), launcher_store_(launcher_store) {}

  /// Forgets the store (it is closing): later calls record and find nothing.
  void detach() noexcept { store_ = nullptr; }

  /// "rank <this rank> reports: <msg>": the text of a failure this rank saw itself.
  std::string reported(const std::string& msg) const { return "rank " + std::to_string(rank_) + " reports: " + msg; }

  /// `msg` as the group records it: as it is when it names the rank it came from already (a
  /// verdict this rank adopted), else as this rank's own report.
  /// Its origin is the rank it names, or this one.
  group_failure as_recorded(errc code, const std::string& msg) const {
    const int from = reporter(msg);
    return {code, from >= 0 ? msg : reported(msg), -1, from >= 0 ? from : rank_};
  }

  /// True when `text` is a failure as the group records it, naming the rank it came from
  /// ("rank 2 reports: ...", "rank 2 left the group ...", "group aborted by rank 2: ..."): a
  /// rank that relays it quotes it as it is, rather than as its own report.
  static bool names_reporter(const std::string& text) noexcept { return reporter(text) >= 0; }

  /// The rank that `text` names as where it came from (see names_reporter), or -1.
  static int reporter(const std::string& text) noexcept {
    const bool aborted = text.rfind("group aborted by rank ", 0) == 0;
    if (!aborted && text.rfind("rank ", 0) != 0) return -1;
    const std::size_t from = aborted ? 22 : 5;
    std::size_t i = from;
    int rank = 0;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9' && rank < 100000000)
      rank = rank * 10 + (text[i++] - '0');
    if (i == from) return -1;
    if (aborted) return rank;
    return text.compare(i, 10, " reports: ") == 0 || text.compare(i, 15, " left the group") == 0 ? rank : -1;
  }

  /// Records `f` as the group's first failure unless one is recorded already, and returns the
  /// one that holds: the first writer wins, so every rank that reads it before composing its
  /// own error reports the same cause. Returns `f` when the store does not answer.
  group_failure record(const group_failure& f) noexcept {
    if (owner_.forked()) return f;
    try {
      if (!store_) return f;
      auto held = group_failure::decode(store_->compare_set(failure_key, "", f.encode(), store_budget()));
      note_read();
      return held;
    } catch (...) {
      return f;
    }
  }

  /// The group's first failure, or an empty one; sets *store_gone when the store does not answer.
  /// With `linger`, waits up to min(200 ms, timeout / 8) for one to be recorded: a peer whose
  /// connection just closed records its failure before it closes, but a peer that leaves by
  /// an exception records it while it unwinds, which may come a moment later.
  group_failure first(bool* store_gone = nullptr, bool linger = false) noexcept {
    if (owner_.forked()) return {};
    const auto end = steady_clock::now() +
                     (linger ? std::min<std::chrono::milliseconds>(detail::timing::failure_linger, timeout_ / 8)
                             : std::chrono::milliseconds(0));
    try {
      for (;;) {
        const auto until = store_budget();
        if (store_ && store_->check(failure_key, until)) {
          auto f = group_failure::decode(store_->get(failure_key, until));
          note_read();
          return f;
        }
        if (!store_ || steady_clock::now() >= end) break;
        std::this_thread::sleep_for(detail::timing::failure_poll);
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

  /// How many ranks have read (or recorded) the group's failure: the store's host waits for
  /// all of them before it closes (group/detail/close_rules.hpp), so that none of them finds
  /// the store gone and blames rank 0 instead of the failure. -1 when the store does not answer.
  int readers() noexcept {
    if (!store_ || owner_.forked()) return -1;
    try {
      return static_cast<int>(store_->add(readers_key, 0, store_budget()));
    } catch (...) {
      return -1;
    }
  }

  /// True when a rank recorded a failure, or the store does not answer (a quick check, for
  /// waits that cannot see the failure otherwise, such as waiting for a peer to connect).
  bool recorded() noexcept {
    if (owner_.forked()) return false;
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

  /// Leaves `text` (empty: removes it) where the peers' timeouts quote it: this rank's error
  /// that did not fail the group (a misuse the rank may still repair, such as finish() with a
  /// parameter missing), so that a peer left waiting for this rank says why. Best effort.
  void note_error(const std::string& text) noexcept {
    if (!store_ || owner_.forked()) return;
    try {
      if (text.empty())
        (void)store_->erase(note_key(rank_), store_budget());
      else
        store_->set(note_key(rank_), text, store_budget());
    } catch (...) {
    }
  }
  /// " (its last error: ...)" when rank `peer` left one (note_error), else "". Best effort.
  std::string noted_error(int peer) noexcept {
    if (!store_ || owner_.forked()) return {};
    try {
      const auto until = store_budget();
      if (!store_->check(note_key(peer), until)) return {};
      return " (its last error: " + store_->get(note_key(peer), until) + ")";
    } catch (...) {
      return {};
    }
  }

  /// What to report for an error met while connecting to peers (a peer that never connected,
  /// a connection refused or lost): the group's first failure when a rank recorded one; "rank 0
  /// is lost" when its store does not answer either (the peer that never connected may have
  /// failed on the store too: it is not the one to blame); else the error itself.
  group_failure explain(const error& e) noexcept {
    if (owner_.forked()) return {e.condition(), detail::message_of(e)};
    try {
      const auto code = e.condition();
      if (code != errc::timeout && code != errc::peer_lost) return {code, detail::message_of(e)};
      bool store_gone = false;
      if (auto f = first(&store_gone); !f.empty()) return f;
      if (store_gone) return {errc::peer_lost, store_lost(detail::message_of(e))};
      return {code, detail::message_of(e)};
    } catch (...) {
      return {e.condition(), {}};
    }
  }

  /// The verdict on a failed link to `peer` (`ec` says how it failed; `why`, when given, says it
  /// better than `ec`): the failure this rank must raise, and whether it is another rank's.
  struct link_verdict {
    group_failure failure;  ///< adopted: the recorded text; else this rank's own sentence
    bool adopted = false;   ///< true: a rank recorded it first (raise its text as it is)
  };

  /// Judges a failed link: the group's first failure when a rank recorded one (the peer that
  /// closed the connection may still be recording why: for a closed link it is waited for
  /// briefly); else "rank 0 is lost" when its store does not answer either (`noticed` says
  /// where this rank noticed: "waiting for rank 3"); else, after a timeout, the rank that
  /// stopped (name_stopped); else the lost peer. This rank's own verdict is
  /// recorded, and when another rank's was recorded meanwhile, that one is returned instead:
  /// the first one is everyone's. `ended`: the peer's process has ended (seen on its pid), so
  /// whatever it recorded is there already and nothing is waited for.
  link_verdict judge(int peer, const std::error_code& ec, const std::string& noticed, const std::string& why = {},
                     bool ended = false) {
    bool store_gone = false;
    const bool timed_out = detail::to_errc(ec) == errc::timeout;
    if (auto f = first(&store_gone, !timed_out && !ended); !f.empty()) return {f, true};
    std::string msg;
    if (store_gone) {
      // The store does not answer either: its host is the one lost (rank 0, unless the
      // launcher serves it), whatever connection happened to notice first.
      msg = store_lost("noticed " + noticed);
    } else if (timed_out) {
      msg = name_stopped(waits_prefix, peer);
    } else {
      msg = !why.empty() ? why : "lost connection to rank " + std::to_string(peer) + " (" + detail::describe(ec) + ")";
    }
    const errc code = timed_out && !store_gone ? errc::timeout : errc::peer_lost;
    // Another rank may have recorded its verdict meanwhile: the first one is everyone's.
    if (const auto held = record({code, reported(msg), -1, rank_}); held.text != reported(msg)) return {held, true};
    return {{code, msg}, false};
  }

  /// Bound of a store round trip made while failing: short, because the store's host (rank 0)
  /// may be the rank that is gone.
  deadline_t store_budget() const {
    return steady_clock::now() +
           std::min<std::chrono::milliseconds>(detail::timing::failure_store_budget, timeout_ / 8);
  }

  /// Where every rank's "waits for" record lives: one place for the whole group, whichever
  /// engine waited (the group's own links, tcp, shared memory), so that a chain crosses from
  /// one engine to another (a host's leader waiting over tcp for a leader that waits in shared
  /// memory for a rank of its host).
  static constexpr const char* waits_prefix = "pg";

  /// Records ahead of any deadline that this rank has been waiting for group rank `peer` for a
  /// while (shared memory does after min(1 s, timeout / 4), detail::timing), so that a rank
  /// whose own deadline ends first follows it to the rank that stopped instead of blaming this
  /// one; `peer < 0` withdraws the record once the wait ended. Best effort: when the store does
  /// not answer, the timeout's own verdict (name_stopped) says so.
  void note_waiting(int peer) noexcept {
    if (!store_ || owner_.forked()) return;
    try {
      const std::string key = waiting_key(waits_prefix, rank_);
      if (peer < 0)
        store_->erase(key, store_budget());
      else
        store_->set(key, std::to_string(peer), store_budget());
    } catch (...) {
    }
  }

  /// After a timeout, finds who stopped: the rank this one waits for (`peer`) may itself wait
  /// for another. Every rank that times out records under `prefix` whom it waits for; the
  /// chain of those records, from `peer` on, ends at the rank that stopped (frozen, swapping,
  /// or stuck outside ddp): a rank that is itself only waiting is never blamed. A rank at the
  /// end of the chain gets a grace of min(1 s, timeout / 4) to record that it waits too (its
  /// own deadline may come a little later). When the store (rank 0) does not answer either,
  /// rank 0 is the one. Returns the sentence for the error.
  std::string name_stopped(const std::string& prefix, int peer) {
    owner_.check(rank_, "process_group (name_stopped())");
    const std::string waited = "rank " + std::to_string(rank_) + " waited for rank " + std::to_string(peer);
    const std::string store_silent = "rank 0 stopped answering (its store does not reply; " + waited + ")";
    if (!store_) return "rank " + std::to_string(peer) + " did not answer within the deadline";
    try {
      store_->set(waiting_key(prefix, rank_), std::to_string(peer), store_budget());
    } catch (const error&) {
      return store_silent;
    }
    const auto grace = std::min<std::chrono::milliseconds>(detail::timing::stopped_grace, timeout_ / 4);
    const auto end = steady_clock::now() + grace;
    // Small groups read every rank's record, so the search can end as soon as the chain's end is
    // the only rank left silent; large ones read only the records along the chain (a thousand
    // ranks timing out together must not each read a thousand keys), and give its end the grace.
    const bool scan_all = size_ <= 64;
    std::unordered_map<int, int> waits_for{{rank_, peer}};
    auto record_of = [&](int r) {
      auto it = waits_for.find(r);
      if (it != waits_for.end()) return it->second;
      const std::string key = waiting_key(prefix, r);
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
      // Certain once the chain's end is the only rank left silent; else wait out the grace,
      // unless a rank records the group's failure meanwhile: judge() then adopts that one, read
      // while the store is still there (its host, rank 0, leaves soon after it failed).
      if (chain.back() < 0 || (scan_all && silent <= 1) || steady_clock::now() >= end) break;
      try {
        if (store_->check(failure_key, store_budget())) break;
      } catch (const error&) {
        return store_silent;
      }
      std::this_thread::sleep_for(detail::timing::stopped_poll);
    }
    // chain: peer, whom peer waits for, ... ending at a silent rank, or at -1 after a cycle.
    std::string via = waited;
    for (std::size_t i = 1; i < chain.size() && chain[i] >= 0; ++i)
      via += ", which waited for rank " + std::to_string(chain[i]);
    if (chain.back() < 0) {
      std::string ring;
      for (std::size_t i = 0; i + 1 < chain.size(); ++i) ring += (ring.empty() ? "" : ", ") + std::to_string(chain[i]);
      return "ranks " + ring + " wait for each other and none of them stopped (" + via + "): their calls do not match";
    }
    return "rank " + std::to_string(chain.back()) + " stopped answering within the deadline (" + via + ")" +
           noted_error(chain.back());
  }

 private:
  static constexpr const char* failure_key = detail::keys::failure;
  static constexpr const char* readers_key = detail::keys::failure_readers;

  /// Counts this rank once among the failure's readers (readers()). Not for a launcher's store:
  /// it outlives every rank, and nobody waits for the count.
  void note_read() noexcept {
    if (launcher_store_ || read_.exchange(true)) return;
    try {
      (void)store_->add(readers_key, 1, store_budget());
    } catch (...) {
    }
  }

  /// The sentence for a store that does not answer: rank 0 lost when it hosts the store.
  std::string store_lost(const std::string& how) const {
    return launcher_store_ ? (store_ != nullptr ? store_->where() : std::string("the group's store")) +
                                 " does not answer (" + how + ")"
                           : "rank 0 is lost (its store does not answer; " + how + ")";
  }
  /// The store key of rank `r`'s "waits for" record under `prefix`.
  static std::string waiting_key(const std::string& prefix, int r) { return detail::keys::waiting(prefix, r); }
  /// The store key of rank `r`'s last error (note_error).
  static std::string note_key(int r) { return detail::keys::note(r); }

  kv_store* store_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  std::chrono::milliseconds timeout_{0};
  bool launcher_store_ = false;  // the launcher serves the store, not rank 0
  /// Whether this rank counted itself among the failure's readers; a flag that moves with the
  /// verdict (a group assigns its verdict once the store is open).
  struct counted {
    std::atomic<bool> v{false};
    counted() = default;
    counted(const counted& o) noexcept : v(o.v.load()) {}
    counted& operator=(const counted& o) noexcept {
      v.store(o.v.load());
      return *this;
    }
    bool exchange(bool b) noexcept { return v.exchange(b); }
  } read_;
  detail::owner_process owner_;  // the process that joined: a forked child's copy records nothing
};

}  // namespace DDP_ABI
}  // namespace ddp
