// dQ of the deterministic backward (Note [Backward kernel] in attention_backward.cu). On Hopper with
// the sm_90a build, head size 128 runs the warp-specialised kernel of Note [Warp-specialised dQ
// pass] (attention_backward_dq_ws.cuh) where it fits the call, and head sizes 64, 96 and 128 the
// warpgroup kernel of Note [Warpgroup dQ pass] (attention_backward_dq_wgmma.cuh) otherwise; the
// kernel below runs the other GPUs and head size 256.
//
// One CTA per (block of 64 queries, q head), four warps of 16 query rows. The CTA walks the same
// key sequence as the forward (KeySequence) in blocks of 64 keys, K and V double-buffered through
// cp.async, and per block computes S = Q K^T, P = exp(S * scale - lse), dP = dO V^T,
// dS = P o (dP - delta), dQ += dS K, all per warp in registers. dQ is written once, so its bits
// do not depend on scheduling. With kSoftcap S is capped before P and dS multiplied by the cap's
// slope (Note [Soft-capped scores in raw units] in attention_common.cuh). A sliding window starts
// the loop at the first block the CTA's first query sees and sets P = 0 for the hidden pairs of
// blocks that straddle a warp's window edge (Note [Sliding window in the kernels]).
#include <cuda_runtime.h>

#include <cmath>

#include "attention_backward_common.cuh"
#include "attention_backward_dq_wgmma.cuh"
#include "attention_backward_dq_ws.cuh"
#include "attention_common.cuh"
#include "attention_cuda_internal.h"

namespace membar::kernels::cuda {
namespace {

using namespace detail;

constexpr int kDqWarps = 4;
constexpr int kDqRows = 16 * kDqWarps;
constexpr int kDqKeys = 64;

// Tiles are swizzled up to head_dim 128, padded above it (one register per tile instead of one
// per fragment offset: at 256 the swizzled kernel spills) and at head sizes that are not a
// multiple of 64 (Note [Padded tiles]).
template <int kHeadDim>
constexpr bool dq_padded() {
  return tile_padded<kHeadDim>(kHeadDim > 128);
}

template <int kHeadDim>
constexpr int dq_stride() {
  return TileLayout<kHeadDim, dq_padded<kHeadDim>()>::kStride;
}

template <int kHeadDim>
constexpr size_t dq_shared_bytes_fixed() {
  // Q, dO [64, D]; K, V [2 stages, 64, D]; 16-bit elements (rows of dq_stride elements).
  return size_t(2 * kDqRows * dq_stride<kHeadDim>() + 4 * kDqKeys * dq_stride<kHeadDim>()) * 2;
}

template <typename Element, int kHeadDim, bool kSoftcap>
__global__ void __launch_bounds__(kDqWarps * 32) paged_attention_backward_dq_kernel(const PagedAttentionBackwardParams params,
                                                                                   const float* delta,
                                                                                   const SoftCap soft_cap) {
  constexpr int kThreads = kDqWarps * 32;
  constexpr int kKeys = kDqKeys;
  constexpr bool kPadded = dq_padded<kHeadDim>();
  constexpr int kStride = dq_stride<kHeadDim>();
  extern __shared__ __align__(128) unsigned char shared_raw[];
  Element* q_tile = reinterpret_cast<Element*>(shared_raw);    // [64, D]
  Element* dout_tile = q_tile + kDqRows * kStride;               // [64, D]
  Element* k_tiles = dout_tile + kDqRows * kStride;              // [2, 64, D]
  Element* v_tiles = k_tiles + 2 * kKeys * kStride;              // [2, 64, D]
  int32_t* selected = reinterpret_cast<int32_t*>(v_tiles + 2 * kKeys * kStride);  // [selected_per_tile]
  __shared__ int selected_count;

  const PagedAttentionShape& shape = params.shape;
  const int thread = threadIdx.x;
  const int warp = thread / 32;
  const int lane = thread % 32;
  const int tile = gridDim.x - 1 - blockIdx.x;
  const int q_head = blockIdx.y;
  const int group = shape.num_q_heads / shape.num_kv_heads;
  const int first_query = tile * kDqRows;
  const int chunk_tokens = shape.chunk_tokens;
  const int64_t q_row_stride = int64_t(shape.num_q_heads) * kHeadDim;
  const int64_t q_offset = int64_t(first_query) * q_row_stride + int64_t(q_head) * kHeadDim;

  load_tile_async<Element, kDqRows, kHeadDim, kThreads, kPadded>(q_tile, static_cast<const Element*>(params.q) + q_offset,
                                                                 q_row_stride, chunk_tokens - first_query, thread);
  load_tile_async<Element, kDqRows, kHeadDim, kThreads, kPadded>(
      dout_tile, static_cast<const Element*>(params.dout) + q_offset, q_row_stride, chunk_tokens - first_query, thread);
  copy_async_commit();

  const auto keys =
      key_sequence_for_tile<Element, kKeys, false, kHeadDim>(params, q_head / group, first_query, selected, &selected_count);
  const int last_query = min(first_query + kDqRows, chunk_tokens) - 1;
  // Loop index i is key-sequence block first_block + i: a sliding window skips the blocks no query
  // of the CTA sees.
  const int first_block = window_first_block<kKeys>(shape, keys.num_history_blocks, first_query);
  const int num_blocks = keys.num_history_blocks + (shape.attend_chunk ? last_query / kKeys + 1 : 0) - first_block;
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;
  auto load_block = [&](int index, int stage) {
    const KeyBlock<Element> block = keys.block(first_block + index);
    load_tile_async<Element, kKeys, kHeadDim, kThreads, kPadded>(k_tiles + stage * kKeys * kStride, block.k_base,
                                                                 kv_row_stride, block.valid_rows, thread);
    load_tile_async<Element, kKeys, kHeadDim, kThreads, kPadded>(v_tiles + stage * kKeys * kStride, block.v_base,
                                                                 kv_row_stride, block.valid_rows, thread);
  };
  if (num_blocks > 0) load_block(0, 0);
  copy_async_commit();

  // Rows of this thread: warp * 16 + lane / 4 and that + 8; their lse (log2 units) and delta.
  const int row_in_tile = warp * 16 + lane / 4;
  const int query_position[2] = {first_query + row_in_tile, first_query + row_in_tile + 8};
  const float* lse = static_cast<const float*>(params.lse);
  float row_lse[2], row_delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    query_row_statistics(lse, delta, chunk_tokens, q_head, query_position[half], row_lse[half], row_delta[half]);
  }
  const float scale_log2 = shape.softmax_scale * kLog2e;
  float dq[kHeadDim / 8][4];
  clear(dq);

