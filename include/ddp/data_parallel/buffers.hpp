#pragma once
/// \file data_parallel/buffers.hpp
/// `ddp::buffer_layout`: where a model's buffers (`buffer_kind::buffer`) sit in the wrapper's
/// side buffer when they are made alike after a step (`dp_options::buffers`), grouped by dtype so
/// that one collective per dtype moves them all; and `ddp::step_record`, the per-step words the
/// ranks reduce with `op::max` (which parameters any rank used, and which rank is the source of
/// the buffers). Pure layout: the wrapper issues the collectives. See docs/engines.md, "What is
/// synchronized".

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/dtype.hpp>
#include <ddp/parameter.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// The staging layout of the buffers that are made alike after each synchronized step: every
/// `buffer_kind::buffer` with elements, grouped by dtype (each group 64-byte aligned), in
/// registration order within a group. Frozen parameters are not in it (construction only).
/// \code
/// ddp::buffer_layout layout{ddp::to_buffer_views(model)};
/// for (const auto& g : layout.groups()) std::printf("%zu elements\n", g.numel);
/// \endcode
class buffer_layout {
 public:
  /// One dtype's buffers, packed one after the other from `offset` (bytes).
  struct group {
    dtype type = dtype::f32;
    std::size_t offset = 0;
    std::size_t numel = 0;
  };
  /// Where one buffer sits: its index among the buffers and its offset (bytes) in the staging.
  struct slot {
    std::size_t buffer = 0;
    std::size_t offset = 0;
  };

  buffer_layout() = default;
  buffer_layout(const buffer_layout&) = delete;  // the views point into names_
  buffer_layout& operator=(const buffer_layout&) = delete;
  explicit buffer_layout(std::vector<buffer_view> buffers) : buffers_(std::move(buffers)) {
    for (auto& b : buffers_) b.name = names_.emplace_back(b.name);  // the names live as long as this
    std::size_t at = 0;
    for (const dtype t : {dtype::f32, dtype::f64, dtype::f16, dtype::bf16, dtype::i32, dtype::i64}) {
      group g{t, at, 0};
      for (std::size_t i = 0; i < buffers_.size(); ++i) {
        const auto& b = buffers_[i];
        if (b.kind != buffer_kind::buffer || b.numel == 0 || b.type != t) continue;
        slots_.push_back({i, g.offset + g.numel * dtype_size(t)});
        g.numel += b.numel;
      }
      if (g.numel == 0) continue;
      groups_.push_back(g);
      at = (g.offset + g.numel * dtype_size(t) + 63) / 64 * 64;
    }
    bytes_ = at;
  }

  /// Every buffer and frozen parameter, as given.
  const std::vector<buffer_view>& buffers() const noexcept { return buffers_; }
  /// The dtype groups of the staging area; empty when nothing is synchronized per step.
  const std::vector<group>& groups() const noexcept { return groups_; }
  /// Each staged buffer's place, group by group.
  const std::vector<slot>& slots() const noexcept { return slots_; }
  /// Bytes of the staging area.
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  std::deque<std::string> names_;  // a deque: the views' names stay put
  std::vector<buffer_view> buffers_;
  std::vector<group> groups_;
  std::vector<slot> slots_;
  std::size_t bytes_ = 0;
};

/// The words each rank contributes to a step's record, reduced with `op::max` over i64: one per
/// parameter (1 when this rank used it in the step, its `no_sync()` steps included), then the
/// rank that takes part in the step (-1 for a rank that has joined), so that the maximum is the
/// highest rank still training: the source of the buffers when ranks have joined, as in
/// PyTorch's `Join`.
/// \code
/// std::vector<std::int64_t> words = ddp::step_record::encode({true, false}, 1);
/// \endcode
struct step_record {
  static std::vector<std::int64_t> encode(const std::vector<bool>& used, int rank) {
    std::vector<std::int64_t> w(used.begin(), used.end());
    w.push_back(rank);
    return w;
  }
  static std::size_t bytes(std::size_t parameters) noexcept { return (parameters + 1) * sizeof(std::int64_t); }
};

}  // namespace DDP_ABI
}  // namespace ddp
