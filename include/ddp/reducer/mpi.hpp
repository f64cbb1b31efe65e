#pragma once
/// \file mpi.hpp
/// `ddp::mpi_reducer`: hands every collective to MPI (`MPI_Allreduce`, `MPI_Bcast`,
/// `MPI_Reduce_scatter_block`, `MPI_Allgather`, `MPI_Barrier`) on a private duplicate of the
/// communicator. Includes `<mpi.h>`; compile with `mpicxx` or the flags of `mpicxx --showme`.
/// See docs/mpi-nccl.md.
///
/// \code
/// int provided = 0;
/// MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
/// auto pg = ddp::init_process_group(opts);        // ranks as in MPI_COMM_WORLD, or any order
/// ddp::mpi_reducer mpi{pg};
/// mpi.allreduce(std::span<float>{v}, ddp::op::avg);
/// ddp::basic_data_parallel<ddp::size_planner, ddp::mpi_reducer, ddp::host_allocator> dp{pg, params};
/// \endcode

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

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/detail/collective.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/detail/kernels.hpp>
#include <ddp/reducer/detail/mpi_check.hpp>
#include <ddp/reducer/detail/front_end.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/process_group.hpp>
#include <ddp/request.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// The engine of `mpi_reducer`: the MPI handles, and one MPI call per collective, made on the
/// reducer's progress thread (reducer/detail/front_end.hpp calls it; use `mpi_reducer`).
class mpi_engine {
 public:
  static constexpr const char* name = "mpi_reducer";
  static constexpr bool descriptors = false;  ///< MPI matches collectives itself
  static constexpr bool deadlines = false;    ///< an MPI call cannot be interrupted
  static constexpr bool launches_at_call = false;

