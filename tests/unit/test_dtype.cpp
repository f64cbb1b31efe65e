#include <ddp/dtype.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

using ddp::bfloat16;
using ddp::half;

namespace {

// Expectations are computed from the definitions of the formats in double arithmetic, not
// with bit manipulation like dtype.hpp does.

// Value of a binary16 bit pattern: (-1)^s * 2^(e-15) * 1.m, or 2^-14 * 0.m when e == 0.
double half_value(std::uint16_t h) {
  const int s = h >> 15;
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  double v;
  if (e == 0x1f) v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0) v = std::ldexp(m, -24);
  else v = std::ldexp(1024 + m, e - 25);
  return s ? -v : v;
}

// The finite non-negative halves in increasing order (bit order equals value order there).
const std::vector<double>& positive_halves() {
  static const std::vector<double> v = [] {
    std::vector<double> r;
    for (std::uint32_t h = 0; h <= 0x7bff; ++h) r.push_back(half_value(static_cast<std::uint16_t>(h)));
    return r;
  }();
  return v;
}

// Rounds |x| to the binary format with `mant_bits` stored mantissa bits and minimum normal
// exponent `emin`, ties to even, by scaling to an integer and using nearbyint (the default
// rounding mode is round-to-nearest-even). Exact in double for float inputs.
double round_to_format(double ax, int mant_bits, int emin) {
  if (ax == 0.0) return 0.0;
  int e;
  std::frexp(ax, &e);  // ax = f * 2^e, f in [0.5, 1): exponent of the leading bit is e - 1
  const int lead = std::max(e - 1, emin);
  const double quantum = std::ldexp(1.0, lead - mant_bits);
  return std::nearbyint(ax / quantum) * quantum;
}

// Expected binary16 bits of a finite or infinite float (NaN handled by the caller).
std::uint16_t expect_half(float f) {
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double ax = std::fabs(static_cast<double>(f));
  if (std::isinf(ax)) return sign | 0x7c00;
  const double r = round_to_format(ax, 10, -14);
  if (r > 65504.0) return sign | 0x7c00;
  const auto& tab = positive_halves();
  const auto it = std::lower_bound(tab.begin(), tab.end(), r);
  REQUIRE(it != tab.end());
  REQUIRE(*it == r);
  return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(it - tab.begin()));
}

std::uint16_t expect_bf16(float f) {
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double ax = std::fabs(static_cast<double>(f));
  if (std::isinf(ax)) return sign | 0x7f80;
  const double r = round_to_format(ax, 7, -126);
  if (r >= std::ldexp(1.0, 128)) return sign | 0x7f80;
  // r has at most 8 significant bits, so it is a float whose low 16 bits are zero.
  const auto bits = std::bit_cast<std::uint32_t>(static_cast<float>(r));
  REQUIRE((bits & 0xffffu) == 0);
  return static_cast<std::uint16_t>(sign | (bits >> 16));
}

std::vector<float> interesting_floats() {
  std::vector<float> v;
  // Every half value, the midpoints between neighbours (ties), and one float ulp either side.
  const auto& tab = positive_halves();
  for (std::size_t i = 0; i + 1 < tab.size(); ++i) {
    const float a = static_cast<float>(tab[i]);
    const float mid = static_cast<float>((tab[i] + tab[i + 1]) / 2);  // 12 bits: exact in float
    for (float x : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      v.push_back(x);
      v.push_back(-x);
    }
  }
  for (float x : {65504.0f, 65519.99f, 65520.0f, 65536.0f, 1e30f, 0x1p-25f, 0x1.000002p-25f, 0x1p-26f,
                  0x1p-24f, 0x1.8p-24f, 0x1p-14f, 0x1.ffcp-15f, 1e-40f, 1e-45f, 3.4028235e38f,
                  std::numeric_limits<float>::infinity(), 0.1f, 1.0f / 3.0f})
    v.push_back(x), v.push_back(-x);
  // Float ties for bf16 (low 16 bits 0x8000) with even and odd kept parts, plus a wide stride.
  for (std::uint32_t hi = 0; hi < 0x10000; hi += 3) {
    for (std::uint32_t lo : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu})
      v.push_back(std::bit_cast<float>((hi << 16) | lo));
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) v.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng())));
  return v;
}

}  // namespace

TEST_CASE("half widening is exact for every bit pattern") {
  int bad = 0;
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    half h;
    h.bits = static_cast<std::uint16_t>(b);
    const float f = static_cast<float>(h);
    const double want = half_value(h.bits);
    if (std::isnan(want)) {
      bad += !std::isnan(f) || std::signbit(f) != ((b & 0x8000u) != 0);
    } else {
      bad += static_cast<double>(f) != want || std::signbit(f) != ((b & 0x8000u) != 0);
    }
  }
  CHECK(bad == 0);
  half one;
  one.bits = 0x3c00;
  CHECK(static_cast<float>(one) == 1.0f);
  half min_sub;
  min_sub.bits = 0x0001;
  CHECK(static_cast<float>(min_sub) == 0x1p-24f);
  half max_sub;
  max_sub.bits = 0x03ff;
  CHECK(static_cast<float>(max_sub) == 0x1.ff8p-15f);
}

