// The warp-specialised dK/dV kernel of the paged-attention backward for Hopper (sm_90a): a producer
// warpgroup that loads, two consumer warpgroups that multiply. The layout "wgmma_ws_w12_k128"
// (BackwardLayout::kWgmmaWsW12K128), chosen on Hopper for head_dim 128 with pages of 128 keys since
// session 32 (Note [Layout choice] in membar/kernels/attention_cuda.h). Internal to kernels/cuda/.
//
// Note [Warp-specialised backward]
// Rationale: the warpgroup backward (Note [Warpgroup backward]) stays at 320-345 TFLOP/s on an
// H100 or H200 (7B shape, 32K-256K history). Nsight Compute (session 31, 256K) found its warps
// waiting 7.6 cycles per issued instruction: on barriers (1.34), fixed-latency dependencies
// (1.34), global loads (1.17: lse and delta, read inline) and shared loads (1.07: the mma.sync dQ
// pass's ldmatrix), with the tensor pipe busy 35% of the time. Every thread both loads (cp.async)
// and multiplies, and two CTA-wide barriers an item keep the two warpgroups in step. A wgmma dQ
// product alone did not move it (session 31). FlashAttention-3's backward (450-550 TFLOP/s on an
// H100 at head_dim 128) separates the loads from the MMAs as the warp-specialised forward does
// (Note [Warp-specialised forward]).
// Approach: one CTA of three warpgroups (384 threads) per (128-key page or chunk block, kv head),
// the same work list (own_keys: items of 64 queries of one q head) and epilogue as the warpgroup
// backward:
//   - warpgroup 0, the producer (setmaxnreg 40), loads K and V of the CTA's keys once, then each
//     item's Q and dO tiles (cp.async, the swizzled layout of Note [Warpgroup shared layout]) and
//     its 64 rows' lse (log2 units) and delta into one of kStages stages. A stage's "full"
//     mbarrier counts two arrivals a producer thread: one when its copies have landed
//     (cp.async.mbarrier.arrive.noinc), one after its statistics stores (mbarrier.arrive,
//     release). Before a stage is written again the producer waits for its "empty" mbarrier,
//     which each consumer warp arrives on once the item's MMAs are done.
//   - warpgroups 1 and 2, the consumers (232 registers), own keys 64 c .. 64 c + 63 and keep their
//     dK and dV in registers, as the warpgroup backward's two warpgroups do. Per item: S^T = K Q^T
//     and dP^T = V dO^T (wgmma from shared memory), P^T while dP^T runs, dS^T; dV += P^T dO and
//     dK += dS^T Q with P^T and dS^T as register A fragments (all as in Note [Warpgroup
//     backward]); dS^T of its 64 keys into a swizzled [128 keys][64 queries] tile (three of them,
//     by item modulo 3), then an arrival on the tile's "dS^T ready" mbarrier (256 threads). dQ of an
//     item needs both consumers' halves of its dS^T, so it is issued during the next item (session
//     37): dV of item i is issued; then, once the "dS^T ready" of item i - 1 has completed, dQ of item
//     i - 1 [64 queries, 64 columns] = dS K over all 128 keys (dS^T read MN-major as A, K's column
//     half c MN-major as B); then dK of item i. Once that dQ is done (wgmma wait 1), while dK still
//     runs, each thread arrives on the tile's "tile free" mbarrier, each warp writes its 16 rows of
//     dQ into its own fp32 staging rows in shared memory and lanes 0-15 add them into the workspace
//     by one bulk reduction a row (cp.reduce.async.bulk .add.f32, 256 bytes); the stage is released
//     once dK is done. The last item's dQ follows the loop's last dK. Deterministic mode skips dQ
//     here (launch_backward_dq runs as for every layout).
//   Before a consumer writes the tile of item i it waits for that tile's "tile free" of item i - 3
//   (both consumers' dQ MMAs of item i - 3 have read it). Nothing makes the two consumers meet every
//   item: one may run up to an item ahead of the other (the producer's stages bound it too), so that
//   one's softmax can overlap the other's MMAs; until session 37 a named barrier of the 256
//   consumer threads before each item's dQ (issued in the same item) kept them in step.
//   A warp's staging rows are its own: before it writes them again its lanes wait until their
//   reductions of the item before have read them (cp.async.bulk.wait_group.read).
// Shared memory (base aligned to 1024; about 213 KiB): K, V [2][128][64] (32 KiB each); Q, dO
// [stages][2][64][64] (16 KiB each a stage); dS^T [3][128][64] (16 KiB each); dQ staging [2][64][72]
// fp32 (rows 288 bytes apart: a warp's float2 stores hit 32 banks); lse, delta [stages][64] fp32;
// barriers.
// Measured (session 32, an H100, bench/results/2026-12-07-session32-h100; Qwen2.5-7B heads, chunk
// 4096, pages of 128 shuffled, bf16): 366.5 / 377.1 / 373.3 TFLOP/s at 32K / 128K / 256K history
// against the warpgroup backward's 322.8 / 343.0 / 340.5 in the same calls (1.14x / 1.10x / 1.10x)
// and SDPA flash's 324.8 / 330.2 / 326.9 (1.13x / 1.14x / 1.14x); the sparse top-64 backward at
// 256K 5.34 ms against 5.99 (1.12x). Correct first: the gpu attention tests (every compiled layout
// against the CPU reference, soft-caps and windows too) and test_attention_cuda.py with it asked
// for (both modes, deterministic too). 24 bytes of spills, in the producer (its loop at 40
// registers); the consumers have none. A second dQ form, each consumer's dQ [64 queries, 128
// columns] over its own 64 keys with no barrier between the consumers and twice the atomics, ran
// 0.87x of the warpgroup backward and was dropped. Nsight Compute at 256K (one launch, 100.7 ms):
// issue slots busy 30%, 10.0 cycles per issued instruction, the top reason global-memory
// dependencies (3.80, counted over the producer's warps too), then mbarrier waits (1.58) and
// barriers (0.91).
// Kernel by kernel under torch.profiler (session 35, an H100, bench/probes/backward_kernels_probe.py):
// without dQ (deterministic mode) this kernel takes 7.26 / 27.93 / 53.45 ms at 32K / 128K / 256K
// history, ~560-580 TFLOP/s for its four products; with dQ 14.12 / 51.71 / 102.01. The dQ step (the
// named barrier, the dS^T tile, the dQ product with both operands from shared memory at N = 64, the
// atomics) costs as much as the other four products: that, not the serial chain of S^T, dP^T, dV and
// dK, is where the 450 TFLOP/s goal is lost.
// dQ by bulk reductions (session 36, an H200, bench/results/2026-12-07-session36-h200): until then
// each consumer thread added its dQ by 16 float2 atomics an item, after waiting for dQ with dK and dV
// done. The bulk reductions in the order above run the default backward at 364.9 / 377.8 / 381.4
// TFLOP/s at 32K / 128K / 256K against the atomics' 355.7 / 365.6 / 360.8 in the same call
// (1.03x / 1.03x / 1.06x; the kernel alone 1.04x / 1.08x / 1.05x); the bulk reductions in the old
// order gave most of it (364.7 / 371.9 / 381.0). Starting each CTA's item list at a different item
// (fewer CTAs adding into the same rows at once) changed nothing measurable and was dropped.
// dQ issued during the next item (session 37, an H100, bench/results/2026-12-07-session37-h100): the
// consumers no longer meet at a named barrier every item. The default backward ran 12.55 / 48.42 /
// 95.48 ms at 32K / 128K / 256K against 13.51 / 49.85 / 100.15 for the named barrier in the same call
// (1.08x / 1.03x / 1.05x; 407 / 404 / 406 TFLOP/s as bench/probes counts them), dQ, dK and dV as
// close to the deterministic backward's as before. Still short of 450.
// Limitations: head_dim 128 only (64 and 96 need a dQ split of their columns); an item's MMAs are
// waited for in full before the next item's S^T (no forced ping-pong of the consumers); the
// soft-capped instantiations spill 44 bytes (48 before), the others 28 (24 before, in the producer).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_backward_common.cuh"
#include "attention_backward_wgmma.cuh"
#include "attention_common.cuh"
#include "attention_cuda_internal.h"
#include "attention_wgmma.cuh"

