// Elastic data-parallel training (ddp::elastic_group, docs/elastic.md): the MLP of 01_mlp keeps
// training while ranks die, freeze or are cut off, and takes replacements in.
//
//   ddprun -n 4 --elastic 2:4 --max-restarts 30 build/examples/05_elastic --min-seconds 70
//
// Every step is committed on every rank or on none (ddp::elastic_group::commit); a failed step
// is dropped, the survivors re-form with fresh ranks, and a replacement that ddprun starts gets
// the weights, the momentum and the data position from the new rank 0. The data is dealt by
// ddp::distributed_sampler; after a change of size the rest of the epoch is dealt over the new
// world (resume), so that no sample of an epoch is skipped or seen twice.
//
// Checks, in every committed step and at the end (the run exits non-zero when one fails):
//  - contributors: a parameter of elastic_max slots whose gradient on rank r is `world` in slot
//    r and 0 elsewhere; averaged, slot q is 1 for every rank q of the generation and 0 beyond:
//    each committed step's average is over exactly the ranks that committed it;
//  - the final weights are bitwise equal on every rank (a hash, gathered from all);
//  - the final loss over the whole dataset is the loss of the group's run replayed in one
//    process (the same steps, each at the size the group had then, the data dealt as the ranks
//    dealt it): bitwise where the reducer adds in rank order, within 0.1% otherwise. A run of
//    more than 3000 steps is held at its step 3000: every rank that committed it keeps a copy of
//    the weights then, and the replay of 3000 steps must match that copy's loss the same way
//    (only if no rank of the final group saw step 3000, a group of newcomers, the final loss
//    must be within 25% (+0.002) of the replay's: later steps need not lower a noisy loss). The
//    final loss is below a quarter of the first step's.
// The last line of the final rank 0 is `elastic: OK steps=<n> failures=<k> sizes=<a,b,...>
// generations=<g>`: the committed steps, the failures survived, the world sizes seen (each once).
//
// --min-seconds S: train at least S seconds (and at least --steps N steps, 300 by default), so
// that a punisher has time; --stop-file F: and until F exists (the punisher's "done"). Rank 0
// decides when to stop, through the contributors' last slot. --ready-file F: rank 0 creates F
// once the first step is committed (a punisher that strikes before it would only test the
// first formation).
//
// Built with libsodium, it proves the group's secret when DDP_AUTH_TOKEN is set
// (docs/security.md). Built with libcurl and nlohmann/json, DDP_STORE=etcd://... (ddprun --store)
// puts the group's store on an etcd cluster (docs/cluster.md).
#include <ddp/ddp.hpp>
#include <ddp/group/elastic.hpp>
#include <ddp/sampler.hpp>
#if DDP_EXAMPLE_SODIUM
#include <ddp/auth/sodium.hpp>
#endif
#if DDP_EXAMPLE_ETCD
#include <ddp/etcd.hpp>
#endif

#include "elastic_verdict.hpp"
#include "mlp_model.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

using namespace mlp_example;

