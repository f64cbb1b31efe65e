#pragma once
/// \file data_parallel/detail/label.hpp
/// How the wrapper's errors name a parameter: "parameter 3 ('fc.weight')".
// IWYU pragma: private

#include <cstddef>
#include <string>
#include <string_view>

namespace ddp {
inline namespace v0 {
namespace detail {

inline std::string parameter_label(std::size_t i, std::string_view name) {
  std::string s = "parameter " + std::to_string(i);
  if (!name.empty()) s.append(" ('").append(name).append("')");
  return s;
}

}  // namespace detail
}  // namespace v0
}  // namespace ddp
