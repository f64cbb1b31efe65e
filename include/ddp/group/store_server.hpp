#pragma once
/// \file group/store_server.hpp
/// The TCP key-value store that rank 0 hosts during and after rendezvous (its clients:
/// group/store_client.hpp). With an authenticator (docs/security.md) every connection must pass
/// a mutual challenge-response before its first request is read.

#include <sys/epoll.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/auth.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/group/detail/admission.hpp>
#include <ddp/group/detail/reactor.hpp>
#include <ddp/group/detail/handshake.hpp>
#include <ddp/detail/socket.hpp>
#include <ddp/group/detail/store_protocol.hpp>
#include <ddp/group/detail/store_table.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/endpoint.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Memory the store may hold, so that no client (or crowd of clients) can grow rank 0 without
/// bound (docs/security.md). By default the store's growth is bounded by 256 MiB in all: 128 MiB
/// of entries and 128 MiB of everything held for connections (65,536 ranks, each parked on a
/// wait, take about 60 MiB of it).
///
/// Entries count their key, their value and `entry_overhead` bytes each (what a tiny entry
/// really costs in memory). A write that would pass `max_bytes` is refused with errc::system on
/// the writer (errc::invalid_argument when the one entry is larger than `max_bytes`, or the value
/// larger than the 64 MiB a frame holds, which the writer checks before sending).
///
/// Connections count `connection_overhead` bytes each, plus their unread requests and unsent
/// replies (the buffers' capacity) and their parked get/wait requests (`waiter_overhead` each,
/// plus their keys). When the total passes `max_buffered`, the connections holding the most are
/// dropped until it fits: large values fill it quickly (a 64 MiB value read by two clients at
/// once holds two 64 MiB replies), the store is for small metadata.
///
/// At most `max_connections` connections are open at once (and no more than the process's
/// descriptors allow: the server raises RLIMIT_NOFILE's soft limit to the hard limit when it
/// starts). When a new connection finds no room, strangers are closed first (docs/security.md):
/// refused connections, then handshakes still running (oldest first), then connections that
/// never sent a valid request, then (with members, without a secret) idle connections that did
/// not claim a rank.
struct store_limits {
  std::size_t max_bytes = std::size_t{128} << 20;     ///< entries: keys, values and entry_overhead each
  std::size_t max_buffered = std::size_t{128} << 20;  ///< buffers, parked requests and connection_overhead
  std::size_t max_connections = 65536;                ///< open connections, handshakes included

  static constexpr std::size_t entry_overhead =
      detail::store_table::entry_overhead;                 ///< per key held (a map node, its strings)
  static constexpr std::size_t connection_overhead = 512;  ///< per open connection
  static constexpr std::size_t waiter_overhead =
      detail::store_table::waiter_overhead;  ///< per parked get/wait, plus its keys and 64 bytes each
};

/// Serves the store on one listening socket from a background thread (the group's listener loop,
/// group/detail/reactor.hpp, with its admission policy, group/detail/admission.hpp): the cost
/// of an event does not grow with the number of connections, and a `set` wakes only the requests
/// parked on its key. Each client has its own input buffer and the loop never blocks on one
/// client, so a client that sends half a frame and stalls delays nobody; a client that sends
/// garbage is dropped. Handshakes run in the same loop, one state per client, so a client
/// stalled mid-handshake delays nobody either.
///
/// With a non-empty `member_prefix` the store has members: a connection joins by a successful
/// compare_set from the empty value of a key `member_prefix` + `<r>` (process_group claims
/// "pg/rank/<r>" this way); with `members` > 0, `<r>` must be a number below it written without
/// leading zeros, so that once every seat is taken nobody else can join. Other connections may read (get, check, wait)
/// and claim, but every other write is refused with errc::auth_failed on the writer, and clients() counts members only,
/// so a stranger can neither plant the group's failure nor delay its end.
class store_server {
 public:
  /// Binds `ep` (port 0 picks a free port; an empty host, every interface; a name is resolved and
  /// its first address taken). Throws errc::unresolvable for a name that does not resolve,
  /// errc::address_in_use when the port is taken. With `auth`,
  /// only clients that prove the same secret are served; without it, binding beyond loopback
  /// prints a one-line warning to stderr. Raises this process's RLIMIT_NOFILE soft limit to its
  /// hard limit (every connection holds a descriptor).
  store_server(const endpoint& ep, int rank, std::shared_ptr<const authenticator> auth = nullptr,
               store_limits limits = {}, std::string member_prefix = {}, std::uint32_t members = 0)
      : rank_(rank),
        auth_(std::move(auth)),
        limits_(limits),
        with_members_(!member_prefix.empty()),
        admission_(rules_for(limits)),
        st_(std::make_unique<serving>(rank, limits.max_bytes, std::move(member_prefix), members)) {
    raise_descriptor_limit();
    listen_ = detail::listen_on(detail::resolve(ep.host, ep.port, rank, true).front(), rank, 4096);
    const auto bound = detail::local_address(listen_.get());
    port_ = detail::port_of(bound);
    if (!auth_ && !detail::is_loopback(bound))
      std::fprintf(stderr, "ddp: store listening on %s:%d without authentication; set DDP_AUTH_TOKEN\n",
                   detail::to_string(bound).c_str(), port_);
    handler_.self = this;
    loop_.emplace(listen_.get(), handler_, rank, "store");
    loop_->start();  // the handler reaches the loop through loop_: served only once it is set
  }
  store_server(const store_server&) = delete;
  store_server& operator=(const store_server&) = delete;
  ~store_server() { stop(); }

