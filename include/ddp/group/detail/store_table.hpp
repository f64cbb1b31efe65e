#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The store's table: its keys and values, the limit on what they hold, who may write, and the
// get/wait requests parked until their keys exist or their time is up. No socket and no thread:
// the server (group/store_server.hpp) keeps the connections, reads each request, hands it here
// with the connection's number (its `owner`) and sends the answers the table makes. Tested in
// one process (tests/unit/test_store_table.cpp).
//
//   store_table t(0, max_bytes, "pg/rank/");
//   auto said = [&](std::uint64_t owner, store_status st, const std::vector<std::string_view>& fields) { ... };
//   t.execute(owner, member, std::move(request), now, said);   // answered, claimed, parked or overflow
//   t.wake(is_member, said);                                    // after writes: parked requests served
//   t.expire(now, said);                                        // parked requests whose time is up
//   t.forget(owner);                                            // a connection closed

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ddp/clock.hpp>
#include <ddp/detail/bytes.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/group/detail/store_protocol.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

class store_table {
 public:
  /// What a request came to.
  enum class outcome : std::uint8_t {
    answered,  ///< answered at once
    claimed,   ///< answered, and it took a seat: its connection is a member from now on
    parked,    ///< a get/wait whose keys are missing: answered by wake() or expire()
    overflow,  ///< a get/wait past store_max_waiting parked for its owner: nothing done, drop it
  };

  /// Entries count their key, their value and this many bytes each (what a tiny entry costs).
  static constexpr std::size_t entry_overhead = 160;
  /// A parked request counts this many bytes, plus its fields and 64 bytes for each.
  static constexpr std::size_t waiter_overhead = 256;

  /// `rank`: who serves the table (for messages). `max_bytes`: what entries may hold in all.
  /// With a `member_prefix`, only connections that claimed a seat (compare_set from the empty
  /// value of a key under it; with `members` > 0, a number below it) may write.
  store_table(int rank, std::size_t max_bytes, std::string member_prefix = {}, std::uint32_t members = 0)
      : rank_(rank), max_bytes_(max_bytes), member_prefix_(std::move(member_prefix)), members_(members) {}

  /// Runs request `f` (valid_request(f) holds) of connection `owner` (`member`: it holds a
  /// seat) and answers it through `said(owner, status, fields)`, or parks it (a get/wait on a
  /// missing key) until wake() or expire() answers it. The fields are valid during the call.
  template <class Said>
  outcome execute(std::uint64_t owner, bool member, frame f, deadline_t now, Said&& said) {
    bool claimed = false;
    if (run(owner, member, f, said, claimed)) return claimed ? outcome::claimed : outcome::answered;
    auto& o = owners_[owner];
    if (o.parked.size() >= store_max_waiting) return outcome::overflow;
    park(owner, o, std::move(f), now);
    return outcome::parked;
  }

  /// Serves the requests parked on keys written since the last call: each either completes
  /// (answered through `said`) or moves on to its next missing key. Those of members
  /// (`is_member(owner)`) first: when answers are large and memory is short, strangers go without.
  template <class IsMember, class Said>
  void wake(IsMember&& is_member, Said&& said) {
    for (std::size_t i = 0; i < pending_wakes_.size(); ++i) {
      auto [b, e] = watch_.equal_range(pending_wakes_[i]);
      std::vector<std::uint64_t> ids;
      for (auto it = b; it != e; ++it) ids.push_back(it->second);
      std::stable_partition(ids.begin(), ids.end(), [&](std::uint64_t id) { return is_member(waiters_.at(id).owner); });
      for (auto id : ids) {
        auto& w = waiters_.at(id);
        const std::size_t next = first_missing(w.req, w.cursor);
        if (next < waited_keys(w.req)) {
          if (next != w.cursor) {
            watch_.erase(w.watch);
            w.cursor = next;
            w.watch = watch_.emplace(w.req.fields[next], id);
          }
          continue;
        }
        bool claimed = false;
        const auto owner = w.owner;
        const frame req = std::move(w.req);
        unpark(id);
        [[maybe_unused]] const bool done = run(owner, true, req, said, claimed);
      }
    }
    pending_wakes_.clear();
  }

