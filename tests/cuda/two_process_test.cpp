// Two-process integrity on the CUDA backend (label gpu), at the mechanism level: this process
// plays the daemon (CudaVmmBackend: frames, copy streams, signal block); a second process,
// started from this same binary, plays the trainer (its ClientMemory on the CUDA mapper, and
// stream signals). Frame and signal fds cross over a Unix socket with SCM_RIGHTS, as they do from
// membard, and the trainer maps frame i at space frame i of one space (Note [Space layout]).
//
// Each cycle: the daemon prefetches fresh random pages host -> GPU and signals ticket k; the
// trainer's stream waits for k on the GPU, reads and checks the pages at their space positions,
// writes new pages, and signals "released k" from its stream; the daemon sees the release,
// offloads GPU -> host and checks the trainer's bytes. Every page of every cycle is checked
// in both processes: 0 corrupted, 0 lost.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/stream_signal.h"
#include "memory.h"
#include "membar/engine/backend.h"

extern char** environ;

namespace membar {
namespace {

constexpr uint32_t kFrames = 8;
constexpr uint32_t kCycles = 60;
constexpr uint32_t kSignalWordCount = 8;
constexpr uint32_t kTicketWord = 0;
constexpr uint32_t kReleaseWord = 1;

struct Hello {
  uint32_t frames = 0;
  uint32_t cycles = 0;
  uint64_t seed = 0;
};
struct Report {
  uint64_t pages_checked = 0;
  uint64_t pages_corrupted = 0;
  int32_t error = 0;  // nonzero: the child failed before finishing (message on its stderr)
};

// The bytes of frame `frame` in cycle `cycle`, written by `writer` (0 daemon, 1 trainer).
void fill_pattern(void* pointer, uint64_t seed, uint32_t cycle, uint32_t frame, uint32_t writer) {
  auto* words = static_cast<uint64_t*>(pointer);
  uint64_t state = seed ^ (uint64_t{cycle} << 40) ^ (uint64_t{frame} << 24) ^ (uint64_t{writer} << 16);
  for (uint64_t i = 0; i < kFrameBytes / 8; ++i) {
    // splitmix64: fast, and every word differs between cycles, frames and writers.
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    words[i] = z ^ (z >> 31);
  }
}

bool matches_pattern(const void* pointer, uint64_t seed, uint32_t cycle, uint32_t frame, uint32_t writer,
                     std::vector<uint8_t>& scratch) {
  scratch.resize(kFrameBytes);
  fill_pattern(scratch.data(), seed, cycle, frame, writer);
  return std::memcmp(pointer, scratch.data(), kFrameBytes) == 0;
}

bool send_message(int socket, const void* data, size_t bytes, int fd) {
  iovec io = {const_cast<void*>(data), bytes};
  msghdr message = {};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(header), &fd, sizeof(int));
  }
  return sendmsg(socket, &message, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes);
}

// Returns the fd that came with the message (-1 if none); false on a short read.
bool receive_message(int socket, void* data, size_t bytes, int* fd) {
  iovec io = {data, bytes};
  msghdr message = {};
  message.msg_iov = &io;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  if (recvmsg(socket, &message, MSG_WAITALL | MSG_CMSG_CLOEXEC) != static_cast<ssize_t>(bytes)) return false;
  if (fd != nullptr) {
    *fd = -1;
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    if (header != nullptr && header->cmsg_type == SCM_RIGHTS) std::memcpy(fd, CMSG_DATA(header), sizeof(int));
  }
  return true;
}

