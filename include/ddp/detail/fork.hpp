#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// Objects that own threads, sockets or shared memory remember the process that made them.
// After fork() the child holds copies of them: their threads do not exist in the child, and
// their sockets, store connections and shared segments are still the parent's. In the child
// such an object may only be destroyed, and its destructor then releases only what is the
// child's own (its copies of descriptors and mappings): it joins no thread, shuts down no
// socket, posts nothing to the store and marks nothing in shared memory. Every other call
// raises errc::usage. The rules are in docs/process-group.md.

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// How many fork()s lie between this process and the first one that used ddp: a
/// pthread_atfork handler bumps it in every child, so asking costs one load, not a getpid().
inline unsigned fork_generation() noexcept {
  static std::atomic<unsigned> generation{0};
  [[maybe_unused]] static const int registered =
      ::pthread_atfork(nullptr, nullptr, [] { generation.fetch_add(1, std::memory_order_relaxed); });
  return generation.load(std::memory_order_relaxed);
}

/// The process an object was made in.
class owner_process {
 public:
  owner_process() noexcept : generation_(fork_generation()), pid_(::getpid()) {}

  /// True in a child forked after the object was made: the object is the parent's copy.
  bool forked() const noexcept { return fork_generation() != generation_; }

  /// Raises errc::usage in a forked child; `what` names the object ("ring<tcp>", "process_group").
  void check(int rank, std::string_view what) const {
    if (forked())
      raise(errc::usage, rank,
            std::string(what) + " used in a forked child; it belongs to process " + std::to_string(pid_) +
                " and this is process " + std::to_string(::getpid()) +
                ": a child may only destroy it or exit, and must make its own process group to "
                "communicate (docs/process-group.md)");
  }

 private:
  unsigned generation_;
  pid_t pid_;
};

/// Leaves `p` alive for good, without running its destructor: in a forked child, for state that
/// a thread of the parent may have been using at the fork (a condition variable it waited on
/// would block its destruction forever). Kept reachable, so leak checkers do not report it.
template <class T>
void abandon(std::unique_ptr<T> p) noexcept {
  static std::mutex mu;
  static auto* kept = new std::vector<const void*>;
  try {
    std::lock_guard lock(mu);
    kept->push_back(p.get());
  } catch (...) {
  }
  (void)p.release();
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
