#pragma once
/// \file reducer/hierarchical.hpp
/// `ddp::hierarchical`: collectives for ranks on several hosts, several ranks per host, as
/// Horovod's hierarchical allreduce and NCCL's intra/inter-node split do. An allreduce reduces
/// within each host through that host's shared-memory segment, allreduces between one leader
/// per host (its lowest rank) with a ring over TCP, and broadcasts the result back within each
/// host. Only the leaders touch the network: one stream per host instead of one per rank.
/// The default reducer (`ddp::auto_reducer`) picks it when the ranks span several hosts.
///
/// \code
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// ddp::hierarchical red{pg};                        // collective: every rank, in the same order
/// std::vector<float> g(1 << 20, 1.0f);
/// red.allreduce(std::span<float>{g}, ddp::op::avg);  // same bits on every rank
/// \endcode
///
/// Bucket buffers from `ddp::shm_allocator` on this reducer's `transport()` (the host's
/// segment) take the zero-copy path within the host.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/uio.h>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/detail/collective.hpp>
#include <ddp/detail/copy.hpp>
#include <ddp/detail/first_failure.hpp>
#include <ddp/detail/kernels.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/group/kv_store.hpp>
#include <ddp/group/topology.hpp>
#include <ddp/group/verdict.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/basic_reducer.hpp>
#include <ddp/reducer/detail/front_end.hpp>
#include <ddp/reducer/ring.hpp>
#include <ddp/reducer/shm.hpp>
#include <ddp/transport/tcp.hpp>
#if defined(DDP_WITH_MPI)
#include <ddp/reducer/mpi.hpp>
#endif

namespace ddp {
inline namespace DDP_ABI {

/// Tunables of `ddp::hierarchical`.
struct hierarchical_options {
  /// Of the ring between the hosts' leaders.
  reducer_options inter{};
  /// Of each host's segment (`members` is set by the reducer).
  shm_options intra{};
  /// Of the leaders' TCP connections.
  tcp_options tcp{};
  /// What carries the leaders' traffic: `tcp`; `mpi` (built with DDP_WITH_MPI, MPI initialized
  /// at MPI_THREAD_SERIALIZED or above with the group's processes as its world); `automatic`:
  /// MPI where that holds, else tcp.
  ddp::backend between = ddp::backend::automatic;
  /// The group's topology when the caller gathered it already (`ddp::auto_reducer` does): the
  /// reducer then does not gather it again. Every rank gives one, or none does (errc::mismatch).
  std::optional<ddp::topology> topology{};
};

namespace detail {

/// A point-to-point transport seen through some of its ranks, renumbered 0..n-1 in the order
/// given (the ring and tree algorithms run over it unchanged). Errors still name the group's
/// ranks: the transport underneath raises them.
template <class T>
class member_view {
 public:
  member_view(T& t, std::vector<int> members) : t_(&t), members_(std::move(members)) {
    const auto me = std::find(members_.begin(), members_.end(), t.rank());
    rank_ = me == members_.end() ? -1 : static_cast<int>(me - members_.begin());
  }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return static_cast<int>(members_.size()); }
  /// The group's rank of member `i` (what errors name: detail::group_rank_of).
  int group_rank(int i) const { return at(i); }
  void send(int peer, const void* data, std::size_t n, deadline_t until) { t_->send(at(peer), data, n, until); }
  void recv(int peer, void* data, std::size_t n, deadline_t until) { t_->recv(at(peer), data, n, until); }
  template <class OnRecv>
  void sendrecv(int to, std::span<const iovec> out, int from, std::span<const iovec> in, deadline_t until,
                OnRecv&& on_recv) {
    t_->sendrecv(at(to), out, at(from), in, until, std::forward<OnRecv>(on_recv));
  }
  void sendrecv(int to, const void* sbuf, std::size_t sn, int from, void* rbuf, std::size_t rn, deadline_t until) {
    t_->sendrecv(at(to), sbuf, sn, at(from), rbuf, rn, until);
  }
  [[noreturn]] void fail(errc code, const std::string& msg) { t_->fail(code, msg); }
  void abort() noexcept { t_->abort(); }

 private:
  int at(int i) const { return members_.at(static_cast<std::size_t>(i)); }
  T* t_;
  std::vector<int> members_;
  int rank_ = -1;
};

/// Multiplies `count` elements of `t` at `p` by `f` (floating types, one rounding each;
/// integers are left alone).
inline void scale_in_place(void* p, std::size_t count, dtype t, double f) {
  kern::dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    auto* v = static_cast<T*>(p);
    if constexpr (std::is_same_v<T, double>) {
      for (std::size_t i = 0; i < count; ++i) v[i] *= f;
    } else if constexpr (std::is_same_v<T, float>) {
      for (std::size_t i = 0; i < count; ++i) v[i] = static_cast<float>(static_cast<double>(v[i]) * f);
    } else if constexpr (!std::is_integral_v<T>) {
      for (std::size_t i = 0; i < count; ++i)
        v[i] = T(static_cast<float>(static_cast<double>(static_cast<float>(v[i])) * f));
    }
  });
}

