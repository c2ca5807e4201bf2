// CUDA kernels of LoGRA (see membar/kernels/logra.h and the CPU reference kernels/cpu/logra_cpu.cpp).
//
// Both matmul-shaped kernels use the same plan: a thread block owns a 64 x 64 output tile, walks
// the reduction dimension in chunks of 64, regenerates the matching 64 x 64 tile of signs of A in
// shared memory (64 sign words, one per row of A, then expanded to +-1 floats), and every thread
// accumulates a 4 x 4 sub-tile in fp32 registers. A exists only as that shared-memory tile.
// Sums run in the reduction order of the CPU reference (Note [LoGRA summation order] in
// logra_cpu.cpp), and the final scaling and subtraction use explicitly rounded intrinsics so
// nvcc does not contract them into an FMA: outputs are bit-identical to the CPU's.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cmath>
#include <type_traits>

#include "membar/kernels/logra.h"

namespace membar::kernels::cuda {
namespace {

constexpr int kTile = 64;          // output tile edge and reduction chunk; one sign word wide
constexpr int kThreads = 256;      // 16 x 16 threads, 4 x 4 outputs each
constexpr int kPerThread = 4;
static_assert(kTile == 64, "one sign word covers 64 columns of A, so a chunk is exactly one word");
static_assert((kTile / kPerThread) * (kTile / kPerThread) == kThreads, "threads must cover the tile");

template <typename T>
__device__ __forceinline__ float to_float(T value);
template <>
__device__ __forceinline__ float to_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 value) { return __bfloat162float(value); }
template <>
__device__ __forceinline__ float to_float<__half>(__half value) { return __half2float(value); }

template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) { return value; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) { return __float2bfloat16_rn(value); }
template <>
__device__ __forceinline__ __half from_float<__half>(float value) { return __float2half_rn(value); }

// Fills the +-1 signs of A's rows [row_begin, row_begin + 64) and columns [64 * column_word, +64):
// signs[c][j] (column-major, ColumnMajor = true) or signs[j][c]. Rows past `rank` get 0 so they
// add nothing.
template <bool ColumnMajor>
__device__ __forceinline__ void fill_sign_tile(uint64_t key_hash, int64_t row_begin, int64_t rank,
                                               uint32_t column_word, uint64_t* words,
                                               float (*signs)[kTile + 4]) {
  const int thread = threadIdx.x;
  if (thread < kTile) {
    const int64_t row = row_begin + thread;
    words[thread] = row < rank ? logra_sign_word(key_hash, static_cast<uint32_t>(row), column_word) : 0;
  }
  __syncthreads();
  for (int index = thread; index < kTile * kTile; index += kThreads) {
    // The fast index walks the innermost dimension of `signs` (conflict-free stores).
    const int j = ColumnMajor ? index % kTile : index / kTile;
    const int c = ColumnMajor ? index / kTile : index % kTile;
    const bool valid = row_begin + j < rank;
    const float sign = valid ? (((words[j] >> c) & 1u) ? -1.f : 1.f) : 0.f;
    if (ColumnMajor) {
      signs[c][j] = sign;
    } else {
      signs[j][c] = sign;
    }
  }
}

