// Physical frames and slabs: which frame holds which space frame, where clients map them, who
// holds what, and renewal before memory changes hands.
//
// Note [Frames, slabs and renewal]
// Rationale: a node's clients must never see each other's bytes, including through a descriptor
// a client kept after its memory was taken back (an exported GPU frame's descriptor imports the
// same physical memory for as long as it is open; a memfd maps its whole file); memory handed to a
// client must hold zeros or the client's own data; a host pool of a terabyte must not need an open
// descriptor per 2 MiB frame; and a trainer's frames should not be remapped on every eviction.
// Approach: GPU frames (2 MiB allocations) are handed to clients one at a time; host memory comes
// in slabs (one memfd each, pinned once on CUDA) handed to one client at a time, whose frames only
// that client uses, so one descriptor per slab is all a client needs. Memory a client no longer
// holds is *renewed* before anyone else gets it: the backend replaces it with fresh zeroed memory
// (a new allocation at the same daemon address for a GPU frame, a new memfd for a slab), so a
// descriptor the old holder kept reaches only the old memory, which nobody else ever gets.
// Renewal runs on backend threads after the memory's last copies; until it finishes the memory
// counts as preparing, and a call that finds the pool empty only because of that gets UNAVAILABLE
// (retry), which the client libraries retry. Host slabs start unprepared and are prepared in the
// background after start-up, so membard serves at once whatever the size of its host pool. A
// client keeps the frames and slabs it holds when they empty (idle GPU frames stay mapped where
// they were, Note [Remapping a position]); when the pool is empty, another client's need
// reclaims idle ones (revoked, then renewed).
// Limitations: a slab is handed out whole, so a client with one host page holds a whole slab of
// the pool (slabs are pool / 256 rounded up to a power of two, between 2 MiB and 4 GiB); a hostile
// client can keep the old memory of frames taken back from it alive (it reads nobody else's
// bytes), and that memory is then outside the pools.
//
// Note [Remapping a position]
// Rationale: with every space at its own addresses (Note [Space layout]), putting a space frame
// into a GPU frame means mapping that frame at the space frame's position in the client. A map
// costs ~30 us of the client's CPU (cuMemMap + cuMemSetAccess, measured on the H200) and an unmap
// ~18 us: as long as the 2 MiB copy itself. Streaming a 256K-token history of a 7B model through a
// bounded GPU budget moves about a million frames a step; remapping each would add tens of seconds.
// Approach: a GPU frame stays mapped at every position it has served (Frame::mapped_at, its
// mapping cache; SpaceFrame::mapped_gpu is the frame mapped at a position). Placing space frame g
// takes, in order: the frame already mapped at g's position, if it is idle, or if its occupant is
// the victim MIN's order would evict for this placement anyway (may_displace, Note [Eviction
// order]); else an idle frame, a new frame under quota, or the eviction victim, mapped there
// (after unmapping the old frame at g's position). Streaming a history settles into the same frames serving the same positions chunk
// after chunk, with no map calls. A position whose old mapping the client's kernels may still
// read (its stream has not passed the marker of the position's last stream-ordered release) is
// not unmapped: acquire then waits for the marker with no engine lock held (a short wait on the
// client's own stream) and tries again; lookahead prefetch skips it.
// Limitations: a frame keeps at most kMaxMappingsPerFrame positions; past that, placing it drops
// its oldest position whose fence has passed (or keeps them all when none has).
#include <algorithm>
#include <bit>
#include <unistd.h>

#include "engine_impl.h"
#include "membar/common/human_bytes.h"

