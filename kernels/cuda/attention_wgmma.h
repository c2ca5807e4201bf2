// The Hopper (wgmma) forward of attention_forward_wgmma.cu (Note [Warpgroup forward]) and backward
// of attention_backward_wgmma.cu, as launch/applies pairs for the variant tables of
// attention_forward.cu and attention_backward.cu. CUDA runtime types only.
#pragma once

#include <cuda_runtime.h>

#include "attention_cuda_internal.h"
#include "membar/kernels/attention.h"

namespace membar::kernels::cuda {

// Two warpgroups of 64 query rows per CTA, one CTA per SM: 64-key blocks in three stages, or
// 128-key blocks in two. (Two CTAs per SM with 64-key blocks in two stages spilled at 128
// registers a thread.)
cudaError_t launch_forward_wgmma_k64_s3(const PagedAttentionForwardParams& params, cudaStream_t stream);
cudaError_t launch_forward_wgmma_k128_s2(const PagedAttentionForwardParams& params, cudaStream_t stream);
// bf16, head_dim 128, key blocks inside a page, sparse tiles of whole CTAs, an sm_90 device.
bool forward_wgmma_k64_applies(const PagedAttentionForwardParams& params);
bool forward_wgmma_k128_applies(const PagedAttentionForwardParams& params);

// The Hopper dK/dV backward of attention_backward_wgmma.cu (Note [Warpgroup backward]): one CTA
// of two warpgroups per (128-key page, kv head), the work list, workspace and dQ atomics of
// Note [Backward split layout]. Enqueues on `stream`.
cudaError_t launch_backward_wgmma_w8_k128(const PagedAttentionBackwardParams& params,
                                          const BackwardWorkspacePointers& workspace, cudaStream_t stream);
// bf16, head_dim 128, pages of 128 keys, an sm_90 device with the sm_90a body built.
bool backward_wgmma_w8_k128_applies(const PagedAttentionBackwardParams& params);

}  // namespace membar::kernels::cuda
