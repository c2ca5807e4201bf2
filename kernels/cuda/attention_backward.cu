// Paged attention backward on CUDA (FlashAttention-2 style, mma.sync tensor cores).
//
// Note [Backward kernel]
// Rationale: a backward that adds dK/dV into shared pages from every query tile and q head
// (atomics) ran 20x slower than FlashAttention's (../shared/docs/measured.md). Here every KV
// block has exactly one owner.
// Approach: one CTA per (KV block, kv head). A KV block is one history page (page_tokens = 64 or
// 128 keys, 16 keys per warp) or a block of the chunk's own keys of the same size. The CTA keeps
// its K and V in shared memory and loops over the (q head of the GQA group, block of 64 queries)
// pairs that attend to it: every query block for a dense history page, the query blocks of the
// tiles that selected the page in sparse mode (the inverse selection, built by
// build_inverse_selection_kernel), and the query blocks at or after the block's first key for a
// chunk block. Q and dO of the next pair load (cp.async, three stages) while the current pair
// computes:
//   S^T = K Q^T, P^T = exp(S^T * scale - lse), dP^T = V dO^T, dS^T = P^T o (dP^T - delta),
//   dV += P^T dO, dK += dS^T Q                                  (registers, per warp),
//   dQ += dS K                                                  (dS^T through shared memory,
//                                                                fp32 atomics into workspace).
// At the end the CTA writes dK, dV once: overwritten for chunk keys, ADDED (fp32, or bf16 with
// round-to-nearest-even) into the grad pages for history keys. No two CTAs touch the same rows, so
// dK/dV are deterministic. delta = rowsum(dO o O) comes from a small kernel first.
// Deterministic mode leaves dQ out of this kernel and runs launch_backward_dq instead, which owns
// each query block and walks its keys like the forward (no atomics; costs two more products).
// Limitations: the chunk blocks have unequal work (causal); they run first in the grid so the
// uniform history blocks fill in behind them.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "attention_backward_common.cuh"
#include "attention_common.cuh"
#include "attention_cuda_internal.h"
#include "attention_wgmma.h"

