// CudaVmmBackend on a real GPU (label gpu): frames and slabs, renewal (Note [Frames, slabs and
// renewal]), merged copies both ways, zero fills, signal words, exactly-once completion, bad
// input and fault injection. Contents are random bytes checked against the host's own copy.
// Skips when there is no driver or GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "membar/engine/backend.h"

namespace membar::runtimed {
namespace {

constexpr uint64_t kGpuFrames = 16;
constexpr uint64_t kHostFrames = 32;

BackendConfig small_config() {
  BackendConfig config;
  config.gpu_pool_bytes = kGpuFrames * kFrameBytes;
  config.host_pool_bytes = kHostFrames * kFrameBytes;
  return config;
}

// Waits for one batch's completion and remembers its status.
class Completion {
 public:
  std::function<void(Status)> callback() {
    return [this](Status status) {
      std::lock_guard<std::mutex> lock(mutex_);
      status_ = std::move(status);
      ++calls_;
      changed_.notify_all();
    };
  }
  Status wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait_for(lock, std::chrono::seconds(20), [&] { return calls_ > 0; });
    if (calls_ == 0) return Status(StatusCode::DEADLINE_EXCEEDED, "the batch never completed");
    return status_;
  }
  int calls() {
    std::lock_guard<std::mutex> lock(mutex_);
    return calls_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  Status status_;
  int calls_ = 0;
};

void fill_random(void* pointer, uint64_t bytes, uint64_t seed) {
  std::mt19937_64 generator(seed);
  auto* words = static_cast<uint64_t*>(pointer);
  for (uint64_t i = 0; i < bytes / 8; ++i) words[i] = generator();
}

std::vector<uint8_t> read_gpu(void* device_pointer, uint64_t bytes) {
  std::vector<uint8_t> out(bytes);
  EXPECT_EQ(cudaMemcpy(out.data(), device_pointer, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  return out;
}

// Host slabs start unprepared: renews (makes and pins) every one, as the engine does in the
// background after start-up, and waits.
void prepare_slabs(DeviceBackend& backend) {
  std::vector<std::unique_ptr<Completion>> done;
  for (uint32_t slab = 0; slab < backend.host_slab_count(); ++slab) {
    done.push_back(std::make_unique<Completion>());
    ASSERT_TRUE(backend.renew(Tier::kHost, slab, done.back()->callback()).ok());
  }
  for (auto& completion : done) ASSERT_TRUE(completion->wait().ok());
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<DeviceBackend>> made = make_cuda_backend(small_config());
    if (!made.ok() && made.status().code() == StatusCode::UNAVAILABLE) {
      GTEST_SKIP() << "no usable CUDA GPU: " << made.status().to_string();
    }
    ASSERT_TRUE(made.ok()) << made.status().to_string();
    backend_ = std::move(made).value();
    prepare_slabs(*backend_);
  }
  std::unique_ptr<DeviceBackend> backend_;
};

TEST_F(CudaBackendTest, FramesAndSlabsAreCountedAndExportable) {
  EXPECT_EQ(backend_->name(), "cuda");
  EXPECT_EQ(backend_->frame_count(Tier::kGpu), kGpuFrames);
  EXPECT_EQ(backend_->frame_count(Tier::kHost), kHostFrames);
  EXPECT_EQ(backend_->host_slab_frames(), host_slab_frames_for(kHostFrames * kFrameBytes));
  Result<int> fd = backend_->export_gpu_frame(3);
  ASSERT_TRUE(fd.ok()) << fd.status().to_string();
  EXPECT_GE(fd.value(), 0);
  close(fd.value());
  for (Tier tier : {Tier::kGpu, Tier::kHost}) {
    EXPECT_NE(backend_->frame_pointer(tier, 0), nullptr);
    EXPECT_EQ(backend_->frame_pointer(tier, tier == Tier::kGpu ? kGpuFrames : kHostFrames), nullptr);
  }
  // Adjacent frames are adjacent addresses (what lets copies merge).
  EXPECT_EQ(static_cast<char*>(backend_->frame_pointer(Tier::kGpu, 1)) -
                static_cast<char*>(backend_->frame_pointer(Tier::kGpu, 0)),
            static_cast<ptrdiff_t>(kFrameBytes));
  Result<int> missing = backend_->export_gpu_frame(kGpuFrames);
  EXPECT_EQ(missing.status().code(), StatusCode::OUT_OF_RANGE);

  // A slab's fd maps the same bytes the daemon sees, and cannot be resized.
  uint32_t slab = 2;
  FrameIndex first = slab * backend_->host_slab_frames();
  Result<int> host_fd = backend_->export_host_slab(slab);
  ASSERT_TRUE(host_fd.ok()) << host_fd.status().to_string();
  void* mapped = mmap(nullptr, kFrameBytes, PROT_READ | PROT_WRITE, MAP_SHARED, host_fd.value(), 0);
  ASSERT_NE(mapped, MAP_FAILED);
  fill_random(backend_->frame_pointer(Tier::kHost, first), kFrameBytes, 77);
  EXPECT_EQ(std::memcmp(mapped, backend_->frame_pointer(Tier::kHost, first), kFrameBytes), 0);
  EXPECT_NE(ftruncate(host_fd.value(), 4096), 0) << "a client must not be able to shrink a host slab";
  munmap(mapped, kFrameBytes);
  close(host_fd.value());
}

// Renewal gives a GPU frame and a slab fresh zeroed memory; a descriptor exported before reaches
// only the old memory.
// A descriptor of `slab` exported before its memory changes hands, mapped and written (frame 0 of
// the slab): what an earlier holder keeps.
struct OldSlabView {
  int fd = -1;
  void* view = MAP_FAILED;
  ~OldSlabView() {
    if (view != MAP_FAILED) munmap(view, kFrameBytes);
    if (fd >= 0) close(fd);
  }
};

void keep_old_view(DeviceBackend& backend, uint32_t slab, uint64_t seed, OldSlabView& old) {
  Result<int> fd = backend.export_host_slab(slab);
  ASSERT_TRUE(fd.ok()) << fd.status().to_string();
  old.fd = fd.value();
  old.view = mmap(nullptr, kFrameBytes, PROT_READ | PROT_WRITE, MAP_SHARED, old.fd, 0);
  ASSERT_NE(old.view, MAP_FAILED);
  fill_random(old.view, kFrameBytes, seed);
}

// Renews `slab` and checks its first frame holds zeros, also after the old holder writes again.
void renew_and_expect_zeros(DeviceBackend& backend, uint32_t slab, OldSlabView& old, uint64_t seed) {
  Completion renewed;
  ASSERT_TRUE(backend.renew(Tier::kHost, slab, renewed.callback()).ok());
  ASSERT_TRUE(renewed.wait().ok());
  const void* first = backend.frame_pointer(Tier::kHost, slab * backend.host_slab_frames());
  std::vector<uint8_t> zeros(kFrameBytes, 0);
  EXPECT_EQ(std::memcmp(first, zeros.data(), kFrameBytes), 0);
  fill_random(old.view, kFrameBytes, seed);  // the old holder keeps writing
  EXPECT_EQ(std::memcmp(first, zeros.data(), kFrameBytes), 0);
}

TEST_F(CudaBackendTest, RenewalGivesFreshZeroedMemory) {
  uint64_t renewals = backend_->counters().renewals;
  std::vector<uint8_t> bytes(kFrameBytes);
  fill_random(bytes.data(), kFrameBytes, 5);
  ASSERT_EQ(cudaMemcpy(backend_->frame_pointer(Tier::kGpu, 3), bytes.data(), kFrameBytes, cudaMemcpyHostToDevice),
            cudaSuccess);
  Completion gpu_renewed;
  ASSERT_TRUE(backend_->renew(Tier::kGpu, 3, gpu_renewed.callback()).ok());
  ASSERT_TRUE(gpu_renewed.wait().ok());
  std::vector<uint8_t> after = read_gpu(backend_->frame_pointer(Tier::kGpu, 3), kFrameBytes);
  EXPECT_EQ(after, std::vector<uint8_t>(kFrameBytes, 0)) << "a renewed GPU frame must hold zeros";

  OldSlabView old;
  keep_old_view(*backend_, 1, 6, old);
  renew_and_expect_zeros(*backend_, 1, old, 7);
  EXPECT_EQ(backend_->counters().renewals, renewals + 2);
  EXPECT_EQ(backend_->renew(Tier::kGpu, kGpuFrames, [](Status) {}).code(), StatusCode::OUT_OF_RANGE);
}

// Note [One host pool for a node]: a released slab has no memory behind it (no descriptor, its
// place unmapped) until it is renewed, and then holds zeros, is pinned (copies from it run), and
// is unreachable through a descriptor exported before the release.
TEST_F(CudaBackendTest, AReleasedSlabIsUnbackedUntilRenewedAndThenZero) {
  uint32_t slab = 0;
  FrameIndex first = slab * backend_->host_slab_frames();
  OldSlabView old;
  keep_old_view(*backend_, slab, 11, old);
  Completion released;
  ASSERT_TRUE(backend_->release_host_slab(slab, released.callback()).ok());
  ASSERT_TRUE(released.wait().ok());
  EXPECT_EQ(backend_->export_host_slab(slab).status().code(), StatusCode::FAILED_PRECONDITION);
  renew_and_expect_zeros(*backend_, slab, old, 12);
  fill_random(backend_->frame_pointer(Tier::kHost, first), kFrameBytes, 13);
  CopyOp op{Tier::kHost, first, 0, Tier::kGpu, 0, 0, kFrameBytes};
  Completion copied;
  ASSERT_TRUE(backend_->enqueue_copies({op}, copied.callback()).ok());
  ASSERT_TRUE(copied.wait().ok());
  std::vector<uint8_t> gpu = read_gpu(backend_->frame_pointer(Tier::kGpu, 0), kFrameBytes);
  EXPECT_EQ(std::memcmp(gpu.data(), backend_->frame_pointer(Tier::kHost, first), kFrameBytes), 0);
  EXPECT_EQ(backend_->release_host_slab(uint32_t(backend_->host_slab_count()), [](Status) {}).code(),
            StatusCode::OUT_OF_RANGE);
}

// Pages of `page_bytes` go host -> GPU in a shuffled order (so merging only joins what is
// really adjacent), then GPU -> other host frames; every byte must survive both trips.
void round_trip(DeviceBackend& backend, uint64_t page_bytes, uint64_t seed) {
  const uint64_t frames = 8;
  const uint64_t pages = frames * kFrameBytes / page_bytes;
  for (uint64_t frame = 0; frame < frames; ++frame) {
    fill_random(backend.frame_pointer(Tier::kHost, frame), kFrameBytes, seed + frame);
    std::memset(backend.frame_pointer(Tier::kHost, frames + frame), 0xAB, kFrameBytes);
  }
  // Page p of the source goes to GPU page destination[p]; runs of 4 pages stay together.
  std::vector<uint64_t> destination(pages);
  std::iota(destination.begin(), destination.end(), 0);
  std::mt19937_64 generator(seed);
  for (uint64_t run = 0; run + 4 <= pages; run += 4) {
    uint64_t other = (generator() % (pages / 4)) * 4;
    for (uint64_t i = 0; i < 4; ++i) std::swap(destination[run + i], destination[other + i]);
  }
  auto page_op = [&](Tier source_tier, uint64_t source_page, uint64_t source_frame_base, Tier dest_tier,
                     uint64_t dest_page, uint64_t dest_frame_base) {
    CopyOp op;
    op.src_tier = source_tier;
    op.src_frame = static_cast<FrameIndex>(source_frame_base + source_page * page_bytes / kFrameBytes);
    op.src_offset = source_page * page_bytes % kFrameBytes;
    op.dst_tier = dest_tier;
    op.dst_frame = static_cast<FrameIndex>(dest_frame_base + dest_page * page_bytes / kFrameBytes);
    op.dst_offset = dest_page * page_bytes % kFrameBytes;
    op.bytes = page_bytes;
    return op;
  };
  std::vector<CopyOp> in;
  for (uint64_t page = 0; page < pages; ++page) in.push_back(page_op(Tier::kHost, page, 0, Tier::kGpu, destination[page], 0));
  Completion prefetched;
  ASSERT_TRUE(backend.enqueue_copies(in, prefetched.callback()).ok());
  ASSERT_TRUE(prefetched.wait().ok());

  // The GPU frames hold the pages where they were sent.
  std::vector<uint8_t> gpu = read_gpu(backend.frame_pointer(Tier::kGpu, 0), frames * kFrameBytes);
  auto* source = static_cast<uint8_t*>(backend.frame_pointer(Tier::kHost, 0));
  uint64_t wrong_pages = 0;
  for (uint64_t page = 0; page < pages; ++page) {
    if (std::memcmp(gpu.data() + destination[page] * page_bytes, source + page * page_bytes, page_bytes) != 0) ++wrong_pages;
  }
  EXPECT_EQ(wrong_pages, 0u) << "pages of " << page_bytes << " bytes corrupted on the way in";

  std::vector<CopyOp> out;
  for (uint64_t page = 0; page < pages; ++page) out.push_back(page_op(Tier::kGpu, destination[page], 0, Tier::kHost, page, frames));
  Completion offloaded;
  ASSERT_TRUE(backend.enqueue_copies(out, offloaded.callback()).ok());
  ASSERT_TRUE(offloaded.wait().ok());
  EXPECT_EQ(std::memcmp(backend.frame_pointer(Tier::kHost, frames), source, frames * kFrameBytes), 0)
      << "pages of " << page_bytes << " bytes corrupted on the way out";
}

TEST_F(CudaBackendTest, PagesRoundTripAtEveryPageSize) {
  uint64_t seed = std::random_device{}();
  for (uint64_t page_bytes : {64ull << 10, 256ull << 10, 2ull << 20}) {
    SCOPED_TRACE(page_bytes);
    round_trip(*backend_, page_bytes, seed + page_bytes);
  }
}

// The round trips above hand each batch's scattered copies to the driver in one
// cudaMemcpyBatchAsync call (Note [Copies handed over in one call]) and see batches complete through
// the streams' completion words (Note [Completion words]); the same round trips with one driver
// call per copy, and with a CUDA event per batch.
class CudaBackendOptions : public ::testing::TestWithParam<bool> {};

TEST_P(CudaBackendOptions, PagesRoundTrip) {
  BackendConfig config = small_config();
  if (GetParam()) {
    config.batch_copies = false;
  } else {
    config.completion_words = false;
  }
  Result<std::unique_ptr<DeviceBackend>> made = make_cuda_backend(config);
  if (!made.ok() && made.status().code() == StatusCode::UNAVAILABLE) GTEST_SKIP() << made.status().to_string();
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  prepare_slabs(*made.value());
  uint64_t seed = std::random_device{}();
  for (uint64_t page_bytes : {64ull << 10, 2ull << 20}) {
    SCOPED_TRACE(page_bytes);
    round_trip(*made.value(), page_bytes, seed + page_bytes);
  }
}

INSTANTIATE_TEST_SUITE_P(CudaBackendCopies, CudaBackendOptions, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return std::string(info.param ? "OneDriverCallPerCopy" : "CompletionEvents");
                         });

TEST_F(CudaBackendTest, CountersSayWhatWasIssued) {
  BackendCounters before = backend_->counters();
  uint64_t seed = std::random_device{}();
  round_trip(*backend_, 64ull << 10, seed);
  BackendCounters after = backend_->counters();
  uint64_t pages = (kGpuFrames / 2) * (kFrameBytes / (64ull << 10));
  EXPECT_EQ(after.copy_ops - before.copy_ops, 2 * pages);   // in and out
  EXPECT_EQ(after.bytes_copied - before.bytes_copied, 2 * pages * (64ull << 10));
  EXPECT_GT(after.transfers - before.transfers, 2u);         // scattered runs of 4 pages: many transfers
  EXPECT_LT(after.transfers - before.transfers, 2 * pages);  // merged where adjacent
}

TEST_F(CudaBackendTest, BothDirectionsInOneBatch) {
  uint64_t seed = std::random_device{}();
  // GPU frames 0..3 get host frames 0..3 while GPU frames 4..7 (filled first) go to host 8..11.
  for (uint64_t frame = 0; frame < 4; ++frame) {
    fill_random(backend_->frame_pointer(Tier::kHost, frame), kFrameBytes, seed + frame);
    fill_random(backend_->frame_pointer(Tier::kHost, 4 + frame), kFrameBytes, seed + 100 + frame);
  }
  std::vector<CopyOp> setup;
  for (FrameIndex frame = 0; frame < 4; ++frame) {
    setup.push_back(CopyOp{Tier::kHost, 4 + frame, 0, Tier::kGpu, 4 + frame, 0, kFrameBytes});
  }
  Completion ready;
  ASSERT_TRUE(backend_->enqueue_copies(setup, ready.callback()).ok());
  ASSERT_TRUE(ready.wait().ok());

  std::vector<CopyOp> both;
  for (FrameIndex frame = 0; frame < 4; ++frame) {
    both.push_back(CopyOp{Tier::kHost, frame, 0, Tier::kGpu, frame, 0, kFrameBytes});
    both.push_back(CopyOp{Tier::kGpu, 4 + frame, 0, Tier::kHost, 8 + frame, 0, kFrameBytes});
  }
  Completion moved;
  ASSERT_TRUE(backend_->enqueue_copies(both, moved.callback()).ok());
  ASSERT_TRUE(moved.wait().ok());
  EXPECT_EQ(moved.calls(), 1);
  std::vector<uint8_t> gpu = read_gpu(backend_->frame_pointer(Tier::kGpu, 0), 4 * kFrameBytes);
  EXPECT_EQ(std::memcmp(gpu.data(), backend_->frame_pointer(Tier::kHost, 0), 4 * kFrameBytes), 0);
  EXPECT_EQ(std::memcmp(backend_->frame_pointer(Tier::kHost, 8), backend_->frame_pointer(Tier::kHost, 4),
                        4 * kFrameBytes), 0);
}

TEST_F(CudaBackendTest, ZeroFillsExactlyTheRange) {
  uint64_t seed = std::random_device{}();
  fill_random(backend_->frame_pointer(Tier::kHost, 0), kFrameBytes, seed);
  fill_random(backend_->frame_pointer(Tier::kHost, 1), kFrameBytes, seed + 1);
  std::vector<uint8_t> expected(static_cast<uint8_t*>(backend_->frame_pointer(Tier::kHost, 0)),
                                static_cast<uint8_t*>(backend_->frame_pointer(Tier::kHost, 0)) + kFrameBytes);
  Completion loaded;
  ASSERT_TRUE(backend_->enqueue_copies({CopyOp{Tier::kHost, 0, 0, Tier::kGpu, 2, 0, kFrameBytes}}, loaded.callback()).ok());
  ASSERT_TRUE(loaded.wait().ok());

  const uint64_t offset = 192 << 10, bytes = 320 << 10;
  Completion gpu_zeroed, host_zeroed;
  ASSERT_TRUE(backend_->enqueue_zero(Tier::kGpu, 2, offset, bytes, gpu_zeroed.callback()).ok());
  ASSERT_TRUE(backend_->enqueue_zero(Tier::kHost, 1, offset, bytes, host_zeroed.callback()).ok());
  ASSERT_TRUE(gpu_zeroed.wait().ok());
  ASSERT_TRUE(host_zeroed.wait().ok());

  std::fill(expected.begin() + offset, expected.begin() + offset + bytes, 0);
  std::vector<uint8_t> gpu = read_gpu(backend_->frame_pointer(Tier::kGpu, 2), kFrameBytes);
  EXPECT_EQ(gpu, expected);
  std::vector<uint8_t> host_expected(kFrameBytes);
  fill_random(host_expected.data(), kFrameBytes, seed + 1);
  std::fill(host_expected.begin() + offset, host_expected.begin() + offset + bytes, 0);
  EXPECT_EQ(std::memcmp(backend_->frame_pointer(Tier::kHost, 1), host_expected.data(), kFrameBytes), 0);
}

TEST_F(CudaBackendTest, SignalWordFollowsEveryEarlierCopy) {
  Result<uint32_t> block = backend_->create_signal_block(8);
  ASSERT_TRUE(block.ok()) << block.status().to_string();
  volatile uint64_t* words = backend_->signal_words(block.value());
  ASSERT_NE(words, nullptr);
  EXPECT_EQ(words[0], 0u);
  uint64_t seed = std::random_device{}();
  auto wait_for_word = [&](uint32_t index, uint64_t value) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (words[index] < value && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    return words[index] == value;
  };
  for (uint64_t round = 1; round <= 20; ++round) {
    // Offload: the copy streams are independent, so the offload starts after the prefetch
    // of the same frames has completed (the engine's rule too).
    fill_random(backend_->frame_pointer(Tier::kHost, 0), 4 * kFrameBytes, seed + round);
    Completion in, out;
    ASSERT_TRUE(backend_->enqueue_copies({CopyOp{Tier::kHost, 0, 0, Tier::kGpu, 0, 0, 4 * kFrameBytes}}, in.callback()).ok());
    ASSERT_TRUE(in.wait().ok());
    ASSERT_TRUE(backend_->enqueue_copies({CopyOp{Tier::kGpu, 0, 0, Tier::kHost, 8, 0, 4 * kFrameBytes}}, out.callback()).ok());
    ASSERT_TRUE(backend_->enqueue_signal(block.value(), 3, round).ok());
    // The CPU sees the word change without any callback, and then the data must be there.
    ASSERT_TRUE(wait_for_word(3, round));
    EXPECT_EQ(std::memcmp(backend_->frame_pointer(Tier::kHost, 8), backend_->frame_pointer(Tier::kHost, 0),
                          4 * kFrameBytes), 0) << "round " << round;
    ASSERT_TRUE(out.wait().ok());

    // Prefetch: when the word changes, the GPU frames hold the new bytes.
    fill_random(backend_->frame_pointer(Tier::kHost, 4), 4 * kFrameBytes, seed + 1000 + round);
    Completion prefetched;
    ASSERT_TRUE(backend_->enqueue_copies({CopyOp{Tier::kHost, 4, 0, Tier::kGpu, 4, 0, 4 * kFrameBytes}}, prefetched.callback()).ok());
    ASSERT_TRUE(backend_->enqueue_signal(block.value(), 4, round).ok());
    ASSERT_TRUE(wait_for_word(4, round));
    std::vector<uint8_t> gpu = read_gpu(backend_->frame_pointer(Tier::kGpu, 4), 4 * kFrameBytes);
    EXPECT_EQ(std::memcmp(gpu.data(), backend_->frame_pointer(Tier::kHost, 4), 4 * kFrameBytes), 0) << "round " << round;
    ASSERT_TRUE(prefetched.wait().ok());
  }
  Result<int> fd = backend_->export_signal_block(block.value());
  ASSERT_TRUE(fd.ok());
  auto* mapped = static_cast<volatile uint64_t*>(mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd.value(), 0));
  ASSERT_NE(static_cast<void*>(const_cast<uint64_t*>(mapped)), MAP_FAILED);
  EXPECT_EQ(mapped[3], 20u) << "another mapping of the block sees the same word";
  munmap(const_cast<uint64_t*>(mapped), 4096);
  close(fd.value());

