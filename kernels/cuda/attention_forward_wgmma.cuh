// The paged-attention forward for Hopper (sm_90a): warpgroup MMAs (wgmma) instead of mma.sync, as a
// template over its layout (WarpgroupForwardTile). Internal to kernels/.
//
// Note [Warpgroup forward]
// Rationale: the mma.sync forward (attention_forward_kernel.cuh) tops out near torch SDPA flash
// on an H200; Hopper's tensor cores reach their rate only through wgmma, whose operands are read
// from shared memory by the tensor cores themselves (FlashAttention-3, cuDNN; docs/kernels.md
// has the numbers).
// Approach: one CTA of two warpgroups (8 warps, 256 threads) per (128 query rows, q head); each
// warpgroup owns 64 query rows and keeps their output accumulator (64 x head_dim fp32: 64 registers
// a thread at head_dim 128) and online-softmax state in registers. The CTA walks the same key sequence as the
// mma.sync kernel (KeySequence: history pages, or the selected ones, then with attend_chunk the
// chunk's own keys up to its last query) in blocks of kKeys keys (keys_per_block). Per block and
// warpgroup:
//   S[64 x kKeys] = Q K^T: head_dim / 16 wgmma m64n<kKeys>k16, Q (A) and the K tile (B) both
//     K-major in shared memory (rows of head_dim, dim contiguous);
//   with kSoftcap the cap (Note [Soft-capped scores in raw units] in attention_common.cuh), then
//   mask (partial last page, causal diagonal), online softmax in fp32 with exp2 (as in the
//     mma.sync kernel: the accumulator layout of a warp is that of mma.m16n8, rows 16 w .. 16 w + 15
//     of the warpgroup for warp w);
//   O[64 x head_dim] += P V: per 16 keys, one wgmma m64n128k16 per 128 dims (m64n64k16 at head_dim
//     64), P converted to the element type in registers as the A operand (the accumulator of S is,
//     per warp, exactly the A fragment layout), the V tile as B from shared memory, MN-major (dim
//     contiguous: the transpose bit).
// K and V tiles are copied with cp.async by all 256 threads in kStages (stages) stages (one
// barrier per block, as Note [Forward kernel] of the mma.sync kernel describes for two and three
// stages).
// Each MMA batch is fenced (wgmma.fence), committed and waited for in full before its result is
// read: in the shipped layouts the tensor cores overlap the softmax only across warpgroups (and
// CTAs), not within one; the experimental overlap_softmax layout of the sweep target issues the
// next block's S before this block's softmax (Note [Softmax beside the next block's scores]). A warpgroup skips the MMAs of a chunk
// block that lies entirely above its rows' diagonal. Layouts (WarpgroupForwardTile): 128-key
// blocks in two stages, or 64-key blocks in three for pages of 64 (docs/kernels.md has their
// measurements against the mma.sync layouts); at head_dim 256, 64-key blocks in two stages (Q and
// two stages of K and V take 193 KiB of shared memory, and the output 128 registers a thread).
// Head sizes: the shared tiles are whole 64-dim halves; head_dim 96 is stored as 128 with the last
// 32 dims of each row never written: S reads only the first 96 dims (six k steps), and P V
// computes 128 output columns of which the last 32 (made of stale shared memory) are never
// stored.
//
// Note [Warpgroup shared layout]
// wgmma reads shared memory through a 64-bit matrix descriptor: start address >> 4 (bits 0-13),
// leading byte offset >> 4 (16-29), stride byte offset >> 4 (32-45), base offset (49-51, 0 here:
// every tile starts 1024-byte aligned) and the swizzle mode (62-63, 1 = 128-byte swizzle). A tile
// of R rows x 128 dims (bf16 or fp16) is stored as two column halves [2][R][64] (a multiple of 64
// dims as that many halves): each row of a half is 128 bytes, and 16-byte piece p of row r lies at piece p ^ (r % 8) (the 128-byte swizzle, the same
// permutation as Note [Swizzle] of attention_common.cuh, applied by cp.async). Eight rows form a
// 1024-byte swizzle atom.
//   Q and K (K-major operands): stride byte offset 1024 (from 8 rows to the next 8); the leading
//     offset is unused with a swizzle (set to 16). The k step kk (16 dims) is half kk / 4, plus
//     32 bytes per step inside the 128-byte row (the hardware applies the swizzle to the final
//     address, so advancing the start address by 32 bytes selects the next 16 dims).
//   V (MN-major operand, N = 128 dims of one product): leading byte offset = the distance between
//     two 64-dim halves (R * 128 bytes), stride byte offset 1024 (from 8 keys to the next 8); the k
//     step kk (16 keys) starts kk * 16 * 128 bytes in, the product of dims 128 g .. 128 g + 127
//     2 g halves in.
// Shared memory written by cp.async (the generic proxy) is made visible to wgmma (the async proxy)
// by fence.proxy.async before the barrier that publishes a stage.
//
// Support: bf16 and fp16, head_dim 64, 96, 128 and 256, page_tokens a multiple of keys_per_block,
// sparse selections whose
// query tiles hold whole CTAs (a multiple of 128 rows); an sm_90 device (forward_layout_fits in
// membar/kernels/attention_cuda.h). The kernel body is compiled only for sm_90a; a build whose
// architecture list lacks it (e.g. plain 90) gets a body that traps, and current_cuda_target()
// reports no warpgroup kernels there (MEMBAR_WGMMA_BUILT, set by kernels/CMakeLists.txt), so the
// layout choice never picks it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_common.cuh"
#include "attention_cuda_internal.h"
#include "attention_wgmma.cuh"

