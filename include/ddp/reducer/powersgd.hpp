#pragma once
/// \file reducer/powersgd.hpp
/// `ddp::powersgd`: low-rank gradient compression (PowerSGD, Vogels et al. 2019) as a
/// communication hook for `ddp::hooked`, the algorithm of PyTorch's `powerSGD_hook` with its
/// defaults: rank 1, 1000 steps of plain allreduce first, error feedback, warm start.
///
/// For each f32 bucket of the data-parallel wrapper reduced with `op::avg` (or `op::sum`) over 2
/// or more ranks, once the bucket has been reduced `start_iter` times uncompressed:
/// 1. Each tensor of the bucket (`comm_bucket::tensors`) is viewed as a matrix M of rows =
///    its first dimension and cols = the rest. It is compressed when min_compression_rate *
///    (rows + cols) * r < rows * cols, r = min(rows, cols, rank); the rest (biases, norms,
///    vectors: "plain") is reduced as it is.
/// 2. Error feedback: M += this rank's error of the previous step.
/// 3. Q (cols x r; random on the first compressed step of the bucket, the previous step's Q
///    after: warm start) is orthogonalized (Gram-Schmidt), P = M Q, and one allreduce (sum)
///    carries the plain tensors and every P of the bucket together.
/// 4. P is orthogonalized, Q = M^T P, and a second allreduce (sum) carries every Q.
/// 5. M is replaced by P Q^T (divided by the number of ranks for avg), the plain tensors by
///    their average; the error kept is M - P Q^T for the next step.
/// The wire carries (plain + sum over compressed tensors of (rows + cols) r) elements instead of
/// the bucket's count: ResNet-50 at rank 1 about 1/100 of its 25.6 M elements.
///
/// Every rank ends with the same bits: P and Q are results of allreduces, the orthogonalization
/// and P Q^T are computed from them alone, and the random first Q comes from a generator seeded
/// by (seed, bucket) with only integer and IEEE-exact arithmetic, not the platform's libm. The
/// first call for each bucket agrees the options and the bucket's layout across ranks with one
/// small allreduce: ranks with different options get errc::mismatch naming them, not wrong
/// numbers. Where PyTorch keeps a zero column as NaN unless orthogonalization_epsilon is set,
/// this hook makes it zero (the approximation then drops that direction).
///
/// Differences from PyTorch's hook: the plain tensors and P share one allreduce (PyTorch runs
/// two), and the error is kept for compressed tensors only (PyTorch also stores each plain
/// tensor's local-minus-average, which sums to zero over the ranks and so never changes an
/// average). Buckets that are not the wrapper's (a program's own allreduce), not f32, not sum or
/// avg, or on one rank, pass through unchanged, as do buckets with nothing worth compressing.
///
/// \code
/// using dp_t = ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ddp::auto_reducer, ddp::powersgd>>;
/// dp_t dp{pg, params, ddp::bucket_policy{}, ddp::dp_options{}, ddp::powersgd{{.rank = 2, .start_iter = 10}}};
/// \endcode
/// See docs/tuning.md, "Communication hooks and compression".

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/fwd.hpp>
#include <ddp/reducer/hooked.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// PowerSGD's settings, named and defaulted as PyTorch's `PowerSGDState`.
struct powersgd_options {
  std::size_t rank = 1;             ///< matrix_approximation_rank (>= 1)
  std::uint64_t start_iter = 1000;  ///< start_powerSGD_iter: each bucket's first reductions are plain
  double min_compression_rate = 2;  ///< compress a tensor only when it shrinks at least this much
  bool error_feedback = true;       ///< use_error_feedback
  bool warm_start = true;           ///< reuse the last step's Q (else a fresh random Q each step)
  float orthogonalization_epsilon = 0;
  std::uint64_t seed = 0;  ///< the random first Q (the same on every rank)
};

