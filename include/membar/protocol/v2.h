// membar wire protocol, version 2: what membard and its clients say to each other.
//
// Two channels (see Note [Two channels] below):
//   - the control socket (Unix stream socket): framed messages, MessageHeaderV2 + payload, with
//     file descriptors passed beside some of them (SCM_RIGHTS);
//   - the per-client shared-memory segment (a memfd the daemon passes in its hello reply, never a
//     name): a request ring (client -> daemon), a completion ring (daemon -> client) and one
//     payload area each way for variable-sized data.
//
// Plain structs with fixed sizes and offsets, little-endian (every membar host is x86-64 or
// aarch64 little-endian). Like NCCL's net_vN.h: a breaking change gets a new version, never a
// silent edit of this file. Additions keep the version: new message types and opcodes are
// appended (numbers never reused, existing structs never change), and a peer that predates one
// answers it with INVALID_ARGUMENT ("unknown opcode"), a clear error rather than a misreading.
// Version 2 replaced version 1 when pages moved to a per-space virtual layout (Note [Space
// layout] in engine/engine.cpp): frame events name the space position a frame maps at, the
// segment travels as a descriptor, and every event carries a sequence number.
// No CUDA, Boost or libuv here; the encode/decode/validate functions are implemented in
// common/protocol.cpp, which depends on nothing but the standard library and membar/status.h,
// so it can be fuzzed on its own (fuzz/protocol_fuzzer.cpp).
//
// Note [Two channels]
// Rationale: a trainer's hot-path calls (acquire, release, prefetch ...) must not pay a socket
// round trip and a libuv wake-up; frames, on the other hand, are file descriptors and can only
// travel over a socket. And the daemon must never block on a client that stops reading.
// Approach: every request travels over the shared-memory rings; the socket carries the
// handshake, the frame events (grants and revocations with their descriptors, and where each
// frame maps), the shutdown notice, and the admin requests of membarctl. Each event the daemon
// queues for a client carries the next number of that client's event sequence, and every
// completion carries `events_through`, the last sequence number queued before it: after reading
// a completion, the client applies socket messages until it has applied that one, so it never
// uses a page whose frame it has not mapped. The daemon writes the socket without blocking, from
// a bounded queue per client (runtimed/daemon/session.h). Limitations: one outstanding request
// per client (the client library serialises calls), so the payload areas need no allocator.
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

