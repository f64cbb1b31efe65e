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
