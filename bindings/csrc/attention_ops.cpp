// Paged-attention ops (OOMB): schemas (one fragment of the membar library), meta functions and the
// CPU implementations; the shared validation is attention_prepare.cpp. A CUDA implementation
// registers for the same schemas with TORCH_LIBRARY_IMPL(membar, CUDA, m) in cuda/.
//
//   paged_attention_forward(q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index,
//       history_tokens, softmax_scale, selected_pages?, query_tile_tokens, attend_chunk, layout,
//       logit_softcap, sliding_window) -> (out, lse)
//   paged_attention_backward(..., out, dout, lse, dk_pool!, dk_page_index, dv_pool!,
//       dv_page_index, ..., deterministic, attend_chunk, layout, logit_softcap, sliding_window)
//       -> (dq, dk_chunk, dv_chunk); ADDS
//       the history's dK/dV into the grad pools in place. attend_chunk=False: the queries attend
//       only the history (Note [Blocked history] in membar/kernels/attention.h); dk_chunk/dv_chunk
//       are then zeros.
//   layout: "" (or "auto") lets the CUDA kernels' layout choice stand; a layout name asks for that
//       compiled layout where it fits the call (CudaOptions in membar/kernels/attention.h), for
//       tests. The CPU implementation has a single layout and accepts only "".
//   MEMBAR_CPU_THREADS (a positive number) caps the CPU kernels' worker threads; it is read once,
//       here (CpuOptions), since the kernels read no environment.
//   page_summary(k_pool, k_page_index, history_tokens, with_bounds) -> (mean, min?, max?)
//   page_select(q, mean, min?, max?, top_k, query_tile_tokens) -> selected_pages
#include "attention_ops.h"

#include <cstdlib>
#include <string>

#include <ATen/ATen.h>

