// A scalar type ddp does not reduce: the error names it.
#include <complex>

#include <ddp/adapters/eigen.hpp>

int main() {
  Eigen::MatrixXcf w(2, 2), g(2, 2);
  ddp::eigen_parameters params;
  params.add("w", w, g);
}
