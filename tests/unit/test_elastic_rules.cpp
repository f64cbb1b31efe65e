// The elastic group's decisions (group/detail/elastic_rules.hpp) in one process, with fake time:
// who closes a round, with whom and in which order, when the state is gone, what a step becomes,
// what a process waiting for a seat does. Then a deterministic simulation runs the protocol
// that group/elastic.hpp drives (register, close, form, vote, decide, apply) over an in-memory
// store, with random kills, freezes, thaws, newcomers and store stalls at every point, and
// checks the invariants of docs/elastic.md "The failure model" on thousands of schedules.
#define DDP_ALLOW_DETAIL_HEADERS
#include <ddp/group/detail/elastic_rules.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

using namespace std::chrono_literals;
namespace el = ddp::detail::elastic;

namespace {

el::registrant reg(std::int64_t idx, std::int64_t place, int holds, std::uint64_t step) {
  return {idx, place, "p" + std::to_string(idx), holds, step};
}

el::round_rules rules_of(int min, int max) { return {min, max, 1000ms, 30000ms, 30000ms}; }

// Round `round` after a generation of `prev` ranks; `live` is the live generation.
el::round_view view_of(int round, int prev, el::live_mark live, std::vector<el::registrant> regs,
                       std::vector<int> dead = {}, std::chrono::milliseconds open_for = 0ms) {
  el::round_view v;
  v.round = round;
  v.prev_size = prev;
  v.live = live;
  v.back.assign(static_cast<std::size_t>(prev), false);
  v.dead.assign(static_cast<std::size_t>(prev), false);
  for (const auto& r : regs)
    if (r.place < prev) v.back[static_cast<std::size_t>(r.place)] = true;
  for (int d : dead) v.dead[static_cast<std::size_t>(d)] = true;
  v.registered = std::move(regs);
  v.open_for = open_for;
  return v;
}

}  // namespace

TEST_CASE("rules: a registration and a closed round read back as written") {
  const auto r = reg(3, 2, 5, 1234);
  const auto back = el::decode_registrant(3, el::encode(r));
  REQUIRE(back);
  CHECK(*back == r);
  CHECK_FALSE(el::decode_registrant(1, "2 uid 5"));
  CHECK_FALSE(el::decode_registrant(1, "x uid 5 6"));
  el::round_decision d;
  d.what = el::round_decision::form;
  d.members = {3, 1, 2};
  const auto dd = el::decode_round(el::encode(d));
  REQUIRE(dd);
  CHECK(dd->members == d.members);
  d.what = el::round_decision::lost;
  d.why = "every rank holding the state of step 7 left";
  const auto dl = el::decode_round(el::encode(d));
  REQUIRE(dl);
  CHECK(dl->what == el::round_decision::lost);
  CHECK(dl->why == d.why);
  CHECK_FALSE(el::decode_round(""));
  CHECK_FALSE(el::decode_round("1 x"));
  // The members' equal state travels with the round.
  d.what = el::round_decision::form;
  d.members = {2, 1};
  d.equal_state = true;
  CHECK(el::encode(d) == "2 1 equal");
  const auto de = el::decode_round(el::encode(d));
  REQUIRE(de);
  CHECK(de->members == d.members);
  CHECK(de->equal_state);
  d.equal_state = false;
  CHECK_FALSE(el::decode_round(el::encode(d))->equal_state);
  CHECK_FALSE(el::decode_round("equal"));
  CHECK_FALSE(el::decode_round("1 equal 2"));
}