namespace membar::kernels::cuda::detail::warpgroup {

inline constexpr int kWsBackwardThreads = 384;           // producer + two consumer warpgroups
inline constexpr int kWsBackwardProducerRegisters = 40;
inline constexpr int kWsBackwardConsumerRegisters = 232;
static_assert(128 * kWsBackwardProducerRegisters + 256 * kWsBackwardConsumerRegisters <= 384 * 168,
              "the warpgroups' registers fit what the launch allocates (168 a thread)");
inline constexpr int kWsBackwardDqColumns = 64;          // dQ columns per consumer (the wgmma N)
// The fp32 dQ staging rows of the bulk dQ write: 64 columns and 8 of padding (288 bytes apart, so
// that a warp's float2 stores of its accumulator rows hit 32 distinct banks).
inline constexpr int kWsBackwardDqStagingStride = kWsBackwardDqColumns + 8;

// The dS^T tiles: an item's is read by the dQ MMAs issued during the next item, so the tile of item i
// is written again at item i + 3 (Note [Warp-specialised backward]).
inline constexpr int kWsBackwardScoreTiles = 3;

template <int kHeadDim, int kStages>
constexpr size_t ws_backward_shared_bytes() {
  // Alignment slack; K, V; Q, dO per stage; three dS^T tiles; the dQ staging rows; lse and delta per
  // stage; barriers (K/V full, full and empty per stage, dS^T ready and tile free per tile).
  return 1024 + 2 * size_t(kBackwardKeyTileBytes<kHeadDim>) + 2 * size_t(kStages) * kBackwardQueryTileBytes<kHeadDim> +
         kWsBackwardScoreTiles * size_t(kBackwardKeys) * kQueries * 2 +
         2 * size_t(kQueries) * kWsBackwardDqStagingStride * 4 + 2 * size_t(kStages) * kQueries * 4 +
         8 * (1 + 2 * kStages + 2 * kWsBackwardScoreTiles);
}

template <typename Element, int kHeadDim, bool kSoftcap, int kStages = 2>
__global__ void __launch_bounds__(kWsBackwardThreads, 1)
    paged_attention_backward_wgmma_ws_kernel(const PagedAttentionBackwardParams params,
                                             const BackwardWorkspacePointers workspace, const SoftCap soft_cap) {
  static_assert(kHeadDim == 128, "the warp-specialised backward is written for head_dim 128");
  static_assert(kStages >= 2 && kStages <= 3, "two or three query stages");
  static_assert(ws_backward_shared_bytes<kHeadDim, kStages>() <= 227 * 1024, "an H100/H200 CTA has 227 KiB");
#if MEMBAR_WGMMA_AVAILABLE
  constexpr int kKeys = kBackwardKeys;
  constexpr int kKeyTileBytes = kBackwardKeyTileBytes<kHeadDim>;
  constexpr int kQueryTileBytes = kBackwardQueryTileBytes<kHeadDim>;
  constexpr int kScoreTileBytes = kKeys * kQueries * 2;
  extern __shared__ unsigned char shared_raw[];
  const uint32_t raw_address = shared_address(shared_raw);
  unsigned char* shared_base = shared_raw + (((raw_address + 1023u) & ~1023u) - raw_address);
  unsigned char* k_tile = shared_base;                                  // [2][128][64]
  unsigned char* v_tile = k_tile + kKeyTileBytes;                       // [2][128][64]
  unsigned char* q_tiles = v_tile + kKeyTileBytes;                      // [stages][2][64][64]
  unsigned char* dout_tiles = q_tiles + kStages * kQueryTileBytes;      // [stages][2][64][64]
  constexpr int kScoreTiles = kWsBackwardScoreTiles;
  unsigned char* score_tiles = dout_tiles + kStages * kQueryTileBytes;  // [3][128][64], dS^T
  float* dq_staging = reinterpret_cast<float*>(score_tiles + kScoreTiles * kScoreTileBytes);  // [2][64][72] fp32
  float* lse_tiles = dq_staging + 2 * kQueries * kWsBackwardDqStagingStride;         // [stages][64], log2 units
  float* delta_tiles = lse_tiles + kStages * kQueries;                             // [stages][64]
  uint64_t* barriers = reinterpret_cast<uint64_t*>(delta_tiles + kStages * kQueries);
  const uint32_t kv_full = shared_address(barriers);
  const auto full = [&](int s) { return kv_full + 8u * (1 + 2 * s); };
  const auto empty = [&](int s) { return kv_full + 8u * (2 + 2 * s); };
  const auto ds_ready = [&](int t) { return kv_full + 8u * (1 + 2 * kStages + 2 * t); };
  const auto tile_free = [&](int t) { return kv_full + 8u * (2 + 2 * kStages + 2 * t); };
  constexpr int kConsumerWarps = 8;

  const PagedAttentionShape& shape = params.shape;
  const int thread = threadIdx.x;
  const int lane = thread % 32;
  const int kv_head = blockIdx.y;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int chunk_tokens = shape.chunk_tokens;
  const int64_t q_row_stride = int64_t(shape.num_q_heads) * kHeadDim;
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;

  const OwnedKeys<Element> owned = own_keys<Element, kHeadDim, kKeys>(params, workspace);
  const WorkList work = owned.work;
  // A page no query tile selected (or, with a sliding window, no query sees) receives nothing.
  if (work.count == 0) return;
  __shared__ int shared_window_edge;
  if (thread == 0) {
    shared_window_edge = owned_window_edge(shape, owned);
    mbarrier_init(kv_full, 128);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full(s), 2 * 128);
      mbarrier_init(empty(s), kConsumerWarps);
    }
    for (int t = 0; t < kScoreTiles; ++t) {
      mbarrier_init(ds_ready(t), 256);
      mbarrier_init(tile_free(t), 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (thread < 128) {
    // The producer.
    registers_decrease<kWsBackwardProducerRegisters>();
    load_swizzled_rows<kKeys, kHeadDim, 128>(k_tile, owned.k_base, kv_row_stride, owned.valid_keys, thread);
    load_swizzled_rows<kKeys, kHeadDim, 128>(v_tile, owned.v_base, kv_row_stride, owned.valid_keys, thread);
    copies_arrive(kv_full);
    const Element* q = static_cast<const Element*>(params.q);
    const Element* dout = static_cast<const Element*>(params.dout);
    const float* lse = static_cast<const float*>(params.lse);
    for (int item = 0; item < work.count; ++item) {
      const int stage = item % kStages;
      // A fresh barrier's "previous phase" counts as done: the first wait on each stage passes.
      mbarrier_wait(empty(stage), ((item / kStages) & 1) ^ 1);
      const WorkItem queries = work_item<kHeadDim>(work, item, kv_head, group, q_row_stride);
      const int valid = chunk_tokens - queries.first_query;
      load_swizzled_rows<kQueries, kHeadDim, 128>(q_tiles + stage * kQueryTileBytes, q + queries.offset, q_row_stride,
                                                  valid, thread);
      load_swizzled_rows<kQueries, kHeadDim, 128>(dout_tiles + stage * kQueryTileBytes, dout + queries.offset,
                                                  q_row_stride, valid, thread);
      copies_arrive(full(stage));
      if (thread < kQueries) {
        query_row_statistics(lse, workspace.delta, chunk_tokens, queries.q_head, queries.first_query + thread,
                             lse_tiles[stage * kQueries + thread], delta_tiles[stage * kQueries + thread]);
      }
      mbarrier_arrive(full(stage));
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  // A consumer.
  registers_increase<kWsBackwardConsumerRegisters>();
  const int consumer = thread / 128 - 1;
  const int warp = (thread - 128) / 32;  // 0 .. 7: consumer c has warps 4 c .. 4 c + 3
  const float scale_log2 = shape.softmax_scale * kLog2e;
  // Key rows of this thread (the accumulator layout of Note [Warpgroup backward]): key_row and
  // key_row + 8, with key_row = 64 consumer + 16 (warp in group) + lane / 4.
  const int key_row = warp * 16 + lane / 4;
  float dk[kHeadDim / 8][4];
  float dv[kHeadDim / 8][4];
  clear(dk);
  clear(dv);
  const uint32_t k_address = shared_address(k_tile) + consumer * kBackwardWarpgroupKeys * kRowBytes;
  const uint32_t v_address = shared_address(v_tile) + consumer * kBackwardWarpgroupKeys * kRowBytes;
  const bool with_dq = workspace.dq_accumulator != nullptr;
  const auto release = [&](uint32_t barrier) {
    __syncwarp();
    if (lane == 0) mbarrier_arrive(barrier);
  };

  mbarrier_wait(kv_full, 0);
  fence_proxy_async_shared();

  for (int item = 0; item < work.count; ++item) {
    const int stage = item % kStages;
    mbarrier_wait(full(stage), (item / kStages) & 1);
    fence_proxy_async_shared();

    int head_in_group, query_block;
    work.decode(item, head_in_group, query_block);
    const int first_query = query_block * kQueries;
    const uint32_t q_stage = shared_address(q_tiles + stage * kQueryTileBytes);
    const uint32_t dout_stage = shared_address(dout_tiles + stage * kQueryTileBytes);
    const float* row_lse = lse_tiles + stage * kQueries;
    const float* row_delta = delta_tiles + stage * kQueries;

    // S^T = K Q^T and dP^T = V dO^T, [64 keys, 64 queries] per consumer; two commit groups.
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
#pragma unroll
      for (int n = 0; n < kQueries / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int query = n * 8 + 2 * (lane % 4) + (j & 1);
          dscores[n][j] = scores[n][j] * (dscores[n][j] - row_delta[query]);
        }
      }
    }

    // dV += P^T dO and dK += dS^T Q (Note [Warpgroup backward]).
    uint32_t p_fragments[kQueries / 16][4];
    uint32_t ds_fragments[kQueries / 16][4];
    accumulator_to_a_fragments<Element, kQueries>(p_fragments, scores);
    accumulator_to_a_fragments<Element, kQueries>(ds_fragments, dscores);
    // dS^T of this consumer's 64 keys into the item's tile, [128 keys][64 queries] in the 128-byte
    // swizzle, pairs of queries at once (the packed A fragments, read before the MMAs that take
    // them are issued), published to the tensor cores before the tile's "dS^T ready" arrival.
    Element* score_tile = reinterpret_cast<Element*>(score_tiles + (item % kScoreTiles) * kScoreTileBytes);
    if (with_dq) {
      // Both consumers' dQ MMAs of item - 3 have read the tile (a fresh barrier's "previous phase"
      // counts as done: the first wait on each tile passes).
      mbarrier_wait(tile_free(item % kScoreTiles), ((item / kScoreTiles) & 1) ^ 1);
#pragma unroll
      for (int n = 0; n < kQueries / 8; ++n) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int offset = warpgroup_tile_offset<kKeys>(key_row + half * 8, n * 8) + 2 * (lane % 4);
          *reinterpret_cast<uint32_t*>(score_tile + offset) = ds_fragments[n / 2][(n % 2) * 2 + half];
        }
      }
      fence_proxy_async_shared();
      mbarrier_arrive(ds_ready(item % kScoreTiles));
    }
    // dQ [64 queries, 64 columns] = dS K over the 128 keys, the columns of K's half `consumer` (k step
    // kk: 16 keys, 16 rows of both tiles, 128 in the descriptors' 16-byte address units).
    const auto issue_dq = [&](float (&dq)[kWsBackwardDqColumns / 8][4], const Element* tile) {
      const uint64_t a_first = matrix_descriptor(shared_address(tile), kKeys * kRowBytes, 1024);
      const uint64_t b_first =
          matrix_descriptor(shared_address(k_tile) + consumer * kKeys * kRowBytes, kKeys * kRowBytes, 1024);
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        const uint64_t step = uint64_t(kk) * (16 * kRowBytes / 16);
        wgmma_shared_transposed<Element, kWsBackwardDqColumns, true, true>(dq, a_first + step, b_first + step,
                                                                          kk > 0 ? 1 : 0);
      }
      wgmma_commit();
    };
    // Adds a finished dQ (of the item before, or of the last item) into the workspace.
    const auto add_dq = [&](const float (&dq)[kWsBackwardDqColumns / 8][4], int dq_head_in_group,
                            int dq_first_query) {
      const int q_head = kv_head * group + dq_head_in_group;
      const int dq_row = (warp % 4) * 16 + lane / 4;  // the accumulator rows of this thread
      // The warp's 16 rows of dQ go through its own staging rows, one bulk reduction of 256 bytes
      // a row issued by lanes 0-15; the reductions of the warp's previous item have read them by
      // now (bulk_wait_read), which the whole warp passes before it writes.
      float* rows = dq_staging + consumer * kQueries * kWsBackwardDqStagingStride;
      if (lane < 16) bulk_wait_read<0>();
      __syncwarp();
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int n = 0; n < kWsBackwardDqColumns / 8; ++n) {
          *reinterpret_cast<float2*>(rows + (dq_row + half * 8) * kWsBackwardDqStagingStride + n * 8 +
                                     2 * (lane % 4)) = make_float2(dq[n][2 * half], dq[n][2 * half + 1]);
        }
      }
      fence_proxy_async_shared();
      __syncwarp();
      if (lane < 16) {
        const int row = (warp % 4) * 16 + lane;
        const int position = dq_first_query + row;
        if (position < chunk_tokens) {
          bulk_reduce_add_f32(workspace.dq_accumulator + int64_t(position) * q_row_stride +
                                  int64_t(q_head) * kHeadDim + consumer * kWsBackwardDqColumns,
                              shared_address(rows + row * kWsBackwardDqStagingStride), kWsBackwardDqColumns * 4);
        }
        bulk_commit();
      }
      __syncwarp();
    };

    // dK += dS^T Q (Note [Warpgroup backward]).
    const auto issue_dk = [&] {
#pragma unroll
      for (int kk = 0; kk < kQueries / 16; ++kk) {
        const uint64_t b = matrix_descriptor(q_stage + kk * 16 * kRowBytes, kQueries * kRowBytes, 1024);
        wgmma_registers_transposed_b<Element, kHeadDim>(dk, ds_fragments[kk], b);
      }
    };

    fence_registers(dv);
    fence_registers(dk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kQueries / 16; ++kk) {
      const uint64_t b = matrix_descriptor(dout_stage + kk * 16 * kRowBytes, kQueries * kRowBytes, 1024);
      wgmma_registers_transposed_b<Element, kHeadDim>(dv, p_fragments[kk], b);
    }
    if (with_dq) {
      // dV of this item; dQ of the item before once both consumers' halves of its dS^T are in; dK;
      // that dQ added while dK runs.
      wgmma_commit();
      if (item > 0) {
        const int previous = item - 1;
        mbarrier_wait(ds_ready(previous % kScoreTiles), (previous / kScoreTiles) & 1);
        float dq[kWsBackwardDqColumns / 8][4];
        wgmma_fence();
        issue_dq(dq, reinterpret_cast<const Element*>(score_tiles + (previous % kScoreTiles) * kScoreTileBytes));
        issue_dk();
        wgmma_commit();
        wgmma_wait<1>();
        fence_registers(dq);
        mbarrier_arrive(tile_free(previous % kScoreTiles));
        int previous_head, previous_block;
        work.decode(previous, previous_head, previous_block);
        add_dq(dq, previous_head, previous_block * kQueries);
      } else {
        issue_dk();
        wgmma_commit();
      }
    } else {
      issue_dk();
      wgmma_commit();
    }
    wgmma_wait<0>();
    fence_registers(dv);
    fence_registers(dk);
    fence_registers(p_fragments);
    fence_registers(ds_fragments);
    // Q, dO and the statistics of the stage are read.
    release(empty(stage));
    if (with_dq && item == work.count - 1) {
      // The last item's dQ, after the loop's last dK.
      mbarrier_wait(ds_ready(item % kScoreTiles), (item / kScoreTiles) & 1);
      float dq[kWsBackwardDqColumns / 8][4];
      wgmma_fence();
      issue_dq(dq, score_tile);
      wgmma_wait<0>();
      fence_registers(dq);
      add_dq(dq, head_in_group, first_query);
    }
  }
  // The staging rows stay until the last reductions have read them.
  if (lane < 16) bulk_wait<0>();

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
  // Built for a GPU without wgmma: the layout choice never picks this layout there.
  __trap();
