#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The little JSON that ddp writes (timeline traces): strings escaped so that any name a user
// gives a parameter (quotes, backslashes, control characters, any bytes) still yields valid JSON,
// and exact fixed-point numbers (nanoseconds printed as microseconds, no floating point).

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Length of the well-formed UTF-8 sequence at s[i] (1 to 4), or 0 when the bytes there are not
/// one (a stray continuation byte, a truncated sequence, an overlong form, a surrogate, or a code
/// point above U+10FFFF): JSON text must be UTF-8, so such bytes are replaced, not copied.
inline std::size_t utf8_sequence(std::string_view s, std::size_t i) noexcept {
  const auto at = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned c = at(i);
  if (c < 0x80) return 1;
  std::size_t n = 0;
  unsigned lo = 0x80, hi = 0xbf;  // range of the second byte
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    if (c == 0xe0) lo = 0xa0;  // overlong
    if (c == 0xed) hi = 0x9f;  // surrogates
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    if (c == 0xf0) lo = 0x90;  // overlong
    if (c == 0xf4) hi = 0x8f;  // above U+10FFFF
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  if (at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k)
    if (at(i + k) < 0x80 || at(i + k) > 0xbf) return 0;
  return n;
}

/// Appends `s` as a JSON string literal (with its quotes). `"` and `\` are escaped, control
/// characters become \n, \t, ... or \u00XX, well-formed UTF-8 is copied as it is, and every byte
/// that is not part of well-formed UTF-8 becomes U+FFFD.
inline void append_json_string(std::string& out, std::string_view s) {
  out += '"';
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const std::size_t n = utf8_sequence(s, i);
      if (n == 0) {
        out += "\\ufffd";
        ++i;
      } else {
        out.append(s.substr(i, n));
        i += n;
      }
      continue;
    }
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
    ++i;
  }
  out += '"';
}

/// Appends `ns` nanoseconds as microseconds with exactly three decimals ("1234.005"): exact, so
/// that an event that nests inside another in nanoseconds still does after printing.
inline void append_micros(std::string& out, std::int64_t ns) {
  char buf[32];
  const bool neg = ns < 0;
  const std::uint64_t v = neg ? 0 - static_cast<std::uint64_t>(ns) : static_cast<std::uint64_t>(ns);
  std::snprintf(buf, sizeof buf, "%s%llu.%03llu", neg ? "-" : "", static_cast<unsigned long long>(v / 1000),
                static_cast<unsigned long long>(v % 1000));
  out += buf;
}

/// Appends an integer.
inline void append_int(std::string& out, long long v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%lld", v);
  out += buf;
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
