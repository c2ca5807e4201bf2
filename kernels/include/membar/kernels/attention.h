// Paged attention for chunk-recurrent training (OOMB; docs/design.md, section "Attention").
//
// One call handles one chunk of one sequence and one layer:
//   queries   of the chunk           q        [chunk_tokens, num_q_heads,  head_dim]  (contiguous)
//   keys/values of the chunk itself  k_chunk  [chunk_tokens, num_kv_heads, head_dim]  (contiguous)
//                                    v_chunk  [chunk_tokens, num_kv_heads, head_dim]
//   history (all earlier tokens) as pages in page pools (a pool is [pool_pages, page_tokens,
//   num_kv_heads, head_dim], contiguous; one page = one pool row). History page p is pool row
//   k_page_index[p] of k_pool (v_page_index[p] of v_pool). The runtime maps a client's frames
//   into one virtual-address window, so the window itself serves as the pool.
// History token t lives in page t / page_tokens, row t % page_tokens; the last page may be
// partial (history_tokens need not be a multiple of page_tokens). Chunk token i sits at absolute
// position history_tokens + i. Every chunk query sees every history token (they are all earlier)
// and the chunk keys at or before its own position (causal). Keys are post-RoPE: position
// encoding is the caller's business. GQA: q head h reads kv head h / (num_q_heads / num_kv_heads).
//
// Sparse mode (selected_pages != nullptr): the queries of query tile j (rows
// [j * query_tile_tokens, (j+1) * query_tile_tokens)) see only the history pages listed in
// selected_pages[j * selected_per_tile .. +selected_per_tile) (entries < 0 are padding and are
// skipped; a page listed twice is an error the selection kernel never produces), plus the chunk's own
// keys causally. The same selection must be passed to the backward call.
//
// Blocked history (attend_chunk == false): the queries attend ONLY the given history pages, not
// the chunk's own keys, so that a caller can stream one layer's history through the GPU in blocks
// of pages and merge the partial results (Note [Blocked history]). k_chunk and v_chunk are not
// read (they may be null). The forward writes out and lse of that partial softmax. The backward
// must be given the FINAL out and lse of the rows (merged over every block and the chunk-only
// call, so that delta = rowsum(dout * out) and P = exp(S - lse) are the full softmax's): it ADDS
// this block's dK/dV into the grad pages and writes this block's contribution to dq; dk_chunk
// and dv_chunk are not written (they may be null). A query row that sees no key in a call
// (history_tokens == 0 with attend_chunk false, or a sparse tile listing only padding) gets
// out = 0 and lse = -inf, and contributes nothing in the backward; an lse of -inf given to the
// backward likewise means "no key", and the row contributes nothing.
//
// Note [Blocked history]
// Split the history into blocks of pages b = 1..B (each a slice of the page indices, with its own
// history_tokens; only the last block may end in a partial page). Forward: (out_b, lse_b) from a
// call per block with attend_chunk = false, plus (out_0, lse_0) from a chunk-only call
// (history_tokens = 0, attend_chunk = true). Then lse = logsumexp_b lse_b and
// out = sum_b exp(lse_b - lse) out_b (rows with lse_b = -inf weigh 0). Backward: call every block,
// and the chunk-only call, with that final (out, lse); dK/dV of each block's pages accumulate in
// place, and dq is the sum of the calls' dq. The result equals one call over the whole history up
// to rounding.
//
// Note [Soft-capped scores]
// Gemma 2 passes every scaled score s = softmax_scale * q.k through cap * tanh(s / cap) before the
// softmax (HF's attn_logit_softcapping). With shape.logit_softcap = cap > 0 the kernels do the same
// to every score before the causal mask; lse is then the log-sum-exp of the capped scores. In the
// backward dS of a capped score is multiplied by d(cap * tanh(s / cap)) / ds = 1 - tanh(s / cap)^2
// before it meets K or Q (the factor softmax_scale follows as without a cap). The CUDA kernels
// compute tanh(x) as 1 - 2 / (exp(2x) + 1) with the fast exponential (absolute error ~1e-7 cap in
// the capped score, far below bf16 rounding), not with tanh.approx (~5e-4). A cap changes no other rule:
// blocked history, sparse selections and lse = -inf for rows that see no key hold as before.
//
// Note [Sliding window]
// Mistral v0.1, Gemma 2/3's local layers and Qwen2 with use_sliding_window let a query see only the
// last W positions: HF masks key position p for the query at position q unless p > q - W (and
// p <= q, the causal rule). With shape.sliding_window = W > 0 the kernels apply the same rule with
// these positions: history key t (in page-table order) is at t, chunk key j at history_tokens + j,
// chunk query i at history_tokens + i. Positions are relative: a caller whose early history no
// query of the chunk can see passes only the pages from the first visible one (history_tokens then
// counts from that page's first row), and the distances, hence the mask, stay right. The window
// masks after the soft-cap (the cap is elementwise, so the order only matters for clarity) and
// before the softmax; in the backward a masked score contributes nothing to dQ, dK or dV. Every
// query sees at least itself, so no row of a windowed call has lse = -inf. Not supported (refused
// by the checks below): a sparse selection (its tiles pick pages by score, not by distance), and
// attend_chunk == false (a block of history does not know where the queries sit relative to it;
// a caller streaming history in blocks keeps windowed layers elsewhere).
//
// Element types: q, k_chunk, v_chunk, pages, out and dout share `dtype` (bf16 or fp16 on the GPU;
// the CPU reference also takes fp32 and fp64). Accumulation is fp32 (fp64 for fp64 inputs).
// lse is fp32 (fp64 for fp64 inputs), natural log, [num_q_heads, chunk_tokens].
//
// Launch functions return 0 (cudaSuccess / OK) or an error code; they never throw or exit.
// CPU functions return kCpuInvalidArgument when their params fail the checks below, before any
// output is written, and kCpuOutOfMemory when a work buffer cannot be allocated. CPU functions block: they run on
// the calling thread plus short-lived worker threads (CpuOptions::max_threads caps their number;
// 0 means std::thread::hardware_concurrency()). The CPU backward owns every key block in one
// task, so dK/dV are always the same bits on every run; with `deterministic` it computes dQ in a
// second pass that owns every query block (same bits too, 40% more work), without it it sums
// per-thread copies of dQ (dq may differ in its last bits between multi-threaded runs). CUDA
// functions enqueue on `stream` and return without waiting; what they support and which compiled
// layout runs a call is in membar/kernels/attention_cuda.h.
#pragma once

