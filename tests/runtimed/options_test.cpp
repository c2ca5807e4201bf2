// Unit tests (label unit) of membard's pieces that need no process: flag and size parsing, and
// the Prometheus text format.
#include <gtest/gtest.h>

#include <vector>

#include "options.h"
#include "prometheus.h"

namespace membar::runtimed {
namespace {

TEST(ParseSize, AcceptsUnitsAndFractions) {
  EXPECT_EQ(parse_size("40GiB").value().bytes, 40ull << 30);
  EXPECT_EQ(parse_size("40G").value().bytes, 40ull << 30);
  EXPECT_EQ(parse_size("512MiB").value().bytes, 512ull << 20);
  EXPECT_EQ(parse_size("64KiB").value().bytes, 64ull << 10);
  EXPECT_EQ(parse_size("1048576").value().bytes, 1ull << 20);
  EXPECT_EQ(parse_size("1.5GiB").value().bytes, 3ull << 29);
  EXPECT_DOUBLE_EQ(parse_size("0.8").value().fraction, 0.8);
  EXPECT_DOUBLE_EQ(parse_size("1.0").value().fraction, 1.0);
}

TEST(ParseSize, RejectsGarbage) {
  for (const char* bad : {"", "GiB", "-1GiB", "40XB", "1.5", "0.0", "nan", "1e30TiB", "abc"}) {
    EXPECT_EQ(parse_size(bad).status().code(), StatusCode::INVALID_ARGUMENT) << bad;
  }
}

TEST(ResolveSize, RoundsDownToWholeFrames) {
  EXPECT_EQ(resolve_size(SizeSpec{5ull << 20, 0}, 0), 4ull << 20);
  EXPECT_EQ(resolve_size(SizeSpec{0, 0.5}, 100ull << 20), 50ull << 20);
  EXPECT_EQ(resolve_size(SizeSpec{0, 0.5}, 3ull << 20), 0u);
  EXPECT_EQ(human_bytes(40ull << 30), "40 GiB");
}

size_t count_of(const std::string& text, const std::string& needle) {
  size_t count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++count;
  return count;
}

Result<DaemonOptions> parse(std::vector<const char*> args) {
  args.insert(args.begin(), "membard");
  return parse_daemon_options(static_cast<int>(args.size()), args.data());
}

TEST(DaemonOptions, DevicesTakeAListAndDeviceIsItsAlias) {
  auto defaults = parse({});
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults.value().devices, (std::vector<int>{0}));
  EXPECT_FALSE(defaults.value().all_devices);
  auto listed = parse({"--backend", "host", "--devices", "0,1,3"});
  ASSERT_TRUE(listed.ok()) << listed.status().to_string();
  EXPECT_EQ(listed.value().devices, (std::vector<int>{0, 1, 3}));
  auto order_kept = parse({"--devices=3,0"});
  ASSERT_TRUE(order_kept.ok());
  EXPECT_EQ(order_kept.value().devices, (std::vector<int>{3, 0}));  // the first given is the default
  auto alias = parse({"--device", "2"});
  ASSERT_TRUE(alias.ok());
  EXPECT_EQ(alias.value().devices, (std::vector<int>{2}));
  EXPECT_EQ(parse({"--devices", "5"}).value().devices, parse({"--device", "5"}).value().devices);
}

// --host-numa-node: auto (the default), none, or a node (Note [Host pools near their GPU]).
TEST(DaemonOptions, HostNumaNodeTakesAutoNoneOrANumber) {
  EXPECT_EQ(parse({}).value().host_numa_node, -2);
  EXPECT_EQ(parse({"--host-numa-node", "auto"}).value().host_numa_node, -2);
  EXPECT_EQ(parse({"--host-numa-node", "none"}).value().host_numa_node, -1);
  EXPECT_EQ(parse({"--host-numa-node=1"}).value().host_numa_node, 1);
  for (const char* bad : {"-1", "x", "", "1x", "1024"}) {
    auto parsed = parse({"--host-numa-node", bad});
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_NE(parsed.status().message().find("--host-numa-node takes auto, none or a node number"), std::string::npos)
        << parsed.status().to_string();
  }
}

TEST(DaemonOptions, BadDeviceListsAreClearErrors) {
  for (std::vector<const char*> bad : {std::vector<const char*>{"--devices", ""}, {"--devices", "0,"}, {"--devices", ",1"},
                                       {"--devices", "0,,1"}, {"--devices", "a"}, {"--devices", "-1"},
                                       {"--devices", "32"}, {"--devices", "1,1"}, {"--devices", "0x1"},
                                       {"--device", "0,1"}, {"--device", "all"}, {"--devices"}}) {
    auto parsed = parse(bad);
    EXPECT_EQ(parsed.status().code(), StatusCode::INVALID_ARGUMENT) << bad.back();
  }
  EXPECT_NE(parse({"--devices", "1,1"}).status().message().find("listed twice"), std::string::npos);
  EXPECT_NE(parse({"--device", "0,1"}).status().message().find("use --devices 0,1"), std::string::npos);
}

// `--devices all` counts CUDA devices; the host backend has none, so it is refused (not read as
// device 0): a CI script asking for "all" on the host backend learns at once that it tests one.
TEST(DaemonOptions, DevicesAllIsForTheCudaBackend) {
  for (std::vector<const char*> args : {std::vector<const char*>{"--backend", "host", "--devices", "all"},
                                        {"--devices", "all", "--backend", "host"}}) {
    auto parsed = parse(args);
    ASSERT_EQ(parsed.status().code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(parsed.status().message().find("--devices all"), std::string::npos) << parsed.status().message();
  }
  auto cuda = parse({"--backend", "cuda", "--devices", "all"});
  ASSERT_TRUE(cuda.ok()) << cuda.status().to_string();
  EXPECT_TRUE(cuda.value().all_devices);
  EXPECT_NE(daemon_usage().find("--devices LIST|all"), std::string::npos);
  EXPECT_NE(daemon_usage().find("GPU pool of each device"), std::string::npos);
}

TEST(DaemonOptions, ParsesEveryFlag) {
  auto options = parse({"--backend", "host", "--socket", "/tmp/x.sock", "--gpu-pool", "0.8", "--host-pool=40GiB",
                        "--default-gpu-quota", "2GiB", "--allow-uid", "1000,1001", "--socket-mode", "0660",
                        "--prometheus-port", "9464", "--ring-capacity", "128", "--daemonize", "--pid-file",
                        "/tmp/membard.pid", "--log-level", "debug", "--device", "1", "--max-connections", "10000",
                        "--handshake-timeout", "250", "--max-spaces", "100", "--max-client-space", "1TiB", "--max-total-space", "2TiB",
                        "--queue-limit", "1MiB", "--default-host-quota", "0.25"});
  ASSERT_TRUE(options.ok()) << options.status().to_string();
  const DaemonOptions& o = options.value();
  EXPECT_EQ(o.backend, "host");
  EXPECT_EQ(o.server.socket_path, "/tmp/x.sock");
  EXPECT_DOUBLE_EQ(o.gpu_pool.fraction, 0.8);
  EXPECT_EQ(o.host_pool.bytes, 40ull << 30);
  EXPECT_EQ(o.default_gpu_quota.bytes, 2ull << 30);
  EXPECT_EQ(o.server.allowed_uids, (std::vector<uint32_t>{1000, 1001}));
  EXPECT_EQ(o.server.socket_mode, 0660u);
  EXPECT_EQ(o.server.prometheus_port, 9464);
  EXPECT_EQ(o.server.ring_capacity, 128u);
  EXPECT_TRUE(o.daemonize);
  EXPECT_EQ(o.pid_file, "/tmp/membard.pid");
  EXPECT_EQ(o.log_level, "debug");
  EXPECT_EQ(o.devices, (std::vector<int>{1}));
  EXPECT_EQ(o.server.max_connections, 10000u);
  EXPECT_EQ(o.server.handshake_timeout_ms, 250u);
  EXPECT_EQ(o.max_spaces, 100u);
  EXPECT_EQ(o.max_client_space.bytes, 1ull << 40);
  EXPECT_EQ(o.max_total_space.bytes, 2ull << 40);
  EXPECT_EQ(o.server.outbound.max_bytes, 1ull << 20);
  EXPECT_DOUBLE_EQ(o.default_host_quota.fraction, 0.25);
  // Defaults: in the foreground, and the limits docs/service.md lists.
  auto defaults = parse({});
  ASSERT_TRUE(defaults.ok());
  const DaemonOptions& d = defaults.value();
  EXPECT_EQ(d.server.socket_path, "/run/membar/membard.sock");
  EXPECT_EQ(d.server.socket_mode, 0600u);
  EXPECT_EQ(d.server.prometheus_port, -1);
  EXPECT_FALSE(d.daemonize);
  EXPECT_TRUE(d.pid_file.empty());
  EXPECT_EQ(d.server.max_connections, 256u);
  EXPECT_EQ(d.server.handshake_timeout_ms, 5000u);
  EXPECT_EQ(d.server.admin_idle_timeout_ms, 60000u);
  EXPECT_EQ(d.server.outbound.max_bytes, 16ull << 20);
  EXPECT_EQ(d.server.outbound.max_fds, 4096u);
  EXPECT_EQ(d.server.ring_capacity, 64u);
  EXPECT_EQ(d.max_spaces, 65536u);
  EXPECT_EQ(d.max_client_space.bytes, 32ull << 40);
  EXPECT_EQ(d.max_total_space.bytes, 32ull << 40);
  EXPECT_EQ(d.gpu_pool.bytes, 256ull << 20);
  EXPECT_EQ(d.host_pool.bytes, 1ull << 30);
  EXPECT_DOUBLE_EQ(d.default_gpu_quota.fraction, 1.0);
  EXPECT_DOUBLE_EQ(d.default_host_quota.fraction, 1.0);
  EXPECT_TRUE(parse({"--foreground"}).ok()) << "kept for scripts that pass it";
  EXPECT_FALSE(parse({"--foreground"}).value().daemonize);
}

TEST(DaemonOptions, RejectsBadFlagsWithTheirName) {
  struct Case {
    std::vector<const char*> args;
    const char* mentions;
  };
  std::vector<Case> cases = {
      {{"--backend", "tpu"}, "--backend"},      {{"--gpu-pool", "lots"}, "--gpu-pool"},
      {{"--socket-mode", "0777"}, "--socket-mode"}, {{"--allow-uid", "12,x"}, "--allow-uid"},
      {{"--prometheus-port", "70000"}, "--prometheus-port"}, {{"--ring-capacity", "1"}, "--ring-capacity"},
      {{"--log-level", "loud"}, "--log-level"}, {{"--frobnicate"}, "--frobnicate"},
      {{"--socket"}, "--socket"},
      {{"--max-connections", "0"}, "--max-connections"}, {{"--handshake-timeout", "5"}, "--handshake-timeout"},
      {{"--max-spaces", "0"}, "--max-spaces"}, {{"--max-client-space", "1MiB"}, "--max-client-space"},
      {{"--max-client-space", "0.5"}, "--max-client-space"},
      {{"--max-total-space", "1MiB"}, "--max-total-space"}, {{"--queue-limit", "1KiB"}, "--queue-limit"},
      {{"--default-gpu-quota", "1"}, "--default-gpu-quota"}, {{"--default-host-quota", "1MiB"}, "--default-host-quota"},
  };
  for (const Case& c : cases) {
    auto options = parse(c.args);
    ASSERT_FALSE(options.ok()) << c.mentions;
    EXPECT_EQ(options.status().code(), StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(options.status().message().find(c.mentions), std::string::npos) << options.status().to_string();
  }
}

TEST(Prometheus, FormatsTiersClientsAndSpacesWithEscapedLabels) {
  RuntimeStats stats;
  stats.backend = "host";
  stats.tiers = {{Tier::kGpu, 16, 3, 12, 1}, {Tier::kHost, 64, 0, 64, 0}};
  stats.tiers[0].frames_lost = 2;
  ClientStats client;
  client.client = 4;
  client.pid = 99;
  client.name = "we\"ird\\name";
  stat_increase(client.gpu_frames, 3);
  client.bytes_gpu_to_host = 12345;
  client.bytes_both = 777;
  client.channel_bytes = 2 << 20;
  client.stall_ns = 1500000000;
  stats.clients.push_back(client);
  SpaceInfo space{1, "L07.k", 96 << 10, 10};
  space.client = 4;
  space.bytes_host = 983040;
  stats.spaces.push_back(space);
  std::string text = format_prometheus(stats);
  EXPECT_NE(text.find("# TYPE membar_frames_total gauge"), std::string::npos);
  EXPECT_NE(text.find("membar_frames_used{tier=\"gpu\"} 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("membar_frames_free{tier=\"host\"} 64\n"), std::string::npos) << text;
  EXPECT_NE(text.find("membar_frames_preparing{tier=\"gpu\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("membar_frames_lost{tier=\"gpu\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("name=\"we\\\"ird\\\\name\""), std::string::npos) << text;
  EXPECT_NE(text.find("direction=\"gpu_to_host\"} 12345\n"), std::string::npos) << text;
  EXPECT_NE(text.find("residency=\"both\"} 777\n"), std::string::npos) << text;
  EXPECT_NE(text.find("membar_client_channel_bytes{client=\"4\""), std::string::npos) << text;
  EXPECT_NE(text.find("} 2097152\n"), std::string::npos) << text;
  EXPECT_NE(text.find("membar_client_stall_seconds_total{client=\"4\""), std::string::npos) << text;
  EXPECT_NE(text.find("} 1.5\n"), std::string::npos) << text;
  EXPECT_NE(text.find("membar_space_bytes{client=\"4\",space=\"L07.k\",state=\"host\"} 983040\n"),
            std::string::npos) << text;
}

TEST(Prometheus, SeveralDevicesLabelEverySampleWithItsDevice) {
  RuntimeStats zero;
  zero.backend = "host";
  zero.tiers = {{Tier::kGpu, 16, 0, 16, 0}, {Tier::kHost, 64, 0, 64, 0}};
  RuntimeStats one = zero;
  one.tiers[0].frames_used = 2;
  ClientStats client;
  client.client = 2;
  client.pid = 7;
  client.name = "on-one";
  one.clients.push_back(client);
  SpaceInfo space{1, "L00.k", 1 << 20, 4};
  space.client = 2;
  one.spaces.push_back(space);
  std::string text = format_prometheus(std::vector<DeviceRuntimeStats>{{0, zero}, {1, one}});
  EXPECT_EQ(count_of(text, "# TYPE membar_frames_used gauge"), 1u) << text;  // one family, every device in it
  EXPECT_NE(text.find("membar_frames_used{device=\"0\",tier=\"gpu\"} 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("membar_frames_used{device=\"1\",tier=\"gpu\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("membar_clients{device=\"0\"} 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("membar_clients{device=\"1\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("membar_client_frames{device=\"1\",client=\"2\",name=\"on-one\",pid=\"7\",tier=\"gpu\"} 0\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("membar_space_bytes{device=\"1\",client=\"2\",space=\"L00.k\",state=\"none\"} 0\n"),
            std::string::npos)
      << text;
  // One device: no device label, the text of a daemon from before devices were added.
  std::string single = format_prometheus(std::vector<DeviceRuntimeStats>{{3, one}});
  EXPECT_EQ(single, format_prometheus(one));
  EXPECT_EQ(single.find("device="), std::string::npos) << single;
  EXPECT_NE(single.find("membar_clients 1\n"), std::string::npos) << single;
}

}  // namespace
}  // namespace membar::runtimed
