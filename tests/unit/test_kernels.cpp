#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/detail/copy.hpp>
#include <ddp/detail/kernels.hpp>
#include <ddp/reducer/detail/fp8.hpp>

#include <doctest/doctest.h>

#include "raises.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using ddp_test::raises;
using ddp::bfloat16;
using ddp::dtype;
using ddp::half;
using ddp::op;
namespace det = ddp::detail;

namespace {

// ---- naive scalar reference, written from the documented semantics --------------------------

template <class T>
struct ref;

template <class F>
F canonical(F x) {
  return std::isnan(x) ? std::numeric_limits<F>::quiet_NaN() : x;
}

template <class F>
F ref_float_op_raw(F a, F b, op o) {
  switch (o) {
    case op::sum:
    case op::avg: return a + b;
    case op::prod: return a * b;
    case op::min: return (b < a || std::isnan(b)) ? b : a;
    case op::max: return (b > a || std::isnan(b)) ? b : a;
  }
  return a;
}

template <class F>
F ref_float_op(F a, F b, op o) {
  return canonical(ref_float_op_raw(a, b, o));
}

template <class I>
I ref_int_op(I a, I b, op o) {
  using U = std::make_unsigned_t<I>;
  switch (o) {
    case op::sum:
    case op::avg: return static_cast<I>(static_cast<U>(a) + static_cast<U>(b));
    case op::prod: return static_cast<I>(static_cast<U>(a) * static_cast<U>(b));
    case op::min: return b < a ? b : a;
    case op::max: return b > a ? b : a;
  }
  return a;
}

template <class T>
T ref_reduce(T a, T b, op o) {
  if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>)
    return T(ref_float_op(static_cast<float>(a), static_cast<float>(b), o));
  else if constexpr (std::is_floating_point_v<T>)
    return ref_float_op(a, b, o);
  else
    return ref_int_op(a, b, o);
}

template <class T>
T ref_combine(const std::vector<const T*>& ins, std::size_t i, op o) {
  if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) {
    float acc = static_cast<float>(ins[0][i]);
    for (std::size_t j = 1; j < ins.size(); ++j) acc = ref_float_op(acc, static_cast<float>(ins[j][i]), o);
    return T(acc);
  } else {
    T acc = ins[0][i];
    for (std::size_t j = 1; j < ins.size(); ++j) acc = ref_reduce(acc, ins[j][i], o);
    return acc;
  }
}

template <class T>
constexpr bool is_16 = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

// The compute type of T: float for the 16-bit floats.
template <class T>
using wide = std::conditional_t<is_16<T>, float, T>;

// 2^-(k+1) with 2^k the smallest power of two >= world (1 for a world of 1), written out
// independently.
double ref_pre(int world) {
  if (world == 1) return 1.0;
  int k = 0;
  while ((1 << k) < world) ++k;
  return std::ldexp(1.0, -(k + 1));
}

template <class T>
double ref_max() {
  if constexpr (std::is_same_v<T, half>) return 65504.0;
  else if constexpr (std::is_same_v<T, bfloat16>) return static_cast<double>(bfloat16::to_float(0x7f7f));
  else return static_cast<double>(std::numeric_limits<T>::max());
}

// The finishing division: a finite sum whose quotient passes the type's largest value gets
// that value (only rounding can carry an average of finite values there).
template <class T, class W>
W ref_finish(W acc, int world) {
  const W post = static_cast<W>(world * ref_pre(world));
  if (post == W(1)) return acc;
  W q = acc / post;
  if (std::isfinite(acc) && std::fabs(static_cast<double>(q)) > ref_max<T>()) q = std::copysign(static_cast<W>(ref_max<T>()), q);
  return canonical(q);
}

// Documented avg semantics of one combine: inputs from raw_from on are multiplied by 2^-k as
// they enter, the sum runs left to right in the compute type, and `finish` divides by
// world * 2^-k (floats) or world (integers, truncating) before the one rounding.
template <class T>
T ref_combine_avg(const std::vector<const T*>& ins, std::size_t i, int world, int raw_from, bool finish) {
  using W = wide<T>;
  if constexpr (std::is_integral_v<T>) {
    T acc = ins[0][i];
    for (std::size_t j = 1; j < ins.size(); ++j) acc = ref_int_op(acc, ins[j][i], op::sum);
    return finish ? static_cast<T>(acc / static_cast<T>(world)) : acc;
  } else {
    const W pre = static_cast<W>(ref_pre(world));
    auto in = [&](std::size_t j) {
      const W x = static_cast<W>(ins[j][i]);
      return static_cast<int>(j) >= raw_from ? x * pre : x;
    };
    W acc = canonical(in(0));
    for (std::size_t j = 1; j < ins.size(); ++j) acc = ref_float_op(acc, in(j), op::sum);
    if (finish) acc = ref_finish<T>(acc, world);
    return T(acc);
  }
}

// ---- data -------------------------------------------------------------------------------------

