// membard: the membar memory daemon. Parses flags, makes the frames (backend), the engine and
// the server, then serves until SIGTERM / SIGINT. See `membard --help`.
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <string>

#if defined(MEMBAR_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include "membar/engine/backend.h"
#include "membar/engine/engine.h"
#include "membar/common/human_bytes.h"
#include "membar/protocol/v2.h"
#include "options.h"
#include "server.h"
#include "shared_segment.h"

namespace {

using namespace membar;
using namespace membar::runtimed;

// A /proc/meminfo entry ("MemAvailable:", "MemTotal:"), in bytes (0 when unreadable).
uint64_t meminfo_bytes(const std::string& wanted) {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == wanted) return kib * 1024;
  }
  return 0;
}
uint64_t host_available_bytes() { return meminfo_bytes("MemAvailable:"); }

// The soft open-file limit raised to the hard one; returns the limit in force.
uint64_t raise_open_file_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  if (limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    (void)::setrlimit(RLIMIT_NOFILE, &limit);
    (void)::getrlimit(RLIMIT_NOFILE, &limit);
  }
  return limit.rlim_cur == RLIM_INFINITY ? (1u << 20) : limit.rlim_cur;
}

// Writes the pid file; removed again when the daemon exits normally.
struct PidFile {
  std::string path;
  ~PidFile() {
    if (!path.empty()) ::unlink(path.c_str());
  }
};

uint64_t gpu_free_bytes(const DaemonOptions& options, int device) {
#if defined(MEMBAR_WITH_CUDA)
  if (options.backend == "cuda") {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(device) == cudaSuccess && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      return free_bytes;
    }
    return 0;
  }
#endif
  (void)device;
  // The host backend's "GPU" frames are host memory too.
  return host_available_bytes();
}

// `--devices all`: every CUDA device this process sees (CUDA backend only; the options refuse it
// on the host backend).
Result<std::vector<int>> every_cuda_device() {
#if defined(MEMBAR_WITH_CUDA)
  int count = 0;
  cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    return unavailable(std::string("--devices all: cannot count CUDA devices: ") + cudaGetErrorString(error));
  }
  if (count == 0) return unavailable("--devices all: this machine has no CUDA device");
  std::vector<int> devices;
  for (int device = 0; device < count && device < static_cast<int>(protocol::v2::kMaxDevices); ++device) {
    devices.push_back(device);
  }
  if (count > static_cast<int>(protocol::v2::kMaxDevices)) {
    spdlog::warn("--devices all: serving the first {} of {} CUDA devices", protocol::v2::kMaxDevices, count);
  }
  return devices;
#else
  return unimplemented("--devices all: this membard was built without CUDA (-DMEMBAR_WITH_CUDA=ON)");
#endif
}

// One device's backend (its pools, `backend_config.device`) and engine.
Result<ServedDevice> make_device(const DaemonOptions& options, const BackendConfig& backend_config,
                                 const EngineConfig& engine_config) {
  const int device = backend_config.device;
  Result<std::unique_ptr<DeviceBackend>> backend = unimplemented("no backend");
  if (options.backend == "host") {
    backend = make_host_backend(backend_config);
  } else {
#if defined(MEMBAR_WITH_CUDA)
    backend = make_cuda_backend(backend_config);
#else
    backend = unimplemented("this membard was built without CUDA (-DMEMBAR_WITH_CUDA=ON); use --backend host");
#endif
  }
  if (!backend.ok()) {
    return Status(backend.status().code(), "cannot create the " + options.backend + " backend of device " +
                                               std::to_string(device) + ": " + backend.status().to_string());
  }
  // Where its host pool lives (Note [Host pools near their GPU] in engine/numa.cpp).
  std::string which = options.devices.size() > 1 ? "device " + std::to_string(device) + ": " : std::string();
  int node = backend.value()->host_numa_node();
  std::string note = backend.value()->host_numa_note();
  if (node >= 0) {
    spdlog::info("{}host pool on NUMA node {}{}", which, node,
                 backend_config.host_numa_node == -2 ? " (nearest the GPU)" : "");
  } else if (!note.empty()) {
    spdlog::warn("{}host pool placed by the kernel: {}", which, note);
  }
  Result<std::unique_ptr<Engine>> engine = Engine::create(std::move(backend).value(), engine_config);
  if (!engine.ok()) {
    return Status(engine.status().code(),
                  "cannot create the engine of device " + std::to_string(device) + ": " + engine.status().to_string());
  }
  return ServedDevice{device, std::move(engine).value()};
}

