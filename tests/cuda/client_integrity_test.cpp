// Page integrity through the whole client API on the CUDA backend (label gpu): trainers write
// random pages from their CUDA streams, the runtime evicts (a GPU quota far below the space)
// and prefetches them back, and every read is checked against what was written.
//   - EmbeddedCuda: one trainer, the engine in-process (embedded:cuda).
//   - DaemonTwoProcesses: `membard --backend cuda` plus two trainer processes started from this
//     binary, each with its own space, over the socket and shared-memory rings.
//   - DaemonRenewsGpuFramesBetweenClients: a trainer fills every GPU frame of the pool and is
//     killed (-9); the next one, asking for no zero-fill, reads zeros (issue 12: GPU frames are
//     renewed before they change hands; a 96 KiB-page space checks pages that straddle frames).
// Pages move through stream_wait (the trainer's stream waits for the ticket on the GPU) and
// stream_release (the stream says when it is done with pages it wrote; the runtime holds copies
// of those pages until then, Note [Stream-ordered release]). The trainer never synchronizes its
// stream after a release, and every worker first checks that a write still queued behind a slow
// stream reaches the host copy, and that stream_release returned without waiting for it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "membar/client.h"

extern char** environ;

namespace membar {
namespace {

constexpr uint64_t kPageBytes = 256ull << 10;
constexpr uint32_t kPages = 64;     // 16 MiB per trainer
constexpr uint32_t kMaxGroup = 8;   // pages per acquire: 2 MiB
constexpr int kOperations = 400;

struct WorkerReport {
  uint64_t pages_written = 0;
  uint64_t pages_checked = 0;
  uint64_t pages_corrupted = 0;
  std::string error;
};

void fill_pattern(void* pointer, uint64_t seed, uint32_t page, uint32_t version) {
  auto* words = static_cast<uint64_t*>(pointer);
  uint64_t state = seed ^ (uint64_t{page} << 32) ^ (uint64_t{version} << 8);
  for (uint64_t i = 0; i < kPageBytes / 8; ++i) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    words[i] = z ^ (z >> 31);
  }
}

// Waits for `ticket` on the stream when the client can, else on the CPU.
Status wait_on_stream(Client& client, Ticket ticket, cudaStream_t stream) {
  Status status = client.stream_wait(ticket, stream);
  if (status.code() == StatusCode::UNIMPLEMENTED) return client.wait(ticket);
  return status;
}

void sleep_on_stream(void* milliseconds) {
  std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<uintptr_t>(milliseconds)));
}

// A write queued behind 50 ms of stream work, stream_release'd, then offloaded at once: the
// host copy must hold the write, and stream_release must not have waited for the stream.
std::string check_late_write(Client& client, SpaceId space, uint64_t seed, cudaStream_t stream, uint8_t* staging) {
  PageRange range{space, 0, 1};
  Result<Acquired> acquired = client.acquire(range, kAcquireWrite | kAcquireZeroNew);
  if (!acquired.ok()) return "late write acquire: " + acquired.status().to_string();
  if (!client.stream_wait(acquired.value().ticket, stream).ok()) return "late write stream_wait failed";
  fill_pattern(staging, seed, 0, 1);
  cudaLaunchHostFunc(stream, sleep_on_stream, reinterpret_cast<void*>(uintptr_t{50}));
  cudaMemcpyAsync(acquired.value().pointer, staging, kPageBytes, cudaMemcpyHostToDevice, stream);
  auto start = std::chrono::steady_clock::now();
  Status released = client.stream_release(range, true, stream);
  double release_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!released.ok()) return "late write stream_release: " + released.to_string();
  Result<Ticket> offloaded = client.offload(range);
  if (!offloaded.ok()) return "late write offload: " + offloaded.status().to_string();
  if (release_ms > 25) return "stream_release waited " + std::to_string(release_ms) + " ms for the stream";
  Status waited = client.wait(offloaded.value());
  if (!waited.ok()) return "late write wait: " + waited.to_string();
  Result<void*> host = client.acquire_host(range);
  if (!host.ok()) return "late write acquire_host: " + host.status().to_string();
  bool intact = std::memcmp(host.value(), staging, kPageBytes) == 0;
  (void)client.release_host(range, false);
  cudaStreamSynchronize(stream);
  return intact ? "" : "the offload copied the page before the stream's write (late write lost)";
}

