// membard's libuv loop: control socket, handshakes, admin requests, Prometheus, shutdown.
//
// Threads: the loop thread owns every Connection and every libuv handle. Each trainer client
// also has a ring thread (session.cpp) that runs its requests; the engine's callbacks may run
// on any thread and reach the client only through its SessionChannel. The only ways into the
// loop from other threads are uv_async_send on `wakeup_` (stop requests, protocol violations).
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
#include <mutex>
#include <unordered_map>

#include "prometheus.h"
#include "session.h"

namespace membar::runtimed {
namespace {

namespace v1 = protocol::v1;

// The peer's handshake and admin messages are small; more unread bytes than this is abuse.
constexpr size_t kMaxPendingBytes = 64 * 1024;

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

class ServerImpl;

struct Connection {
  enum class State { kAwaitHello, kAwaitAttached, kServing, kAdmin, kClosing };

  ServerImpl* server = nullptr;
  uv_pipe_t pipe{};
  wire::MessageAssembler assembler;
  std::shared_ptr<SessionChannel> channel;
  State state = State::kAwaitHello;
  uint32_t uid = 0;
  int32_t pid = 0;
  bool client_open = false;
  ClientId client = 0;
  std::shared_ptr<SharedSegment> segment;
  std::unique_ptr<RingServer> ring;
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
  ServerImpl(const ServerConfig& config, std::unique_ptr<Engine> engine)
      : config_(config), engine_(std::move(engine)) {}
  ~ServerImpl() override;

  Status start();
  Status run() override;
  void request_stop(const std::string& reason) override;
  int prometheus_port() const override { return bound_prometheus_port_; }

 private:
  static void on_connection(uv_stream_t* listener, int status);
  static void on_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buffer);
  static void on_wakeup(uv_async_t* handle);
  static void on_signal(uv_signal_t* handle, int signal_number);
  static void on_http_connection(uv_stream_t* listener, int status);
  static void on_http_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buffer);

  void handle_message(Connection& connection, wire::ReceivedMessage& message);
  void handle_hello(Connection& connection, const v1::HelloV1& hello);
  void fail_connection(Connection& connection, const Status& status);
  void close_connection(Connection& connection, const std::string& reason);
  void shutdown(const std::string& reason);
  void respond_http(HttpConnection& http);
  void close_handle(uv_handle_t* handle);

  ServerConfig config_;
  std::unique_ptr<Engine> engine_;
  ChannelRegistry channels_;  // Note [Channels]
  uv_loop_t loop_{};
  uv_pipe_t listener_{};
  uv_async_t wakeup_{};
  uv_signal_t sigterm_{};
  uv_signal_t sigint_{};
  uv_tcp_t prometheus_{};
  bool loop_ready_ = false;
  bool listener_initialized_ = false;
  bool listening_ = false;
  bool signals_initialized_ = false;
  bool prometheus_open_ = false;
  bool shutting_down_ = false;
  int bound_prometheus_port_ = -1;
  uint64_t segment_counter_ = 0;
  std::unordered_map<Connection*, std::unique_ptr<Connection>> connections_;

