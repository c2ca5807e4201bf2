// The engine: page tables, quotas, frame placement, transfers and eviction for every client of
// one node. Used by the daemon (one engine, many clients over IPC) and by the embedded runtime
// (one engine, one in-process client). Policy only: all memory and copies go through the
// DeviceBackend it is given. Thread-safe: every public method may be called from any thread;
// none blocks on transfers (completions arrive through callbacks / signal words) except wait,
// which says so, and the short waits for a client's own stream that acquire and destroy_space
// may make (Note [Remapping a position] in frames.cpp).
//
// Answers to bad input (never a crash): NOT_FOUND for an unknown client or space;
// INVALID_ARGUMENT for a zero-length range, a page size of 0 or over kMaxPageBytes, a space over
// kMaxSpaceBytes, unknown acquire flags or a ticket never issued; OUT_OF_RANGE for pages past the
// space's end or advance() past the schedule; ALREADY_EXISTS for a duplicate space name;
// FAILED_PRECONDITION for releasing a page that is not acquired, freeing a page that holds
// nothing (double free) or is acquired, offloading an acquired page, destroying a space with
// acquired pages, and mixing GPU and host acquisition of one space frame (a 2 MiB piece of a
// space is acquired on one side at a time); RESOURCE_EXHAUSTED names the client, the tier, its
// quota and the pool, and is also the answer to a client over one of its limits (spaces, page
// tables, schedule size); UNAVAILABLE means "retry": the pool is momentarily empty because frames
// are being cleared or pinned. Every range is checked before anything moves; past the checks, a
// failed acquire pins nothing (evictions it started still complete), while a failed prefetch or
// offload keeps the part of the range it already moved.
//
// See Note [Space layout] in engine.cpp, Note [Frames, slabs and renewal] in frames.cpp, Note
// [Eviction order] in eviction.cpp and Note [Stream-ordered release] in batches.cpp.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "membar/engine/backend.h"
#include "membar/engine/host_share.h"
#include "membar/status.h"
#include "membar/types.h"

