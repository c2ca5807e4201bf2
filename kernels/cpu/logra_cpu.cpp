// CPU reference kernels of LoGRA (see membar/kernels/logra.h). They are the ground truth the
// CUDA kernels and the Python layers are tested against, and they run the CPU training path, so
// they are written to vectorise: A is regenerated into a small transient tile (64 columns of all
// r rows), never as a whole.
//
// Note [LoGRA summation order]
// Every product with a sign of A is exact (the signs are +-1 and the scale 1/sqrt(r) is applied
// once at the end), so a fused multiply-add and a multiply followed by an add give the same bits.
// The sums run in increasing column (project) or increasing rank index (update), the order the
// CUDA kernels use too, and the final scaling is one multiply without contraction. CPU and GPU
// results are therefore bit-identical for fp32 and bf16 outputs.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "membar/kernels/logra.h"

// Keep "w - step * delta" as a multiply then a subtract (Note [LoGRA summation order]); GCC would
// otherwise fuse them on targets with FMA instructions.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace membar::kernels {
namespace {

// Columns of A regenerated per tile: one sign word.
constexpr int64_t kColumnsPerTile = 64;

float bfloat16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

// Round to nearest even, NaN kept quiet (the same rule as the CUDA intrinsic __float2bfloat16_rn).
uint16_t float_to_bfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  const uint32_t rounding_bias = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

// IEEE half precision to float (used only for fp16 inputs).
float float16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1Fu;
  uint32_t mantissa = bits & 0x3FFu;
  uint32_t result;
  if (exponent == 0) {
    if (mantissa == 0) {
      result = sign;
    } else {
      int shift = 0;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        ++shift;
      }
      mantissa &= 0x3FFu;
      result = sign | (static_cast<uint32_t>(127 - 15 - shift + 1) << 23) | (mantissa << 13);
    }
  } else if (exponent == 31) {
    result = sign | 0x7F800000u | (mantissa << 13);
  } else {
    result = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &result, sizeof(value));
  return value;
}

uint16_t float_to_float16(float value) {
  // Round to nearest even through the usual bit manipulation; overflow goes to infinity.
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);
  if (magnitude >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);
  if (magnitude < 0x38800000u) {
    // Subnormal or zero in half precision.
    float absolute;
    std::memcpy(&absolute, &magnitude, sizeof(absolute));
    const float scaled = absolute * 16777216.0f;  // 2^24: one half subnormal ulp
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(scaled)));
  }
  const uint32_t rounded = magnitude + 0x0FFFu + ((magnitude >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

float load_element(const void* base, int64_t index, DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[index];
    case DType::kBFloat16: return bfloat16_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::kFloat16: return float16_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::kFloat64: return static_cast<float>(static_cast<const double*>(base)[index]);
  }
  return 0.f;
}

void store_element(void* base, int64_t index, DType dtype, float value) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(base)[index] = value; return;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[index] = float_to_bfloat16(value); return;
    case DType::kFloat16: static_cast<uint16_t*>(base)[index] = float_to_float16(value); return;
    case DType::kFloat64: static_cast<double*>(base)[index] = value; return;
  }
}

// Converts one row of `count` elements to fp32.
void load_row(const void* base, int64_t offset, int64_t count, DType dtype, float* out) {
  if (dtype == DType::kFloat32) {
    std::memcpy(out, static_cast<const float*>(base) + offset, count * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < count; ++i) out[i] = load_element(base, offset + i, dtype);
}

bool is_activation_dtype(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16;
}

// Fills tile [columns, rank] (column-major in A's terms: tile[c * rank + j] = sign of A[j, c0 + c])
// for columns [column_begin, column_begin + columns) of A, unscaled (+-1).
void fill_transposed_sign_tile(uint64_t key_hash, int64_t rank, int64_t column_begin, int64_t columns,
                               float* tile) {
  const uint32_t column_word = static_cast<uint32_t>(column_begin / kColumnsPerTile);
  for (int64_t j = 0; j < rank; ++j) {
    const uint64_t word = logra_sign_word(key_hash, static_cast<uint32_t>(j), column_word);
    for (int64_t c = 0; c < columns; ++c) tile[c * rank + j] = ((word >> c) & 1u) ? -1.f : 1.f;
  }
}

}  // namespace

