#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/detail/kernels.hpp>

#include <doctest/doctest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// The bulk conversions of compression (detail/kernels.hpp, end): rounding bit for bit that of
// ddp::half / ddp::bfloat16 on every non-NaN f32 pattern class, NaN canonical, scale and
// saturation. Built twice: for the x86-64 baseline (software conversions) and, where the
// compiler takes it, for the build machine (F16C).

using ddp::bfloat16;
using ddp::half;
namespace det = ddp::detail;

namespace {

// Every 16-bit pattern widened, and f32 values around every rounding boundary.
std::vector<float> probe_values() {
  std::vector<float> v;
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {
    v.push_back(half::to_float(static_cast<std::uint16_t>(h)));
    v.push_back(bfloat16::to_float(static_cast<std::uint16_t>(h)));
  }
  // Halfway points and their neighbours, in the normal and subnormal ranges of both types.
  for (std::uint32_t h = 0; h < 0x7c00u; h += 7) {
    const float a = half::to_float(static_cast<std::uint16_t>(h)), b = half::to_float(static_cast<std::uint16_t>(h + 1));
    const float mid = a + (b - a) / 2;
    v.push_back(mid);
    v.push_back(std::nextafter(mid, 0.0f));
    v.push_back(std::nextafter(mid, 1e30f));
    v.push_back(-mid);
  }
  for (std::uint32_t x = 0; x < 0x7f800000u; x += 0x00012345u) {
    v.push_back(std::bit_cast<float>(x));
    v.push_back(std::bit_cast<float>(x | 0x8000u));
    v.push_back(-std::bit_cast<float>(x | 0x7fffu));
  }
  for (float f : {65504.0f, 65519.0f, 65520.0f, 65536.0f, 1e6f, 3.38e38f, 3.3895e38f, 3.4e38f,
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(), 1e-40f,
                  5.96e-8f, 2.98e-8f, 2.99e-8f})
    v.push_back(f), v.push_back(-f);
  v.push_back(std::numeric_limits<float>::infinity());
  v.push_back(-std::numeric_limits<float>::infinity());
  return v;
}

bool is_nan16(std::uint16_t h, bool bf) { return bf ? (h & 0x7fffu) > 0x7f80u : (h & 0x7fffu) > 0x7c00u; }

}  // namespace

TEST_CASE("narrow_to_f16 / narrow_to_bf16 round bit for bit as ddp::half / ddp::bfloat16") {
  auto v = probe_values();
  const float nans[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                        std::bit_cast<float>(0x7f800001u), std::bit_cast<float>(0xffa00000u)};
  for (float f : nans) v.push_back(f);
  // Every length up to a few vectors, so that the tail path is covered at each offset.
  for (std::size_t off : {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{17}}) {
    const std::size_t n = v.size() - off;
    std::vector<half> h(n);
    std::vector<bfloat16> b(n);
    det::narrow_to_f16(h.data(), v.data() + off, n);
    det::narrow_to_bf16(b.data(), v.data() + off, n);
    for (std::size_t i = 0; i < n; ++i) {
      const float x = v[i + off];
      if (std::isnan(x)) {
        REQUIRE(h[i].bits == 0x7e00u);  // canonical, whatever the payload and sign
        REQUIRE(b[i].bits == 0x7fc0u);
        continue;
      }
      INFO("x = " << x << " bits " << std::bit_cast<std::uint32_t>(x));
      REQUIRE(h[i].bits == half(x).bits);
      REQUIRE(b[i].bits == bfloat16(x).bits);
    }
  }
}

