// copy_pages: the contents of pages copied into other pages of the same client.
//
// Note [Copied pages]
// Rationale: a trainer streaming a long history through a small GPU budget reads every history
// block once per later chunk. Brought in as pages of their own space, each block's frames must be
// placed on the GPU and mapped at the block's position in the client's window: at 128K tokens of a
// 7B model ~220K placements a step, ~16 s of the trainer's thread in cuMemMap and cuMemUnmap alone
// (measured on the H200, session 19), while the bytes moved need ~13 s of PCIe that overlaps the
// compute anyway. Moving bytes instead of frames needs no map at all: the trainer keeps a few
// GPU-resident pages of a staging space acquired (mapped once) and asks the runtime to copy each
// block's pages into them, and back out for the pages it accumulates into (dK/dV).
// Approach: copy_pages takes pairs of ranges (source pages, as many destination pages of a space
// with the same page size). Sources keep their residency: each source frame is read where its
// newest contents are (its GPU frame when resident, else its host frame; a frame with no contents
// and freed pages read as zeros), so a history that lives in host memory stays there. Each
// destination frame is written where it lives (its GPU frame when resident, else its host frame,
// taken when it has none); a destination frame that had no contents is zero-filled outside the
// bytes this call writes, and becomes dirty (GPU) or host-valid (host). Copies are cut at frame
// boundaries of both sides (pages of any size, any alignment), so a 2 MiB-aligned block is one
// copy per frame. All operations of one call write disjoint bytes (overlapping ranges are
// refused), so they share batches even where they touch the same frame, and they depend, like
// every copy, on the unfinished batches that last touched their frames (Note [Batches and tickets])
// and on the release markers of the GPU frames they touch. `after_marker` adds the caller's own
// stream marker: the copies run once the stream has passed it (Note [Stream-ordered release]), so
// a staging page is overwritten only after the kernels that read it are done, without the
// trainer's CPU waiting for them (on the device with device-ordered copies, Note
// [Device-ordered copies]; held by the daemon until it sees the word otherwise).
// Limitations: copies between two tiers of one client only (a client never names another's pages);
// pages acquired for host access are refused on either side; the host tier moves no faster than
// before (this removes placements and maps, not bytes). Pages copied into a host-only destination
// count as host bytes of that space; GPU-to-GPU and host-to-host copies are not counted as traffic.
#include <algorithm>
#include <map>

#include "engine_impl.h"

