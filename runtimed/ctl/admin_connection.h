// membarctl's connection to membard: the admin role of protocol v2 (stats and ping over the
// control socket; no engine client, no segment, no frames).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "membar/status.h"
#include "membar/types.h"
#include "membar/common/wire_socket.h"

namespace membar::ctl {

class AdminConnection {
 public:
  // Connects and completes the admin handshake for one device of the daemon (`device`: its CUDA
  // ordinal; -1: the daemon's first device). Blocks at most timeout_ms.
  static Result<std::unique_ptr<AdminConnection>> open(const std::string& socket_path, int device = -1,
                                                       int timeout_ms = 5000);

  // Every client and space of this connection's device. Blocks (one round trip per 4096 spaces).
  Result<RuntimeStats> stats();
  // One ping round trip; returns its duration in nanoseconds.
  Result<uint64_t> ping();
  std::string backend() const { return backend_; }
  // The device this connection reports, and every device of the daemon (ascending).
  int device() const { return device_; }
  std::vector<int> daemon_devices() const;

 private:
  AdminConnection() = default;
  Result<wire::ReceivedMessage> read_message(uint16_t expected_type);

  std::string socket_path_;
  std::string backend_;
  int device_ = 0;
  uint32_t device_mask_ = 0;
  int timeout_ms_ = 5000;
  wire::UniqueFd socket_;
  wire::MessageAssembler assembler_;
  uint64_t next_nonce_ = 1;
};

// Every device of a daemon: one admin connection each (Note [Devices of one daemon] in
// membar/protocol/v2.h), opened once and kept (membarctl top asks every second).
class NodeAdmin {
 public:
  // Connects to the daemon's first device, learns its devices, and connects to each other one.
  static Result<NodeAdmin> open(const std::string& socket_path);
  // Each device's stats, the daemon's first device first. Blocks.
  Result<std::vector<DeviceRuntimeStats>> stats();
  AdminConnection& first() { return *connections_.front(); }

 private:
  std::vector<std::unique_ptr<AdminConnection>> connections_;
};

}  // namespace membar::ctl