TEST_CASE("rules: a round of sources that all hold one step's state holds equal state; any other does not") {
  const el::live_mark live{4, 100};
  const auto r = rules_of(2, 4);
  // Three survivors of generation 4, each holding its state as of step 120; rank 2 found dead.
  auto v = view_of(5, 4, live, {reg(1, 3, 4, 120), reg(2, 0, 4, 120), reg(3, 1, 4, 120)}, {2});
  auto d = el::decide_round(v, r);
  REQUIRE(d.what == el::round_decision::form);
  CHECK(d.equal_state);
  // A source formed from the live generation later (it holds generation 5's state) is as good.
  v = view_of(6, 4, live, {reg(1, 0, 5, 120), reg(2, 1, 4, 120)}, {2, 3});
  d = el::decide_round(v, r);
  REQUIRE(d.what == el::round_decision::form);
  CHECK(d.equal_state);
  // A newcomer among them: it holds nothing, rank 0's state must reach it.
  v = view_of(5, 4, live, {reg(1, 3, 4, 120), reg(2, 0, 4, 120), reg(3, el::newcomer_place, el::holds_nothing, 0)},
              {1, 2});
  d = el::decide_round(v, r);
  REQUIRE(d.what == el::round_decision::form);
  CHECK(d.members.size() == 3);
  CHECK_FALSE(d.equal_state);
  // A rank left behind (it holds generation 2's state, before the live one): no source.
  v = view_of(5, 4, live, {reg(1, 3, 4, 120), reg(2, 0, 4, 120), reg(3, el::newcomer_place, 2, 40)}, {1, 2});
  d = el::decide_round(v, r);
  REQUIRE(d.what == el::round_decision::form);
  CHECK_FALSE(d.equal_state);
  // Sources one step apart.
  v = view_of(5, 4, live, {reg(1, 3, 4, 120), reg(2, 0, 4, 121)}, {1, 2});
  d = el::decide_round(v, r);
  REQUIRE(d.what == el::round_decision::form);
  CHECK_FALSE(d.equal_state);
  // The launcher's ranks before any step: each holds its own initial state, which only the
  // first construction's broadcast makes equal.
  v = view_of(0, 3, el::live_mark{}, {reg(1, 0, el::holds_initial, 0), reg(2, 1, el::holds_initial, 0),
                                      reg(3, 2, el::holds_initial, 0)});
  d = el::decide_round(v, rules_of(2, 3));
  REQUIRE(d.what == el::round_decision::form);
  CHECK_FALSE(d.equal_state);
  // Survivors of the first generation before it committed a step: they hold its state.
  v = view_of(1, 3, el::live_mark{}, {reg(1, 0, 0, 0), reg(2, 2, 0, 0)}, {1});
  d = el::decide_round(v, r);
  REQUIRE(d.what == el::round_decision::form);
  CHECK(d.equal_state);
}

TEST_CASE("rules: the survivors close at once when every rank is back or found dead, sources first") {
  // Generation 4 of 4 ranks committed steps; rank 2 was found dead; a newcomer came first.
  const el::live_mark live{4, 100};
  auto v = view_of(5, 4, live, {reg(1, el::newcomer_place, el::holds_nothing, 0), reg(2, 3, 4, 120),
                                reg(3, 0, 4, 120), reg(4, 1, 4, 120)},
                   {2});
  const auto d = el::decide_round(v, rules_of(2, 5));
  REQUIRE(d.what == el::round_decision::form);
  CHECK(d.members == std::vector<std::int64_t>{3, 4, 2, 1});  // old ranks 0, 1, 3, then the newcomer
  // Without the dead mark, the round waits for rank 2 until the settle time.
  v.dead.assign(4, false);
  CHECK(el::decide_round(v, rules_of(2, 5)).what == el::round_decision::wait);
  v.open_for = 1000ms;
  CHECK(el::decide_round(v, rules_of(2, 5)).what == el::round_decision::form);
  // At the maximum it closes at once, the newcomer cut if the sources fill it.
  v.open_for = 0ms;
  const auto at_max = el::decide_round(v, rules_of(2, 3));
  REQUIRE(at_max.what == el::round_decision::form);
  CHECK(at_max.members == std::vector<std::int64_t>{3, 4, 2});
}

TEST_CASE("rules: all members die while a generation forms: the newcomers left never form a group") {
  // Round 6 follows a formation of 3 (two sources, one newcomer at place 2) that failed: both
  // sources died. The newcomer, a member of that formation now, registers alone.
  const el::live_mark live{4, 57};
  auto v = view_of(6, 3, live, {reg(1, 2, el::holds_nothing, 0)});
  const auto r = rules_of(1, 3);
  CHECK(el::decide_round(v, r).what == el::round_decision::wait);  // a source may still come back
  v.open_for = 5000ms;
  CHECK(el::decide_round(v, r).what == el::round_decision::wait);  // past settle: still no source
  // Both found dead: the state is gone, said at once.
  v.dead = {true, true, false};
  auto d = el::decide_round(v, r);
  REQUIRE(d.what == el::round_decision::lost);
  CHECK(d.why.find("every rank holding the state of step 57 left") != std::string::npos);
  // Nobody found them dead (both killed at once): the timeout ends the wait, saying so.
  v.dead = {false, false, false};
  v.open_for = r.timeout;
  d = el::decide_round(v, r);
  REQUIRE(d.what == el::round_decision::lost);
  CHECK(d.why.find("none came back within the timeout") != std::string::npos);
}

