// LoGRA ops: schemas (one fragment of the membar library), shared validation and the CPU
// implementations. The CUDA implementations live in cuda/logra_cuda.cpp.
//
//   logra_generate_(Tensor! out, int seed, int matrix_id, int step)           out [r, k] fp32 := A
//   logra_project(Tensor x, int seed, int matrix_id, int step, int rank, bool exact=False)
//                                                                             [..., k] -> [..., r]
//     exact: on the GPU, use the kernel that is bit-identical to the CPU (see cuda/logra_cuda.cpp,
//     Note [LoGRA projection paths on the GPU]); the CPU always is.
//   logra_sketch_accumulate_(Tensor! sketch, Tensor grad_output, Tensor projected)
//                                                                             S [d, r] += dY^T P
//   logra_fused_update_(Tensor! weight, Tensor update, float coefficient, int seed, int matrix_id, int step,
//                       int rounding_seed=0, bool exact=False)               W [d, k] -= c U A
//     rounding_seed: bf16 W only; nonzero rounds stochastically (Note [LoGRA stochastic rounding]).
//     exact: on the GPU, use the CUDA-core kernel that is bit-identical to the CPU instead of the
//     tensor-core kernel (Note [LoGRA tensor-core update]); the CPU always is.
#include "logra_ops.h"

#include <ATen/ATen.h>

namespace membar::bindings::logra {

namespace k = membar::kernels;

k::LograKey make_key(int64_t seed, int64_t matrix_id, int64_t step) {
  TORCH_CHECK(matrix_id >= 0, "LoGRA: matrix_id must not be negative (got ", matrix_id, ").");
  TORCH_CHECK(step >= 0, "LoGRA: step must not be negative (got ", step, ").");
  k::LograKey key;
  key.seed = static_cast<uint64_t>(seed);
  key.matrix_id = static_cast<uint64_t>(matrix_id);
  key.step = static_cast<uint64_t>(step);
  return key;
}

k::DType to_kernel_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return k::DType::kFloat32;
    case at::kBFloat16: return k::DType::kBFloat16;
    case at::kHalf: return k::DType::kFloat16;
    default: TORCH_CHECK(false, "LoGRA: tensors must be float32, bfloat16 or float16 (got ", type, ").");
  }
}

ProjectCall prepare_project(const at::Tensor& x, int64_t seed, int64_t matrix_id, int64_t step, int64_t rank) {
  TORCH_CHECK(x.dim() >= 1, "LoGRA project: x must have at least one dimension [..., in_features].");
  TORCH_CHECK(rank >= 1, "LoGRA project: rank must be at least 1 (got ", rank, ").");
  TORCH_CHECK(x.size(-1) >= 1, "LoGRA project: x's last dimension (in_features) must not be empty.");
  ProjectCall call;
  const int64_t in_features = x.size(-1);
  call.x_rows = x.reshape({-1, in_features});
  if (call.x_rows.stride(1) != 1 || call.x_rows.stride(0) < in_features) call.x_rows = call.x_rows.contiguous();
  call.out_shape = x.sizes().vec();
  call.out_shape.back() = rank;
  call.out = at::empty({call.x_rows.size(0), rank}, x.options());
  auto& p = call.params;
  p.shape.rank = rank;
  p.shape.in_features = in_features;
  p.key = make_key(seed, matrix_id, step);
  p.tokens = call.x_rows.size(0);
  p.dtype = to_kernel_dtype(x.scalar_type());
  p.x = call.x_rows.data_ptr();
  p.x_row_stride = call.x_rows.size(0) > 1 ? call.x_rows.stride(0) : in_features;
  p.out = call.out.data_ptr();
  const char* problem = k::logra_check_project(p);
  TORCH_CHECK(problem[0] == '\0', "LoGRA project: ", problem);
  return call;
}

