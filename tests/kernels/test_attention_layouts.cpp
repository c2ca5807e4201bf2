// The layout choice of the CUDA attention kernels (Note [Layout choice] in
// membar/kernels/attention_cuda.h): pure functions, so they run here without a GPU.
#include <gtest/gtest.h>

#include <string>

#include "membar/kernels/attention_cuda.h"

namespace {

namespace mk = membar::kernels;
using mk::BackwardLayout;
using mk::DType;
using mk::ForwardLayout;
using mk::cuda::backward_layout_compiled;
using mk::cuda::backward_layout_fits;
using mk::cuda::choose_backward_layout;
using mk::cuda::choose_forward_layout;
using mk::cuda::CudaTarget;
using mk::cuda::forward_layout_compiled;
using mk::cuda::forward_layout_fits;
using mk::cuda::LayoutQuery;
using mk::cuda::resolve_backward_layout;
using mk::cuda::resolve_forward_layout;

constexpr CudaTarget kHopper{90, true};
constexpr CudaTarget kHopperWithoutSm90a{90, false};
constexpr CudaTarget kAmpere{80, false};

TEST(AttentionLayouts, HopperRunsTheWarpgroupForwardForEveryDtypeAndHeadSize) {
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (int32_t head_dim : {96, 128}) {
      // Pages of 128: the warp-specialised forward.
      const ForwardLayout pages_128 = ForwardLayout::kWgmmaWsW12R64K128S2;
      EXPECT_EQ(pages_128, choose_forward_layout(kHopper, LayoutQuery{dtype, head_dim, 128, 0}));
      EXPECT_EQ(ForwardLayout::kWgmmaW8R64K64S3, choose_forward_layout(kHopper, LayoutQuery{dtype, head_dim, 64, 0}));
      EXPECT_EQ(pages_128, choose_forward_layout(kHopper, LayoutQuery{dtype, head_dim, 128, 256}));
      EXPECT_EQ(pages_128, choose_forward_layout(kHopper, LayoutQuery{dtype, head_dim, 128, 4096}));
    }
    for (int32_t head_dim : {64, 96, 128}) {
      // A CTA of 128 queries does not fit a sparse tile of 64 rows.
      EXPECT_EQ(ForwardLayout::kMmaW4R16K64S3, choose_forward_layout(kHopper, LayoutQuery{dtype, head_dim, 128, 64}));
      EXPECT_EQ(ForwardLayout::kMmaW4R16K64S3, choose_forward_layout(kHopper, LayoutQuery{dtype, head_dim, 128, 192}));
    }
    // Head size 64: the warp-specialised forward for pages of 128, two warpgroup CTAs an SM (a
    // 64 x 64 output leaves the registers for it) for pages of 64.
    EXPECT_EQ(ForwardLayout::kWgmmaWsW12R64K128S2, choose_forward_layout(kHopper, LayoutQuery{dtype, 64, 128, 0}));
    EXPECT_EQ(ForwardLayout::kWgmmaWsW12R64K128S2, choose_forward_layout(kHopper, LayoutQuery{dtype, 64, 128, 4096}));
    EXPECT_EQ(ForwardLayout::kWgmmaW8R64K64S3TwoCtas, choose_forward_layout(kHopper, LayoutQuery{dtype, 64, 64, 0}));
    // Head size 256: 64-key blocks in two stages, for pages of 64 and 128.
    for (int32_t page_tokens : {64, 128}) {
      EXPECT_EQ(ForwardLayout::kWgmmaW8R64K64S2, choose_forward_layout(kHopper, LayoutQuery{dtype, 256, page_tokens, 0}));
      EXPECT_EQ(ForwardLayout::kWgmmaW8R64K64S2, choose_forward_layout(kHopper, LayoutQuery{dtype, 256, page_tokens, 4096}));
      EXPECT_EQ(ForwardLayout::kMmaW4R16K64S2, choose_forward_layout(kHopper, LayoutQuery{dtype, 256, page_tokens, 64}));
    }
  }
}

