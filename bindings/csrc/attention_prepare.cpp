// Validation of the paged-attention ops' tensors and the kernels' params struct they fill
// (attention_ops.h), shared by the CPU and CUDA implementations and by the sweep module of
// bindings/csrc/sweep/. No op is registered here (attention_ops.cpp holds the schemas).
#include "attention_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/ATen.h>

namespace membar::bindings::attention {

namespace k = membar::kernels;

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

int32_t checked_int32(int64_t value, const char* what) {
  TORCH_CHECK(value >= 0 && value <= kInt32Max, "paged attention: ", what, " must be between 0 and 2^31 - 1 (got ",
              value, ").");
  return static_cast<int32_t>(value);
}

void check_device(const at::Tensor& tensor, const at::Tensor& reference, const char* name) {
  TORCH_CHECK(tensor.device() == reference.device(), "paged attention: ", name, " is on ", tensor.device(),
              " but q is on ", reference.device(), "; every tensor of one call must be on the same device.");
}

void check_dims(const at::Tensor& tensor, int64_t dims, const char* name, const char* layout) {
  TORCH_CHECK(tensor.dim() == dims, "paged attention: ", name, " must have ", dims, " dimensions ", layout,
              " (got shape ", tensor.sizes(), ").");
}

// Pools are mapped memory or large preallocated buffers: never copied, so they must already be
// contiguous.
void check_pool(const at::Tensor& pool, const at::Tensor& q, const char* name, int64_t page_tokens,
                int64_t kv_heads, int64_t head_dim) {
  check_device(pool, q, name);
  check_dims(pool, 4, name, "[pool_pages, page_tokens, kv_heads, head_dim]");
  TORCH_CHECK(pool.is_contiguous(), "paged attention: ", name, " must be contiguous (pools are never copied).");
  TORCH_CHECK(pool.size(1) == page_tokens && pool.size(2) == kv_heads && pool.size(3) == head_dim,
              "paged attention: ", name, " has shape ", pool.sizes(), " but [*, ", page_tokens, ", ", kv_heads, ", ",
              head_dim, "] (page_tokens, kv_heads, head_dim) was expected.");
}

// A page index: int32 [num_pages], contiguous, values in [0, pool_pages) (checked when
// check_values; the values are read on the host).
void check_page_index(const at::Tensor& index, const at::Tensor& q, const char* name, int64_t num_pages,
                      int64_t pool_pages, bool check_values) {
  check_device(index, q, name);
  TORCH_CHECK(index.scalar_type() == at::kInt, "paged attention: ", name, " must be int32 (got ",
              index.scalar_type(), ").");
  TORCH_CHECK(index.dim() == 1 && index.size(0) == num_pages, "paged attention: ", name,
              " must have shape [num_history_pages] = [", num_pages, "] (got ", index.sizes(), ").");
  TORCH_CHECK(index.is_contiguous(), "paged attention: ", name, " must be contiguous.");
  if (check_values && num_pages > 0) {
    const int32_t* values = index.data_ptr<int32_t>();
    for (int64_t i = 0; i < num_pages; ++i) {
      TORCH_CHECK(values[i] >= 0 && values[i] < pool_pages, "paged attention: ", name, "[", i, "] = ", values[i],
                  " is not a page of its pool (which has ", pool_pages, " pages).");
    }
  }
}

// The grad pages are written in parallel: one pool row listed twice (in one index, or in the
// dK and dV indices of one shared pool) would be two writers of the same memory.
void check_grad_pages_distinct(const at::Tensor& dk_index, const at::Tensor& dv_index, const at::Tensor& dk_pool,
                               const at::Tensor& dv_pool) {
  const bool shared_pool = dk_pool.data_ptr() == dv_pool.data_ptr() && dk_pool.numel() > 0;
  std::vector<uint8_t> seen_dk(size_t(dk_pool.size(0)), 0);
  std::vector<uint8_t> seen_dv(size_t(dv_pool.size(0)), 0);
  std::vector<uint8_t>& dv_seen = shared_pool ? seen_dk : seen_dv;
  const int32_t* dk = dk_index.data_ptr<int32_t>();
  for (int64_t i = 0; i < dk_index.numel(); ++i) {
    TORCH_CHECK(!seen_dk[size_t(dk[i])], "paged attention: dk_page_index lists pool page ", dk[i],
                " twice; every history page needs its own gradient page.");
    seen_dk[size_t(dk[i])] = 1;
  }
  const int32_t* dv = dv_index.data_ptr<int32_t>();
  for (int64_t i = 0; i < dv_index.numel(); ++i) {
    TORCH_CHECK(!dv_seen[size_t(dv[i])], "paged attention: dv_page_index lists pool page ", dv[i],
                shared_pool ? " that is already used (dk_pool and dv_pool are one pool)" : " twice",
                "; every history page needs its own gradient page.");
    dv_seen[size_t(dv[i])] = 1;
  }
}

}  // namespace

