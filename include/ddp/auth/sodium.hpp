#pragma once
/// \file sodium.hpp
/// The libsodium authenticator: HMAC-SHA-512-256 (`crypto_auth_hmacsha512256`) under a key
/// derived from the token with BLAKE2b, nonces from `randombytes_buf`, constant-time checks
/// from `crypto_auth_hmacsha512256_verify`. Including this header installs nothing: the program
/// chooses it with `ddp::install_authenticator(&ddp::sodium_authenticator::make)`, after which
/// a token in `init_options::auth_token` or `DDP_AUTH_TOKEN` turns authentication on. Link with
/// `-lsodium` (Meson: `dependency('libsodium')`). See docs/security.md.
///
/// \code
/// #include <ddp/auth/sodium.hpp>
/// #include <ddp/ddp.hpp>
/// ddp::install_authenticator(&ddp::sodium_authenticator::make);
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());  // DDP_AUTH_TOKEN=...
/// \endcode

#include <sodium.h>

#include <cstddef>
#include <memory>
#include <span>
#include <string_view>

#include <ddp/version.hpp>
#include <ddp/auth.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// `ddp::authenticator` over libsodium.
///
/// \code
/// auto a = ddp::sodium_authenticator::make("s3cret");
/// std::array<std::byte, 32> tag;
/// a->mac(std::as_bytes(std::span(msg)), tag);
/// \endcode
class sodium_authenticator final : public authenticator {
  static_assert(crypto_auth_hmacsha512256_BYTES == mac_size);
  static_assert(crypto_auth_hmacsha512256_KEYBYTES == 32);

 public:
  /// Derives the key from `secret`. Throws errc::system when libsodium cannot start.
  explicit sodium_authenticator(std::string_view secret) {
    if (::sodium_init() < 0) detail::raise(errc::system, -1, "libsodium failed to initialize (sodium_init)");
    // A fixed context string keeps this key apart from any other use of the same token.
    static constexpr char context[] = "ddp-auth-v1 key";
    crypto_generichash_state st;
    crypto_generichash_init(&st, nullptr, 0, sizeof key_);
    crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(context), sizeof context);
    crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(secret.data()), secret.size());
    crypto_generichash_final(&st, key_, sizeof key_);
    ::sodium_memzero(&st, sizeof st);
  }
  sodium_authenticator(const sodium_authenticator&) = delete;
  sodium_authenticator& operator=(const sodium_authenticator&) = delete;
  ~sodium_authenticator() override { ::sodium_memzero(key_, sizeof key_); }

  /// The factory that `install_authenticator` takes:
  /// `ddp::install_authenticator(&ddp::sodium_authenticator::make)`.
  static std::shared_ptr<const authenticator> make(std::string_view secret) {
    return std::make_shared<const sodium_authenticator>(secret);
  }

  void mac(std::span<const std::byte> message, std::span<std::byte, mac_size> out) const override {
    crypto_auth_hmacsha512256(reinterpret_cast<unsigned char*>(out.data()),
                              reinterpret_cast<const unsigned char*>(message.data()), message.size(), key_);
  }

  bool verify(std::span<const std::byte> message, std::span<const std::byte, mac_size> tag) const override {
    return crypto_auth_hmacsha512256_verify(reinterpret_cast<const unsigned char*>(tag.data()),
                                            reinterpret_cast<const unsigned char*>(message.data()), message.size(),
                                            key_) == 0;
  }

  void random(std::span<std::byte> out) const override { ::randombytes_buf(out.data(), out.size()); }

  std::string_view algorithm() const noexcept override { return "HMAC-SHA-512-256 (libsodium)"; }

 private:
  unsigned char key_[crypto_auth_hmacsha512256_KEYBYTES];
};

}  // namespace DDP_ABI
}  // namespace ddp
