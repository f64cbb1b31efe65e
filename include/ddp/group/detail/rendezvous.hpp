#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The store half of joining a group: every rank's requests are O(1) in the world size, so the
// same protocol joins 2 ranks or a million.
//
//   rank 0:  cas pg/rank/0 "" -> token      (first: the claim makes its connection a member)
//            set pg/job "<world> <job id>", set pg/id <group id>
//   rank r:  wait pg/job, check it is this job's; cas pg/rank/<r> "" -> token
//   rank 0:  wait for every claim pg/rank/<0..world-1> (world / (store_max_fields - 2)
//            requests), then set pg/complete
//   all:     wait pg/complete; get pg/id
//
// The claim is the arrival: there is no count beside it, so no window in which a rank has
// claimed but not yet counted, and a rank that stopped while joining is always named.
// On a timeout a rank names the missing ranks by asking which claims are absent: in one request
// when the world fits in one (up to store_max_fields - 2 ranks). Larger worlds would have every
// rank scan every claim, so only rank 0 scans them there and posts the list under pg/missing;
// the other ranks wait for it (as long as the naming may take) and quote it.
//
// `Store` is `ddp::kv_store` (group/kv_store.hpp, a layer above detail/): the functions take it as a
// template parameter so that this header needs only the wire protocol, not the store itself.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <ddp/error.hpp>
#include <ddp/group/detail/mesh.hpp>
#include <ddp/group/store_client.hpp>
#include <ddp/detail/random.hpp>
#include <ddp/detail/socket.hpp>
#include <ddp/group/detail/store_protocol.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/group/detail/keys.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// The group's store as the directory where ranks announce their listening address (mesh.hpp).
template <class Store>
link_directory store_directory(Store& st, std::chrono::milliseconds timeout) {
  return {[&st, timeout](const std::string& k, const std::string& v) { st.set(k, v, clock::now() + timeout); },
          [&st](const std::string& k) -> std::optional<std::string> {
            // Short, so that a thread holding the shared connection for a long wait of its own
            // delays a first contact by this much at most each time, and never fails it.
            const auto until = clock::now() + timing::lookup_request;
            try {
              if (!st.check(k, until)) return std::nullopt;
              return st.get(k, until);
            } catch (const error& e) {
              if (e.condition() == errc::timeout) return std::nullopt;
              throw;
            }
          }};
}

/// Lazily made connections for a channel of the group, `prefix` naming it in the store (the
/// directory), its peers' connections arriving through `hub`; `group_failed` says whether a rank
/// recorded a failure (peer_links).
template <class Store>
std::unique_ptr<peer_links> open_links(Store& st, link_hub& hub, std::uint64_t group_id, int size,
                                       std::chrono::milliseconds timeout, const std::string& prefix, int bufsize,
                                       std::function<bool()> group_failed) {
  // Each channel's hellos carry its own id (the group's, mixed with the channel's name): a late
  // first contact meant for a closed channel is never admitted into a new one on the same port.
  std::uint64_t channel = group_id;
  for (unsigned char c : prefix) channel = (channel ^ c) * 0x100000001b3ull;
  return std::make_unique<peer_links>(hub, store_directory(st, timeout), size, prefix, channel, bufsize,
                                      std::move(group_failed));
}

/// The same for a transport, from its `ddp::transport_context`: the group's store, hub, id and
/// verdict (a wait for a peer's connection stops once a rank recorded a failure).
template <class Context>
std::unique_ptr<peer_links> open_links(Context& ctx, const std::string& prefix, int bufsize) {
  return open_links(ctx.store(), ctx.hub(), ctx.group_id(), ctx.size(), ctx.timeout(), prefix, bufsize,
                    [v = &ctx.verdict()] { return v->recorded(); });
}

/// Who joins, for join_store(); `where` ("host:port") and `timeout_ms` are for messages.
struct join_request {
  int rank = 0;
  int world = 1;
  std::string job_id;
  std::string where;
  long long timeout_ms = 0;
  long long heartbeat_ms = 0;  // init_options::heartbeat: every rank must run the same
  bool store_in_rank0 = true;  // rank 0's process serves the store (no launcher's, no external one)
};

/// A job's runs under a launcher that restarts it (`ddprun --max-restarts`): run k > 0 of job
/// "J" has the id "J+restart.k", run 0 the id "J". job_run_id makes it, job_run reads it back.
inline constexpr std::string_view restart_mark = "+restart.";
inline std::string job_run_id(const std::string& job, long k) {
  return k > 0 ? job + std::string(restart_mark) + std::to_string(k) : job;
}
/// {J, k} of a run's id.
inline std::pair<std::string, long> job_run(const std::string& id) {
  const auto at = id.rfind(restart_mark);
  if (at == std::string::npos) return {id, 0};
  const char* digits = id.c_str() + at + restart_mark.size();
  char* end = nullptr;
  const long k = std::strtol(digits, &end, 10);
  if (end == digits || *end != '\0' || k <= 0) return {id, 0};
  return {id.substr(0, at), k};
}

