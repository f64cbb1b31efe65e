#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// Files a rank writes for people to read (the timeline, the flight recorder's dumps): one name
// per rank from one setting, and a whole-file write that a link planted at the name cannot
// redirect.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <string>
#include <string_view>

namespace ddp {
inline namespace v0 {
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

/// Writes `text` as the whole content of `path`; 0, or the errno of the step that failed. The
/// bytes go to `path.<pid>.tmp`, created with O_CREAT | O_EXCL | O_NOFOLLOW (so neither a link
/// nor a file someone placed there is written through), then renamed onto `path`: rename
/// replaces a link at `path` itself, never the file it points to, and a reader sees the old
/// file or the new one, never half of one. Only write(2) and friends: no allocation beyond the
/// temporary's name.
inline int replace_file(const std::string& path, std::string_view text) noexcept {
  std::string tmp;
  try {
    tmp = path + "." + std::to_string(::getpid()) + ".tmp";
  } catch (...) {
    return ENOMEM;
  }
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0 && errno == EEXIST) {
    // Left by an earlier write of this process id that did not finish; ours to replace only if
    // it is a plain file of our own (unlink removes a link itself, not its target).
    struct stat st {};
    if (::lstat(tmp.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid() && ::unlink(tmp.c_str()) == 0)
      fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    else
      errno = EEXIST;
  }
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
}  // namespace v0
}  // namespace ddp
