#pragma once
// A real three-member etcd cluster on loopback for a test process (scripts/etcd_cluster.sh),
// started on first use and stopped when the process that started it ends. The suite skips (77)
// where etcd is not installed.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace ddp_test {

class etcd_cluster {
 public:
  /// The suite's cluster, started on first use.
  static etcd_cluster& get() {
    static etcd_cluster c;
    return c;
  }
  /// A cluster of the caller's own, its members started with `flags` (ETCD_FLAGS).
  explicit etcd_cluster(const std::string& flags) : owner_(::getpid()), flags_(flags) { start(); }
  etcd_cluster(const etcd_cluster&) = delete;
  etcd_cluster& operator=(const etcd_cluster&) = delete;
  /// The first member's client URL (http://h:p), for etcdctl.
  std::string first_endpoint() const {
    const auto ep = url_.substr(7, url_.find(',') - 7);
    return "http://" + ep;
  }
  /// The DDP_STORE URL (etcd://h:p,h:p,h:p), with `suffix` (a prefix, options) appended.
  std::string url(const std::string& suffix = "") const { return url_ + suffix; }
  /// Runs the cluster script's `cmd` (kill N, restart N, leader) and returns its output.
  std::string ctl(const std::string& cmd) const {
    const std::string line = (flags_.empty() ? std::string() : "ETCD_FLAGS='" + flags_ + "' ") +
                             std::string(DDP_ETCD_SCRIPT) + " " + verb(cmd) + " " + dir_ + rest(cmd) + " 2>&1";
    std::string out;
    if (FILE* p = ::popen(line.c_str(), "r")) {
      char buf[512];
      while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
      ::pclose(p);
    }
    while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
    return out;
  }
  int leader() const { return std::atoi(ctl("leader").c_str()); }
  ~etcd_cluster() {
    if (::getpid() != owner_ || dir_.empty()) return;
    (void)ctl("stop");
    const std::string rm = "rm -rf " + dir_;
    (void)std::system(rm.c_str());
  }

 private:
  etcd_cluster() : owner_(::getpid()) { start(); }
  void start() {
    if (std::system("command -v etcd >/dev/null 2>&1 && command -v etcdctl >/dev/null 2>&1") != 0) {
      std::fprintf(stderr, "etcd is not installed (scripts/deps.sh installs etcd-server): skipped\n");
      std::_Exit(77);
    }
    char tmpl[] = "/dev/shm/ddp-etcd-XXXXXX";
    char tmpl2[] = "/tmp/ddp-etcd-XXXXXX";
    const char* d = ::mkdtemp(tmpl);
    if (d == nullptr) d = ::mkdtemp(tmpl2);
    if (d == nullptr) {
      std::perror("mkdtemp");
      std::_Exit(1);
    }
    dir_ = d;
    const std::string out = ctl("start");
    std::ifstream f(dir_ + "/url");
    std::getline(f, url_);
    if (url_.rfind("etcd://", 0) != 0) {
      std::fprintf(stderr, "could not start the etcd cluster: %s\n", out.c_str());
      std::_Exit(1);
    }
  }
  static std::string verb(const std::string& cmd) { return cmd.substr(0, cmd.find(' ')); }
  static std::string rest(const std::string& cmd) {
    const auto sp = cmd.find(' ');
    return sp == std::string::npos ? std::string() : cmd.substr(sp);
  }
  pid_t owner_;
  std::string flags_;
  std::string dir_;
  std::string url_;
};

}  // namespace ddp_test
