// libFuzzer target for what a hostile client can make membard do through its ring: sequences of
// requests (raw 64-byte descriptors with payloads, and well-formed requests with fuzzed fields),
// interleaved with the client's socket behaviour (reading its events or not), its stream's
// release markers, corrupted ring indices and disconnects, against a real in-process Engine on
// the host backend, the daemon's RingServer and SessionChannel, and a ChannelRegistry, for up to
// three clients at once. Besides crashes, leaks and undefined behaviour (ASan, UBSan), it checks:
//   - every request completes once, with a known status and its own sequence number, and names
//     no event that was not queued (events_through);
//   - the engine's counters stay exact (Note [Counters]): for each client, its bytes by residency
//     equal the sums over its spaces, and every space's residency bytes add up to its size;
//   - the pools never over-count, and once every client is gone every frame and slab is back
//     (renewed), and no descriptor is left open.
// Built and run by fuzz/run_session_fuzzer.sh (clang++ -fsanitize=fuzzer,address,undefined).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <dirent.h>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "membar/common/wire_socket.h"
#include "membar/engine/backend.h"
#include "membar/engine/channels.h"
#include "membar/engine/engine.h"
#include "membar/protocol/ring.h"
#include "membar/protocol/v2.h"
#include "session.h"
#include "shared_segment.h"

namespace {

using namespace membar;
using namespace membar::runtimed;
namespace v2 = protocol::v2;

void require(bool condition) {
  if (!condition) __builtin_trap();
}

int count_open_fds() {
  int count = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  while (::readdir(dir) != nullptr) ++count;
  ::closedir(dir);
  return count;
}

// Reads the fuzzer's bytes; past the end every read is zero and done() is true.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool done() const { return offset_ >= size_; }
  uint8_t u8() { return offset_ < size_ ? data_[offset_++] : 0; }
  uint16_t u16() { return uint16_t(u8() | (uint16_t(u8()) << 8)); }
  uint32_t u32() { return uint32_t(u16()) | (uint32_t(u16()) << 16); }
  std::vector<uint8_t> take(size_t n) {
    n = std::min(n, size_ - std::min(size_, offset_));
    std::vector<uint8_t> out(data_ + offset_, data_ + offset_ + n);
    offset_ += n;
    return out;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t offset_ = 0;
};

struct FuzzClient {
  ClientId id = 0;
  UniqueFd peer;  // the client's end of the socket
  std::shared_ptr<SessionChannel> channel;
  std::shared_ptr<SharedSegment> segment;
  std::unique_ptr<RingServer> ring;
  protocol::RingEnd<v2::RequestV2> requests;
  protocol::RingEnd<v2::CompletionV2> completions;
  uint64_t sequence = 0;
  uint64_t marker = 0;  // the last release marker this client's "stream" was given
  void* signal_block = nullptr;
  std::atomic<bool> violated{false};
  wire::MessageAssembler assembler;
  bool reading = true;
};

constexpr uint64_t kGpuFrames = 8;
constexpr uint64_t kHostFrames = 16;

class World {
 public:
  World() {
    BackendConfig backend_config;
    backend_config.gpu_pool_bytes = kGpuFrames * kFrameBytes;
    backend_config.host_pool_bytes = kHostFrames * kFrameBytes;
    backend_config.host_slab_frames = 2;
    auto backend = make_host_backend(backend_config);
    require(backend.ok());
    EngineConfig config;
    config.max_spaces_per_client = 16;
    config.max_space_frames_per_client = 4096;
    config.max_schedule_uses = 1 << 16;
    auto engine = Engine::create(std::move(backend).value(), config);
    require(engine.ok());
    engine_ = std::move(engine).value();
  }

