#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// TCP sockets with deadlines: every blocking call polls with the time left, so a silent peer
// turns into errc::timeout and a closed one into errc::peer_lost instead of a hang.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/clock.hpp>
#include <ddp/detail/fd.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

using clock = ddp::steady_clock;
using ddp::deadline_t;

/// Milliseconds until `d`, for one poll: capped at 1,000,000, so a loop that polls must check
/// the deadline again when poll returns 0 rather than take it for the deadline.
inline int ms_left(deadline_t d) noexcept {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(d - clock::now()).count();
  if (left <= 0) return 0;
  return left > timing::poll_cap_ms ? static_cast<int>(timing::poll_cap_ms) : static_cast<int>(left);
}

inline void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

inline void tune_stream(int fd, int bufsize = 4 << 20) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  if (bufsize > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bufsize, sizeof bufsize);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bufsize, sizeof bufsize);
  }
}

/// Strips the brackets of "[::1]".
inline std::string strip_brackets(const std::string& host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') return host.substr(1, host.size() - 2);
  return host;
}

struct endpoint {
  sockaddr_storage addr{};
  socklen_t len = 0;
};

/// Resolves host (name, IPv4 or IPv6) and port; errc::unresolvable when nothing is found.
inline std::vector<endpoint> resolve(const std::string& host, int port, int rank, bool passive = false) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* res = nullptr;
  const std::string h = strip_brackets(host);
  const std::string p = std::to_string(port);
  const int rc = ::getaddrinfo(h.empty() ? nullptr : h.c_str(), p.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    raise(errc::unresolvable, rank, "cannot resolve master address '" + host + "': " + ::gai_strerror(rc));
  }
  std::vector<endpoint> out;
  for (addrinfo* a = res; a; a = a->ai_next) {
    endpoint e;
    std::memcpy(&e.addr, a->ai_addr, a->ai_addrlen);
    e.len = static_cast<socklen_t>(a->ai_addrlen);
    out.push_back(e);
  }
  ::freeaddrinfo(res);
  return out;
}

inline std::string to_string(const sockaddr_storage& a) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(a).sin_addr, buf, sizeof buf);
    return buf;
  }
  ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(a).sin6_addr, buf, sizeof buf);
  return std::string("[") + buf + "]";
}

inline int port_of(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
  return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
}

inline bool is_loopback(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return (ntohl(reinterpret_cast<const sockaddr_in&>(a).sin_addr.s_addr) >> 24) == 127;
  const auto& in6 = reinterpret_cast<const sockaddr_in6&>(a).sin6_addr;
  return IN6_IS_ADDR_LOOPBACK(&in6) != 0;
}

/// Binds and listens; errc::address_in_use when the port is taken.
inline fd_handle listen_on(const endpoint& ep, int rank, int backlog = 128) {
  fd_handle fd(::socket(ep.addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) raise(errc::system, rank, "socket(): " + errno_text(errno));
  int one = 1;
  // SO_REUSEADDR lets a restarted job rebind a port in TIME_WAIT; it does not allow two
  // listeners on one port, so a port really in use still fails with EADDRINUSE.
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&ep.addr), ep.len) != 0) {
    const int e = errno;
    if (e == EADDRINUSE)
      raise(errc::address_in_use, rank,
            "port " + std::to_string(port_of(ep.addr)) + " on " + to_string(ep.addr) +
                " is already in use (another job, or a second rank 0?)");
    raise(errc::system, rank, "bind(" + to_string(ep.addr) + "): " + errno_text(e));
  }
  if (::listen(fd.get(), backlog) != 0) raise(errc::system, rank, "listen(): " + errno_text(errno));
  set_nonblocking(fd.get());
  return fd;
}

inline sockaddr_storage local_address(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return a;
}

