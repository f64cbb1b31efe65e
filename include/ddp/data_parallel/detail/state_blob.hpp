#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
/// \file data_parallel/detail/state_blob.hpp
/// The sharded modes' optimizer state as one blob (`sharded_state()`, `load_sharded_state()`
/// of the sharded wrapper and of `fully_sharded`), independent of the world size and the plan:
///   "ddpshard", then little-endian u64s: format version (1), k (floats of state per element),
///   m (1 when f32 master weights follow the state, else 0), the optimizer's steps, the count of
///   parameters and each one's numel; then per parameter (k + m) arrays of numel floats: the k
///   state arrays, then the master weights (of f16 and bf16 parameters; zeros for f32 ones).
// IWYU pragma: private

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include <ddp/data_parallel/detail/parameters.hpp>
#include <ddp/detail/bytes.hpp>
#include <ddp/error.hpp>
#include <ddp/optim/shard_optimizer.hpp>
#include <ddp/parameter.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail::state_blob {

/// The blob of `full` (per parameter, (k + m) arrays of its numel floats).
inline std::vector<std::byte> encode(std::size_t k, std::size_t m, std::uint64_t steps,
                                     std::span<const tensor_view> views, const std::vector<std::vector<float>>& full) {
  std::string out = "ddpshard";
  put_u64(out, 1);  // format version
  put_u64(out, k);
  put_u64(out, m);
  put_u64(out, steps);
  put_u64(out, views.size());
  for (const auto& v : views) put_u64(out, v.numel);
  for (const auto& f : full) out.append(reinterpret_cast<const char*>(f.data()), f.size() * sizeof(float));
  std::vector<std::byte> blob(out.size());
  std::memcpy(blob.data(), out.data(), out.size());
  return blob;
}

/// A blob read back, checked against the parameters: `read(i, j, offset, count, dst)` copies
/// elements [offset, offset + count) of array j (j < k: state; j == k: master) of parameter i.
struct reader {
  std::span<const std::byte> blob;
  std::size_t k = 0, m = 0;
  std::uint64_t steps = 0;
  std::vector<std::size_t> start;
  std::vector<std::size_t> numel;

  /// Throws errc::invalid_argument for a blob that is not one, errc::mismatch for one of other
  /// parameters; `what` begins the messages ("load_sharded_state").
  reader(std::span<const std::byte> b, std::span<const tensor_view> views, int rank, const std::string& what)
      : blob(b) {
    const auto bad = [&](const std::string& why) { raise(errc::invalid_argument, rank, what + ": " + why); };
    std::size_t at = 8;
    const auto u64 = [&]() -> std::uint64_t {
      if (blob.size() < at + 8) bad("the blob ends early (" + std::to_string(blob.size()) + " bytes)");
      std::uint64_t v = 0;
      for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(std::to_integer<unsigned>(blob[at + i])) << (8 * i);
      at += 8;
      return v;
    };
    if (blob.size() < 8 || std::memcmp(blob.data(), "ddpshard", 8) != 0)
      bad("not a shard state (it must come from sharded_state())");
    if (const auto version = u64(); version != 1) bad("format version " + std::to_string(version) + ", expected 1");
    k = u64(), m = u64(), steps = u64();
    const std::uint64_t count = u64();
    if (k > 64 || m > 1) bad("a header that no sharded_state() writes");
    if (count != views.size())
      raise(errc::mismatch, rank,
            what + ": the state is of " + std::to_string(count) + " parameters, the wrapper has " +
                std::to_string(views.size()));
    std::size_t data = at + 8 * count;
    for (std::size_t i = 0; i < views.size(); ++i) {
      const std::uint64_t n = u64();
      if (n != views[i].numel)
        raise(errc::mismatch, rank,
              what + ": " + parameter_label(i, views[i].name) + " has " + std::to_string(views[i].numel) +
                  " elements, the state " + std::to_string(n),
              -1, static_cast<int>(i));
      start.push_back(data);
      numel.push_back(n);
      data += (k + m) * n * sizeof(float);
    }
    if (blob.size() != data) bad(std::to_string(blob.size()) + " bytes where the header says " + std::to_string(data));
  }

  void read(std::size_t i, std::size_t j, std::size_t offset, std::size_t count, float* dst) const {
    std::memcpy(dst, blob.data() + start[i] + (j * numel[i] + offset) * sizeof(float), count * sizeof(float));
  }

  /// One piece of a shard: its k state arrays into `state` (the piece's block, array j at
  /// j * count), and its master weights into `master` where both exist.
  void read_piece(const shard_piece& pc, float* state, float* master) const {
    for (std::size_t j = 0; j < k; ++j) read(pc.param, j, pc.param_offset, pc.count, state + j * pc.count);
    if (m == 1 && master != nullptr) read(pc.param, k, pc.param_offset, pc.count, master);
  }
};

/// One rank's chunk of a bucket's (or unit's) gathered state, `k` state arrays of `per`
/// elements in piece blocks then (with `m`) `per` master weights, into `full` (per parameter,
/// (k + m) arrays of its numel) by the rank's `pieces`; `narrow`: the master weights are real
/// (an f32 bucket's are not written).
inline void scatter_chunk(std::vector<std::vector<float>>& full, const float* chunk, std::size_t k, std::size_t m,
                          bool narrow, std::size_t per, std::span<const shard_piece> pieces,
                          std::span<const tensor_view> views) {
  for (const auto& pc : pieces) {
    const std::size_t numel = views[pc.param].numel;
    for (std::size_t j = 0; j < k; ++j)
      std::copy_n(chunk + k * pc.shard_offset + j * pc.count, pc.count,
                  full[pc.param].data() + j * numel + pc.param_offset);
    if (m == 1 && narrow)
      std::copy_n(chunk + k * per + pc.shard_offset, pc.count, full[pc.param].data() + k * numel + pc.param_offset);
  }
}

}  // namespace detail::state_blob
}  // namespace DDP_ABI
}  // namespace ddp
