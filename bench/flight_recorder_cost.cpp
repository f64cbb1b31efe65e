// What the flight recorder costs per collective (docs/forensics.md): a group of one rank, whose
// reducer moves no bytes, so a blocking allreduce is the front end alone (argument checks, the
// descriptor, the inline run) plus, with recording on, the ring's entry and its clock reads.
// Two reducers, one built with DDP_FLIGHT_RECORDER_ENTRIES=0 and one with the default, run in
// alternating rounds; the medians of the rounds' ns per call are printed; then the entry of an
// async collective (issued, started, ended) alone.
//
//   flight_recorder_cost [calls per round, default 200000] [rounds, default 9]
#include <ddp/ddp.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <unistd.h>

int main(int argc, char** argv) {
  const long calls = argc > 1 ? std::atol(argv[1]) : 200000;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 9;
  ddp::init_options o;
  o.rank = 0;
  o.world_size = 1;
  o.master_addr = "127.0.0.1";
  o.master_port = 20000 + static_cast<int>(::getpid() % 20000);  // one rank: no peer ever connects
  auto pg = ddp::init_process_group(o);
  ::setenv("DDP_FLIGHT_RECORDER_ENTRIES", "0", 1);
  ddp::auto_reducer off{pg};
  ::unsetenv("DDP_FLIGHT_RECORDER_ENTRIES");
  ddp::auto_reducer on{pg};
  float v = 1.0f;
  const auto per_call = [&](ddp::auto_reducer& r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < calls; ++i) r.allreduce(&v, 1, ddp::dtype::f32, ddp::op::sum);
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / calls;
  };
  std::vector<double> a, b;
  for (int k = 0; k < rounds; ++k) {
    a.push_back(per_call(off));
    b.push_back(per_call(on));
  }
  const auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  std::printf(
      "blocking allreduce, 1 rank, %ld calls x %d rounds: off %.1f ns, on %.1f ns, recording %.1f ns per call\n", calls,
      rounds, median(a), median(b), median(b) - median(a));
  // What an async collective writes: issued on one thread, started and ended on the progress
  // thread (here all on one): the entry alone, three coarse clock reads.
  auto ring = ddp::detail::flight_ring::make(0, 1, "bench");
  std::vector<double> c;
  for (int k = 0; k < rounds; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < calls; ++i) {
      const auto n = ring->issue(ddp::detail::coll_kind::allreduce, ddp::dtype::f32, ddp::op::sum, 0, 1, false, 0, 0);
      ring->started(n);
      ring->finished(n);
    }
    c.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / calls);
  }
  std::printf("an async collective's entry (issue, start, end): %.1f ns\n", median(c));
}
