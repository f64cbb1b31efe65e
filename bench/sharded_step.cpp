// A data-parallel step with AdamW, sharded (dp_options::shard: reduce-scatter, each rank steps
// its shard, all-gather of the parameters) and unsharded (allreduce, every rank steps every
// parameter), in the CSV of bench/peers/torch_zero.py so that bench/sharded.sh puts both beside
// PyTorch's DDP + AdamW and ZeroRedundancyOptimizer.
//
//   sharded_step [--ranks 2,4] [--steps 10] [--warmup 3] [--variants ddp_adamw,ddp_sharded_adamw] [--touch]
//                FILE.params ...
//
// The model is a set of float32 parameters of the file's shapes (`name dim dim ...` per line, as
// tests/data); a step is what an engine with a near-free forward does: backward adds a value
// into every gradient, last parameter first, calling grad_ready after each; then finish() and
// the optimizer (ddp_adamw: ddp::adamw over each whole parameter; ddp_sharded_adamw:
// dp.step(ddp::adamw); ddp_sharded_r2_adamw: the same with each shard held by two ranks,
// dp_options::shard_replicas = 2, what an elastic group gets by default; ddp_fully_sharded_adamw:
// ddp::fully_sharded, the parameters sharded too, in units of consecutive parameters of about
// 1/24 of the model each, each unit gathered around its forward and its backward;
// ddp_fully_sharded_keep_adamw: the same with reshard_after_forward off). --touch gives every
// variant a forward that reads every parameter (a unit's while it is gathered), as a real forward
// would. Times are the slowest rank's per step, after
// a barrier; the median and the 10th percentile over --steps steps. Memory per rank: the optimizer state this rank
// holds (rank 0's and the largest), ddp's gradient memory (bucket buffers held, plus the averaged gradient shards in
// the sharded mode), the largest bucket (the "one bucket" a rank may hold beside its shards: a parameter larger than
// the cap is a bucket of its own) and the peak RSS of rank 0. Each (variant, model, ranks) runs in freshly forked
// processes, so that peak RSS is its own. DDP_BACKEND (shm, tcp, ...) picks the reducer as for any group.
//
// Columns: system,model,ranks,params,steps,step_median_ms,step_p10_ms,opt_state_bytes_rank0,
//          opt_state_bytes_max,peak_rss_bytes_rank0,ddp_grad_bytes_rank0,largest_bucket_bytes
#include <ddp/ddp.hpp>

#include "free_port.hpp"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

/// Where --touch's sums go, so that the compiler keeps the reads.
volatile double touched = 0;

struct model_spec {
  std::string name;
  std::vector<std::size_t> sizes;
  std::vector<std::string> names;
  std::size_t elems = 0;
};

model_spec read_params(const std::filesystem::path& p) {
  std::ifstream in(p);
  if (!in) throw std::runtime_error("cannot read " + p.string());
  model_spec m;
  m.name = p.stem().string();
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string name;
    if (!(ls >> name) || name[0] == '#') continue;
    std::size_t n = 1, d = 0;
    while (ls >> d) n *= d;
    m.names.push_back(name);
    m.sizes.push_back(n);
    m.elems += n;
  }
  return m;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) out.push_back(x);
  return out;
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  const double at = q * static_cast<double>(v.size() - 1);
  const auto lo = static_cast<std::size_t>(at);
  const std::size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (at - static_cast<double>(lo));
}

struct engine {
  std::vector<std::vector<float>> values, grads;
  std::vector<ddp::tensor_view> views;
  explicit engine(const model_spec& m) {
    for (std::size_t i = 0; i < m.sizes.size(); ++i) {
      values.emplace_back(m.sizes[i], 0.01f);
      grads.emplace_back(m.sizes[i], 0.0f);
    }
    for (std::size_t i = 0; i < m.sizes.size(); ++i)
      views.push_back(ddp::make_tensor_view(values[i], grads[i], m.names[i], {static_cast<std::int64_t>(m.sizes[i])}));
  }
  void backward(ddp::data_parallel& dp, float scale) {
    for (std::size_t i = grads.size(); i-- > 0;) {
      for (float& g : grads[i]) g = scale;
      dp.grad_ready(i);
    }
  }
  /// A forward that reads parameters [first, last): their sum.
  double touch(std::size_t first, std::size_t last) const {
    double s = 0;
    for (std::size_t i = first; i < last; ++i) {
      float a = 0;
      for (float v : values[i]) a += v;
      s += a;
    }
    return s;
  }
};

/// This process's resident memory now, MB (/proc/self/statm): the steady state, where the
/// peak RSS also holds the construction's whole model.
double resident_mb() {
  std::ifstream in("/proc/self/statm");
  double total = 0, rss = 0;
  in >> total >> rss;
  return rss * static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1e6;
}

/// Units of consecutive parameters, each closed once it holds 1/24 of the model's elements.
std::vector<std::size_t> units_of(const model_spec& m) {
  std::vector<std::size_t> units;
  std::size_t count = 0, elems = 0;
  for (std::size_t n : m.sizes) {
    ++count, elems += n;
    if (elems * 24 >= m.elems) units.push_back(count), count = 0, elems = 0;
  }
  if (count > 0) units.push_back(count);
  return units;
}

