// The Hopper (sm_90a) dQ kernel of the deterministic backward: warpgroup MMAs (wgmma) instead of
// mma.sync, for head sizes 64, 96 and 128. Internal to kernels/cuda/ (included by
// attention_backward_dq.cu, which runs it on Hopper with the sm_90a build).
//
// Note [Warpgroup dQ pass]
// Rationale: in deterministic mode the dK/dV kernel adds no dQ (the atomics' order would change its
// bits) and a second kernel computes dQ once per query: with the mma.sync dQ kernel the
// deterministic backward ran at 0.79-0.80x of the default one at head size 128 on the H200
// (session 25; goal 0.9x), the pass being an attention forward's worth of work (S = Q K^T, dP = dO
// V^T and dQ = dS K per key block) at mma.sync rates.
// Approach: the mma.sync kernel's grid, key walk and masking (one CTA per 64 queries of one q head,
// the forward's key sequence in 64-key blocks, K and V in two cp.async stages), one warpgroup (128
// threads) per CTA, two CTAs an SM. Per key block: S and dP as wgmma m64n64k16 with Q / dO (A) and K
// / V (B) K-major in the swizzled tiles of Note [Warpgroup shared layout]; P and dS in fp32 in the
// accumulator layout (per warp exactly the mma.sync kernel's: rows 16 warp + lane / 4, keys n * 8 +
// 2 (lane % 4)); dQ += dS K as wgmma with dS from registers and K MN-major (the transpose bit), as
// P V in the warpgroup forward. dQ is written once, so its bits do not depend on scheduling.
// Limitations: head size 256 keeps the mma.sync kernel (dQ of 64 rows x 256 columns would take 128
// registers a thread beside S and dP). Each block's MMAs are waited for before the next block's
// (no overlap of softmax with MMAs).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "attention_backward_wgmma.cuh"
#include "attention_common.cuh"
#include "attention_cuda_internal.h"
#include "attention_wgmma.cuh"

namespace membar::kernels::cuda::detail::warpgroup {

inline constexpr int kDqWarpgroupRows = 64;   // queries per CTA (the wgmma M)
inline constexpr int kDqWarpgroupKeys = 64;   // keys per block
inline constexpr int kDqWarpgroupThreads = 128;

template <int kHeadDim>
constexpr size_t dq_warpgroup_shared_bytes_fixed() {
  // 1024 of alignment slack; Q, dO [D / 64][64][64]; K, V [2 stages][D / 64][64][64].
  return 1024 + size_t(6) * kDqWarpgroupRows * kBackwardTileDims<kHeadDim> * 2;
}

template <typename Element, int kHeadDim, bool kSoftcap>
__global__ void __launch_bounds__(kDqWarpgroupThreads, 2)
    paged_attention_backward_dq_wgmma_kernel(const PagedAttentionBackwardParams params, const float* delta,
                                             const SoftCap soft_cap) {
  static_assert(warpgroup_backward_head_dim(kHeadDim), "the warpgroup dQ pass is written for head_dim 64, 96 or 128");
#if MEMBAR_WGMMA_AVAILABLE
  constexpr int kRows = kDqWarpgroupRows;
  constexpr int kKeys = kDqWarpgroupKeys;
  constexpr int kThreads = kDqWarpgroupThreads;
  constexpr int kDims = kBackwardTileDims<kHeadDim>;
  constexpr int kTileBytes = kRows * kDims * 2;  // every tile: 64 rows of kDims
  extern __shared__ unsigned char shared_raw[];
  const uint32_t raw_address = shared_address(shared_raw);
  unsigned char* shared_base = shared_raw + (((raw_address + 1023u) & ~1023u) - raw_address);
  unsigned char* q_tile = shared_base;
  unsigned char* dout_tile = q_tile + kTileBytes;
  unsigned char* k_tiles = dout_tile + kTileBytes;     // [2 stages]
  unsigned char* v_tiles = k_tiles + 2 * kTileBytes;   // [2 stages]
  int32_t* selected = reinterpret_cast<int32_t*>(v_tiles + 2 * kTileBytes);
  __shared__ int selected_count;

  const PagedAttentionShape& shape = params.shape;
  const int thread = threadIdx.x;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const int tile = gridDim.x - 1 - blockIdx.x;
  const int q_head = blockIdx.y;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int first_query = tile * kRows;
  const int chunk_tokens = shape.chunk_tokens;
  const int64_t q_row_stride = int64_t(shape.num_q_heads) * kHeadDim;
  const int64_t q_offset = int64_t(first_query) * q_row_stride + int64_t(q_head) * kHeadDim;

  load_swizzled_rows<kRows, kHeadDim, kThreads>(q_tile, static_cast<const Element*>(params.q) + q_offset, q_row_stride,
                                                chunk_tokens - first_query, thread);
  load_swizzled_rows<kRows, kHeadDim, kThreads>(dout_tile, static_cast<const Element*>(params.dout) + q_offset,
                                                q_row_stride, chunk_tokens - first_query, thread);
  copy_async_commit();

  const auto keys =
      key_sequence_for_tile<Element, kKeys, false, kHeadDim>(params, q_head / group, first_query, selected, &selected_count);
  const int last_query = min(first_query + kRows, chunk_tokens) - 1;
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

  const int row_in_tile = warp * 16 + lane / 4;
  const int query_position[2] = {first_query + row_in_tile, first_query + row_in_tile + 8};
  const float* lse = static_cast<const float*>(params.lse);
  float row_lse[2], row_delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    query_row_statistics(lse, delta, chunk_tokens, q_head, query_position[half], row_lse[half], row_delta[half]);
  }
  const float scale_log2 = shape.softmax_scale * kLog2e;
  float dq[kDims / 8][4];
  clear(dq);
  const uint32_t q_address = shared_address(q_tile);
  const uint32_t dout_address = shared_address(dout_tile);

