// save_checkpoint / load_checkpoint over real processes: rank 0 writes and reads, every rank
// gets the values, and every failure is the same error on every rank.
#include <ddp/checkpoint.hpp>

#include <doctest/doctest.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness.hpp"
#include "toy_model.hpp"

using namespace std::chrono_literals;
using ddp_test::free_port;
using ddp_test::group_options;
using ddp_test::run_ranks;
using ddp_test::expect_ok;
using ddp_test::local_group;
using ddp_test::on_ranks;
namespace fs = std::filesystem;

namespace {
using ddp_test::require;

/// A small model of mixed dtypes, one empty parameter among them; `variant` changes its layout.
struct model : ddp_test::toy_model {
  explicit model(const std::string& variant = "") {
    add(24, ddp::dtype::f32, {4, 6}, variant == "name" ? "fc1.W" : "fc1.weight");
    add(6, ddp::dtype::f64, variant == "shape" ? std::vector<std::int64_t>{3, 2} : std::vector<std::int64_t>{6},
        "fc1.bias");
    add(3, ddp::dtype::i64, {3}, "counts").add(10, ddp::dtype::bf16, {2, 5}, "emb");
    add(0, ddp::dtype::f32, {0}, "empty");
    if (variant == "extra") add(2, ddp::dtype::f32, {2}, "head");
  }

  void fill(double seed) {
    const auto w = data<float>(0);
    const auto b = data<double>(1);
    const auto k = data<std::int64_t>(2);
    const auto e = data<ddp::bfloat16>(3);
    for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(seed + 0.1 * static_cast<double>(i));
    for (std::size_t i = 0; i < b.size(); ++i) b[i] = seed / 3.0 + static_cast<double>(i);
    for (std::size_t i = 0; i < k.size(); ++i)
      k[i] = static_cast<std::int64_t>(seed * 1000) + static_cast<std::int64_t>(i);
    for (std::size_t i = 0; i < e.size(); ++i) e[i] = ddp::bfloat16(static_cast<float>(seed) - static_cast<float>(i));
  }
};

std::string blob_string(const std::vector<std::byte>& b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}
std::span<const std::byte> bytes_of(const std::string& s) { return std::as_bytes(std::span(s.data(), s.size())); }

using ddp_test::read_file;
using ddp_test::temp_dir;
using ddp_test::write_file;

/// Saves a model filled with seed 1.0 (rank 0's values; the others' differ) from a group of 1.
std::string valid_file(const fs::path& p, const std::string& extra) {
  auto outs = on_ranks(1, local_group{20s}, [&](ddp::process_group& pg) {
    model m;
    m.fill(1.0);
    ddp::save_checkpoint(pg, p, m.views, bytes_of(extra));
  });
  REQUIRE(ddp_test::all_ok(outs));
  return read_file(p);
}

/// Runs load_checkpoint on `n` ranks, expecting every rank to fail with `code` and a message
/// holding `text`, its parameters untouched; `setup` chooses each rank's model and path.
void expect_load_failure(int n, const fs::path& path, ddp::errc code, const std::string& text,
                         const std::function<std::string(int)>& variant = {}, int parameter = -1) {
  auto outs = on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
    model m(variant ? variant(r) : "");
    m.fill(7.0 + r);
    const auto before = m.data_bytes();
    try {
      (void)ddp::load_checkpoint(pg, path, m.views);
    } catch (const ddp::error& e) {
      require(m.data_bytes() == before, "a failed load changed rank " + std::to_string(r) + "'s parameters");
      require(e.parameter() == parameter, "error::parameter() is " + std::to_string(e.parameter()));
      throw;
    }
  });
  INFO(ddp_test::summary(outs));
  for (const auto& o : outs) {
    CAPTURE(o.rank);
    CHECK(o.exit_code == 1);
    CHECK(o.errc == static_cast<int>(code));
    CHECK(o.message.find(text) != std::string::npos);
  }
}
}  // namespace

