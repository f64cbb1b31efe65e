#pragma once
/// \file ddp.hpp
/// The umbrella header: all of ddp's core (process group and store, ring and tree reducers over
/// tcp and shm, planners, the host and shared-memory allocators, the data-parallel wrapper, the
/// authenticator interface) with no optional dependency. CUDA, NCCL, MPI, oneTBB and libsodium
/// enter through their own headers (ddp/memory/cuda_allocator.hpp, ddp/memory/pinned_allocator.hpp,
/// ddp/reducer/nccl.hpp, ddp/reducer/mpi.hpp, ddp/parallel/tbb.hpp, ddp/auth/sodium.hpp).
///
/// \code
/// #include <ddp/ddp.hpp>
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// pg.barrier();
/// \endcode

#include <ddp/version.hpp>                     // IWYU pragma: export
#include <ddp/auth.hpp>                        // IWYU pragma: export
#include <ddp/checkpoint.hpp>                  // IWYU pragma: export
#include <ddp/clock.hpp>                       // IWYU pragma: export
#include <ddp/concepts.hpp>                    // IWYU pragma: export
#include <ddp/data_parallel.hpp>               // IWYU pragma: export
#include <ddp/data_parallel/shard_layout.hpp>  // IWYU pragma: export
#include <ddp/dtype.hpp>                       // IWYU pragma: export
#include <ddp/endpoint.hpp>                    // IWYU pragma: export
#include <ddp/error.hpp>                       // IWYU pragma: export
#include <ddp/fwd.hpp>                         // IWYU pragma: export
#include <ddp/group/topology.hpp>              // IWYU pragma: export
#include <ddp/memory/allocator_concept.hpp>    // IWYU pragma: export
#include <ddp/memory/auto_allocator.hpp>       // IWYU pragma: export
#include <ddp/memory/host_allocator.hpp>       // IWYU pragma: export
#include <ddp/optim/adamw.hpp>                 // IWYU pragma: export
#include <ddp/optim/sgd.hpp>                   // IWYU pragma: export
#include <ddp/optim/shard_optimizer.hpp>       // IWYU pragma: export
#include <ddp/parameter.hpp>                   // IWYU pragma: export
#include <ddp/planner/bucket_plan.hpp>         // IWYU pragma: export
#include <ddp/planner/planner_concept.hpp>     // IWYU pragma: export
#include <ddp/planner/size_planner.hpp>        // IWYU pragma: export
#include <ddp/process_group.hpp>               // IWYU pragma: export
#include <ddp/reducer/auto.hpp>                // IWYU pragma: export
#include <ddp/request.hpp>                     // IWYU pragma: export
#include <ddp/sampler.hpp>                     // IWYU pragma: export
#include <ddp/transport/concept.hpp>           // IWYU pragma: export
// The engines and decorators by name. In compiled mode (DDP_SEPARATE_COMPILATION) the umbrella
// stops at the default path above, and a unit that names one of these includes its header:
// their templates are what a unit would otherwise parse for nothing (docs/performance.md,
// "Compile time").
#if !defined(DDP_SEPARATE_COMPILATION)
#include <ddp/group/elastic.hpp>            // IWYU pragma: export
#include <ddp/memory/shm_allocator.hpp>     // IWYU pragma: export
#include <ddp/reducer/compress.hpp>         // IWYU pragma: export
#include <ddp/reducer/powersgd.hpp>         // IWYU pragma: export
#include <ddp/reducer/flight_recorder.hpp>  // IWYU pragma: export
#include <ddp/reducer/hierarchical.hpp>     // IWYU pragma: export
#include <ddp/reducer/hooked.hpp>           // IWYU pragma: export
#include <ddp/reducer/ring.hpp>             // IWYU pragma: export
#include <ddp/reducer/shm.hpp>              // IWYU pragma: export
#include <ddp/reducer/tree.hpp>             // IWYU pragma: export
#include <ddp/store.hpp>                    // IWYU pragma: export
#include <ddp/transport/tcp.hpp>            // IWYU pragma: export
#endif
