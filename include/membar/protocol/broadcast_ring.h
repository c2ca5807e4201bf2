// A single-writer broadcast ring over shared memory: fixed-size message slots plus a
// double-buffered snapshot area, read by any number of readers that the writer never waits for.
// Header-only, no dependencies beyond the standard library and membar/status.h (only its inline
// parts). LoGRA's policy sync (bindings/python/membar/logra/sync.py) publishes through it, by way
// of bindings/csrc/broadcast_ops.cpp.
//
// Note [Broadcast ring]
// Rationale: a trainer publishes small per-update messages and, now and then, a large snapshot,
// to rollout processes that come and go. The trainer must never wait for a reader, a slow or dead
// reader must not stall or corrupt anything, and readers may map the memory read-only (runtime
// channels are), so readers cannot register, acknowledge or take locks. The readers do not trust
// the writer either: a corrupt or hostile segment must give a clear error, never a read outside
// the segment. Both ends run on x86-64 and aarch64 hosts, so the protocol may rely on nothing but
// the C++ memory model.
// Approach: two segments, each starting with a 64-byte header. The ring segment's header holds
// magic, version, a random instance number, the geometry (slot count, slot payload bytes,
// snapshot payload bytes) and the count of messages written so far; slot_count slots of
// [sequence word, length word, payload] follow, each slot 64-byte aligned. Message s lives in
// slot s % slot_count; its sequence word is 2s+1 while the writer copies it in and 2s+2 once it
// is complete (a seqlock). The writer stores the odd word, issues a release fence, stores the
// length and the payload, stores the even word with release, and then the new message count
// with release. A reader loads the count (acquire) to learn that message s exists, loads the
// sequence word (acquire), copies the length and payload out, issues an acquire fence and loads
// the sequence word again: only when both loads saw 2s+2 is the copy message s (the fences pair
// up, so any payload store the copy saw makes the second load see the odd word or later). A
// word above 2s+2 means the writer lapped the reader: an overrun, reported as such. Payloads
// travel as relaxed 8-byte atomic loads and stores, so the concurrent copy is no data race in the
// language's sense and the same code is correct under x86's and aarch64's orderings. The
// snapshot segment's header holds magic, version, the same instance number, the snapshot payload
// bytes and which of its two buffers is the newest (2: none yet); each buffer is
// [generation word, message count, length, payload] under the same seqlock (the generation is
// odd while being written). The writer fills the buffer that is not the newest and then publishes
// its index, so a reader copying the newest snapshot is disturbed only if two more snapshots are
// published meanwhile. Each end keeps the geometry in local memory (the writer also its own
// message count and generations): the writer never reads the segment back, and a reader reads
// the header's geometry once, checks it against the mapping's size and never again; every length
// and index it loads later is checked before use (DATA_LOSS when impossible).
// Limitations: a reader learns of an overrun only when it asks; it must re-anchor from a snapshot
// (which covers the messages before the count stored with it). One writer per ring: two writers
// would corrupt each other's messages (readers would still read in bounds). A reader that keeps
// losing the race against a writer that publishes snapshots back to back gives up after the
// attempts it was given. The mappings must stay valid while a writer or reader uses them.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>

#include "membar/status.h"

