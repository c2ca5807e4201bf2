// The engine's public API: clients, spaces, the page calls, stats. See membar/engine/engine.h for
// the interface and engine_impl.h for how the engine is split into parts.
//
// Note [Space layout]
// Rationale: kernels want a layer's history as one strided tensor (cuDNN's fused attention reads
// only contiguous K/V; a gather or a slot table costs bandwidth and rules it out), page sizes
// follow the model (32 KiB pages for a small model, head sizes of 96), and pages must still move
// between GPU and host memory behind compute, with the copy engines, in 2 MiB frames.
// Approach: a space is one contiguous range of bytes in the client's address space, one
// reservation per tier (GPU and host); page p lives at base + p * page_bytes, for any page size.
// Its bytes are cut into space frames of 2 MiB: each is held by at most one GPU frame, mapped at
// the space frame's position in the GPU reservation, and one host frame, mapped at its position
// in the host reservation. Residency, dirtiness, pins, eviction and transfers are per space frame;
// a page range names the space frames that cover its bytes. The engine decides which physical
// frame holds what and tells the client where to map it (frame_mapped / frame_unmapped); a
// physical frame stays mapped at the positions it served (Note [Remapping a position] in
// frames.cpp), so streaming a history through a bounded GPU budget reuses mappings instead of
// making new ones.
// Limitations: two page ranges that share a space frame share its state: acquiring one for the
// host while the other is acquired on the GPU is refused; free_pages drops only the space frames
// wholly inside its range (a frame shared with pages outside keeps its contents until a range
// covering it is freed or the space is destroyed); the last space frame may be partial and still
// takes a whole frame.
//
// Note [Freed pages]
// Rationale: free_pages is per page, but contents are kept per space frame; a frame shared by
// freed pages and live ones must keep its contents, yet a freed page must read as zeros when it is
// acquired again with zero-fill (a trainer reuses its gradient pages sequence after sequence), and
// the frame must go once every page in it is freed.
// Approach: a space gets a bitmap of freed pages and a count per frame of its freed pages at its
// first free_pages. Freeing a freed page is a double free. A frame goes (contents dropped in both
// tiers) when all its pages are freed. Acquiring pages clears their bits; with zero-fill, the bytes
// of pages that were freed in a frame that still has contents are zero-filled (after any copy into
// the frame: batch order), and a host acquire does the same on the host side.
// Limitations: the bitmap costs a bit per page: spaces of more than 2^28 pages take frees of
// whole frames only.
//
// Note [Counters]
// Stats read counters kept as space frames change, never a walk over frames or pages: per space
// the bytes by residency class (GPU, host, both, none), dirty and pinned, and per client their
// sums. Every change of a space frame's residency, dirty bit or pins goes through change(), which
// takes the frame's old contribution out and puts the new one in. A stats request costs
// O(clients + spaces reported), and spaces come in pages (first_space, max_spaces).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <unistd.h>

#include "engine_impl.h"
#include "membar/common/human_bytes.h"

namespace membar::runtimed {
namespace {

std::string hex(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(value));
  return text;
}

}  // namespace

EngineImpl::EngineImpl(std::unique_ptr<DeviceBackend> backend, const EngineConfig& config)
    : backend_(std::move(backend)),
      config_(config),
      order_on_device_(config.order_on_device && backend_->orders_on_device()),
      submit_on_dispatcher_(order_on_device_ && config.submit_on_dispatcher),
      next_client_(config.first_client_id) {
  TierPoolState& gpu = pools_[0];
  gpu.frames.resize(backend_->frame_count(Tier::kGpu));
  for (uint64_t i = gpu.frames.size(); i > 0; --i) gpu.free_frames.push_back(FrameIndex(i - 1));
  // Host slabs start unprepared: each is renewed (made, and pinned on CUDA) before first use, in
  // the background, so that the daemon serves at once however large its host pool.
  TierPoolState& host = pools_[1];
  host.frames.resize(backend_->frame_count(Tier::kHost));
  slab_frames_ = std::max<uint32_t>(backend_->host_slab_frames(), 1);
  uint64_t slab_count = host.frames.size() / slab_frames_;
  slabs_.resize(slab_count);
  for (uint64_t s = 0; s < slab_count; ++s) {
    slabs_[s].first_frame = FrameIndex(s * slab_frames_);
    slabs_[s].frames = slab_frames_;
    for (uint32_t i = 0; i < slab_frames_; ++i) host.frames[s * slab_frames_ + i].slab = uint32_t(s);
  }
  dispatcher_ = std::thread([this] { dispatcher_loop(); });
  if (config_.host_share) {
    share_member_ = config_.host_share->join([this] { return spare_slabs_.load(); },
                                             [this] {
                                               {
                                                 std::lock_guard<std::mutex> lock(completion_mutex_);
                                                 ++release_requests_;
                                                 release_asked_ = true;
                                               }
                                               completion_ready_.notify_one();
                                             });
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (uint64_t s = 0; s < slab_count; ++s) {
    if (config_.host_share && (s >= config_.host_initial_slabs || !config_.host_share->take())) {
      slabs_[s].state = Slab::State::kUnbacked;   // Note [One host pool for a node]
      continue;
    }
    renew_slab(uint32_t(s));
  }
}

// Note [No renewal at teardown]
// Rationale: memory a client gives up is renewed before anyone else gets it (Note [Frames, slabs
// and renewal]): a new GPU allocation per frame, a new pinned memfd per host slab. An engine
// that is being destroyed hands nothing to anyone again, and its backend frees all of it a moment
// later. Renewing there cost an embedded trainer's exit (and a stopping membard's) a second
// allocation of every pool while the old memory was still mapped in the trainer's process: on the
// H200 a Gemma-2-9B trainer with 59 GiB of pinned host slabs and ~77 GiB of GPU frames was still
// dropping its store 135 s into its process (session 24; with this Note the same run ended 83 s in,
// step included), and with PyTorch's cache holding the rest of the GPU new frames can fail for
// memory and wait out Note [Renewal when memory is short] (2 minutes).
// Approach: the destructor sets tearing_down_ before it closes the clients; renew_gpu_frame and
// renew_slab then do nothing, and the memory goes with the backend. The embedded client lets the
// destructor close it instead of closing it first.
EngineImpl::~EngineImpl() {
  if (config_.host_share) config_.host_share->leave(share_member_);
  std::vector<ClientId> ids;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tearing_down_ = true;
    for (auto& [id, client] : clients_) ids.push_back(id);
  }
  for (ClientId id : ids) (void)client_close(id);
  backend_->drain();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    renewals_done_.wait(lock, [&] { return renewals_in_flight_ == 0; });
  }
  {
    std::lock_guard<std::mutex> lock(completion_mutex_);
    stopping_ = true;
  }
  completion_ready_.notify_all();
  dispatcher_.join();
  backend_.reset();
  if (config_.host_share) {   // the memory is gone with the backend: its capacity is the others'
    for (const Slab& slab : slabs_) {
      if (slab.state != Slab::State::kUnbacked) config_.host_share->give_back();
    }
  }
}