// One trainer: random groups of pages written (new version), read back and checked, offloaded
// or prefetched, through a GPU quota smaller than the space.
WorkerReport run_worker(Client& client, uint64_t seed, const std::string& space_name) {
  WorkerReport report;
  auto fail = [&](const std::string& what, const Status& status) {
    report.error = what + ": " + status.to_string();
    return report;
  };
  Result<SpaceId> space = client.create_space(space_name, kPageBytes, kPages);
  if (!space.ok()) return fail("create_space", space.status());
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return fail("stream", internal_error("no stream"));
  uint8_t* staging = nullptr;
  if (cudaMallocHost(&staging, kMaxGroup * kPageBytes) != cudaSuccess) return fail("staging", internal_error("no pinned memory"));
  std::vector<uint32_t> version(kPages, 0);  // 0: never written
  std::vector<uint8_t> expected(kPageBytes);
  std::mt19937_64 generator(seed);
  // The staging buffer is reused once the stream's copies out of it are done (not at release).
  cudaEvent_t staging_free = nullptr;
  if (cudaEventCreateWithFlags(&staging_free, cudaEventDisableTiming) != cudaSuccess) {
    return fail("event", internal_error("no event"));
  }
  std::string late = check_late_write(client, space.value(), seed, stream, staging);
  if (!late.empty()) return fail("stream-ordered release", internal_error(late));
  version[0] = 1;
  report.pages_written += 1;

  for (int operation = 0; operation < kOperations; ++operation) {
    uint32_t count = 1 + generator() % kMaxGroup;
    uint32_t first = generator() % (kPages - count + 1);
    PageRange range{space.value(), first, count};
    bool never_written = false;
    for (uint32_t page = first; page < first + count; ++page) never_written = never_written || version[page] == 0;
    uint64_t choice = never_written ? 0 : generator() % 4;
    if (choice == 0) {  // write a new version of every page in the group
      Result<Acquired> acquired = client.acquire(range, kAcquireWrite | kAcquireZeroNew);
      if (!acquired.ok()) return fail("acquire for write", acquired.status());
      Status waited = wait_on_stream(client, acquired.value().ticket, stream);
      if (!waited.ok()) return fail("wait", waited);
      cudaEventSynchronize(staging_free);
      // Now and then the stream runs late, so releases and later copies overlap its work.
      if (generator() % 8 == 0) cudaLaunchHostFunc(stream, sleep_on_stream, reinterpret_cast<void*>(uintptr_t{2}));
      for (uint32_t i = 0; i < count; ++i) {
        fill_pattern(staging + i * kPageBytes, seed, first + i, version[first + i] + 1);
        if (cudaMemcpyAsync(static_cast<char*>(acquired.value().pointer) + i * kPageBytes, staging + i * kPageBytes, kPageBytes,
                            cudaMemcpyHostToDevice, stream) != cudaSuccess) {
          return fail("write copy", internal_error("cudaMemcpyAsync failed"));
        }
      }
      Status released = client.stream_release(range, true, stream);
      if (released.code() == StatusCode::UNIMPLEMENTED) {
        cudaStreamSynchronize(stream);
        released = client.release(range, true);
      }
      if (!released.ok()) return fail("release", released);
      cudaEventRecord(staging_free, stream);
      for (uint32_t i = 0; i < count; ++i) ++version[first + i];
      report.pages_written += count;
    } else if (choice == 1) {  // read back and check
      cudaEventSynchronize(staging_free);
      Result<Acquired> acquired = client.acquire(range, kAcquireRead);
      if (!acquired.ok()) return fail("acquire for read", acquired.status());
      Status waited = wait_on_stream(client, acquired.value().ticket, stream);
      if (!waited.ok()) return fail("wait", waited);
      for (uint32_t i = 0; i < count; ++i) {
        if (cudaMemcpyAsync(staging + i * kPageBytes, static_cast<char*>(acquired.value().pointer) + i * kPageBytes, kPageBytes,
                            cudaMemcpyDeviceToHost, stream) != cudaSuccess) {
          return fail("read copy", internal_error("cudaMemcpyAsync failed"));
        }
      }
      if (cudaStreamSynchronize(stream) != cudaSuccess) return fail("stream", internal_error("stream failed"));
      Status released = client.release(range, false);
      if (!released.ok()) return fail("release", released);
      for (uint32_t i = 0; i < count; ++i) {
        fill_pattern(expected.data(), seed, first + i, version[first + i]);
        ++report.pages_checked;
        if (std::memcmp(staging + i * kPageBytes, expected.data(), kPageBytes) != 0) ++report.pages_corrupted;
      }
    } else {  // move the group out or in ahead of time
      Result<Ticket> ticket = choice == 2 ? client.offload(range) : client.prefetch(range);
      if (!ticket.ok()) return fail(choice == 2 ? "offload" : "prefetch", ticket.status());
      Status waited = client.wait(ticket.value());
      if (!waited.ok()) return fail("wait", waited);
    }
  }
  // Finally every page ever written is read once more (most now come back from the host).
  cudaEventSynchronize(staging_free);
  for (uint32_t page = 0; page < kPages; ++page) {
    if (version[page] == 0) continue;
    PageRange range{space.value(), page, 1};
    Result<Acquired> acquired = client.acquire(range, kAcquireRead);
    if (!acquired.ok()) return fail("final acquire", acquired.status());
    Status waited = wait_on_stream(client, acquired.value().ticket, stream);
    if (!waited.ok()) return fail("wait", waited);
    cudaMemcpyAsync(staging, acquired.value().pointer, kPageBytes, cudaMemcpyDeviceToHost, stream);
    if (cudaStreamSynchronize(stream) != cudaSuccess) return fail("stream", internal_error("stream failed"));
    Status released = client.release(range, false);
    if (!released.ok()) return fail("release", released);
    fill_pattern(expected.data(), seed, page, version[page]);
    ++report.pages_checked;
    if (std::memcmp(staging, expected.data(), kPageBytes) != 0) ++report.pages_corrupted;
  }
  cudaStreamSynchronize(stream);
  cudaEventDestroy(staging_free);
  cudaFreeHost(staging);
  cudaStreamDestroy(stream);
  return report;
}

