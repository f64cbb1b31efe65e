// The responder's side of the challenge-response (detail::auth_responder, used by the store
// server and by the mesh) on arbitrary bytes, fed in arbitrary pieces.
// Properties: nothing crashes; the answers have the fixed sizes of the protocol; the verdict
// does not depend on how the bytes are cut; a stranger gets in only with the proof that
// needs the secret; an honest initiator gets in; and one tampered byte anywhere in its hello or
// proof gets it refused.
//
// Input: a mode byte (low 2 bits: stranger, honest initiator with one byte tampered, stranger
// to a responder without a secret, stranger on a mesh responder; the rest: the piece size),
// then the stranger's bytes, or for the honest mode a 2-byte offset and an xor mask.
//
// The authenticator here is a deterministic stand-in so that inputs replay exactly: it tells
// right tags from wrong ones, which is all the state machine needs; it is no cryptography.

#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/group/detail/handshake.hpp>

#include <algorithm>
#include <array>
#include <cstring>

#include "fuzz_common.hpp"

namespace {

using namespace ddp::detail;

class stand_in final : public ddp::authenticator {
 public:
  void mac(std::span<const std::byte> message, std::span<std::byte, mac_size> out) const override {
    std::uint64_t h[4] = {0x243f6a8885a308d3ull, 0x13198a2e03707344ull, 0xa4093822299f31d0ull, 0x082efa98ec4e6c89ull};
    for (std::size_t i = 0; i < message.size(); ++i) {
      auto& x = h[i % 4];
      x = (x ^ static_cast<std::uint8_t>(message[i])) * 0x100000001b3ull;
      x ^= x >> 29;
    }
    for (std::size_t i = 0; i < 4; ++i) h[i] ^= h[(i + 1) % 4] >> 17;
    std::memcpy(out.data(), h, mac_size);
  }
  bool verify(std::span<const std::byte> message, std::span<const std::byte, mac_size> tag) const override {
    std::array<std::byte, mac_size> want;
    mac(message, want);
    return std::memcmp(want.data(), tag.data(), mac_size) == 0;
  }
  void random(std::span<std::byte> out) const override {
    for (auto& b : out) b = static_cast<std::byte>(next_++ * 0x9e + 0x37);
  }
  std::string_view algorithm() const noexcept override { return "fuzz stand-in"; }

