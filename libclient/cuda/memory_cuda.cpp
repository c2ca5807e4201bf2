// The CUDA GPU tier of ClientMemory (../memory.h): each granted frame's descriptor is imported
// once (cuMemImportFromShareableHandle) and closed; the frame is mapped at space positions with
// cuMemMap + cuMemSetAccess (~30 us on the H200) and unmapped with cuMemUnmap (~18 us). A frame
// may be mapped at several positions at once (the engine's mapping cache, Note [Remapping a
// position]); a revoke unmaps it everywhere before the imported handle is released. The mapper
// retains the device's primary context (the one PyTorch uses), so the addresses are usable by the
// trainer's kernels.
#include <cuda.h>

#include <map>
#include <string>
#include <vector>

#include "../memory.h"
#include "membar/common/cuda/driver_api.h"
#include "membar/common/cuda/resources.h"

namespace membar {
namespace {

using cuda::DriverApi;
using cuda::driver_status;
using cuda::PhysicalAllocation;
using cuda::PrimaryContext;

class CudaMapper final : public FrameMapper {
 public:
  static Result<std::unique_ptr<FrameMapper>> create(int device) {
    std::unique_ptr<CudaMapper> mapper(new CudaMapper());
    MEMBAR_ASSIGN_OR_RETURN(mapper->api_, DriverApi::get());
    MEMBAR_ASSIGN_OR_RETURN(mapper->context_, cuda::retain_primary_context(mapper->api_, device));
    return std::unique_ptr<FrameMapper>(std::move(mapper));
  }

  ~CudaMapper() override {
    (void)cuda::bind_context(api_, context_.get());
    frames_.clear();
  }

  Result<char*> reserve(uint64_t bytes) override {
    MEMBAR_RETURN_IF_ERROR(cuda::bind_context(api_, context_.get()));
    CUdeviceptr base = 0;
    MEMBAR_RETURN_IF_ERROR(driver_status(api_, api_->cuMemAddressReserve(&base, bytes, kFrameBytes, 0, 0),
                                         "cuMemAddressReserve of " + std::to_string(bytes >> 20) + " MiB for a space"));
    return reinterpret_cast<char*>(base);
  }

  void release(char* base, uint64_t bytes) override {
    if (cuda::bind_context(api_, context_.get()).ok()) {
      api_->cuMemAddressFree(reinterpret_cast<CUdeviceptr>(base), bytes);
    }
  }

  Status adopt_frame(uint32_t window_frame, int fd) override {
    cuda::ScopedFd owned(fd);  // the import keeps its own reference
    MEMBAR_RETURN_IF_ERROR(cuda::bind_context(api_, context_.get()));
    CUmemGenericAllocationHandle handle = 0;
    CUresult imported = api_->cuMemImportFromShareableHandle(
        &handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (imported != CUDA_SUCCESS) {
      return driver_status(api_, imported, "cuMemImportFromShareableHandle of frame " + std::to_string(window_frame) +
                                               " (is the fd a CUDA frame from the daemon?)");
    }
    frames_[window_frame] = PhysicalAllocation(api_, handle);
    return Status::Ok();
  }

  Status adopt_slab(uint32_t, uint32_t, uint32_t, int fd) override {
    cuda::ScopedFd owned(fd);
    return internal_error("the GPU tier has no slabs");
  }

  void drop_frame(uint32_t window_frame) override {
    if (cuda::bind_context(api_, context_.get()).ok()) frames_.erase(window_frame);
  }
  void drop_slab(uint32_t) override {}

  Status map(uint32_t window_frame, char* at) override { return map_run(&window_frame, 1, at); }

  // The run's frames are mapped one by one and their access set once, over the whole run (Note
  // [Maps off the caller's thread] in ../memory.cpp); a single frame is a run of one.
  Status map_run(const uint32_t* window_frames, size_t count, char* at) override {
    std::vector<CUmemGenericAllocationHandle> handles;
    for (size_t i = 0; i < count; ++i) {
      uint32_t window_frame = window_frames[i];
      auto it = frames_.find(window_frame);
      if (it == frames_.end()) {
        return internal_error("the runtime mapped frame " + std::to_string(window_frame) + ", which it never granted");
      }
      handles.push_back(it->second.get());
    }
    MEMBAR_RETURN_IF_ERROR(cuda::bind_context(api_, context_.get()));
    CUdeviceptr base = reinterpret_cast<CUdeviceptr>(at);
    auto unmap_first = [&](size_t count) {
      for (size_t j = 0; j < count; ++j) api_->cuMemUnmap(base + j * kFrameBytes, kFrameBytes);
    };
    for (size_t i = 0; i < handles.size(); ++i) {
      CUresult mapped = api_->cuMemMap(base + i * kFrameBytes, kFrameBytes, 0, handles[i], 0);
      if (mapped != CUDA_SUCCESS) {
        unmap_first(i);
        return driver_status(api_, mapped, "cuMemMap of frame " + std::to_string(window_frames[i]));
      }
    }
    CUmemAccessDesc access = cuda::device_read_write_access(context_.device());
    CUresult set = api_->cuMemSetAccess(base, handles.size() * kFrameBytes, &access, 1);
    if (set != CUDA_SUCCESS) {
      unmap_first(handles.size());
      return driver_status(api_, set, handles.size() == 1 ? "cuMemSetAccess of frame " + std::to_string(window_frames[0])
                                                          : "cuMemSetAccess of a run of " + std::to_string(handles.size()) + " frames");
    }
    return Status::Ok();
  }

  Status unmap(char* at) override {
    MEMBAR_RETURN_IF_ERROR(cuda::bind_context(api_, context_.get()));
    return driver_status(api_, api_->cuMemUnmap(reinterpret_cast<CUdeviceptr>(at), kFrameBytes), "cuMemUnmap of a frame");
  }

 private:
  CudaMapper() = default;
  const DriverApi* api_ = nullptr;
  PrimaryContext context_;
  std::map<uint32_t, PhysicalAllocation> frames_;
};

}  // namespace

Result<std::unique_ptr<FrameMapper>> make_cuda_mapper(int device) { return CudaMapper::create(device); }

}  // namespace membar
