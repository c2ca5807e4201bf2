// The Hopper (sm_90a) dK/dV kernel of the paged-attention backward: warpgroup MMAs (wgmma) instead of
// mma.sync. The layout "wgmma_w8_k128" (BackwardLayout::kWgmmaW8K128), shipped for head sizes 64
// and 96 with pages of 128 keys on Hopper (since session 26: 0.83x and 0.94x SDPA flash on the H200,
// against 0.70x and 0.74x for the mma.sync layouts; Note [Layout choice] in
// membar/kernels/attention_cuda.h); bf16 and fp16, with or without a logit soft-cap, with or without
// a sliding window. At head size 128 it was chosen from session 25 to 31 and stays compiled there as
// an opt-in baseline: the warp-specialised backward (Note [Warp-specialised backward],
// attention_backward_wgmma_ws.cuh) replaced it in session 32. Internal to kernels/cuda/.
//
// Note [Warpgroup backward]
// Rationale: the mma.sync backward (Note [Backward split layout], attention_backward_kernel.cuh)
// stays below torch SDPA flash on an H200 (0.78x at a 32K history): Hopper's tensor cores reach
// their rate only through wgmma, as the warpgroup forward showed (Note [Warpgroup forward],
// attention_forward_wgmma.cuh). Its first GPU run (session 25, bench/results/2026-12-04-h200-session25)
// ran 338.8 TFLOP/s at 32K and 351.3 at 128K (1.07x SDPA flash) against the split layout's 247.8 and
// 257.4, with errors against float32 within those of the split layout.
// Approach: the work list, workspace, dQ atomics and epilogue of the split kernel (one CTA of
// two warpgroups, 256 threads, per (128-key page or chunk block, kv head); per item of 64 queries
// of one q head), with the four key-side products as wgmma. Warpgroup w owns keys 64 w .. 64 w + 63
// (M = its 64 keys) and keeps their dK and dV (64 x 128 fp32 each, 2 x 64 registers a thread) in
// registers for the whole loop. Per item and warpgroup:
//   S^T[64 keys x 64 queries] = K Q^T and dP^T = V dO^T: eight wgmma m64n64k16 each, K / V (A)
//     and Q / dO (B) K-major in shared memory (rows of head_dim), as Q and K in the forward;
//   P^T = exp2(S^T * scale log2e - lse log2e), masked (partial last page, causal diagonal of chunk
//     blocks, the sliding window's edge), dS^T = P^T o (dP^T - delta), in fp32: per warp the accumulator layout is that of
//     mma.m16n8 over 16 keys x 64 queries, exactly the layout of the first kernel of
//     attention_backward_kernel.cuh (key row 16 warp + lane / 4), whose masking code this reuses;
//   dV += P^T dO and dK += dS^T Q: four wgmma m64n128k16 each, P^T and dS^T as register A
//     fragments (as P in the forward), dO and Q as B MN-major (dims contiguous: the transpose bit,
//     as V in the forward, leading byte offset = one 64-dim half of the 64-row tile);
//   dQ: dS^T goes to shared memory ([128 keys, 64 queries], padded rows), a barrier, and the split
//     kernel's mma.sync phase 3 (warps 2 x 32 queries by 4 x 32 dims, K read by ldmatrix.trans
//     from the swizzled wgmma tile) adds dQ by fp32 atomics into the workspace; skipped in
//     deterministic mode (launch_backward_dq then runs, as for every layout).
// Why this split of the work: with M = 64 keys per warpgroup the dK/dV accumulators live in
// registers (no shared-memory round trip of P^T for the key-side products, as the split kernel
// needs), and S^T / dP^T come out per warp in the fragment layout the next products read.
// Q, dO, lse and delta of the next item load (cp.async, two stages) while the current one
// computes: the stage written after an item's first barrier was read by the previous item, whose
// MMAs every warp waited for before passing that barrier (wgmma_wait<0> below). Every copy into a
// stage is fenced (fence.proxy.async) before the barrier that publishes it to the tensor cores.
// Shared memory (bytes, base aligned to 1024 for the 128-byte swizzle, Note [Warpgroup shared
// layout]): K, V [2][128][64] (32 KiB each); Q, dO [2 stages][2][64][64] (16 KiB each per stage);
// dS^T [128][72] (TileLayout<64, true>); lse, delta [2 stages][64] fp32: 148 KiB.
// With kSoftcap S^T is capped and dS^T multiplied by the cap's slope (Note [Soft-capped scores in
// raw units] in attention_common.cuh); the capped build waits for dP^T before it forms P^T, so that
// the capped scores and dP^T are live together (no P^T math overlaps the MMAs there). A sliding
// window bounds each CTA's work list (own_keys) and hides the pairs past its edge, as in the split
// kernel (Note [Sliding window in the kernels]).
// Head size 64 is the same code with one 64-column half per tile, N = 64 for dV and dK, and 16 dQ
// columns per warp; 96 fills 1.5 halves (kBackwardTileDims) and 24 dQ columns per warp.
// Limitations: head_dim 64, 96 and 128 and pages of 128 keys, an sm_90 device with the sm_90a body
// built; 256 does not fit dK/dV in registers (Note [Warpgroup backward at head size 256] in
// attention_backward_wgmma_d2.cuh splits the columns between the warpgroups instead).
// Every MMA batch is waited for in full (only the P^T math overlaps the dP^T MMAs); dQ still goes
// through shared memory and mma.sync; at 255 registers a thread (0 spills, nvcc 13 for sm_90a)
// there is no room for deeper tiles.
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

