// Paged attention forward for Hopper (sm_90a): warpgroup MMAs (wgmma) instead of mma.sync.
//
// Note [Warpgroup forward]
// Rationale: the mma.sync forward (attention_forward.cu) peaks near 320 TFLOP/s on an H200, about
// torch SDPA flash; Hopper's tensor cores reach their rate only through wgmma, whose operands are
// read from shared memory by the tensor cores themselves (FlashAttention-3, cuDNN: 600+ TFLOP/s).
// Approach: one CTA of two warpgroups (8 warps, 256 threads) per (128 query rows, q head); each
// warpgroup owns 64 query rows and keeps their output accumulator (64 x 128 fp32, 64 registers a
// thread) and online-softmax state in registers. The CTA walks the same key sequence as the
// mma.sync kernel (KeySequence: history pages, or the selected ones, then with attend_chunk the
// chunk's own keys up to its last query) in blocks of kKeys keys. Per block and warpgroup:
//   S[64 x kKeys] = Q K^T: eight wgmma m64n<kKeys>k16, Q (A) and the K tile (B) both K-major in
//     shared memory (rows of head_dim, dim contiguous);
//   mask (partial last page, causal diagonal), online softmax in fp32 with exp2 (as in the
//     mma.sync kernel: the accumulator layout of a warp is that of mma.m16n8, rows 16 w .. 16 w + 15
//     of the warpgroup for warp w);
//   O[64 x 128] += P V: kKeys / 16 wgmma m64n128k16, P converted to bf16 in registers as the A
//     operand (the accumulator of S is, per warp, exactly the A fragment layout), the V tile as B
//     from shared memory, MN-major (dim contiguous: the transpose bit).
// K and V tiles are copied with cp.async by all 256 threads in kStages stages (one barrier per
// block, as Note [Forward kernel] of the mma.sync kernel describes for two and three stages).
// Each MMA batch is fenced (wgmma.fence), committed and waited for in full before its result is
// read: this first version overlaps the tensor cores with the softmax only across warpgroups (and
// CTAs), not within one (FlashAttention-3's intra-warpgroup pipelining is the next step).
// A warpgroup skips the MMAs of a chunk block that lies entirely above its rows' diagonal.
// Measured on the H200 (2026-11-30, bench/results/2026-11-30-h200-session4): right on its first
// run (errors vs float32 within those of the mma.sync kernel), and with 128-key blocks in two
// stages 430 / 439 / 434 TFLOP/s at 32K / 128K / 256K history (chunk 4096, 28/4 heads) against
// 316 / 325 / 323 for the best mma.sync layout and 311 / 311 / 335 for SDPA flash: the default
// forward wherever it applies (wgmma_w8r64_k64_s3: 347 / 354 / 354).
//
// Note [Warpgroup shared layout]
// wgmma reads shared memory through a 64-bit matrix descriptor: start address >> 4 (bits 0-13),
// leading byte offset >> 4 (16-29), stride byte offset >> 4 (32-45), base offset (49-51, 0 here:
// every tile starts 1024-byte aligned) and the swizzle mode (62-63, 1 = 128-byte swizzle). A tile
// of R rows x 128 dims (bf16) is stored as two column halves [2][R][64]: each row of a half is 128
// bytes, and 16-byte piece p of row r lies at piece p ^ (r % 8) (the 128-byte swizzle, the same
// permutation as Note [Swizzle] of attention_common.cuh, applied by cp.async). Eight rows form a
// 1024-byte swizzle atom.
//   Q and K (K-major operands): stride byte offset 1024 (from 8 rows to the next 8); the leading
//     offset is unused with a swizzle (set to 16). The k step kk (16 dims) is half kk / 4, plus
//     32 bytes per step inside the 128-byte row (the hardware applies the swizzle to the final
//     address, so advancing the start address by 32 bytes selects the next 16 dims).
//   V (MN-major operand, N = the 128 dims): leading byte offset = the distance between the two
//     64-dim halves (R * 128 bytes), stride byte offset 1024 (from 8 keys to the next 8); the k
//     step kk (16 keys) starts kk * 16 * 128 bytes in.
// Shared memory written by cp.async (the generic proxy) is made visible to wgmma (the async proxy)
// by fence.proxy.async before the barrier that publishes a stage.
//
// Support: bf16, head_dim 128, page_tokens 64 or 128 with kKeys <= page_tokens, sparse selections
// whose query tiles hold whole CTAs (a multiple of 128 rows); an sm_90 device (elsewhere applies()
// is false and the mma.sync kernel runs). The kernel body is compiled only for sm_90a; a build
// whose architecture list lacks it (e.g. plain 90) gets a body that traps, and applies() is false
// there (MEMBAR_WGMMA_BUILT, set by kernels/CMakeLists.txt).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_common.cuh"
#include "attention_cuda_internal.h"
#include "attention_wgmma.cuh"
#include "attention_wgmma.h"

