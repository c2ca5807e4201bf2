// The engine's bookkeeping types: space frames, spaces, physical frames and slabs, batches of
// copies, clients. Private to engine/; no CUDA, no locks of their own: the engine's mutex guards
// every field here. See Note [Space layout] in engine.cpp and Note [Frames, slabs and renewal]
// in frames.cpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
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

inline constexpr uint64_t kNeverUsed = UINT64_MAX;  // next use of a frame the schedule never names
inline constexpr uint64_t kNoBatch = 0;
inline constexpr uint32_t kNoSlab = 0xffffffffu;

inline int tier_index(Tier tier) { return tier == Tier::kGpu ? 0 : 1; }
inline const char* tier_name(Tier tier) { return tier == Tier::kGpu ? "GPU" : "host"; }

// The key a GPU-resident, unpinned space frame is filed under for eviction: see Note [Eviction
// order] in eviction.cpp.
struct EvictionKey {
  uint64_t next_use = kNeverUsed;  // first schedule step >= the current step that names it
  uint64_t last_use = 0;           // the client's logical clock when it was last touched
  SpaceId space = 0;
  uint32_t frame = 0;              // space frame
};
// Orders victims first: farthest next use, then least recently used.
struct EvictionOrder {
  bool operator()(const EvictionKey& a, const EvictionKey& b) const {
    if (a.next_use != b.next_use) return a.next_use > b.next_use;
    if (a.last_use != b.last_use) return a.last_use < b.last_use;
    if (a.space != b.space) return a.space < b.space;
    return a.frame < b.frame;
  }
};

// 2 MiB of a space's bytes (Note [Space layout]).
struct SpaceFrame {
  FrameIndex gpu = kNoFrame;   // the GPU frame holding it, when GPU-resident
  FrameIndex host = kNoFrame;  // its host frame, once one is assigned (kept while the copy is stale)
  // The GPU frame the client has mapped at this position (its mapping cache): may differ from
  // `gpu` (or be set while `gpu` is not) when the frame now holds something else.
  FrameIndex mapped_gpu = kNoFrame;
  bool host_valid = false;     // the host copy holds the newest contents
  bool dirty = false;          // the GPU copy holds contents the host copy lacks
  bool write_intent = false;   // acquired with kAcquireWrite: dirty on release
  bool prefetched = false;     // brought in by prefetch and not yet acquired
  bool in_eviction_set = false;
  uint32_t pins = 0;           // GPU pins (acquire)
  uint32_t host_pins = 0;      // host pins (acquire_host)
  // The client's release marker of the last stream-ordered release of this position: its
  // kernels may read this address until the client's stream passes it.
  uint64_t va_fence = 0;
  EvictionKey key;             // valid while in_eviction_set

  bool has_contents() const { return gpu != kNoFrame || host_valid; }
};

// Residency classes a space frame is counted in (stats are kept incrementally: Note [Counters]).
enum ResidencyClass : int { kClassNone = 0, kClassGpu = 1, kClassHost = 2, kClassBoth = 3 };

struct SpaceCounters {
  uint64_t bytes[4] = {0, 0, 0, 0};  // by ResidencyClass
  uint64_t dirty = 0;                // bytes
  uint64_t pinned = 0;               // bytes
  uint64_t bytes_host_to_gpu = 0;
  uint64_t bytes_gpu_to_host = 0;
};

struct Space {
  SpaceInfo info;
  uint64_t bytes = 0;                 // page_bytes * page_count
  std::vector<SpaceFrame> frames;     // ceil(bytes / 2 MiB)
  // Schedule steps naming each space frame, ascending (empty when no schedule names it).
  std::vector<std::vector<uint32_t>> uses;
  SpaceCounters counters;
  // Note [Freed pages] (engine.cpp): one bit per page freed since it last held contents, and per
  // space frame the number of its pages that are; both empty until the first free_pages.
  std::vector<uint64_t> freed;
  std::vector<uint32_t> freed_in_frame;
  bool page_freed(uint32_t p) const { return !freed.empty() && (freed[p / 64] >> (p % 64) & 1) != 0; }
  // Pages overlapping space frame g: [first, last].
  std::pair<uint32_t, uint32_t> pages_of_frame(uint32_t g) const {
    uint64_t start = uint64_t(g) * kFrameBytes;
    return {uint32_t(start / info.page_bytes), uint32_t((start + frame_bytes(g) - 1) / info.page_bytes)};
  }
  // The bytes of space frame g (the last one may be partial).
  uint64_t frame_bytes(uint32_t g) const {
    uint64_t start = uint64_t(g) * kFrameBytes;
    return bytes - start < kFrameBytes ? bytes - start : kFrameBytes;
  }
};

// One physical frame of a tier's pool.
struct Frame {
  ClientId owner = 0;                // 0: in the pool (free, or being renewed)
  uint32_t window_frame = kNoFrame;  // the owner's number for it
  SpaceId space = 0;                 // the space frame it holds (space 0: none, idle)
  uint32_t space_frame = 0;
  uint64_t last_batch = kNoBatch;    // last batch that touched it (may be finished)
  // GPU tier: the owner's release marker copies into or out of it wait for (Note
  // [Stream-ordered release]); 0 when none, or once the owner's stream was seen past it.
  uint64_t fence = 0;
  std::vector<uint64_t> pending_batches;  // unfinished batches touching this frame
  // GPU tier: the space positions where the owner has it mapped (its mapping cache).
  std::vector<std::pair<SpaceId, uint32_t>> mapped_at;
  bool renewing = false;             // GPU tier: being renewed (Note [Frames, slabs and renewal])
  bool renew_started = false;        // the backend has it (else it waits for its last copies)
  uint32_t slab = kNoSlab;           // host tier: its slab
};

