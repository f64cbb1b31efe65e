// ddprun --elastic: when the group's state is gone (tools/ddprun_elastic.hpp), from the lives of
// the processes ddprun started, with made-up times.
#include "../../tools/ddprun_elastic.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

using ddprun::elastic_state;
using ddprun::rank_life;

namespace {
constexpr std::int64_t s = 1'000'000'000;  // a second, in ns
rank_life first(int slot, std::int64_t end = rank_life::running, int code = 137) {
  return {.slot = slot, .start_ns = 0, .end_ns = end, .code = code};
}
rank_life newcomer(int slot, std::int64_t start, std::int64_t end = rank_life::running, int code = 137) {
  return {.slot = slot, .start_ns = start, .end_ns = end, .code = code, .replacement = true};
}
}  // namespace

TEST_CASE("ddprun elastic: the state lives while a rank that holds it runs") {
  CHECK_FALSE(elastic_state({}, 3, true).lost);
  CHECK_FALSE(elastic_state({first(0), first(1), first(2)}, 3, true).lost);
  // Two of three killed, replaced while the third held the state: it lives.
  CHECK_FALSE(
      elastic_state({first(0, 5 * s), first(1, 5 * s), first(2), newcomer(0, 6 * s), newcomer(1, 6 * s)}, 3, true)
          .lost);
  // The first generation gone one by one, each replacement taken in by the ranks still there:
  // the newcomers hold it now.
  CHECK_FALSE(
      elastic_state({first(0, 5 * s), first(1, 10 * s), newcomer(0, 6 * s), newcomer(1, 11 * s)}, 2, true).lost);
  // A rank that stopped (SIGSTOP) is alive: it may come back.
  CHECK_FALSE(elastic_state({first(0, 5 * s), first(1), newcomer(0, 6 * s)}, 2, true).lost);
}

TEST_CASE("ddprun elastic: every rank killed at once") {
  // Replacements started after the last holder died hold nothing: the state is gone, whether
  // they run yet or not.
  const std::vector<rank_life> lives = {first(0, 10 * s), first(1, 10 * s + s / 20), first(2, 10 * s + s / 10),
                                        newcomer(0, 10 * s + s / 5), newcomer(1, 10 * s + s / 5)};
  const auto v = elastic_state(lives, 3, true);
  REQUIRE(v.lost);
  CHECK(v.why == "every rank of the elastic group died within 0.1 s; the group's state is gone");
  CHECK(v.code == 137);
  CHECK(v.gone_ns == 10 * s + s / 10);
  // Without the replacements too.
  CHECK(elastic_state({first(0, 10 * s), first(1, 10 * s), first(2, 10 * s)}, 3, true).lost);
}

TEST_CASE("ddprun elastic: a replacement started while a holder lived counts as one (it may have joined)") {
  // Slot 1's replacement started at 6 s while slot 0 held the state; slot 0 died at 6.5 s:
  // not lost while the replacement runs (it errs on the side of alive)...
  CHECK_FALSE(elastic_state({first(0, 6 * s + s / 2), first(1, 5 * s), newcomer(1, 6 * s)}, 2, true).lost);
  // ...and lost when it ends too (a newcomer that found nobody fails after its timeout).
  const auto v = elastic_state({first(0, 6 * s + s / 2), first(1, 5 * s), newcomer(1, 6 * s, 66 * s, 1)}, 2, true);
  REQUIRE(v.lost);
  CHECK(v.why == "every rank of the elastic group died within 59.5 s; the group's state is gone");
  CHECK(v.code == 137);  // the first of them to end: slot 0's, killed
  // A replacement started after every holder ended holds nothing, even when it started before
  // another replacement's end.
  CHECK(elastic_state({first(0, 5 * s), newcomer(0, 6 * s)}, 1, true).lost);
  const auto one = elastic_state({first(0, 5 * s), first(1), newcomer(0, 6 * s, 7 * s)}, 2, true);
  CHECK_FALSE(one.lost);
}

TEST_CASE("ddprun elastic: the last holders, when they are fewer than the slots") {
  // Slot 2 died at 2 s and its replacement came too late (12 s); slot 1's replacement joined at
  // 3 s while slot 0 lived. The last holders are those alive when the last of them started.
  const auto v = elastic_state(
      {first(0, 10 * s), first(1, 2 * s + s / 2), newcomer(1, 3 * s, 10 * s), first(2, 2 * s), newcomer(2, 12 * s)}, 3,
      true);
  REQUIRE(v.lost);
  CHECK(v.why == "the last 2 ranks holding the elastic group's state died within 0.0 s; the group's state is gone");
  CHECK(v.gone_ns == 10 * s);
}

TEST_CASE("ddprun elastic: a finished job is not lost") {
  CHECK_FALSE(elastic_state({first(0, 10 * s, 0), first(1, 10 * s, 1)}, 2, true).lost);
}

TEST_CASE("ddprun elastic: on several hosts, only the ranks' own word counts") {
  // Every local rank dead: the other hosts' ranks may hold the state.
  CHECK_FALSE(elastic_state({first(0, 10 * s), first(1, 10 * s)}, 2, false).lost);
  // Every slot's last process said that every rank holding the state is gone.
  auto said = [](rank_life l) {
    l.said_lost = true;
    l.code = 1;
    return l;
  };
  std::vector<rank_life> lives = {first(0, 10 * s), first(1, 10 * s), said(newcomer(0, 11 * s, 15 * s))};
  CHECK_FALSE(elastic_state(lives, 2, false).lost);  // slot 1 has not said it
  lives.push_back(said(newcomer(1, 11 * s, 16 * s)));
  const auto v = elastic_state(lives, 2, false);
  REQUIRE(v.lost);
  CHECK(v.why == "every rank of the elastic group exited saying that every rank holding the state is gone");
  CHECK(v.code == 1);
  CHECK(v.gone_ns == 16 * s);
  // A slot whose newer process runs has not given up.
  lives.push_back(newcomer(0, 17 * s));
  CHECK_FALSE(elastic_state(lives, 2, false).lost);
}

TEST_CASE("ddprun: the cause of a failed job is the first rank that failed on its own") {
  using ddprun::failed_rank;
  const std::string lost = "[ddp.peer_lost] rank 0: allreduce: rank 1 (pid 4733) died while this rank waited for it";
  const std::string aborted = "[ddp.aborted] rank 2: group aborted by rank 3: ...";
  const std::string timeout = "[ddp.timeout] rank 3: allreduce: rank 1 did not arrive before the deadline";
  const std::string own = "[ddp.invalid_argument] rank 2: the parameter set is empty";
  // A loaded machine: the killed rank's keeper noted its end after a survivor's exit.
  CHECK(ddprun::first_cause({failed_rank{0, 100, lost}, failed_rank{1, 180, ""}, failed_rank{2, 120, lost}}) == 1);
  // Several ranks failed on their own: the first of them.
  CHECK(ddprun::first_cause({failed_rank{0, 100, lost}, failed_rank{1, 180, ""}, failed_rank{2, 150, own}}) == 2);
  // Every rank reports the group's failure (the cause is on another host): the first.
  CHECK(ddprun::first_cause({failed_rank{0, 300, lost}, failed_rank{2, 200, aborted}, failed_rank{3, 250, timeout}}) ==
        2);
  CHECK(ddprun::first_cause({}) == -1);
  CHECK(ddprun::failed_because_of_the_group(lost));
  CHECK_FALSE(ddprun::failed_because_of_the_group(own));
  CHECK_FALSE(ddprun::failed_because_of_the_group(""));
}
