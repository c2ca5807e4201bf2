// Request latency through the shared-memory ring: a real membard process (host backend) and this
// process as its client, one request at a time, timed from push to completion.
//   nop        the ring round trip alone (the daemon answers without the engine)
//   prefetch   of one GPU-resident page (an engine call that moves nothing)
//   acquire / release  of one GPU-resident page (the trainer's hot path)
// Targets (issue 2): p50 <= 10 us, p99 <= 50 us. Writes ring_latency.json and ring_latency.txt
// to $MEMBAR_RESULTS_DIR (default bench/results/latest).
//
// usage: ring_latency [--membard PATH] [--iterations N] [--backend host|cuda]
#include <signal.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include "membar/client.h"

namespace {

using namespace membar;
using Clock = std::chrono::steady_clock;

struct Summary {
  std::string name;
  size_t samples = 0;
  double p50_us = 0, p90_us = 0, p99_us = 0, p999_us = 0, max_us = 0, mean_us = 0;
};

Summary summarize(const std::string& name, std::vector<double> us) {
  std::sort(us.begin(), us.end());
  Summary s;
  s.name = name;
  s.samples = us.size();
  auto at = [&](double q) { return us[std::min(us.size() - 1, static_cast<size_t>(q * static_cast<double>(us.size())))]; };
  s.p50_us = at(0.50);
  s.p90_us = at(0.90);
  s.p99_us = at(0.99);
  s.p999_us = at(0.999);
  s.max_us = us.back();
  double total = 0;
  for (double v : us) total += v;
  s.mean_us = total / static_cast<double>(us.size());
  return s;
}

template <typename F>
std::vector<double> time_calls(size_t warmup, size_t iterations, F&& call) {
  for (size_t i = 0; i < warmup; ++i) call();
  std::vector<double> us;
  us.reserve(iterations);
  for (size_t i = 0; i < iterations; ++i) {
    auto start = Clock::now();
    call();
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  return us;
}

std::string flag(int argc, char** argv, const char* name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  }
  return fallback;
}

std::string command_output(const char* command) {
  std::string out;
  if (FILE* pipe = ::popen(command, "r")) {
    char buffer[256];
    while (std::fgets(buffer, sizeof(buffer), pipe)) out += buffer;
    ::pclose(pipe);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

int fail(const std::string& what, const Status& status) {
  std::fprintf(stderr, "ring_latency: %s: %s\n", what.c_str(), status.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string membard = flag(argc, argv, "--membard", MEMBARD_PATH);
  std::string backend = flag(argc, argv, "--backend", "host");
  size_t iterations = std::strtoull(flag(argc, argv, "--iterations", "50000").c_str(), nullptr, 10);
  const char* results_env = std::getenv("MEMBAR_RESULTS_DIR");
  std::string results_dir = results_env && *results_env ? results_env : std::string(MEMBAR_SOURCE_DIR) + "/bench/results/latest";

  char directory_pattern[] = "/tmp/membar-ring-XXXXXX";
  std::string directory = ::mkdtemp(directory_pattern);
  std::string socket_path = directory + "/membard.sock";
  pid_t daemon = ::fork();
  if (daemon == 0) {
    std::string log = directory + "/membard.log";
    std::FILE* out = std::freopen(log.c_str(), "w", stderr);
    (void)out;
    ::execl(membard.c_str(), membard.c_str(), "--backend", backend.c_str(), "--socket", socket_path.c_str(),
            "--gpu-pool", "64MiB", "--host-pool", "64MiB", "--log-level", "warn", nullptr);
    ::_exit(127);
  }
  auto cleanup = [&] {
    ::kill(daemon, SIGTERM);
    ::waitpid(daemon, nullptr, 0);
    std::string remove = "rm -rf " + directory;
    (void)!std::system(remove.c_str());
  };

  Result<std::unique_ptr<Client>> connected = unavailable("not tried");
  for (int attempt = 0; attempt < 500; ++attempt) {
    connected = connect_daemon(socket_path, ConnectOptions{});
    if (connected.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!connected.ok()) {
    cleanup();
    return fail("connect to " + membard, connected.status());
  }
  Client& client = *connected.value();
  Result<SpaceId> space = client.create_space("bench", 64 << 10, 4);
  if (!space.ok()) return cleanup(), fail("create_space", space.status());
  PageRange page{space.value(), 0, 1};
  Result<Acquired> first = client.acquire(page, kAcquireWrite | kAcquireZeroNew);
  if (!first.ok() || !client.wait(first.value().ticket).ok() || !client.release(page, true).ok()) {
    cleanup();
    return fail("first acquire", first.status());
  }

  Status error = Status::Ok();
  auto keep = [&](const Status& status) {
    if (!status.ok() && error.ok()) error = status;
  };
  std::vector<Summary> summaries;
  summaries.push_back(summarize("nop", time_calls(2000, iterations, [&] { keep(daemon_client_nop(client)); })));
  summaries.push_back(
      summarize("prefetch", time_calls(1000, iterations / 2, [&] { keep(client.prefetch(page).status()); })));
  std::vector<double> acquire_us, release_us;
  for (size_t i = 0; i < iterations / 2 + 1000; ++i) {
    auto start = Clock::now();
    Result<Acquired> acquired = client.acquire(page, 0);
    auto middle = Clock::now();
    keep(acquired.status());
    keep(client.release(page, false));
    auto end = Clock::now();
    if (i >= 1000) {
      acquire_us.push_back(std::chrono::duration<double, std::micro>(middle - start).count());
      release_us.push_back(std::chrono::duration<double, std::micro>(end - middle).count());
    }
  }
  summaries.push_back(summarize("acquire", acquire_us));
  summaries.push_back(summarize("release", release_us));
  cleanup();
  if (!error.ok()) return fail("a timed call", error);

  utsname machine{};
  ::uname(&machine);
  std::string commit = command_output(("git -C " + std::string(MEMBAR_SOURCE_DIR) + " rev-parse --short HEAD 2>/dev/null").c_str());
  char date[64];
  std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const Summary& nop = summaries[0];
  bool pass = nop.p50_us <= 10.0 && nop.p99_us <= 50.0;

  // The load average says how busy the machine was (other processes compete for the cores the
  // client and the daemon's ring thread spin on).
  double load[3] = {0, 0, 0};
  (void)!::getloadavg(load, 3);
  char load_text[32];
  std::snprintf(load_text, sizeof(load_text), "%.2f", load[0]);
  std::string text = "ring_latency (" + backend + " backend, " + machine.nodename + ", " +
                     std::to_string(std::thread::hardware_concurrency()) + " cpus, load average " + load_text +
                     ", commit " + commit + ", " + date + ")\n";
  char line[256];
  std::snprintf(line, sizeof(line), "%-10s %9s %9s %9s %9s %9s %9s %9s\n", "request", "samples", "p50_us", "p90_us",
                "p99_us", "p99.9_us", "max_us", "mean_us");
  text += line;
  std::string json = "{\n  \"benchmark\": \"ring_latency\",\n  \"backend\": \"" + backend + "\",\n  \"machine\": \"" +
                     machine.nodename + "\",\n  \"cpus\": " + std::to_string(std::thread::hardware_concurrency()) +
                     ",\n  \"load_average_1m\": " + load_text + ",\n  \"commit\": \"" + commit + "\",\n  \"date\": \"" + date +
                     "\",\n  \"targets\": {\"p50_us\": 10, \"p99_us\": 50},\n  \"results\": {";
  for (size_t i = 0; i < summaries.size(); ++i) {
    const Summary& s = summaries[i];
    std::snprintf(line, sizeof(line), "%-10s %9zu %9.2f %9.2f %9.2f %9.2f %9.1f %9.2f\n", s.name.c_str(), s.samples,
                  s.p50_us, s.p90_us, s.p99_us, s.p999_us, s.max_us, s.mean_us);
    text += line;
    char entry[320];
    std::snprintf(entry, sizeof(entry),
                  "%s\n    \"%s\": {\"samples\": %zu, \"p50_us\": %.3f, \"p90_us\": %.3f, \"p99_us\": %.3f, "
                  "\"p999_us\": %.3f, \"max_us\": %.3f, \"mean_us\": %.3f}",
                  i ? "," : "", s.name.c_str(), s.samples, s.p50_us, s.p90_us, s.p99_us, s.p999_us, s.max_us, s.mean_us);
    json += entry;
  }
  json += std::string("\n  },\n  \"pass\": ") + (pass ? "true" : "false") + "\n}\n";
  text += std::string("target (nop): p50 <= 10 us, p99 <= 50 us: ") + (pass ? "met" : "NOT met") + "\n";

  std::fputs(text.c_str(), stdout);
  std::string make_directory = "mkdir -p '" + results_dir + "'";
  (void)!std::system(make_directory.c_str());
  for (auto [name, content] : {std::pair{"ring_latency.json", &json}, std::pair{"ring_latency.txt", &text}}) {
    std::string path = results_dir + "/" + name;
    if (std::FILE* f = std::fopen(path.c_str(), "w")) {
      std::fputs(content->c_str(), f);
      std::fclose(f);
    } else {
      std::fprintf(stderr, "ring_latency: cannot write %s\n", path.c_str());
    }
  }
  return 0;
}
