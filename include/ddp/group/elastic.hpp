#pragma once
/// \file group/elastic.hpp
/// `ddp::elastic_group`: a group that survives the loss of ranks and takes new ones in, between
/// a minimum and a maximum size (`DDP_ELASTIC=MIN:MAX`, `ddprun --elastic MIN:MAX`). Each step
/// is committed through the store, on every rank or on none; a failed step is dropped on every
/// survivor alike, the survivors re-form with fresh, contiguous ranks, and a new member gets the
/// parameters and the registered state from the new rank 0, never from a file. See
/// docs/elastic.md.
///
/// \code
/// ddp::elastic_group eg{ddp::init_options::from_env()};
/// std::optional<ddp::data_parallel> dp;
/// eg.on_form([&](ddp::process_group& pg) { dp.reset(); dp.emplace(pg, params); });
/// eg.on_state([&] { return save_momentum(); }, [&](std::string_view s) { load_momentum(s); });
/// eg.start();
/// while (eg.step() < steps) try {
///   model.forward_backward(batch(eg), [&](std::size_t i) { dp->grad_ready(i); });
///   dp->finish();
///   eg.commit([&] { model.step(); });  // applies the step only where every rank committed it
/// } catch (const ddp::error& e) {
///   if (!eg.recover(e)) return 0;  // the group failed: re-form without the lost ranks (or rethrow)
/// }
/// eg.finish();
/// \endcode

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/auth.hpp>
#include <ddp/clock.hpp>
#include <ddp/detail/bytes.hpp>
#include <ddp/detail/consensus.hpp>
#include <ddp/detail/parked.hpp>
#include <ddp/error.hpp>
#include <ddp/group/detail/elastic_env.hpp>
#include <ddp/group/detail/elastic_rules.hpp>
#include <ddp/group/process_group.hpp>
#include <ddp/group/kv_store.hpp>
#include <ddp/group/store_server.hpp>
#include <ddp/group/verdict.hpp>
#include <ddp/group/detail/keys.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// How an elastic group re-forms (docs/elastic.md).
struct elastic_options {
  /// How long a re-forming group waits for a member of the last generation that neither came
  /// back nor was found dead (its heartbeat's watcher was lost with it) before it re-forms
  /// without it. 0: twice the heartbeat's lease.
  std::chrono::milliseconds settle{0};
  /// How long the first generation waits for the ranks the launcher started before it forms
  /// with those that came (at least the minimum). 0: the group's timeout.
  std::chrono::milliseconds first_wait{0};
  /// Bound on the rendezvous of a new generation: every member of a closed round is alive and
  /// joining, so it is quick; one that died meanwhile makes it fail at this bound, and the next
  /// round forms without it. 0: twice the heartbeat's lease, at least 2 s.
  std::chrono::milliseconds reform_timeout{0};
  /// Says on stderr (rank 0) each re-formation: the generation, its size, why.
  bool verbose = false;
};

/// A group that survives the loss of ranks (SIGKILL, SIGSTOP, a cut link) and grows back to its
/// maximum as new processes arrive. It needs a heartbeat (1 s lease unless
/// `init_options::heartbeat` says otherwise), and its store must outlive any rank: `ddprun
/// --elastic` serves it; without a launcher's store, the launcher's rank 0 hosts it and its
/// loss ends the job (docs/elastic.md, "Limits").
///
/// The protocol, per step: every rank votes in the store after `finish()` (`commit`); the last
/// vote commits the step, and a failure before it drops the step on every rank (a rank that
/// finds the group failed decides "dropped" with one compare-and-set, so both answers cannot
/// be given). Per re-formation: the survivors and any waiting newcomers register in the next
/// round; the round closes once every member of the last generation has come back or been
/// found dead (or after `settle`), with ranks in the old order, newcomers last; `on_form`
/// rebuilds the wrappers on the new group (their construction broadcasts rank 0's parameters,
/// or, when every member holds the state of the same step, only compares hashes of them:
/// process_group::expects_equal_state), and rank 0's step count and registered state
/// (`on_state`) reach every rank.
///
/// `basic_elastic_group<Env>` runs it in the world `Env` gives (group/detail/elastic_env.hpp);
/// `elastic_group` is the real one.
template <class Env>
class basic_elastic_group {
 public:
  using group_type = typename Env::group;

