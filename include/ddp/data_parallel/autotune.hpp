#pragma once
/// \file data_parallel/autotune.hpp
/// `ddp::bucket_autotuner`: the schedule and the choice of the bucket-cap autotune
/// (`bucket_policy::autotune`), as pure logic: which cap each tuning step runs with, what a step
/// records, and which cap wins. `basic_data_parallel` feeds it one figure per synchronized step
/// (the slowest rank's, so every rank feeds the same numbers) and re-plans when it says so.
/// See docs/tuning.md, "Autotune".

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/data_parallel/options.hpp>
#include <ddp/error.hpp>
#include <ddp/planner/bucket_plan.hpp>
#include <ddp/planner/planner_concept.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// The candidates tried when `bucket_policy::autotune_caps` is empty: 1, 2, 4, 8, 16, 25, 50
/// and 100 MiB (PyTorch DDP's default, 25 MiB, among them).
inline std::vector<std::size_t> default_autotune_caps() {
  std::vector<std::size_t> caps;
  for (std::size_t mib : {1, 2, 4, 8, 16, 25, 50, 100}) caps.push_back(mib << 20);
  return caps;
}

/// The candidates as the tuner takes them: `caps` (empty: `default_autotune_caps()`) sorted, each
/// once. Lists that differ only in order or repetition are the same candidates.
inline std::vector<std::size_t> normalized_autotune_caps(std::vector<std::size_t> caps) {
  if (caps.empty()) caps = default_autotune_caps();
  std::sort(caps.begin(), caps.end());
  caps.erase(std::unique(caps.begin(), caps.end()), caps.end());
  return caps;
}

/// "4 MiB", "3 KiB", "1000 B": a size in the largest unit that divides it, so the text is exact.
inline std::string exact_size(std::size_t b) {
  if (b != 0 && b % (std::size_t{1} << 20) == 0) return std::to_string(b >> 20) + " MiB";
  if (b != 0 && b % 1024 == 0) return std::to_string(b >> 10) + " KiB";
  return std::to_string(b) + " B";
}

/// The autotune settings of `p` as ranks compare them, normalised as the tuner uses them:
/// "autotune_caps [1 MiB, 4 MiB], autotune_steps 2, autotune_rounds 1".
inline std::string autotune_settings(const bucket_policy& p) {
  std::string s = "autotune_caps [";
  const auto caps = normalized_autotune_caps(p.autotune_caps);
  for (std::size_t k = 0; k < caps.size(); ++k) s += (k ? ", " : "") + exact_size(caps[k]);
  return s + "], autotune_steps " + std::to_string(p.autotune_steps) + ", autotune_rounds " +
         std::to_string(p.autotune_rounds);
}

/// `base` with its cap set to `cap`: `cap_bytes = cap`, the first bucket's cap kept unless it
/// is larger than `cap` (so a candidate of 1 MiB is 1 MiB everywhere).
/// \code
/// ddp::bucket_policy p = ddp::with_cap(ddp::bucket_policy{}, 4 << 20);  // 1 MiB first, then 4 MiB
/// \endcode
inline bucket_policy with_cap(bucket_policy base, std::size_t cap) {
  base.cap_bytes = cap;
  base.first_cap_bytes = std::min(base.first_cap_bytes, cap);
  return base;
}

/// The candidates that give distinct plans: `caps` sorted, duplicates removed, and each cap
/// whose plan (for `params` walked in `order`) equals a smaller kept cap's dropped, since
/// measuring it again would only measure noise. The smallest cap is always kept.
/// \code
/// auto caps = ddp::distinct_caps(ddp::size_planner{}, infos, ddp::bucket_policy{}, {}, ddp::default_autotune_caps());
/// \endcode
template <bucket_planner Planner>
std::vector<std::size_t> distinct_caps(const Planner& planner, std::span<const param_info> params,
                                       const bucket_policy& base, std::span<const std::size_t> order,
                                       std::vector<std::size_t> caps) {
  std::sort(caps.begin(), caps.end());
  caps.erase(std::unique(caps.begin(), caps.end()), caps.end());
  std::vector<std::size_t> out;
  std::vector<bucket_plan> seen;
  for (std::size_t c : caps) {
    bucket_plan p = planner.plan(params, with_cap(base, c), order);
    if (std::find(seen.begin(), seen.end(), p) != seen.end()) continue;
    seen.push_back(std::move(p));
    out.push_back(c);
  }
  return out;
}

