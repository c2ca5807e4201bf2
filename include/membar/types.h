// Plain value types shared by the client API, the engine and the wire protocol.
// No CUDA, Boost or libuv here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace membar {

// Frames are the unit of physical memory: 2 MiB, the CUDA VMM allocation granularity.
inline constexpr uint64_t kFrameBytes = 2ull << 20;
inline constexpr uint64_t kMinPageBytes = 64ull << 10;
inline constexpr uint64_t kMaxPageBytes = kFrameBytes;

enum class Tier : uint8_t { kGpu = 0, kHost = 1 };

using ClientId = uint32_t;
using SpaceId = uint32_t;
using FrameIndex = uint32_t;   // index of a frame in its tier's pool
using Ticket = uint64_t;       // monotonically increasing per client; 0 = "nothing to wait for"

inline constexpr FrameIndex kNoFrame = 0xffffffffu;

// Residency bits of a page (a page may be in both tiers: clean copy on host, working copy on GPU).
enum Residency : uint8_t { kResidentNone = 0, kResidentGpu = 1, kResidentHost = 2, kResidentBoth = 3 };

// Where a GPU-resident page lives in the client's window: window_base + frame * kFrameBytes +
// slot * page_bytes. `frame` is the client's own window frame number (not the pool's frame index:
// a client never learns the pool layout).
struct PageLocation {
  uint32_t window_frame = kNoFrame;
  uint32_t slot = 0;
};

struct PageRange {
  SpaceId space = 0;
  uint32_t first_page = 0;
  uint32_t page_count = 0;
};

// One step of an access schedule: the page groups a trainer will touch together, in order.
struct ScheduleStep {
  std::vector<PageRange> ranges;
};

struct SpaceInfo {
  SpaceId id = 0;
  std::string name;
  uint64_t page_bytes = 0;
  uint32_t page_count = 0;
  // Filled by stats(): the owner and the pages by residency, dirty (GPU copy newer than host)
  // and pinned (acquired on either tier).
  ClientId client = 0;
  uint64_t pages_gpu = 0, pages_host = 0, pages_both = 0, pages_none = 0;
  uint64_t pages_dirty = 0, pages_pinned = 0;
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
  std::string name;
  uint64_t gpu_quota_bytes = 0;
  uint64_t host_quota_bytes = 0;
  Stat gpu_frames;      // frames held by this client
  Stat host_frames;
  uint64_t pages_gpu = 0, pages_host = 0, pages_both = 0, pages_none = 0;
  uint64_t bytes_host_to_gpu = 0;
  uint64_t bytes_gpu_to_host = 0;
  uint64_t prefetch_hits = 0;    // acquire found the page already on the GPU (prefetched)
  uint64_t prefetch_misses = 0;  // acquire had to start a transfer
  uint64_t evictions = 0;
  uint64_t stall_ns = 0;         // time the client waited for pages to become ready
};

struct TierStats {
  Tier tier = Tier::kGpu;
  uint64_t frames_total = 0;
  uint64_t frames_used = 0;
  uint64_t frames_free = 0;
};

struct RuntimeStats {
  std::string backend;           // "cuda" or "host"
  std::vector<TierStats> tiers;  // GPU then host
  std::vector<ClientStats> clients;
  std::vector<SpaceInfo> spaces; // of the asking client (all clients for the admin view)
};

}  // namespace membar
