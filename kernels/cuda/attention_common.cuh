// Device building blocks of the CUDA paged-attention kernels: tensor-core MMA (mma.sync
// m16n8k16 through inline PTX), ldmatrix, cp.async, a swizzled shared-memory layout and
// warp-level matrix products over tiles of 16 rows. Internal to kernels/cuda/.
//
// Note [Fragment layouts]
// mma.m16n8k16 (row.col) works on per-thread fragments; with lane = 4 * g + c (g = lane / 4,
// c = lane % 4):
//   A (16 x 16, row major): a0 = (row g, cols 2c, 2c+1), a1 = (row g+8, cols 2c, 2c+1),
//                           a2 = (row g, cols 2c+8, 2c+9), a3 = (row g+8, cols 2c+8, 2c+9);
//   B (16 x 8, "col"):      b0 = (rows 2c, 2c+1, col g), b1 = (rows 2c+8, 2c+9, col g);
//   C (16 x 8, fp32):       c0, c1 = (row g, cols 2c, 2c+1), c2, c3 = (row g+8, cols 2c, 2c+1).
// Two adjacent C tiles (16 x 16 of fp32) hold exactly the values of one A fragment, so a
// product's result (P = softmax(S), dS) feeds the next product from registers.
// ldmatrix.x4 loads four 8 x 8 matrices of 16-bit values, lanes 8i..8i+7 giving the row
// addresses of matrix i; without .trans thread t receives (row t/4, cols 2(t%4), 2(t%4)+1), with
// .trans the transpose. Each helper below says which lane addresses which matrix.
//
// Note [Swizzle]
// A shared tile of `kColumns` 16-bit values per row (kColumns >= 64) is stored in 16-byte pieces;
// piece p of row r lands at piece p ^ (r % 8). The eight row addresses of an ldmatrix 8 x 8
// matrix (same piece, eight consecutive rows) then fall into eight different bank groups, and
// so do the cp.async writes of a row's pieces.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "membar/kernels/dtype.h"

namespace membar::kernels::cuda::detail {

template <typename Element>
struct ElementTraits;

template <>
struct ElementTraits<__nv_bfloat16> {
  static constexpr DType kDType = DType::kBFloat16;
  // Packs two floats into one register, `low` in the low half (the smaller column).
  static __device__ __forceinline__ uint32_t pack(float low, float high) {
    __nv_bfloat162 value = __floats2bfloat162_rn(low, high);
    return *reinterpret_cast<uint32_t*>(&value);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t bits) {
    __nv_bfloat162 value = *reinterpret_cast<__nv_bfloat162*>(&bits);
    return __bfloat1622float2(value);
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 value) { return __bfloat162float(value); }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct ElementTraits<__half> {
  static constexpr DType kDType = DType::kFloat16;
  static __device__ __forceinline__ uint32_t pack(float low, float high) {
    __half2 value = __floats2half2_rn(low, high);
    return *reinterpret_cast<uint32_t*>(&value);
  }
  static __device__ __forceinline__ float2 unpack(uint32_t bits) {
    __half2 value = *reinterpret_cast<__half2*>(&bits);
    return __half22float2(value);
  }
  static __device__ __forceinline__ float to_float(__half value) { return __half2float(value); }
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Offset (in elements) of (row, column) in a swizzled tile of kColumns elements per row
// (Note [Swizzle]).
template <int kColumns>
__device__ __forceinline__ int swizzled_offset(int row, int column) {
  static_assert(kColumns % 64 == 0, "the swizzle permutes 8 pieces of 16 bytes per row");
  return row * kColumns + ((((column >> 3) ^ (row & 7))) << 3) + (column & 7);
}

// Note [Padded tiles]
// The alternative to the swizzle: rows of kColumns + 8 elements (16 bytes of padding). The eight
// row addresses of an ldmatrix matrix then start 272 bytes apart at kColumns = 128, i.e. four banks
// apart, and fall into eight different bank groups too (any row of an odd number of 16-byte pieces
// does: 9, 13, 17 or 33 for 64, 96, 128 or 256 columns). Unlike the swizzle, the offset of a
// fragment is the thread's row offset plus a compile-time column, so the compiler needs one
// register per tile instead of one per (fragment, k step), at 6% more shared memory. Head sizes
// that are not whole groups of 64 columns (96) can only be padded (tile_padded).
template <int kColumns, bool kPadded>
struct TileLayout {
  static constexpr int kStride = kPadded ? kColumns + 8 : kColumns;  // elements per stored row
  static __device__ __forceinline__ int offset(int row, int column) {
    if constexpr (kPadded) {
      return row * kStride + column;
    } else {
      return swizzled_offset<kColumns>(row, column);
    }
  }
};

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* pointer) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(pointer)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* pointer) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(pointer)));
}

