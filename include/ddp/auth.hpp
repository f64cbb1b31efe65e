#pragma once
/// \file auth.hpp
/// Shared-secret authentication, the part with no dependency: the `ddp::authenticator`
/// interface that computes and checks message authentication codes under one secret, and the
/// process-wide slot through which the program chooses an implementation. The core never
/// implements cryptography; an implementation comes from its own header, and the program
/// installs it explicitly (including a header installs nothing):
///
/// \code
/// #include <ddp/auth/sodium.hpp>   // link -lsodium
/// ddp::install_authenticator(&ddp::sodium_authenticator::make);
/// auto pg = ddp::init_process_group({.rank = r, .world_size = n, .auth_token = secret});
/// \endcode
///
/// With a token set (`init_options::auth_token` or `DDP_AUTH_TOKEN`), every store and mesh
/// connection starts with a mutual challenge-response (docs/security.md). A token given to a
/// program with no authenticator installed is `errc::unsupported`, never ignored.

#include <atomic>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include <ddp/version.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Message authentication under one shared secret. Implementations must be usable from
/// several threads at once (the store server and the mesh may handshake concurrently).
class authenticator {
 public:
  static constexpr std::size_t mac_size = 32;    ///< bytes of one MAC
  static constexpr std::size_t nonce_size = 32;  ///< bytes of one handshake nonce

  virtual ~authenticator() = default;

  /// Writes the MAC of `message` under the secret into `out`.
  virtual void mac(std::span<const std::byte> message, std::span<std::byte, mac_size> out) const = 0;

  /// True when `tag` is the MAC of `message`; must compare in constant time.
  virtual bool verify(std::span<const std::byte> message, std::span<const std::byte, mac_size> tag) const = 0;

  /// Fills `out` from a cryptographically secure random source (handshake nonces).
  virtual void random(std::span<std::byte> out) const = 0;

  /// Names the algorithm for messages, e.g. "HMAC-SHA-512-256 (libsodium)".
  virtual std::string_view algorithm() const noexcept = 0;
};

/// Makes an authenticator for a secret; may throw `ddp::error`.
using authenticator_factory = std::shared_ptr<const authenticator> (*)(std::string_view secret);

/// The process-wide factory slot; null until the program installs one.
inline std::atomic<authenticator_factory>& authenticator_slot() noexcept {
  static std::atomic<authenticator_factory> slot{nullptr};
  return slot;
}

/// Installs `f` as the process-wide authenticator factory and returns the previous one. Call
/// it before the first group or store that uses a token, with libsodium's factory or your own.
///
/// \code
/// ddp::install_authenticator(&ddp::sodium_authenticator::make);  // <ddp/auth/sodium.hpp>
/// ddp::install_authenticator(&my_hsm_authenticator::make);        // or another implementation
/// \endcode
inline authenticator_factory install_authenticator(authenticator_factory f) noexcept {
  return authenticator_slot().exchange(f);
}

/// True when an authenticator factory is installed in this process.
inline bool authentication_available() noexcept { return authenticator_slot().load() != nullptr; }

/// The authenticator for `secret` from the installed factory. Throws `errc::unsupported`
/// (naming `rank`) when none is installed: a secret must never be silently ignored.
///
/// \code
/// auto auth = ddp::make_authenticator("s3cret", 0);
/// ddp::store_server server{ep, 0, auth};
/// \endcode
inline std::shared_ptr<const authenticator> make_authenticator(std::string_view secret, int rank) {
  if (secret.empty()) detail::raise(errc::invalid_argument, rank, "the auth token is empty");
  const auto f = authenticator_slot().load();
  if (f == nullptr)
    detail::raise(errc::unsupported, rank,
                  "an auth token was given but this program has no authenticator: call "
                  "ddp::install_authenticator(&ddp::sodium_authenticator::make) (from "
                  "<ddp/auth/sodium.hpp>, link libsodium: -lsodium) before creating the group or "
                  "store, or unset DDP_AUTH_TOKEN; refusing to run without authentication");
  auto a = f(secret);
  if (!a) detail::raise(errc::unsupported, rank, "the installed authenticator factory returned nothing");
  return a;
}

}  // namespace DDP_ABI
}  // namespace ddp
