// The engine: page tables, quotas, slot allocation, transfers and eviction for every client of
// one node. Used by the daemon (one engine, many clients over IPC) and by the embedded runtime
// (one engine, one in-process client). Policy only: all memory and copies go through the
// DeviceBackend it is given. Thread-safe: every public method may be called from any thread;
// none blocks on transfers (completions arrive through callbacks / signal words) except wait and
// acquire_host, which say so.
//
// Answers to bad input (never a crash): NOT_FOUND for an unknown client or space;
// INVALID_ARGUMENT for a zero-length range, a page size that is not a power of two in
// [64 KiB, 2 MiB], unknown acquire flags or a ticket never issued; OUT_OF_RANGE for pages past
// the space's end or advance() past the schedule; ALREADY_EXISTS for a duplicate space name;
// FAILED_PRECONDITION for releasing a page that is not acquired, freeing a page that holds
// nothing (double free) or is acquired, offloading an acquired page, destroying a space with
// acquired pages, and mixing GPU and host acquisition of one page (a page is acquired on one
// side at a time). RESOURCE_EXHAUSTED names the client, the tier, its quota and the pool;
// UNAVAILABLE means the pool is momentarily empty because a closed client's frames are still
// finishing copies: retry. Every range is checked before anything moves; past the checks, a
// failed acquire pins nothing and maps nothing new (evictions it started still complete), while
// a failed prefetch or offload keeps the part of the range it already moved.
//
// See Note [Pages and frames] and Note [Eviction order] in engine.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "membar/engine/backend.h"
#include "membar/client.h"
#include "membar/status.h"
#include "membar/types.h"

namespace membar::runtimed {

struct EngineConfig {
  uint64_t default_gpu_quota_bytes = 0;   // 0: the whole GPU pool
  uint64_t default_host_quota_bytes = 0;  // 0: the whole host pool
  uint32_t prefetch_lookahead_steps = 2;  // schedule steps prefetched ahead of advance()
  uint32_t signal_words_per_client = 8;
};

// acquire's answer inside the engine: the client turns locations into pointers in its window.
struct AcquireResult {
  Ticket ticket = 0;
  std::vector<PageLocation> locations;   // one per page, GPU window frames
};

struct ClientConfig {
  std::string name;
  int32_t pid = 0;
  uint32_t uid = 0;
  uint64_t gpu_quota_bytes = 0;           // 0: the engine default
  uint64_t host_quota_bytes = 0;
};

// What a client needs to map: called by the engine whenever a frame enters one of the client's
// two windows (GPU-tier frames and host-tier frames have separate windows and numbering); the
// daemon sends the fd over the socket, the embedded runtime maps it directly. Window frame
// numbers are per client and tier, stable until frame_revoked. Called with no engine lock held.
// Events of one client are delivered in the order the engine produced them (a revoke of window
// frame w always reaches the client before a later grant that reuses w), one at a time. A
// callback must not call back into the engine for the same client. Empty functions are skipped;
// frame_granted's fd is closed by the engine when no callback takes it.
struct ClientEvents {
  std::function<void(uint32_t window_frame, Tier tier, int fd)> frame_granted;
  std::function<void(uint32_t window_frame, Tier tier)> frame_revoked;
  // The client's completed ticket advanced to `completed` (every ticket <= completed is done;
  // the signal word kSignalCompleted already holds it). May be called from the engine's
  // completion thread or from the thread of any engine call.
  std::function<void(Ticket completed)> tickets_completed;
};

// Signal word indices inside a client's signal block.
inline constexpr uint32_t kSignalCompleted = 0;  // highest ticket whose operations are done
inline constexpr uint32_t kSignalReleased = 1;   // highest release marker the client's GPU passed

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(std::unique_ptr<DeviceBackend> backend,
                                                const EngineConfig& config);
  virtual ~Engine() = default;

  virtual Result<ClientId> client_open(const ClientConfig& config, ClientEvents events) = 0;
  // Frees every page, frame and signal block of the client (disconnect, kill -9, shutdown).
  virtual Status client_close(ClientId client) = 0;
  virtual Result<int> client_signal_fd(ClientId client) = 0;
  // How many window frames the client may be granted in `tier` (its quota in frames, at most the
  // pool): window frame numbers are always below this, so a window of this many frames suffices.
  virtual Result<uint32_t> client_window_frames(ClientId client, Tier tier) = 0;

  virtual Result<SpaceId> create_space(ClientId client, const std::string& name, uint64_t page_bytes,
                                       uint32_t page_count) = 0;
  virtual Status destroy_space(ClientId client, SpaceId space) = 0;
  virtual Result<SpaceInfo> space_info(ClientId client, SpaceId space) = 0;
  virtual Result<AcquireResult> acquire(ClientId client, PageRange range, uint32_t flags) = 0;
  virtual Status release(ClientId client, PageRange range, bool dirty) = 0;
  // Stream-ordered release (Note [Stream-ordered release] in engine.cpp): like release, but the
  // client's GPU may still be using the pages until its stream writes `marker` (>= 1) into its
  // kSignalReleased word. Returns at once; copies out of or into the pages' GPU slots, and the
  // revocation of their frames, wait until the word is seen at or past `marker`.
  virtual Status release_after(ClientId client, PageRange range, bool dirty, uint64_t marker) = 0;
  virtual Result<Ticket> prefetch(ClientId client, PageRange range) = 0;
  virtual Result<Ticket> offload(ClientId client, PageRange range) = 0;
  virtual Status free_pages(ClientId client, PageRange range) = 0;
  // Host-tier pointers in the daemon's address space are no use to a client: the engine returns
  // window frames of host-tier frames granted to the client (frame_granted with Tier::kHost).
  // acquire_host blocks until the pages' host copies are complete (it is acquire_host_async +
  // wait); acquire_host_async returns at once with the ticket to wait for (what the daemon uses).
  virtual Result<std::vector<PageLocation>> acquire_host(ClientId client, PageRange range) = 0;
  virtual Result<AcquireResult> acquire_host_async(ClientId client, PageRange range) = 0;
  virtual Status release_host(ClientId client, PageRange range, bool dirty) = 0;
  virtual Status set_schedule(ClientId client, std::vector<ScheduleStep> steps) = 0;
  virtual Status advance(ClientId client, uint32_t step) = 0;
  virtual Result<std::vector<PageLocation>> locations(ClientId client, PageRange range) = 0;
  virtual Status add_stall_ns(ClientId client, uint64_t ns) = 0;

  // Blocks the calling thread until completed_ticket(client) >= ticket. Returns the error of a
  // failed transfer of that ticket, NOT_FOUND for an unknown client, UNAVAILABLE when the client
  // is closed while waiting. Does not count stall time (callers measure and add_stall_ns).
  virtual Status wait(ClientId client, Ticket ticket) = 0;
  // Non-blocking: the highest ticket whose operations (and all earlier tickets') are done.
  virtual Result<Ticket> completed_ticket(ClientId client) = 0;

  // `client` = 0: every client and space (admin view).
  virtual Result<RuntimeStats> stats(ClientId client) = 0;
  virtual DeviceBackend& backend() = 0;
};

}  // namespace membar::runtimed
