// The engine when things go wrong: copies that fail (synchronously or in their completion)
// surface as the ticket's error without stalling anything else, and several clients opening,
// working and closing concurrently on one engine never see each other's data or lose their own.
#include <atomic>
#include <random>
#include <thread>

#include "runtime_test_util.h"

namespace membar::runtimed {
namespace {

using membar::testing::check_pattern;
using membar::testing::fill_pattern;
using membar::testing::MappedClient;

// Forwards to a host backend, failing chosen enqueue_copies calls (1-based): `fail_enqueue_at`
// is refused at enqueue, `fail_completion_at` runs but reports INTERNAL in its completion.
class FailingBackend final : public DeviceBackend {
 public:
  FailingBackend(std::unique_ptr<DeviceBackend> inner, int fail_enqueue_at, int fail_completion_at)
      : inner_(std::move(inner)), fail_enqueue_at_(fail_enqueue_at), fail_completion_at_(fail_completion_at) {}
  std::string name() const override { return inner_->name(); }
  uint64_t frame_count(Tier tier) const override { return inner_->frame_count(tier); }
  Result<int> export_frame(Tier tier, FrameIndex frame) override { return inner_->export_frame(tier, frame); }
  void* frame_pointer(Tier tier, FrameIndex frame) override { return inner_->frame_pointer(tier, frame); }
  Status enqueue_copies(std::vector<CopyOp> ops, std::function<void(Status)> done) override {
    int call = ++calls_;
    if (call == fail_enqueue_at_) return internal_error("injected enqueue failure");
    if (call == fail_completion_at_) {
      return inner_->enqueue_copies(std::move(ops), [done = std::move(done)](Status) {
        done(internal_error("injected completion failure"));
      });
    }
    return inner_->enqueue_copies(std::move(ops), std::move(done));
  }
  Status enqueue_zero(Tier tier, FrameIndex frame, uint64_t offset, uint64_t bytes,
                      std::function<void(Status)> done) override {
    return inner_->enqueue_zero(tier, frame, offset, bytes, std::move(done));
  }
  void drain() override { inner_->drain(); }
  Result<uint32_t> create_signal_block(uint32_t words) override { return inner_->create_signal_block(words); }
  Status destroy_signal_block(uint32_t block) override { return inner_->destroy_signal_block(block); }
  Result<int> export_signal_block(uint32_t block) override { return inner_->export_signal_block(block); }
  volatile uint64_t* signal_words(uint32_t block) override { return inner_->signal_words(block); }
  Status enqueue_signal(uint32_t block, uint32_t index, uint64_t value) override {
    return inner_->enqueue_signal(block, index, value);
  }

