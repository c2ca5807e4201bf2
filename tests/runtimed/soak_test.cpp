// Soak (issue 12): a real membard (host backend), 8 client worker processes doing random
// acquire / write / release / offload / prefetch / host access / free with every page's contents
// checked, random kill -9 of workers (restarted at once), and a misbehaving peer that takes turns
// at being a slow reader (a ping flood it never reads, a client deaf to its events), a crowd of
// idle connections and a source of garbage bytes. Throughout: 0 corrupted pages, 0 leaked bytes
// (every page a worker acquires holds zeros or its own words), the daemon answers pings (p50 /
// p99 printed; p99 <= 100 ms asserted only on a machine that is not overloaded), and a killed
// client is reclaimed within 1 s. MEMBAR_SOAK_SECONDS sets the duration (default 90).
#include <random>

#include "daemon_harness.h"

namespace membar::integration {
namespace {

constexpr int kWorkers = 8;

struct WorkerSlot {
  Process process;
  int generation = 0;
  Clock::time_point started;
};

struct Tally {
  uint64_t runs = 0, finished = 0, killed = 0, cycles = 0, corrupted = 0, leaked_words = 0, failed_calls = 0,
           lost = 0, checked = 0, exhausted = 0;
  std::vector<std::string> failures;
};

uint64_t field(const std::string& line, const std::string& name) {
  std::smatch match;
  if (!std::regex_search(line, match, std::regex(name + "=([0-9]+)"))) return 0;
  return std::stoull(match[1]);
}

// Adds what a worker's output reports: its RESULT line, or (killed) its last PROGRESS line.
void account(const std::string& output, bool killed, int code, Tally& tally) {
  ++tally.runs;
  size_t at = output.rfind(killed ? "PROGRESS " : "RESULT ");
  if (at == std::string::npos) {
    if (!killed) tally.failures.push_back("a worker ended (code " + std::to_string(code) + ") without a RESULT:\n" + output);
    if (killed) ++tally.killed;
    return;
  }
  std::string line = output.substr(at, output.find('\n', at) - at);
  tally.cycles += field(line, "cycles");
  tally.corrupted += field(line, "corrupted");
  tally.leaked_words += field(line, "leaked_words");
  tally.failed_calls += field(line, "failed_calls");
  tally.checked += field(line, "checked");
  if (killed) {
    ++tally.killed;
    return;
  }
  ++tally.finished;
  tally.lost += field(line, "lost");
  tally.exhausted += field(line, "exhausted");
  if (code != 0) tally.failures.push_back("a worker failed (code " + std::to_string(code) + "):\n" + output);
}

// The misbehaving peer: one kind of trouble after another until `stop`.
void misbehave(const std::string& socket_path, std::atomic<bool>& stop, std::atomic<uint64_t>& episodes) {
  std::mt19937 random(4242);
  while (!stop.load()) {
    switch (episodes.load() % 4) {
      case 0: {  // a slow reader: pings it never reads
        int fd = connect_unix(socket_path);
        if (fd < 0) break;
        v2::HelloV2 hello{};
        hello.role = static_cast<uint32_t>(v2::Role::kAdmin);
        (void)wire::send_message(fd, v2::encode_message(v2::MessageType::kHello, hello));
        std::vector<uint8_t> burst;
        for (int i = 0; i < 1024; ++i) {
          auto ping = v2::encode_message(v2::MessageType::kPing, v2::PingV2{uint64_t(i)});
          burst.insert(burst.end(), ping.begin(), ping.end());
        }
        auto start = Clock::now();
        while (!stop.load() && seconds_since(start) < 3) {
          ssize_t n = ::send(fd, burst.data(), burst.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
          if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) break;  // dropped
          std::this_thread::sleep_for(std::chrono::milliseconds(n < 0 ? 5 : 1));
        }
        ::close(fd);
        break;
      }
      case 1: {  // a client deaf to its events (channel grants with descriptors)
        RawPeer deaf;
        if (!deaf.handshake(socket_path, "deaf")) break;
        deaf.read_events = false;
        auto start = Clock::now();
        while (!stop.load() && seconds_since(start) < 3) {
          v2::RequestV2 create = RawPeer::make(v2::Opcode::kCreateChannel);
          create.argument = 4096;
          create.payload_bytes = 4;
          auto created = deaf.call(create, "deaf", 1.0);
          if (created.code == StatusCode::UNAVAILABLE || created.code == StatusCode::RESOURCE_EXHAUSTED) {
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
            continue;
          }
          if (created.code != StatusCode::OK) break;
          v2::RequestV2 close = RawPeer::make(v2::Opcode::kCloseChannel);
          close.argument = created.value;
          if (deaf.call(close, "", 1.0).code != StatusCode::OK) break;
        }
        break;
      }
      case 2: {  // a crowd of idle connections that never say hello
        std::vector<int> fds;
        for (int i = 0; i < 40; ++i) {
          int fd = connect_unix(socket_path, true);
          if (fd >= 0) fds.push_back(fd);
        }
        for (int i = 0; i < 30 && !stop.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        for (int fd : fds) ::close(fd);
        break;
      }
      default: {  // garbage bytes
        for (int i = 0; i < 20 && !stop.load(); ++i) {
          int fd = connect_unix(socket_path);
          if (fd < 0) continue;
          std::vector<uint8_t> garbage(1 + random() % 300);
          for (uint8_t& byte : garbage) byte = uint8_t(random());
          (void)::send(fd, garbage.data(), garbage.size(), MSG_NOSIGNAL);
          (void)peer_closes(fd, 500);
          ::close(fd);
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        break;
      }
    }
    ++episodes;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

TEST_F(DaemonTest, SoakWithKilledWorkersAndAMisbehavingPeer) {
  double soak_s = 90;
  if (const char* text = std::getenv("MEMBAR_SOAK_SECONDS")) soak_s = std::max(5.0, std::atof(text));
  start_daemon({"--default-gpu-quota", "8MiB", "--default-host-quota", "32MiB", "--max-connections", "96",
                "--handshake-timeout", "2000", "--queue-limit", "1MiB"},
               "64MiB", "256MiB");
  std::vector<std::string> shm_before = dev_shm_entries();
  PingMonitor monitor(socket_path_, std::chrono::milliseconds(20));
  ASSERT_TRUE(monitor.connected());
  AdminPeer admin;
  ASSERT_TRUE(admin.open(socket_path_));
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> episodes{0};
  std::thread peer([&] { misbehave(socket_path_, stop, episodes); });

  std::mt19937 random(777);
  auto soak_start = Clock::now();
  auto remaining = [&] { return soak_s - seconds_since(soak_start); };
  std::vector<WorkerSlot> slots(kWorkers);
  uint64_t seeds = 1;
  auto launch = [&](int w) {
    double seconds = std::min(remaining(), 8.0 + double(random() % 15));
    WorkerSlot& slot = slots[w];
    slot.process = Process::spawn({WORKER_PATH, "soak", "--socket", socket_path_, "--seed", std::to_string(seeds++),
                                   "--seconds", std::to_string(std::max(1.0, seconds))},
                                  directory_ + "/worker" + std::to_string(w) + "." + std::to_string(slot.generation++) +
                                      ".out");
    slot.started = Clock::now();
  };
  for (int w = 0; w < kWorkers; ++w) launch(w);

  Tally tally;
  std::vector<double> reclaim_ms;
  int ctl_pings = 0, ctl_failures = 0;
  auto next_kill = Clock::now() + std::chrono::seconds(3);
  auto next_ctl = Clock::now() + std::chrono::seconds(2);
  while (remaining() > 0) {
    for (int w = 0; w < kWorkers; ++w) {
      WorkerSlot& slot = slots[w];
      if (slot.process.pid > 0 && !slot.process.running()) {
        int code = slot.process.wait(1);
        account(slot.process.output(), false, code, tally);
        if (remaining() > 3) launch(w);
      }
    }
    if (Clock::now() > next_kill) {
      // kill -9 a worker that has been running a while, then time its reclaim.
      int w = int(random() % kWorkers);
      WorkerSlot& slot = slots[w];
      if (slot.process.pid > 0 && slot.process.running() && seconds_since(slot.started) > 1.0) {
        int32_t pid = slot.process.pid;
        slot.process.kill_now(SIGKILL);
        auto killed_at = Clock::now();
        slot.process.wait(5);
        bool gone = false;
        while (seconds_since(killed_at) < 5) {
          auto stats = admin.stats_page(0, 1);
          if (stats.ok()) {
            gone = true;
            for (const ClientStats& c : stats.value().clients) gone = gone && c.pid != pid;
            if (gone) break;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        reclaim_ms.push_back(gone ? seconds_since(killed_at) * 1000 : 5000);
        account(slot.process.output(), true, 0, tally);
        if (remaining() > 3) launch(w);
      }
      next_kill = Clock::now() + std::chrono::milliseconds(1500 + random() % 3000);
    }
    if (Clock::now() > next_ctl) {
      int code = -1;
      std::string out = ctl("ping", &code);
      ++ctl_pings;
      if (code != 0 || out.find("alive") == std::string::npos) {
        ++ctl_failures;
        std::printf("membarctl ping failed: %s\n", out.c_str());
      }
      next_ctl = Clock::now() + std::chrono::seconds(2);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // The last runs end on their own.
  for (int w = 0; w < kWorkers; ++w) {
    WorkerSlot& slot = slots[w];
    if (slot.process.pid <= 0) continue;
    int code = slot.process.wait(60);
    account(slot.process.output(), code == -1, code, tally);
  }
  stop = true;
  peer.join();
  monitor.stop();

  Percentiles ping = percentiles(monitor.samples());
  Percentiles reclaim = percentiles(reclaim_ms);
  double load = load_per_core();
  std::printf("soak %.0f s: %llu worker runs (%llu finished, %llu killed -9), %llu cycles, %llu pages checked, "
              "%llu corrupted, %llu leaked words, %llu lost, %llu failed calls, %llu exhausted answers\n",
              soak_s, (unsigned long long)tally.runs, (unsigned long long)tally.finished,
              (unsigned long long)tally.killed, (unsigned long long)tally.cycles, (unsigned long long)tally.checked,
              (unsigned long long)tally.corrupted, (unsigned long long)tally.leaked_words,
              (unsigned long long)tally.lost, (unsigned long long)tally.failed_calls,
              (unsigned long long)tally.exhausted);
  std::printf("misbehaving peer episodes: %llu; membarctl ping: %d runs, %d failed\n",
              (unsigned long long)episodes.load(), ctl_pings, ctl_failures);
  std::printf("ping round trip: %zu samples, p50 %.2f ms, p99 %.2f ms, max %.2f ms; load per core %.2f\n",
              ping.samples, ping.p50, ping.p99, ping.max, load);
  std::printf("reclaim of a killed client: %zu kills, p50 %.1f ms, p99 %.1f ms, max %.1f ms\n", reclaim.samples,
              reclaim.p50, reclaim.p99, reclaim.max);
  for (const std::string& failure : tally.failures) ADD_FAILURE() << failure;
  EXPECT_EQ(tally.corrupted, 0u);
  EXPECT_EQ(tally.leaked_words, 0u) << "a worker read bytes it did not write";
  EXPECT_EQ(tally.lost, 0u);
  EXPECT_EQ(tally.failed_calls, 0u);
  EXPECT_GT(tally.killed, 3u) << "the soak should kill workers";
  EXPECT_GT(tally.checked, 1000u);
  EXPECT_GT(episodes.load(), 4u);
  EXPECT_EQ(ctl_failures, 0);
  EXPECT_LE(reclaim.max, 1000.0) << "a killed client was reclaimed after more than 1 s";
  EXPECT_LT(ping.max, 5000.0) << "a ping took seconds: the daemon stalled";
  if (load <= 1.5) {
    EXPECT_LE(ping.p99, 100.0);
  } else {
    std::printf("NOTE: the machine is overloaded (load per core %.2f, 8 workers on %u cores): the 100 ms p99 bound "
                "is not asserted\n",
                load, std::thread::hardware_concurrency());
  }
  EXPECT_TRUE(pools_empty(10)) << "memory was not returned once every worker left";
  EXPECT_EQ(dev_shm_entries(), shm_before);
  daemon_.kill_now(SIGTERM);
  EXPECT_EQ(daemon_.wait(10), 0) << "SIGTERM after the soak";
}

}  // namespace
}  // namespace membar::integration
