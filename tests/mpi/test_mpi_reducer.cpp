// The MPI reducer under a real `mpirun`: every rank runs this doctest program, builds a ddp
// process group next to MPI_COMM_WORLD, and checks results against references computed from
// every rank's inputs (tests/multiproc/reducer_checks.hpp). Checks are CHECKs, not REQUIREs, so a wrong value on one rank does not
// make it skip collectives the others are waiting in; main() fails the job when any rank failed.
#include <ddp/reducer/mpi.hpp>

#include <ddp/concepts.hpp>
#include <ddp/data_parallel.hpp>
#include <ddp/data_parallel/fully_sharded.hpp>
#include <ddp/memory/host_allocator.hpp>
#include <ddp/optim/adamw.hpp>
#include <ddp/planner/size_planner.hpp>

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <numeric>
#include <span>
#include <string>
#include <vector>

// The one reducer front end offers abort() only where the engine can stop a running collective:
// an MPI call cannot be interrupted.
template <class R>
concept has_abort_call = requires(R& r) { r.abort(); };
static_assert(!has_abort_call<ddp::mpi_reducer>);

#include "../multiproc/reducer_checks.hpp"

using ddp_test::raises;

static_assert(ddp::reducer<ddp::mpi_reducer>);

namespace {

ddp::process_group* g_pg = nullptr;

ddp::process_group& pg() { return *g_pg; }

int pick_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// Every rank holds the same bits (hashes compared over MPI).
bool same_bits_everywhere(const void* p, std::size_t bytes) {
  const auto h = static_cast<unsigned long long>(ddp_test::fnv(p, bytes));
  std::vector<unsigned long long> all(static_cast<std::size_t>(pg().size()));
  MPI_Allgather(&h, 1, MPI_UNSIGNED_LONG_LONG, all.data(), 1, MPI_UNSIGNED_LONG_LONG, MPI_COMM_WORLD);
  return std::all_of(all.begin(), all.end(), [&](unsigned long long x) { return x == h; });
}

// reducer_checks' exact inputs and references, checked without throwing: a rank that sees a
// wrong value still takes part in every later collective, so one failure cannot hang the job.
template <class T>
void check_exact(ddp::mpi_reducer& red, std::size_t count, ddp::op o) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = ddp_test::from_double<T>(ddp_test::exact_input(pg().rank(), i, o));
  red.allreduce(std::span<T>(v), o);
  std::size_t bad = count;
  for (std::size_t i = 0; i < count && bad == count; ++i) {
    const T e = ddp_test::exact_expected<T>(pg().size(), i, o);
    if (std::memcmp(&v[i], &e, sizeof(T)) != 0) bad = i;
  }
  INFO(std::string(ddp::dtype_name(ddp::dtype_of_v<T>)), " ", std::string(ddp::op_name(o)), " count ", count, " first wrong element ", bad);
  CHECK(bad == count);
  CHECK(same_bits_everywhere(v.data(), v.size() * sizeof(T)));
}

void check_all_types_and_ops(ddp::mpi_reducer& red, std::size_t count) {
  for (auto o : {ddp::op::sum, ddp::op::avg, ddp::op::min, ddp::op::max, ddp::op::prod}) {
    check_exact<float>(red, count, o);
    check_exact<double>(red, count, o);
    check_exact<ddp::half>(red, count, o);
    check_exact<ddp::bfloat16>(red, count, o);
    check_exact<std::int32_t>(red, count, o);
    check_exact<std::int64_t>(red, count, o);
  }
}

}  // namespace

TEST_CASE("mpi_reducer: ranks follow the process group") {
  ddp::mpi_reducer red{pg()};
  CHECK(red.rank() == pg().rank());
  CHECK(red.size() == pg().size());
  int r = -1, n = 0;
  MPI_Comm_rank(red.comm(), &r);
  MPI_Comm_size(red.comm(), &n);
  CHECK(r == pg().rank());
  CHECK(n == pg().size());
  int cmp = MPI_UNEQUAL;
  MPI_Comm_compare(red.comm(), MPI_COMM_WORLD, &cmp);
  CHECK(cmp != MPI_IDENT);  // a private communicator: its traffic never matches the program's
  red.barrier();
}

