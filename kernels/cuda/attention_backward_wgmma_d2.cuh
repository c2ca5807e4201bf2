// The Hopper (sm_90a) dK/dV kernel of the paged-attention backward at head size 256: warpgroup MMAs
// (wgmma), the dK/dV columns split between the two warpgroups. The layout "wgmma_w8_k64_d2"
// (BackwardLayout::kWgmmaW8K64D2) for head_dim 256 and pages of 64 or 128 keys on Hopper (Note
// [Layout choice] in membar/kernels/attention_cuda.h); bf16 and fp16, with or without a logit
// soft-cap, with or without a sliding window. Internal to kernels/cuda/.
//
// Note [Warpgroup backward at head size 256]
// Rationale: the warpgroup backward of Note [Warpgroup backward] (attention_backward_wgmma.cuh) keeps
// a warpgroup's dK and dV of 64 keys x head_dim in registers: at head size 256 that is 256 fp32
// registers a thread for them alone. The mma.sync layout that ran head size 256 instead (two passes
// of half the columns, "w4_k64_dq32_pad_s2_d2") reached 0.46x SDPA flash on the H200 (session 25),
// and Gemma 2 / 3 train with head size 256.
// Approach: one CTA of two warpgroups (256 threads) per 64 keys (a page of 64, or half a page of
// 128) and kv head, over the work list of the other layouts (per item 64 queries of one q head).
// Warpgroup w keeps dK and dV of all 64 keys for the columns 128 w .. 128 w + 127 (2 x 64
// registers a thread), as FlashAttention-3 splits them for this head size. Per item:
//   S^T[64 keys x 32 queries] = K Q^T and dP^T = V dO^T, warpgroup w taking the queries 32 w ..
//     32 w + 31: sixteen wgmma m64n32k16 each over the four 64-dim halves, A and B K-major;
//   P^T and dS^T in fp32 as in Note [Warpgroup backward] (same masking), then stored as Element into
//     shared memory ([64 keys][64 queries], the 128-byte swizzle of Note [Warpgroup shared layout])
//     and published to the tensor cores (fence.proxy.async, a barrier): each warpgroup's dV and dK
//     need every query of the item, half of which the other warpgroup scored;
//   dV += P^T dO and dK += dS^T Q over the warpgroup's 128 columns: four wgmma m64n128k16 each, A
//     from shared memory K-major, B (dO, Q) MN-major (the transpose bit);
//   dQ[64 queries x 128 columns of the warpgroup] = dS K: four wgmma m64n128k16, A = dS^T read
//     MN-major (transposed), B = K MN-major, then added by fp32 atomics into the workspace (skipped
//     in deterministic mode: launch_backward_dq then runs, as for every layout).
// The dV, dK and dQ MMAs are issued together and waited for once. Q, dO, lse and delta of the next
// item load (cp.async, two stages) while the current one computes: the stage written after an
// item's first barrier, and the P^T / dS^T tiles written after it, were read by the previous
// item, whose MMAs every warp waited for before passing that barrier.
// Shared memory (bytes, base aligned to 1024): K, V [4][64][64] (32 KiB each); Q, dO [2 stages][4]
// [64][64] (32 KiB each per stage); P^T, dS^T [64][64] (8 KiB each); lse, delta [2 stages][64] fp32:
// 210 KiB (one CTA an SM).
// With kSoftcap S^T is capped and dS^T multiplied by the cap's slope, as in Note [Warpgroup
// backward]; a sliding window bounds the work list and hides the pairs past its edge.
// Limitations: head size 256 only; an sm_90 device with the sm_90a body built. S^T and dP^T are
// N = 32 products (the K and V tiles are read twice per item, once by each warpgroup); the dQ
// atomics are four times the warpgroup backward's per key (64 keys a CTA, twice the columns).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_backward_common.cuh"
#include "attention_common.cuh"
#include "attention_cuda_internal.h"
#include "attention_wgmma.cuh"

