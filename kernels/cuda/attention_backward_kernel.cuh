// The mma.sync paged-attention dK/dV kernels (FlashAttention-2 style) as templates over their
// layouts (BackwardKeysTile, BackwardSplitTile). Internal to kernels/: attention_backward.cu
// instantiates the shipped layouts and runs the backward around them, kernels/sweep/ the
// contenders (Note [Layout choice] in membar/kernels/attention_cuda.h).
//
// Note [Backward kernel]
// Rationale: a backward that adds dK/dV into shared pages from every query tile and q head
// (atomics) is many times slower than FlashAttention's, whose every KV block has one owner.
// Here every KV block has exactly one owner too.
// Approach: one CTA per (KV block, kv head). A KV block is one history page (page_tokens = 64 or
// 128 keys, 16 keys per warp), a part of one (page_parts: 64 keys of a page of 128), or a block
// of the chunk's own keys of the same size. The CTA keeps its K and V in shared memory and loops
// over the (q head of the GQA group, block of 64 queries) pairs that attend to it: every query
// block for a dense history page, the query blocks of the tiles that selected the page in sparse
// mode (the inverse selection, built by build_inverse_selection_kernel), and the query blocks at
// or after the block's first key for a chunk block. Q and dO of the next pair load (cp.async, two
// or three stages) while the current pair computes:
//   S^T = K Q^T, P^T = exp(S^T * scale - lse), dP^T = V dO^T, dS^T = P^T o (dP^T - delta),
//   dV += P^T dO, dK += dS^T Q                                  (registers, per warp),
//   dQ += dS K                                                  (dS^T through shared memory,
//                                                                fp32 atomics into workspace).
// At the end the CTA writes dK, dV once: overwritten for chunk keys, ADDED (fp32, or bf16 with
// round-to-nearest-even) into the grad pages for history keys. No two CTAs touch the same rows, so
// dK/dV are deterministic. delta = rowsum(dO o O) comes from a small kernel first.
// Deterministic mode leaves dQ out of this kernel and runs launch_backward_dq instead, which owns
// each query block and walks its keys like the forward (no atomics; costs two more products).
// At head_dim 256 the dK/dV of a warp's 16 keys do not fit in registers: with dim_parts the CTA
// walks its pairs once per part of the columns, recomputing S^T and dP^T each time (1.4x the
// products for two parts) and adding that part's dK, dV and dQ.
// With kSoftcap S^T is capped before P is formed and dS^T is multiplied by the cap's slope
// (Note [Soft-capped scores in raw units] in attention_common.cuh). With a sliding window the work
// list ends at the last query block that sees the CTA's keys (own_keys), and items that straddle
// the window's edge set P = 0 for the hidden pairs (Note [Sliding window in the kernels]).
// Limitations: the chunk blocks have unequal work (causal); they run first in the grid so the
// uniform history blocks fill in behind them.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "attention_backward_common.cuh"
#include "attention_common.cuh"
#include "attention_cuda_internal.h"

namespace membar::kernels::cuda::detail {

// A layout of the first dK/dV kernel (Note [Backward kernel]): named fields, bounds checked by
// backward_keys_tile_checked. Layout names (docs/kernels.md): w<warps>_k<keys>_dq<dQ columns a
// warp holds at once, at head_dim 128>, then _pad (padded_tiles), _s<stages> (when not 3) and
// _d<dim_parts> (when not 1).
struct BackwardKeysTile {
  int warps = 8;              // warps per CTA, 16 keys each: a CTA owns 16 * warps keys of one page
                              // (the whole page, or a part of it)
  int dq_pieces = 1;          // each warp computes its dQ columns in this many pieces, one after the
                              // other, so that fewer accumulators are live next to dK and dV
  bool padded_tiles = false;  // padded instead of swizzled tiles (Note [Padded tiles]; always at
                              // head sizes that are not a multiple of 64)
  int stages = 3;             // Q/dO stages in shared memory (Note [Backward kernel])
  int dim_parts = 1;          // the CTA walks its work list this many times, each time for dK/dV of
                              // head_dim / dim_parts columns (and their dQ): registers for dK/dV
                              // of the whole of a head_dim of 256 do not exist
  bool page_parts = false;    // a CTA owns a part of a page when pages are longer than its keys