bool gpu_present() {
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
}

TEST(CudaClientIntegrity, EmbeddedCuda) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA GPU";
  EmbeddedConfig config;
  config.backend = BackendKind::kCuda;
  config.gpu_pool_bytes = 4 * kFrameBytes;  // a quarter of the space: every pass evicts
  config.host_pool_bytes = 32 * kFrameBytes;
  Result<std::unique_ptr<Client>> client = make_embedded_client(config);
  ASSERT_TRUE(client.ok()) << client.status().to_string();
  EXPECT_EQ(client.value()->describe(), "embedded:cuda");
  WorkerReport report = run_worker(*client.value(), std::random_device{}(), "integrity.k");
  ASSERT_TRUE(report.error.empty()) << report.error;
  EXPECT_GT(report.pages_written, 0u);
  EXPECT_GT(report.pages_checked, uint64_t{kPages} / 2);
  EXPECT_EQ(report.pages_corrupted, 0u);
  Result<RuntimeStats> stats = client.value()->stats();
  ASSERT_TRUE(stats.ok());
  ASSERT_FALSE(stats.value().clients.empty());
  EXPECT_GT(stats.value().clients[0].evictions, 0u) << "the test should have forced evictions";
  EXPECT_GT(stats.value().clients[0].bytes_gpu_to_host, 0u);
}

