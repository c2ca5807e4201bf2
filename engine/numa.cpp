// Note [Host pools near their GPU]
// Rationale: on a machine with several sockets, pinned host memory on the far socket reaches a
// GPU through the inter-socket link: copies run slower and load the link that the other socket's
// GPUs use too. membard serves every GPU of a node (Note [Devices of one daemon]), each with its own
// host pool, so each pool can live on its GPU's socket.
// Approach: the CUDA backend asks the driver for the host NUMA node nearest its device
// (CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID) when the machine has more than one node online; `membard
// --host-numa-node N` names a node instead, `none` leaves placement to the kernel. A host slab is
// a fresh memfd mapped over its place; before any page of it is touched, mbind(MPOL_PREFERRED)
// attaches the policy to the shared memory object's range, then madvise(MADV_POPULATE_WRITE)
// faults every page in on that node (MPOL_PREFERRED falls back to other nodes rather than fail
// when the node is full). Pinning (cuMemHostRegister) follows, so the pages never move after.
// The system calls are used directly (no libnuma: three calls, no library to install).
// Limitations: a kernel without NUMA support (ENOSYS) or a sandbox that forbids mbind (EPERM)
// leaves placement to the kernel (the backend checks once at start and says so; membard logs it);
// kernels before 5.14 lack MADV_POPULATE_WRITE and pages are touched one by one instead.
#include "membar/engine/numa.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

namespace membar::runtimed::numa {
namespace {

constexpr int kMpolPreferred = 1;
constexpr unsigned long kMpolFNode = 1;
constexpr unsigned long kMpolFAddr = 2;
constexpr int kMadvPopulateWrite = 23;
constexpr unsigned long kMaxNodes = 1024;

std::string errno_text(int error) { return std::string(std::strerror(error)); }

}  // namespace

std::vector<int> online_nodes() {
  std::ifstream file("/sys/devices/system/node/online");
  std::string text;
  if (!file || !std::getline(file, text) || text.empty()) return {0};
  std::vector<int> nodes;
  size_t start = 0;
  while (start < text.size()) {
    size_t comma = text.find(',', start);
    std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    size_t dash = item.find('-');
    int first = std::atoi(item.c_str());
    int last = dash == std::string::npos ? first : std::atoi(item.c_str() + dash + 1);
    for (int node = first; node <= last && node < int(kMaxNodes); ++node) nodes.push_back(node);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return nodes.empty() ? std::vector<int>{0} : nodes;
}

std::string describe(const std::vector<int>& nodes) {
  std::string text;
  for (size_t i = 0; i < nodes.size(); ++i) {
    size_t j = i;
    while (j + 1 < nodes.size() && nodes[j + 1] == nodes[j] + 1) ++j;
    if (!text.empty()) text += ",";
    text += std::to_string(nodes[i]) + (j > i ? "-" + std::to_string(nodes[j]) : "");
    i = j;
  }
  return text;
}

Status place(void* address, uint64_t bytes, int node) {
  if (node >= 0) {
    if (node >= int(kMaxNodes)) return invalid_argument("NUMA node " + std::to_string(node) + " is out of range");
    std::vector<unsigned long> mask(kMaxNodes / (8 * sizeof(unsigned long)), 0);
    mask[node / (8 * sizeof(unsigned long))] |= 1ul << (node % (8 * sizeof(unsigned long)));
    if (::syscall(SYS_mbind, address, bytes, kMpolPreferred, mask.data(), kMaxNodes, 0) != 0) {
      return internal_error("binding a host slab to NUMA node " + std::to_string(node) + ": " + errno_text(errno));
    }
  }
  if (::madvise(address, bytes, kMadvPopulateWrite) == 0) return Status::Ok();
  if (errno != EINVAL) return resource_exhausted("faulting in a host slab: " + errno_text(errno));
  // Before Linux 5.14: touch one byte per page (the memory is fresh, so zero stays zero).
  const long page = ::sysconf(_SC_PAGESIZE);
  auto* bytes_at = static_cast<volatile char*>(address);
  for (uint64_t offset = 0; offset < bytes; offset += uint64_t(page)) bytes_at[offset] = 0;
  return Status::Ok();
}

bool available(std::string* why) {
  const long page = ::sysconf(_SC_PAGESIZE);
  void* probe = ::mmap(nullptr, size_t(page), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (probe == MAP_FAILED) {
    if (why != nullptr) *why = "mmap: " + errno_text(errno);
    return false;
  }
  unsigned long mask = 1;   // node 0 exists wherever NUMA does
  bool ok = ::syscall(SYS_mbind, probe, size_t(page), kMpolPreferred, &mask, 8 * sizeof(mask), 0) == 0;
  if (!ok && why != nullptr) *why = "mbind: " + errno_text(errno);
  ::munmap(probe, size_t(page));
  return ok;
}

Status check_node(int node) {
  std::vector<int> nodes = online_nodes();
  for (int online : nodes) {
    if (online == node) return Status::Ok();
  }
  return invalid_argument("NUMA node " + std::to_string(node) + " is not online on this machine (nodes " +
                          describe(nodes) + ")");
}

Result<int> resolve_node(int requested, int nearest, std::string* note) {
  int node = kNoPlacement;
  if (requested >= 0) {
    MEMBAR_RETURN_IF_ERROR(check_node(requested));
    node = requested;
  } else if (requested == kNearestDevice) {
    std::vector<int> nodes = online_nodes();
    if (nodes.size() < 2) return kNoPlacement;   // one node: nothing to choose
    if (nearest < 0) {
      *note = "the driver does not say which of NUMA nodes " + describe(nodes) + " is nearest the GPU";
      return kNoPlacement;
    }
    node = nearest;
  } else if (requested != kNoPlacement) {
    return invalid_argument("host NUMA node " + std::to_string(requested) + " is neither a node, 'auto' nor 'none'");
  }
  std::string why;
  if (node >= 0 && !available(&why)) {
    *note = "NUMA placement is not available here (" + why + ")";
    return kNoPlacement;
  }
  return node;
}

Result<int> node_of(const void* address) {
  int node = -1;
  if (::syscall(SYS_get_mempolicy, &node, nullptr, 0, const_cast<void*>(address), kMpolFNode | kMpolFAddr) != 0) {
    return unavailable("get_mempolicy: " + errno_text(errno));
  }
  return node;
}

}  // namespace membar::runtimed::numa
