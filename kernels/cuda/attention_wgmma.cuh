// The warpgroup-MMA (wgmma) building blocks of the Hopper attention kernels: matrix descriptors,
// wgmma fences, the m64n32k16 / m64n64k16 / m64n128k16 products in bf16 and fp16 and the swizzled tile copy of
// Note [Warpgroup shared layout] (attention_forward_wgmma.cuh). Shared by the warpgroup forward
// and the experimental warpgroup backward of the sweep target (kernels/sweep/). Internal to kernels/.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "attention_common.cuh"

namespace membar::kernels::cuda::detail {

// The device code exists only for sm_90a (the host pass parses it too, so that every name is used).
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MEMBAR_WGMMA_AVAILABLE 1
#else
#define MEMBAR_WGMMA_AVAILABLE 0
#endif

#if MEMBAR_WGMMA_AVAILABLE
inline constexpr int kRowBytes = 128;  // one 64-dim half row (bf16 or fp16)

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

// The same for A fragments in registers that a wgmma still reads: placed after the wait, it keeps
// their values where they are (no other value takes their registers) until the MMAs are done.
template <int kN>
__device__ __forceinline__ void fence_registers(uint32_t (&a)[kN][4]) {
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(a[n][j])::"memory");
  }
}

// The wgmma operand lists. Accumulator tiles d[kOffset + n] (n < 8 or 16) hold columns
// 8 (kOffset + n) .. 8 (kOffset + n) + 7 of the product (Note [Warpgroup forward]).
#define MEMBAR_WGMMA_TILE(n) \
  "+f"(d[kOffset + n][0]), "+f"(d[kOffset + n][1]), "+f"(d[kOffset + n][2]), "+f"(d[kOffset + n][3])
#define MEMBAR_WGMMA_TILES_4 \
  MEMBAR_WGMMA_TILE(0), MEMBAR_WGMMA_TILE(1), MEMBAR_WGMMA_TILE(2), MEMBAR_WGMMA_TILE(3)
#define MEMBAR_WGMMA_TILES_8                                                                                \
  MEMBAR_WGMMA_TILE(0), MEMBAR_WGMMA_TILE(1), MEMBAR_WGMMA_TILE(2), MEMBAR_WGMMA_TILE(3), MEMBAR_WGMMA_TILE(4), \
      MEMBAR_WGMMA_TILE(5), MEMBAR_WGMMA_TILE(6), MEMBAR_WGMMA_TILE(7)
#define MEMBAR_WGMMA_TILES_16                                                                                 \
  MEMBAR_WGMMA_TILES_8, MEMBAR_WGMMA_TILE(8), MEMBAR_WGMMA_TILE(9), MEMBAR_WGMMA_TILE(10), MEMBAR_WGMMA_TILE(11), \
      MEMBAR_WGMMA_TILE(12), MEMBAR_WGMMA_TILE(13), MEMBAR_WGMMA_TILE(14), MEMBAR_WGMMA_TILE(15)
#define MEMBAR_WGMMA_REGISTERS_16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define MEMBAR_WGMMA_REGISTERS_32                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define MEMBAR_WGMMA_REGISTERS_64                                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "   \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
// A and B from shared memory (both K-major); predicate p: accumulate.
#define MEMBAR_WGMMA_SS(shape, types, registers, a, b, p, tiles)                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " p ", 0;\nwgmma.mma_async.sync.aligned." shape \
               ".f32." types " " registers ", " a ", " b ", p, 1, 1, 0, 0;\n}\n"                 \
               : tiles                                                                           \
               : "l"(a_descriptor), "l"(b_descriptor), "r"(accumulate))
// A and B from shared memory, either MN-major (the transpose immediates ta, tb: 0 or 1).
#define MEMBAR_WGMMA_SS_TRANSPOSED(shape, types, registers, a, b, p, ta, tb, tiles)                      \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " p ", 0;\nwgmma.mma_async.sync.aligned." shape        \
               ".f32." types " " registers ", " a ", " b ", p, 1, 1, " ta ", " tb ";\n}\n"              \
               : tiles                                                                                 \
               : "l"(a_descriptor), "l"(b_descriptor), "r"(accumulate), "n"(int(kTransposeA)), "n"(int(kTransposeB)))
