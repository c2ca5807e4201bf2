// The engine: policy for every client of one node. See engine.h for the interface.
//
// Note [Pages and frames]
// Rationale: physical memory is made once, in 2 MiB frames (the CUDA VMM granularity; cuMemCreate
// costs ~390 us, so never on the hot path), while trainers want pages sized to their kernels'
// tiles (64 KiB .. 2 MiB). Clients must never see each other's memory, and a client must be able
// to map exactly the frames that hold its pages.
// Approach: each tier (GPU, host) is a pool of frames. A frame is handed to one client at a time,
// on demand, while the client is under its quota for that tier; the first page size that needs it
// decides its slot size (2 MiB / page_bytes slots). The grant is announced through
// ClientEvents::frame_granted with a window frame number private to the client and tier, so
// the client maps it at window_base + window_frame * 2 MiB and finds page p of the frame at
// slot * page_bytes. When the last page leaves a frame (eviction, offload, free, destroy) the
// frame is revoked at the end of that call and goes back to the pool; when a GPU slot is needed
// and the client is at quota, a page is evicted and its slot reused directly, so steady-state
// eviction never remaps anything. A page's state is its GPU slot, its host slot, whether the host
// copy is current (host_valid), whether the GPU copy has contents the host lacks (dirty), its
// GPU pins and host pins. The residency reported to users is derived: GPU when it has a GPU slot,
// host when host_valid. A host slot is kept while the page is dirty on the GPU, so a writeback
// never needs host space it did not already have.
// Copies are asynchronous and grouped into batches (one backend enqueue each); every slot
// remembers the last batch that touched it, and a new copy touching the slot depends on that
// batch if it has not finished, so "a page with an in-flight copy is not reused until the copy
// completes" holds without any waiting on the caller's thread. A frame going back to the pool
// with copies still in flight (client_close in the middle of a transfer) drains first: it joins
// the free list only when its last batch completes; a live client's emptied frame with copies in
// flight stays with the client until they complete, then is revoked.
// Tickets: every call that moves data gets the next ticket of its client; a ticket completes when
// its batches and every earlier ticket's have, which is what lets one 64-bit signal word
// (kSignalCompleted) describe completion to CPU and GPU waiters alike. The schedule's lookahead
// prefetch (advance) is the exception: its copies and evictions take no ticket, so an acquire
// never waits for prefetches of later steps (measured on the H200: with a GPU budget of four
// steps, each step waited for the next steps' copies, 6% of compute). A call that hands out a
// page such work may still be filling depends on that batch through the page's slot instead.
// Limitations: frames are retyped to another page size only when a whole frame can be emptied
// (the one whose pages are needed last); eviction chooses only among the asking client's own
// pages (a client over nobody's quota but facing an empty pool gets RESOURCE_EXHAUSTED rather
// than taking frames from a neighbour); the host tier is the last tier: nothing is evicted from
// it (no disk). In-order ticket completion means a slow earlier ticket delays a later one.
//
// Note [Eviction order]
// Rationale: a chunk-recurrent trainer knows its whole access schedule in advance, and for a
// known reference string the optimal replacement policy is Belady's MIN: evict the page whose
// next use is farthest in the future (or never). Without a schedule the best cheap guess is
// least recently used.
// Approach: set_schedule records, for every page, the ascending list of steps that name it.
// Each client keeps, per page size, an ordered set of its GPU-resident unpinned pages keyed by
// (next use at or after the current step, descending; last use, ascending): the first element is
// the victim. advance(step) moves the current step and re-keys only the pages named by the steps
// it passed (their next use changed), so its cost is the size of those steps, not of the space.
// Without a schedule every next use is "never" and the order is pure LRU; pages the schedule
// never names are evicted before any page it does name. Schedule-driven prefetch (advance's
// lookahead) evicts a page only when its next use is strictly later than that of the page being
// brought in, so prefetching can never displace something needed sooner, and only when MIN
// itself would choose that victim at the step that needs the page: if a page the intervening
// steps still use will be needed even later, MIN would evict that one once those steps ran, so
// the prefetch waits (conservative prefetching, after Cao et al.: same replacements as MIN, made
// earlier). Acquire, which must succeed, takes the first victim whatever its next use.
// Limitations: next use is counted in steps, not in pages within a step, so pages of one step
// tie and fall back to LRU among themselves. Eviction is per client and per page size (see
// Note [Pages and frames] for retyping whole frames). Explicit prefetch() is obeyed like
// acquire (it may evict anything unpinned); only advance()'s lookahead follows MIN's rule.
// A page brought in by a prefetch whose copy is still in flight may be chosen as a victim; its
// slot is then reused only after that copy completes (batch ordering), never corrupted.
//
// Note [Stream-ordered release]
// Rationale: a trainer releases pages its kernels are still reading or writing; waiting on its
// CPU for the stream to drain before every release would stall the pipeline of prefetch,
// compute and offload (the point of the runtime). Approach: the client enqueues
// cuStreamWriteValue64(released word, marker) on its stream and calls release_after(marker),
// which returns at once. The pages' GPU slots remember the marker (Frame::slot_fence). A batch
// that touches such a slot (the writeback of a dirty page, or a copy or zero fill into a slot
// whose page was evicted) takes the marker as its fence and is held, not handed to the backend,
// until the client's word is seen at or past it; an emptied frame with an unmet fence is not
// revoked (the client's kernels may still be using the mapping). The engine's dispatcher watches
// the words of clients with something held (every 20 us while there is), so the daemon learns
// when the trainer's GPU passed the marker without the trainer's CPU taking part. Eviction passes
// over pages whose marker was not seen yet while others can go, and otherwise takes the oldest
// marker (choose_victim): MIN's own choice is the page used last, i.e. the one whose kernel just
// ran, and waiting for it would stall the next step behind the copies.
// Limitations: markers are ordered per client; releases from several streams must write their
// markers in increasing order (one stream, or streams ordered with events), else a release may
// wait for a later marker. The watch is the daemon's CPU reading the word, not a GPU-side wait on
// the copy streams (a stuck client stream would otherwise stall every client's copies).
#include "membar/engine/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <optional>
#include <thread>
#include <unistd.h>

#include "engine_state.h"
#include "membar/common/human_bytes.h"

namespace membar::runtimed {
namespace {


bool is_power_of_two(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }

// Accumulates the batches of one call; see Note [Pages and frames].
struct Builder {
  ClientState* client = nullptr;
  Ticket ticket = 0;
  uint64_t current = kNoBatch;
  std::vector<uint64_t> batches;
};

class EngineImpl final : public Engine {
 public:
  EngineImpl(std::unique_ptr<DeviceBackend> backend, const EngineConfig& config)
      : backend_(std::move(backend)), config_(config) {
    for (Tier tier : {Tier::kGpu, Tier::kHost}) {
      TierPoolState& pool = pools_[tier_index(tier)];
      uint64_t count = backend_->frame_count(tier);
      pool.frames.resize(count);
      for (uint64_t i = count; i > 0; --i) pool.free_frames.push_back(FrameIndex(i - 1));
    }
    dispatcher_ = std::thread([this] { dispatcher_loop(); });
  }

  ~EngineImpl() override {
    std::vector<ClientId> ids;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [id, client] : clients_) ids.push_back(id);
    }
    for (ClientId id : ids) (void)client_close(id);
    backend_->drain();
    {
      std::lock_guard<std::mutex> lock(completion_mutex_);
      stopping_ = true;
    }
    completion_ready_.notify_all();
    dispatcher_.join();
    backend_.reset();
  }

  DeviceBackend& backend() override { return *backend_; }

  // ---- Clients -------------------------------------------------------------------------------

  Result<ClientId> client_open(const ClientConfig& config, ClientEvents events) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto client = std::make_shared<ClientState>();
    client->id = next_client_++;
    client->config = config;
    client->events = std::move(events);
    client->stats.client = client->id;
    client->stats.pid = config.pid;
    client->stats.name = config.name;
    for (Tier tier : {Tier::kGpu, Tier::kHost}) {
      int t = tier_index(tier);
      uint64_t pool_frames = pools_[t].frames.size();
      uint64_t quota_bytes = tier == Tier::kGpu ? config.gpu_quota_bytes : config.host_quota_bytes;
      if (quota_bytes == 0) {
        quota_bytes = tier == Tier::kGpu ? config_.default_gpu_quota_bytes : config_.default_host_quota_bytes;
      }
      uint64_t quota_frames = quota_bytes == 0 ? pool_frames : std::min(pool_frames, quota_bytes / kFrameBytes);
      client->quota_frames[t] = uint32_t(quota_frames);
      for (uint32_t w = 0; w < quota_frames; ++w) client->free_windows[t].insert(client->free_windows[t].end(), w);
    }
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

