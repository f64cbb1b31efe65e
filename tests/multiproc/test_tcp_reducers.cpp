#include <doctest/doctest.h>

#include <cstring>
#include <random>

#include "harness.hpp"
#include "reducer_cases.hpp"

using namespace std::chrono_literals;
using namespace ddp_test;

// ring<tcp> and tree<tcp>: the cases of every reducer (reducer_cases.hpp), then tcp's own.
REDUCER_CASES(ddp::ring<ddp::tcp>, ddp::tree<ddp::tcp>);
TEST_CASE_TEMPLATE_INVOKE(allreduce_64mib, ddp::ring<ddp::tcp>, ddp::tree<ddp::tcp>);

TEST_CASE("a rank that comes late to a failed group still reports the failure, not 'rank 0 is lost'") {
  // Ranks 0 and 2 fail and leave while rank 1 sleeps (a loaded machine's slow rank, made
  // certain): rank 0 keeps its store up until rank 1 has read why, so rank 1 reports the
  // mismatch too, not the store that was gone when it came.
  auto outs = run_broadcast_dtype_mismatch<ddp::tree<ddp::tcp>>(reducer_opts, 3, 2, true, std::chrono::milliseconds(1500));
  INFO(summary(outs));
  for (auto& o : outs) CHECK(broadcast_dtype_mismatch_seen(o) == "");
  // Rank 0 left once rank 1 had read it, not at its bound: min(5 s, 10 s / 4) = 2.5 s from its
  // own failure, which comes about when rank 1 begins its 1.5 s sleep, so a rank 0 that waited
  // the bound out would end about 1 s after rank 1.
  CHECK(outs[0].seconds < outs[1].seconds + 0.8);
}

TEST_CASE("tree<tcp> with different small_bytes: mismatch naming both, never wrong data; segment_bytes may differ") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    auto outs = on_ranks(n, local_group{10s}, [&](int r, ddp::process_group& pg) {
      std::vector<float> x(1024, static_cast<float>(r + 1));
      ddp::tree<ddp::tcp> red{pg, ddp::reducer_options{.small_bytes = r == n - 1 ? std::size_t{8192} : std::size_t{1024}}};
      red.allreduce(std::span<float>(x), ddp::op::sum);
      for (float e : x) require(e == static_cast<float>(n * (n + 1) / 2), "wrong data without an error");  // not reached
    }, 30s);
    INFO(summary(outs));
    for (auto& o : outs) CHECK(ended_with(o, ddp::errc::mismatch, {"reducer mismatch", "small_bytes 8192", "small_bytes 1024"}) == "");
    for (auto& o : outs) CHECK(o.seconds < 12.0);
  }
  // segment_bytes does not change the ring's wire schedule: ranks may differ in it.
  expect_ok(on_ranks(3, local_group{10s}, [&](int r, ddp::process_group& pg) {
    ddp::ring<ddp::tcp> red{pg, ddp::reducer_options{.segment_bytes = r == 0 ? std::size_t{4096} : std::size_t{256 << 10}}};
    std::vector<float> x(100000, 1.0f);
    red.allreduce(std::span<float>(x), ddp::op::sum);
    for (float e : x) require(e == 3.0f, "segment_bytes differ");
  }, 30s));
}

TEST_CASE("every descriptor carries the algorithm and its variant; a difference is a mismatch naming both") {
  using namespace ddp::detail;
  coll_desc a;
  a.kind = coll_kind::allreduce;
  a.count = 1024;
  a.seq = 3;
  a.algo = coll_algo::tree;
  a.variant = coll_variant::recursive_doubling;
  coll_desc b = a;
  CHECK(mismatch(a, 0, b, 1).empty());
  b.variant = coll_variant::halving_doubling;
  auto why = mismatch(a, 0, b, 1);
  CHECK(why.find("rank 0 called allreduce #3 of 1024 x f32 sum by tree (recursive doubling)") != std::string::npos);
  CHECK(why.find("rank 1 called allreduce #3 of 1024 x f32 sum by tree (halving-doubling)") != std::string::npos);
  CHECK(why.find("small_bytes") != std::string::npos);
  b = a;
  b.algo = coll_algo::ring;
  b.variant = coll_variant::none;
  why = mismatch(a, 0, b, 1);
  CHECK(why.find("by ring,") == std::string::npos);
  CHECK(why.find("rank 1 called allreduce #3 of 1024 x f32 sum by ring") != std::string::npos);
  CHECK(why.find("same reducer") != std::string::npos);
}

