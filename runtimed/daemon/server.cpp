// membard's libuv loop: control socket, handshakes, admin requests, limits, Prometheus,
// shutdown.
//
// Threads: the loop thread owns every Connection and every libuv handle, and never blocks on a
// peer (Note [Writes never block the daemon] in session.h). Each trainer client also has a ring
// thread (session.cpp) that runs its requests; the engine's callbacks may run on any thread and
// reach the client only through its SessionChannel. The only ways into the loop from other
// threads are uv_async_send on `wakeup_` (stop requests, protocol violations, output to flush,
// overflowing peers), each naming the connection by id.
#include "server.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <uv.h>

#include <spdlog/spdlog.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "prometheus.h"
#include "session.h"

namespace membar::runtimed {
namespace {

namespace v2 = protocol::v2;

// The peer's handshake and admin messages are small; more unread bytes than this is abuse.
constexpr size_t kMaxPendingBytes = 64 * 1024;
// Bytes read from one peer per loop iteration: a flood must not starve the others.
constexpr size_t kReadBudget = 256 * 1024;

std::string uv_error_text(int code) { return std::string(uv_err_name(code)) + " (" + uv_strerror(code) + ")"; }

// True when something accepts connections at `path` (another membard).
bool socket_answers(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  bool answers = ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  ::close(fd);
  return answers;
}

// At most one log line per kind every 10 s; the others are counted and reported with the next.
class RateLimitedLog {
 public:
  template <typename... Args>
  void warn(fmt::format_string<Args...> format, Args&&... args) {
    uint64_t now = protocol::monotonic_ns();
    if (last_ns_ != 0 && now - last_ns_ < 10'000'000'000ull) {
      ++suppressed_;
      return;
    }
    std::string text = fmt::format(format, std::forward<Args>(args)...);
    if (suppressed_ > 0) text += fmt::format(" ({} more like this since the last line)", suppressed_);
    spdlog::warn("{}", text);
    last_ns_ = now;
    suppressed_ = 0;
  }

 private:
  uint64_t last_ns_ = 0;
  uint64_t suppressed_ = 0;
};

class ServerImpl;

struct Connection {
  enum class State { kAwaitHello, kServing, kAdmin, kClosing };

  uint64_t id = 0;
  ServerImpl* server = nullptr;
  uv_poll_t poll{};
  int poll_events = 0;
  wire::MessageAssembler assembler;
  std::shared_ptr<SessionChannel> channel;
  State state = State::kAwaitHello;
  uint32_t uid = 0;
  int32_t pid = 0;
  bool client_open = false;
  ServedDevice* device = nullptr;  // chosen by the hello; its engine holds `client`
  ClientId client = 0;
  std::string client_name;
  std::shared_ptr<SharedSegment> segment;
  std::unique_ptr<RingServer> ring;
  uint64_t accepted_ns = 0;
  uint64_t last_activity_ns = 0;
  // Set by the ring thread; the loop closes the connection on its next wake-up.
  std::atomic<bool> violated{false};
  std::mutex violation_mutex;
  std::string violation_reason;
};

struct HttpConnection {
  uv_tcp_t tcp{};
  uv_write_t write{};
  std::string request;
  std::string response;
  bool responded = false;
};

class ServerImpl final : public Server {
 public:
  ServerImpl(const ServerConfig& config, std::vector<ServedDevice> devices)
      : config_(config), devices_(std::move(devices)) {}
  ~ServerImpl() override;

  Status start();
  Status run() override;
  void request_stop(const std::string& reason) override;
  int prometheus_port() const override { return bound_prometheus_port_; }

 private:
  static void on_connection(uv_stream_t* listener, int status);
  static void on_poll(uv_poll_t* handle, int status, int events);
  static void on_wakeup(uv_async_t* handle);
  static void on_timer(uv_timer_t* handle);
  static void on_signal(uv_signal_t* handle, int signal_number);
  static void on_http_connection(uv_stream_t* listener, int status);
  static void on_http_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buffer);

  void accept_peer(int fd);
  void read_from(Connection& connection);
  void write_to(Connection& connection);
  void set_poll_events(Connection& connection, int events);
  // From any thread: the loop should look at this connection (output queued, overflow, violation).
  void attention(uint64_t id);
  void handle_message(Connection& connection, wire::ReceivedMessage& message);
  void handle_hello(Connection& connection, const v2::HelloV2& hello);
  // The device a hello names (device_plus_one; 0: the first), or NOT_FOUND saying which are served.
  Result<ServedDevice*> device_for(uint32_t device_plus_one);
  std::string devices_text() const;
  void fail_connection(Connection& connection, const Status& status);
  void close_connection(Connection& connection, const std::string& reason);
  void shutdown(const std::string& reason);
  void respond_http(HttpConnection& http);
  void close_handle(uv_handle_t* handle);