k::DType to_kernel_dtype(at::ScalarType type, const char* what) {
  switch (type) {
    case at::kFloat: return k::DType::kFloat32;
    case at::kBFloat16: return k::DType::kBFloat16;
    case at::kHalf: return k::DType::kFloat16;
    case at::kDouble: return k::DType::kFloat64;
    default:
      TORCH_CHECK(false, "paged attention: ", what, " must be float32, float64, bfloat16 or float16 (got ", type, ").");
  }
}

ForwardCall prepare_forward(const at::Tensor& q, const at::Tensor& k_chunk, const at::Tensor& v_chunk,
                            const at::Tensor& k_pool, const at::Tensor& k_page_index, const at::Tensor& v_pool,
                            const at::Tensor& v_page_index, int64_t history_tokens, double softmax_scale,
                            double logit_softcap, int64_t sliding_window,
                            const std::optional<at::Tensor>& selected_pages, int64_t query_tile_tokens,
                            bool attend_chunk, bool check_index_values) {
  check_dims(q, 3, "q", "[chunk_tokens, q_heads, head_dim]");
  check_dims(k_chunk, 3, "k_chunk", "[chunk_tokens, kv_heads, head_dim]");
  check_dims(v_chunk, 3, "v_chunk", "[chunk_tokens, kv_heads, head_dim]");
  check_device(k_chunk, q, "k_chunk");
  check_device(v_chunk, q, "v_chunk");
  const at::ScalarType dtype = q.scalar_type();
  const k::DType kernel_dtype = to_kernel_dtype(dtype, "q");
  for (const auto& [tensor, name] : {std::pair{&k_chunk, "k_chunk"}, std::pair{&v_chunk, "v_chunk"},
                                     std::pair{&k_pool, "k_pool"}, std::pair{&v_pool, "v_pool"}}) {
    TORCH_CHECK(tensor->scalar_type() == dtype, "paged attention: ", name, " is ", tensor->scalar_type(),
                " but q is ", dtype, "; q, k_chunk, v_chunk and the pools must share one dtype.");
  }
  TORCH_CHECK(k_chunk.sizes() == v_chunk.sizes(), "paged attention: k_chunk ", k_chunk.sizes(), " and v_chunk ",
              v_chunk.sizes(), " must have the same shape.");
  TORCH_CHECK(k_chunk.size(0) == q.size(0) && k_chunk.size(2) == q.size(2), "paged attention: k_chunk ",
              k_chunk.sizes(), " must be [chunk_tokens, kv_heads, head_dim] with q's chunk_tokens and head_dim (q is ",
              q.sizes(), ").");
  TORCH_CHECK(k_pool.dim() == 4, "paged attention: k_pool must have 4 dimensions [pool_pages, page_tokens, kv_heads, "
              "head_dim] (got shape ", k_pool.sizes(), ").");
  TORCH_CHECK(history_tokens >= 0, "paged attention: history_tokens must not be negative (got ", history_tokens, ").");
  TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0, "paged attention: softmax_scale must be a finite "
              "positive number (got ", softmax_scale, ").");
  TORCH_CHECK(std::isfinite(logit_softcap) && logit_softcap >= 0, "paged attention: logit_softcap must be 0 (no "
              "soft-cap) or a finite positive number (got ", logit_softcap, ").");
  // Note [Sliding window] in membar/kernels/attention.h; the shape check below refuses the rest.
  TORCH_CHECK(sliding_window >= 0, "paged attention: sliding_window must be 0 (no window) or a positive number of "
              "positions (got ", sliding_window, ").");

  ForwardCall call;
  k::PagedAttentionShape& shape = call.params.shape;
  shape.chunk_tokens = checked_int32(q.size(0), "chunk_tokens");
  shape.history_tokens = checked_int32(history_tokens, "history_tokens");
  shape.page_tokens = checked_int32(k_pool.size(1), "page_tokens");
  shape.num_q_heads = checked_int32(q.size(1), "q_heads");
  shape.num_kv_heads = checked_int32(k_chunk.size(1), "kv_heads");
  shape.head_dim = checked_int32(q.size(2), "head_dim");
  shape.softmax_scale = static_cast<float>(softmax_scale);
  shape.logit_softcap = static_cast<float>(logit_softcap);
  // A window past int32 hides nothing a chunk can hold.
  shape.sliding_window = static_cast<int32_t>(std::min<int64_t>(sliding_window, std::numeric_limits<int32_t>::max()));
  shape.dtype = kernel_dtype;
  shape.attend_chunk = attend_chunk;
  const char* problem = k::paged_attention_check_shape(shape);
  TORCH_CHECK(problem[0] == '\0', "paged attention: ", problem, " (q ", q.sizes(), ", k_chunk ", k_chunk.sizes(),
              ", k_pool ", k_pool.sizes(), ", history_tokens ", history_tokens, ").");

  check_pool(k_pool, q, "k_pool", shape.page_tokens, shape.num_kv_heads, shape.head_dim);
  check_pool(v_pool, q, "v_pool", shape.page_tokens, shape.num_kv_heads, shape.head_dim);
  const int64_t num_pages = shape.num_history_pages();
  check_page_index(k_page_index, q, "k_page_index", num_pages, k_pool.size(0), check_index_values);
  check_page_index(v_page_index, q, "v_page_index", num_pages, v_pool.size(0), check_index_values);

  call.q = q.contiguous();
  call.k_chunk = k_chunk.contiguous();
  call.v_chunk = v_chunk.contiguous();
  call.params.q = call.q.data_ptr();
  call.params.k_chunk = call.k_chunk.data_ptr();
  call.params.v_chunk = call.v_chunk.data_ptr();
  call.params.history.k_pool = k_pool.data_ptr();
  call.params.history.k_page_index = k_page_index.data_ptr<int32_t>();
  call.params.history.v_pool = v_pool.data_ptr();
  call.params.history.v_page_index = v_page_index.data_ptr<int32_t>();
  if (selected_pages.has_value() && selected_pages->defined()) {
    const at::Tensor& selection = *selected_pages;
    TORCH_CHECK(query_tile_tokens >= 1, "paged attention: query_tile_tokens must be at least 1 (got ",
                query_tile_tokens, ").");
    check_device(selection, q, "selected_pages");
    TORCH_CHECK(selection.scalar_type() == at::kInt, "paged attention: selected_pages must be int32 (got ",
                selection.scalar_type(), ").");
    const int64_t num_tiles = (q.size(0) + query_tile_tokens - 1) / query_tile_tokens;
    TORCH_CHECK(selection.dim() == 2 && selection.size(0) == num_tiles && selection.size(1) >= 1,
                "paged attention: selected_pages must have shape [ceil(chunk_tokens / query_tile_tokens), k] = [",
                num_tiles, ", k >= 1] (got ", selection.sizes(), ").");
    call.selected_pages = selection.contiguous();
    call.params.selection.selected_pages = call.selected_pages.data_ptr<int32_t>();
    call.params.selection.selected_per_tile = checked_int32(selection.size(1), "pages per tile");
    call.params.selection.query_tile_tokens = checked_int32(query_tile_tokens, "query_tile_tokens");
    if (check_index_values) {
      const char* selection_problem = k::page_selection_check(shape, call.params.selection);
      TORCH_CHECK(selection_problem[0] == '\0', "paged attention: ", selection_problem);
    }
  }
  call.out = at::empty_like(call.q);
  call.lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(lse_dtype_for(dtype)));
  call.params.out = call.out.data_ptr();
  call.params.lse = call.lse.data_ptr();
  return call;
}

