#pragma once
/// \file parameter.hpp
/// What ddp needs to know about a model's parameters, and how any container describes them.
///
/// The library works internally on `ddp::tensor_view`s: a type-erased (data, grad, numel, dtype,
/// device, name, shape) record per parameter. A user's own container becomes usable by
/// specializing `ddp::parameter_traits<Container>` with a handful of static functions; the
/// `ddp::parameter_set` concept checks that specialization piece by piece, so a compiler error
/// names the missing piece (`has_parameter_grad`, ...). `std::vector<tensor_view>`,
/// `std::span<tensor_view>` and any other random-access range of `tensor_view` work as they are.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// One trainable parameter: its values, its gradient and what they look like.
///
/// `data` and `grad` are not owned. `device` is -1 for host memory and the CUDA device index
/// otherwise. `shape` is compared across ranks at construction, so two parameters of equal
/// `numel` but different layout are still told apart; an empty shape means "flat".
/// \code
/// std::vector<float> w(1024), gw(1024);
/// ddp::tensor_view v = ddp::make_tensor_view(std::span{w}, std::span{gw}, "fc.weight", {32, 32});
/// \endcode
struct tensor_view {
  void* data = nullptr;
  void* grad = nullptr;
  std::size_t numel = 0;
  dtype type = dtype::f32;
  int device = -1;
  std::string_view name{};
  std::vector<std::int64_t> shape{};

  /// Size of the gradient (and of the data) in bytes.
  std::size_t bytes() const noexcept { return numel * dtype_size(type); }

  friend bool operator==(const tensor_view&, const tensor_view&) = default;
};

/// Builds a `tensor_view` over typed storage.
///
/// Throws `ddp::error` (`errc::invalid_argument`) when `grad` and `data` differ in size, or when
/// a non-empty `shape` does not multiply out to `data.size()`; the message names the parameter.
/// An empty `shape` becomes `{data.size()}`.
/// \code
/// auto v = ddp::make_tensor_view(std::span{weights}, std::span{grads}, "conv1.weight", {64, 3, 7, 7});
/// \endcode
template <element T>
requires(!std::is_const_v<T>) tensor_view
    make_tensor_view(std::span<T> data, std::span<T> grad, std::string_view name = {},
                     std::vector<std::int64_t> shape = {}) {
  const auto label = [&] {
    return name.empty() ? std::string("unnamed parameter") : "parameter '" + std::string(name) + "'";
  };
  if (grad.size() != data.size()) {
    detail::raise(errc::invalid_argument, -1,
                  label() + ": gradient has " + std::to_string(grad.size()) + " elements but data has " +
                      std::to_string(data.size()));
  }
  if (shape.empty()) {
    shape.push_back(static_cast<std::int64_t>(data.size()));
  } else {
    std::int64_t product = 1;
    for (auto d : shape) {
      if (d < 0) detail::raise(errc::invalid_argument, -1, label() + ": negative extent in shape");
      product *= d;
    }
    if (static_cast<std::size_t>(product) != data.size()) {
      detail::raise(errc::invalid_argument, -1,
                    label() + ": shape holds " + std::to_string(product) + " elements but data has " +
                        std::to_string(data.size()));
    }
  }
  return tensor_view{static_cast<void*>(data.data()),
                     static_cast<void*>(grad.data()),
                     data.size(),
                     dtype_of_v<T>,
                     -1,
                     name,
                     std::move(shape)};
}

/// Same as the `std::span` overload, for any contiguous ranges (e.g. `std::vector<float>&`).
template <std::ranges::contiguous_range D, std::ranges::contiguous_range G>
requires std::same_as<std::ranges::range_value_t<D>, std::ranges::range_value_t<G>> &&
    element<std::ranges::range_value_t<D>> &&
    (!std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<D>>>)&&(
        !std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<G>>>)tensor_view
    make_tensor_view(D&& data, G&& grad, std::string_view name = {}, std::vector<std::int64_t> shape = {}) {
  using T = std::ranges::range_value_t<D>;
  return make_tensor_view(std::span<T>(std::ranges::data(data), std::ranges::size(data)),
                          std::span<T>(std::ranges::data(grad), std::ranges::size(grad)), name, std::move(shape));
}

