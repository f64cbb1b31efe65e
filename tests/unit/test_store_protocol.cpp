#include <ddp/detail/store_protocol.hpp>

#include <doctest/doctest.h>

using namespace ddp::detail;

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
  CHECK(waited_keys(parsed(encode_frame(static_cast<std::uint8_t>(store_cmd::get), {"k", ms}))) == 1);
  CHECK(waited_keys(parsed(encode_frame(static_cast<std::uint8_t>(store_cmd::wait), {"a", "b", "c", ms}))) == 3);
  CHECK(static_cast<int>(store_status::forbidden) == 6);
  CHECK(store_last_status == 6);
}
