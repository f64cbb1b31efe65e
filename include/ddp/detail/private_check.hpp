// IWYU pragma: private
// The first line of every header under a detail/ folder (ddp/detail/, ddp/X/detail/) includes this check
// (Eigen's InternalHeaderCheck.h idea): a private header included without a public header of
// ddp before it is a mistake, answered with one line that says what to include. Every public
// header includes <ddp/version.hpp> first, which defines DDP_PUBLIC_HEADER_INCLUDED. A test or
// tool that means to use a private header directly says so: #define DDP_ALLOW_DETAIL_HEADERS
// before its first include. No include guard: the check runs at every inclusion.
#if !defined(DDP_PUBLIC_HEADER_INCLUDED) && !defined(DDP_ALLOW_DETAIL_HEADERS)
// clang-format off
#error "this header is private to ddp: include <ddp/ddp.hpp> (or an optional part's public header, \
such as <ddp/reducer/mpi.hpp>) instead; code that means to use it defines DDP_ALLOW_DETAIL_HEADERS first"
// clang-format on
#endif
#include <ddp/version.hpp>
