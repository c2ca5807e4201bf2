// Helpers for tests that reach the runtime through the client API only (libclient, a real
// membard): what a client's stats say about one of its spaces.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>

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

}  // namespace membar::testing
