// Gradient synchronization per data-parallel step, in the CSV of bench/peers/torch_ddp.py so
// that ddp and PyTorch DDP plot together (bench/plot.py --kind step).
//
//   ddp_step [--ranks 2,4] [--caps 1,25,100] [--reducers default,ring_tcp,tree_tcp,ring_shm,tree_shm]
//            [--modes copy,view] [--steps 10] [--warmup 3] [--compute-ms auto|MS]
//            [--compute-kind sleep|spin] [--no-flat] [--no-compute] [--env] FILE.params|DIR ...
//
// Reducers: ring_tcp, tree_tcp, ring_shm, tree_shm, and `default`: ddp::data_parallel's own
// (whatever the library defaults to; chosen at run time where the default does that).
// Compressed (ddp::hooked with ddp::fp16_compress / ddp::bf16_compress, docs/tuning.md):
// ring_tcp_fp16, ring_tcp_bf16, tree_tcp_fp16, ring_shm_fp16, default_fp16; default_fp8
// (ddp::fp8_compress: e4m3, blocks of 256, error feedback). default_powersgd:
// ddp::powersgd at rank 1, compressed from the first step (PyTorch's powerSGD_hook default rank).
// --env: this process is one rank, started by a launcher (ddprun, mpirun, srun; several hosts
// allowed): the group comes from the environment (ddp::init_options::from_env()) and --ranks is
// ignored; only rank 0 prints rows. bench/netns_hier.sh runs it so across network namespaces.
//
// For each params file (`name dim dim ...` per line, as in tests/data) the model is a set of
// float32 parameters of exactly those shapes. A step is what an engine with a near-free forward
// does: backward adds a value into every gradient, last parameter first, calling grad_ready
// after each, then finish(). Each step runs twice, interleaved, after a barrier: once under
// no_sync() and once synchronized; sync_ms is the difference of the medians (of the slowest
// rank per step), exactly as torch_ddp.py measures PyTorch.
//
// Rows, per ranks x model x reducer:
//   ddp_<reducer>_<mode>          one row per bucket cap (copy: gradients copied into buckets;
//                                 view: gradient_as_bucket_view, nothing copied)
//   ddp_<reducer>_copy_auto       `auto` in --caps: bucket_policy::autotune picks the cap (copy mode only);
//                                 the steps until its choice are extra warm-up, bucket_cap_mb is
//                                 the chosen cap (mean of two rounds, alternating with:)
//   ddp_<reducer>_copy_autofixed  the chosen cap as a fixed bucket_policy, measured alternately
//                                 with the tuned wrapper (the same plan: any gap is overhead or noise)
//   ddp_<reducer>_flat            one allreduce of all gradient bytes in one buffer (the floor
//                                 bucketing is compared with); bucket_cap_mb is the model size
//   ddp_<reducer>_<mode>_compute  25 MiB cap with simulated backward compute: each parameter
//                                 costs time proportional to its bytes, compute_ms in total
//                                 (auto: the flat allreduce time), so exposed_median_ms shows
//                                 how much communication the overlap leaves uncovered.
//   --optim sgd|adamw (optimizer overlap, docs/data-parallel.md): with the same compute, a
//   real optimizer step over every parameter (SGD with momentum, or AdamW), three rows:
//   ddp_<reducer>_<mode>_<optim>_alone       the optimizer step by itself (step_median_ms)
//   ddp_<reducer>_<mode>_<optim>_sequential  backward, finish(), then the optimizer
//   ddp_<reducer>_<mode>_<optim>_overlapped  backward, finish() stepping each bucket's
//                                            parameters in on_bucket_reduced
//   and on stderr the share of the optimizer's time hidden: (sequential - overlapped) / alone.
// Columns: system,model,ranks,bucket_cap_mb,steps,step_median_ms,nosync_median_ms,sync_ms,
//          exposed_median_ms,compute_ms
// (the first eight are torch_ddp.py's; exposed = last grad_ready to finish() return).
//
// Ranks are forked here, one fresh process group per (ranks, model) pair.
#include <ddp/data_parallel.hpp>
#include <ddp/reducer/compress.hpp>
#include <ddp/reducer/fp8_compress.hpp>
#include <ddp/reducer/hooked.hpp>
#include <ddp/reducer/powersgd.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/tree.hpp>
#include <ddp/transport/tcp.hpp>
#if __has_include(<ddp/reducer/shm.hpp>)
#include <ddp/memory/shm_allocator.hpp>
#include <ddp/reducer/shm.hpp>
#define DDP_BENCH_HAS_SHM 1
#endif

