// Device pieces of the dK/dV kernels of attention_backward.cu (Note [Backward kernel]) that the
// Hopper backward (attention_backward_wgmma.cuh) shares: the work list of a CTA, its items' queries
// and row statistics (also read by the deterministic dQ passes), the keys it owns and the epilogue
// that writes or ADDS its dK/dV. Moved verbatim out of attention_backward.cu.
// Internal to kernels/cuda/.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attention_common.cuh"
#include "attention_cuda_internal.h"

namespace membar::kernels::cuda::detail {

inline constexpr int kQueries = kQueryBlockTokens;

// The (q head, query block) pairs a KV block attends to, numbered 0..count-1.
struct WorkList {
  int count;
  int per_head;           // pairs per q head
  int first_query_block;  // chunk blocks: the first query block; else 0
  const int32_t* tiles;   // sparse history: the tiles that selected the page
  int blocks_per_tile;    // sparse history: query blocks per selection tile

  __device__ __forceinline__ void decode(int item, int& head_in_group, int& query_block) const {
    head_in_group = item / per_head;
    const int rest = item % per_head;
    if (tiles != nullptr) {
      query_block = tiles[rest / blocks_per_tile] * blocks_per_tile + rest % blocks_per_tile;
    } else {
      query_block = first_query_block + rest;
    }
  }
};

// Work item `item` of a dK/dV CTA: its q head (of the CTA's kv head, `group` q heads a kv head), its
// first query row and where row first_query of that head starts in Q and dO (rows q_row_stride
// apart). The kernels pass what they already hold, so that nothing is recomputed from the params
// (the mma.sync kernels at 255 registers spill more otherwise).
struct WorkItem {
  int q_head;
  int first_query;
  int64_t offset;
};

template <int kHeadDim>
__device__ __forceinline__ WorkItem work_item(const WorkList& work, int item, int kv_head, int group,
                                              int64_t q_row_stride) {
  int head_in_group, query_block;
  work.decode(item, head_in_group, query_block);
  WorkItem result;
  result.q_head = kv_head * group + head_in_group;
  result.first_query = query_block * kQueries;
  result.offset = int64_t(query_block) * kQueries * q_row_stride + int64_t(result.q_head) * kHeadDim;
  return result;
}

// lse (in log2 units) and delta of query row `position` of q head `q_head` (a chunk of
// chunk_tokens rows). Rows past the chunk get lse = +inf, so that P = 0; lse = -inf (the row sees
// no key, Note [Blocked history]) becomes +inf too.
__device__ __forceinline__ void query_row_statistics(const float* lse, const float* delta, int chunk_tokens,
                                                     int q_head, int position, float& row_lse, float& row_delta) {
  if (position < chunk_tokens) {
    const int64_t index = int64_t(q_head) * chunk_tokens + position;
    const float value = lse[index];
    row_lse = value == -INFINITY ? INFINITY : value * kLog2e;
    row_delta = delta[index];
  } else {
    row_lse = INFINITY;
    row_delta = 0.f;
  }
}

// Writes a thread's two rows of dQ, scaled by softmax_scale, from the accumulator layout of the
// deterministic dQ passes: row position[h] gets columns n * 8 + 2 (lane % 4) and the next one from
// dq[n][2 h] and dq[n][2 h + 1], for the first kHeadDim columns; rows past the chunk are skipped.
template <typename Element, int kHeadDim, int kTiles>
__device__ __forceinline__ void write_dq_rows(const PagedAttentionBackwardParams& params, const float (&dq)[kTiles][4],
                                              const int (&position)[2], int q_head, int lane) {
  static_assert(kTiles * 8 >= kHeadDim, "the accumulators hold every column");
  const PagedAttentionShape& shape = params.shape;
  const int64_t q_row_stride = int64_t(shape.num_q_heads) * kHeadDim;
  Element* dq_out = static_cast<Element*>(params.dq);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (position[half] >= shape.chunk_tokens) continue;
    Element* row = dq_out + int64_t(position[half]) * q_row_stride + int64_t(q_head) * kHeadDim;
#pragma unroll
    for (int n = 0; n < kHeadDim / 8; ++n) {
      const int column = n * 8 + 2 * (lane % 4);
      *reinterpret_cast<uint32_t*>(row + column) = ElementTraits<Element>::pack(
          dq[n][2 * half] * shape.softmax_scale, dq[n][2 * half + 1] * shape.softmax_scale);
    }
  }
}