namespace membar::kernels::cuda {
namespace {

using namespace detail;
using Element = __nv_bfloat16;

constexpr int kHeadDim = 128;
constexpr int kWarpgroupRows = 64;
constexpr int kWarpgroups = 2;
constexpr int kRows = kWarpgroupRows * kWarpgroups;  // query rows per CTA
constexpr int kThreads = 128 * kWarpgroups;


template <int kKeys, int kStages>
constexpr size_t wgmma_shared_bytes_fixed() {
  // 1024 bytes of slack to align the base to a swizzle atom, Q [2][128][64], K and V
  // [kStages][2][kKeys][64], and the selection count.
  return 1024 + size_t(kRows) * kHeadDim * 2 + 2 * size_t(kStages) * kKeys * kHeadDim * 2 + 16;
}

template <int kKeys, int kStages, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    paged_attention_forward_wgmma_kernel(const PagedAttentionForwardParams params) {
#if MEMBAR_WGMMA_AVAILABLE
  static_assert(kKeys == 64 || kKeys == 128, "a key block is 64 or 128 keys (a page holds whole blocks)");
  static_assert(kStages == 2 || kStages == 3, "two or three K/V stages");
  constexpr int kTileBytes = kKeys * kHeadDim * 2;  // one K or V stage
  extern __shared__ unsigned char shared_raw[];
  // Align to 1024 bytes (the swizzle atom; the descriptors' base offset is then 0).
  const uint32_t raw_address = shared_address(shared_raw);
  unsigned char* shared_base = shared_raw + (((raw_address + 1023u) & ~1023u) - raw_address);
  unsigned char* q_tile = shared_base;                                 // [2][kRows][64]
  unsigned char* k_tiles = q_tile + kRows * kHeadDim * 2;              // [kStages][2][kKeys][64]
  unsigned char* v_tiles = k_tiles + kStages * kTileBytes;             // [kStages][2][kKeys][64]
  int* selected_count = reinterpret_cast<int*>(v_tiles + kStages * kTileBytes);
  int32_t* selected = selected_count + 4;                               // [selected_per_tile]

  const PagedAttentionShape& shape = params.shape;
  const int thread = threadIdx.x;
  const int warpgroup = thread / 128;
  const int warp_in_group = (thread % 128) / 32;
  const int lane = thread % 32;
  // Later tiles see more chunk keys: start them first.
  const int tile = gridDim.x - 1 - blockIdx.x;
  const int q_head = blockIdx.y;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int kv_head = q_head / group;
  const int first_query = tile * kRows;
  const int chunk_tokens = shape.chunk_tokens;
  const int64_t q_row_stride = int64_t(shape.num_q_heads) * kHeadDim;

  const Element* q = static_cast<const Element*>(params.q);
  load_swizzled_tile<kRows>(q_tile, q + int64_t(first_query) * q_row_stride + int64_t(q_head) * kHeadDim,
                            q_row_stride, chunk_tokens - first_query, thread);
  copy_async_commit();

  const auto keys =
      key_sequence_for_tile<Element, kKeys, true, kHeadDim>(params, kv_head, first_query, selected, selected_count);
  const int last_query = min(first_query + kRows, chunk_tokens) - 1;
  // Without attend_chunk only the history blocks (Note [Blocked history] in attention.h); a CTA
  // with no block at all writes out = 0 and lse = -inf.
  const int num_blocks = keys.num_history_blocks + (shape.attend_chunk ? last_query / kKeys + 1 : 0);
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;

  auto load_block = [&](int index, int stage) {
    const KeyBlock<Element> block = keys.block(index);
    load_swizzled_tile<kKeys>(k_tiles + stage * kTileBytes, block.k_base, kv_row_stride, block.valid_rows, thread);
    load_swizzled_tile<kKeys>(v_tiles + stage * kTileBytes, block.v_base, kv_row_stride, block.valid_rows, thread);
  };
  if (num_blocks > 0) load_block(0, 0);
  copy_async_commit();

  const float scale_log2 = shape.softmax_scale * kLog2e;
  // Rows of this warpgroup: group_row .. group_row + 63; this thread holds warp_row + lane / 4 and
  // that + 8 (the accumulator layout of Note [Warpgroup forward]).
  const int group_row = warpgroup * kWarpgroupRows;
  const int warp_row = group_row + warp_in_group * 16;
  float output[kHeadDim / 8][4];
  clear(output);
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  const uint32_t q_address = shared_address(q_tile) + group_row * kRowBytes;
  const uint32_t k_address = shared_address(k_tiles);
  const uint32_t v_address = shared_address(v_tiles);

  for (int index = 0; index < num_blocks; ++index) {
    const int stage = index % kStages;
    if constexpr (kStages == 3) {
      // The stage written here was read two blocks ago; every warpgroup has passed the barrier
      // of the previous block, so it finished that one.
      if (index + 1 < num_blocks) load_block(index + 1, (index + 1) % kStages);
      copy_async_commit();
      copy_async_wait<1>();
    } else {
      copy_async_wait<0>();
    }
    fence_proxy_async_shared();
    __syncthreads();
    if constexpr (kStages == 2) {
      // The stage written here was read in the previous block, which every warpgroup finished
      // (its MMAs waited for) before the barrier above.
      if (index + 1 < num_blocks) load_block(index + 1, (index + 1) % kStages);
      copy_async_commit();
    }

    const KeyBlock<Element> block = keys.block(index);
    const bool chunk_block = block.first_position >= 0;
    // A chunk block entirely above the diagonal of this warpgroup's rows adds nothing.
    if (chunk_block && block.first_position > first_query + group_row + kWarpgroupRows - 1) continue;

    // S = Q K^T (Note [Warpgroup shared layout]).
    float scores[kKeys / 8][4];
    const uint32_t k_stage = k_address + stage * kTileBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t half = kk / 4;
      const uint32_t column_bytes = (kk % 4) * 32;
      const uint64_t a = matrix_descriptor(q_address + half * kRows * kRowBytes + column_bytes, 16, 1024);
      const uint64_t b = matrix_descriptor(k_stage + half * kKeys * kRowBytes + column_bytes, 16, 1024);
      if constexpr (kKeys == 64) {
        wgmma_m64n64k16_shared(scores, a, b, kk > 0 ? 1 : 0);
      } else {
        wgmma_m64n128k16_shared(scores, a, b, kk > 0 ? 1 : 0);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(scores);

    // Mask: the partial last history page, and the causal diagonal of chunk blocks.
    const int row_position = first_query + warp_row + lane / 4;
    const bool needs_mask =
        block.valid_rows < kKeys || (chunk_block && block.first_position + kKeys - 1 > first_query + warp_row);
    if (needs_mask) {
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int key = n * 8 + 2 * (lane % 4) + (j & 1);
          bool visible = key < block.valid_rows;
          if (chunk_block) visible = visible && block.first_position + key <= row_position + (j >> 1) * 8;
          if (!visible) scores[n][j] = -INFINITY;
        }
      }
    }
    // Online softmax over this block (fp32, exp2 of log2e-scaled scores).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float block_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
        block_max = fmaxf(block_max, fmaxf(scores[n][2 * half], scores[n][2 * half + 1]));
      }
      block_max = quad_max(block_max);
      const float new_max = fmaxf(row_max[half], block_max);
      const float max_scaled = new_max == -INFINITY ? 0.f : new_max * scale_log2;
      const float correction = exp2f(row_max[half] * scale_log2 - max_scaled);
      row_max[half] = new_max;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int j = 2 * half; j < 2 * half + 2; ++j) {
          scores[n][j] = exp2f(scores[n][j] * scale_log2 - max_scaled);
          sum += scores[n][j];
        }
      }
      row_sum[half] = row_sum[half] * correction + sum;