  std::mutex stop_mutex_;
  bool stop_requested_ = false;
  bool wakeup_closed_ = false;
  std::string stop_reason_;
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

Status ServerImpl::start() {
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
  // Bind with a umask that gives nobody else access before the chmod below narrows it.
  mode_t previous_umask = ::umask(0177);
  rc = uv_pipe_bind(&listener_, config_.socket_path.c_str());
  ::umask(previous_umask);
  if (rc != 0) return unavailable("cannot bind " + config_.socket_path + ": " + uv_error_text(rc));
  if (::chmod(config_.socket_path.c_str(), config_.socket_mode) != 0) {
    return permission_denied("cannot chmod " + config_.socket_path + ": " + std::strerror(errno));
  }
  rc = uv_listen(reinterpret_cast<uv_stream_t*>(&listener_), 128, &ServerImpl::on_connection);
  if (rc != 0) return unavailable("cannot listen on " + config_.socket_path + ": " + uv_error_text(rc));
  listening_ = true;

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
  spdlog::info("membard serving {} (backend {}, mode {:o})", config_.socket_path, engine_->backend().name(),
               config_.socket_mode);
  return Status::Ok();
}

Status ServerImpl::run() {
  uv_run(&loop_, UV_RUN_DEFAULT);
  // Every handle is closed once shutdown() ran; anything left (none expected) is drained here.
  if (!shutting_down_) shutdown("event loop ended");
  uv_run(&loop_, UV_RUN_DEFAULT);
  uv_loop_close(&loop_);
  loop_ready_ = false;
  engine_->backend().drain();
  spdlog::info("membard stopped");
  return Status::Ok();
}

void ServerImpl::request_stop(const std::string& reason) {
  std::lock_guard<std::mutex> lock(stop_mutex_);
  stop_requested_ = true;
  stop_reason_ = reason;
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
  {
    std::lock_guard<std::mutex> lock(self->stop_mutex_);
    stop = self->stop_requested_;
    reason = self->stop_reason_;
  }
  if (stop) {
    self->shutdown(reason);
    return;
  }
  std::vector<Connection*> violated;
  for (auto& [pointer, connection] : self->connections_) {
    if (connection->violated.load()) violated.push_back(pointer);
  }
  for (Connection* connection : violated) {
    std::string why;
    {
      std::lock_guard<std::mutex> lock(connection->violation_mutex);
      why = connection->violation_reason;
    }
    self->fail_connection(*connection, invalid_argument("protocol violation: " + why));
  }
}

void ServerImpl::on_connection(uv_stream_t* listener, int status) {
  auto* self = static_cast<ServerImpl*>(listener->data);
  if (status < 0) {
    spdlog::warn("accept failed: {}", uv_error_text(status));
    return;
  }
  auto owned = std::make_unique<Connection>();
  Connection* connection = owned.get();
  connection->server = self;
  uv_pipe_init(&self->loop_, &connection->pipe, 0);
  connection->pipe.data = connection;
  if (uv_accept(listener, reinterpret_cast<uv_stream_t*>(&connection->pipe)) != 0) {
    uv_close(reinterpret_cast<uv_handle_t*>(&connection->pipe),
             [](uv_handle_t* handle) { delete static_cast<Connection*>(handle->data); });
    owned.release();
    return;
  }
  self->connections_.emplace(connection, std::move(owned));
  uv_os_fd_t fd = -1;
  uv_fileno(reinterpret_cast<uv_handle_t*>(&connection->pipe), &fd);
  connection->channel = std::make_shared<SessionChannel>(::fcntl(fd, F_DUPFD_CLOEXEC, 0));

  ucred credentials{};
  socklen_t length = sizeof(credentials);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0) {
    self->fail_connection(*connection, permission_denied("cannot read peer credentials"));
    return;
  }
  connection->uid = credentials.uid;
  connection->pid = credentials.pid;
  bool allowed = credentials.uid == 0 || credentials.uid == ::getuid();
  for (uint32_t uid : self->config_.allowed_uids) allowed = allowed || credentials.uid == uid;
  if (!allowed) {
    spdlog::warn("refused connection from pid {} uid {}: uid not allowed", credentials.pid, credentials.uid);
    self->fail_connection(*connection, permission_denied("uid " + std::to_string(credentials.uid) +
                                                         " may not use this membard (see --allow-uid)"));
    return;
  }
  uv_read_start(
      reinterpret_cast<uv_stream_t*>(&connection->pipe),
      [](uv_handle_t*, size_t suggested, uv_buf_t* buffer) {
        buffer->base = new char[suggested];
        buffer->len = suggested;
      },
      &ServerImpl::on_read);
}

void ServerImpl::on_read(uv_stream_t* stream, ssize_t nread, const uv_buf_t* buffer) {
  auto* connection = static_cast<Connection*>(stream->data);
  ServerImpl* self = connection->server;
  if (nread > 0 && connection->state != Connection::State::kClosing) {
    connection->assembler.append(std::span<const uint8_t>(reinterpret_cast<uint8_t*>(buffer->base), nread));
  }
  delete[] buffer->base;
  if (connection->state == Connection::State::kClosing) return;
  if (nread < 0) {
    self->close_connection(*connection, nread == UV_EOF ? "client disconnected" : "read error: " + uv_error_text(static_cast<int>(nread)));
    return;
  }
  for (;;) {
    Result<std::optional<wire::ReceivedMessage>> next = connection->assembler.next();
    if (!next.ok()) {
      self->fail_connection(*connection, next.status());
      return;
    }
    if (!next.value().has_value()) break;
    self->handle_message(*connection, *next.value());
    if (connection->state == Connection::State::kClosing) return;
  }
  if (connection->assembler.pending_bytes() > kMaxPendingBytes) {
    self->fail_connection(*connection, invalid_argument("more than 64 KiB of unread control bytes"));
  }
}

