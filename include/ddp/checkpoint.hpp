#pragma once
/// \file checkpoint.hpp
/// Checkpoints of a data-parallel model: `ddp::save_checkpoint` writes the parameter values
/// (and a blob of the caller's: optimizer state, step) on rank 0, atomically;
/// `ddp::load_checkpoint` reads them on rank 0 and hands them to every rank, so the ranks'
/// hosts need not share a file system. Both are collective, and a failure on any rank is an
/// error on every rank. The file format is in ddp/data_parallel/detail/checkpoint.hpp; see
/// docs/training-loop.md.
///
/// \code
/// ddp::save_checkpoint(pg, "run/ckpt.ddp", params, std::as_bytes(std::span{&step, 1}));
/// auto blob = ddp::load_checkpoint(pg, "run/ckpt.ddp", params);
/// \endcode

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include <ddp/version.hpp>
#include <ddp/clock.hpp>
#include <ddp/detail/bytes.hpp>
#include <ddp/data_parallel/detail/checkpoint.hpp>
#include <ddp/detail/consensus.hpp>
#include <ddp/detail/fd.hpp>
#include <ddp/detail/output_file.hpp>
#include <ddp/dtype.hpp>
#include <ddp/error.hpp>
#include <ddp/parameter.hpp>
#include <ddp/process_group.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Saves the values of `params` (names, dtypes, shapes and bytes; gradients are not saved), its
/// buffers and frozen parameters when it has them (`ddp::has_buffers`, e.g. `torch_parameters`), and
/// the caller's `extra` bytes to `path`, written by rank 0 alone. The file appears whole or not
/// at all: rank 0 writes a temporary beside it (`<path>.<16 random hex digits>.tmp`, created
/// exclusively, owner-only: mode 0600, so the checkpoint is too; chmod it to share it), fsyncs
/// it, renames it over `path` (replacing a link there, never writing through it) and fsyncs the
/// directory. Collective: every rank returns once rank 0 has succeeded, and a failure on rank 0
/// (a missing directory, a full disk, a parameter in device memory) is raised on every rank,
/// naming rank 0, the file and the errno (errc::system; errc::unsupported for a device
/// parameter). Bounded by `until` (the group's timeout by default): writing a large
/// checkpoint to a slow disk may need a later deadline.
///
/// \code
/// const std::int64_t step = 1000;
/// ddp::save_checkpoint(pg, "ckpt.ddp", params, std::as_bytes(std::span{&step, 1}));
/// \endcode
template <parameter_set P>
void save_checkpoint(process_group& pg, const std::filesystem::path& path, const P& params,
                     std::span<const std::byte> extra, deadline_t until) {
  namespace ck = detail::ckpt;
  group_failure v;
  if (pg.rank() == 0) {
    const std::string file = path.string();
    const std::string who = "save_checkpoint('" + file + "'): rank 0 ";
    std::string tmp;
    bool created = false;
    const auto fail = [&](errc code, const std::string& why, int parameter = -1) {
      if (created) ::unlink(tmp.c_str());
      v = {code, who + why, parameter, pg.rank()};
    };
    try {
      const auto views = to_state_views(params);
      std::vector<ck::entry> entries;
      std::uint64_t data_bytes = 0;
      for (std::size_t i = 0; i < views.size() && v.empty(); ++i) {
        const auto& t = views[i];
        if (t.device >= 0)
          fail(errc::unsupported,
               "cannot save " + ck::label(i, t.name) + ": it is in CUDA device " + std::to_string(t.device) +
                   "'s memory; copy the parameters to host memory and save those",
               static_cast<int>(i));
        entries.push_back({std::string(t.name), t.type, t.shape, t.numel});
        data_bytes += t.bytes();
      }
      if (std::endian::native != std::endian::little && v.empty())
        fail(errc::unsupported, "cannot save on a big-endian host (the format stores little-endian values)");
      if (v.empty()) {
        const std::string table = ck::encode_table(entries);
        const std::string head = ck::encode_header({entries.size(), table.size(), data_bytes, extra.size()});
        // A temporary nobody can plant or guess (owner-only, O_EXCL | O_NOFOLLOW), renamed
        // over the name at the end: what another user put at either name is never written.
        detail::fd_handle fd(detail::create_temp_beside(file, tmp));
        if (fd.get() < 0) {
          fail(errc::system, "could not create a temporary file beside '" + file + "': " + detail::errno_text(errno));
        } else {
          created = true;
          ck::xxh64 sum;
          int e = 0;
          const auto put = [&](const void* p, std::size_t n) {
            if (e != 0) return;
            sum.update(p, n);
            e = ck::write_all(fd.get(), p, n);
          };
          put(head.data(), head.size());
          put(table.data(), table.size());
          for (const auto& t : views) put(t.data, t.bytes());
          put(extra.data(), extra.size());
          std::string trailer;
          detail::put_u64(trailer, sum.digest());
          if (e == 0) e = ck::write_all(fd.get(), trailer.data(), trailer.size());
          if (e != 0) {
            fail(errc::system, "could not write '" + tmp + "': " + detail::errno_text(e));
          } else if (::fsync(fd.get()) != 0) {
            fail(errc::system, "could not fsync '" + tmp + "': " + detail::errno_text(errno));
          } else if (const int ce = fd.reset(); ce != 0) {
            fail(errc::system, "could not close '" + tmp + "': " + detail::errno_text(ce));
          } else if (::rename(tmp.c_str(), file.c_str()) != 0) {
            const int e = errno;
            fail(errc::system,
                 "could not rename '" + tmp + "' to '" + file + "': " + detail::errno_text(e) +
                     (e == EPERM || e == EACCES || e == EISDIR ? " (" + detail::found_at(file) + " is there)"
                                                               : std::string()));
          } else {
            created = false;
            // The rename lasts only once the directory is on disk too. File systems that
            // cannot fsync a directory say EINVAL; there is nothing more to do on those.
            const auto parent = path.parent_path();
            detail::fd_handle dir(::open(parent.empty() ? "." : parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
            if (dir.get() >= 0 && ::fsync(dir.get()) != 0 && errno != EINVAL)
              fail(errc::system, "could not fsync the directory of '" + file + "': " + detail::errno_text(errno));
          }
        }
      }
    } catch (const error& e) {
      fail(e.condition(), std::string(e.message()), e.parameter());
    } catch (const std::exception& e) {
      fail(errc::system, e.what());
    }
  }
  detail::settle(pg, v, until);
}

template <parameter_set P>
void save_checkpoint(process_group& pg, const std::filesystem::path& path, const P& params,
                     std::span<const std::byte> extra = {}) {
  save_checkpoint(pg, path, params, extra, pg.deadline());
}

/// Loads a checkpoint that save_checkpoint wrote into `params` on every rank, and returns the
/// caller's bytes saved with it. Rank 0 reads the file and broadcasts it: only rank 0 needs
/// to see it. Collective; bounded by `until` (the group's timeout by default).
///
/// Nothing in the file is trusted: its size must be what its header says, every record of its
/// table is bounds-checked, and its XXH64 checksum must match before any parameter is written.
/// On any failure no rank's parameters change, and every rank raises the same error:
/// errc::system (the file cannot be opened or read: the message names rank 0, the path and the
/// errno), errc::invalid_argument (not a ddp checkpoint, another version, truncated, corrupt),
/// errc::mismatch (the file's parameters differ from a rank's in count, name, dtype or shape;
/// the message names the first differing parameter and the rank, `error::parameter()` holds
/// its index), errc::unsupported (a parameter in device memory).
///
/// Rank 0 holds the file's data once more in memory while it loads.
///
/// \code
/// std::vector<std::byte> blob = ddp::load_checkpoint(pg, "ckpt.ddp", params);
/// std::int64_t step = 0;
/// std::memcpy(&step, blob.data(), sizeof step);
/// \endcode
template <parameter_set P>
std::vector<std::byte> load_checkpoint(process_group& pg, const std::filesystem::path& path, const P& params,
                                       deadline_t until) {
  namespace ck = detail::ckpt;
  const int rank = pg.rank();
  const std::string file = path.string();
  const std::string who = "load_checkpoint('" + file + "'): rank " + std::to_string(rank) + " ";
  // 1. Every rank describes its parameters; rank 0 reads the file's header and table.
  group_failure v;
  const auto fail = [&](errc code, const std::string& why, int parameter = -1) {
    if (v.empty()) v = {code, who + why, parameter, pg.rank()};
  };
  std::vector<tensor_view> views;
  std::vector<ck::entry> mine;
  detail::fd_handle fd;
  std::string meta;  // u64 file size, the header, the table: what rank 0 hands every rank
  try {
    views = to_state_views(params);
    for (std::size_t i = 0; i < views.size(); ++i) {
      const auto& t = views[i];
      if (t.device >= 0)
        fail(errc::unsupported,
             "cannot load " + ck::label(i, t.name) + ": it is in CUDA device " + std::to_string(t.device) +
                 "'s memory; load into host memory and copy it there",
             static_cast<int>(i));
      mine.push_back({std::string(t.name), t.type, t.shape, t.numel});
    }
    if (std::endian::native != std::endian::little)
      fail(errc::unsupported, "cannot load on a big-endian host (the format stores little-endian values)");
    if (rank == 0 && v.empty()) {
      // O_NONBLOCK: a FIFO (or a device) at the name opens at once and is refused below,
      // instead of blocking this rank, and with it every rank, for ever.
      fd.reset(::open(file.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
      struct stat st {};
      if (fd.get() < 0) {
        fail(errc::system, "could not open '" + file + "': " + detail::errno_text(errno));
      } else if (::fstat(fd.get(), &st) != 0) {
        fail(errc::system, "could not stat '" + file + "': " + detail::errno_text(errno));
      } else if (!S_ISREG(st.st_mode)) {
        fail(errc::invalid_argument, "'" + file + "' is not a regular file (it is " + detail::describe_file(st) + ")");
      } else if (::fcntl(fd.get(), F_SETFL, ::fcntl(fd.get(), F_GETFL) & ~O_NONBLOCK) != 0) {
        fail(errc::system, "could not read '" + file + "': " + detail::errno_text(errno));
      } else {
        const auto size = static_cast<std::uint64_t>(st.st_size);
        std::string head(ck::header_bytes, '\0');
        ck::header h;
        std::string why;
        if (size >= ck::header_bytes) {
          if (const int e = ck::read_exact(fd.get(), head.data(), head.size()); e != 0)
            why = e == ENODATA ? "the file ended early (truncated while read?)" : detail::errno_text(e);
        }
        if (why.empty()) why = ck::decode_header(head, size, h);
        // The table's size against this model's before it is read: a hostile file's table
        // (up to max_table_bytes) is never allocated, nor broadcast to the other ranks.
        std::string other_model;
        if (why.empty()) other_model = ck::table_fits_model(h, mine, rank);
        std::string table;
        if (!other_model.empty()) {
          fail(errc::mismatch, "finds another model in the file: " + other_model);
        } else if (why.empty()) {
          table.resize(static_cast<std::size_t>(h.table));  // at most max_table_bytes, and within the file
          if (const int e = ck::read_exact(fd.get(), table.data(), table.size()); e != 0)
            why = e == ENODATA ? "the file ended early (truncated while read?)" : detail::errno_text(e);
        }
        if (why.empty() && other_model.empty()) {
          std::vector<ck::entry> entries;
          why = ck::decode_table(table, h, entries);
        }
        if (!other_model.empty()) {
          // already failed: another model
        } else if (why.empty()) {
          detail::put_u64(meta, size);
          meta += head;
          meta += table;
        } else {
          fail(errc::invalid_argument, "read '" + file + "': " + why);
        }
      }
    }
  } catch (const error& e) {
    fail(e.condition(), std::string(e.message()), e.parameter());
  } catch (const std::exception& e) {
    fail(errc::system, e.what());
  }
  detail::settle(pg, v, until);

  // 2. Every rank gets the table and compares it with its own parameters; rank 0 reads the
  // data and checks the checksum.
  detail::broadcast_blob([&](std::span<std::byte> b) { pg.broadcast(b, 0, until); }, meta, rank, 0,
                         8 + ck::header_bytes, 8 + ck::header_bytes + ck::max_table_bytes, "load_checkpoint's table");
  ck::header h;
  std::vector<ck::entry> in_file;
  std::string why =
      ck::decode_header(std::string_view(meta).substr(8, ck::header_bytes), detail::get_u64(meta.data()), h);
  if (why.empty()) why = ck::decode_table(std::string_view(meta).substr(8 + ck::header_bytes), h, in_file);
  std::string data;
  std::vector<std::byte> extra;
  try {
    int index = -1;
    if (!why.empty()) {
      fail(errc::protocol, "got a malformed table from rank 0: " + why);  // rank 0 checked it
    } else if (auto diff = ck::first_difference(in_file, mine, rank, index); !diff.empty()) {
      fail(errc::mismatch, "finds another model in the file: " + diff, index);
    } else if (rank == 0) {
      data.resize(static_cast<std::size_t>(h.data));  // the size of rank 0's parameters
      extra.resize(static_cast<std::size_t>(h.extra));
      std::string trailer(ck::trailer_bytes, '\0');
      int e = ck::read_exact(fd.get(), data.data(), data.size());
      if (e == 0 && !extra.empty()) e = ck::read_exact(fd.get(), extra.data(), extra.size());
      if (e == 0) e = ck::read_exact(fd.get(), trailer.data(), trailer.size());
      if (e != 0) {
        fail(errc::invalid_argument,
             "read '" + file +
                 "': " + (e == ENODATA ? "the file ended early (truncated while read?)" : detail::errno_text(e)));
      } else {
        ck::xxh64 sum;
        sum.update(std::string_view(meta).substr(8));
        sum.update(data);
        sum.update(extra.data(), extra.size());
        const std::uint64_t stored = detail::get_u64(trailer.data()), computed = sum.digest();
        if (stored != computed) {
          char hex[64];
          std::snprintf(hex, sizeof hex, "stored %016llx, computed %016llx", static_cast<unsigned long long>(stored),
                        static_cast<unsigned long long>(computed));
          fail(errc::invalid_argument, "read '" + file + "': checksum mismatch, the file is corrupt (" + hex + ")");
        }
      }
    }
  } catch (const std::exception& e) {
    fail(errc::system, e.what());  // out of memory for the data
  }
  fd.reset();
  detail::settle(pg, v, until);

  // 3. The values, from rank 0 straight into every rank's parameters; then the blob.
  std::size_t at = 0;
  for (const auto& t : views) {
    if (rank == 0 && t.bytes() > 0) std::memcpy(t.data, data.data() + at, t.bytes());
    at += t.bytes();
    pg.broadcast(std::span(static_cast<std::byte*>(t.data), t.bytes()), 0, until);
  }
  extra.resize(static_cast<std::size_t>(h.extra));
  pg.broadcast(std::span(extra.data(), extra.size()), 0, until);
  return extra;
}

template <parameter_set P>
std::vector<std::byte> load_checkpoint(process_group& pg, const std::filesystem::path& path, const P& params) {
  return load_checkpoint(pg, path, params, pg.deadline());
}

}  // namespace DDP_ABI
}  // namespace ddp