  ServerConfig config_;
  std::vector<ServedDevice> devices_;  // never resized after create: connections point into it
  uint32_t device_mask_ = 0;           // bit d: device d is served (the hello reply's device_mask)
  // One registry for every device: a trainer on one GPU publishes to readers on the others
  // (client ids are unique across the engines). Note [Channels]
  ChannelRegistry channels_;
  uv_loop_t loop_{};
  uv_pipe_t listener_{};
  uv_async_t wakeup_{};
  uv_timer_t timer_{};
  uv_signal_t sigterm_{};
  uv_signal_t sigint_{};
  uv_tcp_t prometheus_{};
  bool loop_ready_ = false;
  bool listener_initialized_ = false;
  bool listening_ = false;
  bool timer_initialized_ = false;
  bool signals_initialized_ = false;
  bool prometheus_open_ = false;
  bool shutting_down_ = false;
  int bound_prometheus_port_ = -1;
  uint64_t next_connection_id_ = 1;
  std::map<uint64_t, std::unique_ptr<Connection>> connections_;
  RateLimitedLog limit_log_, refused_log_, dropped_log_, timeout_log_;

  std::mutex stop_mutex_;  // guards the stop request, the attention list and wakeup_closed_
  bool stop_requested_ = false;
  bool wakeup_closed_ = false;
  std::string stop_reason_;
  std::set<uint64_t> attention_;
};

ServerImpl::~ServerImpl() {
  if (loop_ready_) {
    // run() was never called or returned early: close what is still open and drain the loop.
    if (!shutting_down_) shutdown("server destroyed");
    uv_run(&loop_, UV_RUN_DEFAULT);
    uv_loop_close(&loop_);
  }
}

void ServerImpl::close_handle(uv_handle_t* handle) {
  if (!uv_is_closing(handle)) uv_close(handle, nullptr);
}

Result<ServedDevice*> ServerImpl::device_for(uint32_t device_plus_one) {
  if (device_plus_one == 0) return &devices_.front();
  for (ServedDevice& served : devices_) {
    if (uint32_t(served.device) + 1 == device_plus_one) return &served;
  }
  return not_found("this membard serves device" + std::string(devices_.size() > 1 ? "s " : " ") + devices_text() +
                   "; not " + std::to_string(device_plus_one - 1));
}

std::string ServerImpl::devices_text() const {
  std::string text;
  for (const ServedDevice& served : devices_) text += (text.empty() ? "" : ", ") + std::to_string(served.device);
  return text;
}

Status ServerImpl::start() {
  if (devices_.empty()) return invalid_argument("membard needs at least one device");
  for (const ServedDevice& served : devices_) {
    if (!served.engine) return invalid_argument("device " + std::to_string(served.device) + " has no engine");
    if (served.device < 0 || served.device >= static_cast<int>(v2::kMaxDevices)) {
      return invalid_argument("device " + std::to_string(served.device) + " is not in 0.." +
                              std::to_string(v2::kMaxDevices - 1));
    }
    uint32_t bit = 1u << served.device;
    if ((device_mask_ & bit) != 0) return invalid_argument("device " + std::to_string(served.device) + " is given twice");
    device_mask_ |= bit;
  }
  int rc = uv_loop_init(&loop_);
  if (rc != 0) return internal_error("uv_loop_init failed: " + uv_error_text(rc));
  loop_ready_ = true;
  uv_async_init(&loop_, &wakeup_, &ServerImpl::on_wakeup);
  wakeup_.data = this;

  if (config_.socket_path.empty() || config_.socket_path.size() >= sizeof(sockaddr_un::sun_path)) {
    return invalid_argument("socket path must be 1.." + std::to_string(sizeof(sockaddr_un::sun_path) - 1) +
                            " bytes: '" + config_.socket_path + "'");
  }
  // The socket's directory (/run/membar) is made if missing; systemd's RuntimeDirectory usually has.
  size_t slash = config_.socket_path.rfind('/');
  if (slash != std::string::npos && slash > 0) {
    std::string parent = config_.socket_path.substr(0, slash);
    struct stat parent_info {};
    if (::stat(parent.c_str(), &parent_info) != 0 && ::mkdir(parent.c_str(), 0755) != 0) {
      return unavailable("cannot create the socket directory " + parent + ": " + std::strerror(errno));
    }
  }
  struct stat existing {};
  if (::lstat(config_.socket_path.c_str(), &existing) == 0) {
    if (!S_ISSOCK(existing.st_mode)) {
      return already_exists(config_.socket_path + " exists and is not a socket; refusing to replace it");
    }
    if (socket_answers(config_.socket_path)) {
      return already_exists("another daemon already serves " + config_.socket_path);
    }
    ::unlink(config_.socket_path.c_str());  // stale socket of a daemon that died
  }
  uv_pipe_init(&loop_, &listener_, 0);
  listener_.data = this;
  listener_initialized_ = true;
  // Bind with a umask that gives nobody else access before the chmod below sets the mode.
  mode_t previous_umask = ::umask(0177);
  rc = uv_pipe_bind(&listener_, config_.socket_path.c_str());
  ::umask(previous_umask);
  if (rc != 0) return unavailable("cannot bind " + config_.socket_path + ": " + uv_error_text(rc));
  // With --allow-uid the credentials check alone decides: others must be able to connect to
  // be checked at all.
  uint32_t mode = config_.allowed_uids.empty() ? config_.socket_mode : 0666;
  if (::chmod(config_.socket_path.c_str(), mode) != 0) {
    return permission_denied("cannot chmod " + config_.socket_path + ": " + std::strerror(errno));
  }
  rc = uv_listen(reinterpret_cast<uv_stream_t*>(&listener_), 128, &ServerImpl::on_connection);
  if (rc != 0) return unavailable("cannot listen on " + config_.socket_path + ": " + uv_error_text(rc));
  listening_ = true;

  uv_timer_init(&loop_, &timer_);
  timer_.data = this;
  timer_initialized_ = true;
  uv_timer_start(&timer_, &ServerImpl::on_timer, 250, 250);

  if (config_.handle_signals) {
    uv_signal_init(&loop_, &sigterm_);
    uv_signal_init(&loop_, &sigint_);
    signals_initialized_ = true;
    sigterm_.data = sigint_.data = this;
    uv_signal_start(&sigterm_, &ServerImpl::on_signal, SIGTERM);
    uv_signal_start(&sigint_, &ServerImpl::on_signal, SIGINT);
    uv_unref(reinterpret_cast<uv_handle_t*>(&sigterm_));
    uv_unref(reinterpret_cast<uv_handle_t*>(&sigint_));
  }

  if (config_.prometheus_port >= 0) {
    uv_tcp_init(&loop_, &prometheus_);
    prometheus_.data = this;
    prometheus_open_ = true;
    sockaddr_in address{};
    uv_ip4_addr("127.0.0.1", config_.prometheus_port, &address);
    rc = uv_tcp_bind(&prometheus_, reinterpret_cast<const sockaddr*>(&address), 0);
    if (rc == 0) rc = uv_listen(reinterpret_cast<uv_stream_t*>(&prometheus_), 16, &ServerImpl::on_http_connection);
    if (rc != 0) {
      return unavailable("cannot serve Prometheus on 127.0.0.1:" + std::to_string(config_.prometheus_port) + ": " +
                         uv_error_text(rc));
    }
    sockaddr_in bound{};
    int length = sizeof(bound);
    uv_tcp_getsockname(&prometheus_, reinterpret_cast<sockaddr*>(&bound), &length);
    bound_prometheus_port_ = ntohs(bound.sin_port);
    spdlog::info("prometheus metrics on http://127.0.0.1:{}/metrics", bound_prometheus_port_);
  }
  if (config_.allowed_uids.empty()) {
    spdlog::info("membard serving {} (backend {}, device{} {}, socket mode {:o}: the daemon's user and root)",
                 config_.socket_path, devices_.front().engine->backend().name(), devices_.size() > 1 ? "s" : "",
                 devices_text(), mode);
  } else {
    std::string uids;
    for (uint32_t uid : config_.allowed_uids) uids += (uids.empty() ? "" : ",") + std::to_string(uid);
    spdlog::info("membard serving {} (backend {}, device{} {}, socket mode 0666: the daemon's user, root and uids {}; "
                 "others are refused by their credentials)",
                 config_.socket_path, devices_.front().engine->backend().name(), devices_.size() > 1 ? "s" : "",
                 devices_text(), uids);
  }
  spdlog::info("limits: {} connections, hello within {} ms, admin idle {} ms, {} queued bytes and {} descriptors per peer",
               config_.max_connections, config_.handshake_timeout_ms, config_.admin_idle_timeout_ms,
               config_.outbound.max_bytes, config_.outbound.max_fds);
  return Status::Ok();
}

Status ServerImpl::run() {
  uv_run(&loop_, UV_RUN_DEFAULT);
  // Every handle is closed once shutdown() ran; anything left (none expected) is drained here.
  if (!shutting_down_) shutdown("event loop ended");
  uv_run(&loop_, UV_RUN_DEFAULT);
  uv_loop_close(&loop_);
  loop_ready_ = false;
  for (ServedDevice& served : devices_) served.engine->backend().drain();
  spdlog::info("membard stopped");
  return Status::Ok();
}

void ServerImpl::request_stop(const std::string& reason) {
  std::lock_guard<std::mutex> lock(stop_mutex_);
  stop_requested_ = true;
  stop_reason_ = reason;
  if (!wakeup_closed_) uv_async_send(&wakeup_);
}

void ServerImpl::attention(uint64_t id) {
  std::lock_guard<std::mutex> lock(stop_mutex_);
  attention_.insert(id);
  if (!wakeup_closed_) uv_async_send(&wakeup_);
}

void ServerImpl::on_signal(uv_signal_t* handle, int signal_number) {
  auto* self = static_cast<ServerImpl*>(handle->data);
  spdlog::info("received signal {}, shutting down", signal_number);
  self->shutdown(signal_number == SIGTERM ? "membard received SIGTERM" : "membard received SIGINT");
}

void ServerImpl::on_wakeup(uv_async_t* handle) {
  auto* self = static_cast<ServerImpl*>(handle->data);
  std::string reason;
  bool stop = false;
  std::set<uint64_t> ids;
  {
    std::lock_guard<std::mutex> lock(self->stop_mutex_);
    stop = self->stop_requested_;
    reason = self->stop_reason_;
    ids.swap(self->attention_);
  }
  if (stop) {
    self->shutdown(reason);
    return;
  }
  for (uint64_t id : ids) {
    auto it = self->connections_.find(id);
    if (it == self->connections_.end()) continue;
    Connection& connection = *it->second;
    if (connection.state == Connection::State::kClosing) continue;
    if (connection.violated.load()) {
      std::string why;
      {
        std::lock_guard<std::mutex> lock(connection.violation_mutex);
        why = connection.violation_reason;
      }
      self->fail_connection(connection, invalid_argument("protocol violation: " + why));
      continue;
    }
    if (connection.channel->overflowed()) {
      self->dropped_log_.warn("dropping pid {} uid {} ('{}'): it stopped reading its socket ({} bytes queued)",
                              connection.pid, connection.uid, connection.client_name, connection.channel->queued_bytes());
      self->close_connection(connection, "stopped reading its socket");
      continue;
    }
    self->write_to(connection);
  }
}

void ServerImpl::on_timer(uv_timer_t* handle) {
  auto* self = static_cast<ServerImpl*>(handle->data);
  uint64_t now = protocol::monotonic_ns();
  std::vector<Connection*> late;
  for (auto& [id, connection] : self->connections_) {
    if (connection->state == Connection::State::kAwaitHello &&
        now - connection->accepted_ns > uint64_t(self->config_.handshake_timeout_ms) * 1000000ull) {
      late.push_back(connection.get());
    } else if (connection->state == Connection::State::kAdmin &&
               now - connection->last_activity_ns > uint64_t(self->config_.admin_idle_timeout_ms) * 1000000ull) {
      late.push_back(connection.get());
    }
  }
  for (Connection* connection : late) {
    bool hello = connection->state == Connection::State::kAwaitHello;
    self->timeout_log_.warn("closing the connection of pid {} uid {}: {}", connection->pid, connection->uid,
                            hello ? "no hello in time" : "idle admin connection");
    self->fail_connection(*connection, Status(StatusCode::DEADLINE_EXCEEDED,
                                              hello ? "no hello within " + std::to_string(self->config_.handshake_timeout_ms) + " ms"
                                                    : "admin connection idle for " +
                                                          std::to_string(self->config_.admin_idle_timeout_ms) + " ms"));
  }
}

void ServerImpl::on_connection(uv_stream_t* listener, int status) {
  auto* self = static_cast<ServerImpl*>(listener->data);
  if (status < 0) {
    self->limit_log_.warn("accept failed: {}", uv_error_text(status));
    return;
  }
  // libuv accepted the socket; take it into a pipe handle only to get its descriptor, keep a
  // duplicate, and poll that ourselves (reads and non-blocking writes).
  auto* pipe = new uv_pipe_t();
  uv_pipe_init(&self->loop_, pipe, 0);
  int fd = -1;
  if (uv_accept(listener, reinterpret_cast<uv_stream_t*>(pipe)) == 0) {
    uv_os_fd_t accepted = -1;
    uv_fileno(reinterpret_cast<uv_handle_t*>(pipe), &accepted);
    fd = ::fcntl(accepted, F_DUPFD_CLOEXEC, 0);
  }
  uv_close(reinterpret_cast<uv_handle_t*>(pipe), [](uv_handle_t* handle) { delete reinterpret_cast<uv_pipe_t*>(handle); });
  if (fd < 0) {
    self->limit_log_.warn("cannot take a new connection: out of file descriptors");
    return;
  }
  self->accept_peer(fd);
}

void ServerImpl::accept_peer(int fd) {
  ucred credentials{};
  socklen_t length = sizeof(credentials);
  bool have_credentials = ::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) == 0;
  auto refuse = [fd](const Status& status) {
    v2::ErrorV2 error{};
    error.status = static_cast<int32_t>(status.code());
    v2::copy_text(error.message, sizeof(error.message), status.message());
    std::vector<uint8_t> bytes = v2::encode_message(v2::MessageType::kError, error);
    (void)wire::send_some(fd, bytes);
    ::close(fd);
  };
  if (!have_credentials) {
    refuse(permission_denied("cannot read peer credentials"));
    return;
  }
  bool allowed = credentials.uid == 0 || credentials.uid == ::getuid();
  for (uint32_t uid : config_.allowed_uids) allowed = allowed || credentials.uid == uid;
  if (!allowed) {
    refused_log_.warn("refused connection from pid {} uid {}: uid not allowed (--allow-uid)", credentials.pid,
                      credentials.uid);
    refuse(permission_denied("uid " + std::to_string(credentials.uid) + " may not use this membard (see --allow-uid)"));
    return;
  }
  if (connections_.size() >= config_.max_connections || shutting_down_) {
    limit_log_.warn("connection limit reached ({} connections, --max-connections): refused pid {} uid {}",
                    connections_.size(), credentials.pid, credentials.uid);
    refuse(resource_exhausted("membard serves at most " + std::to_string(config_.max_connections) +
                              " connections (--max-connections); retry later"));
    return;
  }
  auto owned = std::make_unique<Connection>();
  Connection* connection = owned.get();
  connection->id = next_connection_id_++;
  connection->server = this;
  connection->uid = credentials.uid;
  connection->pid = credentials.pid;
  connection->accepted_ns = connection->last_activity_ns = protocol::monotonic_ns();
  uint64_t id = connection->id;
  connection->channel = std::make_shared<SessionChannel>(fd, config_.outbound, [this, id] { attention(id); });
  connections_.emplace(id, std::move(owned));
  uv_poll_init(&loop_, &connection->poll, fd);
  connection->poll.data = connection;
  set_poll_events(*connection, UV_READABLE);
}

