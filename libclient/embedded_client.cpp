// The embedded runtime: the engine of engine/ running inside the trainer's process, behind the
// same Client API as the daemon client. The engine's events are applied to this process's
// ClientMemory directly (frames imported or mapped, spaces' positions mapped and unmapped),
// exactly as the daemon client applies the messages it receives, so pointers mean the same thing
// in both modes.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "channel_table.h"
#include "membar/client.h"
#include "membar/engine/channels.h"
#include "membar/engine/engine.h"
#include "memory.h"
#include "retry.h"
#if defined(MEMBAR_WITH_CUDA)
#include "cuda/stream_signal.h"
#endif

namespace membar {
namespace {

using runtimed::Engine;

// Every embedded client of this process shares one channel registry (there is no daemon), so a
// channel created by one is found by the others; owners are numbered per process because each
// embedded client has its own engine (and engine client ids repeat).
runtimed::ChannelRegistry& process_channels() {
  static runtimed::ChannelRegistry registry;
  return registry;
}
std::atomic<ClientId> next_channel_owner{1};

class EmbeddedClient final : public Client {
 public:
  ~EmbeddedClient() override {
    process_channels().close_all(channel_owner_);
    // The engine closes this client as it goes, without renewing its memory (Note [No renewal at
    // teardown] in engine/engine.cpp): closing it first would renew every frame and slab.
    engine_.reset();
#if defined(MEMBAR_WITH_CUDA)
    stream_signals_.reset();
#endif
    memory_.reset();
    if (signal_words_ != nullptr) ::munmap(const_cast<uint64_t*>(signal_words_), signal_bytes_);
  }

  static Result<std::unique_ptr<Client>> create(const EmbeddedConfig& config) {
    runtimed::BackendConfig backend_config;
    backend_config.gpu_pool_bytes = config.gpu_pool_bytes;
    backend_config.host_pool_bytes = config.host_pool_bytes;
    backend_config.device = config.device;

    std::unique_ptr<runtimed::DeviceBackend> backend;
    BackendKind kind = BackendKind::kHost;
    if (config.backend == BackendKind::kCuda || config.backend == BackendKind::kAuto) {
#if defined(MEMBAR_WITH_CUDA)
      auto cuda = runtimed::make_cuda_backend(backend_config);
      if (cuda.ok()) {
        backend = std::move(cuda).value();
        kind = BackendKind::kCuda;
      } else if (config.backend == BackendKind::kCuda) {
        return cuda.status();
      }
#else
      if (config.backend == BackendKind::kCuda) {
        return unimplemented("the CUDA backend was asked for, but membar was built without CUDA "
                             "(configure with -DMEMBAR_WITH_CUDA=ON)");
      }
#endif
    }
    if (!backend) {
      MEMBAR_ASSIGN_OR_RETURN(backend, runtimed::make_host_backend(backend_config));
    }
    uint32_t slab_frames = backend->host_slab_frames();
    runtimed::EngineConfig engine_config;
    const char* order_env = std::getenv("MEMBAR_DEVICE_ORDER");
    engine_config.order_on_device = config.order_on_device && !(order_env != nullptr && std::string(order_env) == "0");
    bool ordered = engine_config.order_on_device && backend->orders_on_device();
    // Note [Hand-over on the dispatcher] (engine/batches.cpp): on by default, MEMBAR_DEFER_SUBMIT=0 off.
    const char* defer_env = std::getenv("MEMBAR_DEFER_SUBMIT");
    engine_config.submit_on_dispatcher = !(defer_env != nullptr && std::string(defer_env) == "0");
    if (const char* rank_env = std::getenv("MEMBAR_DISPLACE_RANK")) engine_config.displace_rank = runtimed::parse_displace_rank(rank_env);
    MEMBAR_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::create(std::move(backend), engine_config));