namespace membar::kernels::cuda::detail::warpgroup {

inline constexpr int kWarpgroupRows = 64;
inline constexpr int kWarpgroups = 2;
inline constexpr int kRows = kWarpgroupRows * kWarpgroups;  // query rows per CTA
inline constexpr int kThreads = 128 * kWarpgroups;

// A layout of the warpgroup forward: named fields, bounds checked in the kernel. Layout names:
// wgmma_w8r64_k<keys_per_block>_s<stages> (eight warps, 64 rows per warpgroup).
struct WarpgroupForwardTile {
  int keys_per_block = 128;  // keys per block (a block lies inside one page)
  int stages = 2;            // K/V stages in shared memory
  int ctas_per_sm = 1;       // CTAs per SM the registers are budgeted for (2: head_dim 64, 64-key blocks)
  // S of the next block issued before this block's softmax (Note [Softmax beside the next block's
  // scores]); three stages. Experimental: the sweep target only.
  bool overlap_softmax = false;
};

// Dims of the shared tiles: head_dim in whole 64-dim halves.
template <int kHeadDim>
inline constexpr int kStoredDim = (kHeadDim + 63) / 64 * 64;

template <int kHeadDim, typename Tiling>
constexpr size_t wgmma_shared_bytes_fixed() {
  constexpr WarpgroupForwardTile kTile = Tiling::kTile;
  // 1024 bytes of slack to align the base to a swizzle atom, Q [halves][128][64], K and V
  // [stages][halves][keys_per_block][64], and the selection count.
  return 1024 + size_t(kRows) * kStoredDim<kHeadDim> * 2 +
         2 * size_t(kTile.stages) * kTile.keys_per_block * kStoredDim<kHeadDim> * 2 + 16;
}

template <typename Element, int kHeadDim, typename Tiling, bool kSoftcap = false>
__global__ void __launch_bounds__(kThreads, Tiling::kTile.ctas_per_sm)
    paged_attention_forward_wgmma_kernel(const PagedAttentionForwardParams params) {
  constexpr WarpgroupForwardTile kTile = Tiling::kTile;
  constexpr int kKeys = kTile.keys_per_block;
  constexpr int kStages = kTile.stages;
  constexpr int kDims = kStoredDim<kHeadDim>;
  static_assert(kKeys == 64 || kKeys == 128, "a key block is 64 or 128 keys (the m64n64 or m64n128 wgmma shapes)");
  static_assert(kStages == 2 || kStages == 3, "the barrier schemes take two or three K/V stages");
  static_assert(kTile.ctas_per_sm == 1 || (kTile.ctas_per_sm == 2 && kHeadDim == 64 && kKeys == 64),
                "two CTAs per SM leave 128 registers a thread: enough only for a 64 x 64 output and 64-key scores");
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 256,
                "the supported head sizes (cuda_head_dim_supported)");
  static_assert(kHeadDim <= 128 || kKeys == 64, "at head_dim 256 the output and 128 scores a thread do not fit");
  static_assert(wgmma_shared_bytes_fixed<kHeadDim, Tiling>() + 4 * size_t(kMaxSelectedPerTile) <= 227 * 1024,
                "an H100/H200 CTA has 227 KiB: the tiles and the largest sparse selection must fit");
#if MEMBAR_WGMMA_AVAILABLE
  constexpr int kTileBytes = kKeys * kDims * 2;  // one K or V stage
  extern __shared__ unsigned char shared_raw[];
  // Align to 1024 bytes (the swizzle atom; the descriptors' base offset is then 0).
  const uint32_t raw_address = shared_address(shared_raw);
  unsigned char* shared_base = shared_raw + (((raw_address + 1023u) & ~1023u) - raw_address);
  unsigned char* q_tile = shared_base;                                 // [kDims / 64][kRows][64]
  unsigned char* k_tiles = q_tile + kRows * kDims * 2;                 // [kStages][kDims / 64][kKeys][64]
  unsigned char* v_tiles = k_tiles + kStages * kTileBytes;             // [kStages][kDims / 64][kKeys][64]
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
  load_swizzled_rows<kRows, kHeadDim, kThreads>(q_tile, q + int64_t(first_query) * q_row_stride + int64_t(q_head) * kHeadDim,
                                               q_row_stride, chunk_tokens - first_query, thread);
  copy_async_commit();

