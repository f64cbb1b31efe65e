#pragma once
/// \file bucket_tag.hpp
/// `ddp::bucket_tag`: which bucket of which step a collective serves, passed with the call
/// (`allreduce_async(data, count, dtype, op, tag)`). The data-parallel wrapper tags each
/// bucket's collective; the reducer's flight record names the bucket and step from it
/// (docs/forensics.md) and a communication hook (reducer/hooked.hpp) receives the bucket's
/// tensors from it (PowerSGD reads their shapes). A collective a program issues itself carries
/// the empty tag. Reducers that take no tag still work under the wrapper: it passes the tag
/// only where `ddp::reducer_with_bucket_tag` holds (below).
///
/// \code
/// const ddp::comm_tensor t[] = {{.param = 0, .offset = 0, .numel = 6, .rows = 2}};
/// const ddp::bucket_tag tag{.bucket = 3, .step = 7, .tensors = t};
/// static_assert(ddp::bucket_tag{}.bucket == -1);
/// \endcode

#include <cstddef>
#include <cstdint>
#include <span>

#include <ddp/version.hpp>
#include <ddp/dtype.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// One tensor packed in a bucket, as the data-parallel wrapper hands it to a communication hook
/// (comm_bucket::tensors in reducer/hooked.hpp): the gradient of parameter `param` at elements
/// [offset, offset + numel) of the bucket. `rows` is the parameter's first dimension (its numel
/// when it has no shape), so the gradient is a rows x cols() matrix in row-major order, the
/// view PyTorch's PowerSGD takes of it.
struct comm_tensor {
  std::size_t param = 0;
  std::size_t offset = 0;
  std::size_t numel = 0;
  std::size_t rows = 0;
  std::size_t cols() const noexcept { return rows == 0 ? 0 : numel / rows; }
  friend bool operator==(const comm_tensor&, const comm_tensor&) = default;
};

/// The bucket a collective serves: its index in the wrapper's plan (launch order, the same on
/// every rank), the wrapper's step, and the tensors packed in it, in buffer order (a view: valid
/// until the collective has completed). All empty (-1, none) for a collective a program issues
/// itself.
struct bucket_tag {
  std::int32_t bucket = -1;
  std::int64_t step = -1;
  std::span<const comm_tensor> tensors{};
};

/// A reducer whose `allreduce_async` takes the bucket_tag as a fifth argument (every reducer
/// of ddp; its reduce_scatter_async and allgather_async take one too). The wrapper passes
/// the tag where the reducer takes it and leaves it out otherwise.
template <class R>
concept reducer_with_bucket_tag = requires(R& r, void* data, std::size_t count, dtype t, op o, const bucket_tag& tag) {
  r.allreduce_async(data, count, t, o, tag);
};

}  // namespace DDP_ABI
}  // namespace ddp