// The trainer process. Returns its exit code; results go back over the socket.
int run_child(int socket) {
  Report report;
  auto fail = [&](const std::string& why) {
    fprintf(stderr, "[trainer] %s\n", why.c_str());
    report.error = 1;
    send_message(socket, &report, sizeof(report), -1);
    return 1;
  };
  Hello hello;
  int signal_fd = -1;
  if (!receive_message(socket, &hello, sizeof(hello), &signal_fd) || signal_fd < 0) return fail("no hello");
  void* signal_mapping = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, signal_fd, 0);
  close(signal_fd);
  if (signal_mapping == MAP_FAILED) return fail("cannot map the signal block");
  Result<std::unique_ptr<StreamSignals>> signals =
      StreamSignals::create(static_cast<volatile uint64_t*>(signal_mapping), kSignalWordCount, 0);
  if (!signals.ok()) return fail(signals.status().to_string());
  Result<std::unique_ptr<FrameMapper>> mapper = make_cuda_mapper(0);
  if (!mapper.ok()) return fail(mapper.status().to_string());
  auto memory = std::make_unique<ClientMemory>(std::move(mapper).value(), make_mmap_mapper(), 1);
  constexpr SpaceId kSpace = 1;
  Status added = memory->add_space(kSpace, kFrameBytes, hello.frames);
  if (!added.ok()) return fail(added.to_string());
  for (uint32_t frame = 0; frame < hello.frames; ++frame) {
    int fd = -1;
    uint32_t index = 0;
    if (!receive_message(socket, &index, sizeof(index), &fd) || fd < 0) return fail("no frame fd");
    Status granted = memory->gpu_frame_granted(index, fd);
    if (!granted.ok()) return fail(granted.to_string());
    Status mapped = memory->mapped(Tier::kGpu, index, kSpace, index);
    if (!mapped.ok()) return fail(mapped.to_string());
  }
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) return fail("no stream");
  uint8_t* staging = nullptr;  // pinned: copies into it do not block this thread
  uint64_t bytes = uint64_t{hello.frames} * kFrameBytes;
  if (cudaMallocHost(&staging, bytes) != cudaSuccess) return fail("no pinned staging buffer");
  auto* base = static_cast<uint8_t*>(memory->view(kSpace).value().gpu);
  std::vector<uint8_t> scratch;

  for (uint32_t cycle = 1; cycle <= hello.cycles; ++cycle) {
    // Wait for the daemon's prefetch on the GPU, then read the pages at their positions.
    if (!signals.value()->stream_wait(kTicketWord, cycle, stream).ok()) return fail("stream_wait failed");
    if (cudaMemcpyAsync(staging, base, bytes, cudaMemcpyDeviceToHost, stream) != cudaSuccess) return fail("read failed");
    if (cudaStreamSynchronize(stream) != cudaSuccess) return fail("stream failed");
    for (uint32_t frame = 0; frame < hello.frames; ++frame) {
      ++report.pages_checked;
      if (!matches_pattern(staging + frame * kFrameBytes, hello.seed, cycle, frame, 0, scratch)) ++report.pages_corrupted;
    }
    // Write this cycle's pages and release them from the stream, after the copy.
    for (uint32_t frame = 0; frame < hello.frames; ++frame) {
      fill_pattern(staging + frame * kFrameBytes, hello.seed, cycle, frame, 1);
    }
    if (cudaMemcpyAsync(base, staging, bytes, cudaMemcpyHostToDevice, stream) != cudaSuccess) return fail("write failed");
    if (!signals.value()->stream_write(kReleaseWord, cycle, stream).ok()) return fail("stream_write failed");
    // The staging buffer is rewritten next cycle only after this cycle's copy has run.
    if (cudaStreamSynchronize(stream) != cudaSuccess) return fail("stream failed");
  }
  cudaFreeHost(staging);
  cudaStreamDestroy(stream);
  memory.reset();
  signals.value().reset();
  munmap(signal_mapping, 4096);
  return send_message(socket, &report, sizeof(report), -1) ? 0 : 1;
}

// Kills and reaps the trainer when the test stops early, so a failed test never leaves a
// process waiting on a signal that will not come.
struct ChildGuard {
  pid_t pid = -1;
  ~ChildGuard() {
    if (pid <= 0) return;
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
  }
};

