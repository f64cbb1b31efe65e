#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// A part of ddp that fails for good keeps its first failure here and quotes it on every later
// call (the wrapper, a hooked reducer, the shared-memory transport); and the one test of
// whether an error is a verdict about the group.

#include <atomic>
#include <mutex>
#include <string>
#include <string_view>

#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Whether `c` is a verdict about the group (a peer lost, a deadline passed, the group
/// aborted): the group's failure machinery has posted it to the peers already, so passing it
/// on again, or blaming the rank that saw it, would only blur who failed first.
constexpr bool is_group_verdict(errc c) noexcept {
  return c == errc::peer_lost || c == errc::timeout || c == errc::aborted;
}

/// The first failure: its code and message, kept once; every later `set` is ignored.
class first_failure {
 public:
  bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }

  /// Keeps `code` and `what` when nothing was kept yet; returns whether it did. Out of memory
  /// for the message still marks the part failed.
  bool set(errc code, std::string_view what) noexcept {
    try {
      std::lock_guard lock(mu_);
      if (failed_.load(std::memory_order_relaxed)) return false;
      code_ = code;
      what_ = what;
      failed_.store(true, std::memory_order_release);
      return true;
    } catch (...) {
      return !failed_.exchange(true, std::memory_order_acq_rel);
    }
  }

  /// The kept code (errc::aborted before any).
  errc code() const {
    std::lock_guard lock(mu_);
    return code_;
  }
  /// The kept message (empty before any).
  std::string what() const {
    std::lock_guard lock(mu_);
    return what_;
  }

  /// Forgets the failure, for a part made afresh (a store client's new connection). Only while
  /// no other thread uses the part.
  void reset() {
    std::lock_guard lock(mu_);
    code_ = errc::aborted;
    what_.clear();
    failed_.store(false, std::memory_order_release);
  }

  /// Raises the kept code on `rank` with `prefix` and the kept message, once failed.
  void check(int rank, std::string_view prefix) const {
    if (!failed()) return;
    std::lock_guard lock(mu_);
    raise(code_, rank, std::string(prefix) + what_);
  }

 private:
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;
  errc code_ = errc::aborted;
  std::string what_;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