  /// Joins the elastic group that `opts` names (its `elastic_min` / `elastic_max`, from
  /// `DDP_ELASTIC`; a non-elastic `opts` is a group of fixed size, min = max = world_size). The
  /// group forms in `start()`, after the callbacks are set.
  explicit basic_elastic_group(init_options opts, elastic_options eo = {}, Env env = {})
      : opts_(std::move(opts)), eo_(eo), env_(std::move(env)) {
    if (opts_.elastic_max == 0) opts_.elastic_min = opts_.elastic_max = opts_.world_size;
    if (!opts_.store_url.empty()) opts_.external_store = true;  // etcd: served by nobody in the group
    if (auto why = opts_.validate(); !why.empty()) detail::raise(errc::invalid_argument, opts_.rank, why);
    detail::refuse_elastic_backend(opts_);
    if (opts_.heartbeat.count() == 0) opts_.heartbeat = std::chrono::seconds(1);
    if (eo_.settle.count() == 0) eo_.settle = 2 * opts_.heartbeat;
    if (eo_.first_wait.count() == 0) eo_.first_wait = opts_.timeout;
    if (eo_.reform_timeout.count() == 0)
      eo_.reform_timeout = std::max<std::chrono::milliseconds>(2 * opts_.heartbeat, std::chrono::seconds(2));
    job_ = opts_.job_id.empty() ? std::string("elastic") : opts_.job_id;
    uid_ = env_.uid();
    holds_ = env_.restarted() ? detail::elastic::holds_nothing : detail::elastic::holds_initial;
    const auto until = env_.now() + opts_.timeout;
    coord_ = env_.open_store(opts_, !opts_.external_store && opts_.rank == 0 && !env_.restarted(), until);
    if (coord_->compare_set(detail::keys::elastic_seat(uid_), "", "1", until) != "1")
      detail::raise(errc::protocol, opts_.rank, "elastic group: could not claim this process's seat in the store");
  }
  basic_elastic_group(const basic_elastic_group&) = delete;
  basic_elastic_group& operator=(const basic_elastic_group&) = delete;
  ~basic_elastic_group() {
    env_.close(pg_);
    (void)env_.drop_parked();
    coord_.reset();  // a store this process hosts stays up (bounded) while others use it
  }

  /// Called on every rank each time a generation forms (the first one too), before the state
  /// transfer: build the wrappers and reducers on `pg` there (dropping the old ones first).
  void on_form(std::function<void(group_type&)> fn) { on_form_ = std::move(fn); }
  /// The state a new member needs besides the parameters (optimizer state, sampler position,
  /// anything the program keeps): `save` runs on the new rank 0, `load` on every other rank.
  /// What `save` returns travels to every rank at each formation, at most max_state_bytes
  /// (more fails the formation with errc::protocol on every rank).
  void on_state(std::function<std::string()> save, std::function<void(std::string_view)> load) {
    save_ = std::move(save);
    load_ = std::move(load);
  }

  /// What every member must share, said before start() (the model's parameter names and
  /// shapes, say): the first generation publishes it, and a newcomer whose own differs is
  /// refused before it takes a seat, with errc::mismatch naming the first difference, while the
  /// group goes on (its wrappers' construction would otherwise fail the whole new generation).
  void signature(std::string s) { signature_ = std::move(s); }

  /// Forms the first generation (the ranks the launcher started), or joins a running job as a
  /// new member at its next step boundary. Returns false when the job finished before this
  /// process got a seat (a newcomer that came too late: it should exit normally).
  bool start() {
    const auto until = env_.now() + opts_.timeout;
    std::string gen;
    if (coord_->check(detail::keys::generation, until)) gen = coord_->get(detail::keys::generation, until);
    if (gen.empty() && !env_.restarted()) {
      // The first generation: the launcher's ranks, in their order.
      round_ = 0;
      prev_size_ = opts_.world_size;
      return form(opts_.rank, /*member=*/true, eo_.first_wait, "first generation");
    }
    if (!signature_.empty() && !gen.empty()) check_signature(until);
    round_ = gen.empty() ? 0 : static_cast<int>(detail::keys::int_of(gen, opts_.rank, detail::keys::generation)) + 1;
    prev_size_ = 0;
    holds_ = detail::elastic::holds_nothing;  // the running job's state comes from its rank 0
    return form(joiner_prio, /*member=*/false, opts_.timeout, "joined");
  }

  group_type& group() noexcept { return pg_; }
  int rank() const noexcept { return pg_.rank(); }
  int size() const noexcept { return pg_.size(); }
  /// The current generation (0 for the first; each re-formation takes the next number).
  int generation() const noexcept { return gen_; }
  /// Steps committed by the group so far (the same on every rank).
  std::uint64_t step() const noexcept { return step_; }
  /// Re-formations after a failure, as the group counts them (rank 0's count reaches every
  /// new member).
  int failures() const noexcept { return failures_; }
  /// The sizes of the group's generations so far, in order (rank 0's record).
  const std::vector<int>& sizes() const noexcept { return sizes_; }
  const init_options& options() const noexcept { return opts_; }