namespace membar::bindings::attention {

namespace k = membar::kernels;

namespace {

void check_cpu(const at::Tensor& q, const char* op) {
  TORCH_CHECK(q.device().is_cpu(), op, ": the CPU implementation got tensors on ", q.device(), ".");
}

// The CPU implementations accept no CUDA layout name.
void check_no_layout(const std::string& layout, const char* op) {
  TORCH_CHECK(layout.empty() || layout == "auto", op, ": layout=\"", layout,
              "\" names a layout of the CUDA kernels; the CPU implementation has one (pass \"\").");
}

// MEMBAR_CPU_THREADS, read when the first CPU attention op runs.
const k::CpuOptions& cpu_options() {
  static const k::CpuOptions options = [] {
    k::CpuOptions parsed;
    if (const char* text = std::getenv("MEMBAR_CPU_THREADS")) {
      char* end = nullptr;
      const long value = std::strtol(text, &end, 10);
      if (end != text && *end == '\0' && value >= 1 && value <= 65536) parsed.max_threads = int32_t(value);
    }
    return parsed;
  }();
  return options;
}

void check_kernel_status(int status, const char* op) {
  TORCH_CHECK(status != k::kCpuOutOfMemory, op, ": the CPU kernel could not allocate its work buffers.");
  TORCH_CHECK(status == 0, op, ": the CPU kernel rejected its parameters (status ", status,
              "); this is a bug in the bindings' checks.");
}

std::tuple<at::Tensor, at::Tensor> forward_cpu(const at::Tensor& q, const at::Tensor& k_chunk, const at::Tensor& v_chunk,
                                               const at::Tensor& k_pool, const at::Tensor& k_page_index,
                                               const at::Tensor& v_pool, const at::Tensor& v_page_index,
                                               int64_t history_tokens, double softmax_scale,
                                               const std::optional<at::Tensor>& selected_pages,
                                               int64_t query_tile_tokens, bool attend_chunk, const std::string& layout,
                                               double logit_softcap, int64_t sliding_window) {
  check_cpu(q, "paged_attention_forward");
  check_no_layout(layout, "paged_attention_forward");
  ForwardCall call = prepare_forward(q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index, history_tokens,
                                     softmax_scale, logit_softcap, sliding_window, selected_pages, query_tile_tokens,
                                     attend_chunk, /*check_index_values=*/true);
  check_kernel_status(k::cpu::paged_attention_forward(call.params, cpu_options()), "paged_attention_forward");
  return {call.out, call.lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(
    const at::Tensor& q, const at::Tensor& k_chunk, const at::Tensor& v_chunk, const at::Tensor& k_pool,
    const at::Tensor& k_page_index, const at::Tensor& v_pool, const at::Tensor& v_page_index, const at::Tensor& out,
    const at::Tensor& dout, const at::Tensor& lse, at::Tensor& dk_pool, const at::Tensor& dk_page_index,
    at::Tensor& dv_pool, const at::Tensor& dv_page_index, int64_t history_tokens, double softmax_scale,
    const std::optional<at::Tensor>& selected_pages, int64_t query_tile_tokens, bool deterministic,
    bool attend_chunk, const std::string& layout, double logit_softcap, int64_t sliding_window) {
  check_cpu(q, "paged_attention_backward");
  check_no_layout(layout, "paged_attention_backward");
  BackwardCall call = prepare_backward(q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index, out, dout, lse,
                                       dk_pool, dk_page_index, dv_pool, dv_page_index, history_tokens, softmax_scale,
                                       logit_softcap, sliding_window, selected_pages, query_tile_tokens, deterministic,
                                       attend_chunk, /*check_index_values=*/true);
  check_kernel_status(k::cpu::paged_attention_backward(call.params, cpu_options()), "paged_attention_backward");
  return {call.dq, call.dk_chunk, call.dv_chunk};
}

std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> summary_cpu(
    const at::Tensor& k_pool, const at::Tensor& k_page_index, int64_t history_tokens, bool with_bounds) {
  check_cpu(k_pool, "page_summary");
  SummaryCall call = prepare_summary(k_pool, k_page_index, history_tokens, with_bounds, /*check_index_values=*/true);
  check_kernel_status(k::cpu::page_summary(call.params, cpu_options()), "page_summary");
  return {call.mean, call.min, call.max};
}

at::Tensor select_cpu(const at::Tensor& q, const at::Tensor& mean, const std::optional<at::Tensor>& min,
                      const std::optional<at::Tensor>& max, int64_t top_k, int64_t query_tile_tokens) {
  check_cpu(q, "page_select");
  SelectCall call = prepare_select(q, mean, min, max, top_k, query_tile_tokens);
  check_kernel_status(k::cpu::page_select(call.params, cpu_options()), "page_select");
  return call.selected_pages;
}

// Meta (shape) functions: output shapes and dtypes only, no data is read.
std::tuple<at::Tensor, at::Tensor> forward_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, int64_t, double, const std::optional<at::Tensor>&,
                                                int64_t, bool, const std::string&, double, int64_t) {
  TORCH_CHECK(q.dim() == 3, "paged attention: q must have 3 dimensions [chunk_tokens, q_heads, head_dim].");
  return {at::empty_like(q, at::MemoryFormat::Contiguous),
          at::empty({q.size(1), q.size(0)}, q.options().dtype(lse_dtype_for(q.scalar_type())))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_meta(
    const at::Tensor& q, const at::Tensor& k_chunk, const at::Tensor& v_chunk, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
    const at::Tensor&, at::Tensor&, const at::Tensor&, int64_t, double, const std::optional<at::Tensor>&, int64_t, bool,
    bool, const std::string&, double, int64_t) {
  return {at::empty_like(q, at::MemoryFormat::Contiguous), at::empty_like(k_chunk, at::MemoryFormat::Contiguous),
          at::empty_like(v_chunk, at::MemoryFormat::Contiguous)};
}

std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> summary_meta(
    const at::Tensor& k_pool, const at::Tensor&, int64_t history_tokens, bool with_bounds) {
  TORCH_CHECK(k_pool.dim() == 4, "page summary: k_pool must have 4 dimensions.");
  const int64_t page_tokens = k_pool.size(1);
  const int64_t num_pages = (history_tokens + page_tokens - 1) / page_tokens;
  const auto options = k_pool.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({num_pages, k_pool.size(2), k_pool.size(3)}, options);
  if (!with_bounds) return {mean, std::nullopt, std::nullopt};
  return {mean, at::empty_like(mean), at::empty_like(mean)};
}

at::Tensor select_meta(const at::Tensor& q, const at::Tensor&, const std::optional<at::Tensor>&,
                       const std::optional<at::Tensor>&, int64_t top_k, int64_t query_tile_tokens) {
  TORCH_CHECK(query_tile_tokens >= 1, "page select: query_tile_tokens must be at least 1.");
  return at::empty({(q.size(0) + query_tile_tokens - 1) / query_tile_tokens, top_k}, q.options().dtype(at::kInt));
}

}  // namespace
}  // namespace membar::bindings::attention

TORCH_LIBRARY_FRAGMENT(membar, m) {
  m.def(
      "paged_attention_forward(Tensor q, Tensor k_chunk, Tensor v_chunk, Tensor k_pool, Tensor k_page_index, "
      "Tensor v_pool, Tensor v_page_index, int history_tokens, float softmax_scale, "
      "Tensor? selected_pages=None, int query_tile_tokens=128, bool attend_chunk=True, str layout=\"\", "
      "float logit_softcap=0., int sliding_window=0) -> (Tensor out, Tensor lse)");
  m.def(
      "paged_attention_backward(Tensor q, Tensor k_chunk, Tensor v_chunk, Tensor k_pool, Tensor k_page_index, "
      "Tensor v_pool, Tensor v_page_index, Tensor out, Tensor dout, Tensor lse, "
      "Tensor(a!) dk_pool, Tensor dk_page_index, Tensor(b!) dv_pool, Tensor dv_page_index, "
      "int history_tokens, float softmax_scale, Tensor? selected_pages=None, int query_tile_tokens=128, "
      "bool deterministic=False, bool attend_chunk=True, str layout=\"\", float logit_softcap=0., "
      "int sliding_window=0) "
      "-> (Tensor dq, Tensor dk_chunk, Tensor dv_chunk)");
  m.def(
      "page_summary(Tensor k_pool, Tensor k_page_index, int history_tokens, bool with_bounds=False) "
      "-> (Tensor mean, Tensor? min, Tensor? max)");
  m.def(
      "page_select(Tensor q, Tensor mean, Tensor? min, Tensor? max, int top_k, int query_tile_tokens=128) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(membar, CPU, m) {
  m.impl("paged_attention_forward", &membar::bindings::attention::forward_cpu);
  m.impl("paged_attention_backward", &membar::bindings::attention::backward_cpu);
  m.impl("page_summary", &membar::bindings::attention::summary_cpu);
  m.impl("page_select", &membar::bindings::attention::select_cpu);
}

TORCH_LIBRARY_IMPL(membar, Meta, m) {
  m.impl("paged_attention_forward", &membar::bindings::attention::forward_meta);
  m.impl("paged_attention_backward", &membar::bindings::attention::backward_meta);
  m.impl("page_summary", &membar::bindings::attention::summary_meta);
  m.impl("page_select", &membar::bindings::attention::select_meta);
}