std::pair<at::Tensor, at::Tensor> prepare_sketch(const at::Tensor& sketch, const at::Tensor& grad_output,
                                                 const at::Tensor& projected) {
  TORCH_CHECK(sketch.dim() == 2, "LoGRA sketch: the sketch must be [out_features, rank] (got ", sketch.sizes(), ").");
  TORCH_CHECK(sketch.scalar_type() == at::kFloat, "LoGRA sketch: the sketch must be float32 (got ",
              sketch.scalar_type(), ").");
  TORCH_CHECK(sketch.is_contiguous(), "LoGRA sketch: the sketch must be contiguous.");
  TORCH_CHECK(grad_output.dim() >= 1 && projected.dim() >= 1,
              "LoGRA sketch: grad_output [..., d] and projected [..., r] need at least one dimension.");
  TORCH_CHECK(grad_output.size(-1) == sketch.size(0), "LoGRA sketch: grad_output's last dimension (",
              grad_output.size(-1), ") must equal the sketch's out_features (", sketch.size(0), ").");
  TORCH_CHECK(projected.size(-1) == sketch.size(1), "LoGRA sketch: projected's last dimension (", projected.size(-1),
              ") must equal the sketch's rank (", sketch.size(1), ").");
  TORCH_CHECK(grad_output.sizes().slice(0, grad_output.dim() - 1) == projected.sizes().slice(0, projected.dim() - 1),
              "LoGRA sketch: grad_output ", grad_output.sizes(), " and projected ", projected.sizes(),
              " must have the same leading (token) dimensions.");
  TORCH_CHECK(grad_output.device() == sketch.device() && projected.device() == sketch.device(),
              "LoGRA sketch: sketch, grad_output and projected must be on one device.");
  TORCH_CHECK(grad_output.scalar_type() == projected.scalar_type(), "LoGRA sketch: grad_output (",
              grad_output.scalar_type(), ") and projected (", projected.scalar_type(), ") must share a dtype.");
  to_kernel_dtype(grad_output.scalar_type());
  return {grad_output.reshape({-1, sketch.size(0)}), projected.reshape({-1, sketch.size(1)})};
}

void sketch_accumulate_matmul(at::Tensor& sketch, const at::Tensor& grad_rows, const at::Tensor& projected_rows) {
  if (grad_rows.size(0) == 0) return;
  if (grad_rows.scalar_type() == at::kFloat) {
    sketch.addmm_(grad_rows.t(), projected_rows);
  } else if (sketch.is_cuda()) {
    // cuBLAS reads bf16/fp16 and accumulates and writes fp32: no fp32 copy of dY.
    sketch.add_(at::mm(grad_rows.t(), projected_rows, at::kFloat));
  } else {
    sketch.addmm_(grad_rows.t().to(at::kFloat), projected_rows.to(at::kFloat));
  }
}

k::LograUpdateParams prepare_update(const at::Tensor& weight, const at::Tensor& update, double coefficient,
                                    int64_t seed, int64_t matrix_id, int64_t step, int64_t rounding_seed) {
  TORCH_CHECK(weight.dim() == 2, "LoGRA update: the weight must be [out_features, in_features] (got ",
              weight.sizes(), ").");
  TORCH_CHECK(update.dim() == 2, "LoGRA update: the update must be [out_features, rank] (got ", update.sizes(), ").");
  TORCH_CHECK(update.size(0) == weight.size(0), "LoGRA update: the update has ", update.size(0),
              " rows but the weight has ", weight.size(0), " (out_features must match).");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "LoGRA update: the weight must be float32 or bfloat16 (got ", weight.scalar_type(), ").");
  TORCH_CHECK(update.scalar_type() == at::kFloat, "LoGRA update: the update must be float32 (got ",
              update.scalar_type(), ").");
  TORCH_CHECK(weight.is_contiguous() && update.is_contiguous(), "LoGRA update: weight and update must be contiguous.");
  TORCH_CHECK(weight.device() == update.device(), "LoGRA update: weight and update must be on one device.");
  k::LograUpdateParams p;
  p.shape.rank = update.size(1);
  p.shape.in_features = weight.size(1);
  p.key = make_key(seed, matrix_id, step);
  p.out_features = weight.size(0);
  p.coefficient = static_cast<float>(coefficient);
  p.update = update.data_ptr<float>();
  p.weight_dtype = to_kernel_dtype(weight.scalar_type());
  p.weight = weight.data_ptr();
  p.rounding_seed = static_cast<uint64_t>(rounding_seed);
  const char* problem = k::logra_check_update(p);
  TORCH_CHECK(problem[0] == '\0', "LoGRA update: ", problem);
  return p;
}

