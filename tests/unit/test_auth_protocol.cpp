#include <ddp/auth/sodium.hpp>

#include <ddp/group/detail/handshake.hpp>

#include <doctest/doctest.h>

#include <array>
#include <string>

using namespace ddp::detail;

namespace {
const auto key = ddp::sodium_authenticator::make("unit-test-secret");
const auto other_key = ddp::sodium_authenticator::make("another-secret");
auto admit_all = [](const auth_hello&) { return true; };

auth_hello mesh_hello_from(std::uint32_t from) {
  auth_hello h;
  h.kind = auth_kind::mesh;
  h.from = from;
  h.to = 0;
  h.size = 4;
  h.group = 0x0123456789abcdefull;
  key->random(h.nonce);
  return h;
}

/// The initiator's proof for a challenge, computed with `a`.
std::string proof_for(const ddp::authenticator& a, const std::string& hello, const std::string& challenge) {
  std::array<std::byte, 32> tag;
  a.mac(bytes_of(auth_transcript('I', hello, bytes_of(std::string_view(challenge).substr(8, 32)))), tag);
  std::string p;
  put_u32(p, auth_magic);
  put_u32(p, 0);
  put_bytes(p, tag);
  return p;
}
}  // namespace

// Including <ddp/auth/sodium.hpp> installs nothing: libsodium is the program's explicit choice.
TEST_CASE("the libsodium authenticator is used only once the program installs it") {
  REQUIRE_FALSE(ddp::authentication_available());
  try {
    (void)ddp::make_authenticator("unit-test-secret", 3);
    FAIL("a secret was accepted with no authenticator installed");
  } catch (const ddp::error& e) {
    CHECK(e.condition() == ddp::errc::unsupported);
    CHECK(e.rank() == 3);
    CHECK(std::string(e.what()).find("ddp::install_authenticator(&ddp::sodium_authenticator::make)") !=
          std::string::npos);
  }
  CHECK((ddp::install_authenticator(&ddp::sodium_authenticator::make) == nullptr));
  CHECK(ddp::authentication_available());
  CHECK(ddp::make_authenticator("unit-test-secret", 0)->algorithm() == "HMAC-SHA-512-256 (libsodium)");
  CHECK((ddp::install_authenticator(nullptr) == &ddp::sodium_authenticator::make));
}

TEST_CASE("sodium authenticator: MACs depend on the secret and the message, verify is exact") {
  CHECK(key->algorithm().find("libsodium") != std::string_view::npos);
  const std::string msg = "message";
  std::array<std::byte, 32> a, b, c;
  key->mac(bytes_of(msg), a);
  key->mac(bytes_of(msg), b);
  other_key->mac(bytes_of(msg), c);
  CHECK(a == b);
  CHECK(a != c);
  CHECK(key->verify(bytes_of(msg), a));
  CHECK_FALSE(other_key->verify(bytes_of(msg), a));
  CHECK_FALSE(key->verify(bytes_of(std::string("messagf")), a));
  a[31] ^= std::byte{1};
  CHECK_FALSE(key->verify(bytes_of(msg), a));
  std::array<std::byte, 32> n1{}, n2{};
  key->random(n1);
  key->random(n2);
  CHECK(n1 != n2);
}

TEST_CASE("hello round-trips and malformed hellos are rejected") {
  const auto h = mesh_hello_from(3);
  const auto s = encode_hello(h);
  REQUIRE(s.size() == auth_hello_size);
  auth_hello back;
  REQUIRE(decode_hello(s, back));
  CHECK(back.kind == h.kind);
  CHECK(back.from == 3);
  CHECK(back.size == 4);
  CHECK(back.group == h.group);
  CHECK(back.nonce == h.nonce);
  for (std::size_t i : {0u, 4u, 5u, 6u, 20u}) {
    auto bad = s;
    bad[i] = static_cast<char>(bad[i] ^ 0x55);
    CHECK_FALSE(decode_hello(bad, back));
  }
  CHECK_FALSE(decode_hello(s.substr(0, 63), back));
  // As a store frame length, the magic is over the limit: no confusion with a request.
  std::uint32_t len = 0;
  CHECK(check_header(s, len) == parse_result::invalid);
}

