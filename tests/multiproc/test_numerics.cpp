#include <ddp/reducer/ring.hpp>

#include <ddp/data_parallel.hpp>
#include <ddp/reducer/tree.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/transport/tcp.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness.hpp"
#include "reducer_checks.hpp"

// Differential test of every host reducer against a reference: for each dtype x op x reducer x
// world size 1..9 and counts from 0 to 70,000 (fewer than the ranks included), with values near
// each type's limits, the result must lie within the error bound documented in
// docs/reducers.md ("Accuracy"), and every rank must hold the same bits.
//
// Reference: every rank's input, widened exactly, accumulated in rank order in long double (at
// least f64), rounded once to the type. Bound for sum and avg, with n ranks, u the unit roundoff
// of the type (f32 2^-24, f64 2^-53, f16 2^-11, bf16 2^-8), s its smallest subnormal and
// S = sum of |x_r| (divided by n for avg):   |result - reference| <= (n + 1) u S + 4 n s.
// prod (inputs of magnitude 1/2 to 2): (n + 1) u |reference|. min, max and every integer op:
// exact. A reference beyond the type's range is inf, and so must the result be.

using namespace std::chrono_literals;
using namespace ddp_test;
using ddp::bfloat16;
using ddp::dtype;
using ddp::half;
using ddp::op;

