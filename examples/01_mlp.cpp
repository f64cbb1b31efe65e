// Data-parallel training of a small MLP written in plain C++: its own forward and backward, and
// ddp::data_parallel averaging the gradients across ranks while backward runs.
//
//   ddprun -n 4 build/examples/01_mlp [--compress fp16|bf16|fp8|powersgd] [--checkpoint FILE [--fail-at-epoch E [--fail-rank R]]]
//
// Each rank trains on its shard of a synthetic regression set (generated from a fixed seed, so
// every rank can build the whole set and take its part). Backward walks the layers last to
// first and calls grad_ready(i) as soon as a layer's gradients are complete, so the last
// layer's bucket is being reduced while the earlier layers are still computing.
//
// At the end the program checks, and exits non-zero when a check fails:
//  - the final loss fell well below the first epoch's (below 1/4 of it);
//  - the final weights are bitwise equal on every rank (a hash of them, gathered from all);
//  - on rank 0: they match a single-process run, computed here too, that trains the same model
//    on all shards at once, averaging the shards' gradients as ddp does; the only difference is
//    the order of floating-point additions in the reduction, so the tolerance is 1e-4.
//
// --compress fp16|bf16 sends the gradient buckets as 16-bit floats (ddp::hooked with
// ddp::fp16_compress or ddp::bf16_compress over the default reducer, docs/tuning.md). The
// gradients then differ from the single-process run by the compression's rounding as well, so
// the tolerance of that check is 1e-2 (fp16) or 5e-2 (bf16); the other checks stay.
// --compress fp8 sends them as block-scaled e4m3 (ddp::fp8_compress, error feedback on): the
// final loss is compared with the single-process run's, within fp8_loss_tolerance (relative);
// fp8-no-feedback turns error feedback off (docs/tuning.md shows what that costs).
// --compress powersgd sends them as rank-2 PowerSGD factors (ddp::powersgd, plain allreduce for
// the first epoch): a different descent, so instead of the weights the final loss is compared
// with the single-process run's, within loss_tolerance (relative); the other checks stay.
//
// --checkpoint FILE saves the model (weights, momentum, the epochs done) with
// ddp::save_checkpoint after every epoch, and a run that finds FILE resumes from it with
// ddp::load_checkpoint: what `ddprun --max-restarts K` needs to pick a job up where a failed rank
// left it. The checks above hold for a resumed run as for an uninterrupted one (the reference
// run is the same). --fail-at-epoch E makes rank R (--fail-rank, 1 by default) kill itself
// (SIGKILL) as epoch E begins, in the first run only (DDP_RESTART_COUNT unset or 0): the
// launcher's restart test.
#include <ddp/data_parallel.hpp>
#include <ddp/ddp.hpp>
#include <ddp/reducer/compress.hpp>
#include <ddp/reducer/fp8_compress.hpp>
#include <ddp/reducer/hooked.hpp>
#include <ddp/reducer/powersgd.hpp>

#include "mlp_model.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using namespace mlp_example;

constexpr int samples_per_rank = 1024;
constexpr int batch = 32;
constexpr int epochs = 12;
constexpr double tolerance = 1e-4;
constexpr double loss_tolerance = 0.25;  // --compress powersgd: final loss against the uncompressed run's
constexpr double fp8_loss_tolerance = 0.005;  // --compress fp8: the same (0.05 without error feedback)


}  // namespace

// Trains with the wrapper `dp`; returns the process's exit code (0: every check passed).
template <class DP>
int train(ddp::process_group& pg, DP& dp, mlp& model, const std::vector<ddp::tensor_view>& params, const char* compress);

// Where a run saves and resumes (--checkpoint), and the epoch whose start rank 1 does not
// survive in the first run (--fail-at-epoch; -1: none).
std::string checkpoint_path;
int fail_at_epoch = -1;
int fail_rank = 1;

