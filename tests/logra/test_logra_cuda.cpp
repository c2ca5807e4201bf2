// CUDA kernels of LoGRA against the CPU reference kernels: the same key must give the same A,
// and projections and fused updates must give the same bits (Note [LoGRA summation order]).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "membar/kernels/logra.h"

namespace membar::kernels {
namespace {

#define ASSERT_CUDA(call) ASSERT_EQ((call), cudaSuccess) << cudaGetErrorString(static_cast<cudaError_t>(call))

std::vector<float> random_vector(size_t count, uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> values(count);
  for (auto& v : values) v = normal(generator);
  return values;
}

uint16_t to_bfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// A device buffer that frees itself.
struct DeviceBuffer {
  void* pointer = nullptr;
  explicit DeviceBuffer(size_t bytes) { EXPECT_EQ(cudaMalloc(&pointer, bytes), cudaSuccess); }
  ~DeviceBuffer() { cudaFree(pointer); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

TEST(LograCuda, GeneratorMatchesCpu) {
  const int64_t r = 96, k = 333;
  LograGenerateParams params;
  params.shape = {r, k};
  params.key = {0xDEADBEEFull, 5, 17};
  std::vector<float> cpu_out(r * k), gpu_out(r * k);
  params.out = cpu_out.data();
  ASSERT_EQ(cpu::logra_generate(params), kLograOk);
  DeviceBuffer device(r * k * sizeof(float));
  params.out = static_cast<float*>(device.pointer);
  ASSERT_CUDA(cuda::logra_generate(params, nullptr));
  ASSERT_CUDA(cudaMemcpy(gpu_out.data(), device.pointer, r * k * sizeof(float), cudaMemcpyDeviceToHost));
  EXPECT_EQ(0, std::memcmp(cpu_out.data(), gpu_out.data(), r * k * sizeof(float)));
}

void check_project(int64_t tokens, int64_t k, int64_t r, DType dtype) {
  const size_t element = dtype_size(dtype);
  const auto values = random_vector(tokens * k, 3);
  std::vector<uint8_t> x(tokens * k * element);
  for (int64_t i = 0; i < tokens * k; ++i) {
    if (dtype == DType::kFloat32) {
      std::memcpy(&x[i * 4], &values[i], 4);
    } else {
      // bf16 bits also serve as (finite, small) fp16 test data after masking the exponent.
      uint16_t bits = to_bfloat16(values[i]);
      if (dtype == DType::kFloat16) bits = static_cast<uint16_t>((bits & 0x83FFu) | 0x3800u);
      std::memcpy(&x[i * 2], &bits, 2);
    }
  }
  std::vector<uint8_t> cpu_out(tokens * r * element), gpu_out(tokens * r * element);
  LograProjectParams params;
  params.shape = {r, k};
  params.key = {77, 9, 123};
  params.tokens = tokens;
  params.dtype = dtype;
  params.x = x.data();
  params.x_row_stride = k;
  params.out = cpu_out.data();
  ASSERT_EQ(cpu::logra_project(params), kLograOk);
  DeviceBuffer device_x(x.size()), device_out(gpu_out.size());
  ASSERT_CUDA(cudaMemcpy(device_x.pointer, x.data(), x.size(), cudaMemcpyHostToDevice));
  params.x = device_x.pointer;
  params.out = device_out.pointer;
  ASSERT_CUDA(cuda::logra_project(params, nullptr));
  ASSERT_CUDA(cudaMemcpy(gpu_out.data(), device_out.pointer, gpu_out.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(0, std::memcmp(cpu_out.data(), gpu_out.data(), gpu_out.size())) << dtype_name(dtype);
}

TEST(LograCuda, ProjectMatchesCpuFloat32) { check_project(130, 300, 72, DType::kFloat32); }
TEST(LograCuda, ProjectMatchesCpuBFloat16) { check_project(257, 1000, 256, DType::kBFloat16); }
TEST(LograCuda, ProjectMatchesCpuFloat16) { check_project(65, 64, 8, DType::kFloat16); }

void check_update(int64_t d, int64_t k, int64_t r, DType weight_dtype, uint64_t rounding_seed = 0) {
  const auto u = random_vector(d * r, 4);
  const auto w = random_vector(d * k, 5);
  const size_t element = dtype_size(weight_dtype);
  std::vector<uint8_t> weight(d * k * element);
  for (int64_t i = 0; i < d * k; ++i) {
    if (weight_dtype == DType::kFloat32) {
      std::memcpy(&weight[i * 4], &w[i], 4);
    } else {
      const uint16_t bits = to_bfloat16(w[i]);
      std::memcpy(&weight[i * 2], &bits, 2);
    }
  }
  std::vector<uint8_t> cpu_weight = weight, gpu_weight(weight.size());
  LograUpdateParams params;
  params.shape = {r, k};
  params.key = {31337, 4, 2};
  params.out_features = d;
  params.coefficient = 0.013f;
  params.update = u.data();
  params.weight_dtype = weight_dtype;
  params.weight = cpu_weight.data();
  params.rounding_seed = rounding_seed;
  ASSERT_EQ(cpu::logra_fused_update(params), kLograOk);
  DeviceBuffer device_u(u.size() * 4), device_w(weight.size());
  ASSERT_CUDA(cudaMemcpy(device_u.pointer, u.data(), u.size() * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(device_w.pointer, weight.data(), weight.size(), cudaMemcpyHostToDevice));
  params.update = static_cast<const float*>(device_u.pointer);
  params.weight = device_w.pointer;
  ASSERT_CUDA(cuda::logra_fused_update(params, nullptr));
  ASSERT_CUDA(cudaMemcpy(gpu_weight.data(), device_w.pointer, gpu_weight.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(0, std::memcmp(cpu_weight.data(), gpu_weight.data(), gpu_weight.size())) << dtype_name(weight_dtype);
}

TEST(LograCuda, UpdateMatchesCpuFloat32) { check_update(100, 250, 40, DType::kFloat32); }
TEST(LograCuda, UpdateMatchesCpuBFloat16) { check_update(300, 520, 256, DType::kBFloat16); }
TEST(LograCuda, StochasticRoundingMatchesCpu) { check_update(130, 200, 16, DType::kBFloat16, 0x1234567ull); }

// The tensor-core kernel against a double-precision reference W - c U A (A from the CPU
// generator): U travels as two bf16 terms (error at most 2^-16 |U|) and sums run in fp32 over 2r
// terms, so the error per element stays below c / sqrt(r) * sum_j |U[i, j]| * 2^-14 plus W's own
// rounding (a bf16-only U would be off by up to 2^-8 of that sum).
void check_tensor_core_update(int64_t d, int64_t k, int64_t r) {
  const auto u = random_vector(d * r, 6);
  const auto w = random_vector(d * k, 7);
  std::vector<float> a(r * k);
  LograGenerateParams generate;
  generate.shape = {r, k};
  generate.key = {777, 3, 5};
  generate.out = a.data();
  ASSERT_EQ(cpu::logra_generate(generate), kLograOk);
  const float coefficient = 0.21f;
  DeviceBuffer device_u(u.size() * 4), device_w(w.size() * 4);
  ASSERT_CUDA(cudaMemcpy(device_u.pointer, u.data(), u.size() * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(device_w.pointer, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  LograUpdateParams params;
  params.shape = {r, k};
  params.key = generate.key;
  params.out_features = d;
  params.coefficient = coefficient;
  params.update = static_cast<const float*>(device_u.pointer);
  params.weight_dtype = DType::kFloat32;
  params.weight = device_w.pointer;
  ASSERT_CUDA(cuda::logra_fused_update_tensor_core(params, nullptr));
  std::vector<float> gpu_weight(w.size());
  ASSERT_CUDA(cudaMemcpy(gpu_weight.data(), device_w.pointer, w.size() * 4, cudaMemcpyDeviceToHost));
  int64_t bad = 0;
  for (int64_t i = 0; i < d; ++i) {
    double magnitude = 0.0;
    for (int64_t j = 0; j < r; ++j) magnitude += std::abs(static_cast<double>(u[i * r + j]));
    const double bound = coefficient / std::sqrt(static_cast<double>(r)) * magnitude * std::ldexp(1.0, -14);
    for (int64_t c = 0; c < k; ++c) {
      double delta = 0.0;
      for (int64_t j = 0; j < r; ++j) delta += static_cast<double>(u[i * r + j]) * a[j * k + c];
      const double reference = w[i * k + c] - coefficient * delta;
      const double error = std::abs(gpu_weight[i * k + c] - reference);
      if (error > bound + std::abs(reference) * std::ldexp(1.0, -23)) ++bad;
    }
  }
  EXPECT_EQ(bad, 0) << d << " x " << k << " rank " << r;
}

// Ragged in every tile dimension (rows % 64, columns % 128, rank % 64), and a multi-chunk rank.
TEST(LograCuda, TensorCoreUpdateMatchesReference) { check_tensor_core_update(131, 300, 40); }
TEST(LograCuda, TensorCoreUpdateMatchesReferenceRank256) { check_tensor_core_update(64, 640, 256); }
TEST(LograCuda, TensorCoreUpdateMatchesReferenceRagged) { check_tensor_core_update(70, 1000, 100); }
// rank % 4 != 0 and k % 4 != 0: the scalar paths for U and W.
TEST(LograCuda, TensorCoreUpdateMatchesReferenceScalarPaths) { check_tensor_core_update(33, 301, 7); }

TEST(LograCuda, BadParametersAreRejectedWithoutLaunch) {
  LograUpdateParams params;
  params.shape = {4, 4};
  params.out_features = 4;
  EXPECT_EQ(cuda::logra_fused_update(params, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::logra_fused_update_tensor_core(params, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace membar::kernels
