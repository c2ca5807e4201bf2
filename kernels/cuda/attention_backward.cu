// Paged attention backward on CUDA: the dispatch to the shipped dK/dV layouts (attention_tiles.cuh;
// Note [Layout choice] in membar/kernels/attention_cuda.h) and the passes around them (delta, the
// inverse selection, dQ). The dK/dV kernels are attention_backward_kernel.cuh (Note [Backward kernel])
// and, on Hopper, attention_backward_wgmma.cuh (Note [Warpgroup backward]); docs/kernels.md says why
// these layouts won.
#include <cuda_runtime.h>

#include <cmath>

#include "attention_backward_kernel.cuh"
#include "attention_backward_wgmma.cuh"
#include "attention_backward_wgmma_ws.cuh"
#include "attention_backward_wgmma_d2.cuh"
#include "attention_common.cuh"
#include "attention_cuda_internal.h"
#include "attention_tiles.cuh"

namespace membar::kernels::cuda {

namespace detail {
namespace {

// delta[h, i] = sum_d dO[i, h, d] * O[i, h, d] in fp32; one warp per (i, h). [Hq, Tc].
template <typename Element>
__global__ void backward_delta_kernel(const Element* out, const Element* dout, float* delta, int chunk_tokens,
                                      int num_q_heads, int head_dim) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= int64_t(chunk_tokens) * num_q_heads) return;
  const Element* o_row = out + row * head_dim;
  const Element* do_row = dout + row * head_dim;
  float sum = 0.f;
  for (int column = 2 * lane; column < head_dim; column += 64) {
    const float2 o = ElementTraits<Element>::unpack(*reinterpret_cast<const uint32_t*>(o_row + column));
    const float2 d = ElementTraits<Element>::unpack(*reinterpret_cast<const uint32_t*>(do_row + column));
    sum += o.x * d.x + o.y * d.y;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) {
    const int token = int(row / num_q_heads);
    const int head = int(row % num_q_heads);
    delta[int64_t(head) * chunk_tokens + token] = sum;
  }
}

// For each history page, the query tiles whose selection lists it, in increasing tile order
// (so the backward's accumulation order, and its bits, do not depend on scheduling).
__global__ void build_inverse_selection_kernel(const int32_t* selected_pages, int selected_per_tile, int num_tiles,
                                               int num_pages, int32_t* inverse_count, int32_t* inverse_tiles,
                                               int capacity) {
  const int page = blockIdx.x * blockDim.x + threadIdx.x;
  if (page >= num_pages) return;
  int count = 0;
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int32_t* row = selected_pages + int64_t(tile) * selected_per_tile;
    for (int slot = 0; slot < selected_per_tile; ++slot) {
      if (row[slot] == page) {
        inverse_tiles[int64_t(page) * capacity + count++] = tile;
        break;
      }
    }
  }
  inverse_count[page] = count;
}

// dq = dq_accumulator * scale, converted to the element type; two elements per thread.
template <typename Element>
__global__ void convert_dq_kernel(const float* accumulator, Element* dq, int64_t count, float scale) {
  const int64_t index = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 2;
  if (index >= count) return;
  const float2 value = *reinterpret_cast<const float2*>(accumulator + index);
  *reinterpret_cast<uint32_t*>(dq + index) = ElementTraits<Element>::pack(value.x * scale, value.y * scale);
}

