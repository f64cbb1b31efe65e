#pragma once
/// \file fwd.hpp
/// Forward declarations of ddp's public classes, and the one place that names the wrapper's
/// default policies (nlohmann's `json_fwd.hpp` idea). A header that only passes a
/// `ddp::process_group&` or holds a `ddp::data_parallel*` includes this instead of the whole
/// library; the definitions come from the headers named beside each declaration.
///
/// \code
/// #include <ddp/fwd.hpp>
/// void train_epoch(ddp::process_group& pg, ddp::data_parallel& dp);  // defined elsewhere
/// \endcode
///
/// `basic_data_parallel`'s defaults are given here and only here: `ddp::data_parallel` is
/// `basic_data_parallel<size_planner, auto_reducer, auto_allocator>`: the engine is chosen at run
/// time from the group's topology and `DDP_BACKEND` (reducer/auto.hpp), and buckets live where
/// that engine reads them fastest (memory/auto_allocator.hpp).

#include <cstdint>

#include <ddp/version.hpp>

namespace ddp {
inline namespace DDP_ABI {

// ground: error.hpp, dtype.hpp, auth.hpp
class error;
enum class errc;
enum class dtype : std::uint8_t;
enum class op : std::uint8_t;
struct half;
struct bfloat16;
class authenticator;

// group: process_group.hpp (group/init_options.hpp, group/process_group.hpp), store.hpp
struct init_options;
class process_group;
struct store_limits;
class store_server;
class store_client;

// transport: transport/tcp.hpp
struct tcp_options;
class tcp;

// reducers: reducer/basic_reducer.hpp (ring<T>, tree<T>), reducer/shm.hpp, request.hpp,
// reducer/mpi.hpp and reducer/nccl.hpp (optional SDKs)
struct reducer_options;
struct ring_algorithm;
struct tree_algorithm;
template <class Algorithm, class Transport>
class basic_reducer;
struct shm_options;
class shm;
class request;
class mpi_reducer;
class nccl_reducer;
class hierarchical;
class auto_reducer;
// communication hooks: reducer/hooked.hpp (the decorator; its Hook defaults to plain_allreduce
// there), reducer/compress.hpp, reducer/powersgd.hpp
struct comm_bucket;
// the bucket a collective serves, passed with the call: bucket_tag.hpp
struct comm_tensor;
struct bucket_tag;
struct plain_allreduce;
template <class Inner, class Hook>
class hooked;
struct fp16_compress;
struct bf16_compress;
// block-scaled 8-bit floats: reducer/fp8_compress.hpp
enum class fp8_format : std::uint8_t;
struct fp8_options;
class fp8_compress;
struct powersgd_options;
class powersgd;

// policies: planner/, memory/, parameter.hpp
struct bucket_policy;
struct bucket_plan;
struct size_planner;
struct host_allocator;
struct pinned_allocator;
struct cuda_allocator;
class shm_allocator;
class auto_allocator;
struct tensor_view;

// wrapper: data_parallel.hpp. The defaults live here; the definition repeats none of them
// and checks its arguments against the policy concepts in its body.
struct dp_options;
struct step_stats;
struct construction_stats;
struct autotune_report;
class bucket_autotuner;
class timeline;
template <class Planner = size_planner, class Reducer = auto_reducer, class Allocator = auto_allocator>
class basic_data_parallel;
/// The wrapper with the default policies: size-bucketed buckets, the engine the group's topology
/// calls for (shared memory on one host, hierarchical across hosts, none for one rank), buckets
/// where that engine reads them fastest.
using data_parallel = basic_data_parallel<>;
// the fully sharded mode (ZeRO-3): data_parallel/fully_sharded.hpp
struct fully_sharded_options;
template <class Reducer = auto_reducer, class Allocator = auto_allocator>
class basic_fully_sharded;
/// The fully sharded mode with the default reducer.
using fully_sharded = basic_fully_sharded<>;

}  // namespace DDP_ABI
}  // namespace ddp
