// A vector of floats is one buffer, not a set of parameters.
#include <vector>

#include "ddp/parameter.hpp"

int main() {
  std::vector<float> v(4);
  return static_cast<int>(ddp::to_views(v).size());
}
