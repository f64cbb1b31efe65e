#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/failure_latch.hpp
/// The wrapper's first failure (kept once, raised by every later call), and two small helpers
/// of its steps: `exception_of` and the `no_sync()` scope.
// IWYU pragma: private

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <string_view>

#include <ddp/data_parallel/detail/parameters.hpp>
#include <ddp/detail/first_failure.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

class failure_latch {
 public:
  bool failed() const noexcept { return first_.failed(); }

  /// Raises the first failure's errc on `rank`, quoting its cause, once there is one.
  void check(int rank) const {
    first_.check(rank, "this data_parallel wrapper failed earlier and cannot be used again; the first cause: ");
  }

  /// Called inside a catch block: keeps the current exception as the first failure of `what`
  /// for parameter `param` named `name` (`param` < 0: none) at `step`. Returns the message the
  /// peers must be told, or an empty string: when a failure was kept already, or when the cause
  /// is a verdict about the group (peer_lost, timeout, aborted) that its failure machinery has
  /// posted already (blaming this rank would hide the true cause), or when `tell` is false.
  std::string record(const char* what, std::ptrdiff_t param, std::string_view name, std::uint64_t step,
                     bool tell) noexcept {
    try {
      errc code = errc::aborted;
      std::string cause;
      try {
        throw;
      } catch (const error& e) {
        code = e.condition();
        cause = message_of(e);  // without its "[ddp.x] rank N:" prefix: ours comes later
        if (is_group_verdict(code)) tell = false;
      } catch (const std::exception& e) {
        cause = e.what();
      } catch (...) {
        cause = "an exception of unknown type";
      }
      std::string where = what;
      if (param >= 0) where += " for " + parameter_label(static_cast<std::size_t>(param), name);
      std::string msg = "data_parallel failed in " + where + " at step " + std::to_string(step) + ": " + cause;
      if (!first_.set(code, msg)) return {};  // keep the first cause
      return tell ? msg : std::string();
    } catch (...) {
      first_.set(errc::aborted, {});  // out of memory for the message: still failed
      return {};
    }
  }

  /// Runs `body`. An exception from it is recorded (as `record` does) and rethrown; when the
  /// peers must be told, `tell(message)` (noexcept) runs first.
  template <class Body, class Tell>
  void guard(const char* what, std::ptrdiff_t param, std::string_view name, std::uint64_t step, bool tell_peers,
             Body&& body, Tell&& tell) {
    try {
      body();
    } catch (...) {
      const std::string msg = record(what, param, name, step, tell_peers);
      if (!msg.empty()) tell(msg);
      throw;
    }
  }

 private:
  first_failure first_;
};

/// The exception `f()` throws, or null.
template <class F>
std::exception_ptr exception_of(F&& f) noexcept {
  try {
    f();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

/// The RAII scope of `no_sync()`: counts the scopes open on a wrapper.
class [[nodiscard]] depth_guard {
 public:
  explicit depth_guard(int& depth) noexcept : depth_(&depth) { ++depth; }
  depth_guard(depth_guard&& o) noexcept : depth_(o.depth_) { o.depth_ = nullptr; }
  depth_guard(const depth_guard&) = delete;
  depth_guard& operator=(const depth_guard&) = delete;
  depth_guard& operator=(depth_guard&&) = delete;
  ~depth_guard() {
    if (depth_ != nullptr) --*depth_;
  }

 private:
  int* depth_;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
