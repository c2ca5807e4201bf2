// One connection of membard: its socket channel (shared with the engine's event callbacks) and,
// for trainer clients, the ring-serving thread that runs its requests against the Engine.
// See Note [Two channels] in membar/protocol/v2.h.
//
// Note [Writes never block the daemon]
// Rationale: a peer that stops reading its socket (a ping flood it never drains, a client that
// stopped reading its frame grants) used to hold the event loop in a blocking send for seconds
// each: no handshakes, no stats, no reclaim of dead clients, SIGTERM ignored. Approach: every
// message to a peer goes through its SessionChannel: written at once when the socket takes it,
// else queued (with duplicates of its descriptors) and written by the event loop when the socket
// is writable. The queue is bounded in bytes and descriptors; a peer over its bound is
// disconnected and logged (its frames reclaimed as for any dead client). No thread ever waits on
// a peer's socket: the ring thread posts a completion as soon as its events are queued, and the
// completion's events_through tells the client what to read first.
// Limitations: a message is queued whole (a stats reply of up to 4 MiB counts in full).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <type_traits>
#include <vector>

#include "membar/common/fd.h"
#include "membar/common/wire_socket.h"
#include "membar/engine/channels.h"
#include "membar/engine/engine.h"
#include "membar/protocol/ring.h"
#include "membar/protocol/v2.h"
#include "shared_segment.h"

namespace membar::runtimed {

struct OutboundLimits {
  uint64_t max_bytes = 16ull << 20;  // queued bytes before the peer is dropped
  uint32_t max_fds = 4096;           // queued descriptors before the peer is dropped
};

// What the engine's callbacks (any thread), the ring thread and the event loop use to reach a
// peer. Lives until the last holder is gone, so a late callback never touches freed memory:
// after close() it drops what it is given.
class SessionChannel {
 public:
  // Takes `socket_fd` (non-blocking). `want_write` is called (from any thread, no lock held)
  // when output was queued or the queue overflowed: the loop then polls for writability or
  // drops the peer.
  SessionChannel(int socket_fd, OutboundLimits limits, std::function<void()> want_write);

  // Queues one message (never blocks). `fds` stay the caller's (duplicated when queued).
  // UNAVAILABLE after close; RESOURCE_EXHAUSTED when the queue is over its bound (the channel
  // is then marked overflowed).
  Status send(protocol::v2::MessageType type, std::span<const uint8_t> payload, std::span<const int> fds = {});
  template <typename T>
    requires std::is_trivially_copyable_v<T>
  Status send(protocol::v2::MessageType type, const T& payload, std::span<const int> fds = {}) {
    return send(type, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(&payload), sizeof(T)), fds);
  }
  // An event (Note [Two channels]): `payload` starts with a u64 that is set to the next number of
  // this peer's event sequence.
  template <typename T>
    requires std::is_trivially_copyable_v<T>
  Status send_event(protocol::v2::MessageType type, T payload, int fd = -1) {
    std::lock_guard<std::mutex> lock(event_mutex_);
    uint64_t sequence = events_queued_ + 1;
    std::memcpy(&payload, &sequence, sizeof(sequence));
    int fds[1] = {fd};
    Status status = send(type, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(&payload), sizeof(T)),
                         fd >= 0 ? std::span<const int>(fds, 1) : std::span<const int>());
    if (status.ok()) events_queued_ = sequence;
    return status;
  }
  // The last event sequence number queued (what a completion's events_through carries).
  uint64_t events_queued() const {
    std::lock_guard<std::mutex> lock(event_mutex_);
    return events_queued_;
  }

  // Event loop: writes what the socket takes. OK(true) when nothing is left queued, OK(false)
  // when the socket is full, UNAVAILABLE when the peer is gone.
  Result<bool> flush();
  bool overflowed() const { return overflowed_.load(std::memory_order_acquire); }
  uint64_t queued_bytes() const;
  int socket_fd() const { return socket_.get(); }

  void set_segment(std::shared_ptr<SharedSegment> segment);
  // Publishes the client's completed ticket in its segment and wakes it if it sleeps.
  void publish_completed(Ticket completed);
  // Marks the segment "daemon shutting down" and wakes a sleeping client.
  void publish_shutdown();
  // After close, sends fail quietly, the queue is dropped and the socket is closed.
  void close();

 private:
  struct Pending {
    std::vector<uint8_t> bytes;
    size_t offset = 0;
    std::vector<UniqueFd> fds;  // sent with the first byte
  };
  Result<bool> flush_locked();

  OutboundLimits limits_;
  std::function<void()> want_write_;
  mutable std::mutex send_mutex_;  // guards socket_, queue_, closed_ and the counters below
  UniqueFd socket_;
  std::deque<Pending> queue_;
  uint64_t queued_bytes_ = 0;
  uint64_t queued_fds_ = 0;
  bool closed_ = false;
  std::atomic<bool> overflowed_{false};
  mutable std::mutex event_mutex_;  // orders event numbers with their place in the queue
  uint64_t events_queued_ = 0;
  std::mutex segment_mutex_;  // guards segment_
  std::shared_ptr<SharedSegment> segment_;
};

struct RingServerConfig {
  uint32_t spin_us = 50;
  ChannelRegistry* channels = nullptr;  // the daemon's (null: channel requests fail UNIMPLEMENTED)
  uint32_t uid = 0;                      // the client's, for channel visibility
};

// The thread serving one client's request ring. Started after the segment exists; stop() joins.
class RingServer {
 public:
  RingServer(Engine& engine, ClientId client, std::shared_ptr<SharedSegment> segment,
             std::shared_ptr<SessionChannel> channel, RingServerConfig config,
             std::function<void(std::string)> on_protocol_violation);
  ~RingServer() { stop(); }
  void start();
  // Blocks until the thread has finished its current request and exited.
  void stop();

 private:
  // What one handler answers besides the status.
  struct Answer {
    Ticket ticket = 0;
    uint64_t value = 0;
    std::vector<uint8_t> payload;
  };
  void serve();
  void handle(const protocol::v2::RequestV2& request);
  // One per opcode, generated from MEMBAR_PROTOCOL_OPCODES (Note [One opcode table]).
#define MEMBAR_OPCODE_HANDLER(Name, number, text, range, flags, payload, argument) \
  Status handle_##Name(const protocol::v2::RequestV2& request, Answer& answer);
  MEMBAR_PROTOCOL_OPCODES(MEMBAR_OPCODE_HANDLER)
#undef MEMBAR_OPCODE_HANDLER
  Status grant_channel(Result<ChannelGrant> grant, bool created, Answer& answer);
  bool post(const protocol::v2::CompletionV2& completion);
  void complete_error(const protocol::v2::RequestV2& request, const Status& status);
  // Copies `bytes` to the response area; false when it does not fit.
  bool write_response(std::span<const uint8_t> bytes);

  Engine& engine_;
  ClientId client_;
  std::shared_ptr<SharedSegment> segment_;
  std::shared_ptr<SessionChannel> channel_;
  RingServerConfig config_;
  std::function<void(std::string)> on_protocol_violation_;
  protocol::RingEnd<protocol::v2::RequestV2> requests_;
  protocol::RingEnd<protocol::v2::CompletionV2> completions_;
  std::vector<uint8_t> request_payload_;  // the request's payload, copied out of the segment
  // A schedule arriving in parts (Note [A schedule in parts]): the steps so far and their bytes.
  std::vector<ScheduleStep> schedule_parts_;
  uint64_t schedule_part_bytes_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace membar::runtimed
