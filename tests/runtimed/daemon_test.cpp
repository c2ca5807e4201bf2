// Integration tier: a real membard process on the host backend, client processes
// (membar_integration_worker), in-process daemon clients, raw protocol peers and membarctl.
// Every test starts its own daemon on a socket in its own temporary directory. The hardening
// of issue 12 (hostile and careless clients) is in hardening_test.cpp, the soak in soak_test.cpp.
#include <arpa/inet.h>
#include <netinet/in.h>

#include <random>

#include "client_test_util.h"
#include "daemon_harness.h"

namespace membar::integration {
namespace {

// Writes a recognisable pattern into `count` pages from `first` and checks it later.
[[maybe_unused]] void write_pattern(void* first, size_t count, uint64_t page_bytes, uint8_t seed) {
  for (size_t i = 0; i < count; ++i) {
    auto* bytes = static_cast<uint8_t*>(first) + i * page_bytes;
    for (uint64_t b = 0; b < page_bytes; b += 64) bytes[b] = static_cast<uint8_t>(seed + i + b / 64);
  }
}
[[maybe_unused]] bool pattern_intact(const void* first, size_t count, uint64_t page_bytes, uint8_t seed) {
  for (size_t i = 0; i < count; ++i) {
    auto* bytes = static_cast<const uint8_t*>(first) + i * page_bytes;
    for (uint64_t b = 0; b < page_bytes; b += 64) {
      if (bytes[b] != static_cast<uint8_t>(seed + i + b / 64)) return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
#if !defined(MEMBAR_DAEMON_GPU_TESTS)

TEST_F(DaemonTest, FourClientProcessesKeepEveryPageAcrossTenThousandCycles) {
  // 4 MiB of GPU quota each against 8 MiB of pages each: constant eviction and write-back.
  start_daemon({"--default-gpu-quota", "4MiB"});
  constexpr int kWorkers = 4;
  constexpr int kCyclesEach = 2500;
  std::vector<Process> workers;
  for (int w = 0; w < kWorkers; ++w) {
    workers.push_back(Process::spawn({WORKER_PATH, "integrity", "--socket", socket_path_, "--seed",
                                      std::to_string(1000 + w), "--cycles", std::to_string(kCyclesEach), "--pages", "64"},
                                     directory_ + "/worker" + std::to_string(w) + ".out"));
  }
  uint64_t cycles = 0, bytes_moved = 0, evictions = 0;
  for (int w = 0; w < kWorkers; ++w) {
    int code = workers[w].wait(120);
    std::string output = workers[w].output();
    EXPECT_EQ(code, 0) << "worker " << w << ":\n" << output;
    std::smatch match;
    std::regex pattern(
        "RESULT cycles=([0-9]+) corrupted=([0-9]+) lost=([0-9]+) failed_calls=([0-9]+) bytes_h2d=([0-9]+) "
        "bytes_d2h=([0-9]+) evictions=([0-9]+)");
    ASSERT_TRUE(std::regex_search(output, match, pattern)) << output;
    EXPECT_EQ(std::stoull(match[2]), 0u) << "corrupted pages in worker " << w;
    EXPECT_EQ(std::stoull(match[3]), 0u) << "lost pages in worker " << w;
    EXPECT_EQ(std::stoull(match[4]), 0u) << "failed calls in worker " << w;
    cycles += std::stoull(match[1]);
    bytes_moved += std::stoull(match[5]) + std::stoull(match[6]);
    evictions += std::stoull(match[7]);
  }
  EXPECT_GE(cycles, 10000u);
  EXPECT_GT(bytes_moved, 100ull << 20) << "the schedule should move data between tiers";
  EXPECT_GT(evictions, 0u) << "the quota should force evictions";
  // Everyone left: every frame is back in the pools (renewed).
  EXPECT_TRUE(pools_empty());
}

TEST_F(DaemonTest, AClientKilledMidScheduleCostsTheOthersNothing) {
  start_daemon({"--default-gpu-quota", "4MiB"});
  Process victim = Process::spawn({WORKER_PATH, "integrity", "--socket", socket_path_, "--seed", "501", "--cycles",
                                   "1000000", "--pages", "64"},
                                  directory_ + "/victim.out");
  Process survivor = Process::spawn({WORKER_PATH, "integrity", "--socket", socket_path_, "--seed", "502", "--cycles",
                                     "5000", "--pages", "64"},
                                    directory_ + "/survivor.out");
  // Let both run (transfers in flight), then kill one in the middle of its schedule.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_TRUE(survivor.running()) << "the survivor should still be running when the victim dies";
  EXPECT_TRUE(victim.running());
  victim.kill_now(SIGKILL);
  EXPECT_EQ(victim.wait(5), 128 + SIGKILL);
  EXPECT_EQ(survivor.wait(120), 0) << survivor.output();
  EXPECT_NE(survivor.output().find("corrupted=0 lost=0 failed_calls=0"), std::string::npos) << survivor.output();
  EXPECT_TRUE(pools_empty());
}

TEST_F(DaemonTest, TheIntegrityCheckCatchesASabotagedPage) {
  start_daemon({"--default-gpu-quota", "4MiB"});
  Process worker = Process::spawn({WORKER_PATH, "integrity", "--socket", socket_path_, "--seed", "77", "--cycles",
                                   "400", "--pages", "64", "--sabotage", "1"},
                                  directory_ + "/sabotage.out");
  EXPECT_EQ(worker.wait(60), 1) << worker.output();
  std::smatch match;
  std::string output = worker.output();
  ASSERT_TRUE(std::regex_search(output, match, std::regex("corrupted=([0-9]+) lost=([0-9]+)"))) << output;
  EXPECT_GE(std::stoull(match[1]) + std::stoull(match[2]), 1u) << output;
}

TEST_F(DaemonTest, KillNineOfAClientReclaimsAllItsFramesWithinOneSecond) {
  start_daemon();
  std::vector<std::string> shm_before = dev_shm_entries();
  Process holder = Process::spawn({WORKER_PATH, "hold", "--socket", socket_path_, "--pages", "96"},
                                  directory_ + "/holder.out");
  auto start = Clock::now();
  while (holder.output().find("READY") == std::string::npos && seconds_since(start) < 10) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_NE(holder.output().find("READY"), std::string::npos) << holder.output();
  EXPECT_GT(frames_used("gpu"), 0);
  EXPECT_GT(frames_used("host"), 0);

  holder.kill_now(SIGKILL);
  auto killed = Clock::now();
  ASSERT_EQ(holder.wait(5), 128 + SIGKILL);
  while ((frames_used("gpu") != 0 || frames_used("host") != 0) && seconds_since(killed) < 3) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  double reclaimed_after = seconds_since(killed);
  EXPECT_EQ(frames_used("gpu"), 0);
  EXPECT_EQ(frames_used("host"), 0);
  EXPECT_LT(reclaimed_after, 1.0) << "frames came back (renewed) after " << reclaimed_after << " s";
  std::printf("reclaim of a killed client, renewal included: %.0f ms\n", reclaimed_after * 1000);
  // Segments travel as descriptors: nothing was ever named in /dev/shm.
  EXPECT_EQ(dev_shm_entries(), shm_before);
}

TEST_F(DaemonTest, KillingTheDaemonGivesClientsUnavailableNotAHang) {
  start_daemon();
  auto client = connect_client("victim");
  ASSERT_TRUE(client);
  auto space = client->create_space("x", 64 << 10, 4);
  ASSERT_TRUE(space.ok());
  auto acquired = client->acquire({space.value(), 0, 4}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(acquired.ok());
  ASSERT_TRUE(client->wait(acquired.value().ticket).ok());
  ASSERT_TRUE(client->release({space.value(), 0, 4}, true).ok());

  daemon_.kill_now(SIGKILL);
  ASSERT_EQ(daemon_.wait(5), 128 + SIGKILL);
  auto start = Clock::now();
  auto after = client->acquire({space.value(), 0, 1}, 0);
  EXPECT_LT(seconds_since(start), 1.0);
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.status().code(), StatusCode::UNAVAILABLE) << after.status().to_string();
  EXPECT_NE(after.status().message().find("membard"), std::string::npos) << after.status().to_string();
  // Every later call fails the same way, at once; wait() on an unfinished ticket too.
  start = Clock::now();
  EXPECT_EQ(client->prefetch({space.value(), 0, 1}).status().code(), StatusCode::UNAVAILABLE);
  EXPECT_EQ(client->stats().status().code(), StatusCode::UNAVAILABLE);
  EXPECT_EQ(client->wait(client->completed_ticket() + 100).code(), StatusCode::INVALID_ARGUMENT)
      << "a ticket never issued is refused at once, daemon or not";
  EXPECT_LT(seconds_since(start), 1.0);
}

TEST_F(DaemonTest, SigtermShutsDownCleanlyAndTellsClients) {
  start_daemon();
  auto client = connect_client("told");
  ASSERT_TRUE(client);
  ASSERT_TRUE(client->create_space("x", 64 << 10, 2).ok());
  daemon_.kill_now(SIGTERM);
  EXPECT_EQ(daemon_.wait(5), 0) << daemon_.output();
  auto after = client->create_space("y", 64 << 10, 2);
  ASSERT_FALSE(after.ok());
  EXPECT_EQ(after.status().code(), StatusCode::UNAVAILABLE);
  EXPECT_NE(after.status().message().find("shut"), std::string::npos) << after.status().to_string();
  struct stat info {};
  EXPECT_NE(::stat(socket_path_.c_str(), &info), 0) << "the socket should be removed";
  EXPECT_NE(daemon_.output().find("shutting down"), std::string::npos);
}

TEST_F(DaemonTest, ChannelsCarryBytesToReadersInOtherProcessesAndEndWithTheirCreator) {
  start_daemon();
  auto publisher = connect_client("publisher");
  ASSERT_TRUE(publisher);
  constexpr uint64_t kBytes = 3 << 20;
  auto channel = publisher->create_channel("policy.sync", kBytes);
  ASSERT_TRUE(channel.ok()) << channel.status().to_string();
  ASSERT_TRUE(channel.value().writable);
  ASSERT_EQ(channel.value().bytes, kBytes);
  auto* words = static_cast<uint64_t*>(channel.value().data);
  for (uint64_t i = 0; i < kBytes / 8; ++i) ASSERT_EQ(words[i], 0u) << "channels start zero-filled";
  for (uint64_t i = 0; i < kBytes / 8; ++i) words[i] = i * 0x9E3779B97F4A7C15ull;

  // A reader in another process (its own connection) sees every byte, and cannot write.
  pid_t child = ::fork();
  if (child == 0) {
    ConnectOptions options;
    options.client_name = "reader";
    auto reader = connect_daemon(socket_path_, options);
    if (!reader.ok()) ::_exit(10);
    auto opened = reader.value()->open_channel("policy.sync");
    if (!opened.ok() || opened.value().writable || opened.value().bytes != kBytes) ::_exit(11);
    const auto* seen = static_cast<const uint64_t*>(opened.value().data);
    for (uint64_t i = 0; i < kBytes / 8; ++i) {
      if (seen[i] != i * 0x9E3779B97F4A7C15ull) ::_exit(12);
    }
    void* writable = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, opened.value().fd, 0);
    if (writable != MAP_FAILED) ::_exit(13);
    // Names that do not exist are a clear NOT_FOUND; creating a taken name is ALREADY_EXISTS.
    if (reader.value()->open_channel("policy.none").status().code() != StatusCode::NOT_FOUND) ::_exit(14);
    if (reader.value()->create_channel("policy.sync", 4096).status().code() != StatusCode::ALREADY_EXISTS) ::_exit(15);
    ::_exit(0);
  }
  ASSERT_GT(child, 0);
  int child_status = 0;
  ASSERT_EQ(::waitpid(child, &child_status, 0), child);
  ASSERT_TRUE(WIFEXITED(child_status));
  EXPECT_EQ(WEXITSTATUS(child_status), 0) << "reader failed at step " << WEXITSTATUS(child_status);

  // A reader that keeps its mapping sees later writes too (same memory, no copies).
  auto reader = connect_client("reader2");
  ASSERT_TRUE(reader);
  auto opened = reader->open_channel("policy.sync");
  ASSERT_TRUE(opened.ok()) << opened.status().to_string();
  words[7] = 77;
  EXPECT_EQ(static_cast<const uint64_t*>(opened.value().data)[7], 77u);

  // Bad sizes and names get clear errors; the daemon keeps serving.
  EXPECT_EQ(publisher->create_channel("", 4096).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(publisher->create_channel("zero", 0).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(publisher->create_channel("huge", 1ull << 40).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(publisher->create_channel("over.quota", 512ull << 20).status().code(), StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(reader->close_channel(9999).code(), StatusCode::NOT_FOUND);

  // The creator goes away: its name is dropped, an existing mapping still reads the last bytes.
  publisher.reset();
  auto start = Clock::now();
  Status reopened;
  while (seconds_since(start) < 2) {
    reopened = reader->open_channel("policy.sync").status();
    if (reopened.code() == StatusCode::NOT_FOUND) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(reopened.code(), StatusCode::NOT_FOUND) << reopened.to_string();
  EXPECT_EQ(static_cast<const uint64_t*>(opened.value().data)[7], 77u);
  EXPECT_TRUE(reader->close_channel(opened.value().handle).ok());
}

TEST_F(DaemonTest, AClientCannotReachAnotherClientsPages) {
  start_daemon();
  auto owner = connect_client("owner");
  auto intruder = connect_client("intruder");
  ASSERT_TRUE(owner && intruder);
  auto space = owner->create_space("secret", 64 << 10, 8);
  ASSERT_TRUE(space.ok());
  auto acquired = owner->acquire({space.value(), 0, 8}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(acquired.ok());
  ASSERT_TRUE(owner->wait(acquired.value().ticket).ok());
  write_pattern(acquired.value().pointer, 8, 64 << 10, 7);
  ASSERT_TRUE(owner->release({space.value(), 0, 8}, true).ok());

  // The intruder names the owner's space id: every access is refused, and no frame reaches it.
  PageRange stolen{space.value(), 0, 8};
  auto is_refused = [](const Status& status) {
    return status.code() == StatusCode::NOT_FOUND || status.code() == StatusCode::PERMISSION_DENIED;
  };
  EXPECT_TRUE(is_refused(intruder->acquire(stolen, 0).status()));
  EXPECT_TRUE(is_refused(intruder->acquire_host(stolen).status()));
  EXPECT_EQ(intruder->space_view(space.value()).status().code(), StatusCode::NOT_FOUND);
  EXPECT_TRUE(is_refused(intruder->prefetch(stolen).status()));
  EXPECT_TRUE(is_refused(intruder->prefetch_ranges({stolen}).status()));
  EXPECT_TRUE(is_refused(intruder->offload(stolen).status()));
  EXPECT_TRUE(is_refused(intruder->free_pages(stolen)));
  EXPECT_TRUE(is_refused(intruder->release(stolen, true)));
  EXPECT_TRUE(is_refused(intruder->destroy_space(space.value())));
  auto intruder_stats = intruder->stats();
  ASSERT_TRUE(intruder_stats.ok());
  for (const SpaceInfo& info : intruder_stats.value().spaces) EXPECT_NE(info.name, "secret");
  // No frame was ever granted to the intruder (frames are only sent to their owner).
  bool found = false;
  for (const ClientStats& c : intruder_stats.value().clients) {
    if (c.name != "intruder") continue;
    found = true;
    EXPECT_EQ(c.gpu_frames.allocated, 0);
    EXPECT_EQ(c.host_frames.allocated, 0);
  }
  EXPECT_TRUE(found) << "the intruder's own stats should list it";

  // The owner's pages are untouched.
  auto host = owner->acquire_host({space.value(), 0, 8});
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  EXPECT_TRUE(pattern_intact(host.value(), 8, 64 << 10, 7));
  EXPECT_TRUE(owner->release_host({space.value(), 0, 8}, false).ok());
}

TEST_F(DaemonTest, BadRequestsGetClearErrorsAndOtherClientsLoseNothing) {
  start_daemon();
  auto bystander = connect_client("bystander");
  ASSERT_TRUE(bystander);
  auto kept = bystander->create_space("kept", 64 << 10, 16);
  ASSERT_TRUE(kept.ok());
  auto acquired = bystander->acquire({kept.value(), 0, 16}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(acquired.ok());
  ASSERT_TRUE(bystander->wait(acquired.value().ticket).ok());
  write_pattern(acquired.value().pointer, 16, 64 << 10, 42);
  ASSERT_TRUE(bystander->release({kept.value(), 0, 16}, true).ok());

  // 2 MiB of GPU quota: one frame.
  auto bad = connect_client("bad", 2ull << 20);
  ASSERT_TRUE(bad);
  auto space = bad->create_space("s", 64 << 10, 64);
  ASSERT_TRUE(space.ok());
  EXPECT_EQ(bad->create_space("s", 64 << 10, 4).status().code(), StatusCode::ALREADY_EXISTS);
  EXPECT_TRUE(bad->create_space("odd", 100000, 4).ok()) << "pages may have any size";
  EXPECT_EQ(bad->create_space("empty", 0, 4).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(bad->create_space("huge", kMaxPageBytes + 1, 4).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(bad->create_space("", 64 << 10, 4).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(bad->acquire({space.value() + 100, 0, 1}, 0).status().code(), StatusCode::NOT_FOUND);
  EXPECT_EQ(bad->acquire({space.value(), 60, 10}, 0).status().code(), StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(bad->acquire({space.value(), 0, 0}, 0).status().code(), StatusCode::INVALID_ARGUMENT);
  Status flags = bad->acquire({space.value(), 0, 1}, 0x128).status();
  EXPECT_EQ(flags.code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(flags.message().find("unknown flags 0x128"), std::string::npos) << flags.to_string();
  // Over quota: 64 pinned 64 KiB pages need 2 frames, the client has 1.
  auto over = bad->acquire({space.value(), 0, 64}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::RESOURCE_EXHAUSTED) << over.status().to_string();
  // Double free: pages 0..31 are the space's first frame.
  auto one = bad->acquire({space.value(), 0, 32}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  ASSERT_TRUE(bad->wait(one.value().ticket).ok());
  ASSERT_TRUE(bad->release({space.value(), 0, 32}, true).ok());
  EXPECT_TRUE(bad->free_pages({space.value(), 0, 32}).ok());
  auto second_free = bad->free_pages({space.value(), 0, 32});
  EXPECT_FALSE(second_free.ok());
  EXPECT_EQ(second_free.code(), StatusCode::FAILED_PRECONDITION) << second_free.to_string();
  EXPECT_NE(second_free.message().find("double free"), std::string::npos) << second_free.to_string();
  EXPECT_TRUE(bad->destroy_space(space.value()).ok());
  EXPECT_EQ(bad->destroy_space(space.value()).code(), StatusCode::NOT_FOUND);
  // Still connected and working after all of that.
  EXPECT_TRUE(bad->create_space("after", 64 << 10, 2).ok());

  auto host = bystander->acquire_host({kept.value(), 0, 16});
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  EXPECT_TRUE(pattern_intact(host.value(), 16, 64 << 10, 42));
  EXPECT_TRUE(bystander->release_host({kept.value(), 0, 16}, false).ok());
}

TEST_F(DaemonTest, MalformedSocketMessagesAreRefusedWithoutHurtingOthers) {
  start_daemon();
  auto bystander = connect_client("bystander");
  ASSERT_TRUE(bystander);
  auto space = bystander->create_space("kept", 64 << 10, 4);
  ASSERT_TRUE(space.ok());

  auto expect_error = [&](const std::vector<uint8_t>& bytes, StatusCode expected, const char* what) {
    int fd = connect_unix(socket_path_);
    ASSERT_GE(fd, 0);
    ASSERT_TRUE(wire::send_message(fd, bytes).ok());
    wire::MessageAssembler assembler;
    auto reply = read_one(fd, assembler);
    ASSERT_TRUE(reply.has_value()) << what;
    ASSERT_EQ(reply->header.type, static_cast<uint16_t>(v2::MessageType::kError)) << what;
    auto error = v2::decode_error(reply->payload);
    ASSERT_TRUE(error.ok());
    EXPECT_EQ(static_cast<StatusCode>(error.value().status), expected) << what << ": " << error.value().message;
    EXPECT_TRUE(peer_closes(fd)) << what;
    ::close(fd);
  };

  v2::HelloV2 hello{};
  v2::copy_text(hello.client_name, sizeof(hello.client_name), "raw");
  std::vector<uint8_t> good_hello = v2::encode_message(v2::MessageType::kHello, hello);

  std::vector<uint8_t> bad_magic = good_hello;
  bad_magic[0] ^= 0xff;
  expect_error(bad_magic, StatusCode::INVALID_ARGUMENT, "bad magic");

  std::vector<uint8_t> wrong_version = good_hello;
  wrong_version[4] = 1;  // MessageHeaderV2::version: a client of protocol version 1
  expect_error(wrong_version, StatusCode::FAILED_PRECONDITION, "protocol version 1");

  std::vector<uint8_t> unknown_type = good_hello;
  unknown_type[6] = 200;  // MessageHeaderV2::type
  expect_error(unknown_type, StatusCode::INVALID_ARGUMENT, "unknown message type");

  std::vector<uint8_t> short_payload = v2::encode_message(
      v2::MessageType::kHello, std::span<const uint8_t>(good_hello.data() + 16, sizeof(v2::HelloV2) - 8));
  expect_error(short_payload, StatusCode::INVALID_ARGUMENT, "hello of the wrong size");

  v2::HelloV2 bad_role = hello;
  bad_role.role = 9;
  expect_error(v2::encode_message(v2::MessageType::kHello, bad_role), StatusCode::INVALID_ARGUMENT, "unknown role");

  v2::HelloV2 unterminated = hello;
  std::memset(unterminated.client_name, 'a', sizeof(unterminated.client_name));
  expect_error(v2::encode_message(v2::MessageType::kHello, unterminated), StatusCode::INVALID_ARGUMENT,
               "unterminated name");

  expect_error(v2::encode_message(v2::MessageType::kStatsRequest, std::span<const uint8_t>()),
               StatusCode::INVALID_ARGUMENT, "stats before hello");

  // Truncated: half a header, then the peer hangs up. The daemon just drops it.
  int fd = connect_unix(socket_path_);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::send(fd, good_hello.data(), 7, MSG_NOSIGNAL), 7);
  ::close(fd);

  // The bystander never noticed.
  auto acquired = bystander->acquire({space.value(), 0, 4}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(acquired.ok()) << acquired.status().to_string();
  EXPECT_TRUE(bystander->wait(acquired.value().ticket).ok());
  EXPECT_TRUE(bystander->release({space.value(), 0, 4}, false).ok());
}

TEST_F(DaemonTest, MalformedRingRequestsGetErrorCompletionsAndACorruptRingDropsOnlyThatClient) {
  start_daemon();
  auto bystander = connect_client("bystander");
  ASSERT_TRUE(bystander);
  auto kept = bystander->create_space("kept", 64 << 10, 4);
  ASSERT_TRUE(kept.ok());
  auto acquired = bystander->acquire({kept.value(), 0, 4}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(acquired.ok());
  ASSERT_TRUE(bystander->wait(acquired.value().ticket).ok());
  write_pattern(acquired.value().pointer, 4, 64 << 10, 99);
  ASSERT_TRUE(bystander->release({kept.value(), 0, 4}, true).ok());

  RawPeer peer;
  ASSERT_TRUE(peer.handshake(socket_path_));
  v2::RequestV2 nop{};
  nop.opcode = static_cast<uint16_t>(v2::Opcode::kNop);
  EXPECT_EQ(peer.call(nop).code, StatusCode::OK);

  v2::RequestV2 request = nop;
  request.opcode = 77;
  EXPECT_EQ(peer.call(request).code, StatusCode::INVALID_ARGUMENT);
  request = nop;
  request.reserved1[3] = 1;
  EXPECT_EQ(peer.call(request).code, StatusCode::INVALID_ARGUMENT);
  request = nop;
  request.payload_bytes = 1u << 31;
  EXPECT_EQ(peer.call(request).code, StatusCode::INVALID_ARGUMENT);

  v2::RequestV2 create{};
  create.opcode = static_cast<uint16_t>(v2::Opcode::kCreateSpace);
  create.argument = 64 << 10;
  create.page_count = 4;
  create.payload_bytes = 5;
  EXPECT_EQ(peer.call(create, std::string("a\nb\0c", 5)).code, StatusCode::INVALID_ARGUMENT);
  create.argument = 0;
  EXPECT_EQ(peer.call(create, "space").code, StatusCode::INVALID_ARGUMENT);
  create.argument = 3 << 16;  // 192 KiB: pages may have any size
  EXPECT_EQ(peer.call(create, "space").code, StatusCode::OK);

  v2::RequestV2 schedule{};
  schedule.opcode = static_cast<uint16_t>(v2::Opcode::kSetSchedule);
  std::string bad_schedule("\xff\xff\xff\x7f\x00\x00\x00\x00", 8);  // 2^31 steps in 8 bytes
  schedule.payload_bytes = static_cast<uint32_t>(bad_schedule.size());
  auto bad = peer.call(schedule, bad_schedule);
  EXPECT_EQ(bad.code, StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad.message.find("schedule"), std::string::npos) << bad.message;

  v2::RequestV2 acquire{};
  acquire.opcode = static_cast<uint16_t>(v2::Opcode::kAcquire);
  acquire.space = kept.value() + 1;  // space ids are per client: this peer has only space 1
  acquire.page_count = 1;
  auto foreign = peer.call(acquire);
  EXPECT_TRUE(foreign.code == StatusCode::NOT_FOUND || foreign.code == StatusCode::PERMISSION_DENIED) << foreign.message;
  acquire.first_page = 0xfffffff0u;
  acquire.page_count = 0x100;
  EXPECT_EQ(peer.call(acquire).code, StatusCode::OUT_OF_RANGE);
  acquire.first_page = 0;
  acquire.page_count = 1;
  acquire.flags = 0x128;
  auto flags = peer.call(acquire);
  EXPECT_EQ(flags.code, StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(flags.message.find("unknown flags 0x128 (allowed: 0x3)"), std::string::npos) << flags.message;

  // Still served after all of that.
  EXPECT_EQ(peer.call(nop).code, StatusCode::OK);

  // A head that jumps past the ring: the daemon drops this client (error notice, socket closed).
  auto* control = reinterpret_cast<v2::RingControlV2*>(static_cast<uint8_t*>(peer.segment) +
                                                       peer.layout.request_ring_offset);
  std::atomic_ref<uint64_t>(control->head).store(1ull << 40);
  peer.requests.ring_doorbell();
  auto notice = read_one(peer.fd, peer.assembler);
  ASSERT_TRUE(notice.has_value());
  EXPECT_EQ(notice->header.type, static_cast<uint16_t>(v2::MessageType::kError));
  EXPECT_TRUE(peer_closes(peer.fd));

  auto host = bystander->acquire_host({kept.value(), 0, 4});
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  EXPECT_TRUE(pattern_intact(host.value(), 4, 64 << 10, 99));
  EXPECT_TRUE(bystander->release_host({kept.value(), 0, 4}, false).ok());
}

// Note [A schedule in parts]: a schedule larger than the request payload area (a 1M-token
// sparse step's is ~30 MB) arrives in parts and is installed whole; a failed schedule keeps the
// installed one.
TEST_F(DaemonTest, AScheduleLargerThanThePayloadAreaArrivesInPartsAndIsInstalledWhole) {
  start_daemon();
  auto client = connect_client("long-context");
  ASSERT_TRUE(client);
  auto space = client->create_space("L00.k", 64 << 10, 64);
  ASSERT_TRUE(space.ok());
  // 200,000 steps of 2 ranges each: 5.6 MB encoded, several times the 1 MiB payload area.
  constexpr uint32_t kSteps = 200000;
  std::vector<ScheduleStep> steps(kSteps);
  for (uint32_t s = 0; s < kSteps; ++s) {
    steps[s].ranges = {{space.value(), s % 60, 2}, {space.value(), 62, 1 + s % 2}};
  }
  Status set = client->set_schedule(steps);
  ASSERT_TRUE(set.ok()) << set.to_string();
  // Every part arrived: the last step exists, the one after it does not.
  EXPECT_TRUE(client->advance(kSteps - 1).ok());
  Status past = client->advance(kSteps);
  EXPECT_EQ(past.code(), StatusCode::OUT_OF_RANGE) << past.to_string();
  EXPECT_NE(past.message().find("schedule of 200000 steps"), std::string::npos) << past.to_string();
  // The schedule drives the pages: acquire and release along it.
  auto acquired = client->acquire({space.value(), 0, 64}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(acquired.ok()) << acquired.status().to_string();
  ASSERT_TRUE(client->wait(acquired.value().ticket).ok());
  write_pattern(acquired.value().pointer, 64, 64 << 10, 7);
  ASSERT_TRUE(client->release({space.value(), 0, 64}, true).ok());

  // A long schedule whose last part names a page outside the space: refused as a whole, and the
  // installed schedule stays.
  std::vector<ScheduleStep> bad(kSteps);
  for (uint32_t s = 0; s < kSteps; ++s) bad[s].ranges = {{space.value(), s % 64, 1}, {space.value(), 0, 1}};
  bad.back().ranges = {{space.value(), 63, 2}};
  Status refused = client->set_schedule(bad);
  EXPECT_EQ(refused.code(), StatusCode::OUT_OF_RANGE) << refused.to_string();
  EXPECT_NE(refused.message().find("schedule step 199999"), std::string::npos) << refused.to_string();
  EXPECT_TRUE(client->advance(kSteps - 1).ok()) << "the schedule installed before stays";

  // One step that alone exceeds a request: a clear error from the client library.
  std::vector<ScheduleStep> wide(1);
  wide[0].ranges.assign(100000, PageRange{space.value(), 0, 1});
  Status too_wide = client->set_schedule(wide);
  EXPECT_EQ(too_wide.code(), StatusCode::INVALID_ARGUMENT) << too_wide.to_string();
  EXPECT_NE(too_wide.message().find("step 0 names 100000 page ranges"), std::string::npos) << too_wide.to_string();

  // Still served, bytes intact.
  auto host = client->acquire_host({space.value(), 0, 64});
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  EXPECT_TRUE(pattern_intact(host.value(), 64, 64 << 10, 7));
  EXPECT_TRUE(client->release_host({space.value(), 0, 64}, false).ok());
}

TEST_F(DaemonTest, MembarctlAndPrometheusReportFramesClientsAndSpaces) {
  start_daemon({"--prometheus-port", "0"});
  auto client = connect_client("trainer-a");
  ASSERT_TRUE(client);
  auto space = client->create_space("L07.k", 96 << 10, 32);  // 3 MiB: two space frames, the second partial
  ASSERT_TRUE(space.ok());
  auto acquired = client->acquire({space.value(), 0, 32}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(acquired.ok());
  ASSERT_TRUE(client->wait(acquired.value().ticket).ok());
  ASSERT_TRUE(client->release({space.value(), 0, 32}, true).ok());
  auto offloaded = client->offload({space.value(), 0, 21});  // pages 0..20 lie in the first frame
  ASSERT_TRUE(offloaded.ok());
  ASSERT_TRUE(client->wait(offloaded.value()).ok());
  auto channel = client->create_channel("trainer-a.sync", 3 << 20);
  ASSERT_TRUE(channel.ok()) << channel.status().to_string();

  std::string ctl = std::string(MEMBARCTL_PATH) + " --socket " + socket_path_;
  int code = -1;
  std::string text = run_command(ctl + " stats", &code);
  EXPECT_EQ(code, 0) << text;
  for (const char* expected : {"# Server", "backend: host", "spaces: 1", "# Tier gpu", "frames_total: 16 (32 MiB)",
                               "# Client", "name: trainer-a", "bytes_gpu: 1048576 (1 MiB)",
                               "bytes_host: 2097152 (2 MiB)", "bytes_gpu_to_host: 2097152 (2 MiB)",
                               "channel_bytes: 4194304 (4 MiB)", "prefetch_hit_rate:", "stall_ns:", "gpu_maps:",
                               "fence_waits: 0 (0 ns)", "call_time: lock wait ", "# Space",
                               "name: L07.k", "page_bytes: 98304 (96 KiB)", "bytes: 3145728 (3 MiB)", "bytes_both: 0",
                               "bytes_dirty: 1048576 (1 MiB)", "bytes_pinned: 0"}) {
    EXPECT_NE(text.find(expected), std::string::npos) << "missing '" << expected << "' in\n" << text;
  }
  std::string json = run_command(ctl + " stats --json", &code);
  EXPECT_EQ(code, 0);
  EXPECT_NE(json.find("\"name\": \"trainer-a\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"bytes_gpu_to_host\": 2097152"), std::string::npos) << json;
  EXPECT_NE(json.find("\"channel_bytes\": 4194304"), std::string::npos) << json;
  EXPECT_NE(json.find("\"gpu_maps\": "), std::string::npos) << json;
  EXPECT_NE(json.find("\"fence_waits\": 0, \"fence_wait_ns\": 0, \"call_lock_wait_ns\": "), std::string::npos) << json;
  EXPECT_NE(json.find("\"page_count\": 32, \"bytes_gpu\": 1048576, \"bytes_host\": 2097152"), std::string::npos)
      << json;
  std::string top = run_command(ctl + " top --iterations 2 --interval-ms 50", &code);
  EXPECT_EQ(code, 0);
  EXPECT_NE(top.find("trainer-a"), std::string::npos) << top;
  std::string ping = run_command(ctl + " ping", &code);
  EXPECT_EQ(code, 0);
  EXPECT_NE(ping.find("alive"), std::string::npos) << ping;

  // Prometheus: the port is in the daemon's log.
  std::smatch match;
  std::string log = daemon_.output();
  ASSERT_TRUE(std::regex_search(log, match, std::regex("127\\.0\\.0\\.1:([0-9]+)/metrics"))) << log;
  int http = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(std::stoi(match[1])));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(http, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  std::string request = "GET /metrics HTTP/1.0\r\n\r\n";
  ASSERT_EQ(::send(http, request.data(), request.size(), 0), static_cast<ssize_t>(request.size()));
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = ::recv(http, buffer, sizeof(buffer), 0)) > 0) response.append(buffer, static_cast<size_t>(n));
  ::close(http);
  EXPECT_NE(response.find("200 OK"), std::string::npos) << response;
  EXPECT_NE(response.find("membar_frames_total{tier=\"gpu\"} 16"), std::string::npos) << response;
  EXPECT_TRUE(std::regex_search(response, std::regex("\nmembar_host_pool_numa_node (-1|[0-9]+)\n"))) << response;
  EXPECT_NE(response.find("name=\"trainer-a\""), std::string::npos) << response;
  EXPECT_NE(response.find("membar_client_transferred_bytes_total"), std::string::npos) << response;
  EXPECT_NE(response.find("membar_space_bytes{client=\"1\",space=\"L07.k\",state=\"host\"} 2097152"),
            std::string::npos) << response;
  EXPECT_NE(response.find("membar_client_channel_bytes{client=\"1\""), std::string::npos) << response;
}

TEST_F(DaemonTest, SocketIsPrivateAndForeignUidsAreRefused) {
  start_daemon();
  struct stat info {};
  ASSERT_EQ(::stat(socket_path_.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0600u);
  if (::getuid() != 0) GTEST_SKIP() << "the SO_PEERCRED check needs root to act as another uid";
  // Open the file permissions so only SO_PEERCRED stands between uid 65534 and the daemon.
  ::chmod(directory_.c_str(), 0755);
  ::chmod(socket_path_.c_str(), 0666);
  int code = as_other_user([&] {
    auto client = connect_daemon(socket_path_, ConnectOptions{});
    return client.ok() ? 11 : client.status().code() == StatusCode::PERMISSION_DENIED ? 0 : 12;
  });
  EXPECT_EQ(code, 0) << "10: setuid failed, 11: accepted, 12: another error";
  EXPECT_NE(daemon_.output().find("uid not allowed"), std::string::npos);
}

TEST_F(DaemonTest, AllowUidListAdmitsAnotherUidWithoutChangingTheSocket) {
  if (::getuid() != 0) GTEST_SKIP() << "acting as another uid needs root";
  start_daemon({"--allow-uid", "65534"});
  // --allow-uid makes the socket usable by the admitted uids itself (the credentials check
  // decides): no chmod or chgrp of the socket by an admin.
  struct stat info {};
  ASSERT_EQ(::stat(socket_path_.c_str(), &info), 0);
  EXPECT_EQ(info.st_mode & 0777, 0666u);
  EXPECT_NE(daemon_.output().find("uids 65534"), std::string::npos) << daemon_.output();
  ::chmod(directory_.c_str(), 0755);  // the test's private directory, not the daemon's socket
  int code = as_other_user([&] {
    auto client = connect_daemon(socket_path_, ConnectOptions{});
    if (!client.ok()) {
      std::fprintf(stderr, "%s\n", client.status().to_string().c_str());
      return 11;
    }
    return client.value()->create_space("x", 64 << 10, 1).ok() ? 0 : 12;
  });
  EXPECT_EQ(code, 0) << "10: setuid failed, 11: refused, 12: a call failed";
}

TEST_F(DaemonTest, ConnectPrefersTheNamedDaemonAndFallsBackToEmbeddedOnlyWhenAllowed) {
  start_daemon();
  ConnectOptions options;
  options.socket_path = socket_path_;
  auto client = connect(options);
  ASSERT_TRUE(client.ok()) << client.status().to_string();
  EXPECT_EQ(client.value()->describe(), "daemon:" + socket_path_);

  ::setenv("MEMBAR_SOCKET", socket_path_.c_str(), 1);
  auto from_environment = connect(ConnectOptions{});
  ::unsetenv("MEMBAR_SOCKET");
  ASSERT_TRUE(from_environment.ok());
  EXPECT_EQ(from_environment.value()->describe(), "daemon:" + socket_path_);

  options.socket_path = directory_ + "/nobody.sock";
  auto missing = connect(options);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::UNAVAILABLE);
  EXPECT_NE(missing.status().message().find("nobody.sock"), std::string::npos);
}

// copy_pages through membard (Note [Copied pages] in engine/page_copies.cpp, opcode copy_pages):
// fresh random bytes (never zero) per test, compared byte for byte.
std::vector<uint8_t> random_bytes(std::mt19937_64& random, uint64_t count) {
  std::vector<uint8_t> bytes(count);
  for (uint8_t& byte : bytes) {
    byte = static_cast<uint8_t>(random());
    if (byte == 0) byte = 0x3c;
  }
  return bytes;
}

using membar::testing::same_bytes;

using membar::testing::gpu_resident_bytes;

// History pages that live on the host only, copied by membard into pages the client keeps acquired
// on the GPU: the stage holds them once the ticket completes, the history stays on the host. Bad
// calls are refused (the opcode's payload rules and the engine's checks) and change nothing.
TEST_F(DaemonTest, CopyPagesBringsHostPagesIntoAcquiredPages) {
  start_daemon();
  uint64_t seed = std::random_device{}();
  SCOPED_TRACE("random seed " + std::to_string(seed));
  std::mt19937_64 random(seed);
  auto client = connect_client("trainer");
  ASSERT_TRUE(client);
  constexpr uint64_t kPage = 96 << 10;   // pages straddle frames
  auto history = client->create_space("L00.k.history", kPage, 48);
  auto stage = client->create_space("L00.k.stage", kPage, 32);
  ASSERT_TRUE(history.ok() && stage.ok());
  PageRange all_history{history.value(), 0, 48}, all_stage{stage.value(), 0, 32};
  std::vector<uint8_t> history_bytes = random_bytes(random, 48 * kPage);
  auto host = client->acquire_host(all_history);
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  std::memcpy(host.value(), history_bytes.data(), history_bytes.size());
  ASSERT_TRUE(client->release_host(all_history, true).ok());
  auto offloaded = client->offload(all_history);
  ASSERT_TRUE(offloaded.ok() && client->wait(offloaded.value()).ok());
  ASSERT_EQ(gpu_resident_bytes(*client, history.value()), 0u);
  auto acquired = client->acquire(all_stage, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(acquired.ok()) << acquired.status().to_string();
  ASSERT_TRUE(client->wait(acquired.value().ticket).ok());
  char* staged = static_cast<char*>(acquired.value().pointer);
  std::vector<uint8_t> stage_bytes = random_bytes(random, 32 * kPage);
  std::memcpy(staged, stage_bytes.data(), stage_bytes.size());

  // Bad calls first.
  std::vector<PageRange> pairs = {{history.value(), 15, 12}, {stage.value(), 12, 12}};
  EXPECT_EQ(client->copy_pages({}, std::nullopt).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(client->copy_pages({pairs[0]}, std::nullopt).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(client->copy_pages({{history.value(), 0, 4}, {stage.value(), 0, 5}}, std::nullopt).status().code(),
            StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(client->copy_pages({{stage.value(), 0, 8}, {stage.value(), 4, 8}}, std::nullopt).status().code(),
            StatusCode::INVALID_ARGUMENT);
  std::vector<PageRange> too_many;
  for (uint32_t p = 0; p < 2049; ++p) {
    too_many.push_back({history.value(), p % 48, 1});
    too_many.push_back({stage.value(), p % 32, 1});
  }
  EXPECT_EQ(client->copy_pages(too_many, std::nullopt).status().code(), StatusCode::INVALID_ARGUMENT);
  Status unknown = client->copy_pages({{stage.value() + 7, 0, 4}, {stage.value(), 0, 4}}, std::nullopt).status();
  EXPECT_TRUE(unknown.code() == StatusCode::NOT_FOUND || unknown.code() == StatusCode::INVALID_ARGUMENT)
      << unknown.to_string();
  Status past_end = client->copy_pages({{history.value(), 40, 12}, {stage.value(), 0, 12}}, std::nullopt).status();
  EXPECT_TRUE(past_end.code() == StatusCode::OUT_OF_RANGE || past_end.code() == StatusCode::INVALID_ARGUMENT)
      << past_end.to_string();
  EXPECT_EQ(client->stream_mark(nullptr).status().code(), StatusCode::UNIMPLEMENTED) << "a stream on the host backend";
  EXPECT_EQ(client->copy_pages(pairs, uint64_t{1}).status().code(), StatusCode::INVALID_ARGUMENT)
      << "a marker no stream of this client wrote";
  EXPECT_TRUE(same_bytes(staged, stage_bytes, kPage)) << "a refused copy changed the stage";

  auto copied = client->copy_pages(pairs, std::nullopt);
  ASSERT_TRUE(copied.ok()) << copied.status().to_string();
  ASSERT_TRUE(client->wait(copied.value()).ok());
  std::vector<uint8_t> expected = stage_bytes;
  std::memcpy(expected.data() + 12 * kPage, history_bytes.data() + 15 * kPage, 12 * kPage);
  EXPECT_TRUE(same_bytes(staged, expected, kPage));
  EXPECT_EQ(gpu_resident_bytes(*client, history.value()), 0u) << "membard placed the source on the GPU";
  ASSERT_TRUE(client->release(all_stage, true).ok());
  host = client->acquire_host(all_history);
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  EXPECT_TRUE(same_bytes(host.value(), history_bytes, kPage)) << "the source changed";
  EXPECT_TRUE(client->release_host(all_history, false).ok());
}

// prefetch_ranges: several ranges of two spaces in one ring request. The frames come back to the GPU
// ahead of the acquire (which then counts them as prefetch hits), the bytes are the ones written,
// and a request naming a range past a space's end is refused with a clear error.
TEST_F(DaemonTest, PrefetchRangesBringsOffloadedPagesBackInOneCall) {
  start_daemon();
  uint64_t seed = std::random_device{}();
  SCOPED_TRACE("random seed " + std::to_string(seed));
  std::mt19937_64 random(seed);
  auto client = connect_client("trainer");
  ASSERT_TRUE(client);
  constexpr uint64_t kPage = 512 << 10;   // 4 pages a frame
  auto k = client->create_space("L00.k", kPage, 32);
  auto v = client->create_space("L00.v", kPage, 32);
  ASSERT_TRUE(k.ok() && v.ok());
  std::vector<std::vector<uint8_t>> bytes;
  for (SpaceId space : {k.value(), v.value()}) {
    PageRange all{space, 0, 32};
    bytes.push_back(random_bytes(random, 32 * kPage));
    auto host = client->acquire_host(all);
    ASSERT_TRUE(host.ok()) << host.status().to_string();
    std::memcpy(host.value(), bytes.back().data(), bytes.back().size());
    ASSERT_TRUE(client->release_host(all, true).ok());
    auto offloaded = client->offload(all);
    ASSERT_TRUE(offloaded.ok() && client->wait(offloaded.value()).ok());
    ASSERT_EQ(gpu_resident_bytes(*client, space), 0u);
  }
  EXPECT_EQ(client->prefetch_ranges({{k.value(), 0, 4}, {v.value(), 30, 4}}).status().code(),
            StatusCode::OUT_OF_RANGE);
  // Frames 0 and 5 of K (pages 0-3 and 20-23), frame 2 of V (pages 8-11).
  std::vector<PageRange> wanted = {{k.value(), 0, 4}, {k.value(), 20, 4}, {v.value(), 8, 4}};
  auto before = client->stats();
  ASSERT_TRUE(before.ok());
  auto prefetched = client->prefetch_ranges(wanted);
  ASSERT_TRUE(prefetched.ok()) << prefetched.status().to_string();
  ASSERT_TRUE(client->wait(prefetched.value()).ok());
  EXPECT_EQ(gpu_resident_bytes(*client, k.value()), 2 * 4 * kPage);
  EXPECT_EQ(gpu_resident_bytes(*client, v.value()), 4 * kPage);
  auto hits = [](const RuntimeStats& stats) {
    for (const ClientStats& c : stats.clients) {
      if (c.name == "trainer") return c.prefetch_hits;
    }
    return uint64_t{0};
  };
  for (size_t i = 0; i < wanted.size(); ++i) {
    auto acquired = client->acquire(wanted[i], 0);
    ASSERT_TRUE(acquired.ok()) << acquired.status().to_string();
    ASSERT_TRUE(client->wait(acquired.value().ticket).ok());
    const std::vector<uint8_t>& expected = bytes[i < 2 ? 0 : 1];
    EXPECT_EQ(std::memcmp(acquired.value().pointer, expected.data() + wanted[i].first_page * kPage, 4 * kPage), 0)
        << "range " << i;
    ASSERT_TRUE(client->release(wanted[i], false).ok());
  }
  auto after = client->stats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(hits(after.value()) - hits(before.value()), 3u) << "each prefetched frame found on the GPU";
}

// Space ids are per client: client B naming ids that only client A has is refused in either role,
// B's copies within its own spaces (whose ids A's spaces also have) carry only B's bytes, and A's
// bytes stay as they were.
TEST_F(DaemonTest, CopyPagesCannotReachAnotherClientsPages) {
  start_daemon();
  auto owner = connect_client("owner");
  auto intruder = connect_client("intruder");
  ASSERT_TRUE(owner && intruder);
  constexpr uint64_t kPage = 64 << 10;
  constexpr uint32_t kOwner = 0xa11ce, kIntruder = 0xb0b;
  std::vector<SpaceId> owned;
  for (int s = 0; s < 3; ++s) {
    auto space = owner->create_space("secret" + std::to_string(s), kPage, 32);
    ASSERT_TRUE(space.ok());
    owned.push_back(space.value());
    auto host = owner->acquire_host({space.value(), 0, 32});
    ASSERT_TRUE(host.ok()) << host.status().to_string();
    fill_signed(host.value(), 32 * kPage, kOwner, s);
    ASSERT_TRUE(owner->release_host({space.value(), 0, 32}, true).ok());
  }
  auto own = intruder->create_space("mine", kPage, 32);
  auto spare = intruder->create_space("spare", kPage, 32);
  ASSERT_TRUE(own.ok() && spare.ok());
  auto acquired = intruder->acquire({own.value(), 0, 32}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(acquired.ok() && intruder->wait(acquired.value().ticket).ok());
  fill_signed(acquired.value().pointer, 32 * kPage, kIntruder, 0);
  SpaceId foreign = owned.back();
  ASSERT_TRUE(foreign != own.value() && foreign != spare.value()) << "the owner's third space id is its own";

  auto is_refused = [](const Status& status) {
    return status.code() == StatusCode::NOT_FOUND || status.code() == StatusCode::INVALID_ARGUMENT;
  };
  Status reading = intruder->copy_pages({{foreign, 0, 8}, {own.value(), 0, 8}}, std::nullopt).status();
  EXPECT_TRUE(is_refused(reading)) << reading.to_string();
  Status writing = intruder->copy_pages({{own.value(), 0, 8}, {foreign, 0, 8}}, std::nullopt).status();
  EXPECT_TRUE(is_refused(writing)) << writing.to_string();
  EXPECT_TRUE(check_signed(acquired.value().pointer, 32 * kPage, kIntruder, 0)) << "a refused copy changed B's pages";
  // B's own copies (its space ids are A's too): only B's bytes, wherever they go.
  auto copied = intruder->copy_pages({{own.value(), 0, 16}, {spare.value(), 8, 16}}, std::nullopt);
  ASSERT_TRUE(copied.ok()) << copied.status().to_string();
  ASSERT_TRUE(intruder->wait(copied.value()).ok());
  ASSERT_TRUE(intruder->release({own.value(), 0, 32}, true).ok());
  auto seen = intruder->acquire_host({spare.value(), 0, 32});
  ASSERT_TRUE(seen.ok()) << seen.status().to_string();
  EXPECT_EQ(foreign_words(seen.value(), 32 * kPage, kIntruder), 0u) << "B read bytes that are not its own";
  EXPECT_TRUE(check_signed(static_cast<char*>(seen.value()) + 8 * kPage, 16 * kPage, kIntruder, 0));
  EXPECT_TRUE(intruder->release_host({spare.value(), 0, 32}, false).ok());
  for (int s = 0; s < 3; ++s) {
    auto host = owner->acquire_host({owned[s], 0, 32});
    ASSERT_TRUE(host.ok()) << host.status().to_string();
    EXPECT_TRUE(check_signed(host.value(), 32 * kPage, kOwner, s)) << "the owner's space " << s << " changed";
    EXPECT_TRUE(owner->release_host({owned[s], 0, 32}, false).ok());
  }
}

// The copy_pages opcode on the ring, spoken by hand: its request rules (no space or pages in the
// header, only the after-marker flag, a marker of at least 1 with it, ranges in the payload), and a
// copy after a marker held by membard until the client's released word reaches it.
TEST_F(DaemonTest, CopyPagesRequestsAreCheckedOnTheRingAndWaitForTheMarker) {
  start_daemon();
  RawPeer peer;
  // The handshake of RawPeer, keeping the signal block (the hello reply's first descriptor).
  peer.fd = connect_unix(socket_path_);
  ASSERT_GE(peer.fd, 0);
  v2::HelloV2 hello{};
  v2::copy_text(hello.client_name, sizeof(hello.client_name), "raw-copies");
  ASSERT_TRUE(peer.send_raw(v2::encode_message(v2::MessageType::kHello, hello)));
  auto reply = read_one(peer.fd, peer.assembler);
  ASSERT_TRUE(reply && reply->header.type == static_cast<uint16_t>(v2::MessageType::kHelloReply));
  auto decoded = v2::decode_hello_reply(reply->payload);
  ASSERT_TRUE(decoded.ok() && decoded.value().status == 0 && reply->fds.size() == 2);
  peer.hello_reply = decoded.value();
  peer.segment_bytes = peer.hello_reply.segment_bytes;
  void* segment = ::mmap(nullptr, peer.segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, reply->fds[1].get(), 0);
  ASSERT_NE(segment, MAP_FAILED);
  peer.segment = segment;
  uint64_t signal_bytes = uint64_t(peer.hello_reply.signal_words) * 8;
  ASSERT_GT(peer.hello_reply.signal_words, 1u);
  void* signals = ::mmap(nullptr, signal_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, reply->fds[0].get(), 0);
  ASSERT_NE(signals, MAP_FAILED);
  auto layout = v2::read_segment_header(peer.segment, peer.segment_bytes);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  peer.layout = layout.value();
  auto* base = static_cast<uint8_t*>(peer.segment);
  peer.requests = protocol::RingEnd<v2::RequestV2>(base + peer.layout.request_ring_offset, peer.layout.ring_capacity);
  peer.completions =
      protocol::RingEnd<v2::CompletionV2>(base + peer.layout.completion_ring_offset, peer.layout.ring_capacity);

  auto created = peer.create_space("source", 64 << 10, 32);
  ASSERT_EQ(created.code, StatusCode::OK) << created.message;
  SpaceId source = SpaceId(created.value);
  created = peer.create_space("target", 64 << 10, 32);
  ASSERT_EQ(created.code, StatusCode::OK) << created.message;
  SpaceId target = SpaceId(created.value);
  auto host = peer.call(RawPeer::make(v2::Opcode::kAcquireHost, source, 0, 32));
  ASSERT_EQ(host.code, StatusCode::OK) << host.message;
  ASSERT_TRUE(peer.wait(host.ticket));
  v2::RequestV2 release_host = RawPeer::make(v2::Opcode::kReleaseHost, source, 0, 32);
  release_host.flags = v2::kReleaseDirty;
  ASSERT_EQ(peer.call(release_host).code, StatusCode::OK);

  std::vector<uint8_t> encoded = v2::encode_ranges({{source, 0, 8}, {target, 8, 8}});
  std::string payload(encoded.begin(), encoded.end());
  auto copy_request = [&](uint32_t flags, uint64_t argument) {
    v2::RequestV2 request = RawPeer::make(v2::Opcode::kCopyPages);
    request.flags = flags;
    request.argument = argument;
    request.payload_bytes = uint32_t(payload.size());
    return request;
  };
  EXPECT_EQ(peer.call(copy_request(v2::kCopyAfterMarker, 0), payload).code, StatusCode::INVALID_ARGUMENT)
      << "a marker of 0";
  EXPECT_EQ(peer.call(copy_request(0, 5), payload).code, StatusCode::INVALID_ARGUMENT)
      << "an argument without the flag";
  EXPECT_EQ(peer.call(copy_request(1u << 0, 0), payload).code, StatusCode::INVALID_ARGUMENT) << "an unknown flag";
  v2::RequestV2 with_space = copy_request(0, 0);
  with_space.space = source;
  EXPECT_EQ(peer.call(with_space, payload).code, StatusCode::INVALID_ARGUMENT) << "a space in the header";
  v2::RequestV2 no_payload = copy_request(0, 0);
  no_payload.payload_bytes = 0;
  EXPECT_EQ(peer.call(no_payload).code, StatusCode::INVALID_ARGUMENT) << "no ranges";
  v2::RequestV2 truncated = copy_request(0, 0);
  truncated.payload_bytes = uint32_t(payload.size() - 3);
  EXPECT_EQ(peer.call(truncated, payload.substr(0, payload.size() - 3)).code, StatusCode::INVALID_ARGUMENT)
      << "ranges cut short";

  // After marker 1: held until the released word (signal word 1) reaches it.
  auto held = peer.call(copy_request(v2::kCopyAfterMarker, 1), payload);
  ASSERT_EQ(held.code, StatusCode::OK) << held.message;
  ASSERT_GT(held.ticket, 0u);
  EXPECT_FALSE(peer.wait(held.ticket, 0.05)) << "the copy ran before the stream passed the marker";
  std::atomic_ref<uint64_t>(static_cast<uint64_t*>(signals)[1]).store(1, std::memory_order_release);
  EXPECT_TRUE(peer.wait(held.ticket)) << "the copy never ran after the marker";
  auto now = peer.call(copy_request(0, 0), payload);
  ASSERT_EQ(now.code, StatusCode::OK) << now.message;
  EXPECT_GT(now.ticket, held.ticket);
  EXPECT_TRUE(peer.wait(now.ticket));
  ::munmap(signals, signal_bytes);
}

#else  // MEMBAR_DAEMON_GPU_TESTS: the same daemon on the CUDA VMM backend (label gpu).

TEST_F(DaemonTest, CudaBackendTwoClientProcessesKeepEveryPage) {
  backend_ = "cuda";
  start_daemon({"--default-gpu-quota", "4MiB"});
  std::vector<Process> workers;
  for (int w = 0; w < 2; ++w) {
    workers.push_back(Process::spawn({WORKER_PATH, "integrity", "--socket", socket_path_, "--seed",
                                      std::to_string(2000 + w), "--cycles", "2500", "--pages", "64"},
                                     directory_ + "/gpu-worker" + std::to_string(w) + ".out"));
  }
  for (int w = 0; w < 2; ++w) {
    int code = workers[w].wait(300);
    std::string output = workers[w].output();
    EXPECT_EQ(code, 0) << "worker " << w << ":\n" << output << "\nmembard:\n" << daemon_.output();
    EXPECT_NE(output.find("corrupted=0 lost=0 failed_calls=0"), std::string::npos) << output;
  }
  EXPECT_EQ(frames_used("gpu"), 0);
}

TEST_F(DaemonTest, CudaBackendKillNineReclaimsFrames) {
  backend_ = "cuda";
  start_daemon();
  Process holder = Process::spawn({WORKER_PATH, "hold", "--socket", socket_path_, "--pages", "96"},
                                  directory_ + "/holder.out");
  auto start = Clock::now();
  while (holder.output().find("READY") == std::string::npos && seconds_since(start) < 30) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_NE(holder.output().find("READY"), std::string::npos) << holder.output() << daemon_.output();
  EXPECT_GT(frames_used("gpu"), 0);
  holder.kill_now(SIGKILL);
  auto killed = Clock::now();
  holder.wait(5);
  while (frames_used("gpu") != 0 && seconds_since(killed) < 3) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(frames_used("gpu"), 0);
  EXPECT_LT(seconds_since(killed), 1.0);
}

#endif

}  // namespace
}  // namespace membar::integration
