#pragma once
/// \file error.hpp
/// The one exception type of ddp: `ddp::error`, a `std::system_error` carrying the rank, and
/// optionally the bucket and parameter, that the failure concerns; and `ddp::group_failure`, a
/// failure as it travels from one rank to others.

#include <algorithm>
#include <charconv>
#include <exception>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <ddp/version.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Error conditions; each has a short name used in the message prefix `[ddp.NAME]`.
enum class errc {
  invalid_argument = 1,  ///< bad option or argument given by the caller
  timeout,               ///< a deadline passed
  peer_lost,             ///< a peer closed its connection or died
  mismatch,              ///< ranks disagree (collective, size, dtype, op, shapes)
  protocol,              ///< malformed frame or unexpected message on the wire
  address_in_use,        ///< rank 0 could not bind the master port
  unresolvable,          ///< master address could not be resolved
  rank_conflict,         ///< two processes claimed the same rank
  aborted,               ///< abort() was called on this rank or a peer
  auth_failed,           ///< authentication refused
  unsupported,           ///< a feature or combination this build cannot do
  system,                ///< an operating-system call failed
  usage,                 ///< API misuse (order of calls, state)
  state_lost,            ///< training state held only in memory is gone (every holder lost): restart from a checkpoint
};

class error;

namespace detail {
/// The words every "the state is gone" error holds (an elastic group's round with no source, a
/// sharded shard with no holder left): ddprun (tools/ddprun_elastic.hpp) restarts a job whose
/// ranks all ended saying them.
inline constexpr std::string_view state_lost_words = "every rank holding the state";

inline const char* errc_name(errc e) noexcept {
  switch (e) {
    case errc::invalid_argument:
      return "invalid_argument";
    case errc::timeout:
      return "timeout";
    case errc::peer_lost:
      return "peer_lost";
    case errc::mismatch:
      return "mismatch";
    case errc::protocol:
      return "protocol";
    case errc::address_in_use:
      return "address_in_use";
    case errc::unresolvable:
      return "unresolvable";
    case errc::rank_conflict:
      return "rank_conflict";
    case errc::aborted:
      return "aborted";
    case errc::auth_failed:
      return "auth_failed";
    case errc::unsupported:
      return "unsupported";
    case errc::system:
      return "system";
    case errc::usage:
      return "usage";
    case errc::state_lost:
      return "state_lost";
  }
  return "unknown";
}

/// The ddp::error objects alive in this process, oldest first: an error in flight or held by a
/// request is here, one that was handled is gone. A process_group that is destroyed while an
/// exception propagates reports the latest of them to its peers.
struct live_errors {
  std::mutex mu;
  std::vector<const error*> all;
  static live_errors& get() {
    static auto* l = new live_errors;  // never destroyed: errors may outlive static destruction
    return *l;
  }
  void add(const error* e) {
    std::lock_guard lock(mu);
    all.push_back(e);
  }
  void remove(const error* e) noexcept {
    std::lock_guard lock(mu);
    if (auto it = std::find(all.rbegin(), all.rend(), e); it != all.rend()) all.erase(std::next(it).base());
  }
};

class error_category_impl final : public std::error_category {
 public:
  const char* name() const noexcept override { return "ddp"; }
  std::string message(int ev) const override { return errc_name(static_cast<errc>(ev)); }
};
}  // namespace detail

/// The category of `ddp::errc` codes.
inline const std::error_category& ddp_category() noexcept {
  static const detail::error_category_impl cat;
  return cat;
}

inline std::error_code make_error_code(errc e) noexcept { return {static_cast<int>(e), ddp_category()}; }

/// The exception thrown by every ddp call.
///
/// `what()` reads `[ddp.peer_lost] rank 2: lost connection to rank 3 (...)`.
/// \code
/// try { ring.allreduce(v, ddp::op::sum); }
/// catch (const ddp::error& e) { if (e.code() == ddp::errc::peer_lost) ...; }
/// \endcode
class error : public std::system_error {
 public:
  error(errc code, int rank, const std::string& msg, int bucket = -1, int parameter = -1)
      : std::system_error(make_error_code(code)),
        what_(prefix(code, rank)),
        message_at_(what_.size()),
        rank_(rank),
        bucket_(bucket),
        parameter_(parameter) {
    // A NUL byte from user data (a parameter name read from a file) is written as "\0": what()
    // is a C string, and the bytes after it must not vanish.
    for (const char c : msg) {
      if (c == '\0')
        what_ += "\\0";
      else
        what_ += c;
    }
    detail::live_errors::get().add(this);
  }
  error(const error& o)
      : std::system_error(o),
        what_(o.what_),
        message_at_(o.message_at_),
        rank_(o.rank_),
        bucket_(o.bucket_),
        parameter_(o.parameter_) {
    detail::live_errors::get().add(this);
  }
  error& operator=(const error&) = default;
  ~error() override { detail::live_errors::get().remove(this); }

