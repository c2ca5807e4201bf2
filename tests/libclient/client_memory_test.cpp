// ClientMemory (libclient/memory.h) applying the runtime's frame events on its mapping thread
// (Note [Maps off the caller's thread] in libclient/memory.cpp), on memfd frames: a call waits
// only for the events of the pages it hands out, maps of adjacent positions go as one run, later
// unmaps and revokes keep the bookkeeping right, and removing a space waits for its events.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "memory.h"

namespace membar {
namespace {

// A frame of 2 MiB in a memfd whose first word is `tag`.
int tagged_frame(uint64_t tag) {
  int fd = ::memfd_create("membar-test-frame", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, kFrameBytes), 0);
  void* at = ::mmap(nullptr, kFrameBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  EXPECT_NE(at, MAP_FAILED);
  std::memcpy(at, &tag, sizeof(tag));
  ::munmap(at, kFrameBytes);
  return fd;
}

// The mmap mapper, except that mapping window frame `held` waits until the test lets it go; it
// counts the runs it was given.
class HeldMapper final : public FrameMapper {
 public:
  explicit HeldMapper(uint32_t held) : inner_(make_mmap_mapper()), held_(held) {}
  Result<char*> reserve(uint64_t bytes) override { return inner_->reserve(bytes); }
  void release(char* base, uint64_t bytes) override { inner_->release(base, bytes); }
  Status adopt_frame(uint32_t window_frame, int fd) override { return inner_->adopt_frame(window_frame, fd); }
  Status adopt_slab(uint32_t slab, uint32_t slab_frames, uint32_t frames, int fd) override {
    return inner_->adopt_slab(slab, slab_frames, frames, fd);
  }
  void drop_frame(uint32_t window_frame) override { inner_->drop_frame(window_frame); }
  void drop_slab(uint32_t slab) override { inner_->drop_slab(slab); }
  Status map(uint32_t window_frame, char* at) override {
    if (window_frame == held_) {
      std::unique_lock<std::mutex> lock(mutex_);
      reached_ = true;
      changed_.notify_all();
      changed_.wait(lock, [this] { return let_go_; });
    }
    return inner_->map(window_frame, at);
  }
  Status map_run(const uint32_t* window_frames, size_t count, char* at) override {
    runs_.push_back(count);
    return FrameMapper::map_run(window_frames, count, at);
  }
  Status unmap(char* at) override { return inner_->unmap(at); }

  void wait_reached() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [this] { return reached_; });
  }
  void let_go() {
    std::lock_guard<std::mutex> lock(mutex_);
    let_go_ = true;
    changed_.notify_all();
  }
  std::vector<size_t> runs_;   // read after the memory settled

 private:
  std::unique_ptr<FrameMapper> inner_;
  uint32_t held_;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool reached_ = false;
  bool let_go_ = false;
};

uint64_t word_at(const SpaceView& view, uint32_t space_frame) {
  uint64_t word = 0;
  std::memcpy(&word, static_cast<char*>(view.gpu) + uint64_t(space_frame) * kFrameBytes, sizeof(word));
  return word;
}

