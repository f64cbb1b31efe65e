#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// What `ddp::basic_elastic_group` asks of the world, and the real world's answer: the store it
// coordinates through (the launcher's, or one this process hosts), the groups it forms (real
// process groups over sockets and shared memory), the clock, and who this process is. The
// group touches nothing else of the world: a simulation gives it another environment (in-process
// store, simulated groups, fake time; tests/unit/test_elastic_sim.cpp) and runs the same code.
//
// An environment `Env` provides:
//   Env::store          set/get/check/add/compare_set/try_get/wait/erase_prefix as kv_store's
//   Env::group          rank(), size(), has_sharded_state(), shards_whole(), broadcast(span<u64>|span<byte>, 0)
//   open_store(opts, host, until)   the coordination store (host: serve it here, this is rank 0)
//   no_group()          an empty group;  exists(g): whether g is one
//   form(opts, equal_state)         joins a generation's group (init_process_group)
//   close(g), leave_heartbeat(g), failed(g), failure_text(g), fail_all(g, code, text),
//   found_dead(g), on_found_dead(g, fn)
//   now(), restarted(), uid(), drop_parked()

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include <ddp/auth.hpp>
#include <ddp/clock.hpp>
#include <ddp/detail/parked.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/error.hpp>
#include <ddp/group/detail/close_rules.hpp>
#include <ddp/group/detail/generation.hpp>
#include <ddp/group/process_group.hpp>
#include <ddp/group/store_client.hpp>
#include <ddp/group/store_server.hpp>
#include <ddp/group/detail/keys.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// The real world: the group's store over TCP, process groups (each generation's through its
/// generation_link, generation.hpp), the steady clock.
struct elastic_env {
  using group = process_group;

  /// The store this process hosts, if any: kept up (bounded) while others still use it when it
  /// closes, after the process's own connection (a base of `store` declared before the client,
  /// so destroyed after it).
  struct hosted {
    std::unique_ptr<store_server> server;
    std::chrono::milliseconds linger{0};
    hosted(std::unique_ptr<store_server> s, std::chrono::milliseconds l) : server(std::move(s)), linger(l) {}
    hosted(const hosted&) = delete;
    hosted& operator=(const hosted&) = delete;
    ~hosted() {
      if (!server) return;
      const auto start = steady_clock::now();
      for (close_view v{.bound = linger};;) {
        v.others = server->clients();
        v.waited = std::chrono::duration_cast<std::chrono::milliseconds>(steady_clock::now() - start);
        if (decide_close(v).close) return;
        std::this_thread::sleep_for(detail::timing::close_poll);
      }
    }
  };

  /// The coordination store: the launcher's, etcd (init_options::store_url), or the one this
  /// process hosts (the launcher's rank 0 without a launcher's store), kept in `hosted_` so that
  /// it outlives the group's own connection.
  using store = kv_store;

  std::unique_ptr<store> open_store(const init_options& o, bool host, deadline_t until) {
    // With a secret every connection to the store and between ranks proves it (docs/security.md):
    // a stranger can neither register, nor vote, nor mark a rank dead.
    std::shared_ptr<const authenticator> auth;
    if (!o.auth_token.empty()) auth = make_authenticator(o.auth_token, o.rank);
    if (host)
      hosted_ = std::make_unique<hosted>(
          std::make_unique<store_server>(::ddp::endpoint{o.master_addr, o.master_port}, 0, auth, store_limits{},
                                         std::string(keys::seat_prefix), 0),
          std::min<std::chrono::milliseconds>(o.timeout, std::chrono::seconds(5)));
    return connect_store(o, auth, until);
  }

  static group no_group() { return generation_link::no_group(); }
  bool exists(const group&) const noexcept { return link_.valid(); }
  group form(const init_options& o, bool equal_state) {
    auto g = init_process_group(o);
    link_ = generation_link::of(g, equal_state);
    return g;
  }
  void close(group& g) {
    link_.release();
    g.close();
  }
  /// Stops this rank's heartbeat in `g`: a goodbye (this rank is leaving, not dead), and the
  /// predecessor's word (its goodbye or its death) before it goes.
  void leave_heartbeat(group&) { link_.leave_heartbeat(); }
  bool failed(group&) { return link_.failed(); }
  std::string failure_text(group&) { return link_.failure_text(); }
  /// Wakes every peer still blocked on this rank with `text` (as the group records it when
  /// `as_recorded`: a relayed verdict keeps its origin).
  void fail_all(group&, errc code, const std::string& text, bool as_recorded) { link_.fail(code, text, as_recorded); }
  /// The rank this rank's heartbeat found frozen or dead in `g`, or -1.
  int found_dead(const group&) const noexcept { return link_.found_dead(); }
  /// `fn` is told (on the group's courier thread, never the heartbeat's) the rank the heartbeat
  /// finds frozen or dead.
  void on_found_dead(group&, std::function<void(int)> fn) { link_.on_found_dead(std::move(fn)); }

  static deadline_t now() noexcept { return steady_clock::now(); }
  /// A process that ddprun restarted (DDP_RESTART_COUNT > 0) joins a running job.
  static bool restarted() {
    const char* r = std::getenv("DDP_RESTART_COUNT");
    return r != nullptr && std::atoi(r) > 0;
  }
  static std::string uid() {
    char host[64] = {};
    (void)::gethostname(host, sizeof host - 1);
    std::random_device rd;
    return std::string(host) + "." + std::to_string(::getpid()) + "." + std::to_string(rd());
  }
  static std::string drop_parked() { return detail::drop_parked(); }

 private:
  generation_link link_;            // the current generation's group: all the elastic group may touch of it
  std::unique_ptr<hosted> hosted_;  // the store this process serves, if any (open_store)
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