namespace membar::kernels::cuda::detail::warpgroup {

inline constexpr int kWideHeadDim = 256;
inline constexpr int kWideKeys = 64;            // keys per CTA
inline constexpr int kWideThreads = 256;        // two warpgroups
inline constexpr int kWideQueryStages = 2;
inline constexpr int kWideWarpgroupQueries = kQueries / 2;        // S^T / dP^T columns per warpgroup
inline constexpr int kWideWarpgroupColumns = kWideHeadDim / 2;    // dK / dV / dQ columns per warpgroup
inline constexpr int kWideKeyTileBytes = kWideKeys * kWideHeadDim * 2;      // [4][64][64]
inline constexpr int kWideQueryTileBytes = kQueries * kWideHeadDim * 2;     // [4][64][64]
inline constexpr int kWideScoreTileBytes = kWideKeys * kQueries * 2;        // [64][64]
static_assert(kWideKeys == 64 && kQueries == 64, "one 64-row swizzled half per score tile");

constexpr size_t wide_backward_shared_bytes() {
  return 1024 + 2 * size_t(kWideKeyTileBytes) + 2 * size_t(kWideQueryStages) * kWideQueryTileBytes +
         2 * size_t(kWideScoreTileBytes) + 2 * size_t(kWideQueryStages) * kQueries * 4;
}

template <typename Element, bool kSoftcap>
__global__ void __launch_bounds__(kWideThreads, 1)
    paged_attention_backward_wgmma_d2_kernel(const PagedAttentionBackwardParams params,
                                             const BackwardWorkspacePointers workspace, const SoftCap soft_cap) {
#if MEMBAR_WGMMA_AVAILABLE
  constexpr int kHeadDim = kWideHeadDim;
  constexpr int kKeys = kWideKeys;
  constexpr int kThreads = kWideThreads;
  constexpr int kStages = kWideQueryStages;
  constexpr int kHalfBytes = 64 * kRowBytes;  // one 64-dim half of a 64-row tile
  extern __shared__ unsigned char shared_raw[];
  const uint32_t raw_address = shared_address(shared_raw);
  unsigned char* shared_base = shared_raw + (((raw_address + 1023u) & ~1023u) - raw_address);
  unsigned char* k_tile = shared_base;                                     // [4][64][64]
  unsigned char* v_tile = k_tile + kWideKeyTileBytes;                      // [4][64][64]
  unsigned char* q_tiles = v_tile + kWideKeyTileBytes;                     // [stages][4][64][64]
  unsigned char* dout_tiles = q_tiles + kStages * kWideQueryTileBytes;     // [stages][4][64][64]
  unsigned char* p_tile = dout_tiles + kStages * kWideQueryTileBytes;      // P^T [64 keys][64 queries]
  unsigned char* ds_tile = p_tile + kWideScoreTileBytes;                   // dS^T [64 keys][64 queries]
  float* lse_tiles = reinterpret_cast<float*>(ds_tile + kWideScoreTileBytes);  // [stages, 64], log2 units
  float* delta_tiles = lse_tiles + kStages * kQueries;                         // [stages, 64]

  const PagedAttentionShape& shape = params.shape;
  const int thread = threadIdx.x;
  const int warp = thread / 32;
  const int warpgroup = thread / 128;
  const int lane = thread % 32;
  const int kv_head = blockIdx.y;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int chunk_tokens = shape.chunk_tokens;
  const int64_t q_row_stride = int64_t(shape.num_q_heads) * kHeadDim;
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;

  const OwnedKeys<Element> owned = own_keys<Element, kHeadDim, kKeys, /*kPageParts=*/true>(params, workspace);
  const WorkList work = owned.work;
  if (work.count <= 0) return;
  __shared__ int shared_window_edge;
  if (thread == 0) shared_window_edge = owned_window_edge(shape, owned);

  const Element* q = static_cast<const Element*>(params.q);
  const Element* dout = static_cast<const Element*>(params.dout);
  const float* lse = static_cast<const float*>(params.lse);
  auto load_queries = [&](int item, int stage) {
    const WorkItem queries = work_item<kHeadDim>(work, item, kv_head, group, q_row_stride);
    const int64_t offset = queries.offset;
    const int valid = chunk_tokens - queries.first_query;
    load_swizzled_rows<kQueries, kHeadDim, kThreads>(q_tiles + stage * kWideQueryTileBytes, q + offset, q_row_stride,
                                                    valid, thread);
    load_swizzled_rows<kQueries, kHeadDim, kThreads>(dout_tiles + stage * kWideQueryTileBytes, dout + offset,
                                                    q_row_stride, valid, thread);
  };
  // lse (in log2 units) and delta of the item's query row `thread` (query_row_statistics).
  auto read_row_statistics = [&](int item, float& row_lse, float& row_delta) {
    const WorkItem queries = work_item<kHeadDim>(work, item, kv_head, group, q_row_stride);
    query_row_statistics(lse, workspace.delta, chunk_tokens, queries.q_head, queries.first_query + thread, row_lse,
                         row_delta);
  };

  load_swizzled_rows<kKeys, kHeadDim, kThreads>(k_tile, owned.k_base, kv_row_stride, owned.valid_keys, thread);
  load_swizzled_rows<kKeys, kHeadDim, kThreads>(v_tile, owned.v_base, kv_row_stride, owned.valid_keys, thread);
  load_queries(0, 0);
  copy_async_commit();
  if (thread < kQueries) read_row_statistics(0, lse_tiles[thread], delta_tiles[thread]);

  const float scale_log2 = shape.softmax_scale * kLog2e;
  // Accumulator rows of this thread in every product: 16 (warp in group) + lane / 4, and + 8.
  const int fragment_row = (warp % 4) * 16 + lane / 4;
  // The warpgroup's queries of S^T / dP^T and its columns of dK / dV / dQ.
  const int query_base = warpgroup * kWideWarpgroupQueries;
  const int column_half = warpgroup * (kWideWarpgroupColumns / 64);  // its first 64-dim half
  float dk[kWideWarpgroupColumns / 8][4];
  float dv[kWideWarpgroupColumns / 8][4];
  clear(dk);
  clear(dv);
  const uint32_t k_address = shared_address(k_tile);
  const uint32_t v_address = shared_address(v_tile);
  const uint32_t p_address = shared_address(p_tile);
  const uint32_t ds_address = shared_address(ds_tile);
  Element* p_elements = reinterpret_cast<Element*>(p_tile);
  Element* ds_elements = reinterpret_cast<Element*>(ds_tile);

  for (int item = 0; item < work.count; ++item) {
    const int stage = item % kStages;
    const int next_stage = (item + 1) % kStages;
    float next_lse = 0.f, next_delta = 0.f;
    copy_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();
    if (item + 1 < work.count) {
      load_queries(item + 1, next_stage);
      if (thread < kQueries) read_row_statistics(item + 1, next_lse, next_delta);
    }
    copy_async_commit();

    int head_in_group, query_block;
    work.decode(item, head_in_group, query_block);
    const int first_query = query_block * kQueries;
    const uint32_t q_stage = shared_address(q_tiles + stage * kWideQueryTileBytes);
    const uint32_t dout_stage = shared_address(dout_tiles + stage * kWideQueryTileBytes);
    const float* row_lse = lse_tiles + stage * kQueries;
    const float* row_delta = delta_tiles + stage * kQueries;

    // S^T and dP^T of the warpgroup's 32 queries (rows query_base .. of the Q / dO tiles).
    float scores[kWideWarpgroupQueries / 8][4];
    float dscores[kWideWarpgroupQueries / 8][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t half_bytes = (kk / 4) * kHalfBytes;
      const uint32_t column_bytes = (kk % 4) * 32;
      const uint64_t a = matrix_descriptor(k_address + half_bytes + column_bytes, 16, 1024);
      const uint64_t b = matrix_descriptor(q_stage + half_bytes + query_base * kRowBytes + column_bytes, 16, 1024);
      wgmma_shared<Element, kWideWarpgroupQueries>(scores, a, b, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t half_bytes = (kk / 4) * kHalfBytes;
      const uint32_t column_bytes = (kk % 4) * 32;
      const uint64_t a = matrix_descriptor(v_address + half_bytes + column_bytes, 16, 1024);
      const uint64_t b = matrix_descriptor(dout_stage + half_bytes + query_base * kRowBytes + column_bytes, 16, 1024);
      wgmma_shared<Element, kWideWarpgroupQueries>(dscores, a, b, kk > 0 ? 1 : 0);
    }
    wgmma_commit();

    const int window_edge = shared_window_edge;
    const bool window_cuts = window_edge <= first_query + kQueries - 1;
    const bool may_cut = owned.valid_keys < kKeys ||
                         (owned.chunk_block && owned.first_key + kKeys - 1 > first_query) || window_cuts;
    auto visible = [&](int key, int query) {
      bool seen = key < owned.valid_keys;
      if (owned.chunk_block) seen = seen && owned.first_key + key <= first_query + query;
      if (window_cuts) seen = seen && key + window_edge > first_query + query;
      return seen;
    };
    if constexpr (kSoftcap) {
      wgmma_wait<0>();
      fence_registers(scores);
      fence_registers(dscores);
#pragma unroll
      for (int n = 0; n < kWideWarpgroupQueries / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int query = query_base + n * 8 + 2 * (lane % 4) + (j & 1);
          const int key = fragment_row + (j >> 1) * 8;
          const float capped = soft_cap.capped(scores[n][j]);
          float p = exp2f(capped * scale_log2 - row_lse[query]);
          if (may_cut && !visible(key, query)) p = 0.f;
          scores[n][j] = p;
          dscores[n][j] = p * (dscores[n][j] - row_delta[query]) * soft_cap.slope(capped);
        }
      }
    } else {
      wgmma_wait<1>();
      fence_registers(scores);
#pragma unroll
      for (int n = 0; n < kWideWarpgroupQueries / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int query = query_base + n * 8 + 2 * (lane % 4) + (j & 1);
          const int key = fragment_row + (j >> 1) * 8;
          float p = exp2f(scores[n][j] * scale_log2 - row_lse[query]);
          if (may_cut && !visible(key, query)) p = 0.f;
          scores[n][j] = p;
        }
      }
      wgmma_wait<0>();
      fence_registers(dscores);
#pragma unroll
      for (int n = 0; n < kWideWarpgroupQueries / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int query = query_base + n * 8 + 2 * (lane % 4) + (j & 1);
          dscores[n][j] = scores[n][j] * (dscores[n][j] - row_delta[query]);
        }
      }
    }

