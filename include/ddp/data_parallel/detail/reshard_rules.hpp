#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/reshard_rules.hpp
/// The decisions of the sharded mode's replicas (`dp_options::shard_replicas`), as pure
/// functions: which ranks hold each shard (`holders_of`), what a rank says it holds when a new
/// generation's wrapper is built (`holding`, its text form), and from whom each element of
/// every bucket comes when the new wrapper re-shards the state in memory (`plan`), or that a
/// part of it has no holder left (`plan::lost`). The wrapper (shard_ops.hpp) gathers the
/// holdings and acts. See docs/sharded.md, "Surviving failures".
// IWYU pragma: private

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail::reshard {

/// The ranks holding each shard of a group of `host_of.size()` ranks (`host_of[r]`: rank r's
/// host), `replicas` of each (capped at the world size), shard s's own rank first. Where there
/// are at least `replicas` hosts, each holder of a shard lies on another host (the rank at the
/// same place on the next hosts, wrapping within a smaller host); else the next ranks in order.
inline std::vector<std::vector<int>> holders_of(const std::vector<int>& host_of, int replicas) {
  const int world = static_cast<int>(host_of.size());
  const int r = std::clamp(replicas, 1, std::max(world, 1));
  std::vector<std::vector<int>> hosts;
  std::vector<int> place(host_of.size());
  for (int q = 0; q < world; ++q) {
    const auto h = static_cast<std::size_t>(host_of[static_cast<std::size_t>(q)]);
    if (hosts.size() <= h) hosts.resize(h + 1);
    place[static_cast<std::size_t>(q)] = static_cast<int>(hosts[h].size());
    hosts[h].push_back(q);
  }
  const bool spread = static_cast<int>(hosts.size()) >= r &&
                      std::none_of(hosts.begin(), hosts.end(), [](const auto& m) { return m.empty(); });
  std::vector<std::vector<int>> out(static_cast<std::size_t>(world));
  for (int s = 0; s < world; ++s) {
    auto& h = out[static_cast<std::size_t>(s)];
    for (int j = 0; j < r; ++j) {
      if (spread) {
        const auto& m =
            hosts[(static_cast<std::size_t>(host_of[static_cast<std::size_t>(s)]) + static_cast<std::size_t>(j)) %
                  hosts.size()];
        h.push_back(m[static_cast<std::size_t>(place[static_cast<std::size_t>(s)]) % m.size()]);
      } else {
        h.push_back((s + j) % world);
      }
    }
  }
  return out;
}

/// The shards rank `rank` holds, its own first, given `holders_of`'s table.
inline std::vector<int> shards_of(const std::vector<std::vector<int>>& holders, int rank) {
  std::vector<int> mine;
  if (rank >= 0 && static_cast<std::size_t>(rank) < holders.size()) mine.push_back(rank);
  for (std::size_t s = 0; s < holders.size(); ++s)
    if (static_cast<int>(s) != rank && std::find(holders[s].begin(), holders[s].end(), rank) != holders[s].end())
      mine.push_back(static_cast<int>(s));
  return mine;
}

/// What one rank of a new group holds from its last generation's sharded wrapper (as it parked
/// it when it went): nothing (`any` false: a newcomer, a first wrapper, a torn step), or the
/// shards `shards` of that group of `world` ranks (whose hosts were `host_of`, `replicas` per
/// shard), where it was `rank`, at `steps` optimizer steps, with `k` floats of optimizer state
/// per element, for the plan whose fingerprint is `plan`.
struct holding {
  bool any = false;
  std::uint64_t steps = 0;
  std::uint64_t plan = 0;
  std::uint64_t k = 0;
  int world = 0;
  int rank = -1;
  int replicas = 1;
  std::vector<int> host_of;
  std::vector<int> shards;
  friend bool operator==(const holding&, const holding&) = default;
};

/// The text a rank all-gathers: "-" for nothing, else
/// "steps plan k world rank replicas h0,h1,... s0,s1,...".
inline std::string encode(const holding& h) {
  if (!h.any) return "-";
  const auto list = [](const std::vector<int>& v) {
    std::string s;
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i > 0) s += ',';
      s += std::to_string(v[i]);
    }
    return s.empty() ? std::string("_") : s;
  };
  return std::to_string(h.steps) + " " + std::to_string(h.plan) + " " + std::to_string(h.k) + " " +
         std::to_string(h.world) + " " + std::to_string(h.rank) + " " + std::to_string(h.replicas) + " " +
         list(h.host_of) + " " + list(h.shards);
}

