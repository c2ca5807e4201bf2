// Protocol v2 unit tests: round trips of every encoder, rejection of every malformed field (the
// opcode table's rules, Note [One opcode table]), event sequence numbers, paged stats, segment
// layout checks and the SPSC ring's index validation.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <random>
#include <vector>

#include "membar/client.h"
#include "membar/protocol/ring.h"
#include "membar/protocol/v2.h"
#include "membar/common/wire_socket.h"

namespace membar::protocol::v2 {
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
  HelloV2 hello{};
  hello.gpu_quota_bytes = random_u32(1, 1u << 30);
  copy_text(hello.client_name, sizeof(hello.client_name), "trainer-7");
  std::vector<uint8_t> bytes = encode_message(MessageType::kHello, hello);
  ASSERT_EQ(bytes.size(), sizeof(MessageHeaderV2) + sizeof(HelloV2));
  auto header = decode_message_header(bytes);
  ASSERT_TRUE(header.ok()) << header.status().to_string();
  EXPECT_EQ(header.value().type, static_cast<uint16_t>(MessageType::kHello));
  EXPECT_EQ(header.value().payload_bytes, sizeof(HelloV2));
  auto decoded = decode_hello(std::span<const uint8_t>(bytes).subspan(sizeof(MessageHeaderV2)));
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(decoded.value().gpu_quota_bytes, hello.gpu_quota_bytes);
  EXPECT_STREQ(decoded.value().client_name, "trainer-7");

  FrameGrantV2 grant{7, random_u32(0, 1000), 0};
  auto grant_message = encode_message(MessageType::kFrameGrant, grant, 1);
  auto grant_header = decode_message_header(grant_message);
  ASSERT_TRUE(grant_header.ok());
  EXPECT_EQ(grant_header.value().fd_count, 1u);
  auto decoded_grant = decode_frame_grant(std::span<const uint8_t>(grant_message).subspan(16));
  ASSERT_TRUE(decoded_grant.ok());
  EXPECT_EQ(decoded_grant.value().window_frame, grant.window_frame);
  EXPECT_EQ(event_sequence(MessageType::kFrameGrant, bytes_of(grant)), 7u);

  FrameEventV2 revoke{8, random_u32(0, 1000), static_cast<uint8_t>(Tier::kGpu), {}};
  ASSERT_TRUE(decode_frame_event(bytes_of(revoke)).ok());
  SlabGrantV2 slab{9, 3, 4, 4 * kFrameBytes};
  ASSERT_TRUE(decode_slab_grant(bytes_of(slab)).ok());
  EXPECT_EQ(decode_message_header(encode_message(MessageType::kSlabGrant, slab, 1)).value().fd_count, 1u);
  SlabEventV2 slab_revoke{10, 3, 0};
  ASSERT_TRUE(decode_slab_event(bytes_of(slab_revoke)).ok());
  FrameMapV2 map{11, 2, static_cast<uint8_t>(Tier::kHost), {}, 5, random_u32(0, 1u << 20)};
  auto decoded_map = decode_frame_map(bytes_of(map));
  ASSERT_TRUE(decoded_map.ok());
  EXPECT_EQ(decoded_map.value().space_frame, map.space_frame);
  EXPECT_EQ(event_sequence(MessageType::kFrameUnmap, bytes_of(map)), 11u);
  EXPECT_EQ(event_sequence(MessageType::kPong, bytes_of(map)), 0u) << "only events carry a sequence number";
  StatsRequestV2 request{4096, 100};
  ASSERT_TRUE(decode_stats_request(bytes_of(request)).ok());

  PingV2 ping{rng()()};
  auto pong = decode_ping(bytes_of(ping));
  ASSERT_TRUE(pong.ok());
  EXPECT_EQ(pong.value().nonce, ping.nonce);
}

