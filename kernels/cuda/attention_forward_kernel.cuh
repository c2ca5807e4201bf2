// The mma.sync paged-attention forward kernel (FlashAttention-2 style) as a template over its layout
// (ForwardTile). Internal to kernels/: attention_forward.cu instantiates the shipped layouts and
// kernels/sweep/ the contenders (Note [Layout choice] in membar/kernels/attention_cuda.h).
//
// Note [Forward kernel]
// One CTA per (block of rows() queries, q head) with `warps` warps of 16 * row_tiles_per_warp
// query rows; each warp keeps its output accumulator and online-softmax state in registers, and
// reads Q fragments from shared memory on every key block or (q_in_registers) once into
// registers. The CTA walks its key sequence in blocks of keys_per_block keys (KeySequence: the
// history pages, or the selected ones, then, with attend_chunk, the chunk's own keys up to its
// last query), K and V through cp.async in `stages` stages, one barrier per block: with three
// stages the copy of block i + 1 is issued before the barrier of block i (a stage is rewritten
// two blocks after it was read); with two it is issued right after that barrier (the stage it
// overwrites was read in block i - 1, which every warp finished before passing the barrier). With
// one stage (FlashAttention-2's pipeline, the least shared memory) there is one K and one V buffer
// and two barriers per block: after the first (K of block i has landed, V of block i - 1 is no
// longer read) V of block i loads while S = Q K^T and the softmax run; after the second (V has
// landed, K is no longer read) K of block i + 1 loads while O += P V runs. Scores are masked only
// where a block can cut: the partial last history page and the chunk's diagonal blocks. With
// skip_rescale a warp whose row maxima did not change in a block skips rescaling its accumulator
// (common once a long history has shown its largest scores; its vote and branch can cost more
// than the multiplications they save, see Note [Lazy rescale] for the form that decides before
// any exponential). At the end each row is divided by its softmax sum and
// lse = max * scale + log(sum) is written. With kSoftcap every score is capped before its masks
// (Note [Soft-capped scores in raw units] in attention_common.cuh). A sliding window starts the
// loop at the first block the CTA's first query sees and masks the blocks that straddle a warp's
// window edge (Note [Sliding window in the kernels] in attention_common.cuh).
//
// Note [Forward pipelining]
// Within a warp the three steps of a block depend on each other (S, then its softmax, then P V),
// so while one warp runs the softmax's exponentials its tensor-core work waits, and only the other
// warps of the SM can fill the gap. With pipelined the loop computes S of block i + 1 right
// before the softmax of block i: the tensor cores work through those products while the same
// warp issues the softmax (FlashAttention-3 overlaps the same two steps with warpgroup MMAs).
// It keeps two blocks of scores in registers and needs three K/V stages: block i (V still read),
// block i + 1 (K read) and block i + 2 (loading, issued after the barrier that shows block i + 1
// has landed, so every warp has finished block i - 1, whose stage it overwrites).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "attention_common.cuh"
#include "attention_cuda_internal.h"

