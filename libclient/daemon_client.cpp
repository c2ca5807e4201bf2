// The daemon client: membar::Client over a membard (see membar/protocol/v2.h, Note [Two
// channels]).
//
// Every call is one request on the shared-memory request ring and one completion back. Frame
// events (grants with their descriptors, maps, unmaps, revocations) arrive on the control socket,
// numbered; before the result of a completion is used, the socket is read until the event the
// completion names (events_through) has been applied, so every page the call hands out is mapped.
// Liveness: while it waits, a call polls the socket (a closed socket means the daemon is gone)
// and the segment's daemon_state word (set when the daemon shuts down), so it returns
// UNAVAILABLE instead of hanging; after that every call returns UNAVAILABLE at once.

#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "channel_table.h"
#include "membar/common/wire_socket.h"
#include "membar/protocol/ring.h"
#include "membar/protocol/v2.h"
#include "memory.h"
#include "retry.h"
#if defined(MEMBAR_WITH_CUDA)
#include "cuda/stream_signal.h"
#endif

namespace membar {
namespace {

namespace v2 = protocol::v2;

// Signal word indices (membar/engine/engine.h; repeated here because the client does not include
// the engine's headers in daemon mode).
constexpr uint32_t kSignalCompletedWord = 0;
constexpr uint32_t kSignalReleasedWord = 1;
constexpr uint64_t kSignalBlockBytes = 4096;

uint64_t env_milliseconds(const char* name, uint64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == 0) return fallback;
  char* end = nullptr;
  unsigned long long value = std::strtoull(text, &end, 10);
  return (end != text && *end == 0 && value > 0) ? value : fallback;
}

// How long a waiting call spins before it sleeps on a futex. The daemon usually answers within a
// few microseconds; bounding the spin by time (not by count) matters on a loaded machine, where
// one sched_yield can give away a whole time slice.
constexpr uint64_t kSpinNs = 30'000;

// One step of the spin: a pause for the first few, then sched_yield, so that on a machine with
// more runnable threads than cores (CI) the daemon's ring thread can run on this core.
void spin_step(uint32_t spins) {
  if (spins < 16) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  } else {
    sched_yield();
  }
}

// The reply to one request: completion fields plus the response payload, copied out.
struct Reply {
  Ticket ticket = 0;
  uint64_t value = 0;
  std::vector<uint8_t> payload;
};

class DaemonClient final : public Client {
 public:
  ~DaemonClient() override {
#if defined(MEMBAR_WITH_CUDA)
    stream_signals_.reset();
#endif
    // Closing the socket is what tells the daemon to reclaim this client's memory.
    socket_.reset();
    memory_.reset();
    if (segment_ != nullptr) ::munmap(segment_, segment_bytes_);
    if (signal_words_ != nullptr) ::munmap(const_cast<uint64_t*>(signal_words_), kSignalBlockBytes);
  }

  static Result<std::unique_ptr<Client>> create(const std::string& socket_path, const ConnectOptions& options);

  std::string describe() const override { return "daemon:" + socket_path_; }
  // The daemon's threads, not this process's, finish what the stream waits for.
  bool stream_waits_preferred() const override { return backend_ == BackendKind::kCuda; }
  BackendKind backend() const override { return backend_; }
  int device() const override { return device_; }

