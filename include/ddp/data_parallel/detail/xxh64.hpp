#pragma once
#include <ddp/detail/private_check.hpp>  // a private header: include a public one of ddp
// IWYU pragma: private
// XXH64 (Yann Collet's xxHash, 64-bit, seed 0), streaming: the checkpoint file's checksum
// (data_parallel/detail/checkpoint.hpp) and the hash of the values that ranks compare at a
// wrapper's construction instead of broadcasting them (data_parallel/agreement.hpp).
//
//   xxh64 h;
//   h.update(p, n);
//   h.update(q, m);
//   const std::uint64_t d = h.digest();   // the same as xxh64::of of the concatenation

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include <ddp/detail/bytes.hpp>

namespace ddp {
inline namespace DDP_ABI {
namespace detail {

class xxh64 {
 public:
  xxh64() noexcept { reset(); }
  void reset() noexcept {
    v_[0] = p1 + p2;
    v_[1] = p2;
    v_[2] = 0;
    v_[3] = 0 - p1;
    total_ = 0;
    held_ = 0;
  }
  void update(const void* data, std::size_t n) noexcept {
    const auto* p = static_cast<const unsigned char*>(data);
    total_ += n;
    if (held_ + n < 32) {
      if (n > 0) std::memcpy(buf_ + held_, p, n);
      held_ += n;
      return;
    }
    if (held_ > 0) {
      const std::size_t take = 32 - held_;
      std::memcpy(buf_ + held_, p, take);
      stripe(buf_);
      p += take;
      n -= take;
      held_ = 0;
    }
    for (; n >= 32; p += 32, n -= 32) stripe(p);
    if (n > 0) std::memcpy(buf_, p, n);
    held_ = n;
  }
  void update(std::string_view s) noexcept { update(s.data(), s.size()); }
  std::uint64_t digest() const noexcept {
    std::uint64_t h;
    if (total_ >= 32) {
      h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
      for (auto v : v_) {
        h ^= round(0, v);
        h = h * p1 + p4;
      }
    } else {
      h = p5;
    }
    h += total_;
    const unsigned char* p = buf_;
    std::size_t n = held_;
    for (; n >= 8; p += 8, n -= 8) {
      h ^= round(0, load64(p));
      h = rotl(h, 27) * p1 + p4;
    }
    if (n >= 4) {
      h ^= static_cast<std::uint64_t>(load32(p)) * p1;
      h = rotl(h, 23) * p2 + p3;
      p += 4;
      n -= 4;
    }
    for (; n > 0; ++p, --n) {
      h ^= *p * p5;
      h = rotl(h, 11) * p1;
    }
    h ^= h >> 33;
    h *= p2;
    h ^= h >> 29;
    h *= p3;
    h ^= h >> 32;
    return h;
  }
  static std::uint64_t of(const void* data, std::size_t n) noexcept {
    xxh64 h;
    h.update(data, n);
    return h.digest();
  }

 private:
  static constexpr std::uint64_t p1 = 11400714785074694791ull, p2 = 14029467366897019727ull,
                                 p3 = 1609587929392839161ull, p4 = 9650029242287828579ull, p5 = 2870177450012600261ull;
  static constexpr std::uint64_t rotl(std::uint64_t x, int r) noexcept { return (x << r) | (x >> (64 - r)); }
  static constexpr std::uint64_t round(std::uint64_t acc, std::uint64_t in) noexcept {
    return rotl(acc + in * p2, 31) * p1;
  }
  static std::uint64_t load64(const unsigned char* p) noexcept { return get_u64(reinterpret_cast<const char*>(p)); }
  static std::uint32_t load32(const unsigned char* p) noexcept { return get_u32(reinterpret_cast<const char*>(p)); }
  void stripe(const unsigned char* p) noexcept {
    for (int i = 0; i < 4; ++i) v_[i] = round(v_[i], load64(p + 8 * i));
  }

  std::uint64_t v_[4];
  std::uint64_t total_ = 0;
  unsigned char buf_[32] = {};
  std::size_t held_ = 0;
};

}  // namespace detail
}  // namespace DDP_ABI
}  // namespace ddp
