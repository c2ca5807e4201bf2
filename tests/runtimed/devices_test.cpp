// Integration tests (label integration) of one membard serving several devices
// (`--devices 0,1` on the host backend, where the ordinals are labels): each device has its own
// engine and GPU pool, the host pool is the node's, a client names its device in the hello, and membarctl and Prometheus show
// every device. Note [Devices of one daemon] in include/membar/protocol/v2.h.
#include <netinet/in.h>

#include "daemon_harness.h"

namespace membar::integration {
namespace {

constexpr uint64_t kMiB = 1ull << 20;

class DevicesTest : public DaemonTest {
 protected:
  std::unique_ptr<Client> connect_to(const std::string& name, std::optional<int> device) {
    ConnectOptions options;
    options.client_name = name;
    options.device = device;
    auto client = connect_daemon(socket_path_, options);
    EXPECT_TRUE(client.ok()) << client.status().to_string();
    return client.ok() ? std::move(client).value() : nullptr;
  }

  // Writes `pattern` + page index into every byte of the space's pages on the GPU tier,
  // releases them dirty and offloads them, so that reading back goes through the host tier.
  static void write_pages(Client& client, SpaceId space, uint32_t pages, uint64_t page_bytes, uint8_t pattern) {
    auto acquired = client.acquire({space, 0, pages}, kAcquireWrite | kAcquireZeroNew);
    ASSERT_TRUE(acquired.ok()) << acquired.status().to_string();
    ASSERT_TRUE(client.wait(acquired.value().ticket).ok());
    auto* bytes = static_cast<uint8_t*>(acquired.value().pointer);
    for (uint32_t p = 0; p < pages; ++p) std::memset(bytes + p * page_bytes, pattern + p, page_bytes);
    ASSERT_TRUE(client.release({space, 0, pages}, true).ok());
    auto offloaded = client.offload({space, 0, pages});
    ASSERT_TRUE(offloaded.ok()) << offloaded.status().to_string();
    ASSERT_TRUE(client.wait(offloaded.value()).ok());
  }

  // True when every byte of every page reads `pattern` + page index (GPU tier, acquired back).
  static bool pages_hold(Client& client, SpaceId space, uint32_t pages, uint64_t page_bytes, uint8_t pattern) {
    auto acquired = client.acquire({space, 0, pages}, kAcquireRead);
    if (!acquired.ok() || !client.wait(acquired.value().ticket).ok()) return false;
    const auto* bytes = static_cast<const uint8_t*>(acquired.value().pointer);
    bool same = true;
    for (uint64_t i = 0; i < pages * page_bytes && same; ++i) same = bytes[i] == uint8_t(pattern + i / page_bytes);
    (void)client.release({space, 0, pages}, false);
    return same;
  }