  for (int index = 0; index < num_blocks; ++index) {
    const int stage = index & 1;
    if (index + 1 < num_blocks) load_block(index + 1, stage ^ 1);
    copy_async_commit();
    copy_async_wait<1>();
    __syncthreads();

    const Element* k_tile = k_tiles + stage * kKeys * kStride;
    const Element* v_tile = v_tiles + stage * kKeys * kStride;
    float scores[kKeys / 8][4];
    float dscores[kKeys / 8][4];
    clear(scores);
    clear(dscores);
    warp_matmul_shared_nt<Element, kKeys, kHeadDim, kHeadDim, kHeadDim, kPadded>(scores, q_tile, warp * 16, k_tile, 0, lane);
    if constexpr (kSoftcap) soft_cap_scores(scores, soft_cap);
    warp_matmul_shared_nt<Element, kKeys, kHeadDim, kHeadDim, kHeadDim, kPadded>(dscores, dout_tile, warp * 16, v_tile, 0,
                                                                                lane);
    const KeyBlock<Element> block = keys.block(first_block + index);
    const bool chunk_block = block.first_position >= 0;
    const int window_edge = window_edge_of_block<kKeys>(shape, first_block + index, block.first_position);
    const bool window_cuts = window_edge <= first_query + warp * 16 + 15;
    const bool may_cut = block.valid_rows < kKeys ||
                         (chunk_block && block.first_position + kKeys - 1 > first_query + warp * 16) || window_cuts;
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = n * 8 + 2 * (lane % 4) + (j & 1);
        float p = exp2f(scores[n][j] * scale_log2 - row_lse[j >> 1]);
        if (may_cut) {
          bool visible = key < block.valid_rows;
          if (chunk_block) visible = visible && block.first_position + key <= query_position[j >> 1];
          if (window_cuts) visible = visible && key + window_edge > query_position[j >> 1];
          if (!visible) p = 0.f;
        }
        dscores[n][j] = p * (dscores[n][j] - row_delta[j >> 1]);
        if constexpr (kSoftcap) dscores[n][j] *= soft_cap.slope(scores[n][j]);
      }
    }
    uint32_t fragments[kKeys / 16][4];
    accumulator_to_a_fragments<Element, kKeys>(fragments, dscores);
    warp_matmul_registers_nn<Element, kHeadDim, kKeys, kHeadDim, kPadded>(dq, fragments, k_tile, 0, 0, lane);
    __syncthreads();
  }
  // Leave no copy in flight (a CTA without key blocks never waited for its Q copy).
  copy_async_wait<0>();

  write_dq_rows<Element, kHeadDim>(params, dq, query_position, q_head, lane);
}