inline std::optional<holding> decode(std::string_view s) {
  holding h;
  if (s == "-") return h;
  std::vector<std::string_view> f;
  while (!s.empty()) {
    const auto sp = s.find(' ');
    f.push_back(s.substr(0, sp));
    if (sp == std::string_view::npos) break;
    s.remove_prefix(sp + 1);
  }
  if (f.size() != 8) return std::nullopt;
  const auto num = [](std::string_view t, auto& v) {
    return !t.empty() && std::from_chars(t.data(), t.data() + t.size(), v).ptr == t.data() + t.size();
  };
  const auto list = [&](std::string_view t, std::vector<int>& v) {
    if (t == "_") return true;
    while (true) {
      const auto c = t.find(',');
      int x = 0;
      if (!num(t.substr(0, c), x)) return false;
      v.push_back(x);
      if (c == std::string_view::npos) return true;
      t.remove_prefix(c + 1);
    }
  };
  if (!num(f[0], h.steps) || !num(f[1], h.plan) || !num(f[2], h.k) || !num(f[3], h.world) || !num(f[4], h.rank) ||
      !num(f[5], h.replicas) || !list(f[6], h.host_of) || !list(f[7], h.shards))
    return std::nullopt;
  if (h.world <= 0 || static_cast<int>(h.host_of.size()) != h.world || h.rank < 0 || h.rank >= h.world)
    return std::nullopt;
  for (int x : h.shards)
    if (x < 0 || x >= h.world) return std::nullopt;
  h.any = true;
  return h;
}

/// Elements `[lo, hi)` of a bucket of `numel` held by shard `s` of a group of `world` ranks
/// (each bucket padded to a multiple of the world size and cut into equal shards).
struct span_of_shard {
  std::size_t lo = 0, hi = 0;
};
inline span_of_shard elements_of(std::size_t numel, int world, int s) {
  const auto w = static_cast<std::size_t>(world);
  const std::size_t per = (numel + w - 1) / w, lo = std::min(numel, per * static_cast<std::size_t>(s));
  return {lo, std::min(numel, lo + per)};
}

/// One piece of the re-sharding: elements `[lo, hi)` of bucket `bucket`, which new rank
/// `provider` sends to every rank (their values and optimizer state), from one shard it holds.
struct segment {
  std::size_t bucket = 0;
  std::size_t lo = 0, hi = 0;
  int provider = 0;
  friend bool operator==(const segment&, const segment&) = default;
};

/// What a new generation's wrapper does with the holdings: nothing held anywhere (`fresh`: a
/// first wrapper, or only newcomers, whom the elastic group never lets form a generation
/// alone), the `segments` to move (every element of every bucket, from a holder at the newest
/// `steps`), or `lost`: the text of the error every rank raises (`code`).
struct plan {
  bool fresh = false;
  std::uint64_t steps = 0;
  std::uint64_t k = 0;
  std::vector<segment> segments;
  std::string lost;
  errc code = errc::state_lost;
};

/// "ranks 1 and 3", "rank 2".
inline std::string rank_list(const std::vector<int>& r) {
  std::string s = r.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < r.size(); ++i)
    s += (i == 0 ? "" : i + 1 == r.size() ? " and " : ", ") + std::to_string(r[i]);
  return s;
}

