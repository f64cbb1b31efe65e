#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The segment of one `ddp::shm` transport (reducer/shm.hpp), apart from the algorithms that run
// on it: its set-up (one host checked, rank 0 creates the segment or takes over the one the last
// generation of an elastic group parked, publishes its geometry, the others map it, and the name
// goes once all have it), the layout it was given, and its parking for the next generation when
// the transport goes.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/detail/consensus.hpp>
#include <ddp/detail/parked.hpp>
#include <ddp/detail/random.hpp>
#include <ddp/error.hpp>
#include <ddp/group/kv_store.hpp>
#include <ddp/group/topology.hpp>
#include <ddp/group/transport_context.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/detail/shm_segment.hpp>
#include <ddp/reducer/shm_options.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// Pipeline slots per rank in every segment.
inline constexpr std::size_t shm_nslots = 2;

/// A segment the last generation parked (detail/parked.hpp) and its name.
struct shm_parked_segment : parked_object {
  shm_mapping map;
  std::string name;
  shm_layout layout;             ///< its geometry (its parts: as many as it was laid out for)
  int part = 0;                  ///< this rank's part of its arena
  std::size_t reserved_end = 0;  ///< that part has pages up to here (posix_fallocate)
};

/// One transport's segment, set up (open_shm_session).
struct shm_session {
  int rank = 0;              ///< among the segment's ranks
  int size = 1;              ///< ranks sharing the segment
  std::vector<int> members;  ///< the group's ranks of the segment's ranks, ascending
  std::string name;          ///< its name in /dev/shm, unlinked once set up
  bool reused = false;       ///< the last generation's segment, taken over
  int part = 0;              ///< this rank's part of the arena: its rank, or in a segment taken over its part there
  shm_mapping map;
  shm_layout layout{};
  std::size_t kept_reserved = 0;  ///< a segment taken over: this rank's part has pages up to here
  const char* arena_bound = "";   ///< what sized each rank's part of the arena (for messages)

  shm_header* header() const noexcept { return reinterpret_cast<shm_header*>(map.base()); }
  shm_rank_block& block(int r) const noexcept {
    return reinterpret_cast<shm_rank_block*>(map.base() + layout.blocks)[r];
  }

  /// Whether rank 0 may take over `p` for this segment's ranks, whose setup entries are `held`
  /// ("<pid>[ <parked name> <part>]", by group rank): every one of them holds the same parked
  /// segment (so each one's engine on it is gone), in parts of its own, the slots and parts it
  /// was laid out for are as many as this segment's ranks at least, and every process that had
  /// a seat in it is one of them or has exited (a frozen rank of the last generation could wake
  /// and write into it: then a new segment is made, as always). `parts` receives each rank's
  /// part.
  bool can_reuse(const shm_parked_segment& p, const std::vector<std::string>& held, std::vector<int>& parts,
                 const shm_options& o) const {
    if (p.map.base() == nullptr || p.layout.world < size || p.map.size() < p.layout.total) return false;
    if (p.layout.slot_bytes != round_up(o.slot_bytes, shm_page) || p.layout.nslots != shm_nslots) return false;
    std::vector<int> pids;
    parts.clear();
    for (int m : members) {
      std::istringstream in(held[static_cast<std::size_t>(m)]);
      int pid = 0, part_there = -1;
      std::string parked_name;
      if (!(in >> pid >> parked_name >> part_there) || parked_name != p.name || part_there < 0 ||
          part_there >= p.layout.world || std::find(parts.begin(), parts.end(), part_there) != parts.end())
        return false;
      pids.push_back(pid);
      parts.push_back(part_there);
    }
    const auto* h = reinterpret_cast<const shm_header*>(p.map.base());
    if (h->magic != shm_magic || h->version != shm_version) return false;
    const std::size_t blocks = make_shm_layout(1, 4096, shm_nslots, 0).blocks;
    if (blocks + h->world * sizeof(shm_rank_block) > p.map.size()) return false;
    const auto* b = reinterpret_cast<const shm_rank_block*>(p.map.base() + blocks);
    for (std::uint32_t q = 0; q < h->world; ++q) {
      const int pid = b[q].pid.load(std::memory_order_acquire);
      if (pid > 0 && std::find(pids.begin(), pids.end(), pid) == pids.end() && process_alive(pid)) return false;
    }
    return true;
  }

