// Which GPU-resident space frame leaves when a frame is needed, and what the schedule's
// lookahead brings in.
//
// Note [Eviction order]
// Rationale: a chunk-recurrent trainer knows its whole access schedule in advance, and for a
// known reference string the optimal replacement policy is Belady's MIN: evict what is next used
// farthest in the future (or never). Without a schedule the best cheap guess is least recently
// used.
// Approach: set_schedule records, for every space frame, the ascending list of steps that name it
// (a step's page ranges name the space frames covering their bytes). Each client keeps one ordered
// set of its GPU-resident unpinned space frames keyed by (next use at or after the current step,
// descending; last use, ascending): the first element is the victim. advance(step) moves the
// current step and re-keys only the frames named by the steps it passed (their next use changed),
// so its cost is the size of those steps, not of the spaces; a jump over steps that name more
// frames than the client has resident re-keys the resident frames instead, so no advance costs
// more than that under the engine's lock (nor does the lookahead: a step may name at most
// max_step_uses frames). Without a schedule every next use is
// "never" and the order is LRU (but see the reuse of mapped frames below); frames the schedule
// never names are evicted before any it does name. Schedule-driven prefetch (advance's lookahead)
// evicts a frame only when its next use is strictly later than that of the frame being brought
// in, so prefetching can never displace something needed sooner, and only when MIN itself would
// choose that victim at the step that needs the frame: if a frame the intervening steps still use will be needed even later, MIN
// would evict that one once those steps ran, so the prefetch waits (conservative prefetching,
// after Cao et al.: the same replacements as MIN, made earlier). Acquire, which must succeed,
// takes the first victim whatever its next use. The frame already mapped at a position serves it
// again (Note [Remapping a position]) when its occupant is as good a victim as MIN's: its next
// use is no sooner than the victim's (they tie; every "never" ties). MIN's load count is then
// unchanged, and streaming without a schedule, or through a schedule that does not use a frame
// again, settles into the same frames at the same positions with no map calls. Where the
// occupant is needed sooner than MIN's victim, MIN wins and the position is remapped (taking the
// mapped frame anyway made random schedules load more than MIN and let lookahead displace frames
// needed sooner). Without a schedule the order is therefore LRU except for that reuse.
// EngineConfig::displace_rank (MEMBAR_DISPLACE_RANK, 0 by default) widens the reuse to an occupant
// among MIN's first N candidates (still never one a prefetch's limit protects): in a 2-layer probe
// it halved the map calls for ~12% more bytes (at 32K, ~100 frames resident: 326 -> 200 maps per
// step, most remaps there being occupants outside MIN's first candidates, ~9% idle frames taken),
// but in the 7B trainer (session 15, H200) ranks 8 and 64 changed neither maps nor step time; its
// budget holds thousands of frames, so an occupant is likely rarely among the first 64 (not measured).
// Limitations: next use is counted in steps, not within a step, so frames of one step tie and
// fall back to LRU among themselves. A schedule that walks a history several times, through more
// frames than the quota, keeps remapping: each frame is used again, so MIN's victim is rarely the
// frame mapped where the next one goes (set the schedule per pass to keep the mappings; measured
// in Engine.ScheduledStreamingReusesMappings). Explicit prefetch() is obeyed like acquire (it
// may evict anything unpinned); only advance()'s lookahead follows MIN's rule. A frame brought in by a
// prefetch whose copy is still in flight may be chosen as a victim; copies into its frame then
// wait for that copy (batch ordering), never corrupt it.
#include <algorithm>

#include "engine_impl.h"

