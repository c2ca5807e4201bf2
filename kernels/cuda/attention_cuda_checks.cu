// Host-side checks, the device a layout is chosen for, and the backward workspace layout of the
// CUDA attention kernels.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "attention_cuda_internal.h"
#include "membar/kernels/attention_cuda.h"

namespace membar::kernels::cuda {

const char* paged_attention_cuda_check(const PagedAttentionShape& shape, const PageSelection& selection) {
  if (!cuda_dtype_supported(shape.dtype)) return "the CUDA attention kernels take bfloat16 or float16 tensors.";
  if (!cuda_head_dim_supported(shape.head_dim)) {
    static thread_local char message[120];
    snprintf(message, sizeof(message), "the CUDA attention kernels support head_dim 64, 96, 128 or 256 (got %d).",
             int(shape.head_dim));
    return message;
  }
  if (shape.page_tokens != 64 && shape.page_tokens != 128) {
    return "the CUDA attention kernels support page_tokens 64 or 128.";
  }
  if (selection.enabled()) {
    if (shape.sliding_window > 0) return "a sliding window cannot be combined with a sparse page selection.";
    if (selection.selected_per_tile < 1) return "a sparse selection must list at least one page per tile.";
    if (selection.query_tile_tokens < kQueryBlockTokens || selection.query_tile_tokens % kQueryBlockTokens != 0) {
      return "the CUDA attention kernels need query_tile_tokens to be a multiple of 64.";
    }
    // The compacted selection of a tile lives in shared memory next to the tiles.
    static_assert(kMaxSelectedPerTile == 8192, "the sentence below names the limit");
    if (selection.selected_per_tile > kMaxSelectedPerTile) {
      return "the CUDA attention kernels accept at most 8192 selected pages per tile.";
    }
  }
  return "";
}

const char* paged_attention_check_alignment(const void* const* pointers, const char* const* names, int count) {
  static thread_local char message[160];
  for (int i = 0; i < count; ++i) {
    if (pointers[i] != nullptr && reinterpret_cast<uintptr_t>(pointers[i]) % 16 != 0) {
      snprintf(message, sizeof(message), "%s must be 16-byte aligned for the CUDA attention kernels.", names[i]);
      return message;
    }
  }
  return "";
}

CudaTarget current_cuda_target() {
  CudaTarget target;
#if defined(MEMBAR_WGMMA_BUILT)
  target.warpgroup_kernels = true;  // the architecture list held sm_90a (kernels/CMakeLists.txt)
#endif
  int device = 0;
  int major = 0;
  int minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    return target;
  }
  target.compute_capability = 10 * major + minor;
  return target;
}

int64_t page_select_max_pages(const PagedAttentionShape& shape) {
  // Shared memory: the tile's mean query per head (fp32) plus one score and one flag per page,
  // inside the 227 KiB a Hopper CTA may use.
  const int64_t budget = 227 * 1024 - int64_t(shape.num_q_heads) * shape.head_dim * 4 - 1024;
  return budget > 0 ? budget / 5 : 0;
}

BackwardWorkspaceLayout backward_workspace_layout(const PagedAttentionShape& shape) {
  auto round_up = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  BackwardWorkspaceLayout layout;
  const size_t chunk = size_t(shape.chunk_tokens);
  const size_t pages = size_t(shape.num_history_pages());
  layout.inverse_tiles_capacity = (shape.chunk_tokens + kQueryBlockTokens - 1) / kQueryBlockTokens;
  size_t offset = 0;
  layout.dq_accumulator_offset = offset;
  offset += round_up(chunk * size_t(shape.num_q_heads) * size_t(shape.head_dim) * 4);
  layout.delta_offset = offset;
  offset += round_up(size_t(shape.num_q_heads) * chunk * 4);
  layout.inverse_count_offset = offset;
  offset += round_up(pages * 4);
  layout.inverse_tiles_offset = offset;
  offset += round_up(pages * size_t(layout.inverse_tiles_capacity) * 4);
  layout.total_bytes = offset;
  return layout;
}

size_t paged_attention_backward_workspace_bytes(const PagedAttentionShape& shape) {
  return backward_workspace_layout(shape).total_bytes;
}

}  // namespace membar::kernels::cuda
