// A client's shared-memory segment on the daemon side: a sealed memfd laid out by protocol v2,
// mapped here and passed to the client as a descriptor in the hello reply. It has no name, so no
// other process can open it (a same-user process could open a named segment during the handshake
// and act as that client) and a killed daemon leaves nothing behind in /dev/shm.
#pragma once

#include <cstdint>
#include <memory>

#include "membar/common/fd.h"
#include "membar/protocol/v2.h"
#include "membar/status.h"

namespace membar::runtimed {

class SharedSegment {
 public:
  // A zero-filled segment of layout.segment_bytes with its header written.
  static Result<std::unique_ptr<SharedSegment>> create(const protocol::v2::SegmentLayout& layout);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  // A new descriptor of the segment for the client (the caller closes it).
  Result<int> export_fd() const;
  uint8_t* base() const { return base_; }
  const protocol::v2::SegmentLayout& layout() const { return layout_; }
  protocol::v2::SegmentHeaderV2* header() const { return reinterpret_cast<protocol::v2::SegmentHeaderV2*>(base_); }

 private:
  SharedSegment() = default;
  UniqueFd fd_;
  uint8_t* base_ = nullptr;
  protocol::v2::SegmentLayout layout_;
};

// Removes /dev/shm/membar.* segments that daemons of protocol version 1 left when they were
// killed (they named their segments). Returns how many went.
int sweep_named_segments();

}  // namespace membar::runtimed
