// CUDA implementations of the paged-attention ops (schemas, meta functions and shared
// validation in ../attention_ops.cpp): validate, fill the kernel's params, launch on the current
// stream of q's device. The shape checks of prepare_* run first; then what the CUDA kernels
// support on top (head_dim 64/128, page_tokens 64/128, bf16/fp16, query tiles of 64k rows); then
// the page index values, read back in one small transfer, so that a bad index is an error and
// never an out-of-bounds access.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "attention_ops.h"
// The CUDA kernels' own checks.
#include "attention_cuda_internal.h"

namespace membar::bindings::attention {
namespace {

namespace k = membar::kernels;

void check_cuda(const at::Tensor& tensor, const char* op) {
  TORCH_CHECK(tensor.is_cuda(), op, ": the CUDA implementation got a tensor on ", tensor.device(), ".");
}

void check_launch(int error, const char* op) {
  TORCH_CHECK(error == 0, op, ": the CUDA kernel failed to launch: ", cudaGetErrorString(static_cast<cudaError_t>(error)),
              ".");
}

void check_supported(const k::PagedAttentionShape& shape, const k::PageSelection& selection, const char* op) {
  const char* problem = k::cuda::paged_attention_cuda_check(shape, selection);
  TORCH_CHECK(problem[0] == '\0', op, ": ", problem);
}

void check_aligned(std::initializer_list<std::pair<const void*, const char*>> tensors, const char* op) {
  std::vector<const void*> pointers;
  std::vector<const char*> names;
  for (const auto& [pointer, name] : tensors) {
    pointers.push_back(pointer);
    names.push_back(name);
  }
  const char* problem = k::cuda::paged_attention_check_alignment(pointers.data(), names.data(), int(pointers.size()));
  TORCH_CHECK(problem[0] == '\0', op, ": ", problem);
}

// Every page index value must name a row of its pool: [min, max] of each index, read back in
// one transfer. Returns an empty string, or a sentence naming the first index out of range (the
// caller raises it).
struct IndexRange {
  const at::Tensor* index;
  int64_t pool_pages;
  const char* name;
};
std::string index_range_problem(const std::vector<IndexRange>& indices) {
  std::vector<at::Tensor> bounds;
  for (const IndexRange& range : indices) {
    if (range.index->numel() > 0) bounds.push_back(at::stack({range.index->min(), range.index->max()}));
  }
  if (bounds.empty()) return "";
  const at::Tensor host = at::stack(bounds).to(at::kCPU, at::kLong).contiguous();
  const int64_t* values = host.data_ptr<int64_t>();
  size_t slot = 0;
  for (const IndexRange& range : indices) {
    if (range.index->numel() == 0) continue;
    const int64_t low = values[2 * slot], high = values[2 * slot + 1];
    ++slot;
    if (low < 0 || high >= range.pool_pages) {
      return std::string(range.name) + " holds values in [" + std::to_string(low) + ", " + std::to_string(high) +
             "] but its pool has " + std::to_string(range.pool_pages) + " pages.";
    }
  }
  return "";
}

void check_index_ranges(const std::vector<IndexRange>& indices, const char* op) {
  const std::string problem = index_range_problem(indices);
  TORCH_CHECK(problem.empty(), op, ": ", problem);
}

// The kernel variants of one kind ("forward" or "backward"): their names, default first.
std::vector<std::string> variant_names(bool forward) {
  std::vector<std::string> names;
  const int count = forward ? k::cuda::forward_variant_count() : k::cuda::backward_variant_count();
  names.push_back(forward ? k::cuda::forward_default_variant() : k::cuda::backward_default_variant());
  for (int i = 0; i < count; ++i) {
    const char* name = forward ? k::cuda::forward_variant_name(i) : k::cuda::backward_variant_name(i);
    if (names.front() != name) names.push_back(name);
  }
  return names;
}

// MEMBAR_ATTENTION_{FORWARD,BACKWARD}_VARIANT, when set, must name a compiled variant.
void check_variant_environment(bool forward, const char* op) {
  const char* variable = forward ? "MEMBAR_ATTENTION_FORWARD_VARIANT" : "MEMBAR_ATTENTION_BACKWARD_VARIANT";
  const char* value = std::getenv(variable);
  if (value == nullptr || value[0] == '\0') return;
  const std::vector<std::string> names = variant_names(forward);
  std::string known;
  for (const std::string& name : names) {
    if (name == value) return;
    known += (known.empty() ? "" : ", ") + name;
  }
  TORCH_CHECK(false, op, ": ", variable, "=", value, " names no compiled kernel variant (known: ", known, ").");
}

// (names, default) of the compiled variants of `kernel` ("forward" or "backward").
std::tuple<std::vector<std::string>, std::string> attention_cuda_variants(const std::string& kernel) {
  TORCH_CHECK(kernel == "forward" || kernel == "backward",
              "attention_cuda_variants: kernel must be \"forward\" or \"backward\" (got \"", kernel, "\").");
  std::vector<std::string> names = variant_names(kernel == "forward");
  std::string default_name = names.front();
  return {names, default_name};
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& q, const at::Tensor& k_chunk, const at::Tensor& v_chunk,
                                                const at::Tensor& k_pool, const at::Tensor& k_page_index,
                                                const at::Tensor& v_pool, const at::Tensor& v_page_index,
                                                int64_t history_tokens, double softmax_scale,
                                                const std::optional<at::Tensor>& selected_pages,
                                                int64_t query_tile_tokens, bool attend_chunk) {
  constexpr const char* kOp = "paged_attention_forward";
  check_cuda(q, kOp);
  check_variant_environment(/*forward=*/true, kOp);
  const c10::cuda::CUDAGuard guard(q.device());
  ForwardCall call = prepare_forward(q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index, history_tokens,
                                     softmax_scale, selected_pages, query_tile_tokens, attend_chunk,
                                     /*check_index_values=*/false);
  const k::PagedAttentionForwardParams& p = call.params;
  check_supported(p.shape, p.selection, kOp);
  check_aligned({{p.q, "q"}, {p.k_chunk, "k_chunk"}, {p.v_chunk, "v_chunk"}, {p.history.k_pool, "k_pool"},
                 {p.history.v_pool, "v_pool"}, {p.out, "out"}},
                kOp);
  check_index_ranges({{&k_page_index, k_pool.size(0), "k_page_index"}, {&v_page_index, v_pool.size(0), "v_page_index"}},
                     kOp);
  check_launch(k::cuda::paged_attention_forward(p, at::cuda::getCurrentCUDAStream().stream()), kOp);
  return {call.out, call.lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& q, const at::Tensor& k_chunk, const at::Tensor& v_chunk, const at::Tensor& k_pool,
    const at::Tensor& k_page_index, const at::Tensor& v_pool, const at::Tensor& v_page_index, const at::Tensor& out,
    const at::Tensor& dout, const at::Tensor& lse, at::Tensor& dk_pool, const at::Tensor& dk_page_index,
    at::Tensor& dv_pool, const at::Tensor& dv_page_index, int64_t history_tokens, double softmax_scale,
    const std::optional<at::Tensor>& selected_pages, int64_t query_tile_tokens, bool deterministic,
    bool attend_chunk) {
  constexpr const char* kOp = "paged_attention_backward";
  check_cuda(q, kOp);
  check_variant_environment(/*forward=*/false, kOp);
  const c10::cuda::CUDAGuard guard(q.device());
  BackwardCall call = prepare_backward(q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index, out, dout, lse,
                                       dk_pool, dk_page_index, dv_pool, dv_page_index, history_tokens, softmax_scale,
                                       selected_pages, query_tile_tokens, deterministic, attend_chunk,
                                       /*check_index_values=*/false);
  k::PagedAttentionBackwardParams& p = call.params;
  check_supported(p.shape, p.selection, kOp);
  TORCH_CHECK(p.grad_page_dtype == k::DType::kFloat32 || p.grad_page_dtype == k::DType::kBFloat16, kOp,
              ": the CUDA kernel accumulates into float32 or bfloat16 grad pages (got ", dk_pool.scalar_type(), ").");
  const at::Tensor workspace =
      at::empty({int64_t(k::cuda::paged_attention_backward_workspace_bytes(p.shape))}, q.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  check_aligned({{p.q, "q"}, {p.k_chunk, "k_chunk"}, {p.v_chunk, "v_chunk"}, {p.history.k_pool, "k_pool"},
                 {p.history.v_pool, "v_pool"}, {p.out, "out"}, {p.dout, "dout"}, {p.dq, "dq"},
                 {p.dk_chunk, "dk_chunk"}, {p.dv_chunk, "dv_chunk"}, {p.grad_history.dk_pool, "dk_pool"},
                 {p.grad_history.dv_pool, "dv_pool"}},
                kOp);
  check_index_ranges({{&k_page_index, k_pool.size(0), "k_page_index"},
                      {&v_page_index, v_pool.size(0), "v_page_index"},
                      {&dk_page_index, dk_pool.size(0), "dk_page_index"},
                      {&dv_page_index, dv_pool.size(0), "dv_page_index"}},
                     kOp);
  check_launch(k::cuda::paged_attention_backward(p, at::cuda::getCurrentCUDAStream().stream()), kOp);
  return {call.dq, call.dk_chunk, call.dv_chunk};
}

std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> summary_cuda(
    const at::Tensor& k_pool, const at::Tensor& k_page_index, int64_t history_tokens, bool with_bounds) {
  constexpr const char* kOp = "page_summary";
  check_cuda(k_pool, kOp);
  const c10::cuda::CUDAGuard guard(k_pool.device());
  SummaryCall call = prepare_summary(k_pool, k_page_index, history_tokens, with_bounds, /*check_index_values=*/false);
  const k::DType dtype = call.params.shape.dtype;
  TORCH_CHECK(dtype == k::DType::kBFloat16 || dtype == k::DType::kFloat16, kOp,
              ": the CUDA kernel takes bfloat16 or float16 pools (got ", k_pool.scalar_type(), ").");
  check_index_ranges({{&k_page_index, k_pool.size(0), "k_page_index"}}, kOp);
  check_launch(k::cuda::page_summary(call.params, at::cuda::getCurrentCUDAStream().stream()), kOp);
  return {call.mean, call.min, call.max};
}

at::Tensor select_cuda(const at::Tensor& q, const at::Tensor& mean, const std::optional<at::Tensor>& min,
                       const std::optional<at::Tensor>& max, int64_t top_k, int64_t query_tile_tokens) {
  constexpr const char* kOp = "page_select";
  check_cuda(q, kOp);
  const c10::cuda::CUDAGuard guard(q.device());
  SelectCall call = prepare_select(q, mean, min, max, top_k, query_tile_tokens);
  const k::PagedAttentionShape& shape = call.params.shape;
  TORCH_CHECK(shape.dtype == k::DType::kBFloat16 || shape.dtype == k::DType::kFloat16, kOp,
              ": the CUDA kernel takes bfloat16 or float16 queries (got ", q.scalar_type(), ").");
  TORCH_CHECK(top_k >= 1, kOp, ": top_k must be at least 1.");
  const int64_t max_pages = k::cuda::page_select_max_pages(shape);
  TORCH_CHECK(mean.size(0) <= max_pages, kOp, ": the CUDA kernel scores at most ", max_pages,
              " pages per call for this shape (got ", mean.size(0), ").");
  check_launch(k::cuda::page_select(call.params, at::cuda::getCurrentCUDAStream().stream()), kOp);
  return call.selected_pages;
}

}  // namespace
}  // namespace membar::bindings::attention

// Only CUDA builds have kernel variants (Note [Forward variants] in kernels/cuda/attention_forward.cu):
// membar::attention_cuda_variants("forward" | "backward") -> (names, default name).
TORCH_LIBRARY_FRAGMENT(membar, m) {
  m.def("attention_cuda_variants(str kernel) -> (str[] names, str default_name)",
        &membar::bindings::attention::attention_cuda_variants);
}

TORCH_LIBRARY_IMPL(membar, CUDA, m) {
  m.impl("paged_attention_forward", &membar::bindings::attention::forward_cuda);
  m.impl("paged_attention_backward", &membar::bindings::attention::backward_cuda);
  m.impl("page_summary", &membar::bindings::attention::summary_cuda);
  m.impl("page_select", &membar::bindings::attention::select_cuda);
}