void ServerImpl::handle_message(Connection& connection, wire::ReceivedMessage& message) {
  auto type = static_cast<v1::MessageType>(message.header.type);
  using State = Connection::State;
  if (type == v1::MessageType::kHello && connection.state == State::kAwaitHello) {
    Result<v1::HelloV1> hello = v1::decode_hello(message.payload);
    if (!hello.ok()) {
      fail_connection(connection, hello.status());
      return;
    }
    handle_hello(connection, hello.value());
    return;
  }
  if (type == v1::MessageType::kAttached && connection.state == State::kAwaitAttached) {
    // The client has mapped its segment: the name is no longer needed.
    connection.segment->remove_name();
    connection.state = State::kServing;
    return;
  }
  if (type == v1::MessageType::kPing && connection.state != State::kAwaitHello) {
    Result<v1::PingV1> ping = v1::decode_ping(message.payload);
    if (!ping.ok()) {
      fail_connection(connection, ping.status());
      return;
    }
    (void)connection.channel->send(v1::MessageType::kPong, ping.value());
    return;
  }
  if (type == v1::MessageType::kStatsRequest && connection.state == State::kAdmin) {
    Result<RuntimeStats> stats = engine_->stats(0);
    if (!stats.ok()) {
      fail_connection(connection, stats.status());
      return;
    }
    std::vector<uint8_t> payload = v1::encode_stats(stats.value());
    (void)connection.channel->send(v1::MessageType::kStatsReply, payload);
    return;
  }
  fail_connection(connection, invalid_argument("unexpected message type " + std::to_string(message.header.type) +
                                               " at this point of the conversation"));
}

void ServerImpl::handle_hello(Connection& connection, const v1::HelloV1& hello) {
  v1::HelloReplyV1 reply{};
  reply.backend = static_cast<uint8_t>(engine_->backend().name() == "cuda" ? v1::WireBackend::kCuda
                                                                           : v1::WireBackend::kHost);
  if (hello.role == static_cast<uint32_t>(v1::Role::kAdmin)) {
    connection.state = Connection::State::kAdmin;
    reply.status = 0;
    (void)connection.channel->send(v1::MessageType::kHelloReply, reply);
    return;
  }

  ClientConfig client_config;
  client_config.name = hello.client_name;
  client_config.pid = connection.pid;
  client_config.uid = connection.uid;
  client_config.gpu_quota_bytes = hello.gpu_quota_bytes;
  client_config.host_quota_bytes = hello.host_quota_bytes;

  std::shared_ptr<SessionChannel> channel = connection.channel;
  ClientEvents events;
  events.frame_granted = [channel](uint32_t window_frame, Tier tier, int fd) {
    v1::FrameNoticeV1 notice{window_frame, static_cast<uint8_t>(tier), {}};
    (void)channel->send(v1::MessageType::kFrameGrant, notice, fd);
    ::close(fd);  // the client received its own duplicate
  };
  events.frame_revoked = [channel](uint32_t window_frame, Tier tier) {
    v1::FrameNoticeV1 notice{window_frame, static_cast<uint8_t>(tier), {}};
    (void)channel->send(v1::MessageType::kFrameRevoke, notice);
  };
  events.tickets_completed = [channel](Ticket completed) { channel->publish_completed(completed); };

  Result<ClientId> client = engine_->client_open(client_config, events);
  if (!client.ok()) {
    fail_connection(connection, client.status());
    return;
  }
  connection.client_open = true;
  connection.client = client.value();

  auto fail = [&](const Status& status) { fail_connection(connection, status); };
  Result<v1::SegmentLayout> layout = v1::make_segment_layout(config_.ring_capacity, config_.request_payload_bytes,
                                                             config_.response_payload_bytes);
  if (!layout.ok()) return fail(layout.status());
  std::string name = "membar." + std::to_string(::getpid()) + "." + std::to_string(connection.client) + "." +
                     std::to_string(++segment_counter_);
  Result<std::unique_ptr<SharedSegment>> segment = SharedSegment::create(name, layout.value(), connection.uid);
  if (!segment.ok()) return fail(segment.status());
  connection.segment = std::move(segment).value();
  channel->set_segment(connection.segment);

  Result<uint32_t> gpu_frames = engine_->client_window_frames(connection.client, Tier::kGpu);
  Result<uint32_t> host_frames = engine_->client_window_frames(connection.client, Tier::kHost);
  if (!gpu_frames.ok()) return fail(gpu_frames.status());
  if (!host_frames.ok()) return fail(host_frames.status());
  Result<int> signal_fd = engine_->client_signal_fd(connection.client);
  if (!signal_fd.ok()) return fail(signal_fd.status());
  wire::UniqueFd signal(signal_fd.value());

  reply.status = 0;
  reply.client_id = connection.client;
  reply.ring_capacity = layout.value().ring_capacity;
  reply.segment_bytes = layout.value().segment_bytes;
  reply.gpu_window_frames = gpu_frames.value();
  reply.host_window_frames = host_frames.value();
  reply.signal_words = 8;
  reply.device = config_.device;
  v1::copy_text(reply.segment_name, sizeof(reply.segment_name), name);

  // Start serving before the reply so the client's first request finds a thread.
  ClientId id = connection.client;
  Connection* raw = &connection;
  connection.ring = std::make_unique<RingServer>(
      *engine_, id, connection.segment, channel, RingServerConfig{config_.ring_spin_us, &channels_, connection.uid},
      [this, raw](std::string why) {
        {
          std::lock_guard<std::mutex> lock(raw->violation_mutex);
          raw->violation_reason = std::move(why);
        }
        raw->violated.store(true);
        uv_async_send(&wakeup_);
      });
  connection.ring->start();
  connection.state = Connection::State::kAwaitAttached;
  Status sent = channel->send(v1::MessageType::kHelloReply, reply, signal.get());
  if (!sent.ok()) {
    close_connection(connection, "cannot send hello reply: " + sent.to_string());
    return;
  }
  spdlog::info("client {} '{}' connected (pid {}, uid {}, window {} gpu / {} host frames)", id,
               client_config.name, connection.pid, connection.uid, reply.gpu_window_frames, reply.host_window_frames);
}