TEST_CASE("mpi_reducer: every dtype and op, exact references") {
  ddp::mpi_reducer red{pg()};
  for (std::size_t count : {std::size_t{1}, std::size_t{7}, std::size_t{1000}, std::size_t{65537}})
    check_all_types_and_ops(red, count);
}

TEST_CASE("mpi_reducer: an average whose sum overflows the type is still the average") {
  // f16 40000 on two ranks sums to 80000, beyond f16's 65504: the average must not go through
  // that sum (nor bf16's, f32's or f64's near their maxima), for allreduce and reduce_scatter.
  ddp::mpi_reducer red{pg()};
  const int n = pg().size(), r = pg().rank();
  auto check = [&](auto tag, double base, double step, double u) {
    using T = decltype(tag);
    auto value = [&](int q, std::size_t i) { return base - step * static_cast<double>((q + static_cast<int>(i)) % 4); };
    auto make = [&](double x) {
      if constexpr (std::is_same_v<T, ddp::half> || std::is_same_v<T, ddp::bfloat16>) return T(static_cast<float>(x));
      else return static_cast<T>(x);
    };
    auto back = [](T x) {
      if constexpr (std::is_same_v<T, ddp::half> || std::is_same_v<T, ddp::bfloat16>) return static_cast<double>(static_cast<float>(x));
      else return static_cast<double>(x);
    };
    const std::size_t count = 257;
    std::vector<T> v(count), in(count * static_cast<std::size_t>(n)), out(count);
    for (std::size_t i = 0; i < count; ++i) v[i] = make(value(r, i));
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = make(value(r, i));
    red.allreduce(std::span<T>(v), ddp::op::avg);
    red.reduce_scatter(std::span<const T>(in), std::span<T>(out), ddp::op::avg);
    std::size_t bad = count, bad_rs = count;
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t k = static_cast<std::size_t>(r) * count + i;
      double e = 0, e_rs = 0;
      for (int q = 0; q < n; ++q) e += back(make(value(q, i))), e_rs += back(make(value(q, k)));
      e /= n, e_rs /= n;
      if (bad == count && !(std::fabs(back(v[i]) - e) <= (n + 1) * u * std::fabs(e))) bad = i;
      if (bad_rs == count && !(std::fabs(back(out[i]) - e_rs) <= (n + 1) * u * std::fabs(e_rs))) bad_rs = i;
    }
    INFO(std::string(ddp::dtype_name(ddp::dtype_of_v<T>)), " base ", base, " allreduce element ", bad, " = ",
         bad < count ? back(v[bad]) : 0.0, ", reduce_scatter element ", bad_rs);
    CHECK(bad == count);
    CHECK(bad_rs == count);
    CHECK(same_bits_everywhere(v.data(), v.size() * sizeof(T)));
  };
  check(ddp::half{}, 40000.0, 64.0, 0x1.0p-11);
  check(ddp::half{}, -65504.0, -32.0, 0x1.0p-11);
  check(ddp::bfloat16{}, 3.0e38, 1e37, 0x1.0p-8);
  check(float{}, 3.4e38, 1e36, 0x1.0p-24);
  check(double{}, 1.7e308, 1e306, 0x1.0p-53);
}

TEST_CASE("mpi_reducer: random floats against a double reference") {
  ddp::mpi_reducer red{pg()};
  auto input = [](int r, std::size_t i) {
    std::uint64_t x = (static_cast<std::uint64_t>(r) + 1) * 0x9e3779b97f4a7c15ull ^ (i * 0xbf58476d1ce4e5b9ull);
    x ^= x >> 31;
    return static_cast<float>(static_cast<double>(x % 2000001) / 1000000.0 - 1.0);
  };
  const std::size_t count = 100003;
  std::vector<float> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = input(pg().rank(), i);
  red.allreduce(std::span<float>(v), ddp::op::sum);
  double worst = 0;
  for (std::size_t i = 0; i < count; ++i) {
    double ref = 0;
    for (int r = 0; r < pg().size(); ++r) ref += input(r, i);
    worst = std::max(worst, std::fabs(v[i] - ref));
  }
  CHECK(worst <= 1e-5 * pg().size());
  CHECK(same_bits_everywhere(v.data(), v.size() * sizeof(float)));
}