namespace membar::kernels::cuda {
namespace {

using namespace detail;

// Q/dO stages: three, so that no barrier is needed at the end of an iteration (a stage is
// rewritten two iterations after it was read, and every warp finished that iteration before
// passing the current one's first barrier; dS^T is rewritten only after that barrier too).
constexpr int kStages = 3;

template <int kHeadDim, int kWarps, bool kPadded>
constexpr size_t backward_shared_bytes() {
  constexpr int kKeys = 16 * kWarps;
  constexpr int kStride = TileLayout<kHeadDim, kPadded>::kStride;
  constexpr int kScoreStride = TileLayout<kQueries, kPadded>::kStride;
  // K, V [kKeys, D]; Q, dO [kStages, 64, D]; dS^T [kKeys, 64] (16-bit, rows of kStride elements);
  // lse, delta [kStages, 64] fp32.
  return size_t(2 * kKeys * kStride + 2 * kStages * kQueries * kStride + kKeys * kScoreStride) * 2 +
         2 * kStages * kQueries * 4;
}

// kDqPieces: each warp computes its part of dQ in this many pieces of columns, one after the
// other, so that fewer accumulators are live next to dK and dV (the whole part, 64 columns at
// head_dim 128, made the kernel spill).
// kPadded: padded instead of swizzled tiles (Note [Padded tiles]).
template <typename Element, int kHeadDim, int kWarps, int kDqPieces, bool kPadded>
__global__ void __launch_bounds__(kWarps * 32, 1)
    paged_attention_backward_kv_kernel(const PagedAttentionBackwardParams params, const BackwardWorkspacePointers workspace) {
  constexpr int kKeys = 16 * kWarps;
  constexpr int kThreads = kWarps * 32;
  constexpr int kStride = TileLayout<kHeadDim, kPadded>::kStride;
  using ScoreLayout = TileLayout<kQueries, kPadded>;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  Element* k_tile = reinterpret_cast<Element*>(shared_raw);   // [kKeys, D]
  Element* v_tile = k_tile + kKeys * kStride;                   // [kKeys, D]
  Element* q_tiles = v_tile + kKeys * kStride;                  // [kStages, 64, D]
  Element* dout_tiles = q_tiles + kStages * kQueries * kStride;   // [kStages, 64, D]
  Element* ds_tile = dout_tiles + kStages * kQueries * kStride;   // [kKeys, 64], dS^T
  float* lse_tiles = reinterpret_cast<float*>(ds_tile + kKeys * ScoreLayout::kStride);  // [kStages, 64], log2 units
  float* delta_tiles = lse_tiles + kStages * kQueries;                        // [kStages, 64]

  const PagedAttentionShape& shape = params.shape;
  const int thread = threadIdx.x;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const int kv_head = blockIdx.y;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int chunk_tokens = shape.chunk_tokens;
  const int64_t q_row_stride = int64_t(shape.num_q_heads) * kHeadDim;
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;

  // Which keys this CTA owns, and which query blocks see them.
  const OwnedKeys<Element> owned = own_keys<Element, kHeadDim, kKeys>(params, workspace);
  const bool chunk_block = owned.chunk_block;
  const Element* k_base = owned.k_base;
  const Element* v_base = owned.v_base;
  const int valid_keys = owned.valid_keys;
  const int first_key = owned.first_key;
  const int page = owned.page;
  const WorkList work = owned.work;
  // A page no query tile selected receives nothing: adding zeros is a no-op.
  if (work.count == 0) return;

  const Element* q = static_cast<const Element*>(params.q);
  const Element* dout = static_cast<const Element*>(params.dout);
  const float* lse = static_cast<const float*>(params.lse);
  auto load_queries = [&](int item, int stage) {
    int head_in_group, query_block;
    work.decode(item, head_in_group, query_block);
    const int q_head = kv_head * group + head_in_group;
    const int64_t offset = int64_t(query_block) * kQueries * q_row_stride + int64_t(q_head) * kHeadDim;
    const int valid = chunk_tokens - query_block * kQueries;
    load_tile_async<Element, kQueries, kHeadDim, kThreads, kPadded>(q_tiles + stage * kQueries * kStride, q + offset,
                                                                     q_row_stride, valid, thread);
    load_tile_async<Element, kQueries, kHeadDim, kThreads, kPadded>(dout_tiles + stage * kQueries * kStride,
                                                                     dout + offset, q_row_stride, valid, thread);
  };
  // lse (in log2 units) and delta of one query row; rows past the chunk get lse = +inf, so P = 0.
  auto read_row_statistics = [&](int item, float& row_lse, float& row_delta) {
    int head_in_group, query_block;
    work.decode(item, head_in_group, query_block);
    const int q_head = kv_head * group + head_in_group;
    const int position = query_block * kQueries + thread;
    if (position < chunk_tokens) {
      // lse = -inf: the row sees no key (Note [Blocked history]); +inf makes its P exactly 0.
      const float value = lse[int64_t(q_head) * chunk_tokens + position];
      row_lse = value == -INFINITY ? INFINITY : value * kLog2e;
      row_delta = workspace.delta[int64_t(q_head) * chunk_tokens + position];
    } else {
      row_lse = INFINITY;
      row_delta = 0.f;
    }
  };

  load_tile_async<Element, kKeys, kHeadDim, kThreads, kPadded>(k_tile, k_base, kv_row_stride, valid_keys, thread);
  load_tile_async<Element, kKeys, kHeadDim, kThreads, kPadded>(v_tile, v_base, kv_row_stride, valid_keys, thread);
  load_queries(0, 0);
  copy_async_commit();
  if (thread < kQueries) read_row_statistics(0, lse_tiles[thread], delta_tiles[thread]);

  const float scale_log2 = shape.softmax_scale * kLog2e;
  float dk[kHeadDim / 8][4];
  float dv[kHeadDim / 8][4];
  clear(dk);
  clear(dv);
  // Key rows of this thread: warp * 16 + lane / 4 and that + 8.
  const int key_row = warp * 16 + lane / 4;

  for (int item = 0; item < work.count; ++item) {
    const int stage = item % kStages;
    const int next_stage = (item + 1) % kStages;
    float next_lse = 0.f, next_delta = 0.f;
    if (item + 1 < work.count) {
      load_queries(item + 1, next_stage);
      if (thread < kQueries) read_row_statistics(item + 1, next_lse, next_delta);
    }
    copy_async_commit();
    copy_async_wait<1>();
    __syncthreads();

    int head_in_group, query_block;
    work.decode(item, head_in_group, query_block);
    const int first_query = query_block * kQueries;
    if (first_query < chunk_tokens) {
      const Element* q_tile = q_tiles + stage * kQueries * kStride;
      const Element* dout_tile = dout_tiles + stage * kQueries * kStride;
      const float* row_lse = lse_tiles + stage * kQueries;
      const float* row_delta = delta_tiles + stage * kQueries;

      float scores[kQueries / 8][4];   // S^T: [16 keys, 64 queries] per warp
      float dscores[kQueries / 8][4];  // dP^T, then dS^T
      clear(scores);
      clear(dscores);
      warp_matmul_shared_nt<Element, kQueries, kHeadDim, kHeadDim, kHeadDim, kPadded>(scores, k_tile, warp * 16, q_tile, 0, lane);
      warp_matmul_shared_nt<Element, kQueries, kHeadDim, kHeadDim, kHeadDim, kPadded>(dscores, v_tile, warp * 16, dout_tile, 0,
                                                                             lane);
      const bool may_cut = valid_keys < kKeys || (chunk_block && first_key + kKeys - 1 > first_query);
#pragma unroll
      for (int n = 0; n < kQueries / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int query = n * 8 + 2 * (lane % 4) + (j & 1);
          const int key = key_row + (j >> 1) * 8;
          float p = exp2f(scores[n][j] * scale_log2 - row_lse[query]);
          if (may_cut) {
            bool visible = key < valid_keys;
            if (chunk_block) visible = visible && first_key + key <= first_query + query;
            if (!visible) p = 0.f;
          }
          scores[n][j] = p;
          dscores[n][j] = p * (dscores[n][j] - row_delta[query]);
        }
      }
      uint32_t fragments[kQueries / 16][4];
      accumulator_to_a_fragments<Element, kQueries>(fragments, scores);
      warp_matmul_registers_nn<Element, kHeadDim, kQueries, kHeadDim, kPadded>(dv, fragments, dout_tile, 0, 0, lane);
      accumulator_to_a_fragments<Element, kQueries>(fragments, dscores);
      warp_matmul_registers_nn<Element, kHeadDim, kQueries, kHeadDim, kPadded>(dk, fragments, q_tile, 0, 0, lane);

      if (workspace.dq_accumulator != nullptr) {
        // dS^T to shared memory: [kKeys, 64].
#pragma unroll
        for (int n = 0; n < kQueries / 8; ++n) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int column = n * 8 + 2 * (lane % 4);
            *reinterpret_cast<uint32_t*>(ds_tile + ScoreLayout::offset(key_row + half * 8, column)) =
                fragments[n / 2][(n % 2) * 2 + half];
          }
        }
        __syncthreads();
        // dQ [64, D] = dS [64, kKeys] K [kKeys, D]: warps split 4 row groups x (kWarps / 4) column parts.
        constexpr int kColumnParts = kWarps / 4;
        constexpr int kDqColumns = kHeadDim / kColumnParts / kDqPieces;
        static_assert(kDqColumns % 16 == 0, "a dQ piece is whole 16-column fragments");
        const int row_group = warp % 4;
        const int column_part = warp / 4;
        const int q_head = kv_head * group + head_in_group;
#pragma unroll
        for (int piece = 0; piece < kDqPieces; ++piece) {
          const int first_column = (column_part * kDqPieces + piece) * kDqColumns;
          float dq[kDqColumns / 8][4];
          clear(dq);
          warp_matmul_shared_tn<Element, kDqColumns, kKeys, kQueries, kHeadDim, kPadded>(dq, ds_tile, row_group * 16, k_tile,
                                                                                first_column, lane);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int position = first_query + row_group * 16 + lane / 4 + half * 8;
            if (position >= chunk_tokens) continue;
            float* row = workspace.dq_accumulator + int64_t(position) * q_row_stride + int64_t(q_head) * kHeadDim +
                         first_column;
#pragma unroll
            for (int n = 0; n < kDqColumns / 8; ++n) {
              const int column = n * 8 + 2 * (lane % 4);
#if __CUDA_ARCH__ >= 900
              atomicAdd(reinterpret_cast<float2*>(row + column), make_float2(dq[n][2 * half], dq[n][2 * half + 1]));
#else
              atomicAdd(row + column, dq[n][2 * half]);
              atomicAdd(row + column + 1, dq[n][2 * half + 1]);
#endif
            }
          }
        }
      }
    }
    if (item + 1 < work.count && thread < kQueries) {
      lse_tiles[next_stage * kQueries + thread] = next_lse;
      delta_tiles[next_stage * kQueries + thread] = next_delta;
    }
  }

  // Write dK (scaled) and dV once.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key_row + half * 8;
    if (key >= valid_keys) continue;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      write_key_gradients<Element, kHeadDim>(params, chunk_block, first_key, page, key, n * 8 + 2 * (lane % 4),
                                             dk[n][2 * half], dk[n][2 * half + 1], dv[n][2 * half], dv[n][2 * half + 1]);
    }
  }
}