// P[t, j] = (1/sqrt(r)) * sum_c x[t, c] sign[j, c].
// grid: (ceil(tokens / 64), ceil(r / 64)); block: 256.
template <typename T>
__global__ void __launch_bounds__(kThreads) project_kernel(LograProjectParams params, uint64_t key_hash, float scale) {
  __shared__ uint64_t words[kTile];
  __shared__ __align__(16) float x_tile[kTile][kTile + 4];   // [column][token]
  __shared__ __align__(16) float signs[kTile][kTile + 4];    // [column][rank row]
  const T* x = static_cast<const T*>(params.x);
  T* out = static_cast<T*>(params.out);
  const int64_t token_begin = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * kTile;
  const int thread_token = (threadIdx.x / (kTile / kPerThread)) * kPerThread;
  const int thread_row = (threadIdx.x % (kTile / kPerThread)) * kPerThread;
  const int64_t rank = params.shape.rank;
  const int64_t in_features = params.shape.in_features;

  float accumulator[kPerThread][kPerThread] = {};
  for (int64_t column_begin = 0; column_begin < in_features; column_begin += kTile) {
    // Load x [64 tokens, 64 columns] transposed into x_tile, zero outside the matrix.
    for (int index = threadIdx.x; index < kTile * kTile; index += kThreads) {
      const int c = index % kTile;
      const int t = index / kTile;
      const int64_t token = token_begin + t;
      const int64_t column = column_begin + c;
      x_tile[c][t] = (token < params.tokens && column < in_features)
                         ? to_float<T>(x[token * params.x_row_stride + column])
                         : 0.f;
    }
    fill_sign_tile<true>(key_hash, row_begin, rank, static_cast<uint32_t>(column_begin / kTile), words, signs);
    __syncthreads();
    const int columns = static_cast<int>(in_features - column_begin < kTile ? in_features - column_begin : kTile);
    for (int c = 0; c < columns; ++c) {
      const float4 x_values = *reinterpret_cast<const float4*>(&x_tile[c][thread_token]);
      const float4 sign_values = *reinterpret_cast<const float4*>(&signs[c][thread_row]);
      const float xs[kPerThread] = {x_values.x, x_values.y, x_values.z, x_values.w};
      const float ss[kPerThread] = {sign_values.x, sign_values.y, sign_values.z, sign_values.w};
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) accumulator[i][j] += xs[i] * ss[j];
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t token = token_begin + thread_token + i;
    if (token >= params.tokens) continue;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t row = row_begin + thread_row + j;
      if (row < rank) out[token * rank + row] = from_float<T>(__fmul_rn(accumulator[i][j], scale));
    }
  }
}

template <typename W>
__device__ __forceinline__ float load_weight(const W* weight, int64_t index);
template <>
__device__ __forceinline__ float load_weight<float>(const float* weight, int64_t index) { return weight[index]; }
template <>
__device__ __forceinline__ float load_weight<__nv_bfloat16>(const __nv_bfloat16* weight, int64_t index) {
  return __bfloat162float(weight[index]);
}

template <typename W>
__device__ __forceinline__ void store_weight(W* weight, int64_t index, float value, uint64_t rounding_seed);
template <>
__device__ __forceinline__ void store_weight<float>(float* weight, int64_t index, float value, uint64_t) {
  weight[index] = value;
}
template <>
__device__ __forceinline__ void store_weight<__nv_bfloat16>(__nv_bfloat16* weight, int64_t index, float value,
                                                            uint64_t rounding_seed) {
  if (rounding_seed == 0) {
    weight[index] = __float2bfloat16_rn(value);
  } else {
    const uint16_t bits = logra_bfloat16_stochastic(__float_as_uint(value), rounding_seed, static_cast<uint64_t>(index));
    weight[index] = __ushort_as_bfloat16(bits);
  }
}

