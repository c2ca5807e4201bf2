// The embedded runtime: the engine of runtimed/ running inside the trainer's process, behind
// the same Client API as the daemon client. Frames granted by the engine are mapped into this
// process's windows (a GPU-tier window, device memory on CUDA or shared memory on the host
// backend, and a host-tier window for acquire_host) exactly as the daemon client maps the fds it
// receives, so pointers mean the same thing in both modes.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "channel_table.h"
#include "membar/engine/channels.h"
#include "membar/engine/engine.h"
#include "membar/client.h"
#include "window.h"
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
    if (engine_) {
      (void)engine_->client_close(id_);
      engine_.reset();
    }
#if defined(MEMBAR_WITH_CUDA)
    stream_signals_.reset();
#endif
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
    MEMBAR_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::create(std::move(backend), {}));

    auto client = std::unique_ptr<EmbeddedClient>(new EmbeddedClient());
    client->kind_ = kind;
    client->device_ = config.device;
    client->host_pool_bytes_ = config.host_pool_bytes;
    EmbeddedClient* self = client.get();
    runtimed::ClientEvents events;
    events.frame_granted = [self](uint32_t window_frame, Tier tier, int fd) {
      Status status = self->window(tier).map_frame(window_frame, fd);
      if (!status.ok()) self->note_window_error(status);
    };
    events.frame_revoked = [self](uint32_t window_frame, Tier tier) {
      Status status = self->window(tier).unmap_frame(window_frame);
      if (!status.ok()) self->note_window_error(status);
    };
    runtimed::ClientConfig client_config;
    client_config.name = "embedded";
    client_config.pid = int32_t(::getpid());
    MEMBAR_ASSIGN_OR_RETURN(client->id_, engine->client_open(client_config, std::move(events)));
    client->engine_ = std::move(engine);
    MEMBAR_ASSIGN_OR_RETURN(uint32_t gpu_frames, client->engine_->client_window_frames(client->id_, Tier::kGpu));
    MEMBAR_ASSIGN_OR_RETURN(uint32_t host_frames, client->engine_->client_window_frames(client->id_, Tier::kHost));
#if defined(MEMBAR_WITH_CUDA)
    if (kind == BackendKind::kCuda) {
      MEMBAR_ASSIGN_OR_RETURN(client->gpu_window_, make_cuda_window(gpu_frames, config.device));
    }