namespace membar::kernels::cuda::detail {

// Note [Lazy rescale]
// The online softmax rescales the output accumulator (and running sum) by exp(m_old - m_new)
// whenever a row's running maximum m grows: 64 multiplications per thread and block, plus an
// exponential the multiplications wait for. With lazy_rescale the maximum is only moved when some
// row's block maximum exceeds it by more than kLazyRescaleLog2 (2^8 = 256 in probability), which
// after the first blocks of a long history almost never happens; otherwise P = exp(s - m_old)
// may reach 256, which bf16 P, the fp32 sums and the fp32 accumulator hold without loss. The
// final out = O / sum and lse = m + log(sum) use the same (stale) m, so the result is the same
// function; only rounding differs. The decision needs only the block maximum (no exponential) and
// one warp vote per row tile and block (FlashAttention-4 uses the same idea).
inline constexpr float kLazyRescaleLog2 = 8.f;

// A layout of the forward kernel (Note [Forward kernel]): named fields, bounds checked by
// forward_tile_checked when a layout is instantiated. The layout names of docs/kernels.md spell
// them out: w<warps>r<rows per warp>_k<keys_per_block>_s<stages>, then _qreg (q_in_registers),
// _skip (skip_rescale, which implies shift indexing), _shift (shift_indexing), _2cta
// (ctas_per_sm = 2), _pad (padded_tiles), _pipe (pipelined), _seq (sequential_row_tiles) and
// _lazy (lazy_rescale).
struct ForwardTile {
  int warps = 8;                      // warps per CTA
  int row_tiles_per_warp = 1;         // 16-row query tiles per warp: two read every K and V fragment
                                      // once for 32 rows, at about 255 registers for head_dim 128
  int keys_per_block = 64;            // keys per block (a block lies inside one page)
  int stages = 3;                     // K/V stages in shared memory (1: one K and one V buffer, in turns)
  int ctas_per_sm = 1;                // CTAs per SM the registers are budgeted for (__launch_bounds__)
  bool q_in_registers = false;        // Q fragments loaded once into registers, not per block
  bool skip_rescale = false;          // skip the rescale when no row maximum of the warp grew
  bool shift_indexing = false;        // page and row numbers by shifts, not divisions (KeySequence)
  bool padded_tiles = false;          // padded instead of swizzled tiles (Note [Padded tiles]; always
                                      // at head sizes that are not a multiple of 64)
  bool pipelined = false;             // S of the next block before this one's softmax (Note [Forward pipelining])
  bool sequential_row_tiles = false;  // two row tiles' S and softmax one after the other (one
                                      // tile's scores live; K fragments read once per tile)
  bool lazy_rescale = false;          // move the running maximum only when it grows by 2^8 (Note [Lazy rescale])

