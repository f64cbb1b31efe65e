#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// When the process that hosts the group's store may close it: a pure function of what it sees
// (the other connections still open, how many ranks have read the group's failure, how long it
// has waited) that returns the decision and its reason. The group's close() and an elastic
// generation's hosted store gather the snapshot and act on it (group/detail/group_state.hpp,
// group/detail/elastic_env.hpp); tests/unit/test_close_rules.cpp drives it with made-up time.
//
// The promise it keeps: a rank of a failed group reports the failure a rank recorded, never
// "rank 0 is lost" because the store's host left before it could read why. The host stays until
// every rank has read the failure (failure_verdict counts the readers) or left, or until its
// bound, which only a rank that stopped (frozen, or busy outside ddp) makes it wait out.

#include <algorithm>
#include <chrono>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// What the store's host sees while it closes.
struct close_view {
  bool failing = false;                 ///< the group failed: the others need only read why, then go
  int others = 0;                       ///< connections of other ranks still open on its store
  int read_failure = 0;                 ///< ranks that have read the group's failure (the host included)
  int size = 1;                         ///< ranks in the group
  std::chrono::milliseconds waited{0};  ///< since the host began to close
  std::chrono::milliseconds bound{0};   ///< the longest it waits (close_bound)
};

/// The decision: close now, or wait and look again; with the reason, for the flight recorder
/// and the tests.
struct close_decision {
  bool close = false;
  const char* reason = "";
};

inline close_decision decide_close(const close_view& v) noexcept {
  if (v.others <= 0) return {true, "every other rank has left the store"};
  if (v.failing && v.read_failure >= v.size) return {true, "every rank has read the group's failure"};
  if (v.waited >= v.bound)
    return {true, v.failing ? "the bound passed before every rank read the group's failure (a rank stopped?)"
                            : "the bound passed with ranks still connected"};
  return {false, v.failing ? "ranks still connected have not read the group's failure" : "ranks still use the store"};
}

/// The bound of that wait: a whole timeout after a normal close (the others may still be
/// finishing their last collective through the store); min(cap, timeout / 4) when the group
/// failed, so that a rank that stopped and never reads the failure does not hold this rank's
/// error up by a whole timeout.
inline std::chrono::milliseconds close_bound(bool failing, std::chrono::milliseconds timeout,
                                             std::chrono::milliseconds failing_cap) noexcept {
  return failing ? std::min(failing_cap, timeout / 4) : timeout;
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
