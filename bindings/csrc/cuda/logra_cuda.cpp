// CUDA implementations of the LoGRA ops (schemas in ../logra_ops.cpp): validate, fill the
// kernel's params, launch on the current stream of the tensor's device.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>

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

// Elements of the transient bf16 sign tile of the tensor-core path: 16 MiB. Every projection of
// the 1.5B, 7B and 27B shapes up to r = 256 (r x k at most 256 x 27648) takes one tile, hence one
// GEMM; larger ones are cut into column tiles whose partial products are summed in fp32.
constexpr int64_t kSignTileElements = int64_t{8} << 20;

// Note [LoGRA projection paths on the GPU]
// exact = true: the fused kernel (A regenerated in shared memory, fp32 CUDA-core math), bit-identical
// to the CPU reference. exact = false with bf16 x (the training default): A's signs are written
// into a transient bf16 tile (+-1 is exact in bf16) and cuBLAS multiplies x by it on tensor cores
// with fp32 accumulation, applying 1/sqrt(r) as the GEMM's alpha before the one rounding to bf16.
// When A is too large for one tile, column tiles are multiplied into an fp32 accumulator, which is
// scaled and rounded once at the end. Same values up to fp32 summation order, several times faster
// than the CUDA-core kernel.
at::Tensor project_cuda(const at::Tensor& x, int64_t seed, int64_t matrix_id, int64_t step, int64_t rank, bool exact) {
  check_cuda(x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  auto call = prepare_project(x, seed, matrix_id, step, rank);
  const auto stream = at::cuda::getCurrentCUDAStream().stream();
  if (exact || x.scalar_type() != at::kBFloat16 || call.params.tokens == 0) {
    check_launch(k::cuda::logra_project(call.params, stream), "project");
    return call.out.view(call.out_shape);
  }
  const int64_t in_features = call.params.shape.in_features;
  const int64_t tile_limit = std::max<int64_t>(64, kSignTileElements / rank / 64 * 64);
  const int64_t tile_columns = std::min(tile_limit, in_features);
  const double scale = 1.0 / std::sqrt(static_cast<double>(rank));
  auto sign_buffer = at::empty({rank * tile_columns}, x.options());  // transient, bf16
  auto fill_tile = [&](int64_t column_begin, int64_t columns) {
    auto tile = sign_buffer.narrow(0, 0, rank * columns).view({rank, columns});  // [r, columns]
    k::LograSignTileParams tile_params;
    tile_params.shape = call.params.shape;
    tile_params.key = call.params.key;
    tile_params.column_begin = column_begin;
    tile_params.columns = columns;
    tile_params.out = tile.data_ptr();
    check_launch(k::cuda::logra_sign_tile(tile_params, stream), "sign tile");
    return tile;
  };
  if (tile_columns == in_features) {
    auto tile = fill_tile(0, in_features);
    at::addmm_out(call.out, call.out, call.x_rows, tile.t(), /*beta=*/0, /*alpha=*/scale);  // [T, r] bf16
    return call.out.view(call.out_shape);
  }
  at::Tensor accumulator;
  for (int64_t column_begin = 0; column_begin < in_features; column_begin += tile_columns) {
    const int64_t columns = std::min(tile_columns, in_features - column_begin);
    auto tile = fill_tile(column_begin, columns);
    auto partial = at::mm(call.x_rows.narrow(1, column_begin, columns), tile.t(), at::kFloat);  // [T, r] fp32
    if (accumulator.defined()) {
      accumulator.add_(partial);
    } else {
      accumulator = partial;
    }
  }
  accumulator.mul_(scale);
  call.out.copy_(accumulator);
  return call.out.view(call.out_shape);
}

// exact = false (the training default) takes the tensor-core kernel where the GPU has bf16 tensor
// cores (compute capability 8.0+): Note [LoGRA tensor-core update] in kernels/cuda/logra_cuda.cu.
void fused_update_cuda(at::Tensor weight, const at::Tensor& update, double coefficient, int64_t seed,
                       int64_t matrix_id, int64_t step, int64_t rounding_seed, bool exact) {
  check_cuda(weight, "the weight");
  check_cuda(update, "the update");
  const c10::cuda::CUDAGuard guard(weight.device());
  const auto p = prepare_update(weight, update, coefficient, seed, matrix_id, step, rounding_seed);
  const auto stream = at::cuda::getCurrentCUDAStream().stream();
  if (!exact && at::cuda::getCurrentDeviceProperties()->major >= 8) {
    check_launch(k::cuda::logra_fused_update_tensor_core(p, stream), "update (tensor cores)");
  } else {
    check_launch(k::cuda::logra_fused_update(p, stream), "update");
  }
}

}  // namespace
}  // namespace membar::bindings::logra

TORCH_LIBRARY_IMPL(membar, CUDA, m) {
  m.impl("logra_generate_", &membar::bindings::logra::generate_cuda);
  m.impl("logra_project", &membar::bindings::logra::project_cuda);
  m.impl("logra_fused_update_", &membar::bindings::logra::fused_update_cuda);
}
