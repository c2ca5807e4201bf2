// Runtime benchmarks on one GPU, each as a ratio to a baseline measured in the same run:
//   (a) prefetch / offload bandwidth through CudaVmmBackend vs raw cudaMemcpyAsync from pinned
//       memory, host->GPU, GPU->host and both at once, with 64 KiB, 256 KiB and 2 MiB pages:
//       "merged" (pages adjacent in frames, as a space's pages are) against raw copies of the
//       backend's batch size, and "scattered" (every page to a random slot, nothing merges)
//       against raw page-sized copies. Goal >= 0.9x.
//   (b) the client's mapping costs on the CUDA mapper (libclient/memory.h): a GPU frame's
//       export, its import (cuMemImportFromShareableHandle), a map at a space position
//       (cuMemMap + cuMemSetAccess) and an unmap; and the daemon's renewal of a GPU frame and of a
//       host slab (Note [Frames, slabs and renewal]: what a frame costs when it changes hands).
//   (c) a kernel loop timed alone vs while the backend streams a known schedule in and out;
//       a compute-bound and an HBM-bound kernel. Goal >= 0.97x.
//   (d) the host time of handing copies over: enqueue_copies of k scattered 2 MiB frame copies
//       (nothing merges), with the copies of a batch in one cudaMemcpyBatchAsync call (the
//       default) and one cudaMemcpyAsync each (BackendConfig::batch_copies = false), completion by
//       words (the default) and by events (BackendConfig::completion_words = false), beside the raw
//       driver calls on the same frame pointers; microseconds of the caller's thread per copy.
// Writes runtime_bench.json and runtime_bench.txt to $MEMBAR_RESULTS_DIR
// (default bench/results/latest). Usage: runtime_bench [--quick]
#include <cuda_runtime.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <mutex>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "memory.h"
#include "membar/engine/backend.h"

namespace membar::bench {
namespace {

using runtimed::CopyOp;
using runtimed::DeviceBackend;

#define BENCH_CHECK_CUDA(expression)                                                                \
  do {                                                                                              \
    cudaError_t bench_error_ = (expression);                                                        \
    if (bench_error_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s failed: %s\n", __FILE__, __LINE__, #expression,                \
                   cudaGetErrorString(bench_error_));                                               \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

void check_status(const Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, status.to_string().c_str());
  std::exit(1);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Counts batch completions and lets the caller wait for a number of them.
class CompletionCounter {
 public:
  std::function<void(Status)> callback() {
    return [this](Status status) {
      if (!status.ok()) {
        std::fprintf(stderr, "a batch failed: %s\n", status.to_string().c_str());
        std::exit(1);
      }
      std::lock_guard<std::mutex> lock(mutex_);
      ++completed_;
      changed_.notify_all();
    };
  }
  void wait_for(uint64_t count) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return completed_ >= count; });
  }
  uint64_t completed() {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t completed_ = 0;
};

// Waits for events on a thread of its own, as the CUDA backend's completion threads do: with
// cudaEventSynchronize on blocking-sync events, or by polling cudaEventQuery (section (d): does
// the waiting thread slow the thread that hands copies over?).
class EventWaiter {
 public:
  explicit EventWaiter(bool poll) : poll_(poll), thread_([this] { loop(); }) {}
  ~EventWaiter() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    ready_.notify_one();
    thread_.join();
  }
  void add(cudaEvent_t event) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      events_.push_back(event);
    }
    ready_.notify_one();
  }
  void wait_idle() {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [&] { return events_.empty() && !busy_; });
  }

 private:
  void loop() {
    BENCH_CHECK_CUDA(cudaSetDevice(0));
    for (;;) {
      cudaEvent_t event = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [&] { return stopping_ || !events_.empty(); });
        if (events_.empty()) return;
        event = events_.front();
        events_.erase(events_.begin());
        busy_ = true;
      }
      if (poll_) {
        while (cudaEventQuery(event) == cudaErrorNotReady) std::this_thread::sleep_for(std::chrono::microseconds(20));
      } else {
        BENCH_CHECK_CUDA(cudaEventSynchronize(event));
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        busy_ = false;
      }
      idle_.notify_all();
    }
  }
  bool poll_;
  std::mutex mutex_;
  std::condition_variable ready_, idle_;
  std::vector<cudaEvent_t> events_;
  bool busy_ = false;
  bool stopping_ = false;
  std::thread thread_;
};

struct Layout {
  uint64_t frames = 0;        // frames per direction
  uint64_t batch_frames = 0;  // frames per enqueue_copies batch (one schedule step)
};

