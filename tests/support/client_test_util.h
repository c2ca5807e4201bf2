// Helpers for tests that reach the runtime through the client API only (libclient, a real
// membard): what a client's stats say about one of its spaces.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "membar/client.h"

namespace membar::testing {

// GPU-resident bytes of one of the client's spaces (GPU only or both tiers), from its stats.
inline uint64_t gpu_resident_bytes(Client& client, SpaceId space) {
  auto stats = client.stats();
  EXPECT_TRUE(stats.ok()) << stats.status().to_string();
  if (!stats.ok()) return ~0ull;
  for (const SpaceInfo& info : stats.value().spaces) {
    if (info.id == space) return info.bytes_gpu + info.bytes_both;
  }
  ADD_FAILURE() << "no stats for space " << space;
  return ~0ull;
}

// Whether `actual` holds `expected` byte for byte; otherwise where the first difference is.
inline ::testing::AssertionResult same_bytes(const void* actual, const std::vector<uint8_t>& expected, uint64_t page_bytes) {
  const auto* bytes = static_cast<const uint8_t*>(actual);
  if (std::memcmp(bytes, expected.data(), expected.size()) == 0) return ::testing::AssertionSuccess();
  uint64_t first = 0;
  while (bytes[first] == expected[first]) ++first;
  return ::testing::AssertionFailure() << "the first difference is at byte " << first << " (page " << first / page_bytes
                                       << " + " << first % page_bytes << "): expected " << int(expected[first])
                                       << ", got " << int(bytes[first]);
}

}  // namespace membar::testing
