#pragma once
/// \file adapters/eigen.hpp
/// `ddp::eigen_parameters`: an engine that holds its parameters as Eigen matrices, vectors or
/// arrays (dynamic or fixed size, row or column major, `Eigen::Map`, `Eigen::Ref`, contiguous
/// blocks) registers each one with its gradient, and the container is a `ddp::parameter_set`
/// for `ddp::data_parallel`. The only header of ddp that includes Eigen's (`<Eigen/Core>`,
/// Debian's libeigen3-dev; compile with `-I/usr/include/eigen3` or `pkg-config --cflags eigen3`).
/// See docs/engines.md, "Eigen".
///
/// \code
/// Eigen::MatrixXf W(64, 16), gW(64, 16);
/// Eigen::VectorXf b(64), gb(64);
/// ddp::eigen_parameters params;
/// params.add("fc1.weight", W, gW);
/// params.add("fc1.bias", b, gb);
/// ddp::data_parallel dp{pg, params};
/// // backward: ... gb = ...; gW = ...;
/// params.grad_ready(dp, 1);  // checks that gb still is the registered storage, then dp.grad_ready(1)
/// params.grad_ready(dp, 0);
/// dp.finish();               // gW and gb hold the averages over all ranks
/// \endcode

// First, so that below C++20 the one line that says so stops the compiler before Eigen's headers.
#include <ddp/version.hpp>

#include <Eigen/Core>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/parameter.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// The `ddp::dtype` of an Eigen scalar type; no `value` for a type ddp does not reduce.
template <class Scalar>
struct eigen_dtype {};
template <>
struct eigen_dtype<float> : std::integral_constant<dtype, dtype::f32> {};
template <>
struct eigen_dtype<double> : std::integral_constant<dtype, dtype::f64> {};
template <>
struct eigen_dtype<std::int32_t> : std::integral_constant<dtype, dtype::i32> {};
template <>
struct eigen_dtype<std::int64_t> : std::integral_constant<dtype, dtype::i64> {};
// Eigen's 16-bit floats are their bits (IEEE binary16, bfloat16), as ddp::half and ddp::bfloat16.
template <>
struct eigen_dtype<Eigen::half> : std::integral_constant<dtype, dtype::f16> {};
template <>
struct eigen_dtype<Eigen::bfloat16> : std::integral_constant<dtype, dtype::bf16> {};
static_assert(sizeof(Eigen::half) == 2 && sizeof(Eigen::bfloat16) == 2);

/// An Eigen scalar type ddp can reduce: float, double, std::int32_t, std::int64_t, Eigen::half,
/// Eigen::bfloat16.
template <class Scalar>
concept eigen_scalar = requires {
  eigen_dtype<std::remove_cv_t<Scalar>>::value;
};

/// Instantiated for each registered scalar type: a compiler error for an unsupported one
/// names the type in this template's arguments (`eigen_supported_scalar<std::complex<float>>`).
template <class Scalar>
struct eigen_supported_scalar {
  static_assert(eigen_scalar<Scalar>,
                "ddp::eigen_parameters: unsupported Eigen scalar type (the Scalar of "
                "eigen_supported_scalar<Scalar> in this error); ddp reduces float, double, std::int32_t, "
                "std::int64_t, Eigen::half and Eigen::bfloat16");
  static constexpr bool value = true;
};