namespace detail::psgd {

/// x (rows x r, row-major) orthogonalized column by column (Gram-Schmidt, as PyTorch's
/// `_orthogonalize_gram_schmidt`); a column of zeros stays zero when eps is 0.
inline void orthogonalize(float* x, std::size_t rows, std::size_t r, float eps) noexcept {
  for (std::size_t c = 0; c < r; ++c) {
    double ss = 0;
    for (std::size_t i = 0; i < rows; ++i) ss += static_cast<double>(x[i * r + c]) * x[i * r + c];
    const float norm = static_cast<float>(std::sqrt(ss)) + eps;
    const float inv = norm > 0 ? 1.0f / norm : 0.0f;
    for (std::size_t i = 0; i < rows; ++i) x[i * r + c] *= inv;
    for (std::size_t d = c + 1; d < r; ++d) {
      double dot = 0;
      for (std::size_t i = 0; i < rows; ++i) dot += static_cast<double>(x[i * r + c]) * x[i * r + d];
      const float f = static_cast<float>(dot);
      for (std::size_t i = 0; i < rows; ++i) x[i * r + d] -= f * x[i * r + c];
    }
  }
}

/// p (rows x r) = m (rows x cols) q (cols x r), after adding `err` (rows x cols; null: none)
/// into m row by row, so that the product reads each row while it is still in cache.
inline void times(float* m, const float* err, const float* q, float* p, std::size_t rows, std::size_t cols,
                  std::size_t r) noexcept {
  for (std::size_t i = 0; i < rows; ++i) {
    float* row = m + i * cols;
    if (err != nullptr)
      for (std::size_t j = 0; j < cols; ++j) row[j] += err[i * cols + j];
    if (r == 1) {
      float acc[8] = {};  // eight lanes: the compiler vectorizes the dot product
      std::size_t j = 0;
      for (; j + 8 <= cols; j += 8)
        for (std::size_t l = 0; l < 8; ++l) acc[l] += row[j + l] * q[j + l];
      float tail = 0;
      for (; j < cols; ++j) tail += row[j] * q[j];
      p[i] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
      continue;
    }
    float* out = p + i * r;
    std::fill(out, out + r, 0.0f);
    for (std::size_t j = 0; j < cols; ++j)
      for (std::size_t k = 0; k < r; ++k) out[k] += row[j] * q[j * r + k];
  }
}

/// q (cols x r) = m^T (cols x rows) p (rows x r).
inline void times_transposed(const float* m, const float* p, float* q, std::size_t rows, std::size_t cols,
                             std::size_t r) noexcept {
  std::fill(q, q + cols * r, 0.0f);
  for (std::size_t i = 0; i < rows; ++i) {
    const float* row = m + i * cols;
    if (r == 1) {
      const float pi = p[i];
      for (std::size_t j = 0; j < cols; ++j) q[j] += row[j] * pi;
      continue;
    }
    for (std::size_t j = 0; j < cols; ++j)
      for (std::size_t k = 0; k < r; ++k) q[j * r + k] += row[j] * p[i * r + k];
  }
}

/// m = p q^T; with `err`, err = (m before) - (m after).
inline void expand(float* m, float* err, const float* p, const float* q, std::size_t rows, std::size_t cols,
                   std::size_t r) noexcept {
  for (std::size_t i = 0; i < rows; ++i) {
    float* row = m + i * cols;
    float* e = err != nullptr ? err + i * cols : nullptr;
    for (std::size_t j = 0; j < cols; ++j) {
      float a = 0;
      for (std::size_t k = 0; k < r; ++k) a += p[i * r + k] * q[j * r + k];
      if (e != nullptr) e[j] = row[j] - a;
      row[j] = a;
    }
  }
}

/// splitmix64: the random first Q, from integer arithmetic only (the same bits everywhere).
inline std::uint64_t mix(std::uint64_t& s) noexcept {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// FNV-1a step over a 64-bit word.
inline void hash(std::uint64_t& h, std::uint64_t v) noexcept {
  for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xFF)) * 0x100000001B3ull;
}

}  // namespace detail::psgd

/// Communication hook: PowerSGD low-rank compression of the wrapper's f32 buckets (see this
/// file's comment). Its state (errors, P and Q of each bucket) lives in the hook, that is in the
/// `hooked` reducer the wrapper owns.
class powersgd {
 public:
  powersgd() = default;
  explicit powersgd(powersgd_options o) : o_(o) {
    if (o_.rank == 0) detail::raise(errc::invalid_argument, -1, "powersgd: rank must be at least 1");
    if (!(o_.min_compression_rate >= 0) || !(o_.orthogonalization_epsilon >= 0))
      detail::raise(errc::invalid_argument, -1,
                    "powersgd: min_compression_rate and orthogonalization_epsilon must be non-negative numbers");
  }

