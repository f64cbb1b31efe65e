// The compiled part of ddp (DDP_SEPARATE_COMPILATION, include/ddp/detail/compiled.hpp): the
// non-template code of the process group and of the default reducer, defined once here instead
// of in every unit that includes <ddp/ddp.hpp>. Every unit of the program, this one included,
// defines DDP_SEPARATE_COMPILATION and the same DDP_WITH_* macros (Meson's ddp_compiled_dep
// does); a program mixes no header-only units with it.
#if !defined(DDP_SEPARATE_COMPILATION)
#error "src/ddp.cpp is ddp's compiled mode: define DDP_SEPARATE_COMPILATION here and in every unit of the program"
#endif

#include <ddp/ddp.hpp>

#include <ddp/detail/kernels_impl.hpp>
#include <ddp/group/detail/init_options_impl.hpp>
#include <ddp/group/detail/process_group_impl.hpp>
#include <ddp/group/detail/transport_context_impl.hpp>
#include <ddp/memory/detail/auto_allocator_impl.hpp>
#include <ddp/reducer/detail/auto_impl.hpp>