TEST_CASE("half narrowing rounds to nearest even, with subnormals, overflow, inf and nan") {
  int bad = 0;
  float first_bad = 0;
  for (float f : interesting_floats()) {
    if (std::isnan(f)) continue;
    if (half(f).bits != expect_half(f) && bad++ == 0) first_bad = f;
  }
  CHECK_MESSAGE(bad == 0, "first mismatch at " << first_bad);

  // Spot checks that pin the rules themselves.
  CHECK(half(1.0f).bits == 0x3c00);
  CHECK(half(-2.0f).bits == 0xc000);
  CHECK(half(-0.0f).bits == 0x8000);
  CHECK(half(2049.0f).bits == half(2048.0f).bits);  // tie, 2048 has the even mantissa
  CHECK(half(2051.0f).bits == half(2052.0f).bits);  // tie, rounds up to even
  CHECK(half(65519.0f).bits == 0x7bff);             // below the midpoint: max finite
  CHECK(half(65520.0f).bits == 0x7c00);             // midpoint to the (virtual) next: inf
  CHECK(half(0x1p-25f).bits == 0x0000);             // half of the smallest subnormal: tie to 0
  CHECK(half(0x1.000002p-25f).bits == 0x0001);
  CHECK(half(0x1.8p-24f).bits == 0x0002);           // 1.5 ulps: tie to even 2
  CHECK(half(0x1.ffcp-15f).bits == 0x0400);         // rounds up out of the subnormals
  CHECK(half(1e-45f).bits == 0x0000);
  CHECK(half(std::numeric_limits<float>::infinity()).bits == 0x7c00);
  CHECK(half(-std::numeric_limits<float>::infinity()).bits == 0xfc00);

  for (std::uint32_t nan_bits : {0x7fc00000u, 0x7f800001u, 0xffffffffu, 0x7fa00000u}) {
    const half h(std::bit_cast<float>(nan_bits));
    CHECK((h.bits & 0x7c00) == 0x7c00);
    CHECK((h.bits & 0x03ff) != 0);  // still NaN, not inf, even for payload only in low bits
    CHECK(((h.bits & 0x8000) != 0) == ((nan_bits & 0x80000000u) != 0));
  }
}

TEST_CASE("half round trip keeps every non-NaN pattern") {
  int bad = 0;
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    half h;
    h.bits = static_cast<std::uint16_t>(b);
    const half back(static_cast<float>(h));
    if ((b & 0x7c00) == 0x7c00 && (b & 0x3ff)) bad += (back.bits & 0x7c00) != 0x7c00 || !(back.bits & 0x3ff);
    else bad += back.bits != h.bits;
  }
  CHECK(bad == 0);
}

TEST_CASE("bfloat16 narrowing rounds to nearest even; widening is exact") {
  int bad = 0;
  float first_bad = 0;
  for (float f : interesting_floats()) {
    if (std::isnan(f)) continue;
    if (bfloat16(f).bits != expect_bf16(f) && bad++ == 0) first_bad = f;
  }
  CHECK_MESSAGE(bad == 0, "first mismatch at " << first_bad);

  int bad_widen = 0;
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    bfloat16 x;
    x.bits = static_cast<std::uint16_t>(b);
    const float f = static_cast<float>(x);
    const int e = (b >> 7) & 0xff;
    const int m = b & 0x7f;
    double want = e == 0 ? std::ldexp(m, -133) : std::ldexp(128 + m, e - 134);
    if (e == 0xff) want = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
    if (b & 0x8000) want = -want;
    if (std::isnan(want)) bad_widen += !std::isnan(f);
    else bad_widen += static_cast<double>(f) != want || std::signbit(f) != ((b & 0x8000u) != 0);
    // Round trip
    if (!std::isnan(f)) bad_widen += bfloat16(f).bits != x.bits;
  }
  CHECK(bad_widen == 0);

  CHECK(bfloat16(1.0f).bits == 0x3f80);
  CHECK(bfloat16(std::bit_cast<float>(0x3f808000u)).bits == 0x3f80);  // tie, even stays
  CHECK(bfloat16(std::bit_cast<float>(0x3f818000u)).bits == 0x3f82);  // tie, odd rounds up
  CHECK(bfloat16(std::bit_cast<float>(0x3f808001u)).bits == 0x3f81);
  CHECK(bfloat16(std::bit_cast<float>(0x7f7fffffu)).bits == 0x7f80);  // float max rounds to inf
  CHECK(bfloat16(std::bit_cast<float>(0x00008000u)).bits == 0x0000);  // subnormal tie to even 0
  CHECK(bfloat16(std::bit_cast<float>(0x00018000u)).bits == 0x0002);
  for (std::uint32_t nan_bits : {0x7fc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu}) {
    const bfloat16 b(std::bit_cast<float>(nan_bits));
    CHECK((b.bits & 0x7f80) == 0x7f80);
    CHECK((b.bits & 0x007f) != 0);  // a NaN with payload only in the dropped bits stays NaN
    CHECK(((b.bits & 0x8000) != 0) == ((nan_bits & 0x80000000u) != 0));
  }
}

TEST_CASE("dtype table") {
  CHECK(ddp::dtype_size(ddp::dtype::f16) == sizeof(half));
  CHECK(ddp::dtype_size(ddp::dtype::bf16) == sizeof(bfloat16));
  CHECK(ddp::dtype_size(ddp::dtype::f64) == 8);
  CHECK(ddp::dtype_size(ddp::dtype::i32) == 4);
  static_assert(ddp::dtype_of_v<half> == ddp::dtype::f16);
  static_assert(ddp::dtype_of_v<const bfloat16> == ddp::dtype::bf16);
  static_assert(ddp::dtype_of_v<std::int64_t> == ddp::dtype::i64);
  static_assert(ddp::element<float> && !ddp::element<char>);
  CHECK(std::string(ddp::dtype_name(ddp::dtype::bf16)) == "bf16");
  CHECK(std::string(ddp::op_name(ddp::op::prod)) == "prod");
}
