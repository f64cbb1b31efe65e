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
#include <cstring>
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
  /// Where the tensors' data is instead of the buffer: sources[k] holds tensors[k]'s elements
  /// (nullptr: in the buffer). An allreduce reads them there and writes each tensor's result
  /// there too (the buffer's elements of a tensor with a source are left unspecified). The
  /// wrapper's copy mode passes the gradients so, instead of copying each in and its average
  /// back, to a reducer that says it reads them (`reads_sources()`, the ring over tcp); a
  /// reducer that does not copies them into the buffer first and the results back after.
  /// Used until the collective has completed. Empty: the buffer holds everything.
  std::span<void* const> sources{};
};

namespace detail {
/// Copies the tensors whose data is elsewhere (bucket_tag::sources) into `data`, a buffer of
/// elements of `t`: what a reducer that does not read sources in place does first.
inline void gather_sources(void* data, dtype t, const bucket_tag& tag) noexcept {
  const std::size_t es = dtype_size(t);
  for (std::size_t k = 0; k < tag.sources.size() && k < tag.tensors.size(); ++k)
    if (const void* src = tag.sources[k]; src != nullptr) {
      auto* dst = static_cast<unsigned char*>(data) + tag.tensors[k].offset * es;
      if (dst != src) std::memcpy(dst, src, tag.tensors[k].numel * es);
    }
}
/// The results back where the sources are: what such a reducer does after.
inline void scatter_sources(const void* data, dtype t, std::span<const comm_tensor> tensors,
                            std::span<void* const> sources) noexcept {
  const std::size_t es = dtype_size(t);
  for (std::size_t k = 0; k < sources.size() && k < tensors.size(); ++k)
    if (void* dst = sources[k]; dst != nullptr) {
      const auto* src = static_cast<const unsigned char*>(data) + tensors[k].offset * es;
      if (dst != src) std::memcpy(dst, src, tensors[k].numel * es);
    }
}
/// `tag` once its sources are in the buffer (gather_sources): what the collectives that
/// follow are passed, so that none reads the sources again.
inline bucket_tag without_sources(bucket_tag tag) noexcept {
  tag.sources = {};
  return tag;
}
}  // namespace detail

/// A reducer whose `allreduce_async` takes the bucket_tag as a fifth argument (every reducer
/// of ddp; its reduce_scatter_async and allgather_async take one too). The wrapper passes
/// the tag where the reducer takes it and leaves it out otherwise.
template <class R>
concept reducer_with_bucket_tag = requires(R& r, void* data, std::size_t count, dtype t, op o, const bucket_tag& tag) {
  r.allreduce_async(data, count, t, o, tag);
};

}  // namespace DDP_ABI
}  // namespace ddp
