#pragma once
/// \file planner_concept.hpp
/// The `bucket_planner` policy concept.

#include <concepts>
#include <cstddef>
#include <span>

#include <ddp/version.hpp>
#include <ddp/planner/bucket_plan.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// `p.plan(params, policy, order)` returns a `bucket_plan`.
///
/// `order` is empty (meaning reverse registration order) or a permutation of parameter indices
/// in the order gradients become ready. A planner must be deterministic: every rank calls it
/// with the same arguments and must get the same plan.
template <class P>
concept has_plan_function = requires(const P& p, std::span<const param_info> params, const bucket_policy& policy,
                                     std::span<const std::size_t> order) {
  { p.plan(params, policy, order) } -> std::same_as<bucket_plan>;
};

/// A bucket planner policy, e.g. `ddp::size_planner`.
/// \code
/// static_assert(ddp::bucket_planner<ddp::size_planner>);
/// \endcode
template <class P>
concept bucket_planner = std::default_initializable<P> && std::copy_constructible<P> && has_plan_function<P>;

}  // namespace DDP_ABI
}  // namespace ddp