namespace {

constexpr ddp_test::local_group opts{60s};

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
// Uniform in [0, 1) from a hash.
double unit(std::uint64_t h) { return static_cast<double>(h >> 11) * 0x1.0p-53; }

template <class T>
constexpr bool is_16 = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;
template <class T>
constexpr bool is_float = is_16<T> || std::is_floating_point_v<T>;

template <class T>
struct limits {
  static double max() {
    if constexpr (std::is_same_v<T, half>) return 65504.0;
    else if constexpr (std::is_same_v<T, bfloat16>) return static_cast<double>(bfloat16::to_float(0x7f7f));
    else return static_cast<double>(std::numeric_limits<T>::max());
  }
  static double sub() {  // smallest positive subnormal
    if constexpr (std::is_same_v<T, half>) return 0x1.0p-24;
    else if constexpr (std::is_same_v<T, bfloat16>) return 0x1.0p-133;
    else return static_cast<double>(std::numeric_limits<T>::denorm_min());
  }
  static double u() {  // unit roundoff
    if constexpr (std::is_same_v<T, half>) return 0x1.0p-11;
    else if constexpr (std::is_same_v<T, bfloat16>) return 0x1.0p-8;
    else return std::numeric_limits<T>::epsilon() / 2;
  }
};

template <class T>
T to_type(long double x) {
  if constexpr (is_16<T>) return T(static_cast<float>(static_cast<double>(x)));
  else return static_cast<T>(x);
}
template <class T>
long double widen(T x) {
  if constexpr (is_16<T>) return static_cast<float>(x);
  else return static_cast<long double>(x);
}

// Input of rank r at element i. The kind of value is a function of i alone, so that every rank
// holds a value of the same kind at i (all near the largest value, say), the value itself of
// (r, i).
template <class T>
T input(int r, std::size_t i, op o, int n, std::uint64_t salt) {
  const std::uint64_t hi = mix(i * 0x632be59bd9b4e019ull ^ salt);
  const std::uint64_t hr = mix(hi ^ (static_cast<std::uint64_t>(r) + 1) * 0x8cb92ba72f3d8dd7ull);
  const double v = unit(hr), sgn = (hr & 1) ? -1.0 : 1.0, same_sgn = (hi & 1) ? -1.0 : 1.0;
  if constexpr (is_float<T>) {
    const double M = limits<T>::max(), s = limits<T>::sub();
    const auto ordinary = [&] { return sgn * (0.5 + v) * std::ldexp(1.0, static_cast<int>(hr % 21) - 10); };
    switch (o) {
      case op::avg:
        switch (hi % 8) {
          case 0: return to_type<T>(ordinary());
          case 1: return to_type<T>(same_sgn * M * (1 - v / 16));  // the plain sum overflows
          case 2: return to_type<T>(same_sgn * M);                 // every rank at the limit
          case 3: return to_type<T>(sgn * M * v);
          case 4: return to_type<T>(sgn * s * static_cast<double>(hr % 64));  // subnormals
          case 5: return to_type<T>(sgn * s * 1024 * (1 + v));                // just above
          case 6: return to_type<T>(sgn * 0.0);
          default: return to_type<T>(same_sgn * M * 0.6 + sgn * M * 0.3 * v);
        }
      case op::sum:
        switch (hi % 6) {
          case 0: return to_type<T>(ordinary());
          case 1: return to_type<T>(same_sgn * M / 10 * (1 - v / 4));  // large, the sum fits
          case 2: return to_type<T>(sgn * M / 10 * v);
          case 3: return to_type<T>(sgn * s * static_cast<double>(hr % 64));
          case 4: return to_type<T>(n > 1 ? same_sgn * M * 0.75 : ordinary());  // overflows: inf
          default: return to_type<T>(sgn * 0.0);
        }
      case op::prod:
        return to_type<T>(hi % 5 == 0 ? sgn : sgn * (0.5 + 1.5 * v));
      case op::min:
      case op::max:
        switch (hi % 5) {
          case 0: return to_type<T>(sgn * M * v);
          case 1: return to_type<T>(sgn * std::numeric_limits<double>::infinity());
          case 2: return to_type<T>(sgn * s * static_cast<double>(hr % 64));
          case 3: return to_type<T>(sgn * 0.0);
          default: return to_type<T>(sgn * M);
        }
    }
    return T{};
  } else {
    using L = std::numeric_limits<T>;
    const auto big = static_cast<long double>(L::max()) / 9;  // any sum of 9 fits
    switch (o) {
      case op::sum:
      case op::avg:
        switch (hi % 4) {
          case 0: return static_cast<T>(static_cast<long double>(sgn) * big * static_cast<long double>(v));
          case 1: return static_cast<T>(static_cast<long double>(same_sgn) * big * (1 - static_cast<long double>(v) / 8));
          case 2: return static_cast<T>(static_cast<long long>(hr % 201) - 100);
          default: return static_cast<T>(static_cast<long long>(hr % 7) - 3);
        }
      case op::prod: return static_cast<T>(static_cast<long long>(hr % 7) - 3);  // |product| <= 3^9
      case op::min:
      case op::max:
        switch (hi % 3) {
          case 0: return (hr & 2) ? L::max() : L::min();
          case 1: return static_cast<T>(hr);
          default: return static_cast<T>(static_cast<long long>(hr % 7) - 3);
        }
    }
    return T{};
  }
}

struct ref_value {
  long double value;  // accumulated, before the final rounding
  long double abs;    // sum of |x| (for the bound)
};

template <class T>
ref_value reference(int n, std::size_t i, op o, std::uint64_t salt) {
  long double acc = widen(input<T>(0, i, o, n, salt)), abs = std::fabs(acc);
  for (int r = 1; r < n; ++r) {
    const long double x = widen(input<T>(r, i, o, n, salt));
    abs += std::fabs(x);
    switch (o) {
      case op::sum: case op::avg: acc += x; break;
      case op::prod: acc *= x; break;
      case op::min: acc = x < acc ? x : acc; break;
      case op::max: acc = x > acc ? x : acc; break;
    }
  }
  if (o == op::avg) {
    if constexpr (is_float<T>) {
      acc /= n;
      abs /= n;
    } else {
      acc = static_cast<long double>(static_cast<long long>(acc) / n);  // truncating, as documented
    }
  }
  return {acc, abs};
}

// "" when `got` is within the documented bound of the reference, else why not.
template <class T>
std::string judge(T got, const ref_value& ref, op o, int n) {
  const long double g = widen(got);
  const T want = to_type<T>(ref.value);
  const long double w = widen(want);
  auto say = [&](const char* what) {
    return std::string(what) + ": got " + std::to_string(static_cast<double>(g)) + ", reference " +
           std::to_string(static_cast<double>(w)) + " (unrounded " + std::to_string(static_cast<double>(ref.value)) + ")";
  };
  if constexpr (!is_float<T>) {
    return g == w ? std::string() : say("integer result differs");
  } else {
    if (std::isnan(g)) return say("NaN");
    if (std::isinf(w)) return g == w ? std::string() : say("the reference overflows, the result does not");
    if (std::isinf(g)) return say("inf where the reference is finite");
    if (o == op::min || o == op::max) return g == w ? std::string() : say("min/max differs");
    const long double u = limits<T>::u(), s = limits<T>::sub();
    const long double bound =
        o == op::prod ? (n + 1) * u * std::fabs(w) : (n + 1) * u * ref.abs + 4 * n * s;
    return std::fabs(g - w) <= bound ? std::string() : say(("error beyond the bound " + std::to_string(static_cast<double>(bound))).c_str());
  }
}

// Runs every dtype and op at every count through `red`; returns one bit hash per case (its
// name in `names`), to be compared across ranks.
template <class T, class Reducer>
void run_type(ddp::process_group& pg, Reducer& red, const std::vector<std::size_t>& counts, const std::string& label,
              std::vector<std::string>& names, std::vector<std::uint64_t>& hashes) {
  const int n = pg.size(), r = pg.rank();
  for (op o : {op::sum, op::avg, op::min, op::max, op::prod}) {
    for (std::size_t count : counts) {
      const std::uint64_t salt = mix(count * 131 + static_cast<std::uint64_t>(o) * 7 + static_cast<std::uint64_t>(ddp::dtype_of_v<T>));
      const std::string what = label + " " + ddp::dtype_name(ddp::dtype_of_v<T>) + " " + ddp::op_name(o) + " count " +
                               std::to_string(count) + " on " + std::to_string(n) + " ranks";
      std::vector<T> v(count);
      for (std::size_t i = 0; i < count; ++i) v[i] = input<T>(r, i, o, n, salt);
      red.allreduce(std::span<T>(v), o);
      // Each rank checks every n-th element against the reference; the bit hashes compared
      // below extend the check to every rank's copy.
      for (std::size_t i = static_cast<std::size_t>(r); i < count; i += static_cast<std::size_t>(n)) {
        const std::string why = judge(v[i], reference<T>(n, i, o, salt), o, n);
        if (!why.empty()) throw std::runtime_error(what + ", element " + std::to_string(i) + ": " + why);
      }
      names.push_back(what);
      hashes.push_back(fnv(v.data(), v.size() * sizeof(T)));
    }
  }
}

// reduce_scatter of every op: rank r's slice r against the reference (the same inputs as an
// allreduce of per_rank * n elements).
template <class T, class Reducer>
void run_reduce_scatter(ddp::process_group& pg, Reducer& red, std::size_t per_rank, const std::string& label) {
  const int n = pg.size(), r = pg.rank();
  const std::size_t count = per_rank * static_cast<std::size_t>(n);
  for (op o : {op::sum, op::avg, op::min, op::max, op::prod}) {
    const std::uint64_t salt = mix(count * 977 + static_cast<std::uint64_t>(o) * 7 + static_cast<std::uint64_t>(ddp::dtype_of_v<T>));
    std::vector<T> in(count), out(per_rank);
    for (std::size_t i = 0; i < count; ++i) in[i] = input<T>(r, i, o, n, salt);
    red.reduce_scatter(std::span<const T>(in), std::span<T>(out), o);
    for (std::size_t j = 0; j < per_rank; ++j) {
      const std::size_t i = static_cast<std::size_t>(r) * per_rank + j;
      const std::string why = judge(out[j], reference<T>(n, i, o, salt), o, n);
      if (!why.empty())
        throw std::runtime_error(label + " reduce_scatter " + ddp::dtype_name(ddp::dtype_of_v<T>) + " " + ddp::op_name(o) +
                                 " " + std::to_string(per_rank) + " per rank, element " + std::to_string(i) + ": " + why);
    }
  }
}

template <class Reducer>
void run_all(ddp::process_group& pg, Reducer& red, const std::vector<std::size_t>& counts, const std::string& label,
             std::vector<std::string>& names, std::vector<std::uint64_t>& hashes) {
  for (std::size_t per_rank : {std::size_t{1}, std::size_t{333}}) {
    run_reduce_scatter<half>(pg, red, per_rank, label);
    run_reduce_scatter<float>(pg, red, per_rank, label);
    run_reduce_scatter<std::int32_t>(pg, red, per_rank, label);
  }
  run_type<float>(pg, red, counts, label, names, hashes);
  run_type<double>(pg, red, counts, label, names, hashes);
  run_type<half>(pg, red, counts, label, names, hashes);
  run_type<bfloat16>(pg, red, counts, label, names, hashes);
  run_type<std::int32_t>(pg, red, counts, label, names, hashes);
  run_type<std::int64_t>(pg, red, counts, label, names, hashes);
}

// Every rank's hashes, case by case, through the group's store: one exchange for all cases.
void require_same_hashes(ddp::process_group& pg, const std::vector<std::string>& names,
                         const std::vector<std::uint64_t>& hashes) {
  std::string mine;
  for (auto h : hashes) mine += std::to_string(h) + ",";
  const auto all = pg.all_gather(mine);
  for (std::size_t q = 0; q < all.size(); ++q) {
    if (all[q] == mine) continue;
    std::size_t c = 0, a = 0, b = 0;  // find the first case that differs
    while (c < names.size()) {
      const std::size_t ea = mine.find(',', a), eb = all[q].find(',', b);
      if (eb == std::string::npos || mine.compare(a, ea - a, all[q], b, eb - b) != 0) break;
      a = ea + 1, b = eb + 1, ++c;
    }
    throw std::runtime_error("ranks " + std::to_string(pg.rank()) + " and " + std::to_string(q) + " hold different bits: " +
                             (c < names.size() ? names[c] : std::string("?")));
  }
}

std::vector<std::size_t> counts_for(int n) {
  // Empty, fewer elements than ranks, about as many, odd sizes across segments and tiles, and
  // 70,000 elements.
  std::vector<std::size_t> c{0, 1, static_cast<std::size_t>(n) + 1, 61, 1000, 4099, 70000};
  if (n > 2) c.push_back(static_cast<std::size_t>(n) - 1);
  return c;
}

void run_worlds(const char* label, const std::function<void(ddp::process_group&, std::vector<std::string>&,
                                                               std::vector<std::uint64_t>&)>& body) {
  for (int n = 1; n <= 9; ++n) {
    CAPTURE(n);
    auto outs = on_ranks(n, opts, [&](ddp::process_group& pg) {
      std::vector<std::string> names;
      std::vector<std::uint64_t> hashes;
      body(pg, names, hashes);
      require_same_hashes(pg, names, hashes);
    }, 120s);
    INFO(label);
    expect_ok(outs);
  }
}

}  // namespace

