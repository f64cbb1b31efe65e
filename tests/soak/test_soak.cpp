// Soak: a long random sequence of collectives across 4 ranks, every result checked bit for bit.
//
// Each collective draws its reducer (ring<tcp>, tree<tcp>, ring<shm>, tree<shm>), kind
// (allreduce, a batch of async allreduces in flight at once, reduce_scatter, allgather,
// broadcast), dtype (f32 f64 f16 bf16 i32 i64), op (sum avg min max prod) and size (0 to 1M
// elements, log-uniform: mostly small, some large) from one seed shared by the ranks, so all
// ranks issue the same sequence. Inputs are small integers (powers of two for prod), so the
// reference each rank computes on its own is exact and the check is memcmp; the hashes of every
// result are also compared across ranks. shm collectives sometimes take buffers from the shared
// arena (the zero-copy path).
//
// DDP_SOAK_COUNT (collectives, default 2000), DDP_SOAK_SEED (default: random, printed),
// DDP_SOAK_RANKS (default 4). scripts/soak.sh runs 10,000.

#include <ddp/memory/shm_allocator.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/tree.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/transport/tcp.hpp>

#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "multiproc/harness.hpp"
#include "multiproc/reducer_checks.hpp"

using namespace std::chrono_literals;
using namespace ddp_test;

namespace {

enum class kind { allreduce, batch, reduce_scatter, allgather, broadcast };
constexpr std::array kind_names = {"allreduce", "async batch", "reduce_scatter", "allgather", "broadcast"};
constexpr std::array reducer_names = {"ring<tcp>", "tree<tcp>", "ring<shm>", "tree<shm>"};
constexpr std::array all_types = {ddp::dtype::f32, ddp::dtype::f64, ddp::dtype::f16,
                                  ddp::dtype::bf16, ddp::dtype::i32, ddp::dtype::i64};
constexpr std::array all_ops = {ddp::op::sum, ddp::op::avg, ddp::op::min, ddp::op::max, ddp::op::prod};

/// The four reducers of one rank, over one process group. Small pipeline units, so that
/// moderate sizes already run many segments, slots and both tree modes.
struct reducers {
  ddp::ring<ddp::tcp> ring_tcp;
  ddp::tree<ddp::tcp> tree_tcp;
  ddp::ring<ddp::shm> ring_shm;
  ddp::tree<ddp::shm> tree_shm;
  explicit reducers(ddp::process_group& pg)
      : ring_tcp(pg, ddp::reducer_options{.segment_bytes = 64 << 10}),
        tree_tcp(pg, ddp::reducer_options{.small_bytes = 16 << 10}),
        ring_shm(pg, ddp::shm_options{.segment_bytes = std::size_t{128} << 20, .slot_bytes = 64 << 10}, ddp::reducer_options{}),
        tree_shm(pg, ddp::shm_options{.segment_bytes = std::size_t{128} << 20, .slot_bytes = 64 << 10}, ddp::reducer_options{}) {}

