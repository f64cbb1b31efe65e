#pragma once
// Helpers shared by the fuzz targets: a check that aborts (so libFuzzer and the replay runner
// both report it as a crash, with the input saved), a reader that splits an input into
// structured pieces, and loopback sockets with short deadlines.

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <ddp/detail/socket.hpp>

namespace ddp_fuzz {

using namespace std::chrono_literals;

/// A property every input must keep; a violation aborts with the reason.
inline void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz property violated: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

inline ddp::detail::deadline_t soon(std::chrono::milliseconds d = 5s) { return ddp::detail::clock::now() + d; }

/// Takes bytes from the front of an input; runs dry gracefully (zeros, empty views), so that
/// every input is a valid instance of the structure.
class reader {
 public:
  reader(const std::uint8_t* data, std::size_t size) : p_(reinterpret_cast<const char*>(data)), n_(size) {}
  std::uint8_t byte() {
    if (n_ == 0) return 0;
    --n_;
    return static_cast<std::uint8_t>(*p_++);
  }
  std::string_view take(std::size_t k) {
    k = k < n_ ? k : n_;
    std::string_view s(p_, k);
    p_ += k;
    n_ -= k;
    return s;
  }
  std::string_view rest() { return take(n_); }
  std::size_t size() const { return n_; }

 private:
  const char* p_;
  std::size_t n_;
};

/// A connection to 127.0.0.1:port, without Nagle's delay: each send leaves at once, so that
/// a harness that sends a piece and then waits for the server sees that piece handled.
inline ddp::detail::fd_handle connect_loopback(int port) {
  std::error_code ec;
  auto fd = ddp::detail::connect_retry(ddp::detail::resolve("127.0.0.1", port, 0), soon(), ec);
  require(static_cast<bool>(fd), "cannot connect over loopback");
  ddp::detail::tune_stream(fd.get(), 0);
  return fd;
}

inline void send_bytes(int fd, std::string_view bytes) {
  std::error_code ec;
  ddp::detail::send_all(fd, bytes.data(), bytes.size(), soon(), ec);
  // The peer may drop us in the middle of our garbage: that is its right.
}

}  // namespace ddp_fuzz