void ServerImpl::set_poll_events(Connection& connection, int events) {
  if (connection.poll_events == events) return;
  connection.poll_events = events;
  uv_poll_start(&connection.poll, events, &ServerImpl::on_poll);
}

void ServerImpl::on_poll(uv_poll_t* handle, int status, int events) {
  auto* connection = static_cast<Connection*>(handle->data);
  ServerImpl* self = connection->server;
  if (connection->state == Connection::State::kClosing) return;
  if (status < 0) {
    self->close_connection(*connection, "socket error: " + uv_error_text(status));
    return;
  }
  if (events & UV_WRITABLE) self->write_to(*connection);
  if (connection->state != Connection::State::kClosing && (events & UV_READABLE)) self->read_from(*connection);
}

void ServerImpl::write_to(Connection& connection) {
  Result<bool> flushed = connection.channel->flush();
  if (!flushed.ok()) {
    close_connection(connection, "peer gone (" + flushed.status().message() + ")");
    return;
  }
  set_poll_events(connection, flushed.value() ? UV_READABLE : UV_READABLE | UV_WRITABLE);
}

void ServerImpl::read_from(Connection& connection) {
  Result<bool> read = connection.assembler.read_available(connection.channel->socket_fd(), kReadBudget);
  connection.last_activity_ns = protocol::monotonic_ns();
  for (;;) {
    Result<std::optional<wire::ReceivedMessage>> next = connection.assembler.next();
    if (!next.ok()) {
      fail_connection(connection, next.status());
      return;
    }
    if (!next.value().has_value()) break;
    handle_message(connection, *next.value());
    if (connection.state == Connection::State::kClosing) return;
  }
  if (connection.assembler.pending_fds() > 0) {
    fail_connection(connection, invalid_argument("the peer sent file descriptors; membard takes none"));
    return;
  }
  if (connection.assembler.pending_bytes() > kMaxPendingBytes) {
    fail_connection(connection, invalid_argument("more than 64 KiB of unread control bytes"));
    return;
  }
  if (!read.ok()) close_connection(connection, "peer disconnected");
}