  template <class F>
  decltype(auto) with(int which, F&& f) {
    switch (which) {
      case 0: return f(ring_tcp);
      case 1: return f(tree_tcp);
      case 2: return f(ring_shm);
      default: return f(tree_shm);
    }
  }
};

/// One collective as drawn from the shared sequence.
struct draw {
  kind k = kind::allreduce;
  int reducer = 0;
  ddp::dtype type = ddp::dtype::f32;
  ddp::op oper = ddp::op::sum;
  std::size_t count = 0;  ///< elements (per rank for reduce_scatter and allgather)
  int root = 0;
  bool zero_copy = false;
  std::size_t salt = 0;   ///< shifts the inputs so that every collective reduces other data
};

std::size_t draw_count(std::mt19937_64& g, std::size_t max) {
  if (g() % 20 == 0) return 0;
  const double u = std::uniform_real_distribution<double>(0.0, std::log2(static_cast<double>(max) + 1))(g);
  return std::min<std::size_t>(max, static_cast<std::size_t>(std::exp2(u)));
}

draw draw_one(std::mt19937_64& g, kind k, std::size_t max_count, int n) {
  draw d;
  d.k = k;
  d.reducer = static_cast<int>(g() % 4);
  d.type = all_types[g() % all_types.size()];
  d.oper = all_ops[g() % all_ops.size()];
  d.count = draw_count(g, max_count);
  d.root = static_cast<int>(g() % static_cast<std::uint64_t>(n));
  d.zero_copy = d.reducer >= 2 && g() % 3 == 0;
  d.salt = static_cast<std::size_t>(g() % 100000);
  return d;
}

template <class T>
struct typed {
  using type = T;
};

template <class F>
decltype(auto) with_type(ddp::dtype t, F&& f) {
  switch (t) {
    case ddp::dtype::f32: return f(typed<float>{});
    case ddp::dtype::f64: return f(typed<double>{});
    case ddp::dtype::f16: return f(typed<ddp::half>{});
    case ddp::dtype::bf16: return f(typed<ddp::bfloat16>{});
    case ddp::dtype::i32: return f(typed<std::int32_t>{});
    default: return f(typed<std::int64_t>{});
  }
}

/// A buffer of T, in the shm arena (zero-copy) or on the heap.
template <class T>
class buffer {
 public:
  buffer(std::size_t n, ddp::shm* arena) : n_(n), arena_(n > 0 ? arena : nullptr) {
    if (arena_ != nullptr) p_ = static_cast<T*>(arena_->allocate(n * sizeof(T)));
    else heap_.resize(n), p_ = heap_.data();
  }
  ~buffer() {
    if (arena_ != nullptr) arena_->deallocate(p_, n_ * sizeof(T));
  }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  std::span<T> span() { return {p_, n_}; }

 private:
  std::size_t n_;
  ddp::shm* arena_;
  std::vector<T> heap_;
  T* p_ = nullptr;
};

struct soak_state {
  ddp::process_group* pg = nullptr;
  reducers* red = nullptr;
  std::size_t mismatches = 0;
  std::vector<std::string> first;
  std::vector<std::uint64_t> hashes;  // of every result, compared across ranks in batches
  std::array<std::size_t, 5> kinds{};
  std::array<std::size_t, 4> per_reducer{};

  void record(std::size_t id, const draw& d, const std::string& what) {
    record_text("collective #" + std::to_string(id) + " " + kind_names[static_cast<int>(d.k)] + " on " +
                reducer_names[d.reducer] + " " + ddp::dtype_name(d.type) + " " + ddp::op_name(d.oper) + " count " +
                std::to_string(d.count) + ": " + what);
  }
  void record_text(const std::string& what) {
    ++mismatches;
    if (first.size() < 8) first.push_back(what);
  }
};

template <class T>
void fill_inputs(std::span<T> v, int r, std::size_t salt, ddp::op o) {
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = from_double<T>(exact_input(r, i + salt, o));
}

/// First element of `v` that differs from `expect(i)` in any bit; empty when none.
template <class T, class E>
std::string compare(std::span<const T> v, E&& expect) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    const T e = expect(i);
    if (std::memcmp(&v[i], &e, sizeof(T)) != 0)
      return "element " + std::to_string(i) + " is " + std::to_string(to_double(v[i])) + ", expected " +
             std::to_string(to_double(e));
  }
  return {};
}

/// An allreduce already issued on `v`; checks it against the reference.
template <class T>
void check_allreduce(soak_state& s, std::size_t id, const draw& d, std::span<const T> v) {
  const int n = s.pg->size();
  if (auto why = compare(v, [&](std::size_t i) { return exact_expected<T>(n, i + d.salt, d.oper); }); !why.empty())
    s.record(id, d, why);
  s.hashes.push_back(fnv(v.data(), v.size_bytes()));
}

