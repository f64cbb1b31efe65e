#include <ddp/reducer/hooked.hpp>

#include <ddp/concepts.hpp>
#include <ddp/data_parallel.hpp>
#include <ddp/memory/auto_allocator.hpp>
#include <ddp/memory/host_allocator.hpp>
#include <ddp/memory/shm_allocator.hpp>
#include <ddp/reducer/auto.hpp>
#include <ddp/reducer/compress.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/reducer/tree.hpp>
#include <ddp/transport/tcp.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include "harness.hpp"

using namespace std::chrono_literals;
using namespace ddp_test;

namespace {

// Records every bucket it sees and runs the inner allreduce unchanged.
struct recording_hook {
  std::vector<ddp::comm_bucket> seen;
  template <class R>
  void operator()(const ddp::comm_bucket& b, R& inner) {
    seen.push_back(b);
    inner.allreduce(b.data, b.count, b.type, b.oper);
  }
};

// Throws on allreduce `seq` on rank `rank` (every rank when rank < 0), before any collective.
struct throwing_hook {
  int rank = -1;
  std::uint64_t seq = 1;
  template <class R>
  void operator()(const ddp::comm_bucket& b, R& inner) {
    if (b.seq == seq && (rank < 0 || b.rank == rank)) throw std::runtime_error("hook refuses this bucket");
    inner.allreduce(b.data, b.count, b.type, b.oper);
  }
};

using ring_tcp = ddp::ring<ddp::tcp>;
using ring_shm = ddp::ring<ddp::shm>;

// Runs its inner collectives async and waits for them: on the inner reducer's progress thread,
// where the hook runs, they must run at once rather than queue behind the hook.
struct async_hook {
  int calls = 0;
  template <class R>
  void operator()(const ddp::comm_bucket& b, R& inner) {
    ++calls;
    float one = 1.0f;
    auto q1 = inner.allreduce_async(&one, 1, ddp::dtype::f32, ddp::op::sum);  // the group's size
    auto q2 = inner.allreduce_async(b.data, b.count, b.type, b.oper);
    q1.wait(b.deadline);
    q2.wait(b.deadline);
    if (one != static_cast<float>(b.size)) throw std::runtime_error("the size allreduce gave " + std::to_string(one));
    inner.barrier();
  }
};

// A reducer that lends no progress thread (no run_in_order): hooked keeps one of its own.
class no_lend {
 public:
  explicit no_lend(ddp::process_group& pg) : r_(pg) {}
  int rank() const noexcept { return r_.rank(); }
  int size() const noexcept { return r_.size(); }
  ddp::request allreduce_async(void* d, std::size_t n, ddp::dtype t, ddp::op o) { return r_.allreduce_async(d, n, t, o); }
  void allreduce(void* d, std::size_t n, ddp::dtype t, ddp::op o) { r_.allreduce(d, n, t, o); }
  ddp::request broadcast_async(void* d, std::size_t n, ddp::dtype t, int root) { return r_.broadcast_async(d, n, t, root); }
  ddp::request barrier_async() { return r_.barrier_async(); }
  void barrier() { r_.barrier(); }

