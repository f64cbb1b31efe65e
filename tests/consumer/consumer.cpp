// A program that uses ddp as an outside project would: one process, group of one.
#include <ddp/ddp.hpp>

#include <cstdio>

int main() {
  ddp::init_options o;
  o.master_port = DDP_CONSUMER_PORT;
  auto pg = ddp::init_process_group(o);
  pg.barrier();
  int v = 7;
  pg.broadcast(std::span<int>(&v, 1), 0);
  std::printf("consumer ok: rank %d of %d, v=%d\n", pg.rank(), pg.size(), v);
  return v == 7 && pg.size() == 1 ? 0 : 1;
}
