#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/setup_checks.hpp
/// `check_construction`: what a wrapper checks at construction before anything is planned:
/// memory the buckets can take from, and what every rank must agree on.
// IWYU pragma: private

#include <cstdint>
#include <span>
#include <vector>

#include <ddp/data_parallel/agreement.hpp>
#include <ddp/data_parallel/bucket_memory.hpp>
#include <ddp/data_parallel/detail/parameters.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/parameter.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// At construction, on every rank: the parameters and buffers are memory the buckets can take
/// from, ranks agree on them and on the options every rank must share, and there is at least
/// one parameter (an empty set is errc::invalid_argument on every rank, never a silent no-op).
template <class Allocator>
void check_construction(const agreement& agree, const bucket_memory<Allocator>& memory,
                        const std::vector<tensor_view>& views, const std::vector<buffer_view>& buffers,
                        const dp_options& opts, int rank) {
  memory.check_reachable(views, rank);
  memory.check_reachable(std::span<const buffer_view>(buffers), rank);
  agree.check_signatures(views);
  // Every rank has the same count now: an empty set fails on every rank alike.
  if (views.empty()) raise_empty(rank, buffers.size());
  agree.check_buffer_signatures(buffers);
  agree.check_same("dp_options::uneven_inputs", opts.uneven_inputs ? 1 : 0);
  agree.check_same("dp_options::shard", opts.shard ? 1 : 0);
  agree.check_same("dp_options::find_unused_parameters", opts.find_unused_parameters ? 1 : 0);
  agree.check_same("dp_options::buffers (0 broadcast, 1 average, 2 none)", static_cast<std::uint64_t>(opts.buffers));
  agree.check_same("dp_options::divide_by (0 world_size, 1 contributors)", static_cast<std::uint64_t>(opts.divide_by));
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