    // P^T and dS^T into the swizzled score tiles, pairs of queries at once.
#pragma unroll
    for (int n = 0; n < kWideWarpgroupQueries / 8; ++n) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int key = fragment_row + half * 8;
        const int column = query_base + n * 8;
        const int offset = warpgroup_tile_offset<kKeys>(key, column) + 2 * (lane % 4);
        *reinterpret_cast<uint32_t*>(p_elements + offset) =
            ElementTraits<Element>::pack(scores[n][2 * half], scores[n][2 * half + 1]);
        *reinterpret_cast<uint32_t*>(ds_elements + offset) =
            ElementTraits<Element>::pack(dscores[n][2 * half], dscores[n][2 * half + 1]);
      }
    }
    fence_proxy_async_shared();
    __syncthreads();

    // dV += P^T dO and dK += dS^T Q over the warpgroup's columns (k step kk: 16 queries), then
    // dQ = dS K (k step kk: 16 keys), all in one commit group.
    fence_registers(dv);
    fence_registers(dk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kQueries / 16; ++kk) {
      const uint64_t a = matrix_descriptor(p_address + kk * 32, 16, 1024);
      const uint64_t b = matrix_descriptor(dout_stage + column_half * kHalfBytes + kk * 16 * kRowBytes, kHalfBytes, 1024);
      wgmma_shared_transposed<Element, 128, false, true>(dv, a, b, 1);
    }