TEST(AttentionLayouts, OtherDevicesRunMmaSync) {
  for (const CudaTarget& target : {kAmpere, kHopperWithoutSm90a}) {
    EXPECT_EQ(ForwardLayout::kMmaW8R16K64S3, choose_forward_layout(target, LayoutQuery{DType::kBFloat16, 128, 64, 0}));
  }
  // Three stages of 128-key blocks take more shared memory than an A100 has.
  EXPECT_EQ(ForwardLayout::kMmaW8R16K128S3,
            choose_forward_layout(kHopperWithoutSm90a, LayoutQuery{DType::kBFloat16, 128, 128, 0}));
  EXPECT_EQ(ForwardLayout::kMmaW4R16K128S1, choose_forward_layout(kAmpere, LayoutQuery{DType::kBFloat16, 128, 128, 0}));
  EXPECT_EQ(ForwardLayout::kMmaW4R16K128S1, choose_forward_layout(kAmpere, LayoutQuery{DType::kFloat16, 96, 128, 0}));
  for (int32_t head_dim : {64, 96, 128}) {
    EXPECT_EQ(ForwardLayout::kMmaW8R16K128S3,
              choose_forward_layout(kHopperWithoutSm90a, LayoutQuery{DType::kFloat16, head_dim, 128, 0}));
    EXPECT_EQ(ForwardLayout::kMmaW8R16K64S3,
              choose_forward_layout(kHopperWithoutSm90a, LayoutQuery{DType::kFloat16, head_dim, 64, 0}));
  }
  // Head size 256 runs 64-row CTAs before sm_90a, whatever the pages and sparse tiles.
  for (int32_t tile : {0, 64, 128}) {
    EXPECT_EQ(ForwardLayout::kMmaW4R16K64S2,
              choose_forward_layout(kHopperWithoutSm90a, LayoutQuery{DType::kBFloat16, 256, 128, tile}));
    EXPECT_EQ(ForwardLayout::kMmaW4R16K64S2, choose_forward_layout(kAmpere, LayoutQuery{DType::kFloat16, 256, 64, tile}));
  }
}

TEST(AttentionLayouts, BackwardFollowsThePageSizeAndHeadDim) {
  for (const CudaTarget& target : {kHopper, kHopperWithoutSm90a, kAmpere}) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
      // Head sizes 64 and 96 in pages of 128: the warpgroup kernel on Hopper with the sm_90a build
      // (dense and every sparse tile), 128 the warp-specialised one; the mma.sync layouts elsewhere.
      for (int32_t tile : {0, 64, 128}) {
        EXPECT_EQ(target.warpgroup_kernels ? BackwardLayout::kWgmmaWsW12K128 : BackwardLayout::kMmaSplitK128S2,
                  choose_backward_layout(target, LayoutQuery{dtype, 128, 128, tile}));
        EXPECT_EQ(target.warpgroup_kernels ? BackwardLayout::kWgmmaW8K128 : BackwardLayout::kMmaSplitK128S2,
                  choose_backward_layout(target, LayoutQuery{dtype, 64, 128, tile}));
        EXPECT_EQ(target.warpgroup_kernels ? BackwardLayout::kWgmmaW8K128 : BackwardLayout::kMmaW8K128,
                  choose_backward_layout(target, LayoutQuery{dtype, 96, 128, tile}));
      }
      EXPECT_EQ(BackwardLayout::kMmaW4K64Padded, choose_backward_layout(target, LayoutQuery{dtype, 128, 64, 0}));
      EXPECT_EQ(BackwardLayout::kMmaW4K64, choose_backward_layout(target, LayoutQuery{dtype, 64, 64, 64}));
      EXPECT_EQ(BackwardLayout::kMmaW4K64, choose_backward_layout(target, LayoutQuery{dtype, 96, 64, 0}));
      // Head size 256, pages of 64 or 128: 64 keys a CTA, the columns split between warpgroups on
      // Hopper with the sm_90a build, two passes of half the columns elsewhere.
      const BackwardLayout wide = target.warpgroup_kernels ? BackwardLayout::kWgmmaW8K64D2 : BackwardLayout::kMmaW4K64S2Halves;
      EXPECT_EQ(wide, choose_backward_layout(target, LayoutQuery{dtype, 256, 128, 0}));
      EXPECT_EQ(wide, choose_backward_layout(target, LayoutQuery{dtype, 256, 64, 64}));
    }
  }
}