// Copies 16 bytes global -> shared without passing through registers; when !valid the 16
// shared bytes are zero-filled and `source` is not read.
__device__ __forceinline__ void copy_async_16(void* destination, const void* source, bool valid) {
  const int source_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(destination)),
               "l"(source), "r"(source_bytes));
}
__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPendingGroups>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPendingGroups));
}

// Loads rows [0, kRows) of a strided matrix into a swizzled (or, kPadded, padded: Note [Padded
// tiles]) shared tile: row r starts at base + r * row_stride (elements) when r < valid_rows, and
// is zero-filled otherwise. [kRows, kColumns] in shared memory.
template <typename Element, int kRows, int kColumns, int kThreads, bool kPadded = false>
__device__ __forceinline__ void load_tile_async(Element* tile, const Element* base, int64_t row_stride,
                                                int valid_rows, int thread) {
  using Layout = TileLayout<kColumns, kPadded>;
  constexpr int kPiecesPerRow = kColumns / 8;
  // Each pass copies kRowsPerPass whole rows: the most rows the threads hold that divide kRows.
  // When the threads are not a multiple of a row's pieces (head_dim 96: 12 pieces a row), the
  // remaining threads copy nothing.
  constexpr int kRowsPerPass = [] {
    int rows = kThreads / kPiecesPerRow;
    while (rows > 1 && kRows % rows != 0) --rows;
    return rows;
  }();
  static_assert(kRowsPerPass >= 1 && kRows % kRowsPerPass == 0, "every copying thread copies the same number of pieces");
  if (kThreads % kPiecesPerRow != 0 && thread >= kRowsPerPass * kPiecesPerRow) return;
  const int first_row = thread / kPiecesPerRow;
  const int column = (thread % kPiecesPerRow) * 8;
  const Element* source = base + first_row * row_stride + column;
  const int64_t pass_stride = int64_t(kRowsPerPass) * row_stride;
  if constexpr (kPadded || kRowsPerPass % 8 == 0) {
    // Rows a pass apart share their swizzle phase (row % 8), so a thread's shared offsets differ by
    // a constant and its sources by a stride: no per-piece index arithmetic.
    Element* destination = tile + Layout::offset(first_row, column);
#pragma unroll
    for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
      const bool valid = first_row + pass * kRowsPerPass < valid_rows;
      copy_async_16(destination + pass * kRowsPerPass * Layout::kStride, valid ? source + pass * pass_stride : base,
                    valid);
    }
  } else {
    // Fewer than 8 rows a pass (head_dim 256: 4 rows of 32 pieces for 128 threads): the swizzle
    // phase changes from pass to pass, so each pass finds its piece's offset.
#pragma unroll
    for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
      const int row = first_row + pass * kRowsPerPass;
      const bool valid = row < valid_rows;
      copy_async_16(tile + Layout::offset(row, column), valid ? source + pass * pass_stride : base, valid);
    }
  }
}

// Whether a tile of kColumns 16-bit elements per row is padded (Note [Padded tiles]): when a layout
// asks for it, and always when a row is not whole groups of 64 elements, which the swizzle needs
// (Note [Swizzle]; head_dim 96).
template <int kColumns>
constexpr bool tile_padded(bool requested) {
  return requested || kColumns % 64 != 0;
}

