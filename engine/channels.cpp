// ChannelRegistry (membar/engine/channels.h, Note [Channels]).
#include "membar/engine/channels.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace membar::runtimed {
namespace {

Status errno_status(const std::string& what) {
  int error = errno;
  std::string message = what + ": " + std::strerror(error);
  if (error == ENOMEM || error == ENOSPC || error == EMFILE || error == ENFILE) return resource_exhausted(message);
  return internal_error(message);
}

Status check_name(const std::string& name) {
  if (name.empty() || name.size() > 63) {
    return invalid_argument("channel name must be 1..63 bytes (got " + std::to_string(name.size()) + ")");
  }
  for (char c : name) {
    if (c < 0x21 || c > 0x7e) return invalid_argument("channel name '" + name + "' has a character that is not printable ASCII");
  }
  return Status::Ok();
}

}  // namespace

ChannelRegistry::~ChannelRegistry() {
  for (auto& [name, entry] : by_name_) ::close(entry.fd);
}

Result<ChannelGrant> ChannelRegistry::create(ClientId owner, uint32_t uid, const std::string& name, uint64_t bytes) {
  MEMBAR_RETURN_IF_ERROR(check_name(name));
  if (bytes == 0 || bytes > kMaxChannelBytes) {
    return invalid_argument("channel '" + name + "': size " + std::to_string(bytes) + " is not in [1, 64 GiB]");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  auto key = std::make_pair(uid, name);
  if (by_name_.count(key) != 0) return already_exists("channel '" + name + "' already exists");
  std::string memfd_name = "membar-channel-" + name;
  int fd = ::memfd_create(memfd_name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return errno_status("memfd_create for channel '" + name + "'");
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0 || ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) {
    Status status = errno_status("sizing channel '" + name + "'");
    ::close(fd);
    return status;
  }
  int handed = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (handed < 0) {
    Status status = errno_status("duplicating channel '" + name + "'");
    ::close(fd);
    return status;
  }
  Entry entry{next_id_++, owner, uid, bytes, fd, false};
  by_name_.emplace(key, entry);
  return ChannelGrant{entry.id, handed, bytes, true};
}

Status ChannelRegistry::publish(ClientId owner, uint32_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [key, entry] : by_name_) {
    if (entry.id != id) continue;
    if (entry.owner != owner) break;
    if (entry.published) return Status::Ok();
    // From now on no descriptor of this file, however re-opened, can write it or map it
    // writable; the creator's existing mapping stays writable.
    if (::fcntl(entry.fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0) {
      return errno_status("sealing channel '" + key.second + "'");
    }
    entry.published = true;
    return Status::Ok();
  }
  return not_found("channel " + std::to_string(id) + " was not created by this client (or is closed)");
}

Result<ChannelGrant> ChannelRegistry::open(uint32_t uid, const std::string& name) {
  MEMBAR_RETURN_IF_ERROR(check_name(name));
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = by_name_.find(std::make_pair(uid, name));
  if (it == by_name_.end() || !it->second.published) {
    return not_found("no channel named '" + name + "' (its creator may have closed it or disconnected)");
  }
  // A new open file description with read-only access: mmap(PROT_WRITE, MAP_SHARED) on it fails.
  std::string path = "/proc/self/fd/" + std::to_string(it->second.fd);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_status("re-opening channel '" + name + "' read-only");
  return ChannelGrant{it->second.id, fd, it->second.bytes, false};
}

Result<uint64_t> ChannelRegistry::close(ClientId owner, uint32_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = by_name_.begin(); it != by_name_.end(); ++it) {
    if (it->second.id != id) continue;
    if (it->second.owner != owner) break;
    uint64_t bytes = it->second.bytes;
    ::close(it->second.fd);
    by_name_.erase(it);
    return bytes;
  }
  return not_found("channel " + std::to_string(id) + " was not created by this client (or is closed)");
}

void ChannelRegistry::close_all(ClientId owner) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = by_name_.begin(); it != by_name_.end();) {
    if (it->second.owner == owner) {
      ::close(it->second.fd);
      it = by_name_.erase(it);
    } else {
      ++it;
    }
  }
}

uint64_t ChannelRegistry::owner_bytes(ClientId owner) const {
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t total = 0;
  for (const auto& [name, entry] : by_name_) total += entry.owner == owner ? entry.bytes : 0;
  return total;
}

size_t ChannelRegistry::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return by_name_.size();
}

}  // namespace membar::runtimed