    auto client = std::unique_ptr<EmbeddedClient>(new EmbeddedClient());
    client->kind_ = kind;
    client->ordered_ = ordered;
    client->device_ = config.device;
    std::unique_ptr<FrameMapper> gpu_mapper;
#if defined(MEMBAR_WITH_CUDA)
    if (kind == BackendKind::kCuda) {
      MEMBAR_ASSIGN_OR_RETURN(gpu_mapper, make_cuda_mapper(config.device));
    }
#endif
    if (!gpu_mapper) gpu_mapper = make_mmap_mapper();
    client->memory_ = std::make_unique<ClientMemory>(std::move(gpu_mapper), make_mmap_mapper(), slab_frames,
                                                     async_maps_from_env(), deferred_maps_from_env());
    ClientMemory* memory = client->memory_.get();
    runtimed::ClientEvents events;
    auto note = [memory](Status status) {
      if (!status.ok()) memory->note_error(status);
    };
    events.gpu_frame_granted = [memory, note](uint32_t window_frame, int fd) {
      note(memory->gpu_frame_granted(window_frame, fd));
    };
    events.gpu_frame_revoked = [memory, note](uint32_t window_frame) { note(memory->gpu_frame_revoked(window_frame)); };
    events.host_slab_granted = [memory, note](uint32_t slab, uint32_t frames, int fd) {
      note(memory->host_slab_granted(slab, frames, fd));
    };
    events.host_slab_revoked = [memory, note](uint32_t slab) { note(memory->host_slab_revoked(slab)); };
    events.frame_mapped = [memory, note](Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame) {
      note(memory->mapped(tier, window_frame, space, space_frame));
    };
    events.frame_unmapped = [memory, note](Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame) {
      note(memory->unmapped(tier, window_frame, space, space_frame));
    };
    runtimed::ClientConfig client_config;
    client_config.name = "embedded";
    client_config.pid = int32_t(::getpid());
    client_config.uid = ::getuid();
    MEMBAR_ASSIGN_OR_RETURN(client->id_, engine->client_open(client_config, std::move(events)));
    client->engine_ = std::move(engine);
    MEMBAR_RETURN_IF_ERROR(client->map_signal_block());
    return std::unique_ptr<Client>(std::move(client));
  }

  std::string describe() const override { return kind_ == BackendKind::kCuda ? "embedded:cuda" : "embedded:host"; }
  bool stream_waits_preferred() const override { return kind_ == BackendKind::kCuda && ordered_; }
  BackendKind backend() const override { return kind_; }
  int device() const override { return device_; }

  Result<SpaceId> create_space(const std::string& name, uint64_t page_bytes, uint32_t page_count) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(SpaceId space, engine_->create_space(id_, name, page_bytes, page_count));
    Status reserved = memory_->add_space(space, page_bytes, page_count);
    if (!reserved.ok()) {
      (void)engine_->destroy_space(id_, space);
      return reserved;
    }
    return space;
  }