/// Parameters held as Eigen objects, each registered with its gradient; a `ddp::parameter_set`.
///
/// What `add` accepts, checked when it compiles: an Eigen object with storage of its own
/// (`Matrix`, `Array`, fixed or dynamic size, either storage order), or a writable view of
/// contiguous memory (`Map`, `Ref`, a block of whole columns of a column-major matrix, a
/// `segment` of a vector). It rejects, at compile time: expressions without storage (`W * 2`,
/// `W + V`), read-only objects (a `const` matrix, `Map<const ...>`), temporary matrices, scalar
/// types ddp cannot reduce, and views strided at compile time (`InnerStride<2>`); at run time,
/// with `errc::invalid_argument`: a view whose strides leave gaps (`W.block(0, 0, 2, 2)` of a 4x4
/// matrix), a gradient whose size, shape or storage order differs from the parameter's, a name
/// already registered.
///
/// **Storage must stay put.** ddp keeps the addresses registered here (a `data_parallel`
/// wrapper copies them at construction). Resizing a registered `Matrix` (`gW.resize(..)`, or an
/// assignment of another size) or `swap`ping it moves its storage: `check()` and
/// `grad_ready(dp, i)` then raise `errc::usage`, naming the parameter, instead of letting the
/// wrapper read freed memory. Views (`Map`, `Ref`, blocks) cannot be followed that way: the
/// memory under them is the engine's to keep. Register objects that no longer move in memory
/// either (not elements of a `std::vector` that still grows).
///
/// Shapes list the extents as the elements lie in memory, outermost first (ddp's C order, as
/// for every `tensor_view`): a row-major R x C matrix is `{R, C}`, a column-major one (Eigen's
/// default) `{C, R}`, a vector (a type with one row or one column at compile time) `{size}`.
/// So ranks that hold the same matrix in different storage orders disagree at construction
/// (`errc::mismatch`) instead of averaging transposed gradients (unless the matrix is square).
/// \code
/// ddp::eigen_parameters params;
/// params.add("fc1.weight", W1, gW1);   // Eigen::MatrixXf: shape {in, out}
/// params.add("fc1.bias", b1, gb1);     // Eigen::VectorXf: shape {out}
/// static_assert(ddp::parameter_set<ddp::eigen_parameters>);
/// \endcode
class eigen_parameters {
 public:
  eigen_parameters() = default;
  // The registered names back the string_views that ddp::to_views hands out: a copy would
  // give views into the copy; moving a deque keeps its elements in place.
  eigen_parameters(const eigen_parameters&) = delete;
  eigen_parameters& operator=(const eigen_parameters&) = delete;
  eigen_parameters(eigen_parameters&&) noexcept = default;
  eigen_parameters& operator=(eigen_parameters&&) noexcept = default;

  /// Registers `param` and its gradient `grad` (same scalar type, same shape and storage order)
  /// as the next parameter; returns its index, the one `grad_ready` takes. See the class
  /// comment for what is accepted. Throws `ddp::error` (`errc::invalid_argument`, naming the
  /// parameter) for a size, shape or order mismatch, gaps in a view, or a duplicate name.
  /// \code
  /// const std::size_t i = params.add("fc1.weight", W, gW);
  /// \endcode
  template <class P, class G>
  std::size_t add(std::string_view name, P&& param, G&& grad) {
    using PD = std::remove_cvref_t<P>;
    using GD = std::remove_cvref_t<G>;
    static_assert(is_dense<PD> && is_dense<GD>,
                  "ddp::eigen_parameters::add: the parameter and its gradient must be Eigen dense objects "
                  "(Matrix, Array, Map, Ref or a block of one)");
    static_assert(std::is_same_v<typename PD::Scalar, typename GD::Scalar>,
                  "ddp::eigen_parameters::add: the parameter and its gradient must have the same scalar type");
    static_assert(eigen_supported_scalar<typename PD::Scalar>::value);
    const std::size_t index = entries_.size();
    const std::string label = "eigen_parameters::add: " + label_of(index, name);
    if (!name.empty())
      for (const auto& e : entries_)
        if (e.name == name)
          detail::raise(errc::invalid_argument, -1, label + ": a parameter of this name is already registered", -1,
                        static_cast<int>(index));
    entry e;
    e.name = std::string(name);
    if constexpr (eigen_scalar<typename PD::Scalar>) e.type = eigen_dtype<typename PD::Scalar>::value;
    e.param = storage_of<P>(param, label, "the parameter");
    e.grad = storage_of<G>(grad, label, "its gradient");
    e.shape = e.param.shape();
    // One row or one column is the same memory in either order; a matrix must match the
    // parameter's rows, columns and order, even where the memory-order shapes agree (a square
    // matrix, a transposed one in the other order).
    const bool line = e.param.rows == 1 || e.param.cols == 1;
    const bool same_matrix =
        line || (e.grad.rows == e.param.rows && e.grad.cols == e.param.cols && e.grad.row_major == e.param.row_major);
    if (e.param.numel() != e.grad.numel() || squeezed(e.param.shape()) != squeezed(e.grad.shape()) || !same_matrix)
      detail::raise(errc::invalid_argument, -1,
                    label + ": the gradient is " + e.grad.describe() + " but the parameter is " + e.param.describe() +
                        "; give the gradient the parameter's shape" +
                        (e.param.numel() == e.grad.numel() ? " and storage order (ddp averages the gradient's "
                                                             "memory in the parameter's layout)"
                                                           : ""),
                    -1, static_cast<int>(index));
    entries_.push_back(std::move(e));
    return index;
  }