 private:
  ddp::ring<ddp::tcp> r_;
};

static_assert(ddp::detail::lends_progress_thread<ddp::ring<ddp::tcp>>);
static_assert(ddp::detail::lends_progress_thread<ddp::auto_reducer>);
static_assert(ddp::detail::lends_progress_thread<ddp::hooked<ddp::ring<ddp::shm>>>);
static_assert(!ddp::detail::lends_progress_thread<no_lend>);
static_assert(ddp::detail::lends_progress_thread<ddp::hooked<no_lend>>);  // its own worker's

// Threads of this process now.
long thread_count() {
  long n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

static_assert(ddp::reducer<ddp::hooked<ring_tcp, recording_hook>>);
static_assert(ddp::reducer<ddp::hooked<ddp::auto_reducer, ddp::fp16_compress>>);
static_assert(ddp::reducer<ddp::hooked<ring_shm, ddp::bf16_compress>>);
static_assert(ddp::reducer_with_abort<ddp::hooked<ring_tcp, ddp::fp16_compress>>);
static_assert(ddp::reducer_with_abort<ddp::hooked<ddp::auto_reducer, ddp::fp16_compress>>);
static_assert(ddp::reducer_with_failable_transport<ddp::hooked<ring_tcp, ddp::fp16_compress>>);
static_assert(!ddp::reducer_with_failable_transport<ddp::hooked<ddp::auto_reducer, ddp::fp16_compress>>);
static_assert(ddp::allocator_bound_to<ddp::shm_allocator, ddp::hooked<ring_shm, ddp::fp16_compress>>);
static_assert(ddp::allocator_bound_to<ddp::auto_allocator, ddp::hooked<ddp::auto_reducer, ddp::fp16_compress>>);
static_assert(!ddp::allocator_bound_to<ddp::shm_allocator, ddp::hooked<ring_tcp, ddp::fp16_compress>>);
static_assert(ddp::comm_hook<ddp::fp16_compress, ring_tcp>);
static_assert(!ddp::comm_hook<int, ring_tcp>);

constexpr ddp_test::local_group opts{20s};

// Builds the decorator over the reducer named `kind` and runs `body(red, pg)`.
template <class Hook, class Body>
void with_reducer(const std::string& kind, ddp::process_group& pg, Body&& body) {
  if (kind == "ring_tcp") {
    ddp::hooked<ring_tcp, Hook> red{pg};
    body(red);
  } else if (kind == "ring_shm") {
    ddp::hooked<ring_shm, Hook> red{pg, ddp::shm_options{.segment_bytes = 32 << 20}, ddp::reducer_options{}};
    body(red);
  } else {
    ddp::hooked<ddp::auto_reducer, Hook> red{pg};
    body(red);
  }
}

const char* kinds[] = {"ring_tcp", "ring_shm", "auto"};

// Same bits on every rank: each rank's buffer, gathered through the group.
void require_same_bits(ddp::process_group& pg, const void* p, std::size_t bytes, const std::string& what) {
  const auto all = pg.all_gather(std::string(static_cast<const char*>(p), bytes));
  for (std::size_t r = 1; r < all.size(); ++r) require(all[r] == all[0], what + ": rank " + std::to_string(r) + " differs from rank 0");
}

// Rank r's value of element j: mixed signs and magnitudes (10^-6 .. 10^2), some exact zeros.
float value(int r, std::size_t j, unsigned salt) {
  std::mt19937 g(static_cast<unsigned>(j * 7919u + static_cast<unsigned>(r) * 104729u + salt));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-6, 2);
  if (j % 97 == 5) return 0.0f;
  return u(g) * std::pow(10.0f, static_cast<float>(ex(g)));
}

// The bound of reducer/compress.hpp, checked element by element against the exact average.
void check_bound(const std::vector<float>& got, const std::vector<std::vector<float>>& inputs, ddp::op o, int n,
                 double u, bool fp16, const std::string& what) {
  double m = 0;
  for (auto& in : inputs)
    for (float v : in)
      if (std::isfinite(v)) m = std::max(m, std::fabs(static_cast<double>(v)));
  const double f = o == ddp::op::sum ? n : 1;
  const double t = fp16 ? std::ldexp(1.0, -38) * f * m : std::ldexp(1.0, -133);
  for (std::size_t j = 0; j < got.size(); ++j) {
    double exact = 0, mag = 0;
    for (auto& in : inputs) exact += in[j], mag += std::fabs(static_cast<double>(in[j]));
    if (o == ddp::op::avg) exact /= n, mag /= n;
    const double bound = (n + 2) * u * mag + (4 * n + 1) * t;
    const double err = std::fabs(static_cast<double>(got[j]) - exact);
    if (!(err <= bound))
      throw std::runtime_error(what + ": element " + std::to_string(j) + " is " + std::to_string(got[j]) + ", exact " +
                               std::to_string(exact) + ", error " + std::to_string(err) + " > bound " + std::to_string(bound));
  }
}

}  // namespace

