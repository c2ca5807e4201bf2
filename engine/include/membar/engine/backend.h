// The mechanism seam of the engine: physical frames and copies between tiers. Policy (page
// tables, quotas, eviction) lives in the engine and knows nothing about CUDA; it talks to one
// DeviceBackend. Two implementations:
//   - HostBackend (host/host_backend.cpp): "GPU" frames and host slabs are both memfd shared
//     memory; copies run on worker threads. Lets the whole stack run and be tested on a machine
//     with no GPU.
//   - CudaVmmBackend (cuda/cuda_backend.cpp): GPU frames from cuMemCreate (exportable as POSIX
//     fds), host slabs of pinned memfd memory; copies on the daemon's own copy streams.
//
// Pools (Note [Frames, slabs and renewal] in engine/frames.cpp): the GPU tier is frames of 2 MiB,
// each its own allocation; the host tier is slabs of host_slab_frames() frames, one memfd each,
// handed to one client at a time. Before a GPU frame or a slab is handed to anyone it is
// *renewed*: given fresh zeroed memory that no earlier holder of a descriptor can reach.
// Descriptors are not kept per frame: a GPU frame is exported when granted, a slab's memfd lives
// only while the slab is prepared or held.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "membar/status.h"
#include "membar/types.h"

namespace membar::runtimed {

struct BackendConfig {
  uint64_t gpu_pool_bytes = 256ull << 20;
  uint64_t host_pool_bytes = 1ull << 30;
  int device = 0;
  // 0: chosen from the host pool size (host_slab_frames_for).
  uint32_t host_slab_frames = 0;
  // NUMA node of the host pool (Note [Host pools near their GPU] in engine/numa.cpp): a node
  // number, numa::kNearestDevice (the node nearest the GPU on CUDA machines with several nodes)
  // or numa::kNoPlacement.
  int host_numa_node = -2;
  // Fault injection for tests: creating the Nth GPU frame at start-up (1-based) fails with
  // RESOURCE_EXHAUSTED. 0 = never.
  uint64_t fail_frame_create_after = 0;
  // How long a renewal that finds memory short keeps trying (Note [Renewal when memory is short]
  // in engine/backend.cpp) before the frame or slab is given up as lost.
  uint32_t renewal_patience_ms = 120000;
  // Fault injection for tests: the first N attempts at renewing a GPU frame fail with
  // RESOURCE_EXHAUSTED, as when a client that was killed still holds its old frames. 0 = never.
  uint64_t fail_renewal_attempts = 0;
  // CUDA: a batch's copies of one direction go to the driver in one cudaMemcpyBatchAsync call
  // (Note [Copies handed over in one call] in engine/cuda/cuda_backend.cpp); false: one
  // cudaMemcpyAsync per copy. The environment's MEMBAR_BATCH_COPIES=0 turns it off.
  bool batch_copies = true;
  // CUDA: a batch's completion is a 64-bit word the copy stream writes in order
  // (cuStreamWriteValue64) and a completion thread reads from host memory, instead of a CUDA event
  // it waits for (Note [Completion words] in engine/cuda/cuda_backend.cpp). Needs 64-bit stream
  // memory operations (events otherwise). The environment's MEMBAR_COPY_EVENTS=1 turns it off.
  bool completion_words = true;
};

// Runs `attempt` (one renewal) until it succeeds, fails with anything but RESOURCE_EXHAUSTED,
// `patience_ms` have passed, or `give_up()` (shutdown) says so; waits between tries, 5 ms at
// first, doubling up to 500 ms. Note [Renewal when memory is short] in engine/backend.cpp.
Status renew_patiently(const std::function<Status()>& attempt, uint32_t patience_ms,
                       const std::function<bool()>& give_up);

// BackendConfig::fail_renewal_attempts: RESOURCE_EXHAUSTED while `left` (set from it) is above 0,
// counting it down; OK once it is spent. Thread-safe.
Status injected_renewal_failure(std::atomic<int64_t>& left);

// Frames per host slab for a pool of `host_pool_bytes`: the smallest power of two that keeps
// the pool at or under 256 slabs, between 1 frame (2 MiB) and 2048 frames (4 GiB). A 100 GiB pool
// has 200 slabs of 512 MiB; 1 TiB, 256 of 4 GiB.
uint32_t host_slab_frames_for(uint64_t host_pool_bytes);

// One contiguous copy between two frames (offsets within the frames).
struct CopyOp {
  Tier src_tier = Tier::kHost;
  FrameIndex src_frame = 0;
  uint64_t src_offset = 0;
  Tier dst_tier = Tier::kGpu;
  FrameIndex dst_frame = 0;
  uint64_t dst_offset = 0;
  uint64_t bytes = 0;
};

// What a batch's operations wait for on the device before they run (Note [Device-ordered copies]
// in engine/batches.cpp). Default: nothing (the engine orders them by completion on the host).
struct DeviceOrder {
  // After every operation already enqueued on the backend (on CUDA: the streams this batch uses
  // wait for the other copy stream's work so far; each stream runs its own in order).
  bool after_enqueued = false;
  // Until word `wait_index` of signal block `wait_block` is >= wait_value (0: no wait): a client
  // stream's release marker (cuStreamWaitValue64 on CUDA; a backend worker polls on the host).
  uint32_t wait_block = 0;
  uint32_t wait_index = 0;
  uint64_t wait_value = 0;
};

// Counters of what a backend actually issued (for stats and tests of batching).
struct BackendCounters {
  uint64_t copy_ops = 0;         // CopyOps received
  uint64_t transfers = 0;        // copies issued after merging adjacent ops
  uint64_t bytes_copied = 0;
  uint64_t zero_fills = 0;
  uint64_t renewals = 0;         // GPU frames and host slabs renewed
};

// Threading: every method may be called from any thread. Batches may run concurrently and
// complete in any order: the engine orders dependent copies itself (it never enqueues a copy
// that touches a frame another pending batch touches, unless the batch's DeviceOrder says
// after_enqueued). `done` callbacks are never called from
// inside enqueue_* / renew, may run concurrently on several backend threads, and must not block.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  virtual std::string name() const = 0;        // "host" or "cuda"
  virtual uint64_t frame_count(Tier tier) const = 0;
  // Host frames per slab; slab s holds host frames [s * host_slab_frames(), + host_slab_frames()).
  virtual uint32_t host_slab_frames() const = 0;
  uint64_t host_slab_count() const { return frame_count(Tier::kHost) / host_slab_frames(); }

