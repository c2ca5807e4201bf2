// Building blocks of the CPU attention kernels: a small dense matrix multiply, an array
// exponential, element conversions and a parallel loop. Internal to kernels/cpu/.
#pragma once

#include <cstdint>
#include <functional>

#include "membar/kernels/half_types.h"

namespace membar::kernels::cpu::detail {

// C[rows][cols] += A[rows][depth] * B[depth][cols]; all three row-major with the given leading
// dimensions (elements between consecutive rows). Picks AVX-512, AVX2+FMA or baseline code
// once, from what the running CPU supports.
void matmul_accumulate(int rows, int cols, int depth, const float* a, int64_t lda, const float* b,
                       int64_t ldb, float* c, int64_t ldc);
void matmul_accumulate(int rows, int cols, int depth, const double* a, int64_t lda, const double* b,
                       int64_t ldb, double* c, int64_t ldc);

// values[i] = exp(values[i] - subtract), with exp(-inf) = 0; returns the sum of the results.
// The float version uses a polynomial accurate to about 2 ulp (softmax needs no more); the
// double version calls std::exp.
float exp_subtract_sum(float* values, int count, float subtract);
double exp_subtract_sum(double* values, int count, double subtract);

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

// The number of worker threads the kernels use: MEMBAR_CPU_THREADS if set (>= 1), else
// std::thread::hardware_concurrency().
int worker_count();

// Calls task(index) for every index in [0, num_tasks), on up to worker_count() threads (the
// calling thread is one of them); indices are handed out in increasing order. Blocks until
// every task ran. Returns false when a task threw (its exception is swallowed; the remaining
// tasks still run) so that kernels can report an error code instead of throwing.
bool parallel_for(int64_t num_tasks, const std::function<void(int64_t)>& task);

}  // namespace membar::kernels::cpu::detail
