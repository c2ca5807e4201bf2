// Matrix multiply, exponential and parallel loop for the CPU attention kernels.
//
// Note [CPU matmul micro-kernel]
// Rationale: attention spends nearly all its time in five small matrix products per block
// (64..128 rows, 64..256 columns, depth 64..256). A blocked loop that the compiler vectorises
// reaches a useful fraction of the core's peak without a BLAS dependency.
// Approach: C is walked in register tiles of kTileRows x kTileCols; each tile's accumulators
// live in registers across the whole depth loop and are added to C once. The same template is
// compiled three times, for AVX-512, AVX2+FMA and the x86-64 baseline, with the tile width
// matched to the vector width; the first call picks the best one the CPU supports.
// Limitations: no packing of A or B, so very large depths stream B from L2; the blocks the
// attention kernels pass are small enough for that not to matter.
#include "attention_cpu_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

namespace membar::kernels::cpu::detail {
namespace {

template <typename T, int kTileRows, int kTileCols>
__attribute__((always_inline)) inline void matmul_tile(int depth, const T* a, int64_t lda,
                                                      const T* b, int64_t ldb, T* c, int64_t ldc) {
  T accumulator[kTileRows][kTileCols] = {};
  for (int k = 0; k < depth; ++k) {
    const T* b_row = b + int64_t(k) * ldb;
    for (int r = 0; r < kTileRows; ++r) {
      const T a_value = a[int64_t(r) * lda + k];
      for (int j = 0; j < kTileCols; ++j) accumulator[r][j] += a_value * b_row[j];
    }
  }
  for (int r = 0; r < kTileRows; ++r) {
    for (int j = 0; j < kTileCols; ++j) c[int64_t(r) * ldc + j] += accumulator[r][j];
  }
}

// The edges of C that do not fill a register tile: plain loops.
template <typename T>
__attribute__((always_inline)) inline void matmul_edge(int rows, int cols, int depth, const T* a,
                                                      int64_t lda, const T* b, int64_t ldb, T* c,
                                                      int64_t ldc) {
  for (int r = 0; r < rows; ++r) {
    T* c_row = c + int64_t(r) * ldc;
    for (int k = 0; k < depth; ++k) {
      const T a_value = a[int64_t(r) * lda + k];
      const T* b_row = b + int64_t(k) * ldb;
      for (int j = 0; j < cols; ++j) c_row[j] += a_value * b_row[j];
    }
  }
}

template <typename T, int kTileRows, int kTileCols>
__attribute__((always_inline)) inline void matmul_blocked(int rows, int cols, int depth, const T* a,
                                                         int64_t lda, const T* b, int64_t ldb, T* c,
                                                         int64_t ldc) {
  const int full_rows = rows - rows % kTileRows;
  const int full_cols = cols - cols % kTileCols;
  for (int r = 0; r < full_rows; r += kTileRows) {
    for (int j = 0; j < full_cols; j += kTileCols) {
      matmul_tile<T, kTileRows, kTileCols>(depth, a + int64_t(r) * lda, lda, b + j, ldb,
                                           c + int64_t(r) * ldc + j, ldc);
    }
    if (full_cols < cols) {
      matmul_edge<T>(kTileRows, cols - full_cols, depth, a + int64_t(r) * lda, lda, b + full_cols,
                     ldb, c + int64_t(r) * ldc + full_cols, ldc);
    }
  }
  if (full_rows < rows) {
    matmul_edge<T>(rows - full_rows, cols, depth, a + int64_t(full_rows) * lda, lda, b, ldb,
                   c + int64_t(full_rows) * ldc, ldc);
  }
}

#if defined(__x86_64__)
#define MEMBAR_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,fma,prefer-vector-width=512")))
#define MEMBAR_TARGET_AVX2 __attribute__((target("avx2,fma")))

// Tile shapes: 4 rows x 2 vectors keeps 8 independent accumulator registers, enough to cover
// the FMA latency on two ports.
MEMBAR_TARGET_AVX512 void matmul_float_avx512(int rows, int cols, int depth, const float* a, int64_t lda,
                                              const float* b, int64_t ldb, float* c, int64_t ldc) {
  matmul_blocked<float, 4, 32>(rows, cols, depth, a, lda, b, ldb, c, ldc);
}
MEMBAR_TARGET_AVX2 void matmul_float_avx2(int rows, int cols, int depth, const float* a, int64_t lda,
                                          const float* b, int64_t ldb, float* c, int64_t ldc) {
  matmul_blocked<float, 4, 16>(rows, cols, depth, a, lda, b, ldb, c, ldc);
}
MEMBAR_TARGET_AVX512 void matmul_double_avx512(int rows, int cols, int depth, const double* a, int64_t lda,
                                               const double* b, int64_t ldb, double* c, int64_t ldc) {
  matmul_blocked<double, 4, 16>(rows, cols, depth, a, lda, b, ldb, c, ldc);
}
MEMBAR_TARGET_AVX2 void matmul_double_avx2(int rows, int cols, int depth, const double* a, int64_t lda,
                                           const double* b, int64_t ldb, double* c, int64_t ldc) {
  matmul_blocked<double, 4, 8>(rows, cols, depth, a, lda, b, ldb, c, ldc);
}
#endif

void matmul_float_baseline(int rows, int cols, int depth, const float* a, int64_t lda, const float* b,
                           int64_t ldb, float* c, int64_t ldc) {
  matmul_blocked<float, 4, 8>(rows, cols, depth, a, lda, b, ldb, c, ldc);
}
void matmul_double_baseline(int rows, int cols, int depth, const double* a, int64_t lda, const double* b,
                            int64_t ldb, double* c, int64_t ldc) {
  matmul_blocked<double, 4, 4>(rows, cols, depth, a, lda, b, ldb, c, ldc);
}

using MatmulFloat = void (*)(int, int, int, const float*, int64_t, const float*, int64_t, float*, int64_t);
using MatmulDouble = void (*)(int, int, int, const double*, int64_t, const double*, int64_t, double*, int64_t);

struct MatmulTable {
  MatmulFloat matmul_float = matmul_float_baseline;
  MatmulDouble matmul_double = matmul_double_baseline;
};

MatmulTable choose_matmul() {
  MatmulTable table;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")) {
    table.matmul_float = matmul_float_avx512;
    table.matmul_double = matmul_double_avx512;
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    table.matmul_float = matmul_float_avx2;
    table.matmul_double = matmul_double_avx2;
  }
#endif
  return table;
}

const MatmulTable& matmul_table() {
  static const MatmulTable table = choose_matmul();
  return table;
}

// exp(x) for float arrays, written so that the compiler vectorises it: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by a degree-6 polynomial (Cephes' expf coefficients), 2^n built in the
// exponent bits. Inputs below -87.3 (including -inf) give exactly 0.
__attribute__((always_inline)) inline float exp_subtract_sum_body(float* values, int count, float subtract) {
  float sum = 0.f;
  for (int i = 0; i < count; ++i) {
    float x = values[i] - subtract;
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
    const int32_t exponent = int32_t(n) + 127;
    float scale;
    const uint32_t scale_bits = uint32_t(exponent) << 23;
    std::memcpy(&scale, &scale_bits, sizeof(scale));
    float result = p * scale;
    result = underflow ? 0.f : result;
    values[i] = result;
    sum += result;
  }
  return sum;
}

#if defined(__x86_64__)
MEMBAR_TARGET_AVX512 float exp_subtract_sum_avx512(float* values, int count, float subtract) {
  return exp_subtract_sum_body(values, count, subtract);
}
MEMBAR_TARGET_AVX2 float exp_subtract_sum_avx2(float* values, int count, float subtract) {
  return exp_subtract_sum_body(values, count, subtract);
}
#endif
float exp_subtract_sum_baseline(float* values, int count, float subtract) {
  return exp_subtract_sum_body(values, count, subtract);
}

using ExpFloat = float (*)(float*, int, float);

ExpFloat choose_exp() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")) return exp_subtract_sum_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return exp_subtract_sum_avx2;
#endif
  return exp_subtract_sum_baseline;
}

}  // namespace

