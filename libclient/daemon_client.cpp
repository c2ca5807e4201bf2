// DaemonClient: membar::Client over a membard (see membar/protocol/v1.h, Note [Two channels]).
//
// Every call is one request on the shared-memory request ring and one completion back. Frames
// arrive on the control socket (SCM_RIGHTS) and are mapped into this process's windows before
// the completion that refers to them is used: the socket is drained after every completion.
// Liveness: while it waits, a call polls the socket (a closed socket means the daemon is gone)
// and the segment's daemon_state word (set when the daemon shuts down), so it returns
// UNAVAILABLE instead of hanging; after that every call returns UNAVAILABLE at once.

#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "channel_table.h"
#include "membar/protocol/ring.h"
#include "membar/protocol/v1.h"
#include "window.h"
#include "membar/common/wire_socket.h"
#if defined(MEMBAR_WITH_CUDA)
#include "cuda/stream_signal.h"
#endif

namespace membar {
namespace {

namespace v1 = protocol::v1;
namespace bip = boost::interprocess;

// Signal word indices (runtimed/engine.h; repeated here because the client does not include the
// engine's headers in daemon mode).
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
    // Closing the socket is what tells the daemon to reclaim this client's frames.
    socket_.reset();
    gpu_window_.reset();
    host_window_.reset();
    if (signal_words_ != nullptr) ::munmap(const_cast<uint64_t*>(signal_words_), kSignalBlockBytes);
  }

  static Result<std::unique_ptr<Client>> create(const std::string& socket_path, const ConnectOptions& options);

  std::string describe() const override { return "daemon:" + socket_path_; }
  BackendKind backend() const override { return backend_; }

  Result<SpaceId> create_space(const std::string& name, uint64_t page_bytes, uint32_t page_count) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_RETURN_IF_ERROR(v1::validate_space_name(name));
    v1::RequestV1 request = make_request(v1::Opcode::kCreateSpace);
    request.argument = page_bytes;
    request.page_count = page_count;
    MEMBAR_ASSIGN_OR_RETURN(Reply reply,
                            call(request, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(name.data()), name.size())));
    auto space = static_cast<SpaceId>(reply.value);
    page_bytes_[space] = page_bytes;
    return space;
  }

  Status destroy_space(SpaceId space) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v1::RequestV1 request = make_request(v1::Opcode::kDestroySpace);
    request.space = space;
    MEMBAR_RETURN_IF_ERROR(call(request).status());
    page_bytes_.erase(space);
    return Status::Ok();
  }

  Result<Acquired> acquire(PageRange range, uint32_t flags) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v1::RequestV1 request = range_request(v1::Opcode::kAcquire, range);
    request.flags = flags;
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, call(request));
    MEMBAR_ASSIGN_OR_RETURN(std::vector<PageLocation> locations, v1::decode_locations(reply.payload, range.page_count));
    Acquired acquired;
    acquired.ticket = reply.ticket;
    MEMBAR_ASSIGN_OR_RETURN(acquired.page_pointers, pointers(Tier::kGpu, range.space, locations));
    return acquired;
  }

  Status release(PageRange range, bool dirty) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v1::RequestV1 request = range_request(v1::Opcode::kRelease, range);
    request.flags = dirty ? v1::kReleaseDirty : 0;
    return call(request).status();
  }

  Result<Ticket> prefetch(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, call(range_request(v1::Opcode::kPrefetch, range)));
    return reply.ticket;
  }

  Result<Ticket> offload(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, call(range_request(v1::Opcode::kOffload, range)));
    return reply.ticket;
  }

  Status free_pages(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return call(range_request(v1::Opcode::kFreePages, range)).status();
  }

  Result<std::vector<void*>> acquire_host(PageRange range) override {
    Ticket ticket = 0;
    std::vector<PageLocation> locations;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(Reply reply, call(range_request(v1::Opcode::kAcquireHost, range)));
      MEMBAR_ASSIGN_OR_RETURN(locations, v1::decode_locations(reply.payload, range.page_count));
      ticket = reply.ticket;
    }
    MEMBAR_RETURN_IF_ERROR(wait(ticket));
    std::lock_guard<std::mutex> lock(mutex_);
    return pointers(Tier::kHost, range.space, locations);
  }

  Status release_host(PageRange range, bool dirty) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v1::RequestV1 request = range_request(v1::Opcode::kReleaseHost, range);
    request.flags = dirty ? v1::kReleaseDirty : 0;
    return call(request).status();
  }

  Status set_schedule(std::vector<ScheduleStep> steps) override {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<uint8_t> payload = v1::encode_schedule(steps);
    return call(make_request(v1::Opcode::kSetSchedule), payload).status();
  }

  Status advance(uint32_t step) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v1::RequestV1 request = make_request(v1::Opcode::kAdvance);
    request.argument = step;
    return call(request).status();
  }

  // Not under the call mutex: other threads keep issuing calls while one waits.
  Status wait(Ticket ticket) override {
    if (completed_ticket() >= ticket) return Status::Ok();
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
      v1::RequestV1 request = range_request(v1::Opcode::kRelease, range);
      request.flags = (dirty ? v1::kReleaseDirty : 0) | v1::kReleaseAfterMarker;
      request.argument = marker;
      return call(request).status();
    }