template <typename Element>
cudaError_t run_backward_typed(const PagedAttentionBackwardParams& params, KvLaunch kv, cudaStream_t stream,
                               DqPass dq_pass) {
  const PagedAttentionShape& shape = params.shape;
  const BackwardWorkspaceLayout layout = backward_workspace_layout(shape);
  unsigned char* base = static_cast<unsigned char*>(params.workspace);
  float* delta = reinterpret_cast<float*>(base + layout.delta_offset);
  BackwardWorkspacePointers workspace;
  workspace.dq_accumulator = params.deterministic ? nullptr : reinterpret_cast<float*>(base + layout.dq_accumulator_offset);
  workspace.delta = delta;
  workspace.inverse_count = reinterpret_cast<const int32_t*>(base + layout.inverse_count_offset);
  workspace.inverse_tiles = reinterpret_cast<const int32_t*>(base + layout.inverse_tiles_offset);
  workspace.inverse_capacity = layout.inverse_tiles_capacity;
  workspace.num_chunk_blocks = 0;  // set by the dK/dV launch for its keys per CTA

  const int64_t rows = int64_t(shape.chunk_tokens) * shape.num_q_heads;
  backward_delta_kernel<Element><<<unsigned((rows + 7) / 8), 256, 0, stream>>>(
      static_cast<const Element*>(params.out), static_cast<const Element*>(params.dout), delta, shape.chunk_tokens,
      shape.num_q_heads, shape.head_dim);
  const int num_pages = history_page_count(shape);
  if ((params.selection.selected_pages != nullptr) && num_pages > 0) {
    const int num_tiles = num_query_tiles(shape.chunk_tokens, params.selection.query_tile_tokens);
    build_inverse_selection_kernel<<<(num_pages + 127) / 128, 128, 0, stream>>>(
        params.selection.selected_pages, params.selection.selected_per_tile, num_tiles, num_pages,
        const_cast<int32_t*>(workspace.inverse_count), const_cast<int32_t*>(workspace.inverse_tiles),
        layout.inverse_tiles_capacity);
  }
  const int64_t dq_elements = rows * shape.head_dim;
  cudaError_t error = cudaSuccess;
  if (!params.deterministic) {
    error = cudaMemsetAsync(workspace.dq_accumulator, 0, size_t(dq_elements) * 4, stream);
    if (error != cudaSuccess) return error;
  }
  error = kv(params, workspace, stream);
  if (error != cudaSuccess) return error;
  if (params.deterministic) return static_cast<cudaError_t>(launch_backward_dq(params, delta, stream, dq_pass));
  convert_dq_kernel<Element><<<unsigned((dq_elements / 2 + 255) / 256), 256, 0, stream>>>(
      workspace.dq_accumulator, static_cast<Element*>(params.dq), dq_elements, shape.softmax_scale);
  return cudaGetLastError();
}


}  // namespace

cudaError_t run_backward(const PagedAttentionBackwardParams& params, KvLaunch kv, cudaStream_t stream, DqPass dq_pass) {
  if (params.shape.dtype == DType::kBFloat16) return run_backward_typed<__nv_bfloat16>(params, kv, stream, dq_pass);
  return run_backward_typed<__half>(params, kv, stream, dq_pass);
}

}  // namespace detail

namespace {

// The dK/dV launch of `layout` for one (dtype, head_dim), capped or not (kSoftcap); only the
// layouts the library compiles for it (backward_layout_compiled) are instantiated, each with and
// without a cap; the others give nullptr.
template <typename Element, int kHeadDim, bool kSoftcap>
detail::KvLaunch layout_launch(BackwardLayout layout) {
  constexpr DType kDType = detail::ElementTraits<Element>::kDType;
  switch (layout) {
    case BackwardLayout::kMmaSplitK128S2:
      if constexpr (backward_layout_compiled(BackwardLayout::kMmaSplitK128S2, kDType, kHeadDim)) {
        return &detail::launch_kv_split<Element, kHeadDim, layouts::MmaSplitK128S2, kSoftcap>;
      }
      break;
    case BackwardLayout::kMmaW8K128:
      if constexpr (backward_layout_compiled(BackwardLayout::kMmaW8K128, kDType, kHeadDim)) {
        return &detail::launch_kv<Element, kHeadDim, layouts::MmaW8K128, kSoftcap>;
      }
      break;
    case BackwardLayout::kMmaW4K64:
      if constexpr (backward_layout_compiled(BackwardLayout::kMmaW4K64, kDType, kHeadDim)) {
        return &detail::launch_kv<Element, kHeadDim, layouts::MmaW4K64, kSoftcap>;
      }
      break;
    case BackwardLayout::kMmaW4K64Padded:
      if constexpr (backward_layout_compiled(BackwardLayout::kMmaW4K64Padded, kDType, kHeadDim)) {
        return &detail::launch_kv<Element, kHeadDim, layouts::MmaW4K64Padded, kSoftcap>;
      }
      break;
    case BackwardLayout::kMmaW4K64S2Halves:
      if constexpr (backward_layout_compiled(BackwardLayout::kMmaW4K64S2Halves, kDType, kHeadDim)) {
        return &detail::launch_kv<Element, kHeadDim, layouts::MmaW4K64S2Halves, kSoftcap>;
      }
      break;
    case BackwardLayout::kWgmmaW8K128:
      if constexpr (backward_layout_compiled(BackwardLayout::kWgmmaW8K128, kDType, kHeadDim)) {
        return &detail::warpgroup::launch_backward_kv<Element, kHeadDim, kSoftcap>;
      }
      break;
    case BackwardLayout::kWgmmaWsW12K128:
      if constexpr (backward_layout_compiled(BackwardLayout::kWgmmaWsW12K128, kDType, kHeadDim)) {
        return &detail::warpgroup::launch_backward_kv_ws<Element, kHeadDim, kSoftcap>;
      }
      break;
    case BackwardLayout::kWgmmaW8K64D2:
      if constexpr (backward_layout_compiled(BackwardLayout::kWgmmaW8K64D2, kDType, kHeadDim)) {
        return &detail::warpgroup::launch_backward_kv_d2<Element, kHeadDim, kSoftcap>;
      }
      break;
    case BackwardLayout::kAuto:
      break;
  }
  return nullptr;
}

template <typename Element, bool kSoftcap>
detail::KvLaunch layout_launch_for_head_dim(BackwardLayout layout, int32_t head_dim) {
  switch (head_dim) {
    case 64: return layout_launch<Element, 64, kSoftcap>(layout);
    case 96: return layout_launch<Element, 96, kSoftcap>(layout);
    case 128: return layout_launch<Element, 128, kSoftcap>(layout);
    case 256: return layout_launch<Element, 256, kSoftcap>(layout);
  }
  return nullptr;
}

template <bool kSoftcap>
detail::KvLaunch layout_launch_for_shape(BackwardLayout layout, const PagedAttentionShape& shape) {
  if (shape.dtype == DType::kBFloat16) {
    return layout_launch_for_head_dim<__nv_bfloat16, kSoftcap>(layout, shape.head_dim);
  }
  return layout_launch_for_head_dim<__half, kSoftcap>(layout, shape.head_dim);
}

}  // namespace

