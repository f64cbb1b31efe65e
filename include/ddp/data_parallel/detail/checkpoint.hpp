#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The checkpoint file of ddp/checkpoint.hpp: its format (header, table, checksum), a decoder
// that trusts nothing it reads, the POSIX file calls that save it atomically, and the step
// that turns one rank's failure into the same error on every rank.
//
// Format, version 1; every integer little-endian:
//
//   offset 0   magic     8 bytes "DDPCKPT\0"
//          8   version   u32 = 1
//         12   flags     u32 = 0 (reserved: a reader refuses anything else)
//         16   count     u64  parameters in the table
//         24   table     u64  bytes of the table
//         32   data      u64  bytes of the data section
//         40   extra     u64  bytes of the user's blob
//         48   the table: per parameter, in order,
//                u32 name length (at most max_name_bytes), the name's bytes,
//                u8 dtype (ddp::dtype's value), 3 zero bytes,
//                u32 ndim (at most max_ndim), ndim i64 extents (each >= 0),
//                u64 numel (the product of the extents)
//              the data: each parameter's numel * dtype_size bytes, in table order, no padding,
//                values as they lie in memory on a little-endian host
//              the user's blob
//   end - 8    u64 checksum: XXH64 (seed 0) of every byte before it
//
// The file's size must be exactly 48 + table + data + extra + 8, and the data section exactly
// the sum of the parameters' bytes: a truncated or padded file is refused before any of it is
// used. A decoder reads every field through byte_reader (bounds-checked) and allocates nothing
// from a length it read before that length was checked against the file's real size.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <ddp/clock.hpp>
#include <ddp/data_parallel/detail/xxh64.hpp>
#include <ddp/detail/bytes.hpp>
#include <ddp/detail/fd.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {
namespace ckpt {

inline constexpr char magic[8] = {'D', 'D', 'P', 'C', 'K', 'P', 'T', '\0'};
inline constexpr std::uint32_t version = 1;
inline constexpr std::size_t header_bytes = 48;
inline constexpr std::size_t trailer_bytes = 8;
inline constexpr std::uint32_t max_name_bytes = 1u << 16;
inline constexpr std::uint32_t max_ndim = 64;
/// A table larger than this is refused before it is read (a million parameters with long
/// names fit).
inline constexpr std::uint64_t max_table_bytes = std::uint64_t{1} << 30;
/// The smallest table record: empty name, no extents.
inline constexpr std::uint64_t min_record_bytes = 4 + 4 + 4 + 8;

// XXH64 (data_parallel/detail/xxh64.hpp), the file's checksum.
using detail::xxh64;

// ---- header and table ---------------------------------------------------------------------

/// What the file says about one parameter (and what a rank's model says, to compare).
struct entry {
  std::string name;
  dtype type = dtype::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t numel = 0;
  friend bool operator==(const entry&, const entry&) = default;
};

struct header {
  std::uint64_t count = 0;
  std::uint64_t table = 0;
  std::uint64_t data = 0;
  std::uint64_t extra = 0;
};

inline std::string encode_header(const header& h) {
  std::string s;
  byte_writer(s).raw(std::string_view(magic, 8)).u32(version).u32(0).u64(h.count).u64(h.table).u64(h.data).u64(h.extra);
  return s;
}

inline std::string encode_table(const std::vector<entry>& es) {
  std::string s;
  byte_writer w(s);
  for (const auto& e : es) {
    w.str(e.name).u8(static_cast<std::uint8_t>(e.type)).zeros(3).u32(static_cast<std::uint32_t>(e.shape.size()));
    for (auto d : e.shape) w.i64(d);
    w.u64(e.numel);
  }
  return s;
}

/// `a + b`, false when it does not fit in 64 bits.
inline bool add_to(std::uint64_t& a, std::uint64_t b) noexcept {
  if (b > std::numeric_limits<std::uint64_t>::max() - a) return false;
  a += b;
  return true;
}

/// Decodes the 48 header bytes of a file of `file_size` bytes; the empty string when they
/// describe a file of exactly that size, else what is wrong.
inline std::string decode_header(std::string_view bytes, std::uint64_t file_size, header& h) {
  if (file_size < header_bytes + trailer_bytes || bytes.size() < header_bytes)
    return "not a ddp checkpoint: " + std::to_string(file_size) + " bytes, shorter than the " +
           std::to_string(header_bytes + trailer_bytes) + " of an empty one (truncated?)";
  byte_reader r(bytes.substr(0, header_bytes));
  if (r.raw(8) != std::string_view(magic, 8)) return "not a ddp checkpoint (wrong magic bytes)";
  const auto v = r.u32();
  if (v != version)
    return "checkpoint format version " + std::to_string(v) + "; this ddp reads version " + std::to_string(version);
  if (r.u32() != 0) return "checkpoint header has unknown flags set (a newer format?)";
  h.count = r.u64();
  h.table = r.u64();
  h.data = r.u64();
  h.extra = r.u64();
  std::uint64_t want = header_bytes + trailer_bytes;
  if (!add_to(want, h.table) || !add_to(want, h.data) || !add_to(want, h.extra) || want != file_size)
    return "checkpoint sizes do not add up: the header announces a " + std::to_string(h.table) + "-byte table, " +
           std::to_string(h.data) + " bytes of data and a " + std::to_string(h.extra) + "-byte blob, the file has " +
           std::to_string(file_size) + " bytes (truncated or corrupt)";
  if (h.table > max_table_bytes)
    return "checkpoint table of " + std::to_string(h.table) + " bytes; at most " + std::to_string(max_table_bytes);
  if (h.count > h.table / min_record_bytes)
    return "checkpoint header announces " + std::to_string(h.count) + " parameters in a " + std::to_string(h.table) +
           "-byte table (corrupt)";
  return {};
}

/// Decodes the table of a header already decoded; the empty string when it holds exactly
/// `h.count` well-formed records whose bytes add up to `h.data`, else what is wrong.
inline std::string decode_table(std::string_view table, const header& h, std::vector<entry>& out) {
  out.clear();
  if (table.size() != h.table) return "checkpoint table truncated";
  byte_reader r(table);
  out.reserve(static_cast<std::size_t>(h.count));  // bounded: count <= table / min_record_bytes
  std::uint64_t bytes = 0;
  for (std::uint64_t i = 0; i < h.count; ++i) {
    const auto bad = [&](const std::string& why) {
      return "checkpoint table, parameter " + std::to_string(i) + ": " + why;
    };
    entry e;
    e.name = std::string(r.str(max_name_bytes));
    const auto t = r.u8();
    r.zeros(3);
    const auto ndim = r.u32();
    if (!r.ok()) return bad("truncated or malformed record");
    if (t > static_cast<std::uint8_t>(dtype::i64)) return bad("unknown dtype " + std::to_string(t));
    e.type = static_cast<dtype>(t);
    if (ndim > max_ndim) return bad(std::to_string(ndim) + " dimensions; at most " + std::to_string(max_ndim));
    std::uint64_t product = 1;
    bool fits = true;
    for (std::uint32_t k = 0; k < ndim; ++k) {
      const auto d = r.i64();
      if (d < 0) return bad("negative extent " + std::to_string(d));
      const auto ud = static_cast<std::uint64_t>(d);
      if (ud != 0 && product > std::numeric_limits<std::uint64_t>::max() / ud) fits = false;
      product = fits ? product * ud : 0;
      e.shape.push_back(d);
    }
    e.numel = r.u64();
    if (!r.ok()) return bad("truncated record");
    if (!fits || product != e.numel)
      return bad("numel " + std::to_string(e.numel) + " is not the product of its shape");
    if (e.numel > std::numeric_limits<std::uint64_t>::max() / dtype_size(e.type) ||
        !add_to(bytes, e.numel * dtype_size(e.type)))
      return bad("too large");
    out.push_back(std::move(e));
  }
  if (!r.done()) return "checkpoint table has " + std::to_string(r.remaining()) + " bytes after its last record";
  if (bytes != h.data)
    return "checkpoint data section of " + std::to_string(h.data) + " bytes, but its parameters hold " +
           std::to_string(bytes) + " (corrupt)";
  return {};
}

/// How much larger than the model's own table a file's table may be and still be read (to
/// name the first parameter that differs): a small constant, so that a hostile file costs
/// every rank at most that much above a valid one of the same model.
inline constexpr std::uint64_t table_slack_bytes = std::uint64_t{64} << 10;

/// Checks a file's header against the model of rank `rank` (`mine`) before its table is read:
/// a table more than table_slack_bytes larger than `mine`'s own describes another model and is
/// refused without allocating or broadcasting anything proportional to it. Empty, or the
/// sentence for errc::mismatch.
inline std::string table_fits_model(const header& h, const std::vector<entry>& mine, int rank) {
  const std::uint64_t own = encode_table(mine).size();
  if (h.table <= own + table_slack_bytes) return {};
  return "the file's table of " + std::to_string(h.table) + " bytes lists " + std::to_string(h.count) +
         " parameters, rank " + std::to_string(rank) + " has " + std::to_string(mine.size()) + " (a table of " +
         std::to_string(own) + " bytes)";
}

/// `f32[4, 6]`.
inline std::string describe(const entry& e) {
  std::string s = std::string(dtype_name(e.type)) + "[";
  for (std::size_t k = 0; k < e.shape.size(); ++k) s += (k ? ", " : "") + std::to_string(e.shape[k]);
  return s + "]";
}
inline std::string label(std::size_t i, std::string_view name) {
  return "parameter " + std::to_string(i) + (name.empty() ? std::string() : " ('" + std::string(name) + "')");
}

/// The first difference between the file's parameters and a rank's, as a sentence; empty when
/// they agree. `index` receives the differing parameter's index.
inline std::string first_difference(const std::vector<entry>& file, const std::vector<entry>& mine, int rank,
                                    int& index) {
  const std::string here = "rank " + std::to_string(rank);
  const std::size_t n = std::min(file.size(), mine.size());
  for (std::size_t i = 0; i < n; ++i) {
    const auto& f = file[i];
    const auto& m = mine[i];
    if (f.name == m.name && f.type == m.type && f.shape == m.shape) continue;
    index = static_cast<int>(i);
    return label(i, m.name) + " differs: the file has '" + f.name + "' " + describe(f) + ", " + here + " has '" +
           m.name + "' " + describe(m);
  }
  if (file.size() == mine.size()) return {};
  index = static_cast<int>(n);
  if (file.size() > mine.size())
    return "the file has " + std::to_string(file.size()) + " parameters, " + here + " has " +
           std::to_string(mine.size()) + ": " + label(n, file[n].name) + " " + describe(file[n]) +
           " is in the file only";
  return "the file has " + std::to_string(file.size()) + " parameters, " + here + " has " +
         std::to_string(mine.size()) + ": " + label(n, mine[n].name) + " " + describe(mine[n]) + " is not in the file";
}

// ---- files ----------------------------------------------------------------------------------

/// Reads exactly `n` bytes; 0, ENODATA when the file ends first, or the errno.
inline int read_exact(int fd, void* p, std::size_t n) noexcept {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t k = ::read(fd, c, n);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return errno;
    if (k == 0) return ENODATA;
    c += k;
    n -= static_cast<std::size_t>(k);
  }
  return 0;
}

/// Writes all `n` bytes; 0 or the errno.
inline int write_all(int fd, const void* p, std::size_t n) noexcept {
  const auto* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t k = ::write(fd, c, n);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return errno;
    c += k;
    n -= static_cast<std::size_t>(k);
  }
  return 0;
}

}  // namespace ckpt
}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
