// libFuzzer target for the protocol v1 parser (libclient/protocol_v1.cpp, wire_socket.cpp's
// framing). Everything the daemon or client decodes from a peer goes through here: no input may
// crash, leak, read out of bounds or allocate by an unchecked count, and every accepted payload
// must re-encode to exactly the bytes it came from (the encodings are canonical).
// Built and run by fuzz/run_protocol_fuzzer.sh (clang++ -fsanitize=fuzzer,address,undefined).
#include <cstdint>
#include <cstring>
#include <vector>

#include "membar/protocol/v1.h"
#include "membar/common/wire_socket.h"

namespace v1 = membar::protocol::v1;

namespace {

void require(bool condition) {
  if (!condition) __builtin_trap();
}

void decode_payload_of(uint16_t type, std::span<const uint8_t> payload) {
  switch (static_cast<v1::MessageType>(type)) {
    case v1::MessageType::kHello: (void)v1::decode_hello(payload); break;
    case v1::MessageType::kHelloReply: (void)v1::decode_hello_reply(payload); break;
    case v1::MessageType::kFrameGrant:
    case v1::MessageType::kFrameRevoke: (void)v1::decode_frame_notice(payload); break;
    case v1::MessageType::kShutdown: (void)v1::decode_shutdown(payload); break;
    case v1::MessageType::kPing:
    case v1::MessageType::kPong: (void)v1::decode_ping(payload); break;
    case v1::MessageType::kError: (void)v1::decode_error(payload); break;
    case v1::MessageType::kChannelGrant: (void)v1::decode_channel_notice(payload); break;
    case v1::MessageType::kStatsReply: (void)v1::decode_stats(payload); break;
    default: break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::span<const uint8_t> input(data + 1, size - 1);
  switch (data[0] % 8) {
    case 0: {  // one socket message: header, then its payload
      auto header = v1::decode_message_header(input);
      if (header.ok()) {
        std::span<const uint8_t> rest = input.subspan(sizeof(v1::MessageHeaderV1));
        if (rest.size() >= header.value().payload_bytes) {
          decode_payload_of(header.value().type, rest.first(header.value().payload_bytes));
        }
      }
      break;
    }
    case 1: {  // a byte stream in arbitrary chunks through the assembler
      membar::wire::MessageAssembler assembler;
      size_t offset = 0;
      while (offset < input.size()) {
        size_t chunk = 1 + input[offset] % 64;
        chunk = std::min(chunk, input.size() - offset);
        assembler.append(input.subspan(offset, chunk));
        offset += chunk;
        for (;;) {
          auto next = assembler.next();
          if (!next.ok() || !next.value().has_value()) break;
          decode_payload_of(next.value()->header.type, next.value()->payload);
        }
      }
      break;
    }
    case 2: {  // a ring request as the daemon sees it
      if (input.size() < sizeof(v1::RequestV1) + 4) break;
      v1::RequestV1 request;
      std::memcpy(&request, input.data(), sizeof(request));
      uint32_t capacity;
      std::memcpy(&capacity, input.data() + sizeof(request), 4);
      membar::Status status = v1::validate_request(request, capacity);
      // Whatever is accepted has a payload that fits, a range that does not overflow, and
      // zeros in every reserved byte.
      if (status.ok()) {
        require(request.payload_bytes <= capacity);
        require(uint64_t{request.first_page} + request.page_count <= 0xffffffffull);
        require(request.reserved0 == 0);
        for (uint8_t byte : request.reserved1) require(byte == 0);
      }
      break;
    }
    case 3: {  // schedule payloads: canonical round trip
      auto steps = v1::decode_schedule(input);
      if (steps.ok()) {
        std::vector<uint8_t> again = v1::encode_schedule(steps.value());
        require(again.size() == input.size() && std::memcmp(again.data(), input.data(), input.size()) == 0);
      }
      break;
    }
    case 4: {  // locations payloads
      if (input.size() < 4) break;
      uint32_t expected;
      std::memcpy(&expected, input.data(), 4);
      auto locations = v1::decode_locations(input.subspan(4), expected);
      if (locations.ok()) require(locations.value().size() == expected);
      break;
    }
    case 5: {  // stats payloads: canonical round trip
      auto stats = v1::decode_stats(input);
      if (stats.ok()) {
        std::vector<uint8_t> again = v1::encode_stats(stats.value());
        // The encoding is the input itself, or, for a payload from before the per-space residency
        // records, the input followed by those records (zeros: 4 + 52 bytes per space).
        const size_t records = 4 + stats.value().spaces.size() * (4 + 6 * 8);
        require(again.size() == input.size() || again.size() == input.size() + records);
        require(std::memcmp(again.data(), input.data(), input.size()) == 0);
        auto back = v1::decode_stats(again);
        require(back.ok() && v1::encode_stats(back.value()) == again);
      }
      break;
    }
    case 6: {  // a segment header as the client maps it
      std::vector<uint8_t> copy(input.begin(), input.end());
      auto layout = v1::read_segment_header(copy.data(), copy.size());
      if (layout.ok()) require(layout.value().segment_bytes <= copy.size());
      break;
    }
    case 7: {  // completions and names
      if (input.size() >= sizeof(v1::CompletionV1)) {
        v1::CompletionV1 completion;
        std::memcpy(&completion, input.data(), sizeof(completion));
        (void)v1::validate_completion(completion, 4096);
      }
      std::string_view name(reinterpret_cast<const char*>(input.data()), input.size());
      (void)v1::validate_space_name(name);
      break;
    }
  }
  return 0;
}
