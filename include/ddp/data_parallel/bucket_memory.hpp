#pragma once
/// \file data_parallel/bucket_memory.hpp
/// `ddp::bucket_memory<Allocator>`: the bucket buffers of `basic_data_parallel` for one plan
/// (allocate, copy in and out, zero, drain the collectives that use them), on an allocator
/// alone, so that it can be tested in one process. See docs/data-parallel.md.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <deque>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/concepts.hpp>
#include <ddp/data_parallel/detail/parameters.hpp>
#include <ddp/detail/copy.hpp>
#include <ddp/detail/flight_recorder.hpp>
#include <ddp/error.hpp>
#include <ddp/parameter.hpp>
#include <ddp/planner/bucket_plan.hpp>
#include <ddp/request.hpp>

namespace ddp {
inline namespace DDP_ABI {

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
  ~bucket_memory() {
    release();
    if (side_ != nullptr) alloc_.deallocate(side_, side_bytes_);
  }

  /// Raises `errc::unsupported` on `rank` when the buckets or a parameter (`views`) are memory
  /// the CPU cannot touch and the allocator cannot copy it (no `copy` hook).
  void check_reachable(std::span<const tensor_view> views, int rank) const {
    check_reachable_of(views, rank, "parameter");
  }
  /// The same for the buffers and frozen parameters, which pass through the side buffer.
  void check_reachable(std::span<const buffer_view> buffers, int rank) const {
    check_reachable_of(buffers, rank, "buffer");
  }

 private:
  template <class View>
  void check_reachable_of(std::span<const View> views, int rank, std::string_view noun) const {
    if constexpr (!hooks) {
      if (!host_accessible(alloc_.location()))
        detail::raise(errc::unsupported, rank,
                      std::string("bucket memory of kind '") + memory_kind_name(alloc_.location()) +
                          "' needs an allocator with copy(dst, src, bytes) (ddp::allocator_with_copy)");
      refuse_device_views(views, rank, noun,
                          " but the allocator policy cannot copy device memory (it has no copy(dst, src, bytes), "
                          "ddp::allocator_with_copy; use cuda_allocator)");
    } else if constexpr (requires { bool(alloc_.copies_device_memory()); }) {
      // An allocator whose hooks reach device memory only sometimes (auto_allocator: when the
      // engine it serves is NCCL): the host engines read these buckets with the CPU.
      if (!alloc_.copies_device_memory())
        refuse_device_views(views, rank, noun,
                            std::string(" but the buckets are ") + memory_kind_name(alloc_.location()) +
                                " memory the CPU reduces (a host engine was chosen); reduce device gradients with "
                                "a device engine (DDP_BACKEND=nccl, nccl_reducer) or move them to the host");
    }
  }
  template <class View>
  static void refuse_device_views(std::span<const View> views, int rank, std::string_view noun,
                                  const std::string& why) {
    for (std::size_t i = 0; i < views.size(); ++i)
      if (views[i].device >= 0)
        detail::raise(errc::unsupported, rank,
                      detail::parameter_label(i, views[i].name, noun) + " lives on device " +
                          std::to_string(views[i].device) + why,
                      -1, std::is_same_v<View, tensor_view> ? static_cast<int>(i) : -1);
  }

 public:
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
    if (pool_bytes_ > 0) {
      for (void* p : pool_) alloc_.deallocate(p, pool_bytes_);
      pool_.clear();
      free_.clear();
      launched_.clear();
      pool_bytes_ = 0;
    } else {
      for (std::size_t b = 0; b < buffers_.size(); ++b) alloc_.deallocate(buffers_[b], plan_.buckets[b].bytes);
    }
    buffers_.clear();
  }