TEST(CudaTwoProcess, PagesSurviveEveryCycleAcrossProcesses) {
  runtimed::BackendConfig config;
  config.gpu_pool_bytes = 2 * kFrames * kFrameBytes;
  config.host_pool_bytes = 2 * kFrames * kFrameBytes;
  Result<std::unique_ptr<runtimed::DeviceBackend>> made = runtimed::make_cuda_backend(config);
  if (!made.ok() && made.status().code() == StatusCode::UNAVAILABLE) GTEST_SKIP() << made.status().to_string();
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  runtimed::DeviceBackend& backend = *made.value();
  // Host slabs start unprepared (the engine renews them in the background): prepare them all.
  for (uint32_t slab = 0; slab < backend.host_slab_count(); ++slab) {
    std::atomic<bool> done{false};
    ASSERT_TRUE(backend.renew(Tier::kHost, slab, [&](Status status) {
      EXPECT_TRUE(status.ok()) << status.to_string();
      done = true;
    }).ok());
    while (!done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  Result<uint32_t> block = backend.create_signal_block(kSignalWordCount);
  ASSERT_TRUE(block.ok()) << block.status().to_string();
  volatile uint64_t* words = backend.signal_words(block.value());

  int sockets[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sockets), 0);
  if (sockets[1] == 3) {  // dup2 onto itself would keep close-on-exec: move it first
    sockets[1] = fcntl(3, F_DUPFD_CLOEXEC, 10);
    close(3);
  }
  // The child's end must survive exec; only that one.
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, sockets[1], 3);
  std::string self = "/proc/self/exe";
  char child_flag[] = "--membar-child";
  char* arguments[] = {self.data(), child_flag, nullptr};
  pid_t child = -1;
  ASSERT_EQ(posix_spawn(&child, "/proc/self/exe", &actions, nullptr, arguments, environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  ChildGuard guard{child};
  close(sockets[1]);
  int socket = sockets[0];

  // The trainer's window frame i is the daemon's GPU frame kFrames + i (not the identity).
  Hello hello{kFrames, kCycles, std::random_device{}()};
  Result<int> signal_fd = backend.export_signal_block(block.value());
  ASSERT_TRUE(signal_fd.ok());
  ASSERT_TRUE(send_message(socket, &hello, sizeof(hello), signal_fd.value()));
  close(signal_fd.value());
  for (uint32_t frame = 0; frame < kFrames; ++frame) {
    Result<int> fd = backend.export_gpu_frame(kFrames + frame);
    ASSERT_TRUE(fd.ok()) << fd.status().to_string();
    ASSERT_TRUE(send_message(socket, &frame, sizeof(frame), fd.value()));
    close(fd.value());
  }

  std::vector<uint8_t> scratch;
  uint64_t checked = 0, corrupted = 0;
  for (uint32_t cycle = 1; cycle <= kCycles; ++cycle) {
    // Prefetch host frames 0..7 -> GPU frames 8..15, then signal the ticket.
    std::vector<runtimed::CopyOp> in;
    for (uint32_t frame = 0; frame < kFrames; ++frame) {
      fill_pattern(backend.frame_pointer(Tier::kHost, frame), hello.seed, cycle, frame, 0);
      in.push_back(runtimed::CopyOp{Tier::kHost, frame, 0, Tier::kGpu, kFrames + frame, 0, kFrameBytes});
    }
    ASSERT_TRUE(backend.enqueue_copies(std::move(in), [](Status status) { EXPECT_TRUE(status.ok()); }).ok());
    ASSERT_TRUE(backend.enqueue_signal(block.value(), kTicketWord, cycle).ok());

    // The trainer's release arrives in the signal word, written by its GPU stream.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (words[kReleaseWord] < cycle && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    ASSERT_EQ(words[kReleaseWord], cycle) << "the trainer never released cycle " << cycle;

    // Offload GPU frames 8..15 -> host frames 8..15 and check the trainer's bytes.
    std::vector<runtimed::CopyOp> out;
    for (uint32_t frame = 0; frame < kFrames; ++frame) {
      out.push_back(runtimed::CopyOp{Tier::kGpu, kFrames + frame, 0, Tier::kHost, kFrames + frame, 0, kFrameBytes});
    }
    std::mutex mutex;
    std::condition_variable finished;
    bool done = false;
    Status outcome;
    ASSERT_TRUE(backend.enqueue_copies(std::move(out), [&](Status status) {
      std::lock_guard<std::mutex> lock(mutex);
      outcome = std::move(status);
      done = true;
      finished.notify_all();
    }).ok());
    {
      std::unique_lock<std::mutex> lock(mutex);
      ASSERT_TRUE(finished.wait_for(lock, std::chrono::seconds(30), [&] { return done; }));
    }
    ASSERT_TRUE(outcome.ok()) << outcome.to_string();
    for (uint32_t frame = 0; frame < kFrames; ++frame) {
      ++checked;
      if (!matches_pattern(backend.frame_pointer(Tier::kHost, kFrames + frame), hello.seed, cycle, frame, 1, scratch)) {
        ++corrupted;
      }
    }
  }

  Report report;
  ASSERT_TRUE(receive_message(socket, &report, sizeof(report), nullptr)) << "the trainer sent no report";
  int child_status = 0;
  ASSERT_EQ(waitpid(child, &child_status, 0), child);
  guard.pid = -1;
  close(socket);
  EXPECT_TRUE(WIFEXITED(child_status) && WEXITSTATUS(child_status) == 0) << "trainer exit status " << child_status;
  EXPECT_EQ(report.error, 0);
  EXPECT_EQ(report.pages_checked, uint64_t{kFrames} * kCycles) << "pages lost on the way to the trainer";
  EXPECT_EQ(report.pages_corrupted, 0u);
  EXPECT_EQ(checked, uint64_t{kFrames} * kCycles);
  EXPECT_EQ(corrupted, 0u);
  backend.drain();
}

}  // namespace
}  // namespace membar

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "--membar-child") return membar::run_child(3);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
