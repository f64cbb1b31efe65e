// What a process holds now: its threads and its listening TCP ports, from /proc. Used by the
// tests that hold a rank to one background thread and one port (tests/multiproc/test_links.cpp)
// and by bench/footprint.cpp, which reports them under the launcher.
#pragma once

#include <dirent.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace ddp_test {

/// Threads of this process (entries of /proc/self/task).
inline int threads_now() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (auto* e = ::readdir(d))
      if (e->d_name[0] != '.') ++n;
    ::closedir(d);
  }
  return n;
}

/// The TCP ports this process listens on (v4 and v6): LISTEN sockets in /proc/net/tcp{,6} whose
/// inode is one of this process's descriptors.
inline std::vector<int> listening_ports() {
  std::set<std::string> mine;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (auto* e = ::readdir(d)) {
      char link[256] = {};
      const std::string path = std::string("/proc/self/fd/") + e->d_name;
      const auto k = ::readlink(path.c_str(), link, sizeof link - 1);
      if (k > 8 && std::strncmp(link, "socket:[", 8) == 0) mine.insert(std::string(link + 8, link + k - 1));
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
      if (state != "0A" || mine.count(inode) == 0) continue;  // 0A: LISTEN
      ports.push_back(static_cast<int>(std::stoul(local.substr(local.rfind(':') + 1), nullptr, 16)));
    }
  }
  return ports;
}

}  // namespace ddp_test