int main(int argc, char** argv) try {
  const char* compress = "none";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--compress" && i + 1 < argc) {
      compress = argv[++i];
    } else if (a == "--checkpoint" && i + 1 < argc) {
      checkpoint_path = argv[++i];
    } else if (a == "--fail-at-epoch" && i + 1 < argc) {
      fail_at_epoch = std::atoi(argv[++i]);
    } else if (a == "--fail-rank" && i + 1 < argc) {
      fail_rank = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: 01_mlp [--compress none|fp16|bf16|fp8|fp8-no-feedback|powersgd] [--checkpoint FILE [--fail-at-epoch E [--fail-rank R]]]\n");
      return 2;
    }
  }
  const std::string c = compress;
  if (c != "none" && c != "fp16" && c != "bf16" && c != "powersgd" && c != "fp8" && c != "fp8-no-feedback") {
    std::fprintf(stderr, "01_mlp: --compress takes none, fp16, bf16, fp8, fp8-no-feedback or powersgd, not '%s'\n",
                 compress);
    return 2;
  }
  using namespace ddp::literals;
  auto pg = ddp::init_process_group(ddp::init_options::from_env());
  const int rank = pg.rank();
  // A different initialization on every rank: construction replaces it by rank 0's.
  mlp model(dims, 1234u + static_cast<unsigned>(rank));
  auto params = model.parameters();
  const ddp::bucket_policy buckets{.cap_bytes = 8_KiB, .first_cap_bytes = 512};
  if (c == "fp16") {
    ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ddp::auto_reducer, ddp::fp16_compress>> dp{pg, params, buckets};
    return train(pg, dp, model, params, compress);
  }
  if (c == "bf16") {
    ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ddp::auto_reducer, ddp::bf16_compress>> dp{pg, params, buckets};
    return train(pg, dp, model, params, compress);
  }
  if (c == "fp8" || c == "fp8-no-feedback") {
    ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ddp::auto_reducer, ddp::fp8_compress>> dp{
        pg, params, buckets, ddp::dp_options{}, ddp::fp8_compress{{.error_feedback = c == "fp8"}}};
    return train(pg, dp, model, params, compress);
  }
  if (c == "powersgd") {
    // Rank 2, after one epoch (samples_per_rank / batch steps) of plain allreduce.
    ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ddp::auto_reducer, ddp::powersgd>> dp{
        pg, params, buckets, ddp::dp_options{}, ddp::powersgd{{.rank = 2, .start_iter = samples_per_rank / batch}}};
    return train(pg, dp, model, params, compress);
  }
  ddp::data_parallel dp{pg, params, buckets};
  return train(pg, dp, model, params, compress);
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}

// The state a resumed run needs besides the weights: the epochs done, the first epoch's loss
// (the loss check compares with it) and the momentum, which is the same on every rank.
std::vector<std::byte> resume_state(mlp& model, int epochs_done, double first_loss) {
  std::vector<std::byte> out(sizeof(std::int64_t) + sizeof(double));
  const std::int64_t e = epochs_done;
  std::memcpy(out.data(), &e, sizeof e);
  std::memcpy(out.data() + sizeof e, &first_loss, sizeof first_loss);
  for (const auto& L : model.layers())
    for (const auto* v : {&L.vw, &L.vb}) {
      const auto* p = reinterpret_cast<const std::byte*>(v->data());
      out.insert(out.end(), p, p + v->size() * sizeof(float));
    }
  return out;
}

// Applies what resume_state wrote; returns the epochs done.
int resume_from(mlp& model, const std::vector<std::byte>& in, double& first_loss) {
  std::size_t need = sizeof(std::int64_t) + sizeof(double);
  for (const auto& L : model.layers()) need += (L.vw.size() + L.vb.size()) * sizeof(float);
  if (in.size() != need) throw std::runtime_error("01_mlp: the checkpoint's state is not this model's");
  std::int64_t e = 0;
  std::memcpy(&e, in.data(), sizeof e);
  std::memcpy(&first_loss, in.data() + sizeof e, sizeof first_loss);
  std::size_t at = sizeof e + sizeof first_loss;
  for (auto& L : model.layers())
    for (auto* v : {&L.vw, &L.vb}) {
      std::memcpy(v->data(), in.data() + at, v->size() * sizeof(float));
      at += v->size() * sizeof(float);
    }
  return static_cast<int>(e);
}

