// tree<T> over a transport without fail() (what the algorithms call when a peer's descriptor
// differs) is rejected, naming the missing requirement.
#include <ddp/reducer/tree.hpp>

#include <span>
#include <sys/uio.h>

struct never_fails {
  explicit never_fails(ddp::process_group&) {}
  int rank() const { return 0; }
  int size() const { return 1; }
  void send(int, const void*, std::size_t, ddp::deadline_t) {}
  void recv(int, void*, std::size_t, ddp::deadline_t) {}
  template <class F>
  void sendrecv(int, std::span<const iovec>, int, std::span<const iovec>, ddp::deadline_t, F&&) {}
  void abort() noexcept {}
};

void f(ddp::process_group& pg) { ddp::tree<never_fails> r{pg}; }