  Result<SpaceId> create_space(const std::string& name, uint64_t page_bytes, uint32_t page_count) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_RETURN_IF_ERROR(v2::validate_name(name, "space"));
    v2::RequestV2 request = make_request(v2::Opcode::kCreateSpace);
    request.argument = page_bytes;
    request.page_count = page_count;
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, call(request, as_bytes(name)));
    auto space = static_cast<SpaceId>(reply.value);
    Status reserved = memory_->add_space(space, page_bytes, page_count);
    if (!reserved.ok()) {
      v2::RequestV2 undo = make_request(v2::Opcode::kDestroySpace);
      undo.space = space;
      (void)call(undo);
      return reserved;
    }
    return space;
  }

  Status destroy_space(SpaceId space) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v2::RequestV2 request = make_request(v2::Opcode::kDestroySpace);
    request.space = space;
    MEMBAR_RETURN_IF_ERROR(call(request).status());
    return memory_->remove_space(space);
  }

  Result<SpaceView> space_view(SpaceId space) const override { return memory_->view(space); }

  Result<Acquired> acquire(PageRange range, uint32_t flags) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(SpaceView view, memory_->view(range.space));
    v2::RequestV2 request = range_request(v2::Opcode::kAcquire, range);
    request.flags = flags;
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, retried([&] { return call(request); }));
    MEMBAR_RETURN_IF_ERROR(memory_->settle_ranges(&range, 1));
    return Acquired{reply.ticket, static_cast<char*>(view.gpu) + uint64_t(range.first_page) * view.page_bytes};
  }

  Status release(PageRange range, bool dirty) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v2::RequestV2 request = range_request(v2::Opcode::kRelease, range);
    request.flags = dirty ? v2::kReleaseDirty : 0;
    return call(request).status();
  }

  Result<Ticket> acquire_ranges(const std::vector<PageRange>& ranges, uint32_t flags,
                                std::optional<uint32_t> advance_step) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v2::RequestV2 request = make_request(v2::Opcode::kAcquireRanges);
    request.flags = flags;
    if (advance_step.has_value()) {
      request.flags |= v2::kAcquireAdvanceFlag;
      request.argument = *advance_step;
    }
    std::vector<uint8_t> payload = v2::encode_ranges(ranges);
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, retried([&] { return call(request, payload); }));
    MEMBAR_RETURN_IF_ERROR(memory_->settle_ranges(ranges));   // Note [Maps off the caller's thread]
    return reply.ticket;
  }

  Status release_ranges(const std::vector<PageRange>& ranges, bool dirty) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v2::RequestV2 request = make_request(v2::Opcode::kReleaseRanges);
    request.flags = dirty ? v2::kReleaseDirty : 0;
    return call(request, v2::encode_ranges(ranges)).status();
  }

  // Note [Copied pages] in engine/page_copies.cpp. With a marker, the daemon holds the copies until
  // it sees the client's released word reach it.
  Result<Ticket> copy_pages(const std::vector<PageRange>& pairs, std::optional<uint64_t> after_marker) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v2::RequestV2 request = make_request(v2::Opcode::kCopyPages);
    if (after_marker.has_value()) {
      MEMBAR_RETURN_IF_ERROR(check_marker(*after_marker));
      request.flags = v2::kCopyAfterMarker;
      request.argument = *after_marker;
    }
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, retried([&] { return call(request, v2::encode_ranges(pairs)); }));
    MEMBAR_RETURN_IF_ERROR(memory_->settle());   // host frames a destination took
    return reply.ticket;
  }

  Result<uint64_t> stream_mark(void* cuda_stream) override {
#if defined(MEMBAR_WITH_CUDA)
    if (stream_signals_) {
      std::lock_guard<std::mutex> lock(mutex_);
      uint64_t marker = ++release_marker_;
      MEMBAR_RETURN_IF_ERROR(stream_signals_->stream_write(kSignalReleasedWord, marker, cuda_stream));
      return marker;
    }
#endif
    (void)cuda_stream;
    return unimplemented("stream_mark needs the CUDA backend; this client runs on " + describe());
  }

  // A marker copy_pages may wait for: one stream_mark or stream_release wrote (0 is none; a later one
  // would never be reached and hold the copies forever).
  Status check_marker(uint64_t marker) const {
    if (marker == 0 || marker > release_marker_) {
      return invalid_argument("copy_pages: after_marker " + std::to_string(marker) +
                              " was not written by this client's stream_mark or stream_release (the last was " +
                              std::to_string(release_marker_) + ")");
    }
    return Status::Ok();
  }

  Result<Ticket> prefetch(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, retried([&] { return call(range_request(v2::Opcode::kPrefetch, range)); }));
    MEMBAR_RETURN_IF_ERROR(memory_->settle());
    return reply.ticket;
  }

  Result<Ticket> prefetch_ranges(const std::vector<PageRange>& ranges) override {
    if (ranges.empty()) return Ticket{0};
    std::lock_guard<std::mutex> lock(mutex_);
    v2::RequestV2 request = make_request(v2::Opcode::kPrefetchRanges);
    std::vector<uint8_t> payload = v2::encode_ranges(ranges);
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, retried([&] { return call(request, payload); }));
    MEMBAR_RETURN_IF_ERROR(memory_->settle());
    return reply.ticket;
  }

  Result<Ticket> offload(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, retried([&] { return call(range_request(v2::Opcode::kOffload, range)); }));
    MEMBAR_RETURN_IF_ERROR(memory_->settle());
    return reply.ticket;
  }

  Status free_pages(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_RETURN_IF_ERROR(call(range_request(v2::Opcode::kFreePages, range)).status());
    return memory_->settle();
  }

  Result<void*> acquire_host(PageRange range) override {
    Ticket ticket = 0;
    SpaceView view;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(view, memory_->view(range.space));
      MEMBAR_ASSIGN_OR_RETURN(Reply reply,
                              retried([&] { return call(range_request(v2::Opcode::kAcquireHost, range)); }));
      ticket = reply.ticket;
      MEMBAR_RETURN_IF_ERROR(memory_->settle_ranges(&range, 1));
    }
    MEMBAR_RETURN_IF_ERROR(wait(ticket));
    return static_cast<void*>(static_cast<char*>(view.host) + uint64_t(range.first_page) * view.page_bytes);
  }

  Status release_host(PageRange range, bool dirty) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v2::RequestV2 request = range_request(v2::Opcode::kReleaseHost, range);
    request.flags = dirty ? v2::kReleaseDirty : 0;
    return call(request).status();
  }

  Status add_stall_ns(uint64_t ns) override {
    if (dead_.load(std::memory_order_acquire)) return dead_status();
    pending_stall_ns_.fetch_add(ns, std::memory_order_relaxed);
    return Status::Ok();
  }

  // A schedule larger than the payload area goes in parts (Note [A schedule in parts] in
  // runtimed/daemon/session.cpp): each part as many whole steps as fit.
  Status set_schedule(std::vector<ScheduleStep> steps) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t capacity = layout_.request_payload_bytes;
    size_t first = 0;
    do {
      uint64_t bytes = sizeof(uint32_t);
      size_t end = first;
      for (; end < steps.size(); ++end) {
        uint64_t step_bytes = sizeof(uint32_t) + 3 * sizeof(uint32_t) * uint64_t{steps[end].ranges.size()};
        if (bytes + step_bytes > capacity) break;
        bytes += step_bytes;
      }
      if (end == first && end < steps.size()) {
        return invalid_argument("set_schedule: step " + std::to_string(end) + " names " +
                                std::to_string(steps[end].ranges.size()) + " page ranges; at most " +
                                std::to_string((capacity - 2 * sizeof(uint32_t)) / (3 * sizeof(uint32_t))) +
                                " fit one request");
      }
      std::vector<ScheduleStep> part(std::make_move_iterator(steps.begin() + first),
                                     std::make_move_iterator(steps.begin() + end));
      v2::RequestV2 request = make_request(v2::Opcode::kSetSchedule);
      if (end < steps.size()) request.flags = v2::kScheduleMoreFlag;
      MEMBAR_RETURN_IF_ERROR(call(request, v2::encode_schedule(part)).status());
      first = end;
    } while (first < steps.size());
    return Status::Ok();
  }

  Status advance(uint32_t step) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v2::RequestV2 request = make_request(v2::Opcode::kAdvance);
    request.argument = step;
    return call(request).status();
  }

  // Not under the call mutex: other threads keep issuing calls while one waits.
  Status wait(Ticket ticket) override {
    if (completed_ticket() >= ticket) return Status::Ok();
    uint64_t issued = last_ticket_.load(std::memory_order_acquire);
    if (ticket > issued) {
      return invalid_argument("wait: ticket " + std::to_string(ticket) + " was never issued to this client (the last is " +
                              std::to_string(issued) + ")");
    }
    uint64_t start = protocol::monotonic_ns();
    uint64_t deadline = start + wait_timeout_ms_ * 1000000ull;
    Status result = Status::Ok();
    auto* header = segment_header();
    uint64_t spin_until = start + kSpinNs;
    for (uint32_t spins = 0;; ++spins) {
      if (completed_ticket() >= ticket) break;
      if (dead_.load(std::memory_order_acquire)) {
        result = dead_status();
        break;
      }
      if (protocol::monotonic_ns() < spin_until) {
        spin_step(spins);
        continue;
      }
      Status alive = check_alive();
      if (!alive.ok()) {
        result = alive;
        break;
      }
      uint64_t now = protocol::monotonic_ns();
      if (now > deadline) {
        result = Status(StatusCode::DEADLINE_EXCEEDED, "ticket " + std::to_string(ticket) + " did not complete within " +
                                                           std::to_string(wait_timeout_ms_) + " ms (completed: " +
                                                           std::to_string(completed_ticket()) + ")");
        break;
      }
      auto doorbell = std::atomic_ref<uint32_t>(header->completion_doorbell);
      auto waiting = std::atomic_ref<uint32_t>(header->client_waiting);
      uint32_t seen = doorbell.load(std::memory_order_acquire);
      waiting.store(1, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (completed_ticket() < ticket) protocol::futex_wait(&header->completion_doorbell, seen, 5'000'000);
      waiting.store(0, std::memory_order_relaxed);
    }
    pending_stall_ns_.fetch_add(protocol::monotonic_ns() - start, std::memory_order_relaxed);
    return result;
  }

  Ticket completed_ticket() const override {
    uint64_t from_segment =
        std::atomic_ref<uint64_t>(segment_header()->completed_ticket).load(std::memory_order_acquire);
    uint64_t from_signal = signal_words_ != nullptr ? signal_words_[kSignalCompletedWord] : 0;
    return std::max(from_segment, from_signal);
  }

  Status stream_wait(Ticket ticket, void* cuda_stream) override {
#if defined(MEMBAR_WITH_CUDA)
    if (stream_signals_) return stream_signals_->stream_wait(kSignalCompletedWord, ticket, cuda_stream);
#endif
    return unimplemented("stream_wait needs the CUDA backend; this client runs on " + describe() +
                         " (use wait(ticket))");
  }

  // Stream-ordered: the stream writes the marker when it gets there; the daemon holds copies of
  // these pages (and their frames) until it sees the word (Note [Stream-ordered release]).
  // Nothing here waits for the GPU.
  Status stream_release(PageRange range, bool dirty, void* cuda_stream) override {
#if defined(MEMBAR_WITH_CUDA)
    if (stream_signals_) {
      std::lock_guard<std::mutex> lock(mutex_);
      uint64_t marker = ++release_marker_;
      MEMBAR_RETURN_IF_ERROR(stream_signals_->stream_write(kSignalReleasedWord, marker, cuda_stream));
      v2::RequestV2 request = range_request(v2::Opcode::kRelease, range);
      request.flags = (dirty ? v2::kReleaseDirty : 0) | v2::kReleaseAfterMarker;
      request.argument = marker;
      return call(request).status();
    }
#endif
    return unimplemented("stream_release needs the CUDA backend; this client runs on " + describe() +
                         " (use release)");
  }

  Status stream_release_ranges(const std::vector<PageRange>& ranges, bool dirty, void* cuda_stream) override {
#if defined(MEMBAR_WITH_CUDA)
    if (stream_signals_) {
      std::lock_guard<std::mutex> lock(mutex_);
      uint64_t marker = ++release_marker_;
      MEMBAR_RETURN_IF_ERROR(stream_signals_->stream_write(kSignalReleasedWord, marker, cuda_stream));
      v2::RequestV2 request = make_request(v2::Opcode::kReleaseRanges);
      request.flags = (dirty ? v2::kReleaseDirty : 0) | v2::kReleaseAfterMarker;
      request.argument = marker;
      return call(request, v2::encode_ranges(ranges)).status();
    }
#endif
    return unimplemented("stream_release needs the CUDA backend; this client runs on " + describe() +
                         " (use release)");
  }

  MapCounters map_counters() const override { return memory_->counters(); }

  Result<RuntimeStats> stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, call(make_request(v2::Opcode::kStats)));
    return v2::decode_stats(reply.payload);
  }

  Result<Channel> create_channel(const std::string& name, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v2::RequestV2 request = make_request(v2::Opcode::kCreateChannel);
    request.argument = bytes;
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, call(request, as_bytes(name)));
    MEMBAR_ASSIGN_OR_RETURN(Channel channel, take_channel_grant(static_cast<uint32_t>(reply.value), /*owner=*/true));
    // Mapped writable: now seal it and let readers find it (Note [Channels]).
    v2::RequestV2 publish = make_request(v2::Opcode::kPublishChannel);
    publish.argument = reply.value;
    Status published = call(publish).status();
    if (!published.ok()) {
      (void)channels_.remove(channel.handle, nullptr);
      return published;
    }
    return channel;
  }

  Result<Channel> open_channel(const std::string& name) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, call(make_request(v2::Opcode::kOpenChannel), as_bytes(name)));
    return take_channel_grant(static_cast<uint32_t>(reply.value), /*owner=*/false);
  }

  Status close_channel(uint32_t handle) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ChannelTable::Entry entry;
    MEMBAR_RETURN_IF_ERROR(channels_.remove(handle, &entry));
    if (!entry.owner) return Status::Ok();
    v2::RequestV2 request = make_request(v2::Opcode::kCloseChannel);
    request.argument = entry.runtime_id;
    return call(request).status();
  }

  // A round trip through the ring that the daemon answers without touching the engine (latency
  // benchmark). Not part of membar::Client; reached through daemon_client_nop() below.
  Status nop() {
    std::lock_guard<std::mutex> lock(mutex_);
    return call(make_request(v2::Opcode::kNop)).status();
  }

 private:
  DaemonClient() = default;

  Status handshake(const std::string& socket_path, const ConnectOptions& options);

  v2::SegmentHeaderV2* segment_header() const { return static_cast<v2::SegmentHeaderV2*>(segment_); }

  v2::RequestV2 make_request(v2::Opcode opcode) {
    v2::RequestV2 request{};
    request.opcode = static_cast<uint16_t>(opcode);
    return request;
  }
  v2::RequestV2 range_request(v2::Opcode opcode, PageRange range) {
    v2::RequestV2 request = make_request(opcode);
    request.space = range.space;
    request.first_page = range.first_page;
    request.page_count = range.page_count;
    return request;
  }

  template <typename Call>
  auto retried(Call&& call) -> decltype(call()) {
    return with_retry(std::forward<Call>(call), [this] { return !dead_.load(std::memory_order_acquire); });
  }

  void mark_dead(const Status& status) {
    std::lock_guard<std::mutex> lock(dead_mutex_);
    if (dead_.load()) return;
    dead_status_ = status;
    dead_.store(true, std::memory_order_release);
  }
  Status dead_status() {
    std::lock_guard<std::mutex> lock(dead_mutex_);
    return dead_status_;
  }

  // UNAVAILABLE once the daemon is known gone or shutting down. Drains the socket when no other
  // thread is doing so (wait() runs without the call mutex).
  Status check_alive() {
    if (dead_.load(std::memory_order_acquire)) return dead_status();
    if (std::atomic_ref<uint32_t>(segment_header()->daemon_state).load(std::memory_order_acquire) ==
        v2::kDaemonShuttingDown) {
      mark_dead(unavailable("membard at " + socket_path_ + " is shutting down"));
      // The socket's shutdown notice, if already there, has the daemon's reason.
      std::unique_lock<std::mutex> socket_lock(socket_mutex_, std::try_to_lock);
      if (socket_lock.owns_lock()) (void)drain_socket_locked();
      return dead_status();
    }
    pollfd p{socket_.get(), POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) {
      std::unique_lock<std::mutex> socket_lock(socket_mutex_, std::try_to_lock);
      if (socket_lock.owns_lock()) (void)drain_socket_locked();
    }
    if (dead_.load(std::memory_order_acquire)) return dead_status();
    return Status::Ok();
  }

  Status drain_socket() {
    std::lock_guard<std::mutex> lock(socket_mutex_);
    return drain_socket_locked();
  }

  // Reads and applies every message the socket holds (events, shutdown, errors).
  Status drain_socket_locked() {
    if (dead_.load(std::memory_order_acquire)) return dead_status();
    Result<bool> read = assembler_.read_available(socket_.get());
    for (;;) {
      Result<std::optional<wire::ReceivedMessage>> next = assembler_.next();
      if (!next.ok()) {
        mark_dead(unavailable("membard sent a malformed message: " + next.status().message()));
        break;
      }
      if (!next.value().has_value()) break;
      apply_message(*next.value());
    }
    if (!read.ok()) mark_dead(unavailable("membard at " + socket_path_ + " is gone (" + read.status().message() + ")"));
    if (dead_.load(std::memory_order_acquire)) return dead_status();
    return memory_->take_error();
  }

  // Reads the socket until event `through` has been applied (Note [Two channels]).
  Status await_events(uint64_t through, uint64_t deadline) {
    for (;;) {
      MEMBAR_RETURN_IF_ERROR(drain_socket());
      if (events_applied_ >= through) return Status::Ok();
      MEMBAR_RETURN_IF_ERROR(check_alive());
      uint64_t now = protocol::monotonic_ns();
      if (now > deadline) {
        mark_dead(Status(StatusCode::DEADLINE_EXCEEDED, "membard's frame events did not arrive within " +
                                                            std::to_string(call_timeout_ms_) + " ms"));
        return dead_status();
      }
      pollfd p{socket_.get(), POLLIN, 0};
      ::poll(&p, 1, 2);
    }
  }

  void apply_message(wire::ReceivedMessage& message) {
    auto type = static_cast<v2::MessageType>(message.header.type);
    uint64_t sequence = v2::event_sequence(type, message.payload);
    if (sequence != 0) {
      if (sequence != events_applied_ + 1) {
        mark_dead(internal_error("membard's event " + std::to_string(sequence) + " arrived after event " +
                                 std::to_string(events_applied_)));
        return;
      }
      events_applied_ = sequence;
    }
    auto note = [this](const Status& status) {
      if (!status.ok()) memory_->note_error(status);
    };
    switch (type) {
      case v2::MessageType::kFrameGrant: {
        Result<v2::FrameGrantV2> grant = v2::decode_frame_grant(message.payload);
        if (!grant.ok()) return note(grant.status());
        if (grant.value().window_frame >= gpu_quota_frames_) {
          return note(internal_error("membard granted GPU frame " + std::to_string(grant.value().window_frame) +
                                     ", beyond the quota it announced"));
        }
        return note(memory_->gpu_frame_granted(grant.value().window_frame, message.fds[0].release()));
      }
      case v2::MessageType::kFrameRevoke: {
        Result<v2::FrameEventV2> event = v2::decode_frame_event(message.payload);
        if (!event.ok()) return note(event.status());
        return note(memory_->gpu_frame_revoked(event.value().window_frame));
      }
      case v2::MessageType::kSlabGrant: {
        Result<v2::SlabGrantV2> grant = v2::decode_slab_grant(message.payload);
        if (!grant.ok()) return note(grant.status());
        if (grant.value().frames > host_slab_frames_) return note(internal_error("membard granted an oversized slab"));
        return note(memory_->host_slab_granted(grant.value().slab, grant.value().frames, message.fds[0].release()));
      }
      case v2::MessageType::kSlabRevoke: {
        Result<v2::SlabEventV2> event = v2::decode_slab_event(message.payload);
        if (!event.ok()) return note(event.status());
        return note(memory_->host_slab_revoked(event.value().slab));
      }
      case v2::MessageType::kFrameMap:
      case v2::MessageType::kFrameUnmap: {
        Result<v2::FrameMapV2> map = v2::decode_frame_map(message.payload);
        if (!map.ok()) return note(map.status());
        Tier tier = static_cast<Tier>(map.value().tier);
        if (type == v2::MessageType::kFrameMap) {
          return note(memory_->mapped(tier, map.value().window_frame, map.value().space, map.value().space_frame));
        }
        return note(memory_->unmapped(tier, map.value().window_frame, map.value().space, map.value().space_frame));
      }
      case v2::MessageType::kShutdown: {
        Result<v2::ShutdownV2> notice = v2::decode_shutdown(message.payload);
        std::string reason = notice.ok() ? std::string(notice.value().reason) : "no reason given";
        mark_dead(unavailable("membard at " + socket_path_ + " shut down: " + reason));
        return;
      }
      case v2::MessageType::kError: {
        Result<v2::ErrorV2> error = v2::decode_error(message.payload);
        if (error.ok()) {
          mark_dead(Status(static_cast<StatusCode>(error.value().status),
                           std::string("membard closed the connection: ") + error.value().message));
        } else {
          mark_dead(unavailable("membard closed the connection with a malformed error"));
        }
        return;
      }
      case v2::MessageType::kChannelGrant: {
        Result<v2::ChannelNoticeV2> notice = v2::decode_channel_notice(message.payload);
        if (!notice.ok()) return note(notice.status());
        channel_grants_[notice.value().channel] = std::move(message);
        return;
      }
      case v2::MessageType::kPong:
        return;
      default:
        mark_dead(unavailable("membard sent unexpected message type " + std::to_string(message.header.type)));
        return;
    }
  }

  static std::span<const uint8_t> as_bytes(const std::string& text) {
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  }

  // The channel's descriptor arrived on the socket before the completion (awaited by call()).
  Result<Channel> take_channel_grant(uint32_t runtime_id, bool owner) {
    wire::ReceivedMessage grant;
    {
      std::lock_guard<std::mutex> socket_lock(socket_mutex_);
      auto it = channel_grants_.find(runtime_id);
      if (it == channel_grants_.end()) {
        return internal_error("membard answered channel " + std::to_string(runtime_id) + " without its descriptor");
      }
      grant = std::move(it->second);
      channel_grants_.erase(it);
    }
    MEMBAR_ASSIGN_OR_RETURN(v2::ChannelNoticeV2 notice, v2::decode_channel_notice(grant.payload));
    return channels_.add(grant.fds[0].release(), runtime_id, notice.bytes, (notice.flags & v2::kChannelWritable) != 0,
                         owner);
  }

  // One request and its completion. Caller holds mutex_.
  Result<Reply> call(v2::RequestV2 request, std::span<const uint8_t> payload = {}) {
    if (dead_.load(std::memory_order_acquire)) return dead_status();
    MEMBAR_RETURN_IF_ERROR(drain_socket());
    MEMBAR_RETURN_IF_ERROR(check_alive());
    if (payload.size() > layout_.request_payload_bytes) {
      return invalid_argument(std::string(v2::opcode_name(request.opcode)) + ": request of " +
                              std::to_string(payload.size()) + " bytes exceeds the " +
                              std::to_string(layout_.request_payload_bytes) + "-byte payload area");
    }
    uint8_t* base = static_cast<uint8_t*>(segment_);
    if (!payload.empty()) std::memcpy(base + layout_.request_payload_offset, payload.data(), payload.size());
    request.payload_bytes = static_cast<uint32_t>(payload.size());
    request.sequence = ++sequence_;
    request.stall_ns = pending_stall_ns_.exchange(0, std::memory_order_relaxed);
    if (!requests_.try_push(request)) {
      mark_dead(internal_error("the request ring is full although no request is outstanding"));
      return dead_status();
    }

    uint64_t pushed = protocol::monotonic_ns();
    uint64_t deadline = pushed + call_timeout_ms_ * 1000000ull;
    uint64_t spin_until = pushed + kSpinNs;
    v2::CompletionV2 completion;
    for (uint32_t spins = 0;; ++spins) {
      int popped = completions_.try_pop(completion);
      if (popped < 0) {
        mark_dead(unavailable("membard's completion ring is corrupted"));
        return dead_status();
      }
      if (popped > 0) {
        if (completion.sequence == request.sequence) break;
        continue;  // a completion of an earlier, abandoned request: skip it
      }
      // Spin for a few microseconds (the daemon's ring thread answers fast when awake), then
      // sleep on the doorbell in short slices, checking the daemon's liveness in between.
      if (protocol::monotonic_ns() < spin_until) {
        spin_step(spins);
        continue;
      }
      MEMBAR_RETURN_IF_ERROR(check_alive());
      if (protocol::monotonic_ns() > deadline) {
        mark_dead(Status(StatusCode::DEADLINE_EXCEEDED, std::string("membard did not answer ") +
                                                            std::string(v2::opcode_name(request.opcode)) + " within " +
                                                            std::to_string(call_timeout_ms_) + " ms"));
        return dead_status();
      }
      completions_.wait_for_entries(2'000'000);
    }
    MEMBAR_RETURN_IF_ERROR(v2::validate_completion(completion, layout_.response_payload_bytes));
    Reply reply;
    reply.ticket = completion.ticket;
    reply.value = completion.value;
    const uint8_t* response = base + layout_.response_payload_offset;
    reply.payload.assign(response, response + completion.payload_bytes);
    if (completion.ticket > last_ticket_.load(std::memory_order_relaxed)) {
      last_ticket_.store(completion.ticket, std::memory_order_release);
    }
    // Every frame event of this request was queued before its completion: apply them now.
    MEMBAR_RETURN_IF_ERROR(await_events(completion.events_through, deadline));
    if (completion.status != 0) {
      return Status(static_cast<StatusCode>(completion.status),
                    std::string(reinterpret_cast<const char*>(reply.payload.data()), reply.payload.size()));
    }
    return reply;
  }

  std::string socket_path_;
  BackendKind backend_ = BackendKind::kHost;
  int device_ = 0;  // the daemon's answer: the device this client's frames live on
  std::mutex mutex_;         // serialises calls (client.h: a Client may be used from several threads)
  std::mutex socket_mutex_;  // guards reading the socket and applying its events
  wire::UniqueFd socket_;
  wire::MessageAssembler assembler_;
  void* segment_ = nullptr;
  uint64_t segment_bytes_ = 0;
  v2::SegmentLayout layout_;
  protocol::RingEnd<v2::RequestV2> requests_;
  protocol::RingEnd<v2::CompletionV2> completions_;
  uint64_t sequence_ = 0;
  uint64_t events_applied_ = 0;  // guarded by socket_mutex_
  std::atomic<uint64_t> last_ticket_{0};
  std::atomic<uint64_t> pending_stall_ns_{0};
  uint64_t call_timeout_ms_ = 30000;
  uint64_t wait_timeout_ms_ = 120000;
  uint32_t gpu_quota_frames_ = 0;
  uint32_t host_slab_frames_ = 1;
  std::unique_ptr<ClientMemory> memory_;
  volatile uint64_t* signal_words_ = nullptr;
  std::map<uint32_t, wire::ReceivedMessage> channel_grants_;  // guarded by socket_mutex_
  ChannelTable channels_;                                       // guarded by mutex_
  std::atomic<bool> dead_{false};
  std::mutex dead_mutex_;
  Status dead_status_;
