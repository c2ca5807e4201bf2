// Matrix multiply, exponential and parallel loop for the CPU attention kernels.
//
// Note [CPU matmul micro-kernel]
// Rationale: attention spends nearly all its time in five small matrix products per block
// (64..128 rows, 64..256 columns, depth 64..256). A blocked loop that the compiler vectorises
// reaches a useful fraction of the core's peak without a BLAS dependency.
// Approach: C is walked in register tiles of kTileRows x kTileCols; each tile's accumulators
// live in registers across the whole depth loop and are added to (or stored into) C once. A may
// be given transposed, which lets the attention kernels keep every block in the layout it was
// produced in (no transposes inside the key loop). The same template is
// compiled three times, for AVX-512, AVX2+FMA and the x86-64 baseline, with the tile width
// matched to the vector width; the first call picks the best one the CPU supports.
// Limitations: no packing of A or B, so very large depths stream B from L2; the blocks the
// attention kernels pass are small enough for that not to matter.
#include "attention_cpu_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

namespace membar::kernels::cpu::detail {
namespace {

// Element (r, k) of A, stored either as [rows][depth] or transposed as [depth][rows].
template <typename T, bool kTransposedA>
__attribute__((always_inline)) inline T a_at(const T* a, int64_t lda, int r, int k) {
  return kTransposedA ? a[int64_t(k) * lda + r] : a[int64_t(r) * lda + k];
}

template <typename T, bool kTransposedA, int kTileRows, int kTileCols>
__attribute__((always_inline)) inline void matmul_tile(int depth, const T* a, int64_t lda, const T* b, int64_t ldb,
                                                      T* c, int64_t ldc, bool accumulate) {
  T accumulator[kTileRows][kTileCols] = {};
  for (int k = 0; k < depth; ++k) {
    const T* b_row = b + int64_t(k) * ldb;
    for (int r = 0; r < kTileRows; ++r) {
      const T a_value = a_at<T, kTransposedA>(a, lda, r, k);
      for (int j = 0; j < kTileCols; ++j) accumulator[r][j] += a_value * b_row[j];
    }
  }
  for (int r = 0; r < kTileRows; ++r) {
    T* c_row = c + int64_t(r) * ldc;
    if (accumulate) {
      for (int j = 0; j < kTileCols; ++j) c_row[j] += accumulator[r][j];
    } else {
      for (int j = 0; j < kTileCols; ++j) c_row[j] = accumulator[r][j];
    }
  }
}

// The edges of C that do not fill a register tile: plain loops.
template <typename T, bool kTransposedA>
__attribute__((always_inline)) inline void matmul_edge(int rows, int cols, int depth, const T* a, int64_t lda,
                                                      const T* b, int64_t ldb, T* c, int64_t ldc, bool accumulate) {
  for (int r = 0; r < rows; ++r) {
    T* c_row = c + int64_t(r) * ldc;
    if (!accumulate) {
      for (int j = 0; j < cols; ++j) c_row[j] = T(0);
    }
    for (int k = 0; k < depth; ++k) {
      const T a_value = a_at<T, kTransposedA>(a, lda, r, k);
      const T* b_row = b + int64_t(k) * ldb;
      for (int j = 0; j < cols; ++j) c_row[j] += a_value * b_row[j];
    }
  }
}

template <typename T, bool kTransposedA, int kTileRows, int kTileCols>
__attribute__((always_inline)) inline void matmul_blocked(int rows, int cols, int depth, const T* a, int64_t lda,
                                                         const T* b, int64_t ldb, T* c, int64_t ldc, bool accumulate) {
  const int full_rows = rows - rows % kTileRows;
  const int full_cols = cols - cols % kTileCols;
  // Moves A by `r` rows of C, in either storage order.
  auto a_rows = [&](int r) { return kTransposedA ? a + r : a + int64_t(r) * lda; };
  for (int r = 0; r < full_rows; r += kTileRows) {
    for (int j = 0; j < full_cols; j += kTileCols) {
      matmul_tile<T, kTransposedA, kTileRows, kTileCols>(depth, a_rows(r), lda, b + j, ldb, c + int64_t(r) * ldc + j,
                                                         ldc, accumulate);
    }
    if (full_cols < cols) {
      matmul_edge<T, kTransposedA>(kTileRows, cols - full_cols, depth, a_rows(r), lda, b + full_cols, ldb,
                                   c + int64_t(r) * ldc + full_cols, ldc, accumulate);
    }
  }
  if (full_rows < rows) {
    matmul_edge<T, kTransposedA>(rows - full_rows, cols, depth, a_rows(full_rows), lda, b, ldb,
                                 c + int64_t(full_rows) * ldc, ldc, accumulate);
  }
}

// exp over a [rows][cols] block with a per-column offset, written so that the compiler
// vectorises it along the columns: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6
// polynomial (Cephes' expf coefficients), 2^n built in the exponent bits. Inputs below -87.3
// (including -inf) give exactly 0.
__attribute__((always_inline)) inline void exp_subtract_columns_body(float* values, int rows, int cols,
                                                                    const float* subtract, float* column_sums) {
  for (int i = 0; i < rows; ++i) {
    float* row = values + int64_t(i) * cols;
    for (int j = 0; j < cols; ++j) {
      float x = row[j] - subtract[j];
      // -inf lands here too. A NaN passes both clamps and comes out NaN (the integer conversion
      // of a NaN n gives the "integer indefinite" value on x86, which no branch depends on).
      const bool underflow = x < -87.3f;
      x = x > 88.3f ? 88.3f : x;
      x = underflow ? 0.f : x;
      // Round x / ln2 to the nearest integer with the 1.5 * 2^23 trick (|x / ln2| < 2^22).
      const float shifted = x * 1.44269504088896341f + 12582912.f;
      const float n = shifted - 12582912.f;
      float r = x - n * 0.693359375f;
      r = r - n * -2.12194440e-4f;
      float p = 1.9875691500e-4f;
      p = p * r + 1.3981999507e-3f;
      p = p * r + 8.3334519073e-3f;
      p = p * r + 4.1665795894e-2f;
      p = p * r + 1.6666665459e-1f;
      p = p * r + 5.0000001201e-1f;
      p = p * r * r + r + 1.f;
      const uint32_t scale_bits = uint32_t(int32_t(n) + 127) << 23;
      float scale;
      std::memcpy(&scale, &scale_bits, sizeof(scale));
      const float result = p * scale;
      row[j] = underflow ? 0.f : result;
    }
    if (column_sums) {
      for (int j = 0; j < cols; ++j) column_sums[j] += row[j];
    }
  }
}

__attribute__((always_inline)) inline void widen_bfloat16_body(const BFloat16* from, float* to, int64_t count) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(from);
  uint32_t* out = reinterpret_cast<uint32_t*>(to);
  for (int64_t i = 0; i < count; ++i) out[i] = uint32_t(bits[i]) << 16;
}

#if defined(__x86_64__)
// GCC vectorises with 256-bit registers by default even for AVX-512 targets; ask for 512 (clang
// takes no such target attribute).
#if defined(__clang__)
#define MEMBAR_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,fma")))
#else
#define MEMBAR_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,fma,prefer-vector-width=512")))
#endif
#define MEMBAR_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define MEMBAR_FOR_EACH_ISA(X) X(avx512, MEMBAR_TARGET_AVX512, 32, 16) X(avx2, MEMBAR_TARGET_AVX2, 16, 8)
#else
#define MEMBAR_FOR_EACH_ISA(X)
#endif

// One set of functions per instruction set. Tile shapes: 4 rows x 2 vectors keeps 8
// independent accumulator registers, enough to cover the FMA latency on two ports.
#define MEMBAR_DEFINE_ISA(isa, target, float_cols, double_cols)                                                      \
  target void matmul_float_##isa(int rows, int cols, int depth, const float* a, int64_t lda, const float* b,         \
                                 int64_t ldb, float* c, int64_t ldc, bool accumulate) {                             \
    matmul_blocked<float, false, 4, float_cols>(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);             \
  }                                                                                                                 \
  target void matmul_float_transposed_a_##isa(int rows, int cols, int depth, const float* a, int64_t lda,          \
                                              const float* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) { \
    matmul_blocked<float, true, 4, float_cols>(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);              \
  }                                                                                                                 \
  target void matmul_double_##isa(int rows, int cols, int depth, const double* a, int64_t lda, const double* b,    \
                                  int64_t ldb, double* c, int64_t ldc, bool accumulate) {                          \
    matmul_blocked<double, false, 4, double_cols>(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);          \
  }                                                                                                                 \
  target void matmul_double_transposed_a_##isa(int rows, int cols, int depth, const double* a, int64_t lda,        \
                                               const double* b, int64_t ldb, double* c, int64_t ldc,               \
                                               bool accumulate) {                                                  \
    matmul_blocked<double, true, 4, double_cols>(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);           \
  }                                                                                                                 \
  target void exp_subtract_columns_##isa(float* values, int rows, int cols, const float* subtract,                  \
                                         float* column_sums) {                                                      \
    exp_subtract_columns_body(values, rows, cols, subtract, column_sums);                                           \
  }                                                                                                                 \
  target void widen_bfloat16_##isa(const BFloat16* from, float* to, int64_t count) {                                \
    widen_bfloat16_body(from, to, count);                                                                           \
  }