  Status destroy_space(SpaceId space) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_RETURN_IF_ERROR(engine_->destroy_space(id_, space));
    MEMBAR_RETURN_IF_ERROR(memory_->settle());
    return memory_->remove_space(space);
  }

  Result<SpaceView> space_view(SpaceId space) const override { return memory_->view(space); }

  Result<Acquired> acquire(PageRange range, uint32_t flags) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(SpaceView view, memory_->view(range.space));
    MEMBAR_ASSIGN_OR_RETURN(Ticket ticket, retried([&] { return engine_->acquire(id_, range, flags); }));
    MEMBAR_RETURN_IF_ERROR(memory_->settle_ranges(&range, 1));
    return Acquired{ticket, static_cast<char*>(view.gpu) + uint64_t(range.first_page) * view.page_bytes};
  }

  Status release(PageRange range, bool dirty) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return engine_->release(id_, range, dirty);
  }

  Result<Ticket> acquire_ranges(const std::vector<PageRange>& ranges, uint32_t flags,
                                std::optional<uint32_t> advance_step) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Ticket ticket,
                            retried([&] { return engine_->acquire_ranges(id_, ranges, flags, advance_step); }));
    MEMBAR_RETURN_IF_ERROR(memory_->settle_ranges(ranges));
    return ticket;
  }

  Status release_ranges(const std::vector<PageRange>& ranges, bool dirty) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return engine_->release_ranges(id_, ranges, dirty, std::nullopt);
  }

  // Note [Copied pages] in engine/page_copies.cpp. With a marker, the copies wait for it (on the
  // device when copies are ordered there).
  Result<Ticket> copy_pages(const std::vector<PageRange>& pairs, std::optional<uint64_t> after_marker) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (after_marker.has_value() && (*after_marker == 0 || *after_marker > release_marker_)) {
      return invalid_argument("copy_pages: after_marker " + std::to_string(*after_marker) +
                              " was not written by this client's stream_mark or stream_release (the last was " +
                              std::to_string(release_marker_) + ")");
    }
    MEMBAR_ASSIGN_OR_RETURN(Ticket ticket, retried([&] { return engine_->copy_pages(id_, pairs, after_marker); }));
    MEMBAR_RETURN_IF_ERROR(memory_->settle());   // host frames a destination took
    return ticket;
  }

  Result<uint64_t> stream_mark(void* cuda_stream) override {
#if defined(MEMBAR_WITH_CUDA)
    if (stream_signals_) {
      std::lock_guard<std::mutex> lock(mutex_);
      uint64_t marker = ++release_marker_;
      MEMBAR_RETURN_IF_ERROR(stream_signals_->stream_write(runtimed::kSignalReleased, marker, cuda_stream));
      return marker;
    }
#endif
    (void)cuda_stream;
    return unimplemented("stream_mark needs the CUDA backend; this client runs on " + describe());
  }

  Result<Ticket> prefetch(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Ticket ticket, retried([&] { return engine_->prefetch(id_, range); }));
    MEMBAR_RETURN_IF_ERROR(memory_->settle());
    return ticket;
  }

  Result<Ticket> offload(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Ticket ticket, retried([&] { return engine_->offload(id_, range); }));
    MEMBAR_RETURN_IF_ERROR(memory_->settle());
    return ticket;
  }

  Status free_pages(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_RETURN_IF_ERROR(engine_->free_pages(id_, range));
    return memory_->settle();
  }

  Result<void*> acquire_host(PageRange range) override {
    Ticket ticket = 0;
    SpaceView view;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(view, memory_->view(range.space));
      MEMBAR_ASSIGN_OR_RETURN(ticket, retried([&] { return engine_->acquire_host(id_, range); }));
      MEMBAR_RETURN_IF_ERROR(memory_->settle_ranges(&range, 1));
    }
    MEMBAR_RETURN_IF_ERROR(wait(ticket));
    return static_cast<void*>(static_cast<char*>(view.host) + uint64_t(range.first_page) * view.page_bytes);
  }

  Status release_host(PageRange range, bool dirty) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_RETURN_IF_ERROR(engine_->release_host(id_, range, dirty));
    return memory_->settle();
  }

  Status add_stall_ns(uint64_t ns) override { return engine_->add_stall_ns(id_, ns); }

  Status set_schedule(std::vector<ScheduleStep> steps) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return engine_->set_schedule(id_, std::move(steps));
  }

  Status advance(uint32_t step) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_RETURN_IF_ERROR(engine_->advance(id_, step));
    return memory_->take_error();   // its lookahead's maps go on (Note [Maps off the caller's thread])
  }

  // Not under the client mutex: waiting must not block other threads' calls.
  Status wait(Ticket ticket) override {
    if (completed_ticket() >= ticket) return Status::Ok();
    return stalled([&] { return engine_->wait(id_, ticket); });
  }

  // Runs a host wait and counts its time as this client's stall time.
  template <typename Wait>
  Status stalled(Wait&& host_wait) {
    auto start = std::chrono::steady_clock::now();
    Status status = host_wait();
    auto waited = std::chrono::steady_clock::now() - start;
    (void)engine_->add_stall_ns(id_, uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count()));
    return status;
  }

  Ticket submitted_ticket() const {
    if (signal_words_ == nullptr) return 0;
    return __atomic_load_n(const_cast<uint64_t*>(signal_words_ + runtimed::kSignalSubmitted), __ATOMIC_ACQUIRE);
  }

  Ticket completed_ticket() const override {
    if (signal_words_ == nullptr) return 0;
    return __atomic_load_n(const_cast<uint64_t*>(signal_words_ + runtimed::kSignalCompleted), __ATOMIC_ACQUIRE);
  }

  // The stream waits on the GPU only for copies already enqueued (Note [Enqueued tickets] in
  // engine/batches.cpp): this process's own threads enqueue them, and a GPU wait on anything a
  // host thread has yet to do can deadlock against CUDA's lazy module loading. The host waits
  // until the ticket is enqueued (counted as stall time), never for the copies themselves.
  // wait_submitted runs even for a ticket already enqueued: the first call is what turns on the
  // engine's writes of kSignalEnqueuedDone (without it a stream whose first ticket was enqueued
  // before it asked would wait for a word nobody writes: seen on the H200, 2026-12-01).
  Status stream_wait(Ticket ticket, void* cuda_stream) override {
#if defined(MEMBAR_WITH_CUDA)
    if (stream_signals_) {
      if (completed_ticket() >= ticket) return Status::Ok();
      Status status = submitted_ticket() < ticket ? stalled([&] { return engine_->wait_submitted(id_, ticket); })
                                                  : engine_->wait_submitted(id_, ticket);
      if (!status.ok()) return status.code() == StatusCode::NOT_FOUND ? status : wait(ticket);
      if (completed_ticket() >= ticket) return Status::Ok();
      return stream_signals_->stream_wait(runtimed::kSignalEnqueuedDone, ticket, cuda_stream);
    }
#endif
    return unimplemented("stream_wait needs the CUDA backend; this client runs on " + describe() + " (use wait(ticket))");
  }

  // Stream-ordered, as through a daemon: the engine holds copies of these pages (and their
  // frames) until it sees the stream's marker (Note [Stream-ordered release]).
  Status stream_release(PageRange range, bool dirty, void* cuda_stream) override {
#if defined(MEMBAR_WITH_CUDA)
    if (stream_signals_) {
      std::lock_guard<std::mutex> lock(mutex_);
      uint64_t marker = ++release_marker_;
      MEMBAR_RETURN_IF_ERROR(stream_signals_->stream_write(runtimed::kSignalReleased, marker, cuda_stream));
      return engine_->release_after(id_, range, dirty, marker);
    }
#endif
    return unimplemented("stream_release needs the CUDA backend; this client runs on " + describe() + " (use release)");
  }

  Status stream_release_ranges(const std::vector<PageRange>& ranges, bool dirty, void* cuda_stream) override {
#if defined(MEMBAR_WITH_CUDA)
    if (stream_signals_) {
      std::lock_guard<std::mutex> lock(mutex_);
      uint64_t marker = ++release_marker_;
      MEMBAR_RETURN_IF_ERROR(stream_signals_->stream_write(runtimed::kSignalReleased, marker, cuda_stream));
      return engine_->release_ranges(id_, ranges, dirty, marker);
    }
#endif
    return unimplemented("stream_release needs the CUDA backend; this client runs on " + describe() + " (use release)");
  }

  MapCounters map_counters() const override { return memory_->counters(); }

  Result<RuntimeStats> stats() override { return engine_->stats(id_, 0, 4096); }

  Result<Channel> create_channel(const std::string& name, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_RETURN_IF_ERROR(engine_->reserve_channel_bytes(id_, bytes));
    Result<runtimed::ChannelGrant> grant = process_channels().create(channel_owner_, ::getuid(), name, bytes);
    if (!grant.ok()) {
      (void)engine_->release_channel_bytes(id_, bytes);
      return grant.status();
    }
    Result<Channel> channel = channels_.add(grant.value().fd, grant.value().id, grant.value().bytes, true, /*owner=*/true);
    if (!channel.ok()) {
      (void)process_channels().close(channel_owner_, grant.value().id);
      (void)engine_->release_channel_bytes(id_, bytes);
      return channel.status();
    }
    MEMBAR_RETURN_IF_ERROR(process_channels().publish(channel_owner_, grant.value().id));
    return channel;
  }

  Result<Channel> open_channel(const std::string& name) override {
    std::lock_guard<std::mutex> lock(mutex_);
    Result<runtimed::ChannelGrant> grant = process_channels().open(::getuid(), name);
    if (!grant.ok()) {
      return Status(grant.status().code(), grant.status().message() +
                                               "; this is an embedded runtime, which finds only channels created in "
                                               "this process (start membard to share channels between processes)");
    }
    return channels_.add(grant.value().fd, grant.value().id, grant.value().bytes, grant.value().writable,
                         /*owner=*/false);
  }

  Status close_channel(uint32_t handle) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ChannelTable::Entry entry;
    MEMBAR_RETURN_IF_ERROR(channels_.remove(handle, &entry));
    if (!entry.owner) return Status::Ok();
    MEMBAR_ASSIGN_OR_RETURN(uint64_t bytes, process_channels().close(channel_owner_, entry.runtime_id));
    return engine_->release_channel_bytes(id_, bytes);
  }

 private:
  EmbeddedClient() = default;

  template <typename Call>
  auto retried(Call&& call) -> decltype(call()) {
    return with_retry(std::forward<Call>(call), [] { return true; });
  }

  Status map_signal_block() {
    MEMBAR_ASSIGN_OR_RETURN(int fd, engine_->client_signal_fd(id_));
    signal_bytes_ = 4096;
    void* at = ::mmap(nullptr, signal_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int error = errno;
    ::close(fd);
    if (at == MAP_FAILED) return internal_error(std::string("mapping the signal block failed: ") + std::strerror(error));
    signal_words_ = static_cast<volatile uint64_t*>(at);
#if defined(MEMBAR_WITH_CUDA)
    if (kind_ == BackendKind::kCuda) {
      auto signals = StreamSignals::create(signal_words_, 8, device_);
      if (signals.ok()) stream_signals_ = std::move(signals).value();
    }
#endif
    return Status::Ok();
  }

  std::mutex mutex_;  // serialises calls (see client.h)
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ClientMemory> memory_;
  ClientId id_ = 0;
  BackendKind kind_ = BackendKind::kHost;
  bool ordered_ = false;   // the engine orders copies on the device (EmbeddedConfig::order_on_device)
  int device_ = 0;
  volatile uint64_t* signal_words_ = nullptr;
  uint64_t signal_bytes_ = 0;
  ClientId channel_owner_ = next_channel_owner.fetch_add(1);
  ChannelTable channels_;  // guarded by mutex_
#if defined(MEMBAR_WITH_CUDA)
  std::unique_ptr<StreamSignals> stream_signals_;
#endif
  uint64_t release_marker_ = 0;   // the last marker a stream of this client was given (CUDA only)
};

}  // namespace

Result<std::unique_ptr<Client>> make_embedded_client(const EmbeddedConfig& config) {
  return EmbeddedClient::create(config);
}

}  // namespace membar
