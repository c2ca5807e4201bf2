// Paged attention forward on CUDA (FlashAttention-2 style, mma.sync tensor cores).
//
// Note [Forward kernel]
// One CTA per (block of 16 * kWarps queries, q head); each warp owns 16 query rows and keeps
// their Q fragments, the output accumulator and the online-softmax state in registers. The CTA
// walks its key sequence in blocks of 64 keys (KeySequence: the history pages, or the selected
// ones, then the chunk's own keys up to its last query), double-buffering K and V through
// cp.async so that block i + 1 loads while block i is multiplied. Scores are masked only where a
// block can cut: the partial last history page and the chunk's diagonal blocks.
// At the end each row is divided by its softmax sum and lse = max * scale + log(sum) is written.
#include <cuda_runtime.h>

#include <cmath>

#include "attention_common.cuh"
#include "attention_cuda_internal.h"

namespace membar::kernels::cuda {
namespace {

using namespace detail;

constexpr int kForwardKeys = 64;

template <int kHeadDim, int kWarps>
constexpr size_t forward_shared_bytes_fixed() {
  // Q [16 * kWarps, D] + K and V [2 stages, 64, D], 16-bit elements.
  return size_t(16 * kWarps * kHeadDim + 4 * kForwardKeys * kHeadDim) * 2;
}

template <typename Element, int kHeadDim, int kWarps>
__global__ void __launch_bounds__(kWarps * 32, 1) paged_attention_forward_kernel(const PagedAttentionForwardParams params) {
  constexpr int kRows = 16 * kWarps;
  constexpr int kThreads = kWarps * 32;
  constexpr int kKeys = kForwardKeys;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  Element* q_tile = reinterpret_cast<Element*>(shared_raw);     // [kRows, D]
  Element* k_tiles = q_tile + kRows * kHeadDim;                   // [2, kKeys, D]
  Element* v_tiles = k_tiles + 2 * kKeys * kHeadDim;              // [2, kKeys, D]
  int32_t* selected = reinterpret_cast<int32_t*>(v_tiles + 2 * kKeys * kHeadDim);  // [selected_per_tile]
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
  const int num_blocks = keys.num_history_blocks + last_query / kKeys + 1;
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;

  auto load_block = [&](int index, int stage) {
    const KeyBlock<Element> block = keys.block(index);
    load_tile_async<Element, kKeys, kHeadDim, kThreads>(k_tiles + stage * kKeys * kHeadDim, block.k_base, kv_row_stride,
                                                        block.valid_rows, thread);
    load_tile_async<Element, kKeys, kHeadDim, kThreads>(v_tiles + stage * kKeys * kHeadDim, block.v_base, kv_row_stride,
                                                        block.valid_rows, thread);
  };
  load_block(0, 0);
  copy_async_commit();
  copy_async_wait<1>();
  __syncthreads();

  // This warp's 16 query rows as A fragments, [D / 16][4].
  uint32_t q_fragments[kHeadDim / 16][4];
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    ldmatrix_x4(q_fragments[kk], q_tile + swizzled_offset<kHeadDim>(warp * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8));
  }

  const float scale_log2 = shape.softmax_scale * kLog2e;
  // Rows this thread holds: warp * 16 + lane / 4 and that + 8.
  const int row_in_tile = warp * 16 + lane / 4;
  const int query_position[2] = {first_query + row_in_tile, first_query + row_in_tile + 8};
  float output[kHeadDim / 8][4];
  clear(output);
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};

  for (int index = 0; index < num_blocks; ++index) {
    const int stage = index & 1;
    if (index + 1 < num_blocks) load_block(index + 1, stage ^ 1);
    copy_async_commit();
    copy_async_wait<1>();
    __syncthreads();

    const Element* k_tile = k_tiles + stage * kKeys * kHeadDim;
    const Element* v_tile = v_tiles + stage * kKeys * kHeadDim;
    float scores[kKeys / 8][4];
    clear(scores);
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < kKeys / 16; ++nn) {
        uint32_t b[4];
        const int row = nn * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int column = kk * 16 + ((lane >> 3) & 1) * 8;
        ldmatrix_x4(b, k_tile + swizzled_offset<kHeadDim>(row, column));
        ElementTraits<Element>::mma(scores[2 * nn], q_fragments[kk], b[0], b[1]);
        ElementTraits<Element>::mma(scores[2 * nn + 1], q_fragments[kk], b[2], b[3]);
      }
    }

    const KeyBlock<Element> block = keys.block(index);
    const bool chunk_block = block.first_position >= 0;
    const bool needs_mask = block.valid_rows < kKeys ||
                            (chunk_block && block.first_position + kKeys - 1 > first_query + warp * 16);
    if (needs_mask) {
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int key = n * 8 + 2 * (lane % 4) + (j & 1);
          bool visible = key < block.valid_rows;
          if (chunk_block) visible = visible && block.first_position + key <= query_position[j >> 1];
          if (!visible) scores[n][j] = -INFINITY;
        }
      }
    }

    // Online softmax over this block (Note [Forward kernel]).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float block_max = -INFINITY;
