// What the integration tests share: child processes with captured output, a membard started per
// test in its own directory, raw protocol-v2 peers (a client that speaks the rings by hand and
// keeps the descriptors it is sent, an admin connection for pings and stats pages), and a ping
// monitor that measures the daemon's liveness while something else goes on.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "membar/client.h"
#include "membar/common/wire_socket.h"
#include "membar/protocol/ring.h"
#include "membar/protocol/v2.h"

namespace membar::integration {

namespace v2 = protocol::v2;
using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A child process with its stdout and stderr captured in a file.
struct Process {
  pid_t pid = -1;
  std::string output_path;

  Process() = default;
  Process(Process&& other) noexcept : pid(std::exchange(other.pid, -1)), output_path(std::move(other.output_path)) {}
  Process& operator=(Process&& other) noexcept {
    if (this != &other) {
      reap();
      pid = std::exchange(other.pid, -1);
      output_path = std::move(other.output_path);
    }
    return *this;
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process() { reap(); }

  void reap() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      pid = -1;
    }
  }

  static Process spawn(const std::vector<std::string>& argv, const std::string& output_path) {
    Process process;
    process.output_path = output_path;
    process.pid = ::fork();
    if (process.pid == 0) {
      int fd = ::open(output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
      std::vector<char*> args;
      for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    return process;
  }

  // Exit status (or 128 + signal); -1 if it did not exit within timeout_s.
  int wait(double timeout_s) {
    auto start = Clock::now();
    while (pid > 0 && seconds_since(start) < timeout_s) {
      int status = 0;
      pid_t done = ::waitpid(pid, &status, WNOHANG);
      if (done == pid) {
        pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return -1;
  }

  // True while the child has not exited (it is not reaped here).
  bool running() const {
    siginfo_t info{};
    return pid > 0 && ::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 &&
           info.si_pid == 0;
  }

  void kill_now(int signal_number = SIGKILL) {
    if (pid > 0) ::kill(pid, signal_number);
  }

  std::string output() const {
    std::string text;
    if (FILE* f = std::fopen(output_path.c_str(), "r")) {
      char buffer[4096];
      size_t n;
      while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) text.append(buffer, n);
      std::fclose(f);
    }
    return text;
  }
};

inline std::string run_command(const std::string& command, int* exit_code = nullptr) {
  std::string output;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return output;
  char buffer[65536];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) output.append(buffer, n);
  int status = ::pclose(pipe);
  if (exit_code != nullptr) *exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return output;
}

inline size_t count_occurrences(const std::string& text, const std::string& needle) {
  size_t count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++count;
  return count;
}

inline int connect_unix(const std::string& path, bool nonblocking = false) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0);
  if (fd < 0) return -1;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, path.c_str(), sizeof(address.sun_path) - 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 && errno != EINPROGRESS) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Reads messages from a raw socket until one arrives (or EOF / timeout).
inline std::optional<wire::ReceivedMessage> read_one(int fd, wire::MessageAssembler& assembler, int timeout_ms = 3000) {
  auto start = Clock::now();
  while (seconds_since(start) * 1000 < timeout_ms) {
    auto next = assembler.next();
    if (!next.ok()) return std::nullopt;
    if (next.value().has_value()) return std::move(*next.value());
    pollfd p{fd, POLLIN, 0};
    ::poll(&p, 1, 20);
    if (!assembler.read_available(fd).ok()) {
      auto last = assembler.next();
      if (last.ok() && last.value().has_value()) return std::move(*last.value());
      return std::nullopt;
    }
  }
  return std::nullopt;
}

