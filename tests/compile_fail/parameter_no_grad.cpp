// A container whose traits give no gradient is not a parameter_set.
#include "ddp/parameter.hpp"

struct model {
  float* w;
};

template <>
struct ddp::parameter_traits<model> {
  static std::size_t size(const model&) { return 1; }
  static float* data(const model& m, std::size_t) { return m.w; }
  static std::size_t numel(const model&, std::size_t) { return 1; }
  static ddp::dtype type(const model&, std::size_t) { return ddp::dtype::f32; }
};

int main() {
  float w = 0;
  auto views = ddp::to_views(model{&w});
  return static_cast<int>(views.size());
}
