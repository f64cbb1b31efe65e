#pragma once
/// \file ring.hpp
/// `ddp::ring<Transport>`: reduce-scatter + allgather allreduce, and `ddp::tree<Transport>`:
/// recursive doubling (small messages) and halving-doubling (large), over a point-to-point
/// transport such as `ddp::tcp`. See docs/reducers.md. Both live here because the tree reuses
/// the ring's reduce-scatter, allgather, broadcast and barrier; <ddp/reducer/tree.hpp> includes
/// this header. The step schedules are the pure functions of reducer/detail/schedule.hpp; this file only
/// moves bytes and reduces them. Every message carries the collective's 32-byte descriptor,
/// checked before its payload is used. What the algorithms call on the transport is exactly
/// `ddp::transport` (transport/concept.hpp); `detail::p2p_engine` at the end is the engine
/// `ring<T>` and `tree<T>` run on.
///
/// \code
/// ddp::ring<ddp::tcp> ring{pg};
/// ring.allreduce(std::span<float>{v}, ddp::op::sum);
/// \endcode
#include <ddp/version.hpp>
#include <sys/uio.h>

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstring>
#include <span>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ddp/bucket_tag.hpp>
#include <ddp/clock.hpp>
#include <ddp/detail/collective.hpp>
#include <ddp/detail/copy.hpp>
#include <ddp/detail/kernels.hpp>
#include <ddp/reducer/detail/schedule.hpp>
#include <ddp/error.hpp>
#include <ddp/process_group.hpp>
#include <ddp/reducer/basic_reducer.hpp>
#include <ddp/reducer/detail/front_end.hpp>
#include <ddp/transport/concept.hpp>

