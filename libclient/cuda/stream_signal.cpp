#include "stream_signal.h"

#include <cuda.h>
#include <unistd.h>

#include <string>

#include "membar/common/cuda/driver_api.h"
#include "membar/common/cuda/resources.h"

namespace membar {
namespace {

using cuda::DriverApi;
using cuda::driver_status;
using cuda::HostRegistration;
using cuda::PrimaryContext;

class CudaStreamSignals final : public StreamSignals {
 public:
  CudaStreamSignals(const DriverApi* api, PrimaryContext context, HostRegistration registration,
                    CUdeviceptr device_words, volatile uint64_t* words, uint32_t word_count)
      : api_(api),
        context_(std::move(context)),
        registration_(std::move(registration)),
        device_words_(device_words),
        words_(words),
        word_count_(word_count) {}

  ~CudaStreamSignals() override {
    (void)cuda::bind_context(api_, context_.get());
    registration_.reset();
  }

  Status stream_wait(uint32_t index, uint64_t value, void* cuda_stream) const override {
    MEMBAR_RETURN_IF_ERROR(check_index(index));
    MEMBAR_RETURN_IF_ERROR(cuda::bind_context(api_, context_.get()));
    return driver_status(api_,
                         api_->cuStreamWaitValue64(static_cast<CUstream>(cuda_stream), word(index), value,
                                                   CU_STREAM_WAIT_VALUE_GEQ),
                         "cuStreamWaitValue64 on signal word " + std::to_string(index));
  }

  Status stream_write(uint32_t index, uint64_t value, void* cuda_stream) const override {
    MEMBAR_RETURN_IF_ERROR(check_index(index));
    MEMBAR_RETURN_IF_ERROR(cuda::bind_context(api_, context_.get()));
    return driver_status(api_,
                         api_->cuStreamWriteValue64(static_cast<CUstream>(cuda_stream), word(index), value,
                                                    CU_STREAM_WRITE_VALUE_DEFAULT),
                         "cuStreamWriteValue64 on signal word " + std::to_string(index));
  }

  volatile uint64_t* words() const override { return words_; }
  uint32_t word_count() const override { return word_count_; }

 private:
  Status check_index(uint32_t index) const {
    if (index < word_count_) return Status::Ok();
    return out_of_range("signal word " + std::to_string(index) + " is past the block's " +
                        std::to_string(word_count_) + " words");
  }
  CUdeviceptr word(uint32_t index) const {
    return device_words_ + static_cast<CUdeviceptr>(index) * sizeof(uint64_t);
  }

  const DriverApi* api_;
  PrimaryContext context_;
  HostRegistration registration_;  // empty when someone else in this process registered it
  CUdeviceptr device_words_;
  volatile uint64_t* words_;
  uint32_t word_count_;
};

}  // namespace

Result<std::unique_ptr<StreamSignals>> StreamSignals::create(volatile uint64_t* words, uint32_t word_count,
                                                             int device) {
  if (words == nullptr || word_count == 0) {
    return invalid_argument("StreamSignals needs the mapped signal block and its word count");
  }
  uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  auto* pointer = const_cast<uint64_t*>(words);
  if (reinterpret_cast<uintptr_t>(pointer) % page != 0) {
    return invalid_argument("a signal block mapping must be page-aligned (map the block's fd with mmap)");
  }
  MEMBAR_ASSIGN_OR_RETURN(const DriverApi* api, DriverApi::get());
  MEMBAR_ASSIGN_OR_RETURN(PrimaryContext context, cuda::retain_primary_context(api, device));
  MEMBAR_RETURN_IF_ERROR(cuda::bind_context(api, context.get()));
  int supported = 0;
  MEMBAR_RETURN_IF_ERROR(driver_status(
      api, api->cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, context.device()),
      "cuDeviceGetAttribute(CAN_USE_64_BIT_STREAM_MEM_OPS)"));
  if (supported == 0) {
    return unimplemented("CUDA device " + std::to_string(device) +
                         " cannot run 64-bit stream memory operations (cuStreamWaitValue64)");
  }

  uint64_t bytes = (static_cast<uint64_t>(word_count) * sizeof(uint64_t) + page - 1) / page * page;
  HostRegistration registration;
  CUresult registered = api->cuMemHostRegister(pointer, bytes, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
  if (registered == CUDA_SUCCESS) {
    registration = HostRegistration(api, pointer);
  } else if (registered != CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) {
    // Already registered means the embedded runtime's backend shares this very mapping: use it.
    return driver_status(api, registered, "cuMemHostRegister of the signal block");
  }
  CUdeviceptr device_words = 0;
  MEMBAR_RETURN_IF_ERROR(driver_status(api, api->cuMemHostGetDevicePointer(&device_words, pointer, 0),
                                       "cuMemHostGetDevicePointer of the signal block"));
  return std::unique_ptr<StreamSignals>(
      new CudaStreamSignals(api, std::move(context), std::move(registration), device_words, words, word_count));
}

}  // namespace membar
