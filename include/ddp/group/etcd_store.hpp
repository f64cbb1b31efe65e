#pragma once
/// \file group/etcd_store.hpp
/// `ddp::etcd_store`: the group's store on an etcd v3 cluster (a kv_store backend), so that the
/// control plane survives the loss of any one machine. Included by <ddp/etcd.hpp>, never by
/// <ddp/ddp.hpp>; needs libcurl and nlohmann/json (Debian: libcurl4-openssl-dev,
/// nlohmann-json3-dev). docs/cluster.md.
///
/// It speaks etcd's v3 API as JSON over HTTP (the gateway every etcd member serves on its
/// client port: /v3/kv/range, put, deleterange, txn, /v3/lease/grant, keepalive,
/// /v3/auth/authenticate), through libcurl, with nlohmann/json for the bodies:
///   - endpoints: any member answers; a request that fails on one (refused, reset, no leader,
///     timed out) goes to the next, until the call's deadline;
///   - keys: `<prefix>/<job id>/<key>` (prefix "/ddp" unless the URL gives one): jobs that share
///     a cluster never see each other's keys;
///   - every key is attached to the job's lease (one per job, kept alive by every process of the
///     job): the job's keys vanish a lease's time after its last process, never before;
///   - compare_set is one transaction; a counter is the set of its contributions, and add one
///     transaction that puts this call's and reads them all: no retry when ranks add at once,
///     and a copy of the request sent again after an answer that never came (the member died
///     mid-request) counts once;
///   - a wait for one key watches it (etcd pushes its creation); a wait for several polls them
///     (1 ms, growing to 8 ms), one range request a look;
///   - user and password (`etcd://user:pass@h:2379`) or TLS (`?tls=1&cacert=..&cert=..&key=..`)
///     as the cluster asks.

#include <arpa/inet.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/clock.hpp>
#include <ddp/detail/bytes.hpp>
#include <ddp/detail/first_failure.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/error.hpp>
#include <ddp/group/init_options.hpp>
#include <ddp/group/kv_store.hpp>