/// Decides the re-sharding from every new rank's holding (`all[q]`: new rank q's) for a plan of
/// buckets of `numel` elements whose fingerprint is `plan_fp`. Only holders at the newest step
/// count (an older holding is a rank left behind). Each element comes from the lowest new rank
/// that holds it there; an element nobody holds is `lost`, naming the bucket, the elements, the
/// old shard, its holders (those gone) and the step.
inline plan decide(const std::vector<holding>& all, const std::vector<std::size_t>& numel, std::uint64_t plan_fp) {
  plan p;
  std::vector<int> from;  // new ranks holding something
  for (std::size_t q = 0; q < all.size(); ++q)
    if (all[q].any) {
      if (all[q].plan != plan_fp) {
        p.code = errc::mismatch;
        p.lost = "the shards rank " + std::to_string(q) +
                 " holds from the last generation are of another bucket plan than this wrapper's (the parameters or "
                 "the bucket policy changed): they cannot be re-sharded in memory";
        return p;
      }
      p.steps = std::max(p.steps, all[q].steps);
      from.push_back(static_cast<int>(q));
    }
  if (from.empty()) {
    p.fresh = true;
    return p;
  }
  std::erase_if(from, [&](int q) { return all[static_cast<std::size_t>(q)].steps != p.steps; });
  p.k = all[static_cast<std::size_t>(from.front())].k;
  for (int q : from)
    if (all[static_cast<std::size_t>(q)].k != p.k) {
      p.code = errc::mismatch;
      p.lost = "ranks " + std::to_string(from.front()) + " and " + std::to_string(q) + " hold shards of step " +
               std::to_string(p.steps) + " with " + std::to_string(p.k) + " and " +
               std::to_string(all[static_cast<std::size_t>(q)].k) + " floats of optimizer state per element";
      return p;
    }
  for (std::size_t b = 0; b < numel.size(); ++b) {
    // Every boundary of every holder's intervals; between two, one provider or none.
    std::vector<std::size_t> cuts{0, numel[b]};
    for (int q : from) {
      const auto& h = all[static_cast<std::size_t>(q)];
      for (int s : h.shards) {
        const auto e = elements_of(numel[b], h.world, s);
        cuts.push_back(e.lo);
        cuts.push_back(e.hi);
      }
    }
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    int last_shard = -1;
    for (std::size_t c = 0; c + 1 < cuts.size(); ++c) {
      const std::size_t lo = cuts[c], hi = cuts[c + 1];
      int provider = -1, shard = -1;
      for (int q : from) {
        const auto& h = all[static_cast<std::size_t>(q)];
        for (int s : h.shards) {
          const auto e = elements_of(numel[b], h.world, s);
          if (provider < 0 && e.lo <= lo && hi <= e.hi) {
            provider = q;
            shard = s;
          }
        }
        if (provider >= 0) break;
      }
      if (provider < 0) {
        // Named in the terms of the newest holders' group (the first holder's).
        const auto& ref = all[static_cast<std::size_t>(from.front())];
        const auto per = elements_of(numel[b], ref.world, 0).hi;
        const int s = per == 0 ? 0 : static_cast<int>(lo / per);
        const auto holders = holders_of(ref.host_of, ref.replicas);
        std::vector<int> gone;
        for (int r : holders[static_cast<std::size_t>(s)]) gone.push_back(r);
        p.lost = std::string(state_lost_words) + " of shard " + std::to_string(s) + " of bucket " + std::to_string(b) +
                 " (elements " + std::to_string(lo) + " to " + std::to_string(hi) + ") at step " +
                 std::to_string(p.steps) + " is gone: its holders were " + rank_list(gone) + " of the last " +
                 std::to_string(ref.world) + " (dp_options::shard_replicas " + std::to_string(ref.replicas) +
                 "), all lost together, and no rank here holds it: training cannot go on from there; restart from "
                 "the last checkpoint (load_sharded_state; ddprun --max-restarts does)";
        p.segments.clear();
        return p;
      }
      // One segment lies within one of its provider's shards (the provider sends it from there).
      if (!p.segments.empty() && p.segments.back().bucket == b && p.segments.back().provider == provider &&
          p.segments.back().hi == lo && shard == last_shard)
        p.segments.back().hi = hi;
      else if (hi > lo)
        p.segments.push_back({b, lo, hi, provider});
      last_shard = shard;
    }
  }
  return p;
}

}  // namespace detail::reshard
}  // namespace DDP_ABI
}  // namespace ddp
