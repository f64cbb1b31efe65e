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
// counted from /proc/self/task and /proc/net/tcp{,6} (LISTEN sockets whose inode is one of
// this process's descriptors), and both ranks leave together. docs/process-group.md quotes it.
#include <ddp/ddp.hpp>

#include <dirent.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

int count_threads() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (auto* e = ::readdir(d))
      if (e->d_name[0] != '.') ++n;
    ::closedir(d);
  }
  return n;
}

/// The ports this process listens on (TCP, v4 and v6).
std::vector<int> listening_ports() {
  std::set<std::string> mine;  // socket inodes of this process's descriptors
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (auto* e = ::readdir(d)) {
      char link[256] = {};
      const std::string path = std::string("/proc/self/fd/") + e->d_name;
      const auto k = ::readlink(path.c_str(), link, sizeof link - 1);
      if (k > 0 && std::strncmp(link, "socket:[", 8) == 0) mine.insert(std::string(link + 8, link + k - 1));
    }
    ::closedir(d);
  }
  std::vector<int> ports;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream s(line);
      std::string sl, local, remote, state, queues, timer, retr, uid, timeout, inode;
      s >> sl >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode;
      if (state != "0A" || !mine.count(inode)) continue;  // 0A: LISTEN
      ports.push_back(static_cast<int>(std::stoul(local.substr(local.rfind(':') + 1), nullptr, 16)));
    }
  }
  return ports;
}

void report(int rank) {
  const auto ports = listening_ports();
  std::string list;
  for (int p : ports) list += (list.empty() ? "" : ",") + std::to_string(p);
  const int threads = count_threads();
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
