// The CUDA driver table's error paths. Runs on any machine (label unit): without libcuda the
// table must say so clearly; fault injection and error mapping need no driver at all.
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <unistd.h>

#include "membar/engine/backend.h"
#include "membar/common/cuda/driver_api.h"

namespace membar::cuda {
namespace {

TEST(CudaDriverApi, MissingLibraryIsUnavailableWithAReason) {
  Result<std::unique_ptr<DriverApi>> api = DriverApi::load("/nonexistent/membar/libcuda.so.1");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), StatusCode::UNAVAILABLE);
  EXPECT_NE(api.status().message().find("/nonexistent/membar/libcuda.so.1"), std::string::npos)
      << api.status().to_string();
  EXPECT_NE(api.status().message().find("could not be loaded"), std::string::npos) << api.status().to_string();
}

TEST(CudaDriverApi, LibraryWithoutTheEntryPointIsUnavailable) {
  // libc has no cuGetProcAddress_v2: a library that opens but is not a CUDA driver.
  Result<std::unique_ptr<DriverApi>> api = DriverApi::load("libc.so.6");
  ASSERT_FALSE(api.ok());
  EXPECT_EQ(api.status().code(), StatusCode::UNAVAILABLE);
  EXPECT_NE(api.status().message().find("cuGetProcAddress_v2"), std::string::npos) << api.status().to_string();
}

TEST(CudaDriverApi, ToolkitStubLibraryCannotStartTheDriver) {
  if (access(MEMBAR_CUDA_STUB_LIBRARY, R_OK) != 0) GTEST_SKIP() << "no stub library at " MEMBAR_CUDA_STUB_LIBRARY;
  // The stub exports every symbol but runs nothing: either the lookup or cuInit must refuse,
  // and the answer must be UNAVAILABLE (use another backend), never a crash.
  Result<std::unique_ptr<DriverApi>> api = DriverApi::load(MEMBAR_CUDA_STUB_LIBRARY);
  if (!api.ok()) {
    EXPECT_EQ(api.status().code(), StatusCode::UNAVAILABLE) << api.status().to_string();
    return;
  }
  Status started = api.value()->initialize();
  EXPECT_EQ(started.code(), StatusCode::UNAVAILABLE) << started.to_string();
  EXPECT_FALSE(started.message().empty());
  // The answer is remembered.
  EXPECT_EQ(api.value()->initialize().code(), started.code());
}

TEST(CudaDriverApi, ProcessTableIsLoadedOnceWithTheSameAnswer) {
  Result<const DriverApi*> first = DriverApi::get();
  Result<const DriverApi*> second = DriverApi::get();
  ASSERT_EQ(first.ok(), second.ok());
  if (first.ok()) {
    EXPECT_EQ(first.value(), second.value());
    EXPECT_EQ(first.value()->library(), "libcuda.so.1");
    EXPECT_NE(first.value()->cuMemMap, nullptr);
    EXPECT_NE(first.value()->cuStreamWaitValue64, nullptr);
  } else {
    EXPECT_EQ(first.status().code(), StatusCode::UNAVAILABLE);
    EXPECT_NE(first.status().message().find("libcuda.so.1"), std::string::npos) << first.status().to_string();
    EXPECT_EQ(first.status().message(), second.status().message());
  }
}

// A stand-in for the driver's cuMemCreate: counts calls and hands out distinct handles.
std::atomic<int> fake_mem_create_calls{0};
CUresult fake_mem_create(CUmemGenericAllocationHandle* handle, size_t, const CUmemAllocationProp*, unsigned long long) {
  *handle = static_cast<CUmemGenericAllocationHandle>(++fake_mem_create_calls);
  return CUDA_SUCCESS;
}