namespace membar::runtimed {

uint64_t EngineImpl::next_use(const ClientState& client, const Space& space, uint32_t g) const {
  return next_use_from(space, g, client.current_step);
}

uint64_t EngineImpl::next_use_from(const Space& space, uint32_t g, uint64_t step) {
  if (space.uses.empty()) return kNeverUsed;
  const std::vector<uint32_t>& uses = space.uses[g];
  auto it = std::lower_bound(uses.begin(), uses.end(), step);
  return it == uses.end() ? kNeverUsed : *it;
}

void EngineImpl::eviction_insert(ClientState& client, Space& space, uint32_t g) {
  SpaceFrame& frame = space.frames[g];
  if (frame.in_eviction_set || frame.gpu == kNoFrame || frame.pins != 0) return;
  frame.key.next_use = next_use(client, space, g);
  frame.key.space = space.info.id;
  frame.key.frame = g;
  client.eviction_set.insert(frame.key);
  frame.in_eviction_set = true;
}

void EngineImpl::eviction_erase(ClientState& client, SpaceFrame& frame) {
  if (!frame.in_eviction_set) return;
  client.eviction_set.erase(frame.key);
  frame.in_eviction_set = false;
}

void EngineImpl::unpin(ClientState& client, Space& space, uint32_t g) {
  change(client, space, g, [](SpaceFrame& f) { --f.pins; });
  SpaceFrame& frame = space.frames[g];
  if (frame.pins == 0) {
    frame.key.last_use = ++client.clock;
    eviction_insert(client, space, g);
  }
}

void EngineImpl::rekey_all(ClientState& client) {
  std::vector<EvictionKey> keys(client.eviction_set.begin(), client.eviction_set.end());
  client.eviction_set.clear();
  for (const EvictionKey& key : keys) {
    Space& space = *client.spaces.at(key.space);
    SpaceFrame& frame = space.frames[key.frame];
    frame.in_eviction_set = false;
    eviction_insert(client, space, key.frame);
  }
}

void EngineImpl::clear_schedule(ClientState& client) {
  client.schedule.clear();
  client.schedule_uses.clear();
  client.current_step = 0;
  for (auto& [space_id, space] : client.spaces) space->uses.clear();
  rekey_all(client);
}

// The frame mapped at a position serves it again (no remap) only when that costs no load MIN
// would not make: the client must evict (no idle frame, no new frame under quota), the occupant's
// next use is no sooner than that of MIN's victim (choose_victim, with the same limit; MIN is
// indifferent among victims whose next use ties, and every "never" ties), and no release marker
// holds the occupant's frame.
bool EngineImpl::may_displace(ClientState& client, const SpaceFrame& occupant, const PrefetchLimit* limit) {
  if (occupant.pins != 0 || !occupant.in_eviction_set) return false;
  if (!client.idle_gpu_frames.empty()) return false;
  if (client.gpu_frames.size() < client.quota_frames[0] && !pools_[0].free_frames.empty()) return false;
  uint64_t& fence = frame_of(Tier::kGpu, occupant.gpu).fence;
  if (fence != 0 && !fence_met(client, fence)) return false;
  Result<EvictionKey> victim = choose_victim(client, limit);
  if (!victim.ok()) return false;
  if (occupant.key.next_use >= victim.value().next_use) return true;
  // displace_rank: the occupant may go if it is among the first candidates of MIN's order (and,
  // for a prefetch, not needed before the frame brought in: the scan stops where choose_victim's does).
  if (config_.displace_rank >= client.eviction_set.size()) {   // every candidate: no scan
    return limit == nullptr || (occupant.key.next_use > limit->needed_at && occupant.key.next_use >= limit->floor);
  }
  uint32_t rank = 0;
  for (const EvictionKey& key : client.eviction_set) {
    if (rank++ >= config_.displace_rank) break;
    if (limit != nullptr && (key.next_use <= limit->needed_at || key.next_use < limit->floor)) break;
    if (key.space == occupant.key.space && key.frame == occupant.key.frame) return true;
  }
  return false;
}

// The victim in MIN's order (Note [Eviction order]), except that a frame whose release marker
// was not yet seen (its kernels may still be running, Note [Stream-ordered release]) is passed
// over for the next one in order that is free to go; when every candidate waits for a marker,
// the one with the oldest marker goes (it is the first the trainer's stream will pass). Taking
// MIN's first choice there would make every copy into its frame, and every later ticket, wait
// for the kernel that just ran. `limit` (prefetch) stops the scan at the first frame needed too
// soon. NOT_FOUND when no candidate qualifies.
Result<EvictionKey> EngineImpl::choose_victim(ClientState& client, const PrefetchLimit* limit) {
  constexpr int kScan = 256;  // bounds the cost of a call when many frames wait for markers
  const EvictionKey* oldest = nullptr;
  uint64_t oldest_marker = UINT64_MAX;
  int scanned = 0;
  for (const EvictionKey& key : client.eviction_set) {
    if (limit != nullptr && (key.next_use <= limit->needed_at || key.next_use < limit->floor)) break;
    if (++scanned > kScan) break;
    const SpaceFrame& frame = client.spaces.at(key.space)->frames[key.frame];
    uint64_t& fence = frame_of(Tier::kGpu, frame.gpu).fence;
    if (fence != 0 && fence_met(client, fence)) fence = 0;
    if (fence == 0) return key;
    if (fence < oldest_marker) {
      oldest_marker = fence;
      oldest = &key;
    }
  }
  if (oldest == nullptr) return not_found("no frame may be evicted");
  return *oldest;
}

// ---- Schedules --------------------------------------------------------------------------------------

Status EngineImpl::set_schedule(ClientId id, std::vector<ScheduleStep> steps) {
  if (steps.size() > (1u << 24)) {
    return invalid_argument("a schedule may have at most 16M steps, not " + std::to_string(steps.size()));
  }
  // Phase 1: check every range and learn each space's geometry. Only the lookup of the spaces
  // named takes the lock (a 1M-token step's schedule names ~2.7M ranges but ~100 spaces; checking
  // the ranges under the lock stalled every other client for tens of milliseconds).
  struct Geometry {
    uint64_t frames;
    const Space* space;
    SpaceInfo info;  // a copy: checked without the lock
  };
  std::map<SpaceId, Geometry> geometry;
  std::vector<uint64_t> prefix_uses(steps.size() + 1, 0);  // ClientState::schedule_uses
  {
    std::vector<SpaceId> named;
    for (const ScheduleStep& step : steps) {
      for (const PageRange& range : step.ranges) {
        if (named.empty() || named.back() != range.space) named.push_back(range.space);
      }
    }
    std::sort(named.begin(), named.end());
    named.erase(std::unique(named.begin(), named.end()), named.end());
    std::map<SpaceId, Status> missing;  // spaces named that this client does not have, and why
    // In batches, so that a schedule naming millions of (bogus) spaces holds the lock briefly each
    // time; phase 3 checks that the spaces found are still the client's.
    constexpr size_t kLookupsPerLock = 1024;
    for (size_t first = 0; first < named.size(); first += kLookupsPerLock) {
      std::lock_guard<std::mutex> lock(mutex_);
      MEMBAR_ASSIGN_OR_RETURN(ClientState * client, find_client(id));
      for (size_t i = first; i < std::min(named.size(), first + kLookupsPerLock); ++i) {
        Result<Space*> space = find_space(*client, named[i]);
        if (!space.ok()) {
          missing.emplace(named[i], space.status());
          continue;
        }
        const Space& found = *space.value();
        geometry.emplace(named[i], Geometry{found.frames.size(), &found, found.info});
      }
    }
    // Unlocked: the first bad range in step order, as check_range would report it.
    uint64_t uses = 0;
    for (size_t s = 0; s < steps.size(); ++s) {
      for (const PageRange& range : steps[s].ranges) {
        auto it = geometry.find(range.space);
        Status status = it == geometry.end() ? missing.at(range.space) : Status::Ok();
        if (it != geometry.end()) {
          Result<FrameSpan> span = span_in(it->second.info, range);
          if (span.ok()) {
            uses += span.value().end - span.value().first;
            continue;
          }
          status = span.status();
        }
        return Status(status.code(), "schedule step " + std::to_string(s) + ": " + status.message());
      }
      prefix_uses[s + 1] = uses;
      if (uses - prefix_uses[s] > config_.max_step_uses) {
        return resource_exhausted("schedule step " + std::to_string(s) + " names " +
                                  std::to_string(uses - prefix_uses[s]) + " space frames; a step may name at most " +
                                  std::to_string(config_.max_step_uses));
      }
    }
    if (uses > config_.max_schedule_uses) {
      return resource_exhausted("a schedule may name at most " + std::to_string(config_.max_schedule_uses) +
                                " (space frame, step) uses; this one names " + std::to_string(uses));
    }
  }
  // Phase 2 (unlocked: a long schedule must not stall other clients): every frame's uses.
  std::map<SpaceId, std::vector<std::vector<uint32_t>>> uses;
  for (auto& [space_id, geo] : geometry) uses[space_id].resize(geo.frames);
  for (size_t s = 0; s < steps.size(); ++s) {
    for (const PageRange& range : steps[s].ranges) {
      const Geometry& geo = geometry.at(range.space);
      const FrameSpan span = span_in(geo.info, range).value();  // checked in phase 1
      auto& space_uses = uses[range.space];
      for (uint32_t g = span.first; g < span.end; ++g) {
        std::vector<uint32_t>& list = space_uses[g];
        if (list.empty() || list.back() != uint32_t(s)) list.push_back(uint32_t(s));
      }
    }
  }
  // Phase 3 (locked): install, if the spaces are still the ones checked. The schedule it replaces
  // is swapped out and freed after the lock is released (freeing millions of ranges and use lists
  // took most of the time this phase held the lock).
  std::vector<ScheduleStep> old_schedule;
  std::vector<std::vector<std::vector<uint32_t>>> old_uses;
  Status installed = with_client<Status>(id, [&](ClientState& client) -> Status {
    for (auto& [space_id, geo] : geometry) {
      auto it = client.spaces.find(space_id);
      if (it == client.spaces.end() || it->second.get() != geo.space) {
        return aborted("set_schedule: space " + std::to_string(space_id) + " was destroyed meanwhile");
      }
    }
    old_schedule.swap(client.schedule);
    for (auto& [space_id, space] : client.spaces) {
      if (!space->uses.empty()) old_uses.push_back(std::move(space->uses));
      space->uses.clear();
    }
    for (auto& [space_id, list] : uses) client.spaces.at(space_id)->uses = std::move(list);
    client.schedule = std::move(steps);
    client.schedule_uses = std::move(prefix_uses);
    client.current_step = 0;
    rekey_all(client);
    return Status::Ok();
  });
  return installed;
}

Status EngineImpl::advance(ClientId id, uint32_t step) {
  return with_client<Status>(id, [&](ClientState& client) { return advance_locked(client, step); });
}

Status EngineImpl::advance_locked(ClientState& client, uint32_t step) {
  if (step >= client.schedule.size()) {
    return out_of_range("advance: step " + std::to_string(step) + " is outside the schedule of " +
                        std::to_string(client.schedule.size()) + " steps");
  }
  uint32_t previous = client.current_step;
  client.current_step = step;
  // Re-key the frames the passed steps name, or every frame in the eviction set where that is
  // less work (a jump over many steps: the cost stays bounded by the client's resident frames).
  if (step < previous ||
      client.schedule_uses[step] - client.schedule_uses[previous] > client.eviction_set.size()) {
    rekey_all(client);
  } else {
    for (uint32_t s = previous; s < step; ++s) {
      for (const PageRange& range : client.schedule[s].ranges) {
        Result<FrameSpan> span = check_range(client, range);
        if (!span.ok()) continue;
        Space& space = *span.value().space;
        for (uint32_t g = span.value().first; g < span.value().end; ++g) {
          if (space.frames[g].in_eviction_set) {
            eviction_erase(client, space.frames[g]);
            eviction_insert(client, space, g);
          }
        }
      }
    }
  }
  schedule_prefetch(client);
  return Status::Ok();
}

// Brings in the frames of the next prefetch_lookahead_steps steps (from the current one) that
// are on the host, within quota, never displacing a frame needed sooner.
void EngineImpl::schedule_prefetch(ClientState& client) {
  if (config_.prefetch_lookahead_steps == 0) return;
  // Untracked (no ticket): a later acquire depends on these copies through their frames, not
  // through ticket order, so an acquire never waits for a lookahead it does not use (Note
  // [Batches and tickets]).
  Builder builder = start_builder(client, /*tracked=*/false);
  uint64_t end = std::min<uint64_t>(client.schedule.size(),
                                    uint64_t(client.current_step) + config_.prefetch_lookahead_steps + 1);
  struct Wanted {
    Space* space;
    uint32_t frame;
  };
  std::vector<Wanted> placed;
  bool full = false;
  for (uint64_t s = client.current_step; s < end && !full; ++s) {
    // MIN evicts, when step s needs a frame, the resident frame used last after s. If that is a
    // frame the steps before s still use, the eviction must wait until they ran: the floor.
    PrefetchLimit limit{s, 0};
    for (uint64_t before = client.current_step; before < s; ++before) {
      for (const PageRange& range : client.schedule[before].ranges) {
        Result<FrameSpan> span = check_range(client, range);
        if (!span.ok()) continue;
        const Space& space = *span.value().space;
        for (uint32_t g = span.value().first; g < span.value().end; ++g) {
          if (space.frames[g].gpu != kNoFrame) limit.floor = std::max(limit.floor, next_use_from(space, g, s));
        }
      }
    }
    for (const PageRange& range : client.schedule[s].ranges) {
      Result<FrameSpan> span = check_range(client, range);
      if (!span.ok()) continue;
      Space& space = *span.value().space;
      for (uint32_t g = span.value().first; g < span.value().end && !full; ++g) {
        SpaceFrame& frame = space.frames[g];
        if (frame.gpu != kNoFrame || !frame.host_valid || frame.host_pins != 0) continue;
        Result<std::optional<FenceWait>> placement = place_gpu(client, builder, space, g, &limit);
        if (!placement.ok() || placement.value().has_value()) {
          full = true;
          break;
        }
        placed.push_back({&space, g});
      }
      if (full) break;
    }
  }
  for (const Wanted& wanted : placed) {
    SpaceFrame& frame = wanted.space->frames[wanted.frame];
    add_copy(builder, *wanted.space, wanted.frame, Tier::kHost, frame.host, Tier::kGpu, frame.gpu);
    change(client, *wanted.space, wanted.frame, [](SpaceFrame& f) { f.dirty = false; });
    frame.prefetched = true;
    frame.key.last_use = ++client.clock;
    eviction_insert(client, *wanted.space, wanted.frame);
  }
  (void)finish_builder(builder);
}

}  // namespace membar::runtimed
