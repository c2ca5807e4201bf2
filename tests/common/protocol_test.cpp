// Protocol v1 unit tests: round trips of every encoder, rejection of every malformed field,
// segment layout checks and the SPSC ring's index validation.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "membar/client.h"
#include "membar/protocol/ring.h"
#include "membar/protocol/v1.h"
#include "membar/common/wire_socket.h"

namespace membar::protocol::v1 {
namespace {

std::mt19937_64& rng() {
  static std::mt19937_64 generator(std::random_device{}());
  return generator;
}
uint32_t random_u32(uint32_t low, uint32_t high) {
  return std::uniform_int_distribution<uint32_t>(low, high)(rng());
}

template <typename T>
std::span<const uint8_t> bytes_of(const T& value) {
  return {reinterpret_cast<const uint8_t*>(&value), sizeof(T)};
}

// ---------------------------------------------------------------------------------------------
// Socket messages.

TEST(MessageHeader, RoundTripsEveryFixedSizeMessage) {
  HelloV1 hello{};
  hello.gpu_quota_bytes = random_u32(1, 1u << 30);
  copy_text(hello.client_name, sizeof(hello.client_name), "trainer-7");
  std::vector<uint8_t> bytes = encode_message(MessageType::kHello, hello);
  ASSERT_EQ(bytes.size(), sizeof(MessageHeaderV1) + sizeof(HelloV1));
  auto header = decode_message_header(bytes);
  ASSERT_TRUE(header.ok()) << header.status().to_string();
  EXPECT_EQ(header.value().type, static_cast<uint16_t>(MessageType::kHello));
  EXPECT_EQ(header.value().payload_bytes, sizeof(HelloV1));
  auto decoded = decode_hello(std::span<const uint8_t>(bytes).subspan(sizeof(MessageHeaderV1)));
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(decoded.value().gpu_quota_bytes, hello.gpu_quota_bytes);
  EXPECT_STREQ(decoded.value().client_name, "trainer-7");

  FrameNoticeV1 notice{random_u32(0, 1000), static_cast<uint8_t>(Tier::kHost), {}};
  auto grant = encode_message(MessageType::kFrameGrant, notice, 1);
  auto grant_header = decode_message_header(grant);
  ASSERT_TRUE(grant_header.ok());
  EXPECT_EQ(grant_header.value().fd_count, 1u);
  auto decoded_notice = decode_frame_notice(std::span<const uint8_t>(grant).subspan(16));
  ASSERT_TRUE(decoded_notice.ok());
  EXPECT_EQ(decoded_notice.value().window_frame, notice.window_frame);

  PingV1 ping{rng()()};
  auto pong = decode_ping(bytes_of(ping));
  ASSERT_TRUE(pong.ok());
  EXPECT_EQ(pong.value().nonce, ping.nonce);
}

TEST(MessageHeader, RejectsEveryMalformedField) {
  HelloV1 hello{};
  std::vector<uint8_t> good = encode_message(MessageType::kHello, hello);
  ASSERT_TRUE(decode_message_header(good).ok());

  // Truncated at every length below the header.
  for (size_t n = 0; n < sizeof(MessageHeaderV1); ++n) {
    EXPECT_EQ(decode_message_header(std::span<const uint8_t>(good.data(), n)).status().code(),
              StatusCode::INVALID_ARGUMENT);
  }
  auto mutate = [&](size_t offset, uint8_t value) {
    std::vector<uint8_t> bytes = good;
    bytes[offset] = value;
    return decode_message_header(bytes).status();
  };
  EXPECT_EQ(mutate(0, 0).code(), StatusCode::INVALID_ARGUMENT);   // magic
  EXPECT_EQ(mutate(3, 0).code(), StatusCode::INVALID_ARGUMENT);   // magic, last byte
  Status version = mutate(4, 9);
  EXPECT_EQ(version.code(), StatusCode::FAILED_PRECONDITION);     // version
  EXPECT_NE(version.message().find("version 9"), std::string::npos) << version.to_string();
  EXPECT_EQ(mutate(6, 0).code(), StatusCode::INVALID_ARGUMENT);   // type 0
  EXPECT_EQ(mutate(6, kLastMessageType + 1).code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(mutate(8, sizeof(HelloV1) - 1).code(), StatusCode::INVALID_ARGUMENT);  // payload size
  EXPECT_EQ(mutate(11, 1).code(), StatusCode::INVALID_ARGUMENT);  // payload size, high byte
  EXPECT_EQ(mutate(12, 1).code(), StatusCode::INVALID_ARGUMENT);  // fd on a hello
  // A grant without its fd, and a stats reply over the limit.
  FrameNoticeV1 notice{};
  EXPECT_EQ(decode_message_header(encode_message(MessageType::kFrameGrant, notice, 0)).status().code(),
            StatusCode::INVALID_ARGUMENT);
  MessageHeaderV1 huge{kMagic, kVersion, static_cast<uint16_t>(MessageType::kStatsReply),
                       kMaxSocketPayloadBytes + 1, 0};
  EXPECT_EQ(decode_message_header(bytes_of(huge)).status().code(), StatusCode::INVALID_ARGUMENT);
}

TEST(Hello, RejectsBadRoleReservedAndNames) {
  HelloV1 hello{};
  copy_text(hello.client_name, sizeof(hello.client_name), "ok");
  ASSERT_TRUE(decode_hello(bytes_of(hello)).ok());
  HelloV1 bad = hello;
  bad.role = 2;
  EXPECT_FALSE(decode_hello(bytes_of(bad)).ok());
  bad = hello;
  bad.reserved = 1;
  EXPECT_FALSE(decode_hello(bytes_of(bad)).ok());
  bad = hello;
  std::memset(bad.client_name, 'x', sizeof(bad.client_name));
  EXPECT_FALSE(decode_hello(bytes_of(bad)).ok());
  bad = hello;
  bad.client_name[0] = '\n';
  EXPECT_FALSE(decode_hello(bytes_of(bad)).ok());
  EXPECT_FALSE(decode_hello(std::span<const uint8_t>(bytes_of(hello)).first(sizeof(HelloV1) - 1)).ok());
}

TEST(HelloReply, RejectsUnknownStatusBackendAndUnterminatedText) {
  HelloReplyV1 reply{};
  reply.backend = static_cast<uint8_t>(WireBackend::kHost);
  ASSERT_TRUE(decode_hello_reply(bytes_of(reply)).ok());
  HelloReplyV1 bad = reply;
  bad.status = 99;
  EXPECT_FALSE(decode_hello_reply(bytes_of(bad)).ok());
  bad = reply;
  bad.backend = 7;
  EXPECT_FALSE(decode_hello_reply(bytes_of(bad)).ok());
  bad = reply;
  std::memset(bad.message, 'm', sizeof(bad.message));
  EXPECT_FALSE(decode_hello_reply(bytes_of(bad)).ok());
  bad = reply;
  bad.gpu_window_frames = 1u << 30;
  EXPECT_FALSE(decode_hello_reply(bytes_of(bad)).ok());
}

TEST(SmallMessages, RejectBadTierErrorStatusAndText) {
  FrameNoticeV1 notice{3, 2, {}};
  EXPECT_FALSE(decode_frame_notice(bytes_of(notice)).ok());
  notice = {kNoFrame, 0, {}};
  EXPECT_FALSE(decode_frame_notice(bytes_of(notice)).ok());
  ErrorV1 error{};
  EXPECT_FALSE(decode_error(bytes_of(error)).ok());  // status OK is not an error
  error.status = static_cast<int32_t>(StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(decode_error(bytes_of(error)).ok());
  std::memset(error.message, 'e', sizeof(error.message));
  EXPECT_FALSE(decode_error(bytes_of(error)).ok());
  ShutdownV1 shutdown{};
  std::memset(shutdown.reason, 'r', sizeof(shutdown.reason));
  EXPECT_FALSE(decode_shutdown(bytes_of(shutdown)).ok());
}

TEST(Channels, NoticesAndRequestsRejectBadFields) {
  ChannelNoticeV1 notice{4, kChannelWritable, 1 << 20};
  ASSERT_TRUE(decode_channel_notice(bytes_of(notice)).ok());
  auto message = encode_message(MessageType::kChannelGrant, notice, 1);
  auto header = decode_message_header(message);
  ASSERT_TRUE(header.ok()) << header.status().to_string();
  EXPECT_EQ(header.value().fd_count, 1u);
  EXPECT_FALSE(decode_message_header(encode_message(MessageType::kChannelGrant, notice, 0)).ok())
      << "a channel grant without its descriptor is malformed";
  for (ChannelNoticeV1 bad : {ChannelNoticeV1{4, 2, 1 << 20}, ChannelNoticeV1{0, 0, 1 << 20}, ChannelNoticeV1{4, 0, 0},
                              ChannelNoticeV1{4, 0, 1ull << 40}}) {
    EXPECT_FALSE(decode_channel_notice(bytes_of(bad)).ok()) << bad.channel << " " << bad.flags << " " << bad.bytes;
  }
  RequestV1 create{};
  create.opcode = static_cast<uint16_t>(Opcode::kCreateChannel);
  create.payload_bytes = 4;
  EXPECT_FALSE(validate_request(create, 4096).ok()) << "size 0";
  create.argument = 1ull << 40;
  EXPECT_FALSE(validate_request(create, 4096).ok()) << "over 64 GiB";
  create.argument = 4096;
  create.payload_bytes = 0;
  EXPECT_FALSE(validate_request(create, 4096).ok()) << "no name";
  create.payload_bytes = 64;
  EXPECT_FALSE(validate_request(create, 4096).ok()) << "name too long";
  RequestV1 open{};
  open.opcode = static_cast<uint16_t>(Opcode::kOpenChannel);
  open.payload_bytes = 3;
  open.argument = 5;
  EXPECT_FALSE(validate_request(open, 4096).ok()) << "open takes no argument";
  RequestV1 close{};
  close.opcode = static_cast<uint16_t>(Opcode::kCloseChannel);
  EXPECT_FALSE(validate_request(close, 4096).ok()) << "channel 0";
  close.argument = 1ull << 33;
  EXPECT_FALSE(validate_request(close, 4096).ok()) << "id beyond 32 bits";
}

TEST(Text, CopyTruncatesAndTerminates) {
  char field[8];
  copy_text(field, sizeof(field), "abcdefghijkl");
  EXPECT_STREQ(field, "abcdefg");
  auto read = read_text(field, sizeof(field));
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read.value(), "abcdefg");
  std::memset(field, 'z', sizeof(field));
  EXPECT_FALSE(read_text(field, sizeof(field)).ok());
}

// ---------------------------------------------------------------------------------------------
// Ring requests.

RequestV1 valid_acquire() {
  RequestV1 request{};
  request.opcode = static_cast<uint16_t>(Opcode::kAcquire);
  request.space = 1;
  request.first_page = random_u32(0, 1000);
  request.page_count = random_u32(1, 64);
  request.flags = kAcquireWrite;
  return request;
}

TEST(Request, AcceptsValidRequestsOfEveryOpcode) {
  for (uint16_t op = kFirstOpcode; op <= kLastOpcode; ++op) {
    RequestV1 request{};
    request.opcode = op;
    switch (static_cast<Opcode>(op)) {
      case Opcode::kCreateSpace:
        request.argument = 64 << 10;
        request.page_count = 4;
        request.payload_bytes = 5;
        break;
      case Opcode::kSetSchedule:
        request.payload_bytes = 4;
        break;
      case Opcode::kAdvance:
        request.argument = 7;
        break;
      case Opcode::kNop: case Opcode::kDestroySpace: case Opcode::kStats:
        break;
      case Opcode::kCreateChannel:
        request.argument = 1 << 20;
        request.payload_bytes = 4;
        break;
      case Opcode::kOpenChannel:
        request.payload_bytes = 4;
        break;
      case Opcode::kCloseChannel:
        request.argument = 3;
        break;
      default:
        request.page_count = 1;
    }
    EXPECT_TRUE(validate_request(request, 4096).ok()) << opcode_name(op) << ": "
                                                      << validate_request(request, 4096).to_string();
  }
}

TEST(Request, RejectsEveryMalformedField) {
  ASSERT_TRUE(validate_request(valid_acquire(), 4096).ok());
  auto expect_code = [](const RequestV1& request, StatusCode code, const char* what) {
    Status status = validate_request(request, 4096);
    EXPECT_EQ(status.code(), code) << what << ": " << status.to_string();
    EXPECT_FALSE(status.message().empty()) << what;
  };
  RequestV1 r = valid_acquire();
  r.opcode = 0;
  expect_code(r, StatusCode::INVALID_ARGUMENT, "opcode 0");
  r.opcode = kLastOpcode + 1;
  expect_code(r, StatusCode::INVALID_ARGUMENT, "opcode past the end");
  r = valid_acquire();
  r.reserved0 = 1;
  expect_code(r, StatusCode::INVALID_ARGUMENT, "reserved0");
  for (size_t i = 0; i < sizeof(r.reserved1); ++i) {
    r = valid_acquire();
    r.reserved1[i] = 0x80;
    expect_code(r, StatusCode::INVALID_ARGUMENT, "reserved1");
  }
  r = valid_acquire();
  r.flags = 1u << 5;
  expect_code(r, StatusCode::INVALID_ARGUMENT, "unknown acquire flag");
  r = valid_acquire();
  r.opcode = static_cast<uint16_t>(Opcode::kPrefetch);
  r.flags = 0;
  r.payload_bytes = 8;
  expect_code(r, StatusCode::INVALID_ARGUMENT, "payload on an op without one");
  r = valid_acquire();
  r.page_count = 0;
  expect_code(r, StatusCode::INVALID_ARGUMENT, "empty range");
  r = valid_acquire();
  r.first_page = 0xffffff00u;
  r.page_count = 0x1000;
  expect_code(r, StatusCode::OUT_OF_RANGE, "range overflows");
  r = valid_acquire();
  r.argument = 1;
  expect_code(r, StatusCode::INVALID_ARGUMENT, "argument on a range op");

  RequestV1 release{};
  release.opcode = static_cast<uint16_t>(Opcode::kRelease);
  release.page_count = 1;
  release.flags = kReleaseDirty;
  EXPECT_TRUE(validate_request(release, 4096).ok());
  release.flags = kAcquireZeroNew;
  expect_code(release, StatusCode::INVALID_ARGUMENT, "acquire flag on release");

  RequestV1 create{};
  create.opcode = static_cast<uint16_t>(Opcode::kCreateSpace);
  create.argument = 64 << 10;
  create.page_count = 4;
  create.payload_bytes = 4;
  ASSERT_TRUE(validate_request(create, 4096).ok());
  RequestV1 c = create;
  c.argument = 96 << 10;
  expect_code(c, StatusCode::INVALID_ARGUMENT, "page size not a power of two");
  c.argument = 32 << 10;
  expect_code(c, StatusCode::INVALID_ARGUMENT, "page size below 64 KiB");
  c.argument = 4 << 20;
  expect_code(c, StatusCode::INVALID_ARGUMENT, "page size above 2 MiB");
  c = create;
  c.page_count = 0;
  expect_code(c, StatusCode::INVALID_ARGUMENT, "no pages");
  c = create;
  c.payload_bytes = 0;
  expect_code(c, StatusCode::INVALID_ARGUMENT, "no name");
  c.payload_bytes = kMaxSpaceNameBytes + 1;
  expect_code(c, StatusCode::INVALID_ARGUMENT, "name too long");
  c.payload_bytes = 5000;
  expect_code(c, StatusCode::INVALID_ARGUMENT, "payload beyond the area");

  RequestV1 advance{};
  advance.opcode = static_cast<uint16_t>(Opcode::kAdvance);
  advance.argument = 1ull << 32;
  expect_code(advance, StatusCode::OUT_OF_RANGE, "step beyond 32 bits");
  RequestV1 schedule{};
  schedule.opcode = static_cast<uint16_t>(Opcode::kSetSchedule);
  schedule.payload_bytes = 3;
  expect_code(schedule, StatusCode::INVALID_ARGUMENT, "schedule shorter than its count");
  RequestV1 nop{};
  nop.opcode = static_cast<uint16_t>(Opcode::kNop);
  nop.argument = 5;
  expect_code(nop, StatusCode::INVALID_ARGUMENT, "argument on nop");
  nop.argument = 0;
  nop.page_count = 3;
  expect_code(nop, StatusCode::INVALID_ARGUMENT, "page range on nop");
  nop.page_count = 0;
  nop.space = 2;
  expect_code(nop, StatusCode::INVALID_ARGUMENT, "space on nop");
  c = create;
  c.first_page = 1;
  expect_code(c, StatusCode::INVALID_ARGUMENT, "first page on create_space");
}

TEST(Completion, RejectsUnknownStatusAndOversizedPayload) {
  CompletionV1 completion{};
  EXPECT_TRUE(validate_completion(completion, 4096).ok());
  completion.status = 77;
  EXPECT_FALSE(validate_completion(completion, 4096).ok());
  completion.status = 0;
  completion.payload_bytes = 4097;
  EXPECT_FALSE(validate_completion(completion, 4096).ok());
}

TEST(SpaceName, AcceptsPrintableAndRejectsTheRest) {
  EXPECT_TRUE(validate_space_name("L07.dk").ok());
  EXPECT_FALSE(validate_space_name("").ok());
  EXPECT_FALSE(validate_space_name(std::string(kMaxSpaceNameBytes + 1, 'a')).ok());
  EXPECT_FALSE(validate_space_name("has space").ok());
  EXPECT_FALSE(validate_space_name(std::string("nul\0", 4)).ok());
  EXPECT_FALSE(validate_space_name("\x80").ok());
}

// ---------------------------------------------------------------------------------------------
// Payloads.

TEST(Schedule, RoundTripsRandomSchedules) {
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<ScheduleStep> steps(random_u32(0, 20));
    for (ScheduleStep& step : steps) {
      step.ranges.resize(random_u32(0, 5));
      for (PageRange& range : step.ranges) range = {random_u32(1, 9), random_u32(0, 5000), random_u32(1, 300)};
    }
    std::vector<uint8_t> bytes = encode_schedule(steps);
    auto decoded = decode_schedule(bytes);
    ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
    ASSERT_EQ(decoded.value().size(), steps.size());
    for (size_t s = 0; s < steps.size(); ++s) {
      ASSERT_EQ(decoded.value()[s].ranges.size(), steps[s].ranges.size());
      for (size_t r = 0; r < steps[s].ranges.size(); ++r) {
        EXPECT_EQ(decoded.value()[s].ranges[r].space, steps[s].ranges[r].space);
        EXPECT_EQ(decoded.value()[s].ranges[r].first_page, steps[s].ranges[r].first_page);
        EXPECT_EQ(decoded.value()[s].ranges[r].page_count, steps[s].ranges[r].page_count);
      }
    }
    // Every truncation of a non-empty encoding is rejected, as is a trailing byte.
    for (size_t n = 0; n < bytes.size(); ++n) {
      EXPECT_FALSE(decode_schedule(std::span<const uint8_t>(bytes.data(), n)).ok()) << "length " << n;
    }
    bytes.push_back(0);
    EXPECT_FALSE(decode_schedule(bytes).ok());
  }
}

TEST(Schedule, RejectsHugeCountsEmptyRangesAndOverflow) {
  std::vector<uint8_t> huge_steps = {0xff, 0xff, 0xff, 0xff};
  EXPECT_FALSE(decode_schedule(huge_steps).ok());
  std::vector<ScheduleStep> steps(1);
  steps[0].ranges = {{1, 0, 0}};
  EXPECT_FALSE(decode_schedule(encode_schedule(steps)).ok());
  steps[0].ranges = {{1, 0xfffffff0u, 0x20}};
  EXPECT_EQ(decode_schedule(encode_schedule(steps)).status().code(), StatusCode::OUT_OF_RANGE);
  std::vector<uint8_t> huge_ranges = {1, 0, 0, 0, 0xff, 0xff, 0xff, 0x0f};
  EXPECT_FALSE(decode_schedule(huge_ranges).ok());
}

TEST(Locations, RoundTripAndRejectWrongCounts) {
  std::vector<PageLocation> locations(random_u32(1, 100));
  for (PageLocation& location : locations) location = {random_u32(0, 500), random_u32(0, 31)};
  std::vector<uint8_t> bytes = encode_locations(locations);
  auto decoded = decode_locations(bytes, static_cast<uint32_t>(locations.size()));
  ASSERT_TRUE(decoded.ok());
  for (size_t i = 0; i < locations.size(); ++i) {
    EXPECT_EQ(decoded.value()[i].window_frame, locations[i].window_frame);
    EXPECT_EQ(decoded.value()[i].slot, locations[i].slot);
  }
  EXPECT_FALSE(decode_locations(bytes, static_cast<uint32_t>(locations.size()) + 1).ok());
  EXPECT_FALSE(decode_locations(std::span<const uint8_t>(bytes).first(bytes.size() - 1),
                                static_cast<uint32_t>(locations.size())).ok());
  bytes.push_back(1);
  EXPECT_FALSE(decode_locations(bytes, static_cast<uint32_t>(locations.size())).ok());
}

RuntimeStats random_stats() {
  RuntimeStats stats;
  stats.backend = "host";
  stats.tiers = {{Tier::kGpu, random_u32(1, 100), random_u32(0, 50), random_u32(0, 50)},
                 {Tier::kHost, random_u32(1, 100), random_u32(0, 50), random_u32(0, 50)}};
  for (uint32_t c = 0; c < random_u32(0, 5); ++c) {
    ClientStats client;
    client.client = c + 1;
    client.pid = static_cast<int32_t>(random_u32(1, 100000));
    client.name = "client-" + std::to_string(c);
    client.gpu_quota_bytes = rng()();
    stat_increase(client.gpu_frames, random_u32(1, 10));
    stat_decrease(client.gpu_frames, 1);
    client.pages_both = random_u32(0, 1000);
    client.bytes_host_to_gpu = rng()();
    client.stall_ns = rng()();
    stats.clients.push_back(client);
  }
  for (uint32_t s = 0; s < random_u32(0, 5); ++s) {
    SpaceInfo space{s + 1, "L" + std::to_string(s) + ".k", 64ull << 10, random_u32(1, 1000)};
    space.client = random_u32(1, 9);
    space.pages_host = random_u32(0, 1000);
    space.pages_dirty = random_u32(0, 1000);
    space.pages_pinned = random_u32(0, 1000);
    stats.spaces.push_back(space);
  }
  return stats;
}

TEST(Stats, RoundTripsAndRejectsEveryTruncation) {
  for (int trial = 0; trial < 20; ++trial) {
    RuntimeStats stats = random_stats();
    std::vector<uint8_t> bytes = encode_stats(stats);
    auto decoded = decode_stats(bytes);
    ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
    EXPECT_EQ(decoded.value().backend, stats.backend);
    ASSERT_EQ(decoded.value().tiers.size(), 2u);
    EXPECT_EQ(decoded.value().tiers[1].frames_total, stats.tiers[1].frames_total);
    ASSERT_EQ(decoded.value().clients.size(), stats.clients.size());
    for (size_t c = 0; c < stats.clients.size(); ++c) {
      EXPECT_EQ(decoded.value().clients[c].name, stats.clients[c].name);
      EXPECT_EQ(decoded.value().clients[c].gpu_frames.peak, stats.clients[c].gpu_frames.peak);
      EXPECT_EQ(decoded.value().clients[c].gpu_frames.freed, stats.clients[c].gpu_frames.freed);
      EXPECT_EQ(decoded.value().clients[c].stall_ns, stats.clients[c].stall_ns);
      EXPECT_EQ(decoded.value().clients[c].bytes_host_to_gpu, stats.clients[c].bytes_host_to_gpu);
    }
    ASSERT_EQ(decoded.value().spaces.size(), stats.spaces.size());
    for (size_t s = 0; s < stats.spaces.size(); ++s) {
      EXPECT_EQ(decoded.value().spaces[s].name, stats.spaces[s].name);
      EXPECT_EQ(decoded.value().spaces[s].client, stats.spaces[s].client);
      EXPECT_EQ(decoded.value().spaces[s].pages_host, stats.spaces[s].pages_host);
      EXPECT_EQ(decoded.value().spaces[s].pages_dirty, stats.spaces[s].pages_dirty);
      EXPECT_EQ(decoded.value().spaces[s].pages_pinned, stats.spaces[s].pages_pinned);
    }
    // A payload that ends where the per-space residency records begin is an older daemon's: it
    // decodes (records zero). Every other truncation is refused.
    size_t without_records = bytes.size() - (4 + stats.spaces.size() * (4 + 6 * 8));
    auto older = decode_stats(std::span<const uint8_t>(bytes.data(), without_records));
    ASSERT_TRUE(older.ok()) << older.status().to_string();
    for (const SpaceInfo& space : older.value().spaces) EXPECT_EQ(space.pages_host, 0u);
    for (size_t n = 0; n < bytes.size(); ++n) {
      if (n == without_records) continue;
      EXPECT_FALSE(decode_stats(std::span<const uint8_t>(bytes.data(), n)).ok()) << "length " << n;
    }
  }
}

TEST(Stats, RejectsUnknownTierAndHugeCounts) {
  RuntimeStats stats = random_stats();
  std::vector<uint8_t> bytes = encode_stats(stats);
  std::vector<uint8_t> bad_tier = bytes;
  bad_tier[4 + stats.backend.size() + 4] = 5;  // first tier's number
  EXPECT_FALSE(decode_stats(bad_tier).ok());
  std::vector<uint8_t> huge_tiers = bytes;
  std::memset(huge_tiers.data() + 4 + stats.backend.size(), 0xff, 4);
  EXPECT_FALSE(decode_stats(huge_tiers).ok());
  std::vector<uint8_t> huge_string = bytes;
  std::memset(huge_string.data(), 0xff, 4);
  EXPECT_FALSE(decode_stats(huge_string).ok());
}

// ---------------------------------------------------------------------------------------------
// Segment layout and rings.

TEST(Segment, LayoutRoundTripsAndRejectsTampering) {
  auto layout = make_segment_layout(64, 1 << 20, 4 << 20);
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout.value().request_ring_offset % 64, 0u);
  EXPECT_EQ(layout.value().completion_ring_offset % 64, 0u);
  EXPECT_EQ(layout.value().request_payload_offset % 4096, 0u);
  EXPECT_GE(layout.value().response_payload_offset,
            layout.value().request_payload_offset + layout.value().request_payload_bytes);
  std::vector<uint8_t> segment(layout.value().segment_bytes);
  write_segment_header(segment.data(), layout.value());
  auto read = read_segment_header(segment.data(), segment.size());
  ASSERT_TRUE(read.ok()) << read.status().to_string();
  EXPECT_EQ(read.value().segment_bytes, layout.value().segment_bytes);
  EXPECT_FALSE(read_segment_header(segment.data(), segment.size() - 1).ok());
  EXPECT_FALSE(read_segment_header(segment.data(), 100).ok());
  auto* header = reinterpret_cast<SegmentHeaderV1*>(segment.data());
  header->completion_ring_offset += 64;
  EXPECT_FALSE(read_segment_header(segment.data(), segment.size()).ok());
  header->completion_ring_offset -= 64;
  header->version = 2;
  EXPECT_EQ(read_segment_header(segment.data(), segment.size()).status().code(), StatusCode::FAILED_PRECONDITION);

