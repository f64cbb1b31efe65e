#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
/// \file reducer/detail/shm_segment.hpp
/// The pieces under `ddp::shm`: a POSIX shared-memory mapping, the layout of the segment
/// (header, per-rank control blocks, staging slots, arena), the per-rank arena heap, and the
/// process check (the host check is `ddp::host_identity`, group/topology.hpp).
///
/// Segment layout (offsets are page aligned where the kernels stream through memory):
/// ```
///   shm_header                      one cache line: magic, geometry, abort word
///   shm_rank_block[world]           per rank: futex counter, waiter count, pid, descriptors
///   slots[world][nslots][slot_bytes]  staging for ordinary user buffers
///   arena[arena_bytes]              zero-copy buffers; rank r allocates from part r
/// ```
/// The object is sparse: rank 0 reserves the pages of everything before the arena when it
/// creates it, and each rank reserves pages of its own part as it hands blocks out.

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>

#include <ddp/detail/collective.hpp>
#include <ddp/detail/copy.hpp>
#include <ddp/detail/fd.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

inline constexpr std::uint64_t shm_magic = 0x316d68732d706464ull;  // "ddp-shm1", little endian
inline constexpr std::uint32_t shm_version = 3;                    // 2: descriptors are coll_desc; 3: abort reasons
inline constexpr std::size_t shm_line = 64;
inline constexpr std::size_t shm_page = 4096;

constexpr std::size_t round_up(std::size_t x, std::size_t a) noexcept { return (x + a - 1) / a * a; }

/// What a rank is doing in its current collective; compared across ranks to detect mismatches.
/// Plain data: written by its owner before the signal that publishes it, read by peers after
/// they observed that signal.
struct shm_desc {
  coll_desc coll{};                ///< the collective, as every engine describes it (detail/collective.hpp)
  std::uint64_t arena_offset = 0;  ///< user buffer's offset in the segment, or `no_offset`
  static constexpr std::uint64_t no_offset = ~std::uint64_t{0};
};
static_assert(std::is_trivially_copyable_v<shm_desc>);

struct alignas(shm_line) shm_header {
  std::uint64_t magic;
  std::uint32_t version;
  std::uint32_t world;
  std::uint64_t slot_bytes;
  std::uint64_t nslots;
  std::uint64_t arena_offset;
  std::uint64_t arena_bytes;
  std::uint64_t total_bytes;
  std::atomic<std::int32_t> aborted_by;  ///< -1, or the rank that called abort()
  /// -1, or the rank that claimed the abort: it writes its reason, then sets `aborted_by`, so
  /// a rank that sees `aborted_by` set also sees the reason (when one was given).
  std::atomic<std::int32_t> abort_claim;
  std::int32_t reason_code;  ///< the errc of `reason`
  std::uint32_t reason_len;  ///< bytes of `reason`; 0: abort() gave none
  char reason[1024];         ///< why, as the group records failures ("rank 2 reports: ...")
};

/// One rank's control block. The first line is polled by every peer on each wait; the owner
/// writes `counter` once per signal. Descriptors sit on their own lines so that writing the
/// next one does not disturb pollers of the counter.
struct alignas(shm_line) shm_rank_block {
  std::atomic<std::uint32_t> counter;  ///< futex word: signals sent so far (wraps)
  std::atomic<std::uint32_t> waiters;  ///< peers asleep (or about to be) on `counter`
  std::atomic<std::uint32_t> closed;   ///< 1 once the owner destroyed its transport
  std::atomic<std::int32_t> pid;
  std::atomic<std::int32_t> cpu;       ///< the core the owner last signalled from (a hint)
  alignas(shm_line) shm_desc desc[2];  ///< by collective parity, so writing seq q+1 never
                                       ///< races a slow reader of seq q
};
static_assert(std::atomic<std::int32_t>::is_always_lock_free);

/// Byte offsets of the parts of a segment; a pure function of the geometry so every rank
/// computes the same one from the header rank 0 wrote.
struct shm_layout {
  std::size_t blocks = 0;  ///< offset of shm_rank_block[0]
  std::size_t slots = 0;   ///< offset of slot [0][0]
  std::size_t slot_bytes = 0;
  std::size_t nslots = 0;
  std::size_t arena = 0;  ///< offset of the arena
  std::size_t arena_bytes = 0;
  std::size_t total = 0;
  int world = 1;

