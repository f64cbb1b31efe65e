// Pretend hosts for the tests of the default and hierarchical reducers: DDP_HOST_ID, set in each
// forked rank, says which ranks form a host (tests/netns runs real network namespaces).
#pragma once

#include <stdlib.h>

#include <string>

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

}  // namespace ddp_test
