#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/setup_checks.hpp
/// `check_construction`: what a wrapper checks at construction before anything is planned:
/// memory the buckets can take from, and what every rank must agree on; `start_from_rank0`:
/// every rank from rank 0's values.
// IWYU pragma: private

#include <cstdint>
#include <cstdio>
#include <string>
#include <span>
#include <vector>

#include <ddp/data_parallel/agreement.hpp>
#include <ddp/data_parallel/bucket_memory.hpp>
#include <ddp/data_parallel/detail/parameters.hpp>
#include <ddp/data_parallel/detail/xxh64.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/parameter.hpp>
#include <ddp/process_group.hpp>

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

/// Every rank starts from rank 0's parameters and buffers (the wrapper's construction). On a
/// group whose ranks hold equal state by the elastic protocol (process_group::expects_equal_state),
/// each rank hashes its values and the ranks compare the hashes: equal, nothing moves; different,
/// rank 0's values are broadcast after all, and rank 0 says on stderr that the promise did not
/// hold. Any other group (or values on a device, which the CPU cannot hash) broadcasts them.
template <class Reducer>
construction_stats start_from_rank0(const agreement& agree, Reducer& red, process_group& pg,
                                    std::span<const tensor_view> params, std::span<const buffer_view> buffers) {
  construction_stats built;
  xxh64 h;
  // Every rank decides alike whether to hash: the signatures, which every rank checked equal,
  // say where each value lives.
  if (pg.expects_equal_state() && agreement::hash_values(h, params) && agreement::hash_values(h, buffers)) {
    built.hashes_compared = true;
    built.differing = agree.ranks_differing(h.digest());
    if (built.differing.empty()) return built;
    built.hashes_differed = true;
    if (pg.rank() == 0) {
      std::string ranks;
      for (int r : built.differing) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      std::fprintf(stderr,
                   "[ddp.warning] rank 0: the group expected every rank to hold the same parameters and buffers (an "
                   "elastic group re-formed from ranks that hold the state of one step), but the values of rank(s) "
                   "%s differ from rank 0's: rank 0's are broadcast. The elastic protocol's promise did not hold: a "
                   "step applied on some ranks only, or values changed outside a committed step (docs/elastic.md)\n",
                   ranks.c_str());
    }
  }
  agreement::broadcast_values(red, params, pg.timeout());
  agreement::broadcast_values(red, buffers, pg.timeout());
  for (const auto& v : params) built.bytes_broadcast += v.bytes();
  for (const auto& v : buffers) built.bytes_broadcast += v.bytes();
  return built;
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
