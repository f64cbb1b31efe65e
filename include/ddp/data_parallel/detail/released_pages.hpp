#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/released_pages.hpp
/// The fully sharded mode's release of a unit's memory in the engine's own tensors
/// (data_parallel/fully_sharded.hpp): the whole pages inside a tensor are given back to the
/// kernel (madvise MADV_DONTNEED: the resident memory falls) and, with protection on, made
/// inaccessible (mprotect PROT_NONE), so that a touch outside the unit stops the process at
/// once with a message naming the tensor and its unit (a SIGSEGV handler reads a registry of
/// released ranges, then lets the fault go on to the previous handler); the partial pages at a
/// tensor's ends stay, filled with NaN (parameters) so that a read outside the unit is never a
/// silent stale value. See docs/sharded.md, "Fully sharded".
// IWYU pragma: private

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include <ddp/error.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail::released {

/// One released range: [lo, hi) (whole pages), and what to say when it is touched.
struct entry {
  std::atomic<std::uintptr_t> lo{0};
  std::atomic<std::uintptr_t> hi{0};
  std::atomic<const char*> what{nullptr};  // "parameter 3 ('fc.weight') of unit 1": the owner's string
};

inline constexpr std::size_t capacity = 8192;
inline entry* registry() noexcept {
  static entry table[capacity];
  return table;
}
inline struct sigaction& previous() noexcept {
  static struct sigaction p {};
  return p;
}

/// The SIGSEGV handler: a fault inside a released range prints what was touched (async-signal
/// safe: write(2) only), then the previous handler takes the fault over (the default one ends
/// the process with SIGSEGV).
inline void on_fault(int sig, siginfo_t* info, void* context) {
  const auto at = reinterpret_cast<std::uintptr_t>(info->si_addr);
  for (std::size_t k = 0; k < capacity; ++k) {
    entry& e = registry()[k];
    const std::uintptr_t lo = e.lo.load(std::memory_order_acquire);
    if (lo == 0 || at < lo || at >= e.hi.load(std::memory_order_acquire)) continue;
    const char* what = e.what.load(std::memory_order_acquire);
    const char head[] = "ddp: fully_sharded: ";
    const char tail[] =
        " was touched while its unit is released: gather(unit) before its forward, begin_backward(unit) before its "
        "backward (docs/sharded.md, \"Fully sharded\")\n";
    [[maybe_unused]] ssize_t w = ::write(2, head, sizeof head - 1);
    if (what != nullptr) w = ::write(2, what, std::strlen(what));
    w = ::write(2, tail, sizeof tail - 1);
    break;
  }
  const struct sigaction& p = previous();
  if ((p.sa_flags & SA_SIGINFO) != 0 && p.sa_sigaction != nullptr) {
    p.sa_sigaction(sig, info, context);
    return;
  }
  // The previous handler (the default, most often) takes the fault when it recurs on return.
  ::sigaction(SIGSEGV, &p, nullptr);
}

inline void install_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = &on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGSEGV, &sa, &previous());
  });
}

inline std::size_t page_size() noexcept {
  static const auto p = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return p;
}

/// The whole pages inside [data, data + bytes): [lo, hi), empty when none.
struct pages {
  std::uintptr_t lo = 0, hi = 0;
  static pages inside(const void* data, std::size_t bytes) noexcept {
    const std::size_t p = page_size();
    const auto begin = reinterpret_cast<std::uintptr_t>(data), end = begin + bytes;
    pages r{(begin + p - 1) / p * p, end / p * p};
    if (r.hi <= r.lo) r = {};
    return r;
  }
  bool empty() const noexcept { return hi <= lo; }
  std::size_t bytes() const noexcept { return hi - lo; }
};

/// One tensor's releasable pages and its slot in the registry while released.
class region {
 public:
  region() = default;
  region(void* data, std::size_t bytes, std::string what)
      : data_(static_cast<std::byte*>(data)),
        bytes_(bytes),
        pages_(pages::inside(data, bytes)),
        what_(std::move(what)) {
    // Transparent huge pages where the kernel gives them on request: a released tensor comes
    // back in faults of 2 MiB, not of 4 KiB (a gather of ResNet-50's parameters took 25,000
    // faults), the page tables' and the allocator's work per fault cut 500-fold.
    constexpr std::uintptr_t huge = std::uintptr_t{2} << 20;
    const auto begin = reinterpret_cast<std::uintptr_t>(data);
    const std::uintptr_t lo = (begin + huge - 1) / huge * huge, hi = (begin + bytes) / huge * huge;
    if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // a hint: its failure is harmless
  }
  region(const region&) = delete;
  region& operator=(const region&) = delete;
  region(region&& o) noexcept { *this = std::move(o); }
  region& operator=(region&& o) noexcept {
    restore();
    data_ = o.data_;
    bytes_ = o.bytes_;
    pages_ = o.pages_;
    what_ = std::move(o.what_);
    slot_ = o.slot_;
    protected_ = o.protected_;
    probed_ = o.probed_;
    zero_ = o.zero_;
    given_back_ = o.given_back_;
    populated_ = o.populated_;
    o.slot_ = nullptr;
    o.protected_ = false;
    if (slot_ != nullptr) slot_->what.store(what_.c_str(), std::memory_order_release);
    return *this;
  }
  ~region() { restore(); }

