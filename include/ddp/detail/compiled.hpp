#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// Header-only (the default) or compiled. With DDP_SEPARATE_COMPILATION defined in every unit of
// a program, the non-template code of the group and of the default reducer is only declared by
// the headers and defined once, in the unit that compiles src/ddp.cpp (Meson's
// `ddp_compiled_dep` builds and links it; docs/performance.md, "Compile time"). Its definitions
// live in `X/detail/*_impl.hpp`, written once for both modes: `DDP_DECL` is `inline` in a
// header-only build and nothing in the compiled unit.

#if defined(DDP_SEPARATE_COMPILATION)
#define DDP_DECL
#else
#define DDP_DECL inline
#endif