TEST(CudaDriverApi, MemCreateFailsAfterNCallsAsOutOfMemory) {
  std::unique_ptr<DriverApi> api = DriverApi::empty();
  api->cuMemCreate_entry = fake_mem_create;
  fake_mem_create_calls = 0;
  CUmemAllocationProp properties = {};
  CUmemGenericAllocationHandle handle = 0;

  // Never failing by default.
  for (int call = 0; call < 5; ++call) ASSERT_EQ(api->mem_create(&handle, 2 << 20, &properties, 0), CUDA_SUCCESS);
  EXPECT_EQ(fake_mem_create_calls, 5);

  api->faults().mem_create_successes_left = 3;
  for (int call = 0; call < 3; ++call) ASSERT_EQ(api->mem_create(&handle, 2 << 20, &properties, 0), CUDA_SUCCESS);
  EXPECT_EQ(fake_mem_create_calls, 8);
  for (int call = 0; call < 4; ++call) {
    EXPECT_EQ(api->mem_create(&handle, 2 << 20, &properties, 0), CUDA_ERROR_OUT_OF_MEMORY);
  }
  EXPECT_EQ(fake_mem_create_calls, 8) << "an injected failure must not reach the driver";

  Status status = driver_status(api.get(), api->mem_create(&handle, 2 << 20, &properties, 0), "cuMemCreate of frame 4");
  EXPECT_EQ(status.code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(status.message().find("cuMemCreate of frame 4 failed"), std::string::npos) << status.to_string();

  api->faults().mem_create_successes_left = -1;
  EXPECT_EQ(api->mem_create(&handle, 2 << 20, &properties, 0), CUDA_SUCCESS);
}

TEST(CudaDriverApi, MemCreateWithoutAnEntryPointFails) {
  std::unique_ptr<DriverApi> api = DriverApi::empty();
  CUmemGenericAllocationHandle handle = 0;
  CUmemAllocationProp properties = {};
  EXPECT_EQ(api->mem_create(&handle, 2 << 20, &properties, 0), CUDA_ERROR_NOT_INITIALIZED);
  Status started = api->initialize();
  EXPECT_EQ(started.code(), StatusCode::UNAVAILABLE);
}

TEST(CudaDriverApi, ResultsMapToCanonicalCodes) {
  EXPECT_EQ(driver_status_code(CUDA_SUCCESS), StatusCode::OK);
  EXPECT_EQ(driver_status_code(CUDA_ERROR_OUT_OF_MEMORY), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(driver_status_code(CUDA_ERROR_NO_DEVICE), StatusCode::UNAVAILABLE);
  EXPECT_EQ(driver_status_code(CUDA_ERROR_STUB_LIBRARY), StatusCode::UNAVAILABLE);
  EXPECT_EQ(driver_status_code(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH), StatusCode::UNAVAILABLE);
  EXPECT_EQ(driver_status_code(CUDA_ERROR_INVALID_VALUE), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(driver_status_code(CUDA_ERROR_NOT_SUPPORTED), StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(driver_status_code(CUDA_ERROR_NOT_PERMITTED), StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(driver_status_code(CUDA_ERROR_ILLEGAL_ADDRESS), StatusCode::INTERNAL);

  EXPECT_TRUE(driver_status(nullptr, CUDA_SUCCESS, "anything").ok());
  Status without_table = driver_status(nullptr, CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate");
  EXPECT_EQ(without_table.code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(without_table.message(), "cuMemCreate failed: CUDA error 2");
}

TEST(CudaDriverApi, BackendWithoutADriverIsUnavailable) {
  Result<const DriverApi*> api = DriverApi::get();
  if (api.ok() && api.value()->initialize().ok()) GTEST_SKIP() << "this machine has a working CUDA driver";
  runtimed::BackendConfig config;
  config.gpu_pool_bytes = 4ull << 20;
  config.host_pool_bytes = 4ull << 20;
  Result<std::unique_ptr<runtimed::DeviceBackend>> backend = runtimed::make_cuda_backend(config);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), StatusCode::UNAVAILABLE) << backend.status().to_string();
  EXPECT_FALSE(backend.status().message().empty());
}

TEST(CudaDriverApi, BackendRejectsPoolsThatAreNotWholeFrames) {
  runtimed::BackendConfig config;
  config.gpu_pool_bytes = (2ull << 20) + 1;
  Result<std::unique_ptr<runtimed::DeviceBackend>> backend = runtimed::make_cuda_backend(config);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), StatusCode::INVALID_ARGUMENT) << backend.status().to_string();
}

}  // namespace
}  // namespace membar::cuda
