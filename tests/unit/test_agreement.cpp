#include "ddp/data_parallel/agreement.hpp"
#include "ddp/data_parallel/buffers.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "ddp/planner/size_planner.hpp"
#include "dp_plan.hpp"
#include "raises.hpp"

namespace {

using ddp_test::error_of;

// A fake group of two: this process is rank 0; rank 1's contributions are set by the test.
struct fake_pair {
  std::string theirs;                     // what rank 1 contributes to the next all_gather
  std::vector<std::uint64_t> root_words;  // rank 0's words in a broadcast (this rank's own)
  int gathers = 0, broadcasts = 0;
  std::vector<std::string> sent;

  ddp::agreement_channel channel(int rank = 0) {
    return {rank, 2,
            [this](const std::string& mine) {
              ++gathers;
              sent.push_back(mine);
              return std::vector<std::string>{mine, theirs};
            },
            [this](std::span<std::uint64_t> words, int root) {
              ++broadcasts;
              CHECK(root == 0);
              if (!root_words.empty()) std::copy(root_words.begin(), root_words.end(), words.begin());
            }};
  }
};

ddp::tensor_view view(std::vector<std::int64_t> shape, std::string_view name = {}, int device = -1) {
  ddp::tensor_view v;
  v.numel = 1;
  for (auto d : shape) v.numel *= static_cast<std::size_t>(d);
  v.shape = std::move(shape);
  v.name = name;
  v.device = device;
  return v;
}

std::string words(std::initializer_list<std::uint64_t> ws) {
  std::string s;
  for (auto w : ws)
    for (int k = 0; k < 8; ++k) s.push_back(static_cast<char>((w >> (8 * k)) & 0xff));
  return s;
}

}  // namespace

TEST_CASE("agreement: the signature record on the wire is unchanged (64-bit little-endian words)") {
  const std::vector<ddp::tensor_view> vs{view({2, 3}), view({5}, "b", 1)};
  CHECK(ddp::agreement::encode_signatures(vs) == words({2, 0, 2, 2, 3, 0x100, 1, 5}));
  const auto back = ddp::agreement::decode_signatures(ddp::agreement::encode_signatures(vs));
  REQUIRE(back.size() == 2);
  CHECK(back[0].shape == std::vector<std::int64_t>{2, 3});
  CHECK(back[1].on_device == 1);
  CHECK(ddp::agreement::describe(back[0]) == "f32[2, 3]");
  CHECK(ddp::agreement::describe(back[1]) == "f32@device[5]");
  const auto e = error_of([&] { ddp::agreement::decode_signatures(words({2, 0}).substr(0, 12)); });
  CHECK(e.condition() == ddp::errc::protocol);
  CHECK(ddp::agreement::encode_plan(dp_test::three_buckets(), true) ==
        words({dp_test::three_buckets().fingerprint(), 1}));
}

TEST_CASE("agreement: the same parameters on every rank pass; a differing one is named on every rank") {
  fake_pair fake;
  ddp::agreement agree{fake.channel()};
  const std::vector<ddp::tensor_view> mine{view({8}), view({4, 6}, "fc.weight"), view({6})};
  fake.theirs = ddp::agreement::encode_signatures(mine);
  agree.check_signatures(mine);
  CHECK(fake.gathers == 1);

  const std::vector<ddp::tensor_view> other{view({8}), view({6, 4}, "fc.weight"), view({6})};
  fake.theirs = ddp::agreement::encode_signatures(other);
  const auto e = error_of([&] { agree.check_signatures(mine); });
  CHECK(e.condition() == ddp::errc::mismatch);
  CHECK(e.parameter() == 1);
  CHECK(e.rank() == 0);
  CHECK(std::string(e.what()).find(
            "ranks disagree on parameter 1 ('fc.weight'): rank 0 has f32[4, 6], rank 1 has f32[6, 4]") !=
        std::string::npos);

  // Host on one rank, a device on the other.
  const std::vector<ddp::tensor_view> on_device{view({8}, "emb", 0), view({4, 6}), view({6})};
  fake.theirs = ddp::agreement::encode_signatures(on_device);
  const auto d = error_of([&] { agree.check_signatures(mine); });
  CHECK(std::string(d.what()).find("rank 1 has f32@device[8]") != std::string::npos);
}

