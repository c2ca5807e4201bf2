// A trainer stand-in for the integration tests: a separate process that talks to a real membard.
//   membar_integration_worker integrity --socket PATH --seed S --cycles N [--pages P] [--gpu-quota BYTES]
//     Random schedule of acquire (read / write), offload, prefetch, host access and free over two
//     spaces (64 KiB pages, and 96 KiB pages that straddle frames); every page's contents are a
//     pseudo-random stream keyed by (seed, space, page, version) and checked whenever the page is
//     read. Prints one RESULT line; exit 0 only when no page was corrupted or lost and no call
//     failed.
//   membar_integration_worker hold --socket PATH [--pages P]
//     Fills pages on both tiers, prints READY, then sleeps (the test kills it with SIGKILL).
//   membar_integration_worker fill --socket PATH --signature S
//     Takes all the GPU and host memory its quotas allow, fills every byte with words signed S,
//     prints READY, then sleeps (the test kills it and checks no later client reads S).
//   membar_integration_worker soak --socket PATH --seed S --seconds T [--gpu-quota B] [--host-quota B]
//     Random work over four spaces of odd page sizes until T seconds passed (or SIGKILL): every word
//     it writes carries a signature of this process, and every page it acquires, on either tier,
//     must hold zeros or its own words (0 leaked words) and, where it knows the contents, exactly
//     them (0 corrupted pages). Prints PROGRESS lines and a RESULT line; exit 0 when clean.
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "membar/client.h"

#if defined(MEMBAR_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace {

using namespace membar;

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

struct Rng {
  uint64_t state;
  uint64_t next() { return state = splitmix(state); }
  uint32_t below(uint32_t n) { return static_cast<uint32_t>(next() % n); }
};

// Version v of a page's contents, as 64-bit words carrying `signature` in their top 24 bits
// (never zero); version 0 is "zero-filled" (a fresh page under kAcquireZeroNew).
uint64_t word(uint32_t signature, uint64_t key, int64_t version, uint64_t index) {
  uint64_t x = splitmix(key ^ (static_cast<uint64_t>(version) << 40) ^ (index * 0x9e3779b97f4a7c15ull));
  return (uint64_t(signature & 0xffffff) << 40) | (x & 0xffffffffffull) | 1;
}

void fill(void* page, uint64_t bytes, uint32_t signature, uint64_t key, int64_t version) {
  auto* words = static_cast<uint64_t*>(page);
  for (uint64_t i = 0; i < bytes / 8; ++i) words[i] = version == 0 ? 0 : word(signature, key, version, i);
}

bool matches(const void* page, uint64_t bytes, uint32_t signature, uint64_t key, int64_t version) {
  const auto* words = static_cast<const uint64_t*>(page);
  for (uint64_t i = 0; i < bytes / 8; ++i) {
    if (words[i] != (version == 0 ? 0 : word(signature, key, version, i))) return false;
  }
  return true;
}

// Words that are neither zero nor signed by this process: bytes it did not write.
uint64_t foreign_words(const void* bytes, uint64_t count, uint32_t signature) {
  const auto* words = static_cast<const uint64_t*>(bytes);
  uint64_t foreign = 0;
  for (uint64_t i = 0; i < count / 8; ++i) {
    if (words[i] != 0 && (words[i] >> 40) != (signature & 0xffffff)) ++foreign;
  }
  return foreign;
}

