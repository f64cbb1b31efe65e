#pragma once
/// \file size_planner.hpp
/// `ddp::size_planner`: the default bucket planner, greedy by byte size.

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/planner/bucket_plan.hpp>
#include <ddp/planner/planner_concept.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Greedy size-capped bucketing, the rule of PyTorch's `compute_bucket_assignment_by_size`.
///
/// Parameters are walked in `order` (empty: reverse registration order, since backward produces
/// the last layer's gradients first). Each (dtype, device) kind keeps one open bucket, because a
/// collective reduces one element type on one device. A parameter joins the open bucket of its
/// kind; if it would push a non-empty bucket past its cap, that bucket is closed first, so a
/// bucket exceeds its cap only when it holds a single parameter larger than the cap. A bucket
/// that reaches its cap closes at once. Buckets are listed in the order their last parameter
/// appears in the walk, which is the order they become complete during backward and hence
/// the order they are launched.
///
/// Entries are packed back to back (offsets contiguous in elements, no alignment padding): the
/// reducer then reduces exactly the gradient bytes, and the copy path is one memcpy per entry.
/// The bucket buffer itself is aligned by the allocator policy.
/// \code
/// std::vector<ddp::param_info> ps{{1000, ddp::dtype::f32, -1}, {10, ddp::dtype::f32, -1}};
/// ddp::bucket_plan plan = ddp::size_planner{}.plan(ps, ddp::bucket_policy{});
/// \endcode
struct size_planner {
  /// Plans `params` under `policy`. Throws `ddp::error` (`errc::invalid_argument`) when `order`
  /// is neither empty nor a permutation of `0 .. params.size()-1`, or a dtype is unknown.
  bucket_plan plan(std::span<const param_info> params, const bucket_policy& policy,
                   std::span<const std::size_t> order = {}) const {
    const std::size_t n = params.size();
    const std::vector<std::size_t> walk = walk_order(n, order);

    struct open_bucket {
      bucket b;
      std::size_t closed = 0;    // buckets of this kind closed so far: selects the cap
      std::size_t last_pos = 0;  // walk position of the latest parameter added
    };
    std::vector<open_bucket> open;                     // one per (dtype, device); few kinds, so a linear search
    std::vector<std::pair<std::size_t, bucket>> done;  // (last walk position, bucket)

    const auto close = [&done](open_bucket& ob) {
      bucket fresh;
      fresh.type = ob.b.type;
      fresh.device = ob.b.device;
      done.emplace_back(ob.last_pos, std::exchange(ob.b, std::move(fresh)));
      ++ob.closed;
    };

    for (std::size_t pos = 0; pos < n; ++pos) {
      const std::size_t p = walk[pos];
      const param_info& info = params[p];
      if (dtype_size(info.type) == 0) {
        detail::raise(errc::invalid_argument, -1, "parameter " + std::to_string(p) + " has an unknown dtype", -1,
                      static_cast<int>(p));
      }
      auto it = std::find_if(open.begin(), open.end(), [&](const open_bucket& ob) {
        return ob.b.type == info.type && ob.b.device == info.device;
      });
      if (it == open.end()) {
        open_bucket ob;
        ob.b.type = info.type;
        ob.b.device = info.device;
        open.push_back(std::move(ob));
        it = std::prev(open.end());
      }
      open_bucket& ob = *it;
      const std::size_t bytes = info.bytes();
      if (!ob.b.entries.empty() && ob.b.bytes + bytes > policy.cap_for(ob.closed)) close(ob);
      ob.b.entries.push_back(bucket_entry{p, ob.b.numel, info.numel});
      ob.b.numel += info.numel;
      ob.b.bytes += bytes;
      ob.last_pos = pos;
      if (ob.b.bytes >= policy.cap_for(ob.closed)) close(ob);
    }
    for (auto& ob : open) {
      if (!ob.b.entries.empty()) close(ob);
    }
    std::sort(done.begin(), done.end(), [](const auto& a, const auto& b) { return a.first < b.first; });

    bucket_plan out;
    out.buckets.reserve(done.size());
    out.where.assign(n, {0, 0});
    for (auto& [pos, bk] : done) {
      const std::size_t bi = out.buckets.size();
      for (std::size_t ei = 0; ei < bk.entries.size(); ++ei) out.where[bk.entries[ei].param] = {bi, ei};
      out.buckets.push_back(std::move(bk));
    }
    return out;
  }

 private:
  static std::vector<std::size_t> walk_order(std::size_t n, std::span<const std::size_t> order) {
    std::vector<std::size_t> walk;
    walk.reserve(n);
    if (order.empty()) {
      for (std::size_t i = n; i > 0; --i) walk.push_back(i - 1);
      return walk;
    }
    if (order.size() != n) {
      detail::raise(errc::invalid_argument, -1,
                    "bucket order has " + std::to_string(order.size()) + " entries for " + std::to_string(n) +
                        " parameters; it must be a permutation");
    }
    std::vector<bool> seen(n, false);
    for (std::size_t k = 0; k < n; ++k) {
      const std::size_t p = order[k];
      if (p >= n) {
        detail::raise(errc::invalid_argument, -1,
                      "bucket order entry " + std::to_string(k) + " names parameter " + std::to_string(p) +
                          " but there are only " + std::to_string(n) + " parameters");
      }
      if (seen[p]) {
        detail::raise(errc::invalid_argument, -1,
                      "parameter " + std::to_string(p) + " appears twice in the bucket order (again at entry " +
                          std::to_string(k) + "); it must be a permutation",
                      -1, static_cast<int>(p));
      }
      seen[p] = true;
      walk.push_back(p);
    }
    return walk;
  }
};

static_assert(bucket_planner<size_planner>);

}  // namespace DDP_ABI
}  // namespace ddp
