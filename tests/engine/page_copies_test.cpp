// copy_pages on the host backend (Note [Copied pages] in engine/page_copies.cpp): sources keep
// their residency and are read where their newest bytes are, each destination frame is written
// where it lives, pages without contents (never written, or freed) arrive as zeros, pages of any
// size and ranges that cross frame boundaries at different offsets on the two sides, the copied
// bytes then behave as the client's own (eviction, host access, zero-fill), `after_marker`, and
// bad input refused with nothing changed. Every test copies fresh random bytes (never zero, so a
// zero read back means "no contents"), compared byte for byte.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "runtime_test_util.h"

namespace membar::runtimed {
namespace {

using membar::testing::make_engine;
using membar::testing::MappedClient;
using membar::testing::ReleasedWord;
using membar::testing::retrying;

constexpr uint64_t k64K = 64 << 10;
constexpr uint64_t k96K = 96 << 10;   // pages straddle frames: page 21 holds the first boundary
constexpr uint64_t k128K = 128 << 10;
constexpr uint64_t k2M = 2 << 20;
constexpr uint64_t kOddPage = 3000;   // page 699 holds the first frame boundary, page 1398 the second

using Bytes = std::vector<uint8_t>;


// One engine (8 GPU frames, 32 host frames; copies ordered on the host as in membard, or on the
// "device" as in an embedded client: Note [Device-ordered copies]) and one client whose frames are
// mapped at their space positions (MappedClient), with a random byte source seeded afresh for each
// test (MEMBAR_TEST_SEED replays a seed; every mismatch names it).
// Param: 0 copies ordered on the host, 1 on the device, 2 on the device and handed over by the
// dispatcher thread (Note [Hand-over on the dispatcher]).
class PageCopies : public ::testing::TestWithParam<int> {
 protected:
  static constexpr uint64_t kGpuFrames = 8;
  static constexpr uint64_t kHostFrames = 32;

  void SetUp() override {
    const char* replay = std::getenv("MEMBAR_TEST_SEED");
    seed_ = replay != nullptr ? std::strtoull(replay, nullptr, 10) : std::random_device{}();
    random_.seed(seed_);
    RecordProperty("random_seed", std::to_string(seed_));
    EngineConfig config;
    config.order_on_device = GetParam() != 0;
    config.submit_on_dispatcher = GetParam() == 2;
    engine_ = make_engine(kGpuFrames, kHostFrames, config);
    ASSERT_NE(engine_, nullptr);
    client_ = MappedClient::open(*engine_);
    ASSERT_NE(client_, nullptr);
  }

  ClientId id() const { return client_->id; }

  // `count` random bytes, none zero.
  Bytes random_bytes(uint64_t count) {
    Bytes bytes(count);
    for (uint64_t i = 0; i < count; i += 8) {
      uint64_t word = random_();
      for (uint64_t k = 0; k < 8 && i + k < count; ++k) {
        uint8_t byte = uint8_t(word >> (8 * k));
        bytes[i + k] = byte == 0 ? 0xa5 : byte;
      }
    }
    return bytes;
  }

  uint64_t page_bytes(SpaceId space) { return client_->page_bytes.at(space); }
  uint64_t bytes_of(PageRange range) { return uint64_t(range.page_count) * page_bytes(range.space); }

  // Whether `actual` holds `expected` byte for byte; otherwise where the first difference is.
  ::testing::AssertionResult same_bytes(const void* actual, const Bytes& expected, uint64_t page_bytes) {
    if (actual == nullptr) return ::testing::AssertionFailure() << "no pointer to read";
    const auto* bytes = static_cast<const uint8_t*>(actual);
    if (std::memcmp(bytes, expected.data(), expected.size()) == 0) return ::testing::AssertionSuccess();
    uint64_t first = 0, differing = 0;
    for (uint64_t i = expected.size(); i-- > 0;) {
      if (bytes[i] != expected[i]) {
        first = i;
        ++differing;
      }
    }
    return ::testing::AssertionFailure()
           << differing << " of " << expected.size() << " bytes differ, the first at byte " << first << " (page "
           << first / page_bytes << " + " << first % page_bytes << "): expected " << int(expected[first]) << ", got "
           << int(bytes[first]) << " (random seed " << seed_ << ")";
  }

  // Writes `bytes` into the range through host access (released dirty: the host holds the newest).
  ::testing::AssertionResult write_on_host(PageRange range, const Bytes& bytes) {
    char* host = client_->acquire_host(range);
    if (host == nullptr) return ::testing::AssertionFailure() << "acquire_host failed";
    std::memcpy(host, bytes.data(), bytes.size());
    Status released = engine_->release_host(id(), range, true);
    if (!released.ok()) return ::testing::AssertionFailure() << released.to_string();
    return ::testing::AssertionSuccess();
  }

  // The range's bytes read through host access (which copies GPU-newer contents out first).
  Bytes read_on_host(PageRange range) {
    Bytes bytes(bytes_of(range));
    char* host = client_->acquire_host(range);
    EXPECT_NE(host, nullptr);
    if (host == nullptr) return bytes;
    std::memcpy(bytes.data(), host, bytes.size());
    Status released = engine_->release_host(id(), range, false);
    EXPECT_TRUE(released.ok()) << released.to_string();
    return bytes;
  }

  // Acquires the range on the GPU for writing (zero-fill), writes `bytes` and keeps it acquired.
  ::testing::AssertionResult acquire_and_write(PageRange range, const Bytes& bytes) {
    char* pages = client_->acquire(range, kEngineAcquireWrite | kEngineAcquireZeroNew);
    if (pages == nullptr) return ::testing::AssertionFailure() << "acquire failed";
    std::memcpy(pages, bytes.data(), bytes.size());
    return ::testing::AssertionSuccess();
  }

  // The same, then released dirty: the GPU frames hold the newest bytes, resident but unpinned.
  ::testing::AssertionResult write_on_gpu(PageRange range, const Bytes& bytes) {
    auto written = acquire_and_write(range, bytes);
    if (!written) return written;
    Status released = engine_->release(id(), range, true);
    if (!released.ok()) return ::testing::AssertionFailure() << released.to_string();
    return ::testing::AssertionSuccess();
  }

  // Copies and waits for the ticket.
  ::testing::AssertionResult copy(const std::vector<PageRange>& pairs, std::optional<uint64_t> after_marker = {}) {
    auto ticket = retrying([&] { return engine_->copy_pages(id(), pairs, after_marker); });
    if (!ticket.ok()) return ::testing::AssertionFailure() << "copy_pages: " << ticket.status().to_string();
    Status waited = engine_->wait(id(), ticket.value());
    if (!waited.ok()) return ::testing::AssertionFailure() << "wait: " << waited.to_string();
    return ::testing::AssertionSuccess();
  }

  // The GPU-resident bytes of a space (GPU only or both tiers), and its bytes with no contents.
  uint64_t gpu_bytes(SpaceId space) { return client_->gpu_bytes(space); }
  uint64_t bytes_none(SpaceId space) { return client_->space_stats(space).bytes_none; }