TEST_CASE("mpi_reducer: NaN propagates through float min and max") {
  ddp::mpi_reducer red{pg()};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (auto o : {ddp::op::min, ddp::op::max}) {
    // The last rank holds the NaN, so an implementation that keeps its left operand would lose it.
    std::vector<float> v{1.0f, static_cast<float>(pg().rank())};
    if (pg().rank() == pg().size() - 1) v[0] = nan;
    red.allreduce(std::span<float>(v), o);
    CHECK(std::isnan(v[0]));
    CHECK(v[1] == (o == ddp::op::min ? 0.0f : static_cast<float>(pg().size() - 1)));
    std::vector<ddp::bfloat16> b{ddp::bfloat16(1.0f)};
    if (pg().rank() == 0) b[0] = ddp::bfloat16(nan);
    red.allreduce(std::span<ddp::bfloat16>(b), o);
    CHECK(std::isnan(static_cast<float>(b[0])));
  }
}

TEST_CASE("mpi_reducer: async requests complete in issue order with correct values") {
  ddp::mpi_reducer red{pg()};
  const int n = pg().size();
  const int r = pg().rank();
  std::vector<std::vector<double>> bufs(6, std::vector<double>(4096));
  std::vector<std::int64_t> ints(33, r + 1);
  std::vector<ddp::request> reqs;
  for (std::size_t k = 0; k < bufs.size(); ++k) {
    for (std::size_t i = 0; i < bufs[k].size(); ++i) bufs[k][i] = static_cast<double>(r * 10 + k) + static_cast<double>(i % 5);
    reqs.push_back(red.allreduce_async(std::span<double>(bufs[k]), k % 2 ? ddp::op::avg : ddp::op::sum));
  }
  reqs.push_back(red.allreduce_async(std::span<std::int64_t>(ints), ddp::op::prod));
  reqs.back().wait_for(std::chrono::seconds(60));
  // The last request finished, so every earlier one has too: requests complete in order.
  for (auto& q : reqs) CHECK(q.test());
  const double rank_sum = n * (n - 1) / 2.0;
  for (std::size_t k = 0; k < bufs.size(); ++k) {
    for (std::size_t i = 0; i < bufs[k].size(); i += 97) {
      const double sum = 10 * rank_sum + n * (static_cast<double>(k) + static_cast<double>(i % 5));
      CHECK(bufs[k][i] == (k % 2 ? sum / n : sum));
    }
  }
  std::int64_t fact = 1;
  for (int q = 1; q <= n; ++q) fact *= q;
  CHECK(ints[0] == fact);
  CHECK(ints[32] == fact);
}

TEST_CASE("mpi_reducer: broadcast, reduce_scatter, allgather, barrier") {
  ddp::mpi_reducer red{pg()};
  const int n = pg().size();
  const int r = pg().rank();
  const int root = n - 1;

  std::vector<ddp::half> h(10, ddp::half(static_cast<float>(r)));
  red.broadcast(std::span<ddp::half>(h), root);
  for (auto x : h) CHECK(static_cast<float>(x) == static_cast<float>(root));

  const std::size_t per = 5;
  std::vector<float> in(per * static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(r + 1) * static_cast<float>(i);
  std::vector<float> out(per);
  red.reduce_scatter(std::span<const float>(in), std::span<float>(out), ddp::op::sum);
  const float ranks = static_cast<float>(n * (n + 1) / 2);
  for (std::size_t i = 0; i < per; ++i)
    CHECK(out[i] == ranks * static_cast<float>(static_cast<std::size_t>(r) * per + i));
  std::vector<std::int32_t> iin(per * static_cast<std::size_t>(n), 2 * (r + 1)), iout(per);
  red.reduce_scatter(std::span<const std::int32_t>(iin), std::span<std::int32_t>(iout), ddp::op::avg);
  for (auto x : iout) CHECK(x == (n * (n + 1)) / n);

  std::vector<std::int64_t> mine{r * 100, r * 100 + 1, r * 100 + 2}, all(3 * static_cast<std::size_t>(n));
  red.allgather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(all));
  for (int q = 0; q < n; ++q)
    for (int j = 0; j < 3; ++j) CHECK(all[static_cast<std::size_t>(q * 3 + j)] == q * 100 + j);

  red.barrier();
  auto b = red.barrier_async();
  b.wait_for(std::chrono::seconds(60));
  CHECK(b.test());
}