// acc[32 x 32] += A[32 x D] B^T for the split layout's phase 1: A is rows [a_row, a_row + 32) of a
// swizzled [*, D] tile, B rows [b_row, b_row + 32) of another; acc is [row tile][n8 tile][4].
template <typename Element, int kHeadDim, bool kPadded>
__device__ __forceinline__ void warp_matmul_two_tiles_nt(float (&acc)[2][4][4], const Element* a_tile, int a_row,
                                                         const Element* b_tile, int b_row, int lane) {
  using Layout = TileLayout<kHeadDim, kPadded>;
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    uint32_t a[2][4];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      ldmatrix_x4(a[t], a_tile + Layout::offset(a_row + t * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8));
    }
#pragma unroll
    for (int nn = 0; nn < 2; ++nn) {
      // Matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
      uint32_t b[4];
      ldmatrix_x4(b, b_tile + Layout::offset(b_row + nn * 16 + (lane & 7) + ((lane >> 4) << 3),
                                             kk * 16 + ((lane >> 3) & 1) * 8));
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        ElementTraits<Element>::mma(acc[t][2 * nn], a[t], b[0], b[1]);
        ElementTraits<Element>::mma(acc[t][2 * nn + 1], a[t], b[2], b[3]);
      }
    }
  }
}