  /// The port actually bound.
  int port() const noexcept { return port_; }

  /// Number of clients connected right now: authenticated ones, when there is a secret; members
  /// only, when the store has members; not counting clients that hung up and are only owed
  /// answers.
  int clients() const noexcept { return nclients_.load(); }

  /// Rank that hosts this store (for messages).
  int rank() const noexcept { return rank_; }

  /// Clients dropped since start: malformed input, or holding the most buffered bytes when
  /// the store_limits::max_buffered was passed.
  int dropped() const noexcept { return dropped_.load(); }

  /// Connections closed unserved because this process was out of file descriptors (or at
  /// store_limits::max_connections) and no stranger could make room.
  int shed() const noexcept { return shed_.load(); }

  /// Strangers closed to make room for new connections (docs/security.md).
  int evicted() const noexcept { return evicted_.load(); }

  /// Bytes counted against store_limits::max_bytes now: keys, values and entry_overhead each.
  std::size_t stored_bytes() const noexcept { return table_.stored_bytes(); }

  /// Bytes counted against store_limits::max_buffered now.
  std::size_t buffered_bytes() const noexcept { return buffered_.load(); }

  /// Connections refused by authentication (no, wrong or replayed proof; a handshake that did
  /// not finish in time; a handshake offered to a server without a secret) since start.
  int refused() const noexcept { return refused_.load(); }

  /// Stops serving and closes every connection.
  void stop() noexcept {
    if (!loop_) return;
    // In a forked child's copy the serving thread is the parent's and does not exist here: only
    // this process's descriptors close (the listener's and the loop's copies); the connections'
    // copies stay with the abandoned state.
    if (!loop_->stop()) detail::abandon(std::move(st_));
    loop_.reset();
  }

 private:
  using timer_map = std::multimap<deadline_t, std::uint64_t>;

  using standing = detail::standing;

  /// Where a connection is in its life, one phase at a time.
  enum class phase : std::uint8_t {
    handshake,  ///< proving the secret (`hs` engaged)
    serving,    ///< reading requests and answering them
    refused,    ///< refused: its answer says why, then our side shuts
    lingering,  ///< refused, answered and half-closed: waits for the client to hang up
    hung_up,    ///< the client shut its side: answered what it is owed, then closed
    closed,     ///< closed at the end of this round
  };
  /// What a connection has shown of itself, whatever its phase.
  enum class trust : std::uint8_t {
    unknown,    ///< no valid request and no proof yet
    confirmed,  ///< authenticated, or sent a valid request
    member,     ///< claimed a rank (a store with members)
  };

  struct client {
    detail::fd_handle fd;
    std::uint64_t seq = 0;  // order of arrival
    phase at = phase::serving;
    trust shown = trust::unknown;
    std::string in;
    std::string out;
    std::optional<detail::auth_responder> hs;  // engaged in phase::handshake
    std::uint32_t events = 0;                  // epoll interest now
    std::uint64_t active = 0;                  // when a request of it was last answered
    deadline_t accepted{};
    deadline_t limit{};                        // end of the refused linger, or of the hung-up one
    std::optional<timer_map::iterator> timer;  // in timers_ while `limit` is due
    std::size_t held = 0;                      // counted in buffered_
    // Bookkeeping of the loop: counted by clients(), queued in touched_, queued in backlog_.
    bool counted = false;
    bool touched = false;
    bool backlogged = false;