  /// See mpi_reducer(process_group&).
  explicit mpi_engine(process_group& pg) : timeout_(pg.timeout()) {
    if (pg.options().elastic_max > 0)
      detail::raise(errc::unsupported, pg.rank(),
                    "mpi_reducer on an elastic group (DDP_ELASTIC): MPI_COMM_WORLD cannot shrink or grow (Open MPI 4.1 "
                    "has no ULFM); use the default reducer, ring or tree");
    check_mpi_ready(pg.rank());
    int wsize = 0;
    DDP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &wsize));
    // Both sizes are the same on every rank, so every rank reaches the same verdict and none
    // is left waiting in the split below.
    if (wsize != pg.size())
      detail::raise(errc::invalid_argument, pg.rank(),
                    "mpi_reducer: the process group has " + std::to_string(pg.size()) +
                        " ranks but MPI_COMM_WORLD has " + std::to_string(wsize));
    // Ordering by the group's rank makes MPI rank r the same process as group rank r, whatever
    // numbering the launcher used.
    DDP_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, 0, pg.rank(), &res_.comm));
    finish_setup(pg.rank());
  }
  /// See mpi_reducer(MPI_Comm, std::chrono::milliseconds).
  mpi_engine(MPI_Comm comm, std::chrono::milliseconds timeout) : timeout_(timeout) {
    check_mpi_ready(-1);
    if (comm == MPI_COMM_NULL) detail::raise(errc::invalid_argument, -1, "mpi_reducer: MPI_COMM_NULL");
    if (timeout.count() <= 0) detail::raise(errc::invalid_argument, -1, "mpi_reducer: timeout must be positive");
    DDP_MPI_CHECK(MPI_Comm_dup(comm, &res_.comm));
    finish_setup(-1);
  }
  mpi_engine(const mpi_engine&) = delete;
  mpi_engine& operator=(const mpi_engine&) = delete;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  MPI_Comm comm() const noexcept { return res_.comm; }
  /// Raises unless MPI is initialized at MPI_THREAD_SERIALIZED or above and not finalized.
  static void check_ready(int rank) { check_mpi_ready(rank); }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

  /// At the call, after the dtype and op: MPI counts are int, and reduce_scatter and allgather
  /// cannot be split into pieces.
  void check(detail::coll_kind k, std::size_t count_per_rank) const {
    if ((k == detail::coll_kind::reduce_scatter || k == detail::coll_kind::allgather) &&
        count_per_rank > static_cast<std::size_t>(INT_MAX))
      detail::raise(errc::unsupported, rank_,
                    std::string("mpi_reducer: ") + detail::coll_name(k) + " of more than INT_MAX elements per rank");
  }

  // An average of floats is a sum of contributions prescaled by a power of two, divided once
  // after it (detail/kernels.hpp, "Averages"): dividing a plain sum would overflow where the sum
  // does (f16 40000 on two ranks). Integers sum, then divide.
  void allreduce(void* data, std::size_t count, dtype t, op o) {
    const MPI_Datatype type = mpi_type(t);
    const MPI_Op mop = mpi_op(t, o);
    auto* p = static_cast<std::byte*>(data);
    if (o == op::avg && count > 0) detail::avg_prescale(data, data, count, t, size_);
    for (std::size_t done = 0; done < count;) {
      const std::size_t n = std::min(max_piece, count - done);
      DDP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, p + done * dtype_size(t), static_cast<int>(n), type, mop, res_.comm));
      done += n;
    }
    if (o == op::avg && count > 0) detail::avg_finish(data, count, t, size_);
  }

  void broadcast(void* data, std::size_t count, dtype t, int root) {
    const std::size_t bytes = count * dtype_size(t);
    auto* p = static_cast<std::byte*>(data);
    for (std::size_t done = 0; done < bytes;) {
      const std::size_t n = std::min(max_piece, bytes - done);
      DDP_MPI_CHECK(MPI_Bcast(p + done, static_cast<int>(n), MPI_BYTE, root, res_.comm));
      done += n;
    }
  }

  void reduce_scatter(const void* in, void* out, std::size_t count_per_rank, dtype t, op o) {
    // MPI forbids aliased send and receive buffers, and its MPI_IN_PLACE form puts the result at
    // the start of the input: the in-place form goes through a scratch slice.
    const std::size_t slice = count_per_rank * dtype_size(t);
    const bool in_place = slice > 0 && out == static_cast<const char*>(in) + static_cast<std::size_t>(rank_) * slice;
    // An average sums prescaled contributions (see allreduce); `in` is the caller's.
    std::vector<std::byte> scaled;
    const void* src = in;
    if (o == op::avg && detail::avg_scales(t) && size_ > 1) {
      scaled.resize(count_per_rank * static_cast<std::size_t>(size_) * dtype_size(t));
      detail::avg_prescale(scaled.data(), in, count_per_rank * static_cast<std::size_t>(size_), t, size_);
      src = scaled.data();
    }
    // A scaled copy no longer aliases `out`; the caller's own buffer in place does.
    const bool aliased = in_place && src == in;
    std::vector<char> tmp(aliased ? slice : 0);
    void* dst = aliased ? static_cast<void*>(tmp.data()) : out;
    DDP_MPI_CHECK(
        MPI_Reduce_scatter_block(src, dst, static_cast<int>(count_per_rank), mpi_type(t), mpi_op(t, o), res_.comm));
    if (aliased) std::memcpy(out, dst, slice);
    if (o == op::avg) detail::avg_finish(out, count_per_rank, t, size_);
  }

  void allgather(const void* in, void* out, std::size_t count_per_rank, dtype t) {
    const std::size_t slice = count_per_rank * dtype_size(t);
    const bool in_place = slice > 0 && in == static_cast<const char*>(out) + static_cast<std::size_t>(rank_) * slice;
    const int n = static_cast<int>(count_per_rank);
    DDP_MPI_CHECK(MPI_Allgather(in_place ? MPI_IN_PLACE : in, n, mpi_type(t), out, n, mpi_type(t), res_.comm));
  }

  void barrier() { DDP_MPI_CHECK(MPI_Barrier(res_.comm)); }

 private:
  // MPI counts are int; larger buffers go in pieces of this many elements.
  static constexpr std::size_t max_piece = std::size_t{1} << 30;
  static constexpr int n_ops = 5;

  // MPI handles, freed after the progress thread has stopped (the engine outlives the front
  // end's thread) and only while MPI is still alive: a program that finalizes MPI first has already released them.
  struct mpi_resources {
    MPI_Comm comm = MPI_COMM_NULL;
    MPI_Datatype half_type = MPI_DATATYPE_NULL;  // 2 opaque bytes: f16 and bf16
    MPI_Op f16[n_ops] = {};
    MPI_Op bf16[n_ops] = {};
    MPI_Op f32[n_ops] = {};
    MPI_Op f64[n_ops] = {};
    detail::owner_process owner;
    mpi_resources() {
      for (int i = 0; i < n_ops; ++i) f16[i] = bf16[i] = f32[i] = f64[i] = MPI_OP_NULL;
    }
    mpi_resources(const mpi_resources&) = delete;
    mpi_resources& operator=(const mpi_resources&) = delete;
    ~mpi_resources() {
      if (owner.forked()) return;  // MPI is the parent's: a forked child must not call it
      int fin = 1;
      if (MPI_Finalized(&fin) != MPI_SUCCESS || fin) return;
      for (MPI_Op* set : {f16, bf16, f32, f64})
        for (int i = 0; i < n_ops; ++i)
          if (set[i] != MPI_OP_NULL) (void)MPI_Op_free(&set[i]);
      if (half_type != MPI_DATATYPE_NULL) (void)MPI_Type_free(&half_type);
      if (comm != MPI_COMM_NULL) (void)MPI_Comm_free(&comm);
    }
  };

  // MPI's contract for user ops: inout[i] = in[i] op inout[i]. ddp's kernels are the reduction
  // of every other reducer, so f16/bf16 and NaN handling agree bit for bit with them.
  template <class T, op O>
  static void user_op(void* in, void* inout, int* len, MPI_Datatype*) {
    detail::reduce_into(static_cast<T*>(inout), static_cast<const T*>(in), static_cast<std::size_t>(*len), O);
  }
  template <class T>
  static void create_ops(MPI_Op (&set)[n_ops], bool with_arith) {
    if (with_arith) {
      DDP_MPI_CHECK(MPI_Op_create(&user_op<T, op::sum>, 1, &set[static_cast<int>(op::sum)]));
      DDP_MPI_CHECK(MPI_Op_create(&user_op<T, op::prod>, 1, &set[static_cast<int>(op::prod)]));
    }
    DDP_MPI_CHECK(MPI_Op_create(&user_op<T, op::min>, 1, &set[static_cast<int>(op::min)]));
    DDP_MPI_CHECK(MPI_Op_create(&user_op<T, op::max>, 1, &set[static_cast<int>(op::max)]));
  }

  static void check_mpi_ready(int rank) {
    int init = 0, fin = 0, level = MPI_THREAD_SINGLE;
    DDP_MPI_CHECK(MPI_Initialized(&init));
    DDP_MPI_CHECK(MPI_Finalized(&fin));
    if (!init || fin)
      detail::raise(errc::usage, rank,
                    "mpi_reducer: MPI is not initialized (call MPI_Init_thread with MPI_THREAD_MULTIPLE first)");
    DDP_MPI_CHECK(MPI_Query_thread(&level));
    if (level < MPI_THREAD_SERIALIZED)
      detail::raise(errc::unsupported, rank,
                    "mpi_reducer: MPI was initialized at " + detail::mpi_thread_level_name(level) +
                        "; the progress thread needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE (MPI_Init_thread)");
  }

  void finish_setup(int rank_hint) {
    DDP_MPI_CHECK(MPI_Comm_set_errhandler(res_.comm, MPI_ERRORS_RETURN));
    DDP_MPI_CHECK(MPI_Comm_rank(res_.comm, &rank_));
    DDP_MPI_CHECK(MPI_Comm_size(res_.comm, &size_));
    if (rank_hint >= 0 && rank_hint != rank_)
      detail::raise(errc::rank_conflict, rank_hint,
                    "mpi_reducer: group rank " + std::to_string(rank_hint) + " became MPI rank " +
                        std::to_string(rank_) + " (two members of the group claim the same rank?)");
    DDP_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &res_.half_type));
    DDP_MPI_CHECK(MPI_Type_commit(&res_.half_type));
    create_ops<half>(res_.f16, true);
    create_ops<bfloat16>(res_.bf16, true);
    create_ops<float>(res_.f32, false);
    create_ops<double>(res_.f64, false);
  }

  MPI_Datatype mpi_type(dtype t) const {
    switch (t) {
      case dtype::f32:
        return MPI_FLOAT;
      case dtype::f64:
        return MPI_DOUBLE;
      case dtype::f16:
      case dtype::bf16:
        return res_.half_type;
      case dtype::i32:
        return MPI_INT32_T;
      case dtype::i64:
        return MPI_INT64_T;
    }
    detail::raise(errc::invalid_argument, rank_, "mpi_reducer: unknown dtype " + std::to_string(static_cast<int>(t)));
  }

  // MPI's built-in ops where their semantics are ddp's (sums and products wrap or round the
  // same way, integer min/max have no NaN); ddp's kernels elsewhere.
  MPI_Op mpi_op(dtype t, op o) const {
    const int i = static_cast<int>(o == op::avg ? op::sum : o);
    switch (t) {
      case dtype::f16:
        return res_.f16[i];
      case dtype::bf16:
        return res_.bf16[i];
      case dtype::f32:
        if (o == op::min || o == op::max) return res_.f32[i];
        break;
      case dtype::f64:
        if (o == op::min || o == op::max) return res_.f64[i];
        break;
      case dtype::i32:
      case dtype::i64:
        break;
    }
    switch (o) {
      case op::sum:
      case op::avg:
        return MPI_SUM;
      case op::min:
        return MPI_MIN;
      case op::max:
        return MPI_MAX;
      case op::prod:
        return MPI_PROD;
    }
    detail::raise(errc::invalid_argument, rank_, "mpi_reducer: unknown reduction op");
  }

  std::chrono::milliseconds timeout_;
  int rank_ = -1;
  int size_ = 0;
  mpi_resources res_;  // freed after the front end's progress thread has stopped
};

