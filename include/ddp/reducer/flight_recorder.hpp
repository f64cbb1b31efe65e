#pragma once
/// \file reducer/flight_recorder.hpp
/// `ddp::flight_recorder`: the record every reducer keeps of its last collectives (2048 by
/// default: sequence number, kind, the wrapper's bucket and step, count, bytes, dtype, op,
/// state, issue/start/end times). With `DDP_FLIGHT_RECORDER=PATH` each rank writes it to its
/// file (`{rank}` in PATH is replaced by the rank; else `.rank<r>.json` is appended) when a
/// collective times out, a peer is lost or a reducer aborts, and on the signal
/// `DDP_FLIGHT_RECORDER_SIGNAL` names; `tools/ddp_forensics.py` reads all ranks' files and says
/// who waits where. A program can also write the record itself. See docs/forensics.md.
///
/// \code
/// try {
///   dp.finish();
/// } catch (const ddp::error& e) {
///   ddp::flight_recorder::write("/tmp/record-" + std::to_string(pg.rank()) + ".json", e.what());
///   throw;
/// }
/// \endcode

#include <cstddef>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>

#include <ddp/version.hpp>
#include <ddp/detail/flight_recorder.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// The flight record of this process: every live reducer's ring, as one JSON document.
struct flight_recorder {
  /// Entries per reducer when `DDP_FLIGHT_RECORDER_ENTRIES` does not say (0 there turns
  /// recording off for reducers built afterwards).
  static constexpr std::size_t default_entries = detail::flight_ring::default_entries;

  /// The record now, as the file holds it; `reason` is its "reason" field.
  static std::string text(std::string_view reason = "requested") { return detail::flight_record_text(reason); }

  /// Writes the record to `path` as a whole (to a new file that is then renamed onto `path`, so
  /// a link placed at `path` is replaced, never written through). errc::system naming the file
  /// when it cannot be written.
  static void write(const std::string& path, std::string_view reason = "requested") {
    if (const int e = detail::flight_record_write(path, reason))
      detail::raise(errc::system, -1, "cannot write the flight record to " + path + ": " + detail::errno_text(e));
  }

  /// The file the automatic dumps of this process go to (from `DDP_FLIGHT_RECORDER` as the
  /// last reducer built read it), or "" when none is named.
  static std::string file() {
    std::string base;
    {
      auto& reg = detail::flight_rings();
      std::lock_guard lock(reg.mu);
      base = reg.path;
    }
    return base.empty() ? std::string() : detail::flight_record_file(base);
  }
};

}  // namespace DDP_ABI
}  // namespace ddp
