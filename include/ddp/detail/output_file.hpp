#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// Files ddp writes (the timeline, the flight recorder's dumps, checkpoints): one name per rank
// from one setting, temporaries nobody can plant or guess, whole-file writes that a link planted
// at the name cannot redirect, and in-place opens that refuse what another user planted.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ddp/detail/random.hpp>

#include <cerrno>
#include <cstddef>
#include <string>
#include <string_view>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

/// The file of rank `rank` for the setting `base`: `{rank}` in `base` is replaced by the rank; a
/// `base` without it gets `.rank<r>.json` appended. `instance` > 0 puts `.<instance>` before a
/// final `.json` (or at the end), for a second writer of one process (ddp::timeline_file).
inline std::string rank_file(std::string_view base, int rank, unsigned instance = 0) {
  std::string name;
  const std::string r = std::to_string(rank);
  constexpr std::string_view key = "{rank}";
  if (base.find(key) == std::string_view::npos) {
    name = std::string(base) + ".rank" + r + ".json";
  } else {
    for (std::size_t i = 0; i < base.size();) {
      if (base.substr(i, key.size()) == key) {
        name += r;
        i += key.size();
      } else {
        name += base[i++];
      }
    }
  }
  if (instance == 0) return name;
  const std::string suffix = "." + std::to_string(instance);
  constexpr std::string_view ext = ".json";
  if (name.size() > ext.size() && std::string_view(name).substr(name.size() - ext.size()) == ext)
    return name.insert(name.size() - ext.size(), suffix);
  return name + suffix;
}

/// What `st` describes, for messages: "a symbolic link", "a FIFO", "a socket", "a device", "a
/// directory", "a file of uid U" (another user's), "a file with N hard links", or "a file".
inline std::string describe_file(const struct stat& st) {
  if (S_ISLNK(st.st_mode)) return "a symbolic link";
  if (S_ISFIFO(st.st_mode)) return "a FIFO";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) return "a device";
  if (S_ISDIR(st.st_mode)) return "a directory";
  if (st.st_uid != ::geteuid()) return "a file of uid " + std::to_string(st.st_uid);
  if (st.st_nlink != 1) return "a file with " + std::to_string(st.st_nlink) + " hard links";
  return "a file";
}

/// What is at `path` (lstat, not following a link), as describe_file says it, or "nothing".
inline std::string found_at(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) != 0 ? "nothing" : describe_file(st);
}

/// Creates a new file beside `path` that nothing planted can be: `path.<16 hex digits>.tmp`,
/// the digits from the kernel's random source, opened O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW
/// with `mode` (owner-only by default), so neither a link nor a file another user placed there
/// is written through or reused; a name that is taken is stepped around (another draw, up to 8).
/// Returns the descriptor and sets `name`, or -1 with errno. No allocation beyond the name.
inline int create_temp_beside(const std::string& path, std::string& name, mode_t mode = 0600) noexcept {
  for (int attempt = 0; attempt < 8; ++attempt) {
    char hex[17];
    const unsigned long long r = random_u64();
    for (int k = 0; k < 16; ++k) hex[k] = "0123456789abcdef"[(r >> (60 - 4 * k)) & 0xf];
    hex[16] = '\0';
    try {
      name = path + "." + hex + ".tmp";
    } catch (...) {
      errno = ENOMEM;
      return -1;
    }
    const int fd = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  errno = EEXIST;
  return -1;
}

/// Opens `path` for writing in place (a trace that grows while it is written), refusing what
/// another user may have planted there: a symbolic link (O_NOFOLLOW), a FIFO, socket or device
/// (O_NONBLOCK, so a FIFO never blocks, and a type check on the opened descriptor), a file of
/// another user or one with other hard links. A missing file is created with `mode` (owner-only
/// by default). The descriptor, or -1 with errno set and `why` saying what is there.
inline int open_own_file(const std::string& path, std::string& why, mode_t mode = 0600) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, mode);
  if (fd < 0) {
    const int e = errno;
    why = e == ELOOP || e == ENXIO || e == EACCES || e == EPERM || e == EISDIR ? found_at(path) + " is there"
                                                                               : std::string();
    errno = e;
    return -1;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    errno = e;
    return -1;
  }
  if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || st.st_nlink != 1) {
    why = describe_file(st) + " is there";
    ::close(fd);
    errno = EEXIST;
    return -1;
  }
  return fd;
}

/// Writes `text` as the whole content of `path`; 0, or the errno of the step that failed. The
/// bytes go to a temporary beside it (create_temp_beside: an unguessable name, never a planted
/// link or file, owner-only), then renamed onto `path`: rename replaces a link at `path`
/// itself, never the file it points to, and a reader sees the old file or the new one, never
/// half of one. Only write(2) and friends: no allocation beyond the temporary's name.
inline int replace_file(const std::string& path, std::string_view text) noexcept {
  std::string tmp;
  const int fd = create_temp_beside(path, tmp);
  if (fd < 0) return errno;
  int err = 0;
  for (std::size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : EIO;
      break;
    }
    done += static_cast<std::size_t>(n);
  }
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) ::unlink(tmp.c_str());
  return err;
}

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