namespace membar::protocol {

static_assert(std::atomic_ref<uint64_t>::is_always_lock_free,
              "broadcast ring words are shared across processes: they must be lock-free atomics");

// "MBBCRING" and "MBBCSNAP" read as little-endian 64-bit words.
inline constexpr uint64_t kBroadcastRingMagic = 0x474E495243424D42ull;
inline constexpr uint64_t kBroadcastSnapshotMagic = 0x50414E5343424D42ull;
inline constexpr uint32_t kBroadcastRingVersion = 1;
// Slots and snapshot buffers start on cache lines, so a reader copying one slot does not share a
// line with the writer filling the next.
inline constexpr uint64_t kBroadcastAlignment = 64;
// Sequence words hold 2s + 2: sequences stay below 2^62 so that never overflows.
inline constexpr uint64_t kBroadcastMaxSequence = 1ull << 62;
// A slot or snapshot payload, at most (keeps every offset computation far from overflow).
inline constexpr uint64_t kBroadcastMaxPayloadBytes = 1ull << 40;
inline constexpr uint64_t kBroadcastMaxSlotCount = 1ull << 20;
// The snapshot header's newest-buffer index before the first snapshot.
inline constexpr uint64_t kBroadcastNoSnapshot = 2;

// At offset 0 of the ring segment.
struct BroadcastRingHeader {
  uint64_t magic;           // kBroadcastRingMagic, stored last when the writer formats the segment
  uint32_t version;         // kBroadcastRingVersion
  uint32_t header_bytes;    // sizeof(BroadcastRingHeader)
  uint64_t instance;        // random; the snapshot segment of the same ring holds the same number
  uint64_t slot_count;      // >= 2
  uint64_t slot_bytes;      // payload capacity of a slot, a positive multiple of 8
  uint64_t snapshot_bytes;  // payload capacity of a snapshot buffer, a positive multiple of 8
  uint64_t message_count;   // messages written so far (the next message's sequence)
  uint64_t reserved;
};
static_assert(sizeof(BroadcastRingHeader) == 64, "the ring header is one cache line");
static_assert(offsetof(BroadcastRingHeader, message_count) % 8 == 0, "atomic words are 8-byte aligned");

// At the start of each slot; slot_bytes of payload follow.
struct BroadcastSlotHeader {
  uint64_t sequence;  // 2s + 1 while message s is written, 2s + 2 once it is complete, 0 never written
  uint64_t length;    // payload bytes of the message, <= slot_bytes
};
static_assert(sizeof(BroadcastSlotHeader) == 16, "the payload starts 16 bytes into a slot");

// At offset 0 of the snapshot segment.
struct BroadcastSnapshotHeader {
  uint64_t magic;  // kBroadcastSnapshotMagic, stored last when the writer formats the segment
  uint32_t version;
  uint32_t header_bytes;    // sizeof(BroadcastSnapshotHeader)
  uint64_t instance;        // equal to the ring header's
  uint64_t snapshot_bytes;  // equal to the ring header's
  uint64_t newest_buffer;   // 0 or 1, or kBroadcastNoSnapshot
  uint64_t reserved[3];
};
static_assert(sizeof(BroadcastSnapshotHeader) == 64, "the snapshot header is one cache line");

// At the start of each of the two snapshot buffers; snapshot_bytes of payload follow.
struct BroadcastSnapshotBufferHeader {
  uint64_t generation;     // odd while being written, even when complete
  uint64_t message_count;  // the snapshot contains the effect of messages [0, message_count)
  uint64_t length;         // payload bytes, <= snapshot_bytes
  uint64_t reserved;
};
static_assert(sizeof(BroadcastSnapshotBufferHeader) == 32, "the payload starts 32 bytes into a buffer");

// What a writer is created with. Byte counts are rounded up to multiples of 8.
struct BroadcastRingConfig {
  uint64_t slot_count = 0;      // >= 2
  uint64_t slot_bytes = 0;      // >= 1: the largest message
  uint64_t snapshot_bytes = 0;  // the largest snapshot (0 is allowed and means 8)
};

// The geometry both ends derive from a config or a header.
struct BroadcastRingGeometry {
  uint64_t slot_count = 0;
  uint64_t slot_bytes = 0;           // multiple of 8
  uint64_t snapshot_bytes = 0;       // multiple of 8
  uint64_t slot_stride = 0;          // bytes from one slot to the next
  uint64_t snapshot_stride = 0;      // bytes from one snapshot buffer to the next
  uint64_t ring_segment_bytes = 0;   // the ring segment needs at least this many bytes
  uint64_t snapshot_segment_bytes = 0;
};

namespace broadcast_detail {

inline uint64_t round_up(uint64_t value, uint64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

inline std::atomic_ref<uint64_t> word(const void* base, uint64_t offset) {
  // Readers may hold a read-only mapping: they only ever load through this reference.
  auto* address = const_cast<uint8_t*>(static_cast<const uint8_t*>(base)) + offset;
  return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(address));
}

// The payload travels as relaxed 8-byte atomics (Note [Broadcast ring]); `words` starts 8-byte aligned.
inline void store_payload(void* words, std::span<const uint8_t> payload) {
  uint64_t full = payload.size() / 8;
  for (uint64_t i = 0; i < full; ++i) {
    uint64_t value;
    std::memcpy(&value, payload.data() + 8 * i, 8);
    word(words, 8 * i).store(value, std::memory_order_relaxed);
  }
  if (uint64_t rest = payload.size() % 8; rest != 0) {
    uint64_t value = 0;
    std::memcpy(&value, payload.data() + 8 * full, rest);
    word(words, 8 * full).store(value, std::memory_order_relaxed);
  }
}

inline void load_payload(const void* words, std::span<uint8_t> out) {
  uint64_t full = out.size() / 8;
  for (uint64_t i = 0; i < full; ++i) {
    uint64_t value = word(words, 8 * i).load(std::memory_order_relaxed);
    std::memcpy(out.data() + 8 * i, &value, 8);
  }
  if (uint64_t rest = out.size() % 8; rest != 0) {
    uint64_t value = word(words, 8 * full).load(std::memory_order_relaxed);
    std::memcpy(out.data() + 8 * full, &value, rest);
  }
}

inline std::string bytes_text(uint64_t bytes) { return std::to_string(bytes) + " bytes"; }

inline Status data_loss(std::string message) { return Status(StatusCode::DATA_LOSS, std::move(message)); }

}  // namespace broadcast_detail

// The geometry of a ring made with `config`; INVALID_ARGUMENT with a sentence when it cannot be.
inline Result<BroadcastRingGeometry> broadcast_ring_geometry(const BroadcastRingConfig& config) {
  using broadcast_detail::round_up;
  if (config.slot_count < 2 || config.slot_bytes < 1) {
    return invalid_argument("a ring needs at least 2 slots of at least 1 byte, got " +
                            std::to_string(config.slot_count) + " x " + std::to_string(config.slot_bytes));
  }
  if (config.slot_count > kBroadcastMaxSlotCount) {
    return invalid_argument("a ring holds at most " + std::to_string(kBroadcastMaxSlotCount) + " slots, got " +
                            std::to_string(config.slot_count));
  }
  if (config.slot_bytes > kBroadcastMaxPayloadBytes || config.snapshot_bytes > kBroadcastMaxPayloadBytes) {
    return invalid_argument("a slot or snapshot holds at most " + std::to_string(kBroadcastMaxPayloadBytes) +
                            " bytes, got " + std::to_string(config.slot_bytes) + " and " +
                            std::to_string(config.snapshot_bytes));
  }
  BroadcastRingGeometry geometry;
  geometry.slot_count = config.slot_count;
  geometry.slot_bytes = round_up(config.slot_bytes, 8);
  geometry.snapshot_bytes = config.snapshot_bytes == 0 ? 8 : round_up(config.snapshot_bytes, 8);
  geometry.slot_stride = round_up(sizeof(BroadcastSlotHeader) + geometry.slot_bytes, kBroadcastAlignment);
  geometry.snapshot_stride =
      round_up(sizeof(BroadcastSnapshotBufferHeader) + geometry.snapshot_bytes, kBroadcastAlignment);
  // At most 2^20 slots of at most 2^40 + 128 bytes: no overflow in 64 bits.
  geometry.ring_segment_bytes = sizeof(BroadcastRingHeader) + geometry.slot_count * geometry.slot_stride;
  geometry.snapshot_segment_bytes = sizeof(BroadcastSnapshotHeader) + 2 * geometry.snapshot_stride;
  return geometry;
}

// What a reader's call found.
enum class BroadcastReadOutcome : uint8_t {
  kCopied = 0,              // the payload was copied out and is what the writer wrote
  kNotWritten = 1,          // the message is not written yet, or no snapshot was published yet
  kOverrun = 2,             // the message's slot already holds a later message (the reader fell a ring behind)
  kOverrunDuringCopy = 3,   // the writer reused the slot while the reader was copying it
  kBusy = 4,                // snapshots: every attempt raced with the writer
};

struct BroadcastRead {
  BroadcastReadOutcome outcome = BroadcastReadOutcome::kNotWritten;
  uint64_t length = 0;         // payload bytes copied (kCopied only)
  uint64_t message_count = 0;  // snapshots: the messages the snapshot contains (kCopied only)
};

// The writer's end. Holds raw pointers into the two mappings, which must outlive it. Calls
// never block and never read anything back from the segments. One thread at a time.
class BroadcastRingWriter {
 public:
  BroadcastRingWriter() = default;