#include "free_port.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

struct model_spec {
  std::string name;
  std::vector<std::vector<std::int64_t>> shapes;
  std::vector<std::string> names;
  std::size_t elems = 0;
};

struct options {
  std::vector<int> ranks{2, 4};
  std::vector<double> caps_mb{1, 25, 100};
  bool auto_cap = false;  // `auto` among --caps: a row tuned by bucket_policy::autotune
  std::vector<std::string> reducers{"default", "ring_tcp", "tree_tcp", "ring_shm", "tree_shm"};
  std::vector<std::string> modes{"copy", "view"};
  int steps = 10, warmup = 3;
  double compute_ms = -1;  // -1: auto
  bool spin = false, flat = true, compute = true;
  bool from_env = false;  // --env: one rank of a launched group
  std::string optim;      // --optim sgd|adamw: the optimizer-overlap rows
  std::vector<model_spec> models;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "ddp_step: %s\nusage: ddp_step [--ranks 2,4] [--caps 1,25,100] [--reducers default,ring_tcp,tree_tcp,ring_shm,tree_shm]\n"
               "                [--modes copy,view] [--steps N] [--warmup N] [--compute-ms auto|MS]\n"
               "                [--compute-kind sleep|spin] [--no-flat] [--no-compute] [--env] FILE.params|DIR ...\n",
               why);
  std::exit(2);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string part; std::getline(ss, part, ',');)
    if (!part.empty()) out.push_back(part);
  return out;
}

model_spec read_params(const std::filesystem::path& p) {
  std::ifstream in(p);
  if (!in) usage(("cannot read " + p.string()).c_str());
  model_spec m;
  m.name = p.stem().string();
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string name;
    ls >> name;
    std::vector<std::int64_t> shape;
    std::size_t n = 1;
    for (std::int64_t d; ls >> d;) {
      shape.push_back(d);
      n *= static_cast<std::size_t>(d);
    }
    if (name.empty()) continue;
    if (shape.empty()) usage(("no shape for " + name + " in " + p.string()).c_str());
    m.names.push_back(name);
    m.shapes.push_back(shape);
    m.elems += n;
  }
  if (m.shapes.empty()) usage(("no parameters in " + p.string()).c_str());
  return m;
}

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + a).c_str());
      return argv[++i];
    };
    if (a == "--ranks") {
      o.ranks.clear();
      for (auto& s : split(value())) o.ranks.push_back(std::atoi(s.c_str()));
    } else if (a == "--caps") {
      o.caps_mb.clear();
      for (auto& s : split(value())) {
        if (s == "auto") o.auto_cap = true;
        else o.caps_mb.push_back(std::atof(s.c_str()));
      }
    } else if (a == "--reducers") {
      o.reducers = split(value());
    } else if (a == "--modes") {
      o.modes = split(value());
    } else if (a == "--steps") {
      o.steps = std::atoi(value().c_str());
    } else if (a == "--warmup") {
      o.warmup = std::atoi(value().c_str());
    } else if (a == "--compute-ms") {
      const auto v = value();
      o.compute_ms = v == "auto" ? -1 : std::atof(v.c_str());
    } else if (a == "--compute-kind") {
      const auto v = value();
      if (v != "sleep" && v != "spin") usage("--compute-kind is sleep or spin");
      o.spin = v == "spin";
    } else if (a == "--no-flat") {
      o.flat = false;
    } else if (a == "--no-compute") {
      o.compute = false;
    } else if (a == "--env") {
      o.from_env = true;
    } else if (a == "--optim") {
      o.optim = value();
      if (o.optim != "sgd" && o.optim != "adamw") usage("--optim is sgd or adamw");
    } else if (a == "-h" || a == "--help") {
      usage("help");
    } else if (!a.empty() && a[0] == '-') {
      usage(("unknown option " + a).c_str());
    } else if (std::filesystem::is_directory(a)) {
      std::vector<std::filesystem::path> files;
      for (auto& e : std::filesystem::directory_iterator(a))
        if (e.path().extension() == ".params") files.push_back(e.path());
      std::sort(files.begin(), files.end());
      for (auto& f : files) o.models.push_back(read_params(f));
    } else {
      o.models.push_back(read_params(a));
    }
  }
  if (o.models.empty()) usage("no params file given (e.g. tests/data)");
  if (o.steps < 1 || o.warmup < 0) usage("--steps must be positive");
  for (auto& m : o.modes)
    if (m != "copy" && m != "view") usage("--modes takes copy and view");
  return o;
}


