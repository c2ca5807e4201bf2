// Additions to membar/kernels/attention.h that only the CUDA attention kernels, their bindings
// and their tests need. Torch-free and CUDA-free (no CUDA include), like the contract header.
//
// What the CUDA kernels support, on top of paged_attention_check_shape:
//   dtype bf16 or fp16; head_dim 64 or 128; page_tokens 64 or 128; in sparse mode a
//   query_tile_tokens that is a multiple of 64 (a query tile must hold whole 64-row blocks,
//   because every block of queries reads one selection row); 16-byte aligned tensors.
#pragma once

#include <cstddef>
#include <cstdint>

#include "membar/kernels/attention.h"

namespace membar::kernels::cuda {

// Queries per block of the backward kernels and the granularity of a sparse query tile.
inline constexpr int32_t kQueryBlockTokens = 64;

// Returns an empty string when the CUDA kernels support `shape` (and `selection`, which may be
// disabled), else a sentence saying what is not supported. Checks the shape only; pointers are
// checked by paged_attention_check_pointers.
const char* paged_attention_cuda_check(const PagedAttentionShape& shape, const PageSelection& selection);

// Returns an empty string when every non-null pointer is 16-byte aligned (the kernels copy
// 16-byte pieces), else a sentence naming the first misaligned one.
const char* paged_attention_check_alignment(const void* const* pointers, const char* const* names, int count);

// Page select keeps one score per history page in shared memory: the largest history (in pages)
// it accepts for a given number of q heads and head_dim.
int64_t page_select_max_pages(const PagedAttentionShape& shape);

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
  int32_t num_chunk_blocks;
};

// Compiled variants of the bf16, head_dim 128 kernels, picked at run time by
// MEMBAR_ATTENTION_FORWARD_VARIANT / MEMBAR_ATTENTION_BACKWARD_VARIANT = <name> (Note [Forward
// variants] in attention_forward.cu, Note [Backward variants] in attention_backward.cu). A name
// that is not listed makes the launch fail with cudaErrorInvalidValue; a variant that does not
// apply to a call (e.g. 128-key blocks with pages of 64) leaves that call to the default layout.
// forward_variant_name(i) is null outside [0, forward_variant_count()).
int forward_variant_count();
const char* forward_variant_name(int index);
const char* forward_default_variant();
int backward_variant_count();
const char* backward_variant_name(int index);
const char* backward_default_variant();

// The deterministic backward's dQ pass (attention_backward_dq.cu): one CTA per 64 queries and q
// head recomputes P and dS over the tile's keys and writes dQ once, with no atomics.
// delta: [Hq, Tc] fp32, rowsum(dO * O). Enqueues on `stream`; returns a cudaError_t value.
int launch_backward_dq(const PagedAttentionBackwardParams& params, const float* delta, void* stream);

}  // namespace membar::kernels::cuda