// Pages of one direction, in batches. Inbound: host frames [0, F) -> GPU frames [0, F).
// Outbound: GPU frames [F, 2F) -> host frames [F, 2F). `scattered` sends every page to a
// random page slot of the destination range instead of the same slot.
std::vector<std::vector<CopyOp>> make_batches(const Layout& layout, uint64_t page_bytes, bool inbound,
                                              bool scattered, uint64_t seed) {
  uint64_t pages_per_frame = kFrameBytes / page_bytes;
  uint64_t pages = layout.frames * pages_per_frame;
  std::vector<uint64_t> destination(pages);
  std::iota(destination.begin(), destination.end(), 0);
  if (scattered) std::shuffle(destination.begin(), destination.end(), std::mt19937_64(seed));
  uint64_t base = inbound ? 0 : layout.frames;
  Tier source_tier = inbound ? Tier::kHost : Tier::kGpu;
  Tier destination_tier = inbound ? Tier::kGpu : Tier::kHost;
  std::vector<std::vector<CopyOp>> batches;
  uint64_t pages_per_batch = layout.batch_frames * pages_per_frame;
  for (uint64_t page = 0; page < pages; ++page) {
    if (page % pages_per_batch == 0) batches.emplace_back();
    CopyOp op;
    op.src_tier = source_tier;
    op.src_frame = static_cast<FrameIndex>(base + page / pages_per_frame);
    op.src_offset = page % pages_per_frame * page_bytes;
    op.dst_tier = destination_tier;
    op.dst_frame = static_cast<FrameIndex>(base + destination[page] / pages_per_frame);
    op.dst_offset = destination[page] % pages_per_frame * page_bytes;
    op.bytes = page_bytes;
    batches.back().push_back(op);
  }
  return batches;
}

// Enqueues the batches of both lists alternately (copies are built beforehand: the time is
// the backend's, not the caller's) and returns seconds until the last completion.
double run_backend(DeviceBackend& backend, const std::vector<std::vector<CopyOp>>& first,
                   const std::vector<std::vector<CopyOp>>& second) {
  CompletionCounter counter;
  auto start = std::chrono::steady_clock::now();
  size_t count = std::max(first.size(), second.size());
  for (size_t i = 0; i < count; ++i) {
    if (i < first.size()) check_status(backend.enqueue_copies(first[i], counter.callback()), "enqueue_copies");
    if (i < second.size()) check_status(backend.enqueue_copies(second[i], counter.callback()), "enqueue_copies");
  }
  counter.wait_for(first.size() + second.size());
  return seconds_since(start);
}

// The raw baseline: cudaMemcpyAsync from cudaHostAlloc memory to cudaMalloc memory (and
// back), `piece` bytes per call, one stream per direction, timed the same way.
struct RawBuffers {
  char* host = nullptr;    // [2 * bytes]: inbound source, outbound destination
  char* device = nullptr;  // [2 * bytes]
  uint64_t bytes = 0;
  cudaStream_t streams[2] = {nullptr, nullptr};
};

double run_raw(RawBuffers& raw, uint64_t piece, bool inbound, bool outbound) {
  auto start = std::chrono::steady_clock::now();
  for (uint64_t offset = 0; offset < raw.bytes; offset += piece) {
    if (inbound) {
      BENCH_CHECK_CUDA(cudaMemcpyAsync(raw.device + offset, raw.host + offset, piece, cudaMemcpyHostToDevice, raw.streams[0]));
    }
    if (outbound) {
      BENCH_CHECK_CUDA(cudaMemcpyAsync(raw.host + raw.bytes + offset, raw.device + raw.bytes + offset, piece,
                                       cudaMemcpyDeviceToHost, raw.streams[1]));
    }
  }
  BENCH_CHECK_CUDA(cudaStreamSynchronize(raw.streams[0]));
  BENCH_CHECK_CUDA(cudaStreamSynchronize(raw.streams[1]));
  return seconds_since(start);
}

// Compute-bound: a dependent chain of fused multiply-adds per thread, no memory traffic.
__global__ void burn_kernel(float* data, int iterations) {
  int index = blockIdx.x * blockDim.x + threadIdx.x;
  float a = data[index], b = 1.0001f;
  for (int i = 0; i < iterations; ++i) {
    a = a * b + 0.5f;
    b = b * 0.9999f + a * 1e-9f;
  }
  data[index] = a + b;
}