// The keys one CTA of a dK/dV kernel owns (kKeys rows of one kv head: a history page, a part of
// one when kKeys < page_tokens, or a block of the chunk's own keys) and the (q head, query block)
// pairs that see them.
template <typename Element>
struct OwnedKeys {
  bool chunk_block;
  const Element* k_base;  // row r of the keys at k_base + r * kv_row_stride
  const Element* v_base;
  int valid_keys;         // may be 0 or less for the last part of a partial last page: no work
  int first_key;          // chunk blocks: chunk position of key row 0; history: its row in the page
  int page;               // history page (history blocks)
  WorkList work;
};

// The chunk-relative position of the owned keys' first row (history keys are negative).
template <typename Element>
__device__ __forceinline__ int owned_window_start(const PagedAttentionShape& shape, const OwnedKeys<Element>& owned) {
  return owned.chunk_block ? owned.first_key : owned.page * shape.page_tokens + owned.first_key - shape.history_tokens;
}

// The window edge of the owned keys (window_edge in attention_common.cuh): query row r of the chunk
// sees owned key row k iff k + edge > r; kNoWindowEdge without a window.
template <typename Element>
__device__ __forceinline__ int owned_window_edge(const PagedAttentionShape& shape, const OwnedKeys<Element>& owned) {
  return window_edge(shape, owned_window_start(shape, owned));
}

// CTAs own the chunk's blocks first (num_chunk_blocks of them), then every part of every history
// page: kKeys divides page_tokens (the layouts' fits check it).
template <int kKeys>
__host__ __device__ __forceinline__ int owner_count(const PagedAttentionShape& shape, int num_chunk_blocks) {
  return num_chunk_blocks + history_page_count(shape) * (shape.page_tokens / kKeys);
}

template <int kKeys>
__host__ __device__ __forceinline__ int chunk_owner_count(const PagedAttentionShape& shape) {
  return shape.attend_chunk ? (shape.chunk_tokens + kKeys - 1) / kKeys : 0;
}

// kPageParts: pages may be longer than kKeys (a CTA owns a part of one); false when every page
// holds exactly kKeys keys (the layouts' fits check it), which spares the kernels the arithmetic.
template <typename Element, int kHeadDim, int kKeys, bool kPageParts = false>
__device__ __forceinline__ OwnedKeys<Element> own_keys(const PagedAttentionBackwardParams& params,
                                                        const BackwardWorkspacePointers& workspace) {
  const PagedAttentionShape& shape = params.shape;
  const int kv_head = blockIdx.y;
  const int num_query_blocks = (shape.chunk_tokens + kQueries - 1) / kQueries;
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;
  OwnedKeys<Element> owned;
  owned.chunk_block = int(blockIdx.x) < workspace.num_chunk_blocks;
  owned.first_key = 0;
  owned.page = 0;
  owned.work = WorkList{0, 0, 0, nullptr, 1};
  if (owned.chunk_block) {
    owned.first_key = blockIdx.x * kKeys;
    owned.k_base = static_cast<const Element*>(params.k_chunk) + owned.first_key * kv_row_stride + kv_head * kHeadDim;
    owned.v_base = static_cast<const Element*>(params.v_chunk) + owned.first_key * kv_row_stride + kv_head * kHeadDim;
    owned.valid_keys = min(kKeys, shape.chunk_tokens - owned.first_key);
    owned.work.first_query_block = owned.first_key / kQueries;
    owned.work.per_head = num_query_blocks - owned.work.first_query_block;
  } else {
    const int owner = blockIdx.x - workspace.num_chunk_blocks;
    if constexpr (kPageParts) {
      const int parts_per_page = shape.page_tokens / kKeys;
      owned.page = owner / parts_per_page;
      owned.first_key = (owner % parts_per_page) * kKeys;
    } else {
      owned.page = owner;
    }
    const int64_t first_row = owned.first_key;
    owned.k_base = static_cast<const Element*>(params.history.k_pool) +
                   (int64_t(params.history.k_page_index[owned.page]) * shape.page_tokens + first_row) * kv_row_stride +
                   kv_head * kHeadDim;
    owned.v_base = static_cast<const Element*>(params.history.v_pool) +
                   (int64_t(params.history.v_page_index[owned.page]) * shape.page_tokens + first_row) * kv_row_stride +
                   kv_head * kHeadDim;
    owned.valid_keys = min(kKeys, shape.history_tokens - owned.page * shape.page_tokens - owned.first_key);
    if (kPageParts && owned.valid_keys <= 0) {
      owned.work.count = 0;  // a part past the end of a partial last page
      return owned;
    }
    if (params.selection.selected_pages != nullptr) {
      owned.work.tiles = workspace.inverse_tiles + int64_t(owned.page) * workspace.inverse_capacity;
      owned.work.blocks_per_tile = params.selection.query_tile_tokens / kQueries;
      owned.work.per_head = workspace.inverse_count[owned.page] * owned.work.blocks_per_tile;
    } else {
      owned.work.per_head = num_query_blocks;
    }
  }
  if (shape.sliding_window > 0) {
    // Only the query blocks up to the last query that sees the last key (Note [Sliding window in
    // the kernels] in attention_common.cuh; dense only): a history page no query sees gets no work.
    const int last_key = owned_window_start(shape, owned) + owned.valid_keys - 1;
    const int last_query = last_key + min(shape.sliding_window, kNoWindowEdge) - 1;
    const int end_block = last_query < 0 ? 0 : min(num_query_blocks, last_query / kQueries + 1);
    owned.work.per_head = max(0, end_block - owned.work.first_query_block);
  }
  owned.work.count = owned.work.per_head * (shape.num_q_heads / shape.num_kv_heads);
  return owned;
}

