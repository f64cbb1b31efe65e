#pragma once
/// \file group/kv_store.hpp
/// `ddp::kv_store`: the one interface through which the group, its rendezvous, the failure
/// record, the elastic protocol, the reducers and the launcher use their key-value store, and
/// the registry of its backends. Two backends: the built-in store (group/store_client.hpp, the
/// default: served by rank 0, by `ddprun` or by `ddpstore`) and etcd (<ddp/etcd.hpp>, chosen by
/// `DDP_STORE=etcd://host:2379,...` or init_options::store). docs/cluster.md.
///
/// Every call takes a deadline; the keys it names are put under the store's prefix
/// (`set_prefix`) here, once, for every backend. A backend implements the `do_` functions with
/// the keys as they are stored.
///
/// \code
/// std::unique_ptr<ddp::kv_store> s = ddp::connect_store(opts, until);   // the group's choice
/// s->set("k", "v");
/// auto v = s->get("k", deadline);
/// \endcode

#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddp/auth.hpp>
#include <ddp/clock.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {

struct init_options;

/// A connection to the group's key-value store. Calls from several threads take turns; each
/// takes a deadline and raises ddp::error (errc::timeout, peer_lost, protocol, ...) naming the
/// store, never hangs past it.
class kv_store {
 public:
  virtual ~kv_store() = default;
  kv_store(const kv_store&) = delete;
  kv_store& operator=(const kv_store&) = delete;

  static deadline_t default_deadline() { return steady_clock::now() + detail::timing::store_default_wait; }

  void set(std::string_view key, std::string_view value, deadline_t until = default_deadline()) {
    do_set(keyed(key), value, until);
  }
  /// Waits until `key` exists and returns its value; errc::timeout when it never appeared.
  std::string get(std::string_view key, deadline_t until = default_deadline()) {
    auto v = do_try_get(keyed(key), std::nullopt, until);
    if (!v) detail::raise(errc::timeout, rank_, "store key '" + std::string(key) + "' never appeared");
    return std::move(*v);
  }
  /// `key`'s value once it exists, waiting for it up to `wait` (0: a look); nothing when it did
  /// not appear by then.
  std::optional<std::string> try_get(std::string_view key, std::chrono::milliseconds wait, deadline_t until) {
    return do_try_get(keyed(key), wait, until);
  }
  /// Adds `delta` to the counter at `key` (absent: 0) and returns its new value, exactly once
  /// however the backend retries. A counter is read and written through add alone (add 0
  /// reads it): a backend may keep it in keys of its own under `key`.
  std::int64_t add(std::string_view key, std::int64_t delta, deadline_t until = default_deadline()) {
    return do_add(keyed(key), delta, until);
  }
  /// Sets `key` to `desired` if its value is `expected` (empty `expected`: the key is absent).
  /// Returns the value after the call.
  std::string compare_set(std::string_view key, std::string_view expected, std::string_view desired,
                          deadline_t until = default_deadline()) {
    return do_compare_set(keyed(key), expected, desired, until);
  }
  bool erase(std::string_view key, deadline_t until = default_deadline()) { return do_erase(keyed(key), until); }
  /// Erases every key that starts with `prefix` (under this store's prefix); returns how many.
  std::size_t erase_prefix(std::string_view prefix, deadline_t until = default_deadline()) {
    return do_erase_prefix(keyed(prefix), until);
  }
  bool check(std::string_view key, deadline_t until = default_deadline()) { return do_check(keyed(key), until); }
  /// Waits until every key exists; returns the keys still missing when `until` passed (empty
  /// when all arrived).
  std::vector<std::string> wait(const std::vector<std::string>& keys, deadline_t until) {
    return wait_keys(keys, std::nullopt, until);
  }
  /// The same with the store's wait for the keys (`wait`) apart from the call's own deadline
  /// (`until`: its turn on the connection, the request and the reply): a short look ("which of
  /// these keys are missing now?") at a store busy with other clients must not fail because the
  /// reply took longer than the look.
  std::vector<std::string> wait(const std::vector<std::string>& keys, std::chrono::milliseconds wait,
                                deadline_t until) {
    return wait_keys(keys, wait, until);
  }

  /// Puts every key this connection reads or writes from now on under `prefix` (an elastic
  /// group's generation, init_options::key_prefix): groups that share a store stay apart.
  void set_prefix(std::string prefix) { prefix_ = std::move(prefix); }
  const std::string& prefix() const noexcept { return prefix_; }

  /// True once a failure made the connection unusable (every later call fails at once).
  virtual bool unusable() const noexcept = 0;
  /// This host's address on its route to the store: where the group's links listen.
  virtual sockaddr_storage local_address() const = 0;
  /// The store as errors name it ("the group's store at 10.0.0.1:29500", "etcd at ...").
  virtual std::string where() const = 0;