MEMBAR_FOR_EACH_ISA(MEMBAR_DEFINE_ISA)
MEMBAR_DEFINE_ISA(baseline, , 8, 4)
#undef MEMBAR_DEFINE_ISA

struct KernelTable {
  decltype(&matmul_float_baseline) matmul_float = matmul_float_baseline;
  decltype(&matmul_float_transposed_a_baseline) matmul_float_transposed_a = matmul_float_transposed_a_baseline;
  decltype(&matmul_double_baseline) matmul_double = matmul_double_baseline;
  decltype(&matmul_double_transposed_a_baseline) matmul_double_transposed_a = matmul_double_transposed_a_baseline;
  decltype(&exp_subtract_columns_baseline) exp_subtract_columns = exp_subtract_columns_baseline;
  decltype(&widen_bfloat16_baseline) widen_bfloat16 = widen_bfloat16_baseline;
};

KernelTable choose_kernels() {
  KernelTable table;
#if defined(__x86_64__)
  __builtin_cpu_init();
#define MEMBAR_USE_ISA(isa)                                             \
  table.matmul_float = matmul_float_##isa;                              \
  table.matmul_float_transposed_a = matmul_float_transposed_a_##isa;    \
  table.matmul_double = matmul_double_##isa;                            \
  table.matmul_double_transposed_a = matmul_double_transposed_a_##isa;  \
  table.exp_subtract_columns = exp_subtract_columns_##isa;              \
  table.widen_bfloat16 = widen_bfloat16_##isa;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")) {
    MEMBAR_USE_ISA(avx512)
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    MEMBAR_USE_ISA(avx2)
  }