    bool closing() const noexcept { return at == phase::refused || at == phase::lingering; }
    bool gone() const noexcept { return at == phase::closed; }
    bool member() const noexcept { return shown == trust::member; }
  };
  static void raise_descriptor_limit() noexcept {
    rlimit rl{};
    if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
      rl.rlim_cur = rl.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &rl);
    }
  }

  static detail::admission_rules rules_for(const store_limits& limits) {
    detail::admission_rules r;
    r.capacity = limits.max_connections;
    r.crowded_at = (limits.max_connections * 3 + 3) / 4;  // three quarters full
    return r;
  }

  // The loop's view of the server (reactor.hpp's loop_handler): the connections are watched by their seq.
  struct loop_handler {
    store_server* self = nullptr;
    bool busy() const { return !self->backlog_.empty(); }
    deadline_t next_due(deadline_t now) const { return self->next_due(now); }
    bool listening(deadline_t now) const { return self->admission_.listening(now); }
    void on_listener(deadline_t now) { self->accept_all(now); }
    void on_event(std::uint64_t id, std::uint32_t ev, deadline_t) {
      auto it = self->clients_.find(id);
      if (it != self->clients_.end() && !it->second->gone()) self->on_event(*it->second, ev);
    }
    void after_events(deadline_t now) {
      self->serve_backlog();
      self->expire(now);
      self->settle_touched(now);
      self->shed_buffers();
      self->reap();
    }
  };

  /// When the next thing is due: a parked request's or a connection's deadline, the admission
  /// policy's (a handshake's end, the listener's rest).
  deadline_t next_due(deadline_t now) const {
    auto next = admission_.next_due(now, clients_.size());
    if (const auto parked = table_.next_deadline()) next = std::min(next, *parked);
    if (!timers_.empty()) next = std::min(next, timers_.begin()->first);
    return next;
  }

  void touch(client& c) {
    if (c.touched || c.gone()) return;
    c.touched = true;
    touched_.push_back(c.seq);
  }
  void kill(client& c) {
    if (c.gone()) return;
    c.at = phase::closed;
    dead_.push_back(c.seq);
  }

  void on_event(client& c, std::uint32_t ev) {
    touch(c);
    if ((ev & (EPOLLERR | EPOLLHUP)) && !(ev & EPOLLIN)) {
      kill(c);
      return;
    }
    if (ev & EPOLLIN) {
      const auto r = c.closing() ? drain(c) : on_readable(c);
      if (r == read_result::closed) {
        kill(c);
        return;
      }
      if (r == read_result::invalid) {
        ++dropped_;
        kill(c);
        return;
      }
    }
  }

  /// Handles the frames that waited for this round (handle_frames' budget).
  void serve_backlog() {
    std::vector<std::uint64_t> now;
    now.swap(backlog_);
    for (auto seq : now) {
      auto it = clients_.find(seq);
      if (it == clients_.end() || it->second->gone()) continue;
      auto& c = *it->second;
      c.backlogged = false;
      touch(c);
      if ((c.at == phase::serving || c.at == phase::hung_up) && !handle_frames(c)) {
        ++dropped_;
        kill(c);
      }
    }
  }

  /// After a round's events: flush, half-close refused clients, close the ones that are done,
  /// and bring each touched connection's epoll interest, timers, tier and counts up to date.
  void settle_touched(deadline_t now) {
    for (std::size_t i = 0; i < touched_.size(); ++i) {
      auto it = clients_.find(touched_[i]);
      if (it == clients_.end()) continue;
      auto& c = *it->second;
      c.touched = false;
      if (c.gone()) continue;
      if (!c.out.empty() && !flush(c)) {
        kill(c);
        continue;
      }
      // Replies taken: frames that waited for them are handled next round.
      if (!c.backlogged && (c.at == phase::serving || c.at == phase::hung_up) && c.out.size() < backpressure) {
        std::uint32_t len = 0;
        if (detail::check_header(c.in, len) == detail::parse_result::ok) {
          c.backlogged = true;
          backlog_.push_back(c.seq);
        }
      }
      if (c.at == phase::refused && c.out.empty()) {
        // Half-close and linger until the client hangs up, so it reads our answer rather
        // than a reset.
        ::shutdown(c.fd.get(), SHUT_WR);
        c.at = phase::lingering;
      }
      // A client that shut its side goes once it has every answer it is owed, or after
      // eof_linger: a closed socket looks the same as a half-closed one, and requests parked
      // by a client that is gone must not hold a descriptor for as long as they asked to wait.
      if (c.at == phase::hung_up && ((c.out.empty() && table_.parked(c.seq) == 0) || now >= c.limit)) {
        kill(c);
        continue;
      }
      // Memory a 64 MiB frame left behind goes back once it is handled.
      if (c.in.empty() && c.in.capacity() > (64u << 10)) std::string().swap(c.in);
      if (c.out.empty() && c.out.capacity() > (64u << 10)) std::string().swap(c.out);
      // A client whose replies pile up is not read until it takes them (backpressure).
      const bool want_in = c.at != phase::hung_up && (c.closing() || c.out.size() < backpressure);
      const std::uint32_t want = (want_in ? EPOLLIN : 0u) | (c.out.empty() ? 0u : EPOLLOUT);
      if (want != c.events) {
        loop_->change(c.fd.get(), want, c.seq);
        c.events = want;
      }
      retime(c);
      retier(c);
      recount(c);
      account(c);
    }
    touched_.clear();
    replies_ = 0;  // every answer made this round is in its client's `out` now, counted
  }

  /// Parked requests and connections whose time is up.
  void expire(deadline_t now) {
    // Timed out: the answer says which keys are still missing, so callers can name absent ranks.
    table_.expire(now, [this](std::uint64_t owner, detail::store_status st, const std::vector<std::string_view>& f) {
      auto& c = *clients_.at(owner);
      reply(c, st, f);
      touch(c);
    });
    while (!timers_.empty() && timers_.begin()->first <= now) {
      auto& c = *clients_.at(timers_.begin()->second);
      timers_.erase(*c.timer);
      c.timer.reset();
      if (c.closing())
        kill(c);  // the end of its refused linger
      else
        touch(c);  // the end of its hung-up linger: settle closes it
    }
    // Handshakes whose time is up (far sooner while the store is crowded or short of
    // descriptors: strangers stalled mid-handshake must not hold what real ranks need).
    for (const auto& [seq, why] : admission_.handshakes_over(now, clients_.size())) {
      auto& c = *clients_.at(seq);
      if (c.gone()) continue;
      ++refused_;
      if (why == detail::admission::ended::crowded_out) ++evicted_;
      kill(c);
    }
  }

  void retime(client& c) {
    const auto when = c.closing() || c.at == phase::hung_up ? c.limit : deadline_t::max();
    if (c.timer && (*c.timer)->first == when) return;
    if (c.timer) timers_.erase(*c.timer);
    c.timer.reset();
    if (when != deadline_t::max()) c.timer = timers_.emplace(when, c.seq);
  }

  standing standing_of(const client& c) const {
    if (c.closing()) return standing::refused;
    if (c.at == phase::handshake) return standing::handshaking;
    if (c.shown == trust::unknown) return standing::unconfirmed;
    // In a store with members and no secret, every connection that did not claim a rank is a
    // stranger, parked requests or not (a parked request costs a stranger nothing); idle ones go
    // first, then the least recently answered (retier), so a rank that waits for the job record
    // or just read it stays as long as any other stranger can make room.
    if (with_members_ && !c.member() && !auth_) return standing::not_member;
    return standing::trusted;
  }
  void retier(client& c) {
    const standing s = standing_of(c);
    // Oldest first; among non-members, idle ones before those with a request parked (a rank
    // waiting for the job record), each by its last request answered (a rank whose wait was
    // just answered is about to claim: idle strangers go before it).
    const std::uint64_t order =
        s == standing::not_member ? c.active + (table_.parked(c.seq) == 0 ? 0 : std::uint64_t{1} << 62) : c.seq;
    admission_.place(c.seq, s, order, c.accepted);  // a no-op when neither changed
  }
  void recount(client& c) {
    // Only clients that got in count: a stranger stalled mid-handshake (or one that never
    // claimed a rank, in a store with members) must not keep rank 0 waiting for it to leave.
    const bool should = c.at == phase::serving && (!with_members_ || c.member());
    if (should != c.counted) nclients_ += should ? 1 : -1;
    c.counted = should;
  }
  void account(client& c) {
    const std::size_t held =
        limits_.connection_overhead + c.in.capacity() + c.out.capacity() + table_.parked_bytes(c.seq);
    total_held_ = total_held_ - c.held + held;
    c.held = held;
    buffered_ = total_held_;
  }

  /// Closes the clients marked dead this round.
  void reap() {
    for (auto seq : dead_) close_client(seq);
    dead_.clear();
  }

  void close_client(std::uint64_t seq) {
    auto it = clients_.find(seq);
    if (it == clients_.end()) return;
    auto& c = *it->second;
    table_.forget(c.seq);
    if (c.timer) timers_.erase(*c.timer);
    admission_.forget(c.seq);
    if (c.counted) --nclients_;
    total_held_ -= c.held;
    buffered_ = total_held_;
    clients_.erase(it);  // closes the descriptor, which leaves the epoll set
  }

  enum class read_result { ok, closed, invalid };

  /// Accepts what is waiting (a bounded number per round, so a flood cannot starve the
  /// clients already in).
  void accept_all(deadline_t now) {
    for (int i = 0; i < 512; ++i) {
      const int fd = admission_.accept(
          listen_.get(), now, [this] { return clients_.size(); }, [this] { return evict_stranger(); }, shed_);
      if (fd < 0) return;
      detail::tune_stream(fd, 0);
      auto c = std::make_unique<client>();
      c->fd = detail::fd_handle(fd);
      c->seq = ++seq_;
      c->accepted = now;
      if (auth_) {
        c->at = phase::handshake;
        c->hs.emplace(auth_.get(), detail::auth_kind::store);
      }
      auto& ref = *c;
      clients_.emplace(ref.seq, std::move(c));
      ref.events = EPOLLIN;
      loop_->watch(fd, EPOLLIN, ref.seq);
      retime(ref);
      retier(ref);
      recount(ref);
      account(ref);
    }
  }

  /// Closes the stranger most readily closed (refused, then mid-handshake, then never served,
  /// then not a member; oldest first), now, to free its descriptor. False when there is none.
  bool evict_stranger() {
    const auto seq = admission_.victim();
    if (!seq) return false;
    auto& c = *clients_.at(*seq);
    ++evicted_;
    if (c.at == phase::handshake) ++refused_;
    close_client(*seq);
    return true;
  }

  /// Keeps what is held for all clients under limits_.max_buffered by dropping the clients
  /// that hold the most (a legitimate client's frames are small next to a flood).
  void shed_buffers() {
    while (total_held_ > limits_.max_buffered) {
      client* worst = nullptr;
      for (auto& [fd, c] : clients_)
        if (!c->gone() && (worst == nullptr || c->held > worst->held)) worst = c.get();
      if (worst == nullptr) break;
      ++dropped_;
      kill(*worst);
      total_held_ -= worst->held;  // reap takes it off again: count it once
      worst->held = 0;
    }
  }

  /// Reads what is there and acts on it one chunk at a time, so a bad length is caught after
  /// its first 4 bytes, never after buffering the rest of what the client sent.
  read_result on_readable(client& c) {
    char buf[65536];
    // Frames left for a later round are handled first: read nothing more until then. And at
    // most 1 MiB a round from one client (level-triggered epoll reports the rest next round):
    // a client that streams requests must not keep the loop to itself.
    for (int chunks = 0; chunks < 16 && !c.closing() && !c.backlogged && c.out.size() < backpressure; ++chunks) {
      const ssize_t k = ::recv(c.fd.get(), buf, sizeof buf, 0);
      if (k > 0) {
        make_room(c.in, static_cast<std::size_t>(k));
        c.in.append(buf, static_cast<std::size_t>(k));
        if (!consume(c)) return read_result::invalid;
        account(c);
        // Past the budget: stop reading; shed_buffers drops whoever holds the most. Frames
        // left for a later round: read no more until they are handled (level-triggered epoll
        // reports the socket again).
        if (total_held_ > limits_.max_buffered || c.backlogged) return read_result::ok;
        continue;
      }
      if (k == 0) {
        // Half-closed: requests already read are still answered (parked ones included); one
        // that hung up mid-handshake is owed nothing.
        if (c.at == phase::handshake) return read_result::closed;
        c.at = phase::hung_up;
        c.limit = steady_clock::now() + eof_linger;
        return read_result::ok;
      }
      return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? read_result::ok : read_result::closed;
    }
    return read_result::ok;
  }

  /// Grows `in` for `k` more bytes: doubling, but never past the end of the frame at its front,
  /// so a frame of 64 MiB holds 64 MiB, not 128. Nothing is reserved for what a length only
  /// claims: memory follows the bytes that really arrived.
  static void make_room(std::string& in, std::size_t k) {
    const std::size_t need = in.size() + k;
    if (need <= in.capacity()) return;
    std::size_t target = std::max(need, 2 * in.capacity());
    if (in.size() >= 4) {
      const std::size_t frame_end = std::size_t{4} + detail::get_u32(in.data());
      if (frame_end >= need && frame_end <= std::size_t{4} + detail::store_max_frame)
        target = std::min(target, frame_end);
    }
    std::string grown;  // reserve() on `in` itself would at least double it
    grown.reserve(target);
    grown.append(in);
    in.swap(grown);
  }

  /// A refused client: read and discard until it hangs up.
  static read_result drain(client& c) {
    char buf[4096];
    for (;;) {
      const ssize_t k = ::recv(c.fd.get(), buf, sizeof buf, 0);
      if (k > 0) continue;
      if (k == 0) return read_result::closed;
      return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? read_result::ok : read_result::closed;
    }
  }

  void refuse(client& c) {
    ++refused_;
    c.at = phase::refused;
    c.in.clear();
    c.hs.reset();
    c.limit = steady_clock::now() + detail::timing::store_refused_linger;
  }

  /// Runs the handshake while one is due, then the requests; false drops the client.
  bool consume(client& c) {
    using state = detail::auth_responder::state;
    if (c.at == phase::handshake) {
      switch (c.hs->feed(c.in, c.out, [](const detail::auth_hello&) { return true; })) {
        case state::hello:
        case state::proof:
          return true;
        case state::done:
          c.hs.reset();
          c.at = phase::serving;
          c.shown = trust::confirmed;
          break;
        case state::failed:
          refuse(c);
          return true;
        case state::foreign:
          // Most likely a rank started without the token: tell it so before closing.
          c.out += detail::encode_frame(static_cast<std::uint8_t>(detail::store_status::auth_required), {});
          refuse(c);
          return true;
      }
    } else if (!auth_ && c.in.size() >= 4 && detail::get_u32(c.in.data()) == detail::auth_magic) {
      // A client with a token reached a server without one: answer so it can say why.
      c.out += detail::encode_status(detail::auth_status::no_auth, detail::auth_challenge_size);
      refuse(c);
      return true;
    }
    return handle_frames(c);
  }

  static bool flush(client& c) {
    while (!c.out.empty()) {
      const ssize_t k = ::send(c.fd.get(), c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (k > 0) {
        c.out.erase(0, static_cast<std::size_t>(k));
        continue;
      }
      return k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
    }
    return true;
  }

  bool handle_frames(client& c) {
    // A budget per client and round, and none while its replies pile up: one client streaming
    // cheap requests must not keep the loop (the other clients, stop()) waiting for it.
    for (std::size_t budget = work_per_round;;) {
      if (budget == 0 || c.out.size() >= backpressure) {
        std::uint32_t len = 0;
        if (detail::check_header(c.in, len) == detail::parse_result::ok && !c.backlogged && budget == 0) {
          c.backlogged = true;
          backlog_.push_back(c.seq);
        }
        return true;
      }
      std::uint32_t len = 0;
      const auto hr = detail::check_header(c.in, len);
      if (hr == detail::parse_result::invalid) return false;
      if (hr == detail::parse_result::need_more) return true;
      detail::frame f;
      if (detail::parse_body(std::string_view(c.in).substr(4, len), f) != detail::parse_result::ok) return false;
      c.in.erase(0, 4 + static_cast<std::size_t>(len));
      if (!detail::valid_request(f)) return false;
      // A request costs its keys (a wait for 4095 keys is 4095 lookups, an erase of a prefix as
      // many erasures).
      const bool sweep = f.code == static_cast<std::uint8_t>(detail::store_cmd::del) && f.fields.size() == 2;
      budget -= std::min(budget, sweep ? std::size_t{detail::store_max_fields} : 1 + f.fields.size());
      if (c.shown == trust::unknown) c.shown = trust::confirmed;
      c.active = ++activity_;
      const auto done = table_.execute(c.seq, c.member(), std::move(f), steady_clock::now(),
                                       [&](std::uint64_t, detail::store_status st,
                                           const std::vector<std::string_view>& fields) { reply(c, st, fields); });
      // Our client parks at most one request at a time; many more is a misbehaving peer.
      if (done == detail::store_table::outcome::overflow) return false;
      if (done == detail::store_table::outcome::claimed) c.shown = trust::member;
      wake();
    }
  }

  /// Queues an answer. Answers are counted as they are made: one that would take what all
  /// clients hold past store_limits::max_buffered is not made, and its client is dropped (a
  /// crowd of strangers reading a large value, or parked on it, cannot multiply it in memory).
  void reply(client& c, detail::store_status st, const std::vector<std::string_view>& fields = {}) {
    std::size_t len = 5;
    for (auto f : fields) len += 4 + f.size();
    if (c.gone()) return;
    while (len > 4096 && total_held_ + replies_ + len > limits_.max_buffered) {
      // Make room by dropping whoever holds the most, as shed_buffers does, unless that is
      // less than this answer: then this answer's client goes.
      client* worst = nullptr;
      for (auto& [seq, o] : clients_)
        if (!o->gone() && o.get() != &c && (worst == nullptr || o->held > worst->held)) worst = o.get();
      client& gone = worst != nullptr && worst->held >= len ? *worst : c;
      ++dropped_;
      kill(gone);
      total_held_ -= gone.held;  // reap takes it off again: count it once
      gone.held = 0;
      if (&gone == &c) return;
    }
    replies_ += len;
    c.out += detail::encode_frame(static_cast<std::uint8_t>(st), fields);
  }

  /// Serves the requests parked on the keys written since the last call (the table's wake).
  void wake() {
    table_.wake([this](std::uint64_t owner) { return clients_.at(owner)->member(); },
                [this](std::uint64_t owner, detail::store_status st, const std::vector<std::string_view>& fields) {
                  auto& c = *clients_.at(owner);
                  reply(c, st, fields);
                  c.active = ++activity_;
                  touch(c);
                });
  }

  static constexpr auto eof_linger = detail::timing::store_eof_linger;
  // Replies a client has not taken yet past which it is not read (a pipelining client slows
  // down instead of piling its answers up to store_limits::max_buffered).
  static constexpr std::size_t backpressure = std::size_t{1} << 20;
  /// Work a client gets per round of the loop, in keys looked up (a request costs 1 + its fields).
  static constexpr std::size_t work_per_round = 16384;
  int rank_;
  std::shared_ptr<const authenticator> auth_;
  store_limits limits_;
  bool with_members_;            ///< a member_prefix was given: the table knows the seats, the loop who holds one
  detail::admission admission_;  // whom the listener lets in, whom it closes for room
  int port_ = 0;
  detail::fd_handle listen_;
  std::atomic<int> nclients_{0};
  std::atomic<int> dropped_{0};
  std::atomic<int> refused_{0};
  std::atomic<int> shed_{0};
  std::atomic<int> evicted_{0};
  std::atomic<std::size_t> buffered_{0};
  std::size_t replies_ = 0;             ///< answer bytes made this round, not yet counted in `held`
  std::vector<std::uint64_t> backlog_;  ///< clients with frames left for the next round
  // What the serving thread works on, on the heap: a forked child abandons it (the parent's
  // thread may have been changing it at the fork) instead of destroying it.
  struct serving {
    serving(int rank, std::size_t max_bytes, std::string member_prefix, std::uint32_t members)
        : table(rank, max_bytes, std::move(member_prefix), members) {}
    detail::store_table table;  // the keys, their values and the parked requests
    std::unordered_map<std::uint64_t, std::unique_ptr<client>> clients;  // by seq
    timer_map timers;  // when each connection's handshake, linger or eof linger ends (by seq)
    std::vector<std::uint64_t> touched;
    std::vector<std::uint64_t> dead;
  };
  std::unique_ptr<serving> st_;
  detail::store_table& table_ = st_->table;
  std::unordered_map<std::uint64_t, std::unique_ptr<client>>& clients_ = st_->clients;
  timer_map& timers_ = st_->timers;
  std::vector<std::uint64_t>& touched_ = st_->touched;
  std::vector<std::uint64_t>& dead_ = st_->dead;
  std::uint64_t seq_ = 0;
  std::uint64_t activity_ = 0;
  std::size_t total_held_ = 0;
  loop_handler handler_;
  std::optional<detail::event_loop<loop_handler>> loop_;  // last: its thread stops before the rest goes
};

}  // namespace DDP_ABI
}  // namespace ddp
