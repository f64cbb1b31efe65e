// Data-parallel training of an MLP written with Eigen: parameters and gradients are Eigen
// matrices and vectors, backward is written by hand, and ddp::eigen_parameters hands them to
// ddp::data_parallel, which averages the gradients across ranks while backward runs.
//
//   ddprun -n 4 build/examples/04_eigen                  # gradients in the engine's matrices
//   ddprun -n 4 build/examples/04_eigen --bucket-view    # backward writes into ddp's buckets
//
// Samples are the columns of a matrix. Each rank trains on its shard of a synthetic regression
// set (generated from a fixed seed, so every rank can build the whole set and take its part).
// Backward walks the layers last to first and hands each layer's gradients over as soon as
// they are final (params.grad_ready(dp, i)), so the last layer's bucket is reduced while the
// earlier layers are still computing.
//
// With --bucket-view (dp_options::gradient_as_bucket_view) the gradients live in bucket memory:
// backward writes through the Eigen::Map that params.grad_view<...>(dp, i) gives, and nothing
// is copied in or out of the buckets.
//
// At the end the program checks, and exits non-zero when a check fails:
//  - the final loss fell well below the first epoch's (below 1/4 of it);
//  - the final weights are bitwise equal on every rank (a hash of them, gathered from all);
//  - on rank 0: they match one process that trains the same model on the full batch of every
//    step (all shards at once); only the order of floating-point additions differs, so the
//    tolerance is relative 1e-5.
#include <ddp/adapters/eigen.hpp>

#include <ddp/ddp.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

constexpr int input_dim = 16;
constexpr int samples_per_rank = 1024;
constexpr int batch = 32;
constexpr int epochs = 12;
constexpr float learning_rate = 0.05f;
constexpr float momentum = 0.9f;
constexpr double tolerance = 1e-5;

// The synthetic task: a smooth nonlinear function of the input, the same on every rank.
struct dataset {
  Eigen::MatrixXf x;   // input_dim x n: one sample per column
  Eigen::RowVectorXf y;  // n
};

dataset make_dataset(int n) {
  std::mt19937 g(42);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const Eigen::RowVectorXf a = Eigen::RowVectorXf::NullaryExpr(input_dim, [&] { return u(g); });
  const Eigen::RowVectorXf b = Eigen::RowVectorXf::NullaryExpr(input_dim, [&] { return u(g); });
  dataset d;
  d.x = Eigen::MatrixXf::NullaryExpr(input_dim, n, [&] { return u(g); });
  const Eigen::RowVectorXf pa = a * d.x, pb = b * d.x;
  d.y = pa.array().sin() + 0.5f * pb.array().tanh() * pa.array();
  return d;
}

// A fully connected layer y = W x + b; tanh follows every layer but the last.
struct layer {
  Eigen::MatrixXf W, gW, vW;  // values, gradient, momentum: out x in
  Eigen::VectorXf b, gb, vb;  // out
  Eigen::MatrixXf input;      // saved for backward: in x batch
  // With --bucket-view: the gradients' home in ddp's buckets (else the Maps cover gW and gb).
  Eigen::Map<Eigen::MatrixXf> grad_W{nullptr, 0, 0};
  Eigen::Map<Eigen::VectorXf> grad_b{nullptr, 0};
};

// Rebinds a Map to other memory (Eigen's documented idiom: a Map is re-created in place).
template <class M>
void rebind(Eigen::Map<M>& map, Eigen::Map<M> to) {
  new (&map) Eigen::Map<M>(to.data(), to.rows(), to.cols());
}

