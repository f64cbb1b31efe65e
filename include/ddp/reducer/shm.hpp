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
#include <cstring>
#include <memory>
#include <mutex>
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
#include <ddp/reducer/detail/schedule.hpp>
#include <ddp/reducer/detail/shm_segment.hpp>
#include <ddp/reducer/detail/shm_session.hpp>
#include <ddp/reducer/shm_options.hpp>
#include <ddp/detail/socket.hpp>
#include <ddp/detail/timing.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/group/kv_store.hpp>
#include <ddp/group/verdict.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/basic_reducer.hpp>
#include <ddp/reducer/detail/front_end.hpp>

namespace ddp {
inline namespace DDP_ABI {

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
      : grank_(ctx.rank()),
        opts_(std::move(o)),
        note_after_(std::min<std::chrono::milliseconds>(detail::timing::shm_note_waiting, ctx.timeout() / 4)),
        ctx_(ctx) {
    seg_ = detail::open_shm_session(ctx, opts_);
    rank_ = seg_.rank;
    size_ = seg_.size;
    heap_ = std::make_unique<detail::arena_heap>(seg_.layout.part_begin(seg_.part), seg_.layout.part_end(seg_.part));
    reserved_end_ = std::clamp(seg_.kept_reserved, seg_.layout.part_begin(seg_.part), seg_.layout.part_end(seg_.part));
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
    if (seg_.map.base() == nullptr || owner_.forked()) return;
    auto& me = block(rank_);
    me.closed.store(1, std::memory_order_seq_cst);
    detail::futex_wake_all(&me.counter);
    // A generation of an elastic group: the next one, formed on this host from the same
    // processes, may take the segment over (shm_session::can_reuse), instead of every
    // rank freeing its pages now and the next segment allocating, zeroing and faulting in as
    // many again. The elastic group drops it when nobody took it (detail/parked.hpp).
    if (ctx_.elastic()) seg_.park(reserved_end_);
  }

  /// True when this transport took over the segment of the last generation of its elastic
  /// group (docs/elastic.md, "Re-forming in the same memory") instead of making a new one.
  bool reused_segment() const noexcept { return seg_.reused; }

  /// This rank's index among the segment's ranks (its rank in the group unless
  /// shm_options::members was given).
  int rank() const noexcept { return rank_; }
  /// How many ranks share the segment.
  int size() const noexcept { return size_; }
  /// The group's ranks that share the segment, ascending.
  const std::vector<int>& members() const noexcept { return seg_.members; }
  const shm_options& options() const noexcept { return opts_; }
  /// Name the segment had in /dev/shm; already unlinked once the constructor returned.
  const std::string& name() const noexcept { return seg_.name; }

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
          ins_[j] = seg_.map.base() + peers_[j].arena_offset + static_cast<std::size_t>(rank_) * slice_bytes;
        void* out = out_slice;
        detail::combine(&out, 1, ins_.data(), size_, count_per_rank, t, o, detail::avg_step{size_, 0, true});
        signal();
        wait_all(count_, until, "reduce_scatter");
        return;
      }
      const std::size_t es = dtype_size(t);
      const std::size_t n = static_cast<std::size_t>(size_);
      const std::size_t c = seg_.layout.slot_bytes / es / n;  // elements of each destination per chunk
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
      const std::size_t c = seg_.layout.slot_bytes / es;
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
                               seg_.map.base() + peers_[j].arena_offset + static_cast<std::size_t>(j) * slice_bytes,
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
      const std::size_t c = seg_.layout.slot_bytes;
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
                                   detail::shm_mib(heap_->capacity()) + ", sized by " + seg_.arena_bound + "); " +
                                   detail::shm_space());
    }
    const std::size_t end = std::min(detail::round_up(off + bytes, detail::shm_page), seg_.layout.part_end(seg_.part));
    if (end > reserved_end_) {
      const std::string why = seg_.map.reserve(reserved_end_, end - reserved_end_);
      if (!why.empty()) {
        heap_->deallocate(off, bytes);
        raise_here(errc::system, no_room(bytes) + why);
      }
      reserved_end_ = end;
    }
    populate(off, bytes);
    return seg_.map.base() + off;
  }
  /// Returns a block from allocate(); nullptr is ignored.
  void deallocate(void* p, std::size_t bytes) noexcept {
    if (p == nullptr) return;
    heap_->deallocate(static_cast<std::size_t>(static_cast<std::byte*>(p) - seg_.map.base()), bytes);
  }
  /// True when `p` points into the arena (of any rank).
  bool contains(const void* p) const noexcept {
    const auto* b = static_cast<const std::byte*>(p);
    return seg_.map.base() != nullptr && b >= seg_.map.base() + seg_.layout.arena &&
           b < seg_.map.base() + seg_.layout.total;
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
    if (seg_.map.base() == nullptr) return {{}, -1};
    const auto* h = header();
    const int by = h->aborted_by.load(std::memory_order_acquire);
    if (by < 0 || h->reason_len == 0) return {{}, -1};
    return {{static_cast<errc>(h->reason_code),
             std::string(h->reason, std::min<std::size_t>(h->reason_len, sizeof h->reason))},
            seg_.members[static_cast<std::size_t>(by)]};
  }

 private:
  static constexpr std::size_t nslots = detail::shm_nslots;
  /// Allreduces of at most this many bytes take the tree path whatever the caller's algorithm
  /// (measured: 4 ranks on 2 cores, 4-16 KiB: the tree in 55-65 % of the ring's time).
  static constexpr std::size_t tree_bytes = 16 << 10;
  static constexpr auto slice = detail::timing::shm_wait_slice;

  detail::shm_header* header() const noexcept { return seg_.header(); }
  detail::shm_rank_block& block(int r) const noexcept { return seg_.block(r); }
  std::byte* slot(int r, std::size_t s) const noexcept { return seg_.map.base() + seg_.layout.slot(r, s); }

  /// Maps the pages of a block this rank hands out into its page tables now, in one call
  /// (MADV_POPULATE_WRITE, Linux 5.14), rather than one fault per 4 KiB page at the first
  /// step that writes them. Best effort: an older kernel says EINVAL and the faults come later.
  void populate(std::size_t off, std::size_t bytes) noexcept {
#if defined(MADV_POPULATE_WRITE)
    const std::size_t begin = off / detail::shm_page * detail::shm_page;
    const std::size_t end = std::min(detail::round_up(off + bytes, detail::shm_page), seg_.map.size());
    if (end > begin) (void)::madvise(seg_.map.base() + begin, end - begin, MADV_POPULATE_WRITE);
#else
    (void)off;
    (void)bytes;
#endif
  }

  [[noreturn]] void raise_here(errc e, const std::string& msg) const { detail::raise(e, grank_, msg); }
  /// "rank R": the group's rank of the segment's rank `j`, for messages.
  std::string who(int j) const {
    return "rank " + std::to_string(j >= 0 && j < static_cast<int>(seg_.members.size())
                                        ? seg_.members[static_cast<std::size_t>(j)]
                                        : j);
  }

  std::string no_room(std::size_t bytes) const {
    return "shared-memory segment " + seg_.name + ": no room for a block of " + detail::shm_mib(bytes) +
           " in this rank's part of the arena (" + detail::shm_mib(reserved_end_ - seg_.layout.part_begin(seg_.part)) +
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
    if (seg_.map.base() == nullptr || owner_.forked()) return;  // a forked child must not fail the parent's group
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
      if (auto why = detail::mismatch(peers_[0].coll, seg_.members[0], peers_[j].coll,
                                      seg_.members[static_cast<std::size_t>(j)]);
          !why.empty())
        raise_here(errc::mismatch, why);
  }

  /// Offset of [p, p + bytes) in the segment when it lies wholly in the arena.
  std::uint64_t arena_offset(const void* p, std::size_t bytes) const noexcept {
    const auto* b = static_cast<const std::byte*>(p);
    if (bytes == 0 || !contains(p) || b + bytes > seg_.map.base() + seg_.layout.total)
      return detail::shm_desc::no_offset;
    return static_cast<std::uint64_t>(b - seg_.map.base());
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
    if (dead) {
      // A peer that failed elsewhere (a group call, another transport) recorded why before it
      // left: that is everyone's verdict, not "died" (the group's first failure, judge()).
      const auto v = ctx_.verdict().judge(
          seg_.members[static_cast<std::size_t>(j)], make_error_code(errc::peer_lost), "waiting for " + who(j),
          who(j) + " (pid " + std::to_string(b.pid.load()) + ") died while this rank waited for it", true);
      raise_here(v.failure.code, std::string(what) + ": " + v.failure.text);
    }
    raise_here(errc::timeout, std::string(what) + ": " + who(j) +
                                  " did not arrive before the deadline (waited for its step " + std::to_string(want) +
                                  ", it is at " + std::to_string(b.counter.load()) + ")" +
                                  ctx_.verdict().noted_error(seg_.members[static_cast<std::size_t>(j)]));
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
        ctx_.verdict().note_waiting(seg_.members[static_cast<std::size_t>(j)]);
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
    std::size_t chunk = seg_.layout.slot_bytes / es;
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
        std::byte* src = off != detail::shm_desc::no_offset ? seg_.map.base() + off + b * es : slot(j, s);
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
      const std::size_t chunk = seg_.layout.slot_bytes / es;
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
  bool oversubscribed_ = false;  ///< more ranks than cores on this host
  int spin_ = 0;                 ///< most polls per wait
  int budget_ = 0;               ///< polls of the next wait, adapted between 32 and spin_
  detail::shm_session seg_;      ///< the segment: its name, mapping, layout, this rank's part of the arena
  std::unique_ptr<detail::arena_heap> heap_;
  std::mutex reserve_mu_;         ///< guards reserved_end_
  std::size_t reserved_end_ = 0;  ///< this rank's part has pages up to here (segment offset)
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

}  // namespace DDP_ABI
}  // namespace ddp
