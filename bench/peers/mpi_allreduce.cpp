// MPI_Allreduce (float32 sum) in ddp's sweep format.
//
//   mpirun --oversubscribe -np 2 mpi_allreduce --algo out_of_place,in_place
//
// out_of_place passes separate send and receive buffers, as most users do; in_place passes
// MPI_IN_PLACE, which is what a gradient bucket reduced where it lives looks like.
#include "sweep.hpp"

// The MPI-2 C++ bindings are deprecated and warn under -Wextra; only the C API is used.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <cstdio>
#include <string>
#include <vector>

namespace {

constexpr std::string_view algo_list = "out_of_place|in_place[,...]";

// The system column names the implementation, so Open MPI and MPICH rows can share a plot.
#if defined(OMPI_MAJOR_VERSION)
constexpr std::string_view system_name = "openmpi";
#elif defined(MPICH_VERSION)
constexpr std::string_view system_name = "mpich";
#else
constexpr std::string_view system_name = "mpi";
#endif

void check(int rc, const char* what) {
  if (rc != MPI_SUCCESS) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    std::fprintf(stderr, "%s: %.*s\n", what, len, msg);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  check(MPI_Init(&argc, &argv), "MPI_Init");
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);

  sweep::options o = sweep::parse(argc, argv, algo_list);
  const auto algos = sweep::split(o.algo.empty() ? "out_of_place,in_place" : o.algo);
  for (const auto& a : algos) {
    if (a != "out_of_place" && a != "in_place") {
      if (rank == 0) {
        std::fprintf(stderr, "%s: unknown --algo '%s'\n", argv[0], a.c_str());
        sweep::usage(argv[0], algo_list);
      }
      MPI_Finalize();
      return 2;
    }
  }

  if (rank == 0) sweep::print_header();
  int wrong_here = 0;
  for (const auto& algo : algos) {
    const bool in_place = algo == "in_place";
    for (std::size_t bytes : sweep::sizes(o)) {
      const int count = static_cast<int>(bytes / sizeof(float));
      const int iters = sweep::iters_for(o, bytes);
      const int warmup = sweep::warmup_for(o, bytes);
      // Zeros while timing: repeated in-place sums of nonzero inputs would overflow to inf.
      std::vector<float> send(in_place ? 0 : static_cast<std::size_t>(count), 0.0f);
      std::vector<float> recv(static_cast<std::size_t>(count), 0.0f);
      const void* sendbuf = in_place ? MPI_IN_PLACE : static_cast<const void*>(send.data());

      std::vector<double> us(static_cast<std::size_t>(iters));
      for (int i = 0; i < warmup + iters; ++i) {
        MPI_Barrier(MPI_COMM_WORLD);
        const double t0 = MPI_Wtime();
        check(MPI_Allreduce(sendbuf, recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
              "MPI_Allreduce");
        const double t1 = MPI_Wtime();
        if (i >= warmup) us[static_cast<std::size_t>(i - warmup)] = (t1 - t0) * 1e6;
      }

      std::fill(in_place ? recv.begin() : send.begin(), in_place ? recv.end() : send.end(),
                static_cast<float>(rank + 1));
      check(MPI_Allreduce(sendbuf, recv.data(), count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
            "MPI_Allreduce");
      if (std::size_t wrong = sweep::count_wrong(recv.data(), recv.size(), ranks)) {
        std::fprintf(stderr, "mpi %s rank %d: %zu of %d elements wrong at %zu bytes\n",
                     algo.c_str(), rank, wrong, count, bytes);
        wrong_here = 1;
      }

      std::vector<double> worst(us.size());
      MPI_Reduce(us.data(), worst.data(), static_cast<int>(us.size()), MPI_DOUBLE, MPI_MAX, 0,
                 MPI_COMM_WORLD);
      if (rank == 0)
        sweep::print_row(system_name, algo, ranks, bytes, iters, sweep::summarize(worst));
    }
  }

  int wrong_anywhere = 0;
  MPI_Allreduce(&wrong_here, &wrong_anywhere, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return wrong_anywhere ? 1 : 0;
}
