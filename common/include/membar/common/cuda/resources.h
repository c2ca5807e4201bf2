// Move-only owners of every CUDA and OS resource behind frames, windows and signal blocks
// (TensorRT-LLM's PhysMemWrapper, ggml's pool_alloc): an early return can never leak a physical
// allocation, a VA reservation, a mapping, a host registration or a file descriptor.
// Each owner releases in its destructor; release errors are ignored there, because nothing
// useful can be done with them at that point (the driver is often already tearing down).
// Used by the daemon's CUDA backend and by the client's CUDA window.
#pragma once

#include <cuda.h>

#include "membar/common/fd.h"
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <utility>

#include "membar/common/cuda/driver_api.h"

namespace membar::cuda {

// File descriptors are owned by the one fd owner of common/.
using ScopedFd = membar::UniqueFd;

// One physical allocation (a frame) made by cuMemCreate or imported from an fd.
class PhysicalAllocation {
 public:
  PhysicalAllocation() = default;
  PhysicalAllocation(const DriverApi* api, CUmemGenericAllocationHandle handle) : api_(api), handle_(handle) {}
  PhysicalAllocation(PhysicalAllocation&& other) noexcept
      : api_(other.api_), handle_(std::exchange(other.handle_, 0)) {}
  PhysicalAllocation& operator=(PhysicalAllocation&& other) noexcept {
    if (this != &other) {
      reset();
      api_ = other.api_;
      handle_ = std::exchange(other.handle_, 0);
    }
    return *this;
  }
  ~PhysicalAllocation() { reset(); }
  CUmemGenericAllocationHandle get() const { return handle_; }
  bool valid() const { return handle_ != 0; }
  void reset() {
    if (handle_ != 0) api_->cuMemRelease(handle_);
    handle_ = 0;
  }