  /// Answers the parked requests whose time is up by `now` with `timeout` and the keys still
  /// missing (so that callers can name absent ranks).
  template <class Said>
  void expire(deadline_t now, Said&& said) {
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      const auto id = deadlines_.begin()->second;
      auto& w = waiters_.at(id);
      const auto owner = w.owner;
      const frame req = std::move(w.req);
      unpark(id);
      std::vector<std::string_view> missing;
      for (std::size_t i = 0; i < waited_keys(req); ++i)
        if (!data_.count(req.fields[i])) missing.push_back(req.fields[i]);
      said(owner, store_status::timeout, missing);
    }
  }

  /// Drops what connection `owner` has parked (it closed).
  void forget(std::uint64_t owner) {
    auto it = owners_.find(owner);
    if (it == owners_.end()) return;
    while (!it->second.parked.empty()) unpark(it->second.parked.back());
    owners_.erase(owner);
  }

  /// Requests `owner` has parked now, and the bytes they count.
  std::size_t parked(std::uint64_t owner) const {
    auto it = owners_.find(owner);
    return it == owners_.end() ? 0 : it->second.parked.size();
  }
  std::size_t parked_bytes(std::uint64_t owner) const {
    auto it = owners_.find(owner);
    return it == owners_.end() ? 0 : it->second.bytes;
  }
  /// When the next parked request times out.
  std::optional<deadline_t> next_deadline() const {
    if (deadlines_.empty()) return std::nullopt;
    return deadlines_.begin()->first;
  }
  /// Bytes counted against max_bytes now (any thread may ask).
  std::size_t stored_bytes() const noexcept { return stored_.load(); }
  /// The value of `key`, or nullptr.
  const std::string* find(std::string_view key) const {
    auto it = data_.find(key);
    return it == data_.end() ? nullptr : &it->second;
  }
  std::size_t size() const noexcept { return data_.size(); }

 private:
  struct waiter {
    std::uint64_t owner;
    frame req;
    std::size_t cursor = 0;  // the key it is registered on
    std::size_t bytes = 0;
    std::multimap<std::string, std::uint64_t, std::less<>>::iterator watch;
    std::multimap<deadline_t, std::uint64_t>::iterator timer;
  };
  struct owner_rec {
    std::vector<std::uint64_t> parked;  // ids of its parked requests
    std::size_t bytes = 0;
  };

  /// Executes a request; false when it must wait (get/wait on missing keys).
  template <class Said>
  bool run(std::uint64_t owner, bool member, const frame& f, Said& said, bool& claimed) {
    const auto& k = f.fields[0];
    const bool claim = is_claim(f, member_prefix_, members_);
    if (!member_prefix_.empty() && !member && is_write(f.code) && !claim) {
      static constexpr const char* names[] = {"", "set", "get", "add", "compare_set", "erase", "check", "wait"};
      const std::string why = "the store of rank " + std::to_string(rank_) + " refused to " + names[f.code] + " key '" +
                              k.substr(0, 64) +
                              "': this connection has not joined the group (only a connection that claimed a rank, "
                              "with compare_set of '" +
                              member_prefix_ + "<rank>', may write)";
      said(owner, store_status::forbidden, {why});
      return true;
    }
    const auto ok = [&](std::vector<std::string_view> fields) { said(owner, store_status::ok, fields); };
    switch (static_cast<store_cmd>(f.code)) {
      case store_cmd::set:
        if (store_value(owner, k, f.fields[1], said)) ok({});
        return true;
      case store_cmd::get: {
        auto it = data_.find(k);
        if (it == data_.end()) return false;
        ok({it->second});
        return true;
      }
      case store_cmd::add: {
        auto it = data_.find(k);
        const std::string& old = it == data_.end() ? std::string() : it->second;
        // Two's-complement wrap-around, as the counter's users expect; no signed overflow.
        const auto nv = static_cast<std::int64_t>(static_cast<std::uint64_t>(old.size() == 8 ? decode_i64(old) : 0) +
                                                  static_cast<std::uint64_t>(decode_i64(f.fields[1])));
        if (store_value(owner, k, encode_i64(nv), said)) ok({data_.find(k)->second});
        return true;
      }
      case store_cmd::cas: {
        auto it = data_.find(k);
        const bool matches = it == data_.end() ? f.fields[1].empty() : it->second == f.fields[1];
        if (matches) {
          if (!store_value(owner, k, f.fields[2], said)) return true;
          claimed = claim;
        }
        it = data_.find(k);
        ok({it == data_.end() ? std::string_view() : std::string_view(it->second)});
        return true;
      }
      case store_cmd::del: {
        if (f.fields.size() == 2) {  // every key under the prefix k, a bounded number at a time
          std::size_t n = 0;
          for (auto it = data_.lower_bound(k); it != data_.end() && it->first.starts_with(k) && n < store_max_fields;
               ++n) {
            stored_ -= it->first.size() + it->second.size() + entry_overhead;
            it = data_.erase(it);
          }
          const std::string count = std::to_string(n);
          ok({count});
          return true;
        }
        auto it = data_.find(k);
        const bool erased = it != data_.end();
        if (erased) {
          stored_ -= it->first.size() + it->second.size() + entry_overhead;
          data_.erase(it);
        }
        ok({erased ? "1" : "0"});
        return true;
      }
      case store_cmd::check:
        ok({data_.count(k) ? "1" : "0"});
        return true;
      case store_cmd::wait: {
        for (std::size_t i = 0; i + 1 < f.fields.size(); ++i)
          if (!data_.count(f.fields[i])) return false;
        ok({});
        return true;
      }
    }
    return true;
  }

  /// data_[key] = value within max_bytes_; otherwise answers `full` (or `too_large`) and
  /// returns false.
  template <class Said>
  bool store_value(std::uint64_t owner, const std::string& key, std::string_view value, Said& said) {
    auto it = data_.find(key);
    const std::size_t old = it == data_.end() ? 0 : key.size() + it->second.size() + entry_overhead;
    const std::size_t now = stored_.load() - old;
    const std::size_t need = key.size() + value.size() + entry_overhead;
    if (need > max_bytes_) {
      // Could never fit, however empty the store: a bad argument, not a full store.
      const std::string why = "store value for key '" + key.substr(0, 64) + "' is too large: " + std::to_string(need) +
                              " bytes with its key and entry overhead, and the store of rank " + std::to_string(rank_) +
                              " holds at most " + std::to_string(max_bytes_) + " (store_limits::max_bytes)";
      said(owner, store_status::too_large, {why});
      return false;
    }
    if (now + need > max_bytes_) {
      const std::string why = "the store of rank " + std::to_string(rank_) + " is full: writing '" + key.substr(0, 64) +
                              "' (" + std::to_string(value.size()) + " bytes) would pass its limit of " +
                              std::to_string(max_bytes_) + " bytes (store_limits::max_bytes; " + std::to_string(now) +
                              " held)";
      said(owner, store_status::full, {why});
      return false;
    }
    if (it == data_.end())
      data_.emplace(key, std::string(value));
    else
      it->second.assign(value);
    stored_ = now + need;
    if (watch_.find(key) != watch_.end()) pending_wakes_.push_back(key);
    return true;
  }

  /// Parks a get/wait until its keys exist or its time is up, registered on its first missing key.
  void park(std::uint64_t owner, owner_rec& o, frame f, deadline_t now) {
    const auto ms = decode_i64(f.fields.back());
    // The wait comes from the client: clamp it (a year) before it meets the clock's range.
    const std::int64_t bounded = std::clamp<std::int64_t>(ms, 0, timing::store_max_wait_ms);
    const auto id = ++waiter_seq_;
    std::size_t bytes = waiter_overhead;
    // Each key is a std::string (32 bytes) with its own heap block past 15 bytes (its length
    // rounded up to malloc's 16, plus 16): count 64 bytes besides its length.
    for (const auto& field : f.fields) bytes += field.size() + 64;
    auto& w = waiters_.emplace(id, waiter{owner, std::move(f), 0, bytes, {}, {}}).first->second;
    w.timer = deadlines_.emplace(now + std::chrono::milliseconds(bounded), id);
    w.cursor = first_missing(w.req, 0);
    w.watch = watch_.emplace(w.req.fields[w.cursor], id);
    o.parked.push_back(id);
    o.bytes += bytes;
  }

  /// Index of the first key of `f` from `from` on that is missing (wrapping around); the number
  /// of keys when all exist.
  std::size_t first_missing(const frame& f, std::size_t from) const {
    const std::size_t n = waited_keys(f);
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t k = (from + i) % n;
      if (!data_.count(f.fields[k])) return k;
    }
    return n;
  }

  void unpark(std::uint64_t id) {
    auto it = waiters_.find(id);
    auto& o = owners_.at(it->second.owner);
    watch_.erase(it->second.watch);
    deadlines_.erase(it->second.timer);
    o.bytes -= it->second.bytes;
    std::erase(o.parked, id);
    waiters_.erase(it);
  }

  int rank_;
  std::size_t max_bytes_;
  std::string member_prefix_;
  std::uint32_t members_ = 0;  ///< seats that can be claimed (0: any key under member_prefix_)
  std::map<std::string, std::string, std::less<>> data_;
  std::atomic<std::size_t> stored_{0};
  std::unordered_map<std::uint64_t, waiter> waiters_;
  std::unordered_map<std::uint64_t, owner_rec> owners_;
  std::multimap<std::string, std::uint64_t, std::less<>> watch_;  // key -> parked requests waiting for it
  std::multimap<deadline_t, std::uint64_t> deadlines_;            // when each parked request times out
  std::vector<std::string> pending_wakes_;
  std::uint64_t waiter_seq_ = 0;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