/// The engine of `ddp::hierarchical` (reducer/detail/front_end.hpp): every rank's host segment,
/// and a TCP transport of which only the leaders use connections (made on first use).
class hier_engine {
 public:
  static constexpr const char* name = "hierarchical";
  static constexpr bool descriptors = true;
  static constexpr bool deadlines = true;
  static constexpr bool launches_at_call = false;
  static constexpr coll_algo id = coll_algo::ring;  // of the leaders' messages
  coll_variant variant(coll_kind, std::size_t) const noexcept { return coll_variant::none; }

  hier_engine(process_group& pg, hierarchical_options o)
      : pg_(agree_on_reducer(pg, o.topology ? "hierarchical (topology given)" : "hierarchical")),
        topo_(o.topology ? std::move(*o.topology) : topology::of(pg_)),
        ctx_(pg_),
        shm_(pg_, with_members(o.intra, topo_.ranks_on(topo_.host_of(pg_.rank())))),
        tcp_(pg_, o.tcp),
        leaders_(tcp_, topo_.leaders()),
        opts_(std::move(o)) {
    if (opts_.between != backend::automatic && opts_.between != backend::tcp && opts_.between != backend::mpi)
      raise(errc::invalid_argument, pg_.rank(),
            std::string("hierarchical_options::between is tcp, mpi or auto, not ") + backend_name(opts_.between));
#if defined(DDP_WITH_MPI)
    if (opts_.between != backend::tcp && topo_.hosts() > 1) {
      // Every rank reaches the same verdict: whether MPI is initialized, at which level, and
      // its world's size are the same everywhere under one mpirun.
      bool usable = true;
      try {
        mpi_engine::check_ready(pg_.rank());
        int world = 0;
        DDP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world));
        if (world != pg_.size())
          raise(errc::invalid_argument, pg_.rank(),
                "hierarchical: MPI_COMM_WORLD has " + std::to_string(world) + " processes, the group " +
                    std::to_string(pg_.size()));
      } catch (const error&) {
        if (opts_.between == backend::mpi) throw;
        usable = false;
      }
      if (usable) {
        MPI_Comm c = MPI_COMM_NULL;
        DDP_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, leader() ? 0 : MPI_UNDEFINED, pg_.rank(), &c));
        if (c != MPI_COMM_NULL) {
          mpi_ = std::make_unique<mpi_engine>(c, pg_.timeout());  // its own duplicate
          MPI_Comm_free(&c);
        }
        between_ = backend::mpi;
      }
    }
#else
    if (opts_.between == backend::mpi)
      raise(errc::unsupported, pg_.rank(),
            "hierarchical: MPI between the leaders is not compiled in: build with Open MPI and define DDP_WITH_MPI "
            "(Meson's ddp_mpi_dep does), which makes <ddp/reducer/hierarchical.hpp> include <ddp/reducer/mpi.hpp>");