  /// Ends a step after `finish()`: votes in the store, and once every rank of the generation
  /// voted, runs `apply` (the optimizer step) and counts the step. When the group failed
  /// first, throws errc::aborted ("step N dropped") on every survivor alike, without `apply`:
  /// catch it with the wrapper's errors and call recover(). When newcomers wait and the group
  /// is below its maximum, the group re-forms with them right after `apply`.
  void commit(const std::function<void()>& apply) {
    auto& st = *coord_;
    const auto until = env_.now() + opts_.timeout;
    const std::string base = detail::keys::step(gen_, step_);
    const int n = pg_.size();
    std::string d;
    namespace rules = detail::elastic;
    rules::step_view sv;
    sv.votes = st.add(detail::keys::votes(base), 1, until);
    sv.world = n;
    sv.max = opts_.elastic_max;
    if (sv.votes >= n) {
      if (n < opts_.elastic_max) sv.waiting = st.add(detail::keys::arrivals(detail::keys::round(gen_ + 1)), 0, until);
      // The first step this generation commits makes it the live one: from then on only its
      // members (and generations formed from them) are sources of the state, never a rank that
      // was frozen while it committed. Said before the decision, so that no step is committed
      // while the store still names an older live generation.
      sv.sharded = pg_.has_sharded_state();
      if (!live_said_) {
        say_live(sv.sharded, until);
        live_said_ = true;
      }
      const auto proposal = rules::name(rules::decide_step(sv));
      d = st.compare_set(detail::keys::decision(base), "", proposal, until);
      // A rank stopped (SIGSTOP) before its vote may thaw, vote last, and decide a step that the
      // group dropped long ago and whose keys it has swept since, its decision making the key
      // afresh. The sweep marks a generation before its keys go, so a decision made after the
      // sweep sees the mark (one request, on the deciding rank only).
      if (d == proposal && d != "abort")
        if (const auto sw = st.try_get(detail::keys::swept_steps, std::chrono::milliseconds(0), until);
            sw && detail::keys::int_of(*sw, pg_.rank(), detail::keys::swept_steps) >= gen_)
          detail::raise(errc::aborted, pg_.rank(),
                        "elastic: step " + std::to_string(step_) +
                            " dropped: this rank was stopped while the group went on without generation " +
                            std::to_string(gen_));
      // A newcomer waiting for a seat sees the job alive: noted once a second at most, off the
      // per-step path.
      if (const auto now = env_.now(); now - progress_noted_ >= std::chrono::seconds(1)) {
        st.set(detail::keys::progress, detail::keys::int_value(static_cast<std::int64_t>(step_ + 1)), until);
        progress_noted_ = now;
      }
      // Every rank voted in this step, so each has read the decisions of the steps before it:
      // the last block's keys go in one request, once a block (off the per-step path).
      if (step_ % detail::keys::step_block == 0 && step_ > 0)
        (void)st.erase_prefix(detail::keys::step_block_of(gen_, step_ / detail::keys::step_block - 1), until);
    }
    while (d.empty()) {
      // The decision in one round trip once it is there; a look at the group's health every poll.
      if (auto got = st.try_get(detail::keys::decision(base), detail::timing::elastic_poll, until)) {
        d = std::move(*got);
        break;
      }
      if (env_.now() >= until)
        detail::raise(errc::timeout, pg_.rank(), "elastic: step " + std::to_string(step_) + " was never decided");
      sv.group_failed = env_.failed(pg_);
      if (rules::decide_step(sv) == rules::step_outcome::abort)
        d = st.compare_set(detail::keys::decision(base), "", "abort", until);
    }
    if (d == "abort")
      detail::raise(errc::aborted, pg_.rank(),
                    "elastic: step " + std::to_string(step_) + " dropped on every rank: the group of generation " +
                        std::to_string(gen_) + " failed (" + env_.failure_text(pg_) + ")");
    ++step_;
    // An apply that throws (a collective inside it failed, say) leaves this rank's state torn
    // between two steps: it is no source of the state from now on (a newcomer's standing),
    // unless a replicated sharded wrapper says that its shards hold the step whole (its
    // all-gather failed after every shard was stepped; the next wrapper rebuilds the
    // parameters from the shards).
    if (apply) try {
        apply();
      } catch (...) {
        if (!pg_.shards_whole()) holds_ = detail::elastic::holds_nothing;
        throw;
      }
    if (d == "grow" && !reform(pg_.rank(), "grow"))
      detail::raise(errc::aborted, opts_.rank, "elastic: the job finished while this rank re-formed");
  }