  /// The authenticator of the group's secret (null without one): the links between ranks
  /// prove it.
  const std::shared_ptr<const authenticator>& auth() const noexcept { return auth_; }
  /// The rank this connection speaks for (errors name it).
  int rank() const noexcept { return rank_; }

 protected:
  kv_store(int rank, std::shared_ptr<const authenticator> auth) : rank_(rank), auth_(std::move(auth)) {}

  // The backend's requests, with the keys as stored (under the prefix). `wait`: how long the
  // store may wait for missing keys; nothing: as long as `until` allows.
  virtual void do_set(const std::string& key, std::string_view value, deadline_t until) = 0;
  virtual std::optional<std::string> do_try_get(const std::string& key, std::optional<std::chrono::milliseconds> wait,
                                                deadline_t until) = 0;
  virtual std::int64_t do_add(const std::string& key, std::int64_t delta, deadline_t until) = 0;
  virtual std::string do_compare_set(const std::string& key, std::string_view expected, std::string_view desired,
                                     deadline_t until) = 0;
  virtual bool do_erase(const std::string& key, deadline_t until) = 0;
  virtual std::size_t do_erase_prefix(const std::string& prefix, deadline_t until) = 0;
  virtual bool do_check(const std::string& key, deadline_t until) = 0;
  /// The keys of `keys` still missing when the wait ended, as stored.
  virtual std::vector<std::string> do_wait(const std::vector<std::string>& keys,
                                           std::optional<std::chrono::milliseconds> wait, deadline_t until) = 0;

  int rank_;

 private:
  std::string keyed(std::string_view key) const { return prefix_ + std::string(key); }
  std::vector<std::string> wait_keys(const std::vector<std::string>& keys, std::optional<std::chrono::milliseconds> w,
                                     deadline_t until) {
    std::vector<std::string> stored;
    stored.reserve(keys.size());
    for (const auto& k : keys) stored.push_back(keyed(k));
    auto missing = do_wait(stored, w, until);
    for (auto& k : missing)
      if (k.starts_with(prefix_)) k.erase(0, prefix_.size());
    return missing;
  }

  std::string prefix_;
  std::shared_ptr<const authenticator> auth_;
};

/// How a backend opens its store for a process of the group: the URL (its scheme chose the
/// backend), the process's options and rank, the secret's authenticator (null without one),
/// and the deadline for reaching the store.
using store_factory = std::function<std::unique_ptr<kv_store>(
    const std::string& url, const init_options& opts, std::shared_ptr<const authenticator> auth, deadline_t until)>;

namespace detail {
struct store_registry {
  std::mutex mu;
  std::map<std::string, store_factory, std::less<>> backends;
  static store_registry& get() {
    static store_registry r;
    return r;
  }
};
/// "etcd" of "etcd://h:2379/x"; empty when `url` names no scheme.
inline std::string_view store_scheme(std::string_view url) {
  const auto at = url.find("://");
  return at == std::string_view::npos ? std::string_view{} : url.substr(0, at);
}
}  // namespace detail

/// Makes `scheme` (as in "etcd://...") open stores through `f`; <ddp/etcd.hpp> registers
/// "etcd" when it is included. A later registration of the same scheme replaces the earlier.
inline bool register_store_backend(std::string scheme, store_factory f) {
  auto& r = detail::store_registry::get();
  std::lock_guard lock(r.mu);
  r.backends[std::move(scheme)] = std::move(f);
  return true;
}

/// The backend registered for `url`'s scheme; errc::usage naming the URL when none is (the
/// program did not include the backend's header, or the scheme is misspelled).
inline store_factory store_backend_for(const std::string& url, int rank) {
  const auto scheme = detail::store_scheme(url);
  if (scheme.empty())
    detail::raise(errc::invalid_argument, rank,
                  "DDP_STORE '" + url.substr(0, 128) +
                      "' is not a store URL: write etcd://host:2379[,host:2379...][/prefix] (or leave it unset for "
                      "the built-in store)");
  auto& r = detail::store_registry::get();
  std::lock_guard lock(r.mu);
  auto it = r.backends.find(scheme);
  if (it == r.backends.end())
    detail::raise(errc::usage, rank,
                  "DDP_STORE '" + url.substr(0, 128) + "' names the store backend '" + std::string(scheme) +
                      "', which this program does not have: " +
                      (scheme == "etcd" ? std::string("include <ddp/etcd.hpp> in it and link libcurl (docs/cluster.md)")
                                        : std::string("the backends are etcd:// and the built-in store (unset)")));
  return it->second;
}

}  // namespace DDP_ABI
}  // namespace ddp