TEST(ClientMemory, ACallWaitsOnlyForTheEventsOfItsOwnPages) {
  auto mapper = std::make_unique<HeldMapper>(/*held=*/9);
  HeldMapper* held = mapper.get();
  ClientMemory memory(std::move(mapper), make_mmap_mapper(), 1, /*asynchronous=*/true);
  ASSERT_TRUE(memory.add_space(1, 1 << 20, 32).ok());   // pages of 1 MiB: two per frame, 16 frames
  SpaceView view = memory.view(1).value();   // (view() waits behind a map in progress)
  for (uint32_t w : {1u, 2u, 9u}) ASSERT_TRUE(memory.gpu_frame_granted(w, tagged_frame(100 + w)).ok());
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 1, 1, 0).ok());
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 9, 1, 5).ok());   // held on the mapping thread
  held->wait_reached();
  // Pages 0-1 (frame 0) were mapped before the held event: the call does not wait for it.
  PageRange first{1, 0, 2};
  ASSERT_TRUE(memory.settle_ranges(&first, 1).ok());
  EXPECT_EQ(word_at(view, 0), 101u);
  // A map given after the held one (frame 2 at position 3) waits for it: events apply in order.
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 2, 1, 3).ok());
  std::atomic<bool> settled{false};
  std::thread waiter([&] {
    PageRange later{1, 6, 2};
    EXPECT_TRUE(memory.settle_ranges(&later, 1).ok());
    settled = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(settled.load());
  held->let_go();
  waiter.join();
  EXPECT_TRUE(settled.load());
  EXPECT_EQ(word_at(view, 3), 102u);
  ASSERT_TRUE(memory.settle().ok());
  EXPECT_EQ(word_at(view, 5), 109u);
  MapCounters counters = memory.counters();
  EXPECT_TRUE(counters.asynchronous);
  EXPECT_EQ(counters.maps, 3u);
  EXPECT_EQ(counters.events_applied, 6u);
  EXPECT_GE(counters.wait_ns, 40'000'000u);   // the waiter's ~50 ms
}

TEST(ClientMemory, AdjacentMapsGoAsOneRunAndRevokesUnmapThem) {
  auto mapper = std::make_unique<HeldMapper>(/*held=*/7);
  HeldMapper* held = mapper.get();
  ClientMemory memory(std::move(mapper), make_mmap_mapper(), 1, /*asynchronous=*/true);
  ASSERT_TRUE(memory.add_space(1, kFrameBytes, 8).ok());
  for (uint32_t w = 1; w <= 7; ++w) ASSERT_TRUE(memory.gpu_frame_granted(w, tagged_frame(200 + w)).ok());
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 7, 1, 7).ok());   // holds the thread while the run queues up
  held->wait_reached();
  for (uint32_t p = 0; p < 4; ++p) ASSERT_TRUE(memory.mapped(Tier::kGpu, 1 + p, 1, p).ok());
  // Position 2 again, now frame 5: the queue's later map of the same position wins.
  ASSERT_TRUE(memory.unmapped(Tier::kGpu, 3, 1, 2).ok());
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 5, 1, 2).ok());
  held->let_go();
  ASSERT_TRUE(memory.settle().ok());
  SpaceView view = memory.view(1).value();
  EXPECT_EQ(word_at(view, 0), 201u);
  EXPECT_EQ(word_at(view, 1), 202u);
  EXPECT_EQ(word_at(view, 2), 205u);
  EXPECT_EQ(word_at(view, 3), 204u);
  EXPECT_EQ(held->runs_, (std::vector<size_t>{4}));   // the held single map went through map()
  EXPECT_EQ(memory.counters().map_runs, 3u);          // held, the run of four, position 2 again
  // A revoke unmaps every position of the frame: the page reads as unmapped (PROT_NONE) after.
  ASSERT_TRUE(memory.gpu_frame_revoked(1).ok());
  ASSERT_TRUE(memory.settle().ok());
  EXPECT_EXIT(
      {
        volatile char c = static_cast<char*>(view.gpu)[0];
        (void)c;
        std::exit(0);
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  // Removing the space waits for what is queued and leaves nothing mapped behind.
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 6, 1, 6).ok());
  ASSERT_TRUE(memory.remove_space(1).ok());
  EXPECT_FALSE(memory.view(1).ok());
}

TEST(ClientMemory, ErrorsOfQueuedEventsReachTheNextSettle) {
  ClientMemory memory(make_mmap_mapper(), make_mmap_mapper(), 1, /*asynchronous=*/true);
  ASSERT_TRUE(memory.add_space(1, kFrameBytes, 2).ok());
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 3, 1, 0).ok());   // frame 3 was never granted
  PageRange page{1, 0, 1};
  Status status = memory.settle_ranges(&page, 1);
  EXPECT_EQ(status.code(), StatusCode::INTERNAL);
  EXPECT_NE(status.message().find("never granted"), std::string::npos) << status.to_string();
  EXPECT_TRUE(memory.settle().ok());   // reported once
}

TEST(ClientMemory, SynchronousModeAppliesOnTheCallersThread) {
  ClientMemory memory(make_mmap_mapper(), make_mmap_mapper(), 1, /*asynchronous=*/false);
  ASSERT_TRUE(memory.add_space(1, kFrameBytes, 2).ok());
  ASSERT_TRUE(memory.gpu_frame_granted(4, tagged_frame(404)).ok());
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 4, 1, 1).ok());
  EXPECT_EQ(word_at(memory.view(1).value(), 1), 404u);   // no settle needed
  EXPECT_EQ(memory.mapped(Tier::kGpu, 8, 1, 0).code(), StatusCode::INTERNAL);
  MapCounters counters = memory.counters();
  EXPECT_FALSE(counters.asynchronous);
  EXPECT_EQ(counters.maps, 1u);
}