void matmul_accumulate(int rows, int cols, int depth, const float* a, int64_t lda, const float* b,
                       int64_t ldb, float* c, int64_t ldc) {
  matmul_table().matmul_float(rows, cols, depth, a, lda, b, ldb, c, ldc);
}

void matmul_accumulate(int rows, int cols, int depth, const double* a, int64_t lda, const double* b,
                       int64_t ldb, double* c, int64_t ldc) {
  matmul_table().matmul_double(rows, cols, depth, a, lda, b, ldb, c, ldc);
}

float exp_subtract_sum(float* values, int count, float subtract) {
  static const ExpFloat implementation = choose_exp();
  return implementation(values, count, subtract);
}

double exp_subtract_sum(double* values, int count, double subtract) {
  double sum = 0.0;
  for (int i = 0; i < count; ++i) {
    values[i] = std::exp(values[i] - subtract);  // exp(-inf) is exactly 0
    sum += values[i];
  }
  return sum;
}

int worker_count() {
  static const int count = [] {
    if (const char* text = std::getenv("MEMBAR_CPU_THREADS")) {
      const int requested = std::atoi(text);
      if (requested >= 1) return requested;
    }
    const unsigned hardware = std::thread::hardware_concurrency();
    return hardware >= 1 ? int(hardware) : 1;
  }();
  return count;
}

bool parallel_for(int64_t num_tasks, const std::function<void(int64_t)>& task) {
  if (num_tasks <= 0) return true;
  std::atomic<int64_t> next_task{0};
  std::atomic<bool> failed{false};
  auto worker = [&]() noexcept {
    for (;;) {
      const int64_t index = next_task.fetch_add(1, std::memory_order_relaxed);
      if (index >= num_tasks) return;
      try {
        task(index);
      } catch (...) {
        failed.store(true, std::memory_order_relaxed);
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(worker_count(), num_tasks) - 1;
  std::vector<std::thread> threads;
  for (int64_t i = 0; i < helpers; ++i) {
    try {
      threads.emplace_back(worker);
    } catch (...) {
      break;  // No more threads available: the ones we have (and this one) do the work.
    }
  }
  worker();
  for (std::thread& thread : threads) thread.join();
  return !failed.load();
}

}  // namespace membar::kernels::cpu::detail