TEST_CASE("rules: only newcomers left, however many, never become sources") {
  const el::live_mark live{2, 10};
  std::vector<el::registrant> regs;
  for (int i = 1; i <= 4; ++i) regs.push_back(reg(i, i - 1, el::holds_nothing, 0));
  auto v = view_of(3, 4, live, regs);  // at the maximum, every old place back: still no state
  const auto d = el::decide_round(v, rules_of(1, 4));
  REQUIRE(d.what == el::round_decision::lost);
  for (const auto& x : v.registered) CHECK_FALSE(el::is_source(x, v.live));
  // Before any step was committed the launcher's ranks hold the job's initial state.
  CHECK(el::is_source(reg(1, 0, el::holds_initial, 0), el::live_mark{}));
  CHECK_FALSE(el::is_source(reg(1, 0, el::holds_initial, 0), el::live_mark{0, 1}));
  CHECK_FALSE(el::is_source(reg(1, 0, el::holds_nothing, 0), el::live_mark{}));
}

TEST_CASE("rules: a member thawed after k sweeps is stale: it moves to the current round and is no source") {
  for (int k = 1; k <= 5; ++k) {
    CAPTURE(k);
    const int its_gen = 2, current = its_gen + k;
    CHECK(el::stale(its_gen, current));
    // It registers in the current round: behind the live generation, it is no source.
    const el::live_mark live{current, 300};
    CHECK_FALSE(el::is_source(reg(1, el::newcomer_place, its_gen, 40), live));
    // A newcomer whose round was swept moves to the round after the newest generation.
    el::seat_view s;
    s.round = its_gen + 1;
    s.current = current;
    s.round_closed = false;
    s.progress = true;
    const auto d = el::decide_seat(s, 30s);
    CHECK(d.what == el::seat_decision::move);
    CHECK(d.round == current + 1);
  }
  CHECK_FALSE(el::stale(3, 3));
  // A stale process among sources goes after them, whatever its old place.
  const el::live_mark live{7, 300};
  auto v = view_of(8, 2, live, {reg(1, el::newcomer_place, 2, 40), reg(2, 1, 7, 300), reg(3, 0, 7, 300)});
  const auto d = el::decide_round(v, rules_of(1, 4));
  REQUIRE(d.what == el::round_decision::form);
  CHECK(d.members == std::vector<std::int64_t>{3, 2, 1});
}

TEST_CASE("rules: two failures inside one recovery: the round waits for neither, then forms without both") {
  const el::live_mark live{3, 64};
  // Ranks 1 and 3 of 4 failed; rank 1 was found dead by its successor, rank 3 was not.
  auto v = view_of(4, 4, live, {reg(1, 0, 3, 64), reg(2, 2, 3, 64)}, {1});
  const auto r = rules_of(2, 4);
  CHECK(el::decide_round(v, r).what == el::round_decision::wait);
  v.open_for = r.settle;
  const auto d = el::decide_round(v, r);
  REQUIRE(d.what == el::round_decision::form);
  CHECK(d.members == std::vector<std::int64_t>{1, 2});
  // The formation that follows fails too (a third loss): the next round starts from its ranks.
  auto next = view_of(5, 2, live, {reg(1, 0, 3, 64)}, {1});
  const auto d2 = el::decide_round(next, rules_of(1, 4));
  REQUIRE(d2.what == el::round_decision::form);
  CHECK(d2.members == std::vector<std::int64_t>{1});
}

