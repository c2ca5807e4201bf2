// HostBackend: slabs and renewal (Note [Frames, slabs and renewal]), copies (merged when
// adjacent), zero fills, signal ordering, fault injection.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include "runtime_test_util.h"

namespace membar::runtimed {
namespace {

using membar::testing::check_pattern;
using membar::testing::count_open_fds;
using membar::testing::fill_pattern;
using membar::testing::is_zero;

std::unique_ptr<DeviceBackend> make_backend(uint64_t gpu_frames, uint64_t host_frames, uint32_t slab_frames = 1) {
  BackendConfig config;
  config.gpu_pool_bytes = gpu_frames * kFrameBytes;
  config.host_pool_bytes = host_frames * kFrameBytes;
  config.host_slab_frames = slab_frames;
  auto backend = make_host_backend(config);
  EXPECT_TRUE(backend.ok()) << backend.status().to_string();
  return std::move(backend).value();
}

// Waits for a completion callback.
struct Completion {
  std::mutex mutex;
  std::condition_variable done;
  int count = 0;
  Status status;
  std::function<void(Status)> callback() {
    return [this](Status s) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!s.ok()) status = s;
      ++count;
      done.notify_all();
    };
  }
  void wait_for(int n) {
    std::unique_lock<std::mutex> lock(mutex);
    ASSERT_TRUE(done.wait_for(lock, std::chrono::seconds(10), [&] { return count >= n; }));
  }
};

// Host slabs start unprepared: renews every slab and every GPU frame (the engine does this in the
// background after start-up) and waits; afterwards every frame of both tiers has memory.
void prepare(DeviceBackend& backend) {
  Completion completion;
  int count = 0;
  for (uint32_t slab = 0; slab < backend.host_slab_count(); ++slab, ++count) {
    ASSERT_TRUE(backend.renew(Tier::kHost, slab, completion.callback()).ok());
  }
  completion.wait_for(count);
  ASSERT_TRUE(completion.status.ok()) << completion.status.to_string();
  // A GPU frame has memory from its export on (until its next renewal).
  for (FrameIndex frame = 0; frame < backend.frame_count(Tier::kGpu); ++frame) {
    auto fd = backend.export_gpu_frame(frame);
    ASSERT_TRUE(fd.ok()) << fd.status().to_string();
    ::close(fd.value());
  }
}

// Mappings of the backend's memfds, plus the bytes of inaccessible anonymous reservations of
// whole frames (what a leaked pool reservation would look like). Other mappings come and go
// with the allocator (and sanitizers) and are not counted.
std::pair<int, uint64_t> count_mappings() {
  std::ifstream maps("/proc/self/maps");
  int memfd_mappings = 0;
  uint64_t reserved_bytes = 0;
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("membar-") != std::string::npos) ++memfd_mappings;
    unsigned long long start = 0, end = 0;
    char permissions[8] = {};
    if (std::sscanf(line.c_str(), "%llx-%llx %7s", &start, &end, permissions) == 3 &&
        std::string(permissions) == "---p" && line.find('/') == std::string::npos &&
        (end - start) % kFrameBytes == 0 && end - start >= 4 * kFrameBytes) {
      reserved_bytes += end - start;
    }
  }
  return {memfd_mappings, reserved_bytes};
}