void ServerImpl::handle_message(Connection& connection, wire::ReceivedMessage& message) {
  auto type = static_cast<v2::MessageType>(message.header.type);
  using State = Connection::State;
  if (type == v2::MessageType::kHello && connection.state == State::kAwaitHello) {
    Result<v2::HelloV2> hello = v2::decode_hello(message.payload);
    if (!hello.ok()) {
      fail_connection(connection, hello.status());
      return;
    }
    handle_hello(connection, hello.value());
    return;
  }
  if (type == v2::MessageType::kPing && connection.state != State::kAwaitHello) {
    Result<v2::PingV2> ping = v2::decode_ping(message.payload);
    if (!ping.ok()) {
      fail_connection(connection, ping.status());
      return;
    }
    (void)connection.channel->send(v2::MessageType::kPong, ping.value());
    return;
  }
  if (type == v2::MessageType::kStatsRequest && connection.state == State::kAdmin) {
    Result<v2::StatsRequestV2> request = v2::decode_stats_request(message.payload);
    if (!request.ok()) {
      fail_connection(connection, request.status());
      return;
    }
    // An admin connection reports the device its hello named (Note [Devices of one daemon]).
    Result<RuntimeStats> stats = connection.device->engine->stats(0, request.value().first_space,
                                                                  request.value().max_spaces);
    if (!stats.ok()) {
      fail_connection(connection, stats.status());
      return;
    }
    std::vector<uint8_t> payload = v2::encode_stats(stats.value());
    (void)connection.channel->send(v2::MessageType::kStatsReply, payload);
    return;
  }
  fail_connection(connection, invalid_argument("unexpected message type " + std::to_string(message.header.type) +
                                               " at this point of the conversation"));
}