  /// After a step failed (call it in the handler that caught `e`): when `e` is a failure of the
  /// group (peer_lost, timeout, aborted), drops the step in flight on every survivor and
  /// re-forms without the lost ranks (and with any newcomer waiting); otherwise, or when fewer
  /// than the minimum remain, rethrows. The step count stays where the last committed step
  /// left it. Returns false when the job finished meanwhile without this rank (it was frozen
  /// or cut off while the others went on): the process should then end normally.
  bool recover(const std::exception& e) {
    const auto* de = dynamic_cast<const error*>(&e);
    if (de == nullptr || !group_lost(de->condition()) || !env_.exists(pg_))
      std::rethrow_exception(std::current_exception());
    const int old_rank = pg_.rank();
    // Wake every peer still blocked on this rank, say whom this rank's heartbeat found dead (the
    // next round need not wait for it), and drop the step in flight for all.
    env_.fail_all(pg_, de->condition(), detail::message_of(e), true);
    const auto until = env_.now() + opts_.timeout;
    const int current = current_gen(until);
    if (detail::elastic::stale(gen_, current)) {
      // Frozen (or cut off) while the group re-formed without it: its generation's keys may be
      // swept, and its state is behind. It comes back as a newcomer of the group as it is now.
      env_.leave_heartbeat(pg_);
      if (eo_.verbose)
        std::fprintf(stderr,
                     "[ddp.elastic] rank %d of generation %d: generation %d formed without it; it joins "
                     "again as a newcomer\n",
                     old_rank, gen_, current);
      round_ = current + 1;
      prev_size_ = 0;
      return form(joiner_prio, /*member=*/false, opts_.timeout,
                  "a rank of generation " + std::to_string(gen_) + " came back");
    }
    note_dead(gen_);
    (void)coord_->compare_set(detail::keys::decision(detail::keys::step(gen_, step_)), "", "abort", until);
    ++failures_;
    return reform(old_rank, detail::message_of(e));
  }

  /// Says that the job is done: a newcomer that arrives later leaves (start() returns false).
  void finish() {
    try {
      coord_->set(detail::keys::done, "1", env_.now() + opts_.timeout);
    } catch (const error&) {
    }
  }

 private:
  static constexpr std::int64_t joiner_prio = detail::elastic::newcomer_place;

  /// A newcomer's signature against the group's: errc::mismatch naming where they part.
  void check_signature(deadline_t until) {
    if (!coord_->check(detail::keys::signature, until)) return;
    const auto theirs = coord_->get(detail::keys::signature, until);
    if (theirs == signature_) return;
    std::size_t at = 0;
    while (at < theirs.size() && at < signature_.size() && theirs[at] == signature_[at]) ++at;
    const auto from = at < 24 ? 0 : at - 24;
    detail::raise(errc::mismatch, opts_.rank,
                  "elastic: this process does not match the running group, which it would have joined: the group's "
                  "signature reads '..." +
                      theirs.substr(from, 80) + "', this process's '..." + signature_.substr(from, 80) +
                      "' (from byte " + std::to_string(at) + " on)");
  }

  /// Failures of the group as a whole (a rank lost, silent, or the group aborted), after which
  /// the next round forms: anything else is the program's or a newcomer's own error.
  static bool group_lost(errc c) { return detail::is_group_verdict(c); }

  /// Leaves the current generation and forms the next with `prio` (this rank's place). False
  /// when the job finished meanwhile.
  bool reform(int prio, const std::string& why) {
    env_.leave_heartbeat(pg_);
    prev_size_ = pg_.size();
    prev_gen_ = gen_;
    round_ = gen_ + 1;
    return form(prio, /*member=*/true, opts_.timeout, why);
  }

  /// Marks this generation live (its first committed step), never over a later one: a rank that
  /// stopped before its generation's first decision and thawed after a later generation went
  /// live finds its step dropped instead.
  void say_live(bool sharded, deadline_t until) {
    auto& st = *coord_;
    const auto mine = detail::elastic::encode(detail::elastic::live_mark{gen_, step_ + 1, sharded});
    for (;;) {
      const auto now_live = st.try_get(detail::keys::live, std::chrono::milliseconds(0), until);
      const auto mark = now_live ? detail::elastic::decode_live(*now_live) : std::nullopt;
      if (mark && mark->gen > gen_)
        detail::raise(errc::aborted, pg_.rank(),
                      "elastic: step " + std::to_string(step_) + " dropped: generation " + std::to_string(mark->gen) +
                          " went live while this rank of generation " + std::to_string(gen_) + " was stopped");
      if (st.compare_set(detail::keys::live, now_live.value_or(""), mine, until) == mine) return;
    }
  }

