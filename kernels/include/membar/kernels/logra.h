// LoGRA: low-rank gradient sketches for RL post-training.
//
// For a frozen weight W [d, k] (d = out_features, k = in_features) and a rank r, the projection
// A [r, k] has entries +-1/sqrt(r). A is never stored: every entry comes from a counter-based hash
// of (seed, matrix_id, step, row, column), so the trainer, the CPU reference, the CUDA kernels and
// a rollout process that only received the key all see the same bits. Kernels regenerate A tile
// by tile in registers / shared memory (CUDA) or in a small transient buffer (CPU).
//
// The three operations:
//   project            P = x A^T                      x [tokens, k]  ->  P [tokens, r]
//   sketch_accumulate  S += dY^T P                    dY [tokens, d], P [tokens, r], S [d, r] fp32
//   fused_update       W <- W - coefficient * U A     U [d, r] fp32, W [d, k] fp32 or bf16
// Because E[A^T A] = I_k, S A is an unbiased estimate of the dense gradient G = dY^T x.
//
// Element types: x and P share `dtype` (fp32, bf16 or fp16); accumulation is fp32. S and U are
// fp32. W is fp32 or bf16; the update is computed in fp32 and a bf16 W is rounded to nearest even,
// or stochastically (Note [LoGRA stochastic rounding]).
//
// Two CUDA update kernels: the CUDA-core one is bit-identical to the CPU reference; the
// tensor-core one (Note [LoGRA tensor-core update] in kernels/cuda/logra_cuda.cu) is the
// training default, deterministic and fp32-accurate but not bit-identical to the CPU.
//
// Launch functions return 0 (OK / cudaSuccess) or an error code; they never throw or exit.
// CPU functions block and run on the calling thread. CUDA functions enqueue on `stream` and
// return without waiting.
#pragma once

#include <cstddef>
#include <cstdint>

#include "membar/kernels/dtype.h"

#if defined(__CUDACC__)
#define MEMBAR_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MEMBAR_HOST_DEVICE inline
#endif