TEST_CASE("ring<tcp> agrees with the reference within the documented bound: every dtype and op, 1-9 ranks") {
  run_worlds("ring<tcp>", [](ddp::process_group& pg, auto& names, auto& hashes) {
    // Small segments: received data is reduced piece by piece while the rest arrives.
    ddp::ring<ddp::tcp> red{pg, ddp::reducer_options{.segment_bytes = 4096}};
    run_all(pg, red, counts_for(pg.size()), "ring<tcp>", names, hashes);
  });
}

TEST_CASE("tree<tcp> agrees with the reference within the documented bound: small and large messages, 1-9 ranks") {
  run_worlds("tree<tcp>", [](ddp::process_group& pg, auto& names, auto& hashes) {
    // 1 KiB: counts up to 61 take recursive doubling, larger ones halving-doubling.
    ddp::tree<ddp::tcp> red{pg, ddp::reducer_options{.small_bytes = 1024}};
    run_all(pg, red, counts_for(pg.size()), "tree<tcp>", names, hashes);
    // Halving-doubling with fewer elements than blocks.
    ddp::tree<ddp::tcp> hd{pg, ddp::reducer_options{.small_bytes = 0}};
    run_all(pg, hd, {1, static_cast<std::size_t>(pg.size()) + 1}, "tree<tcp> halving-doubling", names, hashes);
  });
}