void ServerImpl::handle_hello(Connection& connection, const v2::HelloV2& hello) {
  v2::HelloReplyV2 reply{};
  reply.device_mask = device_mask_;
  Result<ServedDevice*> device = device_for(hello.device_plus_one);
  if (!device.ok()) {
    // Answered in the hello reply (the client library reports its status and sentence), then closed.
    dropped_log_.warn("refused pid {} uid {}: {}", connection.pid, connection.uid, device.status().message());
    reply.status = static_cast<int32_t>(device.status().code());
    v2::copy_text(reply.message, sizeof(reply.message), device.status().message());
    (void)connection.channel->send(v2::MessageType::kHelloReply, reply);
    (void)connection.channel->flush();
    close_connection(connection, device.status().message());
    return;
  }
  connection.device = device.value();
  Engine& engine = *connection.device->engine;
  reply.device = connection.device->device;
  reply.backend = static_cast<uint8_t>(engine.backend().name() == "cuda" ? v2::WireBackend::kCuda
                                                                         : v2::WireBackend::kHost);
  if (hello.role == static_cast<uint32_t>(v2::Role::kAdmin)) {
    connection.state = Connection::State::kAdmin;
    reply.status = 0;
    reply.host_slab_frames = 1;
    (void)connection.channel->send(v2::MessageType::kHelloReply, reply);
    return;
  }

  ClientConfig client_config;
  client_config.name = hello.client_name;
  client_config.pid = connection.pid;
  client_config.uid = connection.uid;
  client_config.gpu_quota_bytes = hello.gpu_quota_bytes;
  client_config.host_quota_bytes = hello.host_quota_bytes;
  connection.client_name = client_config.name;

  std::shared_ptr<SessionChannel> channel = connection.channel;
  ClientEvents events;
  events.gpu_frame_granted = [channel](uint32_t window_frame, int fd) {
    (void)channel->send_event(v2::MessageType::kFrameGrant, v2::FrameGrantV2{0, window_frame, 0}, fd);
    ::close(fd);
  };
  events.gpu_frame_revoked = [channel](uint32_t window_frame) {
    (void)channel->send_event(v2::MessageType::kFrameRevoke,
                              v2::FrameEventV2{0, window_frame, static_cast<uint8_t>(Tier::kGpu), {}});
  };
  events.host_slab_granted = [channel](uint32_t slab, uint32_t frames, int fd) {
    (void)channel->send_event(v2::MessageType::kSlabGrant, v2::SlabGrantV2{0, slab, frames, uint64_t{frames} * kFrameBytes},
                              fd);
    ::close(fd);
  };
  events.host_slab_revoked = [channel](uint32_t slab) {
    (void)channel->send_event(v2::MessageType::kSlabRevoke, v2::SlabEventV2{0, slab, 0});
  };
  events.frame_mapped = [channel](Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame) {
    (void)channel->send_event(v2::MessageType::kFrameMap,
                              v2::FrameMapV2{0, window_frame, static_cast<uint8_t>(tier), {}, space, space_frame});
  };
  events.frame_unmapped = [channel](Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame) {
    (void)channel->send_event(v2::MessageType::kFrameUnmap,
                              v2::FrameMapV2{0, window_frame, static_cast<uint8_t>(tier), {}, space, space_frame});
  };
  events.tickets_completed = [channel](Ticket completed) { channel->publish_completed(completed); };

  Result<ClientId> client = engine.client_open(client_config, events);
  if (!client.ok()) {
    fail_connection(connection, client.status());
    return;
  }
  connection.client_open = true;
  connection.client = client.value();

  auto fail = [&](const Status& status) { fail_connection(connection, status); };
  Result<v2::SegmentLayout> layout = v2::make_segment_layout(config_.ring_capacity, config_.request_payload_bytes,
                                                             config_.response_payload_bytes);
  if (!layout.ok()) return fail(layout.status());
  Result<std::unique_ptr<SharedSegment>> segment = SharedSegment::create(layout.value());
  if (!segment.ok()) return fail(segment.status());
  connection.segment = std::move(segment).value();
  channel->set_segment(connection.segment);

  Result<ClientGeometry> geometry = engine.client_geometry(connection.client);
  if (!geometry.ok()) return fail(geometry.status());
  Result<int> signal_fd = engine.client_signal_fd(connection.client);
  if (!signal_fd.ok()) return fail(signal_fd.status());
  UniqueFd signal(signal_fd.value());
  Result<int> segment_fd = connection.segment->export_fd();
  if (!segment_fd.ok()) return fail(segment_fd.status());
  UniqueFd segment_handle(segment_fd.value());

  reply.status = 0;
  reply.client_id = connection.client;
  reply.ring_capacity = layout.value().ring_capacity;
  reply.segment_bytes = layout.value().segment_bytes;
  reply.gpu_quota_frames = geometry.value().gpu_quota_frames;
  reply.host_quota_frames = geometry.value().host_quota_frames;
  reply.host_slab_frames = geometry.value().host_slab_frames;
  reply.signal_words = 8;

  // Start serving before the reply so the client's first request finds a thread.
  ClientId id = connection.client;
  uint64_t connection_id = connection.id;
  Connection* raw = &connection;
  connection.ring = std::make_unique<RingServer>(
      engine, id, connection.segment, channel, RingServerConfig{config_.ring_spin_us, &channels_, connection.uid},
      [this, raw, connection_id](std::string why) {
        {
          std::lock_guard<std::mutex> lock(raw->violation_mutex);
          raw->violation_reason = std::move(why);
        }
        raw->violated.store(true);
        attention(connection_id);
      });
  connection.ring->start();
  connection.state = Connection::State::kServing;
  int fds[2] = {signal.get(), segment_handle.get()};
  Status sent = channel->send(v2::MessageType::kHelloReply, reply, std::span<const int>(fds, 2));
  if (!sent.ok()) {
    close_connection(connection, "cannot send hello reply: " + sent.to_string());
    return;
  }
  spdlog::info("client {} '{}' connected (pid {}, uid {}, device {}, quota {} GPU / {} host frames)", id,
               client_config.name, connection.pid, connection.uid, reply.device, reply.gpu_quota_frames,
               reply.host_quota_frames);
}

