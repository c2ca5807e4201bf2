#include "shared_segment.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>

namespace membar::runtimed {

namespace bip = boost::interprocess;

struct SharedSegment::Mapping {
  bip::mapped_region region;
};

Result<std::unique_ptr<SharedSegment>> SharedSegment::create(const std::string& name,
                                                             const protocol::v1::SegmentLayout& layout,
                                                             uint32_t owner_uid) {
  std::unique_ptr<SharedSegment> segment(new SharedSegment());
  segment->name_ = name;
  segment->layout_ = layout;
  // Boost.Interprocess reports failures by exception; none leaves this function.
  try {
    bip::permissions permissions;
    permissions.set_permissions(0600);
    bip::shared_memory_object object(bip::create_only, name.c_str(), bip::read_write, permissions);
    try {
      object.truncate(static_cast<bip::offset_t>(layout.segment_bytes));
      if (owner_uid != ::geteuid() && ::fchown(object.get_mapping_handle().handle, owner_uid, static_cast<gid_t>(-1)) != 0) {
        bip::shared_memory_object::remove(name.c_str());
        return permission_denied("cannot hand segment " + name + " to uid " + std::to_string(owner_uid) +
                                 ": " + std::strerror(errno) + " (serving other uids needs a root daemon)");
      }
      segment->mapping_ = std::make_unique<Mapping>(Mapping{bip::mapped_region(object, bip::read_write)});
    } catch (...) {
      bip::shared_memory_object::remove(name.c_str());
      throw;
    }
  } catch (const bip::interprocess_exception& error) {
    return resource_exhausted("cannot create shared memory segment " + name + ": " + error.what());
  }
  segment->base_ = static_cast<uint8_t*>(segment->mapping_->region.get_address());
  protocol::v1::write_segment_header(segment->base_, layout);
  return segment;
}

void SharedSegment::remove_name() {
  if (name_removed_) return;
  bip::shared_memory_object::remove(name_.c_str());
  name_removed_ = true;
}

SharedSegment::~SharedSegment() { remove_name(); }

}  // namespace membar::runtimed