  for (int index = 0; index < num_blocks; ++index) {
    const int stage = index & 1;
    copy_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();
    // The other stage was read by the previous block, whose MMAs every warp waited for above.
    if (index + 1 < num_blocks) load_block(index + 1, stage ^ 1);
    copy_async_commit();

    const uint32_t k_stage = shared_address(k_tiles + stage * kTileBytes);
    const uint32_t v_stage = shared_address(v_tiles + stage * kTileBytes);
    float scores[kKeys / 8][4];
    float dscores[kKeys / 8][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t step = (kk / 4) * kRows * kRowBytes + (kk % 4) * 32;
      wgmma_shared<Element, kKeys>(scores, matrix_descriptor(q_address + step, 16, 1024),
                                   matrix_descriptor(k_stage + step, 16, 1024), kk > 0 ? 1 : 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t step = (kk / 4) * kRows * kRowBytes + (kk % 4) * 32;
      wgmma_shared<Element, kKeys>(dscores, matrix_descriptor(dout_address + step, 16, 1024),
                                   matrix_descriptor(v_stage + step, 16, 1024), kk > 0 ? 1 : 0);
    }
    wgmma_commit();

    const KeyBlock<Element> block = keys.block(first_block + index);
    const bool chunk_block = block.first_position >= 0;
    const int window_edge = window_edge_of_block<kKeys>(shape, first_block + index, block.first_position);
    const bool window_cuts = window_edge <= first_query + warp * 16 + 15;
    const bool may_cut = block.valid_rows < kKeys ||
                         (chunk_block && block.first_position + kKeys - 1 > first_query + warp * 16) || window_cuts;
    auto probability = [&](float score, int n, int j) {
      const int key = n * 8 + 2 * (lane % 4) + (j & 1);
      float p = exp2f(score * scale_log2 - row_lse[j >> 1]);
      if (may_cut) {
        bool visible = key < block.valid_rows;
        if (chunk_block) visible = visible && block.first_position + key <= query_position[j >> 1];
        if (window_cuts) visible = visible && key + window_edge > query_position[j >> 1];
        if (!visible) p = 0.f;
      }
      return p;
    };
    if constexpr (kSoftcap) {
      wgmma_wait<0>();
      fence_registers(scores);
      fence_registers(dscores);
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float capped = soft_cap.capped(scores[n][j]);
          const float p = probability(capped, n, j);
          dscores[n][j] = p * (dscores[n][j] - row_delta[j >> 1]) * soft_cap.slope(capped);
        }
      }
    } else {
      wgmma_wait<1>();
      fence_registers(scores);
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) scores[n][j] = probability(scores[n][j], n, j);
      }
      wgmma_wait<0>();
      fence_registers(dscores);
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) dscores[n][j] = scores[n][j] * (dscores[n][j] - row_delta[j >> 1]);
      }
    }

    // dQ += dS K (K MN-major: the k step kk, 16 keys, starts kk * 16 rows in).
    uint32_t fragments[kKeys / 16][4];
    accumulator_to_a_fragments<Element, kKeys>(fragments, dscores);
    fence_registers(dq);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint64_t b = matrix_descriptor(k_stage + kk * 16 * kRowBytes, kKeys * kRowBytes, 1024);
      wgmma_registers_transposed_b<Element, kDims>(dq, fragments[kk], b);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(fragments);
    fence_registers(dq);
  }
  copy_async_wait<0>();

  write_dq_rows<Element, kHeadDim>(params, dq, query_position, q_head, lane);
#else
  __trap();
#endif  // MEMBAR_WGMMA_AVAILABLE
}

template <typename Element, int kHeadDim, bool kSoftcap>
cudaError_t launch_backward_dq_wgmma(const PagedAttentionBackwardParams& params, const float* delta,
                                     cudaStream_t stream) {
  const size_t shared_bytes =
      dq_warpgroup_shared_bytes_fixed<kHeadDim>() +
      ((params.selection.selected_pages != nullptr) ? size_t(params.selection.selected_per_tile) * 4 : 0);
  auto kernel = paged_attention_backward_dq_wgmma_kernel<Element, kHeadDim, kSoftcap>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
  if (error != cudaSuccess) return error;
  const dim3 grid((params.shape.chunk_tokens + kDqWarpgroupRows - 1) / kDqWarpgroupRows, params.shape.num_q_heads);
  kernel<<<grid, kDqWarpgroupThreads, shared_bytes, stream>>>(
      params, delta, soft_cap_of(params.shape.softmax_scale, params.shape.logit_softcap));
  return cudaGetLastError();
}

}  // namespace membar::kernels::cuda::detail::warpgroup