/// Median of `v` (0 for none): the mean of the two middle values for an even count.
inline double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/// The autotune's state machine. Candidates are tried in ascending order, `rounds` passes over
/// all of them, each visit `skip + steps` synchronized steps: the first `skip` steps after a
/// re-plan are not measured (fresh buffers fault their pages in, caches are cold), the next
/// `steps` are. Spreading a candidate's samples over passes keeps a burst of load on a shared
/// machine from deciding alone. After the last visit, `pick()` names the cap with the lowest
/// median over all its samples; ties go to the smaller cap.
/// The tuning starts at the wrapper's first synchronized step, which runs with the smallest
/// candidate and is not measured either (its end is where the ready order becomes known).
/// \code
/// ddp::bucket_autotuner t({1 << 20, 4 << 20}, 3, 2);
/// t.start({1 << 20, 4 << 20}, {1, 1});          // after the first step: the distinct caps
/// while (!t.measuring_done()) t.record(step_ms());  // re-plan with t.cap() when it returns true
/// t.decide(t.pick());                            // rank 0's pick, broadcast
/// \endcode
class bucket_autotuner {
 public:
  /// The largest `autotune_steps` and `autotune_rounds` accepted.
  static constexpr std::size_t max_steps = 1'000'000, max_rounds = 1'000'000;

  /// `caps`: the candidates (empty: `default_autotune_caps()`); `steps` measured per candidate
  /// and pass, `rounds` passes. Throws errc::invalid_argument when `steps` or `rounds` is 0 or above `max_steps` /
  /// `max_rounds`.
  bucket_autotuner(std::vector<std::size_t> caps, std::size_t steps, std::size_t rounds = 1, std::size_t skip = 1)
      : steps_(steps), rounds_(rounds), skip_(skip) {
    if (steps == 0)
      detail::raise(errc::invalid_argument, -1,
                    "bucket_policy::autotune_steps is 0; the autotune needs at least one measured step per candidate");
    if (rounds == 0)
      detail::raise(errc::invalid_argument, -1,
                    "bucket_policy::autotune_rounds is 0; the autotune needs at least one pass over the candidates");
    // Bounded so that the schedule's counts (skip + steps, rounds x candidates x that) cannot
    // wrap around: a wrapped count would end a candidate with no sample, or the tuning before it
    // began, and the choice would be silently arbitrary.
    if (steps > max_steps)
      detail::raise(errc::invalid_argument, -1,
                    "bucket_policy::autotune_steps is " + std::to_string(steps) + ", more than " +
                        std::to_string(max_steps) + "; a few measured steps per candidate are enough");
    if (rounds > max_rounds)
      detail::raise(errc::invalid_argument, -1,
                    "bucket_policy::autotune_rounds is " + std::to_string(rounds) + ", more than " +
                        std::to_string(max_rounds) + "; a few passes over the candidates are enough");
    caps_ = normalized_autotune_caps(std::move(caps));
    report_.enabled = true;
  }

  /// The cap the wrapper plans with at construction and in the first step: the smallest.
  std::size_t first_cap() const noexcept { return caps_.front(); }

  /// The first synchronized step is over: `distinct` are the candidates to try (from
  /// `distinct_caps`, so it starts with `first_cap()`), `buckets[k]` the bucket count of
  /// candidate k's plan (for the report).
  void start(std::vector<std::size_t> distinct, const std::vector<std::size_t>& buckets) {
    if (distinct.empty()) distinct.push_back(first_cap());
    report_.candidates.clear();
    for (std::size_t k = 0; k < distinct.size(); ++k)
      report_.candidates.push_back({distinct[k], k < buckets.size() ? buckets[k] : 0, {}, 0});
    current_ = 0;
    in_candidate_ = 0;
    started_ = true;
  }
  bool started() const noexcept { return started_; }

