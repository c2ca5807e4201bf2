// Helpers shared by the runtime unit tests: page contents patterns, fd counting, and an engine
// client whose granted frames are mapped into real host windows (as the embedded client does).
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "membar/engine/engine.h"
#include "window.h"

namespace membar::testing {

inline uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

// Fills `bytes` with words derived from `tag` (never all zeros).
inline void fill_pattern(void* page, uint64_t bytes, uint64_t tag) {
  auto* words = static_cast<uint64_t*>(page);
  for (uint64_t i = 0; i < bytes / 8; ++i) words[i] = mix(tag * 0x9e3779b97f4a7c15ull + i + 1);
}

// True when `page` holds fill_pattern(tag) exactly.
inline bool check_pattern(const void* page, uint64_t bytes, uint64_t tag) {
  const auto* words = static_cast<const uint64_t*>(page);
  for (uint64_t i = 0; i < bytes / 8; ++i) {
    if (words[i] != mix(tag * 0x9e3779b97f4a7c15ull + i + 1)) return false;
  }
  return true;
}

inline bool is_zero(const void* page, uint64_t bytes) {
  const auto* words = static_cast<const uint64_t*>(page);
  for (uint64_t i = 0; i < bytes / 8; ++i) {
    if (words[i] != 0) return false;
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

// One engine client with both windows mapped from the fds the engine grants.
struct MappedClient {
  runtimed::Engine* engine = nullptr;
  ClientId id = 0;
  std::unique_ptr<Window> gpu_window;
  std::unique_ptr<Window> host_window;
  std::atomic<int> grants{0};    // callbacks may run on the engine's completion thread
  std::atomic<int> revokes{0};
  std::map<SpaceId, uint64_t> page_bytes;

  static std::unique_ptr<MappedClient> open(runtimed::Engine& engine, runtimed::ClientConfig config = {}) {
    auto client = std::make_unique<MappedClient>();
    client->engine = &engine;
    MappedClient* self = client.get();
    runtimed::ClientEvents events;
    events.frame_granted = [self](uint32_t window_frame, Tier tier, int fd) {
      ++self->grants;
      Status status = self->window(tier).map_frame(window_frame, fd);
      EXPECT_TRUE(status.ok()) << status.to_string();
    };
    events.frame_revoked = [self](uint32_t window_frame, Tier tier) {
      ++self->revokes;
      Status status = self->window(tier).unmap_frame(window_frame);
      EXPECT_TRUE(status.ok()) << status.to_string();
    };
    auto id = engine.client_open(config, std::move(events));
    EXPECT_TRUE(id.ok()) << id.status().to_string();
    client->id = id.value();
    client->gpu_window = make_host_window(engine.client_window_frames(client->id, Tier::kGpu).value()).value();
    client->host_window = make_host_window(engine.client_window_frames(client->id, Tier::kHost).value()).value();
    return client;
  }

  // The engine must stop calling back before the windows go (a no-op when already closed).
  ~MappedClient() {
    if (engine != nullptr) (void)engine->client_close(id);
  }

  Window& window(Tier tier) { return tier == Tier::kGpu ? *gpu_window : *host_window; }

  SpaceId space(const std::string& name, uint64_t bytes, uint32_t count) {
    auto space = engine->create_space(id, name, bytes, count);
    EXPECT_TRUE(space.ok()) << space.status().to_string();
    page_bytes[space.value()] = bytes;
    return space.value();
  }

  char* pointer(Tier tier, SpaceId space, PageLocation location) {
    return static_cast<char*>(window(tier).base()) + uint64_t(location.window_frame) * kFrameBytes +
           uint64_t(location.slot) * page_bytes.at(space);
  }

  // Acquires on the GPU tier and waits; returns pointers.
  std::vector<char*> acquire(PageRange range, uint32_t flags) {
    auto result = engine->acquire(id, range, flags);
    EXPECT_TRUE(result.ok()) << result.status().to_string();
    if (!result.ok()) return {};
    Status waited = engine->wait(id, result.value().ticket);
    EXPECT_TRUE(waited.ok()) << waited.to_string();
    std::vector<char*> pointers;
    for (const PageLocation& location : result.value().locations) pointers.push_back(pointer(Tier::kGpu, range.space, location));
    return pointers;
  }

  std::vector<char*> acquire_host(PageRange range) {
    auto result = engine->acquire_host(id, range);
    EXPECT_TRUE(result.ok()) << result.status().to_string();
    if (!result.ok()) return {};
    std::vector<char*> pointers;
    for (const PageLocation& location : result.value()) pointers.push_back(pointer(Tier::kHost, range.space, location));
    return pointers;
  }

  // Events are delivered after the engine call or completion that produced them: poll.
  bool eventually_revoked(int count) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (revokes.load() < count && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return revokes.load() == count;
  }

  ClientStats stats() { return engine->stats(id).value().clients.at(0); }
};

inline std::unique_ptr<runtimed::Engine> make_engine(uint64_t gpu_frames, uint64_t host_frames,
                                                     runtimed::EngineConfig config = {}) {
  runtimed::BackendConfig backend_config;
  backend_config.gpu_pool_bytes = gpu_frames * kFrameBytes;
  backend_config.host_pool_bytes = host_frames * kFrameBytes;
  auto backend = runtimed::make_host_backend(backend_config);
  EXPECT_TRUE(backend.ok()) << backend.status().to_string();
  auto engine = runtimed::Engine::create(std::move(backend).value(), config);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  return std::move(engine).value();
}

}  // namespace membar::testing