// Note [Backward split layout]
// Rationale: in the kernel above every warp owns 16 keys and multiplies them with all 64 queries
// of an item, so each warp reads the whole Q and dO tiles from shared memory for every product;
// shared-memory traffic, not the tensor cores, bounds it. FlashAttention-2's backward gives each
// warp a squarer piece of every product instead.
// Approach: one CTA of eight warps per (128 keys, kv head), the same work list and pipeline as
// above (Q, dO, lse and delta of the next item load while the current one computes). Per item of
// 64 queries, three phases with their own warp layouts:
//   1. S^T, dP^T [128 keys, 64 queries]: warps 4 (32 keys) x 2 (32 queries); P^T and
//      dS^T = P^T o (dP^T - delta) go to shared memory in 16 bits; barrier;
//   2. dV += P^T dO, dK += dS^T Q [128 keys, D]: warps 4 (32 keys) x 2 (D / 2 columns), each
//      warp's dK and dV stay in registers for the whole loop;
//   3. dQ [64 queries, D] = dS K: warps 2 (32 queries) x 4 (D / 4 columns), fp32 atomics into the
//      workspace (skipped in deterministic mode).
// The next item's first barrier orders phase 3's reads of dS^T before phase 1 rewrites it.
// Limitations: 128-key pages only (a CTA owns one page); head_dim 128.
// kPadded: every tile padded instead of swizzled (Note [Padded tiles]). kQuadDq: dQ goes out in
// 16-byte atomics (sm_90), two lanes trading halves so that each holds four adjacent columns of one
// row: half the atomic instructions for 16 shuffles.
template <typename Element, int kHeadDim, int kStagesSplit, bool kPadded, bool kQuadDq>
__global__ void __launch_bounds__(256, 1)
    paged_attention_backward_split_kernel(const PagedAttentionBackwardParams params,
                                          const BackwardWorkspacePointers workspace) {
  constexpr int kKeys = 128;
  constexpr int kThreads = 256;
  constexpr int kStagesHere = kStagesSplit;
  static_assert(kStagesHere == 2 || kStagesHere == 3, "the barrier scheme needs 2 or 3 stages");
  static_assert(kHeadDim % 64 == 0, "phase 2 gives each warp D / 2 columns, phase 3 D / 4");
  using Layout = TileLayout<kHeadDim, kPadded>;        // K, V, Q, dO
  using ScoreLayout = TileLayout<kQueries, kPadded>;   // P^T, dS^T
  constexpr int kStride = Layout::kStride;
  constexpr int kScoreStride = ScoreLayout::kStride;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  Element* k_tile = reinterpret_cast<Element*>(shared_raw);             // [128, D]
  Element* v_tile = k_tile + kKeys * kStride;                             // [128, D]
  Element* q_tiles = v_tile + kKeys * kStride;                            // [stages, 64, D]
  Element* dout_tiles = q_tiles + kStagesHere * kQueries * kStride;       // [stages, 64, D]
  Element* pt_tile = dout_tiles + kStagesHere * kQueries * kStride;       // [128, 64], P^T
  Element* dst_tile = pt_tile + kKeys * kScoreStride;                     // [128, 64], dS^T
  float* lse_tiles = reinterpret_cast<float*>(dst_tile + kKeys * kScoreStride);  // [stages, 64], log2 units
  float* delta_tiles = lse_tiles + kStagesHere * kQueries;                    // [stages, 64]

  const PagedAttentionShape& shape = params.shape;
  const int thread = threadIdx.x;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const int kv_head = blockIdx.y;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int chunk_tokens = shape.chunk_tokens;
  const int64_t q_row_stride = int64_t(shape.num_q_heads) * kHeadDim;
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;

  const OwnedKeys<Element> owned = own_keys<Element, kHeadDim, kKeys>(params, workspace);
  const WorkList work = owned.work;
  // A page no query tile selected receives nothing: adding zeros is a no-op.
  if (work.count == 0) return;

  const Element* q = static_cast<const Element*>(params.q);
  const Element* dout = static_cast<const Element*>(params.dout);
  const float* lse = static_cast<const float*>(params.lse);
  auto load_queries = [&](int item, int stage) {
    int head_in_group, query_block;
    work.decode(item, head_in_group, query_block);
    const int q_head = kv_head * group + head_in_group;
    const int64_t offset = int64_t(query_block) * kQueries * q_row_stride + int64_t(q_head) * kHeadDim;
    const int valid = chunk_tokens - query_block * kQueries;
    load_tile_async<Element, kQueries, kHeadDim, kThreads, kPadded>(q_tiles + stage * kQueries * kStride, q + offset,
                                                                     q_row_stride, valid, thread);
    load_tile_async<Element, kQueries, kHeadDim, kThreads, kPadded>(dout_tiles + stage * kQueries * kStride,
                                                                     dout + offset, q_row_stride, valid, thread);
  };
  // lse (in log2 units) and delta of one query row; rows past the chunk get lse = +inf, so P = 0;
  // lse = -inf (the row sees no key, Note [Blocked history]) becomes +inf too.
  auto read_row_statistics = [&](int item, float& row_lse, float& row_delta) {
    int head_in_group, query_block;
    work.decode(item, head_in_group, query_block);
    const int q_head = kv_head * group + head_in_group;
    const int position = query_block * kQueries + thread;
    if (position < chunk_tokens) {
      const float value = lse[int64_t(q_head) * chunk_tokens + position];
      row_lse = value == -INFINITY ? INFINITY : value * kLog2e;
      row_delta = workspace.delta[int64_t(q_head) * chunk_tokens + position];
    } else {
      row_lse = INFINITY;
      row_delta = 0.f;
    }
  };

  load_tile_async<Element, kKeys, kHeadDim, kThreads, kPadded>(k_tile, owned.k_base, kv_row_stride, owned.valid_keys,
                                                                thread);
  load_tile_async<Element, kKeys, kHeadDim, kThreads, kPadded>(v_tile, owned.v_base, kv_row_stride, owned.valid_keys,
                                                                thread);
  load_queries(0, 0);
  copy_async_commit();
  if (thread < kQueries) read_row_statistics(0, lse_tiles[thread], delta_tiles[thread]);

  const float scale_log2 = shape.softmax_scale * kLog2e;
  // This warp's pieces (Note [Backward split layout]).
  const int key_base = (warp % 4) * 32;                  // phases 1 and 2: 32 keys
  const int query_base = (warp / 4) * 32;                // phases 1 and 3: 32 queries
  const int dim_base = (warp / 4) * (kHeadDim / 2);      // phase 2: D / 2 columns
  const int dq_dim_base = (warp % 4) * (kHeadDim / 4);   // phase 3: D / 4 columns
  constexpr int kDimTiles = kHeadDim / 2 / 8;            // n8 tiles of dK, dV per 16-key row tile
  constexpr int kDqDimTiles = kHeadDim / 4 / 8;
  float dk[2][kDimTiles][4];
  float dv[2][kDimTiles][4];
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    clear(dk[t]);
    clear(dv[t]);
  }

  for (int item = 0; item < work.count; ++item) {
    const int stage = item % kStagesHere;
    const int next_stage = (item + 1) % kStagesHere;
    float next_lse = 0.f, next_delta = 0.f;
    if constexpr (kStagesHere == 3) {
      if (item + 1 < work.count) {
        load_queries(item + 1, next_stage);
        if (thread < kQueries) read_row_statistics(item + 1, next_lse, next_delta);
      }
      copy_async_commit();
      copy_async_wait<1>();
      __syncthreads();
    } else {
      copy_async_wait<0>();
      __syncthreads();
      if (item + 1 < work.count) {
        load_queries(item + 1, next_stage);
        if (thread < kQueries) read_row_statistics(item + 1, next_lse, next_delta);
      }
      copy_async_commit();
    }

    int head_in_group, query_block;
    work.decode(item, head_in_group, query_block);
    const int first_query = query_block * kQueries;
    const Element* q_tile = q_tiles + stage * kQueries * kStride;
    const Element* dout_tile = dout_tiles + stage * kQueries * kStride;
    const float* row_lse = lse_tiles + stage * kQueries;
    const float* row_delta = delta_tiles + stage * kQueries;

    // Phase 1: S^T = K Q^T and dP^T = V dO^T for 32 keys x 32 queries; [row tile][n8 tile][4].
    {
      float scores[2][4][4];
      float dscores[2][4][4];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        clear(scores[t]);
        clear(dscores[t]);
      }
      // S^T first, then dP^T: fewer fragments live at once than with the two products interleaved.
      warp_matmul_two_tiles_nt<Element, kHeadDim, kPadded>(scores, k_tile, key_base, q_tile, query_base, lane);
      warp_matmul_two_tiles_nt<Element, kHeadDim, kPadded>(dscores, v_tile, key_base, dout_tile, query_base, lane);
      const bool may_cut = owned.valid_keys < kKeys || (owned.chunk_block && owned.first_key + kKeys - 1 > first_query);
      // The eight query columns this thread holds: their lse and delta, read once per item.
      float2 column_lse[4], column_delta[4];
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        column_lse[n] = *reinterpret_cast<const float2*>(row_lse + query_base + n * 8 + 2 * (lane % 4));
        column_delta[n] = *reinterpret_cast<const float2*>(row_delta + query_base + n * 8 + 2 * (lane % 4));
      }
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int key = key_base + t * 16 + lane / 4 + half * 8;
            const int query = query_base + n * 8 + 2 * (lane % 4);
            const float lse_pair[2] = {column_lse[n].x, column_lse[n].y};
            const float delta_pair[2] = {column_delta[n].x, column_delta[n].y};
            float p[2], ds[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              p[j] = exp2f(scores[t][n][2 * half + j] * scale_log2 - lse_pair[j]);
              if (may_cut) {
                bool visible = key < owned.valid_keys;
                if (owned.chunk_block) visible = visible && owned.first_key + key <= first_query + query + j;
                if (!visible) p[j] = 0.f;
              }
              ds[j] = p[j] * (dscores[t][n][2 * half + j] - delta_pair[j]);
            }
            const int offset = ScoreLayout::offset(key, query);
            *reinterpret_cast<uint32_t*>(pt_tile + offset) = ElementTraits<Element>::pack(p[0], p[1]);
            *reinterpret_cast<uint32_t*>(dst_tile + offset) = ElementTraits<Element>::pack(ds[0], ds[1]);
          }
        }
      }
    }
    __syncthreads();

    // Phase 2: dV += P^T dO and dK += dS^T Q for 32 keys x D / 2 columns.
