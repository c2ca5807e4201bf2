// The engine when things go wrong: copies that fail (synchronously or in their completion)
// surface as the ticket's error without stalling anything else, renewals that fail keep the
// memory out of the pools (never handed out with old bytes), and several clients opening,
// working and closing concurrently on one engine never see each other's data or lose their own.
#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <thread>

#include "runtime_test_util.h"

namespace membar::runtimed {
namespace {

using membar::testing::check_pattern;
using membar::testing::eventually;
using membar::testing::fill_pattern;
using membar::testing::MappedClient;
using membar::testing::retrying;

// Forwards to a host backend, failing chosen enqueue_copies calls (1-based): `fail_enqueue_at`
// is refused at enqueue, `fail_completion_at` runs but reports INTERNAL in its completion; with
// `fail_gpu_renewals`, every GPU frame renewal reports INTERNAL (the memory is not replaced).
class FailingBackend final : public DeviceBackend {
 public:
  FailingBackend(std::unique_ptr<DeviceBackend> inner, int fail_enqueue_at, int fail_completion_at,
                 bool fail_gpu_renewals = false)
      : inner_(std::move(inner)),
        fail_enqueue_at_(fail_enqueue_at),
        fail_completion_at_(fail_completion_at),
        fail_gpu_renewals_(fail_gpu_renewals) {}
  std::string name() const override { return inner_->name(); }
  uint64_t frame_count(Tier tier) const override { return inner_->frame_count(tier); }
  uint32_t host_slab_frames() const override { return inner_->host_slab_frames(); }
  Result<int> export_gpu_frame(FrameIndex frame) override { return inner_->export_gpu_frame(frame); }
  Result<int> export_host_slab(uint32_t slab) override { return inner_->export_host_slab(slab); }
  Status renew(Tier tier, uint32_t index, std::function<void(Status)> done) override {
    if (tier == Tier::kGpu && fail_gpu_renewals_) {
      ++failed_renewals;
      // Completes from a backend thread, as the contract asks, without touching the memory.
      return inner_->enqueue_zero(Tier::kGpu, index, 0, 0, [done = std::move(done)](Status) {
        done(internal_error("injected renewal failure"));
      });
    }
    return inner_->renew(tier, index, std::move(done));
  }
  Status release_host_slab(uint32_t slab, std::function<void(Status)> done) override {
    return inner_->release_host_slab(slab, std::move(done));
  }
  void* frame_pointer(Tier tier, FrameIndex frame) override { return inner_->frame_pointer(tier, frame); }
  Status enqueue_copies(std::vector<CopyOp> ops, std::function<void(Status)> done,
                        const DeviceOrder& order) override {
    int call = ++calls_;
    if (call == fail_enqueue_at_) return internal_error("injected enqueue failure");
    if (call == fail_completion_at_) {
      return inner_->enqueue_copies(
          std::move(ops), [done = std::move(done)](Status) { done(internal_error("injected completion failure")); },
          order);
    }
    return inner_->enqueue_copies(std::move(ops), std::move(done), order);
  }
  Status enqueue_zero(Tier tier, FrameIndex frame, uint64_t offset, uint64_t bytes, std::function<void(Status)> done,
                      const DeviceOrder& order) override {
    return inner_->enqueue_zero(tier, frame, offset, bytes, std::move(done), order);
  }
  bool orders_on_device() const override { return inner_->orders_on_device(); }
  void drain() override { inner_->drain(); }
  Result<uint32_t> create_signal_block(uint32_t words) override { return inner_->create_signal_block(words); }
  Status destroy_signal_block(uint32_t block) override { return inner_->destroy_signal_block(block); }
  Result<int> export_signal_block(uint32_t block) override { return inner_->export_signal_block(block); }
  volatile uint64_t* signal_words(uint32_t block) override { return inner_->signal_words(block); }
  Status enqueue_signal(uint32_t block, uint32_t index, uint64_t value) override {
    return inner_->enqueue_signal(block, index, value);
  }
  BackendCounters counters() const override { return inner_->counters(); }

  std::atomic<int> failed_renewals{0};

