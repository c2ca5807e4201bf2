// The client's CUDA window and stream signals against a CudaVmmBackend in the same process
// (label gpu): frames exported as fds map on demand, both sides see each other's bytes, a
// client stream really waits for the daemon's signal, and bad calls get clear errors.
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
#include "window.h"
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

class CudaWindowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    BackendConfig config;
    config.gpu_pool_bytes = 8 * kFrameBytes;
    config.host_pool_bytes = 8 * kFrameBytes;
    Result<std::unique_ptr<DeviceBackend>> made = runtimed::make_cuda_backend(config);
    if (!made.ok() && made.status().code() == StatusCode::UNAVAILABLE) {
      GTEST_SKIP() << "no usable CUDA GPU: " << made.status().to_string();
    }
    ASSERT_TRUE(made.ok()) << made.status().to_string();
    backend_ = std::move(made).value();
    Result<std::unique_ptr<Window>> window = make_cuda_window(16, 0);
    ASSERT_TRUE(window.ok()) << window.status().to_string();
    window_ = std::move(window).value();
  }
  void TearDown() override {
    window_.reset();
    backend_.reset();
  }
  char* window_frame(uint32_t frame) { return static_cast<char*>(window_->base()) + frame * kFrameBytes; }

  std::unique_ptr<DeviceBackend> backend_;
  std::unique_ptr<Window> window_;
};

TEST_F(CudaWindowTest, MappedFramesShareBytesBothWays) {
  EXPECT_EQ(window_->bytes(), 16 * kFrameBytes);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(window_->base()) % kFrameBytes, 0u);
  uint64_t seed = std::random_device{}();
  std::vector<uint8_t> bytes(kFrameBytes), seen(kFrameBytes);

  for (int round = 0; round < 3; ++round) {
    // Backend frame 5 appears at window frame 3 (and frame 6 at window frame 15).
    fill_random(bytes.data(), kFrameBytes, seed + round);
    ASSERT_EQ(cudaMemcpy(backend_->frame_pointer(Tier::kGpu, 5), bytes.data(), kFrameBytes, cudaMemcpyHostToDevice), cudaSuccess);
    Result<int> fd = backend_->export_frame(Tier::kGpu, 5);
    ASSERT_TRUE(fd.ok()) << fd.status().to_string();
    ASSERT_TRUE(window_->map_frame(3, fd.value()).ok());
    Result<int> other = backend_->export_frame(Tier::kGpu, 6);
    ASSERT_TRUE(other.ok());
    ASSERT_TRUE(window_->map_frame(15, other.value()).ok());
    EXPECT_TRUE(window_->is_mapped(3));
    EXPECT_FALSE(window_->is_mapped(4));
    ASSERT_EQ(cudaMemcpy(seen.data(), window_frame(3), kFrameBytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(seen, bytes);

    // Writes through the window land in the daemon's frame.
    fill_random(bytes.data(), kFrameBytes, seed + 100 + round);
    ASSERT_EQ(cudaMemcpy(window_frame(15), bytes.data(), kFrameBytes, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(seen.data(), backend_->frame_pointer(Tier::kGpu, 6), kFrameBytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(seen, bytes);

    EXPECT_TRUE(window_->unmap_frame(3).ok());
    EXPECT_TRUE(window_->unmap_frame(15).ok());
    EXPECT_FALSE(window_->is_mapped(3));
  }
}

TEST_F(CudaWindowTest, BadCallsGetClearErrors) {
  Result<int> fd = backend_->export_frame(Tier::kGpu, 0);
  ASSERT_TRUE(fd.ok());
  EXPECT_EQ(window_->map_frame(16, fd.value()).code(), StatusCode::OUT_OF_RANGE);  // closes the fd
  fd = backend_->export_frame(Tier::kGpu, 0);
  ASSERT_TRUE(fd.ok());
  ASSERT_TRUE(window_->map_frame(2, fd.value()).ok());
  fd = backend_->export_frame(Tier::kGpu, 1);
  ASSERT_TRUE(fd.ok());
  EXPECT_EQ(window_->map_frame(2, fd.value()).code(), StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(window_->unmap_frame(7).code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(window_->unmap_frame(99).code(), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(window_->map_frame(4, -1).code(), StatusCode::INVALID_ARGUMENT);
  // A host frame's memfd is not a CUDA allocation: refused, window frame left unmapped.
  Result<int> host_fd = backend_->export_frame(Tier::kHost, 0);
  ASSERT_TRUE(host_fd.ok());
  Status wrong = window_->map_frame(5, host_fd.value());
  EXPECT_FALSE(wrong.ok());
  EXPECT_FALSE(window_->is_mapped(5));
  EXPECT_NE(wrong.message().find("cuMemImportFromShareableHandle"), std::string::npos) << wrong.to_string();
  EXPECT_EQ(make_cuda_window(0, 0).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(make_cuda_window(1, 1000).status().code(), StatusCode::INVALID_ARGUMENT);
}

// The client maps its signal block from the fd, registers it, and its stream waits on the GPU
// for the daemon's signal; the client's own write comes back to the daemon's CPU view.
TEST_F(CudaWindowTest, ClientStreamWaitsForTheDaemonsSignal) {
  Result<uint32_t> block = backend_->create_signal_block(8);
  ASSERT_TRUE(block.ok()) << block.status().to_string();
  Result<int> signal_fd = backend_->export_signal_block(block.value());
  ASSERT_TRUE(signal_fd.ok());
  void* mapped = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, signal_fd.value(), 0);
  close(signal_fd.value());
  ASSERT_NE(mapped, MAP_FAILED);
  Result<std::unique_ptr<StreamSignals>> signals = StreamSignals::create(static_cast<volatile uint64_t*>(mapped), 8, 0);
  ASSERT_TRUE(signals.ok()) << signals.status().to_string();

  Result<int> fd = backend_->export_frame(Tier::kGpu, 2);
  ASSERT_TRUE(fd.ok());
  ASSERT_TRUE(window_->map_frame(0, fd.value()).ok());
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
    ASSERT_EQ(cudaMemcpyAsync(seen, window_frame(0), kFrameBytes, cudaMemcpyDeviceToHost, stream), cudaSuccess);
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
