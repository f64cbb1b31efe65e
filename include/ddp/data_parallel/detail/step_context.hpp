#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/step_context.hpp
/// `step_context`: the wrapper's parts that every step's mechanism works on, passed to each of
/// them once (step_sync, bucket_ops, join_protocol, shard_ops) instead of the same references
/// declared in each.
// IWYU pragma: private

#include <cstdint>
#include <vector>

#include <ddp/data_parallel/bucket_memory.hpp>
#include <ddp/data_parallel/bucket_state.hpp>
#include <ddp/data_parallel/buffers.hpp>
#include <ddp/data_parallel/detail/step_guard.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/parameter.hpp>
#include <ddp/process_group.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// References to the wrapper's members (which outlive every part holding a copy of this):
/// its group, options, parameters and buffers, bucket memory and state, reducer, failure
/// guard, and step counter.
template <class Reducer, class Allocator>
struct step_context {
  process_group& pg;
  const dp_options& opts;
  const std::vector<tensor_view>& views;
  const buffer_layout& buffers;
  bucket_memory<Allocator>& memory;
  bucket_state& state;
  Reducer& red;
  step_guard<Reducer>& guarded;
  const std::uint64_t& step;  ///< `finish()` calls so far
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
