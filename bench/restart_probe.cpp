// The ddp side of bench/restart_time.sh: a data-parallel training loop over a real model's
// parameter shapes (tests/data/*.params) that checkpoints every C steps and resumes from the
// checkpoint, run under `ddprun --max-restarts 1`. In the first run rank V kills itself
// (SIGKILL) as step K begins; rank 0 prints, for every step it completes,
//   step <n> run <restart count> at <ms since the epoch>
// and the victim prints `kill at <ms>` before the signal, so that the script can measure the
// time from the kill to the next completed step and the steps repeated.
//
//   ddprun -n 4 --max-restarts 1 build/bench/restart_probe tests/data/resnet50.params
//       --checkpoint /tmp/ckpt.ddp --steps 12 --kill-at 7 --victim 1 --every 5   (one line)
//
// --elastic [--signal KILL|STOP]: the same loop in an elastic group (ddp::elastic_group, under
// `ddprun --elastic 2:4`), no checkpoint: the victim kills or stops itself as step K begins,
// printing `kill at <ms> pid <pid>`, and the survivors re-form in place; rank 0 prints
// `step <n> run <0 before the failure, 1 after> at <ms>`. --steps counts committed steps.
//
// --sharded: the sharded mode (dp_options::shard) stepped with ddp::adamw, in both loops: in the
// elastic group its shards are replicated (2 holders each, the default there) and re-sharded in
// memory after the failure; in the restart loop the checkpoint holds the shards' AdamW state
// (sharded_state()), which the restarted run loads (load_sharded_state()).
//
// --kill-at -1: nobody fails (bench/elastic_overhead.sh times steady steps, elastic or plain;
// bench/restart_time.sh's link-cut row cuts a host's link from outside); without --checkpoint
// the plain loop saves nothing.
#include <ddp/ddp.hpp>
#if DDP_BENCH_ETCD
#include <ddp/etcd.hpp>  // DDP_STORE=etcd://... (ddprun --store)
#endif

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

