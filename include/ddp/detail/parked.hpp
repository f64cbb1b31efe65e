#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// What one generation of an elastic group leaves behind in this process for the next one to
// take over: `ddp::shm` parks its mapped segment when it goes (reducer/shm.hpp), the next
// `ddp::shm` built here takes it and reuses it when every rank of its segment can (no page
// freed, allocated, zeroed or faulted in again), and the elastic group drops whatever nobody
// took once a generation has formed (group/elastic.hpp). The sharded wrapper parks its shards
// the same way (data_parallel/detail/shard_ops.hpp), which the next one must take. One object
// of each kind at a time: parking another of its kind drops the one before; a forked child
// never takes its parent's.
//
//   detail::park(std::make_unique<my_thing>(...));            // in a destructor
//   auto p = detail::take_parked<my_thing>();                // in the next constructor (or null)
//   detail::drop_parked();                                   // nobody took them

#include <unistd.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Something parked: its destructor releases it.
struct parked_object {
  parked_object() : owner(::getpid()) {}
  parked_object(const parked_object&) = delete;
  parked_object& operator=(const parked_object&) = delete;
  virtual ~parked_object() = default;
  /// Non-empty for an object that the next generation must take: what dropping it untaken
  /// means (the elastic group raises it).
  virtual std::string untaken() const { return {}; }
  pid_t owner;  ///< the process that parked it
};

struct parking_lot {
  std::mutex mu;
  std::vector<std::unique_ptr<parked_object>> slots;  // one of each dynamic type
};
inline parking_lot& parking() {
  static parking_lot lot;
  return lot;
}

/// Parks `p`; what was parked before of its kind is released (outside the lock).
inline void park(std::unique_ptr<parked_object> p) noexcept {
  if (!p) return;
  std::unique_ptr<parked_object> old;
  try {
    std::lock_guard lock(parking().mu);
    auto& slots = parking().slots;
    const auto same = std::find_if(slots.begin(), slots.end(), [&](const auto& q) { return typeid(*q) == typeid(*p); });
    if (same != slots.end())
      old = std::exchange(*same, std::move(p));
    else
      slots.push_back(std::move(p));
  } catch (...) {  // no memory for the slot: p goes now
  }
}

/// The parked object of type `T`, taken out (null when none is, or when it is a parent's, seen
/// in a forked child: that one is dropped).
template <class T>
std::unique_ptr<T> take_parked() noexcept {
  std::unique_ptr<parked_object> p;
  {
    std::lock_guard lock(parking().mu);
    auto& slots = parking().slots;
    const auto it = std::find_if(slots.begin(), slots.end(), [](const auto& q) { return typeid(*q) == typeid(T); });
    if (it == slots.end()) return nullptr;
    p = std::move(*it);
    slots.erase(it);
  }
  if (p->owner != ::getpid()) return nullptr;
  return std::unique_ptr<T>(static_cast<T*>(p.release()));
}

/// Releases everything parked; returns what an object that had to be taken says about it
/// (`parked_object::untaken`), empty when none.
inline std::string drop_parked() noexcept {
  std::vector<std::unique_ptr<parked_object>> all;
  {
    std::lock_guard lock(parking().mu);
    all.swap(parking().slots);
  }
  std::string said;
  for (const auto& p : all)
    if (p->owner == ::getpid()) try {
        if (said.empty()) said = p->untaken();
      } catch (...) {
      }
  return said;
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
