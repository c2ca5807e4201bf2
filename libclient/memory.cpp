// Note [Maps off the caller's thread]
// Rationale: placing a page in a GPU frame at a new position costs the client a cuMemMap +
// cuMemSetAccess (~30 us) and usually a cuMemUnmap (~18 us). A chunk-recurrent trainer streaming
// its history with offload places ~67,000 frames per 7B step at 64K (session 15 on the H200: 5.2 s
// of a 16.8 s step in the trainer's thread, which then fell behind the GPU), nearly all of them
// ahead of use by the runtime's lookahead. Those maps need not run on the trainer's thread, nor
// before the call that caused them returns: a page must be mapped only before a call hands it out.
// Approach: ClientMemory applies the runtime's frame events (grants, revokes, maps, unmaps) in
// order on a mapping thread of its own. Each event gets a sequence number when given; each space
// position remembers the number of its last map or unmap. A call that hands out pages
// (acquire, acquire_ranges, acquire_host) waits, before it returns, only until the events of its
// pages' positions are applied (settle_ranges); the lookahead's maps for later accesses go on
// while the trainer launches its kernels. Every other call that may have placed pages waits for
// all events (settle), and removing a space waits first, so no event outlives its space. Maps of
// adjacent positions given together are applied as one run (one cuMemSetAccess for the run).
// Unmaps applied late are safe: the runtime unmaps a position only once nothing may read it, and
// hands a position out again only after a new map event for it (which the call then waits for).
// MEMBAR_ASYNC_MAPS=1 turns it on; by default every event is applied on the thread that delivers
// it. Measured on the H200 (session 16, 7B dense-offload): no gain, 16.8 s at 64K and 47.8 s at
// 128K with the mapping thread against 16.8 s and 47.6 s without: the trainer's calls still waited
// for most maps (3.9 of 5.5 s at 64K: the lookahead maps only one or two accesses ahead), handing
// copies to the backend took longer while the mapping thread ran (1.9 -> 3.4 s, driver calls of
// two threads), and adjacent positions were almost never mapped together (71,135 runs for
// ~68,000 maps). Fewer maps, not moving them, is what the step needs (Note [Eviction order]).
// Limitations: a caller that reads a page it has not acquired (after prefetch, say) must call
// something that settles first; the mapping thread holds the memory lock while it maps, so
// space_view() may wait behind one map.
//
// Note [Maps in runs]
// Rationale: on the GPU tier a map is cuMemMap + cuMemSetAccess (~41 us on an idle H200, most of it
// the access change) and a remap first unmaps (~26 us): 215K frame placements took 19.4 s of the
// trainer's thread in a 48 s 7B dense-offload step at 128K (session 19), a map call for every
// single frame, because the runtime's events for a placement come as "unmap position g, map frame
// F at g", one placement after the other, and were applied as they came. The lookahead's
// placements are for pages a later call hands out, and a block's are adjacent positions.
// Approach: a synchronous ClientMemory in deferred mode keeps the events it is given and applies
// them when a call settles (before it hands pages out, or the settle of any other call that may
// have placed pages), in order, except within a stretch of maps and unmaps: there the unmaps go
// first, then the maps sorted by (tier, space, position), adjacent positions as one run (one
// cuMemSetAccess for the run). A stretch ends at any other event (grant, revoke) and before an
// unmap of a position the stretch mapped, so every position ends as the events say (a later map of
// the same position stays later: the sort is stable). Unmaps applied late or early within a
// stretch are safe for the same reason as on the mapping thread: the runtime unmaps a position only
// once nothing may read it, and hands a position out only after a map event for it, which the
// handing call applies before it returns. MEMBAR_DEFER_MAPS=1 turns it on.
// Measured on the H200 (session 19, 7B dense-offload at 128K, one run each): 14,256 runs for
// 219,712 maps instead of 230,339, map time 15.96 against 16.34 s, step 47.9 against 47.5 s: the
// map and unmap calls themselves are the cost, and the step did not gain (its sign was against),
// so it is off by default.
// Limitations: a caller reading a page it has not acquired must settle first (as with the mapping
// thread); a grant's descriptor stays open until the next settle.
#include "memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