  /// Registers in round `round_` and waits for it to close; then joins its group. A member of
  /// the last generation (or of the first) may close the round; a newcomer waits for the
  /// members to take it in. A round that fails to form (a rank lost during it) is followed by
  /// the next. Returns false when the job is done.
  bool form(std::int64_t prio, bool member, std::chrono::milliseconds wait_for, std::string why) {
    namespace rules = detail::elastic;
    auto& st = *coord_;
    const auto t0 = env_.now();
    auto until = t0 + std::max(wait_for, opts_.timeout);
    std::string progress;  // a newcomer waits for as long as the job commits steps
    auto seen_progress = env_.now();
    // It holds old state, or none, from now on: a newcomer, whose patience starts now.
    const auto become_newcomer = [&] {
      if (member) seen_progress = env_.now();
      member = false;
      prio = joiner_prio;
    };
    for (;;) {
      if (env_.now() >= until)
        detail::raise(errc::timeout, opts_.rank,
                      "elastic: no generation formed within " +
                          std::to_string(std::max(wait_for, opts_.timeout).count()) + " ms (round " +
                          std::to_string(round_) + ")");
      // A round that formed without this process (it was frozen, or came late): it holds old
      // state, or none, and registers as a newcomer of the round after the newest generation.
      if (const int current = current_gen(until); current >= round_) {
        round_ = current + 1;
        become_newcomer();
      }
      const std::string rk = detail::keys::round(round_);
      const auto idx = st.add(detail::keys::arrivals(rk), 1, until);
      rules::registrant me{.idx = idx, .place = prio, .uid = uid_, .holds = holds_, .step = step_};
      st.set(detail::keys::member(rk, idx), rules::encode(me), until);
      if (member && prio < prev_size_) st.set(detail::keys::old_member(rk, prio), "1", until);
      const auto opened = env_.now();
      // Each round a rank may close gets the whole timeout: its decision (lost, when no source
      // came) is due by then, before this loop's own deadline.
      // A newcomer's requests outlive its seat decision's timeout (idle for a whole timeout).
      until = std::max(until, (member ? opened : seen_progress) + std::max(wait_for, opts_.timeout) +
                                  4 * detail::timing::elastic_poll);
      std::optional<rules::round_decision> closed;
      rules::round_view view;
      view.round = round_;
      view.prev_size = prev_size_;
      // A member looks at the round at once after it registered, before it waits: the last of
      // the members to come closes the round then, without a poll's wait.
      auto wait_closed = member ? std::chrono::milliseconds(0) : detail::timing::elastic_poll;
      for (;;) {
        // A newcomer's wait ends by its seat decision below (a timeout there says why).
        if (member && env_.now() + detail::timing::elastic_poll >= until)
          detail::raise(errc::timeout, opts_.rank, "elastic: round " + std::to_string(round_) + " never closed");
        const auto waited = std::exchange(wait_closed, detail::timing::elastic_poll);
        if (st.wait({detail::keys::closed(rk)}, waited, until).empty()) {
          const auto text = st.get(detail::keys::closed(rk), until);
          closed = rules::decode_round(text);
          if (!closed)
            detail::raise(
                errc::protocol, opts_.rank,
                "elastic: round " + std::to_string(round_) + " closed with a malformed record '" + text + "'");
          break;
        }
        if (!member) {  // newcomers never close a round: they wait for the group to take them in
          rules::seat_view sv;
          sv.round = round_;
          sv.done = st.check(detail::keys::done, until);
          std::string now_at;
          if (!sv.done) {
            // Progress: a step committed, or a generation formed (a group re-forming is alive).
            if (st.check(detail::keys::progress, until)) now_at = st.get(detail::keys::progress, until);
            const int current = current_gen(until);
            now_at += ":" + std::to_string(current);
            sv.progress = now_at != progress;
            if (sv.progress) {
              progress = now_at;
              seen_progress = env_.now();
              until = env_.now() + std::max(wait_for, opts_.timeout) + 4 * detail::timing::elastic_poll;
              sv.current = current;
              sv.round_closed = st.check(detail::keys::closed(rk), until);
            }
          }
          sv.idle = std::chrono::duration_cast<std::chrono::milliseconds>(env_.now() - seen_progress);
          if (sv.idle >= std::max(wait_for, opts_.timeout))
            if (const auto live = st.try_get(detail::keys::live, std::chrono::milliseconds(0), until))
              if (const auto m = rules::decode_live(*live)) sv.live = *m;
          const auto seat = rules::decide_seat(sv, std::max(wait_for, opts_.timeout));
          if (seat.what == rules::seat_decision::leave) return false;
          if (seat.what == rules::seat_decision::timeout)
            detail::raise(errc::timeout, opts_.rank, "elastic: this newcomer " + seat.why);
          if (seat.what == rules::seat_decision::move) {
            round_ = seat.round;
            break;  // closed stays empty: the next round
          }
          continue;
        }
        if (st.check(detail::keys::done, until)) return false;
        gather(view, rk, until);
        view.open_for = std::chrono::duration_cast<std::chrono::milliseconds>(env_.now() - opened);
        const auto d = rules::decide_round(view, round_rules(wait_for));
        if (d.what == rules::round_decision::wait) continue;
        const auto text = st.compare_set(detail::keys::closed(rk), "", rules::encode(d), until);
        closed = rules::decode_round(text);
        if (!closed)
          detail::raise(errc::protocol, opts_.rank,
                        "elastic: round " + std::to_string(round_) + " closed with a malformed record '" + text + "'");
        break;
      }
      if (!closed) continue;
      if (closed->what == rules::round_decision::lost)
        detail::raise(errc::aborted, opts_.rank, "elastic: " + closed->why);
      const auto at = std::find(closed->members.begin(), closed->members.end(), idx);
      if (at == closed->members.end()) {
        // Not taken in (it came after the round closed): a newcomer of the next one.
        ++round_;
        become_newcomer();
        continue;
      }
      const int new_rank = static_cast<int>(at - closed->members.begin());
      const int world = static_cast<int>(closed->members.size());
      if (world < opts_.elastic_min)
        detail::raise(errc::aborted, opts_.rank,
                      "elastic: the group fell to " + std::to_string(world) + " ranks, below its minimum of " +
                          std::to_string(opts_.elastic_min) + " (" + why + ")");
      try {
        join(new_rank, world, why, closed->equal_state);
        return true;
      } catch (const error& e) {
        // A rank lost while the generation formed: the next round, with the ones still here.
        // A newcomer that does not match the group (its wrappers' construction raised
        // errc::mismatch on every rank, naming what differs) leaves with that error, and the
        // members form the next round without it. What each process holds is unchanged: a
        // newcomer that took part holds nothing still (its state transfer did not finish).
        if (!group_lost(e.condition()) && (e.condition() != errc::mismatch || !proven_)) throw;
        env_.fail_all(pg_, e.condition(), detail::message_of(e), false);
        if (gen_ == round_) note_dead(round_);
        env_.leave_heartbeat(pg_);
        prev_size_ = world;
        prev_gen_ = round_;
        prio = new_rank;
        member = true;
        ++round_;
        why = detail::message_of(e);  // the next formation's own cause
        // The formation failed by a loss, not for lack of time: the next round gets its own
        // (a first generation that waited its whole first_wait for a missing rank, then lost
        // one while joining, must still form without it).
        until = std::max(until, env_.now() + std::max(wait_for, opts_.timeout));
      }
    }
  }