TEST(MessageHeader, RejectsEveryMalformedField) {
  HelloV2 hello{};
  std::vector<uint8_t> good = encode_message(MessageType::kHello, hello);
  ASSERT_TRUE(decode_message_header(good).ok());

  // Truncated at every length below the header.
  for (size_t n = 0; n < sizeof(MessageHeaderV2); ++n) {
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
  EXPECT_NE(mutate(4, 1).message().find("version 1"), std::string::npos) << "a protocol v1 peer is named";
  EXPECT_EQ(mutate(6, 0).code(), StatusCode::INVALID_ARGUMENT);   // type 0
  EXPECT_EQ(mutate(6, kLastMessageType + 1).code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(mutate(8, sizeof(HelloV2) - 1).code(), StatusCode::INVALID_ARGUMENT);  // payload size
  EXPECT_EQ(mutate(11, 1).code(), StatusCode::INVALID_ARGUMENT);  // payload size, high byte
  EXPECT_EQ(mutate(12, 1).code(), StatusCode::INVALID_ARGUMENT);  // fd on a hello
  // Grants without their fd, a map with one, a hello reply with three, and a stats reply over the
  // limit.
  FrameGrantV2 grant{1, 0, 0};
  EXPECT_EQ(decode_message_header(encode_message(MessageType::kFrameGrant, grant, 0)).status().code(),
            StatusCode::INVALID_ARGUMENT);
  SlabGrantV2 slab{1, 0, 1, kFrameBytes};
  EXPECT_EQ(decode_message_header(encode_message(MessageType::kSlabGrant, slab, 0)).status().code(),
            StatusCode::INVALID_ARGUMENT);
  FrameMapV2 map{1, 0, 0, {}, 1, 0};
  EXPECT_EQ(decode_message_header(encode_message(MessageType::kFrameMap, map, 1)).status().code(),
            StatusCode::INVALID_ARGUMENT);
  HelloReplyV2 reply{};
  EXPECT_EQ(decode_message_header(encode_message(MessageType::kHelloReply, reply, 3)).status().code(),
            StatusCode::INVALID_ARGUMENT);
  MessageHeaderV2 huge{kMagic, kVersion, static_cast<uint16_t>(MessageType::kStatsReply),
                       kMaxSocketPayloadBytes + 1, 0};
  EXPECT_EQ(decode_message_header(bytes_of(huge)).status().code(), StatusCode::INVALID_ARGUMENT);
}

TEST(Hello, RejectsBadRoleDeviceAndNames) {
  HelloV2 hello{};
  copy_text(hello.client_name, sizeof(hello.client_name), "ok");
  ASSERT_TRUE(decode_hello(bytes_of(hello)).ok());
  HelloV2 bad = hello;
  bad.role = 2;
  EXPECT_FALSE(decode_hello(bytes_of(bad)).ok());
  // Devices 0..31 (device_plus_one 1..32) are names the daemon then checks; past that, malformed.
  HelloV2 device = hello;
  device.device_plus_one = kMaxDevices;
  EXPECT_TRUE(decode_hello(bytes_of(device)).ok());
  bad = hello;
  bad.device_plus_one = kMaxDevices + 1;
  EXPECT_EQ(decode_hello(bytes_of(bad)).status().code(), StatusCode::INVALID_ARGUMENT);
  bad = hello;
  std::memset(bad.client_name, 'x', sizeof(bad.client_name));
  EXPECT_FALSE(decode_hello(bytes_of(bad)).ok());
  bad = hello;
  bad.client_name[0] = '\n';
  EXPECT_FALSE(decode_hello(bytes_of(bad)).ok());
  EXPECT_FALSE(decode_hello(std::span<const uint8_t>(bytes_of(hello)).first(sizeof(HelloV2) - 1)).ok());
}

TEST(HelloReply, RejectsUnknownStatusBackendSlabsAndUnterminatedText) {
  HelloReplyV2 reply{};
  reply.backend = static_cast<uint8_t>(WireBackend::kHost);
  reply.host_slab_frames = 4;
  ASSERT_TRUE(decode_hello_reply(bytes_of(reply)).ok());
  HelloReplyV2 bad = reply;
  bad.status = 99;
  EXPECT_FALSE(decode_hello_reply(bytes_of(bad)).ok());
  bad = reply;
  bad.backend = 7;
  EXPECT_FALSE(decode_hello_reply(bytes_of(bad)).ok());
  bad = reply;
  std::memset(bad.message, 'm', sizeof(bad.message));
  EXPECT_FALSE(decode_hello_reply(bytes_of(bad)).ok());
  bad = reply;
  bad.gpu_quota_frames = 1u << 30;
  EXPECT_FALSE(decode_hello_reply(bytes_of(bad)).ok());
  bad = reply;
  bad.host_slab_frames = 0;
  EXPECT_FALSE(decode_hello_reply(bytes_of(bad)).ok());
  bad.host_slab_frames = (1u << 16) + 1;
  EXPECT_FALSE(decode_hello_reply(bytes_of(bad)).ok());
  // A refusal needs no geometry, only its sentence.
  HelloReplyV2 refusal{};
  refusal.status = static_cast<int32_t>(StatusCode::PERMISSION_DENIED);
  copy_text(refusal.message, sizeof(refusal.message), "uid not allowed");
  EXPECT_TRUE(decode_hello_reply(bytes_of(refusal)).ok());
}

TEST(Events, RejectSequenceZeroBadTiersAndImpossibleFrames) {
  EXPECT_FALSE(decode_frame_grant(bytes_of(FrameGrantV2{0, 1, 0})).ok()) << "sequence 0";
  EXPECT_FALSE(decode_frame_grant(bytes_of(FrameGrantV2{1, kNoFrame, 0})).ok());
  EXPECT_FALSE(decode_frame_grant(bytes_of(FrameGrantV2{1, 1, 1})).ok()) << "reserved";
  EXPECT_FALSE(decode_frame_event(bytes_of(FrameEventV2{1, 3, 2, {}})).ok()) << "tier 2";
  EXPECT_FALSE(decode_frame_event(bytes_of(FrameEventV2{0, 3, 0, {}})).ok());
  EXPECT_FALSE(decode_frame_event(bytes_of(FrameEventV2{1, kNoFrame, 0, {}})).ok());
  EXPECT_FALSE(decode_slab_grant(bytes_of(SlabGrantV2{1, 0, 0, 0})).ok()) << "no frames";
  EXPECT_FALSE(decode_slab_grant(bytes_of(SlabGrantV2{1, 0, 2, kFrameBytes})).ok()) << "bytes disagree";
  EXPECT_FALSE(decode_slab_grant(bytes_of(SlabGrantV2{1, 0, (1u << 16) + 1, ((1u << 16) + 1) * kFrameBytes})).ok());
  EXPECT_FALSE(decode_slab_event(bytes_of(SlabEventV2{0, 1, 0})).ok());
  EXPECT_FALSE(decode_frame_map(bytes_of(FrameMapV2{1, 1, 3, {}, 1, 0})).ok()) << "tier 3";
  EXPECT_FALSE(decode_frame_map(bytes_of(FrameMapV2{1, 1, 0, {}, 0, 0})).ok()) << "space 0";
  EXPECT_FALSE(decode_frame_map(bytes_of(FrameMapV2{1, 1, 0, {}, 1, uint32_t(kMaxSpaceBytes / kFrameBytes)})).ok())
      << "past any space";
  EXPECT_FALSE(decode_frame_map(bytes_of(FrameMapV2{0, 1, 0, {}, 1, 0})).ok());
  ErrorV2 error{};
  EXPECT_FALSE(decode_error(bytes_of(error)).ok());  // status OK is not an error
  error.status = static_cast<int32_t>(StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(decode_error(bytes_of(error)).ok());
  std::memset(error.message, 'e', sizeof(error.message));
  EXPECT_FALSE(decode_error(bytes_of(error)).ok());
  ShutdownV2 shutdown{};
  std::memset(shutdown.reason, 'r', sizeof(shutdown.reason));
  EXPECT_FALSE(decode_shutdown(bytes_of(shutdown)).ok());
  EXPECT_FALSE(decode_stats_request(bytes_of(StatsRequestV2{0, 0})).ok()) << "no spaces asked for";
  EXPECT_FALSE(decode_stats_request(bytes_of(StatsRequestV2{0, kMaxStatsSpaces + 1})).ok());
}

TEST(Channels, NoticesAndRequestsRejectBadFields) {
  ChannelNoticeV2 notice{1, 4, kChannelWritable, 1 << 20};
  ASSERT_TRUE(decode_channel_notice(bytes_of(notice)).ok());
  auto message = encode_message(MessageType::kChannelGrant, notice, 1);
  auto header = decode_message_header(message);
  ASSERT_TRUE(header.ok()) << header.status().to_string();
  EXPECT_EQ(header.value().fd_count, 1u);
  EXPECT_FALSE(decode_message_header(encode_message(MessageType::kChannelGrant, notice, 0)).ok())
      << "a channel grant without its descriptor is malformed";
  for (ChannelNoticeV2 bad : {ChannelNoticeV2{1, 4, 2, 1 << 20}, ChannelNoticeV2{1, 0, 0, 1 << 20},
                              ChannelNoticeV2{1, 4, 0, 0}, ChannelNoticeV2{1, 4, 0, 1ull << 40},
                              ChannelNoticeV2{0, 4, 0, 1 << 20}}) {
    EXPECT_FALSE(decode_channel_notice(bytes_of(bad)).ok()) << bad.channel << " " << bad.flags << " " << bad.bytes;
  }
  RequestV2 create{};
  create.opcode = static_cast<uint16_t>(Opcode::kCreateChannel);
  create.payload_bytes = 4;
  EXPECT_FALSE(validate_request(create, 4096).ok()) << "size 0";
  create.argument = 1ull << 40;
  EXPECT_FALSE(validate_request(create, 4096).ok()) << "over 64 GiB";
  create.argument = 4096;
  EXPECT_TRUE(validate_request(create, 4096).ok());
  create.payload_bytes = 0;
  EXPECT_FALSE(validate_request(create, 4096).ok()) << "no name";
  create.payload_bytes = 64;
  EXPECT_FALSE(validate_request(create, 4096).ok()) << "name too long";
  RequestV2 open{};
  open.opcode = static_cast<uint16_t>(Opcode::kOpenChannel);
  open.payload_bytes = 3;
  open.argument = 5;
  EXPECT_FALSE(validate_request(open, 4096).ok()) << "open takes no argument";
  for (Opcode op : {Opcode::kCloseChannel, Opcode::kPublishChannel}) {
    RequestV2 request{};
    request.opcode = static_cast<uint16_t>(op);
    EXPECT_FALSE(validate_request(request, 4096).ok()) << "channel 0";
    request.argument = 1ull << 33;
    EXPECT_FALSE(validate_request(request, 4096).ok()) << "id beyond 32 bits";
    request.argument = 3;
    EXPECT_TRUE(validate_request(request, 4096).ok());
  }
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

RequestV2 valid_acquire() {
  RequestV2 request{};
  request.opcode = static_cast<uint16_t>(Opcode::kAcquire);
  request.space = 1;
  request.first_page = random_u32(0, 1000);
  request.page_count = random_u32(1, 64);
  request.flags = kAcquireWriteFlag;
  return request;
}

TEST(Request, AcceptsValidRequestsOfEveryOpcode) {
  for (uint16_t op = kFirstOpcode; op <= kLastOpcode; ++op) {
    RequestV2 request{};
    request.opcode = op;
    switch (static_cast<Opcode>(op)) {
      case Opcode::kCreateSpace:
        request.argument = 960;  // any page size
        request.page_count = 4;
        request.payload_bytes = 5;
        break;
      case Opcode::kSetSchedule:
        request.payload_bytes = 4;
        break;
      case Opcode::kAdvance:
        request.argument = 7;
        break;
      case Opcode::kNop: case Opcode::kStats:
        break;
      case Opcode::kDestroySpace:
        request.space = 1;
        break;
      case Opcode::kCreateChannel:
        request.argument = 1 << 20;
        request.payload_bytes = 4;
        break;
      case Opcode::kOpenChannel:
        request.payload_bytes = 4;
        break;
      case Opcode::kCloseChannel: case Opcode::kPublishChannel:
        request.argument = 3;
        break;
      case Opcode::kAcquireRanges: case Opcode::kReleaseRanges: case Opcode::kPrefetchRanges:
        request.payload_bytes = static_cast<uint32_t>(encode_ranges({{1, 0, 1}}).size());
        break;
      case Opcode::kCopyPages:   // a (source, destination) pair, after a marker
        request.payload_bytes = static_cast<uint32_t>(encode_ranges({{1, 0, 1}, {2, 0, 1}}).size());
        request.flags = kCopyAfterMarker;
        request.argument = 3;
        break;
      default:
        request.space = 1;
        request.page_count = 1;
    }
    EXPECT_TRUE(validate_request(request, 4096).ok()) << opcode_name(op) << ": "
                                                      << validate_request(request, 4096).to_string();
    EXPECT_NE(opcode_name(op), "unknown_opcode");
  }
  EXPECT_EQ(opcode_name(0), "unknown_opcode");
  EXPECT_EQ(opcode_name(kLastOpcode + 1), "unknown_opcode");
}

TEST(Request, RejectsEveryMalformedField) {
  ASSERT_TRUE(validate_request(valid_acquire(), 4096).ok());
  auto expect_code = [](const RequestV2& request, StatusCode code, const char* what) {
    Status status = validate_request(request, 4096);
    EXPECT_EQ(status.code(), code) << what << ": " << status.to_string();
    EXPECT_FALSE(status.message().empty()) << what;
  };
  RequestV2 r = valid_acquire();
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
  r.flags = 0x128;
  expect_code(r, StatusCode::INVALID_ARGUMENT, "unknown acquire flag");
  // The message names exactly the unknown bits, in hex, and the allowed ones.
  Status flags = validate_request(r, 4096);
  EXPECT_NE(flags.message().find("unknown flags 0x128 (allowed: 0x3)"), std::string::npos) << flags.to_string();
  r.flags = 0x12b;
  flags = validate_request(r, 4096);
  EXPECT_NE(flags.message().find("unknown flags 0x128"), std::string::npos) << flags.to_string();
  r = valid_acquire();
  r.space = 0;
  expect_code(r, StatusCode::INVALID_ARGUMENT, "no space");
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

  RequestV2 release{};
  release.opcode = static_cast<uint16_t>(Opcode::kRelease);
  release.space = 1;
  release.page_count = 1;
  release.flags = kReleaseDirty;
  EXPECT_TRUE(validate_request(release, 4096).ok());
  release.argument = 1;
  expect_code(release, StatusCode::INVALID_ARGUMENT, "marker without kReleaseAfterMarker");
  release.flags |= kReleaseAfterMarker;
  EXPECT_TRUE(validate_request(release, 4096).ok());
  release.argument = 0;
  expect_code(release, StatusCode::INVALID_ARGUMENT, "stream-ordered release without a marker");
  release.flags = 1u << 2;
  expect_code(release, StatusCode::INVALID_ARGUMENT, "unknown release flag");

  RequestV2 create{};
  create.opcode = static_cast<uint16_t>(Opcode::kCreateSpace);
  create.argument = 64 << 10;
  create.page_count = 4;
  create.payload_bytes = 4;
  ASSERT_TRUE(validate_request(create, 4096).ok());
  RequestV2 c = create;
  for (uint64_t any : {uint64_t(1), uint64_t(96 << 10), uint64_t(960), uint64_t(4 << 20), kMaxPageBytes}) {
    c.argument = any;
    EXPECT_TRUE(validate_request(c, 4096).ok()) << "page size " << any;
  }
  c.argument = 0;
  expect_code(c, StatusCode::INVALID_ARGUMENT, "page size 0");
  c.argument = kMaxPageBytes + 1;
  expect_code(c, StatusCode::INVALID_ARGUMENT, "page size above kMaxPageBytes");
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

  RequestV2 advance{};
  advance.opcode = static_cast<uint16_t>(Opcode::kAdvance);
  advance.argument = 1ull << 32;
  expect_code(advance, StatusCode::OUT_OF_RANGE, "step beyond 32 bits");
  RequestV2 schedule{};
  schedule.opcode = static_cast<uint16_t>(Opcode::kSetSchedule);
  schedule.payload_bytes = 3;
  expect_code(schedule, StatusCode::INVALID_ARGUMENT, "schedule shorter than its count");
  RequestV2 nop{};
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
  RequestV2 destroy{};
  destroy.opcode = static_cast<uint16_t>(Opcode::kDestroySpace);
  expect_code(destroy, StatusCode::INVALID_ARGUMENT, "destroy_space of space 0");
  destroy.space = 3;
  destroy.page_count = 1;
  expect_code(destroy, StatusCode::INVALID_ARGUMENT, "page range on destroy_space");
}

TEST(Completion, RejectsUnknownStatusAndOversizedPayload) {
  CompletionV2 completion{};
  EXPECT_TRUE(validate_completion(completion, 4096).ok());
  completion.status = 77;
  EXPECT_FALSE(validate_completion(completion, 4096).ok());
  completion.status = 0;
  completion.payload_bytes = 4097;
  EXPECT_FALSE(validate_completion(completion, 4096).ok());
}

TEST(Name, AcceptsPrintableAndRejectsTheRest) {
  EXPECT_TRUE(validate_name("L07.dk", "space").ok());
  EXPECT_FALSE(validate_name("", "space").ok());
  EXPECT_FALSE(validate_name(std::string(kMaxSpaceNameBytes + 1, 'a'), "space").ok());
  EXPECT_FALSE(validate_name("has space", "space").ok());
  EXPECT_FALSE(validate_name(std::string("nul\0", 4), "space").ok());
  Status status = validate_name("\x80", "channel");
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("channel"), std::string::npos) << status.to_string();
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

RuntimeStats random_stats() {
  RuntimeStats stats;
  stats.backend = "host";
  stats.tiers = {{Tier::kGpu, random_u32(1, 100), random_u32(0, 50), random_u32(0, 50), random_u32(0, 9)},
                 {Tier::kHost, random_u32(1, 100), random_u32(0, 50), random_u32(0, 50), random_u32(0, 9)}};
  stats.tiers[1].numa_node = static_cast<int32_t>(random_u32(0, 8)) - 1;
  stats.tiers[0].frames_lost = random_u32(0, 3);
  stats.tiers[1].frames_on_request = random_u32(0, 40);
  for (uint32_t c = 0; c < random_u32(0, 5); ++c) {
    ClientStats client;
    client.client = c + 1;
    client.pid = static_cast<int32_t>(random_u32(1, 100000));
    client.uid = random_u32(0, 70000);
    client.name = "client-" + std::to_string(c);
    client.gpu_quota_bytes = rng()();
    stat_increase(client.gpu_frames, random_u32(1, 10));
    stat_decrease(client.gpu_frames, 1);
    client.bytes_both = rng()();
    client.bytes_host_to_gpu = rng()();
    client.stall_ns = rng()();
    client.channel_bytes = rng()();
    client.gpu_maps = rng()();
    client.gpu_unmaps = rng()();
    client.fence_waits = rng()();
    client.fence_wait_ns = rng()();
    client.call_lock_wait_ns = rng()();
    client.call_locked_ns = rng()();
    client.call_enqueue_ns = rng()();
    client.call_deliver_ns = rng()();
    stats.clients.push_back(client);
  }
  for (uint32_t s = 0; s < random_u32(0, 5); ++s) {
    SpaceInfo space{s + 1, "L" + std::to_string(s) + ".k", random_u32(1, 1u << 30), random_u32(1, 1000)};
    space.client = random_u32(1, 9);
    space.bytes_host = rng()();
    space.bytes_dirty = rng()();
    space.bytes_pinned = rng()();
    space.bytes_gpu_to_host = rng()();
    stats.spaces.push_back(space);
  }
  stats.first_space = random_u32(0, 100);
  stats.spaces_total = stats.first_space + uint32_t(stats.spaces.size()) + random_u32(0, 100);
  return stats;
}

// Writes stats payloads the way other daemons do (Note [Stats payload formats] in
// common/protocol.cpp): format 1 (daemons before format 2; `tier_tail` of its three per-tier
// arrays), and format 2 with `extra` counters appended to every entry (a newer daemon) or
// `-missing` of the last ones left out (an older format-2 daemon). Little-endian bytes by hand, so
// that the decoder is checked against the layout, not against its own encoder.
class PayloadWriter {
 public:
  template <typename T>
  void put(T value) {
    const auto* p = reinterpret_cast<const uint8_t*>(&value);
    bytes.insert(bytes.end(), p, p + sizeof(T));
  }
  void put_string(const std::string& text) {
    put<uint32_t>(uint32_t(text.size()));
    bytes.insert(bytes.end(), text.begin(), text.end());
  }
  void put_stat(const Stat& stat) {
    for (int64_t v : {stat.current, stat.peak, stat.allocated, stat.freed}) put<int64_t>(v);
  }
  void put_counters(std::vector<uint64_t> values, int extra) {
    if (extra < 0) values.resize(values.size() - size_t(-extra));
    for (int i = 0; i < extra; ++i) values.push_back(0x1234 + uint64_t(i));
    put<uint32_t>(uint32_t(values.size()));
    for (uint64_t v : values) put<uint64_t>(v);
  }
  std::vector<uint8_t> bytes;
};

std::vector<uint64_t> client_values(const ClientStats& c) {
  return {c.bytes_gpu,     c.bytes_host,  c.bytes_both,       c.bytes_none,        c.bytes_host_to_gpu,
          c.bytes_gpu_to_host, c.prefetch_hits, c.prefetch_misses, c.evictions,   c.stall_ns,
          c.channel_bytes, c.gpu_maps,    c.gpu_unmaps,       c.fence_waits,       c.fence_wait_ns,
          c.call_lock_wait_ns, c.call_locked_ns, c.call_enqueue_ns, c.call_deliver_ns};
}
std::vector<uint64_t> space_values(const SpaceInfo& s) {
  return {s.bytes_gpu, s.bytes_host, s.bytes_both, s.bytes_none, s.bytes_dirty, s.bytes_pinned,
          s.bytes_host_to_gpu, s.bytes_gpu_to_host};
}

void put_client_prefix(PayloadWriter& w, const ClientStats& c) {
  w.put<uint32_t>(c.client);
  w.put<int32_t>(c.pid);
  w.put<uint32_t>(c.uid);
  w.put_string(c.name);
  w.put<uint64_t>(c.gpu_quota_bytes);
  w.put<uint64_t>(c.host_quota_bytes);
  w.put_stat(c.gpu_frames);
  w.put_stat(c.host_frames);
  w.put<uint32_t>(c.spaces);
}
void put_space_prefix(PayloadWriter& w, const SpaceInfo& s) {
  w.put<uint32_t>(s.id);
  w.put_string(s.name);
  w.put<uint64_t>(s.page_bytes);
  w.put<uint32_t>(s.page_count);
  w.put<uint32_t>(s.client);
}

std::vector<uint8_t> format2_payload(const RuntimeStats& stats, int extra, uint32_t format = 2) {
  PayloadWriter w;
  w.put<uint32_t>(0xFFFFFFFFu);
  w.put<uint32_t>(format);
  w.put_string(stats.backend);
  w.put<uint32_t>(stats.first_space);
  w.put<uint32_t>(stats.spaces_total);
  w.put<uint32_t>(uint32_t(stats.tiers.size()));
  for (const TierStats& t : stats.tiers) {
    w.put<uint8_t>(uint8_t(t.tier));
    w.put<int32_t>(t.numa_node);
    w.put_counters({t.frames_total, t.frames_used, t.frames_free, t.frames_preparing, t.frames_lost,
                    t.frames_on_request}, extra);
  }
  w.put<uint32_t>(uint32_t(stats.clients.size()));
  for (const ClientStats& c : stats.clients) {
    put_client_prefix(w, c);
    w.put_counters(client_values(c), extra);
  }
  w.put<uint32_t>(uint32_t(stats.spaces.size()));
  for (const SpaceInfo& sp : stats.spaces) {
    put_space_prefix(w, sp);
    w.put_counters(space_values(sp), extra);
  }
  return w.bytes;
}

std::vector<uint8_t> format1_payload(const RuntimeStats& stats, int tier_tail) {
  PayloadWriter w;
  w.put_string(stats.backend);
  w.put<uint32_t>(stats.first_space);
  w.put<uint32_t>(stats.spaces_total);
  w.put<uint32_t>(uint32_t(stats.tiers.size()));
  for (const TierStats& t : stats.tiers) {
    w.put<uint8_t>(uint8_t(t.tier));
    for (uint64_t v : {t.frames_total, t.frames_used, t.frames_free, t.frames_preparing}) w.put<uint64_t>(v);
  }
  w.put<uint32_t>(uint32_t(stats.clients.size()));
  for (const ClientStats& c : stats.clients) {
    put_client_prefix(w, c);
    for (uint64_t v : client_values(c)) w.put<uint64_t>(v);
  }
  w.put<uint32_t>(uint32_t(stats.spaces.size()));
  for (const SpaceInfo& sp : stats.spaces) {
    put_space_prefix(w, sp);
    for (uint64_t v : space_values(sp)) w.put<uint64_t>(v);
  }
  if (tier_tail >= 1) for (const TierStats& t : stats.tiers) w.put<int32_t>(t.numa_node);
  if (tier_tail >= 2) for (const TierStats& t : stats.tiers) w.put<uint64_t>(t.frames_lost);
  if (tier_tail >= 3) for (const TierStats& t : stats.tiers) w.put<uint64_t>(t.frames_on_request);
  return w.bytes;
}

// Compares decoded stats with the original; the last `missing` counters of every entry (a payload
// of an older format-2 daemon that lacks them) must read 0.
void expect_same_stats(const RuntimeStats& got, const RuntimeStats& want, size_t missing = 0) {
  EXPECT_EQ(got.backend, want.backend);
  EXPECT_EQ(got.first_space, want.first_space);
  EXPECT_EQ(got.spaces_total, want.spaces_total);
  ASSERT_EQ(got.tiers.size(), want.tiers.size());
  for (size_t t = 0; t < want.tiers.size(); ++t) {
    EXPECT_EQ(got.tiers[t].tier, want.tiers[t].tier);
    EXPECT_EQ(got.tiers[t].numa_node, want.tiers[t].numa_node);
    EXPECT_EQ(got.tiers[t].frames_total, want.tiers[t].frames_total);
    EXPECT_EQ(got.tiers[t].frames_preparing, want.tiers[t].frames_preparing);
    EXPECT_EQ(got.tiers[t].frames_lost, want.tiers[t].frames_lost);
    EXPECT_EQ(got.tiers[t].frames_on_request, missing > 0 ? 0u : want.tiers[t].frames_on_request);
  }
  ASSERT_EQ(got.clients.size(), want.clients.size());
  for (size_t c = 0; c < want.clients.size(); ++c) {
    EXPECT_EQ(got.clients[c].name, want.clients[c].name);
    EXPECT_EQ(got.clients[c].uid, want.clients[c].uid);
    EXPECT_EQ(got.clients[c].pid, want.clients[c].pid);
    EXPECT_EQ(got.clients[c].gpu_quota_bytes, want.clients[c].gpu_quota_bytes);
    EXPECT_EQ(got.clients[c].gpu_frames.peak, want.clients[c].gpu_frames.peak);
    EXPECT_EQ(got.clients[c].gpu_frames.freed, want.clients[c].gpu_frames.freed);
    std::vector<uint64_t> expected = client_values(want.clients[c]);
    for (size_t i = expected.size() - missing; i < expected.size(); ++i) expected[i] = 0;
    EXPECT_EQ(client_values(got.clients[c]), expected);
  }
  ASSERT_EQ(got.spaces.size(), want.spaces.size());
  for (size_t s = 0; s < want.spaces.size(); ++s) {
    EXPECT_EQ(got.spaces[s].name, want.spaces[s].name);
    EXPECT_EQ(got.spaces[s].page_bytes, want.spaces[s].page_bytes);
    EXPECT_EQ(got.spaces[s].page_count, want.spaces[s].page_count);
    EXPECT_EQ(got.spaces[s].client, want.spaces[s].client);
    std::vector<uint64_t> expected = space_values(want.spaces[s]);
    for (size_t i = expected.size() - missing; i < expected.size(); ++i) expected[i] = 0;
    EXPECT_EQ(space_values(got.spaces[s]), expected);
  }
}

TEST(Stats, RoundTripsAndRejectsEveryTruncation) {
  for (int trial = 0; trial < 20; ++trial) {
    RuntimeStats stats = random_stats();
    std::vector<uint8_t> bytes = encode_stats(stats);
    EXPECT_EQ(bytes, format2_payload(stats, 0)) << "the encoder writes format 2 as the note lays it out";
    auto decoded = decode_stats(bytes);
    ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
    expect_same_stats(decoded.value(), stats);
    // The encoding is canonical, and every truncation (and a trailing byte) is refused.
    EXPECT_EQ(encode_stats(decoded.value()), bytes);
    for (size_t n = 0; n < bytes.size(); ++n) {
      EXPECT_FALSE(decode_stats(std::span<const uint8_t>(bytes.data(), n)).ok()) << "length " << n;
    }
    bytes.push_back(0);
    EXPECT_FALSE(decode_stats(bytes).ok());
  }
}

// A membarctl reads the membard it finds: a newer one's counters it does not know are skipped, an
// older format-2 one's missing counters read 0, and a later format number reads the same way.
TEST(Stats, ReadsNewerAndOlderFormat2Daemons) {
  for (int trial = 0; trial < 10; ++trial) {
    RuntimeStats stats = random_stats();
    auto newer = decode_stats(format2_payload(stats, 3, 7));
    ASSERT_TRUE(newer.ok()) << newer.status().to_string();
    expect_same_stats(newer.value(), stats);
    auto older = decode_stats(format2_payload(stats, -1));
    ASSERT_TRUE(older.ok()) << older.status().to_string();
    expect_same_stats(older.value(), stats, 1);
  }
}

// Daemons from before format 2 end their payloads after any of the last three per-tier arrays
// (NUMA nodes, lost frames, frames on request): each reads, the absent ones as -1 and 0.
TEST(Stats, ReadsFormat1DaemonsAndRejectsTheirTruncations) {
  for (int trial = 0; trial < 10; ++trial) {
    RuntimeStats stats = random_stats();
    for (int tail = 0; tail <= 3; ++tail) {
      RuntimeStats want = stats;
      for (TierStats& tier : want.tiers) {
        if (tail < 1) tier.numa_node = -1;
        if (tail < 2) tier.frames_lost = 0;
        if (tail < 3) tier.frames_on_request = 0;
      }
      std::vector<uint8_t> bytes = format1_payload(stats, tail);
      auto decoded = decode_stats(bytes);
      ASSERT_TRUE(decoded.ok()) << "tail " << tail << ": " << decoded.status().to_string();
      expect_same_stats(decoded.value(), want);
      if (tail == 3) {
        // Cut anywhere else than after a whole per-tier array: refused.
        const size_t tiers = stats.tiers.size();
        const size_t ends[] = {bytes.size() - 20 * tiers, bytes.size() - 16 * tiers, bytes.size() - 8 * tiers};
        for (size_t n = 0; n < bytes.size(); ++n) {
          if (n == ends[0] || n == ends[1] || n == ends[2]) continue;
          EXPECT_FALSE(decode_stats(std::span<const uint8_t>(bytes.data(), n)).ok()) << "length " << n;
        }
      }
    }
  }
}

// A page of the admin view with the most spaces a reply may carry fits the socket limit.
TEST(Stats, AFullPageOfSpacesFitsOneMessage) {
  RuntimeStats stats;
  stats.backend = "cuda";
  stats.tiers = {{Tier::kGpu, 1, 0, 1, 0}, {Tier::kHost, 1, 0, 1, 0}};
  for (uint32_t c = 0; c < 256; ++c) {
    ClientStats client;
    client.client = c + 1;
    client.name = std::string(63, 'n');
    stats.clients.push_back(client);
  }
  for (uint32_t s = 0; s < kMaxStatsSpaces; ++s) {
    stats.spaces.push_back(SpaceInfo{s + 1, std::string(kMaxSpaceNameBytes, 's'), kMaxPageBytes, 0xffffffffu});
  }
  EXPECT_LE(encode_stats(stats).size(), kMaxSocketPayloadBytes);
}

TEST(Stats, RejectsUnknownTierFormatAndHugeCounts) {
  RuntimeStats stats = random_stats();
  std::vector<uint8_t> bytes = encode_stats(stats);
  // marker, format, backend string, first_space, spaces_total, then the tier count and the first
  // tier's number; a tier entry is its number, NUMA node, counter count and 6 counters.
  const size_t format = 4, backend = 8, tier_count = 8 + 4 + stats.backend.size() + 8;
  const size_t tier_bytes = 1 + 4 + 4 + 6 * 8;
  std::vector<uint8_t> bad_tier = bytes;
  bad_tier[tier_count + 4] = 5;
  EXPECT_FALSE(decode_stats(bad_tier).ok());
  std::vector<uint8_t> huge_tiers = bytes;
  std::memset(huge_tiers.data() + tier_count, 0xff, 4);
  EXPECT_FALSE(decode_stats(huge_tiers).ok());
  std::vector<uint8_t> huge_counters = bytes;
  std::memset(huge_counters.data() + tier_count + 4 + 1 + 4, 0xff, 4);
  EXPECT_FALSE(decode_stats(huge_counters).ok());
  std::vector<uint8_t> huge_clients = bytes;
  std::memset(huge_clients.data() + tier_count + 4 + 2 * tier_bytes, 0xff, 4);
  EXPECT_FALSE(decode_stats(huge_clients).ok());
  std::vector<uint8_t> huge_string = bytes;
  std::memset(huge_string.data() + backend, 0xff, 4);
  EXPECT_FALSE(decode_stats(huge_string).ok());
  for (uint32_t number : {0u, 1u}) {   // a marker with a format before 2
    std::vector<uint8_t> old_format = bytes;
    std::memcpy(old_format.data() + format, &number, 4);
    EXPECT_FALSE(decode_stats(old_format).ok());
  }
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
  auto* header = reinterpret_cast<SegmentHeaderV2*>(segment.data());
  header->completion_ring_offset += 64;
  EXPECT_FALSE(read_segment_header(segment.data(), segment.size()).ok());
  header->completion_ring_offset -= 64;
  header->version = 1;
  EXPECT_EQ(read_segment_header(segment.data(), segment.size()).status().code(), StatusCode::FAILED_PRECONDITION);

  EXPECT_FALSE(make_segment_layout(3, 1 << 20, 1 << 20).ok());
  EXPECT_FALSE(make_segment_layout(1, 1 << 20, 1 << 20).ok());
  EXPECT_FALSE(make_segment_layout(1 << 17, 1 << 20, 1 << 20).ok());
  EXPECT_FALSE(make_segment_layout(64, 100, 1 << 20).ok());
  EXPECT_FALSE(make_segment_layout(64, 1 << 20, 1ull << 40).ok());
}

TEST(Ring, PassesEntriesInOrderAcrossThreadsAndWraps) {
  constexpr uint32_t kCapacity = 8;
  std::vector<uint8_t> memory(sizeof(RingControlV2) + kCapacity * sizeof(RequestV2));
  RingEnd<RequestV2> producer(memory.data(), kCapacity);
  RingEnd<RequestV2> consumer(memory.data(), kCapacity);
  constexpr uint64_t kCount = 20000;
  std::thread thread([&] {
    for (uint64_t i = 1; i <= kCount; ++i) {
      RequestV2 request{};
      request.sequence = i;
      request.argument = i * 3;
      while (!producer.try_push(request)) std::this_thread::yield();
    }
  });
  uint64_t expected = 1;
  uint32_t idle = 0;
  while (expected <= kCount) {
    RequestV2 request;
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
  std::vector<uint8_t> memory(sizeof(RingControlV2) + kCapacity * sizeof(CompletionV2));
  RingEnd<CompletionV2> producer(memory.data(), kCapacity);
  RingEnd<CompletionV2> consumer(memory.data(), kCapacity);
  CompletionV2 entry{};
  for (uint32_t i = 0; i < kCapacity; ++i) EXPECT_TRUE(producer.try_push(entry));
  EXPECT_FALSE(producer.try_push(entry)) << "a full ring refuses";
  auto* control = reinterpret_cast<RingControlV2*>(memory.data());
  control->head = 1000;  // a producer lying about its head
  EXPECT_EQ(consumer.try_pop(entry), -1);
  // A consumer lying about its tail (beyond the head) cannot make the producer overwrite.
  RingEnd<CompletionV2> fresh_producer(memory.data(), kCapacity);
  control->tail = 1ull << 50;
  EXPECT_FALSE(fresh_producer.try_push(entry));
}

// ---------------------------------------------------------------------------------------------
// Socket framing.

TEST(Assembler, SplitsAStreamFedByteByByteAndPairsFds) {
  HelloV2 hello{};
  HelloReplyV2 reply{};
  FrameGrantV2 grant{1, 5, 0};
  std::vector<uint8_t> stream = encode_message(MessageType::kHello, hello);
  std::vector<uint8_t> with_two = encode_message(MessageType::kHelloReply, reply, 2);
  std::vector<uint8_t> with_one = encode_message(MessageType::kFrameGrant, grant, 1);
  stream.insert(stream.end(), with_two.begin(), with_two.end());
  stream.insert(stream.end(), with_one.begin(), with_one.end());
  wire::MessageAssembler assembler;
  int pipes[3][2];
  for (auto& pipe_fds : pipes) {
    ASSERT_EQ(::pipe(pipe_fds), 0);
    ::close(pipe_fds[1]);
    assembler.append_fd(pipe_fds[0]);
  }
  std::vector<uint16_t> types;
  for (uint8_t byte : stream) {
    assembler.append(std::span<const uint8_t>(&byte, 1));
    auto next = assembler.next();
    ASSERT_TRUE(next.ok());
    if (!next.value().has_value()) continue;
    types.push_back(next.value()->header.type);
    if (next.value()->header.type == static_cast<uint16_t>(MessageType::kHelloReply)) {
      ASSERT_EQ(next.value()->fds.size(), 2u);
      EXPECT_EQ(next.value()->fds[0].get(), pipes[0][0]);
      EXPECT_EQ(next.value()->fds[1].get(), pipes[1][0]);
    }
    if (next.value()->header.type == static_cast<uint16_t>(MessageType::kFrameGrant)) {
      ASSERT_EQ(next.value()->fds.size(), 1u);
      EXPECT_EQ(next.value()->fds[0].get(), pipes[2][0]);
    }
  }
  EXPECT_EQ(types, (std::vector<uint16_t>{1, 2, 3}));
  EXPECT_EQ(assembler.pending_bytes(), 0u);
  EXPECT_EQ(assembler.pending_fds(), 0u);
}

TEST(Assembler, ReportsAMissingFdAndGarbage) {
  FrameGrantV2 grant{1, 5, 0};
  wire::MessageAssembler missing_fd;
  auto message = encode_message(MessageType::kFrameGrant, grant, 1);
  missing_fd.append(message);
  EXPECT_FALSE(missing_fd.next().ok());
  wire::MessageAssembler garbage;
  std::vector<uint8_t> noise(64, 0xab);
  garbage.append(noise);
  EXPECT_FALSE(garbage.next().ok());
}

// send_some never waits: on a full socket it writes what fits, then 0.
TEST(Wire, SendSomeNeverBlocks) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, pair), 0);
  std::vector<uint8_t> big(1 << 20, 7);
  size_t total = 0;
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 64; ++i) {
    auto sent = wire::send_some(pair[0], big);
    ASSERT_TRUE(sent.ok());
    total += sent.value();
    if (sent.value() == 0) break;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  EXPECT_LT(total, 64u << 20) << "the socket buffer should have filled";
  EXPECT_EQ(wire::send_some(pair[0], big).value(), 0u);
  ::close(pair[1]);
  EXPECT_EQ(wire::send_some(pair[0], big).status().code(), StatusCode::UNAVAILABLE);
  ::close(pair[0]);
}

}  // namespace
}  // namespace membar::protocol::v2