// The matrix products below take swizzled tiles, or padded ones with kPadded (Note [Padded tiles]).
//
// acc[16 x kN] += A[16 x kK] * B^T, where A is rows [a_row, a_row + 16) of a swizzled shared tile
// stored [m][k] (kColumnsA per row) and B is rows [b_row, b_row + kN) of a swizzled tile stored
// [n][k] (kColumnsB per row). Used for S = Q K^T and its relatives.
template <typename Element, int kN, int kK, int kColumnsA, int kColumnsB, bool kPadded = false>
__device__ __forceinline__ void warp_matmul_shared_nt(float (&acc)[kN / 8][4], const Element* a_tile, int a_row,
                                                      const Element* b_tile, int b_row, int lane) {
  using LayoutA = TileLayout<kColumnsA, kPadded>;
  using LayoutB = TileLayout<kColumnsB, kPadded>;
  static_assert(kN % 16 == 0 && kK % 16 == 0, "tiles are whole 16 x 16 fragments");
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[4];
    // Matrices: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
    ldmatrix_x4(a, a_tile + LayoutA::offset(a_row + (lane & 15), kk * 16 + (lane >> 4) * 8));
#pragma unroll
    for (int nn = 0; nn < kN / 16; ++nn) {
      uint32_t b[4];
      // Matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
      const int row = b_row + nn * 16 + (lane & 7) + ((lane >> 4) << 3);
      const int column = kk * 16 + ((lane >> 3) & 1) * 8;
      ldmatrix_x4(b, b_tile + LayoutB::offset(row, column));
      ElementTraits<Element>::mma(acc[2 * nn], a, b[0], b[1]);
      ElementTraits<Element>::mma(acc[2 * nn + 1], a, b[2], b[3]);
    }
  }
}

// acc[16 x kN] += A[16 x kK] * B, where A comes from registers (Note [Fragment layouts]) and B is
// the [kK x kN] block at (b_row, b_column) of a swizzled shared tile stored [k][n]
// (kColumnsB per row), read transposed by ldmatrix. Used for O += P V, dV += P^T dO and the like.
template <typename Element, int kN, int kK, int kColumnsB, bool kPadded = false>
__device__ __forceinline__ void warp_matmul_registers_nn(float (&acc)[kN / 8][4], const uint32_t (&a)[kK / 16][4],
                                                         const Element* b_tile, int b_row, int b_column, int lane) {
  using LayoutB = TileLayout<kColumnsB, kPadded>;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
    for (int nn = 0; nn < kN / 16; ++nn) {
      uint32_t b[4];
      // Matrices (stored k x n): (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15).
      const int row = b_row + kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      const int column = b_column + nn * 16 + (lane >> 4) * 8;
      ldmatrix_x4_trans(b, b_tile + LayoutB::offset(row, column));
      ElementTraits<Element>::mma(acc[2 * nn], a[kk], b[0], b[1]);
      ElementTraits<Element>::mma(acc[2 * nn + 1], a[kk], b[2], b[3]);
    }
  }
}

// acc[16 x kN] += A * B where A = (stored tile)^T: the stored tile is [k][m] (kColumnsA per row)
// and A's 16 rows are its columns [a_column, a_column + 16); B is stored [k][n] as above.
// Used for dQ += dS K with dS^T in shared memory.
template <typename Element, int kN, int kK, int kColumnsA, int kColumnsB, bool kPadded = false>
__device__ __forceinline__ void warp_matmul_shared_tn(float (&acc)[kN / 8][4], const Element* a_tile, int a_column,
                                                      const Element* b_tile, int b_column, int lane) {
  using LayoutA = TileLayout<kColumnsA, kPadded>;
  using LayoutB = TileLayout<kColumnsB, kPadded>;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[4];
    // Matrices (stored k x m): (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15).
    ldmatrix_x4_trans(a, a_tile + LayoutA::offset(kk * 16 + (lane & 7) + (lane >> 4) * 8,
                                                 a_column + ((lane >> 3) & 1) * 8));
#pragma unroll
    for (int nn = 0; nn < kN / 16; ++nn) {
      uint32_t b[4];
      const int row = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
      const int column = b_column + nn * 16 + (lane >> 4) * 8;
      ldmatrix_x4_trans(b, b_tile + LayoutB::offset(row, column));
      ElementTraits<Element>::mma(acc[2 * nn], a, b[0], b[1]);
      ElementTraits<Element>::mma(acc[2 * nn + 1], a, b[2], b[3]);
    }
  }
}

