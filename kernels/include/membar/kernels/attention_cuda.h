// The CUDA attention kernels' contract beyond membar/kernels/attention.h, for the bindings and the
// tests: what the kernels support, the checks to run before a launch, and which compiled layout
// runs a call. Torch-free and CUDA-free; the launch functions are declared in attention.h.
//
// Support: dtype bf16 or fp16; head_dim 64, 96, 128 or 256; page_tokens 64 or 128; in sparse mode a
// query_tile_tokens that is a multiple of 64 (a query tile holds whole 64-row blocks, because
// every block of queries reads one selection row); 16-byte aligned tensors; any logit_softcap
// (Note [Soft-capped scores] in attention.h), in every layout.
//
// Note [Layout choice]
// Rationale: the fastest layout of an attention kernel depends on the GPU, the dtype, the head
// size and the mode, and is found by measuring. A library that compiles every contender and picks
// one at run time pays their compile time on every build and hides which one ran; FlashAttention-3
// (tile_size_fwd_sm90) and ggml (its fattn-mma config table) ship one tuned layout per case,
// chosen by a pure function.
// Approach: choose_forward_layout and choose_backward_layout are pure functions of the device
// (CudaTarget: compute capability, and whether the library holds the sm_90a bodies of the
// warpgroup kernels) and of the call (LayoutQuery: dtype, head_dim, page_tokens, sparse query
// tiles). The launch functions call them with the current device. The library compiles exactly
// their image (forward_layout_compiled, backward_layout_compiled): a layout no device and no call
// gets for a (dtype, head_dim) is not built for it, except the few opt-in pairs of
// kOptInBackwardLayouts: a layout written for a head size it does not run yet, compiled there so
// that the gpu tests (which run every compiled layout that fits a call against the chosen one and
// the reference) check it and the benches time it by name, before the choice takes it. CudaOptions
// may ask for another compiled layout
// (resolve_forward_layout); the bindings expose that for tests. A logit soft-cap is a template flag
// of the kernels, not a layout: every compiled layout is built twice, without and with a cap, and
// a call with logit_softcap > 0 runs the capped build of the layout chosen or asked for (the
// choice and resolve_*_layout do not look at the cap). The layouts that lost live in
// the sweep target (kernels/sweep/, run by bench/attention_sweep.py); docs/kernels.md keeps their
// measurements and one sentence each on why they lost.
// Limitations: the layouts were swept on an H200 at the Qwen2.5-7B attention shape (bf16,
// head_dim 128, pages of 128); on Hopper the warpgroup forward and backward at the other head
// sizes and fp16 were measured against SDPA flash and the mma.sync layouts (docs/kernels.md), not
// swept; the other GPUs' layouts were not tuned for them. The capped builds reuse the layouts that
// won without a cap (timed beside the uncapped ones, not tuned).
#pragma once

#include <cstddef>
#include <cstdint>

#include "membar/kernels/attention.h"

