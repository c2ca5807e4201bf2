// Turning a batch of page copies into few large transfers (no CUDA here, so it is unit-tested
// on any machine). Small copies run at a third of PCIe speed (64 KiB: ~17 GB/s, 2 MiB and up:
// ~52-55 GB/s on the H200), and the pages of a space usually sit back to back in frames, so
// the CUDA backend sorts a batch and joins runs that continue on both sides.
#pragma once

#include <cstdint>
#include <vector>

namespace membar::runtimed {

// One contiguous copy, in the daemon's own pointers.
struct Transfer {
  char* source = nullptr;
  char* destination = nullptr;
  uint64_t bytes = 0;
};

// Sorts by source address and joins neighbours whose source and destination both continue.
// Precondition: the destinations do not overlap (then the order of copies does not matter).
void copy_plan_merge(std::vector<Transfer>& transfers);

// Cuts transfers so that, on each side lying in [region_begin, region_end), no piece crosses a
// multiple of `boundary` bytes from region_begin (separately registered host frames).
void copy_plan_split(std::vector<Transfer>& transfers, const char* region_begin, const char* region_end,
                     uint64_t boundary);

}  // namespace membar::runtimed
