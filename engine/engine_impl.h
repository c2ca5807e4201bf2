// EngineImpl: the Engine (membar/engine/engine.h), declared once and defined in five parts, one
// concern each with its Note:
//   engine.cpp    the public API: clients, spaces, acquire/release and the other calls, stats
//                 (Note [Space layout], Note [Counters])
//   frames.cpp    physical frames and slabs: placement, the mapping cache, grants, revocations,
//                 renewal (Note [Frames, slabs and renewal], Note [Remapping a position])
//   eviction.cpp  the eviction index, schedules and lookahead prefetch (Note [Eviction order])
//   batches.cpp   batches of copies, tickets, release fences, the dispatcher thread and event
//                 delivery (Note [Batches and tickets], Note [Stream-ordered release],
//                 Note [Event delivery])
//   page_copies.cpp  copy_pages: pages copied into other pages (Note [Copied pages])
// Private to engine/. Every method below that is not a public Engine method expects mutex_ held
// unless it says otherwise.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <unordered_map>
#include <variant>
#include <vector>

#include "engine_state.h"
#include "membar/engine/engine.h"

namespace membar::runtimed {

// Accumulates the batches of one call (Note [Batches and tickets]).
struct Builder {
  ClientState* client = nullptr;
  Ticket ticket = 0;
  uint64_t current = kNoBatch;
  std::vector<uint64_t> batches;
};

// For schedule-driven prefetch: the frame is needed at step `needed_at`; a victim must be used
// later than that, and no earlier than any frame the steps before it still use (`floor`).
struct PrefetchLimit {
  uint64_t needed_at;
  uint64_t floor;
};

// Why a placement could not finish without the client's stream passing a release marker first
// (Note [Remapping a position]); the public call waits for the marker and tries again.
struct FenceWait {
  uint64_t marker = 0;
};

class EngineImpl final : public Engine {
 public:
  EngineImpl(std::unique_ptr<DeviceBackend> backend, const EngineConfig& config);
  ~EngineImpl() override;

  DeviceBackend& backend() override { return *backend_; }

  // engine.cpp
  Result<ClientId> client_open(const ClientConfig& config, ClientEvents events) override;
  Status client_close(ClientId id) override;
  Result<int> client_signal_fd(ClientId id) override;
  Result<ClientGeometry> client_geometry(ClientId id) override;
  Result<SpaceId> create_space(ClientId id, const std::string& name, uint64_t page_bytes,
                               uint32_t page_count) override;
  Status destroy_space(ClientId id, SpaceId space) override;
  Result<SpaceInfo> space_info(ClientId id, SpaceId space) override;
  Result<Ticket> acquire(ClientId id, PageRange range, uint32_t flags) override;
  Status release(ClientId id, PageRange range, bool dirty) override;
  Status release_after(ClientId id, PageRange range, bool dirty, uint64_t marker) override;
  Result<Ticket> acquire_ranges(ClientId id, const std::vector<PageRange>& ranges, uint32_t flags,
                                std::optional<uint32_t> advance_step) override;
  Status release_ranges(ClientId id, const std::vector<PageRange>& ranges, bool dirty,
                        std::optional<uint64_t> marker) override;
  Result<Ticket> copy_pages(ClientId id, const std::vector<PageRange>& pairs,
                            std::optional<uint64_t> after_marker) override;
  Result<Ticket> prefetch(ClientId id, PageRange range) override;
  Result<Ticket> offload(ClientId id, PageRange range) override;
  Status free_pages(ClientId id, PageRange range) override;
  Result<Ticket> acquire_host(ClientId id, PageRange range) override;
  Status release_host(ClientId id, PageRange range, bool dirty) override;
  Status set_schedule(ClientId id, std::vector<ScheduleStep> steps) override;
  Status advance(ClientId id, uint32_t step) override;
  Status add_stall_ns(ClientId id, uint64_t ns) override;
  Status wait(ClientId id, Ticket ticket) override;
  Result<Ticket> completed_ticket(ClientId id) override;
  Status wait_submitted(ClientId id, Ticket ticket) override;
  Status reserve_channel_bytes(ClientId id, uint64_t bytes) override;
  Status release_channel_bytes(ClientId id, uint64_t bytes) override;
  Result<RuntimeStats> stats(ClientId id, uint32_t first_space, uint32_t max_spaces) override;

 private:
  friend struct FrameRangeOf;

