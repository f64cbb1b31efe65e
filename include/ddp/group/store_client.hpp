#pragma once
/// \file group/store_client.hpp
/// A connection to the group's key-value store (group/store_server.hpp): set, get (waits), add,
/// compare-and-set, delete, check and wait-for-keys, each with a deadline; with an authenticator
/// (docs/security.md) the connection first proves the secret and checks the server's proof.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/auth.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/group/detail/handshake.hpp>
#include <ddp/detail/socket.hpp>
#include <ddp/group/detail/store_protocol.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/error.hpp>
#include <ddp/group/detail/keys.hpp>
#include <ddp/detail/first_failure.hpp>
#include <ddp/group/kv_store.hpp>
#include <ddp/group/init_options.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// A connection to the built-in store: the default backend of `kv_store`. Calls take turns on
/// it (each waits for its turn until its own deadline); each takes a deadline.
class store_client : public kv_store {
 public:
  /// Connects, retrying until `until` because rank 0 may start after us, and returns once the
  /// store has answered: with `auth`, the handshake (it proves the secret and checks the
  /// server's proof; errc::auth_failed when either fails); without, a `check` round trip. A
  /// connection the store closes before that (shed or evicted while it had no room,
  /// docs/security.md) is made again until `until`. `external`: the store is served outside the
  /// group (a launcher or `ddpstore`, DDP_EXTERNAL_STORE=1), not by rank 0; errors say so.
  ~store_client() {
    if (owner_.forked()) detail::abandon(std::move(turn_));
  }
  store_client(const store_client&) = delete;
  store_client& operator=(const store_client&) = delete;

  store_client(const std::string& host, int port, int rank, deadline_t until,
               std::shared_ptr<const authenticator> auth = nullptr, bool external = false)
      : kv_store(rank, std::move(auth)),
        store_(external ? "the group's store" : "the store of rank 0"),
        where_(host + ":" + std::to_string(port) +
               (external ? " (served outside the ranks: ddprun or ddpstore)" : "")) {
    const auto eps = detail::resolve(host, port, rank);
    const std::string where = host + ":" + std::to_string(port);
    detail::backoff wait;
    int closed = 0;  // connections the store closed before serving them
    auto no_room = [&] {
      return store_ + " at " + where + " closed this rank's connection " + std::to_string(closed) +
             " times before serving it, until the deadline: it had no room (too many connections or no "
             "descriptors left on its host; strangers flooding it?)";
    };
    for (;;) {
      std::error_code ec;
      fd_ = detail::connect_retry(eps, until, ec);
      if (!fd_) {
        // Retrying ran into the deadline: the master (rank 0) never came up, or its store kept
        // closing our connections (no room).
        detail::raise(errc::timeout, rank,
                      closed > 0 ? no_room()
                                 : "could not reach " + store_ + " at " + where + " before the deadline (" +
                                       (external ? "its server never started?" : "rank 0 never arrived?") +
                                       "): last error: " + detail::describe(ec));
      }
      detail::tune_stream(fd_.get(), 0);
      try {
        if (kv_store::auth()) {
          detail::auth_hello h;
          h.kind = detail::auth_kind::store;
          h.from = static_cast<std::uint32_t>(rank);
          detail::auth_initiate(fd_.get(), *kv_store::auth(), h, until, rank, store_ + " at " + where);
        } else {
          (void)do_check(std::string(detail::keys::hello), until);
        }
        return;
      } catch (const error& e) {
        // Closed before it was served: the store had no room for us yet. Anything else (a
        // refusal, a protocol error, the deadline) is the answer.
        if (e.code() != errc::peer_lost) throw;
        ++closed;
      }
      // A fresh connection: nothing of the closed one's failure carries over.
      fd_.reset();
      broken_.reset();
      if (!wait.pause(until)) detail::raise(errc::timeout, rank, no_room());
    }
  }

  int native_handle() const noexcept { return fd_.get(); }
  bool unusable() const noexcept override { return broken_.failed(); }
  sockaddr_storage local_address() const override { return detail::local_address(fd_.get()); }
  std::string where() const override { return store_ + " at " + where_; }

 protected:
  void do_set(const std::string& key, std::string_view value, deadline_t until) override {
    call(detail::store_cmd::set, {key, value}, until);
  }