  const auto keys =
      key_sequence_for_tile<Element, kKeys, true, kHeadDim>(params, kv_head, first_query, selected, selected_count);
  const int last_query = min(first_query + kRows, chunk_tokens) - 1;
  // Without attend_chunk only the history blocks (Note [Blocked history] in attention.h); a CTA
  // with no block at all writes out = 0 and lse = -inf. With a sliding window the loop skips the
  // first_block blocks no query of the CTA sees: loop index i is key-sequence block first_block + i
  // (Note [Sliding window in the kernels] in attention_common.cuh).
  const int first_block = window_first_block<kKeys>(shape, keys.num_history_blocks, first_query);
  const int num_blocks = keys.num_history_blocks + (shape.attend_chunk ? last_query / kKeys + 1 : 0) - first_block;
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;

  auto load_block = [&](int index, int stage) {
    const KeyBlock<Element> block = keys.block(first_block + index);
    load_swizzled_rows<kKeys, kHeadDim, kThreads>(k_tiles + stage * kTileBytes, block.k_base, kv_row_stride,
                                                  block.valid_rows, thread);
    load_swizzled_rows<kKeys, kHeadDim, kThreads>(v_tiles + stage * kTileBytes, block.v_base, kv_row_stride,
                                                  block.valid_rows, thread);
  };
  if (num_blocks > 0) load_block(0, 0);
  copy_async_commit();

  const float scale_log2 = shape.softmax_scale * kLog2e;
  SoftCap soft_cap;
  if constexpr (kSoftcap) soft_cap = soft_cap_of(shape.softmax_scale, shape.logit_softcap);
  // Rows of this warpgroup: group_row .. group_row + 63; this thread holds warp_row + lane / 4 and
  // that + 8 (the accumulator layout of Note [Warpgroup forward]).
  const int group_row = warpgroup * kWarpgroupRows;
  const int warp_row = group_row + warp_in_group * 16;
  float output[kDims / 8][4];
  clear(output);
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  const uint32_t q_address = shared_address(q_tile) + group_row * kRowBytes;
  const uint32_t k_address = shared_address(k_tiles);
  const uint32_t v_address = shared_address(v_tiles);