 private:
  const DriverApi* api_ = nullptr;
  CUmemGenericAllocationHandle handle_ = 0;
};

// A range of reserved device virtual addresses (cuMemAddressReserve).
class AddressReservation {
 public:
  AddressReservation() = default;
  AddressReservation(const DriverApi* api, CUdeviceptr base, uint64_t bytes) : api_(api), base_(base), bytes_(bytes) {}
  AddressReservation(AddressReservation&& other) noexcept
      : api_(other.api_), base_(std::exchange(other.base_, 0)), bytes_(std::exchange(other.bytes_, 0)) {}
  AddressReservation& operator=(AddressReservation&& other) noexcept {
    if (this != &other) {
      reset();
      api_ = other.api_;
      base_ = std::exchange(other.base_, 0);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~AddressReservation() { reset(); }
  CUdeviceptr base() const { return base_; }
  uint64_t bytes() const { return bytes_; }
  void reset() {
    if (base_ != 0) api_->cuMemAddressFree(base_, bytes_);
    base_ = 0;
    bytes_ = 0;
  }

 private:
  const DriverApi* api_ = nullptr;
  CUdeviceptr base_ = 0;
  uint64_t bytes_ = 0;
};

// A physical allocation mapped at an address inside a reservation (cuMemMap); unmapped on
// destruction. Must be destroyed before the reservation and before the allocation's last owner
// (declare it after both).
class DeviceMapping {
 public:
  DeviceMapping() = default;
  DeviceMapping(const DriverApi* api, CUdeviceptr address, uint64_t bytes) : api_(api), address_(address), bytes_(bytes) {}
  DeviceMapping(DeviceMapping&& other) noexcept
      : api_(other.api_), address_(std::exchange(other.address_, 0)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceMapping& operator=(DeviceMapping&& other) noexcept {
    if (this != &other) {
      reset();
      api_ = other.api_;
      address_ = std::exchange(other.address_, 0);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~DeviceMapping() { reset(); }
  CUdeviceptr address() const { return address_; }
  bool valid() const { return address_ != 0; }
  // Unmaps now and reports the driver's answer; on failure the mapping stays owned.
  CUresult unmap() {
    if (address_ == 0) return CUDA_SUCCESS;
    CUresult result = api_->cuMemUnmap(address_, bytes_);
    if (result == CUDA_SUCCESS) {
      address_ = 0;
      bytes_ = 0;
    }
    return result;
  }
  void reset() {
    if (address_ != 0) api_->cuMemUnmap(address_, bytes_);
    address_ = 0;
    bytes_ = 0;
  }

 private:
  const DriverApi* api_ = nullptr;
  CUdeviceptr address_ = 0;
  uint64_t bytes_ = 0;
};

// Host memory page-locked for the GPU (cuMemHostRegister); unregistered on destruction.
class HostRegistration {
 public:
  HostRegistration() = default;
  HostRegistration(const DriverApi* api, void* pointer) : api_(api), pointer_(pointer) {}
  HostRegistration(HostRegistration&& other) noexcept
      : api_(other.api_), pointer_(std::exchange(other.pointer_, nullptr)) {}
  HostRegistration& operator=(HostRegistration&& other) noexcept {
    if (this != &other) {
      reset();
      api_ = other.api_;
      pointer_ = std::exchange(other.pointer_, nullptr);
    }
    return *this;
  }
  ~HostRegistration() { reset(); }
  bool valid() const { return pointer_ != nullptr; }
  void reset() {
    if (pointer_ != nullptr) api_->cuMemHostUnregister(pointer_);
    pointer_ = nullptr;
  }

 private:
  const DriverApi* api_ = nullptr;
  void* pointer_ = nullptr;
};

// A range of this process's address space from mmap; munmap'ed on destruction.
class HostMapping {
 public:
  HostMapping() = default;
  HostMapping(void* pointer, uint64_t bytes) : pointer_(pointer), bytes_(bytes) {}
  HostMapping(HostMapping&& other) noexcept
      : pointer_(std::exchange(other.pointer_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  HostMapping& operator=(HostMapping&& other) noexcept {
    if (this != &other) {
      reset();
      pointer_ = std::exchange(other.pointer_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  ~HostMapping() { reset(); }
  void* get() const { return pointer_; }
  uint64_t bytes() const { return bytes_; }
  void reset() {
    if (pointer_ != nullptr) ::munmap(pointer_, bytes_);
    pointer_ = nullptr;
    bytes_ = 0;
  }

 private:
  void* pointer_ = nullptr;
  uint64_t bytes_ = 0;
};

// A retained primary context of one device; released on destruction.
class PrimaryContext {
 public:
  PrimaryContext() = default;
  PrimaryContext(const DriverApi* api, CUdevice device, CUcontext context)
      : api_(api), device_(device), context_(context) {}
  PrimaryContext(PrimaryContext&& other) noexcept
      : api_(other.api_), device_(other.device_), context_(std::exchange(other.context_, nullptr)) {}
  PrimaryContext& operator=(PrimaryContext&& other) noexcept {
    if (this != &other) {
      reset();
      api_ = other.api_;
      device_ = other.device_;
      context_ = std::exchange(other.context_, nullptr);
    }
    return *this;
  }
  ~PrimaryContext() { reset(); }
  CUcontext get() const { return context_; }
  CUdevice device() const { return device_; }
  void reset() {
    if (context_ != nullptr) api_->cuDevicePrimaryCtxRelease(device_);
    context_ = nullptr;
  }

 private:
  const DriverApi* api_ = nullptr;
  CUdevice device_ = 0;
  CUcontext context_ = nullptr;
};

// Retains device `ordinal`'s primary context (the one the CUDA runtime and PyTorch use) after
// checking the driver can start. Does not make it current.
inline Result<PrimaryContext> retain_primary_context(const DriverApi* api, int ordinal) {
  MEMBAR_RETURN_IF_ERROR(api->initialize());
  int count = 0;
  MEMBAR_RETURN_IF_ERROR(driver_status(api, api->cuDeviceGetCount(&count), "cuDeviceGetCount"));
  if (ordinal < 0 || ordinal >= count) {
    return invalid_argument("CUDA device " + std::to_string(ordinal) + " does not exist (this machine has " +
                            std::to_string(count) + ")");
  }
  CUdevice device = 0;
  MEMBAR_RETURN_IF_ERROR(driver_status(api, api->cuDeviceGet(&device, ordinal), "cuDeviceGet"));
  CUcontext context = nullptr;
  MEMBAR_RETURN_IF_ERROR(
      driver_status(api, api->cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain"));
  return PrimaryContext(api, device, context);
}

// Makes `context` current on the calling thread when it is not already.
inline Status bind_context(const DriverApi* api, CUcontext context) {
  CUcontext current = nullptr;
  MEMBAR_RETURN_IF_ERROR(driver_status(api, api->cuCtxGetCurrent(&current), "cuCtxGetCurrent"));
  if (current == context) return Status::Ok();
  return driver_status(api, api->cuCtxSetCurrent(context), "cuCtxSetCurrent");
}

// The access descriptor "device `device` may read and write".
inline CUmemAccessDesc device_read_write_access(CUdevice device) {
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

}  // namespace membar::cuda
