// Shared validation of the paged-attention ops, implemented in attention_prepare.cpp
// (attention_ops.cpp holds the schemas, the meta functions and the CPU implementations; the CUDA
// implementation and the sweep module reuse these helpers). Each prepare_* function checks its
// tensors with TORCH_CHECK and a sentence, allocates the outputs and fills the kernel's plain
// parameter struct; nothing here launches work.
//
// Shapes (see kernels/include/membar/kernels/attention.h):
//   q [Tc, Hq, D]; k_chunk, v_chunk [Tc, Hkv, D]; pools [pool_pages, page_tokens, Hkv, D];
//   page indices int32 [num_history_pages]; lse [Hq, Tc] fp32 (fp64 for fp64 inputs);
//   selected_pages int32 [ceil(Tc / query_tile_tokens), k].
// attend_chunk = false: the queries attend only the history (Note [Blocked history] in
// membar/kernels/attention.h).
#pragma once

#include <optional>

#include <torch/library.h>

#include "membar/kernels/attention.h"

namespace membar::bindings::attention {

kernels::DType to_kernel_dtype(at::ScalarType type, const char* what);

// lse is float32, or float64 for float64 inputs.
inline at::ScalarType lse_dtype_for(at::ScalarType element) {
  return element == at::kDouble ? at::kDouble : at::kFloat;
}

// check_index_values: read the page indices and the selection (host tensors only) and check
// every value is in range; a CUDA caller passes false and relies on its own checks.
struct ForwardCall {
  kernels::PagedAttentionForwardParams params;
  at::Tensor q, k_chunk, v_chunk;  // contiguous, kept alive for the call
  at::Tensor selected_pages;       // contiguous or undefined
  at::Tensor out;                  // [Tc, Hq, D], q's dtype
  at::Tensor lse;                  // [Hq, Tc]
};
ForwardCall prepare_forward(const at::Tensor& q, const at::Tensor& k_chunk, const at::Tensor& v_chunk,
                            const at::Tensor& k_pool, const at::Tensor& k_page_index, const at::Tensor& v_pool,
                            const at::Tensor& v_page_index, int64_t history_tokens, double softmax_scale,
                            double logit_softcap, int64_t sliding_window,
                            const std::optional<at::Tensor>& selected_pages, int64_t query_tile_tokens,
                            bool attend_chunk, bool check_index_values);

struct BackwardCall {
  kernels::PagedAttentionBackwardParams params;
  ForwardCall forward;               // the forward's inputs (its out/lse are not allocated)
  at::Tensor out, dout, lse;         // contiguous
  at::Tensor dq, dk_chunk, dv_chunk; // outputs (dk/dv_chunk zeros, not passed to the kernel, without attend_chunk)
};
BackwardCall prepare_backward(const at::Tensor& q, const at::Tensor& k_chunk, const at::Tensor& v_chunk,
                              const at::Tensor& k_pool, const at::Tensor& k_page_index, const at::Tensor& v_pool,
                              const at::Tensor& v_page_index, const at::Tensor& out, const at::Tensor& dout,
                              const at::Tensor& lse, const at::Tensor& dk_pool, const at::Tensor& dk_page_index,
                              const at::Tensor& dv_pool, const at::Tensor& dv_page_index, int64_t history_tokens,
                              double softmax_scale, double logit_softcap, int64_t sliding_window,
                              const std::optional<at::Tensor>& selected_pages, int64_t query_tile_tokens,
                              bool deterministic, bool attend_chunk, bool check_index_values);

struct SummaryCall {
  kernels::PageSummaryParams params;
  at::Tensor mean;                 // [num_history_pages, Hkv, D] fp32
  std::optional<at::Tensor> min, max;
};
SummaryCall prepare_summary(const at::Tensor& k_pool, const at::Tensor& k_page_index, int64_t history_tokens,
                            bool with_bounds, bool check_index_values);

struct SelectCall {
  kernels::PageSelectParams params;
  at::Tensor q, mean, min, max;    // contiguous (min/max undefined without bounds)
  at::Tensor selected_pages;       // [ceil(Tc / query_tile_tokens), top_k] int32
};
SelectCall prepare_select(const at::Tensor& q, const at::Tensor& mean, const std::optional<at::Tensor>& min,
                          const std::optional<at::Tensor>& max, int64_t top_k, int64_t query_tile_tokens);

}  // namespace membar::bindings::attention
