// libFuzzer target for the protocol v2 parsers (common/protocol.cpp, wire_socket.cpp's framing)
// and ring descriptors. Everything the daemon or client decodes from a peer goes through here: no
// input may crash, leak, read out of bounds or allocate by an unchecked count, every accepted
// payload must re-encode to exactly the bytes it came from (the encodings are canonical), every
// accepted ring request must obey its opcode's row (Note [One opcode table]), and a ring whose
// indices a peer wrote must never hand out an entry from outside it.
// Built and run by fuzz/run_protocol_fuzzer.sh (clang++ -fsanitize=fuzzer,address,undefined);
// sequences of requests against a real engine are fuzz/session_fuzzer.cpp's.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "membar/common/wire_socket.h"
#include "membar/protocol/ring.h"
#include "membar/protocol/v2.h"

namespace v2 = membar::protocol::v2;

namespace {

void require(bool condition) {
  if (!condition) __builtin_trap();
}

template <typename T>
void same_bytes(const T& value, std::span<const uint8_t> payload) {
  require(payload.size() == sizeof(T) && std::memcmp(&value, payload.data(), sizeof(T)) == 0);
}

void decode_payload_of(uint16_t type, std::span<const uint8_t> payload) {
  switch (static_cast<v2::MessageType>(type)) {
    case v2::MessageType::kHello: (void)v2::decode_hello(payload); break;
    case v2::MessageType::kHelloReply: (void)v2::decode_hello_reply(payload); break;
    case v2::MessageType::kFrameGrant: {
      auto grant = v2::decode_frame_grant(payload);
      if (grant.ok()) require(grant.value().sequence != 0 && v2::event_sequence(v2::MessageType::kFrameGrant, payload) ==
                                                                   grant.value().sequence);
      break;
    }
    case v2::MessageType::kFrameRevoke: (void)v2::decode_frame_event(payload); break;
    case v2::MessageType::kSlabGrant: {
      auto grant = v2::decode_slab_grant(payload);
      if (grant.ok()) require(grant.value().bytes == uint64_t{grant.value().frames} * membar::kFrameBytes);
      break;
    }
    case v2::MessageType::kSlabRevoke: (void)v2::decode_slab_event(payload); break;
    case v2::MessageType::kFrameMap:
    case v2::MessageType::kFrameUnmap: {
      auto map = v2::decode_frame_map(payload);
      if (map.ok()) require(map.value().space != 0 && map.value().tier <= 1);
      break;
    }
    case v2::MessageType::kShutdown: (void)v2::decode_shutdown(payload); break;
    case v2::MessageType::kStatsRequest: {
      auto request = v2::decode_stats_request(payload);
      if (request.ok()) require(request.value().max_spaces >= 1 && request.value().max_spaces <= v2::kMaxStatsSpaces);
      break;
    }
    case v2::MessageType::kPing:
    case v2::MessageType::kPong: (void)v2::decode_ping(payload); break;
    case v2::MessageType::kError: (void)v2::decode_error(payload); break;
    case v2::MessageType::kChannelGrant: (void)v2::decode_channel_notice(payload); break;
    case v2::MessageType::kStatsReply: (void)v2::decode_stats(payload); break;
  }
}

// What validate_request promises about an accepted request (the opcode table's rules).
void check_accepted(const v2::RequestV2& request, uint64_t capacity) {
  require(request.opcode >= v2::kFirstOpcode && request.opcode <= v2::kLastOpcode);
  require(request.payload_bytes <= capacity);
  require(uint64_t{request.first_page} + request.page_count <= 0xffffffffull);
  require(request.reserved0 == 0);
  for (uint8_t byte : request.reserved1) require(byte == 0);
  switch (static_cast<v2::Opcode>(request.opcode)) {
    case v2::Opcode::kAcquire:
      require((request.flags & ~3u) == 0 && request.space != 0 && request.page_count != 0 && request.argument == 0);
      break;
    case v2::Opcode::kRelease:
      require((request.flags & ~3u) == 0 && request.space != 0 && request.page_count != 0);
      require(((request.flags & v2::kReleaseAfterMarker) != 0) == (request.argument != 0));
      break;
    case v2::Opcode::kCreateSpace:
      require(request.space == 0 && request.first_page == 0 && request.page_count != 0);
      require(request.argument >= 1 && request.argument <= membar::kMaxPageBytes);
      require(request.payload_bytes >= 1 && request.payload_bytes <= v2::kMaxSpaceNameBytes);
      break;
    case v2::Opcode::kNop: case v2::Opcode::kStats:
      require(request.space == 0 && request.page_count == 0 && request.payload_bytes == 0 && request.argument == 0);
      break;
    case v2::Opcode::kCreateChannel:
      require(request.argument >= 1 && request.argument <= (64ull << 30));
      break;
    case v2::Opcode::kCloseChannel: case v2::Opcode::kPublishChannel:
      require(request.argument >= 1 && request.argument <= 0xffffffffull);
      break;
    default:
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::span<const uint8_t> input(data + 1, size - 1);
  switch (data[0] % 9) {
    case 0: {  // one socket message: header, then its payload
      auto header = v2::decode_message_header(input);
      if (header.ok()) {
        std::span<const uint8_t> rest = input.subspan(sizeof(v2::MessageHeaderV2));
        if (rest.size() >= header.value().payload_bytes) {
          decode_payload_of(header.value().type, rest.first(header.value().payload_bytes));
        }
      }
      break;
    }
    case 1: {  // a byte stream in arbitrary chunks through the assembler, with descriptors
      membar::wire::MessageAssembler assembler;
      size_t offset = 0;
      int descriptors = 0;
      while (offset < input.size()) {
        size_t chunk = 1 + input[offset] % 64;
        chunk = std::min(chunk, input.size() - offset);
        if (input[offset] % 7 == 0 && descriptors < 8) {
          int pipe_fds[2];
          if (::pipe(pipe_fds) == 0) {
            ::close(pipe_fds[1]);
            assembler.append_fd(pipe_fds[0]);  // the assembler owns it now
            ++descriptors;
          }
        }
        assembler.append(input.subspan(offset, chunk));
        offset += chunk;
        for (;;) {
          auto next = assembler.next();
          if (!next.ok() || !next.value().has_value()) break;
          require(next.value()->fds.size() == next.value()->header.fd_count);
          decode_payload_of(next.value()->header.type, next.value()->payload);
        }
      }
      break;
    }
    case 2: {  // a ring request as the daemon sees it
      if (input.size() < sizeof(v2::RequestV2) + 4) break;
      v2::RequestV2 request;
      std::memcpy(&request, input.data(), sizeof(request));
      uint32_t capacity;
      std::memcpy(&capacity, input.data() + sizeof(request), 4);
      membar::Status status = v2::validate_request(request, capacity);
      if (status.ok()) check_accepted(request, capacity);
      else require(!status.message().empty());
      (void)v2::opcode_name(request.opcode);
      break;
    }
    case 3: {  // schedule payloads: canonical round trip
      auto steps = v2::decode_schedule(input);
      if (steps.ok()) {
        std::vector<uint8_t> again = v2::encode_schedule(steps.value());
        require(again.size() == input.size() && std::memcmp(again.data(), input.data(), input.size()) == 0);
      }
      break;
    }
    case 4: {  // fixed-size events: accepted ones re-encode to the same bytes
      if (input.empty()) break;
      std::span<const uint8_t> payload = input.subspan(1);
      switch (input[0] % 6) {
        case 0: if (auto v = v2::decode_frame_grant(payload); v.ok()) same_bytes(v.value(), payload); break;
        case 1: if (auto v = v2::decode_frame_event(payload); v.ok()) same_bytes(v.value(), payload); break;
        case 2: if (auto v = v2::decode_slab_grant(payload); v.ok()) same_bytes(v.value(), payload); break;
        case 3: if (auto v = v2::decode_frame_map(payload); v.ok()) same_bytes(v.value(), payload); break;
        case 4: if (auto v = v2::decode_channel_notice(payload); v.ok()) same_bytes(v.value(), payload); break;
        default: if (auto v = v2::decode_hello_reply(payload); v.ok()) same_bytes(v.value(), payload); break;
      }
      break;
    }
    case 5: {  // stats payloads (Note [Stats payload formats]): whatever decodes, format 1 or 2 with
               // any counter counts, re-encodes as canonical format 2, which decodes to the same
               // encoding again
      auto stats = v2::decode_stats(input);
      if (stats.ok()) {
        std::vector<uint8_t> again = v2::encode_stats(stats.value());
        auto twice = v2::decode_stats(again);
        require(twice.ok());
        require(v2::encode_stats(twice.value()) == again);
      }
      break;
    }
    case 6: {  // a segment header as the client maps it
      std::vector<uint8_t> copy(input.begin(), input.end());
      auto layout = v2::read_segment_header(copy.data(), copy.size());
      if (layout.ok()) {
        require(layout.value().segment_bytes <= copy.size());
        require(layout.value().response_payload_offset + layout.value().response_payload_bytes <=
                layout.value().segment_bytes);
      }
      break;
    }
    case 7: {  // completions and names
      if (input.size() >= sizeof(v2::CompletionV2)) {
        v2::CompletionV2 completion;
        std::memcpy(&completion, input.data(), sizeof(completion));
        if (v2::validate_completion(completion, 4096).ok()) {
          require(membar::status_code_is_known(completion.status) && completion.payload_bytes <= 4096);
        }
      }
      std::string_view name(reinterpret_cast<const char*>(input.data()), input.size());
      if (v2::validate_name(name, "space").ok()) {
        require(!name.empty() && name.size() <= v2::kMaxSpaceNameBytes);
        for (char c : name) require(c > 0x20 && c < 0x7f);
      }
      break;
    }
    case 8: {  // a ring whose indices the other end wrote: entries only from inside the ring
      if (input.size() < 17) break;
      constexpr uint32_t kCapacity = 8;
      std::vector<uint8_t> memory(sizeof(v2::RingControlV2) + kCapacity * sizeof(v2::RequestV2), 0);
      auto* control = reinterpret_cast<v2::RingControlV2*>(memory.data());
      membar::protocol::RingEnd<v2::RequestV2> consumer(memory.data(), kCapacity);
      membar::protocol::RingEnd<v2::RequestV2> producer(memory.data(), kCapacity);
      uint64_t head, tail;
      std::memcpy(&head, input.data(), 8);
      std::memcpy(&tail, input.data() + 8, 8);
      for (size_t i = 16; i < input.size(); ++i) {
        switch (input[i] % 4) {
          case 0: control->head = head + input[i]; break;  // a lying producer
          case 1: control->tail = tail + input[i]; break;  // a lying consumer
          case 2: {
            v2::RequestV2 entry{};
            entry.sequence = i;
            (void)producer.try_push(entry);
            break;
          }
          default: {
            v2::RequestV2 out;
            int popped = consumer.try_pop(out);
            require(popped >= -1 && popped <= 1);
            break;
          }
        }
      }
      break;
    }
  }
  return 0;
}