#include <cstdint>

#include "membar/kernels/dtype.h"

namespace membar::kernels {

struct PagedAttentionShape {
  int32_t chunk_tokens = 0;    // Tc >= 1
  int32_t history_tokens = 0;  // >= 0
  int32_t page_tokens = 0;     // >= 1 (CUDA: membar/kernels/attention_cuda.h)
  int32_t num_q_heads = 0;     // Hq, a multiple of num_kv_heads
  int32_t num_kv_heads = 0;    // Hkv
  int32_t head_dim = 0;        // 1 .. 256 (CUDA: membar/kernels/attention_cuda.h)
  float softmax_scale = 0.f;   // usually 1 / sqrt(head_dim)
  DType dtype = DType::kBFloat16;
  // Attention-logit soft-capping (Gemma 2): 0 = none; cap > 0 turns every scaled score
  // s = softmax_scale * q.k into cap * tanh(s / cap) before the masks and the softmax, and the
  // backward multiplies dS by its derivative 1 - tanh^2 (Note [Soft-capped scores]).
  float logit_softcap = 0.f;
  // Sliding-window (local) attention: 0 = none; W > 0 lets the query at position q see only the
  // keys at positions p > q - W (besides p <= q), as HF's sliding_window (Note [Sliding window]).
  int32_t sliding_window = 0;
  // false: attend only the history pages (Note [Blocked history]); k_chunk/v_chunk and
  // dk_chunk/dv_chunk are then neither read nor written and may be null.
  bool attend_chunk = true;

