// The store's table without a socket (group/detail/store_table.hpp): every request, the limit on
// what entries hold, who may write, parked get/wait requests (woken, moved on, timed out,
// forgotten), the bounded erase of a prefix; and when the store's host may close it (close_rules).
// Time is made up: every deadline is a value here.
#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/group/detail/close_rules.hpp>
#include <ddp/group/detail/store_table.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

using namespace ddp::detail;
using namespace std::chrono_literals;
using done = store_table::outcome;
using ddp::deadline_t;

namespace {

const deadline_t t0 = deadline_t{} + 1h;

frame req(store_cmd code, std::vector<std::string> fields) { return frame{static_cast<std::uint8_t>(code), fields}; }
frame get(const std::string& k, std::int64_t ms) { return req(store_cmd::get, {k, encode_ms(ms)}); }
frame add(const std::string& k, std::int64_t by) { return req(store_cmd::add, {k, encode_i64(by)}); }

// Every answer the table made, in order.
struct answer {
  std::uint64_t owner;
  store_status status;
  std::vector<std::string> fields;
};
struct book {
  std::vector<answer> said;
  auto to() {
    return [this](std::uint64_t owner, store_status st, const std::vector<std::string_view>& f) {
      said.push_back({owner, st, std::vector<std::string>(f.begin(), f.end())});
    };
  }
  answer take() {
    REQUIRE(!said.empty());
    auto a = said.front();
    said.erase(said.begin());
    return a;
  }
};

// Runs one request of `owner` and returns its answer (it must be answered at once).
answer ask(store_table& t, std::uint64_t owner, frame f, bool member = false) {
  book b;
  const auto o = t.execute(owner, member, std::move(f), t0, b.to());
  REQUIRE(o != done::parked);
  REQUIRE(o != done::overflow);
  REQUIRE(b.said.size() == 1);
  return b.take();
}

}  // namespace

TEST_CASE("store table: set, get, add, compare_set, erase, check and wait answer as the client expects") {
  store_table t(0, 1 << 20);
  CHECK(ask(t, 1, req(store_cmd::set, {"a", "1"})).status == store_status::ok);
  auto g = ask(t, 1, get("a", 10));
  CHECK(g.status == store_status::ok);
  CHECK(g.fields == std::vector<std::string>{"1"});
  // add: a counter of 8 bytes, wrapping around as two's complement.
  CHECK(decode_i64(ask(t, 1, add("n", 5)).fields.at(0)) == 5);
  CHECK(decode_i64(ask(t, 2, add("n", -7)).fields.at(0)) == -2);
  CHECK(decode_i64(ask(t, 2, add("big", INT64_MAX)).fields.at(0)) == INT64_MAX);
  CHECK(decode_i64(ask(t, 2, add("big", 1)).fields.at(0)) == INT64_MIN);
  // compare_set: from the empty value when missing; answers what the key holds afterwards.
  CHECK(ask(t, 1, req(store_cmd::cas, {"c", "", "x"})).fields == std::vector<std::string>{"x"});
  CHECK(ask(t, 2, req(store_cmd::cas, {"c", "", "y"})).fields == std::vector<std::string>{"x"});
  CHECK(ask(t, 2, req(store_cmd::cas, {"c", "x", "y"})).fields == std::vector<std::string>{"y"});
  CHECK(ask(t, 2, req(store_cmd::cas, {"missing", "z", "w"})).fields == std::vector<std::string>{""});
  CHECK(t.find("missing") == nullptr);
  // check and erase.
  CHECK(ask(t, 1, req(store_cmd::check, {"a"})).fields == std::vector<std::string>{"1"});
  CHECK(ask(t, 1, req(store_cmd::del, {"a"})).fields == std::vector<std::string>{"1"});
  CHECK(ask(t, 1, req(store_cmd::del, {"a"})).fields == std::vector<std::string>{"0"});
  CHECK(ask(t, 1, req(store_cmd::check, {"a"})).fields == std::vector<std::string>{"0"});
  // wait: answered at once when every key exists.
  CHECK(ask(t, 1, req(store_cmd::wait, {"c", "n", encode_ms(10)})).status == store_status::ok);
  CHECK(t.size() == 3);
}