 private:
  std::unique_ptr<DeviceBackend> inner_;
  std::atomic<int> calls_{0};
  int fail_enqueue_at_;
  int fail_completion_at_;
  bool fail_gpu_renewals_;
};

TEST(EngineFaults, FailedCopiesSurfaceInWaitAndNothingStalls) {
  BackendConfig backend_config;
  backend_config.gpu_pool_bytes = 4 * kFrameBytes;
  backend_config.host_pool_bytes = 8 * kFrameBytes;
  auto backend = std::make_unique<FailingBackend>(make_host_backend(backend_config).value(), 3, 6);
  auto engine = Engine::create(std::move(backend), {}).value();
  auto client = MappedClient::open(*engine);
  SpaceId space = client->space("s", 2 << 20, 2);
  client->acquire({space, 0, 2}, kEngineAcquireZeroNew | kEngineAcquireWrite);  // zero fills, no copies
  ASSERT_TRUE(engine->release(client->id, {space, 0, 2}, true).ok());
  std::vector<StatusCode> outcomes;
  for (int round = 0; round < 5; ++round) {
    // Each offload and each acquire issues one enqueue_copies call.
    auto offloaded = engine->offload(client->id, {space, 0, 2});
    ASSERT_TRUE(offloaded.ok());
    outcomes.push_back(engine->wait(client->id, offloaded.value()).code());
    auto acquired = engine->acquire(client->id, {space, 0, 2}, 0);
    ASSERT_TRUE(acquired.ok());
    Status waited = engine->wait(client->id, acquired.value());
    outcomes.push_back(waited.code());
    if (!waited.ok()) { EXPECT_NE(waited.message().find("injected"), std::string::npos) << waited.to_string(); }
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
  const uint64_t page_bytes = thread % 2 ? (96 << 10) * 5 : (1 << 20);  // 480 KiB pages straddle frames
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
          auto acquired = retrying([&] { return engine.acquire(client->id, {space, p, 1}, write ? kEngineAcquireWrite : 0); });
          if (!acquired.ok()) {
            ASSERT_EQ(acquired.status().code(), StatusCode::RESOURCE_EXHAUSTED) << acquired.status().to_string();
            ++exhausted;
            break;
          }
          ASSERT_TRUE(engine.wait(client->id, acquired.value()).ok());
          char* pointer = client->page(Tier::kGpu, space, p);
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
          auto offloaded = retrying([&] { return engine.offload(client->id, {space, p, 1}); });
          if (!offloaded.ok()) {
            ASSERT_EQ(offloaded.status().code(), StatusCode::RESOURCE_EXHAUSTED) << offloaded.status().to_string();
            ++exhausted;
          }
          break;
        }
        default: {
          auto prefetched = retrying([&] { return engine.prefetch(client->id, {space, p, 1}); });
          if (!prefetched.ok()) {
            ASSERT_EQ(prefetched.status().code(), StatusCode::RESOURCE_EXHAUSTED) << prefetched.status().to_string();
            ++exhausted;
          }
          break;
        }
      }
    }
    char* host = client->acquire_host({space, 0, pages});
    ASSERT_NE(host, nullptr);
    for (uint32_t q = 0; q < pages; ++q) {
      if (version[q] == 0) continue;
      ++checked;
      if (!check_pattern(host + uint64_t(q) * page_bytes, page_bytes, tag(q))) ++corrupted;
    }
    ASSERT_TRUE(engine.client_close(client->id).ok());  // with pages acquired for host access
  }
}

// Three clients of 3 GPU frames each share 8, so the pool may run dry (RESOURCE_EXHAUSTED is then
// an answer, not a failure: a client with no frame yet has nothing to evict), and every close hands
// frames to the next client. Each thread lives `lives` times; no page may come back corrupted.
void three_clients_coming_and_going(const runtimed::EngineConfig& config, int lives, uint64_t min_checked) {
  auto engine = membar::testing::make_engine(8, 64, config);
  std::atomic<uint64_t> corrupted{0}, checked{0}, exhausted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] { client_lives(*engine, t, lives, 150, corrupted, checked, exhausted); });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(corrupted.load(), 0u);
  EXPECT_GT(checked.load(), min_checked);
  EXPECT_TRUE(membar::testing::pools_settle(*engine, 8, 64));
  std::printf("checked %llu pages, corrupted %llu, exhausted answers %llu\n", (unsigned long long)checked.load(),
              (unsigned long long)corrupted.load(), (unsigned long long)exhausted.load());
}

TEST(EngineFaults, ClientsComingAndGoingKeepTheirOwnData) { three_clients_coming_and_going({}, 6, 500); }

// The same with copies ordered on the device (Note [Device-ordered copies]): a copy into a frame
// is enqueued behind the writeback it depends on, not after it completed; clients closing drain
// first.
TEST(EngineFaults, ClientsComingAndGoingKeepTheirOwnDataOrderedOnDevice) {
  runtimed::EngineConfig config;
  config.order_on_device = true;
  three_clients_coming_and_going(config, 4, 300);
}

// ... and with the batches handed over by the dispatcher thread (Note [Hand-over on the dispatcher]).
TEST(EngineFaults, ClientsComingAndGoingKeepTheirOwnDataHandedOverOnTheDispatcher) {
  runtimed::EngineConfig config;
  config.order_on_device = true;
  config.submit_on_dispatcher = true;
  three_clients_coming_and_going(config, 4, 300);
}