// The acquire path hands out device pointers on the CUDA backend: the worker reads and writes
// those pages through a host staging buffer. On the host backend the page is used in place.
class PageView {
 public:
  explicit PageView(bool device) : device_(device) {}
  // Host bytes holding the range's contents.
  void* open(void* pages, uint64_t bytes) {
    if (!device_) return pages;
    staging_.resize(bytes);
#if defined(MEMBAR_WITH_CUDA)
    if (cudaMemcpy(staging_.data(), pages, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) std::abort();
#endif
    return staging_.data();
  }
  // Writes the staged bytes back (no-op on the host backend).
  void commit(void* pages, uint64_t bytes) {
#if defined(MEMBAR_WITH_CUDA)
    // A pageable host-to-device cudaMemcpy may return before its DMA lands; the daemon copies
    // the page out in its own process right after release, so the write must be complete first.
    if (device_ && (cudaMemcpy(pages, staging_.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
                    cudaDeviceSynchronize() != cudaSuccess)) {
      std::abort();
    }
#endif
  }

 private:
  bool device_;
  std::vector<uint8_t> staging_;
};

struct Space {
  SpaceId id = 0;
  uint64_t page_bytes = 0;
  uint32_t page_count = 0;
  std::vector<int64_t> version;  // -1: contents unknown (never written, or freed)
};

struct Counters {
  uint64_t cycles = 0, corrupted = 0, lost = 0, failed_calls = 0, leaked_words = 0, exhausted = 0, checked = 0;
};

std::string flag(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 2; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  }
  return fallback;
}

bool report_error(const char* what, const Status& status, Counters& counters) {
  if (status.ok()) return false;
  ++counters.failed_calls;
  std::fprintf(stderr, "worker %d: %s failed: %s\n", static_cast<int>(::getpid()), what, status.to_string().c_str());
  return true;
}

// The random work shared by `integrity` and `soak`: one cycle on a random range of a random space.
// `leak_checks`: every page acquired is also checked for words this process did not write.
class Workload {
 public:
  Workload(Client& client, uint32_t signature, uint64_t seed, bool leak_checks)
      : client_(client), signature_(signature), rng_{seed}, seed_(seed), leak_checks_(leak_checks),
        view_(client.backend() == BackendKind::kCuda) {}

  bool add_space(const std::string& name, uint64_t page_bytes, uint32_t pages) {
    Result<SpaceId> id = client_.create_space(name, page_bytes, pages);
    if (report_error("create_space", id.status(), counters)) return false;
    Space space;
    space.id = id.value();
    space.page_bytes = page_bytes;
    space.page_count = pages;
    space.version.assign(pages, -1);
    spaces_.push_back(space);
    return true;
  }

  uint64_t key(size_t s, uint32_t page) const { return splitmix(seed_ * 1000003 + s * 7919 + page); }

  // Checks one page read through either tier; `pages` holds `count` pages from `first`.
  void check(size_t s, uint32_t first, uint32_t count, const void* pages) {
    Space& space = spaces_[s];
    for (uint32_t i = 0; i < count; ++i) {
      const auto* page = static_cast<const uint8_t*>(pages) + uint64_t(i) * space.page_bytes;
      int64_t version = space.version[first + i];
      if (version >= 0) {
        ++counters.checked;
        if (!matches(page, space.page_bytes, signature_, key(s, first + i), version)) ++counters.corrupted;
      }
    }
    if (leak_checks_) counters.leaked_words += foreign_words(pages, uint64_t(count) * space.page_bytes, signature_);
  }

  // Sabotage: flip one byte of a written page behind the checker's back (through the host tier,
  // marked dirty): the run must then report it. Proves the check can fail.
  void sabotage() {
    Space& space = spaces_[0];
    for (uint32_t page = 0; page < space.page_count; ++page) {
      if (space.version[page] <= 0) continue;
      Result<void*> host = client_.acquire_host(PageRange{space.id, page, 1});
      if (!host.ok()) return;
      static_cast<uint8_t*>(host.value())[12345 % space.page_bytes] ^= 0x40;
      (void)client_.release_host(PageRange{space.id, page, 1}, true);
      std::fprintf(stderr, "worker: sabotaged page %u of space 0\n", page);
      return;
    }
  }

