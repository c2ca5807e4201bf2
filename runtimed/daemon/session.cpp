#include "session.h"

#include <sched.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <cstring>

namespace membar::runtimed {

namespace v1 = protocol::v1;

// ---------------------------------------------------------------------------------------------
// SessionChannel

Status SessionChannel::send(v1::MessageType type, std::span<const uint8_t> payload, int fd_to_pass) {
  std::vector<uint8_t> bytes = v1::encode_message(type, payload, fd_to_pass >= 0 ? 1 : 0);
  std::lock_guard<std::mutex> lock(send_mutex_);
  if (closed_) return unavailable("the client's connection is closed");
  return wire::send_message(socket_.get(), bytes, fd_to_pass);
}

void SessionChannel::set_segment(std::shared_ptr<SharedSegment> segment) {
  std::lock_guard<std::mutex> lock(segment_mutex_);
  segment_ = std::move(segment);
}

namespace {
void wake_client(v1::SegmentHeaderV1* header) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (std::atomic_ref<uint32_t>(header->client_waiting).load(std::memory_order_relaxed) != 0) {
    std::atomic_ref<uint32_t>(header->completion_doorbell).fetch_add(1, std::memory_order_release);
    protocol::futex_wake_all(&header->completion_doorbell);
  }
}
}  // namespace

void SessionChannel::publish_completed(Ticket completed) {
  std::lock_guard<std::mutex> lock(segment_mutex_);
  if (!segment_) return;
  v1::SegmentHeaderV1* header = segment_->header();
  auto word = std::atomic_ref<uint64_t>(header->completed_ticket);
  // Only ever raise it (callbacks from several threads may race; the client can also scribble).
  uint64_t seen = word.load(std::memory_order_relaxed);
  while (seen < completed && !word.compare_exchange_weak(seen, completed, std::memory_order_release)) {
  }
  wake_client(header);
}

void SessionChannel::publish_shutdown() {
  std::lock_guard<std::mutex> lock(segment_mutex_);
  if (!segment_) return;
  v1::SegmentHeaderV1* header = segment_->header();
  std::atomic_ref<uint32_t>(header->daemon_state).store(v1::kDaemonShuttingDown, std::memory_order_release);
  // Wake unconditionally: the client may be between its check and its sleep.
  std::atomic_ref<uint32_t>(header->completion_doorbell).fetch_add(1, std::memory_order_release);
  protocol::futex_wake_all(&header->completion_doorbell);
}

void SessionChannel::close() {
  {
    std::lock_guard<std::mutex> lock(send_mutex_);
    closed_ = true;
    socket_.reset();
  }
  std::lock_guard<std::mutex> lock(segment_mutex_);
  segment_.reset();
}

// ---------------------------------------------------------------------------------------------
// RingServer

RingServer::RingServer(Engine& engine, ClientId client, std::shared_ptr<SharedSegment> segment,
                       std::shared_ptr<SessionChannel> channel, RingServerConfig config,
                       std::function<void(std::string)> on_protocol_violation)
    : engine_(engine),
      client_(client),
      segment_(std::move(segment)),
      channel_(std::move(channel)),
      config_(config),
      on_protocol_violation_(std::move(on_protocol_violation)) {
  const v1::SegmentLayout& layout = segment_->layout();
  requests_ = protocol::RingEnd<v1::RequestV1>(segment_->base() + layout.request_ring_offset, layout.ring_capacity);
  completions_ = protocol::RingEnd<v1::CompletionV1>(segment_->base() + layout.completion_ring_offset,
                                                     layout.ring_capacity);
}

void RingServer::start() { thread_ = std::thread([this] { serve(); }); }

void RingServer::stop() {
  stopping_.store(true, std::memory_order_release);
  if (thread_.joinable()) {
    requests_.ring_doorbell();
    thread_.join();
  }
}