TEST_CASE("rules: a refused newcomer never holds a seat; the round closes after settle without it") {
  // The formation of 3 (two sources, the newcomer at place 2) failed on the newcomer's shapes.
  // It leaves with its error; the two register again, and wait for place 2 up to settle.
  const el::live_mark live{1, 20};
  auto v = view_of(3, 3, live, {reg(1, 0, 1, 20), reg(2, 1, 1, 20)});
  const auto r = rules_of(2, 3);
  CHECK(el::decide_round(v, r).what == el::round_decision::wait);
  v.open_for = r.settle;
  const auto d = el::decide_round(v, r);
  REQUIRE(d.what == el::round_decision::form);
  CHECK(d.members == std::vector<std::int64_t>{1, 2});
}

TEST_CASE("rules: a sharded live generation never re-forms, and never grows") {
  const el::live_mark m{3, 41, true};
  const auto back = el::decode_live(el::encode(m));
  REQUIRE(back);
  CHECK(back->gen == 3);
  CHECK(back->step == 41);
  CHECK(back->sharded);
  CHECK_FALSE(el::decode_live("3 41 other"));
  CHECK(el::decode_live("3 41")->sharded == false);
  CHECK_FALSE(el::decode_live("x"));
  // Every rank back, none dead: still lost, at once (the wrappers' rebuild would reset every
  // shard's optimizer state).
  auto v = view_of(4, 2, m, {reg(1, 0, 3, 41), reg(2, 1, 3, 41)});
  const auto d = el::decide_round(v, rules_of(1, 4));
  REQUIRE(d.what == el::round_decision::lost);
  CHECK(d.why.find("sharded") != std::string::npos);
  CHECK(d.why.find("every rank holding the state") != std::string::npos);
  // Before any step was committed there is nothing to lose: it forms.
  v.live = {};
  CHECK(el::decide_round(v, rules_of(1, 4)).what == el::round_decision::form);
  el::step_view sv;
  sv.votes = sv.world = 2;
  sv.max = 4;
  sv.waiting = 1;
  CHECK(el::decide_step(sv) == el::step_outcome::grow);
  sv.sharded = true;
  CHECK(el::decide_step(sv) == el::step_outcome::commit);
}

TEST_CASE("rules: the store unreachable for longer than the lease decides nothing by itself") {
  // A rank that cannot reach the store keeps its last view: however long it waited, a step it
  // voted for is still pending until the group is found failed (then abort) or the last vote
  // arrives. The step's own deadline, not the store's silence, ends the wait, naming the store.
  el::step_view s;
  s.votes = 2;
  s.world = 3;
  s.max = 3;
  CHECK(el::decide_step(s) == el::step_outcome::pending);
  s.group_failed = true;
  CHECK(el::decide_step(s) == el::step_outcome::abort);
  s.votes = 3;
  CHECK(el::decide_step(s) == el::step_outcome::commit);  // the last vote decides before any failure
  s.max = 4;
  s.waiting = 1;
  CHECK(el::decide_step(s) == el::step_outcome::grow);
  // A seat: a newcomer that saw no progress for the timeout gives up, saying so.
  el::seat_view w;
  w.round = 4;
  w.current = 3;
  w.idle = 30s;
  CHECK(el::decide_seat(w, 30s).what == el::seat_decision::timeout);
  w.done = true;
  CHECK(el::decide_seat(w, 30s).what == el::seat_decision::leave);
}

// ---------------------------------------------------------------------------------------------
// The simulation. Each process runs the loop of group/elastic.hpp one store interaction at a
// time (register, look at its round, join, vote, read the decision); a scheduler picks which
// process moves next, and at random kills, freezes or thaws one, starts a newcomer, or stalls
// the store (nobody moves while time passes). Time is fake: ticks of 10 ms. The decisions are
// the real ones; what a process does with them mirrors elastic.hpp's loops.
namespace {

constexpr int lease = 50;     // ticks: the heartbeat finds a frozen rank after its lease
constexpr int settle = 100;   // 2 leases
constexpr int timeout = 600;  // the group's timeout
constexpr int min_size = 2, max_size = 4;

std::uint64_t apply_step(std::uint64_t w, std::uint64_t s) { return (w ^ (s + 0x9e37)) * 0x100000001b3ull; }

struct sim {
  enum class life { alive, dead, frozen };
  enum class phase { registering, waiting, joining, training, deciding, done, failed, left };
  struct proc {
    int id = 0;
    life state = life::alive;
    int thaw_at = 0, frozen_at = 0;
    phase ph = phase::registering;
    bool member = true;
    std::int64_t place = 0;
    int holds = el::holds_initial;
    std::uint64_t step = 0, weights = 1;
    int gen = -1, rank = -1;
    int round = 0, prev_size = 0, prev_gen = -1;
    std::int64_t idx = 0;
    int opened = 0;
    std::string error;
  };
  struct round_rec {
    std::vector<el::registrant> regs;
    std::optional<el::round_decision> closed;
    int formed = 0;  // members that reached the formation
    bool formation_failed = false;
  };
  struct step_rec {
    std::vector<int> voters;
    std::string decision;
  };