TEST_CASE("store table: entries count their key, value and overhead; a write past the limit is refused") {
  const std::size_t limit = 4 * (store_table::entry_overhead + 10);
  store_table t(3, limit);
  CHECK(t.stored_bytes() == 0);
  CHECK(ask(t, 1, req(store_cmd::set, {"k1", "12345678"})).status == store_status::ok);
  CHECK(t.stored_bytes() == 2 + 8 + store_table::entry_overhead);
  // Overwriting counts the new value only.
  CHECK(ask(t, 1, req(store_cmd::set, {"k1", "1234"})).status == store_status::ok);
  CHECK(t.stored_bytes() == 2 + 4 + store_table::entry_overhead);
  for (const char* k : {"k2", "k3", "k4"}) CHECK(ask(t, 1, req(store_cmd::set, {k, "12345678"})).status == store_status::ok);
  // Full: the answer says whose store, what was written and the limit; nothing changes.
  const auto before = t.stored_bytes();
  auto full = ask(t, 1, req(store_cmd::set, {"k5", "12345678"}));
  CHECK(full.status == store_status::full);
  CHECK(full.fields.at(0).find("the store of rank 3 is full: writing 'k5' (8 bytes)") != std::string::npos);
  CHECK(t.stored_bytes() == before);
  CHECK(t.find("k5") == nullptr);
  // Larger than the whole store: too_large, a bad argument rather than a full store.
  auto huge = ask(t, 1, req(store_cmd::set, {"h", std::string(limit, 'x')}));
  CHECK(huge.status == store_status::too_large);
  CHECK(huge.fields.at(0).find("store_limits::max_bytes") != std::string::npos);
  // compare_set and add are writes too.
  CHECK(ask(t, 1, req(store_cmd::cas, {"k6", "", "12345678"})).status == store_status::full);
  CHECK(ask(t, 1, add("k7", 1)).status == store_status::full);
  // Erasing gives the bytes back, to zero.
  for (const char* k : {"k1", "k2", "k3", "k4"}) ask(t, 1, req(store_cmd::del, {k}));
  CHECK(t.stored_bytes() == 0);
}

TEST_CASE("store table: erasing a prefix takes at most store_max_fields keys a request, and only that prefix") {
  store_table t(0, std::size_t{64} << 20);
  const std::size_t n = store_max_fields + 10;
  for (std::size_t i = 0; i < n; ++i) ask(t, 1, req(store_cmd::set, {"p/" + std::to_string(i), "v"}));
  ask(t, 1, req(store_cmd::set, {"q/1", "v"}));
  ask(t, 1, req(store_cmd::set, {"p", "v"}));  // the prefix itself is a key under it too
  const auto sweep = [&] {
    return std::stoul(ask(t, 1, req(store_cmd::del, {"p/", std::string(store_del_prefix)})).fields.at(0));
  };
  CHECK(sweep() == store_max_fields);
  CHECK(sweep() == 10);
  CHECK(sweep() == 0);
  CHECK(t.size() == 2);
  CHECK(t.find("q/1") != nullptr);
  CHECK(t.find("p") != nullptr);
}

TEST_CASE("store table: a get on a missing key parks until a write, then answers with the value") {
  store_table t(0, 1 << 20);
  book b;
  CHECK(t.execute(7, false, get("k", 1000), t0, b.to()) == done::parked);
  CHECK(b.said.empty());
  CHECK(t.parked(7) == 1);
  CHECK(t.parked_bytes(7) == store_table::waiter_overhead + 1 + 8 + 2 * 64);
  CHECK(t.next_deadline() == t0 + 1000ms);
  // A write of another key wakes nothing.
  ask(t, 1, req(store_cmd::set, {"other", "x"}));
  t.wake([](std::uint64_t) { return false; }, b.to());
  CHECK(b.said.empty());
  ask(t, 1, req(store_cmd::set, {"k", "v"}));
  t.wake([](std::uint64_t) { return false; }, b.to());
  REQUIRE(b.said.size() == 1);
  CHECK(b.said[0].owner == 7);
  CHECK(b.said[0].status == store_status::ok);
  CHECK(b.said[0].fields == std::vector<std::string>{"v"});
  CHECK(t.parked(7) == 0);
  CHECK(t.parked_bytes(7) == 0);
  CHECK(!t.next_deadline());
}

