// The backward entries of the sweep target (attention_sweep.h): the measured dK/dV layouts by name,
// the shipped Hopper one (Note [Warpgroup backward]) first, for bf16 and head_dim 128. Each runs the
// whole backward of the library (detail::run_backward) around its dK/dV kernel.
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "attention_backward_wgmma.cuh"
#include "attention_cuda_internal.h"
#include "attention_sweep.h"
#include "attention_sweep_names.h"
#include "attention_tiles.cuh"

namespace membar::kernels::cuda::sweep {
namespace {

using Element = __nv_bfloat16;
constexpr int kHeadDim = 128;

// The split layouts (Note [Backward split layout]), shipped one first, then the layouts with one
// warp per 16 keys (Note [Backward kernel]). Pages of 128 keys: w4_k64 layouts do not fit the
// sweep's shape and are left out.
constexpr const char* kSplitNames[] = {
    layouts::MmaSplitK128S2::kName, "w8_k128_split_s3_pad",     "w8_k128_split_s2",
    "w8_k128_split_s3",             "w8_k128_split_s2_pad_dq4", "w8_k128_split_s3_pad_dq4",
};
constexpr const char* kKeysNames[] = {"w8_k128_dq64", "w8_k128_dq32", "w8_k128_dq64_pad"};

// The shipped one-warp-per-16-keys layouts' fields are what their names say.
constexpr bool same_keys_tile(const detail::BackwardKeysTile& a, const detail::BackwardKeysTile& b) {
  return a.warps == b.warps && a.dq_pieces == b.dq_pieces && a.padded_tiles == b.padded_tiles &&
         a.stages == b.stages && a.dim_parts == b.dim_parts;
}
static_assert(same_keys_tile(backward_keys_tile_from_name(layouts::MmaW8K128::kName).tile, layouts::MmaW8K128::kTile) &&
                  same_keys_tile(backward_keys_tile_from_name(layouts::MmaW4K64::kName).tile, layouts::MmaW4K64::kTile) &&
                  same_keys_tile(backward_keys_tile_from_name(layouts::MmaW4K64Padded::kName).tile,
                                 layouts::MmaW4K64Padded::kTile) &&
                  same_keys_tile(backward_keys_tile_from_name(layouts::MmaW4K64S2Halves::kName).tile,
                                 layouts::MmaW4K64S2Halves::kTile),
              "the shipped layouts' fields match their names");
constexpr int kSplitCount = int(sizeof(kSplitNames) / sizeof(kSplitNames[0]));
constexpr int kKeysCount = int(sizeof(kKeysNames) / sizeof(kKeysNames[0]));

static_assert(backward_split_tile_from_name(layouts::MmaSplitK128S2::kName).tile.stages ==
                      layouts::MmaSplitK128S2::kTile.stages &&
                  backward_split_tile_from_name(layouts::MmaSplitK128S2::kName).tile.padded_tiles ==
                      layouts::MmaSplitK128S2::kTile.padded_tiles &&
                  backward_split_tile_from_name(layouts::MmaSplitK128S2::kName).tile.quad_dq_atomics ==
                      layouts::MmaSplitK128S2::kTile.quad_dq_atomics,
              "the shipped layout's fields match its name");

template <int kIndex>
struct NamedSplitLayout {
  static constexpr const char* kName = kSplitNames[kIndex];
  static_assert(backward_split_tile_from_name(kName).ok, "every name of kSplitNames follows the layout grammar");
  static constexpr detail::BackwardSplitTile kTile = backward_split_tile_from_name(kName).tile;
};

template <int kIndex>
struct NamedKeysLayout {
  static constexpr const char* kName = kKeysNames[kIndex];
  static_assert(backward_keys_tile_from_name(kName).ok, "every name of kKeysNames follows the layout grammar");
  static constexpr detail::BackwardKeysTile kTile = backward_keys_tile_from_name(kName).tile;
};

constexpr Standing standing_of(const char* name) {
  BackwardLayout layout = BackwardLayout::kAuto;
  const bool shipped = backward_layout_from_name(name, &layout) && layout != BackwardLayout::kAuto &&
                       backward_layout_compiled(layout, DType::kBFloat16, kHeadDim);
  return shipped ? Standing::kShipped : Standing::kContender;
}

// Both kinds of layout own one page of keys per CTA: 128 keys here. The sweep compiles its
// layouts without a cap (Note [Soft-capped scores in raw units]) and times them without a sliding
// window.
bool fits_pages_of_128(const PagedAttentionBackwardParams& params) {
  return params.shape.dtype == DType::kBFloat16 && params.shape.head_dim == kHeadDim &&
         params.shape.page_tokens == 128 && params.shape.logit_softcap == 0.f && params.shape.sliding_window == 0;
}

template <detail::KvLaunch kLaunch>
int run_with(const PagedAttentionBackwardParams& params, void* stream) {
  const int error = backward_params_check(params);
  if (error != cudaSuccess) return error;
  if (!fits_pages_of_128(params)) return cudaErrorInvalidValue;
  return detail::run_backward(params, kLaunch, static_cast<cudaStream_t>(stream));
}

template <typename Tiling>
int split_resources(KernelResources* resources) {
  return kernel_resources(
      reinterpret_cast<const void*>(&detail::paged_attention_backward_split_kernel<Element, kHeadDim, Tiling>), resources);
}

template <typename Tiling>
int keys_resources(KernelResources* resources) {
  return kernel_resources(reinterpret_cast<const void*>(&detail::paged_attention_backward_kv_kernel<Element, kHeadDim, Tiling>),
                      resources);
}

// The warpgroup layout runs on Hopper with the sm_90a body built (as the library's choice).
bool fits_warpgroup(const PagedAttentionBackwardParams& params) {
  const CudaTarget target = current_cuda_target();
  return fits_pages_of_128(params) && target.compute_capability == 90 && target.warpgroup_kernels;
}

int warpgroup_run(const PagedAttentionBackwardParams& params, void* stream) {
  const int error = backward_params_check(params);
  if (error != cudaSuccess) return error;
  if (!fits_warpgroup(params)) return cudaErrorInvalidValue;
  return detail::run_backward(params, &detail::warpgroup::launch_backward_kv<Element, kHeadDim, false>,
                              static_cast<cudaStream_t>(stream));
}

int warpgroup_resources(KernelResources* resources) {
  return kernel_resources(
      reinterpret_cast<const void*>(&detail::warpgroup::paged_attention_backward_wgmma_kernel<Element, kHeadDim, false>),
      resources);
}

template <std::size_t... kIndex>
void append_split_entries(std::vector<BackwardEntry>& entries, std::index_sequence<kIndex...>) {
  (entries.push_back(BackwardEntry{kSplitNames[kIndex], standing_of(kSplitNames[kIndex]), &fits_pages_of_128,
                                   &run_with<&detail::launch_kv_split<Element, kHeadDim, NamedSplitLayout<int(kIndex)>>>,
                                   &split_resources<NamedSplitLayout<int(kIndex)>>}),
   ...);
}

template <std::size_t... kIndex>
void append_keys_entries(std::vector<BackwardEntry>& entries, std::index_sequence<kIndex...>) {
  (entries.push_back(BackwardEntry{kKeysNames[kIndex], standing_of(kKeysNames[kIndex]), &fits_pages_of_128,
                                   &run_with<&detail::launch_kv<Element, kHeadDim, NamedKeysLayout<int(kIndex)>>>,
                                   &keys_resources<NamedKeysLayout<int(kIndex)>>}),
   ...);
}

const std::vector<BackwardEntry>& entries() {
  static const std::vector<BackwardEntry> all = [] {
    std::vector<BackwardEntry> list;
    list.push_back(BackwardEntry{"wgmma_w8_k128", standing_of("wgmma_w8_k128"), &fits_warpgroup, &warpgroup_run,
                                 &warpgroup_resources});
    append_split_entries(list, std::make_index_sequence<kSplitCount>());
    append_keys_entries(list, std::make_index_sequence<kKeysCount>());
    return list;
  }();
  return all;
}

}  // namespace

int backward_entry_count() { return int(entries().size()); }

const BackwardEntry* backward_entry(int index) {
  return index >= 0 && index < backward_entry_count() ? &entries()[size_t(index)] : nullptr;
}

}  // namespace membar::kernels::cuda::sweep