inline constexpr int kBackwardKeys = 128;            // keys per CTA: one page
inline constexpr int kBackwardWarpgroupKeys = 64;    // keys per warpgroup (the wgmma M)
inline constexpr int kBackwardThreads = 256;         // two warpgroups
static_assert(kBackwardKeys == 2 * kBackwardWarpgroupKeys && kBackwardThreads == 2 * 128,
              "two warpgroups of 64 keys each");
inline constexpr int kBackwardQueryStages = 2;       // Q / dO / lse / delta stages
using BackwardScoreLayout = TileLayout<kQueries, true>;                                  // dS^T [128, 64], padded

// The head sizes the kernel is written for: dK/dV of 64 keys in registers (256 columns would not
// fit) and a dQ pass of 8-column tiles, head_dim / 4 columns a warp.
constexpr bool warpgroup_backward_head_dim(int head_dim) {
  return head_dim == 64 || head_dim == 96 || head_dim == 128;
}

// Columns of the tiles and of the dV / dK products: whole 64-column halves (the swizzled layout of
// Note [Warpgroup shared layout]). Head size 96 fills 1.5 halves: the loads leave columns 96-127
// of the second half unwritten, the S^T and dP^T products read only the first 96, and dV / dK run
// 128 columns wide, whose last 32 (products with whatever those unwritten columns hold) no one
// writes out: a column of dV or dK reads only its own column of dO or Q.
template <int kHeadDim>
inline constexpr int kBackwardTileDims = (kHeadDim + 63) / 64 * 64;

// K or V of the CTA's page, [tile dims / 64][128][64]; Q or dO of one stage, [tile dims / 64][64][64].
template <int kHeadDim>
inline constexpr int kBackwardKeyTileBytes = kBackwardKeys * kBackwardTileDims<kHeadDim> * 2;
template <int kHeadDim>
inline constexpr int kBackwardQueryTileBytes = kQueries * kBackwardTileDims<kHeadDim> * 2;