  ~World() {
    for (auto& client : clients_) {
      if (client) close(*client);
    }
    // Every frame and slab comes back, renewed, once nobody holds them.
    bool settled = false;
    for (int i = 0; i < 4000 && !settled; ++i) {
      auto stats = engine_->stats(0);
      require(stats.ok());
      settled = stats.value().tiers[0].frames_free == kGpuFrames && stats.value().tiers[1].frames_free == kHostFrames;
      if (!settled) std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
    require(settled);
  }

  FuzzClient* client(uint8_t which) {
    auto& slot = clients_[which % 3];
    if (slot && !slot->ring) slot.reset();
    if (!slot) slot = open(which % 3);
    return slot.get();
  }

  std::unique_ptr<FuzzClient> open(uint8_t index) {
    auto client = std::make_unique<FuzzClient>();
    int pair[2];
    require(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, pair) == 0);
    client->peer.reset(pair[1]);
    client->channel = std::make_shared<SessionChannel>(pair[0], OutboundLimits{1 << 16, 64}, [] {});
    std::shared_ptr<SessionChannel> channel = client->channel;
    ClientEvents events;
    events.gpu_frame_granted = [channel](uint32_t window_frame, int fd) {
      (void)channel->send_event(v2::MessageType::kFrameGrant, v2::FrameGrantV2{0, window_frame, 0}, fd);
      ::close(fd);
    };
    events.gpu_frame_revoked = [channel](uint32_t window_frame) {
      (void)channel->send_event(v2::MessageType::kFrameRevoke, v2::FrameEventV2{0, window_frame, 0, {}});
    };
    events.host_slab_granted = [channel](uint32_t slab, uint32_t frames, int fd) {
      (void)channel->send_event(v2::MessageType::kSlabGrant, v2::SlabGrantV2{0, slab, frames, frames * kFrameBytes}, fd);
      ::close(fd);
    };
    events.host_slab_revoked = [channel](uint32_t slab) {
      (void)channel->send_event(v2::MessageType::kSlabRevoke, v2::SlabEventV2{0, slab, 0});
    };
    events.frame_mapped = [channel](Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame) {
      (void)channel->send_event(v2::MessageType::kFrameMap,
                                v2::FrameMapV2{0, window_frame, static_cast<uint8_t>(tier), {}, space, space_frame});
    };
    events.frame_unmapped = [channel](Tier tier, uint32_t window_frame, SpaceId space, uint32_t space_frame) {
      (void)channel->send_event(v2::MessageType::kFrameUnmap,
                                v2::FrameMapV2{0, window_frame, static_cast<uint8_t>(tier), {}, space, space_frame});
    };
    events.tickets_completed = [channel](Ticket completed) { channel->publish_completed(completed); };
    ClientConfig config;
    config.name = "fuzz" + std::to_string(index);
    config.uid = index == 2 ? 1000 : 0;  // two users: channel namespaces
    if (index == 1) config.gpu_quota_bytes = 2 * kFrameBytes;
    auto id = engine_->client_open(config, std::move(events));
    require(id.ok());
    client->id = id.value();
    auto signal_fd = engine_->client_signal_fd(client->id);
    require(signal_fd.ok());
    client->signal_block = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, signal_fd.value(), 0);
    ::close(signal_fd.value());
    require(client->signal_block != MAP_FAILED);
    auto layout = v2::make_segment_layout(16, 64 << 10, 64 << 10);
    require(layout.ok());
    auto segment = SharedSegment::create(layout.value());
    require(segment.ok());
    client->segment = std::move(segment).value();
    client->channel->set_segment(client->segment);
    uint8_t* base = client->segment->base();
    client->requests = protocol::RingEnd<v2::RequestV2>(base + layout.value().request_ring_offset, 16);
    client->completions = protocol::RingEnd<v2::CompletionV2>(base + layout.value().completion_ring_offset, 16);
    FuzzClient* raw = client.get();
    client->ring = std::make_unique<RingServer>(*engine_, client->id, client->segment, client->channel,
                                                RingServerConfig{20, &channels_, config.uid},
                                                [raw](std::string) { raw->violated = true; });
    client->ring->start();
    return client;
  }

  // As the daemon closes a connection (server.cpp close_connection).
  void close(FuzzClient& client) {
    if (!client.ring) return;
    channels_.close_all(client.id);
    require(engine_->client_close(client.id).ok());
    client.ring->stop();
    client.ring.reset();
    client.channel->close();
    client.segment.reset();
    ::munmap(client.signal_block, 4096);
    client.signal_block = nullptr;
  }

  // Reads what the client's socket holds (a client that reads its events) and lets the daemon's
  // queue flush into the room made.
  void read_socket(FuzzClient& client) {
    if (!client.ring) return;
    (void)client.assembler.read_available(client.peer.get());
    for (;;) {
      auto next = client.assembler.next();
      require(next.ok());  // the daemon only ever sends well-formed messages
      if (!next.value().has_value()) break;
    }
    (void)client.channel->flush();
  }

  // The client's stream has run everything it was given.
  static void stream_catches_up(FuzzClient& client) {
    __atomic_store_n(static_cast<uint64_t*>(client.signal_block) + kSignalReleased, client.marker, __ATOMIC_RELEASE);
  }