namespace {

long long now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "restart_probe: %s\nusage: restart_probe FILE.params [--checkpoint FILE] [--steps N] [--kill-at K|-1] "
               "[--victim V] [--every C] [--elastic [--signal KILL|STOP]] [--sharded]\n",
               why);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 2) usage("no params file");
  std::string params_file = argv[1], ckpt, sig = "KILL";
  int steps = 12, kill_at = 7, victim = 1, every = 5;
  bool elastic = false, sharded = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] {
      if (i + 1 >= argc) usage(("missing value for " + a).c_str());
      return std::string(argv[++i]);
    };
    if (a == "--checkpoint")
      ckpt = value();
    else if (a == "--steps")
      steps = std::stoi(value());
    else if (a == "--kill-at")
      kill_at = std::stoi(value());
    else if (a == "--victim")
      victim = std::stoi(value());
    else if (a == "--every")
      every = std::stoi(value());
    else if (a == "--elastic")
      elastic = true;
    else if (a == "--sharded")
      sharded = true;
    else if (a == "--signal")
      sig = value();
    else
      usage(("unknown option " + a).c_str());
  }
  if (sig != "KILL" && sig != "STOP") usage("--signal takes KILL or STOP");

  // The model: one f32 tensor per line of the params file.
  std::ifstream in(params_file);
  if (!in) usage(("cannot read " + params_file).c_str());
  std::vector<std::string> names;
  std::vector<std::size_t> sizes;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string name;
    ls >> name;
    std::size_t n = 1;
    for (long long d; ls >> d;) n *= static_cast<std::size_t>(d);
    names.push_back(name);
    sizes.push_back(n);
  }
  std::vector<std::vector<float>> w(names.size()), g(names.size());
  for (std::size_t i = 0; i < names.size(); ++i) w[i].assign(sizes[i], 0.01f), g[i].assign(sizes[i], 0.0f);
  std::vector<ddp::tensor_view> params;
  for (std::size_t i = 0; i < names.size(); ++i) params.push_back(ddp::make_tensor_view(w[i], g[i], names[i]));

  const ddp::dp_options dp_opts{.shard = sharded};
  ddp::adamw adamw{{.lr = 1e-3, .weight_decay = 0.01}};
  // The plain loop's update, or the sharded mode's AdamW on this rank's shards (and gather).
  const auto update = [&](ddp::data_parallel& d) {
    if (sharded) {
      d.step(adamw);
      return;
    }
    for (std::size_t i = 0; i < names.size(); ++i)
      for (std::size_t k = 0; k < w[i].size(); ++k) w[i][k] -= 0.1f * g[i][k];
  };
  if (elastic) {
    const auto opts = ddp::init_options::from_env();
    const char* restarts = std::getenv("DDP_RESTART_COUNT");
    const bool first_run = restarts == nullptr || std::atoi(restarts) == 0;
    ddp::elastic_group eg{opts};
    std::optional<ddp::data_parallel> dp;
    eg.on_form([&](ddp::process_group& pg) {
      dp.reset();
      dp.emplace(pg, params, ddp::bucket_policy{}, dp_opts);
    });
    if (!eg.start()) return 0;
    bool killed = false;
    while (eg.step() < static_cast<std::uint64_t>(steps)) try {
        if (first_run && !killed && eg.step() == static_cast<std::uint64_t>(kill_at) && opts.rank == victim) {
          std::printf("kill at %lld pid %d\n", now_ms(), static_cast<int>(::getpid()));
          std::fflush(stdout);
          killed = true;
          ::raise(sig == "KILL" ? SIGKILL : SIGSTOP);
        }
        for (std::size_t i = names.size(); i-- > 0;) {
          std::fill(g[i].begin(), g[i].end(), 0.001f * static_cast<float>(eg.rank() + 1));
          dp->grad_ready(i);
        }
        dp->finish();
        eg.commit([&] { update(*dp); });
        if (eg.rank() == 0) {
          std::printf("step %llu run %d at %lld\n", static_cast<unsigned long long>(eg.step()),
                      eg.generation() > 0 ? 1 : 0, now_ms());
          std::fflush(stdout);
        }
      } catch (const ddp::error& e) {
        if (!eg.recover(e)) return 0;
      }
    eg.finish();
    return 0;
  }
  auto pg = ddp::init_process_group(ddp::init_options::from_env());
  const int rank = pg.rank();
  const char* restarts = std::getenv("DDP_RESTART_COUNT");
  const int run = restarts ? std::atoi(restarts) : 0;
  ddp::data_parallel dp{pg, params, {}, dp_opts};

  int first = 0;
  if (!ckpt.empty() && std::filesystem::exists(ckpt)) {
    // The checkpoint's extra bytes: the step count, then (sharded) the shards' AdamW state.
    const auto blob = ddp::load_checkpoint(pg, ckpt, params);
    std::int64_t done = 0;
    if (blob.size() >= sizeof done) std::memcpy(&done, blob.data(), sizeof done);
    if (sharded) dp.load_sharded_state(std::span(blob).subspan(sizeof done));
    first = static_cast<int>(done);
  }
  for (int s = first; s < steps; ++s) {
    if (run == 0 && s == kill_at && rank == victim) {
      std::printf("kill at %lld\n", now_ms());
      std::fflush(stdout);
      ::raise(SIGKILL);
    }
    // Backward, last layer first: each gradient is ready in turn.
    for (std::size_t i = names.size(); i-- > 0;) {
      std::fill(g[i].begin(), g[i].end(), 0.001f * static_cast<float>(rank + 1));
      dp.grad_ready(i);
    }
    dp.finish();
    update(dp);
    if (!ckpt.empty() && (s + 1) % every == 0) {
      const std::int64_t done = s + 1;
      std::vector<std::byte> extra(sizeof done);
      std::memcpy(extra.data(), &done, sizeof done);
      if (sharded) {
        const auto state = dp.sharded_state();  // rank 0's: every shard's
        extra.insert(extra.end(), state.begin(), state.end());
      }
      ddp::save_checkpoint(pg, ckpt, params, extra);
    }
    if (rank == 0) {
      std::printf("step %d run %d at %lld\n", s + 1, run, now_ms());
      std::fflush(stdout);
    }
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
