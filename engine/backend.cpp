// What both backends share.
#include "membar/engine/backend.h"

#include <algorithm>
#include <chrono>
#include <thread>

namespace membar::runtimed {

uint32_t host_slab_frames_for(uint64_t host_pool_bytes) {
  constexpr uint64_t kMaxSlabs = 256;
  constexpr uint32_t kMaxSlabFrames = 2048;  // 4 GiB
  uint64_t frames = host_pool_bytes / kFrameBytes;
  uint32_t slab_frames = 1;
  while (slab_frames < kMaxSlabFrames && (frames + slab_frames - 1) / slab_frames > kMaxSlabs) slab_frames *= 2;
  return slab_frames;
}

// Note [Renewal when memory is short]
// Rationale: renewing a GPU frame releases the daemon's handle to its old memory and creates a
// new allocation (Note [Frames, slabs and renewal]). The old memory is freed only when every
// process that imported it has let it go. A trainer that was killed (or timed out) is disconnected
// as soon as its socket closes, often before the driver has torn down its context: for a moment
// its old frames and the new ones all need GPU memory, and with a pool that fills the GPU
// cuMemCreate fails with out-of-memory. Losing the frame then would shrink the pool for good
// (seen on the H200: a 90 GiB pool had 18,840 of its 46,080 frames neither free nor renewing right
// after a 1M-token trainer was killed, which only failed renewals explain; that they failed for
// memory is the likely cause, not yet confirmed: the daemon did not log lost frames then).
// Approach: a renewal that fails with RESOURCE_EXHAUSTED is tried again, with waits growing from
// 5 ms to 500 ms, for up to BackendConfig::renewal_patience_ms (2 minutes); meanwhile the memory
// counts as preparing, and clients that need it are told to retry. Any other failure, or one that
// outlasts the patience, is final: the engine counts the memory as lost (`frames_lost` in
// membarctl stats) and keeps the error for the operator.
Status renew_patiently(const std::function<Status()>& attempt, uint32_t patience_ms,
                       const std::function<bool()>& give_up) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(patience_ms);
  auto wait = std::chrono::milliseconds(5);
  for (;;) {
    Status status = attempt();
    if (status.ok() || status.code() != StatusCode::RESOURCE_EXHAUSTED) return status;
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline || give_up()) return status;
    std::this_thread::sleep_for(std::min<std::chrono::steady_clock::duration>(wait, deadline - now));
    wait = std::min(wait * 2, std::chrono::milliseconds(500));
  }
}

Status injected_renewal_failure(std::atomic<int64_t>& left) {
  if (left.load() > 0 && left.fetch_sub(1) > 0) {
    return resource_exhausted("renewal attempt failed by fault injection (as if memory were short)");
  }
  return Status::Ok();
}

}  // namespace membar::runtimed