template <class T>
std::vector<T> random_data(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<T> v(n);
  if constexpr (std::is_integral_v<T>) {
    std::uniform_int_distribution<T> d(std::numeric_limits<T>::min(), std::numeric_limits<T>::max());
    std::uniform_int_distribution<int> small(-9, 9);
    for (std::size_t i = 0; i < n; ++i) v[i] = (i % 3 == 0) ? static_cast<T>(small(rng)) : d(rng);
  } else {
    std::uniform_real_distribution<float> d(-4.0f, 4.0f);
    for (std::size_t i = 0; i < n; ++i) {
      float x = d(rng);
      if (i % 97 == 5) x = std::numeric_limits<float>::quiet_NaN();
      if (i % 101 == 7) x = -std::numeric_limits<float>::infinity();
      if (i % 103 == 9) x = 0.0f;
      if (i % 107 == 11) x = -0.0f;
      if (i % 109 == 13) x = 3e-6f;  // f16 subnormal range
      if (i % 113 == 17) x = 7e4f;   // f16 overflow
      v[i] = T(x);
    }
  }
  return v;
}

template <class T>
bool same_bits(const T* a, const T* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(T)) == 0;
}

template <class T>
std::size_t first_diff(const T* a, const T* b, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (std::memcmp(a + i, b + i, sizeof(T)) != 0) return i;
  return n;
}

constexpr std::size_t sizes[] = {0, 1, 7, 31, 1000003};
constexpr op ops[] = {op::sum, op::avg, op::min, op::max, op::prod};

template <class T>
void check_reduce_into() {
  for (std::size_t n : sizes) {
    for (op o : ops) {
      CAPTURE(n);
      CAPTURE(ddp::op_name(o));
      // One element of offset makes every pointer miss vector alignment.
      auto a = random_data<T>(n + 1, static_cast<std::uint32_t>(n) * 7 + 1);
      auto b = random_data<T>(n + 1, static_cast<std::uint32_t>(n) * 7 + 2);
      std::vector<T> expect(n);
      for (std::size_t i = 0; i < n; ++i) expect[i] = ref_reduce(a[i + 1], b[i + 1], o);
      det::reduce_into(a.data() + 1, b.data() + 1, n, o);
      CHECK(first_diff(a.data() + 1, expect.data(), n) == n);

      // dst == src
      auto c = random_data<T>(n, 99);
      std::vector<T> expect_self(n);
      for (std::size_t i = 0; i < n; ++i) expect_self[i] = ref_reduce(c[i], c[i], o);
      det::reduce_into(c.data(), c.data(), n, o);
      CHECK(first_diff(c.data(), expect_self.data(), n) == n);
    }
  }
}

template <class T>
void check_combine() {
  for (std::size_t n : sizes) {
    for (op o : ops) {
      for (int nins : {1, 2, 3, 5}) {
        // The large size crosses many tiles; two ops and two input counts cover its paths.
        if (n > 100000 && ((o != op::sum && o != op::min) || nins == 1 || nins == 3)) continue;
        CAPTURE(n);
        CAPTURE(ddp::op_name(o));
        CAPTURE(nins);
        std::vector<std::vector<T>> bufs;
        for (int j = 0; j < nins; ++j)
          bufs.push_back(random_data<T>(n + 1, static_cast<std::uint32_t>(j * 1000 + n)));
        std::vector<const T*> ins;
        for (auto& b : bufs) ins.push_back(b.data() + 1);
        std::vector<T> expect(n);
        for (std::size_t i = 0; i < n; ++i) expect[i] = ref_combine(ins, i, o);

        // Outputs: every input (aliased, the shared-memory allreduce case) plus one separate.
        std::vector<T> separate(n + 1);
        std::vector<T*> outs;
        for (auto& b : bufs) outs.push_back(b.data() + 1);
        outs.push_back(separate.data() + 1);
        det::combine(outs.data(), static_cast<int>(outs.size()), ins.data(), nins, n, o);
        for (std::size_t k = 0; k < outs.size(); ++k) {
          CAPTURE(k);
          CHECK(first_diff(outs[k], expect.data(), n) == n);
        }
      }
    }
  }
}

template <class T>
void check_combine_avg() {
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{31}, std::size_t{3001}}) {
    for (int world : {1, 2, 3, 5, 8, 9}) {
      for (int nins : {1, 2, 3, 5}) {
        for (int raw_from = 0; raw_from <= nins; ++raw_from) {
          for (bool finish : {false, true}) {
            CAPTURE(n);
            CAPTURE(world);
            CAPTURE(nins);
            CAPTURE(raw_from);
            CAPTURE(finish);
            std::vector<std::vector<T>> bufs;
            for (int j = 0; j < nins; ++j)
              bufs.push_back(random_data<T>(n + 1, static_cast<std::uint32_t>(j * 31 + world * 7 + n)));
            std::vector<const T*> ins;
            for (auto& b : bufs) ins.push_back(b.data() + 1);
            std::vector<T> expect(n);
            // One input that is only copied (a partial result, not finished) keeps its bits.
            const bool copy = nins == 1 && (world == 1 || (raw_from == 1 && !finish));
            for (std::size_t i = 0; i < n; ++i) expect[i] = copy ? ins[0][i] : ref_combine_avg(ins, i, world, raw_from, finish);
            std::vector<T> separate(n + 1);
            std::vector<T*> outs;
            for (auto& b : bufs) outs.push_back(b.data() + 1);
            outs.push_back(separate.data() + 1);
            det::combine(outs.data(), static_cast<int>(outs.size()), ins.data(), nins, n, op::avg,
                         det::avg_step{world, raw_from, finish});
            for (std::size_t k = 0; k < outs.size(); ++k) {
              CAPTURE(k);
              CHECK(first_diff(outs[k], expect.data(), n) == n);
            }
          }
        }
      }
    }
  }
}