#pragma unroll
    for (int kk = 0; kk < kQueries / 16; ++kk) {
      const uint64_t a = matrix_descriptor(ds_address + kk * 32, 16, 1024);
      const uint64_t b = matrix_descriptor(q_stage + column_half * kHalfBytes + kk * 16 * kRowBytes, kHalfBytes, 1024);
      wgmma_shared_transposed<Element, 128, false, true>(dk, a, b, 1);
    }
    // (In deterministic mode dQ is computed and dropped: a branch around these MMAs made the
    // compiler serialise the warpgroup's MMAs.)
    float dq[kWideWarpgroupColumns / 8][4];
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint64_t a = matrix_descriptor(ds_address + kk * 16 * kRowBytes, kHalfBytes, 1024);
      const uint64_t b = matrix_descriptor(k_address + column_half * kHalfBytes + kk * 16 * kRowBytes, kHalfBytes, 1024);
      wgmma_shared_transposed<Element, 128, true, true>(dq, a, b, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(dv);
    fence_registers(dk);
    fence_registers(dq);
    if (workspace.dq_accumulator != nullptr) {
      const int q_head = kv_head * group + head_in_group;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int position = first_query + fragment_row + half * 8;
        if (position >= chunk_tokens) continue;
        float* row = workspace.dq_accumulator + int64_t(position) * q_row_stride + int64_t(q_head) * kHeadDim +
                     warpgroup * kWideWarpgroupColumns;
#pragma unroll
        for (int n = 0; n < kWideWarpgroupColumns / 8; ++n) {
          const int column = n * 8 + 2 * (lane % 4);
          atomicAdd(reinterpret_cast<float2*>(row + column), make_float2(dq[n][2 * half], dq[n][2 * half + 1]));
        }
      }
    }
    if (item + 1 < work.count && thread < kQueries) {
      lse_tiles[next_stage * kQueries + thread] = next_lse;
      delta_tiles[next_stage * kQueries + thread] = next_delta;
    }
  }
  copy_async_wait<0>();

  // Write dK (scaled) and dV of the warpgroup's columns once: overwritten for chunk keys, ADDED into
  // the grad pages.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = fragment_row + half * 8;
    if (key >= owned.valid_keys) continue;