// HBM-bound: y = 2x + y over a buffer far larger than L2.
__global__ void stream_kernel(const float4* x, float4* y, size_t count) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float4 a = x[i], b = y[i];
    y[i] = make_float4(2.f * a.x + b.x, 2.f * a.y + b.y, 2.f * a.z + b.z, 2.f * a.w + b.w);
  }
}

struct KernelLoop {
  std::string name;
  std::function<void(cudaStream_t)> launch;
  int launches = 0;
};

double time_loop(const KernelLoop& loop, cudaStream_t stream) {
  cudaEvent_t begin, end;
  BENCH_CHECK_CUDA(cudaEventCreate(&begin));
  BENCH_CHECK_CUDA(cudaEventCreate(&end));
  BENCH_CHECK_CUDA(cudaEventRecord(begin, stream));
  for (int i = 0; i < loop.launches; ++i) loop.launch(stream);
  BENCH_CHECK_CUDA(cudaEventRecord(end, stream));
  BENCH_CHECK_CUDA(cudaEventSynchronize(end));
  float milliseconds = 0;
  BENCH_CHECK_CUDA(cudaEventElapsedTime(&milliseconds, begin, end));
  BENCH_CHECK_CUDA(cudaEventDestroy(begin));
  BENCH_CHECK_CUDA(cudaEventDestroy(end));
  return milliseconds / 1e3;
}

