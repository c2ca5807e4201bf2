// The client's side of Note [Space layout] (engine/engine.cpp): an address reservation per space
// and tier, the frames and slabs the runtime granted, and which frame is mapped at which space
// position. The embedded client applies the engine's events here directly; the daemon client
// applies the same events as they arrive on its socket. Thread-safe (events may arrive on any
// thread; C++17, for CUDA sources too); calls are short except the CUDA maps (tens of microseconds
// each), which run on a thread of their own with MEMBAR_ASYNC_MAPS=1 (Note [Maps off the caller's
// thread] in memory.cpp).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

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
  // Frames window_frames[i] at at + i * kFrameBytes, none of those addresses mapped (the CUDA
  // tier sets access once for the run). Maps frame by frame by default.
  virtual Status map_run(const uint32_t* window_frames, size_t count, char* at);
  virtual Status unmap(char* at) = 0;
};

// mmap of memfds: the host tier on both backends, and the host backend's "GPU" tier.
std::unique_ptr<FrameMapper> make_mmap_mapper();
#if defined(MEMBAR_WITH_CUDA)
// cuMemImportFromShareableHandle + cuMemMap in the device's primary context: the CUDA GPU tier.
Result<std::unique_ptr<FrameMapper>> make_cuda_mapper(int device);
#endif

// Whether ClientMemory applies events on a thread of its own: MEMBAR_ASYNC_MAPS=1 (default off).
bool async_maps_from_env();
// Whether a synchronous ClientMemory keeps events until a call settles and maps them in runs
// (Note [Maps in runs] in libclient/memory.cpp): MEMBAR_DEFER_MAPS=1 (default off).
bool deferred_maps_from_env();

class ClientMemory {
 public:
  // asynchronous: events applied on a mapping thread (Note [Maps off the caller's thread]);
  // deferred (synchronous only): events kept until a call settles, then applied with maps in runs
  // (Note [Maps in runs]); neither: each event applied as it is given.
  ClientMemory(std::unique_ptr<FrameMapper> gpu, std::unique_ptr<FrameMapper> host, uint32_t host_slab_frames,
               bool asynchronous = false, bool deferred = false);
  ~ClientMemory();

  // Waits until every event given so far is applied; then reports what could not be (take_error).
  Status settle();
  // Waits until the events that mapped the frames under `ranges` (either tier) are applied: what
  // a call that hands out those pages needs before it returns; then take_error.
  Status settle_ranges(const PageRange* ranges, size_t count);
  Status settle_ranges(const std::vector<PageRange>& ranges) { return settle_ranges(ranges.data(), ranges.size()); }
  MapCounters counters() const;

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

  struct Op {
    enum class Kind : uint8_t { kFrameGranted, kFrameRevoked, kSlabGranted, kSlabRevoked, kMapped, kUnmapped };
    Kind kind;
    int tier = 0;
    uint32_t window_frame = 0;  // or slab
    uint32_t frames = 0;
    int fd = -1;
    SpaceId space = 0;
    uint32_t space_frame = 0;
    uint64_t sequence = 0;
  };
  // Applies `op` now (synchronous) or queues it for the mapping thread.
  Status give(Op op);
  Status apply(const Op& op);
  Status apply_map_run(const Op* ops, size_t count);
  // apply_map_run, and after a failed run each map on its own; errors are noted (note_error).
  void apply_map_run_noting_errors(const Op* ops, size_t count);
  // Note [Maps in runs]: applies the events kept so far (deferred mode), under flush_mutex_.
  void flush_pending();
  // Applies ops in order, except that each stretch of maps and unmaps has its unmaps first and its
  // maps in position order, adjacent positions as one run; errors are noted. Adds what it mapped.
  void apply_in_runs(std::vector<Op>& ops, uint64_t* maps, uint64_t* runs);
  void run_mapper();
  void wait_applied(uint64_t sequence);
  void wait_all_applied();
  static uint64_t position_key(SpaceId space, uint32_t space_frame) { return (uint64_t(space) << 32) | space_frame; }
  Status apply_frame_granted(uint32_t window_frame, int fd);
  Status apply_frame_revoked(uint32_t window_frame);
  Status apply_slab_granted(uint32_t slab, uint32_t frames, int fd);
  Status apply_slab_revoked(uint32_t slab);
  Status apply_unmapped(int t, SpaceId space, uint32_t space_frame);

  std::unique_ptr<FrameMapper> mappers_[2];
  uint32_t host_slab_frames_;
  mutable std::mutex mutex_;
  std::map<SpaceId, SpaceEntry> spaces_;
  std::map<Position, uint32_t> positions_[2];               // space position -> window frame
  std::map<uint32_t, std::set<Position>> frame_positions_[2];  // window frame -> positions
  std::mutex error_mutex_;
  Status error_;

  // The mapping thread's queue (Note [Maps off the caller's thread]); queue_mutex_ guards all
  // of it and is never held while an event is applied.
  const bool asynchronous_;
  mutable std::mutex queue_mutex_;
  std::condition_variable queued_;   // the mapping thread waits for work
  std::condition_variable applied_;  // callers wait for applied_through_
  std::deque<Op> queue_;
  uint64_t given_ = 0;               // sequence of the last op given
  uint64_t applied_through_ = 0;     // every op up to this one is applied
  bool stopping_ = false;
  std::unordered_map<uint64_t, uint64_t> last_op_[2];     // position key -> sequence of its last map/unmap
  std::unordered_map<SpaceId, uint64_t> page_bytes_;      // for settle_ranges
  MapCounters counters_;                                  // under queue_mutex_
  std::thread mapper_;
  // Deferred mode (Note [Maps in runs]): events given and not yet applied (under queue_mutex_);
  // flush_mutex_ keeps two flushes from interleaving.
  const bool deferred_;
  std::vector<Op> pending_;
  std::mutex flush_mutex_;
};

}  // namespace membar