  constexpr int keys() const { return 16 * warps; }
  constexpr int threads() const { return 32 * warps; }
};

template <int kHeadDim, typename Tiling>
constexpr bool backward_keys_tile_checked() {
  constexpr BackwardKeysTile kTile = Tiling::kTile;
  static_assert(kTile.warps == 4 || kTile.warps == 8, "a CTA owns 64 or 128 keys, 16 per warp");
  static_assert(kTile.stages == 2 || kTile.stages == 3, "the barrier schemes of Note [Backward kernel] take 2 or 3 stages");
  static_assert(kTile.dim_parts >= 1 && kHeadDim % (16 * kTile.dim_parts) == 0,
                "a part of head_dim is whole 16-column fragments");
  static_assert(kTile.dq_pieces >= 1 &&
                    (kHeadDim / kTile.dim_parts / (kTile.warps / 4) / kTile.dq_pieces) % 16 == 0 &&
                    (kHeadDim / kTile.dim_parts / (kTile.warps / 4)) % kTile.dq_pieces == 0,
                "a dQ piece is whole 16-column fragments");
  static_assert(kHeadDim % 16 == 0, "a row of Q, K or V is whole 16-column MMA fragments");
  return true;
}

// A layout of the split dK/dV kernel (Note [Backward split layout]): named fields, bounds checked
// by backward_split_tile_checked. Layout names: w8_k128_split_s<stages>, then _pad
// (padded_tiles) and _dq4 (quad_dq_atomics).
struct BackwardSplitTile {
  int stages = 2;                 // Q/dO stages in shared memory
  bool padded_tiles = false;      // every tile padded instead of swizzled (Note [Padded tiles])
  bool quad_dq_atomics = false;   // dQ in 16-byte atomics (sm_90), two lanes trading halves so that
                                  // each holds four adjacent columns of one row: half the atomic
                                  // instructions for 16 shuffles
};

template <int kHeadDim, typename Tiling>
constexpr bool backward_split_tile_checked() {
  constexpr BackwardSplitTile kTile = Tiling::kTile;
  static_assert(kTile.stages == 2 || kTile.stages == 3, "the barrier scheme needs 2 or 3 stages");
  static_assert(kHeadDim % 64 == 0, "phase 2 gives each warp D / 2 columns, phase 3 D / 4");
  return true;
}

template <int kHeadDim, typename Tiling>
constexpr size_t backward_shared_bytes() {
  constexpr BackwardKeysTile kTile = Tiling::kTile;
  constexpr int kKeys = kTile.keys();
  constexpr int kStages = kTile.stages;
  constexpr bool kPadded = tile_padded<kHeadDim>(kTile.padded_tiles);
  constexpr int kStride = TileLayout<kHeadDim, kPadded>::kStride;
  constexpr int kScoreStride = TileLayout<kQueries, kPadded>::kStride;
  // K, V [kKeys, D]; Q, dO [kStages, 64, D]; dS^T [kKeys, 64] (16-bit, rows of kStride elements);
  // lse, delta [kStages, 64] fp32.
  return size_t(2 * kKeys * kStride + 2 * kStages * kQueries * kStride + kKeys * kScoreStride) * 2 +
         2 * kStages * kQueries * 4;
}

template <typename Element, int kHeadDim, typename Tiling, bool kSoftcap = false>
__global__ void __launch_bounds__(Tiling::kTile.threads(), 1)
    paged_attention_backward_kv_kernel(const PagedAttentionBackwardParams params,
                                       const BackwardWorkspacePointers workspace, const SoftCap soft_cap) {
  static_assert(backward_keys_tile_checked<kHeadDim, Tiling>(), "backward_keys_tile_checked holds the bounds");
  constexpr int kWarps = Tiling::kTile.warps;
  constexpr int kDqPieces = Tiling::kTile.dq_pieces;
  constexpr bool kPadded = tile_padded<kHeadDim>(Tiling::kTile.padded_tiles);
  constexpr int kStages = Tiling::kTile.stages;
  constexpr int kDimParts = Tiling::kTile.dim_parts;
  constexpr int kPartColumns = kHeadDim / kDimParts;  // dK/dV (and dQ) columns of one pass
  constexpr int kKeys = Tiling::kTile.keys();
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
  const OwnedKeys<Element> owned = own_keys<Element, kHeadDim, kKeys, Tiling::kTile.page_parts>(params, workspace);
  const bool chunk_block = owned.chunk_block;
  const int valid_keys = owned.valid_keys;
  const int first_key = owned.first_key;
  const WorkList work = owned.work;
  // A page no query tile selected (or, with a sliding window, no query sees) receives nothing:
  // adding zeros is a no-op.
  if (work.count == 0) return;
  // The owned keys' window edge (Note [Sliding window in the kernels]), read after the barrier of
  // each item.
  __shared__ int shared_window_edge;
  if (thread == 0) shared_window_edge = owned_window_edge(shape, owned);  // kNoWindowEdge without a window

  const Element* q = static_cast<const Element*>(params.q);
  const Element* dout = static_cast<const Element*>(params.dout);
  const float* lse = static_cast<const float*>(params.lse);
  auto load_queries = [&](int item, int stage) {
    const WorkItem queries = work_item<kHeadDim>(work, item, kv_head, group, q_row_stride);
    const int64_t offset = queries.offset;
    const int valid = chunk_tokens - queries.first_query;
    load_tile_async<Element, kQueries, kHeadDim, kThreads, kPadded>(q_tiles + stage * kQueries * kStride, q + offset,
                                                                     q_row_stride, valid, thread);
    load_tile_async<Element, kQueries, kHeadDim, kThreads, kPadded>(dout_tiles + stage * kQueries * kStride,
                                                                     dout + offset, q_row_stride, valid, thread);
  };
  // lse (in log2 units) and delta of the item's query row `thread` (query_row_statistics).
  auto read_row_statistics = [&](int item, float& row_lse, float& row_delta) {
    const WorkItem queries = work_item<kHeadDim>(work, item, kv_head, group, q_row_stride);
    query_row_statistics(lse, workspace.delta, chunk_tokens, queries.q_head, queries.first_query + thread, row_lse,
                         row_delta);
  };

  load_tile_async<Element, kKeys, kHeadDim, kThreads, kPadded>(k_tile, owned.k_base, kv_row_stride, valid_keys, thread);
  load_tile_async<Element, kKeys, kHeadDim, kThreads, kPadded>(v_tile, owned.v_base, kv_row_stride, valid_keys, thread);
  load_queries(0, 0);
  copy_async_commit();
  if (thread < kQueries) read_row_statistics(0, lse_tiles[thread], delta_tiles[thread]);

  const float scale_log2 = shape.softmax_scale * kLog2e;
  // Key rows of this thread: warp * 16 + lane / 4 and that + 8.
  const int key_row = warp * 16 + lane / 4;

  // One pass over the work list per part of head_dim (dim_parts), each for that part's dK/dV
  // columns and dQ columns; the Q/dO pipeline runs on across passes (step = part * count + item).
  // The parts are unrolled, so that each pass's columns are compile-time offsets.
#pragma unroll
  for (int part = 0; part < kDimParts; ++part) {
    const int part_column = part * kPartColumns;
    float dk[kPartColumns / 8][4];
    float dv[kPartColumns / 8][4];
    clear(dk);
    clear(dv);
    for (int item = 0; item < work.count; ++item) {
      const int step = part * work.count + item;
      const int stage = step % kStages;
      const int next_stage = (step + 1) % kStages;
      // The next step's item: the next one of this pass, or the first one of the next pass.
      const bool has_next = item + 1 < work.count || part + 1 < kDimParts;
      const int next_item = (kDimParts == 1 || item + 1 < work.count) ? item + 1 : 0;
      float next_lse = 0.f, next_delta = 0.f;
      if constexpr (kStages == 3) {
        // The stage loaded here was read two steps ago, and dS^T is rewritten only after the
        // barrier below: every warp finished those steps before passing it.
        if (has_next) {
          load_queries(next_item, next_stage);
          if (thread < kQueries) read_row_statistics(next_item, next_lse, next_delta);
        }
        copy_async_commit();
        copy_async_wait<1>();
        __syncthreads();
      } else {
        // Two stages: the stage loaded next was read in the previous step, which every warp
        // finished before passing this barrier.
        copy_async_wait<0>();
        __syncthreads();
        if (has_next) {
          load_queries(next_item, next_stage);
          if (thread < kQueries) read_row_statistics(next_item, next_lse, next_delta);
        }
        copy_async_commit();
      }

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
        warp_matmul_shared_nt<Element, kQueries, kHeadDim, kHeadDim, kHeadDim, kPadded>(scores, k_tile, warp * 16,
                                                                                       q_tile, 0, lane);
        if constexpr (kSoftcap) soft_cap_scores(scores, soft_cap);
        // Note [Sliding window in the kernels]: the pairs the window hides, where the item's last
        // query does not see the first key (a uniform branch), get P = 0 and dS = 0. These kernels
        // sit at 255 registers, and where that happens decides what ptxas spills (nvcc 13.0,
        // docs/kernels.md): with one pass over the columns the scores become -inf here, before dP
        // exists (the fewest values live; the cap's slope is 0 there), and no layout spills on sm_90a;
        // with dim_parts (head_dim 256) P is zeroed with the other masks below, which spills less
        // than before the window on both architectures. The edge comes from shared memory, so that no
        // register holds it across items.
        constexpr bool kMaskScores = kDimParts == 1;
        if (kMaskScores && shape.sliding_window > 0) {
          const int window_edge = shared_window_edge;
          if (window_edge <= first_query + kQueries - 1) {
#pragma unroll
            for (int n = 0; n < kQueries / 8; ++n) {
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                const int query = n * 8 + 2 * (lane % 4) + (j & 1);
                const int key = key_row + (j >> 1) * 8;
                if (key + window_edge <= first_query + query) scores[n][j] = -INFINITY;
              }
            }
          }
        }
        warp_matmul_shared_nt<Element, kQueries, kHeadDim, kHeadDim, kHeadDim, kPadded>(dscores, v_tile, warp * 16,
                                                                                       dout_tile, 0, lane);
        const int window_edge = kMaskScores ? kNoWindowEdge : shared_window_edge;
        const bool window_cuts = !kMaskScores && window_edge <= first_query + kQueries - 1;
        const bool may_cut =
            valid_keys < kKeys || (chunk_block && first_key + kKeys - 1 > first_query) || window_cuts;
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
              if (window_cuts) visible = visible && key + window_edge > first_query + query;
              if (!visible) p = 0.f;
            }
            if constexpr (kSoftcap) {
              // The slope is read from the capped score before P replaces it.
              dscores[n][j] = (dscores[n][j] - row_delta[query]) * soft_cap.slope(scores[n][j]) * p;
              scores[n][j] = p;
            } else {
              scores[n][j] = p;
              dscores[n][j] = p * (dscores[n][j] - row_delta[query]);
            }
          }
        }
        uint32_t fragments[kQueries / 16][4];
        accumulator_to_a_fragments<Element, kQueries>(fragments, scores);
        warp_matmul_registers_nn<Element, kPartColumns, kQueries, kHeadDim, kPadded>(dv, fragments, dout_tile, 0,
                                                                                    part_column, lane);
        accumulator_to_a_fragments<Element, kQueries>(fragments, dscores);
        warp_matmul_registers_nn<Element, kPartColumns, kQueries, kHeadDim, kPadded>(dk, fragments, q_tile, 0,
                                                                                    part_column, lane);

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
          // dQ [64, this pass's columns] = dS [64, kKeys] K [kKeys, columns]: warps split 4 row
          // groups x (kWarps / 4) column parts.
          constexpr int kColumnParts = kWarps / 4;
          constexpr int kDqColumns = kPartColumns / kColumnParts / kDqPieces;
          const int row_group = warp % 4;
          const int column_part = warp / 4;
          const int q_head = kv_head * group + head_in_group;