BackwardCall prepare_backward(const at::Tensor& q, const at::Tensor& k_chunk, const at::Tensor& v_chunk,
                              const at::Tensor& k_pool, const at::Tensor& k_page_index, const at::Tensor& v_pool,
                              const at::Tensor& v_page_index, const at::Tensor& out, const at::Tensor& dout,
                              const at::Tensor& lse, const at::Tensor& dk_pool, const at::Tensor& dk_page_index,
                              const at::Tensor& dv_pool, const at::Tensor& dv_page_index, int64_t history_tokens,
                              double softmax_scale, double logit_softcap, int64_t sliding_window,
                              const std::optional<at::Tensor>& selected_pages, int64_t query_tile_tokens,
                              bool deterministic, bool attend_chunk, bool check_index_values) {
  BackwardCall call;
  call.forward = prepare_forward(q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index, history_tokens,
                                 softmax_scale, logit_softcap, sliding_window, selected_pages, query_tile_tokens,
                                 attend_chunk, check_index_values);
  // The forward's own outputs are not needed.
  call.forward.out = at::Tensor();
  call.forward.lse = at::Tensor();
  const k::PagedAttentionShape& shape = call.forward.params.shape;
  const at::ScalarType dtype = q.scalar_type();
  for (const auto& [tensor, name] : {std::pair{&out, "out"}, std::pair{&dout, "dout"}}) {
    check_device(*tensor, q, name);
    TORCH_CHECK(tensor->sizes() == q.sizes(), "paged attention backward: ", name, " must have q's shape ", q.sizes(),
                " (got ", tensor->sizes(), ").");
    TORCH_CHECK(tensor->scalar_type() == dtype, "paged attention backward: ", name, " is ", tensor->scalar_type(),
                " but q is ", dtype, ".");
  }
  check_device(lse, q, "lse");
  TORCH_CHECK(lse.scalar_type() == lse_dtype_for(dtype), "paged attention backward: lse must be ",
              lse_dtype_for(dtype), " for ", dtype, " inputs (got ", lse.scalar_type(), ").");
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == q.size(0),
              "paged attention backward: lse must have shape [q_heads, chunk_tokens] = [", q.size(1), ", ", q.size(0),
              "] (got ", lse.sizes(), ").");

  TORCH_CHECK(dk_pool.scalar_type() == dv_pool.scalar_type(), "paged attention backward: dk_pool (",
              dk_pool.scalar_type(), ") and dv_pool (", dv_pool.scalar_type(), ") must share one dtype.");
  const at::ScalarType grad_type = dk_pool.scalar_type();
  TORCH_CHECK(grad_type == at::kFloat || grad_type == at::kBFloat16 || grad_type == at::kDouble,
              "paged attention backward: the grad pools must be float32 or bfloat16 (float64 on the CPU) (got ",
              grad_type, ").");
  check_pool(dk_pool, q, "dk_pool", shape.page_tokens, shape.num_kv_heads, shape.head_dim);
  check_pool(dv_pool, q, "dv_pool", shape.page_tokens, shape.num_kv_heads, shape.head_dim);
  const int64_t num_pages = shape.num_history_pages();
  check_page_index(dk_page_index, q, "dk_page_index", num_pages, dk_pool.size(0), check_index_values);
  check_page_index(dv_page_index, q, "dv_page_index", num_pages, dv_pool.size(0), check_index_values);
  if (check_index_values) check_grad_pages_distinct(dk_page_index, dv_page_index, dk_pool, dv_pool);

  call.out = out.contiguous();
  call.dout = dout.contiguous();
  call.lse = lse.contiguous();
  call.dq = at::empty_like(call.forward.q);
  // Without attend_chunk the chunk's keys get no gradient from this call: zeros, which the
  // kernel never sees (it takes null dk_chunk/dv_chunk then).
  call.dk_chunk = attend_chunk ? at::empty_like(call.forward.k_chunk) : at::zeros_like(call.forward.k_chunk);
  call.dv_chunk = attend_chunk ? at::empty_like(call.forward.v_chunk) : at::zeros_like(call.forward.v_chunk);

  k::PagedAttentionBackwardParams& p = call.params;
  const k::PagedAttentionForwardParams& f = call.forward.params;
  p.shape = f.shape;
  p.q = f.q;
  p.k_chunk = f.k_chunk;
  p.v_chunk = f.v_chunk;
  p.history = f.history;
  p.selection = f.selection;
  p.out = call.out.data_ptr();
  p.dout = call.dout.data_ptr();
  p.lse = call.lse.data_ptr();
  p.dq = call.dq.data_ptr();
  p.dk_chunk = attend_chunk ? call.dk_chunk.data_ptr() : nullptr;
  p.dv_chunk = attend_chunk ? call.dv_chunk.data_ptr() : nullptr;
  p.grad_history.dk_pool = dk_pool.data_ptr();
  p.grad_history.dk_page_index = dk_page_index.data_ptr<int32_t>();
  p.grad_history.dv_pool = dv_pool.data_ptr();
  p.grad_history.dv_page_index = dv_page_index.data_ptr<int32_t>();
  p.grad_page_dtype = to_kernel_dtype(grad_type, "dk_pool");
  p.deterministic = deterministic;
  return call;
}

