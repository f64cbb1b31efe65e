#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
/// \file reducer/detail/mpi_check.hpp
/// Conversion of MPI error codes into `ddp::error`. Only meaningful on communicators whose error
/// handler is `MPI_ERRORS_RETURN` (the default, `MPI_ERRORS_ARE_FATAL`, aborts the job before a
/// code is ever returned); `mpi_reducer` sets it on the communicator it duplicates.

// Open MPI's mpi.h also declares its deprecated C++ bindings, whose casts between function
// types trip -Wcast-function-type when the SDK directory is not a system include directory.
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wcast-function-type"
#endif
#include <mpi.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

#include <string>

#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// "MPI_THREAD_SINGLE" for MPI_THREAD_SINGLE, and so on: the name a user finds in the MPI
/// documentation, where the number means nothing (the levels' values are the library's).
inline std::string mpi_thread_level_name(int level) {
  if (level == MPI_THREAD_SINGLE) return "MPI_THREAD_SINGLE";
  if (level == MPI_THREAD_FUNNELED) return "MPI_THREAD_FUNNELED";
  if (level == MPI_THREAD_SERIALIZED) return "MPI_THREAD_SERIALIZED";
  if (level == MPI_THREAD_MULTIPLE) return "MPI_THREAD_MULTIPLE";
  return "an unknown thread level (" + std::to_string(level) + ")";
}

/// The ddp condition of an MPI error class: argument errors are the caller's, a failed process
/// (ULFM's MPIX_ERR_PROC_FAILED, where the MPI library has it) is a lost peer, the rest is the
/// library's or the system's.
inline errc mpi_condition(int code) noexcept {
  int cls = MPI_ERR_OTHER;
  if (MPI_Error_class(code, &cls) != MPI_SUCCESS) return errc::system;
#ifdef MPIX_ERR_PROC_FAILED
  if (cls == MPIX_ERR_PROC_FAILED) return errc::peer_lost;
#endif
#ifdef MPIX_ERR_REVOKED
  if (cls == MPIX_ERR_REVOKED) return errc::aborted;
#endif
  switch (cls) {
    case MPI_ERR_BUFFER:
    case MPI_ERR_COUNT:
    case MPI_ERR_TYPE:
    case MPI_ERR_OP:
    case MPI_ERR_ROOT:
    case MPI_ERR_COMM:
    case MPI_ERR_ARG:
    case MPI_ERR_RANK:
      return errc::invalid_argument;
    case MPI_ERR_TRUNCATE:
      return errc::mismatch;
    default:
      return errc::system;
  }
}

/// Rank in MPI_COMM_WORLD for the message, or -1 outside MPI_Init/MPI_Finalize.
inline int mpi_world_rank() noexcept {
  int init = 0, fin = 0, r = -1;
  if (MPI_Initialized(&init) != MPI_SUCCESS || !init) return -1;
  if (MPI_Finalized(&fin) != MPI_SUCCESS || fin) return -1;
  if (MPI_Comm_rank(MPI_COMM_WORLD, &r) != MPI_SUCCESS) return -1;
  return r;
}

[[noreturn]] inline void raise_mpi(int code, const char* expr, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  raise(mpi_condition(code), mpi_world_rank(),
        "MPI error " + std::to_string(code) + " (" + std::string(text, static_cast<std::size_t>(len > 0 ? len : 0)) +
            ") from " + expr + " at " + file + ":" + std::to_string(line));
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp

/// Evaluates an MPI call; on failure throws `ddp::error` naming the MPI error, the expression,
/// file and line (the condition follows the MPI error class: `invalid_argument`, `peer_lost`,
/// `mismatch` or `system`).
#define DDP_MPI_CHECK(expr)                                                                                   \
  do {                                                                                                        \
    const int ddp_mpi_status_ = (expr);                                                                       \
    if (ddp_mpi_status_ != MPI_SUCCESS) ::ddp::detail::raise_mpi(ddp_mpi_status_, #expr, __FILE__, __LINE__); \
  } while (false)