TEST_CASE("auto_reducer: the mpi backend by name, when built with DDP_WITH_MPI") {
  // Meson's ddp_mpi_dep defines DDP_WITH_MPI: ddp::auto_reducer then offers "mpi".
  ddp::auto_reducer red{pg(), ddp::backend::mpi};
  CHECK(red.chosen() == ddp::backend::mpi);
  CHECK(red.describe().rfind("mpi: ", 0) == 0);
  std::vector<double> v(1000, static_cast<double>(pg().rank() + 1));
  red.allreduce(std::span<double>(v), ddp::op::sum);
  const double n = pg().size();
  for (double x : v) CHECK(x == n * (n + 1) / 2);
  // The default wrapper on it: a step averages.
  std::vector<float> w(10, 0.0f), g(10, static_cast<float>(pg().rank()));
  ddp::basic_data_parallel<ddp::size_planner, ddp::auto_reducer> dp{
      pg(), std::vector<ddp::tensor_view>{ddp::make_tensor_view(std::span{w}, std::span{g}, "w")}, {}, {},
      ddp::backend::mpi};
  CHECK(dp.get_allocator().location() == ddp::memory_kind::host);
  dp.grad_ready(0);
  dp.finish();
  for (float x : g) CHECK(x == static_cast<float>(n - 1) / 2.0f);
}

TEST_CASE("hierarchical: MPI between the hosts' leaders, when built with DDP_WITH_MPI") {
  // Hosts by rank parity (DDP_HOST_ID): {0, 2} and {1, 3} on 4 ranks, leaders 0 and 1.
  ::setenv("DDP_HOST_ID", (pg().rank() % 2) == 0 ? "even" : "odd", 1);
  {
    ddp::auto_reducer red{pg()};
    const int n = pg().size();
    if (n > 1) {
      CHECK(red.chosen() == (n == 2 ? ddp::backend::tcp : ddp::backend::hierarchical));
      if (n > 2) CHECK(red.describe().find("MPI between the leaders, ranks 0, 1") != std::string::npos);
    }
    std::vector<float> v(100000, static_cast<float>(pg().rank() + 1));
    red.allreduce(std::span<float>(v), ddp::op::avg);
    const float want = static_cast<float>(n + 1) / 2.0f;
    CHECK(std::all_of(v.begin(), v.end(), [&](float x) { return x == want; }));
    std::vector<std::int64_t> b(33, pg().rank() == n - 1 ? 77 : -1);
    red.broadcast(std::span<std::int64_t>(b), n - 1);
    CHECK(std::all_of(b.begin(), b.end(), [](std::int64_t x) { return x == 77; }));
    red.barrier();
    CHECK(same_bits_everywhere(v.data(), v.size() * sizeof(float)));
  }
  {
    // Asked for by name on the hierarchical reducer itself.
    ddp::hierarchical h{pg(), ddp::hierarchical_options{.between = ddp::backend::mpi}};
    CHECK((pg().size() < 3 || h.between() == ddp::backend::mpi));
    std::vector<std::int32_t> iv(5, pg().rank());
    h.allreduce(std::span<std::int32_t>(iv), ddp::op::sum);
    CHECK(iv[0] == pg().size() * (pg().size() - 1) / 2);
  }
  ::unsetenv("DDP_HOST_ID");
}