  constexpr int rows() const { return 16 * row_tiles_per_warp * warps; }
  constexpr int threads() const { return 32 * warps; }
};

// The bounds of a ForwardTile at a head_dim; true when they hold (a false one does not compile).
template <int kHeadDim, typename Tiling>
constexpr bool forward_tile_checked() {
  constexpr ForwardTile kTile = Tiling::kTile;
  static_assert(kTile.warps == 4 || kTile.warps == 8, "a CTA has 4 or 8 warps (a copy pass moves whole tile rows)");
  static_assert(kTile.row_tiles_per_warp == 1 || kTile.row_tiles_per_warp == 2,
                "a warp holds 16 or 32 query rows (more does not fit the registers)");
  static_assert(kTile.keys_per_block == 64 || kTile.keys_per_block == 128,
                "a key block is 64 or 128 keys (a page of 64 or 128 holds whole blocks)");
  static_assert(kTile.stages >= 1 && kTile.stages <= 3, "the barrier schemes of Note [Forward kernel] take 1 to 3 stages");
  static_assert(kTile.ctas_per_sm == 1 || kTile.ctas_per_sm == 2, "registers are budgeted for one or two CTAs per SM");
  static_assert(!(kTile.lazy_rescale && kTile.skip_rescale), "lazy rescaling replaces the rescale skip");
  static_assert(!kTile.pipelined || kTile.stages == 3, "the pipelined loop keeps blocks i and i + 1 while i + 2 loads");
  static_assert(!kTile.sequential_row_tiles || (kTile.row_tiles_per_warp == 2 && kTile.stages > 1 && !kTile.pipelined),
                "sequential row tiles need two of them and the plain two- or three-stage loop");
  static_assert(kHeadDim % 16 == 0, "a row of Q, K or V is whole 16-column MMA fragments");
  return true;
}

template <int kHeadDim, typename Tiling>
constexpr size_t forward_shared_bytes_fixed() {
  constexpr ForwardTile kTile = Tiling::kTile;
  // Q [rows, D] + K and V [stages, keys_per_block, D], 16-bit elements (rows of kStride elements).
  constexpr int kStride = TileLayout<kHeadDim, tile_padded<kHeadDim>(kTile.padded_tiles)>::kStride;
  return size_t(kTile.rows() * kStride + 2 * kTile.stages * kTile.keys_per_block * kStride) * 2;
}

template <typename Element, int kHeadDim, typename Tiling, bool kSoftcap = false>
__global__ void __launch_bounds__(Tiling::kTile.threads(), Tiling::kTile.ctas_per_sm)
    paged_attention_forward_kernel(const PagedAttentionForwardParams params) {
  static_assert(forward_tile_checked<kHeadDim, Tiling>(), "forward_tile_checked holds the bounds");
  constexpr int kWarps = Tiling::kTile.warps;
  constexpr int kRowTiles = Tiling::kTile.row_tiles_per_warp;
  constexpr int kStages = Tiling::kTile.stages;
  constexpr int kWarpRows = 16 * kRowTiles;
  constexpr int kRows = Tiling::kTile.rows();
  constexpr int kThreads = kWarps * 32;
  constexpr int kKeys = Tiling::kTile.keys_per_block;
  constexpr bool kPadded = tile_padded<kHeadDim>(Tiling::kTile.padded_tiles);
  using Layout = TileLayout<kHeadDim, kPadded>;
  constexpr int kStride = Layout::kStride;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  Element* q_tile = reinterpret_cast<Element*>(shared_raw);     // [kRows, D]
  Element* k_tiles = q_tile + kRows * kStride;                    // [kStages, kKeys, D]
  Element* v_tiles = k_tiles + kStages * kKeys * kStride;         // [kStages, kKeys, D]
  int32_t* selected = reinterpret_cast<int32_t*>(v_tiles + kStages * kKeys * kStride);  // [selected_per_tile]
  __shared__ int selected_count;

  const PagedAttentionShape& shape = params.shape;
  const int thread = threadIdx.x;
  const int warp = thread / 32;
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
  load_tile_async<Element, kRows, kHeadDim, kThreads, kPadded>(
      q_tile, q + int64_t(first_query) * q_row_stride + int64_t(q_head) * kHeadDim, q_row_stride,
      chunk_tokens - first_query, thread);
  copy_async_commit();

  const auto keys =
      key_sequence_for_tile<Element, kKeys, Tiling::kTile.shift_indexing, kHeadDim>(params, kv_head, first_query, selected, &selected_count);
  const int last_query = min(first_query + kRows, chunk_tokens) - 1;
  // Without attend_chunk only the history blocks (Note [Blocked history] in attention.h); a CTA
  // with no block at all writes out = 0 and lse = -inf. With a sliding window the loop skips the
  // first_block blocks no query of the CTA sees: loop index i is key-sequence block first_block + i
  // (Note [Sliding window in the kernels]).
  const int first_block = window_first_block<kKeys>(shape, keys.num_history_blocks, first_query);
  const int num_blocks = keys.num_history_blocks + (shape.attend_chunk ? last_query / kKeys + 1 : 0) - first_block;
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;

  auto load_keys = [&](int index, int stage) {
    const KeyBlock<Element> block = keys.block(first_block + index);
    load_tile_async<Element, kKeys, kHeadDim, kThreads, kPadded>(k_tiles + stage * kKeys * kStride, block.k_base,
                                                          kv_row_stride, block.valid_rows, thread);
  };
  auto load_values = [&](int index, int stage) {
    const KeyBlock<Element> block = keys.block(first_block + index);
    load_tile_async<Element, kKeys, kHeadDim, kThreads, kPadded>(v_tiles + stage * kKeys * kStride, block.v_base,
                                                          kv_row_stride, block.valid_rows, thread);
  };
  auto load_block = [&](int index, int stage) {
    const KeyBlock<Element> block = keys.block(first_block + index);
    load_tile_async<Element, kKeys, kHeadDim, kThreads, kPadded>(k_tiles + stage * kKeys * kStride, block.k_base,
                                                          kv_row_stride, block.valid_rows, thread);
    load_tile_async<Element, kKeys, kHeadDim, kThreads, kPadded>(v_tiles + stage * kKeys * kStride, block.v_base,
                                                          kv_row_stride, block.valid_rows, thread);
  };
  if (num_blocks > 0) {
    if constexpr (kStages == 1) {
      load_keys(0, 0);
    } else {
      load_block(0, 0);
    }
  }
  copy_async_commit();

  const float scale_log2 = shape.softmax_scale * kLog2e;
  // Note [Lazy rescale]: how far (in raw score units) a block maximum may exceed the running one
  // before the running one moves.
  const float lazy_threshold = kLazyRescaleLog2 / scale_log2;
  SoftCap soft_cap;
  if constexpr (kSoftcap) soft_cap = soft_cap_of(shape.softmax_scale, shape.logit_softcap);
  // Rows this thread holds, per row tile t: warp_row + 16 t + lane / 4 and that + 8.
  const int warp_row = warp * kWarpRows;
  float output[kRowTiles][kHeadDim / 8][4];
  float row_max[kRowTiles][2];
  float row_sum[kRowTiles][2];
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
    clear(output[t]);
    row_max[t][0] = row_max[t][1] = -INFINITY;
    row_sum[t][0] = row_sum[t][1] = 0.f;
  }

