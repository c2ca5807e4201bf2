// The client's side of Note [Space layout] (engine/engine.cpp): an address reservation per space
// and tier, the frames and slabs the runtime granted, and which frame is mapped at which space
// position. The embedded client applies the engine's events here directly; the daemon client
// applies the same events as they arrive on its socket. Thread-safe (events may arrive on any
// thread); calls are short except the CUDA maps (tens of microseconds each).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>

#include "membar/client.h"
#include "membar/status.h"
#include "membar/types.h"

namespace membar {

// How frames of one tier are held and mapped in this process.
class FrameMapper {
 public:
  virtual ~FrameMapper() = default;
  // Address space for a space of `bytes` (a multiple of 2 MiB), nothing mapped.
  virtual Result<char*> reserve(uint64_t bytes) = 0;
  virtual void release(char* base, uint64_t bytes) = 0;
  // A frame that arrived with a descriptor of its own (takes `fd`, closed on every path).
  virtual Status adopt_frame(uint32_t window_frame, int fd) = 0;
  // A slab of `frames` frames (takes `fd`): window frames slab * slab_frames + i.
  virtual Status adopt_slab(uint32_t slab, uint32_t slab_frames, uint32_t frames, int fd) = 0;
  virtual void drop_frame(uint32_t window_frame) = 0;
  virtual void drop_slab(uint32_t slab) = 0;
  virtual Status map(uint32_t window_frame, char* at) = 0;
  virtual Status unmap(char* at) = 0;
};

// mmap of memfds: the host tier on both backends, and the host backend's "GPU" tier.
std::unique_ptr<FrameMapper> make_mmap_mapper();
#if defined(MEMBAR_WITH_CUDA)
// cuMemImportFromShareableHandle + cuMemMap in the device's primary context: the CUDA GPU tier.
Result<std::unique_ptr<FrameMapper>> make_cuda_mapper(int device);
#endif

class ClientMemory {
 public:
  ClientMemory(std::unique_ptr<FrameMapper> gpu, std::unique_ptr<FrameMapper> host, uint32_t host_slab_frames);
  ~ClientMemory();

  Status add_space(SpaceId space, uint64_t page_bytes, uint32_t page_count);
  Status remove_space(SpaceId space);
  Result<SpaceView> view(SpaceId space) const;

  // The runtime's events (Note [Two channels], ClientEvents in membar/engine/engine.h).
  Status gpu_frame_granted(uint32_t window_frame, int fd);
  Status gpu_frame_revoked(uint32_t window_frame);
  Status host_slab_granted(uint32_t slab, uint32_t frames, int fd);
  Status host_slab_revoked(uint32_t slab);
  Status mapped(Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame);
  Status unmapped(Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame);

  // What the runtime said that could not be applied (kept for the next call to report).
  void note_error(const Status& status);
  Status take_error();

 private:
  struct SpaceEntry {
    uint64_t page_bytes = 0;
    uint32_t page_count = 0;
    uint64_t reserved = 0;  // bytes of each reservation
    char* base[2] = {nullptr, nullptr};
  };
  using Position = std::pair<SpaceId, uint32_t>;
  Status unmap_locked(int tier, const Position& position);

  std::unique_ptr<FrameMapper> mappers_[2];
  uint32_t host_slab_frames_;
  mutable std::mutex mutex_;
  std::map<SpaceId, SpaceEntry> spaces_;
  std::map<Position, uint32_t> positions_[2];               // space position -> window frame
  std::map<uint32_t, std::set<Position>> frame_positions_[2];  // window frame -> positions
  std::mutex error_mutex_;
  Status error_;
};

}  // namespace membar