  /// Writes a fresh header and control blocks (rank 0, on a new segment or one taken over).
  void init_header() {
    auto* h = new (map.base()) shm_header{};
    h->magic = shm_magic;
    h->version = shm_version;
    h->world = static_cast<std::uint32_t>(size);
    h->slot_bytes = layout.slot_bytes;
    h->nslots = layout.nslots;
    h->arena_offset = layout.arena;
    h->arena_bytes = layout.arena_bytes;
    h->total_bytes = layout.total;
    h->aborted_by.store(-1, std::memory_order_relaxed);
    h->abort_claim.store(-1, std::memory_order_relaxed);
    h->reason_code = 0;
    h->reason_len = 0;
    for (int r = 0; r < size; ++r) {
      auto* b = new (&block(r)) shm_rank_block{};
      b->counter.store(0, std::memory_order_relaxed);
      b->waiters.store(0, std::memory_order_relaxed);
      b->closed.store(0, std::memory_order_relaxed);
      b->pid.store(0, std::memory_order_relaxed);
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }

  /// Leaves the mapping for the next generation of an elastic group formed on this host from
  /// the same processes, which may take it over (can_reuse) instead of every rank freeing its
  /// pages now and the next segment allocating, zeroing and faulting in as many again. The
  /// elastic group drops it when nobody took it (detail/parked.hpp). `reserved_end`: this
  /// rank's part has pages up to there.
  void park(std::size_t reserved_end) noexcept {
    try {
      auto p = std::make_unique<shm_parked_segment>();
      p->name = name;
      p->layout = layout;
      p->part = part;
      p->reserved_end = reserved_end;
      p->map = std::move(map);
      detail::park(std::move(p));
    } catch (...) {  // no memory for the note: the segment goes now, as without an elastic group
    }
  }
};

/// Sets up the segment of a `ddp::shm` with options `o` on the group of `ctx`, collectively:
/// every rank of the group calls it for its transports in the same order. Raises (as rank
/// ctx.rank()) what any rank could not do, on every rank.
inline shm_session open_shm_session(transport_context& ctx, const shm_options& o) {
  shm_session s;
  const int grank = ctx.rank();
  s.rank = grank;  // the group's ranks, unless members name a subset
  s.size = ctx.size();
  const auto until = ctx.deadline();
  const int channel = ctx.channel();
  auto& pg = ctx.group();
  if (o.members.empty()) {
    for (int r = 0; r < ctx.size(); ++r) s.members.push_back(r);
  } else {
    s.members = o.members;
    const auto me = std::find(s.members.begin(), s.members.end(), grank);
    if (!std::is_sorted(s.members.begin(), s.members.end()) ||
        std::adjacent_find(s.members.begin(), s.members.end()) != s.members.end() || me == s.members.end() ||
        s.members.front() < 0 || s.members.back() >= ctx.size())
      detail::raise(errc::invalid_argument, grank,
                    "shm_options::members must list distinct ranks of the group in ascending order, this rank among "
                    "them");
    s.rank = static_cast<int>(me - s.members.begin());
    s.size = static_cast<int>(s.members.size());
  }
  s.part = s.rank;

  // 1. Same host, sane options: agreed through the process group before touching /dev/shm,
  //    so every rank raises the same error.
  std::string bad;
  if (o.slot_bytes < 4096) bad = "shm_options::slot_bytes must be at least 4096";
  if (o.spin < 0) bad = "shm_options::spin must not be negative";
  const std::string host = o.host_id.empty() ? host_identity() : o.host_id;
  // A segment the last generation of an elastic group left mapped in this process (its
  // engine parked it: detail/parked.hpp). Taken now: reused below when every rank of this
  // segment holds the same one, else released before a new one is made.
  std::unique_ptr<shm_parked_segment> taken = take_parked<shm_parked_segment>();
  auto* parked = taken.get();
  // Each rank's draw of the segment name's random part leads its entry (16 hex digits); the
  // segment's rank 0's is used. It travels over the group's connections, never through the
  // store, so no other local user can know the name before the segment exists and create it
  // first (docs/security.md). Then the host, this process's pid, the name of the segment it
  // holds parked (if any) and its part of that segment's arena, and what is wrong with its
  // options: "<drawn><host>\n<pid>[ <parked name> <part>]\n<bad>".
  char drawn[17];
  std::snprintf(drawn, sizeof drawn, "%016llx", static_cast<unsigned long long>(random_u64()));
  auto hosts =
      pg.all_gather(std::string(drawn) + host + '\n' + std::to_string(::getpid()) +
                    (parked ? " " + parked->name + " " + std::to_string(parked->part) : std::string()) + '\n' + bad);
  std::string secret_part;
  std::vector<std::string> held(static_cast<std::size_t>(ctx.size()));  // by rank: "<pid>[ <name> <part>]"
  for (int r = 0; r < ctx.size(); ++r) {
    auto& h = hosts[static_cast<std::size_t>(r)];
    const auto nl = h.find('\n');
    const auto nl2 = nl == std::string::npos ? nl : h.find('\n', nl + 1);
    if (h.size() < 16 || nl2 == std::string::npos)
      detail::raise(errc::protocol, grank, "rank " + std::to_string(r) + " sent a malformed shm setup entry");
    if (r == s.members[0]) secret_part = h.substr(0, 16);
    held[static_cast<std::size_t>(r)] = h.substr(nl + 1, nl2 - nl - 1);
    if (nl2 + 1 < h.size())
      detail::raise(errc::invalid_argument, grank, "rank " + std::to_string(r) + ": " + h.substr(nl2 + 1));
    h.erase(nl);  // the host
    h.erase(0, 16);
  }
  for (int r = 1; r < s.size; ++r) {
    const auto& a = hosts[static_cast<std::size_t>(s.members[0])];
    const auto& b = hosts[static_cast<std::size_t>(s.members[static_cast<std::size_t>(r)])];
    if (a.substr(0, a.find('\n')) != b.substr(0, b.find('\n')))
      detail::raise(errc::unsupported, grank,
                    "shm needs all its ranks on one host; ranks " + std::to_string(s.members[0]) + " and " +
                        std::to_string(s.members[static_cast<std::size_t>(r)]) + " are on different hosts (" +
                        a.substr(0, a.find('\n')) + " vs " + b.substr(0, b.find('\n')) +
                        "); use ddp::tcp or ddp::hierarchical across hosts");
  }

  // 2. Rank 0 creates the segment and publishes its geometry; the others map it.
  char idhex[17];
  std::snprintf(idhex, sizeof idhex, "%016llx", static_cast<unsigned long long>(ctx.group_id()));
  s.name = "/ddp-" + std::string(idhex) + "-" + std::to_string(channel);
  if (!o.members.empty()) s.name += "-" + std::to_string(s.members[0]);  // one segment per host
  s.name += "-" + secret_part;
  const std::string key = "ddp/shm" + s.name;
  std::string why;
  // The name must go even when this constructor throws (a peer lost during setup), or it
  // would stay in /dev/shm after every process has ended. Every rank removes it on failure:
  // rank 0 may be the one lost, killed between creating the segment and unlinking it. The
  // name is this group's own (its id and a random part only its members know), so nothing
  // else can be removed by it.
  struct unlink_guard {
    const std::string* name = nullptr;
    ~unlink_guard() {
      if (name != nullptr) ::shm_unlink(name->c_str());
    }
  } guard{&s.name};
  if (s.rank == 0) {
    const std::size_t before = make_shm_layout(s.size, o.slot_bytes, shm_nslots, 0).arena;
    const auto arena = shm_arena(s.size, o.segment_bytes, before);
    s.layout = make_shm_layout(s.size, o.slot_bytes, shm_nslots, arena.bytes);
    s.arena_bound = arena.bound;
    std::vector<int> parts;  // reuse: each rank's part of the arena, its part in the last generation
    s.reused = parked != nullptr && s.can_reuse(*parked, held, parts, o);
    std::string geometry = std::to_string(s.layout.slot_bytes) + " " + std::to_string(s.layout.arena_bytes);
    if (s.reused) {
      // The last generation's segment, which every rank here holds mapped and nobody else
      // can touch any more. Its geometry stays (its slots and arena parts were laid out for
      // as many ranks as it had, at least as many as now), each rank keeps the part of the
      // arena it had, whose pages are still in its page tables, and only the header and the
      // control blocks start anew.
      s.layout = parked->layout;
      s.part = parts[0];
      s.kept_reserved = parked->reserved_end;
      s.map = std::move(parked->map);
      s.init_header();
      geometry = std::to_string(s.layout.slot_bytes) + " " + std::to_string(s.layout.arena_bytes) + " " +
                 std::to_string(s.layout.world);
      for (int q : parts) geometry += " " + std::to_string(q);
    } else {
      taken.reset();  // released before a new segment takes its room
      parked = nullptr;
      // Header, control blocks and slots are reserved now; the arena as it is handed out.
      why = s.map.create(s.name, s.layout.total, s.layout.arena);
      if (why.rfind("mmap(", 0) == 0)
        why = "mapping its " + shm_mib(s.layout.total) + " of address space (an arena sized by " + arena.bound +
              "; pass shm_options::segment_bytes to map less): " + why;
      else if (!why.empty() && why.rfind("another process holds", 0) != 0)
        why = "header and staging slots (" + shm_mib(s.layout.arena) + "): " + why;
      if (why.empty()) s.init_header();
    }
    // "ok <slot bytes> <arena bytes>", or "reuse <slot bytes> <arena bytes> <parts> <part of
    // rank 0> <part of rank 1> ...".
    ctx.store().set(key, why.empty() ? std::string(s.reused ? "reuse " : "ok ") + geometry : "error " + why, until);
  } else {
    const std::string v = ctx.store().get(key, until);
    std::istringstream in(v);
    std::string how;
    std::size_t slot = 0, arena = 0;
    int parts = s.size;
    in >> how >> slot >> arena;
    if (how == "reuse") in >> parts;
    std::vector<int> part_of(static_cast<std::size_t>(s.size), -1);
    for (int r = 0; how == "reuse" && r < s.size; ++r) in >> part_of[static_cast<std::size_t>(r)];
    const bool parts_ok = parts >= s.size && std::all_of(part_of.begin(), part_of.end(), [&](int q) {
                            return how != "reuse" || (q >= 0 && q < parts);
                          });
    if (v.rfind("error ", 0) == 0) {
      why = "rank 0 could not create the segment: " + v.substr(6);
    } else if (in.fail() || (how != "ok" && how != "reuse") || !parts_ok) {
      why = "malformed segment geometry '" + v + "' in the store";
    } else {
      s.layout = make_shm_layout(parts, slot, shm_nslots, arena);
      s.arena_bound = shm_arena(s.size, o.segment_bytes, s.layout.arena).bound;
      s.reused = how == "reuse";
      if (!s.reused) {
        taken.reset();
        why = s.map.open(s.name, s.layout.total);
      } else if (parked != nullptr && parked->map.size() >= s.layout.total) {
        s.map = std::move(parked->map);  // the one rank 0 found every rank holding
        s.part = part_of[static_cast<std::size_t>(s.rank)];
        if (s.part == parked->part) s.kept_reserved = parked->reserved_end;
      } else {
        why = "rank 0 reuses the last generation's segment, which this process no longer holds";
      }
      if (why.empty() &&
          (s.header()->magic != shm_magic || s.header()->version != shm_version ||
           s.header()->world != static_cast<std::uint32_t>(s.size) || s.header()->total_bytes != s.layout.total))
        why = "segment " + s.name + " has an unexpected header";
    }
  }
  taken.reset();
  if (why.empty()) s.block(s.rank).pid.store(static_cast<std::int32_t>(::getpid()), std::memory_order_release);
  // 3. Once everyone has it mapped (or failed), the name goes: the mapping keeps the memory.
  // Every rank removes it (a second removal finds nothing): a rank returns from all_gather
  // only after every rank had mapped the segment, and rank 0 may be killed right after it
  // sent its part, before it could remove the name itself.
  const auto failed =
      first_failed([&](const std::string& m) { return pg.all_gather(m); }, group_failure{errc::system, why, -1, grank});
  ::shm_unlink(s.name.c_str());
  guard.name = nullptr;
  if (failed.rank >= 0)
    detail::raise(errc::system, grank,
                  "shared-memory segment " + s.name + " could not be set up on rank " + std::to_string(failed.rank) +
                      ": " + failed.what.text);

  return s;
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