// ---- Lookups ------------------------------------------------------------------------------------

std::string EngineImpl::no_client_text(ClientId id) {
  return "client " + std::to_string(id) + " is not open (never opened, or closed)";
}

Result<ClientState*> EngineImpl::find_client(ClientId id) {
  auto it = clients_.find(id);
  if (it == clients_.end()) return not_found(no_client_text(id));
  return it->second.get();
}

Result<std::shared_ptr<ClientState>> EngineImpl::find_client_shared(ClientId id) {
  auto it = clients_.find(id);
  if (it == clients_.end()) return not_found(no_client_text(id));
  return it->second;
}

Result<Space*> EngineImpl::find_space(ClientState& client, SpaceId space_id) {
  auto it = client.spaces.find(space_id);
  if (it == client.spaces.end()) {
    return not_found("client " + std::to_string(client.id) + " has no space " + std::to_string(space_id));
  }
  return it->second.get();
}

Result<EngineImpl::FrameSpan> EngineImpl::check_range(ClientState& client, const PageRange& range) {
  MEMBAR_ASSIGN_OR_RETURN(Space * space, find_space(client, range.space));
  MEMBAR_ASSIGN_OR_RETURN(FrameSpan span, span_in(space->info, range));
  span.space = space;
  return span;
}

Result<EngineImpl::FrameSpan> EngineImpl::span_in(const SpaceInfo& info, const PageRange& range) {
  if (range.page_count == 0) {
    return invalid_argument("an empty page range of space '" + info.name + "' (page_count is 0)");
  }
  uint64_t end = uint64_t(range.first_page) + range.page_count;
  if (end > info.page_count) {
    return out_of_range("pages [" + std::to_string(range.first_page) + ", " + std::to_string(end) +
                        ") are outside space '" + info.name + "' of " + std::to_string(info.page_count) + " pages");
  }
  uint64_t first_byte = uint64_t(range.first_page) * info.page_bytes;
  uint64_t end_byte = end * info.page_bytes;
  FrameSpan span;
  span.first = uint32_t(first_byte / kFrameBytes);
  span.end = uint32_t((end_byte + kFrameBytes - 1) / kFrameBytes);
  span.first_page = range.first_page;
  span.page_count = range.page_count;
  return span;
}

std::string EngineImpl::frame_text(const Space& space, uint32_t g) {
  return "bytes [" + std::to_string(uint64_t(g) * kFrameBytes) + ", " +
         std::to_string(uint64_t(g) * kFrameBytes + space.frame_bytes(g)) + ") of space '" + space.info.name + "'";
}

// ---- Counters (Note [Counters]) -------------------------------------------------------------------

int EngineImpl::residency_class(const SpaceFrame& frame) {
  return (frame.gpu != kNoFrame ? kClassGpu : 0) | (frame.host_valid ? kClassHost : 0);
}

void EngineImpl::count_frame(ClientState& client, Space& space, const SpaceFrame& frame, uint32_t g, int sign) {
  int64_t bytes = int64_t(space.frame_bytes(g)) * sign;
  int cls = residency_class(frame);
  space.counters.bytes[cls] += uint64_t(bytes);
  uint64_t* client_bytes[4] = {&client.stats.bytes_none, &client.stats.bytes_gpu, &client.stats.bytes_host,
                               &client.stats.bytes_both};
  *client_bytes[cls] += uint64_t(bytes);
  if (frame.dirty) space.counters.dirty += uint64_t(bytes);
  if (frame.pins != 0 || frame.host_pins != 0) space.counters.pinned += uint64_t(bytes);
}

// ---- Waiting for a client's stream ------------------------------------------------------------

Status EngineImpl::wait_for_marker(const std::shared_ptr<ClientState>& client, uint64_t marker) {
  // Note [Remapping a position]: the client's own GPU work that was enqueued before the marker;
  // it makes progress on its own, so this is a short wait on the client's own stream.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (client->closed) return unavailable("client " + std::to_string(client->id) + " was closed");
      if (fence_met(*client, marker)) return Status::Ok();
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return Status(StatusCode::DEADLINE_EXCEEDED,
                    "client " + std::to_string(client->id) + "'s stream did not pass release marker " +
                        std::to_string(marker) + " within 30 s (is its GPU stopped?)");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// ---- Clients ------------------------------------------------------------------------------------

Result<ClientId> EngineImpl::client_open(const ClientConfig& config, ClientEvents events) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto client = std::make_shared<ClientState>();
  client->id = next_client_;
  next_client_ += config_.client_id_step;
  client->config = config;
  client->events = std::move(events);
  client->stats.client = client->id;
  client->stats.pid = config.pid;
  client->stats.uid = config.uid;
  client->stats.name = config.name;
  for (Tier tier : {Tier::kGpu, Tier::kHost}) {
    int t = tier_index(tier);
    uint64_t pool_frames = pools_[t].frames.size();
    uint64_t quota_bytes = tier == Tier::kGpu ? config.gpu_quota_bytes : config.host_quota_bytes;
    if (quota_bytes == 0) {
      quota_bytes = tier == Tier::kGpu ? config_.default_gpu_quota_bytes : config_.default_host_quota_bytes;
    }
    if (quota_bytes != 0 && quota_bytes < kFrameBytes) {
      return invalid_argument("a " + std::string(tier_name(tier)) + " quota of " + std::to_string(quota_bytes) +
                              " bytes is less than one 2 MiB frame (0 asks for the daemon's default share)");
    }
    uint64_t quota_frames = quota_bytes == 0 ? pool_frames : std::min(pool_frames, quota_bytes / kFrameBytes);
    client->quota_frames[t] = uint32_t(quota_frames);
  }
  for (uint32_t w = 0; w < client->quota_frames[0]; ++w) client->free_gpu_windows.insert(client->free_gpu_windows.end(), w);
  client->stats.gpu_quota_bytes = uint64_t(client->quota_frames[0]) * kFrameBytes;
  client->stats.host_quota_bytes = uint64_t(client->quota_frames[1]) * kFrameBytes;
  uint32_t words = std::max<uint32_t>(config_.signal_words_per_client, 2);
  MEMBAR_ASSIGN_OR_RETURN(client->signal_block, backend_->create_signal_block(words));
  client->signal_words = backend_->signal_words(client->signal_block);
  if (client->signal_words == nullptr) {
    (void)backend_->destroy_signal_block(client->signal_block);
    return internal_error("the backend returned no CPU view of a new signal block");
  }
  for (uint32_t i = 0; i < words; ++i) client->signal_words[i] = 0;
  clients_.emplace(client->id, client);
  return client->id;
}