template <class T>
void check_prescale_finish() {
  for (std::size_t n : sizes) {
    for (int world : {1, 2, 3, 7, 9}) {
      CAPTURE(n);
      CAPTURE(world);
      const auto a = random_data<T>(n + 1, 5);
      std::vector<T> pre(n + 1), fin(a), expect_pre(n), expect_fin(n);
      for (std::size_t i = 0; i < n; ++i) {
        if constexpr (std::is_integral_v<T>) {
          expect_pre[i] = a[i + 1];
          expect_fin[i] = static_cast<T>(a[i + 1] / static_cast<T>(world));
        } else {
          using W = wide<T>;
          const W x = static_cast<W>(a[i + 1]);
          expect_pre[i] = world == 1 ? a[i + 1] : T(canonical(x * static_cast<W>(ref_pre(world))));
          expect_fin[i] = world == 1 ? a[i + 1] : T(ref_finish<T>(x, world));
        }
      }
      det::avg_prescale(pre.data() + 1, a.data() + 1, n, world);
      CHECK(first_diff(pre.data() + 1, expect_pre.data(), n) == n);
      det::avg_finish(fin.data() + 1, n, world);
      CHECK(first_diff(fin.data() + 1, expect_fin.data(), n) == n);
    }
  }
}

}  // namespace

TEST_CASE_TEMPLATE("reduce_into matches the scalar reference bit for bit", T, float, double, half,
                   bfloat16, std::int32_t, std::int64_t) {
  check_reduce_into<T>();
}

TEST_CASE_TEMPLATE("combine matches the scalar reference bit for bit", T, float, double, half,
                   bfloat16, std::int32_t, std::int64_t) {
  check_combine<T>();
}

TEST_CASE_TEMPLATE("combine of an average scales, sums and divides like the scalar reference", T, float,
                   double, half, bfloat16, std::int32_t, std::int64_t) {
  check_combine_avg<T>();
}

TEST_CASE_TEMPLATE("avg_prescale and avg_finish match the scalar reference", T, float, double, half,
                   bfloat16, std::int32_t, std::int64_t) {
  check_prescale_finish<T>();
}

TEST_CASE("an average that fits the type never overflows, whatever the sum") {
  // Two ranks averaging f16 40000 (the sum, 80000, is beyond f16's 65504), every world size up
  // to 9 at f16's largest value, bf16 and f32 near their maxima: one n-input combine (the
  // shared-memory reduction) and a ring-like chain of two-input steps (the tcp ring).
  auto check = [](auto tag, float value) {
    using T = decltype(tag);
    for (int world = 1; world <= 9; ++world) {
      CAPTURE(world);
      CAPTURE(value);
      std::vector<T> data(static_cast<std::size_t>(world), T(value));
      std::vector<const T*> ins;
      for (auto& x : data) ins.push_back(&x);
      T out{};
      T* outs[] = {&out};
      det::combine(outs, 1, ins.data(), world, 1, op::avg, det::avg_step{world, 0, true});
      CHECK(static_cast<double>(static_cast<float>(out)) == doctest::Approx(value).epsilon(world * 0.004));
      // Chain: step 0 combines two ranks' own data, later steps add one rank's data to the
      // partial result, the last step finishes.
      if (world < 2) continue;
      T acc = data[0];
      for (int s = 0; s + 1 < world; ++s) {
        const T* in2[] = {&acc, &data[static_cast<std::size_t>(s) + 1]};
        T* o2[] = {&acc};
        det::combine(o2, 1, in2, 2, 1, op::avg, det::avg_step{world, s == 0 ? 0 : 1, s == world - 2});
      }
      CHECK(static_cast<double>(static_cast<float>(acc)) == doctest::Approx(value).epsilon(world * 0.004));
    }
  };
  check(half{}, 40000.0f);
  check(half{}, 65504.0f);
  check(half{}, -65504.0f);
  check(half{}, 9000.0f);
  check(bfloat16{}, 3.3e38f);
  check(bfloat16{}, -3.38e38f);
  check(float{}, std::numeric_limits<float>::max());
  check(float{}, -3.0e38f);
  // f64 through the same kernels.
  for (int world = 2; world <= 9; ++world) {
    std::vector<double> d(static_cast<std::size_t>(world), std::numeric_limits<double>::max());
    std::vector<const double*> ins;
    for (auto& x : d) ins.push_back(&x);
    double out = 0;
    double* outs[] = {&out};
    det::combine(outs, 1, ins.data(), world, 1, op::avg, det::avg_step{world, 0, true});
    CHECK(out == doctest::Approx(std::numeric_limits<double>::max()));
    CHECK(std::isfinite(out));
  }
}