// A from registers, B from shared memory MN-major (the transpose bit); always accumulates.
#define MEMBAR_WGMMA_RS_TRANSPOSED_B(shape, types, registers, a, b, p, tiles)                               \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " p ", 0;\nwgmma.mma_async.sync.aligned." shape          \
               ".f32." types " " registers ", " a ", " b ", p, 1, 1, 1;\n}\n"                             \
               : tiles                                                                                    \
               : "r"(a_fragment[0]), "r"(a_fragment[1]), "r"(a_fragment[2]), "r"(a_fragment[3]), "l"(b_descriptor), \
                 "r"(1))

// d[64 x kN] (+)= A[64 x 16] * B[16 x kN] (kN = 64 or 128, into tiles kOffset ..), A and B from
// shared memory (both K-major), Element bf16 or fp16; with accumulate == 0 the previous d is ignored.
template <typename Element, int kN, int kOffset = 0, int kTiles>
__device__ __forceinline__ void wgmma_shared(float (&d)[kTiles][4], uint64_t a_descriptor, uint64_t b_descriptor,
                                             int accumulate) {
  static_assert(kN == 32 || kN == 64 || kN == 128, "the products of the attention kernels are 32, 64 or 128 columns wide");
  static_assert(kOffset + kN / 8 <= kTiles, "the product's tiles lie inside d");
  constexpr bool kBf16 = std::is_same_v<Element, __nv_bfloat16>;
  static_assert(kBf16 || std::is_same_v<Element, __half>, "wgmma takes bf16 or fp16 operands here");
  if constexpr (kN == 32 && kBf16) {
    MEMBAR_WGMMA_SS("m64n32k16", "bf16.bf16", MEMBAR_WGMMA_REGISTERS_16, "%16", "%17", "%18", MEMBAR_WGMMA_TILES_4);
  } else if constexpr (kN == 32) {
    MEMBAR_WGMMA_SS("m64n32k16", "f16.f16", MEMBAR_WGMMA_REGISTERS_16, "%16", "%17", "%18", MEMBAR_WGMMA_TILES_4);
  } else if constexpr (kN == 64 && kBf16) {
    MEMBAR_WGMMA_SS("m64n64k16", "bf16.bf16", MEMBAR_WGMMA_REGISTERS_32, "%32", "%33", "%34", MEMBAR_WGMMA_TILES_8);
  } else if constexpr (kN == 64) {
    MEMBAR_WGMMA_SS("m64n64k16", "f16.f16", MEMBAR_WGMMA_REGISTERS_32, "%32", "%33", "%34", MEMBAR_WGMMA_TILES_8);
  } else if constexpr (kBf16) {
    MEMBAR_WGMMA_SS("m64n128k16", "bf16.bf16", MEMBAR_WGMMA_REGISTERS_64, "%64", "%65", "%66", MEMBAR_WGMMA_TILES_16);
  } else {
    MEMBAR_WGMMA_SS("m64n128k16", "f16.f16", MEMBAR_WGMMA_REGISTERS_64, "%64", "%65", "%66", MEMBAR_WGMMA_TILES_16);
  }
}

// d[64 x kN] (+)= A[64 x 16] * B[16 x kN] (kN = 64 or 128), A and B from shared memory, each
// K-major or (with kTransposeA / kTransposeB) MN-major, Element bf16 or fp16; with accumulate == 0
// the previous d is ignored. The dQ products of the warpgroup backwards (attention_backward_wgmma.cuh,
// N = 64) and the head-size-256 backward's dV, dK and dQ products (attention_backward_wgmma_d2.cuh).
template <typename Element, int kN, bool kTransposeA, bool kTransposeB>
__device__ __forceinline__ void wgmma_shared_transposed(float (&d)[kN / 8][4], uint64_t a_descriptor,
                                                        uint64_t b_descriptor, int accumulate) {
  static_assert(kN == 64 || kN == 128, "the transposed products of the attention kernels are 64 or 128 columns wide");
  constexpr int kOffset = 0;
  constexpr bool kBf16 = std::is_same_v<Element, __nv_bfloat16>;
  static_assert(kBf16 || std::is_same_v<Element, __half>, "wgmma takes bf16 or fp16 operands here");
  if constexpr (kN == 64 && kBf16) {
    MEMBAR_WGMMA_SS_TRANSPOSED("m64n64k16", "bf16.bf16", MEMBAR_WGMMA_REGISTERS_32, "%32", "%33", "%34", "%35",
                               "%36", MEMBAR_WGMMA_TILES_8);
  } else if constexpr (kN == 64) {
    MEMBAR_WGMMA_SS_TRANSPOSED("m64n64k16", "f16.f16", MEMBAR_WGMMA_REGISTERS_32, "%32", "%33", "%34", "%35", "%36",
                               MEMBAR_WGMMA_TILES_8);
  } else if constexpr (kBf16) {
    MEMBAR_WGMMA_SS_TRANSPOSED("m64n128k16", "bf16.bf16", MEMBAR_WGMMA_REGISTERS_64, "%64", "%65", "%66", "%67",
                               "%68", MEMBAR_WGMMA_TILES_16);
  } else {
    MEMBAR_WGMMA_SS_TRANSPOSED("m64n128k16", "f16.f16", MEMBAR_WGMMA_REGISTERS_64, "%64", "%65", "%66", "%67", "%68",
                               MEMBAR_WGMMA_TILES_16);
  }
}

