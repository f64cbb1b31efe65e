// The model of the MLP examples (01_mlp, 05_elastic): a synthetic regression set and a small
// fully connected network with its own forward and backward, written in plain C++, trained by
// SGD with momentum. Backward calls ready(i) as each parameter's gradient is final, last layer
// first, as a framework's autograd hook would.
#pragma once

#include <ddp/parameter.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace mlp_example {

constexpr int input_dim = 16;
constexpr float learning_rate = 0.05f;
constexpr float momentum = 0.9f;

// The synthetic task: a smooth nonlinear function of the input, the same on every rank.
struct dataset {
  std::vector<float> x, y;  // x: n * input_dim, y: n
  int n = 0;
};

inline dataset make_dataset(int n) {
  std::mt19937 g(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> a(input_dim), b(input_dim);
  for (auto& v : a) v = u(g);
  for (auto& v : b) v = u(g);
  dataset d;
  d.n = n;
  d.x.resize(static_cast<std::size_t>(n) * input_dim);
  d.y.resize(static_cast<std::size_t>(n));
  for (int s = 0; s < n; ++s) {
    float pa = 0, pb = 0;
    for (int k = 0; k < input_dim; ++k) {
      const float v = u(g);
      d.x[static_cast<std::size_t>(s) * input_dim + k] = v;
      pa += a[static_cast<std::size_t>(k)] * v;
      pb += b[static_cast<std::size_t>(k)] * v;
    }
    d.y[static_cast<std::size_t>(s)] = std::sin(pa) + 0.5f * std::tanh(pb) * pa;
  }
  return d;
}

// A fully connected layer y = W x + b; tanh follows every layer but the last.
struct layer {
  int in = 0, out = 0;
  std::vector<float> w, b, gw, gb, vw, vb;  // values, gradients, momentum
  std::vector<float> input, output;         // saved for backward: batch * in, batch * out
};

class mlp {
 public:
  mlp(std::vector<int> dims, unsigned seed) {
    std::mt19937 g(seed);
    for (std::size_t l = 0; l + 1 < dims.size(); ++l) {
      layer L;
      L.in = dims[l];
      L.out = dims[l + 1];
      std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(static_cast<float>(L.in)));
      L.w.resize(static_cast<std::size_t>(L.in * L.out));
      for (auto& v : L.w) v = nd(g);
      L.b.assign(static_cast<std::size_t>(L.out), 0.0f);
      L.gw.assign(L.w.size(), 0.0f);
      L.gb.assign(L.b.size(), 0.0f);
      L.vw.assign(L.w.size(), 0.0f);
      L.vb.assign(L.b.size(), 0.0f);
      layers_.push_back(std::move(L));
    }
  }

  /// Registration order: weight then bias of each layer, first layer first (as a framework
  /// would list them); the names outlive the views.
  std::vector<ddp::tensor_view> parameters() {
    std::vector<ddp::tensor_view> p;
    names_.clear();
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      names_.push_back("fc" + std::to_string(l + 1) + ".weight");
      names_.push_back("fc" + std::to_string(l + 1) + ".bias");
    }
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      auto& L = layers_[l];
      p.push_back(ddp::make_tensor_view(L.w, L.gw, names_[2 * l], {L.out, L.in}));
      p.push_back(ddp::make_tensor_view(L.b, L.gb, names_[2 * l + 1]));
    }
    return p;
  }

  /// Mean squared error over the batch; gradients overwrite gw/gb. `ready(i)` is called for
  /// parameter i as soon as its gradient is final: last layer first.
  float forward_backward(const float* x, const float* y, int n, const std::function<void(std::size_t)>& ready) {
    // Forward.
    std::vector<float> cur(x, x + static_cast<std::size_t>(n) * input_dim);
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      auto& L = layers_[l];
      L.input = cur;
      L.output.assign(static_cast<std::size_t>(n * L.out), 0.0f);
      const bool hidden = l + 1 < layers_.size();
      for (int s = 0; s < n; ++s)
        for (int o = 0; o < L.out; ++o) {
          float z = L.b[static_cast<std::size_t>(o)];
          for (int i = 0; i < L.in; ++i)
            z += L.w[static_cast<std::size_t>(o * L.in + i)] * L.input[static_cast<std::size_t>(s * L.in + i)];
          L.output[static_cast<std::size_t>(s * L.out + o)] = hidden ? std::tanh(z) : z;
        }
      cur = L.output;
    }
    // Loss and its gradient with respect to the output.
    float loss = 0;
    std::vector<float> delta(static_cast<std::size_t>(n));
    for (int s = 0; s < n; ++s) {
      const float e = cur[static_cast<std::size_t>(s)] - y[s];
      loss += e * e;
      delta[static_cast<std::size_t>(s)] = 2.0f * e / static_cast<float>(n);
    }
    // Backward, last layer first.
    for (std::size_t l = layers_.size(); l-- > 0;) {
      auto& L = layers_[l];
      std::fill(L.gw.begin(), L.gw.end(), 0.0f);
      std::fill(L.gb.begin(), L.gb.end(), 0.0f);
      for (int s = 0; s < n; ++s)
        for (int o = 0; o < L.out; ++o) {
          const float d = delta[static_cast<std::size_t>(s * L.out + o)];
          L.gb[static_cast<std::size_t>(o)] += d;
          for (int i = 0; i < L.in; ++i)
            L.gw[static_cast<std::size_t>(o * L.in + i)] += d * L.input[static_cast<std::size_t>(s * L.in + i)];
        }
      // This layer's gradients are final: hand them over while the next layer is computed.
      ready(2 * l + 1);
      ready(2 * l);
      if (l == 0) break;
      std::vector<float> prev(static_cast<std::size_t>(n * L.in), 0.0f);
      for (int s = 0; s < n; ++s)
        for (int i = 0; i < L.in; ++i) {
          float acc = 0;
          for (int o = 0; o < L.out; ++o)
            acc += delta[static_cast<std::size_t>(s * L.out + o)] * L.w[static_cast<std::size_t>(o * L.in + i)];
          const float a = L.input[static_cast<std::size_t>(s * L.in + i)];  // tanh output of layer l-1
          prev[static_cast<std::size_t>(s * L.in + i)] = acc * (1.0f - a * a);
        }
      delta = std::move(prev);
    }
    return loss / static_cast<float>(n);
  }

  /// SGD with momentum on the gradients currently held (the averaged ones after finish()).
  void step() {
    for (auto& L : layers_) {
      for (std::size_t k = 0; k < L.w.size(); ++k) {
        L.vw[k] = momentum * L.vw[k] + L.gw[k];
        L.w[k] -= learning_rate * L.vw[k];
      }
      for (std::size_t k = 0; k < L.b.size(); ++k) {
        L.vb[k] = momentum * L.vb[k] + L.gb[k];
        L.b[k] -= learning_rate * L.vb[k];
      }
    }
  }

  std::vector<layer>& layers() { return layers_; }

  std::uint64_t hash() const {
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (auto& L : layers_)
      for (const auto* v : {&L.w, &L.b})
        for (float f : *v) {
          std::uint32_t bits;
          std::memcpy(&bits, &f, 4);
          for (int k = 0; k < 4; ++k) h = (h ^ ((bits >> (8 * k)) & 0xff)) * 0x100000001b3ull;
        }
    return h;
  }

 private:
  std::vector<layer> layers_;
  std::vector<std::string> names_;
};

inline const std::vector<int> dims{input_dim, 64, 64, 1};

}  // namespace mlp_example