#include "membar/common/fd.h"

namespace membar {
namespace {

std::string errno_text() { return std::strerror(errno); }

class MmapMapper final : public FrameMapper {
 public:
  Result<char*> reserve(uint64_t bytes) override {
    void* at = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (at == MAP_FAILED) return resource_exhausted("reserving " + std::to_string(bytes) + " bytes failed: " + errno_text());
    return static_cast<char*>(at);
  }
  void release(char* base, uint64_t bytes) override { ::munmap(base, bytes); }

  Status adopt_frame(uint32_t window_frame, int fd) override {
    frames_[window_frame] = Source{std::make_shared<UniqueFd>(fd), 0};
    return Status::Ok();
  }
  Status adopt_slab(uint32_t slab, uint32_t slab_frames, uint32_t frames, int fd) override {
    auto shared = std::make_shared<UniqueFd>(fd);
    for (uint32_t i = 0; i < frames; ++i) frames_[slab * slab_frames + i] = Source{shared, uint64_t(i) * kFrameBytes};
    slab_frames_ = slab_frames;
    return Status::Ok();
  }
  void drop_frame(uint32_t window_frame) override { frames_.erase(window_frame); }
  void drop_slab(uint32_t slab) override {
    for (auto it = frames_.lower_bound(slab * slab_frames_); it != frames_.end() && it->first < (slab + 1) * slab_frames_;) {
      it = frames_.erase(it);
    }
  }
  Status map(uint32_t window_frame, char* at) override {
    auto it = frames_.find(window_frame);
    if (it == frames_.end()) return internal_error("the runtime mapped frame " + std::to_string(window_frame) + ", which it never granted");
    void* mapped = ::mmap(at, kFrameBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, it->second.fd->get(),
                          static_cast<off_t>(it->second.offset));
    if (mapped == MAP_FAILED) return internal_error("mapping frame " + std::to_string(window_frame) + " failed: " + errno_text());
    return Status::Ok();
  }
  Status unmap(char* at) override {
    void* mapped = ::mmap(at, kFrameBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (mapped == MAP_FAILED) return internal_error("unmapping a frame failed: " + errno_text());
    return Status::Ok();
  }

 private:
  struct Source {
    std::shared_ptr<UniqueFd> fd;
    uint64_t offset = 0;
  };
  std::map<uint32_t, Source> frames_;
  uint32_t slab_frames_ = 1;
};

}  // namespace

std::unique_ptr<FrameMapper> make_mmap_mapper() { return std::make_unique<MmapMapper>(); }

Status FrameMapper::map_run(const uint32_t* window_frames, size_t count, char* at) {
  for (size_t i = 0; i < count; ++i) {
    Status mapped = map(window_frames[i], at + i * kFrameBytes);
    if (!mapped.ok()) {
      for (size_t j = 0; j < i; ++j) (void)unmap(at + j * kFrameBytes);
      return mapped;
    }
  }
  return Status::Ok();
}

bool async_maps_from_env() {
  const char* env = std::getenv("MEMBAR_ASYNC_MAPS");
  return env != nullptr && std::string(env) == "1";
}

bool deferred_maps_from_env() {
  const char* env = std::getenv("MEMBAR_DEFER_MAPS");
  return env != nullptr && std::string(env) == "1";
}

namespace {
uint64_t nanoseconds_since(std::chrono::steady_clock::time_point start) {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
}
}  // namespace

ClientMemory::ClientMemory(std::unique_ptr<FrameMapper> gpu, std::unique_ptr<FrameMapper> host, uint32_t host_slab_frames,
                           bool asynchronous, bool deferred)
    : host_slab_frames_(host_slab_frames == 0 ? 1 : host_slab_frames),
      asynchronous_(asynchronous),
      deferred_(deferred && !asynchronous) {
  mappers_[0] = std::move(gpu);
  mappers_[1] = std::move(host);
  counters_.asynchronous = asynchronous;
  if (asynchronous_) mapper_ = std::thread([this] { run_mapper(); });
}

ClientMemory::~ClientMemory() {
  if (deferred_) flush_pending();   // grants' descriptors are adopted, then dropped below
  if (mapper_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      stopping_ = true;
    }
    queued_.notify_all();
    mapper_.join();   // applies what is queued first (grants' descriptors are adopted, then dropped)
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (int t = 0; t < 2; ++t) {
    std::vector<Position> left;
    for (auto& [position, frame] : positions_[t]) left.push_back(position);
    for (const Position& position : left) (void)unmap_locked(t, position);
  }
  for (auto& [id, entry] : spaces_) {
    for (int t = 0; t < 2; ++t) mappers_[t]->release(entry.base[t], entry.reserved);
  }
}

Status ClientMemory::add_space(SpaceId space, uint64_t page_bytes, uint32_t page_count) {
  std::lock_guard<std::mutex> lock(mutex_);
  SpaceEntry entry;
  entry.page_bytes = page_bytes;
  entry.page_count = page_count;
  uint64_t bytes = page_bytes * uint64_t(page_count);
  entry.reserved = (bytes + kFrameBytes - 1) / kFrameBytes * kFrameBytes;
  for (int t = 0; t < 2; ++t) {
    Result<char*> base = mappers_[t]->reserve(entry.reserved);
    if (!base.ok()) {
      if (t == 1) mappers_[0]->release(entry.base[0], entry.reserved);
      return base.status();
    }
    entry.base[t] = base.value();
  }
  spaces_[space] = entry;
  std::lock_guard<std::mutex> queue_lock(queue_mutex_);
  page_bytes_[space] = page_bytes;
  return Status::Ok();
}

Status ClientMemory::remove_space(SpaceId space) {
  if (deferred_) flush_pending();
  wait_all_applied();   // none of the events given so far may reach a space that is gone
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = spaces_.find(space);
  if (it == spaces_.end()) return Status::Ok();
  Status status = Status::Ok();
  for (int t = 0; t < 2; ++t) {
    // The runtime unmapped every position before the space went; whatever is left goes now.
    std::vector<Position> left;
    for (auto p = positions_[t].lower_bound({space, 0}); p != positions_[t].end() && p->first.first == space; ++p) {
      left.push_back(p->first);
    }
    for (const Position& position : left) {
      Status unmapped = unmap_locked(t, position);
      if (status.ok()) status = unmapped;
    }
    mappers_[t]->release(it->second.base[t], it->second.reserved);
  }
  spaces_.erase(it);
  std::lock_guard<std::mutex> queue_lock(queue_mutex_);
  page_bytes_.erase(space);
  for (auto& last : last_op_) std::erase_if(last, [space](const auto& entry) { return SpaceId(entry.first >> 32) == space; });
  return status;
}

Result<SpaceView> ClientMemory::view(SpaceId space) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = spaces_.find(space);
  if (it == spaces_.end()) return not_found("this client has no space " + std::to_string(space));
  SpaceView view;
  view.id = space;
  view.gpu = it->second.base[0];
  view.host = it->second.base[1];
  view.page_bytes = it->second.page_bytes;
  view.page_count = it->second.page_count;
  view.bytes = it->second.page_bytes * uint64_t(it->second.page_count);
  return view;
}

// ---- The runtime's events (Note [Maps off the caller's thread]) ------------------------------------

Status ClientMemory::gpu_frame_granted(uint32_t window_frame, int fd) {
  return give(Op{Op::Kind::kFrameGranted, 0, window_frame, 0, fd});
}

Status ClientMemory::gpu_frame_revoked(uint32_t window_frame) {
  return give(Op{Op::Kind::kFrameRevoked, 0, window_frame});
}

Status ClientMemory::host_slab_granted(uint32_t slab, uint32_t frames, int fd) {
  return give(Op{Op::Kind::kSlabGranted, 1, slab, frames, fd});
}

Status ClientMemory::host_slab_revoked(uint32_t slab) { return give(Op{Op::Kind::kSlabRevoked, 1, slab}); }

Status ClientMemory::mapped(Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame) {
  return give(Op{Op::Kind::kMapped, tier == Tier::kGpu ? 0 : 1, window_frame, 0, -1, space, space_frame});
}

Status ClientMemory::unmapped(Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame) {
  return give(Op{Op::Kind::kUnmapped, tier == Tier::kGpu ? 0 : 1, window_frame, 0, -1, space, space_frame});
}

Status ClientMemory::give(Op op) {
  if (deferred_) {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    pending_.push_back(op);
    return Status::Ok();
  }
  if (!asynchronous_) {
    auto started = std::chrono::steady_clock::now();
    Status status = apply(op);
    std::lock_guard<std::mutex> lock(queue_mutex_);
    counters_.events_applied += 1;
    if (op.kind == Op::Kind::kMapped && status.ok()) {
      counters_.maps += 1;
      counters_.map_runs += 1;
    }
    counters_.apply_ns += nanoseconds_since(started);
    return status;
  }
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    op.sequence = ++given_;
    if (op.kind == Op::Kind::kMapped || op.kind == Op::Kind::kUnmapped) {
      last_op_[op.tier][position_key(op.space, op.space_frame)] = op.sequence;
    }
    queue_.push_back(op);
  }
  queued_.notify_one();
  return Status::Ok();
}