  std::mt19937_64 rng;
  int now = 0;
  int stall_until = 0;
  std::vector<proc> ps;
  std::map<int, round_rec> rounds;
  std::map<std::pair<int, std::uint64_t>, step_rec> steps;
  std::map<int, std::vector<int>> gens;  // generation -> members' ids in rank order
  std::map<int, std::vector<bool>> dead_marks;
  int el_gen = -1;
  el::live_mark live;
  std::vector<std::uint64_t> truth{1};  // weights after s committed steps
  std::string violation;
  bool lost_said = false;
  int equal_formations = 0;  // generations formed with equal state (no broadcast)

  explicit sim(std::uint64_t seed) : rng(seed) {
    for (int i = 0; i < 4; ++i) {
      proc p;
      p.id = i;
      p.place = i;
      p.prev_size = 4;
      ps.push_back(p);
    }
  }

  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; }
  void bad(const std::string& what) {
    if (violation.empty()) violation = "t=" + std::to_string(now) + ": " + what;
  }
  bool usable(const proc& p) const { return p.state == life::alive; }
  std::uint64_t committed() const { return truth.size() - 1; }

  // The heartbeat's view: the group of generation g failed for p when another member is dead,
  // frozen past the lease, or has left g (its recover failed the group for all).
  bool group_failed(const proc& p) const {
    for (int q : gens.at(p.gen)) {
      if (q == p.id) continue;
      const auto& o = ps[static_cast<std::size_t>(q)];
      if (o.state == life::dead) return true;
      if (o.state == life::frozen && now - o.frozen_at >= lease) return true;
      if (o.gen != p.gen || (o.ph != phase::training && o.ph != phase::deciding)) return true;
    }
    return false;
  }

  void register_in(proc& p, int round, bool member, std::int64_t place) {
    if (el_gen >= round) {  // the loop's first look: a round formed without it
      round = el_gen + 1;
      member = false;
      place = el::newcomer_place;
    }
    p.round = round;
    p.member = member;
    p.place = place;
    auto& r = rounds[round];
    p.idx = static_cast<std::int64_t>(r.regs.size()) + 1;
    r.regs.push_back({p.idx, place, "p" + std::to_string(p.id), p.holds, p.step});
    p.ph = phase::waiting;
    p.opened = now;
  }

  el::round_view view_for(const proc& p) {
    el::round_view v;
    v.round = p.round;
    v.registered = rounds[p.round].regs;
    v.prev_size = p.prev_size;
    v.back.assign(static_cast<std::size_t>(p.prev_size), false);
    v.dead.assign(static_cast<std::size_t>(p.prev_size), false);
    for (const auto& r : v.registered)
      if (r.place < p.prev_size && r.place >= 0) v.back[static_cast<std::size_t>(r.place)] = true;
    if (auto it = dead_marks.find(p.prev_gen); it != dead_marks.end())
      for (int q = 0; q < p.prev_size && q < static_cast<int>(it->second.size()); ++q)
        v.dead[static_cast<std::size_t>(q)] = it->second[static_cast<std::size_t>(q)];
    v.live = live;
    v.open_for = std::chrono::milliseconds(10 * (now - p.opened));
    return v;
  }