namespace {

constexpr int dataset_size = 4096;
constexpr int batch = 16;  // per rank
constexpr std::uint64_t reference_steps = 3000;  // at most, in the uninterrupted run

// Appends the bytes of `v` to `out`; reads them back from `in` at `at`.
template <class T>
void put(std::string& out, const std::vector<T>& v) {
  out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}
template <class T>
void get(std::string_view in, std::size_t& at, std::vector<T>& v) {
  const std::size_t n = v.size() * sizeof(T);
  if (in.size() - at < n) throw std::runtime_error("05_elastic: rank 0's state is not this model's");
  std::memcpy(v.data(), in.data() + at, n);
  at += n;
}

// Mean squared error of `m` over the whole dataset.
double full_loss(mlp& m, const dataset& d) {
  double sum = 0;
  for (int s = 0; s < d.n; s += 256) {
    const int n = std::min(256, d.n - s);
    sum += static_cast<double>(m.forward_backward(d.x.data() + static_cast<std::size_t>(s) * input_dim,
                                                  d.y.data() + s, n, [](std::size_t) {})) * n;
  }
  return sum / d.n;
}

// The run the group made, replayed in one process: the same steps, each at the size the group
// had then (`history`: the step at which each generation began and its size, in order), the
// data dealt as the ranks dealt it (each generation resumes the epoch where the last left it,
// distributed_sampler::resume), the gradients averaged in rank order as the default reducer
// does. Nothing lost or applied twice, it ends bitwise where the group ended.
double replayed_loss(const dataset& d, const std::vector<std::uint64_t>& history, std::uint64_t steps) {
  mlp ref(dims, 1234u);
  ddp::distributed_sampler all{static_cast<std::uint64_t>(d.n), 0, 1, {.shuffle = true, .seed = 7}};
  all.set_epoch(0);
  std::uint64_t epoch = 0, consumed = 0, from = 0, k = 0;  // from: where the current share began
  std::size_t next = 0;
  int world = 1;
  std::vector<float> x(static_cast<std::size_t>(batch) * input_dim), y(batch);
  auto& L = ref.layers();
  std::vector<std::vector<float>> sw(L.size()), sb(L.size());
  for (std::uint64_t s = 0; s < steps; ++s) {
    for (; next + 1 < history.size() && history[next] <= s; next += 2) {  // a generation began
      world = static_cast<int>(history[next + 1]);
      from = consumed;
      k = 0;
    }
    const auto w = static_cast<std::uint64_t>(world);
    if ((k + 1) * batch > (static_cast<std::uint64_t>(d.n) - from) / w) {  // the epoch is done
      all.set_epoch(++epoch);
      consumed = from = k = 0;
    }
    for (std::size_t l = 0; l < L.size(); ++l) {
      sw[l].assign(L[l].gw.size(), 0.0f);
      sb[l].assign(L[l].gb.size(), 0.0f);
    }
    for (std::uint64_t q = 0; q < w; ++q) {
      for (int i = 0; i < batch; ++i) {
        const auto idx = all[from + q + (k * batch + static_cast<std::uint64_t>(i)) * w];
        std::memcpy(&x[static_cast<std::size_t>(i) * input_dim], &d.x[idx * input_dim], input_dim * sizeof(float));
        y[static_cast<std::size_t>(i)] = d.y[idx];
      }
      ref.forward_backward(x.data(), y.data(), batch, [](std::size_t) {});
      for (std::size_t l = 0; l < L.size(); ++l) {
        for (std::size_t j = 0; j < sw[l].size(); ++j) sw[l][j] += L[l].gw[j];
        for (std::size_t j = 0; j < sb[l].size(); ++j) sb[l][j] += L[l].gb[j];
      }
    }
    for (std::size_t l = 0; l < L.size(); ++l) {
      for (std::size_t j = 0; j < sw[l].size(); ++j) L[l].gw[j] = sw[l][j] / static_cast<float>(world);
      for (std::size_t j = 0; j < sb[l].size(); ++j) L[l].gb[j] = sb[l][j] / static_cast<float>(world);
    }
    ref.step();
    consumed += w * batch;
    ++k;
  }
  return full_loss(ref, d);
}

}  // namespace