template <class T>
void run_single(soak_state& s, std::size_t id, const draw& d) {
  const int r = s.pg->rank(), n = s.pg->size();
  s.red->with(d.reducer, [&](auto& red) {
    ddp::shm* arena = nullptr;
    if constexpr (std::is_same_v<typename std::remove_reference_t<decltype(red)>::transport_type, ddp::shm>)
      if (d.zero_copy) arena = &red.transport();
    switch (d.k) {
      case kind::allreduce: {
        buffer<T> b(d.count, arena);
        fill_inputs(b.span(), r, d.salt, d.oper);
        red.allreduce(b.span(), d.oper);
        check_allreduce<T>(s, id, d, b.span());
        break;
      }
      case kind::reduce_scatter: {
        std::vector<T> in(d.count * static_cast<std::size_t>(n)), out(d.count);
        fill_inputs(std::span<T>(in), r, d.salt, d.oper);
        red.reduce_scatter(std::span<const T>(in), std::span<T>(out), d.oper);
        const std::size_t base = static_cast<std::size_t>(r) * d.count + d.salt;
        if (auto why = compare(std::span<const T>(out), [&](std::size_t j) { return exact_expected<T>(n, base + j, d.oper); });
            !why.empty())
          s.record(id, d, why);
        s.hashes.push_back(0);  // slices differ by rank by design; checked against the reference only
        break;
      }
      case kind::allgather: {
        std::vector<T> in(d.count), out(d.count * static_cast<std::size_t>(n));
        fill_inputs(std::span<T>(in), r, d.salt, d.oper);
        red.allgather(std::span<const T>(in), std::span<T>(out));
        if (auto why = compare(std::span<const T>(out),
                               [&](std::size_t i) {
                                 return from_double<T>(exact_input(static_cast<int>(i / std::max<std::size_t>(1, d.count)),
                                                                   i % std::max<std::size_t>(1, d.count) + d.salt, d.oper));
                               });
            !why.empty())
          s.record(id, d, why);
        s.hashes.push_back(fnv(out.data(), out.size() * sizeof(T)));
        break;
      }
      case kind::broadcast: {
        buffer<T> b(d.count, arena);
        fill_inputs(b.span(), r, d.salt, d.oper);
        red.broadcast(b.span(), d.root);
        if (auto why = compare(std::span<const T>(b.span()),
                               [&](std::size_t i) { return from_double<T>(exact_input(d.root, i + d.salt, d.oper)); });
            !why.empty())
          s.record(id, d, why);
        s.hashes.push_back(fnv(b.span().data(), b.span().size_bytes()));
        break;
      }
      case kind::batch: break;
    }
  });
}

/// Several allreduces in flight at once, on one or several reducers, waited for in order.
void run_batch(soak_state& s, std::size_t id, const std::vector<draw>& ds) {
  const int r = s.pg->rank();
  struct item {
    std::vector<std::byte> bytes;
    ddp::request req;
  };
  std::vector<item> items(ds.size());
  for (std::size_t k = 0; k < ds.size(); ++k) {
    const auto& d = ds[k];
    with_type(d.type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      items[k].bytes.resize(d.count * sizeof(T));
      std::span<T> v(reinterpret_cast<T*>(items[k].bytes.data()), d.count);
      fill_inputs(v, r, d.salt, d.oper);
      items[k].req = s.red->with(d.reducer, [&](auto& red) { return red.allreduce_async(v, d.oper); });
    });
  }
  for (std::size_t k = 0; k < ds.size(); ++k) {
    const auto& d = ds[k];
    items[k].req.wait(std::chrono::steady_clock::now() + 120s);
    with_type(d.type, [&](auto tag) {
      using T = typename decltype(tag)::type;
      check_allreduce<T>(s, id, d, std::span<const T>(reinterpret_cast<const T*>(items[k].bytes.data()), d.count));
    });
    ++s.per_reducer[d.reducer];
  }
}

/// Compares the result hashes gathered since the last call across ranks.
void compare_hashes(soak_state& s, std::size_t first_id, const std::vector<std::size_t>& ids) {
  std::string mine(reinterpret_cast<const char*>(s.hashes.data()), s.hashes.size() * sizeof(std::uint64_t));
  const auto all = s.pg->all_gather(mine);
  for (std::size_t q = 1; q < all.size(); ++q) {
    if (all[q].size() != all[0].size()) {
      s.record_text("before collective #" + std::to_string(first_id) + ": ranks hold different numbers of results");
      continue;
    }
    for (std::size_t k = 0; k < s.hashes.size(); ++k)
      if (std::memcmp(all[q].data() + k * 8, all[0].data() + k * 8, 8) != 0)
        s.record_text("collective #" + std::to_string(ids[k]) + ": rank " + std::to_string(q) +
                      " holds other bits than rank 0");
  }
  s.hashes.clear();
}