void RingServer::serve() {
  uint64_t last_request_ns = protocol::monotonic_ns();
  const uint64_t spin_ns = uint64_t{config_.spin_us} * 1000;
  uint32_t idle_spins = 0;
  while (!stopping_.load(std::memory_order_acquire)) {
    v1::RequestV1 request;
    int popped = requests_.try_pop(request);
    if (popped < 0) {
      on_protocol_violation_("request ring head moved outside the ring (corrupted segment)");
      return;
    }
    if (popped > 0) {
      handle(request);
      last_request_ns = protocol::monotonic_ns();
      idle_spins = 0;
      continue;
    }
    // Spin briefly after a request (the next one usually follows at once), yielding so that a
    // client sharing this core can run; then sleep on the doorbell.
    if (protocol::monotonic_ns() - last_request_ns < spin_ns) {
      if (++idle_spins < 16) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      } else {
        sched_yield();
      }
      continue;
    }
    requests_.wait_for_entries(100'000'000);
  }
}

bool RingServer::write_response(std::span<const uint8_t> bytes) {
  const v1::SegmentLayout& layout = segment_->layout();
  if (bytes.size() > layout.response_payload_bytes) return false;
  if (!bytes.empty()) std::memcpy(segment_->base() + layout.response_payload_offset, bytes.data(), bytes.size());
  return true;
}

bool RingServer::post(const v1::CompletionV1& completion) {
  // One request is outstanding per client, so the ring has room unless the client stopped
  // reading it (or wrote an impossible tail). Give it a second, then drop the client.
  uint64_t deadline = protocol::monotonic_ns() + 1'000'000'000ull;
  while (!completions_.try_push(completion)) {
    if (stopping_.load(std::memory_order_acquire)) return false;
    if (protocol::monotonic_ns() > deadline) {
      on_protocol_violation_("completion ring stayed full for a second");
      return false;
    }
    std::this_thread::yield();
  }
  return true;
}

void RingServer::complete_error(const v1::RequestV1& request, const Status& status) {
  v1::CompletionV1 completion{};
  completion.sequence = request.sequence;
  completion.opcode = request.opcode;
  completion.status = static_cast<int32_t>(status.code());
  const std::string& message = status.message();
  size_t bytes = std::min<size_t>(message.size(), 4096);
  if (write_response(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(message.data()), bytes))) {
    completion.payload_bytes = static_cast<uint32_t>(bytes);
  }
  spdlog::debug("client {}: {} failed: {}", client_, v1::opcode_name(request.opcode), status.to_string());
  post(completion);
}

