// Framed protocol-v2 messages over a Unix stream socket, with file descriptors passed beside
// them (SCM_RIGHTS). Shared by the daemon (runtimed/daemon/) and the client library.
// Not thread-safe: a MessageAssembler belongs to one reader; senders serialise writes to one
// socket themselves.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <vector>

#include "membar/common/fd.h"
#include "membar/protocol/v2.h"
#include "membar/status.h"

namespace membar::wire {

using membar::UniqueFd;  // the one fd owner (membar/common/fd.h)

// Writes all of `bytes` (one encoded message) to a blocking or non-blocking socket, with `fds`
// attached to the first byte. Waits for buffer space at most timeout_ms in total; UNAVAILABLE
// when the peer is gone, DEADLINE_EXCEEDED when it does not read. For clients: the daemon never
// waits on a peer (send_some).
Status send_message(int socket_fd, std::span<const uint8_t> bytes, std::span<const int> fds = {},
                    int timeout_ms = 5000);

// Writes what the socket takes now, without waiting: the number of bytes written (0 when its
// buffer is full), `fds` attached to the first byte (sent only when at least one byte is).
// UNAVAILABLE when the peer is gone.
Result<size_t> send_some(int socket_fd, std::span<const uint8_t> bytes, std::span<const int> fds = {});

struct ReceivedMessage {
  protocol::v2::MessageHeaderV2 header{};
  std::vector<uint8_t> payload;
  std::vector<UniqueFd> fds;  // header.fd_count of them
};

// Splits a byte stream into messages and pairs them with the fds that arrived beside them.
class MessageAssembler {
 public:
  // Bytes (and fds) read from the socket, in arrival order.
  void append(std::span<const uint8_t> bytes);
  void append_fd(int fd) { fds_.emplace_back(fd); }
  // Reads what the socket has without blocking. OK(false) when nothing was there, OK(true) when
  // something was read, UNAVAILABLE on end of stream or a socket error. At most `max_bytes`
  // are read per call (a flood must not starve the daemon's loop).
  Result<bool> read_available(int socket_fd, size_t max_bytes = SIZE_MAX);
  // The next complete message; nullopt when more bytes are needed; an error when the stream is
  // malformed (the connection must then be closed).
  Result<std::optional<ReceivedMessage>> next();
  // Bytes received but not yet returned as messages (a peer may not make this grow unbounded).
  size_t pending_bytes() const { return buffer_.size() - consumed_; }
  // Descriptors received and not yet paired with a message.
  size_t pending_fds() const { return fds_.size(); }

 private:
  std::vector<uint8_t> buffer_;
  size_t consumed_ = 0;
  std::deque<UniqueFd> fds_;
};

}  // namespace membar::wire
