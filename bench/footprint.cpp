// What a rank of ddp costs the process it runs in: its threads and its listening ports. Run
// under the launcher as an elastic job with a ring over TCP (the group, its heartbeat, the
// launcher's link and a transport of its own all live):
//
//   ddprun -n 2 --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --port P --elastic 2:2
//       build/bench/footprint        (one command line; and the same with --node-rank 1)
//   ddprun -n 2 build/bench/footprint --plain        (a plain group with a heartbeat)
//
// Each rank does one allreduce, then prints one line
//   footprint rank R threads T (main + ddp's T-1) listening L ports [list]
// counted from /proc (tests/footprint.hpp), and both ranks leave together. docs/process-group.md quotes it.
#include <ddp/ddp.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "footprint.hpp"  // tests/footprint.hpp: threads_now(), listening_ports()

namespace {

void report(int rank) {
  const auto ports = ddp_test::listening_ports();
  std::string list;
  for (int p : ports) {
    if (!list.empty()) list += ',';
    list += std::to_string(p);
  }
  const int threads = ddp_test::threads_now();
  std::printf("footprint rank %d threads %d (main + ddp's %d) listening %zu ports [%s]\n", rank, threads,
              threads - 1, ports.size(), list.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const bool plain = argc > 1 && std::string(argv[1]) == "--plain";
  try {
    if (plain) {
      auto opts = ddp::init_options::from_env();
      if (opts.heartbeat.count() == 0) opts.heartbeat = std::chrono::seconds(1);
      auto pg = ddp::init_process_group(opts);
      ddp::ring<ddp::tcp> ring(pg);
      std::vector<float> v(1 << 16, 1.0f);
      ring.allreduce(std::span<float>(v), ddp::op::sum);
      report(pg.rank());
      pg.barrier();
      return 0;
    }
    ddp::elastic_group eg{ddp::init_options::from_env()};
    if (!eg.start()) return 0;
    ddp::ring<ddp::tcp> ring(eg.group());
    std::vector<float> v(1 << 16, 1.0f);
    ring.allreduce(std::span<float>(v), ddp::op::sum);
    report(eg.rank());
    eg.group().barrier();
    eg.finish();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "footprint: %s\n", e.what());
    return 1;
  }
}