  std::size_t slot(int rank, std::size_t s) const noexcept {
    return slots + (static_cast<std::size_t>(rank) * nslots + s) * slot_bytes;
  }
  /// Rank r's part of the arena: [arena + begin, arena + end).
  std::size_t part_begin(int r) const noexcept {
    return arena + static_cast<std::size_t>(r) * (arena_bytes / static_cast<std::size_t>(world)) / shm_page * shm_page;
  }
  std::size_t part_end(int r) const noexcept { return r + 1 == world ? arena + arena_bytes : part_begin(r + 1); }
};

constexpr shm_layout make_shm_layout(int world, std::size_t slot_bytes, std::size_t nslots,
                                     std::size_t arena_bytes) noexcept {
  shm_layout l;
  l.world = world;
  l.blocks = round_up(sizeof(shm_header), shm_line);
  l.slots = round_up(l.blocks + static_cast<std::size_t>(world) * sizeof(shm_rank_block), shm_page);
  l.slot_bytes = round_up(slot_bytes, shm_page);
  l.nslots = nslots;
  l.arena = l.slots + static_cast<std::size_t>(world) * nslots * l.slot_bytes;
  l.arena_bytes = round_up(arena_bytes, shm_page);
  l.total = l.arena + l.arena_bytes;
  return l;
}

/// "12.3 MiB": sizes in messages about /dev/shm.
inline std::string shm_mib(std::size_t bytes) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / double(1 << 20));
  return buf;
}

/// What /dev/shm holds now ("/dev/shm has 1.2 MiB free of 64.0 MiB"), for error messages.
inline std::string shm_space() {
  struct statvfs vfs {};
  if (::statvfs("/dev/shm", &vfs) != 0) return "statvfs(/dev/shm): " + errno_text(errno);
  return "/dev/shm has " + shm_mib(static_cast<std::size_t>(vfs.f_bavail) * vfs.f_frsize) + " free of " +
         shm_mib(static_cast<std::size_t>(vfs.f_blocks) * vfs.f_frsize);
}

/// Size of /dev/shm (its tmpfs limit), or 0 when it cannot be read.
inline std::size_t shm_capacity() noexcept {
  struct statvfs vfs {};
  if (::statvfs("/dev/shm", &vfs) != 0) return 0;
  return static_cast<std::size_t>(vfs.f_blocks) * vfs.f_frsize;
}

/// A MAP_SHARED mapping of a POSIX shared-memory object; unmapped (and its descriptor closed)
/// on destruction. The name is unlinked separately, as soon as every rank has mapped it.
///
/// tmpfs backs a page when it is first touched, and a full /dev/shm turns that touch into
/// SIGBUS. So the object is made at its full (sparse) size, which costs nothing, and every range
/// is `reserve`d (posix_fallocate) before it is handed out: a full /dev/shm is then an error
/// where the memory is asked for, never a signal in the middle of a collective.
class shm_mapping {
 public:
  shm_mapping() = default;
  shm_mapping(const shm_mapping&) = delete;
  shm_mapping& operator=(const shm_mapping&) = delete;
  shm_mapping(shm_mapping&& o) noexcept
      : base_(std::exchange(o.base_, nullptr)), size_(std::exchange(o.size_, 0)), fd_(std::exchange(o.fd_, -1)) {}
  shm_mapping& operator=(shm_mapping&& o) noexcept {
    if (this != &o) {
      reset();
      base_ = std::exchange(o.base_, nullptr);
      size_ = std::exchange(o.size_, 0);
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  ~shm_mapping() { reset(); }

  /// Creates `name` exclusively with `size` bytes, reserves its first `reserved` bytes and maps
  /// it. Returns an empty string on success, else why it failed (the caller raises on every
  /// rank at once).
  std::string create(const std::string& name, std::size_t size, std::size_t reserved) {
    fd_ = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd_ < 0) {
      const int e = errno;
      // The name has a random part only the group's ranks know: taken, it is another process's
      // (a stale segment of this user, or a name another user created on purpose).
      struct stat st {};
      if (e == EEXIST && ::stat(("/dev/shm" + name).c_str(), &st) == 0)
        return "another process holds /dev/shm" + name + " (owner uid " + std::to_string(st.st_uid) +
               (st.st_uid == ::geteuid() ? ", this user: a segment left by an earlier run; remove it" : "") + ")";
      return "shm_open(" + name + ", O_CREAT|O_EXCL): " + errno_text(e);
    }
    std::string why;
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0)
      why = "ftruncate(" + name + ", " + std::to_string(size) + "): " + errno_text(errno);
    if (why.empty()) why = reserve(0, reserved);
    if (why.empty()) why = map(name, size);
    if (!why.empty()) {
      reset();
      ::shm_unlink(name.c_str());
    }
    return why;
  }