namespace ddp {
inline namespace DDP_ABI {

namespace detail {

/// Scratch memory for received data, kept per thread (a reducer's worker, or the caller for
/// inline collectives) so that a collective neither allocates nor zero-fills, nor page-faults
/// through fresh memory, on every call.
inline char* scratch(std::size_t bytes) {
  struct buffer {
    std::unique_ptr<char[]> p;
    std::size_t n = 0;
  };
  thread_local buffer b;
  if (b.n < bytes) {
    b.p.reset(new char[bytes]);
    b.n = bytes;
  }
  return b.p.get();
}

/// The group's rank of transport `t`'s rank `i`: a transport seen through some of its ranks
/// (detail::member_view) renumbers them, and errors must name the group's.
template <class T>
int group_rank_of(const T& t, int i) {
  if constexpr (requires { t.group_rank(i); })
    return t.group_rank(i);
  else
    return i;
}

/// Exchange with descriptors: sends [desc | out] to `to`, receives [desc | in] from `from`,
/// fails the transport with errc::mismatch as soon as the peer's descriptor differs.
/// `on_payload(bytes)` sees how many payload bytes have arrived. `out` and `in` are given as
/// parts, the first of each left empty for the descriptor (filled here).
template <class T, class F>
void exchange_parts(T& t, const coll_desc& d, int to, std::span<iovec> out, int from, std::span<iovec> in,
                    deadline_t until, F&& on_payload) {
  coll_desc theirs{};
  out[0] = {const_cast<coll_desc*>(&d), sizeof d};
  in[0] = {&theirs, sizeof theirs};
  bool checked = false;
  t.sendrecv(to, std::span<const iovec>(out), from, std::span<const iovec>(in), until, [&](std::size_t got) {
    if (got < sizeof(coll_desc)) return;
    if (!checked) {
      checked = true;
      if (auto why = mismatch(d, group_rank_of(t, t.rank()), theirs, group_rank_of(t, from)); !why.empty())
        t.fail(errc::mismatch, why);
    }
    on_payload(got - sizeof(coll_desc));
  });
}

template <class T, class F>
void exchange(T& t, const coll_desc& d, int to, const void* out, std::size_t out_n, int from, void* in,
              std::size_t in_n, deadline_t until, F&& on_payload) {
  iovec o[2] = {{}, {const_cast<void*>(out), out_n}}, i[2] = {{}, {in, in_n}};
  exchange_parts(t, d, to, std::span<iovec>(o, 2), from, std::span<iovec>(i, 2), until, std::forward<F>(on_payload));
}

template <class T>
void exchange(T& t, const coll_desc& d, int to, const void* out, std::size_t out_n, int from, void* in,
              std::size_t in_n, deadline_t until) {
  exchange(t, d, to, out, out_n, from, in, in_n, until, [](std::size_t) {});
}

/// Sends [desc | data] only (one direction; the peer calls recv_checked).
template <class T>
void send_checked(T& t, const coll_desc& d, int to, const void* data, std::size_t n, deadline_t until) {
  t.send(to, &d, sizeof d, until);
  if (n) t.send(to, data, n, until);
}
template <class T>
void recv_checked(T& t, const coll_desc& d, int from, void* data, std::size_t n, deadline_t until) {
  coll_desc theirs{};
  t.recv(from, &theirs, sizeof theirs, until);
  if (auto why = mismatch(d, group_rank_of(t, t.rank()), theirs, group_rank_of(t, from)); !why.empty())
    t.fail(errc::mismatch, why);
  if (n) t.recv(from, data, n, until);
}

/// The parts of an exchange with own_data (kept per thread, as scratch).
struct own_parts {
  std::vector<iovec> send, recv;
};
inline own_parts& own_parts_scratch() {
  thread_local own_parts p;
  return p;
}

/// This rank's own data of an allreduce, where it is: the buffer, except the tensors whose
/// data is elsewhere (bucket_tag::sources: the engine's gradients, in copy mode). The ring
/// reads each element of it once, in its first send or its first reduction, and writes its
/// result once, in its last reduction or its all-gather; so the data stays where it is: the
/// buffer carries only the partial sums of the reduce-scatter (none on 2 ranks).
class own_data {
 public:
  own_data(char* buffer, std::size_t es, std::span<const comm_tensor> tensors, std::span<void* const> sources)
      : buffer_(buffer) {
    for (std::size_t k = 0; k < sources.size() && k < tensors.size(); ++k) {
      char* src = static_cast<char*>(sources[k]);
      const std::size_t begin = tensors[k].offset * es, end = begin + tensors[k].numel * es;
      if (src != nullptr && src != buffer + begin && end > begin) pieces_.push_back({begin, end, src});
    }
    std::sort(pieces_.begin(), pieces_.end(), [](const piece& a, const piece& b) { return a.begin < b.begin; });
  }
  /// True when every byte is in the buffer.
  bool in_buffer() const noexcept { return pieces_.empty(); }
  /// Calls f(pointer, bytes) over bytes [begin, begin + len) of the data, in order: pieces of
  /// the sources, and of the buffer between them. The pointers are where the element is read
  /// and where its result goes.
  template <class F>
  void each(std::size_t begin, std::size_t len, F&& f) const {
    const std::size_t end = begin + len;
    auto it = std::upper_bound(pieces_.begin(), pieces_.end(), begin,
                               [](std::size_t pos, const piece& p) { return pos < p.end; });
    for (std::size_t pos = begin; pos < end;) {
      if (it != pieces_.end() && it->begin <= pos) {
        const std::size_t upto = std::min(it->end, end);
        f(it->src + (pos - it->begin), upto - pos);
        pos = upto;
        ++it;
      } else {
        const std::size_t upto = it != pieces_.end() ? std::min(it->begin, end) : end;
        f(buffer_ + pos, upto - pos);
        pos = upto;
      }
    }
  }
  /// The iovecs of bytes [begin, begin + len) after `parts`' first (left for a descriptor).
  void parts(std::size_t begin, std::size_t len, std::vector<iovec>& parts) const {
    parts.assign(1, iovec{});
    each(begin, len, [&](char* p, std::size_t bytes) { parts.push_back({p, bytes}); });
  }

 private:
  struct piece {
    std::size_t begin, end;  // bytes of the buffer
    char* src;
  };
  char* buffer_;
  std::vector<piece> pieces_;
};

/// Reduce-scatter phase of the ring over `count` elements of `in`, chunk c being partition
/// (count, n, (c + shift) mod n): afterwards the reduction of this rank's chunk (rank + 1) mod n,
/// finished (an average is divided), is at `out`. Received segments are reduced as they land.
/// With `in_place` (the allreduce: `in` is writable, and `out` is its finished chunk) the
/// partial sums are kept in `in` itself; else `in` is only read and they travel through two
/// chunks of scratch, so that a reduce-scatter from a const input needs no work copy of it.
/// With `own` (in place only), this rank's own data is read where `own` says (its first send,
/// and its operand of each first reduction), not from `in`: `in` is written before it is read.
template <class T>
void ring_reduce_scatter(T& t, const coll_desc& d, const char* in, char* in_place, char* out, std::size_t count,
                         dtype ty, op o, std::size_t segment_bytes, int shift, deadline_t until,
                         const own_data* own = nullptr) {
  const int n = t.size(), r = t.rank();
  const std::size_t es = checked_size(ty);
  const std::size_t seg = std::max<std::size_t>(es, segment_bytes / es * es);
  auto chunk = [&](int c) { return partition(count, n, (c + shift) % n); };
  const std::size_t most = partition(count, n, 0).size() * es;  // the first chunk is the largest
  char* recv = scratch((in_place ? 1 : 2) * most);
  char* held = in_place ? nullptr : recv + most;  // the partial sum this rank sends next
  for (int step = 0; step < n - 1; ++step) {
    const ring_step st = ring_schedule(r, n, step);
    const range sc = chunk(st.send_chunk), rc = chunk(st.recv_chunk);
    const bool last = step == n - 2;
    // Step 0 sends this rank's own data; later steps the partial sum formed in the step before.
    const char* send = step == 0 || in_place ? in + sc.begin * es : held;
    char* dst = last ? out : in_place ? in_place + rc.begin * es : recv;
    const char* mine = in + rc.begin * es;
    const std::size_t rbytes = rc.size() * es;
    std::size_t reduced = 0;
    // mine = received op mine keeps the order of operands fixed by the ring: the chunk's
    // partial sum travels in rank order and each rank adds its own contribution on the right.
    // An average scales each rank's data as it enters (the first step receives a rank's own
    // data too) and is divided in the last step, by the chunk's owner, before its one rounding.
    const avg_step avg{n, step == 0 ? 0 : 1, last};
    auto reduce_upto = [&](std::size_t avail) {
      while (reduced < rbytes && (avail - reduced >= seg || avail == rbytes)) {
        const std::size_t len = std::min(seg, avail - reduced);
        if (len == 0) break;
        if (own != nullptr) {
          std::size_t at = reduced;
          // The last step's result goes where the data is (the source, or the buffer).
          own->each(static_cast<std::size_t>(mine - in) + reduced, len, [&](char* p, std::size_t bytes) {
            void* outs[1] = {last ? p : dst + at};
            const void* ins[2] = {recv + at, p};
            combine(outs, 1, ins, 2, bytes / es, ty, o, avg);
            at += bytes;
          });
        } else {
          void* outs[1] = {dst + reduced};
          const void* ins[2] = {recv + reduced, mine + reduced};
          combine(outs, 1, ins, 2, len / es, ty, o, avg);
        }
        reduced += len;
      }
    };
    if (own != nullptr && step == 0) {
      // The first send: this rank's own data, part by part from where it is.
      auto& parts = own_parts_scratch();
      own->parts(sc.begin * es, sc.size() * es, parts.send);
      parts.recv.assign({iovec{}, iovec{recv, rbytes}});
      exchange_parts(t, d, st.send_to, std::span<iovec>(parts.send), st.recv_from, std::span<iovec>(parts.recv), until,
                     reduce_upto);
    } else {
      exchange(t, d, st.send_to, send, sc.size() * es, st.recv_from, recv, rbytes, until, reduce_upto);
    }
    reduce_upto(rbytes);
    if (!in_place && !last) std::swap(recv, held);  // the partial just formed goes out next
  }
}

/// Allgather phase of the ring (chunks numbered as in ring_reduce_scatter, by `shift`): the
/// finished chunks travel around until everyone has all. With `own`, each chunk is sent from
/// and received into where its data is (ring_reduce_scatter left the finished chunk there).
template <class T>
void ring_allgather(T& t, const coll_desc& d, char* data, std::size_t count, std::size_t es, int shift,
                    deadline_t until, const own_data* own = nullptr) {
  const int n = t.size(), r = t.rank();
  auto chunk = [&](int c) { return partition(count, n, (c + shift) % n); };
  for (int step = n - 1; step < 2 * (n - 1); ++step) {
    const ring_step st = ring_schedule(r, n, step);
    const range sc = chunk(st.send_chunk), rc = chunk(st.recv_chunk);
    if (own != nullptr) {
      auto& parts = own_parts_scratch();
      own->parts(sc.begin * es, sc.size() * es, parts.send);
      own->parts(rc.begin * es, rc.size() * es, parts.recv);
      exchange_parts(t, d, st.send_to, std::span<iovec>(parts.send), st.recv_from, std::span<iovec>(parts.recv), until,
                     [](std::size_t) {});
    } else {
      exchange(t, d, st.send_to, data + sc.begin * es, sc.size() * es, st.recv_from, data + rc.begin * es,
               rc.size() * es, until);
    }
  }
}

template <class T>
void ring_barrier(T& t, const coll_desc& d, deadline_t until) {
  // Dissemination barrier: log2(n) rounds of descriptors only.
  const int n = t.size(), r = t.rank();
  for (int k = 1; k < n; k <<= 1) exchange(t, d, (r + k) % n, nullptr, 0, (r - k + n) % n, nullptr, 0, until);
}

template <class T>
void tree_broadcast(T& t, const coll_desc& d, void* data, std::size_t bytes, int root, deadline_t until) {
  const binomial_tree tr = tree_for(t.rank(), t.size(), root);
  if (tr.parent >= 0) recv_checked(t, d, tr.parent, data, bytes, until);
  for (int c : tr.children()) send_checked(t, d, c, data, bytes, until);
}

/// Recursive doubling (small) or halving-doubling (large), with the fold for non-powers of two.
/// Which one is the descriptor's variant (so the schedule is what every peer checked), chosen
/// from reducer_options::small_bytes by p2p_engine<tree_algorithm, T>::variant.
template <class T>
void tree_allreduce(T& t, const coll_desc& d, char* data, std::size_t count, dtype ty, op o,
                    const reducer_options& /*opts: decided in d.variant*/, deadline_t until) {
  const int n = t.size(), r = t.rank();
  const std::size_t es = checked_size(ty), bytes = count * es;
  const bool small = d.variant == coll_variant::recursive_doubling;
  const hd_plan p = small ? plan_recursive_doubling(r, n) : plan_halving_doubling(r, n);
  char* const tmp = scratch(bytes);
  // For an average, whether each side still holds its own rank's data, not yet scaled (see
  // avg_step): true until a rank's first combine, i.e. the fold or level 0. A rank that folded
  // in has combined already, so at level 0 the lower side can be scaled and the upper raw.
  const int folded = 2 * (n - p.p2);  // real ranks below this took part in the fold
  bool mine_raw = true;
  // `last` finishes the average: after the last level this rank's part is the result.
  auto combine_range = [&](std::size_t b, std::size_t e, bool mine_lower, bool theirs_raw, bool last) {
    const bool lower_raw = mine_lower ? mine_raw : theirs_raw, upper_raw = mine_lower ? theirs_raw : mine_raw;
    mine_raw = false;
    if (e <= b) return;
    void* outs[1] = {data + b * es};
    const void* lower = (mine_lower ? data : tmp) + b * es;
    const void* upper = (mine_lower ? tmp : data) + b * es;
    // The order lower op upper is fixed for every op. An average takes its partial results
    // first and raw data after (the kernel scales inputs from raw_from on); sums commute
    // bitwise (NaNs are canonical), so both partners still compute the same bits.
    const void* ins[2] = {lower, upper};
    if (o == op::avg && lower_raw && !upper_raw) std::swap(ins[0], ins[1]);
    combine(outs, 1, ins, 2, e - b, ty, o, avg_step{n, (lower_raw ? 0 : 1) + (upper_raw ? 0 : 1), last});
  };
  // Fold: odd ranks among the first 2(n - p2) hand their data to the even rank below.
  if (p.fold_partner >= 0) {
    if (p.folded_out) {
      send_checked(t, d, p.fold_partner, data, bytes, until);
      recv_checked(t, d, p.fold_partner, data, bytes, until);
      return;
    }
    recv_checked(t, d, p.fold_partner, tmp, bytes, until);
    combine_range(0, count, true, true, false);  // the even rank is the lower one
  }
  const auto levels = p.levels();
  for (std::size_t k = 0; k < levels.size(); ++k) {
    const hd_level& l = levels[k];
    const bool theirs_raw = k == 0 && l.peer >= folded, last = k + 1 == levels.size();
    if (small) {
      exchange(t, d, l.peer, data, bytes, l.peer, tmp, bytes, until);
      combine_range(0, count, l.lower, theirs_raw, last);
    } else {
      const range keep = block_span(count, p.blocks, l.keep_begin, l.keep_end);
      const range send = block_span(count, p.blocks, l.send_begin, l.send_end);
      exchange(t, d, l.peer, data + send.begin * es, send.size() * es, l.peer, tmp + keep.begin * es, keep.size() * es,
               until);
      combine_range(keep.begin, keep.end, l.lower, theirs_raw, last);  // the last keep is block vrank
    }
  }
  if (!small) {
    auto span_of = [&](int b, int e) { return block_span(count, p.blocks, b, e); };
    for (int k = p.num_levels - 1; k >= 0; --k) {
      const hd_level& l = p.level[static_cast<std::size_t>(k)];
      const range keep = span_of(l.keep_begin, l.keep_end), send = span_of(l.send_begin, l.send_end);
      exchange(t, d, l.peer, data + keep.begin * es, keep.size() * es, l.peer, data + send.begin * es, send.size() * es,
               until);
    }
  }
  if (p.fold_partner >= 0) send_checked(t, d, p.fold_partner, data, bytes, until);
}

/// Allreduce of `count` elements at `data`, in place, by `Algorithm` (ring_algorithm or
/// tree_algorithm) over any `ddp::transport`; `d` is the stamped descriptor every message carries.
/// With `own` (the ring, n > 1, count > 0: p2p_engine::allreduce_from), the ring reads this
/// rank's data and writes its results where `own` says.
template <class Algorithm, class T>
void p2p_allreduce(T& t, const coll_desc& d, deadline_t until, void* data, std::size_t count, dtype ty, op o,
                   const reducer_options& opts, const own_data* own = nullptr) {
  const int n = t.size();
  [[maybe_unused]] const std::size_t es = checked_size(ty);  // also where there is nothing to reduce
  auto* p = static_cast<char*>(data);
  if (n == 1 || count == 0) {
    if (n > 1) ring_barrier(t, d, until);  // still checks that everyone agrees
    return;
  }
  if constexpr (std::same_as<Algorithm, tree_algorithm>) {
    tree_allreduce(t, d, p, count, ty, o, opts, until);
  } else {
    // Rank r finishes chunk (r + 1) mod n of the reduce-scatter, in place.
    char* const finished = p + partition(count, n, (t.rank() + 1) % n).begin * es;
    ring_reduce_scatter(t, d, p, p, finished, count, ty, o, opts.segment_bytes, 0, until, own);
    ring_allgather(t, d, p, count, es, 0, until, own);
  }
}

/// The engine of `ring<T>` and `tree<T>` over a point-to-point transport: the reducer's group
/// handle, the transport and the options, and the algorithms above. Tree's reduce_scatter,
/// allgather, broadcast and barrier are the ring's. Runs on the front end's thread.
template <class Algorithm, transport Transport>
class p2p_engine {
  static constexpr bool is_tree = std::same_as<Algorithm, tree_algorithm>;
  static_assert(is_tree || std::same_as<Algorithm, ring_algorithm>,
                "ddp: Algorithm is ring_algorithm or tree_algorithm");

 public:
  static constexpr const char* name = "reducer";
  static constexpr bool descriptors = true;  ///< every message carries the collective's descriptor
  static constexpr bool deadlines = true;
  static constexpr bool launches_at_call = false;
  static constexpr coll_algo id = is_tree ? coll_algo::tree : coll_algo::ring;

  /// The ring's wire schedule depends on nothing but the world size (segment_bytes only sets
  /// how soon received bytes are reduced), so it has no variant; the tree's allreduce is
  /// recursive doubling up to small_bytes, halving-doubling above.
  static coll_variant variant(coll_kind k, std::size_t bytes, const reducer_options& opts) noexcept {
    if (!is_tree || k != coll_kind::allreduce) return coll_variant::none;
    return bytes <= opts.small_bytes ? coll_variant::recursive_doubling : coll_variant::halving_doubling;
  }
  coll_variant variant(coll_kind k, std::size_t bytes) const noexcept { return variant(k, bytes, opts_); }
  /// What every rank must agree on (checked at construction).
  static std::string signature(const reducer_options& opts) {
    if constexpr (is_tree)
      return "tree with reducer_options::small_bytes " + std::to_string(opts.small_bytes);
    else
      return "ring";
  }

  p2p_engine(process_group& pg, reducer_options o)
      : pg_(agree_on_reducer(pg, signature(o))), transport_(pg), opts_(o) {}
  template <class TransportOptions>
  p2p_engine(process_group& pg, TransportOptions t, reducer_options o)
      : pg_(agree_on_reducer(pg, signature(o))), transport_(pg, std::move(t)), opts_(o) {}

  int rank() const noexcept { return pg_.rank(); }
  int size() const noexcept { return pg_.size(); }
  std::chrono::milliseconds timeout() const noexcept { return pg_.timeout(); }
  Transport& transport() noexcept { return transport_; }
  process_group& group() noexcept { return pg_; }
  const reducer_options& options() const noexcept { return opts_; }
  void abort() noexcept { transport_.abort(); }

  void allreduce(const coll_desc& d, deadline_t until, void* data, std::size_t count, dtype ty, op o) {
    p2p_allreduce<Algorithm>(transport_, d, until, data, count, ty, o, opts_);
  }
  /// The ring over a transport that takes any number of parts (tcp) reads a bucket's data where
  /// it is (bucket_tag::sources): the wrapper's copy mode then copies no gradient in.
  static constexpr bool reads_sources = !is_tree && transport_any_parts<Transport>;
  /// allreduce, with this rank's data, and its results, partly at `sources` (bucket_tag::sources).
  void allreduce_from(const coll_desc& d, deadline_t until, void* data, std::size_t count, dtype ty, op o,
                      std::span<const comm_tensor> tensors, std::span<void* const> sources) {
    if (transport_.size() == 1 || count == 0) {  // no ring to run: the data goes nowhere
      const bucket_tag tag{.tensors = tensors, .sources = sources};
      gather_sources(data, ty, tag);
      p2p_allreduce<Algorithm>(transport_, d, until, data, count, ty, o, opts_);
      scatter_sources(data, ty, tensors, sources);
      return;
    }
    const own_data own(static_cast<char*>(data), checked_size(ty), tensors, sources);
    p2p_allreduce<Algorithm>(transport_, d, until, data, count, ty, o, opts_, own.in_buffer() ? nullptr : &own);
  }
  // The ring finishes chunk (r + 1) mod n on rank r; numbering the chunks from n - 1 on makes
  // that slice r, where the caller wants it: no work buffer, no rotated copies, the input only
  // read (the partial sums travel through two slices of scratch).
  void reduce_scatter(const coll_desc& d, deadline_t until, const void* in, void* out, std::size_t per_rank, dtype ty,
                      op o) {
    Transport& t = transport_;
    const int n = t.size();
    const std::size_t slice = per_rank * checked_size(ty);
    if (n == 1) {
      if (out != in) copy_bytes(out, in, slice);
      return;
    }
    ring_reduce_scatter(t, d, static_cast<const char*>(in), nullptr, static_cast<char*>(out),
                        per_rank * static_cast<std::size_t>(n), ty, o, opts_.segment_bytes, n - 1, until);
  }
  void allgather(const coll_desc& d, deadline_t until, const void* in, void* out, std::size_t per_rank, dtype ty) {
    Transport& t = transport_;
    const int n = t.size(), r = t.rank();
    const std::size_t es = checked_size(ty), slice = per_rank * es;
    char* const mine = static_cast<char*>(out) + static_cast<std::size_t>(r) * slice;
    if (mine != in) copy_bytes(mine, in, slice);  // in place: the input is this rank's slice already
    if (n > 1) ring_allgather(t, d, static_cast<char*>(out), per_rank * static_cast<std::size_t>(n), es, n - 1, until);
  }
  void broadcast(const coll_desc& d, deadline_t until, void* data, std::size_t count, dtype ty, int root) {
    tree_broadcast(transport_, d, data, count * dtype_size(ty), root, until);
  }
  void barrier(const coll_desc& d, deadline_t until) { ring_barrier(transport_, d, until); }

 private:
  process_group pg_;  // the reducer's own handle: the group stays open while this lives
  Transport transport_;
  reducer_options opts_;
};

}  // namespace detail

}  // namespace DDP_ABI
}  // namespace ddp
