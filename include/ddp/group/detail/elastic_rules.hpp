#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The elastic group's decisions, as pure functions of a snapshot (what the store holds, how long
// this process has waited) that return the decision and its reason. group/elastic.hpp's loops
// only gather snapshots and act on what these say; tests/unit/test_elastic_rules.cpp drives them
// with fake time, and its simulation runs many processes' worth of them over an in-memory store.
//
// The decisions: when a round closes and who is in it, in which order (round); what a step
// becomes once voted (step); what a process that waits for a seat does (seat). The invariants
// they keep (docs/elastic.md, "The failure model"):
// - the group's state comes only from a *source*: a process that holds the state of the newest
//   generation that committed a step (or of a later one, formed from it); a newcomer, or a rank
//   frozen while a later generation committed, is never one;
// - a round with no source never forms: it ends the job with an error that says the state is
//   gone, at once when every rank of the last generation is accounted for, else at the timeout;
// - rank 0 of a new generation is a source, so the committed step never goes backwards.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail::elastic {

/// What a process holds when it registers: a generation's state, the job's initial state (a
/// rank the launcher started, before any generation committed), or nothing (a newcomer).
inline constexpr int holds_nothing = -2;
inline constexpr int holds_initial = -1;
/// The place of a newcomer in a round: after every rank of the last generation.
inline constexpr std::int64_t newcomer_place = std::int64_t{1} << 30;