// Writes dK (times the softmax scale) and dV of key row `key` of the CTA's keys (row first_key +
// key of the chunk, or of the page), columns `column` and `column + 1`: overwritten for chunk
// keys, ADDED into the grad pages for history keys (fp32, or bf16 with round-to-nearest-even).
template <typename Element, int kHeadDim, bool kPageParts = false>
__device__ __forceinline__ void write_key_gradients(const PagedAttentionBackwardParams& params, bool chunk_block,
                                                    int first_key, int page, int key, int column, float dk0, float dk1,
                                                    float dv0, float dv1) {
  const PagedAttentionShape& shape = params.shape;
  const int kv_head = blockIdx.y;
  const int64_t kv_row_stride = int64_t(shape.num_kv_heads) * kHeadDim;
  dk0 *= shape.softmax_scale;
  dk1 *= shape.softmax_scale;
  if (chunk_block) {
    const int64_t offset = int64_t(first_key + key) * kv_row_stride + int64_t(kv_head) * kHeadDim + column;
    *reinterpret_cast<uint32_t*>(static_cast<Element*>(params.dk_chunk) + offset) = ElementTraits<Element>::pack(dk0, dk1);
    *reinterpret_cast<uint32_t*>(static_cast<Element*>(params.dv_chunk) + offset) = ElementTraits<Element>::pack(dv0, dv1);
    return;
  }
  const HistoryGradPages& grad = params.grad_history;
  // History rows: first_key is the part's first row in the page, 0 unless CTAs own parts of pages.
  const int64_t row = kPageParts ? first_key + key : key;
  const int64_t dk_offset =
      (int64_t(grad.dk_page_index[page]) * shape.page_tokens + row) * kv_row_stride + int64_t(kv_head) * kHeadDim + column;
  const int64_t dv_offset =
      (int64_t(grad.dv_page_index[page]) * shape.page_tokens + row) * kv_row_stride + int64_t(kv_head) * kHeadDim + column;
  if (params.grad_page_dtype == DType::kFloat32) {
    float2* dk_pair = reinterpret_cast<float2*>(static_cast<float*>(grad.dk_pool) + dk_offset);
    float2* dv_pair = reinterpret_cast<float2*>(static_cast<float*>(grad.dv_pool) + dv_offset);
    const float2 dk_old = *dk_pair, dv_old = *dv_pair;
    *dk_pair = make_float2(dk_old.x + dk0, dk_old.y + dk1);
    *dv_pair = make_float2(dv_old.x + dv0, dv_old.y + dv1);
  } else {
    using Bf16 = ElementTraits<__nv_bfloat16>;
    uint32_t* dk_bits = reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(grad.dk_pool) + dk_offset);
    uint32_t* dv_bits = reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(grad.dv_pool) + dv_offset);
    const float2 dk_old = Bf16::unpack(*dk_bits), dv_old = Bf16::unpack(*dv_bits);
    *dk_bits = Bf16::pack(dk_old.x + dk0, dk_old.y + dk1);
    *dv_bits = Bf16::pack(dv_old.x + dv0, dv_old.y + dv1);
  }
}

}  // namespace membar::kernels::cuda::detail