  /// Registers `state` as a buffer (`buffer_kind::buffer`: running statistics and the like, kept
  /// alike across ranks after each step, `dp_options::buffers`) or a frozen parameter (rank 0's at
  /// construction only). The same objects as `add` are accepted; returns the buffer's index.
  /// Throws `errc::invalid_argument` for a duplicate name or a view with gaps.
  /// \code
  /// params.add_buffer("bn.running_mean", running_mean);
  /// params.add_buffer("embed.weight", E, ddp::buffer_kind::frozen_parameter);
  /// \endcode
  template <class B>
  std::size_t add_buffer(std::string_view name, B&& state, buffer_kind kind = buffer_kind::buffer) {
    using BD = std::remove_cvref_t<B>;
    static_assert(is_dense<BD>,
                  "ddp::eigen_parameters::add_buffer: a buffer must be an Eigen dense object "
                  "(Matrix, Array, Map, Ref or a block of one)");
    static_assert(eigen_supported_scalar<typename BD::Scalar>::value);
    const std::size_t index = buffers_.size();
    const std::string label =
        "eigen_parameters::add_buffer: buffer " + std::to_string(index) + " ('" + std::string(name) + "')";
    for (const auto& b : buffers_)
      if (!name.empty() && b.name == name)
        detail::raise(errc::invalid_argument, -1, label + ": a buffer of this name is already registered");
    entry e;
    e.name = std::string(name);
    if constexpr (eigen_scalar<typename BD::Scalar>) e.type = eigen_dtype<typename BD::Scalar>::value;
    e.param = storage_of<B>(state, label, "the buffer");
    e.shape = e.param.shape();
    e.kind = kind;
    buffers_.push_back(std::move(e));
    return index;
  }

  /// Number of registered buffers and frozen parameters.
  std::size_t buffer_count() const noexcept { return buffers_.size(); }
  /// Buffer `i` as ddp sees it (checked: `errc::usage` when its matrix was resized or moved).
  buffer_view buffer(std::size_t i) const {
    if (i >= buffers_.size())
      detail::raise(errc::invalid_argument, -1, "eigen_parameters: buffer " + std::to_string(i) + " does not exist");
    const entry& e = buffers_[i];
    verify(e.param, i, e.name, "the buffer", -1);
    return buffer_view{e.param.data, e.param.numel(), e.type, -1, e.name, e.shape, e.kind};
  }

  /// Number of registered parameters.
  std::size_t size() const noexcept { return entries_.size(); }
  bool empty() const noexcept { return entries_.empty(); }

  /// Parameter `i`'s name, as given to `add`.
  std::string_view name(std::size_t i) const { return at(i).name; }
  /// Parameter `i`'s element type.
  dtype type(std::size_t i) const { return at(i).type; }
  /// Parameter `i`'s element count.
  std::size_t numel(std::size_t i) const { return at(i).param.numel(); }
  /// Parameter `i`'s shape, in memory order (see the class comment).
  const std::vector<std::int64_t>& shape(std::size_t i) const { return at(i).shape; }
  /// The registered storage of parameter `i` (checked: raises as `check(i)` when it moved).
  void* data(std::size_t i) const {
    check(i);
    return at(i).param.data;
  }
  /// The registered storage of parameter `i`'s gradient (checked as `data`).
  void* grad(std::size_t i) const {
    check(i);
    return at(i).grad.data;
  }

  /// Raises `errc::usage`, naming the parameter and the old and new sizes, when a registered
  /// `Matrix` or `Array` (parameter or gradient) no longer has the storage it had at `add`:
  /// resized, assigned from another size, swapped.
  /// \code
  /// params.check(0);
  /// \endcode
  void check(std::size_t i) const { check_at(i, -1); }
  /// `check(i)` for every parameter.
  /// \code
  /// params.check();  // e.g. after each optimizer step, in a debug build
  /// \endcode
  void check() const {
    for (std::size_t i = 0; i < entries_.size(); ++i) check_at(i, -1);
  }

