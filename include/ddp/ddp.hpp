#pragma once
/// \file ddp.hpp
/// The umbrella header: all of ddp's core (process group and store, ring and tree reducers over
/// tcp and shm, planners, the host and shared-memory allocators, the data-parallel wrapper, the
/// authenticator interface) with no optional dependency, the same names whether ddp is
/// header-only or compiled (DDP_SEPARATE_COMPILATION). CUDA, NCCL, MPI, oneTBB and libsodium
/// enter through their own headers (ddp/memory/cuda_allocator.hpp, ddp/memory/pinned_allocator.hpp,
/// ddp/reducer/nccl.hpp, ddp/reducer/mpi.hpp, ddp/parallel/tbb.hpp, ddp/auth/sodium.hpp).
/// `<ddp/core.hpp>` is the default path alone, the lighter include in compiled mode.
///
/// \code
/// #include <ddp/ddp.hpp>
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// pg.barrier();
/// \endcode

#include <ddp/core.hpp>  // IWYU pragma: export
// The engines and decorators by name.
#include <ddp/data_parallel/fully_sharded.hpp>  // IWYU pragma: export
#include <ddp/group/elastic.hpp>                // IWYU pragma: export
#include <ddp/memory/shm_allocator.hpp>         // IWYU pragma: export
#include <ddp/reducer/compress.hpp>             // IWYU pragma: export
#include <ddp/reducer/fp8_compress.hpp>         // IWYU pragma: export
#include <ddp/reducer/powersgd.hpp>             // IWYU pragma: export
#include <ddp/reducer/flight_recorder.hpp>      // IWYU pragma: export
#include <ddp/reducer/hierarchical.hpp>         // IWYU pragma: export
#include <ddp/reducer/hooked.hpp>               // IWYU pragma: export
#include <ddp/reducer/ring.hpp>                 // IWYU pragma: export
#include <ddp/reducer/shm.hpp>                  // IWYU pragma: export
#include <ddp/reducer/tree.hpp>                 // IWYU pragma: export
#include <ddp/store.hpp>                        // IWYU pragma: export
#include <ddp/transport/tcp.hpp>                // IWYU pragma: export
