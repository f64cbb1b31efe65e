#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// The definitions of group/process_group.hpp: included by it in a header-only build, compiled
// once by src/ddp.cpp with DDP_SEPARATE_COMPILATION (detail/compiled.hpp).

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include <ddp/auth.hpp>
#include <ddp/detail/bytes.hpp>
#include <ddp/detail/compiled.hpp>
#include <ddp/detail/consensus.hpp>
#include <ddp/detail/kernels.hpp>
#include <ddp/detail/socket.hpp>
#include <ddp/group/detail/group_state.hpp>
#include <ddp/group/detail/launcher.hpp>
#include <ddp/group/detail/mesh.hpp>
#include <ddp/group/detail/rendezvous.hpp>
#include <ddp/group/process_group.hpp>
#include <ddp/group/store_client.hpp>
#include <ddp/group/store_server.hpp>
#include <ddp/group/detail/keys.hpp>

namespace ddp {
inline namespace DDP_ABI {

DDP_DECL detail::group_state& process_group::live(const char* what) const {
  if (!s_)
    detail::raise(errc::usage, -1,
                  std::string(what) +
                      " on an empty process_group handle (it was moved from or closed); use "
                      "the handle it was moved to, or one kept by a reducer or wrapper");
  s_->owner.check(s_->rank, std::string("process_group (") + what + ")");
  return *s_;
}

DDP_DECL int process_group::rank() const noexcept { return s_ ? s_->rank : -1; }
DDP_DECL int process_group::size() const noexcept { return s_ ? s_->size : 0; }
DDP_DECL const init_options& process_group::options() const noexcept {
  static const init_options none{};
  return s_ ? s_->opts : none;
}
DDP_DECL std::chrono::milliseconds process_group::timeout() const noexcept { return options().timeout; }
DDP_DECL kv_store& process_group::store() { return *live("store()").store; }
DDP_DECL std::uint64_t process_group::id() const noexcept { return s_ ? s_->group_id : 0; }

DDP_DECL void process_group::barrier(deadline_t until) {
  auto& g = live("barrier()");
  // Dissemination barrier: log2(n) rounds of one byte each way.
  for (int k = 1; k < g.size; k <<= 1) {
    const int to = (g.rank + k) % g.size, from = (g.rank - k + g.size) % g.size;
    const std::uint8_t b = 0xb7;
    send(to, &b, 1, until, "barrier");
    std::uint8_t got = 0;
    recv(from, &got, 1, until, "barrier");
    if (got != b) detail::raise(errc::mismatch, g.rank, "rank " + std::to_string(from) + " is not in barrier()");
  }
}

DDP_DECL void process_group::broadcast(std::span<std::byte> data, int root, deadline_t until) {
  auto& g = live("broadcast()");
  if (root < 0 || root >= g.size)
    detail::raise(errc::invalid_argument, g.rank, "broadcast root " + std::to_string(root) + " is not a rank");
  // Binomial tree rooted at `root`, in virtual ranks relative to the root.
  const int vr = (g.rank - root + g.size) % g.size;
  const std::uint64_t n = data.size();
  int mask = 1;
  while (mask < g.size) {
    if (vr & mask) {
      const int from = ((vr - mask) + root) % g.size;
      std::uint64_t theirs = 0;
      recv(from, &theirs, sizeof theirs, until, "broadcast");
      if (theirs != n)
        detail::raise(errc::mismatch, g.rank,
                      "broadcast size differs: " + std::to_string(n) + " bytes here, " + std::to_string(theirs) +
                          " at rank " + std::to_string(from));
      recv(from, data.data(), data.size(), until, "broadcast");
      break;
    }
    mask <<= 1;
  }
  mask >>= 1;
  while (mask > 0) {
    if (vr + mask < g.size) {
      const int to = (vr + mask + root) % g.size;
      send(to, &n, sizeof n, until, "broadcast");
      send(to, data.data(), data.size(), until, "broadcast");
    }
    mask >>= 1;
  }
}

DDP_DECL std::vector<std::string> process_group::all_gather(const std::string& mine) {
  live("all_gather()");
  return all_gather_until(mine, deadline());
}

// A binomial tree gathers the blobs to rank 0 (each rank talks to log2(size) peers, never
// rank 0 to all), then a broadcast hands the result out.
DDP_DECL std::vector<std::string> process_group::all_gather_until(const std::string& mine, deadline_t until) {
  auto& g = *s_;
  if (mine.size() > max_gather_blob)
    detail::raise(
        errc::invalid_argument, g.rank,
        "all_gather blob of " + std::to_string(mine.size()) + " bytes; at most " + std::to_string(max_gather_blob));
  // `packed`: (u64 length, bytes) for this rank and the ranks after it in its subtree.
  std::string packed = detail::encode_i64(static_cast<std::int64_t>(mine.size())) + mine;
  for (int mask = 1; mask < g.size; mask <<= 1) {
    if (g.rank & mask) {
      const std::uint64_t n = packed.size();
      send(g.rank - mask, &n, sizeof n, until, "all_gather");
      send(g.rank - mask, packed.data(), packed.size(), until, "all_gather");
      break;
    }
    const int child = g.rank + mask;
    if (child >= g.size) continue;
    const auto ranks = static_cast<std::uint64_t>(std::min(mask, g.size - child));
    std::uint64_t n = 0;
    recv(child, &n, sizeof n, until, "all_gather");
    // Lengths from the wire are checked before anything is allocated with them.
    if (n > ranks * (8 + max_gather_blob))
      detail::raise(errc::protocol, g.rank,
                    "all_gather: rank " + std::to_string(child) + " announced " + std::to_string(n) + " bytes for " +
                        std::to_string(ranks) + " ranks");
    const auto at = packed.size();
    packed.resize(at + n);
    recv(child, packed.data() + at, n, until, "all_gather");
  }
  detail::broadcast_blob([&](std::span<std::byte> b) { broadcast(b, 0, until); }, packed, g.rank, 0,
                         8 * static_cast<std::size_t>(g.size), static_cast<std::size_t>(g.size) * (8 + max_gather_blob),
                         "all_gather");
  std::vector<std::string> all(static_cast<std::size_t>(g.size));
  std::size_t pos = 0;
  for (auto& s : all) {
    if (packed.size() - pos < 8) detail::raise(errc::protocol, g.rank, "all_gather: truncated result from rank 0");
    const auto n = static_cast<std::uint64_t>(detail::decode_i64(std::string_view(packed).substr(pos, 8)));
    if (n > packed.size() - pos - 8) detail::raise(errc::protocol, g.rank, "all_gather: malformed result from rank 0");
    s = packed.substr(pos + 8, n);
    pos += 8 + n;
  }
  if (pos != packed.size()) detail::raise(errc::protocol, g.rank, "all_gather: malformed result from rank 0");
  return all;
}

// Each rank contributes a tagged record (tag, dtype, op, count, values) through all_gather;
// every rank checks all records, then combines them in rank order: the same inputs in the
// same order through the same kernel give the same bits on every rank.
DDP_DECL void process_group::all_reduce_erased(void* values, std::size_t n, dtype t, op o, deadline_t until) {
  auto& g = *s_;
  constexpr std::uint32_t tag = 0x64415231;  // "1RAd" on the wire: a record of all_reduce()
  // tag, dtype, op, 2 zero bytes, count: 16 bytes, so that the values that follow lie as
  // aligned as the string's heap buffer (16 bytes) and the kernels read them as T.
  constexpr std::size_t head = 16;
  if (static_cast<unsigned>(o) > static_cast<unsigned>(op::prod))
    detail::raise(errc::invalid_argument, g.rank, "all_reduce: unknown op " + std::to_string(static_cast<int>(o)));
  const std::size_t es = detail::checked_size(t);
  if (n > process_group::max_all_reduce_bytes / es)
    detail::raise(errc::invalid_argument, g.rank,
                  "all_reduce of " + std::to_string(n) + " " + dtype_name(t) + " values (" + std::to_string(n) + " x " +
                      std::to_string(es) + " bytes); at most " + std::to_string(process_group::max_all_reduce_bytes) +
                      " bytes: use a reducer (ddp::ring) for larger buffers");
  std::string mine;
  detail::byte_writer(mine)
      .u32(tag)
      .u8(static_cast<std::uint8_t>(t))
      .u8(static_cast<std::uint8_t>(o))
      .zeros(2)
      .u64(n)
      .raw(std::span(static_cast<const std::byte*>(values), n * es));
  std::vector<std::string> all;
  try {
    all = all_gather_until(mine, until);
  } catch (const error& e) {
    // A lost or frozen peer: said as the failure of this call, with the cause.
    detail::raise(e.condition(), g.rank, "all_reduce: " + std::string(e.message()), e.bucket(), e.parameter());
  }
  // Every rank reads every record the same way, so every rank raises the same error.
  struct record {
    bool ok = false;
    dtype t{};
    op o{};
    std::uint64_t n = 0;
  };
  const auto read = [&](const std::string& blob) {
    detail::byte_reader r(blob);
    record rec;
    const auto tg = r.u32();
    const auto ty = r.u8();
    const auto op_ = r.u8();
    r.zeros(2);
    rec.n = r.u64();
    rec.ok = r.ok() && tg == tag && ty <= static_cast<std::uint8_t>(dtype::i64) &&
             op_ <= static_cast<std::uint8_t>(op::prod);
    rec.t = static_cast<dtype>(ty);
    rec.o = static_cast<op>(op_);
    rec.ok = rec.ok && r.remaining() / dtype_size(rec.t) == rec.n && r.remaining() % dtype_size(rec.t) == 0;
    return rec;
  };
  const auto says = [](int q, const record& rec) {
    if (!rec.ok) return "rank " + std::to_string(q) + " is not in all_reduce() (another collective?)";
    return "rank " + std::to_string(q) + " reduces " + std::to_string(rec.n) + " " + dtype_name(rec.t) +
           (rec.n == 1 ? " value" : " values") + " with " + op_name(rec.o);
  };
  const record first = read(all[0]);
  std::string differ;
  int differing = 0;
  for (int q = 0; q < g.size; ++q) {
    const record rec = q == 0 ? first : read(all[static_cast<std::size_t>(q)]);
    if (rec.ok && first.ok && rec.t == first.t && rec.o == first.o && rec.n == first.n) continue;
    if (++differing <= 4) differ += (differ.empty() ? "" : ", ") + says(q, rec);
  }
  if (differing > 0) {
    if (differing > 4) differ += " and " + std::to_string(differing - 4) + " more";
    detail::raise(errc::mismatch, g.rank,
                  "all_reduce: ranks disagree: " + (first.ok ? says(0, first) + "; " : std::string()) + differ);
  }
  std::vector<const void*> ins(static_cast<std::size_t>(g.size));
  for (std::size_t q = 0; q < ins.size(); ++q) ins[q] = all[q].data() + head;
  void* outs[1] = {values};
  detail::combine(outs, 1, ins.data(), g.size, n, t, o, detail::avg_step{g.size, 0, true});
}

DDP_DECL int process_group::connections() const noexcept { return s_ && s_->links ? s_->links->connections() : 0; }

// The reason goes to the store so that peers report it; the mesh is shut down so that blocked
// peers wake.
DDP_DECL void process_group::abort(const std::string& why) noexcept {
  if (!s_ || s_->owner.forked() || s_->aborted.exchange(true)) return;
  s_->fail_now({errc::aborted, "group aborted by rank " + std::to_string(s_->rank) + ": " + why, -1, s_->rank});
}
DDP_DECL bool process_group::aborted() const noexcept { return s_ && s_->aborted.load(); }
DDP_DECL void process_group::note_sharded_state(int replicas) noexcept {
  if (s_ && replicas < 2) s_->sharded_state.store(true);
}
DDP_DECL void process_group::note_shards_whole(bool whole) noexcept {
  if (s_) s_->shards_whole.store(whole);
}
DDP_DECL bool process_group::shards_whole() const noexcept { return s_ && s_->shards_whole.load(); }
DDP_DECL void process_group::note_error(const std::string& text) noexcept {
  if (s_ && !s_->owner.forked()) s_->verdict.note_error(text);
}
DDP_DECL bool process_group::has_sharded_state() const noexcept { return s_ && s_->sharded_state.load(); }
DDP_DECL bool process_group::expects_equal_state() const noexcept { return s_ && s_->equal_state; }
DDP_DECL bool process_group::elastic() const noexcept { return s_ && s_->elastic; }
DDP_DECL void process_group::abort(const std::exception& e) noexcept {
  if (!s_ || s_->owner.forked()) return;
  try {
    abort(detail::message_of(e));
  } catch (...) {
    abort();
  }
}

DDP_DECL void process_group::send(int peer, const void* p, std::size_t n, deadline_t until, const char* what) {
  const int fd = link(peer, until, what);
  std::error_code ec;
  detail::send_all(fd, p, n, until, ec);
  if (ec) lost(peer, ec, what);
}
DDP_DECL void process_group::recv(int peer, void* p, std::size_t n, deadline_t until, const char* what) {
  const int fd = link(peer, until, what);
  std::error_code ec;
  detail::recv_all(fd, p, n, until, ec);
  if (ec) lost(peer, ec, what);
}
DDP_DECL int process_group::link(int peer, deadline_t until, const char* what) {
  auto& g = *s_;
  if (g.aborted.load()) detail::raise(errc::aborted, g.rank, std::string(what) + ": this rank's group was aborted");
  if (const int fd = g.links->connected(peer); fd >= 0) return fd;
  try {
    return g.links->get(peer, until);
  } catch (const error& e) {
    if (e.condition() != errc::timeout && e.condition() != errc::peer_lost) throw;
    lost(peer, make_error_code(e.condition()), what, detail::message_of(e));
  }
}
DDP_DECL void process_group::lost(int peer, const std::error_code& ec, const char* what, const std::string& why) {
  auto& g = *s_;
  if (g.aborted.load()) detail::raise(errc::aborted, g.rank, std::string(what) + ": this rank's group was aborted");
  const auto v = g.verdict.judge(peer, ec, "waiting for rank " + std::to_string(peer), why);
  // The judgement recorded the failure (or adopted the one recorded first): the fan-out shuts
  // the mesh, so that peers blocked on this rank wake, and aborts every transport on the group.
  g.failed.exchange(true);
  g.fan_out_once(v.adopted ? v.failure : group_failure{v.failure.code, g.verdict.reported(v.failure.text), -1, g.rank});
  detail::raise(v.failure.code, g.rank, std::string(what) + ": " + v.failure.text);
}

DDP_DECL process_group init_process_group(const init_options& given) {
  if (auto why = given.validate(); !why.empty()) detail::raise(errc::invalid_argument, given.rank, why);
  // A store of its own backend (etcd) is served by nobody in the group.
  init_options opts = given;
  if (!opts.store_url.empty()) opts.external_store = true;
  detail::refuse_elastic_backend(opts);
  // A token with no authenticator installed is errc::unsupported: never run unauthenticated
  // when a secret was asked for.
  std::shared_ptr<const authenticator> auth;
  if (!opts.auth_token.empty()) auth = make_authenticator(opts.auth_token, opts.rank);
  auto group = std::make_shared<detail::group_state>();
  auto& pg = *group;
  pg.opts = opts;
  pg.rank = opts.rank;
  pg.size = opts.world_size;
  const auto joining =
      opts.rendezvous_timeout.count() > 0 ? std::min(opts.rendezvous_timeout, opts.timeout) : opts.timeout;
  const auto until = steady_clock::now() + joining;
  const int rank = opts.rank;

  // Resolve first, so an unresolvable master fails at once on every rank.
  const auto eps = opts.store_url.empty() ? detail::resolve(opts.master_addr, opts.master_port, rank)
                                          : std::vector<detail::endpoint>{};
  // Without a secret, anyone who reaches the store could join the group or disturb it: that is
  // only acceptable on loopback, unless the user says otherwise.
  const auto refuse_open = [&](const std::string& what) {
    detail::raise(errc::auth_failed, rank,
                  what +
                      " beyond this host and the group has no secret: any process that reaches it could join or "
                      "disturb the group. Give every rank the same secret in DDP_AUTH_TOKEN (or "
                      "init_options::auth_token; docs/security.md), or accept an unauthenticated network with "
                      "DDP_INSECURE=1 (or init_options::insecure = true)");
  };
  if (!auth && !opts.insecure)
    for (const auto& ep : eps)
      if (!detail::is_loopback(ep.addr))
        refuse_open("the group's store at " + opts.master_addr + ":" + std::to_string(opts.master_port) + " (" +
                    detail::to_string(ep.addr) + ") is reachable");
  // Only connections that claimed a rank (pg/rank/<r>) may write: a stranger can read, but can
  // neither plant a failure, an address or a record, nor hold rank 0's exit (docs/security.md).
  if (rank == 0 && !opts.external_store)
    pg.server = std::make_unique<store_server>(endpoint{opts.master_addr, opts.master_port}, 0, auth, store_limits{},
                                               std::string(detail::keys::seat_prefix),
                                               static_cast<std::uint32_t>(opts.world_size));
  const detail::join_request join{rank,
                                  opts.world_size,
                                  opts.job_id,
                                  opts.master_addr + ":" + std::to_string(opts.master_port),
                                  static_cast<long long>(joining.count()),
                                  static_cast<long long>(opts.heartbeat.count()),
                                  !opts.external_store};
  for (;;) {
    pg.store = connect_store(opts, auth, until);
    pg.store->set_prefix(opts.key_prefix);
    try {
      pg.group_id = detail::join_store(*pg.store, join, until);
      break;
    } catch (const detail::earlier_run_store& old) {
      // The job's previous run still holds the port (its launcher is ending its ranks, and its
      // store goes with them): connect again until this run's store answers.
      pg.store.reset();
      if (steady_clock::now() + detail::timing::earlier_run_retry >= until)
        detail::raise(errc::timeout, rank,
                      "rendezvous timed out after " + std::to_string(joining.count()) + " ms: the store at " +
                          join.where + " still serves the job's earlier run" +
                          (old.theirs.empty() ? std::string() : " '" + old.theirs + "'") + ", not this one ('" +
                          opts.job_id + "')");
      std::this_thread::sleep_for(detail::timing::earlier_run_retry);
    }
  }
  auto& st = *pg.store;
  // The links between ranks listen where this host reaches the store: beyond loopback they need
  // the secret, as the built-in store does.
  if (!auth && !opts.insecure && !opts.store_url.empty() && !detail::is_loopback(st.local_address()))
    refuse_open("the group's links listen on " + detail::to_string(st.local_address()) + ", reachable");
  pg.verdict = failure_verdict(pg.store.get(), rank, opts.world_size, opts.timeout, opts.external_store);
  // Everything this rank does in the background runs on one thread, and every channel's peers
  // connect to one port (group/detail/reactor.hpp, link_hub.hpp).
  pg.loop = std::make_unique<detail::reactor>(rank, "group");
  pg.hub = std::make_unique<detail::link_hub>(*pg.loop, st.local_address(), auth, rank);
  pg.links = detail::open_links(st, *pg.hub, pg.group_id, opts.world_size, opts.timeout, detail::keys::mesh, 0,
                                [v = &pg.verdict] { return v->recorded(); });
  // The first barrier makes each rank's first connections (log2(size) peers) and proves the
  // group can talk; a failure there is reported like any other.
  process_group handle(std::move(group));
  handle.barrier(until);
  if (opts.heartbeat.count() > 0 && opts.world_size > 1) {
    // The heartbeat's ring, on connections of its own: each rank beats to its successor and
    // watches its predecessor (group/detail/heartbeat.hpp).
    const int succ = (rank + 1) % opts.world_size, pred = (rank + opts.world_size - 1) % opts.world_size;
    pg.heartbeat_links = detail::open_links(st, *pg.hub, pg.group_id, opts.world_size, opts.timeout,
                                            detail::keys::heartbeat, 0, [v = &pg.verdict] { return v->recorded(); });
    const int succ_fd = pg.heartbeat_links->get(succ, until);
    const int pred_fd = pg.heartbeat_links->get(pred, until);
    pg.heartbeat = std::make_unique<detail::heartbeat_watch>(
        *pg.loop, pred_fd, pred, succ_fd, opts.heartbeat,
        [g = &pg, pred](errc code, const std::string& text, bool dead) {
          // An elastic group's next generation forms without the rank found dead here (the
          // courier says so in its store before it records the failure). A rank that left after
          // a failure is not dead: it registers in the next round.
          g->fail_later(g->verdict.as_recorded(code, text), dead ? pred : -1);
        },
        [g = &pg] { return g->failed.load() || g->aborted.load(); });
  }
  // Under a launcher that ends a host's ranks when one fails (ddprun --nnodes), the launcher
  // says first which rank failed: recorded as the group's failure, so that the other hosts
  // name that rank rather than the ranks the launcher ended.
  if (const int fd = detail::launcher_fd(); fd >= 0)
    pg.launcher = std::make_unique<detail::launcher_watch>(*pg.loop, fd, [g = &pg, fd](const std::string& note) {
      g->loop->post_blocking([g, fd, note] {
        if (!note.empty()) g->verdict.record(group_failure::decode(note));
        detail::launcher_watch::ack(fd);
      });
    });
  return handle;
}

}  // namespace DDP_ABI
}  // namespace ddp