/// Customization point: how ddp reads parameter `i` of a container `C`.
///
/// Specialize it for your own model type with static functions taking `(const C&)` or
/// `(const C&, std::size_t i)`:
///
/// | function          | returns                                   | required |
/// |-------------------|-------------------------------------------|----------|
/// | `size(c)`         | number of parameters                      | yes      |
/// | `data(c, i)`      | `void*` (or any non-const object pointer) | yes      |
/// | `grad(c, i)`      | `void*` (or any non-const object pointer) | yes      |
/// | `numel(c, i)`     | element count                             | yes      |
/// | `type(c, i)`      | `ddp::dtype`                              | yes      |
/// | `device(c, i)`    | `int`, -1 for host                        | no (-1)  |
/// | `name(c, i)`      | `std::string_view` that outlives the use  | no ("")  |
/// | `shape(c, i)`     | range of integers                         | no ({numel}) |
///
/// The container is read through `const C&` because ddp never changes which parameters there
/// are; the pointers it hands out are still writable, since gradients are written back.
/// \code
/// template <> struct ddp::parameter_traits<my_model> {
///   static std::size_t size(const my_model& m) { return m.layers.size(); }
///   static void* data(const my_model& m, std::size_t i) { return m.layers[i].w; }
///   static void* grad(const my_model& m, std::size_t i) { return m.layers[i].gw; }
///   static std::size_t numel(const my_model& m, std::size_t i) { return m.layers[i].n; }
///   static ddp::dtype type(const my_model&, std::size_t) { return ddp::dtype::f32; }
/// };
/// \endcode
template <class C>
struct parameter_traits {};

/// The built-in adapter: any random-access range whose elements are `tensor_view`.
template <class C>
requires std::ranges::random_access_range<const C> && std::ranges::sized_range<const C> &&
    std::same_as<std::ranges::range_value_t<const C>, tensor_view>
struct parameter_traits<C> {
  static std::size_t size(const C& c) { return static_cast<std::size_t>(std::ranges::size(c)); }
  static const tensor_view& at(const C& c, std::size_t i) {
    return std::ranges::begin(c)[static_cast<std::ranges::range_difference_t<const C>>(i)];
  }
  static void* data(const C& c, std::size_t i) { return at(c, i).data; }
  static void* grad(const C& c, std::size_t i) { return at(c, i).grad; }
  static std::size_t numel(const C& c, std::size_t i) { return at(c, i).numel; }
  static dtype type(const C& c, std::size_t i) { return at(c, i).type; }
  static int device(const C& c, std::size_t i) { return at(c, i).device; }
  static std::string_view name(const C& c, std::size_t i) { return at(c, i).name; }
  static const std::vector<std::int64_t>& shape(const C& c, std::size_t i) { return at(c, i).shape; }
};

namespace detail {
template <class C>
using traits_of = parameter_traits<std::remove_cvref_t<C>>;

template <class P>
concept writable_object_pointer =
    std::is_pointer_v<P> && !std::is_const_v<std::remove_pointer_t<P>> && !std::is_function_v<std::remove_pointer_t<P>>;
}  // namespace detail

/// `parameter_traits<C>::size(c)` gives the parameter count.
template <class C>
concept has_parameter_count = requires(const C& c) {
  { detail::traits_of<C>::size(c) } -> std::convertible_to<std::size_t>;
};

/// `parameter_traits<C>::data(c, i)` gives a writable pointer to parameter i's values.
template <class C>
concept has_parameter_data = requires(const C& c, std::size_t i) {
  { detail::traits_of<C>::data(c, i) } -> detail::writable_object_pointer;
};

/// `parameter_traits<C>::grad(c, i)` gives a writable pointer to parameter i's gradient.
template <class C>
concept has_parameter_grad = requires(const C& c, std::size_t i) {
  { detail::traits_of<C>::grad(c, i) } -> detail::writable_object_pointer;
};

/// `parameter_traits<C>::numel(c, i)` gives parameter i's element count.
template <class C>
concept has_parameter_numel = requires(const C& c, std::size_t i) {
  { detail::traits_of<C>::numel(c, i) } -> std::convertible_to<std::size_t>;
};

