// A const matrix cannot be registered: ddp writes parameters and gradients.
#include <ddp/adapters/eigen.hpp>

int main() {
  const Eigen::MatrixXf w(2, 2);
  Eigen::MatrixXf g(2, 2);
  ddp::eigen_parameters params;
  params.add("w", w, g);
}