#pragma unroll
    for (int kk = 0; kk < kQueries / 16; ++kk) {
      uint32_t a_p[2][4], a_ds[2][4];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int offset = ScoreLayout::offset(key_base + t * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8);
        ldmatrix_x4(a_p[t], pt_tile + offset);
        ldmatrix_x4(a_ds[t], dst_tile + offset);
      }
#pragma unroll
      for (int nn = 0; nn < kDimTiles / 2; ++nn) {
        // Matrices (stored k x n): (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
        const int offset = Layout::offset(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                     dim_base + nn * 16 + (lane >> 4) * 8);
        uint32_t b_dout[4], b_q[4];
        ldmatrix_x4_trans(b_dout, dout_tile + offset);
        ldmatrix_x4_trans(b_q, q_tile + offset);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          ElementTraits<Element>::mma(dv[t][2 * nn], a_p[t], b_dout[0], b_dout[1]);
          ElementTraits<Element>::mma(dv[t][2 * nn + 1], a_p[t], b_dout[2], b_dout[3]);
          ElementTraits<Element>::mma(dk[t][2 * nn], a_ds[t], b_q[0], b_q[1]);
          ElementTraits<Element>::mma(dk[t][2 * nn + 1], a_ds[t], b_q[2], b_q[3]);
        }
      }
    }

    // Phase 3: dQ [32 queries, D / 4 columns] = dS K, with dS read transposed from dS^T.
    if (workspace.dq_accumulator != nullptr) {
      float dq[2][kDqDimTiles][4];
#pragma unroll
      for (int t = 0; t < 2; ++t) clear(dq[t]);
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
        for (int nn = 0; nn < kDqDimTiles / 2; ++nn) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, k_tile + Layout::offset(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                                  dq_dim_base + nn * 16 + (lane >> 4) * 8));
#pragma unroll
          for (int t = 0; t < 2; ++t) {
            ElementTraits<Element>::mma(dq[t][2 * nn], a[t], b[0], b[1]);
            ElementTraits<Element>::mma(dq[t][2 * nn + 1], a[t], b[2], b[3]);
          }
        }
      }
      const int q_head = kv_head * group + head_in_group;
#if __CUDA_ARCH__ >= 900
      if constexpr (kQuadDq) {
        // Even lanes (c = lane % 4 even) take row g, columns 2c..2c+3; odd lanes row g + 8,
        // columns 2c-2..2c+1 (Note [Fragment layouts]): each gives its partner the other row's pair.
        const bool even = (lane & 1) == 0;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const int position = first_query + query_base + t * 16 + lane / 4 + (even ? 0 : 8);
          float* row = workspace.dq_accumulator + int64_t(position) * q_row_stride + int64_t(q_head) * kHeadDim +
                       dq_dim_base;
#pragma unroll
          for (int n = 0; n < kDqDimTiles; ++n) {
            const float given0 = even ? dq[t][n][2] : dq[t][n][0];
            const float given1 = even ? dq[t][n][3] : dq[t][n][1];
            const float taken0 = __shfl_xor_sync(0xffffffffu, given0, 1);
            const float taken1 = __shfl_xor_sync(0xffffffffu, given1, 1);
            const float4 value = even ? make_float4(dq[t][n][0], dq[t][n][1], taken0, taken1)
                                      : make_float4(taken0, taken1, dq[t][n][2], dq[t][n][3]);
            if (position < chunk_tokens) {
              atomicAdd(reinterpret_cast<float4*>(row + n * 8 + 2 * ((lane % 4) & ~1)), value);
            }
          }
        }
      } else
