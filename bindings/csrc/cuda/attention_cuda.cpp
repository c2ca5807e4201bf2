// CUDA implementations of the paged-attention ops (schemas and meta functions in
// bindings/csrc/attention_ops.cpp, shared validation in attention_prepare.cpp): validate, fill the
// kernel's params, launch on the current stream of q's device. The shape checks of prepare_* run
// first; then what the CUDA kernels support on top (paged_attention_cuda_check of
// membar/kernels/attention_cuda.h); then the page index values, read back in one small transfer
// once per index storage and version (Note [Checked page indices]), so that a bad index is an error
// and never an out-of-bounds access.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention_ops.h"
#include "membar/kernels/attention_cuda.h"

namespace membar::bindings::attention {
namespace {

namespace k = membar::kernels;

void check_cuda(const at::Tensor& tensor, const char* op) {
  TORCH_CHECK(tensor.is_cuda(), op, ": the CUDA implementation got a tensor on ", tensor.device(), ".");
}

// A window without attend_chunk, refused before anything else: on the H200 (session 19) this call
// crashed the process (segmentation fault) where the same refusal from prepare_forward's shape check
// raises on the CPU; not yet understood (bench/probes/window_refusal_probe.py reproduces it), so the
// CUDA ops refuse it here first, as the shape check would.
void check_window_call(int64_t sliding_window, bool attend_chunk, const char* op) {
  TORCH_CHECK(sliding_window <= 0 || attend_chunk, op, ": a sliding window needs attend_chunk: a call over a block of "
              "history alone does not know the queries' positions relative to it.");
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

// Every page index value must name a row of its pool (Note [Checked page indices]).
struct IndexRange {
  const at::Tensor* index;
  int64_t pool_pages;
  const char* name;
};

// Note [Checked page indices]
//   Rationale: a page index value outside its pool would make the kernels read or write out of
//   bounds, so every call checks them; but reading an index's [min, max] back to the host waits for
//   the GPU, and the trainer makes thousands of calls a step (every sparse history read, every page
//   summary), each then draining the stream and exposing the host's work between calls.
//   What: the trainer's indices are views of a few long-lived tensors (a store's page numbers, a
//   staging area's rows). So the bounds are read once per storage and version: on a call whose
//   index's storage is not known, the [min, max] of the whole storage (as int32) is read with the
//   call's own check, in the same transfer, and remembered with a weak reference to the storage (its
//   address cannot be reused while the entry lives) and the version counter's value. A later call
//   with any view of that storage at that version passes without a read when the storage's bounds
//   fit the pool. An in-place write through torch bumps the version (views share the counter) and
//   the next call reads again. Not seen: writes that bypass the index's version counter (raw
//   pointers from outside torch, or a write through `.data`, which has a counter of its own);
//   inference tensors have no version counter and are read every call.
//   Where: check_index_ranges; CheckedStorages holds at most kCheckedStorages entries.
struct CheckedStorage {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  uint32_t version = 0;
  int64_t low = 0, high = 0;
};

constexpr size_t kCheckedStorages = 64;
constexpr int64_t kMaxCheckedStorageValues = int64_t(1) << 24;   // bigger storages are read per call

class CheckedStorages {
 public:
  // The remembered bounds of index's storage, when known at its current version.
  std::optional<std::pair<int64_t, int64_t>> bounds(const at::Tensor& index) {
    if (!cacheable(index)) return std::nullopt;
    const std::lock_guard<std::mutex> lock(mutex_);
    const c10::StorageImpl* storage = index.storage().unsafeGetStorageImpl();
    const uint32_t version = index.unsafeGetTensorImpl()->version_counter().current_version();
    for (auto entry = entries_.begin(); entry != entries_.end();) {
      if (entry->storage.expired()) {
        entry = entries_.erase(entry);
        continue;
      }
      if (entry->storage._unsafe_get_target() == storage && entry->version == version) {
        return std::make_pair(entry->low, entry->high);
      }
      ++entry;
    }
    return std::nullopt;
  }

  void remember(const at::Tensor& index, int64_t low, int64_t high) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const c10::StorageImpl* storage = index.storage().unsafeGetStorageImpl();
    for (auto entry = entries_.begin(); entry != entries_.end(); ++entry) {
      if (entry->storage._unsafe_get_target() == storage) {
        entries_.erase(entry);
        break;
      }
    }
    if (entries_.size() >= kCheckedStorages) entries_.erase(entries_.begin());   // the oldest
    entries_.push_back({index.storage().getWeakStorageImpl(),
                        index.unsafeGetTensorImpl()->version_counter().current_version(), low, high});
  }

  static bool cacheable(const at::Tensor& index) {
    return index.unsafeGetTensorImpl()->version_counter().enabled() && !index.is_inference() &&
           index.storage().nbytes() % sizeof(int32_t) == 0 &&
           int64_t(index.storage().nbytes() / sizeof(int32_t)) <= kMaxCheckedStorageValues;
  }

  // The whole storage of index as an int32 tensor.
  static at::Tensor whole(const at::Tensor& index) {
    const int64_t values = int64_t(index.storage().nbytes() / sizeof(int32_t));
    return at::empty({0}, index.options()).set_(index.storage(), 0, {values}, {1});
  }

 private:
  std::mutex mutex_;
  std::vector<CheckedStorage> entries_;
};

CheckedStorages& checked_storages() {
  static CheckedStorages storages;
  return storages;
}

// Returns an empty string, or a sentence naming the first index out of range (the caller raises
// it). Indices whose storage's remembered bounds fit their pool need no read; the others' own
// [min, max] (and, where remembered later, their storage's) come back in one transfer.
std::string index_range_problem(const std::vector<IndexRange>& indices) {
  CheckedStorages& storages = checked_storages();
  std::vector<at::Tensor> bounds;
  std::vector<int> slot_of(indices.size(), -1), storage_slot_of(indices.size(), -1);
  for (size_t i = 0; i < indices.size(); ++i) {
    const at::Tensor& index = *indices[i].index;
    if (index.numel() == 0) continue;
    const auto known = storages.bounds(index);
    if (known && known->first >= 0 && known->second < indices[i].pool_pages) continue;
    slot_of[i] = int(bounds.size());
    bounds.push_back(at::stack({index.min(), index.max()}).to(at::kLong));
    if (!known && CheckedStorages::cacheable(index)) {
      const at::Tensor whole = CheckedStorages::whole(index);
      storage_slot_of[i] = int(bounds.size());
      bounds.push_back(at::stack({whole.min(), whole.max()}).to(at::kLong));
    }
  }
  if (bounds.empty()) return "";
  const at::Tensor host = at::stack(bounds).to(at::kCPU).contiguous();
  const int64_t* values = host.data_ptr<int64_t>();
  for (size_t i = 0; i < indices.size(); ++i) {
    if (storage_slot_of[i] >= 0) {
      storages.remember(*indices[i].index, values[2 * storage_slot_of[i]], values[2 * storage_slot_of[i] + 1]);
    }
  }
  for (size_t i = 0; i < indices.size(); ++i) {
    if (slot_of[i] < 0) continue;
    const int64_t low = values[2 * slot_of[i]], high = values[2 * slot_of[i] + 1];
    if (low < 0 || high >= indices[i].pool_pages) {
      return std::string(indices[i].name) + " holds values in [" + std::to_string(low) + ", " + std::to_string(high) +
             "] but its pool has " + std::to_string(indices[i].pool_pages) + " pages.";
    }
  }
  return "";
}

void check_index_ranges(const std::vector<IndexRange>& indices, const char* op) {
  const std::string problem = index_range_problem(indices);
  TORCH_CHECK(problem.empty(), op, ": ", problem);
}

// The names of the library's layouts of one kind ("forward" or "backward").
std::vector<std::string> layout_names(const std::string& kind) {
  TORCH_CHECK(kind == "forward" || kind == "backward", "attention_cuda_layouts: kind must be \"forward\" or \"backward\" (got \"",
              kind, "\").");
  std::vector<std::string> names;
  if (kind == "forward") {
    for (k::ForwardLayout layout : k::cuda::kForwardLayouts) names.push_back(k::cuda::forward_layout_name(layout));
  } else {
    for (k::BackwardLayout layout : k::cuda::kBackwardLayouts) names.push_back(k::cuda::backward_layout_name(layout));
  }
  return names;
}

std::string joined(const std::vector<std::string>& names) {
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

// The op's `layout` argument as CudaOptions: "" or "auto" leave the choice to the kernels, unless
// $MEMBAR_CUDA_FORWARD_LAYOUT / $MEMBAR_CUDA_BACKWARD_LAYOUT name a layout: a whole training step
// can then run another compiled layout (an A/B of a kernel inside the step, e.g. the split
// mma.sync backward against the warpgroup one on Hopper). Where the named layout does not fit a
// call, the chosen one runs (resolve_*_layout), as for the argument.
k::CudaOptions layout_options(const std::string& layout, bool forward, const char* op) {
  k::CudaOptions options;
  const char* variable = forward ? "MEMBAR_CUDA_FORWARD_LAYOUT" : "MEMBAR_CUDA_BACKWARD_LAYOUT";
  const char* from_environment = layout.empty() ? std::getenv(variable) : nullptr;
  const std::string name = from_environment != nullptr ? std::string(from_environment) : layout;
  const bool known = forward ? k::cuda::forward_layout_from_name(name.c_str(), &options.forward_layout)
                             : k::cuda::backward_layout_from_name(name.c_str(), &options.backward_layout);
  TORCH_CHECK(known, op, ": ", from_environment != nullptr ? std::string("$") + variable : std::string("layout"),
              "=\"", name, "\" names no layout of the CUDA kernels (known: ",
              joined(layout_names(forward ? "forward" : "backward")), ").");
  // $MEMBAR_CUDA_DQ_PASS=warpgroup: a deterministic backward's dQ pass before the warp-specialised
  // one (an A/B of the pass inside a step; Note [Warp-specialised dQ pass]).
  const char* dq_pass = forward ? nullptr : std::getenv("MEMBAR_CUDA_DQ_PASS");
  if (dq_pass != nullptr && *dq_pass != '\0') {
    const std::string pass(dq_pass);
    TORCH_CHECK(pass == "auto" || pass == "warpgroup", op, ": $MEMBAR_CUDA_DQ_PASS=\"", pass,
                "\" names no dQ pass (known: auto, warpgroup).");
    if (pass == "warpgroup") options.dq_pass = k::DqPass::kWarpgroup;
  }
  return options;
}

// The name of the layout the CUDA kernels choose on the current device for a call of this kind,
// dtype, head_dim, page_tokens and sparse tile size (0: dense).
std::string attention_cuda_layout(const std::string& kind, at::ScalarType dtype, int64_t head_dim, int64_t page_tokens,
                                  int64_t sparse_tile_tokens) {
  layout_names(kind);  // checks `kind`
  const k::cuda::LayoutQuery query{to_kernel_dtype(dtype, "dtype"), int32_t(head_dim), int32_t(page_tokens),
                                   int32_t(sparse_tile_tokens)};
  const k::cuda::CudaTarget target = k::cuda::current_cuda_target();
  return kind == "forward" ? k::cuda::forward_layout_name(k::cuda::choose_forward_layout(target, query))
                           : k::cuda::backward_layout_name(k::cuda::choose_backward_layout(target, query));
}

std::tuple<at::Tensor, at::Tensor> forward_cuda(const at::Tensor& q, const at::Tensor& k_chunk, const at::Tensor& v_chunk,
                                                const at::Tensor& k_pool, const at::Tensor& k_page_index,
                                                const at::Tensor& v_pool, const at::Tensor& v_page_index,
                                                int64_t history_tokens, double softmax_scale,
                                                const std::optional<at::Tensor>& selected_pages,
                                                int64_t query_tile_tokens, bool attend_chunk, const std::string& layout,
                                                double logit_softcap, int64_t sliding_window) {
  constexpr const char* kOp = "paged_attention_forward";
  check_cuda(q, kOp);
  check_window_call(sliding_window, attend_chunk, kOp);
  const k::CudaOptions options = layout_options(layout, /*forward=*/true, kOp);
  const c10::cuda::CUDAGuard guard(q.device());
  ForwardCall call = prepare_forward(q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index, history_tokens,
                                     softmax_scale, logit_softcap, sliding_window, selected_pages, query_tile_tokens,
                                     attend_chunk, /*check_index_values=*/false);
  const k::PagedAttentionForwardParams& p = call.params;
  check_supported(p.shape, p.selection, kOp);
  check_aligned({{p.q, "q"}, {p.k_chunk, "k_chunk"}, {p.v_chunk, "v_chunk"}, {p.history.k_pool, "k_pool"},
                 {p.history.v_pool, "v_pool"}, {p.out, "out"}},
                kOp);
  check_index_ranges({{&k_page_index, k_pool.size(0), "k_page_index"}, {&v_page_index, v_pool.size(0), "v_page_index"}},
                     kOp);
  check_launch(k::cuda::paged_attention_forward(p, at::cuda::getCurrentCUDAStream().stream(), options), kOp);
  return {call.out, call.lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(
    const at::Tensor& q, const at::Tensor& k_chunk, const at::Tensor& v_chunk, const at::Tensor& k_pool,
    const at::Tensor& k_page_index, const at::Tensor& v_pool, const at::Tensor& v_page_index, const at::Tensor& out,
    const at::Tensor& dout, const at::Tensor& lse, at::Tensor& dk_pool, const at::Tensor& dk_page_index,
    at::Tensor& dv_pool, const at::Tensor& dv_page_index, int64_t history_tokens, double softmax_scale,
    const std::optional<at::Tensor>& selected_pages, int64_t query_tile_tokens, bool deterministic,
    bool attend_chunk, const std::string& layout, double logit_softcap, int64_t sliding_window) {
  constexpr const char* kOp = "paged_attention_backward";
  check_cuda(q, kOp);
  check_window_call(sliding_window, attend_chunk, kOp);
  const k::CudaOptions options = layout_options(layout, /*forward=*/false, kOp);
  const c10::cuda::CUDAGuard guard(q.device());
  BackwardCall call = prepare_backward(q, k_chunk, v_chunk, k_pool, k_page_index, v_pool, v_page_index, out, dout, lse,
                                       dk_pool, dk_page_index, dv_pool, dv_page_index, history_tokens, softmax_scale,
                                       logit_softcap, sliding_window, selected_pages, query_tile_tokens, deterministic,
                                       attend_chunk, /*check_index_values=*/false);
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
  check_launch(k::cuda::paged_attention_backward(p, at::cuda::getCurrentCUDAStream().stream(), options), kOp);
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

// Only CUDA builds have kernel layouts (Note [Layout choice] in membar/kernels/attention_cuda.h):
//   attention_cuda_layouts("forward" | "backward") -> the names of the library's layouts;
//   attention_cuda_layout(kind, dtype, head_dim, page_tokens, sparse_tile_tokens) -> the one the
//       current device runs for such a call.
TORCH_LIBRARY_FRAGMENT(membar, m) {
  m.def("attention_cuda_layouts(str kind) -> str[]", &membar::bindings::attention::layout_names);
  m.def("attention_cuda_layout(str kind, ScalarType dtype, int head_dim, int page_tokens, int sparse_tile_tokens=0) "
        "-> str",
        &membar::bindings::attention::attention_cuda_layout);
}

TORCH_LIBRARY_IMPL(membar, CUDA, m) {
  m.impl("paged_attention_forward", &membar::bindings::attention::forward_cuda);
  m.impl("paged_attention_backward", &membar::bindings::attention::backward_cuda);
  m.impl("page_summary", &membar::bindings::attention::summary_cuda);
  m.impl("page_select", &membar::bindings::attention::select_cuda);
}
