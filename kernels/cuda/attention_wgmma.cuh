// The warpgroup-MMA (wgmma) building blocks of the Hopper attention kernels: matrix descriptors,
// wgmma fences, the m64n64k16 / m64n128k16 products in bf16 and the swizzled tile copy of
// Note [Warpgroup shared layout] (attention_forward_wgmma.cuh). Shared by the warpgroup forward
// and the experimental warpgroup backward of the sweep target (kernels/sweep/). Internal to kernels/.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention_common.cuh"

namespace membar::kernels::cuda::detail {

// The device code exists only for sm_90a (the host pass parses it too, so that every name is used).
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MEMBAR_WGMMA_AVAILABLE 1
#else
#define MEMBAR_WGMMA_AVAILABLE 0
#endif

#if MEMBAR_WGMMA_AVAILABLE
inline constexpr int kRowBytes = 128;  // one 64-dim half row of bf16

// The matrix descriptor of Note [Warpgroup shared layout], 128-byte swizzle.
__device__ __forceinline__ uint64_t matrix_descriptor(uint32_t shared_address, uint32_t leading_bytes,
                                                      uint32_t stride_bytes) {
  return uint64_t((shared_address & 0x3FFFFu) >> 4) | (uint64_t((leading_bytes >> 4) & 0x3FFFu) << 16) |
         (uint64_t((stride_bytes >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes (cp.async) visible to the async proxy.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Tells the compiler that the registers of `d` may change here, so that no read of an
// accumulator moves across a wgmma wait (the hardware writes them asynchronously).
template <int kN>
__device__ __forceinline__ void fence_registers(float (&d)[kN][4]) {
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[n][j])::"memory");
  }
}

// d[64 x 64] (+)= A[64 x 16] * B[16 x 64], A and B from shared memory (both K-major); with
// accumulate == 0 the previous d is ignored.
__device__ __forceinline__ void wgmma_m64n64k16_shared(float (&d)[8][4], uint64_t a_descriptor,
                                                      uint64_t b_descriptor, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(a_descriptor), "l"(b_descriptor), "r"(accumulate));
}

// d[64 x 128] (+)= A[64 x 16] * B[16 x 128], A and B from shared memory (both K-major); with
// accumulate == 0 the previous d is ignored.
__device__ __forceinline__ void wgmma_m64n128k16_shared(float (&d)[16][4], uint64_t a_descriptor,
                                                      uint64_t b_descriptor, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "l"(a_descriptor), "l"(b_descriptor), "r"(accumulate));
}

// d[64 x 128] += A[64 x 16] * B[16 x 128], A from registers (Note [Fragment layouts] per warp),
// B from shared memory MN-major (the transpose bit set).
__device__ __forceinline__ void wgmma_m64n128k16_registers_transposed_b(float (&d)[16][4], const uint32_t (&a)[4],
                                                                       uint64_t b_descriptor) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_descriptor), "r"(1));
}

// Copies rows [0, kTileRows) of a strided [*, 128] bf16 matrix into the two-half swizzled layout
// of Note [Warpgroup shared layout]: row r starts at base + r * row_stride (elements) when
// r < valid_rows, and is zero-filled otherwise. 16 pieces of 16 bytes per row, 256 threads: one
// pass copies 16 rows, so a thread's swizzle phase (row % 8) is the same on every pass.
// kCopyThreads: the threads of the CTA that copy (all of them).
template <int kTileRows, int kCopyThreads = 256>
__device__ __forceinline__ void load_swizzled_tile(unsigned char* tile, const __nv_bfloat16* base, int64_t row_stride,
                                                   int valid_rows, int thread) {
  constexpr int kRowsPerPass = kCopyThreads / 16;
  static_assert(kTileRows % kRowsPerPass == 0, "every thread copies the same number of pieces");
  const int piece = thread % 16;
  const int first_row = thread / 16;
  const int half = piece / 8;
  const int swizzled_piece = (piece % 8) ^ (first_row % 8);
  unsigned char* destination = tile + half * kTileRows * kRowBytes + first_row * kRowBytes + swizzled_piece * 16;
  const __nv_bfloat16* source = base + int64_t(first_row) * row_stride + piece * 8;
  const int64_t pass_stride = int64_t(kRowsPerPass) * row_stride;
#pragma unroll
  for (int pass = 0; pass < kTileRows / kRowsPerPass; ++pass) {
    const bool valid = first_row + pass * kRowsPerPass < valid_rows;
    copy_async_16(destination + pass * kRowsPerPass * kRowBytes, valid ? source + pass * pass_stride : base, valid);
  }
}

#endif  // MEMBAR_WGMMA_AVAILABLE

}  // namespace membar::kernels::cuda::detail