namespace ddp {
inline namespace DDP_ABI {

namespace detail {

/// An etcd URL, parsed: `etcd://[user:password@]host:port[,host:port...][/prefix][?options]`
/// with options tls=1, cacert=FILE, cert=FILE, key=FILE, ttl=SECONDS (the job lease's).
struct etcd_url {
  std::vector<std::string> endpoints;  ///< "host:port", in order
  std::string prefix = "/ddp";         ///< where the jobs' keys live
  std::string user, password;
  bool tls = false;
  std::string cacert, cert, key;
  int ttl_s = 0;  ///< the job lease's time to live; 0: the store's default (opts.timeout-based)
  /// The URL without its password, for messages.
  std::string shown() const {
    std::string s = "etcd://";
    if (!user.empty()) s += user + ":***@";
    for (std::size_t i = 0; i < endpoints.size(); ++i) s += (i ? "," : "") + endpoints[i];
    return s + prefix;
  }
};

/// Parses `url`; errc::invalid_argument saying what is wrong (never quoting a password).
inline etcd_url parse_etcd_url(std::string_view url, int rank = -1) {
  auto bad = [&](const std::string& why) -> etcd_url {
    std::string shown(url.substr(0, 160));
    if (auto at = shown.find('@'); at != std::string::npos) {
      const auto colon = shown.find(':', 7);
      if (colon != std::string::npos && colon < at) shown = shown.substr(0, colon) + ":***" + shown.substr(at);
    }
    raise(
        errc::invalid_argument, rank,
        "store URL '" + shown + "': " + why +
            " (write etcd://[user:password@]host:2379[,host:2379...][/prefix][?tls=1&cacert=FILE&cert=FILE&key=FILE])");
  };
  constexpr std::string_view scheme = "etcd://";
  if (!url.starts_with(scheme)) return bad("it does not start with etcd://");
  std::string_view rest = url.substr(scheme.size());
  etcd_url u;
  std::string_view query;
  if (auto q = rest.find('?'); q != std::string_view::npos) {
    query = rest.substr(q + 1);
    rest = rest.substr(0, q);
  }
  if (auto at = rest.rfind('@'); at != std::string_view::npos) {
    const auto cred = rest.substr(0, at);
    rest = rest.substr(at + 1);
    const auto colon = cred.find(':');
    if (colon == std::string_view::npos || colon == 0) return bad("its credentials are not user:password");
    u.user = std::string(cred.substr(0, colon));
    u.password = std::string(cred.substr(colon + 1));
  }
  if (auto slash = rest.find('/'); slash != std::string_view::npos) {
    u.prefix = std::string(rest.substr(slash));
    rest = rest.substr(0, slash);
    while (u.prefix.size() > 1 && u.prefix.back() == '/') u.prefix.pop_back();
    if (u.prefix == "/") return bad("its prefix is empty");
    if (u.prefix.size() > 256) return bad("its prefix is longer than 256 characters");
  }
  while (!rest.empty()) {
    const auto comma = rest.find(',');
    const auto ep = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    const auto colon = ep.rfind(':');
    if (ep.empty() || colon == std::string_view::npos || colon == 0 || colon + 1 == ep.size())
      return bad("endpoint '" + std::string(ep.substr(0, 64)) + "' is not host:port");
    const auto port = ep.substr(colon + 1);
    if (port.size() > 5 || port.find_first_not_of("0123456789") != std::string_view::npos ||
        std::stoi(std::string(port)) < 1 || std::stoi(std::string(port)) > 65535)
      return bad("endpoint '" + std::string(ep.substr(0, 64)) + "' has no port in [1, 65535]");
    u.endpoints.emplace_back(ep);
  }
  if (u.endpoints.empty()) return bad("it names no endpoint");
  if (u.endpoints.size() > 64) return bad("it names more than 64 endpoints");
  while (!query.empty()) {
    const auto amp = query.find('&');
    const auto kv = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view{} : query.substr(amp + 1);
    const auto eq = kv.find('=');
    const auto k = kv.substr(0, eq);
    const std::string v = eq == std::string_view::npos ? std::string() : std::string(kv.substr(eq + 1));
    if (k == "tls")
      u.tls = v == "1" || v == "true";
    else if (k == "cacert")
      u.cacert = v;
    else if (k == "cert")
      u.cert = v;
    else if (k == "key")
      u.key = v;
    else if (k == "ttl") {
      if (v.empty() || v.size() > 6 || v.find_first_not_of("0123456789") != std::string::npos || std::stoi(v) < 5)
        return bad("ttl must be a number of seconds, at least 5");
      u.ttl_s = std::stoi(v);
    } else
      return bad("unknown option '" + std::string(k.substr(0, 32)) + "'");
  }
  if (!u.cacert.empty() || !u.cert.empty()) u.tls = true;
  return u;
}

inline std::string base64(std::string_view in) {
  static constexpr char t[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const unsigned v = (static_cast<unsigned char>(in[i]) << 16) | (static_cast<unsigned char>(in[i + 1]) << 8) |
                       static_cast<unsigned char>(in[i + 2]);
    out += {t[v >> 18], t[(v >> 12) & 63], t[(v >> 6) & 63], t[v & 63]};
  }
  if (i + 1 == in.size()) {
    const unsigned v = static_cast<unsigned char>(in[i]) << 16;
    out += {t[v >> 18], t[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == in.size()) {
    const unsigned v = (static_cast<unsigned char>(in[i]) << 16) | (static_cast<unsigned char>(in[i + 1]) << 8);
    out += {t[v >> 18], t[(v >> 12) & 63], t[(v >> 6) & 63], '='};
  }
  return out;
}
/// The bytes of `in`; nothing when it is not base64.
inline std::optional<std::string> unbase64(std::string_view in) {
  if (in.size() % 4 != 0) return std::nullopt;
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  out.reserve(in.size() / 4 * 3);
  for (std::size_t i = 0; i < in.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int j = 0; j < 4; ++j) {
      const char c = in[i + static_cast<std::size_t>(j)];
      if (c == '=' && i + 4 == in.size() && j >= 2) {
        v[j] = 0;
        ++pad;
      } else if (pad > 0 || (v[j] = val(c)) < 0) {
        return std::nullopt;
      }
    }
    const unsigned w = (static_cast<unsigned>(v[0]) << 18) | (static_cast<unsigned>(v[1]) << 12) |
                       (static_cast<unsigned>(v[2]) << 6) | static_cast<unsigned>(v[3]);
    out += static_cast<char>(w >> 16);
    if (pad < 2) out += static_cast<char>((w >> 8) & 255);
    if (pad < 1) out += static_cast<char>(w & 255);
  }
  return out;
}

/// The first key after every key that starts with `prefix` (etcd's range_end for a prefix).
inline std::string prefix_end(std::string prefix) {
  while (!prefix.empty()) {
    auto& c = prefix.back();
    if (static_cast<unsigned char>(c) < 0xff) {
      c = static_cast<char>(static_cast<unsigned char>(c) + 1);
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');
}

/// What one HTTP request to one member came to.
struct etcd_reply {
  enum class kind : std::uint8_t {
    ok,               ///< 200 and a JSON body
    unreachable,      ///< never sent (refused, no route, DNS): safe to send elsewhere
    unknown,          ///< sent, no answer (reset, timeout): it may have been applied
    busy,             ///< an answer that the member cannot serve now (no leader, leader changed, timed out)
    refused,          ///< an answer that no member will change (permission, bad request, too large)
    unauthenticated,  ///< the auth token expired or is missing: authenticate again
    lease_gone,       ///< the job's lease is gone (the job's keys with it)
  };
  kind k = kind::unreachable;
  nlohmann::json body;
  std::string text;  ///< what the member or libcurl said
};

/// Classifies a gateway's error body (gRPC status `code`, `message`).
inline etcd_reply::kind etcd_error_kind(long http, const nlohmann::json& body) {
  const int code = body.is_object() && body.contains("code") && body["code"].is_number() ? body["code"].get<int>() : -1;
  const std::string msg = body.is_object() && body.contains("message") && body["message"].is_string()
                              ? body["message"].get<std::string>()
                              : "";
  if (msg.find("lease not found") != std::string::npos) return etcd_reply::kind::lease_gone;
  if (code == 16 || msg.find("invalid auth token") != std::string::npos ||
      msg.find("user name is empty") != std::string::npos)
    return etcd_reply::kind::unauthenticated;
  if (code == 14 || code == 4 || code == 10 || code == 13 || http == 503 || http == 504 || http == 502)
    return etcd_reply::kind::busy;  // unavailable, deadline exceeded, aborted, internal
  return etcd_reply::kind::refused;
}

}  // namespace detail

/// The group's store on etcd (a kv_store backend). One connection (libcurl handle) to one member
/// at a time, moving on to the next member when one fails; calls take turns.
class etcd_store : public kv_store {
 public:
  /// Connects to the cluster `url` names for the job `job` (its keys' namespace), as `rank`;
  /// `ttl`: the job lease's time to live. Retries until `until` (the cluster may start after
  /// us); errc::timeout naming every endpoint and the last error when none answered.
  etcd_store(const std::string& url, const std::string& job, int rank, deadline_t until,
             std::shared_ptr<const authenticator> auth = nullptr, std::chrono::seconds ttl = std::chrono::seconds(60))
      : kv_store(rank, std::move(auth)), url_(detail::parse_etcd_url(url, rank)) {
    static std::once_flag curl_once;
    std::call_once(curl_once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
    if (job.empty() || job.size() > 200 || job.find('/') != std::string::npos)
      detail::raise(errc::invalid_argument, rank,
                    "etcd store: the job id '" + job.substr(0, 64) +
                        "' must be 1 to 200 characters without '/' (it names the job's keys)");
    ns_ = url_.prefix + "/" + job + "/";
    ttl_ = url_.ttl_s > 0 ? std::chrono::seconds(url_.ttl_s) : ttl;
    std::random_device rd;
    uid_ = std::to_string(::getpid()) + "." + std::to_string(rd()) + std::to_string(rd());
    main_ = std::make_unique<conn>();
    // The job's lease: granted by the first process of the job, found by the others.
    lease_ = join_lease(until);
    keeper_ = std::thread([this] { keep_alive(); });
  }
  ~etcd_store() override {
    if (owner_.forked()) {  // a forked child: the thread is the parent's
      keeper_.detach();
      return;
    }
    {
      std::lock_guard lk(keep_mu_);
      stop_ = true;
    }
    keep_cv_.notify_all();
    if (keeper_.joinable()) keeper_.join();
  }

  bool unusable() const noexcept override { return broken_.failed(); }
  sockaddr_storage local_address() const override {
    sockaddr_storage a{};
    std::lock_guard lk(addr_mu_);
    auto* v4 = reinterpret_cast<sockaddr_in*>(&a);
    auto* v6 = reinterpret_cast<sockaddr_in6*>(&a);
    if (::inet_pton(AF_INET, local_ip_.c_str(), &v4->sin_addr) == 1)
      v4->sin_family = AF_INET;
    else if (::inet_pton(AF_INET6, local_ip_.c_str(), &v6->sin6_addr) == 1)
      v6->sin6_family = AF_INET6;
    else {
      v4->sin_family = AF_INET;
      v4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    }
    return a;
  }
  std::string where() const override { return "the group's store on " + url_.shown() + " (job keys " + ns_ + ")"; }
  /// The job's key namespace ("/ddp/<job>/").
  const std::string& key_space() const noexcept { return ns_; }
  /// The job lease's id (hex), for tools and tests.
  std::int64_t lease() const noexcept { return lease_; }
  /// The member that answered last ("host:port").
  std::string member() const {
    return url_.endpoints[static_cast<std::size_t>(current_.load()) % url_.endpoints.size()];
  }

 protected:
  void do_set(const std::string& key, std::string_view value, deadline_t until) override {
    check_value(key, value);
    (void)request("/v3/kv/put", {{"key", k64(key)}, {"value", detail::base64(value)}, {"lease", lease_str()}}, until,
                  key);
  }

  /// A look; while the key is absent and the wait allows, a watch from the revision of that look
  /// (etcd pushes the key's creation the moment it is committed: no polling), then a look again.
  std::optional<std::string> do_try_get(const std::string& key, std::optional<std::chrono::milliseconds> wait,
                                        deadline_t until) override {
    const auto stop = wait ? std::min(until, steady_clock::now() + *wait) : until;
    for (;;) {
      auto r = request("/v3/kv/range", {{"key", k64(key)}}, until, key);
      if (auto v = first_value(r, key)) return v;
      if (steady_clock::now() >= stop) return std::nullopt;
      const auto rev = r.contains("header") ? int_field(r["header"], "revision") : 0;
      if (auto v = watch_for(key, rev + 1, stop)) return v;
    }
  }

  /// A counter is the set of its contributions, `<key>/+/<connection>.<op>` each holding its
  /// delta (kv_store: counters are read and written through add alone). One transaction puts
  /// this call's contribution and reads them all at that revision: the sum is the counter's
  /// value right after this add, exactly as a serial counter would answer it. No compare, so no
  /// retry when several ranks add at once (the per-step vote: one write per rank), and a copy of
  /// the request sent again, or applied late, puts the same key with the same delta: it counts
  /// once.
  std::int64_t do_add(const std::string& key, std::int64_t delta, deadline_t until) override {
    const std::string part = key + "/+/";
    const std::string mine = part + uid_ + "." + std::to_string(++ops_);
    nlohmann::json txn = {
        {"success",
         nlohmann::json::array(
             {{{"request_put",
                {{"key", k64(mine)}, {"value", detail::base64(detail::encode_i64(delta))}, {"lease", lease_str()}}}},
              {{"request_range", {{"key", k64(part)}, {"range_end", k64end(part)}}}}})}};
    auto r = request("/v3/kv/txn", txn, until, key);
    const auto* range = r.contains("responses") && r["responses"].is_array() && r["responses"].size() == 2 &&
                                r["responses"][1].contains("response_range")
                            ? &r["responses"][1]["response_range"]
                            : nullptr;
    if (range == nullptr) malformed(key, "a transaction answer without the counter's contributions");
    if (int_field(*range, "count") > max_contributions)
      malformed(key, "a counter of " + std::to_string(int_field(*range, "count")) + " contributions (at most " +
                         std::to_string(max_contributions) + ")");
    std::int64_t sum = 0;
    bool seen_mine = false;
    const std::string stored_mine = ns_ + "k/" + mine;
    if (range->contains("kvs") && (*range)["kvs"].is_array())
      for (const auto& kv : (*range)["kvs"]) {
        sum += counter_of(kv, key);
        if (kv.contains("key") && kv["key"].is_string() &&
            detail::unbase64(kv["key"].get<std::string>()) == stored_mine)
          seen_mine = true;
      }
    if (!seen_mine) malformed(key, "a counter that does not hold the contribution just added");
    return sum;
  }

  std::string do_compare_set(const std::string& key, std::string_view expected, std::string_view desired,
                             deadline_t until) override {
    check_value(key, desired);
    nlohmann::json cmp =
        expected.empty()
            ? nlohmann::json{{"key", k64(key)}, {"target", "VERSION"}, {"result", "EQUAL"}, {"version", "0"}}
            : nlohmann::json{
                  {"key", k64(key)}, {"target", "VALUE"}, {"result", "EQUAL"}, {"value", detail::base64(expected)}};
    nlohmann::json txn = {
        {"compare", nlohmann::json::array({cmp})},
        {"success",
         nlohmann::json::array(
             {{{"request_put", {{"key", k64(key)}, {"value", detail::base64(desired)}, {"lease", lease_str()}}}}})},
        {"failure", nlohmann::json::array({{{"request_range", {{"key", k64(key)}}}}})}};
    // A retry after an answer that never came is safe: the value after the call is what it says.
    auto r = request("/v3/kv/txn", txn, until, key);
    if (r.value("succeeded", false)) return std::string(desired);
    const auto* kv = range_kv_of_txn(r);
    return kv == nullptr ? std::string() : value_of(*kv, key);
  }

  bool do_erase(const std::string& key, deadline_t until) override {
    auto r = request("/v3/kv/deleterange", {{"key", k64(key)}}, until, key);
    return int_field(r, "deleted") > 0;
  }

  std::size_t do_erase_prefix(const std::string& prefix, deadline_t until) override {
    auto r = request("/v3/kv/deleterange", {{"key", k64(prefix)}, {"range_end", k64end(prefix)}}, until, prefix);
    return static_cast<std::size_t>(int_field(r, "deleted"));
  }

  bool do_check(const std::string& key, deadline_t until) override {
    auto r = request("/v3/kv/range", {{"key", k64(key)}, {"count_only", true}}, until, key);
    return int_field(r, "count") > 0;
  }

  std::vector<std::string> do_wait(const std::vector<std::string>& keys, std::optional<std::chrono::milliseconds> wait,
                                   deadline_t until) override {
    const auto stop = wait ? std::min(until, steady_clock::now() + *wait) : until;
    std::vector<std::string> missing = keys;
    for (auto pause = std::chrono::microseconds(1000);; pause = std::min(pause * 2, max_poll)) {
      missing = still_missing(missing, until);
      if (missing.empty()) return {};
      const auto now = steady_clock::now();
      if (now >= stop) return missing;
      std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(pause, stop - now));
    }
  }

 private:
  static constexpr auto max_poll = std::chrono::microseconds(8000);
  /// A counter's contributions (adds) at most: ddp's counters count ranks (votes, arrivals,
  /// readers of a failure).
  static constexpr std::int64_t max_contributions = 1 << 21;
  /// etcd refuses requests over 1.5 MiB by default: values stay well under it.
  static constexpr std::size_t max_value = 1u << 20;

  struct conn {
    CURL* h = curl_easy_init();
    curl_slist* headers = nullptr;
    std::string token;  // the auth token (user and password)
    conn() = default;
    conn(const conn&) = delete;
    conn& operator=(const conn&) = delete;
    ~conn() {
      if (headers != nullptr) curl_slist_free_all(headers);
      if (h != nullptr) curl_easy_cleanup(h);
    }
  };

  // The job's keys: "<prefix>/<job>/k/<key>"; the store's own (the lease's name, the operation
  // marks): "<prefix>/<job>/i/...", out of reach of erase_prefix.
  std::string k64(const std::string& key) const { return detail::base64(ns_ + "k/" + key); }
  std::string k64end(const std::string& key) const { return detail::base64(detail::prefix_end(ns_ + "k/" + key)); }
  std::string i64(const std::string& key) const { return detail::base64(ns_ + "i/" + key); }
  std::string lease_str() const { return std::to_string(lease_); }

  void check_value(const std::string& key, std::string_view value) const {
    if (value.size() > max_value)
      detail::raise(errc::invalid_argument, rank_,
                    "store value for key '" + shown_key(key) + "' is " + std::to_string(value.size()) + " bytes; " +
                        url_.shown() + " takes at most " + std::to_string(max_value) +
                        " (the store is for small metadata; send bulk data through a collective)");
  }
  static std::string shown_key(const std::string& key) { return key.substr(0, 96); }

  static std::int64_t int_field(const nlohmann::json& j, const char* name) {
    if (!j.is_object() || !j.contains(name)) return 0;  // proto3 JSON leaves zeros out
    const auto& v = j[name];
    if (v.is_number_integer()) return v.get<std::int64_t>();
    if (v.is_string()) try {
        return std::stoll(v.get<std::string>());
      } catch (...) {
      }
    return 0;
  }
  /// The range result inside a failed transaction's answer, or null when the key is absent.
  static const nlohmann::json* range_kv_of_txn(const nlohmann::json& r) {
    if (!r.contains("responses") || !r["responses"].is_array() || r["responses"].empty()) return nullptr;
    const auto& rr = r["responses"][0];
    if (!rr.contains("response_range")) return nullptr;
    const auto& range = rr["response_range"];
    if (!range.contains("kvs") || !range["kvs"].is_array() || range["kvs"].empty()) return nullptr;
    return &range["kvs"][0];
  }
  std::string value_of(const nlohmann::json& kv, const std::string& key) const {
    if (!kv.contains("value")) return {};
    if (!kv["value"].is_string()) malformed(key, "a value that is not a string");
    auto v = detail::unbase64(kv["value"].get<std::string>());
    if (!v) malformed(key, "a value that is not base64");
    return std::move(*v);
  }
  std::optional<std::string> first_value(const nlohmann::json& r, const std::string& key) const {
    if (!r.contains("kvs") || !r["kvs"].is_array() || r["kvs"].empty()) return std::nullopt;
    return value_of(r["kvs"][0], key);
  }
  std::int64_t counter_of(const nlohmann::json& kv, const std::string& key) const {
    const auto v = value_of(kv, key);
    if (v.size() != 8)
      detail::raise(errc::protocol, rank_,
                    url_.shown() + ": key '" + shown_key(key) + "' holds " + std::to_string(v.size()) +
                        " bytes, not a counter (8): another program, or another job, writes under this job's keys");
    return detail::decode_i64(v);
  }
  std::int64_t parse_i64(const std::string& s, const std::string& key) const {
    try {
      std::size_t used = 0;
      const auto v = std::stoll(s, &used);
      if (used == s.size()) return v;
    } catch (...) {
    }
    malformed(key, "a malformed operation mark '" + s.substr(0, 32) + "'");
  }
  [[noreturn]] void malformed(const std::string& key, const std::string& what) const {
    detail::raise(errc::protocol, rank_,
                  url_.shown() + " (member " + member() + ") answered key '" + shown_key(key) + "' with " + what +
                      ": another program writes under this job's keys, or this is not etcd");
  }

  /// What a watch saw: the key's value once it was put, or why it ended.
  struct watch_state {
    std::string buf;
    std::optional<std::string> value;
    std::string error;
  };
  static std::size_t on_watch(char* p, std::size_t size, std::size_t n, void* data) {
    auto& w = *static_cast<watch_state*>(data);
    w.buf.append(p, size * n);
    for (std::size_t nl; (nl = w.buf.find('\n')) != std::string::npos;) {
      const auto j = nlohmann::json::parse(w.buf.substr(0, nl), nullptr, false);
      w.buf.erase(0, nl + 1);
      if (j.is_discarded() || !j.is_object() || j.contains("error")) {
        w.error = j.is_object() && j.contains("error") ? j["error"].dump() : "a watch message that is not JSON";
        return 0;
      }
      const auto& res = j.contains("result") ? j["result"] : j;
      if (res.value("canceled", false)) {
        w.error = "the watch was canceled: " + res.value("cancel_reason", std::string());
        return 0;
      }
      if (!res.contains("events") || !res["events"].is_array()) continue;
      for (const auto& ev : res["events"])
        if (ev.value("type", std::string("PUT")) == "PUT" && ev.contains("kv")) {
          const auto& kv = ev["kv"];
          w.value = kv.contains("value") && kv["value"].is_string() ? detail::unbase64(kv["value"].get<std::string>())
                                                                    : std::optional<std::string>(std::string());
          if (!w.value) w.error = "a watched value that is not base64";
          return 0;  // seen: end the transfer
        }
    }
    return w.buf.size() > (1u << 20) ? 0 : size * n;
  }
  /// Watches `key` from revision `from` until `stop`: its value once put, or nothing (the time
  /// is up, or the watch failed: the caller looks again). On a connection of its own, so that
  /// the group's requests never wait behind it; a second waiter in this process at the same
  /// moment polls instead.
  std::optional<std::string> watch_for(const std::string& key, std::int64_t from, deadline_t stop) {
    std::unique_lock lk(watch_mu_, std::try_to_lock);
    if (!lk.owns_lock()) {
      std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(max_poll, stop - steady_clock::now()));
      return std::nullopt;
    }
    if (!watch_) watch_ = std::make_unique<conn>();
    watch_state w;
    const std::string payload =
        nlohmann::json{{"create_request", {{"key", k64(key)}, {"start_revision", std::to_string(from)}}}}.dump();
    const int at = current_.load();
    const std::string& ep = url_.endpoints[static_cast<std::size_t>(at) % url_.endpoints.size()];
    auto r = post(*watch_, ep, "/v3/watch", payload, stop, &etcd_store::on_watch, &w);
    if (w.value) return w.value;
    if (r.k == detail::etcd_reply::kind::busy) return std::nullopt;              // the time is up
    if (w.error.find("auth token") != std::string::npos) watch_->token.clear();  // expired: a new one next time
    // The member failed the watch (or sent what it should not): a moment, then the next look
    // (its request moves on to another member if this one is gone).
    if (w.error.empty() && r.k == detail::etcd_reply::kind::unknown) {
      int expected = at;
      current_.compare_exchange_strong(expected, at + 1);
    }
    std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(max_poll, stop - steady_clock::now()));
    return std::nullopt;
  }

  /// The keys of `keys` that do not exist now: one range over their common prefix when there
  /// are several, else one look each.
  std::vector<std::string> still_missing(const std::vector<std::string>& keys, deadline_t until) {
    std::vector<std::string> out;
    if (keys.size() > 1) {
      std::string common = keys[0];
      for (const auto& k : keys) {
        std::size_t i = 0;
        while (i < common.size() && i < k.size() && common[i] == k[i]) ++i;
        common.resize(i);
      }
      if (!common.empty()) {
        auto r = request("/v3/kv/range",
                         {{"key", k64(common)}, {"range_end", k64end(common)}, {"keys_only", true}, {"limit", 100000}},
                         until, common);
        const std::string stored = ns_ + "k/";
        std::vector<std::string> present;
        if (r.contains("kvs") && r["kvs"].is_array())
          for (const auto& kv : r["kvs"])
            if (kv.contains("key") && kv["key"].is_string())
              if (auto k = detail::unbase64(kv["key"].get<std::string>()); k && k->starts_with(stored))
                present.push_back(k->substr(stored.size()));
        std::sort(present.begin(), present.end());
        for (const auto& k : keys)
          if (!std::binary_search(present.begin(), present.end(), k)) out.push_back(k);
        return out;
      }
    }
    for (const auto& k : keys)
      if (!do_check(k, until)) out.push_back(k);
    return out;
  }

  /// The job's lease: the one `<ns>__lease` names (it vanishes with the lease), or a new one
  /// granted here and named there by the first process of the job.
  std::int64_t join_lease(deadline_t until) {
    const std::string key = "lease";
    for (int tries = 0;; ++tries) {
      auto have = request("/v3/kv/range", {{"key", i64(key)}}, until, key);
      if (auto v = first_value(have, key)) {
        lease_ = parse_i64(*v, key);
        // It may have expired between the look and now: then a fresh one (its key went with it).
        auto ttl = request("/v3/lease/timetolive", nlohmann::json{{"ID", *v}}, until, key);
        if (int_field(ttl, "TTL") > 0) return lease_;
      }
      auto g = request("/v3/lease/grant", {{"TTL", std::to_string(ttl_.count())}}, until, key);
      const std::int64_t id = int_field(g, "ID");
      if (id == 0) malformed(key, "a lease grant without an ID");
      nlohmann::json txn = {
          {"compare",
           nlohmann::json::array({{{"key", i64(key)}, {"target", "VERSION"}, {"result", "EQUAL"}, {"version", "0"}}})},
          {"success", nlohmann::json::array({{{"request_put",
                                               {{"key", i64(key)},
                                                {"value", detail::base64(std::to_string(id))},
                                                {"lease", std::to_string(id)}}}}})},
          {"failure", nlohmann::json::array({{{"request_range", {{"key", i64(key)}}}}})}};
      auto r = request("/v3/kv/txn", txn, until, key);
      if (r.value("succeeded", false)) return id;
      (void)request("/v3/lease/revoke", {{"ID", std::to_string(id)}}, until, key);
      if (tries > 8) malformed(key, "a lease that keeps vanishing");
    }
  }

  /// Keeps the job's lease alive (a third of its time to live apart) on a connection of its own;
  /// a lease found gone makes the store unusable with the reason.
  void keep_alive() {
    conn c;
    const auto every = std::max<std::chrono::milliseconds>(ttl_ / 3, std::chrono::milliseconds(500));
    std::unique_lock lk(keep_mu_);
    while (!keep_cv_.wait_for(lk, every, [&] { return stop_; })) {
      lk.unlock();
      try {
        // Bounded apart from the period, so that a store closing while the cluster is down waits
        // seconds, not a period: two misses in a row still leave the lease a third of its time.
        const auto until = steady_clock::now() + std::min<std::chrono::milliseconds>(every, std::chrono::seconds(2));
        auto r = exchange(c, "/v3/lease/keepalive", {{"ID", lease_str()}}, until, "lease");
        const auto& res = r.contains("result") ? r["result"] : r;
        if (int_field(res, "TTL") <= 0)  // a live lease has time left
          broken_.set(errc::peer_lost, url_.shown() + ": the job's lease " + lease_str() +
                                           " expired: every key of the job (" + ns_ +
                                           ") is gone with it (the cluster lost it, or no process kept it for " +
                                           std::to_string(ttl_.count()) + " s)");
      } catch (const std::exception&) {
        // The request's own failure: the next round tries again (the calls see the cluster's state).
      }
      lk.lock();
    }
  }

  nlohmann::json request(const char* path, const nlohmann::json& body, deadline_t until, const std::string& key) {
    owner_.check(rank_, "etcd_store");
    std::unique_lock lk(turn_, std::defer_lock);
    while (!lk.try_lock()) {
      if (steady_clock::now() >= until)
        detail::raise(errc::timeout, rank_,
                      "store request timed out waiting for its turn on the connection to " + url_.shown() +
                          " (another thread's request held it)");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    broken_.check(rank_, "the connection to " + url_.shown() + " is unusable: ");
    return exchange(*main_, path, body, until, key);
  }

  /// One request, sent to member after member until one answers it (or the deadline passes).
  /// Sends `body` to `path`; on a member that fails, the next, until one answers or the
  /// deadline passes. Every request of this store may be sent again: set, erase and ranges are
  /// idempotent, compare_set answers the value after it, and add guards itself (do_add).
  nlohmann::json exchange(conn& c, const char* path, const nlohmann::json& body, deadline_t until,
                          const std::string& key) {
    const std::string payload = body.dump();
    std::string last;
    int tries = 0;
    bool authed_again = false;
    for (auto pause = std::chrono::milliseconds(5);; pause = std::min(pause * 2, std::chrono::milliseconds(200))) {
      const auto now = steady_clock::now();
      if (now >= until && tries > 0)
        detail::raise(errc::timeout, rank_,
                      url_.shown() + " did not answer a request on key '" + shown_key(key) + "' before the deadline (" +
                          std::to_string(tries) + " tries over its " + std::to_string(url_.endpoints.size()) +
                          " members; is the cluster down or without quorum?): last error: " + last);
      const int at = current_.load();
      const std::string& ep = url_.endpoints[static_cast<std::size_t>(at) % url_.endpoints.size()];
      ++tries;
      auto r = post(c, ep, path, payload, until);
      using kind = detail::etcd_reply::kind;
      if (r.k == kind::ok) {
        if (&c == main_.get()) {
          char* ip = nullptr;
          if (curl_easy_getinfo(c.h, CURLINFO_LOCAL_IP, &ip) == CURLE_OK && ip != nullptr) {
            std::lock_guard lk(addr_mu_);
            local_ip_ = ip;
          }
        }
        return std::move(r.body);
      }
      last = ep + ": " + r.text;
      if (r.k == kind::refused)
        detail::raise(
            r.text.find("permission denied") != std::string::npos ? errc::auth_failed : errc::invalid_argument, rank_,
            url_.shown() + " (member " + ep + ") refused a request on key '" + shown_key(key) + "': " + r.text +
                (r.text.find("permission denied") != std::string::npos
                     ? " (the user needs read and write on the prefix " + url_.prefix + "/)"
                     : std::string()));
      if (r.k == kind::lease_gone) {
        broken_.set(errc::peer_lost, url_.shown() + ": the job's lease " + lease_str() +
                                         " is gone, and every key of the job (" + ns_ + ") with it");
        broken_.check(rank_, "");
      }
      if (r.k == kind::unauthenticated) {
        if (url_.user.empty() || authed_again)
          detail::raise(errc::auth_failed, rank_,
                        url_.shown() + " (member " + ep + ") requires authentication: " + r.text +
                            (url_.user.empty() ? " (give etcd://user:password@... in DDP_STORE)" : std::string()));
        authed_again = true;
        authenticate(c, ep, until);
        continue;
      }
      // unreachable, busy, or unknown: the next member, a moment later.
      int expected = at;
      current_.compare_exchange_strong(expected, at + 1);
      if (static_cast<std::size_t>(tries) % url_.endpoints.size() == 0) {
        const auto left = until - steady_clock::now();
        if (left > std::chrono::nanoseconds(0))
          std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(pause, left));
      }
    }
  }

  void authenticate(conn& c, const std::string& ep, deadline_t until) {
    c.token.clear();
    const std::string payload = nlohmann::json{{"name", url_.user}, {"password", url_.password}}.dump();
    auto r = post(c, ep, "/v3/auth/authenticate", payload, until);
    if (r.k != detail::etcd_reply::kind::ok || !r.body.contains("token") || !r.body["token"].is_string())
      detail::raise(errc::auth_failed, rank_,
                    url_.shown() + " (member " + ep + ") refused user '" + url_.user +
                        "': " + (r.text.empty() ? std::string("no token in its answer") : r.text));
    c.token = r.body["token"].get<std::string>();
  }

  static std::size_t on_body(char* p, std::size_t size, std::size_t n, void* out) {
    auto* s = static_cast<std::string*>(out);
    if (s->size() + size * n > (8u << 20)) return 0;  // no answer of ours is this large
    s->append(p, size * n);
    return size * n;
  }

  /// One HTTP POST to one member, bounded by `until` (and 2 s, so that a member that hangs
  /// leaves time for the others).
  /// With `stream`, the answer goes to it as it comes (a watch), bounded by `until` alone; the
  /// sink ends the transfer by taking fewer bytes than it was given.
  using sink = std::size_t (*)(char*, std::size_t, std::size_t, void*);
  detail::etcd_reply post(conn& c, const std::string& ep, const char* path, const std::string& payload,
                          deadline_t until, sink stream = nullptr, void* stream_data = nullptr) {
    detail::etcd_reply r;
    if (c.h == nullptr) {
      r.text = "libcurl could not make a handle";
      return r;
    }
    if (url_.user.size() && c.token.empty() && std::string_view(path) != "/v3/auth/authenticate") {
      authenticate(c, ep, until);
    }
    const std::string url = std::string(url_.tls ? "https://" : "http://") + ep + path;
    std::string body;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - steady_clock::now()).count();
    // Never 0, which libcurl reads as "no limit": a watch whose time is up takes 1 ms.
    const long ms = static_cast<long>(stream ? std::max<long long>(left, 1) : std::clamp<long long>(left, 50, 2000));
    curl_easy_setopt(c.h, CURLOPT_URL, url.c_str());
    curl_easy_setopt(c.h, CURLOPT_POST, 1L);
    curl_easy_setopt(c.h, CURLOPT_POSTFIELDS, payload.data());
    curl_easy_setopt(c.h, CURLOPT_POSTFIELDSIZE, static_cast<long>(payload.size()));
    curl_easy_setopt(c.h, CURLOPT_WRITEFUNCTION, stream ? stream : &etcd_store::on_body);
    curl_easy_setopt(c.h, CURLOPT_WRITEDATA, stream ? stream_data : &body);
    curl_easy_setopt(c.h, CURLOPT_TIMEOUT_MS, ms);
    curl_easy_setopt(c.h, CURLOPT_CONNECTTIMEOUT_MS, std::min<long>(ms, 1000));
    curl_easy_setopt(c.h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c.h, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(c.h, CURLOPT_PROTOCOLS_STR, url_.tls ? "https" : "http");
    if (url_.tls) {
      if (!url_.cacert.empty()) curl_easy_setopt(c.h, CURLOPT_CAINFO, url_.cacert.c_str());
      if (!url_.cert.empty()) curl_easy_setopt(c.h, CURLOPT_SSLCERT, url_.cert.c_str());
      if (!url_.key.empty()) curl_easy_setopt(c.h, CURLOPT_SSLKEY, url_.key.c_str());
    }
    if (c.headers != nullptr) {
      curl_slist_free_all(c.headers);
      c.headers = nullptr;
    }
    c.headers = curl_slist_append(c.headers, "Content-Type: application/json");
    if (!c.token.empty()) c.headers = curl_slist_append(c.headers, ("Authorization: " + c.token).c_str());
    curl_easy_setopt(c.h, CURLOPT_HTTPHEADER, c.headers);
    const CURLcode rc = curl_easy_perform(c.h);
    if (stream != nullptr) {  // the sink has what came; say only how it ended
      r.k = rc == CURLE_OK || rc == CURLE_WRITE_ERROR ? detail::etcd_reply::kind::ok
            : rc == CURLE_OPERATION_TIMEDOUT          ? detail::etcd_reply::kind::busy
                                                      : detail::etcd_reply::kind::unknown;
      r.text = curl_easy_strerror(rc);
      return r;
    }
    if (rc != CURLE_OK) {
      using kind = detail::etcd_reply::kind;
      // Never sent: safe to send elsewhere. Anything later may have reached the member.
      r.k = (rc == CURLE_COULDNT_CONNECT || rc == CURLE_COULDNT_RESOLVE_HOST || rc == CURLE_SSL_CONNECT_ERROR ||
             (rc == CURLE_OPERATION_TIMEDOUT && !curl_connected(c)))
                ? kind::unreachable
                : kind::unknown;
      r.text = curl_easy_strerror(rc);
      return r;
    }
    long http = 0;
    curl_easy_getinfo(c.h, CURLINFO_RESPONSE_CODE, &http);
    r.body = nlohmann::json::parse(body, nullptr, false);
    if (r.body.is_discarded()) {
      r.k = detail::etcd_reply::kind::busy;
      r.text = "HTTP " + std::to_string(http) + " with a body that is not JSON ('" + body.substr(0, 64) +
               "'): is this etcd's client port?";
      if (http == 200) r.k = detail::etcd_reply::kind::refused;
      return r;
    }
    if (http == 200 && !(r.body.is_object() && r.body.contains("error"))) {
      r.k = detail::etcd_reply::kind::ok;
      return r;
    }
    r.k = detail::etcd_error_kind(http, r.body);
    r.text = "HTTP " + std::to_string(http) + ": " +
             (r.body.is_object() && r.body.contains("message") ? r.body["message"].dump() : body.substr(0, 200));
    return r;
  }
  static bool curl_connected(conn& c) {
    double t = 0;
    curl_easy_getinfo(c.h, CURLINFO_CONNECT_TIME, &t);
    return t > 0;
  }

  detail::etcd_url url_;
  std::string ns_;  ///< the job's key space: "<prefix>/<job>/"
  std::chrono::seconds ttl_{60};
  std::string uid_;  ///< this connection's name in its operation marks
  std::uint64_t ops_ = 0;
  std::int64_t lease_ = 0;
  std::unique_ptr<conn> main_;
  std::unique_ptr<conn> watch_;  ///< watches (do_try_get), one at a time
  std::mutex watch_mu_;
  std::mutex turn_;  ///< one request at a time on main_
  std::atomic<int> current_{0};
  mutable std::mutex addr_mu_;
  std::string local_ip_;
  detail::first_failure broken_;
  detail::owner_process owner_;
  std::mutex keep_mu_;
  std::condition_variable keep_cv_;
  bool stop_ = false;
  std::thread keeper_;
};

namespace detail {
/// Registers the "etcd" scheme: DDP_STORE=etcd://... opens an etcd_store for the job
/// (init_options::job_id, "default" without one), its lease living 3 timeouts (at least 60 s).
inline const bool etcd_registered = register_store_backend(
    "etcd",
    [](const std::string& url, const init_options& o, std::shared_ptr<const authenticator> auth,
       deadline_t until) -> std::unique_ptr<kv_store> {
      const auto ttl = std::max<std::chrono::seconds>(std::chrono::seconds(60),
                                                      std::chrono::duration_cast<std::chrono::seconds>(3 * o.timeout));
      return std::make_unique<etcd_store>(url, o.job_id.empty() ? std::string("default") : o.job_id, o.rank, until,
                                          std::move(auth), ttl);
    });
}  // namespace detail

}  // namespace DDP_ABI
}  // namespace ddp