const char* logra_check_project(const LograProjectParams& params) {
  if (params.shape.rank < 1) return "rank must be at least 1.";
  if (params.shape.in_features < 1) return "in_features must be at least 1.";
  if (params.shape.rank > (int64_t{1} << 31)) return "rank must fit in 31 bits.";
  if (params.tokens < 0) return "tokens must not be negative.";
  if (!is_activation_dtype(params.dtype)) return "x must be float32, bfloat16 or float16.";
  if (params.x_row_stride < params.shape.in_features) return "x's row stride must be at least in_features.";
  if (params.tokens > 0 && (params.x == nullptr || params.out == nullptr)) return "x and out must not be null.";
  return "";
}

const char* logra_check_sketch(const LograSketchParams& params) {
  if (params.rank < 1) return "rank must be at least 1.";
  if (params.out_features < 1) return "out_features must be at least 1.";
  if (params.tokens < 0) return "tokens must not be negative.";
  if (!is_activation_dtype(params.dtype)) return "grad_output and projected must be float32, bfloat16 or float16.";
  if (params.sketch == nullptr) return "sketch must not be null.";
  if (params.tokens > 0 && (params.grad_output == nullptr || params.projected == nullptr)) {
    return "grad_output and projected must not be null.";
  }
  return "";
}

const char* logra_check_update(const LograUpdateParams& params) {
  if (params.shape.rank < 1) return "rank must be at least 1.";
  if (params.shape.in_features < 1) return "in_features must be at least 1.";
  if (params.shape.rank > (int64_t{1} << 31)) return "rank must fit in 31 bits.";
  if (params.out_features < 1) return "out_features must be at least 1.";
  if (params.weight_dtype != DType::kFloat32 && params.weight_dtype != DType::kBFloat16) {
    return "the weight must be float32 or bfloat16.";
  }
  if (params.update == nullptr || params.weight == nullptr) return "update and weight must not be null.";
  if (!std::isfinite(params.coefficient)) return "the coefficient must be finite.";
  return "";
}