// Turns a 16 x kN fp32 result into A fragments of a following product (Note [Fragment layouts]).
template <typename Element, int kN>
__device__ __forceinline__ void accumulator_to_a_fragments(uint32_t (&a)[kN / 16][4], const float (&acc)[kN / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    a[kk][0] = ElementTraits<Element>::pack(acc[2 * kk][0], acc[2 * kk][1]);
    a[kk][1] = ElementTraits<Element>::pack(acc[2 * kk][2], acc[2 * kk][3]);
    a[kk][2] = ElementTraits<Element>::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[kk][3] = ElementTraits<Element>::pack(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
  }
}

template <int kN>
__device__ __forceinline__ void clear(float (&acc)[kN][4]) {
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[n][j] = 0.f;
  }
}

// Where the keys of one block come from: a history page (some rows of it) or the chunk itself.
// Rows [0, valid_rows) of the block are keys; key row r is at k_base + r * row_stride.
template <typename Element>
struct KeyBlock {
  const Element* k_base;
  const Element* v_base;
  int valid_rows;
  int first_position;  // position of row 0 among the chunk's keys (chunk blocks), else -1
};

// Resolves block `block` of a query tile's key sequence: first the history blocks (dense: every
// history block of kKeys tokens; sparse: each selected page, in list order, cut into blocks),
// then the chunk's own blocks. `selected` is the tile's compacted selection (sparse only).
// kShiftIndexing: page_tokens is a power of two (64 or 128, what the CUDA kernels accept) and
// page_shift its log2, so that page and row numbers come from shifts and masks instead of integer
// divisions (tens of instructions each, per block and thread).
template <typename Element, int kKeys, bool kShiftIndexing = false>
struct KeySequence {
  const Element* k_pool;
  const Element* v_pool;
  const int32_t* k_page_index;
  const int32_t* v_page_index;
  const Element* k_chunk;
  const Element* v_chunk;
  const int32_t* selected;  // shared memory, or nullptr when dense
  int history_tokens;
  int page_tokens;
  int chunk_tokens;
  int num_kv_heads;
  int head_dim;
  int kv_head;
  int num_history_blocks;
  int page_shift;  // log2(page_tokens), used with kShiftIndexing

  __device__ __forceinline__ KeyBlock<Element> block(int index) const {
    const int64_t row_stride = int64_t(num_kv_heads) * head_dim;
    KeyBlock<Element> result;
    if (index < num_history_blocks) {
      int first_token;
      int page;
      int row_in_page;
      if constexpr (kShiftIndexing) {
        if (selected != nullptr) {
          // blocks_per_page = page_tokens / kKeys = 2^(page_shift - log2(kKeys)).
          const int block_shift = page_shift - (kKeys == 128 ? 7 : 6);
          first_token = (selected[index >> block_shift] << page_shift) + ((index & ((1 << block_shift) - 1)) * kKeys);
        } else {
          first_token = index * kKeys;
        }
        page = first_token >> page_shift;
        row_in_page = first_token & ((1 << page_shift) - 1);
      } else {
        if (selected != nullptr) {
          const int blocks_per_page = page_tokens / kKeys;
          first_token = selected[index / blocks_per_page] * page_tokens + (index % blocks_per_page) * kKeys;
        } else {
          first_token = index * kKeys;
        }
        page = first_token / page_tokens;
        row_in_page = first_token % page_tokens;
      }
      result.k_base = k_pool + (int64_t(k_page_index[page]) * page_tokens + row_in_page) * row_stride +
                      int64_t(kv_head) * head_dim;
      result.v_base = v_pool + (int64_t(v_page_index[page]) * page_tokens + row_in_page) * row_stride +
                      int64_t(kv_head) * head_dim;
      result.valid_rows = min(kKeys, history_tokens - first_token);
      result.first_position = -1;
    } else {
      const int first = (index - num_history_blocks) * kKeys;
      result.k_base = k_chunk + int64_t(first) * row_stride + int64_t(kv_head) * head_dim;
      result.v_base = v_chunk + int64_t(first) * row_stride + int64_t(kv_head) * head_dim;
      result.valid_rows = min(kKeys, chunk_tokens - first);
      result.first_position = first;
    }
    return result;
  }
};

