// The broadcast ring (membar/protocol/broadcast_ring.h, Note [Broadcast ring]) as a TorchScript
// custom class, torch.classes.membar.BroadcastRing, over two mappings that Python made (POSIX
// shared memory, or runtime channels) and hands over as (address, bytes). The mappings must
// outlive the object, or close() must come first: membar/logra/sync.py's SharedMemoryRing keeps
// both and closes in that order. Bindings only validate and translate: INVALID_ARGUMENT and
// DATA_LOSS become ValueError (a payload that does not fit, a segment that is not a ring), other
// codes RuntimeError. Payloads are 1-D uint8 CPU tensors.
//
//   BroadcastRing.segment_bytes(int slot_count, int slot_bytes, int snapshot_bytes) -> int[2]
//       the bytes the ring and the snapshot segment need: [ring, snapshot]
//   BroadcastRing.create(int ring_address, int ring_bytes, int snapshot_address, int snapshot_bytes,
//                        int slot_count, int slot_bytes, int snapshot_payload_bytes) -> BroadcastRing
//       formats both segments; the object writes, and reads like any reader
//   BroadcastRing.open(int ring_address, int ring_bytes, int snapshot_address, int snapshot_bytes)
//       -> BroadcastRing   a reader (the mappings may be read-only)
//   geometry() -> int[3]   [slot_count, slot_bytes, snapshot_bytes] (payload bytes, multiples of 8)
//   message_count() -> int   messages written so far (the writer's own count on the writing side)
//   write_message(Tensor payload) -> int   the message's sequence
//   write_snapshot(int message_count, Tensor payload) -> ()
//   read_message(int sequence) -> (int outcome, Tensor payload)
//   read_snapshot(int attempts) -> (int outcome, int message_count, Tensor payload)
//       outcome: BroadcastReadOutcome's number (0 copied, 1 not written, 2 overrun, 3 overrun
//       during the copy, 4 busy); payload is empty unless copied
//   close() -> ()   drops the pointers into the mappings; later calls raise
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "membar/protocol/broadcast_ring.h"

namespace membar::bindings {
namespace {

namespace protocol = membar::protocol;

void check_ok(const Status& status, const char* what) {
  if (status.ok()) return;
  const bool value_error = status.code() == StatusCode::INVALID_ARGUMENT || status.code() == StatusCode::DATA_LOSS;
  TORCH_CHECK_VALUE(!value_error, "broadcast ring ", what, ": ", status.message());
  TORCH_CHECK(false, "broadcast ring ", what, ": ", status.message());
}

template <typename T>
T take(Result<T> result, const char* what) {
  check_ok(result.status(), what);
  return std::move(result).value();
}

uint64_t to_u64(int64_t value, const char* name) {
  TORCH_CHECK_VALUE(value >= 0, "broadcast ring: ", name, " must not be negative, got ", value, ".");
  return uint64_t(value);
}

// A mapping Python made: [address, address + bytes).
template <typename Byte>
std::span<Byte> mapping(int64_t address, int64_t bytes, const char* name) {
  TORCH_CHECK_VALUE(address > 0 && bytes > 0, "broadcast ring: the ", name,
                    " mapping needs a nonzero address and size, got ", address, " and ", bytes, ".");
  return {reinterpret_cast<Byte*>(uintptr_t(address)), size_t(bytes)};
}

std::span<const uint8_t> payload_bytes(const at::Tensor& payload) {
  TORCH_CHECK_VALUE(payload.device().is_cpu() && payload.scalar_type() == at::kByte && payload.dim() == 1 &&
                        payload.is_contiguous(),
                    "broadcast ring: payloads are contiguous 1-D uint8 CPU tensors, got ", payload.scalar_type(), " ",
                    payload.sizes(), " on ", payload.device(), ".");
  return {payload.data_ptr<uint8_t>(), size_t(payload.numel())};
}

at::Tensor copied_prefix(const at::Tensor& out, const protocol::BroadcastRead& read) {
  return read.outcome == protocol::BroadcastReadOutcome::kCopied ? out.narrow(0, 0, int64_t(read.length))
                                                                  : out.narrow(0, 0, 0);
}

class BroadcastRing : public torch::CustomClassHolder {
 public:
  static std::vector<int64_t> segment_bytes(int64_t slot_count, int64_t slot_bytes, int64_t snapshot_bytes) {
    protocol::BroadcastRingConfig config{to_u64(slot_count, "slot_count"), to_u64(slot_bytes, "slot_bytes"),
                                         to_u64(snapshot_bytes, "snapshot_bytes")};
    auto geometry = take(protocol::broadcast_ring_geometry(config), "segment_bytes");
    return {int64_t(geometry.ring_segment_bytes), int64_t(geometry.snapshot_segment_bytes)};
  }

