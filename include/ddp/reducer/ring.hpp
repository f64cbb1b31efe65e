#pragma once
/// \file ring.hpp
/// `ddp::ring<Transport>`: reduce-scatter + allgather allreduce. See docs/reducers.md.
///
/// \code
/// ddp::ring<ddp::tcp> ring{pg};
/// ring.allreduce(std::span<float>{v}, ddp::op::sum);
/// \endcode
#include <ddp/version.hpp>
#include <ddp/reducer/detail/p2p_algorithms.hpp>  // IWYU pragma: export
