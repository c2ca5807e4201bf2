// Copies and their order: batches, tickets, release fences, the dispatcher thread, and the
// delivery of events to clients.
//
// Note [Batches and tickets]
// Rationale: every call that moves data must return at once, yet a copy into a frame must never
// overtake an earlier copy out of it, and a client must be able to wait for exactly its call's
// copies. Approach: copies and zero fills are grouped into batches (one backend enqueue each);
// every frame remembers the last batch that touched it, and a new copy touching the frame depends
// on that batch if it has not finished, so "a frame with an in-flight copy is not reused until
// the copy completes" holds without any waiting on the caller's thread. Every call that moves
// data gets the next ticket of its client; a ticket completes when its batches and every earlier
// ticket's have, which is what lets one 64-bit signal word (kSignalCompleted) describe completion
// to CPU and GPU waiters alike. The schedule's lookahead prefetch (advance) is the exception: its
// copies and evictions take no ticket, so an acquire never waits for prefetches of later steps
// (measured on the H200: with a GPU budget of four steps, each step waited for the next steps'
// copies, 6% of compute); a call that hands out a frame such work may still be filling depends on
// that batch through the frame instead. Memory a client gave up is renewed only after its last
// batch (Note [Frames, slabs and renewal]). Limitations: in-order ticket completion means a slow
// earlier ticket delays a later one.
//
// Note [Stream-ordered release]
// Rationale: a trainer releases pages its kernels are still reading or writing; waiting on its
// CPU for the stream to drain before every release would stall the pipeline of prefetch, compute
// and offload (the point of the runtime). Approach: the client enqueues
// cuStreamWriteValue64(released word, marker) on its stream and calls release_after(marker), which
// returns at once. The space frames' GPU frames and positions remember the marker (Frame::fence,
// SpaceFrame::va_fence). A batch that touches such a frame (the writeback of a dirty frame, or a
// copy or zero fill into a frame whose space frame was evicted) takes the marker as its fence and
// is held, not handed to the backend, until the client's word is seen at or past it; a position
// is not unmapped, and an idle frame not reclaimed, before its fence is seen (Note [Remapping a
// position]). The engine's dispatcher watches the words of clients with something held (every
// 20 us while there is), so the daemon learns when the trainer's GPU passed the marker without the
// trainer's CPU taking part. Eviction passes over frames whose marker was not seen yet while
// others can go, and otherwise takes the oldest marker (choose_victim): MIN's own choice is the
// frame used last, i.e. the one whose kernel just ran, and waiting for it would stall the next
// step behind the copies. Limitations: markers are ordered per client; releases from several
// streams must write their markers in increasing order (one stream, or streams ordered with
// events), else a release may wait for a later marker. The watch is the daemon's CPU reading the
// word, not a GPU-side wait on the copy streams (a stuck client stream would otherwise stall every
// client's copies).
//
// Note [Event delivery]
// Rationale: what a client must map (grants, maps, unmaps, revocations) is decided under the
// engine lock, but telling the client may block (a socket write queue, a CUDA map), and no client
// may stall the engine. Approach: events are queued per client under the lock, in the order they
// are decided, and delivered by whichever thread finishes the call (with_client) or the
// dispatcher, with no engine lock held, one deliverer per client at a time (delivery_mutex), so a
// client sees its events in order and a call's events are delivered before the call returns.
// Events queued for other clients (a reclaim) are delivered by the same call. A deliverer takes
// every event queued so far in one hold of the engine lock, not one hold per event: a step at
// 256K delivers ~0.5M map and unmap events, and with the embedded engine's dispatcher holding the
// lock while it hands copies to CUDA (Note [Hand-over on the dispatcher]) each hold may wait for
// one of those. Between events it reads `closed` without the lock (an atomic); a client closed
// meanwhile gets no more events, and the descriptors of those it does not get are closed.
#include <algorithm>
#include <chrono>
#include <unistd.h>

#include "engine_impl.h"

