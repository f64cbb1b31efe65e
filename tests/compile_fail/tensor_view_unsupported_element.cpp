// Only the element types every reducer supports can be parameters.
#include <span>
#include <vector>

#include "ddp/parameter.hpp"

int main() {
  std::vector<char> w(4), g(4);
  auto v = ddp::make_tensor_view(std::span<char>(w), std::span<char>(g));
  return static_cast<int>(v.numel);
}
