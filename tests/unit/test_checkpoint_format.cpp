// The checkpoint file format (ddp/data_parallel/detail/checkpoint.hpp): the checksum, the header and table
// codecs, and a decoder that refuses every malformed input without reading out of bounds.
#include <ddp/checkpoint.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace ck = ddp::detail::ckpt;

namespace {
std::vector<ck::entry> sample_entries() {
  return {{"fc1.weight", ddp::dtype::f32, {4, 6}, 24},
          {"fc1.bias", ddp::dtype::f64, {6}, 6},
          {"", ddp::dtype::i64, {}, 1},  // a scalar: no extents, one element
          {"emb", ddp::dtype::bf16, {0, 5}, 0}};
}
std::uint64_t data_bytes(const std::vector<ck::entry>& es) {
  std::uint64_t n = 0;
  for (const auto& e : es) n += e.numel * ddp::dtype_size(e.type);
  return n;
}
// Header and table of a file holding `es` and an `extra`-byte blob; `size` gets the file's size.
std::string meta_of(const std::vector<ck::entry>& es, std::uint64_t extra, std::uint64_t& size) {
  const auto table = ck::encode_table(es);
  const auto head = ck::encode_header({es.size(), table.size(), data_bytes(es), extra});
  size = head.size() + table.size() + data_bytes(es) + extra + ck::trailer_bytes;
  return head + table;
}
}  // namespace

TEST_CASE("the checksum is XXH64 with seed 0, in one piece or streamed") {
  CHECK(ck::xxh64::of("", 0) == 0xef46db3751d8e999ull);
  CHECK(ck::xxh64::of("a", 1) == 0xd24ec4f1a98c6e5bull);
  CHECK(ck::xxh64::of("abc", 3) == 0x44bc2cf5ad770999ull);
  std::string b(100, '\0');
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<char>(i);
  CHECK(ck::xxh64::of(b.data(), b.size()) == 0x6ac1e58032166597ull);
  std::string c(1000, '\0');
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = static_cast<char>(i * 7 % 256);
  CHECK(ck::xxh64::of(c.data(), c.size()) == 0x25275608a9cfc168ull);
  for (std::size_t piece : {1u, 3u, 7u, 31u, 32u, 33u, 500u}) {
    ck::xxh64 h;
    for (std::size_t at = 0; at < c.size(); at += piece) h.update(c.data() + at, std::min(piece, c.size() - at));
    CHECK(h.digest() == 0x25275608a9cfc168ull);
  }
}

TEST_CASE("header and table round-trip") {
  const auto es = sample_entries();
  std::uint64_t size = 0;
  const auto meta = meta_of(es, 17, size);
  ck::header h;
  REQUIRE(ck::decode_header(meta, size, h) == "");
  CHECK(h.count == 4);
  CHECK(h.data == 24 * 4 + 6 * 8 + 8 + 0);
  CHECK(h.extra == 17);
  std::vector<ck::entry> back;
  REQUIRE(ck::decode_table(std::string_view(meta).substr(ck::header_bytes), h, back) == "");
  CHECK(back == es);
  CHECK(meta.substr(0, 8) == std::string("DDPCKPT\0", 8));
}