  /// The sharded mode's buffers: adopts `plan` with no bucket holding memory yet; `bind(b)`
  /// lends bucket b a buffer of the largest bucket's size, each bucket padded with zeros to a
  /// multiple of `pad_to` elements (the world size), and `unbind(b)` takes it back. The pool
  /// grows only when a bucket finds no buffer free and none it may wait for: the sharded mode
  /// holds one, not one per bucket. See docs/sharded.md, "Memory".
  void allocate_pooled(bucket_plan plan, std::size_t pad_to) {
    release();
    plan_ = std::move(plan);
    pad_to_ = pad_to == 0 ? 1 : pad_to;
    std::size_t most = 0;
    for (std::size_t b = 0; b < plan_.buckets.size(); ++b) most = std::max(most, padded_bytes(b));
    pool_bytes_ = std::max<std::size_t>(most, 1);
    buffers_.assign(plan_.buckets.size(), nullptr);
    requests_.assign(buffers_.size(), request{});
  }
  /// Bucket b's padded size in bytes (its plan size where buffers are not pooled).
  std::size_t padded_bytes(std::size_t b) const noexcept {
    const auto& bk = plan_.buckets[b];
    const std::size_t per = (bk.numel + pad_to_ - 1) / pad_to_;
    return per * pad_to_ * dtype_size(bk.type);
  }
  /// Gives bucket b a buffer unless it has one: a free one; else, when `may_wait`, the buffer of
  /// the oldest bucket whose collective was tracked since it was bound, once that collective
  /// ends (waited up to `patience`, raised on `rank` as `wait`); else a new one. Its padding is
  /// zeroed. Safe to call from several threads.
  void bind(std::size_t b, bool may_wait, std::chrono::milliseconds patience, int rank) {
    std::lock_guard lock(pool_mu_);
    if (buffers_[b] != nullptr) return;
    void* p = nullptr;
    if (!free_.empty()) {
      p = free_.back();
      free_.pop_back();
    } else if (may_wait && !launched_.empty()) {
      const std::size_t k = launched_.front();
      wait(k, patience, rank);
      launched_.pop_front();
      p = std::exchange(buffers_[k], nullptr);
    } else {
      pool_.reserve(pool_.size() + 1);
      p = alloc_.allocate(pool_bytes_);
      pool_.push_back(p);
    }
    buffers_[b] = p;
    const std::size_t used = plan_.buckets[b].bytes, padded = padded_bytes(b);
    if (padded > used) zero_bytes(static_cast<std::byte*>(p) + used, padded - used);
  }
  /// Returns bucket b's buffer to the pool (no collective may still use it).
  void unbind(std::size_t b) noexcept {
    std::lock_guard lock(pool_mu_);
    if (buffers_[b] == nullptr) return;
    std::erase(launched_, b);
    free_.push_back(std::exchange(buffers_[b], nullptr));
  }
  /// Bytes of bucket buffers held: the pool's, or one buffer per bucket.
  std::size_t held_bytes() const noexcept {
    if (pool_bytes_ > 0) return pool_.size() * pool_bytes_;
    std::size_t sum = 0;
    for (std::size_t b = 0; b < buffers_.size(); ++b) sum += plan_.buckets[b].bytes;
    return sum;
  }
  /// Buffers the pool holds now (0 where buffers are not pooled) and the bytes of each.
  std::size_t pooled() const noexcept { return pool_.size(); }
  std::size_t pool_buffer_bytes() const noexcept { return pool_bytes_; }
  /// Forgets the buffers (and the side buffer) without freeing them: a collective may still
  /// write into them.
  void leak() noexcept {
    buffers_.clear();
    pool_.clear();
    free_.clear();
    pool_bytes_ = 0;
    side_ = nullptr;
  }

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
  void zero(std::size_t i, std::size_t bytes) { zero_bytes(slot(i), bytes); }

  /// Clears all of bucket `b`'s buffer.
  void zero_bucket(std::size_t b) { zero_bytes(buffers_[b], plan_.buckets[b].bytes); }
  /// Runs `f(p)` on bucket `b`'s elements where the CPU can reach them: in place for memory the
  /// CPU touches, else on a host copy brought in and written back through the allocator's hooks.
  template <class F>
  void on_host(std::size_t b, F&& f) {
    const std::size_t bytes = plan_.buckets[b].bytes;
    if (host_accessible(alloc_.location())) {
      f(buffers_[b]);
      return;
    }
    std::vector<std::byte> host(bytes);
    copy(host.data(), buffers_[b], bytes);
    f(static_cast<void*>(host.data()));
    copy(buffers_[b], host.data(), bytes);
  }