  /// The newest generation that formed (el/gen), -1 when none has.
  int current_gen(deadline_t until) {
    const auto g = coord_->try_get(detail::keys::generation, std::chrono::milliseconds(0), until);
    return g && !g->empty() ? static_cast<int>(detail::keys::int_of(*g, opts_.rank, detail::keys::generation)) : -1;
  }

  detail::elastic::round_rules round_rules(std::chrono::milliseconds wait_for) const {
    return {.min = opts_.elastic_min,
            .max = opts_.elastic_max,
            .settle = eo_.settle,
            .first = wait_for,
            .timeout = std::max(wait_for, opts_.timeout)};
  }

  /// Reads round `rk` into `v`: the registrations so far (each read once: they never change),
  /// which ranks of the last generation are back or found dead, and the live generation.
  void gather(detail::elastic::round_view& v, const std::string& rk, deadline_t until) {
    namespace rules = detail::elastic;
    auto& st = *coord_;
    // Who is back is read before the registrations: a rank writes its registration before its
    // "old/<rank>" mark, so every rank seen back here is among the registrations read below,
    // and a round never closes as "every rank back" without one of them.
    gather_back(v, rk, until);
    const auto n = st.add(detail::keys::arrivals(rk), 0, until);
    std::vector<bool> read(static_cast<std::size_t>(std::max<std::int64_t>(n, 0)) + 1, false);
    for (const auto& r : v.registered)
      if (r.idx >= 1 && r.idx <= n) read[static_cast<std::size_t>(r.idx)] = true;
    for (std::int64_t i = 1; i <= n; ++i) {
      if (read[static_cast<std::size_t>(i)]) continue;
      // A process that died (or stopped) between its count and its record leaves a hole: it is
      // passed over, never the registrations after it (a rank holding the state among them).
      // One that writes its record after the round closed is a late registrant, as any other.
      const auto rec = st.try_get(detail::keys::member(rk, i), std::chrono::milliseconds(0), until);
      if (!rec) continue;
      auto r = rules::decode_registrant(i, *rec);
      if (!r) detail::raise(errc::protocol, opts_.rank, "elastic: a malformed registration '" + *rec + "' in " + rk);
      v.registered.push_back(std::move(*r));
    }
  }
  /// Which ranks of the last generation are back in round `rk` or were found dead, and the
  /// live generation (gather's first part).
  void gather_back(detail::elastic::round_view& v, const std::string& rk, deadline_t until) {
    namespace rules = detail::elastic;
    auto& st = *coord_;
    v.back.assign(static_cast<std::size_t>(prev_size_), false);
    v.dead.assign(static_cast<std::size_t>(prev_size_), false);
    std::vector<std::string> keys;
    for (int q = 0; q < prev_size_; ++q) keys.push_back(detail::keys::old_member(rk, q));
    for (int q = 0; q < prev_size_; ++q) keys.push_back(detail::keys::dead(prev_gen_, q));
    std::vector<bool> missing(keys.size(), false);
    if (!keys.empty())
      for (const auto& k : st.wait(keys, std::chrono::milliseconds(0), until))
        missing[static_cast<std::size_t>(std::find(keys.begin(), keys.end(), k) - keys.begin())] = true;
    for (int q = 0; q < prev_size_; ++q) {
      v.back[static_cast<std::size_t>(q)] = !missing[static_cast<std::size_t>(q)];
      v.dead[static_cast<std::size_t>(q)] = !missing[static_cast<std::size_t>(prev_size_ + q)];
    }
    v.live = {};
    if (const auto live = st.try_get(detail::keys::live, std::chrono::milliseconds(0), until)) {
      const auto m = rules::decode_live(*live);
      if (!m) detail::raise(errc::protocol, opts_.rank, "elastic: a malformed live mark '" + *live + "'");
      v.live = *m;
    }
    if (const auto at = st.try_get(detail::keys::progress, std::chrono::milliseconds(0), until))
      v.live.step = std::max<std::uint64_t>(
          v.live.step, static_cast<std::uint64_t>(detail::keys::int_of(*at, opts_.rank, detail::keys::progress)));
  }