// Every choice is a compiled layout that fits the call: the library never reaches a layout it did
// not build, nor one that cannot run the call.
TEST(AttentionLayouts, EveryChoiceIsCompiledAndFits) {
  for (const CudaTarget& target : {kHopper, kHopperWithoutSm90a, kAmpere}) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
      for (int32_t head_dim : {64, 96, 128, 256}) {
        for (int32_t page_tokens : {64, 128}) {
          for (int32_t tile : {0, 64, 128, 192, 256, 4096}) {
            const LayoutQuery query{dtype, head_dim, page_tokens, tile};
            SCOPED_TRACE(std::to_string(target.compute_capability) + " head_dim " + std::to_string(head_dim) +
                         " pages " + std::to_string(page_tokens) + " tile " + std::to_string(tile));
            const ForwardLayout forward = choose_forward_layout(target, query);
            EXPECT_TRUE(forward_layout_compiled(forward, dtype, head_dim));
            EXPECT_TRUE(forward_layout_fits(forward, target, query));
            const BackwardLayout backward = choose_backward_layout(target, query);
            EXPECT_TRUE(backward_layout_compiled(backward, dtype, head_dim));
            EXPECT_TRUE(backward_layout_fits(backward, target, query));
          }
        }
      }
    }
  }
}

TEST(AttentionLayouts, OnlyTheLayoutsDispatchReachesAreCompiled) {
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kWgmmaW8R64K128S2, DType::kBFloat16, 128));
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kWgmmaW8R64K128S2, DType::kFloat16, 96));
  // 128-key blocks and three stages do not fit beside a Q tile of head_dim 256.
  EXPECT_FALSE(forward_layout_compiled(ForwardLayout::kWgmmaW8R64K128S2, DType::kBFloat16, 256));
  EXPECT_FALSE(forward_layout_compiled(ForwardLayout::kWgmmaW8R64K64S3, DType::kFloat16, 256));
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kWgmmaW8R64K64S2, DType::kFloat16, 256));
  EXPECT_FALSE(forward_layout_compiled(ForwardLayout::kWgmmaW8R64K64S2, DType::kBFloat16, 128));
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kMmaW8R16K128S3, DType::kBFloat16, 128));
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kMmaW8R16K128S3, DType::kFloat16, 128));
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kMmaW8R16K128S3, DType::kFloat16, 96));
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kMmaW8R16K64S3, DType::kFloat16, 64));
  EXPECT_FALSE(forward_layout_compiled(ForwardLayout::kMmaW8R16K128S3, DType::kBFloat16, 256));
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kMmaW4R16K64S2, DType::kBFloat16, 256));
  EXPECT_FALSE(forward_layout_compiled(ForwardLayout::kMmaW4R16K64S2, DType::kBFloat16, 128));
  // The warp-specialised forward: chosen at head sizes 96 and 128 (both dtypes); the warpgroup
  // forward it replaced there stays compiled (opt-in). Asked for on Hopper with pages of 128 it
  // runs, elsewhere the choice does.
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kWgmmaW8R64K128S2, DType::kFloat16, 128));
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kWgmmaW8R64K128S2, DType::kBFloat16, 96));
  EXPECT_FALSE(forward_layout_compiled(ForwardLayout::kWgmmaW8R64K128S2, DType::kBFloat16, 64));
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kWgmmaWsW12R64K128S2, DType::kFloat16, 96));
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kWgmmaWsW12R64K128S2, DType::kBFloat16, 128));
  // Chosen at head size 64 too (pages of 128), where the two-CTA warpgroup forward stays chosen
  // for pages of 64.
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kWgmmaWsW12R64K128S2, DType::kBFloat16, 64));
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kWgmmaW8R64K64S3TwoCtas, DType::kFloat16, 64));
  EXPECT_TRUE(forward_layout_compiled(ForwardLayout::kWgmmaWsW12R64K128S2, DType::kFloat16, 128));
  EXPECT_FALSE(forward_layout_compiled(ForwardLayout::kWgmmaWsW12R64K128S2, DType::kBFloat16, 256));
  EXPECT_EQ(ForwardLayout::kWgmmaWsW12R64K128S2,
            resolve_forward_layout(ForwardLayout::kWgmmaWsW12R64K128S2, kHopper, LayoutQuery{DType::kBFloat16, 128, 128, 0}));
  EXPECT_EQ(ForwardLayout::kWgmmaW8R64K64S3,
            resolve_forward_layout(ForwardLayout::kWgmmaWsW12R64K128S2, kHopper, LayoutQuery{DType::kBFloat16, 128, 64, 0}));
  EXPECT_EQ(ForwardLayout::kMmaW8R16K128S3, resolve_forward_layout(ForwardLayout::kWgmmaWsW12R64K128S2,
                                                                   kHopperWithoutSm90a, LayoutQuery{DType::kBFloat16, 128, 128, 0}));
  EXPECT_TRUE(backward_layout_compiled(BackwardLayout::kMmaSplitK128S2, DType::kFloat16, 128));
  EXPECT_TRUE(backward_layout_compiled(BackwardLayout::kMmaSplitK128S2, DType::kBFloat16, 64));
  // The split layout needs whole 64-column groups.
  EXPECT_FALSE(backward_layout_compiled(BackwardLayout::kMmaSplitK128S2, DType::kBFloat16, 96));
  EXPECT_TRUE(backward_layout_compiled(BackwardLayout::kMmaW4K64S2Halves, DType::kFloat16, 256));
  EXPECT_FALSE(backward_layout_compiled(BackwardLayout::kMmaW4K64S2Halves, DType::kFloat16, 128));
  // The unpadded one-warp-per-16-keys kernel spills at head_dim 128: never compiled there.
  EXPECT_FALSE(backward_layout_compiled(BackwardLayout::kMmaW4K64, DType::kBFloat16, 128));
  EXPECT_FALSE(backward_layout_compiled(BackwardLayout::kMmaW8K128, DType::kBFloat16, 128));
  // The warpgroup backward is chosen at head sizes 64 and 96, opt-in at 128, in both dtypes; 256 it
  // cannot run.
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    EXPECT_TRUE(backward_layout_compiled(BackwardLayout::kWgmmaW8K128, dtype, 128));
    EXPECT_TRUE(backward_layout_compiled(BackwardLayout::kWgmmaW8K128, dtype, 64));
    EXPECT_TRUE(backward_layout_compiled(BackwardLayout::kWgmmaW8K128, dtype, 96));
    EXPECT_FALSE(backward_layout_compiled(BackwardLayout::kWgmmaW8K128, dtype, 256));
  }
  // Head size 256's warpgroup layout: there only.
  EXPECT_TRUE(backward_layout_compiled(BackwardLayout::kWgmmaW8K64D2, DType::kBFloat16, 256));
  EXPECT_TRUE(backward_layout_compiled(BackwardLayout::kWgmmaW8K64D2, DType::kFloat16, 256));
  EXPECT_FALSE(backward_layout_compiled(BackwardLayout::kWgmmaW8K64D2, DType::kBFloat16, 128));
  // The warp-specialised backward: chosen at 128 only; the warpgroup one it replaced there still runs
  // when asked for by name.
  EXPECT_TRUE(backward_layout_compiled(BackwardLayout::kWgmmaWsW12K128, DType::kFloat16, 128));
  EXPECT_TRUE(backward_layout_compiled(BackwardLayout::kWgmmaWsW12K128, DType::kBFloat16, 128));
  EXPECT_FALSE(backward_layout_compiled(BackwardLayout::kWgmmaWsW12K128, DType::kBFloat16, 64));
  EXPECT_FALSE(backward_layout_compiled(BackwardLayout::kWgmmaWsW12K128, DType::kBFloat16, 96));
  const LayoutQuery bf16_128{DType::kBFloat16, 128, 128, 0};
  EXPECT_EQ(BackwardLayout::kWgmmaWsW12K128, choose_backward_layout(kHopper, bf16_128));
  EXPECT_EQ(BackwardLayout::kWgmmaW8K128, resolve_backward_layout(BackwardLayout::kWgmmaW8K128, kHopper, bf16_128));
  // Asked for where it is not compiled, the chosen layout runs.
  const LayoutQuery bf16_64{DType::kBFloat16, 64, 128, 0};
  EXPECT_EQ(BackwardLayout::kWgmmaW8K128, resolve_backward_layout(BackwardLayout::kWgmmaWsW12K128, kHopper, bf16_64));
  // A head size the kernels do not support compiles nothing.
  for (int32_t head_dim : {32, 80, 160, 192}) {
    EXPECT_FALSE(mk::cuda::cuda_head_dim_supported(head_dim));
    for (ForwardLayout layout : mk::cuda::kForwardLayouts) EXPECT_FALSE(forward_layout_compiled(layout, DType::kBFloat16, head_dim));
    for (BackwardLayout layout : mk::cuda::kBackwardLayouts) EXPECT_FALSE(backward_layout_compiled(layout, DType::kFloat16, head_dim));
  }
}

