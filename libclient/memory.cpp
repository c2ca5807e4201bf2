#include "memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "membar/common/fd.h"

namespace membar {
namespace {

std::string errno_text() { return std::strerror(errno); }

class MmapMapper final : public FrameMapper {
 public:
  Result<char*> reserve(uint64_t bytes) override {
    void* at = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (at == MAP_FAILED) return resource_exhausted("reserving " + std::to_string(bytes) + " bytes failed: " + errno_text());
    return static_cast<char*>(at);
  }
  void release(char* base, uint64_t bytes) override { ::munmap(base, bytes); }

  Status adopt_frame(uint32_t window_frame, int fd) override {
    frames_[window_frame] = Source{std::make_shared<UniqueFd>(fd), 0};
    return Status::Ok();
  }
  Status adopt_slab(uint32_t slab, uint32_t slab_frames, uint32_t frames, int fd) override {
    auto shared = std::make_shared<UniqueFd>(fd);
    for (uint32_t i = 0; i < frames; ++i) frames_[slab * slab_frames + i] = Source{shared, uint64_t(i) * kFrameBytes};
    slab_frames_ = slab_frames;
    return Status::Ok();
  }
  void drop_frame(uint32_t window_frame) override { frames_.erase(window_frame); }
  void drop_slab(uint32_t slab) override {
    for (auto it = frames_.lower_bound(slab * slab_frames_); it != frames_.end() && it->first < (slab + 1) * slab_frames_;) {
      it = frames_.erase(it);
    }
  }
  Status map(uint32_t window_frame, char* at) override {
    auto it = frames_.find(window_frame);
    if (it == frames_.end()) return internal_error("the runtime mapped frame " + std::to_string(window_frame) + ", which it never granted");
    void* mapped = ::mmap(at, kFrameBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, it->second.fd->get(),
                          static_cast<off_t>(it->second.offset));
    if (mapped == MAP_FAILED) return internal_error("mapping frame " + std::to_string(window_frame) + " failed: " + errno_text());
    return Status::Ok();
  }
  Status unmap(char* at) override {
    void* mapped = ::mmap(at, kFrameBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (mapped == MAP_FAILED) return internal_error("unmapping a frame failed: " + errno_text());
    return Status::Ok();
  }

 private:
  struct Source {
    std::shared_ptr<UniqueFd> fd;
    uint64_t offset = 0;
  };
  std::map<uint32_t, Source> frames_;
  uint32_t slab_frames_ = 1;
};

}  // namespace

std::unique_ptr<FrameMapper> make_mmap_mapper() { return std::make_unique<MmapMapper>(); }

ClientMemory::ClientMemory(std::unique_ptr<FrameMapper> gpu, std::unique_ptr<FrameMapper> host, uint32_t host_slab_frames)
    : host_slab_frames_(host_slab_frames == 0 ? 1 : host_slab_frames) {
  mappers_[0] = std::move(gpu);
  mappers_[1] = std::move(host);
}

ClientMemory::~ClientMemory() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int t = 0; t < 2; ++t) {
    std::vector<Position> left;
    for (auto& [position, frame] : positions_[t]) left.push_back(position);
    for (const Position& position : left) (void)unmap_locked(t, position);
  }
  for (auto& [id, entry] : spaces_) {
    for (int t = 0; t < 2; ++t) mappers_[t]->release(entry.base[t], entry.reserved);
  }
}

Status ClientMemory::add_space(SpaceId space, uint64_t page_bytes, uint32_t page_count) {
  std::lock_guard<std::mutex> lock(mutex_);
  SpaceEntry entry;
  entry.page_bytes = page_bytes;
  entry.page_count = page_count;
  uint64_t bytes = page_bytes * uint64_t(page_count);
  entry.reserved = (bytes + kFrameBytes - 1) / kFrameBytes * kFrameBytes;
  for (int t = 0; t < 2; ++t) {
    Result<char*> base = mappers_[t]->reserve(entry.reserved);
    if (!base.ok()) {
      if (t == 1) mappers_[0]->release(entry.base[0], entry.reserved);
      return base.status();
    }
    entry.base[t] = base.value();
  }
  spaces_[space] = entry;
  return Status::Ok();
}

Status ClientMemory::remove_space(SpaceId space) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = spaces_.find(space);
  if (it == spaces_.end()) return Status::Ok();
  Status status = Status::Ok();
  for (int t = 0; t < 2; ++t) {
    // The runtime unmapped every position before the space went; whatever is left goes now.
    std::vector<Position> left;
    for (auto p = positions_[t].lower_bound({space, 0}); p != positions_[t].end() && p->first.first == space; ++p) {
      left.push_back(p->first);
    }
    for (const Position& position : left) {
      Status unmapped = unmap_locked(t, position);
      if (status.ok()) status = unmapped;
    }
    mappers_[t]->release(it->second.base[t], it->second.reserved);
  }
  spaces_.erase(it);
  return status;
}