// The wrapper's copy mode hands the ring<tcp> the gradients' addresses (bucket_tag::sources)
// instead of copying them into the bucket and the averages back: the ring sends its first chunk
// from them, part by part, reads its operand of each first reduction there, and writes the
// results there (last reduction, all-gather). Same bits as from a filled buffer: tensors of 1
// element to thousands, gaps between them (in the buffer), sources that are the tensor's own slot
// or none, more parts in one chunk than one sendmsg takes (IOV_MAX), on 2-4 ranks, sum and
// average, f32 and bf16; the tree (which does not read sources) copies them in first and the
// results out after, and gives its own bits from the same data.
template <class R>
void check_sources(int n, ddp::dtype ty, ddp::op o, std::size_t tensors, std::uint64_t seed) {
  expect_ok(on_ranks(n, reducer_opts, [&](int r, ddp::process_group& pg) {
    const std::size_t es = ddp::dtype_size(ty);
    std::mt19937_64 g(seed);  // the same layout on every rank
    std::vector<ddp::comm_tensor> layout;
    std::size_t count = 0;
    for (std::size_t k = 0; k < tensors; ++k) {
      count += g() % 3 == 0 ? g() % 5 : 0;  // a gap: elements no tensor owns
      const std::size_t numel = g() % 4 == 0 ? 1 + g() % 3000 : 1 + g() % 7;
      layout.push_back({k, count, numel, numel});
      count += numel;
    }
    count += g() % 9;
    std::mt19937_64 v(seed ^ (0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(r + 1)));
    std::vector<unsigned char> full(count * es);
    for (std::size_t i = 0; i < count; ++i) {
      const float x = static_cast<float>(static_cast<int>(v() % 2001) - 1000) / 64.0f;
      if (ty == ddp::dtype::bf16) {
        std::uint32_t b;
        std::memcpy(&b, &x, 4);
        const auto h = static_cast<std::uint16_t>(b >> 16);
        std::memcpy(&full[i * es], &h, 2);
      } else {
        std::memcpy(&full[i * es], &x, 4);
      }
    }
    // The expected bits: the same reducer on the filled buffer.
    R red = make<R>(pg);
    std::vector<unsigned char> want = full;
    red.allreduce(want.data(), count, ty, o);
    // The buffer holds only the gaps (and the tensors whose source is the buffer); the rest is
    // poison, and lives at the sources.
    std::vector<unsigned char> buf(count * es, 0xCD);
    std::vector<std::vector<unsigned char>> held(tensors);
    std::vector<void*> sources(tensors, nullptr);
    std::vector<bool> covered(count, false);
    for (std::size_t k = 0; k < tensors; ++k) {
      const auto& x = layout[k];
      for (std::size_t i = x.offset; i < x.offset + x.numel; ++i) covered[i] = true;
      const std::size_t how = g() % 8;
      if (how == 0) {  // in the buffer already
        std::memcpy(&buf[x.offset * es], &full[x.offset * es], x.numel * es);
      } else if (how == 1) {  // its own slot
        std::memcpy(&buf[x.offset * es], &full[x.offset * es], x.numel * es);
        sources[k] = &buf[x.offset * es];
      } else {
        held[k].assign(full.begin() + static_cast<std::ptrdiff_t>(x.offset * es),
                       full.begin() + static_cast<std::ptrdiff_t>((x.offset + x.numel) * es));
        sources[k] = held[k].data();
      }
    }
    for (std::size_t i = 0; i < count; ++i)
      if (!covered[i]) std::memcpy(&buf[i * es], &full[i * es], es);
    const ddp::bucket_tag tag{.bucket = 0, .step = 0, .tensors = layout, .sources = sources};
    red.allreduce_async(buf.data(), count, ty, o, tag).wait(std::chrono::steady_clock::now() + 20s);
    // Each tensor's result where its data was; the rest in the buffer.
    for (std::size_t k = 0; k < tensors; ++k) {
      const auto& x = layout[k];
      const auto* got = sources[k] != nullptr ? static_cast<const unsigned char*>(sources[k]) : &buf[x.offset * es];
      require(std::memcmp(got, &want[x.offset * es], x.numel * es) == 0,
              "tensor " + std::to_string(k) + ": the result from sources differs from the filled buffer's bits");
    }
    for (std::size_t i = 0; i < count; ++i)
      if (!covered[i]) require(std::memcmp(&buf[i * es], &want[i * es], es) == 0, "a gap's result differs");
  }, 60s));
}

TEST_CASE_TEMPLATE("allreduce from bucket_tag::sources: the bits of a filled buffer", R, ddp::ring<ddp::tcp>,
                   ddp::tree<ddp::tcp>) {
  static_assert(ddp::ring<ddp::tcp>::reads_sources() && !ddp::tree<ddp::tcp>::reads_sources());
  std::uint64_t seed = 7;
  for (int n : {2, 3, 4})
    for (auto ty : {ddp::dtype::f32, ddp::dtype::bf16})
      for (auto o : {ddp::op::sum, ddp::op::avg}) {
        CAPTURE(n);
        CAPTURE(static_cast<int>(ty));
        CAPTURE(static_cast<int>(o));
        check_sources<R>(n, ty, o, 40, ++seed);
      }
  // More parts in one chunk than one sendmsg takes: 3000 one-element tensors.
  check_sources<R>(2, ddp::dtype::f32, ddp::op::avg, 3000, 99);
  check_sources<R>(3, ddp::dtype::f32, ddp::op::sum, 3000, 98);
}

TEST_CASE("allreduce from bucket_tag::sources: a source inside the buffer, or too few, is invalid_argument") {
  expect_ok(on_ranks(2, reducer_opts, [&](int, ddp::process_group& pg) {
    ddp::ring<ddp::tcp> red{pg};
    std::vector<float> buf(64, 1.0f);
    const ddp::comm_tensor t[2] = {{0, 0, 8, 8}, {1, 8, 8, 8}};
    void* inside[2] = {buf.data() + 16, nullptr};
    require_raises([&] { (void)red.allreduce_async(buf.data(), 64, ddp::dtype::f32, ddp::op::sum, {.tensors = t, .sources = inside}); },
                   ddp::errc::invalid_argument, {"overlaps the buffer"}, "a source inside the buffer");
    void* one[1] = {nullptr};
    require_raises([&] { (void)red.allreduce_async(buf.data(), 64, ddp::dtype::f32, ddp::op::sum, {.tensors = t, .sources = one}); },
                   ddp::errc::invalid_argument, {"1 sources for 2 tensors"}, "too few sources");
  }, 30s));
}
