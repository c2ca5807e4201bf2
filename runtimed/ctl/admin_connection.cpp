#include "admin_connection.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "membar/protocol/ring.h"
#include "membar/protocol/v2.h"

namespace membar::ctl {

namespace v2 = protocol::v2;

Result<std::unique_ptr<AdminConnection>> AdminConnection::open(const std::string& socket_path, int device,
                                                               int timeout_ms) {
  if (device < -1 || device >= static_cast<int>(v2::kMaxDevices)) {
    return invalid_argument("device " + std::to_string(device) + " is not in 0.." + std::to_string(v2::kMaxDevices - 1));
  }
  std::unique_ptr<AdminConnection> connection(new AdminConnection());
  connection->socket_path_ = socket_path;
  connection->timeout_ms_ = timeout_ms;
  sockaddr_un address{};
  if (socket_path.empty() || socket_path.size() >= sizeof(address.sun_path)) {
    return invalid_argument("socket path '" + socket_path + "' is empty or too long");
  }
  connection->socket_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket_path.data(), socket_path.size());
  if (::connect(connection->socket_.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    return unavailable("no membard answers at " + socket_path + ": " + std::strerror(errno));
  }
  v2::HelloV2 hello{};
  hello.role = static_cast<uint32_t>(v2::Role::kAdmin);
  hello.device_plus_one = static_cast<uint32_t>(device + 1);
  v2::copy_text(hello.client_name, sizeof(hello.client_name), "membarctl");
  // A refusing daemon may close before the hello is sent: read its error either way.
  Status sent = wire::send_message(connection->socket_.get(), v2::encode_message(v2::MessageType::kHello, hello));
  Result<wire::ReceivedMessage> answered =
      connection->read_message(static_cast<uint16_t>(v2::MessageType::kHelloReply));
  if (!sent.ok() && !answered.ok() && answered.status().code() == StatusCode::UNAVAILABLE) return sent;
  MEMBAR_ASSIGN_OR_RETURN(wire::ReceivedMessage message, std::move(answered));
  MEMBAR_ASSIGN_OR_RETURN(v2::HelloReplyV2 reply, v2::decode_hello_reply(message.payload));
  if (reply.status != 0) {
    return Status(static_cast<StatusCode>(reply.status), std::string("membard refused: ") + reply.message);
  }
  connection->backend_ = reply.backend == static_cast<uint8_t>(v2::WireBackend::kCuda) ? "cuda" : "host";
  connection->device_ = reply.device;
  connection->device_mask_ = reply.device_mask;
  return connection;
}

std::vector<int> AdminConnection::daemon_devices() const {
  // A daemon that predates device_mask serves one device: this one.
  if (device_mask_ == 0) return {device_};
  std::vector<int> devices;
  for (int device = 0; device < static_cast<int>(v2::kMaxDevices); ++device) {
    if ((device_mask_ >> device) & 1u) devices.push_back(device);
  }
  return devices;
}

Result<NodeAdmin> NodeAdmin::open(const std::string& socket_path) {
  NodeAdmin node;
  MEMBAR_ASSIGN_OR_RETURN(std::unique_ptr<AdminConnection> first, AdminConnection::open(socket_path));
  std::vector<int> devices = first->daemon_devices();
  int first_device = first->device();
  node.connections_.push_back(std::move(first));
  for (int device : devices) {
    if (device == first_device) continue;
    MEMBAR_ASSIGN_OR_RETURN(std::unique_ptr<AdminConnection> other, AdminConnection::open(socket_path, device));
    node.connections_.push_back(std::move(other));
  }
  return node;
}

Result<std::vector<DeviceRuntimeStats>> NodeAdmin::stats() {
  std::vector<DeviceRuntimeStats> devices;
  for (const std::unique_ptr<AdminConnection>& connection : connections_) {
    MEMBAR_ASSIGN_OR_RETURN(RuntimeStats stats, connection->stats());
    devices.push_back({connection->device(), std::move(stats)});
  }
  return devices;
}

Result<wire::ReceivedMessage> AdminConnection::read_message(uint16_t expected_type) {
  uint64_t deadline = protocol::monotonic_ns() + uint64_t(timeout_ms_) * 1000000ull;
  for (;;) {
    MEMBAR_ASSIGN_OR_RETURN(std::optional<wire::ReceivedMessage> next, assembler_.next());
    if (next.has_value()) {
      if (next->header.type == expected_type) return std::move(*next);
      if (next->header.type == static_cast<uint16_t>(v2::MessageType::kError)) {
        MEMBAR_ASSIGN_OR_RETURN(v2::ErrorV2 error, v2::decode_error(next->payload));
        return Status(static_cast<StatusCode>(error.status), std::string("membard: ") + error.message);
      }
      if (next->header.type == static_cast<uint16_t>(v2::MessageType::kShutdown)) {
        return unavailable("membard at " + socket_path_ + " is shutting down");
      }
      continue;
    }
    uint64_t now = protocol::monotonic_ns();
    if (now > deadline) {
      return Status(StatusCode::DEADLINE_EXCEEDED, "membard did not answer within " + std::to_string(timeout_ms_) + " ms");
    }
    pollfd p{socket_.get(), POLLIN, 0};
    ::poll(&p, 1, static_cast<int>((deadline - now) / 1000000) + 1);
    Result<bool> read = assembler_.read_available(socket_.get());
    if (!read.ok()) {
      MEMBAR_ASSIGN_OR_RETURN(std::optional<wire::ReceivedMessage> last, assembler_.next());
      if (last.has_value() && last->header.type == static_cast<uint16_t>(v2::MessageType::kError)) {
        MEMBAR_ASSIGN_OR_RETURN(v2::ErrorV2 error, v2::decode_error(last->payload));
        return Status(static_cast<StatusCode>(error.status), std::string("membard: ") + error.message);
      }
      if (last.has_value() && last->header.type == expected_type) return std::move(*last);
      return unavailable("membard at " + socket_path_ + " closed the connection");
    }
  }
}

Result<RuntimeStats> AdminConnection::stats() {
  // Spaces come in pages (a daemon with 60,000 spaces answers in 15 replies, none over 4 MiB).
  RuntimeStats all;
  for (uint32_t first = 0;;) {
    v2::StatsRequestV2 request{first, v2::kMaxStatsSpaces};
    MEMBAR_RETURN_IF_ERROR(wire::send_message(socket_.get(), v2::encode_message(v2::MessageType::kStatsRequest, request)));
    MEMBAR_ASSIGN_OR_RETURN(wire::ReceivedMessage reply,
                            read_message(static_cast<uint16_t>(v2::MessageType::kStatsReply)));
    MEMBAR_ASSIGN_OR_RETURN(RuntimeStats page, v2::decode_stats(reply.payload));
    bool empty_page = page.spaces.empty();  // read before `page` is moved from
    if (first == 0) {
      all = std::move(page);
    } else {
      all.spaces.insert(all.spaces.end(), page.spaces.begin(), page.spaces.end());
      all.spaces_total = page.spaces_total;
    }
    first = static_cast<uint32_t>(all.spaces.size());
    // Done when every space is here, or when the daemon has no more (spaces went meanwhile).
    if (first >= all.spaces_total || empty_page) break;
    if (all.spaces.size() >= 1000000) break;  // a bound on what membarctl holds
  }
  return all;
}

Result<uint64_t> AdminConnection::ping() {
  v2::PingV2 ping{next_nonce_++};
  uint64_t start = protocol::monotonic_ns();
  MEMBAR_RETURN_IF_ERROR(wire::send_message(socket_.get(), v2::encode_message(v2::MessageType::kPing, ping)));
  MEMBAR_ASSIGN_OR_RETURN(wire::ReceivedMessage reply, read_message(static_cast<uint16_t>(v2::MessageType::kPong)));
  MEMBAR_ASSIGN_OR_RETURN(v2::PingV2 pong, v2::decode_ping(reply.payload));
  if (pong.nonce != ping.nonce) return internal_error("membard answered a different ping");
  return protocol::monotonic_ns() - start;
}

}  // namespace membar::ctl