int main(int argc, char** argv) try {
  double min_seconds = 0;
  std::uint64_t min_steps = 300;
  std::string stop_file, ready_file;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--min-seconds" && i + 1 < argc) {
      min_seconds = std::atof(argv[++i]);
    } else if (a == "--steps" && i + 1 < argc) {
      min_steps = static_cast<std::uint64_t>(std::atoll(argv[++i]));
    } else if (a == "--stop-file" && i + 1 < argc) {
      stop_file = argv[++i];
    } else if (a == "--ready-file" && i + 1 < argc) {
      ready_file = argv[++i];
    } else {
      std::fprintf(stderr, "usage: 05_elastic [--min-seconds S] [--steps N] [--stop-file F] [--ready-file F]\n");
      return 2;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
#if DDP_EXAMPLE_SODIUM
  ddp::install_authenticator(&ddp::sodium_authenticator::make);
#endif
  const auto opts = ddp::init_options::from_env();
  ddp::elastic_group eg{opts, {.verbose = true}};
  const int max_world = eg.options().elastic_max;
  const dataset data = make_dataset(dataset_size);

  // A different initialization on every process: each generation's construction replaces it by
  // rank 0's, so a replacement starts from the group's weights.
  const char* replacement = std::getenv("DDP_RESTART_COUNT");
  mlp model(dims, 1234u + static_cast<unsigned>(opts.rank) + (replacement && std::atoi(replacement) > 0 ? 77u : 0u));
  auto params = model.parameters();
  // The contributors: slot q < max_world counts rank q; the last slot carries rank 0's "stop".
  std::vector<float> count_w(static_cast<std::size_t>(max_world) + 1, 0.0f), count_g(count_w.size(), 0.0f);
  params.push_back(ddp::make_tensor_view(count_w, count_g, "contributors"));
  // A replacement built with another model is refused before it takes a seat.
  std::string signature;
  for (const auto& p : params) {
    signature += std::string(p.name) + "[";
    for (auto d : p.shape) signature += std::to_string(d) + ",";
    signature += "] ";
  }
  eg.signature(signature);

  // What a replacement needs besides the weights: the epoch, the data position, whether the
  // group is done training, the momentum and the first loss.
  std::uint64_t epoch = 0, consumed = 0;
  std::vector<std::uint64_t> history;  // the step at which each generation began, and its size
  double first_loss = -1;
  std::optional<mlp> at_reference;  // the weights when step reference_steps was committed
  bool stop = false, counts_ok = true;
  eg.on_state(
      [&] {
        std::string s;
        put(s, std::vector<std::uint64_t>{epoch, consumed, stop ? 1u : 0u});
        put(s, std::vector<double>{first_loss});
        put(s, std::vector<std::uint64_t>{history.size()});
        put(s, history);
        for (auto& L : model.layers()) {
          put(s, L.vw);
          put(s, L.vb);
        }
        return s;
      },
      [&](std::string_view s) {
        std::size_t at = 0;
        std::vector<std::uint64_t> pos(3);
        std::vector<double> fl(1);
        get(s, at, pos);
        get(s, at, fl);
        std::vector<std::uint64_t> hn(1);
        get(s, at, hn);
        history.assign(hn[0], 0);
        get(s, at, history);
        for (auto& L : model.layers()) {
          get(s, at, L.vw);
          get(s, at, L.vb);
        }
        epoch = pos[0];
        consumed = pos[1];
        stop = pos[2] != 0;
        first_loss = fl[0];
      });
  std::optional<ddp::data_parallel> dp;
  eg.on_form([&](ddp::process_group& pg) {
    dp.reset();
    dp.emplace(pg, params, ddp::bucket_policy{.cap_bytes = 8 << 10, .first_cap_bytes = 512});
  });
  const auto finished_without_me = [] {
    std::printf("the job finished while this process had no seat in the group\n");
    return 0;
  };
  if (!eg.start()) return finished_without_me();

  std::optional<ddp::distributed_sampler> sampler;
  int sampler_gen = -1;
  std::uint64_t k = 0;  // steps taken from the current share
  std::vector<float> x(static_cast<std::size_t>(batch) * input_dim), y(batch);
  std::string bad_count;
  while (!stop) try {
      const int rank = eg.rank(), world = eg.size();
      if (sampler_gen != eg.generation()) {  // a new generation: deal the rest of the epoch over it
        history.push_back(eg.step());
        history.push_back(static_cast<std::uint64_t>(world));
        sampler.emplace(static_cast<std::uint64_t>(data.n), rank, world,
                        ddp::sampler_options{.shuffle = true, .seed = 7, .drop_last = true});
        sampler->resume(epoch, consumed);
        sampler_gen = eg.generation();
        k = 0;
      }
      if ((k + 1) * batch > sampler->size()) {  // the epoch is done
        sampler->resume(++epoch, consumed = 0);
        k = 0;
      }
      for (int i = 0; i < batch; ++i) {
        const auto idx = (*sampler)[k * batch + static_cast<std::uint64_t>(i)];
        std::memcpy(&x[static_cast<std::size_t>(i) * input_dim], &data.x[idx * input_dim], input_dim * sizeof(float));
        y[static_cast<std::size_t>(i)] = data.y[idx];
      }
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::fill(count_g.begin(), count_g.end(), 0.0f);
      count_g[static_cast<std::size_t>(rank)] = static_cast<float>(world);
      if (rank == 0 && elapsed >= min_seconds && eg.step() + 1 >= min_steps &&
          (stop_file.empty() || std::filesystem::exists(stop_file)))
        count_g.back() = static_cast<float>(world);
      const float loss = model.forward_backward(x.data(), y.data(), batch, [&](std::size_t i) { dp->grad_ready(i); });
      dp->grad_ready(params.size() - 1);
      dp->finish();
      eg.commit([&] {
        for (int q = 0; q < max_world; ++q) {
          const float want = q < world ? 1.0f : 0.0f;
          if (count_g[static_cast<std::size_t>(q)] != want && bad_count.empty()) {
            counts_ok = false;
            bad_count = "step " + std::to_string(eg.step()) + ": slot " + std::to_string(q) + " holds " +
                        std::to_string(count_g[static_cast<std::size_t>(q)]) + " in a world of " + std::to_string(world);
          }
        }
        stop = count_g.back() == 1.0f;
        model.step();
        consumed += static_cast<std::uint64_t>(world * batch);
        ++k;
        if (first_loss < 0) first_loss = loss;
      });
      if (eg.step() == reference_steps) at_reference.emplace(model);
      if (!ready_file.empty() && eg.rank() == 0 && eg.step() == 1) std::ofstream(ready_file) << "ready\n";
    } catch (const ddp::error& e) {
      std::fprintf(stderr, "[ddp.elastic] rank %d: %s\n", eg.rank(), e.what());
      if (!eg.recover(e)) return finished_without_me();
    }

  // The final checks, as collectives of the last generation (re-formed too if a rank is lost
  // here): the weights' hash from every rank, the contributors' verdict, the final loss.
  for (;;) try {
      // "<hash> <counts ok> <loss at step reference_steps, or -1>"
      char mine[96];
      std::snprintf(mine, sizeof mine, "%016llx %d %.17g", static_cast<unsigned long long>(model.hash()),
                    counts_ok ? 1 : 0, at_reference ? full_loss(*at_reference, data) : -1.0);
      const auto all = eg.group().all_gather(mine);
      const bool equal = std::all_of(all.begin(), all.end(), [&](const std::string& h) {
        return h.substr(0, 16) == all[0].substr(0, 16);
      });
      const bool counted = std::all_of(all.begin(), all.end(), [](const std::string& h) { return h[17] == '1'; });
      double loss_at_reference = -1;  // from any rank that committed step reference_steps
      for (const auto& h : all) loss_at_reference = std::max(loss_at_reference, std::atof(h.c_str() + 19));
      int code = equal && counted ? 0 : 1;
      if (eg.rank() == 0) {
        const double final_loss = full_loss(model, data);
        // The group's run replayed in one process (replayed_loss): nothing lost, applied twice or
        // averaged over the wrong ranks, it ends where the group ended, bitwise where the reducer
        // adds in rank order (the default on one host), within 0.1% where it adds in another order
        // (a ring over TCP). A run longer than reference_steps is held at its step
        // reference_steps (the replay of that many steps takes rank 0 a few seconds) through the
        // copy of the weights kept then. Only where no rank of the final group committed that
        // step is the final loss held to the replay's loosely, as SGD's loss on this toy problem
        // is noisy (a run at 2 ranks once ended at 2.1x its loss at step 3000). (Held instead to
        // an uninterrupted run at one size, a run whose size changed early was once 1.3-3x off
        // after 700-2000 steps with every step accounted for: this toy problem's trajectory
        // depends on how the data was dealt.)
        const std::uint64_t ref_steps = std::min<std::uint64_t>(eg.step(), reference_steps);
        const double ref = replayed_loss(data, history, ref_steps);
        const bool whole = ref_steps == eg.step();
        const double held = whole ? final_loss : loss_at_reference;  // the group's loss at ref_steps
        const bool bitwise = held >= 0 && ref == held;
        const bool close = (held >= 0 ? std::abs(held - ref) <= 1e-3 * ref : final_loss <= 1.25 * ref + 0.002) &&
                           final_loss < first_loss / 4;
        std::printf("final weights bitwise equal on all %d ranks: %s\n", eg.size(), equal ? "OK" : "FAILED");
        std::printf("every committed step averaged over exactly its generation's ranks: %s%s%s\n",
                    counted ? "OK" : "FAILED", bad_count.empty() ? "" : ": ", bad_count.c_str());
        std::printf("final loss %.9g, loss at step %llu %.9g, the same %llu steps replayed in one process (%zu "
                    "generations) %.9g%s, first step %.6f: %s\n",
                    final_loss, static_cast<unsigned long long>(ref_steps), held,
                    static_cast<unsigned long long>(ref_steps), history.size() / 2, ref, bitwise ? " (bitwise)" : "",
                    first_loss, close ? "OK" : "FAILED");
        if (!close) code = 1;
      }
      return elastic_example::conclude(eg, "elastic", code);
    } catch (const ddp::error& e) {
      std::fprintf(stderr, "[ddp.elastic] rank %d (final checks): %s\n", eg.rank(), e.what());
      if (!eg.recover(e)) return finished_without_me();
    }
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
