// 16-bit floating-point storage types for the CPU kernels, without torch or compiler extensions.
//
// BFloat16 and Float16 are plain 16-bit containers with conversions to and from float:
// widening is exact, narrowing rounds to nearest, ties to even (the rounding torch, CUDA and
// the hardware converters use), keeps infinities, and turns every NaN into a quiet NaN.
// Arithmetic happens in float: convert, compute, convert back.
#pragma once

#include <cstdint>
#include <cstring>

namespace membar::kernels {

struct BFloat16 {
  uint16_t bits = 0;
};

struct Float16 {
  uint16_t bits = 0;
};

static_assert(sizeof(BFloat16) == 2, "BFloat16 must have the size of torch.bfloat16 storage");
static_assert(sizeof(Float16) == 2, "Float16 must have the size of torch.float16 storage");

inline uint32_t float_to_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float bits_to_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// bfloat16 is the upper half of a float: widening appends 16 zero bits.
inline float bfloat16_to_float(BFloat16 value) { return bits_to_float(uint32_t(value.bits) << 16); }

inline BFloat16 float_to_bfloat16(float value) {
  uint32_t bits = float_to_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    // NaN: keep the sign, force a quiet NaN (dropping the low mantissa bits could make it inf).
    return BFloat16{uint16_t((bits >> 16) | 0x0040u)};
  }
  // Round to nearest even: add 0x7fff plus the lowest kept bit, then truncate. A carry out of
  // the mantissa correctly bumps the exponent (and rounds the largest finite values to inf).
  uint32_t lowest_kept_bit = (bits >> 16) & 1u;
  bits += 0x7fffu + lowest_kept_bit;
  return BFloat16{uint16_t(bits >> 16)};
}

inline float float16_to_float(Float16 value) {
  uint32_t sign = uint32_t(value.bits & 0x8000u) << 16;
  uint32_t exponent = (value.bits >> 10) & 0x1fu;
  uint32_t mantissa = value.bits & 0x3ffu;
  if (exponent == 0x1fu) {
    // Infinity or NaN: the float has the all-ones exponent and the mantissa shifted up.
    return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in float.
    float magnitude = float(mantissa) * (1.0f / 16777216.0f);
    return sign ? -magnitude : magnitude;
  }
  // Normal: rebias the exponent from 15 to 127.
  return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline Float16 float_to_float16(float value) {
  uint32_t bits = float_to_bits(value);
  uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return Float16{uint16_t(sign | 0x7e00u)};  // NaN -> quiet NaN
  // 65520 = the largest half (65504) plus half an ulp (16): from there on, round to infinity.
  if (magnitude >= 0x477ff000u) return Float16{uint16_t(sign | 0x7c00u)};
  if (magnitude < 0x38800000u) {
    // Below the smallest normal half (2^-14): the result is a subnormal (or zero), an integer
    // multiple of 2^-24. Shift the float's full 24-bit significand right and round to nearest
    // even by hand. Values below 2^-25 (and 2^-25 itself, a tie to even zero) round to zero.
    if (magnitude < 0x33000001u) return Float16{sign};
    uint32_t exponent = magnitude >> 23;                      // 102 .. 112
    uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - exponent;                         // 14 .. 24
    uint32_t result = significand >> shift;
    uint32_t remainder = significand & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (remainder > half || (remainder == half && (result & 1u))) result += 1u;
    return Float16{uint16_t(sign | result)};
  }
  // Normal: rebias the exponent (127 -> 15) and round the mantissa's low 13 bits to nearest
  // even; a carry into the exponent is the correct result (including up to 65504's neighbour).
  uint32_t lowest_kept_bit = (magnitude >> 13) & 1u;
  magnitude += 0xfffu + lowest_kept_bit;
  magnitude -= 112u << 23;
  return Float16{uint16_t(sign | (magnitude >> 13))};
}

}  // namespace membar::kernels
