// The warp-specialised paged-attention forward for Hopper (sm_90a): a producer warpgroup that
// loads, two consumer warpgroups that multiply, scheduled in turn. Internal to kernels/.
//
// Note [Warp-specialised forward]
// Rationale: the warpgroup forward (Note [Warpgroup forward]) runs ~420 TFLOP/s on an H200 at the
// 7B shape; FlashAttention-3 and cuDNN reach 600-670 on the same tensor cores. What the shipped
// kernel lacks is what FlashAttention-3 adds: (1) every thread both loads (cp.async) and
// multiplies, and one CTA-wide barrier per key block puts both warpgroups in lockstep, so their
// softmaxes run at the same time and the tensor cores idle meanwhile; (2) a warpgroup waits for
// its S before its softmax and for its P V before the next S, so its own MMAs never overlap its
// own softmax (session 27's overlap experiment still loaded with every thread and lost).
// Approach: one CTA of three warpgroups (384 threads) per (128 query rows, q head), as the
// warpgroup forward walks the same key sequence (KeySequence) in 128-key blocks:
//   - warpgroup 0, the producer, keeps 40 registers a thread (setmaxnreg) and copies Q, then
//     each block's K and V tiles with cp.async into the stages of the swizzled layout of Note
//     [Warpgroup shared layout]; cp.async.mbarrier.arrive.noinc tells a stage's "full" mbarrier
//     once its copies have landed, so no thread waits for its own copies. Before a stage is
//     written again the producer waits for its "empty" mbarrier, which each consumer warp arrives
//     on once its MMAs no longer read it. K and V have their own stages and barriers: a K stage
//     is free after S, a V stage only after P V.
//   - warpgroups 1 and 2, the consumers, keep 232 registers a thread and own 64 query rows each
//     (O and the online-softmax state in registers, the accumulator layout of Note [Warpgroup
//     forward]). Per block i a consumer issues S_i = Q K_i^T and O += P_{i-1} V_{i-1}, waits for
//     S_i only, runs the masks and online softmax of block i while P V still runs, then waits
//     for P V, rescales O by block i's correction and converts P_i to A fragments
//     (FlashAttention-3's intra-warpgroup overlap). The last block's P V follows the loop.
//   - the two consumers take turns issuing their MMAs (FlashAttention-3's ping-pong): consumer c
//     waits on named barrier 1 + c before it issues and arrives on the other's after, so one
//     warpgroup's softmax runs while the other's MMAs keep the tensor cores busy. Both consumers
//     pass the barriers once per block of the CTA, also for the chunk blocks above their rows'
//     diagonal, which they skip (every later block is such a block); consumer 1 arrives once on
//     consumer 0's barrier at the start (as FlashAttention-3 does: no warp arrives on a barrier it
//     then waits on) and consumer 0 syncs once more at the end, so every arrival is matched.
// The copies of a stage are made visible to wgmma (the async proxy) by fence.proxy.async, run by
// each consumer thread after its wait on the stage's full barrier (the producer's copies complete
// asynchronously, so it cannot fence after them). A variant without these fences ran within noise
// of it (0.97-1.03x, session 29) and was dropped.
// Stages: a K stage is free only once both consumers' S of its block is done, so with two K stages
// the producer has about one and a half block-times (~2 us) to read the page table and land
// K_{i+2} before consumer 0 wants it; a V stage is free only after P V, a block later. Throughput
// falls from 32K to 256K history (-10% in session 30 on an H100, cuDNN's dense forward -4%), but a
// late K does not explain it: a third K stage (session 30, 197 KiB of shared memory) ran 1.00x /
// 0.97x / 0.95x of two at 32K / 128K / 256K in the same call, and was dropped. The clock does:
// one launch at a time under Nsight Compute (session 31, the H200) the forward ran 589 TFLOP/s at
// 32K and 601 at 256K, while launched back to back the GPU runs at its power limit.
// Support: what the warpgroup forward supports at head_dim 64, 96 and 128 with pages of 128
// (bf16 and fp16, sparse tiles of 128k rows, soft-caps, windows); head_dim 256 does not fit
// (two consumers' output alone is 128 registers a thread). Compiled and chosen at head_dim 64, 96
// and 128. At 128 it ran first in session 29 (an H100: correct in every gpu attention test; 593 / 553
// / 522 TFLOP/s at 32K / 128K / 256K history against 421 / 431 / 420 for the warpgroup forward
// and 617 / 598 / 584 for cuDNN's dense forward in the same call); session 30 (an H100 again) ran
// 594 / 581 / 535 against 410 / 429 / 429 and cuDNN's 621 / 633 / 596, and at head_dim 96 (32K
// history, bf16) 431 against the warpgroup forward's 350 (1.23x) and SDPA flash's 326, correct
// against the float32 reference in bf16 and fp16 first; on the H200 (session 31) 579 / 544 / 513 at
// 128 against the warpgroup forward's 396 / 416 / 424, and at head_dim 64 (32K) 396 against the
// two-CTA warpgroup forward's 298 (1.33x), correct against the reference first.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_common.cuh"
#include "attention_cuda_internal.h"
#include "attention_forward_wgmma.cuh"
#include "attention_wgmma.cuh"

