#pragma once
/// \file ddp.hpp
/// The umbrella header: the core of ddp (process group, ring and tree reducers over tcp and shm,
/// the data-parallel wrapper) with no optional dependency. CUDA, NCCL, MPI and oneTBB
/// features enter through their own headers (ddp/reducer/nccl.hpp, ddp/reducer/mpi.hpp, ...).
///
/// \code
/// #include <ddp/ddp.hpp>
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// pg.barrier();
/// \endcode

#include <ddp/concepts.hpp>       // IWYU pragma: export
#include <ddp/data_parallel.hpp>  // IWYU pragma: export
#include <ddp/dtype.hpp>          // IWYU pragma: export
#include <ddp/error.hpp>          // IWYU pragma: export
#include <ddp/process_group.hpp>  // IWYU pragma: export
#include <ddp/reducer/ring.hpp>   // IWYU pragma: export
#include <ddp/reducer/tree.hpp>   // IWYU pragma: export
#include <ddp/store.hpp>          // IWYU pragma: export
#include <ddp/reducer/shm.hpp>  // IWYU pragma: export
#include <ddp/transport/tcp.hpp>  // IWYU pragma: export
