// membard's server: a libuv loop on the control socket, one Session per connection, an optional
// Prometheus endpoint on loopback. No global server object: main.cpp (or a test) owns a Server.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "membar/engine/engine.h"
#include "membar/status.h"
#include "session.h"

namespace membar::runtimed {

// Note [Service limits]
// What one peer may make membard hold, and how long it may take. Every limit hit is answered
// with a clear error to that peer and logged (at most one line per limit every 10 s, with the
// count of the others), and never costs other peers anything.
struct ServerConfig {
  std::string socket_path;
  // 0600 by default (only the daemon's user and root). With allowed_uids the socket is made
  // 0666 and the uid check (SO_PEERCRED) alone decides who may connect.
  uint32_t socket_mode = 0600;
  // Besides the daemon's own uid and root, the uids that may connect (SO_PEERCRED).
  std::vector<uint32_t> allowed_uids;
  // Prometheus text endpoint on 127.0.0.1; -1: off, 0: an ephemeral port (see prometheus_port()).
  int prometheus_port = -1;
  // Shared-memory rings and payload areas of each client.
  uint32_t ring_capacity = 64;
  uint64_t request_payload_bytes = 1ull << 20;
  uint64_t response_payload_bytes = 4ull << 20;
  // How long a ring thread spins on an empty ring before sleeping on its doorbell.
  uint32_t ring_spin_us = 50;
  // Install SIGTERM / SIGINT handlers that shut the server down.
  bool handle_signals = true;
  // Connections at once (trainers and membarctl); more are refused with an error.
  uint32_t max_connections = 256;
  // A peer must say hello within this; an admin connection may stay idle this long.
  uint32_t handshake_timeout_ms = 5000;
  uint32_t admin_idle_timeout_ms = 60000;
  // Each peer's queue of messages its socket has not taken yet (Note [Writes never block the
  // daemon]).
  OutboundLimits outbound;
};

// One device the daemon serves: its CUDA ordinal (told to its clients, so they map frames on the
// same device; a label on the host backend) and the engine of its pools. Engines of different
// devices share nothing but the channel registry (Note [Devices of one daemon] in
// membar/protocol/v2.h); their client ids must not overlap (EngineConfig::first_client_id).
struct ServedDevice {
  int device = 0;
  std::unique_ptr<Engine> engine;
};

class Server {
 public:
  // Binds the socket (and the Prometheus port). Does not serve until run(). `devices`: at least
  // one, distinct ordinals below protocol::v2::kMaxDevices; the first serves peers that name none.
  static Result<std::unique_ptr<Server>> create(const ServerConfig& config, std::vector<ServedDevice> devices);
  virtual ~Server() = default;

  // Serves until a signal or request_stop; then tells every client, closes them and returns.
  // Blocks; call from one thread.
  virtual Status run() = 0;
  // Thread-safe and async-signal-unsafe: asks run() to shut down.
  virtual void request_stop(const std::string& reason) = 0;
  // The bound Prometheus port (after create), -1 when off.
  virtual int prometheus_port() const = 0;
};

}  // namespace membar::runtimed
