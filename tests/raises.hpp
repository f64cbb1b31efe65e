#pragma once
// "Raises X with text Y", written once for every suite: raises() says what differs from a
// ddp::error of condition X whose message holds each text Y (empty when nothing does), for a
// doctest check in the test's own process, `CHECK(raises(f, X, {"Y"}) == "")`; require_raises()
// throws it instead, in a forked child (where a doctest check cannot report: the harness carries
// the child's exception back) and in helpers shared by both. tests/multiproc/harness.hpp adds
// ended_with(), the same for a child's outcome. Needs no doctest and no fork.

#include <ddp/error.hpp>

#include <exception>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace ddp_test {

/// Throws `what` unless `ok`: a check inside a child, which the harness reports with its text.
inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

/// What differs between the ddp::error `e` and one of condition `code` whose message holds every
/// one of `texts`; empty when nothing does.
inline std::string differs(const ddp::error& e, ddp::errc code, std::initializer_list<std::string_view> texts) {
  const std::string what = e.what();
  if (e.condition() != code)
    return std::string("errc ") + ddp::detail::errc_name(e.condition()) + " instead of " +
           ddp::detail::errc_name(code) + ": " + what;
  for (auto t : texts)
    if (what.find(t) == std::string::npos) return "the message lacks '" + std::string(t) + "': " + what;
  return {};
}

/// "Raises X with text Y": runs `f`, which must raise a ddp::error of condition `code` whose
/// message holds every one of `texts` on the calling thread (not later, from a request). Empty
/// when it did, else what happened instead: `CHECK(raises(f, code, {"text"}) == "")` in the
/// test's own process, require_raises in a child (where a doctest check cannot report).
template <class F>
std::string raises(F&& f, ddp::errc code, std::initializer_list<std::string_view> texts = {}) {
  try {
    std::forward<F>(f)();
  } catch (const ddp::error& e) {
    return differs(e, code, texts);
  } catch (const std::exception& e) {
    return std::string("raised another exception than ddp::error: ") + e.what();
  }
  return std::string("no ddp::error was raised (expected errc ") + ddp::detail::errc_name(code) + ")";
}

/// The ddp::error `f` raised, for a case that checks more of it than raises() does (its rank(),
/// parameter()); one of errc 0 saying so when `f` raised none.
template <class F>
ddp::error error_of(F&& f) {
  try {
    std::forward<F>(f)();
  } catch (const ddp::error& e) {
    return e;
  }
  return ddp::error(ddp::errc{}, -1, "no ddp::error was raised");
}

/// raises() in a child: throws (for the harness to report, after `what`) unless `f` raised so.
template <class F>
void require_raises(F&& f, ddp::errc code, std::initializer_list<std::string_view> texts,
                    const std::string& what = {}) {
  const std::string why = raises(std::forward<F>(f), code, texts);
  require(why.empty(), what.empty() ? why : what + ": " + why);
}

}  // namespace ddp_test