// W[i, c] -= step * sum_j U[i, j] sign[j, c].
// grid: (ceil(k / 64), ceil(d / 64)); block: 256.
template <typename W>
__global__ void __launch_bounds__(kThreads) update_kernel(LograUpdateParams params, uint64_t key_hash, float step) {
  __shared__ uint64_t words[kTile];
  __shared__ __align__(16) float update_tile[kTile][kTile + 4];  // [rank index][row of W]
  __shared__ __align__(16) float signs[kTile][kTile + 4];        // [rank index][column of W]
  W* weight = static_cast<W*>(params.weight);
  const int64_t column_begin = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t output_begin = static_cast<int64_t>(blockIdx.y) * kTile;
  const int thread_output = (threadIdx.x / (kTile / kPerThread)) * kPerThread;
  const int thread_column = (threadIdx.x % (kTile / kPerThread)) * kPerThread;
  const int64_t rank = params.shape.rank;
  const int64_t in_features = params.shape.in_features;
  const uint32_t column_word = static_cast<uint32_t>(column_begin / kTile);

  float delta[kPerThread][kPerThread] = {};
  for (int64_t rank_begin = 0; rank_begin < rank; rank_begin += kTile) {
    for (int index = threadIdx.x; index < kTile * kTile; index += kThreads) {
      const int j = index % kTile;
      const int i = index / kTile;
      const int64_t output = output_begin + i;
      const int64_t rank_index = rank_begin + j;
      update_tile[j][i] = (output < params.out_features && rank_index < rank)
                              ? params.update[output * rank + rank_index]
                              : 0.f;
    }
    // signs[j][c] holds sign[rank_begin + j, column_begin + c].
    fill_sign_tile<false>(key_hash, rank_begin, rank, column_word, words, signs);
    __syncthreads();
    const int ranks = static_cast<int>(rank - rank_begin < kTile ? rank - rank_begin : kTile);
    for (int j = 0; j < ranks; ++j) {
      const float4 update_values = *reinterpret_cast<const float4*>(&update_tile[j][thread_output]);
      const float us[kPerThread] = {update_values.x, update_values.y, update_values.z, update_values.w};
      const float4 sign_values = *reinterpret_cast<const float4*>(&signs[j][thread_column]);
      const float ss[kPerThread] = {sign_values.x, sign_values.y, sign_values.z, sign_values.w};
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int c = 0; c < kPerThread; ++c) delta[i][c] += us[i] * ss[c];
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int64_t output = output_begin + thread_output + i;
    if (output >= params.out_features) continue;
#pragma unroll
    for (int c = 0; c < kPerThread; ++c) {
      const int64_t column = column_begin + thread_column + c;
      if (column >= in_features) continue;
      const int64_t index = output * in_features + column;
      const float change = __fmul_rn(step, delta[i][c]);
      const float value = __fsub_rn(load_weight<W>(weight, index), change);
      store_weight<W>(weight, index, value, params.rounding_seed);
    }
  }
}

