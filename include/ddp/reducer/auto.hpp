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
#include <ddp/detail/timing.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/group/backend.hpp>
#include <ddp/group/topology.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/detail/front_end.hpp>
#include <ddp/reducer/detail/typed_collectives.hpp>
#include <ddp/reducer/hierarchical.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/request.hpp>
#include <ddp/transport/tcp.hpp>
#if defined(DDP_WITH_MPI)
#include <ddp/reducer/mpi.hpp>
#endif
#if defined(DDP_WITH_NCCL)
#include <ddp/reducer/nccl.hpp>
#endif

namespace ddp {
inline namespace v0 {
namespace detail {

/// The engine of a group of one rank: every collective is already done.
class solo_engine {
 public:
  static constexpr const char* name = "none";
  static constexpr bool descriptors = false;
  static constexpr bool deadlines = false;
  static constexpr bool launches_at_call = false;

  explicit solo_engine(process_group& pg) : pg_(pg) {
    if (pg_.size() != 1)
      raise(errc::invalid_argument, pg_.rank(), "the reducer without communication is for a group of 1 rank");
  }
  int rank() const noexcept { return 0; }
  int size() const noexcept { return 1; }
  std::chrono::milliseconds timeout() const noexcept { return pg_.timeout(); }
  // One rank's data is its own sum, average, minimum, maximum and product.
  void allreduce(void*, std::size_t, dtype, op) noexcept {}
  void broadcast(void*, std::size_t, dtype, int) noexcept {}
  void reduce_scatter(const void* in, void* out, std::size_t n, dtype t, op) {
    if (in != out && n > 0) std::memmove(out, in, n * checked_size(t));
  }
  void allgather(const void* in, void* out, std::size_t n, dtype t) {
    if (in != out && n > 0) std::memmove(out, in, n * checked_size(t));
  }
  void barrier() noexcept {}

 private:
  process_group pg_;
};

class solo_reducer : public reducer_front_end<solo_engine> {
 public:
  explicit solo_reducer(process_group& pg) : reducer_front_end(pg.rank(), pg) {}
};

}  // namespace detail

/// The default reducer: the engine for the group it finds (see the table above). Constructing
/// it is a collective; every rank must ask for the same backend (errc::mismatch otherwise).
class auto_reducer : public detail::typed_collectives<auto_reducer> {
  friend class detail::typed_collectives<auto_reducer>;
  using variant = std::variant<std::unique_ptr<detail::solo_reducer>, std::unique_ptr<ring<shm>>,
                               std::unique_ptr<hierarchical>, std::unique_ptr<ring<tcp>>
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
  template <class F>
  decltype(auto) visit(F&& f) {
    return std::visit([&](auto& p) -> decltype(auto) { return f(*p); }, r_);
  }
  template <class F>
  decltype(auto) visit(F&& f) const {
    return std::visit([&](const auto& p) -> decltype(auto) { return f(*p); }, r_);
  }

 public:
  using typed_collectives::allreduce;
  using typed_collectives::allreduce_async;

  /// Picks and builds the engine for `pg` (`pg.options().backend`, else `backend` when given).
  explicit auto_reducer(process_group& pg) : auto_reducer(pg, pg.options().backend) {}
  auto_reducer(process_group& pg, ddp::backend wanted) : pg_(pg), asked_(wanted), timeout_(pg.timeout()) {
    const int n = pg.size();
    if (n == 1 && (wanted == backend::automatic || wanted == backend::shm || wanted == backend::hierarchical)) {
      chosen_ = backend::automatic;
      what_ = "none: 1 rank, no communication";
      r_ = std::make_unique<detail::solo_reducer>(pg);
    } else {
      // One exchange says every rank's backend and host.
      const auto all = pg.all_gather(std::string(backend_name(wanted)) + '\n' + host_identity());
      std::vector<std::string> ids;
      for (int r = 0; r < n; ++r) {
        const auto& s = all[static_cast<std::size_t>(r)];
        const auto nl = s.find('\n');
        if (s.substr(0, nl) != backend_name(wanted))
          detail::raise(errc::mismatch, pg.rank(),
                        "backend mismatch: rank " + std::to_string(pg.rank()) + " asked for '" + backend_name(wanted) +
                            "', rank " + std::to_string(r) + " for '" + s.substr(0, nl) +
                            "'; every rank must set the same DDP_BACKEND (init_options::backend)");
        ids.push_back(s.substr(nl + 1));
      }
      topo_ = topology::from_identities(ids);
      build(pg, wanted);
    }
    if (pg.options().debug_info && pg.rank() == 0)
      std::fprintf(stderr, "ddp: backend %s -> %s\n", backend_name(asked_), what_.c_str());
  }

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
  shm* segment() noexcept {
    return std::visit(
        [](auto& r) -> shm* {
          using R = std::decay_t<decltype(*r)>;
          if constexpr (std::is_same_v<R, ring<shm>> || std::is_same_v<R, hierarchical>)
            return &r->transport();
          else
            return nullptr;
        },
        r_);
  }
#if defined(DDP_WITH_NCCL)
  /// The NCCL reducer when `nccl` was chosen, else nullptr (`ddp::auto_allocator` takes its
  /// device and stream).
  nccl_reducer* nccl() noexcept {
    auto* p = std::get_if<std::unique_ptr<nccl_reducer>>(&r_);
    return p ? p->get() : nullptr;
  }
#endif

  /// The reducer's own handle on its group.
  process_group& group() noexcept { return pg_; }

  int rank() const noexcept {
    return visit([](auto& r) { return r.rank(); });
  }
  int size() const noexcept {
    return visit([](auto& r) { return r.size(); });
  }

  request allreduce_async(void* data, std::size_t count, dtype t, op o) {
    return visit([&](auto& r) { return r.allreduce_async(data, count, t, o); });
  }
  request broadcast_async(void* data, std::size_t count, dtype t, int root) {
    return visit([&](auto& r) { return r.broadcast_async(data, count, t, root); });
  }
  request reduce_scatter_async(const void* in, void* out, std::size_t count_per_rank, dtype t, op o) {
    return visit([&](auto& r) { return r.reduce_scatter_async(in, out, count_per_rank, t, o); });
  }
  request allgather_async(const void* in, void* out, std::size_t count_per_rank, dtype t) {
    return visit([&](auto& r) { return r.allgather_async(in, out, count_per_rank, t); });
  }
  request barrier_async() {
    return visit([&](auto& r) { return r.barrier_async(); });
  }
  void allreduce(void* data, std::size_t count, dtype t, op o) {
    visit([&](auto& r) { r.allreduce(data, count, t, o); });
  }
  void barrier() {
    visit([&](auto& r) { r.barrier(); });
  }
  /// The engine's progress thread, lent to a decorator (`ddp::hooked` runs its hook on it):
  /// see reducer/detail/front_end.hpp.
  request run_in_order(std::function<void()> job) {
    return visit([&](auto& r) { return r.run_in_order(std::move(job)); });
  }
  template <class F>
  bool try_run_inline(F&& job) {
    return visit([&](auto& r) { return r.try_run_inline(job); });
  }
  /// Ends the collectives in flight on every rank (where the engine can be interrupted: all but MPI).
  void abort() noexcept {
    visit([](auto& r) {
      if constexpr (requires { r.abort(); }) r.abort();
    });
  }
  /// The same, with the reason: the peers raise `code` quoting `why` ("rank R reports: why")
  /// where the engine can carry it (shm, tcp, hierarchical), else as abort(). What
  /// `ddp::hooked` calls when its hook throws.
  void abort(errc code, const std::string& why) noexcept {
    visit([&](auto& r) {
      if constexpr (requires {
                      { r.abort(code, why) }
                      noexcept;
                    })
        r.abort(code, why);
      else if constexpr (requires {
                           { r.transport().abort(code, why) }
                           noexcept;
                         })
        r.transport().abort(code, why);
      if constexpr (requires { r.abort(); }) r.abort();
    });
  }

 private:
  void wait(const request& r) const { r.wait(detail::timing::collective_deadline(timeout_)); }

  void build(process_group& pg, ddp::backend wanted) {
    const std::string where = topo_.describe();
    const bool by_name = wanted != backend::automatic;
    const std::string why = by_name ? " (asked for by name)" : "";
    ddp::backend b = wanted;
    if (b == backend::automatic) {
      if (topo_.hosts() == 1)
        b = backend::shm;
      else if (topo_.hosts() == topo_.world())
        b = backend::tcp;
      else
        b = backend::hierarchical;
    }
    chosen_ = b;
    switch (b) {
      case backend::shm:
        r_ = std::make_unique<ring<shm>>(pg);
        what_ = "shm: " + where + " (ring over one shared-memory segment; buckets in the segment)" + why;
        break;
      case backend::hierarchical: {
        auto h = std::make_unique<hierarchical>(pg, hierarchical_options{.topology = topo_});
        std::string leaders;
        for (int l : topo_.leaders()) leaders += (leaders.empty() ? "" : ", ") + std::to_string(l);
        what_ = "hierarchical: " + where + " (shm within each host, " +
                (h->between() == backend::mpi ? "MPI" : "tcp ring") + " between the leaders, ranks " + leaders + ")" +
                why;
        r_ = std::move(h);
        break;
      }
      case backend::tcp:
        r_ = std::make_unique<ring<tcp>>(pg);
        what_ =
            "tcp: " + where + " (ring over TCP" + (by_name ? "" : "; one rank per host, nothing to share") + ")" + why;
        break;
      case backend::mpi:
#if defined(DDP_WITH_MPI)
        r_ = std::make_unique<mpi_reducer>(pg);
        what_ = "mpi: " + where + " (MPI_Allreduce on MPI_COMM_WORLD)" + why;
        break;
#else
        detail::raise(errc::unsupported, pg.rank(),
                      "backend 'mpi' is not compiled in: build with Open MPI and define DDP_WITH_MPI (Meson's "
                      "ddp_mpi_dep does), which makes <ddp/reducer/auto.hpp> include <ddp/reducer/mpi.hpp>; or use "
                      "ddp::mpi_reducer from <ddp/reducer/mpi.hpp> directly");
#endif
      case backend::nccl:
#if defined(DDP_WITH_NCCL)
        r_ = std::make_unique<nccl_reducer>(pg);
        what_ = "nccl: " + where + " (NCCL on CUDA devices; buckets in device memory)" + why;
        break;
#else
        detail::raise(errc::unsupported, pg.rank(),
                      "backend 'nccl' is not compiled in: build with the CUDA Toolkit and NCCL and define "
                      "DDP_WITH_NCCL (Meson's ddp_nccl_dep does), which makes <ddp/reducer/auto.hpp> include "
                      "<ddp/reducer/nccl.hpp>; or use ddp::nccl_reducer from <ddp/reducer/nccl.hpp> directly");
#endif
      case backend::automatic:
        break;
    }
  }

  process_group pg_;
  ddp::backend asked_;
  ddp::backend chosen_ = backend::automatic;
  std::string what_;
  ddp::topology topo_{{0}, {{0}}};
  std::chrono::milliseconds timeout_{0};
};

}  // namespace v0
}  // namespace ddp