double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0 : (n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
}

// Per step, the slowest rank's time: a synchronized step ends when its last rank does.
std::vector<double> slowest(ddp::process_group& pg, const std::vector<double>& mine) {
  std::string blob(reinterpret_cast<const char*>(mine.data()), mine.size() * sizeof(double));
  auto all = pg.all_gather(blob);
  std::vector<double> out = mine;
  for (auto& b : all)
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = std::max(out[i], reinterpret_cast<const double*>(b.data())[i]);
  return out;
}

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

// The engine: its gradients, and a backward that adds `scale` into each, last parameter first.
struct engine {
  std::vector<std::vector<float>> grads;
  std::vector<ddp::tensor_view> views;
  std::vector<float> data_dummy;  // parameters' values are not touched by this benchmark

  explicit engine(const model_spec& m) {
    std::size_t largest = 0;
    for (auto& s : m.shapes) {
      std::size_t n = 1;
      for (auto d : s) n *= static_cast<std::size_t>(d);
      grads.emplace_back(n, 0.0f);
      largest = std::max(largest, n);
    }
    // Values are only read at construction (rank 0's are broadcast), which the benchmark turns
    // off; every view's data points at one shared dummy of the largest size.
    data_dummy.assign(largest, 0.0f);
    for (std::size_t i = 0; i < grads.size(); ++i)
      views.push_back(ddp::tensor_view{data_dummy.data(), grads[i].data(), grads[i].size(), ddp::dtype::f32, -1,
                                       m.names[i], m.shapes[i]});
  }
};

// Simulated backward compute: parameter i costs ns_per_elem * numel; sleeping models an
// accelerator computing while the CPU is free, spinning models CPU training.
struct compute_model {
  double ns_per_elem = 0;
  bool spin = false;
  clock_type::time_point due{};

  void start() { due = clock_type::now(); }
  void cost(std::size_t elems) {
    if (ns_per_elem <= 0) return;
    due += std::chrono::nanoseconds(static_cast<long long>(ns_per_elem * static_cast<double>(elems)));
    if (spin) {
      while (clock_type::now() < due) {
      }
    } else if (due - clock_type::now() > std::chrono::microseconds(100)) {
      std::this_thread::sleep_until(due);
    }
  }
  void end() {
    if (ns_per_elem > 0 && clock_type::now() < due) std::this_thread::sleep_until(due);
  }
};

template <class DP>
void backward(DP& dp, engine& e, bool view, float scale, compute_model& cm) {
  cm.start();
  for (std::size_t i = e.grads.size(); i-- > 0;) {
    float* g = view ? static_cast<float*>(dp.bucket_grad(i)) : e.grads[i].data();
    const std::size_t n = e.grads[i].size();
    for (std::size_t k = 0; k < n; ++k) g[k] += scale;
    cm.cost(n);
    dp.grad_ready(i);
  }
  cm.end();
}

struct row {
  double step_ms = 0, nosync_ms = 0, exposed_ms = 0;
};

// The optimizer of the overlap rows: its own copy of every parameter and its state, updated
// from the averaged gradients as torch.optim.SGD (momentum 0.9) or AdamW (PyTorch's defaults)
// would, one parameter at a time.
struct optimizer {
  bool adamw = false;
  std::vector<std::vector<float>> value, m, v;
  std::vector<int> steps;