namespace membar::kernels::cuda::detail::warpgroup_ws {

using warpgroup::kRows;
using warpgroup::kStoredDim;
using warpgroup::kWarpgroupRows;

inline constexpr int kConsumers = 2;
inline constexpr int kThreads = 128 * (kConsumers + 1);
inline constexpr int kProducerRegisters = 40;
inline constexpr int kConsumerRegisters = 232;
static_assert(128 * kProducerRegisters + 128 * kConsumers * kConsumerRegisters <= 65536,
              "the three warpgroups' registers fit the SM's 64K");

// A layout of the warp-specialised forward (wgmma_ws_w12r64_k<keys>_s<stages>, or
// wgmma_ws_w12r64_k<keys>_k<K stages>v<V stages> when they differ).
struct WarpSpecialisedForwardTile {
  int keys_per_block = 128;
  int k_stages = 2;
  int v_stages = 2;
};

template <int kHeadDim, typename Tiling>
constexpr size_t ws_shared_bytes_fixed() {
  constexpr WarpSpecialisedForwardTile kTile = Tiling::kTile;
  // Alignment slack, Q, K and V stages, the barriers (one Q, two per stage) and the selection count.
  return 1024 + size_t(kRows) * kStoredDim<kHeadDim> * 2 +
         size_t(kTile.k_stages + kTile.v_stages) * kTile.keys_per_block * kStoredDim<kHeadDim> * 2 +
         8 * (1 + 2 * (kTile.k_stages + kTile.v_stages)) + 16;
}


template <typename Element, int kHeadDim, typename Tiling, bool kSoftcap = false>
__global__ void __launch_bounds__(kThreads, 1) paged_attention_forward_ws_kernel(const PagedAttentionForwardParams params) {
  constexpr WarpSpecialisedForwardTile kTile = Tiling::kTile;
  constexpr int kKeys = kTile.keys_per_block;
  constexpr int kKStages = kTile.k_stages;
  constexpr int kVStages = kTile.v_stages;
  constexpr int kDims = kStoredDim<kHeadDim>;
  static_assert(kKeys == 128, "128-key blocks (m64n128 scores)");
  static_assert(kKStages >= 2 && kKStages <= 3 && kVStages >= 2 && kVStages <= 3, "two or three stages");
  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128, "head sizes whose output fits a consumer");
  static_assert(ws_shared_bytes_fixed<kHeadDim, Tiling>() + 4 * size_t(kMaxSelectedPerTile) <= 227 * 1024,
                "an H100/H200 CTA has 227 KiB: the tiles and the largest sparse selection must fit");
#if MEMBAR_WGMMA_AVAILABLE
  constexpr int kTileBytes = kKeys * kDims * 2;
  extern __shared__ unsigned char shared_raw[];
  const uint32_t raw_address = shared_address(shared_raw);
  unsigned char* shared_base = shared_raw + (((raw_address + 1023u) & ~1023u) - raw_address);
  unsigned char* q_tile = shared_base;                      // [kDims / 64][kRows][64]
  unsigned char* k_tiles = q_tile + kRows * kDims * 2;       // [kKStages][kDims / 64][kKeys][64]
  unsigned char* v_tiles = k_tiles + kKStages * kTileBytes;  // [kVStages][kDims / 64][kKeys][64]
  uint64_t* barriers = reinterpret_cast<uint64_t*>(v_tiles + kVStages * kTileBytes);
  using Stages = KeyBlockStages<kKStages, kVStages>;
  int* selected_count = reinterpret_cast<int*>(barriers + Stages::kBarriers);
  int32_t* selected = selected_count + 4;  // [selected_per_tile]
  const Stages stages{shared_address(barriers)};
  constexpr int kConsumerWarps = 4 * kConsumers;