  void cycle() {
    size_t s = rng_.below(static_cast<uint32_t>(spaces_.size()));
    Space& space = spaces_[s];
    uint32_t count = 1 + rng_.below(4);
    uint32_t first = rng_.below(space.page_count - count + 1);
    PageRange range{space.id, first, count};
    uint64_t bytes = uint64_t(count) * space.page_bytes;
    uint32_t choice = rng_.below(100);
    ++counters.cycles;
    if (choice < 55) {
      bool write = choice < 40;
      bool zero = rng_.below(4) != 0;
      Result<Acquired> acquired = client_.acquire(range, (write ? uint32_t{kAcquireWrite} : 0u) | (zero ? kAcquireZeroNew : 0u));
      if (exhausted(acquired.status()) || report_error("acquire", acquired.status(), counters)) return;
      if (report_error("wait", client_.wait(acquired.value().ticket), counters)) return;
      void* pages = acquired.value().pointer;
      void* bytes_view = view_.open(pages, bytes);
      check(s, first, count, bytes_view);
      if (write) {
        for (uint32_t i = 0; i < count; ++i) {
          int64_t& version = space.version[first + i];
          version = next_version_++;
          fill(static_cast<uint8_t*>(bytes_view) + uint64_t(i) * space.page_bytes, space.page_bytes, signature_,
               key(s, first + i), version);
        }
        view_.commit(pages, bytes);
      }
      report_error("release", client_.release(range, write), counters);
    } else if (choice < 72) {
      Result<Ticket> ticket = client_.offload(range);
      if (exhausted(ticket.status()) || report_error("offload", ticket.status(), counters)) return;
      report_error("wait", client_.wait(ticket.value()), counters);
    } else if (choice < 87) {
      Result<Ticket> ticket = client_.prefetch(range);
      if (exhausted(ticket.status()) || report_error("prefetch", ticket.status(), counters)) return;
      report_error("wait", client_.wait(ticket.value()), counters);
    } else if (choice < 97) {
      Result<void*> host = client_.acquire_host(range);
      if (exhausted(host.status()) || report_error("acquire_host", host.status(), counters)) return;
      check(s, first, count, host.value());
      bool write = rng_.below(2) == 0;
      if (write) {
        for (uint32_t i = 0; i < count; ++i) {
          int64_t& version = space.version[first + i];
          version = next_version_++;
          fill(static_cast<uint8_t*>(host.value()) + uint64_t(i) * space.page_bytes, space.page_bytes, signature_,
               key(s, first + i), version);
        }
      }
      report_error("release_host", client_.release_host(range, write), counters);
    } else {
      // Frees drop only space frames wholly inside the range; a range whose whole frames hold
      // nothing is a double free (FAILED_PRECONDITION, tested on its own): free written ranges.
      bool all_written = true;
      for (uint32_t i = 0; i < count; ++i) all_written = all_written && space.version[first + i] >= 0;
      if (!all_written) return;
      if (report_error("free_pages", client_.free_pages(range), counters)) return;
      for (uint32_t i = 0; i < count; ++i) space.version[first + i] = -1;
    }
  }

  // Every page with known contents must still hold its last version.
  void final_sweep() {
    for (size_t s = 0; s < spaces_.size(); ++s) {
      Space& space = spaces_[s];
      for (uint32_t page = 0; page < space.page_count; ++page) {
        if (space.version[page] < 0) continue;
        PageRange range{space.id, page, 1};
        Result<void*> host = client_.acquire_host(range);
        if (!host.ok()) {
          ++counters.lost;
          report_error("final acquire_host", host.status(), counters);
          continue;
        }
        if (!matches(host.value(), space.page_bytes, signature_, key(s, page), space.version[page])) ++counters.lost;
        if (leak_checks_) counters.leaked_words += foreign_words(host.value(), space.page_bytes, signature_);
        report_error("final release_host", client_.release_host(range, false), counters);
      }
    }
  }

  Counters counters;

 private:
  // RESOURCE_EXHAUSTED is an answer when other clients pin the pool; counted, not a failure.
  bool exhausted(const Status& status) {
    if (status.code() != StatusCode::RESOURCE_EXHAUSTED) return false;
    ++counters.exhausted;
    return true;
  }

