// membard under hostile and careless clients (issue 12), against a real daemon on the host
// backend: no bytes leak between clients (killed owners, revoked descriptors), a peer that stops
// reading cannot stall the daemon, resources stay bounded (connections, handshakes, spaces,
// channel bytes), stats never walk pages, processes of one user are isolated, and nothing is left
// behind. Tests that act as a second Unix user need root (uid 65534 via setuid) and skip otherwise.
#include "daemon_harness.h"

namespace membar::integration {
namespace {

constexpr uint64_t k2M = 2ull << 20;

// Prints the latency summary and asserts p99 <= 100 ms unless the machine is overloaded.
void expect_responsive(const std::vector<double>& samples, const char* during) {
  Percentiles p = percentiles(samples);
  double load = load_per_core();
  std::printf("ping during %s: %zu samples, p50 %.2f ms, p99 %.2f ms, max %.2f ms (load per core %.2f)\n", during,
              p.samples, p.p50, p.p99, p.max, load);
  ASSERT_GT(p.samples, 5u) << "the monitor could not ping";
  EXPECT_LT(p.max, 5000.0) << "a ping was lost or took seconds: the daemon stalled during " << during;
  if (load <= 1.5) {
    EXPECT_LE(p.p99, 100.0) << "ping p99 over 100 ms during " << during;
  } else {
    std::printf("NOTE: the machine is overloaded (load per core %.2f): the 100 ms p99 bound is not asserted\n", load);
  }
}

// Acquire/release cycles per second of `client` over `seconds` (one 64 KiB page).
double op_rate(Client& client, SpaceId space, double seconds, double* worst_ms = nullptr) {
  auto start = Clock::now();
  uint64_t ops = 0;
  double worst = 0;
  while (seconds_since(start) < seconds) {
    auto op_start = Clock::now();
    auto acquired = client.acquire({space, 0, 1}, 0);
    if (!acquired.ok() || !client.wait(acquired.value().ticket).ok() || !client.release({space, 0, 1}, false).ok()) {
      ADD_FAILURE() << "an op failed: " << acquired.status().to_string();
      return 0;
    }
    worst = std::max(worst, seconds_since(op_start) * 1000);
    ++ops;
  }
  if (worst_ms != nullptr) *worst_ms = worst;
  return double(ops) / seconds_since(start);
}

// ---- (1) No leaks between clients -------------------------------------------------------------

// A client that filled every GPU frame and every host slab with its words is killed (-9); the
// next client, asking for no zero-fill, reads zeros everywhere, including past its spaces' ends.
TEST_F(DaemonTest, ANewClientReadsOnlyZerosAfterAKilledOwner) {
  start_daemon({}, "16MiB", "32MiB");
  constexpr uint32_t kSignature = 0x5ec7e7;
  Process filler = Process::spawn({WORKER_PATH, "fill", "--socket", socket_path_, "--signature",
                                   std::to_string(kSignature)},
                                  directory_ + "/filler.out");
  auto start = Clock::now();
  while (filler.output().find("READY") == std::string::npos && seconds_since(start) < 20) {
    ASSERT_TRUE(filler.running()) << filler.output();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_NE(filler.output().find("READY gpu_frames=8 host_frames=16"), std::string::npos) << filler.output();
  EXPECT_EQ(frames_used("gpu"), 8);
  EXPECT_EQ(frames_used("host"), 16);
  filler.kill_now(SIGKILL);
  ASSERT_EQ(filler.wait(5), 128 + SIGKILL);
  ASSERT_TRUE(pools_empty());

  auto reader = connect_client("reader");
  ASSERT_TRUE(reader);
  auto gpu = reader->create_space("gpu", k2M, 8);
  ASSERT_TRUE(gpu.ok());
  auto acquired = reader->acquire({gpu.value(), 0, 8}, /*flags=*/0);  // no zero-fill asked for
  ASSERT_TRUE(acquired.ok()) << acquired.status().to_string();
  ASSERT_TRUE(reader->wait(acquired.value().ticket).ok());
  EXPECT_EQ(foreign_words(acquired.value().pointer, 8 * k2M, /*signature=*/0), 0u)
      << "GPU frames of a killed client reached the next one with its bytes";
  ASSERT_TRUE(reader->release({gpu.value(), 0, 8}, false).ok());
  // Host: 15 whole frames and a 1 MiB space whose frame's other half is mapped too.
  auto host = reader->create_space("host", k2M, 15);
  auto tail = reader->create_space("tail", 1 << 20, 1);
  ASSERT_TRUE(host.ok() && tail.ok());
  auto host_pages = reader->acquire_host({host.value(), 0, 15});
  ASSERT_TRUE(host_pages.ok()) << host_pages.status().to_string();
  EXPECT_EQ(foreign_words(host_pages.value(), 15 * k2M, 0), 0u) << "a host slab reached the next client unrenewed";
  auto tail_page = reader->acquire_host({tail.value(), 0, 1});
  ASSERT_TRUE(tail_page.ok()) << tail_page.status().to_string();
  EXPECT_EQ(foreign_words(tail_page.value(), k2M, 0), 0u) << "the bytes past a space's end leaked";
}

// A client that keeps the descriptors of its frames and slabs after the daemon took them back
// (revoked for another client) reads none of the new owner's bytes through them, and writing
// them changes nothing the new owner sees.
TEST_F(DaemonTest, ADescriptorKeptAfterRevocationReadsNoneOfTheNewOwnersBytes) {
  start_daemon({}, "8MiB", "8MiB");  // 4 GPU frames, 4 host slabs of one frame
  RawPeer hostile;
  ASSERT_TRUE(hostile.handshake(socket_path_, "hostile"));
  auto space = hostile.create_space("x", k2M, 4);
  ASSERT_EQ(space.code, StatusCode::OK) << space.message;
  SpaceId id = SpaceId(space.value);
  auto acquired = hostile.call(RawPeer::make(v2::Opcode::kAcquire, id, 0, 4));
  for (int attempt = 0; acquired.code == StatusCode::UNAVAILABLE && attempt < 200; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    acquired = hostile.call(RawPeer::make(v2::Opcode::kAcquire, id, 0, 4));
  }
  ASSERT_EQ(acquired.code, StatusCode::OK) << acquired.message;
  auto release = RawPeer::make(v2::Opcode::kRelease, id, 0, 4);
  release.flags = v2::kReleaseDirty;
  ASSERT_EQ(hostile.call(release).code, StatusCode::OK);
  RawPeer::Answer offloaded;
  for (int attempt = 0; attempt < 200; ++attempt) {  // slabs are prepared in the background
    offloaded = hostile.call(RawPeer::make(v2::Opcode::kOffload, id, 0, 4));
    if (offloaded.code != StatusCode::UNAVAILABLE) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(offloaded.code, StatusCode::OK) << offloaded.message;
  ASSERT_TRUE(hostile.wait(offloaded.ticket));
  ASSERT_EQ(hostile.call(RawPeer::make(v2::Opcode::kFreePages, id, 0, 4)).code, StatusCode::OK);
  hostile.drain();
  ASSERT_EQ(hostile.gpu_frames.size(), 4u);
  ASSERT_EQ(hostile.slabs.size(), 4u);

  // The new owner needs the whole pool: the hostile client's idle frames and slabs are revoked.
  constexpr uint32_t kSecret = 0xa11ce5;
  auto owner = connect_client("owner");
  ASSERT_TRUE(owner);
  auto secret = owner->create_space("secret", k2M, 4);
  ASSERT_TRUE(secret.ok());
  auto pages = owner->acquire({secret.value(), 0, 4}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(pages.ok()) << pages.status().to_string();
  ASSERT_TRUE(owner->wait(pages.value().ticket).ok());
  fill_signed(pages.value().pointer, 4 * k2M, kSecret, 1);
  ASSERT_TRUE(owner->release({secret.value(), 0, 4}, true).ok());
  auto written_back = owner->offload({secret.value(), 0, 4});
  ASSERT_TRUE(written_back.ok()) << written_back.status().to_string();
  ASSERT_TRUE(owner->wait(written_back.value()).ok());
  auto on_host = owner->acquire_host({secret.value(), 0, 4});
  ASSERT_TRUE(on_host.ok()) << on_host.status().to_string();
  ASSERT_TRUE(check_signed(on_host.value(), 4 * k2M, kSecret, 1));
  ASSERT_TRUE(owner->release_host({secret.value(), 0, 4}, false).ok());
  auto back = owner->acquire({secret.value(), 0, 4}, 0);  // and on the GPU again
  ASSERT_TRUE(back.ok() && owner->wait(back.value().ticket).ok());
  ASSERT_TRUE(owner->release({secret.value(), 0, 4}, false).ok());

  uint64_t secret_words = 0;
  auto scan = [&](std::map<uint32_t, UniqueFd>& kept) {
    for (auto& [number, fd] : kept) {
      void* old = ::mmap(nullptr, k2M, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
      ASSERT_NE(old, MAP_FAILED);
      const auto* words = static_cast<const uint64_t*>(old);
      for (uint64_t i = 0; i < k2M / 8; ++i) secret_words += (words[i] >> 40) == kSecret;
      std::memset(old, 0xee, k2M);  // and scribbles on what it kept
      ::munmap(old, k2M);
    }
  };
  scan(hostile.gpu_frames);
  scan(hostile.slabs);
  EXPECT_EQ(secret_words, 0u) << "a revoked descriptor reached the new owner's bytes";
  auto again = owner->acquire_host({secret.value(), 0, 4});
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_TRUE(check_signed(again.value(), 4 * k2M, kSecret, 1)) << "the old holder's writes reached the new owner";
  ASSERT_TRUE(owner->release_host({secret.value(), 0, 4}, false).ok());
  auto gpu_again = owner->acquire({secret.value(), 0, 4}, 0);
  ASSERT_TRUE(gpu_again.ok() && owner->wait(gpu_again.value().ticket).ok());
  EXPECT_TRUE(check_signed(gpu_again.value().pointer, 4 * k2M, kSecret, 1));
}

// ---- (2) No stalls --------------------------------------------------------------------------

// A peer that floods pings and never reads its pongs is dropped (and logged) once its queue is
// over the bound; meanwhile the daemon answers pings at once and serves a trainer, and SIGTERM
// still stops it.
TEST_F(DaemonTest, APeerThatNeverReadsItsPongsIsDroppedWhileOthersAreServed) {
  start_daemon({"--queue-limit", "1MiB"});
  PingMonitor monitor(socket_path_, std::chrono::milliseconds(10));
  ASSERT_TRUE(monitor.connected());
  auto trainer = connect_client("trainer");
  ASSERT_TRUE(trainer);
  auto space = trainer->create_space("s", 64 << 10, 4);
  ASSERT_TRUE(space.ok());

  int fd = connect_unix(socket_path_);
  ASSERT_GE(fd, 0);
  v2::HelloV2 hello{};
  hello.role = static_cast<uint32_t>(v2::Role::kAdmin);
  ASSERT_TRUE(wire::send_message(fd, v2::encode_message(v2::MessageType::kHello, hello)).ok());
  std::vector<uint8_t> burst;
  for (int i = 0; i < 4096; ++i) {
    auto ping = v2::encode_message(v2::MessageType::kPing, v2::PingV2{uint64_t(i)});
    burst.insert(burst.end(), ping.begin(), ping.end());
  }
  std::atomic<bool> flooding{true};
  std::atomic<uint64_t> sent{0};
  bool dropped = false;
  std::thread flood([&] {
    size_t offset = 0;
    auto start = Clock::now();
    while (seconds_since(start) < 20) {
      ssize_t n = ::send(fd, burst.data() + offset, burst.size() - offset, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n > 0) {
        sent += uint64_t(n);
        offset = (offset + size_t(n)) % burst.size();
      } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        dropped = true;  // EPIPE / ECONNRESET: the daemon closed us
        break;
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    flooding = false;
  });
  double rate = op_rate(*trainer, space.value(), 2.0);
  flood.join();
  ::close(fd);
  monitor.stop();
  EXPECT_TRUE(dropped) << "the flooding peer was never dropped (" << sent.load() << " bytes sent)";
  EXPECT_GT(rate, 50.0) << "the trainer was starved during the flood";
  std::printf("trainer ops during the ping flood: %.0f/s; the flood sent %.1f MiB before it was dropped\n", rate,
              sent.load() / 1048576.0);
  expect_responsive(monitor.samples(), "a ping flood that never reads");
  std::string log = daemon_.output();
  EXPECT_NE(log.find("stopped reading its socket"), std::string::npos) << log;
  daemon_.kill_now(SIGTERM);
  EXPECT_EQ(daemon_.wait(5), 0) << "SIGTERM did not stop the daemon\n" << daemon_.output();
}

// A trainer that stops reading its socket while its requests make events (channel grants, each
// with a descriptor) is dropped once its queue is over the bound; the daemon keeps serving.
TEST_F(DaemonTest, AClientThatStopsReadingAFloodOfEventsIsDropped) {
  start_daemon();
  PingMonitor monitor(socket_path_, std::chrono::milliseconds(10));
  ASSERT_TRUE(monitor.connected());
  auto trainer = connect_client("trainer");
  ASSERT_TRUE(trainer);
  auto space = trainer->create_space("s", 64 << 10, 4);
  ASSERT_TRUE(space.ok());
  RawPeer deaf;
  ASSERT_TRUE(deaf.handshake(socket_path_, "deaf"));
  deaf.read_events = false;
  std::thread flood([&] {
    for (int i = 0; i < 20000; ++i) {
      v2::RequestV2 create = RawPeer::make(v2::Opcode::kCreateChannel);
      create.argument = 4096;
      create.payload_bytes = 5;
      auto created = deaf.call(create, "flood", 2.0);
      if (created.code == StatusCode::UNAVAILABLE) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));  // host slabs being prepared
        continue;
      }
      if (created.code != StatusCode::OK) break;  // dropped: the ring is no longer served
      v2::RequestV2 close = RawPeer::make(v2::Opcode::kCloseChannel);
      close.argument = created.value;
      if (deaf.call(close, "", 2.0).code != StatusCode::OK) break;
    }
  });
  double rate = op_rate(*trainer, space.value(), 2.0);
  flood.join();
  monitor.stop();
  EXPECT_TRUE(peer_closes(deaf.fd, 5000)) << "the deaf client was not dropped:\n" << daemon_.output();
  EXPECT_GT(rate, 50.0);
  std::printf("trainer ops during the event flood: %.0f/s\n", rate);
  expect_responsive(monitor.samples(), "a client that stopped reading its events");
  EXPECT_NE(daemon_.output().find("stopped reading its socket"), std::string::npos) << daemon_.output();
  // Its channels went with it (the trainer holds no host memory), and so did its entry.
  auto start = Clock::now();
  while (frames_used("host") != 0 && seconds_since(start) < 3) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(frames_used("host"), 0);
  EXPECT_EQ(ctl("stats").find("name: deaf"), std::string::npos);
  daemon_.kill_now(SIGTERM);
  EXPECT_EQ(daemon_.wait(5), 0);
}

// ---- (3) Bounded resources ------------------------------------------------------------------

// As many idle connections as this machine's descriptor limit allows (up to 10,000): the daemon
// holds at most --max-connections of them, refuses the rest with a sentence, logs the limit once,
// keeps serving its clients, and takes new ones once the idle ones time out.
TEST_F(DaemonTest, ManyIdleConnectionsStayUnderTheLimitsAndOthersAreServed) {
  uint64_t limit = raise_open_file_limit();
  int target = int(std::min<uint64_t>(10000, limit > 600 ? limit - 500 : 100));
  start_daemon({"--max-connections", "256", "--handshake-timeout", "3000"});
  auto trainer = connect_client("trainer");
  ASSERT_TRUE(trainer);
  auto space = trainer->create_space("s", 64 << 10, 4);
  ASSERT_TRUE(space.ok());
  PingMonitor monitor(socket_path_, std::chrono::milliseconds(20));
  ASSERT_TRUE(monitor.connected());

  std::vector<int> fds;
  fds.reserve(target);
  auto start = Clock::now();
  int max_daemon_fds = 0;
  while (int(fds.size()) < target && seconds_since(start) < 30) {
    int fd = connect_unix(socket_path_, /*nonblocking=*/true);
    if (fd < 0) {  // the listen backlog is full for a moment
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      continue;
    }
    fds.push_back(fd);
    if (fds.size() % 1000 == 0) max_daemon_fds = std::max(max_daemon_fds, count_fds_of(daemon_.pid));
  }
  double flood_s = seconds_since(start);
  max_daemon_fds = std::max(max_daemon_fds, count_fds_of(daemon_.pid));
  double rate = op_rate(*trainer, space.value(), 1.0);
  std::printf("%zu connections attempted in %.1f s (descriptor limit %llu); the daemon held at most %d descriptors; "
              "trainer ops %.0f/s\n",
              fds.size(), flood_s, (unsigned long long)limit, max_daemon_fds, rate);
  EXPECT_EQ(int(fds.size()), target);
  EXPECT_LT(max_daemon_fds, 2 * 256 + 128) << "the daemon's descriptors grew with the idle connections";
  EXPECT_GT(rate, 50.0);
  std::string log = daemon_.output();
  size_t lines = count_occurrences(log, "connection limit reached");
  EXPECT_GE(lines, 1u) << log.substr(0, 4000);
  EXPECT_LE(lines, size_t(1 + flood_s / 10)) << "the limit was logged per connection, not rate-limited";
  // Refused peers got a sentence before the close.
  int refused = -1;
  for (int fd : fds) {
    wire::MessageAssembler assembler;
    auto message = read_one(fd, assembler, 50);
    if (!message || message->header.type != static_cast<uint16_t>(v2::MessageType::kError)) continue;
    auto error = v2::decode_error(message->payload);
    if (error.ok() && std::string(error.value().message).find("--max-connections") != std::string::npos) {
      refused = fd;
      break;
    }
  }
  EXPECT_GE(refused, 0) << "no refused connection was told why";
  // Once the idle ones time out (3 s), new clients are served.
  start = Clock::now();
  std::unique_ptr<Client> late;
  while (!late && seconds_since(start) < 10) {
    auto connected = connect_daemon(socket_path_, ConnectOptions{});
    if (connected.ok()) late = std::move(connected).value();
    else std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(late) << "no new client was admitted after the idle connections timed out";
  for (int fd : fds) ::close(fd);
  monitor.stop();
  expect_responsive(monitor.samples(), "10,000 idle connections");
}

TEST_F(DaemonTest, APeerThatNeverSaysHelloIsClosedAfterTheHandshakeTimeout) {
  start_daemon({"--handshake-timeout", "300"});
  int fd = connect_unix(socket_path_);
  ASSERT_GE(fd, 0);
  auto start = Clock::now();
  wire::MessageAssembler assembler;
  auto message = read_one(fd, assembler, 3000);
  ASSERT_TRUE(message.has_value()) << "the silent peer was never told";
  ASSERT_EQ(message->header.type, static_cast<uint16_t>(v2::MessageType::kError));
  auto error = v2::decode_error(message->payload);
  ASSERT_TRUE(error.ok());
  EXPECT_EQ(static_cast<StatusCode>(error.value().status), StatusCode::DEADLINE_EXCEEDED);
  EXPECT_NE(std::string(error.value().message).find("no hello within 300 ms"), std::string::npos)
      << error.value().message;
  EXPECT_TRUE(peer_closes(fd, 1000));
  double closed_after = seconds_since(start);
  EXPECT_GE(closed_after, 0.25);
  EXPECT_LT(closed_after, 1.5);
  ::close(fd);
  EXPECT_NE(daemon_.output().find("no hello in time"), std::string::npos);
}

TEST_F(DaemonTest, SpaceLimitsAndQuotasUnderOneFrameAreClearErrors) {
  start_daemon({"--max-spaces", "8", "--max-client-space", "64MiB"});
  auto client = connect_client("limited");
  ASSERT_TRUE(client);
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(client->create_space("s" + std::to_string(i), 4096, 1).ok());
  auto ninth = client->create_space("s8", 4096, 1);
  EXPECT_EQ(ninth.status().code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(ninth.status().message().find("--max-spaces"), std::string::npos) << ninth.status().to_string();
  auto other = connect_client("other");  // the limit is per client
  ASSERT_TRUE(other);
  EXPECT_TRUE(other->create_space("s0", 4096, 1).ok());
  auto big = other->create_space("big", 1 << 20, 65);  // 65 MiB of page table over 64 MiB
  EXPECT_EQ(big.status().code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(big.status().message().find("over its limit"), std::string::npos) << big.status().to_string();
  EXPECT_TRUE(other->create_space("fits", 1 << 20, 60).ok());
  // A quota of one byte (or anything under one 2 MiB frame) is refused with a sentence.
  ConnectOptions tiny;
  tiny.gpu_quota_bytes = 1;
  auto refused = connect_daemon(socket_path_, tiny);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::INVALID_ARGUMENT) << refused.status().to_string();
  EXPECT_NE(refused.status().message().find("less than one 2 MiB frame"), std::string::npos)
      << refused.status().to_string();
  tiny.gpu_quota_bytes = 0;
  tiny.host_quota_bytes = (2 << 20) - 1;
  EXPECT_EQ(connect_daemon(socket_path_, tiny).status().code(), StatusCode::INVALID_ARGUMENT);
  // And as a daemon flag.
  int code = -1;
  std::string out = run_command(std::string(MEMBARD_PATH) + " --backend host --socket " + directory_ +
                                    "/other.sock --default-gpu-quota 1",
                                &code);
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("--default-gpu-quota must be at least one 2MiB frame"), std::string::npos) << out;
}

// All clients' spaces together are bounded too (their page tables are the daemon's memory): many
// clients cannot exhaust it between them; what one frees, another may take; a client that leaves
// returns its share.
TEST_F(DaemonTest, AllClientsSpacesTogetherAreBoundedAndFreedSpaceServesOthers) {
  start_daemon({"--max-client-space", "80MiB", "--max-total-space", "96MiB"});
  auto first = connect_client("first");
  auto second = connect_client("second");
  ASSERT_TRUE(first && second);
  auto a = first->create_space("a", 1 << 20, 60);  // 60 MiB
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  auto b = second->create_space("b", 1 << 20, 40);  // 60 + 40 > 96
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(b.status().message().find("--max-total-space"), std::string::npos) << b.status().to_string();
  EXPECT_TRUE(second->create_space("small", 1 << 20, 30).ok());  // 90 of 96
  ASSERT_TRUE(first->destroy_space(a.value()).ok());
  EXPECT_TRUE(second->create_space("b", 1 << 20, 40).ok()) << "freed space serves another client";
  // A client that leaves returns its spaces' share.
  auto third = connect_client("third");
  ASSERT_TRUE(third);
  EXPECT_FALSE(third->create_space("c", 1 << 20, 30).ok());  // 70 + 30 > 96
  second.reset();
  bool served = false;
  for (int i = 0; i < 100 && !served; ++i) {  // the daemon drops the client asynchronously
    served = third->create_space("c", 1 << 20, 30).ok();
    if (!served) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(served) << "the spaces of a client that left still count";
}

// Channel memory counts against the creator's host quota and the host pool, and stats show it.
TEST_F(DaemonTest, ChannelBytesCountInQuotasPoolsAndStats) {
  start_daemon({}, "8MiB", "32MiB");  // 16 host frames
  auto client = connect_client("publisher", 0, 16 << 20);  // 8 host frames
  ASSERT_TRUE(client);
  auto channel = client->create_channel("sync", 9 << 20);  // 5 frames
  ASSERT_TRUE(channel.ok()) << channel.status().to_string();
  auto stats = client->stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats.value().clients.at(0).channel_bytes, 10ull << 20);
  EXPECT_EQ(frames_used("host"), 5) << "channel frames count as used in the host pool";
  EXPECT_NE(ctl("stats").find("channel_bytes: 10485760 (10 MiB)"), std::string::npos);
  // 5 channel frames + 4 page frames exceed the 8-frame quota.
  auto space = client->create_space("pages", k2M, 4);
  ASSERT_TRUE(space.ok());
  auto over = client->acquire_host({space.value(), 0, 4});
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::RESOURCE_EXHAUSTED) << over.status().to_string();
  EXPECT_EQ(client->create_channel("more", 8 << 20).status().code(), StatusCode::RESOURCE_EXHAUSTED);
  // The pool: another client's channel may not take what is left of the pool past its size.
  auto other = connect_client("other");
  ASSERT_TRUE(other);
  auto too_big = other->create_channel("big", 24 << 20);  // 12 frames; 11 are left
  EXPECT_EQ(too_big.status().code(), StatusCode::RESOURCE_EXHAUSTED) << too_big.status().to_string();
  EXPECT_NE(too_big.status().message().find("host pool"), std::string::npos) << too_big.status().to_string();
  // Closing gives the frames back.
  ASSERT_TRUE(client->close_channel(channel.value().handle).ok());
  EXPECT_EQ(client->stats().value().clients.at(0).channel_bytes, 0u);
  auto fits = client->acquire_host({space.value(), 0, 4});
  EXPECT_TRUE(fits.ok()) << fits.status().to_string();
}

// ---- (4) Stats never walk pages -------------------------------------------------------------

// One client with a huge space (2^25 pages of 64 KiB: 2 TiB, a million space frames) creating it,
// polling stats in a loop and destroying it does not hold the engine. The yardstick is another
// client's op rate in adjacent windows: while a peer hammers the daemon with cheap requests
// (pings, stats of a small space) and while it polls the huge space's stats and the admin stats.
// Stats that walked pages (tens of ms a poll) would cut the rate by far more than 3x; adjacent
// windows keep other load on a 2-core CI machine (tests run two at a time) out of the ratio, and a
// noisy pair is measured again, up to three times.
TEST_F(DaemonTest, AHugeSpaceAndStatsPollingDoNotSlowOtherClients) {
  start_daemon();
  auto worker = connect_client("worker");
  ASSERT_TRUE(worker);
  auto space = worker->create_space("s", 64 << 10, 4);
  ASSERT_TRUE(space.ok());

  RawPeer huge, small;
  ASSERT_TRUE(huge.handshake(socket_path_, "huge"));
  ASSERT_TRUE(small.handshake(socket_path_, "small"));
  ASSERT_EQ(small.create_space("few", 64 << 10, 4).code, StatusCode::OK);
  enum Phase : int { kCreate, kCheap, kStats, kStop };
  std::atomic<int> phase{kCreate};
  std::atomic<bool> created{false};
  std::atomic<uint64_t> cheap_polls{0}, stats_polls{0};
  double create_ms = 0, destroy_ms = 0;
  std::thread poller([&] {
    auto created_at = Clock::now();
    auto made = huge.create_space("history", 64 << 10, 1u << 25);
    create_ms = seconds_since(created_at) * 1000;
    EXPECT_EQ(made.code, StatusCode::OK) << made.message;
    created = true;
    AdminPeer admin;
    EXPECT_TRUE(admin.open(socket_path_));
    for (int now = phase.load(); now != kStop; now = phase.load()) {
      if (now == kCheap) {
        EXPECT_EQ(small.call(RawPeer::make(v2::Opcode::kStats)).code, StatusCode::OK);
        EXPECT_GE(admin.ping(), 0.0);
        cheap_polls += 2;
      } else if (now == kStats) {
        EXPECT_EQ(huge.call(RawPeer::make(v2::Opcode::kStats)).code, StatusCode::OK);
        EXPECT_TRUE(admin.stats_page(0, v2::kMaxStatsSpaces).ok());
        stats_polls += 2;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    auto destroy_at = Clock::now();
    EXPECT_EQ(huge.call(RawPeer::make(v2::Opcode::kDestroySpace, SpaceId(made.value)), "", 30).code, StatusCode::OK);
    destroy_ms = seconds_since(destroy_at) * 1000;
  });
  double worst_during_create = 0;
  while (!created.load()) {
    double worst = 0;
    op_rate(*worker, space.value(), 0.1, &worst);
    worst_during_create = std::max(worst_during_create, worst);
  }
  double cheap = 0, busy = 0, worst_while_polling = 0;
  for (int attempt = 1; attempt <= 3; ++attempt) {
    phase = kCheap;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    cheap = op_rate(*worker, space.value(), 0.75);
    phase = kStats;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    double worst = 0;
    busy = op_rate(*worker, space.value(), 0.75, &worst);
    worst_while_polling = std::max(worst_while_polling, worst);
    std::printf("attempt %d: other client's ops %.0f/s beside cheap requests, %.0f/s beside stats of a 2 TiB "
                "space\n", attempt, cheap, busy);
    if (busy >= cheap / 3) break;
  }
  phase = kStop;
  double worst_during_destroy = 0;
  double after = op_rate(*worker, space.value(), 0.5, &worst_during_destroy);
  poller.join();
  std::printf("%llu cheap polls, %llu stats polls, worst op %.1f ms; create %.0f ms (worst op meanwhile %.1f ms), "
              "destroy %.0f ms (worst op meanwhile %.1f ms, %.0f ops/s)\n",
              (unsigned long long)cheap_polls.load(), (unsigned long long)stats_polls.load(), worst_while_polling,
              create_ms, worst_during_create, destroy_ms, worst_during_destroy, after);
  EXPECT_GT(stats_polls.load(), 20u);
  EXPECT_GE(busy, cheap / 3) << "stats of a huge space cut another client's op rate";
  EXPECT_LT(worst_during_create, 500.0);
  EXPECT_LT(worst_during_destroy, 250.0) << "destroying a huge space held the engine for its whole walk";
}

// ---- (5) Isolation among processes of one user ------------------------------------------------

// Segments travel as descriptors (nothing is named in /dev/shm), and a reader of a published
// channel cannot write it, not even through a read-write re-open of /proc/self/fd.
TEST_F(DaemonTest, SegmentsAreDescriptorsAndReadersCannotWriteChannels) {
  std::vector<std::string> before = dev_shm_entries();
  start_daemon();
  auto publisher = connect_client("publisher");
  ASSERT_TRUE(publisher);
  auto channel = publisher->create_channel("policy", 1 << 20);
  ASSERT_TRUE(channel.ok());
  std::memset(channel.value().data, 0x42, 1 << 20);
  auto reader = connect_client("reader");
  ASSERT_TRUE(reader);
  auto opened = reader->open_channel("policy");
  ASSERT_TRUE(opened.ok()) << opened.status().to_string();
  EXPECT_FALSE(opened.value().writable);
  EXPECT_EQ(dev_shm_entries(), before) << "a segment or channel got a name in /dev/shm";
  std::string path = "/proc/self/fd/" + std::to_string(opened.value().fd);
  int reopened = ::open(path.c_str(), O_RDWR);
  if (reopened >= 0) {
    char byte = 1;
    EXPECT_LT(::pwrite(reopened, &byte, 1, 0), 0) << "write() through a re-opened reader descriptor";
    void* writable = ::mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, reopened, 0);
    EXPECT_EQ(writable, MAP_FAILED) << "a writable mapping through a re-opened reader descriptor";
    if (writable != MAP_FAILED) ::munmap(writable, 1 << 20);
    ::close(reopened);
  }
  EXPECT_EQ(::mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, opened.value().fd, 0), MAP_FAILED);
  EXPECT_EQ(static_cast<const uint8_t*>(opened.value().data)[0], 0x42);
  // The creator's mapping stays writable.
  static_cast<uint8_t*>(channel.value().data)[0] = 0x43;
  EXPECT_EQ(static_cast<const uint8_t*>(opened.value().data)[0], 0x43);
}

TEST_F(DaemonTest, ChannelNamesArePerUser) {
  if (::getuid() != 0) GTEST_SKIP() << "acting as a second Unix user needs root";
  start_daemon({"--allow-uid", "65534"});
  ::chmod(directory_.c_str(), 0755);
  auto mine = connect_client("root-publisher");
  ASSERT_TRUE(mine);
  auto channel = mine->create_channel("shared.name", 4096);
  ASSERT_TRUE(channel.ok());
  std::memset(channel.value().data, 'R', 4096);
  int code = as_other_user([&] {
    auto client = connect_daemon(socket_path_, ConnectOptions{});
    if (!client.ok()) return 11;
    if (client.value()->open_channel("shared.name").status().code() != StatusCode::NOT_FOUND) return 12;
    auto own = client.value()->create_channel("shared.name", 4096);  // the same name, its own namespace
    if (!own.ok()) return 13;
    std::memset(own.value().data, 'N', 4096);
    auto reopened = client.value()->open_channel("shared.name");
    if (!reopened.ok() || static_cast<const char*>(reopened.value().data)[0] != 'N') return 14;
    return 0;
  });
  EXPECT_EQ(code, 0) << "10: setuid, 11: connect, 12: saw root's channel, 13: name taken across users, 14: own";
  auto again = mine->open_channel("shared.name");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(static_cast<const char*>(again.value().data)[0], 'R');
}

// ---- (6) Leftovers and edges ----------------------------------------------------------------

TEST_F(DaemonTest, AKilledDaemonLeavesNothingInDevShm) {
  std::vector<std::string> before = dev_shm_entries();
  start_daemon();
  {
    auto client = connect_client("c");
    ASSERT_TRUE(client);
    auto channel = client->create_channel("c", 1 << 20);
    ASSERT_TRUE(channel.ok());
    auto space = client->create_space("s", 64 << 10, 64);
    ASSERT_TRUE(space.ok());
    auto acquired = client->acquire({space.value(), 0, 64}, kAcquireWrite | kAcquireZeroNew);
    ASSERT_TRUE(acquired.ok() && client->wait(acquired.value().ticket).ok());
    daemon_.kill_now(SIGKILL);
    ASSERT_EQ(daemon_.wait(5), 128 + SIGKILL);
  }
  EXPECT_EQ(dev_shm_entries(), before);
  // A restart on the same socket path serves at once (the stale socket is replaced).
  start_daemon();
  EXPECT_TRUE(connect_client("after"));
}

// 60,000 spaces: membarctl (text and JSON) lists them all, from replies that each stay under
// the 4 MiB message limit.
TEST_F(DaemonTest, StatsOfSixtyThousandSpacesComeInPages) {
  start_daemon();
  RawPeer many;
  ASSERT_TRUE(many.handshake(socket_path_, "many"));
  constexpr uint32_t kSpaces = 60000;
  auto start = Clock::now();
  for (uint32_t i = 0; i < kSpaces; ++i) {
    auto created = many.create_space("space-with-a-long-name-" + std::to_string(i), 4096, 1);
    ASSERT_EQ(created.code, StatusCode::OK) << i << ": " << created.message;
  }
  std::printf("60,000 spaces created in %.1f s\n", seconds_since(start));
  AdminPeer admin;
  ASSERT_TRUE(admin.open(socket_path_));
  uint32_t listed = 0;
  size_t largest = 0;
  for (uint32_t first = 0; first < kSpaces;) {
    size_t bytes = 0;
    auto page = admin.stats_page(first, v2::kMaxStatsSpaces, &bytes);
    ASSERT_TRUE(page.ok()) << page.status().to_string();
    EXPECT_EQ(page.value().spaces_total, kSpaces);
    ASSERT_FALSE(page.value().spaces.empty());
    largest = std::max(largest, bytes);
    listed += uint32_t(page.value().spaces.size());
    first += uint32_t(page.value().spaces.size());
  }
  EXPECT_EQ(listed, kSpaces);
  EXPECT_LT(largest, size_t(v2::kMaxSocketPayloadBytes));
  std::printf("largest stats reply: %.2f MiB\n", largest / 1048576.0);
  int code = -1;
  std::string text = ctl("stats", &code);
  EXPECT_EQ(code, 0) << text.substr(0, 2000);
  EXPECT_NE(text.find("spaces: 60000"), std::string::npos);
  EXPECT_EQ(count_occurrences(text, "\n# Space "), kSpaces);
  std::string json = ctl("stats --json", &code);
  EXPECT_EQ(code, 0) << json.substr(0, 2000);
  EXPECT_EQ(count_occurrences(json, "\"page_bytes\": 4096"), kSpaces);
  EXPECT_NE(json.find("\"spaces_total\": 60000"), std::string::npos);
  // The client's own view: the first page, and the total.
  auto own = many.call(RawPeer::make(v2::Opcode::kStats));
  EXPECT_EQ(own.code, StatusCode::OK);
}

TEST_F(DaemonTest, WaitOnATicketNeverIssuedReturnsAtOnce) {
  start_daemon();
  auto client = connect_client("waiter");
  ASSERT_TRUE(client);
  auto space = client->create_space("s", 64 << 10, 1);
  ASSERT_TRUE(space.ok());
  auto acquired = client->acquire({space.value(), 0, 1}, kAcquireZeroNew);
  ASSERT_TRUE(acquired.ok());
  auto start = Clock::now();
  Status status = client->wait(acquired.value().ticket + 1000);
  EXPECT_EQ(status.code(), StatusCode::INVALID_ARGUMENT) << status.to_string();
  EXPECT_LT(seconds_since(start), 0.05) << "a ticket never issued must not be waited for";
  EXPECT_TRUE(client->wait(acquired.value().ticket).ok());
}

TEST_F(DaemonTest, WarningsForBadConnectionsAreRateLimited) {
  start_daemon();
  for (int i = 0; i < 50; ++i) {
    int fd = connect_unix(socket_path_);
    ASSERT_GE(fd, 0);
    std::vector<uint8_t> garbage(64, uint8_t(0xa0 + i % 16));
    (void)::send(fd, garbage.data(), garbage.size(), MSG_NOSIGNAL);
    EXPECT_TRUE(peer_closes(fd, 2000));
    ::close(fd);
  }
  auto client = connect_client("still-served");
  EXPECT_TRUE(client);
  std::string log = daemon_.output();
  size_t lines = count_occurrences(log, "dropping connection of pid");
  EXPECT_GE(lines, 1u) << log;
  EXPECT_LE(lines, 2u) << "one warning per bad connection:\n" << log;
}

// --host-numa-node: the node is said at start; one that is not online stops the daemon with a
// sentence naming the nodes there are (Note [Host pools near their GPU]).
TEST_F(DaemonTest, TheHostPoolsNumaNodeIsSaidAndAMissingOneRefused) {
  start_daemon({"--host-numa-node", "0"});
  std::string log = daemon_.output();
  bool placed = log.find("host pool on NUMA node 0") != std::string::npos;
  bool unavailable = log.find("host pool placed by the kernel: NUMA placement is not available here") != std::string::npos;
  EXPECT_TRUE(placed || unavailable) << log;
  auto client = connect_client("numa");
  ASSERT_TRUE(client);
  auto space = client->create_space("s", k2M, 2);
  ASSERT_TRUE(space.ok());
  EXPECT_TRUE(client->acquire_host({space.value(), 0, 2}).ok());
  // Stats say where the host pool is, through the wire and in membarctl's text and JSON.
  auto stats = client->stats();
  ASSERT_TRUE(stats.ok());
  ASSERT_EQ(stats.value().tiers.size(), 2u);
  EXPECT_EQ(stats.value().tiers[0].numa_node, -1) << "the GPU tier has no NUMA node";
  EXPECT_EQ(stats.value().tiers[1].numa_node, placed ? 0 : -1);
  std::string text = run_command(std::string(MEMBARCTL_PATH) + " --socket " + socket_path_ + " stats");
  EXPECT_NE(text.find(placed ? "numa_node: 0\n" : "numa_node: none (placed by the kernel)"), std::string::npos) << text;
  std::string json = run_command(std::string(MEMBARCTL_PATH) + " --socket " + socket_path_ + " stats --json");
  EXPECT_NE(json.find(placed ? "\"numa_node\": 0}" : "\"numa_node\": null}"), std::string::npos) << json;
  int code = -1;
  std::string out = run_command(std::string(MEMBARD_PATH) + " --backend host --socket " + directory_ +
                                    "/numa.sock --host-numa-node 1000",
                                &code);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("NUMA node 1000 is not online on this machine (nodes 0"), std::string::npos) << out;
}

TEST_F(DaemonTest, TheDefaultShareIsPrintedAtStart) {
  start_daemon({"--default-gpu-quota", "0.25"});
  std::string log = daemon_.output();
  EXPECT_NE(log.find("each client's share unless it asks for less: 8 MiB of the GPU pool, 128 MiB of the host pool"),
            std::string::npos)
      << log;
  auto client = connect_client("default");
  ASSERT_TRUE(client);
  EXPECT_EQ(client->stats().value().clients.at(0).gpu_quota_bytes, 8ull << 20);
}

}  // namespace
}  // namespace membar::integration
