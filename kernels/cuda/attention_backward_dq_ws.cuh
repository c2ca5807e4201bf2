// The warp-specialised dQ pass of the deterministic backward on Hopper (sm_90a), head_dim 128.
// Internal to kernels/cuda/ (included by attention_backward_dq.cu, which runs it on Hopper with the
// sm_90a build where it fits a call).
//
// Note [Warp-specialised dQ pass]
// Rationale: deterministic mode computes dQ in a pass of its own (Note [Warpgroup dQ pass]). Once
// the default backward became warp-specialised (session 32, Note [Warp-specialised backward]) the
// deterministic one fell to 0.98x / 0.91x / 0.885x of it at 32K / 128K / 256K history (session 33,
// an H100; goal 0.9x): the dK/dV kernel is the same warp-specialised one, but the dQ pass was
// still one warpgroup a CTA that loads with every thread, meets its partner warps at a CTA-wide
// barrier per key block and waits for each block's products before the next block's. The pass is
// a forward with one more product (S = Q K^T, dP = dO V^T, dQ += dS K), and the forward gained
// 1.25-1.45x from warp specialisation (Note [Warp-specialised forward]).
// Approach: the warp-specialised forward's scheme, with dQ in place of the output. One CTA of three
// warpgroups (384 threads) per (128 queries, q head), walking the forward's key sequence
// (KeySequence) in 64-key blocks (S, dP and dQ of 64 rows and the dS fragments take 144 registers
// a thread; 128-key blocks would take 224 before addresses and spill):
//   - warpgroup 0, the producer (setmaxnreg 56), copies Q and dO once, then each block's K and V
//     into their stages with cp.async; cp.async.mbarrier.arrive.noinc tells a stage's "full"
//     barrier once its copies have landed. K has three stages and V two: K_i is read by S_i and by
//     dQ += dS_i K_i, issued one block later, so K_i is free only once block i + 1's turn is done;
//     V_i is free after dP_i.
//   - warpgroups 1 and 2, the consumers (224 registers), own 64 query rows each, dQ in registers
//     (the accumulator layout of Note [Warpgroup forward]); lse and delta of their two rows a
//     thread read once. Per block i a consumer issues S_i, dP_i and dQ += dS_{i-1} K_{i-1} as three
//     commit groups, waits for S_i only and exponentiates it while dP_i and the dQ product run,
//     then for dP_i (dS_i = P_i o (dP_i - delta)), then for the dQ product before dS_i replaces
//     dS_{i-1} in the A fragments (FlashAttention-3's intra-warpgroup overlap). The last block's
//     dQ product follows the loop.
//   - the two consumers take turns issuing (ping-pong, named barriers 1 and 2, exactly as the
//     warp-specialised forward does, including the blocks above a consumer's diagonal that it
//     skips and the matching of every arrival).
// Masks as the warpgroup dQ pass (per warp: partial blocks, the causal chunk blocks, a window's
// edge); P = 0 where hidden. dQ is written once, so its bits do not depend on scheduling.
// Shared memory (base aligned to 1024): Q, dO [2][128][64] (32 KiB each); K [3][2][64][64] and
// V [2][2][64][64] (16 KiB a stage); the barriers; a sparse tile's selection.
// Measured (session 35, an H100, bench/results/2026-12-07-session35-h100; Qwen2.5-7B heads, chunk
// 4096, pages of 128 shuffled, bf16): under torch.profiler the pass took 7.15 / 28.81 / 55.55 ms at
// 32K / 128K / 256K history against the warpgroup pass's 7.39 / 29.83 / 63.32 (at 256K the clocks
// differed: the same dK/dV kernel ran 53.45 and 60.30 ms beside them), the deterministic backward
// 0.983x / 0.912x / 0.936x of the default's time; the attention bench (three runs a mode) gave
// 0.987x / 0.901x / 0.930x in one call and 0.888x / 0.892x at 128K / 256K in another, the warpgroup
// pass 0.870x-0.907x in the same calls: run-to-run noise is as large as the gain. dQ the same bits
// as the warpgroup pass's (both add the same 64-key products in the same order). Correct first: the
// gpu attention tests (every case in deterministic mode, the warpgroup pass beside it) and
// test_attention_variants.py. No spills (producer 56 registers, consumers 224).
// Limitations: head_dim 128 only (64 and 96 keep the warpgroup pass); CTAs of 128 queries, so a
// sparse selection needs query tiles of 128k rows (others keep the warpgroup pass). S and dP read
// both operands from shared memory at N = 64, near the SM's shared-memory bandwidth.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_backward_common.cuh"
#include "attention_backward_wgmma.cuh"
#include "attention_common.cuh"
#include "attention_cuda_internal.h"
#include "attention_wgmma.cuh"