#pragma unroll
          for (int piece = 0; piece < kDqPieces; ++piece) {
            const int first_column = part_column + (column_part * kDqPieces + piece) * kDqColumns;
            float dq[kDqColumns / 8][4];
            clear(dq);
            warp_matmul_shared_tn<Element, kDqColumns, kKeys, kQueries, kHeadDim, kPadded>(dq, ds_tile, row_group * 16,
                                                                                          k_tile, first_column, lane);
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
      if (has_next && thread < kQueries) {
        lse_tiles[next_stage * kQueries + thread] = next_lse;
        delta_tiles[next_stage * kQueries + thread] = next_delta;
      }
    }

    // Write this pass's dK (scaled) and dV once.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = key_row + half * 8;
      if (key >= valid_keys) continue;
#pragma unroll
      for (int n = 0; n < kPartColumns / 8; ++n) {
        write_key_gradients<Element, kHeadDim, Tiling::kTile.page_parts>(params, chunk_block, first_key, owned.page, key,
                                               part_column + n * 8 + 2 * (lane % 4), dk[n][2 * half],
                                               dk[n][2 * half + 1], dv[n][2 * half], dv[n][2 * half + 1]);
      }
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
// With kSoftcap phase 1 caps S^T before P^T and multiplies dS^T by the cap's slope (Note
// [Soft-capped scores in raw units] in attention_common.cuh). A sliding window bounds the work
// list and sets P^T = 0 for hidden pairs in phase 1, as in the kernel above.
// Limitations: 128-key pages only (a CTA owns one page); head_dim 128.
// The layout is a BackwardSplitTile.
template <typename Element, int kHeadDim, typename Tiling, bool kSoftcap = false>
__global__ void __launch_bounds__(256, 1)
    paged_attention_backward_split_kernel(const PagedAttentionBackwardParams params,
                                          const BackwardWorkspacePointers workspace, const SoftCap soft_cap) {
  constexpr BackwardSplitTile kTile = Tiling::kTile;
  static_assert(backward_split_tile_checked<kHeadDim, Tiling>(), "backward_split_tile_checked holds the bounds");
  constexpr int kKeys = 128;
  constexpr int kThreads = 256;
  constexpr int kStagesHere = kTile.stages;
  constexpr bool kPadded = tile_padded<kHeadDim>(kTile.padded_tiles);
  constexpr bool kQuadDq = kTile.quad_dq_atomics;
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
    const WorkItem queries = work_item<kHeadDim>(work, item, kv_head, group, q_row_stride);
    const int64_t offset = queries.offset;
    const int valid = chunk_tokens - queries.first_query;
    load_tile_async<Element, kQueries, kHeadDim, kThreads, kPadded>(q_tiles + stage * kQueries * kStride, q + offset,
                                                                     q_row_stride, valid, thread);
    load_tile_async<Element, kQueries, kHeadDim, kThreads, kPadded>(dout_tiles + stage * kQueries * kStride,
                                                                     dout + offset, q_row_stride, valid, thread);
  };
  // lse (in log2 units) and delta of the item's query row `thread` (query_row_statistics).
  auto read_row_statistics = [&](int item, float& row_lse, float& row_delta) {
    const WorkItem queries = work_item<kHeadDim>(work, item, kv_head, group, q_row_stride);
    query_row_statistics(lse, workspace.delta, chunk_tokens, queries.q_head, queries.first_query + thread, row_lse,
                         row_delta);
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
      if constexpr (kSoftcap) {
        soft_cap_scores(scores[0], soft_cap);
        soft_cap_scores(scores[1], soft_cap);
      }
      warp_matmul_two_tiles_nt<Element, kHeadDim, kPadded>(dscores, v_tile, key_base, dout_tile, query_base, lane);
      // The window hides some pair of the item when its last query does not see the first key.
      const int window_edge = owned_window_edge(shape, owned);
      const bool window_cuts = window_edge <= first_query + kQueries - 1;
      const bool may_cut = owned.valid_keys < kKeys ||
                           (owned.chunk_block && owned.first_key + kKeys - 1 > first_query) || window_cuts;
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
                if (window_cuts) visible = visible && key + window_edge > first_query + query + j;
                if (!visible) p[j] = 0.f;
              }
              ds[j] = p[j] * (dscores[t][n][2 * half + j] - delta_pair[j]);
              if constexpr (kSoftcap) ds[j] *= soft_cap.slope(scores[t][n][2 * half + j]);
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