// With --daemonize: detach (fork + setsid); the parent exits once the child serves, with the
// child's start-up status. Returns the fd to report readiness on, or -1 in the foreground.
int detach() {
  int pipe_fds[2];
  if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return -1;
  pid_t child = ::fork();
  if (child < 0) return -1;
  if (child > 0) {
    ::close(pipe_fds[1]);
    char ready = 0;
    ssize_t n = ::read(pipe_fds[0], &ready, 1);
    ::_exit(n == 1 && ready == '1' ? 0 : 1);
  }
  ::close(pipe_fds[0]);
  ::setsid();
  int null_fd = ::open("/dev/null", O_RDWR);
  if (null_fd >= 0) {
    ::dup2(null_fd, STDIN_FILENO);
    if (null_fd > STDERR_FILENO) ::close(null_fd);
  }
  return pipe_fds[1];
}

int run(int argc, char** argv) {
  Result<DaemonOptions> parsed = parse_daemon_options(argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "membard: %s\n%s", parsed.status().message().c_str(), daemon_usage().c_str());
    return 2;
  }
  DaemonOptions options = std::move(parsed).value();
  if (options.show_help) {
    std::fputs(daemon_usage().c_str(), stdout);
    return 0;
  }
  // A Prometheus scraper that hangs up mid-response must not kill the daemon: libuv's writes
  // report EPIPE, and only if SIGPIPE is ignored.
  std::signal(SIGPIPE, SIG_IGN);
  spdlog::set_level(spdlog::level::from_str(options.log_level));
  spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [membard] [%^%l%$] %v");

  int ready_fd = options.daemonize ? detach() : -1;
  // Same-user processes must not read this process's descriptors or memory (/proc/PID/fd,
  // /proc/PID/mem): every client's frames pass through it.
  (void)::prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
  uint64_t open_files = raise_open_file_limit();
  if (uint64_t{options.server.max_connections} * 2 + 512 > open_files) {
    uint32_t fitting = static_cast<uint32_t>(open_files > 1024 ? (open_files - 512) / 2 : 256);
    spdlog::warn("the open-file limit ({}) is too low for {} connections: serving at most {}", open_files,
                 options.server.max_connections, fitting);
    options.server.max_connections = fitting;
  }
  if (int swept = sweep_named_segments(); swept > 0) {
    spdlog::info("removed {} shared-memory segments left in /dev/shm by an earlier daemon", swept);
  }
  PidFile pid_file;

  if (options.all_devices) {
    Result<std::vector<int>> every = every_cuda_device();
    if (!every.ok()) {
      spdlog::error("{}", every.status().message());
      return 1;
    }
    options.devices = std::move(every).value();
  }
  // GPU pools and quotas are per device: each device gets a --gpu-pool (a fraction is of that
  // device's free memory), and a client's share is of its device's pools (Note [Devices of one
  // daemon] in membar/protocol/v2.h). The host pool is one for the node (Note [One host pool for a
  // node] in engine/host_share.cpp): every device's engine may use all of it, each backs an equal
  // part at start-up, on its GPU's NUMA node, and capacity moves to the device that needs it.
  const size_t device_count = options.devices.size();
  std::vector<BackendConfig> pools(device_count);
  const uint64_t host_pool_bytes = resolve_size(options.host_pool, host_available_bytes());
  uint64_t host_needed = host_pool_bytes;
  for (size_t i = 0; i < device_count; ++i) {
    pools[i].device = options.devices[i];
    pools[i].host_numa_node = options.host_numa_node;
    pools[i].gpu_pool_bytes = resolve_size(options.gpu_pool, gpu_free_bytes(options, options.devices[i]));
    pools[i].host_pool_bytes = host_pool_bytes;
    if (pools[i].gpu_pool_bytes == 0 || pools[i].host_pool_bytes == 0) {
      spdlog::error("pools must hold at least one 2 MiB frame (device {}: gpu {}, host {})", pools[i].device,
                    human_bytes(pools[i].gpu_pool_bytes), human_bytes(pools[i].host_pool_bytes));
      return 1;
    }
    host_needed += options.backend == "host" ? pools[i].gpu_pool_bytes : 0;
  }
  std::shared_ptr<HostShare> host_share;
  uint64_t host_slabs = 0;
  if (device_count > 1) {
    uint32_t slab_frames = host_slab_frames_for(host_pool_bytes);
    host_slabs = host_pool_bytes / kFrameBytes / slab_frames;
    host_share = std::make_shared<HostShare>(host_slabs);
    spdlog::info("host pool {} ({} slabs of {}) shared by {} devices", human_bytes(host_slabs * slab_frames * kFrameBytes),
                 host_slabs, human_bytes(uint64_t(slab_frames) * kFrameBytes), device_count);
  }
  // The host pools are pinned: they must fit in memory with room to spare for everything else.
  uint64_t host_total = meminfo_bytes("MemTotal:");
  if (host_total != 0 && host_needed > host_total / 10 * 9) {
    spdlog::error("{} of host pool{}{} do not fit this machine's {} of memory (at most 90% of it can be pinned); "
                  "give a smaller --host-pool (or a fraction such as --host-pool 0.5)",
                  human_bytes(host_needed), device_count > 1 ? " (one for all devices)" : "",
                  options.backend == "host" ? " plus the host backend's GPU pools" : "", human_bytes(host_total));
    return 1;
  }

  EngineConfig engine_config;
  engine_config.max_spaces_per_client = options.max_spaces;
  engine_config.max_space_frames_per_client = options.max_client_space.bytes / kFrameBytes;
  engine_config.max_space_frames_total = options.max_total_space.bytes / kFrameBytes;
  engine_config.client_id_step = static_cast<uint32_t>(device_count);
  engine_config.log_error = [](const std::string& message) { spdlog::error("{}", message); };
  // Note [Eviction order]'s displace_rank (an experiment's knob, as in the embedded engine).
  if (const char* rank = std::getenv("MEMBAR_DISPLACE_RANK")) engine_config.displace_rank = parse_displace_rank(rank);
  std::vector<ServedDevice> devices;
  for (size_t i = 0; i < device_count; ++i) {
    const BackendConfig& pool = pools[i];
    std::string which = device_count > 1 ? "device " + std::to_string(pool.device) + ", " : std::string();
    spdlog::info("{}backend {}: gpu pool {} ({} frames), host pool {} ({} frames)", which, options.backend,
                 human_bytes(pool.gpu_pool_bytes), pool.gpu_pool_bytes / kFrameBytes, human_bytes(pool.host_pool_bytes),
                 pool.host_pool_bytes / kFrameBytes);
    engine_config.default_gpu_quota_bytes = resolve_size(options.default_gpu_quota, pool.gpu_pool_bytes);
    engine_config.default_host_quota_bytes = resolve_size(options.default_host_quota, pool.host_pool_bytes);
    spdlog::info("{}each client's share unless it asks for less: {} of the GPU pool, {} of the host pool "
                 "(--default-gpu-quota, --default-host-quota)",
                 which, human_bytes(engine_config.default_gpu_quota_bytes),
                 human_bytes(engine_config.default_host_quota_bytes));
    engine_config.first_client_id = static_cast<ClientId>(i + 1);  // ids i+1, i+1+n, ...: unique node-wide
    engine_config.host_share = host_share;
    engine_config.host_initial_slabs = host_slabs / device_count + (i < host_slabs % device_count ? 1 : 0);
    Result<ServedDevice> device = make_device(options, pool, engine_config);
    if (!device.ok()) {
      spdlog::error("{}", device.status().message());
      return 1;
    }
    devices.push_back(std::move(device).value());
  }
  Result<std::unique_ptr<Server>> server = Server::create(options.server, std::move(devices));
  if (!server.ok()) {
    spdlog::error("cannot start: {}", server.status().to_string());
    return 1;
  }
  if (!options.pid_file.empty()) {
    std::ofstream out(options.pid_file);
    out << ::getpid() << "\n";
    if (!out) {
      spdlog::error("cannot write the pid file {}", options.pid_file);
      return 1;
    }
    pid_file.path = options.pid_file;
  }
  if (ready_fd >= 0) {
    (void)!::write(ready_fd, "1", 1);
    ::close(ready_fd);
  }
  Status served = server.value()->run();
  if (!served.ok()) {
    spdlog::error("{}", served.to_string());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return run(argc, argv); }
