#pragma once
/// \file reducer/shm.hpp
/// `ddp::shm`: collectives between the ranks of one host through one POSIX shared-memory
/// segment. Ordinary user buffers are pipelined through per-rank staging slots; buffers that
/// already live in the segment's arena (see `ddp::shm_allocator`) are reduced in place, each
/// input read once and each output written once. See docs/reducers.md.
///
/// The engine is synchronous and has no threads of its own: one thread per instance (the
/// reducer's progress thread) calls the collectives, in the same order on every rank.
///
/// How it synchronizes. Each rank owns one 32-bit counter in the segment and bumps it at every
/// step ("signal"); all ranks send the same signals in the same order, so "rank j finished step
/// k" is simply "counter j >= k". A waiter spins briefly (or, when the peer last signalled from
/// the waiter's own core, yields to it at once), then sleeps on the counter with a futex in
/// slices, checking the deadline, abort and the peer's pid between slices.
///
/// Determinism. Every element of a result is computed once, by one rank, as
/// `in_0 op in_1 op ... op in_{n-1}` in rank order (the `combine` kernel), and then only copied,
/// so every rank ends with the same bits.

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/detail/collective.hpp>
#include <ddp/detail/consensus.hpp>
#include <ddp/detail/first_failure.hpp>
#include <ddp/detail/fork.hpp>
#include <ddp/reducer/detail/futex.hpp>
#include <ddp/detail/kernels.hpp>
#include <ddp/detail/parked.hpp>
#include <ddp/detail/random.hpp>
#include <ddp/reducer/detail/schedule.hpp>
#include <ddp/reducer/detail/shm_segment.hpp>
#include <ddp/detail/socket.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/group/store_client.hpp>
#include <ddp/group/topology.hpp>
#include <ddp/group/verdict.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/basic_reducer.hpp>
#include <ddp/reducer/detail/front_end.hpp>