  optimizer(const engine& e, bool adam) : adamw(adam), steps(e.grads.size(), 0) {
    for (const auto& g : e.grads) {
      value.emplace_back(g.size(), 0.01f);
      m.emplace_back(g.size(), 0.0f);
      if (adamw) v.emplace_back(g.size(), 0.0f);
    }
  }
  void step(std::size_t i, const float* g) {
    float* p = value[i].data();
    float* mi = m[i].data();
    const std::size_t n = value[i].size();
    if (!adamw) {
      for (std::size_t k = 0; k < n; ++k) {
        mi[k] = 0.9f * mi[k] + g[k];
        p[k] -= 0.01f * mi[k];
      }
      return;
    }
    const int t = ++steps[i];
    const float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 1e-2f;
    const float c1 = 1.0f - std::pow(b1, static_cast<float>(t)), c2 = std::sqrt(1.0f - std::pow(b2, static_cast<float>(t)));
    float* vi = v[i].data();
    for (std::size_t k = 0; k < n; ++k) {
      p[k] *= 1.0f - lr * wd;
      mi[k] = b1 * mi[k] + (1.0f - b1) * g[k];
      vi[k] = b2 * vi[k] + (1.0f - b2) * g[k] * g[k];
      p[k] -= lr / c1 * mi[k] / (std::sqrt(vi[k]) / c2 + eps);
    }
  }
};

// Steps of backward + finish() + the optimizer, sequential (after finish) or overlapped (in
// on_bucket_reduced); also the optimizer alone. Rows as print_row's, times the slowest rank's.
template <class DP>
std::vector<double> time_optim(ddp::process_group& pg, DP& dp, engine& e, bool view, const options& o,
                               compute_model cm, optimizer& opt, int how) {
  const auto grad_of = [&](std::size_t i) -> const float* {
    return view ? static_cast<const float*>(dp.bucket_grad(i)) : e.grads[i].data();
  };
  if (how == 2)
    dp.on_bucket_reduced([&](const ddp::reduced_bucket& b) {
      for (std::size_t i : b.parameters) opt.step(i, grad_of(i));
    });
  std::vector<double> t;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    dp.get_reducer().barrier();
    const auto t0 = clock_type::now();
    if (how == 0) {
      for (std::size_t i = 0; i < e.grads.size(); ++i) opt.step(i, grad_of(i));
    } else {
      backward(dp, e, view, 1.0f / static_cast<float>(s + 1), cm);
      dp.finish();
      if (how == 1)
        for (std::size_t i = 0; i < e.grads.size(); ++i) opt.step(i, grad_of(i));
    }
    if (s >= o.warmup) t.push_back(ms_since(t0));
  }
  dp.on_bucket_reduced({});
  return slowest(pg, t);
}

// Times `steps` interleaved pairs (no_sync, synchronized) of one configuration.
template <class DP>
row time_steps(ddp::process_group& pg, DP& dp, engine& e, bool view, const options& o, compute_model cm) {
  std::vector<double> sync, nosync, exposed;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    const float scale = 1.0f / static_cast<float>(s + 1);
    double t_nosync = 0, t_sync = 0;
    {
      auto guard = dp.no_sync();
      dp.get_reducer().barrier();
      const auto t0 = clock_type::now();
      backward(dp, e, view, scale, cm);
      dp.finish();
      t_nosync = ms_since(t0);
    }
    dp.get_reducer().barrier();
    const auto t0 = clock_type::now();
    backward(dp, e, view, scale, cm);
    dp.finish();
    t_sync = ms_since(t0);
    if (s >= o.warmup) {
      sync.push_back(t_sync);
      nosync.push_back(t_nosync);
      exposed.push_back(dp.last_step_stats().exposed_ms);
    }
  }
  return {median(slowest(pg, sync)), median(slowest(pg, nosync)), median(slowest(pg, exposed))};
}

