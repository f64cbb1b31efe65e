// ring<T> over a transport without the iovec sendrecv (only the plain one) is rejected where the
// reducer is named, and the diagnostic names the missing requirement.
#include <ddp/reducer/ring.hpp>

struct plain_only {
  explicit plain_only(ddp::process_group&) {}
  int rank() const { return 0; }
  int size() const { return 1; }
  void send(int, const void*, std::size_t, ddp::deadline_t) {}
  void recv(int, void*, std::size_t, ddp::deadline_t) {}
  void sendrecv(int, const void*, std::size_t, int, void*, std::size_t, ddp::deadline_t) {}
  [[noreturn]] void fail(ddp::errc, const std::string&) { throw 0; }
  void abort() noexcept {}
};

void f(ddp::process_group& pg) { ddp::ring<plain_only> r{pg}; }