Status EngineImpl::client_close(ClientId id) {
  std::shared_ptr<ClientState> client;
  std::map<SpaceId, std::unique_ptr<Space>> doomed_spaces;
  std::optional<uint32_t> doomed_block;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = clients_.find(id);
    if (it == clients_.end()) return not_found(no_client_text(id));
    client = it->second;
    client->closed = true;
    // Batches not yet handed to the backend never will be: cancel them. Submitted ones finish
    // on their own; their frames are renewed only after.
    std::vector<uint64_t> cancelled;
    for (auto& [batch_id, batch] : batches_) {
      if (batch.client == id && !batch.submitted) cancelled.push_back(batch_id);
    }
    for (uint64_t batch_id : cancelled) {
      Batch& batch = batches_.at(batch_id);
      for (auto [tier, frame] : batch.frames) {
        Frame& f = frame_of(tier, frame);
        f.pending_batches.erase(std::remove(f.pending_batches.begin(), f.pending_batches.end(), batch_id),
                                f.pending_batches.end());
      }
      batches_.erase(batch_id);
    }
    return_client_memory(*client);
    space_frames_all_ -= client->space_frames_total;
    // The page tables are freed below, with no lock held (a huge space takes a while).
    doomed_spaces.swap(client->spaces);
    if (order_on_device_ && client->signal_words != nullptr) {
      // Copies enqueued to wait on the device for this client's markers need not wait any more;
      // they read the block until they have run (Note [Device-ordered copies]).
      __atomic_store_n(const_cast<uint64_t*>(client->signal_words + kSignalReleased), UINT64_MAX, __ATOMIC_RELEASE);
      doomed_block = client->signal_block;
    } else {
      (void)backend_->destroy_signal_block(client->signal_block);
    }
    client->signal_words = nullptr;
    clients_.erase(it);
  }
  if (doomed_block) {
    backend_->drain();
    (void)backend_->destroy_signal_block(*doomed_block);
  }
  ticket_done_.notify_all();
  doomed_spaces.clear();
  // Wait for a delivery in progress on another thread, then close descriptors nobody will take.
  std::lock_guard<std::mutex> delivery(client->delivery_mutex);
  std::lock_guard<std::mutex> lock(mutex_);
  for (ClientEvent& event : client->events_queue) {
    if (event.fd >= 0) ::close(event.fd);
  }
  client->events_queue.clear();
  return Status::Ok();
}

Result<int> EngineImpl::client_signal_fd(ClientId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
  return backend_->export_signal_block(client->signal_block);
}

Result<ClientGeometry> EngineImpl::client_geometry(ClientId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
  return ClientGeometry{client->quota_frames[0], client->quota_frames[1], slab_frames_};
}

// ---- Spaces -------------------------------------------------------------------------------------

Result<SpaceId> EngineImpl::create_space(ClientId id, const std::string& name, uint64_t page_bytes,
                                         uint32_t page_count) {
  if (name.empty() || name.size() > 255) {
    return invalid_argument("a space name must have 1 to 255 characters, not " + std::to_string(name.size()));
  }
  if (page_bytes == 0 || page_bytes > kMaxPageBytes) {
    return invalid_argument("space '" + name + "': page size " + std::to_string(page_bytes) + " bytes is not in [1, " +
                            human_bytes(kMaxPageBytes) + "]");
  }
  if (page_count == 0) return invalid_argument("space '" + name + "' must have at least one page");
  uint64_t bytes = page_bytes * uint64_t(page_count);
  if (bytes > kMaxSpaceBytes) {
    return invalid_argument("space '" + name + "' of " + human_bytes(bytes) + " is larger than the largest space (" +
                            human_bytes(kMaxSpaceBytes) + ")");
  }
  uint64_t frames = (bytes + kFrameBytes - 1) / kFrameBytes;
  // The page table's frames are reserved under the lock first, then the table is made outside it
  // (a large space must not stall other clients, and a flood of large spaces must not make the
  // engine allocate what its limits would refuse).
  auto check = [&](ClientState& client, uint64_t reserved) -> Status {
    if (client.spaces.size() >= config_.max_spaces_per_client) {
      return resource_exhausted("client " + std::to_string(id) + " has " + std::to_string(client.spaces.size()) +
                                " spaces, the most one client may have (--max-spaces)");
    }
    if (client.space_frames_total - reserved + frames > config_.max_space_frames_per_client) {
      return resource_exhausted("space '" + name + "' of " + human_bytes(bytes) + " would bring client " +
                                std::to_string(id) + "'s spaces to " +
                                human_bytes((client.space_frames_total - reserved + frames) * kFrameBytes) +
                                ", over its limit of " + human_bytes(config_.max_space_frames_per_client * kFrameBytes));
    }
    if (space_frames_all_ - reserved + frames > config_.max_space_frames_total) {
      return resource_exhausted("space '" + name + "' of " + human_bytes(bytes) + " would bring all clients' spaces to " +
                                human_bytes((space_frames_all_ - reserved + frames) * kFrameBytes) +
                                ", over the limit of " + human_bytes(config_.max_space_frames_total * kFrameBytes) +
                                " for their page tables (--max-total-space)");
    }
    if (client.space_names.count(name) != 0) {
      return already_exists("client " + std::to_string(id) + " already has a space named '" + name + "'");
    }
    return Status::Ok();
  };
  MEMBAR_RETURN_IF_ERROR(with_client<Status>(id, [&](ClientState& client) -> Status {
    MEMBAR_RETURN_IF_ERROR(check(client, 0));
    client.space_frames_total += frames;
    space_frames_all_ += frames;
    return Status::Ok();
  }));
  auto space = std::make_unique<Space>();
  space->info.name = name;
  space->info.page_bytes = page_bytes;
  space->info.page_count = page_count;
  space->bytes = bytes;
  space->frames.resize(frames);
  space->counters.bytes[kClassNone] = bytes;
  return with_client<Result<SpaceId>>(id, [&](ClientState& client) -> Result<SpaceId> {
    // Checked again (another call of this client may have come in between): the reservation is
    // returned when it fails. A client closed meanwhile took its reservations with it.
    if (Status again = check(client, frames); !again.ok()) {
      client.space_frames_total -= frames;
      space_frames_all_ -= frames;
      return again;
    }
    SpaceId space_id = client.next_space++;
    space->info.id = space_id;
    space->info.client = id;
    client.space_names[name] = space_id;
    client.stats.bytes_none += bytes;
    client.stats.spaces = uint32_t(client.spaces.size() + 1);
    client.spaces.emplace(space_id, std::move(space));
    return space_id;
  });
}