class mlp {
 public:
  mlp(const std::vector<int>& dims, unsigned seed) : layers_(dims.size() - 1) {
    std::mt19937 g(seed);
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      auto& L = layers_[l];
      const int in = dims[l], out = dims[l + 1];
      std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(static_cast<float>(in)));
      L.W = Eigen::MatrixXf::NullaryExpr(out, in, [&] { return nd(g); });
      L.b = Eigen::VectorXf::Zero(out);
      L.gW = L.vW = Eigen::MatrixXf::Zero(out, in);
      L.gb = L.vb = Eigen::VectorXf::Zero(out);
      rebind(L.grad_W, Eigen::Map<Eigen::MatrixXf>(L.gW.data(), out, in));
      rebind(L.grad_b, Eigen::Map<Eigen::VectorXf>(L.gb.data(), out));
    }
  }
  mlp(const mlp&) = delete;  // the Maps point into this object's own matrices

  /// Registration order: weight then bias of each layer, first layer first (as a framework
  /// would list them). The matrices have their final sizes and no longer move.
  void register_with(ddp::eigen_parameters& params) {
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      params.add("fc" + std::to_string(l + 1) + ".weight", layers_[l].W, layers_[l].gW);
      params.add("fc" + std::to_string(l + 1) + ".bias", layers_[l].b, layers_[l].gb);
    }
  }

  /// View mode: backward and the optimizer use ddp's bucket memory from now on.
  template <class DataParallel>
  void use_buckets(const ddp::eigen_parameters& params, DataParallel& dp) {
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      rebind(layers_[l].grad_W, params.grad_view<Eigen::MatrixXf>(dp, 2 * l));
      rebind(layers_[l].grad_b, params.grad_view<Eigen::VectorXf>(dp, 2 * l + 1));
    }
  }

  /// Mean squared error over the columns of x; `ready(i)` is called for parameter i as soon as
  /// its gradient is final: last layer first.
  template <class Ready>
  float forward_backward(const Eigen::Ref<const Eigen::MatrixXf>& x, const Eigen::Ref<const Eigen::RowVectorXf>& y,
                         Ready&& ready) {
    Eigen::MatrixXf a = x;
    for (std::size_t l = 0; l < layers_.size(); ++l) {
      auto& L = layers_[l];
      L.input = a;
      a = (L.W * L.input).colwise() + L.b;
      if (l + 1 < layers_.size()) a = a.array().tanh().matrix();
    }
    const auto n = static_cast<float>(x.cols());
    const Eigen::MatrixXf err = a - y;
    Eigen::MatrixXf delta = (2.0f / n) * err;
    for (std::size_t l = layers_.size(); l-- > 0;) {
      auto& L = layers_[l];
      L.grad_W.noalias() = delta * L.input.transpose();
      L.grad_b = delta.rowwise().sum();
      // This layer's gradients are final: hand them over while the next layer is computed.
      ready(2 * l + 1);
      ready(2 * l);
      if (l == 0) break;
      // The derivative of tanh at the previous layer's output (this layer's input).
      delta = (L.W.transpose() * delta).cwiseProduct((1.0f - L.input.array().square()).matrix());
    }
    return err.squaredNorm() / n;
  }

  /// SGD with momentum on the gradients currently held (the averaged ones after finish()).
  void step() {
    for (auto& L : layers_) {
      L.vW = momentum * L.vW + L.grad_W;
      L.W -= learning_rate * L.vW;
      L.vb = momentum * L.vb + L.grad_b;
      L.b -= learning_rate * L.vb;
    }
  }

  const std::vector<layer>& layers() const { return layers_; }

  std::uint64_t hash() const {
    std::uint64_t h = 0xcbf29ce484222325ull;
    const auto mix = [&](const float* p, Eigen::Index n) {
      for (Eigen::Index k = 0; k < n; ++k) {
        std::uint32_t bits;
        std::memcpy(&bits, p + k, 4);
        h = (h ^ bits) * 0x100000001b3ull;
      }
    };
    for (const auto& L : layers_) {
      mix(L.W.data(), L.W.size());
      mix(L.b.data(), L.b.size());
    }
    return h;
  }

 private:
  std::vector<layer> layers_;  // sized once, in the constructor: the matrices never move
};

const std::vector<int> dims{input_dim, 64, 64, 1};

}  // namespace