namespace membar::kernels::cuda {

// The device a layout is chosen for.
struct CudaTarget {
  int32_t compute_capability = 0;  // 10 * major + minor: 80 (A100), 90 (H100, H200)
  bool warpgroup_kernels = false;  // the library was built for sm_90a (the wgmma kernel bodies)
};

// What of a call the choice depends on.
struct LayoutQuery {
  DType dtype = DType::kBFloat16;
  int32_t head_dim = 0;
  int32_t page_tokens = 0;
  int32_t sparse_tile_tokens = 0;  // query_tile_tokens of a sparse selection; 0 when dense
};

inline LayoutQuery layout_query(const PagedAttentionShape& shape, const PageSelection& selection) {
  return LayoutQuery{shape.dtype, shape.head_dim, shape.page_tokens,
                     selection.enabled() ? selection.query_tile_tokens : 0};
}

// The dtypes and head sizes the CUDA kernels are compiled for (paged_attention_cuda_check refuses
// the others with a sentence).
constexpr bool cuda_dtype_supported(DType dtype) { return dtype == DType::kBFloat16 || dtype == DType::kFloat16; }
constexpr bool cuda_head_dim_supported(int32_t head_dim) {
  return head_dim == 64 || head_dim == 96 || head_dim == 128 || head_dim == 256;
}

// The layout dispatch runs for a call on `target` (Note [Layout choice]); meaningful for the
// supported dtypes and head sizes. With a logit soft-cap the same layout runs, capped.
constexpr ForwardLayout choose_forward_layout(const CudaTarget& target, const LayoutQuery& query) {
  const bool hopper = target.compute_capability == 90 && target.warpgroup_kernels;
  // Hopper, every dtype and head size, CTAs of 128 query rows (sparse tiles of 128k rows): the
  // warpgroup kernel. Head size 256: 64-key blocks in two stages (Q and three stages do not fit).
  if (hopper && query.sparse_tile_tokens % 128 == 0) {
    if (query.head_dim == 256) return ForwardLayout::kWgmmaW8R64K64S2;
    // Pages of 64: 64-key blocks; at head size 64 two CTAs an SM (1.07x the one-CTA 128-key
    // warpgroup layout on the H200).
    if (query.page_tokens % 128 != 0) {
      return query.head_dim == 64 ? ForwardLayout::kWgmmaW8R64K64S3TwoCtas : ForwardLayout::kWgmmaW8R64K64S3;
    }
    // Head sizes 64, 96 and 128, pages of 128: the warp-specialised forward (Note [Warp-specialised
    // forward]; on an H100 at 128 1.41x / 1.28x / 1.24x the warpgroup one at 32K / 128K / 256K
    // history (session 29), 1.45x / 1.35x / 1.25x (session 30); at 96 1.23x at 32K (session 30); on
    // the H200 at 64 1.33x the two-CTA layout at 32K (session 31)).
    return ForwardLayout::kWgmmaWsW12R64K128S2;
  }
  // Head size 256: Q and two stages of K and V fill the shared memory of a 64-row CTA.
  if (query.head_dim == 256) return ForwardLayout::kMmaW4R16K64S2;
  // A CTA's queries must lie inside one sparse tile: 128-row CTAs need tiles of 128k rows.
  if (query.sparse_tile_tokens % 128 != 0) return ForwardLayout::kMmaW4R16K64S3;
  // 128-key blocks lie inside pages of 128 only. Three stages of them take 224 KiB of shared
  // memory at head_dim 128, which Hopper has and an A100 (164 KiB) does not: before sm_90 the
  // 64-row layout with one K and one V buffer (80 KiB) runs them.
  if (query.page_tokens % 128 != 0) return ForwardLayout::kMmaW8R16K64S3;
  return target.compute_capability >= 90 ? ForwardLayout::kMmaW8R16K128S3 : ForwardLayout::kMmaW4R16K128S1;
}

constexpr BackwardLayout choose_backward_layout(const CudaTarget& target, const LayoutQuery& query) {
  // Hopper, head sizes 64, 96 and 128, pages of 128: the warpgroup kernel (Note [Warpgroup
  // backward]; on the H200 at 32K history 1.01x SDPA flash at 128 against the split layout's 0.78x,
  // 0.83x at 64 against 0.70x, 0.95x at 96 against 0.74x: session 26), every dtype, dense or sparse.
  // At 128 since session 32 the warp-specialised kernel (Note [Warp-specialised backward]; on an
  // H100 1.14x / 1.10x / 1.10x the warpgroup kernel at 32K / 128K / 256K history, 1.12x sparse).
  const bool hopper = target.compute_capability == 90 && target.warpgroup_kernels;
  if (hopper && query.head_dim == 128 && query.page_tokens == 128) return BackwardLayout::kWgmmaWsW12K128;
  if (hopper && query.head_dim != 256 && query.page_tokens == 128) return BackwardLayout::kWgmmaW8K128;
  // Head size 256: no warpgroup holds dK and dV of 64 keys x 256 columns in registers. On Hopper
  // 64 keys a CTA, each warpgroup keeping half the columns (Note [Warpgroup backward at head size
  // 256]); elsewhere 64 keys a CTA, in two passes of half the columns.
  if (hopper && query.head_dim == 256) return BackwardLayout::kWgmmaW8K64D2;
  if (query.head_dim == 256) return BackwardLayout::kMmaW4K64S2Halves;
  // Otherwise a CTA owns one page. At head_dim 128 the swizzled one-warp-per-16-keys kernel
  // spills; padded tiles or the split layout do not. The split layout needs whole 64-column
  // groups (head_dim 64 or 128).
  if (query.page_tokens == 64) {
    return query.head_dim == 128 ? BackwardLayout::kMmaW4K64Padded : BackwardLayout::kMmaW4K64;
  }
  return query.head_dim % 64 == 0 ? BackwardLayout::kMmaSplitK128S2 : BackwardLayout::kMmaW8K128;
}

// Whether `layout` can run a call at all (ignoring dtype and head_dim): its key blocks lie inside
// one page, its CTA's queries inside one sparse tile, and the device runs its instructions.
constexpr bool forward_layout_fits(ForwardLayout layout, const CudaTarget& target, const LayoutQuery& query) {
  const auto tiles_hold = [&](int32_t rows) { return query.sparse_tile_tokens % rows == 0; };
  switch (layout) {
    case ForwardLayout::kWgmmaW8R64K128S2:
    case ForwardLayout::kWgmmaWsW12R64K128S2:
      return target.compute_capability == 90 && target.warpgroup_kernels && tiles_hold(128) &&
             query.page_tokens % 128 == 0;
    case ForwardLayout::kWgmmaW8R64K64S3:
    case ForwardLayout::kWgmmaW8R64K64S2:
    case ForwardLayout::kWgmmaW8R64K64S3TwoCtas:
      return target.compute_capability == 90 && target.warpgroup_kernels && tiles_hold(128) &&
             query.page_tokens % 64 == 0;
    case ForwardLayout::kMmaW8R16K128S3:
      return tiles_hold(128) && query.page_tokens % 128 == 0;
    case ForwardLayout::kMmaW8R16K64S3:
      return tiles_hold(128) && query.page_tokens % 64 == 0;
    case ForwardLayout::kMmaW4R16K64S3:
    case ForwardLayout::kMmaW4R16K64S2:
      return tiles_hold(64) && query.page_tokens % 64 == 0;
    case ForwardLayout::kMmaW4R16K128S1:
      return tiles_hold(64) && query.page_tokens % 128 == 0;
    case ForwardLayout::kAuto:
      break;
  }
  return false;
}

constexpr bool backward_layout_fits(BackwardLayout layout, const CudaTarget& target, const LayoutQuery& query) {
  switch (layout) {
    case BackwardLayout::kMmaSplitK128S2:
    case BackwardLayout::kMmaW8K128:
      return query.page_tokens == 128;
    case BackwardLayout::kMmaW4K64:
    case BackwardLayout::kMmaW4K64Padded:
      return query.page_tokens == 64;
    case BackwardLayout::kMmaW4K64S2Halves:
      return query.page_tokens % 64 == 0;
    case BackwardLayout::kWgmmaW8K128:
    case BackwardLayout::kWgmmaWsW12K128:
      return target.compute_capability == 90 && target.warpgroup_kernels && query.page_tokens == 128;
    case BackwardLayout::kWgmmaW8K64D2:
      return target.compute_capability == 90 && target.warpgroup_kernels && query.page_tokens % 64 == 0;
    case BackwardLayout::kAuto:
      break;
  }
  return false;
}

namespace layout_detail {
// Every kind of device and call the choice distinguishes, for a given dtype and head_dim.
inline constexpr CudaTarget kTargets[] = {{80, false}, {90, false}, {90, true}};
inline constexpr int32_t kPageTokens[] = {64, 128};
inline constexpr int32_t kSparseTiles[] = {0, 64, 128};
}  // namespace layout_detail

// Opt-in forward (layout, head_dim) pairs (Note [Layout choice]), every supported dtype: the
// warpgroup forward at head sizes 96 and 128, which the warp-specialised one replaced there
// (sessions 29 and 30), kept so that the attention bench and the gpu tests run it beside the chosen
// one by name. (At head size 64 the two-CTA warpgroup forward it replaced for pages of 128 is still
// chosen for pages of 64, so it stays compiled without an entry here.)
struct OptInForwardLayout {
  ForwardLayout layout;
  int32_t head_dim;
};
inline constexpr OptInForwardLayout kOptInForwardLayouts[] = {{ForwardLayout::kWgmmaW8R64K128S2, 96},
                                                              {ForwardLayout::kWgmmaW8R64K128S2, 128}};

// Whether the library compiles `layout` for this dtype and head_dim: whether they are supported
// and choose_forward_layout returns it for some device and call of that dtype and head_dim (or it
// is opt-in there).
constexpr bool forward_layout_compiled(ForwardLayout layout, DType dtype, int32_t head_dim) {
  if (!cuda_dtype_supported(dtype) || !cuda_head_dim_supported(head_dim)) return false;
  for (const OptInForwardLayout& opt_in : kOptInForwardLayouts) {
    if (opt_in.layout == layout && opt_in.head_dim == head_dim) return true;
  }
  for (const CudaTarget& target : layout_detail::kTargets) {
    for (int32_t page_tokens : layout_detail::kPageTokens) {
      for (int32_t tile : layout_detail::kSparseTiles) {
        if (choose_forward_layout(target, LayoutQuery{dtype, head_dim, page_tokens, tile}) == layout) return true;
      }
    }
  }
  return false;
}

// Opt-in (layout, head_dim) pairs (Note [Layout choice]), every supported dtype: the warpgroup
// backward at head size 128, which the warp-specialised one replaced there (session 32), kept so that
// the attention bench and the gpu tests run it beside the chosen one by name.
struct OptInBackwardLayout {
  BackwardLayout layout;
  int32_t head_dim;
};
inline constexpr OptInBackwardLayout kOptInBackwardLayouts[] = {{BackwardLayout::kWgmmaW8K128, 128}};

constexpr bool backward_layout_compiled(BackwardLayout layout, DType dtype, int32_t head_dim) {
  if (!cuda_dtype_supported(dtype) || !cuda_head_dim_supported(head_dim)) return false;
  for (const OptInBackwardLayout& opt_in : kOptInBackwardLayouts) {
    if (opt_in.layout == layout && opt_in.head_dim == head_dim) return true;
  }
  for (const CudaTarget& target : layout_detail::kTargets) {
    for (int32_t page_tokens : layout_detail::kPageTokens) {
      for (int32_t tile : layout_detail::kSparseTiles) {
        if (choose_backward_layout(target, LayoutQuery{dtype, head_dim, page_tokens, tile}) == layout) return true;
      }
    }
  }
  return false;
}

// The layout that runs a call that asked for `requested` (kAuto: the chosen one). A layout with
// no build for the call runs the chosen one instead; with a logit soft-cap that includes the
// capped build, which every compiled layout has (Note [Layout choice]).
constexpr ForwardLayout resolve_forward_layout(ForwardLayout requested, const CudaTarget& target,
                                               const LayoutQuery& query) {
  if (requested != ForwardLayout::kAuto && forward_layout_compiled(requested, query.dtype, query.head_dim) &&
      forward_layout_fits(requested, target, query)) {
    return requested;
  }
  return choose_forward_layout(target, query);
}

constexpr BackwardLayout resolve_backward_layout(BackwardLayout requested, const CudaTarget& target,
                                                 const LayoutQuery& query) {
  if (requested != BackwardLayout::kAuto && backward_layout_compiled(requested, query.dtype, query.head_dim) &&
      backward_layout_fits(requested, target, query)) {
    return requested;
  }
  return choose_backward_layout(target, query);
}

// Every layout the library has, and their names (the layout grammar of docs/kernels.md).
inline constexpr ForwardLayout kForwardLayouts[] = {
    ForwardLayout::kWgmmaW8R64K128S2, ForwardLayout::kWgmmaW8R64K64S3, ForwardLayout::kMmaW8R16K128S3,
    ForwardLayout::kMmaW8R16K64S3, ForwardLayout::kMmaW4R16K64S3, ForwardLayout::kMmaW4R16K64S2,
    ForwardLayout::kMmaW4R16K128S1, ForwardLayout::kWgmmaW8R64K64S2, ForwardLayout::kWgmmaW8R64K64S3TwoCtas,
    ForwardLayout::kWgmmaWsW12R64K128S2};
inline constexpr BackwardLayout kBackwardLayouts[] = {BackwardLayout::kMmaSplitK128S2, BackwardLayout::kMmaW8K128,
                                                      BackwardLayout::kMmaW4K64, BackwardLayout::kMmaW4K64Padded,
                                                      BackwardLayout::kMmaW4K64S2Halves, BackwardLayout::kWgmmaW8K128,
                                                      BackwardLayout::kWgmmaWsW12K128, BackwardLayout::kWgmmaW8K64D2};

constexpr const char* forward_layout_name(ForwardLayout layout) {
  switch (layout) {
    case ForwardLayout::kAuto: return "auto";
    case ForwardLayout::kWgmmaW8R64K128S2: return "wgmma_w8r64_k128_s2";
    case ForwardLayout::kWgmmaW8R64K64S3: return "wgmma_w8r64_k64_s3";
    case ForwardLayout::kWgmmaW8R64K64S2: return "wgmma_w8r64_k64_s2";
    case ForwardLayout::kWgmmaW8R64K64S3TwoCtas: return "wgmma_w8r64_k64_s3_2cta";
    case ForwardLayout::kWgmmaWsW12R64K128S2: return "wgmma_ws_w12r64_k128_s2";
    case ForwardLayout::kMmaW8R16K128S3: return "w8r16_k128_s3_qreg_shift";
    case ForwardLayout::kMmaW8R16K64S3: return "w8r16_k64_s3_qreg_shift";
    case ForwardLayout::kMmaW4R16K64S3: return "w4r16_k64_s3";
    case ForwardLayout::kMmaW4R16K64S2: return "w4r16_k64_s2_shift_pad";
    case ForwardLayout::kMmaW4R16K128S1: return "w4r16_k128_s1_qreg_shift_2cta";
  }
  return "unknown";
}

constexpr const char* backward_layout_name(BackwardLayout layout) {
  switch (layout) {
    case BackwardLayout::kAuto: return "auto";
    case BackwardLayout::kMmaSplitK128S2: return "w8_k128_split_s2_pad";
    case BackwardLayout::kMmaW8K128: return "w8_k128_dq64";
    case BackwardLayout::kMmaW4K64: return "w4_k64_dq128";
    case BackwardLayout::kMmaW4K64Padded: return "w4_k64_dq128_pad";
    case BackwardLayout::kMmaW4K64S2Halves: return "w4_k64_dq32_pad_s2_d2";
    case BackwardLayout::kWgmmaW8K128: return "wgmma_w8_k128";
    case BackwardLayout::kWgmmaWsW12K128: return "wgmma_ws_w12_k128";
    case BackwardLayout::kWgmmaW8K64D2: return "wgmma_w8_k64_d2";
  }
  return "unknown";
}

namespace layout_detail {
constexpr bool same_name(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) {
    ++a;
    ++b;
  }
  return *a == *b;
}

template <typename Layout, int kCount>
constexpr bool layout_from_name(const char* name, const Layout (&layouts)[kCount], const char* (*name_of)(Layout),
                                Layout* layout) {
  if (name[0] == '\0' || same_name(name, "auto")) {
    *layout = Layout::kAuto;
    return true;
  }
  for (Layout candidate : layouts) {
    if (same_name(name, name_of(candidate))) {
      *layout = candidate;
      return true;
    }
  }
  return false;
}
}  // namespace layout_detail

