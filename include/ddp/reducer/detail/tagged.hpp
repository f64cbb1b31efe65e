#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// Collectives with their bucket_tag (ddp/bucket_tag.hpp) for reducers that take one, and
// without it for a reducer of the user's that does not: the data-parallel wrapper and the
// built-in communication hooks issue every bucket's collective through these, so the flight
// record names the bucket and step of each, a hook's inner collectives included.

#include <cstddef>

#include <ddp/bucket_tag.hpp>
#include <ddp/clock.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/request.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

template <class R>
request allreduce_async_tagged(R& r, void* data, std::size_t count, dtype t, op o, const bucket_tag& tag) {
  if constexpr (reducer_with_bucket_tag<R>) {
    return r.allreduce_async(data, count, t, o, tag);
  } else {
    // A reducer without the tag works on the buffer alone, and the results could not be put
    // back where the sources are when it completes.
    if (!tag.sources.empty())
      raise(errc::unsupported, r.rank(), "allreduce with bucket_tag::sources on a reducer that takes no bucket_tag");
    return r.allreduce_async(data, count, t, o);
  }
}

/// Runs an allreduce through `r` and returns when it is done: the blocking call where the
/// reducer has one (it runs on the calling thread when nothing is queued), else async and wait.
/// What a communication hook calls on its inner reducer, with its bucket's tag.
template <class R>
void allreduce_now(R& r, void* data, std::size_t count, dtype t, op o, steady_clock::time_point deadline,
                   const bucket_tag& tag) {
  if constexpr (requires { r.allreduce(data, count, t, o, tag); })
    r.allreduce(data, count, t, o, tag);
  else if constexpr (requires { r.allreduce(data, count, t, o); })
    gather_sources(data, t, tag), r.allreduce(data, count, t, o), scatter_sources(data, t, tag.tensors, tag.sources);
  else
    allreduce_async_tagged(r, data, count, t, o, tag).wait(deadline);
}

template <class R>
request reduce_scatter_async_tagged(R& r, const void* in, void* out, std::size_t count_per_rank, dtype t, op o,
                                    const bucket_tag& tag) {
  if constexpr (requires { r.reduce_scatter_async(in, out, count_per_rank, t, o, tag); })
    return r.reduce_scatter_async(in, out, count_per_rank, t, o, tag);
  else
    return r.reduce_scatter_async(in, out, count_per_rank, t, o);
}

template <class R>
request allgather_async_tagged(R& r, const void* in, void* out, std::size_t count_per_rank, dtype t,
                               const bucket_tag& tag) {
  if constexpr (requires { r.allgather_async(in, out, count_per_rank, t, tag); })
    return r.allgather_async(in, out, count_per_rank, t, tag);
  else
    return r.allgather_async(in, out, count_per_rank, t);
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
