// Host pools on a NUMA node (Note [Host pools near their GPU] in engine/numa.cpp): the node is
// resolved from what was asked, a node not online is a clear error, and a host slab's pages land
// on the node asked for. CI machines have one node; the last online node is used where there are
// more.
#include <sys/mman.h>
#include <unistd.h>

#include <condition_variable>
#include <mutex>

#include "membar/engine/numa.h"
#include "runtime_test_util.h"

namespace membar::runtimed {
namespace {

TEST(Numa, OnlineNodesAreReadAndDescribed) {
  std::vector<int> nodes = numa::online_nodes();
  ASSERT_FALSE(nodes.empty());
  EXPECT_EQ(nodes.front(), 0);
  EXPECT_EQ(numa::describe({0}), "0");
  EXPECT_EQ(numa::describe({0, 1, 2, 4}), "0-2,4");
}

TEST(Numa, WhatWasAskedResolvesToANodeOrNone) {
  std::string note;
  EXPECT_EQ(numa::resolve_node(numa::kNoPlacement, 0, &note).value(), numa::kNoPlacement);
  // One node online: nothing to choose, nothing to say.
  if (numa::online_nodes().size() == 1) {
    EXPECT_EQ(numa::resolve_node(numa::kNearestDevice, 0, &note).value(), numa::kNoPlacement);
    EXPECT_EQ(note, "");
  }
  auto missing = numa::resolve_node(1000, -1, &note);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(missing.status().message().find("NUMA node 1000 is not online on this machine (nodes " +
                                            numa::describe(numa::online_nodes()) + ")"),
            std::string::npos)
      << missing.status().to_string();
  EXPECT_EQ(numa::resolve_node(-7, -1, &note).status().code(), StatusCode::INVALID_ARGUMENT);
}

TEST(Numa, PlacedMemoryLandsOnTheNodeAskedFor) {
  std::string why;
  if (!numa::available(&why)) GTEST_SKIP() << "no NUMA placement here: " << why;
  const int node = numa::online_nodes().back();
  const uint64_t bytes = 4ull << 20;
  int fd = ::memfd_create("numa-test", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, bytes), 0);
  void* at = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(at, MAP_FAILED);
  ASSERT_TRUE(numa::place(at, bytes, node).ok());
  for (uint64_t offset : {uint64_t{0}, bytes / 2, bytes - 4096}) {
    auto where = numa::node_of(static_cast<char*>(at) + offset);
    ASSERT_TRUE(where.ok()) << where.status().to_string();
    EXPECT_EQ(where.value(), node) << "page at offset " << offset;
  }
  EXPECT_EQ(static_cast<char*>(at)[bytes - 1], 0) << "fresh memory reads zero after being faulted in";
  ::munmap(at, bytes);
  ::close(fd);
}

// The host backend places every slab it renews on the node it was given.
TEST(Numa, TheHostBackendPutsItsSlabsOnItsNode) {
  std::string why;
  if (!numa::available(&why)) GTEST_SKIP() << "no NUMA placement here: " << why;
  const int node = numa::online_nodes().back();
  BackendConfig config;
  config.gpu_pool_bytes = 2 * kFrameBytes;
  config.host_pool_bytes = 4 * kFrameBytes;
  config.host_slab_frames = 2;
  config.host_numa_node = node;
  auto made = make_host_backend(config);
  ASSERT_TRUE(made.ok()) << made.status().to_string();
  DeviceBackend& backend = *made.value();
  EXPECT_EQ(backend.host_numa_node(), node);
  std::mutex mutex;
  std::condition_variable cv;
  int done = 0;
  for (uint32_t slab = 0; slab < backend.host_slab_count(); ++slab) {
    ASSERT_TRUE(backend.renew(Tier::kHost, slab, [&](Status status) {
      EXPECT_TRUE(status.ok()) << status.to_string();
      std::lock_guard<std::mutex> lock(mutex);
      ++done;
      cv.notify_all();
    }).ok());
  }
  std::unique_lock<std::mutex> lock(mutex);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return done == int(backend.host_slab_count()); }));
  for (FrameIndex frame = 0; frame < backend.frame_count(Tier::kHost); ++frame) {
    auto where = numa::node_of(backend.frame_pointer(Tier::kHost, frame));
    ASSERT_TRUE(where.ok()) << where.status().to_string();
    EXPECT_EQ(where.value(), node) << "host frame " << frame;
  }
  // Without a node the pool is left to the kernel, and asking for a node that is not online fails.
  config.host_numa_node = numa::kNearestDevice;
  EXPECT_EQ(make_host_backend(config).value()->host_numa_node(), numa::kNoPlacement) << "no GPU to be near";
  config.host_numa_node = 1000;
  EXPECT_EQ(make_host_backend(config).status().code(), StatusCode::INVALID_ARGUMENT);
}

}  // namespace
}  // namespace membar::runtimed
