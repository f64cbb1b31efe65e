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
//
// Built with LibTorch (the `torch` feature), the default engine is LibTorch instead: a small
// causal transformer (ddp::torch_fully_sharded, each block a unit, the root module the rest),
// autograd driving the units' backward, against the same model under ddp::torch_data_parallel.
// `--engine plain` runs the plain engine there too. For the side-by-side with PyTorch's FSDP2:
//   ddprun -n 2 build/examples/07_fully_sharded --steps 50 --init init.bin --losses ddp.txt
//   python3 examples/07_fully_sharded_fsdp2.py --init init.bin --ranks 2 --steps 50 --compare ddp.txt
// (scripts/fsdp2_loss_curve.sh runs both).
#include <ddp/ddp.hpp>
#ifdef DDP_EXAMPLE_LIBTORCH
#include <ddp/adapters/libtorch.hpp>

#include "tensor_file.hpp"
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

constexpr int input_dim = 32;
const std::vector<int> dims = {input_dim, 384, 384, 384, 1};  // 3 layers of 147k+ elements, 2 small
constexpr int batch = 16;                                     // per rank
int steps = 25;

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

/// The plain engine's run; the process's exit code.
int run_plain(ddp::process_group& pg) {
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
      opt.step(ddp::shard_step{
          0,
          static_cast<std::uint64_t>(s + 1),
          std::span<float>(static_cast<float*>(whole_params[i].data), whole_params[i].numel),
          std::span<const float>(static_cast<const float*>(whole_params[i].grad), whole_params[i].numel),
          std::span<float>(whole_state[i]),
          {}});
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
    if (!close)
      std::printf("FAILED: max weight difference %g (largest weight %g)\n", static_cast<double>(diff),
                  static_cast<double>(scale));
    if (!small) std::printf("FAILED: %zu parameter bytes on this rank, more than 1.05 x %.0f\n", param_bytes, ideal);
    if (!learned)
      std::printf("FAILED: the loss did not fall (%g -> %g)\n", static_cast<double>(first), static_cast<double>(last));
    if (same && close && small && learned)
      std::printf(
          "fully sharded: OK param_bytes_per_rank=%zu unsharded_param_bytes=%zu state_bytes_per_rank=%zu "
          "max_weight_diff=%g steps=%d loss=%.4f->%.4f\n",
          param_bytes, model, state, static_cast<double>(diff), steps, static_cast<double>(first),
          static_cast<double>(last));
  }
  return same && close && small && learned ? 0 : 1;
}

#ifdef DDP_EXAMPLE_LIBTORCH
namespace gpt {

constexpr int vocab = 64, seq = 32, dim = 128, heads = 4, blocks = 2, rows = 8, batches = 25;

/// A pre-norm transformer block: causal self-attention and an MLP, each with a residual.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
    proj = register_module("proj", torch::nn::Linear(dim, dim));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    fc1 = register_module("fc1", torch::nn::Linear(dim, 4 * dim));
    fc2 = register_module("fc2", torch::nn::Linear(4 * dim, dim));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto B = x.size(0), T = x.size(1);
    auto qkv3 = qkv(ln1(x)).view({B, T, 3, heads, dim / heads}).permute({2, 0, 3, 1, 4});
    auto q = qkv3[0], k = qkv3[1], v = qkv3[2];
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(dim / heads)));
    auto mask = torch::ones({T, T}, torch::kBool).triu(1);
    att = torch::softmax(att.masked_fill(mask, -std::numeric_limits<float>::infinity()), -1);
    auto y = torch::matmul(att, v).transpose(1, 2).reshape({B, T, dim});
    auto h = x + proj(y);
    return h + fc2(torch::gelu(fc1(ln2(h))));
  }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    pos = register_parameter("pos", torch::randn({seq, dim}) * 0.02);
    tok = register_module("tok", torch::nn::Embedding(vocab, dim));
    for (int b = 0; b < blocks; ++b) layers.push_back(register_module("block" + std::to_string(b), Block()));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    head = register_module("head", torch::nn::Linear(dim, vocab));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    auto h = tok(idx) + pos.narrow(0, 0, idx.size(1));
    for (auto& b : layers) h = through ? through(b, h) : b->forward(h);
    return head(ln_f(h));
  }
  torch::Tensor pos;
  torch::nn::Embedding tok{nullptr};
  std::vector<Block> layers;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
  std::function<torch::Tensor(Block&, const torch::Tensor&)> through;  // a block through the wrapper
};
TORCH_MODULE(Net);