  /// Opens an existing `name` and maps `size` bytes of it.
  std::string open(const std::string& name, std::size_t size) {
    fd_ = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
    if (fd_ < 0) return "shm_open(" + name + "): " + errno_text(errno);
    struct stat st {};
    std::string why;
    if (::fstat(fd_, &st) != 0)
      why = "fstat(" + name + "): " + errno_text(errno);
    else if (static_cast<std::size_t>(st.st_size) < size)
      why = name + " holds " + std::to_string(st.st_size) + " bytes, expected " + std::to_string(size);
    else
      why = map(name, size);
    if (!why.empty()) reset();
    return why;
  }

  /// Backs the `bytes` bytes at `offset` with pages now, so that touching them cannot fail
  /// later. The range must not be reserved yet (its bytes are compared with the free space).
  /// Returns an empty string on success, else why not, with what /dev/shm has free.
  std::string reserve(std::size_t offset, std::size_t bytes) {
    if (bytes == 0) return {};
    // Refuse up front when /dev/shm plainly lacks the room: a doomed posix_fallocate would
    // first take what is left from every other user of /dev/shm, then give it back.
    struct statvfs vfs {};
    if (::statvfs("/dev/shm", &vfs) == 0 && static_cast<std::size_t>(vfs.f_bavail) * vfs.f_frsize < bytes)
      return reserve_failure(bytes, "statvfs", ENOSPC);
    // In steps, so that a signal (EINTR: tmpfs undoes the interrupted call) costs one step's
    // work, not the whole reservation, and a steady stream of signals cannot stall it.
    constexpr std::size_t step = std::size_t{64} << 20;
    int interrupted = 0;
    for (std::size_t done = 0; done < bytes;) {
      const std::size_t n = std::min(step, bytes - done);
      const int e = ::posix_fallocate(fd_, static_cast<off_t>(offset + done), static_cast<off_t>(n));
      if (e == EINTR && ++interrupted < 1000) continue;
      if (e != 0) return reserve_failure(bytes, "posix_fallocate", e);
      done += n;
    }
    return {};
  }

  std::byte* base() const noexcept { return static_cast<std::byte*>(base_); }
  std::size_t size() const noexcept { return size_; }

 private:
  static std::string reserve_failure(std::size_t bytes, const char* how, int e) {
    std::string cause;
    switch (e) {
      case ENOSPC:
        cause = "/dev/shm is full (remove what fills it, or enlarge it, e.g. docker --shm-size)";
        break;
      case EFBIG:
        cause = "larger than a file may grow here (RLIMIT_FSIZE or the file system's limit)";
        break;
      case ENOMEM:
        cause = "out of memory (tmpfs pages count against this process's memory cgroup)";
        break;
      default:
        break;
    }
    return "cannot reserve " + shm_mib(bytes) + " (" + how + ": " + errno_text(e) + ")" +
           (cause.empty() ? "" : ": " + cause) + "; " + shm_space();
  }
  std::string map(const std::string& name, std::size_t size) {
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) return "mmap(" + name + ", " + std::to_string(size) + "): " + errno_text(errno);
    base_ = p;
    size_ = size;
    return {};
  }
  void reset() noexcept {
    if (base_ != nullptr) ::munmap(base_, size_);
    if (fd_ >= 0) ::close(fd_);
    base_ = nullptr;
    size_ = 0;
    fd_ = -1;
  }
  void* base_ = nullptr;
  std::size_t size_ = 0;
  int fd_ = -1;  ///< kept open to reserve more of the object after its name is gone
};

/// Arena bytes of a segment for `world` ranks when shm_options::segment_bytes is `asked`: that
/// many, or for 0 (automatic) a part per rank as large as /dev/shm itself, so that a rank's
/// buffers can fill /dev/shm before its part runs out. The object is sparse and only reserved
/// ranges hold pages, so the size costs address space, not memory: at most 2^44 bytes in all
/// (16 TiB of the 128 TiB a process can map), a quarter of RLIMIT_AS where one is set, and
/// within RLIMIT_FSIZE after the `before` bytes that precede the arena (a larger ftruncate
/// would raise SIGXFSZ).
struct shm_arena_size {
  std::size_t bytes = 0;   ///< the whole arena (world parts)
  const char* bound = "";  ///< what limited each part, for messages
};

