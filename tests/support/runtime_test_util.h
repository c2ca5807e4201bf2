// Helpers shared by the runtime unit tests: page contents patterns, fd counting, and an engine
// client whose events are applied to a real ClientMemory (libclient/memory.h, the mmap mapper), as
// the embedded client does, so that every page is read and written at its place in the space
// (Note [Space layout] in engine/engine.cpp) and every event is counted.
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>

#include "membar/engine/engine.h"
#include "memory.h"

namespace membar::testing {

inline uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

// The byte at `index` of pattern `tag` (never zero, so a zeroed page never passes a check).
inline uint8_t pattern_byte(uint64_t tag, uint64_t index) {
  uint64_t word = mix(tag * 0x9e3779b97f4a7c15ull + index / 8 + 1);
  uint8_t byte = static_cast<uint8_t>(word >> (8 * (index % 8)));
  return byte == 0 ? 0x5a : byte;
}

// Fills `bytes` (any count, not only whole words) with pattern `tag`.
inline void fill_pattern(void* page, uint64_t bytes, uint64_t tag) {
  auto* out = static_cast<uint8_t*>(page);
  for (uint64_t i = 0; i < bytes; ++i) out[i] = pattern_byte(tag, i);
}

// True when `page` holds fill_pattern(tag) exactly.
inline bool check_pattern(const void* page, uint64_t bytes, uint64_t tag) {
  const auto* in = static_cast<const uint8_t*>(page);
  for (uint64_t i = 0; i < bytes; ++i) {
    if (in[i] != pattern_byte(tag, i)) return false;
  }
  return true;
}

inline bool is_zero(const void* page, uint64_t bytes) {
  const auto* in = static_cast<const uint8_t*>(page);
  for (uint64_t i = 0; i < bytes; ++i) {
    if (in[i] != 0) return false;
  }
  return true;
}

inline int count_open_fds() {
  int count = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  while (::readdir(dir) != nullptr) ++count;
  ::closedir(dir);
  return count;
}

// Polls `done` for up to `timeout`; true once it holds.
template <typename Done>
bool eventually(Done&& done, std::chrono::milliseconds timeout = std::chrono::seconds(2)) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

// Calls `call` until it stops answering UNAVAILABLE ("retry": frames being renewed), as the
// client libraries do (libclient/retry.h), for at most two seconds.
template <typename Call>
auto retrying(Call&& call) -> decltype(call()) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (;;) {
    auto result = call();
    Status status;
    if constexpr (std::is_same_v<decltype(result), Status>) {
      status = result;
    } else {
      status = result.status();
    }
    if (status.code() != StatusCode::UNAVAILABLE || std::chrono::steady_clock::now() > deadline) return result;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// One engine client whose events are applied to a ClientMemory of its own, and counted.
struct MappedClient {
  runtimed::Engine* engine = nullptr;
  ClientId id = 0;
  std::unique_ptr<ClientMemory> memory;
  // Event counts (callbacks may run on the engine's completion thread).
  std::atomic<int> gpu_grants{0}, gpu_revokes{0}, slab_grants{0}, slab_revokes{0};
  std::atomic<int> maps[2] = {0, 0};    // by tier index: GPU, host
  std::atomic<int> unmaps[2] = {0, 0};
  std::mutex granted_mutex;
  std::set<uint32_t> granted_gpu_windows;  // every window frame number ever granted
  std::map<SpaceId, uint64_t> page_bytes;

  static std::unique_ptr<MappedClient> open(runtimed::Engine& engine, runtimed::ClientConfig config = {}) {
    auto client = std::make_unique<MappedClient>();
    client->engine = &engine;
    MappedClient* self = client.get();
    runtimed::ClientEvents events;
    auto note = [self](const Status& status) { EXPECT_TRUE(status.ok()) << status.to_string(); };
    events.gpu_frame_granted = [self, note](uint32_t window_frame, int fd) {
      ++self->gpu_grants;
      {
        std::lock_guard<std::mutex> lock(self->granted_mutex);
        self->granted_gpu_windows.insert(window_frame);
      }
      note(self->memory->gpu_frame_granted(window_frame, fd));
    };
    events.gpu_frame_revoked = [self, note](uint32_t window_frame) {
      ++self->gpu_revokes;
      note(self->memory->gpu_frame_revoked(window_frame));
    };
    events.host_slab_granted = [self, note](uint32_t slab, uint32_t frames, int fd) {
      ++self->slab_grants;
      note(self->memory->host_slab_granted(slab, frames, fd));
    };
    events.host_slab_revoked = [self, note](uint32_t slab) {
      ++self->slab_revokes;
      note(self->memory->host_slab_revoked(slab));
    };
    events.frame_mapped = [self, note](Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame) {
      ++self->maps[tier == Tier::kGpu ? 0 : 1];
      note(self->memory->mapped(tier, window_frame, space, space_frame));
    };
    events.frame_unmapped = [self, note](Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame) {
      ++self->unmaps[tier == Tier::kGpu ? 0 : 1];
      note(self->memory->unmapped(tier, window_frame, space, space_frame));
    };
    auto id = engine.client_open(config, std::move(events));
    EXPECT_TRUE(id.ok()) << id.status().to_string();
    if (!id.ok()) return nullptr;
    client->id = id.value();
    auto geometry = engine.client_geometry(client->id);
    EXPECT_TRUE(geometry.ok());
    client->memory = std::make_unique<ClientMemory>(make_mmap_mapper(), make_mmap_mapper(),
                                                    geometry.value().host_slab_frames);
    return client;
  }

  // The engine must stop calling back before the memory goes (a no-op when already closed).
  ~MappedClient() {
    if (engine != nullptr) (void)engine->client_close(id);
  }

  SpaceId space(const std::string& name, uint64_t bytes, uint32_t count) {
    auto space = engine->create_space(id, name, bytes, count);
    EXPECT_TRUE(space.ok()) << space.status().to_string();
    if (!space.ok()) return 0;
    Status added = memory->add_space(space.value(), bytes, count);
    EXPECT_TRUE(added.ok()) << added.to_string();
    page_bytes[space.value()] = bytes;
    return space.value();
  }

  Status destroy(SpaceId space) {
    MEMBAR_RETURN_IF_ERROR(engine->destroy_space(id, space));
    return memory->remove_space(space);
  }

  SpaceView view(SpaceId space) { return memory->view(space).value(); }

  // Page `page` of `space` on one tier: base + page * page_bytes (Note [Space layout]).
  char* page(Tier tier, SpaceId space, uint32_t page) {
    SpaceView v = view(space);
    return static_cast<char*>(tier == Tier::kGpu ? v.gpu : v.host) + uint64_t(page) * v.page_bytes;
  }

  // Acquires on the GPU tier (retrying "retry" answers) and waits; returns the range's first
  // page, or nullptr on failure.
  char* acquire(PageRange range, uint32_t flags) {
    auto ticket = retrying([&] { return engine->acquire(id, range, flags); });
    EXPECT_TRUE(ticket.ok()) << ticket.status().to_string();
    if (!ticket.ok()) return nullptr;
    Status waited = engine->wait(id, ticket.value());
    EXPECT_TRUE(waited.ok()) << waited.to_string();
    return page(Tier::kGpu, range.space, range.first_page);
  }

  char* acquire_host(PageRange range) {
    auto ticket = retrying([&] { return engine->acquire_host(id, range); });
    EXPECT_TRUE(ticket.ok()) << ticket.status().to_string();
    if (!ticket.ok()) return nullptr;
    Status waited = engine->wait(id, ticket.value());
    EXPECT_TRUE(waited.ok()) << waited.to_string();
    return page(Tier::kHost, range.space, range.first_page);
  }

  // Waits for a ticket a call returned.
  void finish(const Result<Ticket>& ticket) {
    ASSERT_TRUE(ticket.ok()) << ticket.status().to_string();
    Status waited = engine->wait(id, ticket.value());
    ASSERT_TRUE(waited.ok()) << waited.to_string();
  }

  ClientStats stats() { return engine->stats(id).value().clients.at(0); }
  SpaceInfo space_stats(SpaceId space) {
    RuntimeStats all = engine->stats(id).value();
    for (const SpaceInfo& info : all.spaces) {
      if (info.id == space) return info;
    }
    ADD_FAILURE() << "no stats for space " << space;
    return {};
  }
  // GPU-resident bytes of a space (GPU only, or both tiers).
  uint64_t gpu_bytes(SpaceId space) {
    SpaceInfo info = space_stats(space);
    return info.bytes_gpu + info.bytes_both;
  }
};

inline std::unique_ptr<runtimed::Engine> make_engine(uint64_t gpu_frames, uint64_t host_frames,
                                                     runtimed::EngineConfig config = {},
                                                     uint32_t host_slab_frames = 1) {
  runtimed::BackendConfig backend_config;
  backend_config.gpu_pool_bytes = gpu_frames * kFrameBytes;
  backend_config.host_pool_bytes = host_frames * kFrameBytes;
  backend_config.host_slab_frames = host_slab_frames;
  auto backend = runtimed::make_host_backend(backend_config);
  EXPECT_TRUE(backend.ok()) << backend.status().to_string();
  auto engine = runtimed::Engine::create(std::move(backend).value(), config);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  return std::move(engine).value();
}

// Waits until the pools are whole again (every frame and slab renewed and free).
// Two devices' engines of one node sharing a host pool of `share->slabs()` one-frame slabs
// (Note [One host pool for a node]): the first backs `first_slabs` at start, the second the rest;
// client ids are odd on the first, even on the second, as membard numbers them.
inline std::pair<std::unique_ptr<runtimed::Engine>, std::unique_ptr<runtimed::Engine>> make_engines_sharing(
    const std::shared_ptr<runtimed::HostShare>& share, uint64_t gpu_frames, uint64_t first_slabs) {
  runtimed::EngineConfig config;
  config.host_share = share;
  config.client_id_step = 2;
  config.first_client_id = 1;
  config.host_initial_slabs = first_slabs;
  auto first = make_engine(gpu_frames, share->slabs(), config);
  config.first_client_id = 2;
  config.host_initial_slabs = share->slabs() - first_slabs;
  auto second = make_engine(gpu_frames, share->slabs(), config);
  return {std::move(first), std::move(second)};
}

inline bool pools_settle(runtimed::Engine& engine, uint64_t gpu_frames, uint64_t host_frames) {
  return eventually([&] {
    RuntimeStats stats = engine.stats(0).value();
    return stats.tiers[0].frames_free == gpu_frames && stats.tiers[1].frames_free == host_frames;
  });
}

// Maps an engine client's signal block; word kSignalReleased is what a CUDA stream would write
// (Note [Stream-ordered release] in engine/batches.cpp): set() plays the stream passing a marker.
struct ReleasedWord {
  void* mapped = MAP_FAILED;
  ReleasedWord(runtimed::Engine& engine, ClientId id) {
    auto fd = engine.client_signal_fd(id);
    EXPECT_TRUE(fd.ok());
    if (!fd.ok()) return;
    mapped = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd.value(), 0);
    ::close(fd.value());
    EXPECT_NE(mapped, MAP_FAILED);
  }
  ReleasedWord(const ReleasedWord&) = delete;
  ReleasedWord& operator=(const ReleasedWord&) = delete;
  ~ReleasedWord() {
    if (mapped != MAP_FAILED) ::munmap(mapped, 4096);
  }
  void set(uint64_t value) {
    __atomic_store_n(static_cast<uint64_t*>(mapped) + runtimed::kSignalReleased, value, __ATOMIC_RELEASE);
  }
};

}  // namespace membar::testing