/// The dataset: `n` sequences of seq + 1 tokens, each an arithmetic progression modulo the
/// vocabulary (a start and a stride of 1, 2, 3 or 5), so the next token is learnable.
torch::Tensor dataset(int n) {
  std::mt19937 g(2026);
  auto d = torch::empty({n, seq + 1}, torch::kLong);
  auto a = d.accessor<std::int64_t, 2>();
  const int strides[] = {1, 2, 3, 5};
  for (int i = 0; i < n; ++i) {
    const int start = static_cast<int>(g() % vocab), stride = strides[g() % 4];
    for (int j = 0; j <= seq; ++j) a[i][j] = (start + stride * j) % vocab;
  }
  return d;
}

/// Rank r's batch of step s (as examples/07_fully_sharded_fsdp2.py takes it).
torch::Tensor batch_of(const torch::Tensor& data, int s, int rank, int world) {
  return data.narrow(0, ((s % batches) * world + rank) * rows, rows);
}

/// The loss of `forward` (the model's forward, or the root unit's through the wrapper) on batch b.
template <class Forward>
torch::Tensor loss_of(Forward&& forward, const torch::Tensor& b) {
  auto x = b.narrow(1, 0, seq), y = b.narrow(1, 1, seq);
  return torch::nn::functional::cross_entropy(forward(x).reshape({-1, vocab}), y.reshape({-1}));
}

}  // namespace gpt

