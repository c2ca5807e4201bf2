#include "options.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "membar/client.h"
#include "membar/protocol/v2.h"

namespace membar::runtimed {

Result<SizeSpec> parse_size(const std::string& text) {
  if (text.empty()) return invalid_argument("empty size");
  char* end = nullptr;
  double number = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || !std::isfinite(number) || number < 0) {
    return invalid_argument("'" + text + "' is not a size (e.g. 40GiB, 512MiB or a fraction 0.8)");
  }
  std::string unit(end);
  SizeSpec spec;
  if (unit.empty() && text.find('.') != std::string::npos) {
    if (number <= 0 || number > 1) return invalid_argument("fraction '" + text + "' must be in (0, 1]");
    spec.fraction = number;
    return spec;
  }
  double scale = 1;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "K" || unit == "KiB" || unit == "k") scale = 1024.0;
  else if (unit == "M" || unit == "MiB") scale = 1024.0 * 1024;
  else if (unit == "G" || unit == "GiB") scale = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TiB") scale = 1024.0 * 1024 * 1024 * 1024;
  else return invalid_argument("'" + text + "' has unknown unit '" + unit + "' (use B, KiB, MiB, GiB, TiB)");
  double bytes = number * scale;
  if (bytes > 1e18) return invalid_argument("'" + text + "' is too large");
  spec.bytes = static_cast<uint64_t>(bytes);
  return spec;
}

uint64_t resolve_size(const SizeSpec& spec, uint64_t free_bytes) {
  uint64_t bytes = spec.fraction > 0 ? static_cast<uint64_t>(spec.fraction * static_cast<double>(free_bytes)) : spec.bytes;
  return bytes / kFrameBytes * kFrameBytes;
}

Result<std::vector<int>> parse_device_list(const std::string& text) {
  std::vector<int> devices;
  size_t start = 0;
  for (;;) {
    size_t comma = text.find(',', start);
    std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    char* end = nullptr;
    long number = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != 0 || item[0] == '-' || item[0] == '+' || number < 0 ||
        number >= static_cast<long>(protocol::v2::kMaxDevices)) {
      return invalid_argument("'" + item + "' is not a device (0.." + std::to_string(protocol::v2::kMaxDevices - 1) +
                              ", or 'all')");
    }
    for (int seen : devices) {
      if (seen == number) return invalid_argument("device " + item + " is listed twice");
    }
    devices.push_back(static_cast<int>(number));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return devices;
}

std::string daemon_usage() {
  return "usage: membard [options]\n"
         "The membar memory daemon: owns a GPU pool (CUDA VMM frames) and a pinned host pool, and serves\n"
         "the trainers of this node over a Unix socket. Runs in the foreground (systemd, a terminal,\n"
         "a container); --daemonize detaches and --pid-file records the pid.\n"
         "\n"
         "Memory:\n"
         "  --backend cuda|host        cuda: GPU frames (default when built with CUDA); host: no GPU (tests)\n"
         "  --devices LIST|all         CUDA devices served, e.g. 0,1,3 (default 0); all: every CUDA device.\n"
         "                             Each device has its own pools and engine; a client names its device\n"
         "                             when it connects (the first one when it names none). With --backend\n"
         "                             host the numbers are labels (no GPU) and 'all' is refused\n"
         "  --device N                 the same as --devices N\n"
         "  --gpu-pool SIZE            GPU pool of each device (default 256MiB)\n"
         "  --host-pool SIZE           host pool of the node (one for all devices), pinned in the background\n"
         "                             (default 1GiB)\n"
         "  --host-numa-node auto|none|N\n"
         "                             where host pools live on machines with several NUMA nodes (sockets):\n"
         "                             auto (default) puts each device's pool on the node nearest its GPU,\n"
         "                             N on node N, none leaves it to the kernel\n"
         "  --default-gpu-quota SIZE   each client's share of its device's GPU pool when it asks for none\n"
         "                             (default 1.0: the whole pool)\n"
         "  --default-host-quota SIZE  likewise for its device's host pool\n"
         "Access:\n"
         "  --socket PATH              control socket (default /run/membar/membard.sock)\n"
         "  --allow-uid UID[,UID...]   admit these uids besides the daemon's own and root; the socket is then\n"
         "                             made 0666 and the peer's credentials (SO_PEERCRED) decide\n"
         "  --socket-mode 0600|0660    without --allow-uid: 0660 lets the socket's group connect (default 0600)\n"
         "Limits (see docs/service.md):\n"
         "  --max-connections N        connections at once, trainers and membarctl (default 256)\n"
         "  --handshake-timeout MS     a peer must say hello within this (default 5000)\n"
         "  --max-spaces N             spaces per client (default 65536)\n"
         "  --max-client-space SIZE    bytes of all of a client's spaces (page tables; default 32TiB)\n"
         "  --max-total-space SIZE     bytes of all clients' spaces together, per device (default 32TiB:\n"
         "                             ~1.3GiB of page tables in the daemon)\n"
         "  --queue-limit SIZE         bytes queued for a peer that does not read its socket (default 16MiB)\n"
         "Other:\n"
         "  --prometheus-port N        serve http://127.0.0.1:N/metrics (loopback only; 0 picks a free port)\n"
         "  --ring-capacity N          request ring entries per client (default 64)\n"
         "  --daemonize                detach into the background once serving\n"
         "  --pid-file PATH            write the daemon's pid there (removed on exit)\n"
         "  --log-level L              trace|debug|info|warn|error|off (default info)\n"
         "SIZE: 40GiB, 512MiB, or a fraction such as 0.8 (of free memory for pools: the device's for --gpu-pool,\n"
         "the machine's for --host-pool; of the pool for quotas).\n";
}

