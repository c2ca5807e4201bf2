// Encoding, decoding and validation of protocol v2 (include/membar/protocol/v2.h). Depends only
// on the standard library and membar/status.h so that fuzz/protocol_fuzzer.cpp can build it alone.
#include "membar/protocol/v2.h"

#include <array>
#include <cstdio>
#include <cstring>
#include <limits>

namespace membar::protocol::v2 {
namespace {

constexpr uint64_t align_up(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

bool is_power_of_two(uint64_t value) { return value != 0 && (value & (value - 1)) == 0; }

// The largest payload each socket message type may carry.
uint32_t max_payload_bytes(MessageType type) {
  switch (type) {
    case MessageType::kHello: return sizeof(HelloV2);
    case MessageType::kHelloReply: return sizeof(HelloReplyV2);
    case MessageType::kFrameGrant: return sizeof(FrameGrantV2);
    case MessageType::kFrameRevoke: return sizeof(FrameEventV2);
    case MessageType::kSlabGrant: return sizeof(SlabGrantV2);
    case MessageType::kSlabRevoke: return sizeof(SlabEventV2);
    case MessageType::kFrameMap: return sizeof(FrameMapV2);
    case MessageType::kFrameUnmap: return sizeof(FrameMapV2);
    case MessageType::kShutdown: return sizeof(ShutdownV2);
    case MessageType::kStatsRequest: return sizeof(StatsRequestV2);
    case MessageType::kStatsReply: return kMaxSocketPayloadBytes;
    case MessageType::kPing: return sizeof(PingV2);
    case MessageType::kPong: return sizeof(PingV2);
    case MessageType::kError: return sizeof(ErrorV2);
    case MessageType::kChannelGrant: return sizeof(ChannelNoticeV2);
  }
  return 0;
}

// Messages whose size is fixed must carry exactly that size.
bool payload_size_is_fixed(MessageType type) { return type != MessageType::kStatsReply; }

// Descriptors beside each message type: [fewest, most].
std::pair<uint32_t, uint32_t> fd_count_range(MessageType type) {
  switch (type) {
    case MessageType::kHelloReply: return {0, 2};  // 2 when OK, 0 with a refusal
    case MessageType::kFrameGrant:
    case MessageType::kSlabGrant:
    case MessageType::kChannelGrant:
      return {1, 1};
    default:
      return {0, 0};
  }
}

template <typename T>
Result<T> decode_fixed(std::span<const uint8_t> payload, const char* what) {
  if (payload.size() != sizeof(T)) {
    return invalid_argument(std::string(what) + " payload is " + std::to_string(payload.size()) +
                            " bytes, expected " + std::to_string(sizeof(T)));
  }
  T value;
  std::memcpy(&value, payload.data(), sizeof(T));
  return value;
}

bool text_has_nul(const char* field, size_t bytes) { return std::memchr(field, 0, bytes) != nullptr; }

bool all_zero(const uint8_t* bytes, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    if (bytes[i] != 0) return false;
  }
  return true;
}

// Bounds-checked little-endian reader over a payload. Every read fails (and keeps failing) once
// the payload is exhausted; decoders check ok() at the end and before allocating by a count.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  template <typename T>
  T read() {
    T value{};
    if (!ok_ || bytes_.size() - offset_ < sizeof(T)) {
      ok_ = false;
      return value;
    }
    std::memcpy(&value, bytes_.data() + offset_, sizeof(T));
    offset_ += sizeof(T);
    return value;
  }
  std::string read_string(uint32_t max_bytes) {
    uint32_t length = read<uint32_t>();
    if (!ok_ || length > max_bytes || bytes_.size() - offset_ < length) {
      ok_ = false;
      return {};
    }
    std::string out(reinterpret_cast<const char*>(bytes_.data() + offset_), length);
    offset_ += length;
    return out;
  }
  // True when `count` items of at least `min_item_bytes` each can still be present.
  bool can_hold(uint64_t count, uint64_t min_item_bytes) {
    if (!ok_ || count > (bytes_.size() - offset_) / min_item_bytes) ok_ = false;
    return ok_;
  }
  bool ok() const { return ok_; }
  bool at_end() const { return ok_ && offset_ == bytes_.size(); }

 private:
  std::span<const uint8_t> bytes_;
  size_t offset_ = 0;
  bool ok_ = true;
};

class Writer {
 public:
  template <typename T>
  void write(T value) {
    const auto* p = reinterpret_cast<const uint8_t*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
  }
  void write_string(std::string_view text, uint32_t max_bytes) {
    if (text.size() > max_bytes) text = text.substr(0, max_bytes);
    write<uint32_t>(static_cast<uint32_t>(text.size()));
    bytes_.insert(bytes_.end(), text.begin(), text.end());
  }
  std::vector<uint8_t> take() { return std::move(bytes_); }