namespace cpu {

int logra_generate(const LograGenerateParams& params) {
  if (params.shape.rank < 1 || params.shape.in_features < 1 || params.out == nullptr) return kLograInvalidArgument;
  const uint64_t key_hash = logra_key_hash(params.key);
  const float scale = 1.0f / std::sqrt(static_cast<float>(params.shape.rank));
  for (int64_t j = 0; j < params.shape.rank; ++j) {
    for (int64_t c = 0; c < params.shape.in_features; ++c) {
      params.out[j * params.shape.in_features + c] =
          scale * logra_sign(key_hash, static_cast<uint32_t>(j), static_cast<uint32_t>(c));
    }
  }
  return kLograOk;
}

int logra_project(const LograProjectParams& params) {
  if (logra_check_project(params)[0] != '\0') return kLograInvalidArgument;
  const int64_t rank = params.shape.rank;
  const int64_t in_features = params.shape.in_features;
  const uint64_t key_hash = logra_key_hash(params.key);
  const float scale = 1.0f / std::sqrt(static_cast<float>(rank));
  // Accumulators for all tokens [tokens, r] in fp32; the column loop is outermost so each sign
  // tile [64, r] is generated once.
  std::vector<float> accumulator(static_cast<size_t>(params.tokens * rank), 0.f);
  std::vector<float> tile(static_cast<size_t>(kColumnsPerTile * rank));
  std::vector<float> x_row(kColumnsPerTile);
  for (int64_t column_begin = 0; column_begin < in_features; column_begin += kColumnsPerTile) {
    const int64_t columns = std::min(kColumnsPerTile, in_features - column_begin);
    fill_transposed_sign_tile(key_hash, rank, column_begin, columns, tile.data());
    for (int64_t t = 0; t < params.tokens; ++t) {
      load_row(params.x, t * params.x_row_stride + column_begin, columns, params.dtype, x_row.data());
      float* acc = accumulator.data() + t * rank;
      for (int64_t c = 0; c < columns; ++c) {
        const float value = x_row[c];
        const float* signs = tile.data() + c * rank;
        for (int64_t j = 0; j < rank; ++j) acc[j] += value * signs[j];
      }
    }
  }
  for (int64_t i = 0; i < params.tokens * rank; ++i) store_element(params.out, i, params.dtype, accumulator[i] * scale);
  return kLograOk;
}

int logra_sketch_accumulate(const LograSketchParams& params) {
  if (logra_check_sketch(params)[0] != '\0') return kLograInvalidArgument;
  std::vector<float> projected_row(params.rank);
  std::vector<float> grad_row(params.out_features);
  for (int64_t t = 0; t < params.tokens; ++t) {
    load_row(params.projected, t * params.rank, params.rank, params.dtype, projected_row.data());
    load_row(params.grad_output, t * params.out_features, params.out_features, params.dtype, grad_row.data());
    for (int64_t i = 0; i < params.out_features; ++i) {
      const float g = grad_row[i];
      float* sketch_row = params.sketch + i * params.rank;
      for (int64_t j = 0; j < params.rank; ++j) sketch_row[j] += g * projected_row[j];
    }
  }
  return kLograOk;
}

int logra_fused_update(const LograUpdateParams& params) {
  if (logra_check_update(params)[0] != '\0') return kLograInvalidArgument;
  const int64_t rank = params.shape.rank;
  const int64_t in_features = params.shape.in_features;
  const uint64_t key_hash = logra_key_hash(params.key);
  // Scale of A folded into the coefficient: W -= (coefficient / sqrt(r)) * U sign(A).
  const float step = params.coefficient / std::sqrt(static_cast<float>(rank));
  std::vector<float> tile(static_cast<size_t>(kColumnsPerTile * rank));
  std::vector<float> delta(kColumnsPerTile);
  for (int64_t column_begin = 0; column_begin < in_features; column_begin += kColumnsPerTile) {
    const int64_t columns = std::min(kColumnsPerTile, in_features - column_begin);
    fill_transposed_sign_tile(key_hash, rank, column_begin, columns, tile.data());
    for (int64_t i = 0; i < params.out_features; ++i) {
      const float* update_row = params.update + i * rank;
      // delta[c] = sum_j U[i, j] sign[j, c], summed in increasing j (Note [LoGRA summation order]).
      for (int64_t c = 0; c < columns; ++c) {
        const float* signs = tile.data() + c * rank;
        float sum = 0.f;
        for (int64_t j = 0; j < rank; ++j) sum += update_row[j] * signs[j];
        delta[c] = sum;
      }
      const int64_t offset = i * in_features + column_begin;
      if (params.weight_dtype == DType::kFloat32) {
        float* weight = static_cast<float*>(params.weight) + offset;
        for (int64_t c = 0; c < columns; ++c) {
          const float change = step * delta[c];
          weight[c] -= change;
        }
      } else {
        uint16_t* weight = static_cast<uint16_t*>(params.weight) + offset;
        for (int64_t c = 0; c < columns; ++c) {
          const float change = step * delta[c];
          const float value = bfloat16_to_float(weight[c]) - change;
          if (params.rounding_seed == 0) {
            weight[c] = float_to_bfloat16(value);
          } else {
            uint32_t bits;
            std::memcpy(&bits, &value, sizeof(bits));
            weight[c] = logra_bfloat16_stochastic(bits, params.rounding_seed, static_cast<uint64_t>(offset + c));
          }
        }
      }
    }
  }
  return kLograOk;
}

}  // namespace cpu
}  // namespace membar::kernels