#endif
  }

  int rank() const noexcept { return pg_.rank(); }
  int size() const noexcept { return pg_.size(); }
  std::chrono::milliseconds timeout() const noexcept { return pg_.timeout(); }
  process_group& group() noexcept { return pg_; }
  const ddp::topology& topology() const noexcept { return topo_; }
  shm& transport() noexcept { return shm_; }
  bool leader() const noexcept { return shm_.rank() == 0; }
  /// What carries the leaders' traffic: tcp or mpi.
  ddp::backend between() const noexcept { return between_; }
  void abort() noexcept { abort(errc::aborted, "rank " + std::to_string(pg_.rank()) + " called abort()"); }
  /// abort() with the reason: the host's ranks read it in the segment, the other hosts in the
  /// group's failure record (which the tcp transport writes), so every rank quotes it. The
  /// record goes first: the host's leader, woken by the segment, must find it there rather than
  /// record its own view of the abort.
  void abort(errc code, const std::string& why) noexcept {
    tcp_.abort(code, why);
    shm_.abort(code, why);
  }

  void allreduce(const coll_desc& d, deadline_t until, void* data, std::size_t count, dtype t, op o) {
    if (topo_.hosts() == 1) return run_local([&] { shm_.allreduce(data, count, t, o, until); });
    const bool integral = t == dtype::i32 || t == dtype::i64;
    const bool uniform = topo_.uniform();
    // avg: the mean within the host (safe from overflow in f16), then the mean of the hosts'
    // means, each weighted by its share of the ranks when the hosts differ in size. Integer avg
    // sums everything and truncates once, as the flat reducers do.
    const op local = o == op::avg && integral ? op::sum : o;
    const op inter = o == op::avg && (integral || !uniform) ? op::sum : o;
    run_local([&] { shm_.allreduce(data, count, t, local, until); });
    if (leader())
      run_leader([&] {
        if (o == op::avg && !integral && !uniform)
          scale_in_place(data, count, t, static_cast<double>(shm_.size()) / static_cast<double>(pg_.size()));
        if (!inter_mpi([&](auto& m) { m.allreduce(data, count, t, inter); }))
          p2p_allreduce<ring_algorithm>(leaders_, d, until, data, count, t, inter, opts_.inter);
        if (o == op::avg && integral) avg_finish(data, count, t, pg_.size());  // the sum / world, truncated
      });
    run_local([&] { shm_.broadcast(data, count, t, 0, follow(until)); });
  }

  void broadcast(const coll_desc& d, deadline_t until, void* data, std::size_t count, dtype t, int root) {
    const int rh = topo_.host_of(root), mine = topo_.host_of(pg_.rank());
    const auto& on_root_host = topo_.ranks_on(rh);
    const int local_root =
        static_cast<int>(std::find(on_root_host.begin(), on_root_host.end(), root) - on_root_host.begin());
    if (mine == rh) run_local([&] { shm_.broadcast(data, count, t, local_root, until); });
    if (topo_.hosts() == 1) return;
    if (leader())
      run_leader([&] {
        if (!inter_mpi([&](auto& m) { m.broadcast(data, count, t, rh); }))
          tree_broadcast(leaders_, d, data, count * checked_size(t), rh, until);
      });
    if (mine != rh) run_local([&] { shm_.broadcast(data, count, t, 0, follow(until)); });
  }

  void reduce_scatter(const coll_desc& d, deadline_t until, const void* in, void* out, std::size_t per_rank, dtype t,
                      op o) {
    const std::size_t slice = per_rank * checked_size(t);
    std::vector<char> work(slice * static_cast<std::size_t>(pg_.size()));
    copy_bytes(work.data(), in, work.size());
    allreduce(d, until, work.data(), per_rank * static_cast<std::size_t>(pg_.size()), t, o);
    copy_bytes(out, work.data() + static_cast<std::size_t>(pg_.rank()) * slice, slice);
  }

  void allgather(const coll_desc& d, deadline_t until, const void* in, void* out, std::size_t per_rank, dtype t) {
    const std::size_t slice = per_rank * checked_size(t);
    auto* o = static_cast<char*>(out);
    if (o + static_cast<std::size_t>(pg_.rank()) * slice != in)
      std::memmove(o + static_cast<std::size_t>(pg_.rank()) * slice, in, slice);
    for (int r = 0; r < pg_.size(); ++r) broadcast(d, until, o + static_cast<std::size_t>(r) * slice, per_rank, t, r);
  }

  void barrier(const coll_desc& d, deadline_t until) {
    run_local([&] { shm_.barrier(until); });
    if (topo_.hosts() == 1) return;
    if (leader())
      run_leader([&] {
        if (!inter_mpi([&](auto& m) { m.barrier(); })) ring_barrier(leaders_, d, until);
      });
    run_local([&] { shm_.barrier(follow(until)); });
  }

 private:
  /// Runs `f` on the leaders' MPI engine when they talk over MPI; false when they use tcp.
  template <class F>
  bool inter_mpi([[maybe_unused]] F&& f) {
#if defined(DDP_WITH_MPI)
    if (mpi_) {
      f(*mpi_);
      return true;
    }
#endif
    return false;
  }
  static shm_options with_members(shm_options o, std::vector<int> members) {
    o.members = std::move(members);
    return o;
  }
  /// A rank that waits for its leader's result waits longer than the leader's own deadline:
  /// when the network fails, the leader's error (naming the ranks lost) reaches it first.
  deadline_t follow(deadline_t until) const { return leader() ? until : until + detail::timing::hier_follow_grace; }
  /// A step within the host. When it fails because this host's leader gave up (its network
  /// failed), the group's recorded failure says why better than "aborted by rank L": that is
  /// what this rank reports. When the store is gone with rank 0, the reason the leader left
  /// in the segment (run_leader) says it.
  template <class F>
  void run_local(F&& f) {
    try {
      f();
    } catch (const error& e) {
      if (!leader() && detail::is_group_verdict(e.condition())) {
        auto g = ctx_.verdict().first(nullptr, true);
        int from = shm_.members().front();
        if (g.empty()) std::tie(g, from) = shm_.abort_reason();
        // This rank's own verdict (it called abort()) came from no one; a rank's own report
        // names it already.
        const auto own = [&](int r) { return g.text.rfind("rank " + std::to_string(r) + " reports: ", 0) == 0; };
        if (!g.empty())
          raise(g.code, pg_.rank(),
                own(pg_.rank()) || (from != shm_.members().front() && own(from)) ? g.text
                : from == shm_.members().front()
                    ? g.text + " (reported to this rank by its host's leader, rank " + std::to_string(from) + ")"
                    : g.text + " (reported to this rank by rank " + std::to_string(from) + ", on its host)");
      }
      // A leader whose host failed tells the other hosts at once, rather than letting them
      // run into their deadline.
      if (leader()) fail_network(e);
      throw;
    }
  }
  /// A step between the leaders. On failure the host's other ranks are woken (they report the
  /// group's recorded failure, which the transport wrote before raising).
  template <class F>
  void run_leader(F&& f) {
    try {
      f();
    } catch (const error& e) {
      // The reason goes into the segment too: when the failure is rank 0's (the store's host),
      // the host's ranks cannot read it from the group's record.
      shm_.abort(e.condition(), message_of(e));
      throw;
    } catch (...) {
      shm_.abort();
      throw;
    }
  }
  void fail_network(const error& e) noexcept {
    try {
      tcp_.abort(e.condition(), message_of(e));  // records it as the group's failure, shuts the links
    } catch (...) {
      tcp_.abort();
    }
  }

  process_group pg_;  // the reducer's own handle: the group stays open while this lives
  ddp::topology topo_;
  transport_context ctx_;  // the group's verdict
  shm shm_;
  tcp tcp_;
  member_view<tcp> leaders_;
  hierarchical_options opts_;
  ddp::backend between_ = backend::tcp;