#endif
    if (!client->gpu_window_) {
      MEMBAR_ASSIGN_OR_RETURN(client->gpu_window_, make_host_window(gpu_frames));
    }
    MEMBAR_ASSIGN_OR_RETURN(client->host_window_, make_host_window(host_frames));
    MEMBAR_RETURN_IF_ERROR(client->map_signal_block());
    return std::unique_ptr<Client>(std::move(client));
  }

  std::string describe() const override {
    return kind_ == BackendKind::kCuda ? "embedded:cuda" : "embedded:host";
  }
  BackendKind backend() const override { return kind_; }

  Result<SpaceId> create_space(const std::string& name, uint64_t page_bytes, uint32_t page_count) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(SpaceId space, engine_->create_space(id_, name, page_bytes, page_count));
    page_bytes_[space] = page_bytes;
    return space;
  }

  Status destroy_space(SpaceId space) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_RETURN_IF_ERROR(engine_->destroy_space(id_, space));
    page_bytes_.erase(space);
    return take_window_error();
  }

  Result<Acquired> acquire(PageRange range, uint32_t flags) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(runtimed::AcquireResult result, engine_->acquire(id_, range, flags));
    MEMBAR_RETURN_IF_ERROR(take_window_error());
    Acquired acquired;
    acquired.ticket = result.ticket;
    MEMBAR_ASSIGN_OR_RETURN(acquired.page_pointers, pointers(*gpu_window_, range.space, result.locations));
    return acquired;
  }

  Status release(PageRange range, bool dirty) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return engine_->release(id_, range, dirty);
  }

  Result<Ticket> prefetch(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Ticket ticket, engine_->prefetch(id_, range));
    MEMBAR_RETURN_IF_ERROR(take_window_error());
    return ticket;
  }

  Result<Ticket> offload(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(Ticket ticket, engine_->offload(id_, range));
    MEMBAR_RETURN_IF_ERROR(take_window_error());
    return ticket;
  }

  Status free_pages(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_RETURN_IF_ERROR(engine_->free_pages(id_, range));
    return take_window_error();
  }

  Result<std::vector<void*>> acquire_host(PageRange range) override {
    runtimed::AcquireResult result;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(result, engine_->acquire_host_async(id_, range));
      MEMBAR_RETURN_IF_ERROR(take_window_error());
    }
    MEMBAR_RETURN_IF_ERROR(wait(result.ticket));
    std::lock_guard<std::mutex> lock(mutex_);
    return pointers(*host_window_, range.space, result.locations);
  }

  Status release_host(PageRange range, bool dirty) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_RETURN_IF_ERROR(engine_->release_host(id_, range, dirty));
    return take_window_error();
  }

  Status set_schedule(std::vector<ScheduleStep> steps) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return engine_->set_schedule(id_, std::move(steps));
  }

  Status advance(uint32_t step) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_RETURN_IF_ERROR(engine_->advance(id_, step));
    return take_window_error();
  }

  // Not under the client mutex: waiting must not block other threads' calls.
  Status wait(Ticket ticket) override {
    if (completed_ticket() >= ticket) return Status::Ok();
    auto start = std::chrono::steady_clock::now();
    Status status = engine_->wait(id_, ticket);
    auto waited = std::chrono::steady_clock::now() - start;
    (void)engine_->add_stall_ns(id_, uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count()));
    return status;
  }

  Ticket completed_ticket() const override {
    if (signal_words_ == nullptr) return 0;
    return __atomic_load_n(const_cast<uint64_t*>(signal_words_ + runtimed::kSignalCompleted), __ATOMIC_ACQUIRE);
  }

  Status stream_wait(Ticket ticket, void* cuda_stream) override {
#if defined(MEMBAR_WITH_CUDA)
    if (stream_signals_) return stream_signals_->stream_wait(runtimed::kSignalCompleted, ticket, cuda_stream);
#endif
    return unimplemented("stream_wait needs the CUDA backend; this client runs on " + describe() +
                         " (use wait(ticket))");
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
    return unimplemented("stream_release needs the CUDA backend; this client runs on " + describe() +
                         " (use release)");
  }

  void* window_base() const override { return gpu_window_->base(); }
  uint64_t window_bytes() const override { return gpu_window_->bytes(); }

  Result<std::vector<PageLocation>> locations(PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return engine_->locations(id_, range);
  }

  Result<RuntimeStats> stats() override { return engine_->stats(id_); }

  Result<Channel> create_channel(const std::string& name, uint64_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(runtimed::ChannelGrant grant,
                            process_channels().create(channel_owner_, ::getuid(), name, bytes, host_pool_bytes_));
    return channels_.add(grant.fd, grant.id, grant.bytes, grant.writable, /*owner=*/true);
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
    return entry.owner ? process_channels().close(channel_owner_, entry.runtime_id) : Status::Ok();
  }

 private:
  EmbeddedClient() = default;

  Window& window(Tier tier) { return tier == Tier::kGpu ? *gpu_window_ : *host_window_; }

  // Window callbacks run on whichever thread delivers the engine's events; errors are kept for
  // the next call to report.
  void note_window_error(const Status& status) {
    std::lock_guard<std::mutex> lock(window_error_mutex_);
    if (window_error_.ok()) window_error_ = status;
  }
  Status take_window_error() {
    std::lock_guard<std::mutex> lock(window_error_mutex_);
    return std::exchange(window_error_, Status::Ok());
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

  Result<std::vector<void*>> pointers(const Window& window, SpaceId space,
                                      const std::vector<PageLocation>& locations) const {
    auto it = page_bytes_.find(space);
    if (it == page_bytes_.end()) return not_found("no space " + std::to_string(space));
    std::vector<void*> answer;
    answer.reserve(locations.size());
    char* base = static_cast<char*>(window.base());
    for (const PageLocation& location : locations) {
      if (location.window_frame == kNoFrame || !window.is_mapped(location.window_frame)) {
        return internal_error("the runtime returned a page in window frame " +
                              std::to_string(location.window_frame) + ", which is not mapped");
      }
      answer.push_back(base + uint64_t(location.window_frame) * kFrameBytes + uint64_t(location.slot) * it->second);
    }
    return answer;
  }

  std::mutex mutex_;  // serialises calls (see client.h)
  std::unique_ptr<Engine> engine_;
  ClientId id_ = 0;
  BackendKind kind_ = BackendKind::kHost;
  int device_ = 0;
  std::unique_ptr<Window> gpu_window_;
  std::unique_ptr<Window> host_window_;
  std::map<SpaceId, uint64_t> page_bytes_;
  volatile uint64_t* signal_words_ = nullptr;
  uint64_t signal_bytes_ = 0;
  std::mutex window_error_mutex_;
  Status window_error_;
  uint64_t host_pool_bytes_ = 0;
  ClientId channel_owner_ = next_channel_owner.fetch_add(1);
  ChannelTable channels_;  // guarded by mutex_
#if defined(MEMBAR_WITH_CUDA)
  std::unique_ptr<StreamSignals> stream_signals_;
  uint64_t release_marker_ = 0;
#endif
};

}  // namespace

Result<std::unique_ptr<Client>> make_embedded_client(const EmbeddedConfig& config) {
  return EmbeddedClient::create(config);
}

}  // namespace membar
