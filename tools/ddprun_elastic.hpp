// ddprun's decisions, pure functions of what the launcher saw of its ranks: which rank caused a
// failed job (first_cause), and under --elastic whether the group's state is gone, from their
// ranks' lives (tools/ddprun.cpp; tests/unit/test_ddprun_elastic.cpp; docs/elastic.md, "The
// launcher"). A pure function: no process, clock or store of its own.
//
// The state (the weights, the optimizer's, the program's on_state blob) lives only in the
// members of the group. The first generation's ranks hold it from the start; a replacement
// (a newcomer, DDP_RESTART_COUNT > 0) gets it from a member when it joins, so it can hold it
// only if a holder was alive when it started. When no holder is left alive, every newcomer
// would wait for a group that will never take it in (a whole timeout each, again and again):
// the state is gone. The rule errs on the side of "not gone": a replacement that started
// while a holder was alive counts as a holder, although that holder may have died before it
// took it in (that replacement then fails after one timeout, and the state is found gone then).
#pragma once

#ifndef DDP_ALLOW_DETAIL_HEADERS
#define DDP_ALLOW_DETAIL_HEADERS  // the elastic group's words for a lost state, from the library itself
#endif
#include <ddp/group/detail/elastic_rules.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace ddprun {

/// One process ddprun started in a slot of an elastic job.
struct rank_life {
  static constexpr std::int64_t running = std::numeric_limits<std::int64_t>::max();
  int slot = 0;
  std::int64_t start_ns = 0;
  std::int64_t end_ns = running;  ///< when it ended (its keeper's note); `running` while it runs
  int code = 0;                   ///< how it ended: its exit status, 128 + signal when killed
  bool replacement = false;       ///< started as a newcomer into a running group
  bool said_lost = false;         ///< it wrote that every rank holding the state is gone
};

/// The verdict: `lost` with a line that says why, the status to exit with (the code of the
/// first of the last holders to end), and when the state was gone (the last holder's end):
/// a replacement started since never had a group to join.
struct state_verdict {
  bool lost = false;
  std::string why;
  int code = 0;
  std::int64_t gone_ns = 0;
};

/// A rank that ended with a failure, as ddprun saw it: when its keeper noted the end, and the
/// last error line it wrote (empty when it wrote none: killed, crashed).
struct failed_rank {
  int rank = -1;
  std::int64_t at_ns = 0;
  std::string_view last_error;
};

/// True when `said` is a ddp error that reports a failure of the group, not one of the rank's
/// own: a peer lost, an abort, a collective's deadline (`[ddp.peer_lost]`, `[ddp.aborted]`,
/// `[ddp.timeout]`).
inline bool failed_because_of_the_group(std::string_view said) {
  for (const std::string_view tag : {"[ddp.peer_lost]", "[ddp.aborted]", "[ddp.timeout]"})
    if (said.find(tag) != std::string_view::npos) return true;
  return false;
}

/// The rank to blame for a job's failure: the first to end that failed on its own (killed,
/// crashed, an error of its own), else the first to end. Ranks fail together, and on a loaded
/// machine a killed rank's keeper may note its end after a survivor has already exited
/// reporting it lost: the order of the notes alone would blame that survivor. -1 when none.
inline int first_cause(const std::vector<failed_rank>& failed) {
  int pick = -1;
  bool pick_own = false;
  std::int64_t pick_at = 0;
  for (const auto& f : failed) {
    const bool own = !failed_because_of_the_group(f.last_error);
    if (pick < 0 || (own && !pick_own) || (own == pick_own && f.at_ns < pick_at)) {
      pick = f.rank;
      pick_own = own;
      pick_at = f.at_ns;
    }
  }
  return pick;
}

/// What a rank writes when, as a newcomer, it finds no member left to take it in.
inline constexpr std::string_view state_lost_text = ddp::detail::elastic::state_lost_words;

/// Whether the elastic group's state is gone, from every process started in this run of the
/// job (`slots` of them at a time). `whole_group`: these slots are the whole group (one host);
/// on several hosts the others' ranks may hold the state, and only the ranks' own word counts
/// (each slot's last process ended saying so). A job with a process that ended normally
/// (code 0) is done, not lost.
inline state_verdict elastic_state(const std::vector<rank_life>& lives, int slots, bool whole_group) {
  if (lives.empty()) return {};
  for (const auto& l : lives)
    if (l.end_ns != rank_life::running && l.code == 0) return {};
  // The ranks' own word: every slot's last process ended saying that the state is gone.
  {
    std::vector<const rank_life*> last(static_cast<std::size_t>(std::max(slots, 0)), nullptr);
    for (const auto& l : lives)
      if (l.slot >= 0 && l.slot < slots && (!last[l.slot] || l.start_ns >= last[l.slot]->start_ns)) last[l.slot] = &l;
    const bool all_said = slots > 0 && std::all_of(last.begin(), last.end(), [](const rank_life* l) {
                            return l != nullptr && l->end_ns != rank_life::running && l->said_lost;
                          });
    if (all_said) {
      const auto by_end = [](const rank_life* a, const rank_life* b) { return a->end_ns < b->end_ns; };
      return {true, "every rank of the elastic group exited saying that " + std::string(state_lost_text) + " is gone",
              (*std::min_element(last.begin(), last.end(), by_end))->code,
              (*std::max_element(last.begin(), last.end(), by_end))->end_ns};
    }
  }
  if (!whole_group) return {};
  // Holders, in the order started: the first generation, and each replacement that started
  // while a holder was alive.
  std::vector<const rank_life*> order;
  for (const auto& l : lives) order.push_back(&l);
  std::stable_sort(order.begin(), order.end(),
                   [](const rank_life* a, const rank_life* b) { return a->start_ns < b->start_ns; });
  std::vector<const rank_life*> holders;
  for (const auto* l : order) {
    const bool holds = !l->replacement || std::any_of(holders.begin(), holders.end(),
                                                      [&](const rank_life* h) { return h->end_ns > l->start_ns; });
    if (holds) holders.push_back(l);
  }
  for (const auto* h : holders)
    if (h->end_ns == rank_life::running) return {};
  // Gone. The last holders: those alive when the last of them started, all ended since.
  const std::int64_t latest_start = holders.back()->start_ns;
  std::int64_t first_end = rank_life::running, last_end = 0;
  int code = 0, count = 0;
  for (const auto* h : holders) {
    if (h->end_ns < latest_start) continue;
    ++count;
    last_end = std::max(last_end, h->end_ns);
    if (h->end_ns < first_end) {
      first_end = h->end_ns;
      code = h->code;
    }
  }
  char within[32];
  std::snprintf(within, sizeof within, "%.1f", static_cast<double>(last_end - first_end) / 1e9);
  const std::string who = count >= slots
                              ? "every rank of the elastic group"
                              : "the last " + std::to_string(count) + " ranks holding the elastic group's state";
  return {true, who + " died within " + within + " s; the group's state is gone", code, last_end};
}

}  // namespace ddprun