void ClientMemory::run_mapper() {
  std::vector<Op> batch;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(queue_mutex_);
      queued_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;   // stopping, nothing left
      batch.assign(queue_.begin(), queue_.end());
      queue_.clear();
    }
    for (size_t i = 0; i < batch.size();) {
      auto started = std::chrono::steady_clock::now();
      size_t end = i + 1;
      uint64_t maps = 0;
      if (batch[i].kind == Op::Kind::kMapped) {
        while (end < batch.size() && batch[end].kind == Op::Kind::kMapped && batch[end].tier == batch[i].tier &&
               batch[end].space == batch[i].space && batch[end].space_frame == batch[end - 1].space_frame + 1) {
          ++end;
        }
        maps = end - i;
        apply_map_run_noting_errors(&batch[i], maps);
      } else {
        Status status = apply(batch[i]);
        if (!status.ok()) note_error(status);
      }
      {
        std::lock_guard<std::mutex> lock(queue_mutex_);
        applied_through_ = batch[end - 1].sequence;
        counters_.events_applied += end - i;
        counters_.maps += maps;
        counters_.map_runs += maps > 0 ? 1 : 0;
        counters_.apply_ns += nanoseconds_since(started);
      }
      applied_.notify_all();
      i = end;
    }
  }
}

void ClientMemory::apply_map_run_noting_errors(const Op* ops, size_t count) {
  Status status = apply_map_run(ops, count);
  if (status.ok()) return;
  if (count == 1) return note_error(status);
  // One by one after a failed run: the error names the frame, and the others are mapped.
  for (size_t j = 0; j < count; ++j) {
    Status one = apply_map_run(&ops[j], 1);
    if (!one.ok()) note_error(one);
  }
}

