#pragma once
/// \file data_parallel/bucket_memory.hpp
/// `ddp::bucket_memory<Allocator>`: the bucket buffers of `basic_data_parallel` for one plan
/// (allocate, copy in and out, zero, drain the collectives that use them), on an allocator
/// alone, so that it can be tested in one process. See docs/data-parallel.md.

#include <chrono>
#include <cstddef>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/concepts.hpp>
#include <ddp/data_parallel/detail/parameters.hpp>
#include <ddp/detail/copy.hpp>
#include <ddp/error.hpp>
#include <ddp/parameter.hpp>
#include <ddp/planner/bucket_plan.hpp>
#include <ddp/request.hpp>

namespace ddp {
inline namespace v0 {

/// One flat buffer per bucket of a plan, from `Allocator`, and the requests of the collectives
/// that use them. Copies and zeroing go through the allocator's hooks when it has them
/// (`copying_allocator`), else through `memcpy`/`memset`. Frees its buffers when destroyed,
/// unless told that a collective may still write into them (`leak()`).
/// \code
/// ddp::bucket_memory<ddp::host_allocator> mem{{}};
/// mem.allocate(plan);
/// mem.copy_in(3, grad3, bytes3);   // gradient 3 into its slot
/// mem.zero(4, bytes4);             // an unused parameter
/// \endcode
template <device_allocator Allocator>
class bucket_memory {
  static_assert(!allocator_with_copy<Allocator> || allocator_with_zero<Allocator>,
                "ddp: this allocator has copy(dst, src, bytes) but no zero(dst, bytes): an allocator with "
                "the copy hook must also model ddp::allocator_with_zero (the wrapper cannot clear memory "
                "it does not copy itself)");
  static_assert(!allocates_device_memory<Allocator>() || allocator_with_copy<Allocator>,
                "ddp: this allocator hands out memory the CPU cannot touch but has no copy(dst, src, bytes): "
                "it must model ddp::allocator_with_copy and ddp::allocator_with_zero (ddp::copying_allocator)");

 public:
  /// True when copies and zeroing go through the allocator's hooks.
  static constexpr bool hooks = allocator_with_copy<Allocator>;

  explicit bucket_memory(Allocator alloc) : alloc_(std::move(alloc)) {}
  bucket_memory(const bucket_memory&) = delete;
  bucket_memory& operator=(const bucket_memory&) = delete;
  ~bucket_memory() { release(); }

  /// Raises `errc::unsupported` on `rank` when the buckets or a parameter (`views`) are memory
  /// the CPU cannot touch and the allocator cannot copy it (no `copy` hook).
  void check_reachable(std::span<const tensor_view> views, int rank) const {
    if constexpr (!hooks) {
      if (!host_accessible(alloc_.location()))
        detail::raise(errc::unsupported, rank,
                      std::string("bucket memory of kind '") + memory_kind_name(alloc_.location()) +
                          "' needs an allocator with copy(dst, src, bytes) (ddp::allocator_with_copy)");
      for (std::size_t i = 0; i < views.size(); ++i)
        if (views[i].device >= 0)
          detail::raise(errc::unsupported, rank,
                        detail::parameter_label(i, views[i].name) + " lives on device " +
                            std::to_string(views[i].device) +
                            " but the allocator policy cannot copy device memory (it has no copy(dst, src, "
                            "bytes), ddp::allocator_with_copy; use cuda_allocator)",
                        -1, static_cast<int>(i));
    }
  }

  /// Frees the current buffers, adopts `plan` and allocates one buffer per bucket. When an
  /// allocation throws, nothing stays allocated and the exception propagates.
  void allocate(bucket_plan plan) {
    release();
    plan_ = std::move(plan);
    std::vector<void*> out;
    out.reserve(plan_.buckets.size());
    try {
      for (const auto& bk : plan_.buckets) out.push_back(alloc_.allocate(bk.bytes));
    } catch (...) {
      for (std::size_t b = 0; b < out.size(); ++b) alloc_.deallocate(out[b], plan_.buckets[b].bytes);
      throw;
    }
    buffers_ = std::move(out);
    requests_.assign(buffers_.size(), request{});
  }

  /// Frees every buffer (the caller knows that no collective can touch them any more).
  void release() noexcept {
    for (std::size_t b = 0; b < buffers_.size(); ++b) alloc_.deallocate(buffers_[b], plan_.buckets[b].bytes);
    buffers_.clear();
  }
  /// Forgets the buffers without freeing them: a collective may still write into them.
  void leak() noexcept { buffers_.clear(); }

  const bucket_plan& plan() const noexcept { return plan_; }
  /// Number of buffers held (0 before `allocate` and after `release`).
  std::size_t size() const noexcept { return buffers_.size(); }
  void* buffer(std::size_t b) const noexcept { return buffers_[b]; }
  /// Where parameter `i`'s gradient sits in its bucket.
  void* slot(std::size_t i) const noexcept {
    const auto [b, e] = plan_.where[i];
    const auto& bk = plan_.buckets[b];
    return static_cast<std::byte*>(buffers_[b]) + bk.entries[e].offset_elems * dtype_size(bk.type);
  }

  /// Copies `bytes` of parameter `i`'s gradient from `src` into its slot.
  void copy_in(std::size_t i, const void* src, std::size_t bytes) { copy(slot(i), src, bytes); }
  /// Copies `bytes` of parameter `i`'s slot out to `dst`.
  void copy_out(std::size_t i, void* dst, std::size_t bytes) { copy(dst, slot(i), bytes); }
  /// Clears `bytes` of parameter `i`'s slot.
  void zero(std::size_t i, std::size_t bytes) {
    if (bytes == 0) return;
    if constexpr (allocator_with_zero<Allocator>)
      alloc_.zero(slot(i), bytes);
    else
      std::memset(slot(i), 0, bytes);
  }

  /// Keeps the request of bucket `b`'s collective, which uses its buffer until it ends.
  void track(std::size_t b, request r) { requests_[b] = std::move(r); }
  const request& in_flight(std::size_t b) const noexcept { return requests_[b]; }
  /// Waits up to `patience` (and 2 s of grace) for bucket `b`'s collective. Its own error (one
  /// naming a rank) is rethrown as it is; a deadline that passes is raised on `rank`, naming
  /// the bucket and the wait.
  void wait(std::size_t b, std::chrono::milliseconds patience, int rank) const {
    try {
      requests_[b].wait(steady_clock::now() + patience + std::chrono::seconds(2));
    } catch (const error& e) {
      if (e.rank() >= 0) throw;
      detail::raise(e.condition(), rank,
                    "bucket " + std::to_string(b) + " was not reduced within " + std::to_string(patience.count()) +
                        " ms (a peer stopped answering?)",
                    static_cast<int>(b));
    }
  }
  /// A new step: the previous step's requests have all ended.
  void clear_requests() { requests_.assign(buffers_.size(), request{}); }

  /// True when no collective can still touch the buffers: waits up to `patience` for the
  /// tracked requests, then calls `abort()` and waits up to 2 s more.
  template <class Abort>
  bool drain(steady_clock::duration patience, Abort&& abort) noexcept {
    const auto wait_all = [this](steady_clock::time_point until) {
      bool all = true;
      for (auto& r : requests_) {
        if (!r.valid()) continue;
        try {
          r.wait(until);
        } catch (...) {
        }
        all = all && r.test();
      }
      return all;
    };
    bool pending = false;
    for (auto& r : requests_) pending = pending || (r.valid() && !r.test());
    if (!pending) return true;
    try {
      if (wait_all(steady_clock::now() + patience)) return true;
      abort();
      return wait_all(steady_clock::now() + std::chrono::seconds(2));
    } catch (...) {
      return false;
    }
  }

  Allocator& allocator() noexcept { return alloc_; }
  const Allocator& allocator() const noexcept { return alloc_; }

 private:
  void copy(void* dst, const void* src, std::size_t bytes) {
    if (bytes == 0 || dst == src) return;
    if constexpr (hooks)
      alloc_.copy(dst, src, bytes);
    else
      detail::copy_bytes_streaming(dst, src, bytes);  // a gradient or a result, not read again soon
  }

  Allocator alloc_;
  bucket_plan plan_;
  std::vector<void*> buffers_;
  std::vector<request> requests_;
};

}  // namespace v0
}  // namespace ddp
