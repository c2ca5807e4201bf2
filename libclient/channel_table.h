// The channels a Client holds mapped (membar::Channel, runtimed/channels.h Note [Channels]):
// handle -> mapping. Shared by the embedded and the daemon client. Not thread-safe: the owning
// client serialises calls.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>

#include "membar/client.h"

namespace membar {

class ChannelTable {
 public:
  struct Entry {
    Channel channel;
    uint32_t runtime_id = 0;  // the registry's id
    bool owner = false;       // this client created it
  };

  ChannelTable() = default;
  ChannelTable(const ChannelTable&) = delete;
  ChannelTable& operator=(const ChannelTable&) = delete;
  ~ChannelTable() {
    for (auto& [handle, entry] : entries_) unmap(entry);
  }

  // Maps `fd` (taken over: closed on error, kept open in the entry on success).
  Result<Channel> add(int fd, uint32_t runtime_id, uint64_t bytes, bool writable, bool owner) {
    int protection = writable ? PROT_READ | PROT_WRITE : PROT_READ;
    void* data = ::mmap(nullptr, bytes, protection, MAP_SHARED, fd, 0);
    if (data == MAP_FAILED) {
      Status status = internal_error(std::string("mapping a channel of ") + std::to_string(bytes) +
                                     " bytes failed: " + std::strerror(errno));
      ::close(fd);
      return status;
    }
    Entry entry;
    entry.channel = Channel{next_handle_++, data, bytes, writable, fd};
    entry.runtime_id = runtime_id;
    entry.owner = owner;
    entries_.emplace(entry.channel.handle, entry);
    return entry.channel;
  }

  // Unmaps and forgets; NOT_FOUND for an unknown handle. `entry_out` gets what was removed.
  Status remove(uint32_t handle, Entry* entry_out) {
    auto it = entries_.find(handle);
    if (it == entries_.end()) return not_found("channel handle " + std::to_string(handle) + " is not open in this client");
    if (entry_out != nullptr) *entry_out = it->second;
    unmap(it->second);
    entries_.erase(it);
    return Status::Ok();
  }

  const Entry* find(uint32_t handle) const {
    auto it = entries_.find(handle);
    return it == entries_.end() ? nullptr : &it->second;
  }

 private:
  static void unmap(Entry& entry) {
    if (entry.channel.data != nullptr) ::munmap(entry.channel.data, entry.channel.bytes);
    if (entry.channel.fd >= 0) ::close(entry.channel.fd);
    entry.channel.data = nullptr;
    entry.channel.fd = -1;
  }

  std::map<uint32_t, Entry> entries_;
  uint32_t next_handle_ = 1;
};

}  // namespace membar
