// Note [Eviction order] checked against references: on random reference strings, the engine's
// misses equal the offline optimum found by exhaustive search, and its resident set after every
// step equals a plain Belady (farthest next use, then least recently used) simulation. Without
// a schedule, it equals an LRU simulation.
#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "runtime_test_util.h"

namespace membar::runtimed {
namespace {

using membar::testing::check_pattern;
using membar::testing::fill_pattern;
using membar::testing::make_engine;
using membar::testing::MappedClient;

constexpr uint64_t kPage = 2 << 20;  // one page per frame: the quota in frames is the cache size

// Fewest misses any replacement policy can have on `refs` with `capacity` pages (exhaustive
// search over every victim choice, memoised on (position, resident set)).
int optimal_misses(const std::vector<int>& refs, int capacity) {
  std::map<std::pair<size_t, uint32_t>, int> memo;
  std::function<int(size_t, uint32_t)> best = [&](size_t i, uint32_t resident) -> int {
    if (i == refs.size()) return 0;
    auto key = std::make_pair(i, resident);
    auto it = memo.find(key);
    if (it != memo.end()) return it->second;
    uint32_t bit = 1u << refs[i];
    int answer;
    if (resident & bit) {
      answer = best(i + 1, resident);
    } else if (__builtin_popcount(resident) < capacity) {
      answer = 1 + best(i + 1, resident | bit);
    } else {
      answer = INT32_MAX;
      for (int v = 0; v < 32; ++v) {
        if (resident & (1u << v)) answer = std::min(answer, 1 + best(i + 1, (resident & ~(1u << v)) | bit));
      }
    }
    memo[key] = answer;
    return answer;
  };
  return best(0, 0);
}

// Resident sets after each step under Belady (with_schedule) or LRU, ties by least recent use.
std::vector<std::set<int>> simulate(const std::vector<int>& refs, int capacity, bool with_schedule, int* misses) {
  std::set<int> resident;
  std::map<int, size_t> last_use;
  std::vector<std::set<int>> history;
  *misses = 0;
  for (size_t i = 0; i < refs.size(); ++i) {
    int page = refs[i];
    if (!resident.count(page)) {
      ++*misses;
      if (int(resident.size()) == capacity) {
        int victim = -1;
        size_t victim_next = 0, victim_last = 0;
        for (int candidate : resident) {
          size_t next = SIZE_MAX;
          if (with_schedule) {
            for (size_t j = i; j < refs.size(); ++j) {
              if (refs[j] == candidate) {
                next = j;
                break;
              }
            }
          }
          size_t last = last_use[candidate];
          if (victim < 0 || next > victim_next || (next == victim_next && last < victim_last)) {
            victim = candidate;
            victim_next = next;
            victim_last = last;
          }
        }
        resident.erase(victim);
      }
      resident.insert(page);
    }
    last_use[page] = i;
    history.push_back(resident);
  }
  return history;
}

// Runs `refs` through the engine (one acquire per step, pages filled on the host beforehand so
// every GPU miss is a host->GPU copy), checking contents, and returns the resident sets.
std::vector<std::set<int>> run_engine(const std::vector<int>& refs, int pages, int capacity, bool with_schedule,
                                      uint64_t* misses, uint64_t seed) {
  EngineConfig config;
  config.prefetch_lookahead_steps = 0;  // eviction only: acquire decides every load
  auto engine = make_engine(capacity + 2, pages + 1, config);
  ClientConfig client_config;
  client_config.gpu_quota_bytes = uint64_t(capacity) * kFrameBytes;
  auto client = MappedClient::open(*engine, client_config);
  SpaceId space = client->space("s", kPage, pages);
  auto host = client->acquire_host({space, 0, uint32_t(pages)});
  for (int p = 0; p < pages; ++p) fill_pattern(host[p], kPage, seed + p);
  EXPECT_TRUE(engine->release_host(client->id, {space, 0, uint32_t(pages)}, true).ok());
  if (with_schedule) {
    std::vector<ScheduleStep> steps;
    for (int page : refs) steps.push_back(ScheduleStep{{PageRange{space, uint32_t(page), 1}}});
    EXPECT_TRUE(engine->set_schedule(client->id, steps).ok());
  }
  std::vector<std::set<int>> history;
  for (size_t i = 0; i < refs.size(); ++i) {
    if (with_schedule) EXPECT_TRUE(engine->advance(client->id, uint32_t(i)).ok());
    auto pointers = client->acquire({space, uint32_t(refs[i]), 1}, 0);
    EXPECT_TRUE(!pointers.empty() && check_pattern(pointers[0], 4096, seed + refs[i])) << "step " << i;
    EXPECT_TRUE(engine->release(client->id, {space, uint32_t(refs[i]), 1}, false).ok());
    auto locations = engine->locations(client->id, {space, 0, uint32_t(pages)}).value();
    std::set<int> resident;
    for (int p = 0; p < pages; ++p) {
      if (locations[p].window_frame != kNoFrame) resident.insert(p);
    }
    history.push_back(resident);
  }
  *misses = client->stats().prefetch_misses;
  return history;
}

TEST(Eviction, BeladyMatchesTheOptimumOnRandomSchedules) {
  std::mt19937 random(12345);
  for (int trial = 0; trial < 40; ++trial) {
    int pages = 3 + int(random() % 5);     // 3..7
    int capacity = 1 + int(random() % 3);  // 1..3
    int length = 8 + int(random() % 12);   // 8..19
    std::vector<int> refs(length);
    for (int& r : refs) r = int(random() % pages);
    int expected_misses = 0;
    auto expected = simulate(refs, capacity, /*with_schedule=*/true, &expected_misses);
    uint64_t misses = 0;
    auto actual = run_engine(refs, pages, capacity, /*with_schedule=*/true, &misses, 1000 * trial);
    ASSERT_EQ(actual.size(), expected.size());
    for (size_t i = 0; i < refs.size(); ++i) {
      ASSERT_EQ(actual[i], expected[i]) << "trial " << trial << " step " << i;
    }
    EXPECT_EQ(int(misses), expected_misses);
    EXPECT_EQ(int(misses), optimal_misses(refs, capacity)) << "trial " << trial;
  }
}

TEST(Eviction, WithoutAScheduleItIsLeastRecentlyUsed) {
  std::mt19937 random(777);
  for (int trial = 0; trial < 20; ++trial) {
    int pages = 4 + int(random() % 4);
    int capacity = 2 + int(random() % 2);
    std::vector<int> refs(16);
    for (int& r : refs) r = int(random() % pages);
    int expected_misses = 0;
    auto expected = simulate(refs, capacity, /*with_schedule=*/false, &expected_misses);
    uint64_t misses = 0;
    auto actual = run_engine(refs, pages, capacity, /*with_schedule=*/false, &misses, 5000 + trial);
    for (size_t i = 0; i < refs.size(); ++i) ASSERT_EQ(actual[i], expected[i]) << "trial " << trial << " step " << i;
    EXPECT_EQ(int(misses), expected_misses);
    // Belady is never worse than LRU; on these strings it is usually strictly better.
    EXPECT_GE(expected_misses, optimal_misses(refs, capacity));
  }
}

TEST(Eviction, LookaheadNeverDisplacesAPageNeededSooner) {
  // Capacity 2, schedule A B C A B C. At advance(1), evicting A (next use 3) for C (needed at 2)
  // would displace nothing needed sooner, yet MIN evicts B (next use 4) once step 1 has run:
  // lookahead must wait for that and load no more than MIN's four pages.
  EngineConfig config;
  config.prefetch_lookahead_steps = 4;
  auto engine = make_engine(4, 8, config);
  ClientConfig client_config;
  client_config.gpu_quota_bytes = 2 * kFrameBytes;
  auto client = MappedClient::open(*engine, client_config);
  SpaceId space = client->space("s", kPage, 3);
  auto host = client->acquire_host({space, 0, 3});
  for (int p = 0; p < 3; ++p) fill_pattern(host[p], kPage, 40 + p);
  ASSERT_TRUE(engine->release_host(client->id, {space, 0, 3}, true).ok());
  std::vector<int> refs = {0, 1, 2, 0, 1, 2};
  std::vector<ScheduleStep> steps;
  for (int page : refs) steps.push_back(ScheduleStep{{PageRange{space, uint32_t(page), 1}}});
  ASSERT_TRUE(engine->set_schedule(client->id, steps).ok());
  for (size_t i = 0; i < refs.size(); ++i) {
    ASSERT_TRUE(engine->advance(client->id, uint32_t(i)).ok());
    // The page of the current step is resident (prefetched) before acquire asks for it.
    auto locations = engine->locations(client->id, {space, uint32_t(refs[i]), 1}).value();
    EXPECT_NE(locations[0].window_frame, kNoFrame) << "step " << i;
    auto pointers = client->acquire({space, uint32_t(refs[i]), 1}, 0);
    EXPECT_TRUE(check_pattern(pointers[0], kPage, 40 + refs[i]));
    ASSERT_TRUE(engine->release(client->id, {space, uint32_t(refs[i]), 1}, false).ok());
  }
  auto stats = client->stats();
  EXPECT_EQ(stats.prefetch_misses, 0u);
  // Belady with capacity 2 on this string needs 4 loads; lookahead must not add more.
  EXPECT_EQ(stats.bytes_host_to_gpu, uint64_t(optimal_misses(refs, 2)) * kPage);
}

}  // namespace
}  // namespace membar::runtimed