TEST_CASE("ring<shm> agrees with the reference within the documented bound: every dtype and op, 1-9 ranks") {
  run_worlds("ring<shm>", [](ddp::process_group& pg, auto& names, auto& hashes) {
    ddp::ring<ddp::shm> red{pg, ddp::shm_options{.segment_bytes = 16 << 20, .slot_bytes = 8192}, ddp::reducer_options{}};
    run_all(pg, red, counts_for(pg.size()), "ring<shm>", names, hashes);
  });
}

TEST_CASE("tree<shm> agrees with the reference within the documented bound: every dtype and op, 1-9 ranks") {
  run_worlds("tree<shm>", [](ddp::process_group& pg, auto& names, auto& hashes) {
    ddp::tree<ddp::shm> red{pg, ddp::shm_options{.segment_bytes = 16 << 20, .slot_bytes = 8192}, ddp::reducer_options{}};
    run_all(pg, red, counts_for(pg.size()), "tree<shm>", names, hashes);
  });
}

TEST_CASE("data_parallel averages f16 and bf16 gradients whose sum overflows the type") {
  // 2 ranks at f16 40000 (sum 80000 > 65504) and bf16 3e38, then 8 ranks near f16 9000 (sum
  // about 72000): data_parallel's default op is avg, which must not go through the plain sum.
  for (int n : {2, 8}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
      const std::size_t len = 1000;
      const float base = n == 2 ? 40000.0f : 9000.0f;
      auto g16 = [&](int q, std::size_t j) { return half(base + static_cast<float>((q * 7 + static_cast<int>(j)) % 16) * 8); };
      auto gbf = [&](int q, std::size_t j) { return bfloat16(3.0e38f - static_cast<float>((q + static_cast<int>(j)) % 4) * 1e37f); };
      std::vector<half> w16(len), d16(len);
      std::vector<bfloat16> wbf(len), dbf(len);
      std::vector<ddp::tensor_view> views{ddp::make_tensor_view(w16, d16, "f16"), ddp::make_tensor_view(wbf, dbf, "bf16")};
      ddp::data_parallel dp{pg, views};
      for (std::size_t j = 0; j < len; ++j) d16[j] = g16(r, j), dbf[j] = gbf(r, j);
      dp.grad_ready(0);
      dp.grad_ready(1);
      dp.finish();
      for (std::size_t j = 0; j < len; ++j) {
        double e16 = 0, ebf = 0;
        for (int q = 0; q < n; ++q) e16 += static_cast<float>(g16(q, j)), ebf += static_cast<float>(gbf(q, j));
        e16 /= n, ebf /= n;
        const double got16 = static_cast<float>(d16[j]), gotbf = static_cast<float>(dbf[j]);
        require(std::isfinite(got16) && std::fabs(got16 - e16) <= (n + 1) * 0x1.0p-11 * e16,
                "f16 average of element " + std::to_string(j) + " is " + std::to_string(got16) + ", expected " + std::to_string(e16));
        require(std::isfinite(gotbf) && std::fabs(gotbf - ebf) <= (n + 1) * 0x1.0p-8 * ebf,
                "bf16 average of element " + std::to_string(j) + " is " + std::to_string(gotbf) + ", expected " + std::to_string(ebf));
      }
      require_same_bits(pg, d16.data(), len * sizeof(half), "f16 gradients");
      require_same_bits(pg, dbf.data(), len * sizeof(bfloat16), "bf16 gradients");
    }, 120s));
  }
}

