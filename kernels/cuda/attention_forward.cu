// Paged attention forward on CUDA (FlashAttention-2 style, mma.sync tensor cores).
//
// Note [Forward kernel]
// One CTA per (block of kRows queries, q head) with kWarps warps of 16 * kRowTiles query rows; each
// warp keeps its output accumulator and online-softmax state in registers, and reads Q fragments
// from shared memory on every key block or (kQInRegisters) once into registers. The CTA walks its
// key sequence in blocks of kKeys keys (KeySequence: the history pages, or the selected ones, then,
// with attend_chunk, the chunk's own keys up to its last query), K and V through cp.async in
// kStages stages, one barrier per block: with three stages the copy of block i + 1 is issued
// before the barrier of block i (a stage is rewritten two blocks after it was read); with two it is
// issued right after that barrier (the stage it overwrites was read in block i - 1, which every
// warp finished before passing the barrier). With one stage (FlashAttention-2's pipeline, the
// least shared memory) there is one K and one V buffer and two barriers per block: after the
// first (K of block i has landed, V of block i - 1 is no longer read) V of block i loads while
// S = Q K^T and the softmax run; after the second (V has landed, K is no longer read) K of block
// i + 1 loads while O += P V runs. Scores are masked only where a block can cut: the
// partial last history page and the chunk's diagonal blocks. With kSkipRescale a warp whose row
// maxima did not change in a block skips rescaling its accumulator (common once a long history
// has shown its largest scores; on the H200 its vote and branch cost more than the multiplications
// they save, see Note [Lazy rescale] for the form that decides before any exponential). At the
// end each row is divided by its softmax sum and lse = max * scale + log(sum) is written.
//
// Note [Forward pipelining]
// Within a warp the three steps of a block depend on each other (S, then its softmax, then P V),
// so while one warp runs the softmax's exponentials its tensor-core work waits, and only the other
// warps of the SM can fill the gap. With kPipelined the loop computes S of block i + 1 right
// before the softmax of block i: the tensor cores work through those products while the same
// warp issues the softmax (FlashAttention-3 overlaps the same two steps with warpgroup MMAs).
// It keeps two blocks of scores in registers and needs three K/V stages: block i (V still read),
// block i + 1 (K read) and block i + 2 (loading, issued after the barrier that shows block i + 1
// has landed, so every warp has finished block i - 1, whose stage it overwrites).
//
// Note [Forward variants]
// Rationale: the best layout depends on the GPU and is found by measuring (bench/attention_sweep.py).
// Approach: kForwardVariants lists compiled configurations of the bf16, head_dim 128 kernel;
// MEMBAR_ATTENTION_FORWARD_VARIANT=<name> picks one at run time (read at every launch), else the
// default (kDefaultForwardVariant: the fastest one measured on the H200, then its fallbacks;
// "w8r16_k64_s3" is the layout before tuning). A variant runs only where it applies (kKeys <=
// page_tokens; sparse tiles a multiple of its kRows; wgmma: sm_90a); elsewhere, and for the other
// dtypes and head dims, the layouts of dispatch_rows run. Every variant computes the same
// function; results differ only in rounding.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "attention_common.cuh"
#include "attention_cuda_internal.h"
#include "attention_wgmma.h"