/// One registration in a round, as the store keeps it ("m/<idx>").
struct registrant {
  std::int64_t idx = 0;    ///< its arrival in the round, from 1
  std::int64_t place = 0;  ///< its rank in the last generation, or newcomer_place
  std::string uid;         ///< the process
  int holds = holds_nothing;
  std::uint64_t step = 0;  ///< the steps committed in the state it holds
  bool operator==(const registrant&) const = default;
};
/// "place uid holds step": the store's form of a registration.
inline std::string encode(const registrant& r) {
  return std::to_string(r.place) + " " + r.uid + " " + std::to_string(r.holds) + " " + std::to_string(r.step);
}
inline std::optional<registrant> decode_registrant(std::int64_t idx, std::string_view s) {
  registrant r;
  r.idx = idx;
  std::vector<std::string> f;
  std::size_t at = 0;
  while (at <= s.size()) {
    const auto sp = s.find(' ', at);
    f.emplace_back(s.substr(at, sp == std::string_view::npos ? std::string_view::npos : sp - at));
    if (sp == std::string_view::npos) break;
    at = sp + 1;
  }
  if (f.size() != 4 || f[1].empty()) return std::nullopt;
  try {
    r.place = std::stoll(f[0]);
    r.uid = f[1];
    r.holds = std::stoi(f[2]);
    r.step = std::stoull(f[3]);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  return r;
}

/// The newest generation that committed a step, as the store says ("el/live": "<g> <step>"),
/// and the step count the group last noted ("el/step"): what a source must hold.
struct live_mark {
  int gen = -1;            ///< -1: no generation committed a step yet
  std::uint64_t step = 0;  ///< at least this many steps were committed
  bool sharded = false;    ///< its state is sharded over its ranks (process_group::note_sharded_state)
};
/// The store's form of the live mark: "<gen> <step>[ sharded]".
inline std::string encode(const live_mark& m) {
  return std::to_string(m.gen) + " " + std::to_string(m.step) + (m.sharded ? " sharded" : "");
}
inline std::optional<live_mark> decode_live(std::string_view s) {
  live_mark m;
  const auto a = s.find(' ');
  if (a == std::string_view::npos) return std::nullopt;
  const auto b = s.find(' ', a + 1);
  try {
    m.gen = std::stoi(std::string(s.substr(0, a)));
    m.step =
        std::stoull(std::string(s.substr(a + 1, b == std::string_view::npos ? std::string_view::npos : b - a - 1)));
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (b != std::string_view::npos) {
    if (s.substr(b + 1) != "sharded") return std::nullopt;
    m.sharded = true;
  }
  return m;
}

/// A source of the group's state: it holds the state of the live generation or of a later one
/// (formed from it, by induction), or the job's initial state while nothing was committed.
inline bool is_source(const registrant& r, const live_mark& live) {
  return r.holds != holds_nothing && r.holds >= live.gen;
}

/// A round, as one process sees it while it waits for it to close.
struct round_view {
  int round = 0;
  std::vector<registrant> registered;  ///< in arrival order
  int prev_size = 0;                   ///< ranks of the last generation (expected back)
  std::vector<bool> back;              ///< by old rank: registered in this round
  std::vector<bool> dead;              ///< by old rank: found dead in the last generation
  live_mark live;
  std::chrono::milliseconds open_for{0};  ///< since this process registered
};

/// The rules a round closes by.
struct round_rules {
  int min = 1, max = 1;
  std::chrono::milliseconds settle{0};   ///< wait for a rank neither back nor found dead
  std::chrono::milliseconds first{0};    ///< round 0: wait for the launcher's ranks
  std::chrono::milliseconds timeout{0};  ///< the group's timeout: a round never waits longer
};

/// What a round becomes.
struct round_decision {
  enum kind { wait, form, lost } what = wait;
  std::vector<std::int64_t> members;  ///< form: the registrations (idx) in rank order
  std::string why;                    ///< form: why now; lost: what happened
  /// form: every member holds the live state as of one step (equal_state), so their parameters
  /// are bitwise equal and the new generation's wrappers need not broadcast them.
  bool equal_state = false;
};

/// Every rank of the last generation has come back or was found dead (round 0: came).
inline bool all_accounted(const round_view& v) {
  for (int q = 0; q < v.prev_size; ++q) {
    const bool back = q < static_cast<int>(v.back.size()) && v.back[q];
    const bool dead = v.round > 0 && q < static_cast<int>(v.dead.size()) && v.dead[q];
    if (!back && !dead) return false;
  }
  return true;
}

/// The members of a round that closes now, in rank order: the sources first (the most steps
/// first, then their old ranks: rank 0 stays rank 0 while it lives), then everyone else in
/// the order they came; at most `max`.
inline std::vector<std::int64_t> member_order(const round_view& v, int max) {
  std::vector<const registrant*> src, rest;
  for (const auto& r : v.registered) (is_source(r, v.live) ? src : rest).push_back(&r);
  std::stable_sort(src.begin(), src.end(), [](const registrant* a, const registrant* b) {
    if (a->step != b->step) return a->step > b->step;
    if (a->place != b->place) return a->place < b->place;
    return a->idx < b->idx;
  });
  std::stable_sort(rest.begin(), rest.end(), [](const registrant* a, const registrant* b) { return a->idx < b->idx; });
  std::vector<std::int64_t> out;
  for (const auto* r : src) out.push_back(r->idx);
  for (const auto* r : rest) out.push_back(r->idx);
  if (static_cast<int>(out.size()) > max) out.resize(static_cast<std::size_t>(max));
  return out;
}

/// Whether the members of a round that closes hold the same state, bit for bit: each is a
/// source that holds a generation's state (it joined one: the launcher's initial state is each
/// rank's own, which the first construction makes equal), all as of the same committed step. By
/// the protocol every member of a generation applied every step it committed, so such members
/// hold what rank 0 holds; a newcomer, a rank left behind (frozen while a later generation
/// committed) or one whose apply was torn is no source, and a source one step behind differs.
inline bool equal_state(const round_view& v, const std::vector<std::int64_t>& members) {
  if (members.empty()) return false;
  std::uint64_t step = 0;
  for (std::size_t k = 0; k < members.size(); ++k) {
    const auto r = std::find_if(v.registered.begin(), v.registered.end(),
                                [&](const registrant& x) { return x.idx == members[k]; });
    if (r == v.registered.end() || !is_source(*r, v.live) || r->holds < 0) return false;
    if (k == 0) step = r->step;
    if (r->step != step) return false;
  }
  return true;
}

/// The words every "the state is gone" error holds (error.hpp).
using ::ddp::detail::state_lost_words;

/// The text of a round whose state is gone.
inline std::string state_lost_text(const round_view& v, std::string_view how) {
  return std::string(state_lost_words) + " of step " + std::to_string(v.live.step) + " left (generation " +
         std::to_string(v.live.gen < 0 ? 0 : v.live.gen) + "; round " + std::to_string(v.round) + " has " +
         std::to_string(v.registered.size()) + " process(es), none of which holds it: " + std::string(how) +
         "): training cannot go on from there; restart from the last checkpoint (ddprun --max-restarts does)";
}

/// Whether round `v` closes now, with whom, or is lost. Called by a process that may close a
/// round (a rank of the last generation, or of a formation that failed); a newcomer waits.
inline round_decision decide_round(const round_view& v, const round_rules& r) {
  round_decision d;
  if (v.live.sharded) {
    // Each rank alone held its shard's optimizer state: a generation without one of them, or
    // rebuilt wrappers, would go on with shards reset to zero. Nothing re-shards it in memory
    // yet, so the job ends here, loudly, on every process that looks.
    d.what = round_decision::lost;
    d.why = "the state of step " + std::to_string(v.live.step) + " is sharded over the ranks of generation " +
            std::to_string(v.live.gen) + " (dp_options::shard), so " + std::string(state_lost_words) +
            " is needed, and a re-formed group would lose the "
            "shards of the ranks that left, or reset every shard's optimizer state (re-sharding in memory is not "
            "built): training cannot go on from there; restart from the last checkpoint (ddprun --max-restarts does)";
    return d;
  }
  const int n = static_cast<int>(v.registered.size());
  const bool any_source =
      std::any_of(v.registered.begin(), v.registered.end(), [&](const registrant& x) { return is_source(x, v.live); });
  const bool accounted = all_accounted(v);
  if (!any_source) {
    // Nobody here holds the state: it never forms (a group of newcomers would start over from
    // their own first step and call it success). The job ends, loudly, as soon as nobody who
    // holds it can still come: every rank of the last generation is back or dead, or the
    // timeout passed.
    if (accounted && v.prev_size > 0) {
      d.what = round_decision::lost;
      d.why = state_lost_text(v, "every rank of the last generation is back without it or was found dead");
    } else if (v.open_for >= r.timeout) {
      d.what = round_decision::lost;
      d.why = state_lost_text(v, "none came back within the timeout of " + std::to_string(r.timeout.count()) + " ms");
    }
    return d;
  }
  // Closed at the maximum; at the minimum or above once every rank of the last generation is
  // back or found dead, or after the wait; below the minimum only when every rank is back or
  // found dead (after the wait: a newcomer may still come), or after the timeout (ranks that
  // neither came nor were found dead may be slow, not gone); the caller then says it fell below.
  const auto wait_more = v.prev_size > 0 && v.round > 0 ? r.settle : r.first;
  const bool waited = v.open_for >= wait_more;
  if (n >= r.max) {
    d.why = "the maximum size";
  } else if (n >= r.min && accounted) {
    d.why = "every rank of the last generation is back or found dead";
  } else if (n >= r.min && waited) {
    d.why = "waited " + std::to_string(wait_more.count()) + " ms for the ranks neither back nor found dead";
  } else if (n < r.min && waited && accounted) {
    d.why = "below the minimum, every rank accounted for";
  } else if (n < r.min && v.open_for >= r.timeout) {
    d.why = "below the minimum after the timeout";
  } else {
    return d;
  }
  d.what = round_decision::form;
  d.members = member_order(v, r.max);
  d.equal_state = equal_state(v, d.members);
  return d;
}

/// The store's form of a closed round: the members' idx in rank order ("3 1 4 2"), followed by
/// " equal" when they hold equal state, or "lost <why>".
inline constexpr std::string_view equal_word = "equal";
inline std::string encode(const round_decision& d) {
  if (d.what == round_decision::lost) return "lost " + d.why;
  std::string s;
  for (auto i : d.members) s += (s.empty() ? "" : " ") + std::to_string(i);
  if (d.equal_state) s += " " + std::string(equal_word);
  return s;
}
inline std::optional<round_decision> decode_round(std::string_view s) {
  round_decision d;
  if (s.substr(0, 5) == "lost ") {
    d.what = round_decision::lost;
    d.why = std::string(s.substr(5));
    return d;
  }
  d.what = round_decision::form;
  std::size_t at = 0;
  while (at < s.size()) {
    auto sp = s.find(' ', at);
    if (sp == std::string_view::npos) sp = s.size();
    if (s.substr(at, sp - at) == equal_word && sp == s.size() && at > 0) {
      d.equal_state = true;
      break;
    }
    try {
      d.members.push_back(std::stoll(std::string(s.substr(at, sp - at))));
    } catch (const std::exception&) {
      return std::nullopt;
    }
    at = sp + 1;
  }
  if (d.members.empty()) return std::nullopt;
  return d;
}

/// What a step becomes once this rank voted: the last vote decides commit (or grow, when
/// newcomers wait and there is room); a rank that finds the group failed before a decision
/// proposes abort. The store's compare-and-set keeps the first proposal: every rank reads it.
enum class step_outcome { pending, commit, grow, abort };
struct step_view {
  std::int64_t votes = 0;  ///< after this rank's vote
  int world = 0;
  int max = 0;
  std::int64_t waiting = 0;  ///< newcomers registered in the next round
  bool group_failed = false;
  bool sharded = false;  ///< the state is sharded over the ranks: no re-formation, so no growth
};
inline step_outcome decide_step(const step_view& v) {
  if (v.votes >= v.world)
    return v.world < v.max && v.waiting > 0 && !v.sharded ? step_outcome::grow : step_outcome::commit;
  return v.group_failed ? step_outcome::abort : step_outcome::pending;
}
inline std::string_view name(step_outcome o) {
  switch (o) {
    case step_outcome::commit:
      return "commit";
    case step_outcome::grow:
      return "grow";
    case step_outcome::abort:
      return "abort";
    default:
      return "";
  }
}

/// What a process that waits for a seat, or comes back to a round, does (a newcomer, or a rank
/// that was frozen while the group went on).
struct seat_view {
  int round = 0;      ///< the round it is registered in (or is about to)
  int current = -1;   ///< the newest generation that formed ("el/gen"; -1: none)
  bool done = false;  ///< the job finished ("el/done")
  bool round_closed = false;
  bool progress = false;              ///< the group committed steps since this process last looked
  std::chrono::milliseconds idle{0};  ///< since it last saw progress
  live_mark live;                     ///< the live generation ("el/live"), read once it idled a timeout
};
struct seat_decision {
  enum kind { wait, leave, move, timeout } what = wait;
  int round = 0;  ///< move: the round to register in
  std::string why;
};
inline seat_decision decide_seat(const seat_view& v, std::chrono::milliseconds timeout) {
  seat_decision d;
  if (v.done) {
    d.what = seat_decision::leave;
    d.why = "the job finished";
  } else if (v.current >= v.round && !v.round_closed) {
    // Its round formed without it and was swept since: it would never see it close.
    d.what = seat_decision::move;
    d.round = v.current + 1;
    d.why = "generation " + std::to_string(v.current) + " formed without it";
  } else if (!v.progress && v.idle >= timeout) {
    // Nothing for a whole timeout: no step committed, no generation took it in. The ranks
    // holding the state would have done one or the other: they are gone (all at once, with no
    // survivor to say so), or stopped.
    d.what = seat_decision::timeout;
    d.why = "waited " + std::to_string(v.idle.count()) +
            " ms for a seat while the group committed no step: " + std::string(state_lost_words) + " of step " +
            std::to_string(v.live.step) +
            (v.live.gen >= 0 ? " (generation " + std::to_string(v.live.gen) + ")" : std::string()) +
            " left or stopped, and no survivor is there to take newcomers in";
  }
  return d;
}

/// A rank of generation `gen` that fails (or thaws) and finds `current` the newest generation:
/// when a later one formed without it, it holds old state and comes back as a newcomer.
inline bool stale(int gen, int current) { return current > gen; }

}  // namespace detail::elastic
}  // namespace DDP_ABI
}  // namespace ddp