  /// `check(i)`, then `dp.grad_ready(i)` (through `dp.grad_ready(params, i)`, which checks and
  /// tells the peers): the way an engine hands over gradient `i` during backward, so that a
  /// gradient matrix that moved is an error naming it on every rank, not a read of freed memory
  /// by the wrapper.
  /// \code
  /// gW = delta * input.transpose();
  /// params.grad_ready(dp, 0);
  /// \endcode
  template <class DataParallel>
  void grad_ready(DataParallel& dp, std::size_t i) const {
    // Through the wrapper's own check where it has one: a refusal then fails the wrapper and
    // reaches the peers, whose finish() quotes it instead of waiting for this rank.
    if constexpr (requires { dp.grad_ready(*this, i); }) {
      dp.grad_ready(*this, i);
    } else {
      check_at(i, dp.rank());
      dp.grad_ready(i);
    }
  }

  /// View mode (`dp_options::gradient_as_bucket_view`): gradient `i` lives in bucket memory at
  /// `dp.bucket_grad(i)`; this is an `Eigen::Map<M>` over it with the registered gradient's
  /// rows and columns, for backward to write into. The address stays valid for `dp`'s lifetime.
  /// `M` is a plain `Matrix` or `Array` type of the parameter's scalar type, with compatible
  /// fixed sizes and, unless a vector, the registered storage order. Throws `errc::usage` in
  /// copy mode (where the registered gradient is the one to write), `errc::invalid_argument`
  /// when `M` does not fit parameter `i`.
  /// \code
  /// ddp::data_parallel dp{pg, params, {}, {.gradient_as_bucket_view = true}};
  /// Eigen::Map<Eigen::MatrixXf> gW = params.grad_view<Eigen::MatrixXf>(dp, 0);
  /// gW.noalias() = delta * input.transpose();  // written straight into the bucket
  /// params.grad_ready(dp, 0);
  /// \endcode
  template <class M, class DataParallel>
  Eigen::Map<M> grad_view(DataParallel& dp, std::size_t i) const {
    static_assert(is_plain<M>,
                  "ddp::eigen_parameters::grad_view<M>: M must be a plain Eigen::Matrix or Eigen::Array type");
    static_assert(eigen_supported_scalar<typename M::Scalar>::value);
    const int rank = dp.rank();
    const entry& e = at(i, rank);
    const std::string label = "eigen_parameters::grad_view: " + label_of(i, e.name);
    if (!dp.options().gradient_as_bucket_view)
      detail::raise(errc::usage, rank,
                    label +
                        ": the wrapper is in copy mode (dp_options::gradient_as_bucket_view is false); "
                        "backward writes the registered gradient there",
                    -1, static_cast<int>(i));
    if (dp.size() != entries_.size())
      detail::raise(errc::invalid_argument, rank,
                    label + ": the wrapper holds " + std::to_string(dp.size()) + " parameters but " +
                        std::to_string(entries_.size()) + " are registered here; pass the wrapper built from these",
                    -1, static_cast<int>(i));
    const dtype want = eigen_dtype<typename M::Scalar>::value;
    if (want != e.type)
      detail::raise(errc::invalid_argument, rank,
                    label + ": Map of " + dtype_name(want) + " over a " + dtype_name(e.type) + " gradient", -1,
                    static_cast<int>(i));
    const auto rows = static_cast<Eigen::Index>(e.grad.rows), cols = static_cast<Eigen::Index>(e.grad.cols);
    auto* p = static_cast<typename M::Scalar*>(dp.bucket_grad(i));
    if constexpr (M::IsVectorAtCompileTime) {
      const auto n = static_cast<Eigen::Index>(e.grad.numel());
      if (M::SizeAtCompileTime != Eigen::Dynamic && M::SizeAtCompileTime != n)
        detail::raise(errc::invalid_argument, rank,
                      label + ": a vector type of " + std::to_string(M::SizeAtCompileTime) + " elements over " +
                          e.grad.describe(),
                      -1, static_cast<int>(i));
      if (!e.grad.vector && rows != 1 && cols != 1)
        detail::raise(errc::invalid_argument, rank, label + ": a vector type over " + e.grad.describe(), -1,
                      static_cast<int>(i));
      return Eigen::Map<M>(p, n);
    } else {
      if ((M::RowsAtCompileTime != Eigen::Dynamic && M::RowsAtCompileTime != rows) ||
          (M::ColsAtCompileTime != Eigen::Dynamic && M::ColsAtCompileTime != cols) ||
          (rows != 1 && cols != 1 && static_cast<bool>(M::IsRowMajor) != e.grad.row_major))
        detail::raise(errc::invalid_argument, rank,
                      label + ": a " + std::to_string(M::RowsAtCompileTime) + "x" +
                          std::to_string(M::ColsAtCompileTime) + (M::IsRowMajor ? " row-major" : " column-major") +
                          " type (-1: dynamic) over " + e.grad.describe(),
                      -1, static_cast<int>(i));
      return Eigen::Map<M>(p, rows, cols);
    }
  }

