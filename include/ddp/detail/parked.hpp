#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// What one generation of an elastic group leaves behind in this process for the next one to
// take over: `ddp::shm` parks its mapped segment when it goes (reducer/shm.hpp), the next
// `ddp::shm` built here takes it and reuses it when every rank of its segment can (no page
// freed, allocated, zeroed or faulted in again), and the elastic group drops whatever nobody
// took once a generation has formed (group/elastic.hpp). One object at a time: parking another
// drops the one before; a forked child never takes its parent's.
//
//   detail::park(std::make_unique<my_thing>(...));            // in a destructor
//   auto p = detail::take_parked();                          // in the next constructor
//   if (auto* mine = dynamic_cast<my_thing*>(p.get())) ...   // else it is dropped with p
//   detail::drop_parked();                                   // nobody took it

#include <unistd.h>

#include <memory>
#include <mutex>
#include <utility>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Something parked: its destructor releases it.
struct parked_object {
  parked_object() : owner(::getpid()) {}
  parked_object(const parked_object&) = delete;
  parked_object& operator=(const parked_object&) = delete;
  virtual ~parked_object() = default;
  pid_t owner;  ///< the process that parked it
};

struct parking_lot {
  std::mutex mu;
  std::unique_ptr<parked_object> slot;
};
inline parking_lot& parking() {
  static parking_lot lot;
  return lot;
}

/// Parks `p`; what was parked before is released (outside the lock).
inline void park(std::unique_ptr<parked_object> p) noexcept {
  std::unique_ptr<parked_object> old;
  {
    std::lock_guard lock(parking().mu);
    old = std::exchange(parking().slot, std::move(p));
  }
}

/// What is parked, taken out (null when nothing is, or when it is a parent's, seen in a forked
/// child: that one is dropped).
inline std::unique_ptr<parked_object> take_parked() noexcept {
  std::unique_ptr<parked_object> p;
  {
    std::lock_guard lock(parking().mu);
    p = std::move(parking().slot);
  }
  if (p && p->owner != ::getpid()) p.reset();
  return p;
}

/// Releases what is parked.
inline void drop_parked() noexcept { take_parked().reset(); }

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
