#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The mutual challenge-response that opens every authenticated connection (store and mesh).
// All four messages have fixed sizes, so a reader knows how much to expect before it reads and
// nothing is allocated from a length a stranger sent:
//
//   initiator -> responder  hello     64 B  magic | version | kind | from | to | size | group | nonce_i
//   responder -> initiator  challenge 72 B  magic | status | nonce_r | MAC("R", hello, nonce_r)
//   initiator -> responder  proof     40 B  magic | MAC("I", hello, nonce_r)
//   responder -> initiator  verdict    8 B  magic | status
//
// Each side's MAC covers both fresh nonces and its own role letter, so a recorded exchange
// cannot be replayed (the responder's nonce is new each time) and a responder's MAC cannot be
// reflected back as an initiator's. The secret itself never crosses the wire; MACs are checked
// by the authenticator in constant time. The magic read as a store frame length is beyond
// store_max_frame, so a server can tell a handshake from a plain request by its first 4 bytes.

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include <ddp/auth.hpp>
#include <ddp/error.hpp>
#include <ddp/detail/bytes.hpp>
#include <ddp/detail/socket.hpp>
#include <ddp/group/detail/store_protocol.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

inline constexpr std::uint32_t auth_magic = 0x41504444u;  // "DDPA"
inline constexpr std::uint8_t auth_version = 1;
static_assert(auth_magic > store_max_frame, "a handshake must not parse as a store frame");

inline constexpr std::size_t auth_hello_size = 64;
inline constexpr std::size_t auth_challenge_size = 72;
inline constexpr std::size_t auth_proof_size = 40;
inline constexpr std::size_t auth_verdict_size = 8;

/// How long a responder gives one connection to finish its handshake before dropping it, so
/// that connections which stall mid-handshake cannot pile up.
inline constexpr std::chrono::seconds auth_handshake_limit{10};

enum class auth_kind : std::uint8_t { store = 1, mesh = 2 };
/// `not_expected`: the proof holds, but nothing here takes that connection (its channel closed,
/// or not open yet): the initiator treats it as a connection dropped, not as a wrong secret.
enum class auth_status : std::uint8_t { challenge = 0, no_auth = 1, refused = 2, accepted = 3, not_expected = 4 };

/// The initiator's hello: what it connects as, and its fresh nonce.
struct auth_hello {
  auth_kind kind = auth_kind::store;
  std::uint32_t from = 0;   ///< initiator's rank
  std::uint32_t to = 0;     ///< rank it means to reach
  std::uint32_t size = 0;   ///< group size (0 for the store)
  std::uint64_t group = 0;  ///< group id (0 for the store)
  std::array<std::byte, authenticator::nonce_size> nonce{};
};

inline std::string encode_hello(const auth_hello& h) {
  std::string out;
  out.reserve(auth_hello_size);
  byte_writer(out)
      .u32(auth_magic)
      .u8(auth_version)
      .u8(static_cast<std::uint8_t>(h.kind))
      .zeros(2)
      .u32(h.from)
      .u32(h.to)
      .u32(h.size)
      .zeros(4)
      .u64(h.group)
      .raw(h.nonce);
  return out;
}

/// Parses a hello; false unless magic, version, kind and the zero fields are right.
inline bool decode_hello(std::string_view s, auth_hello& h) {
  if (s.size() != auth_hello_size) return false;
  byte_reader r(s);
  auth_hello got;
  const bool head = r.u32() == auth_magic && r.u8() == auth_version;
  const auto kind = r.u8();
  r.zeros(2);
  got.from = r.u32();
  got.to = r.u32();
  got.size = r.u32();
  r.zeros(4);
  got.group = r.u64();
  r.raw(got.nonce);
  if (!head || !r.done()) return false;
  if (kind != static_cast<std::uint8_t>(auth_kind::store) && kind != static_cast<std::uint8_t>(auth_kind::mesh))
    return false;
  got.kind = static_cast<auth_kind>(kind);
  h = got;
  return true;
}

/// What each side MACs: a context string, its role letter, the whole hello, the responder's
/// nonce. The hello carries the initiator's nonce, kind, ranks and group, so all are covered.
inline std::string auth_transcript(char role, std::string_view hello, std::span<const std::byte> responder_nonce) {
  std::string t = "ddp-auth-v1";
  t.push_back(role);
  t.append(hello);
  put_bytes(t, responder_nonce);
  return t;
}

inline std::string encode_status(auth_status st, std::size_t total) {
  std::string out;
  out.reserve(total);
  byte_writer(out).u32(auth_magic).u8(static_cast<std::uint8_t>(st)).zeros(total - 5);
  return out;
}

/// The responder's side as a state machine driven by the bytes that arrive, so a poll loop can
/// run many handshakes at once and a stalled one delays nobody.
class auth_responder {
 public:
  enum class state {
    hello,    ///< waiting for the hello
    proof,    ///< challenge sent, waiting for the proof
    done,     ///< authenticated; the verdict is in `out`
    failed,   ///< refused; whatever should be said is in `out`; then close (input discarded)
    foreign,  ///< the first bytes are not a handshake, e.g. a client without a secret (discarded)
  };

  /// `auth` null: this side has no secret, and a hello is answered with `no_auth`.
  auth_responder(const authenticator* auth, auth_kind kind) noexcept : auth_(auth), kind_(kind) {}

