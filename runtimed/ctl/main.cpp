// membarctl: the admin CLI of membard.
//   membarctl [--socket PATH] stats [--json]     one snapshot (sectioned text, or JSON)
//   membarctl [--socket PATH] top [--iterations N] [--interval-ms MS]   live view, every second
//   membarctl [--socket PATH] ping               liveness and round-trip time
// PATH defaults to $MEMBAR_SOCKET, then /run/membar/membard.sock.
#include <poll.h>
#include <termios.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "admin_connection.h"
#include "format.h"
#include "membar/client.h"

namespace {

using namespace membar;

const char* kUsage =
    "usage: membarctl [--socket PATH] stats [--json]\n"
    "       membarctl [--socket PATH] top [--iterations N] [--interval-ms MS]   (q quits)\n"
    "       membarctl [--socket PATH] ping\n"
    "PATH defaults to $MEMBAR_SOCKET, then /run/membar/membard.sock.\n";

// Raw keyboard input for `top` (restored on exit): lets 'q' quit without Enter.
class KeyboardMode {
 public:
  explicit KeyboardMode(bool enable) {
    if (!enable || ::tcgetattr(STDIN_FILENO, &saved_) != 0) return;
    termios raw = saved_;
    raw.c_lflag &= ~static_cast<tcflag_t>(ICANON | ECHO);
    raw.c_cc[VMIN] = 0;
    raw.c_cc[VTIME] = 0;
    active_ = ::tcsetattr(STDIN_FILENO, TCSANOW, &raw) == 0;
  }
  ~KeyboardMode() {
    if (active_) ::tcsetattr(STDIN_FILENO, TCSANOW, &saved_);
  }
  // Sleeps up to `ms`; true when 'q' (or Ctrl-D, end of input) was typed meanwhile.
  bool wait_for_quit(int ms) {
    if (!active_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      return false;
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    for (;;) {
      int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
      if (left <= 0) return false;
      pollfd p{STDIN_FILENO, POLLIN, 0};
      if (::poll(&p, 1, left) <= 0) continue;
      char key = 0;
      ssize_t n = ::read(STDIN_FILENO, &key, 1);
      if (n == 0 || key == 'q' || key == 'Q' || key == 4) return true;
    }
  }

 private:
  termios saved_{};
  bool active_ = false;
};

int fail(const Status& status) {
  std::fprintf(stderr, "membarctl: %s\n", status.to_string().c_str());
  return status.code() == StatusCode::UNAVAILABLE ? 3 : 1;
}

int usage_error(const std::string& message) {
  std::fprintf(stderr, "membarctl: %s\n%s", message.c_str(), kUsage);
  return 2;
}

bool parse_count(const std::string& text, long long low, long long* out) {
  char* end = nullptr;
  long long value = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != 0 || value < low) return false;
  *out = value;
  return true;
}

int run(int argc, char** argv) {
  std::string socket_path;
  if (const char* from_environment = std::getenv("MEMBAR_SOCKET")) socket_path = from_environment;
  if (socket_path.empty() || socket_path == "embedded") socket_path = kDefaultSocketPath;
  std::string command;
  bool json = false;
  long long iterations = -1;
  long long interval_ms = 1000;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&](std::string* out) {
      if (i + 1 >= argc) return false;
      *out = argv[++i];
      return true;
    };
    std::string text;
    if (arg == "--help" || arg == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (arg == "--socket") {
      if (!value(&socket_path)) return usage_error("--socket needs a path");
    } else if (arg == "--json") {
      json = true;
    } else if (arg == "--iterations") {
      if (!value(&text) || !parse_count(text, 1, &iterations)) return usage_error("--iterations needs a count >= 1");
    } else if (arg == "--interval-ms") {
      if (!value(&text) || !parse_count(text, 10, &interval_ms)) return usage_error("--interval-ms needs >= 10");
    } else if (command.empty() && (arg == "stats" || arg == "top" || arg == "ping")) {
      command = arg;
    } else {
      return usage_error("unknown argument '" + arg + "'");
    }
  }
  if (command.empty()) return usage_error("no command given");

  Result<ctl::NodeAdmin> node = ctl::NodeAdmin::open(socket_path);
  if (!node.ok()) return fail(node.status());
  ctl::AdminConnection& admin = node.value().first();

  if (command == "ping") {
    Result<uint64_t> round_trip = admin.ping();
    if (!round_trip.ok()) return fail(round_trip.status());
    std::vector<int> devices = admin.daemon_devices();
    std::string device_list;
    for (int device : devices) device_list += (device_list.empty() ? "" : ", ") + std::to_string(device);
    std::printf("membard at %s is alive (backend %s, device%s %s, protocol v2), round trip %s\n", socket_path.c_str(),
                admin.backend().c_str(), devices.size() > 1 ? "s" : "", device_list.c_str(),
                ctl::human_duration_ns(round_trip.value()).c_str());
    return 0;
  }
  if (command == "stats") {
    Result<std::vector<DeviceRuntimeStats>> stats = node.value().stats();
    if (!stats.ok()) return fail(stats.status());
    std::string text = json ? ctl::format_stats_json(stats.value(), socket_path)
                            : ctl::format_stats_text(stats.value(), socket_path);
    std::fputs(text.c_str(), stdout);
    return 0;
  }
  // top
  bool terminal = ::isatty(STDOUT_FILENO) != 0;
  // On a terminal, 'q' quits: stdin without line buffering or echo while top runs.
  KeyboardMode keyboard(terminal && ::isatty(STDIN_FILENO) != 0);
  std::vector<DeviceRuntimeStats> previous;
  auto last = std::chrono::steady_clock::now();
  for (long long i = 0; iterations < 0 || i < iterations; ++i) {
    if (i > 0 && keyboard.wait_for_quit(static_cast<int>(interval_ms))) break;
    Result<std::vector<DeviceRuntimeStats>> stats = node.value().stats();
    if (!stats.ok()) return fail(stats.status());
    auto now = std::chrono::steady_clock::now();
    double interval_s = std::chrono::duration<double>(now - last).count();
    last = now;
    std::string screen = ctl::format_top(stats.value(), previous, interval_s, socket_path);
    if (terminal) std::fputs("\033[H\033[2J", stdout);
    std::fputs(screen.c_str(), stdout);
    if (!terminal) std::fputs("\n", stdout);
    std::fflush(stdout);
    previous = std::move(stats).value();
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return run(argc, argv); }