// A space is destroyed in chunks of space frames, the engine lock taken per chunk, so that a huge
// space (a million frames) does not stall other clients (Note [Counters]): the owner's calls are
// serialised, so nothing adds contents, pins or fences to the space meanwhile; other clients'
// reclaims and finishing copies only take state away. The page table is freed with no lock held.
Status EngineImpl::destroy_space(ClientId id, SpaceId space_id) {
  constexpr uint32_t kChunkFrames = 16384;
  // Pins are known from the counters, without a walk.
  uint32_t frame_count = 0;
  MEMBAR_RETURN_IF_ERROR(with_client<Status>(id, [&](ClientState& client) -> Status {
    MEMBAR_ASSIGN_OR_RETURN(Space * space, find_space(client, space_id));
    if (space->counters.pinned != 0) {
      return failed_precondition("space '" + space->info.name + "' cannot be destroyed: " +
                                 human_bytes(space->counters.pinned) + " of it are still acquired");
    }
    frame_count = uint32_t(space->frames.size());
    return Status::Ok();
  }));
  // The client's kernels may still read positions released in stream order: their mappings go
  // only once its stream has passed the markers.
  for (int attempt = 0;; ++attempt) {
    uint64_t newest = 0;
    for (uint32_t first = 0; first < frame_count; first += kChunkFrames) {
      MEMBAR_RETURN_IF_ERROR(with_client<Status>(id, [&](ClientState& client) -> Status {
        MEMBAR_ASSIGN_OR_RETURN(Space * space, find_space(client, space_id));
        uint32_t end = uint32_t(std::min<uint64_t>(space->frames.size(), uint64_t(first) + kChunkFrames));
        for (uint32_t g = first; g < end; ++g) {
          const SpaceFrame& frame = space->frames[g];
          if (frame.mapped_gpu != kNoFrame && frame.va_fence != 0 && !fence_met(client, frame.va_fence)) {
            newest = std::max(newest, frame.va_fence);
          }
        }
        return Status::Ok();
      }));
    }
    if (newest == 0) break;
    if (attempt >= 64) {
      return Status(StatusCode::DEADLINE_EXCEEDED, "destroy_space: client " + std::to_string(id) +
                                                       "'s stream keeps the space's mappings in use");
    }
    std::shared_ptr<ClientState> owner;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(owner, find_client_shared(id));
    }
    MEMBAR_RETURN_IF_ERROR(wait_for_marker(owner, newest));
  }
  for (uint32_t first = 0; first < frame_count; first += kChunkFrames) {
    MEMBAR_RETURN_IF_ERROR(with_client<Status>(id, [&](ClientState& client) -> Status {
      MEMBAR_ASSIGN_OR_RETURN(Space * space, find_space(client, space_id));
      uint32_t end = uint32_t(std::min<uint64_t>(space->frames.size(), uint64_t(first) + kChunkFrames));
      for (uint32_t g = first; g < end; ++g) {
        drop_frame(client, *space, g);
        unmap_position(client, *space, g);
      }
      return Status::Ok();
    }));
  }
  std::unique_ptr<Space> doomed;
  Status done = with_client<Status>(id, [&](ClientState& client) -> Status {
    auto it = client.spaces.find(space_id);
    if (it == client.spaces.end()) return find_space(client, space_id).status();
    Space& space = *it->second;
    client.space_names.erase(space.info.name);
    client.space_frames_total -= space.frames.size();
    space_frames_all_ -= space.frames.size();
    client.stats.bytes_none -= space.counters.bytes[kClassNone];
    doomed = std::move(it->second);
    client.spaces.erase(it);
    client.stats.spaces = uint32_t(client.spaces.size());
    // A schedule naming a dead space is meaningless: forget it.
    if (!client.schedule.empty()) clear_schedule(client);
    return Status::Ok();
  });
  doomed.reset();
  return done;
}

Result<SpaceInfo> EngineImpl::space_info(ClientId id, SpaceId space_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
  MEMBAR_ASSIGN_OR_RETURN(Space * space, find_space(*client, space_id));
  return space->info;
}

// ---- Acquire / release ------------------------------------------------------------------------

Result<Ticket> EngineImpl::acquire(ClientId id, PageRange range, uint32_t flags) {
  return with_client_waiting<Result<Ticket>>(
      id, [&](ClientState& client, std::optional<FenceWait>& wait) -> Result<Ticket> {
        MEMBAR_ASSIGN_OR_RETURN(FrameSpan span, check_range(client, range));
        uint32_t known = kEngineAcquireWrite | kEngineAcquireZeroNew;
        if ((flags & ~known) != 0) {
          return invalid_argument("acquire: unknown flag bits " + hex(flags & ~known) + " (known: " + hex(known) + ")");
        }
        Ticket ticket = 0;
        MEMBAR_ASSIGN_OR_RETURN(wait, acquire_locked(client, span, flags, &ticket));
        return ticket;
      });
}

