// An expression without storage (a product) cannot be registered.
#include <ddp/adapters/eigen.hpp>

int main() {
  Eigen::MatrixXf w(2, 2), g(2, 2);
  ddp::eigen_parameters params;
  params.add("w", w, g * 2.0f);
}