  // A new file descriptor for a GPU frame (the caller owns and closes it): the client maps it
  // (mmap on the host backend, cuMemImportFromShareableHandle + cuMemMap on CUDA). Non-blocking.
  virtual Result<int> export_gpu_frame(FrameIndex frame) = 0;
  // A new file descriptor for a prepared host slab (mmap-able: memfd), the caller closes it.
  virtual Result<int> export_host_slab(uint32_t slab) = 0;
  // Gives a GPU frame (tier kGpu, index = frame) or a host slab (tier kHost, index = slab) fresh
  // zeroed memory, unreachable through any descriptor exported before; calls `done` exactly once
  // from a backend thread. Host slabs start unprepared: each is renewed once before first use.
  // Returns an error (and never calls `done`) if the work cannot be queued.
  virtual Status renew(Tier tier, uint32_t index, std::function<void(Status)> done) = 0;
  // Drops a prepared host slab's memory (unpinned, its memfd closed; a descriptor exported before
  // reaches only the old memory) and leaves its place unbacked until a later renew; calls `done`
  // exactly once from a backend thread (Note [One host pool for a node] in engine/host_share.cpp).
  virtual Status release_host_slab(uint32_t slab, std::function<void(Status)> done) = 0;
  // The daemon's own pointer to a frame (host pointer, or device pointer in the daemon's context).
  virtual void* frame_pointer(Tier tier, FrameIndex frame) = 0;

  // Enqueues a batch of copies (adjacent ops may be merged into larger transfers) and calls
  // `done` exactly once, from a backend thread, when all have finished (or with the error that
  // stopped them). Returns an error (and never calls `done`) if the batch cannot be enqueued.
  // `order`: what the batch waits for on the device first (only where orders_on_device()).
  virtual Status enqueue_copies(std::vector<CopyOp> ops, std::function<void(Status)> done,
                                const DeviceOrder& order = {}) = 0;
  // Fills byte ranges with zeros; same completion contract.
  virtual Status enqueue_zero(Tier tier, FrameIndex frame, uint64_t offset, uint64_t bytes,
                              std::function<void(Status)> done, const DeviceOrder& order = {}) = 0;
  // Whether enqueue_* honour a DeviceOrder (Note [Device-ordered copies]).
  virtual bool orders_on_device() const { return false; }
  // Blocks until every enqueued operation has completed (shutdown, tests).
  virtual void drain() = 0;

  // Signal blocks: small arrays of 64-bit words readable by the CPU and the GPU of the daemon
  // and of one client (each client gets its own block, so no client sees another's). The
  // backend writes them in stream order (cuStreamWriteValue64 on CUDA, the copy thread on the
  // host backend); a client's CUDA stream can wait on them (cuStreamWaitValue64) and write them
  // (cuStreamWriteValue64) to say "the GPU is done with these pages".
  virtual Result<uint32_t> create_signal_block(uint32_t words) = 0;
  virtual Status destroy_signal_block(uint32_t block) = 0;
  virtual Result<int> export_signal_block(uint32_t block) = 0;        // new fd, caller closes
  virtual volatile uint64_t* signal_words(uint32_t block) = 0;        // daemon's CPU view
  // Sets word `index` of `block` to `value` once every operation enqueued before this call has
  // completed.
  virtual Status enqueue_signal(uint32_t block, uint32_t index, uint64_t value) = 0;

  virtual BackendCounters counters() const { return {}; }

  // The NUMA node the host pool's pages are placed on, or -1 (placement left to the kernel);
  // host_numa_note() says why there is none when one was asked for.
  virtual int host_numa_node() const { return -1; }
  virtual std::string host_numa_note() const { return {}; }
};

// Creates the GPU frames up front (host slabs are prepared by the engine's renewals).
Result<std::unique_ptr<DeviceBackend>> make_host_backend(const BackendConfig& config);
#if defined(MEMBAR_WITH_CUDA)
Result<std::unique_ptr<DeviceBackend>> make_cuda_backend(const BackendConfig& config);
#endif

}  // namespace membar::runtimed
