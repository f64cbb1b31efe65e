// Fully sharded data parallel (ZeRO-3, ddp::fully_sharded): a plain C++ engine with hand-written
// forward and backward passes, a stack of dense layers, says where each layer (a unit) begins
// and ends; between those points each rank holds only its shard of the layer's parameters,
// gradients and AdamW state. In the same run the same engine trains unsharded (the default
// wrapper averaging every gradient, each rank stepping the whole model with the same AdamW).
//
//   ddprun -n 4 build/examples/07_fully_sharded
//
// Forward: fs.gather(l) before layer l (its parameters all-gathered into the engine's own
// tensors, the next layer's gather started behind it), fs.release(l) after (their pages given
// back). Backward: fs.begin_backward(l) (gathered again, gradients zeroed), the layer's backward,
// fs.end_backward(l) (its gradients reduce-scattered while the next layer's backward runs, then
// released). Then fs.finish() and fs.step(adamw). Small layers (under 1e5 elements) stay whole.
//
// Rank 0's last line:
//   fully sharded: OK param_bytes_per_rank=P unsharded_param_bytes=U state_bytes_per_rank=S
//   max_weight_diff=D steps=N loss=L0->L1
// P: the parameter bytes this rank holds between steps (its shards, f32, and the whole small
// layers); U: the model's (every rank's, unsharded); S: this rank's AdamW state; D: the largest
// difference of any weight between the two runs after the last step (0 on 2 ranks: the
// reduce-scatter adds the two ranks' gradients as the allreduce does; within float rounding on
// more, where a shard boundary can change the order of the sum). The program exits non-zero
// when D exceeds 1e-6 relative, when P is not within 5% of the sharded layers' U / N plus the
// whole layers, when the ranks' weights differ, or when the loss did not fall.
#include <ddp/ddp.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

constexpr int input_dim = 32;
const std::vector<int> dims = {input_dim, 384, 384, 384, 1};  // 3 layers of 147k+ elements, 2 small
constexpr int batch = 16;   // per rank
constexpr int steps = 25;

/// The engine: dense layers, tanh between them; each layer's forward and backward on its own.
struct engine {
  struct layer {
    int in = 0, out = 0;
    std::vector<float> w, b, gw, gb;  // values and gradients (the wrapper releases them between uses)
    std::vector<float> input, output;
  };
  std::vector<layer> layers;
  std::vector<std::string> names;