TEST_CASE("agreement: a different number of parameters names the counts and the first extra one") {
  fake_pair fake;
  ddp::agreement agree{fake.channel(1)};
  const std::vector<ddp::tensor_view> mine{view({8}), view({4}), view({2}, "head")};
  fake.theirs = ddp::agreement::encode_signatures(std::vector<ddp::tensor_view>{view({8}), view({4})});
  const auto e = error_of([&] { agree.check_signatures(mine); });
  CHECK(e.condition() == ddp::errc::mismatch);
  CHECK(e.rank() == 1);
  CHECK(e.parameter() == 2);
  CHECK(std::string(e.what()).find("ranks disagree on the number of parameters: rank 0 has 3, rank 1 has 2; "
                                   "the first differing is parameter 2 ('head')") != std::string::npos);
}

TEST_CASE("agreement: plans and the rebuild decision must match") {
  fake_pair fake;
  ddp::agreement agree{fake.channel()};
  const auto plan = dp_test::three_buckets();
  fake.theirs = ddp::agreement::encode_plan(plan, false);
  agree.check_plan(plan, false, "at construction");

  auto other = plan;
  std::swap(other.buckets[1], other.buckets[2]);
  fake.theirs = ddp::agreement::encode_plan(other, false);
  const auto e = error_of([&] { agree.check_plan(plan, false, "at construction"); });
  CHECK(e.condition() == ddp::errc::mismatch);
  CHECK(std::string(e.what()).find("bucket plans differ at construction between rank 0 and rank 1") !=
        std::string::npos);

  fake.theirs = ddp::agreement::encode_plan(plan, true);
  const auto r = error_of([&] { agree.check_plan(plan, false, "at construction"); });
  CHECK(std::string(r.what()).find("ranks disagree at construction on rebuilding the bucket plan after the first "
                                   "step: rank 0 does, rank 1 do not") != std::string::npos);
}

TEST_CASE("agreement: a rank that could not set up its buckets fails every rank, naming it") {
  fake_pair fake;
  ddp::agreement agree{fake.channel()};
  fake.theirs = "";
  agree.share_setup(nullptr);
  CHECK(fake.sent.back().empty());

  fake.theirs = ddp::group_failure{ddp::errc::system, "shm arena full", -1, 1}.encode();
  const auto e = error_of([&] { agree.share_setup(nullptr); });
  CHECK(e.condition() == ddp::errc::system);
  CHECK(std::string(e.what()).find("rank 1 could not set up its gradient buckets: shm arena full") !=
        std::string::npos);

  // This rank's own failure is sent to the peers and rethrown as it was raised.
  fake.theirs = "";
  const auto own = std::make_exception_ptr(ddp::error(ddp::errc::unsupported, 0, "no room on device 0"));
  const auto o = error_of([&] { agree.share_setup(own); });
  CHECK(o.condition() == ddp::errc::unsupported);
  CHECK(std::string(o.what()).find("no room on device 0") != std::string::npos);
  const auto sent = ddp::group_failure::decode(fake.sent.back());
  CHECK(sent.code == ddp::errc::unsupported);
  CHECK(sent.text == "no room on device 0");
  CHECK(sent.origin == 0);

  // Alone, nothing is gathered.
  ddp::agreement alone{{0, 1, nullptr, nullptr}};
  alone.share_setup(nullptr);
  CHECK_THROWS_AS(alone.share_setup(own), ddp::error);
}