template <int kHeadDim, typename Tiling>
constexpr size_t backward_split_shared_bytes() {
  constexpr BackwardSplitTile kTile = Tiling::kTile;
  constexpr int kStagesSplit = kTile.stages;
  constexpr bool kPadded = tile_padded<kHeadDim>(kTile.padded_tiles);
  // K, V [128, D]; Q, dO [stages, 64, D]; P^T, dS^T [128, 64] (16-bit, rows of kStride elements);
  // lse, delta [stages, 64] fp32.
  constexpr int kStride = TileLayout<kHeadDim, kPadded>::kStride;
  constexpr int kScoreStride = TileLayout<kQueries, kPadded>::kStride;
  return size_t(2 * 128 * kStride + 2 * kStagesSplit * kQueries * kStride + 2 * 128 * kScoreStride) * 2 +
         2 * kStagesSplit * kQueries * 4;
}

// kSoftcap: the instantiations that cap scores (params.shape.logit_softcap > 0).
template <typename Element, int kHeadDim, typename Tiling, bool kSoftcap = false>
cudaError_t launch_kv(const PagedAttentionBackwardParams& params, const BackwardWorkspacePointers& workspace,
                      cudaStream_t stream) {
  constexpr BackwardKeysTile kTile = Tiling::kTile;
  constexpr size_t kSharedBytes = backward_shared_bytes<kHeadDim, Tiling>();
  auto kernel = paged_attention_backward_kv_kernel<Element, kHeadDim, Tiling, kSoftcap>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSharedBytes));
  if (error != cudaSuccess) return error;
  BackwardWorkspacePointers owners = workspace;
  owners.num_chunk_blocks = chunk_owner_count<kTile.keys()>(params.shape);
  const dim3 grid(owner_count<kTile.keys()>(params.shape, owners.num_chunk_blocks), params.shape.num_kv_heads);
  if (grid.x == 0) return cudaSuccess;  // no key at all (attend_chunk false, empty history)
  kernel<<<grid, kTile.threads(), kSharedBytes, stream>>>(
      params, owners, soft_cap_of(params.shape.softmax_scale, params.shape.logit_softcap));
  return cudaGetLastError();
}