namespace ddp {
inline namespace v0 {

/// Allreduce algorithm of `ddp::shm`.
enum class shm_algo : std::uint8_t {
  /// Reduce-scatter + allgather: rank r reduces slice r of every rank's input and writes it to
  /// every rank's output. Reads and writes each byte once per rank: the bandwidth path.
  ring,
  /// Every rank reduces the whole message from all ranks' staging slots into its own buffer:
  /// one synchronization less per chunk, n times the reads. The latency path for small messages.
  tree,
};

constexpr const char* shm_algo_name(shm_algo a) noexcept { return a == shm_algo::tree ? "tree" : "ring"; }

/// Tunables of `ddp::shm`; see docs/reducers.md. Geometry (segment and slot sizes) is taken
/// from rank 0; `spin` and `host_id` are per rank.
struct shm_options {
  /// Bytes of the zero-copy arena that `ddp::shm_allocator` hands out; each rank owns
  /// segment_bytes / world of it. 0 (the default): each rank's part is as large as /dev/shm, so
  /// the arena holds whatever fits in /dev/shm. Either way pages are reserved only as blocks are
  /// handed out. See "Shared-memory sizing" in docs/reducers.md.
  std::size_t segment_bytes = 0;
  /// Staging bytes per rank per pipeline slot (two slots). Cache-sized, so staged chunks stay
  /// in L2/L3 between the copy-in, the reduction and the copy-out.
  std::size_t slot_bytes = std::size_t{1} << 20;
  /// Polls of a peer's counter before sleeping on it. When there are more ranks than cores a
  /// spinning waiter steals the core its peer needs, so the engine spins less then.
  int spin = 2000;
  /// Overrides the host identity compared across ranks (empty: `DDP_HOST_ID` when set, else the
  /// host name, boot id, network namespace and /dev/shm's device). Lets tests pretend ranks
  /// live on different hosts.
  std::string host_id{};
  /// The group's ranks that share this segment, ascending (empty: every rank of the group).
  /// Every rank of the group constructs its `shm` at the same time, each naming its own host's
  /// ranks (`ddp::topology`): one segment per host, as `ddp::hierarchical` builds them.
  /// `rank()` and `size()` are then this host's; errors name the group's ranks.
  std::vector<int> members{};
  friend bool operator==(const shm_options&, const shm_options&) = default;
};

/// Shared-memory collectives engine for ranks on one host (the engine of `ring<shm>` and `tree<shm>`,
/// and usable on its own).
///
/// Construction is collective: every rank of `pg` constructs its `shm` objects in the same
/// order. The segment's name is unlinked as soon as all ranks mapped it, so nothing is left in
/// /dev/shm even when a rank crashes later.
/// \code
/// auto pg = ddp::init_process_group(ddp::init_options::from_env());
/// ddp::shm link{pg};
/// std::vector<float> g(1 << 20, 1.0f);
/// link.allreduce(g.data(), g.size(), ddp::dtype::f32, ddp::op::sum, pg.deadline());
/// \endcode
class shm {
 public:
  /// Built from the group (`ddp::shm s{pg}`), collectively.
  explicit shm(transport_context ctx, shm_options o = {})
      : rank_(ctx.rank()),
        size_(ctx.size()),
        grank_(ctx.rank()),
        opts_(std::move(o)),
        note_after_(std::min<std::chrono::milliseconds>(detail::timing::shm_note_waiting, ctx.timeout() / 4)),
        ctx_(ctx) {
    const auto until = ctx.deadline();
    const int channel = ctx.channel();
    auto& pg = ctx.group();
    if (opts_.members.empty()) {
      for (int r = 0; r < ctx.size(); ++r) members_.push_back(r);
    } else {
      members_ = opts_.members;
      const auto me = std::find(members_.begin(), members_.end(), grank_);
      if (!std::is_sorted(members_.begin(), members_.end()) ||
          std::adjacent_find(members_.begin(), members_.end()) != members_.end() || me == members_.end() ||
          members_.front() < 0 || members_.back() >= ctx.size())
        raise_here(errc::invalid_argument,
                   "shm_options::members must list distinct ranks of the group in ascending order, this rank among "
                   "them");
      rank_ = static_cast<int>(me - members_.begin());
      size_ = static_cast<int>(members_.size());
    }
    part_ = rank_;

    // 1. Same host, sane options: agreed through the process group before touching /dev/shm,
    //    so every rank raises the same error.
    std::string bad;
    if (opts_.slot_bytes < 4096) bad = "shm_options::slot_bytes must be at least 4096";
    if (opts_.spin < 0) bad = "shm_options::spin must not be negative";
    const std::string host = opts_.host_id.empty() ? host_identity() : opts_.host_id;
    // A segment the last generation of an elastic group left mapped in this process (its
    // engine parked it: detail/parked.hpp). Taken now: reused below when every rank of this
    // segment holds the same one, else released before a new one is made.
    std::unique_ptr<detail::parked_object> taken = detail::take_parked();
    auto* parked = dynamic_cast<parked_segment*>(taken.get());
    // Each rank's draw of the segment name's random part leads its entry (16 hex digits); the
    // segment's rank 0's is used. It travels over the group's connections, never through the
    // store, so no other local user can know the name before the segment exists and create it
    // first (docs/security.md). Then the host, this process's pid, the name of the segment it
    // holds parked (if any) and its part of that segment's arena, and what is wrong with its
    // options: "<drawn><host>\n<pid>[ <parked name> <part>]\n<bad>".
    char drawn[17];
    std::snprintf(drawn, sizeof drawn, "%016llx", static_cast<unsigned long long>(detail::random_u64()));
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
        raise_here(errc::protocol, "rank " + std::to_string(r) + " sent a malformed shm setup entry");
      if (r == members_[0]) secret_part = h.substr(0, 16);
      held[static_cast<std::size_t>(r)] = h.substr(nl + 1, nl2 - nl - 1);
      if (nl2 + 1 < h.size())
        raise_here(errc::invalid_argument, "rank " + std::to_string(r) + ": " + h.substr(nl2 + 1));
      h.erase(nl);  // the host
      h.erase(0, 16);
    }
    for (int r = 1; r < size_; ++r) {
      const auto& a = hosts[static_cast<std::size_t>(members_[0])];
      const auto& b = hosts[static_cast<std::size_t>(members_[static_cast<std::size_t>(r)])];
      if (a.substr(0, a.find('\n')) != b.substr(0, b.find('\n')))
        raise_here(errc::unsupported, "shm needs all its ranks on one host; ranks " + std::to_string(members_[0]) +
                                          " and " + std::to_string(members_[static_cast<std::size_t>(r)]) +
                                          " are on different hosts (" + a.substr(0, a.find('\n')) + " vs " +
                                          b.substr(0, b.find('\n')) +
                                          "); use ddp::tcp or ddp::hierarchical across hosts");
    }

    // 2. Rank 0 creates the segment and publishes its geometry; the others map it.
    char idhex[17];
    std::snprintf(idhex, sizeof idhex, "%016llx", static_cast<unsigned long long>(ctx.group_id()));
    name_ = "/ddp-" + std::string(idhex) + "-" + std::to_string(channel);
    if (!opts_.members.empty()) name_ += "-" + std::to_string(members_[0]);  // one segment per host
    name_ += "-" + secret_part;
    const std::string key = "ddp/shm" + name_;
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
    } guard{&name_};
    std::size_t kept_reserved = 0;  // a segment taken over: this rank's part has pages up to here
    if (rank_ == 0) {
      const std::size_t before = detail::make_shm_layout(size_, opts_.slot_bytes, nslots, 0).arena;
      const auto arena = detail::shm_arena(size_, opts_.segment_bytes, before);
      layout_ = detail::make_shm_layout(size_, opts_.slot_bytes, nslots, arena.bytes);
      arena_bound_ = arena.bound;
      std::vector<int> parts;  // reuse: each rank's part of the arena, its part in the last generation
      reused_ = parked != nullptr && can_reuse(*parked, held, parts);
      std::string geometry = std::to_string(layout_.slot_bytes) + " " + std::to_string(layout_.arena_bytes);
      if (reused_) {
        // The last generation's segment, which every rank here holds mapped and nobody else
        // can touch any more. Its geometry stays (its slots and arena parts were laid out for
        // as many ranks as it had, at least as many as now), each rank keeps the part of the
        // arena it had, whose pages are still in its page tables, and only the header and the
        // control blocks start anew.
        layout_ = parked->layout;
        part_ = parts[0];
        kept_reserved = parked->reserved_end;
        map_ = std::move(parked->map);
        init_segment();
        geometry = std::to_string(layout_.slot_bytes) + " " + std::to_string(layout_.arena_bytes) + " " +
                   std::to_string(layout_.world);
        for (int q : parts) geometry += " " + std::to_string(q);
      } else {
        taken.reset();  // released before a new segment takes its room
        parked = nullptr;
        // Header, control blocks and slots are reserved now; the arena as it is handed out.
        why = map_.create(name_, layout_.total, layout_.arena);
        if (why.rfind("mmap(", 0) == 0)
          why = "mapping its " + detail::shm_mib(layout_.total) + " of address space (an arena sized by " +
                arena.bound + "; pass shm_options::segment_bytes to map less): " + why;
        else if (!why.empty() && why.rfind("another process holds", 0) != 0)
          why = "header and staging slots (" + detail::shm_mib(layout_.arena) + "): " + why;
        if (why.empty()) init_segment();
      }
      // "ok <slot bytes> <arena bytes>", or "reuse <slot bytes> <arena bytes> <parts> <part of
      // rank 0> <part of rank 1> ...".
      ctx.store().set(key, why.empty() ? std::string(reused_ ? "reuse " : "ok ") + geometry : "error " + why, until);
    } else {
      const std::string v = ctx.store().get(key, until);
      std::istringstream in(v);
      std::string how;
      std::size_t slot = 0, arena = 0;
      int parts = size_;
      in >> how >> slot >> arena;
      if (how == "reuse") in >> parts;
      std::vector<int> part_of(static_cast<std::size_t>(size_), -1);
      for (int r = 0; how == "reuse" && r < size_; ++r) in >> part_of[static_cast<std::size_t>(r)];
      const bool parts_ok = parts >= size_ && std::all_of(part_of.begin(), part_of.end(), [&](int q) {
                              return how != "reuse" || (q >= 0 && q < parts);
                            });
      if (v.rfind("error ", 0) == 0) {
        why = "rank 0 could not create the segment: " + v.substr(6);
      } else if (in.fail() || (how != "ok" && how != "reuse") || !parts_ok) {
        why = "malformed segment geometry '" + v + "' in the store";
      } else {
        layout_ = detail::make_shm_layout(parts, slot, nslots, arena);
        arena_bound_ = detail::shm_arena(size_, opts_.segment_bytes, layout_.arena).bound;
        reused_ = how == "reuse";
        if (!reused_) {
          taken.reset();
          why = map_.open(name_, layout_.total);
        } else if (parked != nullptr && parked->map.size() >= layout_.total) {
          map_ = std::move(parked->map);  // the one rank 0 found every rank holding
          part_ = part_of[static_cast<std::size_t>(rank_)];
          if (part_ == parked->part) kept_reserved = parked->reserved_end;
        } else {
          why = "rank 0 reuses the last generation's segment, which this process no longer holds";
        }
        if (why.empty() &&
            (header()->magic != detail::shm_magic || header()->version != detail::shm_version ||
             header()->world != static_cast<std::uint32_t>(size_) || header()->total_bytes != layout_.total))
          why = "segment " + name_ + " has an unexpected header";
      }
    }
    taken.reset();
    if (why.empty()) block(rank_).pid.store(static_cast<std::int32_t>(::getpid()), std::memory_order_release);
    // 3. Once everyone has it mapped (or failed), the name goes: the mapping keeps the memory.
    // Every rank removes it (a second removal finds nothing): a rank returns from all_gather
    // only after every rank had mapped the segment, and rank 0 may be killed right after it
    // sent its part, before it could remove the name itself.
    const auto failed = detail::first_failed([&](const std::string& m) { return pg.all_gather(m); },
                                             detail::outcome{errc::system, -1, why});
    ::shm_unlink(name_.c_str());
    guard.name = nullptr;
    if (failed.rank >= 0)
      raise_here(errc::system, "shared-memory segment " + name_ + " could not be set up on rank " +
                                   std::to_string(failed.rank) + ": " + failed.what.message);

    heap_ = std::make_unique<detail::arena_heap>(layout_.part_begin(part_), layout_.part_end(part_));
    reserved_end_ = std::clamp(kept_reserved, layout_.part_begin(part_), layout_.part_end(part_));
    ins_.resize(static_cast<std::size_t>(size_));
    outs_.resize(static_cast<std::size_t>(size_));
    peers_.resize(static_cast<std::size_t>(size_));
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    oversubscribed_ = static_cast<unsigned>(size_) > cores;
    spin_ = oversubscribed_ ? std::min(opts_.spin, 64) : opts_.spin;
    budget_ = spin_;
    // The group failed as a whole (its heartbeat found a rank frozen or dead): wake the
    // waiters in the segment at once, with the group's cause.
    watch_ = ctx_.watch([this](const group_failure& f) { abort_with(f.code, f.text); });
  }

