#include "shared_segment.h"

#include <dirent.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace membar::runtimed {

Result<std::unique_ptr<SharedSegment>> SharedSegment::create(const protocol::v2::SegmentLayout& layout) {
  std::unique_ptr<SharedSegment> segment(new SharedSegment());
  segment->layout_ = layout;
  segment->fd_.reset(::memfd_create("membar-segment", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!segment->fd_.valid()) return resource_exhausted(std::string("memfd_create of a segment: ") + std::strerror(errno));
  if (::ftruncate(segment->fd_.get(), static_cast<off_t>(layout.segment_bytes)) != 0) {
    return resource_exhausted(std::string("sizing a segment: ") + std::strerror(errno));
  }
  // The client must not shrink it under the daemon (its accesses would fault).
  if (::fcntl(segment->fd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return internal_error(std::string("sealing a segment: ") + std::strerror(errno));
  }
  void* base = ::mmap(nullptr, layout.segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, segment->fd_.get(), 0);
  if (base == MAP_FAILED) return resource_exhausted(std::string("mapping a segment: ") + std::strerror(errno));
  segment->base_ = static_cast<uint8_t*>(base);
  protocol::v2::write_segment_header(segment->base_, layout);
  return segment;
}

SharedSegment::~SharedSegment() {
  if (base_ != nullptr) ::munmap(base_, layout_.segment_bytes);
}

Result<int> SharedSegment::export_fd() const {
  int fd = ::fcntl(fd_.get(), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return resource_exhausted(std::string("duplicating a segment: ") + std::strerror(errno));
  return fd;
}

int sweep_named_segments() {
  DIR* directory = ::opendir("/dev/shm");
  if (directory == nullptr) return 0;
  int removed = 0;
  uid_t me = ::geteuid();
  while (dirent* entry = ::readdir(directory)) {
    std::string name = entry->d_name;
    if (name.rfind("membar.", 0) != 0) continue;
    std::string path = "/dev/shm/" + name;
    struct stat info {};
    if (::stat(path.c_str(), &info) != 0 || info.st_uid != me) continue;
    if (::unlink(path.c_str()) == 0) ++removed;
  }
  ::closedir(directory);
  return removed;
}

}  // namespace membar::runtimed
