// The sweep target (membar_kernels_sweep): the layouts of the CUDA attention kernels that were
// measured against each other for bf16, head_dim 128 (the shipped ones, the contenders that lost,
// and experimental ones never verified on a GPU), each runnable by name. Only
// bench/attention_sweep.py uses it, through the torch module of bindings/csrc/sweep/; the library
// users load compiles the shipped layouts alone (Note [Layout choice] in membar/kernels/attention_cuda.h), and
// docs/kernels.md keeps the measurements and why each contender lost. Torch-free, CUDA-free.
#pragma once

#include <cstdint>

#include "membar/kernels/attention.h"

namespace membar::kernels::cuda::sweep {

enum class Standing : int32_t {
  kShipped = 0,       // a layout the library compiles for bf16, head_dim 128
  kContender = 1,     // measured and lost (docs/kernels.md says why)
  kExperimental = 2,  // never verified on a GPU: checked against the shipped layouts before it is timed
};

// A kernel's resources, from cudaFuncGetAttributes.
struct KernelResources {
  int32_t registers = 0;    // per thread
  int32_t local_bytes = 0;  // local memory per thread (stack frame and spills)
};

// One layout. fits: whether it can run this call (bf16, head_dim 128, no logit soft-cap, its page
// size, sparse tiles and device). run: checks the params as the library's launch does, then
// enqueues the whole forward or backward with this layout on `stream`; returns a cudaError_t
// value. resources: of its main kernel, on the current device.
struct ForwardEntry {
  const char* name;
  Standing standing;
  bool (*fits)(const PagedAttentionForwardParams& params);
  int (*run)(const PagedAttentionForwardParams& params, void* stream);
  int (*resources)(KernelResources* resources);
};
struct BackwardEntry {
  const char* name;
  Standing standing;
  bool (*fits)(const PagedAttentionBackwardParams& params);
  int (*run)(const PagedAttentionBackwardParams& params, void* stream);
  int (*resources)(KernelResources* resources);
};

// The resources of a __global__ function on the current device; returns a cudaError_t value.
int kernel_resources(const void* kernel, KernelResources* resources);

// The entries, shipped ones first; entry(index) is null outside [0, count).
int forward_entry_count();
const ForwardEntry* forward_entry(int index);
int backward_entry_count();
const BackwardEntry* backward_entry(int index);

}  // namespace membar::kernels::cuda::sweep