  Client& client_;
  uint32_t signature_;
  Rng rng_;
  uint64_t seed_;
  bool leak_checks_;
  PageView view_;
  std::vector<Space> spaces_;
  int64_t next_version_ = 1;
};

void print_stats_line(Client& client, const Counters& counters) {
  uint64_t h2d = 0, d2h = 0, evictions = 0;
  Result<RuntimeStats> stats = client.stats();
  if (stats.ok()) {
    for (const ClientStats& c : stats.value().clients) {
      h2d += c.bytes_host_to_gpu;
      d2h += c.bytes_gpu_to_host;
      evictions += c.evictions;
    }
  }
  std::printf("RESULT cycles=%" PRIu64 " corrupted=%" PRIu64 " lost=%" PRIu64 " failed_calls=%" PRIu64
              " bytes_h2d=%" PRIu64 " bytes_d2h=%" PRIu64 " evictions=%" PRIu64 " leaked_words=%" PRIu64
              " exhausted=%" PRIu64 " checked=%" PRIu64 "\n",
              counters.cycles, counters.corrupted, counters.lost, counters.failed_calls, h2d, d2h, evictions,
              counters.leaked_words, counters.exhausted, counters.checked);
  std::fflush(stdout);
}

int run_integrity(Client& client, uint64_t seed, uint64_t cycles, uint32_t pages, bool sabotage) {
  Workload work(client, static_cast<uint32_t>(splitmix(seed)), seed, /*leak_checks=*/false);
  if (!work.add_space("w" + std::to_string(seed) + ".0", 64 << 10, pages)) return 1;
  if (!work.add_space("w" + std::to_string(seed) + ".1", 96 << 10, pages / 2)) return 1;
  for (uint64_t cycle = 0; cycle < cycles; ++cycle) {
    if (sabotage && cycle == cycles / 2) work.sabotage();
    work.cycle();
  }
  work.final_sweep();
  print_stats_line(client, work.counters);
  const Counters& c = work.counters;
  return c.corrupted == 0 && c.lost == 0 && c.failed_calls == 0 ? 0 : 1;
}

int run_soak(Client& client, uint64_t seed, double seconds) {
  // The signature changes with every process: a restarted worker's data is not its predecessor's.
  uint32_t signature = static_cast<uint32_t>(splitmix(seed ^ (uint64_t(::getpid()) << 20)) & 0xffffff);
  if (signature == 0) signature = 1;
  Workload work(client, signature, seed ^ uint64_t(::getpid()), /*leak_checks=*/true);
  const std::string prefix = "soak" + std::to_string(seed) + ".";
  if (!work.add_space(prefix + "a", 64 << 10, 48) || !work.add_space(prefix + "b", 96 << 10, 40) ||
      !work.add_space(prefix + "c", 960, 3000) || !work.add_space(prefix + "d", 32 << 10, 100)) {
    return 1;
  }
  std::printf("READY\n");
  std::fflush(stdout);
  auto start = std::chrono::steady_clock::now();
  auto last_report = start;
  for (;;) {
    auto now = std::chrono::steady_clock::now();
    if (std::chrono::duration<double>(now - start).count() > seconds) break;
    if (now - last_report > std::chrono::seconds(1)) {
      const Counters& c = work.counters;
      std::printf("PROGRESS cycles=%" PRIu64 " corrupted=%" PRIu64 " leaked_words=%" PRIu64 " failed_calls=%" PRIu64
                  " checked=%" PRIu64 "\n",
                  c.cycles, c.corrupted, c.leaked_words, c.failed_calls, c.checked);
      std::fflush(stdout);
      last_report = now;
    }
    work.cycle();
  }
  work.final_sweep();
  print_stats_line(client, work.counters);
  const Counters& c = work.counters;
  return c.corrupted == 0 && c.lost == 0 && c.failed_calls == 0 && c.leaked_words == 0 ? 0 : 1;
}

int run_hold(Client& client, uint32_t pages) {
  Result<SpaceId> space = client.create_space("hold", 64 << 10, pages);
  if (!space.ok()) return 1;
  PageRange all{space.value(), 0, pages};
  Result<Acquired> acquired = client.acquire(all, kAcquireWrite | kAcquireZeroNew);
  if (!acquired.ok() || !client.wait(acquired.value().ticket).ok()) return 1;
  PageView view(client.backend() == BackendKind::kCuda);
  uint64_t bytes = uint64_t(pages) * (64 << 10);
  std::memset(view.open(acquired.value().pointer, bytes), 0x5a, bytes);
  view.commit(acquired.value().pointer, bytes);
  if (!client.release(all, true).ok()) return 1;
  Result<Ticket> offloaded = client.offload(PageRange{space.value(), 0, pages / 2});
  if (!offloaded.ok() || !client.wait(offloaded.value()).ok()) return 1;
  std::printf("READY\n");
  std::fflush(stdout);
  ::sleep(60);
  return 0;
}

// Fills as much GPU and host memory as the quotas allow with words signed `signature`.
int run_fill(Client& client, uint32_t signature) {
  Result<RuntimeStats> stats = client.stats();
  if (!stats.ok() || stats.value().clients.empty()) return 1;
  uint64_t gpu_frames = stats.value().clients[0].gpu_quota_bytes / kFrameBytes;
  uint64_t host_frames = stats.value().clients[0].host_quota_bytes / kFrameBytes;
  PageView view(client.backend() == BackendKind::kCuda);
  // GPU: one space of the quota's frames, written whole and kept resident (clean copies on host
  // are not needed: offloading would take host frames).
  Result<SpaceId> gpu = client.create_space("fill.gpu", kFrameBytes, static_cast<uint32_t>(gpu_frames));
  if (!gpu.ok()) return 1;
  PageRange gpu_range{gpu.value(), 0, static_cast<uint32_t>(gpu_frames)};
  Result<Acquired> acquired = client.acquire(gpu_range, kAcquireWrite);
  if (!acquired.ok() || !client.wait(acquired.value().ticket).ok()) {
    std::fprintf(stderr, "fill: acquire: %s\n", acquired.status().to_string().c_str());
    return 1;
  }
  uint64_t gpu_bytes = gpu_frames * kFrameBytes;
  void* staged = view.open(acquired.value().pointer, gpu_bytes);
  for (uint64_t i = 0; i < gpu_bytes / 8; ++i) static_cast<uint64_t*>(staged)[i] = word(signature, 1, 1, i);
  view.commit(acquired.value().pointer, gpu_bytes);
  if (!client.release(gpu_range, false).ok()) return 1;
  // Host: the whole host quota.
  Result<SpaceId> host = client.create_space("fill.host", kFrameBytes, static_cast<uint32_t>(host_frames));
  if (!host.ok()) return 1;
  PageRange host_range{host.value(), 0, static_cast<uint32_t>(host_frames)};
  Result<void*> pages = client.acquire_host(host_range);
  if (!pages.ok()) {
    std::fprintf(stderr, "fill: acquire_host: %s\n", pages.status().to_string().c_str());
    return 1;
  }
  for (uint64_t i = 0; i < host_frames * kFrameBytes / 8; ++i) static_cast<uint64_t*>(pages.value())[i] = word(signature, 2, 1, i);
  std::printf("READY gpu_frames=%" PRIu64 " host_frames=%" PRIu64 "\n", gpu_frames, host_frames);
  std::fflush(stdout);
  ::sleep(120);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: membar_integration_worker integrity|hold|fill|soak --socket PATH ...\n");
    return 2;
  }
  std::string mode = argv[1];
  ConnectOptions options;
  options.client_name = mode + "-" + std::to_string(::getpid());
  options.gpu_quota_bytes = std::strtoull(flag(argc, argv, "--gpu-quota", "0").c_str(), nullptr, 10);
  options.host_quota_bytes = std::strtoull(flag(argc, argv, "--host-quota", "0").c_str(), nullptr, 10);
  Result<std::unique_ptr<Client>> client = connect_daemon(flag(argc, argv, "--socket", ""), options);
  if (!client.ok()) {
    std::fprintf(stderr, "worker: cannot connect: %s\n", client.status().to_string().c_str());
    return 1;
  }
  uint32_t pages = static_cast<uint32_t>(std::strtoul(flag(argc, argv, "--pages", "64").c_str(), nullptr, 10));
  uint64_t seed = std::strtoull(flag(argc, argv, "--seed", "1").c_str(), nullptr, 10);
  if (mode == "integrity") {
    uint64_t cycles = std::strtoull(flag(argc, argv, "--cycles", "1000").c_str(), nullptr, 10);
    bool sabotage = flag(argc, argv, "--sabotage", "0") == "1";
    return run_integrity(*client.value(), seed, cycles, pages, sabotage);
  }
  if (mode == "soak") return run_soak(*client.value(), seed, std::strtod(flag(argc, argv, "--seconds", "10").c_str(), nullptr));
  if (mode == "hold") return run_hold(*client.value(), pages);
  if (mode == "fill") {
    return run_fill(*client.value(), static_cast<uint32_t>(std::strtoul(flag(argc, argv, "--signature", "1").c_str(), nullptr, 10)));
  }
  std::fprintf(stderr, "worker: unknown mode %s\n", mode.c_str());
  return 2;
}