TEST_CASE("where the sum fits, an average is bit for bit the sum divided by the world size") {
  // Scaling by a power of two is exact, so the new path must reproduce (sum) / n, the result of
  // dividing after summing, on data that stays clear of overflow and the subnormal range.
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> d(-1000.0, 1000.0);
  for (int world : {2, 3, 5, 6, 7, 9}) {
    const std::size_t n = 1001;
    std::vector<std::vector<float>> f(static_cast<std::size_t>(world), std::vector<float>(n));
    std::vector<std::vector<double>> g(static_cast<std::size_t>(world), std::vector<double>(n));
    for (int r = 0; r < world; ++r)
      for (std::size_t i = 0; i < n; ++i) {
        f[static_cast<std::size_t>(r)][i] = static_cast<float>(d(rng));
        g[static_cast<std::size_t>(r)][i] = d(rng);
      }
    std::vector<const float*> fi;
    std::vector<const double*> gi;
    for (int r = 0; r < world; ++r) {
      fi.push_back(f[static_cast<std::size_t>(r)].data());
      gi.push_back(g[static_cast<std::size_t>(r)].data());
    }
    std::vector<float> fo(n);
    std::vector<double> go(n);
    float* fos[] = {fo.data()};
    double* gos[] = {go.data()};
    det::combine(fos, 1, fi.data(), world, n, op::avg, det::avg_step{world, 0, true});
    det::combine(gos, 1, gi.data(), world, n, op::avg, det::avg_step{world, 0, true});
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      volatile float fs = fi[0][i];
      volatile double gs = gi[0][i];
      for (int r = 1; r < world; ++r) {
        fs = fs + fi[static_cast<std::size_t>(r)][i];
        gs = gs + gi[static_cast<std::size_t>(r)][i];
      }
      bad += std::bit_cast<std::uint32_t>(fo[i]) != std::bit_cast<std::uint32_t>(static_cast<float>(fs / static_cast<float>(world)));
      bad += std::bit_cast<std::uint64_t>(go[i]) != std::bit_cast<std::uint64_t>(static_cast<double>(gs / world));
    }
    CAPTURE(world);
    CHECK(bad == 0);
  }
}

TEST_CASE("float sum is the plain left-to-right sum, exactly") {
  // Values of very different magnitude make the summation order visible in the result.
  const std::vector<float> a{1e8f, 1.0f, -1e8f, 3.5f, 0.1f, 1e-3f, 7.0f, 9.0f, 1e8f};
  const std::vector<float> b{1.0f, 1e8f, 1.0f, 1e-8f, 0.2f, 1e3f, -7.0f, 1.0f, 1.0f};
  const std::vector<float> c{-1e8f, -1e8f, 1e8f, 2.0f, 0.3f, 1.0f, 1e-7f, -10.0f, -1e8f};
  std::vector<float> out(a.size());
  const float* ins[] = {a.data(), b.data(), c.data()};
  float* outs[] = {out.data()};
  det::combine(outs, 1, ins, 3, a.size(), op::sum);
  for (std::size_t i = 0; i < a.size(); ++i) {
    volatile float x = a[i];
    x = x + b[i];
    x = x + c[i];
    CHECK(std::bit_cast<std::uint32_t>(out[i]) == std::bit_cast<std::uint32_t>(static_cast<float>(x)));
  }
  // (1e8 + 1) - 1e8 == 0 in float: the order really is left to right.
  CHECK(out[0] == 0.0f);
  CHECK(out[1] == 0.0f);
}

TEST_CASE("integer sum and prod wrap") {
  std::int32_t a[] = {std::numeric_limits<std::int32_t>::max(), std::numeric_limits<std::int32_t>::min(), 65536};
  const std::int32_t b[] = {1, -1, 65536};
  det::reduce_into(a, b, 3, op::sum);
  CHECK(a[0] == std::numeric_limits<std::int32_t>::min());
  CHECK(a[1] == std::numeric_limits<std::int32_t>::max());
  std::int32_t p[] = {65536, -3};
  const std::int32_t q[] = {65536, 5};
  det::reduce_into(p, q, 2, op::prod);
  CHECK(p[0] == 0);
  CHECK(p[1] == -15);
  std::int64_t m[] = {-7};
  det::avg_finish(m, 1, 2);
  CHECK(m[0] == -3);  // truncation toward zero
  // Integer avg is the wrapping sum divided once: 3 ranks of INT32_MAX wrap before dividing.
  const std::int32_t big[] = {std::numeric_limits<std::int32_t>::max()};
  const std::int32_t* bins[] = {big, big, big};
  std::int32_t bout[1];
  std::int32_t* bouts[] = {bout};
  det::combine(bouts, 1, bins, 3, 1, op::avg, det::avg_step{3, 0, true});
  CHECK(bout[0] == static_cast<std::int32_t>(static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max()) * 3u) / 3);
}

TEST_CASE("min and max propagate NaN from either side") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (op o : {op::min, op::max}) {
    float a[] = {nan, 1.0f, 2.0f, -1.0f};
    const float b[] = {1.0f, nan, 1.0f, 5.0f};
    det::reduce_into(a, b, 4, o);
    CHECK(std::isnan(a[0]));
    CHECK(std::isnan(a[1]));
    CHECK(a[2] == (o == op::min ? 1.0f : 2.0f));
    CHECK(a[3] == (o == op::min ? -1.0f : 5.0f));
  }
  half h[] = {half(1.0f), half(nan)};
  const half g[] = {half(nan), half(-2.0f)};
  det::reduce_into(h, g, 2, op::max);
  CHECK((h[0].bits & 0x7fffu) > 0x7c00u);
  CHECK((h[1].bits & 0x7fffu) > 0x7c00u);
}