  // ---- engine.cpp: lookups, the call wrapper, counters ----------------------------------------
  static std::string no_client_text(ClientId id);
  Result<ClientState*> find_client(ClientId id);
  Result<std::shared_ptr<ClientState>> find_client_shared(ClientId id);
  Result<Space*> find_space(ClientState& client, SpaceId space_id);
  // The space and the space frames [first, end) that hold the range's bytes.
  struct FrameSpan {
    Space* space = nullptr;
    uint32_t first = 0;  // space frames [first, end)
    uint32_t end = 0;
    uint32_t first_page = 0;  // the pages asked for
    uint32_t page_count = 0;
  };
  Result<FrameSpan> check_range(ClientState& client, const PageRange& range);
  // The same checks on a space's geometry alone (no lock needed on a copy of it); span.space null.
  static Result<FrameSpan> span_in(const SpaceInfo& info, const PageRange& range);
  static std::string frame_text(const Space& space, uint32_t g);
  // Runs `body` under mutex_ for the open client `id`, then delivers the client's events with no
  // lock held (the one lock-then-deliver helper, Note [Event delivery]).
  template <typename R, typename Body>
  R with_client(ClientId id, Body&& body);
  // Like with_client, for calls that may need the client's stream to pass a release marker
  // first: `body` returns a FenceWait through `wait`, and the call is retried after the wait.
  template <typename R, typename Body>
  R with_client_waiting(ClientId id, Body&& body);
  Status wait_for_marker(const std::shared_ptr<ClientState>& client, uint64_t marker);
  // Note [Counters]: every change of a space frame's residency, dirty or pinned state goes through
  // here so that stats never walk frames.
  static int residency_class(const SpaceFrame& frame);
  template <typename Mutate>
  void change(ClientState& client, Space& space, uint32_t g, Mutate&& mutate);
  void count_frame(ClientState& client, Space& space, const SpaceFrame& frame, uint32_t g, int sign);
  Result<std::optional<FenceWait>> acquire_locked(ClientState& client, FrameSpan span, uint32_t flags,
                                                  Ticket* ticket);
  Status release_locked(ClientState& client, const PageRange& range, bool dirty, std::optional<uint64_t> marker);
  // Takes back the pins an acquire of `span` added (no dirtying): the undo of a failed multi-range call.
  void unpin_span(ClientState& client, const FrameSpan& span);
  // Note [Freed pages]: the span's pages are in use again; freed ones in frames that still have
  // contents are zero-filled on `zero_tier` when given.
  void unfree_pages(ClientState& client, Builder& builder, const FrameSpan& span, std::optional<Tier> zero_tier);

  // ---- frames.cpp --------------------------------------------------------------------------
  Frame& frame_of(Tier tier, FrameIndex index) { return pools_[tier_index(tier)].frames[index]; }
  // A GPU frame for space frame g, mapped at its position (Note [Remapping a position]). With
  // `limit` (lookahead prefetch) only frames whose occupant is needed later may be taken.
  Result<std::optional<FenceWait>> place_gpu(ClientState& client, Builder& builder, Space& space, uint32_t g,
                                             const PrefetchLimit* limit);
  // Takes any usable GPU frame for the client (idle, new, or an evicted victim's).
  Result<FrameIndex> take_gpu_frame(ClientState& client, Builder& builder, const PrefetchLimit* limit);
  Status grant_gpu_frame(ClientState& client);
  Result<FrameIndex> take_host_frame(ClientState& client, Space& space, uint32_t g);
  Status grant_slab(ClientState& client);
  void clear_gpu(ClientState& client, Space& space, uint32_t g);
  void clear_host(ClientState& client, Space& space, uint32_t g);
  // Moves a GPU-resident space frame out: written back first when dirty, then its frame is idle.
  Status evict_gpu(ClientState& client, Builder& builder, Space& space, uint32_t g, bool pressure);
  // Forgets a space frame's contents in both tiers.
  void drop_frame(ClientState& client, Space& space, uint32_t g);
  void unmap_position(ClientState& client, Space& space, uint32_t g);
  // Idle frames and slabs of other clients go back to the pool (renewed) when `requester` needs
  // them and the pool is empty. Returns how many were started.
  uint64_t reclaim_gpu_frames(ClientState& requester, uint64_t wanted);
  uint64_t reclaim_slabs(ClientState& requester);
  // Hands a frame or slab no client holds to the backend for renewal (when its copies are done).
  void renew_gpu_frame(FrameIndex index);
  void renew_slab(uint32_t slab);
  void renewal_done(Tier tier, uint32_t index, Status status, bool released = false);
  void return_client_memory(ClientState& client);
  void report_lost(Tier tier, uint64_t lost_before, const Status& status);
  // Note [One host pool for a node] (engine/host_share.cpp).
  bool back_a_slab();
  void serve_release_requests();
  void count_spare_slabs();
  // Host frames of backed slabs no client holds (free or being prepared): what channels and grants
  // share (Note [One host pool for a node]: unbacked and releasing slabs are not this engine's).
  uint64_t unheld_host_frames() const;
  Status exhausted(const ClientState& client, Tier tier, const char* why);
  bool gpu_frame_quiescent(ClientState& client, Frame& frame);