  void recover(proc& p) {
    // elastic_group::recover: stale (a later generation formed without it): a newcomer now.
    if (el::stale(p.gen, el_gen)) {
      register_in(p, el_gen + 1, false, el::newcomer_place);
      return;
    }
    // The heartbeat's successor marks a dead (or long-frozen) member.
    auto& marks = dead_marks[p.gen];
    const auto& mem = gens[p.gen];
    marks.resize(mem.size(), false);
    for (std::size_t r = 0; r < mem.size(); ++r) {
      const auto& o = ps[static_cast<std::size_t>(mem[r])];
      if (o.state == life::dead || (o.state == life::frozen && chance(0.5))) marks[r] = chance(0.8);
    }
    auto& st = steps[{p.gen, p.step}];
    if (st.decision.empty()) st.decision = "abort";
    p.prev_size = static_cast<int>(mem.size());
    p.prev_gen = p.gen;
    register_in(p, p.gen + 1, true, p.rank);
  }

  void act(proc& p) {
    switch (p.ph) {
      case phase::registering:
        register_in(p, p.round, p.member, p.place);
        break;
      case phase::waiting: {
        auto& r = rounds[p.round];
        if (!r.closed) {
          if (!p.member) {
            // decide_seat: a round that formed without it, swept meanwhile (modelled as closed
            // but forgotten: the real loop moves on the same way).
            el::seat_view s;
            s.round = p.round;
            s.current = el_gen;
            s.progress = true;
            s.round_closed = false;
            const auto d = el::decide_seat(s, std::chrono::milliseconds(10 * timeout));
            if (d.what == el::seat_decision::move) register_in(p, d.round, false, el::newcomer_place);
            else if (now - p.opened > 4 * timeout) {
              p.ph = phase::failed;
              p.error = "newcomer timeout";
            }
            return;
          }
          const auto d = el::decide_round(view_for(p), el::round_rules{min_size, max_size, std::chrono::milliseconds(10 * settle),
                                                                        std::chrono::milliseconds(10 * settle),
                                                                        std::chrono::milliseconds(10 * timeout)});
          if (d.what == el::round_decision::wait) return;
          r.closed = d;
        }
        if (r.closed->what == el::round_decision::lost) {
          p.ph = phase::failed;
          p.error = r.closed->why;
          lost_said = true;
          return;
        }
        const auto& m = r.closed->members;
        const auto at = std::find(m.begin(), m.end(), p.idx);
        if (at == m.end()) {
          register_in(p, p.round + 1, false, el::newcomer_place);
          return;
        }
        if (static_cast<int>(m.size()) < min_size) {
          p.ph = phase::failed;
          p.error = "below the minimum";
          return;
        }
        p.rank = static_cast<int>(at - m.begin());
        p.ph = phase::joining;
        el_gen = std::max(el_gen, p.round);  // set once its process group is up
        break;
      }
      case phase::joining: {
        auto& r = rounds[p.round];
        const auto& m = r.closed->members;
        std::vector<proc*> mem;
        for (auto i : m)
          for (auto& q : ps)
            if (q.round == p.round && q.idx == i && (q.ph == phase::joining || q.ph == phase::training)) mem.push_back(&q);
        bool all_here = mem.size() == m.size();
        bool someone_gone = false;
        for (auto i : m) {
          for (auto& q : ps)
            if (q.round == p.round && q.idx == i &&
                (q.state == life::dead || (q.state == life::frozen && now - q.frozen_at >= lease) || q.ph == phase::failed ||
                 (q.ph == phase::waiting && q.round != p.round)))
              someone_gone = true;
        }
        if (r.formation_failed || (someone_gone && now - p.opened >= lease)) {
          // A rank lost while the generation formed: the next round, with what each holds.
          r.formation_failed = true;
          p.prev_size = static_cast<int>(m.size());
          p.prev_gen = p.round;
          dead_marks[p.round].resize(m.size(), false);
          gens[p.round] = {};
          for (auto i : m)
            for (auto& q : ps)
              if (q.round == p.round && q.idx == i) gens[p.round].push_back(q.id);
          p.gen = p.round;  // its process group of that round, failed
          register_in(p, p.round + 1, true, p.rank);
          return;
        }
        if (!all_here) return;
        for (auto* q : mem)
          if (!usable(*q)) return;  // a frozen member holds the formation up
        // The formation: rank 0's state reaches every member.
        proc* zero = nullptr;
        for (auto* q : mem)
          if (q->rank == 0) zero = q;
        if (zero->holds == el::holds_nothing) bad("a newcomer supplied the state in generation " + std::to_string(p.round));
        if (zero->step != committed()) bad("rank 0 of generation " + std::to_string(p.round) + " holds step " +
                                           std::to_string(zero->step) + " while " + std::to_string(committed()) +
                                           " were committed");
        if (zero->step <= committed() && zero->weights != truth[zero->step]) bad("rank 0's weights are not its step's");
        // A round that says its members hold equal state: their wrappers compare hashes and
        // broadcast nothing, so every member must already hold rank 0's weights.
        if (r.closed->equal_state) {
          ++equal_formations;
          for (auto* q : mem)
            if (q->weights != zero->weights || q->step != zero->step)
              bad("generation " + std::to_string(p.round) + " formed as holding equal state, but a member's weights "
                  "differ from rank 0's");
        }
        for (auto* q : mem) {
          if (el::is_source({q->idx, q->place, "", q->holds, q->step}, live) &&
              (q->step != zero->step || q->weights != zero->weights))
            bad("two sources differ in generation " + std::to_string(p.round));
          if (zero->step < q->step) bad("the committed step went backwards on a member");
          q->step = zero->step;
          q->weights = zero->weights;
          q->holds = p.round;
          q->gen = p.round;
          q->ph = phase::training;
          q->opened = now;
        }
        gens[p.round].clear();
        for (auto* q : mem) gens[p.round].push_back(q->id);
        std::sort(gens[p.round].begin(), gens[p.round].end(),
                  [&](int a, int b) { return ps[static_cast<std::size_t>(a)].rank < ps[static_cast<std::size_t>(b)].rank; });
        break;
      }
      case phase::training: {
        if (group_failed(p)) {
          recover(p);
          return;
        }
        auto& st = steps[{p.gen, p.step}];
        if (!st.decision.empty()) {  // decided abort by a failed rank before this vote
          recover(p);
          return;
        }
        st.voters.push_back(p.id);
        el::step_view v;
        v.votes = static_cast<std::int64_t>(st.voters.size());
        v.world = static_cast<int>(gens[p.gen].size());
        v.max = max_size;
        if (v.votes >= v.world) {
          v.waiting = rounds.count(p.gen + 1) ? static_cast<std::int64_t>(rounds[p.gen + 1].regs.size()) : 0;
          auto voters = st.voters;
          auto members = gens[p.gen];
          std::sort(voters.begin(), voters.end());
          std::sort(members.begin(), members.end());
          if (voters != members) bad("a step was decided over ranks other than its generation's");
          if (live.gen < p.gen) live = {p.gen, p.step + 1};
          st.decision = std::string(el::name(el::decide_step(v)));
          if (p.step != committed()) bad("step " + std::to_string(p.step) + " decided after " + std::to_string(committed()));
          truth.push_back(apply_step(truth.back(), p.step));
        }
        p.ph = phase::deciding;
        break;
      }
      case phase::deciding: {
        auto& st = steps[{p.gen, p.step}];
        if (st.decision.empty()) {
          el::step_view v;
          v.votes = static_cast<std::int64_t>(st.voters.size());
          v.world = static_cast<int>(gens[p.gen].size());
          v.max = max_size;
          v.group_failed = group_failed(p);
          if (el::decide_step(v) == el::step_outcome::abort) st.decision = "abort";
          else return;
        }
        if (st.decision == "abort") {
          recover(p);
          return;
        }
        // Committed: apply.
        p.weights = apply_step(p.weights, p.step);
        ++p.step;
        if (p.weights != truth[p.step]) bad("a member's weights left the committed chain at step " + std::to_string(p.step));
        live.step = std::max(live.step, p.step);
        if (p.step >= 200) {
          p.ph = phase::done;
          return;
        }
        if (st.decision == "grow") {
          p.prev_size = static_cast<int>(gens[p.gen].size());
          p.prev_gen = p.gen;
          register_in(p, p.gen + 1, true, p.rank);
          return;
        }
        p.ph = phase::training;
        break;
      }
      default:
        break;
    }
  }

