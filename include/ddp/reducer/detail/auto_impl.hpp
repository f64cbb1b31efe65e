#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The definitions of reducer/auto.hpp: included by it in a header-only build, compiled once by
// src/ddp.cpp with DDP_SEPARATE_COMPILATION (detail/compiled.hpp).

#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include <ddp/detail/compiled.hpp>
#include <ddp/detail/consensus.hpp>
#include <ddp/reducer/auto.hpp>
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

namespace ddp {
inline namespace DDP_ABI {
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

template <class F>
decltype(auto) auto_reducer::visit(F&& f) {
  return std::visit([&](auto& p) -> decltype(auto) { return f(*p); }, r_);
}
template <class F>
decltype(auto) auto_reducer::visit(F&& f) const {
  return std::visit([&](const auto& p) -> decltype(auto) { return f(*p); }, r_);
}

DDP_DECL auto_reducer::auto_reducer(process_group& pg) : auto_reducer(pg, pg.options().backend) {}
DDP_DECL auto_reducer::auto_reducer(process_group& pg, ddp::backend wanted)
    : pg_(pg), asked_(wanted), timeout_(pg.timeout()) {
  const int n = pg.size();
  if (n == 1 && (wanted == backend::automatic || wanted == backend::shm || wanted == backend::hierarchical)) {
    chosen_ = backend::automatic;
    what_ = "none: 1 rank, no communication";
    r_ = std::make_unique<detail::solo_reducer>(pg);
  } else {
    // One exchange says every rank's backend and host.
    const auto all = pg.all_gather(std::string(backend_name(wanted)) + '\n' + host_identity());
    const auto asked = [](const std::string& s) { return s.substr(0, s.find('\n')); };
    // Every rank compares with rank 0, so every rank raises the same error.
    if (const auto differing = detail::differing_ranks(all, asked); !differing.empty())
      detail::raise(errc::mismatch, pg.rank(),
                    "backend mismatch: rank 0 asked for '" + asked(all[0]) + "', rank " +
                        std::to_string(differing.front()) + " for '" + asked(all[differing.front()]) +
                        "'; every rank must set the same DDP_BACKEND (init_options::backend)");
    std::vector<std::string> ids;
    for (const auto& s : all) ids.push_back(s.substr(s.find('\n') + 1));
    topo_ = topology::from_identities(ids);
    build(pg, wanted);
  }
  if (pg.options().debug_info && pg.rank() == 0)
    std::fprintf(stderr, "ddp: backend %s -> %s\n", backend_name(asked_), what_.c_str());
}

DDP_DECL auto_reducer::~auto_reducer() = default;

DDP_DECL shm* auto_reducer::segment() noexcept {
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
DDP_DECL nccl_reducer* auto_reducer::nccl() noexcept {
  auto* p = std::get_if<std::unique_ptr<nccl_reducer>>(&r_);
  return p ? p->get() : nullptr;
}
#endif

DDP_DECL int auto_reducer::rank() const noexcept {
  return visit([](auto& r) { return r.rank(); });
}
DDP_DECL int auto_reducer::size() const noexcept {
  return visit([](auto& r) { return r.size(); });
}

DDP_DECL request auto_reducer::allreduce_async(void* data, std::size_t count, dtype t, op o, const bucket_tag& tag) {
  return visit([&](auto& r) { return r.allreduce_async(data, count, t, o, tag); });
}
DDP_DECL bool auto_reducer::reads_sources() const noexcept {
  return visit([](const auto& r) { return r.reads_sources(); });
}
DDP_DECL request auto_reducer::broadcast_async(void* data, std::size_t count, dtype t, int root) {
  return visit([&](auto& r) { return r.broadcast_async(data, count, t, root); });
}
DDP_DECL request auto_reducer::reduce_scatter_async(const void* in, void* out, std::size_t count_per_rank, dtype t,
                                                    op o, const bucket_tag& tag) {
  return visit([&](auto& r) { return r.reduce_scatter_async(in, out, count_per_rank, t, o, tag); });
}
DDP_DECL request auto_reducer::allgather_async(const void* in, void* out, std::size_t count_per_rank, dtype t,
                                               const bucket_tag& tag) {
  return visit([&](auto& r) { return r.allgather_async(in, out, count_per_rank, t, tag); });
}
DDP_DECL request auto_reducer::barrier_async() {
  return visit([&](auto& r) { return r.barrier_async(); });
}
DDP_DECL void auto_reducer::allreduce(void* data, std::size_t count, dtype t, op o, const bucket_tag& tag) {
  visit([&](auto& r) { r.allreduce(data, count, t, o, tag); });
}
DDP_DECL void auto_reducer::barrier() {
  visit([&](auto& r) { r.barrier(); });
}
DDP_DECL request auto_reducer::run_in_order(std::function<void()> job) {
  return visit([&](auto& r) { return r.run_in_order(std::move(job)); });
}
DDP_DECL bool auto_reducer::try_run_inline(const std::function<void()>& job) {
  return visit([&](auto& r) { return r.try_run_inline(job); });
}
DDP_DECL void auto_reducer::abort() noexcept {
  visit([](auto& r) {
    if constexpr (requires { r.abort(); }) r.abort();
  });
}
DDP_DECL void auto_reducer::abort(errc code, const std::string& why) noexcept {
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

DDP_DECL void auto_reducer::build(process_group& pg, ddp::backend wanted) {
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

}  // namespace DDP_ABI
}  // namespace ddp
