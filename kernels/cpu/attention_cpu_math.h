// Building blocks of the CPU attention kernels: a small dense matrix multiply, an array
// exponential, element conversions and a parallel loop. Internal to kernels/cpu/.
#pragma once

#include <cstdint>
#include <functional>

#include "membar/kernels/half_types.h"

namespace membar::kernels::cpu::detail {

// C[rows][cols] (+)= A[rows][depth] * B[depth][cols]; all three row-major with the given leading
// dimensions (elements between consecutive rows). With accumulate the product is added to C,
// otherwise it overwrites C. Picks AVX-512, AVX2+FMA or baseline code once, from what the
// running CPU supports.
void matmul(int rows, int cols, int depth, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
            int64_t ldc, bool accumulate);
void matmul(int rows, int cols, int depth, const double* a, int64_t lda, const double* b, int64_t ldb, double* c,
            int64_t ldc, bool accumulate);

// The same with A given transposed: C[rows][cols] (+)= A^T B where a_transposed is
// [depth][rows] (lda elements between its rows).
void matmul_transposed_a(int rows, int cols, int depth, const float* a_transposed, int64_t lda, const float* b,
                         int64_t ldb, float* c, int64_t ldc, bool accumulate);
void matmul_transposed_a(int rows, int cols, int depth, const double* a_transposed, int64_t lda, const double* b,
                         int64_t ldb, double* c, int64_t ldc, bool accumulate);

// For a dense [rows][cols] block: values[i][j] = exp(values[i][j] - subtract[j]), with
// exp(-inf) = 0; when column_sums is not null, adds each column's new values into it. The float
// version uses a polynomial accurate to about 2 ulp (softmax needs no more); the double version
// calls std::exp.
void exp_subtract_columns(float* values, int rows, int cols, const float* subtract, float* column_sums);
void exp_subtract_columns(double* values, int rows, int cols, const double* subtract, double* column_sums);

// Widens `count` contiguous elements into the compute type.
void widen(const BFloat16* from, float* to, int64_t count);
void widen(const Float16* from, float* to, int64_t count);
void widen(const float* from, float* to, int64_t count);
void widen(const double* from, double* to, int64_t count);

// Element conversions: widening into the compute type and narrowing (round to nearest even).
inline float to_compute(float value) { return value; }
inline double to_compute(double value) { return value; }
inline float to_compute(BFloat16 value) { return bfloat16_to_float(value); }
inline float to_compute(Float16 value) { return float16_to_float(value); }

template <typename Element>
inline Element from_compute(float value);
template <>
inline float from_compute<float>(float value) { return value; }
template <>
inline BFloat16 from_compute<BFloat16>(float value) { return float_to_bfloat16(value); }
template <>
inline Float16 from_compute<Float16>(float value) { return float_to_float16(value); }
template <typename Element>
inline Element from_compute(double value);
template <>
inline double from_compute<double>(double value) { return value; }

// The number of worker threads a call may use: max_threads when it is at least 1
// (CpuOptions::max_threads), else std::thread::hardware_concurrency().
int worker_limit(int32_t max_threads);

// Calls task(index) for every index in [0, num_tasks), on up to max_workers threads (the calling
// thread is one of them); indices are handed out in increasing order. Blocks until every task ran.
// Returns false when a task threw (its exception is swallowed; the remaining tasks still run) so
// that kernels can report an error code instead of throwing.
bool parallel_for(int64_t num_tasks, const std::function<void(int64_t)>& task, int64_t max_workers);

// The same, also passing the worker's number, in [0, planned_workers(num_tasks, max_workers)),
// to each task (for per-worker buffers).
bool parallel_for_workers(int64_t num_tasks, const std::function<void(int64_t, int)>& task, int64_t max_workers);

// The number of workers parallel_for(_workers) starts at most for these arguments.
int64_t planned_workers(int64_t num_tasks, int64_t max_workers);

// How many workers `work` floating-point operations deserve: starting a thread costs about as
// much as a few million of them, so small problems stay on the calling thread.
int64_t workers_for_work(double work);

}  // namespace membar::kernels::cpu::detail