TEST_CASE("agreement: the rebuild plans from rank 0's observed order on every rank") {
  std::vector<ddp::param_info> infos(4, ddp::param_info{1000, ddp::dtype::f32, -1});
  const ddp::bucket_policy policy{.cap_bytes = 0, .first_cap_bytes = 0};  // one bucket per parameter
  fake_pair fake;
  fake.root_words = {1, 3, 0, 2};  // rank 0 saw this order
  ddp::agreement agree{fake.channel(1)};
  const std::vector<std::size_t> mine{3, 2, 1, 0};  // this rank saw another
  const auto plan = agree.rebuilt_plan(ddp::size_planner{}, infos, policy, mine);
  CHECK(fake.broadcasts == 1);
  REQUIRE(plan.buckets.size() == 4);
  std::vector<std::size_t> first;
  for (const auto& b : plan.buckets) first.push_back(b.entries.front().param);
  CHECK(first == std::vector<std::size_t>{1, 3, 0, 2});
}

TEST_CASE("agreement: an option every rank must share (check_same) names the differing rank and values") {
  fake_pair fake;
  ddp::agreement agree{fake.channel()};
  fake.theirs = words({1});
  agree.check_same("dp_options::uneven_inputs", 1);
  fake.theirs = words({0});
  const auto e = error_of([&] { agree.check_same("dp_options::uneven_inputs", 1); });
  CHECK(e.condition() == ddp::errc::mismatch);
  CHECK(std::string(e.what()).find("ranks disagree on dp_options::uneven_inputs: rank 0 has 1, rank 1 has 0") !=
        std::string::npos);
}

TEST_CASE("agreement: buffers are compared like parameters, frozen ones told apart, named as buffers") {
  fake_pair fake;
  ddp::agreement agree{fake.channel()};
  std::vector<float> a(6), b(6);
  std::vector<std::int64_t> c(1);
  const std::vector<ddp::buffer_view> mine{
      ddp::make_buffer_view(std::span{a}, "bn.mean"),
      ddp::make_buffer_view(std::span{b}, "frozen.w", {2, 3}, ddp::buffer_kind::frozen_parameter),
      ddp::make_buffer_view(std::span{c}, "bn.count")};
  fake.theirs = ddp::agreement::encode_signatures(std::span<const ddp::buffer_view>(mine));
  agree.check_buffer_signatures(mine);

  auto other = mine;
  other[1].kind = ddp::buffer_kind::buffer;  // a buffer where rank 0 has a frozen parameter
  fake.theirs = ddp::agreement::encode_signatures(std::span<const ddp::buffer_view>(other));
  const auto e = error_of([&] { agree.check_buffer_signatures(mine); });
  CHECK(e.condition() == ddp::errc::mismatch);
  CHECK(e.parameter() == -1);
  CHECK(std::string(e.what()).find("ranks disagree on buffer 1 ('frozen.w'): rank 0 has f32[2, 3] (frozen parameter), "
                                   "rank 1 has f32[2, 3]") != std::string::npos);

  other.pop_back();
  other[1].kind = ddp::buffer_kind::frozen_parameter;
  fake.theirs = ddp::agreement::encode_signatures(std::span<const ddp::buffer_view>(other));
  const auto n = error_of([&] { agree.check_buffer_signatures(mine); });
  CHECK(std::string(n.what()).find("ranks disagree on the number of buffers: rank 0 has 3, rank 1 has 2; the first "
                                   "differing is buffer 2 ('bn.count')") != std::string::npos);
}