/// Reducer that runs each collective as one MPI call on the reducer's progress thread, in issue
/// order (so every rank issues the same sequence, as MPI requires).
///
/// Threading: MPI must be initialized with `MPI_Init_thread` at level `MPI_THREAD_SERIALIZED`
/// or higher, because the progress thread is not the main thread. `SERIALIZED` is enough when
/// the program makes no MPI call of its own while a request is in flight and uses one
/// `mpi_reducer`; otherwise ask for `MPI_THREAD_MULTIPLE`.
///
/// Deadlines bound the caller's wait only: an MPI call cannot be interrupted, so a collective
/// whose peer died keeps the progress thread until MPI itself returns an error or the job is
/// aborted (`MPI_Abort`, or the launcher killing it). The destructor waits for the running
/// collective. Types without an MPI equivalent (f16, bf16) travel as 2-byte elements with
/// user-defined ops that widen to float and round after each pairwise step; float min/max use
/// ddp's kernels too, so NaN propagates as with every other reducer. `avg` is an MPI sum
/// divided by the world size afterwards (integers truncate).
class mpi_reducer : public detail::reducer_front_end<mpi_engine> {
 public:
  /// MPI moves the bytes itself: there is no ddp transport for an allocator to be built from
  /// (`basic_data_parallel` default-constructs its allocator; `host_allocator` is the usual one).
  struct engine_transport {};
  using transport_type = engine_transport;