TEST_CASE("mpi_reducer: built from a sub-communicator") {
  // Even and odd ranks form two groups; each reduces over its own members only.
  MPI_Comm sub = MPI_COMM_NULL;
  const int r = pg().rank();
  MPI_Comm_split(MPI_COMM_WORLD, r % 2, r, &sub);
  {
    ddp::mpi_reducer red{sub, std::chrono::seconds(30)};
    int members = 0;
    int expected = 0;
    for (int q = r % 2; q < pg().size(); q += 2) {
      ++members;
      expected += q;
    }
    CHECK(red.size() == members);
    CHECK(red.rank() == r / 2);
    std::vector<std::int32_t> v{r};
    red.allreduce(std::span<std::int32_t>(v), ddp::op::sum);
    CHECK(v[0] == expected);
  }
  MPI_Comm_free(&sub);
}

TEST_CASE("mpi_reducer: errors become ddp::error with the MPI condition") {
  ddp::mpi_reducer red{pg()};
  std::vector<float> v(4, 1.0f);
  CHECK(raises([&] { (void)red.broadcast_async(v.data(), v.size(), ddp::dtype::f32, pg().size()); }, ddp::errc::invalid_argument) == "");
  CHECK(raises([&] { red.allreduce(v.data(), v.size(), ddp::dtype::f32, static_cast<ddp::op>(42)); }, ddp::errc::invalid_argument) == "");
  std::vector<float> three(3);  // 4 inputs are never size() * 3
  CHECK(raises([&] { red.reduce_scatter(std::span<const float>(v), std::span<float>(three), ddp::op::sum); }, ddp::errc::invalid_argument) == "");
  // The reducer's communicator returns errors instead of aborting the job; DDP_MPI_CHECK turns
  // them into ddp::error. Argument checks fail locally, on every rank alike.
  CHECK(raises([&] { DDP_MPI_CHECK(MPI_Bcast(v.data(), 1, MPI_FLOAT, pg().size() + 3, red.comm())); }, ddp::errc::invalid_argument) == "");
  std::string what;
  try {
    DDP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, v.data(), -1, MPI_FLOAT, MPI_SUM, red.comm()));
  } catch (const ddp::error& e) {
    what = e.what();
  }
  CHECK(what.find("[ddp.invalid_argument] rank " + std::to_string(pg().rank())) == 0);
  CHECK(what.find("MPI_Allreduce") != std::string::npos);
  // Still usable afterwards.
  red.allreduce(std::span<float>(v), ddp::op::sum);
  CHECK(v[0] == static_cast<float>(pg().size()));
}