#undef MEMBAR_USE_ISA
#endif
  return table;
}

const KernelTable& kernels() {
  static const KernelTable table = choose_kernels();
  return table;
}

}  // namespace

void matmul(int rows, int cols, int depth, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
            int64_t ldc, bool accumulate) {
  kernels().matmul_float(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);
}

void matmul(int rows, int cols, int depth, const double* a, int64_t lda, const double* b, int64_t ldb, double* c,
            int64_t ldc, bool accumulate) {
  kernels().matmul_double(rows, cols, depth, a, lda, b, ldb, c, ldc, accumulate);
}

void matmul_transposed_a(int rows, int cols, int depth, const float* a_transposed, int64_t lda, const float* b,
                         int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  kernels().matmul_float_transposed_a(rows, cols, depth, a_transposed, lda, b, ldb, c, ldc, accumulate);
}

void matmul_transposed_a(int rows, int cols, int depth, const double* a_transposed, int64_t lda, const double* b,
                         int64_t ldb, double* c, int64_t ldc, bool accumulate) {
  kernels().matmul_double_transposed_a(rows, cols, depth, a_transposed, lda, b, ldb, c, ldc, accumulate);
}

void exp_subtract_columns(float* values, int rows, int cols, const float* subtract, float* column_sums) {
  kernels().exp_subtract_columns(values, rows, cols, subtract, column_sums);
}

void exp_subtract_columns(double* values, int rows, int cols, const double* subtract, double* column_sums) {
  for (int i = 0; i < rows; ++i) {
    double* row = values + int64_t(i) * cols;
    for (int j = 0; j < cols; ++j) row[j] = std::exp(row[j] - subtract[j]);  // exp(-inf) is exactly 0
    if (column_sums) {
      for (int j = 0; j < cols; ++j) column_sums[j] += row[j];
    }
  }
}

void widen(const BFloat16* from, float* to, int64_t count) { kernels().widen_bfloat16(from, to, count); }

void widen(const Float16* from, float* to, int64_t count) {
  for (int64_t i = 0; i < count; ++i) to[i] = float16_to_float(from[i]);
}

void widen(const float* from, float* to, int64_t count) { std::memcpy(to, from, size_t(count) * sizeof(float)); }

void widen(const double* from, double* to, int64_t count) { std::memcpy(to, from, size_t(count) * sizeof(double)); }

int worker_limit(int32_t max_threads) {
  if (max_threads >= 1) return max_threads;
  static const int hardware = [] {
    const unsigned count = std::thread::hardware_concurrency();
    return count >= 1 ? int(count) : 1;
  }();
  return hardware;
}

int64_t workers_for_work(double work) {
  constexpr double kWorkPerWorker = 4e6;
  return std::max<int64_t>(1, int64_t(work / kWorkPerWorker));
}

int64_t planned_workers(int64_t num_tasks, int64_t max_workers) {
  return std::max<int64_t>(1, std::min<int64_t>(num_tasks, max_workers));
}

bool parallel_for_workers(int64_t num_tasks, const std::function<void(int64_t, int)>& task, int64_t max_workers) {
  if (num_tasks <= 0) return true;
  std::atomic<int64_t> next_task{0};
  std::atomic<bool> failed{false};
  auto worker = [&](int worker_index) noexcept {
    for (;;) {
      const int64_t index = next_task.fetch_add(1, std::memory_order_relaxed);
      if (index >= num_tasks) return;
      try {
        task(index, worker_index);
      } catch (...) {
        failed.store(true, std::memory_order_relaxed);
      }
    }
  };
  const int64_t helpers = planned_workers(num_tasks, max_workers) - 1;
  std::vector<std::thread> threads;
  for (int64_t i = 0; i < helpers; ++i) {
    try {
      threads.emplace_back(worker, int(i + 1));
    } catch (...) {
      break;  // No more threads available: the ones we have (and this one) do the work.
    }
  }
  worker(0);
  for (std::thread& thread : threads) thread.join();
  return !failed.load();
}

bool parallel_for(int64_t num_tasks, const std::function<void(int64_t)>& task, int64_t max_workers) {
  return parallel_for_workers(num_tasks, [&](int64_t index, int) { task(index); }, max_workers);
}

}  // namespace membar::kernels::cpu::detail
