// What both backends share.
#include "membar/engine/backend.h"

namespace membar::runtimed {

uint32_t host_slab_frames_for(uint64_t host_pool_bytes) {
  constexpr uint64_t kMaxSlabs = 256;
  constexpr uint32_t kMaxSlabFrames = 2048;  // 4 GiB
  uint64_t frames = host_pool_bytes / kFrameBytes;
  uint32_t slab_frames = 1;
  while (slab_frames < kMaxSlabFrames && (frames + slab_frames - 1) / slab_frames > kMaxSlabs) slab_frames *= 2;
  return slab_frames;
}

}  // namespace membar::runtimed
