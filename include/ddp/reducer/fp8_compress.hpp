#pragma once
/// \file reducer/fp8_compress.hpp
/// `ddp::fp8_compress`: a communication hook for `ddp::hooked` that sends each f32 bucket as
/// block-scaled 8-bit floats (OCP e4m3 or e5m2), a quarter of the bytes, with error feedback.
///
/// What happens to an f32 bucket reduced with `op::sum` or `op::avg` over 2 or more ranks:
/// 1. With error feedback (on by default), the bucket's residual from the previous step (what
///    its quantization lost) is added to it: y = x + r.
/// 2. y is cut into blocks of `block` elements (256 by default); each block gets one f32 scale
///    s = max|y| / largest (448 for e4m3, 57344 for e5m2) and each element the 8-bit code of
///    y / s, rounded once to nearest even (reducer/detail/fp8.hpp). The new residual is y minus what
///    the codes decode to.
/// 3. One all-gather carries every rank's codes and scales (and its options and bucket size,
///    compared on arrival): each rank then decodes every rank's block and sums them in f32, in
///    rank order, and divides by n for avg. The partial sums are never re-quantized: one
///    rounding to 8 bits per contribution, whatever the world size, and the same bits on every
///    rank (the same codes summed in the same order).
///
/// Bytes: each rank receives (n - 1) (count + 4 count / block) bytes, against 8 (n - 1) / n
/// count for an f32 ring allreduce and 4 (n - 1) / n count for fp16_compress: a quarter of f32's
/// on 2 ranks, 3/8 on 3; it stops paying against fp16 at 4 ranks and against f32 at 8 (the
/// exchange is an all-gather, not an all-to-all: docs/tuning.md, "fp8").
///
/// Bound, per element, with y_r rank r's value after step 1, u = 2^-4 (e4m3) or 2^-3 (e5m2),
/// t_r = 2^-9 s_r (e4m3) or 2^-16 s_r (e5m2) what the format's subnormal steps absorb:
///   |sum - exact| <= sum_r (u |y_r| + t_r) + (n - 1) 2^-24 sum_r |y_r|   (avg: divided by n)
/// and with error feedback what is lost in one step is carried to the next, so over steps the
/// error does not accumulate. A block holding NaN or an infinity on some rank is NaN or that
/// infinity in the result on every rank (never a finite value), and carries no residual.
///
/// Other buckets pass through unchanged (the inner reducer's allreduce): other dtypes, ops
/// min, max and prod, and groups of one rank. Ranks with other options (format, block, error
/// feedback) are `errc::mismatch` naming the rank, on every rank.
///
/// \code
/// using compressed = ddp::basic_data_parallel<ddp::size_planner,
///                                             ddp::hooked<ddp::ring<ddp::tcp>, ddp::fp8_compress>,
///                                             ddp::host_allocator>;
/// compressed dp{pg, params};
/// // other options: ddp::hooked<...> red{pg, ddp::fp8_compress{{.format = ddp::fp8_format::e5m2}}};
/// \endcode

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/reducer/detail/fp8.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/fwd.hpp>
#include <ddp/reducer/detail/tagged.hpp>
#include <ddp/reducer/hooked.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// The options of `ddp::fp8_compress`; every rank must pass the same.
struct fp8_options {
  fp8_format format = fp8_format::e4m3;
  /// Elements per scale: smaller blocks follow the values more closely, at 4 bytes a block.
  std::size_t block = 256;
  /// Keep what each bucket's quantization lost and add it to that bucket next step (buckets of
  /// the data-parallel wrapper; an allreduce a program issues itself has none).
  bool error_feedback = true;
};

/// Communication hook: f32 sum/avg buckets travel as block-scaled 8-bit floats, summed in f32
/// after one all-gather; see this file's comment.
class fp8_compress {
 public:
  fp8_compress() = default;
  /// errc::invalid_argument for a block of 0 or more than 2^20 elements.
  explicit fp8_compress(fp8_options o) : o_(o) {
    if (o_.block == 0 || o_.block > (std::size_t{1} << 20))
      detail::raise(errc::invalid_argument, -1,
                    "fp8_compress: block = " + std::to_string(o_.block) + " elements; use 1 to 2^20 (default 256)");
  }

  template <class R>
  void operator()(const comm_bucket& b, R& inner) {
    detail::require_host_buckets(b, inner, "fp8_compress");
    if (b.type != dtype::f32 || b.size < 2 || b.count == 0 || (b.oper != op::sum && b.oper != op::avg)) {
      detail::allreduce_now(inner, b.data, b.count, b.type, b.oper, b.deadline, b.tag());
      return;
    }
    if (o_.format == fp8_format::e4m3)
      run<fp8_format::e4m3>(b, inner);
    else
      run<fp8_format::e5m2>(b, inner);
  }