template <class DP>
int train(ddp::process_group& pg, DP& dp, mlp& model, const std::vector<ddp::tensor_view>& params, const char* compress) {
  const bool compressed = std::string(compress) != "none";
  const int rank = pg.rank(), world = pg.size();
  const dataset data = make_dataset(samples_per_rank * world);
  const int steps_per_epoch = samples_per_rank / batch;
  const auto shard_x = [&](int q, int s) {
    return data.x.data() + static_cast<std::size_t>(q * samples_per_rank + s * batch) * input_dim;
  };
  const auto shard_y = [&](int q, int s) { return data.y.data() + q * samples_per_rank + s * batch; };

  if (rank == 0)
    std::printf("ddp: %d ranks, %zu parameters in %zu buckets, %d samples per rank, batch %d per rank%s%s\n", world,
                dp.size(), dp.plan().buckets.size(), samples_per_rank, batch, compressed ? ", gradients compressed to " : "",
                compressed ? compress : "");

  std::vector<double> epoch_loss;
  double exposed_ms = 0, backward_ms = 0;
  int first_epoch = 0;
  double first_loss = 0;
  if (!checkpoint_path.empty() && std::filesystem::exists(checkpoint_path)) {
    // Rank 0 reads the file and hands every rank the same weights and state.
    first_epoch = resume_from(model, ddp::load_checkpoint(pg, checkpoint_path, params), first_loss);
    if (rank == 0) std::printf("resumed from %s after epoch %d\n", checkpoint_path.c_str(), first_epoch);
  }
  const char* restarts = std::getenv("DDP_RESTART_COUNT");
  const bool first_run = restarts == nullptr || std::atoi(restarts) == 0;
  for (int e = first_epoch; e < epochs; ++e) {
    if (e == fail_at_epoch && rank == fail_rank && first_run) std::raise(SIGKILL);
    double sum = 0;
    for (int s = 0; s < steps_per_epoch; ++s) {
      sum += model.forward_backward(shard_x(rank, s), shard_y(rank, s), batch, [&](std::size_t i) { dp.grad_ready(i); });
      dp.finish();  // every rank now holds the gradient averaged over all ranks' batches
      model.step();
      exposed_ms += dp.last_step_stats().exposed_ms;
      backward_ms += dp.last_step_stats().backward_ms;
    }
    double loss = sum / steps_per_epoch;
    dp.get_reducer().allreduce(std::span<double>(&loss, 1), ddp::op::avg);  // mean over all shards
    epoch_loss.push_back(loss);
    if (e == 0) first_loss = loss;
    if (rank == 0) std::printf("epoch %2d  loss %.6f\n", e + 1, loss);
    if (!checkpoint_path.empty()) {
      const auto state = resume_state(model, e + 1, first_loss);
      ddp::save_checkpoint(pg, checkpoint_path, params, std::span<const std::byte>(state));
    }
  }

  bool ok = true;
  const double first = first_loss, last = epoch_loss.empty() ? first_loss : epoch_loss.back();
  if (rank == 0)
    std::printf("loss fell from %.6f to %.6f (%.1fx): %s\n", first, last, first / last,
                last < first / 4 ? "OK" : "FAILED");
  ok = ok && last < first / 4;

  // Bitwise equality of the weights: every rank's hash, gathered everywhere.
  char mine[32];
  std::snprintf(mine, sizeof mine, "%016llx", static_cast<unsigned long long>(model.hash()));
  const auto hashes = pg.all_gather(mine);
  const bool equal = std::all_of(hashes.begin(), hashes.end(), [&](const std::string& h) { return h == hashes[0]; });
  if (rank == 0) std::printf("final weights bitwise equal on all %d ranks (hash %s): %s\n", world, mine, equal ? "OK" : "FAILED");
  ok = ok && equal;

  if (rank == 0) {
    // The same training in one process: all shards' gradients, averaged, then one step.
    mlp ref(dims, 1234u);
    std::vector<std::vector<float>> sum_w(ref.layers().size()), sum_b(ref.layers().size());
    double ref_last = 0;  // its last epoch's mean loss, over all shards
    for (int e = 0; e < epochs; ++e)
      for (int s = 0; s < steps_per_epoch; ++s) {
        for (std::size_t l = 0; l < ref.layers().size(); ++l) {
          sum_w[l].assign(ref.layers()[l].gw.size(), 0.0f);
          sum_b[l].assign(ref.layers()[l].gb.size(), 0.0f);
        }
        for (int q = 0; q < world; ++q) {
          const double l = ref.forward_backward(shard_x(q, s), shard_y(q, s), batch, [](std::size_t) {});
          if (e == epochs - 1) ref_last += l / (world * steps_per_epoch);
          for (std::size_t l = 0; l < ref.layers().size(); ++l) {
            for (std::size_t k = 0; k < sum_w[l].size(); ++k) sum_w[l][k] += ref.layers()[l].gw[k];
            for (std::size_t k = 0; k < sum_b[l].size(); ++k) sum_b[l][k] += ref.layers()[l].gb[k];
          }
        }
        for (std::size_t l = 0; l < ref.layers().size(); ++l) {
          for (std::size_t k = 0; k < sum_w[l].size(); ++k) ref.layers()[l].gw[k] = sum_w[l][k] / static_cast<float>(world);
          for (std::size_t k = 0; k < sum_b[l].size(); ++k) ref.layers()[l].gb[k] = sum_b[l][k] / static_cast<float>(world);
        }
        ref.step();
      }
    double max_diff = 0;
    for (std::size_t l = 0; l < ref.layers().size(); ++l) {
      const auto& a = model.layers()[l];
      const auto& b = ref.layers()[l];
      for (std::size_t k = 0; k < a.w.size(); ++k) max_diff = std::max(max_diff, static_cast<double>(std::abs(a.w[k] - b.w[k])));
      for (std::size_t k = 0; k < a.b.size(); ++k) max_diff = std::max(max_diff, static_cast<double>(std::abs(a.b[k] - b.b[k])));
    }
    // With compression the 16-bit rounding of every gradient is part of the difference: a looser
    // bound, still far below what a broken compression gives (weights are of order 0.1-1).
    const std::string c = compress;
    if (c == "powersgd" || c.starts_with("fp8")) {
      const double rel = std::abs(last - ref_last) / ref_last;
      const double tol = c == "powersgd" ? loss_tolerance : c == "fp8" ? fp8_loss_tolerance : 10 * fp8_loss_tolerance;
      const bool close = rel <= tol;
      std::printf("single-process run on the full batch: final loss %.6f, this run's %.6f (%.2f%% apart, tolerance "
                  "%.1f%%; weights %.3g apart): %s\n",
                  ref_last, last, 100 * rel, 100 * tol, max_diff, close ? "OK" : "FAILED");
      ok = ok && close;
    } else {
      const double bound = c == "fp16" ? 1e-2 : c == "bf16" ? 5e-2 : tolerance;
      const bool match = max_diff <= bound;
      std::printf("single-process run on the full batch: max |difference| of weights %.3g (tolerance %.0e%s%s): %s\n",
                  max_diff, bound, compressed ? ", " : "", compressed ? compress : "", match ? "OK" : "FAILED");
      ok = ok && match;
    }
    const double steps = static_cast<double>(std::max(1, (epochs - first_epoch) * steps_per_epoch));
    std::printf("per step: backward %.3f ms, communication left exposed after backward %.3f ms\n",
                backward_ms / steps, exposed_ms / steps);
  }
  // Every rank exits with the verdict of all checks.
  double verdict = ok ? 0.0 : 1.0;
  dp.get_reducer().allreduce(std::span<double>(&verdict, 1), ddp::op::max);
  return verdict == 0.0 ? 0 : 1;
}