#if defined(MEMBAR_WITH_CUDA)
  std::unique_ptr<StreamSignals> stream_signals_;
#endif
  uint64_t release_marker_ = 0;   // the last marker a stream of this client was given (CUDA only)
};

// Reads socket messages until the hello reply arrives (or an error, EOF or the deadline).
Result<wire::ReceivedMessage> read_reply(int socket_fd, wire::MessageAssembler& assembler, uint64_t deadline) {
  for (;;) {
    for (;;) {
      MEMBAR_ASSIGN_OR_RETURN(std::optional<wire::ReceivedMessage> next, assembler.next());
      if (!next.has_value()) break;
      auto type = static_cast<v2::MessageType>(next->header.type);
      if (type == v2::MessageType::kHelloReply) return std::move(*next);
      if (type == v2::MessageType::kError) {
        MEMBAR_ASSIGN_OR_RETURN(v2::ErrorV2 error, v2::decode_error(next->payload));
        return Status(static_cast<StatusCode>(error.status), std::string("membard refused the connection: ") + error.message);
      }
      return invalid_argument("membard sent message type " + std::to_string(next->header.type) + " before its hello reply");
    }
    uint64_t now = protocol::monotonic_ns();
    if (now > deadline) return Status(StatusCode::DEADLINE_EXCEEDED, "membard did not answer the handshake within 5 s");
    pollfd p{socket_fd, POLLIN, 0};
    ::poll(&p, 1, static_cast<int>((deadline - now) / 1000000) + 1);
    Result<bool> read = assembler.read_available(socket_fd);
    if (!read.ok()) {
      // The daemon may have written its refusal and closed: parse what arrived first (an error,
      // or a hello reply that says why, as for a device it does not serve).
      MEMBAR_ASSIGN_OR_RETURN(std::optional<wire::ReceivedMessage> last, assembler.next());
      if (last.has_value() && last->header.type == static_cast<uint16_t>(v2::MessageType::kHelloReply)) {
        return std::move(*last);
      }
      if (last.has_value() && last->header.type == static_cast<uint16_t>(v2::MessageType::kError)) {
        MEMBAR_ASSIGN_OR_RETURN(v2::ErrorV2 error, v2::decode_error(last->payload));
        return Status(static_cast<StatusCode>(error.status), std::string("membard refused the connection: ") + error.message);
      }
      return unavailable("membard closed the connection during the handshake");
    }
  }
}