  // Formats both segments (which no reader may be using yet) for `config`. Each segment must be
  // 8-byte aligned and at least as large as broadcast_ring_geometry(config) says.
  static Result<BroadcastRingWriter> create(std::span<uint8_t> ring_segment, std::span<uint8_t> snapshot_segment,
                                            const BroadcastRingConfig& config) {
    MEMBAR_ASSIGN_OR_RETURN(BroadcastRingGeometry geometry, broadcast_ring_geometry(config));
    if (reinterpret_cast<uintptr_t>(ring_segment.data()) % 8 != 0 ||
        reinterpret_cast<uintptr_t>(snapshot_segment.data()) % 8 != 0) {
      return invalid_argument("broadcast ring segments must be 8-byte aligned");
    }
    if (ring_segment.size() < geometry.ring_segment_bytes ||
        snapshot_segment.size() < geometry.snapshot_segment_bytes) {
      return invalid_argument("broadcast ring segments of " + broadcast_detail::bytes_text(ring_segment.size()) +
                              " and " + broadcast_detail::bytes_text(snapshot_segment.size()) + " are too small: " +
                              std::to_string(geometry.slot_count) + " slots of " +
                              broadcast_detail::bytes_text(geometry.slot_bytes) + " need " +
                              broadcast_detail::bytes_text(geometry.ring_segment_bytes) + " and " +
                              broadcast_detail::bytes_text(geometry.snapshot_segment_bytes));
    }
    std::random_device entropy;
    uint64_t instance = (uint64_t(entropy()) << 32) ^ uint64_t(entropy()) ^
                        uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
    std::memset(ring_segment.data(), 0, geometry.ring_segment_bytes);
    std::memset(snapshot_segment.data(), 0, geometry.snapshot_segment_bytes);

    auto* ring = reinterpret_cast<BroadcastRingHeader*>(ring_segment.data());
    ring->version = kBroadcastRingVersion;
    ring->header_bytes = sizeof(BroadcastRingHeader);
    ring->instance = instance;
    ring->slot_count = geometry.slot_count;
    ring->slot_bytes = geometry.slot_bytes;
    ring->snapshot_bytes = geometry.snapshot_bytes;
    auto* snapshot = reinterpret_cast<BroadcastSnapshotHeader*>(snapshot_segment.data());
    snapshot->version = kBroadcastRingVersion;
    snapshot->header_bytes = sizeof(BroadcastSnapshotHeader);
    snapshot->instance = instance;
    snapshot->snapshot_bytes = geometry.snapshot_bytes;
    snapshot->newest_buffer = kBroadcastNoSnapshot;
    // The magic last: a reader that sees it sees the rest of the header.
    std::atomic_ref<uint64_t>(snapshot->magic).store(kBroadcastSnapshotMagic, std::memory_order_release);
    std::atomic_ref<uint64_t>(ring->magic).store(kBroadcastRingMagic, std::memory_order_release);

    BroadcastRingWriter writer;
    writer.ring_ = ring_segment.data();
    writer.snapshot_ = snapshot_segment.data();
    writer.geometry_ = geometry;
    return writer;
  }

