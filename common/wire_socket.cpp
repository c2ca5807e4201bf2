#include "membar/common/wire_socket.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "membar/protocol/ring.h"

namespace membar::wire {

namespace {

// One sendmsg with `fds` in its control data; -1 with errno on failure.
ssize_t send_with_fds(int socket_fd, const uint8_t* data, size_t bytes, std::span<const int> fds, int flags) {
  iovec iov{const_cast<uint8_t*>(data), bytes};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * protocol::v2::kMaxMessageFds)];
  if (!fds.empty()) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  return ::sendmsg(socket_fd, &msg, MSG_NOSIGNAL | flags);
}

}  // namespace

Status send_message(int socket_fd, std::span<const uint8_t> bytes, std::span<const int> fds, int timeout_ms) {
  if (fds.size() > protocol::v2::kMaxMessageFds) return invalid_argument("too many descriptors for one message");
  size_t sent = 0;
  uint64_t deadline = protocol::monotonic_ns() + uint64_t(timeout_ms) * 1000000ull;
  while (sent < bytes.size()) {
    ssize_t n = send_with_fds(socket_fd, bytes.data() + sent, bytes.size() - sent,
                              sent == 0 ? fds : std::span<const int>(), 0);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    // ETOOMANYREFS: the sender's uid has too many fds in flight (RLIMIT_NOFILE); they drain as
    // the peer reads, exactly like a full buffer.
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == ETOOMANYREFS)) {
      uint64_t now = protocol::monotonic_ns();
      if (now >= deadline) {
        return {StatusCode::DEADLINE_EXCEEDED, "peer did not read its socket for " + std::to_string(timeout_ms) + " ms"};
      }
      if (errno == ETOOMANYREFS) {
        ::usleep(1000);
      } else {
        pollfd p{socket_fd, POLLOUT, 0};
        ::poll(&p, 1, static_cast<int>((deadline - now) / 1000000ull) + 1);
      }
      continue;
    }
    return unavailable(std::string("socket send failed: ") + std::strerror(errno));
  }
  return Status::Ok();
}

Result<size_t> send_some(int socket_fd, std::span<const uint8_t> bytes, std::span<const int> fds) {
  if (fds.size() > protocol::v2::kMaxMessageFds) return invalid_argument("too many descriptors for one message");
  for (;;) {
    ssize_t n = send_with_fds(socket_fd, bytes.data(), bytes.size(), fds, MSG_DONTWAIT);
    if (n >= 0) return static_cast<size_t>(n);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ETOOMANYREFS) return size_t{0};
    return unavailable(std::string("socket send failed: ") + std::strerror(errno));
  }
}

void MessageAssembler::append(std::span<const uint8_t> bytes) {
  buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
}

Result<bool> MessageAssembler::read_available(int socket_fd, size_t max_bytes) {
  bool any = false;
  size_t total = 0;
  for (;;) {
    if (total >= max_bytes) return any;
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
    total += static_cast<size_t>(n);
    any = true;
  }
}

Result<std::optional<ReceivedMessage>> MessageAssembler::next() {
  std::span<const uint8_t> pending(buffer_.data() + consumed_, buffer_.size() - consumed_);
  if (pending.size() < sizeof(protocol::v2::MessageHeaderV2)) return std::optional<ReceivedMessage>();
  MEMBAR_ASSIGN_OR_RETURN(auto header, protocol::v2::decode_message_header(pending));
  if (pending.size() < sizeof(header) + header.payload_bytes) return std::optional<ReceivedMessage>();
  ReceivedMessage message;
  message.header = header;
  message.payload.assign(pending.begin() + sizeof(header), pending.begin() + sizeof(header) + header.payload_bytes);
  if (fds_.size() < header.fd_count) {
    return invalid_argument("a message announced " + std::to_string(header.fd_count) +
                            " file descriptors that did not arrive");
  }
  for (uint32_t i = 0; i < header.fd_count; ++i) {
    message.fds.push_back(std::move(fds_.front()));
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