  EXPECT_EQ(backend_->enqueue_signal(block.value(), 8, 1).code(), StatusCode::OUT_OF_RANGE);
  EXPECT_TRUE(backend_->destroy_signal_block(block.value()).ok());
  EXPECT_EQ(backend_->signal_words(block.value()), nullptr);
  EXPECT_EQ(backend_->enqueue_signal(block.value(), 0, 1).code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(backend_->destroy_signal_block(block.value()).code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(backend_->create_signal_block(0).status().code(), StatusCode::INVALID_ARGUMENT);
}

TEST_F(CudaBackendTest, EveryBatchCompletesExactlyOnce) {
  std::atomic<int> completions{0}, failures{0};
  const int batches = 300;
  std::mt19937 generator(std::random_device{}());
  for (int batch = 0; batch < batches; ++batch) {
    std::vector<CopyOp> ops;
    int count = static_cast<int>(generator() % 4);  // empty batches too
    for (int i = 0; i < count; ++i) {
      bool inbound = generator() % 2 == 0;
      FrameIndex gpu = generator() % kGpuFrames, host = generator() % kHostFrames;
      uint64_t offset = (generator() % 32) * (64 << 10);
      ops.push_back(inbound ? CopyOp{Tier::kHost, host, offset, Tier::kGpu, gpu, offset, 64 << 10}
                            : CopyOp{Tier::kGpu, gpu, offset, Tier::kHost, host, offset, 64 << 10});
    }
    ASSERT_TRUE(backend_->enqueue_copies(std::move(ops), [&](Status status) {
      if (!status.ok()) ++failures;
      ++completions;
    }).ok());
  }
  backend_->drain();
  EXPECT_EQ(completions.load(), batches);
  EXPECT_EQ(failures.load(), 0);
}

TEST_F(CudaBackendTest, BadInputIsRefusedAndNeverCompletes) {
  Completion never;
  auto refused = [&](std::vector<CopyOp> ops) { return backend_->enqueue_copies(std::move(ops), never.callback()).code(); };
  EXPECT_EQ(refused({CopyOp{Tier::kHost, kHostFrames, 0, Tier::kGpu, 0, 0, 4096}}), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(refused({CopyOp{Tier::kHost, 0, 0, Tier::kGpu, kGpuFrames, 0, 4096}}), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(refused({CopyOp{Tier::kHost, 0, kFrameBytes, Tier::kGpu, 0, 0, 4096}}), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(refused({CopyOp{Tier::kHost, kHostFrames - 1, 4096, Tier::kGpu, 0, 0, kFrameBytes}}), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(refused({CopyOp{Tier::kHost, 0, 0, Tier::kGpu, 0, 0, 0}}), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(refused({CopyOp{static_cast<Tier>(7), 0, 0, Tier::kGpu, 0, 0, 4096}}), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(backend_->enqueue_copies({}, nullptr).code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(backend_->enqueue_zero(Tier::kGpu, kGpuFrames, 0, 4096, never.callback()).code(), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(backend_->enqueue_zero(Tier::kHost, 0, 0, 0, never.callback()).code(), StatusCode::INVALID_ARGUMENT);
  backend_->drain();
  EXPECT_EQ(never.calls(), 0);
}

TEST(CudaBackendFaults, NthFrameFailsAsResourceExhaustedAndLeaksNothing) {
  BackendConfig config = small_config();
  {
    Result<std::unique_ptr<DeviceBackend>> probe = make_cuda_backend(config);
    if (!probe.ok() && probe.status().code() == StatusCode::UNAVAILABLE) GTEST_SKIP() << probe.status().to_string();
    ASSERT_TRUE(probe.ok()) << probe.status().to_string();
  }
  size_t free_before = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);

  // Only GPU frames are made at start-up (host slabs are prepared later, by renewals).
  for (uint64_t failing : {uint64_t{1}, uint64_t{5}, kGpuFrames}) {
    SCOPED_TRACE(failing);
    config.fail_frame_create_after = failing;
    Result<std::unique_ptr<DeviceBackend>> made = make_cuda_backend(config);
    ASSERT_FALSE(made.ok());
    EXPECT_EQ(made.status().code(), StatusCode::RESOURCE_EXHAUSTED) << made.status().to_string();
    EXPECT_FALSE(made.status().message().empty());
  }
  // Every frame made before the failure was released: free GPU memory is back where it was
  // (2 MiB of slack for the driver's own bookkeeping).
  size_t free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  EXPECT_LE(free_before, free_after + (2ull << 20)) << "frames leaked by failed start-ups";

  config.fail_frame_create_after = kGpuFrames + 1;
  Result<std::unique_ptr<DeviceBackend>> healthy = make_cuda_backend(config);
  EXPECT_TRUE(healthy.ok()) << healthy.status().to_string();
}

// Note [Renewal when memory is short]: GPU frame renewals that fail for memory (injected) are tried
// again and end with a zeroed frame; past the patience the renewal reports RESOURCE_EXHAUSTED.
TEST(CudaBackendFaults, RenewalsShortOfMemoryAreTriedAgain) {
  for (bool patient : {true, false}) {
    SCOPED_TRACE(patient ? "a short shortage" : "a shortage longer than the patience");
    BackendConfig config = small_config();
    config.fail_renewal_attempts = patient ? 3 : 1u << 30;
    config.renewal_patience_ms = patient ? 60000 : 50;
    Result<std::unique_ptr<DeviceBackend>> made = make_cuda_backend(config);
    if (!made.ok() && made.status().code() == StatusCode::UNAVAILABLE) GTEST_SKIP() << made.status().to_string();
    ASSERT_TRUE(made.ok()) << made.status().to_string();
    DeviceBackend& backend = *made.value();
    std::vector<uint8_t> bytes(kFrameBytes);
    fill_random(bytes.data(), kFrameBytes, 21);
    ASSERT_EQ(cudaMemcpy(backend.frame_pointer(Tier::kGpu, 2), bytes.data(), kFrameBytes, cudaMemcpyHostToDevice),
              cudaSuccess);
    Completion renewed;
    ASSERT_TRUE(backend.renew(Tier::kGpu, 2, renewed.callback()).ok());
    Status status = renewed.wait();
    if (patient) {
      ASSERT_TRUE(status.ok()) << status.to_string();
      EXPECT_EQ(read_gpu(backend.frame_pointer(Tier::kGpu, 2), kFrameBytes), std::vector<uint8_t>(kFrameBytes, 0));
    } else {
      EXPECT_EQ(status.code(), StatusCode::RESOURCE_EXHAUSTED) << status.to_string();
    }
  }
}

}  // namespace
}  // namespace membar::runtimed