  // ---- eviction.cpp ------------------------------------------------------------------------
  uint64_t next_use(const ClientState& client, const Space& space, uint32_t g) const;
  static uint64_t next_use_from(const Space& space, uint32_t g, uint64_t step);
  void eviction_insert(ClientState& client, Space& space, uint32_t g);
  void eviction_erase(ClientState& client, SpaceFrame& frame);
  void rekey_all(ClientState& client);
  void clear_schedule(ClientState& client);
  void unpin(ClientState& client, Space& space, uint32_t g);
  Result<EvictionKey> choose_victim(ClientState& client, const PrefetchLimit* limit);
  bool may_displace(ClientState& client, const SpaceFrame& occupant, const PrefetchLimit* limit);
  void schedule_prefetch(ClientState& client);
  Status advance_locked(ClientState& client, uint32_t step);

  // ---- batches.cpp -------------------------------------------------------------------------
  Builder start_builder(ClientState& client, bool tracked = true);
  void depend_on_frame(Builder& builder, Tier tier, FrameIndex frame);
  void open_batch(Builder& builder);
  void seal(Builder& builder);
  bool is_pending(uint64_t batch_id) const;
  void depend(uint64_t batch_id, uint64_t dependency);
  void attach_frame(uint64_t batch_id, Tier tier, FrameIndex index);
  // split_on_reuse false: the caller's operations on a frame the current batch already touches
  // write disjoint bytes (copy_pages), so they may share the batch.
  void prepare(Builder& builder, std::initializer_list<std::pair<Tier, FrameIndex>> frames,
               bool split_on_reuse = true);
  bool fence_met(ClientState& client, uint64_t marker);
  bool release_fences(ClientState& client);
  void add_copy(Builder& builder, Space& space, uint32_t g, Tier from, FrameIndex source, Tier to,
                FrameIndex destination);
  void add_zero(Builder& builder, Space& space, uint32_t g, Tier tier, FrameIndex frame);
  void add_zero_bytes(Builder& builder, Tier tier, FrameIndex frame, uint64_t offset, uint64_t bytes);
  Ticket finish_builder(Builder& builder);
  void submit(uint64_t id);
  void submit_deferred();   // the dispatcher's part (Note [Hand-over on the dispatcher])
  // Hands one batch to the backend; adds dependents it made ready to `ready` (device order).
  void submit_one(uint64_t id, std::vector<uint64_t>& ready);
  bool submittable(const Batch& batch) const;
  std::function<void(Status)> completion_callback(uint64_t id);
  void complete_batch(uint64_t id);
  void drop_pending_batch(Tier tier, FrameIndex index, uint64_t batch_id);
  void advance_completed(ClientState& client);
  void note_submitted(const Batch& batch);
  void advance_submitted(ClientState& client);
  void enqueue_submitted_signal(ClientState& client);
  void request_fence_watch();
  void watch_fences();
  void dispatcher_loop();
  // With no engine lock held.
  void deliver_events(const std::shared_ptr<ClientState>& client);
  void deliver_event(ClientState& client, const ClientEvent& event);
  void queue_event(ClientState& client, ClientEvent event);

  std::unique_ptr<DeviceBackend> backend_;
  EngineConfig config_;
  bool order_on_device_ = false;   // Note [Device-ordered copies]
  bool submit_on_dispatcher_ = false;   // Note [Hand-over on the dispatcher]

