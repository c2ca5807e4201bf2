// Page summaries and top-k page selection for sparse attention, on CUDA. Simple kernels: they
// run once per chunk and layer and touch little memory next to the attention itself.
#include <cuda_runtime.h>

#include <cmath>

#include "attention_common.cuh"
#include "attention_cuda_internal.h"

namespace membar::kernels::cuda {
namespace {

using namespace detail;

// One CTA per (history page, kv head), one thread per dimension: mean, min and max over the
// page's valid rows. mean/min/max: [num_history_pages, Hkv, D] fp32.
template <typename Element>
__global__ void page_summary_kernel(const PageSummaryParams params) {
  const PagedAttentionShape& shape = params.shape;
  const int page = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int dimension = threadIdx.x;
  if (dimension >= shape.head_dim) return;
  const int rows = min(shape.page_tokens, shape.history_tokens - page * shape.page_tokens);
  const int64_t row_stride = int64_t(shape.num_kv_heads) * shape.head_dim;
  const Element* key = static_cast<const Element*>(params.k_pool) +
                       int64_t(params.k_page_index[page]) * shape.page_tokens * row_stride +
                       int64_t(kv_head) * shape.head_dim + dimension;
  float sum = 0.f, low = INFINITY, high = -INFINITY;
  for (int row = 0; row < rows; ++row) {
    const float value = ElementTraits<Element>::to_float(key[row * row_stride]);
    sum += value;
    low = fminf(low, value);
    high = fmaxf(high, value);
  }
  const int64_t offset = (int64_t(page) * shape.num_kv_heads + kv_head) * shape.head_dim + dimension;
  params.mean[offset] = sum / float(rows);
  if (params.min != nullptr) params.min[offset] = low;
  if (params.max != nullptr) params.max[offset] = high;
}

// One CTA per query tile. Shared memory: the tile's mean query [Hq, D] fp32, a score per page and
// a chosen flag per page.
// Scores: one warp per page, lanes over dimensions, summed over q heads. Top-k: k rounds of a
// CTA-wide argmax (ties to the lower page, NaN ranks last, as in the CPU reference). Output:
// the chosen pages in increasing order, then -1.
template <typename Element>
__global__ void page_select_kernel(const PageSelectParams params) {
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const PagedAttentionShape& shape = params.shape;
  const int num_pages = history_page_count(shape);
  const int head_dim = shape.head_dim;
  const int num_q_heads = shape.num_q_heads;
  const int group = num_q_heads / shape.num_kv_heads;
  float* mean_query = reinterpret_cast<float*>(shared_raw);   // [Hq, D]
  float* scores = mean_query + num_q_heads * head_dim;          // [num_pages]
  unsigned char* chosen = reinterpret_cast<unsigned char*>(scores + num_pages);  // [num_pages]
  __shared__ float best_score[32];
  __shared__ int best_page[32];
  __shared__ int chosen_count;

  const int tile = blockIdx.x;
  const int thread = threadIdx.x;
  const int lane = thread % 32;
  const int warp = thread / 32;
  const int num_warps = blockDim.x / 32;
  const int begin = tile * params.query_tile_tokens;
  const int end = min(shape.chunk_tokens, begin + params.query_tile_tokens);
  const Element* q = static_cast<const Element*>(params.q);
  for (int index = thread; index < num_q_heads * head_dim; index += blockDim.x) {
    float sum = 0.f;
    for (int token = begin; token < end; ++token) {
      sum += ElementTraits<Element>::to_float(q[int64_t(token) * num_q_heads * head_dim + index]);
    }
    mean_query[index] = sum / float(end - begin);
  }
  __syncthreads();

  for (int page = warp; page < num_pages; page += num_warps) {
    float score = 0.f;
    for (int head = 0; head < num_q_heads; ++head) {
      const int64_t summary = (int64_t(page) * shape.num_kv_heads + head / group) * head_dim;
      const float* query = mean_query + head * head_dim;
      for (int d = lane; d < head_dim; d += 32) {
        if (params.use_bounds) {
          score += fmaxf(query[d] * params.min[summary + d], query[d] * params.max[summary + d]);
        } else {
          score += query[d] * params.mean[summary + d];
        }
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) score += __shfl_xor_sync(0xffffffffu, score, offset);
    if (lane == 0) {
      scores[page] = isnan(score) ? -INFINITY : score;
      chosen[page] = 0;
    }
  }
  __syncthreads();

  const int keep = min(params.top_k, num_pages);
  if (keep == num_pages) {
    for (int page = thread; page < num_pages; page += blockDim.x) chosen[page] = 1;
  } else {
    for (int round = 0; round < keep; ++round) {
      float score = -INFINITY;
      int page_of_score = num_pages;  // "none", ranks below every real page
      for (int page = thread; page < num_pages; page += blockDim.x) {
        if (chosen[page]) continue;
        const float candidate = scores[page];
        if (page_of_score == num_pages || candidate > score || (candidate == score && page < page_of_score)) {
          score = candidate;
          page_of_score = page;
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        const float other_score = __shfl_xor_sync(0xffffffffu, score, offset);
        const int other_page = __shfl_xor_sync(0xffffffffu, page_of_score, offset);
        if (other_page != num_pages &&
            (page_of_score == num_pages || other_score > score || (other_score == score && other_page < page_of_score))) {
          score = other_score;
          page_of_score = other_page;
        }
      }
      if (lane == 0) {
        best_score[warp] = score;
        best_page[warp] = page_of_score;
      }
      __syncthreads();
      if (thread == 0) {
        float winner_score = best_score[0];
        int winner = best_page[0];
        for (int w = 1; w < num_warps; ++w) {
          if (best_page[w] != num_pages &&
              (winner == num_pages || best_score[w] > winner_score || (best_score[w] == winner_score && best_page[w] < winner))) {
            winner_score = best_score[w];
            winner = best_page[w];
          }
        }
        chosen[winner] = 1;
      }
      __syncthreads();
    }
  }
  __syncthreads();

  // Chosen pages in increasing order (the first warp compacts 32 pages at a time), then -1.
  int32_t* selected = params.selected_pages + int64_t(tile) * params.top_k;
  if (warp == 0) {
    int count = 0;
    for (int start = 0; start < num_pages; start += 32) {
      const int page = start + lane;
      const bool take = page < num_pages && chosen[page];
      const unsigned mask = __ballot_sync(0xffffffffu, take);
      if (take) selected[count + __popc(mask & ((1u << lane) - 1u))] = page;
      count += __popc(mask);
    }
    if (lane == 0) chosen_count = count;
  }
  __syncthreads();
  for (int slot = chosen_count + thread; slot < params.top_k; slot += blockDim.x) selected[slot] = -1;
}

}  // namespace

int page_summary(const PageSummaryParams& params, void* stream) {
  // Only history_tokens, page_tokens, num_kv_heads, head_dim and dtype describe a summary.
  const PagedAttentionShape& shape = params.shape;
  if (shape.history_tokens < 0 || shape.page_tokens < 1 || shape.num_kv_heads < 1 || shape.head_dim < 1 ||
      shape.head_dim > 1024 || params.mean == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (shape.dtype != DType::kBFloat16 && shape.dtype != DType::kFloat16) return cudaErrorInvalidValue;
  const int num_pages = history_page_count(shape);
  if (num_pages == 0) return cudaSuccess;
  if (params.k_pool == nullptr || params.k_page_index == nullptr) return cudaErrorInvalidValue;
  const dim3 grid(num_pages, shape.num_kv_heads);
  const int threads = (shape.head_dim + 31) / 32 * 32;
  cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  if (shape.dtype == DType::kBFloat16) {
    page_summary_kernel<__nv_bfloat16><<<grid, threads, 0, cuda_stream>>>(params);
  } else {
    page_summary_kernel<__half><<<grid, threads, 0, cuda_stream>>>(params);
  }
  return cudaGetLastError();
}

int page_select(const PageSelectParams& params, void* stream) {
  const PagedAttentionShape& shape = params.shape;
  if (paged_attention_check_shape(shape)[0] != '\0') return cudaErrorInvalidValue;
  if (shape.dtype != DType::kBFloat16 && shape.dtype != DType::kFloat16) return cudaErrorInvalidValue;
  if (params.top_k < 1 || params.query_tile_tokens < 1 || params.q == nullptr || params.selected_pages == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int num_pages = history_page_count(shape);
  if (num_pages > page_select_max_pages(shape)) return cudaErrorInvalidValue;
  if (num_pages > 0 && (params.use_bounds ? (params.min == nullptr || params.max == nullptr) : params.mean == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const size_t shared_bytes = size_t(shape.num_q_heads) * shape.head_dim * 4 + size_t(num_pages) * 5;
  const int num_tiles = num_query_tiles(shape.chunk_tokens, params.query_tile_tokens);
  cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  auto launch = [&](auto kernel) {
    cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
    if (error != cudaSuccess) return error;
    kernel<<<num_tiles, 256, shared_bytes, cuda_stream>>>(params);
    return cudaGetLastError();
  };
  if (shape.dtype == DType::kBFloat16) return launch(page_select_kernel<__nv_bfloat16>);
  return launch(page_select_kernel<__half>);
}

}  // namespace membar::kernels::cuda
