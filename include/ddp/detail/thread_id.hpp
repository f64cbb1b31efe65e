#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The operating system's id of the calling thread (Linux gettid(): what `top -H`, `perf` and
// trace viewers show), for timeline tracks. Read once per thread and kept: gettid() is a system
// call. A fork() makes the forking thread a new thread of the child, with a new id, so the kept
// value is re-read when the fork generation changed.

#include <sys/types.h>
#include <unistd.h>

#include <ddp/detail/fork.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

inline long os_thread_id() noexcept {
  struct cached {
    unsigned generation = ~0u;
    long id = 0;
  };
  thread_local cached c;
  const unsigned g = fork_generation();
  if (c.generation != g) {
    c.id = static_cast<long>(::gettid());
    c.generation = g;
  }
  return c.id;
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