  // Not movable: shm_allocator handles and in-flight peers refer to this object.
  shm(const shm&) = delete;
  shm& operator=(const shm&) = delete;
  /// Peers waiting on this rank learn at once that it left (errc::peer_lost) instead of
  /// running into their deadline.
  ~shm() {
    watch_.reset();  // no call from the group's failure while this goes
    // A forked child's copy maps the parent's segment: marking it closed would fail the
    // parent's peers. Only the child's mapping goes (with the members).
    if (map_.base() == nullptr || owner_.forked()) return;
    auto& me = block(rank_);
    me.closed.store(1, std::memory_order_seq_cst);
    detail::futex_wake_all(&me.counter);
    // A generation of an elastic group: the next one, formed on this host from the same
    // processes, may take the segment over (the constructor's can_reuse), instead of every
    // rank freeing its pages now and the next segment allocating, zeroing and faulting in as
    // many again. The elastic group drops it when nobody took it (detail/parked.hpp).
    if (ctx_.elastic()) try {
        auto p = std::make_unique<parked_segment>();
        p->name = name_;
        p->layout = layout_;
        p->part = part_;
        p->reserved_end = reserved_end_;
        p->map = std::move(map_);
        detail::park(std::move(p));
      } catch (...) {  // no memory for the note: the segment goes now, as without an elastic group
      }
  }

  /// True when this transport took over the segment of the last generation of its elastic
  /// group (docs/elastic.md, "Re-forming in the same memory") instead of making a new one.
  bool reused_segment() const noexcept { return reused_; }

  /// This rank's index among the segment's ranks (its rank in the group unless
  /// shm_options::members was given).
  int rank() const noexcept { return rank_; }
  /// How many ranks share the segment.
  int size() const noexcept { return size_; }
  /// The group's ranks that share the segment, ascending.
  const std::vector<int>& members() const noexcept { return members_; }
  const shm_options& options() const noexcept { return opts_; }
  /// Name the segment had in /dev/shm; already unlinked once the constructor returned.
  const std::string& name() const noexcept { return name_; }

  /// In-place allreduce of `count` elements at `data`; every rank ends with the same bits.
  /// Buffers from `allocate()` on every rank take the zero-copy path.
  /// \code
  /// link.allreduce(v.data(), v.size(), ddp::dtype::f32, ddp::op::avg, pg.deadline());
  /// \endcode
  void allreduce(void* data, std::size_t count, dtype t, op o, deadline_t until, shm_algo a = shm_algo::ring) {
    enter();
    check_types(t, o, "allreduce");
    const std::size_t es = dtype_size(t);
    // Up to tree_bytes the ring runs as the tree: one synchronization fewer, which costs more
    // than reading every rank's few lines. Every rank decides alike (ranks whose counts differ
    // fail the descriptor check of the first step, which both paths share).
    const bool as_tree = a == shm_algo::tree || count * es <= tree_bytes;
    // The tree path writes a rank's output while peers may still read its input, so arena
    // buffers are staged there like any other.
    const std::uint64_t off = as_tree ? detail::shm_desc::no_offset : arena_offset(data, count * es);
    auto& d = begin(detail::coll_kind::allreduce, count, t, o, 0, a, off);
    if (size_ == 1) return;  // a sum over one rank; avg divides by 1
    if (as_tree) return allreduce_tree(data, count, t, o, until, d);
    guarded([&] { allreduce_ring(static_cast<std::byte*>(data), count, t, o, until, d); });
  }

  /// Reduce-scatter: `in` holds count_per_rank * size() elements; rank r receives the
  /// reduction of every rank's slice r in `out_slice`.
  /// \code
  /// link.reduce_scatter(in.data(), mine.data(), mine.size(), ddp::dtype::f32, ddp::op::sum, pg.deadline());
  /// \endcode
  /// `out_slice` must not overlap `in`, except as exactly this rank's slice of it (in place);
  /// `a` only names the caller's algorithm in the descriptor, which peers compare.
  void reduce_scatter(const void* in, void* out_slice, std::size_t count_per_rank, dtype t, op o, deadline_t until,
                      shm_algo a = shm_algo::ring) {
    enter();
    check_types(t, o, "reduce_scatter");
    const std::size_t slice_bytes = count_per_rank * dtype_size(t);
    detail::check_overlap("reduce_scatter", rank_, in, slice_bytes * static_cast<std::size_t>(size_), out_slice,
                          slice_bytes);
    auto& d = begin(detail::coll_kind::reduce_scatter, count_per_rank, t, o, 0, a,
                    arena_offset(in, slice_bytes * static_cast<std::size_t>(size_)));
    guarded([&] {
      if (all_in_arena(d, until, "reduce_scatter")) {
        // Every rank's input lies in the arena: this rank's slice of each, combined straight
        // into `out_slice`; nobody returns (and reuses its input) before every rank has read.
        for (int j = 0; j < size_; ++j)
          ins_[j] = map_.base() + peers_[j].arena_offset + static_cast<std::size_t>(rank_) * slice_bytes;
        void* out = out_slice;
        detail::combine(&out, 1, ins_.data(), size_, count_per_rank, t, o, detail::avg_step{size_, 0, true});
        signal();
        wait_all(count_, until, "reduce_scatter");
        return;
      }
      const std::size_t es = dtype_size(t);
      const std::size_t n = static_cast<std::size_t>(size_);
      const std::size_t c = layout_.slot_bytes / es / n;  // elements of each destination per chunk
      const auto* src = static_cast<const std::byte*>(in);
      auto* dst = static_cast<std::byte*>(out_slice);
      staged_chunks(
          d, count_per_rank, c, -1, until, "reduce_scatter",
          [&](std::size_t s, std::size_t b, std::size_t len) {
            for (std::size_t q = 0; q < n; ++q)
              detail::copy_bytes(slot(rank_, s) + q * c * es, src + (q * count_per_rank + b) * es, len * es);
          },
          [&](std::size_t s, std::size_t b, std::size_t len) {
            for (int j = 0; j < size_; ++j) ins_[j] = slot(j, s) + static_cast<std::size_t>(rank_) * c * es;
            void* out = dst + b * es;
            detail::combine(&out, 1, ins_.data(), size_, len, t, o, detail::avg_step{size_, 0, true});
          });
    });
  }