/// `parameter_traits<C>::type(c, i)` gives parameter i's `ddp::dtype`.
template <class C>
concept has_parameter_dtype = requires(const C& c, std::size_t i) {
  { detail::traits_of<C>::type(c, i) } -> std::same_as<dtype>;
};

/// Optional: `parameter_traits<C>::device(c, i)`; host (-1) when absent.
template <class C>
concept has_parameter_device = requires(const C& c, std::size_t i) {
  { detail::traits_of<C>::device(c, i) } -> std::convertible_to<int>;
};

/// Optional: `parameter_traits<C>::name(c, i)`; must not return a temporary `std::string`,
/// since the view keeps only a `std::string_view` to it.
template <class C>
concept has_parameter_name = requires(const C& c, std::size_t i) {
  { detail::traits_of<C>::name(c, i) } -> std::convertible_to<std::string_view>;
};

/// Optional: `parameter_traits<C>::shape(c, i)`, a range of integers.
template <class C>
concept has_parameter_shape = requires(const C& c, std::size_t i) {
  { detail::traits_of<C>::shape(c, i) } -> std::ranges::input_range;
  requires std::integral<std::ranges::range_value_t<decltype(detail::traits_of<C>::shape(c, i))>>;
};

/// A container ddp can train: a parameter count and, per parameter, data, grad, numel and dtype.
///
/// Each requirement is its own named concept, so a failed check names what is missing.
/// \code
/// static_assert(ddp::parameter_set<std::vector<ddp::tensor_view>>);
/// \endcode
template <class C>
concept parameter_set = has_parameter_count<C> && has_parameter_data<C> && has_parameter_grad<C> &&
    has_parameter_numel<C> && has_parameter_dtype<C>;

/// Normalizes any `parameter_set` into views; the wrapper works on these internally.
///
/// Throws `ddp::error` (`errc::invalid_argument`, with the parameter index) when a parameter with
/// elements has a null data or gradient pointer, or when its shape disagrees with its numel.
/// \code
/// std::vector<ddp::tensor_view> views = ddp::to_views(model);
/// \endcode
template <parameter_set C>
std::vector<tensor_view> to_views(const C& c) {
  using traits = detail::traits_of<C>;
  if constexpr (has_parameter_name<C>) {
    static_assert(!std::is_same_v<decltype(traits::name(c, std::size_t{})), std::string>,
                  "parameter_traits<C>::name must return a view or a reference that outlives "
                  "the container's use, not a temporary std::string");
  }
  const std::size_t n = static_cast<std::size_t>(traits::size(c));
  std::vector<tensor_view> out;
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    tensor_view v;
    v.data = static_cast<void*>(traits::data(c, i));
    v.grad = static_cast<void*>(traits::grad(c, i));
    v.numel = static_cast<std::size_t>(traits::numel(c, i));
    v.type = traits::type(c, i);
    if constexpr (has_parameter_device<C>) v.device = static_cast<int>(traits::device(c, i));
    if constexpr (has_parameter_name<C>) v.name = std::string_view(traits::name(c, i));
    if constexpr (has_parameter_shape<C>) {
      for (auto d : traits::shape(c, i)) v.shape.push_back(static_cast<std::int64_t>(d));
    }
    if (v.shape.empty()) v.shape.push_back(static_cast<std::int64_t>(v.numel));

    const auto label = [&] {
      std::string s = "parameter " + std::to_string(i);
      if (!v.name.empty()) s += " ('" + std::string(v.name) + "')";
      return s;
    };
    if (v.numel != 0 && (v.data == nullptr || v.grad == nullptr)) {
      detail::raise(errc::invalid_argument, -1,
                    label() + ": null " + (v.data == nullptr ? "data" : "gradient") + " pointer", -1,
                    static_cast<int>(i));
    }
    std::int64_t product = 1;
    for (auto d : v.shape) product *= d;
    if (product < 0 || static_cast<std::size_t>(product) != v.numel) {
      detail::raise(
          errc::invalid_argument, -1,
          label() + ": shape holds " + std::to_string(product) + " elements but numel is " + std::to_string(v.numel),
          -1, static_cast<int>(i));
    }
    out.push_back(std::move(v));
  }
  return out;
}

// ---- buffers: the rest of a model's state ----------------------------------------------------

