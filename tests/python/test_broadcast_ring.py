"""The C++ broadcast ring through torch.classes.membar.BroadcastRing and SharedMemoryRing: the
binding's errors, a corrupt segment, an overrun."""
import mmap
import uuid

import numpy as np
import pytest
import torch

import membar  # noqa: F401 (loads the ops library)
from membar.logra.sync import SharedMemoryRing, SyncOverrun

BroadcastRing = torch.classes.membar.BroadcastRing


def _address(buffer):
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def _payload(sequence, length):
    generator = torch.Generator().manual_seed(sequence)
    return torch.randint(0, 256, (length,), dtype=torch.uint8, generator=generator)


def test_binding_round_trips_and_reports_overruns_and_misuse():
    ring_bytes, snapshot_bytes = BroadcastRing.segment_bytes(3, 100, 300)
    ring_memory, snapshot_memory = mmap.mmap(-1, ring_bytes), mmap.mmap(-1, snapshot_bytes)
    writer = BroadcastRing.create(_address(ring_memory), ring_bytes, _address(snapshot_memory), snapshot_bytes,
                                  3, 100, 300)
    reader = BroadcastRing.open(_address(ring_memory), ring_bytes, _address(snapshot_memory), snapshot_bytes)
    try:
        assert list(reader.geometry()) == [3, 104, 304]
        lengths = [int(n) for n in torch.randint(0, 105, (7,))]
        for sequence, length in enumerate(lengths):
            assert writer.write_message(_payload(sequence, length)) == sequence
        assert reader.message_count() == writer.message_count() == 7
        for sequence, length in enumerate(lengths):
            outcome, payload = reader.read_message(sequence)
            if sequence < 4:
                assert outcome == 2 and payload.numel() == 0  # overwritten: the ring holds 3
            else:
                assert outcome == 0 and torch.equal(payload, _payload(sequence, length))
        assert reader.read_message(7)[0] == 1  # not written yet
        assert reader.read_snapshot(10)[0] == 1  # no snapshot yet
        writer.write_snapshot(7, _payload(99, 300))
        outcome, count, payload = reader.read_snapshot(10)
        assert outcome == 0 and count == 7 and torch.equal(payload, _payload(99, 300))
        with pytest.raises(ValueError, match="does not fit"):
            writer.write_message(torch.zeros(105, dtype=torch.uint8))
        with pytest.raises(ValueError, match="uint8"):
            writer.write_message(torch.zeros(4, dtype=torch.int32))
        with pytest.raises(RuntimeError, match="only reads"):
            reader.write_message(_payload(0, 4))
    finally:
        writer.close()
        reader.close()
    with pytest.raises(RuntimeError, match="after close"):
        reader.read_message(0)


def test_corrupt_segment_is_refused_with_a_clear_error():
    name = f"membar_test_{uuid.uuid4().hex[:12]}"
    ring = SharedMemoryRing(name, create=True, slot_count=4, slot_bytes=16, snapshot_bytes=16)
    try:
        ring.write_message(b"hello")
        ring._ring.buf[24:32] = (1 << 40).to_bytes(8, "little")  # the header's slot count
        with pytest.raises(ValueError, match="is not a LoGRA policy ring: .*at most"):
            SharedMemoryRing(name, create=False)
        ring._ring.buf[24:32] = (4).to_bytes(8, "little")
        reader = SharedMemoryRing(name, create=False)
        # A slot whose length exceeds the slot: an error, not a read past it.
        ring._ring.buf[64 + 8:64 + 16] = (1 << 50).to_bytes(8, "little")
        with pytest.raises(ValueError, match="claims"):
            reader.read_message(0)
        reader.close()
    finally:
        ring.close()
    with pytest.raises(RuntimeError, match="closed"):
        ring.read_message(0)


def test_reader_follows_the_writer_and_detects_an_overrun():
    name = f"membar_test_{uuid.uuid4().hex[:12]}"
    writer = SharedMemoryRing(name, create=True, slot_count=2, slot_bytes=8, snapshot_bytes=8)
    reader = SharedMemoryRing(name, create=False)
    try:
        for sequence in range(3):
            writer.write_message(bytes([sequence]) * (sequence + 1))
        assert reader.latest_sequence() == 3
        with pytest.raises(SyncOverrun, match="overwritten"):
            reader.read_message(0)
        assert reader.read_message(2) == b"\x02\x02\x02"
    finally:
        reader.close()
        writer.close()
