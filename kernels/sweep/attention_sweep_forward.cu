// The forward entries of the sweep target (attention_sweep.h): the shipped warpgroup layouts, an
// experimental one and every measured mma.sync layout, by name, for bf16 and head_dim 128.
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "attention_cuda_internal.h"
#include "attention_sweep.h"
#include "attention_sweep_names.h"
#include "attention_tiles.cuh"

namespace membar::kernels::cuda::sweep {
namespace {

using Element = __nv_bfloat16;
constexpr int kHeadDim = 128;

// The mma.sync layouts, shipped ones first (docs/kernels.md has each one's measurements; the
// shipped w4r16_k64_s2_shift_pad runs head_dim 256, here it is timed at 128).
constexpr const char* kMmaNames[] = {
    layouts::MmaW8R16K128S3::kName,
    layouts::MmaW8R16K64S3::kName,
    layouts::MmaW4R16K64S3::kName,
    layouts::MmaW4R16K64S2::kName,
    layouts::MmaW4R16K128S1::kName,
    "w8r16_k64_s3",
    "w4r32_k64_s2_shift_2cta",
    "w4r32_k64_s2_skip_2cta",
    "w4r32_k64_s2_shift_2cta_seq",
    "w4r32_k64_s2_skip_2cta_seq",
    "w4r32_k64_s2_shift_2cta_lazy",
    "w4r16_k64_s2_qreg_skip_2cta",
    "w4r16_k64_s3_qreg_skip_2cta",
    "w4r16_k64_s2_qreg_shift_2cta",
    "w4r16_k64_s2_qreg_2cta",
    "w4r16_k64_s3_qreg_shift_2cta",
    "w4r16_k64_s2_qreg_shift_2cta_lazy",
    "w4r16_k64_s2_shift_2cta_lazy",
    "w4r16_k64_s2_qreg_shift_2cta_pad",
    "w4r16_k64_s3_qreg_skip_2cta_pipe",
    "w4r16_k64_s3_qreg_shift_2cta_pipe",
    "w4r16_k64_s3_shift_2cta_pipe",
    "w4r16_k64_s3_qreg_shift_2cta_pipe_lazy",
    "w4r16_k128_s1_qreg_shift_2cta_lazy",
    "w8r16_k128_s3_qreg_skip",
    "w8r16_k128_s2_qreg_skip",
    "w8r16_k128_s2_qreg_shift",
    "w8r16_k128_s3_qreg_shift_lazy",
    "w8r16_k64_s3_qreg_skip",
    "w8r16_k64_s3_qreg_shift_pipe",
    "w8r16_k64_s3_qreg_shift_lazy",
};
constexpr int kMmaCount = int(sizeof(kMmaNames) / sizeof(kMmaNames[0]));

// The sweep runs the shipped layouts from their names too: their fields must be what the names say.
static_assert(same_tile(forward_tile_from_name(layouts::MmaW8R16K128S3::kName).tile, layouts::MmaW8R16K128S3::kTile),
              "the shipped layout's fields match its name");
static_assert(same_tile(forward_tile_from_name(layouts::MmaW8R16K64S3::kName).tile, layouts::MmaW8R16K64S3::kTile),
              "the shipped layout's fields match its name");
static_assert(same_tile(forward_tile_from_name(layouts::MmaW4R16K64S3::kName).tile, layouts::MmaW4R16K64S3::kTile),
              "the shipped layout's fields match its name");
static_assert(same_tile(forward_tile_from_name(layouts::MmaW4R16K64S2::kName).tile, layouts::MmaW4R16K64S2::kTile),
              "the shipped layout's fields match its name");
static_assert(same_tile(forward_tile_from_name(layouts::MmaW4R16K128S1::kName).tile, layouts::MmaW4R16K128S1::kTile),
              "the shipped layout's fields match its name");

// The layout called kMmaNames[kIndex], as the kernel's template argument.
template <int kIndex>
struct NamedMmaLayout {
  static constexpr const char* kName = kMmaNames[kIndex];
  static_assert(forward_tile_from_name(kName).ok, "every name of kMmaNames follows the layout grammar");
  static constexpr detail::ForwardTile kTile = forward_tile_from_name(kName).tile;
};

constexpr Standing standing_of(const char* name) {
  ForwardLayout layout = ForwardLayout::kAuto;
  const bool shipped = forward_layout_from_name(name, &layout) && layout != ForwardLayout::kAuto &&
                       forward_layout_compiled(layout, DType::kBFloat16, kHeadDim);
  return shipped ? Standing::kShipped : Standing::kContender;
}

// The sweep compiles its layouts without a cap (Note [Soft-capped scores in raw units]) and times
// them without a sliding window.
bool is_bf16_d128(const PagedAttentionForwardParams& params) {
  return params.shape.dtype == DType::kBFloat16 && params.shape.head_dim == kHeadDim &&
         params.shape.logit_softcap == 0.f && params.shape.sliding_window == 0;
}

template <typename Tiling>
bool mma_fits(const PagedAttentionForwardParams& params) {
  return is_bf16_d128(params) && detail::forward_tile_fits<Tiling>(params);
}

template <typename Tiling>
int mma_run(const PagedAttentionForwardParams& params, void* stream) {
  const int error = forward_params_check(params);
  if (error != cudaSuccess) return error;
  if (!mma_fits<Tiling>(params)) return cudaErrorInvalidValue;
  return detail::launch_forward<Element, kHeadDim, Tiling>(params, static_cast<cudaStream_t>(stream));
}

template <typename Tiling>
int mma_resources(KernelResources* resources) {
  return kernel_resources(reinterpret_cast<const void*>(&detail::paged_attention_forward_kernel<Element, kHeadDim, Tiling>),
                      resources);
}

template <typename Tiling, ForwardLayout kLayout>
bool wgmma_fits(const PagedAttentionForwardParams& params) {
  return is_bf16_d128(params) &&
         forward_layout_fits(kLayout, current_cuda_target(), layout_query(params.shape, params.selection));
}

template <typename Tiling, ForwardLayout kLayout>
int wgmma_run(const PagedAttentionForwardParams& params, void* stream) {
  const int error = forward_params_check(params);
  if (error != cudaSuccess) return error;
  if (!wgmma_fits<Tiling, kLayout>(params)) return cudaErrorInvalidValue;
  return detail::warpgroup::launch_forward<Element, kHeadDim, Tiling>(params, static_cast<cudaStream_t>(stream));
}

template <typename Tiling>
int wgmma_resources(KernelResources* resources) {
  return kernel_resources(reinterpret_cast<const void*>(&detail::warpgroup::paged_attention_forward_wgmma_kernel<Element, kHeadDim, Tiling>),
                      resources);
}

// Experimental: the 64-key warpgroup layout with S of the next block issued before this block's
// softmax (Note [Softmax beside the next block's scores] in attention_forward_wgmma.cuh); it fits
// where wgmma_w8r64_k64_s3 does. Measured on the H200 (session 27): correct, 0.88-0.90x of
// wgmma_w8r64_k64_s3 (docs/kernels.md): kept in the sweep as the baseline of later overlap work.
struct WgmmaW8R64K64S3Overlap {
  static constexpr const char* kName = "wgmma_w8r64_k64_s3_overlap";
  static constexpr detail::warpgroup::WarpgroupForwardTile kTile = [] {
    detail::warpgroup::WarpgroupForwardTile tile;
    tile.keys_per_block = 64;
    tile.stages = 3;
    tile.overlap_softmax = true;
    return tile;
  }();
};

template <std::size_t... kIndex>
void append_mma_entries(std::vector<ForwardEntry>& entries, std::index_sequence<kIndex...>) {
  (entries.push_back(ForwardEntry{kMmaNames[kIndex], standing_of(kMmaNames[kIndex]),
                                  &mma_fits<NamedMmaLayout<int(kIndex)>>, &mma_run<NamedMmaLayout<int(kIndex)>>,
                                  &mma_resources<NamedMmaLayout<int(kIndex)>>}),
   ...);
}

const std::vector<ForwardEntry>& entries() {
  static const std::vector<ForwardEntry> all = [] {
    std::vector<ForwardEntry> list;
    list.push_back(ForwardEntry{layouts::WgmmaW8R64K128S2::kName, Standing::kShipped,
                                &wgmma_fits<layouts::WgmmaW8R64K128S2, ForwardLayout::kWgmmaW8R64K128S2>,
                                &wgmma_run<layouts::WgmmaW8R64K128S2, ForwardLayout::kWgmmaW8R64K128S2>,
                                &wgmma_resources<layouts::WgmmaW8R64K128S2>});
    list.push_back(ForwardEntry{layouts::WgmmaW8R64K64S3::kName, Standing::kShipped,
                                &wgmma_fits<layouts::WgmmaW8R64K64S3, ForwardLayout::kWgmmaW8R64K64S3>,
                                &wgmma_run<layouts::WgmmaW8R64K64S3, ForwardLayout::kWgmmaW8R64K64S3>,
                                &wgmma_resources<layouts::WgmmaW8R64K64S3>});
    list.push_back(ForwardEntry{WgmmaW8R64K64S3Overlap::kName, Standing::kExperimental,
                                &wgmma_fits<WgmmaW8R64K64S3Overlap, ForwardLayout::kWgmmaW8R64K64S3>,
                                &wgmma_run<WgmmaW8R64K64S3Overlap, ForwardLayout::kWgmmaW8R64K64S3>,
                                &wgmma_resources<WgmmaW8R64K64S3Overlap>});
    append_mma_entries(list, std::make_index_sequence<kMmaCount>());
    return list;
  }();
  return all;
}

}  // namespace

int kernel_resources(const void* kernel, KernelResources* resources) {
  cudaFuncAttributes attributes;
  const cudaError_t error = cudaFuncGetAttributes(&attributes, kernel);
  if (error != cudaSuccess) return error;
  resources->registers = attributes.numRegs;
  resources->local_bytes = int32_t(attributes.localSizeBytes);
  return cudaSuccess;
}

int forward_entry_count() { return int(entries().size()); }

const ForwardEntry* forward_entry(int index) {
  return index >= 0 && index < forward_entry_count() ? &entries()[size_t(index)] : nullptr;
}

}  // namespace membar::kernels::cuda::sweep
