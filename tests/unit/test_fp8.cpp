// The fp8 kernels of ddp::fp8_compress (detail/fp8.hpp) in one process: every finite code
// decodes and encodes back; random values round to nearest even as a reference written with
// frexp and nearbyint, subnormals and saturation included; block scales of zero, tiny and
// non-finite blocks; quantization's residual; accumulation of non-finite blocks; odd lengths.
#include <ddp/reducer/fp8_compress.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

using ddp::fp8_format;
namespace k = ddp::detail::fp8;

namespace {

float reference(float v, int mant, int bias, float largest) {
  if (v == 0.0f) return 0.0f;
  const float a = std::fabs(v);
  int e = 0;
  std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  const float step = std::ldexp(1.0f, std::max(e - 1, 1 - bias) - mant);
  const float q = std::min(std::nearbyint(a / step) * step, largest);
  return std::copysign(q, v);
}

template <fp8_format F>
void every_value(int mant, int bias, float largest) {
  for (int c = 0; c < 256; ++c) {
    if ((static_cast<unsigned>(c) & 0x7fu) > k::spec_of(F).top) continue;  // NaN and inf codes: never sent
    const float d = k::decode_one<F>(static_cast<std::uint8_t>(c));
    CAPTURE(c);
    CHECK(std::isfinite(d));
    CHECK(k::encode_one<F>(d) == c);
  }
  CHECK(k::decode_one<F>(static_cast<std::uint8_t>(k::spec_of(F).top)) == largest);
  std::uint32_t seed = 12345;
  int bad = 0;
  for (int i = 0; i < 1000000; ++i) {
    seed = seed * 1664525u + 1013904223u;
    const float v =
        std::ldexp(static_cast<float>(seed >> 8) / 16777216.0f * 2.0f - 1.0f, static_cast<int>(seed % 48) - 30);
    if (std::fabs(v) > largest) continue;
    const float got = k::decode_one<F>(k::encode_one<F>(v)), want = reference(v, mant, bias, largest);
    bad += got == want ? 0 : 1;
  }
  CHECK(bad == 0);
  // Saturation: what rounds past the largest value stays at it; halfway cases go to even.
  CHECK(k::decode_one<F>(k::encode_one<F>(largest * 1.01f)) == largest);
  CHECK(k::decode_one<F>(k::encode_one<F>(-largest * 1.01f)) == -largest);
}

}  // namespace

TEST_CASE("fp8 e4m3 and e5m2: every code round-trips, values round to nearest even") {
  every_value<fp8_format::e4m3>(3, 7, 448.0f);
  every_value<fp8_format::e5m2>(2, 15, 57344.0f);
  CHECK(k::decode_one<fp8_format::e4m3>(1) == std::ldexp(1.0f, -9));  // the smallest subnormal
  CHECK(k::decode_one<fp8_format::e5m2>(1) == std::ldexp(1.0f, -16));
  CHECK(k::encode_one<fp8_format::e4m3>(1.0625f) == k::encode_one<fp8_format::e4m3>(1.0f));  // tie to even
  CHECK(k::encode_one<fp8_format::e4m3>(1.1875f) == k::encode_one<fp8_format::e4m3>(1.25f));
}

TEST_CASE("fp8 block scales: zeros, tiny values, NaN and infinities") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (std::size_t n : {1u, 7u, 8u, 37u, 256u}) {
    CAPTURE(n);
    std::vector<float> x(n, 0.0f);
    CHECK(k::block_scale(x.data(), n, 448.0f) == 0.0f);
    x[n / 2] = -3.5f;
    CHECK(k::block_scale(x.data(), n, 448.0f) == 3.5f / 448.0f);
    x[n - 1] = inf;
    CHECK(k::block_scale(x.data(), n, 448.0f) == inf);
    x[n - 1] = -inf;
    CHECK(k::block_scale(x.data(), n, 448.0f) == -inf);
    x[0] = inf;
    CHECK((n == 1 ? k::block_scale(x.data(), n, 448.0f) == inf : std::isnan(k::block_scale(x.data(), n, 448.0f))));
    x.assign(n, 1e-40f);
    const float s = k::block_scale(x.data(), n, 448.0f);
    CHECK(s > 0.0f);
    CHECK(std::isfinite(1.0f / s));
    x[0] = nan;
    CHECK(std::isnan(k::block_scale(x.data(), n, 448.0f)));
  }
}

TEST_CASE("fp8 quantize and accumulate: the residual is what was lost; non-finite blocks spread their value") {
  for (std::size_t n : {5u, 8u, 37u, 256u, 1000u}) {
    CAPTURE(n);
    std::vector<float> x(n), r(n), back(n);
    for (std::size_t i = 0; i < n; ++i) x[i] = std::sin(0.37f * static_cast<float>(i)) * 3.0f;
    std::vector<std::uint8_t> c(n);
    const float s = k::block_scale(x.data(), n, 448.0f);
    k::quantize<fp8_format::e4m3>(x.data(), n, s, c.data(), r.data());
    k::accumulate<fp8_format::e4m3>(back.data(), c.data(), n, s, true);
    for (std::size_t i = 0; i < n; ++i) {
      CHECK(back[i] + r[i] == doctest::Approx(x[i]).epsilon(1e-6));
      CHECK(std::fabs(r[i]) <= std::fabs(x[i]) / 16.0f + std::ldexp(1.0f, -9) * s);
    }
    k::accumulate<fp8_format::e4m3>(back.data(), c.data(), n, s, false);  // twice: the sum
    for (std::size_t i = 0; i < n; ++i) CHECK(back[i] == 2.0f * (x[i] - r[i]));
    // A non-finite block: codes 0, residual 0, and the scale itself is what every element gets.
    const float inf = std::numeric_limits<float>::infinity();
    k::quantize<fp8_format::e4m3>(x.data(), n, inf, c.data(), r.data());
    for (std::size_t i = 0; i < n; ++i) CHECK((c[i] == 0 && r[i] == 0.0f));
    k::accumulate<fp8_format::e4m3>(back.data(), c.data(), n, -inf, false);
    for (std::size_t i = 0; i < n; ++i) CHECK(back[i] == -inf);
  }
}

