// Tests of the torch-free bfloat16 / float16 conversions (membar/kernels/half_types.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "membar/kernels/half_types.h"

namespace membar::kernels {
namespace {

// Round to nearest even computed the slow way: among the two neighbours (in widened float),
// take the closer one, ties to the one with an even last bit.
template <typename Half, float (*Widen)(Half)>
uint16_t round_by_search(float value, uint16_t lower_bits) {
  const float lower = Widen(Half{lower_bits});
  const float upper = Widen(Half{uint16_t(lower_bits + 1)});
  const double distance_lower = std::fabs(double(value) - double(lower));
  const double distance_upper = std::fabs(double(upper) - double(value));
  if (distance_lower < distance_upper) return lower_bits;
  if (distance_upper < distance_lower) return uint16_t(lower_bits + 1);
  return (lower_bits & 1u) ? uint16_t(lower_bits + 1) : lower_bits;
}

TEST(HalfTypes, BFloat16WideningIsExactAndRoundTrips) {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const float value = bfloat16_to_float(BFloat16{uint16_t(bits)});
    EXPECT_EQ(float_to_bits(value), bits << 16);
    if (std::isnan(value)) {
      EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(value))));
    } else {
      EXPECT_EQ(float_to_bfloat16(value).bits, bits);
    }
  }
}

TEST(HalfTypes, Float16RoundTripsEveryValue) {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const float value = float16_to_float(Float16{uint16_t(bits)});
    if (std::isnan(value)) {
      EXPECT_EQ(bits & 0x7c00u, 0x7c00u);
      EXPECT_TRUE(std::isnan(float16_to_float(float_to_float16(value))));
    } else {
      EXPECT_EQ(float_to_float16(value).bits, bits) << "bits " << bits;
    }
  }
  EXPECT_EQ(float16_to_float(Float16{0x3c00u}), 1.0f);
  EXPECT_EQ(float16_to_float(Float16{0x7bffu}), 65504.0f);
  EXPECT_EQ(float16_to_float(Float16{0x0001u}), std::ldexp(1.0f, -24));
  EXPECT_EQ(float16_to_float(Float16{0xc000u}), -2.0f);
}

TEST(HalfTypes, BFloat16RoundsToNearestEven) {
  std::mt19937 generator(1234);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {
    const uint32_t bits = any_bits(generator);
    const float value = bits_to_float(bits);
    if (!std::isfinite(value)) continue;
    const uint16_t truncated = uint16_t(bits >> 16);
    const BFloat16 rounded = float_to_bfloat16(value);
    // Values beyond the largest finite bfloat16 plus half an ulp round to infinity.
    if ((truncated & 0x7fffu) == 0x7f7fu && std::isinf(bfloat16_to_float(rounded))) continue;
    // The search works on magnitudes: bits count up with magnitude for either sign.
    EXPECT_EQ(rounded.bits, (round_by_search<BFloat16, bfloat16_to_float>(value, truncated))) << value;
  }
  // Ties: 1 + 2^-8 lies halfway between 1 and 1 + 2^-7 and goes to the even one (1).
  EXPECT_EQ(bfloat16_to_float(float_to_bfloat16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  EXPECT_EQ(bfloat16_to_float(float_to_bfloat16(1.0f + 3 * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::isinf(bfloat16_to_float(float_to_bfloat16(std::numeric_limits<float>::max()))));
  EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload sits only in the low bits must not turn into infinity.
  EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(bits_to_float(0x7f800001u)))));
}

TEST(HalfTypes, Float16RoundsToNearestEven) {
  std::mt19937 generator(99);
  std::uniform_real_distribution<double> log_magnitude(-28.0, 17.0);
  std::bernoulli_distribution negative(0.5);
  for (int i = 0; i < 200000; ++i) {
    float value = float(std::exp2(log_magnitude(generator)));
    if (negative(generator)) value = -value;
    const Float16 rounded = float_to_float16(value);
    const float widened = float16_to_float(rounded);
    if (std::fabs(value) >= 65520.0f) {
      EXPECT_TRUE(std::isinf(widened)) << value;
      continue;
    }
    // The neighbours of the result: the rounded value must be at least as close as both, and
    // on a tie its last bit must be even.
    const uint16_t magnitude_bits = rounded.bits & 0x7fffu;
    const double error = std::fabs(double(widened) - double(value));
    const uint16_t sign = rounded.bits & 0x8000u;
    if (magnitude_bits > 0) {
      const double below = std::fabs(double(float16_to_float(Float16{uint16_t(sign | (magnitude_bits - 1))})) - value);
      EXPECT_LE(error, below) << value;
      if (error == below) {
        EXPECT_EQ(magnitude_bits & 1u, 0u) << value;
      }
    }
    if (magnitude_bits < 0x7bffu) {
      const double above = std::fabs(double(float16_to_float(Float16{uint16_t(sign | (magnitude_bits + 1))})) - value);
      EXPECT_LE(error, above) << value;
      if (error == above) {
        EXPECT_EQ(magnitude_bits & 1u, 0u) << value;
      }
    }
  }
  EXPECT_EQ(float_to_float16(65519.0f).bits, 0x7bffu);
  EXPECT_EQ(float_to_float16(65520.0f).bits, 0x7c00u);
  EXPECT_EQ(float_to_float16(std::ldexp(1.0f, -25)).bits, 0x0000u);  // tie between 0 and 2^-24: even
  EXPECT_EQ(float_to_float16(std::ldexp(1.5f, -25)).bits, 0x0001u);
  EXPECT_EQ(float_to_float16(std::ldexp(3.0f, -25)).bits, 0x0002u);  // tie between 1 and 2 ulps: even
  EXPECT_EQ(float_to_float16(-0.0f).bits, 0x8000u);
}

}  // namespace
}  // namespace membar::kernels
