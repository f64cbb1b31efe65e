#pragma once
/// \file tcp.hpp
/// `ddp::tcp`: the point-to-point transport over TCP between any hosts. Each instance opens its
/// own connections (so a reducer's progress thread never shares a socket with the process group),
/// made on first use: a ring connects each rank to its two neighbours only,
/// with non-blocking sockets, large socket buffers and TCP_NODELAY. `sendrecv` drives both
/// directions of a link at once, which is what a ring needs.
///
/// \code
/// ddp::tcp t{pg};
/// t.sendrecv(next, out.data(), out.size(), prev, in.data(), in.size(), pg.deadline());
/// \endcode

#include <sys/uio.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/group/detail/mesh.hpp>
#include <ddp/group/detail/rendezvous.hpp>
#include <ddp/detail/socket.hpp>
#include <ddp/error.hpp>
#include <ddp/group/verdict.hpp>
#include <ddp/group/transport_context.hpp>
#include <ddp/group/detail/keys.hpp>
#include <ddp/detail/first_failure.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Tunables of the TCP transport. See docs/reducers.md.
struct tcp_options {
  int socket_buffer = 4 << 20;  ///< SO_SNDBUF / SO_RCVBUF per connection
  friend bool operator==(const tcp_options&, const tcp_options&) = default;
};

/// TCP transport: one connection per pair of ranks, opened through the group's store.
class tcp {
 public:
  static constexpr bool is_point_to_point = true;

  /// Built from the group (`ddp::tcp t{pg}`): keeps a handle on it of its own, so the group
  /// (its store) stays open while the transport lives.
  explicit tcp(transport_context ctx, tcp_options o = {}) : ctx_(std::move(ctx)), opts_(o) {
    channel_ = detail::keys::tcp_channel(ctx_.channel());
    // Connections are made on first use: a ring touches two peers, a tree three.
    links_ = detail::open_links(ctx_, channel_, o.socket_buffer);
    // The group failed as a whole (its heartbeat found a rank frozen or dead): end the
    // collectives blocked here at once, with the group's cause. On the reactor's thread, and the
    // failure is recorded already: the connections shut, and nothing waits on the store here.
    watch_ = ctx_.watch([this](const group_failure& f) {
      if (!owner_.forked()) break_links(f.text);
    });
  }
  tcp(const tcp&) = delete;
  tcp& operator=(const tcp&) = delete;

  int rank() const noexcept { return ctx_.rank(); }
  int size() const noexcept { return ctx_.size(); }
  process_group& group() noexcept { return ctx_.group(); }

  /// Peers this transport is connected to now (connections are made on first exchange).
  int connections() const noexcept { return links_ ? links_->connections() : 0; }

  void send(int peer, const void* data, std::size_t n, deadline_t until) {
    check_usable();
    std::error_code ec;
    detail::send_all(fd(peer, until), data, n, until, ec);
    if (ec) lost(peer, ec);
  }

  void recv(int peer, void* data, std::size_t n, deadline_t until) {
    check_usable();
    std::error_code ec;
    detail::recv_all(fd(peer, until), data, n, until, ec);
    if (ec) lost(peer, ec);
  }

  /// Takes any number of parts in sendrecv (transport/concept.hpp: `transport_any_parts`): the
  /// ring sends a bucket's first chunk straight from the engine's gradients, one part each.
  static constexpr bool any_parts = true;