template <int kHeadDim>
constexpr size_t backward_shared_bytes() {
  // 1024 bytes of slack to align the base to a swizzle atom; K, V; Q, dO per stage; dS^T; lse and
  // delta per stage.
  return 1024 + 2 * size_t(kBackwardKeyTileBytes<kHeadDim>) +
         2 * size_t(kBackwardQueryStages) * kBackwardQueryTileBytes<kHeadDim> +
         size_t(kBackwardKeys) * BackwardScoreLayout::kStride * 2 + 2 * size_t(kBackwardQueryStages) * kQueries * 4;
}

#if MEMBAR_WGMMA_AVAILABLE
// Offset (in elements) of (row, column) in a [2][kTileRows][64] tile of Note [Warpgroup shared
// layout]; `column` a multiple of 8 (one 16-byte piece), as ldmatrix row addresses are.
template <int kTileRows>
__device__ __forceinline__ int warpgroup_tile_offset(int row, int column) {
  const int half = column / 64;
  const int piece = (column % 64) / 8;
  return half * kTileRows * 64 + row * 64 + ((piece ^ (row % 8)) * 8);
}
#endif  // MEMBAR_WGMMA_AVAILABLE

template <typename Element, int kHeadDim, bool kSoftcap>
__global__ void __launch_bounds__(kBackwardThreads, 1)
    paged_attention_backward_wgmma_kernel(const PagedAttentionBackwardParams params,
                                          const BackwardWorkspacePointers workspace, const SoftCap soft_cap) {
  static_assert(warpgroup_backward_head_dim(kHeadDim), "the warpgroup backward is written for head_dim 64, 96 or 128");
#if MEMBAR_WGMMA_AVAILABLE
  constexpr int kKeys = kBackwardKeys;
  constexpr int kThreads = kBackwardThreads;
  constexpr int kQueryStages = kBackwardQueryStages;
  constexpr int kKeyTileBytes = kBackwardKeyTileBytes<kHeadDim>;
  constexpr int kQueryTileBytes = kBackwardQueryTileBytes<kHeadDim>;
  using ScoreLayout = BackwardScoreLayout;
  extern __shared__ unsigned char shared_raw[];
  // Align to 1024 bytes (the swizzle atom; the descriptors' base offset is then 0).
  const uint32_t raw_address = shared_address(shared_raw);
  unsigned char* shared_base = shared_raw + (((raw_address + 1023u) & ~1023u) - raw_address);
  unsigned char* k_tile = shared_base;                                        // [D / 64][128][64]
  unsigned char* v_tile = k_tile + kKeyTileBytes;                             // [D / 64][128][64]
  unsigned char* q_tiles = v_tile + kKeyTileBytes;                            // [stages][D / 64][64][64]
  unsigned char* dout_tiles = q_tiles + kQueryStages * kQueryTileBytes;       // [stages][D / 64][64][64]
  Element* dst_tile = reinterpret_cast<Element*>(dout_tiles + kQueryStages * kQueryTileBytes);  // [128, 64], dS^T
  float* lse_tiles = reinterpret_cast<float*>(dst_tile + kKeys * ScoreLayout::kStride);  // [stages, 64], log2 units
  float* delta_tiles = lse_tiles + kQueryStages * kQueries;                              // [stages, 64]

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

  const OwnedKeys<Element> owned = own_keys<Element, kHeadDim, kKeys>(params, workspace);
  const WorkList work = owned.work;
  // A page no query tile selected (or, with a sliding window, no query sees) receives nothing:
  // adding zeros is a no-op.
  if (work.count == 0) return;
  // The owned keys' window edge (Note [Sliding window in the kernels]), read after the first
  // barrier of the loop; kNoWindowEdge without a window. In shared memory, so that no register
  // holds it across the loop.
  __shared__ int shared_window_edge;
  if (thread == 0) shared_window_edge = owned_window_edge(shape, owned);

  const Element* q = static_cast<const Element*>(params.q);
  const Element* dout = static_cast<const Element*>(params.dout);
  const float* lse = static_cast<const float*>(params.lse);
  auto load_queries = [&](int item, int stage) {
    const WorkItem queries = work_item<kHeadDim>(work, item, kv_head, group, q_row_stride);
    const int64_t offset = queries.offset;
    const int valid = chunk_tokens - queries.first_query;
    load_swizzled_rows<kQueries, kHeadDim, kThreads>(q_tiles + stage * kQueryTileBytes, q + offset, q_row_stride,
                                                    valid, thread);
    load_swizzled_rows<kQueries, kHeadDim, kThreads>(dout_tiles + stage * kQueryTileBytes, dout + offset,
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
  // Key rows of this thread (the accumulator layout of Note [Warpgroup backward]): key_row and
  // key_row + 8, with key_row = 64 warpgroup + 16 (warp in group) + lane / 4.
  const int key_row = warp * 16 + lane / 4;
  // Phase 3 (the split kernel's): 32 queries x D / 4 columns per warp.
  const int query_base = (warp / 4) * 32;
  const int dq_dim_base = (warp % 4) * (kHeadDim / 4);
  constexpr int kDqDimTiles = kHeadDim / 4 / 8;        // 2, 3 or 4
  constexpr int kProductDims = kBackwardTileDims<kHeadDim>;
  float dk[kProductDims / 8][4];
  float dv[kProductDims / 8][4];
  clear(dk);
  clear(dv);

  // This warpgroup's 64 rows of K and V (A operands, K-major).
  const uint32_t k_address = shared_address(k_tile) + warpgroup * kBackwardWarpgroupKeys * kRowBytes;
  const uint32_t v_address = shared_address(v_tile) + warpgroup * kBackwardWarpgroupKeys * kRowBytes;

  for (int item = 0; item < work.count; ++item) {
    const int stage = item % kQueryStages;
    const int next_stage = (item + 1) % kQueryStages;
    float next_lse = 0.f, next_delta = 0.f;
    copy_async_wait<0>();
    fence_proxy_async_shared();
    __syncthreads();
    // The stage written here was read by the previous item, which every warp finished (its MMAs
    // waited for) before the barrier above.
    if (item + 1 < work.count) {
      load_queries(item + 1, next_stage);
      if (thread < kQueries) read_row_statistics(item + 1, next_lse, next_delta);
    }
    copy_async_commit();

    int head_in_group, query_block;
    work.decode(item, head_in_group, query_block);
    const int first_query = query_block * kQueries;
    const uint32_t q_stage = shared_address(q_tiles + stage * kQueryTileBytes);
    const uint32_t dout_stage = shared_address(dout_tiles + stage * kQueryTileBytes);
    const float* row_lse = lse_tiles + stage * kQueries;
    const float* row_delta = delta_tiles + stage * kQueries;

    // S^T = K Q^T and dP^T = V dO^T, [64 keys, 64 queries] per warpgroup (Note [Warpgroup shared
    // layout]: the k step kk is half kk / 4, 32 bytes per step inside the row). Two commit groups:
    // the uncapped softmax part waits for S^T only.
    float scores[kQueries / 8][4];
    float dscores[kQueries / 8][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t half = kk / 4;
      const uint32_t column_bytes = (kk % 4) * 32;
      const uint64_t a = matrix_descriptor(k_address + half * kKeys * kRowBytes + column_bytes, 16, 1024);
      const uint64_t b = matrix_descriptor(q_stage + half * kQueries * kRowBytes + column_bytes, 16, 1024);
      wgmma_shared<Element, 64>(scores, a, b, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t half = kk / 4;
      const uint32_t column_bytes = (kk % 4) * 32;
      const uint64_t a = matrix_descriptor(v_address + half * kKeys * kRowBytes + column_bytes, 16, 1024);
      const uint64_t b = matrix_descriptor(dout_stage + half * kQueries * kRowBytes + column_bytes, 16, 1024);
      wgmma_shared<Element, 64>(dscores, a, b, kk > 0 ? 1 : 0);
    }
    wgmma_commit();

    // The pairs to hide: the partial last page, the causal diagonal of chunk blocks, and the
    // window's edge when the item's last query does not see the first owned key.
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
      // Capped: P^T and dS^T together, once dP^T is in (the slope needs the capped score).
      wgmma_wait<0>();
      fence_registers(scores);
      fence_registers(dscores);
#pragma unroll
      for (int n = 0; n < kQueries / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int query = n * 8 + 2 * (lane % 4) + (j & 1);
          const int key = key_row + (j >> 1) * 8;
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
      // P^T, while dP^T's MMAs run.
#pragma unroll
      for (int n = 0; n < kQueries / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int query = n * 8 + 2 * (lane % 4) + (j & 1);
          const int key = key_row + (j >> 1) * 8;
          float p = exp2f(scores[n][j] * scale_log2 - row_lse[query]);
          if (may_cut && !visible(key, query)) p = 0.f;
          scores[n][j] = p;
        }
      }
      wgmma_wait<0>();
      fence_registers(dscores);
      // dS^T = P^T o (dP^T - delta).
#pragma unroll
      for (int n = 0; n < kQueries / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int query = n * 8 + 2 * (lane % 4) + (j & 1);
          dscores[n][j] = scores[n][j] * (dscores[n][j] - row_delta[query]);
        }
      }
    }

    // dV += P^T dO and dK += dS^T Q, [64 keys, 128 dims] per warpgroup: P^T and dS^T as A
    // fragments in registers (k step kk = score tiles 2 kk, 2 kk + 1), dO and Q MN-major (the k
    // step kk, 16 queries, starts kk * 16 rows in; leading byte offset = one 64-dim half of 64 rows).
    uint32_t p_fragments[kQueries / 16][4];
    uint32_t ds_fragments[kQueries / 16][4];
    accumulator_to_a_fragments<Element, kQueries>(p_fragments, scores);
    accumulator_to_a_fragments<Element, kQueries>(ds_fragments, dscores);
    fence_registers(dv);
    fence_registers(dk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kQueries / 16; ++kk) {
      const uint64_t b = matrix_descriptor(dout_stage + kk * 16 * kRowBytes, kQueries * kRowBytes, 1024);
      wgmma_registers_transposed_b<Element, kProductDims>(dv, p_fragments[kk], b);
    }
#pragma unroll
    for (int kk = 0; kk < kQueries / 16; ++kk) {
      const uint64_t b = matrix_descriptor(q_stage + kk * 16 * kRowBytes, kQueries * kRowBytes, 1024);
      wgmma_registers_transposed_b<Element, kProductDims>(dk, ds_fragments[kk], b);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(dv);
    fence_registers(dk);

    if (workspace.dq_accumulator != nullptr) {
      // dS^T to shared memory: [128 keys, 64 queries].
#pragma unroll
      for (int n = 0; n < kQueries / 8; ++n) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int column = n * 8 + 2 * (lane % 4);
          *reinterpret_cast<uint32_t*>(dst_tile + ScoreLayout::offset(key_row + half * 8, column)) =
              ds_fragments[n / 2][(n % 2) * 2 + half];
        }
      }
      __syncthreads();

      // Phase 3 of Note [Backward split layout]: dQ [32 queries, D / 4 columns] = dS K, with dS
      // read transposed from dS^T and K from the swizzled wgmma tile.
      float dq[2][kDqDimTiles][4];
#pragma unroll
      for (int t = 0; t < 2; ++t) clear(dq[t]);
      const Element* k_elements = reinterpret_cast<const Element*>(k_tile);
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        uint32_t a[2][4];
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          // Matrices (stored k x m): (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15).
          ldmatrix_x4_trans(a[t], dst_tile + ScoreLayout::offset(kk * 16 + (lane & 7) + (lane >> 4) * 8,
                                                                 query_base + t * 16 + ((lane >> 3) & 1) * 8));
        }
#pragma unroll
        for (int nn = 0; nn < (kDqDimTiles + 1) / 2; ++nn) {
          // 16 columns of K (an odd last tile, head size 96: the next warp's 8 columns, or for the
          // last warp 8 unwritten ones, loaded and not used).
          uint32_t b[4];
          ldmatrix_x4_trans(b, k_elements + warpgroup_tile_offset<kKeys>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                                         dq_dim_base + nn * 16 + (lane >> 4) * 8));
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            ElementTraits<Element>::mma(dq[t][2 * nn], a[t], b[0], b[1]);
            if (2 * nn + 1 < kDqDimTiles) ElementTraits<Element>::mma(dq[t][2 * nn + 1], a[t], b[2], b[3]);
          }
        }
      }
      const int q_head = kv_head * group + head_in_group;
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int position = first_query + query_base + t * 16 + lane / 4 + half * 8;
          if (position >= chunk_tokens) continue;
          float* row =
              workspace.dq_accumulator + int64_t(position) * q_row_stride + int64_t(q_head) * kHeadDim + dq_dim_base;
