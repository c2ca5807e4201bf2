// The shipped layouts of the CUDA attention kernels (Note [Layout choice] in
// membar/kernels/attention_cuda.h): one type per ForwardLayout / BackwardLayout, named as the
// enum, with the layout's name (docs/kernels.md) in kName and its named fields in kTile. The
// kernels take the type: nvcc cannot instantiate a kernel on a reference to a constant inside a
// namespace. Internal to kernels/: attention_forward.cu and attention_backward.cu dispatch to
// them, kernels/sweep/ times them against the contenders.
#pragma once

#include "attention_backward_kernel.cuh"
#include "attention_forward_kernel.cuh"
#include "attention_forward_wgmma.cuh"
#include "attention_forward_wgmma_ws.cuh"

namespace membar::kernels::cuda::layouts {

// Forward (attention_forward_wgmma.cuh and attention_forward_kernel.cuh).
struct WgmmaW8R64K128S2 {
  static constexpr const char* kName = "wgmma_w8r64_k128_s2";
  static constexpr detail::warpgroup::WarpgroupForwardTile kTile = [] {
    detail::warpgroup::WarpgroupForwardTile tile;
    tile.keys_per_block = 128;
    tile.stages = 2;
    return tile;
  }();
};

struct WgmmaW8R64K64S3 {
  static constexpr const char* kName = "wgmma_w8r64_k64_s3";
  static constexpr detail::warpgroup::WarpgroupForwardTile kTile = [] {
    detail::warpgroup::WarpgroupForwardTile tile;
    tile.keys_per_block = 64;
    tile.stages = 3;
    return tile;
  }();
};

struct WgmmaW8R64K64S2 {
  static constexpr const char* kName = "wgmma_w8r64_k64_s2";
  static constexpr detail::warpgroup::WarpgroupForwardTile kTile = [] {
    detail::warpgroup::WarpgroupForwardTile tile;
    tile.keys_per_block = 64;
    tile.stages = 2;
    return tile;
  }();
};

struct WgmmaW8R64K64S3TwoCtas {
  static constexpr const char* kName = "wgmma_w8r64_k64_s3_2cta";
  static constexpr detail::warpgroup::WarpgroupForwardTile kTile = [] {
    detail::warpgroup::WarpgroupForwardTile tile;
    tile.keys_per_block = 64;
    tile.stages = 3;
    tile.ctas_per_sm = 2;
    return tile;
  }();
};

struct WgmmaWsW12R64K128S2 {
  static constexpr const char* kName = "wgmma_ws_w12r64_k128_s2";
  static constexpr detail::warpgroup_ws::WarpSpecialisedForwardTile kTile = [] {
    detail::warpgroup_ws::WarpSpecialisedForwardTile tile;
    tile.keys_per_block = 128;
    tile.k_stages = 2;
    tile.v_stages = 2;
    return tile;
  }();
};

struct MmaW8R16K128S3 {
  static constexpr const char* kName = "w8r16_k128_s3_qreg_shift";
  static constexpr detail::ForwardTile kTile = [] {
    detail::ForwardTile tile;
    tile.warps = 8;
    tile.row_tiles_per_warp = 1;
    tile.keys_per_block = 128;
    tile.stages = 3;
    tile.q_in_registers = true;
    tile.shift_indexing = true;
    return tile;
  }();
};

struct MmaW8R16K64S3 {
  static constexpr const char* kName = "w8r16_k64_s3_qreg_shift";
  static constexpr detail::ForwardTile kTile = [] {
    detail::ForwardTile tile;
    tile.warps = 8;
    tile.row_tiles_per_warp = 1;
    tile.keys_per_block = 64;
    tile.stages = 3;
    tile.q_in_registers = true;
    tile.shift_indexing = true;
    return tile;
  }();
};

struct MmaW4R16K64S3 {
  static constexpr const char* kName = "w4r16_k64_s3";
  static constexpr detail::ForwardTile kTile = [] {
    detail::ForwardTile tile;
    tile.warps = 4;
    tile.row_tiles_per_warp = 1;
    tile.keys_per_block = 64;
    tile.stages = 3;
    return tile;
  }();
};

struct MmaW4R16K64S2 {
  static constexpr const char* kName = "w4r16_k64_s2_shift_pad";
  static constexpr detail::ForwardTile kTile = [] {
    detail::ForwardTile tile;
    tile.warps = 4;
    tile.row_tiles_per_warp = 1;
    tile.keys_per_block = 64;
    tile.stages = 2;
    tile.shift_indexing = true;
    tile.padded_tiles = true;
    return tile;
  }();
};

struct MmaW4R16K128S1 {
  static constexpr const char* kName = "w4r16_k128_s1_qreg_shift_2cta";
  static constexpr detail::ForwardTile kTile = [] {
    detail::ForwardTile tile;
    tile.warps = 4;
    tile.row_tiles_per_warp = 1;
    tile.keys_per_block = 128;
    tile.stages = 1;
    tile.ctas_per_sm = 2;
    tile.q_in_registers = true;
    tile.shift_indexing = true;
    return tile;
  }();
};

// Backward dK/dV (attention_backward_kernel.cuh).
struct MmaSplitK128S2 {
  static constexpr const char* kName = "w8_k128_split_s2_pad";
  static constexpr detail::BackwardSplitTile kTile = [] {
    detail::BackwardSplitTile tile;
    tile.stages = 2;
    tile.padded_tiles = true;
    return tile;
  }();
};

struct MmaW8K128 {
  static constexpr const char* kName = "w8_k128_dq64";
  static constexpr detail::BackwardKeysTile kTile = [] {
    detail::BackwardKeysTile tile;
    tile.warps = 8;
    tile.dq_pieces = 1;
    return tile;
  }();
};

struct MmaW4K64 {
  static constexpr const char* kName = "w4_k64_dq128";
  static constexpr detail::BackwardKeysTile kTile = [] {
    detail::BackwardKeysTile tile;
    tile.warps = 4;
    tile.dq_pieces = 1;
    return tile;
  }();
};

struct MmaW4K64Padded {
  static constexpr const char* kName = "w4_k64_dq128_pad";
  static constexpr detail::BackwardKeysTile kTile = [] {
    detail::BackwardKeysTile tile;
    tile.warps = 4;
    tile.dq_pieces = 1;
    tile.padded_tiles = true;
    return tile;
  }();
};

struct MmaW4K64S2Halves {
  static constexpr const char* kName = "w4_k64_dq32_pad_s2_d2";
  static constexpr detail::BackwardKeysTile kTile = [] {
    detail::BackwardKeysTile tile;
    tile.warps = 4;
    tile.dq_pieces = 2;
    tile.padded_tiles = true;
    tile.stages = 2;
    tile.dim_parts = 2;
    tile.page_parts = true;
    return tile;
  }();
};

}  // namespace membar::kernels::cuda::layouts
