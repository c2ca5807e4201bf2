// Shared validation of the LoGRA ops (logra_ops.cpp holds the schemas and the CPU kernels,
// cuda/logra_cuda.cpp the CUDA kernels). Each helper checks its tensors with TORCH_CHECK and a
// sentence, then fills the kernel's plain parameter struct; nothing here launches work.
#pragma once

#include <torch/library.h>

#include "membar/kernels/logra.h"

namespace membar::bindings::logra {

kernels::LograKey make_key(int64_t seed, int64_t matrix_id, int64_t step);
kernels::DType to_kernel_dtype(at::ScalarType type);

// x [..., k] -> (params, x viewed as [tokens, k] and kept alive, out [tokens, r]).
struct ProjectCall {
  kernels::LograProjectParams params;
  at::Tensor x_rows;  // [tokens, k], unit column stride
  at::Tensor out;     // [tokens, r], x's dtype and device
  std::vector<int64_t> out_shape;  // [..., r]
};
ProjectCall prepare_project(const at::Tensor& x, int64_t seed, int64_t matrix_id, int64_t step, int64_t rank);

// Checks S [d, r] fp32, dY [..., d], P [..., r] with matching leading dimensions. Returns
// (dY as [tokens, d], P as [tokens, r]).
std::pair<at::Tensor, at::Tensor> prepare_sketch(const at::Tensor& sketch, const at::Tensor& grad_output,
                                                 const at::Tensor& projected);

kernels::LograUpdateParams prepare_update(const at::Tensor& weight, const at::Tensor& update, double coefficient,
                                          int64_t seed, int64_t matrix_id, int64_t step, int64_t rounding_seed);

kernels::LograGenerateParams prepare_generate(const at::Tensor& out, int64_t seed, int64_t matrix_id, int64_t step);

// S += dY^T P through a matmul with fp32 accumulation (BLAS on the CPU, cuBLAS on the GPU).
void sketch_accumulate_matmul(at::Tensor& sketch, const at::Tensor& grad_rows, const at::Tensor& projected_rows);

}  // namespace membar::bindings::logra