  const PagedAttentionShape& shape = params.shape;
  const int thread = threadIdx.x;
  const int warpgroup = thread / 128;
  const int lane = thread % 32;
  const int tile = gridDim.x - 1 - blockIdx.x;  // later tiles see more chunk keys: start them first
  const int q_head = blockIdx.y;
  const int kv_head = q_head / (shape.num_q_heads / shape.num_kv_heads);
  const int first_query = tile * kRows;
  const int chunk_tokens = shape.chunk_tokens;
  const int64_t q_row_stride = int64_t(shape.num_q_heads) * kHeadDim;
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;

  if (thread == 0) stages.init(kConsumerWarps);
  __syncthreads();
  // Every thread: in sparse mode this compacts the tile's selection and ends with __syncthreads().
  const auto keys =
      key_sequence_for_tile<Element, kKeys, true, kHeadDim>(params, kv_head, first_query, selected, selected_count);
  const int last_query = min(first_query + kRows, chunk_tokens) - 1;
  const int first_block = window_first_block<kKeys>(shape, keys.num_history_blocks, first_query);
  const int num_blocks = keys.num_history_blocks + (shape.attend_chunk ? last_query / kKeys + 1 : 0) - first_block;

  if (warpgroup == 0) {
    // The producer.
    registers_decrease<kProducerRegisters>();
    const int copier = thread;  // 0 .. 127
    const Element* q = static_cast<const Element*>(params.q);
    load_swizzled_rows<kRows, kHeadDim, 128>(q_tile, q + int64_t(first_query) * q_row_stride + int64_t(q_head) * kHeadDim,
                                             q_row_stride, chunk_tokens - first_query, copier);
    copies_arrive(stages.query_full());
    produce_key_blocks<kKeys, kHeadDim>(keys, first_block, num_blocks, k_tiles, v_tiles, stages, kv_row_stride, copier);
    return;
  }