namespace membar::kernels::cuda::detail::warpgroup {

inline constexpr int kDqWsThreads = 384;  // producer + two consumer warpgroups
inline constexpr int kDqWsRows = 128;     // queries per CTA (64 a consumer)
inline constexpr int kDqWsKeys = 64;      // keys per block
inline constexpr int kDqWsKStages = 3;
inline constexpr int kDqWsVStages = 2;
inline constexpr int kDqWsProducerRegisters = 56;
inline constexpr int kDqWsConsumerRegisters = 224;
static_assert(128 * kDqWsProducerRegisters + 256 * kDqWsConsumerRegisters <= 65536,
              "the three warpgroups' registers fit the SM's 64K");

constexpr size_t dq_ws_shared_bytes_fixed() {
  constexpr size_t kQueryTile = size_t(kDqWsRows) * 128 * 2;
  constexpr size_t kKeyTile = size_t(kDqWsKeys) * 128 * 2;
  // Alignment slack, Q and dO, the K and V stages, the barriers (Q's, two per stage), the count.
  return 1024 + 2 * kQueryTile + (kDqWsKStages + kDqWsVStages) * kKeyTile + 8 * (1 + 2 * (kDqWsKStages + kDqWsVStages)) +
         16;
}

// Whether the warp-specialised dQ pass runs a call (the device is checked by the caller).
inline bool dq_ws_fits(const PagedAttentionBackwardParams& params) {
  return params.shape.head_dim == 128 &&
         (params.selection.selected_pages == nullptr || params.selection.query_tile_tokens % kDqWsRows == 0);
}

template <typename Element, bool kSoftcap>
__global__ void __launch_bounds__(kDqWsThreads, 1)
    paged_attention_backward_dq_ws_kernel(const PagedAttentionBackwardParams params, const float* delta,
                                          const SoftCap soft_cap) {
  static_assert(dq_ws_shared_bytes_fixed() + 4 * size_t(kMaxSelectedPerTile) <= 227 * 1024,
                "an H100/H200 CTA has 227 KiB: the tiles and the largest sparse selection must fit");
#if MEMBAR_WGMMA_AVAILABLE
  constexpr int kHeadDim = 128;
  constexpr int kRows = kDqWsRows;
  constexpr int kKeys = kDqWsKeys;
  constexpr int kKStages = kDqWsKStages;
  constexpr int kVStages = kDqWsVStages;
  constexpr int kQueryTileBytes = kRows * kHeadDim * 2;
  constexpr int kKeyTileBytes = kKeys * kHeadDim * 2;
  constexpr int kConsumerWarps = 8;
  extern __shared__ unsigned char shared_raw[];
  const uint32_t raw_address = shared_address(shared_raw);
  unsigned char* shared_base = shared_raw + (((raw_address + 1023u) & ~1023u) - raw_address);
  unsigned char* q_tile = shared_base;                            // [2][kRows][64]
  unsigned char* dout_tile = q_tile + kQueryTileBytes;            // [2][kRows][64]
  unsigned char* k_tiles = dout_tile + kQueryTileBytes;           // [kKStages][2][kKeys][64]
  unsigned char* v_tiles = k_tiles + kKStages * kKeyTileBytes;    // [kVStages][2][kKeys][64]
  uint64_t* barriers = reinterpret_cast<uint64_t*>(v_tiles + kVStages * kKeyTileBytes);
  using Stages = KeyBlockStages<kKStages, kVStages>;
  int* selected_count = reinterpret_cast<int*>(barriers + Stages::kBarriers);
  int32_t* selected = selected_count + 4;  // [selected_per_tile]
  const Stages stages{shared_address(barriers)};

  const PagedAttentionShape& shape = params.shape;
  const int thread = threadIdx.x;
  const int warpgroup_index = thread / 128;
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

  if (warpgroup_index == 0) {
    // The producer.
    registers_decrease<kDqWsProducerRegisters>();
    const int copier = thread;  // 0 .. 127
    const int64_t q_offset = int64_t(first_query) * q_row_stride + int64_t(q_head) * kHeadDim;
    load_swizzled_rows<kRows, kHeadDim, 128>(q_tile, static_cast<const Element*>(params.q) + q_offset, q_row_stride,
                                             chunk_tokens - first_query, copier);
    load_swizzled_rows<kRows, kHeadDim, 128>(dout_tile, static_cast<const Element*>(params.dout) + q_offset,
                                             q_row_stride, chunk_tokens - first_query, copier);
    copies_arrive(stages.query_full());
    produce_key_blocks<kKeys, kHeadDim>(keys, first_block, num_blocks, k_tiles, v_tiles, stages, kv_row_stride, copier);
    return;
  }

  // A consumer.
  registers_increase<kDqWsConsumerRegisters>();
  const int consumer = warpgroup_index - 1;
  const int warp_in_group = (thread % 128) / 32;
  const int group_row = consumer * 64;
  const int warp_row = group_row + warp_in_group * 16;  // the warp's first row in the CTA
  const int query_position[2] = {first_query + warp_row + lane / 4, first_query + warp_row + lane / 4 + 8};
  const float* lse = static_cast<const float*>(params.lse);
  float row_lse[2], row_delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    query_row_statistics(lse, delta, chunk_tokens, q_head, query_position[half], row_lse[half], row_delta[half]);
  }
  const float scale_log2 = shape.softmax_scale * kLog2e;
  float dq[kHeadDim / 8][4];
  clear(dq);
  const uint32_t q_address = shared_address(q_tile) + group_row * kRowBytes;
  const uint32_t dout_address = shared_address(dout_tile) + group_row * kRowBytes;
  const uint32_t k_address = shared_address(k_tiles);
  const uint32_t v_address = shared_address(v_tiles);
  // Ping-pong (Note [Warp-specialised forward]): barrier 1 + c is consumer c's turn to issue.
  const auto turn_wait = [&]() { named_barrier_sync(1 + consumer, 2 * 128); };
  const auto turn_pass = [&]() { named_barrier_arrive(2 - consumer, 2 * 128); };
  const auto release = [&](uint32_t barrier) {
    __syncwarp();
    if (lane == 0) mbarrier_arrive(barrier);
  };

