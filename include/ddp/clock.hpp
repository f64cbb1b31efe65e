#pragma once
/// \file clock.hpp
/// The clock every deadline of ddp is read on, and the deadline type itself. Every blocking
/// call of ddp takes (or derives from the group's timeout) a `ddp::deadline_t`; it is a point
/// on the steady clock, so wall-clock jumps never shorten or lengthen a wait.
///
/// \code
/// #include <ddp/clock.hpp>
/// ddp::deadline_t until = ddp::steady_clock::now() + std::chrono::seconds(30);
/// \endcode

#include <chrono>

#include <ddp/version.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// The steady clock all of ddp's deadlines are read on (named `steady_clock`, not `clock`, so that
/// `using namespace ddp;` never hides `clock()` from <ctime>).
using steady_clock = std::chrono::steady_clock;
/// A deadline: the point on `ddp::steady_clock` past which a blocking call gives up.
using deadline_t = steady_clock::time_point;

}  // namespace DDP_ABI
}  // namespace ddp