  void call(FuzzClient& client, v2::RequestV2 request, const std::vector<uint8_t>& payload) {
    const v2::SegmentLayout& layout = client.segment->layout();
    uint8_t* base = client.segment->base();
    if (!payload.empty()) {
      std::memcpy(base + layout.request_payload_offset, payload.data(),
                  std::min<size_t>(payload.size(), layout.request_payload_bytes));
    }
    request.sequence = ++client.sequence;
    if ((request.flags & v2::kReleaseAfterMarker) != 0 && (request.opcode == uint16_t(v2::Opcode::kRelease) ||
                                                            request.opcode == uint16_t(v2::Opcode::kCopyPages))) {
      client.marker = std::max<uint64_t>(client.marker, request.argument);
    }
    if (!client.requests.try_push(request)) {
      require(client.violated.load());
      return;
    }
    auto start = std::chrono::steady_clock::now();
    v2::CompletionV2 completion;
    for (;;) {
      int popped = client.completions.try_pop(completion);
      require(popped >= 0);
      if (popped > 0) break;
      if (client.violated.load()) return;
      auto waited = std::chrono::steady_clock::now() - start;
      if (waited > std::chrono::milliseconds(2)) stream_catches_up(client);
      if (client.reading) read_socket(client);
      // A request never answered is a hang: the ring thread waits on something that will not come.
      require(waited < std::chrono::seconds(20));
      std::this_thread::yield();
    }
    require(completion.sequence == request.sequence);
    require(completion.opcode == request.opcode);
    require(status_code_is_known(completion.status));
    require(v2::validate_completion(completion, layout.response_payload_bytes).ok());
    require(completion.events_through <= client.channel->events_queued());
  }

  // Note [Counters]: the incremental counters equal what a walk would find.
  void check_counters() {
    auto all = engine_->stats(0);
    require(all.ok());
    for (const TierStats& tier : all.value().tiers) {
      require(tier.frames_free + tier.frames_preparing <= tier.frames_total);
    }
    for (const ClientStats& client : all.value().clients) {
      uint64_t sums[4] = {0, 0, 0, 0};
      uint64_t bytes = 0;
      for (const SpaceInfo& space : all.value().spaces) {
        if (space.client != client.client) continue;
        uint64_t size = space.page_bytes * space.page_count;
        require(space.bytes_gpu + space.bytes_host + space.bytes_both + space.bytes_none == size);
        require(space.bytes_dirty <= size && space.bytes_pinned <= size);
        sums[0] += space.bytes_gpu;
        sums[1] += space.bytes_host;
        sums[2] += space.bytes_both;
        sums[3] += space.bytes_none;
        bytes += size;
      }
      require(client.bytes_gpu == sums[0] && client.bytes_host == sums[1] && client.bytes_both == sums[2] &&
              client.bytes_none == sums[3]);
      require(client.gpu_frames.current >= 0 && client.host_frames.current >= 0);
      require(uint64_t(client.gpu_frames.current) <= kGpuFrames && uint64_t(client.host_frames.current) <= kHostFrames);
    }
  }

  std::vector<uint8_t> schedule_payload(Input& in) {
    std::vector<ScheduleStep> steps(in.u8() % 6);
    for (ScheduleStep& step : steps) {
      step.ranges.resize(in.u8() % 3);
      for (PageRange& range : step.ranges) range = PageRange{1u + in.u8() % 3, in.u8() % 64u, 1u + in.u8() % 16u};
    }
    return v2::encode_schedule(steps);
  }

