// The client half of signal blocks on CUDA (see DeviceBackend's signal blocks in
// runtimed/backend.h): the daemon's copy streams write "ticket T is done" into a word of the
// client's block with cuStreamWriteValue64; the trainer's stream waits for it on the GPU with
// cuStreamWaitValue64 and later writes "the GPU is done with these pages", so neither side
// needs a CPU round trip on the hot path.
//
// The block is shared memory (a memfd the runtime hands the client). The client mmaps it
// (MAP_SHARED) for its CPU view, then registers that mapping here so its streams can reach it.
// Used by the daemon client and by the embedded client alike. Thread-safe after create().
#pragma once

#include <cstdint>
#include <memory>

#include "membar/status.h"

namespace membar {

class StreamSignals {
 public:
  // `words`: the client's own mapping of the block (page-aligned, as mmap returns it), holding
  // `word_count` words. Registers it with the driver (cuMemHostRegister, DEVICEMAP) in this
  // process's context of `device`. UNAVAILABLE without a driver or GPU; UNIMPLEMENTED when
  // the GPU cannot run 64-bit stream memory operations. Blocks for a few microseconds.
  static Result<std::unique_ptr<StreamSignals>> create(volatile uint64_t* words, uint32_t word_count, int device);
  virtual ~StreamSignals() = default;

  // Enqueues on `cuda_stream` (a cudaStream_t / CUstream; null is the legacy default stream):
  // work enqueued after this waits until word `index` >= `value` (wrap-around compare, as
  // tickets only grow). Does not block the calling thread.
  virtual Status stream_wait(uint32_t index, uint64_t value, void* cuda_stream) const = 0;
  // Enqueues on `cuda_stream`: once the work enqueued before it has finished (its memory
  // writes visible), word `index` becomes `value`. Does not block the calling thread.
  virtual Status stream_write(uint32_t index, uint64_t value, void* cuda_stream) const = 0;

  virtual volatile uint64_t* words() const = 0;
  virtual uint32_t word_count() const = 0;
};

}  // namespace membar