namespace membar::runtimed {
namespace {

constexpr size_t kMaxMappingsPerFrame = 64;

}  // namespace

// ---- GPU frames ---------------------------------------------------------------------------------

Result<std::optional<FenceWait>> EngineImpl::place_gpu(ClientState& client, Builder& builder, Space& space, uint32_t g,
                                                       const PrefetchLimit* limit) {
  SpaceFrame& target = space.frames[g];
  FrameIndex mapped = target.mapped_gpu;
  FrameIndex chosen = kNoFrame;
  if (mapped != kNoFrame) {
    Frame& frame = frame_of(Tier::kGpu, mapped);
    if (frame.space == 0) {
      client.idle_gpu_frames.erase(mapped);
      chosen = mapped;
    } else if (frame.space != space.info.id || frame.space_frame != g) {
      Space& other = *client.spaces.at(frame.space);
      SpaceFrame& occupant = other.frames[frame.space_frame];
      if (occupant.in_eviction_set && may_displace(client, occupant, limit)) {
        MEMBAR_RETURN_IF_ERROR(evict_gpu(client, builder, other, frame.space_frame, /*pressure=*/true));
        client.idle_gpu_frames.erase(mapped);
        chosen = mapped;
      }
    }
  }
  if (chosen == kNoFrame) {
    MEMBAR_ASSIGN_OR_RETURN(chosen, take_gpu_frame(client, builder, limit));
    if (mapped != kNoFrame) {
      if (target.va_fence != 0 && !fence_met(client, target.va_fence)) {
        client.idle_gpu_frames.insert(chosen);
        return std::optional<FenceWait>(FenceWait{target.va_fence});
      }
      unmap_position(client, space, g);
    }
    Frame& frame = frame_of(Tier::kGpu, chosen);
    if (frame.mapped_at.size() >= kMaxMappingsPerFrame) {
      for (size_t i = 0; i < frame.mapped_at.size(); ++i) {
        auto [old_space, old_g] = frame.mapped_at[i];
        SpaceFrame& old = client.spaces.at(old_space)->frames[old_g];
        if (old.va_fence == 0 || fence_met(client, old.va_fence)) {
          unmap_position(client, *client.spaces.at(old_space), old_g);
          break;
        }
      }
    }
    frame.mapped_at.emplace_back(space.info.id, g);
    target.mapped_gpu = chosen;
    target.va_fence = 0;
    queue_event(client, ClientEvent{ClientEvent::Kind::kMapped, Tier::kGpu, frame.window_frame, 0, -1, space.info.id, g, 0});
    ++client.stats.gpu_maps;
  }
  Frame& frame = frame_of(Tier::kGpu, chosen);
  frame.space = space.info.id;
  frame.space_frame = g;
  change(client, space, g, [chosen](SpaceFrame& f) { f.gpu = chosen; });
  return std::optional<FenceWait>();
}

Result<FrameIndex> EngineImpl::take_gpu_frame(ClientState& client, Builder& builder, const PrefetchLimit* limit) {
  TierPoolState& pool = pools_[0];
  for (;;) {
    if (!client.idle_gpu_frames.empty()) {
      FrameIndex index = *client.idle_gpu_frames.begin();
      client.idle_gpu_frames.erase(client.idle_gpu_frames.begin());
      return index;
    }
    if (client.gpu_frames.size() < client.quota_frames[0] && !pool.free_frames.empty()) {
      MEMBAR_RETURN_IF_ERROR(grant_gpu_frame(client));
      continue;
    }
    Result<EvictionKey> victim = choose_victim(client, limit);
    if (victim.ok()) {
      Space& space = *client.spaces.at(victim.value().space);
      MEMBAR_RETURN_IF_ERROR(evict_gpu(client, builder, space, victim.value().frame, /*pressure=*/true));
      continue;
    }
    if (limit != nullptr) return exhausted(client, Tier::kGpu, " and every resident frame is needed sooner");
    if (client.gpu_frames.size() < client.quota_frames[0]) {
      if (pool.preparing > 0 || reclaim_gpu_frames(client, 16) > 0) {
        return unavailable("client " + std::to_string(client.id) + " needs a GPU frame and the pool's free frames are " +
                           "being cleared for reuse; retry");
      }
      return exhausted(client, Tier::kGpu, "");
    }
    return exhausted(client, Tier::kGpu, " with every resident frame acquired");
  }
}

Status EngineImpl::grant_gpu_frame(ClientState& client) {
  TierPoolState& pool = pools_[0];
  FrameIndex index = pool.free_frames.back();
  if (client.free_gpu_windows.empty()) {
    return internal_error("client " + std::to_string(client.id) + " has no free window frame although it is under quota");
  }
  MEMBAR_ASSIGN_OR_RETURN(int fd, backend_->export_gpu_frame(index));
  pool.free_frames.pop_back();
  Frame& frame = pool.frames[index];
  frame.owner = client.id;
  frame.window_frame = *client.free_gpu_windows.begin();
  client.free_gpu_windows.erase(client.free_gpu_windows.begin());
  frame.space = 0;
  frame.fence = 0;
  frame.mapped_at.clear();
  client.gpu_frames.insert(index);
  client.idle_gpu_frames.insert(index);
  stat_increase(client.stats.gpu_frames, 1);
  queue_event(client, ClientEvent{ClientEvent::Kind::kFrameGranted, Tier::kGpu, frame.window_frame, 0, fd, 0, 0, 0});
  return Status::Ok();
}

void EngineImpl::clear_gpu(ClientState& client, Space& space, uint32_t g) {
  SpaceFrame& target = space.frames[g];
  if (target.gpu == kNoFrame) return;
  FrameIndex index = target.gpu;
  Frame& frame = frame_of(Tier::kGpu, index);
  frame.space = 0;
  frame.space_frame = 0;
  change(client, space, g, [](SpaceFrame& f) { f.gpu = kNoFrame; });
  client.idle_gpu_frames.insert(index);
}

Status EngineImpl::evict_gpu(ClientState& client, Builder& builder, Space& space, uint32_t g, bool pressure) {
  SpaceFrame& target = space.frames[g];
  if (target.dirty) {
    if (target.host == kNoFrame) {
      MEMBAR_ASSIGN_OR_RETURN(FrameIndex host, take_host_frame(client, space, g));
      (void)host;
    }
    add_copy(builder, space, g, Tier::kGpu, target.gpu, Tier::kHost, target.host);
    change(client, space, g, [](SpaceFrame& f) {
      f.host_valid = true;
      f.dirty = false;
    });
  }
  eviction_erase(client, target);
  clear_gpu(client, space, g);
  target.prefetched = false;
  if (pressure) ++client.stats.evictions;
  return Status::Ok();
}

void EngineImpl::unmap_position(ClientState& client, Space& space, uint32_t g) {
  SpaceFrame& target = space.frames[g];
  if (target.mapped_gpu == kNoFrame) return;
  Frame& frame = frame_of(Tier::kGpu, target.mapped_gpu);
  auto& positions = frame.mapped_at;
  positions.erase(std::remove(positions.begin(), positions.end(), std::make_pair(space.info.id, g)), positions.end());
  queue_event(client, ClientEvent{ClientEvent::Kind::kUnmapped, Tier::kGpu, frame.window_frame, 0, -1, space.info.id, g, 0});
  ++client.stats.gpu_unmaps;
  target.mapped_gpu = kNoFrame;
  target.va_fence = 0;
}

void EngineImpl::drop_frame(ClientState& client, Space& space, uint32_t g) {
  SpaceFrame& target = space.frames[g];
  eviction_erase(client, target);
  if (target.gpu != kNoFrame) clear_gpu(client, space, g);
  if (target.host != kNoFrame) clear_host(client, space, g);
  change(client, space, g, [](SpaceFrame& f) {
    f.host_valid = false;
    f.dirty = false;
  });
  target.write_intent = false;
  target.prefetched = false;
}

bool EngineImpl::gpu_frame_quiescent(ClientState& client, Frame& frame) {
  if (!frame.pending_batches.empty()) return false;
  if (frame.fence != 0) {
    if (!fence_met(client, frame.fence)) return false;
    frame.fence = 0;
  }
  for (auto [space_id, g] : frame.mapped_at) {
    SpaceFrame& position = client.spaces.at(space_id)->frames[g];
    if (position.va_fence != 0 && !fence_met(client, position.va_fence)) return false;
  }
  return true;
}

uint64_t EngineImpl::reclaim_gpu_frames(ClientState& requester, uint64_t wanted) {
  uint64_t started = 0;
  for (auto& [id, holder] : clients_) {
    if (holder.get() == &requester || holder->closed) continue;
    std::vector<FrameIndex> idle(holder->idle_gpu_frames.begin(), holder->idle_gpu_frames.end());
    for (FrameIndex index : idle) {
      if (started >= wanted) break;
      Frame& frame = frame_of(Tier::kGpu, index);
      if (!gpu_frame_quiescent(*holder, frame)) continue;
      // The revoke unmaps every position of the frame in the holder's process.
      for (auto [space_id, g] : frame.mapped_at) {
        SpaceFrame& position = holder->spaces.at(space_id)->frames[g];
        position.mapped_gpu = kNoFrame;
        position.va_fence = 0;
      }
      frame.mapped_at.clear();
      queue_event(*holder, ClientEvent{ClientEvent::Kind::kFrameRevoked, Tier::kGpu, frame.window_frame, 0, -1, 0, 0, 0});
      holder->idle_gpu_frames.erase(index);
      holder->gpu_frames.erase(index);
      holder->free_gpu_windows.insert(frame.window_frame);
      stat_decrease(holder->stats.gpu_frames, 1);
      frame.owner = 0;
      frame.window_frame = kNoFrame;
      renew_gpu_frame(index);
      ++started;
    }
    if (started > 0) deliveries_due_.push_back(holder);
    if (started >= wanted) break;
  }
  return started;
}

void EngineImpl::renew_gpu_frame(FrameIndex index) {
  if (tearing_down_) return;   // Note [No renewal at teardown] (engine.cpp)
  Frame& frame = frame_of(Tier::kGpu, index);
  if (!frame.renewing) {
    frame.renewing = true;
    frame.renew_started = false;
    ++pools_[0].preparing;
  }
  if (frame.renew_started || !frame.pending_batches.empty()) return;
  frame.renew_started = true;
  ++renewals_in_flight_;
  Status queued = backend_->renew(Tier::kGpu, index, [this, index](Status status) {
    {
      std::lock_guard<std::mutex> lock(completion_mutex_);
      completions_.emplace_back(RenewalDone{Tier::kGpu, index, std::move(status)});
    }
    completion_ready_.notify_one();
  });
  if (!queued.ok()) renewal_done(Tier::kGpu, index, queued);
}

// ---- Host frames and slabs ------------------------------------------------------------------------

Result<FrameIndex> EngineImpl::take_host_frame(ClientState& client, Space& space, uint32_t g) {
  if (client.host_frames_used + client.channel_frames >= client.quota_frames[1]) {
    return exhausted(client, Tier::kHost, "");
  }
  if (client.idle_host_frames.empty()) MEMBAR_RETURN_IF_ERROR(grant_slab(client));
  FrameIndex index = *client.idle_host_frames.begin();
  client.idle_host_frames.erase(client.idle_host_frames.begin());
  Frame& frame = frame_of(Tier::kHost, index);
  frame.space = space.info.id;
  frame.space_frame = g;
  ++slabs_[frame.slab].used_frames;
  ++client.host_frames_used;
  space.frames[g].host = index;
  queue_event(client, ClientEvent{ClientEvent::Kind::kMapped, Tier::kHost, frame.window_frame, 0, -1, space.info.id, g, 0});
  return index;
}

Status EngineImpl::grant_slab(ClientState& client) {
  const uint64_t unheld = unheld_host_frames();
  Slab* chosen = nullptr;
  uint32_t chosen_index = 0;
  bool preparing = false;
  for (uint32_t s = 0; s < slabs_.size(); ++s) {
    Slab& slab = slabs_[s];
    if (slab.state == Slab::State::kPreparing) preparing = true;
    if (slab.state == Slab::State::kFree && chosen == nullptr) {
      chosen = &slab;
      chosen_index = s;
    }
  }
  if (chosen != nullptr && unheld - chosen->frames < channel_frames_) chosen = nullptr;  // channels hold the rest
  if (chosen == nullptr) {
    if (preparing || reclaim_slabs(client) > 0) {
      return unavailable("client " + std::to_string(client.id) + " needs host memory and the pool's free slabs are " +
                         "being prepared; retry");
    }
    if (back_a_slab()) {
      return unavailable("client " + std::to_string(client.id) + " needs host memory: a slab of the node's host pool " +
                         "is being prepared for this device; retry");
    }
    return exhausted(client, Tier::kHost, "");
  }
  MEMBAR_ASSIGN_OR_RETURN(int fd, backend_->export_host_slab(chosen_index));
  uint32_t number;
  if (!client.free_client_slabs.empty()) {
    number = *client.free_client_slabs.begin();
    client.free_client_slabs.erase(client.free_client_slabs.begin());
  } else {
    number = client.next_client_slab++;
  }
  chosen->state = Slab::State::kOwned;
  count_spare_slabs();
  chosen->owner = client.id;
  chosen->client_slab = number;
  chosen->used_frames = 0;
  client.slabs[number] = chosen_index;
  for (uint32_t i = 0; i < chosen->frames; ++i) {
    Frame& frame = frame_of(Tier::kHost, chosen->first_frame + i);
    frame.owner = client.id;
    frame.window_frame = number * slab_frames_ + i;
    frame.space = 0;
    client.idle_host_frames.insert(chosen->first_frame + i);
  }
  stat_increase(client.stats.host_frames, chosen->frames);
  queue_event(client, ClientEvent{ClientEvent::Kind::kSlabGranted, Tier::kHost, number, chosen->frames, fd, 0, 0, 0});
  return Status::Ok();
}

void EngineImpl::clear_host(ClientState& client, Space& space, uint32_t g) {
  SpaceFrame& target = space.frames[g];
  if (target.host == kNoFrame) return;
  FrameIndex index = target.host;
  Frame& frame = frame_of(Tier::kHost, index);
  queue_event(client, ClientEvent{ClientEvent::Kind::kUnmapped, Tier::kHost, frame.window_frame, 0, -1, space.info.id, g, 0});
  frame.space = 0;
  frame.space_frame = 0;
  --slabs_[frame.slab].used_frames;
  --client.host_frames_used;
  client.idle_host_frames.insert(index);
  change(client, space, g, [](SpaceFrame& f) {
    f.host = kNoFrame;
    f.host_valid = false;
  });
}

uint64_t EngineImpl::reclaim_slabs(ClientState& requester) {
  for (auto& [id, holder] : clients_) {
    if (holder.get() == &requester || holder->closed) continue;
    for (auto it = holder->slabs.begin(); it != holder->slabs.end(); ++it) {
      Slab& slab = slabs_[it->second];
      if (slab.used_frames != 0) continue;
      bool quiet = true;
      for (uint32_t i = 0; i < slab.frames && quiet; ++i) {
        quiet = frame_of(Tier::kHost, slab.first_frame + i).pending_batches.empty();
      }
      if (!quiet) continue;
      for (uint32_t i = 0; i < slab.frames; ++i) {
        holder->idle_host_frames.erase(slab.first_frame + i);
        Frame& frame = frame_of(Tier::kHost, slab.first_frame + i);
        frame.owner = 0;
        frame.window_frame = kNoFrame;
      }
      queue_event(*holder, ClientEvent{ClientEvent::Kind::kSlabRevoked, Tier::kHost, it->first, 0, -1, 0, 0, 0});
      stat_decrease(holder->stats.host_frames, slab.frames);
      holder->free_client_slabs.insert(it->first);
      uint32_t index = it->second;
      holder->slabs.erase(it);
      slab.owner = 0;
      renew_slab(index);
      deliveries_due_.push_back(holder);
      return 1;
    }
  }
  return 0;
}

void EngineImpl::renew_slab(uint32_t index) {
  if (tearing_down_) return;   // Note [No renewal at teardown] (engine.cpp)
  Slab& slab = slabs_[index];
  if (slab.state != Slab::State::kPreparing) {
    slab.state = Slab::State::kPreparing;
    slab.renew_started = false;
    pools_[1].preparing += slab.frames;
    count_spare_slabs();
  }
  if (slab.renew_started) return;
  for (uint32_t i = 0; i < slab.frames; ++i) {
    if (!frame_of(Tier::kHost, slab.first_frame + i).pending_batches.empty()) return;
  }
  slab.renew_started = true;
  ++renewals_in_flight_;
  Status queued = backend_->renew(Tier::kHost, index, [this, index](Status status) {
    {
      std::lock_guard<std::mutex> lock(completion_mutex_);
      completions_.emplace_back(RenewalDone{Tier::kHost, index, std::move(status)});
    }
    completion_ready_.notify_one();
  });
  if (!queued.ok()) renewal_done(Tier::kHost, index, queued);
}

void EngineImpl::renewal_done(Tier tier, uint32_t index, Status status, bool released) {
  if (renewals_in_flight_ > 0) --renewals_in_flight_;
  if (tier == Tier::kGpu) {
    Frame& frame = frame_of(Tier::kGpu, index);
    frame.renewing = false;
    frame.renew_started = false;
    --pools_[0].preparing;
    if (status.ok()) {
      pools_[0].free_frames.push_back(index);
    } else {
      ++lost_frames_[0];
      last_renewal_error_ = status;
      report_lost(Tier::kGpu, lost_frames_[0] - 1, status);
    }
  } else if (released) {
    Slab& slab = slabs_[index];
    if (status.ok()) {
      slab.state = Slab::State::kUnbacked;
      if (config_.host_share) config_.host_share->give_back();
    } else {
      slab.state = Slab::State::kBroken;
      lost_frames_[1] += slab.frames;
      last_renewal_error_ = status;
      report_lost(Tier::kHost, lost_frames_[1] - slab.frames, status);
    }
  } else {
    Slab& slab = slabs_[index];
    slab.renew_started = false;
    pools_[1].preparing -= slab.frames;
    if (status.ok()) {
      slab.state = Slab::State::kFree;
    } else {
      slab.state = Slab::State::kBroken;
      lost_frames_[1] += slab.frames;
      last_renewal_error_ = status;
      report_lost(Tier::kHost, lost_frames_[1] - slab.frames, status);
    }
  }
  if (tier == Tier::kHost) {
    count_spare_slabs();
    if (!released && release_requests_.load() > 0) serve_release_requests();
  }
  renewals_done_.notify_all();
}

// ---- One host pool for a node (Note [One host pool for a node] in engine/host_share.cpp) ---------

// Backs one of this engine's unbacked slabs with the share's capacity, or asks the other engines
// to release one. True when the caller's client should retry.
bool EngineImpl::back_a_slab() {
  if (!config_.host_share) return false;
  for (uint32_t s = 0; s < slabs_.size(); ++s) {
    if (slabs_[s].state != Slab::State::kUnbacked) continue;
    if (config_.host_share->take()) {
      renew_slab(s);
      return true;
    }
    return config_.host_share->ask_others(share_member_);
  }
  return false;   // every slab of this engine is backed (the whole node's pool is here)
}

// Other engines asked for host memory: drops a free slab per ask (not one that channels need).
// Asks that must wait for a slab still being prepared stay for renewal_done; asks this engine has
// nothing for are cancelled (the asker's client is then told the node's pool is used up).
void EngineImpl::serve_release_requests() {
  if (!config_.host_share) return;
  while (release_requests_.load() > 0) {
    const uint64_t unheld = unheld_host_frames();
    bool preparing = false;
    for (const Slab& slab : slabs_) preparing = preparing || slab.state == Slab::State::kPreparing;
    uint32_t chosen = kNoSlab;
    for (uint32_t s = 0; s < slabs_.size() && chosen == kNoSlab; ++s) {
      if (slabs_[s].state == Slab::State::kFree && unheld - slabs_[s].frames >= channel_frames_) chosen = s;
    }
    if (chosen == kNoSlab) {
      if (!preparing) {
        for (uint32_t n = release_requests_.exchange(0); n > 0; --n) config_.host_share->cancel_ask();
      }
      break;
    }
    --release_requests_;
    slabs_[chosen].state = Slab::State::kReleasing;
    ++renewals_in_flight_;
    Status queued = backend_->release_host_slab(chosen, [this, chosen](Status status) {
      {
        std::lock_guard<std::mutex> lock(completion_mutex_);
        completions_.emplace_back(RenewalDone{Tier::kHost, chosen, std::move(status), true});
      }
      completion_ready_.notify_one();
    });
    if (!queued.ok()) renewal_done(Tier::kHost, chosen, queued, true);
  }
  count_spare_slabs();
}

uint64_t EngineImpl::unheld_host_frames() const {
  uint64_t unheld = 0;
  for (const Slab& slab : slabs_) unheld += slab.backed() && slab.state != Slab::State::kOwned ? slab.frames : 0;
  return unheld;
}

void EngineImpl::count_spare_slabs() {
  if (!config_.host_share) return;
  uint64_t spare = 0;   // free, or being prepared for nobody yet
  for (const Slab& slab : slabs_) {
    spare += slab.state == Slab::State::kFree || slab.state == Slab::State::kPreparing ? 1 : 0;
  }
  spare_slabs_ = spare;
}

void EngineImpl::return_client_memory(ClientState& client) {
  for (FrameIndex index : client.gpu_frames) {
    Frame& frame = frame_of(Tier::kGpu, index);
    frame.owner = 0;
    frame.window_frame = kNoFrame;
    frame.space = 0;
    frame.fence = 0;
    frame.mapped_at.clear();
    renew_gpu_frame(index);
  }
  stat_decrease(client.stats.gpu_frames, int64_t(client.gpu_frames.size()));
  client.gpu_frames.clear();
  client.idle_gpu_frames.clear();
  for (auto [number, index] : client.slabs) {
    Slab& slab = slabs_[index];
    for (uint32_t i = 0; i < slab.frames; ++i) {
      Frame& frame = frame_of(Tier::kHost, slab.first_frame + i);
      frame.owner = 0;
      frame.window_frame = kNoFrame;
      frame.space = 0;
    }
    slab.owner = 0;
    slab.used_frames = 0;
    stat_decrease(client.stats.host_frames, slab.frames);
    renew_slab(index);
  }
  client.slabs.clear();
  client.idle_host_frames.clear();
  channel_frames_ -= std::min(channel_frames_, client.channel_frames);
  client.channel_frames = 0;
  client.space_names.clear();
  client.eviction_set.clear();
}

// Logs lost memory when a tier's count of lost frames first passes 1, 2, 4, 8, ... (a failing
// device can lose thousands of frames: a line each would bury the log).
void EngineImpl::report_lost(Tier tier, uint64_t lost_before, const Status& status) {
  uint64_t lost = lost_frames_[tier_index(tier)];
  if (!config_.log_error || std::bit_width(lost) == std::bit_width(lost_before)) return;
  config_.log_error(std::to_string(lost) + " " + tier_name(tier) + " frame" + (lost == 1 ? "" : "s") +
                    " lost so far (renewal failed; out of the pool until membard restarts): " + status.to_string());
}

Status EngineImpl::exhausted(const ClientState& client, Tier tier, const char* why) {
  int t = tier_index(tier);
  uint64_t held = tier == Tier::kGpu ? client.gpu_frames.size() : client.host_frames_used + client.channel_frames;
  uint64_t free_frames = 0;
  if (tier == Tier::kGpu) {
    free_frames = pools_[0].free_frames.size();
  } else {
    for (const Slab& slab : slabs_) free_frames += slab.state == Slab::State::kFree ? slab.frames : 0;
  }
  std::string text = "client " + std::to_string(client.id) +
                     (client.config.name.empty() ? "" : " ('" + client.config.name + "')") + " needs a " +
                     tier_name(tier) + " frame but holds " + std::to_string(held) + " of its " +
                     std::to_string(client.quota_frames[t]) + "-frame " + tier_name(tier) + " quota (" +
                     human_bytes(uint64_t(client.quota_frames[t]) * kFrameBytes) + ")" + why + "; the pool has " +
                     std::to_string(free_frames) + " of " + std::to_string(pools_[t].frames.size()) + " frames free";
  return resource_exhausted(text);
}

}  // namespace membar::runtimed
