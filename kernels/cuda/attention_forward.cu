// Paged attention forward on CUDA: the dispatch to the shipped layouts (attention_tiles.cuh; Note
// [Layout choice] in membar/kernels/attention_cuda.h). The mma.sync kernel is
// attention_forward_kernel.cuh, the warpgroup (wgmma) one attention_forward_wgmma.cuh;
// docs/kernels.md says why these layouts won.
#include <cuda_runtime.h>

#include "attention_cuda_internal.h"
#include "attention_tiles.cuh"

namespace membar::kernels::cuda {
namespace {

// Launches `layout` for one (dtype, head_dim), capped or not (kSoftcap); only the layouts the
// library compiles for it (forward_layout_compiled) are instantiated, each with and without a cap.
template <typename Element, int kHeadDim, bool kSoftcap>
cudaError_t launch_layout(ForwardLayout layout, const PagedAttentionForwardParams& params, cudaStream_t stream) {
  constexpr DType kDType = detail::ElementTraits<Element>::kDType;
  switch (layout) {
    case ForwardLayout::kWgmmaW8R64K128S2:
      if constexpr (forward_layout_compiled(ForwardLayout::kWgmmaW8R64K128S2, kDType, kHeadDim)) {
        return detail::warpgroup::launch_forward<Element, kHeadDim, layouts::WgmmaW8R64K128S2, kSoftcap>(
            params, stream);
      }
      break;
    case ForwardLayout::kWgmmaW8R64K64S3:
      if constexpr (forward_layout_compiled(ForwardLayout::kWgmmaW8R64K64S3, kDType, kHeadDim)) {
        return detail::warpgroup::launch_forward<Element, kHeadDim, layouts::WgmmaW8R64K64S3, kSoftcap>(params, stream);
      }
      break;
    case ForwardLayout::kWgmmaW8R64K64S3TwoCtas:
      if constexpr (forward_layout_compiled(ForwardLayout::kWgmmaW8R64K64S3TwoCtas, kDType, kHeadDim)) {
        return detail::warpgroup::launch_forward<Element, kHeadDim, layouts::WgmmaW8R64K64S3TwoCtas, kSoftcap>(
            params, stream);
      }
      break;
    case ForwardLayout::kWgmmaW8R64K64S2:
      if constexpr (forward_layout_compiled(ForwardLayout::kWgmmaW8R64K64S2, kDType, kHeadDim)) {
        return detail::warpgroup::launch_forward<Element, kHeadDim, layouts::WgmmaW8R64K64S2, kSoftcap>(params, stream);
      }
      break;
    case ForwardLayout::kWgmmaWsW12R64K128S2:
      if constexpr (forward_layout_compiled(ForwardLayout::kWgmmaWsW12R64K128S2, kDType, kHeadDim)) {
        return detail::warpgroup_ws::launch_forward<Element, kHeadDim, layouts::WgmmaWsW12R64K128S2, kSoftcap>(
            params, stream);
      }
      break;
    case ForwardLayout::kMmaW8R16K128S3:
      if constexpr (forward_layout_compiled(ForwardLayout::kMmaW8R16K128S3, kDType, kHeadDim)) {
        return detail::launch_forward<Element, kHeadDim, layouts::MmaW8R16K128S3, kSoftcap>(params, stream);
      }
      break;
    case ForwardLayout::kMmaW8R16K64S3:
      if constexpr (forward_layout_compiled(ForwardLayout::kMmaW8R16K64S3, kDType, kHeadDim)) {
        return detail::launch_forward<Element, kHeadDim, layouts::MmaW8R16K64S3, kSoftcap>(params, stream);
      }
      break;
    case ForwardLayout::kMmaW4R16K64S3:
      if constexpr (forward_layout_compiled(ForwardLayout::kMmaW4R16K64S3, kDType, kHeadDim)) {
        return detail::launch_forward<Element, kHeadDim, layouts::MmaW4R16K64S3, kSoftcap>(params, stream);
      }
      break;
    case ForwardLayout::kMmaW4R16K64S2:
      if constexpr (forward_layout_compiled(ForwardLayout::kMmaW4R16K64S2, kDType, kHeadDim)) {
        return detail::launch_forward<Element, kHeadDim, layouts::MmaW4R16K64S2, kSoftcap>(params, stream);
      }
      break;
    case ForwardLayout::kMmaW4R16K128S1:
      if constexpr (forward_layout_compiled(ForwardLayout::kMmaW4R16K128S1, kDType, kHeadDim)) {
        return detail::launch_forward<Element, kHeadDim, layouts::MmaW4R16K128S1, kSoftcap>(params, stream);
      }
      break;
    case ForwardLayout::kAuto:
      break;
  }
  // resolve_forward_layout only returns compiled layouts: reaching this is a bug.
  return cudaErrorInvalidValue;
}

template <typename Element, bool kSoftcap>
cudaError_t launch_head_dim(ForwardLayout layout, const PagedAttentionForwardParams& params, cudaStream_t stream) {
  switch (params.shape.head_dim) {
    case 64: return launch_layout<Element, 64, kSoftcap>(layout, params, stream);
    case 96: return launch_layout<Element, 96, kSoftcap>(layout, params, stream);
    case 128: return launch_layout<Element, 128, kSoftcap>(layout, params, stream);
    case 256: return launch_layout<Element, 256, kSoftcap>(layout, params, stream);
  }
  return cudaErrorInvalidValue;  // paged_attention_cuda_check refused it before
}

template <bool kSoftcap>
cudaError_t launch_dtype(ForwardLayout layout, const PagedAttentionForwardParams& params, cudaStream_t stream) {
  if (params.shape.dtype == DType::kBFloat16) return launch_head_dim<__nv_bfloat16, kSoftcap>(layout, params, stream);
  return launch_head_dim<__half, kSoftcap>(layout, params, stream);
}

}  // namespace

int forward_params_check(const PagedAttentionForwardParams& params) {
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
  return cudaSuccess;
}

int paged_attention_forward(const PagedAttentionForwardParams& params, void* stream, const CudaOptions& options) {
  const int error = forward_params_check(params);
  if (error != cudaSuccess) return error;
  const ForwardLayout layout = resolve_forward_layout(options.forward_layout, current_cuda_target(),
                                                      layout_query(params.shape, params.selection));
  cudaStream_t cuda_stream = static_cast<cudaStream_t>(stream);
  // A cap runs the same layout's capped instantiation (Note [Soft-capped scores in raw units] in
  // attention_common.cuh).
  if (params.shape.logit_softcap > 0.f) return launch_dtype<true>(layout, params, cuda_stream);
  return launch_dtype<false>(layout, params, cuda_stream);
}

}  // namespace membar::kernels::cuda