template <typename Element, int kHeadDim, typename Tiling, bool kSoftcap = false>
cudaError_t launch_kv_split(const PagedAttentionBackwardParams& params, const BackwardWorkspacePointers& workspace,
                            cudaStream_t stream) {
  constexpr size_t kSharedBytes = backward_split_shared_bytes<kHeadDim, Tiling>();
  auto kernel = paged_attention_backward_split_kernel<Element, kHeadDim, Tiling, kSoftcap>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSharedBytes));
  if (error != cudaSuccess) return error;
  BackwardWorkspacePointers owners = workspace;
  owners.num_chunk_blocks = chunk_owner_count<128>(params.shape);
  const dim3 grid(owner_count<128>(params.shape, owners.num_chunk_blocks), params.shape.num_kv_heads);
  if (grid.x == 0) return cudaSuccess;  // no key at all (attend_chunk false, empty history)
  kernel<<<grid, 256, kSharedBytes, stream>>>(params, owners,
                                              soft_cap_of(params.shape.softmax_scale, params.shape.logit_softcap));
  return cudaGetLastError();
}

// Launches one dK/dV layout (for the chosen layout, or a contender of the sweep target).
using KvLaunch = cudaError_t (*)(const PagedAttentionBackwardParams&, const BackwardWorkspacePointers&, cudaStream_t);

// The whole backward of attention_backward.cu (delta, the inverse selection, the dK/dV launch `kv`,
// then dQ; in deterministic mode the dQ pass `dq_pass`) for params that passed backward_params_check.
// Enqueues on `stream`.
cudaError_t run_backward(const PagedAttentionBackwardParams& params, KvLaunch kv, cudaStream_t stream,
                         DqPass dq_pass = DqPass::kAuto);

}  // namespace membar::kernels::cuda::detail
