// Note [Eviction order] checked against references: on random reference strings, the engine's
// misses equal the offline optimum found by exhaustive search, and every eviction takes a page
// whose next use is the farthest (MIN; among ties the engine may prefer the frame already mapped
// at the position, Note [Remapping a position]). Without a schedule, its resident sets equal an
// LRU simulation that reuses the frame mapped at a position whenever the client must evict.
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

// LRU as the engine runs it without a schedule (Note [Remapping a position]): each page has its
// own position; a miss first takes a new frame while under the quota, else the frame last mapped
// at the page's position (its occupant goes: every "never" ties), else the least recently used
// page's frame, which is then mapped there.
std::vector<std::set<int>> simulate_lru_with_mappings(const std::vector<int>& refs, int capacity, int* misses) {
  std::map<int, int> frame_of_page;     // resident page -> frame
  std::map<int, int> page_in_frame;     // frame -> resident page
  std::map<int, int> mapped_at;         // page (position) -> frame last mapped there
  std::map<int, size_t> last_use;
  std::vector<std::set<int>> history;
  int frames = 0;
  *misses = 0;
  for (size_t i = 0; i < refs.size(); ++i) {
    int page = refs[i];
    if (!frame_of_page.count(page)) {
      ++*misses;
      int frame = -1;
      if (frames < capacity) {
        frame = frames++;
      } else {
        auto mapped = mapped_at.find(page);
        if (mapped != mapped_at.end()) {
          frame = mapped->second;
        } else {
          int victim = -1;
          for (auto [candidate, f] : frame_of_page) {
            if (victim < 0 || last_use[candidate] < last_use[victim]) victim = candidate;
          }
          frame = frame_of_page[victim];
        }
        frame_of_page.erase(page_in_frame[frame]);
      }
      frame_of_page[page] = frame;
      page_in_frame[frame] = page;
      mapped_at[page] = frame;
    }
    last_use[page] = i;
    std::set<int> resident;
    for (auto [p, f] : frame_of_page) resident.insert(p);
    history.push_back(resident);
  }
  return history;
}

// Step at which `page` is next used at or after step `from` (SIZE_MAX: never).
size_t next_use(const std::vector<int>& refs, int page, size_t from) {
  for (size_t j = from; j < refs.size(); ++j) {
    if (refs[j] == page) return j;
  }
  return SIZE_MAX;
}

