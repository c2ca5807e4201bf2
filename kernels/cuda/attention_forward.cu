// Paged attention forward on CUDA (FlashAttention-2 style, mma.sync tensor cores).
//
// Note [Forward kernel]
// One CTA per (block of 128 queries, q head) with eight warps of 16 query rows (four warps, 64
// rows, when a sparse selection's tiles are an odd multiple of 64); each warp keeps its output
// accumulator and online-softmax state in registers and reads Q fragments from shared memory. The CTA
// walks its key sequence in blocks of 64 keys (KeySequence: the history pages, or the selected
// ones, then the chunk's own keys up to its last query), double-buffering K and V through
// cp.async in three stages so that block i + 1 loads while block i is multiplied and one barrier
// per block suffices (a stage is rewritten two blocks after it was read). Scores are masked only where a
// block can cut: the partial last history page and the chunk's diagonal blocks.
// At the end each row is divided by its softmax sum and lse = max * scale + log(sum) is written.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "attention_common.cuh"
#include "attention_cuda_internal.h"

namespace membar::kernels::cuda {
namespace {

using namespace detail;

constexpr int kForwardKeys = 64;
// K/V stages: three, so that one barrier per block suffices.
constexpr int kStages = 3;

template <int kHeadDim, int kRows>
constexpr size_t forward_shared_bytes_fixed() {
  // Q [kRows, D] + K and V [kStages, 64, D], 16-bit elements.
  return size_t(kRows * kHeadDim + 2 * kStages * kForwardKeys * kHeadDim) * 2;
}

// kRowTiles: 16-row tiles per warp. Two tiles per warp read every K and V fragment from shared
// memory once for 32 rows, halving the shared-memory traffic per tensor-core instruction, but
// need more registers than the H200 has per thread at head_dim 128 (spills); one is the default.
template <typename Element, int kHeadDim, int kWarps, int kRowTiles>
__global__ void __launch_bounds__(kWarps * 32, 1) paged_attention_forward_kernel(const PagedAttentionForwardParams params) {
  constexpr int kWarpRows = 16 * kRowTiles;
  constexpr int kRows = kWarpRows * kWarps;
  constexpr int kThreads = kWarps * 32;
  constexpr int kKeys = kForwardKeys;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  Element* q_tile = reinterpret_cast<Element*>(shared_raw);     // [kRows, D]
  Element* k_tiles = q_tile + kRows * kHeadDim;                   // [kStages, kKeys, D]
  Element* v_tiles = k_tiles + kStages * kKeys * kHeadDim;        // [kStages, kKeys, D]
  int32_t* selected = reinterpret_cast<int32_t*>(v_tiles + kStages * kKeys * kHeadDim);  // [selected_per_tile]
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
  load_tile_async<Element, kRows, kHeadDim, kThreads>(q_tile, q + int64_t(first_query) * q_row_stride + int64_t(q_head) * kHeadDim,
                                                      q_row_stride, chunk_tokens - first_query, thread);
  copy_async_commit();

  KeySequence<Element, kKeys> keys;
  keys.k_pool = static_cast<const Element*>(params.history.k_pool);
  keys.v_pool = static_cast<const Element*>(params.history.v_pool);
  keys.k_page_index = params.history.k_page_index;
  keys.v_page_index = params.history.v_page_index;
  keys.k_chunk = static_cast<const Element*>(params.k_chunk);
  keys.v_chunk = static_cast<const Element*>(params.v_chunk);
  keys.history_tokens = shape.history_tokens;
  keys.page_tokens = shape.page_tokens;
  keys.chunk_tokens = chunk_tokens;
  keys.num_kv_heads = shape.num_kv_heads;
  keys.head_dim = kHeadDim;
  keys.kv_head = kv_head;
  const int num_pages = history_page_count(shape);
  if ((params.selection.selected_pages != nullptr)) {
    const int selection_tile = first_query / params.selection.query_tile_tokens;
    const int count = compact_selection(
        params.selection.selected_pages + int64_t(selection_tile) * params.selection.selected_per_tile,
        params.selection.selected_per_tile, num_pages, selected, &selected_count);
    keys.selected = selected;
    keys.num_history_blocks = count * (shape.page_tokens / kKeys);
  } else {
    keys.selected = nullptr;
    keys.num_history_blocks = (shape.history_tokens + kKeys - 1) / kKeys;
  }
  const int last_query = min(first_query + kRows, chunk_tokens) - 1;
  // Without attend_chunk only the history blocks (Note [Blocked history] in attention.h); a CTA
  // with no block at all writes out = 0 and lse = -inf.
  const int num_blocks = keys.num_history_blocks + (shape.attend_chunk ? last_query / kKeys + 1 : 0);
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;

  auto load_block = [&](int index, int stage) {
    const KeyBlock<Element> block = keys.block(index);
    load_tile_async<Element, kKeys, kHeadDim, kThreads>(k_tiles + stage * kKeys * kHeadDim, block.k_base, kv_row_stride,
                                                        block.valid_rows, thread);
    load_tile_async<Element, kKeys, kHeadDim, kThreads>(v_tiles + stage * kKeys * kHeadDim, block.v_base, kv_row_stride,
                                                        block.valid_rows, thread);
  };
  if (num_blocks > 0) load_block(0, 0);
  copy_async_commit();

  const float scale_log2 = shape.softmax_scale * kLog2e;
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

  for (int index = 0; index < num_blocks; ++index) {
    const int stage = index % kStages;
    if (index + 1 < num_blocks) load_block(index + 1, (index + 1) % kStages);
    copy_async_commit();
    copy_async_wait<1>();
    __syncthreads();

    const Element* k_tile = k_tiles + stage * kKeys * kHeadDim;
    const Element* v_tile = v_tiles + stage * kKeys * kHeadDim;
    float scores[kRowTiles][kKeys / 8][4];
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t) clear(scores[t]);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      uint32_t a[kRowTiles][4];
#pragma unroll
      for (int t = 0; t < kRowTiles; ++t) {
        ldmatrix_x4(a[t], q_tile + swizzled_offset<kHeadDim>(warp_row + t * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8));
      }
#pragma unroll
      for (int nn = 0; nn < kKeys / 16; ++nn) {
        uint32_t b[4];
        const int row = nn * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int column = kk * 16 + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(b, k_tile + swizzled_offset<kHeadDim>(row, column));
#pragma unroll
        for (int t = 0; t < kRowTiles; ++t) {
          ElementTraits<Element>::mma(scores[t][2 * nn], a[t], b[0], b[1]);
          ElementTraits<Element>::mma(scores[t][2 * nn + 1], a[t], b[2], b[3]);
        }
      }
    }

