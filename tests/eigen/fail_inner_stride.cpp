// A view strided at compile time (every other element) is not contiguous.
#include <ddp/adapters/eigen.hpp>

int main() {
  float w[8] = {}, g[8] = {};
  Eigen::Map<Eigen::VectorXf, 0, Eigen::InnerStride<2>> wv(w, 4), gv(g, 4);
  ddp::eigen_parameters params;
  params.add("w", wv, gv);
}
