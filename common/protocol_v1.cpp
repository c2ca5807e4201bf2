// Encoding, decoding and validation of protocol v1 (include/membar/protocol/v1.h). Depends only
// on the standard library and membar/status.h so that fuzz/protocol_fuzzer.cpp can build it alone.
#include "membar/protocol/v1.h"

#include <cstring>
#include <limits>

#include "membar/client.h"

namespace membar::protocol::v1 {
namespace {

constexpr uint64_t align_up(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

bool is_power_of_two(uint64_t value) { return value != 0 && (value & (value - 1)) == 0; }

// The largest payload each socket message type may carry.
uint32_t max_payload_bytes(MessageType type) {
  switch (type) {
    case MessageType::kHello: return sizeof(HelloV1);
    case MessageType::kHelloReply: return sizeof(HelloReplyV1);
    case MessageType::kAttached: return 0;
    case MessageType::kFrameGrant: return sizeof(FrameNoticeV1);
    case MessageType::kFrameRevoke: return sizeof(FrameNoticeV1);
    case MessageType::kShutdown: return sizeof(ShutdownV1);
    case MessageType::kStatsRequest: return 0;
    case MessageType::kStatsReply: return kMaxSocketPayloadBytes;
    case MessageType::kPing: return sizeof(PingV1);
    case MessageType::kPong: return sizeof(PingV1);
    case MessageType::kError: return sizeof(ErrorV1);
    case MessageType::kChannelGrant: return sizeof(ChannelNoticeV1);
  }
  return 0;
}

// Messages whose size is fixed must carry exactly that size.
bool payload_size_is_fixed(MessageType type) { return type != MessageType::kStatsReply; }

uint32_t expected_fd_count(MessageType type) {
  return type == MessageType::kFrameGrant || type == MessageType::kChannelGrant ? 1 : 0;
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

// Opcodes that name a page range.
bool opcode_takes_range(Opcode op) {
  switch (op) {
    case Opcode::kAcquire: case Opcode::kRelease: case Opcode::kPrefetch: case Opcode::kOffload:
    case Opcode::kFreePages: case Opcode::kAcquireHost: case Opcode::kReleaseHost:
    case Opcode::kLocations:
      return true;
    default:
      return false;
  }
}

uint32_t allowed_flags(Opcode op) {
  switch (op) {
    case Opcode::kAcquire: return kAcquireWrite | kAcquireZeroNew;
    case Opcode::kRelease: return kReleaseDirty | kReleaseAfterMarker;
    case Opcode::kReleaseHost: return kReleaseDirty;
    default: return 0;
  }
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
  layout.request_ring_offset = sizeof(SegmentHeaderV1);
  layout.completion_ring_offset =
      layout.request_ring_offset + sizeof(RingControlV1) + uint64_t{ring_capacity} * sizeof(RequestV1);
  layout.request_payload_offset = align_up(
      layout.completion_ring_offset + sizeof(RingControlV1) + uint64_t{ring_capacity} * sizeof(CompletionV1),
      4096);
  layout.request_payload_bytes = align_up(request_payload_bytes, 64);
  layout.response_payload_offset = align_up(layout.request_payload_offset + layout.request_payload_bytes, 4096);
  layout.response_payload_bytes = align_up(response_payload_bytes, 64);
  layout.segment_bytes = align_up(layout.response_payload_offset + layout.response_payload_bytes, 4096);
  return layout;
}

void write_segment_header(void* segment, const SegmentLayout& layout) {
  SegmentHeaderV1 header{};
  header.magic = kMagic;
  header.version = kVersion;
  header.ring_capacity = layout.ring_capacity;
  header.entry_bytes = sizeof(RequestV1);
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
  if (mapped_bytes < sizeof(SegmentHeaderV1)) {
    return invalid_argument("segment of " + std::to_string(mapped_bytes) + " bytes is smaller than its header");
  }
  SegmentHeaderV1 header;
  std::memcpy(&header, segment, sizeof(header));
  if (header.magic != kMagic) return invalid_argument("segment header has a bad magic number");
  if (header.version != kVersion) {
    return failed_precondition("segment is protocol version " + std::to_string(header.version) +
                               ", this client speaks " + std::to_string(kVersion));
  }
  if (header.entry_bytes != sizeof(RequestV1)) return invalid_argument("segment ring entries have the wrong size");
  // Recompute the layout from the sizes and require the offsets to match exactly.
  MEMBAR_ASSIGN_OR_RETURN(SegmentLayout layout,
                          make_segment_layout(header.ring_capacity, header.request_payload_bytes,
                                              header.response_payload_bytes));
  if (layout.segment_bytes != header.segment_bytes || layout.request_ring_offset != header.request_ring_offset ||
      layout.completion_ring_offset != header.completion_ring_offset ||
      layout.request_payload_offset != header.request_payload_offset ||
      layout.response_payload_offset != header.response_payload_offset) {
    return invalid_argument("segment header offsets do not match protocol v1's layout");
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
  MessageHeaderV1 header{kMagic, kVersion, static_cast<uint16_t>(type),
                         static_cast<uint32_t>(payload.size()), fd_count};
  std::vector<uint8_t> out(sizeof(header) + payload.size());
  std::memcpy(out.data(), &header, sizeof(header));
  if (!payload.empty()) std::memcpy(out.data() + sizeof(header), payload.data(), payload.size());
  return out;
}

Result<MessageHeaderV1> decode_message_header(std::span<const uint8_t> bytes) {
  if (bytes.size() < sizeof(MessageHeaderV1)) {
    return invalid_argument("message header truncated: " + std::to_string(bytes.size()) + " of 16 bytes");
  }
  MessageHeaderV1 header;
  std::memcpy(&header, bytes.data(), sizeof(header));
  if (header.magic != kMagic) return invalid_argument("bad magic number: not a membar protocol message");
  if (header.version != kVersion) {
    return failed_precondition("protocol version mismatch: peer speaks version " +
                               std::to_string(header.version) + ", this side speaks version " +
                               std::to_string(kVersion));
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
  if (header.fd_count != expected_fd_count(type) &&
      !(type == MessageType::kHelloReply && header.fd_count <= 1)) {
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

Result<HelloV1> decode_hello(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(HelloV1 hello, decode_fixed<HelloV1>(payload, "hello"));
  if (hello.role != static_cast<uint32_t>(Role::kClient) && hello.role != static_cast<uint32_t>(Role::kAdmin)) {
    return invalid_argument("hello names unknown role " + std::to_string(hello.role));
  }
  if (hello.reserved != 0) return invalid_argument("hello reserved field is not zero");
  if (!text_has_nul(hello.client_name, sizeof(hello.client_name))) {
    return invalid_argument("hello client name is not NUL-terminated within 64 bytes");
  }
  for (const char* c = hello.client_name; *c != 0; ++c) {
    if (*c < 0x20 || *c > 0x7e) return invalid_argument("hello client name has a non-printable byte");
  }
  return hello;
}

Result<HelloReplyV1> decode_hello_reply(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(HelloReplyV1 reply, decode_fixed<HelloReplyV1>(payload, "hello reply"));
  if (!status_code_is_known(reply.status)) {
    return invalid_argument("hello reply has unknown status " + std::to_string(reply.status));
  }
  if (!text_has_nul(reply.segment_name, sizeof(reply.segment_name)) ||
      !text_has_nul(reply.message, sizeof(reply.message))) {
    return invalid_argument("hello reply text is not NUL-terminated");
  }
  if (reply.status == static_cast<int32_t>(StatusCode::OK)) {
    if (reply.backend != static_cast<uint8_t>(WireBackend::kHost) &&
        reply.backend != static_cast<uint8_t>(WireBackend::kCuda)) {
      return invalid_argument("hello reply names unknown backend " + std::to_string(reply.backend));
    }
    if (reply.gpu_window_frames > (1u << 24) || reply.host_window_frames > (1u << 24)) {
      return invalid_argument("hello reply window sizes exceed 2^24 frames");
    }
  }
  return reply;
}

Result<FrameNoticeV1> decode_frame_notice(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(FrameNoticeV1 notice, decode_fixed<FrameNoticeV1>(payload, "frame notice"));
  if (notice.tier != static_cast<uint8_t>(Tier::kGpu) && notice.tier != static_cast<uint8_t>(Tier::kHost)) {
    return invalid_argument("frame notice names unknown tier " + std::to_string(notice.tier));
  }
  if (notice.window_frame == kNoFrame) return invalid_argument("frame notice names no frame");
  return notice;
}

Result<ChannelNoticeV1> decode_channel_notice(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(ChannelNoticeV1 notice, decode_fixed<ChannelNoticeV1>(payload, "channel notice"));
  if ((notice.flags & ~kChannelWritable) != 0) {
    return invalid_argument("channel notice has unknown flags " + std::to_string(notice.flags));
  }
  if (notice.channel == 0 || notice.bytes == 0 || notice.bytes > (64ull << 30)) {
    return invalid_argument("channel notice names channel " + std::to_string(notice.channel) + " of " +
                            std::to_string(notice.bytes) + " bytes");
  }
  return notice;
}

Result<ShutdownV1> decode_shutdown(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(ShutdownV1 shutdown, decode_fixed<ShutdownV1>(payload, "shutdown"));
  if (!text_has_nul(shutdown.reason, sizeof(shutdown.reason))) {
    return invalid_argument("shutdown reason is not NUL-terminated");
  }
  return shutdown;
}

Result<PingV1> decode_ping(std::span<const uint8_t> payload) { return decode_fixed<PingV1>(payload, "ping"); }

Result<ErrorV1> decode_error(std::span<const uint8_t> payload) {
  MEMBAR_ASSIGN_OR_RETURN(ErrorV1 error, decode_fixed<ErrorV1>(payload, "error"));
  if (!status_code_is_known(error.status) || error.status == 0) {
    return invalid_argument("error message has status " + std::to_string(error.status));
  }
  if (!text_has_nul(error.message, sizeof(error.message))) return invalid_argument("error text is not NUL-terminated");
  return error;
}

// ---------------------------------------------------------------------------------------------
// Ring entries.

Status validate_space_name(std::string_view name) {
  if (name.empty() || name.size() > kMaxSpaceNameBytes) {
    return invalid_argument("space name must be 1.." + std::to_string(kMaxSpaceNameBytes) + " bytes, got " +
                            std::to_string(name.size()));
  }
  for (char c : name) {
    if (c < 0x21 || c > 0x7e) return invalid_argument("space name has a byte that is not printable ASCII");
  }
  return Status::Ok();
}

Status validate_request(const RequestV1& request, uint64_t request_payload_capacity) {
  if (request.opcode < kFirstOpcode || request.opcode > kLastOpcode) {
    return invalid_argument("unknown opcode " + std::to_string(request.opcode));
  }
  auto op = static_cast<Opcode>(request.opcode);
  std::string name(opcode_name(request.opcode));
  if (request.reserved0 != 0 || !all_zero(request.reserved1, sizeof(request.reserved1))) {
    return invalid_argument(name + ": reserved bytes are not zero");
  }
  if ((request.flags & ~allowed_flags(op)) != 0) {
    return invalid_argument(name + ": unknown flags 0x" + std::to_string(request.flags & ~allowed_flags(op)));
  }
  if (request.payload_bytes > request_payload_capacity) {
    return invalid_argument(name + ": payload of " + std::to_string(request.payload_bytes) +
                            " bytes exceeds the payload area (" + std::to_string(request_payload_capacity) + ")");
  }
  bool takes_payload = op == Opcode::kCreateSpace || op == Opcode::kSetSchedule ||
                       op == Opcode::kCreateChannel || op == Opcode::kOpenChannel;
  if (!takes_payload && request.payload_bytes != 0) {
    return invalid_argument(name + ": takes no payload but announces " + std::to_string(request.payload_bytes) + " bytes");
  }
  if (opcode_takes_range(op)) {
    if (request.page_count == 0) return invalid_argument(name + ": page range is empty");
    if (uint64_t{request.first_page} + request.page_count > std::numeric_limits<uint32_t>::max()) {
      return out_of_range(name + ": page range [" + std::to_string(request.first_page) + ", +" +
                          std::to_string(request.page_count) + ") overflows 32-bit page indices");
    }
    bool after_marker = op == Opcode::kRelease && (request.flags & kReleaseAfterMarker) != 0;
    if (after_marker && request.argument == 0) return invalid_argument(name + ": the release marker must be at least 1");
    if (!after_marker && request.argument != 0) return invalid_argument(name + ": argument must be zero");
  } else {
    // Fields an opcode does not use must be zero, so that no request means two things.
    if (request.first_page != 0 || (op != Opcode::kCreateSpace && request.page_count != 0)) {
      return invalid_argument(name + ": takes no page range but names one");
    }
    if (request.space != 0 && op != Opcode::kDestroySpace) {
      return invalid_argument(name + ": takes no space but names space " + std::to_string(request.space));
    }
  }
  switch (op) {
    case Opcode::kCreateSpace:
      if (request.page_count == 0) return invalid_argument("create_space: page count must be at least 1");
      if (request.argument < kMinPageBytes || request.argument > kMaxPageBytes || !is_power_of_two(request.argument)) {
        return invalid_argument("create_space: page size " + std::to_string(request.argument) +
                                " is not a power of two in [64 KiB, 2 MiB]");
      }
      if (request.payload_bytes == 0 || request.payload_bytes > kMaxSpaceNameBytes) {
        return invalid_argument("create_space: name must be 1.." + std::to_string(kMaxSpaceNameBytes) + " bytes");
      }
      break;
    case Opcode::kAdvance:
      if (request.argument > std::numeric_limits<uint32_t>::max()) {
        return out_of_range("advance: step " + std::to_string(request.argument) + " exceeds 32 bits");
      }
      break;
    case Opcode::kSetSchedule:
      if (request.payload_bytes < sizeof(uint32_t)) return invalid_argument("set_schedule: payload truncated");
      break;
    case Opcode::kNop: case Opcode::kDestroySpace: case Opcode::kStats:
      if (request.argument != 0) return invalid_argument(name + ": argument must be zero");
      break;
    case Opcode::kCreateChannel:
    case Opcode::kOpenChannel:
      if (request.payload_bytes == 0 || request.payload_bytes > kMaxSpaceNameBytes) {
        return invalid_argument(name + ": name must be 1.." + std::to_string(kMaxSpaceNameBytes) + " bytes");
      }
      if (op == Opcode::kCreateChannel && (request.argument == 0 || request.argument > (64ull << 30))) {
        return invalid_argument("create_channel: size " + std::to_string(request.argument) + " is not in [1, 64 GiB]");
      }
      if (op == Opcode::kOpenChannel && request.argument != 0) return invalid_argument(name + ": argument must be zero");
      break;
    case Opcode::kCloseChannel:
      if (request.argument == 0 || request.argument > std::numeric_limits<uint32_t>::max()) {
        return invalid_argument("close_channel: channel id " + std::to_string(request.argument) + " is not valid");
      }
      break;
    default:
      break;
  }
  return Status::Ok();
}

Status validate_completion(const CompletionV1& completion, uint64_t response_payload_capacity) {
  if (!status_code_is_known(completion.status)) {
    return invalid_argument("completion has unknown status " + std::to_string(completion.status));
  }
  if (completion.payload_bytes > response_payload_capacity) {
    return invalid_argument("completion payload exceeds the response area");
  }
  return Status::Ok();
}

std::string_view opcode_name(uint16_t opcode) {
  switch (static_cast<Opcode>(opcode)) {
    case Opcode::kNop: return "nop";
    case Opcode::kCreateSpace: return "create_space";
    case Opcode::kDestroySpace: return "destroy_space";
    case Opcode::kAcquire: return "acquire";
    case Opcode::kRelease: return "release";
    case Opcode::kPrefetch: return "prefetch";
    case Opcode::kOffload: return "offload";
    case Opcode::kFreePages: return "free_pages";
    case Opcode::kAcquireHost: return "acquire_host";
    case Opcode::kReleaseHost: return "release_host";
    case Opcode::kSetSchedule: return "set_schedule";
    case Opcode::kAdvance: return "advance";
    case Opcode::kLocations: return "locations";
    case Opcode::kStats: return "stats";
    case Opcode::kCreateChannel: return "create_channel";
    case Opcode::kOpenChannel: return "open_channel";
    case Opcode::kCloseChannel: return "close_channel";
  }
  return "unknown_opcode";
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

std::vector<uint8_t> encode_locations(const std::vector<PageLocation>& locations) {
  Writer w;
  w.write<uint32_t>(static_cast<uint32_t>(locations.size()));
  for (const PageLocation& location : locations) {
    w.write<uint32_t>(location.window_frame);
    w.write<uint32_t>(location.slot);
  }
  return w.take();
}

Result<std::vector<PageLocation>> decode_locations(std::span<const uint8_t> payload, uint32_t expected_count) {
  Reader r(payload);
  uint32_t count = r.read<uint32_t>();
  if (!r.ok() || count != expected_count) {
    return invalid_argument("locations payload holds " + std::to_string(count) + " entries, expected " +
                            std::to_string(expected_count));
  }
  if (!r.can_hold(count, 2 * sizeof(uint32_t))) return invalid_argument("locations payload truncated");
  std::vector<PageLocation> locations(count);
  for (PageLocation& location : locations) {
    location.window_frame = r.read<uint32_t>();
    location.slot = r.read<uint32_t>();
  }
  if (!r.at_end()) return invalid_argument("locations payload has trailing bytes");
  return locations;
}

// Stats: string backend; u32 tiers {u8 tier, u64 total, used, free};
// u32 clients {u32 client, i32 pid, string name, u64 quotas x2, Stat x2, u64 x9};
// u32 spaces {u32 id, string name, u64 page_bytes, u32 page_count}.
std::vector<uint8_t> encode_stats(const RuntimeStats& stats) {
  Writer w;
  w.write_string(stats.backend, kMaxStatsString);
  w.write<uint32_t>(static_cast<uint32_t>(stats.tiers.size()));
  for (const TierStats& tier : stats.tiers) {
    w.write<uint8_t>(static_cast<uint8_t>(tier.tier));
    w.write<uint64_t>(tier.frames_total);
    w.write<uint64_t>(tier.frames_used);
    w.write<uint64_t>(tier.frames_free);
  }
  w.write<uint32_t>(static_cast<uint32_t>(stats.clients.size()));
  for (const ClientStats& c : stats.clients) {
    w.write<uint32_t>(c.client);
    w.write<int32_t>(c.pid);
    w.write_string(c.name, kMaxStatsString);
    w.write<uint64_t>(c.gpu_quota_bytes);
    w.write<uint64_t>(c.host_quota_bytes);
    write_stat(w, c.gpu_frames);
    write_stat(w, c.host_frames);
    for (uint64_t v : {c.pages_gpu, c.pages_host, c.pages_both, c.pages_none, c.bytes_host_to_gpu,
                       c.bytes_gpu_to_host, c.prefetch_hits, c.prefetch_misses, c.evictions, c.stall_ns}) {
      w.write<uint64_t>(v);
    }
  }
  w.write<uint32_t>(static_cast<uint32_t>(stats.spaces.size()));
  for (const SpaceInfo& s : stats.spaces) {
    w.write<uint32_t>(s.id);
    w.write_string(s.name, kMaxStatsString);
    w.write<uint64_t>(s.page_bytes);
    w.write<uint32_t>(s.page_count);
  }
  // Appended later (per-space residency): one record per space, in the same order. Decoders
  // accept payloads without it (all zeros).
  w.write<uint32_t>(static_cast<uint32_t>(stats.spaces.size()));
  for (const SpaceInfo& s : stats.spaces) {
    w.write<uint32_t>(s.client);
    for (uint64_t v : {s.pages_gpu, s.pages_host, s.pages_both, s.pages_none, s.pages_dirty, s.pages_pinned}) {
      w.write<uint64_t>(v);
    }
  }
  return w.take();
}

Result<RuntimeStats> decode_stats(std::span<const uint8_t> payload) {
  Reader r(payload);
  RuntimeStats stats;
  stats.backend = r.read_string(kMaxStatsString);
  uint32_t tier_count = r.read<uint32_t>();
  if (!r.can_hold(tier_count, 25)) return invalid_argument("stats payload: tier count exceeds the payload");
  for (uint32_t i = 0; i < tier_count; ++i) {
    TierStats tier;
    uint8_t tier_number = r.read<uint8_t>();
    if (tier_number > static_cast<uint8_t>(Tier::kHost)) return invalid_argument("stats payload: unknown tier");
    tier.tier = static_cast<Tier>(tier_number);
    tier.frames_total = r.read<uint64_t>();
    tier.frames_used = r.read<uint64_t>();
    tier.frames_free = r.read<uint64_t>();
    stats.tiers.push_back(tier);
  }
  uint32_t client_count = r.read<uint32_t>();
  constexpr uint64_t kMinClientBytes = 4 + 4 + 4 + 16 + 2 * kStatBytes + 10 * 8;
  if (!r.can_hold(client_count, kMinClientBytes)) return invalid_argument("stats payload: client count exceeds the payload");
  for (uint32_t i = 0; i < client_count; ++i) {
    ClientStats c;
    c.client = r.read<uint32_t>();
    c.pid = r.read<int32_t>();
    c.name = r.read_string(kMaxStatsString);
    c.gpu_quota_bytes = r.read<uint64_t>();
    c.host_quota_bytes = r.read<uint64_t>();
    c.gpu_frames = read_stat(r);
    c.host_frames = read_stat(r);
    for (uint64_t* v : {&c.pages_gpu, &c.pages_host, &c.pages_both, &c.pages_none, &c.bytes_host_to_gpu,
                        &c.bytes_gpu_to_host, &c.prefetch_hits, &c.prefetch_misses, &c.evictions, &c.stall_ns}) {
      *v = r.read<uint64_t>();
    }
    if (!r.ok()) return invalid_argument("stats payload: client entry truncated");
    stats.clients.push_back(std::move(c));
  }
  uint32_t space_count = r.read<uint32_t>();
  if (!r.can_hold(space_count, 4 + 4 + 8 + 4)) return invalid_argument("stats payload: space count exceeds the payload");
  for (uint32_t i = 0; i < space_count; ++i) {
    SpaceInfo s;
    s.id = r.read<uint32_t>();
    s.name = r.read_string(kMaxStatsString);
    s.page_bytes = r.read<uint64_t>();
    s.page_count = r.read<uint32_t>();
    stats.spaces.push_back(std::move(s));
  }
  if (r.ok() && !r.at_end()) {
    uint32_t detail_count = r.read<uint32_t>();
    if (!r.ok() || detail_count != space_count) {
      return invalid_argument("stats payload: space residency records do not match the spaces");
    }
    for (SpaceInfo& s : stats.spaces) {
      s.client = r.read<uint32_t>();
      for (uint64_t* v : {&s.pages_gpu, &s.pages_host, &s.pages_both, &s.pages_none, &s.pages_dirty, &s.pages_pinned}) {
        *v = r.read<uint64_t>();
      }
    }
  }
  if (!r.at_end()) return invalid_argument("stats payload is truncated or has trailing bytes");
  return stats;
}

}  // namespace membar::protocol::v1
