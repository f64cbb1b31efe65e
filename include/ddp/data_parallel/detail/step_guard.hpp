#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/step_guard.hpp
/// `step_guard`: runs the parts of the wrapper's calls that change step state, keeps the first
/// failure (`failure_latch`) and, for a cause on this rank, fails the reducer's transport and the
/// group with it, so that peers blocked on this rank fail now, naming it and quoting the cause
/// where the reducer can carry it, not at a deadline.
// IWYU pragma: private

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/concepts.hpp>
#include <ddp/data_parallel/detail/failure_latch.hpp>
#include <ddp/error.hpp>
#include <ddp/process_group.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// The collectives of the step record and the buffers bypass a communication hook
/// (ddp::hooked): hooks are for gradient buckets. They are issued only once every bucket has
/// been waited for, so the hook's queue holds nothing of the wrapper's then.
template <class Reducer>
auto& plain_reducer(Reducer& red) noexcept {
  if constexpr (requires { red.inner(); })
    return red.inner();
  else
    return red;
}

/// The wrapper's failure state and the one way its step-changing parts run. Holds references to
/// the wrapper's parameter names, step counter, reducer and group, which outlive it.
template <class Reducer>
class step_guard {
 public:
  step_guard(const std::vector<std::string>& names, const std::uint64_t& step, Reducer& red, process_group& pg) noexcept
      : names_(names), step_(step), red_(red), pg_(pg) {}

  /// Raises the first failure on `rank`, once there is one.
  void check(int rank) const { failure_.check(rank); }

  /// Runs `body`, the part of a call named `what` (for parameter `param`, < 0: none). An
  /// exception from it leaves the step half done, which no later call could repair: the wrapper
  /// fails for good, and for a cause on this rank (`tell_peers`) the reducer's transport and the
  /// group fail with it.
  template <class F>
  void operator()(const char* what, std::ptrdiff_t param, F&& body, bool tell_peers = true) {
    const auto i = static_cast<std::size_t>(param);
    failure_.guard(what, param, param >= 0 && i < names_.size() ? std::string_view(names_[i]) : "", step_, tell_peers,
                   body, [this](const std::string& msg) noexcept { fail_peers(msg); });
  }

  /// Fails the reducer's transport and the group with `msg`, which the peers' errors quote.
  void fail_peers(const std::string& msg) noexcept {
    if constexpr (reducer_with_failable_transport<Reducer>)
      detail::exception_of([&] { red_.transport().fail(errc::aborted, msg); });  // tcp: to the peers
    if constexpr (requires {
                    { red_.abort(errc::aborted, msg) }
                    noexcept;
                  })
      red_.abort(errc::aborted, msg);  // the reducer carries the cause (auto_reducer's shm)
    else
      abort_reducer();
    pg_.abort(msg);
  }

  /// The wrapper's destructor, unwinding in the middle of a step: the peers, which wait for
  /// this rank's collectives and can no longer complete them, learn why before the reducer's
  /// transports close.
  void leave_unfinished() noexcept {
    try {
      errc code{};
      std::string msg;
      if (latest_live_error(code, msg))
        fail_peers("left step " + std::to_string(step_) + " unfinished on its error (" + std::string(errc_name(code)) +
                   "): " + msg);
    } catch (...) {  // no memory for the message: the transports close as they would
    }
  }

  void abort_reducer() noexcept {
    if constexpr (reducer_with_abort<Reducer>) red_.abort();
  }

 private:
  const std::vector<std::string>& names_;
  const std::uint64_t& step_;
  Reducer& red_;
  process_group& pg_;
  failure_latch failure_;  // the first failure: every later call raises it
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
