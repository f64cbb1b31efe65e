#pragma once
/// \file data_parallel/agreement.hpp
/// `ddp::agreement`: what the ranks of a `basic_data_parallel` must agree on (the parameters'
/// signatures, the bucket plan's fingerprint, each rank's bucket setup, the order the plan is
/// rebuilt from), over a small channel (`agreement_channel`) instead of a `process_group`, so
/// that it can be tested in one process with a fake. Every encoding the wrapper sends to its
/// peers lives here. See docs/data-parallel.md.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/concepts.hpp>
#include <ddp/detail/bytes.hpp>
#include <ddp/data_parallel/detail/parameters.hpp>
#include <ddp/data_parallel/detail/xxh64.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/parameter.hpp>
#include <ddp/planner/bucket_plan.hpp>
#include <ddp/request.hpp>
#include <ddp/detail/consensus.hpp>
#include <ddp/detail/timing.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// What the agreement needs from a group: this rank, the world size, an all-gather of byte
/// strings and a broadcast of 64-bit words. `basic_data_parallel` fills it from its
/// `process_group`; a test passes functions that play the other ranks.
struct agreement_channel {
  int rank = 0;
  int size = 1;
  /// Every rank's string, indexed by rank (a collective: every rank calls it).
  std::function<std::vector<std::string>(const std::string&)> all_gather;
  /// Copies `root`'s words into every rank's span (a collective).
  std::function<void(std::span<std::uint64_t>, int root)> broadcast;
};

/// One parameter as ranks compare it: dtype, host or device, shape (not the device index, which
/// may differ per rank).
struct parameter_signature {
  std::uint8_t type = 0;
  std::uint8_t on_device = 0;
  std::uint8_t frozen = 0;  ///< buffers: a frozen parameter (`buffer_kind::frozen_parameter`)
  std::vector<std::int64_t> shape;
  friend bool operator==(const parameter_signature&, const parameter_signature&) = default;
};

/// The checks that every rank makes alike; each raises the same error on every rank.
/// \code
/// ddp::agreement agree{{.rank = pg.rank(), .size = pg.size(),
///                       .all_gather = [&](const std::string& s) { return pg.all_gather(s); }}};
/// agree.check_signatures(views);  // errc::mismatch naming the first differing parameter
/// \endcode
class agreement {
 public:
  explicit agreement(agreement_channel channel) : ch_(std::move(channel)) {}

  int rank() const noexcept { return ch_.rank; }
  int size() const noexcept { return ch_.size; }

  // ---- the wire encodings (little-endian 64-bit words) ------------------------------------

  /// Parameter count, then per parameter: dtype | on-device << 8 | frozen << 9, rank of the
  /// shape, the shape. The same for buffers (`buffer_view`).
  template <class View>
  static std::string encode_signatures(std::span<const View> views) {
    std::string s;
    detail::byte_writer w(s);
    w.u64(views.size());
    for (const auto& v : views) {
      std::uint64_t td = static_cast<std::uint64_t>(v.type) | (v.device >= 0 ? 0x100u : 0u);
      if constexpr (std::is_same_v<View, buffer_view>)
        if (v.kind == buffer_kind::frozen_parameter) td |= 0x200u;
      w.u64(td).u64(v.shape.size());
      for (auto d : v.shape) w.i64(d);
    }
    return s;
  }
  static std::string encode_signatures(std::span<const tensor_view> views) {
    return encode_signatures<tensor_view>(views);
  }

  /// The inverse of `encode_signatures`; errc::protocol for a truncated or malformed record
  /// (counts are bounded by the bytes left, so a lying count allocates nothing).
  static std::vector<parameter_signature> decode_signatures(const std::string& s) {
    detail::byte_reader r(s);
    const std::uint64_t n = r.u64();
    if (n > r.remaining() / 16) r.fail();
    std::vector<parameter_signature> out(r.ok() ? n : 0);
    for (auto& sig : out) {
      const std::uint64_t td = r.u64();
      sig.type = static_cast<std::uint8_t>(td & 0xff);
      sig.on_device = static_cast<std::uint8_t>((td >> 8) & 1);
      sig.frozen = static_cast<std::uint8_t>((td >> 9) & 1);
      const std::uint64_t nd = r.u64();
      if (nd > r.remaining() / 8) r.fail();
      if (!r.ok()) break;
      for (std::uint64_t k = 0; k < nd; ++k) sig.shape.push_back(r.i64());
    }
    if (!r.done()) detail::raise(errc::protocol, -1, "malformed parameter signature");
    return out;
  }