int main(int argc, char** argv) try {
  using namespace ddp::literals;
  const bool bucket_view = argc > 1 && std::strcmp(argv[1], "--bucket-view") == 0;
  auto pg = ddp::init_process_group(ddp::init_options::from_env());
  const int rank = pg.rank(), world = pg.size();
  const dataset data = make_dataset(samples_per_rank * world);
  const int steps_per_epoch = samples_per_rank / batch;
  const auto shard = [&](int q, int s) { return q * samples_per_rank + s * batch; };  // first column

  // A different initialization on every rank: construction replaces it by rank 0's.
  mlp model(dims, 1234u + static_cast<unsigned>(rank));
  ddp::eigen_parameters params;
  model.register_with(params);
  ddp::data_parallel dp{pg, params, ddp::bucket_policy{.cap_bytes = 8_KiB, .first_cap_bytes = 512},
                        ddp::dp_options{.gradient_as_bucket_view = bucket_view}};
  if (bucket_view) model.use_buckets(params, dp);
  if (rank == 0)
    std::printf("ddp + Eigen: %d ranks, %zu parameters in %zu buckets, %d samples per rank, batch %d per rank, "
                "gradients %s\n",
                world, dp.size(), dp.plan().buckets.size(), samples_per_rank, batch,
                bucket_view ? "in bucket memory (gradient_as_bucket_view)" : "copied into the buckets");

  std::vector<double> epoch_loss;
  for (int e = 0; e < epochs; ++e) {
    double sum = 0;
    for (int s = 0; s < steps_per_epoch; ++s) {
      sum += model.forward_backward(data.x.middleCols(shard(rank, s), batch), data.y.segment(shard(rank, s), batch),
                                    [&](std::size_t i) { params.grad_ready(dp, i); });
      dp.finish();  // every rank now holds the gradient averaged over all ranks' batches
      model.step();
    }
    double loss = sum / steps_per_epoch;
    dp.get_reducer().allreduce(std::span<double>(&loss, 1), ddp::op::avg);  // mean over all shards
    epoch_loss.push_back(loss);
    if (rank == 0) std::printf("epoch %2d  loss %.6f\n", e + 1, loss);
  }
  params.check();  // the registered matrices still have the storage the wrapper points at

  bool ok = true;
  const double first = epoch_loss.front(), last = epoch_loss.back();
  if (rank == 0)
    std::printf("loss fell from %.6f to %.6f (%.1fx): %s\n", first, last, first / last,
                last < first / 4 ? "OK" : "FAILED");
  ok = ok && last < first / 4;

  // Bitwise equality of the weights: every rank's hash, gathered everywhere.
  char mine[32];
  std::snprintf(mine, sizeof mine, "%016llx", static_cast<unsigned long long>(model.hash()));
  const auto hashes = pg.all_gather(mine);
  const bool equal = std::all_of(hashes.begin(), hashes.end(), [&](const std::string& h) { return h == hashes[0]; });
  if (rank == 0)
    std::printf("final weights bitwise equal on all %d ranks (hash %s): %s\n", world, mine, equal ? "OK" : "FAILED");
  ok = ok && equal;

  if (rank == 0) {
    // One process, the full batch of every step: the columns of all shards at once. Its mean
    // over world * batch samples is the average of the shards' means, summed in another order.
    mlp ref(dims, 1234u);
    Eigen::MatrixXf x(input_dim, world * batch);
    Eigen::RowVectorXf y(world * batch);
    for (int e = 0; e < epochs; ++e)
      for (int s = 0; s < steps_per_epoch; ++s) {
        for (int q = 0; q < world; ++q) {
          x.middleCols(q * batch, batch) = data.x.middleCols(shard(q, s), batch);
          y.segment(q * batch, batch) = data.y.segment(shard(q, s), batch);
        }
        ref.forward_backward(x, y, [](std::size_t) {});
        ref.step();
      }
    double max_diff = 0;
    for (std::size_t l = 0; l < ref.layers().size(); ++l) {
      const auto& a = model.layers()[l];
      const auto& b = ref.layers()[l];
      const auto rel = [](const auto& u, const auto& v) {
        return static_cast<double>(((u - v).array().abs() / v.array().abs().max(1.0f)).maxCoeff());
      };
      max_diff = std::max({max_diff, rel(a.W, b.W), rel(a.b, b.b)});
    }
    const bool match = max_diff <= tolerance;
    std::printf("one process on the full batch: max relative difference of weights %.3g (tolerance %.0e): %s\n",
                max_diff, tolerance, match ? "OK" : "FAILED");
    ok = ok && match;
  }
  // Every rank exits with the verdict of all checks.
  double verdict = ok ? 0.0 : 1.0;
  dp.get_reducer().allreduce(std::span<double>(&verdict, 1), ddp::op::max);
  return verdict == 0.0 ? 0 : 1;
} catch (const ddp::error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