 private:
  struct extent {
    void* data = nullptr;
    Eigen::Index rows = 0, cols = 0;
  };
  using probe_fn = extent (*)(const void*);

  // Derived-to-base deduction, so that classes derived from Eigen's (VectorBlock derives from
  // Block, a user's from Matrix) count as what they derive from.
  template <class D>
  static std::true_type dense_test(const Eigen::DenseBase<D>*);
  static std::false_type dense_test(...);
  template <class D>
  static std::true_type plain_test(const Eigen::PlainObjectBase<D>*);
  static std::false_type plain_test(...);
  template <class T>
  static constexpr bool is_dense = decltype(dense_test(static_cast<T*>(nullptr)))::value;
  template <class T>
  static constexpr bool is_plain = decltype(plain_test(static_cast<T*>(nullptr)))::value;

  // One side (values or gradient) of a parameter: where it is, as registered, and for an
  // object that owns its storage, how to read where that storage is now.
  struct storage {
    void* data = nullptr;
    std::int64_t rows = 0, cols = 0;
    bool row_major = false;
    bool vector = false;  // one row or one column at compile time
    const void* object = nullptr;
    probe_fn probe = nullptr;

    std::size_t numel() const noexcept { return static_cast<std::size_t>(rows * cols); }
    std::vector<std::int64_t> shape() const {
      if (vector) return {rows * cols};
      return row_major ? std::vector<std::int64_t>{rows, cols} : std::vector<std::int64_t>{cols, rows};
    }
    std::string describe() const {
      return std::to_string(rows) + "x" + std::to_string(cols) +
             (vector      ? " (a vector)"
              : row_major ? " row-major"
                          : " column-major");
    }
  };

  struct entry {
    std::string name;
    dtype type = dtype::f32;
    storage param, grad;
    std::vector<std::int64_t> shape;
    buffer_kind kind = buffer_kind::buffer;  // buffers_ only
  };

  static std::string label_of(std::size_t i, std::string_view name) {
    std::string s = "parameter " + std::to_string(i);
    if (!name.empty()) s.append(" ('").append(name).append("')");
    return s;
  }

  // A shape with its extents of 1 left out: a VectorXf of n and an n x 1 MatrixXf agree.
  static std::vector<std::int64_t> squeezed(const std::vector<std::int64_t>& s) {
    std::vector<std::int64_t> out;
    for (auto d : s)
      if (d != 1) out.push_back(d);
    return out;
  }

