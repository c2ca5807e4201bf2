// A trainer's pipeline through the whole client API on one GPU, against the same kernels on
// memory that never moves, measured in the same run:
//   a space of pages several times the client's GPU quota; step s acquires one group of pages
//   (the schedule is set up front, so advance(s) prefetches the next groups), the trainer's
//   stream waits for them on the GPU (stream_wait), a kernel reads and rewrites every word,
//   and stream_release hands them back without the CPU waiting for the kernel (Note
//   [Stream-ordered release]); the runtime writes dirty pages back and evicts behind.
// Reported: step time and the ratio of compute alone to compute in the pipeline (goal >= 0.97x,
// issue 2), bytes moved, the host time spent inside runtime calls per step, and an integrity
// check (every word of every page equals the number of passes over it; any lost or stale
// writeback shows). Runs on the embedded runtime, or through a membard with --socket PATH.
// Writes pipeline_bench.json / .txt to $MEMBAR_RESULTS_DIR (default bench/results/latest).
// Usage: pipeline_bench [--socket PATH] [--quick] [--rounds N (kernel work per word)]
#include <cuda_runtime.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "membar/client.h"

namespace membar::bench {
namespace {

#define PIPELINE_CHECK_CUDA(expression)                                                              \
  do {                                                                                              \
    cudaError_t pipeline_error_ = (expression);                                                     \
    if (pipeline_error_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s failed: %s\n", __FILE__, __LINE__, #expression,                 \
                   cudaGetErrorString(pipeline_error_));                                            \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

void check(const Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, status.to_string().c_str());
  std::exit(1);
}

constexpr int kMaxGroupPages = 16;

// The pages of one step, by value (no pointer table to copy).
struct Group {
  float* pages[kMaxGroupPages];
  int count = 0;
};

// Every word of every page: `rounds` dependent multiply-adds (compute), then +1 (the write the
// integrity check counts). Grid-stride over the group's pages.
__global__ void step_kernel(Group group, uint64_t words_per_page, int rounds) {
  uint64_t total = words_per_page * uint64_t(group.count);
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < total; i += uint64_t(gridDim.x) * blockDim.x) {
    float* word = group.pages[i / words_per_page] + (i % words_per_page);
    float value = *word;
    float scratch = value * 1e-7f;
    for (int r = 0; r < rounds; ++r) scratch = scratch * 0.999f + 1e-9f;
    *word = value + 1.0f + (scratch > 1e30f ? 1.0f : 0.0f);
  }
}

struct Config {
  uint64_t page_bytes = 2ull << 20;
  int group_pages = 8;       // pages per step
  int groups = 32;           // distinct groups (the space)
  int passes = 4;            // times the schedule walks all groups
  uint64_t gpu_quota_groups = 4;
  int rounds = 24576;        // kernel work per word: about 2 ms per step on an H200
};

double elapsed_s(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int run(const std::string& socket, bool quick, int rounds) {
  Config config;
  if (rounds > 0) config.rounds = rounds;
  if (quick) {
    config.groups = 12;
    config.passes = 2;
  }
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::fprintf(stderr, "pipeline_bench needs a CUDA GPU\n");
    return 2;
  }
  const uint64_t group_bytes = config.page_bytes * config.group_pages;
  const uint64_t words_per_page = config.page_bytes / sizeof(float);
  const uint32_t pages = uint32_t(config.groups * config.group_pages);
  const int steps = config.groups * config.passes;

  ConnectOptions options;
  options.client_name = "pipeline-bench";
  options.gpu_quota_bytes = config.gpu_quota_groups * group_bytes;
  options.embedded.backend = BackendKind::kCuda;
  options.embedded.gpu_pool_bytes = config.gpu_quota_groups * group_bytes;
  options.embedded.host_pool_bytes = uint64_t(pages) * config.page_bytes + (64ull << 20);
  options.socket_path = socket;
  options.allow_embedded = false;
  Result<std::unique_ptr<Client>> connected =
      socket.empty() ? make_embedded_client(options.embedded) : connect(options);
  check(connected.status(), "connect");
  Client& client = *connected.value();
  if (client.backend() != BackendKind::kCuda) {
    std::fprintf(stderr, "the runtime does not run the CUDA backend (%s)\n", client.describe().c_str());
    return 2;
  }
  Result<SpaceId> space = client.create_space("pipeline.pages", config.page_bytes, pages);
  check(space.status(), "create_space");
  std::vector<ScheduleStep> schedule;
  for (int s = 0; s < steps; ++s) {
    int group = s % config.groups;
    ScheduleStep step;
    step.ranges.push_back(PageRange{space.value(), uint32_t(group * config.group_pages), uint32_t(config.group_pages)});
    schedule.push_back(step);
  }
  check(client.set_schedule(schedule), "set_schedule");

  cudaStream_t stream;
  PIPELINE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int sms = 0;
  PIPELINE_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  dim3 grid(sms * 4), block(256);

  // Baseline: the same kernels over one group of device memory that never moves.
  float* resident = nullptr;
  PIPELINE_CHECK_CUDA(cudaMalloc(&resident, group_bytes));
  PIPELINE_CHECK_CUDA(cudaMemsetAsync(resident, 0, group_bytes, stream));
  Group resident_group;
  resident_group.count = config.group_pages;
  for (int i = 0; i < config.group_pages; ++i) resident_group.pages[i] = resident + i * words_per_page;
  cudaEvent_t begin, end;
  PIPELINE_CHECK_CUDA(cudaEventCreate(&begin));
  PIPELINE_CHECK_CUDA(cudaEventCreate(&end));
  auto time_resident = [&] {
    PIPELINE_CHECK_CUDA(cudaEventRecord(begin, stream));
    for (int s = 0; s < steps; ++s) step_kernel<<<grid, block, 0, stream>>>(resident_group, words_per_page, config.rounds);
    PIPELINE_CHECK_CUDA(cudaEventRecord(end, stream));
    PIPELINE_CHECK_CUDA(cudaEventSynchronize(end));
    float ms = 0;
    PIPELINE_CHECK_CUDA(cudaEventElapsedTime(&ms, begin, end));
    return ms / 1e3;
  };
  time_resident();  // warm-up
  double resident_s = time_resident();

  // The pipeline. Host time inside runtime calls is summed separately from the wall time.
  double call_s = 0;
  auto timed = [&](auto&& call) {
    auto start = std::chrono::steady_clock::now();
    auto result = call();
    call_s += elapsed_s(start);
    return result;
  };
  Result<RuntimeStats> before = client.stats();
  check(before.status(), "stats");
  auto wall_start = std::chrono::steady_clock::now();
  PIPELINE_CHECK_CUDA(cudaEventRecord(begin, stream));
  for (int s = 0; s < steps; ++s) {
    PageRange range = schedule[s].ranges[0];
    check(timed([&] { return client.advance(uint32_t(s)); }), "advance");
    Result<Acquired> acquired = timed([&] { return client.acquire(range, kAcquireWrite | kAcquireZeroNew); });
    check(acquired.status(), "acquire");
    check(timed([&] { return client.stream_wait(acquired.value().ticket, stream); }), "stream_wait");
    Group group;
    group.count = config.group_pages;
    // The group's pages are one contiguous range (Note [Space layout]).
    for (int i = 0; i < config.group_pages; ++i) {
      group.pages[i] = static_cast<float*>(acquired.value().pointer) + uint64_t(i) * words_per_page;
    }
    step_kernel<<<grid, block, 0, stream>>>(group, words_per_page, config.rounds);
    PIPELINE_CHECK_CUDA(cudaGetLastError());
    check(timed([&] { return client.stream_release(range, true, stream); }), "stream_release");
  }
  PIPELINE_CHECK_CUDA(cudaEventRecord(end, stream));
  PIPELINE_CHECK_CUDA(cudaEventSynchronize(end));
  double pipeline_wall_s = elapsed_s(wall_start);
  float pipeline_ms = 0;
  PIPELINE_CHECK_CUDA(cudaEventElapsedTime(&pipeline_ms, begin, end));
  double pipeline_s = pipeline_ms / 1e3;
  Result<RuntimeStats> after = client.stats();
  check(after.status(), "stats");

  // Integrity: every page was touched `passes` times, so every word equals passes.
  uint64_t bad_words = 0, checked_words = 0;
  std::vector<float> host(words_per_page);
  for (uint32_t p = 0; p < pages; ++p) {
    Result<void*> pointer = client.acquire_host(PageRange{space.value(), p, 1});
    check(pointer.status(), "acquire_host");
    std::memcpy(host.data(), pointer.value(), config.page_bytes);
    check(client.release_host(PageRange{space.value(), p, 1}, false), "release_host");
    for (float value : host) bad_words += value != float(config.passes) ? 1 : 0;
    checked_words += host.size();
  }

  const ClientStats& b = before.value().clients.at(0);
  const ClientStats& a = after.value().clients.at(0);
  double moved_in = double(a.bytes_host_to_gpu - b.bytes_host_to_gpu);
  double moved_out = double(a.bytes_gpu_to_host - b.bytes_gpu_to_host);
  double ratio = resident_s / pipeline_s;
  char text[2048];
  std::snprintf(text, sizeof(text),
                "pipeline through the client API (%s): %d steps of %d x %llu KiB pages, space %u pages "
                "(%.0f MiB), GPU quota %llu MiB\n"
                "  compute alone        %8.3f s  (%.2f ms/step)\n"
                "  compute in pipeline  %8.3f s  (%.2f ms/step; wall %.3f s)\n"
                "  ratio                %8.3f  (goal >= 0.97)\n"
                "  moved host->GPU %.2f GiB, GPU->host %.2f GiB (%.1f GB/s each way while running)\n"
                "  host time in runtime calls %.1f us/step (advance, acquire, stream_wait, stream_release)\n"
                "  prefetch hits %llu, misses %llu, evictions %llu\n"
                "  integrity: %llu of %llu words wrong\n",
                client.describe().c_str(), steps, config.group_pages,
                static_cast<unsigned long long>(config.page_bytes >> 10), pages,
                double(pages) * config.page_bytes / (1 << 20),
                static_cast<unsigned long long>(options.gpu_quota_bytes >> 20), resident_s, 1e3 * resident_s / steps,
                pipeline_s, 1e3 * pipeline_s / steps, pipeline_wall_s, ratio, moved_in / (1ull << 30),
                moved_out / (1ull << 30), moved_in / pipeline_s / 1e9, 1e6 * call_s / steps,
                static_cast<unsigned long long>(a.prefetch_hits - b.prefetch_hits),
                static_cast<unsigned long long>(a.prefetch_misses - b.prefetch_misses),
                static_cast<unsigned long long>(a.evictions - b.evictions),
                static_cast<unsigned long long>(bad_words), static_cast<unsigned long long>(checked_words));
  std::printf("%s", text);

  const char* directory = std::getenv("MEMBAR_RESULTS_DIR");
  std::string out = directory != nullptr && *directory ? directory : "bench/results/latest";
  ::mkdir(out.c_str(), 0755);
  std::string mode = socket.empty() ? "embedded" : "daemon";
  std::ofstream(out + "/pipeline_bench_" + mode + ".txt") << text;
  std::ofstream json(out + "/pipeline_bench_" + mode + ".json");
  json << "{\"runtime\": \"" << client.describe() << "\", \"steps\": " << steps
       << ", \"group_pages\": " << config.group_pages << ", \"page_bytes\": " << config.page_bytes
       << ", \"space_pages\": " << pages << ", \"gpu_quota_bytes\": " << options.gpu_quota_bytes
       << ", \"compute_alone_s\": " << resident_s << ", \"compute_in_pipeline_s\": " << pipeline_s
       << ", \"pipeline_wall_s\": " << pipeline_wall_s << ", \"ratio\": " << ratio
       << ", \"bytes_host_to_gpu\": " << moved_in << ", \"bytes_gpu_to_host\": " << moved_out
       << ", \"host_call_us_per_step\": " << 1e6 * call_s / steps
       << ", \"prefetch_hits\": " << (a.prefetch_hits - b.prefetch_hits)
       << ", \"prefetch_misses\": " << (a.prefetch_misses - b.prefetch_misses)
       << ", \"evictions\": " << (a.evictions - b.evictions) << ", \"wrong_words\": " << bad_words
       << ", \"checked_words\": " << checked_words << "}\n";

  PIPELINE_CHECK_CUDA(cudaFree(resident));
  PIPELINE_CHECK_CUDA(cudaStreamDestroy(stream));
  return bad_words == 0 ? 0 : 1;
}

}  // namespace
}  // namespace membar::bench

int main(int argc, char** argv) {
  std::string socket;
  bool quick = false;
  int rounds = 0;
  for (int i = 1; i < argc; ++i) {
    std::string argument = argv[i];
    if (argument == "--quick") {
      quick = true;
    } else if (argument == "--socket" && i + 1 < argc) {
      socket = argv[++i];
    } else if (argument == "--rounds" && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: pipeline_bench [--socket PATH] [--quick] [--rounds N]\n");
      return 2;
    }
  }
  return membar::bench::run(socket, quick, rounds);
}
