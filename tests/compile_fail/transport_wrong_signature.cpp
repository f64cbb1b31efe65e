// A transport whose send has no deadline (every blocking call of ddp takes one) is rejected,
// naming the requirement whose signature it misses.
#include <ddp/reducer/ring.hpp>

#include <span>
#include <sys/uio.h>

struct no_deadline {
  explicit no_deadline(ddp::process_group&) {}
  int rank() const { return 0; }
  int size() const { return 1; }
  void send(int, const void*, std::size_t) {}
  void recv(int, void*, std::size_t, ddp::deadline_t) {}
  template <class F>
  void sendrecv(int, std::span<const iovec>, int, std::span<const iovec>, ddp::deadline_t, F&&) {}
  [[noreturn]] void fail(ddp::errc, const std::string&) { throw 0; }
  void abort() noexcept {}
};

void f(ddp::process_group& pg) { ddp::ring<no_deadline> r{pg}; }