/// The automatic arena (`asked` == 0): each rank's part as large as /dev/shm, within a quarter of
/// the address-space limit and within the file-size limit, whichever is least; `bound` says which.
inline shm_arena_size shm_arena(int world, std::size_t asked, std::size_t before) noexcept {
  if (asked != 0) return {asked, "shm_options::segment_bytes"};
  const std::size_t n = static_cast<std::size_t>(world < 1 ? 1 : world);
  std::size_t part = shm_capacity();
  const char* bound = "the size of /dev/shm";
  if (part == 0) {
    part = std::size_t{1} << 30;  // no statvfs: reservations still say when it is full
    bound = "1 GiB (the size of /dev/shm is unknown)";
  }
  part = round_up(part, shm_page);
  std::size_t space = std::size_t{1} << 44;
  const char* space_bound = "16 TiB of address space";
  struct rlimit lim {};
  if (::getrlimit(RLIMIT_AS, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur / 4 < space) {
    space = static_cast<std::size_t>(lim.rlim_cur) / 4;
    space_bound = "a quarter of the address-space limit (RLIMIT_AS, ulimit -v), shared by the ranks";
  }
  if (::getrlimit(RLIMIT_FSIZE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) {
    const auto fsize = static_cast<std::size_t>(lim.rlim_cur);
    if ((fsize > before ? fsize - before : 0) < space) {
      space = fsize > before ? fsize - before : 0;
      space_bound = "the file-size limit (RLIMIT_FSIZE, ulimit -f), shared by the ranks";
    }
  }
  const std::size_t by_space = std::max(shm_page, space / n / shm_page * shm_page);
  if (by_space < part) {
    part = by_space;
    bound = space_bound;
  }
  return {part * n, bound};
}

inline std::size_t shm_arena_bytes(int world, std::size_t asked, std::size_t before) noexcept {
  return shm_arena(world, asked, before).bytes;
}

/// First-fit heap over one rank's part of the arena. Only its owner allocates from a part, so
/// the bookkeeping stays in process memory (a crashed peer cannot corrupt it) and ranks never
/// coordinate. Blocks are 64-byte aligned and freed blocks coalesce with their neighbours.
class arena_heap {
 public:
  static constexpr std::size_t npos = ~std::size_t{0};
  arena_heap() = default;
  arena_heap(std::size_t begin, std::size_t end) {
    if (end > begin) free_[begin] = end - begin;
    capacity_ = end > begin ? end - begin : 0;
  }
  /// Offset of a block of at least `bytes`, or npos when no free block is large enough.
  std::size_t allocate(std::size_t bytes) {
    const std::size_t need = round_up(bytes == 0 ? 1 : bytes, shm_line);
    std::lock_guard lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < need) continue;
      const std::size_t off = it->first;
      const std::size_t rest = it->second - need;
      free_.erase(it);
      if (rest > 0) free_[off + need] = rest;
      used_ += need;
      return off;
    }
    return npos;
  }
  void deallocate(std::size_t off, std::size_t bytes) noexcept {
    const std::size_t len = round_up(bytes == 0 ? 1 : bytes, shm_line);
    std::lock_guard lock(mu_);
    used_ -= len;
    auto next = free_.lower_bound(off);
    std::size_t b = off, n = len;
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == off) {
        b = prev->first;
        n += prev->second;
        free_.erase(prev);
      }
    }
    if (next != free_.end() && off + len == next->first) {
      n += next->second;
      free_.erase(next);
    }
    free_[b] = n;
  }
  std::size_t largest_free() const {
    std::lock_guard lock(mu_);
    std::size_t m = 0;
    for (auto& [o, n] : free_) m = n > m ? n : m;
    return m;
  }
  std::size_t capacity() const noexcept { return capacity_; }
  std::size_t used() const {
    std::lock_guard lock(mu_);
    return used_;
  }

 private:
  mutable std::mutex mu_;
  std::map<std::size_t, std::size_t> free_;
  std::size_t capacity_ = 0;
  std::size_t used_ = 0;
};

/// False once `pid` has exited. A zombie (exited, not yet reaped by its parent) counts as gone:
/// kill(pid, 0) still succeeds on it.
inline bool process_alive(int pid) noexcept {
  if (pid <= 0) return true;  // not published yet
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return true;  // no /proc: trust kill()
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return true;
  buf[n] = '\0';
  // "pid (comm) S ...": the state follows the last ')' since comm may contain one.
  const char* rp = std::strrchr(buf, ')');
  if (rp == nullptr || rp[1] == '\0' || rp[2] == '\0') return true;
  return rp[2] != 'Z' && rp[2] != 'X';
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
