// Channels: named byte buffers in shared memory that one client writes and other processes of
// the same user read, made and handed out by the runtime (a membard daemon, or the embedded
// runtime inside one process). What LoGRA's policy sync publishes through: the trainer creates
// a channel and writes update records into it; rollout processes open it read-only.
//
// Note [Channels]
// Rationale: a publisher and its subscribers must share memory without trusting each other's
// names for POSIX shm objects (a stale /dev/shm name outlives a crashed trainer; anyone of the
// same uid can create one first), a subscriber must not be able to corrupt what the others read
// (not even by re-opening its descriptor read-write through /proc/self/fd), and channel memory
// must count like any other memory a client holds. Approach: the registry owns one memfd per
// channel (size fixed at creation, sealed against resizing). The creator gets a read-write
// descriptor, maps it, then publishes the channel: publishing seals it against any further write
// access (F_SEAL_FUTURE_WRITE: the creator's mapping stays writable, no new writable mapping or
// write() is possible through any descriptor, however re-opened). Only published channels can be
// opened; an opener gets a descriptor re-opened O_RDONLY. Names live in a namespace per uid: a
// channel is found only by processes of its creator's uid (root sees every uid's names only by
// giving that uid, through the daemon's credentials check), and two users may use the same name.
// The name is dropped when the creator closes it or disconnects; descriptors already handed out
// stay valid (the memory lives while any process maps it), so a subscriber sees the last contents
// but no new ones. The bytes count against the creator's host quota and the host pool
// (Engine::reserve_channel_bytes).
// Limitations: no notification: readers poll the contents (a sequence word in the data, for
// example).
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

  // A zero-filled, unpublished channel of `bytes` owned by `owner`, in `uid`'s namespace.
  // ALREADY_EXISTS when the name is taken there, INVALID_ARGUMENT for a bad name or a size of 0
  // or over 64 GiB. (Quota: the caller reserves the bytes with the engine first.)
  Result<ChannelGrant> create(ClientId owner, uint32_t uid, const std::string& name, uint64_t bytes);
  // Seals the channel against further write access and makes it visible to open().
  Status publish(ClientId owner, uint32_t id);
  // A read-only descriptor of a published channel in `uid`'s namespace; NOT_FOUND otherwise
  // (another user's channels are not found, so their names do not leak).
  Result<ChannelGrant> open(uint32_t uid, const std::string& name);
  // Drops the name of a channel `owner` created (its memory lives while mapped anywhere) and
  // returns its size.
  Result<uint64_t> close(ClientId owner, uint32_t id);
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
    bool published = false;
  };
  mutable std::mutex mutex_;
  std::map<std::pair<uint32_t, std::string>, Entry> by_name_;  // (uid, name)
  uint32_t next_id_ = 1;
};

// Largest channel. Names follow the rule of space names: 1..63 bytes of printable ASCII.
inline constexpr uint64_t kMaxChannelBytes = 64ull << 30;

}  // namespace membar::runtimed