// Note [One host pool for a node] under load: two devices' engines share 40 host slabs, 8 backed by
// the first at start and 32 by the second; three clients live and die on the first device at once
// (up to 36 host frames between them) and one on the second (up to 3), so host memory moves between
// the engines while clients write, offload and read back. No page comes back corrupted, nothing
// deadlocks, and afterwards every slab of the node is free or unbacked capacity again.
TEST(EngineFaults, DevicesSharingOneHostPoolUnderLoadKeepEveryonesData) {
  auto share = std::make_shared<HostShare>(40);
  auto [first, second] = membar::testing::make_engines_sharing(share, 8, 8);
  std::atomic<uint64_t> corrupted{0}, checked{0}, exhausted{0};
  std::vector<std::thread> threads;
  for (int t : {0, 2, 4}) threads.emplace_back([&, t] { client_lives(*first, t, 3, 120, corrupted, checked, exhausted); });
  threads.emplace_back([&] { client_lives(*second, 1, 3, 120, corrupted, checked, exhausted); });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(corrupted.load(), 0u);
  EXPECT_GT(checked.load(), 200u);
  EXPECT_TRUE(eventually([&] {
    RuntimeStats a = first->stats(0).value();
    RuntimeStats b = second->stats(0).value();
    return a.tiers[0].frames_free == 8 && b.tiers[0].frames_free == 8 &&
           a.tiers[1].frames_free == a.tiers[1].frames_total && b.tiers[1].frames_free == b.tiers[1].frames_total &&
           a.tiers[1].frames_total + b.tiers[1].frames_total + share->left() == 40;
  }));
  EXPECT_GT(first->stats(0).value().tiers[1].frames_total, 8u);   // the first device took some of the second's
  std::printf("checked %llu pages, corrupted %llu, exhausted answers %llu\n", (unsigned long long)checked.load(),
              (unsigned long long)corrupted.load(), (unsigned long long)exhausted.load());
}

// A client writes two GPU frames of its own and closes: both go to renewal.
void write_two_frames_and_close(Engine& engine, uint64_t tag) {
  auto first = MappedClient::open(engine);
  SpaceId space = first->space("secret", 2 << 20, 2);
  char* pages = first->acquire({space, 0, 2}, kEngineAcquireWrite | kEngineAcquireZeroNew);
  ASSERT_NE(pages, nullptr);
  fill_pattern(pages, 4 << 20, tag);
  ASSERT_TRUE(engine.release(first->id, {space, 0, 2}, true).ok());
}

// A GPU frame whose renewal fails never returns to the pool: the next client is told the pool is
// short (RESOURCE_EXHAUSTED, after "retry" while the renewal ran), and never gets the old bytes.
TEST(EngineFaults, AFailedRenewalKeepsTheFrameOutOfThePool) {
  BackendConfig backend_config;
  backend_config.gpu_pool_bytes = 2 * kFrameBytes;
  backend_config.host_pool_bytes = 4 * kFrameBytes;
  backend_config.host_slab_frames = 1;
  auto failing = std::make_unique<FailingBackend>(make_host_backend(backend_config).value(), 0, 0, true);
  FailingBackend* backend = failing.get();
  EngineConfig config;
  std::mutex logged_mutex;
  std::vector<std::string> logged;
  config.log_error = [&](const std::string& message) {
    std::lock_guard<std::mutex> lock(logged_mutex);
    logged.push_back(message);
  };
  auto engine = Engine::create(std::move(failing), config).value();
  write_two_frames_and_close(*engine, 31);  // both frames go to renewal, which fails
  EXPECT_TRUE(eventually([&] { return backend->failed_renewals.load() == 2; }));
  auto next = MappedClient::open(*engine);
  SpaceId space = next->space("next", 2 << 20, 1);
  auto acquired = retrying([&] { return engine->acquire(next->id, {space, 0, 1}, 0); });
  ASSERT_FALSE(acquired.ok());
  EXPECT_EQ(acquired.status().code(), StatusCode::RESOURCE_EXHAUSTED) << acquired.status().to_string();
  EXPECT_EQ(next->gpu_grants.load(), 0);
  RuntimeStats stats = engine->stats(0).value();
  EXPECT_EQ(stats.tiers[0].frames_free, 0u);
  EXPECT_EQ(stats.tiers[0].frames_preparing, 0u);
  // Counted as lost, not as used by nobody, and said once per doubling (1, 2).
  EXPECT_EQ(stats.tiers[0].frames_lost, 2u);
  EXPECT_EQ(stats.tiers[0].frames_used, 0u);
  std::lock_guard<std::mutex> lock(logged_mutex);
  ASSERT_EQ(logged.size(), 2u);
  EXPECT_NE(logged[0].find("1 GPU frame lost so far"), std::string::npos) << logged[0];
  EXPECT_NE(logged[1].find("injected renewal failure"), std::string::npos) << logged[1];
}