TEST_CASE("mpi_reducer: unknown dtype or op and overlapping buffers are invalid_argument at the call; in place works") {
  ddp::mpi_reducer red{pg()};
  const int n = pg().size();
  const std::size_t me = static_cast<std::size_t>(pg().rank()), per = 1000, nn = static_cast<std::size_t>(n);
  auto raised = [](auto&& f, const char* text) {
    try {
      f();
    } catch (const ddp::error& e) {
      CHECK_MESSAGE(std::string(e.what()).find(text) != std::string::npos, e.what());
      return e.condition();
    }
    return ddp::errc{};
  };
  const auto bad_t = static_cast<ddp::dtype>(99);
  std::vector<float> v(per, 1.0f), buf(per * (nn + 1), 1.0f);
  const auto inv = ddp::errc::invalid_argument;
  // Used to be queued and fail later on the progress thread (allreduce), or do nothing (broadcast).
  CHECK(raised([&] { (void)red.allreduce_async(v.data(), per, bad_t, ddp::op::sum); }, "unknown dtype 99") == inv);
  CHECK(raised([&] { (void)red.broadcast_async(v.data(), per, bad_t, 0); }, "unknown dtype 99") == inv);
  CHECK(raised([&] { (void)red.allgather_async(v.data(), buf.data(), per, bad_t); }, "unknown dtype 99") == inv);
  CHECK(raised([&] { (void)red.reduce_scatter_async(buf.data(), v.data(), per, ddp::dtype::f32, static_cast<ddp::op>(42)); },
               "unknown reduction op 42") == inv);
  CHECK(raised([&] { (void)red.reduce_scatter_async(buf.data(), buf.data() + me * per + 1, per, ddp::dtype::f32, ddp::op::sum); },
               "overlap") == inv);
  CHECK(raised([&] { (void)red.allgather_async(buf.data() + me * per + 1, buf.data(), per, ddp::dtype::f32); }, "overlap") ==
        inv);
  // In place: the output is this rank's slice of the input, and the other way round.
  for (std::size_t i = 0; i < per * nn; ++i) buf[i] = static_cast<float>(i % 97);
  float* slice = buf.data() + me * per;
  red.reduce_scatter(std::span<const float>(buf.data(), per * nn), std::span<float>(slice, per), ddp::op::sum);
  for (std::size_t i = 0; i < per; ++i) CHECK(slice[i] == static_cast<float>(n) * static_cast<float>((me * per + i) % 97));
  for (std::size_t i = 0; i < per; ++i) slice[i] = static_cast<float>(me * 10000 + i);
  red.allgather(std::span<const float>(slice, per), std::span<float>(buf.data(), per * nn));
  for (std::size_t q = 0; q < nn; ++q) CHECK(buf[q * per + 7] == static_cast<float>(q * 10000 + 7));
  // Nothing was queued by the refused calls: the reducer is in step with its peers.
  red.allreduce(std::span<float>(v), ddp::op::sum);
  CHECK(v[0] == static_cast<float>(n));
}

TEST_CASE("mpi_reducer: drives basic_data_parallel, gradients averaged") {
  using dp_t = ddp::basic_data_parallel<ddp::size_planner, ddp::mpi_reducer, ddp::host_allocator>;
  const int n = pg().size();
  const int r = pg().rank();
  // Three parameters of two dtypes; small caps give several buckets, so several collectives
  // are in flight while later gradients are still being "computed".
  std::vector<float> w0(1000), g0(1000), w2(5), g2(5);
  std::vector<double> w1(300), g1(300);
  auto value = [](int rank, std::size_t p, std::size_t j, int step) {
    return static_cast<double>(static_cast<long>(((static_cast<std::size_t>(rank) + 1) * 31 + p * 17 + j * 7 +
                                                  static_cast<std::size_t>(step) * 13) % 97) - 48) / 8.0;
  };
  for (std::size_t j = 0; j < w0.size(); ++j) w0[j] = static_cast<float>(r * 1000 + static_cast<int>(j));
  for (std::size_t j = 0; j < w1.size(); ++j) w1[j] = r * 1000.0 + static_cast<double>(j);
  std::vector<ddp::tensor_view> views{ddp::make_tensor_view(std::span<float>(w0), std::span<float>(g0), "w0"),
                                      ddp::make_tensor_view(std::span<double>(w1), std::span<double>(g1), "w1"),
                                      ddp::make_tensor_view(std::span<float>(w2), std::span<float>(g2), "w2")};
  dp_t dp{pg(), views, ddp::bucket_policy{.cap_bytes = 1024, .first_cap_bytes = 256}};
  // Rank 0's parameters were broadcast through the MPI reducer.
  CHECK(w0[999] == 999.0f);
  CHECK(w1[7] == 7.0);
  for (int step = 0; step < 3; ++step) {
    for (std::size_t j = 0; j < g0.size(); ++j) g0[j] = static_cast<float>(value(r, 0, j, step));
    for (std::size_t j = 0; j < g1.size(); ++j) g1[j] = value(r, 1, j, step);
    for (std::size_t j = 0; j < g2.size(); ++j) g2[j] = static_cast<float>(value(r, 2, j, step));
    for (std::size_t i = 3; i-- > 0;) dp.grad_ready(i);
    dp.finish();
    auto avg = [&](std::size_t p, std::size_t j) {
      double s = 0;
      for (int q = 0; q < n; ++q) s += value(q, p, j, step);
      return s;
    };
    bool ok = true;
    for (std::size_t j = 0; j < g0.size(); ++j) ok = ok && g0[j] == static_cast<float>(avg(0, j)) / static_cast<float>(n);
    for (std::size_t j = 0; j < g1.size(); ++j) ok = ok && g1[j] == avg(1, j) / n;
    for (std::size_t j = 0; j < g2.size(); ++j) ok = ok && g2[j] == static_cast<float>(avg(2, j)) / static_cast<float>(n);
    CHECK_MESSAGE(ok, "step " << step << ": a gradient differs from the average");
    CHECK(dp.last_step_stats().buckets.size() >= 3);
  }
}

