// membar wire protocol, version 1: what a client and membard exchange.
//
// Two channels (see Note [Two channels] below):
//   - the control socket (Unix stream socket): framed messages, MessageHeaderV1 + payload, with
//     file descriptors passed beside some of them (SCM_RIGHTS);
//   - the per-client shared-memory segment: a request ring (client -> daemon), a completion ring
//     (daemon -> client) and one payload area each way for variable-sized data.
//
// Plain structs with fixed sizes and offsets, little-endian (every membar host is x86-64 or
// aarch64 little-endian). Like NCCL's net_vN.h: a breaking change gets a v2.h, never a silent
// edit of this file. Additions keep the version: new message types and opcodes are appended
// (numbers never reused, existing structs never change), and a peer that predates one answers it
// with INVALID_ARGUMENT ("unknown opcode"), a clear error rather than a misreading. Added since
// the first release: kChannelGrant; kCreateChannel, kOpenChannel, kCloseChannel; the
// kReleaseAfterMarker flag of kRelease. No CUDA, Boost or libuv here; the encode/decode/validate functions are
// implemented in libclient/protocol_v1.cpp, which depends on nothing but the standard library
// and membar/status.h, so it can be fuzzed on its own (fuzz/protocol_fuzzer.cpp).
//
// Note [Two channels]
// Rationale: a trainer's hot-path calls (acquire, release, prefetch ...) must not pay a socket
// round trip and a libuv wake-up; frames, on the other hand, are file descriptors and can only
// travel over a socket. Approach: every request travels over the shared-memory rings; the
// socket carries the handshake, frame grants and revocations (each with its fd), the shutdown
// notice, and the admin requests of membarctl. The daemon sends a grant before it posts the
// completion of the request that caused it, and AF_UNIX queues bytes in the receiver's buffer
// before sendmsg returns, so a client that drains its socket after reading a completion has
// every frame that completion refers to. Limitations: one outstanding request per client (the
// client library serialises calls), so the payload areas need no allocator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "membar/status.h"
#include "membar/types.h"