k::LograGenerateParams prepare_generate(const at::Tensor& out, int64_t seed, int64_t matrix_id, int64_t step) {
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "LoGRA generate: out must be a contiguous float32 [rank, in_features] tensor.");
  TORCH_CHECK(out.size(0) >= 1 && out.size(1) >= 1, "LoGRA generate: rank and in_features must be at least 1.");
  k::LograGenerateParams p;
  p.shape.rank = out.size(0);
  p.shape.in_features = out.size(1);
  p.key = make_key(seed, matrix_id, step);
  p.out = out.data_ptr<float>();
  return p;
}

namespace {

void check_cpu(const at::Tensor& tensor, const char* what) {
  TORCH_CHECK(tensor.device().is_cpu(), "LoGRA: ", what, " must be on the CPU for the CPU kernel.");
}

void generate_cpu(at::Tensor out, int64_t seed, int64_t matrix_id, int64_t step) {
  const auto p = prepare_generate(out, seed, matrix_id, step);
  TORCH_CHECK(k::cpu::logra_generate(p) == k::kLograOk, "LoGRA generate: the CPU kernel rejected its parameters.");
}

at::Tensor project_cpu(const at::Tensor& x, int64_t seed, int64_t matrix_id, int64_t step, int64_t rank, bool exact) {
  check_cpu(x, "x");
  auto call = prepare_project(x, seed, matrix_id, step, rank);
  TORCH_CHECK(k::cpu::logra_project(call.params) == k::kLograOk, "LoGRA project: the CPU kernel rejected its parameters.");
  return call.out.view(call.out_shape);
}

at::Tensor project_meta(const at::Tensor& x, int64_t seed, int64_t matrix_id, int64_t step, int64_t rank, bool exact) {
  TORCH_CHECK(x.dim() >= 1 && rank >= 1, "LoGRA project: x must be [..., in_features] and rank at least 1.");
  auto shape = x.sizes().vec();
  shape.back() = rank;
  return at::empty(shape, x.options());
}

void sketch_accumulate(at::Tensor sketch, const at::Tensor& grad_output, const at::Tensor& projected) {
  auto [grad_rows, projected_rows] = prepare_sketch(sketch, grad_output, projected);
  sketch_accumulate_matmul(sketch, grad_rows, projected_rows);
}

void fused_update_cpu(at::Tensor weight, const at::Tensor& update, double coefficient, int64_t seed, int64_t matrix_id,
                      int64_t step, int64_t rounding_seed, bool exact) {
  check_cpu(weight, "the weight");
  const auto p = prepare_update(weight, update, coefficient, seed, matrix_id, step, rounding_seed);
  TORCH_CHECK(k::cpu::logra_fused_update(p) == k::kLograOk, "LoGRA update: the CPU kernel rejected its parameters.");
}

void fused_update_meta(at::Tensor weight, const at::Tensor& update, double coefficient, int64_t seed,
                       int64_t matrix_id, int64_t step, int64_t rounding_seed, bool exact) {
  TORCH_CHECK(weight.dim() == 2 && update.dim() == 2 && weight.size(0) == update.size(0),
              "LoGRA update: weight [d, k] and update [d, r] must agree on d.");
}

}  // namespace
}  // namespace membar::bindings::logra

TORCH_LIBRARY_FRAGMENT(membar, m) {
  m.def("logra_generate_(Tensor! out, int seed, int matrix_id, int step) -> ()");
  m.def("logra_project(Tensor x, int seed, int matrix_id, int step, int rank, bool exact=False) -> Tensor");
  m.def("logra_sketch_accumulate_(Tensor! sketch, Tensor grad_output, Tensor projected) -> ()");
  m.def("logra_fused_update_(Tensor! weight, Tensor update, float coefficient, int seed, int matrix_id, int step, "
        "int rounding_seed=0, bool exact=False) -> ()");
}

TORCH_LIBRARY_IMPL(membar, CPU, m) {
  m.impl("logra_generate_", &membar::bindings::logra::generate_cpu);
  m.impl("logra_project", &membar::bindings::logra::project_cpu);
  m.impl("logra_fused_update_", &membar::bindings::logra::fused_update_cpu);
}

TORCH_LIBRARY_IMPL(membar, Meta, m) {
  m.impl("logra_project", &membar::bindings::logra::project_meta);
  m.impl("logra_fused_update_", &membar::bindings::logra::fused_update_meta);
}

// The sketch update is a matmul: one implementation serves every backend.
TORCH_LIBRARY_IMPL(membar, CompositeExplicitAutograd, m) {
  m.impl("logra_sketch_accumulate_", &membar::bindings::logra::sketch_accumulate);
}
