#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// Wire format of the key-value store. A frame is
//   u32 length (of everything after it, little endian) | u8 code | fields...
// and a field is u32 length | bytes (detail/bytes.hpp writes and reads them). Lengths are checked against fixed limits
// before anything is allocated, so a peer that claims a huge frame is dropped instead of growing our memory.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/detail/bytes.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

enum class store_cmd : std::uint8_t { set = 1, get = 2, add = 3, cas = 4, del = 5, check = 6, wait = 7 };
// del takes one key, or a prefix and the mark below: it then erases at most store_max_fields
// keys that start with the prefix and answers how many, in decimal (the client repeats it
// until fewer come back).
inline constexpr std::string_view store_del_prefix = "*";
// auth_required: the server has a secret and the client started without a handshake.
// full: the write would pass store_limits::max_bytes; too_large: the value alone passes it.
// forbidden: a store with members (store_server's member_prefix) refused a write from a
// connection that has not claimed a rank; the one field says which key and why.
enum class store_status : std::uint8_t {
  ok = 0,
  timeout = 1,
  bad_request = 2,
  auth_required = 3,
  full = 4,
  too_large = 5,
  forbidden = 6
};
inline constexpr std::uint8_t store_last_status = static_cast<std::uint8_t>(store_status::forbidden);

inline constexpr std::uint32_t store_max_frame = 64u << 20;  ///< whole frame
inline constexpr std::uint32_t store_max_key = 4096;         ///< one key
inline constexpr std::uint32_t store_max_fields = 4096;      ///< keys in one wait
inline constexpr std::size_t store_max_waiting = 64;         ///< parked get/wait requests per client

/// Builds one frame from a code and fields.
inline std::string encode_frame(std::uint8_t code, const std::vector<std::string_view>& fields) {
  std::string out;
  std::size_t len = 1;
  for (auto f : fields) len += 4 + f.size();
  out.reserve(4 + len);
  byte_writer w(out);
  w.u32(static_cast<std::uint32_t>(len)).u8(code);
  for (auto f : fields) w.str(f);
  return out;
}

struct frame {
  std::uint8_t code = 0;
  std::vector<std::string> fields;
};

/// Result of looking at the front of a byte stream.
enum class parse_result { need_more, ok, invalid };

/// Checks the 4-byte header; `invalid` when the claimed length is 0 or over the limit.
inline parse_result check_header(std::string_view buf, std::uint32_t& len, std::uint32_t limit = store_max_frame) {
  if (buf.size() < 4) return parse_result::need_more;
  len = get_u32(buf.data());
  if (len == 0 || len > limit) return parse_result::invalid;
  return buf.size() < 4 + static_cast<std::size_t>(len) ? parse_result::need_more : parse_result::ok;
}

/// Parses a complete frame body (after the length); `invalid` on truncated or oversized fields.
inline parse_result parse_body(std::string_view body, frame& out) {
  if (body.empty()) return parse_result::invalid;
  byte_reader r(body);
  out.code = r.u8();
  out.fields.clear();
  while (r.remaining() > 0) {
    if (out.fields.size() >= store_max_fields) return parse_result::invalid;
    const std::string_view f = r.str();
    if (!r.ok()) return parse_result::invalid;
    out.fields.emplace_back(f);
  }
  return parse_result::ok;
}

/// Number of fields each request must carry (wait: at least 2).
inline bool valid_request(const frame& f) {
  const auto n = f.fields.size();
  for (std::size_t i = 0; i < n; ++i) {
    // Every field but values (set/cas payloads) is a key or a small number.
    const bool is_value = (f.code == static_cast<std::uint8_t>(store_cmd::set) && i == 1) ||
                          (f.code == static_cast<std::uint8_t>(store_cmd::cas) && i >= 1);
    if (!is_value && f.fields[i].size() > store_max_key) return false;
  }
  switch (static_cast<store_cmd>(f.code)) {
    case store_cmd::set:
      return n == 2;
    case store_cmd::get:
      return n == 2;
    case store_cmd::add:
      return n == 2 && f.fields[1].size() == 8;
    case store_cmd::cas:
      return n == 3;
    case store_cmd::del:
      return n == 1 || (n == 2 && f.fields[1] == store_del_prefix);
    case store_cmd::check:
      return n == 1;
    case store_cmd::wait:
      return n >= 2;
  }
  return false;
}

inline std::string encode_ms(std::int64_t ms) { return encode_i64(ms); }

/// True for the requests that change the store (refused to non-members of a store with members).
inline bool is_write(std::uint8_t code) {
  const auto c = static_cast<store_cmd>(code);
  return c == store_cmd::set || c == store_cmd::add || c == store_cmd::cas || c == store_cmd::del;
}

/// True when `f` (a valid request) claims a rank of a store with members: compare_set of a key
/// under `prefix` from the empty value.
inline bool is_claim(const frame& f, std::string_view prefix, std::uint32_t members = 0) {
  if (prefix.empty() || f.code != static_cast<std::uint8_t>(store_cmd::cas) || f.fields.size() != 3 ||
      !f.fields[1].empty())
    return false;
  if (!f.fields[0].starts_with(prefix)) {
    // A store without numbered seats takes a claim under a namespace too ("el3/pg/rank/0": a
    // generation of an elastic group, init_options::key_prefix): anyone may claim there anyway.
    const auto at = f.fields[0].find(prefix);
    return members == 0 && at != std::string::npos && at > 0 && f.fields[0][at - 1] == '/';
  }
  if (members == 0) return true;
  // A seat: a number below `members`, in its one spelling (no sign, no leading zero).
  const std::string_view seat = std::string_view(f.fields[0]).substr(prefix.size());
  if (seat.empty() || seat.size() > 10 || (seat.size() > 1 && seat[0] == '0')) return false;
  std::uint64_t r = 0;
  for (char ch : seat) {
    if (ch < '0' || ch > '9') return false;
    r = r * 10 + static_cast<std::uint64_t>(ch - '0');
  }
  return r < members;
}

/// Number of keys a get (1) or wait (all fields but the last, its time limit) waits for.
inline std::size_t waited_keys(const frame& f) {
  return f.code == static_cast<std::uint8_t>(store_cmd::wait) ? f.fields.size() - 1 : 1;
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
