#pragma once
// Checks shared by every reducer's multi-process suite. Inputs are chosen so that the exact
// result is representable in every dtype (small integers, powers of two for prod), which makes
// the independently computed reference exact; a second check uses random floats against a
// double-precision reference with a tolerance. Ranks also compare a hash of their result bits:
// every rank must end with the same bits.

#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/process_group.hpp>
#include <ddp/request.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <thread>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness.hpp"

namespace ddp_test {

/// Small exact value of rank `r` at index `i` for op `o`.
inline double exact_input(int r, std::size_t i, ddp::op o) {
  if (o == ddp::op::prod) {
    static const double v[] = {1.0, 2.0, -1.0, 1.0, 1.0, -2.0, 1.0};
    return v[(static_cast<std::size_t>(r) * 3 + i) % 7];
  }
  return static_cast<double>(static_cast<int>((static_cast<std::size_t>(r) * 7 + i * 13) % 17) - 8);
}

template <class T>
T from_double(double x) {
  if constexpr (std::is_same_v<T, ddp::half> || std::is_same_v<T, ddp::bfloat16>) return T(static_cast<float>(x));
  else return static_cast<T>(x);
}
template <class T>
double to_double(T x) {
  if constexpr (std::is_same_v<T, ddp::half> || std::is_same_v<T, ddp::bfloat16>) return static_cast<float>(x);
  else return static_cast<double>(x);
}

/// Reference result computed from everyone's inputs, in T's arithmetic where it matters (avg).
template <class T>
T exact_expected(int n, std::size_t i, ddp::op o) {
  double acc = exact_input(0, i, o);
  for (int r = 1; r < n; ++r) {
    const double x = exact_input(r, i, o);
    switch (o) {
      case ddp::op::sum: case ddp::op::avg: acc += x; break;
      case ddp::op::prod: acc *= x; break;
      case ddp::op::min: acc = std::min(acc, x); break;
      case ddp::op::max: acc = std::max(acc, x); break;
    }
  }
  if (o == ddp::op::avg) {
    if constexpr (std::is_integral_v<T>) return static_cast<T>(static_cast<T>(acc) / n);
    else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) return static_cast<T>(static_cast<T>(acc) / static_cast<T>(n));
    else return T(static_cast<float>(acc) / static_cast<float>(n));
  }
  return from_double<T>(acc);
}

inline std::uint64_t fnv(const void* p, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  auto b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

/// Every rank holds the same bits (compared through the process group).
inline void require_same_bits(ddp::process_group& pg, const void* p, std::size_t n, const std::string& what) {
  const auto all = pg.all_gather(std::to_string(fnv(p, n)));
  for (std::size_t q = 1; q < all.size(); ++q) require(all[q] == all[0], what + ": ranks hold different bits");
}

/// Allreduce of exact inputs; checks every element against the reference and the bits across ranks.
template <class T, class Reducer>
void check_exact(ddp::process_group& pg, Reducer& red, std::size_t count, ddp::op o) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = from_double<T>(exact_input(pg.rank(), i, o));
  red.allreduce(std::span<T>(v), o);
  const std::string what = std::string(ddp::dtype_name(ddp::dtype_of_v<T>)) + " " + ddp::op_name(o) + " count " +
                           std::to_string(count);
  for (std::size_t i = 0; i < count; ++i) {
    const T e = exact_expected<T>(pg.size(), i, o);
    if (std::memcmp(&v[i], &e, sizeof(T)) != 0)
      throw std::runtime_error(what + ": element " + std::to_string(i) + " is " + std::to_string(to_double(v[i])) +
                               ", expected " + std::to_string(to_double(e)));
  }
  require_same_bits(pg, v.data(), v.size() * sizeof(T), what);
}

template <class Reducer>
void check_all_types_and_ops(ddp::process_group& pg, Reducer& red, std::size_t count) {
  for (auto o : {ddp::op::sum, ddp::op::avg, ddp::op::min, ddp::op::max, ddp::op::prod}) {
    check_exact<float>(pg, red, count, o);
    check_exact<double>(pg, red, count, o);
    check_exact<ddp::half>(pg, red, count, o);
    check_exact<ddp::bfloat16>(pg, red, count, o);
    check_exact<std::int32_t>(pg, red, count, o);
    check_exact<std::int64_t>(pg, red, count, o);
  }
}

