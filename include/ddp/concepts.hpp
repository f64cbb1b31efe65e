#pragma once
/// \file concepts.hpp
/// Every policy concept of ddp in one place: `parameter_set` (what a model exposes),
/// `bucket_planner` (how gradients are grouped), `reducer` (who reduces a flat buffer) and
/// `device_allocator` (where bucket buffers live). `basic_data_parallel` constrains its template
/// arguments with these; each is a conjunction of small named concepts, so a failed check names
/// the requirement that is missing.
///
/// \code
/// #include <ddp/concepts.hpp>
/// static_assert(ddp::reducer<ddp::ring<ddp::tcp>>);
/// static_assert(ddp::bucket_planner<ddp::size_planner>);
/// static_assert(ddp::device_allocator<ddp::host_allocator>);
/// static_assert(ddp::parameter_set<std::vector<ddp::tensor_view>>);
/// \endcode

#include <concepts>
#include <cstddef>

#include <ddp/dtype.hpp>
#include <ddp/memory/allocator_concept.hpp>  // IWYU pragma: export
#include <ddp/parameter.hpp>                 // IWYU pragma: export
#include <ddp/planner/planner_concept.hpp>   // IWYU pragma: export
#include <ddp/process_group.hpp>
#include <ddp/request.hpp>
#include <ddp/transport/concept.hpp>  // IWYU pragma: export

namespace ddp {
inline namespace v0 {

/// `R{pg}` builds a reducer over a joined process group (a collective call on every rank).
template <class R>
concept reducer_constructible_from_group = std::constructible_from<R, process_group&>;

/// `r.allreduce_async(data, count, dtype, op)` starts an in-place allreduce and returns a
/// `ddp::request`.
template <class R>
concept has_allreduce_async = requires(R& r, void* data, std::size_t count, dtype t, op o) {
  { r.allreduce_async(data, count, t, o) } -> std::same_as<request>;
};

/// `r.broadcast_async(data, count, dtype, root)` copies root's buffer to every rank.
template <class R>
concept has_broadcast_async = requires(R& r, void* data, std::size_t count, dtype t, int root) {
  { r.broadcast_async(data, count, t, root) } -> std::same_as<request>;
};

/// `r.barrier()` blocks until every rank has called it.
template <class R>
concept has_barrier = requires(R& r) { r.barrier(); };

/// `r.rank()` and `r.size()` say where this process stands in the reducer's group.
template <class R>
concept has_rank_and_size = requires(const R& r) {
  { r.rank() } -> std::convertible_to<int>;
  { r.size() } -> std::convertible_to<int>;
};

/// A reducer policy: the untyped interface of `ddp::basic_reducer` that the data-parallel
/// wrapper drives. Collectives must run in issue order, so that ranks issuing the same sequence
/// of calls match them up. Optional extras the wrapper uses when present: `transport()` (an
/// allocator constructible from it is built that way, e.g. `shm_allocator`) and `abort()`
/// (called when a failed step leaves collectives in flight).
/// \code
/// static_assert(ddp::reducer<ddp::tree<ddp::tcp>>);
/// \endcode
template <class R>
concept reducer = reducer_constructible_from_group<R> && has_allreduce_async<R> && has_broadcast_async<R> &&
                  has_barrier<R> && has_rank_and_size<R>;

}  // namespace v0
}  // namespace ddp