// d[64 x kN] += A[64 x 16] * B[16 x kN] (kN = 64 or 128, into tiles kOffset ..), A from registers
// (Note [Fragment layouts] per warp), B from shared memory MN-major (the transpose bit set).
template <typename Element, int kN, int kOffset = 0, int kTiles>
__device__ __forceinline__ void wgmma_registers_transposed_b(float (&d)[kTiles][4], const uint32_t (&a_fragment)[4],
                                                             uint64_t b_descriptor) {
  static_assert(kN == 64 || kN == 128, "the products of the attention kernels are 64 or 128 columns wide");
  static_assert(kOffset + kN / 8 <= kTiles, "the product's tiles lie inside d");
  constexpr bool kBf16 = std::is_same_v<Element, __nv_bfloat16>;
  static_assert(kBf16 || std::is_same_v<Element, __half>, "wgmma takes bf16 or fp16 operands here");
  if constexpr (kN == 64 && kBf16) {
    MEMBAR_WGMMA_RS_TRANSPOSED_B("m64n64k16", "bf16.bf16", MEMBAR_WGMMA_REGISTERS_32, "{%32, %33, %34, %35}", "%36",
                                 "%37", MEMBAR_WGMMA_TILES_8);
  } else if constexpr (kN == 64) {
    MEMBAR_WGMMA_RS_TRANSPOSED_B("m64n64k16", "f16.f16", MEMBAR_WGMMA_REGISTERS_32, "{%32, %33, %34, %35}", "%36",
                                 "%37", MEMBAR_WGMMA_TILES_8);
  } else if constexpr (kBf16) {
    MEMBAR_WGMMA_RS_TRANSPOSED_B("m64n128k16", "bf16.bf16", MEMBAR_WGMMA_REGISTERS_64, "{%64, %65, %66, %67}", "%68",
                                 "%69", MEMBAR_WGMMA_TILES_16);
  } else {
    MEMBAR_WGMMA_RS_TRANSPOSED_B("m64n128k16", "f16.f16", MEMBAR_WGMMA_REGISTERS_64, "{%64, %65, %66, %67}", "%68",
                                 "%69", MEMBAR_WGMMA_TILES_16);
  }
}

#undef MEMBAR_WGMMA_RS_TRANSPOSED_B
#undef MEMBAR_WGMMA_SS_TRANSPOSED
#undef MEMBAR_WGMMA_SS
#undef MEMBAR_WGMMA_REGISTERS_64
#undef MEMBAR_WGMMA_REGISTERS_32
#undef MEMBAR_WGMMA_REGISTERS_16
#undef MEMBAR_WGMMA_TILES_16
#undef MEMBAR_WGMMA_TILES_8
#undef MEMBAR_WGMMA_TILES_4
#undef MEMBAR_WGMMA_TILE

// The bf16 products the sweep target's warpgroup backward calls by name.
__device__ __forceinline__ void wgmma_m64n64k16_shared(float (&d)[8][4], uint64_t a_descriptor,
                                                      uint64_t b_descriptor, int accumulate) {
  wgmma_shared<__nv_bfloat16, 64>(d, a_descriptor, b_descriptor, accumulate);
}
__device__ __forceinline__ void wgmma_m64n128k16_registers_transposed_b(float (&d)[16][4], const uint32_t (&a)[4],
                                                                       uint64_t b_descriptor) {
  wgmma_registers_transposed_b<__nv_bfloat16, 128>(d, a, b_descriptor);
}

