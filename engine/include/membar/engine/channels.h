// Channels: named byte buffers in shared memory that one client writes and other processes of
// the same user read, made and handed out by the runtime (a membard daemon, or the embedded
// runtime inside one process). What LoGRA's policy sync publishes through: the trainer creates
// a channel and writes update records into it; rollout processes open it read-only.
//
// Note [Channels]
// Rationale: a publisher and its subscribers must share memory without trusting each other's
// names for POSIX shm objects (a stale /dev/shm name outlives a crashed trainer; anyone of the
// same uid can create one first), and a subscriber must not be able to corrupt what the others
// read. Approach: the registry owns one sealed memfd per channel (size fixed at creation); the
// creator gets a read-write descriptor, an opener a descriptor re-opened O_RDONLY through
// /proc/self/fd, which mmap can only map PROT_READ. Names are per registry (per daemon), only
// openers of the creator's uid (or root) find a channel, and the name is dropped when the creator
// closes it or disconnects; descriptors already handed out stay valid (the memory lives while
// any process maps it), so a subscriber sees the last contents but no new ones.
// Limitations: no notification: readers poll the contents (a sequence word in the data, for
// example). The bytes of a client's channels count against its host quota.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "membar/status.h"
#include "membar/types.h"

namespace membar::runtimed {

struct ChannelGrant {
  uint32_t id = 0;
  int fd = -1;            // a new descriptor: the caller owns and closes it
  uint64_t bytes = 0;
  bool writable = false;
};

class ChannelRegistry {
 public:
  ChannelRegistry() = default;
  ~ChannelRegistry();
  ChannelRegistry(const ChannelRegistry&) = delete;
  ChannelRegistry& operator=(const ChannelRegistry&) = delete;

  // A zero-filled channel of `bytes` owned by `owner`. ALREADY_EXISTS when the name is taken,
  // INVALID_ARGUMENT for a bad name or a size of 0 or over 64 GiB, RESOURCE_EXHAUSTED when the
  // owner's channels would exceed `owner_limit_bytes` (0: no limit).
  Result<ChannelGrant> create(ClientId owner, uint32_t uid, const std::string& name, uint64_t bytes,
                              uint64_t owner_limit_bytes);
  // A read-only descriptor of the channel; NOT_FOUND when no channel of that name is visible to
  // `uid` (another user's channels are not found, so their names do not leak).
  Result<ChannelGrant> open(uint32_t uid, const std::string& name);
  // Drops the name of a channel `owner` created (its memory lives while mapped anywhere).
  Status close(ClientId owner, uint32_t id);
  // Drops every channel of `owner` (disconnect).
  void close_all(ClientId owner);

  uint64_t owner_bytes(ClientId owner) const;
  size_t size() const;

 private:
  struct Entry {
    uint32_t id = 0;
    ClientId owner = 0;
    uint32_t uid = 0;
    uint64_t bytes = 0;
    int fd = -1;  // the registry's read-write descriptor
  };
  mutable std::mutex mutex_;
  std::map<std::string, Entry> by_name_;
  uint32_t next_id_ = 1;
};

// Largest channel. Names follow the rule of space names: 1..63 bytes of printable ASCII.
inline constexpr uint64_t kMaxChannelBytes = 64ull << 30;

}  // namespace membar::runtimed