  /// "f32[4, 6]", "f16@device[8]".
  static std::string describe(const parameter_signature& s) {
    std::string d = dtype_name(static_cast<dtype>(s.type));
    d += s.on_device ? "@device[" : "[";
    for (std::size_t k = 0; k < s.shape.size(); ++k) d += (k ? ", " : "") + std::to_string(s.shape[k]);
    return d + (s.frozen ? "] (frozen parameter)" : "]");
  }

  /// The plan's fingerprint, then whether the layout is settled (1) or will be rebuilt (0).
  static std::string encode_plan(const bucket_plan& plan, bool settled) {
    std::string s;
    detail::byte_writer(s).u64(plan.fingerprint()).u64(settled ? 1 : 0);
    return s;
  }

  /// A rank's bucket setup: empty when it went well, else "<errc> <text>".
  // ---- the checks ---------------------------------------------------------------------------

  /// Every rank has the same parameters (count, dtypes, shapes, host or device). Otherwise
  /// errc::mismatch on every rank, naming the first differing parameter and the ranks that
  /// differ (or the counts).
  void check_signatures(std::span<const tensor_view> views) const { check_signatures_of(views, "parameter"); }

  /// The same for the buffers and frozen parameters (`buffer_view`): count, kinds, dtypes, shapes.
  void check_buffer_signatures(std::span<const buffer_view> buffers) const { check_signatures_of(buffers, "buffer"); }

  /// Every rank passes the same `value` for the option `what` (a collective); otherwise
  /// errc::mismatch on every rank, naming the option, rank 0's value and the ranks that differ.
  void check_same(const char* what, std::uint64_t value) const {
    if (ch_.size == 1) return;
    std::string mine;
    detail::byte_writer(mine).u64(value);
    detail::agree([this](const std::string& s) { return ch_.all_gather(s); }, ch_.rank, mine,
                  [&](const auto& all, const auto& differing) {
                    const auto number = [&](std::size_t r) {
                      return std::to_string(detail::byte_reader(all[r]).u64());
                    };
                    std::string msg = std::string("ranks disagree on ") + what + ": rank 0 has " + number(0);
                    for (const auto r : differing) msg += ", rank " + std::to_string(r) + " has " + number(r);
                    return msg;
                  });
  }

  /// Every rank passes the same `value`, a setting written out as text (a collective; compare
  /// normalised values, so that settings that mean the same agree); otherwise errc::mismatch on
  /// every rank, naming `what` and showing rank 0's value and each differing one with its ranks.
  /// \code
  /// agree.check_same_text("bucket_policy::autotune settings", ddp::autotune_settings(policy));
  /// \endcode
  void check_same_text(const char* what, const std::string& value) const {
    if (ch_.size == 1) return;
    detail::agree([this](const std::string& s) { return ch_.all_gather(s); }, ch_.rank, value,
                  [&](const auto& all, const auto& differing) { return disagreement_text(what, all, differing); });
  }

  /// "ranks disagree on <what>: rank 0 has <v>; ranks 1, 3 have <w>; ..." for values that are text.
  static std::string disagreement_text(const char* what, const std::vector<std::string>& all,
                                       const std::vector<std::size_t>& differing) {
    // The differing values in order of first appearance, each with its ranks.
    std::vector<std::pair<std::string, std::vector<std::size_t>>> others;
    for (const auto r : differing) {
      auto it = std::find_if(others.begin(), others.end(), [&](const auto& o) { return o.first == all[r]; });
      if (it == others.end()) it = others.insert(others.end(), {all[r], {}});
      it->second.push_back(r);
    }
    constexpr std::size_t shown = 4, ranks_shown = 8;
    std::string msg = std::string("ranks disagree on ") + what + ": rank 0 has " + all[0];
    for (std::size_t k = 0; k < others.size() && k < shown; ++k) {
      const auto& ranks = others[k].second;
      msg += ranks.size() > 1 ? "; ranks " : "; rank ";
      for (std::size_t i = 0; i < ranks.size() && i < ranks_shown; ++i)
        msg += (i ? ", " : "") + std::to_string(ranks[i]);
      if (ranks.size() > ranks_shown) msg += " and " + std::to_string(ranks.size() - ranks_shown) + " more";
      msg += (ranks.size() > 1 ? " have " : " has ") + others[k].first;
    }
    if (others.size() > shown) msg += "; and " + std::to_string(others.size() - shown) + " more values";
    return msg;
  }