#pragma unroll
      for (int n = 0; n < kHeadDim / 8; ++n) {
        output[n][2 * half] *= correction;
        output[n][2 * half + 1] *= correction;
      }
    }
    // P as bf16 A fragments: k step kk (16 keys) is score tiles 2 kk and 2 kk + 1.
    uint32_t p[kKeys / 16][4];
    accumulator_to_a_fragments<Element, kKeys>(p, scores);

    // O += P V (V MN-major: Note [Warpgroup shared layout]).
    const uint32_t v_stage = v_address + stage * kTileBytes;
    fence_registers(output);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint64_t b = matrix_descriptor(v_stage + kk * 16 * kRowBytes, kKeys * kRowBytes, 1024);
      wgmma_m64n128k16_registers_transposed_b(output, p[kk], b);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(output);
  }

  // Leave no copy in flight (a CTA without key blocks never waited for its Q copy).
  copy_async_wait<0>();

  Element* out = static_cast<Element*>(params.out);
  float* lse = static_cast<float*>(params.lse);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float sum = quad_sum(row_sum[half]);
    const int position = first_query + warp_row + lane / 4 + half * 8;
    if (position >= chunk_tokens) continue;
    const float inverse = sum > 0.f ? 1.f / sum : 0.f;
    Element* out_row = out + int64_t(position) * q_row_stride + int64_t(q_head) * kHeadDim;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      const int column = n * 8 + 2 * (lane % 4);
      *reinterpret_cast<uint32_t*>(out_row + column) =
          ElementTraits<Element>::pack(output[n][2 * half] * inverse, output[n][2 * half + 1] * inverse);
    }
    if (lane % 4 == 0) {
      lse[int64_t(q_head) * chunk_tokens + position] =
          sum > 0.f ? row_max[half] * shape.softmax_scale + logf(sum) : -INFINITY;
    }
  }