#pragma unroll
          for (int n = 0; n < kDqDimTiles; ++n) {
            const int column = n * 8 + 2 * (lane % 4);
            atomicAdd(reinterpret_cast<float2*>(row + column), make_float2(dq[t][n][2 * half], dq[t][n][2 * half + 1]));
          }
        }
      }
    }
    // The next stage's statistics: read by the next item after its first barrier; their slots were
    // last read by the previous item, before this item's first barrier.
    if (item + 1 < work.count && thread < kQueries) {
      lse_tiles[next_stage * kQueries + thread] = next_lse;
      delta_tiles[next_stage * kQueries + thread] = next_delta;
    }
  }
  // Leave no copy in flight.
  copy_async_wait<0>();

  // Write dK (scaled) and dV once: overwritten for chunk keys, ADDED into the grad pages.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key_row + half * 8;
    if (key >= owned.valid_keys) continue;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      write_key_gradients<Element, kHeadDim>(params, owned.chunk_block, owned.first_key, owned.page, key,
                                             n * 8 + 2 * (lane % 4), dk[n][2 * half], dk[n][2 * half + 1],
                                             dv[n][2 * half], dv[n][2 * half + 1]);
    }
  }
#else
  // Built for a GPU without wgmma (an architecture list without sm_90a): the layout choice never
  // picks this layout there (CudaTarget::warpgroup_kernels), so reaching this is a bug; stop loudly
  // rather than return a wrong result.
  __trap();