TEST_CASE("a custom hook sees every allreduce once, in issue order, and its results are exact") {
  for (const char* kind : kinds)
    for (int n : {2, 3}) {
      CAPTURE(kind);
      CAPTURE(n);
      expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
        with_reducer<recording_hook>(kind, pg, [&](auto& red) {
          // Integer-valued floats: sums and averages over 2 and 3 ranks of these are exact... in
          // f32 and f64 (averages: multiples of 1/2 and 1/3 are compared with the same division).
          std::vector<float> a(1000);
          std::vector<double> d(17);
          std::vector<std::int32_t> k(5);
          for (std::size_t j = 0; j < a.size(); ++j) a[j] = static_cast<float>((r + 1) * static_cast<int>(j % 50));
          for (std::size_t j = 0; j < d.size(); ++j) d[j] = (r + 1) * 1.5 * static_cast<double>(j);
          for (std::size_t j = 0; j < k.size(); ++j) k[j] = (r + 1) * static_cast<std::int32_t>(j) - 3;
          std::vector<std::int64_t> root(3, r == 0 ? 42 : -1);
          auto q1 = red.allreduce_async(a.data(), a.size(), ddp::dtype::f32, ddp::op::sum);
          auto qb = red.broadcast_async(root.data(), root.size(), ddp::dtype::i64, 0);
          auto q2 = red.allreduce_async(d.data(), d.size(), ddp::dtype::f64, ddp::op::avg);
          auto q3 = red.allreduce_async(k.data(), k.size(), ddp::dtype::i32, ddp::op::max);
          // Blocking calls while the async ones may still be queued: they wait their turn.
          red.barrier();
          float one = static_cast<float>(r);
          red.allreduce(std::span<float>(&one, 1), ddp::op::min);  // blocking, typed
          const auto until = std::chrono::steady_clock::now() + 20s;
          q1.wait(until), qb.wait(until), q2.wait(until), q3.wait(until);
          require_raises([&] { red.allreduce_async(a.data(), 1, static_cast<ddp::dtype>(99), ddp::op::sum); },
                         ddp::errc::invalid_argument, {}, "an unknown dtype is errc::invalid_argument at the call");
          const int tri = n * (n + 1) / 2;
          for (std::size_t j = 0; j < a.size(); ++j)
            require(a[j] == static_cast<float>(tri * static_cast<int>(j % 50)), "f32 sum at " + std::to_string(j));
          for (std::size_t j = 0; j < d.size(); ++j)
            require(d[j] == tri * 1.5 * static_cast<double>(j) / n, "f64 avg at " + std::to_string(j));
          for (std::size_t j = 0; j < k.size(); ++j) require(k[j] == n * static_cast<std::int32_t>(j) - 3, "i32 max");
          require(root == std::vector<std::int64_t>(3, 42), "broadcast");
          require(one == 0.0f, "blocking min");
          const auto& seen = red.hook().seen;
          require(seen.size() == 4, "the hook ran " + std::to_string(seen.size()) + " times, not 4 (broadcast and barrier are not hooked)");
          const ddp::dtype types[] = {ddp::dtype::f32, ddp::dtype::f64, ddp::dtype::i32, ddp::dtype::f32};
          const ddp::op ops[] = {ddp::op::sum, ddp::op::avg, ddp::op::max, ddp::op::min};
          const std::size_t counts[] = {1000, 17, 5, 1};
          for (std::size_t i = 0; i < 4; ++i) {
            require(seen[i].seq == i, "seq of call " + std::to_string(i));
            require(seen[i].type == types[i] && seen[i].oper == ops[i] && seen[i].count == counts[i],
                    "descriptor of call " + std::to_string(i));
            require(seen[i].rank == r && seen[i].size == n, "rank and size in the descriptor");
            require(seen[i].deadline > std::chrono::steady_clock::now() - 60s, "deadline");
          }
          require(seen[0].data == a.data() && seen[1].data == d.data(), "the hook gets the caller's buffer");
          require(seen[0].bytes() == 4000, "bytes()");
        });
      }));
    }
}