void ClientMemory::flush_pending() {
  std::lock_guard<std::mutex> flushing(flush_mutex_);
  std::vector<Op> ops;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    ops.swap(pending_);
  }
  if (ops.empty()) return;
  auto started = std::chrono::steady_clock::now();
  uint64_t maps = 0;
  uint64_t runs = 0;
  apply_in_runs(ops, &maps, &runs);
  std::lock_guard<std::mutex> lock(queue_mutex_);
  counters_.events_applied += ops.size();
  counters_.maps += maps;
  counters_.map_runs += runs;
  counters_.apply_ns += nanoseconds_since(started);
}

void ClientMemory::apply_in_runs(std::vector<Op>& ops, uint64_t* maps, uint64_t* runs) {
  auto map_event = [](const Op& op) { return op.kind == Op::Kind::kMapped || op.kind == Op::Kind::kUnmapped; };
  std::vector<Op> stretch_maps;
  std::unordered_set<uint64_t> mapped_here[2];
  for (size_t i = 0; i < ops.size();) {
    if (!map_event(ops[i])) {
      Status status = apply(ops[i]);
      if (!status.ok()) note_error(status);
      ++i;
      continue;
    }
    // The stretch [i, end): maps and unmaps, up to another event or an unmap of a position it mapped.
    size_t end = i;
    stretch_maps.clear();
    mapped_here[0].clear();
    mapped_here[1].clear();
    for (; end < ops.size() && map_event(ops[end]); ++end) {
      const Op& op = ops[end];
      uint64_t key = position_key(op.space, op.space_frame);
      int t = op.tier == 0 ? 0 : 1;
      if (op.kind == Op::Kind::kUnmapped) {
        if (mapped_here[t].count(key) != 0) break;
        continue;
      }
      mapped_here[t].insert(key);
      stretch_maps.push_back(op);
    }
    for (size_t k = i; k < end; ++k) {
      if (ops[k].kind != Op::Kind::kUnmapped) continue;
      Status status = apply(ops[k]);
      if (!status.ok()) note_error(status);
    }
    std::stable_sort(stretch_maps.begin(), stretch_maps.end(), [](const Op& a, const Op& b) {
      return std::tie(a.tier, a.space, a.space_frame) < std::tie(b.tier, b.space, b.space_frame);
    });
    for (size_t k = 0; k < stretch_maps.size();) {
      size_t run_end = k + 1;
      while (run_end < stretch_maps.size() && stretch_maps[run_end].tier == stretch_maps[k].tier &&
             stretch_maps[run_end].space == stretch_maps[k].space &&
             stretch_maps[run_end].space_frame == stretch_maps[run_end - 1].space_frame + 1) {
        ++run_end;
      }
      size_t count = run_end - k;
      apply_map_run_noting_errors(&stretch_maps[k], count);
      *maps += count;
      *runs += 1;
      k = run_end;
    }
    i = end;
  }
}