SummaryCall prepare_summary(const at::Tensor& k_pool, const at::Tensor& k_page_index, int64_t history_tokens,
                            bool with_bounds, bool check_index_values) {
  check_dims(k_pool, 4, "k_pool", "[pool_pages, page_tokens, kv_heads, head_dim]");
  TORCH_CHECK(history_tokens >= 0, "page summary: history_tokens must not be negative (got ", history_tokens, ").");
  SummaryCall call;
  k::PagedAttentionShape& shape = call.params.shape;
  shape.history_tokens = checked_int32(history_tokens, "history_tokens");
  shape.page_tokens = checked_int32(k_pool.size(1), "page_tokens");
  shape.num_kv_heads = checked_int32(k_pool.size(2), "kv_heads");
  shape.head_dim = checked_int32(k_pool.size(3), "head_dim");
  shape.dtype = to_kernel_dtype(k_pool.scalar_type(), "k_pool");
  TORCH_CHECK(shape.page_tokens >= 1 && shape.num_kv_heads >= 1 && shape.head_dim >= 1 && shape.head_dim <= 256,
              "page summary: k_pool ", k_pool.sizes(), " must have page_tokens >= 1, kv_heads >= 1 and "
              "1 <= head_dim <= 256.");
  check_pool(k_pool, k_pool, "k_pool", shape.page_tokens, shape.num_kv_heads, shape.head_dim);
  const int64_t num_pages = shape.num_history_pages();
  check_page_index(k_page_index, k_pool, "k_page_index", num_pages, k_pool.size(0), check_index_values);
  const auto options = k_pool.options().dtype(at::kFloat);
  call.mean = at::empty({num_pages, shape.num_kv_heads, shape.head_dim}, options);
  if (with_bounds) {
    call.min = at::empty({num_pages, shape.num_kv_heads, shape.head_dim}, options);
    call.max = at::empty({num_pages, shape.num_kv_heads, shape.head_dim}, options);
  }
  call.params.k_pool = k_pool.data_ptr();
  call.params.k_page_index = k_page_index.data_ptr<int32_t>();
  call.params.mean = call.mean.data_ptr<float>();
  call.params.min = with_bounds ? call.min->data_ptr<float>() : nullptr;
  call.params.max = with_bounds ? call.max->data_ptr<float>() : nullptr;
  return call;
}