TEST_CASE("save on rank 0, load on every rank: values, shapes and the caller's blob come back, on 2 and 3 processes") {
  for (int n : {2, 3}) {
    CAPTURE(n);
    temp_dir dir;
    const auto path = dir.path / "ckpt.ddp";
    expect_ok(on_ranks(n, local_group{20s}, [&](int r, ddp::process_group& pg) {
      model m;
      m.fill(1.0 + r);  // every rank differs; rank 0's values are saved
      const std::int64_t step = 4200 + r;
      ddp::save_checkpoint(pg, path, m.views, std::as_bytes(std::span{&step, 1}));
      // The file is there, whole, when save returns on any rank; no temporary is left.
      require(fs::is_regular_file(path), "no checkpoint after save returned");
      for (const auto& f : fs::directory_iterator(dir.path))
        require(f.path() == path, "left behind: " + f.path().string());
      model zero;
      zero.fill(1.0);
      const auto saved = zero.data_bytes();  // what rank 0 saved
      m.fill(-5.0 - r);
      pg.barrier();  // nobody saves again before everybody has looked
      // Hosts need not share a file system: only rank 0 opens the path.
      const fs::path where = r == 0 ? path : fs::path("/nonexistent/ckpt.ddp");
      const auto blob = ddp::load_checkpoint(pg, where, m.views);
      require(m.data_bytes() == saved, "rank " + std::to_string(r) + " did not get rank 0's values");
      std::int64_t got = 0;
      require(blob.size() == sizeof got, "blob size " + std::to_string(blob.size()));
      std::memcpy(&got, blob.data(), sizeof got);
      require(got == 4200, "blob holds " + std::to_string(got));
      // Saving over an existing checkpoint replaces it; an empty blob comes back empty.
      m.fill(3.0 + r);
      ddp::save_checkpoint(pg, path, m.views);
      m.fill(0.0);
      require(ddp::load_checkpoint(pg, path, m.views).empty(), "empty blob");
      model three;
      three.fill(3.0);
      require(m.data_bytes() == three.data_bytes(), "second checkpoint's values");
    }));
  }
}

TEST_CASE("a model that differs from the file's is errc::mismatch on every rank, naming the parameter and the rank") {
  temp_dir dir;
  const auto path = dir.path / "ckpt.ddp";
  valid_file(path, "");
  expect_load_failure(
      3, path, ddp::errc::mismatch,
      "load_checkpoint('" + path.string() +
          "'): rank 1 finds another model in the file: parameter 1 ('fc1.bias') differs: the file has 'fc1.bias' "
          "f64[6], rank 1 has 'fc1.bias' f64[3, 2]",
      [](int r) { return r == 1 ? "shape" : ""; }, 1);
  expect_load_failure(
      3, path, ddp::errc::mismatch,
      "rank 0 finds another model in the file: parameter 0 ('fc1.W') differs: the file has 'fc1.weight' f32[4, 6], "
      "rank 0 has 'fc1.W' f32[4, 6]",
      [](int r) { return r == 0 ? "name" : ""; }, 0);
  expect_load_failure(
      3, path, ddp::errc::mismatch,
      "rank 2 finds another model in the file: the file has 5 parameters, rank 2 has 6: parameter 5 ('head') f32[2] "
      "is not in the file",
      [](int r) { return r == 2 ? "extra" : ""; }, 5);
}

TEST_CASE("a missing, foreign, truncated or corrupt file is the same clear error on every rank") {
  temp_dir dir;
  const auto good = dir.path / "good.ddp";
  const std::string file = valid_file(good, "optimizer state");
  const auto p = dir.path / "bad.ddp";
  expect_load_failure(3, dir.path / "missing.ddp", ddp::errc::system,
                      "load_checkpoint('" + (dir.path / "missing.ddp").string() + "'): rank 0 could not open '" +
                          (dir.path / "missing.ddp").string() + "': No such file or directory (errno 2)");
  write_file(p, "PK\3\4 this is a zip file, not a checkpoint, and it is long enough to have a header");
  expect_load_failure(2, p, ddp::errc::invalid_argument, "rank 0 read '" + p.string() + "': not a ddp checkpoint (wrong magic bytes)");
  write_file(p, file.substr(0, file.size() - 1));
  expect_load_failure(2, p, ddp::errc::invalid_argument, "sizes do not add up");
  std::string v2 = file;
  v2[8] = 2;
  write_file(p, v2);
  expect_load_failure(2, p, ddp::errc::invalid_argument, "checkpoint format version 2; this ddp reads version 1");
  std::string flipped = file;
  flipped[file.size() - 20] = static_cast<char>(flipped[file.size() - 20] ^ 0x10);  // in the blob
  write_file(p, flipped);
  expect_load_failure(2, p, ddp::errc::invalid_argument, "checksum mismatch, the file is corrupt (stored ");
  expect_load_failure(2, dir.path, ddp::errc::invalid_argument, "is not a regular file");
}