  /// Ranks agree on the plan and on whether it will be rebuilt (a collective of the group that
  /// a rank skipping it would leave its peers waiting on); `when` says at which point.
  void check_plan(const bucket_plan& plan, bool settled, const char* when) const {
    const auto all = ch_.all_gather(encode_plan(plan, settled));
    std::string plans, rebuilds;
    for (std::size_t r = 1; r < all.size(); ++r) {
      if (all[r].compare(0, 8, all[0], 0, 8) != 0)
        plans += (plans.empty() ? "rank " : ", rank ") + std::to_string(r);
      else if (all[r] != all[0])
        rebuilds += (rebuilds.empty() ? "rank " : ", rank ") + std::to_string(r);
    }
    if (!plans.empty())
      detail::raise(errc::mismatch, ch_.rank,
                    std::string("bucket plans differ ") + when + " between rank 0 and " + plans +
                        " (different bucket_policy or planner on those ranks?)");
    if (!rebuilds.empty()) {
      const bool rank0_rebuilds = all[0][8] == 0;
      detail::raise(errc::mismatch, ch_.rank,
                    std::string("ranks disagree ") + when +
                        " on rebuilding the bucket plan after the first step: rank 0 " +
                        (rank0_rebuilds ? "does, " : "does not, ") + rebuilds + (rank0_rebuilds ? " do not" : " do") +
                        " (bucket_policy::rebuild_from_ready_order or dp_options::gradient_as_bucket_view differ)");
    }
  }

  /// Tells every rank whether every other rank set up its buckets. `mine` is this rank's own
  /// failure (rethrown as it was raised); otherwise a failed peer is raised with its errc,
  /// naming it, so that nobody learns of it only at the first step.
  void share_setup(const std::exception_ptr& mine) const {
    if (ch_.size == 1) {
      if (mine) std::rethrow_exception(mine);
      return;
    }
    const auto failed = detail::first_failed(ch_.all_gather, detail::failure_of(mine, ch_.rank));
    if (mine) std::rethrow_exception(mine);  // this rank's own cause, as it was raised
    if (failed.rank >= 0)
      detail::raise(
          failed.what.code, ch_.rank,
          "rank " + std::to_string(failed.rank) + " could not set up its gradient buckets: " + failed.what.text);
  }

  /// The rebuild from the observed ready order: rank 0's `order` (every parameter once) is
  /// broadcast and every rank re-plans with it. The caller checks the new plan with
  /// `check_plan(..., "after the rebuild")` once its buckets are in place.
  /// `agreed`, when given, receives rank 0's order (the bucket-cap autotune re-plans with it).
  template <bucket_planner Planner>
  bucket_plan rebuilt_plan(const Planner& planner, std::span<const param_info> infos, const bucket_policy& policy,
                           std::span<const std::size_t> order, std::vector<std::size_t>* agreed = nullptr) const {
    std::vector<std::uint64_t> words(order.begin(), order.end());
    ch_.broadcast(std::span<std::uint64_t>(words), 0);
    std::vector<std::size_t> walk(words.begin(), words.end());
    if (agreed) *agreed = walk;
    return planner.plan(infos, policy, walk);
  }

  /// Rank 0's `value` on every rank (a collective): a choice rank 0 makes for all, such as the
  /// bucket cap the autotune picks.
  std::uint64_t rank0_value(std::uint64_t value) const {
    if (ch_.size == 1) return value;
    ch_.broadcast(std::span<std::uint64_t>(&value, 1), 0);
    return value;
  }