  // Q fragments of this warp's rows, loaded once (q_in_registers): the Q copy is the oldest group.
  uint32_t q_fragments[kRowTiles][Tiling::kTile.q_in_registers ? kHeadDim / 16 : 1][4];
  if constexpr (Tiling::kTile.q_in_registers) {
    copy_async_wait<1>();
    __syncthreads();
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t) {
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        ldmatrix_x4(q_fragments[t][kk],
                    q_tile + Layout::offset(warp_row + t * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8));
      }
    }
  }

  // S = Q K^T of the block in `stage`, into acc ([row tile][n8 tile][4]).
  using Scores = float[kRowTiles][kKeys / 8][4];
  // With only_tile >= 0 (a constant at every call), just that row tile (sequential_row_tiles).
  auto compute_scores = [&](Scores& acc, int stage, int only_tile) {
    const Element* k_tile = k_tiles + stage * kKeys * kStride;
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t) {
      if (only_tile < 0 || t == only_tile) clear(acc[t]);
    }
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      uint32_t a[kRowTiles][4];
#pragma unroll
      for (int t = 0; t < kRowTiles; ++t) {
        if (only_tile >= 0 && t != only_tile) continue;
        if constexpr (Tiling::kTile.q_in_registers) {
#pragma unroll
          for (int j = 0; j < 4; ++j) a[t][j] = q_fragments[t][kk][j];
        } else {
          ldmatrix_x4(a[t], q_tile + Layout::offset(warp_row + t * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8));
        }
      }