namespace membar::kernels::cuda {
namespace {

using namespace detail;

// Note [Lazy rescale]
// The online softmax rescales the output accumulator (and running sum) by exp(m_old - m_new)
// whenever a row's running maximum m grows: 64 multiplications per thread and block, plus an
// exponential the multiplications wait for. With kLazyRescale the maximum is only moved when some
// row's block maximum exceeds it by more than kLazyRescaleLog2 (2^8 = 256 in probability), which
// after the first blocks of a long history almost never happens; otherwise P = exp(s - m_old)
// may reach 256, which bf16 P, the fp32 sums and the fp32 accumulator hold without loss. The
// final out = O / sum and lse = m + log(sum) use the same (stale) m, so the result is the same
// function; only rounding differs. The decision needs only the block maximum (no exponential) and
// one warp vote per row tile and block (FlashAttention-4 uses the same idea).
constexpr float kLazyRescaleLog2 = 8.f;

// A compiled layout of the forward kernel (Note [Forward kernel]).
//   kWarps, kRowTiles: warps per CTA and 16-row tiles per warp (two tiles read every K and V
//     fragment once for 32 rows, halving shared-memory traffic per tensor-core instruction, but
//     need about 255 registers at head_dim 128);
//   kKeys: keys per block (64 or 128; at most page_tokens);
//   kStages: K/V stages in shared memory (1, 2 or 3; 1 = one K and one V buffer, loaded in turns);
//   kQInRegisters: Q fragments loaded once into registers instead of from shared memory per block;
//   kSkipRescale: skip the accumulator rescale when a warp's row maxima did not change;
//   kMinBlocks: CTAs per SM the registers are budgeted for (__launch_bounds__);
//   kShiftIndexing: page and row numbers by shifts (KeySequence); on in every tuned variant
//     (those with kSkipRescale), off in today's default layout;
//   kPadded: Q, K and V tiles padded instead of swizzled (Note [Padded tiles]);
//   kPipelined: S of the next block before the softmax of this one (Note [Forward pipelining]);
//   kSequentialTiles: with two row tiles per warp, S and softmax of one tile after the other (one
//     tile's scores live instead of two; K fragments are read once per tile, V once per warp);
//   kLazyRescale: move the running maximum only when it grows by more than 2^8 (Note [Lazy rescale]).
template <int kWarps_, int kRowTiles_, int kKeys_, int kStages_, bool kQInRegisters_, bool kSkipRescale_, int kMinBlocks_,
          bool kShiftIndexing_ = kSkipRescale_, bool kPadded_ = false, bool kPipelined_ = false,
          bool kSequentialTiles_ = false, bool kLazyRescale_ = false>
struct ForwardConfig {
  static constexpr int kWarps = kWarps_;
  static constexpr int kRowTiles = kRowTiles_;
  static constexpr int kKeys = kKeys_;
  static constexpr int kStages = kStages_;
  static constexpr bool kQInRegisters = kQInRegisters_;
  static constexpr bool kSkipRescale = kSkipRescale_;
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr bool kShiftIndexing = kShiftIndexing_;
  static constexpr bool kPadded = kPadded_;
  static constexpr bool kPipelined = kPipelined_;
  static constexpr bool kSequentialTiles = kSequentialTiles_;
  static constexpr bool kLazyRescale = kLazyRescale_;
  static_assert(!(kLazyRescale && kSkipRescale), "lazy rescaling replaces the rescale skip");
  static_assert(!kSequentialTiles || (kStages > 1 && !kPipelined), "sequential tiles use the plain two- or three-stage loop");
  static constexpr int kRows = 16 * kRowTiles * kWarps;
  static_assert(kKeys == 64 || kKeys == 128, "a key block is 64 or 128 keys (a page holds whole blocks)");
  static_assert(kStages >= 1 && kStages <= 3, "the barrier schemes of Note [Forward kernel] take 1 to 3 stages");
};

// The layout every dtype and head_dim runs by default: eight warps of 16 rows, 64-key blocks.
using DefaultForwardConfig = ForwardConfig<8, 1, 64, 3, false, false, 1>;

template <int kHeadDim, typename Config>
constexpr size_t forward_shared_bytes_fixed() {
  // Q [kRows, D] + K and V [kStages, kKeys, D], 16-bit elements (rows of kStride elements).
  constexpr int kStride = TileLayout<kHeadDim, Config::kPadded>::kStride;
  return size_t(Config::kRows * kStride + 2 * Config::kStages * Config::kKeys * kStride) * 2;
}

template <typename Element, int kHeadDim, typename Config>
__global__ void __launch_bounds__(Config::kWarps * 32, Config::kMinBlocks)
    paged_attention_forward_kernel(const PagedAttentionForwardParams params) {
  constexpr int kWarps = Config::kWarps;
  constexpr int kRowTiles = Config::kRowTiles;
  constexpr int kStages = Config::kStages;
  constexpr int kWarpRows = 16 * kRowTiles;
  constexpr int kRows = Config::kRows;
  constexpr int kThreads = kWarps * 32;
  constexpr int kKeys = Config::kKeys;
  using Layout = TileLayout<kHeadDim, Config::kPadded>;
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
  load_tile_async<Element, kRows, kHeadDim, kThreads, Config::kPadded>(
      q_tile, q + int64_t(first_query) * q_row_stride + int64_t(q_head) * kHeadDim, q_row_stride,
      chunk_tokens - first_query, thread);
  copy_async_commit();

  const auto keys =
      key_sequence_for_tile<Element, kKeys, Config::kShiftIndexing, kHeadDim>(params, kv_head, first_query, selected, &selected_count);
  const int last_query = min(first_query + kRows, chunk_tokens) - 1;
  // Without attend_chunk only the history blocks (Note [Blocked history] in attention.h); a CTA
  // with no block at all writes out = 0 and lse = -inf.
  const int num_blocks = keys.num_history_blocks + (shape.attend_chunk ? last_query / kKeys + 1 : 0);
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;

  auto load_keys = [&](int index, int stage) {
    const KeyBlock<Element> block = keys.block(index);
    load_tile_async<Element, kKeys, kHeadDim, kThreads, Config::kPadded>(k_tiles + stage * kKeys * kStride, block.k_base,
                                                                          kv_row_stride, block.valid_rows, thread);
  };
  auto load_values = [&](int index, int stage) {
    const KeyBlock<Element> block = keys.block(index);
    load_tile_async<Element, kKeys, kHeadDim, kThreads, Config::kPadded>(v_tiles + stage * kKeys * kStride, block.v_base,
                                                                          kv_row_stride, block.valid_rows, thread);
  };
  auto load_block = [&](int index, int stage) {
    const KeyBlock<Element> block = keys.block(index);
    load_tile_async<Element, kKeys, kHeadDim, kThreads, Config::kPadded>(k_tiles + stage * kKeys * kStride, block.k_base,
                                                                          kv_row_stride, block.valid_rows, thread);
    load_tile_async<Element, kKeys, kHeadDim, kThreads, Config::kPadded>(v_tiles + stage * kKeys * kStride, block.v_base,
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

  // Q fragments of this warp's rows, loaded once (kQInRegisters): the Q copy is the oldest group.
  uint32_t q_fragments[kRowTiles][Config::kQInRegisters ? kHeadDim / 16 : 1][4];
  if constexpr (Config::kQInRegisters) {
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
  // With only_tile >= 0 (a constant at every call), just that row tile (kSequentialTiles).
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
        if constexpr (Config::kQInRegisters) {
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
  auto softmax_tile = [&](Scores& scores, int t, const KeyBlock<Element>& block, bool needs_mask,
                          uint32_t (&p)[kKeys / 16][4]) {
    const bool chunk_block = block.first_position >= 0;
    const int row_position = first_query + warp_row + t * 16 + lane / 4;
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
    if constexpr (Config::kLazyRescale) {
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
        // Skipped (kSkipRescale) when no row of the warp got a new maximum: every correction is 1.
        if (!Config::kSkipRescale || __any_sync(0xffffffffu, correction != 1.f)) {
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
    const KeyBlock<Element> block = keys.block(index);
    const bool needs_mask = block_needs_mask(block);
    Probabilities p_fragments;
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t) softmax_tile(scores, t, block, needs_mask, p_fragments[t]);
    if constexpr (kStages == 1) {
      copy_async_wait<0>();
      __syncthreads();
      if (index + 1 < num_blocks) load_keys(index + 1, 0);
      copy_async_commit();
    }
    multiply_values(p_fragments, v_tiles + stage * kKeys * kStride);
  };

  if constexpr (Config::kPipelined) {
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
      if constexpr (Config::kSequentialTiles) {
        // One row tile at a time up to its P, so that only one tile's scores are live.
        const KeyBlock<Element> block = keys.block(index);
        const bool needs_mask = block_needs_mask(block);
        Probabilities p_fragments;
#pragma unroll
        for (int t = 0; t < kRowTiles; ++t) {
          compute_scores(scores, stage, t);
          softmax_tile(scores, t, block, needs_mask, p_fragments[t]);
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

template <typename Element, int kHeadDim, typename Config>
cudaError_t launch_forward(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  const PagedAttentionShape& shape = params.shape;
  const size_t shared_bytes = forward_shared_bytes_fixed<kHeadDim, Config>() +
                              (params.selection.selected_pages != nullptr ? size_t(params.selection.selected_per_tile) * 4 : 0);
  auto kernel = paged_attention_forward_kernel<Element, kHeadDim, Config>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
  if (error != cudaSuccess) return error;
  if (Config::kMinBlocks > 1) {
    // Ask for the largest shared-memory carveout, so that kMinBlocks CTAs fit on one SM.
    error = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, int(cudaSharedmemCarveoutMaxShared));
    if (error != cudaSuccess) return error;
  }
  const dim3 grid((shape.chunk_tokens + Config::kRows - 1) / Config::kRows, shape.num_q_heads);
  kernel<<<grid, Config::kWarps * 32, shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

// Whether a layout can run this call: a key block must lie inside one page, and a CTA's queries
// inside one selection tile.
template <typename Config>
bool config_applies(const PagedAttentionForwardParams& params) {
  if (Config::kKeys > params.shape.page_tokens) return false;
  return params.selection.selected_pages == nullptr || params.selection.query_tile_tokens % Config::kRows == 0;
}

using ForwardLaunch = cudaError_t (*)(const PagedAttentionForwardParams&, cudaStream_t);
using ForwardApplies = bool (*)(const PagedAttentionForwardParams&);
struct ForwardVariant {
  const char* name;
  ForwardLaunch launch;
  ForwardApplies applies;
};

template <typename Config>
constexpr ForwardVariant bf16_d128_variant(const char* name) {
  return ForwardVariant{name, &launch_forward<__nv_bfloat16, 128, Config>, &config_applies<Config>};
}

// Note [Forward variants]. Names: w<warps>r<rows per warp>_k<keys per block>_s<stages>, then
// _qreg (Q in registers), _skip (rescale skip), _shift (shift indexing), _2cta (registers budgeted for
// two CTAs per SM), _pad (padded tiles), _pipe (Note [Forward pipelining]), _seq (sequential row
// tiles), _lazy (Note [Lazy rescale]); shift indexing is on with _skip or _shift.
constexpr ForwardVariant kForwardVariants[] = {
    // Today's layout before tuning (eight warps of 16 rows, 64-key blocks, Q from shared memory).
    bf16_d128_variant<DefaultForwardConfig>("w8r16_k64_s3"),
    // Round 1 on the H200 (bench/attention_sweep.py, 2026-11-30 15:11 UTC, TFLOP/s at 32K / 128K
    // history; SDPA flash 302 / 309): today's layout 259 / 266; this one 275 / 283, the fastest.
    bf16_d128_variant<ForwardConfig<4, 1, 64, 2, true, true, 2, true, false, false>>("w4r16_k64_s2_qreg_skip_2cta"),
    bf16_d128_variant<ForwardConfig<4, 1, 64, 3, true, true, 2, true, false, false>>("w4r16_k64_s3_qreg_skip_2cta"),
    bf16_d128_variant<ForwardConfig<8, 1, 128, 3, true, true, 1, true, false, false>>("w8r16_k128_s3_qreg_skip"),
    bf16_d128_variant<ForwardConfig<8, 1, 128, 2, true, true, 1, true, false, false>>("w8r16_k128_s2_qreg_skip"),
    bf16_d128_variant<ForwardConfig<4, 2, 64, 2, false, true, 2, true, false, false>>("w4r32_k64_s2_skip_2cta"),
    bf16_d128_variant<ForwardConfig<8, 1, 64, 3, true, true, 1, true, false, false>>("w8r16_k64_s3_qreg_skip"),
    // Round 2: the same without the rescale skip (in round 1 the skip alone cost 11%: its vote and
    // branch split the softmax into basic blocks the scheduler cannot interleave), with and
    // without shift indexing (in round 2 shift indexing gained 3%).
    bf16_d128_variant<ForwardConfig<4, 1, 64, 2, true, false, 2, true, false, false>>("w4r16_k64_s2_qreg_shift_2cta"),
    bf16_d128_variant<ForwardConfig<4, 1, 64, 2, true, false, 2, false, false, false>>("w4r16_k64_s2_qreg_2cta"),
    bf16_d128_variant<ForwardConfig<4, 1, 64, 3, true, false, 2, true, false, false>>("w4r16_k64_s3_qreg_shift_2cta"),
    bf16_d128_variant<ForwardConfig<8, 1, 128, 3, true, false, 1, true, false, false>>("w8r16_k128_s3_qreg_shift"),
    bf16_d128_variant<ForwardConfig<8, 1, 128, 2, true, false, 1, true, false, false>>("w8r16_k128_s2_qreg_shift"),
    // Round 2 (2026-11-30 15:53 UTC; SDPA flash 311 / 313): this one 315 / 319, the fastest
    // (FlashAttention-2's own layout once the tile copies stopped costing registers); then
    // w8r16_k128_s3_qreg_shift(_lazy) 310 / 311-314 and w4r16_k128_s1_qreg_shift_2cta 306 / 304.
    bf16_d128_variant<ForwardConfig<4, 2, 64, 2, false, false, 2, true, false, false>>("w4r32_k64_s2_shift_2cta"),
    bf16_d128_variant<ForwardConfig<4, 2, 64, 2, false, false, 2, true, false, false, true>>("w4r32_k64_s2_shift_2cta_seq"),
    bf16_d128_variant<ForwardConfig<4, 2, 64, 2, false, true, 2, true, false, false, true>>("w4r32_k64_s2_skip_2cta_seq"),
    bf16_d128_variant<ForwardConfig<8, 1, 64, 3, true, false, 1, true, false, false>>("w8r16_k64_s3_qreg_shift"),
    // One K and one V buffer, so that 128-key blocks fit two CTAs per SM.
    bf16_d128_variant<ForwardConfig<4, 1, 128, 1, true, false, 2, true, false, false>>("w4r16_k128_s1_qreg_shift_2cta"),
    // Pipelined (Note [Forward pipelining]): S of block i + 1 overlaps the softmax of block i. In
    // round 2 no faster than the same layout without it (the two CTAs per SM already overlap them).
    bf16_d128_variant<ForwardConfig<4, 1, 64, 3, true, true, 2, true, false, true>>("w4r16_k64_s3_qreg_skip_2cta_pipe"),
    bf16_d128_variant<ForwardConfig<4, 1, 64, 3, true, false, 2, true, false, true>>("w4r16_k64_s3_qreg_shift_2cta_pipe"),
    bf16_d128_variant<ForwardConfig<8, 1, 64, 3, true, false, 1, true, false, true>>("w8r16_k64_s3_qreg_shift_pipe"),
    bf16_d128_variant<ForwardConfig<4, 1, 64, 3, false, false, 2, true, false, true>>("w4r16_k64_s3_shift_2cta_pipe"),
    // Lazy rescaling (Note [Lazy rescale]): +5% with 16-row warps in round 2, -6% with 32-row ones
    // (where it makes the kernel spill).
    bf16_d128_variant<ForwardConfig<4, 1, 64, 2, true, false, 2, true, false, false, false, true>>("w4r16_k64_s2_qreg_shift_2cta_lazy"),
    bf16_d128_variant<ForwardConfig<4, 1, 64, 3, true, false, 2, true, false, true, false, true>>("w4r16_k64_s3_qreg_shift_2cta_pipe_lazy"),
    bf16_d128_variant<ForwardConfig<4, 2, 64, 2, false, false, 2, true, false, false, false, true>>("w4r32_k64_s2_shift_2cta_lazy"),
    bf16_d128_variant<ForwardConfig<8, 1, 128, 3, true, false, 1, true, false, false, false, true>>("w8r16_k128_s3_qreg_shift_lazy"),
    bf16_d128_variant<ForwardConfig<4, 1, 128, 1, true, false, 2, true, false, false, false, true>>("w4r16_k128_s1_qreg_shift_2cta_lazy"),
    bf16_d128_variant<ForwardConfig<4, 1, 64, 2, false, false, 2, true, false, false, false, true>>("w4r16_k64_s2_shift_2cta_lazy"),
    bf16_d128_variant<ForwardConfig<8, 1, 64, 3, true, false, 1, true, false, false, false, true>>("w8r16_k64_s3_qreg_shift_lazy"),
    // Padded tiles (Note [Padded tiles]) were 3-6% slower than swizzled ones in round 1 with the skip.
    bf16_d128_variant<ForwardConfig<4, 1, 64, 2, true, false, 2, true, true, false>>("w4r16_k64_s2_qreg_shift_2cta_pad"),
    // Warpgroup MMAs (Note [Warpgroup forward] in attention_forward_wgmma.cu; sm_90a only,
    // elsewhere the mma.sync default below runs): round 3 (2026-11-30 19:05 UTC; SDPA flash
    // 311 / 311 / 335 at 32K / 128K / 256K) 430 / 439 / 434 with 128-key blocks, 347 / 354 / 354
    // with 64-key ones, against 316 / 325 / 323 for w4r32_k64_s2_shift_2cta.
    ForwardVariant{"wgmma_w8r64_k64_s3", &launch_forward_wgmma_k64_s3, &forward_wgmma_k64_applies},
    ForwardVariant{"wgmma_w8r64_k128_s2", &launch_forward_wgmma_k128_s2, &forward_wgmma_k128_applies},
};
constexpr int kForwardVariantCount = int(sizeof(kForwardVariants) / sizeof(kForwardVariants[0]));

// The fastest variant measured on the H200 (round 3 above: 1.30-1.41x SDPA flash), then where it
// does not apply the next fastest: 64-key warpgroup blocks (pages of 64), the best mma.sync layout
// (a GPU other than sm_90 or a build without sm_90a), and for what none of them takes (sparse
// tiles of 64 rows, fp16, head_dim 64) the layouts of dispatch_rows.
constexpr int kDefaultForwardVariant = find_variant(kForwardVariants, "wgmma_w8r64_k128_s2");
constexpr int kDefaultForwardFallbacks[] = {find_variant(kForwardVariants, "wgmma_w8r64_k64_s3"),
                                            find_variant(kForwardVariants, "w4r32_k64_s2_shift_2cta")};
static_assert(kDefaultForwardVariant >= 0, "the default names a listed variant");
static_assert(kDefaultForwardFallbacks[0] >= 0 && kDefaultForwardFallbacks[1] >= 0, "the fallbacks name listed variants");

// The variant MEMBAR_ATTENTION_FORWARD_VARIANT names (-1 when unset; -2 when it names none), or
// the four-warps-of-32-rows one under the older knob MEMBAR_ATTENTION_FORWARD_WARP_ROWS=32.
int requested_forward_variant() {
  const char* name = std::getenv("MEMBAR_ATTENTION_FORWARD_VARIANT");
  if (name == nullptr || name[0] == '\0') {
    const char* warp_rows = std::getenv("MEMBAR_ATTENTION_FORWARD_WARP_ROWS");
    if (warp_rows == nullptr || std::strcmp(warp_rows, "32") != 0) return -1;
    name = "w4r32_k64_s2_skip_2cta";
  }
  int index = find_variant(kForwardVariants, name);
  return index >= 0 ? index : -2;
}

template <typename Element, int kHeadDim>
cudaError_t dispatch_rows(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  // A CTA's queries must lie in one selection tile (Note [Forward kernel]): 128 rows (eight warps
  // of 16) unless the selection's tiles are an odd multiple of 64 rows.
  if (params.selection.selected_pages != nullptr && params.selection.query_tile_tokens % 128 != 0) {
    return launch_forward<Element, kHeadDim, ForwardConfig<4, 1, 64, 3, false, false, 1>>(params, stream);
  }
  return launch_forward<Element, kHeadDim, DefaultForwardConfig>(params, stream);
}

template <typename Element>
cudaError_t dispatch_head_dim(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  if (params.shape.head_dim == 64) return dispatch_rows<Element, 64>(params, stream);
  return dispatch_rows<Element, 128>(params, stream);
}

}  // namespace

int paged_attention_forward(const PagedAttentionForwardParams& params, void* stream) {
  if (paged_attention_check_shape(params.shape)[0] != '\0') return cudaErrorInvalidValue;
  if (paged_attention_cuda_check(params.shape, params.selection)[0] != '\0') return cudaErrorInvalidValue;
  const void* pointers[] = {params.q, params.k_chunk, params.v_chunk, params.history.k_pool, params.history.v_pool,
                            params.out};
  const char* names[] = {"q", "k_chunk", "v_chunk", "k_pool", "v_pool", "out"};
  if (paged_attention_check_alignment(pointers, names, 6)[0] != '\0') return cudaErrorInvalidValue;
  if (params.q == nullptr || params.out == nullptr || params.lse == nullptr) return cudaErrorInvalidValue;
  if (params.shape.attend_chunk && (params.k_chunk == nullptr || params.v_chunk == nullptr)) return cudaErrorInvalidValue;
  if (params.shape.history_tokens > 0 &&
      (params.history.k_pool == nullptr || params.history.v_pool == nullptr ||
       params.history.k_page_index == nullptr || params.history.v_page_index == nullptr)) {
    return cudaErrorInvalidValue;
  }
  cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  if (params.shape.dtype == DType::kBFloat16 && params.shape.head_dim == 128) {
    int variant = requested_forward_variant();
    if (variant == -2) return cudaErrorInvalidValue;
    if (variant >= 0) {
      if (kForwardVariants[variant].applies(params)) return kForwardVariants[variant].launch(params, cuda_stream);
    } else {
      if (kForwardVariants[kDefaultForwardVariant].applies(params)) {
        return kForwardVariants[kDefaultForwardVariant].launch(params, cuda_stream);
      }
      for (int fallback : kDefaultForwardFallbacks) {
        if (kForwardVariants[fallback].applies(params)) return kForwardVariants[fallback].launch(params, cuda_stream);
      }
    }
  }
  if (params.shape.dtype == DType::kBFloat16) return dispatch_head_dim<__nv_bfloat16>(params, cuda_stream);
  return dispatch_head_dim<__half>(params, cuda_stream);
}

int forward_variant_count() { return kForwardVariantCount; }
const char* forward_variant_name(int index) {
  return index >= 0 && index < kForwardVariantCount ? kForwardVariants[index].name : nullptr;
}
const char* forward_default_variant() { return kForwardVariants[kDefaultForwardVariant].name; }

}  // namespace membar::kernels::cuda
