#pragma once
/// \file dtype.hpp
/// Element types and reduction operations: `ddp::dtype`, `ddp::op`, and the 16-bit float types
/// `ddp::half` and `ddp::bfloat16` (storage types; arithmetic goes through float).

#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <ddp/version.hpp>

namespace ddp {
inline namespace DDP_ABI {

/// Element type of a buffer on the wire and in buckets.
enum class dtype : std::uint8_t { f32 = 0, f64 = 1, f16 = 2, bf16 = 3, i32 = 4, i64 = 5 };

/// Reduction operation. `avg` is a sum divided by the world size (integer avg truncates).
enum class op : std::uint8_t { sum = 0, avg = 1, min = 2, max = 3, prod = 4 };

/// IEEE 754 binary16 storage type; converts to and from float (round to nearest even).
struct half {
  std::uint16_t bits = 0;
  half() = default;
  explicit half(float f) noexcept : bits(from_float(f)) {}
  explicit operator float() const noexcept { return to_float(bits); }
  friend bool operator==(half a, half b) noexcept { return a.bits == b.bits; }

  static std::uint16_t from_float(float f) noexcept {
    const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
    const std::uint32_t sign = (x >> 16) & 0x8000u;
    std::uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) {  // inf or nan
      return static_cast<std::uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
    }
    if (absx >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow
    if (absx < 0x38800000u) {                                                    // subnormal or zero in half
      // Shift the float so that its value in units of 2^-24 sits in the integer part.
      const float scaled = std::bit_cast<float>(absx) * 16777216.0f;  // 2^24, exact
      // Round to nearest even through the float adder: add and subtract 2^23.
      const float r = (scaled + 8388608.0f) - 8388608.0f;
      return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(r));
    }
    const std::uint32_t mant_odd = (absx >> 13) & 1u;
    absx += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
    return static_cast<std::uint16_t>(sign | (absx >> 13));
  }
  static float to_float(std::uint16_t h) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exp = (h >> 10) & 0x1fu;
    const std::uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
      const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;  // 2^-24
      return sign ? -v : v;
    }
    if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
    return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
  }
};

/// bfloat16 storage type: the upper 16 bits of a float (round to nearest even).
struct bfloat16 {
  std::uint16_t bits = 0;
  bfloat16() = default;
  explicit bfloat16(float f) noexcept : bits(from_float(f)) {}
  explicit operator float() const noexcept { return to_float(bits); }
  friend bool operator==(bfloat16 a, bfloat16 b) noexcept { return a.bits == b.bits; }

  static std::uint16_t from_float(float f) noexcept {
    std::uint32_t x = std::bit_cast<std::uint32_t>(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return static_cast<std::uint16_t>(x >> 16);
  }
  static float to_float(std::uint16_t b) noexcept { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }
};

/// Maps a C++ element type to its `ddp::dtype`; undefined for unsupported types.
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> : std::integral_constant<dtype, dtype::f32> {};
template <>
struct dtype_of<double> : std::integral_constant<dtype, dtype::f64> {};
template <>
struct dtype_of<half> : std::integral_constant<dtype, dtype::f16> {};
template <>
struct dtype_of<bfloat16> : std::integral_constant<dtype, dtype::bf16> {};
template <>
struct dtype_of<std::int32_t> : std::integral_constant<dtype, dtype::i32> {};
template <>
struct dtype_of<std::int64_t> : std::integral_constant<dtype, dtype::i64> {};

template <class T>
inline constexpr dtype dtype_of_v = dtype_of<std::remove_cv_t<T>>::value;

/// True for the element types every ddp reducer supports.
template <class T>
concept element = requires {
  dtype_of<std::remove_cv_t<T>>::value;
};

/// Size in bytes of one element of `t`.
constexpr std::size_t dtype_size(dtype t) noexcept {
  switch (t) {
    case dtype::f32:
    case dtype::i32:
      return 4;
    case dtype::f64:
    case dtype::i64:
      return 8;
    case dtype::f16:
    case dtype::bf16:
      return 2;
  }
  return 0;
}

constexpr const char* dtype_name(dtype t) noexcept {
  switch (t) {
    case dtype::f32:
      return "f32";
    case dtype::f64:
      return "f64";
    case dtype::f16:
      return "f16";
    case dtype::bf16:
      return "bf16";
    case dtype::i32:
      return "i32";
    case dtype::i64:
      return "i64";
  }
  return "?";
}

constexpr const char* op_name(op o) noexcept {
  switch (o) {
    case op::sum:
      return "sum";
    case op::avg:
      return "avg";
    case op::min:
      return "min";
    case op::max:
      return "max";
    case op::prod:
      return "prod";
  }
  return "?";
}

}  // namespace DDP_ABI
}  // namespace ddp