// Note [LoGRA tensor-core update]
// Rationale: W -= c U A costs 2 r d k flops; at r = 64 over a 7B model's projections that is
// ~0.8 TFLOP, which the fp32 CUDA-core kernel above needs tens of milliseconds for, per update.
// Tensor cores do it at memory speed (W is read and written once), but they multiply bf16, and
// rounding U to bf16 (8 bits of mantissa) would add a 0.4% error to every update.
// Approach: U is split into two bf16 terms, U = hi + lo with hi = bf16(U), lo = bf16(U - hi), so
// hi + lo carries ~16 significant bits (error at most 2^-16 |U|, the level of fp32 summation noise
// over r terms). A's signs are exact in bf16. One block owns a 64 x 128 tile of W: per chunk of
// 64 rank indices it splits the U tile into hi / lo in shared memory, regenerates the 64 x 128
// sign tile from the key, and 8 warps accumulate U_hi S + U_lo S in fp32 with WMMA 16x16x16. The
// epilogue stages the fp32 tile in shared memory (reusing the operand space) and applies
// W - (c / sqrt(r)) delta with the same rounding (nearest even or keyed stochastic) and the same
// element index as the exact kernel.
// Limitations: not bit-identical to the CPU reference (tensor-core summation order differs); it
// is deterministic, so a trainer and a receiver on the same GPU type get the same bits. The exact
// kernel stays available (exact = true).
namespace tensor_core {

constexpr int kRows = 64;        // rows of W per block
constexpr int kColumns = 128;    // columns of W per block: two sign words per row of A
constexpr int kRankChunk = 64;   // rank indices per pass
constexpr int kThreads = 256;    // 8 warps: 2 (rows) x 4 (columns), each 32 x 32
// Two resident blocks per SM (at most 128 registers a thread): one block's loads and epilogue
// overlap the other's sign generation and MMAs.
constexpr int kBlocksPerMultiprocessor = 2;
constexpr int kUpdateStride = kRankChunk + 8;   // bf16 elements; a multiple of 8 for WMMA loads
constexpr int kSignStride = kColumns + 8;       // bf16 elements
constexpr int kStagingStride = kColumns + 4;    // floats; a multiple of 4 for WMMA stores
constexpr int kUpdateTileBytes = kRows * kUpdateStride * 2;
constexpr int kSignTileBytes = kRankChunk * kSignStride * 2;
constexpr int kOperandBytes = 2 * kUpdateTileBytes + kSignTileBytes + kRankChunk * 2 * 8;
constexpr int kStagingBytes = kRows * kStagingStride * 4;
constexpr int kSharedBytes = kOperandBytes > kStagingBytes ? kOperandBytes : kStagingBytes;
static_assert(kColumns == 2 * 64, "the sign tile is filled from exactly two sign words per row of A");
static_assert(kSharedBytes <= 48 * 1024, "the tile must fit static shared memory (no opt-in launch attribute)");
static_assert(kUpdateTileBytes % 32 == 0 && kSignTileBytes % 32 == 0,
              "WMMA needs 256-bit aligned fragment pointers, so every sub-buffer starts on 32 bytes");
static_assert((kThreads / 32) == (kRows / 32) * (kColumns / 32), "one warp per 32 x 32 sub-tile");
constexpr int kUpdateGroups = kRows * kRankChunk / 4 / kThreads;  // float4 loads of U per thread and pass
static_assert(kRows * kRankChunk % (4 * kThreads) == 0, "the threads must cover the U tile's float4 groups evenly");

__device__ __forceinline__ float weight_to_float(float value) { return value; }
__device__ __forceinline__ float weight_to_float(__nv_bfloat16 value) { return __bfloat162float(value); }

// The stored value of an element of W: fp32 as is; bf16 to nearest even, or, when rounding_seed
// != 0, stochastically with the element's 16 random bits `random` (its slice of the rounding word,
// Note [LoGRA stochastic rounding]), which gives the exact kernel's bits.
template <typename W>
__device__ __forceinline__ W round_weight(float value, uint64_t rounding_seed, uint32_t random);
template <>
__device__ __forceinline__ float round_weight<float>(float value, uint64_t, uint32_t) { return value; }
template <>
__device__ __forceinline__ __nv_bfloat16 round_weight<__nv_bfloat16>(float value, uint64_t rounding_seed,
                                                                     uint32_t random) {
  if (rounding_seed == 0) return __float2bfloat16_rn(value);
  return __ushort_as_bfloat16(logra_bfloat16_round_with(__float_as_uint(value), random));
}

// W[i, c] -= step * sum_j U[i, j] sign[j, c], U split into bf16 hi + lo, tensor cores.
// grid: (ceil(k / 128), ceil(d / 64)); block: 256.
template <typename W>
__global__ void __launch_bounds__(kThreads, kBlocksPerMultiprocessor) update_kernel(LograUpdateParams params, uint64_t key_hash, float step) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  namespace wmma = nvcuda::wmma;
  __shared__ __align__(128) unsigned char shared[kSharedBytes];
  auto* update_high = reinterpret_cast<__nv_bfloat16*>(shared);                      // [64 rows][72]
  auto* update_low = reinterpret_cast<__nv_bfloat16*>(shared + kUpdateTileBytes);    // [64 rows][72]
  auto* signs = reinterpret_cast<__nv_bfloat16*>(shared + 2 * kUpdateTileBytes);      // [64 ranks][136]
  auto* words = reinterpret_cast<uint64_t*>(shared + 2 * kUpdateTileBytes + kSignTileBytes);  // [64 ranks][2]
  auto* staging = reinterpret_cast<float*>(shared);                                   // [64 rows][132], after the loop

  W* weight = static_cast<W*>(params.weight);
  const int64_t column_begin = static_cast<int64_t>(blockIdx.x) * kColumns;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * kRows;
  const int64_t rank = params.shape.rank;
  const int64_t in_features = params.shape.in_features;
  const int warp = threadIdx.x / 32;
  const int warp_row = (warp / 4) * 32;
  const int warp_column = (warp % 4) * 32;
  const uint32_t first_word = static_cast<uint32_t>(column_begin / 64);
  constexpr int kPerVector = 16 / static_cast<int>(sizeof(W));   // elements of W per 16-byte access
  constexpr int kVectorsPerRow = kColumns / kPerVector;
  constexpr int kWeightIterations = kRows * kVectorsPerRow / kThreads;
  static_assert(kRows * kVectorsPerRow % kThreads == 0, "the threads must cover the tile's vectors evenly");
  const bool vector_weight =
      in_features % kPerVector == 0 && reinterpret_cast<uintptr_t>(params.weight) % 16 == 0;
  const bool vector_update = rank % 4 == 0 && reinterpret_cast<uintptr_t>(params.update) % 16 == 0;

