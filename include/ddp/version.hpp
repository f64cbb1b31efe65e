#pragma once
/// \file version.hpp
/// ddp's version, and the two checks every public header makes first: the language is C++20 or
/// later, and what follows is a public header (so a private `ddp/detail/` header included on its
/// own can tell; see ddp/detail/private_check.hpp). Every public header includes this one
/// before any other of ddp.
///
/// \code
/// #include <ddp/version.hpp>
/// static_assert(DDP_VERSION >= 100);  // 0.1.0 or later
/// \endcode

// Below C++20, ddp stops with this one line. An #error alone would not do: GCC and Clang go on
// compiling after it and bury it under hundreds of errors from the C++20 code that follows
// ("'bit_cast' is not a member of 'std'"); a missing include stops both compilers at once.
#if !defined(__cplusplus) || __cplusplus < 202002L
#include <ddp needs C++20: compile with -std=c++20 or later>  // IWYU pragma: keep
#endif

#define DDP_VERSION_MAJOR 0
#define DDP_VERSION_MINOR 1
#define DDP_VERSION_PATCH 0
/// MAJOR * 10000 + MINOR * 100 + PATCH.
#define DDP_VERSION (DDP_VERSION_MAJOR * 10000 + DDP_VERSION_MINOR * 100 + DDP_VERSION_PATCH)

/// Set once a public header of ddp is included; the private headers check it.
#define DDP_PUBLIC_HEADER_INCLUDED 1

// The ABI tag: ddp's inline namespace names how this unit was compiled, header-only or compiled
// (DDP_SEPARATE_COMPILATION, detail/compiled.hpp), and with which optional engines compiled in
// (DDP_WITH_MPI, DDP_WITH_NCCL), all of which change what ddp's types and functions are. Two
// units of one program that disagree see different names for the same ddp::process_group, so a
// call from one into the other fails to link, naming the function, instead of the one-definition
// rule breaking in silence (tests/compile_fail/mixed_modes.sh). `ddp::` names stay as written:
// the namespace is inline. For example `v0_h_m0_n0`: version 0, header-only, no MPI, no NCCL.
#if defined(DDP_SEPARATE_COMPILATION)
#define DDP_ABI_MODE_ c
#else
#define DDP_ABI_MODE_ h
#endif
#if defined(DDP_WITH_MPI)
#define DDP_ABI_MPI_ m1
#else
#define DDP_ABI_MPI_ m0
#endif
#if defined(DDP_WITH_NCCL)
#define DDP_ABI_NCCL_ n1
#else
#define DDP_ABI_NCCL_ n0
#endif
#define DDP_ABI_JOIN2_(v, m, p, n) v##_##m##_##p##_##n
#define DDP_ABI_JOIN_(v, m, p, n) DDP_ABI_JOIN2_(v, m, p, n)
/// The name of ddp's inline namespace in this unit (`namespace ddp { inline namespace DDP_ABI {`).
#define DDP_ABI DDP_ABI_JOIN_(v0, DDP_ABI_MODE_, DDP_ABI_MPI_, DDP_ABI_NCCL_)
