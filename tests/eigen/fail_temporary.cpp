// A temporary matrix would be gone before the wrapper reads it.
#include <ddp/adapters/eigen.hpp>

int main() {
  Eigen::MatrixXf w(2, 2);
  ddp::eigen_parameters params;
  params.add("w", w, Eigen::MatrixXf(2, 2));
}