TEST_CASE("an unknown dtype or op on the untyped path is invalid_argument on every reducer, never a trap") {
  // Every rank passes the same bad value, so no peer is left waiting; each call must fail with
  // errc::invalid_argument (the ring used to divide by dtype_size's 0: SIGFPE).
  for (int n : {1, 2, 3}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, local_group{10s}, [&](ddp::process_group& pg) {
      auto expect_invalid = [&](auto& red, const char* name) {
        std::vector<float> v(64, 1.0f), out(64);
        for (int t : {6, 9, 255})
          require_raises([&] { red.allreduce(v.data(), v.size(), static_cast<dtype>(t), op::sum); },
                         ddp::errc::invalid_argument, {},
                         std::string(name) + ": allreduce with dtype " + std::to_string(t));
        for (int o : {5, 77})
          require_raises([&] { red.allreduce(v.data(), v.size(), dtype::f32, static_cast<op>(o)); },
                         ddp::errc::invalid_argument, {},
                         std::string(name) + ": allreduce with op " + std::to_string(o));
      };
      {
        ddp::ring<ddp::tcp> red{pg};
        expect_invalid(red, "ring<tcp>");
      }
      {
        ddp::tree<ddp::tcp> red{pg};
        expect_invalid(red, "tree<tcp>");
      }
      {
        ddp::ring<ddp::shm> red{pg, ddp::shm_options{.segment_bytes = 4 << 20}, ddp::reducer_options{}};
        expect_invalid(red, "ring<shm>");
      }
      {
        ddp::tree<ddp::shm> red{pg, ddp::shm_options{.segment_bytes = 4 << 20}, ddp::reducer_options{}};
        expect_invalid(red, "tree<shm>");
      }
    }, 60s));
  }
}
