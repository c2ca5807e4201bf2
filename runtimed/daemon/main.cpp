// membard: the membar memory daemon. Parses flags, makes the frames (backend), the engine and
// the server, then serves until SIGTERM / SIGINT. See `membard --help`.
#include <fcntl.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <string>

#if defined(MEMBAR_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

#include "membar/engine/backend.h"
#include "membar/engine/engine.h"
#include "options.h"
#include "server.h"

namespace {

using namespace membar;
using namespace membar::runtimed;

// MemAvailable from /proc/meminfo, in bytes (0 when unreadable).
uint64_t host_available_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

uint64_t gpu_free_bytes(const DaemonOptions& options) {
#if defined(MEMBAR_WITH_CUDA)
  if (options.backend == "cuda") {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(options.device) == cudaSuccess && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      return free_bytes;
    }
    return 0;
  }
#endif
  // The host backend's "GPU" frames are host memory too.
  return host_available_bytes();
}

// Without --foreground: detach (fork + setsid); the parent exits once the child serves, with
// the child's start-up status. Returns the fd to report readiness on, or -1 in the foreground.
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

  int ready_fd = options.foreground ? -1 : detach();

  BackendConfig backend_config;
  uint64_t gpu_free = gpu_free_bytes(options);
  uint64_t host_free = host_available_bytes();
  backend_config.gpu_pool_bytes = resolve_size(options.gpu_pool, gpu_free);
  backend_config.host_pool_bytes = resolve_size(options.host_pool, host_free);
  backend_config.device = options.device;
  if (backend_config.gpu_pool_bytes == 0 || backend_config.host_pool_bytes == 0) {
    spdlog::error("pools must hold at least one 2 MiB frame (gpu {}, host {})",
                  human_bytes(backend_config.gpu_pool_bytes), human_bytes(backend_config.host_pool_bytes));
    return 1;
  }
  spdlog::info("backend {}: gpu pool {} ({} frames), host pool {} ({} frames)", options.backend,
               human_bytes(backend_config.gpu_pool_bytes), backend_config.gpu_pool_bytes / kFrameBytes,
               human_bytes(backend_config.host_pool_bytes), backend_config.host_pool_bytes / kFrameBytes);

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
    spdlog::error("cannot create the {} backend: {}", options.backend, backend.status().to_string());
    return 1;
  }
  EngineConfig engine_config;
  engine_config.default_gpu_quota_bytes = resolve_size(options.default_gpu_quota, backend_config.gpu_pool_bytes);
  engine_config.default_host_quota_bytes = resolve_size(options.default_host_quota, backend_config.host_pool_bytes);
  Result<std::unique_ptr<Engine>> engine = Engine::create(std::move(backend).value(), engine_config);
  if (!engine.ok()) {
    spdlog::error("cannot create the engine: {}", engine.status().to_string());
    return 1;
  }
  options.server.device = options.device;
  Result<std::unique_ptr<Server>> server = Server::create(options.server, std::move(engine).value());
  if (!server.ok()) {
    spdlog::error("cannot start: {}", server.status().to_string());
    return 1;
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