namespace membar::protocol::v1 {

// "MBR1" read as a little-endian 32-bit word.
inline constexpr uint32_t kMagic = 0x3152424Du;
inline constexpr uint16_t kVersion = 1;

// Longest client name (bytes, without the terminating NUL), longest space name, longest message.
inline constexpr uint32_t kNameBytes = 64;
inline constexpr uint32_t kMessageBytes = 192;
inline constexpr uint32_t kMaxSpaceNameBytes = 63;
// A socket message payload never exceeds this (stats replies are the largest).
inline constexpr uint32_t kMaxSocketPayloadBytes = 4u << 20;

// ---------------------------------------------------------------------------------------------
// Control socket.

enum class MessageType : uint16_t {
  kHello = 1,         // client -> daemon: HelloV1
  kHelloReply = 2,    // daemon -> client: HelloReplyV1 (+1 fd, the signal block, when ok)
  kAttached = 3,      // client -> daemon: empty; the client has mapped its segment
  kFrameGrant = 4,    // daemon -> client: FrameNoticeV1 (+1 fd, the frame)
  kFrameRevoke = 5,   // daemon -> client: FrameNoticeV1
  kShutdown = 6,      // daemon -> client: ShutdownV1
  kStatsRequest = 7,  // admin -> daemon: empty
  kStatsReply = 8,    // daemon -> admin: encoded RuntimeStats (encode_stats)
  kPing = 9,          // admin or client -> daemon: PingV1
  kPong = 10,         // daemon -> admin or client: PingV1 (same nonce)
  kError = 11,        // daemon -> peer: ErrorV1, then the daemon closes the connection
  kChannelGrant = 12, // daemon -> client: ChannelNoticeV1 (+1 fd, the channel's memory)
};
inline constexpr uint16_t kFirstMessageType = 1;
inline constexpr uint16_t kLastMessageType = 12;

struct MessageHeaderV1 {
  uint32_t magic;          // kMagic
  uint16_t version;        // kVersion
  uint16_t type;           // MessageType
  uint32_t payload_bytes;  // bytes that follow the header
  uint32_t fd_count;       // file descriptors sent beside this message (0 or 1)
};
static_assert(sizeof(MessageHeaderV1) == 16, "the header is read as 16 bytes before anything else");
static_assert(offsetof(MessageHeaderV1, version) == 4,
              "version sits at byte 4 in every protocol version, so a mismatch can be reported");

enum class Role : uint32_t {
  kClient = 0,  // a trainer: gets an engine client, a segment and frames
  kAdmin = 1,   // membarctl: socket requests only (stats, ping), owns nothing
};

struct HelloV1 {
  uint32_t role;              // Role
  uint32_t reserved;          // zero
  uint64_t gpu_quota_bytes;   // 0: the daemon's default
  uint64_t host_quota_bytes;  // 0: the daemon's default
  char client_name[kNameBytes];  // NUL-terminated, printable ASCII
};
static_assert(sizeof(HelloV1) == 88, "fixed wire size: 4 + 4 + 8 + 8 + 64");
static_assert(offsetof(HelloV1, client_name) == 24, "name follows the quotas");

enum class WireBackend : uint8_t { kHost = 1, kCuda = 2 };

struct HelloReplyV1 {
  int32_t status;               // StatusCode; the rest is meaningful only when OK
  uint32_t client_id;
  uint8_t backend;              // WireBackend
  uint8_t reserved[3];
  uint32_t ring_capacity;       // entries per ring, a power of two
  uint64_t segment_bytes;
  uint32_t gpu_window_frames;   // window sizes the client reserves (frames)
  uint32_t host_window_frames;
  uint32_t signal_words;        // 64-bit words in the signal block
  int32_t device;               // CUDA device ordinal of the daemon's GPU tier
  char segment_name[kNameBytes];  // Boost.Interprocess shared_memory_object name
  char message[kMessageBytes];    // why, when status is not OK
};
static_assert(sizeof(HelloReplyV1) == 40 + kNameBytes + kMessageBytes, "fixed wire size");
static_assert(offsetof(HelloReplyV1, status) == 0, "status first, readable whatever follows");
static_assert(offsetof(HelloReplyV1, segment_bytes) == 16, "8-byte field on an 8-byte boundary");

struct FrameNoticeV1 {
  uint32_t window_frame;
  uint8_t tier;            // membar::Tier
  uint8_t reserved[3];
};
static_assert(sizeof(FrameNoticeV1) == 8, "fixed wire size");

// A channel (runtimed/channels.h, Note [Channels]) the client created or opened; sent before
// the completion of the kCreateChannel / kOpenChannel request it answers.
inline constexpr uint32_t kChannelWritable = 1u << 0;
struct ChannelNoticeV1 {
  uint32_t channel;        // the daemon's channel id (the completion's value)
  uint32_t flags;          // kChannelWritable for the creator
  uint64_t bytes;
};
static_assert(sizeof(ChannelNoticeV1) == 16, "fixed wire size");

struct ShutdownV1 {
  char reason[kMessageBytes];
};
static_assert(sizeof(ShutdownV1) == kMessageBytes, "fixed wire size");

struct PingV1 {
  uint64_t nonce;
};
static_assert(sizeof(PingV1) == 8, "fixed wire size");

struct ErrorV1 {
  int32_t status;
  uint32_t reserved;
  char message[kMessageBytes];
};
static_assert(sizeof(ErrorV1) == 8 + kMessageBytes, "fixed wire size");

// ---------------------------------------------------------------------------------------------
// Shared-memory segment. Layout (offsets from the segment start, each 64-byte aligned):
//   SegmentHeaderV1 | request RingControlV1 | RequestV1[capacity]
//                   | completion RingControlV1 | CompletionV1[capacity]
//   | request payload area | response payload area
// The daemon never reads offsets or sizes back from the segment (the client can write it): it
// keeps its own copy of the layout and validates every index it reads.

inline constexpr uint32_t kDaemonRunning = 0;
inline constexpr uint32_t kDaemonShuttingDown = 1;

struct SegmentHeaderV1 {
  uint32_t magic;                   // kMagic
  uint16_t version;                 // kVersion
  uint16_t reserved0;
  uint32_t ring_capacity;
  uint32_t entry_bytes;             // 64
  uint64_t segment_bytes;
  uint64_t request_ring_offset;     // RingControlV1, then RequestV1[capacity]
  uint64_t completion_ring_offset;  // RingControlV1, then CompletionV1[capacity]
  uint64_t request_payload_offset;
  uint64_t request_payload_bytes;
  uint64_t response_payload_offset;
  uint64_t response_payload_bytes;
  uint8_t reserved1[56];
  // Second cache line: what the daemon tells a waiting client without a socket message.
  uint32_t daemon_state;            // kDaemonRunning / kDaemonShuttingDown (set before the
                                    // socket's shutdown notice)
  uint32_t completion_doorbell;     // futex word, bumped after completed_ticket advances
  uint64_t completed_ticket;        // every ticket <= this is done (engine's tickets_completed)
  uint32_t client_waiting;          // the client sleeps on completion_doorbell: wake it
  uint8_t reserved2[44];
};
static_assert(sizeof(SegmentHeaderV1) == 192, "header plus one cache line for daemon_state");
static_assert(offsetof(SegmentHeaderV1, daemon_state) == 128,
              "daemon-written words on their own cache line: the client polls them while it waits");
static_assert(offsetof(SegmentHeaderV1, completed_ticket) == 136, "8-byte atomic on an 8-byte boundary");

// One single-producer single-consumer ring's shared indices. head: entries pushed (producer),
// tail: entries popped (consumer); both only grow. Each on its own cache line so producer and
// consumer do not false-share. doorbell: a futex word bumped by the producer when the consumer
// said it sleeps (consumer_waiting = 1).
struct RingControlV1 {
  uint64_t head;
  uint8_t pad0[56];
  uint64_t tail;
  uint8_t pad1[56];
  uint32_t doorbell;
  uint32_t consumer_waiting;
  uint8_t pad2[56];
};
static_assert(sizeof(RingControlV1) == 192, "three cache lines");
static_assert(offsetof(RingControlV1, tail) == 64, "tail on its own cache line");
static_assert(offsetof(RingControlV1, doorbell) == 128, "doorbell on its own cache line");

enum class Opcode : uint16_t {
  kNop = 1,            // round trip only (latency benchmark, liveness)
  kCreateSpace = 2,    // payload: name; argument: page_bytes; page_count -> value: space id
  kDestroySpace = 3,   // space
  kAcquire = 4,        // range, flags: AcquireFlags -> ticket, payload: locations
  kRelease = 5,        // range, flags: kReleaseDirty, kReleaseAfterMarker (argument: marker)
  kPrefetch = 6,       // range -> ticket
  kOffload = 7,        // range -> ticket
  kFreePages = 8,      // range
  kAcquireHost = 9,    // range -> payload: locations (host window)
  kReleaseHost = 10,   // range, flags: kReleaseDirty
  kSetSchedule = 11,   // payload: schedule (encode_schedule)
  kAdvance = 12,       // argument: step
  kLocations = 13,     // range -> payload: locations (GPU window)
  kStats = 14,         // -> payload: encoded RuntimeStats of this client
  kCreateChannel = 15, // payload: name; argument: bytes -> value: channel id (+ kChannelGrant)
  kOpenChannel = 16,   // payload: name -> value: channel id (+ kChannelGrant, read-only)
  kCloseChannel = 17,  // argument: channel id (one this client created)
};
inline constexpr uint16_t kFirstOpcode = 1;
inline constexpr uint16_t kLastOpcode = 17;

inline constexpr uint32_t kReleaseDirty = 1u << 0;
// Stream-ordered release: the pages stay in use until the client's stream writes `argument`
// (>= 1) into its released signal word (Note [Stream-ordered release] in runtimed/engine/engine.cpp).
inline constexpr uint32_t kReleaseAfterMarker = 1u << 1;

struct RequestV1 {
  uint64_t sequence;       // per client, increasing; echoed in the completion
  uint16_t opcode;         // Opcode
  uint16_t reserved0;      // zero
  uint32_t flags;
  uint32_t space;
  uint32_t first_page;
  uint32_t page_count;
  uint32_t payload_bytes;  // bytes at the start of the request payload area
  uint64_t argument;
  uint64_t stall_ns;       // time the client waited for pages since its last request
  uint8_t reserved1[16];   // zero
};
static_assert(sizeof(RequestV1) == 64, "one cache line per ring entry");
static_assert(offsetof(RequestV1, argument) == 32, "8-byte field on an 8-byte boundary");

struct CompletionV1 {
  uint64_t sequence;       // the request's
  uint16_t opcode;         // the request's
  uint16_t reserved0;
  int32_t status;          // StatusCode; on error the response payload holds the message
  uint64_t ticket;
  uint64_t value;          // op-specific (space id)
  uint32_t payload_bytes;  // bytes at the start of the response payload area
  uint32_t reserved1;
  uint8_t reserved2[24];
};
static_assert(sizeof(CompletionV1) == 64, "one cache line per ring entry");
static_assert(offsetof(CompletionV1, ticket) == 16, "8-byte field on an 8-byte boundary");

// Segment geometry derived from the ring capacity and payload area sizes.
struct SegmentLayout {
  uint32_t ring_capacity = 0;
  uint64_t request_ring_offset = 0;
  uint64_t completion_ring_offset = 0;
  uint64_t request_payload_offset = 0;
  uint64_t request_payload_bytes = 0;
  uint64_t response_payload_offset = 0;
  uint64_t response_payload_bytes = 0;
  uint64_t segment_bytes = 0;
};
inline constexpr uint32_t kMaxRingCapacity = 1u << 16;
inline constexpr uint64_t kMaxPayloadAreaBytes = 64ull << 20;

// Checks: capacity a power of two in [2, kMaxRingCapacity], payload areas in [4 KiB, 64 MiB].
Result<SegmentLayout> make_segment_layout(uint32_t ring_capacity, uint64_t request_payload_bytes,
                                          uint64_t response_payload_bytes);
// Writes the header of a fresh (zeroed) segment.
void write_segment_header(void* segment, const SegmentLayout& layout);
// Reads and checks a header against the size actually mapped (the client's side).
Result<SegmentLayout> read_segment_header(const void* segment, uint64_t mapped_bytes);

// ---------------------------------------------------------------------------------------------
// Encoding and validation. Decoders never trust a length: every count is checked against the
// bytes present before anything is allocated.

// A whole socket message: header + payload.
std::vector<uint8_t> encode_message(MessageType type, std::span<const uint8_t> payload,
                                    uint32_t fd_count = 0);
// A fixed-size wire struct as the payload (containers go through the span overload).
template <typename T>
  requires std::is_trivially_copyable_v<T>
std::vector<uint8_t> encode_message(MessageType type, const T& payload, uint32_t fd_count = 0) {
  return encode_message(type, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(&payload),
                                                       sizeof(T)),
                        fd_count);
}