// Note [Copied pages]: history pages that live on the host stream through staging pages held on
// the GPU, block after block, each copy waiting for the stream's read of the previous block in the
// same rows (a slow host function delays every read); then the staging rows, changed on the
// GPU, are copied back into host-only pages. Each copy waits for the marker the stream wrote
// after the previous read (stream_mark). No history frame is ever placed on the GPU.
TEST(CudaClientIntegrity, StagedCopiesFollowTheStream) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA GPU";
  EmbeddedConfig config;
  config.backend = BackendKind::kCuda;
  config.gpu_pool_bytes = 8 * kFrameBytes;
  config.host_pool_bytes = 32 * kFrameBytes;
  Result<std::unique_ptr<Client>> made = make_embedded_client(config);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  Client& client = *made.value();
  constexpr uint32_t kBlock = 8;        // pages per block: 2 MiB
  constexpr uint32_t kBlocks = 6;
  Result<SpaceId> history = client.create_space("staged.history", kPageBytes, kBlock * kBlocks);
  Result<SpaceId> stage = client.create_space("staged.rows", kPageBytes, kBlock);
  ASSERT_TRUE(history.ok() && stage.ok());
  uint64_t seed = std::random_device{}();
  // The history, written from the host (it never has a GPU frame).
  for (uint32_t b = 0; b < kBlocks; ++b) {
    PageRange range{history.value(), b * kBlock, kBlock};
    Result<void*> host = client.acquire_host(range);
    ASSERT_TRUE(host.ok()) << host.status().to_string();
    for (uint32_t i = 0; i < kBlock; ++i) fill_pattern(static_cast<char*>(host.value()) + i * kPageBytes, seed, b * kBlock + i, 1);
    ASSERT_TRUE(client.release_host(range, true).ok());
  }
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  PageRange rows{stage.value(), 0, kBlock};
  Result<Acquired> held = client.acquire(rows, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(held.ok()) << held.status().to_string();
  ASSERT_TRUE(wait_on_stream(client, held.value().ticket, stream).ok());
  uint8_t* read = nullptr;
  ASSERT_EQ(cudaMallocHost(&read, uint64_t(kBlocks) * kBlock * kPageBytes), cudaSuccess);
  std::optional<uint64_t> read_done;   // the marker after the last read of the rows
  for (uint32_t b = 0; b < kBlocks; ++b) {
    Result<Ticket> copied = client.copy_pages({PageRange{history.value(), b * kBlock, kBlock}, rows}, read_done);
    ASSERT_TRUE(copied.ok()) << copied.status().to_string();
    ASSERT_TRUE(client.stream_wait(copied.value(), stream).ok());
    // The "kernel" reading the rows runs late: the next block's copy must wait for it.
    cudaLaunchHostFunc(stream, sleep_on_stream, reinterpret_cast<void*>(uintptr_t{5}));
    ASSERT_EQ(cudaMemcpyAsync(read + uint64_t(b) * kBlock * kPageBytes, held.value().pointer, kBlock * kPageBytes,
                              cudaMemcpyDeviceToHost, stream), cudaSuccess);
    Result<uint64_t> marker = client.stream_mark(stream);
    ASSERT_TRUE(marker.ok()) << marker.status().to_string();
    read_done = marker.value();
  }
  // The rows changed on the GPU, then copied back into the history's first block (host only).
  std::vector<uint8_t> changed(kBlock * kPageBytes);
  for (uint32_t i = 0; i < kBlock; ++i) fill_pattern(changed.data() + i * kPageBytes, seed, i, 2);
  ASSERT_EQ(cudaMemcpyAsync(held.value().pointer, changed.data(), changed.size(), cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  Result<uint64_t> written = client.stream_mark(stream);
  ASSERT_TRUE(written.ok()) << written.status().to_string();
  Result<Ticket> back = client.copy_pages({rows, PageRange{history.value(), 0, kBlock}}, written.value());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_TRUE(client.wait(back.value()).ok());
  std::vector<uint8_t> expected(kPageBytes);
  uint64_t corrupted = 0;
  for (uint32_t p = 0; p < kBlock * kBlocks; ++p) {
    fill_pattern(expected.data(), seed, p, 1);
    if (std::memcmp(read + uint64_t(p) * kPageBytes, expected.data(), kPageBytes) != 0) ++corrupted;
  }
  EXPECT_EQ(corrupted, 0u) << "pages read from the staging rows differ from the history";
  Result<RuntimeStats> stats = client.stats();
  ASSERT_TRUE(stats.ok());
  for (const SpaceInfo& space : stats.value().spaces) {
    if (space.name == "staged.history") {
      EXPECT_EQ(space.bytes_gpu + space.bytes_both, 0u) << "a history frame was placed on the GPU";
    }
  }
  Result<void*> host = client.acquire_host(PageRange{history.value(), 0, kBlock});
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  EXPECT_EQ(std::memcmp(host.value(), changed.data(), changed.size()), 0) << "the copy back did not land";
  ASSERT_TRUE(client.release_host(PageRange{history.value(), 0, kBlock}, false).ok());
  ASSERT_TRUE(client.stream_release(rows, false, stream).ok());
  cudaStreamSynchronize(stream);
  cudaFreeHost(read);
  cudaStreamDestroy(stream);
}

#if defined(MEMBAR_MEMBARD_PATH)
// Kills and reaps a process when the test stops early.
struct ProcessGuard {
  explicit ProcessGuard(pid_t process, int signal = SIGKILL) : pid(process), signal_number(signal) {}
  ProcessGuard(ProcessGuard&& other) noexcept : pid(std::exchange(other.pid, -1)), signal_number(other.signal_number) {}
  ProcessGuard(const ProcessGuard&) = delete;
  ProcessGuard& operator=(const ProcessGuard&) = delete;
  pid_t pid = -1;
  int signal_number = SIGKILL;
  ~ProcessGuard() {
    if (pid <= 0) return;
    kill(pid, signal_number);
    int status = 0;
    waitpid(pid, &status, 0);
  }
};

pid_t spawn(std::vector<std::string> arguments) {
  std::vector<char*> argv;
  for (std::string& argument : arguments) argv.push_back(argument.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -1;
  return pid;
}

// Waits for `pid` up to `seconds`; returns its wait status, or -1 on timeout.
int wait_with_timeout(pid_t pid, int seconds) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

TEST(CudaClientIntegrity, DaemonTwoProcesses) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA GPU";
  char directory_template[] = "/tmp/membar-cuda-integrity-XXXXXX";
  ASSERT_NE(mkdtemp(directory_template), nullptr);
  std::string socket_path = std::string(directory_template) + "/membard.sock";
  ProcessGuard daemon(spawn({MEMBAR_MEMBARD_PATH, "--backend", "cuda", "--socket", socket_path, "--gpu-pool", "64MiB",
                             "--host-pool", "256MiB", "--default-gpu-quota", "8MiB", "--log-level", "warn"}),
                      SIGTERM);
  ASSERT_GT(daemon.pid, 0) << "cannot start " << MEMBAR_MEMBARD_PATH;

  // The daemon answers once its frames exist.
  ConnectOptions options;
  options.socket_path = socket_path;
  options.allow_embedded = false;
  options.client_name = "integrity-probe";
  bool up = false;
  for (int attempt = 0; attempt < 300 && !up; ++attempt) {
    int status = 0;
    ASSERT_NE(waitpid(daemon.pid, &status, WNOHANG), daemon.pid) << "membard exited at start-up (status " << status << ")";
    up = connect(options).ok();
    if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(up) << "membard --backend cuda did not answer on " << socket_path;

  uint64_t seed = std::random_device{}();
  std::vector<ProcessGuard> workers;
  for (int worker = 0; worker < 2; ++worker) {
    workers.emplace_back(spawn({"/proc/self/exe", "--membar-worker", socket_path,
                                std::to_string(seed + 1000003ull * worker), std::to_string(worker)}));
    ASSERT_GT(workers.back().pid, 0);
  }
  for (ProcessGuard& worker : workers) {
    int status = wait_with_timeout(worker.pid, 240);
    ASSERT_NE(status, -1) << "a trainer process did not finish";
    worker.pid = -1;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "trainer exit status " << status;
  }
  kill(daemon.pid, SIGTERM);
  int status = wait_with_timeout(daemon.pid, 20);
  EXPECT_NE(status, -1) << "membard did not stop on SIGTERM";
  if (status != -1) daemon.pid = -1;
  unlink(socket_path.c_str());
  rmdir(directory_template);
}
TEST(CudaClientIntegrity, DaemonRenewsGpuFramesBetweenClients) {
  if (!gpu_present()) GTEST_SKIP() << "no CUDA GPU";
  char directory_template[] = "/tmp/membar-cuda-renewal-XXXXXX";
  ASSERT_NE(mkdtemp(directory_template), nullptr);
  std::string socket_path = std::string(directory_template) + "/membard.sock";
  ProcessGuard daemon(spawn({MEMBAR_MEMBARD_PATH, "--backend", "cuda", "--socket", socket_path, "--gpu-pool", "32MiB",
                             "--host-pool", "64MiB", "--log-level", "warn"}),
                      SIGTERM);
  ASSERT_GT(daemon.pid, 0);
  ConnectOptions options;
  options.socket_path = socket_path;
  options.allow_embedded = false;
  bool up = false;
  for (int attempt = 0; attempt < 300 && !up; ++attempt) {
    up = connect(options).ok();
    if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(up);
  // The filler takes the whole GPU pool (16 frames), writes it, leaves a marker file, then
  // sleeps until killed.
  std::string ready = std::string(directory_template) + "/ready";
  ProcessGuard filler(spawn({"/proc/self/exe", "--membar-fill", socket_path, ready}));
  ASSERT_GT(filler.pid, 0);
  for (int attempt = 0; attempt < 600 && access(ready.c_str(), F_OK) != 0; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(access(ready.c_str(), F_OK), 0) << "the filler never filled the pool";
  kill(filler.pid, SIGKILL);
  waitpid(filler.pid, nullptr, 0);
  filler.pid = -1;

  Result<std::unique_ptr<Client>> reader = Status(StatusCode::UNAVAILABLE, "not yet");
  for (int attempt = 0; attempt < 100 && !reader.ok(); ++attempt) {
    reader = connect(options);
    if (!reader.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  Result<SpaceId> space = reader.value()->create_space("reader", 96 << 10, 340);  // ~31.9 MiB: 16 frames
  ASSERT_TRUE(space.ok()) << space.status().to_string();
  Result<Acquired> acquired = reader.value()->acquire({space.value(), 0, 340}, 0);  // no zero-fill asked for
  ASSERT_TRUE(acquired.ok()) << acquired.status().to_string();
  ASSERT_TRUE(reader.value()->wait(acquired.value().ticket).ok());
  std::vector<uint64_t> seen(16 * kFrameBytes / 8);
  ASSERT_EQ(cudaMemcpy(seen.data(), acquired.value().pointer, 16 * kFrameBytes, cudaMemcpyDeviceToHost), cudaSuccess)
      << "the whole mapped range (16 frames) must be readable";
  uint64_t nonzero = 0;
  for (uint64_t word : seen) nonzero += word != 0;
  EXPECT_EQ(nonzero, 0u) << "a GPU frame reached the next client with the killed one's bytes";
  ASSERT_TRUE(reader.value()->release({space.value(), 0, 340}, false).ok());
  reader.value().reset();
  kill(daemon.pid, SIGTERM);
  if (wait_with_timeout(daemon.pid, 20) != -1) daemon.pid = -1;
  unlink(ready.c_str());
  unlink(socket_path.c_str());
  rmdir(directory_template);
}

#endif

// The filler of DaemonRenewsGpuFramesBetweenClients: the whole GPU pool, written, then a marker.
int fill_main(const std::string& socket_path, const std::string& ready) {
  ConnectOptions options;
  options.socket_path = socket_path;
  options.allow_embedded = false;
  Result<std::unique_ptr<Client>> client = connect(options);
  if (!client.ok()) return 2;
  Result<SpaceId> space = client.value()->create_space("fill", kFrameBytes, 16);
  if (!space.ok()) return 3;
  Result<Acquired> acquired = client.value()->acquire({space.value(), 0, 16}, kAcquireWrite);
  if (!acquired.ok() || !client.value()->wait(acquired.value().ticket).ok()) return 4;
  if (cudaMemset(acquired.value().pointer, 0x5a, 16 * kFrameBytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
    return 5;
  }
  if (!client.value()->release({space.value(), 0, 16}, true).ok()) return 6;
  FILE* marker = std::fopen(ready.c_str(), "w");
  if (marker != nullptr) std::fclose(marker);
  ::sleep(120);
  return 0;
}

// A trainer process of DaemonTwoProcesses: exit 0 when every checked page was intact.
int worker_main(const std::string& socket_path, uint64_t seed, const std::string& name) {
  ConnectOptions options;
  options.socket_path = socket_path;
  options.allow_embedded = false;
  options.client_name = "integrity-" + name;
  Result<std::unique_ptr<Client>> client = connect(options);
  if (!client.ok()) {
    std::fprintf(stderr, "[trainer %s] connect: %s\n", name.c_str(), client.status().to_string().c_str());
    return 2;
  }
  if (client.value()->backend() != BackendKind::kCuda) {
    std::fprintf(stderr, "[trainer %s] the daemon does not run the CUDA backend\n", name.c_str());
    return 2;
  }
  WorkerReport report = run_worker(*client.value(), seed, "integrity." + name);
  std::printf("[trainer %s] %llu pages written, %llu checked, %llu corrupted %s\n", name.c_str(),
              static_cast<unsigned long long>(report.pages_written), static_cast<unsigned long long>(report.pages_checked),
              static_cast<unsigned long long>(report.pages_corrupted), report.error.c_str());
  if (!report.error.empty()) return 2;
  return report.pages_corrupted == 0 && report.pages_checked > 0 ? 0 : 3;
}

}  // namespace
}  // namespace membar

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "--membar-worker") {
    return membar::worker_main(argv[2], std::stoull(argv[3]), argv[4]);
  }
  if (argc == 4 && std::string(argv[1]) == "--membar-fill") return membar::fill_main(argv[2], argv[3]);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