Result<std::optional<FenceWait>> EngineImpl::acquire_locked(ClientState& client, FrameSpan span, uint32_t flags,
                                                            Ticket* ticket) {
  Space& space = *span.space;
  for (uint32_t g = span.first; g < span.end; ++g) {
    if (space.frames[g].host_pins != 0) {
      return failed_precondition(frame_text(space, g) +
                                 " are acquired for host access; release_host them before acquiring them on the GPU");
    }
  }
  Builder builder = start_builder(client);
  // Pin what is already resident first, so that no frame of this range evicts another.
  std::vector<uint32_t> pinned_now;
  std::vector<uint32_t> needs_frame;
  for (uint32_t g = span.first; g < span.end; ++g) {
    SpaceFrame& frame = space.frames[g];
    if (frame.gpu != kNoFrame) {
      // A copy into the frame may still run (an untracked lookahead prefetch): the ticket covers it.
      depend_on_frame(builder, Tier::kGpu, frame.gpu);
      eviction_erase(client, frame);
      change(client, space, g, [](SpaceFrame& f) { ++f.pins; });
      pinned_now.push_back(g);
      if (frame.prefetched) ++client.stats.prefetch_hits;
      frame.prefetched = false;
    } else {
      needs_frame.push_back(g);
    }
  }
  // Phase 1: frames (evicting as needed; writebacks go into the builder first).
  std::vector<uint32_t> placed;
  auto undo = [&](Status status) -> Result<std::optional<FenceWait>> {
    for (uint32_t g : placed) clear_gpu(client, space, g);
    for (uint32_t g : pinned_now) unpin(client, space, g);
    (void)finish_builder(builder);
    return status;
  };
  for (uint32_t g : needs_frame) {
    Result<std::optional<FenceWait>> placement = place_gpu(client, builder, space, g, nullptr);
    if (!placement.ok()) return undo(placement.status());
    if (placement.value().has_value()) {
      std::optional<FenceWait> wait = placement.value();
      (void)undo(Status::Ok());
      return wait;
    }
    placed.push_back(g);
    // The frame may have been someone's until now: a copy or fill of the old owner still queued
    // must land before this ticket completes, even when this call puts nothing into the frame.
    depend_on_frame(builder, Tier::kGpu, space.frames[g].gpu);
  }
  // Phase 2: contents. A resident frame that never had contents (acquired before without
  // zero-fill and never written) is zero-filled now if asked.
  if (flags & kEngineAcquireZeroNew) {
    for (uint32_t g : pinned_now) {
      SpaceFrame& frame = space.frames[g];
      if (!frame.dirty && !frame.host_valid && !frame.write_intent) {
        add_zero(builder, space, g, Tier::kGpu, frame.gpu);
        change(client, space, g, [](SpaceFrame& f) { f.dirty = true; });
      }
    }
  }
  for (uint32_t g : placed) {
    SpaceFrame& frame = space.frames[g];
    if (frame.host_valid) {
      add_copy(builder, space, g, Tier::kHost, frame.host, Tier::kGpu, frame.gpu);
      ++client.stats.prefetch_misses;
      change(client, space, g, [](SpaceFrame& f) {
        f.dirty = false;
        ++f.pins;
      });
    } else {
      bool zero = (flags & kEngineAcquireZeroNew) != 0;
      if (zero) add_zero(builder, space, g, Tier::kGpu, frame.gpu);
      change(client, space, g, [zero](SpaceFrame& f) {
        f.dirty = zero;  // zeros are contents the host does not have
        ++f.pins;
      });
    }
  }
  unfree_pages(client, builder, span,
               (flags & kEngineAcquireZeroNew) ? std::optional<Tier>(Tier::kGpu) : std::optional<Tier>());
  for (uint32_t g = span.first; g < span.end; ++g) {
    SpaceFrame& frame = space.frames[g];
    frame.key.last_use = ++client.clock;
    if (flags & kEngineAcquireWrite) frame.write_intent = true;
  }
  *ticket = finish_builder(builder);
  return std::optional<FenceWait>();
}

Result<Ticket> EngineImpl::acquire_ranges(ClientId id, const std::vector<PageRange>& ranges, uint32_t flags,
                                          std::optional<uint32_t> advance_step) {
  if (ranges.empty()) return invalid_argument("acquire_ranges: no range given");
  return with_client_waiting<Result<Ticket>>(
      id, [&](ClientState& client, std::optional<FenceWait>& wait) -> Result<Ticket> {
        uint32_t known = kEngineAcquireWrite | kEngineAcquireZeroNew;
        if ((flags & ~known) != 0) {
          return invalid_argument("acquire: unknown flag bits " + hex(flags & ~known) + " (known: " + hex(known) + ")");
        }
        std::vector<FrameSpan> spans;
        for (const PageRange& range : ranges) {
          MEMBAR_ASSIGN_OR_RETURN(FrameSpan span, check_range(client, range));
          spans.push_back(span);
        }
        if (advance_step.has_value()) MEMBAR_RETURN_IF_ERROR(advance_locked(client, *advance_step));
        // Tickets complete in order: the last one's completion means every range is in place.
        Ticket last = 0;
        for (size_t i = 0; i < spans.size(); ++i) {
          Result<std::optional<FenceWait>> acquired = acquire_locked(client, spans[i], flags, &last);
          if (!acquired.ok() || acquired.value().has_value()) {
            for (size_t j = 0; j < i; ++j) unpin_span(client, spans[j]);
            if (!acquired.ok()) return acquired.status();
            wait = acquired.value();
            return Ticket{0};
          }
        }
        return last;
      });
}

void EngineImpl::unpin_span(ClientState& client, const FrameSpan& span) {
  for (uint32_t g = span.first; g < span.end; ++g) {
    SpaceFrame& frame = span.space->frames[g];
    if (frame.pins == 0) continue;
    if (frame.pins == 1) frame.write_intent = false;
    unpin(client, *span.space, g);
  }
}

void EngineImpl::unfree_pages(ClientState& client, Builder& builder, const FrameSpan& span,
                               std::optional<Tier> zero_tier) {
  Space& space = *span.space;
  if (space.freed.empty()) return;
  uint64_t pb = space.info.page_bytes;
  for (uint32_t p = span.first_page; p < span.first_page + span.page_count; ++p) {
    if (!space.page_freed(p)) continue;
    space.freed[p / 64] &= ~(uint64_t{1} << (p % 64));
    uint64_t page_start = uint64_t(p) * pb;
    uint64_t page_end = page_start + pb;
    for (uint32_t g = uint32_t(page_start / kFrameBytes); g <= uint32_t((page_end - 1) / kFrameBytes); ++g) {
      --space.freed_in_frame[g];
      if (!zero_tier.has_value()) continue;
      SpaceFrame& frame = space.frames[g];
      FrameIndex target = *zero_tier == Tier::kGpu ? frame.gpu : frame.host;
      // A frame without contents was zero-filled whole; only leftovers in live frames need it.
      if (target == kNoFrame || (*zero_tier == Tier::kGpu && !frame.dirty && !frame.host_valid)) continue;
      uint64_t frame_start = uint64_t(g) * kFrameBytes;
      uint64_t from = std::max(page_start, frame_start);
      uint64_t to = std::min(page_end, frame_start + space.frame_bytes(g));
      add_zero_bytes(builder, *zero_tier, target, from - frame_start, to - from);
      // The GPU copy is now the newer one: the host copy must not be read or written back over
      // (dirty implies !host_valid everywhere; a host access copies the GPU frame out first).
      if (*zero_tier == Tier::kGpu) {
        change(client, space, g, [](SpaceFrame& f) {
          f.dirty = true;
          f.host_valid = false;
        });
      } else if (frame.gpu != kNoFrame && frame.pins == 0) {
        // The host copy is now the newer one (a host access: no GPU pins): the GPU copy still
        // holds the freed pages' old bytes and must not serve a later acquire.
        eviction_erase(client, frame);
        clear_gpu(client, space, g);
        frame.prefetched = false;
        change(client, space, g, [](SpaceFrame& f) { f.dirty = false; });
      }
    }
  }
}