template <class Hook>
void compressed_values(const char* kind, int n, ddp::op o, double u, bool fp16) {
  expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
    with_reducer<Hook>(kind, pg, [&](auto& red) {
      // Sizes: one element, a vector tail, several vectors.
      for (std::size_t count : {std::size_t{1}, std::size_t{13}, std::size_t{4099}}) {
        std::vector<std::vector<float>> inputs(static_cast<std::size_t>(n), std::vector<float>(count));
        for (int q = 0; q < n; ++q)
          for (std::size_t j = 0; j < count; ++j) inputs[static_cast<std::size_t>(q)][j] = value(q, j, static_cast<unsigned>(count));
        if (count > 100) {
          inputs[0][7] = 1.0e6f;  // beyond f16's range (65504): scaled, not inf
          inputs[static_cast<std::size_t>(n - 1)][8] = 60000.0f;
          inputs[0][8] = 60000.0f;  // a sum past 65504
          inputs[0][9] = 1.0e-40f;  // f32 subnormal
        }
        std::vector<float> buf = inputs[static_cast<std::size_t>(r)];
        red.allreduce(buf.data(), buf.size(), ddp::dtype::f32, o);
        for (float v : buf) require(std::isfinite(v), "a finite input gave a non-finite result");
        check_bound(buf, inputs, o, n, u, fp16, std::string(kind) + " count " + std::to_string(count));
        require_same_bits(pg, buf.data(), buf.size() * 4, "compressed result");
      }
    });
  }));
}

TEST_CASE("fp16 and bf16 compression: within the stated bound, finite beyond f16's range, same bits on every rank") {
  for (const char* kind : kinds)
    for (int n : {2, 3})
      for (ddp::op o : {ddp::op::avg, ddp::op::sum}) {
        CAPTURE(kind);
        CAPTURE(n);
        CAPTURE(ddp::op_name(o));
        compressed_values<ddp::fp16_compress>(kind, n, o, std::ldexp(1.0, -11), true);
        compressed_values<ddp::bf16_compress>(kind, n, o, std::ldexp(1.0, -8), false);
      }
}