TEST(HostBackend, PoolsHaveTheConfiguredFramesAndSlabs) {
  auto backend = make_backend(3, 8, 4);
  EXPECT_EQ(backend->name(), "host");
  EXPECT_EQ(backend->frame_count(Tier::kGpu), 3u);
  EXPECT_EQ(backend->frame_count(Tier::kHost), 8u);
  EXPECT_EQ(backend->host_slab_frames(), 4u);
  EXPECT_EQ(backend->host_slab_count(), 2u);
  EXPECT_NE(backend->frame_pointer(Tier::kGpu, 2), nullptr);
  EXPECT_EQ(backend->frame_pointer(Tier::kGpu, 3), nullptr);
  EXPECT_FALSE(backend->export_gpu_frame(3).ok());
  // A slab has no memory until it is prepared (renewed once).
  EXPECT_EQ(backend->export_host_slab(0).status().code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(backend->renew(Tier::kHost, 2, [](Status) {}).code(), StatusCode::OUT_OF_RANGE);
  prepare(*backend);
  auto fd = backend->export_host_slab(1);
  ASSERT_TRUE(fd.ok()) << fd.status().to_string();
  ::close(fd.value());
  // Slab sizes for a pool (host_slab_frames_for): at most 256 slabs, between 2 MiB and 4 GiB.
  EXPECT_EQ(host_slab_frames_for(64ull << 20), 1u);
  EXPECT_EQ(host_slab_frames_for(512ull << 20), 1u);
  EXPECT_EQ(host_slab_frames_for(1ull << 30), 2u);
  EXPECT_EQ(host_slab_frames_for(100ull << 30), 256u);
  EXPECT_EQ(host_slab_frames_for(1ull << 40), 2048u);
  EXPECT_EQ(host_slab_frames_for(16ull << 40), 2048u);
  BackendConfig config;
  config.gpu_pool_bytes = 2 * kFrameBytes;
  config.host_pool_bytes = 1ull << 30;
  EXPECT_EQ(make_host_backend(config).value()->host_slab_frames(), 2u) << "the default comes from the pool size";
}

TEST(HostBackend, ExportedMemoryIsSharedWithTheDaemonView) {
  auto backend = make_backend(2, 4, 2);
  prepare(*backend);
  auto fd = backend->export_gpu_frame(1);
  ASSERT_TRUE(fd.ok());
  void* view = ::mmap(nullptr, kFrameBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.value(), 0);
  ::close(fd.value());
  ASSERT_NE(view, MAP_FAILED);
  fill_pattern(view, kFrameBytes, 77);
  EXPECT_TRUE(check_pattern(backend->frame_pointer(Tier::kGpu, 1), kFrameBytes, 77));
  EXPECT_FALSE(check_pattern(backend->frame_pointer(Tier::kGpu, 0), kFrameBytes, 77));
  ::munmap(view, kFrameBytes);
  // A slab's descriptor maps all its frames, in order.
  auto slab = backend->export_host_slab(1);
  ASSERT_TRUE(slab.ok());
  void* slab_view = ::mmap(nullptr, 2 * kFrameBytes, PROT_READ | PROT_WRITE, MAP_SHARED, slab.value(), 0);
  ::close(slab.value());
  ASSERT_NE(slab_view, MAP_FAILED);
  fill_pattern(static_cast<char*>(slab_view) + kFrameBytes, kFrameBytes, 78);
  EXPECT_TRUE(check_pattern(backend->frame_pointer(Tier::kHost, 3), kFrameBytes, 78));
  ::munmap(slab_view, 2 * kFrameBytes);
}

// Note [Frames, slabs and renewal]: renewal gives fresh zeroed memory; a descriptor exported
// before reaches only the old memory, and writing it changes nothing the daemon sees.
TEST(HostBackend, RenewalGivesFreshMemoryThatOldDescriptorsCannotReach) {
  auto backend = make_backend(2, 4, 2);
  prepare(*backend);
  for (Tier tier : {Tier::kGpu, Tier::kHost}) {
    SCOPED_TRACE(tier == Tier::kGpu ? "GPU frame" : "host slab");
    uint32_t index = 1;
    FrameIndex frame = tier == Tier::kGpu ? 1 : 2;  // host: the first frame of slab 1
    auto export_it = [&] { return tier == Tier::kGpu ? backend->export_gpu_frame(index) : backend->export_host_slab(index); };
    auto old_fd = export_it();
    ASSERT_TRUE(old_fd.ok());
    void* old_view = ::mmap(nullptr, kFrameBytes, PROT_READ | PROT_WRITE, MAP_SHARED, old_fd.value(), 0);
    ASSERT_NE(old_view, MAP_FAILED);
    fill_pattern(old_view, kFrameBytes, 500);
    ASSERT_TRUE(check_pattern(backend->frame_pointer(tier, frame), kFrameBytes, 500));
    uint64_t renewals = backend->counters().renewals;
    Completion completion;
    ASSERT_TRUE(backend->renew(tier, index, completion.callback()).ok());
    completion.wait_for(1);
    ASSERT_TRUE(completion.status.ok()) << completion.status.to_string();
    EXPECT_EQ(backend->counters().renewals, renewals + 1);
    auto new_fd = export_it();
    ASSERT_TRUE(new_fd.ok());
    void* new_view = ::mmap(nullptr, kFrameBytes, PROT_READ | PROT_WRITE, MAP_SHARED, new_fd.value(), 0);
    ASSERT_NE(new_view, MAP_FAILED);
    EXPECT_TRUE(is_zero(new_view, kFrameBytes)) << "renewed memory must hold zeros";
    EXPECT_TRUE(is_zero(backend->frame_pointer(tier, frame), kFrameBytes));
    fill_pattern(new_view, kFrameBytes, 600);
    fill_pattern(old_view, kFrameBytes, 700);  // the old holder keeps writing
    EXPECT_TRUE(check_pattern(backend->frame_pointer(tier, frame), kFrameBytes, 600));
    EXPECT_TRUE(check_pattern(new_view, kFrameBytes, 600));
    EXPECT_TRUE(check_pattern(old_view, kFrameBytes, 700));
    ::munmap(old_view, kFrameBytes);
    ::munmap(new_view, kFrameBytes);
    ::close(old_fd.value());
    ::close(new_fd.value());
  }
}

TEST(HostBackend, AdjacentCopiesMergeAcrossFrames) {
  auto backend = make_backend(4, 4, 4);
  prepare(*backend);
  constexpr uint64_t kPage = 64 << 10;
  for (FrameIndex f = 0; f < 4; ++f) fill_pattern(backend->frame_pointer(Tier::kHost, f), kFrameBytes, 100 + f);
  // Host frames 1..2 -> GPU frames 2..3, as 64 pages of 64 KiB given in shuffled order: one run.
  std::vector<CopyOp> ops;
  for (uint32_t i = 0; i < 64; ++i) {
    FrameIndex src = 1 + i / 32, dst = 2 + i / 32;
    uint64_t offset = uint64_t(i % 32) * kPage;
    ops.push_back(CopyOp{Tier::kHost, src, offset, Tier::kGpu, dst, offset, kPage});
  }
  std::shuffle(ops.begin(), ops.end(), std::mt19937(7));
  // Plus one op that is not adjacent to anything: host frame 0 slot 5 -> GPU frame 0 slot 9.
  ops.push_back(CopyOp{Tier::kHost, 0, 5 * kPage, Tier::kGpu, 0, 9 * kPage, kPage});
  Completion completion;
  BackendCounters before = backend->counters();
  ASSERT_TRUE(backend->enqueue_copies(ops, completion.callback()).ok());
  completion.wait_for(1);
  backend->drain();
  ASSERT_TRUE(completion.status.ok());
  BackendCounters after = backend->counters();
  EXPECT_EQ(after.copy_ops - before.copy_ops, 65u);
  EXPECT_EQ(after.transfers - before.transfers, 2u);
  EXPECT_EQ(after.bytes_copied - before.bytes_copied, 65 * kPage);
  EXPECT_TRUE(check_pattern(backend->frame_pointer(Tier::kGpu, 2), kFrameBytes, 101));
  EXPECT_TRUE(check_pattern(backend->frame_pointer(Tier::kGpu, 3), kFrameBytes, 102));
  const char* src = static_cast<const char*>(backend->frame_pointer(Tier::kHost, 0)) + 5 * kPage;
  const char* dst = static_cast<const char*>(backend->frame_pointer(Tier::kGpu, 0)) + 9 * kPage;
  EXPECT_EQ(std::memcmp(src, dst, kPage), 0);
}

TEST(HostBackend, ZeroFillAndBadRanges) {
  auto backend = make_backend(1, 1);
  prepare(*backend);
  fill_pattern(backend->frame_pointer(Tier::kGpu, 0), kFrameBytes, 5);
  Completion completion;
  ASSERT_TRUE(backend->enqueue_zero(Tier::kGpu, 0, 1 << 20, 64 << 10, completion.callback()).ok());
  completion.wait_for(1);
  backend->drain();
  char* frame = static_cast<char*>(backend->frame_pointer(Tier::kGpu, 0));
  EXPECT_TRUE(is_zero(frame + (1 << 20), 64 << 10));
  EXPECT_FALSE(is_zero(frame + (1 << 20) + (64 << 10), 64 << 10));
  // Out of range: refused, callback never called.
  int calls = 0;
  auto never = [&calls](Status) { ++calls; };
  EXPECT_EQ(backend->enqueue_zero(Tier::kGpu, 1, 0, 8, never).code(), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(backend->enqueue_zero(Tier::kGpu, 0, kFrameBytes - 8, 16, never).code(), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(backend->enqueue_copies({CopyOp{Tier::kHost, 3, 0, Tier::kGpu, 0, 0, 8}}, never).code(),
            StatusCode::OUT_OF_RANGE);
  backend->drain();
  EXPECT_EQ(calls, 0);
}

TEST(HostBackend, SignalFiresOnlyAfterEarlierWork) {
  auto backend = make_backend(8, 8);
  prepare(*backend);
  auto block = backend->create_signal_block(4);
  ASSERT_TRUE(block.ok());
  volatile uint64_t* words = backend->signal_words(block.value());
  ASSERT_NE(words, nullptr);
  for (FrameIndex f = 0; f < 8; ++f) fill_pattern(backend->frame_pointer(Tier::kHost, f), kFrameBytes, 300 + f);
  Completion completion;
  // Eight batches on disjoint frames (batches may run concurrently), a signal after each.
  for (FrameIndex f = 0; f < 8; ++f) {
    ASSERT_TRUE(backend->enqueue_copies({CopyOp{Tier::kHost, f, 0, Tier::kGpu, f, 0, kFrameBytes}},
                                        completion.callback()).ok());
    ASSERT_TRUE(backend->enqueue_signal(block.value(), 2, uint64_t(f + 1)).ok());
  }
  // Once the word says 8, every copy before it has landed.
  auto word = [&] { return __atomic_load_n(const_cast<uint64_t*>(words + 2), __ATOMIC_ACQUIRE); };
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (word() != 8 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  ASSERT_EQ(word(), 8u);
  for (FrameIndex f = 0; f < 8; ++f) EXPECT_TRUE(check_pattern(backend->frame_pointer(Tier::kGpu, f), kFrameBytes, 300 + f));
  EXPECT_EQ(backend->enqueue_signal(block.value(), 4, 1).code(), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(backend->enqueue_signal(block.value() + 100, 0, 1).code(), StatusCode::NOT_FOUND);
  auto fd = backend->export_signal_block(block.value());
  ASSERT_TRUE(fd.ok());
  auto* view = static_cast<volatile uint64_t*>(::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd.value(), 0));
  ::close(fd.value());
  EXPECT_EQ(view[2], 8u);
  ::munmap(const_cast<uint64_t*>(view), 4096);
  EXPECT_TRUE(backend->destroy_signal_block(block.value()).ok());
  EXPECT_EQ(backend->destroy_signal_block(block.value()).code(), StatusCode::NOT_FOUND);
  completion.wait_for(8);
  backend->drain();  // the last callback has returned before `completion` goes
}

TEST(HostBackend, FrameCreationFailureLeaksNothing) {
  int fds_before = count_open_fds();
  auto maps_before = count_mappings();
  for (uint64_t fail_after : {1, 2, 4}) {
    BackendConfig config;
    config.gpu_pool_bytes = 4 * kFrameBytes;
    config.host_pool_bytes = 8 * kFrameBytes;
    config.fail_frame_create_after = fail_after;
    auto backend = make_host_backend(config);
    ASSERT_FALSE(backend.ok());
    EXPECT_EQ(backend.status().code(), StatusCode::RESOURCE_EXHAUSTED);
    EXPECT_NE(backend.status().message().find("fault injected"), std::string::npos) << backend.status().to_string();
  }
  EXPECT_EQ(count_open_fds(), fds_before);
  EXPECT_EQ(count_mappings(), maps_before);
  // Failing after all 4 GPU frames exist is no failure; a backend that lived and did work
  // leaves nothing behind either.
  {
    BackendConfig config;
    config.gpu_pool_bytes = 4 * kFrameBytes;
    config.host_pool_bytes = 8 * kFrameBytes;
    config.host_slab_frames = 2;
    config.fail_frame_create_after = 5;
    auto backend = make_host_backend(config);
    ASSERT_TRUE(backend.ok());
    prepare(*backend.value());
    auto block = backend.value()->create_signal_block(8);
    ASSERT_TRUE(block.ok());
  }
  EXPECT_EQ(count_open_fds(), fds_before);
  EXPECT_EQ(count_mappings(), maps_before);
}

}  // namespace
}  // namespace membar::runtimed
