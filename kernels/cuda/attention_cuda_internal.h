// Pieces of the CUDA attention kernels that only kernels/cuda/, kernels/sweep/ and their tests
// use. Torch-free and CUDA-free (no CUDA include), like the contract headers
// membar/kernels/attention.h and membar/kernels/attention_cuda.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "membar/kernels/attention.h"
#include "membar/kernels/attention_cuda.h"

namespace membar::kernels::cuda {

// Queries per block of the backward kernels and the granularity of a sparse query tile.
inline constexpr int32_t kQueryBlockTokens = 64;
// Selected pages of one sparse tile at most: a tile's compacted selection lives in shared memory
// beside the kernels' tiles (4 bytes a page).
inline constexpr int32_t kMaxSelectedPerTile = 8192;

// The backward workspace, carved from the caller's buffer in this order (each piece 256-byte
// aligned): dQ accumulator fp32 [Tc, Hq, D]; delta = rowsum(dO * O) fp32 [Hq, Tc];
// per history page the number of query tiles that selected it, int32 [num_history_pages];
// and their list, int32 [num_history_pages, ceil(Tc / 64)].
struct BackwardWorkspaceLayout {
  size_t dq_accumulator_offset = 0;
  size_t delta_offset = 0;
  size_t inverse_count_offset = 0;
  size_t inverse_tiles_offset = 0;
  size_t total_bytes = 0;
  int32_t inverse_tiles_capacity = 0;  // ceil(Tc / 64): the most query tiles any selection has
};
BackwardWorkspaceLayout backward_workspace_layout(const PagedAttentionShape& shape);

// The backward workspace as the dK/dV kernels see it (pointers into the layout above).
struct BackwardWorkspacePointers {
  float* dq_accumulator;          // [Tc, Hq, D] fp32, or nullptr in deterministic mode
  const float* delta;             // [Hq, Tc]
  const int32_t* inverse_count;   // [num_history_pages], sparse only
  const int32_t* inverse_tiles;   // [num_history_pages, inverse_capacity], sparse only
  int32_t inverse_capacity;
  // CTAs that own the chunk's keys (none without attend_chunk: dk_chunk/dv_chunk stay untouched);
  // each dK/dV launch sets it for its keys per CTA (chunk_owner_count).
  int32_t num_chunk_blocks;
};

// The launch functions' checks of their params (shape, support, alignment, required pointers):
// cudaSuccess, or cudaErrorInvalidValue (as an int) before anything is enqueued.
int forward_params_check(const PagedAttentionForwardParams& params);
int backward_params_check(const PagedAttentionBackwardParams& params);

// The deterministic backward's dQ pass (attention_backward_dq.cu): one CTA per 64 queries (128 in
// the warp-specialised pass) and q head recomputes P and dS over the tile's keys and writes dQ
// once, with no atomics. delta: [Hq, Tc] fp32, rowsum(dO * O). `pass`: CudaOptions::dq_pass.
// Enqueues on `stream`; returns a cudaError_t value.
int launch_backward_dq(const PagedAttentionBackwardParams& params, const float* delta, void* stream,
                       DqPass pass = DqPass::kAuto);

}  // namespace membar::kernels::cuda
