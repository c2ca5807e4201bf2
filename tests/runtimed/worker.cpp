// A trainer stand-in for the integration tests: a separate process that talks to a real membard.
//   membar_integration_worker integrity --socket PATH --seed S --cycles N [--pages P] [--gpu-quota BYTES]
//     Random schedule of acquire (read / write), offload, prefetch, host access and free over two
//     spaces; every page's contents are a pseudo-random stream keyed by (seed, space, page,
//     version) and checked whenever the page is read. Prints one RESULT line; exit 0 only when
//     no page was corrupted or lost and no call failed.
//   membar_integration_worker hold --socket PATH [--pages P]
//     Fills pages on both tiers, prints READY, then sleeps (the test kills it with SIGKILL).
#include <unistd.h>

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

// Contents of version v of a page; version 0 is "zero-filled" (a fresh page under kAcquireZeroNew).
void fill(void* page, uint64_t bytes, uint64_t key, int64_t version) {
  auto* words = static_cast<uint64_t*>(page);
  uint64_t x = splitmix(key ^ (static_cast<uint64_t>(version) << 40));
  for (uint64_t i = 0; i < bytes / 8; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    words[i] = version == 0 ? 0 : x;
  }
}

bool matches(const void* page, uint64_t bytes, uint64_t key, int64_t version) {
  const auto* words = static_cast<const uint64_t*>(page);
  uint64_t x = splitmix(key ^ (static_cast<uint64_t>(version) << 40));
  for (uint64_t i = 0; i < bytes / 8; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    if (words[i] != (version == 0 ? 0 : x)) return false;
  }
  return true;
}