TEST_CASE("store table: a wait on several keys moves from missing key to missing key and answers once all exist") {
  store_table t(0, 1 << 20);
  book b;
  CHECK(t.execute(4, true, req(store_cmd::wait, {"a", "b", "c", encode_ms(5000)}), t0, b.to()) == done::parked);
  for (const char* k : {"c", "a"}) {
    ask(t, 1, req(store_cmd::set, {k, "1"}));
    t.wake([](std::uint64_t) { return true; }, b.to());
    CHECK(b.said.empty());
    CHECK(t.parked(4) == 1);
  }
  ask(t, 1, req(store_cmd::set, {"b", "1"}));
  t.wake([](std::uint64_t) { return true; }, b.to());
  REQUIRE(b.said.size() == 1);
  CHECK(b.said[0].status == store_status::ok);
  CHECK(t.parked(4) == 0);
}

TEST_CASE("store table: a parked request times out at its deadline, naming the keys still missing") {
  store_table t(0, 1 << 20);
  book b;
  REQUIRE(t.execute(2, true, req(store_cmd::wait, {"r/0", "r/1", "r/2", encode_ms(100)}), t0, b.to()) ==
          done::parked);
  ask(t, 1, req(store_cmd::set, {"r/1", "x"}));
  t.wake([](std::uint64_t) { return true; }, b.to());
  t.expire(t0 + 99ms, b.to());
  CHECK(b.said.empty());
  t.expire(t0 + 100ms, b.to());
  REQUIRE(b.said.size() == 1);
  CHECK(b.said[0].owner == 2);
  CHECK(b.said[0].status == store_status::timeout);
  CHECK(b.said[0].fields == std::vector<std::string>{"r/0", "r/2"});
  CHECK(t.parked(2) == 0);
  // A wait far longer than the clock can hold is clamped (a year), not overflowed.
  REQUIRE(t.execute(2, true, get("never", INT64_MAX), t0, b.to()) == done::parked);
  CHECK(*t.next_deadline() == t0 + std::chrono::milliseconds(timing::store_max_wait_ms));
  REQUIRE(t.execute(2, true, get("never", -5), t0, b.to()) == done::parked);
  CHECK(*t.next_deadline() == t0);
}

TEST_CASE("store table: a connection parks at most store_max_waiting requests; forget drops what it parked") {
  store_table t(0, 1 << 20);
  book b;
  for (std::size_t i = 0; i < store_max_waiting; ++i)
    REQUIRE(t.execute(9, true, get("k" + std::to_string(i), 1000), t0, b.to()) == done::parked);
  CHECK(t.execute(9, true, get("one more", 1000), t0, b.to()) == done::overflow);
  CHECK(t.parked(9) == store_max_waiting);
  // Another connection is not held to 9's count.
  CHECK(t.execute(10, true, get("k0", 1000), t0, b.to()) == done::parked);
  t.forget(9);
  CHECK(t.parked(9) == 0);
  CHECK(t.parked_bytes(9) == 0);
  // Its requests are gone: a write wakes only 10's, and no deadline of 9's is left.
  ask(t, 1, req(store_cmd::set, {"k0", "v"}));
  t.wake([](std::uint64_t) { return true; }, b.to());
  REQUIRE(b.said.size() == 1);
  CHECK(b.said[0].owner == 10);
  CHECK(!t.next_deadline());
  t.expire(t0 + 1h, b.to());
  CHECK(b.said.size() == 1);
}

TEST_CASE("store table: parked requests of members are answered before those of strangers") {
  store_table t(0, 1 << 20);
  book b;
  for (std::uint64_t owner : {11, 12, 13, 14}) REQUIRE(t.execute(owner, false, get("job", 1000), t0, b.to()) == done::parked);
  ask(t, 1, req(store_cmd::set, {"job", "record"}));
  t.wake([](std::uint64_t owner) { return owner % 2 == 0; }, b.to());
  REQUIRE(b.said.size() == 4);
  CHECK(b.said[0].owner == 12);
  CHECK(b.said[1].owner == 14);
  CHECK(b.said[2].owner == 11);
  CHECK(b.said[3].owner == 13);
}

