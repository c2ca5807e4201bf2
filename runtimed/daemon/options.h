// membard's command line: flags, sizes ("40GiB", "512MiB", or a fraction "0.8" of free memory).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "membar/common/human_bytes.h"
#include "membar/status.h"
#include "server.h"

namespace membar::runtimed {

// A pool size as given: bytes, or a fraction of the free memory of the tier.
struct SizeSpec {
  uint64_t bytes = 0;
  double fraction = 0;  // used when > 0
};

// "40GiB", "40G", "512MiB", "64KiB", "1048576", "0.8" (a fraction in (0, 1]).
Result<SizeSpec> parse_size(const std::string& text);
// Bytes for a spec given the tier's free memory, rounded down to whole 2 MiB frames.
uint64_t resolve_size(const SizeSpec& spec, uint64_t free_bytes);

struct DaemonOptions {
#if defined(MEMBAR_WITH_CUDA)
  std::string backend = "cuda";  // "host" or "cuda"
#else
  std::string backend = "host";
#endif
  ServerConfig server;
  SizeSpec gpu_pool{256ull << 20, 0};
  SizeSpec host_pool{1ull << 30, 0};
  SizeSpec default_gpu_quota{0, 1.0};  // a fraction of the pool: the whole pool by default
  SizeSpec default_host_quota{0, 1.0};
  // The devices served, one engine and pool each (Note [Devices of one daemon] in
  // membar/protocol/v2.h): CUDA ordinals in the order given, no repeats, each below
  // kMaxDevices. With --backend host they are labels only (no GPU is touched).
  std::vector<int> devices{0};
  // `--devices all`: every CUDA device (main resolves it, CUDA backend only; on the host
  // backend it is refused while parsing, as there is nothing to count).
  bool all_devices = false;
  // --host-numa-node: a node number, -2 ("auto": each device's pool on the node nearest its GPU,
  // on machines with several nodes) or -1 ("none"). Note [Host pools near their GPU].
  int host_numa_node = -2;
  uint32_t max_spaces = 65536;
  SizeSpec max_client_space{32ull << 40, 0};
  SizeSpec max_total_space{32ull << 40, 0};  // all clients' spaces of one device's engine
  bool daemonize = false;
  std::string pid_file;
  std::string log_level = "info";
  bool show_help = false;
};

// "0,1,3": CUDA ordinals 0..kMaxDevices-1, no repeats (INVALID_ARGUMENT naming the bad item).
Result<std::vector<int>> parse_device_list(const std::string& text);

// Parses argv (without exiting or printing): INVALID_ARGUMENT naming the bad flag.
Result<DaemonOptions> parse_daemon_options(int argc, const char* const* argv);
std::string daemon_usage();

}  // namespace membar::runtimed
