#include "session.h"

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <cstring>

namespace membar::runtimed {

namespace v2 = protocol::v2;

// ---------------------------------------------------------------------------------------------
// SessionChannel (Note [Writes never block the daemon])

SessionChannel::SessionChannel(int socket_fd, OutboundLimits limits, std::function<void()> want_write)
    : limits_(limits), want_write_(std::move(want_write)), socket_(socket_fd) {}

Status SessionChannel::send(v2::MessageType type, std::span<const uint8_t> payload, std::span<const int> fds) {
  std::vector<uint8_t> bytes = v2::encode_message(type, payload, static_cast<uint32_t>(fds.size()));
  bool wake = false;
  Status status = Status::Ok();
  {
    std::lock_guard<std::mutex> lock(send_mutex_);
    if (closed_) return unavailable("the peer's connection is closed");
    if (overflowed_.load(std::memory_order_relaxed)) return resource_exhausted("the peer's write queue overflowed");
    size_t sent = 0;
    if (queue_.empty()) {
      Result<size_t> written = wire::send_some(socket_.get(), bytes, fds);
      if (!written.ok()) return written.status();  // the loop sees the closed socket and drops the peer
      sent = written.value();
      if (sent == bytes.size()) return Status::Ok();
    }
    if (queued_bytes_ + (bytes.size() - sent) > limits_.max_bytes ||
        queued_fds_ + (sent == 0 ? fds.size() : 0) > limits_.max_fds) {
      overflowed_.store(true, std::memory_order_release);
      status = resource_exhausted("the peer stopped reading: " + std::to_string(queued_bytes_) + " bytes and " +
                                  std::to_string(queued_fds_) + " descriptors queued");
    } else {
      Pending pending;
      pending.bytes = std::move(bytes);
      pending.offset = sent;
      if (sent == 0) {
        for (int fd : fds) {
          int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
          if (copy < 0) {
            overflowed_.store(true, std::memory_order_release);
            status = resource_exhausted("the daemon is out of descriptors for a queued message");
            break;
          }
          pending.fds.emplace_back(copy);
        }
      }
      if (status.ok()) {
        queued_bytes_ += pending.bytes.size() - pending.offset;
        queued_fds_ += pending.fds.size();
        queue_.push_back(std::move(pending));
      }
    }
    wake = true;
  }
  if (wake && want_write_) want_write_();
  return status;
}

Result<bool> SessionChannel::flush() {
  std::lock_guard<std::mutex> lock(send_mutex_);
  return flush_locked();
}

Result<bool> SessionChannel::flush_locked() {
  if (closed_) return true;
  while (!queue_.empty()) {
    Pending& front = queue_.front();
    std::vector<int> fds;
    for (const UniqueFd& fd : front.fds) fds.push_back(fd.get());
    std::span<const uint8_t> rest(front.bytes.data() + front.offset, front.bytes.size() - front.offset);
    MEMBAR_ASSIGN_OR_RETURN(size_t written, wire::send_some(socket_.get(), rest, fds));
    if (written == 0) return false;
    if (!front.fds.empty()) {
      queued_fds_ -= front.fds.size();
      front.fds.clear();
    }
    front.offset += written;
    queued_bytes_ -= written;
    if (front.offset == front.bytes.size()) queue_.pop_front();
  }
  return true;
}

uint64_t SessionChannel::queued_bytes() const {
  std::lock_guard<std::mutex> lock(send_mutex_);
  return queued_bytes_;
}

void SessionChannel::set_segment(std::shared_ptr<SharedSegment> segment) {
  std::lock_guard<std::mutex> lock(segment_mutex_);
  segment_ = std::move(segment);
}

namespace {
void wake_client(v2::SegmentHeaderV2* header) {
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
  v2::SegmentHeaderV2* header = segment_->header();
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
  v2::SegmentHeaderV2* header = segment_->header();
  std::atomic_ref<uint32_t>(header->daemon_state).store(v2::kDaemonShuttingDown, std::memory_order_release);
  // Wake unconditionally: the client may be between its check and its sleep.
  std::atomic_ref<uint32_t>(header->completion_doorbell).fetch_add(1, std::memory_order_release);
  protocol::futex_wake_all(&header->completion_doorbell);
}

void SessionChannel::close() {
  {
    std::lock_guard<std::mutex> lock(send_mutex_);
    closed_ = true;
    socket_.reset();
    queue_.clear();
    queued_bytes_ = 0;
    queued_fds_ = 0;
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
  const v2::SegmentLayout& layout = segment_->layout();
  requests_ = protocol::RingEnd<v2::RequestV2>(segment_->base() + layout.request_ring_offset, layout.ring_capacity);
  completions_ = protocol::RingEnd<v2::CompletionV2>(segment_->base() + layout.completion_ring_offset,
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
    v2::RequestV2 request;
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
  const v2::SegmentLayout& layout = segment_->layout();
  if (bytes.size() > layout.response_payload_bytes) return false;
  if (!bytes.empty()) std::memcpy(segment_->base() + layout.response_payload_offset, bytes.data(), bytes.size());
  return true;
}

bool RingServer::post(const v2::CompletionV2& completion) {
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

void RingServer::complete_error(const v2::RequestV2& request, const Status& status) {
  v2::CompletionV2 completion{};
  completion.sequence = request.sequence;
  completion.opcode = request.opcode;
  completion.status = static_cast<int32_t>(status.code());
  completion.events_through = channel_->events_queued();
  const std::string& message = status.message();
  size_t bytes = std::min<size_t>(message.size(), 4096);
  if (write_response(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(message.data()), bytes))) {
    completion.payload_bytes = static_cast<uint32_t>(bytes);
  }
  spdlog::debug("client {}: {} failed: {}", client_, v2::opcode_name(request.opcode), status.to_string());
  post(completion);
}

void RingServer::handle(const v2::RequestV2& request) {
  const v2::SegmentLayout& layout = segment_->layout();
  Status valid = v2::validate_request(request, layout.request_payload_bytes);
  if (!valid.ok()) {
    complete_error(request, valid);
    return;
  }
  // Copy the payload out before decoding it: the client could rewrite it meanwhile.
  request_payload_.assign(segment_->base() + layout.request_payload_offset,
                          segment_->base() + layout.request_payload_offset + request.payload_bytes);
  if (request.stall_ns != 0) (void)engine_.add_stall_ns(client_, request.stall_ns);

  Answer answer;
  Status status;
  switch (static_cast<v2::Opcode>(request.opcode)) {
#define MEMBAR_OPCODE_CASE(Name, number, text, range, flags, payload, argument) \
  case v2::Opcode::k##Name:                                                      \
    status = handle_##Name(request, answer);                                     \
    break;
    MEMBAR_PROTOCOL_OPCODES(MEMBAR_OPCODE_CASE)
#undef MEMBAR_OPCODE_CASE
  }
  if (!status.ok()) {
    complete_error(request, status);
    return;
  }
  if (!write_response(answer.payload)) {
    complete_error(request, resource_exhausted("the reply (" + std::to_string(answer.payload.size()) +
                                               " bytes) does not fit the response area"));
    return;
  }
  v2::CompletionV2 completion{};
  completion.sequence = request.sequence;
  completion.opcode = request.opcode;
  completion.ticket = answer.ticket;
  completion.value = answer.value;
  completion.payload_bytes = static_cast<uint32_t>(answer.payload.size());
  // Every event the request caused was queued before this (the engine delivers a call's events
  // before it returns).
  completion.events_through = channel_->events_queued();
  post(completion);
}

// ---- Handlers (one per row of MEMBAR_PROTOCOL_OPCODES) --------------------------------------------

namespace {
PageRange range_of(const v2::RequestV2& request) {
  return PageRange{request.space, request.first_page, request.page_count};
}
}  // namespace

Status RingServer::handle_Nop(const v2::RequestV2&, Answer&) { return Status::Ok(); }

Status RingServer::handle_CreateSpace(const v2::RequestV2& request, Answer& answer) {
  std::string name(request_payload_.begin(), request_payload_.end());
  MEMBAR_RETURN_IF_ERROR(v2::validate_name(name, "space"));
  MEMBAR_ASSIGN_OR_RETURN(SpaceId space, engine_.create_space(client_, name, request.argument, request.page_count));
  answer.value = space;
  return Status::Ok();
}

Status RingServer::handle_DestroySpace(const v2::RequestV2& request, Answer&) {
  return engine_.destroy_space(client_, request.space);
}

Status RingServer::handle_Acquire(const v2::RequestV2& request, Answer& answer) {
  MEMBAR_ASSIGN_OR_RETURN(answer.ticket, engine_.acquire(client_, range_of(request), request.flags));
  return Status::Ok();
}

Status RingServer::handle_Release(const v2::RequestV2& request, Answer&) {
  bool dirty = (request.flags & v2::kReleaseDirty) != 0;
  if ((request.flags & v2::kReleaseAfterMarker) != 0) {
    return engine_.release_after(client_, range_of(request), dirty, request.argument);
  }
  return engine_.release(client_, range_of(request), dirty);
}

Status RingServer::handle_AcquireRanges(const v2::RequestV2& request, Answer& answer) {
  MEMBAR_ASSIGN_OR_RETURN(std::vector<PageRange> ranges, v2::decode_ranges(request_payload_));
  std::optional<uint32_t> advance;
  if ((request.flags & v2::kAcquireAdvanceFlag) != 0) advance = static_cast<uint32_t>(request.argument);
  uint32_t flags = request.flags & (v2::kAcquireWriteFlag | v2::kAcquireZeroNewFlag);
  MEMBAR_ASSIGN_OR_RETURN(answer.ticket, engine_.acquire_ranges(client_, ranges, flags, advance));
  return Status::Ok();
}

Status RingServer::handle_ReleaseRanges(const v2::RequestV2& request, Answer&) {
  MEMBAR_ASSIGN_OR_RETURN(std::vector<PageRange> ranges, v2::decode_ranges(request_payload_));
  std::optional<uint64_t> marker;
  if ((request.flags & v2::kReleaseAfterMarker) != 0) marker = request.argument;
  return engine_.release_ranges(client_, ranges, (request.flags & v2::kReleaseDirty) != 0, marker);
}

Status RingServer::handle_CopyPages(const v2::RequestV2& request, Answer& answer) {
  MEMBAR_ASSIGN_OR_RETURN(std::vector<PageRange> pairs, v2::decode_ranges(request_payload_));
  std::optional<uint64_t> marker;
  if ((request.flags & v2::kCopyAfterMarker) != 0) marker = request.argument;
  MEMBAR_ASSIGN_OR_RETURN(answer.ticket, engine_.copy_pages(client_, pairs, marker));
  return Status::Ok();
}

Status RingServer::handle_Prefetch(const v2::RequestV2& request, Answer& answer) {
  MEMBAR_ASSIGN_OR_RETURN(answer.ticket, engine_.prefetch(client_, range_of(request)));
  return Status::Ok();
}

Status RingServer::handle_PrefetchRanges(const v2::RequestV2& request, Answer& answer) {
  MEMBAR_ASSIGN_OR_RETURN(std::vector<PageRange> ranges, v2::decode_ranges(request_payload_));
  Ticket last = 0;
  for (const PageRange& range : ranges) {
    MEMBAR_ASSIGN_OR_RETURN(Ticket ticket, engine_.prefetch(client_, range));
    last = std::max(last, ticket);
  }
  answer.ticket = last;
  return Status::Ok();
}

Status RingServer::handle_Offload(const v2::RequestV2& request, Answer& answer) {
  MEMBAR_ASSIGN_OR_RETURN(answer.ticket, engine_.offload(client_, range_of(request)));
  return Status::Ok();
}

Status RingServer::handle_FreePages(const v2::RequestV2& request, Answer&) {
  return engine_.free_pages(client_, range_of(request));
}

Status RingServer::handle_AcquireHost(const v2::RequestV2& request, Answer& answer) {
  MEMBAR_ASSIGN_OR_RETURN(answer.ticket, engine_.acquire_host(client_, range_of(request)));
  return Status::Ok();
}

Status RingServer::handle_ReleaseHost(const v2::RequestV2& request, Answer&) {
  return engine_.release_host(client_, range_of(request), (request.flags & v2::kReleaseDirty) != 0);
}

// Note [A schedule in parts]
// Rationale: a schedule grows with the square of the context (each chunk names its history):
// at 1M tokens the sparse step's is ~30 MB, while a request's payload area is 1 MiB.
// Approach: the client library splits a schedule that does not fit into parts at step
// boundaries; every part but the last carries kScheduleMoreFlag. The ring server appends each
// part's steps and hands the whole schedule to the engine with the last part, so the engine sees
// one set_schedule as in the embedded runtime. A failed part (bad encoding, or more than
// kMaxScheduleBytes buffered, which bounds what one client can make the daemon hold) drops the
// parts so far and fails; the client's previous schedule stays installed until a whole new one
// arrives.
// Limitations: a single step larger than the payload area cannot be sent (the client says so).
Status RingServer::handle_SetSchedule(const v2::RequestV2& request, Answer&) {
  Result<std::vector<ScheduleStep>> part = v2::decode_schedule(request_payload_);
  if (!part.ok()) {
    schedule_parts_.clear();
    schedule_part_bytes_ = 0;
    return part.status();
  }
  schedule_part_bytes_ += request_payload_.size();
  if (schedule_part_bytes_ > v2::kMaxScheduleBytes) {
    schedule_parts_.clear();
    schedule_part_bytes_ = 0;
    return resource_exhausted("set_schedule: a schedule may take at most " + std::to_string(v2::kMaxScheduleBytes) +
                              " encoded bytes");
  }
  std::vector<ScheduleStep>& steps = part.value();
  if (schedule_parts_.empty()) {
    schedule_parts_ = std::move(steps);
  } else {
    schedule_parts_.insert(schedule_parts_.end(), std::make_move_iterator(steps.begin()),
                           std::make_move_iterator(steps.end()));
  }
  if ((request.flags & v2::kScheduleMoreFlag) != 0) return Status::Ok();
  std::vector<ScheduleStep> whole = std::move(schedule_parts_);
  schedule_parts_.clear();
  schedule_part_bytes_ = 0;
  return engine_.set_schedule(client_, std::move(whole));
}

Status RingServer::handle_Advance(const v2::RequestV2& request, Answer&) {
  return engine_.advance(client_, static_cast<uint32_t>(request.argument));
}

Status RingServer::handle_Stats(const v2::RequestV2&, Answer& answer) {
  MEMBAR_ASSIGN_OR_RETURN(RuntimeStats stats, engine_.stats(client_, 0, v2::kMaxStatsSpaces));
  answer.payload = v2::encode_stats(stats);
  return Status::Ok();
}

Status RingServer::grant_channel(Result<ChannelGrant> grant, bool created, Answer& answer) {
  MEMBAR_RETURN_IF_ERROR(grant.status());
  UniqueFd fd(grant.value().fd);
  // The descriptor travels as an event, before the completion (Note [Two channels]).
  v2::ChannelNoticeV2 notice{0, grant.value().id, grant.value().writable ? v2::kChannelWritable : 0u,
                             grant.value().bytes};
  Status sent = channel_->send_event(v2::MessageType::kChannelGrant, notice, fd.get());
  if (!sent.ok()) {
    if (created) (void)config_.channels->close(client_, grant.value().id);
    return sent;
  }
  answer.value = grant.value().id;
  return Status::Ok();
}

Status RingServer::handle_CreateChannel(const v2::RequestV2& request, Answer& answer) {
  if (config_.channels == nullptr) return unimplemented("this membard serves no channels");
  std::string name(request_payload_.begin(), request_payload_.end());
  MEMBAR_RETURN_IF_ERROR(v2::validate_name(name, "channel"));
  // Channel memory counts against the client's host quota and the host pool (Note [Channels]).
  MEMBAR_RETURN_IF_ERROR(engine_.reserve_channel_bytes(client_, request.argument));
  Result<ChannelGrant> grant = config_.channels->create(client_, config_.uid, name, request.argument);
  if (!grant.ok()) {
    (void)engine_.release_channel_bytes(client_, request.argument);
    return grant.status();
  }
  Status granted = grant_channel(std::move(grant), true, answer);
  if (!granted.ok()) (void)engine_.release_channel_bytes(client_, request.argument);
  return granted;
}

Status RingServer::handle_OpenChannel(const v2::RequestV2&, Answer& answer) {
  if (config_.channels == nullptr) return unimplemented("this membard serves no channels");
  std::string name(request_payload_.begin(), request_payload_.end());
  MEMBAR_RETURN_IF_ERROR(v2::validate_name(name, "channel"));
  return grant_channel(config_.channels->open(config_.uid, name), false, answer);
}

Status RingServer::handle_CloseChannel(const v2::RequestV2& request, Answer&) {
  if (config_.channels == nullptr) return unimplemented("this membard serves no channels");
  MEMBAR_ASSIGN_OR_RETURN(uint64_t bytes, config_.channels->close(client_, static_cast<uint32_t>(request.argument)));
  return engine_.release_channel_bytes(client_, bytes);
}

Status RingServer::handle_PublishChannel(const v2::RequestV2& request, Answer&) {
  if (config_.channels == nullptr) return unimplemented("this membard serves no channels");
  return config_.channels->publish(client_, static_cast<uint32_t>(request.argument));
}

}  // namespace membar::runtimed