TEST_CASE("store table: with members, only a connection that claimed a seat writes; seats are numbered when bounded") {
  SUBCASE("any key under the prefix is a seat") {
    store_table t(5, 1 << 20, "pg/rank/");
    auto refused = ask(t, 1, req(store_cmd::set, {"x", "1"}));
    CHECK(refused.status == store_status::forbidden);
    CHECK(refused.fields.at(0).find("the store of rank 5 refused to set key 'x'") != std::string::npos);
    CHECK(ask(t, 1, add("n", 1)).status == store_status::forbidden);
    CHECK(ask(t, 1, req(store_cmd::del, {"x"})).status == store_status::forbidden);
    // Reads are anyone's.
    CHECK(ask(t, 1, req(store_cmd::check, {"x"})).status == store_status::ok);
    // A claim: compare_set from the empty value of a key under the prefix.
    book b;
    CHECK(t.execute(1, false, req(store_cmd::cas, {"pg/rank/el.abc", "", "1"}), t0, b.to()) == done::claimed);
    // Taken already: answered with the holder's value, no seat.
    CHECK(t.execute(2, false, req(store_cmd::cas, {"pg/rank/el.abc", "", "2"}), t0, b.to()) == done::answered);
    CHECK(b.said.at(1).fields == std::vector<std::string>{"1"});
    // Under a namespace ("el3/pg/rank/0": a generation's keys) a claim is taken too.
    CHECK(t.execute(3, false, req(store_cmd::cas, {"el3/pg/rank/0", "", "1"}), t0, b.to()) == done::claimed);
    // A member writes.
    CHECK(ask(t, 1, req(store_cmd::set, {"x", "1"}), true).status == store_status::ok);
  }
  SUBCASE("numbered seats below the count, in their one spelling") {
    store_table t(0, 1 << 20, "pg/rank/", 2);
    book b;
    for (const char* bad : {"pg/rank/2", "pg/rank/01", "pg/rank/-1", "pg/rank/x", "el3/pg/rank/0"})
      CHECK(t.execute(1, false, req(store_cmd::cas, {bad, "", "1"}), t0, b.to()) != done::claimed);
    CHECK(t.find("pg/rank/2") == nullptr);
    CHECK(t.execute(1, false, req(store_cmd::cas, {"pg/rank/1", "", "1"}), t0, b.to()) == done::claimed);
  }
}

// ---- When the store's host may close it (group/detail/close_rules.hpp) ----------------------

TEST_CASE("close rules: a failed group's store stays until every rank has read why, or left, or the bound passed") {
  const auto bound = close_bound(true, 10s, 5s);
  CHECK(bound == 2500ms);  // min(cap, timeout / 4)
  CHECK(close_bound(true, 60s, 5s) == 5s);
  CHECK(close_bound(false, 60s, 5s) == 60s);  // a normal close waits a whole timeout
  close_view v{.failing = true, .others = 2, .read_failure = 2, .size = 3, .waited = 600ms, .bound = bound};
  // Past the old 500 ms: a slow rank still connected that has not read the failure keeps it up.
  auto d = decide_close(v);
  CHECK_FALSE(d.close);
  CHECK(std::string(d.reason).find("not read") != std::string::npos);
  v.read_failure = 3;  // it read it, and has not left yet: nothing more it needs
  d = decide_close(v);
  CHECK(d.close);
  CHECK(std::string(d.reason).find("every rank has read") != std::string::npos);
  v.read_failure = 1;  // nobody else read it, but they all left
  v.others = 0;
  CHECK(decide_close(v).close);
  v.others = 1;  // a frozen rank: connected, never reads; the bound ends the wait
  v.waited = bound - 1ms;
  CHECK_FALSE(decide_close(v).close);
  v.waited = bound;
  d = decide_close(v);
  CHECK(d.close);
  CHECK(std::string(d.reason).find("bound") != std::string::npos);
}

TEST_CASE("close rules: after a normal close, readers of a failure count for nothing; only leaving does") {
  close_view v{.failing = false, .others = 1, .read_failure = 5, .size = 2, .waited = 1s, .bound = 60s};
  CHECK_FALSE(decide_close(v).close);
  v.others = 0;
  CHECK(decide_close(v).close);
  v.others = 1;
  v.waited = 60s;
  CHECK(decide_close(v).close);
}
