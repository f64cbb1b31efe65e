#pragma once
/// \file ddp.hpp
/// The umbrella header: the core of ddp with no optional dependency. CUDA, NCCL, MPI and oneTBB
/// features enter through their own headers (ddp/reducer/nccl.hpp, ddp/reducer/mpi.hpp, ...).
///
/// \code
/// #include <ddp/ddp.hpp>
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// pg.barrier();
/// \endcode

#include "dtype.hpp"          // IWYU pragma: export
#include "error.hpp"          // IWYU pragma: export
#include "process_group.hpp"  // IWYU pragma: export
#include "store.hpp"          // IWYU pragma: export