TEST_CASE("every truncation and every corrupted byte of a valid file is refused, the parameters untouched") {
  temp_dir dir;
  const auto good = dir.path / "good.ddp";
  const std::string file = valid_file(good, "blob");
  const auto p = dir.path / "bad.ddp";
  expect_ok(on_ranks(1, local_group{20s}, [&](ddp::process_group& pg) {
    model m;
    m.fill(9.0);
    const auto before = m.data_bytes();
    const auto refused = [&](const std::string& content, const std::string& what) {
      write_file(p, content);
      try {
        (void)ddp::load_checkpoint(pg, p, m.views);
      } catch (const ddp::error& e) {
        require(e.condition() == ddp::errc::invalid_argument || e.condition() == ddp::errc::mismatch,
                what + ": " + e.what());
        require(m.data_bytes() == before, what + ": parameters changed");
        return;
      }
      throw std::runtime_error(what + ": accepted");
    };
    for (std::size_t len = 0; len < file.size(); ++len) refused(file.substr(0, len), "truncated to " + std::to_string(len));
    for (std::size_t at = 0; at < file.size(); ++at)
      for (unsigned char x : {0x01, 0xff}) {
        std::string bad = file;
        bad[at] = static_cast<char>(bad[at] ^ static_cast<char>(x));
        refused(bad, "byte " + std::to_string(at) + " ^ " + std::to_string(x));
      }
    std::string longer = file + "x";
    refused(longer, "one byte appended");
    // The valid file still loads.
    require(blob_string(ddp::load_checkpoint(pg, good, m.views)) == "blob", "valid file");
  }, 120s));
}

TEST_CASE("a save that fails on rank 0 is an error on every rank, naming rank 0, the file and the errno") {
  temp_dir dir;
  const auto path = dir.path / "no" / "such" / "dir" / "ckpt.ddp";
  auto outs = on_ranks(3, local_group{20s}, [&](ddp::process_group& pg) {
    model m;
    ddp::save_checkpoint(pg, path, m.views);
  });
  INFO(ddp_test::summary(outs));
  for (const auto& o : outs) {
    CAPTURE(o.rank);
    CHECK(o.exit_code == 1);
    CHECK(o.errc == static_cast<int>(ddp::errc::system));
    CHECK(o.message.find("[ddp.system] rank " + std::to_string(o.rank) + ": save_checkpoint('" + path.string() +
                         "'): rank 0 could not create a temporary file beside '" + path.string() + "'") !=
          std::string::npos);
    CHECK(o.message.find("': No such file or directory (errno 2)") != std::string::npos);
  }
  CHECK_FALSE(fs::exists(dir.path / "no"));
}

TEST_CASE("parameters in device memory are errc::unsupported on every rank, for save and load") {
  temp_dir dir;
  const auto path = dir.path / "ckpt.ddp";
  valid_file(path, "");
  for (bool save : {true, false}) {
    CAPTURE(save);
    auto outs = on_ranks(2, local_group{20s}, [&](ddp::process_group& pg) {
      model m;
      m.views[3].device = 0;  // never touched: refused before any copy
      if (save) ddp::save_checkpoint(pg, dir.path / "gpu.ddp", m.views);
      else (void)ddp::load_checkpoint(pg, path, m.views);
    });
    INFO(ddp_test::summary(outs));
    for (const auto& o : outs) {
      CHECK(o.errc == static_cast<int>(ddp::errc::unsupported));
      CHECK(o.message.find("rank 0 cannot " + std::string(save ? "save" : "load") +
                           " parameter 3 ('emb'): it is in CUDA device 0's memory") != std::string::npos);
    }
    CHECK_FALSE(fs::exists(dir.path / "gpu.ddp"));
  }
}

// ---- names and files another local user can plant (docs/security.md) ----------------------

TEST_CASE("hardening: links and files planted at a save's names are never written through; the checkpoint is owner-only") {
  temp_dir dir;
  const auto path = dir.path / "ckpt.ddp";
  const auto victim = dir.path / "victim", victim2 = dir.path / "victim2", planted = dir.path / "planted";
  write_file(victim, "precious");
  write_file(victim2, "precious too");
  // A link at the final name: rename replaces the link itself.
  fs::create_symlink(victim2, path);
  const bool root = ::geteuid() == 0;
  auto outs = on_ranks(2, local_group{20s}, [&](int r, ddp::process_group& pg) {
    if (r == 0) {
      // The temporary's name of the previous release, guessable from the pid: a link to the
      // victim, and (as root) a file of another user that was writable by everyone.
      const std::string old_tmp = path.string() + ".tmp." + std::to_string(::getpid());
      fs::create_symlink(victim, old_tmp);
      const std::string old_tmp2 = path.string() + "." + std::to_string(::getpid()) + ".tmp";
      write_file(old_tmp2, "someone else's");
      require(::chmod(old_tmp2.c_str(), 0666) == 0 && (!root || ::chown(old_tmp2.c_str(), 65534, 65534) == 0), "chown");
      fs::copy_file(old_tmp2, planted);
    }
    pg.barrier();
    model m;
    m.fill(3.0);
    ddp::save_checkpoint(pg, path, m.views, bytes_of("step 9"));
    model back;
    require(blob_string(ddp::load_checkpoint(pg, path, back.views)) == "step 9", "blob");
    require(back.data_bytes() == m.data_bytes(), "values");
  });
  INFO(ddp_test::summary(outs));
  REQUIRE(ddp_test::all_ok(outs));
  CHECK(read_file(victim) == "precious");
  CHECK(read_file(victim2) == "precious too");
  struct stat st {};
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  CHECK(S_ISREG(st.st_mode));
  CHECK((st.st_mode & 0777) == 0600);
  CHECK(st.st_uid == ::geteuid());
  // Nothing was left beside it but what was planted; the planted file is as it was.
  int temporaries = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) {
    const auto name = e.path().filename().string();
    if (name.rfind("ckpt.ddp.", 0) != 0) continue;
    ++temporaries;
    if (fs::is_regular_file(fs::symlink_status(e.path()))) CHECK(read_file(e.path()) == read_file(planted));
  }
  CHECK(temporaries == 2);
}

