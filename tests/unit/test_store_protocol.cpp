#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/group/detail/store_protocol.hpp>
#include <ddp/detail/bytes.hpp>
#include <ddp/group/detail/handshake.hpp>

#include <doctest/doctest.h>

#include <array>
#include <string>
#include <string_view>

using namespace ddp::detail;
using namespace std::string_literals;

TEST_CASE("frames round-trip through encode, check_header and parse_body") {
  const std::string big(100000, 'x');
  auto f = encode_frame(static_cast<std::uint8_t>(store_cmd::cas), {"key", "", big});
  std::uint32_t len = 0;
  REQUIRE(check_header(f, len) == parse_result::ok);
  CHECK(len == f.size() - 4);
  frame out;
  REQUIRE(parse_body(std::string_view(f).substr(4), out) == parse_result::ok);
  CHECK(out.code == static_cast<std::uint8_t>(store_cmd::cas));
  REQUIRE(out.fields.size() == 3);
  CHECK(out.fields[0] == "key");
  CHECK(out.fields[1].empty());
  CHECK(out.fields[2] == big);
  CHECK(valid_request(out));
}

TEST_CASE("partial frames ask for more bytes") {
  auto f = encode_frame(1, {"k", "v"});
  std::uint32_t len = 0;
  for (std::size_t cut = 0; cut < f.size(); ++cut)
    CHECK(check_header(std::string_view(f).substr(0, cut), len) == parse_result::need_more);
}

TEST_CASE("oversized and zero lengths are rejected before allocating") {
  std::string h;
  put_u32(h, 0xffffffffu);
  std::uint32_t len = 0;
  CHECK(check_header(h, len) == parse_result::invalid);
  std::string z;
  put_u32(z, 0);
  CHECK(check_header(z, len) == parse_result::invalid);
  std::string over;
  put_u32(over, store_max_frame + 1);
  CHECK(check_header(over, len) == parse_result::invalid);
}

TEST_CASE("a field that claims more bytes than the frame holds is invalid") {
  std::string body;
  body.push_back(static_cast<char>(store_cmd::set));
  put_u32(body, 1000);
  body += "short";
  frame out;
  CHECK(parse_body(body, out) == parse_result::invalid);
  std::string trunc;
  trunc.push_back(static_cast<char>(store_cmd::set));
  trunc += "ab";  // not even a whole length
  CHECK(parse_body(trunc, out) == parse_result::invalid);
}

TEST_CASE("requests with the wrong shape are not valid") {
  frame f;
  f.code = static_cast<std::uint8_t>(store_cmd::set);
  f.fields = {"only-key"};
  CHECK_FALSE(valid_request(f));
  f.code = static_cast<std::uint8_t>(store_cmd::add);
  f.fields = {"k", "123"};  // delta must be 8 bytes
  CHECK_FALSE(valid_request(f));
  f.fields = {"k", encode_i64(-5)};
  CHECK(valid_request(f));
  f.code = 99;
  CHECK_FALSE(valid_request(f));
  f.code = static_cast<std::uint8_t>(store_cmd::get);
  f.fields = {std::string(store_max_key + 1, 'k'), encode_ms(10)};
  CHECK_FALSE(valid_request(f));
}

TEST_CASE("i64 encoding is little endian and round-trips negatives") {
  for (std::int64_t v : std::initializer_list<std::int64_t>{0, 1, -1, 123456789012345, INT64_MIN, INT64_MAX}) CHECK(decode_i64(encode_i64(v)) == v);
  CHECK(encode_i64(1)[0] == '\x01');
}