Result<DaemonOptions> parse_daemon_options(int argc, const char* const* argv) {
  DaemonOptions options;
  options.server.socket_path = kDefaultSocketPath;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    std::string value;
    size_t equals = flag.find('=');
    bool has_inline_value = flag.rfind("--", 0) == 0 && equals != std::string::npos;
    if (has_inline_value) {
      value = flag.substr(equals + 1);
      flag = flag.substr(0, equals);
    }
    auto take = [&]() -> Result<std::string> {
      if (has_inline_value) return value;
      if (i + 1 >= argc) return invalid_argument(flag + " needs a value");
      return std::string(argv[++i]);
    };
    auto take_size = [&](SizeSpec& out) -> Status {
      MEMBAR_ASSIGN_OR_RETURN(std::string text, take());
      Result<SizeSpec> size = parse_size(text);
      if (!size.ok()) return invalid_argument(flag + ": " + size.status().message());
      out = size.value();
      return Status::Ok();
    };
    auto take_int = [&](int64_t low, int64_t high) -> Result<int64_t> {
      MEMBAR_ASSIGN_OR_RETURN(std::string text, take());
      char* end = nullptr;
      long long number = std::strtoll(text.c_str(), &end, 0);
      if (end == text.c_str() || *end != 0 || number < low || number > high) {
        return invalid_argument(flag + ": '" + text + "' is not an integer in [" + std::to_string(low) + ", " +
                                std::to_string(high) + "]");
      }
      return static_cast<int64_t>(number);
    };
    if (flag == "--help" || flag == "-h") {
      options.show_help = true;
    } else if (flag == "--backend") {
      MEMBAR_ASSIGN_OR_RETURN(options.backend, take());
      if (options.backend != "host" && options.backend != "cuda") {
        return invalid_argument("--backend must be 'cuda' or 'host', got '" + options.backend + "'");
      }
    } else if (flag == "--socket") {
      MEMBAR_ASSIGN_OR_RETURN(options.server.socket_path, take());
    } else if (flag == "--gpu-pool") {
      MEMBAR_RETURN_IF_ERROR(take_size(options.gpu_pool));
    } else if (flag == "--host-pool") {
      MEMBAR_RETURN_IF_ERROR(take_size(options.host_pool));
    } else if (flag == "--host-numa-node") {
      MEMBAR_ASSIGN_OR_RETURN(std::string text, take());
      char* end = nullptr;
      long node = std::strtol(text.c_str(), &end, 10);
      if (text == "auto") {
        options.host_numa_node = -2;
      } else if (text == "none") {
        options.host_numa_node = -1;
      } else if (!text.empty() && *end == 0 && node >= 0 && node < 1024) {
        options.host_numa_node = static_cast<int>(node);
      } else {
        return invalid_argument("--host-numa-node takes auto, none or a node number, got '" + text + "'");
      }
    } else if (flag == "--default-gpu-quota") {
      MEMBAR_RETURN_IF_ERROR(take_size(options.default_gpu_quota));
      if (options.default_gpu_quota.fraction == 0 && options.default_gpu_quota.bytes < kFrameBytes) {
        return invalid_argument("--default-gpu-quota must be at least one 2MiB frame (or a fraction of the pool)");
      }
    } else if (flag == "--default-host-quota") {
      MEMBAR_RETURN_IF_ERROR(take_size(options.default_host_quota));
      if (options.default_host_quota.fraction == 0 && options.default_host_quota.bytes < kFrameBytes) {
        return invalid_argument("--default-host-quota must be at least one 2MiB frame (or a fraction of the pool)");
      }
    } else if (flag == "--devices" || flag == "--device") {
      MEMBAR_ASSIGN_OR_RETURN(std::string list, take());
      options.all_devices = flag == "--devices" && list == "all";
      if (!options.all_devices) {
        Result<std::vector<int>> devices = parse_device_list(list);
        if (!devices.ok()) return invalid_argument(flag + ": " + devices.status().message());
        if (flag == "--device" && devices.value().size() != 1) {
          return invalid_argument("--device takes one device; use --devices " + list);
        }
        options.devices = std::move(devices).value();
      }
    } else if (flag == "--allow-uid") {
      MEMBAR_ASSIGN_OR_RETURN(std::string list, take());
      size_t start = 0;
      while (start <= list.size()) {
        size_t comma = list.find(',', start);
        std::string item = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        char* end = nullptr;
        unsigned long uid = std::strtoul(item.c_str(), &end, 10);
        if (item.empty() || *end != 0 || uid > 0xfffffffful) {
          return invalid_argument("--allow-uid: '" + item + "' is not a uid");
        }
        options.server.allowed_uids.push_back(static_cast<uint32_t>(uid));
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
    } else if (flag == "--socket-mode") {
      MEMBAR_ASSIGN_OR_RETURN(std::string text, take());
      if (text != "0600" && text != "0660" && text != "600" && text != "660") {
        return invalid_argument("--socket-mode must be 0600 or 0660, got '" + text + "'");
      }
      options.server.socket_mode = text.find("66") != std::string::npos ? 0660 : 0600;
    } else if (flag == "--prometheus-port") {
      MEMBAR_ASSIGN_OR_RETURN(int64_t port, take_int(-1, 65535));
      options.server.prometheus_port = static_cast<int>(port);
    } else if (flag == "--ring-capacity") {
      MEMBAR_ASSIGN_OR_RETURN(int64_t capacity, take_int(2, 65536));
      options.server.ring_capacity = static_cast<uint32_t>(capacity);
    } else if (flag == "--foreground" || flag == "-f") {
      options.daemonize = false;  // the default; kept for scripts that pass it
    } else if (flag == "--daemonize") {
      options.daemonize = true;
    } else if (flag == "--pid-file") {
      MEMBAR_ASSIGN_OR_RETURN(options.pid_file, take());
    } else if (flag == "--max-connections") {
      MEMBAR_ASSIGN_OR_RETURN(int64_t count, take_int(1, 1 << 20));
      options.server.max_connections = static_cast<uint32_t>(count);
    } else if (flag == "--handshake-timeout") {
      MEMBAR_ASSIGN_OR_RETURN(int64_t ms, take_int(10, 3600000));
      options.server.handshake_timeout_ms = static_cast<uint32_t>(ms);
    } else if (flag == "--max-spaces") {
      MEMBAR_ASSIGN_OR_RETURN(int64_t count, take_int(1, 1 << 24));
      options.max_spaces = static_cast<uint32_t>(count);
    } else if (flag == "--max-client-space") {
      MEMBAR_RETURN_IF_ERROR(take_size(options.max_client_space));
      if (options.max_client_space.fraction > 0 || options.max_client_space.bytes < kFrameBytes) {
        return invalid_argument("--max-client-space must be a size of at least 2MiB");
      }
    } else if (flag == "--max-total-space") {
      MEMBAR_RETURN_IF_ERROR(take_size(options.max_total_space));
      if (options.max_total_space.fraction > 0 || options.max_total_space.bytes < kFrameBytes) {
        return invalid_argument("--max-total-space must be a size of at least 2MiB");
      }
    } else if (flag == "--queue-limit") {
      SizeSpec queue;
      MEMBAR_RETURN_IF_ERROR(take_size(queue));
      if (queue.fraction > 0 || queue.bytes < (64u << 10)) return invalid_argument("--queue-limit must be at least 64KiB");
      options.server.outbound.max_bytes = queue.bytes;
    } else if (flag == "--log-level") {
      MEMBAR_ASSIGN_OR_RETURN(options.log_level, take());
      static const char* levels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
      bool known = false;
      for (const char* level : levels) known = known || options.log_level == level;
      if (!known) return invalid_argument("--log-level: unknown level '" + options.log_level + "'");
    } else {
      return invalid_argument("unknown flag '" + flag + "'");
    }
  }
  if (options.all_devices && options.backend == "host") {
    return invalid_argument("--devices all counts CUDA devices and --backend host has none: list the device "
                            "labels instead (e.g. --devices 0,1)");
  }
  return options;
}

}  // namespace membar::runtimed