  explicit engine(unsigned seed) {
    std::mt19937 g(seed);
    for (std::size_t l = 0; l + 1 < dims.size(); ++l) {
      layer L;
      L.in = dims[l], L.out = dims[l + 1];
      std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(static_cast<float>(L.in)));
      L.w.resize(static_cast<std::size_t>(L.in) * static_cast<std::size_t>(L.out));
      for (auto& v : L.w) v = nd(g);
      L.b.assign(static_cast<std::size_t>(L.out), 0.01f);
      L.gw.assign(L.w.size(), 0.0f);
      L.gb.assign(L.b.size(), 0.0f);
      layers.push_back(std::move(L));
    }
  }
  std::vector<ddp::tensor_view> parameters() {
    std::vector<ddp::tensor_view> p;
    names.clear();
    for (std::size_t l = 0; l < layers.size(); ++l)
      for (const char* k : {".weight", ".bias"}) names.push_back("fc" + std::to_string(l + 1) + k);
    for (std::size_t l = 0; l < layers.size(); ++l) {
      auto& L = layers[l];
      p.push_back(ddp::make_tensor_view(std::span{L.w}, std::span{L.gw}, names[2 * l], {L.out, L.in}));
      p.push_back(ddp::make_tensor_view(std::span{L.b}, std::span{L.gb}, names[2 * l + 1]));
    }
    return p;
  }
  std::vector<float> forward(std::size_t l, const std::vector<float>& x, int n) {
    auto& L = layers[l];
    L.input = x;
    L.output.assign(static_cast<std::size_t>(n * L.out), 0.0f);
    const bool hidden = l + 1 < layers.size();
    for (int s = 0; s < n; ++s)
      for (int o = 0; o < L.out; ++o) {
        float z = L.b[static_cast<std::size_t>(o)];
        const float* w = &L.w[static_cast<std::size_t>(o) * static_cast<std::size_t>(L.in)];
        const float* a = &L.input[static_cast<std::size_t>(s) * static_cast<std::size_t>(L.in)];
        for (int i = 0; i < L.in; ++i) z += w[i] * a[i];
        L.output[static_cast<std::size_t>(s * L.out + o)] = hidden ? std::tanh(z) : z;
      }
    return L.output;
  }
  /// Layer l's gradients (accumulated into gw, gb) and the delta for the layer below.
  std::vector<float> backward(std::size_t l, const std::vector<float>& delta, int n) {
    auto& L = layers[l];
    std::vector<float> prev(static_cast<std::size_t>(n * L.in), 0.0f);
    for (int s = 0; s < n; ++s)
      for (int o = 0; o < L.out; ++o) {
        const float d = delta[static_cast<std::size_t>(s * L.out + o)];
        L.gb[static_cast<std::size_t>(o)] += d;
        float* gw = &L.gw[static_cast<std::size_t>(o) * static_cast<std::size_t>(L.in)];
        const float* w = &L.w[static_cast<std::size_t>(o) * static_cast<std::size_t>(L.in)];
        const float* a = &L.input[static_cast<std::size_t>(s) * static_cast<std::size_t>(L.in)];
        float* p = &prev[static_cast<std::size_t>(s) * static_cast<std::size_t>(L.in)];
        for (int i = 0; i < L.in; ++i) {
          gw[i] += d * a[i];
          p[i] += d * w[i];
        }
      }
    if (l > 0)
      for (std::size_t k = 0; k < prev.size(); ++k) prev[k] *= 1.0f - L.input[k] * L.input[k];  // tanh'
    return prev;
  }
};

/// This rank's batch of step s: inputs and targets of a fixed smooth function.
void batch_of(int rank, int s, std::vector<float>& x, std::vector<float>& y) {
  std::mt19937 g(static_cast<unsigned>(1000 * s + rank));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  x.resize(static_cast<std::size_t>(batch * input_dim));
  y.resize(batch);
  for (int i = 0; i < batch; ++i) {
    float t = 0;
    for (int k = 0; k < input_dim; ++k) {
      const float v = u(g);
      x[static_cast<std::size_t>(i * input_dim + k)] = v;
      t += v * static_cast<float>((k % 5) - 2);
    }
    y[static_cast<std::size_t>(i)] = std::sin(0.3f * t);
  }
}

/// The loss and its gradient with respect to the output.
float loss_of(const std::vector<float>& out, const std::vector<float>& y, std::vector<float>& delta) {
  float loss = 0;
  delta.resize(out.size());
  for (std::size_t s = 0; s < out.size(); ++s) {
    const float e = out[s] - y[s];
    loss += e * e;
    delta[s] = 2.0f * e / static_cast<float>(out.size());
  }
  return loss / static_cast<float>(out.size());
}

}  // namespace