// Note [Renewal when memory is short]: a renewal that finds memory short (as when a killed
// client's process still holds its old frames) is tried again until it succeeds; the frames come
// back to the pool holding zeros, and nothing is lost. Past the backend's patience they are lost,
// counted and logged, and the next client is told the pool is short.
TEST(EngineFaults, RenewalsWaitOutAShortageOfMemoryAndLoseNothing) {
  for (bool patient : {true, false}) {
    SCOPED_TRACE(patient ? "shortage shorter than the patience" : "shortage longer than the patience");
    BackendConfig backend_config;
    backend_config.gpu_pool_bytes = 2 * kFrameBytes;
    backend_config.host_pool_bytes = 2 * kFrameBytes;
    backend_config.host_slab_frames = 1;
    // Two frames renewed on two backend workers: 6 failed tries each take ~0.3 s of waits.
    backend_config.fail_renewal_attempts = patient ? 12 : 1u << 30;
    backend_config.renewal_patience_ms = patient ? 60000 : 30;
    std::atomic<int> logged{0};
    EngineConfig config;
    config.log_error = [&](const std::string&) { ++logged; };
    auto engine = Engine::create(make_host_backend(backend_config).value(), config).value();
    write_two_frames_and_close(*engine, 57);  // as a killed trainer: renewed while memory is short
    if (patient) {
      EXPECT_TRUE(eventually([&] { return engine->stats(0).value().tiers[0].frames_free == 2; },
                             std::chrono::seconds(20)));
      auto next = MappedClient::open(*engine);
      SpaceId space = next->space("next", 2 << 20, 2);
      char* pages = next->acquire({space, 0, 2}, kEngineAcquireWrite | kEngineAcquireZeroNew);
      ASSERT_NE(pages, nullptr);
      EXPECT_FALSE(check_pattern(pages, 2 << 20, 57));
      EXPECT_FALSE(check_pattern(pages + (2 << 20), 2 << 20, 57));
      RuntimeStats stats = engine->stats(0).value();
      EXPECT_EQ(stats.tiers[0].frames_lost, 0u);
      EXPECT_EQ(stats.tiers[1].frames_lost, 0u);
      EXPECT_EQ(logged.load(), 0);
    } else {
      EXPECT_TRUE(eventually([&] { return engine->stats(0).value().tiers[0].frames_lost == 2; },
                             std::chrono::seconds(20)));
      RuntimeStats stats = engine->stats(0).value();
      EXPECT_EQ(stats.tiers[0].frames_free, 0u);
      EXPECT_EQ(stats.tiers[0].frames_used, 0u);
      EXPECT_GT(logged.load(), 0);
      auto next = MappedClient::open(*engine);
      SpaceId space = next->space("next", 2 << 20, 1);
      auto acquired = retrying([&] { return engine->acquire(next->id, {space, 0, 1}, 0); });
      ASSERT_FALSE(acquired.ok());
      EXPECT_EQ(acquired.status().code(), StatusCode::RESOURCE_EXHAUSTED) << acquired.status().to_string();
    }
  }
}

// Note [No renewal at teardown]: an engine going away with a client still holding written frames
// and slabs does not renew them (here every renewal would fail for memory for a minute: a renewal
// at teardown would hold the destructor that long).
TEST(EngineFaults, AnEngineGoingAwayRenewsNothing) {
  BackendConfig backend_config;
  backend_config.gpu_pool_bytes = 2 * kFrameBytes;
  backend_config.host_pool_bytes = 2 * kFrameBytes;
  backend_config.host_slab_frames = 1;
  backend_config.fail_renewal_attempts = 1u << 30;
  backend_config.renewal_patience_ms = 60000;
  auto engine = Engine::create(make_host_backend(backend_config).value(), EngineConfig{}).value();
  auto client = MappedClient::open(*engine);
  SpaceId space = client->space("pages", 2 << 20, 4);   // 4 frames: 2 on the GPU tier, 2 in host slabs
  char* pages = client->acquire({space, 0, 2}, kEngineAcquireWrite | kEngineAcquireZeroNew);
  ASSERT_NE(pages, nullptr);
  fill_pattern(pages, 4 << 20, 58);
  ASSERT_TRUE(engine->release(client->id, {space, 0, 2}, true).ok());
  pages = client->acquire({space, 2, 2}, kEngineAcquireWrite | kEngineAcquireZeroNew);   // evicts 0-1 to host
  ASSERT_NE(pages, nullptr);
  ASSERT_TRUE(engine->release(client->id, {space, 2, 2}, true).ok());
  EXPECT_GT(engine->stats(0).value().tiers[1].frames_used, 0u);
  const auto started = std::chrono::steady_clock::now();
  engine.reset();   // closes the client
  client->engine = nullptr;
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(10));
}

}  // namespace
}  // namespace membar::runtimed