  const BroadcastRingGeometry& geometry() const { return geometry_; }
  // Messages written so far (the writer's own count, never read back from the segment).
  uint64_t message_count() const { return message_count_; }

  // Copies `payload` into the next slot and publishes it; returns its sequence. INVALID_ARGUMENT
  // when it does not fit a slot; RESOURCE_EXHAUSTED after 2^62 messages.
  Result<uint64_t> write_message(std::span<const uint8_t> payload) {
    if (payload.size() > geometry_.slot_bytes) {
      return invalid_argument("a " + std::to_string(payload.size()) + "-byte message does not fit a " +
                              std::to_string(geometry_.slot_bytes) + "-byte slot");
    }
    if (message_count_ >= kBroadcastMaxSequence) {
      return resource_exhausted("a broadcast ring carries at most 2^62 messages");
    }
    const uint64_t sequence = message_count_;
    const uint64_t slot = sizeof(BroadcastRingHeader) + (sequence % geometry_.slot_count) * geometry_.slot_stride;
    auto sequence_word = broadcast_detail::word(ring_, slot + offsetof(BroadcastSlotHeader, sequence));
    sequence_word.store(2 * sequence + 1, std::memory_order_relaxed);
    // Orders the odd word before the payload stores (Note [Broadcast ring]).
    std::atomic_thread_fence(std::memory_order_release);
    broadcast_detail::word(ring_, slot + offsetof(BroadcastSlotHeader, length))
        .store(payload.size(), std::memory_order_relaxed);
    broadcast_detail::store_payload(ring_ + slot + sizeof(BroadcastSlotHeader), payload);
    sequence_word.store(2 * sequence + 2, std::memory_order_release);
    message_count_ = sequence + 1;
    broadcast_detail::word(ring_, offsetof(BroadcastRingHeader, message_count))
        .store(message_count_, std::memory_order_release);
    return sequence;
  }

