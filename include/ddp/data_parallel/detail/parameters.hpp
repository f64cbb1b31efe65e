#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/parameters.hpp
/// How the wrapper's errors name a parameter: "parameter 3 ('fc.weight')".
// IWYU pragma: private

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/parameter.hpp>
#include <ddp/planner/bucket_plan.hpp>

namespace ddp {
inline namespace DDP_ABI {
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
/// What finish() says when parameters never became ready (raise_missing raises it).
inline std::string missing_text(const std::vector<std::size_t>& missing, const std::vector<std::string>& names) {
  return "finish() while " + std::to_string(missing.size()) + " parameter" + (missing.size() > 1 ? "s" : "") +
         " never became ready this step: " + parameter_list(missing, names) +
         "; call grad_ready(i) for each one backward produced a gradient for. Only a parameter that took no part "
         "in this step's loss may be marked unused (mark_unused(i), or dp_options::find_unused_parameters for "
         "every parameter not ready at finish()): its gradient is then zero, or what no_sync() steps accumulated";
}
[[noreturn]] inline void raise_missing(int rank, const std::vector<std::size_t>& missing,
                                       const std::vector<std::string>& names) {
  raise(errc::usage, rank, missing_text(missing, names), -1, static_cast<int>(missing.front()));
}
/// A wrapper over no parameters averages nothing: each rank would train alone, and `finish()`
/// would return as if all were well. Raised on every rank, once the ranks agreed on the count
/// (a count that differs is the signature check's mismatch). `buffers`: how many buffers and
/// frozen parameters came with the empty set.
[[noreturn]] inline void raise_empty(int rank, std::size_t buffers) {
  raise(errc::invalid_argument, rank,
        "the parameter set is empty: a data_parallel wrapper over no parameters averages nothing, and each rank "
        "would train alone. An engine that allocates its parameters lazily (dlib before its first forward, a layer "
        "whose shape comes from its first input) has none yet when wrapped too early: wrap it after it has "
        "allocated them (after the first forward). A model whose every parameter is frozen" +
            (buffers > 0 ? " (" + std::to_string(buffers) + " buffers and frozen parameters came with this set)"
                         : std::string()) +
            " has nothing to average: it needs no data_parallel wrapper (docs/engines.md, \"When to wrap\")");
}

/// "0x7f...": an address in an error message.
inline std::string address_text(const void* p) {
  char buf[2 + 2 * sizeof(void*) + 1];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

/// What `grad_ready(params, i)` checks before it hands gradient `i` over: `params`, as the engine
/// describes it now, still holds parameter `i` where the wrapper captured it at construction
/// (`captured`): the same parameter count (`count`), element count, values and gradient
/// (`slot`: in view mode the bucket memory the engine may have been pointed at; else null). An
/// engine that reallocated a gradient after wrapping would otherwise have the wrapper read (and
/// write the average into) memory the engine no longer uses, silently: errc::usage naming it.
template <parameter_set C>
void check_unmoved(const C& params, std::size_t i, const tensor_view& captured, const void* slot, std::size_t count,
                   int rank) {
  using traits = traits_of<C>;
  // Called per gradient per step: the message is built only when a check fails.
  const auto fail = [&](const std::string& what) {
    raise(errc::usage, rank,
          "grad_ready(params, " + std::to_string(i) + "): " + parameter_label(i, captured.name) + ": " + what +
              "; the wrapper would read the gradient from (and write the average into) memory the engine no longer "
              "uses. Wrap after the engine has allocated its parameters and gradients for good, and keep them in "
              "place while the wrapper lives (zero a gradient instead of reallocating it), or build a new wrapper",
          -1, static_cast<int>(i));
  };
  std::size_t n = 0, numel = 0;
  const void *data = nullptr, *grad = nullptr;
  try {
    n = static_cast<std::size_t>(traits::size(params));
    if (n == count) {
      numel = static_cast<std::size_t>(traits::numel(params, i));
      data = static_cast<const void*>(traits::data(params, i));
      grad = static_cast<const void*>(traits::grad(params, i));
    }
  } catch (const error& e) {
    // A set that checks itself (eigen_parameters: a matrix resized) raised without a rank.
    if (e.rank() >= 0) throw;
    raise(e.condition(), rank, std::string(e.message()), e.bucket(), e.parameter());
  }
  if (n != count)
    fail("the parameter set now holds " + std::to_string(n) + " parameters, the wrapper was built over " +
         std::to_string(count) + " (parameters added or removed after wrapping, or not the set it was built from)");
  if (numel != captured.numel)
    fail("it now has " + std::to_string(numel) + " elements, the wrapper captured " + std::to_string(captured.numel));
  if (data != captured.data)
    fail("its values moved: the wrapper captured them at " + address_text(captured.data) +
         ", the engine now has them at " + address_text(data) + " (reallocated after wrapping)");
  if (grad != captured.grad && (slot == nullptr || grad != slot))
    fail("its gradient moved: the wrapper captured it at " + address_text(captured.grad) +
         ", the engine now has it at " + address_text(grad) + " (reallocated after wrapping)");
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
}  // namespace DDP_ABI
}  // namespace ddp
