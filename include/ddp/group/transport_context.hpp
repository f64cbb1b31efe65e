#pragma once
/// \file group/transport_context.hpp
/// `ddp::transport_context`: what a transport gets from its group (docs/architecture.md, "Where
/// a new piece goes"). <ddp/process_group.hpp> includes it.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/detail/compiled.hpp>
#include <ddp/group/process_group.hpp>

namespace ddp {
inline namespace DDP_ABI {
class failure_verdict;  // group/verdict.hpp
struct group_failure;   // error.hpp
namespace detail {
struct group_state;  // group/detail/group_state.hpp
class link_hub;      // group/detail/link_hub.hpp
}  // namespace detail

/// A transport's registration for the group's failure as a whole (`transport_context::watch`):
/// while it lives, a group that fails (its heartbeat found a rank frozen or dead) calls the
/// function it holds. Destroying it unregisters, waiting for a call in progress: a transport
/// declares it last, so that it goes first.
class group_watch {
 public:
  group_watch() = default;
  group_watch(group_watch&& o) noexcept : s_(std::move(o.s_)), id_(std::exchange(o.id_, 0)) {}
  group_watch& operator=(group_watch&& o) noexcept {
    if (this != &o) {
      reset();
      s_ = std::move(o.s_);
      id_ = std::exchange(o.id_, 0);
    }
    return *this;
  }
  group_watch(const group_watch&) = delete;
  group_watch& operator=(const group_watch&) = delete;
  ~group_watch() { reset(); }
  /// Unregisters now.
  void reset() noexcept;

 private:
  friend class transport_context;
  group_watch(std::shared_ptr<detail::group_state> s, std::uint64_t id) noexcept : s_(std::move(s)), id_(id) {}
  std::shared_ptr<detail::group_state> s_;
  std::uint64_t id_ = 0;
};

/// What a transport gets from its group, instead of the group's plumbing: rank, size, timeout,
/// the group's id, a channel of its own, the group's store and failure verdict, and a handle
/// that keeps the group open for as long as the transport lives. Built from a `process_group`
/// (implicitly, so `ddp::tcp t{pg}` and `ddp::shm s{pg}` read as they always did); a transport
/// opens its connections with it (`detail::open_links(ctx, prefix, bufsize)`).
///
/// Building one takes the group's next channel: every rank must build its transports in the
/// same order (as it must build them at all: their construction is collective).
/// \code
/// class my_transport {
///  public:
///   explicit my_transport(ddp::transport_context ctx) : ctx_(std::move(ctx)) {}
///   ...
/// };
/// \endcode
class transport_context {
 public:
  /// errc::usage on an empty handle or in a forked child.
  transport_context(process_group& pg);  // NOLINT(google-explicit-constructor): a group is a context
  /// A copy is another transport's context: it takes the group's next channel, so that two
  /// transports built from one context (`ddp::tcp a{ctx}, b{ctx};`) never share a channel and
  /// each other's connections. Collective as building one: copy in the same order on every rank.
  transport_context(const transport_context& o);
  transport_context& operator=(const transport_context& o);
  /// A move keeps the channel: the same transport's context, passed on.
  transport_context(transport_context&&) noexcept = default;
  transport_context& operator=(transport_context&&) noexcept = default;
  ~transport_context() = default;

  int rank() const noexcept { return pg_.rank(); }
  int size() const noexcept { return pg_.size(); }
  std::chrono::milliseconds timeout() const noexcept { return pg_.timeout(); }
  deadline_t deadline() const { return pg_.deadline(); }
  /// The group's id, agreed at rendezvous (distinguishes this group's connections).
  std::uint64_t group_id() const noexcept { return pg_.id(); }
  /// This transport's channel: a number unique in the group, the same on every rank. It names
  /// the transport's keys in the store and its shared segments.
  int channel() const noexcept { return channel_; }
  /// The transport's own handle on the group (collectives during setup: all_gather, barrier).
  process_group& group() noexcept { return pg_; }
  /// The group's store (hosted by rank 0): where a transport's ranks announce addresses.
  kv_store& store() { return pg_.store(); }
  /// The group's failure verdict: record a failure, read the first one, judge a failed link.
  failure_verdict& verdict() noexcept { return *verdict_; }
  /// The rank's one listening port, where a transport's peers connect (`detail::open_links`
  /// opens a channel on it).
  detail::link_hub& hub();
  /// Calls `on_failure` (on the group's reactor thread, once the failure is recorded) when the
  /// group fails as a whole: its heartbeat found a rank frozen or dead (init_options::heartbeat),
  /// or a rank aborted it. A transport aborts
  /// itself there with the group's failure, so that its collectives blocked on a silent peer
  /// end at once. Keep the returned handle for as long as the transport lives.
  group_watch watch(std::function<void(const group_failure&)> on_failure);
  /// True when the group is a generation of an `elastic_group`: once it fails or grows, the
  /// next generation forms on the same hosts, mostly from the same processes, and a transport
  /// may leave what it built for that one to take over (`ddp::shm` keeps its segment mapped;
  /// docs/elastic.md, "Re-forming in the same memory").
  bool elastic() const noexcept;

 private:
  process_group pg_;
  int channel_ = 0;
  failure_verdict* verdict_ = nullptr;  // the group's; lives as long as pg_ does
};

}  // namespace DDP_ABI
}  // namespace ddp

#if !defined(DDP_SEPARATE_COMPILATION)
#include <ddp/group/detail/transport_context_impl.hpp>
#endif
