#pragma once
/// \file reducer/auto.hpp
/// `ddp::auto_reducer`: the default reducer of `ddp::data_parallel`. It picks its engine when
/// it is constructed, from `init_options::backend` (`DDP_BACKEND`) and the group's topology:
///
/// | backend | engine |
/// |---|---|
/// | `auto`, 1 rank | none: no communication |
/// | `auto`, every rank on one host | `ring<shm>`: one shared-memory segment (buckets in it) |
/// | `auto`, several hosts, one rank each | `ring<tcp>` |
/// | `auto`, several hosts, several ranks on some | `hierarchical`: shm within a host, tcp between leaders |
/// | `shm`, `tcp`, `hierarchical` | that one |
/// | `mpi`, `nccl` | `mpi_reducer`, `nccl_reducer` (compiled in with DDP_WITH_MPI, DDP_WITH_NCCL) |
///
/// With `DDP_DEBUG=info` (`init_options::debug_info`) rank 0 says on stderr what it chose and
/// why; `describe()` returns the same text. See docs/cluster.md.
///
/// \code
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// ddp::auto_reducer red{pg};                          // collective
/// std::printf("%s\n", red.describe().c_str());        // "shm: 1 host, 4 ranks ..."
/// std::vector<float> g(1000, 1.0f);
/// red.allreduce(std::span<float>{g}, ddp::op::avg);
/// \endcode

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <variant>

#include <ddp/version.hpp>
#include <ddp/bucket_tag.hpp>
#include <ddp/detail/compiled.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/group/backend.hpp>
#include <ddp/group/topology.hpp>
#include <ddp/fwd.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/detail/typed_collectives.hpp>
#include <ddp/request.hpp>
// The engines: complete here in a header-only build; in compiled mode only their names are
// needed, and a unit that names one includes its header (auto_impl.hpp includes them all).
#if !defined(DDP_SEPARATE_COMPILATION)
#include <ddp/reducer/hierarchical.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/transport/tcp.hpp>
#if defined(DDP_WITH_MPI)
#include <ddp/reducer/mpi.hpp>
#endif
#if defined(DDP_WITH_NCCL)
#include <ddp/reducer/nccl.hpp>
#endif
#endif

namespace ddp {
inline namespace DDP_ABI {
namespace detail {
class solo_reducer;  // reducer/detail/auto_impl.hpp: the engine of a group of one rank
}  // namespace detail

/// The default reducer: the engine for the group it finds (see the table above). Constructing
/// it is a collective; every rank must ask for the same backend (errc::mismatch otherwise).
class auto_reducer : public detail::typed_collectives<auto_reducer> {
  friend class detail::typed_collectives<auto_reducer>;
  using variant =
      std::variant<std::unique_ptr<detail::solo_reducer>,
                   std::unique_ptr<basic_reducer<ring_algorithm, shm>>,                                // ring<shm>
                   std::unique_ptr<hierarchical>, std::unique_ptr<basic_reducer<ring_algorithm, tcp>>  // ring<tcp>
#if defined(DDP_WITH_MPI)
                   ,
                   std::unique_ptr<mpi_reducer>
#endif
#if defined(DDP_WITH_NCCL)
                   ,
                   std::unique_ptr<nccl_reducer>
#endif
                   >;
  variant r_;
  // Calls `f` on the engine (reducer/detail/auto_impl.hpp).
  template <class F>
  decltype(auto) visit(F&& f);
  template <class F>
  decltype(auto) visit(F&& f) const;

 public:
  using typed_collectives::allreduce;
  using typed_collectives::allreduce_async;

  /// Picks and builds the engine for `pg` (`pg.options().backend`, else `backend` when given).
  explicit auto_reducer(process_group& pg);
  auto_reducer(process_group& pg, ddp::backend wanted);
  ~auto_reducer();

  auto_reducer(const auto_reducer&) = delete;
  auto_reducer& operator=(const auto_reducer&) = delete;

  /// What was chosen and why: "shm: 1 host, 4 ranks (...)".
  const std::string& describe() const noexcept { return what_; }
  /// The backend asked for (`automatic` unless one was named).
  ddp::backend requested() const noexcept { return asked_; }
  /// The backend running: `automatic` only for a group of one rank (no communication).
  ddp::backend chosen() const noexcept { return chosen_; }
  /// Which ranks share a host (one host for a group of one).
  const ddp::topology& topology() const noexcept { return topo_; }
  /// The shared-memory segment this rank's buckets may live in (shm and hierarchical), else
  /// nullptr. `ddp::auto_allocator` draws from it.
  shm* segment() noexcept;
#if defined(DDP_WITH_NCCL)
  /// The NCCL reducer when `nccl` was chosen, else nullptr (`ddp::auto_allocator` takes its
  /// device and stream).
  nccl_reducer* nccl() noexcept;
#endif

  /// The reducer's own handle on its group.
  process_group& group() noexcept { return pg_; }

  int rank() const noexcept;
  int size() const noexcept;

  request allreduce_async(void* data, std::size_t count, dtype t, op o, const bucket_tag& tag = {});
  /// True when the engine reads bucket_tag::sources in place (ring<tcp>: several hosts, one rank
  /// each): the wrapper's copy mode then copies no gradient into its buckets.
  bool reads_sources() const noexcept;
  request broadcast_async(void* data, std::size_t count, dtype t, int root);
  request reduce_scatter_async(const void* in, void* out, std::size_t count_per_rank, dtype t, op o,
                               const bucket_tag& tag = {});
  request allgather_async(const void* in, void* out, std::size_t count_per_rank, dtype t, const bucket_tag& tag = {});
  request barrier_async();
  void allreduce(void* data, std::size_t count, dtype t, op o, const bucket_tag& tag = {});
  void barrier();
  /// The engine's progress thread, lent to a decorator (`ddp::hooked` runs its hook on it):
  /// see reducer/detail/front_end.hpp.
  request run_in_order(std::function<void()> job);
  bool try_run_inline(const std::function<void()>& job);
  /// Ends the collectives in flight on every rank (where the engine can be interrupted: all but MPI).
  void abort() noexcept;
  /// The same, with the reason: the peers raise `code` quoting `why` ("rank R reports: why")
  /// where the engine can carry it (shm, tcp, hierarchical), else as abort(). What
  /// `ddp::hooked` calls when its hook throws.
  void abort(errc code, const std::string& why) noexcept;

 private:
  void wait(const request& r) const { r.wait(detail::timing::collective_deadline(timeout_)); }
  void build(process_group& pg, ddp::backend wanted);

  process_group pg_;
  ddp::backend asked_;
  ddp::backend chosen_ = backend::automatic;
  std::string what_;
  ddp::topology topo_{{0}, {{0}}};
  std::chrono::milliseconds timeout_{0};
};

}  // namespace DDP_ABI
}  // namespace ddp

#if !defined(DDP_SEPARATE_COMPILATION)
#include <ddp/reducer/detail/auto_impl.hpp>
#endif