// The acquire path hands out device pointers on the CUDA backend: the worker reads and writes
// those pages through a host staging buffer. On the host backend the page is used in place.
class PageView {
 public:
  explicit PageView(bool device) : device_(device) {}
  // Host bytes holding the page's contents.
  void* open(void* page, uint64_t bytes) {
    if (!device_) return page;
    staging_.resize(bytes);
#if defined(MEMBAR_WITH_CUDA)
    if (cudaMemcpy(staging_.data(), page, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) std::abort();
#endif
    return staging_.data();
  }
  // Writes the staged bytes back to the page (no-op on the host backend).
  void commit(void* page, uint64_t bytes) {
#if defined(MEMBAR_WITH_CUDA)
    // A pageable host-to-device cudaMemcpy may return before its DMA lands; the daemon copies
    // the page out in its own process right after release, so the write must be complete first.
    if (device_ && (cudaMemcpy(page, staging_.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
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
  std::vector<int64_t> version;  // -1: no contents (never written, or freed)
};

struct Counters {
  uint64_t cycles = 0, corrupted = 0, lost = 0, failed_calls = 0;
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

// sabotage: after half the cycles, flip one byte of a written page behind the checker's back
// (through the host tier, marked dirty): the run must then report it. Proves the check can fail.
int run_integrity(Client& client, uint64_t seed, uint64_t cycles, uint32_t pages, bool sabotage) {
  Rng rng{seed};
  Counters counters;
  PageView view(client.backend() == BackendKind::kCuda);
  std::vector<Space> spaces(2);
  spaces[0].page_bytes = 64 << 10;
  spaces[0].page_count = pages;
  spaces[1].page_bytes = 128 << 10;
  spaces[1].page_count = pages / 2;
  for (size_t s = 0; s < spaces.size(); ++s) {
    std::string name = "w" + std::to_string(seed) + "." + std::to_string(s);
    Result<SpaceId> id = client.create_space(name, spaces[s].page_bytes, spaces[s].page_count);
    if (report_error("create_space", id.status(), counters)) return 1;
    spaces[s].id = id.value();
    spaces[s].version.assign(spaces[s].page_count, -1);
  }
  auto key = [&](size_t s, uint32_t page) { return splitmix(seed * 1000003 + s * 7919 + page); };
  int64_t next_version = 1;

  for (uint64_t cycle = 0; cycle < cycles; ++cycle) {
    if (sabotage && cycle == cycles / 2) {
      for (uint32_t page = 0; page < spaces[0].page_count; ++page) {
        if (spaces[0].version[page] < 0) continue;
        Result<std::vector<void*>> host = client.acquire_host(PageRange{spaces[0].id, page, 1});
        if (!host.ok()) break;
        static_cast<uint8_t*>(host.value()[0])[12345] ^= 0x40;
        (void)client.release_host(PageRange{spaces[0].id, page, 1}, true);
        std::fprintf(stderr, "worker: sabotaged page %u of space 0\n", page);
        break;
      }
    }
    size_t s = rng.below(2);
    Space& space = spaces[s];
    uint32_t count = 1 + rng.below(4);
    uint32_t first = rng.below(space.page_count - count + 1);
    PageRange range{space.id, first, count};
    uint32_t choice = rng.below(100);
    ++counters.cycles;
    if (choice < 55) {
      bool write = choice < 40;
      Result<Acquired> acquired = client.acquire(range, (write ? uint32_t{kAcquireWrite} : 0u) | kAcquireZeroNew);
      if (report_error("acquire", acquired.status(), counters)) continue;
      if (report_error("wait", client.wait(acquired.value().ticket), counters)) continue;
      for (uint32_t i = 0; i < count; ++i) {
        int64_t& version = space.version[first + i];
        if (version < 0) version = 0;  // zero-filled by kAcquireZeroNew
        void* page = acquired.value().page_pointers[i];
        void* bytes = view.open(page, space.page_bytes);
        if (!matches(bytes, space.page_bytes, key(s, first + i), version)) ++counters.corrupted;
        if (write) {
          version = next_version++;
          fill(bytes, space.page_bytes, key(s, first + i), version);
          view.commit(page, space.page_bytes);
        }
      }
      report_error("release", client.release(range, write), counters);
    } else if (choice < 75) {
      Result<Ticket> ticket = client.offload(range);
      if (report_error("offload", ticket.status(), counters)) continue;
      report_error("wait", client.wait(ticket.value()), counters);
    } else if (choice < 90) {
      Result<Ticket> ticket = client.prefetch(range);
      if (report_error("prefetch", ticket.status(), counters)) continue;
      report_error("wait", client.wait(ticket.value()), counters);
    } else if (choice < 97) {
      Result<std::vector<void*>> host = client.acquire_host(range);
      if (report_error("acquire_host", host.status(), counters)) continue;
      bool write = rng.below(2) == 0;
      for (uint32_t i = 0; i < count; ++i) {
        int64_t& version = space.version[first + i];
        void* page = host.value()[i];
        if (version >= 0 && !matches(page, space.page_bytes, key(s, first + i), version)) ++counters.corrupted;
        if (write) {
          version = next_version++;
          fill(page, space.page_bytes, key(s, first + i), version);
        }
      }
      report_error("release_host", client.release_host(range, write), counters);
    } else {
      // Freeing a page with no contents is a double free (FAILED_PRECONDITION, tested on its
      // own): free only ranges that are wholly written.
      bool all_written = true;
      for (uint32_t i = 0; i < count; ++i) all_written = all_written && space.version[first + i] >= 0;
      if (!all_written) continue;
      if (report_error("free_pages", client.free_pages(range), counters)) continue;
      for (uint32_t i = 0; i < count; ++i) space.version[first + i] = -1;
    }
  }

  // Final sweep: every page with contents must still hold its last version.
  for (size_t s = 0; s < spaces.size(); ++s) {
    Space& space = spaces[s];
    for (uint32_t page = 0; page < space.page_count; ++page) {
      if (space.version[page] < 0) continue;
      PageRange range{space.id, page, 1};
      Result<std::vector<void*>> host = client.acquire_host(range);
      if (!host.ok()) {
        ++counters.lost;
        report_error("final acquire_host", host.status(), counters);
        continue;
      }
      if (!matches(host.value()[0], space.page_bytes, key(s, page), space.version[page])) ++counters.lost;
      report_error("final release_host", client.release_host(range, false), counters);
    }
  }
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
              " bytes_h2d=%" PRIu64 " bytes_d2h=%" PRIu64 " evictions=%" PRIu64 "\n",
              counters.cycles, counters.corrupted, counters.lost, counters.failed_calls, h2d, d2h, evictions);
  std::fflush(stdout);
  return counters.corrupted == 0 && counters.lost == 0 && counters.failed_calls == 0 ? 0 : 1;
}

int run_hold(Client& client, uint32_t pages) {
  Result<SpaceId> space = client.create_space("hold", 64 << 10, pages);
  if (!space.ok()) return 1;
  PageRange all{space.value(), 0, pages};
  Result<Acquired> acquired = client.acquire(all, kAcquireWrite | kAcquireZeroNew);
  if (!acquired.ok() || !client.wait(acquired.value().ticket).ok()) return 1;
  PageView view(client.backend() == BackendKind::kCuda);
  for (void* page : acquired.value().page_pointers) {
    std::memset(view.open(page, 64 << 10), 0x5a, 64 << 10);
    view.commit(page, 64 << 10);
  }
  if (!client.release(all, true).ok()) return 1;
  Result<Ticket> offloaded = client.offload(PageRange{space.value(), 0, pages / 2});
  if (!offloaded.ok() || !client.wait(offloaded.value()).ok()) return 1;
  std::printf("READY\n");
  std::fflush(stdout);
  ::sleep(60);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: membar_integration_worker integrity|hold --socket PATH ...\n");
    return 2;
  }
  std::string mode = argv[1];
  ConnectOptions options;
  options.client_name = mode + "-" + std::to_string(::getpid());
  options.gpu_quota_bytes = std::strtoull(flag(argc, argv, "--gpu-quota", "0").c_str(), nullptr, 10);
  Result<std::unique_ptr<Client>> client = connect_daemon(flag(argc, argv, "--socket", ""), options);
  if (!client.ok()) {
    std::fprintf(stderr, "worker: cannot connect: %s\n", client.status().to_string().c_str());
    return 1;
  }
  uint32_t pages = static_cast<uint32_t>(std::strtoul(flag(argc, argv, "--pages", "64").c_str(), nullptr, 10));
  if (mode == "integrity") {
    uint64_t seed = std::strtoull(flag(argc, argv, "--seed", "1").c_str(), nullptr, 10);
    uint64_t cycles = std::strtoull(flag(argc, argv, "--cycles", "1000").c_str(), nullptr, 10);
    bool sabotage = flag(argc, argv, "--sabotage", "0") == "1";
    return run_integrity(*client.value(), seed, cycles, pages, sabotage);
  }
  if (mode == "hold") return run_hold(*client.value(), pages);
  std::fprintf(stderr, "worker: unknown mode %s\n", mode.c_str());
  return 2;
}
