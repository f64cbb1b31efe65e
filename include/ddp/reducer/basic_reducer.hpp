#pragma once
/// \file basic_reducer.hpp
/// `ddp::basic_reducer<Algorithm, Transport>`: ring and tree reducers. Every reducer of ddp
/// (these, `mpi_reducer`, `nccl_reducer`) is one front end (reducer/detail/front_end.hpp: the
/// calls, argument checks, descriptors, progress thread, requests and bounded waits) over an
/// engine that moves the bytes; `engine_for<Algorithm, Transport>` picks the engine here.
/// Collectives run on one progress thread per reducer, in issue order, so several async
/// requests can be in flight and every rank issues the same sequence. A blocking call runs on
/// the calling thread when nothing is queued, else it is queued and waited for.
///
/// \code
/// ddp::ring<ddp::tcp> ring{pg};
/// ring.allreduce(std::span<float>{v}, ddp::op::sum);
/// auto req = ring.allreduce_async(std::span<float>{v}, ddp::op::avg);
/// req.wait(deadline);
/// \endcode

#include <cstddef>
#include <utility>

#include <ddp/version.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/detail/front_end.hpp>
#include <ddp/transport/concept.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Run-time tunables of ring and tree reducers. See docs/reducers.md.
struct reducer_options {
  /// Ring: the receive side reduces each segment of this many bytes as soon as it has arrived.
  std::size_t segment_bytes = 256 << 10;
  /// Tree: messages up to this size use recursive doubling (latency, log2 n steps, full buffer
  /// each step); larger ones use recursive halving-doubling (bandwidth).
  std::size_t small_bytes = 64 << 10;
  friend bool operator==(const reducer_options&, const reducer_options&) = default;
};

/// Tag: ring allreduce (reduce-scatter + allgather), bandwidth-optimal: 2(n-1)/n of the buffer
/// per rank, 2(n-1) steps.
struct ring_algorithm {};
/// Tag: tree allreduce: recursive doubling for small messages (log2 n steps), recursive
/// halving-doubling for large ones.
struct tree_algorithm {};

namespace detail {
/// The ring and tree algorithms over a point-to-point transport (reducer/ring.hpp).
template <class Algorithm, transport Transport>
class p2p_engine;
}  // namespace detail

/// The engine that runs `basic_reducer<Algorithm, Transport>`: the ring and tree algorithms of
/// reducer/ring.hpp over any `ddp::transport` (tcp), unless an engine of its own is
/// registered for `Transport` by specializing this (reducer/shm.hpp does for `ddp::shm`).
template <class Algorithm, class Transport>
struct engine_for {
  using type = detail::p2p_engine<Algorithm, Transport>;
};

/// Ring or tree reducer over `Transport` (`ddp::tcp`, any `ddp::transport`, or `ddp::shm`).
/// Constructing one is a collective: every rank constructs its reducers in the same order, and
/// every rank must pick the same algorithm and `reducer_options` (errc::mismatch otherwise).
/// Threads: see reducer/detail/front_end.hpp and docs/reducers.md.
template <class Algorithm, class Transport>
class basic_reducer : public detail::reducer_front_end<typename engine_for<Algorithm, Transport>::type> {
  using base = detail::reducer_front_end<typename engine_for<Algorithm, Transport>::type>;

 public:
  using transport_type = Transport;

  /// Keeps a handle on `pg` of its own: the group stays open while the reducer lives.
  explicit basic_reducer(process_group& pg, reducer_options o = {}) : base(pg.rank(), pg, o) {}
  template <class TransportOptions>
  basic_reducer(process_group& pg, TransportOptions t, reducer_options o) : base(pg.rank(), pg, std::move(t), o) {}

  Transport& transport() noexcept { return this->engine().transport(); }
  process_group& group() noexcept { return this->engine().group(); }
  const reducer_options& options() const noexcept { return this->engine().options(); }
};

/// Ring reducer over `Transport` (`ddp::tcp` or `ddp::shm`).
template <class Transport>
using ring = basic_reducer<ring_algorithm, Transport>;
/// Tree reducer over `Transport` (`ddp::tcp` or `ddp::shm`).
template <class Transport>
using tree = basic_reducer<tree_algorithm, Transport>;

}  // namespace DDP_ABI
}  // namespace ddp
