// Parameters are written (initial broadcast), so data() must not hand out a const pointer.
#include "ddp/parameter.hpp"

struct model {
  const float* w;
  float* g;
};

template <>
struct ddp::parameter_traits<model> {
  static std::size_t size(const model&) { return 1; }
  static const float* data(const model& m, std::size_t) { return m.w; }
  static float* grad(const model& m, std::size_t) { return m.g; }
  static std::size_t numel(const model&, std::size_t) { return 1; }
  static ddp::dtype type(const model&, std::size_t) { return ddp::dtype::f32; }
};

int main() {
  float w = 0, g = 0;
  return static_cast<int>(ddp::to_views(model{&w, &g}).size());
}