  /// Consumes what it needs from the front of `in` and appends its replies to `out`.
  /// `admit(hello)` runs once the initiator has proven the secret, before the verdict.
  template <class Admit>
  state feed(std::string& in, std::string& out, Admit&& admit) {
    if (state_ == state::hello) {
      if (in.size() >= 4 && get_u32(in.data()) != auth_magic) return fail(in, state::foreign, "not a handshake");
      if (in.size() < auth_hello_size) return state_;
      hello_bytes_ = in.substr(0, auth_hello_size);
      in.erase(0, auth_hello_size);
      if (!decode_hello(hello_bytes_, hello_)) return fail(in, state::failed, "malformed hello");
      if (auth_ == nullptr) {
        out += encode_status(auth_status::no_auth, auth_challenge_size);
        return fail(in, state::failed, "peer expects authentication but this side has no secret");
      }
      if (hello_.kind != kind_) {
        out += encode_status(auth_status::refused, auth_challenge_size);
        return fail(in, state::failed, "hello for another kind of connection");
      }
      auth_->random(nonce_);
      std::array<std::byte, authenticator::mac_size> tag;
      auth_->mac(bytes_of(auth_transcript('R', hello_bytes_, nonce_)), tag);
      byte_writer(out)
          .u32(auth_magic)
          .u8(static_cast<std::uint8_t>(auth_status::challenge))
          .zeros(3)
          .raw(nonce_)
          .raw(tag);
      state_ = state::proof;
    }
    if (state_ == state::proof) {
      if (in.size() < auth_proof_size) return state_;
      const std::string p = in.substr(0, auth_proof_size);
      in.erase(0, auth_proof_size);
      byte_reader r(p);
      const bool head = r.u32() == auth_magic && r.u32() == 0;
      std::array<std::byte, authenticator::mac_size> tag;
      r.raw(tag);
      if (!head || !r.done() || !auth_->verify(bytes_of(auth_transcript('I', hello_bytes_, nonce_)), tag)) {
        out += encode_status(auth_status::refused, auth_verdict_size);
        return fail(in, state::failed, "wrong proof (no or another secret, or a replayed handshake)");
      }
      if (!admit(static_cast<const auth_hello&>(hello_))) {
        out += encode_status(auth_status::not_expected, auth_verdict_size);
        return fail(in, state::failed, "authenticated, but not expected here");
      }
      out += encode_status(auth_status::accepted, auth_verdict_size);
      state_ = state::done;
    }
    return state_;
  }

  state current() const noexcept { return state_; }
  const auth_hello& hello() const noexcept { return hello_; }
  /// Why the handshake failed, for logs and messages.
  const char* why() const noexcept { return why_; }

 private:
  // Whatever else a refused peer sent is meaningless: it is discarded, so the outcome does
  // not depend on how its bytes were split across reads.
  state fail(std::string& in, state s, const char* why) noexcept {
    in.clear();
    why_ = why;
    return state_ = s;
  }

  const authenticator* auth_;
  auth_kind kind_;
  state state_ = state::hello;
  const char* why_ = "";
  auth_hello hello_{};
  std::string hello_bytes_;
  std::array<std::byte, authenticator::nonce_size> nonce_{};
};

/// The initiator's side, blocking until `until`. `peer` names the other end in messages.
/// Throws auth_failed when either side's proof fails or the peer refuses, timeout or peer_lost
/// when the connection stalls or closes mid-handshake.
inline void auth_initiate(int fd, const authenticator& auth, auth_hello h, deadline_t until, int rank,
                          const std::string& peer) {
  auth.random(h.nonce);
  const std::string hello = encode_hello(h);
  std::error_code ec;
  auto io_fail = [&](const char* step) {
    raise(to_errc(ec) == errc::timeout ? errc::timeout : errc::peer_lost, rank,
          std::string("authentication with ") + peer + ": " + describe(ec) + " while " + step);
  };
  send_all(fd, hello.data(), hello.size(), until, ec);
  if (ec) io_fail("sending the hello");
  char c[auth_challenge_size];
  recv_all(fd, c, sizeof c, until, ec);
  if (ec) io_fail("waiting for the challenge");
  byte_reader cr(std::string_view(c, sizeof c));
  if (cr.u32() != auth_magic) raise(errc::auth_failed, rank, peer + " did not answer with a handshake");
  const auto st = static_cast<auth_status>(cr.u8());
  if (st == auth_status::no_auth)
    raise(errc::auth_failed, rank,
          peer +
              " does not use authentication but this process has an auth token; give every rank "
              "the same DDP_AUTH_TOKEN");
  if (st != auth_status::challenge) raise(errc::auth_failed, rank, peer + " refused the connection");
  std::array<std::byte, authenticator::nonce_size> nonce;
  std::array<std::byte, authenticator::mac_size> tag;
  cr.raw(3);  // reserved
  cr.raw(nonce);
  cr.raw(tag);
  if (!auth.verify(bytes_of(auth_transcript('R', hello, nonce)), tag))
    raise(errc::auth_failed, rank,
          peer +
              " could not prove it knows the group's secret (a different DDP_AUTH_TOKEN, or "
              "not a ddp peer); connection refused");
  std::array<std::byte, authenticator::mac_size> mine;
  auth.mac(bytes_of(auth_transcript('I', hello, nonce)), mine);
  std::string proof;
  byte_writer(proof).u32(auth_magic).u32(0).raw(mine);
  send_all(fd, proof.data(), proof.size(), until, ec);
  if (ec) io_fail("sending the proof");
  char v[auth_verdict_size];
  recv_all(fd, v, sizeof v, until, ec);
  if (ec) io_fail("waiting for the verdict");
  byte_reader vr(std::string_view(v, sizeof v));
  const bool magic = vr.u32() == auth_magic;
  const auto said = static_cast<auth_status>(vr.u8());
  if (magic && said == auth_status::not_expected)
    raise(errc::peer_lost, rank,
          peer +
              " took our proof of the secret but nothing there takes this connection (its transport closed, or "
              "has not opened yet)");
  if (!magic || said != auth_status::accepted)
    raise(errc::auth_failed, rank, peer + " refused our proof of the secret");
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
