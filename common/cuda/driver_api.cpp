#include "membar/common/cuda/driver_api.h"

#include <dlfcn.h>

#include <string>

namespace membar::cuda {
namespace {

// cuGetProcAddress is the one symbol found with dlsym; every other entry point comes from it,
// versioned. cuda.h maps the name to cuGetProcAddress_v2 (CUDA 12+ signature).
using GetProcAddressFunction = decltype(&::cuGetProcAddress);
constexpr const char* kGetProcAddressSymbol = "cuGetProcAddress_v2";

}  // namespace

Result<std::unique_ptr<DriverApi>> DriverApi::load(const std::string& library) {
  // The handle is never closed: the CUDA runtime linked into this binary opens the same
  // library, and entry points copied out of the table must stay valid for the process.
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* reason = dlerror();
    return unavailable("the CUDA driver library " + library + " could not be loaded (" +
                       (reason != nullptr ? reason : "no reason given") +
                       "); is the NVIDIA driver installed on this machine?");
  }
  auto get_proc_address =
      reinterpret_cast<GetProcAddressFunction>(dlsym(handle, kGetProcAddressSymbol));
  if (get_proc_address == nullptr) {
    return unavailable("the CUDA driver library " + library + " has no " +
                       kGetProcAddressSymbol + "; the driver is older than CUDA 12");
  }

  std::unique_ptr<DriverApi> api(new DriverApi());
  api->library_ = library;
  auto resolve = [&](const char* symbol, void** entry) -> Status {
    CUdriverProcAddressQueryResult query = CU_GET_PROC_ADDRESS_SUCCESS;
    CUresult result = get_proc_address(symbol, entry, CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &query);
    if (result == CUDA_SUCCESS && query == CU_GET_PROC_ADDRESS_SUCCESS && *entry != nullptr) {
      return Status::Ok();
    }
    std::string why = query == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                          ? "the driver is older than the CUDA " + std::to_string(CUDA_VERSION / 1000) +
                                "." + std::to_string(CUDA_VERSION % 1000 / 10) + " this build needs"
                          : "the symbol was not found (result " + std::to_string(result) + ")";
    return unavailable(std::string("the CUDA driver library ") + library + " does not provide " +
                       symbol + ": " + why);
  };
#define MEMBAR_CUDA_DRIVER_RESOLVE(name) \
  MEMBAR_RETURN_IF_ERROR(resolve(#name, reinterpret_cast<void**>(&api->name)));
  MEMBAR_CUDA_DRIVER_ENTRY_POINTS(MEMBAR_CUDA_DRIVER_RESOLVE)
#undef MEMBAR_CUDA_DRIVER_RESOLVE
  MEMBAR_RETURN_IF_ERROR(resolve("cuMemCreate", reinterpret_cast<void**>(&api->cuMemCreate_entry)));
  return api;
}

std::unique_ptr<DriverApi> DriverApi::empty() {
  std::unique_ptr<DriverApi> api(new DriverApi());
  api->library_ = "(filled in by hand)";
  return api;
}

Result<const DriverApi*> DriverApi::get() {
  // Loaded once; the Result (table or the reason there is none) lives for the process.
  static const Result<std::unique_ptr<DriverApi>>* const loaded =
      new Result<std::unique_ptr<DriverApi>>(load("libcuda.so.1"));
  if (!loaded->ok()) return loaded->status();
  return static_cast<const DriverApi*>(loaded->value().get());
}

CUresult DriverApi::mem_create(CUmemGenericAllocationHandle* handle, size_t bytes,
                               const CUmemAllocationProp* properties,
                               unsigned long long flags) const {
  // Note [Fault injection]: a negative counter never fails. Otherwise each call takes one
  // success from the counter; when none is left the call fails as a full GPU would.
  int64_t left = faults_.mem_create_successes_left.load(std::memory_order_relaxed);
  while (left >= 0) {
    if (left == 0) return CUDA_ERROR_OUT_OF_MEMORY;
    if (faults_.mem_create_successes_left.compare_exchange_weak(left, left - 1)) break;
  }
  if (cuMemCreate_entry == nullptr) return CUDA_ERROR_NOT_INITIALIZED;
  return cuMemCreate_entry(handle, bytes, properties, flags);
}

Status DriverApi::initialize() const {
  std::call_once(initialize_once_, [this] {
    if (cuInit == nullptr) {
      initialize_status_ = unavailable("the CUDA driver table from " + library_ + " has no cuInit");
      return;
    }
    CUresult result = cuInit(0);
    if (result != CUDA_SUCCESS) {
      Status status = driver_status(this, result, "cuInit (starting the CUDA driver from " + library_ + ")");
      // Whatever stops the driver from starting means "no usable GPU here", which callers
      // treat as "use another backend".
      initialize_status_ = Status(StatusCode::UNAVAILABLE, status.message());
      return;
    }
    int devices = 0;
    result = cuDeviceGetCount(&devices);
    if (result != CUDA_SUCCESS) {
      initialize_status_ = driver_status(this, result, "cuDeviceGetCount");
    } else if (devices == 0) {
      initialize_status_ = unavailable("the CUDA driver reports no GPU on this machine");
    }
  });
  return initialize_status_;
}

StatusCode driver_status_code(CUresult result) {
  switch (result) {
    case CUDA_SUCCESS:
      return StatusCode::OK;
    case CUDA_ERROR_OUT_OF_MEMORY:
      return StatusCode::RESOURCE_EXHAUSTED;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_STUB_LIBRARY:
    case CUDA_ERROR_SYSTEM_NOT_READY:
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
    case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
    case CUDA_ERROR_DEVICE_UNAVAILABLE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
      return StatusCode::UNAVAILABLE;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_INVALID_DEVICE:
      return StatusCode::INVALID_ARGUMENT;
    case CUDA_ERROR_NOT_SUPPORTED:
      return StatusCode::UNIMPLEMENTED;
    case CUDA_ERROR_NOT_PERMITTED:
      return StatusCode::PERMISSION_DENIED;
    default:
      return StatusCode::INTERNAL;
  }
}

Status driver_status(const DriverApi* api, CUresult result, std::string_view what) {
  if (result == CUDA_SUCCESS) return Status::Ok();
  const char* name = nullptr;
  const char* text = nullptr;
  if (api != nullptr && api->cuGetErrorName != nullptr) api->cuGetErrorName(result, &name);
  if (api != nullptr && api->cuGetErrorString != nullptr) api->cuGetErrorString(result, &text);
  std::string message(what);
  message += " failed: ";
  message += name != nullptr ? name : "CUDA error " + std::to_string(static_cast<int>(result));
  if (text != nullptr) {
    message += " (";
    message += text;
    message += ")";
  }
  return Status(driver_status_code(result), std::move(message));
}

}  // namespace membar::cuda
