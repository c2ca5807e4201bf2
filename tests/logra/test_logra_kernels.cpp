// CPU reference kernels of LoGRA against plain dense references (A materialised in double
// precision), on fresh random inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "membar/kernels/logra.h"

namespace membar::kernels {
namespace {

std::vector<float> random_vector(size_t count, uint32_t seed, float scale = 1.f) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.f, scale);
  std::vector<float> values(count);
  for (auto& v : values) v = normal(generator);
  return values;
}

uint16_t to_bfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

float from_bfloat16(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, 4);
  return value;
}

// A [r, k] through the public generator.
std::vector<float> generate(const LograKey& key, int64_t rank, int64_t in_features) {
  std::vector<float> a(rank * in_features);
  LograGenerateParams params;
  params.shape = {rank, in_features};
  params.key = key;
  params.out = a.data();
  EXPECT_EQ(cpu::logra_generate(params), kLograOk);
  return a;
}

TEST(LograGenerator, SameKeySameBitsDifferentKeyDifferentBits) {
  const LograKey key{1234, 7, 3};
  const auto a = generate(key, 48, 200);
  const auto b = generate(key, 48, 200);
  EXPECT_EQ(a, b);
  const float scale = 1.f / std::sqrt(48.f);
  int negatives = 0;
  for (float v : a) {
    ASSERT_TRUE(v == scale || v == -scale);
    negatives += v < 0;
  }
  // 9600 fair coin flips: 4800 +- 49 (1 sigma); allow 5 sigma.
  EXPECT_NEAR(negatives, 4800, 245);
  for (const LograKey other : {LograKey{1235, 7, 3}, LograKey{1234, 8, 3}, LograKey{1234, 7, 4}}) {
    const auto c = generate(other, 48, 200);
    int equal = 0;
    for (size_t i = 0; i < a.size(); ++i) equal += a[i] == c[i];
    EXPECT_NEAR(equal, 4800, 245) << "keys differing in one field must give independent signs";
  }
}

TEST(LograGenerator, RowsAndColumnsAreUncorrelated) {
  // Neighbouring rows, and the 64-column words, must not repeat each other.
  const auto a = generate({99, 0, 0}, 64, 256);
  for (int64_t row = 1; row < 64; ++row) {
    double dot = 0;
    for (int64_t c = 0; c < 256; ++c) dot += a[row * 256 + c] * a[(row - 1) * 256 + c] * 64.0;
    EXPECT_LT(std::abs(dot), 5 * 16.0) << "rows " << row - 1 << " and " << row;  // 5 sigma of 256 flips
  }
  for (int64_t word = 1; word < 4; ++word) {
    double dot = 0;
    for (int64_t row = 0; row < 64; ++row) {
      for (int64_t c = 0; c < 64; ++c) dot += a[row * 256 + word * 64 + c] * a[row * 256 + c] * 64.0;
    }
    EXPECT_LT(std::abs(dot), 5 * 64.0) << "column word " << word;
  }
}

struct ProjectCase {
  int64_t tokens, in_features, rank, row_stride;
  DType dtype;
};

class LograProjectTest : public ::testing::TestWithParam<ProjectCase> {};

