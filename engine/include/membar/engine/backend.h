// The mechanism seam of the daemon: physical frames and copies between tiers. Policy (page
// tables, quotas, eviction) lives in the engine and knows nothing about CUDA; it talks to one
// DeviceBackend. Two implementations:
//   - HostBackend (host_backend.cpp): "GPU" and host frames are both memfd shared memory; copies
//     run on worker threads. Lets the whole stack run and be tested on a machine with no GPU.
//   - CudaVmmBackend (cuda/cuda_backend.cpp): GPU frames from cuMemCreate (exportable as POSIX
//     fds), host frames pinned; copies on the daemon's own copy streams.
// Frames are created once, at start-up (cuMemCreate costs ~390 us each).
#pragma once

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
  // Fault injection for tests: creating the Nth frame (1-based, counting both tiers) fails with
  // RESOURCE_EXHAUSTED. 0 = never.
  uint64_t fail_frame_create_after = 0;
};

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

// Counters of what a backend actually issued (for stats and tests of batching).
struct BackendCounters {
  uint64_t copy_ops = 0;         // CopyOps received
  uint64_t transfers = 0;        // copies issued after merging adjacent ops
  uint64_t bytes_copied = 0;
  uint64_t zero_fills = 0;
};

// Threading: every method may be called from any thread. Batches may run concurrently and
// complete in any order: the engine orders dependent copies itself (it never enqueues a copy
// that touches a slot another pending batch touches). `done` callbacks are never called from
// inside enqueue_*, may run concurrently on several backend threads, and must not block.
// Host-tier frames export fds that mmap() can map (memfd or equivalent) on every backend.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  virtual std::string name() const = 0;        // "host" or "cuda"
  virtual uint64_t frame_count(Tier tier) const = 0;

  // A new file descriptor for the frame (the caller owns and closes it). The client maps it:
  // mmap on the host backend, cuMemImportFromShareableHandle + cuMemMap on CUDA. Non-blocking.
  virtual Result<int> export_frame(Tier tier, FrameIndex frame) = 0;
  // The daemon's own pointer to the frame (host pointer, or device pointer in the daemon's context).
  virtual void* frame_pointer(Tier tier, FrameIndex frame) = 0;

  // Enqueues a batch of copies (adjacent ops may be merged into larger transfers) and calls
  // `done` exactly once, from a backend thread, when all have finished (or with the error that
  // stopped them). Returns an error (and never calls `done`) if the batch cannot be enqueued.
  virtual Status enqueue_copies(std::vector<CopyOp> ops, std::function<void(Status)> done) = 0;
  // Fills byte ranges with zeros; same completion contract.
  virtual Status enqueue_zero(Tier tier, FrameIndex frame, uint64_t offset, uint64_t bytes,
                              std::function<void(Status)> done) = 0;
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
};

// Creates frames up front. BackendKind comes from membar/client.h's meaning: host or cuda.
Result<std::unique_ptr<DeviceBackend>> make_host_backend(const BackendConfig& config);
#if defined(MEMBAR_WITH_CUDA)
Result<std::unique_ptr<DeviceBackend>> make_cuda_backend(const BackendConfig& config);
#endif

}  // namespace membar::runtimed