  /// One request: a wait (at the store, up to `server_wait`) and a get in one round trip.
  std::optional<std::string> do_try_get(const std::string& key, std::optional<std::chrono::milliseconds> server_wait,
                                        deadline_t until) override {
    const auto ms = detail::encode_ms(
        std::min<std::int64_t>(server_wait ? server_wait->count() : INT64_MAX, server_wait_ms(until)));
    auto r = call(detail::store_cmd::get, {key, ms}, until);
    if (r.code == static_cast<std::uint8_t>(detail::store_status::timeout)) return std::nullopt;
    return r.fields.empty() ? std::string() : std::move(r.fields[0]);
  }

  std::int64_t do_add(const std::string& key, std::int64_t delta, deadline_t until) override {
    const auto d = detail::encode_i64(delta);
    auto r = call(detail::store_cmd::add, {key, d}, until);
    return detail::decode_i64(first_field(r, "add", 8));
  }

  std::string do_compare_set(const std::string& key, std::string_view expected, std::string_view desired,
                             deadline_t until) override {
    auto r = call(detail::store_cmd::cas, {key, expected, desired}, until);
    return first_field(r, "compare_set");
  }

  bool do_erase(const std::string& key, deadline_t until) override {
    return first_field(call(detail::store_cmd::del, {key}, until), "erase") == "1";
  }

  /// The store erases a bounded number per request, so this takes one request per 4096 keys.
  std::size_t do_erase_prefix(const std::string& prefix, deadline_t until) override {
    std::size_t total = 0;
    for (;;) {
      const std::string a{
          first_field(call(detail::store_cmd::del, {prefix, detail::store_del_prefix}, until), "erase_prefix")};
      std::size_t n = 0;
      if (a.empty() || a.size() > 6 || a.find_first_not_of("0123456789") != std::string::npos ||
          (n = std::stoul(a)) > detail::store_max_fields)
        detail::raise(errc::protocol, rank_, "store answered erase_prefix with '" + a.substr(0, 16) + "', not a count");
      total += n;
      if (n < detail::store_max_fields) return total;
    }
  }

  bool do_check(const std::string& key, deadline_t until) override {
    return first_field(call(detail::store_cmd::check, {key}, until), "check") == "1";
  }

  std::vector<std::string> do_wait(const std::vector<std::string>& keys,
                                   std::optional<std::chrono::milliseconds> server_wait, deadline_t until) override {
    std::vector<std::string_view> f(keys.begin(), keys.end());
    const auto ms = detail::encode_ms(
        std::min<std::int64_t>(server_wait ? server_wait->count() : INT64_MAX, server_wait_ms(until)));
    f.push_back(ms);
    auto r = call(detail::store_cmd::wait, f, until);
    if (r.code != static_cast<std::uint8_t>(detail::store_status::timeout)) return {};
    return std::move(r.fields);
  }

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

  detail::frame call(detail::store_cmd cmd, const std::vector<std::string_view>& fields, deadline_t until) {
    // A forked child shares the connection with its parent: one frame from it would garble both.
    owner_.check(rank_, "store_client");
    check_request(cmd, fields);
    // Other threads share this connection: the deadline may pass while this call waits for its
    // turn. That is this call's timeout, not a fault of the connection: nothing was sent.
    turn_guard lock(*turn_, until);
    if (!lock.held)
      detail::raise(errc::timeout, rank_,
                    "store request timed out waiting for its turn on the connection to " + store_ + " at " + where_ +
                        " (another thread's request held it)");
    broken_.check(rank_, "the connection to " + store_ + " at " + where_ + " is unusable after an earlier failure: ");
    const auto start = steady_clock::now();
    if (start >= until)
      detail::raise(errc::timeout, rank_,
                    "store request timed out waiting for its turn on the connection to " + store_ + " at " + where_ +
                        " (another thread's request held it)");
    // Once sent, the answer is read for a moment at least, whatever is left of `until`: an
    // answer abandoned half-way would make the connection unusable for every later call.
    until = std::max(until, start + min_answer);
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
    if (f.code > detail::store_last_status)
      broken(errc::protocol, "store sent an unknown status " + std::to_string(f.code));
    if (f.code == static_cast<std::uint8_t>(detail::store_status::full))
      detail::raise(errc::system, rank_, f.fields.empty() ? store_ + " is full" : f.fields[0]);
    if (f.code == static_cast<std::uint8_t>(detail::store_status::too_large))
      detail::raise(errc::invalid_argument, rank_,
                    f.fields.empty() ? "the value is larger than " + store_ + " holds" : f.fields[0]);
    if (f.code == static_cast<std::uint8_t>(detail::store_status::forbidden))
      detail::raise(
          errc::auth_failed, rank_,
          f.fields.empty() ? store_ + " refused a write: this connection has not joined the group" : f.fields[0]);
    if (f.code == static_cast<std::uint8_t>(detail::store_status::bad_request))
      detail::raise(errc::protocol, rank_, "store rejected the request");
    if (f.code == static_cast<std::uint8_t>(detail::store_status::auth_required))
      broken(errc::auth_failed, store_ +
                                    " requires authentication and refused this process: set DDP_AUTH_TOKEN (or "
                                    "init_options::auth_token) to the group's secret");
    return f;
  }

