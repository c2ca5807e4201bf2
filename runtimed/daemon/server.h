// membard's server: a libuv loop on the control socket, one Session per connection, an optional
// Prometheus endpoint on loopback. No global server object: main.cpp (or a test) owns a Server.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "membar/engine/engine.h"
#include "membar/status.h"

namespace membar::runtimed {

struct ServerConfig {
  std::string socket_path;
  // 0600 by default; 0660 lets the socket's group connect (uids are still checked).
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
  // CUDA device of the GPU tier, told to clients so they map frames on the same device.
  int device = 0;
};

class Server {
 public:
  // Binds the socket (and the Prometheus port). Does not serve until run().
  static Result<std::unique_ptr<Server>> create(const ServerConfig& config, std::unique_ptr<Engine> engine);
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