  /// Joins MPI_COMM_WORLD with the ranks numbered as in `pg` (a collective on both): the MPI
  /// world must hold exactly `pg.size()` processes, each also a member of `pg`; ranks may be
  /// numbered differently by the launcher and by `pg`. Throws `errc::usage` when MPI is not
  /// initialized, `errc::unsupported` below `MPI_THREAD_SERIALIZED`, `errc::invalid_argument`
  /// when the sizes differ. The group's timeout bounds blocking calls.
  /// \code
  /// ddp::mpi_reducer mpi{pg};
  /// \endcode
  explicit mpi_reducer(process_group& pg) : reducer_front_end(pg.rank(), pg) {}

  /// Uses a duplicate of `comm` (a collective on `comm`); `timeout` bounds blocking calls.
  /// \code
  /// ddp::mpi_reducer mpi{MPI_COMM_WORLD, std::chrono::seconds(30)};
  /// \endcode
  explicit mpi_reducer(MPI_Comm comm, std::chrono::milliseconds timeout = std::chrono::seconds(60))
      : reducer_front_end(-1, comm, timeout) {}

  /// The reducer's private communicator (its ranks match `rank()`).
  MPI_Comm comm() const noexcept { return engine().comm(); }
  std::chrono::milliseconds timeout() const noexcept { return engine().timeout(); }
};

}  // namespace DDP_ABI
}  // namespace ddp