 private:
  std::vector<uint8_t> bytes_;
};

constexpr uint32_t kMaxStatsString = 256;
constexpr uint32_t kStatBytes = 4 * sizeof(int64_t);

void write_stat(Writer& w, const Stat& s) {
  w.write<int64_t>(s.current);
  w.write<int64_t>(s.peak);
  w.write<int64_t>(s.allocated);
  w.write<int64_t>(s.freed);
}
Stat read_stat(Reader& r) {
  Stat s;
  s.current = r.read<int64_t>();
  s.peak = r.read<int64_t>();
  s.allocated = r.read<int64_t>();
  s.freed = r.read<int64_t>();
  return s;
}

// One row of MEMBAR_PROTOCOL_OPCODES (Note [One opcode table]).
struct OpcodeRow {
  std::string_view name;
  RangeRule range;
  uint32_t flags;
  PayloadRule payload;
  ArgumentRule argument;
};

const OpcodeRow* opcode_row(uint16_t opcode) {
  static const OpcodeRow kRows[] = {
#define MEMBAR_OPCODE_ROW(Name, number, text, range, flags, payload, argument) \
  {text, RangeRule::range, flags, PayloadRule::payload, ArgumentRule::argument},
      MEMBAR_PROTOCOL_OPCODES(MEMBAR_OPCODE_ROW)
#undef MEMBAR_OPCODE_ROW
  };
  static_assert(sizeof(kRows) / sizeof(kRows[0]) == kLastOpcode - kFirstOpcode + 1,
                "opcodes are numbered 1..kLastOpcode without gaps");
  if (opcode < kFirstOpcode || opcode > kLastOpcode) return nullptr;
  return &kRows[opcode - kFirstOpcode];
}

std::string hex(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%llx", static_cast<unsigned long long>(value));
  return text;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Segment.

Result<SegmentLayout> make_segment_layout(uint32_t ring_capacity, uint64_t request_payload_bytes,
                                          uint64_t response_payload_bytes) {
  if (!is_power_of_two(ring_capacity) || ring_capacity < 2 || ring_capacity > kMaxRingCapacity) {
    return invalid_argument("ring capacity " + std::to_string(ring_capacity) +
                            " must be a power of two in [2, " + std::to_string(kMaxRingCapacity) + "]");
  }
  for (uint64_t bytes : {request_payload_bytes, response_payload_bytes}) {
    if (bytes < 4096 || bytes > kMaxPayloadAreaBytes) {
      return invalid_argument("payload area of " + std::to_string(bytes) +
                              " bytes is outside [4 KiB, 64 MiB]");
    }
  }
  SegmentLayout layout;
  layout.ring_capacity = ring_capacity;
  layout.request_ring_offset = sizeof(SegmentHeaderV2);
  layout.completion_ring_offset =
      layout.request_ring_offset + sizeof(RingControlV2) + uint64_t{ring_capacity} * sizeof(RequestV2);
  layout.request_payload_offset = align_up(
      layout.completion_ring_offset + sizeof(RingControlV2) + uint64_t{ring_capacity} * sizeof(CompletionV2),
      4096);
  layout.request_payload_bytes = align_up(request_payload_bytes, 64);
  layout.response_payload_offset = align_up(layout.request_payload_offset + layout.request_payload_bytes, 4096);
  layout.response_payload_bytes = align_up(response_payload_bytes, 64);
  layout.segment_bytes = align_up(layout.response_payload_offset + layout.response_payload_bytes, 4096);
  return layout;
}

void write_segment_header(void* segment, const SegmentLayout& layout) {
  SegmentHeaderV2 header{};
  header.magic = kMagic;
  header.version = kVersion;
  header.ring_capacity = layout.ring_capacity;
  header.entry_bytes = sizeof(RequestV2);
  header.segment_bytes = layout.segment_bytes;
  header.request_ring_offset = layout.request_ring_offset;
  header.completion_ring_offset = layout.completion_ring_offset;
  header.request_payload_offset = layout.request_payload_offset;
  header.request_payload_bytes = layout.request_payload_bytes;
  header.response_payload_offset = layout.response_payload_offset;
  header.response_payload_bytes = layout.response_payload_bytes;
  header.daemon_state = kDaemonRunning;
  std::memcpy(segment, &header, sizeof(header));
}

Result<SegmentLayout> read_segment_header(const void* segment, uint64_t mapped_bytes) {
  if (mapped_bytes < sizeof(SegmentHeaderV2)) {
    return invalid_argument("segment of " + std::to_string(mapped_bytes) + " bytes is smaller than its header");
  }
  SegmentHeaderV2 header;
  std::memcpy(&header, segment, sizeof(header));
  if (header.magic != kMagic) return invalid_argument("segment header has a bad magic number");
  if (header.version != kVersion) {
    return failed_precondition("segment is protocol version " + std::to_string(header.version) +
                               ", this client speaks " + std::to_string(kVersion));
  }
  if (header.entry_bytes != sizeof(RequestV2)) return invalid_argument("segment ring entries have the wrong size");
  // Recompute the layout from the sizes and require the offsets to match exactly.
  MEMBAR_ASSIGN_OR_RETURN(SegmentLayout layout,
                          make_segment_layout(header.ring_capacity, header.request_payload_bytes,
                                              header.response_payload_bytes));
  if (layout.segment_bytes != header.segment_bytes || layout.request_ring_offset != header.request_ring_offset ||
      layout.completion_ring_offset != header.completion_ring_offset ||
      layout.request_payload_offset != header.request_payload_offset ||
      layout.response_payload_offset != header.response_payload_offset) {
    return invalid_argument("segment header offsets do not match protocol v2's layout");
  }
  if (layout.segment_bytes > mapped_bytes) {
    return invalid_argument("segment header says " + std::to_string(layout.segment_bytes) +
                            " bytes but only " + std::to_string(mapped_bytes) + " are mapped");
  }
  return layout;
}

// ---------------------------------------------------------------------------------------------
// Socket messages.

std::vector<uint8_t> encode_message(MessageType type, std::span<const uint8_t> payload, uint32_t fd_count) {
  MessageHeaderV2 header{kMagic, kVersion, static_cast<uint16_t>(type),
                         static_cast<uint32_t>(payload.size()), fd_count};
  std::vector<uint8_t> out(sizeof(header) + payload.size());
  std::memcpy(out.data(), &header, sizeof(header));
  if (!payload.empty()) std::memcpy(out.data() + sizeof(header), payload.data(), payload.size());
  return out;
}

Result<MessageHeaderV2> decode_message_header(std::span<const uint8_t> bytes) {
  if (bytes.size() < sizeof(MessageHeaderV2)) {
    return invalid_argument("message header truncated: " + std::to_string(bytes.size()) + " of 16 bytes");
  }
  MessageHeaderV2 header;
  std::memcpy(&header, bytes.data(), sizeof(header));
  if (header.magic != kMagic) return invalid_argument("bad magic number: not a membar protocol message");
  if (header.version != kVersion) {
    return failed_precondition("protocol version mismatch: peer speaks version " +
                               std::to_string(header.version) + ", this side speaks version " +
                               std::to_string(kVersion) + " (update membard and the client library together)");
  }
  if (header.type < kFirstMessageType || header.type > kLastMessageType) {
    return invalid_argument("unknown message type " + std::to_string(header.type));
  }
  auto type = static_cast<MessageType>(header.type);
  uint32_t limit = max_payload_bytes(type);
  if (header.payload_bytes > limit || (payload_size_is_fixed(type) && header.payload_bytes != limit)) {
    return invalid_argument("message type " + std::to_string(header.type) + " carries " +
                            std::to_string(header.payload_bytes) + " payload bytes, allowed " +
                            std::to_string(limit));
  }
  auto [fewest, most] = fd_count_range(type);
  if (header.fd_count < fewest || header.fd_count > most) {
    return invalid_argument("message type " + std::to_string(header.type) + " announces " +
                            std::to_string(header.fd_count) + " file descriptors");
  }
  return header;
}

void copy_text(char* field, size_t field_bytes, std::string_view text) {
  size_t n = std::min(text.size(), field_bytes - 1);
  std::memcpy(field, text.data(), n);
  std::memset(field + n, 0, field_bytes - n);
}

Result<std::string> read_text(const char* field, size_t field_bytes) {
  if (!text_has_nul(field, field_bytes)) return invalid_argument("text field is not NUL-terminated");
  return std::string(field);
}

Result<HelloV2> decode_hello(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(HelloV2 hello, decode_fixed<HelloV2>(payload, "hello"));
  if (hello.role != static_cast<uint32_t>(Role::kClient) && hello.role != static_cast<uint32_t>(Role::kAdmin)) {
    return invalid_argument("hello names unknown role " + std::to_string(hello.role));
  }
  if (hello.device_plus_one > kMaxDevices) {
    return invalid_argument("hello names device " + std::to_string(hello.device_plus_one - 1) + " (devices are 0.." +
                            std::to_string(kMaxDevices - 1) + ")");
  }
  if (!text_has_nul(hello.client_name, sizeof(hello.client_name))) {
    return invalid_argument("hello client name is not NUL-terminated within 64 bytes");
  }
  for (const char* c = hello.client_name; *c != 0; ++c) {
    if (*c < 0x20 || *c > 0x7e) return invalid_argument("hello client name has a non-printable byte");
  }
  return hello;
}

Result<HelloReplyV2> decode_hello_reply(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(HelloReplyV2 reply, decode_fixed<HelloReplyV2>(payload, "hello reply"));
  if (!status_code_is_known(reply.status)) {
    return invalid_argument("hello reply has unknown status " + std::to_string(reply.status));
  }
  if (!text_has_nul(reply.message, sizeof(reply.message))) {
    return invalid_argument("hello reply text is not NUL-terminated");
  }
  if (reply.status == static_cast<int32_t>(StatusCode::OK)) {
    if (reply.backend != static_cast<uint8_t>(WireBackend::kHost) &&
        reply.backend != static_cast<uint8_t>(WireBackend::kCuda)) {
      return invalid_argument("hello reply names unknown backend " + std::to_string(reply.backend));
    }
    if (reply.gpu_quota_frames > (1u << 26) || reply.host_quota_frames > (1u << 26)) {
      return invalid_argument("hello reply quotas exceed 2^26 frames");
    }
    if (reply.host_slab_frames == 0 || reply.host_slab_frames > (1u << 16)) {
      return invalid_argument("hello reply names host slabs of " + std::to_string(reply.host_slab_frames) + " frames");
    }
  }
  return reply;
}

namespace {
Status check_tier(uint8_t tier, const char* what) {
  if (tier != static_cast<uint8_t>(Tier::kGpu) && tier != static_cast<uint8_t>(Tier::kHost)) {
    return invalid_argument(std::string(what) + " names unknown tier " + std::to_string(tier));
  }
  return Status::Ok();
}
Status check_sequence(uint64_t sequence, const char* what) {
  if (sequence == 0) return invalid_argument(std::string(what) + " has event sequence number 0");
  return Status::Ok();
}
}  // namespace

Result<FrameGrantV2> decode_frame_grant(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(FrameGrantV2 grant, decode_fixed<FrameGrantV2>(payload, "frame grant"));
  MEMBAR_RETURN_IF_ERROR(check_sequence(grant.sequence, "frame grant"));
  if (grant.window_frame == kNoFrame || grant.reserved != 0) return invalid_argument("frame grant names no frame");
  return grant;
}

Result<FrameEventV2> decode_frame_event(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(FrameEventV2 event, decode_fixed<FrameEventV2>(payload, "frame event"));
  MEMBAR_RETURN_IF_ERROR(check_sequence(event.sequence, "frame event"));
  MEMBAR_RETURN_IF_ERROR(check_tier(event.tier, "frame event"));
  if (event.window_frame == kNoFrame) return invalid_argument("frame event names no frame");
  return event;
}

Result<SlabGrantV2> decode_slab_grant(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(SlabGrantV2 grant, decode_fixed<SlabGrantV2>(payload, "slab grant"));
  MEMBAR_RETURN_IF_ERROR(check_sequence(grant.sequence, "slab grant"));
  if (grant.frames == 0 || grant.frames > (1u << 16) || grant.bytes != uint64_t{grant.frames} * kFrameBytes) {
    return invalid_argument("slab grant of " + std::to_string(grant.frames) + " frames announces " +
                            std::to_string(grant.bytes) + " bytes");
  }
  return grant;
}

Result<SlabEventV2> decode_slab_event(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(SlabEventV2 event, decode_fixed<SlabEventV2>(payload, "slab event"));
  MEMBAR_RETURN_IF_ERROR(check_sequence(event.sequence, "slab event"));
  return event;
}

Result<FrameMapV2> decode_frame_map(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(FrameMapV2 map, decode_fixed<FrameMapV2>(payload, "frame map"));
  MEMBAR_RETURN_IF_ERROR(check_sequence(map.sequence, "frame map"));
  MEMBAR_RETURN_IF_ERROR(check_tier(map.tier, "frame map"));
  if (map.space == 0 || map.window_frame == kNoFrame) return invalid_argument("frame map names no space or frame");
  if (uint64_t{map.space_frame} >= kMaxSpaceBytes / kFrameBytes) {
    return invalid_argument("frame map names space frame " + std::to_string(map.space_frame) + ", past any space");
  }
  return map;
}

Result<ChannelNoticeV2> decode_channel_notice(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(ChannelNoticeV2 notice, decode_fixed<ChannelNoticeV2>(payload, "channel notice"));
  MEMBAR_RETURN_IF_ERROR(check_sequence(notice.sequence, "channel notice"));
  if ((notice.flags & ~kChannelWritable) != 0) {
    return invalid_argument("channel notice has unknown flags " + hex(notice.flags & ~kChannelWritable));
  }
  if (notice.channel == 0 || notice.bytes == 0 || notice.bytes > (64ull << 30)) {
    return invalid_argument("channel notice names channel " + std::to_string(notice.channel) + " of " +
                            std::to_string(notice.bytes) + " bytes");
  }
  return notice;
}

Result<ShutdownV2> decode_shutdown(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(ShutdownV2 shutdown, decode_fixed<ShutdownV2>(payload, "shutdown"));
  if (!text_has_nul(shutdown.reason, sizeof(shutdown.reason))) {
    return invalid_argument("shutdown reason is not NUL-terminated");
  }
  return shutdown;
}

Result<StatsRequestV2> decode_stats_request(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(StatsRequestV2 request, decode_fixed<StatsRequestV2>(payload, "stats request"));
  if (request.max_spaces == 0 || request.max_spaces > kMaxStatsSpaces) {
    return invalid_argument("stats request asks for " + std::to_string(request.max_spaces) + " spaces (1.." +
                            std::to_string(kMaxStatsSpaces) + ")");
  }
  return request;
}

Result<PingV2> decode_ping(std::span<const uint8_t> payload) { return decode_fixed<PingV2>(payload, "ping"); }

Result<ErrorV2> decode_error(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(ErrorV2 error, decode_fixed<ErrorV2>(payload, "error"));
  if (!status_code_is_known(error.status) || error.status == 0) {
    return invalid_argument("error message has status " + std::to_string(error.status));
  }
  if (!text_has_nul(error.message, sizeof(error.message))) return invalid_argument("error text is not NUL-terminated");
  return error;
}

uint64_t event_sequence(MessageType type, std::span<const uint8_t> payload) {
  switch (type) {
    case MessageType::kFrameGrant: case MessageType::kFrameRevoke: case MessageType::kSlabGrant:
    case MessageType::kSlabRevoke: case MessageType::kFrameMap: case MessageType::kFrameUnmap:
    case MessageType::kChannelGrant:
      break;
    default:
      return 0;
  }
  uint64_t sequence = 0;
  if (payload.size() >= sizeof(sequence)) std::memcpy(&sequence, payload.data(), sizeof(sequence));
  return sequence;
}

// ---------------------------------------------------------------------------------------------
// Ring entries.

Status validate_name(std::string_view name, std::string_view what) {
  if (name.empty() || name.size() > kMaxSpaceNameBytes) {
    return invalid_argument(std::string(what) + " name must be 1.." + std::to_string(kMaxSpaceNameBytes) +
                            " bytes, got " + std::to_string(name.size()));
  }
  for (char c : name) {
    if (c < 0x21 || c > 0x7e) {
      return invalid_argument(std::string(what) + " name has a byte that is not printable ASCII (or is a space)");
    }
  }
  return Status::Ok();
}

Status validate_request(const RequestV2& request, uint64_t request_payload_capacity) {
  const OpcodeRow* row = opcode_row(request.opcode);
  if (row == nullptr) return invalid_argument("unknown opcode " + std::to_string(request.opcode));
  std::string name(row->name);
  if (request.reserved0 != 0 || !all_zero(request.reserved1, sizeof(request.reserved1))) {
    return invalid_argument(name + ": reserved bytes are not zero");
  }
  if ((request.flags & ~row->flags) != 0) {
    return invalid_argument(name + ": unknown flags " + hex(request.flags & ~row->flags) + " (allowed: " +
                            hex(row->flags) + ")");
  }
  if (request.payload_bytes > request_payload_capacity) {
    return invalid_argument(name + ": payload of " + std::to_string(request.payload_bytes) +
                            " bytes exceeds the payload area (" + std::to_string(request_payload_capacity) + ")");
  }
  switch (row->payload) {
    case PayloadRule::kNone:
      if (request.payload_bytes != 0) {
        return invalid_argument(name + ": takes no payload but announces " + std::to_string(request.payload_bytes) +
                                " bytes");
      }
      break;
    case PayloadRule::kName:
      if (request.payload_bytes == 0 || request.payload_bytes > kMaxSpaceNameBytes) {
        return invalid_argument(name + ": name must be 1.." + std::to_string(kMaxSpaceNameBytes) + " bytes, got " +
                                std::to_string(request.payload_bytes));
      }
      break;
    case PayloadRule::kSchedule:
      if (request.payload_bytes < sizeof(uint32_t)) return invalid_argument(name + ": payload truncated");
      break;
    case PayloadRule::kRanges:
      if (request.payload_bytes < sizeof(uint32_t) + 3 * sizeof(uint32_t) ||
          request.payload_bytes > sizeof(uint32_t) + kMaxRanges * 3 * sizeof(uint32_t)) {
        return invalid_argument(name + ": a ranges payload of " + std::to_string(request.payload_bytes) + " bytes");
      }
      break;
  }
  // Fields an opcode does not use must be zero, so that no request means two things.
  switch (row->range) {
    case RangeRule::kNone:
      if (request.space != 0 || request.first_page != 0 || request.page_count != 0) {
        return invalid_argument(name + ": takes no space or page range but names one");
      }
      break;
    case RangeRule::kSpace:
      if (request.space == 0) return invalid_argument(name + ": names no space");
      if (request.first_page != 0 || request.page_count != 0) {
        return invalid_argument(name + ": takes no page range but names one");
      }
      break;
    case RangeRule::kPages:
      if (request.space == 0) return invalid_argument(name + ": names no space");
      if (request.page_count == 0) return invalid_argument(name + ": page range is empty");
      if (uint64_t{request.first_page} + request.page_count > std::numeric_limits<uint32_t>::max()) {
        return out_of_range(name + ": page range [" + std::to_string(request.first_page) + ", +" +
                            std::to_string(request.page_count) + ") overflows 32-bit page indices");
      }
      break;
    case RangeRule::kCount:
      if (request.space != 0 || request.first_page != 0) return invalid_argument(name + ": takes no space or first page");
      if (request.page_count == 0) return invalid_argument(name + ": page count must be at least 1");
      break;
  }
  switch (row->argument) {
    case ArgumentRule::kZero:
      if (request.argument != 0) return invalid_argument(name + ": argument must be zero");
      break;
    case ArgumentRule::kPageBytes:
      if (request.argument == 0 || request.argument > kMaxPageBytes) {
        return invalid_argument(name + ": page size " + std::to_string(request.argument) + " bytes is not in [1, " +
                                std::to_string(kMaxPageBytes) + "]");
      }
      break;
    case ArgumentRule::kMarker: {
      bool after_marker = (request.flags & kReleaseAfterMarker) != 0;
      if (after_marker && request.argument == 0) return invalid_argument(name + ": the release marker must be at least 1");
      if (!after_marker && request.argument != 0) return invalid_argument(name + ": argument must be zero");
      break;
    }
    case ArgumentRule::kStep:
      if (request.argument > std::numeric_limits<uint32_t>::max()) {
        return out_of_range(name + ": step " + std::to_string(request.argument) + " exceeds 32 bits");
      }
      break;
    case ArgumentRule::kBytes:
      if (request.argument == 0 || request.argument > (64ull << 30)) {
        return invalid_argument(name + ": size " + std::to_string(request.argument) + " is not in [1, 64 GiB]");
      }
      break;
    case ArgumentRule::kChannel:
      if (request.argument == 0 || request.argument > std::numeric_limits<uint32_t>::max()) {
        return invalid_argument(name + ": channel id " + std::to_string(request.argument) + " is not valid");
      }
      break;
    case ArgumentRule::kAdvanceTo: {
      bool advance = (request.flags & kAcquireAdvanceFlag) != 0;
      if (advance && request.argument > std::numeric_limits<uint32_t>::max()) {
        return out_of_range(name + ": step " + std::to_string(request.argument) + " exceeds 32 bits");
      }
      if (!advance && request.argument != 0) return invalid_argument(name + ": argument must be zero");
      break;
    }
  }
  return Status::Ok();
}

Status validate_completion(const CompletionV2& completion, uint64_t response_payload_capacity) {
  if (!status_code_is_known(completion.status)) {
    return invalid_argument("completion has unknown status " + std::to_string(completion.status));
  }
  if (completion.payload_bytes > response_payload_capacity) {
    return invalid_argument("completion payload exceeds the response area");
  }
  return Status::Ok();
}

std::string_view opcode_name(uint16_t opcode) {
  const OpcodeRow* row = opcode_row(opcode);
  return row == nullptr ? std::string_view("unknown_opcode") : row->name;
}

// ---------------------------------------------------------------------------------------------
// Payloads.

std::vector<uint8_t> encode_schedule(const std::vector<ScheduleStep>& steps) {
  Writer w;
  w.write<uint32_t>(static_cast<uint32_t>(steps.size()));
  for (const ScheduleStep& step : steps) {
    w.write<uint32_t>(static_cast<uint32_t>(step.ranges.size()));
    for (const PageRange& range : step.ranges) {
      w.write<uint32_t>(range.space);
      w.write<uint32_t>(range.first_page);
      w.write<uint32_t>(range.page_count);
    }
  }
  return w.take();
}

Result<std::vector<ScheduleStep>> decode_schedule(std::span<const uint8_t> payload) {
  Reader r(payload);
  uint32_t step_count = r.read<uint32_t>();
  if (!r.can_hold(step_count, sizeof(uint32_t))) {
    return invalid_argument("schedule announces " + std::to_string(step_count) + " steps; the payload cannot hold them");
  }
  std::vector<ScheduleStep> steps(step_count);
  for (uint32_t s = 0; s < step_count; ++s) {
    uint32_t range_count = r.read<uint32_t>();
    if (!r.can_hold(range_count, 3 * sizeof(uint32_t))) {
      return invalid_argument("schedule step " + std::to_string(s) + " announces " + std::to_string(range_count) +
                              " ranges; the payload cannot hold them");
    }
    steps[s].ranges.resize(range_count);
    for (PageRange& range : steps[s].ranges) {
      range.space = r.read<uint32_t>();
      range.first_page = r.read<uint32_t>();
      range.page_count = r.read<uint32_t>();
      if (range.page_count == 0) {
        return invalid_argument("schedule step " + std::to_string(s) + " has an empty page range");
      }
      if (uint64_t{range.first_page} + range.page_count > std::numeric_limits<uint32_t>::max()) {
        return out_of_range("schedule step " + std::to_string(s) + " has a page range that overflows 32 bits");
      }
    }
  }
  if (!r.at_end()) return invalid_argument("schedule payload has trailing or missing bytes");
  return steps;
}

std::vector<uint8_t> encode_ranges(const std::vector<PageRange>& ranges) {
  Writer w;
  w.write<uint32_t>(static_cast<uint32_t>(ranges.size()));
  for (const PageRange& range : ranges) {
    w.write<uint32_t>(range.space);
    w.write<uint32_t>(range.first_page);
    w.write<uint32_t>(range.page_count);
  }
  return w.take();
}

Result<std::vector<PageRange>> decode_ranges(std::span<const uint8_t> payload) {
  Reader r(payload);
  uint32_t count = r.read<uint32_t>();
  if (!r.ok() || count == 0 || count > kMaxRanges || !r.can_hold(count, 3 * sizeof(uint32_t))) {
    return invalid_argument("a ranges payload announces " + std::to_string(count) + " ranges (1.." +
                            std::to_string(kMaxRanges) + ", as many as it holds)");
  }
  std::vector<PageRange> ranges(count);
  for (PageRange& range : ranges) {
    range.space = r.read<uint32_t>();
    range.first_page = r.read<uint32_t>();
    range.page_count = r.read<uint32_t>();
    if (range.space == 0 || range.page_count == 0) return invalid_argument("a ranges payload names an empty range");
    if (uint64_t{range.first_page} + range.page_count > std::numeric_limits<uint32_t>::max()) {
      return out_of_range("a page range overflows 32-bit page indices");
    }
  }
  if (!r.at_end()) return invalid_argument("a ranges payload has trailing bytes");
  return ranges;
}

// Note [Stats payload formats]
// Rationale: the admin view grows a counter most sessions, and a membarctl must read the membard
// it finds running, older or newer than itself.
// Approach: format 2 (what encode_stats writes) starts with a marker no format-1 payload can start
// with (a string length past kMaxStatsString) and its number, then every entry's counters as a
// counted array of u64, in a fixed order that only ever grows at the end:
//   u32 kStatsFormatMarker, u32 format (2); string backend; u32 first_space, u32 spaces_total;
//   u32 tiers {u8 tier, i32 numa_node, u32 n, u64 x n (kTierCounters order)};
//   u32 clients {u32 client, i32 pid, u32 uid, string name, u64 quotas x2, Stat x2, u32 spaces,
//                u32 n, u64 x n (kClientCounters order)};
//   u32 spaces {u32 id, string name, u64 page_bytes, u32 page_count, u32 client, u32 n,
//               u64 x n (kSpaceCounters order)}.
// A decoder reads the counters it knows, skips any it does not (a newer daemon's), and leaves the
// ones a payload lacks at 0 (an older format-2 daemon's). Any format number >= 2 is read this way:
// a later format may only append counters. Format-1 payloads (daemons before this note) are still
// read (decode_stats_format1).
// Limitations: a membarctl from before format 2 cannot read a format-2 daemon (it reads the marker
// as an overlong string and says the payload is malformed).
namespace {

constexpr uint32_t kStatsFormatMarker = 0xFFFFFFFFu;
constexpr uint32_t kStatsFormat = 2;
constexpr uint32_t kMaxStatsCounters = 256;  // per entry, from any daemon

std::array<uint64_t*, 6> tier_counters(TierStats& t) {
  return {&t.frames_total, &t.frames_used, &t.frames_free, &t.frames_preparing, &t.frames_lost,
          &t.frames_on_request};
}
std::array<uint64_t*, 19> client_counters(ClientStats& c) {
  return {&c.bytes_gpu,      &c.bytes_host,       &c.bytes_both,        &c.bytes_none,      &c.bytes_host_to_gpu,
          &c.bytes_gpu_to_host, &c.prefetch_hits, &c.prefetch_misses,   &c.evictions,       &c.stall_ns,
          &c.channel_bytes,  &c.gpu_maps,         &c.gpu_unmaps,        &c.fence_waits,     &c.fence_wait_ns,
          &c.call_lock_wait_ns, &c.call_locked_ns, &c.call_enqueue_ns,  &c.call_deliver_ns};
}
std::array<uint64_t*, 8> space_counters(SpaceInfo& s) {
  return {&s.bytes_gpu,    &s.bytes_host,   &s.bytes_both,        &s.bytes_none,
          &s.bytes_dirty,  &s.bytes_pinned, &s.bytes_host_to_gpu, &s.bytes_gpu_to_host};
}

// Format 1 carried the first 4 tier, 19 client and 8 space counters of these lists, in place.
constexpr size_t kFormat1TierCounters = 4, kFormat1ClientCounters = 19, kFormat1SpaceCounters = 8;

// The fields before a client's or a space's counters, the same in both formats.
void read_client_prefix(Reader& r, ClientStats& c) {
  c.client = r.read<uint32_t>();
  c.pid = r.read<int32_t>();
  c.uid = r.read<uint32_t>();
  c.name = r.read_string(kMaxStatsString);
  c.gpu_quota_bytes = r.read<uint64_t>();
  c.host_quota_bytes = r.read<uint64_t>();
  c.gpu_frames = read_stat(r);
  c.host_frames = read_stat(r);
  c.spaces = r.read<uint32_t>();
}
void read_space_prefix(Reader& r, SpaceInfo& s) {
  s.id = r.read<uint32_t>();
  s.name = r.read_string(kMaxStatsString);
  s.page_bytes = r.read<uint64_t>();
  s.page_count = r.read<uint32_t>();
  s.client = r.read<uint32_t>();
}

template <size_t kCount>
void write_counters(Writer& w, const std::array<uint64_t*, kCount>& counters) {
  w.write<uint32_t>(static_cast<uint32_t>(kCount));
  for (const uint64_t* counter : counters) w.write<uint64_t>(*counter);
}

// Reads a counted array into `counters` (Note [Stats payload formats]); false when the count is
// out of bounds or the payload cannot hold it.
template <size_t kCount>
bool read_counters(Reader& r, const std::array<uint64_t*, kCount>& counters) {
  const uint32_t count = r.read<uint32_t>();
  if (!r.ok() || count > kMaxStatsCounters || !r.can_hold(count, sizeof(uint64_t))) return false;
  for (uint32_t i = 0; i < count; ++i) {
    const uint64_t value = r.read<uint64_t>();
    if (i < kCount) *counters[i] = value;
  }
  return r.ok();
}

Result<RuntimeStats> decode_stats_format1(std::span<const uint8_t> payload);

}  // namespace

std::vector<uint8_t> encode_stats(const RuntimeStats& stats) {
  Writer w;
  w.write<uint32_t>(kStatsFormatMarker);
  w.write<uint32_t>(kStatsFormat);
  w.write_string(stats.backend, kMaxStatsString);
  w.write<uint32_t>(stats.first_space);
  w.write<uint32_t>(stats.spaces_total);
  w.write<uint32_t>(static_cast<uint32_t>(stats.tiers.size()));
  for (TierStats tier : stats.tiers) {
    w.write<uint8_t>(static_cast<uint8_t>(tier.tier));
    w.write<int32_t>(tier.numa_node);
    write_counters(w, tier_counters(tier));
  }
  w.write<uint32_t>(static_cast<uint32_t>(stats.clients.size()));
  for (ClientStats c : stats.clients) {
    w.write<uint32_t>(c.client);
    w.write<int32_t>(c.pid);
    w.write<uint32_t>(c.uid);
    w.write_string(c.name, kMaxStatsString);
    w.write<uint64_t>(c.gpu_quota_bytes);
    w.write<uint64_t>(c.host_quota_bytes);
    write_stat(w, c.gpu_frames);
    write_stat(w, c.host_frames);
    w.write<uint32_t>(c.spaces);
    write_counters(w, client_counters(c));
  }
  w.write<uint32_t>(static_cast<uint32_t>(stats.spaces.size()));
  for (SpaceInfo s : stats.spaces) {
    w.write<uint32_t>(s.id);
    w.write_string(s.name, kMaxStatsString);
    w.write<uint64_t>(s.page_bytes);
    w.write<uint32_t>(s.page_count);
    w.write<uint32_t>(s.client);
    write_counters(w, space_counters(s));
  }
  return w.take();
}

Result<RuntimeStats> decode_stats(std::span<const uint8_t> payload) {
  Reader r(payload);
  if (r.read<uint32_t>() != kStatsFormatMarker) return decode_stats_format1(payload);
  const uint32_t format = r.read<uint32_t>();
  if (!r.ok() || format < 2) return invalid_argument("stats payload: unknown format " + std::to_string(format));
  RuntimeStats stats;
  stats.backend = r.read_string(kMaxStatsString);
  stats.first_space = r.read<uint32_t>();
  stats.spaces_total = r.read<uint32_t>();
  uint32_t tier_count = r.read<uint32_t>();
  if (!r.can_hold(tier_count, 1 + 4 + 4)) return invalid_argument("stats payload: tier count exceeds the payload");
  for (uint32_t i = 0; i < tier_count; ++i) {
    TierStats tier;
    uint8_t tier_number = r.read<uint8_t>();
    if (tier_number > static_cast<uint8_t>(Tier::kHost)) return invalid_argument("stats payload: unknown tier");
    tier.tier = static_cast<Tier>(tier_number);
    tier.numa_node = r.read<int32_t>();
    if (!read_counters(r, tier_counters(tier))) return invalid_argument("stats payload: tier entry malformed");
    stats.tiers.push_back(tier);
  }
  uint32_t client_count = r.read<uint32_t>();
  constexpr uint64_t kMinClientBytes = 4 + 4 + 4 + 4 + 16 + 2 * kStatBytes + 4 + 4;
  if (!r.can_hold(client_count, kMinClientBytes)) return invalid_argument("stats payload: client count exceeds the payload");
  for (uint32_t i = 0; i < client_count; ++i) {
    ClientStats c;
    read_client_prefix(r, c);
    if (!read_counters(r, client_counters(c))) return invalid_argument("stats payload: client entry malformed");
    stats.clients.push_back(std::move(c));
  }
  uint32_t space_count = r.read<uint32_t>();
  if (!r.can_hold(space_count, 4 + 4 + 8 + 4 + 4 + 4)) {
    return invalid_argument("stats payload: space count exceeds the payload");
  }
  for (uint32_t i = 0; i < space_count; ++i) {
    SpaceInfo s;
    read_space_prefix(r, s);
    if (!read_counters(r, space_counters(s))) return invalid_argument("stats payload: space entry malformed");
    stats.spaces.push_back(std::move(s));
  }
  if (!r.at_end()) return invalid_argument("stats payload is truncated or has trailing bytes");
  return stats;
}

namespace {

// Format 1 (daemons before Note [Stats payload formats]): string backend; u32 first_space, u32
// spaces_total; u32 tiers {u8 tier, u64 total, used, free, preparing}; u32 clients {u32 client,
// i32 pid, u32 uid, string name, u64 quotas x2, Stat x2, u32 spaces, u64 x19}; u32 spaces {u32 id,
// string name, u64 page_bytes, u32 page_count, u32 client, u64 x8}; then {i32 numa_node} per tier,
// {u64 frames_lost} per tier and {u64 frames_on_request} per tier, each absent from daemons older
// than it (read as -1 and 0).
Result<RuntimeStats> decode_stats_format1(std::span<const uint8_t> payload) {
  Reader r(payload);
  RuntimeStats stats;
  stats.backend = r.read_string(kMaxStatsString);
  stats.first_space = r.read<uint32_t>();
  stats.spaces_total = r.read<uint32_t>();
  uint32_t tier_count = r.read<uint32_t>();
  if (!r.can_hold(tier_count, 33)) return invalid_argument("stats payload: tier count exceeds the payload");
  for (uint32_t i = 0; i < tier_count; ++i) {
    TierStats tier;
    uint8_t tier_number = r.read<uint8_t>();
    if (tier_number > static_cast<uint8_t>(Tier::kHost)) return invalid_argument("stats payload: unknown tier");
    tier.tier = static_cast<Tier>(tier_number);
    for (size_t k = 0; k < kFormat1TierCounters; ++k) *tier_counters(tier)[k] = r.read<uint64_t>();
    stats.tiers.push_back(tier);
  }
  uint32_t client_count = r.read<uint32_t>();
  constexpr uint64_t kMinClientBytes = 4 + 4 + 4 + 4 + 16 + 2 * kStatBytes + 4 + kFormat1ClientCounters * 8;
  if (!r.can_hold(client_count, kMinClientBytes)) return invalid_argument("stats payload: client count exceeds the payload");
  for (uint32_t i = 0; i < client_count; ++i) {
    ClientStats c;
    read_client_prefix(r, c);
    for (size_t k = 0; k < kFormat1ClientCounters; ++k) *client_counters(c)[k] = r.read<uint64_t>();
    if (!r.ok()) return invalid_argument("stats payload: client entry truncated");
    stats.clients.push_back(std::move(c));
  }
  uint32_t space_count = r.read<uint32_t>();
  if (!r.can_hold(space_count, 4 + 4 + 8 + 4 + 4 + kFormat1SpaceCounters * 8)) {
    return invalid_argument("stats payload: space count exceeds the payload");
  }
  for (uint32_t i = 0; i < space_count; ++i) {
    SpaceInfo s;
    read_space_prefix(r, s);
    for (size_t k = 0; k < kFormat1SpaceCounters; ++k) *space_counters(s)[k] = r.read<uint64_t>();
    stats.spaces.push_back(std::move(s));
  }
  if (!r.ok()) return invalid_argument("stats payload: space entry truncated");
  if (!r.at_end()) {   // the tiers' NUMA nodes (an older daemon ends before them)
    for (TierStats& tier : stats.tiers) tier.numa_node = r.read<int32_t>();
  }
  if (r.ok() && !r.at_end()) {   // the tiers' lost frames (absent from daemons before 2026-12-02's eleventh session)
    for (TierStats& tier : stats.tiers) tier.frames_lost = r.read<uint64_t>();
  }
  if (r.ok() && !r.at_end()) {   // what the node's host pool would give (absent before the twelfth session)
    for (TierStats& tier : stats.tiers) tier.frames_on_request = r.read<uint64_t>();
  }
  if (!r.at_end()) return invalid_argument("stats payload is truncated or has trailing bytes");
  return stats;
}

}  // namespace

}  // namespace membar::protocol::v2