namespace membar::runtimed {

// Acquire flags (the same bits as membar::AcquireFlags in membar/client.h).
inline constexpr uint32_t kEngineAcquireWrite = 1u << 0;
inline constexpr uint32_t kEngineAcquireZeroNew = 1u << 1;

// Note [Limits]
// What one client may make the engine hold, so that no client can exhaust the daemon's memory
// or stall it with long walks: the bounds are checked before anything is allocated, and the
// answer is RESOURCE_EXHAUSTED naming the limit.
struct EngineConfig {
  uint64_t default_gpu_quota_bytes = 0;   // 0: the whole GPU pool
  uint64_t default_host_quota_bytes = 0;  // 0: the whole host pool
  uint32_t prefetch_lookahead_steps = 2;  // schedule steps prefetched ahead of advance()
  uint32_t signal_words_per_client = 8;
  uint32_t max_spaces_per_client = 65536;
  // Space frames (2 MiB each) of all a client's spaces: ~100 bytes of page table each.
  uint64_t max_space_frames_per_client = 1ull << 24;
  // ... and of every client's spaces together: what the page tables may take of the daemon's own
  // memory (~1.3 GiB at the default), so that many clients cannot exhaust it between them.
  uint64_t max_space_frames_total = 1ull << 24;
  // (space frame, step) uses of a schedule, and of one step (the lookahead prefetch walks a few
  // steps' frames under the engine's lock: this bounds how long).
  uint64_t max_schedule_uses = 1ull << 26;
  uint64_t max_step_uses = 1ull << 20;
  // Client ids are first_client_id, + client_id_step, ...: a daemon with one engine per device
  // gives engine i of n the ids i + 1, i + 1 + n, ..., so an id names one client node-wide (its
  // channels, the admin view, the logs).
  ClientId first_client_id = 1;
  uint32_t client_id_step = 1;
  // Copies wait for each other and for clients' release markers on the device instead of the
  // engine holding them on the host (Note [Device-ordered copies] in engine/batches.cpp), where
  // the backend can. For an engine of one client (embedded in a trainer): a client's stream that
  // never reaches its marker would hold up every client's copies.
  bool order_on_device = false;
  // With order_on_device: a call's batches go to the backend from the engine's dispatcher thread
  // instead of the calling thread (Note [Hand-over on the dispatcher] in engine/batches.cpp;
  // the embedded client turns it on, MEMBAR_DEFER_SUBMIT=0 off: 256K sparse-offload 61.5 s against
  // 67.1 s on the H200, session 28). Off here: the engine of a daemon orders its copies on the host.
  bool submit_on_dispatcher = false;
  // Placing a space frame takes the GPU frame already mapped at its position when that frame's
  // occupant is among the first `displace_rank` frames of MIN's eviction order, not only when it
  // ties MIN's victim (0, the default): fewer map calls for some extra loads (Note [Eviction
  // order]; measured by bench/probes/maps_probe.py and tools/h200_session.sh displace). A rank at
  // least the number of candidates (UINT32_MAX: MEMBAR_DISPLACE_RANK=all) takes any occupant a
  // prefetch may evict, without scanning.
  uint32_t displace_rank = 0;
  // Where the engine says what an operator must know and no caller is there to hear (a frame or
  // slab lost because its renewal failed for good): membard logs it. Called with the engine's
  // lock held: it must not call back into the engine.
  std::function<void(const std::string& message)> log_error;
  // One host pool for the engines of a node (Note [One host pool for a node] in
  // engine/host_share.cpp): the backend's host pool is the whole node's; this engine backs
  // host_initial_slabs of its slabs at start-up and takes or gives capacity through the share.
  // Null: every slab of the backend's host pool is this engine's.
  std::shared_ptr<HostShare> host_share;
  uint64_t host_initial_slabs = 0;
};

// MEMBAR_DISPLACE_RANK's value: a count, or "all" (UINT32_MAX); anything else is 0 (off).
inline uint32_t parse_displace_rank(const char* text) {
  if (std::string(text) == "all") return UINT32_MAX;
  char* end = nullptr;
  unsigned long value = std::strtoul(text, &end, 10);
  return end != text && *end == '\0' && value <= UINT32_MAX ? uint32_t(value) : 0;
}

struct ClientConfig {
  std::string name;
  int32_t pid = 0;
  uint32_t uid = 0;
  uint64_t gpu_quota_bytes = 0;           // 0: the engine default
  uint64_t host_quota_bytes = 0;
};

// What a client needs to map its memory (Note [Space layout]). Window frame numbers are per
// client and tier: GPU frames below its GPU quota in frames; host frame w lies in the client's
// slab w / host_slab_frames at offset (w % host_slab_frames) * 2 MiB. Callbacks are called with
// no engine lock held, in the order the engine produced the events (a revoke of window frame w
// always reaches the client before a later grant that reuses w; an unmap of a position before a
// later map there), one at a time. A callback must not call back into the engine for the same
// client. Empty functions are skipped; descriptors are closed by the engine when no callback
// takes them (a callback that takes one closes it).
struct ClientEvents {
  std::function<void(uint32_t window_frame, int fd)> gpu_frame_granted;
  std::function<void(uint32_t window_frame)> gpu_frame_revoked;   // unmap it everywhere, drop it
  std::function<void(uint32_t slab, uint32_t frames, int fd)> host_slab_granted;
  std::function<void(uint32_t slab)> host_slab_revoked;
  // Map window frame `window_frame` of `tier` at the space's byte offset space_frame * 2 MiB.
  std::function<void(Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame)> frame_mapped;
  std::function<void(Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame)> frame_unmapped;
  // The client's completed ticket advanced to `completed` (every ticket <= completed is done;
  // the signal word kSignalCompleted already holds it). May be called from the engine's
  // completion thread or from the thread of any engine call.
  std::function<void(Ticket completed)> tickets_completed;
};

struct ClientGeometry {
  uint32_t gpu_quota_frames = 0;
  uint32_t host_quota_frames = 0;
  uint32_t host_slab_frames = 0;
};

// Signal word indices inside a client's signal block.
inline constexpr uint32_t kSignalCompleted = 0;  // highest ticket whose operations are done
inline constexpr uint32_t kSignalReleased = 1;   // highest release marker the client's GPU passed
// Note [Enqueued tickets] in batches.cpp: the highest ticket whose copies (and all earlier tickets')
// are enqueued on the backend, written by the engine on the host; and the same ticket written by the
// backend in stream order once those copies are done (a GPU may wait on it without depending on any
// host thread making progress).
inline constexpr uint32_t kSignalSubmitted = 2;
inline constexpr uint32_t kSignalEnqueuedDone = 3;

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(std::unique_ptr<DeviceBackend> backend,
                                                const EngineConfig& config);
  virtual ~Engine() = default;

  virtual Result<ClientId> client_open(const ClientConfig& config, ClientEvents events) = 0;
  // Frees every page, frame, slab and signal block of the client (disconnect, kill -9,
  // shutdown); they are renewed before anyone else gets them.
  virtual Status client_close(ClientId client) = 0;
  virtual Result<int> client_signal_fd(ClientId client) = 0;
  virtual Result<ClientGeometry> client_geometry(ClientId client) = 0;