  // The tile of W is loaded first (16-byte vectors, when aligned), so that its latency overlaps
  // the U load, the sign generation and the MMAs below; the epilogue then only computes and stores.
  uint4 values[kWeightIterations];
  if (vector_weight) {
#pragma unroll
    for (int it = 0; it < kWeightIterations; ++it) {
      const int vector = threadIdx.x + it * kThreads;
      const int64_t row = row_begin + vector / kVectorsPerRow;
      const int64_t column = column_begin + (vector % kVectorsPerRow) * kPerVector;
      if (row < params.out_features && column < in_features) {
        values[it] = *reinterpret_cast<const uint4*>(weight + row * in_features + column);
      }
    }
  }

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> accumulator[2][2];
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int n = 0; n < 2; ++n) wmma::fill_fragment(accumulator[m][n], 0.0f);
  }

  for (int64_t rank_begin = 0; rank_begin < rank; rank_begin += kRankChunk) {
    // U [64 rows, 64 ranks] -> hi / lo; zero outside the matrix so padding adds nothing. Four
    // consecutive ranks per access, every load of the pass issued before any is used.
    float4 loaded[kUpdateGroups];
#pragma unroll
    for (int g = 0; g < kUpdateGroups; ++g) {
      const int group = threadIdx.x + g * kThreads;
      const int64_t row = row_begin + group / (kRankChunk / 4);
      const int64_t rank_index = rank_begin + (group % (kRankChunk / 4)) * 4;
      const float* source = params.update + row * rank + rank_index;
      if (vector_update && row < params.out_features && rank_index < rank) {
        loaded[g] = *reinterpret_cast<const float4*>(source);  // rank % 4 == 0: the group is whole
      } else {
        const bool row_valid = row < params.out_features;
        loaded[g] = make_float4(row_valid && rank_index < rank ? source[0] : 0.f,
                                row_valid && rank_index + 1 < rank ? source[1] : 0.f,
                                row_valid && rank_index + 2 < rank ? source[2] : 0.f,
                                row_valid && rank_index + 3 < rank ? source[3] : 0.f);
      }
    }
#pragma unroll
    for (int g = 0; g < kUpdateGroups; ++g) {
      const int group = threadIdx.x + g * kThreads;
      const int offset = (group / (kRankChunk / 4)) * kUpdateStride + (group % (kRankChunk / 4)) * 4;
      const float values[4] = {loaded[g].x, loaded[g].y, loaded[g].z, loaded[g].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const __nv_bfloat16 high = __float2bfloat16_rn(values[e]);
        update_high[offset + e] = high;
        update_low[offset + e] = __float2bfloat16_rn(values[e] - __bfloat162float(high));
      }
    }
    if (threadIdx.x < kRankChunk * 2) {
      const int j = threadIdx.x / 2;
      const int64_t rank_index = rank_begin + j;
      words[threadIdx.x] = rank_index < rank
                               ? logra_sign_word(key_hash, static_cast<uint32_t>(rank_index), first_word + (threadIdx.x % 2))
                               : 0;
    }
    __syncthreads();
    // signs[j][c] = sign of A[rank_begin + j, column_begin + c] (+1 / -1, exact in bf16), two
    // columns per 32-bit store: bf16 +1 is 0x3F80, and a set sign bit (0x8000) makes it -1.
    for (int index = threadIdx.x; index < kRankChunk * kColumns / 2; index += kThreads) {
      const int j = index / (kColumns / 2);
      const int c = (index % (kColumns / 2)) * 2;
      const uint32_t bits = static_cast<uint32_t>(words[j * 2 + c / 64] >> (c % 64)) & 3u;
      *reinterpret_cast<uint32_t*>(signs + j * kSignStride + c) = 0x3F803F80u | ((bits & 1u) << 15) | ((bits & 2u) << 30);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kRankChunk; kk += 16) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> sign_fragment[2];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        wmma::load_matrix_sync(sign_fragment[n], signs + kk * kSignStride + warp_column + n * 16, kSignStride);
      }
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> high_fragment, low_fragment;
        const int offset = (warp_row + m * 16) * kUpdateStride + kk;
        wmma::load_matrix_sync(high_fragment, update_high + offset, kUpdateStride);
        wmma::load_matrix_sync(low_fragment, update_low + offset, kUpdateStride);
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          wmma::mma_sync(accumulator[m][n], high_fragment, sign_fragment[n], accumulator[m][n]);
          wmma::mma_sync(accumulator[m][n], low_fragment, sign_fragment[n], accumulator[m][n]);
        }
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      wmma::store_matrix_sync(staging + (warp_row + m * 16) * kStagingStride + warp_column + n * 16, accumulator[m][n],
                              kStagingStride, wmma::mem_row_major);
    }
  }
  __syncthreads();
  if (vector_weight) {
    // 16-byte accesses (8 bf16 or 4 fp32 of one row), loaded at the start of the block; deltas
    // read as float4.
#pragma unroll
    for (int it = 0; it < kWeightIterations; ++it) {
      const int vector = threadIdx.x + it * kThreads;
      const int i = vector / kVectorsPerRow;
      const int c = (vector % kVectorsPerRow) * kPerVector;
      const int64_t row = row_begin + i;
      const int64_t column = column_begin + c;
      if (row >= params.out_features || column >= in_features) continue;  // k % kPerVector == 0: whole vectors
      W* lanes = reinterpret_cast<W*>(&values[it]);
      const int64_t first = row * in_features + column;  // a multiple of kPerVector (>= 4)
      const float* deltas = staging + i * kStagingStride + c;
#pragma unroll
      for (int quad = 0; quad < kPerVector; quad += 4) {
        const float4 delta = *reinterpret_cast<const float4*>(deltas + quad);
        const float quad_deltas[4] = {delta.x, delta.y, delta.z, delta.w};
        // Elements first + quad .. + 3 share one rounding word (Note [LoGRA stochastic rounding]).
        const uint64_t random = std::is_same<W, __nv_bfloat16>::value && params.rounding_seed != 0
                                    ? logra_rounding_word(params.rounding_seed, static_cast<uint64_t>(first + quad) >> 2)
                                    : 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float value = __fsub_rn(weight_to_float(lanes[quad + e]), __fmul_rn(step, quad_deltas[e]));
          lanes[quad + e] = round_weight<W>(value, params.rounding_seed, static_cast<uint32_t>(random >> (16 * e)));
        }
      }
      *reinterpret_cast<uint4*>(weight + first) = values[it];
    }
  } else {
    for (int index = threadIdx.x; index < kRows * kColumns; index += kThreads) {
      const int i = index / kColumns;
      const int c = index % kColumns;
      const int64_t row = row_begin + i;
      const int64_t column = column_begin + c;
      if (row >= params.out_features || column >= in_features) continue;
      const int64_t element = row * in_features + column;
      const float change = __fmul_rn(step, staging[i * kStagingStride + c]);
      store_weight<W>(weight, element, __fsub_rn(load_weight<W>(weight, element), change), params.rounding_seed);
    }
  }
