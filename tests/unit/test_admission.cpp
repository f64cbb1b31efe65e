// The pure parts of the group's front door, in one process with made-up time: the admission
// policy of a listener (group/detail/admission.hpp: whom it closes for room, when a handshake's
// time is up, when it next has something to do) and the verdict's naming of a failure
// (group/verdict.hpp: a relayed verdict keeps its origin, a rank's own is "rank R reports: ...").
// No socket, no thread: the listeners' loops and the multiprocess suites compose them.
#define DDP_ALLOW_DETAIL_HEADERS  // uses ddp's private headers directly (ddp/detail/private_check.hpp)
#include <ddp/group/detail/admission.hpp>
#include <ddp/group/verdict.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <string>

using namespace std::chrono_literals;
using ddp::detail::admission;
using ddp::detail::admission_rules;
using ddp::detail::standing;

namespace {
admission_rules small_rules() {
  admission_rules r;
  r.capacity = 8;
  r.crowded_at = 4;
  r.handshake_limit = 5000ms;
  r.crowded_handshake_limit = 1000ms;
  return r;
}
}  // namespace

TEST_CASE("admission: the stranger most readily closed goes first, by standing, then by age") {
  admission a(small_rules());
  const ddp::deadline_t t0{};
  CHECK_FALSE(a.victim().has_value());
  a.place(1, standing::not_member, 1, t0);
  a.place(2, standing::handshaking, 2, t0);
  a.place(3, standing::handshaking, 3, t0);
  a.place(4, standing::refused, 4, t0);
  a.place(5, standing::trusted, 5, t0);  // never kept: never closed for room
  REQUIRE(a.victim().has_value());
  CHECK(*a.victim() == 4);  // refused before anything else
  a.forget(4);
  CHECK(*a.victim() == 2);  // then the oldest handshake
  a.forget(2);
  CHECK(*a.victim() == 3);
  a.place(3, standing::trusted, 3, t0);  // proven: leaves the ranking
  CHECK(*a.victim() == 1);
  a.forget(1);
  CHECK_FALSE(a.victim().has_value());
  a.forget(99);  // unknown: nothing happens
}

TEST_CASE("admission: handshakes end at their limit, and at the short one while crowded") {
  admission a(small_rules());
  const ddp::deadline_t t0{};
  a.place(1, standing::handshaking, 1, t0);
  a.place(2, standing::handshaking, 2, t0 + 2000ms);
  // Not crowded (2 held, crowded at 4): the usual limit, 5 s from each arrival.
  CHECK(a.handshakes_over(t0 + 4999ms, 2).empty());
  CHECK(a.next_due(t0 + 100ms, 2) == t0 + 5000ms);  // the oldest ends first
  auto over = a.handshakes_over(t0 + 5000ms, 2);
  REQUIRE(over.size() == 1);
  CHECK(over[0].first == 1);
  CHECK(over[0].second == admission::ended::timed_out);
  // Crowded (4 held): the short limit, 1 s, for every handshake, oldest first.
  over = a.handshakes_over(t0 + 3000ms, 4);
  REQUIRE(over.size() == 2);
  CHECK(over[0].first == 1);
  CHECK(over[0].second == admission::ended::crowded_out);
  CHECK(over[1].first == 2);
  CHECK(a.next_due(t0, 4) == t0 + 1000ms);
  CHECK(a.pressed(t0, 4));
  CHECK_FALSE(a.pressed(t0, 3));
  // Nothing pending: nothing due, the whole capacity, and the listener is watched.
  a.forget(1);
  a.forget(2);
  CHECK(a.next_due(t0, 0) == ddp::deadline_t::max());
  CHECK(a.room(t0) == 8);
  CHECK(a.listening(t0));
}

TEST_CASE("verdict: a failure is recorded as this rank's report unless it already names its origin") {
  const ddp::failure_verdict v;  // no store: records nothing, finds nothing
  SUBCASE("names") {
    CHECK(ddp::failure_verdict::names_reporter("rank 2 reports: rank 1 stopped answering"));
    CHECK(ddp::failure_verdict::names_reporter("rank 12 left the group on its error (timeout): x"));
    CHECK(ddp::failure_verdict::names_reporter("group aborted by rank 3: why"));
    CHECK_FALSE(ddp::failure_verdict::names_reporter("rank 1 stopped answering: no heartbeat"));
    CHECK_FALSE(ddp::failure_verdict::names_reporter("rank reports: nobody"));
    CHECK_FALSE(ddp::failure_verdict::names_reporter(""));
    CHECK(ddp::failure_verdict::reporter("rank 12 left the group on its error (timeout): x") == 12);
    CHECK(ddp::failure_verdict::reporter("group aborted by rank 3: why") == 3);
    CHECK(ddp::failure_verdict::reporter("rank 1 stopped answering: no heartbeat") == -1);
  }
  SUBCASE("as recorded") {
    const auto relayed = v.as_recorded(ddp::errc::timeout, "rank 2 reports: rank 1 stopped answering");
    CHECK(relayed.code == ddp::errc::timeout);
    CHECK(relayed.text == "rank 2 reports: rank 1 stopped answering");
    CHECK(relayed.origin == 2);  // where it came from, not this rank
    const auto own = v.as_recorded(ddp::errc::peer_lost, "rank 1 died");
    CHECK(own.code == ddp::errc::peer_lost);
    CHECK(own.text.find(" reports: rank 1 died") != std::string::npos);
    CHECK(ddp::failure_verdict::names_reporter(own.text));  // relayed again, it stays as it is
    CHECK(v.as_recorded(ddp::errc::peer_lost, own.text).text == own.text);
  }
}