// A host slab: host frames handed to one client at a time (Note [Frames, slabs and renewal]).
struct Slab {
  // kBroken: its renewal failed; it stays out of the pool. kUnbacked: no memory behind it (a
  // node's shared host pool, Note [One host pool for a node]); kReleasing: its memory is being
  // dropped for another device's engine.
  enum class State { kPreparing, kFree, kOwned, kBroken, kUnbacked, kReleasing } state = State::kPreparing;
  // Whether the slab's frames count in the pool (it has memory, or is getting some).
  bool backed() const { return state != State::kUnbacked && state != State::kReleasing; }
  bool renew_started = false;
  ClientId owner = 0;
  uint32_t client_slab = 0;  // the owner's number for it
  FrameIndex first_frame = 0;
  uint32_t frames = 0;
  uint32_t used_frames = 0;  // frames holding a space frame
};

struct TierPoolState {
  std::vector<Frame> frames;
  std::vector<FrameIndex> free_frames;  // GPU tier: unowned, renewed, quiescent
  uint64_t preparing = 0;               // GPU frames being renewed / host frames of preparing slabs
};

// A set of copies and zero fills that may run in any order among themselves, after the
// batches it depends on. Every batch belongs to one ticket of one client (0: untracked).
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
  // Note [Device-ordered copies]: dependencies not yet handed to the backend, and the dependents
  // that count this batch among theirs.
  uint32_t unsubmitted_dependencies = 0;
  std::vector<uint64_t> submission_dependents;
  bool sealed = false;
  bool submitted = false;
  uint64_t fence = 0;   // the client's release marker the copies wait for (0: none)
  bool held = false;    // ready, but waiting for `fence`
  uint32_t outstanding_callbacks = 0;
  Status status;
  // Bytes each way, per space (for stats when the batch completes).
  std::vector<std::pair<SpaceId, int64_t>> to_gpu, to_host;
};

struct PendingTicket {
  Ticket ticket = 0;
  uint32_t remaining_batches = 0;
  Status status;
  uint32_t unsubmitted_batches = 0;   // batches not yet handed to the backend (Note [Enqueued tickets])
};

// What the engine tells a client, queued under the engine mutex and delivered in order without
// it (Note [Event delivery] in batches.cpp).
struct ClientEvent {
  enum class Kind { kFrameGranted, kSlabGranted, kFrameRevoked, kSlabRevoked, kMapped, kUnmapped, kCompleted } kind;
  Tier tier = Tier::kGpu;
  uint32_t window_frame = 0;  // or the client's slab number
  uint32_t frames = 0;        // slab grants
  int fd = -1;
  SpaceId space = 0;
  uint32_t space_frame = 0;
  Ticket ticket = 0;
};

struct ClientState {
  ClientId id = 0;
  ClientConfig config;
  ClientEvents events;
  // Set under the engine mutex; read without it by a deliverer between events (Note [Event delivery]).
  std::atomic<bool> closed{false};
  uint32_t quota_frames[2] = {0, 0};

  // GPU tier: frames held (in use or idle), idle ones, and free window numbers.
  std::set<FrameIndex> gpu_frames;
  std::set<FrameIndex> idle_gpu_frames;
  std::set<uint32_t> free_gpu_windows;
  // Host tier: slabs held (by the client's slab number), and their idle frames.
  std::map<uint32_t, uint32_t> slabs;          // client slab number -> pool slab index
  std::set<FrameIndex> idle_host_frames;
  uint32_t next_client_slab = 0;
  std::set<uint32_t> free_client_slabs;
  uint64_t host_frames_used = 0;               // host frames holding a space frame
  uint64_t channel_frames = 0;                 // host quota taken by channels

  std::map<SpaceId, std::unique_ptr<Space>> spaces;
  std::map<std::string, SpaceId> space_names;
  SpaceId next_space = 1;
  uint64_t space_frames_total = 0;             // of all its spaces (page-table bound)

  uint32_t signal_block = 0;
  volatile uint64_t* signal_words = nullptr;
  uint64_t released_seen = 0;           // highest release marker its streams were seen past
  std::vector<uint64_t> held_batches;   // batches waiting for a release marker, in order
  bool awaiting_fence = false;          // held batches, or frames kept for a fence
  Ticket next_ticket = 1;
  Ticket completed = 0;
  Ticket submitted = 0;   // every ticket <= submitted is enqueued (Note [Enqueued tickets])
  Status signal_error;    // the backend could not enqueue a kSignalEnqueuedDone write
  bool enqueued_signal = false;   // the client waits on kSignalEnqueuedDone (set by wait_submitted)
  std::deque<PendingTicket> pending_tickets;
  std::map<Ticket, Status> failed_tickets;

  std::vector<ScheduleStep> schedule;
  // schedule_uses[s]: the space frames named by steps [0, s), counted per range (s = 0..steps):
  // what advance() would re-key walking from one step to another (Note [Eviction order]).
  std::vector<uint64_t> schedule_uses;
  uint32_t current_step = 0;
  uint64_t clock = 0;
  std::set<EvictionKey, EvictionOrder> eviction_set;

  ClientStats stats;
  // Time delivering its calls' events (outside the engine lock; copied into stats.call_deliver_ns).
  std::atomic<uint64_t> deliver_ns{0};

  std::deque<ClientEvent> events_queue;  // guarded by the engine mutex
  std::mutex delivery_mutex;             // one deliverer at a time, in order
};

}  // namespace membar::runtimed