  // S = Q K^T of the block in `stage` into `scores`, issued and committed, not waited for (Note
  // [Warpgroup shared layout]).
  auto issue_scores = [&](float (&scores)[kKeys / 8][4], int stage) {
    const uint32_t k_stage = k_address + stage * kTileBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t half = kk / 4;
      const uint32_t column_bytes = (kk % 4) * 32;
      const uint64_t a = matrix_descriptor(q_address + half * kRows * kRowBytes + column_bytes, 16, 1024);
      const uint64_t b = matrix_descriptor(k_stage + half * kKeys * kRowBytes + column_bytes, 16, 1024);
      wgmma_shared<Element, kKeys>(scores, a, b, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  };
  // The block's cap (kSoftcap), masks and online softmax on its (finished) scores, the output
  // rescaled, and P as A fragments of the element type: k step kk (16 keys) is score tiles 2 kk
  // and 2 kk + 1. `index`: the block's loop index (for its window edge).
  auto softmax_block = [&](float (&scores)[kKeys / 8][4], const KeyBlock<Element>& block, int index,
                           uint32_t (&p)[kKeys / 16][4]) {
    // Note [Soft-capped scores in raw units] (attention_common.cuh): before the masks.
    if constexpr (kSoftcap) soft_cap_scores(scores, soft_cap);
    // Mask: the partial last history page, and the causal diagonal of chunk blocks.
    const bool chunk_block = block.first_position >= 0;
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
    // The sliding window, where it hides some key of the block from some row of this warp (Note
    // [Sliding window in the kernels] in attention_common.cuh). A row may then see no key of the
    // block: the -INFINITY guard on the running maximum below keeps it finite.
    const int window_edge = window_edge_of_block<kKeys>(shape, first_block + index, block.first_position);
    if (window_edge <= first_query + warp_row + 15) {
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int key = n * 8 + 2 * (lane % 4) + (j & 1);
          if (key + window_edge <= row_position + (j >> 1) * 8) scores[n][j] = -INFINITY;
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
      for (int n = 0; n < kDims / 8; ++n) {
        output[n][2 * half] *= correction;
        output[n][2 * half + 1] *= correction;
      }
    }
    accumulator_to_a_fragments<Element, kKeys>(p, scores);
  };
  // O += P V of the block in `stage` (V MN-major: Note [Warpgroup shared layout]), issued and
  // committed, not waited for.
  auto issue_values = [&](const uint32_t (&p)[kKeys / 16][4], int stage) {
    const uint32_t v_stage = v_address + stage * kTileBytes;
    fence_registers(output);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint32_t key_step = v_stage + kk * 16 * kRowBytes;
      if constexpr (kDims == 64) {
        wgmma_registers_transposed_b<Element, 64>(output, p[kk], matrix_descriptor(key_step, kKeys * kRowBytes, 1024));
      } else {
        wgmma_registers_transposed_b<Element, 128>(output, p[kk], matrix_descriptor(key_step, kKeys * kRowBytes, 1024));
        if constexpr (kDims == 256) {
          // Dims 128-255: halves 2 and 3.
          wgmma_registers_transposed_b<Element, 128, 16>(
              output, p[kk], matrix_descriptor(key_step + 2 * kKeys * kRowBytes, kKeys * kRowBytes, 1024));
        }
      }
    }
    wgmma_commit();
  };
  // A chunk block entirely above the diagonal of this warpgroup's rows adds nothing (and every
  // later block is such a block).
  auto computes = [&](const KeyBlock<Element>& block) {
    const bool chunk_block = block.first_position >= 0;
    return !(chunk_block && block.first_position > first_query + group_row + kWarpgroupRows - 1);
  };