  const fp8_options& options() const noexcept { return o_; }
  /// Bytes of residuals held (error feedback: 4 per element of every bucket seen), and of the
  /// exchange's buffers.
  std::size_t residual_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& [k, r] : residual_) n += r.size() * sizeof(float);
    return n;
  }
  std::size_t scratch_bytes() const noexcept { return (send_.size() + recv_.size()) * sizeof(std::uint32_t); }

 private:
  static constexpr std::size_t header_words = 2;  // the options' code, the element count

  std::uint32_t code() const noexcept {
    return static_cast<std::uint32_t>(o_.format) | static_cast<std::uint32_t>(o_.block) << 8 |
           (o_.error_feedback ? 1u << 31 : 0u);
  }
  static std::string describe(std::uint32_t c) {
    return std::string((c & 0xff) == 0   ? "e4m3"
                       : (c & 0xff) == 1 ? "e5m2"
                                         : "an unknown format") +
           " block=" + std::to_string((c >> 8) & 0x7fffff) + " error_feedback=" + ((c >> 31) != 0 ? "on" : "off");
  }

  template <fp8_format F, class R>
  void run(const comm_bucket& b, R& inner) {
    namespace k = detail::fp8;
    auto* x = static_cast<float*>(b.data);
    const std::size_t n = b.count, bl = o_.block, nb = (n + bl - 1) / bl;
    const std::size_t words = header_words + nb + (n + 3) / 4;
    if (send_.size() < words) send_.assign(words, 0);
    if (recv_.size() < words * static_cast<std::size_t>(b.size))
      recv_.assign(words * static_cast<std::size_t>(b.size), 0);
    std::uint32_t* mine = send_.data();
    mine[0] = code();
    mine[1] = static_cast<std::uint32_t>(n);
    float* scales = reinterpret_cast<float*>(mine + header_words);
    auto* codes = reinterpret_cast<std::uint8_t*>(mine + header_words + nb);
    mine[words - 1] = 0;  // the codes' padding
    float* res = nullptr;
    if (o_.error_feedback && b.bucket >= 0) {
      auto& r = residual_[b.bucket];
      if (r.size() != n) r.assign(n, 0.0f);  // a new bucket, or a new plan: nothing carried
      res = r.data();
    }
    // y = x + r in the residual's memory (which quantization then overwrites), scales, codes.
    k::quantize_blocks<F>(x, n, bl, res, scales, codes);
    const request req = detail::allgather_async_tagged(inner, mine, recv_.data(), words, dtype::i32, b.tag());
    req.wait(b.deadline);
    for (int r = 0; r < b.size; ++r) {
      const std::uint32_t* theirs = recv_.data() + static_cast<std::size_t>(r) * words;
      if (theirs[0] != mine[0] || theirs[1] != mine[1])
        detail::raise(errc::mismatch, b.rank,
                      "fp8_compress: rank " + std::to_string(r) + " sent " + describe(theirs[0]) + " for " +
                          std::to_string(theirs[1]) + " elements where rank " + std::to_string(b.rank) + " sent " +
                          describe(mine[0]) + " for " + std::to_string(n) +
                          ": every rank must compress with the same options");
    }
    // Every rank's blocks decoded and summed in one pass over the bucket (and divided, for avg).
    const auto ranks = static_cast<std::size_t>(b.size);
    rank_codes_.resize(ranks);
    rank_scales_.resize(ranks);
    for (std::size_t r = 0; r < ranks; ++r) {
      const std::uint32_t* theirs = recv_.data() + r * words;
      rank_scales_[r] = theirs + header_words;
      rank_codes_[r] = reinterpret_cast<const std::uint8_t*>(theirs + header_words + nb);
    }
    rows_.resize(ranks);
    block_scales_.resize(ranks);
    const float divisor = b.oper == op::avg ? static_cast<float>(b.size) : 1.0f;
    k::sum_blocks<F>(x, n, bl, rank_codes_.data(), rank_scales_.data(), b.size, divisor, rows_.data(),
                     block_scales_.data());
  }

  fp8_options o_{};
  std::map<std::int32_t, std::vector<float>> residual_;  // per bucket of the wrapper
  std::vector<std::uint32_t> send_, recv_;               // grow only: buckets repeat every step
  std::vector<const std::uint8_t*> rank_codes_;          // per rank: its codes in recv_
  std::vector<const void*> rank_scales_;                 // per rank: its block scales in recv_
  std::vector<const std::uint8_t*> rows_;                // sum_blocks' scratch: per rank, the block's codes
  std::vector<float> block_scales_;                      // sum_blocks' scratch: per rank, the block's scale
};

}  // namespace DDP_ABI
}  // namespace ddp