  /// Adds the bytes of every view's values, in order, to `h` (XXH64): what ranks compare to
  /// learn whether they already hold the same values. Host memory only: returns false, having
  /// hashed nothing, when a view lives on a device.
  template <class View>
  static bool hash_values(detail::xxh64& h, std::span<const View> views) {
    for (const auto& v : views)
      if (v.device >= 0) return false;
    for (const auto& v : views)
      if (v.numel > 0) h.update(v.data, v.bytes());
    return true;
  }

  /// The ranks whose `hash` differs from rank 0's, ascending (a collective; empty when every
  /// rank has rank 0's).
  std::vector<int> ranks_differing(std::uint64_t hash) const {
    if (ch_.size == 1) return {};
    std::string mine;
    detail::byte_writer(mine).u64(hash);
    const auto all = ch_.all_gather(mine);
    std::vector<int> out;
    for (std::size_t r = 1; r < all.size(); ++r)
      if (all[r] != all[0]) out.push_back(static_cast<int>(r));
    return out;
  }

  /// Copies rank 0's parameter (or buffer) values to every rank through `red` (a collective), so
  /// that training starts from one model even when ranks initialized differently.
  /// `root`: the rank whose values win (rank 0 at construction).
  template <reducer Reducer, class View>
  static void broadcast_values(Reducer& red, std::span<const View> views, std::chrono::milliseconds timeout,
                               int root = 0) {
    std::vector<request> reqs;
    reqs.reserve(views.size());
    for (const auto& v : views)
      if (v.numel > 0) reqs.push_back(red.broadcast_async(v.data, v.numel, v.type, root));
    const auto until = detail::timing::collective_deadline(timeout);
    for (auto& r : reqs) r.wait(until);
  }

 private:
  template <class View>
  void check_signatures_of(std::span<const View> views, const char* noun) const {
    const auto all = ch_.all_gather(encode_signatures<View>(views));
    if (std::all_of(all.begin(), all.end(), [&](const std::string& s) { return s == all[0]; })) return;
    std::vector<std::vector<parameter_signature>> sigs;
    for (const auto& s : all) sigs.push_back(decode_signatures(s));
    std::size_t common = sigs[0].size();
    for (const auto& s : sigs) common = std::min(common, s.size());
    const auto label = [&](std::size_t i) {
      return detail::parameter_label(i, i < views.size() ? views[i].name : std::string_view{}, noun);
    };
    const auto index_of = [](std::size_t i) { return std::is_same_v<View, tensor_view> ? static_cast<int>(i) : -1; };
    for (std::size_t i = 0; i < common; ++i) {
      std::string differing;
      for (std::size_t r = 1; r < sigs.size(); ++r)
        if (!(sigs[r][i] == sigs[0][i]))
          differing += (differing.empty() ? "" : ", ") + ("rank " + std::to_string(r) + " has " + describe(sigs[r][i]));
      if (!differing.empty())
        detail::raise(errc::mismatch, ch_.rank,
                      "ranks disagree on " + label(i) + ": rank 0 has " + describe(sigs[0][i]) + ", " + differing, -1,
                      index_of(i));
    }
    std::string counts;
    for (std::size_t r = 0; r < sigs.size(); ++r)
      if (sigs[r].size() != sigs[0].size() || r == 0)
        counts +=
            (counts.empty() ? "" : ", ") + ("rank " + std::to_string(r) + " has " + std::to_string(sigs[r].size()));
    // A rank with none wrapped its engine before the engine allocated them (dlib before its
    // first forward): say so, or the count alone reads like a different model.
    std::string none;
    for (std::size_t r = 0; r < sigs.size(); ++r)
      if (std::is_same_v<View, tensor_view> && sigs[r].empty()) none += (none.empty() ? "" : ", ") + std::to_string(r);
    if (!none.empty())
      none = "; rank(s) " + none + " have no " + noun +
             "s at all: wrapped before the engine allocated them? Wrap after it has (after the first forward; "
             "docs/engines.md, \"When to wrap\")";
    detail::raise(errc::mismatch, ch_.rank,
                  std::string("ranks disagree on the number of ") + noun + "s: " + counts +
                      "; the first differing is " + label(common) + none,
                  -1, index_of(common));
  }

  agreement_channel ch_;
};

}  // namespace DDP_ABI
}  // namespace ddp