// Compacts one selection row (entries < 0 or >= num_pages are padding) into shared memory, in
// list order, by the first warp; returns the count to every thread. Ends with __syncthreads().
__device__ __forceinline__ int compact_selection(const int32_t* row, int entries, int num_pages,
                                                 int32_t* compacted, int* shared_count) {
  const int thread = threadIdx.x;
  if (thread < 32) {
    int count = 0;
    for (int start = 0; start < entries; start += 32) {
      const int slot = start + thread;
      const int32_t page = slot < entries ? row[slot] : -1;
      const bool keep = page >= 0 && page < num_pages;
      const unsigned mask = __ballot_sync(0xffffffffu, keep);
      if (keep) compacted[count + __popc(mask & ((1u << thread) - 1u))] = page;
      count += __popc(mask);
    }
    if (thread == 0) *shared_count = count;
  }
  __syncthreads();
  return *shared_count;
}

__device__ __forceinline__ float quad_max(float value) {
  value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, 1));
  return fmaxf(value, __shfl_xor_sync(0xffffffffu, value, 2));
}
__device__ __forceinline__ float quad_sum(float value) {
  value += __shfl_xor_sync(0xffffffffu, value, 1);
  return value + __shfl_xor_sync(0xffffffffu, value, 2);
}

// PagedAttentionShape::num_history_pages, callable from device code too.
template <typename Shape>
__host__ __device__ __forceinline__ int history_page_count(const Shape& shape) {
  return (shape.history_tokens + shape.page_tokens - 1) / shape.page_tokens;
}

// The key sequence of the CTA whose queries start at first_query, from a kernel's params (the
// forward's or the backward's: shape, selection, history pools and page indices, chunk K/V). In
// sparse mode the query tile's selection is compacted into `selected` (shared memory, count in
// *selected_count) by the first warp, so every thread of the CTA must call this (it then ends
// with __syncthreads()).
template <typename Element, int kKeys, bool kShiftIndexing, int kHeadDim, typename Params>
__device__ __forceinline__ KeySequence<Element, kKeys, kShiftIndexing> key_sequence_for_tile(
    const Params& params, int kv_head, int first_query, int32_t* selected, int* selected_count) {
  const auto& shape = params.shape;
  KeySequence<Element, kKeys, kShiftIndexing> keys;
  keys.page_shift = shape.page_tokens == 128 ? 7 : 6;
  keys.k_pool = static_cast<const Element*>(params.history.k_pool);
  keys.v_pool = static_cast<const Element*>(params.history.v_pool);
  keys.k_page_index = params.history.k_page_index;
  keys.v_page_index = params.history.v_page_index;
  keys.k_chunk = static_cast<const Element*>(params.k_chunk);
  keys.v_chunk = static_cast<const Element*>(params.v_chunk);
  keys.history_tokens = shape.history_tokens;
  keys.page_tokens = shape.page_tokens;
  keys.chunk_tokens = shape.chunk_tokens;
  keys.num_kv_heads = shape.num_kv_heads;
  keys.head_dim = kHeadDim;
  keys.kv_head = kv_head;
  if (params.selection.selected_pages != nullptr) {
    const int selection_tile = first_query / params.selection.query_tile_tokens;
    const int count = compact_selection(
        params.selection.selected_pages + int64_t(selection_tile) * params.selection.selected_per_tile,
        params.selection.selected_per_tile, history_page_count(shape), selected, selected_count);
    keys.selected = selected;
    keys.num_history_blocks = count * (shape.page_tokens / kKeys);
  } else {
    keys.selected = nullptr;
    keys.num_history_blocks = (shape.history_tokens + kKeys - 1) / kKeys;
  }
  return keys;
}

