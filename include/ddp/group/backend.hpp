#pragma once
/// \file group/backend.hpp
/// `ddp::backend`: the names of the engines the default reducer chooses from. The choice is
/// made in reducer/auto.hpp (`ddp::auto_reducer`); the name is a value of the group's options
/// (`init_options::backend`, `DDP_BACKEND`), so it lives here, below both. See docs/cluster.md.
///
/// \code
/// if (auto b = ddp::parse_backend("shm")) std::puts(ddp::backend_name(*b));
/// \endcode

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string_view>

#include <ddp/version.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Which collectives engine the default reducer (`ddp::auto_reducer`, reducer/auto.hpp) uses;
/// by name in `DDP_BACKEND`, as PyTorch's `init_process_group("gloo")`. See docs/cluster.md.
enum class backend : std::uint8_t {
  automatic,     ///< "auto": one rank -> none; one host -> shm; several hosts -> hierarchical
  shm,           ///< "shm": shared memory; every rank on one host
  tcp,           ///< "tcp": a ring over TCP between all ranks
  mpi,           ///< "mpi": MPI_Allreduce (needs DDP_WITH_MPI: <ddp/reducer/mpi.hpp>)
  nccl,          ///< "nccl": NCCL on CUDA devices (needs DDP_WITH_NCCL: <ddp/reducer/nccl.hpp>)
  hierarchical,  ///< "hierarchical": shm within each host, tcp between one leader per host
};

/// The name of `b` as `DDP_BACKEND` spells it ("auto", "shm", ...).
constexpr const char* backend_name(backend b) noexcept {
  switch (b) {
    case backend::automatic:
      return "auto";
    case backend::shm:
      return "shm";
    case backend::tcp:
      return "tcp";
    case backend::mpi:
      return "mpi";
    case backend::nccl:
      return "nccl";
    case backend::hierarchical:
      return "hierarchical";
  }
  return "?";
}

/// The backend named `name`; std::nullopt for a name that is none of them.
inline std::optional<backend> parse_backend(std::string_view name) noexcept {
  for (auto b : {backend::automatic, backend::shm, backend::tcp, backend::mpi, backend::nccl, backend::hierarchical})
    if (name == backend_name(b)) return b;
  return std::nullopt;
}

}  // namespace DDP_ABI
}  // namespace ddp