/// Tries to connect once, waiting at most until `d`; returns an invalid handle on failure and
/// sets `ec` (connection refused is the normal case while the listener is not up yet).
inline fd_handle try_connect(const endpoint& ep, deadline_t d, std::error_code& ec) {
  fd_handle fd(::socket(ep.addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) {
    ec.assign(errno, std::generic_category());
    return {};
  }
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&ep.addr), ep.len) != 0) {
    if (errno != EINPROGRESS) {
      ec.assign(errno, std::generic_category());
      return {};
    }
    pollfd p{fd.get(), POLLOUT, 0};
    int r = 0;
    for (int left = ms_left(d); r == 0 && left > 0; left = ms_left(d)) r = ::poll(&p, 1, left);
    if (r <= 0) {
      ec = make_error_code(errc::timeout);
      return {};
    }
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      ec.assign(err, std::generic_category());
      return {};
    }
  }
  ec.clear();
  return fd;
}

/// The pause between attempts to reach a listener (a peer's, the store's): connect_backoff,
/// doubled each time up to connect_backoff_max, never past a deadline.
class backoff {
 public:
  /// Sleeps the next pause and returns true; false, without sleeping, when the pause would reach
  /// `until`.
  bool pause(deadline_t until) {
    if (clock::now() + next_ >= until) return false;
    std::this_thread::sleep_for(next_);
    next_ = std::min<std::chrono::nanoseconds>(next_ * 2, timing::connect_backoff_max);
    return true;
  }

 private:
  std::chrono::nanoseconds next_ = timing::connect_backoff;
};

/// Connects, retrying until `d` (the listener may start later than we do).
inline fd_handle connect_retry(const std::vector<endpoint>& eps, deadline_t d, std::error_code& ec) {
  backoff wait;
  for (;;) {
    for (const auto& ep : eps) {
      auto fd = try_connect(ep, d, ec);
      if (fd) return fd;
    }
    if (!wait.pause(d)) {
      if (!ec) ec = make_error_code(errc::timeout);
      return {};
    }
  }
}

/// Accepts one connection before `d`, or returns an invalid handle with ec = timeout.
inline fd_handle accept_until(int listen_fd, deadline_t d, std::error_code& ec) {
  for (;;) {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      ec.clear();
      return fd_handle(fd);
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      ec.assign(errno, std::generic_category());
      return {};
    }
    pollfd p{listen_fd, POLLIN, 0};
    const int left = ms_left(d);
    if (left == 0) {
      ec = make_error_code(errc::timeout);
      return {};
    }
    ::poll(&p, 1, left);
  }
}

/// Sends all bytes before `d`. ec: timeout, peer_lost (EPIPE/ECONNRESET) or errno.
inline void send_all(int fd, const void* data, std::size_t n, deadline_t d, std::error_code& ec) noexcept {
  auto p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd pf{fd, POLLOUT, 0};
      const int left = ms_left(d);
      if (left == 0) {
        ec = make_error_code(errc::timeout);
        return;
      }
      ::poll(&pf, 1, left);  // 0 (capped wait over, or the deadline): the loop checks again
      continue;
    }
    ec = (errno == EPIPE || errno == ECONNRESET) ? make_error_code(errc::peer_lost)
                                                 : std::error_code(errno, std::generic_category());
    return;
  }
  ec.clear();
}

/// Receives exactly n bytes before `d`. ec: timeout, peer_lost (EOF/ECONNRESET) or errno.
inline void recv_all(int fd, void* data, std::size_t n, deadline_t d, std::error_code& ec) noexcept {
  auto p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= static_cast<std::size_t>(k);
      continue;
    }
    if (k == 0) {
      ec = make_error_code(errc::peer_lost);
      return;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd pf{fd, POLLIN, 0};
      const int left = ms_left(d);
      if (left == 0) {
        ec = make_error_code(errc::timeout);
        return;
      }
      ::poll(&pf, 1, left);  // 0 (capped wait over, or the deadline): the loop checks again
      continue;
    }
    ec = errno == ECONNRESET ? make_error_code(errc::peer_lost) : std::error_code(errno, std::generic_category());
    return;
  }
  ec.clear();
}

/// Describes an error_code from the functions above for a message.
inline std::string describe(const std::error_code& ec) {
  if (ec.category() == ddp_category()) return errc_name(static_cast<errc>(ec.value()));
  return ec.message();
}

/// Maps an error_code to the errc a caller should raise.
inline errc to_errc(const std::error_code& ec) {
  if (ec.category() == ddp_category()) return static_cast<errc>(ec.value());
  return errc::system;
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