int backward_params_check(const PagedAttentionBackwardParams& params) {
  const PagedAttentionShape& shape = params.shape;
  if (paged_attention_check_shape(shape)[0] != '\0') return cudaErrorInvalidValue;
  if (paged_attention_cuda_check(shape, params.selection)[0] != '\0') return cudaErrorInvalidValue;
  if (params.grad_page_dtype != DType::kFloat32 && params.grad_page_dtype != DType::kBFloat16) {
    return cudaErrorInvalidValue;
  }
  const void* pointers[] = {params.q,       params.k_chunk,  params.v_chunk,  params.history.k_pool,
                            params.history.v_pool, params.out, params.dout, params.dq,
                            params.dk_chunk, params.dv_chunk, params.workspace, params.grad_history.dk_pool,
                            params.grad_history.dv_pool};
  const char* names[] = {"q",  "k_chunk", "v_chunk",  "k_pool",   "v_pool",    "out",    "dout",
                         "dq", "dk_chunk", "dv_chunk", "workspace", "dk_pool", "dv_pool"};
  if (paged_attention_check_alignment(pointers, names, 13)[0] != '\0') return cudaErrorInvalidValue;
  const void* required[] = {params.q, params.out, params.dout, params.lse, params.dq, params.workspace};
  for (const void* pointer : required) {
    if (pointer == nullptr) return cudaErrorInvalidValue;
  }
  if (shape.attend_chunk) {
    const void* chunk_required[] = {params.k_chunk, params.v_chunk, params.dk_chunk, params.dv_chunk};
    for (const void* pointer : chunk_required) {
      if (pointer == nullptr) return cudaErrorInvalidValue;
    }
  }
  if (shape.history_tokens > 0) {
    const void* history_required[] = {params.history.k_pool, params.history.v_pool, params.grad_history.dk_pool,
                                      params.grad_history.dv_pool};
    for (const void* pointer : history_required) {
      if (pointer == nullptr) return cudaErrorInvalidValue;
    }
    if (params.history.k_page_index == nullptr || params.history.v_page_index == nullptr ||
        params.grad_history.dk_page_index == nullptr || params.grad_history.dv_page_index == nullptr) {
      return cudaErrorInvalidValue;
    }
  }
  return cudaSuccess;
}

int paged_attention_backward(const PagedAttentionBackwardParams& params, void* stream, const CudaOptions& options) {
  const int error = backward_params_check(params);
  if (error != cudaSuccess) return error;
  const BackwardLayout layout = resolve_backward_layout(options.backward_layout, current_cuda_target(),
                                                        layout_query(params.shape, params.selection));
  // A cap runs the same layout's capped instantiation (Note [Soft-capped scores in raw units] in
  // attention_common.cuh); launch_backward_dq picks its own for the deterministic dQ pass.
  const detail::KvLaunch kv = params.shape.logit_softcap > 0.f ? layout_launch_for_shape<true>(layout, params.shape)
                                                               : layout_launch_for_shape<false>(layout, params.shape);
  // resolve_backward_layout only returns compiled layouts: a missing launch is a bug.
  if (kv == nullptr) return cudaErrorInvalidValue;
  return detail::run_backward(params, kv, static_cast<cudaStream_t>(stream), options.dq_pass);
}

}  // namespace membar::kernels::cuda