namespace membar::runtimed {

namespace {

constexpr size_t kMaxCopyPairs = 2048;

struct Interval {
  uint64_t from = 0;
  uint64_t to = 0;
  size_t range = 0;   // index into the call's ranges, for messages
};

std::string range_text(const PageRange& range) {
  return "pages [" + std::to_string(range.first_page) + ", " +
         std::to_string(uint64_t(range.first_page) + range.page_count) + ") of space " + std::to_string(range.space);
}

}  // namespace

Result<Ticket> EngineImpl::copy_pages(ClientId id, const std::vector<PageRange>& pairs,
                                      std::optional<uint64_t> after_marker) {
  if (pairs.empty()) return invalid_argument("copy_pages: no pages named");
  if (pairs.size() % 2 != 0) {
    return invalid_argument("copy_pages: ranges come in (source, destination) pairs; got " +
                            std::to_string(pairs.size()) + " ranges");
  }
  if (pairs.size() / 2 > kMaxCopyPairs) {
    return invalid_argument("copy_pages: " + std::to_string(pairs.size() / 2) + " pairs in one call; at most " +
                            std::to_string(kMaxCopyPairs));
  }
  if (after_marker == 0u) return invalid_argument("copy_pages: the release marker must be at least 1");
  return with_client<Result<Ticket>>(id, [&](ClientState& client) -> Result<Ticket> {
    // ---- Checks: nothing changes before every pair passes. ---------------------------------------
    std::vector<FrameSpan> spans;
    spans.reserve(pairs.size());
    for (const PageRange& range : pairs) {
      MEMBAR_ASSIGN_OR_RETURN(FrameSpan span, check_range(client, range));
      spans.push_back(span);
    }
    // Byte intervals per space: sources may overlap each other (read twice), destinations may
    // overlap nothing of this call.
    std::map<SpaceId, std::vector<Interval>> written, read;
    for (size_t i = 0; i < pairs.size(); i += 2) {
      const Space& source = *spans[i].space;
      const Space& destination = *spans[i + 1].space;
      if (pairs[i].page_count != pairs[i + 1].page_count) {
        return invalid_argument("copy_pages: " + range_text(pairs[i]) + " and " + range_text(pairs[i + 1]) +
                                " name different numbers of pages");
      }
      if (source.info.page_bytes != destination.info.page_bytes) {
        return invalid_argument("copy_pages: space '" + source.info.name + "' has pages of " +
                                std::to_string(source.info.page_bytes) + " bytes, space '" + destination.info.name +
                                "' of " + std::to_string(destination.info.page_bytes) + "; pages are copied whole");
      }
      for (size_t side : {i, i + 1}) {
        const Space& space = *spans[side].space;
        uint64_t pb = space.info.page_bytes;
        Interval interval{uint64_t(pairs[side].first_page) * pb,
                          (uint64_t(pairs[side].first_page) + pairs[side].page_count) * pb, side};
        (side == i ? read : written)[space.info.id].push_back(interval);
        for (uint32_t g = spans[side].first; g < spans[side].end; ++g) {
          if (space.frames[g].host_pins != 0) {
            return failed_precondition("copy_pages: " + frame_text(space, g) +
                                       " are acquired for host access; release_host them first");
          }
        }
      }
    }
    for (auto& [space_id, intervals] : written) {
      std::sort(intervals.begin(), intervals.end(), [](const Interval& a, const Interval& b) { return a.from < b.from; });
      for (size_t k = 1; k < intervals.size(); ++k) {
        if (intervals[k].from < intervals[k - 1].to) {
          return invalid_argument("copy_pages: destinations " + range_text(pairs[intervals[k - 1].range]) + " and " +
                                  range_text(pairs[intervals[k].range]) + " overlap");
        }
      }
      auto sources = read.find(space_id);
      if (sources == read.end()) continue;
      for (const Interval& source : sources->second) {
        auto after = std::upper_bound(intervals.begin(), intervals.end(), source.from,
                                      [](uint64_t value, const Interval& b) { return value < b.from; });
        bool overlaps = after != intervals.end() && after->from < source.to;
        if (after != intervals.begin() && std::prev(after)->to > source.from) overlaps = true;
        if (overlaps) {
          return invalid_argument("copy_pages: source " + range_text(pairs[source.range]) +
                                  " overlaps a destination of the same call");
        }
      }
    }

    // ---- Destination frames: each written where it lives (a host frame taken when it has none). --
    struct Target {
      Tier tier = Tier::kHost;
      FrameIndex frame = kNoFrame;
      bool had_contents = true;
      std::vector<std::pair<uint64_t, uint64_t>> covered;   // bytes of the frame this call writes
    };
    std::map<std::pair<SpaceId, uint32_t>, Target> targets;
    std::vector<std::pair<Space*, uint32_t>> taken;
    for (size_t i = 1; i < pairs.size(); i += 2) {
      Space& space = *spans[i].space;
      for (uint32_t g = spans[i].first; g < spans[i].end; ++g) {
        auto key = std::make_pair(space.info.id, g);
        if (targets.count(key) != 0) continue;
        SpaceFrame& frame = space.frames[g];
        Target target;
        if (frame.gpu != kNoFrame) {
          target.tier = Tier::kGpu;
          target.frame = frame.gpu;
          target.had_contents = frame.dirty || frame.host_valid || frame.write_intent;
        } else {
          if (frame.host == kNoFrame) {
            Result<FrameIndex> host = take_host_frame(client, space, g);
            if (!host.ok()) {
              for (auto [owner, q] : taken) clear_host(client, *owner, q);
              return host.status();
            }
            taken.emplace_back(&space, g);
          }
          target.tier = Tier::kHost;
          target.frame = frame.host;
          target.had_contents = frame.host_valid;
        }
        targets.emplace(key, std::move(target));
      }
    }

    // ---- Copies, cut at the frame boundaries of both sides. ----------------------------------------
    Builder builder = start_builder(client);
    auto join = [&](std::initializer_list<std::pair<Tier, FrameIndex>> frames) {
      prepare(builder, frames, /*split_on_reuse=*/false);
      if (after_marker.has_value() && !fence_met(client, *after_marker)) {
        Batch& batch = batches_.at(builder.current);
        batch.fence = std::max(batch.fence, *after_marker);
      }
    };
    for (size_t i = 0; i < pairs.size(); i += 2) {
      Space& source = *spans[i].space;
      Space& destination = *spans[i + 1].space;
      uint64_t pb = source.info.page_bytes;
      uint64_t from = uint64_t(pairs[i].first_page) * pb;
      uint64_t to = uint64_t(pairs[i + 1].first_page) * pb;
      uint64_t left = uint64_t(pairs[i].page_count) * pb;
      while (left > 0) {
        uint32_t sg = uint32_t(from / kFrameBytes);
        uint32_t dg = uint32_t(to / kFrameBytes);
        uint64_t soff = from % kFrameBytes;
        uint64_t doff = to % kFrameBytes;
        uint64_t bytes = std::min({left, kFrameBytes - soff, kFrameBytes - doff});
        // Freed source pages read as zeros: cut this piece at page boundaries when its frame has any.
        if (!source.freed_in_frame.empty() && source.freed_in_frame[sg] != 0) {
          uint64_t page_end = (from / pb + 1) * pb;
          bytes = std::min(bytes, page_end - from);
        }
        Target& target = targets.at({destination.info.id, dg});
        target.covered.emplace_back(doff, doff + bytes);
        const SpaceFrame& read_from = source.frames[sg];
        bool freed = !source.freed_in_frame.empty() && source.freed_in_frame[sg] != 0 &&
                     source.page_freed(uint32_t(from / pb));
        bool on_gpu = read_from.gpu != kNoFrame &&
                      (read_from.dirty || read_from.host_valid || read_from.write_intent);
        bool on_host = read_from.gpu == kNoFrame && read_from.host_valid;
        if (freed || (!on_gpu && !on_host)) {
          join({{target.tier, target.frame}});
          batches_.at(builder.current).zeros.push_back(Batch::Zero{target.tier, target.frame, doff, bytes});
        } else {
          Tier tier = on_gpu ? Tier::kGpu : Tier::kHost;
          FrameIndex frame = on_gpu ? read_from.gpu : read_from.host;
          join({{tier, frame}, {target.tier, target.frame}});
          Batch& batch = batches_.at(builder.current);
          batch.copies.push_back(CopyOp{tier, frame, soff, target.tier, target.frame, doff, bytes});
          if (tier != target.tier) {
            (target.tier == Tier::kGpu ? batch.to_gpu : batch.to_host).emplace_back(destination.info.id, int64_t(bytes));
          }
        }
        from += bytes;
        to += bytes;
        left -= bytes;
      }
    }

    // ---- Destination frames that had no contents: zeros around what this call wrote. ---------------
    for (auto& [key, target] : targets) {
      Space& space = *client.spaces.at(key.first);
      uint32_t g = key.second;
      if (!target.had_contents) {
        std::sort(target.covered.begin(), target.covered.end());
        uint64_t at = 0;
        uint64_t end = space.frame_bytes(g);
        for (auto [from, to] : target.covered) {
          if (from > at) {
            join({{target.tier, target.frame}});
            batches_.at(builder.current).zeros.push_back(Batch::Zero{target.tier, target.frame, at, from - at});
          }
          at = std::max(at, to);
        }
        if (at < end) {
          join({{target.tier, target.frame}});
          batches_.at(builder.current).zeros.push_back(Batch::Zero{target.tier, target.frame, at, end - at});
        }
      }
      bool gpu = target.tier == Tier::kGpu;
      change(client, space, g, [gpu](SpaceFrame& f) {
        if (gpu) {
          f.dirty = true;   // newer than the host copy
          f.host_valid = false;
        } else {
          f.host_valid = true;
        }
      });
    }
    for (size_t i = 1; i < pairs.size(); i += 2) unfree_pages(client, builder, spans[i], std::nullopt);
    return finish_builder(builder);
  });
}

}  // namespace membar::runtimed