  if constexpr (!kTile.overlap_softmax) {
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
      const KeyBlock<Element> block = keys.block(first_block + index);
      if (!computes(block)) continue;

      float scores[kKeys / 8][4];
      issue_scores(scores, stage);
      wgmma_wait<0>();
      fence_registers(scores);
      uint32_t p[kKeys / 16][4];
      softmax_block(scores, block, index, p);
      issue_values(p, stage);
      wgmma_wait<0>();
      fence_registers(output);
    }
  } else {
    // Note [Softmax beside the next block's scores]: S of block i + 1 is issued before the softmax
    // of block i, so that the tensor cores compute it while this warpgroup's threads run the
    // softmax (FlashAttention-3's intra-warpgroup overlap). Three stages: block i (P V), block
    // i + 1 (S) and block i + 2 (loading). One barrier per block, as above: at the top of block i
    // every thread's copies of block i + 1 are visible and every warpgroup has finished P V of
    // block i - 1, whose stage block i + 2 then fills.
    static_assert(kStages == 3, "the overlapped loop holds three blocks at once");
    if (num_blocks > 1) load_block(1, 1);
    copy_async_commit();
    copy_async_wait<1>();   // Q and block 0
    fence_proxy_async_shared();
    __syncthreads();
    float scores[kKeys / 8][4];
    float next_scores[kKeys / 8][4];
    KeyBlock<Element> block = keys.block(first_block);
    if (num_blocks > 0 && computes(block)) issue_scores(scores, 0);
    for (int index = 0; index < num_blocks; ++index) {
      copy_async_wait<0>();   // block index + 1
      fence_proxy_async_shared();
      __syncthreads();
      if (index + 2 < num_blocks) load_block(index + 2, (index + 2) % kStages);
      copy_async_commit();
      const KeyBlock<Element> next_block = keys.block(first_block + index + 1);
      const bool next = index + 1 < num_blocks && computes(next_block);
      if (next) issue_scores(next_scores, (index + 1) % kStages);
      if (computes(block)) {
        if (next) {
          wgmma_wait<1>();   // S of this block; S of the next one may still run
        } else {
          wgmma_wait<0>();
        }
        fence_registers(scores);
        uint32_t p[kKeys / 16][4];
        softmax_block(scores, block, index, p);
        issue_values(p, index % kStages);
      }
      wgmma_wait<0>();
      fence_registers(output);
      if (next) {
        fence_registers(next_scores);
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
          for (int j = 0; j < 4; ++j) scores[n][j] = next_scores[n][j];
        }
      }
      block = next_block;
    }
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
  // Built for a GPU without wgmma (an architecture list without sm_90a): the layout choice never
  // picks this body there, so stop loudly rather than return a wrong result.
  __trap();
#endif  // MEMBAR_WGMMA_AVAILABLE
}

// kSoftcap: the instantiation that caps scores (params.shape.logit_softcap > 0).
template <typename Element, int kHeadDim, typename Tiling, bool kSoftcap = false>
cudaError_t launch_forward(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  const PagedAttentionShape& shape = params.shape;
  const size_t shared_bytes = wgmma_shared_bytes_fixed<kHeadDim, Tiling>() +
                              (params.selection.selected_pages != nullptr ? size_t(params.selection.selected_per_tile) * 4 : 0);
  auto kernel = paged_attention_forward_wgmma_kernel<Element, kHeadDim, Tiling, kSoftcap>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
  if (error != cudaSuccess) return error;
  error = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, int(cudaSharedmemCarveoutMaxShared));
  if (error != cudaSuccess) return error;
  const dim3 grid((shape.chunk_tokens + kRows - 1) / kRows, shape.num_q_heads);
  kernel<<<grid, kThreads, shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace membar::kernels::cuda::detail::warpgroup