  /// With `give_back`, gives the whole pages back to the kernel (their contents are lost); with
  /// `protect`, makes them inaccessible until `reopen()`. The first release checks that pages
  /// given back read as zero (private anonymous memory: new, malloc, std::vector), which
  /// `reads_zero()` then says.
  void release(bool give_back, bool protect, int rank) {
    if (pages_.empty() || protected_) return;
    void* lo = reinterpret_cast<void*>(pages_.lo);
    if (give_back) {
      const bool probe = !probed_;
      if (probe) *static_cast<volatile unsigned char*>(lo) = 0xa5;
      if (::madvise(lo, pages_.bytes(), MADV_DONTNEED) != 0) fail("madvise(MADV_DONTNEED)", rank);
      if (probe) {  // a shared or file mapping keeps its contents: its gradients are zeroed by hand
        zero_ = *static_cast<volatile unsigned char*>(lo) == 0;
        probed_ = true;
        if (zero_) ::madvise(lo, page_size(), MADV_DONTNEED);  // the probe's page, again
      }
    }
    given_back_ = give_back;
    populated_ = false;
    if (!protect) return;
    install_handler();
    if (::mprotect(lo, pages_.bytes(), PROT_NONE) != 0) fail("mprotect(PROT_NONE)", rank);
    protected_ = true;
    for (std::size_t k = 0; k < capacity && slot_ == nullptr; ++k) {
      entry& e = registry()[k];
      std::uintptr_t free = 0;
      if (e.lo.load(std::memory_order_relaxed) != 0) continue;
      e.what.store(what_.c_str(), std::memory_order_relaxed);
      e.hi.store(pages_.hi, std::memory_order_relaxed);
      if (e.lo.compare_exchange_strong(free, pages_.lo, std::memory_order_acq_rel)) slot_ = &e;
    }
    // A full registry only loses the message: the fault still stops the process.
  }

  /// Makes the pages accessible again (zero-filled where released), faulted in at once where
  /// they were given back: one call instead of a page fault per 4 KiB page as they are written.
  void reopen(int rank) {
    if (protected_) {
      unregister();
      if (::mprotect(reinterpret_cast<void*>(pages_.lo), pages_.bytes(), PROT_READ | PROT_WRITE) != 0)
        fail("mprotect(PROT_READ | PROT_WRITE)", rank);
      protected_ = false;
    }
#ifdef MADV_POPULATE_WRITE
    if (given_back_ && !populated_) {
      ::madvise(reinterpret_cast<void*>(pages_.lo), pages_.bytes(),
                MADV_POPULATE_WRITE);  // before 5.14: EINVAL, harmless
      populated_ = true;
    }
#endif
  }

  std::size_t releasable_bytes() const noexcept { return pages_.bytes(); }
  /// The whole pages read as zero since the last release (given back, and memory that zeroes).
  bool reads_zero() const noexcept { return !pages_.empty() && given_back_ && zero_; }
  /// The tensor's bytes outside its whole pages: [data, lo) and [hi, data + bytes).
  template <class Fill>
  void edges(const Fill& fill) const {
    if (pages_.empty()) {
      fill(data_, bytes_);
      return;
    }
    const auto begin = reinterpret_cast<std::uintptr_t>(data_);
    fill(data_, pages_.lo - begin);
    fill(data_ + (pages_.hi - begin), bytes_ - (pages_.hi - begin));
  }

 private:
  void unregister() noexcept {
    if (slot_ != nullptr) slot_->lo.store(0, std::memory_order_release);
    slot_ = nullptr;
  }
  void restore() noexcept {
    unregister();
    if (protected_) ::mprotect(reinterpret_cast<void*>(pages_.lo), pages_.bytes(), PROT_READ | PROT_WRITE);
    protected_ = false;
  }
  [[noreturn]] void fail(const char* call, int rank) const {
    const int e = errno;
    raise(errc::system, rank, "fully_sharded: " + std::string(call) + " of " + what_ + " failed: " + std::strerror(e));
  }

  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  pages pages_{};
  std::string what_;
  entry* slot_ = nullptr;
  bool protected_ = false;
  bool probed_ = false, zero_ = false, given_back_ = false, populated_ = false;
};

}  // namespace detail::released
}  // namespace DDP_ABI
}  // namespace ddp
