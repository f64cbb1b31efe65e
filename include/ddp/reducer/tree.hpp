#pragma once
/// \file tree.hpp
/// `ddp::tree<Transport>`: recursive doubling (small messages) and halving-doubling (large).
///
/// \code
/// ddp::tree<ddp::tcp> tree{pg};
/// tree.allreduce(std::span<float>{v}, ddp::op::max);
/// \endcode
#include <ddp/version.hpp>
#include <ddp/reducer/detail/p2p_algorithms.hpp>  // IWYU pragma: export