/// Random floats in `v` (anywhere: a vector, the shm arena): result within tolerance of a double
/// reference, same bits on every rank.
template <class Reducer>
void check_random_floats(ddp::process_group& pg, Reducer& red, std::span<float> v) {
  auto input = [](int r, std::size_t i) {
    std::uint64_t x = (static_cast<std::uint64_t>(r) + 1) * 0x9e3779b97f4a7c15ull ^ (i * 0xbf58476d1ce4e5b9ull);
    x ^= x >> 31;
    return static_cast<float>(static_cast<double>(x % 2000001) / 1000000.0 - 1.0);
  };
  const std::size_t count = v.size();
  for (std::size_t i = 0; i < count; ++i) v[i] = input(pg.rank(), i);
  red.allreduce(v, ddp::op::sum);
  for (std::size_t i = 0; i < count; i += 1 + count / 100000) {
    double ref = 0;
    for (int r = 0; r < pg.size(); ++r) ref += input(r, i);
    require(std::fabs(v[i] - ref) <= 1e-5 * pg.size(), "random f32 sum off at " + std::to_string(i));
  }
  require_same_bits(pg, v.data(), v.size() * sizeof(float), "random f32 sum");
}
template <class Reducer>
void check_random_floats(ddp::process_group& pg, Reducer& red, std::size_t count) {
  std::vector<float> v(count);
  check_random_floats(pg, red, std::span<float>(v));
}

/// An unknown dtype or op on the untyped entry points is errc::invalid_argument at the call, on
/// every rank alike, before anything is sent; the reducer stays usable.
template <class Reducer>
void check_invalid_arguments(ddp::process_group& pg, Reducer& red) {
  const auto bad_t = static_cast<ddp::dtype>(99);
  const auto bad_o = static_cast<ddp::op>(42);
  const auto inv = ddp::errc::invalid_argument;
  const std::size_t n = static_cast<std::size_t>(pg.size());
  std::vector<float> v(1000, 1.0f), all(1000 * n, 1.0f), one(1000);
  require_raises([&] { (void)red.allreduce_async(v.data(), v.size(), bad_t, ddp::op::sum); }, inv,
                 {"allreduce", "unknown dtype 99"}, "allreduce_async bad dtype");
  require_raises([&] { red.allreduce(v.data(), v.size(), bad_t, ddp::op::sum); }, inv, {"unknown dtype 99"},
                 "allreduce bad dtype");
  require_raises([&] { red.allreduce(v.data(), v.size(), ddp::dtype::f32, bad_o); }, inv, {"unknown reduction op 42"},
                 "allreduce bad op");
  require_raises([&] { (void)red.allreduce_async(v.data(), v.size(), ddp::dtype::f32, bad_o); }, inv,
                 {"unknown reduction op 42"}, "allreduce_async bad op");
  require_raises([&] { (void)red.broadcast_async(v.data(), v.size(), bad_t, 0); }, inv, {"broadcast", "unknown dtype"},
                 "broadcast bad dtype");
  require_raises([&] { (void)red.reduce_scatter_async(all.data(), one.data(), one.size(), bad_t, ddp::op::sum); },
                 inv, {"reduce_scatter", "unknown dtype"}, "reduce_scatter bad dtype");
  require_raises([&] { (void)red.reduce_scatter_async(all.data(), one.data(), one.size(), ddp::dtype::f32, bad_o); },
                 inv, {"reduce_scatter", "unknown reduction op"}, "reduce_scatter bad op");
  require_raises([&] { (void)red.allgather_async(one.data(), all.data(), one.size(), bad_t); }, inv,
                 {"allgather", "unknown dtype"}, "allgather bad dtype");
  // Nothing was sent: the next collective pairs up with the peers' next one.
  red.allreduce(std::span<float>(v), ddp::op::sum);
  for (float x : v) require(x == static_cast<float>(n), "allreduce after refused calls");
}