// Copies rows [0, kTileRows) of a strided [*, kDims] matrix (bf16 or fp16) into the swizzled
// layout of Note [Warpgroup shared layout], [ceil(kDims / 64)][kTileRows][64]: row r starts at
// base + r * row_stride (elements) when r < valid_rows, and is zero-filled otherwise. A row is
// kDims / 8 pieces of 16 bytes; the copy runs over the pieces of whole 64-dim halves (8, 16 or 32
// a row), and the pieces past kDims (head_dim 96: the last 32 dims of the second half) are not
// written: no MMA reads them into a result that is kept. kCopyThreads: the threads of the CTA that
// copy (all of them); one pass copies kCopyThreads / pieces rows, a multiple of 8, so a thread's
// swizzle phase (row % 8) is the same on every pass.
template <int kTileRows, int kDims, int kCopyThreads, typename Element>
__device__ __forceinline__ void load_swizzled_rows(unsigned char* tile, const Element* base, int64_t row_stride,
                                                   int valid_rows, int thread) {
  constexpr int kPieces = (kDims + 63) / 64 * 8;  // per row, over whole halves
  constexpr int kRowsPerPass = kCopyThreads / kPieces;
  static_assert(kDims % 8 == 0, "rows are copied in 16-byte pieces");
  static_assert(kCopyThreads % kPieces == 0 && kRowsPerPass % 8 == 0, "a pass covers whole swizzle atoms");
  static_assert(kTileRows % kRowsPerPass == 0, "every thread copies the same number of pieces");
  const int piece = thread % kPieces;
  if (kDims % 64 != 0 && piece >= kDims / 8) return;
  const int first_row = thread / kPieces;
  const int half = piece / 8;
  const int swizzled_piece = (piece % 8) ^ (first_row % 8);
  unsigned char* destination = tile + half * kTileRows * kRowBytes + first_row * kRowBytes + swizzled_piece * 16;
  const Element* source = base + int64_t(first_row) * row_stride + piece * 8;
  const int64_t pass_stride = int64_t(kRowsPerPass) * row_stride;
#pragma unroll
  for (int pass = 0; pass < kTileRows / kRowsPerPass; ++pass) {
    const bool valid = first_row + pass * kRowsPerPass < valid_rows;
    copy_async_16(destination + pass * kRowsPerPass * kRowBytes, valid ? source + pass * pass_stride : base, valid);
  }
}

// The mbarrier, named-barrier and register-reallocation steps of the warp-specialised kernels
// (Note [Warp-specialised forward], Note [Warp-specialised backward]).
__device__ __forceinline__ void mbarrier_init(uint32_t barrier, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(barrier), "r"(count) : "memory");
}
// Blocks until the phase of parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t barrier, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_loop:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_loop;\n"
      "}\n" ::"r"(barrier),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(barrier) : "memory");
}
// The barrier sees one arrival once every cp.async this thread issued before has landed.
__device__ __forceinline__ void copies_arrive(uint32_t barrier) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(barrier) : "memory");
}
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Bulk reduction of `bytes` (a multiple of 16, both addresses 16-byte aligned) of fp32 from shared
// memory into global memory (cp.reduce.async.bulk ... add.f32), tracked by this thread's bulk groups.
__device__ __forceinline__ void bulk_reduce_add_f32(float* global, uint32_t shared, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(global),
               "r"(shared), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most kPending of this thread's bulk groups still read their shared source.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Waits until at most kPending of this thread's bulk groups are incomplete (their writes done).
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}
template <int kRegisters>
__device__ __forceinline__ void registers_decrease() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void registers_increase() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// The key-block stages of the warp-specialised kernels that walk a query tile's key sequence (the
// forward, Note [Warp-specialised forward], and the deterministic dQ pass, Note [Warp-specialised
// dQ pass]): one mbarrier for the query tiles, then K stage s's "full" and "empty" barriers, then
// V stage s's, at consecutive 8-byte slots from `first`. A "full" barrier counts the 128 producer
// threads' copies (copies_arrive), an "empty" one an arrival per consumer warp.
template <int kKStages, int kVStages>
struct KeyBlockStages {
  static constexpr int kBarriers = 1 + 2 * (kKStages + kVStages);
  uint32_t first;  // shared address of the query tiles' barrier

