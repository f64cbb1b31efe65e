#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// Every fixed duration of the group, its store, its connections and the shared-memory engine,
// in one place, each with the reason for its value. A wait that scales with the group's
// timeout is written as min(constant, timeout / k) where it is used: the constant here is its
// cap, so a short test timeout shrinks it and a long production timeout never stretches it.
// User-facing bounds (init_options::timeout, a call's deadline) are not here: they are the
// caller's.

#include <chrono>
#include <cstdint>

namespace ddp {
inline namespace DDP_ABI {
namespace detail::timing {

using namespace std::chrono_literals;

// ---- The failure verdict (group/verdict.hpp) ---------------------------------------------

/// Cap of a store round trip made while failing (min with timeout / 8): the store's host, rank 0,
/// may be the rank that is gone, and a verdict must not wait for it a whole timeout.
inline constexpr std::chrono::milliseconds failure_store_budget = 250ms;
/// Cap of the wait for a peer's failure record after its connection closed (min with
/// timeout / 8): a peer that leaves by an exception records why while it unwinds, a moment
/// after its socket closed; long enough for that, short next to any real deadline.
inline constexpr std::chrono::milliseconds failure_linger = 200ms;
/// Between two looks for that record: a store round trip on loopback is tens of microseconds,
/// so 10 ms costs the store nothing and finds the record within a few looks.
inline constexpr std::chrono::milliseconds failure_poll = 10ms;
/// Cap of the grace a rank at the end of a "waits for" chain gets to record that it waits too
/// (min with timeout / 4): its own deadline may come a little later than ours.
inline constexpr std::chrono::milliseconds stopped_grace = 1000ms;
/// Between two reads of the "waits for" records while that grace runs.
inline constexpr std::chrono::milliseconds stopped_poll = 20ms;
/// After how long a wait in shared memory records whom it waits for (min with timeout / 4),
/// ahead of its deadline: a leader that entered the collective earlier and times out over tcp
/// first then follows it to the late rank of this host. One store round trip to record it and
/// one to withdraw it, only for waits this long.
inline constexpr std::chrono::milliseconds shm_note_waiting = 1000ms;

// ---- Closing the group (group/detail/group_state.hpp) ------------------------------------

/// Cap of rank 0's wait for the others to read the group's failure from its store (min with
/// timeout / 4; group/detail/close_rules.hpp): it ends as soon as every rank has read it or
/// left, so only a rank that stopped (frozen, or busy outside ddp) makes rank 0 wait it out.
/// Long enough for a rank slowed by a loaded machine to reach its next collective and read
/// why (500 ms was not: such a rank found the store gone and blamed rank 0), short enough
/// that a frozen peer does not hold rank 0's error up by a whole timeout.
inline constexpr std::chrono::milliseconds close_failing_wait = 5000ms;
/// Between two looks at the store's client count (and the failure's readers) while rank 0
/// waits for the others.
inline constexpr std::chrono::milliseconds close_poll = 2ms;

// ---- Connections between ranks (group/detail/mesh.hpp, detail/socket.hpp) ---------------------

/// First pause before connecting again (to the store, or to a peer whose listener dropped an
/// attempt), doubled each time up to connect_backoff_max: a listener that is about to start is
/// found within milliseconds, one that is overwhelmed is not hammered.
inline constexpr std::chrono::milliseconds connect_backoff = 5ms;
inline constexpr std::chrono::milliseconds connect_backoff_max = 200ms;
/// First and largest pause between looks for a peer's announced address: it appears as soon as
/// the peer opens the channel, usually within milliseconds; 25 ms keeps thousands of ranks
/// looking at once from flooding the store.
inline constexpr std::chrono::milliseconds lookup_pause = 2ms;
inline constexpr std::chrono::milliseconds lookup_pause_max = 25ms;
/// Bound of one address lookup in the store: short, so that a thread holding the shared store
/// connection for a long wait of its own delays a first contact by this much at most each time.
inline constexpr std::chrono::milliseconds lookup_request = 100ms;
/// Slice of a wait for a connection another thread (or the peer) is making: between slices
/// the waiter checks the deadline, probes a silent peer and asks whether the group failed.
inline constexpr std::chrono::milliseconds link_wait_slice = 100ms;
/// Between two probes of a peer that promised its connection: a peer that died after promising
/// never sends it, and its closed listener refuses; asking four times a second finds that soon.
inline constexpr std::chrono::milliseconds link_probe_every = 250ms;
/// Bound of one such probe: on a live host a refused connection answers in microseconds.
inline constexpr std::chrono::milliseconds link_probe_connect = 100ms;

// ---- Listeners: the store's and the mesh acceptor's (group/detail/admission.hpp, reactor.hpp)

/// Handshake limit per connection while a listener is crowded or out of descriptors lately (a
/// crowd of strangers): a peer finishes its hello in milliseconds, a stranger stalled
/// mid-handshake must not hold a slot.
inline constexpr std::chrono::milliseconds crowded_handshake_limit = 1000ms;
/// Longest sleep of a listener's loop with nothing due (its eventfd wakes it for everything
/// else): bounds how late a timer can fire if the set of due times is ever out of date.
inline constexpr std::chrono::milliseconds listener_idle = 1000ms;
/// Rest of a listener out of descriptors when no stranger could make room: the loop must not
/// spin on a listener it cannot serve; clients retry their connection.
inline constexpr std::chrono::milliseconds listener_fd_rest = 50ms;
/// How long a listener stays "under pressure" after it ran out of descriptors.
inline constexpr std::chrono::milliseconds listener_pressure_linger = 10000ms;
/// How long a listener keeps to the room it had when it ran out of descriptors.
inline constexpr std::chrono::milliseconds listener_fd_room_linger = 1000ms;
/// Cap of one poll in ms_left(): poll() takes an int of milliseconds, and a deadline days away
/// must not overflow it; a loop that polls checks the deadline again when poll returns 0.
inline constexpr std::int64_t poll_cap_ms = 1'000'000;

// ---- Joining (group/detail/rendezvous.hpp) -------------------------------------------------------

/// Between two tries to join while the port still serves the job's earlier run (a launcher's
/// restart: the old store goes when its ranks have been ended).
inline constexpr std::chrono::milliseconds earlier_run_retry = 50ms;
/// How often an elastic group's rank looks again, while it waits for a step's decision or for
/// its round to close, whether the group failed meanwhile (group/elastic.hpp).
inline constexpr std::chrono::milliseconds elastic_poll = 20ms;
/// How long an elastic group's rank that leaves a generation waits for its heartbeat
/// predecessor's goodbye or death (group/detail/heartbeat.hpp, leave): the ranks leaving together
/// say goodbye within milliseconds; a dead one's connection ends a moment after its death.
inline constexpr std::chrono::milliseconds elastic_leave_wait = 100ms;
/// A wait of a millisecond: the store answers at once with the keys still missing.
inline constexpr std::chrono::milliseconds missing_ranks_wait = 1ms;
/// Bound of the requests that name the missing ranks after rendezvous timed out: the error
/// must come soon after the timeout, even when rank 0's store is slow to answer.
inline constexpr std::chrono::milliseconds missing_ranks_budget = 2000ms;

// ---- The store (store.hpp) -----------------------------------------------------------------

/// Time a refused connection (a failed handshake or claim) is kept half-closed to read its
/// refusal before it is closed.
inline constexpr std::chrono::milliseconds store_refused_linger = 2000ms;
/// Time a client that shut its side keeps its parked requests: a closed socket looks like a
/// half-closed one, and requests of a client that is gone must not hold a descriptor for as
/// long as they asked to wait.
inline constexpr std::chrono::milliseconds store_eof_linger = 10000ms;
/// Longest wait the store parks for a client (a year): the wait comes from the client and is
/// clamped before it meets the clock's range.
inline constexpr std::int64_t store_max_wait_ms = std::int64_t{366} * 86'400'000;
/// Margin the server keeps before a get/wait's deadline to answer it (min with an eighth of
/// the wait), and how long past the deadline the client reads that answer: a store that does
/// not answer (rank 0 frozen) is still noticed soon after the deadline.
inline constexpr std::chrono::milliseconds store_reply_slack = 250ms;
/// Once sent, a request's answer is read for this long at least, whatever is left of its
/// deadline: an answer abandoned half-way would make the connection unusable for every later call.
inline constexpr std::chrono::milliseconds store_min_answer = 100ms;
/// Deadline of a store request made without one: long enough for any rendezvous, finite so
/// that nothing waits forever.
inline constexpr std::chrono::seconds store_default_wait = std::chrono::seconds(300);

// ---- The shared-memory engine (reducer/shm.hpp) -------------------------------------------

/// Slice of a futex sleep on a peer's counter: between slices the waiter checks its deadline,
/// abort and whether the peer's process is still alive.
inline constexpr std::chrono::milliseconds shm_wait_slice = 50ms;
/// With more ranks than cores, or with the peer last seen on the waiter's own core, how long a
/// waiter keeps yielding before it sleeps on the futex: the peer it waits for is most likely
/// queued on its own core and runs at once on a yield,
/// where a futex sleep costs a wake-up through the scheduler (tens of microseconds) each step.
inline constexpr std::chrono::microseconds shm_yield_window = 500us;

// ---- Waiting for a collective (reducers, the wrapper) -------------------------------------

/// Margin of collective_deadline past twice the timeout.
inline constexpr std::chrono::milliseconds collective_wait_margin = 2000ms;
/// Deadline of a wait for a collective handed to a reducer: the collective is bounded by the
/// group's timeout once it starts, and the queued work ahead of it is too, so twice the timeout
/// and a margin bound the whole wait. The reducer's own deadline error comes first; this one
/// only keeps a waiter from hanging when the reducer cannot raise one.
template <class Rep, class Period>
std::chrono::steady_clock::time_point collective_deadline(std::chrono::duration<Rep, Period> timeout) {
  return std::chrono::steady_clock::now() + 2 * timeout + collective_wait_margin;
}

// ---- The hierarchical reducer (reducer/hierarchical.hpp) ----------------------------------

/// How much longer than its leader a rank waits for the leader's result: when the network
/// between hosts fails, the leader's error (which names the ranks lost) is recorded and wakes
/// its host's ranks before their own deadline would make them blame the leader.
inline constexpr std::chrono::milliseconds hier_follow_grace = 1500ms;

}  // namespace detail::timing
}  // namespace DDP_ABI
}  // namespace ddp
