// CUDA implementations of the LoGRA ops (schemas in ../logra_ops.cpp): validate, fill the
// kernel's params, launch on the current stream of the tensor's device.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "logra_ops.h"

namespace membar::bindings::logra {
namespace {

namespace k = membar::kernels;

void check_cuda(const at::Tensor& tensor, const char* what) {
  TORCH_CHECK(tensor.is_cuda(), "LoGRA: ", what, " must be a CUDA tensor for the CUDA kernel.");
}

void check_launch(int error, const char* what) {
  TORCH_CHECK(error == 0, "LoGRA ", what, ": the CUDA launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(error)), ".");
}

void generate_cuda(at::Tensor out, int64_t seed, int64_t matrix_id, int64_t step) {
  check_cuda(out, "out");
  const c10::cuda::CUDAGuard guard(out.device());
  const auto p = prepare_generate(out, seed, matrix_id, step);
  check_launch(k::cuda::logra_generate(p, at::cuda::getCurrentCUDAStream().stream()), "generate");
}

at::Tensor project_cuda(const at::Tensor& x, int64_t seed, int64_t matrix_id, int64_t step, int64_t rank) {
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  auto call = prepare_project(x, seed, matrix_id, step, rank);
  check_launch(k::cuda::logra_project(call.params, at::cuda::getCurrentCUDAStream().stream()), "project");
  return call.out.view(call.out_shape);
}

void fused_update_cuda(at::Tensor weight, const at::Tensor& update, double coefficient, int64_t seed,
                       int64_t matrix_id, int64_t step) {
  check_cuda(weight, "the weight");
  check_cuda(update, "the update");
  const c10::cuda::CUDAGuard guard(weight.device());
  const auto p = prepare_update(weight, update, coefficient, seed, matrix_id, step);
  check_launch(k::cuda::logra_fused_update(p, at::cuda::getCurrentCUDAStream().stream()), "update");
}

}  // namespace
}  // namespace membar::bindings::logra

TORCH_LIBRARY_IMPL(membar, CUDA, m) {
  m.impl("logra_generate_", &membar::bindings::logra::generate_cuda);
  m.impl("logra_project", &membar::bindings::logra::project_cuda);
  m.impl("logra_fused_update_", &membar::bindings::logra::fused_update_cuda);
}