#endif
      {
#pragma unroll
        for (int t = 0; t < 2; ++t) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int position = first_query + query_base + t * 16 + lane / 4 + half * 8;
            if (position >= chunk_tokens) continue;
            float* row = workspace.dq_accumulator + int64_t(position) * q_row_stride + int64_t(q_head) * kHeadDim +
                         dq_dim_base;
#pragma unroll
            for (int n = 0; n < kDqDimTiles; ++n) {
              const int column = n * 8 + 2 * (lane % 4);
#if __CUDA_ARCH__ >= 900
              atomicAdd(reinterpret_cast<float2*>(row + column), make_float2(dq[t][n][2 * half], dq[t][n][2 * half + 1]));
#else
              atomicAdd(row + column, dq[t][n][2 * half]);
              atomicAdd(row + column + 1, dq[t][n][2 * half + 1]);
#endif
            }
          }
        }
      }
    }
    if (item + 1 < work.count && thread < kQueries) {
      lse_tiles[next_stage * kQueries + thread] = next_lse;
      delta_tiles[next_stage * kQueries + thread] = next_delta;
    }
  }

  // Write dK (scaled) and dV once.
#pragma unroll
  for (int t = 0; t < 2; ++t) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = key_base + t * 16 + lane / 4 + half * 8;
      if (key >= owned.valid_keys) continue;
#pragma unroll
      for (int n = 0; n < kDimTiles; ++n) {
        write_key_gradients<Element, kHeadDim>(params, owned.chunk_block, owned.first_key, owned.page, key,
                                               dim_base + n * 8 + 2 * (lane % 4), dk[t][n][2 * half],
                                               dk[t][n][2 * half + 1], dv[t][n][2 * half], dv[t][n][2 * half + 1]);
      }
    }
  }
}

template <int kHeadDim, int kStagesSplit, bool kPadded>
constexpr size_t backward_split_shared_bytes() {
  // K, V [128, D]; Q, dO [stages, 64, D]; P^T, dS^T [128, 64] (16-bit, rows of kStride elements);
  // lse, delta [stages, 64] fp32.
  constexpr int kStride = TileLayout<kHeadDim, kPadded>::kStride;
  constexpr int kScoreStride = TileLayout<kQueries, kPadded>::kStride;
  return size_t(2 * 128 * kStride + 2 * kStagesSplit * kQueries * kStride + 2 * 128 * kScoreStride) * 2 +
         2 * kStagesSplit * kQueries * 4;
}

// delta[h, i] = sum_d dO[i, h, d] * O[i, h, d] in fp32; one warp per (i, h). [Hq, Tc].
template <typename Element>
__global__ void backward_delta_kernel(const Element* out, const Element* dout, float* delta, int chunk_tokens,
                                      int num_q_heads, int head_dim) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= int64_t(chunk_tokens) * num_q_heads) return;
  const Element* o_row = out + row * head_dim;
  const Element* do_row = dout + row * head_dim;
  float sum = 0.f;
  for (int column = 2 * lane; column < head_dim; column += 64) {
    const float2 o = ElementTraits<Element>::unpack(*reinterpret_cast<const uint32_t*>(o_row + column));
    const float2 d = ElementTraits<Element>::unpack(*reinterpret_cast<const uint32_t*>(do_row + column));
    sum += o.x * d.x + o.y * d.y;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) {
    const int token = int(row / num_q_heads);
    const int head = int(row % num_q_heads);
    delta[int64_t(head) * chunk_tokens + token] = sum;
  }
}

// For each history page, the query tiles whose selection lists it, in increasing tile order
// (so the backward's accumulation order, and its bits, do not depend on scheduling).
__global__ void build_inverse_selection_kernel(const int32_t* selected_pages, int selected_per_tile, int num_tiles,
                                               int num_pages, int32_t* inverse_count, int32_t* inverse_tiles,
                                               int capacity) {
  const int page = blockIdx.x * blockDim.x + threadIdx.x;
  if (page >= num_pages) return;
  int count = 0;
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int32_t* row = selected_pages + int64_t(tile) * selected_per_tile;
    for (int slot = 0; slot < selected_per_tile; ++slot) {
      if (row[slot] == page) {
        inverse_tiles[int64_t(page) * capacity + count++] = tile;
        break;
      }
    }
  }
  inverse_count[page] = count;
}

// dq = dq_accumulator * scale, converted to the element type; two elements per thread.
template <typename Element>
__global__ void convert_dq_kernel(const float* accumulator, Element* dq, int64_t count, float scale) {
  const int64_t index = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 2;
  if (index >= count) return;
  const float2 value = *reinterpret_cast<const float2*>(accumulator + index);
  *reinterpret_cast<uint32_t*>(dq + index) = ElementTraits<Element>::pack(value.x * scale, value.y * scale);
}

template <typename Element, int kHeadDim, int kWarps, int kDqPieces = 1, bool kPadded = false>
cudaError_t launch_kv(const PagedAttentionBackwardParams& params, const BackwardWorkspacePointers& workspace,
                      cudaStream_t stream) {
  constexpr size_t kSharedBytes = backward_shared_bytes<kHeadDim, kWarps, kPadded>();
  auto kernel = paged_attention_backward_kv_kernel<Element, kHeadDim, kWarps, kDqPieces, kPadded>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSharedBytes));
  if (error != cudaSuccess) return error;
  const dim3 grid(workspace.num_chunk_blocks + history_page_count(params.shape), params.shape.num_kv_heads);
  if (grid.x == 0) return cudaSuccess;  // no key at all (attend_chunk false, empty history)
  kernel<<<grid, kWarps * 32, kSharedBytes, stream>>>(params, workspace);
  return cudaGetLastError();
}

