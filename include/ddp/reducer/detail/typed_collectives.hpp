#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The typed collectives (spans of ddp's element types) that every reducer offers on top of its
// untyped ones. A reducer derives from typed_collectives<itself> (CRTP), brings these overloads
// next to its own with `using`, and befriends the base so that it can reach its private
// `wait(const request&)`:
//
//   class my_reducer : public detail::typed_collectives<my_reducer> {
//     friend class detail::typed_collectives<my_reducer>;
//    public:
//     using typed_collectives::allreduce;
//     using typed_collectives::allreduce_async;
//     request allreduce_async(void*, std::size_t, dtype, op);   // and allreduce, broadcast_async,
//     ...                                                       // reduce_scatter_async,
//    private:                                                   // allgather_async, rank, size
//     void wait(const request&) const;
//   };

#include <cstddef>
#include <span>

#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/request.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

template <class Derived>
class typed_collectives {
 public:
  /// Starts an in-place allreduce of `v`.
  template <class T>
  request allreduce_async(std::span<T> v, op o) {
    static_assert(element<T>,
                  "ddp: allreduce element type must be float, double, ddp::half, ddp::bfloat16, "
                  "std::int32_t or std::int64_t");
    return self().allreduce_async(static_cast<void*>(v.data()), v.size(), dtype_of_v<T>, o);
  }
  /// In-place allreduce of `v`; returns when every rank's result is in `v`.
  template <class T>
  void allreduce(std::span<T> v, op o) {
    static_assert(element<T>,
                  "ddp: allreduce element type must be float, double, ddp::half, ddp::bfloat16, "
                  "std::int32_t or std::int64_t");
    self().allreduce(static_cast<void*>(v.data()), v.size(), dtype_of_v<T>, o);
  }
  /// Copies `root`'s `v` into every rank's `v`.
  template <class T>
  void broadcast(std::span<T> v, int root = 0) {
    static_assert(element<T>, "ddp: broadcast element type must be one of ddp's dtypes");
    self().wait(self().broadcast_async(static_cast<void*>(v.data()), v.size(), dtype_of_v<T>, root));
  }
  /// `in` holds size() slices of out.size() elements; rank r receives the reduction of slice r.
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, op o) {
    static_assert(element<T>, "ddp: reduce_scatter element type must be one of ddp's dtypes");
    if (in.size() != out.size() * static_cast<std::size_t>(self().size()))
      raise(errc::invalid_argument, self().rank(), "reduce_scatter: input must hold size() * output elements");
    self().wait(self().reduce_scatter_async(in.data(), out.data(), out.size(), dtype_of_v<T>, o));
  }
  /// Every rank's `in`, concatenated in rank order into `out`.
  template <class T>
  void allgather(std::span<const T> in, std::span<T> out) {
    static_assert(element<T>, "ddp: allgather element type must be one of ddp's dtypes");
    if (out.size() != in.size() * static_cast<std::size_t>(self().size()))
      raise(errc::invalid_argument, self().rank(), "allgather: output must hold size() * input elements");
    self().wait(self().allgather_async(in.data(), out.data(), in.size(), dtype_of_v<T>));
  }

 protected:
  typed_collectives() = default;
  ~typed_collectives() = default;

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
