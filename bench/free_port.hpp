#pragma once
// A loopback port that was free a moment ago, for a benchmark's own store (rank 0 binds it next).
#ifndef DDP_ALLOW_DETAIL_HEADERS
#define DDP_ALLOW_DETAIL_HEADERS  // ddp's private socket helpers (ddp/detail/private_check.hpp)
#endif
#include <ddp/detail/socket.hpp>

namespace bench {

inline int free_port() {
  const auto ep = ddp::detail::resolve("127.0.0.1", 0, 0, true).front();
  auto fd = ddp::detail::listen_on(ep, 0, 1);
  return ddp::detail::port_of(ddp::detail::local_address(fd.get()));
}

}  // namespace bench