template <typename Element, int kHeadDim, int kStagesSplit, bool kPadded, bool kQuadDq = false>
cudaError_t launch_kv_split(const PagedAttentionBackwardParams& params, const BackwardWorkspacePointers& workspace,
                            cudaStream_t stream) {
  constexpr size_t kSharedBytes = backward_split_shared_bytes<kHeadDim, kStagesSplit, kPadded>();
  auto kernel = paged_attention_backward_split_kernel<Element, kHeadDim, kStagesSplit, kPadded, kQuadDq>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSharedBytes));
  if (error != cudaSuccess) return error;
  const dim3 grid(workspace.num_chunk_blocks + history_page_count(params.shape), params.shape.num_kv_heads);
  if (grid.x == 0) return cudaSuccess;  // no key at all (attend_chunk false, empty history)
  kernel<<<grid, 256, kSharedBytes, stream>>>(params, workspace);
  return cudaGetLastError();
}

using KvLaunch = cudaError_t (*)(const PagedAttentionBackwardParams&, const BackwardWorkspacePointers&, cudaStream_t);
using KvApplies = bool (*)(const PagedAttentionBackwardParams&);
struct BackwardVariant {
  const char* name;
  KvLaunch launch;
  // Whether the variant can run this call (its shape, the device); when not, the default runs.
  KvApplies applies;
};

// The mma.sync layouts run every call that reaches the variant table.
bool always_applies(const PagedAttentionBackwardParams&) { return true; }

// Note [Backward variants]: compiled layouts of the dK/dV kernel for bf16, head_dim 128 and pages
// of 128 keys (one page per CTA), picked by MEMBAR_ATTENTION_BACKWARD_VARIANT=<name> at every
// launch (the default otherwise; other shapes always run the default layout). Names:
// w<warps>_k<keys per CTA>_dq<columns of dQ a warp holds at once>[_pad] for the kernel above,
// w8_k128_split_s<Q/dO stages>[_pad][_dq4] for Note [Backward split layout] (_pad: Note [Padded
// tiles]; _dq4: dQ in 16-byte atomics), wgmma_w8_k128 for Note [Warpgroup backward]
// (attention_backward_wgmma.cu). A variant whose applies() is false for a call (wgmma_w8_k128 off
// an sm_90 device or without the sm_90a build) leaves that call to the default. The default is
// the fastest one measured on the H200; "w8_k128_dq64" is the kernel before tuning.
constexpr BackwardVariant kBackwardVariants[] = {
    // Today's kernel before tuning, and its dQ-in-pieces and padded forms.
    {"w8_k128_dq64", &launch_kv<__nv_bfloat16, 128, 8, 1>, &always_applies},
    {"w8_k128_dq32", &launch_kv<__nv_bfloat16, 128, 8, 2>, &always_applies},
    {"w8_k128_dq64_pad", &launch_kv<__nv_bfloat16, 128, 8, 1, true>, &always_applies},
    // Round 1 on the H200 (bench/attention_sweep.py, 2026-11-30 15:11 UTC, TFLOP/s at 32K / 128K
    // history; SDPA flash 318 / 322): today's kernel 211 / 223; split_s2_pad 257 / 268, the fastest.
    {"w8_k128_split_s2_pad", &launch_kv_split<__nv_bfloat16, 128, 2, true>, &always_applies},
    {"w8_k128_split_s3_pad", &launch_kv_split<__nv_bfloat16, 128, 3, true>, &always_applies},
    {"w8_k128_split_s2", &launch_kv_split<__nv_bfloat16, 128, 2, false>, &always_applies},
    {"w8_k128_split_s3", &launch_kv_split<__nv_bfloat16, 128, 3, false>, &always_applies},
    // Round 2 (2026-11-30 15:53 UTC; SDPA flash 315 / 318): split_s2_pad 255 / 267 stays the
    // fastest; dQ in 16-byte atomics 251 / 265.
    {"w8_k128_split_s2_pad_dq4", &launch_kv_split<__nv_bfloat16, 128, 2, true, true>, &always_applies},
    {"w8_k128_split_s3_pad_dq4", &launch_kv_split<__nv_bfloat16, 128, 3, true, true>, &always_applies},
    // Hopper warpgroup MMAs (Note [Warpgroup backward] in attention_backward_wgmma.cu): sm_90 only,
    // not yet run on a GPU.
    {"wgmma_w8_k128", &launch_backward_wgmma_w8_k128, &backward_wgmma_w8_k128_applies},
};
constexpr int kBackwardVariantCount = int(sizeof(kBackwardVariants) / sizeof(kBackwardVariants[0]));

// The fastest variant measured on the H200 (rounds above: 0.81-0.84x SDPA flash).
constexpr int kDefaultBackwardVariant = find_variant(kBackwardVariants, "w8_k128_split_s2_pad");
static_assert(kDefaultBackwardVariant >= 0, "the default names a listed variant");

// The variant MEMBAR_ATTENTION_BACKWARD_VARIANT names: -1 when unset, -2 when it names none.
int requested_backward_variant() {
  const char* name = std::getenv("MEMBAR_ATTENTION_BACKWARD_VARIANT");
  if (name == nullptr || name[0] == '\0') return -1;
  int index = find_variant(kBackwardVariants, name);
  return index >= 0 ? index : -2;
}