  /// Writes el<g>/hb/dead/<rank> for the rank this rank's heartbeat found frozen or dead in
  /// generation `g` (the current group), if it found one and the group's courier has not said so
  /// already (its write, within the heartbeat's lease, may have failed: then this one, within
  /// the timeout, says it).
  void note_dead(int g) {
    const int dead = env_.found_dead(pg_);
    if (dead >= 0 && marked_dead_.load() != dead_mark(g, dead)) mark_dead(g, dead, opts_.timeout);
  }
  void mark_dead(int g, int dead, std::chrono::milliseconds budget) {
    coord_->set(detail::keys::dead(g, dead), "1", env_.now() + budget);
    marked_dead_.store(dead_mark(g, dead));
  }
  static std::int64_t dead_mark(int g, int dead) { return static_cast<std::int64_t>(g) << 32 | dead; }
  /// Joins generation round_ as `rank` of `world`, rebuilds the program's wrappers, hands out
  /// rank 0's state. `equal_state`: every member holds the live state as of one step (the
  /// round's decision), which the group tells the wrappers built on it
  /// (process_group::expects_equal_state).
  void join(int rank, int world, const std::string& why, bool equal_state) {
    init_options o = opts_;
    o.rank = rank;
    o.world_size = world;
    o.local_rank = -1;
    o.key_prefix = detail::keys::generation_keys(round_);
    o.external_store = true;  // the store outlives every generation
    o.job_id = job_ + "+el." + std::to_string(round_);
    o.rendezvous_timeout = eo_.reform_timeout;
    env_.close(pg_);
    pg_ = env_.form(o, equal_state);
    gen_ = round_;
    // The rank this generation's heartbeat finds dead is said in the store at once, from the
    // group's courier thread, so that the next round need not wait for this rank's recover().
    env_.on_found_dead(pg_, [this, g = gen_](int dead) { mark_dead(g, dead, opts_.heartbeat); });
    if (env_.found_dead(pg_) >= 0) note_dead(gen_);
    coord_->set(detail::keys::generation, detail::keys::int_value(gen_), env_.now() + opts_.timeout);
    if (!signature_.empty() && gen_ == 0 && rank == 0)
      coord_->set(detail::keys::signature, signature_, env_.now() + opts_.timeout);
    if (rank == 0 && eo_.verbose)
      std::fprintf(stderr, "[ddp.elastic] generation %d: %d ranks (%s)%s\n", gen_, world, why.c_str(),
                   equal_state ? "; every rank holds the state of the same step" : "");
    if (on_form_) on_form_(pg_);
    // What the last generation's transports left for this one and nobody took (detail/parked.hpp).
    // A sharded wrapper's shards must be taken: one dropped means the program built the new
    // wrapper before it destroyed the old, which would start every shard's state afresh.
    if (const auto untaken = env_.drop_parked(); !untaken.empty()) detail::raise(errc::usage, rank, untaken);
    proven_ = true;  // this process's wrappers matched a generation's
    // Rank 0's counts (steps, failures, the sizes so far) and the program's state reach every
    // rank.
    sizes_.push_back(world);
    std::string blob;
    if (rank == 0) {
      blob = detail::encode_i64(static_cast<std::int64_t>(step_)) + detail::encode_i64(failures_) +
             detail::encode_i64(static_cast<std::int64_t>(sizes_.size()));
      for (int s : sizes_) blob += detail::encode_i64(s);
      if (save_) blob += save_();
    }
    detail::broadcast_blob([&](std::span<std::byte> b) { pg_.broadcast(b, 0); }, blob, rank, 0, 24, max_state_bytes,
                           "elastic: the group's counts and the program's state (on_state's save)");
    const std::string_view b(blob);
    const auto at = [&](std::size_t i) {
      if (b.size() < 8 * (i + 1)) detail::raise(errc::protocol, rank, "elastic: rank 0's state is truncated");
      return detail::decode_i64(b.substr(8 * i, 8));
    };
    if (const auto got = static_cast<std::uint64_t>(at(0)); got < step_)
      detail::raise(errc::protocol, rank,
                    "elastic: generation " + std::to_string(gen_) + "'s rank 0 holds the state of step " +
                        std::to_string(got) + ", behind this rank's " + std::to_string(step_) +
                        ": the committed step would go backwards");
    step_ = static_cast<std::uint64_t>(at(0));
    failures_ = static_cast<int>(at(1));
    const auto nsizes = static_cast<std::size_t>(at(2));
    if (nsizes > b.size() / 8) detail::raise(errc::protocol, rank, "elastic: rank 0's state is malformed");
    sizes_.clear();
    for (std::size_t i = 0; i < nsizes; ++i) sizes_.push_back(static_cast<int>(at(3 + i)));
    if (rank != 0 && load_) load_(b.substr(8 * (3 + nsizes)));
    holds_ = gen_;
    live_said_ = false;
    if (rank == 0) sweep();
  }

