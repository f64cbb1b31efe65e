// Pretend hosts for the tests of the default and hierarchical reducers: DDP_HOST_ID, set in each
// forked rank, says which ranks form a host (tests/netns runs real network namespaces).
#pragma once

#include <stdlib.h>

#include <string>
#include <utility>

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

/// Group options (a local_group) that first put rank r on host hosts[r], for on_ranks:
/// `on_ranks(4, on_hosts("aabb", opts), [&](int r, ddp::process_group& pg) { ... })`.
template <class Options>
auto on_hosts(std::string hosts, Options options) {
  return [hosts = std::move(hosts), options](int r, int n, int port) {
    on_host(hosts, r);
    return options(r, n, port);
  };
}

}  // namespace ddp_test
