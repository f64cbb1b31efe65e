// A Map of const memory is read-only.
#include <ddp/adapters/eigen.hpp>

int main() {
  float w[4] = {}, g[4] = {};
  Eigen::Map<const Eigen::VectorXf> wv(w, 4);
  Eigen::Map<Eigen::VectorXf> gv(g, 4);
  ddp::eigen_parameters params;
  params.add("w", wv, gv);
}