#pragma unroll
      for (int nn = 0; nn < kKeys / 16; ++nn) {
        uint32_t b[4];
        const int row = nn * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int column = kk * 16 + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(b, k_tile + Layout::offset(row, column));
#pragma unroll
        for (int t = 0; t < kRowTiles; ++t) {
          if (only_tile >= 0 && t != only_tile) continue;
          ElementTraits<Element>::mma(acc[t][2 * nn], a[t], b[0], b[1]);
          ElementTraits<Element>::mma(acc[t][2 * nn + 1], a[t], b[2], b[3]);
        }
      }
    }
  };
  // Mask and online softmax of row tile t of a block's scores; P goes to p as A fragments.
  // window_edge: the block's (Note [Sliding window in the kernels]), used when window_cuts.
  auto softmax_tile = [&](Scores& scores, int t, const KeyBlock<Element>& block, bool needs_mask, bool window_cuts,
                          int window_edge, uint32_t (&p)[kKeys / 16][4]) {
    const bool chunk_block = block.first_position >= 0;
    const int row_position = first_query + warp_row + t * 16 + lane / 4;
    if constexpr (kSoftcap) soft_cap_scores(scores[t], soft_cap);
    if (needs_mask) {
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int key = n * 8 + 2 * (lane % 4) + (j & 1);
          bool visible = key < block.valid_rows;
          if (chunk_block) visible = visible && block.first_position + key <= row_position + (j >> 1) * 8;
          if (!visible) scores[t][n][j] = -INFINITY;
        }
      }
    }
    if (window_cuts) {
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int key = n * 8 + 2 * (lane % 4) + (j & 1);
          if (key + window_edge <= row_position + (j >> 1) * 8) scores[t][n][j] = -INFINITY;
        }
      }
    }
    if constexpr (Tiling::kTile.lazy_rescale) {
      // Note [Lazy rescale]: the running maximum moves only when a row's block maximum exceeds it
      // by more than kLazyRescaleLog2 (in log2 units), decided before any exponential.
      float block_max[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        block_max[half] = -INFINITY;
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
          block_max[half] = fmaxf(block_max[half], fmaxf(scores[t][n][2 * half], scores[t][n][2 * half + 1]));
        }
        block_max[half] = quad_max(block_max[half]);
      }
      const bool grows = block_max[0] > row_max[t][0] + lazy_threshold || block_max[1] > row_max[t][1] + lazy_threshold;
      if (__any_sync(0xffffffffu, grows)) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float new_max = fmaxf(row_max[t][half], block_max[half]);
          const float max_scaled = new_max == -INFINITY ? 0.f : new_max * scale_log2;
          const float correction = exp2f(row_max[t][half] * scale_log2 - max_scaled);
          row_max[t][half] = new_max;
          row_sum[t][half] *= correction;
