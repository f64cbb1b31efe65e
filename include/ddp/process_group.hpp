#pragma once
/// \file process_group.hpp
/// Process group: rendezvous through rank 0's TCP store, TCP connections between ranks made on
/// first use, barrier, broadcast and all_gather. Options come explicitly or from the environment that torchrun-style
/// launchers, `ddprun`, `mpirun` (Open MPI, MPICH/PMI) and Slurm set.
///
/// This header gives the group's public face; each job has its own header:
/// - group/backend.hpp: `ddp::backend`, the default reducer's engines by name (`DDP_BACKEND`);
/// - group/init_options.hpp: `ddp::init_options` and `from_env` (the parsing of the launchers'
///   variables is group/detail/env.hpp);
/// - group/process_group.hpp: `ddp::process_group` and `ddp::init_process_group`;
/// - group/transport_context.hpp: `ddp::transport_context`, what a transport gets from its group.

#include <ddp/version.hpp>
#include <ddp/group/backend.hpp>
#include <ddp/group/init_options.hpp>
#include <ddp/group/process_group.hpp>
#include <ddp/group/transport_context.hpp>