int main() try {
  auto pg = ddp::init_process_group(ddp::init_options::from_env());
  const int rank = pg.rank();
  engine sharded(42), whole(42);
  auto params = sharded.parameters();
  auto whole_params = whole.parameters();
  const std::size_t units = sharded.layers.size();

  ddp::fully_sharded fs{pg, params, std::vector<std::size_t>(units, 2)};
  ddp::data_parallel dp{pg, whole_params};
  ddp::adamw opt{{.lr = 2e-3, .weight_decay = 0.01}};
  std::vector<std::vector<float>> whole_state;
  for (const auto& p : whole_params) whole_state.emplace_back(opt.state_per_element() * p.numel, 0.0f);

  std::vector<float> x, y, delta;
  float first = 0, last = 0;
  for (int s = 0; s < steps; ++s) {
    batch_of(rank, s, x, y);
    // The fully sharded run: each layer between its unit's points.
    std::vector<float> a = x;
    for (std::size_t l = 0; l < units; ++l) {
      fs.gather(l);
      a = sharded.forward(l, a, batch);
      fs.release(l);
    }
    const float loss = loss_of(a, y, delta);
    for (std::size_t l = units; l-- > 0;) {
      fs.begin_backward(l);  // parameters back, gradients zero
      delta = sharded.backward(l, delta, batch);
      fs.end_backward(l);
    }
    fs.finish();
    fs.step(opt);
    // The unsharded run.
    a = x;
    for (std::size_t l = 0; l < units; ++l) a = whole.forward(l, a, batch);
    loss_of(a, y, delta);
    for (auto& L : whole.layers) std::fill(L.gw.begin(), L.gw.end(), 0.0f), std::fill(L.gb.begin(), L.gb.end(), 0.0f);
    for (std::size_t l = units; l-- > 0;) {
      delta = whole.backward(l, delta, batch);
      dp.grad_ready(2 * l + 1);
      dp.grad_ready(2 * l);
    }
    dp.finish();
    for (std::size_t i = 0; i < whole_params.size(); ++i)
      opt.step(ddp::shard_step{0, static_cast<std::uint64_t>(s + 1),
                               std::span<float>(static_cast<float*>(whole_params[i].data), whole_params[i].numel),
                               std::span<const float>(static_cast<const float*>(whole_params[i].grad), whole_params[i].numel),
                               std::span<float>(whole_state[i]), {}});
    if (s == 0) first = loss;
    last = loss;
  }

  // Held between steps, before the final gather: this rank's shards and the whole layers.
  const std::size_t param_bytes = fs.param_bytes(), model = fs.model_bytes(), state = fs.state_bytes();
  std::size_t whole_layers = 0, sharded_layers = 0;
  for (std::size_t u = 0; u < units; ++u) {
    const auto [p0, count] = fs.unit_parameters(u);
    std::size_t b = 0;
    for (std::size_t i = p0; i < p0 + count; ++i) b += params[i].bytes();
    (fs.whole(u) ? whole_layers : sharded_layers) += b;
  }
  const double ideal = static_cast<double>(sharded_layers) / pg.size() + 2.0 * static_cast<double>(whole_layers);
  fs.gather_all();  // the trained weights into the engine's tensors, to compare

  float diff = 0, scale = 0;
  std::string mine;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const auto* p = static_cast<const float*>(params[i].data);
    const auto* q = static_cast<const float*>(whole_params[i].data);
    mine.append(reinterpret_cast<const char*>(p), params[i].bytes());
    for (std::size_t k = 0; k < params[i].numel; ++k)
      diff = std::max(diff, std::fabs(p[k] - q[k])), scale = std::max(scale, std::fabs(q[k]));
  }
  const auto all = pg.all_gather(mine);
  bool same = true;
  for (const auto& h : all) same = same && h == all[0];
  const bool close = diff <= 1e-6f * scale;
  const bool small = static_cast<double>(param_bytes) <= 1.05 * ideal;
  const bool learned = last < first;
  if (rank == 0) {
    if (!same) std::printf("FAILED: the ranks hold different weights\n");
    if (!close) std::printf("FAILED: max weight difference %g (largest weight %g)\n", static_cast<double>(diff), static_cast<double>(scale));
    if (!small) std::printf("FAILED: %zu parameter bytes on this rank, more than 1.05 x %.0f\n", param_bytes, ideal);
    if (!learned) std::printf("FAILED: the loss did not fall (%g -> %g)\n", static_cast<double>(first), static_cast<double>(last));
    if (same && close && small && learned)
      std::printf("fully sharded: OK param_bytes_per_rank=%zu unsharded_param_bytes=%zu state_bytes_per_rank=%zu "
                  "max_weight_diff=%g steps=%d loss=%.4f->%.4f\n",
                  param_bytes, model, state, static_cast<double>(diff), steps, static_cast<double>(first),
                  static_cast<double>(last));
  }
  return same && close && small && learned ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