#else
  // Built for a GPU without wgmma (an architecture list without sm_90a): applies() lets this run
  // on any sm_90 device, so stop loudly rather than return a wrong result.
  __trap();
#endif  // MEMBAR_WGMMA_AVAILABLE
}

template <int kKeys, int kStages, int kMinBlocks>
cudaError_t launch_wgmma(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  const PagedAttentionShape& shape = params.shape;
  const size_t shared_bytes = wgmma_shared_bytes_fixed<kKeys, kStages>() +
                              (params.selection.selected_pages != nullptr ? size_t(params.selection.selected_per_tile) * 4 : 0);
  auto kernel = paged_attention_forward_wgmma_kernel<kKeys, kStages, kMinBlocks>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
  if (error != cudaSuccess) return error;
  error = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, int(cudaSharedmemCarveoutMaxShared));
  if (error != cudaSuccess) return error;
  const dim3 grid((shape.chunk_tokens + kRows - 1) / kRows, shape.num_q_heads);
  kernel<<<grid, kThreads, shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

template <int kKeys>
bool wgmma_applies(const PagedAttentionForwardParams& params) {
  const PagedAttentionShape& shape = params.shape;
  if (shape.dtype != DType::kBFloat16 || shape.head_dim != kHeadDim) return false;
  if (shape.page_tokens % kKeys != 0) return false;
  if (params.selection.selected_pages != nullptr && params.selection.query_tile_tokens % kRows != 0) return false;
  return device_is_sm90();
}

}  // namespace

cudaError_t launch_forward_wgmma_k64_s3(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  return launch_wgmma<64, 3, 1>(params, stream);
}
cudaError_t launch_forward_wgmma_k128_s2(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  return launch_wgmma<128, 2, 1>(params, stream);
}
bool forward_wgmma_k64_applies(const PagedAttentionForwardParams& params) { return wgmma_applies<64>(params); }
bool forward_wgmma_k128_applies(const PagedAttentionForwardParams& params) { return wgmma_applies<128>(params); }

}  // namespace membar::kernels::cuda