  Status client_close(ClientId id) override {
    std::shared_ptr<ClientState> client;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = clients_.find(id);
      if (it == clients_.end()) return not_found(no_client_text(id));
      client = it->second;
      client->closed = true;
      // Batches not yet handed to the backend never will be: cancel them. Submitted ones finish
      // on their own; their frames drain before anyone else gets them.
      std::vector<uint64_t> cancelled;
      for (auto& [batch_id, batch] : batches_) {
        if (batch.client == id && !batch.submitted) cancelled.push_back(batch_id);
      }
      for (uint64_t batch_id : cancelled) {
        Batch& batch = batches_.at(batch_id);
        for (auto [tier, frame] : batch.frames) drop_pending_batch(tier, frame, batch_id);
        batches_.erase(batch_id);
      }
      for (Tier tier : {Tier::kGpu, Tier::kHost}) {
        std::vector<FrameIndex> owned(client->frames[tier_index(tier)].begin(),
                                      client->frames[tier_index(tier)].end());
        for (FrameIndex frame : owned) return_frame_to_pool(*client, tier, frame, /*announce=*/false);
      }
      client->spaces.clear();
      client->space_names.clear();
      (void)backend_->destroy_signal_block(client->signal_block);
      client->signal_words = nullptr;
      clients_.erase(it);
    }
    ticket_done_.notify_all();
    // Wait for a delivery in progress on another thread, then close fds nobody will take.
    std::lock_guard<std::mutex> delivery(client->delivery_mutex);
    std::lock_guard<std::mutex> lock(mutex_);
    for (ClientEvent& event : client->events_queue) {
      if (event.fd >= 0) ::close(event.fd);
    }
    client->events_queue.clear();
    return Status::Ok();
  }

  Result<int> client_signal_fd(ClientId id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
    return backend_->export_signal_block(client->signal_block);
  }

  Result<uint32_t> client_window_frames(ClientId id, Tier tier) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
    return client->quota_frames[tier_index(tier)];
  }

  // ---- Spaces --------------------------------------------------------------------------------

  Result<SpaceId> create_space(ClientId id, const std::string& name, uint64_t page_bytes,
                               uint32_t page_count) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
    if (name.empty() || name.size() > 255) {
      return invalid_argument("a space name must have 1 to 255 characters, not " + std::to_string(name.size()));
    }
    if (!is_power_of_two(page_bytes) || page_bytes < kMinPageBytes || page_bytes > kMaxPageBytes) {
      return invalid_argument("space '" + name + "': page size " + std::to_string(page_bytes) +
                              " bytes is not a power of two in [64 KiB, 2 MiB]");
    }
    if (page_count == 0) return invalid_argument("space '" + name + "' must have at least one page");
    // Page tables cost ~64 bytes a page in the daemon: bound what one client can make it hold.
    constexpr uint64_t kMaxPagesPerClient = 1ull << 25;
    uint64_t existing = 0;
    for (const auto& [other_id, other] : client->spaces) existing += other.pages.size();
    if (existing + page_count > kMaxPagesPerClient) {
      return resource_exhausted("space '" + name + "' asks for " + std::to_string(page_count) + " pages; client " +
                                std::to_string(id) + " already has " + std::to_string(existing) +
                                " and may have at most " + std::to_string(kMaxPagesPerClient) + " in all its spaces");
    }
    if (client->space_names.count(name) != 0) {
      return already_exists("client " + std::to_string(id) + " already has a space named '" + name + "'");
    }
    SpaceId space_id = client->next_space++;
    Space& space = client->spaces[space_id];
    space.info = SpaceInfo{space_id, name, page_bytes, page_count};
    space.pages.resize(page_count);
    client->space_names[name] = space_id;
    return space_id;
  }

  Status destroy_space(ClientId id, SpaceId space_id) override {
    std::shared_ptr<ClientState> owner;
    Status status = [&]() -> Status {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(owner, find_client_shared(id));
      MEMBAR_ASSIGN_OR_RETURN(Space * space, find_space(*owner, space_id));
      for (uint32_t p = 0; p < space->pages.size(); ++p) {
        if (space->pages[p].pins != 0 || space->pages[p].host_pins != 0) {
          return failed_precondition("space '" + space->info.name + "' cannot be destroyed: page " +
                                     std::to_string(p) + " is still acquired");
        }
      }
      for (uint32_t p = 0; p < space->pages.size(); ++p) drop_page(*owner, *space, p);
      owner->space_names.erase(space->info.name);
      owner->spaces.erase(space_id);
      // A schedule naming a dead space is meaningless: forget it.
      if (!owner->schedule.empty()) clear_schedule(*owner);
      trim(*owner);
      return Status::Ok();
    }();
    if (owner) deliver_events(owner);
    return status;
  }

  Result<SpaceInfo> space_info(ClientId id, SpaceId space_id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
    MEMBAR_ASSIGN_OR_RETURN(Space * space, find_space(*client, space_id));
    return space->info;
  }

  // ---- Acquire / release ---------------------------------------------------------------------

  Result<AcquireResult> acquire(ClientId id, PageRange range, uint32_t flags) override {
    std::shared_ptr<ClientState> owner;
    Result<AcquireResult> result = [&]() -> Result<AcquireResult> {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(owner, find_client_shared(id));
      ClientState& client = *owner;
      MEMBAR_ASSIGN_OR_RETURN(Space * space, check_range(client, range));
      if (flags & ~uint32_t(kAcquireWrite | kAcquireZeroNew)) {
        return invalid_argument("acquire: unknown flag bits " + std::to_string(flags));
      }
      for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
        if (space->pages[p].host_pins != 0) {
          return failed_precondition(page_text(*space, p) +
                                     " is acquired for host access; release_host it before acquiring it on the GPU");
        }
      }
      Builder builder = start_builder(client);
      // Pin what is already resident first, so that no page of this range evicts another.
      std::vector<uint32_t> pinned_now;
      std::vector<uint32_t> needs_slot;
      for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
        Page& page = space->pages[p];
        if (page.gpu.valid()) {
          // A copy into the slot may still run (an untracked lookahead prefetch): the ticket
          // covers it.
          depend_on_slot(builder, Tier::kGpu, page.gpu);
          eviction_erase(client, *space, page);
          ++page.pins;
          pinned_now.push_back(p);
          if (page.prefetched) ++client.stats.prefetch_hits;
          page.prefetched = false;
        } else {
          needs_slot.push_back(p);
        }
      }
      // Phase 1: slots (evicting as needed; writebacks go into the builder first).
      std::vector<uint32_t> slotted;
      for (uint32_t p : needs_slot) {
        Result<SlotRef> slot = get_gpu_slot(client, builder, space->info.page_bytes, /*limit=*/nullptr);
        if (!slot.ok()) {
          for (uint32_t q : slotted) {
            Page& page = space->pages[q];
            clear_slot(client, Tier::kGpu, page.gpu);
            page.gpu = {};
          }
          for (uint32_t q : pinned_now) unpin(client, *space, q);
          (void)finish_builder(builder);
          trim(client);
          return slot.status();
        }
        place(client, Tier::kGpu, slot.value(), space->info.id, p);
        space->pages[p].gpu = slot.value();
        slotted.push_back(p);
      }
      // Phase 2: contents. A resident page that never had contents (acquired before without
      // zero-fill and never written) is zero-filled now if asked.
      if (flags & kAcquireZeroNew) {
        for (uint32_t p : pinned_now) {
          Page& page = space->pages[p];
          if (!page.dirty && !page.host_valid && !page.write_intent) {
            add_zero(builder, *space, Tier::kGpu, page.gpu);
            page.dirty = true;
          }
        }
      }
      for (uint32_t p : slotted) {
        Page& page = space->pages[p];
        if (page.host_valid) {
          add_copy(builder, *space, Tier::kHost, page.host, Tier::kGpu, page.gpu);
          ++client.stats.prefetch_misses;
          page.dirty = false;
        } else if (flags & kAcquireZeroNew) {
          add_zero(builder, *space, Tier::kGpu, page.gpu);
          page.dirty = true;  // zeros are contents the host does not have
        }
        ++page.pins;
      }
      AcquireResult answer;
      for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
        Page& page = space->pages[p];
        page.key.last_use = ++client.clock;
        if (flags & kAcquireWrite) page.write_intent = true;
        answer.locations.push_back(location_of(client, Tier::kGpu, page.gpu, space->info.page_bytes));
      }
      answer.ticket = finish_builder(builder);
      trim(client);
      return answer;
    }();
    if (owner) deliver_events(owner);
    return result;
  }

  Status release(ClientId id, PageRange range, bool dirty) override {
    return release_pages(id, range, dirty, std::nullopt);
  }

  Status release_after(ClientId id, PageRange range, bool dirty, uint64_t marker) override {
    return release_pages(id, range, dirty, marker);
  }

  // Unpins the pages; with a marker (stream_release) their GPU slots wait for it first (Note
  // [Stream-ordered release]).
  Status release_pages(ClientId id, PageRange range, bool dirty, std::optional<uint64_t> marker) {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
    MEMBAR_ASSIGN_OR_RETURN(Space * space, check_range(*client, range));
    if (marker == 0u) return invalid_argument("release_after: the release marker must be at least 1");
    for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
      if (space->pages[p].pins == 0) {
        return failed_precondition("release: " + page_text(*space, p) + " is not acquired");
      }
    }
    bool fenced = marker.has_value() && !fence_met(*client, *marker);
    for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
      Page& page = space->pages[p];
      if (fenced && page.gpu.valid()) {
        uint64_t& fence = frame_of(Tier::kGpu, page.gpu.frame).slot_fence[page.gpu.slot];
        fence = std::max(fence, *marker);
      }
      if (dirty || page.write_intent) {
        page.dirty = true;
        page.host_valid = false;
      }
      if (page.pins == 1) page.write_intent = false;
      unpin(*client, *space, p);
    }
    return Status::Ok();
  }

  // ---- Hints ---------------------------------------------------------------------------------

  Result<Ticket> prefetch(ClientId id, PageRange range) override {
    std::shared_ptr<ClientState> owner;
    Result<Ticket> result = [&]() -> Result<Ticket> {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(owner, find_client_shared(id));
      ClientState& client = *owner;
      MEMBAR_ASSIGN_OR_RETURN(Space * space, check_range(client, range));
      Builder builder = start_builder(client);
      // Pages with no contents are left alone: acquire makes them. Pages already resident are
      // pinned for the duration of the call so the range does not evict itself.
      std::vector<uint32_t> held;
      std::vector<uint32_t> wanted;
      for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
        Page& page = space->pages[p];
        if (page.gpu.valid()) {
          eviction_erase(client, *space, page);
          ++page.pins;
          held.push_back(p);
        } else if (page.host_valid && page.host_pins == 0) {
          wanted.push_back(p);
        }
      }
      Status status = Status::Ok();
      std::vector<uint32_t> slotted;
      for (uint32_t p : wanted) {
        Result<SlotRef> slot = get_gpu_slot(client, builder, space->info.page_bytes, nullptr);
        if (!slot.ok()) {
          status = slot.status();
          break;
        }
        place(client, Tier::kGpu, slot.value(), space->info.id, p);
        space->pages[p].gpu = slot.value();
        slotted.push_back(p);
      }
      for (uint32_t p : slotted) {
        Page& page = space->pages[p];
        add_copy(builder, *space, Tier::kHost, page.host, Tier::kGpu, page.gpu);
        page.dirty = false;
        page.prefetched = true;
        page.key.last_use = ++client.clock;
        eviction_insert(client, *space, p);
      }
      for (uint32_t p : held) unpin(client, *space, p);
      Ticket ticket = finish_builder(builder);
      trim(client);
      if (!status.ok()) return status;
      return ticket;
    }();
    if (owner) deliver_events(owner);
    return result;
  }

  Result<Ticket> offload(ClientId id, PageRange range) override {
    std::shared_ptr<ClientState> owner;
    Result<Ticket> result = [&]() -> Result<Ticket> {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(owner, find_client_shared(id));
      ClientState& client = *owner;
      MEMBAR_ASSIGN_OR_RETURN(Space * space, check_range(client, range));
      for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
        if (space->pages[p].pins != 0) {
          return failed_precondition("offload: " + page_text(*space, p) + " is acquired; release it first");
        }
      }
      Builder builder = start_builder(client);
      Status status = Status::Ok();
      for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
        if (!space->pages[p].gpu.valid()) continue;
        status = evict_gpu_page(client, builder, *space, p, /*pressure=*/false);
        if (!status.ok()) break;
      }
      Ticket ticket = finish_builder(builder);
      trim(client);
      if (!status.ok()) return status;
      return ticket;
    }();
    if (owner) deliver_events(owner);
    return result;
  }

  Status free_pages(ClientId id, PageRange range) override {
    std::shared_ptr<ClientState> owner;
    Status status = [&]() -> Status {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(owner, find_client_shared(id));
      MEMBAR_ASSIGN_OR_RETURN(Space * space, check_range(*owner, range));
      for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
        const Page& page = space->pages[p];
        if (page.pins != 0 || page.host_pins != 0) {
          return failed_precondition("free_pages: " + page_text(*space, p) + " is acquired; release it first");
        }
        if (!page.gpu.valid() && !page.host.valid()) {
          return failed_precondition("free_pages: " + page_text(*space, p) +
                                     " holds nothing (never written, or already freed: double free?)");
        }
      }
      for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) drop_page(*owner, *space, p);
      trim(*owner);
      return Status::Ok();
    }();
    if (owner) deliver_events(owner);
    return status;
  }

  // ---- Host access ---------------------------------------------------------------------------

  Result<std::vector<PageLocation>> acquire_host(ClientId id, PageRange range) override {
    MEMBAR_ASSIGN_OR_RETURN(AcquireResult acquired, acquire_host_async(id, range));
    MEMBAR_RETURN_IF_ERROR(wait(id, acquired.ticket));
    return acquired.locations;
  }

  Result<AcquireResult> acquire_host_async(ClientId id, PageRange range) override {
    std::shared_ptr<ClientState> owner;
    Result<AcquireResult> result = [&]() -> Result<AcquireResult> {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(owner, find_client_shared(id));
      ClientState& client = *owner;
      MEMBAR_ASSIGN_OR_RETURN(Space * space, check_range(client, range));
      for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
        if (space->pages[p].pins != 0) {
          return failed_precondition(page_text(*space, p) +
                                     " is acquired on the GPU; release it before acquiring it for host access");
        }
      }
      Builder builder = start_builder(client);
      // Phase 1: host slots for every page that lacks one.
      std::vector<uint32_t> slotted;
      for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
        Page& page = space->pages[p];
        if (page.host.valid()) {
          // A writeback into the slot may still run (an untracked lookahead's eviction).
          depend_on_slot(builder, Tier::kHost, page.host);
          continue;
        }
        Result<SlotRef> slot = get_host_slot(client, space->info.page_bytes);
        if (!slot.ok()) {
          for (uint32_t q : slotted) {
            clear_slot(client, Tier::kHost, space->pages[q].host);
            space->pages[q].host = {};
          }
          (void)finish_builder(builder);
          trim(client);
          return slot.status();
        }
        place(client, Tier::kHost, slot.value(), space->info.id, p);
        page.host = slot.value();
        slotted.push_back(p);
      }
      // Phase 2: contents. Dirty GPU copies are written back; pages with no contents read as zeros.
      AcquireResult answer;
      for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
        Page& page = space->pages[p];
        if (!page.host_valid) {
          if (page.gpu.valid() && page.dirty) {
            add_copy(builder, *space, Tier::kGpu, page.gpu, Tier::kHost, page.host);
            page.dirty = false;
          } else {
            // No contents anywhere: the host copy reads as zeros, and a GPU slot holding
            // leftovers is dropped so the two tiers never disagree about a clean page.
            add_zero(builder, *space, Tier::kHost, page.host);
            if (page.gpu.valid()) {
              eviction_erase(client, *space, page);
              clear_slot(client, Tier::kGpu, page.gpu);
              page.gpu = {};
              page.prefetched = false;
            }
          }
          page.host_valid = true;
        }
        ++page.host_pins;
        answer.locations.push_back(location_of(client, Tier::kHost, page.host, space->info.page_bytes));
      }
      answer.ticket = finish_builder(builder);
      trim(client);
      return answer;
    }();
    if (owner) deliver_events(owner);
    return result;
  }

  Status release_host(ClientId id, PageRange range, bool dirty) override {
    std::shared_ptr<ClientState> owner;
    Status status = [&]() -> Status {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(owner, find_client_shared(id));
      MEMBAR_ASSIGN_OR_RETURN(Space * space, check_range(*owner, range));
      for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
        if (space->pages[p].host_pins == 0) {
          return failed_precondition("release_host: " + page_text(*space, p) + " is not acquired for host access");
        }
      }
      for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
        Page& page = space->pages[p];
        --page.host_pins;
        // The host copy is now the newest: a GPU copy (never pinned meanwhile) is stale.
        if (dirty && page.gpu.valid()) {
          eviction_erase(*owner, *space, page);
          clear_slot(*owner, Tier::kGpu, page.gpu);
          page.gpu = {};
          page.prefetched = false;
          page.dirty = false;
        }
      }
      trim(*owner);
      return Status::Ok();
    }();
    if (owner) deliver_events(owner);
    return status;
  }

  // ---- Schedule ------------------------------------------------------------------------------

  Status set_schedule(ClientId id, std::vector<ScheduleStep> steps) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
    if (steps.size() > (1u << 24)) {
      return invalid_argument("a schedule may have at most 16M steps, not " + std::to_string(steps.size()));
    }
    // The engine keeps every (page, step) use: bound them as it bounds page tables.
    constexpr uint64_t kMaxPageUses = 1ull << 26;
    uint64_t uses = 0;
    for (const ScheduleStep& step : steps) {
      for (const PageRange& range : step.ranges) uses += range.page_count;
    }
    if (uses > kMaxPageUses) {
      return resource_exhausted("a schedule may name at most " + std::to_string(kMaxPageUses) +
                                " pages in all its steps; this one names " + std::to_string(uses));
    }
    for (size_t s = 0; s < steps.size(); ++s) {
      for (const PageRange& range : steps[s].ranges) {
        Result<Space*> space = check_range(*client, range);
        if (!space.ok()) {
          return Status(space.status().code(),
                        "schedule step " + std::to_string(s) + ": " + space.status().message());
        }
      }
    }
    clear_schedule(*client);
    for (size_t s = 0; s < steps.size(); ++s) {
      for (const PageRange& range : steps[s].ranges) {
        Space& space = client->spaces.at(range.space);
        if (space.uses.empty()) space.uses.resize(space.pages.size());
        for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
          std::vector<uint32_t>& uses = space.uses[p];
          if (uses.empty() || uses.back() != uint32_t(s)) uses.push_back(uint32_t(s));
        }
      }
    }
    client->schedule = std::move(steps);
    client->current_step = 0;
    rekey_all(*client);
    return Status::Ok();
  }

  Status advance(ClientId id, uint32_t step) override {
    std::shared_ptr<ClientState> owner;
    Status status = [&]() -> Status {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(owner, find_client_shared(id));
      ClientState& client = *owner;
      if (step >= client.schedule.size()) {
        return out_of_range("advance: step " + std::to_string(step) + " is outside the schedule of " +
                            std::to_string(client.schedule.size()) + " steps");
      }
      uint32_t previous = client.current_step;
      client.current_step = step;
      if (step < previous) {
        rekey_all(client);
      } else {
        for (uint32_t s = previous; s < step; ++s) {
          for (const PageRange& range : client.schedule[s].ranges) {
            Space& space = client.spaces.at(range.space);
            for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
              if (space.pages[p].in_eviction_set) {
                eviction_erase(client, space, space.pages[p]);
                eviction_insert(client, space, p);
              }
            }
          }
        }
      }
      schedule_prefetch(client);
      trim(client);
      return Status::Ok();
    }();
    if (owner) deliver_events(owner);
    return status;
  }

  // ---- Queries -------------------------------------------------------------------------------

  Result<std::vector<PageLocation>> locations(ClientId id, PageRange range) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
    MEMBAR_ASSIGN_OR_RETURN(Space * space, check_range(*client, range));
    std::vector<PageLocation> answer;
    answer.reserve(range.page_count);
    for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
      answer.push_back(location_of(*client, Tier::kGpu, space->pages[p].gpu, space->info.page_bytes));
    }
    return answer;
  }

  Status add_stall_ns(ClientId id, uint64_t ns) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
    client->stats.stall_ns += ns;
    return Status::Ok();
  }

  Status wait(ClientId id, Ticket ticket) override {
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
      return unavailable("client " + std::to_string(id) + " was closed while waiting for ticket " +
                         std::to_string(ticket));
    }
    auto failed = client->failed_tickets.find(ticket);
    if (failed != client->failed_tickets.end()) return failed->second;
    return Status::Ok();
  }

  Result<Ticket> completed_ticket(ClientId id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
    return client->completed;
  }

  Result<RuntimeStats> stats(ClientId id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    RuntimeStats answer;
    answer.backend = backend_->name();
    for (Tier tier : {Tier::kGpu, Tier::kHost}) {
      const TierPoolState& pool = pools_[tier_index(tier)];
      TierStats tier_stats;
      tier_stats.tier = tier;
      tier_stats.frames_total = pool.frames.size();
      tier_stats.frames_free = pool.free_frames.size();
      tier_stats.frames_used = tier_stats.frames_total - tier_stats.frames_free;
      answer.tiers.push_back(tier_stats);
    }
    auto add_client = [&answer](const ClientState& client) {
      ClientStats stats = client.stats;
      stats.pages_gpu = stats.pages_host = stats.pages_both = stats.pages_none = 0;
      for (const auto& [space_id, space] : client.spaces) {
        SpaceInfo info = space.info;
        info.client = client.id;
        for (const Page& page : space.pages) {
          switch (page.residency()) {
            case kResidentGpu: ++info.pages_gpu; break;
            case kResidentHost: ++info.pages_host; break;
            case kResidentBoth: ++info.pages_both; break;
            default: ++info.pages_none; break;
          }
          info.pages_dirty += page.dirty ? 1 : 0;
          info.pages_pinned += (page.pins != 0 || page.host_pins != 0) ? 1 : 0;
        }
        stats.pages_gpu += info.pages_gpu;
        stats.pages_host += info.pages_host;
        stats.pages_both += info.pages_both;
        stats.pages_none += info.pages_none;
        answer.spaces.push_back(std::move(info));
      }
      answer.clients.push_back(std::move(stats));
    };
    if (id == 0) {
      for (const auto& [client_id, client] : clients_) add_client(*client);
    } else {
      MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
      add_client(*client);
    }
    return answer;
  }

 private:
  // ---- Lookups and checks (engine mutex held) ---------------------------------------------------

  static std::string no_client_text(ClientId id) {
    return "client " + std::to_string(id) + " is not open (never opened, or closed)";
  }

  Result<ClientState*> find_client(ClientId id) {
    auto it = clients_.find(id);
    if (it == clients_.end()) return not_found(no_client_text(id));
    return it->second.get();
  }

  Result<std::shared_ptr<ClientState>> find_client_shared(ClientId id) {
    auto it = clients_.find(id);
    if (it == clients_.end()) return not_found(no_client_text(id));
    return it->second;
  }

  Result<Space*> find_space(ClientState& client, SpaceId space_id) {
    auto it = client.spaces.find(space_id);
    if (it == client.spaces.end()) {
      return not_found("client " + std::to_string(client.id) + " has no space " + std::to_string(space_id));
    }
    return &it->second;
  }

  Result<Space*> check_range(ClientState& client, const PageRange& range) {
    MEMBAR_ASSIGN_OR_RETURN(Space * space, find_space(client, range.space));
    if (range.page_count == 0) {
      return invalid_argument("an empty page range of space '" + space->info.name + "' (page_count is 0)");
    }
    uint64_t end = uint64_t(range.first_page) + range.page_count;
    if (end > space->pages.size()) {
      return out_of_range("pages [" + std::to_string(range.first_page) + ", " + std::to_string(end) +
                          ") are outside space '" + space->info.name + "' of " +
                          std::to_string(space->pages.size()) + " pages");
    }
    return space;
  }

  static std::string page_text(const Space& space, uint32_t page) {
    return "page " + std::to_string(page) + " of space '" + space.info.name + "'";
  }

  PageLocation location_of(const ClientState& client, Tier tier, SlotRef slot, uint64_t page_bytes) const {
    (void)page_bytes;
    if (!slot.valid()) return PageLocation{};
    const Frame& frame = pools_[tier_index(tier)].frames[slot.frame];
    return PageLocation{frame.window_frame, slot.slot};
  }

  // ---- Frames and slots --------------------------------------------------------------------------

  Frame& frame_of(Tier tier, FrameIndex index) { return pools_[tier_index(tier)].frames[index]; }

  // Takes a free frame of the pool for the client, sliced for page_bytes, and announces it.
  Status grant_frame(ClientState& client, Tier tier, uint64_t page_bytes) {
    int t = tier_index(tier);
    TierPoolState& pool = pools_[t];
    FrameIndex index = pool.free_frames.back();
    if (client.free_windows[t].empty()) {
      return internal_error("client " + std::to_string(client.id) + " has no free window frame in the " +
                            tier_name(tier) + " tier although it is under quota");
    }
    MEMBAR_ASSIGN_OR_RETURN(int fd, backend_->export_frame(tier, index));
    pool.free_frames.pop_back();
    Frame& frame = pool.frames[index];
    frame.owner = client.id;
    frame.window_frame = *client.free_windows[t].begin();
    client.free_windows[t].erase(client.free_windows[t].begin());
    set_frame_page_bytes(frame, page_bytes);
    client.frames[t].insert(index);
    client.partial[t][page_bytes].insert(index);
    stat_increase(tier == Tier::kGpu ? client.stats.gpu_frames : client.stats.host_frames, 1);
    client.events_queue.push_back({ClientEvent::Kind::kGranted, frame.window_frame, tier, fd, 0});
    return Status::Ok();
  }

  static void set_frame_page_bytes(Frame& frame, uint64_t page_bytes) {
    frame.page_bytes = page_bytes;
    frame.used_slots = 0;
    frame.slots.assign(kFrameBytes / page_bytes, SlotOwner{});
    frame.slot_batch.assign(kFrameBytes / page_bytes, kNoBatch);
    frame.slot_fence.assign(kFrameBytes / page_bytes, 0);
  }

  // Takes the frame from the client (its pages must be gone) and returns it to the pool, or to
  // draining when copies still touch it.
  void return_frame_to_pool(ClientState& client, Tier tier, FrameIndex index, bool announce) {
    int t = tier_index(tier);
    Frame& frame = frame_of(tier, index);
    client.frames[t].erase(index);
    client.partial[t][frame.page_bytes].erase(index);
    client.free_windows[t].insert(frame.window_frame);
    if (announce) client.events_queue.push_back({ClientEvent::Kind::kRevoked, frame.window_frame, tier, -1, 0});
    stat_decrease(tier == Tier::kGpu ? client.stats.gpu_frames : client.stats.host_frames, 1);
    frame.owner = 0;
    frame.window_frame = kNoFrame;
    frame.used_slots = 0;
    frame.slots.clear();
    frame.slot_batch.clear();
    frame.slot_fence.clear();
    if (frame.pending_batches.empty()) pools_[t].free_frames.push_back(index);
  }

  void drop_pending_batch(Tier tier, FrameIndex index, uint64_t batch_id) {
    Frame& frame = frame_of(tier, index);
    auto it = std::find(frame.pending_batches.begin(), frame.pending_batches.end(), batch_id);
    if (it == frame.pending_batches.end()) return;
    frame.pending_batches.erase(it);
    if (!frame.pending_batches.empty()) return;
    if (frame.owner == 0) {
      pools_[tier_index(tier)].free_frames.push_back(index);
    } else if (frame.used_slots == 0) {
      auto owner = clients_.find(frame.owner);
      if (owner != clients_.end()) owner->second->maybe_empty[tier_index(tier)].push_back(index);
    }
  }

  // Releases the client's frames that no longer hold a page (end of every call that may empty one).
  void trim(ClientState& client) {
    for (Tier tier : {Tier::kGpu, Tier::kHost}) {
      int t = tier_index(tier);
      std::vector<FrameIndex> candidates;
      candidates.swap(client.maybe_empty[t]);
      std::sort(candidates.begin(), candidates.end());
      candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
      for (FrameIndex index : candidates) {
        Frame& frame = frame_of(tier, index);
        // A frame still touched by copies stays with the client (which may reuse its slots at
        // once); the last copy's completion trims it again.
        if (frame.owner == client.id && frame.used_slots == 0 && frame.pending_batches.empty()) {
          if (tier == Tier::kGpu && !frame_fences_met(client, frame)) {
            // The client's kernels may still use the mapping: keep it until the fence is seen.
            client.maybe_empty[t].push_back(index);
            client.awaiting_fence = true;
            request_fence_watch();
            continue;
          }
          return_frame_to_pool(client, tier, index, true);
        }
      }
    }
  }

  void place(ClientState& client, Tier tier, SlotRef slot, SpaceId space, uint32_t page) {
    int t = tier_index(tier);
    Frame& frame = frame_of(tier, slot.frame);
    frame.slots[slot.slot] = SlotOwner{space, page};
    ++frame.used_slots;
    if (frame.used_slots == frame.slots.size()) client.partial[t][frame.page_bytes].erase(slot.frame);
  }

  void clear_slot(ClientState& client, Tier tier, SlotRef slot) {
    int t = tier_index(tier);
    Frame& frame = frame_of(tier, slot.frame);
    frame.slots[slot.slot] = SlotOwner{};
    --frame.used_slots;
    client.partial[t][frame.page_bytes].insert(slot.frame);
    if (frame.used_slots == 0) client.maybe_empty[t].push_back(slot.frame);
  }

  static uint32_t first_free_slot(const Frame& frame) {
    for (uint32_t s = 0; s < frame.slots.size(); ++s) {
      if (frame.slots[s].space == 0) return s;
    }
    return uint32_t(frame.slots.size());
  }

  uint64_t draining_frames(Tier tier) const {
    uint64_t count = 0;
    for (const Frame& frame : pools_[tier_index(tier)].frames) {
      if (frame.owner == 0 && !frame.pending_batches.empty()) ++count;
    }
    return count;
  }

  Status exhausted(const ClientState& client, Tier tier, uint64_t page_bytes, const char* why) {
    int t = tier_index(tier);
    const TierPoolState& pool = pools_[t];
    std::string text = "client " + std::to_string(client.id) +
                       (client.config.name.empty() ? "" : " ('" + client.config.name + "')") + " needs a " +
                       tier_name(tier) + " slot for a " + human_bytes(page_bytes) + " page but holds " +
                       std::to_string(client.frames[t].size()) + " of its " +
                       std::to_string(client.quota_frames[t]) + "-frame " + tier_name(tier) + " quota (" +
                       human_bytes(uint64_t(client.quota_frames[t]) * kFrameBytes) + ")" + why +
                       "; the pool has " + std::to_string(pool.free_frames.size()) + " of " +
                       std::to_string(pool.frames.size()) + " frames free";
    if (pool.free_frames.empty() && client.frames[t].size() < client.quota_frames[t] && draining_frames(tier) > 0) {
      return unavailable(text + " and some frames are still finishing copies of a closed client; retry");
    }
    return resource_exhausted(text);
  }

  Result<SlotRef> get_host_slot(ClientState& client, uint64_t page_bytes) {
    constexpr int t = 1;
    for (;;) {
      auto& partial = client.partial[t][page_bytes];
      if (!partial.empty()) {
        FrameIndex index = *partial.begin();
        return SlotRef{index, first_free_slot(frame_of(Tier::kHost, index))};
      }
      if (client.frames[t].size() < client.quota_frames[t] && !pools_[t].free_frames.empty()) {
        MEMBAR_RETURN_IF_ERROR(grant_frame(client, Tier::kHost, page_bytes));
        continue;
      }
      return exhausted(client, Tier::kHost, page_bytes, "");
    }
  }

  // A free GPU slot for a page of page_bytes: a free slot of an owned frame, a new frame under
  // quota, or an evicted page's slot (Note [Eviction order]). With `limit`, only pages whose next
  // use is strictly later than *limit may be evicted, and whole frames are never retyped.
  // For schedule-driven prefetch: the page is needed at step `needed_at`; a victim must be used
  // later than that, and no later than any page of the steps before it would be (`floor`).
  struct PrefetchLimit {
    uint64_t needed_at;
    uint64_t floor;
  };

  // The victim among the client's evictable pages of one size: MIN's order (Note [Eviction
  // order]), except that a page whose release marker was not yet seen (its kernels may still be
  // running, Note [Stream-ordered release]) is passed over for the next one in order that is free
  // to go; when every candidate waits for a marker, the one with the oldest marker goes (it is the
  // first the trainer's stream will pass). Taking MIN's first choice there would make every copy
  // into its slot, and every later ticket, wait for the kernel that just ran. `limit` (prefetch)
  // stops the scan at the first page needed too soon. NOT_FOUND when no candidate qualifies.
  Result<EvictionKey> choose_victim(ClientState& client, const std::set<EvictionKey, EvictionOrder>& candidates,
                                    const PrefetchLimit* limit) {
    constexpr int kScan = 256;  // bounds the cost of a call when many pages wait for markers
    const EvictionKey* oldest = nullptr;
    uint64_t oldest_marker = UINT64_MAX;
    int scanned = 0;
    for (const EvictionKey& key : candidates) {
      if (limit != nullptr && (key.next_use <= limit->needed_at || key.next_use < limit->floor)) break;
      if (++scanned > kScan) break;
      const Page& page = client.spaces.at(key.space).pages[key.page];
      uint64_t& fence = frame_of(Tier::kGpu, page.gpu.frame).slot_fence[page.gpu.slot];
      if (fence != 0 && fence_met(client, fence)) fence = 0;
      if (fence == 0) return key;
      if (fence < oldest_marker) {
        oldest_marker = fence;
        oldest = &key;
      }
    }
    if (oldest == nullptr) return not_found("no page may be evicted");
    return *oldest;
  }

  Result<SlotRef> get_gpu_slot(ClientState& client, Builder& builder, uint64_t page_bytes, const PrefetchLimit* limit) {
    constexpr int t = 0;
    for (;;) {
      auto& partial = client.partial[t][page_bytes];
      if (!partial.empty()) {
        FrameIndex index = *partial.begin();
        return SlotRef{index, first_free_slot(frame_of(Tier::kGpu, index))};
      }
      if (client.frames[t].size() < client.quota_frames[t] && !pools_[t].free_frames.empty()) {
        MEMBAR_RETURN_IF_ERROR(grant_frame(client, Tier::kGpu, page_bytes));
        continue;
      }
      auto set = client.eviction_sets.find(page_bytes);
      if (set != client.eviction_sets.end() && !set->second.empty()) {
        Result<EvictionKey> chosen = choose_victim(client, set->second, limit);
        if (!chosen.ok()) return exhausted(client, Tier::kGpu, page_bytes, " and every resident page is needed sooner");
        EvictionKey victim = chosen.value();
        Space& space = client.spaces.at(victim.space);
        MEMBAR_RETURN_IF_ERROR(evict_gpu_page(client, builder, space, victim.page, /*pressure=*/true));
        continue;
      }
      if (limit == nullptr) {
        MEMBAR_ASSIGN_OR_RETURN(bool retyped, retype_frame(client, builder, page_bytes));
        if (retyped) continue;
      }
      return exhausted(client, Tier::kGpu, page_bytes, " with every resident page acquired");
    }
  }

  // Empties the owned GPU frame of another page size whose pages are needed last and slices it
  // for page_bytes. False when no frame qualifies (every one holds an acquired page).
  Result<bool> retype_frame(ClientState& client, Builder& builder, uint64_t page_bytes) {
    FrameIndex best = kNoFrame;
    uint64_t best_next = 0;
    uint64_t best_last = UINT64_MAX;
    for (FrameIndex index : client.frames[0]) {
      const Frame& frame = frame_of(Tier::kGpu, index);
      if (frame.page_bytes == page_bytes) continue;
      bool usable = true;
      uint64_t soonest = kNeverUsed;
      uint64_t latest = 0;
      for (const SlotOwner& owner : frame.slots) {
        if (owner.space == 0) continue;
        const Page& page = client.spaces.at(owner.space).pages[owner.page];
        if (!page.in_eviction_set) {
          usable = false;
          break;
        }
        soonest = std::min(soonest, page.key.next_use);
        latest = std::max(latest, page.key.last_use);
      }
      if (!usable) continue;
      if (best == kNoFrame || soonest > best_next || (soonest == best_next && latest < best_last)) {
        best = index;
        best_next = soonest;
        best_last = latest;
      }
    }
    if (best == kNoFrame) return false;
    Frame& frame = frame_of(Tier::kGpu, best);
    for (uint32_t s = 0; s < frame.slots.size(); ++s) {
      SlotOwner owner = frame.slots[s];
      if (owner.space == 0) continue;
      MEMBAR_RETURN_IF_ERROR(
          evict_gpu_page(client, builder, client.spaces.at(owner.space), owner.page, /*pressure=*/true));
    }
    // The frame is empty but copies may still read it: whatever lands in the new slots must
    // wait for all of them. A fresh batch depending on every pending batch of the frame, recorded
    // as the last user of every new slot, says exactly that.
    std::vector<uint64_t> pending = frame.pending_batches;
    client.partial[0][frame.page_bytes].erase(best);
    set_frame_page_bytes(frame, page_bytes);
    client.partial[0][page_bytes].insert(best);
    if (!pending.empty()) {
      seal(builder);
      open_batch(builder);
      for (uint64_t dependency : pending) depend(builder.current, dependency);
      attach_frame(builder.current, Tier::kGpu, best);
      std::fill(frame.slot_batch.begin(), frame.slot_batch.end(), builder.current);
    }
    return true;
  }

  // Moves a GPU page out: written back first when dirty, then its slot freed.
  Status evict_gpu_page(ClientState& client, Builder& builder, Space& space, uint32_t p, bool pressure) {
    Page& page = space.pages[p];
    if (page.dirty) {
      if (!page.host.valid()) {
        MEMBAR_ASSIGN_OR_RETURN(SlotRef host, get_host_slot(client, space.info.page_bytes));
        place(client, Tier::kHost, host, space.info.id, p);
        page.host = host;
      }
      add_copy(builder, space, Tier::kGpu, page.gpu, Tier::kHost, page.host);
      page.host_valid = true;
      page.dirty = false;
    }
    eviction_erase(client, space, page);
    clear_slot(client, Tier::kGpu, page.gpu);
    page.gpu = {};
    page.prefetched = false;
    if (pressure) ++client.stats.evictions;
    return Status::Ok();
  }

  // Forgets a page's contents in both tiers.
  void drop_page(ClientState& client, Space& space, uint32_t p) {
    Page& page = space.pages[p];
    eviction_erase(client, space, page);
    if (page.gpu.valid()) clear_slot(client, Tier::kGpu, page.gpu);
    if (page.host.valid()) clear_slot(client, Tier::kHost, page.host);
    EvictionKey key = page.key;
    page = Page{};
    page.key.last_use = key.last_use;
  }

  void unpin(ClientState& client, Space& space, uint32_t p) {
    Page& page = space.pages[p];
    --page.pins;
    if (page.pins == 0) {
      page.key.last_use = ++client.clock;
      eviction_insert(client, space, p);
    }
  }

  // ---- Eviction index (Note [Eviction order]) ---------------------------------------------------

  uint64_t next_use(const ClientState& client, const Space& space, uint32_t p) const {
    return next_use_from(space, p, client.current_step);
  }

  // The first step >= `step` that names page p.
  static uint64_t next_use_from(const Space& space, uint32_t p, uint64_t step) {
    if (space.uses.empty()) return kNeverUsed;
    const std::vector<uint32_t>& uses = space.uses[p];
    auto it = std::lower_bound(uses.begin(), uses.end(), step);
    return it == uses.end() ? kNeverUsed : *it;
  }

  void eviction_insert(ClientState& client, Space& space, uint32_t p) {
    Page& page = space.pages[p];
    if (page.in_eviction_set || !page.gpu.valid() || page.pins != 0) return;
    page.key.next_use = next_use(client, space, p);
    page.key.space = space.info.id;
    page.key.page = p;
    client.eviction_sets[space.info.page_bytes].insert(page.key);
    page.in_eviction_set = true;
  }

  void eviction_erase(ClientState& client, Space& space, Page& page) {
    if (!page.in_eviction_set) return;
    client.eviction_sets[space.info.page_bytes].erase(page.key);
    page.in_eviction_set = false;
  }

  void rekey_all(ClientState& client) {
    for (auto& [space_id, space] : client.spaces) {
      for (uint32_t p = 0; p < space.pages.size(); ++p) {
        if (space.pages[p].in_eviction_set) {
          eviction_erase(client, space, space.pages[p]);
          eviction_insert(client, space, p);
        }
      }
    }
  }

  void clear_schedule(ClientState& client) {
    client.schedule.clear();
    client.current_step = 0;
    for (auto& [space_id, space] : client.spaces) space.uses.clear();
    rekey_all(client);
  }

  // Brings in the pages of the next prefetch_lookahead_steps steps (from the current one) that
  // are on the host, within quota, never displacing a page needed sooner.
  void schedule_prefetch(ClientState& client) {
    if (config_.prefetch_lookahead_steps == 0) return;
    // Untracked (no ticket): a later acquire depends on these copies through their slots, not
    // through ticket order, so an acquire never waits for a lookahead it does not use (Note
    // [Pages and frames], Tickets).
    Builder builder = start_builder(client, /*tracked=*/false);
    uint64_t end = std::min<uint64_t>(client.schedule.size(),
                                      uint64_t(client.current_step) + config_.prefetch_lookahead_steps + 1);
    struct Wanted {
      Space* space;
      uint32_t page;
    };
    std::vector<Wanted> slotted;
    bool full = false;
    for (uint64_t s = client.current_step; s < end && !full; ++s) {
      // MIN evicts, when step s needs a page, the resident page used last after s. If that is a
      // page the steps before s still use, the eviction must wait until they ran: the floor.
      PrefetchLimit limit{s, 0};
      for (uint64_t before = client.current_step; before < s; ++before) {
        for (const PageRange& range : client.schedule[before].ranges) {
          const Space& space = client.spaces.at(range.space);
          for (uint32_t p = range.first_page; p < range.first_page + range.page_count; ++p) {
            if (space.pages[p].gpu.valid()) limit.floor = std::max(limit.floor, next_use_from(space, p, s));
          }
        }
      }
      for (const PageRange& range : client.schedule[s].ranges) {
        Space& space = client.spaces.at(range.space);
        for (uint32_t p = range.first_page; p < range.first_page + range.page_count && !full; ++p) {
          Page& page = space.pages[p];
          if (page.gpu.valid() || !page.host_valid || page.host_pins != 0) continue;
          Result<SlotRef> slot = get_gpu_slot(client, builder, space.info.page_bytes, &limit);
          if (!slot.ok()) {
            full = true;
            break;
          }
          place(client, Tier::kGpu, slot.value(), space.info.id, p);
          page.gpu = slot.value();
          slotted.push_back({&space, p});
        }
        if (full) break;
      }
    }
    for (const Wanted& wanted : slotted) {
      Page& page = wanted.space->pages[wanted.page];
      add_copy(builder, *wanted.space, Tier::kHost, page.host, Tier::kGpu, page.gpu);
      page.dirty = false;
      page.prefetched = true;
      page.key.last_use = ++client.clock;
      eviction_insert(client, *wanted.space, wanted.page);
    }
    (void)finish_builder(builder);
  }

  // ---- Batches and tickets (Note [Pages and frames]) ------------------------------------------------

  // `tracked`: the call gets the client's next ticket (what wait / stream_wait take); untracked
  // work (ticket 0) completes on its own and is reached only through slot dependencies.
  Builder start_builder(ClientState& client, bool tracked = true) {
    Builder builder;
    builder.client = &client;
    builder.ticket = tracked ? client.next_ticket++ : 0;
    return builder;
  }

  // Makes the builder's work wait for the unfinished batch that last touched `slot`, without
  // touching the slot (no copy of this call reads or writes it). Used where a call hands out a
  // page another batch may still be filling.
  void depend_on_slot(Builder& builder, Tier tier, SlotRef slot) {
    uint64_t last = frame_of(tier, slot.frame).slot_batch[slot.slot];
    if (!is_pending(last) || last == builder.current) return;
    if (builder.current == kNoBatch) open_batch(builder);
    depend(builder.current, last);
  }

  void open_batch(Builder& builder) {
    uint64_t id = next_batch_++;
    Batch& batch = batches_[id];
    batch.id = id;
    batch.client = builder.client->id;
    batch.ticket = builder.ticket;
    builder.current = id;
    builder.batches.push_back(id);
  }

  void seal(Builder& builder) {
    if (builder.current != kNoBatch) batches_.at(builder.current).sealed = true;
    builder.current = kNoBatch;
  }

  bool is_pending(uint64_t batch_id) const { return batch_id != kNoBatch && batches_.count(batch_id) != 0; }

  void depend(uint64_t batch_id, uint64_t dependency) {
    if (!is_pending(dependency) || dependency == batch_id) return;
    Batch& before = batches_.at(dependency);
    if (std::find(before.dependents.begin(), before.dependents.end(), batch_id) != before.dependents.end()) return;
    before.dependents.push_back(batch_id);
    ++batches_.at(batch_id).unmet_dependencies;
  }

  void attach_frame(uint64_t batch_id, Tier tier, FrameIndex index) {
    Batch& batch = batches_.at(batch_id);
    auto key = std::make_pair(tier, index);
    if (std::find(batch.frames.begin(), batch.frames.end(), key) != batch.frames.end()) return;
    batch.frames.push_back(key);
    frame_of(tier, index).pending_batches.push_back(batch_id);
  }

  // Makes the builder's current batch the one an operation on these slots joins: a new batch
  // when the current one already touches one of them (ops within a batch are unordered), with
  // dependencies on every unfinished batch that touched them before.
  void prepare(Builder& builder, std::initializer_list<std::pair<Tier, SlotRef>> slots) {
    bool conflict = builder.current == kNoBatch;
    for (auto [tier, slot] : slots) {
      if (frame_of(tier, slot.frame).slot_batch[slot.slot] == builder.current && builder.current != kNoBatch) {
        conflict = true;
      }
    }
    if (conflict) {
      seal(builder);
      open_batch(builder);
    }
    for (auto [tier, slot] : slots) {
      Frame& frame = frame_of(tier, slot.frame);
      depend(builder.current, frame.slot_batch[slot.slot]);
      frame.slot_batch[slot.slot] = builder.current;
      attach_frame(builder.current, tier, slot.frame);
      if (tier == Tier::kGpu && frame.slot_fence[slot.slot] != 0) {
        uint64_t& fence = frame.slot_fence[slot.slot];
        if (fence_met(*builder.client, fence)) {
          fence = 0;
        } else {
          Batch& batch = batches_.at(builder.current);
          batch.fence = std::max(batch.fence, fence);
        }
      }
    }
  }

  // True when the client's stream was seen past `marker` (reads its released word).
  bool fence_met(ClientState& client, uint64_t marker) {
    if (marker <= client.released_seen) return true;
    if (client.signal_words != nullptr) {
      uint64_t word = __atomic_load_n(const_cast<uint64_t*>(client.signal_words + kSignalReleased), __ATOMIC_ACQUIRE);
      client.released_seen = std::max(client.released_seen, word);
    }
    return marker <= client.released_seen;
  }

  bool frame_fences_met(ClientState& client, Frame& frame) {
    for (uint64_t& fence : frame.slot_fence) {
      if (fence == 0) continue;
      if (!fence_met(client, fence)) return false;
      fence = 0;
    }
    return true;
  }

  // Hands over held batches whose fence is now met and revokes frames kept for a fence. Returns
  // whether the client still waits for something. Caller holds mutex_.
  bool release_fences(ClientState& client) {
    if (!client.awaiting_fence) return false;
    std::vector<uint64_t> still_held;
    std::vector<uint64_t> ready;
    for (uint64_t id : client.held_batches) {
      auto it = batches_.find(id);
      if (it == batches_.end()) continue;
      (fence_met(client, it->second.fence) ? ready : still_held).push_back(id);
    }
    client.held_batches = std::move(still_held);
    client.awaiting_fence = !client.held_batches.empty();
    for (uint64_t id : ready) {
      auto it = batches_.find(id);
      if (it == batches_.end()) continue;
      it->second.held = false;
      it->second.fence = 0;
      submit(id);
    }
    trim(client);  // sets awaiting_fence again for frames still waiting
    return client.awaiting_fence;
  }

  void add_copy(Builder& builder, const Space& space, Tier from, SlotRef source, Tier to, SlotRef destination) {
    prepare(builder, {{from, source}, {to, destination}});
    uint64_t bytes = space.info.page_bytes;
    Batch& batch = batches_.at(builder.current);
    batch.copies.push_back(CopyOp{from, source.frame, uint64_t(source.slot) * bytes, to, destination.frame,
                                  uint64_t(destination.slot) * bytes, bytes});
    if (to == Tier::kGpu) {
      batch.bytes_host_to_gpu += bytes;
    } else {
      batch.bytes_gpu_to_host += bytes;
    }
  }

  void add_zero(Builder& builder, const Space& space, Tier tier, SlotRef slot) {
    prepare(builder, {{tier, slot}});
    uint64_t bytes = space.info.page_bytes;
    Batch& batch = batches_.at(builder.current);
    uint64_t offset = uint64_t(slot.slot) * bytes;
    // Adjacent zero fills of one frame become one.
    if (!batch.zeros.empty()) {
      Batch::Zero& last = batch.zeros.back();
      if (last.tier == tier && last.frame == slot.frame && last.offset + last.bytes == offset) {
        last.bytes += bytes;
        return;
      }
    }
    batch.zeros.push_back(Batch::Zero{tier, slot.frame, offset, bytes});
  }

  Ticket finish_builder(Builder& builder) {
    seal(builder);
    ClientState& client = *builder.client;
    if (builder.ticket != 0) {
      client.pending_tickets.push_back(PendingTicket{builder.ticket, uint32_t(builder.batches.size()), Status::Ok()});
    }
    for (uint64_t id : builder.batches) {
      auto it = batches_.find(id);
      if (it != batches_.end() && !it->second.submitted && !it->second.held && it->second.unmet_dependencies == 0) {
        submit(id);
      }
    }
    advance_completed(client);
    return builder.ticket;
  }

  void submit(uint64_t id) {
    Batch& batch = batches_.at(id);
    if (batch.fence != 0) {
      auto owner = clients_.find(batch.client);
      if (owner != clients_.end() && !fence_met(*owner->second, batch.fence)) {
        if (!batch.held) {
          batch.held = true;
          owner->second->held_batches.push_back(id);
          owner->second->awaiting_fence = true;
          request_fence_watch();
        }
        return;
      }
      batch.fence = 0;
    }
    batch.submitted = true;
    batch.outstanding_callbacks = uint32_t((batch.copies.empty() ? 0 : 1) + batch.zeros.size());
    uint32_t failed = 0;
    if (!batch.copies.empty()) {
      Status status = backend_->enqueue_copies(batch.copies, completion_callback(id));
      if (!status.ok()) {
        batch.status = status;
        ++failed;
      }
    }
    for (const Batch::Zero& zero : batch.zeros) {
      Status status = backend_->enqueue_zero(zero.tier, zero.frame, zero.offset, zero.bytes, completion_callback(id));
      if (!status.ok()) {
        batch.status = status;
        ++failed;
      }
    }
    batch.outstanding_callbacks -= failed;
    if (batch.outstanding_callbacks == 0) complete_batch(id);
  }

  std::function<void(Status)> completion_callback(uint64_t id) {
    return [this, id](Status status) {
      {
        std::lock_guard<std::mutex> lock(completion_mutex_);
        completions_.emplace_back(id, std::move(status));
      }
      completion_ready_.notify_one();
    };
  }

  void complete_batch(uint64_t id) {
    auto it = batches_.find(id);
    if (it == batches_.end()) return;
    Batch batch = std::move(it->second);
    batches_.erase(it);
    for (auto [tier, frame] : batch.frames) drop_pending_batch(tier, frame, id);
    auto owner = clients_.find(batch.client);
    if (owner != clients_.end() && !owner->second->closed) trim(*owner->second);
    for (uint64_t dependent : batch.dependents) {
      auto next = batches_.find(dependent);
      if (next == batches_.end()) continue;
      if (--next->second.unmet_dependencies == 0 && next->second.sealed && !next->second.submitted) {
        if (!batch.status.ok()) next->second.status = batch.status;  // a failed source poisons its readers
        submit(dependent);
      }
    }
    auto client_it = clients_.find(batch.client);
    if (client_it == clients_.end()) return;
    ClientState& client = *client_it->second;
    client.stats.bytes_host_to_gpu += batch.bytes_host_to_gpu;
    client.stats.bytes_gpu_to_host += batch.bytes_gpu_to_host;
    for (PendingTicket& pending : client.pending_tickets) {
      if (pending.ticket != batch.ticket) continue;
      --pending.remaining_batches;
      if (!batch.status.ok()) pending.status = batch.status;
      break;
    }
    advance_completed(client);
  }

  void advance_completed(ClientState& client) {
    Ticket before = client.completed;
    while (!client.pending_tickets.empty() && client.pending_tickets.front().remaining_batches == 0) {
      PendingTicket& front = client.pending_tickets.front();
      if (!front.status.ok()) client.failed_tickets[front.ticket] = front.status;
      client.completed = front.ticket;
      client.pending_tickets.pop_front();
    }
    if (client.completed == before) return;
    if (client.signal_words != nullptr) {
      // A release store: a reader that sees the ticket also sees the pages' bytes.
      __atomic_store_n(const_cast<uint64_t*>(client.signal_words + kSignalCompleted), client.completed,
                       __ATOMIC_RELEASE);
    }
    if (client.events.tickets_completed) {
      client.events_queue.push_back({ClientEvent::Kind::kCompleted, 0, Tier::kGpu, -1, client.completed});
    }
    ticket_done_.notify_all();
  }

  // Wakes the dispatcher to watch released words. Caller holds mutex_ (never the other way
  // round: the dispatcher takes completion_mutex_ without mutex_).
  void request_fence_watch() {
    if (fence_watch_needed_.exchange(true)) return;
    { std::lock_guard<std::mutex> lock(completion_mutex_); }
    completion_ready_.notify_one();
  }

  // Looks at the released words of clients that wait for a fence (Note [Stream-ordered release]).
  void watch_fences() {
    if (!fence_watch_needed_.load()) return;
    std::vector<std::shared_ptr<ClientState>> touched;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      bool any = false;
      for (auto& [id, client] : clients_) {
        if (client->closed || !client->awaiting_fence) continue;
        uint64_t seen = client->released_seen;
        bool waiting = release_fences(*client);
        any = any || waiting;
        if (client->released_seen != seen) touched.push_back(client);
      }
      fence_watch_needed_ = any;
    }
    for (const auto& client : touched) deliver_events(client);
  }

  void dispatcher_loop() {
    for (;;) {
      watch_fences();
      std::pair<uint64_t, Status> completion;
      {
        std::unique_lock<std::mutex> lock(completion_mutex_);
        auto ready = [this] { return stopping_ || !completions_.empty(); };
        if (fence_watch_needed_.load()) {
          completion_ready_.wait_for(lock, std::chrono::microseconds(20), ready);
        } else {
          completion_ready_.wait(lock, [&] { return ready() || fence_watch_needed_.load(); });
        }
        if (completions_.empty()) {
          if (stopping_) return;
          continue;
        }
        completion = std::move(completions_.front());
        completions_.pop_front();
      }
      std::shared_ptr<ClientState> client;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = batches_.find(completion.first);
        if (it == batches_.end()) continue;
        Batch& batch = it->second;
        if (!completion.second.ok()) batch.status = completion.second;
        auto client_it = clients_.find(batch.client);
        if (client_it != clients_.end()) client = client_it->second;
        if (--batch.outstanding_callbacks == 0) complete_batch(completion.first);
      }
      if (client) deliver_events(client);
    }
  }

  // Hands the client's queued events to its callbacks, in order, with no engine lock held.
  void deliver_events(const std::shared_ptr<ClientState>& client) {
    std::lock_guard<std::mutex> delivery(client->delivery_mutex);
    for (;;) {
      ClientEvent event;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (client->closed || client->events_queue.empty()) return;
        event = client->events_queue.front();
        client->events_queue.pop_front();
      }
      switch (event.kind) {
        case ClientEvent::Kind::kGranted:
          if (client->events.frame_granted) {
            client->events.frame_granted(event.window_frame, event.tier, event.fd);
          } else {
            ::close(event.fd);
          }
          break;
        case ClientEvent::Kind::kRevoked:
          if (client->events.frame_revoked) client->events.frame_revoked(event.window_frame, event.tier);
          break;
        case ClientEvent::Kind::kCompleted:
          if (client->events.tickets_completed) client->events.tickets_completed(event.ticket);
          break;
      }
    }
  }

  std::unique_ptr<DeviceBackend> backend_;
  EngineConfig config_;

  std::mutex mutex_;  // guards everything below except the completion queue
  std::condition_variable ticket_done_;
  TierPoolState pools_[2];
  std::map<ClientId, std::shared_ptr<ClientState>> clients_;
  ClientId next_client_ = 1;
  std::unordered_map<uint64_t, Batch> batches_;
  uint64_t next_batch_ = 1;
  // Some client waits for a release marker: the dispatcher polls (guarded by mutex_ for writes;
  // read without it by the dispatcher to choose how long to sleep).
  std::atomic<bool> fence_watch_needed_{false};

  std::mutex completion_mutex_;
  std::condition_variable completion_ready_;
  std::deque<std::pair<uint64_t, Status>> completions_;
  bool stopping_ = false;
  std::thread dispatcher_;
};

}  // namespace

Result<std::unique_ptr<Engine>> Engine::create(std::unique_ptr<DeviceBackend> backend, const EngineConfig& config) {
  if (!backend) return invalid_argument("Engine::create needs a backend");
  if (config.signal_words_per_client > 4096) {
    return invalid_argument("signal_words_per_client must be at most 4096, not " +
                            std::to_string(config.signal_words_per_client));
  }
  return std::unique_ptr<Engine>(new EngineImpl(std::move(backend), config));
}

}  // namespace membar::runtimed
