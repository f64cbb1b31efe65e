#pragma once
/// \file concepts.hpp
/// Every policy concept of ddp in one place: `parameter_set` (what a model exposes),
/// `bucket_planner` (how gradients are grouped), `reducer` (who reduces a flat buffer) and
/// `device_allocator` (where bucket buffers live). `basic_data_parallel` constrains its template
/// arguments with these; each is a conjunction of small named concepts, so a failed check names
/// the requirement that is missing. The optional hooks the wrapper uses when present are named
/// concepts too: `allocator_with_copy`, `allocator_with_zero`, `copying_allocator`,
/// `reducer_with_abort`, `reducer_with_failable_transport` and `allocator_bound_to`.
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
#include <string>
#include <type_traits>

#include <ddp/version.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/memory/allocator_concept.hpp>  // IWYU pragma: export
#include <ddp/parameter.hpp>                 // IWYU pragma: export
#include <ddp/planner/planner_concept.hpp>   // IWYU pragma: export
#include <ddp/process_group.hpp>
#include <ddp/request.hpp>
#include <ddp/transport/concept.hpp>  // IWYU pragma: export

namespace ddp {
inline namespace DDP_ABI {

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
concept has_barrier = requires(R& r) {
  r.barrier();
};

/// `r.rank()` and `r.size()` say where this process stands in the reducer's group.
template <class R>
concept has_rank_and_size = requires(const R& r) {
  { r.rank() } -> std::convertible_to<int>;
  { r.size() } -> std::convertible_to<int>;
};

/// A reducer policy: the untyped interface of `ddp::basic_reducer` that the data-parallel
/// wrapper drives. Collectives must run in issue order, so that ranks issuing the same sequence
/// of calls match them up. Optional extras the wrapper uses when present, each a named concept
/// below: `reducer_with_abort`, `reducer_with_failable_transport`, and allocators bound to the
/// reducer (`allocator_bound_to`).
/// \code
/// static_assert(ddp::reducer<ddp::tree<ddp::tcp>>);
/// \endcode
template <class R>
concept reducer = reducer_constructible_from_group<R> && has_allreduce_async<R> && has_broadcast_async<R> &&
    has_barrier<R> && has_rank_and_size<R>;

/// `r.abort()` exists (whether or not it may throw).
template <class R>
concept has_abort = requires(R& r) {
  r.abort();
};

/// Optional hook: `r.abort()`, `noexcept`, ends the reducer's collectives in flight on every
/// rank. The wrapper calls it when a failed step or its destructor finds collectives that do
/// not end; it runs on paths that must not throw, hence `noexcept`.
template <class R>
concept reducer_with_abort = requires(R& r) {
  { r.abort() }
  noexcept;
};

/// Optional hook: `r.transport().fail(errc, message)` fails the reducer's transport with a
/// cause that reaches the peers (tcp does), so that their errors quote this rank's cause.
template <class R>
concept reducer_with_failable_transport = requires(R& r, const std::string& message) {
  r.transport().fail(errc::aborted, message);
};

/// An allocator built from the reducer's transport, `A(r.transport())`: `shm_allocator` draws
/// bucket buffers from the arena of `ring<shm>`'s own `shm`.
template <class A, class R>
concept allocator_bound_to_transport = requires(R& r) {
  typename R::transport_type;
  r.transport();
  requires std::constructible_from<A, typename R::transport_type&>;
};

/// An allocator built from the reducer itself, `A::for_reducer(r)`: `cuda_allocator` takes the
/// device and stream of `nccl_reducer`.
template <class A, class R>
concept allocator_bound_to_reducer = requires(R& r) {
  { A::for_reducer(r) } -> std::same_as<A>;
};

/// A reducer that decorates another, `r.inner()` (`ddp::hooked`): an allocator bound to the
/// inner reducer is bound to the decorator too, so that buckets live where the inner reducer
/// reads them fastest.
template <class A, class R>
concept allocator_bound_through_inner = requires(R& r) {
  r.inner();
  requires allocator_bound_to_reducer<A, std::remove_reference_t<decltype(r.inner())>> ||
      allocator_bound_to_transport<A, std::remove_reference_t<decltype(r.inner())>>;
};

/// An allocator that the wrapper builds from its reducer (any way above) instead of
/// default-constructing it.
template <class A, class R>
concept allocator_bound_to =
    allocator_bound_to_reducer<A, R> || allocator_bound_to_transport<A, R> || allocator_bound_through_inner<A, R>;

/// The allocator the wrapper uses with reducer `r`: bound to it when `allocator_bound_to`
/// (from the reducer first, then its transport, then the reducer it decorates), else
/// default-constructed.
/// \code
/// auto alloc = ddp::allocator_for<ddp::shm_allocator>(reducer);  // from reducer.transport()
/// \endcode
template <device_allocator A, class R>
A allocator_for(R& r) {
  if constexpr (allocator_bound_to_reducer<A, R>)
    return A::for_reducer(r);
  else if constexpr (allocator_bound_to_transport<A, R>)
    return A(r.transport());
  else if constexpr (requires { r.inner(); })
    return allocator_for<A>(r.inner());
  else
    return A{};
}

}  // namespace DDP_ABI
}  // namespace ddp