TEST_CASE("responder: a full exchange fed one byte at a time succeeds") {
  auth_responder r(key.get(), auth_kind::mesh);
  const auto hello = encode_hello(mesh_hello_from(2));
  std::string in, out;
  for (char ch : hello) {
    CHECK(r.current() == auth_responder::state::hello);
    in.push_back(ch);
    r.feed(in, out, admit_all);
  }
  REQUIRE(r.current() == auth_responder::state::proof);
  REQUIRE(out.size() == auth_challenge_size);
  CHECK(static_cast<auth_status>(out[4]) == auth_status::challenge);
  // The responder's MAC verifies on the initiator's side.
  std::array<std::byte, 32> tag;
  std::memcpy(tag.data(), out.data() + 40, 32);
  CHECK(key->verify(bytes_of(auth_transcript('R', hello, bytes_of(std::string_view(out).substr(8, 32)))), tag));
  const auto proof = proof_for(*key, hello, out);
  out.clear();
  for (char ch : proof) {
    in.push_back(ch);
    r.feed(in, out, admit_all);
  }
  CHECK(r.current() == auth_responder::state::done);
  CHECK(in.empty());
  REQUIRE(out.size() == auth_verdict_size);
  CHECK(static_cast<auth_status>(out[4]) == auth_status::accepted);
  CHECK(r.hello().from == 2);
}

TEST_CASE("responder: wrong secret, replay, reflection, wrong kind and refusal by admit all fail") {
  const auto hello = encode_hello(mesh_hello_from(1));
  auto challenge = [&](auth_responder& r) {
    std::string in = hello, out;
    r.feed(in, out, admit_all);
    REQUIRE(r.current() == auth_responder::state::proof);
    return out;
  };
  auto finish = [&](auth_responder& r, const std::string& proof, auto&& admit) {
    std::string in = proof, out;
    r.feed(in, out, admit);
    return out;
  };
  {
    auth_responder r(key.get(), auth_kind::mesh);
    const auto c = challenge(r);
    const auto v = finish(r, proof_for(*other_key, hello, c), admit_all);
    CHECK(r.current() == auth_responder::state::failed);
    CHECK(static_cast<auth_status>(v[4]) == auth_status::refused);
  }
  std::string recorded;
  {
    auth_responder r(key.get(), auth_kind::mesh);
    recorded = proof_for(*key, hello, challenge(r));
    finish(r, recorded, admit_all);
    CHECK(r.current() == auth_responder::state::done);
  }
  {
    auth_responder r(key.get(), auth_kind::mesh);
    challenge(r);  // a fresh nonce: the recorded proof no longer fits
    finish(r, recorded, admit_all);
    CHECK(r.current() == auth_responder::state::failed);
  }
  {
    auth_responder r(key.get(), auth_kind::mesh);
    const auto c = challenge(r);
    std::string reflected;
    put_u32(reflected, auth_magic);
    put_u32(reflected, 0);
    reflected += c.substr(40, 32);
    finish(r, reflected, admit_all);
    CHECK(r.current() == auth_responder::state::failed);
  }
  {
    auth_responder r(key.get(), auth_kind::mesh);
    const auto c = challenge(r);
    const auto v = finish(r, proof_for(*key, hello, c), [](const auth_hello&) { return false; });
    CHECK(r.current() == auth_responder::state::failed);
    CHECK(static_cast<auth_status>(v[4]) == auth_status::not_expected);
  }
  {
    auth_responder r(key.get(), auth_kind::store);
    std::string in = hello, out;
    r.feed(in, out, admit_all);
    CHECK(r.current() == auth_responder::state::failed);
    CHECK(static_cast<auth_status>(out[4]) == auth_status::refused);
  }
}

TEST_CASE("responder: a plain request is foreign, and a side without a secret answers no_auth") {
  {
    auth_responder r(key.get(), auth_kind::store);
    std::string in = encode_frame(static_cast<std::uint8_t>(store_cmd::get), {"k", encode_ms(10)}), out;
    r.feed(in, out, admit_all);
    CHECK(r.current() == auth_responder::state::foreign);
    CHECK(out.empty());
  }
  {
    auth_responder r(nullptr, auth_kind::store);
    std::string in = encode_hello(mesh_hello_from(1)), out;
    r.feed(in, out, admit_all);
    CHECK(r.current() == auth_responder::state::failed);
    REQUIRE(out.size() == auth_challenge_size);
    CHECK(static_cast<auth_status>(out[4]) == auth_status::no_auth);
  }
}