void RingServer::handle(const v1::RequestV1& request) {
  const v1::SegmentLayout& layout = segment_->layout();
  Status valid = v1::validate_request(request, layout.request_payload_bytes);
  if (!valid.ok()) {
    complete_error(request, valid);
    return;
  }
  // Copy the payload out before decoding it: the client could rewrite it meanwhile.
  request_payload_.assign(segment_->base() + layout.request_payload_offset,
                          segment_->base() + layout.request_payload_offset + request.payload_bytes);
  if (request.stall_ns != 0) (void)engine_.add_stall_ns(client_, request.stall_ns);

  v1::CompletionV1 completion{};
  completion.sequence = request.sequence;
  completion.opcode = request.opcode;
  PageRange range{request.space, request.first_page, request.page_count};
  bool dirty = (request.flags & v1::kReleaseDirty) != 0;
  std::vector<uint8_t> response;
  Status status;

  switch (static_cast<v1::Opcode>(request.opcode)) {
    case v1::Opcode::kNop:
      break;
    case v1::Opcode::kCreateSpace: {
      std::string name(request_payload_.begin(), request_payload_.end());
      status = v1::validate_space_name(name);
      if (!status.ok()) break;
      Result<SpaceId> space = engine_.create_space(client_, name, request.argument, request.page_count);
      status = space.status();
      if (space.ok()) completion.value = space.value();
      break;
    }
    case v1::Opcode::kDestroySpace:
      status = engine_.destroy_space(client_, request.space);
      break;
    case v1::Opcode::kAcquire:
    case v1::Opcode::kAcquireHost: {
      Result<AcquireResult> acquired = request.opcode == static_cast<uint16_t>(v1::Opcode::kAcquire)
                                           ? engine_.acquire(client_, range, request.flags)
                                           : engine_.acquire_host_async(client_, range);
      status = acquired.status();
      if (acquired.ok()) {
        completion.ticket = acquired.value().ticket;
        response = v1::encode_locations(acquired.value().locations);
      }
      break;
    }
    case v1::Opcode::kRelease:
      status = (request.flags & v1::kReleaseAfterMarker) != 0
                   ? engine_.release_after(client_, range, dirty, request.argument)
                   : engine_.release(client_, range, dirty);
      break;
    case v1::Opcode::kReleaseHost:
      status = engine_.release_host(client_, range, dirty);
      break;
    case v1::Opcode::kPrefetch:
    case v1::Opcode::kOffload: {
      Result<Ticket> ticket = request.opcode == static_cast<uint16_t>(v1::Opcode::kPrefetch)
                                  ? engine_.prefetch(client_, range)
                                  : engine_.offload(client_, range);
      status = ticket.status();
      if (ticket.ok()) completion.ticket = ticket.value();
      break;
    }
    case v1::Opcode::kFreePages:
      status = engine_.free_pages(client_, range);
      break;
    case v1::Opcode::kSetSchedule: {
      Result<std::vector<ScheduleStep>> steps = v1::decode_schedule(request_payload_);
      status = steps.status();
      if (steps.ok()) status = engine_.set_schedule(client_, std::move(steps).value());
      break;
    }
    case v1::Opcode::kAdvance:
      status = engine_.advance(client_, static_cast<uint32_t>(request.argument));
      break;
    case v1::Opcode::kLocations: {
      Result<std::vector<PageLocation>> locations = engine_.locations(client_, range);
      status = locations.status();
      if (locations.ok()) response = v1::encode_locations(locations.value());
      break;
    }
    case v1::Opcode::kStats: {
      Result<RuntimeStats> stats = engine_.stats(client_);
      status = stats.status();
      if (stats.ok()) response = v1::encode_stats(stats.value());
      break;
    }
    case v1::Opcode::kCreateChannel:
    case v1::Opcode::kOpenChannel: {
      if (config_.channels == nullptr) {
        status = unimplemented("this membard serves no channels");
        break;
      }
      std::string name(request_payload_.begin(), request_payload_.end());
      Result<ChannelGrant> grant = Status::Ok();
      if (request.opcode == static_cast<uint16_t>(v1::Opcode::kCreateChannel)) {
        Result<uint32_t> host_frames = engine_.client_window_frames(client_, Tier::kHost);
        uint64_t limit = host_frames.ok() ? uint64_t{host_frames.value()} * kFrameBytes : 0;
        grant = config_.channels->create(client_, config_.uid, name, request.argument, limit);
      } else {
        grant = config_.channels->open(config_.uid, name);
      }
      status = grant.status();
      if (!grant.ok()) break;
      // The descriptor travels before the completion (Note [Two channels]).
      v1::ChannelNoticeV1 notice{grant.value().id, grant.value().writable ? v1::kChannelWritable : 0u,
                                 grant.value().bytes};
      status = channel_->send(v1::MessageType::kChannelGrant, notice, grant.value().fd);
      ::close(grant.value().fd);
      if (!status.ok()) {
        if (request.opcode == static_cast<uint16_t>(v1::Opcode::kCreateChannel)) {
          (void)config_.channels->close(client_, grant.value().id);
        }
        break;
      }
      completion.value = grant.value().id;
      spdlog::debug("client {}: {} channel '{}' ({} bytes)", client_, v1::opcode_name(request.opcode), name,
                    grant.value().bytes);
      break;
    }
    case v1::Opcode::kCloseChannel:
      status = config_.channels == nullptr ? unimplemented("this membard serves no channels")
                                           : config_.channels->close(client_, static_cast<uint32_t>(request.argument));
      break;
  }
  if (!status.ok()) {
    complete_error(request, status);
    return;
  }
  if (!write_response(response)) {
    complete_error(request, resource_exhausted("the reply (" + std::to_string(response.size()) +
                                               " bytes) does not fit the response area"));
    return;
  }
  completion.payload_bytes = static_cast<uint32_t>(response.size());
  post(completion);
}

}  // namespace membar::runtimed