  // Publishes a snapshot that contains the effect of messages [0, message_count).
  // INVALID_ARGUMENT when it does not fit.
  Status write_snapshot(uint64_t message_count, std::span<const uint8_t> payload) {
    if (payload.size() > geometry_.snapshot_bytes) {
      return invalid_argument("a " + std::to_string(payload.size()) + "-byte snapshot does not fit " +
                              std::to_string(geometry_.snapshot_bytes) + " bytes");
    }
    const uint64_t buffer = newest_buffer_ == 0 ? 1 : 0;
    const uint64_t offset = sizeof(BroadcastSnapshotHeader) + buffer * geometry_.snapshot_stride;
    auto generation = broadcast_detail::word(snapshot_, offset + offsetof(BroadcastSnapshotBufferHeader, generation));
    generation.store(generations_[buffer] + 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    broadcast_detail::word(snapshot_, offset + offsetof(BroadcastSnapshotBufferHeader, message_count))
        .store(message_count, std::memory_order_relaxed);
    broadcast_detail::word(snapshot_, offset + offsetof(BroadcastSnapshotBufferHeader, length))
        .store(payload.size(), std::memory_order_relaxed);
    broadcast_detail::store_payload(snapshot_ + offset + sizeof(BroadcastSnapshotBufferHeader), payload);
    generations_[buffer] += 2;
    generation.store(generations_[buffer], std::memory_order_release);
    newest_buffer_ = buffer;
    broadcast_detail::word(snapshot_, offsetof(BroadcastSnapshotHeader, newest_buffer))
        .store(buffer, std::memory_order_release);
    return Status::Ok();
  }

 private:
  uint8_t* ring_ = nullptr;
  uint8_t* snapshot_ = nullptr;
  BroadcastRingGeometry geometry_;
  uint64_t message_count_ = 0;
  uint64_t newest_buffer_ = kBroadcastNoSnapshot;
  uint64_t generations_[2] = {0, 0};
};

// A reader's end. Holds raw pointers into the two mappings (read-only ones do), which must
// outlive it. Calls never block, except read_snapshot's short sleeps between attempts. Readers
// are independent: any number, in any processes; one reader object is used by one thread at a time.
class BroadcastRingReader {
 public:
  BroadcastRingReader() = default;

