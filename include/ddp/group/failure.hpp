#pragma once
/// \file group/failure.hpp
/// `ddp::group_failure`: a failure as a group records it and passes it between ranks. The
/// verdict that records it is in group/verdict.hpp; `process_group::failure` names it.

#include <cstdlib>
#include <string>

#include <ddp/version.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// A failure as the group records it: its condition and a sentence that names the rank it
/// happened on ("rank 2 reports: lost connection to rank 3 (...)"), so that any rank can
/// raise it under its own prefix.
struct group_failure {
  errc code{};
  std::string text;
  bool empty() const noexcept { return text.empty(); }
  /// "<errc> <text>": how a failure travels between ranks (store record, all_gather).
  std::string encode() const { return std::to_string(static_cast<int>(code)) + " " + text; }
  static group_failure decode(const std::string& v) {
    const auto sp = v.find(' ');
    if (sp == std::string::npos) return {errc::protocol, v};
    return {static_cast<errc>(std::atoi(v.substr(0, sp).c_str())), v.substr(sp + 1)};
  }
};

}  // namespace DDP_ABI
}  // namespace ddp