TEST_CASE("agreement: values hash by their bytes (XXH64 over the views in order); ranks_differing names the others") {
  std::vector<float> a{1.0f, 2.0f, 3.0f}, b{4.0f, 5.0f}, ga(3), gb(2);
  const std::vector<ddp::tensor_view> vs{ddp::make_tensor_view(a, ga, "a"), ddp::make_tensor_view(b, gb, "b")};
  ddp::detail::xxh64 h;
  REQUIRE(ddp::agreement::hash_values(h, std::span<const ddp::tensor_view>(vs)));
  // The concatenation of the values' bytes, streamed.
  std::vector<float> all{1.0f, 2.0f, 3.0f, 4.0f, 5.0f};
  const auto digest = h.digest();
  CHECK(digest == ddp::detail::xxh64::of(all.data(), all.size() * sizeof(float)));
  // One bit of one value changes it.
  b[1] = std::nextafter(b[1], 10.0f);
  ddp::detail::xxh64 h2;
  REQUIRE(ddp::agreement::hash_values(h2, std::span<const ddp::tensor_view>(vs)));
  CHECK(h2.digest() != digest);
  // Values on a device: nothing is hashed, and the caller broadcasts.
  auto dev = vs;
  dev[1].device = 0;
  ddp::detail::xxh64 h3;
  CHECK_FALSE(ddp::agreement::hash_values(h3, std::span<const ddp::tensor_view>(dev)));
  CHECK(h3.digest() == ddp::detail::xxh64{}.digest());

  fake_pair f;
  ddp::agreement agree{f.channel()};
  std::string theirs;
  ddp::detail::byte_writer(theirs).u64(digest);
  f.theirs = theirs;
  CHECK(agree.ranks_differing(digest).empty());
  CHECK(agree.ranks_differing(digest + 1) == std::vector<int>{1});
  CHECK(f.gathers == 2);
  CHECK(f.broadcasts == 0);
}

TEST_CASE("buffer_layout: each-step buffers grouped by dtype, 64-byte aligned groups; frozen ones left out") {
  std::vector<float> m1(5), m2(3);
  std::vector<double> v(2);
  std::vector<std::int64_t> c(1);
  std::vector<float> frozen(7);
  const ddp::buffer_layout layout{{ddp::make_buffer_view(std::span{c}, "count"), ddp::make_buffer_view(std::span{m1}, "m1"),
                                   ddp::make_buffer_view(std::span{frozen}, "f", {}, ddp::buffer_kind::frozen_parameter),
                                   ddp::make_buffer_view(std::span{v}, "v"), ddp::make_buffer_view(std::span{m2}, "m2")}};
  REQUIRE(layout.groups().size() == 3);
  CHECK(layout.groups()[0].type == ddp::dtype::f32);
  CHECK(layout.groups()[0].offset == 0);
  CHECK(layout.groups()[0].numel == 8);  // m1 and m2, not the frozen one
  CHECK(layout.groups()[1].type == ddp::dtype::f64);
  CHECK(layout.groups()[1].offset == 64);
  CHECK(layout.groups()[2].type == ddp::dtype::i64);
  CHECK(layout.groups()[2].offset == 128);
  CHECK(layout.bytes() == 192);
  REQUIRE(layout.slots().size() == 4);
  CHECK(layout.slots()[0].buffer == 1);  // m1 at 0
  CHECK(layout.slots()[1].buffer == 4);  // m2 after m1's 5 floats
  CHECK(layout.slots()[1].offset == 20);
  CHECK(layout.buffers()[2].name == "f");
  CHECK(ddp::step_record::encode({true, false, true}, 2) == std::vector<std::int64_t>{1, 0, 1, 2});
  CHECK(ddp::step_record::bytes(3) == 32);
}

TEST_CASE("agreement: a setting written out (check_same_text) shows every differing value, not a hash") {
  fake_pair fake;
  ddp::agreement agree{fake.channel()};
  fake.theirs = "caps [1 MiB, 4 MiB]";
  agree.check_same_text("bucket_policy::autotune_caps", "caps [1 MiB, 4 MiB]");
  CHECK(fake.sent.back() == "caps [1 MiB, 4 MiB]");  // the text itself goes on the wire
  fake.theirs = "caps [1 MiB, 8 MiB]";
  const auto e = error_of([&] { agree.check_same_text("bucket_policy::autotune_caps", "caps [1 MiB, 4 MiB]"); });
  CHECK(e.condition() == ddp::errc::mismatch);
  CHECK(std::string(e.what()).find("ranks disagree on bucket_policy::autotune_caps: rank 0 has caps [1 MiB, 4 MiB]; "
                                   "rank 1 has caps [1 MiB, 8 MiB]") != std::string::npos);
}