TEST_CASE("widen_from_f16 / widen_from_bf16 are exact, NaN canonical") {
  std::vector<half> h(0x10000);
  std::vector<bfloat16> b(0x10000);
  for (std::uint32_t i = 0; i < 0x10000u; ++i) h[i].bits = b[i].bits = static_cast<std::uint16_t>(i);
  for (std::size_t n : {std::size_t{0x10000}, std::size_t{3}, std::size_t{9}}) {
    std::vector<float> fh(n), fb(n);
    det::widen_from_f16(fh.data(), h.data(), n);
    det::widen_from_bf16(fb.data(), b.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      if (is_nan16(h[i].bits, false))
        REQUIRE(std::bit_cast<std::uint32_t>(fh[i]) == 0x7fc00000u);
      else
        REQUIRE(std::bit_cast<std::uint32_t>(fh[i]) == std::bit_cast<std::uint32_t>(half::to_float(h[i].bits)));
      if (is_nan16(b[i].bits, true))
        REQUIRE(std::bit_cast<std::uint32_t>(fb[i]) == 0x7fc00000u);
      else
        REQUIRE(std::bit_cast<std::uint32_t>(fb[i]) == std::bit_cast<std::uint32_t>(bfloat16::to_float(b[i].bits)));
    }
  }
}

TEST_CASE("a power-of-two scale is exact: narrow(x * 2^e) then widen * 2^-e rounds once") {
  const auto v = probe_values();
  for (int e : {-20, -3, 0, 5, 30}) {
    const float s = std::ldexp(1.0f, e), inv = std::ldexp(1.0f, -e);
    std::vector<half> h(v.size());
    std::vector<float> back(v.size());
    det::narrow_to_f16(h.data(), v.data(), v.size(), s);
    det::widen_from_f16(back.data(), h.data(), v.size(), inv);
    for (std::size_t i = 0; i < v.size(); ++i) {
      const float scaled = v[i] * s;
      if (std::isnan(scaled)) continue;
      REQUIRE(h[i].bits == half(scaled).bits);
      const float want = half::to_float(half(scaled).bits) * inv;
      REQUIRE(std::bit_cast<std::uint32_t>(back[i]) == std::bit_cast<std::uint32_t>(want));
    }
  }
}

TEST_CASE("saturation: finite values past the largest finite become it, infinities stay") {
  const float in[] = {65519.0f, 65520.0f, 1e6f, -1e9f, std::numeric_limits<float>::infinity(), 3.4e38f,
                      -std::numeric_limits<float>::max(), 1.0f, -std::numeric_limits<float>::infinity()};
  constexpr std::size_t n = sizeof in / sizeof in[0];
  half h[n];
  bfloat16 b[n];
  det::narrow_to_f16(h, in, n, 1.0f, true);
  det::narrow_to_bf16(b, in, n, 1.0f, true);
  const std::uint16_t want_h[] = {0x7bff, 0x7bff, 0x7bff, 0xfbff, 0x7c00, 0x7bff, 0xfbff, 0x3c00, 0xfc00};
  const std::uint16_t want_b[] = {bfloat16(65519.0f).bits, bfloat16(65520.0f).bits, bfloat16(1e6f).bits,
                                  bfloat16(-1e9f).bits,    0x7f80,                  0x7f7f,
                                  0xff7f,                  0x3f80,                  0xff80};
  for (std::size_t i = 0; i < n; ++i) {
    INFO(i);
    CHECK(h[i].bits == want_h[i]);
    CHECK(b[i].bits == want_b[i]);
  }
  CHECK(bfloat16(3.4e38f).bits == 0x7f80);  // without saturation: inf
}

TEST_CASE("max_abs_finite skips NaN and inf, sees every lane and the tail") {
  for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{8}, std::size_t{33}, std::size_t{1000}}) {
    for (std::size_t at = 0; at < n; at += (n > 40 ? 97 : 1)) {
      std::vector<float> v(n, 0.5f);
      if (n > 2) v[(at + 1) % n] = std::numeric_limits<float>::quiet_NaN();
      if (n > 3) v[(at + 2) % n] = -std::numeric_limits<float>::infinity();
      v[at] = -3.0f;
      CHECK(det::max_abs_finite(v.data(), n) == 3.0f);
    }
  }
  const float none[] = {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  CHECK(det::max_abs_finite(none, 2) == 0.0f);
  CHECK(det::max_abs_finite(none, 0) == 0.0f);
}