SelectCall prepare_select(const at::Tensor& q, const at::Tensor& mean, const std::optional<at::Tensor>& min,
                          const std::optional<at::Tensor>& max, int64_t top_k, int64_t query_tile_tokens) {
  check_dims(q, 3, "q", "[chunk_tokens, q_heads, head_dim]");
  check_dims(mean, 3, "mean", "[num_history_pages, kv_heads, head_dim]");
  check_device(mean, q, "mean");
  TORCH_CHECK(mean.scalar_type() == at::kFloat, "page select: mean must be float32 (got ", mean.scalar_type(), ").");
  TORCH_CHECK(top_k >= 1, "page select: top_k must be at least 1 (got ", top_k, ").");
  TORCH_CHECK(query_tile_tokens >= 1, "page select: query_tile_tokens must be at least 1 (got ", query_tile_tokens, ").");
  const bool has_min = min.has_value() && min->defined(), has_max = max.has_value() && max->defined();
  TORCH_CHECK(has_min == has_max, "page select: pass both min and max (bound scores) or neither (mean scores).");
  SelectCall call;
  k::PagedAttentionShape& shape = call.params.shape;
  // Only the number of history pages matters here: one "token" per page.
  shape.chunk_tokens = checked_int32(q.size(0), "chunk_tokens");
  shape.history_tokens = checked_int32(mean.size(0), "num_history_pages");
  shape.page_tokens = 1;
  shape.num_q_heads = checked_int32(q.size(1), "q_heads");
  shape.num_kv_heads = checked_int32(mean.size(1), "kv_heads");
  shape.head_dim = checked_int32(q.size(2), "head_dim");
  shape.softmax_scale = 1.f;
  shape.dtype = to_kernel_dtype(q.scalar_type(), "q");
  TORCH_CHECK(mean.size(2) == q.size(2), "page select: mean ", mean.sizes(), " must have q's head_dim ", q.size(2), ".");
  const char* problem = k::paged_attention_check_shape(shape);
  TORCH_CHECK(problem[0] == '\0', "page select: ", problem, " (q ", q.sizes(), ", mean ", mean.sizes(), ").");
  call.q = q.contiguous();
  call.mean = mean.contiguous();
  if (has_min) {
    for (const auto& [tensor, name] : {std::pair{&*min, "min"}, std::pair{&*max, "max"}}) {
      check_device(*tensor, q, name);
      TORCH_CHECK(tensor->sizes() == mean.sizes() && tensor->scalar_type() == at::kFloat, "page select: ", name,
                  " must be float32 with mean's shape ", mean.sizes(), " (got ", tensor->scalar_type(), " ",
                  tensor->sizes(), ").");
    }
    call.min = min->contiguous();
    call.max = max->contiguous();
  }
  const int64_t num_tiles = (q.size(0) + query_tile_tokens - 1) / query_tile_tokens;
  call.selected_pages = at::empty({num_tiles, top_k}, q.options().dtype(at::kInt));
  k::PageSelectParams& p = call.params;
  p.q = call.q.data_ptr();
  p.mean = call.mean.data_ptr<float>();
  p.min = has_min ? call.min.data_ptr<float>() : nullptr;
  p.max = has_min ? call.max.data_ptr<float>() : nullptr;
  p.use_bounds = has_min;
  p.top_k = checked_int32(top_k, "top_k");
  p.query_tile_tokens = checked_int32(query_tile_tokens, "query_tile_tokens");
  p.selected_pages = call.selected_pages.data_ptr<int32_t>();
  return call;
}

}  // namespace membar::bindings::attention