#endif
}

}  // namespace tensor_core

__global__ void generate_kernel(LograGenerateParams params, uint64_t key_hash, float scale) {
  const int64_t total = params.shape.rank * params.shape.in_features;
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < total;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = index / params.shape.in_features;
    const int64_t column = index % params.shape.in_features;
    params.out[index] = scale * logra_sign(key_hash, static_cast<uint32_t>(row), static_cast<uint32_t>(column));
  }
}

// out[j, c] = sign of A[j, column_begin + c] as bf16 (+1 or -1, exact).
__global__ void sign_tile_kernel(LograSignTileParams params, uint64_t key_hash) {
  const int64_t total = params.shape.rank * params.columns;
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < total;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = index / params.columns;
    const int64_t column = params.column_begin + index % params.columns;
    static_cast<__nv_bfloat16*>(params.out)[index] =
        __float2bfloat16_rn(logra_sign(key_hash, static_cast<uint32_t>(row), static_cast<uint32_t>(column)));
  }
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

int logra_generate(const LograGenerateParams& params, void* stream) {
  if (params.shape.rank < 1 || params.shape.in_features < 1 || params.out == nullptr) return cudaErrorInvalidValue;
  const int64_t total = params.shape.rank * params.shape.in_features;
  const int blocks = static_cast<int>(ceil_div(total, 256) < 4096 ? ceil_div(total, 256) : 4096);
  generate_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      params, logra_key_hash(params.key), 1.0f / std::sqrt(static_cast<float>(params.shape.rank)));
  return cudaGetLastError();
}