/// What a buffer is, which says when ranks make it alike (docs/engines.md, "What is synchronized").
enum class buffer_kind : std::uint8_t {
  /// State that the forward pass updates, such as BatchNorm's running statistics: rank 0's at
  /// construction and, by default, after every synchronized step (`dp_options::buffers`).
  buffer,
  /// A parameter that is not trained (frozen, `requires_grad = false`): rank 0's at construction
  /// only, as PyTorch's DistributedDataParallel broadcasts every parameter once.
  frozen_parameter,
};

/// One piece of a model's state that is not a trained parameter: a buffer or a frozen parameter.
/// Like `tensor_view`, not owned; it has no gradient.
/// \code
/// std::vector<float> running_mean(64);
/// ddp::buffer_view b = ddp::make_buffer_view(std::span{running_mean}, "bn1.running_mean");
/// \endcode
struct buffer_view {
  void* data = nullptr;
  std::size_t numel = 0;
  dtype type = dtype::f32;
  int device = -1;
  std::string_view name{};
  std::vector<std::int64_t> shape{};
  buffer_kind kind = buffer_kind::buffer;
  /// Size of the values in bytes.
  std::size_t bytes() const noexcept { return numel * dtype_size(type); }
  friend bool operator==(const buffer_view&, const buffer_view&) = default;
};

/// Builds a `buffer_view` over typed storage; an empty `shape` becomes `{data.size()}`. Throws
/// `errc::invalid_argument` when a non-empty `shape` does not multiply out to `data.size()`.
/// \code
/// auto b = ddp::make_buffer_view(std::span{frozen_embedding}, "embed.weight", {1000, 64},
///                                ddp::buffer_kind::frozen_parameter);
/// \endcode
template <element T>
requires(!std::is_const_v<T>) buffer_view
    make_buffer_view(std::span<T> data, std::string_view name = {}, std::vector<std::int64_t> shape = {},
                     buffer_kind kind = buffer_kind::buffer) {
  auto v = make_tensor_view(data, data, name, std::move(shape));  // the same shape checks
  return buffer_view{v.data, v.numel, v.type, -1, name, std::move(v.shape), kind};
}

/// Optional part of `parameter_traits<C>`: `buffer_count(c)` and `buffer(c, i)` (a `buffer_view`)
/// describe the model's buffers and frozen parameters, which the wrapper keeps equal across ranks
/// and checkpoints save. A container without them has none.
template <class C>
concept has_buffers = requires(const C& c, std::size_t i) {
  { detail::traits_of<C>::buffer_count(c) } -> std::convertible_to<std::size_t>;
  { detail::traits_of<C>::buffer(c, i) } -> std::convertible_to<buffer_view>;
};

/// The buffers of any `parameter_set` (none without `has_buffers`), checked as `to_views` checks
/// parameters: `errc::invalid_argument` naming the buffer for a null data pointer or a shape that
/// disagrees with its numel.
/// \code
/// std::vector<ddp::buffer_view> state = ddp::to_buffer_views(model);
/// \endcode
template <parameter_set C>
std::vector<buffer_view> to_buffer_views(const C& c) {
  std::vector<buffer_view> out;
  if constexpr (has_buffers<C>) {
    using traits = detail::traits_of<C>;
    const std::size_t n = static_cast<std::size_t>(traits::buffer_count(c));
    out.reserve(n);
    for (std::size_t i = 0; i < n; ++i) {
      buffer_view v = traits::buffer(c, i);
      if (v.shape.empty()) v.shape.push_back(static_cast<std::int64_t>(v.numel));
      const auto label = [&] {
        return "buffer " + std::to_string(i) + (v.name.empty() ? std::string() : " ('" + std::string(v.name) + "')");
      };
      if (v.numel != 0 && v.data == nullptr) detail::raise(errc::invalid_argument, -1, label() + ": null data pointer");
      std::int64_t product = 1;
      for (auto d : v.shape) product *= d;
      if (product < 0 || static_cast<std::size_t>(product) != v.numel)
        detail::raise(
            errc::invalid_argument, -1,
            label() + ": shape holds " + std::to_string(product) + " elements but numel is " + std::to_string(v.numel));
      out.push_back(std::move(v));
    }
  }
  return out;
}