  /// Erases the keys of generations two or more behind this one (their rendezvous, heartbeat
  /// and mesh keys, their round's registrations), so that the store holds at most three
  /// generations however often the group re-forms. The last one stays for a rank of it that
  /// wakes late; the one before, for a newcomer that read it as current. A generation's step
  /// decisions stay until a later generation commits a step (el/live): a rank frozen while its
  /// step was decided reads that decision when it thaws, whatever formed since, so that it
  /// never holds the live state one step behind. Best effort: a store that fails here fails the
  /// next step too.
  void sweep() {
    auto& st = *coord_;
    const auto until = env_.now() + opts_.timeout;
    try {
      int from = 0, steps_from = 0;
      if (st.check(detail::keys::swept, until))
        from = static_cast<int>(
                   detail::keys::int_of(st.get(detail::keys::swept, until), opts_.rank, detail::keys::swept)) +
               1;
      if (st.check(detail::keys::swept_steps, until))
        steps_from = static_cast<int>(detail::keys::int_of(st.get(detail::keys::swept_steps, until), opts_.rank,
                                                           detail::keys::swept_steps)) +
                     1;
      for (int g = from; g <= gen_ - 2; ++g) {
        (void)st.erase_prefix(detail::keys::generation_keys(g), until);
        (void)st.erase_prefix(detail::keys::round(g), until);
        st.set(detail::keys::swept, detail::keys::int_value(g), until);
      }
      const auto live = st.try_get(detail::keys::live, std::chrono::milliseconds(0), until);
      const auto mark = live ? detail::elastic::decode_live(*live) : std::nullopt;
      const int live_gen = mark ? mark->gen : -1;
      for (int g = steps_from; g < std::min(live_gen, gen_ - 1); ++g) {
        // Said before the keys go: a rank of g that decides a step after it finds the mark.
        st.set(detail::keys::swept_steps, detail::keys::int_value(g), until);
        (void)st.erase_prefix(detail::keys::steps(g), until);
      }
    } catch (const std::exception&) {
    }
  }

  init_options opts_;
  elastic_options eo_;
  Env env_;
  std::string job_;
  std::string uid_;
  std::string signature_;
  std::unique_ptr<typename Env::store> coord_;
  group_type pg_ = Env::no_group();
  std::atomic<std::int64_t> marked_dead_{-1};  // the (generation, rank) last said dead in the store (dead_mark)
  std::function<void(group_type&)> on_form_;
  std::function<std::string()> save_;
  std::function<void(std::string_view)> load_;

 public:
  /// The most the group's counts and on_state's state may be, as sent at a formation: a length
  /// a peer announces is checked against it before anything is allocated.
  static constexpr std::size_t max_state_bytes = std::size_t{1} << 30;

 private:
  int gen_ = -1;
  int prev_gen_ = -1;
  int round_ = 0;
  int prev_size_ = 0;
  int failures_ = 0;
  deadline_t progress_noted_{};  // when this rank last wrote el/step
  bool proven_ = false;          // a generation's wrappers were built here (a mismatch since is a newcomer's)
  /// The state this process holds (detail::elastic::holds_*, or the generation it joined): only
  /// a holder of the live generation's state may be a new generation's rank 0.
  int holds_ = detail::elastic::holds_initial;
  bool live_said_ = false;  // this generation's first committed step was said in the store
  std::uint64_t step_ = 0;
  std::vector<int> sizes_;
};

/// The elastic group of real processes (group/detail/elastic_env.hpp).
using elastic_group = basic_elastic_group<detail::elastic_env>;

}  // namespace DDP_ABI
}  // namespace ddp