// Note [Maps in runs]: deferred events wait for a settle, then a block's placements ("unmap the
// position's old frame, map the new one", one after the other) map as one run.
TEST(ClientMemory, DeferredPlacementsMapAsRunsAtTheNextSettle) {
  auto mapper = std::make_unique<HeldMapper>(/*held=*/1000);   // never held: counts runs
  HeldMapper* counted = mapper.get();
  ClientMemory memory(std::move(mapper), make_mmap_mapper(), 1, /*asynchronous=*/false, /*deferred=*/true);
  ASSERT_TRUE(memory.add_space(1, kFrameBytes, 8).ok());
  for (uint32_t w = 1; w <= 9; ++w) ASSERT_TRUE(memory.gpu_frame_granted(w, tagged_frame(300 + w)).ok());
  // Frames 1-4 at positions 0-3, each placement as the runtime gives it.
  for (uint32_t p = 0; p < 4; ++p) {
    ASSERT_TRUE(memory.unmapped(Tier::kGpu, 9, 1, p).ok());   // nothing there yet: a no-op
    ASSERT_TRUE(memory.mapped(Tier::kGpu, 1 + p, 1, p).ok());
  }
  EXPECT_EQ(memory.counters().events_applied, 0u);   // nothing applied before a settle
  PageRange pages{1, 0, 4};
  ASSERT_TRUE(memory.settle_ranges(&pages, 1).ok());
  SpaceView view = memory.view(1).value();
  for (uint32_t p = 0; p < 4; ++p) EXPECT_EQ(word_at(view, p), 301u + p);
  EXPECT_EQ(counted->runs_, (std::vector<size_t>{4}));
  // The same positions again with frames 5-8 (each unmaps its old frame first), given in reverse:
  // still one run, and every position ends with its new frame.
  for (uint32_t p = 4; p-- > 0;) {
    ASSERT_TRUE(memory.unmapped(Tier::kGpu, 1 + p, 1, p).ok());
    ASSERT_TRUE(memory.mapped(Tier::kGpu, 5 + p, 1, p).ok());
  }
  ASSERT_TRUE(memory.settle().ok());
  for (uint32_t p = 0; p < 4; ++p) EXPECT_EQ(word_at(view, p), 305u + p);
  EXPECT_EQ(counted->runs_, (std::vector<size_t>{4, 4}));
  MapCounters counters = memory.counters();
  EXPECT_EQ(counters.maps, 8u);
  EXPECT_EQ(counters.map_runs, 2u);
  EXPECT_FALSE(counters.asynchronous);
}

TEST(ClientMemory, DeferredEventsEndAsGivenWhereOrderMatters) {
  ClientMemory memory(make_mmap_mapper(), make_mmap_mapper(), 1, /*asynchronous=*/false, /*deferred=*/true);
  ASSERT_TRUE(memory.add_space(1, kFrameBytes, 8).ok());
  for (uint32_t w = 1; w <= 4; ++w) ASSERT_TRUE(memory.gpu_frame_granted(w, tagged_frame(500 + w)).ok());
  // Position 2: frame 1, unmapped, then frame 2 (the unmap must not run before the first map).
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 1, 1, 2).ok());
  ASSERT_TRUE(memory.unmapped(Tier::kGpu, 1, 1, 2).ok());
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 2, 1, 2).ok());
  // Position 5: frame 3, then frame 4 over it (a later map of a position wins).
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 3, 1, 5).ok());
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 4, 1, 5).ok());
  // Position 6: frame 3 and unmapped again: nothing there in the end.
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 3, 1, 6).ok());
  ASSERT_TRUE(memory.unmapped(Tier::kGpu, 3, 1, 6).ok());
  // A revoke after a map of the frame: the frame leaves every position it was mapped at.
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 1, 1, 7).ok());
  ASSERT_TRUE(memory.gpu_frame_revoked(1).ok());
  ASSERT_TRUE(memory.settle().ok());
  SpaceView view = memory.view(1).value();
  EXPECT_EQ(word_at(view, 2), 502u);
  EXPECT_EQ(word_at(view, 5), 504u);
  for (uint32_t unmapped : {6u, 7u}) {
    EXPECT_EXIT(
        {
          volatile char c = static_cast<char*>(view.gpu)[uint64_t(unmapped) * kFrameBytes];
          (void)c;
          std::exit(0);
        },
        ::testing::KilledBySignal(SIGSEGV), "")
        << "position " << unmapped;
  }
  // An event that cannot be applied is reported by the settle that applies it, once.
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 9, 1, 0).ok());   // frame 9 was never granted
  Status status = memory.settle();
  EXPECT_EQ(status.code(), StatusCode::INTERNAL);
  EXPECT_NE(status.message().find("never granted"), std::string::npos) << status.to_string();
  EXPECT_TRUE(memory.settle().ok());
  // Removing a space applies what is kept first.
  ASSERT_TRUE(memory.mapped(Tier::kGpu, 2, 1, 0).ok());
  ASSERT_TRUE(memory.remove_space(1).ok());
  EXPECT_FALSE(memory.view(1).ok());
}

}  // namespace
}  // namespace membar