TEST(AttentionLayouts, AskingForALayoutRunsItOnlyWhereItIsCompiledAndFits) {
  const LayoutQuery bf16_128{DType::kBFloat16, 128, 128, 0};
  // The layout another GPU would run, on Hopper: it runs.
  EXPECT_EQ(ForwardLayout::kMmaW8R16K128S3, resolve_forward_layout(ForwardLayout::kMmaW8R16K128S3, kHopper, bf16_128));
  EXPECT_EQ(ForwardLayout::kMmaW4R16K128S1, resolve_forward_layout(ForwardLayout::kMmaW4R16K128S1, kHopper, bf16_128));
  // Warpgroup layouts need Hopper and the sm_90a build; elsewhere the choice runs.
  EXPECT_EQ(ForwardLayout::kMmaW4R16K128S1, resolve_forward_layout(ForwardLayout::kWgmmaW8R64K128S2, kAmpere, bf16_128));
  EXPECT_EQ(ForwardLayout::kMmaW8R16K128S3,
            resolve_forward_layout(ForwardLayout::kWgmmaW8R64K128S2, kHopperWithoutSm90a, bf16_128));
  // Not compiled for this head size: the choice runs.
  const LayoutQuery fp16_256{DType::kFloat16, 256, 128, 0};
  EXPECT_EQ(ForwardLayout::kWgmmaW8R64K64S2, resolve_forward_layout(ForwardLayout::kMmaW8R16K128S3, kHopper, fp16_256));
  // 128-key blocks do not fit pages of 64.
  const LayoutQuery pages_64{DType::kBFloat16, 128, 64, 0};
  EXPECT_EQ(ForwardLayout::kWgmmaW8R64K64S3, resolve_forward_layout(ForwardLayout::kWgmmaW8R64K128S2, kHopper, pages_64));
  EXPECT_EQ(BackwardLayout::kMmaW4K64Padded, resolve_backward_layout(BackwardLayout::kMmaSplitK128S2, kHopper, pages_64));
  EXPECT_EQ(BackwardLayout::kMmaW4K64Padded, resolve_backward_layout(BackwardLayout::kWgmmaW8K128, kHopper, pages_64));
  // The split layout asked for on Hopper runs (the tests compare it with the warpgroup one); the
  // warpgroup layout asked for without the sm_90a build or before Hopper does not.
  EXPECT_EQ(BackwardLayout::kMmaSplitK128S2, resolve_backward_layout(BackwardLayout::kMmaSplitK128S2, kHopper, bf16_128));
  EXPECT_EQ(BackwardLayout::kWgmmaWsW12K128, resolve_backward_layout(BackwardLayout::kAuto, kHopper, bf16_128));
  EXPECT_EQ(BackwardLayout::kMmaSplitK128S2, resolve_backward_layout(BackwardLayout::kWgmmaW8K128, kAmpere, bf16_128));
  EXPECT_EQ(BackwardLayout::kMmaSplitK128S2,
            resolve_backward_layout(BackwardLayout::kWgmmaW8K128, kHopperWithoutSm90a, bf16_128));
  EXPECT_EQ(ForwardLayout::kWgmmaWsW12R64K128S2, resolve_forward_layout(ForwardLayout::kAuto, kHopper, bf16_128));
  EXPECT_EQ(ForwardLayout::kWgmmaW8R64K128S2, resolve_forward_layout(ForwardLayout::kWgmmaW8R64K128S2, kHopper, bf16_128));
}