  // Checks both headers against each other and against the mappings' sizes. DATA_LOSS with a
  // sentence when the segments are not one formatted broadcast ring of this version.
  static Result<BroadcastRingReader> open(std::span<const uint8_t> ring_segment,
                                          std::span<const uint8_t> snapshot_segment) {
    if (reinterpret_cast<uintptr_t>(ring_segment.data()) % 8 != 0 ||
        reinterpret_cast<uintptr_t>(snapshot_segment.data()) % 8 != 0) {
      return invalid_argument("broadcast ring segments must be 8-byte aligned");
    }
    if (ring_segment.size() < sizeof(BroadcastRingHeader) ||
        snapshot_segment.size() < sizeof(BroadcastSnapshotHeader)) {
      return broadcast_detail::data_loss("a " + broadcast_detail::bytes_text(ring_segment.size()) + " ring or " +
                                               broadcast_detail::bytes_text(snapshot_segment.size()) +
                                               " snapshot segment is too small for a broadcast ring header");
    }
    auto field = [](std::span<const uint8_t> segment, size_t offset) {
      return broadcast_detail::word(segment.data(), offset).load(std::memory_order_acquire);
    };
    // Magic first (acquire): the writer stores it last.
    if (field(ring_segment, offsetof(BroadcastRingHeader, magic)) != kBroadcastRingMagic) {
      return broadcast_detail::data_loss("the ring segment is not a broadcast ring (wrong magic)");
    }
    if (field(snapshot_segment, offsetof(BroadcastSnapshotHeader, magic)) != kBroadcastSnapshotMagic) {
      return broadcast_detail::data_loss("the snapshot segment is not a broadcast ring snapshot area (wrong magic)");
    }
    // Version and header size share one little-endian word (loaded as one atomic).
    static_assert(offsetof(BroadcastRingHeader, header_bytes) == offsetof(BroadcastRingHeader, version) + 4 &&
                      offsetof(BroadcastSnapshotHeader, header_bytes) == offsetof(BroadcastSnapshotHeader, version) + 4,
                  "version and header_bytes are adjacent 32-bit fields");
    const uint64_t ring_version = field(ring_segment, offsetof(BroadcastRingHeader, version));
    const uint64_t snapshot_version = field(snapshot_segment, offsetof(BroadcastSnapshotHeader, version));
    if (ring_version != (uint64_t(kBroadcastRingVersion) | uint64_t(sizeof(BroadcastRingHeader)) << 32) ||
        snapshot_version != (uint64_t(kBroadcastRingVersion) | uint64_t(sizeof(BroadcastSnapshotHeader)) << 32)) {
      auto describe = [](uint64_t word) {
        return "version " + std::to_string(uint32_t(word)) + " with a " + std::to_string(word >> 32) + "-byte header";
      };
      return broadcast_detail::data_loss("the ring segment holds broadcast ring " + describe(ring_version) +
                                         " and the snapshot segment " + describe(snapshot_version) +
                                         "; this reader reads version " + std::to_string(kBroadcastRingVersion) +
                                         " with 64-byte headers");
    }
    if (field(ring_segment, offsetof(BroadcastRingHeader, instance)) !=
        field(snapshot_segment, offsetof(BroadcastSnapshotHeader, instance))) {
      return broadcast_detail::data_loss("the ring and snapshot segments belong to different rings "
                                           "(the writer was restarted between the two opens?)");
    }
    BroadcastRingConfig config;
    config.slot_count = field(ring_segment, offsetof(BroadcastRingHeader, slot_count));
    config.slot_bytes = field(ring_segment, offsetof(BroadcastRingHeader, slot_bytes));
    config.snapshot_bytes = field(ring_segment, offsetof(BroadcastRingHeader, snapshot_bytes));
    auto geometry = broadcast_ring_geometry(config);
    if (!geometry.ok()) {
      return broadcast_detail::data_loss("the ring header's geometry is impossible: " + geometry.status().message());
    }
    const BroadcastRingGeometry& g = geometry.value();
    if (g.slot_bytes != config.slot_bytes || g.snapshot_bytes != config.snapshot_bytes ||
        field(snapshot_segment, offsetof(BroadcastSnapshotHeader, snapshot_bytes)) != config.snapshot_bytes) {
      return broadcast_detail::data_loss("the ring header's payload sizes (" + std::to_string(config.slot_bytes) +
                                               ", " + std::to_string(config.snapshot_bytes) +
                                               ") are not multiples of 8 or disagree with the snapshot segment's");
    }
    if (ring_segment.size() < g.ring_segment_bytes || snapshot_segment.size() < g.snapshot_segment_bytes) {
      return Status(StatusCode::DATA_LOSS,
                    "the ring header describes " + std::to_string(g.slot_count) + " slots of " +
                        broadcast_detail::bytes_text(g.slot_bytes) + " and snapshots of " +
                        broadcast_detail::bytes_text(g.snapshot_bytes) + " (segments of " +
                        broadcast_detail::bytes_text(g.ring_segment_bytes) + " and " +
                        broadcast_detail::bytes_text(g.snapshot_segment_bytes) + "), but the mappings hold only " +
                        broadcast_detail::bytes_text(ring_segment.size()) + " and " +
                        broadcast_detail::bytes_text(snapshot_segment.size()));
    }
    BroadcastRingReader reader;
    reader.ring_ = ring_segment.data();
    reader.snapshot_ = snapshot_segment.data();
    reader.geometry_ = g;
    return reader;
  }

