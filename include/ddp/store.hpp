#pragma once
/// \file store.hpp
/// The TCP key-value store that rank 0 hosts during and after rendezvous: set, get (waits),
/// add, compare-and-set, delete, check and wait-for-keys, each with a deadline. With an
/// authenticator (docs/security.md) every connection must pass a mutual challenge-response
/// before its first request is read.
///
/// \code
/// ddp::store_server server{ddp::detail::resolve("127.0.0.1", 0, 0, true).front(), 0};
/// ddp::store_client c{"127.0.0.1", server.port(), 0, deadline};
/// c.set("k", "v");
/// auto v = c.get("k", deadline);
/// \endcode

#include <fcntl.h>
#include <sys/eventfd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "auth.hpp"
#include "detail/fork.hpp"
#include "detail/handshake.hpp"
#include "detail/socket.hpp"
#include "detail/store_protocol.hpp"
#include "error.hpp"

namespace ddp {
inline namespace v0 {

/// Memory the store may hold, so that no client (or crowd of clients) can grow rank 0 without
/// bound. A write that would pass `max_bytes` is refused with errc::system on the writer
/// (errc::invalid_argument when the one value is larger than `max_bytes`, or than the 64 MiB a
/// frame holds, which the writer checks before sending); when
/// the bytes buffered for all clients pass `max_buffered`, the clients holding the most are
/// dropped until it fits (frames are limited to 64 MiB each besides).
struct store_limits {
  std::size_t max_bytes = std::size_t{1} << 30;     ///< keys and values held
  std::size_t max_buffered = std::size_t{1} << 30;  ///< unread requests and unsent replies, all clients
};

/// Serves the store on one listening socket from a background thread. Each client has its own
/// input buffer and the loop never blocks on one client, so a client that sends half a frame
/// and stalls delays nobody; a client that sends garbage is dropped. Handshakes run in the same
/// loop, one state per client, so a client stalled mid-handshake delays nobody either.
class store_server {
 public:
  /// Binds `ep` (port 0 picks a free port). Throws errc::address_in_use when taken. With `auth`,
  /// only clients that prove the same secret are served; without it, binding beyond loopback
  /// prints a one-line warning to stderr.
  store_server(const detail::endpoint& ep, int rank, std::shared_ptr<const authenticator> auth = nullptr,
               store_limits limits = {})
      : rank_(rank), auth_(std::move(auth)), limits_(limits) {
    listen_ = detail::listen_on(ep, rank);
    const auto bound = detail::local_address(listen_.get());
    port_ = detail::port_of(bound);
    if (!auth_ && !detail::is_loopback(bound))
      std::fprintf(stderr, "ddp: store listening on %s:%d without authentication; set DDP_AUTH_TOKEN\n",
                   detail::to_string(bound).c_str(), port_);
    wake_ = detail::fd_handle(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    spare_ = detail::fd_handle(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    thread_ = std::thread([this] { loop(); });
  }
  store_server(const store_server&) = delete;
  store_server& operator=(const store_server&) = delete;
  ~store_server() { stop(); }

  /// The port actually bound.
  int port() const noexcept { return port_; }

  /// Number of clients connected right now (authenticated ones, when there is a secret; not
  /// counting clients that hung up and are only owed answers).
  int clients() const noexcept { return nclients_.load(); }

  /// Rank that hosts this store (for messages).
  int rank() const noexcept { return rank_; }

  /// Clients dropped since start: malformed input, or holding the most buffered bytes when
  /// the store_limits::max_buffered was passed.
  int dropped() const noexcept { return dropped_.load(); }

  /// Connections closed unserved because this process was out of file descriptors.
  int shed() const noexcept { return shed_.load(); }

  /// Bytes of keys and values held now.
  std::size_t stored_bytes() const noexcept { return stored_.load(); }

  /// Connections refused by authentication (no, wrong or replayed proof; a handshake that did
  /// not finish in time; a handshake offered to a server without a secret) since start.
  int refused() const noexcept { return refused_.load(); }

  /// Stops serving and closes every connection.
  void stop() noexcept {
    if (!thread_.joinable()) return;
    if (owner_.forked()) {
      // A forked child's copy: the serving thread is the parent's and does not exist here, and
      // the wake-up descriptor is the parent's too. Only this process's descriptors close.
      thread_.detach();
      return;
    }
    stopping_ = true;
    std::uint64_t one = 1;
    [[maybe_unused]] auto r = ::write(wake_.get(), &one, sizeof one);
    thread_.join();
  }

 private:
  struct client {
    detail::fd_handle fd;
    std::string in;
    std::string out;
    std::optional<detail::auth_responder> hs;  // engaged until the handshake is done
    bool closing = false;                      // refused: say why, then close
    bool shut = false;                         // closing and our side is shut down
    bool eof = false;                          // the client shut its side: answer, then close
    detail::deadline_t eof_limit{};            // ... within this time at most
    detail::deadline_t limit{};                // end of the handshake or of the closing linger
  };
  struct waiter {
    int fd;
    detail::frame req;
    detail::deadline_t until;
  };

  void loop() {
    std::map<int, client> clients;
    std::vector<waiter> waiters;
    std::vector<pollfd> pfds;
    while (!stopping_) {
      pfds.clear();
      pfds.push_back({wake_.get(), POLLIN, 0});
      const auto before = detail::clock::now();
      // Out of descriptors for longer than shedding helps: leave the listener alone a while
      // rather than spin on it.
      pfds.push_back({listen_.get(), static_cast<short>(before >= accept_pause_ ? POLLIN : 0), 0});
      int timeout = before >= accept_pause_ ? 1000 : detail::ms_left(accept_pause_) + 1;
      for (auto& [fd, c] : clients) {
        // A client whose replies pile up is not read until it takes them (backpressure).
        const bool want_in = !c.eof && (c.closing || c.out.size() < detail::store_max_frame);
        pfds.push_back({fd, static_cast<short>((want_in ? POLLIN : 0) | (c.out.empty() ? 0 : POLLOUT)), 0});
        if (c.hs || c.closing) timeout = std::min(timeout, detail::ms_left(c.limit) + 1);
        if (c.eof) timeout = std::min(timeout, detail::ms_left(c.eof_limit) + 1);
      }
      for (const auto& w : waiters) timeout = std::min(timeout, detail::ms_left(w.until) + 1);
      ::poll(pfds.data(), pfds.size(), timeout);
      if (stopping_) break;
      const auto now = detail::clock::now();
      if (pfds[1].revents & POLLIN) {
        for (;;) {
          const int fd = accept_one(now);
          if (fd < 0) break;
          if (clients.size() >= max_clients) { ::close(fd); continue; }
          detail::tune_stream(fd, 0);
          auto& c = clients[fd];
          c.fd = detail::fd_handle(fd);
          if (auth_) {
            c.hs.emplace(auth_.get(), detail::auth_kind::store);
            c.limit = now + detail::auth_handshake_limit;
          }
        }
      }
      std::vector<int> dead;
      for (std::size_t i = 2; i < pfds.size(); ++i) {
        const int fd = pfds[i].fd;
        auto it = clients.find(fd);
        if (it == clients.end()) continue;  // accepted after pfds was built
        auto& c = it->second;
        if (pfds[i].revents & (POLLERR | POLLHUP | POLLNVAL) && !(pfds[i].revents & POLLIN)) {
          dead.push_back(fd);
          continue;
        }
        if (pfds[i].revents & POLLIN) {
          const auto r = c.closing ? drain(c) : on_readable(fd, c, waiters);
          if (r == read_result::closed) { dead.push_back(fd); continue; }
          if (r == read_result::invalid) { ++dropped_; dead.push_back(fd); continue; }
        }
        if (!c.out.empty() && !flush(c)) { dead.push_back(fd); continue; }
        if (c.closing && c.out.empty() && !c.shut) {
          // Half-close and linger until the client hangs up, so it reads our answer rather
          // than a reset.
          ::shutdown(fd, SHUT_WR);
          c.shut = true;
        }
        if ((c.hs || c.closing) && now >= c.limit) {
          if (c.hs && !c.closing) ++refused_;
          dead.push_back(fd);
        }
      }
      serve_waiters(clients, waiters);
      // A client that shut its side goes once it has every answer it is owed, or after
      // eof_linger: a closed socket looks the same as a half-closed one, and requests parked
      // by a client that is gone must not hold a descriptor for as long as they asked to wait.
      for (auto& [fd, c] : clients)
        if (c.eof && ((c.out.empty() && std::none_of(waiters.begin(), waiters.end(),
                                                     [fd = fd](const waiter& w) { return w.fd == fd; })) ||
                      now >= c.eof_limit))
          dead.push_back(fd);
      shed_buffers(clients, dead);
      std::sort(dead.begin(), dead.end());
      dead.erase(std::unique(dead.begin(), dead.end()), dead.end());
      for (int fd : dead) {
        clients.erase(fd);
        std::erase_if(waiters, [fd](const waiter& w) { return w.fd == fd; });
      }
      // Only clients that got in count: a stranger stalled mid-handshake must not keep rank 0
      // waiting for it to leave.
      nclients_ = static_cast<int>(std::count_if(clients.begin(), clients.end(), [](const auto& kv) {
        return !kv.second.hs && !kv.second.closing && !kv.second.eof;
      }));
    }
  }

  enum class read_result { ok, closed, invalid };

  /// Accepts one connection, or returns -1 when none is waiting. Out of descriptors, the
  /// waiting connections are accepted on a spare descriptor and closed at once (their clients
  /// see the connection closed instead of hanging), so the loop never spins on a listener it
  /// cannot serve; when even that fails, the listener rests for 100 ms.
  int accept_one(detail::deadline_t now) {
    for (;;) {
      const int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) return fd;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return -1;
      bool drained = false;
      if ((errno == EMFILE || errno == ENFILE) && spare_) {
        spare_.reset();
        for (;;) {
          const int extra = ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC);
          if (extra < 0) {
            drained = errno == EAGAIN || errno == EWOULDBLOCK;
            if (errno == EINTR || errno == ECONNABORTED) continue;
            break;
          }
          ::close(extra);
          ++shed_;
        }
        spare_ = detail::fd_handle(::open("/dev/null", O_RDONLY | O_CLOEXEC));
      }
      if (!drained || !spare_) accept_pause_ = now + std::chrono::milliseconds(100);
      return -1;
    }
  }

  /// Keeps the bytes buffered for all clients under limits_.max_buffered by dropping the
  /// clients that hold the most (a legitimate client's frames are small next to a flood).
  void shed_buffers(std::map<int, client>& clients, std::vector<int>& dead) {
    std::size_t total = 0;
    for (const auto& [fd, c] : clients) total += c.in.size() + c.out.size();
    while (total > limits_.max_buffered) {
      auto worst = clients.end();
      for (auto it = clients.begin(); it != clients.end(); ++it) {
        if (std::find(dead.begin(), dead.end(), it->first) != dead.end()) continue;
        if (worst == clients.end() || it->second.in.size() + it->second.out.size() >
                                          worst->second.in.size() + worst->second.out.size())
          worst = it;
      }
      if (worst == clients.end()) break;
      total -= worst->second.in.size() + worst->second.out.size();
      dead.push_back(worst->first);
      ++dropped_;
    }
  }

  /// Reads what is there and acts on it one chunk at a time, so a bad length is caught after
  /// its first 4 bytes, never after buffering the rest of what the client sent.
  read_result on_readable(int fd, client& c, std::vector<waiter>& waiters) {
    char buf[65536];
    while (!c.closing && c.out.size() < detail::store_max_frame) {
      const ssize_t k = ::recv(c.fd.get(), buf, sizeof buf, 0);
      if (k > 0) {
        c.in.append(buf, static_cast<std::size_t>(k));
        if (!consume(fd, c, waiters)) return read_result::invalid;
        continue;
      }
      if (k == 0) {
        // Half-closed: requests already read are still answered (parked ones included).
        c.eof = true;
        c.eof_limit = detail::clock::now() + eof_linger;
        return read_result::ok;
      }
      return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? read_result::ok : read_result::closed;
    }
    return read_result::ok;
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
    c.closing = true;
    c.in.clear();
    c.hs.reset();
    c.limit = detail::clock::now() + std::chrono::seconds(2);
  }

  /// Runs the handshake while one is due, then the requests; false drops the client.
  bool consume(int fd, client& c, std::vector<waiter>& waiters) {
    using state = detail::auth_responder::state;
    if (c.hs) {
      switch (c.hs->feed(c.in, c.out, [](const detail::auth_hello&) { return true; })) {
        case state::hello:
        case state::proof: return true;
        case state::done: c.hs.reset(); break;
        case state::failed: refuse(c); return true;
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
    return handle_frames(fd, c, waiters);
  }

  static bool flush(client& c) {
    while (!c.out.empty()) {
      const ssize_t k = ::send(c.fd.get(), c.out.data(), c.out.size(), MSG_NOSIGNAL);
      if (k > 0) { c.out.erase(0, static_cast<std::size_t>(k)); continue; }
      return k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
    }
    return true;
  }

  bool handle_frames(int fd, client& c, std::vector<waiter>& waiters) {
    for (;;) {
      std::uint32_t len = 0;
      const auto hr = detail::check_header(c.in, len);
      if (hr == detail::parse_result::invalid) return false;
      if (hr == detail::parse_result::need_more) return true;
      detail::frame f;
      if (detail::parse_body(std::string_view(c.in).substr(4, len), f) != detail::parse_result::ok) return false;
      c.in.erase(0, 4 + static_cast<std::size_t>(len));
      if (!detail::valid_request(f)) return false;
      if (!execute(c, f)) {
        // Our client parks at most one request at a time; many more is a misbehaving peer.
        if (std::count_if(waiters.begin(), waiters.end(), [fd](const waiter& w) { return w.fd == fd; }) >=
            static_cast<std::ptrdiff_t>(detail::store_max_waiting))
          return false;
        const auto ms = detail::decode_i64(f.fields.back());
        // The wait comes from the client: clamp it (a day) before it meets the clock's range.
        const std::int64_t bounded = std::clamp<std::int64_t>(ms, 0, std::int64_t{86'400'000});
        waiters.push_back({fd, std::move(f), detail::clock::now() + std::chrono::milliseconds(bounded)});
      }
    }
  }

  static void reply(client& c, detail::store_status st, const std::vector<std::string_view>& fields = {}) {
    c.out += detail::encode_frame(static_cast<std::uint8_t>(st), fields);
  }

  /// Executes a request; returns false when it must wait (get/wait on missing keys).
  bool execute(client& c, const detail::frame& f) {
    using detail::store_cmd;
    const auto& k = f.fields[0];
    switch (static_cast<store_cmd>(f.code)) {
      case store_cmd::set:
        if (!store_value(c, k, f.fields[1])) return true;
        reply(c, detail::store_status::ok);
        return true;
      case store_cmd::get: {
        auto it = data_.find(k);
        if (it == data_.end()) return false;
        reply(c, detail::store_status::ok, {it->second});
        return true;
      }
      case store_cmd::add: {
        auto it = data_.find(k);
        const std::string& old = it == data_.end() ? std::string() : it->second;
        // Two's-complement wrap-around, as the counter's users expect; no signed overflow.
        const auto nv = static_cast<std::int64_t>(
            static_cast<std::uint64_t>(old.size() == 8 ? detail::decode_i64(old) : 0) +
            static_cast<std::uint64_t>(detail::decode_i64(f.fields[1])));
        if (!store_value(c, k, detail::encode_i64(nv))) return true;
        reply(c, detail::store_status::ok, {data_.find(k)->second});
        return true;
      }
      case store_cmd::cas: {
        auto it = data_.find(k);
        if (it == data_.end()) {
          if (f.fields[1].empty()) {
            if (!store_value(c, k, f.fields[2])) return true;
            reply(c, detail::store_status::ok, {f.fields[2]});
          } else {
            reply(c, detail::store_status::ok, {f.fields[1].substr(0, 0)});
          }
          return true;
        }
        if (it->second == f.fields[1] && !store_value(c, k, f.fields[2])) return true;
        reply(c, detail::store_status::ok, {data_.find(k)->second});
        return true;
      }
      case store_cmd::del: {
        auto it = data_.find(k);
        const bool erased = it != data_.end();
        if (erased) {
          stored_ -= it->first.size() + it->second.size();
          data_.erase(it);
        }
        reply(c, detail::store_status::ok, {erased ? "1" : "0"});
        return true;
      }
      case store_cmd::check:
        reply(c, detail::store_status::ok, {data_.count(k) ? "1" : "0"});
        return true;
      case store_cmd::wait: {
        for (std::size_t i = 0; i + 1 < f.fields.size(); ++i)
          if (!data_.count(f.fields[i])) return false;
        reply(c, detail::store_status::ok);
        return true;
      }
    }
    return true;
  }

  /// data_[key] = value within limits_.max_bytes; otherwise answers `full` and returns false.
  bool store_value(client& c, const std::string& key, std::string_view value) {
    auto it = data_.find(key);
    const std::size_t old = it == data_.end() ? 0 : key.size() + it->second.size();
    const std::size_t now = stored_.load() - old;
    if (key.size() + value.size() > limits_.max_bytes) {
      // Could never fit, however empty the store: a bad argument, not a full store.
      const std::string why = "store value for key '" + key.substr(0, 64) + "' is too large: " +
                              std::to_string(key.size() + value.size()) + " bytes with its key, and the store of rank " +
                              std::to_string(rank_) + " holds at most " + std::to_string(limits_.max_bytes) +
                              " (store_limits::max_bytes)";
      reply(c, detail::store_status::too_large, {why});
      return false;
    }
    if (now + key.size() + value.size() > limits_.max_bytes) {
      const std::string why = "the store of rank " + std::to_string(rank_) + " is full: writing '" + key + "' (" +
                              std::to_string(value.size()) + " bytes) would pass its limit of " +
                              std::to_string(limits_.max_bytes) + " bytes (store_limits::max_bytes; " +
                              std::to_string(now) + " held)";
      reply(c, detail::store_status::full, {why});
      return false;
    }
    if (it == data_.end()) data_.emplace(key, std::string(value));
    else it->second.assign(value);
    stored_ = now + key.size() + value.size();
    return true;
  }

  void serve_waiters(std::map<int, client>& clients, std::vector<waiter>& waiters) {
    const auto now = detail::clock::now();
    for (auto it = waiters.begin(); it != waiters.end();) {
      auto cit = clients.find(it->fd);
      if (cit == clients.end()) { it = waiters.erase(it); continue; }
      if (execute(cit->second, it->req)) {
        it = waiters.erase(it);
      } else if (now >= it->until) {
        // Timed out: say which keys are still missing, so callers can name absent ranks.
        std::vector<std::string_view> missing;
        const std::size_t nkeys = it->req.code == static_cast<std::uint8_t>(detail::store_cmd::wait)
                                      ? it->req.fields.size() - 1 : 1;
        for (std::size_t i = 0; i < nkeys; ++i)
          if (!data_.count(it->req.fields[i])) missing.push_back(it->req.fields[i]);
        reply(cit->second, detail::store_status::timeout, missing);
        it = waiters.erase(it);
      } else {
        ++it;
      }
      if (cit != clients.end() && !cit->second.out.empty()) flush(cit->second);
    }
  }

  static constexpr std::size_t max_clients = 65536;
  static constexpr auto eof_linger = std::chrono::seconds(10);
  int rank_;
  std::shared_ptr<const authenticator> auth_;
  store_limits limits_;
  detail::fd_handle spare_;  // given up to accept (and close) one connection when out of descriptors
  detail::deadline_t accept_pause_{};
  int port_ = 0;
  detail::fd_handle listen_;
  detail::fd_handle wake_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> nclients_{0};
  std::atomic<int> dropped_{0};
  std::atomic<int> refused_{0};
  std::atomic<int> shed_{0};
  std::atomic<std::size_t> stored_{0};
  std::map<std::string, std::string, std::less<>> data_;
  detail::owner_process owner_;
  std::thread thread_;
};

/// A connection to the store. Calls are serialized by a mutex; each takes a deadline.
class store_client {
 public:
  /// Connects, retrying until `until` because rank 0 may start after us. With `auth`, proves
  /// the secret and checks the server's proof before anything else (errc::auth_failed when
  /// either fails).
  store_client(const std::string& host, int port, int rank, detail::deadline_t until,
               std::shared_ptr<const authenticator> auth = nullptr)
      : rank_(rank), auth_(std::move(auth)) {
    const auto eps = detail::resolve(host, port, rank);
    std::error_code ec;
    fd_ = detail::connect_retry(eps, until, ec);
    if (!fd_) {
      // Retrying ran into the deadline: the master (rank 0) never came up.
      detail::raise(errc::timeout, rank,
                    "could not reach the store of rank 0 at " + host + ":" + std::to_string(port) +
                        " before the deadline (rank 0 never arrived?): last error: " + detail::describe(ec));
    }
    detail::tune_stream(fd_.get(), 0);
    if (auth_) {
      detail::auth_hello h;
      h.kind = detail::auth_kind::store;
      h.from = static_cast<std::uint32_t>(rank);
      detail::auth_initiate(fd_.get(), *auth_, h, until, rank,
                            "the store of rank 0 at " + host + ":" + std::to_string(port));
    }
  }

  void set(std::string_view key, std::string_view value, detail::deadline_t until = default_deadline()) {
    call(detail::store_cmd::set, {key, value}, until);
  }

  /// Waits until `key` exists (server-side wait) and returns its value.
  std::string get(std::string_view key, detail::deadline_t until = default_deadline()) {
    const auto ms = detail::encode_ms(server_wait_ms(until));
    auto r = call(detail::store_cmd::get, {key, ms}, until);
    if (r.code == static_cast<std::uint8_t>(detail::store_status::timeout))
      detail::raise(errc::timeout, rank_, "store key '" + std::string(key) + "' never appeared");
    return r.fields.empty() ? std::string() : r.fields[0];
  }

  std::int64_t add(std::string_view key, std::int64_t delta, detail::deadline_t until = default_deadline()) {
    const auto d = detail::encode_i64(delta);
    auto r = call(detail::store_cmd::add, {key, d}, until);
    return detail::decode_i64(first_field(r, "add", 8));
  }

  /// Sets `key` to `desired` if its value is `expected` (empty `expected`: the key is absent).
  /// Returns the value after the call.
  std::string compare_set(std::string_view key, std::string_view expected, std::string_view desired,
                          detail::deadline_t until = default_deadline()) {
    auto r = call(detail::store_cmd::cas, {key, expected, desired}, until);
    return first_field(r, "compare_set");
  }

  bool erase(std::string_view key, detail::deadline_t until = default_deadline()) {
    return first_field(call(detail::store_cmd::del, {key}, until), "erase") == "1";
  }

  bool check(std::string_view key, detail::deadline_t until = default_deadline()) {
    return first_field(call(detail::store_cmd::check, {key}, until), "check") == "1";
  }

  /// Waits until every key exists; returns the keys still missing when `until` passed (empty
  /// when all arrived).
  std::vector<std::string> wait(const std::vector<std::string>& keys, detail::deadline_t until) {
    std::vector<std::string_view> f(keys.begin(), keys.end());
    const auto ms = detail::encode_ms(server_wait_ms(until));
    f.push_back(ms);
    auto r = call(detail::store_cmd::wait, f, until);
    if (r.code == static_cast<std::uint8_t>(detail::store_status::timeout)) return r.fields;
    return {};
  }

  int native_handle() const noexcept { return fd_.get(); }

  /// The authenticator this connection was opened with (null without a secret); the mesh
  /// connections opened through this store use it too.
  const std::shared_ptr<const authenticator>& auth() const noexcept { return auth_; }

  static detail::deadline_t default_deadline() { return detail::clock::now() + std::chrono::seconds(300); }

 private:
  /// The answer's first field; an answer without it (or of the wrong size) is a protocol error.
  const std::string& first_field(const detail::frame& f, const char* what, std::size_t size = 0) const {
    if (f.fields.empty() || (size != 0 && f.fields[0].size() != size))
      detail::raise(errc::protocol, rank_, std::string("store answered ") + what + " without its value");
    return f.fields[0];
  }

  /// Requests the store could never take are refused here, before they are sent: the server
  /// drops a client whose frame passes its limits, which would break this connection (and with
  /// it the group) for what is only a bad argument.
  void check_request(detail::store_cmd cmd, const std::vector<std::string_view>& fields) const {
    const std::string key = fields.empty() ? std::string() : std::string(fields[0].substr(0, 64));
    const std::size_t nkeys = cmd == detail::store_cmd::wait ? fields.size() - 1 : 1;
    for (std::size_t i = 0; i < nkeys && i < fields.size(); ++i)
      if (fields[i].size() > detail::store_max_key)
        detail::raise(errc::invalid_argument, rank_,
                      "store key '" + std::string(fields[i].substr(0, 64)) + "...' is " +
                          std::to_string(fields[i].size()) + " bytes; keys hold at most " +
                          std::to_string(detail::store_max_key));
    if (fields.size() > detail::store_max_fields)
      detail::raise(errc::invalid_argument, rank_,
                    "store wait for " + std::to_string(nkeys) + " keys; one request holds at most " +
                        std::to_string(detail::store_max_fields - 1));
    std::size_t frame = 1;
    for (auto f : fields) frame += 4 + f.size();
    if (frame > detail::store_max_frame)
      detail::raise(errc::invalid_argument, rank_,
                    "store value for key '" + key + "' is too large: the request is " + std::to_string(frame) +
                        " bytes and a store frame holds at most " + std::to_string(detail::store_max_frame) +
                        " (the store is for small metadata; send bulk data through a collective)");
  }

  detail::frame call(detail::store_cmd cmd, const std::vector<std::string_view>& fields, detail::deadline_t until) {
    // A forked child shares the connection with its parent: one frame from it would garble both.
    owner_.check(rank_, "store_client");
    check_request(cmd, fields);
    std::lock_guard lock(mu_);
    if (!broken_.empty())
      detail::raise(broken_code_, rank_, "store connection to rank 0 is unusable after an earlier failure: " + broken_);
    const auto out = detail::encode_frame(static_cast<std::uint8_t>(cmd), fields);
    std::error_code ec;
    detail::send_all(fd_.get(), out.data(), out.size(), until, ec);
    if (ec) fail(ec);
    // The server answers get and wait itself when their time is up, a moment before `until`
    // (server_wait_ms); the answer may take a little longer than `until` to arrive. Not much:
    // a store that does not answer (rank 0 frozen) must be noticed soon after the deadline.
    const bool server_waits = cmd == detail::store_cmd::get || cmd == detail::store_cmd::wait;
    const auto rd = server_waits ? until + reply_slack : until;
    char hdr[4];
    detail::recv_all(fd_.get(), hdr, 4, rd, ec);
    if (ec) fail(ec);
    const std::uint32_t len = detail::get_u32(hdr);
    if (len == 0 || len > detail::store_max_frame)
      broken(errc::protocol, "store sent a bad frame length (" + std::to_string(len) + " bytes)");
    std::string body(len, '\0');
    detail::recv_all(fd_.get(), body.data(), len, rd, ec);
    if (ec) fail(ec);
    detail::frame f;
    if (detail::parse_body(body, f) != detail::parse_result::ok) broken(errc::protocol, "store sent a malformed frame");
    if (f.code > static_cast<std::uint8_t>(detail::store_status::too_large))
      broken(errc::protocol, "store sent an unknown status " + std::to_string(f.code));
    if (f.code == static_cast<std::uint8_t>(detail::store_status::full))
      detail::raise(errc::system, rank_, f.fields.empty() ? std::string("the store of rank 0 is full") : f.fields[0]);
    if (f.code == static_cast<std::uint8_t>(detail::store_status::too_large))
      detail::raise(errc::invalid_argument, rank_,
                    f.fields.empty() ? std::string("the value is larger than the store of rank 0 holds") : f.fields[0]);
    if (f.code == static_cast<std::uint8_t>(detail::store_status::bad_request))
      detail::raise(errc::protocol, rank_, "store rejected the request");
    if (f.code == static_cast<std::uint8_t>(detail::store_status::auth_required))
      broken(errc::auth_failed,
             "the store of rank 0 requires authentication and refused this process: set "
             "DDP_AUTH_TOKEN (or init_options::auth_token) to the group's secret");
    return f;
  }

  static constexpr auto reply_slack = std::chrono::milliseconds(250);

  /// How long the server waits for a get/wait: up to `until`, less a margin for its answer.
  static int server_wait_ms(detail::deadline_t until) {
    const int left = detail::ms_left(until);
    return std::max(0, left - std::min(left / 8, static_cast<int>(reply_slack.count())));
  }

  [[noreturn]] void fail(const std::error_code& ec) {
    // A reply may still be on its way: later calls would read it as theirs, so none may follow.
    broken(detail::to_errc(ec) == errc::timeout ? errc::timeout : errc::peer_lost,
           "store connection to rank 0: " + detail::describe(ec));
  }
  /// The byte stream can no longer be trusted to be in step with our requests (a reply still on
  /// its way, or one we could not frame): every later call fails at once, naming this cause.
  [[noreturn]] void broken(errc code, const std::string& why) {
    broken_ = why;
    broken_code_ = code;
    detail::raise(code, rank_, why);
  }

  int rank_;
  std::shared_ptr<const authenticator> auth_;
  detail::fd_handle fd_;
  std::mutex mu_;
  std::string broken_;  ///< why the connection is unusable (guarded by mu_); empty while it is fine
  errc broken_code_ = errc::peer_lost;
  detail::owner_process owner_;
};

}  // namespace v0
}  // namespace ddp