Status EngineImpl::release_ranges(ClientId id, const std::vector<PageRange>& ranges, bool dirty,
                                  std::optional<uint64_t> marker) {
  return with_client<Status>(id, [&](ClientState& client) -> Status {
    for (const PageRange& range : ranges) {
      MEMBAR_ASSIGN_OR_RETURN(FrameSpan span, check_range(client, range));
      for (uint32_t g = span.first; g < span.end; ++g) {
        if (span.space->frames[g].pins == 0) {
          return failed_precondition("release: " + frame_text(*span.space, g) + " are not acquired");
        }
      }
    }
    for (const PageRange& range : ranges) MEMBAR_RETURN_IF_ERROR(release_locked(client, range, dirty, marker));
    return Status::Ok();
  });
}

Status EngineImpl::release(ClientId id, PageRange range, bool dirty) {
  return with_client<Status>(id, [&](ClientState& client) { return release_locked(client, range, dirty, std::nullopt); });
}

Status EngineImpl::release_after(ClientId id, PageRange range, bool dirty, uint64_t marker) {
  return with_client<Status>(id, [&](ClientState& client) { return release_locked(client, range, dirty, marker); });
}

// Unpins; with a marker (stream_release) the frames and positions wait for it first (Note
// [Stream-ordered release]).
Status EngineImpl::release_locked(ClientState& client, const PageRange& range, bool dirty,
                                  std::optional<uint64_t> marker) {
  MEMBAR_ASSIGN_OR_RETURN(FrameSpan span, check_range(client, range));
  if (marker == 0u) return invalid_argument("release_after: the release marker must be at least 1");
  Space& space = *span.space;
  for (uint32_t g = span.first; g < span.end; ++g) {
    if (space.frames[g].pins == 0) return failed_precondition("release: " + frame_text(space, g) + " are not acquired");
  }
  bool fenced = marker.has_value() && !fence_met(client, *marker);
  for (uint32_t g = span.first; g < span.end; ++g) {
    SpaceFrame& frame = space.frames[g];
    if (fenced) {
      if (frame.gpu != kNoFrame) {
        uint64_t& fence = frame_of(Tier::kGpu, frame.gpu).fence;
        fence = std::max(fence, *marker);
      }
      frame.va_fence = std::max(frame.va_fence, *marker);
    }
    bool mark_dirty = dirty || frame.write_intent;
    change(client, space, g, [mark_dirty](SpaceFrame& f) {
      if (mark_dirty) {
        f.dirty = true;
        f.host_valid = false;
      }
    });
    if (frame.pins == 1) frame.write_intent = false;
    unpin(client, space, g);
  }
  return Status::Ok();
}

// ---- Hints ----------------------------------------------------------------------------------------

Result<Ticket> EngineImpl::prefetch(ClientId id, PageRange range) {
  return with_client<Result<Ticket>>(id, [&](ClientState& client) -> Result<Ticket> {
    MEMBAR_ASSIGN_OR_RETURN(FrameSpan span, check_range(client, range));
    Space& space = *span.space;
    Builder builder = start_builder(client);
    // Frames with no contents are left alone: acquire makes them. Frames already resident are
    // pinned for the duration of the call so the range does not evict itself.
    std::vector<uint32_t> held;
    std::vector<uint32_t> wanted;
    for (uint32_t g = span.first; g < span.end; ++g) {
      SpaceFrame& frame = space.frames[g];
      if (frame.gpu != kNoFrame) {
        eviction_erase(client, frame);
        change(client, space, g, [](SpaceFrame& f) { ++f.pins; });
        held.push_back(g);
      } else if (frame.host_valid && frame.host_pins == 0) {
        wanted.push_back(g);
      }
    }
    Status status = Status::Ok();
    for (uint32_t g : wanted) {
      Result<std::optional<FenceWait>> placement = place_gpu(client, builder, space, g, nullptr);
      if (!placement.ok()) {
        status = placement.status();
        break;
      }
      if (placement.value().has_value()) break;  // a hint: skip what would need a wait
      SpaceFrame& frame = space.frames[g];
      add_copy(builder, space, g, Tier::kHost, frame.host, Tier::kGpu, frame.gpu);
      change(client, space, g, [](SpaceFrame& f) { f.dirty = false; });
      frame.prefetched = true;
      frame.key.last_use = ++client.clock;
      eviction_insert(client, space, g);
    }
    for (uint32_t g : held) unpin(client, space, g);
    Ticket ticket = finish_builder(builder);
    if (!status.ok()) return status;
    return ticket;
  });
}

Result<Ticket> EngineImpl::offload(ClientId id, PageRange range) {
  return with_client<Result<Ticket>>(id, [&](ClientState& client) -> Result<Ticket> {
    MEMBAR_ASSIGN_OR_RETURN(FrameSpan span, check_range(client, range));
    Space& space = *span.space;
    for (uint32_t g = span.first; g < span.end; ++g) {
      if (space.frames[g].pins != 0) {
        return failed_precondition("offload: " + frame_text(space, g) + " are acquired; release them first");
      }
    }
    Builder builder = start_builder(client);
    Status status = Status::Ok();
    for (uint32_t g = span.first; g < span.end; ++g) {
      if (space.frames[g].gpu == kNoFrame) continue;
      status = evict_gpu(client, builder, space, g, /*pressure=*/false);
      if (!status.ok()) break;
    }
    Ticket ticket = finish_builder(builder);
    if (!status.ok()) return status;
    return ticket;
  });
}

