#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// What a process group is, apart from its handles: the data that every `ddp::process_group`
// handle on one group shares, and what happens when the last handle lets go of it. The group's
// calls (barrier, broadcast, all_gather, all_reduce, abort) are process_group's own
// (group/process_group.hpp); this holds no second list of them.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <ddp/clock.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/group/detail/close_rules.hpp>
#include <ddp/group/detail/heartbeat.hpp>
#include <ddp/group/detail/launcher.hpp>
#include <ddp/group/detail/link_hub.hpp>
#include <ddp/group/detail/mesh.hpp>
#include <ddp/group/detail/reactor.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/error.hpp>
#include <ddp/group/init_options.hpp>
#include <ddp/group/verdict.hpp>
#include <ddp/group/store_client.hpp>
#include <ddp/group/store_server.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// A group's state; shared by its handles, destroyed (closing the group) with the last one.
struct group_state {
  group_state() = default;
  group_state(const group_state&) = delete;
  group_state& operator=(const group_state&) = delete;
  ~group_state() {
    // In a forked child the members' destructors only close this process's copies of the
    // descriptors: no wait for the other ranks, no store traffic (the store server's own
    // destructor leaves the parent's thread alone).
    if (!owner.forked()) close();
  }

  /// Fails the group, from a user's thread: records `f` in the store (the first failure recorded
  /// wins) and then fans out on the reactor (fan_out), so that the peers woken there find the
  /// record. Returns the failure that holds.
  group_failure fail_now(const group_failure& f) noexcept {
    failed.exchange(true);
    auto held = verdict.record(f);
    fan_out_once(held);
    return held;
  }
  /// Fails the group from the reactor's thread (the heartbeat found a rank frozen or dead, the
  /// launcher's note), which never waits on the store: the record goes to the reactor's courier,
  /// and the fan-out follows it on the reactor. `dead`: the rank the heartbeat found dead (an
  /// elastic group says so in its store first; -1 when none).
  void fail_later(const group_failure& f, int dead = -1) noexcept {
    failed.exchange(true);
    if (dead >= 0) found_dead.store(dead);
    const auto deliver = [this, f, dead] {
      if (dead >= 0) tell_found(dead);
      fan_out_once(verdict.record(f));
    };
    try {
      loop->post_blocking(deliver);
    } catch (...) {
      deliver();  // no room to hand it over: late here rather than never
    }
  }

  /// The failure reaches everything blocked on this group, once, on the reactor's thread: the
  /// mesh shuts (peers blocked on this rank wake), and every transport that watches the group
  /// aborts with the failure that holds, so that collectives blocked here end at once.
  void fan_out_once(const group_failure& held) noexcept {
    if (fanned_out.exchange(true)) return;
    const auto fan_out = [this, &held] {  // call() waits for it: the reference holds
      if (links) links->shutdown();
      std::lock_guard lock(watch_mu);
      for (auto& [id, w] : watchers) try {
          w(held);
        } catch (...) {
        }
    };
    try {
      if (loop)
        loop->call(fan_out);
      else
        fan_out();
    } catch (...) {
      fan_out();  // no room to post it: here rather than never (it is noexcept inside)
    }
  }
  /// Registers `w` for the fan-out; the id unregisters it (unwatch, which waits for a call in
  /// progress, so that a transport's destructor that unwatches first is never called after).
  std::uint64_t watch(std::function<void(const group_failure&)> w) {
    std::lock_guard lock(watch_mu);
    watchers.emplace(next_watch, std::move(w));
    return next_watch++;
  }
  void unwatch(std::uint64_t id) noexcept {
    std::lock_guard lock(watch_mu);
    watchers.erase(id);
  }

