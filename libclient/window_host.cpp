// The host window: a PROT_NONE reservation of max_frames * 2 MiB; granted frames are mapped
// MAP_FIXED | MAP_SHARED from their memfd, revoked ones are replaced by PROT_NONE again so the
// reservation stays whole (nothing else in the process can land inside it).
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "window.h"

namespace membar {
namespace {

class HostWindow final : public Window {
 public:
  HostWindow(char* base, uint32_t max_frames) : base_(base), mapped_(max_frames, false) {}

  ~HostWindow() override {
    if (base_ != nullptr) ::munmap(base_, bytes());
  }

  Status map_frame(uint32_t window_frame, int fd) override {
    if (window_frame >= mapped_.size()) {
      if (fd >= 0) ::close(fd);
      return out_of_range("window frame " + std::to_string(window_frame) + " is outside a window of " +
                          std::to_string(mapped_.size()) + " frames");
    }
    if (mapped_[window_frame]) {
      if (fd >= 0) ::close(fd);
      return already_exists("window frame " + std::to_string(window_frame) + " is already mapped");
    }
    void* at = ::mmap(frame_address(window_frame), kFrameBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                      fd, 0);
    int error = errno;
    if (fd >= 0) ::close(fd);
    if (at == MAP_FAILED) {
      return internal_error("mapping window frame " + std::to_string(window_frame) +
                            " failed: " + std::strerror(error));
    }
    mapped_[window_frame] = true;
    return Status::Ok();
  }

  Status unmap_frame(uint32_t window_frame) override {
    if (window_frame >= mapped_.size() || !mapped_[window_frame]) {
      return not_found("window frame " + std::to_string(window_frame) + " is not mapped");
    }
    void* at = ::mmap(frame_address(window_frame), kFrameBytes, PROT_NONE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (at == MAP_FAILED) {
      return internal_error("unmapping window frame " + std::to_string(window_frame) +
                            " failed: " + std::strerror(errno));
    }
    mapped_[window_frame] = false;
    return Status::Ok();
  }

  bool is_mapped(uint32_t window_frame) const override {
    return window_frame < mapped_.size() && mapped_[window_frame];
  }
  void* base() const override { return base_; }
  uint64_t bytes() const override { return uint64_t(mapped_.size()) * kFrameBytes; }

 private:
  char* frame_address(uint32_t window_frame) const { return base_ + uint64_t(window_frame) * kFrameBytes; }

  char* base_;
  std::vector<bool> mapped_;
};

}  // namespace

Result<std::unique_ptr<Window>> make_host_window(uint32_t max_frames) {
  char* base = nullptr;
  if (max_frames > 0) {
    uint64_t bytes = uint64_t(max_frames) * kFrameBytes;
    void* at = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (at == MAP_FAILED) {
      return resource_exhausted("reserving a window of " + std::to_string(bytes) +
                                " bytes failed: " + std::strerror(errno));
    }
    base = static_cast<char*>(at);
  }
  return std::unique_ptr<Window>(new HostWindow(base, max_frames));
}

}  // namespace membar