Status EngineImpl::free_pages(ClientId id, PageRange range) {
  return with_client<Status>(id, [&](ClientState& client) -> Status {
    MEMBAR_ASSIGN_OR_RETURN(FrameSpan span, check_range(client, range));
    Space& space = *span.space;
    uint64_t first_byte = uint64_t(range.first_page) * space.info.page_bytes;
    uint64_t end_byte = (uint64_t(range.first_page) + range.page_count) * space.info.page_bytes;
    auto whole = [&](uint32_t g) {
      uint64_t start = uint64_t(g) * kFrameBytes;
      return start >= first_byte && start + space.frame_bytes(g) <= end_byte;
    };
    for (uint32_t g = span.first; g < span.end; ++g) {
      const SpaceFrame& frame = space.frames[g];
      if (frame.pins != 0 || frame.host_pins != 0) {
        return failed_precondition("free_pages: " + frame_text(space, g) + " are acquired; release them first");
      }
      if (whole(g) && frame.gpu == kNoFrame && frame.host == kNoFrame &&
          (space.freed_in_frame.empty() || space.freed_in_frame[g] == 0)) {
        return failed_precondition("free_pages: " + frame_text(space, g) +
                                   " hold nothing (never written, or already freed: double free?)");
      }
    }
    bool partial = !whole(span.first) || !whole(span.end - 1);
    if (partial && space.freed.empty() && space.info.page_count > (1u << 28)) {
      return invalid_argument("free_pages: space '" + space.info.name + "' has more than 2^28 pages; free whole 2 MiB "
                              "frames of it (Note [Freed pages])");
    }
    if (space.freed.empty() && (partial || space.info.page_count <= (1u << 28))) {
      space.freed.assign((uint64_t(space.info.page_count) + 63) / 64, 0);
      space.freed_in_frame.assign(space.frames.size(), 0);
    }
    if (space.freed.empty()) {  // a huge space, whole frames only
      for (uint32_t g = span.first; g < span.end; ++g) drop_frame(client, space, g);
      return Status::Ok();
    }
    for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
      if (space.page_freed(p)) {
        return failed_precondition("free_pages: page " + std::to_string(p) + " of space '" + space.info.name +
                                   "' is already freed (double free)");
      }
    }
    uint64_t pb = space.info.page_bytes;
    for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
      space.freed[p / 64] |= uint64_t{1} << (p % 64);
      uint64_t page_start = uint64_t(p) * pb;
      for (uint32_t g = uint32_t(page_start / kFrameBytes); g <= uint32_t((page_start + pb - 1) / kFrameBytes); ++g) {
        ++space.freed_in_frame[g];
      }
    }
    for (uint32_t g = span.first; g < span.end; ++g) {
      auto [first, last] = space.pages_of_frame(g);
      if (space.freed_in_frame[g] == last - first + 1) drop_frame(client, space, g);
    }
    return Status::Ok();
  });
}

// ---- Host access ----------------------------------------------------------------------------------

Result<Ticket> EngineImpl::acquire_host(ClientId id, PageRange range) {
  return with_client<Result<Ticket>>(id, [&](ClientState& client) -> Result<Ticket> {
    MEMBAR_ASSIGN_OR_RETURN(FrameSpan span, check_range(client, range));
    Space& space = *span.space;
    for (uint32_t g = span.first; g < span.end; ++g) {
      if (space.frames[g].pins != 0) {
        return failed_precondition(frame_text(space, g) +
                                   " are acquired on the GPU; release them before acquiring them for host access");
      }
    }
    Builder builder = start_builder(client);
    // Phase 1: host frames for every space frame that lacks one.
    std::vector<uint32_t> placed;
    for (uint32_t g = span.first; g < span.end; ++g) {
      SpaceFrame& frame = space.frames[g];
      if (frame.host != kNoFrame) {
        // A writeback into the frame may still run (an untracked lookahead's eviction).
        depend_on_frame(builder, Tier::kHost, frame.host);
        continue;
      }
      Result<FrameIndex> host = take_host_frame(client, space, g);
      if (!host.ok()) {
        for (uint32_t q : placed) clear_host(client, space, q);
        (void)finish_builder(builder);
        return host.status();
      }
      placed.push_back(g);
    }
    // Phase 2: contents. Dirty GPU copies are written back; frames with no contents read as zeros.
    for (uint32_t g = span.first; g < span.end; ++g) {
      SpaceFrame& frame = space.frames[g];
      if (!frame.host_valid) {
        if (frame.gpu != kNoFrame && frame.dirty) {
          add_copy(builder, space, g, Tier::kGpu, frame.gpu, Tier::kHost, frame.host);
          change(client, space, g, [](SpaceFrame& f) { f.dirty = false; });
        } else {
          // No contents anywhere: the host copy reads as zeros, and a GPU frame holding leftovers
          // is dropped so the two tiers never disagree about a clean frame.
          add_zero(builder, space, g, Tier::kHost, frame.host);
          if (frame.gpu != kNoFrame) {
            eviction_erase(client, frame);
            clear_gpu(client, space, g);
            frame.prefetched = false;
          }
        }
        change(client, space, g, [](SpaceFrame& f) { f.host_valid = true; });
      }
      change(client, space, g, [](SpaceFrame& f) { ++f.host_pins; });
    }
    unfree_pages(client, builder, span, Tier::kHost);
    return finish_builder(builder);
  });
}

Status EngineImpl::release_host(ClientId id, PageRange range, bool dirty) {
  return with_client<Status>(id, [&](ClientState& client) -> Status {
    MEMBAR_ASSIGN_OR_RETURN(FrameSpan span, check_range(client, range));
    Space& space = *span.space;
    for (uint32_t g = span.first; g < span.end; ++g) {
      if (space.frames[g].host_pins == 0) {
        return failed_precondition("release_host: " + frame_text(space, g) + " are not acquired for host access");
      }
    }
    for (uint32_t g = span.first; g < span.end; ++g) {
      SpaceFrame& frame = space.frames[g];
      change(client, space, g, [](SpaceFrame& f) { --f.host_pins; });
      // The host copy is now the newest: a GPU copy (never pinned meanwhile) is stale.
      if (dirty && frame.gpu != kNoFrame) {
        eviction_erase(client, frame);
        clear_gpu(client, space, g);
        frame.prefetched = false;
        change(client, space, g, [](SpaceFrame& f) { f.dirty = false; });
      }
    }
    return Status::Ok();
  });
}

// ---- Small calls ----------------------------------------------------------------------------------

Status EngineImpl::add_stall_ns(ClientId id, uint64_t ns) {
  std::lock_guard<std::mutex> lock(mutex_);
  MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
  client->stats.stall_ns += ns;
  return Status::Ok();
}

Status EngineImpl::wait(ClientId id, Ticket ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = clients_.find(id);
  if (it == clients_.end()) return not_found(no_client_text(id));
  std::shared_ptr<ClientState> client = it->second;
  if (ticket >= client->next_ticket) {
    return invalid_argument("wait: ticket " + std::to_string(ticket) + " was never issued to client " +
                            std::to_string(id) + " (the last is " + std::to_string(client->next_ticket - 1) + ")");
  }
  ticket_done_.wait(lock, [&] { return client->closed || client->completed >= ticket; });
  if (client->closed && client->completed < ticket) {
    return unavailable("client " + std::to_string(id) + " was closed while waiting for ticket " + std::to_string(ticket));
  }
  auto failed = client->failed_tickets.find(ticket);
  if (failed != client->failed_tickets.end()) return failed->second;
  return Status::Ok();
}