namespace membar::runtimed {

// ---- Builders and dependencies ---------------------------------------------------------------------

// `tracked`: the call gets the client's next ticket (what wait / stream_wait take); untracked
// work (ticket 0) completes on its own and is reached only through frame dependencies.
Builder EngineImpl::start_builder(ClientState& client, bool tracked) {
  Builder builder;
  builder.client = &client;
  builder.ticket = tracked ? client.next_ticket++ : 0;
  return builder;
}

// Makes the builder's work wait for the unfinished batch that last touched `frame`, without
// touching the frame (no copy of this call reads or writes it). Used where a call hands out a
// frame another batch may still be filling.
void EngineImpl::depend_on_frame(Builder& builder, Tier tier, FrameIndex frame) {
  uint64_t last = frame_of(tier, frame).last_batch;
  if (!is_pending(last) || last == builder.current) return;
  if (builder.current == kNoBatch) open_batch(builder);
  depend(builder.current, last);
}

void EngineImpl::open_batch(Builder& builder) {
  uint64_t id = next_batch_++;
  Batch& batch = batches_[id];
  batch.id = id;
  batch.client = builder.client->id;
  batch.ticket = builder.ticket;
  builder.current = id;
  builder.batches.push_back(id);
}

void EngineImpl::seal(Builder& builder) {
  if (builder.current != kNoBatch) batches_.at(builder.current).sealed = true;
  builder.current = kNoBatch;
}

bool EngineImpl::is_pending(uint64_t batch_id) const { return batch_id != kNoBatch && batches_.count(batch_id) != 0; }

void EngineImpl::depend(uint64_t batch_id, uint64_t dependency) {
  if (!is_pending(dependency) || dependency == batch_id) return;
  Batch& before = batches_.at(dependency);
  if (std::find(before.dependents.begin(), before.dependents.end(), batch_id) != before.dependents.end()) return;
  before.dependents.push_back(batch_id);
  Batch& after = batches_.at(batch_id);
  ++after.unmet_dependencies;
  if (order_on_device_ && !before.submitted) {
    before.submission_dependents.push_back(batch_id);
    ++after.unsubmitted_dependencies;
  }
}

void EngineImpl::attach_frame(uint64_t batch_id, Tier tier, FrameIndex index) {
  Batch& batch = batches_.at(batch_id);
  auto key = std::make_pair(tier, index);
  if (std::find(batch.frames.begin(), batch.frames.end(), key) != batch.frames.end()) return;
  batch.frames.push_back(key);
  frame_of(tier, index).pending_batches.push_back(batch_id);
}

// Makes the builder's current batch the one an operation on these frames joins: a new batch when
// the current one already touches one of them (ops within a batch are unordered), with
// dependencies on every unfinished batch that touched them before.
void EngineImpl::prepare(Builder& builder, std::initializer_list<std::pair<Tier, FrameIndex>> frames,
                         bool split_on_reuse) {
  bool conflict = builder.current == kNoBatch;
  for (auto [tier, index] : frames) {
    if (split_on_reuse && frame_of(tier, index).last_batch == builder.current && builder.current != kNoBatch) {
      conflict = true;
    }
  }
  if (conflict) {
    seal(builder);
    open_batch(builder);
  }
  for (auto [tier, index] : frames) {
    Frame& frame = frame_of(tier, index);
    depend(builder.current, frame.last_batch);
    frame.last_batch = builder.current;
    attach_frame(builder.current, tier, index);
    if (tier == Tier::kGpu && frame.fence != 0) {
      if (fence_met(*builder.client, frame.fence)) {
        frame.fence = 0;
      } else {
        Batch& batch = batches_.at(builder.current);
        batch.fence = std::max(batch.fence, frame.fence);
      }
    }
  }
}

// True when the client's stream was seen past `marker` (reads its released word).
bool EngineImpl::fence_met(ClientState& client, uint64_t marker) {
  if (marker <= client.released_seen) return true;
  if (client.signal_words != nullptr) {
    uint64_t word = __atomic_load_n(const_cast<uint64_t*>(client.signal_words + kSignalReleased), __ATOMIC_ACQUIRE);
    client.released_seen = std::max(client.released_seen, word);
  }
  return marker <= client.released_seen;
}

// Hands over held batches whose fence is now met. Returns whether the client still waits.
bool EngineImpl::release_fences(ClientState& client) {
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
  return client.awaiting_fence;
}

void EngineImpl::add_copy(Builder& builder, Space& space, uint32_t g, Tier from, FrameIndex source, Tier to,
                          FrameIndex destination) {
  prepare(builder, {{from, source}, {to, destination}});
  uint64_t bytes = space.frame_bytes(g);
  Batch& batch = batches_.at(builder.current);
  batch.copies.push_back(CopyOp{from, source, 0, to, destination, 0, bytes});
  (to == Tier::kGpu ? batch.to_gpu : batch.to_host).emplace_back(space.info.id, int64_t(bytes));
}

void EngineImpl::add_zero(Builder& builder, Space& space, uint32_t g, Tier tier, FrameIndex frame) {
  prepare(builder, {{tier, frame}});
  Batch& batch = batches_.at(builder.current);
  batch.zeros.push_back(Batch::Zero{tier, frame, 0, space.frame_bytes(g)});
}

void EngineImpl::add_zero_bytes(Builder& builder, Tier tier, FrameIndex frame, uint64_t offset, uint64_t bytes) {
  prepare(builder, {{tier, frame}});
  batches_.at(builder.current).zeros.push_back(Batch::Zero{tier, frame, offset, bytes});
}

Ticket EngineImpl::finish_builder(Builder& builder) {
  seal(builder);
  ClientState& client = *builder.client;
  if (builder.ticket != 0) {
    uint32_t batches = uint32_t(builder.batches.size());
    client.pending_tickets.push_back(PendingTicket{builder.ticket, batches, Status::Ok(), batches});
  }
  bool deferred = false;
  for (uint64_t id : builder.batches) {
    auto it = batches_.find(id);
    if (it == batches_.end() || !submittable(it->second)) continue;
    if (submit_on_dispatcher_) {   // Note [Hand-over on the dispatcher]
      deferred_submits_.push_back(id);
      deferred = true;
    } else {
      submit(id);
    }
  }
  advance_completed(client);
  advance_submitted(client);
  if (deferred && !submit_asked_.exchange(true)) {
    { std::lock_guard<std::mutex> lock(completion_mutex_); }   // no lost wake-up
    completion_ready_.notify_one();
  }
  return builder.ticket;
}

// Note [Hand-over on the dispatcher]
// Rationale: with copies ordered on the device (Note [Device-ordered copies], the embedded
// runtime), every call hands its batches to the backend before it returns, on the trainer's own
// thread: on the H200 the embedded engine's calls held its lock 22.6 s of a 70 s sparse-offload
// step at 256K (8.1 s of it in cudaMemcpyBatchAsync and the device-side waits), where membard's
// took 3.9 s and the step ran 1.13x faster (session 27). Copies ordered on the host move that work
// to the dispatcher, but the trainer then waits on its host for copies to complete.
// Approach: with EngineConfig::submit_on_dispatcher (and device order), finish_builder leaves the
// call's submittable batches in deferred_submits_ and wakes the dispatcher thread, which hands
// them over under the engine lock in the order they were sealed (submit: dependents enqueued-only
// follow at once, as before). Nothing else changes: a ticket counts as submitted once its batches
// are enqueued, so a client that lets its stream wait for a ticket first waits on its host for the
// dispatcher to have enqueued it (wait_submitted, Note [Enqueued tickets]: the stream never waits
// for work a thread of its process has yet to enqueue), and a host wait() for the copies
// themselves. A batch cancelled meanwhile (its client closed) is skipped.
// Limitations: a call whose ticket the trainer waits for at once gains nothing (it waits for the
// hand-over instead of doing it); what moves off its thread is the work of the calls it does not
// wait for (lookahead prefetches, write-backs, releases' copies). The embedded client's default
// (MEMBAR_DEFER_SUBMIT=0 turns it off): on the H200 the 256K sparse-offload step took 61.5 s against
// 67.1 s without it, the lock held 8.2 s against 25.8 s (membard: 57.8 s; session 28).
void EngineImpl::submit_deferred() {
  std::vector<uint64_t> ids;
  ids.swap(deferred_submits_);
  for (uint64_t id : ids) {
    auto it = batches_.find(id);
    if (it == batches_.end() || it->second.submitted || !it->second.sealed || !submittable(it->second)) continue;
    uint64_t client_id = it->second.client;
    submit(id);
    if (auto owner = clients_.find(client_id); owner != clients_.end()) {
      advance_completed(*owner->second);
      advance_submitted(*owner->second);
    }
  }
}

// Note [Enqueued tickets]
// Rationale: a CUDA stream of the client's process that waits on the GPU for a ticket must not
// depend on a host thread of that process making progress: CUDA's lazy module loading can hold a
// driver lock until the device is idle, and a copy not yet enqueued (the dispatcher blocked on that
// lock) or a completion word not yet stored by the completion thread then never comes (seen on the
// H200 with an embedded runtime: Note [Runtime pages] in runtime_store.py).
// Approach: each pending ticket counts its batches not yet handed to the backend; `submitted` is
// the highest ticket with none left (and none left in any earlier ticket). A batch counts as
// handed over once its copies and zero fills are enqueued, so the signal below is enqueued behind
// them. When it advances, the
// engine stores it in the client's kSignalSubmitted word (host) and, once the client has called
// wait_submitted (other clients pay nothing), asks the backend to write it into
// kSignalEnqueuedDone once every operation enqueued so far has completed (enqueue_signal: the
// CUDA backend's signal stream waits for both copy streams, then cuStreamWriteValue64). A client
// waits on the host until its ticket is submitted (wait_submitted: the time copies wait for their
// frames, never for the copies themselves) and then lets its stream wait on the GPU for
// kSignalEnqueuedDone: what that wait depends on is already enqueued.
// If the backend cannot enqueue the signal, wait_submitted returns that error from then on and the
// client waits on the host instead.
// Limitations: a failed transfer still advances kSignalEnqueuedDone (as through a daemon, the
// stream's wait does not carry the error: wait() does). Work of other clients enqueued before the
// signal delays it too.
void EngineImpl::note_submitted(const Batch& batch) {
  if (batch.ticket == 0) return;
  auto owner = clients_.find(batch.client);
  if (owner == clients_.end()) return;
  for (PendingTicket& pending : owner->second->pending_tickets) {
    if (pending.ticket != batch.ticket) continue;
    if (pending.unsubmitted_batches > 0) --pending.unsubmitted_batches;
    break;
  }
  advance_submitted(*owner->second);
}

void EngineImpl::advance_submitted(ClientState& client) {
  Ticket submitted = std::max(client.submitted, client.completed);
  for (const PendingTicket& pending : client.pending_tickets) {
    if (pending.unsubmitted_batches != 0) break;
    submitted = std::max(submitted, pending.ticket);
  }
  if (submitted == client.submitted) return;
  client.submitted = submitted;
  if (client.signal_words != nullptr) {
    __atomic_store_n(const_cast<uint64_t*>(client.signal_words + kSignalSubmitted), submitted, __ATOMIC_RELEASE);
    if (client.enqueued_signal) enqueue_submitted_signal(client);
  }
  ticket_done_.notify_all();
}

void EngineImpl::enqueue_submitted_signal(ClientState& client) {
  Status status = backend_->enqueue_signal(client.signal_block, kSignalEnqueuedDone, client.submitted);
  if (!status.ok() && client.signal_error.ok()) client.signal_error = status;   // wait_submitted reports it
}

// Whether a sealed batch may go to the backend now: once its dependencies have completed, or,
// ordered on the device, once they are enqueued (Note [Device-ordered copies]).
bool EngineImpl::submittable(const Batch& batch) const {
  if (batch.submitted || batch.held) return false;
  return order_on_device_ ? batch.unsubmitted_dependencies == 0 : batch.unmet_dependencies == 0;
}

// Note [Device-ordered copies]
// Rationale: an engine embedded in a trainer must let the trainer's stream wait for its copies
// on the GPU, never on the host: a host wait empties the GPU's queue (the trainer's CPU stops
// launching kernels), and it is long, because a copy into a frame waits for the stream to pass
// the marker of the frame's last release (Note [Stream-ordered release]) and for the batch that
// last touched the frame. Held on the host, those waits make the trainer's host wait for its own
// GPU: 17% of a 128K offload step on the H200. A stream may not wait on the GPU for work that a
// host thread of its own process has yet to enqueue either (Note [Enqueued tickets]: CUDA's lazy
// module loading can hold a driver lock until the device is idle).
// Approach: with EngineConfig::order_on_device, a batch goes to the backend as soon as the
// batches it depends on are enqueued (not completed), and says on the device what it waits for
// (DeviceOrder): after_enqueued when a dependency has not completed (the streams it uses wait for
// the other copy stream's work so far; each stream is in order), and the client's released word
// >= its fence (cuStreamWaitValue64) instead of being held. So a ticket is enqueued the moment it
// is issued, the client's wait_submitted returns at once and its stream waits on the GPU for
// kSignalEnqueuedDone: everything that wait depends on is already on the device, in stream order
// behind markers the trainer's stream wrote before the wait (no cycle: a batch's fence is a marker
// issued before the batch was built, and a stream's wait is enqueued after its ticket's batches).
// Completion is still seen on the host (frames, renewal, tickets, stats), off the critical path.
// Limitations: only for an engine of one client (the embedded runtime): a fenced batch holds up
// later work on its copy stream until that client's stream passes the marker, so a client that
// stops short of its marker would stall everyone's copies of that direction; a daemon keeps host
// order. after_enqueued orders behind all of the other stream's work, not just the dependency's.
// A failed dependency's error still reaches its dependents' tickets (their copies run either way,
// as in host order). Closing a client sets its released word past every marker and drains the
// backend before its signal block goes.
void EngineImpl::submit(uint64_t id) {
  std::vector<uint64_t> ready{id};
  while (!ready.empty()) {
    uint64_t next = ready.back();
    ready.pop_back();
    auto it = batches_.find(next);
    if (it == batches_.end() || it->second.submitted) continue;
    submit_one(next, ready);
  }
}

void EngineImpl::submit_one(uint64_t id, std::vector<uint64_t>& ready) {
  Batch& batch = batches_.at(id);
  DeviceOrder order;
  if (order_on_device_) {
    order.after_enqueued = batch.unmet_dependencies > 0;
    if (batch.fence != 0) {
      auto owner = clients_.find(batch.client);
      if (owner != clients_.end() && owner->second->signal_words != nullptr &&
          !fence_met(*owner->second, batch.fence)) {
        order.wait_block = owner->second->signal_block;
        order.wait_index = kSignalReleased;
        order.wait_value = batch.fence;
      }
      batch.fence = 0;
    }
  } else if (batch.fence != 0) {
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
  // A batch with nothing to copy that still waits for something (an acquire of a page a prefetch
  // is filling: depend_on_frame) goes to the backend all the same, empty, so that it completes
  // only after what it waits for (device order); on the host it was submitted only after that.
  bool empty_but_ordered =
      batch.copies.empty() && batch.zeros.empty() && (order.after_enqueued || order.wait_value != 0);
  batch.outstanding_callbacks =
      uint32_t((batch.copies.empty() && !empty_but_ordered ? 0 : 1) + batch.zeros.size());
  uint32_t failed = 0;
  auto enqueueing = std::chrono::steady_clock::now();
  if (!batch.copies.empty() || empty_but_ordered) {
    Status status = backend_->enqueue_copies(batch.copies, completion_callback(id), order);
    if (!status.ok()) {
      batch.status = status;
      ++failed;
    }
  }
  for (const Batch::Zero& zero : batch.zeros) {
    Status status =
        backend_->enqueue_zero(zero.tier, zero.frame, zero.offset, zero.bytes, completion_callback(id), order);
    if (!status.ok()) {
      batch.status = status;
      ++failed;
    }
  }
  batch.outstanding_callbacks -= failed;
  if (auto owner = clients_.find(batch.client); owner != clients_.end()) {
    owner->second->stats.call_enqueue_ns += elapsed_ns(enqueueing, std::chrono::steady_clock::now());
  }
  // Dependents waiting only for this batch to be enqueued may follow it now (device order).
  std::vector<uint64_t> followers;
  followers.swap(batch.submission_dependents);
  for (uint64_t follower : followers) {
    auto it = batches_.find(follower);
    if (it == batches_.end()) continue;
    if (it->second.unsubmitted_dependencies > 0) --it->second.unsubmitted_dependencies;
    if (it->second.sealed && submittable(it->second)) ready.push_back(follower);
  }
  // Only now, behind the batch's own copies, may the stream-ordered word move past its ticket
  // (Note [Enqueued tickets]).
  note_submitted(batch);
  if (batch.outstanding_callbacks == 0) complete_batch(id);
}

std::function<void(Status)> EngineImpl::completion_callback(uint64_t id) {
  return [this, id](Status status) {
    {
      std::lock_guard<std::mutex> lock(completion_mutex_);
      completions_.emplace_back(BatchDone{id, std::move(status)});
    }
    completion_ready_.notify_one();
  };
}

void EngineImpl::drop_pending_batch(Tier tier, FrameIndex index, uint64_t batch_id) {
  Frame& frame = frame_of(tier, index);
  auto it = std::find(frame.pending_batches.begin(), frame.pending_batches.end(), batch_id);
  if (it == frame.pending_batches.end()) return;
  frame.pending_batches.erase(it);
  if (!frame.pending_batches.empty()) return;
  // Memory given up while its copies ran is renewed now (Note [Frames, slabs and renewal]).
  if (tier == Tier::kGpu) {
    if (frame.renewing && !frame.renew_started) renew_gpu_frame(index);
  } else if (frame.slab != kNoSlab) {
    Slab& slab = slabs_[frame.slab];
    if (slab.state == Slab::State::kPreparing && !slab.renew_started) renew_slab(frame.slab);
  }
}

void EngineImpl::complete_batch(uint64_t id) {
  auto it = batches_.find(id);
  if (it == batches_.end()) return;
  Batch batch = std::move(it->second);
  batches_.erase(it);
  for (auto [tier, frame] : batch.frames) drop_pending_batch(tier, frame, id);
  for (uint64_t dependent : batch.dependents) {
    auto next = batches_.find(dependent);
    if (next == batches_.end()) continue;
    if (order_on_device_) {   // already enqueued behind this batch on the device
      --next->second.unmet_dependencies;
      if (!batch.status.ok()) next->second.status = batch.status;
      continue;
    }
    if (--next->second.unmet_dependencies == 0 && next->second.sealed && !next->second.submitted) {
      if (!batch.status.ok()) next->second.status = batch.status;  // a failed source poisons its readers
      submit(dependent);
    }
  }
  auto client_it = clients_.find(batch.client);
  if (client_it == clients_.end()) return;
  ClientState& client = *client_it->second;
  for (auto [space_id, bytes] : batch.to_gpu) {
    client.stats.bytes_host_to_gpu += uint64_t(bytes);
    auto space = client.spaces.find(space_id);
    if (space != client.spaces.end()) space->second->counters.bytes_host_to_gpu += uint64_t(bytes);
  }
  for (auto [space_id, bytes] : batch.to_host) {
    client.stats.bytes_gpu_to_host += uint64_t(bytes);
    auto space = client.spaces.find(space_id);
    if (space != client.spaces.end()) space->second->counters.bytes_gpu_to_host += uint64_t(bytes);
  }
  for (PendingTicket& pending : client.pending_tickets) {
    if (pending.ticket != batch.ticket) continue;
    --pending.remaining_batches;
    if (!batch.status.ok()) pending.status = batch.status;
    break;
  }
  advance_completed(client);
}

void EngineImpl::advance_completed(ClientState& client) {
  Ticket before = client.completed;
  while (!client.pending_tickets.empty() && client.pending_tickets.front().remaining_batches == 0) {
    PendingTicket& front = client.pending_tickets.front();
    if (!front.status.ok()) client.failed_tickets[front.ticket] = front.status;
    client.completed = front.ticket;
    client.pending_tickets.pop_front();
  }
  if (client.completed == before) return;
  if (client.signal_words != nullptr) {
    // A release store: a reader that sees the ticket also sees the frames' bytes.
    __atomic_store_n(const_cast<uint64_t*>(client.signal_words + kSignalCompleted), client.completed, __ATOMIC_RELEASE);
  }
  if (client.events.tickets_completed) {
    ClientEvent event{ClientEvent::Kind::kCompleted};
    event.ticket = client.completed;
    client.events_queue.push_back(event);
  }
  ticket_done_.notify_all();
}

// ---- The dispatcher ---------------------------------------------------------------------------------

// Wakes the dispatcher to watch released words. Caller holds mutex_ (never the other way round:
// the dispatcher takes completion_mutex_ without mutex_).
void EngineImpl::request_fence_watch() {
  if (fence_watch_needed_.exchange(true)) return;
  { std::lock_guard<std::mutex> lock(completion_mutex_); }
  completion_ready_.notify_one();
}

// Looks at the released words of clients that wait for a fence (Note [Stream-ordered release]).
void EngineImpl::watch_fences() {
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

void EngineImpl::dispatcher_loop() {
  for (;;) {
    watch_fences();
    std::variant<BatchDone, RenewalDone> completion;
    {
      std::unique_lock<std::mutex> lock(completion_mutex_);
      auto ready = [this] {
        return stopping_ || !completions_.empty() || release_asked_.load() || submit_asked_.load();
      };
      if (fence_watch_needed_.load()) {
        completion_ready_.wait_for(lock, std::chrono::microseconds(20), ready);
      } else {
        completion_ready_.wait(lock, [&] { return ready() || fence_watch_needed_.load(); });
      }
      if (submit_asked_.exchange(false)) {   // Note [Hand-over on the dispatcher]
        lock.unlock();
        std::vector<std::shared_ptr<ClientState>> others;
        {
          std::lock_guard<std::mutex> engine_lock(mutex_);
          submit_deferred();
          others.swap(deliveries_due_);
        }
        for (const auto& other : others) deliver_events(other);
        continue;
      }
      if (completions_.empty()) {
        if (stopping_) return;
        if (release_asked_.exchange(false)) {   // Note [One host pool for a node]
          lock.unlock();
          std::lock_guard<std::mutex> engine_lock(mutex_);
          serve_release_requests();   // what it cannot serve yet, renewal_done serves
        }
        continue;
      }
      completion = std::move(completions_.front());
      completions_.pop_front();
    }
    std::shared_ptr<ClientState> client;
    std::vector<std::shared_ptr<ClientState>> others;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (auto* renewal = std::get_if<RenewalDone>(&completion)) {
        renewal_done(renewal->tier, renewal->index, renewal->status, renewal->released);
        continue;
      }
      BatchDone& done = std::get<BatchDone>(completion);
      auto it = batches_.find(done.id);
      if (it == batches_.end()) continue;
      Batch& batch = it->second;
      if (!done.status.ok()) batch.status = done.status;
      auto client_it = clients_.find(batch.client);
      if (client_it != clients_.end()) client = client_it->second;
      if (--batch.outstanding_callbacks == 0) complete_batch(done.id);
      others.swap(deliveries_due_);
    }
    if (client) deliver_events(client);
    for (const auto& other : others) deliver_events(other);
  }
}

// ---- Events (Note [Event delivery]) -----------------------------------------------------------------

void EngineImpl::queue_event(ClientState& client, ClientEvent event) { client.events_queue.push_back(event); }

void EngineImpl::deliver_events(const std::shared_ptr<ClientState>& client) {
  std::lock_guard<std::mutex> delivery(client->delivery_mutex);
  std::deque<ClientEvent> taken;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (client->closed || client->events_queue.empty()) return;
      taken.swap(client->events_queue);   // every event queued so far, in one hold of the lock
    }
    for (size_t next = 0; next < taken.size(); ++next) {
      if (client->closed.load(std::memory_order_acquire)) {
        // Closed meanwhile (client_close waits for this delivery before it closes what is queued):
        // nobody takes the descriptors of the events not delivered.
        for (size_t rest = next; rest < taken.size(); ++rest) {
          if (taken[rest].fd >= 0) ::close(taken[rest].fd);
        }
        return;
      }
      deliver_event(*client, taken[next]);
    }
    taken.clear();
  }
}