  // What `add` records of one Eigen object; the compile-time checks of the class comment.
  template <class X, class D>
  static storage storage_of(D& x, const std::string& label, const char* side) {
    using T = std::remove_cvref_t<X>;
    constexpr bool plain = is_plain<T>;
    constexpr bool direct = (T::Flags & Eigen::DirectAccessBit) != 0;  // the checks below follow from it
    static_assert(direct,
                  "ddp::eigen_parameters::add: an Eigen expression without storage of its own (a product, a sum, "
                  "a cast...): register the Matrix, Array, Map or Ref that holds the values");
    static_assert(!plain || std::is_lvalue_reference_v<X>,
                  "ddp::eigen_parameters::add: a temporary matrix; register the engine's own object, whose "
                  "storage outlives the data_parallel wrapper");
    static_assert(
        !direct || (plain ? !std::is_const_v<std::remove_reference_t<X>> : (T::Flags & Eigen::LvalueBit) != 0),
        "ddp::eigen_parameters::add: a read-only object (a const matrix, a Map or Ref of const); ddp "
        "writes the parameter (rank 0's values at construction) and the gradient (the average)");
    static_assert(!direct || T::InnerStrideAtCompileTime == 1 || T::InnerStrideAtCompileTime == Eigen::Dynamic,
                  "ddp::eigen_parameters::add: a view with a compile-time inner stride other than 1 "
                  "(InnerStride<N>): ddp needs contiguous storage");
    storage s;
    if constexpr (direct) {  // else rejected above; this spares the errors that would follow
      s.data = const_cast<void*>(static_cast<const void*>(x.data()));
      s.rows = static_cast<std::int64_t>(x.rows());
      s.cols = static_cast<std::int64_t>(x.cols());
      s.row_major = T::IsRowMajor;
      s.vector = T::IsVectorAtCompileTime;
      if constexpr (plain) {
        s.object = static_cast<const void*>(&x);
        s.probe = [](const void* o) {
          const auto& m = *static_cast<const T*>(o);
          return extent{const_cast<void*>(static_cast<const void*>(m.data())), m.rows(), m.cols()};
        };
      } else {
        const bool gaps = (x.innerSize() > 1 && x.innerStride() != 1) ||
                          (x.outerSize() > 1 && x.outerStride() != x.innerSize() * x.innerStride());
        if (gaps)
          detail::raise(errc::invalid_argument, -1,
                        label + ": " + side + " is a view with gaps (" + s.describe() + ", inner stride " +
                            std::to_string(x.innerStride()) + ", outer stride " + std::to_string(x.outerStride()) +
                            "); ddp needs contiguous storage: register the whole matrix, or a Map, Ref or block "
                            "over contiguous memory");
      }
    }
    return s;
  }

  const entry& at(std::size_t i, int rank = -1) const {
    if (i >= entries_.size())
      detail::raise(errc::invalid_argument, rank,
                    "eigen_parameters: parameter " + std::to_string(i) + " does not exist (" +
                        std::to_string(entries_.size()) + " registered)",
                    -1, static_cast<int>(i));
    return entries_[i];
  }

  void check_at(std::size_t i, int rank) const {
    const entry& e = at(i, rank);
    verify(e.param, i, e.name, "the parameter", rank);
    verify(e.grad, i, e.name, "its gradient", rank);
  }

  static void verify(const storage& s, std::size_t i, std::string_view name, const char* side, int rank) {
    if (s.probe == nullptr) return;
    const extent now = s.probe(s.object);
    if (now.data == s.data && now.rows == s.rows && now.cols == s.cols) return;
    const bool same_size = now.rows == s.rows && now.cols == s.cols;
    detail::raise(errc::usage, rank,
                  label_of(i, name) + ": " + side + " no longer has the storage registered for it (" +
                      (same_size ? "same size " + std::to_string(s.rows) + "x" + std::to_string(s.cols) +
                                       ", other memory: reassigned or swapped"
                                 : "was " + std::to_string(s.rows) + "x" + std::to_string(s.cols) + ", now " +
                                       std::to_string(now.rows) + "x" + std::to_string(now.cols) + ": resized") +
                      "); a data_parallel wrapper built from these parameters still points at the old memory. "
                      "Give matrices their final size before registering them and keep it while a wrapper lives",
                  -1, static_cast<int>(i));
  }

  std::deque<entry> entries_;  // a deque: the names stay put as parameters are added
  std::deque<entry> buffers_;  // add_buffer: buffers and frozen parameters
};

/// `eigen_parameters` as a `ddp::parameter_set` (include/ddp/parameter.hpp).
template <>
struct parameter_traits<eigen_parameters> {
  static std::size_t size(const eigen_parameters& p) noexcept { return p.size(); }
  static void* data(const eigen_parameters& p, std::size_t i) { return p.data(i); }
  static void* grad(const eigen_parameters& p, std::size_t i) { return p.grad(i); }
  static std::size_t numel(const eigen_parameters& p, std::size_t i) { return p.numel(i); }
  static dtype type(const eigen_parameters& p, std::size_t i) { return p.type(i); }
  static std::string_view name(const eigen_parameters& p, std::size_t i) { return p.name(i); }
  static const std::vector<std::int64_t>& shape(const eigen_parameters& p, std::size_t i) { return p.shape(i); }
  static std::size_t buffer_count(const eigen_parameters& p) noexcept { return p.buffer_count(); }
  static buffer_view buffer(const eigen_parameters& p, std::size_t i) { return p.buffer(i); }
};

static_assert(parameter_set<eigen_parameters>);

}  // namespace DDP_ABI
}  // namespace ddp