  int32_t num_history_pages() const { return (history_tokens + page_tokens - 1) / page_tokens; }
};

struct PageSelection {
  const int32_t* selected_pages = nullptr;  // [num_query_tiles, selected_per_tile], -1 = padding
  int32_t selected_per_tile = 0;
  int32_t query_tile_tokens = 0;             // rows of q per tile (e.g. 128)
  bool enabled() const { return selected_pages != nullptr; }
};

// The history's K and V pages (read only).
struct HistoryPages {
  const void* k_pool = nullptr;              // [*, page_tokens, Hkv, D], dtype
  const int32_t* k_page_index = nullptr;     // [num_history_pages]
  const void* v_pool = nullptr;              // [*, page_tokens, Hkv, D], dtype
  const int32_t* v_page_index = nullptr;     // [num_history_pages]
};

// The history's dK and dV pages, accumulated into (read-modify-write).
struct HistoryGradPages {
  void* dk_pool = nullptr;                   // [*, page_tokens, Hkv, D], grad_page_dtype
  const int32_t* dk_page_index = nullptr;    // [num_history_pages]
  void* dv_pool = nullptr;
  const int32_t* dv_page_index = nullptr;
};

// The compiled layouts of the CUDA kernels (Note [Layout choice] in membar/kernels/attention_cuda.h),
// each named after the layout grammar of docs/kernels.md.
enum class ForwardLayout : int32_t {
  kAuto = 0,              // the layout choose_forward_layout picks
  kWgmmaW8R64K128S2 = 1,  // "wgmma_w8r64_k128_s2": two warpgroups of 64 rows, 128-key blocks, 2 stages
  kWgmmaW8R64K64S3 = 2,   // "wgmma_w8r64_k64_s3": two warpgroups of 64 rows, 64-key blocks, 3 stages
  kMmaW8R16K128S3 = 3,    // "w8r16_k128_s3_qreg_shift": mma.sync, 8 warps of 16 rows, 128-key blocks
  kMmaW8R16K64S3 = 4,     // "w8r16_k64_s3_qreg_shift": mma.sync, 8 warps of 16 rows, 64-key blocks
  kMmaW4R16K64S3 = 5,     // "w4r16_k64_s3": mma.sync, 4 warps of 16 rows (sparse tiles of 64 rows)
  kMmaW4R16K64S2 = 6,     // "w4r16_k64_s2_shift_pad": mma.sync, 4 warps of 16 rows, 2 stages (head_dim 256)
  kMmaW4R16K128S1 = 7,    // "w4r16_k128_s1_qreg_shift_2cta": mma.sync, 4 warps of 16 rows, one K/V buffer
  kWgmmaW8R64K64S2 = 8,   // "wgmma_w8r64_k64_s2": two warpgroups of 64 rows, 64-key blocks, 2 stages (head_dim 256)
  kWgmmaW8R64K64S3TwoCtas = 9,  // "wgmma_w8r64_k64_s3_2cta": 64-key blocks, 3 stages, two CTAs an SM (head_dim 64)
  // "wgmma_ws_w12r64_k128_s2": a producer warpgroup and two consumer warpgroups of 64 rows taking
  // turns, 128-key blocks, 2 stages (Note [Warp-specialised forward]; Hopper, head_dim 64, 96 and 128)
  kWgmmaWsW12R64K128S2 = 10,
};
enum class BackwardLayout : int32_t {
  kAuto = 0,              // the layout choose_backward_layout picks
  kMmaSplitK128S2 = 1,    // "w8_k128_split_s2_pad": 8 warps per 128-key page, three warp layouts
  kMmaW8K128 = 2,         // "w8_k128_dq64": 8 warps of 16 keys per 128-key page
  kMmaW4K64 = 3,          // "w4_k64_dq128": 4 warps of 16 keys per 64-key page
  kMmaW4K64Padded = 4,    // "w4_k64_dq128_pad": the same with padded tiles (no spills at head_dim 128)
  kMmaW4K64S2Halves = 5,  // "w4_k64_dq32_pad_s2_d2": 64 keys a CTA (of a page of 64 or 128), 2 stages, dK/dV
                          // in two passes of head_dim / 2 columns (head_dim 256)
  kWgmmaW8K128 = 6,       // "wgmma_w8_k128": two warpgroups of 64 keys per 128-key page, wgmma (Hopper, head_dim 128)
  kWgmmaWsW12K128 = 7,    // "wgmma_ws_w12_k128": warp-specialised, a producer and two consumer warpgroups (Hopper, head_dim 128)
  kWgmmaW8K64D2 = 8,      // "wgmma_w8_k64_d2": 64 keys a CTA, wgmma, dK/dV/dQ columns split between two
                          // warpgroups (Hopper, head_dim 256)
};

// How a call runs, apart from what it computes (the params). Like ggml's compute plan (its thread
// count), these stay out of the params: the CUDA kernels take their params by value, and a
// forward params struct past 128 bytes once made a tuned mma.sync layout spill (with
// sliding_window it is 136 bytes, and no forward layout spills: docs/kernels.md).
enum class DqPass : int32_t { kAuto = 0, kWarpgroup = 1 };

struct CpuOptions {
  // Worker threads at most, the calling thread included (0: std::thread::hardware_concurrency()).
  int32_t max_threads = 0;
};
struct CudaOptions {
  // kAuto: the layout the choice picks. Another value asks for that layout, which runs where it is
  // compiled for the call's dtype and head_dim and fits the call (page size, sparse tiles,
  // device); elsewhere the chosen one runs. The bindings expose this for tests.
  ForwardLayout forward_layout = ForwardLayout::kAuto;
  BackwardLayout backward_layout = BackwardLayout::kAuto;
  // The dQ pass of a deterministic backward (Note [Warp-specialised dQ pass] in kernels/cuda/):
  // kAuto the chosen one, the warp-specialised pass on Hopper at head_dim 128 where it fits;
  // kWarpgroup the pass before it (one warpgroup a CTA on Hopper, mma.sync elsewhere).
  DqPass dq_pass = DqPass::kAuto;
};

struct PagedAttentionForwardParams {
  PagedAttentionShape shape;
  const void* q = nullptr;                // [Tc, Hq, D]
  const void* k_chunk = nullptr;          // [Tc, Hkv, D]
  const void* v_chunk = nullptr;          // [Tc, Hkv, D]
  HistoryPages history;
  PageSelection selection;
  void* out = nullptr;                    // [Tc, Hq, D], dtype
  void* lse = nullptr;                    // [Hq, Tc], fp32 (fp64 when dtype is fp64)
};

struct PagedAttentionBackwardParams {
  PagedAttentionShape shape;
  const void* q = nullptr;                // [Tc, Hq, D]
  const void* k_chunk = nullptr;          // [Tc, Hkv, D]
  const void* v_chunk = nullptr;          // [Tc, Hkv, D]
  HistoryPages history;                   // as in the forward
  PageSelection selection;                // the forward's selection
  const void* out = nullptr;              // [Tc, Hq, D], the forward's output (the final, merged one)
  const void* dout = nullptr;             // [Tc, Hq, D]
  const void* lse = nullptr;              // [Hq, Tc], the forward's lse (the final, merged one)
  void* dq = nullptr;                     // [Tc, Hq, D], dtype; overwritten
  void* dk_chunk = nullptr;               // [Tc, Hkv, D], dtype; overwritten (untouched without attend_chunk)
  void* dv_chunk = nullptr;               // [Tc, Hkv, D], dtype; overwritten (untouched without attend_chunk)
  // Gradient pages of the history: dK/dV of every attended history row is ADDED in place.
  // Rows past history_tokens in the last page are left untouched.
  HistoryGradPages grad_history;
  // fp32 (default) or bf16 (round to nearest even); the CPU reference also takes fp64 (used by
  // finite-difference and gradcheck tests of fp64 inputs).
  DType grad_page_dtype = DType::kFloat32;
  bool deterministic = false;             // same bits on every run for the same inputs
  void* workspace = nullptr;              // see paged_attention_backward_workspace_bytes
};

// Page summaries for sparse selection: per page and kv head, the mean of the page's valid key
// rows (fp32), and optionally the elementwise min and max (fp32).
struct PageSummaryParams {
  PagedAttentionShape shape;              // history_tokens, page_tokens, num_kv_heads, head_dim, dtype
  const void* k_pool = nullptr;           // as HistoryPages
  const int32_t* k_page_index = nullptr;
  float* mean = nullptr;                  // [num_history_pages, Hkv, D]
  float* min = nullptr;                   // optional, same shape
  float* max = nullptr;                   // optional, same shape
};

// Top-k history pages per query tile. Score of page p for tile j: the sum over q heads h of
// dot(mean of the tile's queries of head h, mean[p, kv(h)]) (or, with use_bounds, the sum over
// heads of the upper bound sum_d max(qbar_d * min_d, qbar_d * max_d)). The tile's queries are its
// valid rows (the last tile may be partial). Equal scores go to the lower page index. Output
// sorted ascending by page index; when fewer than k pages exist, the rest is -1.
struct PageSelectParams {
  PagedAttentionShape shape;
  const void* q = nullptr;                // [Tc, Hq, D]
  const float* mean = nullptr;            // [num_history_pages, Hkv, D]
  const float* min = nullptr;             // used when use_bounds
  const float* max = nullptr;
  bool use_bounds = false;
  int32_t top_k = 0;
  int32_t query_tile_tokens = 0;
  int32_t* selected_pages = nullptr;      // [ceil(Tc / query_tile_tokens), top_k]
};

inline constexpr int kCpuInvalidArgument = 1;  // the value of cudaErrorInvalidValue
inline constexpr int kCpuOutOfMemory = 2;      // the value of cudaErrorMemoryAllocation

// Validates params; returns an empty string when they are usable, else a sentence saying what is
// wrong (used by the bindings and the launchers before any memory is touched). It checks what
// every backend needs: positive sizes, num_q_heads a multiple of num_kv_heads, 1 <= head_dim <=
// 256, a finite positive softmax_scale, a sliding_window >= 0 (and none without attend_chunk)
// and sizes whose products fit the index types. Backends
// with narrower support (the CUDA kernels: paged_attention_cuda_check in
// membar/kernels/attention_cuda.h) check that on top.
const char* paged_attention_check_shape(const PagedAttentionShape& shape);

// Validates a sparse selection held in HOST memory: selected_per_tile >= 1, query_tile_tokens >= 1,
// every entry -1 or a history page number in [0, num_history_pages), and no page listed twice
// for one tile, and no sliding window (Note [Sliding window]). Returns an empty string when usable,
// else a sentence. A disabled selection (selected_pages == nullptr) is always usable.
const char* page_selection_check(const PagedAttentionShape& shape, const PageSelection& selection);

// Number of query tiles of a chunk: ceil(chunk_tokens / query_tile_tokens).
inline int32_t num_query_tiles(int32_t chunk_tokens, int32_t query_tile_tokens) {
  return (chunk_tokens + query_tile_tokens - 1) / query_tile_tokens;
}

namespace cpu {
int paged_attention_forward(const PagedAttentionForwardParams& params, const CpuOptions& options = {});
int paged_attention_backward(const PagedAttentionBackwardParams& params, const CpuOptions& options = {});
int page_summary(const PageSummaryParams& params, const CpuOptions& options = {});
int page_select(const PageSelectParams& params, const CpuOptions& options = {});
}  // namespace cpu

#if defined(MEMBAR_WITH_CUDA)
namespace cuda {
// Return cudaError_t values as int so that this header needs no CUDA include.
size_t paged_attention_backward_workspace_bytes(const PagedAttentionShape& shape);
int paged_attention_forward(const PagedAttentionForwardParams& params, void* stream, const CudaOptions& options = {});
int paged_attention_backward(const PagedAttentionBackwardParams& params, void* stream, const CudaOptions& options = {});
int page_summary(const PageSummaryParams& params, void* stream);
int page_select(const PageSelectParams& params, void* stream);
}  // namespace cuda
#endif

}  // namespace membar::kernels
