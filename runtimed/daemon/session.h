// One connection of membard: its socket channel (shared with the engine's event callbacks) and,
// for trainer clients, the ring-serving thread that runs its requests against the Engine.
// See Note [Two channels] in membar/protocol/v1.h.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <type_traits>

#include "membar/engine/channels.h"
#include "membar/engine/engine.h"
#include "membar/protocol/ring.h"
#include "membar/protocol/v1.h"
#include "shared_segment.h"
#include "membar/common/wire_socket.h"

namespace membar::runtimed {

// What the engine's callbacks (any thread) and the ring thread need to reach a client. Lives
// until the last callback holding it is gone, so a late callback never touches freed memory:
// after close() it drops what it is given.
class SessionChannel {
 public:
  explicit SessionChannel(int socket_fd_duplicate) : socket_(socket_fd_duplicate) {}

  // Sends one message (and passes `fd_to_pass`, which stays the caller's). Serialised.
  Status send(protocol::v1::MessageType type, std::span<const uint8_t> payload, int fd_to_pass = -1);
  template <typename T>
    requires std::is_trivially_copyable_v<T>
  Status send(protocol::v1::MessageType type, const T& payload, int fd_to_pass = -1) {
    return send(type, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(&payload), sizeof(T)), fd_to_pass);
  }

  void set_segment(std::shared_ptr<SharedSegment> segment);
  // Publishes the client's completed ticket in its segment and wakes it if it sleeps.
  void publish_completed(Ticket completed);
  // Marks the segment "daemon shutting down" and wakes a sleeping client.
  void publish_shutdown();
  // After close, sends fail quietly and the socket duplicate is closed.
  void close();

 private:
  // Two locks, so a send blocked on a client that stopped reading (up to send_message's
  // timeout) never delays publishing completions, which the engine's shared dispatcher does.
  std::mutex send_mutex_;   // guards socket_ and closed_
  wire::UniqueFd socket_;
  bool closed_ = false;
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
  void serve();
  void handle(const protocol::v1::RequestV1& request);
  bool post(const protocol::v1::CompletionV1& completion);
  void complete_error(const protocol::v1::RequestV1& request, const Status& status);
  // Copies `bytes` to the response area; false when it does not fit.
  bool write_response(std::span<const uint8_t> bytes);

  Engine& engine_;
  ClientId client_;
  std::shared_ptr<SharedSegment> segment_;
  std::shared_ptr<SessionChannel> channel_;
  RingServerConfig config_;
  std::function<void(std::string)> on_protocol_violation_;
  protocol::RingEnd<protocol::v1::RequestV1> requests_;
  protocol::RingEnd<protocol::v1::CompletionV1> completions_;
  std::vector<uint8_t> request_payload_;  // the request's payload, copied out of the segment
  std::atomic<bool> stopping_{false};
  std::thread thread_;
};

}  // namespace membar::runtimed
