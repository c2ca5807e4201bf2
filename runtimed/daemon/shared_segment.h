// A client's shared-memory segment on the daemon side (Boost.Interprocess shared_memory_object +
// mapped_region), laid out by protocol v1. Move-only owner: the mapping lives as long as the
// object; the name is removed once the client has attached (or when the object dies), so a
// crashed daemon leaves nothing behind in /dev/shm for long.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "membar/protocol/v1.h"
#include "membar/status.h"

namespace membar::runtimed {

class SharedSegment {
 public:
  // Creates the segment `name` (mode 0600, zero-filled, owned by `owner_uid` so that a client
  // admitted by --allow-uid can open it; changing the owner needs a root daemon) and writes its
  // header.
  static Result<std::unique_ptr<SharedSegment>> create(const std::string& name,
                                                       const protocol::v1::SegmentLayout& layout,
                                                       uint32_t owner_uid);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  // Removes the name; the mapping stays valid. Idempotent.
  void remove_name();

  uint8_t* base() const { return base_; }
  const protocol::v1::SegmentLayout& layout() const { return layout_; }
  const std::string& name() const { return name_; }
  protocol::v1::SegmentHeaderV1* header() const {
    return reinterpret_cast<protocol::v1::SegmentHeaderV1*>(base_);
  }

 private:
  struct Mapping;
  SharedSegment() = default;
  std::unique_ptr<Mapping> mapping_;
  uint8_t* base_ = nullptr;
  protocol::v1::SegmentLayout layout_;
  std::string name_;
  bool name_removed_ = false;
};

}  // namespace membar::runtimed