  static constexpr auto reply_slack = detail::timing::store_reply_slack;
  static constexpr auto min_answer = detail::timing::store_min_answer;

  /// How long the server waits for a get/wait: up to `until` (however far: days), less a
  /// margin for its answer.
  static std::int64_t server_wait_ms(deadline_t until) {
    const std::int64_t left = std::max<std::int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(until - steady_clock::now()).count());
    return left - std::min<std::int64_t>(left / 8, reply_slack.count());
  }

  [[noreturn]] void fail(const std::error_code& ec) {
    // A reply may still be on its way: later calls would read it as theirs, so none may follow.
    broken(detail::to_errc(ec) == errc::timeout ? errc::timeout : errc::peer_lost,
           "the connection to " + store_ + " at " + where_ + " failed: " + detail::describe(ec));
  }
  /// The byte stream can no longer be trusted to be in step with our requests (a reply still on
  /// its way, or one we could not frame): every later call fails at once, naming this cause.
  [[noreturn]] void broken(errc code, const std::string& why) {
    broken_.set(code, why);
    detail::raise(code, rank_, why);
  }

  std::string store_;  // who serves the store, as errors name it
  std::string where_;  // its address (and who serves it), for messages
  detail::fd_handle fd_;
  /// One request at a time on the connection, waited for until the caller's deadline. (A mutex
  /// and a flag rather than std::timed_mutex, whose timed lock ThreadSanitizer cannot follow.)
  /// On the heap: a forked child abandons it, since a parent thread may have been waiting on it.
  struct turn {
    std::mutex mu;
    std::condition_variable cv;
    bool busy = false;
  };
  struct turn_guard {
    turn& t;
    bool held;
    turn_guard(turn& tt, deadline_t until) : t(tt) {
      std::unique_lock lk(t.mu);
      held = t.cv.wait_until(lk, until, [&] { return !t.busy; });
      if (held) t.busy = true;
    }
    ~turn_guard() {
      if (!held) return;
      {
        std::lock_guard lk(t.mu);
        t.busy = false;
      }
      t.cv.notify_one();
    }
    turn_guard(const turn_guard&) = delete;
    turn_guard& operator=(const turn_guard&) = delete;
  };
  std::unique_ptr<turn> turn_ =
      std::make_unique<turn>();   ///< one request at a time on the connection; waited for until the deadline
  detail::first_failure broken_;  ///< why the connection is unusable (set during a turn)
  detail::owner_process owner_;
};

/// The group's store as `o` names it: the backend of `o.store_url` (etcd://...), else the
/// built-in store at master_addr:master_port (rank 0's, or the launcher's when external_store).
inline std::unique_ptr<kv_store> connect_store(const init_options& o, std::shared_ptr<const authenticator> auth,
                                               deadline_t until) {
  if (!o.store_url.empty()) return store_backend_for(o.store_url, o.rank)(o.store_url, o, std::move(auth), until);
  return std::make_unique<store_client>(o.master_addr, o.master_port, o.rank, until, std::move(auth), o.external_store);
}

}  // namespace DDP_ABI
}  // namespace ddp
