#pragma once
// The toy model the suites train, written once: parameters in order, each with its values and
// gradient (zeroed storage of its own), dtype, name and shape, and `views`, what a wrapper or a
// checkpoint is given. tests/multiproc (data_parallel, join, checkpoint, powersgd, lifetimes,
// sharded, buffers), tests/faults and tests/timeline give it their layout and values, directly or
// in a struct derived from it:
//   ddp_test::toy_model m({1000, 17, 4096});      // flat f32 parameters p0, p1, p2, all zero
//   m.add(24, ddp::dtype::f64, {4, 6}, "fc.b");  // one more, shaped and named
//   m.fill_data(1.0);                             // or [&](std::size_t i, std::size_t j) { ... }
//   m.grad<float>(0)[5] = 2;                      // any dtype: set(m.grad(i), m.type(i), j, v)
// It moves but does not copy (the views point into it), is shallow const like a view, and needs
// no doctest and no fork.

#include <ddp/dtype.hpp>
#include <ddp/parameter.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace ddp_test {

class toy_model {
 public:
  std::vector<ddp::tensor_view> views;  ///< one per parameter; a case may change a field (device)

  toy_model() = default;
  /// Flat parameters p0, p1, ... of `sizes` elements of `type`.
  explicit toy_model(const std::vector<std::size_t>& sizes, ddp::dtype type = ddp::dtype::f32) {
    for (std::size_t n : sizes) add(n, type);
  }

  /// Adds a parameter of `numel` elements of `type`, values and gradient zero (no storage when
  /// empty); shaped {numel} unless `shape` says otherwise (unchecked: a case may want a wrong
  /// one), named "p" and its index unless `name` is given.
  toy_model& add(std::size_t numel, ddp::dtype type = ddp::dtype::f32, std::vector<std::int64_t> shape = {},
                 std::string name = {}) {
    const auto zeroed = [&] { return numel ? std::make_unique<std::byte[]>(numel * ddp::dtype_size(type)) : nullptr; };
    if (shape.empty()) shape.push_back(static_cast<std::int64_t>(numel));
    names_.push_back(name.empty() ? "p" + std::to_string(views.size()) : std::move(name));
    data_.push_back(zeroed());
    grad_.push_back(zeroed());
    views.push_back({data_.back().get(), grad_.back().get(), numel, type, -1, names_.back(), std::move(shape)});
    return *this;
  }

  std::size_t size() const { return views.size(); }
  std::size_t numel(std::size_t i) const { return views[i].numel; }
  ddp::dtype type(std::size_t i) const { return views[i].type; }
  const std::string& name(std::size_t i) const { return names_[i]; }
  std::size_t bytes() const { std::size_t b = 0; for (const auto& v : views) b += v.bytes(); return b; }

  /// Parameter i's values and gradient: untyped (for get and set), or as a span of T, which must
  /// be the element type of its dtype.
  void* data(std::size_t i) const { return data_[i].get(); }
  void* grad(std::size_t i) const { return grad_[i].get(); }
  template <ddp::element T>
  std::span<T> data(std::size_t i) const { return {static_cast<T*>(data(i)), of_type<T>(i)}; }
  template <ddp::element T>
  std::span<T> grad(std::size_t i) const { return {static_cast<T*>(grad(i)), of_type<T>(i)}; }
  /// A copy of parameter i's values, to compare with later ones.
  template <ddp::element T>
  std::vector<T> values(std::size_t i) const { return {data<T>(i).begin(), data<T>(i).end()}; }
  /// Every parameter's values (or gradients), one after the other: two states compared bit for bit.
  std::string data_bytes() const { return joined(data_); }
  std::string grad_bytes() const { return joined(grad_); }

  /// Element j of an array of dtype `t` at `p` (a parameter's or a bucket's), as a double.
  static double get(const void* p, ddp::dtype t, std::size_t j) {
    switch (t) {
      case ddp::dtype::f32: return static_cast<const float*>(p)[j];
      case ddp::dtype::f64: return static_cast<const double*>(p)[j];
      case ddp::dtype::f16: return static_cast<float>(static_cast<const ddp::half*>(p)[j]);
      case ddp::dtype::bf16: return static_cast<float>(static_cast<const ddp::bfloat16*>(p)[j]);
      case ddp::dtype::i32: return static_cast<const std::int32_t*>(p)[j];
      case ddp::dtype::i64: return static_cast<double>(static_cast<const std::int64_t*>(p)[j]);
    }
    throw std::logic_error("toy_model: no such dtype");
  }
  /// Sets element j of such an array to `v`, converted to the dtype (the 16-bit ones through float).
  static void set(void* p, ddp::dtype t, std::size_t j, double v) {
    switch (t) {
      case ddp::dtype::f32: static_cast<float*>(p)[j] = static_cast<float>(v); return;
      case ddp::dtype::f64: static_cast<double*>(p)[j] = v; return;
      case ddp::dtype::f16: static_cast<ddp::half*>(p)[j] = ddp::half(static_cast<float>(v)); return;
      case ddp::dtype::bf16: static_cast<ddp::bfloat16*>(p)[j] = ddp::bfloat16(static_cast<float>(v)); return;
      case ddp::dtype::i32: static_cast<std::int32_t*>(p)[j] = static_cast<std::int32_t>(v); return;
      case ddp::dtype::i64: static_cast<std::int64_t*>(p)[j] = static_cast<std::int64_t>(v); return;
    }
    throw std::logic_error("toy_model: no such dtype");
  }

  /// Sets element j of every parameter i to `f(i, j)`, or to `v`, converted to its dtype (set).
  template <std::invocable<std::size_t, std::size_t> F>
  void fill_data(F&& f) { fill(data_, f); }
  template <std::invocable<std::size_t, std::size_t> F>
  void fill_grad(F&& f) { fill(grad_, f); }
  void fill_data(double v) { fill(data_, [v](std::size_t, std::size_t) { return v; }); }
  void fill_grad(double v) { fill(grad_, [v](std::size_t, std::size_t) { return v; }); }

 private:
  using storage = std::vector<std::unique_ptr<std::byte[]>>;
  storage data_, grad_;
  std::deque<std::string> names_;  // a deque: adding one moves none of those the views point into

  template <class T>
  std::size_t of_type(std::size_t i) const {
    if (ddp::dtype_of_v<T> != type(i))
      throw std::logic_error("toy_model: parameter " + std::to_string(i) + " ('" + names_[i] + "') is of another type");
    return numel(i);
  }
  template <class F>
  void fill(const storage& to, F&& f) {
    for (std::size_t i = 0; i < size(); ++i)
      for (std::size_t j = 0; j < numel(i); ++j) set(to[i].get(), type(i), j, static_cast<double>(f(i, j)));
  }
  std::string joined(const storage& parts) const {
    std::string s;
    for (std::size_t i = 0; i < size(); ++i) s.append(reinterpret_cast<const char*>(parts[i].get()), views[i].bytes());
    return s;
  }
};

}  // namespace ddp_test