  // One well-formed request with fuzzed fields (the decoder's rules hold, the engine decides).
  void structured(FuzzClient& client, Input& in) {
    static const uint64_t kPageSizes[] = {1, 960, 4096, 65536, 98304, 1 << 20, 2 << 20, 3 << 20};
    static const char* kNames[] = {"a", "b", "L00.k", "x"};
    uint16_t opcode = uint16_t(v2::kFirstOpcode + in.u8() % v2::kLastOpcode);
    v2::RequestV2 request{};
    request.opcode = opcode;
    std::vector<uint8_t> payload;
    auto name = [&] {
      std::string text = kNames[in.u8() % 4];
      payload.assign(text.begin(), text.end());
      request.payload_bytes = uint32_t(payload.size());
    };
    switch (static_cast<v2::Opcode>(opcode)) {
      case v2::Opcode::kNop: case v2::Opcode::kStats:
        break;
      case v2::Opcode::kCreateSpace:
        request.argument = kPageSizes[in.u8() % 8];
        request.page_count = 1 + in.u16() % 512;
        name();
        break;
      case v2::Opcode::kDestroySpace:
        request.space = 1 + in.u8() % 4;
        break;
      case v2::Opcode::kSetSchedule:
        payload = schedule_payload(in);
        request.payload_bytes = uint32_t(payload.size());
        break;
      case v2::Opcode::kAdvance:
        request.argument = in.u8() % 8;
        break;
      case v2::Opcode::kCreateChannel:
        request.argument = 1 + uint64_t(in.u16()) * 97;
        name();
        break;
      case v2::Opcode::kOpenChannel:
        name();
        break;
      case v2::Opcode::kCloseChannel: case v2::Opcode::kPublishChannel:
        request.argument = 1 + in.u8() % 8;
        break;
      case v2::Opcode::kCopyPages: {   // (source, destination) pairs, sometimes after a marker
        std::vector<PageRange> pairs(2 * (1 + in.u8() % 3) - (in.u8() % 16 == 0 ? 1 : 0));
        for (PageRange& range : pairs) range = PageRange{1u + in.u8() % 4, in.u8() % 64u, 1u + in.u8() % 16u};
        payload = v2::encode_ranges(pairs);
        request.payload_bytes = uint32_t(payload.size());
        if (in.u8() % 2) {
          request.flags = v2::kCopyAfterMarker;
          request.argument = client.marker + 1 + in.u8() % 2;
        }
        break;
      }
      case v2::Opcode::kPrefetchRanges: {   // 1-4 ranges, any space id, some past a space's end
        std::vector<PageRange> ranges(1 + in.u8() % 4);
        for (PageRange& range : ranges) range = PageRange{1u + in.u8() % 4, in.u8() % 64u, 1u + in.u8() % 16u};
        payload = v2::encode_ranges(ranges);
        request.payload_bytes = uint32_t(payload.size());
        break;
      }
      default: {  // the page-range opcodes
        request.space = 1 + in.u8() % 4;
        request.first_page = in.u8() % 64;
        request.page_count = 1 + in.u8() % 32;
        uint8_t bits = in.u8();
        if (opcode == uint16_t(v2::Opcode::kAcquire)) request.flags = bits & 3;
        if (opcode == uint16_t(v2::Opcode::kReleaseHost)) request.flags = bits & v2::kReleaseDirty;
        if (opcode == uint16_t(v2::Opcode::kRelease)) {
          request.flags = bits & 3;
          if (request.flags & v2::kReleaseAfterMarker) request.argument = client.marker + 1 + (bits >> 6);
        }
      }
    }
    call(client, request, payload);
  }

  void step(Input& in) {
    uint8_t op = in.u8();
    FuzzClient* client = this->client(op >> 5);
    switch (op % 8) {
      case 0:
      case 1:
      case 2:
        structured(*client, in);
        break;
      case 3: {  // a raw descriptor and payload, as the client wrote them
        v2::RequestV2 request;
        std::vector<uint8_t> bytes = in.take(sizeof(request));
        bytes.resize(sizeof(request), 0);
        std::memcpy(&request, bytes.data(), sizeof(request));
        call(*client, request, in.take(in.u8()));
        break;
      }
      case 4:  // the client stops (or starts again) reading its socket
        client->reading = !client->reading;
        if (client->reading) read_socket(*client);
        break;
      case 5:  // the client's stream runs on
        stream_catches_up(*client);
        break;
      case 6: {  // ring abuse: an impossible head
        auto* control = reinterpret_cast<v2::RingControlV2*>(client->segment->base() +
                                                            client->segment->layout().request_ring_offset);
        std::atomic_ref<uint64_t>(control->head).store(uint64_t(in.u32()) << 8);
        client->requests.ring_doorbell();
        for (int i = 0; i < 2000 && !client->violated.load(); ++i) std::this_thread::sleep_for(std::chrono::microseconds(50));
        close(*client);  // the daemon drops a client that corrupts its ring
        break;
      }
      default:  // disconnect (kill -9)
        close(*client);
        break;
    }
    // A client over its queue bound is dropped, as the daemon's loop does.
    if (client->ring && client->channel->overflowed()) close(*client);
    check_counters();
  }

 private:
  std::unique_ptr<Engine> engine_;
  ChannelRegistry channels_;
  std::unique_ptr<FuzzClient> clients_[3];
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  int fds_before = count_open_fds();
  {
    World world;
    Input in(data, size);
    for (int steps = 0; steps < 64 && !in.done(); ++steps) world.step(in);
  }
  require(count_open_fds() == fds_before);
  return 0;
}