TEST_CASE("compression: NaN and inf propagate, bf16 saturates instead of overflowing, other buckets exact") {
  const int n = 3;
  expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
    ddp::hooked<ring_tcp, ddp::fp16_compress> h16{pg};
    ddp::hooked<ring_tcp, ddp::bf16_compress> b16{pg};
    for (int which = 0; which < 2; ++which) {
      std::vector<float> v(40, 1.0f);
      if (r == 1) v[3] = std::numeric_limits<float>::quiet_NaN();
      if (r == 2) v[4] = std::numeric_limits<float>::infinity();
      v[5] = r == 0 ? std::numeric_limits<float>::infinity() : (r == 1 ? -std::numeric_limits<float>::infinity() : 1.0f);
      if (which == 0)
        h16.allreduce(v.data(), v.size(), ddp::dtype::f32, ddp::op::avg);
      else
        b16.allreduce(v.data(), v.size(), ddp::dtype::f32, ddp::op::avg);
      require(std::isnan(v[3]), "NaN on one rank is NaN everywhere");
      require(std::isinf(v[4]) && v[4] > 0, "+inf on one rank is +inf");
      require(std::isnan(v[5]), "+inf and -inf give NaN");
      for (std::size_t j = 6; j < v.size(); ++j) require(v[j] == 1.0f, "finite neighbours of NaN stay exact");
      std::uint32_t bits;
      std::memcpy(&bits, &v[3], 4);
      require(bits == 0x7fc00000u, "the canonical NaN");
      require_same_bits(pg, v.data(), v.size() * 4, "NaN/inf bucket");
    }
    // bf16: 3.4e38 rounds past bf16's largest value; compressed, it saturates (avg stays finite).
    std::vector<float> big(8, 3.4e38f);
    b16.allreduce(big.data(), big.size(), ddp::dtype::f32, ddp::op::avg);
    for (float x : big) require(std::isfinite(x) && x > 3.3e38f, "bf16 saturation: " + std::to_string(x));
    // Other dtypes and ops pass through exactly.
    std::vector<double> d(33);
    std::vector<std::int64_t> k(33);
    std::vector<ddp::half> hv(33);
    std::vector<float> mx(33);
    for (std::size_t j = 0; j < 33; ++j) {
      d[j] = (r + 1) * 0.1 * static_cast<double>(j);
      k[j] = (r + 1) * static_cast<std::int64_t>(j) * 1000000007LL;
      hv[j] = ddp::half(static_cast<float>(r + static_cast<int>(j)));
      mx[j] = static_cast<float>(r) + 0.1234567f * static_cast<float>(j);
    }
    std::vector<double> d_ref = d;
    ring_tcp plain{pg};
    plain.allreduce(std::span<double>(d_ref), ddp::op::sum);
    h16.allreduce(std::span<double>(d), ddp::op::sum);
    require(std::memcmp(d.data(), d_ref.data(), d.size() * 8) == 0, "f64 through fp16_compress: bit for bit");
    h16.allreduce(std::span<std::int64_t>(k), ddp::op::sum);
    for (std::size_t j = 0; j < 33; ++j) require(k[j] == 6 * static_cast<std::int64_t>(j) * 1000000007LL, "i64 exact");
    h16.allreduce(std::span<ddp::half>(hv), ddp::op::sum);
    for (std::size_t j = 0; j < 33; ++j)
      require(static_cast<float>(hv[j]) == static_cast<float>(3 + 3 * static_cast<int>(j)), "f16 bucket unchanged");
    b16.allreduce(std::span<float>(mx), ddp::op::max);
    for (std::size_t j = 0; j < 33; ++j) require(mx[j] == 2.0f + 0.1234567f * static_cast<float>(j), "f32 max not compressed");
  }));
}

TEST_CASE("through the data_parallel wrapper: compressed averages within the bound, same bits, the allocator of the inner reducer") {
  for (int n : {2, 3}) {
    CAPTURE(n);
    expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
      const std::vector<std::size_t> sizes{3000, 7, 1500, 64};
      std::vector<std::vector<float>> val(sizes.size()), grad(sizes.size());
      std::vector<ddp::tensor_view> views;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        val[i].assign(sizes[i], 0.0f);
        grad[i].assign(sizes[i], 0.0f);
        views.push_back(ddp::tensor_view{val[i].data(), grad[i].data(), sizes[i], ddp::dtype::f32, -1,
                                         std::string("p").append(std::to_string(i)), {static_cast<std::int64_t>(sizes[i])}});
      }
      auto step = [&](auto& dp, bool fp16) {
        for (int s = 0; s < 3; ++s) {
          std::vector<std::vector<std::vector<float>>> inputs(sizes.size());
          for (std::size_t i = 0; i < sizes.size(); ++i) {
            inputs[i].assign(static_cast<std::size_t>(n), std::vector<float>(sizes[i]));
            for (int q = 0; q < n; ++q)
              for (std::size_t j = 0; j < sizes[i]; ++j)
                inputs[i][static_cast<std::size_t>(q)][j] = value(q, j + 10000 * i, static_cast<unsigned>(s));
            grad[i] = inputs[i][static_cast<std::size_t>(r)];
          }
          for (std::size_t i = sizes.size(); i-- > 0;) dp.grad_ready(i);
          dp.finish();
          for (std::size_t i = 0; i < sizes.size(); ++i) {
            check_bound(grad[i], inputs[i], ddp::op::avg, n, std::ldexp(1.0, fp16 ? -11 : -8), fp16,
                        "parameter " + std::to_string(i) + " step " + std::to_string(s));
            require_same_bits(pg, grad[i].data(), grad[i].size() * 4, "parameter " + std::to_string(i));
          }
        }
      };
      {
        ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ring_tcp, ddp::fp16_compress>, ddp::host_allocator> dp{
            pg, views, ddp::bucket_policy{.cap_bytes = 8192, .first_cap_bytes = 256}};
        require(dp.plan().buckets.size() >= 3, "several buckets");
        step(dp, true);
        require(dp.get_reducer().hook().scratch_bytes() >= 2 * 1500, "scratch kept for the largest bucket");
      }
      {
        // The default engine (shm on one host), and its allocator: buckets in its segment.
        ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ddp::auto_reducer, ddp::bf16_compress>> dp{pg, views};
        require(dp.get_allocator().location() == ddp::memory_kind::shared,
                "auto_allocator bound through the decorator to auto_reducer's segment");
        require(dp.get_allocator().segment() == dp.get_reducer().inner().segment(), "the inner reducer's segment");
        step(dp, false);
      }
      {
        ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ring_shm, ddp::fp16_compress>, ddp::shm_allocator> dp{
            pg, views, ddp::bucket_policy{}, ddp::dp_options{}, ddp::shm_options{.segment_bytes = 32 << 20},
            ddp::reducer_options{}};
        require(dp.get_allocator().location() == ddp::memory_kind::shared, "shm_allocator from the inner transport");
        step(dp, true);
      }
    }));
  }
}

