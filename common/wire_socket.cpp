#include "membar/common/wire_socket.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "membar/protocol/ring.h"

namespace membar::wire {

Status send_message(int socket_fd, std::span<const uint8_t> bytes, int fd_to_pass, int timeout_ms) {
  size_t sent = 0;
  uint64_t deadline = protocol::monotonic_ns() + uint64_t(timeout_ms) * 1000000ull;
  while (sent < bytes.size()) {
    iovec iov{const_cast<uint8_t*>(bytes.data() + sent), bytes.size() - sent};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    if (sent == 0 && fd_to_pass >= 0) {
      std::memset(control, 0, sizeof(control));
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
      cmsg->cmsg_level = SOL_SOCKET;
      cmsg->cmsg_type = SCM_RIGHTS;
      cmsg->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(cmsg), &fd_to_pass, sizeof(int));
    }
    ssize_t n = ::sendmsg(socket_fd, &msg, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    // ETOOMANYREFS: the sender's uid has too many fds in flight (RLIMIT_NOFILE); they drain as
    // the peer reads, exactly like a full buffer.
    if (n < 0 && errno == ETOOMANYREFS) {
      if (protocol::monotonic_ns() >= deadline) {
        return {StatusCode::DEADLINE_EXCEEDED, "peer did not take its file descriptors for " + std::to_string(timeout_ms) + " ms"};
      }
      ::usleep(1000);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      uint64_t now = protocol::monotonic_ns();
      if (now >= deadline) return {StatusCode::DEADLINE_EXCEEDED, "peer did not read its socket for " + std::to_string(timeout_ms) + " ms"};
      pollfd p{socket_fd, POLLOUT, 0};
      ::poll(&p, 1, static_cast<int>((deadline - now) / 1000000ull) + 1);
      continue;
    }
    return unavailable(std::string("socket send failed: ") + std::strerror(errno));
  }
  return Status::Ok();
}

void MessageAssembler::append(std::span<const uint8_t> bytes) {
  buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
}

Result<bool> MessageAssembler::read_available(int socket_fd) {
  bool any = false;
  for (;;) {
    uint8_t data[16384];
    iovec iov{data, sizeof(data)};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = ::recvmsg(socket_fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return any;
    if (n < 0) return unavailable(std::string("socket receive failed: ") + std::strerror(errno));
    for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
      if (cmsg->cmsg_level == SOL_SOCKET && cmsg->cmsg_type == SCM_RIGHTS) {
        size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(cmsg) + i * sizeof(int), sizeof(int));
          append_fd(fd);
        }
      }
    }
    if (n == 0) return unavailable("the peer closed the connection");
    append(std::span<const uint8_t>(data, static_cast<size_t>(n)));
    any = true;
  }
}

Result<std::optional<ReceivedMessage>> MessageAssembler::next() {
  std::span<const uint8_t> pending(buffer_.data() + consumed_, buffer_.size() - consumed_);
  if (pending.size() < sizeof(protocol::v1::MessageHeaderV1)) return std::optional<ReceivedMessage>();
  MEMBAR_ASSIGN_OR_RETURN(auto header, protocol::v1::decode_message_header(pending));
  if (pending.size() < sizeof(header) + header.payload_bytes) return std::optional<ReceivedMessage>();
  ReceivedMessage message;
  message.header = header;
  message.payload.assign(pending.begin() + sizeof(header), pending.begin() + sizeof(header) + header.payload_bytes);
  if (header.fd_count == 1) {
    if (fds_.empty()) return invalid_argument("a message announced a file descriptor that did not arrive");
    message.fd = std::move(fds_.front());
    fds_.pop_front();
  }
  consumed_ += sizeof(header) + header.payload_bytes;
  if (consumed_ == buffer_.size()) {
    buffer_.clear();
    consumed_ = 0;
  } else if (consumed_ > (1u << 20)) {
    buffer_.erase(buffer_.begin(), buffer_.begin() + static_cast<ptrdiff_t>(consumed_));
    consumed_ = 0;
  }
  return std::optional<ReceivedMessage>(std::move(message));
}

}  // namespace membar::wire