/// A `parameter_set` with buffers beside it, for containers that have no buffer traits of their
/// own (a `std::vector<tensor_view>`, say); a container's own buffers come first. Made by `ddp::with_buffers`; holds
/// the parameter set by reference when given an lvalue, by value otherwise.
template <class P>
class buffered_parameters {
 public:
  buffered_parameters(P params, std::vector<buffer_view> buffers)
      : params_(std::forward<P>(params)), buffers_(std::move(buffers)) {}
  const std::remove_cvref_t<P>& parameters() const noexcept { return params_; }
  const std::vector<buffer_view>& buffers() const noexcept { return buffers_; }

 private:
  P params_;
  std::vector<buffer_view> buffers_;
};

/// `params` with `buffers`: what the wrapper and checkpoints take to keep a whole model in step.
/// \code
/// ddp::data_parallel dp{pg, ddp::with_buffers(views, {ddp::make_buffer_view(std::span{stats}, "bn.stats")})};
/// \endcode
template <parameter_set P>
buffered_parameters<P> with_buffers(P&& params, std::vector<buffer_view> buffers) {
  return buffered_parameters<P>(std::forward<P>(params), std::move(buffers));
}

template <class P>
struct parameter_traits<buffered_parameters<P>> {
  using self = buffered_parameters<P>;
  using inner = detail::traits_of<P>;
  static std::size_t size(const self& s) { return static_cast<std::size_t>(inner::size(s.parameters())); }
  static void* data(const self& s, std::size_t i) { return static_cast<void*>(inner::data(s.parameters(), i)); }
  static void* grad(const self& s, std::size_t i) { return static_cast<void*>(inner::grad(s.parameters(), i)); }
  static std::size_t numel(const self& s, std::size_t i) {
    return static_cast<std::size_t>(inner::numel(s.parameters(), i));
  }
  static dtype type(const self& s, std::size_t i) { return inner::type(s.parameters(), i); }
  static int device(const self& s, std::size_t i) {
    if constexpr (has_parameter_device<P>)
      return static_cast<int>(inner::device(s.parameters(), i));
    else
      return -1;
  }
  static std::string_view name(const self& s, std::size_t i) {
    if constexpr (has_parameter_name<P>) {
      static_assert(!std::is_same_v<decltype(inner::name(s.parameters(), i)), std::string>,
                    "parameter_traits<C>::name must return a view or a reference that outlives the container's use, "
                    "not a temporary std::string");
      return std::string_view(inner::name(s.parameters(), i));
    } else {
      return {};
    }
  }
  static std::vector<std::int64_t> shape(const self& s, std::size_t i) {
    std::vector<std::int64_t> out;
    if constexpr (has_parameter_shape<P>)
      for (auto d : inner::shape(s.parameters(), i)) out.push_back(static_cast<std::int64_t>(d));
    return out;  // empty: {numel}
  }
  // The parameter set's own buffers (a torch_parameters' BatchNorm statistics), then the added ones.
  static std::size_t own_buffers(const self& s) {
    if constexpr (has_buffers<P>)
      return static_cast<std::size_t>(inner::buffer_count(s.parameters()));
    else
      return 0;
  }
  static std::size_t buffer_count(const self& s) { return own_buffers(s) + s.buffers().size(); }
  static buffer_view buffer(const self& s, std::size_t i) {
    const std::size_t own = own_buffers(s);
    if constexpr (has_buffers<P>)
      if (i < own) return inner::buffer(s.parameters(), i);
    return s.buffers().at(i - own);
  }
};

/// The whole state of a model as views: every parameter, then every buffer and frozen parameter
/// (whose `grad` is its `data`). What checkpoints save and load.
/// \code
/// for (const auto& v : ddp::to_state_views(model)) std::printf("%s\n", std::string(v.name).c_str());
/// \endcode
template <parameter_set C>
std::vector<tensor_view> to_state_views(const C& c) {
  auto out = to_views(c);
  for (auto& b : to_buffer_views(c))
    out.push_back(tensor_view{b.data, b.data, b.numel, b.type, b.device, b.name, std::move(b.shape)});
  return out;
}

}  // namespace DDP_ABI
}  // namespace ddp