#pragma unroll
          for (int n = 0; n < kHeadDim / 8; ++n) {
            output[t][n][2 * half] *= correction;
            output[t][n][2 * half + 1] *= correction;
          }
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float max_scaled = row_max[t][half] == -INFINITY ? 0.f : row_max[t][half] * scale_log2;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
          for (int j = 2 * half; j < 2 * half + 2; ++j) {
            scores[t][n][j] = exp2f(scores[t][n][j] * scale_log2 - max_scaled);
            sum += scores[t][n][j];
          }
        }
        row_sum[t][half] += sum;
      }
    } else {
      // Online softmax over this block (Note [Forward kernel]).
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float block_max = -INFINITY;
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
          block_max = fmaxf(block_max, fmaxf(scores[t][n][2 * half], scores[t][n][2 * half + 1]));
        }
        block_max = quad_max(block_max);
        const float new_max = fmaxf(row_max[t][half], block_max);
        const float max_scaled = new_max == -INFINITY ? 0.f : new_max * scale_log2;
        const float correction = exp2f(row_max[t][half] * scale_log2 - max_scaled);
        row_max[t][half] = new_max;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
          for (int j = 2 * half; j < 2 * half + 2; ++j) {
            scores[t][n][j] = exp2f(scores[t][n][j] * scale_log2 - max_scaled);
            sum += scores[t][n][j];
          }
        }
        row_sum[t][half] = row_sum[t][half] * correction + sum;
        // Skipped (skip_rescale) when no row of the warp got a new maximum: every correction is 1.
        if (!Tiling::kTile.skip_rescale || __any_sync(0xffffffffu, correction != 1.f)) {
#pragma unroll
          for (int n = 0; n < kHeadDim / 8; ++n) {
            output[t][n][2 * half] *= correction;
            output[t][n][2 * half + 1] *= correction;
          }
        }
      }
    }
    accumulator_to_a_fragments<Element, kKeys>(p, scores[t]);
  };
  // Whether some score of this warp's rows in the block must be masked.
  auto block_needs_mask = [&](const KeyBlock<Element>& block) {
    return block.valid_rows < kKeys ||
           (block.first_position >= 0 && block.first_position + kKeys - 1 > first_query + warp_row);
  };
  // Whether the window hides some key of the block from some row of this warp: the last row does
  // not see the block's first key.
  auto window_cuts_block = [&](int window_edge) { return window_edge <= first_query + warp_row + kWarpRows - 1; };
  using Probabilities = uint32_t[kRowTiles][kKeys / 16][4];
  auto multiply_values = [&](Probabilities& p_fragments, const Element* v_tile) {
    // O += P V: every V fragment serves all row tiles of the warp.
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < kHeadDim / 16; ++nn) {
        uint32_t b[4];
        const int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int column = nn * 16 + (lane >> 4) * 8;
        ldmatrix_x4_trans(b, v_tile + Layout::offset(row, column));
#pragma unroll
        for (int t = 0; t < kRowTiles; ++t) {
          ElementTraits<Element>::mma(output[t][2 * nn], p_fragments[t][kk], b[0], b[1]);
          ElementTraits<Element>::mma(output[t][2 * nn + 1], p_fragments[t][kk], b[2], b[3]);
        }
      }
    }
  };
  // Mask, online softmax and O += P V of block `index` (in `stage`), from its scores.
  auto accumulate_block = [&](Scores& scores, int index, int stage) {
    const KeyBlock<Element> block = keys.block(first_block + index);
    const bool needs_mask = block_needs_mask(block);
    const int window_edge = window_edge_of_block<kKeys>(shape, first_block + index, block.first_position);
    const bool window_cuts = window_cuts_block(window_edge);
    Probabilities p_fragments;
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t) {
      softmax_tile(scores, t, block, needs_mask, window_cuts, window_edge, p_fragments[t]);
    }
    if constexpr (kStages == 1) {
      copy_async_wait<0>();
      __syncthreads();
      if (index + 1 < num_blocks) load_keys(index + 1, 0);
      copy_async_commit();
    }
    multiply_values(p_fragments, v_tiles + stage * kKeys * kStride);
  };

  if constexpr (Tiling::kTile.pipelined) {
    // Note [Forward pipelining]: S of block i + 1 is computed before the softmax of block i, so
    // that the tensor cores work on it while the warp runs the softmax's exponentials.
    static_assert(kStages == 3, "the pipelined loop keeps blocks i and i + 1 while i + 2 loads");
    Scores scores_even, scores_odd;
    if (num_blocks > 1) load_block(1, 1);
    copy_async_commit();
    copy_async_wait<1>();
    __syncthreads();
    if (num_blocks > 0) compute_scores(scores_even, 0, -1);
    // One step: block `index`'s scores are in `current`; block index + 1's go to `next`.
    auto step = [&](Scores& current, Scores& next, int index) {
      if (index + 1 < num_blocks) {
        copy_async_wait<0>();
        __syncthreads();
        if (index + 2 < num_blocks) load_block(index + 2, (index + 2) % kStages);
        copy_async_commit();
        compute_scores(next, (index + 1) % kStages, -1);
      }
      accumulate_block(current, index, index % kStages);
    };
    for (int index = 0; index < num_blocks; index += 2) {
      step(scores_even, scores_odd, index);
      if (index + 1 < num_blocks) step(scores_odd, scores_even, index + 1);
    }
  } else {
    for (int index = 0; index < num_blocks; ++index) {
      const int stage = index % kStages;
      if constexpr (kStages == 3) {
        if (index + 1 < num_blocks) load_block(index + 1, (index + 1) % kStages);
        copy_async_commit();
        copy_async_wait<1>();
        __syncthreads();
      } else if constexpr (kStages == 2) {
        copy_async_wait<0>();
        __syncthreads();
        if (index + 1 < num_blocks) load_block(index + 1, (index + 1) % kStages);
        copy_async_commit();
      } else {
        copy_async_wait<0>();
        __syncthreads();
        load_values(index, 0);
        copy_async_commit();
      }
      Scores scores;
      if constexpr (Tiling::kTile.sequential_row_tiles) {
        // One row tile at a time up to its P, so that only one tile's scores are live.
        const KeyBlock<Element> block = keys.block(first_block + index);
        const bool needs_mask = block_needs_mask(block);
        const int window_edge = window_edge_of_block<kKeys>(shape, first_block + index, block.first_position);
        const bool window_cuts = window_cuts_block(window_edge);
        Probabilities p_fragments;
#pragma unroll
        for (int t = 0; t < kRowTiles; ++t) {
          compute_scores(scores, stage, t);
          softmax_tile(scores, t, block, needs_mask, window_cuts, window_edge, p_fragments[t]);
        }
        multiply_values(p_fragments, v_tiles + stage * kKeys * kStride);
      } else {
        compute_scores(scores, stage, -1);
        accumulate_block(scores, index, stage);
      }
      // No barrier here: the copy issued next overwrites the stage read two blocks ago (three
      // stages), or is issued after the next barrier (one or two) (Note [Forward kernel]).
    }
  }

  // Leave no copy in flight (a CTA without key blocks never waited for its Q copy).
  copy_async_wait<0>();

  Element* out = static_cast<Element*>(params.out);
  float* lse = static_cast<float*>(params.lse);
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float sum = quad_sum(row_sum[t][half]);
      const int position = first_query + warp_row + t * 16 + lane / 4 + half * 8;
      if (position >= chunk_tokens) continue;
      const float inverse = sum > 0.f ? 1.f / sum : 0.f;
      Element* out_row = out + int64_t(position) * q_row_stride + int64_t(q_head) * kHeadDim;