  static c10::intrusive_ptr<BroadcastRing> create(int64_t ring_address, int64_t ring_bytes, int64_t snapshot_address,
                                                  int64_t snapshot_bytes, int64_t slot_count, int64_t slot_bytes,
                                                  int64_t snapshot_payload_bytes) {
    protocol::BroadcastRingConfig config{to_u64(slot_count, "slot_count"), to_u64(slot_bytes, "slot_bytes"),
                                         to_u64(snapshot_payload_bytes, "snapshot_bytes")};
    auto ring = mapping<uint8_t>(ring_address, ring_bytes, "ring");
    auto snapshot = mapping<uint8_t>(snapshot_address, snapshot_bytes, "snapshot");
    auto self = c10::make_intrusive<BroadcastRing>();
    self->writer_ = take(protocol::BroadcastRingWriter::create(ring, snapshot, config), "create");
    self->reader_ = take(protocol::BroadcastRingReader::open(ring, snapshot), "create");
    return self;
  }

  static c10::intrusive_ptr<BroadcastRing> open(int64_t ring_address, int64_t ring_bytes, int64_t snapshot_address,
                                                int64_t snapshot_bytes) {
    auto self = c10::make_intrusive<BroadcastRing>();
    self->reader_ = take(protocol::BroadcastRingReader::open(mapping<const uint8_t>(ring_address, ring_bytes, "ring"),
                                                             mapping<const uint8_t>(snapshot_address, snapshot_bytes,
                                                                                    "snapshot")),
                         "open");
    return self;
  }

  std::vector<int64_t> geometry() const {
    const auto& g = reader().geometry();
    return {int64_t(g.slot_count), int64_t(g.slot_bytes), int64_t(g.snapshot_bytes)};
  }

  int64_t message_count() const {
    return int64_t(writer_ ? writer_->message_count() : reader().message_count());
  }

  int64_t write_message(const at::Tensor& payload) {
    return int64_t(take(writer().write_message(payload_bytes(payload)), "write_message"));
  }

  void write_snapshot(int64_t message_count, const at::Tensor& payload) {
    check_ok(writer().write_snapshot(to_u64(message_count, "message_count"), payload_bytes(payload)),
             "write_snapshot");
  }

  std::tuple<int64_t, at::Tensor> read_message(int64_t sequence) const {
    at::Tensor out = at::empty({int64_t(reader().geometry().slot_bytes)}, at::kByte);
    auto read = take(reader().read_message(to_u64(sequence, "sequence"),
                                           {out.data_ptr<uint8_t>(), size_t(out.numel())}),
                     "read_message");
    return {int64_t(read.outcome), copied_prefix(out, read)};
  }

  std::tuple<int64_t, int64_t, at::Tensor> read_snapshot(int64_t attempts) const {
    TORCH_CHECK_VALUE(attempts >= 1 && attempts <= int64_t(UINT32_MAX),
                      "broadcast ring read_snapshot: attempts must be in [1, 2^32), got ", attempts, ".");
    at::Tensor out = at::empty({int64_t(reader().geometry().snapshot_bytes)}, at::kByte);
    auto read = take(reader().read_snapshot({out.data_ptr<uint8_t>(), size_t(out.numel())}, uint32_t(attempts)),
                     "read_snapshot");
    return {int64_t(read.outcome), int64_t(read.message_count), copied_prefix(out, read)};
  }

  void close() {
    writer_.reset();
    reader_.reset();
  }

 private:
  protocol::BroadcastRingWriter& writer() {
    TORCH_CHECK(writer_.has_value(), reader_ ? "broadcast ring: this end only reads (it was opened, not created)."
                                             : "broadcast ring: used after close().");
    return *writer_;
  }
  const protocol::BroadcastRingReader& reader() const {
    TORCH_CHECK(reader_.has_value(), "broadcast ring: used after close().");
    return *reader_;
  }

  std::optional<protocol::BroadcastRingWriter> writer_;
  std::optional<protocol::BroadcastRingReader> reader_;
};

}  // namespace
}  // namespace membar::bindings

TORCH_LIBRARY_FRAGMENT(membar, m) {
  using membar::bindings::BroadcastRing;
  m.class_<BroadcastRing>("BroadcastRing")
      .def_static("segment_bytes", &BroadcastRing::segment_bytes)
      .def_static("create", &BroadcastRing::create)
      .def_static("open", &BroadcastRing::open)
      .def("geometry", &BroadcastRing::geometry)
      .def("message_count", &BroadcastRing::message_count)
      .def("write_message", &BroadcastRing::write_message)
      .def("write_snapshot", &BroadcastRing::write_snapshot)
      .def("read_message", &BroadcastRing::read_message)
      .def("read_snapshot", &BroadcastRing::read_snapshot)
      .def("close", &BroadcastRing::close);
}