  // `bytes` with the page range [first, first + replacement pages) replaced.
  static Bytes replaced(Bytes bytes, uint64_t page_bytes, uint32_t first, const Bytes& replacement) {
    std::memcpy(bytes.data() + uint64_t(first) * page_bytes, replacement.data(), replacement.size());
    return bytes;
  }
  static Bytes slice(const Bytes& bytes, uint64_t page_bytes, uint32_t first, uint32_t count) {
    return Bytes(bytes.begin() + uint64_t(first) * page_bytes, bytes.begin() + uint64_t(first + count) * page_bytes);
  }

  uint64_t seed_ = 0;
  std::mt19937_64 random_;
  std::unique_ptr<Engine> engine_;          // outlives the client, which closes itself first
  std::unique_ptr<MappedClient> client_;
};

// The trainer's read: history pages that live in host memory copied into staging pages it keeps
// acquired on the GPU. The staging pages hold the bytes once the ticket completes; the history
// stays on the host (no GPU frame placed, nothing mapped); staging bytes outside the copy stay.
TEST_P(PageCopies, HostResidentSourceIntoAcquiredGpuPagesLeavesTheSourceOnTheHost) {
  SpaceId history = client_->space("history", k96K, 48);   // 4.5 MiB: three space frames
  SpaceId stage = client_->space("stage", k96K, 32);       // 3 MiB: two space frames
  PageRange all_history{history, 0, 48}, all_stage{stage, 0, 32};
  // The history once had a GPU frame (now stale: host access wrote after it), then was offloaded.
  ASSERT_NE(client_->acquire(all_history, kEngineAcquireZeroNew), nullptr);
  ASSERT_TRUE(engine_->release(id(), all_history, false).ok());
  Bytes history_bytes = random_bytes(bytes_of(all_history));
  ASSERT_TRUE(write_on_host(all_history, history_bytes));
  ASSERT_NO_FATAL_FAILURE(client_->finish(engine_->offload(id(), all_history)));
  ASSERT_EQ(gpu_bytes(history), 0u) << "the history should live on the host only";
  Bytes stage_bytes = random_bytes(bytes_of(all_stage));
  ASSERT_TRUE(acquire_and_write(all_stage, stage_bytes));

  int maps_before = client_->maps[0].load();
  int grants_before = client_->gpu_grants.load();
  int64_t frames_before = client_->stats().gpu_frames.current;
  // Pages [15, 27) cross the frame boundary 6 1/3 pages in; pages [12, 24) of the stage 9 1/3 in.
  ASSERT_TRUE(copy({PageRange{history, 15, 12}, PageRange{stage, 12, 12}}));
  Bytes expected = replaced(stage_bytes, k96K, 12, slice(history_bytes, k96K, 15, 12));
  EXPECT_TRUE(same_bytes(client_->page(Tier::kGpu, stage, 0), expected, k96K));
  // The source stays where it was.
  EXPECT_EQ(gpu_bytes(history), 0u) << "copy_pages placed a GPU frame for a host-resident source";
  EXPECT_EQ(client_->space_stats(history).bytes_host, bytes_of(all_history));
  EXPECT_EQ(client_->maps[0].load(), maps_before) << "copy_pages mapped a GPU frame";
  EXPECT_EQ(client_->gpu_grants.load(), grants_before);
  EXPECT_EQ(client_->stats().gpu_frames.current, frames_before);
  EXPECT_TRUE(same_bytes(read_on_host(all_history).data(), history_bytes, k96K)) << "the source changed";
  ASSERT_TRUE(engine_->release(id(), all_stage, true).ok());
}

// The other way: pages resident on the GPU (dirty there, a stale copy on the host) copied into pages
// that never had contents and were never acquired: the destination frames are taken on the host
// and written there, zero outside the copied bytes; the GPU's bytes are the ones copied.
TEST_P(PageCopies, GpuResidentSourceIntoPagesThatLiveOnlyOnTheHost) {
  SpaceId block = client_->space("block", k128K, 32);   // 4 MiB: two space frames
  SpaceId saved = client_->space("saved", k128K, 40);   // 5 MiB: three space frames, the last partial
  PageRange all_block{block, 0, 32}, all_saved{saved, 0, 40};
  ASSERT_TRUE(write_on_host(all_block, random_bytes(bytes_of(all_block))));   // the stale host copy
  Bytes block_bytes = random_bytes(bytes_of(all_block));
  ASSERT_TRUE(write_on_gpu(all_block, block_bytes));
  ASSERT_EQ(gpu_bytes(block), bytes_of(all_block));
  // Block pages [10, 20) cross a frame boundary 6 pages in; saved pages [12, 22) 4 pages in.
  ASSERT_TRUE(copy({PageRange{block, 10, 10}, PageRange{saved, 12, 10}}));
  EXPECT_EQ(gpu_bytes(saved), 0u) << "a destination that lives nowhere should be written on the host";
  EXPECT_EQ(bytes_none(saved), 1ull << 20) << "only the two frames the copy wrote should hold contents";
  Bytes expected(bytes_of(all_saved), 0);
  expected = replaced(expected, k128K, 12, slice(block_bytes, k128K, 10, 10));
  EXPECT_TRUE(same_bytes(read_on_host(all_saved).data(), expected, k128K));
  EXPECT_EQ(gpu_bytes(block), bytes_of(all_block)) << "the source left the GPU";
  ASSERT_NE(client_->acquire(all_block, 0), nullptr);
  EXPECT_TRUE(same_bytes(client_->page(Tier::kGpu, block, 0), block_bytes, k128K)) << "the source changed";
  ASSERT_TRUE(engine_->release(id(), all_block, false).ok());
}

// Sources that have a GPU frame whose bytes are older than the host's (written through host access
// after the GPU copy) are read from the host.
TEST_P(PageCopies, SourcesWithAStaleGpuCopyAreReadFromTheHost) {
  SpaceId source = client_->space("source", k64K, 64);
  SpaceId target = client_->space("target", k64K, 64);
  PageRange all_source{source, 0, 64}, all_target{target, 0, 64};
  ASSERT_TRUE(write_on_gpu(all_source, random_bytes(bytes_of(all_source))));
  Bytes newer = random_bytes(bytes_of(all_source));
  ASSERT_TRUE(write_on_host(all_source, newer));
  Bytes target_bytes = random_bytes(bytes_of(all_target));
  ASSERT_TRUE(acquire_and_write(all_target, target_bytes));
  ASSERT_TRUE(copy({PageRange{source, 24, 16}, PageRange{target, 40, 16}}));
  EXPECT_TRUE(same_bytes(client_->page(Tier::kGpu, target, 0),
                         replaced(target_bytes, k64K, 40, slice(newer, k64K, 24, 16)), k64K));
  ASSERT_TRUE(engine_->release(id(), all_target, true).ok());
}

// The trainer's accumulation: history pages copied into an acquired stage, changed there by a
// "kernel", copied back. The history (host only throughout) holds the changed bytes; its other
// pages, in the same frames, keep theirs.
TEST_P(PageCopies, AWriteBackRoundTripThroughAGpuStage) {
  SpaceId history = client_->space("history", k64K, 96);   // three space frames
  SpaceId stage = client_->space("stage", k64K, 32);       // one
  PageRange all_history{history, 0, 96}, all_stage{stage, 0, 32};
  Bytes history_bytes = random_bytes(bytes_of(all_history));
  ASSERT_TRUE(write_on_host(all_history, history_bytes));
  ASSERT_NO_FATAL_FAILURE(client_->finish(engine_->offload(id(), all_history)));
  ASSERT_TRUE(acquire_and_write(all_stage, random_bytes(bytes_of(all_stage))));
  char* staged = client_->page(Tier::kGpu, stage, 4);
  // Pages [28, 40) of the history cross a frame boundary; they go to pages [4, 16) of the stage.
  ASSERT_TRUE(copy({PageRange{history, 28, 12}, PageRange{stage, 4, 12}}));
  ASSERT_TRUE(same_bytes(staged, slice(history_bytes, k64K, 28, 12), k64K));
  Bytes changed = random_bytes(12 * k64K);
  std::memcpy(staged, changed.data(), changed.size());   // the "kernel" writes the stage
  ASSERT_TRUE(copy({PageRange{stage, 4, 12}, PageRange{history, 28, 12}}));
  EXPECT_EQ(gpu_bytes(history), 0u) << "the history left the host";
  EXPECT_TRUE(same_bytes(read_on_host(all_history).data(), replaced(history_bytes, k64K, 28, changed), k64K));
  ASSERT_TRUE(engine_->release(id(), all_stage, true).ok());
}

// Pages of 3000 bytes and of 96 KiB, K and V style: a history and a stage space for each, several
// pairs in one call, both sides crossing frame boundaries at different offsets, destinations on
// the GPU (acquired), on the host (never acquired) and in the source's own space.
TEST_P(PageCopies, OddPageSizesAndRangesStraddlingFramesAtDifferentOffsets) {
  SpaceId k_history = client_->space("L00.k.history", kOddPage, 2100);   // 6.3 MB: four space frames
  SpaceId k_stage = client_->space("L00.k.stage", kOddPage, 1500);       // 4.5 MB: three
  SpaceId v_history = client_->space("L00.v.history", k96K, 64);         // 6 MiB: three
  SpaceId v_stage = client_->space("L00.v.stage", k96K, 48);             // 4.5 MiB: three
  PageRange all_k_history{k_history, 0, 2100}, all_k_stage{k_stage, 0, 1500};
  PageRange all_v_history{v_history, 0, 64}, all_v_stage{v_stage, 0, 48};
  Bytes k_history_bytes = random_bytes(bytes_of(all_k_history));
  Bytes v_history_bytes = random_bytes(bytes_of(all_v_history));
  ASSERT_TRUE(write_on_host(all_k_history, k_history_bytes));
  ASSERT_TRUE(write_on_host(all_v_history, v_history_bytes));
  Bytes k_stage_bytes = random_bytes(bytes_of(all_k_stage));
  ASSERT_TRUE(acquire_and_write(all_k_stage, k_stage_bytes));   // v_stage is never acquired

  std::vector<PageRange> pairs = {
      // Source crosses at page 699 (152 bytes in), destination at page 1398 (304 bytes in).
      PageRange{k_history, 690, 20}, PageRange{k_stage, 1390, 20},
      // Source crosses at page 21 (32 KiB in), destination at page 42 (64 KiB in), on the host.
      PageRange{v_history, 18, 8}, PageRange{v_stage, 40, 8},
      // Within one space: source crosses at page 1398, destination at page 2097 (456 bytes in).
      PageRange{k_history, 1390, 19}, PageRange{k_history, 2080, 19},
      PageRange{v_history, 0, 3}, PageRange{v_history, 60, 3},
  };
  ASSERT_TRUE(copy(pairs));

  Bytes k_stage_expected = replaced(k_stage_bytes, kOddPage, 1390, slice(k_history_bytes, kOddPage, 690, 20));
  EXPECT_TRUE(same_bytes(client_->page(Tier::kGpu, k_stage, 0), k_stage_expected, kOddPage));
  Bytes v_stage_expected = replaced(Bytes(bytes_of(all_v_stage), 0), k96K, 40, slice(v_history_bytes, k96K, 18, 8));
  EXPECT_TRUE(same_bytes(read_on_host(all_v_stage).data(), v_stage_expected, k96K));
  EXPECT_EQ(gpu_bytes(v_stage), 0u);
  Bytes k_history_expected = replaced(k_history_bytes, kOddPage, 2080, slice(k_history_bytes, kOddPage, 1390, 19));
  EXPECT_TRUE(same_bytes(read_on_host(all_k_history).data(), k_history_expected, kOddPage));
  Bytes v_history_expected = replaced(v_history_bytes, k96K, 60, slice(v_history_bytes, k96K, 0, 3));
  EXPECT_TRUE(same_bytes(read_on_host(all_v_history).data(), v_history_expected, k96K));
  EXPECT_EQ(gpu_bytes(k_history), 0u);
  EXPECT_EQ(gpu_bytes(v_history), 0u);
  ASSERT_TRUE(engine_->release(id(), all_k_stage, true).ok());
}

// A destination frame without contents reads as zeros outside the copied bytes even where the frame
// under it held this client's older bytes: a GPU frame placed by an acquire without zero-fill, and
// frames the client got back from pages it freed (a client's own frames are not renewed).
TEST_P(PageCopies, DestinationFramesWithoutContentsAreZeroOutsideTheCopyOnReusedFrames) {
  SpaceId old = client_->space("old", k2M, kGpuFrames);
  ASSERT_TRUE(write_on_gpu({old, 0, uint32_t(kGpuFrames)}, random_bytes(kGpuFrames * k2M)));
  ASSERT_NO_FATAL_FAILURE(client_->finish(engine_->offload(id(), {old, 0, uint32_t(kGpuFrames)})));
  ASSERT_TRUE(engine_->free_pages(id(), {old, 0, uint32_t(kGpuFrames)}).ok());
  SpaceId source = client_->space("source", k64K, 32);
  Bytes source_bytes = random_bytes(32 * k64K);
  ASSERT_TRUE(write_on_host({source, 0, 32}, source_bytes));
  SpaceId on_gpu = client_->space("on_gpu", k64K, 64);
  SpaceId on_host = client_->space("on_host", k64K, 64);
  ASSERT_NE(client_->acquire({on_gpu, 0, 64}, /*flags=*/0), nullptr);   // no zero-fill asked for
  ASSERT_TRUE(engine_->release(id(), {on_gpu, 0, 64}, false).ok());
  ASSERT_TRUE(copy({PageRange{source, 0, 10}, PageRange{on_gpu, 28, 10}, PageRange{source, 10, 10},
                    PageRange{on_host, 40, 10}}));
  Bytes zeros(64 * k64K, 0);
  EXPECT_TRUE(same_bytes(read_on_host({on_gpu, 0, 64}).data(),
                         replaced(zeros, k64K, 28, slice(source_bytes, k64K, 0, 10)), k64K));
  EXPECT_TRUE(same_bytes(read_on_host({on_host, 0, 64}).data(),
                         replaced(zeros, k64K, 40, slice(source_bytes, k64K, 10, 10)), k64K));
}

// Whole 2 MiB pages, where every copy is one whole frame, in both directions at once.
TEST_P(PageCopies, WholeFramePagesInBothDirections) {
  SpaceId host_pages = client_->space("host", k2M, 4);
  SpaceId gpu_pages = client_->space("gpu", k2M, 4);
  Bytes host_bytes = random_bytes(4 * k2M);
  Bytes gpu_bytes_written = random_bytes(4 * k2M);
  ASSERT_TRUE(write_on_host({host_pages, 0, 4}, host_bytes));
  ASSERT_TRUE(acquire_and_write({gpu_pages, 0, 4}, gpu_bytes_written));
  ASSERT_TRUE(copy({PageRange{host_pages, 0, 2}, PageRange{gpu_pages, 2, 2}, PageRange{gpu_pages, 0, 1},
                    PageRange{host_pages, 3, 1}}));
  EXPECT_TRUE(same_bytes(client_->page(Tier::kGpu, gpu_pages, 0),
                         replaced(gpu_bytes_written, k2M, 2, slice(host_bytes, k2M, 0, 2)), k2M));
  ASSERT_TRUE(engine_->release(id(), {gpu_pages, 0, 4}, true).ok());
  EXPECT_TRUE(same_bytes(read_on_host({host_pages, 0, 4}).data(),
                         replaced(host_bytes, k2M, 3, slice(gpu_bytes_written, k2M, 0, 1)), k2M));
  EXPECT_EQ(gpu_bytes(host_pages), 0u);
}

// Pages that never had contents, and pages freed with free_pages (whole frames, and pages of a
// frame that keeps other contents, one of them straddling two frames), arrive as zeros over
// destination bytes that were something else, on the GPU and on the host. A never-written source
// gets no frame on either tier; a freed source page stays freed.
TEST_P(PageCopies, PagesWithoutContentsOrFreedArriveAsZeros) {
  SpaceId never = client_->space("never", k96K, 64);
  SpaceId freed = client_->space("freed", k96K, 64);        // page 21 straddles frames 0 and 1
  SpaceId on_gpu = client_->space("on_gpu", k96K, 64);
  SpaceId on_host = client_->space("on_host", k96K, 64);
  Bytes freed_bytes = random_bytes(64 * k96K);
  ASSERT_TRUE(write_on_gpu({freed, 0, 64}, freed_bytes));
  // Frame 2 (pages 43 .. 63, the part of page 42 in it too) goes whole: pages [42, 64) are freed.
  ASSERT_TRUE(engine_->free_pages(id(), {freed, 42, 22}).ok());
  // Pages 20 .. 22 of frames 0 and 1, which keep their other pages' contents.
  ASSERT_TRUE(engine_->free_pages(id(), {freed, 20, 3}).ok());
  Bytes gpu_before = random_bytes(64 * k96K);
  Bytes host_before = random_bytes(64 * k96K);
  ASSERT_TRUE(acquire_and_write({on_gpu, 0, 64}, gpu_before));
  ASSERT_TRUE(write_on_host({on_host, 0, 64}, host_before));

  ASSERT_TRUE(copy({
      PageRange{never, 3, 10}, PageRange{on_gpu, 5, 10},        // never written
      PageRange{freed, 18, 6}, PageRange{on_gpu, 30, 6},        // 18, 19 kept; 20 .. 22 freed; 23 kept
      PageRange{freed, 40, 10}, PageRange{on_host, 10, 10},     // 40, 41 kept; 42 .. 49 freed
      PageRange{never, 60, 4}, PageRange{on_host, 50, 4},
  }));
  Bytes zeros(64 * k96K, 0);
  Bytes gpu_expected = replaced(gpu_before, k96K, 5, slice(zeros, k96K, 0, 10));
  Bytes from_freed = slice(freed_bytes, k96K, 18, 6);
  std::memset(from_freed.data() + 2 * k96K, 0, 3 * k96K);
  gpu_expected = replaced(gpu_expected, k96K, 30, from_freed);
  EXPECT_TRUE(same_bytes(client_->page(Tier::kGpu, on_gpu, 0), gpu_expected, k96K));
  Bytes host_expected = replaced(host_before, k96K, 10, slice(freed_bytes, k96K, 40, 2));
  host_expected = replaced(host_expected, k96K, 12, slice(zeros, k96K, 0, 8));
  host_expected = replaced(host_expected, k96K, 50, slice(zeros, k96K, 0, 4));
  EXPECT_TRUE(same_bytes(read_on_host({on_host, 0, 64}).data(), host_expected, k96K));
  EXPECT_EQ(bytes_none(never), 64 * k96K) << "reading pages without contents placed a frame for them";
  EXPECT_EQ(engine_->free_pages(id(), {freed, 21, 1}).code(), StatusCode::FAILED_PRECONDITION)
      << "a copied-from freed page should stay freed (freeing it again is a double free)";
  ASSERT_TRUE(engine_->release(id(), {on_gpu, 0, 64}, true).ok());
}

// A freed page copied into (in a frame that keeps other contents) holds the copy: acquiring it with
// zero-fill keeps the copied bytes, and freeing it again is no double free.
TEST_P(PageCopies, AFreedDestinationPageHoldsTheCopy) {
  SpaceId source = client_->space("source", k64K, 32);
  SpaceId target = client_->space("target", k64K, 32);   // one frame
  Bytes source_bytes = random_bytes(32 * k64K);
  Bytes target_bytes = random_bytes(32 * k64K);
  ASSERT_TRUE(write_on_host({source, 0, 32}, source_bytes));
  ASSERT_TRUE(write_on_gpu({target, 0, 32}, target_bytes));
  ASSERT_TRUE(engine_->free_pages(id(), {target, 8, 4}).ok());
  ASSERT_TRUE(copy({PageRange{source, 0, 4}, PageRange{target, 8, 4}}));
  char* pages = client_->acquire({target, 0, 32}, kEngineAcquireZeroNew);
  ASSERT_NE(pages, nullptr);
  EXPECT_TRUE(same_bytes(pages, replaced(target_bytes, k64K, 8, slice(source_bytes, k64K, 0, 4)), k64K))
      << "zero-fill of a freed page wiped the bytes copied into it";
  ASSERT_TRUE(engine_->release(id(), {target, 0, 32}, false).ok());
  EXPECT_TRUE(engine_->free_pages(id(), {target, 8, 4}).ok()) << "the copy gave the pages contents";
}

// The copied bytes are the destination's newest wherever they went: a GPU frame written by the copy
// is written back when evicted although the client released it clean; a GPU frame written over a
// host copy makes the host copy stale; a host frame written over a GPU frame that still maps older
// bytes (idle after an offload) is what the next acquire brings in.
TEST_P(PageCopies, CopiedBytesAreTheDestinationsNewestEverywhere) {
  SpaceId source = client_->space("source", k64K, 96);
  Bytes source_bytes = random_bytes(96 * k64K);
  ASSERT_TRUE(write_on_host({source, 0, 96}, source_bytes));

  // Acquired for reading, copied into, released clean, offloaded.
  SpaceId read_only = client_->space("read_only", k64K, 32);
  Bytes read_only_bytes = random_bytes(32 * k64K);
  ASSERT_TRUE(write_on_host({read_only, 0, 32}, read_only_bytes));
  ASSERT_NE(client_->acquire({read_only, 0, 32}, 0), nullptr);
  ASSERT_TRUE(copy({PageRange{source, 0, 8}, PageRange{read_only, 10, 8}}));
  ASSERT_TRUE(engine_->release(id(), {read_only, 0, 32}, false).ok());
  ASSERT_NO_FATAL_FAILURE(client_->finish(engine_->offload(id(), {read_only, 0, 32})));
  EXPECT_TRUE(same_bytes(read_on_host({read_only, 0, 32}).data(),
                         replaced(read_only_bytes, k64K, 10, slice(source_bytes, k64K, 0, 8)), k64K))
      << "the copy into a GPU frame was dropped by the offload (not marked dirty)";

  // Resident on both tiers, unpinned: the copy goes to the GPU frame; host access must see it.
  SpaceId both = client_->space("both", k64K, 32);
  Bytes both_bytes = random_bytes(32 * k64K);
  ASSERT_TRUE(write_on_host({both, 0, 32}, both_bytes));
  ASSERT_NE(client_->acquire({both, 0, 32}, 0), nullptr);
  ASSERT_TRUE(engine_->release(id(), {both, 0, 32}, false).ok());
  ASSERT_EQ(client_->space_stats(both).bytes_both, 32 * k64K);
  ASSERT_TRUE(copy({PageRange{source, 32, 6}, PageRange{both, 20, 6}}));
  EXPECT_EQ(gpu_bytes(both), 32 * k64K) << "a GPU-resident destination left the GPU";
  EXPECT_TRUE(same_bytes(read_on_host({both, 0, 32}).data(),
                         replaced(both_bytes, k64K, 20, slice(source_bytes, k64K, 32, 6)), k64K));

  // Offloaded (host only; its GPU frame idle, still mapped with the old bytes): the copy goes to the
  // host frame, and the next acquire brings it in.
  SpaceId offloaded = client_->space("offloaded", k64K, 32);
  Bytes offloaded_bytes = random_bytes(32 * k64K);
  ASSERT_TRUE(write_on_gpu({offloaded, 0, 32}, offloaded_bytes));
  ASSERT_NO_FATAL_FAILURE(client_->finish(engine_->offload(id(), {offloaded, 0, 32})));
  ASSERT_EQ(gpu_bytes(offloaded), 0u);
  ASSERT_TRUE(copy({PageRange{source, 64, 16}, PageRange{offloaded, 0, 16}}));
  EXPECT_EQ(gpu_bytes(offloaded), 0u);
  char* pages = client_->acquire({offloaded, 0, 32}, 0);
  ASSERT_NE(pages, nullptr);
  EXPECT_TRUE(same_bytes(pages, replaced(offloaded_bytes, k64K, 0, slice(source_bytes, k64K, 64, 16)), k64K))
      << "the acquire served the GPU frame's older bytes";
  ASSERT_TRUE(engine_->release(id(), {offloaded, 0, 32}, false).ok());
}

// Note [Stream-ordered release]: with after_marker, the copies run only once the client's stream
// has passed the marker; until then the destination keeps its bytes and the ticket is not done.
TEST_P(PageCopies, CopiesAfterAMarkerWaitForTheStream) {
  ReleasedWord released(*engine_, id());
  ASSERT_NE(released.mapped, MAP_FAILED);
  SpaceId source = client_->space("source", k64K, 16);
  SpaceId stage = client_->space("stage", k64K, 16);
  SpaceId other = client_->space("other", k64K, 1);
  Bytes source_bytes = random_bytes(16 * k64K);
  Bytes stage_bytes = random_bytes(16 * k64K);
  ASSERT_TRUE(write_on_host({source, 0, 16}, source_bytes));
  ASSERT_TRUE(acquire_and_write({stage, 0, 16}, stage_bytes));
  // A "kernel" reads the stage and releases another page in stream order, marker 1.
  ASSERT_NE(client_->acquire({other, 0, 1}, kEngineAcquireZeroNew), nullptr);
  ASSERT_TRUE(engine_->release_after(id(), {other, 0, 1}, false, 1).ok());
  auto ticket = engine_->copy_pages(id(), {PageRange{source, 0, 16}, PageRange{stage, 0, 16}}, 1);
  ASSERT_TRUE(ticket.ok()) << ticket.status().to_string();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_LT(engine_->completed_ticket(id()).value(), ticket.value()) << "the copy ran before the marker";
  EXPECT_TRUE(same_bytes(client_->page(Tier::kGpu, stage, 0), stage_bytes, k64K))
      << "the stage was overwritten before the stream passed the marker";
  released.set(1);
  ASSERT_TRUE(engine_->wait(id(), ticket.value()).ok());
  EXPECT_TRUE(same_bytes(client_->page(Tier::kGpu, stage, 0), source_bytes, k64K));
  ASSERT_TRUE(engine_->release(id(), {stage, 0, 16}, true).ok());
}

// At most 2048 pairs: 2048 one-page pairs (the pages reversed) are copied, 2049 refused.
TEST_P(PageCopies, TwoThousandFortyEightPairsAndNotOneMore) {
  constexpr uint32_t kPairs = 2048;
  SpaceId source = client_->space("source", 1000, kPairs + 1);
  SpaceId target = client_->space("target", 1000, kPairs + 1);
  Bytes source_bytes = random_bytes(uint64_t(kPairs + 1) * 1000);
  ASSERT_TRUE(write_on_host({source, 0, kPairs + 1}, source_bytes));
  Bytes target_bytes = random_bytes(uint64_t(kPairs + 1) * 1000);
  ASSERT_TRUE(write_on_host({target, 0, kPairs + 1}, target_bytes));
  std::vector<PageRange> pairs;
  for (uint32_t p = 0; p <= kPairs; ++p) {
    pairs.push_back(PageRange{source, p, 1});
    pairs.push_back(PageRange{target, kPairs - p, 1});
  }
  Status refused = engine_->copy_pages(id(), pairs, std::nullopt).status();
  EXPECT_EQ(refused.code(), StatusCode::INVALID_ARGUMENT) << refused.to_string();
  EXPECT_TRUE(same_bytes(read_on_host({target, 0, kPairs + 1}).data(), target_bytes, 1000));
  pairs.resize(2 * kPairs);
  ASSERT_TRUE(copy(pairs));
  Bytes expected = target_bytes;
  for (uint32_t p = 0; p < kPairs; ++p) {
    std::memcpy(expected.data() + uint64_t(kPairs - p) * 1000, source_bytes.data() + uint64_t(p) * 1000, 1000);
  }
  EXPECT_TRUE(same_bytes(read_on_host({target, 0, kPairs + 1}).data(), expected, 1000));
}

// Across the pairs of one call, sources may overlap (pages read twice: one block into two stages),
// but a destination may overlap no other destination and no source of the call (Note [Copied
// pages]: the operations of one call write disjoint bytes and run in any order).
TEST_P(PageCopies, OneCallReadsPagesTwiceButWritesEachByteOnce) {
  SpaceId history = client_->space("history", kOddPage, 1500);
  SpaceId stage = client_->space("stage", kOddPage, 1500);
  Bytes history_bytes = random_bytes(1500 * kOddPage);
  Bytes stage_bytes = random_bytes(1500 * kOddPage);
  ASSERT_TRUE(write_on_host({history, 0, 1500}, history_bytes));
  ASSERT_TRUE(acquire_and_write({stage, 0, 1500}, stage_bytes));
  EXPECT_EQ(engine_->copy_pages(id(), {PageRange{history, 0, 10}, PageRange{stage, 0, 10}, PageRange{history, 20, 10},
                                       PageRange{stage, 5, 10}},
                                std::nullopt)
                .status()
                .code(),
            StatusCode::INVALID_ARGUMENT)
      << "two destinations overlap";
  EXPECT_EQ(engine_->copy_pages(id(), {PageRange{history, 0, 10}, PageRange{history, 100, 10},
                                       PageRange{history, 105, 10}, PageRange{stage, 0, 10}},
                                std::nullopt)
                .status()
                .code(),
            StatusCode::INVALID_ARGUMENT)
      << "a destination overlaps the source of another pair";
  EXPECT_TRUE(same_bytes(client_->page(Tier::kGpu, stage, 0), stage_bytes, kOddPage));
  // Pages [695, 705) cross the first frame boundary; both stages read them.
  ASSERT_TRUE(copy({PageRange{history, 695, 10}, PageRange{stage, 0, 10}, PageRange{history, 698, 4},
                    PageRange{stage, 1396, 4}}));
  Bytes expected = replaced(stage_bytes, kOddPage, 0, slice(history_bytes, kOddPage, 695, 10));
  expected = replaced(expected, kOddPage, 1396, slice(history_bytes, kOddPage, 698, 4));
  EXPECT_TRUE(same_bytes(client_->page(Tier::kGpu, stage, 0), expected, kOddPage));
  ASSERT_TRUE(engine_->release(id(), {stage, 0, 1500}, true).ok());
}

// Every bad call is refused before anything moves: the destinations keep their bytes, on the GPU
// and on the host, even where a good pair came before the bad one.
TEST_P(PageCopies, BadInputIsRefusedAndChangesNothing) {
  SpaceId source = client_->space("source", k64K, 64);
  SpaceId target = client_->space("target", k64K, 64);
  SpaceId on_host = client_->space("on_host", k64K, 64);
  SpaceId smaller = client_->space("smaller", 32 << 10, 64);
  Bytes source_bytes = random_bytes(64 * k64K);
  Bytes target_bytes = random_bytes(64 * k64K);
  Bytes host_bytes = random_bytes(64 * k64K);
  Bytes smaller_bytes = random_bytes(64 * (32 << 10));
  ASSERT_TRUE(write_on_host({source, 0, 64}, source_bytes));
  ASSERT_TRUE(write_on_host({on_host, 0, 64}, host_bytes));
  ASSERT_TRUE(write_on_host({smaller, 0, 64}, smaller_bytes));
  ASSERT_TRUE(acquire_and_write({target, 0, 64}, target_bytes));
  const PageRange good_source{source, 0, 4}, good_target{target, 0, 4};

  auto code_of = [&](const std::vector<PageRange>& pairs) {
    return engine_->copy_pages(id(), pairs, std::nullopt).status().code();
  };
  auto refused = [&](const std::vector<PageRange>& pairs, std::initializer_list<StatusCode> codes) {
    Status status = engine_->copy_pages(id(), pairs, std::nullopt).status();
    for (StatusCode code : codes) {
      if (status.code() == code) return ::testing::AssertionSuccess();
    }
    return ::testing::AssertionFailure() << "answered " << status.to_string();
  };
  constexpr auto kInvalid = StatusCode::INVALID_ARGUMENT;
  EXPECT_EQ(code_of({}), kInvalid) << "an empty list";
  EXPECT_EQ(code_of({good_source}), kInvalid) << "one range";
  EXPECT_EQ(code_of({good_source, good_target, PageRange{source, 8, 4}}), kInvalid) << "three ranges";
  EXPECT_EQ(code_of({PageRange{source, 0, 4}, PageRange{target, 0, 5}}), kInvalid) << "page counts differ";
  EXPECT_EQ(code_of({PageRange{source, 0, 0}, PageRange{target, 0, 0}}), kInvalid) << "no pages";
  EXPECT_EQ(code_of({PageRange{source, 0, 4}, PageRange{smaller, 0, 4}}), kInvalid) << "page sizes differ";
  EXPECT_EQ(code_of({PageRange{smaller, 0, 4}, PageRange{source, 0, 4}}), kInvalid) << "page sizes differ";
  EXPECT_EQ(code_of({PageRange{source, 0, 8}, PageRange{source, 4, 8}}), kInvalid) << "overlap ahead";
  EXPECT_EQ(code_of({PageRange{source, 4, 8}, PageRange{source, 0, 8}}), kInvalid) << "overlap behind";
  EXPECT_EQ(code_of({PageRange{source, 4, 8}, PageRange{source, 4, 8}}), kInvalid) << "a range onto itself";
  EXPECT_EQ(code_of({PageRange{source, 0, 8}, PageRange{source, 7, 8}}), kInvalid) << "one page overlaps";
  // Unknown spaces and pages past the end: the engine's own codes (NOT_FOUND, OUT_OF_RANGE), or
  // INVALID_ARGUMENT from copy_pages's checks.
  EXPECT_TRUE(refused({PageRange{source + 100, 0, 4}, good_target}, {StatusCode::NOT_FOUND, kInvalid}))
      << "an unknown source space";
  EXPECT_TRUE(refused({good_source, PageRange{target + 100, 0, 4}}, {StatusCode::NOT_FOUND, kInvalid}))
      << "an unknown destination space";
  EXPECT_TRUE(refused({PageRange{source, 62, 4}, PageRange{target, 0, 4}}, {StatusCode::OUT_OF_RANGE, kInvalid}))
      << "a source past the end";
  EXPECT_TRUE(refused({PageRange{source, 0, 4}, PageRange{target, 64, 4}}, {StatusCode::OUT_OF_RANGE, kInvalid}))
      << "a destination past the end";
  EXPECT_TRUE(refused({PageRange{source, 0xfffffff0u, 0x100}, PageRange{target, 0, 0x100}},
                      {StatusCode::OUT_OF_RANGE, kInvalid}))
      << "a range whose end wraps around";
  EXPECT_EQ(engine_->copy_pages(99, {good_source, good_target}, std::nullopt).status().code(), StatusCode::NOT_FOUND)
      << "an unknown client";
  // A good pair first, a bad one after it: nothing is copied.
  EXPECT_EQ(code_of({good_source, good_target, PageRange{source, 8, 4}, PageRange{target, 8, 5}}), kInvalid);
  EXPECT_TRUE(refused({good_source, good_target, PageRange{source, 8, 4}, PageRange{target + 100, 8, 4}},
                      {StatusCode::NOT_FOUND, kInvalid}));
  // Pages acquired for host access, as source or as destination (and the pages beside them).
  char* pinned = client_->acquire_host({source, 10, 2});
  ASSERT_NE(pinned, nullptr);
  EXPECT_EQ(code_of({PageRange{source, 10, 2}, PageRange{target, 10, 2}}), StatusCode::FAILED_PRECONDITION)
      << "a source pinned for host access";
  EXPECT_EQ(code_of({PageRange{source, 8, 4}, PageRange{target, 10, 4}}), StatusCode::FAILED_PRECONDITION)
      << "a source range ending in pages pinned for host access";
  ASSERT_TRUE(engine_->release_host(id(), {source, 10, 2}, false).ok());
  pinned = client_->acquire_host({on_host, 20, 4});
  ASSERT_NE(pinned, nullptr);
  EXPECT_EQ(code_of({PageRange{source, 20, 4}, PageRange{on_host, 20, 4}}), StatusCode::FAILED_PRECONDITION)
      << "a destination pinned for host access";
  EXPECT_EQ(code_of({good_source, good_target, PageRange{source, 20, 4}, PageRange{on_host, 22, 4}}),
            StatusCode::FAILED_PRECONDITION)
      << "a good pair, then a destination pinned for host access";
  ASSERT_TRUE(engine_->release_host(id(), {on_host, 20, 4}, false).ok());

  // Nothing changed anywhere.
  EXPECT_TRUE(same_bytes(client_->page(Tier::kGpu, target, 0), target_bytes, k64K));
  EXPECT_TRUE(same_bytes(read_on_host({on_host, 0, 64}).data(), host_bytes, k64K));
  EXPECT_TRUE(same_bytes(read_on_host({source, 0, 64}).data(), source_bytes, k64K));
  EXPECT_TRUE(same_bytes(read_on_host({smaller, 0, 64}).data(), smaller_bytes, 32 << 10));
  EXPECT_EQ(gpu_bytes(source), 0u);
  EXPECT_EQ(client_->space_stats(target).bytes_pinned, 64 * k64K);
  // Still served: adjacent ranges of one space do not overlap.
  ASSERT_TRUE(copy({PageRange{source, 0, 8}, PageRange{source, 8, 8}}));
  EXPECT_TRUE(same_bytes(read_on_host({source, 0, 16}).data(),
                         replaced(slice(source_bytes, k64K, 0, 16), k64K, 8, slice(source_bytes, k64K, 0, 8)), k64K));
  ASSERT_TRUE(engine_->release(id(), {target, 0, 64}, true).ok());
}

// Destination frames that live nowhere take host frames; a call that needs more than the client's
// host quota is refused (RESOURCE_EXHAUSTED) and gives back the frames it took: no destination
// gains contents, and a call that needs the whole quota then works.
TEST_P(PageCopies, ACallOverTheHostQuotaChangesNothing) {
  ClientConfig config;
  config.host_quota_bytes = 2 * kFrameBytes;
  auto client = MappedClient::open(*engine_, config);
  ASSERT_NE(client, nullptr);
  SpaceId source = client->space("source", k96K, 64);   // 6 MiB, on the GPU only
  SpaceId target = client->space("target", k96K, 64);   // three frames without contents
  char* pages = client->acquire({source, 0, 64}, kEngineAcquireWrite | kEngineAcquireZeroNew);
  ASSERT_NE(pages, nullptr);
  Bytes source_bytes = random_bytes(64 * k96K);
  std::memcpy(pages, source_bytes.data(), source_bytes.size());
  ASSERT_TRUE(engine_->release(client->id, {source, 0, 64}, true).ok());
  auto refused = retrying([&] {
    return engine_->copy_pages(client->id, {PageRange{source, 0, 64}, PageRange{target, 0, 64}}, std::nullopt);
  });
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::RESOURCE_EXHAUSTED) << refused.status().to_string();
  EXPECT_EQ(client->space_stats(target).bytes_none, 64 * k96K) << "a refused copy gave destination frames contents";
  // Pages [0, 42) lie in the first two frames: the whole quota.
  auto copied = retrying([&] {
    return engine_->copy_pages(client->id, {PageRange{source, 10, 42}, PageRange{target, 0, 42}}, std::nullopt);
  });
  ASSERT_TRUE(copied.ok()) << "the refused call kept host frames: " << copied.status().to_string();
  ASSERT_NO_FATAL_FAILURE(client->finish(copied));
  EXPECT_EQ(client->space_stats(target).bytes_none, 64 * k96K - 2 * kFrameBytes);
  char* host = client->acquire_host({target, 0, 42});
  ASSERT_NE(host, nullptr);
  EXPECT_TRUE(same_bytes(host, slice(source_bytes, k96K, 10, 42), k96K));
  ASSERT_TRUE(engine_->release_host(client->id, {target, 0, 42}, false).ok());
}

// Space ids are per client: a client naming ids that only another client has gets them refused
// (as unknown), and neither client's bytes move.
TEST_P(PageCopies, AClientCannotNameAnotherClientsSpaces) {
  SpaceId third = 0;
  for (const char* name : {"a.first", "a.second", "a.third"}) third = client_->space(name, k64K, 32);
  Bytes secret = random_bytes(32 * k64K);
  ASSERT_TRUE(write_on_host({third, 0, 32}, secret));
  auto other = MappedClient::open(*engine_);
  ASSERT_NE(other, nullptr);
  SpaceId own = other->space("b.own", k64K, 32);
  ASSERT_NE(own, third) << "the ids should differ for this test";
  char* own_pages = other->acquire({own, 0, 32}, kEngineAcquireWrite | kEngineAcquireZeroNew);
  ASSERT_NE(own_pages, nullptr);
  Bytes own_bytes = random_bytes(32 * k64K);
  std::memcpy(own_pages, own_bytes.data(), own_bytes.size());
  auto reading = engine_->copy_pages(other->id, {PageRange{third, 0, 8}, PageRange{own, 0, 8}}, std::nullopt);
  EXPECT_TRUE(reading.status().code() == StatusCode::NOT_FOUND ||
              reading.status().code() == StatusCode::INVALID_ARGUMENT)
      << reading.status().to_string();
  auto writing = engine_->copy_pages(other->id, {PageRange{own, 0, 8}, PageRange{third, 0, 8}}, std::nullopt);
  EXPECT_TRUE(writing.status().code() == StatusCode::NOT_FOUND ||
              writing.status().code() == StatusCode::INVALID_ARGUMENT)
      << writing.status().to_string();
  EXPECT_TRUE(same_bytes(own_pages, own_bytes, k64K)) << "the other client's bytes reached this one";
  EXPECT_TRUE(same_bytes(read_on_host({third, 0, 32}).data(), secret, k64K));
  ASSERT_TRUE(engine_->release(other->id, {own, 0, 32}, true).ok());
}

// Copies are ordered like every other transfer of the client (Note [Batches and tickets]): a copy
// out of pages a copy just wrote, and a host access or offload of them, issued without waiting for
// the first ticket, see the copied bytes.
TEST_P(PageCopies, ChainedCopiesAndAccessesWithoutWaitsSeeTheCopiedBytes) {
  SpaceId history = client_->space("history", k2M, 4);
  SpaceId stage = client_->space("stage", k2M, 4);
  SpaceId saved = client_->space("saved", k2M, 4);
  SpaceId spare = client_->space("spare", k2M, 4);
  Bytes history_bytes = random_bytes(4 * k2M);
  ASSERT_TRUE(write_on_host({history, 0, 4}, history_bytes));
  ASSERT_TRUE(acquire_and_write({stage, 0, 4}, random_bytes(4 * k2M)));
  Bytes spare_bytes = random_bytes(4 * k2M);
  ASSERT_TRUE(write_on_gpu({spare, 0, 4}, spare_bytes));
  // history (host) -> stage (GPU) -> saved (host, new) -> spare (GPU, unpinned), no waits between.
  ASSERT_TRUE(engine_->copy_pages(id(), {PageRange{history, 0, 4}, PageRange{stage, 0, 4}}, std::nullopt).ok());
  ASSERT_TRUE(engine_->copy_pages(id(), {PageRange{stage, 0, 4}, PageRange{saved, 0, 4}}, std::nullopt).ok());
  ASSERT_TRUE(engine_->copy_pages(id(), {PageRange{saved, 1, 2}, PageRange{spare, 1, 2}}, std::nullopt).ok());
  ASSERT_NO_FATAL_FAILURE(client_->finish(engine_->offload(id(), {spare, 0, 4})));
  EXPECT_TRUE(same_bytes(read_on_host({saved, 0, 4}).data(), history_bytes, k2M));
  EXPECT_TRUE(same_bytes(read_on_host({spare, 0, 4}).data(),
                         replaced(spare_bytes, k2M, 1, slice(history_bytes, k2M, 1, 2)), k2M));
  EXPECT_TRUE(same_bytes(client_->page(Tier::kGpu, stage, 0), history_bytes, k2M));
  ASSERT_TRUE(engine_->release(id(), {stage, 0, 4}, true).ok());
}

// Random acquires, host accesses, offloads, prefetches, frees and copies (tickets not waited for)
// over three spaces of 96 KiB pages that do not fit the GPU together (evictions), against a model
// of every page's bytes; every space is read back through host access now and then and at the end.
TEST_P(PageCopies, RandomOperationsAgreeWithAModel) {
  constexpr uint32_t kPages = 48;   // 4.5 MiB: three space frames each, nine for a 3-frame quota
  constexpr int kSpaces = 3;
  ClientConfig config;
  config.gpu_quota_bytes = 3 * kFrameBytes;
  auto client = MappedClient::open(*engine_, config);
  ASSERT_NE(client, nullptr);
  std::vector<SpaceId> spaces;
  std::vector<Bytes> model;   // every page's bytes; zeros where it has none
  for (int s = 0; s < kSpaces; ++s) {
    spaces.push_back(client->space("s" + std::to_string(s), k96K, kPages));
    model.emplace_back(kPages * k96K, 0);
  }
  auto index_of = [&](SpaceId space) {
    return size_t(std::find(spaces.begin(), spaces.end(), space) - spaces.begin());
  };
  auto random_range = [&] {
    uint32_t count = 1 + uint32_t(random_() % 12);
    return PageRange{spaces[random_() % kSpaces], uint32_t(random_() % (kPages - count + 1)), count};
  };
  auto overlaps = [](PageRange a, PageRange b) {
    return a.space == b.space && a.first_page < b.first_page + b.page_count &&
           b.first_page < a.first_page + a.page_count;
  };
  auto audit = [&](int step) {
    for (int s = 0; s < kSpaces; ++s) {
      char* host = client->acquire_host({spaces[s], 0, kPages});
      ASSERT_NE(host, nullptr);
      EXPECT_TRUE(same_bytes(host, model[s], k96K)) << "space " << s << " after step " << step;
      // Released clean: the host access zero-filled freed pages and dropped the stale GPU copy of
      // their frames (Engine.FreedPagesReadOnTheHostAreZerosOnTheGpuToo).
      ASSERT_TRUE(engine_->release_host(client->id, {spaces[s], 0, kPages}, false).ok());
    }
  };
  int copies = 0;
  for (int step = 0; step < 300; ++step) {
    PageRange range = random_range();
    Bytes& bytes = model[index_of(range.space)];
    uint64_t offset = uint64_t(range.first_page) * k96K, length = uint64_t(range.page_count) * k96K;
    switch (random_() % 8) {
      case 0: {   // a "kernel" writes pages on the GPU
        char* pages = client->acquire(range, kEngineAcquireWrite | kEngineAcquireZeroNew);
        ASSERT_NE(pages, nullptr) << "step " << step;
        ASSERT_TRUE(same_bytes(pages, Bytes(bytes.begin() + offset, bytes.begin() + offset + length), k96K))
            << "step " << step << ": acquired pages";
        Bytes written = random_bytes(length);
        std::memcpy(pages, written.data(), length);
        std::memcpy(bytes.data() + offset, written.data(), length);
        ASSERT_TRUE(engine_->release(client->id, range, true).ok());
        break;
      }
      case 1: {   // the CPU writes pages
        char* host = client->acquire_host(range);
        ASSERT_NE(host, nullptr) << "step " << step;
        Bytes written = random_bytes(length);
        std::memcpy(host, written.data(), length);
        std::memcpy(bytes.data() + offset, written.data(), length);
        ASSERT_TRUE(engine_->release_host(client->id, range, true).ok());
        break;
      }
      case 2:
        ASSERT_TRUE(retrying([&] { return engine_->offload(client->id, range); }).ok()) << "step " << step;
        break;
      case 3: {
        auto prefetched = retrying([&] { return engine_->prefetch(client->id, range); });
        ASSERT_TRUE(prefetched.ok() || prefetched.status().code() == StatusCode::RESOURCE_EXHAUSTED)
            << prefetched.status().to_string();
        break;
      }
      case 4: {   // refused when a page is freed already or a whole frame holds nothing
        Status freed = engine_->free_pages(client->id, range);
        ASSERT_TRUE(freed.ok() || freed.code() == StatusCode::FAILED_PRECONDITION) << freed.to_string();
        if (freed.ok()) std::memset(bytes.data() + offset, 0, length);
        break;
      }
      default: {   // one to three pairs, destinations overlapping nothing else of the call
        std::vector<PageRange> pairs;
        uint32_t wanted = 1 + uint32_t(random_() % 3);
        for (int attempt = 0; attempt < 20 && pairs.size() < 2 * wanted; ++attempt) {
          PageRange source = random_range();
          PageRange destination = random_range();
          destination.page_count = source.page_count;
          destination.first_page = std::min(destination.first_page, kPages - source.page_count);
          bool clash = overlaps(source, destination);
          for (size_t k = 0; k < pairs.size(); ++k) {
            clash = clash || overlaps(destination, pairs[k]) || (k % 2 == 1 && overlaps(source, pairs[k]));
          }
          if (!clash) {
            pairs.push_back(source);
            pairs.push_back(destination);
          }
        }
        auto ticket = retrying([&] { return engine_->copy_pages(client->id, pairs, std::nullopt); });
        ASSERT_TRUE(ticket.ok()) << "step " << step << ": " << ticket.status().to_string();
        std::vector<Bytes> read;   // every source is read before any destination is written
        for (size_t k = 0; k < pairs.size(); k += 2) {
          const Bytes& from = model[index_of(pairs[k].space)];
          uint64_t at = uint64_t(pairs[k].first_page) * k96K;
          read.emplace_back(from.begin() + at, from.begin() + at + uint64_t(pairs[k].page_count) * k96K);
        }
        for (size_t k = 1; k < pairs.size(); k += 2) {
          std::memcpy(model[index_of(pairs[k].space)].data() + uint64_t(pairs[k].first_page) * k96K,
                      read[k / 2].data(), read[k / 2].size());
        }
        ++copies;
        break;
      }
    }
    if (step % 50 == 49) {
      ASSERT_NO_FATAL_FAILURE(audit(step));
    }
  }
  ASSERT_NO_FATAL_FAILURE(audit(300));
  EXPECT_GT(copies, 50);
  EXPECT_GT(client->stats().evictions, 0u);
}

INSTANTIATE_TEST_SUITE_P(Order, PageCopies, ::testing::Values(0, 1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == 0 ? "OnTheHost"
                                              : info.param == 1 ? "OnTheDevice" : "OnTheDeviceHandedOverByTheDispatcher");
                         });

}  // namespace
}  // namespace membar::runtimed