TEST_CASE(
    "fp8 sum_ranks: one pass gives accumulate's bits, rank by rank, with the division, tails and non-finite scales") {
  const float inf = std::numeric_limits<float>::infinity();
  for (int ranks : {1, 2, 3, 5})
    for (std::size_t n : {3u, 8u, 37u, 256u}) {
      CAPTURE(ranks);
      CAPTURE(n);
      std::vector<std::vector<std::uint8_t>> c(static_cast<std::size_t>(ranks), std::vector<std::uint8_t>(n));
      std::vector<const std::uint8_t*> rows;
      std::vector<float> scales;
      for (int r = 0; r < ranks; ++r) {
        for (std::size_t i = 0; i < n; ++i)
          c[static_cast<std::size_t>(r)][i] = static_cast<std::uint8_t>((i * 29 + r * 7) % 255);
        c[static_cast<std::size_t>(r)][0] = 0x7e;  // the largest code
        rows.push_back(c[static_cast<std::size_t>(r)].data());
        scales.push_back(0.37f + 0.11f * static_cast<float>(r));
      }
      for (const float divisor : {1.0f, static_cast<float>(ranks)}) {
        std::vector<float> want(n), got(n);
        for (int r = 0; r < ranks; ++r)
          k::accumulate<fp8_format::e4m3>(want.data(), rows[static_cast<std::size_t>(r)], n,
                                          scales[static_cast<std::size_t>(r)], r == 0);
        for (auto& w : want) w = divisor != 1.0f ? w / divisor : w;
        k::sum_ranks<fp8_format::e4m3>(got.data(), n, rows.data(), scales.data(), ranks, divisor);
        CHECK(std::memcmp(got.data(), want.data(), n * sizeof(float)) == 0);
      }
      if (ranks > 1) {  // one rank's block is +inf: the whole block is
        scales[1] = inf;
        std::vector<float> got(n);
        k::sum_ranks<fp8_format::e4m3>(got.data(), n, rows.data(), scales.data(), ranks, 1.0f);
        for (float g : got) CHECK(g == inf);
      }
    }
}

TEST_CASE("fp8 quantize_blocks and sum_blocks: a whole bucket gives the per-block kernels' bits") {
  constexpr auto F = fp8_format::e4m3;
  for (std::size_t block : {std::size_t{37}, std::size_t{256}})
    for (std::size_t n : {std::size_t{1}, std::size_t{300}, std::size_t{1000}}) {
      CAPTURE(block);
      CAPTURE(n);
      const std::size_t nb = (n + block - 1) / block;
      std::vector<float> x(n), r0(n), r1(n);
      for (std::size_t i = 0; i < n; ++i) {
        x[i] = std::sin(static_cast<float>(i)) * static_cast<float>(1 + i % 7);
        r0[i] = r1[i] = 1e-3f * std::cos(static_cast<float>(i));
      }
      // Per block, as fp8_compress did: y = x + r, the scale, the codes and the new residual.
      std::vector<float> s0(nb), s1(nb);
      std::vector<std::uint8_t> c0(n), c1(n);
      for (std::size_t at = 0, blk = 0; at < n; at += block, ++blk) {
        const std::size_t len = std::min(block, n - at);
        k::add_into(r0.data() + at, x.data() + at, len);
        s0[blk] = k::block_scale(r0.data() + at, len, k::spec_of(F).largest);
        k::quantize<F>(r0.data() + at, len, s0[blk], c0.data() + at, r0.data() + at);
      }
      k::quantize_blocks<F>(x.data(), n, block, r1.data(), s1.data(), c1.data());
      CHECK(c0 == c1);
      CHECK(std::memcmp(s0.data(), s1.data(), nb * sizeof(float)) == 0);
      CHECK(std::memcmp(r0.data(), r1.data(), n * sizeof(float)) == 0);
      // Two ranks' codes summed and averaged: sum_ranks block by block.
      std::vector<float> want(n), got(n);
      for (std::size_t at = 0, blk = 0; at < n; at += block, ++blk) {
        const std::uint8_t* rows[2] = {c0.data() + at, c1.data() + at};
        const float sc[2] = {s0[blk], 2 * s1[blk]};
        k::sum_ranks<F>(want.data() + at, std::min(block, n - at), rows, sc, 2, 2.0f);
      }
      std::vector<float> s1x2(nb);
      for (std::size_t b = 0; b < nb; ++b) s1x2[b] = 2 * s1[b];
      const std::uint8_t* codes[2] = {c0.data(), c1.data()};
      const void* scales[2] = {s0.data(), s1x2.data()};
      const std::uint8_t* rows[2];
      float sc[2];
      k::sum_blocks<F>(got.data(), n, block, codes, scales, 2, 2.0f, rows, sc);
      CHECK(std::memcmp(got.data(), want.data(), n * sizeof(float)) == 0);
    }
}