#pragma unroll
    for (int n = 0; n < kWideWarpgroupColumns / 8; ++n) {
      write_key_gradients<Element, kHeadDim, /*kPageParts=*/true>(
          params, owned.chunk_block, owned.first_key, owned.page, key,
          warpgroup * kWideWarpgroupColumns + n * 8 + 2 * (lane % 4), dk[n][2 * half], dk[n][2 * half + 1],
          dv[n][2 * half], dv[n][2 * half + 1]);
    }
  }
#else
  __trap();
#endif  // MEMBAR_WGMMA_AVAILABLE
}

// The dK/dV launch of the head-size-256 warpgroup backward (a detail::KvLaunch), capped or not.
template <typename Element, int kHeadDim, bool kSoftcap>
cudaError_t launch_backward_kv_d2(const PagedAttentionBackwardParams& params, const BackwardWorkspacePointers& workspace,
                                  cudaStream_t stream) {
  static_assert(kHeadDim == kWideHeadDim, "the split-column warpgroup backward is written for head_dim 256");
  constexpr size_t kSharedBytes = wide_backward_shared_bytes();
  auto kernel = paged_attention_backward_wgmma_d2_kernel<Element, kSoftcap>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSharedBytes));
  if (error != cudaSuccess) return error;
  BackwardWorkspacePointers owners = workspace;
  owners.num_chunk_blocks = chunk_owner_count<kWideKeys>(params.shape);
  const dim3 grid(owner_count<kWideKeys>(params.shape, owners.num_chunk_blocks), params.shape.num_kv_heads);
  if (grid.x == 0) return cudaSuccess;
  kernel<<<grid, kWideThreads, kSharedBytes, stream>>>(
      params, owners, soft_cap_of(params.shape.softmax_scale, params.shape.logit_softcap));
  return cudaGetLastError();
}

}  // namespace membar::kernels::cuda::detail::warpgroup