TEST_CASE("NaN results are the canonical quiet NaN whatever the operands' payloads") {
  const float n1 = std::bit_cast<float>(0xffc00001u);  // negative, payload 1
  const float n2 = std::bit_cast<float>(0x7fc00002u);
  for (op o : ops) {
    float a[] = {n1, n2, 1.0f, n1};
    const float b[] = {n2, n1, n2, 1.0f};
    det::reduce_into(a, b, 4, o);
    for (float x : a) CHECK(std::bit_cast<std::uint32_t>(x) == 0x7fc00000u);
    half h[] = {half(n1)};
    const half g[] = {half(n2)};
    det::reduce_into(h, g, 1, o);
    CHECK(h[0].bits == 0x7e00u);
  }
  double d[] = {-std::numeric_limits<double>::quiet_NaN()};
  const double e[] = {1.0};
  det::reduce_into(d, e, 1, op::sum);
  CHECK(std::bit_cast<std::uint64_t>(d[0]) == 0x7ff8000000000000ull);
}

TEST_CASE("f16 combine rounds once, reduce_into rounds each step") {
  // 2048 + 1 + 1: float gives 2050, exact in f16. Rounding after each step gives
  // 2048 + 1 -> 2049 -> ties to even 2048, then again 2048.
  const half a[] = {half(2048.0f)};
  const half b[] = {half(1.0f)};
  const half c[] = {half(1.0f)};
  half out[1];
  const half* ins[] = {a, b, c};
  half* outs[] = {out};
  det::combine(outs, 1, ins, 3, 1, op::sum);
  CHECK(static_cast<float>(out[0]) == 2050.0f);
  half acc[] = {a[0]};
  det::reduce_into(acc, b, 1, op::sum);
  det::reduce_into(acc, c, 1, op::sum);
  CHECK(static_cast<float>(acc[0]) == 2048.0f);
}

// NaN payloads may differ between the F16C path and ddp::half (operations make every NaN they
// produce canonical before narrowing, see above); everything else must match bit for bit.
bool same_half(std::uint16_t a, std::uint16_t b) {
  const bool na = (a & 0x7c00) == 0x7c00 && (a & 0x3ff);
  const bool nb = (b & 0x7c00) == 0x7c00 && (b & 0x3ff);
  return na || nb ? na && nb && ((a ^ b) & 0x8000) == 0 : a == b;
}
bool same_float(float a, float b) {
  return std::isnan(a) || std::isnan(b) ? std::isnan(a) && std::isnan(b) && std::signbit(a) == std::signbit(b)
                                        : std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
}

TEST_CASE("vector f16/bf16 conversion equals ddp::half / ddp::bfloat16 on every half and many floats") {
  namespace k = det::kern;
  constexpr std::size_t w = k::lanes<half>::width;
  // All 65536 16-bit patterns, widened.
  std::size_t bad_widen = 0;
  for (std::uint32_t base = 0; base < 65536; base += w) {
    half h[w];
    bfloat16 b[w];
    for (std::size_t i = 0; i < w; ++i) {
      h[i].bits = static_cast<std::uint16_t>(base + i);
      b[i].bits = static_cast<std::uint16_t>(base + i);
    }
    float fh[w];
    float fb[w];
    k::lanes<float>::store(fh, k::lanes<half>::load(h));
    k::lanes<float>::store(fb, k::lanes<bfloat16>::load(b));
    for (std::size_t i = 0; i < w; ++i) {
      bad_widen += !same_float(fh[i], half::to_float(h[i].bits));
      bad_widen += std::bit_cast<std::uint32_t>(fb[i]) != std::bit_cast<std::uint32_t>(bfloat16::to_float(b[i].bits));
    }
  }
  CHECK(bad_widen == 0);
  // Narrowing: a stride through all 2^32 float patterns, plus the rounding boundaries of every
  // f16 exponent (low 13 bits just below, at and above the halfway point).
  std::vector<std::uint32_t> pats;
  for (std::uint64_t x = 0; x < (1ull << 32); x += 4093) pats.push_back(static_cast<std::uint32_t>(x));
  for (std::uint32_t e = 0; e < 256; ++e)
    for (std::uint32_t low : {0x0fffu, 0x1000u, 0x1001u, 0x2fffu, 0x3000u, 0x3001u, 0x1fffu, 0x0u, 0x7fffu, 0x8000u, 0x8001u, 0x18000u})
      for (std::uint32_t s : {0u, 0x80000000u}) pats.push_back(s | (e << 23) | low);
  while (pats.size() % w) pats.push_back(0x7f800001u);  // signalling NaN
  std::size_t bad_f16 = 0;
  std::size_t bad_bf16 = 0;
  for (std::size_t base = 0; base < pats.size(); base += w) {
    float f[w];
    for (std::size_t i = 0; i < w; ++i) f[i] = std::bit_cast<float>(pats[base + i]);
    half h[w];
    bfloat16 b[w];
    k::lanes<half>::store(h, k::lanes<float>::load(f));
    k::lanes<bfloat16>::store(b, k::lanes<float>::load(f));
    for (std::size_t i = 0; i < w; ++i) {
      if (!same_half(h[i].bits, half::from_float(f[i])) && bad_f16++ == 0) MESSAGE("f16 first mismatch at float bits " << pats[base + i]);
      if (b[i].bits != bfloat16::from_float(f[i]) && bad_bf16++ == 0) MESSAGE("bf16 first mismatch at float bits " << pats[base + i]);
    }
  }
  CHECK(bad_f16 == 0);
  CHECK(bad_bf16 == 0);
  CHECK(pats.size() > 1000000);
}

