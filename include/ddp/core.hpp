#pragma once
/// \file core.hpp
/// The default path alone: the process group and its store client, the data-parallel wrapper
/// with the default reducer (`ddp::auto_reducer`, which picks its engine at run time) and the
/// default allocator, the planners, the ready-made optimizers, checkpoints and the sampler.
/// `<ddp/ddp.hpp>` is this and every engine and decorator by name (`ring`, `tree`, `tcp`,
/// `shm`, `hierarchical`, the compression hooks, the flight recorder, `elastic_group`, the
/// store's server); in compiled mode (DDP_SEPARATE_COMPILATION) a unit that includes only this
/// parses none of their templates, which is most of what the umbrella costs there
/// (docs/performance.md, "Compile time"). The names are the same in both modes.
///
/// \code
/// #include <ddp/core.hpp>
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// pg.barrier();
/// \endcode

#include <ddp/version.hpp>                     // IWYU pragma: export
#include <ddp/auth.hpp>                        // IWYU pragma: export
#include <ddp/bucket_tag.hpp>                  // IWYU pragma: export
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