TEST_CASE("a hook that throws on one rank: ddp::error on every rank, promptly, naming the hook") {
  for (const char* kind : {"ring_tcp", "auto"}) {
    for (int thrower : {1, -1}) {
      CAPTURE(kind);
      CAPTURE(thrower);
      const int n = 3;
      auto outs = on_ranks(n, opts, [&](ddp::process_group& pg) {
        std::vector<float> val(600, 0.0f), grad(600, 1.0f);
        std::vector<ddp::tensor_view> views;
        for (int i = 0; i < 3; ++i)
          views.push_back(ddp::tensor_view{val.data() + 200 * i, grad.data() + 200 * i, 200, ddp::dtype::f32, -1,
                                           std::string(1, static_cast<char>('a' + i)), {200}});
        auto run = [&](auto& dp) {
          for (int s = 0; s < 3; ++s) {
            for (std::size_t i = 3; i-- > 0;) dp.grad_ready(i);
            dp.finish();
          }
        };
        // Buckets of one parameter: allreduces 0, 1, 2 in the first step; the hook throws on 1.
        const ddp::bucket_policy one_each{.cap_bytes = 800, .first_cap_bytes = 800};
        if (std::string(kind) == "ring_tcp") {
          ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ring_tcp, throwing_hook>, ddp::host_allocator> dp{
              pg, views, one_each, ddp::dp_options{}, throwing_hook{thrower, 1}};
          run(dp);
        } else {
          ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ddp::auto_reducer, throwing_hook>> dp{
              pg, views, one_each, ddp::dp_options{}, throwing_hook{thrower, 1}};
          run(dp);
        }
      }, 60s);
      for (auto& o : outs) {
        CAPTURE(o.message);
        CHECK(o.exit_code == 1);  // a ddp::error, not another exception, not a hang
        CHECK(o.seconds < 15.0);  // well before the 20 s timeout
        // The thrower's error is its hook's: its earlier buckets had completed when the hook
        // ran. Peers see the abort that follows (when all throw, an abort may reach a rank
        // still finishing bucket 0: then that is its error).
        if (o.rank == thrower) {
          CHECK(o.message.find("communication hook threw on allreduce 1 (200 f32, avg): hook refuses this bucket") !=
                std::string::npos);
        } else if (thrower >= 0) {
          // tcp (the group's record) and shared memory (the segment) carry the cause to the peers.
          CHECK(o.message.find("rank 1 reports: the communication hook threw") != std::string::npos);
        }
      }
    }
  }
}