  /// Allgather: rank r's `count_per_rank` elements land at `out + r * count_per_rank` on every
  /// rank. `in_slice` may be that very place in `out` (in place); any other overlap raises.
  /// \code
  /// link.allgather(mine.data(), all.data(), mine.size(), ddp::dtype::f32, pg.deadline());
  /// \endcode
  void allgather(const void* in_slice, void* out, std::size_t count_per_rank, dtype t, deadline_t until,
                 shm_algo a = shm_algo::ring) {
    enter();
    check_types(t, op::sum, "allgather");
    const std::size_t slice_bytes = count_per_rank * dtype_size(t);
    detail::check_overlap("allgather", rank_, out, slice_bytes * static_cast<std::size_t>(size_), in_slice,
                          slice_bytes);
    auto& d = begin(detail::coll_kind::allgather, count_per_rank, t, op::sum, 0, a,
                    arena_offset(out, slice_bytes * static_cast<std::size_t>(size_)));
    guarded([&] {
      const std::size_t es = dtype_size(t);
      const std::size_t c = layout_.slot_bytes / es;
      const auto* src = static_cast<const std::byte*>(in_slice);
      auto* dst = static_cast<std::byte*>(out);
      auto* mine = dst + static_cast<std::size_t>(rank_) * count_per_rank * es;
      if (mine != src && count_per_rank > 0) std::memmove(mine, src, count_per_rank * es);  // may overlap
      if (all_in_arena(d, until, "allgather")) {
        // Every rank's output lies in the arena, its own slice in place: each peer's slice is
        // read from the peer's output; nobody returns before every rank has read its slice.
        for (int j = 0; j < size_; ++j)
          if (j != rank_)
            detail::copy_bytes(dst + static_cast<std::size_t>(j) * slice_bytes,
                               map_.base() + peers_[j].arena_offset + static_cast<std::size_t>(j) * slice_bytes,
                               slice_bytes);
        signal();
        wait_all(count_, until, "allgather");
        return;
      }
      staged_chunks(
          d, count_per_rank, c, -1, until, "allgather",
          [&](std::size_t s, std::size_t b, std::size_t len) {
            detail::copy_bytes(slot(rank_, s), mine + b * es, len * es);
          },
          [&](std::size_t s, std::size_t b, std::size_t len) {
            for (int j = 0; j < size_; ++j)
              if (j != rank_)
                detail::copy_bytes(dst + (static_cast<std::size_t>(j) * count_per_rank + b) * es, slot(j, s), len * es);
          });
    });
  }

  /// Broadcast of `bytes` bytes from rank `root` to every rank.
  /// \code
  /// link.broadcast(weights.data(), weights.size() * sizeof(float), 0, pg.deadline());
  /// \endcode
  void broadcast(void* data, std::size_t bytes, int root, deadline_t until, shm_algo a = shm_algo::ring) {
    broadcast_as(data, bytes, bytes, dtype::f32, true, root, until, a);
  }
  /// Broadcast of `count` elements of `t` (what `ring<shm>::broadcast_async` runs): the bytes
  /// move as above, and every rank must name the same count and type.
  void broadcast(void* data, std::size_t count, dtype t, int root, deadline_t until, shm_algo a = shm_algo::ring) {
    broadcast_as(data, count * dtype_size(t), count, t, false, root, until, a);
  }

 private:
  void broadcast_as(void* data, std::size_t bytes, std::uint64_t count, dtype t, bool raw, int root, deadline_t until,
                    shm_algo a) {
    enter();
    if (root < 0 || root >= size_)
      raise_here(errc::invalid_argument,
                 "broadcast root " + std::to_string(root) + " is not a rank of " + std::to_string(size_));
    auto& d = begin(detail::coll_kind::broadcast, count, t, op::sum, root, a, detail::shm_desc::no_offset);
    d.coll.bytes = raw ? 1 : 0;
    guarded([&] {
      const std::size_t c = layout_.slot_bytes;
      auto* p = static_cast<std::byte*>(data);
      staged_chunks(
          d, bytes, c, root, until, "broadcast",
          [&](std::size_t s, std::size_t b, std::size_t len) { detail::copy_bytes(slot(root, s), p + b, len); },
          [&](std::size_t s, std::size_t b, std::size_t len) {
            if (rank_ != root) detail::copy_bytes(p + b, slot(root, s), len);
          });
    });
  }

 public:
  /// Returns once every rank has entered barrier().
  /// \code
  /// link.barrier(pg.deadline());
  /// \endcode
  void barrier(deadline_t until, shm_algo a = shm_algo::ring) {
    enter();
    auto& d = begin(detail::coll_kind::barrier, 0, dtype::f32, op::sum, 0, a, detail::shm_desc::no_offset);
    guarded([&] {
      signal();
      wait_all(count_, until, "barrier");
      check_peers(d);
    });
  }

  /// `bytes` of this rank's part of the arena, 64-byte aligned; nullptr for 0 bytes. Its pages
  /// are reserved in /dev/shm before it is returned. Throws errc::system when /dev/shm cannot
  /// hold it, or when an explicit shm_options::segment_bytes leaves too small a part.
  /// \code
  /// auto* g = static_cast<float*>(link.allocate(n * sizeof(float)));  // zero-copy allreduce
  /// link.deallocate(g, n * sizeof(float));
  /// \endcode
  void* allocate(std::size_t bytes) {
    owner_.check(rank_, "shm transport");  // the arena is shared with the parent's peers
    if (bytes == 0) return nullptr;
    // First fit hands out the lowest free block, so this rank's reserved pages are the prefix
    // [part_begin, reserved_end_) of its part; freed blocks keep theirs for the next allocation.
    std::lock_guard lock(reserve_mu_);
    const std::size_t off = heap_->allocate(bytes);
    if (off == detail::arena_heap::npos) {
      if (opts_.segment_bytes != 0)
        raise_here(errc::system, "shm arena exhausted: asked for " + std::to_string(bytes) +
                                     " bytes, the largest free block is " + std::to_string(heap_->largest_free()) +
                                     " of this rank's " + std::to_string(heap_->capacity()) +
                                     " (each rank owns shm_options::segment_bytes / world; 0 sizes it from /dev/shm)");
      raise_here(errc::system, no_room(bytes) + "with it this rank's blocks would outgrow its part of the arena (" +
                                   detail::shm_mib(heap_->capacity()) + ", sized by " + arena_bound_ + "); " +
                                   detail::shm_space());
    }
    const std::size_t end = std::min(detail::round_up(off + bytes, detail::shm_page), layout_.part_end(part_));
    if (end > reserved_end_) {
      const std::string why = map_.reserve(reserved_end_, end - reserved_end_);
      if (!why.empty()) {
        heap_->deallocate(off, bytes);
        raise_here(errc::system, no_room(bytes) + why);
      }
      reserved_end_ = end;
    }
    populate(off, bytes);
    return map_.base() + off;
  }
  /// Returns a block from allocate(); nullptr is ignored.
  void deallocate(void* p, std::size_t bytes) noexcept {
    if (p == nullptr) return;
    heap_->deallocate(static_cast<std::size_t>(static_cast<std::byte*>(p) - map_.base()), bytes);
  }
  /// True when `p` points into the arena (of any rank).
  bool contains(const void* p) const noexcept {
    const auto* b = static_cast<const std::byte*>(p);
    return map_.base() != nullptr && b >= map_.base() + layout_.arena && b < map_.base() + layout_.total;
  }

  /// Makes every current and future wait on every rank fail with errc::aborted. Safe to call
  /// from any thread, e.g. while the progress thread is blocked in a collective.
  void abort() noexcept { abort_with({}, {}); }