void print_row(ddp::process_group& pg, const std::string& system, const model_spec& m, double cap_mb, int steps,
               const row& r, double compute_ms) {
  if (pg.rank() != 0) return;
  std::printf("%s,%s,%d,%g,%d,%.3f,%.3f,%.3f,%.3f,%.3f\n", system.c_str(), m.name.c_str(), pg.size(), cap_mb, steps,
              r.step_ms, r.nosync_ms, r.step_ms - r.nosync_ms, r.exposed_ms, compute_ms);
  std::fflush(stdout);
}

// One reducer family: its flat allreduce, every (mode, cap), and the compute runs.
template <class Reducer, class Allocator, class... ReducerArgs>
void run_reducer(ddp::process_group& pg, const model_spec& m, engine& e, const options& o, const std::string& name,
                 ReducerArgs... rargs) {
  using dp_type = ddp::basic_data_parallel<ddp::size_planner, Reducer, Allocator>;
  using namespace ddp::literals;
  const double model_mb = static_cast<double>(m.elems * 4) / (1 << 20);
  double flat_ms = 0;
  {
    // The floor: one allreduce of every gradient byte in one bucket, no copies.
    dp_type dp{pg, e.views, ddp::bucket_policy{.cap_bytes = SIZE_MAX, .first_cap_bytes = SIZE_MAX, .rebuild_from_ready_order = false},
               ddp::dp_options{.gradient_as_bucket_view = true, .broadcast_parameters = false}, rargs...};
    void* buf = dp.bucket_grad(dp.plan().buckets[0].entries[0].param);
    const std::size_t count = m.elems;
    std::vector<double> t;
    for (int s = 0; s < o.warmup + o.steps; ++s) {
      dp.get_reducer().barrier();
      const auto t0 = clock_type::now();
      dp.get_reducer().allreduce(buf, count, ddp::dtype::f32, ddp::op::avg);
      if (s >= o.warmup) t.push_back(ms_since(t0));
    }
    flat_ms = median(slowest(pg, t));
    if (o.flat) print_row(pg, "ddp_" + name + "_flat", m, model_mb, o.steps, {flat_ms, 0, flat_ms}, 0);
  }
  for (const auto& mode : o.modes) {
    const bool view = mode == "view";
    for (double cap : o.caps_mb) {
      const auto cap_bytes = static_cast<std::size_t>(cap * (1 << 20));
      // PyTorch's defaults: the first bucket capped at 1 MiB so that communication starts early.
      dp_type dp{pg, e.views, ddp::bucket_policy{.cap_bytes = cap_bytes, .first_cap_bytes = std::min(cap_bytes, 1_MiB)},
                 ddp::dp_options{.gradient_as_bucket_view = view, .broadcast_parameters = false}, rargs...};
      const row r = time_steps(pg, dp, e, view, o, compute_model{});
      print_row(pg, "ddp_" + name + "_" + mode, m, cap, o.steps, r, 0);
    }
    if (o.auto_cap && !view) {
      // The wrapper tunes during its first synchronized steps, run exactly as time_steps runs
      // them (no_sync step, barrier, synchronized step); then the usual warm-up and measurement.
      dp_type dp{pg, e.views, ddp::bucket_policy{.autotune = true},
                 ddp::dp_options{.broadcast_parameters = false}, rargs...};
      compute_model none{};
      for (int s = 0; !dp.autotune_report().done; ++s) {
        {
          auto guard = dp.no_sync();
          backward(dp, e, false, 1.0f, none);
          dp.finish();
        }
        dp.get_reducer().barrier();
        backward(dp, e, false, 1.0f / static_cast<float>(s + 1), none);
        dp.finish();
      }
      // Then the chosen cap as a fixed policy, measured alternately with the tuned wrapper (two
      // rounds each), so that load drifting during the run falls on both alike.
      const std::size_t chosen = dp.autotune_report().chosen_cap_bytes;
      dp_type fixed{pg, e.views, ddp::bucket_policy{.cap_bytes = chosen, .first_cap_bytes = std::min(chosen, 1_MiB)},
                    ddp::dp_options{.broadcast_parameters = false}, rargs...};
      row ra{}, rf{};
      for (int k = 0; k < 2; ++k) {
        const row a = time_steps(pg, dp, e, false, o, compute_model{});
        const row f = time_steps(pg, fixed, e, false, o, compute_model{});
        ra = {ra.step_ms + a.step_ms / 2, ra.nosync_ms + a.nosync_ms / 2, ra.exposed_ms + a.exposed_ms / 2};
        rf = {rf.step_ms + f.step_ms / 2, rf.nosync_ms + f.nosync_ms / 2, rf.exposed_ms + f.exposed_ms / 2};
      }
      const double chosen_mb = static_cast<double>(chosen) / (1 << 20);
      print_row(pg, "ddp_" + name + "_copy_auto", m, chosen_mb, o.steps, ra, 0);
      print_row(pg, "ddp_" + name + "_copy_autofixed", m, chosen_mb, o.steps, rf, 0);
    }
    if (o.compute) {
      const double compute_ms = o.compute_ms >= 0 ? o.compute_ms : flat_ms;
      dp_type dp{pg, e.views, ddp::bucket_policy{.cap_bytes = 25_MiB, .first_cap_bytes = 1_MiB},
                 ddp::dp_options{.gradient_as_bucket_view = view, .broadcast_parameters = false}, rargs...};
      compute_model cm{compute_ms * 1e6 / static_cast<double>(m.elems), o.spin, {}};
      const row r = time_steps(pg, dp, e, view, o, cm);
      print_row(pg, "ddp_" + name + "_" + mode + "_compute", m, 25, o.steps, r, compute_ms);
      if (!o.optim.empty()) {
        // Three rounds of (alone, sequential, overlapped), alternating, so that load drifting
        // during the run falls on all three alike.
        optimizer opt(e, o.optim == "adamw");
        std::vector<double> alone, seq, ovl;
        for (int k = 0; k < 3; ++k) {
          for (int how = 0; how < 3; ++how) {
            const auto t = time_optim(pg, dp, e, view, o, cm, opt, how);
            auto& into = how == 0 ? alone : how == 1 ? seq : ovl;
            into.insert(into.end(), t.begin(), t.end());
          }
        }
        const std::string base = "ddp_" + name + "_" + mode + "_" + o.optim;
        const double a = median(alone), sq = median(seq), ov = median(ovl);
        print_row(pg, base + "_alone", m, 25, o.steps, {a, 0, 0}, compute_ms);
        print_row(pg, base + "_sequential", m, 25, o.steps, {sq, 0, 0}, compute_ms);
        print_row(pg, base + "_overlapped", m, 25, o.steps, {ov, 0, 0}, compute_ms);
        if (pg.rank() == 0)
          std::fprintf(stderr, "%s %s %d ranks: optimizer %.2f ms, sequential %.2f ms, overlapped %.2f ms: %.0f%% of the "
                               "optimizer hidden (sync alone: %.2f ms exposed)\n",
                       base.c_str(), m.name.c_str(), pg.size(), a, sq, ov, a > 0 ? 100.0 * (sq - ov) / a : 0.0,
                       r.exposed_ms);
      }
    }
  }
}