  void event() {
    const auto pick = [&]() -> proc* {
      std::vector<proc*> c;
      for (auto& p : ps)
        if (p.state != life::dead && p.ph != phase::done && p.ph != phase::failed) c.push_back(&p);
      if (c.empty()) return nullptr;
      return c[std::uniform_int_distribution<std::size_t>(0, c.size() - 1)(rng)];
    };
    const int kind = std::uniform_int_distribution<int>(0, 9)(rng);
    if (kind <= 2) {
      if (auto* p = pick(); p && p->state == life::alive) p->state = life::dead;
    } else if (kind <= 4) {
      if (auto* p = pick(); p && p->state == life::alive) {
        p->state = life::frozen;
        p->thaw_at = now + std::uniform_int_distribution<int>(lease / 2, 6 * settle)(rng);
        p->frozen_at = now;
      }
    } else if (kind <= 7) {
      if (ps.size() < 24) {
        proc p;
        p.id = static_cast<int>(ps.size());
        p.member = false;
        p.place = el::newcomer_place;
        p.holds = el::holds_nothing;
        p.weights = 0xbad0000u + static_cast<std::uint64_t>(p.id);  // its own values, never the job's
        p.round = el_gen + 1;
        p.ph = phase::registering;
        ps.push_back(p);
      }
    } else {
      stall_until = now + std::uniform_int_distribution<int>(1, 2 * lease)(rng);
    }
  }