  static std::string http_get_metrics(int port) {
    int http = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(static_cast<uint16_t>(port));
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    std::string response;
    if (::connect(http, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0) {
      std::string request = "GET /metrics HTTP/1.0\r\n\r\n";
      (void)!::send(http, request.data(), request.size(), 0);
      char buffer[4096];
      ssize_t n;
      while ((n = ::recv(http, buffer, sizeof(buffer), 0)) > 0) response.append(buffer, static_cast<size_t>(n));
    }
    ::close(http);
    return response;
  }
};

TEST_F(DevicesTest, ClientsOnTwoDevicesKeepTheirOwnBytesAndPools) {
  start_daemon({"--devices", "0,1"});  // 32 MiB GPU pool per device, 128 MiB host pool for both
  auto on_zero = connect_to("on-zero", 0);
  auto on_one = connect_to("on-one", 1);
  ASSERT_TRUE(on_zero && on_one);
  EXPECT_EQ(on_zero->device(), 0);
  EXPECT_EQ(on_one->device(), 1);

  // The same space name on both devices: spaces live in each device's engine.
  const uint64_t page_bytes = kMiB;
  const uint32_t pages = 6;
  auto zero_space = on_zero->create_space("L00.k", page_bytes, pages);
  auto one_space = on_one->create_space("L00.k", page_bytes, pages);
  ASSERT_TRUE(zero_space.ok() && one_space.ok());
  write_pages(*on_zero, zero_space.value(), pages, page_bytes, 0x10);
  write_pages(*on_one, one_space.value(), pages, page_bytes, 0xa0);
  EXPECT_TRUE(pages_hold(*on_zero, zero_space.value(), pages, page_bytes, 0x10));
  EXPECT_TRUE(pages_hold(*on_one, one_space.value(), pages, page_bytes, 0xa0));

  // Client ids are unique across the daemon; each client's stats show its own device's engine.
  auto zero_stats = on_zero->stats();
  auto one_stats = on_one->stats();
  ASSERT_TRUE(zero_stats.ok() && one_stats.ok());
  ASSERT_EQ(zero_stats.value().clients.size(), 1u);
  ASSERT_EQ(one_stats.value().clients.size(), 1u);
  EXPECT_NE(zero_stats.value().clients[0].client, one_stats.value().clients[0].client);
  EXPECT_EQ(zero_stats.value().clients[0].name, "on-zero");
  EXPECT_EQ(one_stats.value().clients[0].name, "on-one");

  // Pools are per device: a client that takes device 0's whole GPU pool (32 MiB) leaves
  // device 1's untouched, and a client there can take all of its own.
  auto whole_zero = on_zero->create_space("whole", 32 * kMiB, 1);
  auto whole_one = on_one->create_space("whole", 32 * kMiB, 1);
  ASSERT_TRUE(whole_zero.ok() && whole_one.ok());
  auto taken_zero = on_zero->acquire({whole_zero.value(), 0, 1}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(taken_zero.ok()) << taken_zero.status().to_string();
  ASSERT_TRUE(on_zero->wait(taken_zero.value().ticket).ok());
  auto taken_one = on_one->acquire({whole_one.value(), 0, 1}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(taken_one.ok()) << taken_one.status().to_string();
  ASSERT_TRUE(on_one->wait(taken_one.value().ticket).ok());
  auto full_zero = on_zero->stats();
  ASSERT_TRUE(full_zero.ok());
  EXPECT_EQ(full_zero.value().tiers[0].frames_total, 16u);
  EXPECT_EQ(full_zero.value().tiers[0].frames_used, 16u);
  // Both pools were full at once; the earlier pages come back from each device's own host tier.
  ASSERT_TRUE(on_zero->release({whole_zero.value(), 0, 1}, false).ok());
  ASSERT_TRUE(on_one->release({whole_one.value(), 0, 1}, false).ok());
  EXPECT_TRUE(pages_hold(*on_zero, zero_space.value(), pages, page_bytes, 0x10));
  EXPECT_TRUE(pages_hold(*on_one, one_space.value(), pages, page_bytes, 0xa0));
}

// The host pool is the node's (Note [One host pool for a node]): a client alone on device 1 fills
// 120 of the 128 MiB (device 1 backed only half of it at start-up; device 0 gives back its free
// slabs), and its bytes read back intact; a client on device 0 then gets what is left, zeroed.
// Host frames a device could hand its clients now: its own free and preparing ones and what the
// node's pool would give it on request (what Runtime.pool_bytes_left counts).
uint64_t host_frames_for(Client& client) {
  auto stats = client.stats();
  EXPECT_TRUE(stats.ok());
  if (!stats.ok()) return 0;
  const TierStats& host = stats.value().tiers[1];
  return host.frames_free + host.frames_preparing + host.frames_on_request;
}

uint64_t host_frames_used(Client& client) {
  auto stats = client.stats();
  return stats.ok() ? stats.value().tiers[1].frames_used : 0;
}

TEST_F(DevicesTest, OneDeviceCanUseTheWholeHostPool) {
  start_daemon({"--devices", "0,1"});  // 128 MiB host pool for both devices
  auto on_one = connect_to("on-one", 1);
  ASSERT_TRUE(on_one);
  auto watcher = connect_to("watcher", 0);
  ASSERT_TRUE(watcher);
  // Each device backs half of the pool and sees the other half as on request: the whole pool.
  EXPECT_EQ(host_frames_for(*watcher), 64u);
  EXPECT_EQ(host_frames_for(*on_one), 64u);
  const uint64_t page_bytes = kMiB;
  const uint32_t pages = 120;
  auto space = on_one->create_space("offloaded", page_bytes, pages);
  ASSERT_TRUE(space.ok()) << space.status().to_string();
  auto host = on_one->acquire_host({space.value(), 0, pages});
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  auto* bytes = static_cast<uint8_t*>(host.value());
  for (uint32_t p = 0; p < pages; ++p) std::memset(bytes + p * page_bytes, 0x30 + p, page_bytes);
  ASSERT_TRUE(on_one->release_host({space.value(), 0, pages}, true).ok());
  auto one_stats = on_one->stats();
  ASSERT_TRUE(one_stats.ok());
  EXPECT_GE(one_stats.value().tiers[1].frames_used, 60u);   // 120 MiB in 2 MiB frames
  EXPECT_GE(one_stats.value().tiers[1].frames_total, 60u);  // more than its half of 64
  // Device 0 sees what is left of the node's pool, not the half it started with.
  EXPECT_EQ(host_frames_for(*watcher), 64u - host_frames_used(*on_one));
  EXPECT_LE(host_frames_for(*watcher), 4u);

  auto on_zero = connect_to("on-zero", 0);
  ASSERT_TRUE(on_zero);
  auto rest = on_zero->create_space("rest", page_bytes, 4);
  ASSERT_TRUE(rest.ok());
  auto zero_host = on_zero->acquire_host({rest.value(), 0, 4});
  ASSERT_TRUE(zero_host.ok()) << zero_host.status().to_string();
  const auto* zeros = static_cast<const uint8_t*>(zero_host.value());
  bool all_zero = true;
  for (uint64_t i = 0; i < 4 * page_bytes && all_zero; ++i) all_zero = zeros[i] == 0;
  EXPECT_TRUE(all_zero);
  ASSERT_TRUE(on_zero->release_host({rest.value(), 0, 4}, false).ok());
  // More than the node has left is a clear error on device 0, and device 1 loses nothing.
  auto more = on_zero->create_space("more", page_bytes, 16);
  ASSERT_TRUE(more.ok());
  auto refused = on_zero->acquire_host({more.value(), 0, 16});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::RESOURCE_EXHAUSTED) << refused.status().to_string();
  auto again = on_one->acquire_host({space.value(), 0, pages});
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  bytes = static_cast<uint8_t*>(again.value());
  bool intact = true;
  for (uint64_t i = 0; i < pages * page_bytes && intact; ++i) intact = bytes[i] == uint8_t(0x30 + i / page_bytes);
  EXPECT_TRUE(intact);
  ASSERT_TRUE(on_one->release_host({space.value(), 0, pages}, false).ok());
}

TEST_F(DevicesTest, AClientNamingNoDeviceGetsTheFirstListed) {
  start_daemon({"--devices", "3,1"});
  auto unnamed = connect_to("unnamed", std::nullopt);
  auto on_one = connect_to("on-one", 1);
  ASSERT_TRUE(unnamed && on_one);
  EXPECT_EQ(unnamed->device(), 3);
  EXPECT_EQ(on_one->device(), 1);
  // The default connect (as before devices were added) still works.
  auto plain = connect_client("plain");
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->device(), 3);
}

TEST_F(DevicesTest, ADeviceTheDaemonDoesNotServeIsAClearError) {
  start_daemon({"--devices", "0,1"});
  ConnectOptions options;
  options.client_name = "lost";
  options.device = 2;
  auto refused = connect_daemon(socket_path_, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::NOT_FOUND) << refused.status().to_string();
  EXPECT_NE(refused.status().message().find("this membard serves devices 0, 1; not 2"), std::string::npos)
      << refused.status().to_string();
  options.device = 99;  // past the protocol's ordinals: refused before anything is sent
  EXPECT_EQ(connect_daemon(socket_path_, options).status().code(), StatusCode::INVALID_ARGUMENT);
  // The refusal cost nothing: the daemon serves the next client.
  auto on_one = connect_to("on-one", 1);
  ASSERT_TRUE(on_one);
  EXPECT_EQ(on_one->device(), 1);
}

TEST_F(DevicesTest, AChannelReachesAReaderOnAnotherDevice) {
  start_daemon({"--devices", "0,1"});
  auto writer = connect_to("writer", 0);
  auto reader = connect_to("reader", 1);
  ASSERT_TRUE(writer && reader);
  auto created = writer->create_channel("policy.sync", 64 << 10);
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  std::memset(created.value().data, 0x5c, 64 << 10);
  auto opened = reader->open_channel("policy.sync");
  ASSERT_TRUE(opened.ok()) << opened.status().to_string();
  const auto* bytes = static_cast<const uint8_t*>(opened.value().data);
  EXPECT_EQ(bytes[0], 0x5c);
  EXPECT_EQ(bytes[(64 << 10) - 1], 0x5c);
}

TEST_F(DevicesTest, MembarctlAndPrometheusShowEveryDeviceAndWhereEachClientIs) {
  start_daemon({"--devices", "0,1", "--prometheus-port", "0"});
  auto on_zero = connect_to("trainer-zero", 0);
  auto on_one = connect_to("trainer-one", 1);
  ASSERT_TRUE(on_zero && on_one);
  auto space = on_one->create_space("L01.v", kMiB, 2);
  ASSERT_TRUE(space.ok());
  auto acquired = on_one->acquire({space.value(), 0, 2}, kAcquireWrite | kAcquireZeroNew);
  ASSERT_TRUE(acquired.ok());
  ASSERT_TRUE(on_one->wait(acquired.value().ticket).ok());
  const std::string one_id = std::to_string(on_one->stats().value().clients[0].client);

  int code = -1;
  std::string json = ctl("stats --json", &code);
  ASSERT_EQ(code, 0) << json;
  // Both devices, each with its tiers and its clients; the top-level keys of one device remain.
  EXPECT_NE(json.find("\"devices\": ["), std::string::npos) << json;
  EXPECT_NE(json.find("{\"device\": 0, \"spaces_total\": 0, \"clients\": ["), std::string::npos) << json;
  EXPECT_NE(json.find("{\"device\": 1, \"spaces_total\": 1, \"clients\": [" + one_id + "], \"tiers\": ["),
            std::string::npos)
      << json;
  EXPECT_NE(json.find("\"tiers\": ["), std::string::npos) << json;
  EXPECT_NE(json.find("\"spaces_total\": 1,\n  \"tiers\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"client\": " + one_id + ", \"device\": 1, \"name\": \"trainer-one\""), std::string::npos)
      << json;
  EXPECT_NE(json.find("\"device\": 0, \"name\": \"trainer-zero\""), std::string::npos) << json;
  EXPECT_NE(json.find("\"name\": \"L01.v\", \"client\": " + one_id + ", \"device\": 1"), std::string::npos) << json;
  EXPECT_EQ(count_occurrences(json, "\"tier\": \"gpu\", \"frames_total\": 16"), 3u) << json;  // top level + 2
  EXPECT_EQ(frames_used("gpu"), 0);  // the top-level tiers are device 0's

  std::string text = ctl("stats", &code);
  ASSERT_EQ(code, 0) << text;
  for (const char* expected : {"devices: 0, 1", "clients: 2", "# Tier gpu (device 0)", "# Tier gpu (device 1)",
                               "name: trainer-one", "device: 1", "name: L01.v"}) {
    EXPECT_NE(text.find(expected), std::string::npos) << "missing '" << expected << "' in\n" << text;
  }
  std::string top = ctl("top --iterations 1", &code);
  ASSERT_EQ(code, 0) << top;
  EXPECT_NE(top.find("devices 0, 1"), std::string::npos) << top;
  EXPECT_NE(top.find("dev 1  gpu"), std::string::npos) << top;
  EXPECT_NE(top.find("  1 trainer-one"), std::string::npos) << top;

  std::string ping = ctl("ping", &code);
  ASSERT_EQ(code, 0) << ping;
  EXPECT_NE(ping.find("alive (backend host, devices 0, 1,"), std::string::npos) << ping;

  std::smatch match;
  std::string log = daemon_.output();
  ASSERT_TRUE(std::regex_search(log, match, std::regex("127\\.0\\.0\\.1:([0-9]+)/metrics"))) << log;
  std::string metrics = http_get_metrics(std::stoi(match[1]));
  EXPECT_NE(metrics.find("200 OK"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("membar_frames_total{device=\"0\",tier=\"gpu\"} 16\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("membar_frames_used{device=\"1\",tier=\"gpu\"} 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("membar_clients{device=\"1\"} 1\n"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("membar_client_frames{device=\"1\",client=\"" + one_id + "\",name=\"trainer-one\""),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("membar_space_bytes{device=\"1\",client=\"" + one_id + "\",space=\"L01.v\""),
            std::string::npos)
      << metrics;
}

}  // namespace
}  // namespace membar::integration
