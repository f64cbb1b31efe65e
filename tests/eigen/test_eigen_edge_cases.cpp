// Adversarial cases for the Eigen adapter: gradients whose storage order or shape differs from
// the parameter's where the memory-order shapes happen to agree (square matrices, a transposed
// gradient in the other order), and a resize that keeps the size.
#include <ddp/adapters/eigen.hpp>

#include <doctest/doctest.h>

#include "raises.hpp"

#include <Eigen/Core>

#include <initializer_list>
#include <string>

namespace {

using ddp_test::raises;

}  // namespace

// The class comment promises errc::invalid_argument for "a gradient whose size, shape or
// storage order differs from the parameter's". add() compared only the memory-order shapes, so
// a square gradient in the other storage order, and a transposed gradient in the other order
// (3x2 row-major for a 2x3 column-major parameter: both {3, 2} in memory), were accepted: ddp
// then averages element k of each rank's gradient memory as if it were the parameter's element
// k, which holds only while every rank makes the same choice (a rank with the other order
// averages transposed gradients, and construction cannot tell: the shapes are the parameter's).
TEST_CASE("eigen: a gradient in the other storage order is refused even where the memory shapes agree") {
  using RowMajor3 = Eigen::Matrix<float, 3, 3, Eigen::RowMajor>;
  using RowMajorX = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::Matrix3f W;
  RowMajor3 gW_rows;
  ddp::eigen_parameters p;
  CHECK(raises([&] { p.add("square", W, gW_rows); }, ddp::errc::invalid_argument,
               {"parameter 0 ('square'): the gradient is 3x3 row-major but the parameter is 3x3 column-major",
                "storage order"}) == "");
  Eigen::MatrixXf V(2, 3);
  RowMajorX gV_t(3, 2);
  CHECK(raises([&] { p.add("transposed", V, gV_t); }, ddp::errc::invalid_argument,
               {"the gradient is 3x2 row-major but the parameter is 2x3 column-major"}) == "");
  CHECK(p.size() == 0);
  // What stays accepted: the same order; vectors against n x 1 or 1 x n matrices of either order;
  // a 1 x n row-major gradient for a 1 x n column-major parameter (the same memory).
  Eigen::Matrix3f gW;
  CHECK(p.add("square", W, gW) == 0);
  Eigen::VectorXf b(4);
  RowMajorX gb(4, 1);
  CHECK(p.add("bias", b, gb) == 1);
  Eigen::MatrixXf r(1, 5);
  RowMajorX gr(1, 5);
  CHECK(p.add("row", r, gr) == 2);
}

// Eigen's resize() to the size a matrix already has keeps its storage: no error; a resize that
// reallocates is one, naming the parameter.
TEST_CASE("eigen: resize to the same size keeps the registration; another size is refused") {
  Eigen::MatrixXf W(4, 4), gW(4, 4);
  ddp::eigen_parameters p;
  p.add("w", W, gW);
  gW.resize(4, 4);
  CHECK_NOTHROW(p.check());
  gW.resize(2, 8);  // the same element count: Eigen keeps the buffer, the shape changed
  CHECK(raises([&] { p.check(0); }, ddp::errc::usage, {"parameter 0 ('w'): its gradient", "was 4x4, now 2x8: resized"}) == "");
}