  EXPECT_FALSE(make_segment_layout(3, 1 << 20, 1 << 20).ok());
  EXPECT_FALSE(make_segment_layout(1, 1 << 20, 1 << 20).ok());
  EXPECT_FALSE(make_segment_layout(1 << 17, 1 << 20, 1 << 20).ok());
  EXPECT_FALSE(make_segment_layout(64, 100, 1 << 20).ok());
  EXPECT_FALSE(make_segment_layout(64, 1 << 20, 1ull << 40).ok());
}

TEST(Ring, PassesEntriesInOrderAcrossThreadsAndWraps) {
  constexpr uint32_t kCapacity = 8;
  std::vector<uint8_t> memory(sizeof(RingControlV1) + kCapacity * sizeof(RequestV1));
  RingEnd<RequestV1> producer(memory.data(), kCapacity);
  RingEnd<RequestV1> consumer(memory.data(), kCapacity);
  constexpr uint64_t kCount = 20000;
  std::thread thread([&] {
    for (uint64_t i = 1; i <= kCount; ++i) {
      RequestV1 request{};
      request.sequence = i;
      request.argument = i * 3;
      while (!producer.try_push(request)) std::this_thread::yield();
    }
  });
  uint64_t expected = 1;
  uint32_t idle = 0;
  while (expected <= kCount) {
    RequestV1 request;
    int popped = consumer.try_pop(request);
    ASSERT_GE(popped, 0);
    if (popped == 0) {
      // Spin a little, then sleep on the doorbell (the producer's push wakes it).
      if (++idle > 200) consumer.wait_for_entries(1'000'000);
      continue;
    }
    idle = 0;
    ASSERT_EQ(request.sequence, expected);
    ASSERT_EQ(request.argument, expected * 3);
    ++expected;
  }
  thread.join();
}

TEST(Ring, RejectsAnImpossibleHeadAndAFullRing) {
  constexpr uint32_t kCapacity = 4;
  std::vector<uint8_t> memory(sizeof(RingControlV1) + kCapacity * sizeof(CompletionV1));
  RingEnd<CompletionV1> producer(memory.data(), kCapacity);
  RingEnd<CompletionV1> consumer(memory.data(), kCapacity);
  CompletionV1 entry{};
  for (uint32_t i = 0; i < kCapacity; ++i) EXPECT_TRUE(producer.try_push(entry));
  EXPECT_FALSE(producer.try_push(entry)) << "a full ring refuses";
  auto* control = reinterpret_cast<RingControlV1*>(memory.data());
  control->head = 1000;  // a producer lying about its head
  EXPECT_EQ(consumer.try_pop(entry), -1);
  // A consumer lying about its tail (beyond the head) cannot make the producer overwrite.
  RingEnd<CompletionV1> fresh_producer(memory.data(), kCapacity);
  control->tail = 1ull << 50;
  EXPECT_FALSE(fresh_producer.try_push(entry));
}

// ---------------------------------------------------------------------------------------------
// Socket framing.

TEST(Assembler, SplitsAStreamFedByteByByteAndPairsFds) {
  HelloV1 hello{};
  FrameNoticeV1 notice{5, 0, {}};
  std::vector<uint8_t> stream = encode_message(MessageType::kHello, hello);
  std::vector<uint8_t> grant = encode_message(MessageType::kFrameGrant, notice, 1);
  stream.insert(stream.end(), grant.begin(), grant.end());
  wire::MessageAssembler assembler;
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  ::close(pipe_fds[1]);
  assembler.append_fd(pipe_fds[0]);
  std::vector<uint16_t> types;
  for (uint8_t byte : stream) {
    assembler.append(std::span<const uint8_t>(&byte, 1));
    auto next = assembler.next();
    ASSERT_TRUE(next.ok());
    if (next.value().has_value()) {
      types.push_back(next.value()->header.type);
      if (next.value()->header.type == static_cast<uint16_t>(MessageType::kFrameGrant)) {
        EXPECT_EQ(next.value()->fd.get(), pipe_fds[0]);
      }
    }
  }
  EXPECT_EQ(types, (std::vector<uint16_t>{1, 4}));
  EXPECT_EQ(assembler.pending_bytes(), 0u);
}

TEST(Assembler, ReportsAMissingFdAndGarbage) {
  FrameNoticeV1 notice{5, 0, {}};
  wire::MessageAssembler missing_fd;
  auto grant = encode_message(MessageType::kFrameGrant, notice, 1);
  missing_fd.append(grant);
  EXPECT_FALSE(missing_fd.next().ok());
  wire::MessageAssembler garbage;
  std::vector<uint8_t> noise(64, 0xab);
  garbage.append(noise);
  EXPECT_FALSE(garbage.next().ok());
}

}  // namespace
}  // namespace membar::protocol::v1
