// Gloo allreduce (float32 sum) on N local ranks over TCP loopback, in ddp's sweep format.
//
//   gloo_allreduce --ranks 2 --algo ring_chunked,halving_doubling,allreduce_ring
//
// The program forks its own ranks. Each algorithm in --algo gets a fresh set of processes and
// a fresh context: mixing Gloo's legacy algorithm classes with gloo::allreduce in one context
// produced 44 ms stalls here, which would be measured as the algorithm's cost.
#include "sweep.hpp"

#include <gloo/allreduce.h>
#include <gloo/allreduce_bcube.h>
#include <gloo/allreduce_halving_doubling.h>
#include <gloo/allreduce_ring.h>
#include <gloo/allreduce_ring_chunked.h>
#include <gloo/barrier.h>
#include <gloo/barrier_all_to_all.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr std::string_view algo_list =
    "ring_chunked|halving_doubling|bcube|ring|allreduce_ring|allreduce_bcube[,...]";
constexpr const char* default_algos = "ring_chunked,halving_doubling,allreduce_ring,allreduce_bcube";

bool is_legacy(const std::string& algo) { return algo.rfind("allreduce_", 0) != 0; }

// One timed collective: `run()` reduces `buf` in place across the context.
struct collective {
  std::function<void()> run;
  std::function<void()> barrier;
};

// Legacy algorithms set up their pairs' buffers at construction and are run repeatedly, as
// Caffe2 used them; gloo::allreduce builds its options per call, as PyTorch's ProcessGroupGloo
// does, so that cost is part of what is measured.
collective make_collective(const std::string& algo, const std::shared_ptr<gloo::Context>& ctx,
                           float* buf, int count, std::shared_ptr<void>& keep) {
  const std::vector<float*> ptrs{buf};
  if (is_legacy(algo)) {
    auto barrier = std::make_shared<gloo::BarrierAllToAll>(ctx);
    std::shared_ptr<gloo::Algorithm> alg;
    if (algo == "ring_chunked")
      alg = std::make_shared<gloo::AllreduceRingChunked<float>>(ctx, ptrs, count);
    else if (algo == "halving_doubling")
      alg = std::make_shared<gloo::AllreduceHalvingDoubling<float>>(ctx, ptrs, count);
    else if (algo == "bcube")
      alg = std::make_shared<gloo::AllreduceBcube<float>>(ctx, ptrs, count);
    else if (algo == "ring")
      alg = std::make_shared<gloo::AllreduceRing<float>>(ctx, ptrs, count);
    else
      throw std::invalid_argument("unknown algorithm " + algo);
    keep = alg;
    return {[alg] { alg->run(); }, [barrier] { barrier->run(); }};
  }
  gloo::AllreduceOptions::Algorithm which;
  if (algo == "allreduce_ring") which = gloo::AllreduceOptions::Algorithm::RING;
  else if (algo == "allreduce_bcube") which = gloo::AllreduceOptions::Algorithm::BCUBE;
  else throw std::invalid_argument("unknown algorithm " + algo);
  // Tags must match across ranks per collective; every rank issues the same sequence.
  auto tag = std::make_shared<uint32_t>(0);
  auto run = [ctx, buf, count, which, tag] {
    gloo::AllreduceOptions opts(ctx);
    opts.setAlgorithm(which);
    opts.setOutput(buf, static_cast<std::size_t>(count));
    opts.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, std::size_t)>(&gloo::sum<float>));
    opts.setTag((*tag)++);
    gloo::allreduce(opts);
  };
  auto barrier = [ctx, tag] {
    gloo::BarrierOptions opts(ctx);
    opts.setTag((*tag)++);
    gloo::barrier(opts);
  };
  return {run, barrier};
}