#if defined(DDP_WITH_MPI)
  std::unique_ptr<mpi_engine> mpi_;  // the leaders' communicator (leaders only)
#endif
};

}  // namespace detail

/// Hierarchical reducer: shared memory within each host, a TCP ring between the hosts' leaders.
/// Constructing one is a collective. With one host it is the shared-memory reducer; with one
/// rank per host, a ring over TCP.
class hierarchical : public detail::reducer_front_end<detail::hier_engine> {
  using base = detail::reducer_front_end<detail::hier_engine>;

 public:
  /// The host segment: `ddp::shm_allocator` is built from it (buckets in shared memory).
  using transport_type = shm;

  explicit hierarchical(process_group& pg, hierarchical_options o = {}) : base(pg.rank(), pg, std::move(o)) {}

  using base::abort;
  /// abort() with the reason: every rank, on this host and the others, raises `code` quoting
  /// `why` ("rank R reports: why"). What `ddp::hooked` calls when its hook throws.
  void abort(errc code, const std::string& why) noexcept { this->engine().abort(code, why); }

  /// Which ranks share a host.
  const ddp::topology& topology() const noexcept { return this->engine().topology(); }
  /// This host's segment.
  shm& transport() noexcept { return this->engine().transport(); }
  process_group& group() noexcept { return this->engine().group(); }
  /// True on the rank that carries its host's traffic to the other hosts.
  bool leader() const noexcept { return this->engine().leader(); }
  /// What carries the leaders' traffic: `backend::tcp` or `backend::mpi`.
  ddp::backend between() const noexcept { return this->engine().between(); }
};

}  // namespace DDP_ABI
}  // namespace ddp