void soak_rank(int r, int n, int port, std::size_t count, std::uint64_t seed) {
  ddp::init_options o;
  o.rank = r;
  o.world_size = n;
  o.master_port = port;
  o.timeout = 120s;
  auto pg = ddp::init_process_group(o);
  reducers red(pg);
  soak_state s;
  s.pg = &pg;
  s.red = &red;
  std::mt19937_64 g(seed);
  std::vector<std::size_t> ids;  // collective id of each pending hash
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t id = 0;
  while (id < count) {
    const auto pick = g() % 100;
    const kind k = pick < 70 ? kind::allreduce : pick < 82 ? kind::batch : pick < 88 ? kind::reduce_scatter
                   : pick < 94 ? kind::allgather : kind::broadcast;
    if (k == kind::batch) {
      const std::size_t m = std::min<std::size_t>(2 + g() % 4, count - id);
      std::vector<draw> ds;
      for (std::size_t j = 0; j < m; ++j) ds.push_back(draw_one(g, kind::batch, 256 << 10, n));
      for (std::size_t j = 0; j < m; ++j) ids.push_back(id + j);
      run_batch(s, id, ds);
      s.kinds[static_cast<int>(kind::batch)] += m;
      id += m;
    } else {
      // reduce_scatter and allgather move n times the per-rank count.
      const std::size_t max = k == kind::reduce_scatter || k == kind::allgather ? (1 << 20) / n : 1 << 20;
      const draw d = draw_one(g, k, max, n);
      ids.push_back(id);
      with_type(d.type, [&](auto tag) { run_single<typename decltype(tag)::type>(s, id, d); });
      ++s.kinds[static_cast<int>(k)];
      ++s.per_reducer[d.reducer];
      ++id;
    }
    if (s.hashes.size() >= 64 || id >= count) {
      compare_hashes(s, id, ids);
      ids.clear();
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto totals = pg.all_gather(std::to_string(s.mismatches));
  std::size_t total = 0;
  for (auto& t : totals) total += std::stoull(t);
  for (auto& f : s.first) std::fprintf(stderr, "soak rank %d: %s\n", r, f.c_str());
  if (r == 0) {
    std::printf("soak: seed %llu, %d ranks, %zu collectives in %.1f s, %zu mismatches\n",
                static_cast<unsigned long long>(seed), n, count, secs, total);
    std::printf("soak:   by kind:");
    for (std::size_t k = 0; k < kind_names.size(); ++k) std::printf(" %s %zu", kind_names[k], s.kinds[k]);
    std::printf("\nsoak:   by reducer:");
    for (std::size_t k = 0; k < reducer_names.size(); ++k) std::printf(" %s %zu", reducer_names[k], s.per_reducer[k]);
    std::printf("\n");
    std::fflush(stdout);
  }
  if (total != 0) throw std::runtime_error(std::to_string(total) + " mismatches (first on this rank: " +
                                           (s.first.empty() ? std::string("none here") : s.first.front()) + ")");
}

}  // namespace

TEST_CASE("soak: random collectives on every reducer, every result bit-checked") {
  const auto count = static_cast<std::size_t>(env_long("DDP_SOAK_COUNT", 2000));
  const int n = static_cast<int>(env_long("DDP_SOAK_RANKS", 4));
  const long s = env_long("DDP_SOAK_SEED", 0);
  const std::uint64_t seed = s != 0 ? static_cast<std::uint64_t>(s) : std::random_device{}() % 1000000000u + 1;
  const int port = free_port();
  const auto limit = std::chrono::milliseconds(60000 + 200 * static_cast<std::int64_t>(count));
  auto outs = run_ranks(n, [&](int r) { soak_rank(r, n, port, count, seed); }, limit);
  INFO("seed " << seed << " (DDP_SOAK_SEED reproduces)\n" << summary(outs));
  CHECK(all_ok(outs));
}
