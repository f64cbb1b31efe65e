#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/parameters.hpp
/// How the wrapper's errors name a parameter: "parameter 3 ('fc.weight')".
// IWYU pragma: private

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/parameter.hpp>
#include <ddp/planner/bucket_plan.hpp>

namespace ddp {
inline namespace v0 {
namespace detail {

inline std::string parameter_label(std::size_t i, std::string_view name, std::string_view noun = "parameter") {
  std::string s = std::string(noun) + " " + std::to_string(i);
  if (!name.empty()) s.append(" ('").append(name).append("')");
  return s;
}

/// "parameter 0 ('a'), parameter 2 and 5 more": the first `shown` of `which`, then a count.
inline std::string parameter_list(const std::vector<std::size_t>& which, const std::vector<std::string>& names,
                                  std::size_t shown = 8) {
  std::string list;
  if (shown > which.size()) shown = which.size();
  for (std::size_t k = 0; k < shown; ++k)
    list += (k ? ", " : "") + parameter_label(which[k], which[k] < names.size() ? names[which[k]] : "");
  if (shown < which.size()) list += " and " + std::to_string(which.size() - shown) + " more";
  return list;
}

/// Copies of the parameters' names, owned by the wrapper, with `views` repointed at them (a
/// name may be a view into storage the engine frees).
inline std::vector<std::string> own_names(std::vector<tensor_view>& views) {
  std::vector<std::string> names;  // moved out whole: the strings, and so the views, stay put
  names.reserve(views.size());
  for (const auto& v : views) names.emplace_back(v.name);
  for (std::size_t i = 0; i < views.size(); ++i) views[i].name = names[i];
  return names;
}

/// What a planner reads about each parameter.
inline std::vector<param_info> infos_of(const std::vector<tensor_view>& views) {
  std::vector<param_info> out;
  out.reserve(views.size());
  for (const auto& v : views) out.push_back(param_info{v.numel, v.type, v.device});
  return out;
}

// The wrapper's usage errors about parameters, each naming the parameter (and its bucket).
[[noreturn]] inline void raise_bad_index(int rank, const char* what, std::size_t i, std::size_t n) {
  raise(errc::invalid_argument, rank,
        std::string(what) + "(" + std::to_string(i) + "): there are only " + std::to_string(n) + " parameters", -1,
        static_cast<int>(i));
}
[[noreturn]] inline void raise_already(int rank, const char* what, std::size_t i, std::string_view name, bool unused,
                                       std::uint64_t step, std::size_t bucket) {
  raise(errc::usage, rank,
        std::string(what) + ": " + parameter_label(i, name) + " was already " + (unused ? "marked unused" : "ready") +
            " in this step (step " + std::to_string(step) + "); each parameter is ready or unused once per step, " +
            (unused ? std::string("and only if backward produced no gradient for it")
                    : std::string("when its gradient is final (a parameter used twice in one forward, such as tied "
                                  "weights, after its last contribution)")) +
            ", and finish() ends the step",
        static_cast<int>(bucket), static_cast<int>(i));
}
[[noreturn]] inline void raise_missing(int rank, const std::vector<std::size_t>& missing,
                                       const std::vector<std::string>& names) {
  raise(errc::usage, rank,
        "finish() while " + std::to_string(missing.size()) + " parameter" + (missing.size() > 1 ? "s" : "") +
            " never became ready this step: " + parameter_list(missing, names) +
            "; call grad_ready(i) for each one backward produced a gradient for. Only a parameter that took no part "
            "in this step's loss may be marked unused (mark_unused(i), or dp_options::find_unused_parameters for "
            "every parameter not ready at finish()): its gradient is then zero, or what no_sync() steps accumulated",
        -1, static_cast<int>(missing.front()));
}
/// A synchronized `finish()` with no hook since the previous `finish()` (which ended step
/// `previous`): the loop calls `finish()` twice. Not a step of missing parameters: marking them
/// unused (or `find_unused_parameters`) would average zeros into every gradient.
[[noreturn]] inline void raise_finish_twice(int rank, std::uint64_t previous, bool find_unused) {
  raise(errc::usage, rank,
        "finish() called twice with nothing new: no grad_ready or mark_unused since the previous finish(), which "
        "ended step " +
            std::to_string(previous) + "; call finish() once per step, after that step's grad_ready/mark_unused calls" +
            (find_unused ? " (with dp_options::find_unused_parameters this finish() would have averaged a zero "
                           "gradient for every parameter)"
                         : ""));
}

}  // namespace detail
}  // namespace v0
}  // namespace ddp
