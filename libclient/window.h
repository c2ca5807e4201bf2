// A client's view of its frames: a reserved range of virtual addresses into which frames are
// mapped on demand, one 2 MiB frame per slot (window_frame). Two implementations:
//   - host (window_host.cpp): mmap(PROT_NONE) reservation, frames mmap'ed MAP_FIXED|MAP_SHARED
//     from their memfd;
//   - CUDA (cuda/window_cuda.cpp): cuMemAddressReserve, cuMemImportFromShareableHandle (fd
//     imported once per frame), cuMemMap + cuMemSetAccess; unmap on revoke.
// Used by the embedded client and the daemon client alike. Not thread-safe: the owning client
// serialises calls.
#pragma once

#include <cstdint>
#include <memory>

#include "membar/status.h"
#include "membar/types.h"

namespace membar {

class Window {
 public:
  virtual ~Window() = default;
  // Maps the frame behind `fd` at base() + window_frame * kFrameBytes. Takes ownership of fd
  // (closes it, on success and on error). Blocks (a few tens of microseconds on CUDA).
  virtual Status map_frame(uint32_t window_frame, int fd) = 0;
  virtual Status unmap_frame(uint32_t window_frame) = 0;
  virtual bool is_mapped(uint32_t window_frame) const = 0;
  virtual void* base() const = 0;
  virtual uint64_t bytes() const = 0;
};

// Reserves max_frames * kFrameBytes of address space.
Result<std::unique_ptr<Window>> make_host_window(uint32_t max_frames);
#if defined(MEMBAR_WITH_CUDA)
Result<std::unique_ptr<Window>> make_cuda_window(uint32_t max_frames, int device);
#endif

}  // namespace membar
