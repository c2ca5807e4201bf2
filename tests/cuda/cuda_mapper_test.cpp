// The client's CUDA memory (libclient/memory.h on the CUDA mapper) and stream signals against a
// CudaVmmBackend in the same process (label gpu): granted frames are imported once and mapped at
// space positions (Note [Space layout]); both sides see each other's bytes; one frame may serve
// several positions at once (the mapping cache, Note [Remapping a position]); a revoke unmaps it
// everywhere; a client stream really waits for the daemon's signal; bad calls get clear errors.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "cuda/stream_signal.h"
#include "memory.h"
#include "membar/engine/backend.h"

namespace membar {
namespace {

using runtimed::BackendConfig;
using runtimed::CopyOp;
using runtimed::DeviceBackend;

void fill_random(void* pointer, uint64_t bytes, uint64_t seed) {
  std::mt19937_64 generator(seed);
  auto* words = static_cast<uint64_t*>(pointer);
  for (uint64_t i = 0; i < bytes / 8; ++i) words[i] = generator();
}

class CudaMapperTest : public ::testing::Test {
 protected:
  void SetUp() override {
    BackendConfig config;
    config.gpu_pool_bytes = 8 * kFrameBytes;
    config.host_pool_bytes = 8 * kFrameBytes;
    config.host_slab_frames = 2;
    Result<std::unique_ptr<DeviceBackend>> made = runtimed::make_cuda_backend(config);
    if (!made.ok() && made.status().code() == StatusCode::UNAVAILABLE) {
      GTEST_SKIP() << "no usable CUDA GPU: " << made.status().to_string();
    }
    ASSERT_TRUE(made.ok()) << made.status().to_string();
    backend_ = std::move(made).value();
    for (uint32_t slab = 0; slab < backend_->host_slab_count(); ++slab) {
      std::atomic<bool> done{false};
      ASSERT_TRUE(backend_->renew(Tier::kHost, slab, [&](Status status) {
        EXPECT_TRUE(status.ok()) << status.to_string();
        done = true;
      }).ok());
      while (!done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    Result<std::unique_ptr<FrameMapper>> mapper = make_cuda_mapper(0);
    ASSERT_TRUE(mapper.ok()) << mapper.status().to_string();
    memory_ = std::make_unique<ClientMemory>(std::move(mapper).value(), make_mmap_mapper(), 2);
  }
  void TearDown() override {
    memory_.reset();
    backend_.reset();
  }
  // Grants GPU frame `frame` of the pool as the client's window frame `window`.
  void grant(uint32_t window, FrameIndex frame) {
    Result<int> fd = backend_->export_gpu_frame(frame);
    ASSERT_TRUE(fd.ok()) << fd.status().to_string();
    ASSERT_TRUE(memory_->gpu_frame_granted(window, fd.value()).ok());
  }
  char* gpu_page(SpaceId space, uint32_t space_frame) {
    return static_cast<char*>(memory_->view(space).value().gpu) + uint64_t(space_frame) * kFrameBytes;
  }

  std::unique_ptr<DeviceBackend> backend_;
  std::unique_ptr<ClientMemory> memory_;
};

TEST_F(CudaMapperTest, MappedFramesShareBytesBothWaysAtTheirPositions) {
  ASSERT_TRUE(memory_->add_space(1, 96 << 10, 64).ok());  // 6 MiB: three space frames
  SpaceView view = memory_->view(1).value();
  EXPECT_EQ(reinterpret_cast<uintptr_t>(view.gpu) % kFrameBytes, 0u);
  EXPECT_EQ(view.bytes, 64ull * (96 << 10));
  uint64_t seed = std::random_device{}();
  std::vector<uint8_t> bytes(kFrameBytes), seen(kFrameBytes);
  grant(0, 5);
  grant(1, 6);
  for (int round = 0; round < 3; ++round) {
    // Pool frame 5 (window 0) appears at space frame 2, pool frame 6 (window 1) at space frame 0.
    fill_random(bytes.data(), kFrameBytes, seed + round);
    ASSERT_EQ(cudaMemcpy(backend_->frame_pointer(Tier::kGpu, 5), bytes.data(), kFrameBytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_TRUE(memory_->mapped(Tier::kGpu, 0, 1, 2).ok());
    ASSERT_TRUE(memory_->mapped(Tier::kGpu, 1, 1, 0).ok());
    ASSERT_EQ(cudaMemcpy(seen.data(), gpu_page(1, 2), kFrameBytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(seen, bytes);
    // Writes at a position land in the daemon's frame.
    fill_random(bytes.data(), kFrameBytes, seed + 100 + round);
    ASSERT_EQ(cudaMemcpy(gpu_page(1, 0), bytes.data(), kFrameBytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(seen.data(), backend_->frame_pointer(Tier::kGpu, 6), kFrameBytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(seen, bytes);
    // One contiguous range across the two mapped positions and the frame between them.
    ASSERT_TRUE(memory_->mapped(Tier::kGpu, 0, 1, 1).ok());  // the same frame at a second position
    std::vector<uint8_t> range(3 * kFrameBytes);
    ASSERT_EQ(cudaMemcpy(range.data(), view.gpu, 3 * kFrameBytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(std::memcmp(range.data() + kFrameBytes, range.data() + 2 * kFrameBytes, kFrameBytes), 0);
    ASSERT_TRUE(memory_->unmapped(Tier::kGpu, 0, 1, 1).ok());
    ASSERT_TRUE(memory_->unmapped(Tier::kGpu, 0, 1, 2).ok());
    ASSERT_TRUE(memory_->unmapped(Tier::kGpu, 1, 1, 0).ok());
  }
  // A revoke unmaps the frame at every position it serves.
  ASSERT_TRUE(memory_->mapped(Tier::kGpu, 0, 1, 0).ok());
  ASSERT_TRUE(memory_->mapped(Tier::kGpu, 0, 1, 2).ok());
  ASSERT_TRUE(memory_->gpu_frame_revoked(0).ok());
  EXPECT_FALSE(memory_->mapped(Tier::kGpu, 0, 1, 1).ok()) << "a revoked frame cannot be mapped again";
  ASSERT_TRUE(memory_->remove_space(1).ok());
}

// Note [Maps off the caller's thread]: the CUDA mapper maps a run of adjacent positions with one
// cuMemSetAccess over the run; the run reads and writes as one range, and each position unmaps
// on its own afterwards.
TEST_F(CudaMapperTest, ARunOfAdjacentFramesMapsWithOneAccessCall) {
  Result<std::unique_ptr<FrameMapper>> made = make_cuda_mapper(0);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  std::unique_ptr<FrameMapper> mapper = std::move(made).value();
  Result<char*> base = mapper->reserve(4 * kFrameBytes);
  ASSERT_TRUE(base.ok()) << base.status().to_string();
  uint64_t seed = std::random_device{}();
  std::vector<uint32_t> run;
  for (uint32_t i = 0; i < 3; ++i) {
    Result<int> fd = backend_->export_gpu_frame(2 + i);
    ASSERT_TRUE(fd.ok()) << fd.status().to_string();
    ASSERT_TRUE(mapper->adopt_frame(10 + i, fd.value()).ok());
    run.push_back(10 + i);
  }
  std::vector<uint8_t> bytes(3 * kFrameBytes), seen(3 * kFrameBytes);
  fill_random(bytes.data(), bytes.size(), seed);
  ASSERT_TRUE(mapper->map_run(run.data(), run.size(), base.value() + kFrameBytes).ok());
  ASSERT_EQ(cudaMemcpy(base.value() + kFrameBytes, bytes.data(), bytes.size(), cudaMemcpyHostToDevice), cudaSuccess);
  for (uint32_t i = 0; i < 3; ++i) {   // each position's bytes are in its own pool frame
    ASSERT_EQ(cudaMemcpy(seen.data(), backend_->frame_pointer(Tier::kGpu, 2 + i), kFrameBytes, cudaMemcpyDeviceToHost),
              cudaSuccess);
    EXPECT_EQ(std::memcmp(seen.data(), bytes.data() + i * kFrameBytes, kFrameBytes), 0) << "frame " << i;
  }
  // The middle position alone goes; the others stay readable.
  ASSERT_TRUE(mapper->unmap(base.value() + 2 * kFrameBytes).ok());
  ASSERT_EQ(cudaMemcpy(seen.data(), base.value() + 3 * kFrameBytes, kFrameBytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::memcmp(seen.data(), bytes.data() + 2 * kFrameBytes, kFrameBytes), 0);
  // A run naming a frame never granted maps nothing.
  std::vector<uint32_t> bad = {10, 99};
  EXPECT_EQ(mapper->map_run(bad.data(), bad.size(), base.value() + 2 * kFrameBytes).code(), StatusCode::INTERNAL);
  ASSERT_TRUE(mapper->unmap(base.value() + kFrameBytes).ok());
  ASSERT_TRUE(mapper->unmap(base.value() + 3 * kFrameBytes).ok());
  for (uint32_t w : run) mapper->drop_frame(w);
  mapper->release(base.value(), 4 * kFrameBytes);
}

// The same events applied on ClientMemory's mapping thread (MEMBAR_ASYNC_MAPS=1): a
// settled range reads the daemon's bytes.
TEST_F(CudaMapperTest, EventsAppliedOnTheMappingThreadShareBytesOnceSettled) {
  Result<std::unique_ptr<FrameMapper>> mapper = make_cuda_mapper(0);
  ASSERT_TRUE(mapper.ok()) << mapper.status().to_string();
  memory_ = std::make_unique<ClientMemory>(std::move(mapper).value(), make_mmap_mapper(), 2, /*asynchronous=*/true);
  ASSERT_TRUE(memory_->add_space(1, kFrameBytes, 4).ok());
  SpaceView view = memory_->view(1).value();
  uint64_t seed = std::random_device{}();
  std::vector<uint8_t> bytes(4 * kFrameBytes), seen(4 * kFrameBytes);
  fill_random(bytes.data(), bytes.size(), seed);
  for (uint32_t i = 0; i < 4; ++i) {
    ASSERT_EQ(cudaMemcpy(backend_->frame_pointer(Tier::kGpu, 4 + i), bytes.data() + i * kFrameBytes, kFrameBytes,
                         cudaMemcpyHostToDevice), cudaSuccess);
    grant(i, 4 + i);
  }
  for (uint32_t i = 0; i < 4; ++i) ASSERT_TRUE(memory_->mapped(Tier::kGpu, i, 1, i).ok());
  PageRange all{1, 0, 4};
  ASSERT_TRUE(memory_->settle_ranges(&all, 1).ok());
  ASSERT_EQ(cudaMemcpy(seen.data(), view.gpu, seen.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(seen, bytes);
  MapCounters counters = memory_->counters();
  EXPECT_EQ(counters.maps, 4u);
  EXPECT_LE(counters.map_runs, 4u);
  ASSERT_TRUE(memory_->remove_space(1).ok());
}

TEST_F(CudaMapperTest, BadEventsGetClearErrors) {
  ASSERT_TRUE(memory_->add_space(1, 1 << 20, 3).ok());  // two space frames
  EXPECT_EQ(memory_->mapped(Tier::kGpu, 7, 1, 0).code(), StatusCode::INTERNAL) << "a frame never granted";
  grant(0, 0);
  EXPECT_EQ(memory_->mapped(Tier::kGpu, 0, 1, 2).code(), StatusCode::INTERNAL) << "past the space's end";
  EXPECT_EQ(memory_->mapped(Tier::kGpu, 0, 9, 0).code(), StatusCode::INTERNAL) << "a space never made";
  // A host slab's memfd is not a CUDA allocation: refused.
  Result<int> host_fd = backend_->export_host_slab(0);
  ASSERT_TRUE(host_fd.ok());
  Status wrong = memory_->gpu_frame_granted(3, host_fd.value());
  EXPECT_FALSE(wrong.ok());
  EXPECT_NE(wrong.message().find("cuMemImportFromShareableHandle"), std::string::npos) << wrong.to_string();
  EXPECT_FALSE(make_cuda_mapper(1000).ok()) << "device 1000 does not exist";
}

// The client maps its signal block from the fd, registers it, and its stream waits on the GPU
// for the daemon's signal; the client's own write comes back to the daemon's CPU view.
TEST_F(CudaMapperTest, ClientStreamWaitsForTheDaemonsSignal) {
  Result<uint32_t> block = backend_->create_signal_block(8);
  ASSERT_TRUE(block.ok()) << block.status().to_string();
  Result<int> signal_fd = backend_->export_signal_block(block.value());
  ASSERT_TRUE(signal_fd.ok());
  void* mapped = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, signal_fd.value(), 0);
  close(signal_fd.value());
  ASSERT_NE(mapped, MAP_FAILED);
  Result<std::unique_ptr<StreamSignals>> signals = StreamSignals::create(static_cast<volatile uint64_t*>(mapped), 8, 0);
  ASSERT_TRUE(signals.ok()) << signals.status().to_string();

  ASSERT_TRUE(memory_->add_space(1, kFrameBytes, 1).ok());
  grant(0, 2);
  ASSERT_TRUE(memory_->mapped(Tier::kGpu, 0, 1, 0).ok());
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  // Pinned: a copy into pageable memory would block this thread until the stream ran, and
  // the stream waits for a signal this thread has not sent yet.
  uint8_t* seen = nullptr;
  ASSERT_EQ(cudaMallocHost(&seen, kFrameBytes), cudaSuccess);
  uint64_t seed = std::random_device{}();

  for (uint64_t ticket = 1; ticket <= 5; ++ticket) {
    // The client enqueues "wait for ticket, read the page, say released" before the daemon
    // has even started the copy.
    ASSERT_TRUE(signals.value()->stream_wait(0, ticket, stream).ok());
    ASSERT_EQ(cudaMemcpyAsync(seen, gpu_page(1, 0), kFrameBytes, cudaMemcpyDeviceToHost, stream), cudaSuccess);
    ASSERT_TRUE(signals.value()->stream_write(1, ticket, stream).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(cudaStreamQuery(stream), cudaErrorNotReady) << "the client stream did not wait for the signal";

    fill_random(backend_->frame_pointer(Tier::kHost, 1), kFrameBytes, seed + ticket);
    ASSERT_TRUE(backend_->enqueue_copies({CopyOp{Tier::kHost, 1, 0, Tier::kGpu, 2, 0, kFrameBytes}}, [](Status) {}).ok());
    ASSERT_TRUE(backend_->enqueue_signal(block.value(), 0, ticket).ok());
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(std::memcmp(seen, backend_->frame_pointer(Tier::kHost, 1), kFrameBytes), 0) << "ticket " << ticket;
    EXPECT_EQ(backend_->signal_words(block.value())[1], ticket) << "the daemon sees the client's release";
    backend_->drain();
  }
  EXPECT_EQ(signals.value()->stream_wait(8, 1, stream).code(), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(StreamSignals::create(nullptr, 8, 0).status().code(), StatusCode::INVALID_ARGUMENT);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  ASSERT_EQ(cudaFreeHost(seen), cudaSuccess);
  signals = Status(StatusCode::CANCELLED, "unregistered");
  munmap(mapped, 4096);
}

}  // namespace
}  // namespace membar