// Runs `refs` through the engine (one acquire per step, pages filled on the host beforehand so
// every GPU miss is a host->GPU copy), checking contents, and returns the resident sets. Each page
// is a space of its own (one 2 MiB space frame), so the stats' per-space residency says which
// pages are on the GPU.
// jump: before advance(i), go back to step 0 first, so that advance(i) jumps over i steps (the
// engine then re-keys every resident frame instead of the passed steps' frames once those name more).
std::vector<std::set<int>> run_engine(const std::vector<int>& refs, int pages, int capacity, bool with_schedule,
                                      uint64_t* misses, uint64_t seed, bool jump = false) {
  EngineConfig config;
  config.prefetch_lookahead_steps = 0;  // eviction only: acquire decides every load
  auto engine = make_engine(capacity + 2, pages + 1, config);
  ClientConfig client_config;
  client_config.gpu_quota_bytes = uint64_t(capacity) * kFrameBytes;
  auto client = MappedClient::open(*engine, client_config);
  std::vector<SpaceId> spaces(pages);
  for (int p = 0; p < pages; ++p) {
    spaces[p] = client->space("page" + std::to_string(p), kPage, 1);
    char* host = client->acquire_host({spaces[p], 0, 1});
    EXPECT_NE(host, nullptr);
    if (host == nullptr) return {};
    fill_pattern(host, 4096, seed + p);
    EXPECT_TRUE(engine->release_host(client->id, {spaces[p], 0, 1}, true).ok());
  }
  if (with_schedule) {
    std::vector<ScheduleStep> steps;
    for (int page : refs) steps.push_back(ScheduleStep{{PageRange{spaces[page], 0, 1}}});
    EXPECT_TRUE(engine->set_schedule(client->id, steps).ok());
  }
  std::vector<std::set<int>> history;
  for (size_t i = 0; i < refs.size(); ++i) {
    PageRange range{spaces[refs[i]], 0, 1};
    if (with_schedule && jump) { EXPECT_TRUE(engine->advance(client->id, 0).ok()); }
    if (with_schedule) { EXPECT_TRUE(engine->advance(client->id, uint32_t(i)).ok()); }
    char* page = client->acquire(range, 0);
    EXPECT_TRUE(page != nullptr && check_pattern(page, 4096, seed + refs[i])) << "step " << i;
    EXPECT_TRUE(engine->release(client->id, range, false).ok());
    RuntimeStats stats = engine->stats(client->id).value();
    std::set<int> resident;
    for (int p = 0; p < pages; ++p) {
      for (const SpaceInfo& info : stats.spaces) {
        if (info.id == spaces[p] && info.bytes_gpu + info.bytes_both != 0) resident.insert(p);
      }
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
    (void)simulate(refs, capacity, /*with_schedule=*/true, &expected_misses);
    uint64_t misses = 0;
    auto actual = run_engine(refs, pages, capacity, /*with_schedule=*/true, &misses, 1000 * trial);
    ASSERT_EQ(actual.size(), refs.size());
    // Every eviction took a page used farthest ahead (or never again).
    std::set<int> before;
    for (size_t i = 0; i < refs.size(); ++i) {
      ASSERT_TRUE(actual[i].count(refs[i])) << "trial " << trial << " step " << i;
      for (int evicted : before) {
        if (actual[i].count(evicted)) continue;
        size_t farthest = 0;
        for (int candidate : before) farthest = std::max(farthest, next_use(refs, candidate, i));
        EXPECT_EQ(next_use(refs, evicted, i), farthest)
            << "trial " << trial << " step " << i << ": evicted page " << evicted << " is needed sooner than another";
      }
      before = actual[i];
    }
    EXPECT_EQ(int(misses), expected_misses) << "trial " << trial;
    EXPECT_EQ(int(misses), optimal_misses(refs, capacity)) << "trial " << trial;
  }
}

// advance() over many steps re-keys every resident frame rather than the passed steps' frames
// when that is less work: the choices are the same as advancing one step at a time.
TEST(Eviction, JumpingAheadMakesTheSameChoicesAsSteppingThrough) {
  std::mt19937 random(777);
  for (int trial = 0; trial < 30; ++trial) {
    int pages = 3 + int(random() % 5);
    int capacity = 1 + int(random() % 3);
    int length = 8 + int(random() % 12);
    std::vector<int> refs(length);
    for (int& r : refs) r = int(random() % pages);
    uint64_t stepped_misses = 0, jumped_misses = 0;
    auto stepped = run_engine(refs, pages, capacity, true, &stepped_misses, 50 * trial);
    auto jumped = run_engine(refs, pages, capacity, true, &jumped_misses, 50 * trial, /*jump=*/true);
    EXPECT_EQ(stepped, jumped) << "trial " << trial;
    EXPECT_EQ(stepped_misses, jumped_misses) << "trial " << trial;
  }
}

TEST(Eviction, WithoutAScheduleItIsLeastRecentlyUsed) {
  std::mt19937 random(777);
  int mapped_reuses = 0;
  for (int trial = 0; trial < 20; ++trial) {
    int pages = 4 + int(random() % 4);
    int capacity = 2 + int(random() % 2);
    std::vector<int> refs(16);
    for (int& r : refs) r = int(random() % pages);
    int expected_misses = 0;
    auto expected = simulate_lru_with_mappings(refs, capacity, &expected_misses);
    int plain_misses = 0;
    auto plain = simulate(refs, capacity, /*with_schedule=*/false, &plain_misses);
    uint64_t misses = 0;
    auto actual = run_engine(refs, pages, capacity, /*with_schedule=*/false, &misses, 5000 + trial);
    for (size_t i = 0; i < refs.size(); ++i) {
      ASSERT_EQ(actual[i], expected[i]) << "trial " << trial << " step " << i;
      if (expected[i] != plain[i]) ++mapped_reuses;
    }
    EXPECT_EQ(int(misses), expected_misses);
    // Belady is never worse than LRU.
    EXPECT_GE(expected_misses, optimal_misses(refs, capacity));
  }
  std::printf("steps where reusing a mapping differed from plain LRU: %d\n", mapped_reuses);
}

// Three one-frame pages on the host (page p holding pattern `pattern` + p), a client of two GPU
// frames, and the schedule `refs` (one page a step).
struct TwoFrameSchedule {
  std::unique_ptr<Engine> engine;
  std::unique_ptr<MappedClient> client;
  SpaceId space = 0;
};

TwoFrameSchedule two_frames_scheduled(const EngineConfig& config, const std::vector<int>& refs, int pattern) {
  TwoFrameSchedule run;
  run.engine = make_engine(4, 8, config);
  ClientConfig client_config;
  client_config.gpu_quota_bytes = 2 * kFrameBytes;
  run.client = MappedClient::open(*run.engine, client_config);
  run.space = run.client->space("s", kPage, 3);
  char* host = run.client->acquire_host({run.space, 0, 3});
  EXPECT_NE(host, nullptr);
  for (int p = 0; p < 3 && host != nullptr; ++p) fill_pattern(host + p * kPage, kPage, pattern + p);
  EXPECT_TRUE(run.engine->release_host(run.client->id, {run.space, 0, 3}, true).ok());
  std::vector<ScheduleStep> steps;
  for (int page : refs) steps.push_back(ScheduleStep{{PageRange{run.space, uint32_t(page), 1}}});
  EXPECT_TRUE(run.engine->set_schedule(run.client->id, steps).ok());
  return run;
}

TEST(Eviction, LookaheadNeverDisplacesAPageNeededSooner) {
  // Capacity 2, schedule A B C A B C. At advance(1), evicting A (next use 3) for C (needed at 2)
  // would displace nothing needed sooner, yet MIN evicts B (next use 4) once step 1 has run:
  // lookahead must wait for that and load no more than MIN's four pages.
  EngineConfig config;
  config.prefetch_lookahead_steps = 4;
  std::vector<int> refs = {0, 1, 2, 0, 1, 2};
  auto [engine, client, space] = two_frames_scheduled(config, refs, 40);
  for (size_t i = 0; i < refs.size(); ++i) {
    ASSERT_TRUE(engine->advance(client->id, uint32_t(i)).ok());
    // The page of the current step is resident (prefetched) before acquire asks for it.
    uint64_t misses_before = client->stats().prefetch_misses;
    char* page = client->acquire({space, uint32_t(refs[i]), 1}, 0);
    ASSERT_NE(page, nullptr);
    EXPECT_EQ(client->stats().prefetch_misses, misses_before) << "step " << i;
    EXPECT_TRUE(check_pattern(page, kPage, 40 + refs[i]));
    ASSERT_TRUE(engine->release(client->id, {space, uint32_t(refs[i]), 1}, false).ok());
  }
  auto stats = client->stats();
  EXPECT_EQ(stats.prefetch_misses, 0u);
  // Belady with capacity 2 on this string needs 4 loads; lookahead must not add more.
  EXPECT_EQ(stats.bytes_host_to_gpu, uint64_t(optimal_misses(refs, 2)) * kPage);
}

}  // namespace
}  // namespace membar::runtimed
