// The embedded client end to end on the host backend: the space layout (one contiguous range per
// space and tier, Note [Space layout]), channels, and random acquire / release / offload /
// prefetch / free / host-access cycles from several threads with every page's contents
// checksummed, under GPU pressure (evictions, page sizes that do not divide a frame), and
// copy_pages between pages on either tier.
#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>

#include "client_test_util.h"
#include "membar/client.h"
#include "runtime_test_util.h"

namespace membar {
namespace {

using membar::testing::check_pattern;
using membar::testing::fill_pattern;
using membar::testing::is_zero;

std::unique_ptr<Client> make_client(uint64_t gpu_frames, uint64_t host_frames) {
  EmbeddedConfig config;
  config.backend = BackendKind::kHost;
  config.gpu_pool_bytes = gpu_frames * kFrameBytes;
  config.host_pool_bytes = host_frames * kFrameBytes;
  auto client = make_embedded_client(config);
  EXPECT_TRUE(client.ok()) << client.status().to_string();
  return std::move(client).value();
}

TEST(EmbeddedClient, BasicsOnTheHostBackend) {
  auto client = make_client(4, 8);
  EXPECT_EQ(client->describe(), "embedded:host");
  EXPECT_EQ(client->backend(), BackendKind::kHost);
  constexpr uint64_t kPage = 96 << 10;  // pages straddle frames
  auto space = client->create_space("L00.k", kPage, 40);
  ASSERT_TRUE(space.ok()) << space.status().to_string();
  EXPECT_EQ(client->create_space("L00.k", kPage, 16).status().code(), StatusCode::ALREADY_EXISTS);
  auto view = client->space_view(space.value());
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view.value().page_bytes, kPage);
  EXPECT_EQ(view.value().page_count, 40u);
  EXPECT_EQ(view.value().bytes, 40 * kPage);
  ASSERT_NE(view.value().gpu, nullptr);
  ASSERT_NE(view.value().host, nullptr);
  EXPECT_EQ(client->space_view(space.value() + 1).status().code(), StatusCode::NOT_FOUND);
  auto acquired = client->acquire({space.value(), 0, 40}, kAcquireZeroNew | kAcquireWrite);
  ASSERT_TRUE(acquired.ok()) << acquired.status().to_string();
  ASSERT_TRUE(client->wait(acquired.value().ticket).ok());
  EXPECT_GE(client->completed_ticket(), acquired.value().ticket);
  char* pages = static_cast<char*>(acquired.value().pointer);
  EXPECT_EQ(pages, view.value().gpu);
  EXPECT_TRUE(is_zero(pages, 40 * kPage));
  for (uint32_t p = 0; p < 40; ++p) fill_pattern(pages + p * kPage, kPage, p);
  // Page first + i lies at pointer + i * page_bytes for any first page.
  auto middle = client->acquire({space.value(), 17, 5}, 0);
  ASSERT_TRUE(middle.ok());
  EXPECT_EQ(middle.value().pointer, pages + 17 * kPage);
  ASSERT_TRUE(client->release({space.value(), 17, 5}, false).ok());
  EXPECT_EQ(client->stream_wait(acquired.value().ticket, nullptr).code(), StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(client->stream_release({space.value(), 0, 40}, true, nullptr).code(), StatusCode::UNIMPLEMENTED);
  ASSERT_TRUE(client->release({space.value(), 0, 40}, true).ok());
  auto offloaded = client->offload({space.value(), 0, 40});
  ASSERT_TRUE(offloaded.ok());
  ASSERT_TRUE(client->wait(offloaded.value()).ok());
  auto host = client->acquire_host({space.value(), 0, 40});
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  EXPECT_EQ(host.value(), view.value().host);
  for (uint32_t p = 0; p < 40; ++p) EXPECT_TRUE(check_pattern(static_cast<char*>(host.value()) + p * kPage, kPage, p));
  ASSERT_TRUE(client->release_host({space.value(), 0, 40}, false).ok());
  // Back on the GPU at the same addresses.
  auto again = client->acquire({space.value(), 0, 40}, 0);
  ASSERT_TRUE(again.ok());
  ASSERT_TRUE(client->wait(again.value().ticket).ok());
  EXPECT_EQ(again.value().pointer, pages);
  for (uint32_t p = 0; p < 40; ++p) EXPECT_TRUE(check_pattern(pages + p * kPage, kPage, p)) << p;
  ASSERT_TRUE(client->release({space.value(), 0, 40}, false).ok());
  auto stats = client->stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats.value().backend, "host");
  EXPECT_EQ(stats.value().clients.at(0).bytes_both, 40 * kPage);
  EXPECT_EQ(stats.value().clients.at(0).bytes_gpu_to_host, 40 * kPage);
  ASSERT_EQ(stats.value().spaces.size(), 1u);
  EXPECT_EQ(stats.value().spaces[0].name, "L00.k");
  // A ticket never issued is refused at once, not waited for.
  EXPECT_EQ(client->wait(client->completed_ticket() + 1000).code(), StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(client->destroy_space(space.value()).ok());
  EXPECT_EQ(client->acquire({space.value(), 0, 1}, 0).status().code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(client->space_view(space.value()).status().code(), StatusCode::NOT_FOUND);
}

TEST(EmbeddedClient, ChannelsAreSharedInsideTheProcessAndReadOnlyForOpeners) {
  EmbeddedConfig config;
  config.backend = BackendKind::kHost;
  config.gpu_pool_bytes = 8ull << 20;
  config.host_pool_bytes = 16ull << 20;
  auto publisher = make_embedded_client(config);
  auto reader = make_embedded_client(config);
  ASSERT_TRUE(publisher.ok() && reader.ok());
  auto channel = publisher.value()->create_channel("embedded.sync", 1 << 20);
  ASSERT_TRUE(channel.ok()) << channel.status().to_string();
  std::mt19937_64 random(42);
  std::vector<uint64_t> expected(channel.value().bytes / 8);
  for (uint64_t& word : expected) word = random();
  std::memcpy(channel.value().data, expected.data(), channel.value().bytes);

  auto opened = reader.value()->open_channel("embedded.sync");
  ASSERT_TRUE(opened.ok()) << opened.status().to_string();
  EXPECT_FALSE(opened.value().writable);
  EXPECT_EQ(std::memcmp(opened.value().data, expected.data(), expected.size() * 8), 0);
  EXPECT_EQ(::mmap(nullptr, 4096, PROT_WRITE, MAP_SHARED, opened.value().fd, 0), MAP_FAILED);

  EXPECT_EQ(publisher.value()->create_channel("embedded.sync", 4096).status().code(), StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(publisher.value()->create_channel("big", 64ull << 20).status().code(), StatusCode::RESOURCE_EXHAUSTED);
  auto missing = reader.value()->open_channel("nobody");
  EXPECT_EQ(missing.status().code(), StatusCode::NOT_FOUND);
  EXPECT_NE(missing.status().message().find("embedded"), std::string::npos) << missing.status().message();

  // The creator's close drops the name; the reader's mapping keeps the bytes.
  ASSERT_TRUE(publisher.value()->close_channel(channel.value().handle).ok());
  EXPECT_EQ(reader.value()->open_channel("embedded.sync").status().code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(std::memcmp(opened.value().data, expected.data(), expected.size() * 8), 0);
  EXPECT_EQ(publisher.value()->close_channel(channel.value().handle).code(), StatusCode::NOT_FOUND);
  // The name is free again, and a destroyed client's channels go with it.
  ASSERT_TRUE(publisher.value()->create_channel("embedded.sync", 4096).ok());
  publisher.value().reset();
  EXPECT_EQ(reader.value()->open_channel("embedded.sync").status().code(), StatusCode::NOT_FOUND);
}

TEST(EmbeddedClient, AskingForCudaWithoutCudaIsAClearError) {
#if !defined(MEMBAR_WITH_CUDA)
  EmbeddedConfig config;
  config.backend = BackendKind::kCuda;
  auto client = make_embedded_client(config);
  ASSERT_FALSE(client.ok());
  EXPECT_EQ(client.status().code(), StatusCode::UNIMPLEMENTED);
#else
  GTEST_SKIP() << "built with CUDA";
#endif
}

// One thread's workload over its own space; every page's expected contents tracked by version.
struct Worker {
  Client* client;
  SpaceId space;
  uint64_t page_bytes;
  uint32_t pages;
  uint64_t salt;
  std::vector<uint32_t> version;  // 0: no contents
  uint64_t cycles = 0, corrupted = 0, exhausted = 0, checked = 0, zero_failures = 0, host_failures = 0;
  // Zero-fill is per space frame (a frame with contents is not refilled), so it is checked only
  // where a page is a whole frame.
  bool pages_are_frames() const { return page_bytes % kFrameBytes == 0; }

  uint64_t tag(uint32_t page) const { return salt * 1000003 + uint64_t(page) * 7919 + version[page]; }

  void verify(uint32_t page, void* pointer) {
    if (version[page] == 0) return;
    ++checked;
    if (!check_pattern(pointer, page_bytes, tag(page))) ++corrupted;
  }

  void run(uint64_t iterations, uint64_t seed) {
    std::mt19937_64 random(seed);
    for (uint64_t i = 0; i < iterations; ++i) {
      uint32_t count = 1 + uint32_t(random() % 4);
      uint32_t first = uint32_t(random() % (pages - count + 1));
      PageRange range{space, first, count};
      switch (random() % 8) {
        case 0:
        case 1:
        case 2: {  // acquire on the "GPU", check, maybe write
          bool write = random() % 2 == 0;
          uint32_t flags = write ? uint32_t(kAcquireWrite) : 0u;
          if (random() % 2) flags |= kAcquireZeroNew;
          auto acquired = client->acquire(range, flags);
          if (!acquired.ok()) {
            ASSERT_EQ(acquired.status().code(), StatusCode::RESOURCE_EXHAUSTED) << acquired.status().to_string();
            ++exhausted;
            break;
          }
          ASSERT_TRUE(client->wait(acquired.value().ticket).ok());
          for (uint32_t k = 0; k < count; ++k) {
            void* pointer = static_cast<char*>(acquired.value().pointer) + uint64_t(k) * page_bytes;
            if (pages_are_frames() && version[first + k] == 0 && (flags & kAcquireZeroNew) &&
                !is_zero(pointer, page_bytes)) {
              // A freed page without contents must not keep its old GPU frame's bytes.
              ++corrupted;
              ++zero_failures;
            }
            verify(first + k, pointer);
            if (write) {
              ++version[first + k];
              fill_pattern(pointer, page_bytes, tag(first + k));
            }
          }
          ASSERT_TRUE(client->release(range, write).ok());
          break;
        }
        case 3: {
          auto ticket = client->offload(range);
          ASSERT_TRUE(ticket.ok() || ticket.status().code() == StatusCode::RESOURCE_EXHAUSTED)
              << ticket.status().to_string();
          if (ticket.ok() && random() % 2) { ASSERT_TRUE(client->wait(ticket.value()).ok()); }
          break;
        }
        case 4: {
          auto ticket = client->prefetch(range);
          if (!ticket.ok()) {
            ASSERT_EQ(ticket.status().code(), StatusCode::RESOURCE_EXHAUSTED) << ticket.status().to_string();
            ++exhausted;
          }
          break;
        }
        case 5: {  // free, when every page has contents; otherwise the engine must refuse
          bool all = true;
          for (uint32_t k = 0; k < count; ++k) all = all && version[first + k] != 0;
          Status status = client->free_pages(range);
          if (all) {
            ASSERT_TRUE(status.ok()) << status.to_string();
            for (uint32_t k = 0; k < count; ++k) version[first + k] = 0;
          } else if (status.ok()) {
            // Pages without contents may share frames with pages that have some (or hold frames
            // acquired without zero-fill): freeing them is legal. Their versions stay 0.
            for (uint32_t k = 0; k < count; ++k) version[first + k] = 0;
          } else {
            ASSERT_EQ(status.code(), StatusCode::FAILED_PRECONDITION) << status.to_string();
          }
          break;
        }
        default: {  // host access: check, maybe write
          auto host = client->acquire_host(range);
          if (!host.ok()) {
            ASSERT_EQ(host.status().code(), StatusCode::RESOURCE_EXHAUSTED) << host.status().to_string();
            ++exhausted;
            break;
          }
          bool write = random() % 2 == 0;
          for (uint32_t k = 0; k < count; ++k) {
            char* page = static_cast<char*>(host.value()) + uint64_t(k) * page_bytes;
            uint64_t before = corrupted;
            verify(first + k, page);
            host_failures += corrupted - before;
            if (write) {
              ++version[first + k];
              fill_pattern(page, page_bytes, tag(first + k));
            }
          }
          ASSERT_TRUE(client->release_host(range, write).ok());
          break;
        }
      }
      ++cycles;
    }
  }

  // Every page with contents, read back through the host tier.
  void audit() {
    auto host = client->acquire_host({space, 0, pages});
    ASSERT_TRUE(host.ok()) << host.status().to_string();
    for (uint32_t p = 0; p < pages; ++p) verify(p, static_cast<char*>(host.value()) + uint64_t(p) * page_bytes);
    ASSERT_TRUE(client->release_host({space, 0, pages}, false).ok());
  }
};

TEST(EmbeddedClient, RandomCyclesFromFourThreadsLoseNothing) {
  // 12 GPU frames for four spaces of up to 48 MiB each: constant eviction and write-back.
  auto client = make_client(12, 128);
  const uint64_t page_sizes[] = {3000, 96 << 10, 1 << 20, 2 << 20};
  std::vector<Worker> workers;
  for (int t = 0; t < 4; ++t) {
    uint32_t pages = uint32_t(std::min<uint64_t>(t == 0 ? 2048 : 24, (48ull << 20) / page_sizes[t]));
    auto space = client->create_space("thread" + std::to_string(t), page_sizes[t], pages);
    ASSERT_TRUE(space.ok());
    workers.push_back(Worker{client.get(), space.value(), page_sizes[t], pages, uint64_t(t + 1),
                             std::vector<uint32_t>(pages, 0)});
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&workers, t] { workers[t].run(1000, 99 + t); });
  for (auto& thread : threads) thread.join();
  uint64_t cycles = 0, corrupted = 0, exhausted = 0, checked = 0;
  for (Worker& worker : workers) {
    worker.audit();
    cycles += worker.cycles;
    corrupted += worker.corrupted;
    std::printf("worker %llu: corrupted %llu (zero %llu, host %llu)\n", (unsigned long long)worker.salt,
                (unsigned long long)worker.corrupted, (unsigned long long)worker.zero_failures,
                (unsigned long long)worker.host_failures);
    exhausted += worker.exhausted;
    checked += worker.checked;
  }
  auto stats = client->stats().value().clients.at(0);
  std::printf("cycles %llu, pages checked %llu, corrupted %llu, exhausted (retried later) %llu, evictions %llu, "
              "host->gpu %llu MiB, gpu->host %llu MiB\n",
              (unsigned long long)cycles, (unsigned long long)checked, (unsigned long long)corrupted,
              (unsigned long long)exhausted, (unsigned long long)stats.evictions,
              (unsigned long long)(stats.bytes_host_to_gpu >> 20), (unsigned long long)(stats.bytes_gpu_to_host >> 20));
  EXPECT_EQ(cycles, 4000u);
  EXPECT_EQ(corrupted, 0u);
  EXPECT_GT(checked, 2000u);
  EXPECT_GT(stats.evictions, 100u);
  EXPECT_LT(exhausted, cycles / 10);
}

// copy_pages through the client API (Note [Copied pages] in engine/page_copies.cpp), with fresh
// random bytes (never zero) for each test: the seed is in every failure's trace.
class RandomBytes {
 public:
  RandomBytes() : seed_(std::random_device{}()), random_(seed_) {}
  uint64_t seed() const { return seed_; }
  std::vector<uint8_t> next(uint64_t count) {
    std::vector<uint8_t> bytes(count);
    for (uint64_t i = 0; i < count; ++i) {
      uint8_t byte = uint8_t(random_());
      bytes[i] = byte == 0 ? 0x3c : byte;
    }
    return bytes;
  }

 private:
  uint64_t seed_;
  std::mt19937_64 random_;
};

using membar::testing::same_bytes;

// The bytes of pages [first, first + count) of `bytes`, and `bytes` with them replaced.
std::vector<uint8_t> slice(const std::vector<uint8_t>& bytes, uint64_t page_bytes, uint32_t first, uint32_t count) {
  return {bytes.begin() + uint64_t(first) * page_bytes, bytes.begin() + uint64_t(first + count) * page_bytes};
}
std::vector<uint8_t> replaced(std::vector<uint8_t> bytes, uint64_t page_bytes, uint32_t first,
                              const std::vector<uint8_t>& pages) {
  std::memcpy(bytes.data() + uint64_t(first) * page_bytes, pages.data(), pages.size());
  return bytes;
}

using membar::testing::gpu_resident_bytes;

// Writes `bytes` through host access (released dirty), or reads the range's bytes through it.
::testing::AssertionResult write_on_host(Client& client, PageRange range, const std::vector<uint8_t>& bytes) {
  auto host = client.acquire_host(range);
  if (!host.ok()) return ::testing::AssertionFailure() << host.status().to_string();
  std::memcpy(host.value(), bytes.data(), bytes.size());
  Status released = client.release_host(range, true);
  if (!released.ok()) return ::testing::AssertionFailure() << released.to_string();
  return ::testing::AssertionSuccess();
}
std::vector<uint8_t> read_on_host(Client& client, PageRange range, uint64_t page_bytes) {
  std::vector<uint8_t> bytes(uint64_t(range.page_count) * page_bytes);
  auto host = client.acquire_host(range);
  EXPECT_TRUE(host.ok()) << host.status().to_string();
  if (!host.ok()) return bytes;
  std::memcpy(bytes.data(), host.value(), bytes.size());
  EXPECT_TRUE(client.release_host(range, false).ok());
  return bytes;
}

// Acquires the range on the GPU for writing, waits, and returns its first page (nullptr on failure).
char* acquire_now(Client& client, PageRange range) {
  auto acquired = client.acquire(range, kAcquireWrite | kAcquireZeroNew);
  EXPECT_TRUE(acquired.ok()) << acquired.status().to_string();
  if (!acquired.ok()) return nullptr;
  Status waited = client.wait(acquired.value().ticket);
  EXPECT_TRUE(waited.ok()) << waited.to_string();
  return static_cast<char*>(acquired.value().pointer);
}

// History pages that live on the host only, copied into staging pages kept acquired on the GPU:
// the stage holds them after wait(ticket), the history stays on the host. Bad calls (a stream on
// the host backend, an odd number of ranges, a destination overlapping its source, a page range
// past the end) are refused and change nothing.
TEST(EmbeddedClient, CopyPagesFromHostPagesIntoAcquiredPages) {
  RandomBytes random;
  SCOPED_TRACE("random seed " + std::to_string(random.seed()));
  auto client = make_client(8, 32);
  constexpr uint64_t kPage = 96 << 10;
  auto history = client->create_space("L00.k.history", kPage, 48);
  auto stage = client->create_space("L00.k.stage", kPage, 32);
  ASSERT_TRUE(history.ok() && stage.ok());
  PageRange all_history{history.value(), 0, 48}, all_stage{stage.value(), 0, 32};
  std::vector<uint8_t> history_bytes = random.next(48 * kPage);
  ASSERT_TRUE(write_on_host(*client, all_history, history_bytes));
  auto offloaded = client->offload(all_history);
  ASSERT_TRUE(offloaded.ok() && client->wait(offloaded.value()).ok());
  ASSERT_EQ(gpu_resident_bytes(*client, history.value()), 0u);
  char* staged = acquire_now(*client, all_stage);
  ASSERT_NE(staged, nullptr);
  std::vector<uint8_t> stage_bytes = random.next(32 * kPage);
  std::memcpy(staged, stage_bytes.data(), stage_bytes.size());

  std::vector<PageRange> pairs = {{history.value(), 15, 12}, {stage.value(), 12, 12}};
  auto marked = client->stream_mark(nullptr);
  EXPECT_EQ(marked.status().code(), StatusCode::UNIMPLEMENTED) << marked.status().to_string();
  auto unmarked = client->copy_pages(pairs, uint64_t{1});   // no stream ever wrote marker 1
  EXPECT_EQ(unmarked.status().code(), StatusCode::INVALID_ARGUMENT) << unmarked.status().to_string();
  EXPECT_EQ(client->copy_pages({pairs[0]}, std::nullopt).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(client->copy_pages({}, std::nullopt).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(client->copy_pages({{stage.value(), 0, 8}, {stage.value(), 4, 8}}, std::nullopt).status().code(),
            StatusCode::INVALID_ARGUMENT);
  Status past_end = client->copy_pages({{history.value(), 40, 12}, {stage.value(), 0, 12}}, std::nullopt).status();
  EXPECT_TRUE(past_end.code() == StatusCode::OUT_OF_RANGE || past_end.code() == StatusCode::INVALID_ARGUMENT)
      << past_end.to_string();
  EXPECT_TRUE(same_bytes(staged, stage_bytes, kPage)) << "a refused copy changed the stage";

  auto copied = client->copy_pages(pairs, std::nullopt);
  ASSERT_TRUE(copied.ok()) << copied.status().to_string();
  ASSERT_TRUE(client->wait(copied.value()).ok());
  EXPECT_GE(client->completed_ticket(), copied.value());
  EXPECT_TRUE(same_bytes(staged, replaced(stage_bytes, kPage, 12, slice(history_bytes, kPage, 15, 12)), kPage));
  EXPECT_EQ(gpu_resident_bytes(*client, history.value()), 0u) << "copy_pages placed the source on the GPU";
  EXPECT_TRUE(same_bytes(read_on_host(*client, all_history, kPage).data(), history_bytes, kPage));
  ASSERT_TRUE(client->release(all_stage, true).ok());
}

// Pages of 3000 bytes, ranges crossing frame boundaries at different offsets: pages resident on
// the GPU copied into pages that never had contents (written on the host, zero elsewhere), then a
// write-back round trip of host pages through an acquired stage; the host pages not copied back
// keep their bytes.
TEST(EmbeddedClient, CopyPagesOfThreeThousandBytesBothWays) {
  RandomBytes random;
  SCOPED_TRACE("random seed " + std::to_string(random.seed()));
  auto client = make_client(8, 32);
  constexpr uint64_t kPage = 3000;   // page 699 straddles the first frame boundary, page 1398 the second
  auto resident = client->create_space("resident", kPage, 1500);
  auto history = client->create_space("history", kPage, 2100);
  auto stage = client->create_space("stage", kPage, 800);
  ASSERT_TRUE(resident.ok() && history.ok() && stage.ok());
  PageRange all_resident{resident.value(), 0, 1500}, all_history{history.value(), 0, 2100};
  char* resident_pages = acquire_now(*client, all_resident);
  ASSERT_NE(resident_pages, nullptr);
  std::vector<uint8_t> resident_bytes = random.next(1500 * kPage);
  std::memcpy(resident_pages, resident_bytes.data(), resident_bytes.size());
  ASSERT_TRUE(client->release(all_resident, true).ok());

  // Resident pages [690, 710) into the history's pages [1390, 1410), which have no contents yet.
  auto copied = client->copy_pages({{resident.value(), 690, 20}, {history.value(), 1390, 20}}, std::nullopt);
  ASSERT_TRUE(copied.ok()) << copied.status().to_string();
  ASSERT_TRUE(client->wait(copied.value()).ok());
  EXPECT_EQ(gpu_resident_bytes(*client, history.value()), 0u);
  std::vector<uint8_t> history_expected =
      replaced(std::vector<uint8_t>(2100 * kPage, 0), kPage, 1390, slice(resident_bytes, kPage, 690, 20));
  EXPECT_TRUE(same_bytes(read_on_host(*client, all_history, kPage).data(), history_expected, kPage));

  // The round trip: history [1380, 1420) -> stage [680, 720) -> changed -> back.
  std::vector<uint8_t> history_bytes = random.next(2100 * kPage);
  ASSERT_TRUE(write_on_host(*client, all_history, history_bytes));
  char* staged = acquire_now(*client, {stage.value(), 0, 800});
  ASSERT_NE(staged, nullptr);
  copied = client->copy_pages({{history.value(), 1380, 40}, {stage.value(), 680, 40}}, std::nullopt);
  ASSERT_TRUE(copied.ok()) << copied.status().to_string();
  ASSERT_TRUE(client->wait(copied.value()).ok());
  ASSERT_TRUE(same_bytes(staged + 680 * kPage, slice(history_bytes, kPage, 1380, 40), kPage));
  std::vector<uint8_t> changed = random.next(40 * kPage);
  std::memcpy(staged + 680 * kPage, changed.data(), changed.size());
  copied = client->copy_pages({{stage.value(), 680, 40}, {history.value(), 1380, 40}}, std::nullopt);
  ASSERT_TRUE(copied.ok()) << copied.status().to_string();
  ASSERT_TRUE(client->wait(copied.value()).ok());
  EXPECT_EQ(gpu_resident_bytes(*client, history.value()), 0u);
  EXPECT_TRUE(same_bytes(read_on_host(*client, all_history, kPage).data(),
                         replaced(history_bytes, kPage, 1380, changed), kPage));
  ASSERT_TRUE(client->release({stage.value(), 0, 800}, true).ok());
}

}  // namespace
}  // namespace membar
