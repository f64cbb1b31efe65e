// Pretend hosts for the tests of the default and hierarchical reducers: DDP_HOST_ID, set in each
// forked rank, says which ranks form a host (tests/netns runs real network namespaces).
#pragma once

#include <stdlib.h>

#include <chrono>
#include <stdexcept>
#include <string>

#include <ddp/process_group.hpp>

#include "harness.hpp"

namespace ddp_test {

/// Puts rank r on host hosts[r] ("aabb": ranks 0, 1 on host a); a space leaves DDP_HOST_ID
/// unset (the machine's own identity).
inline void on_host(const std::string& hosts, int r) {
  const char c = hosts[static_cast<std::size_t>(r)];
  if (c == ' ')
    ::unsetenv("DDP_HOST_ID");
  else
    ::setenv("DDP_HOST_ID", std::string(1, c).c_str(), 1);
}

/// Rank r of n on localhost:port, asking for backend `b`.
inline ddp::init_options backend_options(int rank, int n, int port, std::chrono::milliseconds timeout,
                                         ddp::backend b = ddp::backend::automatic) {
  auto o = group_options(rank, n, port, timeout);
  o.backend = b;
  return o;
}

/// Throws `what` unless `cond` (a child's failure, reported to the parent by run_ranks).

}  // namespace ddp_test