namespace membar::protocol::v2 {

// "MBR1" read as a little-endian 32-bit word (the magic names the family, not the version).
inline constexpr uint32_t kMagic = 0x3152424Du;
inline constexpr uint16_t kVersion = 2;

// Longest client name (bytes, without the terminating NUL), longest space name, longest message.
inline constexpr uint32_t kNameBytes = 64;
inline constexpr uint32_t kMessageBytes = 192;
inline constexpr uint32_t kMaxSpaceNameBytes = 63;
// A socket message payload never exceeds this (stats replies are the largest).
inline constexpr uint32_t kMaxSocketPayloadBytes = 4u << 20;
// File descriptors beside one message, at most (the hello reply's signal block and segment).
inline constexpr uint32_t kMaxMessageFds = 2;

// ---------------------------------------------------------------------------------------------
// Control socket.

enum class MessageType : uint16_t {
  kHello = 1,          // client -> daemon: HelloV2
  kHelloReply = 2,     // daemon -> client: HelloReplyV2 (+2 fds when OK: signal block, segment)
  kFrameGrant = 3,     // daemon -> client: FrameGrantV2 (+1 fd: one GPU frame)
  kFrameRevoke = 4,    // daemon -> client: FrameEventV2 (unmap it everywhere, drop it)
  kSlabGrant = 5,      // daemon -> client: SlabGrantV2 (+1 fd: one host slab of frames)
  kSlabRevoke = 6,     // daemon -> client: SlabEventV2 (its frames are already unmapped)
  kFrameMap = 7,       // daemon -> client: FrameMapV2 (map a frame at a space position)
  kFrameUnmap = 8,     // daemon -> client: FrameMapV2 (unmap that space position)
  kShutdown = 9,       // daemon -> client: ShutdownV2
  kStatsRequest = 10,  // admin -> daemon: StatsRequestV2
  kStatsReply = 11,    // daemon -> admin: encoded RuntimeStats (encode_stats)
  kPing = 12,          // admin or client -> daemon: PingV2
  kPong = 13,          // daemon -> admin or client: PingV2 (same nonce)
  kError = 14,         // daemon -> peer: ErrorV2, then the daemon closes the connection
  kChannelGrant = 15,  // daemon -> client: ChannelNoticeV2 (+1 fd, the channel's memory)
};
inline constexpr uint16_t kFirstMessageType = 1;
inline constexpr uint16_t kLastMessageType = 15;

struct MessageHeaderV2 {
  uint32_t magic;          // kMagic
  uint16_t version;        // kVersion
  uint16_t type;           // MessageType
  uint32_t payload_bytes;  // bytes that follow the header
  uint32_t fd_count;       // file descriptors sent beside this message
};
static_assert(sizeof(MessageHeaderV2) == 16, "the header is read as 16 bytes before anything else");
static_assert(offsetof(MessageHeaderV2, version) == 4,
              "version sits at byte 4 in every protocol version, so a mismatch can be reported");

enum class Role : uint32_t {
  kClient = 0,  // a trainer: gets an engine client, a segment and frames
  kAdmin = 1,   // membarctl: socket requests only (stats, ping), owns nothing
};

// Note [Devices of one daemon]
// One membard may serve several GPUs of its node (`membard --devices 0,1,3`): one engine and one
// pool per device, each independent (frames, quotas, eviction), behind one socket. A peer names
// the device it works on in its hello: `device_plus_one` = CUDA ordinal + 1, and 0 means the
// daemon's first device, so a peer that predates this field (it sent zero) keeps working. A
// device the daemon does not serve is answered by a hello reply with status NOT_FOUND and the
// sentence "this membard serves devices 0, 1; not 2", then the connection is closed. Everything
// on a connection concerns its device: a trainer's frames, and an admin's stats replies (membarctl
// opens one admin connection per device). The reply's `device` is the device served, and
// `device_mask` lists every device of the daemon (bit d: CUDA device d), so an admin learns
// where to look; a daemon that predates the mask sends 0 (read it as "only `device`"). Ordinals
// are at most kMaxDevices - 1. Client ids are unique across the daemon's devices.
inline constexpr uint32_t kMaxDevices = 32;

struct HelloV2 {
  uint32_t role;              // Role
  uint32_t device_plus_one;   // CUDA device + 1; 0: the daemon's first (Note [Devices of one daemon])
  uint64_t gpu_quota_bytes;   // 0: the daemon's default
  uint64_t host_quota_bytes;  // 0: the daemon's default
  char client_name[kNameBytes];  // NUL-terminated, printable ASCII
};
static_assert(sizeof(HelloV2) == 88, "fixed wire size: 4 + 4 + 8 + 8 + 64");
static_assert(offsetof(HelloV2, client_name) == 24, "name follows the quotas");

enum class WireBackend : uint8_t { kHost = 1, kCuda = 2 };

struct HelloReplyV2 {
  int32_t status;               // StatusCode; the rest is meaningful only when OK
  uint32_t client_id;
  uint8_t backend;              // WireBackend
  uint8_t reserved[3];
  uint32_t ring_capacity;       // entries per ring, a power of two
  uint64_t segment_bytes;       // size of the segment memfd (second descriptor)
  uint32_t gpu_quota_frames;    // GPU window frames are numbered below this
  uint32_t host_quota_frames;
  uint32_t host_slab_frames;    // host window frame w lies in slab w / host_slab_frames
  uint32_t signal_words;        // 64-bit words in the signal block (first descriptor)
  int32_t device;               // CUDA device ordinal of this connection's GPU tier
  uint32_t device_mask;         // bit d: the daemon serves device d (0 from an older daemon)
  char message[kMessageBytes];  // why, when status is not OK
};
static_assert(sizeof(HelloReplyV2) == 48 + kMessageBytes, "fixed wire size");
static_assert(offsetof(HelloReplyV2, status) == 0, "status first, readable whatever follows");
static_assert(offsetof(HelloReplyV2, segment_bytes) == 16, "8-byte field on an 8-byte boundary");

// Every event a daemon queues for a client begins with the next number of that client's event
// sequence (1, 2, ...): Note [Two channels].
struct FrameGrantV2 {
  uint64_t sequence;
  uint32_t window_frame;   // the client's number for this GPU frame (< gpu_quota_frames)
  uint32_t reserved;
};
static_assert(sizeof(FrameGrantV2) == 16, "fixed wire size");

struct FrameEventV2 {
  uint64_t sequence;
  uint32_t window_frame;
  uint8_t tier;            // membar::Tier
  uint8_t reserved[3];
};
static_assert(sizeof(FrameEventV2) == 16, "fixed wire size");

struct SlabGrantV2 {
  uint64_t sequence;
  uint32_t slab;           // the client's slab number: its host frames are
  uint32_t frames;         //   [slab * host_slab_frames, + frames)
  uint64_t bytes;          // frames * 2 MiB: the size of the descriptor's memory
};
static_assert(sizeof(SlabGrantV2) == 24, "fixed wire size");

struct SlabEventV2 {
  uint64_t sequence;
  uint32_t slab;
  uint32_t reserved;
};
static_assert(sizeof(SlabEventV2) == 16, "fixed wire size");

// kFrameMap: map window frame `window_frame` of `tier` at space frame `space_frame` of `space`
// (space byte offset space_frame * 2 MiB). kFrameUnmap: unmap whatever is mapped there
// (`window_frame` names the frame that was, for checking).
struct FrameMapV2 {
  uint64_t sequence;
  uint32_t window_frame;
  uint8_t tier;
  uint8_t reserved[3];
  uint32_t space;
  uint32_t space_frame;
};
static_assert(sizeof(FrameMapV2) == 24, "fixed wire size");

// A channel (engine/include/membar/engine/channels.h, Note [Channels]) the client created or
// opened; an event like the frame events, queued before the completion of the request.
inline constexpr uint32_t kChannelWritable = 1u << 0;
struct ChannelNoticeV2 {
  uint64_t sequence;
  uint32_t channel;        // the daemon's channel id (the completion's value)
  uint32_t flags;          // kChannelWritable for the creator
  uint64_t bytes;
};
static_assert(sizeof(ChannelNoticeV2) == 24, "fixed wire size");

struct ShutdownV2 {
  char reason[kMessageBytes];
};
static_assert(sizeof(ShutdownV2) == kMessageBytes, "fixed wire size");

// The admin view comes in pages of spaces: spaces [first_space, first_space + max_spaces) in
// (client, space id) order; the reply says how many there are in all.
struct StatsRequestV2 {
  uint32_t first_space;
  uint32_t max_spaces;     // 1..kMaxStatsSpaces
};
static_assert(sizeof(StatsRequestV2) == 8, "fixed wire size");
inline constexpr uint32_t kMaxStatsSpaces = 4096;

struct PingV2 {
  uint64_t nonce;
};
static_assert(sizeof(PingV2) == 8, "fixed wire size");

struct ErrorV2 {
  int32_t status;
  uint32_t reserved;
  char message[kMessageBytes];
};
static_assert(sizeof(ErrorV2) == 8 + kMessageBytes, "fixed wire size");

// ---------------------------------------------------------------------------------------------
// Shared-memory segment. Layout (offsets from the segment start, each 64-byte aligned):
//   SegmentHeaderV2 | request RingControlV2 | RequestV2[capacity]
//                   | completion RingControlV2 | CompletionV2[capacity]
//   | request payload area | response payload area
// The daemon never reads offsets or sizes back from the segment (the client can write it): it
// keeps its own copy of the layout and validates every index it reads.

inline constexpr uint32_t kDaemonRunning = 0;
inline constexpr uint32_t kDaemonShuttingDown = 1;

struct SegmentHeaderV2 {
  uint32_t magic;                   // kMagic
  uint16_t version;                 // kVersion
  uint16_t reserved0;
  uint32_t ring_capacity;
  uint32_t entry_bytes;             // 64
  uint64_t segment_bytes;
  uint64_t request_ring_offset;     // RingControlV2, then RequestV2[capacity]
  uint64_t completion_ring_offset;  // RingControlV2, then CompletionV2[capacity]
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
static_assert(sizeof(SegmentHeaderV2) == 192, "header plus one cache line for daemon_state");
static_assert(offsetof(SegmentHeaderV2, daemon_state) == 128,
              "daemon-written words on their own cache line: the client polls them while it waits");
static_assert(offsetof(SegmentHeaderV2, completed_ticket) == 136, "8-byte atomic on an 8-byte boundary");

// One single-producer single-consumer ring's shared indices. head: entries pushed (producer),
// tail: entries popped (consumer); both only grow. Each on its own cache line so producer and
// consumer do not false-share. doorbell: a futex word bumped by the producer when the consumer
// said it sleeps (consumer_waiting = 1).
struct RingControlV2 {
  uint64_t head;
  uint8_t pad0[56];
  uint64_t tail;
  uint8_t pad1[56];
  uint32_t doorbell;
  uint32_t consumer_waiting;
  uint8_t pad2[56];
};
static_assert(sizeof(RingControlV2) == 192, "three cache lines");
static_assert(offsetof(RingControlV2, tail) == 64, "tail on its own cache line");
static_assert(offsetof(RingControlV2, doorbell) == 128, "doorbell on its own cache line");

// Request flags.
inline constexpr uint32_t kAcquireWriteFlag = 1u << 0;      // == membar::kAcquireWrite
inline constexpr uint32_t kAcquireZeroNewFlag = 1u << 1;    // == membar::kAcquireZeroNew
// acquire_ranges: advance the schedule to step `argument` first (one call per access).
inline constexpr uint32_t kAcquireAdvanceFlag = 1u << 2;
inline constexpr uint32_t kReleaseDirty = 1u << 0;
// Stream-ordered release: the pages stay in use until the client's stream writes `argument`
// (>= 1) into its released signal word (Note [Stream-ordered release] in engine/engine.cpp).
inline constexpr uint32_t kReleaseAfterMarker = 1u << 1;
// copy_pages (Note [Copied pages] in engine/page_copies.cpp): the copies run once the client's
// stream has written `argument` (>= 1) into its released word; the same bit as kReleaseAfterMarker.
inline constexpr uint32_t kCopyAfterMarker = 1u << 1;
static_assert(kCopyAfterMarker == kReleaseAfterMarker, "ArgumentRule::kMarker reads this bit");
// set_schedule: more parts follow (Note [A schedule in parts] in runtimed/daemon/session.cpp): the
// daemon keeps this part's steps and installs the whole schedule with the first part without it.
inline constexpr uint32_t kScheduleMoreFlag = 1u << 0;
// The most encoded schedule bytes the daemon buffers for one client across parts.
inline constexpr uint64_t kMaxScheduleBytes = 256ull << 20;

// What each opcode's request must name (validate_request checks it; unused fields must be zero).
enum class RangeRule : uint8_t {
  kNone,   // no space, no pages
  kSpace,  // a space, no pages
  kPages,  // a space and a non-empty page range
  kCount,  // no space; page_count >= 1 (create_space)
};
enum class PayloadRule : uint8_t {
  kNone,      // no payload
  kName,      // 1..kMaxSpaceNameBytes bytes of printable ASCII (space or channel name)
  kSchedule,  // an encoded schedule (decode_schedule checks it)
  kRanges,    // encoded page ranges, 1..kMaxRanges (decode_ranges checks them)
};
inline constexpr uint32_t kMaxRanges = 4096;
enum class ArgumentRule : uint8_t {
  kZero,       // argument must be 0
  kPageBytes,  // 1..kMaxPageBytes
  kMarker,     // >= 1 with kReleaseAfterMarker, else 0
  kStep,       // < 2^32
  kBytes,      // 1..64 GiB (channel size)
  kChannel,    // a channel id, 1..2^32-1
  kAdvanceTo,  // < 2^32 with kAcquireAdvanceFlag, else 0
};

// Note [One opcode table]
// Every opcode is one row: its number, its name, the fields it uses, the flags it allows, its
// payload and argument. The enum, opcode_name, validate_request and the daemon's dispatch
// (runtimed/daemon/session.cpp) are all generated from this table, so an opcode cannot be
// added in one place and forgotten in another.
//
// X(Name, number, "text", RangeRule, allowed flags, PayloadRule, ArgumentRule)
#define MEMBAR_PROTOCOL_OPCODES(X)                                                                      \
  X(Nop, 1, "nop", kNone, 0u, kNone, kZero)                                                             \
  X(CreateSpace, 2, "create_space", kCount, 0u, kName, kPageBytes)                                      \
  X(DestroySpace, 3, "destroy_space", kSpace, 0u, kNone, kZero)                                         \
  X(Acquire, 4, "acquire", kPages, kAcquireWriteFlag | kAcquireZeroNewFlag, kNone, kZero)               \
  X(Release, 5, "release", kPages, kReleaseDirty | kReleaseAfterMarker, kNone, kMarker)                 \
  X(Prefetch, 6, "prefetch", kPages, 0u, kNone, kZero)                                                  \
  X(Offload, 7, "offload", kPages, 0u, kNone, kZero)                                                    \
  X(FreePages, 8, "free_pages", kPages, 0u, kNone, kZero)                                               \
  X(AcquireHost, 9, "acquire_host", kPages, 0u, kNone, kZero)                                           \
  X(ReleaseHost, 10, "release_host", kPages, kReleaseDirty, kNone, kZero)                               \
  X(SetSchedule, 11, "set_schedule", kNone, kScheduleMoreFlag, kSchedule, kZero)                       \
  X(Advance, 12, "advance", kNone, 0u, kNone, kStep)                                                    \
  X(Stats, 13, "stats", kNone, 0u, kNone, kZero)                                                        \
  X(CreateChannel, 14, "create_channel", kNone, 0u, kName, kBytes)                                      \
  X(OpenChannel, 15, "open_channel", kNone, 0u, kName, kZero)                                           \
  X(CloseChannel, 16, "close_channel", kNone, 0u, kNone, kChannel)                                      \
  X(PublishChannel, 17, "publish_channel", kNone, 0u, kNone, kChannel)                                  \
  X(AcquireRanges, 18, "acquire_ranges", kNone, kAcquireWriteFlag | kAcquireZeroNewFlag | kAcquireAdvanceFlag, \
    kRanges, kAdvanceTo)                                                                                \
  X(ReleaseRanges, 19, "release_ranges", kNone, kReleaseDirty | kReleaseAfterMarker, kRanges, kMarker)      \
  X(CopyPages, 20, "copy_pages", kNone, kCopyAfterMarker, kRanges, kMarker)                           \
  X(PrefetchRanges, 21, "prefetch_ranges", kNone, 0u, kRanges, kZero)

enum class Opcode : uint16_t {
#define MEMBAR_OPCODE_ENUM(Name, number, text, range, flags, payload, argument) k##Name = number,
  MEMBAR_PROTOCOL_OPCODES(MEMBAR_OPCODE_ENUM)
#undef MEMBAR_OPCODE_ENUM
};
inline constexpr uint16_t kFirstOpcode = 1;
inline constexpr uint16_t kLastOpcode = 21;

struct RequestV2 {
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
static_assert(sizeof(RequestV2) == 64, "one cache line per ring entry");
static_assert(offsetof(RequestV2, argument) == 32, "8-byte field on an 8-byte boundary");

struct CompletionV2 {
  uint64_t sequence;        // the request's
  uint16_t opcode;          // the request's
  uint16_t reserved0;
  int32_t status;           // StatusCode; on error the response payload holds the message
  uint64_t ticket;
  uint64_t value;           // op-specific (space id, channel id)
  uint32_t payload_bytes;   // bytes at the start of the response payload area
  uint32_t reserved1;
  uint64_t events_through;  // the client's last event queued before this completion
  uint8_t reserved2[16];
};
static_assert(sizeof(CompletionV2) == 64, "one cache line per ring entry");
static_assert(offsetof(CompletionV2, ticket) == 16, "8-byte field on an 8-byte boundary");
static_assert(offsetof(CompletionV2, events_through) == 40, "8-byte field on an 8-byte boundary");

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

// Checks magic, version, type, the payload size the type allows and its descriptor count. A
// version mismatch is FAILED_PRECONDITION naming both versions; anything else malformed is
// INVALID_ARGUMENT.
Result<MessageHeaderV2> decode_message_header(std::span<const uint8_t> bytes);

Result<HelloV2> decode_hello(std::span<const uint8_t> payload);
Result<HelloReplyV2> decode_hello_reply(std::span<const uint8_t> payload);
Result<FrameGrantV2> decode_frame_grant(std::span<const uint8_t> payload);
Result<FrameEventV2> decode_frame_event(std::span<const uint8_t> payload);
Result<SlabGrantV2> decode_slab_grant(std::span<const uint8_t> payload);
Result<SlabEventV2> decode_slab_event(std::span<const uint8_t> payload);
Result<FrameMapV2> decode_frame_map(std::span<const uint8_t> payload);
Result<ChannelNoticeV2> decode_channel_notice(std::span<const uint8_t> payload);
Result<ShutdownV2> decode_shutdown(std::span<const uint8_t> payload);
Result<StatsRequestV2> decode_stats_request(std::span<const uint8_t> payload);
Result<PingV2> decode_ping(std::span<const uint8_t> payload);
Result<ErrorV2> decode_error(std::span<const uint8_t> payload);
// The event sequence number a daemon -> client event message starts with; 0 for other types.
uint64_t event_sequence(MessageType type, std::span<const uint8_t> payload);

// Copies `text` into a fixed char field, truncating, always NUL-terminated.
void copy_text(char* field, size_t field_bytes, std::string_view text);
// Reads a fixed char field that must hold a NUL within its bytes.
Result<std::string> read_text(const char* field, size_t field_bytes);

// Checks every field of a request that does not need the engine, from the opcode's row of
// MEMBAR_PROTOCOL_OPCODES: opcode, reserved bytes, flags, fields the opcode does not use, page
// range arithmetic, payload size and argument.
Status validate_request(const RequestV2& request, uint64_t request_payload_capacity);
// Checks a completion the client reads (sequence matching is the caller's).
Status validate_completion(const CompletionV2& completion, uint64_t response_payload_capacity);

// Space and channel names: 1..63 bytes of printable ASCII.
Status validate_name(std::string_view name, std::string_view what);

// Schedule payload: u32 step count, then per step u32 range count and that many
// {u32 space, u32 first_page, u32 page_count}.
std::vector<uint8_t> encode_schedule(const std::vector<ScheduleStep>& steps);
Result<std::vector<ScheduleStep>> decode_schedule(std::span<const uint8_t> payload);

// Ranges payload: u32 count (1..kMaxRanges), then count {u32 space, u32 first_page, u32 page_count}.
std::vector<uint8_t> encode_ranges(const std::vector<PageRange>& ranges);
Result<std::vector<PageRange>> decode_ranges(std::span<const uint8_t> payload);

// Stats payload: see common/protocol.cpp (length-prefixed strings, counted arrays).
std::vector<uint8_t> encode_stats(const RuntimeStats& stats);
Result<RuntimeStats> decode_stats(std::span<const uint8_t> payload);

std::string_view opcode_name(uint16_t opcode);

}  // namespace membar::protocol::v2