void ServerImpl::fail_connection(Connection& connection, const Status& status) {
  if (connection.state == Connection::State::kClosing) return;
  if (connection.client_open) {
    spdlog::warn("dropping client {} ('{}', pid {}): {}", connection.client, connection.client_name, connection.pid,
                 status.to_string());
  } else {
    dropped_log_.warn("dropping connection of pid {} uid {}: {}", connection.pid, connection.uid, status.to_string());
  }
  v2::ErrorV2 error{};
  error.status = static_cast<int32_t>(status.ok() ? StatusCode::INTERNAL : status.code());
  v2::copy_text(error.message, sizeof(error.message), status.message());
  if (connection.channel) {
    (void)connection.channel->send(v2::MessageType::kError, error);
    (void)connection.channel->flush();  // best effort: the peer gets the sentence if it reads
  }
  close_connection(connection, status.to_string());
}

void ServerImpl::close_connection(Connection& connection, const std::string& reason) {
  if (connection.state == Connection::State::kClosing) return;
  connection.state = Connection::State::kClosing;
  // Closing the engine client first wakes a ring thread that waits in the engine for this
  // client's stream (it is gone); then the thread can be joined at once.
  if (connection.client_open) {
    channels_.close_all(connection.client);
    uint64_t start = protocol::monotonic_ns();
    Status closed = connection.device->engine->client_close(connection.client);
    if (!closed.ok()) spdlog::error("client {}: close failed: {}", connection.client, closed.to_string());
    spdlog::info("client {} '{}' closed ({}), its memory reclaimed in {:.1f} ms", connection.client,
                 connection.client_name, reason, (protocol::monotonic_ns() - start) * 1e-6);
    connection.client_open = false;
  }
  if (connection.ring) {
    connection.ring->stop();
    connection.ring.reset();
  }
  connection.segment.reset();
  uv_poll_stop(&connection.poll);
  uv_close(reinterpret_cast<uv_handle_t*>(&connection.poll), [](uv_handle_t* handle) {
    auto* closed = static_cast<Connection*>(handle->data);
    // The channel owns the socket: closing it here tells the peer, after libuv let go of it.
    closed->channel->close();
    closed->server->connections_.erase(closed->id);
  });
}