  __device__ __forceinline__ uint32_t query_full() const { return first; }
  __device__ __forceinline__ uint32_t k_full(int s) const { return first + 8u * (1 + 2 * s); }
  __device__ __forceinline__ uint32_t k_empty(int s) const { return first + 8u * (2 + 2 * s); }
  __device__ __forceinline__ uint32_t v_full(int s) const { return first + 8u * (1 + 2 * kKStages + 2 * s); }
  __device__ __forceinline__ uint32_t v_empty(int s) const { return first + 8u * (2 + 2 * kKStages + 2 * s); }
  // By one thread, before the CTA-wide barrier that publishes them.
  __device__ __forceinline__ void init(int consumer_warps) const {
    mbarrier_init(query_full(), 128);
    for (int s = 0; s < kKStages; ++s) {
      mbarrier_init(k_full(s), 128);
      mbarrier_init(k_empty(s), consumer_warps);
    }
    for (int s = 0; s < kVStages; ++s) {
      mbarrier_init(v_full(s), 128);
      mbarrier_init(v_empty(s), consumer_warps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // A consumer's wait for block `index`'s K (or V) stage (the phase index / stages has completed),
  // then the fence that makes the producer's copies visible to wgmma.
  __device__ __forceinline__ void wait_k_full(int index) const {
    mbarrier_wait(k_full(index % kKStages), (index / kKStages) & 1);
    fence_proxy_async_shared();
  }
  __device__ __forceinline__ void wait_v_full(int index) const {
    mbarrier_wait(v_full(index % kVStages), (index / kVStages) & 1);
    fence_proxy_async_shared();
  }
};

// The producer warpgroup's loop over blocks [first_block, first_block + num_blocks) of a key
// sequence: each block's K and V rows into their stages in the swizzled layout (tiles of kKeys rows,
// [ceil(kHeadDim / 64)][kKeys][64] a stage), a stage written once every consumer warp has released
// it (a fresh barrier's previous phase counts as done, so the first wait on a stage passes).
// `copier`: the producer thread, 0 .. 127. Returns once its copies have landed.
template <int kKeys, int kHeadDim, int kKStages, int kVStages, typename Keys>
__device__ __forceinline__ void produce_key_blocks(const Keys& keys, int first_block, int num_blocks,
                                                   unsigned char* k_tiles, unsigned char* v_tiles,
                                                   const KeyBlockStages<kKStages, kVStages>& stages,
                                                   int64_t kv_row_stride, int copier) {
  constexpr int kTileBytes = kKeys * ((kHeadDim + 63) / 64 * 64) * 2;
  for (int index = 0; index < num_blocks; ++index) {
    const int k_stage = index % kKStages;
    const int v_stage = index % kVStages;
    const auto block = keys.block(first_block + index);
    mbarrier_wait(stages.k_empty(k_stage), ((index / kKStages) & 1) ^ 1);
    load_swizzled_rows<kKeys, kHeadDim, 128>(k_tiles + k_stage * kTileBytes, block.k_base, kv_row_stride,
                                             block.valid_rows, copier);
    copies_arrive(stages.k_full(k_stage));
    mbarrier_wait(stages.v_empty(v_stage), ((index / kVStages) & 1) ^ 1);
    load_swizzled_rows<kKeys, kHeadDim, 128>(v_tiles + v_stage * kTileBytes, block.v_base, kv_row_stride,
                                             block.valid_rows, copier);
    copies_arrive(stages.v_full(v_stage));
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// The 128-dim bf16 copy of the sweep target's warpgroup backward.
template <int kTileRows, int kCopyThreads = 256>
__device__ __forceinline__ void load_swizzled_tile(unsigned char* tile, const __nv_bfloat16* base, int64_t row_stride,
                                                   int valid_rows, int thread) {
  load_swizzled_rows<kTileRows, 128, kCopyThreads>(tile, base, row_stride, valid_rows, thread);
}

#endif  // MEMBAR_WGMMA_AVAILABLE

}  // namespace membar::kernels::cuda::detail