/// A broadcast of 256 elements from root 0 on `n` ranks of a `Reducer`, where rank `odd` passes
/// i32 and the others f32 (the same bytes): a mismatch on every rank naming both, never data
/// read as another type, within 12 s. Where the root sends and is done before a receiver can see
/// the difference, `then_barrier` runs a barrier after it, which brings the detecting rank's
/// verdict to the others. With `late`, rank 1 (neither the root nor `odd`) comes to the
/// broadcast that much later than the others, which have failed and left by then. Each rank's
/// outcome, for the caller to CHECK with broadcast_dtype_mismatch_seen().
template <class Reducer>
std::vector<outcome> run_broadcast_dtype_mismatch(const local_group& opts, int n, int odd, bool then_barrier,
                                                  std::chrono::milliseconds late = {}) {
  const int port = free_port();
  return run_ranks(n, [&](int r) {
    auto pg = ddp::init_process_group(opts(r, n, port, std::chrono::seconds(10)));
    Reducer red{pg};
    if (r == 1 && odd != 1) std::this_thread::sleep_for(late);
    std::vector<float> f(256, 1.5f);
    std::vector<std::int32_t> i(256, 7);
    if (r == odd)
      red.broadcast(std::span<std::int32_t>(i), 0);
    else
      red.broadcast(std::span<float>(f), 0);
    if (then_barrier) red.barrier();
  }, std::chrono::seconds(30));
}
/// What every rank's outcome of run_broadcast_dtype_mismatch must say; empty when it does.
inline std::string broadcast_dtype_mismatch_seen(const outcome& o) {
  if (o.errc != static_cast<int>(ddp::errc::mismatch)) return "not errc::mismatch: " + o.message;
  for (const char* t : {"broadcast #1 of 256 x f32 from root 0", "broadcast #1 of 256 x i32 from root 0"})
    if (o.message.find(t) == std::string::npos) return std::string("'") + t + "' not in: " + o.message;
  if (o.seconds >= 12.0) return "took " + std::to_string(o.seconds) + " s";
  return {};
}

/// reduce_scatter and allgather refuse overlapping buffers (errc::invalid_argument naming the
/// collective and both byte ranges) except the in-place form, which gives the right values,
/// also across the shm engine's chunk boundaries (`per` elements per rank).
template <class Reducer>
void check_overlap_rules(ddp::process_group& pg, Reducer& red, std::size_t per) {
  const int r = pg.rank();
  const std::size_t n = static_cast<std::size_t>(pg.size()), me = static_cast<std::size_t>(r);
  const auto inv = ddp::errc::invalid_argument;
  auto input = [](std::size_t q, std::size_t i) { return static_cast<float>((q * 7 + i * 3) % 1024); };
  std::vector<float> buf(per * (n + 1));
  for (std::size_t i = 0; i < per * n; ++i) buf[i] = input(me, i);
  // Output shifted by one element from this rank's slice: overlaps, not in place.
  require_raises([&] { (void)red.reduce_scatter_async(buf.data(), buf.data() + me * per + 1, per, ddp::dtype::f32, ddp::op::sum); },
                 inv, {"reduce_scatter", "overlap", "0x"}, "reduce_scatter overlapping");
  require_raises([&] { red.reduce_scatter(std::span<const float>(buf.data(), per * n), std::span<float>(buf.data() + per * n - 1, per), ddp::op::sum); },
                 inv, {"reduce_scatter", "overlap"}, "typed reduce_scatter overlapping");
  require_raises([&] { (void)red.allgather_async(buf.data() + me * per + 1, buf.data(), per, ddp::dtype::f32); }, inv,
                 {"allgather", "overlap", "0x"}, "allgather overlapping");
  // In place: the output is this rank's slice of the input.
  float* slice = buf.data() + me * per;
  red.reduce_scatter(std::span<const float>(buf.data(), per * n), std::span<float>(slice, per), ddp::op::sum);
  for (std::size_t i = 0; i < per; ++i) {
    float e = 0;
    for (std::size_t q = 0; q < n; ++q) e += input(q, me * per + i);
    if (slice[i] != e)
      throw std::runtime_error("in-place reduce_scatter: element " + std::to_string(i) + " is " + std::to_string(slice[i]) +
                               ", expected " + std::to_string(e));
  }
  // In place: the input is this rank's slice of the output.
  for (std::size_t i = 0; i < per; ++i) slice[i] = static_cast<float>(me * 100000 + i);
  red.allgather(std::span<const float>(slice, per), std::span<float>(buf.data(), per * n));
  for (std::size_t q = 0; q < n; ++q)
    for (std::size_t i = 0; i < per; ++i)
      if (buf[q * per + i] != static_cast<float>(q * 100000 + i))
        throw std::runtime_error("in-place allgather: element " + std::to_string(q * per + i) + " is wrong");
}

}  // namespace ddp_test