#pragma unroll
      for (int n = 0; n < kHeadDim / 8; ++n) {
        const int column = n * 8 + 2 * (lane % 4);
        *reinterpret_cast<uint32_t*>(out_row + column) =
            ElementTraits<Element>::pack(output[t][n][2 * half] * inverse, output[t][n][2 * half + 1] * inverse);
      }
      if (lane % 4 == 0) {
        lse[int64_t(q_head) * chunk_tokens + position] =
            sum > 0.f ? row_max[t][half] * shape.softmax_scale + logf(sum) : -INFINITY;
      }
    }
  }
}

// kSoftcap: the instantiation that caps scores (params.shape.logit_softcap > 0).
template <typename Element, int kHeadDim, typename Tiling, bool kSoftcap = false>
cudaError_t launch_forward(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  constexpr ForwardTile kTile = Tiling::kTile;
  const PagedAttentionShape& shape = params.shape;
  const size_t shared_bytes = forward_shared_bytes_fixed<kHeadDim, Tiling>() +
                              (params.selection.selected_pages != nullptr ? size_t(params.selection.selected_per_tile) * 4 : 0);
  auto kernel = paged_attention_forward_kernel<Element, kHeadDim, Tiling, kSoftcap>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
  if (error != cudaSuccess) return error;
  if (kTile.ctas_per_sm > 1) {
    // Ask for the largest shared-memory carveout, so that ctas_per_sm CTAs fit on one SM.
    error = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, int(cudaSharedmemCarveoutMaxShared));
    if (error != cudaSuccess) return error;
  }
  const dim3 grid((shape.chunk_tokens + kTile.rows() - 1) / kTile.rows(), shape.num_q_heads);
  kernel<<<grid, kTile.threads(), shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

// Whether a layout can run this call: a key block must lie inside one page, and a CTA's queries
// inside one selection tile.
template <typename Tiling>
bool forward_tile_fits(const PagedAttentionForwardParams& params) {
  constexpr ForwardTile kTile = Tiling::kTile;
  if (params.shape.page_tokens % kTile.keys_per_block != 0) return false;
  return params.selection.selected_pages == nullptr || params.selection.query_tile_tokens % kTile.rows() == 0;
}

}  // namespace membar::kernels::cuda::detail