namespace membar::kernels {

// Note [LoGRA sign generator]
// Rationale: A must be bit-identical wherever it is rebuilt (CPU, GPU, another process), cost
// almost nothing to regenerate, and have independent, fair signs.
// Approach: SplitMix64's finalizer (a bijective 64-bit mixer with full avalanche) applied to
// counters. The key (seed, matrix_id, step) is folded into one 64-bit key hash by three mixing
// rounds. One 64-bit "sign word" covers 64 consecutive columns of one row of A:
//   word(row, column / 64) = mix(key_hash ^ mix((row << 32) | (column / 64)))
// and column c takes bit (c % 64) of its word: bit set means -1/sqrt(r), clear means +1/sqrt(r).
// Only integer operations are used, so every compiler and device produces the same bits.
// Limitations: rows and column words must fit in 32 bits each (k < 2^37), far beyond any layer.

// SplitMix64's finalizer: a bijection on 64-bit integers.
MEMBAR_HOST_DEVICE uint64_t logra_mix64(uint64_t value) {
  value += 0x9E3779B97F4A7C15ull;
  value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9ull;
  value = (value ^ (value >> 27)) * 0x94D049BB133111EBull;
  return value ^ (value >> 31);
}

// The key of one projection: which training run (seed), which weight matrix, which redraw.
struct LograKey {
  uint64_t seed = 0;
  uint64_t matrix_id = 0;
  uint64_t step = 0;
};

MEMBAR_HOST_DEVICE uint64_t logra_key_hash(uint64_t seed, uint64_t matrix_id, uint64_t step) {
  uint64_t hash = logra_mix64(seed);
  hash = logra_mix64(hash ^ matrix_id);
  return logra_mix64(hash ^ step);
}

MEMBAR_HOST_DEVICE uint64_t logra_key_hash(const LograKey& key) {
  return logra_key_hash(key.seed, key.matrix_id, key.step);
}

// Sign bits of columns [64 * column_word, 64 * column_word + 64) of `row` (bit j: column
// 64 * column_word + j; set = negative).
MEMBAR_HOST_DEVICE uint64_t logra_sign_word(uint64_t key_hash, uint32_t row, uint32_t column_word) {
  return logra_mix64(key_hash ^ logra_mix64((static_cast<uint64_t>(row) << 32) | column_word));
}

// +1.0f or -1.0f for entry (row, column) of the sign matrix; A = sign / sqrt(r).
MEMBAR_HOST_DEVICE float logra_sign(uint64_t key_hash, uint32_t row, uint32_t column) {
  const uint64_t word = logra_sign_word(key_hash, row, column >> 6);
  return ((word >> (column & 63u)) & 1u) ? -1.0f : 1.0f;
}

// Note [LoGRA stochastic rounding]
// Rationale: a bf16 weight swallows any change below half its ulp (|w| / 512): at RL learning
// rates a bf16-only trainer would not move at all, and a bf16-only receiver would drift from an
// fp32 trainer. Stochastic rounding keeps the expected value exact. Drawing its random bits from
// a counter-based hash of (rounding_seed, element index) keeps it deterministic, so a receiver
// applying the same update with the same rounding seed gets the same bits as the trainer.
// Approach: add 16 random bits below the bf16 mantissa to the fp32 bit pattern, then truncate.
// One 64-bit word serves four consecutive elements (16 bits each): element i takes bits
// [16 * (i % 4), 16 * (i % 4) + 16) of word(i / 4), and word(g) = mix(mix(rounding_seed) + g * gamma)
// with gamma = 0x9E3779B97F4A7C15: output g of a SplitMix64 stream whose state starts at
// mix(rounding_seed). Hashing is most of the update kernels' arithmetic: one mix per four
// elements (mix(rounding_seed) is loop-invariant) instead of two per element.
// Non-finite values round to nearest even (the random add could turn a NaN into an infinity).

// 64 random bits for elements [4 * group, 4 * group + 4) of one stochastic rounding.
MEMBAR_HOST_DEVICE uint64_t logra_rounding_word(uint64_t rounding_seed, uint64_t group) {
  return logra_mix64(logra_mix64(rounding_seed) + group * 0x9E3779B97F4A7C15ull);
}

// The bf16 bits of fp32 `float_bits` rounded with 16 random bits `random` (uniform in [0, 2^16)).
MEMBAR_HOST_DEVICE uint16_t logra_bfloat16_round_with(uint32_t float_bits, uint32_t random) {
  if ((float_bits & 0x7F800000u) == 0x7F800000u) {
    const uint32_t rounding_bias = 0x7FFFu + ((float_bits >> 16) & 1u);
    const bool is_nan = (float_bits & 0x7FFFFFFFu) > 0x7F800000u;
    return static_cast<uint16_t>(is_nan ? ((float_bits >> 16) | 0x0040u) : ((float_bits + rounding_bias) >> 16));
  }
  return static_cast<uint16_t>((float_bits + (random & 0xFFFFu)) >> 16);
}

// Element `index` of a stochastic rounding keyed by `rounding_seed`.
MEMBAR_HOST_DEVICE uint16_t logra_bfloat16_stochastic(uint32_t float_bits, uint64_t rounding_seed, uint64_t index) {
  const uint64_t word = logra_rounding_word(rounding_seed, index >> 2);
  return logra_bfloat16_round_with(float_bits, static_cast<uint32_t>(word >> ((index & 3u) * 16u)));
}

struct LograShape {
  int64_t rank = 0;          // r >= 1
  int64_t in_features = 0;   // k >= 1
};

// Writes A [rank, in_features] as fp32 (tests and debugging only; the training path never
// materialises A).
struct LograGenerateParams {
  LograShape shape;
  LograKey key;
  float* out = nullptr;      // [r, k], fp32, contiguous
};

// P = x A^T.
struct LograProjectParams {
  LograShape shape;
  LograKey key;
  int64_t tokens = 0;        // >= 0
  DType dtype = DType::kFloat32;  // of x and out: fp32, bf16 or fp16
  const void* x = nullptr;   // [tokens, k], row stride x_row_stride elements, unit column stride
  int64_t x_row_stride = 0;  // >= k
  void* out = nullptr;       // [tokens, r], contiguous
};

// S += dY^T P (the CPU reference; the bindings use a BLAS / cuBLAS matmul for this step).
struct LograSketchParams {
  int64_t tokens = 0;
  int64_t out_features = 0;  // d
  int64_t rank = 0;          // r
  DType dtype = DType::kFloat32;  // of grad_output and projected
  const void* grad_output = nullptr;  // [tokens, d], contiguous
  const void* projected = nullptr;    // [tokens, r], contiguous
  float* sketch = nullptr;            // [d, r], fp32, contiguous; accumulated into
};

// W <- W - coefficient * U A, with A regenerated from the key tile by tile.
struct LograUpdateParams {
  LograShape shape;
  LograKey key;
  int64_t out_features = 0;  // d
  float coefficient = 0.f;   // alpha * eta (the caller folds in signs and step sizes)
  const float* update = nullptr;  // U [d, r], fp32, contiguous
  DType weight_dtype = DType::kFloat32;  // fp32 or bf16
  void* weight = nullptr;    // W [d, k], contiguous; read-modify-write
  // bf16 W only: 0 rounds to nearest even; any other value rounds stochastically with bits from
  // hash(rounding_seed, i * k + c) (Note [LoGRA stochastic rounding]). Ignored for fp32 W.
  uint64_t rounding_seed = 0;
};

// Writes the unscaled signs (+1 / -1) of columns [column_begin, column_begin + columns) of A as
// bf16 [r, columns] (a transient tile for the tensor-core projection path of the CUDA op: the op
// multiplies x's matching columns by the tile with cuBLAS and scales by 1/sqrt(r) at the end).
struct LograSignTileParams {
  LograShape shape;          // rank r and the full in_features k
  LograKey key;
  int64_t column_begin = 0;  // a multiple of 64
  int64_t columns = 0;       // >= 1, column_begin + columns <= k
  void* out = nullptr;       // [r, columns], bf16, contiguous
};

// Returns an empty string when the parameters are usable, else a sentence saying what is wrong.
// The bindings and every launcher call these before touching memory.
const char* logra_check_project(const LograProjectParams& params);
const char* logra_check_sketch(const LograSketchParams& params);
const char* logra_check_update(const LograUpdateParams& params);

// Error codes of the CPU functions (the CUDA functions return cudaError_t values as int).
inline constexpr int kLograOk = 0;
inline constexpr int kLograInvalidArgument = 1;

namespace cpu {
int logra_generate(const LograGenerateParams& params);
int logra_project(const LograProjectParams& params);
int logra_sketch_accumulate(const LograSketchParams& params);
int logra_fused_update(const LograUpdateParams& params);
}  // namespace cpu

#if defined(MEMBAR_WITH_CUDA)
namespace cuda {
// Return cudaError_t values as int so that this header needs no CUDA include. Invalid
// parameters return cudaErrorInvalidValue (1) without launching.
int logra_generate(const LograGenerateParams& params, void* stream);
int logra_sign_tile(const LograSignTileParams& params, void* stream);
int logra_project(const LograProjectParams& params, void* stream);
int logra_fused_update(const LograUpdateParams& params, void* stream);
// The same update on tensor cores (Note [LoGRA tensor-core update] in logra_cuda.cu): U split
// into two bf16 terms, fp32 accumulation; deterministic but not bit-identical to the CPU.
// Needs compute capability 8.0 or newer.
int logra_fused_update_tensor_core(const LograUpdateParams& params, void* stream);
}  // namespace cuda
#endif

}  // namespace membar::kernels