#pragma unroll
      for (int n = 0; n < kKeys / 8; ++n) block_max = fmaxf(block_max, fmaxf(scores[n][2 * half], scores[n][2 * half + 1]));
      block_max = quad_max(block_max);
      const float new_max = fmaxf(row_max[half], block_max);
      const float max_scaled = new_max == -INFINITY ? 0.f : new_max * scale_log2;
      const float correction = exp2f(row_max[half] * scale_log2 - max_scaled);
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
      row_sum[half] = row_sum[half] * correction + sum;
#pragma unroll
      for (int n = 0; n < kHeadDim / 8; ++n) {
        output[n][2 * half] *= correction;
        output[n][2 * half + 1] *= correction;
      }
    }

    uint32_t p_fragments[kKeys / 16][4];
    accumulator_to_a_fragments<Element, kKeys>(p_fragments, scores);
    warp_matmul_registers_nn<Element, kHeadDim, kKeys, kHeadDim>(output, p_fragments, v_tile, 0, 0, lane);
    // The next iteration's copy overwrites the stage read here.
    __syncthreads();
  }

  Element* out = static_cast<Element*>(params.out);
  float* lse = static_cast<float*>(params.lse);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float sum = quad_sum(row_sum[half]);
    const int position = query_position[half];
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
}

template <typename Element, int kHeadDim, int kWarps>
cudaError_t launch_forward(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  const PagedAttentionShape& shape = params.shape;
  const size_t shared_bytes = forward_shared_bytes_fixed<kHeadDim, kWarps>() +
                              ((params.selection.selected_pages != nullptr) ? size_t(params.selection.selected_per_tile) * 4 : 0);
  auto kernel = paged_attention_forward_kernel<Element, kHeadDim, kWarps>;
  cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
  if (error != cudaSuccess) return error;
  const dim3 grid((shape.chunk_tokens + 16 * kWarps - 1) / (16 * kWarps), shape.num_q_heads);
  kernel<<<grid, kWarps * 32, shared_bytes, stream>>>(params);
  return cudaGetLastError();
}

template <typename Element, int kHeadDim>
cudaError_t dispatch_warps(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  // A CTA's queries must lie in one selection tile (Note [Forward kernel]).
  if ((params.selection.selected_pages != nullptr) && params.selection.query_tile_tokens % 128 != 0) {
    return launch_forward<Element, kHeadDim, 4>(params, stream);
  }
  return launch_forward<Element, kHeadDim, 8>(params, stream);
}

template <typename Element>
cudaError_t dispatch_head_dim(const PagedAttentionForwardParams& params, cudaStream_t stream) {
  if (params.shape.head_dim == 64) return dispatch_warps<Element, 64>(params, stream);
  return dispatch_warps<Element, 128>(params, stream);
}

}  // namespace

int paged_attention_forward(const PagedAttentionForwardParams& params, void* stream) {
  if (paged_attention_check_shape(params.shape)[0] != '\0') return cudaErrorInvalidValue;
  if (paged_attention_cuda_check(params.shape, params.selection)[0] != '\0') return cudaErrorInvalidValue;
  const void* pointers[] = {params.q, params.k_chunk, params.v_chunk, params.history.k_pool, params.history.v_pool,
                            params.out};
  const char* names[] = {"q", "k_chunk", "v_chunk", "k_pool", "v_pool", "out"};
  if (paged_attention_check_alignment(pointers, names, 6)[0] != '\0') return cudaErrorInvalidValue;
  if (params.q == nullptr || params.k_chunk == nullptr || params.v_chunk == nullptr || params.out == nullptr ||
      params.lse == nullptr) {
    return cudaErrorInvalidValue;
  }
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
