// IWYU pragma: private
// The first line of every header under ddp/detail/ and ddp/reducer/detail/ includes this check
// (Eigen's InternalHeaderCheck.h idea): a private header included without a public header of
// ddp before it is a mistake, answered with one line that says what to include. Every public
// header includes <ddp/version.hpp> first, which defines DDP_PUBLIC_HEADER_INCLUDED. A test or
// tool that means to use a private header directly says so: #define DDP_ALLOW_DETAIL_HEADERS
// before its first include. No include guard: the check runs at every inclusion.
#if !defined(DDP_PUBLIC_HEADER_INCLUDED) && !defined(DDP_ALLOW_DETAIL_HEADERS)
#error "this header is private to ddp: include <ddp/ddp.hpp> (or the public header of an optional part: <ddp/reducer/mpi.hpp>, <ddp/reducer/nccl.hpp>, <ddp/memory/cuda_allocator.hpp>, <ddp/parallel/tbb.hpp>, <ddp/auth/sodium.hpp>) instead; code that means to use it defines DDP_ALLOW_DETAIL_HEADERS first"
#endif
#include <ddp/version.hpp>
