// Where host pools live on machines with several NUMA nodes (sockets): a GPU copies to and from
// pinned host memory over its own socket's PCIe root fastest, so a device's host pool belongs on
// the NUMA node nearest that GPU (Note [Host pools near their GPU] in engine/numa.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "membar/status.h"

namespace membar::runtimed::numa {

// BackendConfig::host_numa_node values besides a node number.
inline constexpr int kNoPlacement = -1;   // wherever the kernel puts the pages
inline constexpr int kNearestDevice = -2; // the node nearest the device (CUDA), else no placement

// The NUMA nodes this machine has online (from /sys/devices/system/node/online); {0} when the
// kernel does not say (no NUMA support).
std::vector<int> online_nodes();
// "0-1", "0,2": the list as a short text, for messages.
std::string describe(const std::vector<int>& nodes);

// Faults in [address, address + bytes) of a fresh, not yet touched shared mapping, first binding
// it to `node` (MPOL_PREFERRED: the pages come from that node while it has free memory) unless
// node is kNoPlacement. `address` and `bytes` are page-aligned.
Status place(void* address, uint64_t bytes, int node);

// Whether this kernel places memory by node (mbind); `why` gets the reason when it does not.
bool available(std::string* why);
// INVALID_ARGUMENT naming the online nodes when `node` is not one of them.
Status check_node(int node);

// The node a host pool goes on, from BackendConfig::host_numa_node: `nearest` is the node nearest
// the device (-1 when unknown or there is no GPU). -1 means no placement, and `note` then says why
// when placement was asked for or could have been chosen. INVALID_ARGUMENT for a node not online.
Result<int> resolve_node(int requested, int nearest, std::string* note);

// The node holding the (faulted-in) page at `address`, for checks and tests.
Result<int> node_of(const void* address);

}  // namespace membar::runtimed::numa
