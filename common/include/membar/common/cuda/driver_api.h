// The one table of CUDA driver entry points membar calls (as PyTorch's c10/cuda/driver_api.h
// and NCCL's pfn_ table do). The driver is loaded at run time with dlopen("libcuda.so.1") and
// every entry point is looked up with cuGetProcAddress for the CUDA version these headers
// describe, so:
//   - a binary built with CUDA support starts on a machine without a driver; the first call
//     that needs the driver returns UNAVAILABLE with a sentence saying why;
//   - there is one place where tests inject faults ("cuMemCreate fails after N calls").
//
// Everything here is usable from any thread. Calling an entry point needs no lock.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "membar/status.h"

namespace membar::cuda {

// X(entry point). Names are the un-suffixed driver symbols; cuda.h's macros give each member
// the signature of the newest version (for example cuStreamWriteValue64 -> _v2), and
// cuGetProcAddress is asked for exactly that version (CUDA_VERSION).
#define MEMBAR_CUDA_DRIVER_ENTRY_POINTS(X) \
  X(cuInit)                                \
  X(cuDriverGetVersion)                    \
  X(cuGetErrorName)                        \
  X(cuGetErrorString)                      \
  X(cuDeviceGet)                           \
  X(cuDeviceGetCount)                      \
  X(cuDeviceGetAttribute)                  \
  X(cuDevicePrimaryCtxRetain)              \
  X(cuDevicePrimaryCtxRelease)             \
  X(cuCtxGetCurrent)                       \
  X(cuCtxSetCurrent)                       \
  X(cuMemRelease)                          \
  X(cuMemExportToShareableHandle)          \
  X(cuMemImportFromShareableHandle)        \
  X(cuMemAddressReserve)                   \
  X(cuMemAddressFree)                      \
  X(cuMemMap)                              \
  X(cuMemUnmap)                            \
  X(cuMemSetAccess)                        \
  X(cuMemGetAllocationGranularity)         \
  X(cuMemHostRegister)                     \
  X(cuMemHostUnregister)                   \
  X(cuMemHostGetDevicePointer)             \
  X(cuStreamWriteValue64)                  \
  X(cuStreamWaitValue64)

// Test fault injection, one counter per table. Not a global: a test builds its own table
// (DriverApi::load) and sets the counter on it.
struct DriverFaults {
  // cuMemCreate succeeds this many more times, then every further call returns
  // CUDA_ERROR_OUT_OF_MEMORY without reaching the driver. Negative: never fail.
  std::atomic<int64_t> mem_create_successes_left{-1};
};

class DriverApi {
 public:
  // The process-wide table, loaded on first use (thread-safe). A failed load is remembered
  // and returned again: UNAVAILABLE when libcuda.so.1 cannot be opened or lacks an entry point.
  static Result<const DriverApi*> get();
  // A fresh table from `library` (tests: a missing path, the toolkit's stub library, or a
  // table whose fault counters they set). Does not call cuInit.
  static Result<std::unique_ptr<DriverApi>> load(const std::string& library);
  // A table whose entry points the caller fills in (tests of the fault-injection and error
  // paths on machines without a driver). Every entry point starts null.
  static std::unique_ptr<DriverApi> empty();

  DriverApi(const DriverApi&) = delete;
  DriverApi& operator=(const DriverApi&) = delete;

#define MEMBAR_CUDA_DRIVER_MEMBER(name) decltype(&::name) name = nullptr;
  MEMBAR_CUDA_DRIVER_ENTRY_POINTS(MEMBAR_CUDA_DRIVER_MEMBER)
#undef MEMBAR_CUDA_DRIVER_MEMBER

  // cuMemCreate goes through here and nowhere else, so fault injection sees every call.
  CUresult mem_create(CUmemGenericAllocationHandle* handle, size_t bytes,
                      const CUmemAllocationProp* properties, unsigned long long flags) const;
  // The real entry point behind mem_create (tests set it when building a table by hand).
  decltype(&::cuMemCreate) cuMemCreate_entry = nullptr;

  // Mutable through a const table: fault counters are test state, not part of the table.
  DriverFaults& faults() const { return faults_; }
  // Where the table came from ("libcuda.so.1").
  const std::string& library() const { return library_; }

  // Calls cuInit(0) once per table and remembers the answer. UNAVAILABLE when the driver has
  // no usable device (no GPU, a stub library, a driver older than the toolkit).
  Status initialize() const;

 private:
  DriverApi() = default;

  std::string library_;
  mutable DriverFaults faults_;
  mutable std::once_flag initialize_once_;
  mutable Status initialize_status_;  // written once, inside initialize_once_
};

// The Status for a driver result: OK for CUDA_SUCCESS; otherwise the mapped code and
// "<what> failed: CUDA_ERROR_OUT_OF_MEMORY (out of memory)". Mapping:
//   CUDA_ERROR_OUT_OF_MEMORY                        -> RESOURCE_EXHAUSTED
//   no device / stub library / driver too old        -> UNAVAILABLE
//   CUDA_ERROR_INVALID_VALUE / INVALID_HANDLE        -> INVALID_ARGUMENT
//   CUDA_ERROR_NOT_SUPPORTED                         -> UNIMPLEMENTED
//   CUDA_ERROR_NOT_PERMITTED                         -> PERMISSION_DENIED
//   anything else                                    -> INTERNAL
// `api` may be null (then the message carries the number only).
Status driver_status(const DriverApi* api, CUresult result, std::string_view what);
StatusCode driver_status_code(CUresult result);

}  // namespace membar::cuda
