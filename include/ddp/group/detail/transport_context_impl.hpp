#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// `transport_context`'s constructor (group/transport_context.hpp): inline in a header-only
// build, compiled once in src/ddp.cpp in compiled mode (detail/compiled.hpp).

#include <ddp/version.hpp>
#include <ddp/detail/compiled.hpp>
#include <ddp/group/detail/group_state.hpp>
#include <ddp/group/transport_context.hpp>
#include <ddp/group/verdict.hpp>

namespace ddp {
inline namespace DDP_ABI {

DDP_DECL transport_context::transport_context(process_group& pg) : pg_(pg) {
  auto& g = pg_.live("transport_context");
  channel_ = g.next_channel++;
  verdict_ = &g.verdict;
}

DDP_DECL transport_context::transport_context(const transport_context& o) : pg_(o.pg_), verdict_(o.verdict_) {
  channel_ = pg_.live("transport_context").next_channel++;
}

DDP_DECL transport_context& transport_context::operator=(const transport_context& o) {
  if (this != &o) *this = transport_context(o);
  return *this;
}

DDP_DECL bool transport_context::elastic() const noexcept { return pg_.elastic(); }

DDP_DECL detail::link_hub& transport_context::hub() { return *pg_.live("transport_context::hub").hub; }

DDP_DECL group_watch transport_context::watch(std::function<void(const group_failure&)> on_failure) {
  auto& g = pg_.live("transport_context::watch");
  const auto id = g.watch(std::move(on_failure));
  return group_watch(pg_.s_, id);
}

DDP_DECL void group_watch::reset() noexcept {
  // In a forked child the registry is a copy nobody calls (its lock may even be a copy taken
  // mid-call): left alone.
  if (s_ && id_ != 0 && !s_->owner.forked()) s_->unwatch(id_);
  s_.reset();
  id_ = 0;
}

}  // namespace DDP_ABI
}  // namespace ddp