TEST_P(LograProjectTest, MatchesDenseReference) {
  const auto c = GetParam();
  const LograKey key{42, 3, 11};
  const auto a = generate(key, c.rank, c.in_features);
  const auto x = random_vector(c.tokens * c.row_stride, 5);
  std::vector<uint16_t> x_bf16(x.size());
  for (size_t i = 0; i < x.size(); ++i) x_bf16[i] = to_bfloat16(x[i]);
  const bool bf16 = c.dtype == DType::kBFloat16;
  std::vector<float> out_f32(c.tokens * c.rank);
  std::vector<uint16_t> out_bf16(c.tokens * c.rank);
  LograProjectParams params;
  params.shape = {c.rank, c.in_features};
  params.key = key;
  params.tokens = c.tokens;
  params.dtype = c.dtype;
  params.x = bf16 ? static_cast<const void*>(x_bf16.data()) : x.data();
  params.x_row_stride = c.row_stride;
  params.out = bf16 ? static_cast<void*>(out_bf16.data()) : out_f32.data();
  ASSERT_STREQ(logra_check_project(params), "");
  ASSERT_EQ(cpu::logra_project(params), kLograOk);
  for (int64_t t = 0; t < c.tokens; ++t) {
    for (int64_t j = 0; j < c.rank; ++j) {
      double reference = 0, magnitude = 0;
      for (int64_t col = 0; col < c.in_features; ++col) {
        const double xv = bf16 ? from_bfloat16(x_bf16[t * c.row_stride + col]) : x[t * c.row_stride + col];
        reference += xv * a[j * c.in_features + col];
        magnitude += std::abs(xv * a[j * c.in_features + col]);
      }
      const double got = bf16 ? from_bfloat16(out_bf16[t * c.rank + j]) : out_f32[t * c.rank + j];
      // fp32 accumulation error, plus the output's own rounding for bf16.
      const double bound = 1e-6 * magnitude + (bf16 ? std::abs(reference) / 256.0 : 0.0) + 1e-7;
      ASSERT_NEAR(got, reference, bound) << "token " << t << " rank " << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, LograProjectTest,
                         ::testing::Values(ProjectCase{37, 200, 48, 200, DType::kFloat32},
                                           ProjectCase{64, 128, 64, 150, DType::kFloat32},
                                           ProjectCase{5, 65, 130, 65, DType::kFloat32},
                                           ProjectCase{33, 192, 16, 192, DType::kBFloat16},
                                           ProjectCase{1, 1, 1, 1, DType::kFloat32}));

TEST(LograSketch, MatchesDenseReference) {
  const int64_t tokens = 50, d = 70, r = 24;
  const auto dy = random_vector(tokens * d, 8);
  const auto p = random_vector(tokens * r, 9);
  auto sketch = random_vector(d * r, 10);
  const auto initial = sketch;
  LograSketchParams params;
  params.tokens = tokens;
  params.out_features = d;
  params.rank = r;
  params.grad_output = dy.data();
  params.projected = p.data();
  params.sketch = sketch.data();
  ASSERT_EQ(cpu::logra_sketch_accumulate(params), kLograOk);
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t j = 0; j < r; ++j) {
      double reference = initial[i * r + j];
      for (int64_t t = 0; t < tokens; ++t) reference += double(dy[t * d + i]) * p[t * r + j];
      ASSERT_NEAR(sketch[i * r + j], reference, 1e-4);
    }
  }
}

void check_update(int64_t d, int64_t k, int64_t r, DType weight_dtype) {
  const LograKey key{7, 2, 5};
  const auto a = generate(key, r, k);
  const auto u = random_vector(d * r, 21);
  const auto w = random_vector(d * k, 22);
  const float coefficient = 0.37f;
  std::vector<uint16_t> w_bf16(w.size());
  for (size_t i = 0; i < w.size(); ++i) w_bf16[i] = to_bfloat16(w[i]);
  std::vector<float> w_f32 = w;
  LograUpdateParams params;
  params.shape = {r, k};
  params.key = key;
  params.out_features = d;
  params.coefficient = coefficient;
  params.update = u.data();
  params.weight_dtype = weight_dtype;
  params.weight = weight_dtype == DType::kBFloat16 ? static_cast<void*>(w_bf16.data()) : w_f32.data();
  ASSERT_EQ(cpu::logra_fused_update(params), kLograOk);
  for (int64_t i = 0; i < d; ++i) {
    for (int64_t c = 0; c < k; ++c) {
      const double before = weight_dtype == DType::kBFloat16 ? from_bfloat16(to_bfloat16(w[i * k + c])) : w[i * k + c];
      double delta = 0;
      for (int64_t j = 0; j < r; ++j) delta += double(u[i * r + j]) * a[j * k + c];
      const double reference = before - coefficient * delta;
      const double got = weight_dtype == DType::kBFloat16 ? from_bfloat16(w_bf16[i * k + c]) : w_f32[i * k + c];
      const double bound = weight_dtype == DType::kBFloat16 ? std::abs(reference) / 256.0 + 1e-6 : 1e-5;
      ASSERT_NEAR(got, reference, bound) << "row " << i << " column " << c;
    }
  }
}

TEST(LograUpdate, Float32MatchesDense) { check_update(40, 150, 20, DType::kFloat32); }
TEST(LograUpdate, Float32RankAboveTile) { check_update(9, 64, 100, DType::kFloat32); }
TEST(LograUpdate, BFloat16MatchesDense) { check_update(33, 96, 8, DType::kBFloat16); }