TEST_CASE("mpi_reducer: the sharded mode (MPI_Reduce_scatter_block, MPI_Allgather) steps the unsharded wrapper's weights") {
  // Values that are small multiples of 1/8: every sum and average is exact in float, so the
  // sharded run and the unsharded one agree bit for bit whatever order MPI adds in.
  const int r = pg().rank();
  const std::vector<std::size_t> sizes{1001, 7, 333};
  struct run {
    std::vector<std::vector<float>> w, g;
    std::vector<ddp::tensor_view> views;
  };
  const auto make = [&](run& m) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      m.w.emplace_back(sizes[i], 0.5f);
      m.g.emplace_back(sizes[i], 0.0f);
    }
    for (std::size_t i = 0; i < sizes.size(); ++i) m.views.push_back(ddp::make_tensor_view(m.w[i], m.g[i], "p"));
  };
  const auto grads = [&](run& m, int step) {
    for (std::size_t i = 0; i < sizes.size(); ++i)
      for (std::size_t j = 0; j < sizes[i]; ++j)
        m.g[i][j] = static_cast<float>(static_cast<int>((j * 7 + i * 3 + static_cast<std::size_t>(r + step)) % 17) - 8) / 8.0f;
  };
  using dp_t = ddp::basic_data_parallel<ddp::size_planner, ddp::mpi_reducer, ddp::host_allocator>;
  const ddp::bucket_policy small{.cap_bytes = 1024, .first_cap_bytes = 256};
  run a, b;
  make(a);
  make(b);
  ddp::adamw opt{{.lr = 0.01}};
  {
    dp_t dp{pg(), a.views, small, {.shard = true}};
    for (int step = 0; step < 3; ++step) {
      grads(a, step);
      for (std::size_t i = sizes.size(); i-- > 0;) dp.grad_ready(i);
      dp.finish();
      dp.step(opt);
    }
  }
  {
    dp_t dp{pg(), b.views, small};
    std::vector<std::vector<float>> state;
    for (auto n : sizes) state.emplace_back(2 * n, 0.0f);
    for (int step = 0; step < 3; ++step) {
      grads(b, step);
      for (std::size_t i = sizes.size(); i-- > 0;) dp.grad_ready(i);
      dp.finish();
      for (std::size_t i = 0; i < sizes.size(); ++i)
        opt.step(ddp::shard_step{i, static_cast<std::uint64_t>(step + 1), std::span<float>(b.w[i]),
                                 std::span<const float>(b.g[i]), std::span<float>(state[i]), {}});
    }
  }
  CHECK(a.w == b.w);
  CHECK(a.w[0][0] != 0.5f);  // the weights moved
}