TEST(AttentionLayouts, NamesRoundTrip) {
  for (ForwardLayout layout : mk::cuda::kForwardLayouts) {
    ForwardLayout parsed = ForwardLayout::kAuto;
    EXPECT_TRUE(mk::cuda::forward_layout_from_name(mk::cuda::forward_layout_name(layout), &parsed));
    EXPECT_EQ(layout, parsed);
  }
  for (BackwardLayout layout : mk::cuda::kBackwardLayouts) {
    BackwardLayout parsed = BackwardLayout::kAuto;
    EXPECT_TRUE(mk::cuda::backward_layout_from_name(mk::cuda::backward_layout_name(layout), &parsed));
    EXPECT_EQ(layout, parsed);
  }
  ForwardLayout forward = ForwardLayout::kMmaW8R16K64S3;
  EXPECT_TRUE(mk::cuda::forward_layout_from_name("", &forward));
  EXPECT_EQ(ForwardLayout::kAuto, forward);
  EXPECT_TRUE(mk::cuda::forward_layout_from_name("auto", &forward));
  EXPECT_FALSE(mk::cuda::forward_layout_from_name("w4r32_k64_s2_shift_2cta", &forward));  // a contender
  BackwardLayout backward = BackwardLayout::kAuto;
  EXPECT_TRUE(mk::cuda::backward_layout_from_name("wgmma_w8_k128", &backward));
  EXPECT_EQ(BackwardLayout::kWgmmaW8K128, backward);
  EXPECT_FALSE(mk::cuda::backward_layout_from_name("w8_k128_split_s3_pad", &backward));  // a contender
}

}  // namespace