TEST(LograUpdate, StochasticRoundingIsUnbiased) {
  // W = 1 (bf16 ulp 2^-7 above 1, 2^-8 below), 200 updates of -1e-4 * sign pattern: round to
  // nearest never moves; stochastic rounding follows the fp32 sum on average.
  const int64_t d = 32, k = 128, r = 4;
  const LograKey key{3, 1, 0};
  std::vector<float> u(d * r, 1e-4f);
  std::vector<float> exact(d * k, 1.f);
  std::vector<uint16_t> rounded(d * k, to_bfloat16(1.f));
  LograUpdateParams params;
  params.shape = {r, k};
  params.key = key;
  params.out_features = d;
  params.coefficient = 1.f;
  params.update = u.data();
  for (int update = 0; update < 200; ++update) {
    params.weight_dtype = DType::kFloat32;
    params.weight = exact.data();
    params.rounding_seed = 0;
    ASSERT_EQ(cpu::logra_fused_update(params), kLograOk);
    params.weight_dtype = DType::kBFloat16;
    params.weight = rounded.data();
    params.rounding_seed = 1000 + update;
    ASSERT_EQ(cpu::logra_fused_update(params), kLograOk);
  }
  double error = 0, movement = 0;
  for (int64_t i = 0; i < d * k; ++i) {
    error += from_bfloat16(rounded[i]) - exact[i];
    movement += std::abs(exact[i] - 1.0);
    // Each rounding errs by less than one ulp (<= 2^-7 here) with zero mean: after 200 updates
    // an element is off by a random walk of about 0.05 (1 sigma); 0.3 is 6 sigma.
    ASSERT_LT(std::abs(from_bfloat16(rounded[i]) - exact[i]), 0.3) << "element " << i;
  }
  EXPECT_GT(movement / (d * k), 5e-3);
  EXPECT_LT(std::abs(error) / (d * k), 0.05 * movement / (d * k));
}

// Mean over n independent seeds of S A, with S = G A^T, estimates G; the error should fall like
// 1/sqrt(n) (E[A^T A] = I, so the estimator is unbiased).
double sketch_estimate_error(const std::vector<float>& g, int64_t d, int64_t k, int64_t r, int samples, uint64_t seed0) {
  std::vector<double> mean(d * k, 0.0);
  for (int n = 0; n < samples; ++n) {
    const auto a = generate({seed0 + n, 0, 0}, r, k);
    std::vector<double> s(d * r, 0.0);
    for (int64_t i = 0; i < d; ++i)
      for (int64_t j = 0; j < r; ++j)
        for (int64_t c = 0; c < k; ++c) s[i * r + j] += g[i * k + c] * a[j * k + c];
    for (int64_t i = 0; i < d; ++i)
      for (int64_t c = 0; c < k; ++c) {
        double v = 0;
        for (int64_t j = 0; j < r; ++j) v += s[i * r + j] * a[j * k + c];
        mean[i * k + c] += v / samples;
      }
  }
  double error = 0, norm = 0;
  for (int64_t i = 0; i < d * k; ++i) {
    error += (mean[i] - g[i]) * (mean[i] - g[i]);
    norm += double(g[i]) * g[i];
  }
  return std::sqrt(error / norm);
}

TEST(LograSketch, UnbiasedErrorShrinksLikeInverseSquareRoot) {
  const int64_t d = 6, k = 40, r = 4;
  const auto g = random_vector(d * k, 31);
  // Average the relative error over a few independent runs to steady the ratio.
  double small = 0, large = 0;
  for (int run = 0; run < 4; ++run) {
    small += sketch_estimate_error(g, d, k, r, 32, 1000 * run + 1);
    large += sketch_estimate_error(g, d, k, r, 512, 1000 * run + 500001);
  }
  // Theory: relative error ~ sqrt(k / (r n)); 16x more samples -> 4x smaller.
  const double ratio = small / large;
  EXPECT_GT(ratio, 2.8);
  EXPECT_LT(ratio, 5.7);
  EXPECT_LT(large / 4, 0.2);
}

TEST(LograChecks, BadInputGetsASentence) {
  LograProjectParams project;
  project.shape = {0, 10};
  project.tokens = 1;
  project.x_row_stride = 10;
  EXPECT_NE(std::string(logra_check_project(project)), "");
  EXPECT_EQ(cpu::logra_project(project), kLograInvalidArgument);
  project.shape = {4, 10};
  project.x_row_stride = 5;
  EXPECT_NE(std::string(logra_check_project(project)).find("stride"), std::string::npos);

  float w = 0, u = 0;
  LograUpdateParams update;
  update.shape = {1, 1};
  update.out_features = 1;
  update.update = &u;
  update.weight = &w;
  update.weight_dtype = DType::kFloat16;
  EXPECT_NE(std::string(logra_check_update(update)).find("float32 or bfloat16"), std::string::npos);
  update.weight_dtype = DType::kFloat32;
  update.coefficient = NAN;
  EXPECT_NE(std::string(logra_check_update(update)).find("finite"), std::string::npos);
  EXPECT_EQ(cpu::logra_fused_update(update), kLograInvalidArgument);

  LograSketchParams sketch;
  sketch.rank = 2;
  sketch.out_features = 2;
  sketch.tokens = 1;
  EXPECT_NE(std::string(logra_check_sketch(sketch)), "");
}

}  // namespace
}  // namespace membar::kernels