#endif  // MEMBAR_WGMMA_AVAILABLE
}

// The dK/dV launch of the warpgroup backward (a detail::KvLaunch) for one dtype, capped or not.
template <typename Element, int kHeadDim, bool kSoftcap>
cudaError_t launch_backward_kv(const PagedAttentionBackwardParams& params, const BackwardWorkspacePointers& workspace,
                               cudaStream_t stream) {
  constexpr size_t kSharedBytes = backward_shared_bytes<kHeadDim>();
  auto kernel = paged_attention_backward_wgmma_kernel<Element, kHeadDim, kSoftcap>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSharedBytes));
  if (error != cudaSuccess) return error;
  BackwardWorkspacePointers owners = workspace;
  owners.num_chunk_blocks = chunk_owner_count<kBackwardKeys>(params.shape);
  const dim3 grid(owner_count<kBackwardKeys>(params.shape, owners.num_chunk_blocks), params.shape.num_kv_heads);
  if (grid.x == 0) return cudaSuccess;  // no key at all (attend_chunk false, empty history)
  kernel<<<grid, kBackwardThreads, kSharedBytes, stream>>>(
      params, owners, soft_cap_of(params.shape.softmax_scale, params.shape.logit_softcap));
  return cudaGetLastError();
}

}  // namespace membar::kernels::cuda::detail::warpgroup