// Checks magic, version, type and the payload size the type allows. A version mismatch is
// FAILED_PRECONDITION naming both versions; anything else malformed is INVALID_ARGUMENT.
Result<MessageHeaderV1> decode_message_header(std::span<const uint8_t> bytes);

Result<HelloV1> decode_hello(std::span<const uint8_t> payload);
Result<HelloReplyV1> decode_hello_reply(std::span<const uint8_t> payload);
Result<FrameNoticeV1> decode_frame_notice(std::span<const uint8_t> payload);
Result<ChannelNoticeV1> decode_channel_notice(std::span<const uint8_t> payload);
Result<ShutdownV1> decode_shutdown(std::span<const uint8_t> payload);
Result<PingV1> decode_ping(std::span<const uint8_t> payload);
Result<ErrorV1> decode_error(std::span<const uint8_t> payload);

// Copies `text` into a fixed char field, truncating, always NUL-terminated.
void copy_text(char* field, size_t field_bytes, std::string_view text);
// Reads a fixed char field that must hold a NUL within its bytes.
Result<std::string> read_text(const char* field, size_t field_bytes);

// Checks every field of a request that does not need the engine: opcode, reserved bytes, flags,
// page range arithmetic, payload size for the opcode.
Status validate_request(const RequestV1& request, uint64_t request_payload_capacity);
// Checks a completion the client reads (sequence matching is the caller's).
Status validate_completion(const CompletionV1& completion, uint64_t response_payload_capacity);

// Space names: 1..63 bytes of printable ASCII.
Status validate_space_name(std::string_view name);

// Schedule payload: u32 step count, then per step u32 range count and that many
// {u32 space, u32 first_page, u32 page_count}.
std::vector<uint8_t> encode_schedule(const std::vector<ScheduleStep>& steps);
Result<std::vector<ScheduleStep>> decode_schedule(std::span<const uint8_t> payload);

// Locations payload: u32 count, then count {u32 window_frame, u32 slot}.
std::vector<uint8_t> encode_locations(const std::vector<PageLocation>& locations);
Result<std::vector<PageLocation>> decode_locations(std::span<const uint8_t> payload,
                                                   uint32_t expected_count);

// Stats payload: see protocol_v1.cpp (length-prefixed strings, counted arrays).
std::vector<uint8_t> encode_stats(const RuntimeStats& stats);
Result<RuntimeStats> decode_stats(std::span<const uint8_t> payload);

std::string_view opcode_name(uint16_t opcode);

}  // namespace membar::protocol::v1