/// The fully sharded variants: forward unit by unit (gathered, read, released), backward in
/// reverse (gathered again, gradients written, reduce-scattered), finish, the shards stepped.
void fully_sharded_main(int rank, int n, ddp::process_group& pg, engine& e, const model_spec& m,
                        const std::string& variant, int steps, int warmup, bool touch) {
  const auto units = units_of(m);
  ddp::fully_sharded_options o{.reshard_after_forward = variant != "ddp_fully_sharded_keep_adamw"};
  // DDP_FS_KEEP_MEMORY=1: released units keep their pages (protected only); =2: nor protected.
  if (const char* k = std::getenv("DDP_FS_KEEP_MEMORY")) o.release_memory = false, o.protect_released = k[0] != '2';
  ddp::fully_sharded fs{pg, e.views, units, o};
  ddp::adamw opt{{.lr = 1e-3, .weight_decay = 0.01}};
  std::vector<std::size_t> first(units.size() + 1, 0);
  for (std::size_t u = 0; u < units.size(); ++u) first[u + 1] = first[u] + units[u];
  std::vector<double> ms, opt_ms;
  double sink = 0;
  for (int s = 0; s < warmup + steps; ++s) {
    pg.barrier();
    const auto t0 = clock_type::now();
    for (std::size_t u = 0; u < units.size(); ++u) {
      fs.gather(u);
      if (touch) sink += e.touch(first[u], first[u + 1]);
      fs.release(u);
    }
    const float scale = 1.0f / static_cast<float>(s + 1 + rank);
    for (std::size_t u = units.size(); u-- > 0;) {
      fs.begin_backward(u);
      for (std::size_t i = first[u]; i < first[u + 1]; ++i)
        for (float& g : e.grads[i]) g = scale;
      fs.end_backward(u);
    }
    fs.finish();
    const auto t1 = clock_type::now();
    fs.step(opt);
    if (s >= warmup) {
      ms.push_back(std::chrono::duration<double, std::milli>(clock_type::now() - t0).count());
      opt_ms.push_back(std::chrono::duration<double, std::milli>(clock_type::now() - t1).count());
    }
  }
  touched = sink;
  if (rank == 0)
    std::fprintf(stderr,
                 "# %s %s %d ranks: %zu units, optimizer median %.2f ms of %.2f; %llu gathers, %llu prefetched, "
                 "waited for %.1f ms a step; resident now %.0f MB\n",
                 variant.c_str(), m.name.c_str(), n, units.size(), percentile(opt_ms, 0.5), percentile(ms, 0.5),
                 static_cast<unsigned long long>(fs.gathers_issued()),
                 static_cast<unsigned long long>(fs.gathers_prefetched()),
                 std::chrono::duration<double, std::milli>(fs.gather_wait()).count() / (warmup + steps),
                 resident_mb());
  pg.all_reduce(std::span<double>(ms), ddp::op::max);
  std::vector<double> st{static_cast<double>(fs.state_bytes())};
  pg.all_reduce(std::span<double>(st), ddp::op::max);
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  std::size_t largest = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    std::size_t b = 0;
    for (std::size_t i = first[u]; i < first[u + 1]; ++i) b += e.views[i].bytes();
    largest = std::max(largest, b);
  }
  if (rank == 0) {
    std::printf("%s,%s,%d,%zu,%d,%.3f,%.3f,%zu,%.0f,%ld,%zu,%zu\n", variant.c_str(), m.name.c_str(), n, m.elems, steps,
                percentile(ms, 0.5), percentile(ms, 0.1), fs.state_bytes(), st[0], ru.ru_maxrss * 1024L,
                fs.gradient_bytes(), largest);
    std::fflush(stdout);
  }
}