TEST_CASE("after a hook failed, every later collective of the decorator raises errc::aborted quoting it") {
  const int n = 2;
  expect_ok(on_ranks(n, opts, [&](ddp::process_group& pg) {
    ddp::hooked<ring_tcp, throwing_hook> red{pg, throwing_hook{-1, 0}};
    std::vector<float> v(10, 1.0f);
    std::string first, later;
    try {
      red.allreduce(v.data(), v.size(), ddp::dtype::f32, ddp::op::sum);
    } catch (const ddp::error& e) {
      require(e.condition() == ddp::errc::aborted, "the hook's failure is errc::aborted");
      first = e.what();
    }
    require(first.find("the communication hook threw on allreduce 0 (10 f32, sum): hook refuses this bucket") !=
                std::string::npos, "first: " + first);
    require(red.failed(), "failed()");
    try {
      red.barrier();
    } catch (const ddp::error& e) {
      require(e.condition() == ddp::errc::aborted, "later: errc::aborted");
      later = e.what();
    }
    require(later.find("failed earlier; the first cause: the communication hook threw on allreduce 0") != std::string::npos,
            "later: " + later);
  }));
}

TEST_CASE("a killed peer during compressed steps: ddp::error on every surviving rank, no hang") {
  for (const char* kind : {"ring_tcp", "auto"}) {
    CAPTURE(kind);
    const int n = 3;
    auto outs = on_ranks(n, local_group{10s}, [&](int r, ddp::process_group& pg) {
      std::vector<float> val(5000, 0.0f), grad(5000, 1.0f);
      std::vector<ddp::tensor_view> views{ddp::tensor_view{val.data(), grad.data(), 5000, ddp::dtype::f32, -1, "w", {5000}}};
      auto run = [&](auto& dp) {
        for (int s = 0; s < 5; ++s) {
          if (s == 2 && r == 2) ::_exit(9);  // dies between steps, its peers inside the next one
          dp.grad_ready(0);
          dp.finish();
        }
      };
      if (std::string(kind) == "ring_tcp") {
        ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ring_tcp, ddp::fp16_compress>, ddp::host_allocator> dp{
            pg, views};
        run(dp);
      } else {
        ddp::basic_data_parallel<ddp::size_planner, ddp::hooked<ddp::auto_reducer, ddp::fp16_compress>> dp{pg, views};
        run(dp);
      }
    }, 60s);
    for (auto& o : outs) {
      CAPTURE(o.message);
      if (o.rank == 2) {
        CHECK(o.exit_code == 9);
      } else {
        CHECK(o.exit_code == 1);
        CHECK(!o.timed_out);
        CHECK(o.seconds < 40.0);
      }
    }
  }
}

// Ranks built with different hooks run different sequences of collectives (fp16 agrees on a
// scale first, bf16 does not): that must be an error on every rank, never a silent result.
template <class Hook>
void reduce_with(const std::string& kind, ddp::process_group& pg, std::vector<float>& v) {
  with_reducer<Hook>(kind, pg, [&](auto& red) {
    for (int i = 0; i < 3; ++i) red.allreduce(v.data(), v.size(), ddp::dtype::f32, ddp::op::avg);
  });
}

TEST_CASE("ranks with different hooks: an error on every rank, not wrong numbers") {
  for (const char* kind : kinds) {
    CAPTURE(kind);
    const int n = 2;
    auto outs = on_ranks(n, local_group{3s}, [&](int r, ddp::process_group& pg) {
      std::vector<float> v(1000, static_cast<float>(r + 1));
      if (r == 0)
        reduce_with<ddp::fp16_compress>(kind, pg, v);
      else
        reduce_with<ddp::bf16_compress>(kind, pg, v);
      for (float x : v) require(x == 1.5f, "silently wrong: " + std::to_string(x) + " instead of 1.5");
      throw std::runtime_error("no error, and the average is right");
    }, 60s);
    for (auto& o : outs) {
      CAPTURE(o.rank);
      CAPTURE(o.message);
      CHECK(o.exit_code == 1);  // a ddp::error
      CHECK(o.message.find("collective mismatch") != std::string::npos);
      CHECK(o.seconds < 2.5);  // detected, not the 3 s timeout
    }
  }
}