TEST_CASE("every truncation, every flipped byte and random bytes are refused without reading out of bounds") {
  const auto es = sample_entries();
  std::uint64_t size = 0;
  const auto meta = meta_of(es, 5, size);
  // The decoders see exactly the bytes they are given: a shorter header or table is refused
  // (an out-of-bounds read would show under the sanitizers and as garbage here).
  for (std::size_t len = 0; len < meta.size(); ++len) {
    CAPTURE(len);
    const std::string cut = meta.substr(0, len);
    ck::header h;
    std::string why = ck::decode_header(cut, size, h);
    if (len < ck::header_bytes) {
      CHECK(why != "");
      continue;
    }
    REQUIRE(why == "");
    std::vector<ck::entry> out;
    CHECK(ck::decode_table(std::string_view(cut).substr(ck::header_bytes), h, out) != "");
  }
  // A file size that does not match the header.
  for (std::uint64_t wrong : {std::uint64_t{0}, size - 1, size + 1, std::uint64_t{1} << 63}) {
    ck::header h;
    CHECK(ck::decode_header(meta, wrong, h) != "");
  }
  // Every byte of header and table changed: refused, or (in a name or an unused bit) decoded
  // into a different table; never accepted as the same one.
  int refused = 0;
  for (std::size_t at = 0; at < meta.size(); ++at) {
    for (unsigned char x : {0x01, 0x80, 0xff}) {
      std::string bad = meta;
      bad[at] = static_cast<char>(bad[at] ^ static_cast<char>(x));
      ck::header h;
      std::vector<ck::entry> out;
      std::string why = ck::decode_header(bad, size, h);
      if (why.empty()) why = ck::decode_table(std::string_view(bad).substr(ck::header_bytes), h, out);
      if (!why.empty()) ++refused;
      else CHECK(out != es);
    }
  }
  CHECK(refused > 0);
  // Random bytes, with and without a valid magic and version, of random sizes.
  std::mt19937_64 g(13);
  for (int trial = 0; trial < 20000; ++trial) {
    std::string junk(static_cast<std::size_t>(g() % 200), '\0');
    for (auto& ch : junk) ch = static_cast<char>(g());
    if (trial % 2 == 0 && junk.size() >= 16) junk.replace(0, 16, meta.substr(0, 16));
    ck::header h;
    const std::uint64_t claimed = trial % 3 == 0 ? g() : junk.size() + g() % 64;
    std::string why = ck::decode_header(junk, claimed, h);
    if (!why.empty()) continue;
    std::vector<ck::entry> out;
    const std::string_view table = std::string_view(junk).substr(std::min(junk.size(), ck::header_bytes));
    (void)ck::decode_table(table, h, out);
  }
}

TEST_CASE("specific refusals say what is wrong") {
  const auto es = sample_entries();
  std::uint64_t size = 0;
  const auto meta = meta_of(es, 0, size);
  ck::header h;
  std::string bad = meta;
  bad[0] = 'X';
  CHECK(ck::decode_header(bad, size, h) == "not a ddp checkpoint (wrong magic bytes)");
  bad = meta;
  bad[8] = 2;
  CHECK(ck::decode_header(bad, size, h) == "checkpoint format version 2; this ddp reads version 1");
  bad = meta;
  bad[12] = 1;
  CHECK(ck::decode_header(bad, size, h) == "checkpoint header has unknown flags set (a newer format?)");
  CHECK(ck::decode_header(meta, 10, h).find("shorter than the 56 of an empty one") != std::string::npos);
  CHECK(ck::decode_header(meta, size - 1, h).find("sizes do not add up") != std::string::npos);
  // A table whose numel is not the product of its shape.
  auto wrong = es;
  wrong[0].numel = 25;
  const auto t = ck::encode_table(wrong);
  const ck::header hh{wrong.size(), t.size(), data_bytes(wrong), 0};
  std::vector<ck::entry> out;
  CHECK(ck::decode_table(t, hh, out) == "checkpoint table, parameter 0: numel 25 is not the product of its shape");
  // More parameters announced than a table of that size can hold.
  const auto head = ck::encode_header({1000, t.size(), 0, 0});
  CHECK(ck::decode_header(head, ck::header_bytes + t.size() + ck::trailer_bytes, h).find("announces 1000 parameters") !=
        std::string::npos);
}

TEST_CASE("the first difference between the file's parameters and a rank's names it") {
  const auto es = sample_entries();
  int index = -1;
  CHECK(ck::first_difference(es, es, 1, index) == "");
  auto other = es;
  other[1].shape = {3, 2};
  CHECK(ck::first_difference(es, other, 2, index) ==
        "parameter 1 ('fc1.bias') differs: the file has 'fc1.bias' f64[6], rank 2 has 'fc1.bias' f64[3, 2]");
  CHECK(index == 1);
  other = es;
  other[0].type = ddp::dtype::f16;
  CHECK(ck::first_difference(es, other, 0, index).find("the file has 'fc1.weight' f32[4, 6], rank 0 has 'fc1.weight' "
                                                       "f16[4, 6]") != std::string::npos);
  CHECK(index == 0);
  other = es;
  other.pop_back();
  CHECK(ck::first_difference(es, other, 1, index) ==
        "the file has 4 parameters, rank 1 has 3: parameter 3 ('emb') bf16[0, 5] is in the file only");
  CHECK(index == 3);
  other = es;
  other.push_back({"head", ddp::dtype::f32, {2}, 2});
  CHECK(ck::first_difference(es, other, 1, index) ==
        "the file has 4 parameters, rank 1 has 5: parameter 4 ('head') f32[2] is not in the file");
  CHECK(index == 4);
}