void ServerImpl::shutdown(const std::string& reason) {
  if (shutting_down_) return;
  shutting_down_ = true;
  spdlog::info("shutting down: {}", reason);
  v2::ShutdownV2 notice{};
  v2::copy_text(notice.reason, sizeof(notice.reason), reason);
  std::vector<Connection*> open;
  for (auto& [id, connection] : connections_) open.push_back(connection.get());
  for (Connection* connection : open) {
    if (connection->state == Connection::State::kClosing) continue;
    if (connection->channel) {
      connection->channel->publish_shutdown();
      (void)connection->channel->send(v2::MessageType::kShutdown, notice);
      (void)connection->channel->flush();
    }
    close_connection(*connection, "daemon shutdown");
  }
  if (listener_initialized_) {
    close_handle(reinterpret_cast<uv_handle_t*>(&listener_));
    listener_initialized_ = false;
  }
  if (listening_) {
    ::unlink(config_.socket_path.c_str());
    listening_ = false;
  }
  if (timer_initialized_) {
    uv_timer_stop(&timer_);
    close_handle(reinterpret_cast<uv_handle_t*>(&timer_));
    timer_initialized_ = false;
  }
  if (prometheus_open_) close_handle(reinterpret_cast<uv_handle_t*>(&prometheus_));
  if (signals_initialized_) {
    close_handle(reinterpret_cast<uv_handle_t*>(&sigterm_));
    close_handle(reinterpret_cast<uv_handle_t*>(&sigint_));
  }
  std::lock_guard<std::mutex> lock(stop_mutex_);
  wakeup_closed_ = true;
  close_handle(reinterpret_cast<uv_handle_t*>(&wakeup_));
}