void rank_main(int rank, int n, int port, const model_spec& m, const std::string& variant, int steps, int warmup,
               bool touch) {
  ddp::init_options io;
  io.rank = rank;
  io.world_size = n;
  io.master_port = port;
  io.timeout = std::chrono::seconds(120);
  // DDP_BACKEND=tcp measures the sharded step over the ring on tcp (the default is shm on one host).
  if (const char* b = std::getenv("DDP_BACKEND"))
    if (auto v = ddp::parse_backend(b)) io.backend = *v;
  auto pg = ddp::init_process_group(io);
  engine e(m);
  if (variant.rfind("ddp_fully_sharded", 0) == 0) return fully_sharded_main(rank, n, pg, e, m, variant, steps, warmup, touch);
  const bool replicated = variant == "ddp_sharded_r2_adamw";  // dp_options::shard_replicas = 2
  const bool sharded = variant == "ddp_sharded_adamw" || variant == "ddp_sharded_none" || replicated;
  // ddp_sharded_none: an optimizer that changes nothing, so that the step is the all-gather and its copies.
  struct none_optimizer {
    std::size_t state_per_element() const { return 0; }
    std::string signature() const { return "none"; }
    void step(const ddp::shard_step&) {}
  } none;
  ddp::data_parallel dp(pg, e.views, {},
                        {.broadcast_parameters = false, .shard = sharded, .shard_replicas = replicated ? 2 : 1});
  ddp::adamw opt{{.lr = 1e-3, .weight_decay = 0.01}};
  std::vector<std::vector<float>> state;  // the unsharded AdamW's, whole
  if (!sharded)
    for (const auto& g : e.grads) state.emplace_back(2 * g.size(), 0.0f);
  std::uint64_t t = 0;
  std::vector<double> ms, opt_ms;
  double sink = 0;
  for (int s = 0; s < warmup + steps; ++s) {
    pg.barrier();
    const auto t0 = clock_type::now();
    if (touch) sink += e.touch(0, e.values.size());
    e.backward(dp, 1.0f / static_cast<float>(s + 1 + rank));
    dp.finish();
    const auto t1 = clock_type::now();
    if (variant == "ddp_sharded_none") {
      dp.step(none);
    } else if (sharded) {
      dp.step(opt);
    } else {
      ++t;
      for (std::size_t i = 0; i < e.views.size(); ++i)
        opt.step(ddp::shard_step{
            i, t, std::span<float>(e.values[i]), std::span<const float>(e.grads[i]), std::span<float>(state[i]), {}});
    }
    if (s >= warmup) {
      ms.push_back(std::chrono::duration<double, std::milli>(clock_type::now() - t0).count());
      opt_ms.push_back(std::chrono::duration<double, std::milli>(clock_type::now() - t1).count());
    }
  }
  touched = sink;
  if (rank == 0)  // where the step goes: backward + finish() against the optimizer (+ gather)
    std::fprintf(stderr, "# %s %s %d ranks: optimizer%s median %.2f ms of %.2f; resident now %.0f MB\n",
                 variant.c_str(), m.name.c_str(), n, sharded ? " + all-gather" : "", percentile(opt_ms, 0.5),
                 percentile(ms, 0.5), resident_mb());
  pg.all_reduce(std::span<double>(ms), ddp::op::max);
  std::size_t state_bytes = dp.shard_state_bytes();
  if (!sharded)
    for (const auto& s : state) state_bytes += s.size() * sizeof(float);
  std::vector<double> st{static_cast<double>(state_bytes)};
  pg.all_reduce(std::span<double>(st), ddp::op::max);
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  const std::size_t grad_bytes = dp.bucket_bytes_held() + dp.shard_gradient_bytes();
  std::size_t largest = 0;
  for (const auto& b : dp.plan().buckets) largest = std::max(largest, b.bytes);
  if (rank == 0) {
    std::printf("%s,%s,%d,%zu,%d,%.3f,%.3f,%zu,%.0f,%ld,%zu,%zu\n", variant.c_str(), m.name.c_str(), n, m.elems, steps,
                percentile(ms, 0.5), percentile(ms, 0.1), state_bytes, st[0], ru.ru_maxrss * 1024L, grad_bytes,
                largest);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) try {
  std::vector<int> ranks{2, 4};
  std::vector<std::string> variants{"ddp_adamw", "ddp_sharded_adamw"};
  int steps = 10, warmup = 3;
  bool touch = false;
  std::vector<model_spec> models;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--ranks") {
      ranks.clear();
      for (const auto& r : split(next())) ranks.push_back(std::stoi(r));
    } else if (a == "--steps") {
      steps = std::stoi(next());
    } else if (a == "--warmup") {
      warmup = std::stoi(next());
    } else if (a == "--variants") {
      variants = split(next());
    } else if (a == "--touch") {
      touch = true;
    } else {
      models.push_back(read_params(a));
    }
  }
  if (models.empty())
    throw std::runtime_error("usage: sharded_step [--ranks 2,4] [--steps N] [--warmup N] FILE.params ...");
  std::printf(
      "system,model,ranks,params,steps,step_median_ms,step_p10_ms,opt_state_bytes_rank0,opt_state_bytes_max,"
      "peak_rss_bytes_rank0,ddp_grad_bytes_rank0,largest_bucket_bytes\n");
  std::fflush(stdout);
  int failed = 0;
  for (const auto& m : models)
    for (int n : ranks)
      for (const auto& v : variants) {
        const int port = bench::free_port();
        std::vector<pid_t> pids;
        for (int r = 0; r < n; ++r) {
          const pid_t pid = ::fork();
          if (pid == 0) {
            try {
              rank_main(r, n, port, m, v, steps, warmup, touch);
              std::_Exit(0);
            } catch (const std::exception& ex) {
              std::fprintf(stderr, "sharded_step rank %d: %s\n", r, ex.what());
              std::_Exit(1);
            }
          }
          pids.push_back(pid);
        }
        for (pid_t p : pids) {
          int st = 0;
          ::waitpid(p, &st, 0);
          failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        }
      }
  return failed == 0 ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "sharded_step: %s\n", e.what());
  return 2;
}