    const KeyBlock<Element> block = keys.block(index);
    const bool chunk_block = block.first_position >= 0;
    const bool needs_mask = block.valid_rows < kKeys ||
                            (chunk_block && block.first_position + kKeys - 1 > first_query + warp_row);
    uint32_t p_fragments[kRowTiles][kKeys / 16][4];
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t) {
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
#pragma unroll
        for (int n = 0; n < kHeadDim / 8; ++n) {
          output[t][n][2 * half] *= correction;
          output[t][n][2 * half + 1] *= correction;
        }
      }
      accumulator_to_a_fragments<Element, kKeys>(p_fragments[t], scores[t]);
    }

    // O += P V: every V fragment serves all row tiles of the warp.
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < kHeadDim / 16; ++nn) {
        uint32_t b[4];
        const int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int column = nn * 16 + (lane >> 4) * 8;
        ldmatrix_x4_trans(b, v_tile + swizzled_offset<kHeadDim>(row, column));
#pragma unroll
        for (int t = 0; t < kRowTiles; ++t) {
          ElementTraits<Element>::mma(output[t][2 * nn], p_fragments[t][kk], b[0], b[1]);
          ElementTraits<Element>::mma(output[t][2 * nn + 1], p_fragments[t][kk], b[2], b[3]);
        }
      }
    }
    // No barrier here: the copy issued next overwrites the stage read two blocks ago, which every
    // warp finished before passing this iteration's barrier (Note [Forward kernel]).
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

template <typename Element, int kHeadDim, int kWarps, int kRowTiles>
cudaError_t launch_forward(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  constexpr int kRows = 16 * kRowTiles * kWarps;
  const PagedAttentionShape& shape = params.shape;
  const size_t shared_bytes = forward_shared_bytes_fixed<kHeadDim, kRows>() +
                              (params.selection.selected_pages != nullptr ? size_t(params.selection.selected_per_tile) * 4 : 0);
  auto kernel = paged_attention_forward_kernel<Element, kHeadDim, kWarps, kRowTiles>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
  if (error != cudaSuccess) return error;
  const dim3 grid((shape.chunk_tokens + kRows - 1) / kRows, shape.num_q_heads);
  kernel<<<grid, kWarps * 32, shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

template <typename Element, int kHeadDim>
cudaError_t dispatch_rows(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  // A CTA's queries must lie in one selection tile (Note [Forward kernel]): 128 rows (eight warps
  // of 16) unless the selection's tiles are an odd multiple of 64 rows.
  if (params.selection.selected_pages != nullptr && params.selection.query_tile_tokens % 128 != 0) {
    return launch_forward<Element, kHeadDim, 4, 1>(params, stream);
  }
  // Tuning knob for comparing layouts on a new GPU: MEMBAR_ATTENTION_FORWARD_WARP_ROWS=32 runs four
  // warps of 32 rows instead of eight of 16 (same results). On the H200 the 32-row layout spills
  // (255 registers) and ran at 220 TFLOP/s against 272 for the default
  // (bench/results/2026-11-30-attention-h200.json).
  const char* warp_rows = std::getenv("MEMBAR_ATTENTION_FORWARD_WARP_ROWS");
  if (warp_rows != nullptr && std::strcmp(warp_rows, "32") == 0) {
    return launch_forward<Element, kHeadDim, 4, 2>(params, stream);
  }
  return launch_forward<Element, kHeadDim, 8, 1>(params, stream);
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
  if (params.shape.dtype == DType::kBFloat16) return dispatch_head_dim<__nv_bfloat16>(params, cuda_stream);
  return dispatch_head_dim<__half>(params, cuda_stream);
}

}  // namespace membar::kernels::cuda