TEST_CASE("mpi_reducer: the fully sharded mode (units gathered and released) steps the unsharded wrapper's weights") {
  // As above: sums exact in float, so the runs agree bit for bit whatever order MPI adds in.
  const int r = pg().rank();
  const std::vector<std::size_t> sizes{1001, 7, 3333, 2000};
  std::vector<std::vector<float>> wa, ga, wb, gb;
  std::vector<ddp::tensor_view> va, vb;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    wa.emplace_back(sizes[i], 0.5f), ga.emplace_back(sizes[i], 0.0f);
    wb.emplace_back(sizes[i], 0.5f), gb.emplace_back(sizes[i], 0.0f);
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    va.push_back(ddp::make_tensor_view(wa[i], ga[i], "p"));
    vb.push_back(ddp::make_tensor_view(wb[i], gb[i], "p"));
  }
  const auto grads = [&](std::vector<std::vector<float>>& g, std::size_t i, int step) {
    for (std::size_t j = 0; j < sizes[i]; ++j)
      g[i][j] += static_cast<float>(static_cast<int>((j * 7 + i * 3 + static_cast<std::size_t>(r + step)) % 17) - 8) / 8.0f;
  };
  ddp::adamw opt{{.lr = 0.01}};
  {
    ddp::basic_fully_sharded<ddp::mpi_reducer> fs{pg(), va, {2, 1, 1}, {.whole_below = 0}};
    for (int step = 0; step < 3; ++step) {
      for (std::size_t u = 0; u < 3; ++u) fs.gather(u), fs.release(u);
      for (std::size_t u = 3; u-- > 0;) {
        fs.begin_backward(u);
        const auto [first, count] = fs.unit_parameters(u);
        for (std::size_t i = first; i < first + count; ++i) grads(ga, i, step);
        fs.end_backward(u);
      }
      fs.finish();
      fs.step(opt);
    }
    fs.gather_all();
  }
  {
    ddp::basic_data_parallel<ddp::size_planner, ddp::mpi_reducer, ddp::host_allocator> dp{pg(), vb};
    std::vector<std::vector<float>> state;
    for (auto n : sizes) state.emplace_back(2 * n, 0.0f);
    for (int step = 0; step < 3; ++step) {
      for (std::size_t i = sizes.size(); i-- > 0;) {
        std::fill(gb[i].begin(), gb[i].end(), 0.0f);
        grads(gb, i, step);
        dp.grad_ready(i);
      }
      dp.finish();
      for (std::size_t i = 0; i < sizes.size(); ++i)
        opt.step(ddp::shard_step{i, static_cast<std::uint64_t>(step + 1), std::span<float>(wb[i]),
                                 std::span<const float>(gb[i]), std::span<float>(state[i]), {}});
    }
  }
  CHECK(wa == wb);
  CHECK(wa[0][0] != 0.5f);  // the weights moved
}

int main(int argc, char** argv) {
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) return 1;
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  int failed = 0;
  if (provided < MPI_THREAD_SERIALIZED) {
    // The reducer refuses such a library; say so instead of failing every case.
    if (rank == 0)
      std::fprintf(stderr, "MPI provides %s only; skipping\n", ddp::detail::mpi_thread_level_name(provided).c_str());
    MPI_Finalize();
    return 77;
  }
  {
    // mpirun sets the ranks (OMPI_COMM_WORLD_RANK/SIZE) but no rendezvous address: rank 0 picks
    // a free port and tells the others.
    auto opts = ddp::init_options::from_env();
    int port = rank == 0 ? pick_port() : 0;
    MPI_Bcast(&port, 1, MPI_INT, 0, MPI_COMM_WORLD);
    opts.master_addr = "127.0.0.1";
    opts.master_port = port;
    opts.rank = rank;
    opts.world_size = size;
    // A failure that leaves ranks waiting ends within this bound instead of hanging the suite.
    opts.timeout = std::chrono::seconds(20);
    auto group = ddp::init_process_group(opts);
    g_pg = &group;

    doctest::Context ctx(argc, argv);
    if (rank != 0) ctx.setOption("no-version", true);
    const int rc = ctx.run();
    failed = (rc != 0 || ctx.shouldExit()) ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    group.barrier();
    g_pg = nullptr;
  }
  MPI_Finalize();
  if (failed && rank == 0) std::fprintf(stderr, "mpi_reducer: a check failed on at least one rank\n");
  return failed;
}
