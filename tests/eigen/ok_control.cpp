// The positive control: what the failing cases change, done right, compiles.
#include <ddp/adapters/eigen.hpp>

static_assert(ddp::parameter_set<ddp::eigen_parameters>);
static_assert(ddp::eigen_scalar<float> && ddp::eigen_scalar<Eigen::half> && !ddp::eigen_scalar<std::complex<float>>);

int main() {
  Eigen::MatrixXf w(2, 2), g(2, 2);
  float a[8] = {}, b[8] = {};
  Eigen::Map<Eigen::VectorXf, 0, Eigen::InnerStride<1>> av(a, 8), bv(b, 8);
  const Eigen::Map<Eigen::VectorXf> cv(a, 4), dv(b, 4);
  ddp::eigen_parameters params;
  params.add("w", w, g);
  params.add("a", av, bv);
  params.add("c", cv, dv);
  return static_cast<int>(params.size()) - 3;
}