Status DaemonClient::handshake(const std::string& socket_path, const ConnectOptions& options) {
  socket_path_ = socket_path;
  call_timeout_ms_ = env_milliseconds("MEMBAR_CALL_TIMEOUT_MS", 30000);
  wait_timeout_ms_ = env_milliseconds("MEMBAR_WAIT_TIMEOUT_MS", 120000);
  sockaddr_un address{};
  if (socket_path.empty() || socket_path.size() >= sizeof(address.sun_path)) {
    return invalid_argument("socket path '" + socket_path + "' is empty or too long");
  }
  if (options.device.has_value() && (*options.device < 0 || *options.device >= static_cast<int>(v2::kMaxDevices))) {
    return invalid_argument("device " + std::to_string(*options.device) + " is not in 0.." +
                            std::to_string(v2::kMaxDevices - 1));
  }
  socket_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!socket_.valid()) return unavailable(std::string("cannot create a socket: ") + std::strerror(errno));
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket_path.data(), socket_path.size());
  if (::connect(socket_.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    return unavailable("no membard answers at " + socket_path + ": " + std::strerror(errno));
  }

  v2::HelloV2 hello{};
  hello.role = static_cast<uint32_t>(v2::Role::kClient);
  // Note [Devices of one daemon]: 0 asks for the daemon's first device.
  hello.device_plus_one = options.device.has_value() ? static_cast<uint32_t>(*options.device + 1) : 0;
  hello.gpu_quota_bytes = options.gpu_quota_bytes;
  hello.host_quota_bytes = options.host_quota_bytes;
  std::string name = options.client_name.empty() ? "pid-" + std::to_string(::getpid()) : options.client_name;
  for (char& c : name) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  v2::copy_text(hello.client_name, sizeof(hello.client_name), name);
  // A daemon that refuses this peer (SO_PEERCRED) writes its error and closes at once, possibly
  // before the hello goes out: a failed send still reads what the daemon said.
  Status sent = wire::send_message(socket_.get(), v2::encode_message(v2::MessageType::kHello, hello));
  uint64_t reply_deadline = protocol::monotonic_ns() + (sent.ok() ? 5'000'000'000ull : 500'000'000ull);
  Result<wire::ReceivedMessage> answered = read_reply(socket_.get(), assembler_, reply_deadline);
  if (!sent.ok() && !answered.ok() && answered.status().code() == StatusCode::UNAVAILABLE) return sent;
  MEMBAR_ASSIGN_OR_RETURN(wire::ReceivedMessage message, std::move(answered));
  MEMBAR_ASSIGN_OR_RETURN(v2::HelloReplyV2 reply, v2::decode_hello_reply(message.payload));
  if (reply.status != 0) {
    return Status(static_cast<StatusCode>(reply.status), std::string("membard refused the connection: ") + reply.message);
  }
  if (message.fds.size() != 2) return internal_error("membard's hello reply carried no signal block and segment");
  backend_ = reply.backend == static_cast<uint8_t>(v2::WireBackend::kCuda) ? BackendKind::kCuda : BackendKind::kHost;
  gpu_quota_frames_ = reply.gpu_quota_frames;
  device_ = reply.device;
  host_slab_frames_ = reply.host_slab_frames;

  void* signal = ::mmap(nullptr, kSignalBlockBytes, PROT_READ | PROT_WRITE, MAP_SHARED, message.fds[0].get(), 0);
  if (signal == MAP_FAILED) return internal_error(std::string("mapping the signal block failed: ") + std::strerror(errno));
  signal_words_ = static_cast<volatile uint64_t*>(signal);

  segment_bytes_ = reply.segment_bytes;
  segment_ = ::mmap(nullptr, segment_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, message.fds[1].get(), 0);
  if (segment_ == MAP_FAILED) {
    segment_ = nullptr;
    return unavailable(std::string("mapping membard's shared memory segment failed: ") + std::strerror(errno));
  }
  MEMBAR_ASSIGN_OR_RETURN(layout_, v2::read_segment_header(segment_, segment_bytes_));
  uint8_t* base = static_cast<uint8_t*>(segment_);
  requests_ = protocol::RingEnd<v2::RequestV2>(base + layout_.request_ring_offset, layout_.ring_capacity);
  completions_ = protocol::RingEnd<v2::CompletionV2>(base + layout_.completion_ring_offset, layout_.ring_capacity);

  std::unique_ptr<FrameMapper> gpu_mapper;
  if (backend_ == BackendKind::kCuda) {
#if defined(MEMBAR_WITH_CUDA)
    MEMBAR_ASSIGN_OR_RETURN(gpu_mapper, make_cuda_mapper(reply.device));
    auto signals = StreamSignals::create(signal_words_, 8, reply.device);
    if (signals.ok()) stream_signals_ = std::move(signals).value();
#else
    return unimplemented("membard runs the CUDA backend but this client library was built without CUDA "
                         "(configure with -DMEMBAR_WITH_CUDA=ON)");
#endif
  } else {
    gpu_mapper = make_mmap_mapper();
  }
  memory_ = std::make_unique<ClientMemory>(std::move(gpu_mapper), make_mmap_mapper(), host_slab_frames_,
                                           async_maps_from_env(), deferred_maps_from_env());
  return Status::Ok();
}

Result<std::unique_ptr<Client>> DaemonClient::create(const std::string& socket_path, const ConnectOptions& options) {
  std::unique_ptr<DaemonClient> client(new DaemonClient());
  MEMBAR_RETURN_IF_ERROR(client->handshake(socket_path, options));
  return std::unique_ptr<Client>(std::move(client));
}

}  // namespace

Result<std::unique_ptr<Client>> connect_daemon(const std::string& socket_path, const ConnectOptions& options) {
  return DaemonClient::create(socket_path, options);
}

Status daemon_client_nop(Client& client) {
  auto* daemon = dynamic_cast<DaemonClient*>(&client);
  if (daemon == nullptr) return invalid_argument("not a daemon client: " + client.describe());
  return daemon->nop();
}

}  // namespace membar