  /// The cap the coming step runs with (after `start`, before `decide`).
  std::size_t cap() const noexcept {
    if (report_.done) return report_.chosen_cap_bytes;
    return started_ && !measuring_done() ? report_.candidates[current_ % report_.candidates.size()].cap_bytes
                                         : first_cap();
  }

  /// One synchronized step of the current candidate ended; `slowest_ms` is its figure (the
  /// maximum over the ranks). Returns true when the next step runs with another cap (re-plan
  /// with `cap()`), or when measuring is over (`measuring_done()`, then `decide`).
  bool record(double slowest_ms) {
    if (!started_ || measuring_done()) return false;
    auto& c = report_.candidates[current_ % report_.candidates.size()];
    if (in_candidate_ >= skip_) c.samples_ms.push_back(slowest_ms);
    if (++in_candidate_ < skip_ + steps_) return false;
    c.median_ms = median_of(c.samples_ms);
    ++current_;
    in_candidate_ = 0;
    return true;
  }

  /// Every candidate has its `rounds * steps` measurements.
  bool measuring_done() const noexcept { return started_ && current_ >= rounds_ * report_.candidates.size(); }

  /// The candidate with the lowest median (the smaller cap on a tie); `first_cap()` before any.
  std::size_t pick() const noexcept {
    std::size_t best = first_cap();
    double best_ms = 0;
    bool any = false;
    for (const auto& c : report_.candidates) {
      if (c.samples_ms.empty()) continue;
      if (!any || c.median_ms < best_ms) {
        best = c.cap_bytes;
        best_ms = c.median_ms;
        any = true;
      }
    }
    return best;
  }

  /// Adopts `cap` (rank 0's pick) at step `step`: tuning is over.
  void decide(std::size_t cap, std::uint64_t step) noexcept {
    report_.done = true;
    report_.chosen_cap_bytes = cap;
    report_.decided_at_step = step;
  }
  bool done() const noexcept { return report_.done; }

  /// Synchronized steps from the first one to the decision: 1 + rounds * candidates * (skip + steps).
  std::size_t tuning_steps(std::size_t candidates) const noexcept {
    return 1 + rounds_ * candidates * (skip_ + steps_);
  }

  const autotune_report& report() const noexcept { return report_; }

  /// The block rank 0 logs: one line per candidate, then the choice, each `ddp: autotune: `.
  static std::string describe(const autotune_report& r) {
    const auto mib = [](std::size_t b) {
      char buf[32];
      if (b >= (std::size_t{1} << 20))
        std::snprintf(buf, sizeof buf, "%g MiB", static_cast<double>(b) / (1 << 20));
      else if (b >= 1024)
        std::snprintf(buf, sizeof buf, "%g KiB", static_cast<double>(b) / 1024);
      else
        std::snprintf(buf, sizeof buf, "%zu B", b);
      return std::string(buf);
    };
    std::string out;
    for (const auto& c : r.candidates) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "ddp: autotune: cap %-9s %3zu buckets  median %9.3f ms  [",
                    mib(c.cap_bytes).c_str(), c.buckets, c.median_ms);
      out += buf;
      for (std::size_t k = 0; k < c.samples_ms.size(); ++k) {
        std::snprintf(buf, sizeof buf, "%s%.3f", k ? " " : "", c.samples_ms[k]);
        out += buf;
      }
      out += "]\n";
    }
    out += "ddp: autotune: chose cap " + mib(r.chosen_cap_bytes) + " at step " + std::to_string(r.decided_at_step) +
           " (slowest rank's first grad_ready to finish() return, median per candidate)\n";
    return out;
  }

 private:
  std::vector<std::size_t> caps_;
  std::size_t steps_ = 2, rounds_ = 1, skip_ = 1;
  std::size_t current_ = 0, in_candidate_ = 0;
  bool started_ = false;
  autotune_report report_;
};

}  // namespace DDP_ABI
}  // namespace ddp