/// Thrown by join_store() when the store on the port is an earlier run of this very job (its
/// ranks are being ended by their launcher, and the store goes with them): the caller connects
/// again until the new run's store answers, within its deadline.
struct earlier_run_store {
  std::string theirs;  // its job id; empty when it closed before it said
};

/// Names ranks compactly: "rank 3", "ranks 1, 2, 5", "ranks 1, 2, ... (40 in all)".
inline std::string name_ranks(const std::vector<int>& ranks, std::size_t shown = 32) {
  if (ranks.empty()) return "no rank";
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size() && i < shown; ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > shown) s += ", ... (" + std::to_string(ranks.size()) + " in all)";
  return s;
}

/// The ranks whose claim key is still missing when the store answers. `patient`: each chunk of
/// claims is waited for until `until` at the store (rank 0's wait for every rank); otherwise
/// for a millisecond (the check after a timeout), though the reply may queue behind thousands
/// of other ranks' requests, so the call still has until `until`.
template <class Store>
std::vector<int> missing_ranks(Store& st, int world, deadline_t until, bool patient = false) {
  std::vector<int> missing;
  const int chunk = static_cast<int>(store_max_fields) - 2;
  for (int lo = 0; lo < world; lo += chunk) {
    std::vector<std::string> keys;
    for (int r = lo; r < std::min(world, lo + chunk); ++r) keys.push_back(keys::seat(r));
    if (clock::now() >= until) raise(errc::timeout, -1, "no time left to list the missing ranks");
    for (auto& k : patient ? st.wait(keys, until) : st.wait(keys, timing::missing_ranks_wait, until))
      missing.push_back(std::atoi(k.c_str() + k.rfind('/') + 1));
  }
  std::sort(missing.begin(), missing.end());
  return missing;
}

