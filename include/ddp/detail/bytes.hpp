#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The one byte encoder of ddp's wire formats (store frames, the authentication handshake, the
// wrapper's parameter signatures): little-endian integers, raw bytes and u32-length-prefixed
// strings appended to a std::string, and a reader that checks every read against what is left.
//
//   std::string s;
//   byte_writer w(s);
//   w.u32(7).u64(n).str("key");
//
//   byte_reader r(s);
//   const auto a = r.u32(); const auto b = r.u64(); const auto k = r.str();
//   if (!r.ok()) ...  // a short or malformed input: every read past the end yields 0 or empty
//
// A failed read never touches memory beyond the input and never allocates from a length the
// input claims; the reader stays failed, so a decoder checks ok() once at the end.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Appends `v` to `out` as 4 little-endian bytes.
inline void put_u32(std::string& out, std::uint32_t v) {
  const char b[4] = {static_cast<char>(v), static_cast<char>(v >> 8), static_cast<char>(v >> 16),
                     static_cast<char>(v >> 24)};
  out.append(b, 4);
}
/// Appends `v` to `out` as 8 little-endian bytes.
inline void put_u64(std::string& out, std::uint64_t v) {
  put_u32(out, static_cast<std::uint32_t>(v));
  put_u32(out, static_cast<std::uint32_t>(v >> 32));
}
/// Appends raw bytes.
inline void put_bytes(std::string& out, std::span<const std::byte> b) {
  out.append(reinterpret_cast<const char*>(b.data()), b.size());
}

/// Reads 4 little-endian bytes at `p`; the caller has checked that they are there.
inline std::uint32_t get_u32(const char* p) noexcept {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return static_cast<std::uint32_t>(u[0]) | static_cast<std::uint32_t>(u[1]) << 8 |
         static_cast<std::uint32_t>(u[2]) << 16 | static_cast<std::uint32_t>(u[3]) << 24;
}
/// Reads 8 little-endian bytes at `p`; the caller has checked that they are there.
inline std::uint64_t get_u64(const char* p) noexcept {
  return static_cast<std::uint64_t>(get_u32(p)) | static_cast<std::uint64_t>(get_u32(p + 4)) << 32;
}

/// The bytes of a string, for MACs and put_bytes.
inline std::span<const std::byte> bytes_of(std::string_view s) noexcept {
  return std::as_bytes(std::span(s.data(), s.size()));
}

/// A signed 64-bit number as its 8 little-endian bytes (two's complement).
inline std::string encode_i64(std::int64_t v) {
  std::string s;
  s.reserve(8);
  put_u64(s, static_cast<std::uint64_t>(v));
  return s;
}
/// The inverse of encode_i64; a shorter input reads as if padded with zero bytes.
inline std::int64_t decode_i64(std::string_view s) noexcept {
  std::uint64_t u = 0;
  for (std::size_t i = 0; i < 8 && i < s.size(); ++i)
    u |= static_cast<std::uint64_t>(static_cast<unsigned char>(s[i])) << (8 * i);
  return static_cast<std::int64_t>(u);
}

/// Appends little-endian fields to a string it does not own.
class byte_writer {
 public:
  explicit byte_writer(std::string& out) noexcept : out_(&out) {}

  byte_writer& u8(std::uint8_t v) {
    out_->push_back(static_cast<char>(v));
    return *this;
  }
  byte_writer& u32(std::uint32_t v) {
    put_u32(*out_, v);
    return *this;
  }
  byte_writer& u64(std::uint64_t v) {
    put_u64(*out_, v);
    return *this;
  }
  byte_writer& i64(std::int64_t v) {
    put_u64(*out_, static_cast<std::uint64_t>(v));
    return *this;
  }
  /// `n` zero bytes (reserved or padding fields).
  byte_writer& zeros(std::size_t n) {
    out_->append(n, '\0');
    return *this;
  }
  /// Bytes as they are, without a length (fixed-size fields).
  byte_writer& raw(std::string_view s) {
    out_->append(s.data(), s.size());
    return *this;
  }
  byte_writer& raw(std::span<const std::byte> b) {
    put_bytes(*out_, b);
    return *this;
  }
  /// A u32 length, then the bytes. The caller keeps `s` below 4 GiB (the formats' limits are far lower).
  byte_writer& str(std::string_view s) {
    put_u32(*out_, static_cast<std::uint32_t>(s.size()));
    return raw(s);
  }

  std::size_t size() const noexcept { return out_->size(); }

 private:
  std::string* out_;
};

/// Reads little-endian fields from the front of a byte string, checking each against what is
/// left. The first read that does not fit fails the reader: it and every later read return
/// 0 (or an empty view) and ok() turns false, so a decoder reads everything, then checks once.
class byte_reader {
 public:
  explicit byte_reader(std::string_view in) noexcept : in_(in) {}

  std::uint8_t u8() noexcept {
    const char* p = take(1);
    return p ? static_cast<std::uint8_t>(*p) : 0;
  }
  std::uint32_t u32() noexcept {
    const char* p = take(4);
    return p ? get_u32(p) : 0;
  }
  std::uint64_t u64() noexcept {
    const char* p = take(8);
    return p ? get_u64(p) : 0;
  }
  std::int64_t i64() noexcept { return static_cast<std::int64_t>(u64()); }
  /// The next `n` bytes as they are (a view into the input).
  std::string_view raw(std::size_t n) noexcept {
    const char* p = take(n);
    return p ? std::string_view(p, n) : std::string_view();
  }
  /// Copies the next out.size() bytes into `out` (zeros it when they are not there).
  void raw(std::span<std::byte> out) noexcept {
    if (out.empty()) return;
    const char* p = take(out.size());
    if (p)
      std::memcpy(out.data(), p, out.size());
    else
      std::memset(out.data(), 0, out.size());
  }
  /// A u32 length, then that many bytes; fails when the length passes `limit` or the end.
  std::string_view str(std::size_t limit = SIZE_MAX) noexcept {
    const std::uint32_t n = u32();
    if (n > limit) {
      fail();
      return {};
    }
    return raw(n);
  }
  /// Skips `n` bytes that must all be zero (reserved fields); fails otherwise.
  void zeros(std::size_t n) noexcept {
    for (char c : raw(n))
      if (c != 0) fail();
  }

  /// False once a read did not fit (or a check failed); stays false.
  bool ok() const noexcept { return ok_; }
  /// Bytes not read yet (0 once failed): a bound for counts read from the input.
  std::size_t remaining() const noexcept { return ok_ ? in_.size() - pos_ : 0; }
  /// True when everything was read and nothing failed.
  bool done() const noexcept { return ok_ && pos_ == in_.size(); }
  /// Marks the input malformed (a decoder's own check failed).
  void fail() noexcept { ok_ = false; }

 private:
  const char* take(std::size_t n) noexcept {
    if (!ok_ || n > in_.size() - pos_) {
      ok_ = false;
      return nullptr;
    }
    const char* p = in_.data() + pos_;
    pos_ += n;
    return p;
  }

  std::string_view in_;
  std::size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
