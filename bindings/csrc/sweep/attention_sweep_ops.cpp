// The torch module of the sweep target (kernels/sweep/attention_sweep.h): every measured layout of
// the CUDA attention kernels by name, for bench/attention_sweep.py and
// tests/python/test_attention_wgmma_backward.py, which load it with torch.ops.load_library. It is
// not part of membar/_C.so. Ops (namespace membar_sweep):
//   layouts(str kind) -> (str[] names, str[] standings)        kind "forward" or "backward";
//       standing "shipped", "contender" or "experimental", shipped layouts first
//   resources(str kind, str layout) -> (int registers, int local_bytes)   of its main kernel
//   paged_attention_forward(str layout, <membar::paged_attention_forward's arguments>) -> (out, lse)
//   paged_attention_backward(str layout, <membar::paged_attention_backward's arguments>)
//       -> (dq, dk_chunk, dv_chunk)
// Unlike the library, a layout that does not fit the call is an error, not a fallback. Page index
// values are not read back and checked: the callers build them.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "attention_ops.h"
#include "attention_sweep.h"
#include "membar/kernels/attention_cuda.h"

namespace membar::bindings::attention {
namespace {

namespace k = membar::kernels;
namespace sweep = membar::kernels::cuda::sweep;

const char* standing_name(sweep::Standing standing) {
  switch (standing) {
    case sweep::Standing::kShipped: return "shipped";
    case sweep::Standing::kContender: return "contender";
    case sweep::Standing::kExperimental: return "experimental";
  }
  return "unknown";
}

void check_kind(const std::string& kind) {
  TORCH_CHECK(kind == "forward" || kind == "backward", "membar_sweep: kind must be \"forward\" or \"backward\" (got \"",
              kind, "\").");
}

const sweep::ForwardEntry& forward_entry(const std::string& name) {
  for (int i = 0; i < sweep::forward_entry_count(); ++i) {
    if (name == sweep::forward_entry(i)->name) return *sweep::forward_entry(i);
  }
  TORCH_CHECK(false, "membar_sweep: no forward layout is called \"", name, "\".");
}

const sweep::BackwardEntry& backward_entry(const std::string& name) {
  for (int i = 0; i < sweep::backward_entry_count(); ++i) {
    if (name == sweep::backward_entry(i)->name) return *sweep::backward_entry(i);
  }
  TORCH_CHECK(false, "membar_sweep: no backward layout is called \"", name, "\".");
}

std::tuple<std::vector<std::string>, std::vector<std::string>> layouts(const std::string& kind) {
  check_kind(kind);
  std::vector<std::string> names, standings;
  const int count = kind == "forward" ? sweep::forward_entry_count() : sweep::backward_entry_count();
  for (int i = 0; i < count; ++i) {
    const char* name = kind == "forward" ? sweep::forward_entry(i)->name : sweep::backward_entry(i)->name;
    const sweep::Standing standing =
        kind == "forward" ? sweep::forward_entry(i)->standing : sweep::backward_entry(i)->standing;
    names.push_back(name);
    standings.push_back(standing_name(standing));
  }
  return {names, standings};
}

std::tuple<int64_t, int64_t> resources(const std::string& kind, const std::string& name) {
  check_kind(kind);
  sweep::KernelResources result;
  const int error = kind == "forward" ? forward_entry(name).resources(&result) : backward_entry(name).resources(&result);
  TORCH_CHECK(error == 0, "membar_sweep: cudaFuncGetAttributes failed for ", name, ": ",
              cudaGetErrorString(static_cast<cudaError_t>(error)), ".");
  return {result.registers, result.local_bytes};
}

void check_supported(const k::PagedAttentionShape& shape, const k::PageSelection& selection, const char* op) {
  const char* problem = k::cuda::paged_attention_cuda_check(shape, selection);
  TORCH_CHECK(problem[0] == '\0', op, ": ", problem);
}

std::tuple<at::Tensor, at::Tensor> forward(const std::string& layout, const at::Tensor& q, const at::Tensor& k_chunk,
                                           const at::Tensor& v_chunk, const at::Tensor& k_pool,
                                           const at::Tensor& k_page_index, const at::Tensor& v_pool,
                                           const at::Tensor& v_page_index, int64_t history_tokens,
                                           double softmax_scale, const std::optional<at::Tensor>& selected_pages,
                                           int64_t query_tile_tokens, bool attend_chunk) {
  constexpr const char* kOp = "membar_sweep::paged_attention_forward";
  TORCH_CHECK(q.is_cuda(), kOp, ": the sweep runs on a CUDA device (q is on ", q.device(), ").");
  const sweep::ForwardEntry& entry = forward_entry(layout);
  const c10::cuda::CUDAGuard guard(q.device());
  ForwardCall call = prepare_forward(q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index, history_tokens,
                                     softmax_scale, /*logit_softcap=*/0.0, /*sliding_window=*/0, selected_pages,
                                     query_tile_tokens, attend_chunk, /*check_index_values=*/false);
  check_supported(call.params.shape, call.params.selection, kOp);
  TORCH_CHECK(entry.fits(call.params), kOp, ": the layout ", layout, " does not fit this call or device.");
  const int error = entry.run(call.params, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(error == 0, kOp, ": ", layout, " failed to launch: ", cudaGetErrorString(static_cast<cudaError_t>(error)),
              ".");
  return {call.out, call.lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    const std::string& layout, const at::Tensor& q, const at::Tensor& k_chunk, const at::Tensor& v_chunk,
    const at::Tensor& k_pool, const at::Tensor& k_page_index, const at::Tensor& v_pool, const at::Tensor& v_page_index,
    const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse, at::Tensor& dk_pool,
    const at::Tensor& dk_page_index, at::Tensor& dv_pool, const at::Tensor& dv_page_index, int64_t history_tokens,
    double softmax_scale, const std::optional<at::Tensor>& selected_pages, int64_t query_tile_tokens,
    bool deterministic, bool attend_chunk) {
  constexpr const char* kOp = "membar_sweep::paged_attention_backward";
  TORCH_CHECK(q.is_cuda(), kOp, ": the sweep runs on a CUDA device (q is on ", q.device(), ").");
  const sweep::BackwardEntry& entry = backward_entry(layout);
  const c10::cuda::CUDAGuard guard(q.device());
  BackwardCall call = prepare_backward(q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index, out, dout, lse,
                                       dk_pool, dk_page_index, dv_pool, dv_page_index, history_tokens, softmax_scale,
                                       /*logit_softcap=*/0.0, /*sliding_window=*/0, selected_pages, query_tile_tokens,
                                       deterministic, attend_chunk, /*check_index_values=*/false);
  k::PagedAttentionBackwardParams& p = call.params;
  check_supported(p.shape, p.selection, kOp);
  TORCH_CHECK(entry.fits(p), kOp, ": the layout ", layout, " does not fit this call or device.");
  const at::Tensor workspace =
      at::empty({int64_t(k::cuda::paged_attention_backward_workspace_bytes(p.shape))}, q.options().dtype(at::kByte));
  p.workspace = workspace.data_ptr();
  const int error = entry.run(p, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(error == 0, kOp, ": ", layout, " failed to launch: ", cudaGetErrorString(static_cast<cudaError_t>(error)),
              ".");
  return {call.dq, call.dk_chunk, call.dv_chunk};
}

}  // namespace
}  // namespace membar::bindings::attention

TORCH_LIBRARY(membar_sweep, m) {
  m.def("layouts(str kind) -> (str[] names, str[] standings)", &membar::bindings::attention::layouts);
  m.def("resources(str kind, str layout) -> (int registers, int local_bytes)", &membar::bindings::attention::resources);
  m.def(
      "paged_attention_forward(str layout, Tensor q, Tensor k_chunk, Tensor v_chunk, Tensor k_pool, "
      "Tensor k_page_index, Tensor v_pool, Tensor v_page_index, int history_tokens, float softmax_scale, "
      "Tensor? selected_pages=None, int query_tile_tokens=128, bool attend_chunk=True) -> (Tensor out, Tensor lse)");
  m.def(
      "paged_attention_backward(str layout, Tensor q, Tensor k_chunk, Tensor v_chunk, Tensor k_pool, "
      "Tensor k_page_index, Tensor v_pool, Tensor v_page_index, Tensor out, Tensor dout, Tensor lse, "
      "Tensor(a!) dk_pool, Tensor dk_page_index, Tensor(b!) dv_pool, Tensor dv_page_index, "
      "int history_tokens, float softmax_scale, Tensor? selected_pages=None, int query_tile_tokens=128, "
      "bool deterministic=False, bool attend_chunk=True) -> (Tensor dq, Tensor dk_chunk, Tensor dv_chunk)");
}

TORCH_LIBRARY_IMPL(membar_sweep, CUDA, m) {
  m.impl("paged_attention_forward", &membar::bindings::attention::forward);
  m.impl("paged_attention_backward", &membar::bindings::attention::backward);
}