 private:
  std::unique_ptr<DeviceBackend> inner_;
  std::atomic<int> calls_{0};
  int fail_enqueue_at_;
  int fail_completion_at_;
};

TEST(EngineFaults, FailedCopiesSurfaceInWaitAndNothingStalls) {
  BackendConfig backend_config;
  backend_config.gpu_pool_bytes = 4 * kFrameBytes;
  backend_config.host_pool_bytes = 8 * kFrameBytes;
  auto backend = std::make_unique<FailingBackend>(make_host_backend(backend_config).value(), 3, 6);
  auto engine = Engine::create(std::move(backend), {}).value();
  auto client = MappedClient::open(*engine);
  SpaceId space = client->space("s", 2 << 20, 2);
  client->acquire({space, 0, 2}, kAcquireZeroNew | kAcquireWrite);  // zero fills, no copies
  ASSERT_TRUE(engine->release(client->id, {space, 0, 2}, true).ok());
  std::vector<StatusCode> outcomes;
  for (int round = 0; round < 5; ++round) {
    // Each offload and each acquire issues one enqueue_copies call.
    auto offloaded = engine->offload(client->id, {space, 0, 2});
    ASSERT_TRUE(offloaded.ok());
    outcomes.push_back(engine->wait(client->id, offloaded.value()).code());
    auto acquired = engine->acquire(client->id, {space, 0, 2}, 0);
    ASSERT_TRUE(acquired.ok());
    Status waited = engine->wait(client->id, acquired.value().ticket);
    outcomes.push_back(waited.code());
    if (!waited.ok()) EXPECT_NE(waited.message().find("injected"), std::string::npos) << waited.to_string();
    ASSERT_TRUE(engine->release(client->id, {space, 0, 2}, true).ok());
  }
  std::vector<StatusCode> expected(10, StatusCode::OK);
  expected[2] = StatusCode::INTERNAL;  // third copy batch: refused at enqueue
  expected[5] = StatusCode::INTERNAL;  // sixth: failed in its completion
  EXPECT_EQ(outcomes, expected);
  EXPECT_GE(engine->completed_ticket(client->id).value(), 11u);
}

// One client's life: random work with checksums, then close; repeated.
void client_lives(Engine& engine, int thread, int lives, int operations, std::atomic<uint64_t>& corrupted,
                  std::atomic<uint64_t>& checked, std::atomic<uint64_t>& exhausted) {
  std::mt19937_64 random(1234 + thread);
  const uint64_t page_bytes = thread % 2 ? (512 << 10) : (1 << 20);
  const uint32_t pages = 12;
  for (int life = 0; life < lives; ++life) {
    ClientConfig config;
    config.name = "thread" + std::to_string(thread);
    config.gpu_quota_bytes = 3 * kFrameBytes;
    auto client = MappedClient::open(engine, config);
    SpaceId space = client->space("s", page_bytes, pages);
    std::vector<uint64_t> version(pages, 0);
    auto tag = [&](uint32_t p) { return (uint64_t(thread) << 40) + (uint64_t(life) << 32) + p * 1000 + version[p]; };
    for (int op = 0; op < operations; ++op) {
      uint32_t p = uint32_t(random() % pages);
      switch (random() % 4) {
        case 0:
        case 1: {
          bool write = random() % 2;
          auto acquired = engine.acquire(client->id, {space, p, 1}, write ? kAcquireWrite : 0);
          if (!acquired.ok()) {
            ASSERT_EQ(acquired.status().code(), StatusCode::RESOURCE_EXHAUSTED) << acquired.status().to_string();
            ++exhausted;
            break;
          }
          ASSERT_TRUE(engine.wait(client->id, acquired.value().ticket).ok());
          char* pointer = client->pointer(Tier::kGpu, space, acquired.value().locations[0]);
          if (version[p] != 0) {
            ++checked;
            if (!check_pattern(pointer, page_bytes, tag(p))) ++corrupted;
          }
          if (write) {
            ++version[p];
            fill_pattern(pointer, page_bytes, tag(p));
          }
          ASSERT_TRUE(engine.release(client->id, {space, p, 1}, write).ok());
          break;
        }
        case 2: {
          auto offloaded = engine.offload(client->id, {space, p, 1});
          ASSERT_TRUE(offloaded.ok()) << offloaded.status().to_string();
          break;
        }
        default: {
          auto prefetched = engine.prefetch(client->id, {space, p, 1});
          if (!prefetched.ok()) {
            ASSERT_EQ(prefetched.status().code(), StatusCode::RESOURCE_EXHAUSTED) << prefetched.status().to_string();
            ++exhausted;
          }
          break;
        }
      }
    }
    auto host = client->acquire_host({space, 0, pages});
    ASSERT_EQ(host.size(), pages);
    for (uint32_t q = 0; q < pages; ++q) {
      if (version[q] == 0) continue;
      ++checked;
      if (!check_pattern(host[q], page_bytes, tag(q))) ++corrupted;
    }
    ASSERT_TRUE(engine.client_close(client->id).ok());  // with pages acquired for host access
  }
}

TEST(EngineFaults, ClientsComingAndGoingKeepTheirOwnData) {
  // Three clients of 3 GPU frames each share 8, so the pool may run dry (RESOURCE_EXHAUSTED is
  // then an answer, not a failure: a client with no frame yet has nothing to evict), and every
  // close hands frames to the next client.
  auto engine = membar::testing::make_engine(8, 64);
  std::atomic<uint64_t> corrupted{0}, checked{0}, exhausted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] { client_lives(*engine, t, 6, 150, corrupted, checked, exhausted); });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(corrupted.load(), 0u);
  EXPECT_GT(checked.load(), 500u);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  RuntimeStats stats;
  do {
    stats = engine->stats(0).value();
    if (stats.tiers[0].frames_free == 8 && stats.tiers[1].frames_free == 64) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  } while (std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(stats.tiers[0].frames_free, 8u);
  EXPECT_EQ(stats.tiers[1].frames_free, 64u);
  std::printf("checked %llu pages, corrupted %llu, exhausted answers %llu\n", (unsigned long long)checked.load(),
              (unsigned long long)corrupted.load(), (unsigned long long)exhausted.load());
}

}  // namespace
}  // namespace membar::runtimed
