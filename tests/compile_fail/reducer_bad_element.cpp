// A reducer rejects an element type no reducer can do, with a readable message.
#include <ddp/reducer/ring.hpp>
#include <ddp/transport/tcp.hpp>

#include <span>
#include <vector>

void f(ddp::ring<ddp::tcp>& ring) {
  std::vector<char> v(10);
  ring.allreduce(std::span<char>(v), ddp::op::sum);
}