  /// `[ddp.<errc>] rank <r>: <message>` (without system_error's appended category text).
  const char* what() const noexcept override { return what_.c_str(); }

  /// The message alone, without the `[ddp.<errc>] rank <r>: ` prefix: what to build on when
  /// the error is reported again, under another prefix (so no prefix is ever doubled).
  std::string_view message() const noexcept { return std::string_view(what_).substr(message_at_); }

  /// Rank that raised the error (-1 when unknown, e.g. before the group exists).
  int rank() const noexcept { return rank_; }
  /// Bucket index the error concerns, or -1.
  int bucket() const noexcept { return bucket_; }
  /// Parameter index the error concerns, or -1.
  int parameter() const noexcept { return parameter_; }
  /// The condition, e.g. `errc::timeout`.
  errc condition() const noexcept { return static_cast<errc>(code().value()); }

 private:
  static std::string prefix(errc code, int rank) {
    std::string s = "[ddp.";
    s += detail::errc_name(code);
    s += "] ";
    if (rank >= 0) s += "rank " + std::to_string(rank) + ": ";
    return s;
  }
  std::string what_;
  std::size_t message_at_;
  int rank_;
  int bucket_;
  int parameter_;
};

namespace detail {
/// "rank 3 never connected" from "[ddp.timeout] rank 2: rank 3 never connected", and what()
/// of any other exception: the text to embed in another message (which has its own prefix).
inline std::string message_of(const std::exception& e) {
  if (const auto* d = dynamic_cast<const error*>(&e)) return std::string(d->message());
  return e.what();
}

/// The condition and message of the latest ddp::error alive in this process, if any.
inline bool latest_live_error(errc& code, std::string& message) {
  auto& l = live_errors::get();
  std::lock_guard lock(l.mu);
  if (l.all.empty()) return false;
  code = l.all.back()->condition();
  message = std::string(l.all.back()->message());
  return true;
}

/// The single throw site of ddp.
[[noreturn]] inline void raise(errc code, int rank, const std::string& msg, int bucket = -1, int parameter = -1) {
  throw error(code, rank, msg, bucket, parameter);
}
}  // namespace detail

/// A failure as it travels between ranks: its condition, a sentence that names where it
/// happened ("rank 2 reports: lost connection to rank 3 (...)"), the parameter it concerns and
/// the rank it came from, so that any rank can raise it under its own prefix. The one value and
/// the one codec for every way a failure crosses ranks: the group's failure record in its store,
/// a step's outcome gathered or broadcast to every rank (detail/consensus.hpp), and the
/// launcher's note to a rank (ddprun).
struct group_failure {
  errc code{};
  std::string text;    ///< empty: no failure
  int parameter = -1;  ///< the parameter it concerns, or -1
  int origin = -1;     ///< the rank it happened on, or -1 when that is not known
  bool empty() const noexcept { return text.empty(); }

  /// "<errc> <parameter> <origin> <text>", and "" for no failure.
  std::string encode() const {
    if (empty()) return {};
    return std::to_string(static_cast<int>(code)) + ' ' + std::to_string(parameter) + ' ' + std::to_string(origin) +
           ' ' + text;
  }
  /// What encode() wrote; "" is no failure, and anything else that encode() cannot have written
  /// is errc::protocol quoting it (never an empty failure, which would read as success).
  static group_failure decode(std::string_view s) {
    if (s.empty()) return {};
    int field[3] = {};
    const char* at = s.data();
    const char* const end = s.data() + s.size();
    for (int& f : field) {
      const auto [next, ec] = std::from_chars(at, end, f);
      if (ec != std::errc{} || next == end || *next != ' ') return malformed(s);
      at = next + 1;
    }
    // A condition errc_name does not know is no condition of this build's.
    if (at == end || std::string_view(detail::errc_name(static_cast<errc>(field[0]))) == "unknown") return malformed(s);
    return {static_cast<errc>(field[0]), std::string(at, end), field[1], field[2]};
  }
  /// Raises it on `rank` (under that rank's prefix), with its condition and parameter.
  [[noreturn]] void raise_on(int rank) const { detail::raise(code, rank, text, -1, parameter); }

 private:
  static group_failure malformed(std::string_view s) {
    return {errc::protocol, "a malformed failure record: \"" + std::string(s.substr(0, 200)) + "\""};
  }
};

}  // namespace DDP_ABI
}  // namespace ddp

template <>
struct std::is_error_code_enum<ddp::errc> : std::true_type {};
