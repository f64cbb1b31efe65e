// mpi_reducer in a program that initialized MPI at MPI_THREAD_SINGLE: errc::unsupported, and
// the message names the level as MPI does ("MPI_THREAD_SINGLE"), not by its number. Its own
// main (MPI_Init_thread comes first); exit status 0 when every check holds.
#include <ddp/reducer/mpi.hpp>

#include <ddp/process_group.hpp>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <string>

namespace {
// A port that was free a moment ago, for the group of one.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}
}  // namespace

int main(int argc, char** argv) {
  int provided = -1;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_SINGLE, &provided) != MPI_SUCCESS) return 1;
  int failed = 0;
  auto check = [&](bool ok, const char* what, const std::string& got) {
    if (!ok) {
      std::fprintf(stderr, "FAIL: %s: %s\n", what, got.c_str());
      failed = 1;
    }
  };
  check(ddp::detail::mpi_thread_level_name(MPI_THREAD_SINGLE) == "MPI_THREAD_SINGLE", "name of SINGLE",
        ddp::detail::mpi_thread_level_name(MPI_THREAD_SINGLE));
  check(ddp::detail::mpi_thread_level_name(MPI_THREAD_FUNNELED) == "MPI_THREAD_FUNNELED", "name of FUNNELED",
        ddp::detail::mpi_thread_level_name(MPI_THREAD_FUNNELED));
  check(ddp::detail::mpi_thread_level_name(MPI_THREAD_SERIALIZED) == "MPI_THREAD_SERIALIZED", "name of SERIALIZED",
        ddp::detail::mpi_thread_level_name(MPI_THREAD_SERIALIZED));
  check(ddp::detail::mpi_thread_level_name(MPI_THREAD_MULTIPLE) == "MPI_THREAD_MULTIPLE", "name of MULTIPLE",
        ddp::detail::mpi_thread_level_name(MPI_THREAD_MULTIPLE));
  if (provided < MPI_THREAD_SERIALIZED) {
    auto pg = ddp::init_process_group({.rank = 0, .world_size = 1, .master_port = free_port()});
    try {
      ddp::mpi_reducer r{pg};
      check(false, "mpi_reducer at a thread level below SERIALIZED", "no error");
    } catch (const ddp::error& e) {
      const std::string w = e.what();
      check(e.code() == ddp::errc::unsupported, "errc", w);
      check(w.find("initialized at " + ddp::detail::mpi_thread_level_name(provided)) != std::string::npos,
            "the level is named", w);
      check(w.find("level 0") == std::string::npos && w.find("level " + std::to_string(provided)) == std::string::npos,
            "no bare number", w);
    }
  } else {
    std::fprintf(stderr, "MPI gave %s when asked for MPI_THREAD_SINGLE; the refusal is not exercised\n",
                 ddp::detail::mpi_thread_level_name(provided).c_str());
  }
  MPI_Finalize();
  return failed;
}