// True when the peer has closed `fd` (EOF) within timeout_ms.
inline bool peer_closes(int fd, int timeout_ms = 3000) {
  auto start = Clock::now();
  while (seconds_since(start) * 1000 < timeout_ms) {
    char byte[4096];
    ssize_t n = ::recv(fd, byte, sizeof(byte), MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return true;
    if (n < 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

// Raises this process's open-file limit to its hard limit; returns the limit in force.
inline uint64_t raise_open_file_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return 1024;
  limit.rlim_cur = limit.rlim_max;
  (void)::setrlimit(RLIMIT_NOFILE, &limit);
  (void)::getrlimit(RLIMIT_NOFILE, &limit);
  return limit.rlim_cur;
}

inline int count_fds_of(pid_t pid) {
  std::string out = run_command("ls /proc/" + std::to_string(pid) + "/fd | wc -l");
  return std::atoi(out.c_str());
}

// Names in /dev/shm (the test checks that nothing membar makes appears there).
inline std::vector<std::string> dev_shm_entries() {
  std::vector<std::string> names;
  std::string out = run_command("ls -1 /dev/shm");
  size_t start = 0;
  while (start < out.size()) {
    size_t end = out.find('\n', start);
    if (end == std::string::npos) end = out.size();
    if (end > start) names.push_back(out.substr(start, end - start));
    start = end + 1;
  }
  return names;
}

// p50 / p99 / max of samples in milliseconds.
struct Percentiles {
  size_t samples = 0;
  double p50 = 0, p99 = 0, max = 0;
};
inline Percentiles percentiles(std::vector<double> values) {
  Percentiles out;
  out.samples = values.size();
  if (values.empty()) return out;
  std::sort(values.begin(), values.end());
  auto at = [&](double q) { return values[std::min(values.size() - 1, size_t(q * double(values.size())))]; };
  out.p50 = at(0.5);
  out.p99 = at(0.99);
  out.max = values.back();
  return out;
}

// The 1-minute load average per core: above ~1.5 latency bounds are not asserted (shared CI
// machines), only printed.
inline double load_per_core() {
  double load[1] = {0};
  if (::getloadavg(load, 1) != 1) return 0;
  return load[0] / std::max(1u, std::thread::hardware_concurrency());
}

// An admin connection spoken by hand (protocol v2): pings and pages of stats.
class AdminPeer {
 public:
  ~AdminPeer() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool open(const std::string& socket_path) {
    fd_ = connect_unix(socket_path);
    if (fd_ < 0) return false;
    v2::HelloV2 hello{};
    hello.role = static_cast<uint32_t>(v2::Role::kAdmin);
    v2::copy_text(hello.client_name, sizeof(hello.client_name), "test-admin");
    if (!wire::send_message(fd_, v2::encode_message(v2::MessageType::kHello, hello)).ok()) return false;
    auto reply = read_one(fd_, assembler_);
    return reply && reply->header.type == static_cast<uint16_t>(v2::MessageType::kHelloReply);
  }
  // Round trip of one ping in milliseconds; negative when it failed (or took over timeout_ms).
  double ping(int timeout_ms = 5000) {
    v2::PingV2 ping{++nonce_};
    auto start = Clock::now();
    if (!wire::send_message(fd_, v2::encode_message(v2::MessageType::kPing, ping), {}, timeout_ms).ok()) return -1;
    for (;;) {
      int left = timeout_ms - int(seconds_since(start) * 1000);
      if (left <= 0) return -1;
      auto reply = read_one(fd_, assembler_, left);
      if (!reply) return -1;
      if (reply->header.type != static_cast<uint16_t>(v2::MessageType::kPong)) continue;
      auto pong = v2::decode_ping(reply->payload);
      if (pong.ok() && pong.value().nonce == ping.nonce) return seconds_since(start) * 1000;
    }
  }
  // One page of the admin stats; `payload_bytes` gets the reply's size.
  Result<RuntimeStats> stats_page(uint32_t first, uint32_t max, size_t* payload_bytes = nullptr) {
    v2::StatsRequestV2 request{first, max};
    MEMBAR_RETURN_IF_ERROR(wire::send_message(fd_, v2::encode_message(v2::MessageType::kStatsRequest, request)));
    for (;;) {
      auto reply = read_one(fd_, assembler_, 10000);
      if (!reply) return unavailable("no stats reply");
      if (reply->header.type == static_cast<uint16_t>(v2::MessageType::kError)) {
        return internal_error("the daemon answered with an error");
      }
      if (reply->header.type != static_cast<uint16_t>(v2::MessageType::kStatsReply)) continue;
      if (payload_bytes != nullptr) *payload_bytes = reply->payload.size();
      return v2::decode_stats(reply->payload);
    }
  }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  wire::MessageAssembler assembler_;
  uint64_t nonce_ = 0;
};

// Pings the daemon every `interval` from its own admin connection and thread, recording round
// trips (a failed or lost ping counts as 10 s).
class PingMonitor {
 public:
  PingMonitor(const std::string& socket_path, std::chrono::milliseconds interval) {
    ok_ = admin_.open(socket_path);
    thread_ = std::thread([this, interval] {
      while (!stop_.load()) {
        double ms = ok_ ? admin_.ping() : -1;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          samples_.push_back(ms < 0 ? 10000.0 : ms);
        }
        std::this_thread::sleep_for(interval);
      }
    });
  }
  ~PingMonitor() { stop(); }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  bool connected() const { return ok_; }
  std::vector<double> samples() {
    std::lock_guard<std::mutex> lock(mutex_);
    return samples_;
  }

 private:
  AdminPeer admin_;
  bool ok_ = false;
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::vector<double> samples_;
  std::thread thread_;
};

// A trainer client spoken by hand (protocol v2): the test can send what no DaemonClient would,
// stop reading its socket, and keep the descriptors it was granted after the daemon took them back.
struct RawPeer {
  int fd = -1;
  wire::MessageAssembler assembler;
  void* segment = nullptr;
  uint64_t segment_bytes = 0;
  v2::HelloReplyV2 hello_reply{};
  v2::SegmentLayout layout;
  protocol::RingEnd<v2::RequestV2> requests;
  protocol::RingEnd<v2::CompletionV2> completions;
  uint64_t sequence = 0;
  uint64_t events_seen = 0;
  bool read_events = true;                       // false: never read the socket after the handshake
  std::map<uint32_t, UniqueFd> gpu_frames;       // window frame -> the descriptor it came with
  std::map<uint32_t, UniqueFd> slabs;            // slab -> descriptor
  std::vector<UniqueFd> channels;

  ~RawPeer() {
    if (segment != nullptr) ::munmap(segment, segment_bytes);
    if (fd >= 0) ::close(fd);
  }

  bool send_raw(const std::vector<uint8_t>& bytes) { return wire::send_message(fd, bytes).ok(); }

  // Full client handshake; returns false on any failure.
  bool handshake(const std::string& path, const std::string& name = "raw", uint64_t gpu_quota = 0,
                 uint64_t host_quota = 0) {
    fd = connect_unix(path);
    if (fd < 0) return false;
    v2::HelloV2 hello{};
    hello.gpu_quota_bytes = gpu_quota;
    hello.host_quota_bytes = host_quota;
    v2::copy_text(hello.client_name, sizeof(hello.client_name), name);
    if (!send_raw(v2::encode_message(v2::MessageType::kHello, hello))) return false;
    auto reply = read_one(fd, assembler);
    if (!reply || reply->header.type != static_cast<uint16_t>(v2::MessageType::kHelloReply)) return false;
    auto decoded = v2::decode_hello_reply(reply->payload);
    if (!decoded.ok() || decoded.value().status != 0 || reply->fds.size() != 2) return false;
    hello_reply = decoded.value();
    segment_bytes = hello_reply.segment_bytes;
    segment = ::mmap(nullptr, segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, reply->fds[1].get(), 0);
    if (segment == MAP_FAILED) {
      segment = nullptr;
      return false;
    }
    auto read = v2::read_segment_header(segment, segment_bytes);
    if (!read.ok()) return false;
    layout = read.value();
    auto* base = static_cast<uint8_t*>(segment);
    requests = protocol::RingEnd<v2::RequestV2>(base + layout.request_ring_offset, layout.ring_capacity);
    completions = protocol::RingEnd<v2::CompletionV2>(base + layout.completion_ring_offset, layout.ring_capacity);
    return true;
  }

  // Reads and keeps whatever the socket holds (events and their descriptors).
  void drain() {
    (void)assembler.read_available(fd);
    for (;;) {
      auto next = assembler.next();
      if (!next.ok() || !next.value().has_value()) return;
      wire::ReceivedMessage& message = *next.value();
      auto type = static_cast<v2::MessageType>(message.header.type);
      uint64_t event = v2::event_sequence(type, message.payload);
      if (event != 0) events_seen = event;
      if (type == v2::MessageType::kFrameGrant) {
        auto grant = v2::decode_frame_grant(message.payload);
        if (grant.ok()) gpu_frames[grant.value().window_frame] = std::move(message.fds[0]);
      } else if (type == v2::MessageType::kSlabGrant) {
        auto grant = v2::decode_slab_grant(message.payload);
        if (grant.ok()) slabs[grant.value().slab] = std::move(message.fds[0]);
      } else if (type == v2::MessageType::kChannelGrant) {
        channels.push_back(std::move(message.fds[0]));
      }
    }
  }

  struct Answer {
    StatusCode code = StatusCode::OK;
    std::string message;
    Ticket ticket = 0;
    uint64_t value = 0;
  };

  // Pushes a request (sequence filled in) and returns its completion, after reading the events
  // it names (unless read_events is off).
  Answer call(v2::RequestV2 request, const std::string& payload = "", double timeout_s = 3) {
    auto* base = static_cast<uint8_t*>(segment);
    std::memcpy(base + layout.request_payload_offset, payload.data(), payload.size());
    request.sequence = ++sequence;
    if (!requests.try_push(request)) return {StatusCode::INTERNAL, "ring full"};
    auto start = Clock::now();
    v2::CompletionV2 completion;
    while (seconds_since(start) < timeout_s) {
      if (completions.try_pop(completion) > 0) {
        if (completion.sequence != request.sequence) continue;
        Answer answer;
        answer.code = static_cast<StatusCode>(completion.status);
        answer.ticket = completion.ticket;
        answer.value = completion.value;
        if (completion.status != 0) {
          answer.message.assign(reinterpret_cast<const char*>(base + layout.response_payload_offset),
                                completion.payload_bytes);
        }
        while (read_events && events_seen < completion.events_through && seconds_since(start) < timeout_s) {
          drain();
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
        return answer;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    return {StatusCode::DEADLINE_EXCEEDED, "no completion"};
  }

  static v2::RequestV2 make(v2::Opcode opcode, SpaceId space = 0, uint32_t first = 0, uint32_t count = 0) {
    v2::RequestV2 request{};
    request.opcode = static_cast<uint16_t>(opcode);
    request.space = space;
    request.first_page = first;
    request.page_count = count;
    return request;
  }
  Answer create_space(const std::string& name, uint64_t page_bytes, uint32_t pages) {
    v2::RequestV2 request = make(v2::Opcode::kCreateSpace, 0, 0, pages);
    request.argument = page_bytes;
    request.payload_bytes = uint32_t(name.size());
    return call(request, name);
  }
  // Waits for a ticket through the segment's completed word.
  bool wait(Ticket ticket, double timeout_s = 5) {
    auto* header = static_cast<v2::SegmentHeaderV2*>(segment);
    auto start = Clock::now();
    while (std::atomic_ref<uint64_t>(header->completed_ticket).load() < ticket) {
      if (seconds_since(start) > timeout_s) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return true;
  }
};

// Fills bytes with words that carry a 24-bit signature in their top bits (never zero), so that
// any word read later tells whose it is: zero (never written), this signature, or someone else's.
inline uint64_t signed_word(uint32_t signature, uint64_t key, uint64_t index) {
  uint64_t x = (key + 1) * 0x9e3779b97f4a7c15ull + index * 0xbf58476d1ce4e5b9ull;
  x ^= x >> 31;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 29;
  return (uint64_t(signature & 0xffffff) << 40) | (x & 0xffffffffffull) | 1;
}
inline void fill_signed(void* bytes, uint64_t count, uint32_t signature, uint64_t key) {
  auto* words = static_cast<uint64_t*>(bytes);
  for (uint64_t i = 0; i < count / 8; ++i) words[i] = signed_word(signature, key, i);
}
inline bool check_signed(const void* bytes, uint64_t count, uint32_t signature, uint64_t key) {
  const auto* words = static_cast<const uint64_t*>(bytes);
  for (uint64_t i = 0; i < count / 8; ++i) {
    if (words[i] != signed_word(signature, key, i)) return false;
  }
  return true;
}
// Words that are neither zero nor signed by `signature`: bytes this reader did not write.
inline uint64_t foreign_words(const void* bytes, uint64_t count, uint32_t signature) {
  const auto* words = static_cast<const uint64_t*>(bytes);
  uint64_t foreign = 0;
  for (uint64_t i = 0; i < count / 8; ++i) {
    if (words[i] != 0 && (words[i] >> 40) != (signature & 0xffffff)) ++foreign;
  }
  return foreign;
}

// Runs a membard per test in a private directory (host backend unless a test says otherwise).
class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char pattern[] = "/tmp/membar-it-XXXXXX";
    directory_ = ::mkdtemp(pattern);
    socket_path_ = directory_ + "/membard.sock";
  }

  void TearDown() override {
    daemon_.kill_now(SIGKILL);
    daemon_.wait(5);
    run_command("rm -rf " + directory_);
  }

  // Starts membard and waits until it accepts connections.
  void start_daemon(std::vector<std::string> extra = {}, const std::string& gpu_pool = "32MiB",
                    const std::string& host_pool = "128MiB") {
    std::vector<std::string> argv = {MEMBARD_PATH, "--backend", backend_, "--socket", socket_path_, "--gpu-pool",
                                     gpu_pool, "--host-pool", host_pool, "--log-level", "info"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    daemon_ = Process::spawn(argv, directory_ + "/membard.log");
    auto start = Clock::now();
    while (seconds_since(start) < 10) {
      int fd = connect_unix(socket_path_);
      if (fd >= 0) {
        ::close(fd);
        return;
      }
      if (!daemon_.running()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    FAIL() << "membard did not start: " << daemon_.output();
  }

  std::unique_ptr<Client> connect_client(const std::string& name, uint64_t gpu_quota = 0, uint64_t host_quota = 0) {
    ConnectOptions options;
    options.client_name = name;
    options.gpu_quota_bytes = gpu_quota;
    options.host_quota_bytes = host_quota;
    auto client = connect_daemon(socket_path_, options);
    EXPECT_TRUE(client.ok()) << client.status().to_string();
    return client.ok() ? std::move(client).value() : nullptr;
  }

  std::string ctl(const std::string& arguments, int* code = nullptr) {
    return run_command(std::string(MEMBARCTL_PATH) + " --socket " + socket_path_ + " " + arguments, code);
  }

  // frames_used of a tier, read through `membarctl stats --json`.
  int64_t frames_used(const char* tier) {
    std::string json = ctl("stats --json");
    std::smatch match;
    std::regex pattern(std::string("\"tier\": \"") + tier + "\", \"frames_total\": [0-9]+, \"frames_used\": ([0-9]+)");
    if (!std::regex_search(json, match, pattern)) return -1;
    return std::stoll(match[1]);
  }

  // Waits until both pools are back to no frames used (renewals done).
  bool pools_empty(double timeout_s = 5) {
    auto start = Clock::now();
    while (seconds_since(start) < timeout_s) {
      if (frames_used("gpu") == 0 && frames_used("host") == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

  std::string backend_ = "host";
  std::string directory_;
  std::string socket_path_;
  Process daemon_;
};

// Acts as uid/gid 65534 (nobody) in a forked child, runs `body` there and returns its exit code
// (10: setuid failed). Only for tests running as root.
template <typename Body>
int as_other_user(Body&& body) {
  pid_t child = ::fork();
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(10);
    ::_exit(body());
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace membar::integration