#endif  // MEMBAR_WGMMA_AVAILABLE
}

// The dK/dV launch of the warp-specialised backward (a detail::KvLaunch) for one dtype, capped or not.
template <typename Element, int kHeadDim, bool kSoftcap, int kStages = 2>
cudaError_t launch_backward_kv_ws(const PagedAttentionBackwardParams& params, const BackwardWorkspacePointers& workspace,
                                  cudaStream_t stream) {
  constexpr size_t kSharedBytes = ws_backward_shared_bytes<kHeadDim, kStages>();
  auto kernel = paged_attention_backward_wgmma_ws_kernel<Element, kHeadDim, kSoftcap, kStages>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSharedBytes));
  if (error != cudaSuccess) return error;
  BackwardWorkspacePointers owners = workspace;
  owners.num_chunk_blocks = chunk_owner_count<kBackwardKeys>(params.shape);
  const dim3 grid(owner_count<kBackwardKeys>(params.shape, owners.num_chunk_blocks), params.shape.num_kv_heads);
  if (grid.x == 0) return cudaSuccess;  // no key at all (attend_chunk false, empty history)
  kernel<<<grid, kWsBackwardThreads, kSharedBytes, stream>>>(
      params, owners, soft_cap_of(params.shape.softmax_scale, params.shape.logit_softcap));
  return cudaGetLastError();
}

}  // namespace membar::kernels::cuda::detail::warpgroup