#endif
    return unimplemented("stream_release needs the CUDA backend; this client runs on " + describe() +
                         " (use release)");
  }

  void* window_base() const override { return gpu_window_->base(); }
  uint64_t window_bytes() const override { return gpu_window_->bytes(); }

  Result<std::vector<PageLocation>> locations(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, call(range_request(v1::Opcode::kLocations, range)));
    return v1::decode_locations(reply.payload, range.page_count);
  }

  Result<RuntimeStats> stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, call(make_request(v1::Opcode::kStats)));
    return v1::decode_stats(reply.payload);
  }

  Result<Channel> create_channel(const std::string& name, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    v1::RequestV1 request = make_request(v1::Opcode::kCreateChannel);
    request.argument = bytes;
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, call(request, as_bytes(name)));
    return take_channel_grant(static_cast<uint32_t>(reply.value), /*owner=*/true);
  }

  Result<Channel> open_channel(const std::string& name) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Reply reply, call(make_request(v1::Opcode::kOpenChannel), as_bytes(name)));
    return take_channel_grant(static_cast<uint32_t>(reply.value), /*owner=*/false);
  }

  Status close_channel(uint32_t handle) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ChannelTable::Entry entry;
    MEMBAR_RETURN_IF_ERROR(channels_.remove(handle, &entry));
    if (!entry.owner) return Status::Ok();
    v1::RequestV1 request = make_request(v1::Opcode::kCloseChannel);
    request.argument = entry.runtime_id;
    return call(request).status();
  }

  // A round trip through the ring that the daemon answers without touching the engine (latency
  // benchmark). Not part of membar::Client; reached through ring_round_trip() below.
  Status nop() {
    std::lock_guard<std::mutex> lock(mutex_);
    return call(make_request(v1::Opcode::kNop)).status();
  }

 private:
  DaemonClient() = default;

  Status handshake(const std::string& socket_path, const ConnectOptions& options);

  v1::SegmentHeaderV1* segment_header() const {
    return static_cast<v1::SegmentHeaderV1*>(segment_region_.get_address());
  }

  v1::RequestV1 make_request(v1::Opcode opcode) {
    v1::RequestV1 request{};
    request.opcode = static_cast<uint16_t>(opcode);
    return request;
  }
  v1::RequestV1 range_request(v1::Opcode opcode, PageRange range) {
    v1::RequestV1 request = make_request(opcode);
    request.space = range.space;
    request.first_page = range.first_page;
    request.page_count = range.page_count;
    return request;
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
        v1::kDaemonShuttingDown) {
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

  // Reads and applies every message the socket holds (grants, revokes, shutdown, errors).
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
    return take_window_error();
  }

  void apply_message(wire::ReceivedMessage& message) {
    switch (static_cast<v1::MessageType>(message.header.type)) {
      case v1::MessageType::kFrameGrant: {
        Result<v1::FrameNoticeV1> notice = v1::decode_frame_notice(message.payload);
        if (!notice.ok()) return note_window_error(notice.status());
        Window& window = notice.value().tier == static_cast<uint8_t>(Tier::kGpu) ? *gpu_window_ : *host_window_;
        if (notice.value().window_frame * kFrameBytes >= window.bytes()) {
          return note_window_error(internal_error("membard granted window frame " +
                                                  std::to_string(notice.value().window_frame) +
                                                  ", beyond the window it announced"));
        }
        if (window.is_mapped(notice.value().window_frame)) (void)window.unmap_frame(notice.value().window_frame);
        Status mapped = window.map_frame(notice.value().window_frame, message.fd.release());
        if (!mapped.ok()) note_window_error(mapped);
        return;
      }
      case v1::MessageType::kFrameRevoke: {
        Result<v1::FrameNoticeV1> notice = v1::decode_frame_notice(message.payload);
        if (!notice.ok()) return note_window_error(notice.status());
        Window& window = notice.value().tier == static_cast<uint8_t>(Tier::kGpu) ? *gpu_window_ : *host_window_;
        if (window.is_mapped(notice.value().window_frame)) {
          Status unmapped = window.unmap_frame(notice.value().window_frame);
          if (!unmapped.ok()) note_window_error(unmapped);
        }
        return;
      }
      case v1::MessageType::kShutdown: {
        Result<v1::ShutdownV1> notice = v1::decode_shutdown(message.payload);
        std::string reason = notice.ok() ? std::string(notice.value().reason) : "no reason given";
        mark_dead(unavailable("membard at " + socket_path_ + " shut down: " + reason));
        return;
      }
      case v1::MessageType::kError: {
        Result<v1::ErrorV1> error = v1::decode_error(message.payload);
        if (error.ok()) {
          mark_dead(Status(static_cast<StatusCode>(error.value().status),
                           std::string("membard closed the connection: ") + error.value().message));
        } else {
          mark_dead(unavailable("membard closed the connection with a malformed error"));
        }
        return;
      }
      case v1::MessageType::kChannelGrant: {
        Result<v1::ChannelNoticeV1> notice = v1::decode_channel_notice(message.payload);
        if (!notice.ok()) return note_window_error(notice.status());
        channel_grants_[notice.value().channel] = std::move(message);
        return;
      }
      case v1::MessageType::kPong:
        return;
      default:
        mark_dead(unavailable("membard sent unexpected message type " + std::to_string(message.header.type)));
        return;
    }
  }

  static std::span<const uint8_t> as_bytes(const std::string& text) {
    return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(text.data()), text.size());
  }

  // The channel's descriptor arrived on the socket before the completion (drained by call()).
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
    MEMBAR_ASSIGN_OR_RETURN(v1::ChannelNoticeV1 notice, v1::decode_channel_notice(grant.payload));
    return channels_.add(grant.fd.release(), runtime_id, notice.bytes, (notice.flags & v1::kChannelWritable) != 0,
                         owner);
  }

  void note_window_error(const Status& status) {
    if (window_error_.ok()) window_error_ = status;
  }
  Status take_window_error() { return std::exchange(window_error_, Status::Ok()); }

  // One request and its completion. Caller holds mutex_.
  Result<Reply> call(v1::RequestV1 request, std::span<const uint8_t> payload = {}) {
    if (dead_.load(std::memory_order_acquire)) return dead_status();
    MEMBAR_RETURN_IF_ERROR(drain_socket());
    MEMBAR_RETURN_IF_ERROR(check_alive());
    if (payload.size() > layout_.request_payload_bytes) {
      return invalid_argument(std::string(v1::opcode_name(request.opcode)) + ": request of " +
                              std::to_string(payload.size()) + " bytes exceeds the " +
                              std::to_string(layout_.request_payload_bytes) + "-byte payload area");
    }
    uint8_t* base = static_cast<uint8_t*>(segment_region_.get_address());
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
    v1::CompletionV1 completion;
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
                                                            std::string(v1::opcode_name(request.opcode)) + " within " +
                                                            std::to_string(call_timeout_ms_) + " ms"));
        return dead_status();
      }
      completions_.wait_for_entries(2'000'000);
    }
    MEMBAR_RETURN_IF_ERROR(v1::validate_completion(completion, layout_.response_payload_bytes));
    Reply reply;
    reply.ticket = completion.ticket;
    reply.value = completion.value;
    const uint8_t* response = base + layout_.response_payload_offset;
    reply.payload.assign(response, response + completion.payload_bytes);
    // Frames granted by this request were sent before its completion: map them now.
    MEMBAR_RETURN_IF_ERROR(drain_socket());
    if (completion.status != 0) {
      return Status(static_cast<StatusCode>(completion.status),
                    std::string(reinterpret_cast<const char*>(reply.payload.data()), reply.payload.size()));
    }
    return reply;
  }

  Result<std::vector<void*>> pointers(Tier tier, SpaceId space, const std::vector<PageLocation>& locations) {
    std::lock_guard<std::mutex> socket_lock(socket_mutex_);  // the windows change under it
    auto it = page_bytes_.find(space);
    if (it == page_bytes_.end()) return not_found("space " + std::to_string(space) + " was not created by this client");
    Window& window = tier == Tier::kGpu ? *gpu_window_ : *host_window_;
    std::vector<void*> answer;
    answer.reserve(locations.size());
    char* window_base = static_cast<char*>(window.base());
    for (const PageLocation& location : locations) {
      uint64_t offset = uint64_t(location.window_frame) * kFrameBytes + uint64_t(location.slot) * it->second;
      if (location.window_frame == kNoFrame || offset + it->second > window.bytes() ||
          !window.is_mapped(location.window_frame)) {
        return internal_error("membard returned a page in window frame " + std::to_string(location.window_frame) +
                              ", which this client has not mapped");
      }
      answer.push_back(window_base + offset);
    }
    return answer;
  }

  std::string socket_path_;
  BackendKind backend_ = BackendKind::kHost;
  std::mutex mutex_;         // serialises calls (client.h: a Client may be used from several threads)
  std::mutex socket_mutex_;  // guards reading the socket and the windows
  wire::UniqueFd socket_;
  wire::MessageAssembler assembler_;
  bip::mapped_region segment_region_;
  v1::SegmentLayout layout_;
  protocol::RingEnd<v1::RequestV1> requests_;
  protocol::RingEnd<v1::CompletionV1> completions_;
  uint64_t sequence_ = 0;
  std::atomic<uint64_t> pending_stall_ns_{0};
  uint64_t call_timeout_ms_ = 30000;
  uint64_t wait_timeout_ms_ = 120000;
  std::unique_ptr<Window> gpu_window_;
  std::unique_ptr<Window> host_window_;
  std::map<SpaceId, uint64_t> page_bytes_;
  volatile uint64_t* signal_words_ = nullptr;
  Status window_error_;
  std::map<uint32_t, wire::ReceivedMessage> channel_grants_;  // guarded by socket_mutex_
  ChannelTable channels_;                                       // guarded by mutex_
  std::atomic<bool> dead_{false};
  std::mutex dead_mutex_;
  Status dead_status_;
