// Broadcast ring unit tests: round trips of messages and snapshots, overruns, read-only readers,
// rejection of bad headers and impossible slots, a hostile writer against a reader whose segments
// end at a guard page, and threads racing a writer on the same slots (Note [Broadcast ring]).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "membar/protocol/broadcast_ring.h"

namespace membar::protocol {
namespace {

std::mt19937_64& rng() {
  static std::mt19937_64 generator(std::random_device{}());
  return generator;
}
uint64_t random_between(uint64_t low, uint64_t high) {
  return std::uniform_int_distribution<uint64_t>(low, high)(rng());
}
std::vector<uint8_t> random_bytes(size_t count) {
  std::vector<uint8_t> bytes(count);
  for (auto& byte : bytes) byte = uint8_t(rng()());
  return bytes;
}

// Storage for one ring: 64-byte aligned vectors of the sizes the geometry asks for.
struct Segments {
  explicit Segments(const BroadcastRingConfig& config) {
    auto geometry = broadcast_ring_geometry(config);
    EXPECT_TRUE(geometry.ok()) << geometry.status().to_string();
    ring.resize(geometry.value().ring_segment_bytes / 8);
    snapshot.resize(geometry.value().snapshot_segment_bytes / 8);
  }
  std::span<uint8_t> ring_bytes() { return {reinterpret_cast<uint8_t*>(ring.data()), ring.size() * 8}; }
  std::span<uint8_t> snapshot_bytes() { return {reinterpret_cast<uint8_t*>(snapshot.data()), snapshot.size() * 8}; }
  BroadcastRingHeader* ring_header() { return reinterpret_cast<BroadcastRingHeader*>(ring.data()); }
  BroadcastSnapshotHeader* snapshot_header() { return reinterpret_cast<BroadcastSnapshotHeader*>(snapshot.data()); }
  std::vector<uint64_t> ring, snapshot;
};

BroadcastRingWriter make_writer(Segments& segments, const BroadcastRingConfig& config) {
  auto writer = BroadcastRingWriter::create(segments.ring_bytes(), segments.snapshot_bytes(), config);
  EXPECT_TRUE(writer.ok()) << writer.status().to_string();
  return std::move(writer).value();
}

BroadcastRingReader open_reader(Segments& segments) {
  auto reader = BroadcastRingReader::open(segments.ring_bytes(), segments.snapshot_bytes());
  EXPECT_TRUE(reader.ok()) << reader.status().to_string();
  return std::move(reader).value();
}

// A payload whose length and every byte are functions of its sequence number: two messages that
// share a slot differ in their bytes, so a copy that mixes them cannot pass the check.
uint64_t pattern_length(uint64_t sequence, uint64_t capacity) { return 1 + (sequence * 7919) % capacity; }
uint8_t pattern_byte(uint64_t sequence, uint64_t index) {
  return uint8_t((sequence * 0x9E3779B97F4A7C15ull) >> (8 * (index % 8))) + uint8_t(index / 8);
}
std::vector<uint8_t> pattern_payload(uint64_t sequence, uint64_t capacity) {
  std::vector<uint8_t> payload(pattern_length(sequence, capacity));
  for (uint64_t i = 0; i < payload.size(); ++i) payload[i] = pattern_byte(sequence, i);
  return payload;
}
bool matches_pattern(uint64_t sequence, uint64_t capacity, std::span<const uint8_t> payload) {
  if (payload.size() != pattern_length(sequence, capacity)) return false;
  for (uint64_t i = 0; i < payload.size(); ++i) {
    if (payload[i] != pattern_byte(sequence, i)) return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Single thread.

TEST(BroadcastRing, GeometryRoundsPayloadsAndRejectsImpossibleConfigs) {
  auto geometry = broadcast_ring_geometry({5, 13, 0});
  ASSERT_TRUE(geometry.ok());
  EXPECT_EQ(geometry.value().slot_bytes, 16u);
  EXPECT_EQ(geometry.value().snapshot_bytes, 8u);
  EXPECT_EQ(geometry.value().slot_stride, 64u);
  EXPECT_EQ(geometry.value().ring_segment_bytes, 64u + 5 * 64);
  EXPECT_EQ(geometry.value().snapshot_segment_bytes, 64u + 2 * 64);
  for (BroadcastRingConfig bad : {BroadcastRingConfig{1, 8, 8}, BroadcastRingConfig{4, 0, 8},
                                  BroadcastRingConfig{kBroadcastMaxSlotCount + 1, 8, 8},
                                  BroadcastRingConfig{4, kBroadcastMaxPayloadBytes + 1, 8},
                                  BroadcastRingConfig{4, 8, kBroadcastMaxPayloadBytes + 1}}) {
    auto rejected = broadcast_ring_geometry(bad);
    ASSERT_FALSE(rejected.ok());
    EXPECT_EQ(rejected.status().code(), StatusCode::INVALID_ARGUMENT);
  }
  EXPECT_NE(broadcast_ring_geometry({1, 8, 8}).status().message().find("at least 2 slots"), std::string::npos);
}

TEST(BroadcastRing, RoundTripsMessagesOfEveryLengthAcrossWraps) {
  const BroadcastRingConfig config{random_between(2, 9), random_between(1, 300), 64};
  Segments segments(config);
  BroadcastRingWriter writer = make_writer(segments, config);
  BroadcastRingReader reader = open_reader(segments);
  const uint64_t capacity = writer.geometry().slot_bytes;
  EXPECT_EQ(reader.geometry().slot_bytes, capacity);
  std::vector<uint8_t> out(capacity);
  std::vector<std::vector<uint8_t>> written;
  for (uint64_t sequence = 0; sequence < 10 * config.slot_count + 3; ++sequence) {
    auto nothing = reader.read_message(sequence, out);
    ASSERT_TRUE(nothing.ok());
    EXPECT_EQ(nothing.value().outcome, BroadcastReadOutcome::kNotWritten);
    // Every length from empty to full occurs, with random bytes.
    written.push_back(random_bytes(sequence == 0 ? capacity : random_between(0, capacity)));
    auto landed = writer.write_message(written.back());
    ASSERT_TRUE(landed.ok());
    EXPECT_EQ(landed.value(), sequence);
    EXPECT_EQ(reader.message_count(), sequence + 1);
    auto read = reader.read_message(sequence, out);
    ASSERT_TRUE(read.ok()) << read.status().to_string();
    ASSERT_EQ(read.value().outcome, BroadcastReadOutcome::kCopied);
    ASSERT_EQ(read.value().length, written.back().size());
    EXPECT_TRUE(std::equal(written.back().begin(), written.back().end(), out.begin()));
  }
  // The last slot_count messages are all still there, in any order of reading.
  for (uint64_t back = 1; back <= config.slot_count; ++back) {
    uint64_t sequence = written.size() - back;
    auto read = reader.read_message(sequence, out);
    ASSERT_TRUE(read.ok());
    ASSERT_EQ(read.value().outcome, BroadcastReadOutcome::kCopied);
    EXPECT_TRUE(std::equal(written[sequence].begin(), written[sequence].end(), out.begin()));
  }
}

TEST(BroadcastRing, ReportsAnOverrunWhenTheReaderFallsARingBehind) {
  const BroadcastRingConfig config{8, 32, 8};
  Segments segments(config);
  BroadcastRingWriter writer = make_writer(segments, config);
  BroadcastRingReader reader = open_reader(segments);
  for (uint64_t sequence = 0; sequence < 11; ++sequence) {
    ASSERT_TRUE(writer.write_message(pattern_payload(sequence, 32)).ok());
  }
  std::vector<uint8_t> out(32);
  for (uint64_t sequence = 0; sequence < 3; ++sequence) {
    auto read = reader.read_message(sequence, out);
    ASSERT_TRUE(read.ok());
    EXPECT_EQ(read.value().outcome, BroadcastReadOutcome::kOverrun) << "message " << sequence << " was overwritten";
  }
  for (uint64_t sequence = 3; sequence < 11; ++sequence) {
    auto read = reader.read_message(sequence, out);
    ASSERT_TRUE(read.ok());
    ASSERT_EQ(read.value().outcome, BroadcastReadOutcome::kCopied);
    EXPECT_TRUE(matches_pattern(sequence, 32, std::span(out).first(read.value().length)));
  }
  EXPECT_EQ(reader.read_message(11, out).value().outcome, BroadcastReadOutcome::kNotWritten);
}

TEST(BroadcastRing, SnapshotsRoundTripThroughBothBuffers) {
  const BroadcastRingConfig config{4, 8, random_between(1, 5000)};
  Segments segments(config);
  BroadcastRingWriter writer = make_writer(segments, config);
  BroadcastRingReader reader = open_reader(segments);
  std::vector<uint8_t> out(reader.geometry().snapshot_bytes);
  auto none = reader.read_snapshot(out);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none.value().outcome, BroadcastReadOutcome::kNotWritten);
  for (uint64_t count = 0; count < 5; ++count) {
    std::vector<uint8_t> payload = random_bytes(random_between(0, config.snapshot_bytes));
    ASSERT_TRUE(writer.write_snapshot(count * 16, payload).ok());
    EXPECT_EQ(segments.snapshot_header()->newest_buffer, count % 2) << "buffers alternate";
    auto read = reader.read_snapshot(out);
    ASSERT_TRUE(read.ok());
    ASSERT_EQ(read.value().outcome, BroadcastReadOutcome::kCopied);
    EXPECT_EQ(read.value().message_count, count * 16);
    ASSERT_EQ(read.value().length, payload.size());
    EXPECT_TRUE(std::equal(payload.begin(), payload.end(), out.begin()));
  }
}

TEST(BroadcastRing, RefusesWhatDoesNotFitAndShortOutputs) {
  const BroadcastRingConfig config{2, 13, 20};
  Segments segments(config);
  BroadcastRingWriter writer = make_writer(segments, config);
  BroadcastRingReader reader = open_reader(segments);
  auto too_long = writer.write_message(std::vector<uint8_t>(17));
  ASSERT_FALSE(too_long.ok());
  EXPECT_EQ(too_long.status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(too_long.status().message().find("does not fit"), std::string::npos);
  EXPECT_TRUE(writer.write_message(std::vector<uint8_t>(16)).ok()) << "13 rounds up to 16";
  Status snapshot = writer.write_snapshot(0, std::vector<uint8_t>(25));
  EXPECT_EQ(snapshot.code(), StatusCode::INVALID_ARGUMENT);
  std::vector<uint8_t> short_out(8);
  EXPECT_EQ(reader.read_message(0, short_out).status().code(), StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(reader.read_snapshot(short_out).status().code(), StatusCode::INVALID_ARGUMENT);
  std::vector<uint8_t> out(16);
  EXPECT_EQ(reader.read_message(kBroadcastMaxSequence, out).status().code(), StatusCode::INVALID_ARGUMENT);
  // Segments smaller than the config needs.
  std::vector<uint64_t> small(4);
  auto refused = BroadcastRingWriter::create({reinterpret_cast<uint8_t*>(small.data()), 32},
                                             segments.snapshot_bytes(), config);
  EXPECT_EQ(refused.status().code(), StatusCode::INVALID_ARGUMENT);
}

// The runtime's channels map a reader's view read-only: every reader call only loads.
TEST(BroadcastRing, ReaderWorksOnAReadOnlyMapping) {
  const BroadcastRingConfig config{4, 40, 100};
  auto geometry = broadcast_ring_geometry(config).value();
  const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
  const uint64_t ring_bytes = broadcast_detail::round_up(geometry.ring_segment_bytes, page);
  const uint64_t total = ring_bytes + broadcast_detail::round_up(geometry.snapshot_segment_bytes, page);
  int fd = memfd_create("broadcast_ring_test", 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, off_t(total)), 0);
  void* writable = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  void* readable = mmap(nullptr, total, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  ASSERT_NE(writable, MAP_FAILED);
  ASSERT_NE(readable, MAP_FAILED);
  auto* w = static_cast<uint8_t*>(writable);
  const auto* r = static_cast<const uint8_t*>(readable);
  auto writer = BroadcastRingWriter::create({w, ring_bytes}, {w + ring_bytes, total - ring_bytes}, config);
  ASSERT_TRUE(writer.ok());
  auto reader = BroadcastRingReader::open({r, ring_bytes}, {r + ring_bytes, total - ring_bytes});
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  std::vector<uint8_t> out(reader.value().geometry().snapshot_bytes);
  for (uint64_t sequence = 0; sequence < 9; ++sequence) {
    ASSERT_TRUE(writer.value().write_message(pattern_payload(sequence, 40)).ok());
    auto read = reader.value().read_message(sequence, out);
    ASSERT_TRUE(read.ok());
    ASSERT_EQ(read.value().outcome, BroadcastReadOutcome::kCopied);
    EXPECT_TRUE(matches_pattern(sequence, 40, std::span(out).first(read.value().length)));
  }
  ASSERT_TRUE(writer.value().write_snapshot(9, pattern_payload(9, 100)).ok());
  auto snapshot = reader.value().read_snapshot(out);
  ASSERT_TRUE(snapshot.ok());
  ASSERT_EQ(snapshot.value().outcome, BroadcastReadOutcome::kCopied);
  EXPECT_EQ(snapshot.value().message_count, 9u);
  EXPECT_TRUE(matches_pattern(9, 100, std::span(out).first(snapshot.value().length)));
  munmap(writable, total);
  munmap(readable, total);
}

// ---------------------------------------------------------------------------------------------
// Segments that are not what an honest writer formats.

TEST(BroadcastRing, RejectsBadHeaders) {
  const BroadcastRingConfig config{4, 24, 48};
  struct Case {
    const char* what;
    std::function<void(Segments&)> corrupt;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"ring magic", [](Segments& s) { s.ring_header()->magic ^= 1; }, "wrong magic"},
      {"snapshot magic", [](Segments& s) { s.snapshot_header()->magic = 0; }, "wrong magic"},
      {"ring version", [](Segments& s) { s.ring_header()->version = 2; }, "version 2"},
      {"snapshot version", [](Segments& s) { s.snapshot_header()->version = 0; }, "version"},
      {"header size", [](Segments& s) { s.ring_header()->header_bytes = 128; }, "version"},
      {"instance", [](Segments& s) { s.snapshot_header()->instance ^= 1ull << 40; }, "different rings"},
      {"one slot", [](Segments& s) { s.ring_header()->slot_count = 1; }, "at least 2 slots"},
      {"no slots", [](Segments& s) { s.ring_header()->slot_count = 0; }, "at least 2 slots"},
      {"huge slot count", [](Segments& s) { s.ring_header()->slot_count = ~0ull; }, "at most"},
      {"empty slots", [](Segments& s) { s.ring_header()->slot_bytes = 0; }, "at least 2 slots"},
      {"unaligned slots", [](Segments& s) { s.ring_header()->slot_bytes = 20; }, "multiples of 8"},
      {"huge slots", [](Segments& s) { s.ring_header()->slot_bytes = 1ull << 63; }, "at most"},
      {"more slots than mapped", [](Segments& s) { s.ring_header()->slot_count = 5; }, "mappings hold only"},
      {"larger slots than mapped", [](Segments& s) { s.ring_header()->slot_bytes = 56; }, "mappings hold only"},
      {"snapshot sizes disagree", [](Segments& s) { s.snapshot_header()->snapshot_bytes = 40; }, "disagree"},
      {"larger snapshots than mapped",
       [](Segments& s) {
         s.ring_header()->snapshot_bytes = 4096;
         s.snapshot_header()->snapshot_bytes = 4096;
       },
       "mappings hold only"},
  };
  for (const Case& c : cases) {
    Segments segments(config);
    make_writer(segments, config);
    c.corrupt(segments);
    auto reader = BroadcastRingReader::open(segments.ring_bytes(), segments.snapshot_bytes());
    ASSERT_FALSE(reader.ok()) << c.what;
    EXPECT_EQ(reader.status().code(), StatusCode::DATA_LOSS) << c.what;
    EXPECT_NE(reader.status().message().find(c.message), std::string::npos)
        << c.what << ": " << reader.status().message();
  }
  // Mappings shorter than a header, unaligned mappings, and zero-filled (never formatted) memory.
  Segments segments(config);
  make_writer(segments, config);
  EXPECT_EQ(BroadcastRingReader::open(segments.ring_bytes().first(63), segments.snapshot_bytes()).status().code(),
            StatusCode::DATA_LOSS);
  EXPECT_EQ(BroadcastRingReader::open(segments.ring_bytes().subspan(4), segments.snapshot_bytes()).status().code(),
            StatusCode::INVALID_ARGUMENT);
  Segments blank(config);
  auto unformatted = BroadcastRingReader::open(blank.ring_bytes(), blank.snapshot_bytes());
  EXPECT_EQ(unformatted.status().code(), StatusCode::DATA_LOSS);
}

TEST(BroadcastRing, RejectsImpossibleSlotsAndSnapshots) {
  const BroadcastRingConfig config{4, 24, 48};
  Segments segments(config);
  BroadcastRingWriter writer = make_writer(segments, config);
  BroadcastRingReader reader = open_reader(segments);
  for (uint64_t sequence = 0; sequence < 3; ++sequence) {
    ASSERT_TRUE(writer.write_message(pattern_payload(sequence, 24)).ok());
  }
  ASSERT_TRUE(writer.write_snapshot(3, pattern_payload(3, 48)).ok());
  std::vector<uint8_t> out(48);
  auto* slots = reinterpret_cast<uint8_t*>(segments.ring.data()) + sizeof(BroadcastRingHeader);
  const uint64_t stride = writer.geometry().slot_stride;

  // A length beyond the slot: refused before any byte is copied.
  reinterpret_cast<BroadcastSlotHeader*>(slots + 1 * stride)->length = 1ull << 50;
  auto long_message = reader.read_message(1, out);
  ASSERT_FALSE(long_message.ok());
  EXPECT_EQ(long_message.status().code(), StatusCode::DATA_LOSS);
  EXPECT_NE(long_message.status().message().find("claims"), std::string::npos);
  // A published message whose slot holds an older sequence word.
  reinterpret_cast<BroadcastSlotHeader*>(slots + 2 * stride)->sequence = 2;
  EXPECT_EQ(reader.read_message(2, out).status().code(), StatusCode::DATA_LOSS);
  // A count far ahead of the slots: later messages look overwritten or impossible, never out of bounds.
  segments.ring_header()->message_count = 1ull << 61;
  auto ahead = reader.read_message(0, out);
  ASSERT_TRUE(ahead.ok());
  EXPECT_EQ(ahead.value().outcome, BroadcastReadOutcome::kCopied) << "message 0 is intact";
  EXPECT_EQ(reader.read_message((1ull << 61) - 1, out).status().code(), StatusCode::DATA_LOSS);

  auto* buffer = reinterpret_cast<BroadcastSnapshotBufferHeader*>(
      reinterpret_cast<uint8_t*>(segments.snapshot.data()) + sizeof(BroadcastSnapshotHeader) +
      segments.snapshot_header()->newest_buffer * writer.geometry().snapshot_stride);
  buffer->length = 49;
  EXPECT_EQ(reader.read_snapshot(out).status().code(), StatusCode::DATA_LOSS);
  buffer->length = 48;
  segments.snapshot_header()->newest_buffer = 7;
  EXPECT_EQ(reader.read_snapshot(out).status().code(), StatusCode::DATA_LOSS);
  // A generation that stays odd: the reader gives up after its attempts instead of waiting.
  segments.snapshot_header()->newest_buffer = 1;
  reinterpret_cast<BroadcastSnapshotBufferHeader*>(reinterpret_cast<uint8_t*>(segments.snapshot.data()) +
                                                   sizeof(BroadcastSnapshotHeader) + writer.geometry().snapshot_stride)
      ->generation = 3;
  auto busy = reader.read_snapshot(out, 3);
  ASSERT_TRUE(busy.ok());
  EXPECT_EQ(busy.value().outcome, BroadcastReadOutcome::kBusy);
}

// A region whose last byte sits right before an inaccessible page: a read past the end faults.
class GuardedRegion {
 public:
  explicit GuardedRegion(uint64_t bytes) {
    const uint64_t page = uint64_t(sysconf(_SC_PAGESIZE));
    mapped_ = broadcast_detail::round_up(bytes, page) + page;
    base_ = static_cast<uint8_t*>(mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
    EXPECT_NE(base_, MAP_FAILED);
    EXPECT_EQ(mprotect(base_ + mapped_ - page, page, PROT_NONE), 0);
    data_ = base_ + mapped_ - page - bytes;
    bytes_ = bytes;
  }
  ~GuardedRegion() { munmap(base_, mapped_); }
  std::span<uint8_t> bytes() { return {data_, bytes_}; }

 private:
  uint8_t* base_ = nullptr;
  uint8_t* data_ = nullptr;
  uint64_t mapped_ = 0;
  uint64_t bytes_ = 0;
};

TEST(BroadcastRing, AHostileWriterNeverMakesAReaderLeaveTheSegments) {
  const BroadcastRingConfig config{4, 40, 72};
  const auto geometry = broadcast_ring_geometry(config).value();
  GuardedRegion ring(geometry.ring_segment_bytes);
  GuardedRegion snapshot(geometry.snapshot_segment_bytes);
  uint64_t copied = 0, refused = 0;
  for (int round = 0; round < 2000; ++round) {
    auto writer = BroadcastRingWriter::create(ring.bytes(), snapshot.bytes(), config);
    ASSERT_TRUE(writer.ok());
    for (uint64_t sequence = 0; sequence < 6; ++sequence) {
      ASSERT_TRUE(writer.value().write_message(pattern_payload(sequence, 40)).ok());
    }
    ASSERT_TRUE(writer.value().write_snapshot(6, pattern_payload(6, 72)).ok());
    // Overwrite random words anywhere (headers included) with small, huge or random values.
    for (int hit = 0; hit < 6; ++hit) {
      bool in_ring = rng()() % 2 == 0;
      std::span<uint8_t> target = in_ring ? ring.bytes() : snapshot.bytes();
      uint64_t offset = random_between(0, target.size() / 8 - 1) * 8;
      uint64_t value = std::array<uint64_t, 4>{random_between(0, 16), rng()(), ~0ull - random_between(0, 8),
                                               1ull << random_between(0, 63)}[rng()() % 4];
      std::memcpy(target.data() + offset, &value, 8);
    }
    auto reader = BroadcastRingReader::open(ring.bytes(), snapshot.bytes());
    if (!reader.ok()) {
      ++refused;
      continue;
    }
    std::vector<uint8_t> out(std::max(reader.value().geometry().slot_bytes, reader.value().geometry().snapshot_bytes));
    for (uint64_t sequence : {uint64_t(0), uint64_t(3), uint64_t(5), random_between(0, 1ull << 40)}) {
      auto read = reader.value().read_message(sequence, out);
      if (read.ok() && read.value().outcome == BroadcastReadOutcome::kCopied) {
        ++copied;
        EXPECT_LE(read.value().length, reader.value().geometry().slot_bytes);
      }
    }
    auto read = reader.value().read_snapshot(out, 2);
    if (read.ok() && read.value().outcome == BroadcastReadOutcome::kCopied) {
      EXPECT_LE(read.value().length, reader.value().geometry().snapshot_bytes);
    }
  }
  // Both paths ran: some corruptions hit a header, most left messages to read.
  EXPECT_GT(refused, 0u);
  EXPECT_GT(copied, 0u);
}

// ---------------------------------------------------------------------------------------------
// Threads: one writer laps readers on a small ring as fast as it can.

TEST(BroadcastRing, ReadersRacingTheWriterNeverAcceptATornMessage) {
  const BroadcastRingConfig config{2, 2048, 8};
  Segments segments(config);
  BroadcastRingWriter writer = make_writer(segments, config);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> copied{0}, torn_refused{0}, overrun{0}, accepted_torn{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 3; ++r) {
    readers.emplace_back([&] {
      BroadcastRingReader reader = open_reader(segments);
      std::vector<uint8_t> out(reader.geometry().slot_bytes);
      while (!stop.load(std::memory_order_relaxed)) {
        uint64_t count = reader.message_count();
        if (count == 0) continue;
        auto read = reader.read_message(count - 1, out);
        if (!read.ok()) {
          ADD_FAILURE() << read.status().to_string();
          return;
        }
        switch (read.value().outcome) {
          case BroadcastReadOutcome::kCopied:
            ++copied;
            if (!matches_pattern(count - 1, 2048, std::span(out).first(read.value().length))) ++accepted_torn;
            break;
          case BroadcastReadOutcome::kOverrunDuringCopy: ++torn_refused; break;
          case BroadcastReadOutcome::kOverrun: ++overrun; break;
          default: ADD_FAILURE() << "message " << count - 1 << " was counted but not found";
        }
      }
    });
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  uint64_t written = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    for (int i = 0; i < 64; ++i, ++written) {
      if (!writer.write_message(pattern_payload(written, 2048)).ok()) ADD_FAILURE() << "write " << written;
    }
  }
  stop = true;
  for (auto& thread : readers) thread.join();
  std::printf("writer: %llu messages; readers: %llu copied, %llu torn copies refused, %llu overruns\n",
              (unsigned long long)written, (unsigned long long)copied.load(), (unsigned long long)torn_refused.load(),
              (unsigned long long)overrun.load());
  EXPECT_EQ(accepted_torn.load(), 0u) << "a reader accepted a payload that mixes two messages";
  EXPECT_GT(copied.load(), 0u);
  EXPECT_GT(written, 1000u);
}

TEST(BroadcastRing, ReadersRacingTheWriterNeverAcceptATornSnapshot) {
  const BroadcastRingConfig config{2, 8, 4096};
  Segments segments(config);
  BroadcastRingWriter writer = make_writer(segments, config);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> copied{0}, busy{0}, accepted_torn{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 3; ++r) {
    readers.emplace_back([&] {
      BroadcastRingReader reader = open_reader(segments);
      std::vector<uint8_t> out(reader.geometry().snapshot_bytes);
      while (!stop.load(std::memory_order_relaxed)) {
        auto read = reader.read_snapshot(out, 4);
        if (!read.ok()) {
          ADD_FAILURE() << read.status().to_string();
          return;
        }
        if (read.value().outcome == BroadcastReadOutcome::kBusy) ++busy;
        if (read.value().outcome != BroadcastReadOutcome::kCopied) continue;
        ++copied;
        // The payload of the snapshot stored with message count c is pattern c.
        if (!matches_pattern(read.value().message_count, 4096, std::span(out).first(read.value().length))) {
          ++accepted_torn;
        }
      }
    });
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
  uint64_t written = 0;
  while (std::chrono::steady_clock::now() < deadline) {
    for (int i = 0; i < 16; ++i, ++written) {
      if (!writer.write_snapshot(written, pattern_payload(written, 4096)).ok()) ADD_FAILURE() << "write " << written;
    }
  }
  stop = true;
  for (auto& thread : readers) thread.join();
  std::printf("writer: %llu snapshots; readers: %llu copied, %llu gave up\n", (unsigned long long)written,
              (unsigned long long)copied.load(), (unsigned long long)busy.load());
  EXPECT_EQ(accepted_torn.load(), 0u) << "a reader accepted a snapshot that mixes two snapshots";
  EXPECT_GT(copied.load(), 0u);
}

}  // namespace
}  // namespace membar::protocol