TEST_CASE("one progress thread per reducer stack: hooked runs on the inner reducer's thread") {
  const int n = 2;
  expect_ok(on_ranks(n, opts, [&](ddp::process_group& pg) {
    std::vector<float> v(100, 1.0f);
    // Each reducer runs a blocking and an async allreduce first, so that whatever a reducer
    // starts on first use (connections) is running when the threads are counted.
    auto exercise = [&](auto& red) {
      red.allreduce(v.data(), v.size(), ddp::dtype::f32, ddp::op::avg);
      red.allreduce_async(v.data(), v.size(), ddp::dtype::f32, ddp::op::avg).wait(std::chrono::steady_clock::now() + 20s);
      require(v[0] == 1.0f, "the average of ones");
    };
    pg.barrier();
    const long base = thread_count();
    ring_tcp plain{pg};
    exercise(plain);
    const long with_plain = thread_count();
    ddp::hooked<ring_tcp, async_hook> hk{pg};
    exercise(hk);
    const long with_hooked = thread_count();
    ddp::hooked<ddp::hooked<ring_tcp, async_hook>, recording_hook> twice{pg};
    exercise(twice);
    const long with_twice = thread_count();
    require(hk.hook().calls == 2 && twice.inner().hook().calls == 2 && twice.hook().seen.size() == 2, "hook calls");
    const long per_ring = with_plain - base;
    require(per_ring >= 1, "ring<tcp> has a progress thread: " + std::to_string(per_ring));
    require(with_hooked - with_plain == per_ring,
            "hooked<ring<tcp>> added " + std::to_string(with_hooked - with_plain) + " threads, ring<tcp> " + std::to_string(per_ring));
    require(with_twice - with_hooked == per_ring, "hooked<hooked<ring<tcp>>> added " +
                                                      std::to_string(with_twice - with_hooked) + " threads, ring<tcp> " +
                                                      std::to_string(per_ring));
    // The fallback: an inner reducer without a thread to lend, and the decorator's own.
    no_lend bare{pg};
    exercise(bare);
    const long with_bare = thread_count();
    ddp::hooked<no_lend, async_hook> own{pg};
    exercise(own);
    require(thread_count() - with_bare == per_ring + 1, "hooked<no_lend> keeps a thread of its own");
    require(own.hook().calls == 2, "fallback hook calls");
  }));
}

TEST_CASE("a hook that waits on async inner collectives, queued behind other work: no deadlock, in order") {
  for (const char* kind : kinds) {
    CAPTURE(kind);
    const int n = 2;
    expect_ok(on_ranks(n, opts, [&](int r, ddp::process_group& pg) {
      with_reducer<async_hook>(kind, pg, [&](auto& red) {
        std::vector<std::vector<float>> bufs(6, std::vector<float>(257));
        std::vector<ddp::request> qs;
        std::int64_t root = r == 0 ? 7 : 0;
        for (std::size_t i = 0; i < bufs.size(); ++i) {
          for (auto& x : bufs[i]) x = static_cast<float>((r + 1) * (i + 1));
          qs.push_back(red.allreduce_async(bufs[i].data(), bufs[i].size(), ddp::dtype::f32, ddp::op::sum));
          if (i == 2) qs.push_back(red.broadcast_async(&root, 1, ddp::dtype::i64, 0));
        }
        red.allreduce(bufs[0].data(), 1, ddp::dtype::f32, ddp::op::max);  // blocking, behind them
        red.barrier();
        for (auto& q : qs) q.wait(std::chrono::steady_clock::now() + 20s);
        const float tri = static_cast<float>(n * (n + 1) / 2);
        for (std::size_t i = 0; i < bufs.size(); ++i)
          for (std::size_t j = i == 0 ? 1 : 0; j < bufs[i].size(); ++j)
            require(bufs[i][j] == tri * static_cast<float>(i + 1), "bucket " + std::to_string(i));
        require(bufs[0][0] == tri, "the blocking max after the sum");
        require(root == 7, "broadcast");
        require(red.hook().calls == 7, "hook calls: " + std::to_string(red.hook().calls));
      });
    }));
  }
}