  const powersgd_options& options() const noexcept { return o_; }
  /// f32 elements of the buckets reduced compressed so far, and the elements that went on the
  /// wire for them (their ratio is the compression rate).
  std::uint64_t elements_in() const noexcept { return in_; }
  std::uint64_t elements_on_wire() const noexcept { return wire_; }
  /// Bytes of state held (errors, P with the plain tensors, Q), all buckets.
  std::size_t state_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& s : buckets_) n += (s.error.size() + s.pu.size() + s.q.size()) * sizeof(float);
    return n;
  }

  template <class R>
  void operator()(const comm_bucket& b, R& inner) {
    detail::require_host_buckets(b, inner, "powersgd");
    if (b.type != dtype::f32 || b.size < 2 || b.count == 0 || (b.oper != op::sum && b.oper != op::avg) ||
        b.bucket < 0 || b.tensors.empty()) {
      detail::allreduce_now(inner, b.data, b.count, b.type, b.oper, b.deadline, b.tag());
      return;
    }
    state& s = state_of(b);
    if (!s.agreed) agree(b, inner, s);
    if (s.calls++ < o_.start_iter || s.mats.empty()) {
      detail::allreduce_now(inner, b.data, b.count, b.type, b.oper, b.deadline, b.tag());
      return;
    }
    compress(b, inner, s);
  }

 private:
  struct matrix {
    std::size_t offset, rows, cols, r;
    std::size_t e, p, q;  // where its error, P (after the plain elements) and Q start
  };
  struct state {
    std::uint64_t calls = 0;
    std::size_t count = 0;
    std::vector<comm_tensor> layout;  // what the rest was built for
    std::vector<matrix> mats;
    std::vector<comm_tensor> plain;
    std::size_t plain_elems = 0;
    std::vector<float> error, pu, q;  // pu: the plain tensors, then every P
    bool q_ready = false, agreed = false;
  };

  // The bucket's state; built again (errors and Q dropped) when its layout changed.
  state& state_of(const comm_bucket& b) {
    const auto i = static_cast<std::size_t>(b.bucket);
    if (buckets_.size() <= i) buckets_.resize(i + 1);
    state& s = buckets_[i];
    if (s.count == b.count && std::ranges::equal(s.layout, b.tensors)) return s;
    const std::uint64_t calls = s.calls;
    s = state{};
    s.calls = calls;
    s.count = b.count;
    s.layout.assign(b.tensors.begin(), b.tensors.end());
    std::size_t e = 0, p = 0, q = 0;
    for (const auto& t : b.tensors) {
      if (t.offset + t.numel > b.count)
        detail::raise(errc::invalid_argument, b.rank,
                      "powersgd: bucket " + std::to_string(b.bucket) + " names parameter " + std::to_string(t.param) +
                          " beyond its " + std::to_string(b.count) + " elements");
      const std::size_t rows = t.rows, cols = t.cols();
      const std::size_t r = std::min({rows, cols, o_.rank});
      const bool worth =
          rows * cols == t.numel && rows > 0 &&
          o_.min_compression_rate * static_cast<double>((rows + cols) * r) < static_cast<double>(t.numel);
      if (!worth) {
        s.plain.push_back(t);
        s.plain_elems += t.numel;
        continue;
      }
      s.mats.push_back(matrix{t.offset, rows, cols, r, e, p, q});
      e += t.numel;
      p += rows * r;
      q += cols * r;
    }
    for (auto& m : s.mats) m.p += s.plain_elems;
    if (o_.error_feedback) s.error.assign(e, 0.0f);
    s.pu.assign(s.plain_elems + p, 0.0f);
    s.q.assign(q, 0.0f);
    return s;
  }

  // One allreduce (max over h and -h) per bucket layout: every rank must run the same
  // collectives below, so the options and the layout must match.
  template <class R>
  void agree(const comm_bucket& b, R& inner, state& s) {
    std::uint64_t h = 0xCBF29CE484222325ull;
    for (std::uint64_t v : {std::uint64_t(o_.rank), o_.start_iter, std::uint64_t(o_.error_feedback),
                            std::uint64_t(o_.warm_start), o_.seed, std::uint64_t(b.count)})
      detail::psgd::hash(h, v);
    detail::psgd::hash(h, std::bit_cast<std::uint64_t>(o_.min_compression_rate));
    detail::psgd::hash(h, std::bit_cast<std::uint32_t>(o_.orthogonalization_epsilon));
    for (const auto& t : b.tensors) {
      detail::psgd::hash(h, t.offset);
      detail::psgd::hash(h, t.numel);
      detail::psgd::hash(h, t.rows);
    }
    const auto mine = static_cast<std::int64_t>(h >> 2);
    std::int64_t both[2] = {mine, -mine};
    detail::allreduce_now(inner, both, 2, dtype::i64, op::max, b.deadline, b.tag());
    if (both[0] != mine || both[1] != -mine)
      detail::raise(errc::mismatch, b.rank,
                    "powersgd: the ranks' options (rank, start_iter, min_compression_rate, error_feedback, warm_start, "
                    "orthogonalization_epsilon, seed) or bucket " +
                        std::to_string(b.bucket) + "'s layout differ; give every rank the same powersgd_options");
    s.agreed = true;
  }

  template <class R>
  void compress(const comm_bucket& b, R& inner, state& s) {
    namespace k = detail::psgd;
    float* x = static_cast<float*>(b.data);
    const float eps = o_.orthogonalization_epsilon;
    if (!s.q_ready || !o_.warm_start) {
      std::uint64_t g = o_.seed ^ (0xD1B54A32D192ED03ull * (static_cast<std::uint64_t>(b.bucket) + 1)) ^ s.calls;
      for (float& v : s.q)  // uniform in [-1, 1): 24 random bits, exact in f32
        v = static_cast<float>(static_cast<std::int32_t>(k::mix(g) >> 40) - (1 << 23)) * 0x1p-23f;
      s.q_ready = true;
    }
    for (const auto& m : s.mats) {
      k::orthogonalize(s.q.data() + m.q, m.cols, m.r, eps);
      // Error feedback: this rank's error of the previous step joins the gradient first.
      k::times(x + m.offset, o_.error_feedback ? s.error.data() + m.e : nullptr, s.q.data() + m.q, s.pu.data() + m.p,
               m.rows, m.cols, m.r);
    }
    for (std::size_t at = 0; const auto& t : s.plain) {
      std::copy_n(x + t.offset, t.numel, s.pu.data() + at);
      at += t.numel;
    }
    detail::allreduce_now(inner, s.pu.data(), s.pu.size(), dtype::f32, op::sum, b.deadline, b.tag());
    const bool avg = b.oper == op::avg;
    const float n = static_cast<float>(b.size);
    for (std::size_t at = 0; const auto& t : s.plain) {
      for (std::size_t i = 0; i < t.numel; ++i) x[t.offset + i] = avg ? s.pu[at + i] / n : s.pu[at + i];
      at += t.numel;
    }
    for (const auto& m : s.mats) {
      k::orthogonalize(s.pu.data() + m.p, m.rows, m.r, eps);
      k::times_transposed(x + m.offset, s.pu.data() + m.p, s.q.data() + m.q, m.rows, m.cols, m.r);
    }
    detail::allreduce_now(inner, s.q.data(), s.q.size(), dtype::f32, op::sum, b.deadline, b.tag());
    if (avg)
      for (float& v : s.q) v /= n;
    for (const auto& m : s.mats)
      k::expand(x + m.offset, o_.error_feedback ? s.error.data() + m.e : nullptr, s.pu.data() + m.p, s.q.data() + m.q,
                m.rows, m.cols, m.r);
    in_ += b.count;
    wire_ += s.pu.size() + s.q.size();
  }

  powersgd_options o_{};
  std::vector<state> buckets_;  // by the wrapper's bucket index
  std::uint64_t in_ = 0, wire_ = 0;
};

}  // namespace DDP_ABI
}  // namespace ddp