int logra_sign_tile(const LograSignTileParams& params, void* stream) {
  if (params.shape.rank < 1 || params.columns < 1 || params.column_begin < 0 || params.column_begin % 64 != 0 ||
      params.column_begin + params.columns > params.shape.in_features || params.out == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int64_t total = params.shape.rank * params.columns;
  const int blocks = static_cast<int>(ceil_div(total, 256) < 4096 ? ceil_div(total, 256) : 4096);
  sign_tile_kernel<<<blocks, 256, 0, static_cast<cudaStream_t>(stream)>>>(params, logra_key_hash(params.key));
  return cudaGetLastError();
}

int logra_project(const LograProjectParams& params, void* stream) {
  if (logra_check_project(params)[0] != '\0') return cudaErrorInvalidValue;
  if (params.tokens == 0) return cudaSuccess;
  const int64_t token_blocks = ceil_div(params.tokens, kTile);
  const int64_t rank_blocks = ceil_div(params.shape.rank, kTile);
  if (token_blocks > 0x7FFFFFFF || rank_blocks > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(token_blocks), static_cast<unsigned>(rank_blocks));
  const uint64_t key_hash = logra_key_hash(params.key);
  const float scale = 1.0f / std::sqrt(static_cast<float>(params.shape.rank));
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  switch (params.dtype) {
    case DType::kFloat32: project_kernel<float><<<grid, kThreads, 0, cuda_stream>>>(params, key_hash, scale); break;
    case DType::kBFloat16: project_kernel<__nv_bfloat16><<<grid, kThreads, 0, cuda_stream>>>(params, key_hash, scale); break;
    case DType::kFloat16: project_kernel<__half><<<grid, kThreads, 0, cuda_stream>>>(params, key_hash, scale); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

int logra_fused_update(const LograUpdateParams& params, void* stream) {
  if (logra_check_update(params)[0] != '\0') return cudaErrorInvalidValue;
  const int64_t column_blocks = ceil_div(params.shape.in_features, kTile);
  const int64_t output_blocks = ceil_div(params.out_features, kTile);
  if (column_blocks > 0x7FFFFFFF || output_blocks > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(column_blocks), static_cast<unsigned>(output_blocks));
  const uint64_t key_hash = logra_key_hash(params.key);
  const float step = params.coefficient / std::sqrt(static_cast<float>(params.shape.rank));
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (params.weight_dtype == DType::kFloat32) {
    update_kernel<float><<<grid, kThreads, 0, cuda_stream>>>(params, key_hash, step);
  } else {
    update_kernel<__nv_bfloat16><<<grid, kThreads, 0, cuda_stream>>>(params, key_hash, step);
  }
  return cudaGetLastError();
}

int logra_fused_update_tensor_core(const LograUpdateParams& params, void* stream) {
  if (logra_check_update(params)[0] != '\0') return cudaErrorInvalidValue;
  const int64_t column_blocks = ceil_div(params.shape.in_features, tensor_core::kColumns);
  const int64_t row_blocks = ceil_div(params.out_features, tensor_core::kRows);
  if (column_blocks > 0x7FFFFFFF || row_blocks > 65535) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(column_blocks), static_cast<unsigned>(row_blocks));
  const uint64_t key_hash = logra_key_hash(params.key);
  const float step = params.coefficient / std::sqrt(static_cast<float>(params.shape.rank));
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (params.weight_dtype == DType::kFloat32) {
    tensor_core::update_kernel<float><<<grid, tensor_core::kThreads, 0, cuda_stream>>>(params, key_hash, step);
  } else {
    tensor_core::update_kernel<__nv_bfloat16><<<grid, tensor_core::kThreads, 0, cuda_stream>>>(params, key_hash, step);
  }
  return cudaGetLastError();
}

}  // namespace membar::kernels::cuda
