// Parameter checks shared by every attention backend (the CUDA build links this file too).
#include <cmath>
#include <cstdint>
#include <vector>

#include "membar/kernels/attention.h"

namespace membar::kernels {

const char* paged_attention_check_shape(const PagedAttentionShape& shape) {
  if (shape.chunk_tokens < 1) return "chunk_tokens must be at least 1.";
  if (shape.history_tokens < 0) return "history_tokens must not be negative.";
  if (shape.page_tokens < 1) return "page_tokens must be at least 1.";
  if (shape.num_kv_heads < 1) return "num_kv_heads must be at least 1.";
  if (shape.num_q_heads < 1) return "num_q_heads must be at least 1.";
  if (shape.num_q_heads % shape.num_kv_heads != 0) {
    return "num_q_heads must be a multiple of num_kv_heads (grouped-query attention).";
  }
  if (shape.head_dim < 1 || shape.head_dim > 256) return "head_dim must be between 1 and 256.";
  if (!std::isfinite(shape.softmax_scale) || !(shape.softmax_scale > 0.f)) {
    return "softmax_scale must be a finite positive number.";
  }
  if (!std::isfinite(shape.logit_softcap) || shape.logit_softcap < 0.f) {
    return "logit_softcap must be 0 (no soft-cap) or a finite positive number.";
  }
  // A cap this small would overflow the CUDA kernels' derived constants (cap / scale and its inverse).
  if (shape.logit_softcap > 0.f && shape.logit_softcap < 1e-6f) {
    return "logit_softcap must be 0 (no soft-cap) or at least 1e-6.";
  }
  // Note [Sliding window] in attention.h.
  if (shape.sliding_window < 0) return "sliding_window must be 0 (no window) or a positive number of positions.";
  if (shape.sliding_window > 0 && !shape.attend_chunk) {
    return "a sliding window needs attend_chunk: a call over a block of history alone does not know the "
           "queries' positions relative to it.";
  }
  switch (shape.dtype) {
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kFloat64:
      break;
    default:
      return "dtype must be float32, float16, bfloat16 or float64.";
  }
  // Element offsets are computed in int64; keep every tensor's element count well inside it,
  // and the history's page count inside int32 (page indices are int32).
  const int64_t row_elements = int64_t(shape.num_q_heads) * shape.head_dim;
  if (int64_t(shape.chunk_tokens) * row_elements > (int64_t(1) << 48)) {
    return "the chunk's query tensor is too large (more than 2^48 elements).";
  }
  return "";
}

const char* page_selection_check(const PagedAttentionShape& shape, const PageSelection& selection) {
  if (!selection.enabled()) return "";
  if (shape.sliding_window > 0) return "a sliding window cannot be combined with a sparse page selection.";
  if (selection.selected_per_tile < 1) return "a sparse selection must list at least one page per tile.";
  if (selection.query_tile_tokens < 1) return "query_tile_tokens must be at least 1.";
  const int32_t num_pages = shape.num_history_pages();
  const int32_t num_tiles = num_query_tiles(shape.chunk_tokens, selection.query_tile_tokens);
  // Marks the pages seen in the current tile; stamp = tile + 1 avoids clearing between tiles.
  std::vector<int32_t> seen_in_tile(size_t(num_pages), 0);
  for (int32_t tile = 0; tile < num_tiles; ++tile) {
    const int32_t* row = selection.selected_pages + int64_t(tile) * selection.selected_per_tile;
    for (int32_t slot = 0; slot < selection.selected_per_tile; ++slot) {
      const int32_t page = row[slot];
      if (page < 0) {
        if (page != -1) return "selected_pages entries must be -1 (padding) or a history page number.";
        continue;
      }
      if (page >= num_pages) return "selected_pages lists a page past the end of the history.";
      if (seen_in_tile[size_t(page)] == tile + 1) return "selected_pages lists a page twice for one query tile.";
      seen_in_tile[size_t(page)] = tile + 1;
    }
  }
  return "";
}

}  // namespace membar::kernels