TEST_CASE("agreement: check_same_text groups the ranks that share a differing value") {
  // Five ranks: 1 and 3 agree with each other, 4 has a third value; this process is rank 2.
  const std::vector<std::string> values{"a", "b", "a", "b", "c"};
  ddp::agreement agree{{2, 5, [&](const std::string&) { return values; }, {}}};
  const auto e = error_of([&] { agree.check_same_text("x", "a"); });
  CHECK(e.rank() == 2);
  CHECK(std::string(e.what()).find("ranks disagree on x: rank 0 has a; ranks 1, 3 have b; rank 4 has c") !=
        std::string::npos);
  // One rank alone checks nothing (and gathers nothing).
  ddp::agreement alone{{0, 1, {}, {}}};
  alone.check_same_text("x", "a");
}

TEST_CASE("consensus: a failure travels in one codec; the lowest failing rank is the one every rank raises") {
  using ddp::group_failure;
  const group_failure o{ddp::errc::mismatch, "rank 2 has f16 where rank 0 has f32 (with spaces)", 7, 2};
  const auto back = group_failure::decode(o.encode());
  CHECK(back.code == ddp::errc::mismatch);
  CHECK(back.parameter == 7);
  CHECK(back.origin == 2);
  CHECK(back.text == o.text);
  CHECK(group_failure{}.encode().empty());
  CHECK(group_failure::decode("").empty());
  // Anything encode() cannot have written is a protocol failure quoting it, never success.
  for (const char* junk : {"not a failure", "3 -1 2", "3 -1 2 ", "99 -1 -1 x", "0 -1 -1 x", "3 x -1 text", "3"}) {
    CAPTURE(junk);
    const auto j = group_failure::decode(junk);
    CHECK(j.code == ddp::errc::protocol);
    CHECK(j.text.find(junk) != std::string::npos);
  }
  // A failure whose message is empty still reads as a failure; its origin is the rank given.
  const auto empty = ddp::detail::failure_of(std::make_exception_ptr(ddp::error(ddp::errc::system, 0, "")), 4);
  CHECK_FALSE(empty.empty());
  CHECK(empty.origin == 4);
  const auto gathered = [](const std::string&) {
    return std::vector<std::string>{"", group_failure{ddp::errc::timeout, "late"}.encode(),
                                    group_failure{ddp::errc::system, "full"}.encode()};
  };
  const auto f = ddp::detail::first_failed(gathered, group_failure{});
  CHECK(f.rank == 1);
  CHECK(f.what.code == ddp::errc::timeout);
  CHECK(f.what.text == "late");
  CHECK(f.what.origin == 1);  // the rank it was gathered from
}

TEST_CASE("consensus: a blob from one rank to all; a length outside its bounds is refused before it sizes memory") {
  using ddp::detail::broadcast_blob;
  // The root keeps its blob (a one-process broadcast changes nothing).
  std::string blob = "state";
  int calls = 0;
  auto echo = [&](std::span<std::byte>) { ++calls; };
  broadcast_blob(echo, blob, 0, 0, 1, 100, "test blob");
  CHECK(blob == "state");
  CHECK(calls == 2);
  // A receiver told of a length past the bound raises naming the root and the blob, and never
  // asks for the bytes (nothing was allocated for them).
  calls = 0;
  std::string got;
  auto liar = [&](std::span<std::byte> b) {
    ++calls;
    const std::uint64_t huge = std::uint64_t{1} << 60;
    REQUIRE(b.size() == sizeof huge);
    std::memcpy(b.data(), &huge, sizeof huge);
  };
  try {
    broadcast_blob(liar, got, 1, 0, 1, 100, "test blob");
    FAIL("an announced length past the bound was accepted");
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::protocol);
    CHECK(std::string(e.what()).find("test blob: rank 0 announced 1152921504606846976 bytes") != std::string::npos);
  }
  CHECK(calls == 1);
  CHECK(got.empty());
  // The root's own blob out of bounds fails there too, as on the others.
  std::string big(101, 'x');
  CHECK_THROWS_AS(broadcast_blob(echo, big, 0, 0, 1, 100, "test blob"), ddp::error);
  std::string none;
  CHECK_THROWS_AS(broadcast_blob(echo, none, 0, 0, 1, 100, "test blob"), ddp::error);
}