/// The LibTorch engine's run; the process's exit code.
int run_libtorch(ddp::process_group& pg, const std::string& init, const std::string& losses) {
  using namespace gpt;
  torch::set_num_threads(1);
  const int rank = pg.rank(), world = pg.size();
  torch::manual_seed(42);
  Net net, whole;
  {  // the same initial weights in both (the wrapper makes rank 0's everyone's)
    torch::NoGradGuard g;
    auto a = net->parameters(), b = whole->parameters();
    for (std::size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
  }
  const auto data = dataset(batches * world * rows);
  if (rank == 0 && !init.empty()) {
    std::vector<std::pair<std::string, torch::Tensor>> ts;
    for (const auto& p : net->named_parameters()) ts.emplace_back(p.key(), p.value());
    ts.emplace_back("data", data);
    example::write_tensors(init, ts);
  }
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  for (auto& b : net->layers) units.push_back(b.ptr());
  units.push_back(net.ptr());
  ddp::torch_fully_sharded fs{pg, units, {.whole_below = 0}};
  net->through = [&fs](Block& b, const torch::Tensor& h) { return fs.forward(b, h); };
  ddp::torch_data_parallel dp{pg, *whole};
  const ddp::adamw_options hyper{.lr = 3e-3, .weight_decay = 0.01};
  ddp::adamw opt{hyper}, whole_opt{hyper};
  auto whole_params = whole->parameters();
  std::vector<std::vector<float>> whole_state;
  for (const auto& p : whole_params) whole_state.emplace_back(2 * static_cast<std::size_t>(p.numel()), 0.0f);

  std::vector<double> curve;
  for (int s = 0; s < steps; ++s) {
    const auto b = batch_of(data, s, rank, world);
    auto loss = loss_of([&](const torch::Tensor& x) { return fs.forward(net, x); }, b);  // each block a unit inside
    loss.backward();  // every unit's gradients reduce-scattered when this returns
    fs.step(opt);
    whole->zero_grad();
    loss_of([&](const torch::Tensor& x) { return whole->forward(x); }, b)
        .backward();  // averaged by torch_data_parallel
    {
      torch::NoGradGuard g;
      for (std::size_t i = 0; i < whole_params.size(); ++i) {
        const auto n = static_cast<std::size_t>(whole_params[i].numel());
        whole_opt.step(ddp::shard_step{0,
                                       static_cast<std::uint64_t>(s + 1),
                                       std::span<float>(whole_params[i].data_ptr<float>(), n),
                                       std::span<const float>(whole_params[i].grad().data_ptr<float>(), n),
                                       std::span<float>(whole_state[i]),
                                       {}});
      }
    }
    const float mine = loss.item().toFloat();
    double sum = 0;
    for (const auto& l : pg.all_gather(std::string(reinterpret_cast<const char*>(&mine), sizeof mine))) {
      float v = 0;
      std::memcpy(&v, l.data(), sizeof v);
      sum += v;
    }
    curve.push_back(sum / world);
  }
  if (rank == 0 && !losses.empty()) {
    std::ofstream f(losses);
    f.precision(9);
    for (const double l : curve) f << l << "\n";
    if (!f) throw std::runtime_error("cannot write " + losses);
  }

  auto& w = fs.wrapper();
  const std::size_t param_bytes = w.param_bytes(), model = w.model_bytes(), state = w.state_bytes();
  const std::size_t partial = w.partial_page_bytes();
  const double ideal = static_cast<double>(model) / world;
  w.gather_all();
  float diff = 0, scale = 0;
  std::string mine;
  auto a = net->parameters();
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, (a[i] - whole_params[i]).abs().max().item<float>());
    scale = std::max(scale, whole_params[i].abs().max().item<float>());
    auto c = a[i].contiguous();
    mine.append(static_cast<const char*>(c.data_ptr()), static_cast<std::size_t>(c.numel()) * sizeof(float));
  }
  const auto all = pg.all_gather(mine);
  bool same = true;
  for (const auto& h : all) same = same && h == all[0];
  const bool close = diff <= 1e-6f * scale;
  // The shards, and the partial pages at each released tensor's ends (LibTorch's allocations are
  // not page-aligned; those pages stay).
  const bool small = static_cast<double>(param_bytes) <= 1.05 * ideal + static_cast<double>(partial);
  const bool learned = curve.back() < (steps >= 20 ? 0.5 : 1.0) * curve.front();  // halved in 20 steps
  if (rank == 0) {
    if (!same) std::printf("FAILED: the ranks hold different weights\n");
    if (!close)
      std::printf("FAILED: max weight difference %g (largest weight %g)\n", static_cast<double>(diff),
                  static_cast<double>(scale));
    if (!small)
      std::printf("FAILED: %zu parameter bytes on this rank, more than 1.05 x %.0f + %zu\n", param_bytes, ideal,
                  partial);
    if (!learned) std::printf("FAILED: the loss did not fall (by half from 20 steps) (%g -> %g)\n", curve.front(), curve.back());
    if (same && close && small && learned)
      std::printf(
          "fully sharded: OK param_bytes_per_rank=%zu unsharded_param_bytes=%zu state_bytes_per_rank=%zu "
          "partial_page_bytes=%zu max_weight_diff=%g steps=%d loss=%.4f->%.4f engine=libtorch\n",
          param_bytes, model, state, partial, static_cast<double>(diff), steps, curve.front(), curve.back());
  }
  w.release_all();
  return same && close && small && learned ? 0 : 1;
}
#endif

int main(int argc, char** argv) try {
  std::string engine = "plain", init, losses;
#ifdef DDP_EXAMPLE_LIBTORCH
  engine = "libtorch";
#endif
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool more = i + 1 < argc;
    if (a == "--engine" && more)
      engine = argv[++i];
    else if (a == "--steps" && more)
      steps = std::stoi(argv[++i]);
    else if (a == "--init" && more)
      init = argv[++i];
    else if (a == "--losses" && more)
      losses = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--engine plain|libtorch] [--steps N] [--init FILE] [--losses FILE]\n", argv[0]);
      return 2;
    }
  }
  auto pg = ddp::init_process_group(ddp::init_options::from_env());
#ifdef DDP_EXAMPLE_LIBTORCH
  if (engine == "libtorch") return run_libtorch(pg, init, losses);
#endif
  if (engine != "plain") {
    std::fprintf(stderr, "engine '%s': this build has %s\n", engine.c_str(),
#ifdef DDP_EXAMPLE_LIBTORCH
                 "plain and libtorch"
#else
                 "only plain (LibTorch was not found)"
#endif
    );
    return 2;
  }
  return run_plain(pg);
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