void rank_main(const ddp::init_options& io, const options& o) {
  auto pg = ddp::init_process_group(io);
  const int rank = pg.rank(), world = pg.size();
  for (const auto& m : o.models) {
    engine e(m);
    for (const auto& red : o.reducers) {
      if (red == "default") {
        run_reducer<ddp::data_parallel::reducer_type, ddp::data_parallel::allocator_type>(pg, m, e, o, red);
      } else if (red == "ring_tcp") {
        run_reducer<ddp::ring<ddp::tcp>, ddp::host_allocator>(pg, m, e, o, red);
      } else if (red == "tree_tcp") {
        run_reducer<ddp::tree<ddp::tcp>, ddp::host_allocator>(pg, m, e, o, red);
      } else if (red == "ring_tcp_fp16") {
        run_reducer<ddp::hooked<ddp::ring<ddp::tcp>, ddp::fp16_compress>, ddp::host_allocator>(pg, m, e, o, red);
      } else if (red == "ring_tcp_bf16") {
        run_reducer<ddp::hooked<ddp::ring<ddp::tcp>, ddp::bf16_compress>, ddp::host_allocator>(pg, m, e, o, red);
      } else if (red == "tree_tcp_fp16") {
        run_reducer<ddp::hooked<ddp::tree<ddp::tcp>, ddp::fp16_compress>, ddp::host_allocator>(pg, m, e, o, red);
      } else if (red == "default_fp16") {
        run_reducer<ddp::hooked<ddp::auto_reducer, ddp::fp16_compress>, ddp::data_parallel::allocator_type>(pg, m, e, o, red);
      } else if (red == "default_fp8") {
        run_reducer<ddp::hooked<ddp::auto_reducer, ddp::fp8_compress>, ddp::data_parallel::allocator_type>(pg, m, e, o, red);
      } else if (red == "default_powersgd") {
        run_reducer<ddp::hooked<ddp::auto_reducer, ddp::powersgd>, ddp::data_parallel::allocator_type>(
            pg, m, e, o, red, ddp::powersgd{{.rank = 1, .start_iter = 0}});
#ifdef DDP_BENCH_HAS_SHM
      } else if (red == "ring_shm" || red == "tree_shm" || red == "ring_shm_fp16") {
        // The arena must hold every rank's buckets; tmpfs only backs the pages touched.
        const std::size_t per_rank = m.elems * 4 + (std::size_t{64} << 20);
        const ddp::shm_options so{.segment_bytes = per_rank * static_cast<std::size_t>(world)};
        if (red == "ring_shm")
          run_reducer<ddp::ring<ddp::shm>, ddp::shm_allocator>(pg, m, e, o, red, so, ddp::reducer_options{});
        else if (red == "ring_shm_fp16")
          run_reducer<ddp::hooked<ddp::ring<ddp::shm>, ddp::fp16_compress>, ddp::shm_allocator>(pg, m, e, o, red, so,
                                                                                              ddp::reducer_options{});
        else
          run_reducer<ddp::tree<ddp::shm>, ddp::shm_allocator>(pg, m, e, o, red, so, ddp::reducer_options{});
#endif
      } else if (rank == 0) {
        std::fprintf(stderr, "# reducer %s is not available in this build; skipped\n", red.c_str());
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse(argc, argv);
  const auto describe_models = [&] {
    for (auto& m : o.models)
      std::fprintf(stderr, "# %s: %zu parameters, %zu float32 elements, %zu bytes\n", m.name.c_str(), m.shapes.size(),
                   m.elems, m.elems * 4);
  };
  const char* header =
      "system,model,ranks,bucket_cap_mb,steps,step_median_ms,nosync_median_ms,sync_ms,exposed_median_ms,compute_ms\n";
  if (o.from_env) {
    // One rank of a launched group; rows come from rank 0.
    try {
      const auto io = ddp::init_options::from_env();
      if (io.rank == 0) {
        describe_models();
        std::fputs(header, stdout);
      }
      std::fflush(nullptr);
      rank_main(io, o);
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ddp_step: %s\n", e.what());
      return 1;
    }
  }
  describe_models();
  std::fputs(header, stdout);
  std::fflush(nullptr);
  int failed = 0;
  for (int n : o.ranks) {
    const int port = bench::free_port();
    std::vector<pid_t> kids;
    for (int r = 0; r < n; ++r) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        int code = 0;
        try {
          ddp::init_options io;
          io.rank = r;
          io.world_size = n;
          io.master_port = port;
          io.timeout = std::chrono::seconds(120);
          // DDP_BACKEND and DDP_DEBUG as a launched program reads them.
          const auto env = ddp::init_options::from_env([](const char* v) -> const char* {
            return std::string_view(v) == "DDP_BACKEND" || std::string_view(v) == "DDP_DEBUG" ? std::getenv(v) : nullptr;
          });
          io.backend = env.backend;
          io.debug_info = env.debug_info;
          rank_main(io, o);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank %d: %s\n", r, e.what());
          code = 1;
        }
        std::fflush(nullptr);
        ::_exit(code);
      }
      kids.push_back(pid);
    }
    for (pid_t k : kids) {
      int st = 0;
      ::waitpid(k, &st, 0);
      if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) ++failed;
    }
  }
  return failed == 0 ? 0 : 1;
}
