// The CUDA window: a client's reserved range of device virtual addresses into which the
// daemon's GPU frames are mapped on demand (see ../window.h).
//
// Each grant brings a new fd (cuMemExportToShareableHandle in the daemon, SCM_RIGHTS on the
// socket); it is imported once (cuMemImportFromShareableHandle), the fd closed, and the
// allocation mapped with cuMemMap + cuMemSetAccess (~29 us measured). A revoke unmaps and
// releases the imported handle (~18 us), after which the daemon may give the frame to anyone.
// The window retains the device's primary context (the one PyTorch uses), so pointers into
// it are usable by the trainer's kernels.
#include <cuda.h>

#include <memory>
#include <string>
#include <vector>

#include "../window.h"
#include "membar/common/cuda/driver_api.h"
#include "membar/common/cuda/resources.h"

namespace membar {
namespace {

using cuda::AddressReservation;
using cuda::DeviceMapping;
using cuda::DriverApi;
using cuda::driver_status;
using cuda::PhysicalAllocation;
using cuda::PrimaryContext;
using cuda::ScopedFd;

// One mapped window slot; the mapping is declared last so it is undone first.
struct MappedFrame {
  PhysicalAllocation allocation;
  DeviceMapping mapping;
};

class CudaWindow final : public Window {
 public:
  static Result<std::unique_ptr<Window>> create(uint32_t max_frames, int device);

  ~CudaWindow() override {
    // Mappings must go before the reservation: bind the context and drop frames first.
    (void)cuda::bind_context(api_, context_.get());
    frames_.clear();
  }

  Status map_frame(uint32_t window_frame, int fd) override;
  Status unmap_frame(uint32_t window_frame) override;
  bool is_mapped(uint32_t window_frame) const override {
    return window_frame < frames_.size() && frames_[window_frame] != nullptr;
  }
  void* base() const override { return reinterpret_cast<void*>(reservation_.base()); }
  uint64_t bytes() const override { return reservation_.bytes(); }

 private:
  CudaWindow() = default;

  const DriverApi* api_ = nullptr;
  PrimaryContext context_;
  AddressReservation reservation_;
  std::vector<std::unique_ptr<MappedFrame>> frames_;  // one per window frame; null: unmapped
};

Result<std::unique_ptr<Window>> CudaWindow::create(uint32_t max_frames, int device) {
  if (max_frames == 0) return invalid_argument("a CUDA window needs at least one frame");
  std::unique_ptr<CudaWindow> window(new CudaWindow());
  MEMBAR_ASSIGN_OR_RETURN(window->api_, DriverApi::get());
  MEMBAR_ASSIGN_OR_RETURN(window->context_, cuda::retain_primary_context(window->api_, device));
  MEMBAR_RETURN_IF_ERROR(cuda::bind_context(window->api_, window->context_.get()));
  uint64_t bytes = static_cast<uint64_t>(max_frames) * kFrameBytes;
  CUdeviceptr base = 0;
  MEMBAR_RETURN_IF_ERROR(driver_status(window->api_, window->api_->cuMemAddressReserve(&base, bytes, kFrameBytes, 0, 0),
                                       "cuMemAddressReserve of a " + std::to_string(bytes >> 20) + " MiB window"));
  window->reservation_ = AddressReservation(window->api_, base, bytes);
  window->frames_.resize(max_frames);
  return std::unique_ptr<Window>(std::move(window));
}

Status CudaWindow::map_frame(uint32_t window_frame, int fd) {
  ScopedFd owned(fd);  // closed on every path: the import keeps its own reference
  if (fd < 0) return invalid_argument("map_frame got no file descriptor (" + std::to_string(fd) + ")");
  if (window_frame >= frames_.size()) {
    return out_of_range("window frame " + std::to_string(window_frame) + " is past the window's " +
                        std::to_string(frames_.size()) + " frames");
  }
  if (frames_[window_frame] != nullptr) {
    return already_exists("window frame " + std::to_string(window_frame) + " is already mapped");
  }
  MEMBAR_RETURN_IF_ERROR(cuda::bind_context(api_, context_.get()));
  auto frame = std::make_unique<MappedFrame>();
  CUmemGenericAllocationHandle handle = 0;
  CUresult imported = api_->cuMemImportFromShareableHandle(
      &handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (imported != CUDA_SUCCESS) {
    return driver_status(api_, imported,
                         "cuMemImportFromShareableHandle of window frame " + std::to_string(window_frame) +
                             " (is the fd a CUDA frame from the daemon?)");
  }
  frame->allocation = PhysicalAllocation(api_, handle);
  CUdeviceptr address = reservation_.base() + static_cast<CUdeviceptr>(window_frame) * kFrameBytes;
  MEMBAR_RETURN_IF_ERROR(driver_status(api_, api_->cuMemMap(address, kFrameBytes, 0, handle, 0),
                                       "cuMemMap of window frame " + std::to_string(window_frame)));
  frame->mapping = DeviceMapping(api_, address, kFrameBytes);
  CUmemAccessDesc access = cuda::device_read_write_access(context_.device());
  MEMBAR_RETURN_IF_ERROR(driver_status(api_, api_->cuMemSetAccess(address, kFrameBytes, &access, 1),
                                       "cuMemSetAccess of window frame " + std::to_string(window_frame)));
  frames_[window_frame] = std::move(frame);
  return Status::Ok();
}

Status CudaWindow::unmap_frame(uint32_t window_frame) {
  if (window_frame >= frames_.size()) {
    return out_of_range("window frame " + std::to_string(window_frame) + " is past the window's " +
                        std::to_string(frames_.size()) + " frames");
  }
  if (frames_[window_frame] == nullptr) {
    return failed_precondition("window frame " + std::to_string(window_frame) + " is not mapped");
  }
  MEMBAR_RETURN_IF_ERROR(cuda::bind_context(api_, context_.get()));
  // Unmap explicitly to report an error; the destructor would ignore it.
  MEMBAR_RETURN_IF_ERROR(driver_status(api_, frames_[window_frame]->mapping.unmap(),
                                       "cuMemUnmap of window frame " + std::to_string(window_frame)));
  frames_[window_frame].reset();  // releases the imported handle
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Window>> make_cuda_window(uint32_t max_frames, int device) {
  return CudaWindow::create(max_frames, device);
}

}  // namespace membar