void ClientMemory::wait_applied(uint64_t sequence) {
  std::unique_lock<std::mutex> lock(queue_mutex_);
  if (applied_through_ >= sequence) return;
  auto started = std::chrono::steady_clock::now();
  applied_.wait(lock, [&] { return applied_through_ >= sequence; });
  counters_.wait_ns += nanoseconds_since(started);
}

void ClientMemory::wait_all_applied() {
  uint64_t through = 0;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    through = given_;
  }
  wait_applied(through);
}

Status ClientMemory::settle() {
  if (deferred_) flush_pending();
  wait_all_applied();
  return take_error();
}

Status ClientMemory::settle_ranges(const PageRange* ranges, size_t count) {
  if (deferred_) {
    flush_pending();
    return take_error();
  }
  uint64_t needed = 0;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    if (applied_through_ < given_) {
      for (size_t r = 0; r < count; ++r) {
        const PageRange& range = ranges[r];
        auto bytes = page_bytes_.find(range.space);
        if (bytes == page_bytes_.end() || range.page_count == 0) continue;
        uint64_t first = uint64_t(range.first_page) * bytes->second / kFrameBytes;
        uint64_t end = ((uint64_t(range.first_page) + range.page_count) * bytes->second + kFrameBytes - 1) / kFrameBytes;
        for (const auto& last : last_op_) {
          for (uint64_t f = first; f < end; ++f) {
            auto op = last.find(position_key(range.space, uint32_t(f)));
            if (op != last.end()) needed = std::max(needed, op->second);
          }
        }
      }
    }
  }
  wait_applied(needed);
  return take_error();
}

MapCounters ClientMemory::counters() const {
  std::lock_guard<std::mutex> lock(queue_mutex_);
  return counters_;
}

Status ClientMemory::apply(const Op& op) {
  switch (op.kind) {
    case Op::Kind::kFrameGranted: return apply_frame_granted(op.window_frame, op.fd);
    case Op::Kind::kFrameRevoked: return apply_frame_revoked(op.window_frame);
    case Op::Kind::kSlabGranted: return apply_slab_granted(op.window_frame, op.frames, op.fd);
    case Op::Kind::kSlabRevoked: return apply_slab_revoked(op.window_frame);
    case Op::Kind::kMapped: return apply_map_run(&op, 1);
    case Op::Kind::kUnmapped: return apply_unmapped(op.tier, op.space, op.space_frame);
  }
  return internal_error("unknown frame event");
}