  /// The same, with the reason: every waiting rank raises `code` quoting `why` (as
  /// "rank R reports: why", unless `why` already names the rank that reports it) instead of
  /// "shm transport aborted by rank R". The first abort on the segment is the one every rank
  /// reports; up to 1 KiB of `why` travels.
  void abort(errc code, const std::string& why) noexcept { abort_with(code, why); }

  /// Marks the segment failed on every rank with `code` and `msg` (see abort(code, why)), then
  /// raises it here: what tcp's fail() does for its connections.
  [[noreturn]] void fail(errc code, const std::string& msg) {
    abort_with(code, msg);
    raise_here(code, msg);
  }

  /// The reason the segment was aborted with, as the group records failures, and the group's
  /// rank that gave it (-1 and an empty failure: not aborted, or aborted without a reason).
  std::pair<group_failure, int> abort_reason() const {
    if (map_.base() == nullptr) return {{}, -1};
    const auto* h = header();
    const int by = h->aborted_by.load(std::memory_order_acquire);
    if (by < 0 || h->reason_len == 0) return {{}, -1};
    return {{static_cast<errc>(h->reason_code),
             std::string(h->reason, std::min<std::size_t>(h->reason_len, sizeof h->reason))},
            members_[static_cast<std::size_t>(by)]};
  }

 private:
  static constexpr std::size_t nslots = 2;
  /// Allreduces of at most this many bytes take the tree path whatever the caller's algorithm
  /// (measured: 4 ranks on 2 cores, 4-16 KiB: the tree in 55-65 % of the ring's time).
  static constexpr std::size_t tree_bytes = 16 << 10;
  static constexpr auto slice = detail::timing::shm_wait_slice;

  detail::shm_header* header() const noexcept { return reinterpret_cast<detail::shm_header*>(map_.base()); }
  detail::shm_rank_block& block(int r) const noexcept {
    return reinterpret_cast<detail::shm_rank_block*>(map_.base() + layout_.blocks)[r];
  }
  std::byte* slot(int r, std::size_t s) const noexcept { return map_.base() + layout_.slot(r, s); }

  /// Maps the pages of a block this rank hands out into its page tables now, in one call
  /// (MADV_POPULATE_WRITE, Linux 5.14), rather than one fault per 4 KiB page at the first
  /// step that writes them. Best effort: an older kernel says EINVAL and the faults come later.
  void populate(std::size_t off, std::size_t bytes) noexcept {
#if defined(MADV_POPULATE_WRITE)
    const std::size_t begin = off / detail::shm_page * detail::shm_page;
    const std::size_t end = std::min(detail::round_up(off + bytes, detail::shm_page), map_.size());
    if (end > begin) (void)::madvise(map_.base() + begin, end - begin, MADV_POPULATE_WRITE);
#else
    (void)off;
    (void)bytes;
#endif
  }

  /// A segment the last generation parked (detail/parked.hpp) and its name.
  struct parked_segment : detail::parked_object {
    detail::shm_mapping map;
    std::string name;
    detail::shm_layout layout;     ///< its geometry (its parts: as many as it was laid out for)
    int part = 0;                  ///< this rank's part of its arena
    std::size_t reserved_end = 0;  ///< that part has pages up to here (posix_fallocate)
  };

  /// Whether rank 0 may take over `p` for this segment's ranks, whose setup entries are `held`
  /// ("<pid>[ <parked name> <part>]", by group rank): every one of them holds the same parked
  /// segment (so each one's engine on it is gone), in parts of its own, the slots and parts it
  /// was laid out for are as many as this segment's ranks at least, and every process that had
  /// a seat in it is one of them or has exited (a frozen rank of the last generation could wake
  /// and write into it: then a new segment is made, as always). `parts` receives each rank's
  /// part.
  bool can_reuse(const parked_segment& p, const std::vector<std::string>& held, std::vector<int>& parts) const {
    if (p.map.base() == nullptr || p.layout.world < size_ || p.map.size() < p.layout.total) return false;
    if (p.layout.slot_bytes != detail::round_up(opts_.slot_bytes, detail::shm_page) || p.layout.nslots != nslots)
      return false;
    std::vector<int> pids;
    parts.clear();
    for (int m : members_) {
      std::istringstream in(held[static_cast<std::size_t>(m)]);
      int pid = 0, part = -1;
      std::string name;
      if (!(in >> pid >> name >> part) || name != p.name || part < 0 || part >= p.layout.world ||
          std::find(parts.begin(), parts.end(), part) != parts.end())
        return false;
      pids.push_back(pid);
      parts.push_back(part);
    }
    const auto* h = reinterpret_cast<const detail::shm_header*>(p.map.base());
    if (h->magic != detail::shm_magic || h->version != detail::shm_version) return false;
    const std::size_t blocks = detail::make_shm_layout(1, 4096, nslots, 0).blocks;
    if (blocks + h->world * sizeof(detail::shm_rank_block) > p.map.size()) return false;
    const auto* b = reinterpret_cast<const detail::shm_rank_block*>(p.map.base() + blocks);
    for (std::uint32_t q = 0; q < h->world; ++q) {
      const int pid = b[q].pid.load(std::memory_order_acquire);
      if (pid > 0 && std::find(pids.begin(), pids.end(), pid) == pids.end() && detail::process_alive(pid)) return false;
    }
    return true;
  }

