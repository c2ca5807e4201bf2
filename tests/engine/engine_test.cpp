// The engine on the host backend: page tables, slot packing, quotas, bad input, data movement
// between tiers, host access, client close.
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <set>
#include <thread>

#include "runtime_test_util.h"

namespace membar::runtimed {
namespace {

using membar::testing::check_pattern;
using membar::testing::fill_pattern;
using membar::testing::is_zero;
using membar::testing::make_engine;
using membar::testing::MappedClient;

constexpr uint64_t k64K = 64 << 10;
constexpr uint64_t k2M = 2 << 20;

bool contains(const Status& status, const std::string& text) {
  return status.message().find(text) != std::string::npos;
}

TEST(Engine, BadInputGetsClearErrors) {
  auto engine = make_engine(4, 8);
  auto client = MappedClient::open(*engine);
  ClientId id = client->id;
  // Page sizes and names.
  for (uint64_t bytes : {uint64_t(0), uint64_t(32 << 10), uint64_t(96 << 10), uint64_t(4 << 20)}) {
    auto space = engine->create_space(id, "bad", bytes, 4);
    ASSERT_FALSE(space.ok());
    EXPECT_EQ(space.status().code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(contains(space.status(), "power of two")) << space.status().to_string();
  }
  EXPECT_EQ(engine->create_space(id, "zero", k64K, 0).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(engine->create_space(id, "", k64K, 1).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(engine->create_space(id, "huge", k64K, 0xffffffffu).status().code(), StatusCode::RESOURCE_EXHAUSTED);
  SpaceId space = client->space("L00.k", k64K, 8);
  EXPECT_EQ(engine->create_space(id, "L00.k", k64K, 8).status().code(), StatusCode::ALREADY_EXISTS);
  // Unknown client, space, page.
  EXPECT_EQ(engine->acquire(99, {space, 0, 1}, 0).status().code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(engine->acquire(id, {space + 7, 0, 1}, 0).status().code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(engine->acquire(id, {space, 8, 1}, 0).status().code(), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(engine->acquire(id, {space, 7, 2}, 0).status().code(), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(engine->acquire(id, {space, 0xffffffffu, 2}, 0).status().code(), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(engine->acquire(id, {space, 0, 0}, 0).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(engine->acquire(id, {space, 0, 1}, 1u << 7).status().code(), StatusCode::INVALID_ARGUMENT);
  // Release of an unpinned page, double free, free of an acquired page.
  EXPECT_EQ(engine->release(id, {space, 0, 1}, false).code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(engine->free_pages(id, {space, 0, 1}).code(), StatusCode::FAILED_PRECONDITION);
  client->acquire({space, 0, 2}, kAcquireZeroNew);
  EXPECT_EQ(engine->free_pages(id, {space, 0, 1}).code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(engine->offload(id, {space, 1, 1}).status().code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(engine->acquire_host(id, {space, 0, 1}).status().code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(engine->destroy_space(id, space).code(), StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(engine->release(id, {space, 0, 2}, true).ok());
  EXPECT_EQ(engine->release(id, {space, 0, 1}, true).code(), StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(engine->free_pages(id, {space, 0, 2}).ok());
  Status double_free = engine->free_pages(id, {space, 0, 2});
  EXPECT_EQ(double_free.code(), StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(contains(double_free, "double free")) << double_free.to_string();
  // Schedules and tickets.
  EXPECT_EQ(engine->advance(id, 0).code(), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(engine->set_schedule(id, {ScheduleStep{{PageRange{space, 6, 4}}}}).code(), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(engine->wait(id, 1000).code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(engine->wait(99, 1).code(), StatusCode::NOT_FOUND);
  EXPECT_TRUE(engine->wait(id, 0).ok());
  // The page table is intact after all of that.
  EXPECT_TRUE(engine->destroy_space(id, space).ok());
  EXPECT_EQ(engine->destroy_space(id, space).code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(engine->client_close(99).code(), StatusCode::NOT_FOUND);
}

TEST(Engine, PagesPackIntoFramesAndFramesComeBack) {
  auto engine = make_engine(4, 4);
  auto client = MappedClient::open(*engine);
  SpaceId space = client->space("kv", k64K, 40);
  auto pointers = client->acquire({space, 0, 40}, kAcquireZeroNew | kAcquireWrite);
  ASSERT_EQ(pointers.size(), 40u);
  // 32 slots per frame: 40 pages need exactly two frames, every page its own 64 KiB.
  EXPECT_EQ(client->grants.load(), 2);
  auto stats = client->stats();
  EXPECT_EQ(stats.gpu_frames.current, 2);
  EXPECT_EQ(stats.pages_gpu, 40u);
  std::set<char*> distinct(pointers.begin(), pointers.end());
  EXPECT_EQ(distinct.size(), 40u);
  for (size_t i = 0; i < pointers.size(); ++i) {
    EXPECT_TRUE(is_zero(pointers[i], k64K));
    fill_pattern(pointers[i], k64K, i);
  }
  auto locations = engine->locations(client->id, {space, 0, 40}).value();
  for (const PageLocation& location : locations) EXPECT_LT(location.slot, 32u);
  ASSERT_TRUE(engine->release(client->id, {space, 0, 40}, false).ok());  // kAcquireWrite made them dirty
  // Offload everything: the GPU frames go back to the pool; the host holds the data.
  auto ticket = engine->offload(client->id, {space, 0, 40});
  ASSERT_TRUE(ticket.ok());
  ASSERT_TRUE(engine->wait(client->id, ticket.value()).ok());
  stats = client->stats();
  EXPECT_EQ(stats.gpu_frames.current, 0);
  EXPECT_EQ(stats.pages_host, 40u);
  EXPECT_EQ(stats.bytes_gpu_to_host, 40 * k64K);
  EXPECT_TRUE(client->eventually_revoked(2)) << client->revokes.load();
  EXPECT_EQ(engine->stats(0).value().tiers[0].frames_free, 4u);
  // And back: contents survive.
  pointers = client->acquire({space, 0, 40}, 0);
  for (size_t i = 0; i < pointers.size(); ++i) EXPECT_TRUE(check_pattern(pointers[i], k64K, i)) << i;
  EXPECT_EQ(client->stats().bytes_host_to_gpu, 40 * k64K);
  EXPECT_EQ(client->stats().pages_both, 40u);
  ASSERT_TRUE(engine->release(client->id, {space, 0, 40}, false).ok());
  // Freeing drops both tiers and returns every frame.
  ASSERT_TRUE(engine->free_pages(client->id, {space, 0, 40}).ok());
  auto tiers = engine->stats(0).value().tiers;
  EXPECT_EQ(tiers[0].frames_free, 4u);
  EXPECT_EQ(tiers[1].frames_free, 4u);
  EXPECT_EQ(client->stats().pages_none, 40u);
}

TEST(Engine, QuotaAndPoolExhaustionNameTheNumbers) {
  auto engine = make_engine(4, 16);
  ClientConfig small;
  small.name = "small";
  small.gpu_quota_bytes = 2 * kFrameBytes;
  auto a = MappedClient::open(*engine, small);
  SpaceId space = a->space("big", k2M, 6);
  auto over = engine->acquire(a->id, {space, 0, 3}, kAcquireZeroNew);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(contains(over.status(), "client " + std::to_string(a->id))) << over.status().to_string();
  EXPECT_TRUE(contains(over.status(), "'small'"));
  EXPECT_TRUE(contains(over.status(), "2-frame GPU quota")) << over.status().to_string();
  // Nothing stays pinned after the failure: the next acquire of two pages works.
  auto ok = engine->acquire(a->id, {space, 0, 2}, kAcquireZeroNew);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(a->stats().gpu_frames.current, 2);
  // A second client without a quota gets the other two frames, then the pool is empty.
  auto b = MappedClient::open(*engine);
  SpaceId other = b->space("other", k2M, 4);
  ASSERT_TRUE(engine->acquire(b->id, {other, 0, 2}, kAcquireZeroNew).ok());
  auto empty = engine->acquire(b->id, {other, 2, 1}, kAcquireZeroNew);
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE(contains(empty.status(), "0 of 4 frames free")) << empty.status().to_string();
  // Once client a closes, its frames serve b.
  ASSERT_TRUE(engine->client_close(a->id).ok());
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  Result<AcquireResult> retry = engine->acquire(b->id, {other, 2, 2}, kAcquireZeroNew);
  while (!retry.ok() && retry.status().code() == StatusCode::UNAVAILABLE && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    retry = engine->acquire(b->id, {other, 2, 2}, kAcquireZeroNew);
  }
  ASSERT_TRUE(retry.ok()) << retry.status().to_string();
  // Window frame numbers are per client: b's four frames are 0..3 in its own window.
  auto locations = engine->locations(b->id, {other, 0, 4}).value();
  std::set<uint32_t> frames;
  for (auto& location : locations) frames.insert(location.window_frame);
  EXPECT_EQ(frames, (std::set<uint32_t>{0, 1, 2, 3}));
}

TEST(Engine, EvictionWritesDirtyPagesBackAndKeepsContents) {
  auto engine = make_engine(2, 16);
  auto client = MappedClient::open(*engine);
  SpaceId space = client->space("s", k2M, 8);
  // Write 8 pages through a 2-frame GPU: every acquire beyond two evicts a dirty page.
  for (uint32_t p = 0; p < 8; ++p) {
    auto pointers = client->acquire({space, p, 1}, kAcquireWrite);
    fill_pattern(pointers[0], k2M, 1000 + p);
    ASSERT_TRUE(engine->release(client->id, {space, p, 1}, true).ok());
  }
  EXPECT_EQ(client->stats().evictions, 6u);
  EXPECT_EQ(client->stats().gpu_frames.current, 2);
  for (uint32_t p = 0; p < 8; ++p) {
    auto pointers = client->acquire({space, p, 1}, 0);
    EXPECT_TRUE(check_pattern(pointers[0], k2M, 1000 + p)) << p;
    ASSERT_TRUE(engine->release(client->id, {space, p, 1}, false).ok());
  }
  // Host reads see the newest contents, including pages dirty on the GPU.
  auto pointers = client->acquire({space, 7, 1}, kAcquireWrite);
  fill_pattern(pointers[0], k2M, 7777);
  ASSERT_TRUE(engine->release(client->id, {space, 7, 1}, false).ok());
  auto host = client->acquire_host({space, 0, 8});
  ASSERT_EQ(host.size(), 8u);
  for (uint32_t p = 0; p < 7; ++p) EXPECT_TRUE(check_pattern(host[p], k2M, 1000 + p)) << p;
  EXPECT_TRUE(check_pattern(host[7], k2M, 7777));
  // A host write makes the GPU copy stale: the next acquire must bring the host version.
  fill_pattern(host[7], k2M, 8888);
  ASSERT_TRUE(engine->release_host(client->id, {space, 0, 8}, true).ok());
  EXPECT_EQ(engine->release_host(client->id, {space, 0, 1}, false).code(), StatusCode::FAILED_PRECONDITION);
  pointers = client->acquire({space, 7, 1}, 0);
  EXPECT_TRUE(check_pattern(pointers[0], k2M, 8888));
  ASSERT_TRUE(engine->release(client->id, {space, 7, 1}, false).ok());
}

TEST(Engine, MixedPageSizesRetypeWholeFrames) {
  auto engine = make_engine(2, 16);
  auto client = MappedClient::open(*engine);
  SpaceId small = client->space("small", k64K, 64);
  SpaceId large = client->space("large", k2M, 2);
  auto pointers = client->acquire({small, 0, 64}, kAcquireWrite | kAcquireZeroNew);
  for (uint32_t p = 0; p < 64; ++p) fill_pattern(pointers[p], k64K, p);
  ASSERT_TRUE(engine->release(client->id, {small, 0, 64}, true).ok());
  // Both frames hold 64 KiB pages; a 2 MiB page needs a whole frame emptied.
  pointers = client->acquire({large, 0, 1}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_EQ(pointers.size(), 1u);
  fill_pattern(pointers[0], k2M, 99);
  ASSERT_TRUE(engine->release(client->id, {large, 0, 1}, true).ok());
  EXPECT_EQ(client->stats().evictions, 32u);
  pointers = client->acquire({small, 0, 64}, 0);
  ASSERT_EQ(pointers.size(), 64u);
  for (uint32_t p = 0; p < 64; ++p) EXPECT_TRUE(check_pattern(pointers[p], k64K, p)) << p;
  ASSERT_TRUE(engine->release(client->id, {small, 0, 64}, false).ok());
  pointers = client->acquire({large, 0, 1}, 0);
  EXPECT_TRUE(check_pattern(pointers[0], k2M, 99));
}

TEST(Engine, PrefetchHitsAndScheduleLookahead) {
  EngineConfig config;
  config.prefetch_lookahead_steps = 1;
  auto engine = make_engine(2, 16, config);
  auto client = MappedClient::open(*engine);
  SpaceId space = client->space("s", k2M, 4);
  auto host = client->acquire_host({space, 0, 4});
  for (uint32_t p = 0; p < 4; ++p) fill_pattern(host[p], k2M, 50 + p);
  ASSERT_TRUE(engine->release_host(client->id, {space, 0, 4}, true).ok());
  // Explicit prefetch, then acquire: a hit, no new transfer.
  auto ticket = engine->prefetch(client->id, {space, 0, 1});
  ASSERT_TRUE(ticket.ok());
  auto pointers = client->acquire({space, 0, 1}, 0);
  EXPECT_TRUE(check_pattern(pointers[0], k2M, 50));
  EXPECT_EQ(client->stats().prefetch_hits, 1u);
  EXPECT_EQ(client->stats().prefetch_misses, 0u);
  ASSERT_TRUE(engine->release(client->id, {space, 0, 1}, false).ok());
  // Schedule 0,1,2,3: each advance brings the next step's page in ahead of its acquire.
  std::vector<ScheduleStep> steps;
  for (uint32_t p = 0; p < 4; ++p) steps.push_back(ScheduleStep{{PageRange{space, p, 1}}});
  ASSERT_TRUE(engine->set_schedule(client->id, steps).ok());
  for (uint32_t s = 0; s < 4; ++s) {
    ASSERT_TRUE(engine->advance(client->id, s).ok());
    pointers = client->acquire({space, s, 1}, 0);
    EXPECT_TRUE(check_pattern(pointers[0], k2M, 50 + s)) << s;
    ASSERT_TRUE(engine->release(client->id, {space, s, 1}, false).ok());
  }
  auto stats = client->stats();
  EXPECT_EQ(stats.prefetch_misses, 0u);
  EXPECT_EQ(stats.prefetch_hits, 4u);
  EXPECT_EQ(stats.bytes_host_to_gpu, 4 * k2M);
}

TEST(Engine, CloseReclaimsEverythingWhileCopiesRun) {
  auto engine = make_engine(8, 32);
  for (int round = 0; round < 5; ++round) {
    auto client = MappedClient::open(*engine);
    SpaceId space = client->space("s", k64K, 256);
    // The previous client's frames may still be finishing its copies: UNAVAILABLE says retry.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    auto acquired = engine->acquire(client->id, {space, 0, 256}, kAcquireZeroNew | kAcquireWrite);
    while (!acquired.ok() && acquired.status().code() == StatusCode::UNAVAILABLE &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      acquired = engine->acquire(client->id, {space, 0, 256}, kAcquireZeroNew | kAcquireWrite);
    }
    ASSERT_TRUE(acquired.ok()) << acquired.status().to_string();
    ASSERT_TRUE(engine->release(client->id, {space, 0, 256}, true).ok());
    ASSERT_TRUE(engine->offload(client->id, {space, 0, 128}).ok());  // copies in flight at close
    ASSERT_TRUE(engine->client_close(client->id).ok());
    EXPECT_EQ(engine->stats(client->id).status().code(), StatusCode::NOT_FOUND);
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  RuntimeStats stats;
  do {
    stats = engine->stats(0).value();
    if (stats.tiers[0].frames_free == 8 && stats.tiers[1].frames_free == 32) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  } while (std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(stats.tiers[0].frames_free, 8u);
  EXPECT_EQ(stats.tiers[1].frames_free, 32u);
  EXPECT_TRUE(stats.clients.empty());
}

// Note [Stream-ordered release]: copies of released pages and the revocation of their frames wait
// until the client's released word reaches the marker (here written by the test, as a CUDA
// stream's cuStreamWriteValue64 would).
TEST(Engine, StreamOrderedReleaseHoldsCopiesAndFramesUntilTheMarker) {
  auto engine = make_engine(2, 4);
  auto client = MappedClient::open(*engine);
  ClientId id = client->id;
  auto signal_fd = engine->client_signal_fd(id);
  ASSERT_TRUE(signal_fd.ok());
  void* mapped = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, signal_fd.value(), 0);
  ::close(signal_fd.value());
  ASSERT_NE(mapped, MAP_FAILED);
  auto* released_word = static_cast<uint64_t*>(mapped) + kSignalReleased;
  auto set_released = [&](uint64_t value) { __atomic_store_n(released_word, value, __ATOMIC_RELEASE); };

  SpaceId space = client->space("L00.k", k64K, 4);
  std::vector<char*> pages = client->acquire({space, 0, 4}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_EQ(pages.size(), 4u);
  for (int i = 0; i < 4; ++i) fill_pattern(pages[i], k64K, 100 + i);
  EXPECT_EQ(engine->release_after(id, {space, 0, 4}, true, 0).code(), StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(engine->release_after(id, {space, 0, 4}, true, 1).ok());
  EXPECT_EQ(engine->release_after(id, {space, 0, 4}, true, 2).code(), StatusCode::FAILED_PRECONDITION);
  // The "GPU" is still writing after the release call: these are the bytes that must reach host.
  for (int i = 0; i < 4; ++i) fill_pattern(pages[i], k64K, 200 + i);

  auto offloaded = engine->offload(id, {space, 0, 4});
  ASSERT_TRUE(offloaded.ok()) << offloaded.status().to_string();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_LT(engine->completed_ticket(id).value(), offloaded.value()) << "the writeback ran before the marker";
  EXPECT_EQ(client->stats().bytes_gpu_to_host, 0u);
  EXPECT_EQ(client->revokes.load(), 0) << "a frame the client may still use was taken back";

  set_released(1);
  ASSERT_TRUE(engine->wait(id, offloaded.value()).ok());
  EXPECT_EQ(client->stats().bytes_gpu_to_host, 4 * k64K);
  EXPECT_TRUE(client->eventually_revoked(1)) << "the emptied GPU frame goes back once the marker is seen";
  std::vector<char*> host = client->acquire_host({space, 0, 4});
  ASSERT_EQ(host.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(check_pattern(host[i], k64K, 200 + i)) << "page " << i;
  ASSERT_TRUE(engine->release_host(id, {space, 0, 4}, false).ok());

  // A clean page freed right after its stream-ordered release: its frame stays mapped until the
  // marker, and a marker already passed holds nothing.
  int revokes_before = client->revokes.load();
  client->acquire({space, 0, 1}, 0);
  ASSERT_TRUE(engine->release_after(id, {space, 0, 1}, false, 2).ok());
  ASSERT_TRUE(engine->free_pages(id, {space, 0, 1}).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(client->revokes.load(), revokes_before);
  set_released(2);
  EXPECT_TRUE(client->eventually_revoked(revokes_before + 1));
  client->acquire({space, 1, 1}, 0);
  ASSERT_TRUE(engine->release_after(id, {space, 1, 1}, true, 2).ok());
  auto quick = engine->offload(id, {space, 1, 1});
  ASSERT_TRUE(quick.ok());
  EXPECT_TRUE(engine->wait(id, quick.value()).ok());
  ::munmap(mapped, 4096);
}

// The schedule's lookahead prefetch takes no ticket: an acquire of pages already resident
// completes even while a lookahead copy waits (here for a release marker), instead of queueing
// behind it in ticket order.
TEST(Engine, AcquireDoesNotWaitForTheLookaheadOfLaterSteps) {
  constexpr uint64_t k1M = 1 << 20;
  auto engine = make_engine(1, 4);  // one GPU frame: two 1 MiB slots
  auto client = MappedClient::open(*engine);
  ClientId id = client->id;
  auto signal_fd = engine->client_signal_fd(id);
  ASSERT_TRUE(signal_fd.ok());
  void* mapped = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, signal_fd.value(), 0);
  ::close(signal_fd.value());
  ASSERT_NE(mapped, MAP_FAILED);
  auto* released_word = static_cast<uint64_t*>(mapped) + kSignalReleased;

  SpaceId space = client->space("L00.k", k1M, 3);
  for (uint32_t p = 0; p < 3; ++p) {  // every page gets contents on the host
    std::vector<char*> page = client->acquire({space, p, 1}, kAcquireWrite | kAcquireZeroNew);
    fill_pattern(page[0], k1M, 10 + p);
    ASSERT_TRUE(engine->release(id, {space, p, 1}, true).ok());
    auto offloaded = engine->offload(id, {space, p, 1});
    ASSERT_TRUE(offloaded.ok() && engine->wait(id, offloaded.value()).ok());
  }
  ASSERT_TRUE(engine->set_schedule(id, {ScheduleStep{{PageRange{space, 0, 1}}}, ScheduleStep{{PageRange{space, 1, 1}}},
                                        ScheduleStep{{PageRange{space, 2, 1}}}}).ok());
  ASSERT_TRUE(engine->advance(id, 0).ok());  // brings in pages 0 and 1 (two slots)
  std::vector<char*> page0 = client->acquire({space, 0, 1}, kAcquireWrite);
  ASSERT_EQ(page0.size(), 1u);
  EXPECT_TRUE(check_pattern(page0[0], k1M, 10));
  ASSERT_TRUE(engine->release_after(id, {space, 0, 1}, true, 1).ok());  // the "kernel" still runs
  // Step 1: the lookahead wants page 2, and the only page it may evict is page 0, whose marker
  // was not seen: that copy is held.
  ASSERT_TRUE(engine->advance(id, 1).ok());
  auto acquired = engine->acquire(id, {space, 1, 1}, 0);
  ASSERT_TRUE(acquired.ok()) << acquired.status().to_string();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (engine->completed_ticket(id).value() < acquired.value().ticket && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_GE(engine->completed_ticket(id).value(), acquired.value().ticket)
      << "the acquire of a resident page waited for the held lookahead copy";
  EXPECT_TRUE(check_pattern(client->pointer(Tier::kGpu, space, acquired.value().locations[0]), k1M, 11));
  ASSERT_TRUE(engine->release(id, {space, 1, 1}, false).ok());
  // The marker arrives: page 0 is written back, page 2 comes in, and every byte is right.
  __atomic_store_n(released_word, uint64_t{1}, __ATOMIC_RELEASE);
  std::vector<char*> page2 = client->acquire({space, 2, 1}, 0);
  ASSERT_EQ(page2.size(), 1u);
  EXPECT_TRUE(check_pattern(page2[0], k1M, 12));
  ASSERT_TRUE(engine->release(id, {space, 2, 1}, false).ok());
  std::vector<char*> host = client->acquire_host({space, 0, 1});
  ASSERT_EQ(host.size(), 1u);
  EXPECT_TRUE(check_pattern(host[0], k1M, 10));
  ::munmap(mapped, 4096);
}

TEST(Engine, TicketsCompleteInOrderAndSetTheSignalWord) {
  auto engine = make_engine(4, 16);
  std::vector<Ticket> seen;
  std::mutex seen_mutex;
  ClientEvents events;
  events.frame_granted = [](uint32_t, Tier, int fd) { ::close(fd); };
  events.tickets_completed = [&](Ticket t) {
    std::lock_guard<std::mutex> lock(seen_mutex);
    seen.push_back(t);
  };
  ClientId id = engine->client_open({}, std::move(events)).value();
  SpaceId space = engine->create_space(id, "s", k64K, 128).value();
  Ticket last = 0;
  for (uint32_t i = 0; i < 16; ++i) {
    auto acquired = engine->acquire(id, {space, i * 8, 8}, kAcquireZeroNew | kAcquireWrite);
    ASSERT_TRUE(acquired.ok()) << acquired.status().to_string();
    EXPECT_GT(acquired.value().ticket, last);
    last = acquired.value().ticket;
    ASSERT_TRUE(engine->release(id, {space, i * 8, 8}, true).ok());
    ASSERT_TRUE(engine->offload(id, {space, i * 8, 8}).ok());
  }
  auto final_ticket = engine->offload(id, {space, 0, 128});
  ASSERT_TRUE(final_ticket.ok());
  ASSERT_TRUE(engine->wait(id, final_ticket.value()).ok());
  EXPECT_GE(engine->completed_ticket(id).value(), final_ticket.value());
  int fd = engine->client_signal_fd(id).value();
  auto* words = static_cast<volatile uint64_t*>(::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0));
  ::close(fd);
  EXPECT_GE(words[kSignalCompleted], final_ticket.value());
  ::munmap(const_cast<uint64_t*>(words), 4096);
  // The event reaches the callback after the ticket completes (delivery runs unlocked).
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(seen_mutex);
      if ((!seen.empty() && seen.back() >= final_ticket.value()) || std::chrono::steady_clock::now() > deadline) break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  std::lock_guard<std::mutex> lock(seen_mutex);
  ASSERT_FALSE(seen.empty());
  EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
  EXPECT_GE(seen.back(), final_ticket.value());
}

}  // namespace
}  // namespace membar::runtimed