TEST_CASE("hardening: load_checkpoint on a FIFO is errc::invalid_argument on every rank at once") {
  temp_dir dir;
  const auto fifo = dir.path / "ckpt.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto outs = on_ranks(2, local_group{20s}, [&](ddp::process_group& pg) {
    model m;
    (void)ddp::load_checkpoint(pg, fifo, m.views);
  }, 30s);
  INFO(ddp_test::summary(outs));
  for (const auto& o : outs) {
    CAPTURE(o.rank);
    CHECK(o.errc == static_cast<int>(ddp::errc::invalid_argument));
    CHECK(o.message.find("'" + fifo.string() + "' is not a regular file (it is a FIFO)") != std::string::npos);
    CHECK(o.seconds < 10.0);  // the group's timeout is 20 s; before, rank 0 blocked in open() for ever
  }
}

TEST_CASE("hardening: a hostile table of two million records costs no rank more memory than a valid file") {
  temp_dir dir;
  const auto path = dir.path / "hostile.ddp";
  // Minimal records (an empty name, f32, no dimensions: one element each), consistent sizes and
  // a header that passes every check: only the model tells it apart. Written in pieces, so that
  // this process (whose memory the ranks inherit) stays small.
  constexpr std::uint64_t records = 2'000'000, record_bytes = 4 + 4 + 4 + 8;
  {
    std::string head = valid_file(dir.path / "valid.ddp", "").substr(0, 16);  // magic, version, flags
    std::ofstream out(path, std::ios::binary);
    auto u64 = [](std::string& s, std::uint64_t v) {
      for (int k = 0; k < 8; ++k) s += static_cast<char>((v >> (8 * k)) & 0xff);
    };
    u64(head, records);
    u64(head, records * record_bytes);
    u64(head, records * 4);
    u64(head, 0);
    out.write(head.data(), static_cast<std::streamsize>(head.size()));
    std::string rec(record_bytes, '\0');
    rec[4] = static_cast<char>(ddp::dtype::f32);
    rec[12] = 1;  // numel 1
    std::string chunk;
    for (int k = 0; k < 4096; ++k) chunk += rec;
    for (std::uint64_t i = 0; i < records; i += 4096)
      out.write(chunk.data(), static_cast<std::streamsize>(std::min<std::uint64_t>(4096, records - i) * record_bytes));
    const std::string zeros(1 << 20, '\0');
    for (std::uint64_t left = records * 4 + 8; left > 0;) {
      const auto n = std::min<std::uint64_t>(left, zeros.size());
      out.write(zeros.data(), static_cast<std::streamsize>(n));
      left -= n;
    }
  }
  REQUIRE(fs::file_size(path) == 48 + records * (record_bytes + 4) + 8);
  auto outs = on_ranks(2, local_group{30s}, [&](int r, ddp::process_group& pg) {
    model m;
    rusage before {};
    ::getrusage(RUSAGE_SELF, &before);
    try {
      (void)ddp::load_checkpoint(pg, path, m.views);
    } catch (const ddp::error&) {
      rusage after {};
      ::getrusage(RUSAGE_SELF, &after);
      const long grew_kib = after.ru_maxrss - before.ru_maxrss;
      // A valid file of this model costs a few KiB; the table alone is 40 MB.
      require(grew_kib < 8 * 1024, "rank " + std::to_string(r) + "'s peak memory grew by " + std::to_string(grew_kib) + " KiB");
      throw;
    }
  }, 60s);
  INFO(ddp_test::summary(outs));
  for (const auto& o : outs) {
    CAPTURE(o.rank);
    CHECK(o.errc == static_cast<int>(ddp::errc::mismatch));
    CHECK(o.message.find("finds another model in the file: the file's table of 40000000 bytes lists 2000000 "
                         "parameters, rank 0 has 5") != std::string::npos);
  }
}
