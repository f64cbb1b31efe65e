// ring<T> over a transport whose sendrecv takes its progress callback by non-const lvalue
// reference: the algorithms pass a temporary lambda, so the concept rejects it where the reducer
// is named, rather than the algorithm body failing deep inside.
#include <ddp/reducer/ring.hpp>

struct lvalue_progress {
  explicit lvalue_progress(ddp::process_group&) {}
  int rank() const { return 0; }
  int size() const { return 1; }
  void send(int, const void*, std::size_t, ddp::deadline_t) {}
  void recv(int, void*, std::size_t, ddp::deadline_t) {}
  template <class F>
  void sendrecv(int, std::span<const iovec>, int, std::span<const iovec>, ddp::deadline_t, F& on_recv) { on_recv(0); }
  [[noreturn]] void fail(ddp::errc, const std::string&) { throw 0; }
  void abort() noexcept {}
};

void f(ddp::process_group& pg) { ddp::ring<lvalue_progress> r{pg}; }