// Maps ops[0, count): adjacent positions of one space and tier, as one run (count may be 1).
Status ClientMemory::apply_map_run(const Op* ops, size_t count) {
  std::lock_guard<std::mutex> lock(mutex_);
  int t = ops[0].tier;
  SpaceId space = ops[0].space;
  auto it = spaces_.find(space);
  if (it == spaces_.end()) return internal_error("the runtime mapped a frame in space " + std::to_string(space) + ", which this client does not know");
  if (uint64_t(ops[count - 1].space_frame + 1) * kFrameBytes > it->second.reserved) {
    return internal_error("the runtime mapped a frame past the end of space " + std::to_string(space));
  }
  std::vector<uint32_t> frames;
  for (size_t i = 0; i < count; ++i) {
    Position position{space, ops[i].space_frame};
    if (positions_[t].count(position) != 0) MEMBAR_RETURN_IF_ERROR(unmap_locked(t, position));
    frames.push_back(ops[i].window_frame);
  }
  char* at = it->second.base[t] + uint64_t(ops[0].space_frame) * kFrameBytes;
  MEMBAR_RETURN_IF_ERROR(count == 1 ? mappers_[t]->map(frames[0], at) : mappers_[t]->map_run(frames.data(), count, at));
  for (size_t i = 0; i < count; ++i) {
    Position position{space, ops[i].space_frame};
    positions_[t][position] = ops[i].window_frame;
    frame_positions_[t][ops[i].window_frame].insert(position);
  }
  return Status::Ok();
}

Status ClientMemory::apply_frame_granted(uint32_t window_frame, int fd) {
  std::lock_guard<std::mutex> lock(mutex_);
  return mappers_[0]->adopt_frame(window_frame, fd);
}

Status ClientMemory::apply_frame_revoked(uint32_t window_frame) {
  std::lock_guard<std::mutex> lock(mutex_);
  Status status = Status::Ok();
  auto it = frame_positions_[0].find(window_frame);
  if (it != frame_positions_[0].end()) {
    std::set<Position> positions = it->second;
    for (const Position& position : positions) {
      Status unmapped = unmap_locked(0, position);
      if (status.ok()) status = unmapped;
    }
  }
  mappers_[0]->drop_frame(window_frame);
  return status;
}

Status ClientMemory::apply_slab_granted(uint32_t slab, uint32_t frames, int fd) {
  std::lock_guard<std::mutex> lock(mutex_);
  return mappers_[1]->adopt_slab(slab, host_slab_frames_, frames, fd);
}

Status ClientMemory::apply_slab_revoked(uint32_t slab) {
  std::lock_guard<std::mutex> lock(mutex_);
  Status status = Status::Ok();
  for (uint32_t w = slab * host_slab_frames_; w < (slab + 1) * host_slab_frames_; ++w) {
    auto it = frame_positions_[1].find(w);
    if (it == frame_positions_[1].end()) continue;
    std::set<Position> positions = it->second;
    for (const Position& position : positions) {
      Status unmapped = unmap_locked(1, position);
      if (status.ok()) status = unmapped;
    }
  }
  mappers_[1]->drop_slab(slab);
  return status;
}

Status ClientMemory::apply_unmapped(int t, SpaceId space, uint32_t space_frame) {
  std::lock_guard<std::mutex> lock(mutex_);
  return unmap_locked(t, Position{space, space_frame});
}

Status ClientMemory::unmap_locked(int t, const Position& position) {
  auto it = positions_[t].find(position);
  if (it == positions_[t].end()) return Status::Ok();
  uint32_t window_frame = it->second;
  positions_[t].erase(it);
  auto frames = frame_positions_[t].find(window_frame);
  if (frames != frame_positions_[t].end()) {
    frames->second.erase(position);
    if (frames->second.empty()) frame_positions_[t].erase(frames);
  }
  auto space = spaces_.find(position.first);
  if (space == spaces_.end()) return Status::Ok();
  return mappers_[t]->unmap(space->second.base[t] + uint64_t(position.second) * kFrameBytes);
}

void ClientMemory::note_error(const Status& status) {
  std::lock_guard<std::mutex> lock(error_mutex_);
  if (error_.ok()) error_ = status;
}

Status ClientMemory::take_error() {
  std::lock_guard<std::mutex> lock(error_mutex_);
  return std::exchange(error_, Status::Ok());
}

}  // namespace membar
