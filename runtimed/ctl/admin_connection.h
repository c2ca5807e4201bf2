// membarctl's connection to membard: the admin role of protocol v2 (stats and ping over the
// control socket; no engine client, no segment, no frames).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "membar/status.h"
#include "membar/types.h"
#include "membar/common/wire_socket.h"

namespace membar::ctl {

class AdminConnection {
 public:
  // Connects and completes the admin handshake. Blocks at most timeout_ms.
  static Result<std::unique_ptr<AdminConnection>> open(const std::string& socket_path, int timeout_ms = 5000);

  // Every client and space of the daemon. Blocks (one round trip per 4096 spaces).
  Result<RuntimeStats> stats();
  // One ping round trip; returns its duration in nanoseconds.
  Result<uint64_t> ping();
  std::string backend() const { return backend_; }

 private:
  AdminConnection() = default;
  Result<wire::ReceivedMessage> read_message(uint16_t expected_type);

  std::string socket_path_;
  std::string backend_;
  int timeout_ms_ = 5000;
  wire::UniqueFd socket_;
  wire::MessageAssembler assembler_;
  uint64_t next_nonce_ = 1;
};

}  // namespace membar::ctl
