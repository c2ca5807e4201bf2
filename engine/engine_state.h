// The engine's bookkeeping types: pages, spaces, frames, batches of copies, clients. Internal to
// engine.cpp (and its tests' understanding); no CUDA, no locks of its own: the engine's mutex
// guards every field here. See Note [Pages and frames] in engine.cpp.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "membar/engine/backend.h"
#include "membar/engine/engine.h"
#include "membar/types.h"

namespace membar::runtimed {

inline constexpr uint64_t kNeverUsed = UINT64_MAX;  // next use of a page the schedule never names
inline constexpr uint64_t kNoBatch = 0;

inline int tier_index(Tier tier) { return tier == Tier::kGpu ? 0 : 1; }
inline const char* tier_name(Tier tier) { return tier == Tier::kGpu ? "GPU" : "host"; }

// Where a page lives inside the pool of one tier.
struct SlotRef {
  FrameIndex frame = kNoFrame;
  uint32_t slot = 0;
  bool valid() const { return frame != kNoFrame; }
};

// The key a GPU-resident, unpinned page is filed under for eviction: see Note [Eviction order].
struct EvictionKey {
  uint64_t next_use = kNeverUsed;  // first schedule step >= the current step that names the page
  uint64_t last_use = 0;           // the client's logical clock when the page was last touched
  SpaceId space = 0;
  uint32_t page = 0;
};
// Orders victims first: farthest next use, then least recently used.
struct EvictionOrder {
  bool operator()(const EvictionKey& a, const EvictionKey& b) const {
    if (a.next_use != b.next_use) return a.next_use > b.next_use;
    if (a.last_use != b.last_use) return a.last_use < b.last_use;
    if (a.space != b.space) return a.space < b.space;
    return a.page < b.page;
  }
};

struct Page {
  SlotRef gpu;                 // GPU slot, when GPU-resident
  SlotRef host;                // host slot, once one is assigned (kept while the copy is stale)
  bool host_valid = false;     // the host copy holds the newest contents
  bool dirty = false;          // the GPU copy holds contents the host copy lacks
  bool write_intent = false;   // acquired with kAcquireWrite: dirty on release
  bool prefetched = false;     // brought in by prefetch and not yet acquired
  bool in_eviction_set = false;
  uint32_t pins = 0;           // GPU pins (acquire)
  uint32_t host_pins = 0;      // host pins (acquire_host)
  EvictionKey key;             // valid while in_eviction_set

  uint8_t residency() const {
    return uint8_t((gpu.valid() ? kResidentGpu : 0) | (host_valid ? kResidentHost : 0));
  }
};

struct Space {
  SpaceInfo info;
  std::vector<Page> pages;
  // Schedule steps naming each page, ascending (empty when no schedule names it).
  std::vector<std::vector<uint32_t>> uses;
};

// Which page occupies a slot of a frame.
struct SlotOwner {
  SpaceId space = 0;  // 0: the slot is free
  uint32_t page = 0;
};

struct Frame {
  ClientId owner = 0;                // 0: in the pool (free, or draining its last copies)
  uint64_t page_bytes = 0;           // the slot size while owned
  uint32_t window_frame = kNoFrame;  // the owner's window frame number
  uint32_t used_slots = 0;
  std::vector<SlotOwner> slots;
  std::vector<uint64_t> slot_batch;  // last batch that touched each slot (may be finished)
  // GPU tier: the owner's release marker each slot waits for (Note [Stream-ordered release]);
  // 0 when none, or once the owner's stream was seen past it.
  std::vector<uint64_t> slot_fence;
  std::vector<uint64_t> pending_batches;  // unfinished batches touching this frame
};

struct TierPoolState {
  std::vector<Frame> frames;
  std::vector<FrameIndex> free_frames;  // unowned and quiescent
};

// A set of copies and zero fills that may run in any order among themselves, after the
// batches it depends on. Every batch belongs to one ticket of one client.
struct Batch {
  uint64_t id = 0;
  ClientId client = 0;
  Ticket ticket = 0;
  std::vector<CopyOp> copies;
  struct Zero {
    Tier tier;
    FrameIndex frame;
    uint64_t offset;
    uint64_t bytes;
  };
  std::vector<Zero> zeros;
  std::vector<std::pair<Tier, FrameIndex>> frames;  // distinct frames touched
  uint32_t unmet_dependencies = 0;
  std::vector<uint64_t> dependents;
  bool sealed = false;
  bool submitted = false;
  uint64_t fence = 0;   // the client's release marker the copies wait for (0: none)
  bool held = false;    // ready, but waiting for `fence`
  uint32_t outstanding_callbacks = 0;
  Status status;
  uint64_t bytes_host_to_gpu = 0;
  uint64_t bytes_gpu_to_host = 0;
};

struct PendingTicket {
  Ticket ticket = 0;
  uint32_t remaining_batches = 0;
  Status status;
};

struct ClientEvent {
  enum class Kind { kGranted, kRevoked, kCompleted } kind;
  uint32_t window_frame = 0;
  Tier tier = Tier::kGpu;
  int fd = -1;
  Ticket ticket = 0;
};

struct ClientState {
  ClientId id = 0;
  ClientConfig config;
  ClientEvents events;
  bool closed = false;
  uint32_t quota_frames[2] = {0, 0};
  std::set<uint32_t> free_windows[2];                       // window frame numbers not in use
  std::set<FrameIndex> frames[2];                            // owned frames per tier
  std::map<uint64_t, std::set<FrameIndex>> partial[2];      // owned frames with a free slot, by page size
  std::vector<FrameIndex> maybe_empty[2];                   // frames whose last page left

  std::map<SpaceId, Space> spaces;
  std::map<std::string, SpaceId> space_names;
  SpaceId next_space = 1;

  uint32_t signal_block = 0;
  volatile uint64_t* signal_words = nullptr;
  uint64_t released_seen = 0;           // highest release marker its streams were seen past
  std::vector<uint64_t> held_batches;   // batches waiting for a release marker, in order
  bool awaiting_fence = false;          // held batches, or emptied frames kept for a fence
  Ticket next_ticket = 1;
  Ticket completed = 0;
  std::deque<PendingTicket> pending_tickets;
  std::map<Ticket, Status> failed_tickets;

  std::vector<ScheduleStep> schedule;
  uint32_t current_step = 0;
  uint64_t clock = 0;
  std::map<uint64_t, std::set<EvictionKey, EvictionOrder>> eviction_sets;  // by page size

  ClientStats stats;

  std::deque<ClientEvent> events_queue;  // guarded by the engine mutex
  std::mutex delivery_mutex;             // one deliverer at a time, in order
};

}  // namespace membar::runtimed