  // S = Q K^T and dP = dO V^T of a block, [64 queries, 64 keys]: two commit groups.
  auto issue_scores = [&](float (&scores)[kKeys / 8][4], float (&dscores)[kKeys / 8][4], int index) {
    const uint32_t k_stage = k_address + (index % kKStages) * kKeyTileBytes;
    const uint32_t v_stage = v_address + (index % kVStages) * kKeyTileBytes;
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
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t half = kk / 4;
      const uint32_t column_bytes = (kk % 4) * 32;
      const uint64_t a = matrix_descriptor(dout_address + half * kRows * kRowBytes + column_bytes, 16, 1024);
      const uint64_t b = matrix_descriptor(v_stage + half * kKeys * kRowBytes + column_bytes, 16, 1024);
      wgmma_shared<Element, kKeys>(dscores, a, b, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
  };
  // dQ += dS K of a block (K MN-major: the k step kk, 16 keys, starts kk * 16 rows in); one group.
  auto issue_dq = [&](const uint32_t (&fragments)[kKeys / 16][4], int index) {
    const uint32_t k_stage = k_address + (index % kKStages) * kKeyTileBytes;
    fence_registers(dq);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      const uint64_t b = matrix_descriptor(k_stage + kk * 16 * kRowBytes, kKeys * kRowBytes, 1024);
      wgmma_registers_transposed_b<Element, kHeadDim>(dq, fragments[kk], b);
    }
    wgmma_commit();
  };
  // P of a block's finished scores (in place), before dP is done (uncapped), or dS of both (capped).
  struct BlockMask {
    bool chunk_block, window_cuts, may_cut;
    int valid_rows, first_position, window_edge;
  };
  auto mask_of = [&](int index) {
    const KeyBlock<Element> block = keys.block(first_block + index);
    BlockMask mask;
    mask.chunk_block = block.first_position >= 0;
    mask.valid_rows = block.valid_rows;
    mask.first_position = block.first_position;
    mask.window_edge = window_edge_of_block<kKeys>(shape, first_block + index, block.first_position);
    mask.window_cuts = mask.window_edge <= first_query + warp_row + 15;
    mask.may_cut = block.valid_rows < kKeys || (mask.chunk_block && block.first_position + kKeys - 1 > first_query + warp_row) ||
                   mask.window_cuts;
    return mask;
  };
  auto probability = [&](const BlockMask& mask, float score, int n, int j) {
    const int key = n * 8 + 2 * (lane % 4) + (j & 1);
    float p = exp2f(score * scale_log2 - row_lse[j >> 1]);
    if (mask.may_cut) {
      bool visible = key < mask.valid_rows;
      if (mask.chunk_block) visible = visible && mask.first_position + key <= query_position[j >> 1];
      if (mask.window_cuts) visible = visible && key + mask.window_edge > query_position[j >> 1];
      if (!visible) p = 0.f;
    }
    return p;
  };
  // Waits for S and dP of a block (the dQ product issued after them may still run: `pending` groups)
  // and leaves dS in `dscores`.
  auto block_gradients = [&](float (&scores)[kKeys / 8][4], float (&dscores)[kKeys / 8][4], int index, auto pending) {
    constexpr int kPending = decltype(pending)::value;
    const BlockMask mask = mask_of(index);
    if constexpr (kSoftcap) {
      wgmma_wait<kPending>();
      fence_registers(scores);
      fence_registers(dscores);
      release(stages.v_empty(index % kVStages));
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float capped = soft_cap.capped(scores[n][j]);
          const float p = probability(mask, capped, n, j);
          dscores[n][j] = p * (dscores[n][j] - row_delta[j >> 1]) * soft_cap.slope(capped);
        }
      }
    } else {
      wgmma_wait<kPending + 1>();
      fence_registers(scores);
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) scores[n][j] = probability(mask, scores[n][j], n, j);
      }
      wgmma_wait<kPending>();
      fence_registers(dscores);
      release(stages.v_empty(index % kVStages));
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) dscores[n][j] = scores[n][j] * (dscores[n][j] - row_delta[j >> 1]);
      }
    }
  };
  const auto computes = [&](int index) {
    const KeyBlock<Element> block = keys.block(first_block + index);
    return !(block.first_position >= 0 && block.first_position > first_query + group_row + 63);
  };
  // Blocks this consumer computes: all but the trailing chunk blocks above its rows' diagonal.
  int own_blocks = num_blocks;
  while (own_blocks > 0 && !computes(own_blocks - 1)) --own_blocks;

  mbarrier_wait(stages.query_full(), 0);
  fence_proxy_async_shared();
  if (consumer == 1) named_barrier_arrive(1, 2 * 128);  // consumer 0 takes the first turn

  if (own_blocks > 0) {
    float scores[kKeys / 8][4];
    float dscores[kKeys / 8][4];
    uint32_t fragments[kKeys / 16][4];
    {
      stages.wait_k_full(0);
      stages.wait_v_full(0);
      turn_wait();
      issue_scores(scores, dscores, 0);
      turn_pass();
      block_gradients(scores, dscores, 0, std::integral_constant<int, 0>{});
      accumulator_to_a_fragments<Element, kKeys>(fragments, dscores);
    }
    for (int index = 1; index < own_blocks; ++index) {
      stages.wait_k_full(index);
      stages.wait_v_full(index);
      turn_wait();
      issue_scores(scores, dscores, index);
      issue_dq(fragments, index - 1);
      turn_pass();
      block_gradients(scores, dscores, index, std::integral_constant<int, 1>{});
      wgmma_wait<0>();  // dQ += dS_{i-1} K_{i-1}: its fragments and K stage are free
      fence_registers(dq);
      fence_registers(fragments);
      release(stages.k_empty((index - 1) % kKStages));
      accumulator_to_a_fragments<Element, kKeys>(fragments, dscores);
    }
    issue_dq(fragments, own_blocks - 1);
    wgmma_wait<0>();
    fence_registers(dq);
    release(stages.k_empty((own_blocks - 1) % kKStages));
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

  write_dq_rows<Element, kHeadDim>(params, dq, query_position, q_head, lane);
#else
  __trap();
#endif  // MEMBAR_WGMMA_AVAILABLE
}

template <typename Element, bool kSoftcap>
cudaError_t launch_backward_dq_ws(const PagedAttentionBackwardParams& params, const float* delta, cudaStream_t stream) {
  const size_t shared_bytes = dq_ws_shared_bytes_fixed() + ((params.selection.selected_pages != nullptr)
                                                                ? size_t(params.selection.selected_per_tile) * 4
                                                                : 0);
  auto kernel = paged_attention_backward_dq_ws_kernel<Element, kSoftcap>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
  if (error != cudaSuccess) return error;
  const dim3 grid((params.shape.chunk_tokens + kDqWsRows - 1) / kDqWsRows, params.shape.num_q_heads);
  kernel<<<grid, kDqWsThreads, shared_bytes, stream>>>(
      params, delta, soft_cap_of(params.shape.softmax_scale, params.shape.logit_softcap));
  return cudaGetLastError();
}

}  // namespace membar::kernels::cuda::detail::warpgroup
