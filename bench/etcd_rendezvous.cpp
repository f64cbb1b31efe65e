// Joining on etcd at scale: N simulated ranks (threads of one process, each with its own store
// connection, made before the release) run the store half of joining a group
// (ddp::detail::join_store, the same code a real rank runs) against the built-in store
// (a store_server in this process) and against an etcd cluster (DDP_STORE-style URL), and we time
// it: from the release to the last rank's return. Medians over `reps`.
//
//   etcd_rendezvous URL [--ranks 64,256] [--reps 3] [--timeout-ms 60000]
//
// CSV on stdout: store,ranks,reps,join_median_ms,join_min_ms,join_max_ms,failed
// (bench/etcd_store.sh starts a three-member cluster on loopback and runs it).
#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/etcd.hpp>
#include <ddp/group/detail/rendezvous.hpp>
#include <ddp/store.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/// One rendezvous of `n` ranks; the time from the release to the last return (ms), or -1.
double one(int n, const std::function<std::unique_ptr<ddp::kv_store>(int)>& open, long long timeout_ms,
           const std::string& job, std::string& error) {
  std::vector<std::unique_ptr<ddp::kv_store>> st(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) st[static_cast<std::size_t>(r)] = open(r);
  std::atomic<int> go{0}, failed{0};
  std::vector<std::chrono::steady_clock::time_point> done(static_cast<std::size_t>(n));
  std::vector<std::thread> ts;
  std::string err;
  std::mutex mu;
  for (int r = 0; r < n; ++r)
    ts.emplace_back([&, r] {
      while (go.load() == 0) go.wait(0);
      try {
        const auto until = ddp::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
        ddp::detail::join_request req{r, n, job, "127.0.0.1:1", timeout_ms, 0, false};
        (void)ddp::detail::join_store(*st[static_cast<std::size_t>(r)], req, until);
      } catch (const std::exception& e) {
        ++failed;
        std::lock_guard lk(mu);
        err = e.what();
      }
      done[static_cast<std::size_t>(r)] = std::chrono::steady_clock::now();
    });
  const auto t0 = std::chrono::steady_clock::now();
  go = 1;
  go.notify_all();
  for (auto& t : ts) t.join();
  if (failed > 0) {
    error = err;
    return -1;
  }
  const auto last = *std::max_element(done.begin(), done.end());
  return std::chrono::duration<double, std::milli>(last - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: etcd_rendezvous URL [--ranks 64,256] [--reps 3] [--timeout-ms 60000]\n");
    return 2;
  }
  const std::string url = argv[1];
  std::vector<int> sizes{64, 256};
  int reps = 3;
  long long timeout_ms = 60000;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--ranks") {
      sizes.clear();
      for (std::size_t at = 0; at <= v.size();) {
        const auto comma = v.find(',', at);
        sizes.push_back(std::stoi(v.substr(at, comma - at)));
        if (comma == std::string::npos) break;
        at = comma + 1;
      }
    } else if (a == "--reps") reps = std::stoi(v);
    else if (a == "--timeout-ms") timeout_ms = std::stoll(v);
  }
  std::printf("store,ranks,reps,join_median_ms,join_min_ms,join_max_ms,failed\n");
  std::random_device rd;
  for (int n : sizes)
    for (const std::string store : {"builtin", "etcd"}) {
      std::vector<double> ms;
      int failed = 0;
      std::string error;
      for (int k = 0; k < reps; ++k) {
        const std::string job = "rdv-" + std::to_string(n) + "-" + std::to_string(rd());
        std::unique_ptr<ddp::store_server> server;
        if (store == "builtin")
          server = std::make_unique<ddp::store_server>(ddp::endpoint{"127.0.0.1", 0}, 0, nullptr, ddp::store_limits{},
                                                       "pg/rank/", static_cast<std::uint32_t>(n));
        auto open = [&](int r) -> std::unique_ptr<ddp::kv_store> {
          const auto until = ddp::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
          if (server) return std::make_unique<ddp::store_client>("127.0.0.1", server->port(), r, until, nullptr, true);
          return std::make_unique<ddp::etcd_store>(url, job, r, until);
        };
        const double t = one(n, open, timeout_ms, job, error);
        if (t < 0) ++failed;
        else ms.push_back(t);
      }
      if (!error.empty()) std::fprintf(stderr, "%s %d: %s\n", store.c_str(), n, error.c_str());
      std::printf("%s,%d,%d,%.1f,%.1f,%.1f,%d\n", store.c_str(), n, reps, median(ms),
                  ms.empty() ? 0 : *std::min_element(ms.begin(), ms.end()),
                  ms.empty() ? 0 : *std::max_element(ms.begin(), ms.end()), failed);
      std::fflush(stdout);
    }
}