  /// Sends the parts `out` to `to` while receiving into the parts `in` from `from`, both at
  /// once (any number of parts: a small header and a payload, typically; or a header and the
  /// gradients a bucket's chunk spans).
  /// `on_recv(bytes_received_so_far)` runs after each read so callers can check a header or
  /// reduce the segments that have arrived while the rest is still in flight.
  template <class OnRecv>
  void sendrecv(int to, std::span<const iovec> out, int from, std::span<const iovec> in, deadline_t until,
                OnRecv&& on_recv) {
    check_usable();
    const int sfd = fd(to, until), rfd = fd(from, until);
    iovec sv_few[4], rv_few[4];
    std::vector<iovec> sv_many, rv_many;
    if (out.size() > 4) sv_many.resize(out.size());
    if (in.size() > 4) rv_many.resize(in.size());
    iovec* const sv = out.size() > 4 ? sv_many.data() : sv_few;
    iovec* const rv = in.size() > 4 ? rv_many.data() : rv_few;
    std::size_t ns = 0, nr = 0, sleft = 0, rleft = 0;
    for (auto& v : out)
      if (v.iov_len) {
        sv[ns++] = v;
        sleft += v.iov_len;
      }
    for (auto& v : in)
      if (v.iov_len) {
        rv[nr++] = v;
        rleft += v.iov_len;
      }
    std::size_t si = 0, ri = 0, got = 0;
    auto advance = [](iovec* v, std::size_t& i, std::size_t n, std::size_t k) {
      while (k > 0 && i < n) {
        const std::size_t take = std::min(k, v[i].iov_len);
        v[i].iov_base = static_cast<char*>(v[i].iov_base) + take;
        v[i].iov_len -= take;
        k -= take;
        if (v[i].iov_len == 0) ++i;
      }
    };
    while (sleft > 0 || rleft > 0) {
      bool progressed = false;
      if (sleft > 0) {
        msghdr m{};
        m.msg_iov = sv + si;
        m.msg_iovlen = std::min<std::size_t>(ns - si, iov_cap);
        const ssize_t k = ::sendmsg(sfd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
          advance(sv, si, ns, static_cast<std::size_t>(k));
          sleft -= static_cast<std::size_t>(k);
          progressed = true;
        } else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          lost(to, errno == EPIPE || errno == ECONNRESET ? make_error_code(errc::peer_lost)
                                                         : std::error_code(errno, std::generic_category()));
        }
      }
      if (rleft > 0) {
        msghdr m{};
        m.msg_iov = rv + ri;
        m.msg_iovlen = std::min<std::size_t>(nr - ri, iov_cap);
        const ssize_t k = ::recvmsg(rfd, &m, MSG_DONTWAIT);
        if (k > 0) {
          advance(rv, ri, nr, static_cast<std::size_t>(k));
          rleft -= static_cast<std::size_t>(k);
          got += static_cast<std::size_t>(k);
          progressed = true;
          on_recv(got);
        } else if (k == 0) {
          lost(from, make_error_code(errc::peer_lost));
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          lost(from, errno == ECONNRESET ? make_error_code(errc::peer_lost)
                                         : std::error_code(errno, std::generic_category()));
        }
      }
      if (progressed) continue;
      pollfd p[2];
      nfds_t np = 0;
      if (sfd == rfd) {
        p[np++] = {sfd, static_cast<short>((sleft ? POLLOUT : 0) | (rleft ? POLLIN : 0)), 0};
      } else {
        if (sleft) p[np++] = {sfd, POLLOUT, 0};
        if (rleft) p[np++] = {rfd, POLLIN, 0};
      }
      // ms_left() is capped (about 16.7 minutes): a poll that ends with nothing ready is a
      // timeout only once the deadline itself has passed.
      const int left = detail::ms_left(until);
      if (left == 0 || (::poll(p, np, left) == 0 && steady_clock::now() >= until))
        lost(rleft ? from : to, make_error_code(errc::timeout));
    }
  }

  /// Plain full-duplex exchange of one buffer each way.
  void sendrecv(int to, const void* sbuf, std::size_t sn, int from, void* rbuf, std::size_t rn, deadline_t until) {
    const iovec o{const_cast<void*>(sbuf), sn}, i{rbuf, rn};
    sendrecv(to, std::span(&o, 1), from, std::span(&i, 1), until, [](std::size_t) {});
  }

  /// Marks this transport failed on every rank: the reason goes to the store (so peers report
  /// it instead of a bare "connection lost") and every connection is shut down, which wakes
  /// peers blocked on us at once. Then throws it here.
  [[noreturn]] void fail(errc code, const std::string& msg) {
    post_abort(code, msg);
    detail::raise(code, rank(), msg);
  }

  /// Shuts the transport down; peers blocked on this rank fail promptly (errc::aborted).
  void abort() noexcept { abort(errc::aborted, "rank " + std::to_string(rank()) + " called abort()"); }

  /// The same, with the reason: it becomes the group's failure record (unless a rank recorded
  /// one first), so peers raise `code` quoting `why` ("rank R reports: why").
  void abort(errc code, const std::string& why) noexcept {
    if (owner_.forked()) return;  // a forked child must not shut the parent's connections
    try {
      post_abort(code, why);
    } catch (...) {
    }
  }

 private:
  /// Parts per sendmsg/recvmsg call: the kernel refuses more than IOV_MAX (1024 on Linux).
  static constexpr std::size_t iov_cap = 1024;

  /// The connection to `peer`, made now if this is the first exchange with it.
  int fd(int peer, deadline_t until) {
    // In a forked child the connections are the parent's: a byte from the child would garble them.
    owner_.check(rank(), "tcp transport");
    if (peer < 0 || peer >= size() || peer == rank())
      detail::raise(errc::invalid_argument, rank(), "tcp: no connection to rank " + std::to_string(peer));
    if (const int f = links_->connected(peer); f >= 0) return f;
    try {
      return links_->get(peer, until);
    } catch (const error& e) {
      // Report the group's first failure when a rank recorded one (the peer that never
      // connected may have failed first), else what went wrong here.
      if (e.condition() == errc::timeout) lost(peer, make_error_code(errc::timeout));
      const auto f = ctx_.verdict().explain(e);
      if (!f.empty() && f.text != detail::message_of(e)) adopt(f);
      post_abort(e.condition(), detail::message_of(e));
      throw;
    }
  }

  void check_usable() const { broken_.check(rank(), "tcp transport is unusable after an earlier failure: "); }

  /// Marks this transport unusable with `msg`; false when it was marked already (the first
  /// reason wins; abort() on any thread and the progress thread may race here).
  bool mark_broken(const std::string& msg) { return broken_.set(errc::aborted, msg); }

  /// Marks this transport unusable and shuts its connections, which wakes peers blocked on us.
  void break_links(const std::string& msg) {
    if (mark_broken(msg) && links_) links_->shutdown();
  }

  /// This rank's own failure: marked here, recorded as the group's (first writer wins; a store
  /// that is gone too is ignored: shutting the sockets still tells the peers), connections shut.
  void post_abort(errc code, const std::string& msg) {
    if (!mark_broken(msg)) return;
    ctx_.verdict().record(ctx_.verdict().as_recorded(code, msg));
    if (links_) links_->shutdown();
  }

  /// Raises a failure another rank recorded (or that explains this one): one verdict for everyone.
  [[noreturn]] void adopt(const group_failure& f) {
    break_links(f.text);
    detail::raise(f.code, rank(), f.text);
  }

  /// A connection failed: the group's verdict (group/verdict.hpp), which records this rank's own
  /// failure when no rank recorded one first, then the connections go.
  [[noreturn]] void lost(int peer, const std::error_code& ec) {
    adopt(ctx_.verdict().judge(peer, ec, "on the link to rank " + std::to_string(peer)).failure);
  }

  transport_context ctx_;  // the transport's own handle: the group stays open while this lives
  tcp_options opts_;
  std::string channel_;
  std::unique_ptr<detail::peer_links> links_;
  detail::first_failure broken_;  // why this transport is unusable (the first reason)
  detail::owner_process owner_;
  group_watch watch_;  // last: unregistered first, before what its call uses goes
};

}  // namespace DDP_ABI
}  // namespace ddp