std::vector<char> to_bytes(const std::vector<double>& v) {
  std::vector<char> out(v.size() * sizeof(double));
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

std::vector<double> from_bytes(const std::vector<char>& b) {
  std::vector<double> out(b.size() / sizeof(double));
  std::memcpy(out.data(), b.data(), out.size() * sizeof(double));
  return out;
}

// Body of one rank; returns the process exit status.
int run_rank(const sweep::options& o, const std::string& algo, const std::string& store_dir,
             int rank) {
  gloo::rendezvous::FileStore file_store(store_dir);
  gloo::rendezvous::PrefixStore store(algo, file_store);
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, o.ranks);
  ctx->setTimeout(std::chrono::seconds(120));
  ctx->connectFullMesh(store, dev);

  int status = 0;
  for (std::size_t bytes : sweep::sizes(o)) {
    const int count = static_cast<int>(bytes / sizeof(float));
    const int iters = sweep::iters_for(o, bytes);
    const int warmup = sweep::warmup_for(o, bytes);
    // Zeros while timing: sums of equal nonzero inputs grow geometrically and would reach inf
    // within a few dozen iterations; zeros cost the same and stay finite.
    std::vector<float> buf(static_cast<std::size_t>(count), 0.0f);
    std::shared_ptr<void> keep;
    collective c = make_collective(algo, ctx, buf.data(), count, keep);

    std::vector<double> us;
    us.reserve(static_cast<std::size_t>(iters));
    for (int i = 0; i < warmup + iters; ++i) {
      c.barrier();
      auto t0 = std::chrono::steady_clock::now();
      c.run();
      auto t1 = std::chrono::steady_clock::now();
      if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }

    std::fill(buf.begin(), buf.end(), static_cast<float>(rank + 1));
    c.barrier();
    c.run();
    if (std::size_t wrong = sweep::count_wrong(buf.data(), buf.size(), o.ranks)) {
      std::fprintf(stderr, "gloo %s rank %d: %zu of %d elements wrong at %zu bytes\n",
                   algo.c_str(), rank, wrong, count, bytes);
      status = 1;
    }

    const std::string key = "t/" + std::to_string(bytes) + "/";
    store.set(key + std::to_string(rank), to_bytes(us));
    if (rank == 0) {
      std::vector<double> worst = us;
      for (int r = 1; r < o.ranks; ++r) {
        const std::string k = key + std::to_string(r);
        store.wait({k});
        auto theirs = from_bytes(store.get(k));
        for (std::size_t i = 0; i < worst.size() && i < theirs.size(); ++i)
          worst[i] = std::max(worst[i], theirs[i]);
      }
      sweep::print_row("gloo", algo, o.ranks, bytes, iters, sweep::summarize(worst));
    }
    // Nobody frees buffers the legacy algorithm's pairs still reference while a peer sends.
    c.barrier();
  }
  return status;
}

// Starts o.ranks processes for one algorithm and waits for all of them.
int run_algo(const sweep::options& o, const std::string& algo, const std::string& store_dir) {
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < o.ranks; ++r) {
    pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      return 1;
    }
    if (pid == 0) {
      int status = 1;
      try {
        status = run_rank(o, algo, store_dir, r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "gloo %s rank %d: %s\n", algo.c_str(), r, e.what());
      }
      std::fflush(stdout);
      std::_Exit(status);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int ws = 0;
    if (waitpid(pid, &ws, 0) < 0 || !WIFEXITED(ws) || WEXITSTATUS(ws) != 0) ++failed;
  }
  if (failed) std::fprintf(stderr, "gloo %s: %d of %d ranks failed\n", algo.c_str(), failed, o.ranks);
  return failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  sweep::options o = sweep::parse(argc, argv, algo_list);
  const auto algos = sweep::split(o.algo.empty() ? default_algos : o.algo);
  for (const auto& a : algos) {
    if (a != "ring_chunked" && a != "halving_doubling" && a != "bcube" && a != "ring" &&
        a != "allreduce_ring" && a != "allreduce_bcube") {
      std::fprintf(stderr, "%s: unknown --algo '%s'\n", argv[0], a.c_str());
      sweep::usage(argv[0], algo_list);
      return 2;
    }
  }
  char dir_template[] = "/tmp/gloo_allreduce.XXXXXX";
  if (!mkdtemp(dir_template)) {
    std::perror("mkdtemp");
    return 1;
  }
  sweep::print_header();
  int status = 0;
  for (const auto& a : algos) status |= run_algo(o, a, dir_template);
  std::error_code ec;
  std::filesystem::remove_all(dir_template, ec);
  return status;
}