void EngineImpl::deliver_event(ClientState& client, const ClientEvent& event) {
  const ClientEvents& events = client.events;
  switch (event.kind) {
    case ClientEvent::Kind::kFrameGranted:
      if (events.gpu_frame_granted) {
        events.gpu_frame_granted(event.window_frame, event.fd);
      } else {
        ::close(event.fd);
      }
      break;
    case ClientEvent::Kind::kSlabGranted:
      if (events.host_slab_granted) {
        events.host_slab_granted(event.window_frame, event.frames, event.fd);
      } else {
        ::close(event.fd);
      }
      break;
    case ClientEvent::Kind::kFrameRevoked:
      if (events.gpu_frame_revoked) events.gpu_frame_revoked(event.window_frame);
      break;
    case ClientEvent::Kind::kSlabRevoked:
      if (events.host_slab_revoked) events.host_slab_revoked(event.window_frame);
      break;
    case ClientEvent::Kind::kMapped:
      if (events.frame_mapped) events.frame_mapped(event.tier, event.window_frame, event.space, event.space_frame);
      break;
    case ClientEvent::Kind::kUnmapped:
      if (events.frame_unmapped) events.frame_unmapped(event.tier, event.window_frame, event.space, event.space_frame);
      break;
    case ClientEvent::Kind::kCompleted:
      if (events.tickets_completed) events.tickets_completed(event.ticket);
      break;
  }
}

}  // namespace membar::runtimed