  void init_segment() {
    auto* h = new (map_.base()) detail::shm_header{};
    h->magic = detail::shm_magic;
    h->version = detail::shm_version;
    h->world = static_cast<std::uint32_t>(size_);
    h->slot_bytes = layout_.slot_bytes;
    h->nslots = layout_.nslots;
    h->arena_offset = layout_.arena;
    h->arena_bytes = layout_.arena_bytes;
    h->total_bytes = layout_.total;
    h->aborted_by.store(-1, std::memory_order_relaxed);
    h->abort_claim.store(-1, std::memory_order_relaxed);
    h->reason_code = 0;
    h->reason_len = 0;
    for (int r = 0; r < size_; ++r) {
      auto* b = new (&block(r)) detail::shm_rank_block{};
      b->counter.store(0, std::memory_order_relaxed);
      b->waiters.store(0, std::memory_order_relaxed);
      b->closed.store(0, std::memory_order_relaxed);
      b->pid.store(0, std::memory_order_relaxed);
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }

  [[noreturn]] void raise_here(errc e, const std::string& msg) const { detail::raise(e, grank_, msg); }
  /// "rank R": the group's rank of the segment's rank `j`, for messages.
  std::string who(int j) const {
    return "rank " +
           std::to_string(j >= 0 && j < static_cast<int>(members_.size()) ? members_[static_cast<std::size_t>(j)] : j);
  }

  std::string no_room(std::size_t bytes) const {
    return "shared-memory segment " + name_ + ": no room for a block of " + detail::shm_mib(bytes) +
           " in this rank's part of the arena (" + detail::shm_mib(reserved_end_ - layout_.part_begin(part_)) +
           " reserved so far): ";
  }

  void check_types(dtype t, op o, const char* what) const {
    detail::check_dtype(t, rank_, what);
    detail::check_op(o, rank_, what);
  }

  /// Refuses calls on a transport that failed or was aborted: its counters no longer agree
  /// with its peers'.
  void enter() {
    owner_.check(rank_, "shm transport");
    check_abort();
    if (failure_.failed())
      raise_here(failure_.code(), "shm transport is unusable after an earlier error: " + failure_.what());
  }
  void check_abort() const {
    const int by = header()->aborted_by.load(std::memory_order_acquire);
    if (by < 0) return;
    if (auto [f, from] = abort_reason(); !f.empty()) raise_here(f.code, f.text);
    raise_here(errc::aborted,
               by == rank_ ? "shm transport aborted by this rank" : "shm transport aborted by " + who(by));
  }

  /// abort() and abort(code, why): the first rank to claim the segment writes its reason, then
  /// publishes itself in `aborted_by`, so a waiter that sees it sees the reason too.
  void abort_with(errc code, const std::string& why) noexcept {
    if (map_.base() == nullptr || owner_.forked()) return;  // a forked child must not fail the parent's group
    auto* h = header();
    std::int32_t none = -1;
    if (h->abort_claim.compare_exchange_strong(none, rank_, std::memory_order_seq_cst)) {
      std::size_t len = 0;
      if (!why.empty()) {
        // Quoted as the group quotes failures: "rank R reports: ..." names the rank it came
        // from; a reason relayed from another rank (the group's verdict) names that one already.
        const std::string prefix =
            failure_verdict::names_reporter(why) ? "" : "rank " + std::to_string(grank_) + " reports: ";
        len = std::min(prefix.size(), sizeof h->reason);
        std::memcpy(h->reason, prefix.data(), len);
        const std::size_t more = std::min(why.size(), sizeof h->reason - len);
        std::memcpy(h->reason + len, why.data(), more);
        len += more;
      }
      h->reason_code = static_cast<std::int32_t>(code);
      h->reason_len = static_cast<std::uint32_t>(len);
      std::int32_t unset = -1;
      h->aborted_by.compare_exchange_strong(unset, rank_, std::memory_order_seq_cst);
    }
    // A rank that lost the claim: the winner is publishing (a copy of at most 1 KiB); the
    // waiters it wakes, and those woken here, see it within one wait slice.
    for (int j = 0; j < size_; ++j) detail::futex_wake_all(&block(j).counter);
  }

  /// Runs a collective's body; on any error marks this transport failed and tells peers
  /// waiting on this rank, so they fail now rather than at their deadline.
  template <class F>
  void guarded(F&& body) {
    try {
      body();
    } catch (const error& e) {
      failure_.set(e.condition(), detail::message_of(e));
      auto& me = block(rank_);
      me.closed.store(2, std::memory_order_seq_cst);
      detail::futex_wake_all(&me.counter);
      throw;
    }
  }

  /// Publishes this rank's descriptor of the collective it starts (by parity of its number, so
  /// writing the next one never races a slow reader of this one).
  detail::shm_desc& begin(detail::coll_kind kind, std::uint64_t count, dtype t, op o, int root, shm_algo a,
                          std::uint64_t off) {
    ++seq_;
    auto& d = block(rank_).desc[seq_ & 1];
    d.coll = detail::coll_desc{};
    d.coll.kind = kind;
    d.coll.type = t;
    d.coll.oper = o;
    d.coll.algo = a == shm_algo::tree ? detail::coll_algo::tree : detail::coll_algo::ring;
    d.coll.root = root;
    d.coll.seq = seq_;
    d.coll.count = count;
    d.arena_offset = off;
    return d;
  }

  /// After the first signal of a collective every rank's descriptor is visible. All ranks
  /// compare rank 0's against each other rank's in the same order, so all raise the same
  /// error, and before anyone touches a peer's data (the arena offsets may differ).
  void check_peers(const detail::shm_desc& mine) {
    const std::size_t par = seq_ & 1;
    for (int j = 0; j < size_; ++j) std::memcpy(&peers_[j], &block(j).desc[par], sizeof(detail::shm_desc));
    peers_[rank_] = mine;
    // The one check of every engine (detail/collective.hpp), against rank 0's descriptor.
    for (int j = 1; j < size_; ++j)
      if (auto why =
              detail::mismatch(peers_[0].coll, members_[0], peers_[j].coll, members_[static_cast<std::size_t>(j)]);
          !why.empty())
        raise_here(errc::mismatch, why);
  }

  /// Offset of [p, p + bytes) in the segment when it lies wholly in the arena.
  std::uint64_t arena_offset(const void* p, std::size_t bytes) const noexcept {
    const auto* b = static_cast<const std::byte*>(p);
    if (bytes == 0 || !contains(p) || b + bytes > map_.base() + layout_.total) return detail::shm_desc::no_offset;
    return static_cast<std::uint64_t>(b - map_.base());
  }

  std::size_t take_slot() noexcept { return static_cast<std::size_t>(turn_++ % nslots); }

  /// reduce_scatter and allgather: the ranks exchange their descriptors (a first step, which
  /// also compares them); true when every rank's buffer lies in the arena, so that each reads
  /// its peers' buffers in place. Every rank decides alike. The staged pipeline otherwise.
  bool all_in_arena(const detail::shm_desc& d, deadline_t until, const char* what) {
    signal();
    wait_all(count_, until, what);
    check_peers(d);
    if (d.coll.count == 0) return false;
    for (int j = 0; j < size_; ++j)
      if (peers_[j].arena_offset == detail::shm_desc::no_offset) return false;
    return true;
  }

  // ---- synchronization -------------------------------------------------------------------

  void signal() noexcept {
    ++count_;
    auto& me = block(rank_);
    me.cpu.store(::sched_getcpu(), std::memory_order_relaxed);
    me.counter.store(static_cast<std::uint32_t>(count_), std::memory_order_seq_cst);
    if (me.waiters.load(std::memory_order_seq_cst) != 0) detail::futex_wake_all(&me.counter);
  }

  static bool reached(std::uint32_t have, std::uint64_t want) noexcept {
    return static_cast<std::int32_t>(have - static_cast<std::uint32_t>(want)) >= 0;
  }

  /// Raises if rank j can no longer send signal `want`. A peer's last signal precedes its
  /// `closed` flag (and its death), so the counter is read again after them: a peer that
  /// signalled and then left is not an error.
  void check_peer(int j, std::uint64_t want, deadline_t until, const char* what) const {
    check_abort();
    auto& b = block(j);
    const auto closed = b.closed.load(std::memory_order_seq_cst);
    const bool dead = closed == 0 && !detail::process_alive(b.pid.load(std::memory_order_acquire));
    const bool late = steady_clock::now() >= until;
    if (!closed && !dead && !late) return;
    if (reached(b.counter.load(std::memory_order_seq_cst), want)) return;
    if (closed != 0)
      raise_here(errc::peer_lost, std::string(what) + ": " + who(j) +
                                      (closed == 1 ? " closed its shm transport" : " failed with an error") +
                                      " while this rank waited for it");
    if (dead)
      raise_here(errc::peer_lost, std::string(what) + ": " + who(j) + " (pid " + std::to_string(b.pid.load()) +
                                      ") died while this rank waited for it");
    raise_here(errc::timeout, std::string(what) + ": " + who(j) +
                                  " did not arrive before the deadline (waited for its step " + std::to_string(want) +
                                  ", it is at " + std::to_string(b.counter.load()) + ")" +
                                  ctx_.verdict().noted_error(members_[static_cast<std::size_t>(j)]));
  }

  /// Waits until rank j has sent `want` signals: poll, then sleep on its counter in slices.
  ///
  /// Polling pays only while the peer runs on another core. When it does not (more ranks
  /// than cores, or cores taken by other processes) every poll delays the peer, so the budget
  /// adapts like an adaptive mutex: it grows while polls succeed and halves whenever the wait
  /// ended in a sleep. A yield every few polls hands the core to a peer queued behind us.
  ///
  /// A peer that last signalled from this rank's own core cannot move while we poll: polling
  /// only delays it, and yielding to it keeps both ranks on one core even when another core is
  /// idle (the scheduler does not move a task that never sleeps). So then this rank does not
  /// poll: with a core per rank it sleeps at once, and the peer's wake-up places it on an idle
  /// core; with more ranks than cores it yields at once.
  void wait_rank(int j, std::uint64_t want, deadline_t until, const char* what) {
    auto& b = block(j);
    if (reached(b.counter.load(std::memory_order_acquire), want)) return;
    const bool beside = b.cpu.load(std::memory_order_relaxed) == ::sched_getcpu();
    if (!beside) spin_on(b, want);
    if (reached(b.counter.load(std::memory_order_acquire), want)) return;
    // More ranks than cores: the peer we wait for is most likely queued on our own core, and a
    // yield hands it the core at once, where a futex sleep would cost a wake-up through the
    // scheduler (tens of microseconds). So keep yielding for a while before sleeping.
    if (oversubscribed_ || beside) {
      const auto stop = steady_clock::now() + detail::timing::shm_yield_window;
      do {
        ::sched_yield();
        if (reached(b.counter.load(std::memory_order_acquire), want)) return;
      } while (steady_clock::now() < stop);
    }
    // A long wait records whom it waits for, ahead of its deadline (failure_verdict::
    // note_waiting): a rank of another host whose deadline ends first then names rank j, not
    // this one. Withdrawn when j arrives; left in place when this wait fails.
    const auto note_at = steady_clock::now() + note_after_;
    bool noted = false;
    for (;;) {
      check_peer(j, want, until, what);
      if (!noted && steady_clock::now() >= note_at) {
        ctx_.verdict().note_waiting(members_[static_cast<std::size_t>(j)]);
        noted = true;
      }
      b.waiters.fetch_add(1, std::memory_order_seq_cst);
      const std::uint32_t v = b.counter.load(std::memory_order_seq_cst);
      if (!reached(v, want)) {
        const auto left = until - steady_clock::now();
        detail::futex_wait(&b.counter, v, std::min<std::chrono::nanoseconds>(slice, left));
      }
      b.waiters.fetch_sub(1, std::memory_order_seq_cst);
      if (reached(b.counter.load(std::memory_order_acquire), want)) {
        if (noted) ctx_.verdict().note_waiting(-1);
        return;
      }
    }
  }

  /// The polling part of wait_rank: up to budget_ polls, adapting the budget.
  void spin_on(detail::shm_rank_block& b, std::uint64_t want) {
    for (int i = 0; i < budget_; ++i) {
      detail::cpu_relax();
      if (reached(b.counter.load(std::memory_order_acquire), want)) {
        budget_ = std::min(spin_, budget_ + budget_ / 4 + 8);
        return;
      }
      if ((i & 31) == 31) ::sched_yield();
    }
    budget_ = std::max(std::min(spin_, 32), budget_ / 2);
  }

  void wait_all(std::uint64_t want, deadline_t until, const char* what) {
    for (int j = 1; j < size_; ++j) wait_rank((rank_ + j) % size_, want, until, what);
  }

  /// Peers read (and in the ring also write) this rank's slot s until they signal the step
  /// recorded in slot_free_at_[s].
  void wait_slot_free(std::size_t s, deadline_t until, const char* what) { wait_all(slot_free_at_[s], until, what); }

  // ---- allreduce -------------------------------------------------------------------------

  /// Reduces elements [0, len) of every rank's source into every rank's destination; this rank
  /// owns the slice `part`, and computes each element once (an average is scaled and divided
  /// inside the kernel's accumulator), so every rank receives the owner's bits.
  void reduce_slice(detail::range part, dtype t, op o) {
    const std::size_t len = part.size();
    if (len == 0) return;
    const int n = size_;
    for (int j = 0; j < n; ++j) outs_[j] = const_cast<void*>(ins_[j]);
    detail::combine(outs_.data(), n, ins_.data(), n, len, t, o, detail::avg_step{n, 0, true});
  }

  /// The staged pipeline of reduce_scatter, allgather, broadcast and the tree allreduce: `total`
  /// units (elements or bytes) in chunks of `c`, chunk k through the next slot. The ranks that
  /// write (every rank; with `root` >= 0 the root only) `stage(slot, begin, len)` once the slot is
  /// free; every rank signals and waits for the writers (for every rank at the first step, which
  /// checks the descriptors); then `consume(slot, begin, len)` reads the staged parts, and the
  /// slot is free again once every rank signalled past it. A collective of nothing still runs
  /// the first step, so that the descriptors are compared.
  template <class Stage, class Consume>
  void staged_chunks(const detail::shm_desc& d, std::size_t total, std::size_t c, int root, deadline_t until,
                     const char* what, Stage&& stage, Consume&& consume) {
    std::size_t k = 0;
    do {
      const std::size_t b = k * c;
      const std::size_t len = std::min(c, total - b);
      const std::size_t s = take_slot();
      if ((root < 0 || rank_ == root) && len > 0) {
        wait_slot_free(s, until, what);
        stage(s, b, len);
      }
      signal();
      if (k == 0 || root < 0) {
        wait_all(count_, until, what);
        if (k == 0) check_peers(d);
      } else if (rank_ != root) {
        wait_rank(root, count_, until, what);  // after the first step only the root matters
      }
      if (len == 0) break;
      consume(s, b, len);
      signal();
      slot_free_at_[s] = count_;
    } while (++k * c < total);
  }

  void allreduce_ring(std::byte* data, std::size_t count, dtype t, op o, deadline_t until, const detail::shm_desc& d) {
    const std::size_t es = dtype_size(t);
    const bool staged = d.arena_offset == detail::shm_desc::no_offset;
    std::size_t chunk = layout_.slot_bytes / es;
    std::size_t s = take_slot();
    if (staged && count > 0) {
      wait_slot_free(s, until, "allreduce");
      detail::copy_bytes(slot(rank_, s), data, std::min(count, chunk) * es);
    }
    signal();
    wait_all(count_, until, "allreduce");
    check_peers(d);
    if (count == 0) return;

    // Which ranks' buffers lie in the arena: every rank reads the same descriptors, so all
    // decide the same. With all of them there, one chunk: no staging at all.
    bool all_arena = true;
    for (int j = 0; j < size_; ++j) all_arena = all_arena && peers_[j].arena_offset != detail::shm_desc::no_offset;
    for (int i = 0; i < size_; ++i)
      for (int j = i + 1; j < size_; ++j) {
        const auto a = peers_[i].arena_offset, b = peers_[j].arena_offset;
        if (a != detail::shm_desc::no_offset && b != detail::shm_desc::no_offset && a < b + count * es &&
            b < a + count * es)
          raise_here(errc::invalid_argument,
                     "allreduce: " + who(i) + " and " + who(j) + " passed overlapping buffers in the shared arena");
      }
    if (all_arena) chunk = count;
    const std::size_t nchunks = (count + chunk - 1) / chunk;
    const std::size_t align = std::max<std::size_t>(1, detail::shm_line / es);
    for (std::size_t k = 0; k < nchunks; ++k) {
      const std::size_t b = k * chunk;
      const std::size_t len = std::min(chunk, count - b);
      if (k > 0) wait_all(count_, until, "allreduce");  // inputs of chunk k are in place
      const auto part = detail::partition_aligned(len, size_, rank_, align);
      for (int j = 0; j < size_; ++j) {
        const auto off = peers_[j].arena_offset;
        std::byte* src = off != detail::shm_desc::no_offset ? map_.base() + off + b * es : slot(j, s);
        ins_[j] = src + part.begin * es;
      }
      reduce_slice(part, t, o);
      signal();
      const std::uint64_t done = count_;
      // Stage the next chunk while slower peers finish this one (double buffering).
      const std::size_t next = k + 1 < nchunks ? take_slot() : s;
      if (k + 1 < nchunks) {
        if (staged) {
          wait_slot_free(next, until, "allreduce");
          detail::copy_bytes(slot(rank_, next), data + (b + chunk) * es, std::min(chunk, count - b - chunk) * es);
        }
        signal();
      }
      wait_all(done, until, "allreduce");
      if (staged) detail::copy_bytes(data + b * es, slot(rank_, s), len * es);
      slot_free_at_[s] = done;
      s = next;
    }
  }

  void allreduce_tree(void* data, std::size_t count, dtype t, op o, deadline_t until, const detail::shm_desc& d) {
    guarded([&] {
      const std::size_t es = dtype_size(t);
      const std::size_t chunk = layout_.slot_bytes / es;
      auto* p = static_cast<std::byte*>(data);
      staged_chunks(
          d, count, chunk, -1, until, "allreduce",
          [&](std::size_t s, std::size_t b, std::size_t len) {
            detail::copy_bytes(slot(rank_, s), p + b * es, len * es);
          },
          [&](std::size_t s, std::size_t b, std::size_t len) {
            for (int j = 0; j < size_; ++j) ins_[j] = slot(j, s);
            void* out = p + b * es;
            detail::combine(&out, 1, ins_.data(), size_, len, t, o, detail::avg_step{size_, 0, true});
          });
    });
  }

  int rank_ = 0;   // among the segment's ranks
  int size_ = 1;   // ranks sharing the segment
  int grank_ = 0;  // in the group (errors name it)
  shm_options opts_;
  std::vector<int> members_;     // the group's ranks of the segment's ranks
  bool oversubscribed_ = false;  ///< more ranks than cores on this host
  int spin_ = 0;                 ///< most polls per wait
  int budget_ = 0;               ///< polls of the next wait, adapted between 32 and spin_
  std::string name_;
  bool reused_ = false;  ///< the last generation's segment, taken over
  int part_ = 0;         ///< this rank's part of the arena: its rank, or in a segment taken over its part there
  detail::shm_mapping map_;
  detail::shm_layout layout_{};
  std::unique_ptr<detail::arena_heap> heap_;
  std::mutex reserve_mu_;         ///< guards reserved_end_
  std::size_t reserved_end_ = 0;  ///< this rank's part has pages up to here (segment offset)
  const char* arena_bound_ = "";  ///< what sized each rank's part of the arena (for messages)
  std::uint64_t count_ = 0;       ///< signals sent; equal on all ranks between collectives
  std::uint64_t seq_ = 0;         ///< collectives started
  std::uint64_t turn_ = 0;        ///< slot rotation, advanced identically on every rank
  std::array<std::uint64_t, nslots> slot_free_at_{};
  std::vector<const void*> ins_;
  std::vector<void*> outs_;
  std::vector<detail::shm_desc> peers_;
  detail::first_failure failure_;
  detail::owner_process owner_;           ///< a forked child's copy only unmaps
  std::chrono::milliseconds note_after_;  ///< a wait this long records whom it waits for
  mutable transport_context ctx_;  ///< the group's verdict ("waits for" records, notes: even a const check reads them)
  group_watch watch_;              ///< last: unregistered first, before what its call uses goes
};

/// The engine of `ring<shm>` and `tree<shm>`: the reducer's group handle and one `ddp::shm`,
/// which runs each whole collective itself (its own descriptors in the segment, the common
/// mismatch check, its own synchronization) in the mode of `Algorithm`. Not a transport: the
/// reducer front end (reducer/detail/front_end.hpp) drives it like the MPI and NCCL engines.
template <class Algorithm>
class shm_engine {
  static_assert(std::same_as<Algorithm, ring_algorithm> || std::same_as<Algorithm, tree_algorithm>,
                "ddp: Algorithm is ring_algorithm or tree_algorithm");