  // Runs the schedule; returns true when it ended (done or every process stopped).
  bool run(int ticks, double event_rate) {
    for (; now < ticks; ++now) {
      for (auto& p : ps)
        if (p.state == life::frozen && now >= p.thaw_at) p.state = life::alive;
      if (chance(event_rate)) event();
      if (now < stall_until) continue;
      std::vector<std::size_t> order(ps.size());
      for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::shuffle(order.begin(), order.end(), rng);
      for (auto i : order) {
        auto& p = ps[i];
        if (usable(p) && chance(0.7)) act(p);
        if (!violation.empty()) return true;
      }
      bool any = false;
      for (auto& p : ps)
        if (p.state != life::dead && p.ph != phase::done && p.ph != phase::failed) any = true;
      if (!any) return true;
    }
    return false;
  }

  // The end: the state lost means every process still there raised it; otherwise nobody trains
  // from a state behind the committed one.
  void check_end() {
    for (const auto& p : ps) {
      if (p.state == life::dead) continue;
      if (p.ph == phase::training || p.ph == phase::deciding || p.ph == phase::done)
        if (p.step + 1 < committed()) bad("process " + std::to_string(p.id) + " trains at step " + std::to_string(p.step) +
                                          " behind the committed " + std::to_string(committed()));
    }
    if (lost_said) {
      // Said only when no live process held the committed state at that point: check the
      // weaker fact that nobody finished the job after it.
      for (const auto& p : ps)
        if (p.ph == phase::done && p.step < committed()) bad("a process finished behind the lost state");
    }
  }
};

}  // namespace

TEST_CASE("rules: a simulation of the protocol keeps the invariants under random failures") {
  const char* seed_env = std::getenv("DDP_SIM_SEED");
  const std::uint64_t first = seed_env ? std::strtoull(seed_env, nullptr, 10) : 1;
  const int schedules = seed_env ? 1 : 3000;
  int ended_lost = 0, finished = 0, equal = 0;
  for (int i = 0; i < schedules; ++i) {
    const auto seed = first + static_cast<std::uint64_t>(i);
    sim s(seed);
    s.run(4000, 0.01 + 0.02 * static_cast<double>(seed % 5));
    s.check_end();
    if (!s.violation.empty()) {
      FAIL_CHECK("seed " << seed << " (replay: DDP_SIM_SEED=" << seed << " unit_elastic_rules): " << s.violation);
      break;
    }
    ended_lost += s.lost_said ? 1 : 0;
    equal += s.equal_formations;
    for (const auto& p : s.ps)
      if (p.ph == sim::phase::done) {
        ++finished;
        break;
      }
  }
  MESSAGE(schedules << " schedules: " << finished << " finished the job, " << ended_lost
                    << " ended with the state lost; " << equal << " generations formed holding equal state");
  // The schedules reach both ends: a test whose punisher never wins proves little.
  if (!seed_env) {
    CHECK(finished > schedules / 10);
    CHECK(ended_lost > 0);
    CHECK(equal > schedules / 10);
  }
}
