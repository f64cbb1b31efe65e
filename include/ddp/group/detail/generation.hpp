#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// What an elastic group (group/elastic.hpp, through its environment, elastic_env.hpp) may ask of
// one generation's process group, and nothing more: mark it a generation, leave its heartbeat,
// read and post its failure, learn the rank its heartbeat found dead, and let it go. The elastic
// group never touches the group's state itself; this link is the one door, and the only part of
// ddp besides the group's own that process_group lets in (as transport_context is a transport's).

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include <ddp/detail/timing.hpp>
#include <ddp/error.hpp>
#include <ddp/group/detail/group_state.hpp>
#include <ddp/group/process_group.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

class generation_link {
 public:
  generation_link() = default;

  /// An empty process_group (no generation formed yet).
  static process_group no_group() { return process_group(nullptr); }
  /// The link to `g`'s group, which an elastic group just formed: marks it a generation (its
  /// transports may leave what they built for the next one), and says whether its ranks all hold
  /// the state of one committed step (process_group::expects_equal_state).
  static generation_link of(process_group& g, bool equal_state) {
    generation_link l;
    l.s_ = g.s_;
    if (l.s_) {
      l.s_->equal_state = equal_state;
      l.s_->elastic = true;
    }
    return l;
  }

  bool valid() const noexcept { return s_ != nullptr; }

  /// Stops this rank's heartbeat: a goodbye (this rank is leaving, not dead), and the
  /// predecessor's word (its goodbye or its death) before it goes.
  void leave_heartbeat() {
    if (!s_ || !s_->heartbeat) return;
    s_->heartbeat->leave(timing::elastic_leave_wait);
    s_->heartbeat.reset();
  }
  /// Whether the generation failed: posted here, aborted, or recorded by any rank.
  bool failed() {
    if (!s_) return true;
    if (s_->failed.load() || s_->aborted.load()) return true;
    return s_->verdict.recorded();
  }
  /// The generation's recorded failure, in words.
  std::string failure_text() {
    if (!s_) return "no group";
    const auto f = s_->verdict.first();
    return f.empty() ? std::string("a rank failed") : f.text;
  }
  /// Fails the generation: wakes every peer still blocked on this rank with `text` (as the group
  /// records it when `as_recorded`: a relayed verdict keeps its origin).
  void fail(errc code, const std::string& text, bool as_recorded) {
    if (!s_) return;
    s_->fail_now(as_recorded ? s_->verdict.as_recorded(code, text) : group_failure{code, text});
  }
  /// The rank this rank's heartbeat found frozen or dead, or -1.
  int found_dead() const noexcept { return s_ ? s_->found_dead.load() : -1; }
  /// `fn` is told (on the group's courier thread, never the heartbeat's) the rank the heartbeat
  /// finds frozen or dead.
  void on_found_dead(std::function<void(int)> fn) {
    if (!s_) return;
    std::lock_guard lock(s_->found_mu);
    s_->on_found_dead = std::move(fn);
  }
  /// The generation ends for the elastic group: what the courier was handed (the rank the
  /// heartbeat found dead, said in the store) is done first, then the group stops telling it,
  /// and the link lets go (the group closes with its last handle).
  void release() noexcept {
    if (!s_) return;
    try {
      if (s_->loop) s_->loop->settle();
    } catch (...) {
    }
    {
      std::lock_guard lock(s_->found_mu);
      s_->on_found_dead = nullptr;
    }
    s_.reset();
  }

 private:
  std::shared_ptr<group_state> s_;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