Result<SpaceView> ClientMemory::view(SpaceId space) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = spaces_.find(space);
  if (it == spaces_.end()) return not_found("this client has no space " + std::to_string(space));
  SpaceView view;
  view.id = space;
  view.gpu = it->second.base[0];
  view.host = it->second.base[1];
  view.page_bytes = it->second.page_bytes;
  view.page_count = it->second.page_count;
  view.bytes = it->second.page_bytes * uint64_t(it->second.page_count);
  return view;
}

Status ClientMemory::gpu_frame_granted(uint32_t window_frame, int fd) {
  std::lock_guard<std::mutex> lock(mutex_);
  return mappers_[0]->adopt_frame(window_frame, fd);
}

Status ClientMemory::gpu_frame_revoked(uint32_t window_frame) {
  std::lock_guard<std::mutex> lock(mutex_);
  Status status = Status::Ok();
  auto it = frame_positions_[0].find(window_frame);
  if (it != frame_positions_[0].end()) {
    std::set<Position> positions = it->second;
    for (const Position& position : positions) {
      Status unmapped = unmap_locked(0, position);
      if (status.ok()) status = unmapped;
    }
  }
  mappers_[0]->drop_frame(window_frame);
  return status;
}

Status ClientMemory::host_slab_granted(uint32_t slab, uint32_t frames, int fd) {
  std::lock_guard<std::mutex> lock(mutex_);
  return mappers_[1]->adopt_slab(slab, host_slab_frames_, frames, fd);
}

Status ClientMemory::host_slab_revoked(uint32_t slab) {
  std::lock_guard<std::mutex> lock(mutex_);
  Status status = Status::Ok();
  for (uint32_t w = slab * host_slab_frames_; w < (slab + 1) * host_slab_frames_; ++w) {
    auto it = frame_positions_[1].find(w);
    if (it == frame_positions_[1].end()) continue;
    std::set<Position> positions = it->second;
    for (const Position& position : positions) {
      Status unmapped = unmap_locked(1, position);
      if (status.ok()) status = unmapped;
    }
  }
  mappers_[1]->drop_slab(slab);
  return status;
}

Status ClientMemory::mapped(Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame) {
  std::lock_guard<std::mutex> lock(mutex_);
  int t = tier == Tier::kGpu ? 0 : 1;
  auto it = spaces_.find(space);
  if (it == spaces_.end()) return internal_error("the runtime mapped a frame in space " + std::to_string(space) + ", which this client does not know");
  if (uint64_t(space_frame + 1) * kFrameBytes > it->second.reserved) {
    return internal_error("the runtime mapped a frame past the end of space " + std::to_string(space));
  }
  Position position{space, space_frame};
  if (positions_[t].count(position) != 0) MEMBAR_RETURN_IF_ERROR(unmap_locked(t, position));
  MEMBAR_RETURN_IF_ERROR(mappers_[t]->map(window_frame, it->second.base[t] + uint64_t(space_frame) * kFrameBytes));
  positions_[t][position] = window_frame;
  frame_positions_[t][window_frame].insert(position);
  return Status::Ok();
}

Status ClientMemory::unmapped(Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame) {
  std::lock_guard<std::mutex> lock(mutex_);
  (void)window_frame;
  return unmap_locked(tier == Tier::kGpu ? 0 : 1, Position{space, space_frame});
}

Status ClientMemory::unmap_locked(int t, const Position& position) {
  auto it = positions_[t].find(position);
  if (it == positions_[t].end()) return Status::Ok();
  uint32_t window_frame = it->second;
  positions_[t].erase(it);
  auto frames = frame_positions_[t].find(window_frame);
  if (frames != frame_positions_[t].end()) {
    frames->second.erase(position);
    if (frames->second.empty()) frame_positions_[t].erase(frames);
  }
  auto space = spaces_.find(position.first);
  if (space == spaces_.end()) return Status::Ok();
  return mappers_[t]->unmap(space->second.base[t] + uint64_t(position.second) * kFrameBytes);
}

void ClientMemory::note_error(const Status& status) {
  std::lock_guard<std::mutex> lock(error_mutex_);
  if (error_.ok()) error_ = status;
}

Status ClientMemory::take_error() {
  std::lock_guard<std::mutex> lock(error_mutex_);
  return std::exchange(error_, Status::Ok());
}

}  // namespace membar