 private:
  mutable std::uint8_t next_ = 0;
};

struct outcome {
  auth_responder::state st;
  std::string out;
  std::string rest;  ///< bytes the responder left unread, fed to it or not
  int admitted = 0;
};

/// Feeds `bytes` to a fresh responder (with a fresh stand-in, so its nonces are the same each
/// time, or with no secret) `piece` bytes at a time (0: all at once), as a poll loop would,
/// stopping when the handshake is over.
outcome respond(bool with_secret, auth_kind kind, std::string_view bytes, std::size_t piece) {
  stand_in auth;
  auth_responder r(with_secret ? &auth : nullptr, kind);
  outcome o{auth_responder::state::hello, {}, {}, 0};
  auto admit = [&](const auth_hello&) { return ++o.admitted, true; };
  std::string in;
  std::size_t pos = 0;
  for (;;) {
    const std::size_t k = piece == 0 ? bytes.size() - pos : std::min(piece, bytes.size() - pos);
    in.append(bytes.substr(pos, k));
    pos += k;
    o.st = r.feed(in, o.out, admit);
    if (o.st != auth_responder::state::hello && o.st != auth_responder::state::proof) break;
    if (pos == bytes.size()) break;
  }
  o.rest = in + std::string(bytes.substr(pos));
  return o;
}

bool sizes_fit(const outcome& o) {
  switch (o.st) {
    case auth_responder::state::hello:
    case auth_responder::state::foreign: return o.out.empty();
    case auth_responder::state::proof: return o.out.size() == auth_challenge_size;
    case auth_responder::state::done: return o.out.size() == auth_challenge_size + auth_verdict_size;
    case auth_responder::state::failed:
      return o.out.empty() || o.out.size() == auth_challenge_size ||
             o.out.size() == auth_challenge_size + auth_verdict_size;
  }
  return false;
}

/// The proof only a holder of the secret can make for `hello` and the challenge in `out`.
std::string proof_for(const ddp::authenticator& auth, std::string_view hello, std::string_view out) {
  std::array<std::byte, ddp::authenticator::nonce_size> nonce;
  std::memcpy(nonce.data(), out.data() + 8, nonce.size());
  std::array<std::byte, ddp::authenticator::mac_size> tag;
  auth.mac(bytes_of(auth_transcript('I', hello, nonce)), tag);
  std::string p;
  put_u32(p, auth_magic);
  put_u32(p, 0);
  put_bytes(p, tag);
  return p;
}

void stranger(bool with_secret, auth_kind kind, std::string_view bytes, std::size_t piece) {
  const auto whole = respond(with_secret, kind, bytes, 0);
  const auto cut = respond(with_secret, kind, bytes, piece);
  // A refused peer's bytes are discarded, so what is left over only counts while it may go on.
  const bool goes_on = whole.st != auth_responder::state::failed && whole.st != auth_responder::state::foreign;
  ddp_fuzz::require(whole.st == cut.st && whole.out == cut.out && (!goes_on || whole.rest == cut.rest) &&
                        whole.admitted == cut.admitted,
                    "verdict depends on how the bytes are cut");
  ddp_fuzz::require(sizes_fit(whole), "answer sizes do not fit the protocol");
  ddp_fuzz::require(whole.admitted == (whole.st == auth_responder::state::done ? 1 : 0), "admit ran out of turn");
  if (whole.st == auth_responder::state::done) {
    // Possible only with the right proof: the one computed with the secret.
    ddp_fuzz::require(with_secret, "a responder without a secret completed a handshake");
    stand_in fresh;  // same secret, same nonces as the responder's
    auth_responder probe(&fresh, kind);
    std::string in(bytes.substr(0, auth_hello_size)), out;
    (void)probe.feed(in, out, [](const auth_hello&) { return true; });
    const auto want = proof_for(fresh, bytes.substr(0, auth_hello_size), out);
    ddp_fuzz::require(bytes.substr(auth_hello_size, auth_proof_size) == want, "stranger got in without the proof");
  }
}

void honest(auth_kind kind, std::size_t offset, std::uint8_t mask, std::size_t piece) {
  stand_in initiator;  // holds the secret; its nonces differ from the responder's
  for (int i = 0; i < 7; ++i) {
    std::array<std::byte, 1> skip;
    initiator.random(skip);
  }
  auth_hello h;
  h.kind = kind;
  h.from = 3;
  h.to = 1;
  h.size = 4;
  h.group = 0x5eed;
  initiator.random(h.nonce);
  const std::string hello = encode_hello(h);
  std::string sent = hello;
  const bool tamper_hello = mask != 0 && offset < auth_hello_size;
  if (tamper_hello) sent[offset] = static_cast<char>(sent[offset] ^ mask);

  stand_in responder_auth;
  auth_responder r(&responder_auth, kind);
  std::string in, out;
  int admitted = 0;
  auto admit = [&](const auth_hello&) { return ++admitted, true; };
  auto st = auth_responder::state::hello;
  for (std::size_t pos = 0; pos < sent.size() && st == auth_responder::state::hello; pos += piece) {
    in.append(sent.substr(pos, piece));
    st = r.feed(in, out, admit);
  }
  if (st == auth_responder::state::proof) {
    // The challenge must prove the responder's secret over exactly our hello.
    std::array<std::byte, ddp::authenticator::nonce_size> nonce;
    std::array<std::byte, ddp::authenticator::mac_size> tag;
    std::memcpy(nonce.data(), out.data() + 8, nonce.size());
    std::memcpy(tag.data(), out.data() + 8 + nonce.size(), tag.size());
    const bool challenge_ok = initiator.verify(bytes_of(auth_transcript('R', hello, nonce)), tag);
    ddp_fuzz::require(challenge_ok != tamper_hello, "challenge does not match the hello");
    std::string proof = proof_for(initiator, hello, out);
    const bool tamper_proof = mask != 0 && offset >= auth_hello_size && offset < auth_hello_size + auth_proof_size;
    if (tamper_proof) proof[offset - auth_hello_size] = static_cast<char>(proof[offset - auth_hello_size] ^ mask);
    for (std::size_t pos = 0; pos < proof.size() && st == auth_responder::state::proof; pos += piece) {
      in.append(proof.substr(pos, piece));
      st = r.feed(in, out, admit);
    }
    const bool tampered = tamper_hello || tamper_proof;
    ddp_fuzz::require((st == auth_responder::state::done) == !tampered, "tampering went unnoticed, or honesty failed");
  } else {
    ddp_fuzz::require(tamper_hello && (st == auth_responder::state::failed || st == auth_responder::state::foreign),
                      "honest hello not challenged");
  }
  ddp_fuzz::require(admitted == (st == auth_responder::state::done ? 1 : 0), "admit ran out of turn");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  ddp_fuzz::reader in(data, size);
  const std::uint8_t mode = in.byte();
  const std::size_t piece = 1 + (mode >> 2);  // 1..64 bytes per read
  switch (mode & 3) {
    case 0: stranger(true, auth_kind::store, in.rest(), piece); break;
    case 1: {
      const std::size_t offset = in.byte() | static_cast<std::size_t>(in.byte()) << 8;
      honest(auth_kind::mesh, offset % (auth_hello_size + auth_proof_size + 8), in.byte(), piece);
      break;
    }
    case 2: stranger(false, auth_kind::store, in.rest(), piece); break;
    default: stranger(true, auth_kind::mesh, in.rest(), piece); break;
  }
  return 0;
}