  const BroadcastRingGeometry& geometry() const { return geometry_; }

  // Messages written so far, as the segment says (any value: read_message checks what it finds).
  uint64_t message_count() const {
    return broadcast_detail::word(ring_, offsetof(BroadcastRingHeader, message_count)).load(std::memory_order_acquire);
  }

  // Copies message `sequence` into `out` (at least geometry().slot_bytes long). kCopied with its
  // length, kNotWritten, kOverrun or kOverrunDuringCopy; DATA_LOSS when the slot holds something
  // an honest writer cannot have written; INVALID_ARGUMENT for a short `out` or a sequence >= 2^62.
  Result<BroadcastRead> read_message(uint64_t sequence, std::span<uint8_t> out) const {
    if (out.size() < geometry_.slot_bytes) {
      return invalid_argument("read_message needs room for " + broadcast_detail::bytes_text(geometry_.slot_bytes) +
                              ", got " + broadcast_detail::bytes_text(out.size()));
    }
    if (sequence >= kBroadcastMaxSequence) {
      return invalid_argument("message sequences are below 2^62, got " + std::to_string(sequence));
    }
    BroadcastRead read;
    if (sequence >= message_count()) return read;  // kNotWritten
    const uint64_t slot = sizeof(BroadcastRingHeader) + (sequence % geometry_.slot_count) * geometry_.slot_stride;
    auto sequence_word = broadcast_detail::word(ring_, slot + offsetof(BroadcastSlotHeader, sequence));
    const uint64_t expected = 2 * sequence + 2;
    const uint64_t before = sequence_word.load(std::memory_order_acquire);
    if (before > expected) {
      read.outcome = BroadcastReadOutcome::kOverrun;
      return read;
    }
    if (before < expected) {
      // The count said message `sequence` was complete, so its slot holds it or a later one.
      return broadcast_detail::data_loss("broadcast ring slot " + std::to_string(sequence % geometry_.slot_count) +
                                               " holds sequence word " + std::to_string(before) +
                                               " although message " + std::to_string(sequence) +
                                               " was published (a corrupt or second writer)");
    }
    const uint64_t length =
        broadcast_detail::word(ring_, slot + offsetof(BroadcastSlotHeader, length)).load(std::memory_order_relaxed);
    const bool length_valid = length <= geometry_.slot_bytes;
    if (length_valid) {
      broadcast_detail::load_payload(ring_ + slot + sizeof(BroadcastSlotHeader), out.first(length));
    }
    // Orders the copy's loads before the second load of the sequence word (Note [Broadcast ring]).
    std::atomic_thread_fence(std::memory_order_acquire);
    if (sequence_word.load(std::memory_order_relaxed) != expected) {
      read.outcome = BroadcastReadOutcome::kOverrunDuringCopy;
      return read;
    }
    if (!length_valid) {
      return broadcast_detail::data_loss("broadcast ring message " + std::to_string(sequence) + " claims " +
                                               broadcast_detail::bytes_text(length) + " but slots hold " +
                                               broadcast_detail::bytes_text(geometry_.slot_bytes));
    }
    read.outcome = BroadcastReadOutcome::kCopied;
    read.length = length;
    return read;
  }

