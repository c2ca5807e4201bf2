// The CUDA backend's copy planning (merge adjacent page copies, split at host frame
// boundaries), on plain memory: runs on any machine (label unit).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "membar/engine/copy_plan.h"

namespace membar::runtimed {
namespace {

constexpr uint64_t kUnit = 4096;  // stands in for a 2 MiB frame
constexpr uint64_t kUnits = 16;

// For every source byte, the destination offset it goes to (-1: not copied).
std::vector<int64_t> byte_map(const std::vector<Transfer>& transfers, const char* source, const char* destination) {
  std::vector<int64_t> map(kUnit * kUnits, -1);
  for (const Transfer& transfer : transfers) {
    for (uint64_t i = 0; i < transfer.bytes; ++i) {
      int64_t& slot = map[transfer.source - source + i];
      EXPECT_EQ(slot, -1) << "a source byte copied twice";
      slot = transfer.destination - destination + static_cast<int64_t>(i);
    }
  }
  return map;
}

// Pages of `page` bytes from source to destination; destinations shuffled in runs of `run` pages.
std::vector<Transfer> page_copies(char* source, char* destination, uint64_t page, uint64_t run, std::mt19937_64& generator) {
  uint64_t pages = kUnit * kUnits / page;
  std::vector<uint64_t> runs(pages / run);
  std::iota(runs.begin(), runs.end(), 0);
  std::shuffle(runs.begin(), runs.end(), generator);
  std::vector<Transfer> transfers;
  for (uint64_t p = 0; p < pages; ++p) {
    uint64_t target = runs[p / run] * run + p % run;
    transfers.push_back(Transfer{source + p * page, destination + target * page, page});
  }
  std::shuffle(transfers.begin(), transfers.end(), generator);  // the engine's order is arbitrary
  return transfers;
}

TEST(CopyPlan, MergeKeepsEveryByteAndJoinsEveryContinuingRun) {
  std::vector<char> source(kUnit * kUnits), destination(kUnit * kUnits);
  std::mt19937_64 generator(std::random_device{}());
  for (uint64_t page : {256ull, 1024ull, 4096ull}) {
    for (uint64_t run : {1ull, 4ull, 16ull}) {
      std::vector<Transfer> transfers = page_copies(source.data(), destination.data(), page, run, generator);
      std::vector<int64_t> before = byte_map(transfers, source.data(), destination.data());
      copy_plan_merge(transfers);
      EXPECT_EQ(byte_map(transfers, source.data(), destination.data()), before);
      for (size_t i = 0; i + 1 < transfers.size(); ++i) {
        bool joinable = transfers[i].source + transfers[i].bytes == transfers[i + 1].source &&
                        transfers[i].destination + transfers[i].bytes == transfers[i + 1].destination;
        EXPECT_FALSE(joinable) << "two transfers left unmerged";
      }
      // Runs of `run` pages stay together, so there are at most as many transfers as runs.
      EXPECT_LE(transfers.size(), kUnit * kUnits / page / run);
    }
  }
  // Identity: one transfer.
  std::vector<Transfer> identity = page_copies(source.data(), destination.data(), 1024, kUnit * kUnits / 1024, generator);
  copy_plan_merge(identity);
  ASSERT_EQ(identity.size(), 1u);
  EXPECT_EQ(identity[0].bytes, kUnit * kUnits);
}

TEST(CopyPlan, SplitStopsAtEveryBoundaryOfTheRegion) {
  // The destination side sits half a page off its buffer's start, so the two sides'
  // boundaries never line up and merged runs cross the host's frame boundaries.
  std::vector<char> host(kUnit * kUnits + 512), device(kUnit * kUnits + 512);
  std::mt19937_64 generator(std::random_device{}());
  for (bool host_is_source : {true, false}) {
    char* source = host_is_source ? host.data() : device.data();
    char* destination = (host_is_source ? device.data() : host.data()) + 512;
    std::vector<Transfer> transfers = page_copies(source, destination, 1024, 4, generator);
    std::vector<int64_t> before = byte_map(transfers, source, destination);
    copy_plan_merge(transfers);
    size_t merged = transfers.size();
    copy_plan_split(transfers, host.data(), host.data() + kUnit * kUnits, kUnit);
    EXPECT_EQ(byte_map(transfers, source, destination), before);
    if (!host_is_source) {
      EXPECT_GT(transfers.size(), merged) << "offset runs must have been cut";
    }
    for (const Transfer& transfer : transfers) {
      const char* host_side = host_is_source ? transfer.source : transfer.destination;
      uint64_t first_unit = (host_side - host.data()) / kUnit;
      uint64_t last_unit = (host_side + transfer.bytes - 1 - host.data()) / kUnit;
      EXPECT_EQ(first_unit, last_unit) << "a transfer crosses a host frame boundary";
    }
  }
  // A region that neither side touches changes nothing.
  std::vector<char> elsewhere(kUnit);
  std::vector<Transfer> one = {Transfer{host.data() + 100, device.data() + 100, 3 * kUnit}};
  copy_plan_split(one, elsewhere.data(), elsewhere.data() + elsewhere.size(), kUnit);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].bytes, 3 * kUnit);
}

}  // namespace
}  // namespace membar::runtimed