/// Runs the store half of joining; returns the group id that rank 0 chose. Throws
/// errc::address_in_use (another job's store), errc::rank_conflict, errc::timeout.
template <class Store>
std::uint64_t join_store(Store& st, const join_request& req, deadline_t until) {
  const int rank = req.rank;
  const std::string job = std::to_string(req.world) + " " + req.job_id;
  // Rank 0's heartbeat rides on its job record (no request more): "\nheartbeat <ms>" when on.
  constexpr std::string_view heartbeat_mark = "\nheartbeat ";
  const auto heartbeat_of = [&](const std::string& record) -> long long {
    const auto at = record.find(heartbeat_mark);
    return at == std::string::npos ? 0 : std::atoll(record.c_str() + at + heartbeat_mark.size());
  };
  auto describe_job = [](const std::string& j) {
    const auto sp = j.find(' ');
    const std::string id = sp == std::string::npos ? std::string() : j.substr(sp + 1);
    return "a group of " + j.substr(0, sp) + " ranks" + (id.empty() ? std::string() : ", job '" + id + "'");
  };
  const std::string port = req.where.substr(req.where.rfind(':') + 1);
  const std::string host = req.where.substr(0, req.where.rfind(':'));

  // A claim token unique to this process; a second claimant of the rank sees another token.
  const std::uint64_t nonce = random_u64();
  char hostname[256] = {};
  ::gethostname(hostname, sizeof hostname - 1);
  const std::string token = std::string(hostname) + ":" + std::to_string(::getpid()) + ":" + std::to_string(nonce);
  const std::string rk = keys::seat(rank);
  auto claim = [&] {
    const auto owner = st.compare_set(rk, "", token, until);
    if (owner != token)
      raise(errc::rank_conflict, rank,
            "rank " + std::to_string(rank) + " is already taken by another process (its claim: '" +
                owner.substr(0, 96) + "'); every process needs its own rank" +
                (st.auth() ? std::string()
                           : std::string(" (without a secret any process that reaches the store can "
                                         "take a free rank: docs/security.md)")) +
                (req.job_id.empty() ? " (if another job of the same size uses " + req.where +
                                          ", give each job its own MASTER_PORT, or a DDP_JOB_ID)"
                                    : ""));
  };

  if (rank == 0) {
    // Rank 0 describes its job (world size, job id) before anything else; every other rank
    // checks that the store on this port is its own job's before it claims a rank: another
    // job's store answering here means the port is taken, not that two processes want a rank.
    claim();
    st.set(keys::job, req.heartbeat_ms > 0 ? job + std::string(heartbeat_mark) + std::to_string(req.heartbeat_ms) : job,
           until);
    st.set(keys::group_id, encode_i64(static_cast<std::int64_t>(nonce)), until);
  } else {
    std::string record;
    try {
      if (!st.wait({keys::job}, until).empty())
        raise(errc::timeout, rank,
              "rendezvous timed out after " + std::to_string(req.timeout_ms) + " ms: the store at " + req.where +
                  " answers, but its rank 0 never described its job");
      record = st.get(keys::job, until);
    } catch (const error& e) {
      // A rank of a restarted run may have reached the earlier run's store just as its
      // launcher ended that run: a store that closes before it said whose it is counts as one.
      if (e.condition() == errc::peer_lost && job_run(req.job_id).second > 0) throw earlier_run_store{};
      throw;
    }
    const auto theirs = record.substr(0, record.find('\n'));
    const auto sp = theirs.find(' ');
    const std::string their_id = sp == std::string::npos ? std::string() : theirs.substr(sp + 1);
    if (!req.job_id.empty() && their_id != req.job_id) {
      const auto [mine_base, mine_run] = job_run(req.job_id);
      const auto [their_base, their_run] = job_run(their_id);
      if (mine_base == their_base && their_run < mine_run) throw earlier_run_store{their_id};
    }
    if (theirs.substr(0, sp) != std::to_string(req.world) ||
        (!req.job_id.empty() && !their_id.empty() && their_id != req.job_id))
      raise(errc::address_in_use, rank,
            "another job holds port " + port + " at " + host + ": the store there serves " + describe_job(theirs) +
                ", this process belongs to " + describe_job(job) + "; give each job its own MASTER_PORT");
    if (const long long hb = heartbeat_of(record); hb != req.heartbeat_ms)
      raise(errc::mismatch, rank,
            "heartbeat mismatch: rank 0 runs a heartbeat lease of " + std::to_string(hb) + " ms, rank " +
                std::to_string(rank) + " one of " + std::to_string(req.heartbeat_ms) +
                " ms (0: none); every rank must set the same DDP_HEARTBEAT_MS (init_options::heartbeat)");
    claim();
  }

  // Rank 0 waits for every claim and announces completion; the others wait for that one key.
  std::string what;
  if (rank == 0) {
    try {
      const auto missing = missing_ranks(st, req.world, until, true);
      if (missing.empty()) {
        st.set(keys::complete, "1", until);
        return static_cast<std::uint64_t>(nonce);
      }
      what = name_ranks(missing) + " of " + std::to_string(req.world) + " never arrived";
    } catch (const error& e) {
      if (e.condition() != errc::timeout) throw;
      // No time was left for a later chunk of claims: ask once more, briefly, who is missing.
    }
  } else {
    bool complete = false;
    try {
      complete = st.wait({keys::complete}, until).empty();
    } catch (const error& e) {
      // The deadline passed while the store's answer was on its way (a store busy with thousands
      // of ranks timing out at once, on a loaded machine): still the rendezvous' timeout, said
      // as such below, not a failure of the store.
      if (e.condition() != errc::timeout) throw;
    }
    if (complete) return static_cast<std::uint64_t>(decode_i64(st.get(keys::group_id, until)));
  }
  // Name the missing ranks: rank 0 scans the claims and posts what it found; in worlds that fit
  // one request the others scan them too, in larger ones they quote rank 0's list.
  const auto budget = clock::now() + timing::missing_ranks_budget;
  try {
    if (what.empty() && (rank == 0 || req.world <= static_cast<int>(store_max_fields) - 2)) {
      const auto missing = missing_ranks(st, req.world, budget);
      if (!missing.empty())
        what = name_ranks(missing) + " of " + std::to_string(req.world) + " never arrived";
      else if (rank == 0)
        what = "every rank claimed its place, but the last claims came as the deadline passed";
      else
        what =
            "every rank claimed its place, but rank 0 never announced that the group was complete (rank 0 "
            "stopped or froze while joining)";
    } else if (what.empty() && st.wait({keys::missing}, budget).empty()) {  // rank 0 posts it as it times out
      what = st.get(keys::missing, budget);
    } else if (what.empty()) {
      what = "not every rank of " + std::to_string(req.world) + " arrived (rank 0's error names them)";
    }
    if (rank == 0) st.set(keys::missing, what, budget);
  } catch (const error&) {
    // The store stopped answering: where rank 0's process serves it, rank 0 stopped or froze.
    if (what.empty() && req.store_in_rank0 && rank != 0)
      what = "rank 0, whose process serves the group's store at " + req.where +
             ", stopped answering (it stopped, froze or lost its network while the group formed)";
    else if (what.empty())
      what = "not every rank of " + std::to_string(req.world) + " arrived (the store at " + req.where +
             " stopped answering)";
  }
  raise(errc::timeout, rank, "rendezvous timed out after " + std::to_string(req.timeout_ms) + " ms: " + what);
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