  /// Closes connections; rank 0 waits (bounded by the timeout) for the others to leave its
  /// store first. When the group failed (an error posted or raised here, abort(), an
  /// exception on its way out, or a failure any rank recorded) it waits until every rank has
  /// read the failure or left, at most min(close_failing_wait, timeout / 4): a frozen peer,
  /// which never reads it, does not hold this rank's error up by a whole timeout
  /// (group/detail/close_rules.hpp).
  void close() noexcept {
    const bool unwinding = std::uncaught_exceptions() > 0;
    // Leaving because of an exception: tell the peers why (the latest ddp::error alive here,
    // which is the one in flight or the one that caused it), rather than let them find a
    // closed connection and blame this rank.
    if (unwinding && !failed.load() && !aborted.load() && store) {
      try {
        errc code{};
        std::string msg;
        const bool known = detail::latest_live_error(code, msg);
        // An error about the group itself (calls that do not match, a deadline, a lost peer)
        // is the peers' error too and keeps its code; one about this rank alone (a bad
        // argument, a misuse) is errc::aborted for them.
        const bool group_wide = known && (is_group_verdict(code) || code == errc::mismatch);
        fail_now({group_wide ? code : errc::aborted,
                  known ? "rank " + std::to_string(rank) + " left the group on its error (" +
                              std::string(detail::errc_name(code)) + "): " + msg
                        : "rank " + std::to_string(rank) + " left the group while an exception propagated",
                  -1, rank});
      } catch (...) {
      }
    }
    // A failure a transport on the group recorded counts too: a program that caught it and
    // leaves normally must not keep rank 0 waiting a whole timeout for a peer that is gone.
    const bool failing = failed.load() || aborted.load() || unwinding || (server && !verdict.first().empty());
    heartbeat.reset();  // says goodbye to the successor: a normal close is no death
    launcher.reset();
    // The courier's records and the fan-outs still posted finish here, before the links and the
    // store they use go.
    if (loop) loop->stop();
    heartbeat_links.reset();
    links.reset();
    hub.reset();
    if (server) linger(failing);
    verdict.detach();
    store.reset();
    server.reset();
  }

  /// Rank 0 keeps its store up while the others still need it (detail::decide_close): after a
  /// failure until every rank has read why, else until they have left, within the bound.
  void linger(bool failing) noexcept {
    const auto start = steady_clock::now();
    if (failing) (void)verdict.first();  // counts this rank among the readers
    close_view v{.failing = failing,
                 .size = size,
                 .bound = close_bound(failing, opts.timeout, detail::timing::close_failing_wait)};
    for (;;) {
      // This rank's own connection is open unless it broke.
      v.others = server->clients() - (store && !store->unusable() ? 1 : 0);
      v.read_failure = failing && v.others > 0 ? verdict.readers() : 0;
      v.waited = std::chrono::duration_cast<std::chrono::milliseconds>(steady_clock::now() - start);
      if (decide_close(v).close) return;
      std::this_thread::sleep_for(detail::timing::close_poll);
    }
  }

  init_options opts;
  int rank = 0;
  int size = 1;
  std::uint64_t group_id = 0;
  int next_channel = 1;  // the next transport's channel; every rank builds its transports in the same order
  std::atomic<bool> aborted{false};
  std::atomic<bool> failed{false};  // a failure was posted: close() does not wait for the others
  std::atomic<bool> sharded_state{
      false};  // a wrapper keeps state sharded over the ranks, one holder each (note_sharded_state)
  std::atomic<bool> shards_whole{
      false};  // a replicated wrapper's failed step left its shards whole (note_shards_whole)
  /// Set by an elastic group that forms this group from ranks which all hold the live state of
  /// one step (group/elastic.hpp): every rank's parameters are then bitwise equal, and a
  /// wrapper's construction compares hashes instead of broadcasting (expects_equal_state).
  bool equal_state = false;
  /// A generation of an elastic group (group/elastic.hpp): its transports may leave what they
  /// built for the next generation to take over (transport_context::elastic).
  bool elastic = false;
  std::atomic<int> found_dead{-1};  // the predecessor this rank's heartbeat found frozen or dead
  std::atomic<bool> fanned_out{false};
  std::mutex found_mu;  // guards on_found_dead
  /// Told (on the reactor's courier) which rank the heartbeat found frozen or dead, before the
  /// group's failure is recorded: an elastic group says so in its store (group/elastic.hpp).
  std::function<void(int)> on_found_dead;
  void tell_found(int dead) noexcept {
    std::lock_guard lock(found_mu);
    if (on_found_dead) try {
        on_found_dead(dead);
      } catch (...) {
      }
  }
  std::unique_ptr<store_server> server;
  std::unique_ptr<kv_store> store;
  failure_verdict verdict;        // kept in store; detached before it closes
  std::unique_ptr<reactor> loop;  // the rank's background thread (group/detail/reactor.hpp)
  std::unique_ptr<link_hub> hub;  // its one listening port, on the reactor
  std::unique_ptr<peer_links> links;
  std::unique_ptr<launcher_watch> launcher;     // DDP_LAUNCHER_FD: the launcher's note (group/detail/launcher.hpp)
  std::unique_ptr<peer_links> heartbeat_links;  // the heartbeat's ring ("pg/hb"), when init_options::heartbeat
  std::unique_ptr<heartbeat_watch> heartbeat;   // group/detail/heartbeat.hpp
  std::mutex watch_mu;                          // guards watchers
  std::map<std::uint64_t, std::function<void(const group_failure&)>> watchers;  // transports, for the fan-out
  std::uint64_t next_watch = 1;
  owner_process owner;  // the process that joined: a forked child's copy only closes
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