template <typename Element, int kHeadDim, bool kSoftcap>
cudaError_t launch(const PagedAttentionBackwardParams& params, const float* delta, cudaStream_t stream, DqPass pass) {
  if constexpr (warpgroup::warpgroup_backward_head_dim(kHeadDim)) {
    const cuda::CudaTarget target = current_cuda_target();
    if (target.compute_capability == 90 && target.warpgroup_kernels) {
      // Hopper with the sm_90a build: the warp-specialised dQ pass (Note [Warp-specialised dQ
      // pass]) where it fits and is not asked away, else the warpgroup one (Note [Warpgroup dQ pass]).
      if constexpr (kHeadDim == 128) {
        if (pass != DqPass::kWarpgroup && warpgroup::dq_ws_fits(params)) {
          return warpgroup::launch_backward_dq_ws<Element, kSoftcap>(params, delta, stream);
        }
      }
      return warpgroup::launch_backward_dq_wgmma<Element, kHeadDim, kSoftcap>(params, delta, stream);
    }
  }
  const size_t shared_bytes = dq_shared_bytes_fixed<kHeadDim>() +
                              ((params.selection.selected_pages != nullptr) ? size_t(params.selection.selected_per_tile) * 4 : 0);
  auto kernel = paged_attention_backward_dq_kernel<Element, kHeadDim, kSoftcap>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
  if (error != cudaSuccess) return error;
  const dim3 grid((params.shape.chunk_tokens + kDqRows - 1) / kDqRows, params.shape.num_q_heads);
  kernel<<<grid, kDqWarps * 32, shared_bytes, stream>>>(
      params, delta, soft_cap_of(params.shape.softmax_scale, params.shape.logit_softcap));
  return cudaGetLastError();
}

template <typename Element, bool kSoftcap>
cudaError_t launch_head_dim(const PagedAttentionBackwardParams& params, const float* delta, cudaStream_t stream,
                            DqPass pass) {
  switch (params.shape.head_dim) {
    case 64: return launch<Element, 64, kSoftcap>(params, delta, stream, pass);
    case 96: return launch<Element, 96, kSoftcap>(params, delta, stream, pass);
    case 128: return launch<Element, 128, kSoftcap>(params, delta, stream, pass);
    case 256: return launch<Element, 256, kSoftcap>(params, delta, stream, pass);
  }
  return cudaErrorInvalidValue;  // paged_attention_cuda_check refused it before
}

template <bool kSoftcap>
cudaError_t launch_dtype(const PagedAttentionBackwardParams& params, const float* delta, cudaStream_t stream,
                         DqPass pass) {
  if (params.shape.dtype == DType::kBFloat16) return launch_head_dim<__nv_bfloat16, kSoftcap>(params, delta, stream, pass);
  return launch_head_dim<__half, kSoftcap>(params, delta, stream, pass);
}

}  // namespace

int launch_backward_dq(const PagedAttentionBackwardParams& params, const float* delta, void* stream, DqPass pass) {
  cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  // The capped instantiations (Note [Soft-capped scores in raw units] in attention_common.cuh).
  if (params.shape.logit_softcap > 0.f) return launch_dtype<true>(params, delta, cuda_stream, pass);
  return launch_dtype<false>(params, delta, cuda_stream, pass);
}

}  // namespace membar::kernels::cuda
