#pragma once
/// \file tree.hpp
/// `ddp::tree<Transport>`: recursive doubling (small messages) and halving-doubling (large). It
/// shares the ring's code, in <ddp/reducer/ring.hpp>; this header is the tree's name for it.
///
/// \code
/// ddp::tree<ddp::tcp> tree{pg};
/// tree.allreduce(std::span<float>{v}, ddp::op::max);
/// \endcode
#include <ddp/version.hpp>
#include <ddp/reducer/ring.hpp>  // IWYU pragma: export