TEST_CASE("writes, claims and waited keys, as the server's membership and parked requests see them") {
  auto parsed = [](const std::string& bytes) {
    frame f;
    REQUIRE(parse_body(std::string_view(bytes).substr(4), f) == parse_result::ok);
    REQUIRE(valid_request(f));
    return f;
  };
  const auto ms = encode_ms(10);
  for (auto c : {store_cmd::set, store_cmd::add, store_cmd::cas, store_cmd::del})
    CHECK(is_write(static_cast<std::uint8_t>(c)));
  for (auto c : {store_cmd::get, store_cmd::check, store_cmd::wait}) CHECK_FALSE(is_write(static_cast<std::uint8_t>(c)));
  const auto claim = parsed(encode_frame(static_cast<std::uint8_t>(store_cmd::cas), {"pg/rank/3", "", "token"}));
  CHECK(is_claim(claim, "pg/rank/"));
  CHECK_FALSE(is_claim(claim, ""));             // no members: nothing is a claim
  CHECK_FALSE(is_claim(claim, "pg/rank/3/x"));  // another prefix
  CHECK_FALSE(is_claim(parsed(encode_frame(static_cast<std::uint8_t>(store_cmd::cas), {"pg/rank/3", "old", "t"})),
                       "pg/rank/"));  // not from the empty value
  CHECK_FALSE(is_claim(parsed(encode_frame(static_cast<std::uint8_t>(store_cmd::cas), {"pg/abort", "", "t"})),
                       "pg/rank/"));
  CHECK_FALSE(is_claim(parsed(encode_frame(static_cast<std::uint8_t>(store_cmd::set), {"pg/rank/3", ""})), "pg/rank/"));
  // With a number of seats, only a seat is a claim: a stranger cannot join by claiming a key
  // no rank owns, once every real seat is taken.
  auto seat = [&](const char* key) {
    return parsed(encode_frame(static_cast<std::uint8_t>(store_cmd::cas), {key, "", "t"}));
  };
  CHECK(is_claim(seat("pg/rank/0"), "pg/rank/", 4));
  CHECK(is_claim(seat("pg/rank/3"), "pg/rank/", 4));
  for (const char* k : {"pg/rank/4", "pg/rank/999999", "pg/rank/03", "pg/rank/", "pg/rank/-1", "pg/rank/+1",
                        "pg/rank/1x", "pg/rank/3/aux", "pg/rank/99999999999999999999"}) {
    CAPTURE(k);
    CHECK_FALSE(is_claim(seat(k), "pg/rank/", 4));
  }
  CHECK(is_claim(seat("pg/rank/999999"), "pg/rank/"));  // no count: any key under the prefix
  // Without a count (an elastic group's store), a claim under a namespace ("el3/": a
  // generation) counts too; with one, a namespace cannot add seats.
  CHECK(is_claim(seat("el3/pg/rank/0"), "pg/rank/"));
  CHECK_FALSE(is_claim(seat("el3/pg/rank/0"), "pg/rank/", 4));
  CHECK_FALSE(is_claim(seat("el3pg/rank/0"), "pg/rank/"));
  CHECK_FALSE(is_claim(seat("el3/pg/abort"), "pg/rank/"));
  CHECK(waited_keys(parsed(encode_frame(static_cast<std::uint8_t>(store_cmd::get), {"k", ms}))) == 1);
  CHECK(waited_keys(parsed(encode_frame(static_cast<std::uint8_t>(store_cmd::wait), {"a", "b", "c", ms}))) == 3);
  CHECK(static_cast<int>(store_status::forbidden) == 6);
  CHECK(store_last_status == 6);
}

