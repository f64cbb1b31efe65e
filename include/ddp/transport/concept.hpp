#pragma once
/// \file transport/concept.hpp
/// `ddp::transport`: everything the ring and tree algorithms (reducer/ring.hpp) call on
/// a point-to-point transport, with the exact arguments they pass. `ddp::ring<T>` and
/// `ddp::tree<T>` are constrained by it, so a transport that lacks one of these is rejected where
/// the reducer is named, and the diagnostic names the missing requirement (e.g.
/// `transport_has_fail`). See docs/reducers.md, "Writing a transport".
///
/// \code
/// #include <ddp/transport/concept.hpp>
/// #include <ddp/transport/tcp.hpp>
/// static_assert(ddp::transport<ddp::tcp>);
/// \endcode

#include <sys/uio.h>

#include <concepts>
#include <cstddef>
#include <span>
#include <string>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/error.hpp>
#include <ddp/process_group.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// The stand-in for the callable the algorithms pass to `sendrecv` as `on_recv`: a lambda of
/// their own, with captures, called after each read with the bytes received so far (descriptor
/// included). A transport takes it as a template parameter (or any callable wrapper that
/// accepts such a lambda); the concept checks `sendrecv` with this type.
struct sendrecv_progress {
  void* state = nullptr;  ///< a capture: not convertible to a plain function pointer
  void operator()(std::size_t /*received*/) const noexcept {}
};

/// `T t{pg}` builds the transport over a joined process group; a reducer does it once, on every
/// rank in the same order (a collective). `basic_reducer`'s constructor that takes transport
/// options builds `T{pg, options}`.
template <class T>
concept transport_constructible_from_group = std::constructible_from<T, process_group&>;

/// `t.rank()` and `t.size()`: this process's rank and the number of ranks, as `int`.
template <class T>
concept transport_has_rank_and_size = requires(const T& t) {
  { t.rank() } -> std::same_as<int>;
  { t.size() } -> std::same_as<int>;
};

/// `t.send(peer, data, bytes, until)`: sends all `bytes` to `peer` or throws `ddp::error`
/// (errc::timeout at `until`, errc::peer_lost, ...).
template <class T>
concept transport_has_send = requires(T& t, int peer, const void* data, std::size_t bytes, deadline_t until) {
  t.send(peer, data, bytes, until);
};

/// `t.recv(peer, data, bytes, until)`: receives exactly `bytes` from `peer` or throws.
template <class T>
concept transport_has_recv = requires(T& t, int peer, void* data, std::size_t bytes, deadline_t until) {
  t.recv(peer, data, bytes, until);
};

/// `t.sendrecv(to, out, from, in, until, on_recv)`: sends the parts `out` (up to 4 iovecs) to
/// `to` while it receives into the parts `in` from `from`, both at once (a ring sends to one
/// neighbour while the other sends to it: one direction after the other would deadlock), and
/// calls `on_recv(bytes_received_so_far)` as bytes arrive, so the algorithm can check the
/// descriptor at the front and reduce segments before the rest lands. `on_recv` may throw
/// (through `fail`); the transport lets the exception pass.
template <class T>
concept transport_has_sendrecv = requires(T& t, int to, std::span<const iovec> out, int from, std::span<const iovec> in,
                                          deadline_t until) {
  // A temporary, as the algorithms pass it: a sendrecv taking `F&` would not bind it.
  t.sendrecv(to, out, from, in, until, sendrecv_progress{});
};

/// A transport whose sendrecv takes any number of parts, not only 4 (`static constexpr bool
/// any_parts = true`, as `ddp::tcp`): the ring then sends a bucket's first chunk from the
/// engine's gradients, one part each, instead of having them copied into the bucket first.
template <class T>
concept transport_any_parts = requires {
  requires T::any_parts;
};

/// `t.fail(code, message)`: marks the transport failed on every rank (peers blocked on this
/// one learn it at once) and throws `ddp::error{code}` here. The algorithms call it when a
/// peer's collective descriptor differs from theirs (errc::mismatch). Must not return.
template <class T>
concept transport_has_fail = requires(T& t, errc code, const std::string& message) {
  t.fail(code, message);
};

/// `t.abort()`, noexcept, from any thread: wakes every wait on this rank and tells the peers
/// (errc::aborted); what `ring<T>::abort()` calls while a collective may be running.
template <class T>
concept transport_has_abort = requires(T& t) {
  { t.abort() }
  noexcept;
};

/// A point-to-point transport for `ddp::ring<T>` and `ddp::tree<T>`. Calls on one transport
/// come from one thread at a time (the reducer's), except `abort()`.
/// \code
/// static_assert(ddp::transport<ddp::tcp>);
/// \endcode
template <class T>
concept transport = transport_constructible_from_group<T> && transport_has_rank_and_size<T> && transport_has_send<T> &&
    transport_has_recv<T> && transport_has_sendrecv<T> && transport_has_fail<T> && transport_has_abort<T>;

}  // namespace DDP_ABI
}  // namespace ddp