  /// A small buffer beside the buckets, from the same allocator, so that the reducer can use it
  /// as it uses a bucket (the uneven-inputs count of contributing ranks). Allocated once, kept
  /// when `allocate` changes the plan, freed when this object is.
  void allocate_side(std::size_t bytes) {
    if (side_ != nullptr) return;
    side_ = alloc_.allocate(bytes);
    side_bytes_ = bytes;
  }
  void* side() const noexcept { return side_; }
  /// Copies `bytes` from host memory `src` into the side buffer, or out of it into `dst`.
  void put_side(const void* src, std::size_t bytes) { copy(side_, src, bytes); }
  void get_side(void* dst, std::size_t bytes) { copy(dst, side_, bytes); }
  /// The same at `offset` bytes into the side buffer (the buffers' staging, docs/engines.md).
  void put_side(std::size_t offset, const void* src, std::size_t bytes) {
    copy(static_cast<std::byte*>(side_) + offset, src, bytes);
  }
  void get_side(std::size_t offset, void* dst, std::size_t bytes) {
    copy(dst, static_cast<std::byte*>(side_) + offset, bytes);
  }

  /// Keeps the request of bucket `b`'s collective, which uses its buffer until it ends.
  void track(std::size_t b, request r) {
    requests_[b] = std::move(r);
    if (pool_bytes_ > 0) {
      std::lock_guard lock(pool_mu_);
      launched_.push_back(b);
    }
  }
  const request& in_flight(std::size_t b) const noexcept { return requests_[b]; }
  /// The same for the side buffer's collective.
  void track_side(request r) { side_request_ = std::move(r); }
  /// Waits up to `patience` (and 2 s of grace) for bucket `b`'s collective. Its own error (one
  /// naming a rank) is rethrown as it is; a deadline that passes is raised on `rank`, naming
  /// the bucket and the wait.
  void wait(std::size_t b, std::chrono::milliseconds patience, int rank) const {
    wait_one(requests_[b], patience, rank, "bucket " + std::to_string(b) + " was not reduced", static_cast<int>(b));
  }
  /// The same for the side buffer's collective; `what` names it in a timeout's message.
  void wait_side(std::chrono::milliseconds patience, int rank, const std::string& what) const {
    wait_one(side_request_, patience, rank, what, -1);
  }
  /// A new step: the previous step's requests have all ended.
  void clear_requests() {
    requests_.assign(buffers_.size(), request{});
    side_request_ = request{};
  }

  /// True when no collective can still touch the buffers: waits up to `patience` for the
  /// tracked requests, then calls `abort()` and waits up to 2 s more.
  template <class Abort>
  bool drain(steady_clock::duration patience, Abort&& abort) noexcept {
    // The buckets' requests and the side buffer's, which the same collectives' order binds.
    const auto each = [this](auto&& f) {
      for (auto& r : requests_) f(r);
      f(side_request_);
    };
    const auto wait_all = [&](steady_clock::time_point until) {
      bool all = true;
      each([&](request& r) {
        if (!r.valid()) return;
        try {
          r.wait(until);
        } catch (...) {
        }
        all = all && r.test();
      });
      return all;
    };
    bool pending = false;
    each([&](request& r) { pending = pending || (r.valid() && !r.test()); });
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
  static void wait_one(const request& req, std::chrono::milliseconds patience, int rank, const std::string& what,
                       int bucket) {
    try {
      req.wait(steady_clock::now() + patience + std::chrono::seconds(2));
    } catch (const error& e) {
      if (e.rank() >= 0) throw;
      if (e.condition() == errc::timeout) detail::flight_record_failure(what + ": the wait timed out");
      detail::raise(e.condition(), rank,
                    what + " within " + std::to_string(patience.count()) + " ms (a peer stopped answering?)", bucket);
    }
  }

  void zero_bytes(void* p, std::size_t bytes) {
    if (bytes == 0) return;
    if constexpr (allocator_with_zero<Allocator>)
      alloc_.zero(p, bytes);
    else
      std::memset(p, 0, bytes);
  }

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
  void* side_ = nullptr;
  std::size_t side_bytes_ = 0;
  request side_request_;
  // The pool (allocate_pooled): every buffer, the free ones, the bound buckets whose collective
  // was tracked (oldest first), the size of each buffer (0: not pooled) and the padding.
  std::vector<void*> pool_;
  std::vector<void*> free_;
  std::deque<std::size_t> launched_;
  std::size_t pool_bytes_ = 0;
  std::size_t pad_to_ = 1;
  std::mutex pool_mu_;
};

}  // namespace DDP_ABI
}  // namespace ddp