// The wire formats are fixed: these bytes are what every released peer sends and expects.
TEST_CASE("a store frame and an auth hello keep their exact bytes") {
  using namespace std::string_view_literals;
  CHECK(encode_frame(static_cast<std::uint8_t>(store_cmd::set), {"k", "vv"}) ==
        "\x0c\0\0\0\x01\x01\0\0\0k\x02\0\0\0vv"sv);
  CHECK(encode_i64(-2) == "\xfe\xff\xff\xff\xff\xff\xff\xff"sv);
  auth_hello h;
  h.kind = auth_kind::mesh;
  h.from = 1;
  h.to = 0x02030405;
  h.size = 3;
  h.group = 0x1122334455667788ull;
  for (std::size_t i = 0; i < h.nonce.size(); ++i) h.nonce[i] = static_cast<std::byte>(i + 1);
  const std::string e = encode_hello(h);
  std::string want = "DDPA\x01\x02\0\0\x01\0\0\0\x05\x04\x03\x02\x03\0\0\0\0\0\0\0"
                     "\x88\x77\x66\x55\x44\x33\x22\x11"s;
  for (int i = 1; i <= 32; ++i) want.push_back(static_cast<char>(i));
  CHECK(e == want);
  auth_hello back;
  REQUIRE(decode_hello(e, back));
  CHECK(back.kind == auth_kind::mesh);
  CHECK(back.from == 1);
  CHECK(back.to == 0x02030405u);
  CHECK(back.size == 3);
  CHECK(back.group == 0x1122334455667788ull);
  CHECK(back.nonce == h.nonce);
  for (std::size_t at : {std::size_t{6}, std::size_t{7}, std::size_t{20}, std::size_t{23}}) {
    std::string bad = e;
    bad[at] = 1;  // a reserved byte set
    CHECK_FALSE(decode_hello(bad, back));
  }
  CHECK_FALSE(decode_hello(std::string_view(e).substr(0, e.size() - 1), back));
  std::string other_kind = e;
  other_kind[5] = 9;
  CHECK_FALSE(decode_hello(other_kind, back));
  CHECK(encode_status(auth_status::refused, auth_verdict_size) == "DDPA\x02\0\0\0"sv);
}

TEST_CASE("byte_writer writes little endian and length-prefixed strings") {
  std::string s;
  byte_writer(s).u8(0xab).u32(0x01020304).u64(0x0102030405060708ull).i64(-1).str("hi").zeros(2).raw("xy");
  const std::string want = std::string("\xab\x04\x03\x02\x01\x08\x07\x06\x05\x04\x03\x02\x01", 13) +
                           std::string(8, '\xff') + std::string("\x02\0\0\0hi\0\0xy", 10);
  CHECK(s == want);
  byte_reader r(s);
  CHECK(r.u8() == 0xab);
  CHECK(r.u32() == 0x01020304u);
  CHECK(r.u64() == 0x0102030405060708ull);
  CHECK(r.i64() == -1);
  CHECK(r.str() == "hi");
  r.zeros(2);
  CHECK(r.raw(2) == "xy");
  CHECK(r.ok());
  CHECK(r.done());
}

TEST_CASE("byte_reader fails cleanly on a short or lying input, and stays failed") {
  const std::string three("\x01\x02\x03", 3);
  byte_reader r(three);
  CHECK(r.u32() == 0);  // 3 bytes left: fails, reads nothing
  CHECK_FALSE(r.ok());
  CHECK(r.u8() == 0);  // stays failed although a byte is there
  CHECK(r.remaining() == 0);
  CHECK_FALSE(r.done());

  std::string lie;
  byte_writer(lie).u32(1000).raw("short");  // claims 1000 bytes, holds 5
  byte_reader l(lie);
  CHECK(l.str().empty());
  CHECK_FALSE(l.ok());

  std::string big;
  byte_writer(big).str("12345");
  byte_reader lim(big);
  CHECK(lim.str(4).empty());  // over the caller's limit
  CHECK_FALSE(lim.ok());
  byte_reader fits(big);
  CHECK(fits.str(5) == "12345");
  CHECK(fits.done());

  const std::string nz("\0\x01", 2);
  byte_reader z(nz);
  z.zeros(2);
  CHECK_FALSE(z.ok());

  std::array<std::byte, 4> out{std::byte{9}, std::byte{9}, std::byte{9}, std::byte{9}};
  byte_reader two(std::string_view("ab"));
  two.raw(out);  // 2 bytes for 4: zeroed, failed
  CHECK_FALSE(two.ok());
  CHECK(out == std::array<std::byte, 4>{});

  byte_reader partial(std::string_view("abc"));
  CHECK(partial.raw(2) == "ab");
  CHECK(partial.ok());
  CHECK_FALSE(partial.done());  // a byte left over
  CHECK(partial.remaining() == 1);
}