inline constexpr float kLog2e = 1.4426950408889634f;

// Note [Sliding window in the kernels]
// Note [Sliding window] (membar/kernels/attention.h) lets chunk query row r (position
// history_tokens + r) see key position p only if p > history_tokens + r - W. A window is a runtime
// value (shape.sliding_window, read from the parameter bank), not a template flag: it changes
// which blocks a loop visits and adds a mask in the blocks that straddle the window's edge, both
// behind uniform branches, so the kernels without a window run the same loops (one more uniform
// branch per block) and nothing is compiled twice. Windows come only with dense calls that attend
// the chunk (the checks refuse the rest), so a key sequence's block i holds history tokens
// i * kKeys .. (dense) and chunk blocks their first_position.
//   Which blocks: a query-major loop (forward, dQ pass) starts at the first block holding the
//   lowest position its first query sees (window_first_block); a key-major CTA (dK/dV) visits
//   only the query blocks up to the last query that sees its last key (own_keys).
//   Which scores: in chunk-row units a block's edge is e = (its first key's position -
//   history_tokens) + W, and row r sees key k of the block iff k + e > r (window_edge); a block
//   needs the mask only where e <= the last row of the warp (or item), a uniform test.
//   Rows with nothing visible in a block: the forward's online softmax already keeps such rows
//   finite (a running maximum of -inf is replaced by 0 before exponentiating, as FlashAttention
//   does), and every row sees at least its own key, so no lse is -inf. The backward gets P = 0,
//   hence dS = 0, for hidden pairs: the dQ pass, the split dK/dV kernel and the head_dim-256
//   dK/dV kernel (dim_parts) set P = 0 where they apply the other masks; the other
//   one-warp-per-16-keys dK/dV kernels, at 255 registers, set the hidden scores to -inf right after
//   S (the fewest values live; SoftCap::slope is 0 there): the placements that spill least
//   (docs/kernels.md).
//   Limitations: windows combine with dense calls that attend the chunk only; the skipped blocks
//   save the work outside the window, but a straddling block computes all of its scores.
inline constexpr int kNoWindowEdge = 1 << 30;

// The first block of a dense key sequence of kKeys-key blocks that queries from chunk row
// first_query on can see (0 without a window): the one holding position history_tokens +
// first_query - W + 1.
template <int kKeys, typename Shape>
__device__ __forceinline__ int window_first_block(const Shape& shape, int num_history_blocks, int first_query) {
  if (shape.sliding_window <= 0) return 0;
  const int lowest = shape.history_tokens + first_query - shape.sliding_window + 1;
  if (lowest <= 0) return 0;
  if (lowest < shape.history_tokens) return lowest / kKeys;
  return num_history_blocks + (lowest - shape.history_tokens) / kKeys;
}

// The edge e of a block whose first key is at chunk-relative position `start` (history keys are
// negative): row r sees key k of the block iff k + e > r; kNoWindowEdge without a window. Windows
// past 2^30 are clamped (they hide nothing a chunk can hold) so that e never overflows.
template <typename Shape>
__device__ __forceinline__ int window_edge(const Shape& shape, int start) {
  if (shape.sliding_window <= 0) return kNoWindowEdge;
  return start + min(shape.sliding_window, kNoWindowEdge);
}

// window_edge of block `index` of a dense key sequence (first_position: the KeyBlock's, -1 for
// history blocks).
template <int kKeys, typename Shape>
__device__ __forceinline__ int window_edge_of_block(const Shape& shape, int index, int first_position) {
  return window_edge(shape, first_position >= 0 ? first_position : index * kKeys - shape.history_tokens);
}