  // Copies the newest complete snapshot into `out` (at least geometry().snapshot_bytes long):
  // kCopied with its length and message count, kNotWritten when none was published, kBusy when
  // `attempts` tries all raced with the writer (sleeping 500 us after each try that found the
  // buffer being written). DATA_LOSS when the snapshot area holds something impossible.
  Result<BroadcastRead> read_snapshot(std::span<uint8_t> out, uint32_t attempts = 100) const {
    if (out.size() < geometry_.snapshot_bytes) {
      return invalid_argument("read_snapshot needs room for " + broadcast_detail::bytes_text(geometry_.snapshot_bytes) +
                              ", got " + broadcast_detail::bytes_text(out.size()));
    }
    BroadcastRead read;
    for (uint32_t attempt = 0; attempt < attempts; ++attempt) {
      const uint64_t buffer = broadcast_detail::word(snapshot_, offsetof(BroadcastSnapshotHeader, newest_buffer))
                                  .load(std::memory_order_acquire);
      if (buffer == kBroadcastNoSnapshot) return read;  // kNotWritten
      if (buffer > 1) {
        return Status(StatusCode::DATA_LOSS,
                      "the snapshot header names buffer " + std::to_string(buffer) + " (there are two)");
      }
      const uint64_t offset = sizeof(BroadcastSnapshotHeader) + buffer * geometry_.snapshot_stride;
      auto generation =
          broadcast_detail::word(snapshot_, offset + offsetof(BroadcastSnapshotBufferHeader, generation));
      const uint64_t before = generation.load(std::memory_order_acquire);
      if (before % 2 == 1) {
        std::this_thread::sleep_for(std::chrono::microseconds(500));
        continue;
      }
      const uint64_t message_count =
          broadcast_detail::word(snapshot_, offset + offsetof(BroadcastSnapshotBufferHeader, message_count))
              .load(std::memory_order_relaxed);
      const uint64_t length =
          broadcast_detail::word(snapshot_, offset + offsetof(BroadcastSnapshotBufferHeader, length))
              .load(std::memory_order_relaxed);
      const bool length_valid = length <= geometry_.snapshot_bytes;
      if (length_valid) {
        broadcast_detail::load_payload(snapshot_ + offset + sizeof(BroadcastSnapshotBufferHeader), out.first(length));
      }
      std::atomic_thread_fence(std::memory_order_acquire);
      if (generation.load(std::memory_order_relaxed) != before) continue;
      if (!length_valid) {
        return broadcast_detail::data_loss("the snapshot claims " + broadcast_detail::bytes_text(length) +
                                                 " but buffers hold " +
                                                 broadcast_detail::bytes_text(geometry_.snapshot_bytes));
      }
      read.outcome = BroadcastReadOutcome::kCopied;
      read.length = length;
      read.message_count = message_count;
      return read;
    }
    read.outcome = BroadcastReadOutcome::kBusy;
    return read;
  }

 private:
  const uint8_t* ring_ = nullptr;
  const uint8_t* snapshot_ = nullptr;
  BroadcastRingGeometry geometry_;
};

}  // namespace membar::protocol