#if defined(MEMBAR_WITH_CUDA)
  std::unique_ptr<StreamSignals> stream_signals_;
  uint64_t release_marker_ = 0;
#endif
};

// Reads socket messages until the hello reply arrives (or an error, EOF or the deadline).
Result<wire::ReceivedMessage> read_reply(int socket_fd, wire::MessageAssembler& assembler, uint64_t deadline,
                                         std::vector<wire::ReceivedMessage>& early) {
  for (;;) {
    for (;;) {
      MEMBAR_ASSIGN_OR_RETURN(std::optional<wire::ReceivedMessage> next, assembler.next());
      if (!next.has_value()) break;
      auto type = static_cast<v1::MessageType>(next->header.type);
      if (type == v1::MessageType::kHelloReply) return std::move(*next);
      if (type == v1::MessageType::kError) {
        MEMBAR_ASSIGN_OR_RETURN(v1::ErrorV1 error, v1::decode_error(next->payload));
        return Status(static_cast<StatusCode>(error.status), std::string("membard refused the connection: ") + error.message);
      }
      early.push_back(std::move(*next));
    }
    uint64_t now = protocol::monotonic_ns();
    if (now > deadline) return Status(StatusCode::DEADLINE_EXCEEDED, "membard did not answer the handshake within 5 s");
    pollfd p{socket_fd, POLLIN, 0};
    ::poll(&p, 1, static_cast<int>((deadline - now) / 1000000) + 1);
    Result<bool> read = assembler.read_available(socket_fd);
    if (!read.ok()) {
      // The daemon may have written its refusal and closed: parse what arrived first.
      MEMBAR_ASSIGN_OR_RETURN(std::optional<wire::ReceivedMessage> last, assembler.next());
      if (last.has_value() && last->header.type == static_cast<uint16_t>(v1::MessageType::kError)) {
        MEMBAR_ASSIGN_OR_RETURN(v1::ErrorV1 error, v1::decode_error(last->payload));
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
  socket_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!socket_.valid()) return unavailable(std::string("cannot create a socket: ") + std::strerror(errno));
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket_path.data(), socket_path.size());
  if (::connect(socket_.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    return unavailable("no membard answers at " + socket_path + ": " + std::strerror(errno));
  }

  v1::HelloV1 hello{};
  hello.role = static_cast<uint32_t>(v1::Role::kClient);
  hello.gpu_quota_bytes = options.gpu_quota_bytes;
  hello.host_quota_bytes = options.host_quota_bytes;
  std::string name = options.client_name.empty() ? "pid-" + std::to_string(::getpid()) : options.client_name;
  for (char& c : name) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  v1::copy_text(hello.client_name, sizeof(hello.client_name), name);
  // A daemon that refuses this peer (SO_PEERCRED) writes its error and closes at once, possibly
  // before the hello goes out: a failed send still reads what the daemon said.
  Status sent = wire::send_message(socket_.get(), v1::encode_message(v1::MessageType::kHello, hello));
  std::vector<wire::ReceivedMessage> early;
  uint64_t reply_deadline = protocol::monotonic_ns() + (sent.ok() ? 5'000'000'000ull : 500'000'000ull);
  Result<wire::ReceivedMessage> answered = read_reply(socket_.get(), assembler_, reply_deadline, early);
  if (!sent.ok() && !answered.ok() && answered.status().code() == StatusCode::UNAVAILABLE) return sent;
  MEMBAR_ASSIGN_OR_RETURN(wire::ReceivedMessage message, std::move(answered));
  MEMBAR_ASSIGN_OR_RETURN(v1::HelloReplyV1 reply, v1::decode_hello_reply(message.payload));
  if (reply.status != 0) {
    return Status(static_cast<StatusCode>(reply.status), std::string("membard refused the connection: ") + reply.message);
  }
  if (!message.fd.valid()) return internal_error("membard's hello reply carried no signal block");
  backend_ = reply.backend == static_cast<uint8_t>(v1::WireBackend::kCuda) ? BackendKind::kCuda : BackendKind::kHost;

  void* signal = ::mmap(nullptr, kSignalBlockBytes, PROT_READ | PROT_WRITE, MAP_SHARED, message.fd.get(), 0);
  if (signal == MAP_FAILED) return internal_error(std::string("mapping the signal block failed: ") + std::strerror(errno));
  signal_words_ = static_cast<volatile uint64_t*>(signal);

  try {
    bip::shared_memory_object object(bip::open_only, reply.segment_name, bip::read_write);
    bip::mapped_region region(object, bip::read_write);
    segment_region_.swap(region);
  } catch (const bip::interprocess_exception& error) {
    return unavailable(std::string("cannot open membard's shared memory segment ") + reply.segment_name + ": " +
                       error.what());
  }
  MEMBAR_ASSIGN_OR_RETURN(layout_, v1::read_segment_header(segment_region_.get_address(), segment_region_.get_size()));
  if (layout_.segment_bytes != reply.segment_bytes) {
    return internal_error("membard's segment size differs from its hello reply");
  }
  uint8_t* base = static_cast<uint8_t*>(segment_region_.get_address());
  requests_ = protocol::RingEnd<v1::RequestV1>(base + layout_.request_ring_offset, layout_.ring_capacity);
  completions_ = protocol::RingEnd<v1::CompletionV1>(base + layout_.completion_ring_offset, layout_.ring_capacity);

  uint32_t gpu_frames = std::max<uint32_t>(reply.gpu_window_frames, 1);
  uint32_t host_frames = std::max<uint32_t>(reply.host_window_frames, 1);
  if (backend_ == BackendKind::kCuda) {
#if defined(MEMBAR_WITH_CUDA)
    MEMBAR_ASSIGN_OR_RETURN(gpu_window_, make_cuda_window(gpu_frames, reply.device));
    auto signals = StreamSignals::create(signal_words_, 8, reply.device);
    if (signals.ok()) stream_signals_ = std::move(signals).value();
#else
    return unimplemented("membard runs the CUDA backend but this client library was built without CUDA "
                         "(configure with -DMEMBAR_WITH_CUDA=ON)");
#endif
  } else {
    MEMBAR_ASSIGN_OR_RETURN(gpu_window_, make_host_window(gpu_frames));
  }
  MEMBAR_ASSIGN_OR_RETURN(host_window_, make_host_window(host_frames));
  for (wire::ReceivedMessage& early_message : early) apply_message(early_message);
  MEMBAR_RETURN_IF_ERROR(take_window_error());
  return wire::send_message(socket_.get(), v1::encode_message(v1::MessageType::kAttached, std::span<const uint8_t>()));
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