void ServerImpl::fail_connection(Connection& connection, const Status& status) {
  if (connection.state == Connection::State::kClosing) return;
  spdlog::warn("dropping connection of pid {}: {}", connection.pid, status.to_string());
  v1::ErrorV1 error{};
  error.status = static_cast<int32_t>(status.ok() ? StatusCode::INTERNAL : status.code());
  v1::copy_text(error.message, sizeof(error.message), status.message());
  if (connection.channel) (void)connection.channel->send(v1::MessageType::kError, error);
  close_connection(connection, status.to_string());
}

void ServerImpl::close_connection(Connection& connection, const std::string& reason) {
  if (connection.state == Connection::State::kClosing) return;
  connection.state = Connection::State::kClosing;
  if (connection.ring) {
    connection.ring->stop();
    connection.ring.reset();
  }
  // Close the channel first: the engine's revocations during client_close go nowhere.
  if (connection.channel) connection.channel->close();
  if (connection.client_open) {
    channels_.close_all(connection.client);
    uint64_t start = protocol::monotonic_ns();
    Status closed = engine_->client_close(connection.client);
    if (!closed.ok()) spdlog::error("client {}: close failed: {}", connection.client, closed.to_string());
    spdlog::info("client {} closed ({}), its frames reclaimed in {:.1f} ms", connection.client, reason,
                 (protocol::monotonic_ns() - start) * 1e-6);
    connection.client_open = false;
  }
  if (connection.segment) {
    connection.segment->remove_name();
    connection.segment.reset();
  }
  uv_close(reinterpret_cast<uv_handle_t*>(&connection.pipe), [](uv_handle_t* handle) {
    auto* closed = static_cast<Connection*>(handle->data);
    closed->server->connections_.erase(closed);
  });
}

void ServerImpl::shutdown(const std::string& reason) {
  if (shutting_down_) return;
  shutting_down_ = true;
  spdlog::info("shutting down: {}", reason);
  v1::ShutdownV1 notice{};
  v1::copy_text(notice.reason, sizeof(notice.reason), reason);
  std::vector<Connection*> open;
  for (auto& [pointer, connection] : connections_) open.push_back(pointer);
  for (Connection* connection : open) {
    if (connection->state == Connection::State::kClosing) continue;
    if (connection->channel) {
      connection->channel->publish_shutdown();
      (void)connection->channel->send(v1::MessageType::kShutdown, notice);
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
    Result<RuntimeStats> stats = engine_->stats(0);
    if (stats.ok()) {
      body = format_prometheus(stats.value());
    } else {
      status_line = "HTTP/1.0 500 Internal Server Error";
      body = stats.status().to_string() + "\n";
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

Result<std::unique_ptr<Server>> Server::create(const ServerConfig& config, std::unique_ptr<Engine> engine) {
  if (!engine) return invalid_argument("Server::create needs an engine");
  auto server = std::make_unique<ServerImpl>(config, std::move(engine));
  MEMBAR_RETURN_IF_ERROR(server->start());
  return std::unique_ptr<Server>(std::move(server));
}

}  // namespace membar::runtimed