// The layout called `name` ("" and "auto" are kAuto); false when no layout has that name.
constexpr bool forward_layout_from_name(const char* name, ForwardLayout* layout) {
  return layout_detail::layout_from_name(name, kForwardLayouts, &forward_layout_name, layout);
}

constexpr bool backward_layout_from_name(const char* name, BackwardLayout* layout) {
  return layout_detail::layout_from_name(name, kBackwardLayouts, &backward_layout_name, layout);
}

// Returns an empty string when the CUDA kernels support `shape` (and `selection`, which may be
// disabled), else a sentence saying what is not supported. Checks the shape only; pointers are
// checked by paged_attention_check_alignment.
const char* paged_attention_cuda_check(const PagedAttentionShape& shape, const PageSelection& selection);

// Returns an empty string when every non-null pointer is 16-byte aligned (the kernels copy
// 16-byte pieces), else a sentence naming the first misaligned one.
const char* paged_attention_check_alignment(const void* const* pointers, const char* const* names, int count);

// Page select keeps one score per history page in shared memory: the largest history (in pages)
// it accepts for a given number of q heads and head_dim.
int64_t page_select_max_pages(const PagedAttentionShape& shape);

#if defined(MEMBAR_WITH_CUDA)
// The current device of the calling thread, as choose_*_layout sees it (compute capability 0
// when there is none).
CudaTarget current_cuda_target();
#endif

}  // namespace membar::kernels::cuda