  // Pages of any size (1 .. kMaxPageBytes bytes); the space is page_bytes * page_count bytes,
  // laid out contiguously (Note [Space layout]).
  virtual Result<SpaceId> create_space(ClientId client, const std::string& name, uint64_t page_bytes,
                                       uint32_t page_count) = 0;
  virtual Status destroy_space(ClientId client, SpaceId space) = 0;
  virtual Result<SpaceInfo> space_info(ClientId client, SpaceId space) = 0;
  // Makes the range GPU-resident, mapped at its space position and pinned; returns the ticket
  // whose completion means the contents are in place.
  virtual Result<Ticket> acquire(ClientId client, PageRange range, uint32_t flags) = 0;
  virtual Status release(ClientId client, PageRange range, bool dirty) = 0;
  // Stream-ordered release (Note [Stream-ordered release] in batches.cpp): like release, but the
  // client's GPU may still be using the pages until its stream writes `marker` (>= 1) into its
  // kSignalReleased word. Returns at once; copies out of or into the pages' GPU frames, and the
  // unmapping or revocation of those frames, wait until the word is seen at or past `marker`.
  virtual Status release_after(ClientId client, PageRange range, bool dirty, uint64_t marker) = 0;
  // Several ranges in one call and one ticket (the K and V pages of one access, say); with
  // `advance_step`, advance(step) first. A failure pins nothing.
  virtual Result<Ticket> acquire_ranges(ClientId client, const std::vector<PageRange>& ranges, uint32_t flags,
                                        std::optional<uint32_t> advance_step) = 0;
  // Several ranges released at once; with `marker`, in stream order (release_after). All ranges
  // are checked before any is released.
  virtual Status release_ranges(ClientId client, const std::vector<PageRange>& ranges, bool dirty,
                                std::optional<uint64_t> marker) = 0;
  // Copies the contents of pages into other pages of the same client (Note [Copied pages] in
  // engine/page_copies.cpp): pairs[2i] names source pages, pairs[2i + 1] as many destination pages
  // of a space with the same page size. Sources keep their residency and are read where their
  // newest contents are (pages without contents, or freed, read as zeros); each destination frame
  // is written where it lives (its GPU frame when resident, else its host frame). With
  // `after_marker`, the copies run only once the client's stream has passed that release marker
  // (the caller's kernels that read or wrote these pages before are done). The ticket completes
  // when the destination pages hold the copies.
  virtual Result<Ticket> copy_pages(ClientId client, const std::vector<PageRange>& pairs,
                                    std::optional<uint64_t> after_marker) = 0;
  virtual Result<Ticket> prefetch(ClientId client, PageRange range) = 0;
  virtual Result<Ticket> offload(ClientId client, PageRange range) = 0;
  virtual Status free_pages(ClientId client, PageRange range) = 0;
  // Makes the range host-resident, mapped at its host-side space position, and pinned there;
  // pages with no contents read as zeros. The ticket's completion means the data is there.
  virtual Result<Ticket> acquire_host(ClientId client, PageRange range) = 0;
  virtual Status release_host(ClientId client, PageRange range, bool dirty) = 0;
  virtual Status set_schedule(ClientId client, std::vector<ScheduleStep> steps) = 0;
  virtual Status advance(ClientId client, uint32_t step) = 0;
  virtual Status add_stall_ns(ClientId client, uint64_t ns) = 0;

  // Blocks the calling thread until completed_ticket(client) >= ticket. Returns the error of a
  // failed transfer of that ticket, NOT_FOUND for an unknown client, INVALID_ARGUMENT for a ticket
  // never issued, UNAVAILABLE when the client is closed while waiting. Does not count stall time
  // (callers measure and add_stall_ns).
  virtual Status wait(ClientId client, Ticket ticket) = 0;
  // Non-blocking: the highest ticket whose operations (and all earlier tickets') are done.
  virtual Result<Ticket> completed_ticket(ClientId client) = 0;
  // Blocks until every operation of `ticket` (and of all earlier tickets) has been enqueued on the
  // backend, or has completed; then the kSignalEnqueuedDone word reaches `ticket` in stream order
  // (Note [Enqueued tickets]). Errors as wait().
  virtual Status wait_submitted(ClientId client, Ticket ticket) = 0;

  // Channels count against the client's host quota and the host pool (Note [Channels]).
  virtual Status reserve_channel_bytes(ClientId client, uint64_t bytes) = 0;
  virtual Status release_channel_bytes(ClientId client, uint64_t bytes) = 0;

  // `client` = 0: every client (admin view). Spaces from index `first_space` (in (client, space
  // id) order), at most `max_spaces` of them. Kept incrementally: no walk over pages.
  virtual Result<RuntimeStats> stats(ClientId client, uint32_t first_space = 0,
                                     uint32_t max_spaces = UINT32_MAX) = 0;
  virtual DeviceBackend& backend() = 0;
};

}  // namespace membar::runtimed