std::string shell_line(const char* command) {
  std::string out;
  if (FILE* pipe = popen(command, "r")) {
    char buffer[256];
    while (fgets(buffer, sizeof(buffer), pipe) != nullptr) out += buffer;
    pclose(pipe);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

std::string json_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out;
}

// Results as ordered (key, number) rows per section, rendered as JSON and as text.
struct Row {
  std::string name;
  std::vector<std::pair<std::string, double>> values;
};

int run(bool quick) {
  int device = 0;
  BENCH_CHECK_CUDA(cudaSetDevice(device));
  cudaDeviceProp properties{};
  BENCH_CHECK_CUDA(cudaGetDeviceProperties(&properties, device));
  const Layout layout{quick ? 128ull : 512ull, 32};  // frames per direction; 64 MiB batches
  const uint64_t direction_bytes = layout.frames * kFrameBytes;
  const int repetitions = quick ? 3 : 5;

  runtimed::BackendConfig config;
  config.device = device;
  config.gpu_pool_bytes = 2 * direction_bytes;
  config.host_pool_bytes = 2 * direction_bytes;
  auto start = std::chrono::steady_clock::now();
  Result<std::unique_ptr<DeviceBackend>> made = runtimed::make_cuda_backend(config);
  check_status(made.status(), "make_cuda_backend");
  double startup_seconds = seconds_since(start);
  DeviceBackend& backend = *made.value();
  // Host slabs start unprepared (the engine renews them in the background): prepare them all, and
  // time it (slab renewal: a new memfd, populated and pinned).
  auto renew_all = [&](Tier tier, uint64_t count) {
    CompletionCounter renewed;
    auto began = std::chrono::steady_clock::now();
    for (uint64_t index = 0; index < count; ++index) {
      check_status(backend.renew(tier, static_cast<uint32_t>(index), renewed.callback()), "renew");
    }
    renewed.wait_for(count);
    return seconds_since(began) * 1e6 / double(count);
  };
  double slab_renew_us = renew_all(Tier::kHost, backend.host_slab_count());
  std::printf("[renew] %llu host slabs of %u frames: %.0f us per slab\n",
              static_cast<unsigned long long>(backend.host_slab_count()), backend.host_slab_frames(), slab_renew_us);
  for (uint64_t frame = 0; frame < 2 * layout.frames; ++frame) {
    std::memset(backend.frame_pointer(Tier::kHost, frame), static_cast<int>(frame), kFrameBytes);
  }

  RawBuffers raw;
  raw.bytes = direction_bytes;
  BENCH_CHECK_CUDA(cudaHostAlloc(&raw.host, 2 * direction_bytes, cudaHostAllocDefault));
  std::memset(raw.host, 1, 2 * direction_bytes);
  BENCH_CHECK_CUDA(cudaMalloc(&raw.device, 2 * direction_bytes));
  for (auto& stream : raw.streams) BENCH_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  std::vector<Row> bandwidth_rows;
  const uint64_t batch_bytes = layout.batch_frames * kFrameBytes;
  for (uint64_t page_bytes : {64ull << 10, 256ull << 10, 2ull << 20}) {
    for (bool scattered : {false, true}) {
      auto in = make_batches(layout, page_bytes, true, scattered, page_bytes);
      auto out = make_batches(layout, page_bytes, false, scattered, page_bytes + 1);
      std::vector<std::vector<CopyOp>> none;
      uint64_t raw_piece = scattered ? page_bytes : batch_bytes;
      struct Mode {
        const char* name;
        bool inbound, outbound;
      };
      for (Mode mode : {Mode{"host_to_gpu", true, false}, Mode{"gpu_to_host", false, true}, Mode{"both_ways", true, true}}) {
        std::vector<double> backend_seconds, raw_seconds;
        run_backend(backend, mode.inbound ? in : none, mode.outbound ? out : none);  // warm-up
        run_raw(raw, raw_piece, mode.inbound, mode.outbound);
        for (int repetition = 0; repetition < repetitions; ++repetition) {
          backend_seconds.push_back(run_backend(backend, mode.inbound ? in : none, mode.outbound ? out : none));
          raw_seconds.push_back(run_raw(raw, raw_piece, mode.inbound, mode.outbound));
        }
        double bytes = static_cast<double>(direction_bytes) * ((mode.inbound ? 1 : 0) + (mode.outbound ? 1 : 0));
        double backend_gbps = bytes / median(backend_seconds) / 1e9;
        double raw_gbps = bytes / median(raw_seconds) / 1e9;
        std::string name = std::string(mode.name) + (scattered ? "/scattered/" : "/merged/") +
                           std::to_string(page_bytes >> 10) + "KiB";
        bandwidth_rows.push_back(Row{name,
                                     {{"page_kib", static_cast<double>(page_bytes >> 10)},
                                      {"raw_piece_kib", static_cast<double>(raw_piece >> 10)},
                                      {"backend_gbps", backend_gbps},
                                      {"raw_gbps", raw_gbps},
                                      {"ratio", backend_gbps / raw_gbps}}});
        std::printf("[bandwidth] %-32s backend %6.1f GB/s  raw %6.1f GB/s  ratio %.3f\n", name.c_str(), backend_gbps,
                    raw_gbps, backend_gbps / raw_gbps);
        std::fflush(stdout);
      }
    }
  }

  // (b) The client's mapping costs, and renewal.
  std::vector<Row> map_rows;
  {
    const uint32_t frames = static_cast<uint32_t>(std::min<uint64_t>(512, 2 * layout.frames));
    std::vector<double> export_us, import_us, map_us, unmap_us;
    for (int round = 0; round < repetitions; ++round) {
      Result<std::unique_ptr<FrameMapper>> mapper = make_cuda_mapper(device);
      check_status(mapper.status(), "make_cuda_mapper");
      Result<char*> base = mapper.value()->reserve(uint64_t(frames) * kFrameBytes);
      check_status(base.status(), "reserve");
      std::vector<int> fds(frames);
      auto exported = std::chrono::steady_clock::now();
      for (uint32_t frame = 0; frame < frames; ++frame) {
        Result<int> fd = backend.export_gpu_frame(frame);
        check_status(fd.status(), "export_gpu_frame");
        fds[frame] = fd.value();
      }
      export_us.push_back(seconds_since(exported) * 1e6 / frames);
      auto imported = std::chrono::steady_clock::now();
      for (uint32_t frame = 0; frame < frames; ++frame) check_status(mapper.value()->adopt_frame(frame, fds[frame]), "adopt_frame");
      import_us.push_back(seconds_since(imported) * 1e6 / frames);
      auto mapped = std::chrono::steady_clock::now();
      for (uint32_t frame = 0; frame < frames; ++frame) {
        check_status(mapper.value()->map(frame, base.value() + uint64_t(frame) * kFrameBytes), "map");
      }
      map_us.push_back(seconds_since(mapped) * 1e6 / frames);
      auto unmapped = std::chrono::steady_clock::now();
      for (uint32_t frame = 0; frame < frames; ++frame) {
        check_status(mapper.value()->unmap(base.value() + uint64_t(frame) * kFrameBytes), "unmap");
      }
      unmap_us.push_back(seconds_since(unmapped) * 1e6 / frames);
      for (uint32_t frame = 0; frame < frames; ++frame) mapper.value()->drop_frame(frame);
      mapper.value()->release(base.value(), uint64_t(frames) * kFrameBytes);
    }
    double gpu_renew_us = renew_all(Tier::kGpu, frames);
    double map = median(map_us), unmap = median(unmap_us), exported = median(export_us), imported = median(import_us);
    map_rows.push_back(Row{"client_map_unmap",
                           {{"frames", static_cast<double>(frames)},
                            {"export_us", exported},
                            {"map_us", map},
                            {"unmap_us", unmap},
                            {"map_unmap_pages_per_s", 1e6 / (map + unmap)},
                            {"import_us", imported},
                            {"gpu_frame_renew_us", gpu_renew_us},
                            {"host_slab_renew_us", slab_renew_us}}});
    std::printf("[map] export %.1f us, import %.1f us, map (map+access) %.1f us, unmap %.1f us: %.0f map+unmap "
                "frames/s; renewal %.1f us per GPU frame, %.0f us per host slab\n",
                exported, imported, map, unmap, 1e6 / (map + unmap), gpu_renew_us, slab_renew_us);
  }

  // (c) Kernels alone vs while the backend streams a schedule in and out.
  std::vector<Row> overlap_rows;
  {
    cudaStream_t compute;
    BENCH_CHECK_CUDA(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
    int blocks = properties.multiProcessorCount * 8;
    float* burn_data = nullptr;
    BENCH_CHECK_CUDA(cudaMalloc(&burn_data, static_cast<size_t>(blocks) * 1024 * sizeof(float)));
    BENCH_CHECK_CUDA(cudaMemset(burn_data, 0, static_cast<size_t>(blocks) * 1024 * sizeof(float)));
    const size_t stream_count = (1ull << 30) / sizeof(float4);  // two 1 GiB vectors
    float4 *x = nullptr, *y = nullptr;
    BENCH_CHECK_CUDA(cudaMalloc(&x, stream_count * sizeof(float4)));
    BENCH_CHECK_CUDA(cudaMalloc(&y, stream_count * sizeof(float4)));
    BENCH_CHECK_CUDA(cudaMemset(x, 0, stream_count * sizeof(float4)));
    BENCH_CHECK_CUDA(cudaMemset(y, 0, stream_count * sizeof(float4)));
    std::vector<KernelLoop> loops = {
        {"compute_bound", [&](cudaStream_t s) { burn_kernel<<<blocks, 1024, 0, s>>>(burn_data, 20000); }, quick ? 60 : 200},
        {"hbm_bound", [&](cudaStream_t s) { stream_kernel<<<properties.multiProcessorCount * 4, 512, 0, s>>>(x, y, stream_count); },
         quick ? 300 : 1000},
    };
    // The schedule: 64 MiB steps in and out, up to 4 of each in flight, as a trainer's
    // prefetch/offload pipeline would keep them.
    auto in = make_batches(layout, 256ull << 10, true, false, 1);
    auto out = make_batches(layout, 256ull << 10, false, false, 2);
    for (const KernelLoop& loop : loops) {
      loop.launch(compute);
      BENCH_CHECK_CUDA(cudaStreamSynchronize(compute));
      double alone_before = time_loop(loop, compute);
      std::atomic<bool> stop{false};
      std::atomic<uint64_t> streamed_bytes{0};
      double streaming_seconds = 0;
      std::thread streamer([&] {
        CompletionCounter counter;
        uint64_t issued = 0;
        auto began = std::chrono::steady_clock::now();
        for (size_t step = 0; !stop.load(); step = (step + 1) % in.size()) {
          if (issued >= counter.completed() + 8) counter.wait_for(issued - 7);
          check_status(backend.enqueue_copies(in[step], counter.callback()), "enqueue_copies");
          check_status(backend.enqueue_copies(out[step], counter.callback()), "enqueue_copies");
          issued += 2;
          streamed_bytes += 2 * layout.batch_frames * kFrameBytes;
        }
        counter.wait_for(issued);
        streaming_seconds = seconds_since(began);
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // transfers at full rate first
      double with_transfers = time_loop(loop, compute);
      stop = true;
      streamer.join();
      double alone_after = time_loop(loop, compute);
      double alone = (alone_before + alone_after) / 2;
      double streamed_gbps = static_cast<double>(streamed_bytes.load()) / streaming_seconds / 1e9;
      overlap_rows.push_back(Row{loop.name,
                                 {{"alone_s", alone},
                                  {"with_transfers_s", with_transfers},
                                  {"ratio", alone / with_transfers},
                                  {"streamed_gbps", streamed_gbps}}});
      std::printf("[overlap] %-14s alone %.3f s, with transfers %.3f s (%.1f GB/s streamed): ratio %.3f\n",
                  loop.name.c_str(), alone, with_transfers, streamed_gbps, alone / with_transfers);
    }
    BENCH_CHECK_CUDA(cudaFree(burn_data));
    BENCH_CHECK_CUDA(cudaFree(x));
    BENCH_CHECK_CUDA(cudaFree(y));
    BENCH_CHECK_CUDA(cudaStreamDestroy(compute));
  }
  backend.drain();

  // (d) Host time of handing copies over (Note [Copies handed over in one call]).
  std::vector<Row> handoff_rows;
  {
    runtimed::BackendConfig per_copy_config = config;
    per_copy_config.batch_copies = false;
    Result<std::unique_ptr<DeviceBackend>> per_copy_made = runtimed::make_cuda_backend(per_copy_config);
    check_status(per_copy_made.status(), "make_cuda_backend (one call per copy)");
    DeviceBackend& per_copy = *per_copy_made.value();
    // Completion by CUDA events instead of completion words (Note [Completion words]).
    runtimed::BackendConfig events_config = config;
    events_config.completion_words = false;
    Result<std::unique_ptr<DeviceBackend>> events_made = runtimed::make_cuda_backend(events_config);
    check_status(events_made.status(), "make_cuda_backend (completion events)");
    DeviceBackend& with_events = *events_made.value();
    for (DeviceBackend* other : {&per_copy, &with_events}) {
      CompletionCounter prepared;
      for (uint64_t slab = 0; slab < other->host_slab_count(); ++slab) {
        check_status(other->renew(Tier::kHost, static_cast<uint32_t>(slab), prepared.callback()), "renew");
      }
      prepared.wait_for(other->host_slab_count());
    }
    cudaStream_t stream = nullptr;
    BENCH_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const int rounds = quick ? 4 : 8;
    // Host microseconds per copy of enqueue_copies over every batch of `batches`, median of rounds.
    auto time_backend = [&](DeviceBackend& target, const std::vector<std::vector<CopyOp>>& batches) {
      std::vector<double> per_copy_us;
      for (int round = 0; round < rounds; ++round) {
        CompletionCounter counter;
        double handing = 0;
        uint64_t copies = 0;
        for (const auto& batch : batches) {
          auto began = std::chrono::steady_clock::now();
          check_status(target.enqueue_copies(batch, counter.callback()), "enqueue_copies");
          handing += seconds_since(began);
          copies += batch.size();
        }
        counter.wait_for(batches.size());
        per_copy_us.push_back(handing * 1e6 / double(copies));
      }
      return median(per_copy_us);
    };
    // The same copies as raw driver calls on the backend's frame pointers.
    // waiter: 0 none; 1 an event per batch waited for with cudaEventSynchronize on another thread
    // (the backend's way); 2 the same events polled with cudaEventQuery.
    std::vector<cudaEvent_t> batch_events(layout.frames);
    for (auto& event : batch_events) {
      BENCH_CHECK_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync));
    }
    auto time_raw = [&](DeviceBackend& target, const std::vector<std::vector<CopyOp>>& batches, bool batched,
                        int waiter_kind = 0) {
      std::unique_ptr<EventWaiter> waiter;
      if (waiter_kind != 0) waiter = std::make_unique<EventWaiter>(waiter_kind == 2);
      std::vector<double> per_copy_us;
      std::vector<void*> destinations;
      std::vector<const void*> sources;
      std::vector<size_t> sizes;
      for (int round = 0; round < rounds; ++round) {
        double handing = 0;
        uint64_t copies = 0;
        for (const auto& batch : batches) {
          destinations.clear();
          sources.clear();
          sizes.clear();
          for (const CopyOp& op : batch) {
            destinations.push_back(static_cast<char*>(target.frame_pointer(op.dst_tier, op.dst_frame)) + op.dst_offset);
            sources.push_back(static_cast<char*>(target.frame_pointer(op.src_tier, op.src_frame)) + op.src_offset);
            sizes.push_back(op.bytes);
          }
          auto began = std::chrono::steady_clock::now();
          if (batched && batch.size() > 1) {
            cudaMemcpyAttributes attributes = {};
            attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
            size_t first = 0;
            BENCH_CHECK_CUDA(cudaMemcpyBatchAsync(destinations.data(), sources.data(), sizes.data(), batch.size(),
                                                  &attributes, &first, 1, stream));
          } else {
            for (size_t i = 0; i < batch.size(); ++i) {
              BENCH_CHECK_CUDA(cudaMemcpyAsync(destinations[i], sources[i], sizes[i], cudaMemcpyDefault, stream));
            }
          }
          if (waiter) {
            cudaEvent_t event = batch_events[(&batch - batches.data()) % batch_events.size()];
            BENCH_CHECK_CUDA(cudaEventRecord(event, stream));
            waiter->add(event);
          }
          handing += seconds_since(began);
          copies += batch.size();
        }
        BENCH_CHECK_CUDA(cudaStreamSynchronize(stream));
        if (waiter) waiter->wait_idle();
        per_copy_us.push_back(handing * 1e6 / double(copies));
      }
      return median(per_copy_us);
    };
    for (uint64_t batch_frames : {1ull, 4ull, 16ull, 64ull}) {
      for (bool inbound : {true, false}) {
        Layout copies_layout{layout.frames, batch_frames};
        auto batches = make_batches(copies_layout, kFrameBytes, inbound, true, 7 + batch_frames);
        (void)time_backend(backend, batches);  // warm-up
        double batched_us = time_backend(backend, batches);
        double one_by_one_us = time_backend(per_copy, batches);
        double events_us = time_backend(with_events, batches);
        double raw_batched_us = time_raw(backend, batches, true);
        double raw_one_by_one_us = time_raw(backend, batches, false);
        double raw_waited_us = time_raw(backend, batches, false, 1);
        double raw_polled_us = time_raw(backend, batches, false, 2);
        std::string name = std::string(inbound ? "host_to_gpu" : "gpu_to_host") + "/" + std::to_string(batch_frames) +
                           "_frames";
        handoff_rows.push_back(Row{name,
                                   {{"copies_per_batch", double(batch_frames)},
                                    {"backend_batched_us", batched_us},
                                    {"backend_one_by_one_us", one_by_one_us},
                                    {"backend_events_us", events_us},
                                    {"raw_batched_us", raw_batched_us},
                                    {"raw_one_by_one_us", raw_one_by_one_us},
                                    {"raw_event_waited_us", raw_waited_us},
                                    {"raw_event_polled_us", raw_polled_us},
                                    {"ratio", one_by_one_us / batched_us}}});
        std::printf("[handoff] %-24s us per copy: backend batched %.2f, one by one %.2f, with completion events "
                    "%.2f; raw batched %.2f, one by one %.2f, + an event per batch waited on a thread %.2f / polled "
                    "%.2f\n",
                    name.c_str(), batched_us, one_by_one_us, events_us, raw_batched_us, raw_one_by_one_us,
                    raw_waited_us, raw_polled_us);
        std::fflush(stdout);
      }
    }
    per_copy.drain();
    with_events.drain();
    backend.drain();
    for (auto& event : batch_events) BENCH_CHECK_CUDA(cudaEventDestroy(event));
    BENCH_CHECK_CUDA(cudaStreamDestroy(stream));
  }

  // Results.
  const char* directory_variable = std::getenv("MEMBAR_RESULTS_DIR");
  std::string directory = directory_variable != nullptr && *directory_variable != 0 ? directory_variable : "bench/results/latest";
  std::system(("mkdir -p '" + directory + "'").c_str());
  char date[64];
  std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const char* commit_variable = std::getenv("MEMBAR_COMMIT");
  std::string commit = commit_variable != nullptr ? commit_variable : shell_line("git rev-parse --short HEAD 2>/dev/null");
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  auto worst_ratio = [](const std::vector<Row>& rows, const std::string& filter) {
    double worst = 1e9;
    for (const Row& row : rows) {
      if (row.name.find(filter) == std::string::npos) continue;
      for (const auto& [key, value] : row.values) if (key == "ratio") worst = std::min(worst, value);
    }
    return worst;
  };
  double worst_bandwidth = std::min(worst_ratio(bandwidth_rows, "/merged/"), worst_ratio(bandwidth_rows, "/scattered/"));
  double worst_overlap = worst_ratio(overlap_rows, "");

  std::ostringstream json;
  json.precision(6);
  json << "{\n  \"benchmark\": \"runtime_bench\",\n  \"date\": \"" << date << "\",\n  \"commit\": \"" << json_escape(commit)
       << "\",\n  \"machine\": {\"host\": \"" << json_escape(host) << "\", \"gpu\": \"" << json_escape(properties.name)
       << "\", \"sms\": " << properties.multiProcessorCount << "},\n  \"quick\": " << (quick ? "true" : "false")
       << ",\n  \"bytes_per_direction\": " << direction_bytes << ",\n  \"batch_bytes\": " << batch_bytes
       << ",\n  \"backend_startup_s\": " << startup_seconds << ",\n";
  auto section = [&](const char* name, const std::vector<Row>& rows, bool last) {
    json << "  \"" << name << "\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      json << "    {\"name\": \"" << rows[i].name << "\"";
      for (const auto& [key, value] : rows[i].values) {
        json << ", \"" << key << "\": ";
        if (std::isfinite(value)) {
          json << value;
        } else {
          json << "null";
        }
      }
      json << "}" << (i + 1 < rows.size() ? "," : "") << "\n";
    }
    json << "  ]" << (last ? "\n" : ",\n");
  };
  section("bandwidth", bandwidth_rows, false);
  section("mapping", map_rows, false);
  section("overlap", overlap_rows, false);
  section("handoff", handoff_rows, false);
  json << "  \"goals\": {\"bandwidth_ratio_min\": 0.9, \"bandwidth_ratio_worst\": " << worst_bandwidth
       << ", \"overlap_ratio_min\": 0.97, \"overlap_ratio_worst\": " << worst_overlap << "}\n}\n";

  std::ostringstream text;
  char line[512];
  text << "runtime_bench  " << date << "  commit " << commit << "  " << properties.name << " on " << host << "\n";
  std::snprintf(line, sizeof(line), "%.0f MiB per direction, %.0f MiB batches, backend start-up %.2f s\n\n",
                direction_bytes / 1048576.0, batch_bytes / 1048576.0, startup_seconds);
  text << line << "(a) bandwidth: backend vs raw cudaMemcpyAsync from pinned memory (goal >= 0.9x)\n";
  std::snprintf(line, sizeof(line), "%-34s %10s %10s %10s %8s\n", "transfer", "raw piece", "backend", "raw", "ratio");
  text << line;
  for (const Row& row : bandwidth_rows) {
    std::snprintf(line, sizeof(line), "%-34s %7.0f KiB %5.1f GB/s %5.1f GB/s %8.3f\n", row.name.c_str(), row.values[1].second,
                  row.values[2].second, row.values[3].second, row.values[4].second);
    text << line;
  }
  text << "\n(b) the client's mapping costs (CUDA mapper) and renewal\n";
  for (const Row& row : map_rows) {
    std::snprintf(line, sizeof(line),
                  "export %.1f us, import %.1f us, map %.1f us, unmap %.1f us per 2 MiB frame: %.0f map+unmap frames/s\n"
                  "renewal: %.1f us per GPU frame, %.0f us per host slab\n",
                  row.values[1].second, row.values[5].second, row.values[2].second, row.values[3].second,
                  row.values[4].second, row.values[6].second, row.values[7].second);
    text << line;
  }
  text << "\n(c) kernels alone vs while the backend streams in and out (goal >= 0.97x)\n";
  for (const Row& row : overlap_rows) {
    std::snprintf(line, sizeof(line), "%-14s alone %.3f s, with transfers %.3f s, streamed %.1f GB/s: ratio %.3f\n",
                  row.name.c_str(), row.values[0].second, row.values[1].second, row.values[3].second, row.values[2].second);
    text << line;
  }
  text << "\n(d) host time of handing scattered 2 MiB copies over, us per copy (batched = cudaMemcpyBatchAsync)\n";
  for (const Row& row : handoff_rows) {
    std::snprintf(line, sizeof(line),
                  "%-24s backend batched %6.2f, one by one %6.2f, completion events %6.2f; raw batched %6.2f, one by "
                  "one %6.2f, with events waited %6.2f / polled %6.2f\n",
                  row.name.c_str(), row.values[1].second, row.values[2].second, row.values[3].second,
                  row.values[4].second, row.values[5].second, row.values[6].second, row.values[7].second);
    text << line;
  }
  std::snprintf(line, sizeof(line), "\nworst bandwidth ratio %.3f (goal 0.9), worst overlap ratio %.3f (goal 0.97)\n",
                worst_bandwidth, worst_overlap);
  text << line;

  std::ofstream(directory + "/runtime_bench.json") << json.str();
  std::ofstream(directory + "/runtime_bench.txt") << text.str();
  std::printf("\n%s\nwrote %s/runtime_bench.json and runtime_bench.txt\n", text.str().c_str(), directory.c_str());

  BENCH_CHECK_CUDA(cudaFreeHost(raw.host));
  BENCH_CHECK_CUDA(cudaFree(raw.device));
  for (auto& stream : raw.streams) BENCH_CHECK_CUDA(cudaStreamDestroy(stream));
  return 0;
}

}  // namespace
}  // namespace membar::bench

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: runtime_bench [--quick]\n");
      return 2;
    }
  }
  return membar::bench::run(quick);
}