Status EngineImpl::wait_submitted(ClientId id, Ticket ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = clients_.find(id);
  if (it == clients_.end()) return not_found(no_client_text(id));
  std::shared_ptr<ClientState> client = it->second;
  if (ticket >= client->next_ticket) {
    return invalid_argument("wait_submitted: ticket " + std::to_string(ticket) + " was never issued to client " +
                            std::to_string(id) + " (the last is " + std::to_string(client->next_ticket - 1) + ")");
  }
  if (!client->enqueued_signal && client->signal_words != nullptr) {   // the first such wait
    client->enqueued_signal = true;
    enqueue_submitted_signal(*client);
  }
  ticket_done_.wait(lock, [&] {
    return client->closed || client->completed >= ticket || client->submitted >= ticket;
  });
  if (client->closed && client->completed < ticket && client->submitted < ticket) {
    return unavailable("client " + std::to_string(id) + " was closed while waiting for ticket " + std::to_string(ticket));
  }
  if (client->completed < ticket && !client->signal_error.ok()) return client->signal_error;
  return Status::Ok();
}

Result<Ticket> EngineImpl::completed_ticket(ClientId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
  return client->completed;
}

// ---- Channels (Note [Channels]) -------------------------------------------------------------------

Status EngineImpl::reserve_channel_bytes(ClientId id, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
  uint64_t frames = (bytes + kFrameBytes - 1) / kFrameBytes;
  if (client->host_frames_used + client->channel_frames + frames > client->quota_frames[1]) {
    return resource_exhausted("a channel of " + human_bytes(bytes) + " would bring client " + std::to_string(id) +
                              "'s host memory to " +
                              human_bytes((client->host_frames_used + client->channel_frames + frames) * kFrameBytes) +
                              ", over its host quota of " + human_bytes(uint64_t(client->quota_frames[1]) * kFrameBytes));
  }
  // The pool's frames in slabs nobody holds, less what channels already took.
  uint64_t unheld = unheld_host_frames();
  if (channel_frames_ + frames > unheld) {
    return resource_exhausted("a channel of " + human_bytes(bytes) + " does not fit the host pool: " +
                              human_bytes((unheld - std::min(unheld, channel_frames_)) * kFrameBytes) +
                              " of it is not held by clients or channels");
  }
  client->channel_frames += frames;
  channel_frames_ += frames;
  client->stats.channel_bytes += frames * kFrameBytes;
  return Status::Ok();
}

Status EngineImpl::release_channel_bytes(ClientId id, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
  uint64_t frames = (bytes + kFrameBytes - 1) / kFrameBytes;
  frames = std::min<uint64_t>(frames, client->channel_frames);
  client->channel_frames -= frames;
  channel_frames_ -= std::min(channel_frames_, frames);
  client->stats.channel_bytes -= frames * kFrameBytes;
  return Status::Ok();
}

// ---- Stats (Note [Counters]) ----------------------------------------------------------------------

Result<RuntimeStats> EngineImpl::stats(ClientId id, uint32_t first_space, uint32_t max_spaces) {
  std::lock_guard<std::mutex> lock(mutex_);
  RuntimeStats answer;
  answer.backend = backend_->name();
  for (Tier tier : {Tier::kGpu, Tier::kHost}) {
    const TierPoolState& pool = pools_[tier_index(tier)];
    TierStats tier_stats;
    tier_stats.tier = tier;
    tier_stats.frames_total = pool.frames.size();
    if (tier == Tier::kGpu) {
      tier_stats.frames_free = pool.free_frames.size();
      tier_stats.frames_preparing = pool.preparing;
    } else {
      tier_stats.frames_total = 0;
      uint64_t unbacked_slabs = 0;
      for (const Slab& slab : slabs_) {
        if (slab.state == Slab::State::kUnbacked) ++unbacked_slabs;
        if (slab.backed()) tier_stats.frames_total += slab.frames;
        if (slab.state == Slab::State::kFree) tier_stats.frames_free += slab.frames;
        if (slab.state == Slab::State::kPreparing) tier_stats.frames_preparing += slab.frames;
      }
      tier_stats.frames_free -= std::min(tier_stats.frames_free, channel_frames_);
      tier_stats.numa_node = backend_->host_numa_node();
      if (config_.host_share) {   // Note [One host pool for a node]: what the others could give
        tier_stats.frames_on_request =
            std::min(config_.host_share->obtainable(share_member_), unbacked_slabs) * slab_frames_;
      }
    }
    tier_stats.frames_lost = lost_frames_[tier_index(tier)];
    tier_stats.frames_used =
        tier_stats.frames_total - tier_stats.frames_free - tier_stats.frames_preparing - tier_stats.frames_lost;
    answer.tiers.push_back(tier_stats);
  }
  auto add_spaces = [&](const ClientState& client, uint32_t& index) {
    for (const auto& [space_id, space] : client.spaces) {
      if (index >= first_space && answer.spaces.size() < max_spaces) {
        SpaceInfo info = space->info;
        info.client = client.id;
        info.bytes_none = space->counters.bytes[kClassNone];
        info.bytes_gpu = space->counters.bytes[kClassGpu];
        info.bytes_host = space->counters.bytes[kClassHost];
        info.bytes_both = space->counters.bytes[kClassBoth];
        info.bytes_dirty = space->counters.dirty;
        info.bytes_pinned = space->counters.pinned;
        info.bytes_host_to_gpu = space->counters.bytes_host_to_gpu;
        info.bytes_gpu_to_host = space->counters.bytes_gpu_to_host;
        answer.spaces.push_back(std::move(info));
      }
      ++index;
    }
  };
  uint32_t index = 0;
  auto add_client = [&](ClientState& client) {
    answer.clients.push_back(client.stats);
    answer.clients.back().call_deliver_ns = client.deliver_ns.load(std::memory_order_relaxed);
    add_spaces(client, index);
  };
  if (id == 0) {
    for (const auto& [client_id, client] : clients_) add_client(*client);
  } else {
    MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
    add_client(*client);
  }
  answer.first_space = first_space;
  answer.spaces_total = index;
  return answer;
}

// ---- Creation -------------------------------------------------------------------------------------

Result<std::unique_ptr<Engine>> Engine::create(std::unique_ptr<DeviceBackend> backend, const EngineConfig& config) {
  if (!backend) return invalid_argument("Engine::create needs a backend");
  if (config.signal_words_per_client > 4096) {
    return invalid_argument("signal_words_per_client must be at most 4096, not " +
                            std::to_string(config.signal_words_per_client));
  }
  if (backend->host_slab_frames() == 0 || backend->frame_count(Tier::kHost) % backend->host_slab_frames() != 0) {
    return invalid_argument("the backend's host pool is not a whole number of slabs");
  }
  return std::unique_ptr<Engine>(new EngineImpl(std::move(backend), config));
}

}  // namespace membar::runtimed