// Note [Soft-capped scores in raw units]
// Note [Soft-capped scores] (membar/kernels/attention.h) caps every scaled score s = scale * r
// (r = q.k) at cap * tanh(s / cap). The kernels keep scores in raw units (r; the scale goes into
// the exponent: P = exp2(r * scale log2(e) - ...)), so with a cap they replace each raw score,
// right after S = Q K^T and before any mask, by r' = (cap / scale) tanh(scale r / cap): masks,
// the online softmax, lse and P = exp2(r' * scale log2(e) - lse) then run unchanged. The backward
// caps its recomputed S in place the same way, before it computes dP (fewer values live at once),
// and multiplies dS = P o (dP - delta) by 1 - tanh^2 before dS meets K or Q, with tanh recovered
// from the capped score (tanh = r' scale / cap); the factor scale of dQ and dK stays as it was.
// tanh(x) = 1 - u with u = 2 / (exp(2x) + 1): one exp2 and one fast division (ex2.approx and
// div.approx under --use_fast_math, relative errors ~2^-22), exact at both ends without a clamp
// (exp2 overflowing to +inf gives u = 0, tanh = 1; underflowing to 0 gives u = 2, tanh = -1;
// __fdividef(2, y) is 0 for y past 2^126), so no score, however large, turns into NaN. The
// capped score's absolute error is ~1e-7 cap, and so is the slope's. tanh.approx.f32 would save
// the division but its relative error of 2^-11 is as coarse as a bf16 rounding of every score.
// The cap is a template flag of the kernels (kSoftcap): the instantiations without it are the
// code they were before the cap existed. The forward kernels derive the SoftCap constants on the
// device; the backward kernels, at 255 registers, take them as a kernel argument (soft_cap_of on
// the host), which ptxas reads from the parameter bank (docs/kernels.md has what the capped
// instantiations spill).
struct SoftCap {
  float raw_to_exponent = 0.f;  // 2 log2(e) scale / cap: exp(2 x) = exp2(r * raw_to_exponent)
  float raw_cap = 0.f;          // cap / scale: the cap in raw units
  float raw_to_tanh = 0.f;      // scale / cap: tanh(x) = r' * raw_to_tanh for a capped score r'

  // The capped score r' of raw score r (raw units).
  __device__ __forceinline__ float capped(float raw) const {
    const float complement = __fdividef(2.f, exp2f(raw * raw_to_exponent) + 1.f);  // 1 - tanh(x)
    return raw_cap - raw_cap * complement;
  }
  // d tanh(x) / dx = 1 - tanh(x)^2 at a capped score r'. tanh^2 is held to 1, so that a score a
  // sliding window masked to -inf gets slope 0, not -inf (whose product with P = 0 would be NaN;
  // Note [Sliding window in the kernels]); a capped score's |tanh| is at most 1 anyway.
  __device__ __forceinline__ float slope(float capped_score) const {
    const float tanh_x = capped_score * raw_to_tanh;
    return 1.f - fminf(tanh_x * tanh_x, 1.f);
  }
};

// Caps every score of a block of scores in raw units (accumulator tiles of mma.m16n8 or wgmma).
template <int kN>
__device__ __forceinline__ void soft_cap_scores(float (&scores)[kN][4], const SoftCap& cap) {
#pragma unroll
  for (int n = 0; n < kN; ++n) {
#pragma unroll
    for (int j = 0; j < 4; ++j) scores[n][j] = cap.capped(scores[n][j]);
  }
}

// The SoftCap of a call: softmax_scale and logit_softcap of its shape (all zero without a cap).
__host__ __device__ __forceinline__ SoftCap soft_cap_of(float softmax_scale, float logit_softcap) {
  SoftCap cap;
  if (!(logit_softcap > 0.f)) return cap;
  cap.raw_to_exponent = 2.f * kLog2e * softmax_scale / logit_softcap;
  cap.raw_cap = logit_softcap / softmax_scale;
  cap.raw_to_tanh = softmax_scale / logit_softcap;
  return cap;
}

}  // namespace membar::kernels::cuda::detail