  // A consumer.
  registers_increase<kConsumerRegisters>();
  const int consumer = warpgroup - 1;
  const int warp_in_group = (thread % 128) / 32;
  const int group_row = consumer * kWarpgroupRows;
  const int warp_row = group_row + warp_in_group * 16;
  const int row_position = first_query + warp_row + lane / 4;
  const float scale_log2 = shape.softmax_scale * kLog2e;
  SoftCap soft_cap;
  if constexpr (kSoftcap) soft_cap = soft_cap_of(shape.softmax_scale, shape.logit_softcap);
  float output[kDims / 8][4];
  clear(output);
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  const uint32_t q_address = shared_address(q_tile) + group_row * kRowBytes;
  const uint32_t k_address = shared_address(k_tiles);
  const uint32_t v_address = shared_address(v_tiles);
  // Ping-pong (Note [Warp-specialised forward]): barrier 1 + c is consumer c's turn to issue.
  const auto turn_wait = [&]() { named_barrier_sync(1 + consumer, 2 * 128); };
  const auto turn_pass = [&]() { named_barrier_arrive(2 - consumer, 2 * 128); };
  const auto release = [&](uint32_t barrier) {
    __syncwarp();
    if (lane == 0) mbarrier_arrive(barrier);
  };

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
      }
    }
    wgmma_commit();
  };
  // The masks and the online softmax of a block's finished scores (exponentiated in place); the
  // running sums are updated and `correction` says by how much the output must be rescaled (it
  // may still be accumulating the block before).
  auto softmax_block = [&](float (&scores)[kKeys / 8][4], const KeyBlock<Element>& block, int index,
                           float (&correction)[2]) {
    if constexpr (kSoftcap) soft_cap_scores(scores, soft_cap);
    const bool chunk_block = block.first_position >= 0;
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
      correction[half] = exp2f(row_max[half] * scale_log2 - max_scaled);
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
      row_sum[half] = row_sum[half] * correction[half] + sum;
    }
  };
  auto rescale_output = [&](const float (&correction)[2]) {
#pragma unroll
    for (int n = 0; n < kDims / 8; ++n) {
      output[n][0] *= correction[0];
      output[n][1] *= correction[0];
      output[n][2] *= correction[1];
      output[n][3] *= correction[1];
    }
  };
  const auto computes = [&](const KeyBlock<Element>& block) {
    return !(block.first_position >= 0 && block.first_position > first_query + group_row + kWarpgroupRows - 1);
  };
  // Blocks this consumer computes: all but the trailing chunk blocks above its rows' diagonal.
  int own_blocks = num_blocks;
  while (own_blocks > 0 && !computes(keys.block(first_block + own_blocks - 1))) --own_blocks;

  mbarrier_wait(stages.query_full(), 0);
  fence_proxy_async_shared();
  if (consumer == 1) named_barrier_arrive(1, 2 * 128);  // consumer 0 takes the first turn

  if (own_blocks > 0) {
    float scores[kKeys / 8][4];
    uint32_t p[kKeys / 16][4];
    float correction[2];
    {
      stages.wait_k_full(0);
      turn_wait();
      issue_scores(scores, 0);
      turn_pass();
      wgmma_wait<0>();
      fence_registers(scores);
      release(stages.k_empty(0));
      softmax_block(scores, keys.block(first_block), 0, correction);
      accumulator_to_a_fragments<Element, kKeys>(p, scores);
    }
    for (int index = 1; index < own_blocks; ++index) {
      const int stage = index % kKStages;
      const int previous = (index - 1) % kVStages;
      const KeyBlock<Element> block = keys.block(first_block + index);
      stages.wait_k_full(index);
      turn_wait();
      issue_scores(scores, stage);
      stages.wait_v_full(index - 1);
      issue_values(p, previous);
      turn_pass();
      wgmma_wait<1>();  // S of this block; P V of the one before may still run
      fence_registers(scores);
      release(stages.k_empty(stage));
      softmax_block(scores, block, index, correction);
      wgmma_wait<0>();
      fence_registers(output);
      fence_registers(p);
      release(stages.v_empty(previous));
      rescale_output(correction);
      accumulator_to_a_fragments<Element, kKeys>(p, scores);
    }
    const int last = (own_blocks - 1) % kVStages;
    stages.wait_v_full(own_blocks - 1);
    issue_values(p, last);
    wgmma_wait<0>();
    fence_registers(output);
    release(stages.v_empty(last));
  }
  // The blocks this consumer skips: it still takes its turns and frees their stages (once they are
  // full, so that its arrivals count toward the right phase).
  for (int index = own_blocks; index < num_blocks; ++index) {
    stages.wait_k_full(index);
    stages.wait_v_full(index);
    turn_wait();
    turn_pass();
    release(stages.k_empty(index % kKStages));
    release(stages.v_empty(index % kVStages));
  }
  // Consumer 0's last wait matches consumer 1's last turn_pass (or, without blocks, its first
  // arrival).
  if (consumer == 0) turn_wait();

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
  __trap();
#endif  // MEMBAR_WGMMA_AVAILABLE
}

template <typename Element, int kHeadDim, typename Tiling, bool kSoftcap = false>
cudaError_t launch_forward(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  const PagedAttentionShape& shape = params.shape;
  const size_t shared_bytes = ws_shared_bytes_fixed<kHeadDim, Tiling>() +
                              (params.selection.selected_pages != nullptr ? size_t(params.selection.selected_per_tile) * 4 : 0);
  auto kernel = paged_attention_forward_ws_kernel<Element, kHeadDim, Tiling, kSoftcap>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
  if (error != cudaSuccess) return error;
  error = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, int(cudaSharedmemCarveoutMaxShared));
  if (error != cudaSuccess) return error;
  const dim3 grid((shape.chunk_tokens + kRows - 1) / kRows, shape.num_q_heads);
  kernel<<<grid, kThreads, shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace membar::kernels::cuda::detail::warpgroup_ws