// ---------------------------------------------------------------------------------------------
// Prometheus endpoint: one request per connection, HTTP/1.0, then close.

void ServerImpl::on_http_connection(uv_stream_t* listener, int status) {
  auto* self = static_cast<ServerImpl*>(listener->data);
  if (status < 0) return;
  auto* http = new HttpConnection();
  uv_tcp_init(&self->loop_, &http->tcp);
  http->tcp.data = http;
  http->write.data = self;
  if (uv_accept(listener, reinterpret_cast<uv_stream_t*>(&http->tcp)) != 0) {
    uv_close(reinterpret_cast<uv_handle_t*>(&http->tcp),
             [](uv_handle_t* handle) { delete static_cast<HttpConnection*>(handle->data); });
    return;
  }
  uv_read_start(
      reinterpret_cast<uv_stream_t*>(&http->tcp),
      [](uv_handle_t*, size_t suggested, uv_buf_t* buffer) {
        buffer->base = new char[suggested];
        buffer->len = suggested;
      },
      &ServerImpl::on_http_read);
}

void ServerImpl::on_http_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buffer) {
  auto* http = static_cast<HttpConnection*>(stream->data);
  auto* self = static_cast<ServerImpl*>(http->write.data);
  if (nread > 0) http->request.append(buffer->base, static_cast<size_t>(nread));
  delete[] buffer->base;
  auto close = [http] {
    uv_close(reinterpret_cast<uv_handle_t*>(&http->tcp),
             [](uv_handle_t* handle) { delete static_cast<HttpConnection*>(handle->data); });
  };
  if (http->responded) return;
  if (nread < 0 || http->request.size() > 16384) {
    close();
    return;
  }
  if (http->request.find("\r\n\r\n") == std::string::npos && http->request.find("\n\n") == std::string::npos) return;
  self->respond_http(*http);
}

void ServerImpl::respond_http(HttpConnection& http) {
  http.responded = true;
  uv_read_stop(reinterpret_cast<uv_stream_t*>(&http.tcp));
  bool metrics_path = http.request.rfind("GET /metrics", 0) == 0 || http.request.rfind("GET / ", 0) == 0;
  std::string body;
  std::string status_line = "HTTP/1.0 200 OK";
  if (!metrics_path) {
    status_line = "HTTP/1.0 404 Not Found";
    body = "membard serves GET /metrics\n";
  } else {
    std::vector<DeviceRuntimeStats> node;
    Status failed;
    for (ServedDevice& served : devices_) {
      Result<RuntimeStats> stats = served.engine->stats(0, 0, v2::kMaxStatsSpaces);
      if (!stats.ok()) {
        failed = stats.status();
        break;
      }
      node.push_back({served.device, std::move(stats).value()});
    }
    if (failed.ok()) {
      body = format_prometheus(node);
    } else {
      status_line = "HTTP/1.0 500 Internal Server Error";
      body = failed.to_string() + "\n";
    }
  }
  http.response = status_line + "\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: " +
                  std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
  uv_buf_t buffer = uv_buf_init(http.response.data(), static_cast<unsigned>(http.response.size()));
  http.write.data = &http;
  uv_write(&http.write, reinterpret_cast<uv_stream_t*>(&http.tcp), &buffer, 1, [](uv_write_t* request, int) {
    auto* done = static_cast<HttpConnection*>(request->data);
    uv_close(reinterpret_cast<uv_handle_t*>(&done->tcp),
             [](uv_handle_t* handle) { delete static_cast<HttpConnection*>(handle->data); });
  });
}

}  // namespace

Result<std::unique_ptr<Server>> Server::create(const ServerConfig& config, std::vector<ServedDevice> devices) {
  auto server = std::make_unique<ServerImpl>(config, std::move(devices));
  MEMBAR_RETURN_IF_ERROR(server->start());
  return std::unique_ptr<Server>(std::move(server));
}

}  // namespace membar::runtimed