TEST_CASE("type-erased entry points dispatch on dtype and reject bad arguments") {
  std::vector<double> a{1.0, 2.0, 3.0};
  const std::vector<double> b{10.0, 20.0, 30.0};
  det::reduce_into(a.data(), b.data(), 3, dtype::f64, op::sum);
  CHECK(a == std::vector<double>{11.0, 22.0, 33.0});

  std::vector<half> x{half(1.0f), half(2.0f)};
  std::vector<half> y{half(0.5f), half(0.25f)};
  void* outs[] = {x.data()};
  const void* ins[] = {x.data(), y.data()};
  det::combine(outs, 1, ins, 2, 2, dtype::f16, op::sum);
  CHECK(static_cast<float>(x[0]) == 1.5f);
  CHECK(static_cast<float>(x[1]) == 2.25f);

  std::vector<std::int32_t> z{9, -9};
  det::avg_finish(z.data(), 2, dtype::i32, 2);
  CHECK(z == std::vector<std::int32_t>{4, -4});
  std::vector<half> h{half(40000.0f), half(-6.0f)};
  det::avg_prescale(h.data(), h.data(), 2, dtype::f16, 3);  // 3 ranks: 2^-3
  CHECK(static_cast<float>(h[0]) == 5000.0f);
  CHECK(static_cast<float>(h[1]) == -0.75f);
  det::avg_finish(h.data(), 2, dtype::f16, 3);  // divides by 3/8
  CHECK(h[0] == half(5000.0f / 0.375f));  // 13336: the average of three ranks' 40000, one rounding
  CHECK(static_cast<float>(h[1]) == -2.0f);

  CHECK(raises([&] { det::reduce_into(a.data(), b.data(), 3, static_cast<dtype>(42), op::sum); }, ddp::errc::invalid_argument) == "");
  CHECK(raises([&] { det::reduce_into(a.data(), b.data(), 3, dtype::f64, static_cast<op>(9)); }, ddp::errc::invalid_argument) == "");
  CHECK(raises([&] { det::avg_finish(z.data(), 2, dtype::i32, 0); }, ddp::errc::invalid_argument) == "");
  CHECK(raises([&] { det::avg_prescale(z.data(), z.data(), 2, dtype::i32, -1); }, ddp::errc::invalid_argument) == "");
  CHECK(a == std::vector<double>{11.0, 22.0, 33.0});  // rejected calls touched nothing
}

TEST_CASE("every kernel entry rejects an unknown dtype, op or avg step with invalid_argument") {
  // Values no enumerator has: each must be errc::invalid_argument, never a trap (a division by
  // dtype_size's 0) or a silent no-op, whatever the other arguments.
  constexpr auto bad = ddp::errc::invalid_argument;
  std::vector<double> a(4096, 1.0), b(4096, 2.0);
  void* outs[] = {a.data()};
  const void* ins[] = {a.data(), b.data()};
  double* touts[] = {a.data()};
  const double* tins[] = {a.data(), b.data()};
  for (int t : {6, 7, 42, 255}) {
    CAPTURE(t);
    const auto dt = static_cast<dtype>(t);
    CHECK(raises([&] { det::reduce_into(a.data(), b.data(), 4096, dt, op::sum); }, bad) == "");
    CHECK(raises([&] { det::combine(outs, 1, ins, 2, 4096, dt, op::sum); }, bad) == "");
    CHECK(raises([&] { det::combine(outs, 1, ins, 2, 0, dt, op::avg, det::avg_step{2, 0, true}); }, bad) == "");
    CHECK(raises([&] { det::avg_prescale(a.data(), a.data(), 4096, dt, 2); }, bad) == "");
    CHECK(raises([&] { det::avg_finish(a.data(), 4096, dt, 2); }, bad) == "");
    CHECK(raises([&] { (void)det::checked_size(dt); }, bad) == "");
  }
  for (int o : {5, 9, 200}) {
    CAPTURE(o);
    const auto op_ = static_cast<op>(o);
    CHECK(raises([&] { det::reduce_into(a.data(), b.data(), 4096, dtype::f64, op_); }, bad) == "");
    CHECK(raises([&] { det::reduce_into(a.data(), b.data(), 4096, op_); }, bad) == "");
    CHECK(raises([&] { det::combine(outs, 1, ins, 2, 4096, dtype::f64, op_); }, bad) == "");
    CHECK(raises([&] { det::combine(touts, 1, tins, 2, 4096, op_); }, bad) == "");
  }
  for (auto s : {det::avg_step{0, 0, true}, det::avg_step{-3, 0, false}, det::avg_step{2, -1, true}, det::avg_step{2, 3, true}}) {
    CHECK(raises([&] { det::combine(outs, 1, ins, 2, 4096, dtype::f64, op::avg, s); }, bad) == "");
    CHECK(raises([&] { det::combine(touts, 1, tins, 2, 4096, op::avg, s); }, bad) == "");
  }
  CHECK(a == std::vector<double>(4096, 1.0));  // rejected calls touched nothing
}

TEST_CASE("copy_bytes_streaming copies every byte, whatever the alignment and length") {
  const std::size_t big = ddp::detail::stream_min_bytes * 2 + 77;
  std::vector<unsigned char> src(big + 64), dst(big + 64);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{100}, ddp::detail::stream_min_bytes - 1,
                        ddp::detail::stream_min_bytes, ddp::detail::stream_min_bytes + 63, big}) {
    for (std::size_t so : {0, 1, 5, 16}) {
      for (std::size_t doff : {0, 3, 8, 15, 16}) {
        std::fill(dst.begin(), dst.end(), 0xee);
        ddp::detail::copy_bytes_streaming(dst.data() + doff, src.data() + so, n);
        CAPTURE(n);
        CAPTURE(so);
        CAPTURE(doff);
        CHECK(std::memcmp(dst.data() + doff, src.data() + so, n) == 0);
        if (doff > 0) CHECK(dst[doff - 1] == 0xee);  // nothing before
        CHECK(dst[doff + n] == 0xee);                // nothing after
      }
    }
  }
}

