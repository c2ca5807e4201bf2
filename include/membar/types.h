// Plain value types shared by the client API, the engine and the wire protocol.
// No CUDA, Boost or libuv here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace membar {

// Frames are the unit of physical memory: 2 MiB, the CUDA VMM allocation granularity. A space's
// bytes are cut into frames of 2 MiB (its *space frames*); each lives in at most one GPU frame and
// one host frame at a time. Pages are the user's unit and may have any size: a page range names
// the space frames that cover its bytes.
inline constexpr uint64_t kFrameBytes = 2ull << 20;
// The largest page and the largest space (bytes): bounds, not preferences.
inline constexpr uint64_t kMaxPageBytes = 1ull << 30;
inline constexpr uint64_t kMaxSpaceBytes = 1ull << 44;

enum class Tier : uint8_t { kGpu = 0, kHost = 1 };

using ClientId = uint32_t;
using SpaceId = uint32_t;
using FrameIndex = uint32_t;   // index of a frame in its tier's pool
using Ticket = uint64_t;       // monotonically increasing per client; 0 = "nothing to wait for"

inline constexpr FrameIndex kNoFrame = 0xffffffffu;

struct PageRange {
  SpaceId space = 0;
  uint32_t first_page = 0;
  uint32_t page_count = 0;
};

// One step of an access schedule: the page groups a trainer will touch together, in order.
struct ScheduleStep {
  std::vector<PageRange> ranges;
};

// A space as stats report it: its shape, owner, and its bytes by residency (counted by space
// frames: a frame is GPU, host, both or none), dirty (the GPU copy is newer) and pinned.
struct SpaceInfo {
  SpaceId id = 0;
  std::string name;
  uint64_t page_bytes = 0;
  uint32_t page_count = 0;
  ClientId client = 0;
  uint64_t bytes_gpu = 0, bytes_host = 0, bytes_both = 0, bytes_none = 0;
  uint64_t bytes_dirty = 0, bytes_pinned = 0;
  uint64_t bytes_host_to_gpu = 0;  // copied in for this space
  uint64_t bytes_gpu_to_host = 0;  // written back for this space
};

// {current, peak, allocated, freed}, changed only through stat_* helpers (PyTorch's Stat).
struct Stat {
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocated = 0;
  int64_t freed = 0;
};
inline void stat_increase(Stat& s, int64_t n) {
  s.current += n;
  s.allocated += n;
  if (s.current > s.peak) s.peak = s.current;
}
inline void stat_decrease(Stat& s, int64_t n) {
  s.current -= n;
  s.freed += n;
}

struct ClientStats {
  ClientId client = 0;
  int32_t pid = 0;
  uint32_t uid = 0;
  std::string name;
  uint64_t gpu_quota_bytes = 0;
  uint64_t host_quota_bytes = 0;
  Stat gpu_frames;      // frames held by this client (in use or kept idle for it)
  Stat host_frames;
  uint32_t spaces = 0;
  uint64_t bytes_gpu = 0, bytes_host = 0, bytes_both = 0, bytes_none = 0;
  uint64_t bytes_host_to_gpu = 0;
  uint64_t bytes_gpu_to_host = 0;
  uint64_t prefetch_hits = 0;    // acquire found the frame already on the GPU (prefetched)
  uint64_t prefetch_misses = 0;  // acquire had to start a transfer
  uint64_t evictions = 0;
  uint64_t stall_ns = 0;         // time the client waited for pages to become ready
  // GPU frames mapped at / unmapped from a position of its spaces (Note [Remapping a position]:
  // streaming settles into frames already mapped where they serve, with no map calls).
  uint64_t gpu_maps = 0, gpu_unmaps = 0;
  // Calls that waited on the host for the client's own stream to pass a release marker before a
  // position could be remapped (Note [Remapping a position]), and the time they waited: host time
  // in which the trainer enqueued no work.
  uint64_t fence_waits = 0, fence_wait_ns = 0;
  // Where the client's calls spent their time in the runtime (the embedded engine: the trainer's
  // own thread; membard: the daemon's): waiting for the engine's lock, holding it (page tables,
  // eviction, copy planning), handing its copies to the backend (cudaMemcpyAsync and its events;
  // mostly inside the locked time, on the dispatcher's thread for batches held for a marker), and
  // delivering the calls' events (for an embedded CUDA client: its map calls).
  uint64_t call_lock_wait_ns = 0, call_locked_ns = 0, call_enqueue_ns = 0, call_deliver_ns = 0;
  uint64_t channel_bytes = 0;    // its channels (counted in its host quota)
};

struct TierStats {
  Tier tier = Tier::kGpu;
  uint64_t frames_total = 0;
  uint64_t frames_used = 0;       // held by clients
  uint64_t frames_free = 0;       // ready to hand out
  uint64_t frames_preparing = 0;  // being cleared or pinned before they can be handed out
  // The host tier: the NUMA node its memory is bound to (membard --host-numa-node; Note [Host pools
  // near their GPU]); -1 when the kernel places it, and always for the GPU tier.
  int32_t numa_node = -1;
  // Frames given up because their renewal failed for good (Note [Renewal when memory is short]
  // in engine/backend.cpp): out of the pool until the daemon restarts; normally 0. Not in
  // frames_used.
  uint64_t frames_lost = 0;
  // The host tier of a daemon serving several devices from one node host pool (Note [One host
  // pool for a node] in engine/host_share.cpp): frames this device does not hold but would get on
  // request, from capacity no device holds backed or slabs another device has free. Not in
  // frames_total; 0 with one device and for the GPU tier.
  uint64_t frames_on_request = 0;
};

struct RuntimeStats {
  std::string backend;           // "cuda" or "host"
  std::vector<TierStats> tiers;  // GPU then host
  std::vector<ClientStats> clients;
  // Spaces of the asking client (all clients for the admin view), from index `first_space` of
  // `spaces_total` in (client, space id) order: large answers come in pages.
  std::vector<SpaceInfo> spaces;
  uint32_t first_space = 0;
  uint32_t spaces_total = 0;
};

// One device's stats in a daemon that serves several (Note [Devices of one daemon] in
// membar/protocol/v2.h): its CUDA ordinal (a label on the host backend) and its engine's view.
struct DeviceRuntimeStats {
  int32_t device = 0;
  RuntimeStats stats;
};

}  // namespace membar
