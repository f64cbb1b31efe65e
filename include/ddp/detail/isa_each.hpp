#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// No include guard: included once per kernel body. `#define DDP_ISA_BODY <ddp/.../x_body.hpp>`
// and include this file at namespace scope; it includes the body once per instruction set
// (detail/isa.hpp), with DDP_KERN_NS (the namespace under ddp::detail: kern, kern_v3, kern_v4),
// DDP_KERN_VECTOR_BYTES and DDP_KERN_F16C defined, and undefines DDP_ISA_BODY.
#include <ddp/detail/isa.hpp>

#ifdef DDP_ISA_BODY
#define DDP_KERN_NS kern
#define DDP_KERN_VECTOR_BYTES DDP_DETAIL_VECTOR_BYTES
#define DDP_KERN_F16C DDP_DETAIL_BASE_F16C
#include DDP_ISA_BODY
#undef DDP_KERN_NS
#undef DDP_KERN_VECTOR_BYTES
#undef DDP_KERN_F16C
#if DDP_DETAIL_ISA_DISPATCH
// Both run-time copies: 32-byte vectors, F16C's conversions; AVX2, and AVX-512 as well.
#define DDP_KERN_VECTOR_BYTES 32
#define DDP_KERN_F16C 1
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
#define DDP_KERN_NS kern_v3
#include DDP_ISA_BODY
#undef DDP_KERN_NS
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,f16c,avx512f,avx512vl,avx512bw,avx512dq")
#define DDP_KERN_NS kern_v4
#include DDP_ISA_BODY
#undef DDP_KERN_NS
#pragma GCC pop_options
#undef DDP_KERN_VECTOR_BYTES
#undef DDP_KERN_F16C
#endif
#undef DDP_ISA_BODY
#endif