TEST_CASE("the finishing division clamps a quotient past the largest value on both sides") {
  // A finite average that rounding carried beyond the largest finite value becomes that value,
  // with its sign; the sign mask once kept negative quotients at -inf.
  auto check = [](auto tag) {
    using T = decltype(tag);
    using L = det::kern::lanes<T>;
    using S = typename L::scalar;
    const auto top = static_cast<S>(det::kern::max_finite<T>());
    const typename L::vec half_step = typename L::vec{} + S(0.5);
    const auto up = det::kern::avg_out<T, det::kern::fin_mode::div>(typename L::vec{} + top, half_step);
    const auto down = det::kern::avg_out<T, det::kern::fin_mode::div>(typename L::vec{} - top, half_step);
    CHECK(up[0] == top);
    CHECK(down[0] == -top);
    const S inf = std::numeric_limits<S>::infinity();  // inf in stays inf: not a rounding artefact
    CHECK(det::kern::avg_out<T, det::kern::fin_mode::div>(typename L::vec{} - inf, half_step)[0] == -inf);
  };
  check(float{});
  check(double{});
  check(half{});
  check(bfloat16{});
}

#if DDP_DETAIL_ISA_DISPATCH
// A build for the x86-64 baseline (this one, with optimization) runs the kernels' AVX2 or
// AVX-512 copy where the CPU has it (detail/isa.hpp): every entry point must give the baseline
// copy's bits in every copy, for every input pattern (NaN, inf, subnormals), op, average step,
// scale and length (tails included). Each `all` call runs its function under every copy this
// CPU has and compares the bytes of what it returns.
TEST_CASE("kernels: every instruction-set copy gives the baseline copy's bits") {
  const det::isa best = det::isa_use(det::isa::avx512);
  struct restore {
    ~restore() { det::isa_use(det::isa::avx512); }
  } r;
  if (best == det::isa::build) {
    MESSAGE("this CPU has no AVX2 and F16C (or the OS keeps no AVX state): only the baseline copy runs here");
    return;
  }
  std::vector<det::isa> copies{det::isa::build, det::isa::avx2};
  if (best == det::isa::avx512) copies.push_back(det::isa::avx512);
  std::mt19937 g(26);
  std::uniform_int_distribution<std::uint32_t> bits;
  auto random_bits = [&](auto tag, std::size_t n) {
    using T = decltype(tag);
    std::vector<T> v(n);
    for (auto& x : v) {
      const std::uint32_t b = bits(g);
      std::memcpy(static_cast<void*>(&x), &b, sizeof x);  // NaN, inf, subnormals among them
    }
    return v;
  };
  int compared = 0;
  auto all = [&](const char* what, auto&& f) {
    det::isa_use(copies[0]);
    const auto want = f();
    for (std::size_t c = 1; c < copies.size(); ++c) {
      CHECK(det::isa_use(copies[c]) == copies[c]);
      const auto got = f();
      REQUIRE(got.size() == want.size());
      CHECK_MESSAGE(std::memcmp(got.data(), want.data(), want.size() * sizeof want[0]) == 0, what, " in copy ",
                    det::isa_name());
      ++compared;
    }
  };
  auto each_type = [&](auto&& f) {
    f(float{});
    f(half{});
    f(bfloat16{});
  };
  for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{9}, std::size_t{17}, std::size_t{1023},
                        std::size_t{4097}, std::size_t{70001}}) {
    CAPTURE(n);
    each_type([&](auto tag) {
      using T = decltype(tag);
      const auto a = random_bits(tag, n), b = random_bits(tag, n), c = random_bits(tag, n), d = random_bits(tag, n);
      for (op o : {op::sum, op::avg, op::min, op::max, op::prod}) {
        CAPTURE(o);
        for (int nins = 1; nins <= 4; ++nins)
          for (int world : {1, 2, 3, 4, 6})
            for (int raw = 0; raw <= nins; ++raw)
              for (bool fin : {false, true}) {
                const T* ins[] = {a.data(), b.data(), c.data(), d.data()};
                all("combine", [&] {
                  std::vector<T> out(n), out2(n);
                  T* outs[] = {out.data(), out2.data()};
                  det::combine(outs, 2, ins, nins, n, o, det::avg_step{world, raw, fin});
                  CHECK(std::memcmp(out.data(), out2.data(), n * sizeof(T)) == 0);
                  return out;
                });
              }
        all("reduce_into", [&] {
          auto acc = a;
          det::reduce_into(acc.data(), b.data(), n, o);
          det::reduce_into(static_cast<void*>(acc.data()), c.data(), n, ddp::dtype_of<T>::value, o);
          return acc;
        });
      }
      // In place, as the shared-memory reducer calls it: the output is an input.
      all("combine in place", [&] {
        auto x = a, y = b;
        const T* ins[] = {x.data(), y.data()};
        T* outs[] = {x.data()};
        det::combine(outs, 1, ins, 2, n, op::avg, det::avg_step{2, 0, true});
        return x;
      });
      for (int world : {2, 3, 5})
        all("avg_prescale, avg_finish", [&] {
          std::vector<T> x(n);
          det::avg_prescale(x.data(), a.data(), n, world);
          det::avg_finish(x.data(), n, world);
          return x;
        });
    });
    // The compression hooks' bulk conversions with a scale, and fp8's kernels.
    const auto f = random_bits(float{}, n), f2 = random_bits(float{}, n);
    const auto h = random_bits(half{}, n);
    const auto bh = random_bits(bfloat16{}, n);
    all("max_abs_finite", [&] { return std::vector<float>{det::max_abs_finite(f.data(), n)}; });
    for (float scale : {1.0f, 0.25f, 1024.0f, 1.0e-6f})
      for (bool sat : {false, true}) {
        CAPTURE(scale);
        CAPTURE(sat);
        all("narrow_to_f16", [&] {
          std::vector<half> o(n);
          det::narrow_to_f16(o.data(), f.data(), n, scale, sat);
          return o;
        });
        all("narrow_to_bf16", [&] {
          std::vector<bfloat16> o(n);
          det::narrow_to_bf16(o.data(), f.data(), n, scale, sat);
          return o;
        });
        all("widen_from_f16", [&] {
          std::vector<float> o(n);
          det::widen_from_f16(o.data(), h.data(), n, scale);
          return o;
        });
        all("widen_from_bf16", [&] {
          std::vector<float> o(n);
          det::widen_from_bf16(o.data(), bh.data(), n, scale);
          return o;
        });
      }
    namespace k8 = det::fp8;
    // Finite values of every magnitude, with some NaN and inf among them in the first blocks.
    std::vector<float> x(n);
    std::uniform_real_distribution<float> mag(-40.0f, 40.0f);
    for (std::size_t i = 0; i < n; ++i) x[i] = std::ldexp(i % 2 ? -1.0f : 1.0f, static_cast<int>(mag(g))) * 1.37f;
    if (n > 40) x[3] = std::numeric_limits<float>::quiet_NaN(), x[37] = std::numeric_limits<float>::infinity();
    all("fp8 add_into", [&] {
      auto y = x;
      k8::add_into(y.data(), f2.data(), n);
      return y;
    });
    auto quantized = [&](auto fmt) {
      constexpr ddp::fp8_format F = decltype(fmt)::value;
      std::vector<float> out(n + n / 32 + 1);  // residuals, then the block scales
      std::vector<std::uint8_t> codes(n);
      auto y = x;
      for (std::size_t at = 0, blk = 0; at < n; at += 32, ++blk) {
        const std::size_t len = std::min<std::size_t>(32, n - at);
        const float s = k8::block_scale(y.data() + at, len, k8::spec_of(F).largest);
        out[n + blk] = s;
        k8::quantize<F>(y.data() + at, len, s, codes.data() + at, y.data() + at);
      }
      std::copy(y.begin(), y.end(), out.begin());
      return std::make_pair(out, codes);
    };
    auto fp8_checks = [&](auto fmt) {
      constexpr ddp::fp8_format F = decltype(fmt)::value;
      all("fp8 block_scale, quantize", [&] { return quantized(fmt).first; });
      all("fp8 codes", [&] { return quantized(fmt).second; });
      all("fp8 quantize_blocks", [&] {
        std::vector<float> out(n + n / 64 + 1, 0.0f);  // residuals, the block scales, then the codes
        std::vector<std::uint8_t> codes(n);
        k8::quantize_blocks<F>(x.data(), n, 64, out.data(), out.data() + n, codes.data());
        out.insert(out.end(), codes.begin(), codes.end());
        return out;
      });
      const auto [rs, codes] = quantized(fmt);
      for (int ranks : {1, 2, 3})
        all("fp8 sum_ranks", [&] {
          std::vector<float> out(n);
          std::vector<const std::uint8_t*> rows(static_cast<std::size_t>(ranks), codes.data());
          std::vector<float> scales(static_cast<std::size_t>(ranks));
          for (std::size_t at = 0, blk = 0; at < n; at += 32, ++blk) {
            const std::size_t len = std::min<std::size_t>(32, n - at);
            for (int r = 0; r < ranks; ++r) {
              scales[static_cast<std::size_t>(r)] = rs[n + blk] * static_cast<float>(r + 1);
              rows[static_cast<std::size_t>(r)] = codes.data() + at;
            }
            k8::sum_ranks<F>(out.data() + at, len, rows.data(), scales.data(), ranks, ranks == 3 ? 3.0f : 1.0f);
          }
          return out;
        });
      all("fp8 accumulate", [&] {
        std::vector<float> out(n);
        for (std::size_t at = 0, blk = 0; at < n; at += 32, ++blk) {
          const std::size_t len = std::min<std::size_t>(32, n - at);
          k8::accumulate<F>(out.data() + at, codes.data() + at, len, rs[n + blk], true);
          k8::accumulate<F>(out.data() + at, codes.data() + at, len, rs[n + blk] * 0.5f, false);
        }
        return out;
      });
    };
    fp8_checks(std::integral_constant<ddp::fp8_format, ddp::fp8_format::e4m3>{});
    fp8_checks(std::integral_constant<ddp::fp8_format, ddp::fp8_format::e5m2>{});
  }
  // The comparisons ran: the test cannot pass by comparing nothing.
  CHECK(compared > 1000);
  MESSAGE("copies compared: ", copies.size(), ", comparisons: ", compared);
}
#endif
