// Single-thread bandwidth of the host reduction kernels against memcpy and a plain `a += b`
// loop, on arrays that live in memory (256 MiB) and mostly in cache (8 MiB).
//
//   g++ -std=c++20 -O2 -Iinclude bench/kernels.cpp -o kernels_bench && ./kernels_bench
//   ./kernels_bench [big_MiB=256] [small_MiB=8] [reps=5]
//
// "touched" GB/s counts every byte read or written once: 2x the size for memcpy, 3x for
// `a += b`, (inputs + outputs) x the size for combine. The kernels must stay close to the plain
// loop: the gap is the price of their NaN handling and tails.

#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/detail/kernels.hpp>
#include <ddp/reducer/fp8_compress.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

struct free_deleter {
  void operator()(void* p) const noexcept { std::free(p); }
};
using block = std::unique_ptr<std::byte, free_deleter>;

block alloc(std::size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!p) {
    std::fprintf(stderr, "out of memory\n");
    std::exit(1);
  }
  std::memset(p, 0, bytes);  // fault the pages in before timing
  return block(static_cast<std::byte*>(p));
}

double median_seconds(int reps, const std::function<void()>& f) {
  f();  // warm-up
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto a = clock_type::now();
    f();
    t.push_back(std::chrono::duration<double>(clock_type::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Kept out of line so that the compiler sees an ordinary loop over unknown pointers, as in
// user code.
[[gnu::noinline]] void plain_add(float* a, const float* b, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) a[i] += b[i];
}

template <class T>
void fill(T* p, std::size_t n, float v) {
  for (std::size_t i = 0; i < n; ++i) p[i] = T(v);
}

void run(std::size_t bytes, int reps) {
  const std::size_t nf = bytes / sizeof(float);
  const std::size_t nh = bytes / 2;
  std::printf("\n== %zu MiB per array, %d reps, median ==\n", bytes >> 20, reps);
  std::printf("%-28s %10s %14s\n", "kernel", "ms", "touched GB/s");
  auto report = [&](const char* name, double s, double touched) {
    std::printf("%-28s %10.3f %14.2f\n", name, s * 1e3, touched / s / 1e9);
    return touched / s / 1e9;
  };

  std::vector<block> buf;
  for (int i = 0; i < 4; ++i) buf.push_back(alloc(bytes));
  auto f = [&](int i) { return reinterpret_cast<float*>(buf[static_cast<std::size_t>(i)].get()); };
  for (int i = 0; i < 4; ++i) fill(f(i), nf, 1.0f);

  const double b = static_cast<double>(bytes);
  report("memcpy", median_seconds(reps, [&] { std::memcpy(f(0), f(1), bytes); }), 2 * b);
  const double plain = report("plain a[i] += b[i]", median_seconds(reps, [&] { plain_add(f(0), f(1), nf); }), 3 * b);
  const double red = report("reduce_into<float> sum",
                            median_seconds(reps, [&] { ddp::detail::reduce_into(f(0), f(1), nf, ddp::op::sum); }), 3 * b);
  report("reduce_into<float> max",
         median_seconds(reps, [&] { ddp::detail::reduce_into(f(0), f(1), nf, ddp::op::max); }), 3 * b);
  for (int k : {2, 4}) {
    // The shared-memory allreduce: every input is also an output.
    float* outs[4] = {f(0), f(1), f(2), f(3)};
    const float* ins[4] = {f(0), f(1), f(2), f(3)};
    char name[64];
    std::snprintf(name, sizeof name, "combine<float> %d in/%d out", k, k);
    report(name, median_seconds(reps, [&] { ddp::detail::combine(outs, k, ins, k, nf, ddp::op::sum); }),
           2.0 * k * b);
    std::snprintf(name, sizeof name, "combine<float> %d in/1 out", k);
    report(name, median_seconds(reps, [&] { ddp::detail::combine(outs, 1, ins, k, nf, ddp::op::sum); }),
           (k + 1.0) * b);
    // avg over 3 ranks: every input scaled on entry, the result divided by 3/8 (not a power of
    // two: a true division), as the shm reducers finish a slice.
    std::snprintf(name, sizeof name, "combine<float> avg %d in/%d out", k, k);
    report(name, median_seconds(reps, [&] {
             ddp::detail::combine(outs, k, ins, k, nf, ddp::op::avg, ddp::detail::avg_step{3, 0, true});
           }), 2.0 * k * b);
    std::snprintf(name, sizeof name, "combine<float> avg %d in/1 out", k);
    report(name, median_seconds(reps, [&] {
             ddp::detail::combine(outs, 1, ins, k, nf, ddp::op::avg, ddp::detail::avg_step{3, 0, true});
           }), (k + 1.0) * b);
  }
  {
    // A middle step of the tcp ring's avg: received partial result + own data scaled.
    float* outs[1] = {f(0)};
    const float* ins[2] = {f(1), f(0)};
    report("combine<float> avg ring step", median_seconds(reps, [&] {
             ddp::detail::combine(outs, 1, ins, 2, nf, ddp::op::avg, ddp::detail::avg_step{3, 1, false});
           }), 3 * b);
  }
  auto h = [&](int i) { return reinterpret_cast<ddp::half*>(buf[static_cast<std::size_t>(i)].get()); };
  auto bf = [&](int i) { return reinterpret_cast<ddp::bfloat16*>(buf[static_cast<std::size_t>(i)].get()); };
  fill(h(0), nh, 0.5f);
  fill(h(1), nh, 0.25f);
  report("reduce_into<half> sum",
         median_seconds(reps, [&] { ddp::detail::reduce_into(h(0), h(1), nh, ddp::op::sum); }), 3 * b);
  fill(bf(0), nh, 0.5f);
  fill(bf(1), nh, 0.25f);
  report("reduce_into<bfloat16> sum",
         median_seconds(reps, [&] { ddp::detail::reduce_into(bf(0), bf(1), nh, ddp::op::sum); }), 3 * b);
  std::printf("reduce_into<float> / plain loop: %.0f%% (target >= 80%%)\n", 100.0 * red / plain);
  // The conversion work of fp16_compress and bf16_compress on one f32 bucket (max |x|, narrow with
  // the scale, widen with its inverse; bf16 needs no max), as f32 bytes per second: K in
  // docs/tuning.md's rule for when compression pays.
  for (std::size_t i = 0; i < nf; ++i) f(0)[i] = 1e-3f * static_cast<float>(i % 1000) - 0.5f;
  const double k16 = report("fp16_compress passes (f32 B)", median_seconds(reps, [&] {
                              const float m = ddp::detail::max_abs_finite(f(0), nf);
                              ddp::detail::narrow_to_f16(h(2), f(0), nf, 1.0f / (m > 0 ? m : 1.0f), true);
                              ddp::detail::widen_from_f16(f(0), h(2), nf, m > 0 ? m : 1.0f);
                            }), b);
  const double kb = report("bf16_compress passes (f32 B)", median_seconds(reps, [&] {
                             ddp::detail::narrow_to_bf16(bf(2), f(0), nf, 1.0f, true);
                             ddp::detail::widen_from_bf16(f(0), bf(2), nf, 1.0f);
                           }), b);
  std::printf("compression pays across H hosts below a link of K (H-1)/H: fp16 %.1f Gbit/s, bf16 %.1f Gbit/s "
              "(2 hosts: half)\n", k16 * 8, kb * 8);
  // fp8_compress's kernels on one f32 bucket, blocks of 256: the scales and codes with error
  // feedback (quantize), and one rank's codes decoded into the sum (accumulate), as f32 bytes per
  // second; the exchange decodes every rank's codes, so its decode work is n times the second.
  {
    namespace k8 = ddp::detail::fp8;
    auto* codes = reinterpret_cast<std::uint8_t*>(h(2));
    float* res = f(1);
    std::vector<float> scales(nf / 256 + 1);
    std::memset(res, 0, nf * sizeof(float));
    const double q = report("fp8 quantize, error feedback (f32 B)", median_seconds(reps, [&] {
                              // as fp8_compress: y = x + residual, the block scales, the codes
                              k8::quantize_blocks<ddp::fp8_format::e4m3>(f(0), nf, 256, res, scales.data(), codes);
                            }), b);
    const double d = report("fp8 decode into the sum (f32 B)", median_seconds(reps, [&] {
                              for (std::size_t at = 0, blk = 0; at < nf; at += 256, ++blk)
                                k8::accumulate<ddp::fp8_format::e4m3>(f(0) + at, codes + at,
                                                                      std::min<std::size_t>(256, nf - at),
                                                                      scales[blk], false);
                            }), b);
    std::printf("fp8 against fp16's passes: quantize %.2fx, one decode %.2fx of fp16_compress's bytes per second\n",
                q / k16, d / k16);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--help") == 0) {
    std::printf("usage: %s [big_MiB=256] [small_MiB=8] [reps=5]\n", argv[0]);
    return 0;
  }
  const std::size_t big = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 256;
  const std::size_t small = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 8;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  std::printf("vector bytes %zu, kernels: %s\n", ddp::detail::kern::vector_bytes, ddp::detail::isa_name());
  run(small << 20, reps);
  run(big << 20, reps);
}