 public:
  static constexpr const char* name = "reducer";
  static constexpr bool descriptors = false;  ///< shm publishes its own, in the segment
  static constexpr bool deadlines = true;
  static constexpr bool launches_at_call = false;
  static constexpr shm_algo mode = std::same_as<Algorithm, ring_algorithm> ? shm_algo::ring : shm_algo::tree;

  /// The engine ignores reducer_options; only the algorithm must agree.
  static std::string signature() { return std::string(shm_algo_name(mode)) + "<shm>"; }

  shm_engine(process_group& pg, const reducer_options& o)
      : pg_(detail::agree_on_reducer(pg, signature())), shm_(pg), opts_(o) {}
  shm_engine(process_group& pg, shm_options t, const reducer_options& o)
      : pg_(detail::agree_on_reducer(pg, signature())), shm_(pg, std::move(t)), opts_(o) {}

  int rank() const noexcept { return pg_.rank(); }
  int size() const noexcept { return pg_.size(); }
  std::chrono::milliseconds timeout() const noexcept { return pg_.timeout(); }
  /// The segment (what `shm_allocator` is built from).
  shm& transport() noexcept { return shm_; }
  process_group& group() noexcept { return pg_; }
  const reducer_options& options() const noexcept { return opts_; }
  void abort() noexcept { shm_.abort(); }

  void allreduce(deadline_t until, void* data, std::size_t count, dtype t, op o) {
    shm_.allreduce(data, count, t, o, until, mode);
  }
  void reduce_scatter(deadline_t until, const void* in, void* out, std::size_t per_rank, dtype t, op o) {
    shm_.reduce_scatter(in, out, per_rank, t, o, until, mode);
  }
  void allgather(deadline_t until, const void* in, void* out, std::size_t per_rank, dtype t) {
    shm_.allgather(in, out, per_rank, t, until, mode);
  }
  void broadcast(deadline_t until, void* data, std::size_t count, dtype t, int root) {
    shm_.broadcast(data, count, t, root, until, mode);
  }
  void barrier(deadline_t until) { shm_.barrier(until, mode); }

 private:
  process_group pg_;  // the reducer's own handle: the group stays open while this lives
  shm shm_;
  reducer_options opts_;
};

/// `ring<shm>` and `tree<shm>` run on the shared-memory engine.
template <class Algorithm>
struct engine_for<Algorithm, shm> {
  using type = shm_engine<Algorithm>;
};

}  // namespace v0
}  // namespace ddp