template <typename Element>
cudaError_t launch_backward(const PagedAttentionBackwardParams& params, cudaStream_t stream) {
  const PagedAttentionShape& shape = params.shape;
  const BackwardWorkspaceLayout layout = backward_workspace_layout(shape);
  unsigned char* base = static_cast<unsigned char*>(params.workspace);
  float* delta = reinterpret_cast<float*>(base + layout.delta_offset);
  BackwardWorkspacePointers workspace;
  workspace.dq_accumulator = params.deterministic ? nullptr : reinterpret_cast<float*>(base + layout.dq_accumulator_offset);
  workspace.delta = delta;
  workspace.inverse_count = reinterpret_cast<const int32_t*>(base + layout.inverse_count_offset);
  workspace.inverse_tiles = reinterpret_cast<const int32_t*>(base + layout.inverse_tiles_offset);
  workspace.inverse_capacity = layout.inverse_tiles_capacity;
  // Without attend_chunk no CTA owns chunk keys: dk_chunk/dv_chunk stay untouched.
  workspace.num_chunk_blocks = shape.attend_chunk ? (shape.chunk_tokens + shape.page_tokens - 1) / shape.page_tokens : 0;

  const int64_t rows = int64_t(shape.chunk_tokens) * shape.num_q_heads;
  backward_delta_kernel<Element><<<unsigned((rows + 7) / 8), 256, 0, stream>>>(
      static_cast<const Element*>(params.out), static_cast<const Element*>(params.dout), delta, shape.chunk_tokens,
      shape.num_q_heads, shape.head_dim);
  const int num_pages = history_page_count(shape);
  if ((params.selection.selected_pages != nullptr) && num_pages > 0) {
    const int num_tiles = num_query_tiles(shape.chunk_tokens, params.selection.query_tile_tokens);
    build_inverse_selection_kernel<<<(num_pages + 127) / 128, 128, 0, stream>>>(
        params.selection.selected_pages, params.selection.selected_per_tile, num_tiles, num_pages,
        const_cast<int32_t*>(workspace.inverse_count), const_cast<int32_t*>(workspace.inverse_tiles),
        layout.inverse_tiles_capacity);
  }
  const int64_t dq_elements = rows * shape.head_dim;
  cudaError_t error = cudaSuccess;
  if (!params.deterministic) {
    error = cudaMemsetAsync(workspace.dq_accumulator, 0, size_t(dq_elements) * 4, stream);
    if (error != cudaSuccess) return error;
  }
  const bool small_pages = shape.page_tokens == 64;
  if (std::is_same_v<Element, __nv_bfloat16> && shape.head_dim == 128 && !small_pages) {
    int variant = requested_backward_variant();
    if (variant == -2) return cudaErrorInvalidValue;
    if (variant < 0 || !kBackwardVariants[variant].applies(params)) variant = kDefaultBackwardVariant;
    error = kBackwardVariants[variant].launch(params, workspace, stream);
  } else if (shape.head_dim == 64) {
    error = small_pages ? launch_kv<Element, 64, 4>(params, workspace, stream)
                        : launch_kv<Element, 64, 8>(params, workspace, stream);
  } else {
    error = small_pages ? launch_kv<Element, 128, 4>(params, workspace, stream)
                        : launch_kv<Element, 128, 8>(params, workspace, stream);
  }
  if (error != cudaSuccess) return error;
  if (params.deterministic) return static_cast<cudaError_t>(launch_backward_dq(params, delta, stream));
  convert_dq_kernel<Element><<<unsigned((dq_elements / 2 + 255) / 256), 256, 0, stream>>>(
      workspace.dq_accumulator, static_cast<Element*>(params.dq), dq_elements, shape.softmax_scale);
  return cudaGetLastError();
}

}  // namespace

int paged_attention_backward(const PagedAttentionBackwardParams& params, void* stream) {
  const PagedAttentionShape& shape = params.shape;
  if (paged_attention_check_shape(shape)[0] != '\0') return cudaErrorInvalidValue;
  if (paged_attention_cuda_check(shape, params.selection)[0] != '\0') return cudaErrorInvalidValue;
  if (params.grad_page_dtype != DType::kFloat32 && params.grad_page_dtype != DType::kBFloat16) {
    return cudaErrorInvalidValue;
  }
  const void* pointers[] = {params.q,       params.k_chunk,  params.v_chunk,  params.history.k_pool,
                            params.history.v_pool, params.out, params.dout, params.dq,
                            params.dk_chunk, params.dv_chunk, params.workspace, params.grad_history.dk_pool,
                            params.grad_history.dv_pool};
  const char* names[] = {"q",  "k_chunk", "v_chunk",  "k_pool",   "v_pool",    "out",    "dout",
                         "dq", "dk_chunk", "dv_chunk", "workspace", "dk_pool", "dv_pool"};
  if (paged_attention_check_alignment(pointers, names, 13)[0] != '\0') return cudaErrorInvalidValue;
  const void* required[] = {params.q, params.out, params.dout, params.lse, params.dq, params.workspace};
  for (const void* pointer : required) {
    if (pointer == nullptr) return cudaErrorInvalidValue;
  }
  if (shape.attend_chunk) {
    const void* chunk_required[] = {params.k_chunk, params.v_chunk, params.dk_chunk, params.dv_chunk};
    for (const void* pointer : chunk_required) {
      if (pointer == nullptr) return cudaErrorInvalidValue;
    }
  }
  if (shape.history_tokens > 0) {
    const void* history_required[] = {params.history.k_pool, params.history.v_pool, params.grad_history.dk_pool,
                                      params.grad_history.dv_pool};
    for (const void* pointer : history_required) {
      if (pointer == nullptr) return cudaErrorInvalidValue;
    }
    if (params.history.k_page_index == nullptr || params.history.v_page_index == nullptr ||
        params.grad_history.dk_page_index == nullptr || params.grad_history.dv_page_index == nullptr) {
      return cudaErrorInvalidValue;
    }
  }
  cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  if (shape.dtype == DType::kBFloat16) return launch_backward<__nv_bfloat16>(params, cuda_stream);
  return launch_backward<__half>(params, cuda_stream);
}

int backward_variant_count() { return kBackwardVariantCount; }
const char* backward_variant_name(int index) {
  return index >= 0 && index < kBackwardVariantCount ? kBackwardVariants[index].name : nullptr;
}
const char* backward_default_variant() { return kBackwardVariants[kDefaultBackwardVariant].name; }

}  // namespace membar::kernels::cuda