  std::mutex mutex_;  // guards everything below except the completion queue
  std::condition_variable ticket_done_;
  TierPoolState pools_[2];
  std::vector<Slab> slabs_;
  uint32_t slab_frames_ = 1;
  uint64_t channel_frames_ = 0;   // host pool frames taken by channels
  uint64_t space_frames_all_ = 0; // space frames of every client's spaces (and reservations)
  std::map<ClientId, std::shared_ptr<ClientState>> clients_;
  ClientId next_client_;  // EngineConfig::first_client_id, then every client_id_step
  std::unordered_map<uint64_t, Batch> batches_;
  uint64_t next_batch_ = 1;
  uint64_t renewals_in_flight_ = 0;
  uint64_t lost_frames_[2] = {0, 0};  // frames whose renewal failed (kept out of the pools)
  Status last_renewal_error_;
  // Other clients whose events a call queued (reclaims): delivered with the caller's.
  std::vector<std::shared_ptr<ClientState>> deliveries_due_;
  std::condition_variable renewals_done_;
  // Some client waits for a release marker: the dispatcher polls (guarded by mutex_ for writes;
  // read without it by the dispatcher to choose how long to sleep).
  std::atomic<bool> fence_watch_needed_{false};
  // Note [One host pool for a node]: this engine's membership of the node's share, its free
  // backed slabs (read by other engines without this engine's lock), and another engine's ask
  // for one (handled by the dispatcher thread).
  uint32_t share_member_ = 0;
  std::atomic<uint64_t> spare_slabs_{0};
  std::atomic<uint32_t> release_requests_{0};   // other engines' asks not yet served
  std::atomic<bool> release_asked_{false};        // a new ask for the dispatcher thread
  // Note [Hand-over on the dispatcher]: sealed batches the calls left for the dispatcher to hand
  // to the backend (guarded by mutex_), and whether it has been told.
  std::vector<uint64_t> deferred_submits_;
  std::atomic<bool> submit_asked_{false};

  // What the dispatcher thread handles: a finished batch part, or a finished renewal.
  struct BatchDone {
    uint64_t id;
    Status status;
  };
  struct RenewalDone {
    Tier tier;
    uint32_t index;
    Status status;
    bool released = false;  // a host slab's memory was dropped (release_host_slab), not renewed
  };
  std::mutex completion_mutex_;
  std::condition_variable completion_ready_;
  std::deque<std::variant<BatchDone, RenewalDone>> completions_;
  bool stopping_ = false;
  std::thread dispatcher_;
  // Set by the destructor before it closes the clients: memory is no longer renewed (Note
  // [No renewal at teardown] in engine.cpp).
  std::atomic<bool> tearing_down_{false};
};

// ---- Template definitions ---------------------------------------------------------------------

inline uint64_t elapsed_ns(std::chrono::steady_clock::time_point from, std::chrono::steady_clock::time_point to) {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count());
}

template <typename R, typename Body>
R EngineImpl::with_client(ClientId id, Body&& body) {
  return with_client_waiting<R>(id, [&](ClientState& client, std::optional<FenceWait>&) { return body(client); });
}

template <typename R, typename Body>
R EngineImpl::with_client_waiting(ClientId id, Body&& body) {
  for (int attempt = 0;; ++attempt) {
    std::optional<FenceWait> fence_wait;
    std::shared_ptr<ClientState> owner;
    std::vector<std::shared_ptr<ClientState>> others;
    auto called = std::chrono::steady_clock::now();
    R result = [&]() -> R {
      std::lock_guard<std::mutex> lock(mutex_);
      auto locked = std::chrono::steady_clock::now();
      auto found = find_client_shared(id);
      if (!found.ok()) return found.status();
      owner = std::move(found).value();
      R answer = body(*owner, fence_wait);
      others.swap(deliveries_due_);
      owner->stats.call_lock_wait_ns += elapsed_ns(called, locked);
      owner->stats.call_locked_ns += elapsed_ns(locked, std::chrono::steady_clock::now());
      return answer;
    }();
    auto delivering = std::chrono::steady_clock::now();
    if (owner) deliver_events(owner);
    for (const auto& other : others) deliver_events(other);
    if (owner) owner->deliver_ns.fetch_add(elapsed_ns(delivering, std::chrono::steady_clock::now()), std::memory_order_relaxed);
    if (!fence_wait.has_value()) return result;
    if (attempt >= 64) {   // the body undid its work: a placeholder result must not pass for success
      return Status(StatusCode::UNAVAILABLE, "client " + std::to_string(id) + " still waits for its stream to pass "
                                                 "release marker " + std::to_string(fence_wait->marker) + "; retry");
    }
    auto started = std::chrono::steady_clock::now();
    Status waited = wait_for_marker(owner, fence_wait->marker);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++owner->stats.fence_waits;
      owner->stats.fence_wait_ns += elapsed_ns(started, std::chrono::steady_clock::now());
    }
    if (!waited.ok()) return waited;
  }
}

template <typename Mutate>
void EngineImpl::change(ClientState& client, Space& space, uint32_t g, Mutate&& mutate) {
  SpaceFrame& frame = space.frames[g];
  count_frame(client, space, frame, g, -1);
  mutate(frame);
  count_frame(client, space, frame, g, +1);
}

}  // namespace membar::runtimed
