"""Seed-based policy sync: the trainer publishes (seed, step, alpha * eta * U per matrix) per
update; rollout processes regenerate A from the key and apply the update themselves.

Note [Policy sync transport]
Rationale: per update only d x r fp32 values per matrix and a key travel instead of d x k
weights. Rollout processes come and go (late joiners, crashes); the trainer must never wait for
them. bf16 rollout weights swallow deltas below |w| / 256, so a receiver that applied updates to
bf16 weights directly would drift from the trainer.
Approach: membar's broadcast ring (Note [Broadcast ring] in include/membar/protocol/
broadcast_ring.h, reached through torch.classes.membar.BroadcastRing): fixed-size message slots
plus a double-buffered snapshot area, both in shared memory: two channels of the membar runtime
(``Runtime.create_channel``: memory made by the daemon, mapped read-only by subscribers, so a
reader cannot corrupt what the trainer wrote) when the publisher and subscribers are given a
Runtime, else two POSIX shared-memory segments. Python maps the segments; the C++ ring writes and
reads them under a seqlock per slot and per snapshot buffer. The writer never looks at readers, so
a slow or dead subscriber cannot stall or corrupt the trainer; a reader that fell more than a ring
behind gets SyncOverrun and re-anchors from the newest snapshot (full fp32 weights and the number
of updates they contain). Subscribers keep fp32 masters of the targeted weights, apply every
update to the masters with the same fused kernel as the trainer, and copy the masters into the
model's (bf16) weights, so they match the trainer's authoritative weights exactly when both run
the same kernel and device type, and within bf16 rounding otherwise. A receiver without masters
(keep_masters=False) applies updates to its bf16 weights with the trainer's stochastic rounding
(same per-update seed, derived from the message): it stays bit-identical to a bf16-only trainer
and unbiased against an fp32 one.
Limitations: runtime channels live while the trainer's Runtime is connected: subscribers keep
reading what they mapped, but a subscriber cannot join after the trainer's runtime went away.
With an embedded runtime only subscribers in the trainer's own process find the channels. POSIX
segments are unlinked by the publisher's close(); a trainer killed with SIGKILL leaves them in
/dev/shm (channels go with the trainer's connection).
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Sequence

import numpy as np
import torch

from membar.logra import ops

_MESSAGE_MAGIC = 0x4C475231  # "LGR1"
_VERSION = 1
# The broadcast ring (bindings/csrc/broadcast_ops.cpp); loading membar loads it.
_BroadcastRing = torch.classes.membar.BroadcastRing


class SyncOverrun(RuntimeError):
    """The message a reader asked for was overwritten: the reader fell a whole ring behind."""


class _PosixSegment:
    """A POSIX shared-memory segment (the transport without a runtime)."""

    def __init__(self, name: str, create: bool, size: int = 0):
        self._segment = shared_memory.SharedMemory(name=name, create=create, size=size)
        # Lifetimes are explicit (the publisher unlinks in close()); Python 3.11's resource tracker
        # would otherwise unlink a segment when any process that merely attached it exits.
        resource_tracker.unregister(self._segment._name, "shared_memory")  # noqa: SLF001 (documented workaround)
        self.buf = self._segment.buf
        self.owner = create

    def close(self) -> None:
        self.buf = None
        self._segment.close()
        if self.owner:
            try:
                shared_memory._posixshmem.shm_unlink(self._segment._name)  # noqa: SLF001 (tracker bypassed)
            except FileNotFoundError:
                pass


class _ChannelSegment:
    """A channel of the membar runtime: made (zero-filled, writable) by the creator, mapped
    read-only by openers."""

    def __init__(self, runtime, name: str, create: bool, size: int = 0):
        self._channel = runtime.create_channel(name, size) if create else runtime.open_channel(name)
        self.buf = self._channel.buffer
        self.owner = create

    def close(self) -> None:
        self.buf = None
        self._channel.close()


def _attach(name: str, create: bool, size: int = 0, runtime=None):
    if runtime is None:
        return _PosixSegment(name, create, size)
    try:
        return _ChannelSegment(runtime, name, create, size)
    except RuntimeError as error:
        if not create and "NOT_FOUND" in str(error):
            raise FileNotFoundError(str(error)) from error
        raise


# What BroadcastRing's reads report (membar::protocol::BroadcastReadOutcome).
_COPIED, _NOT_WRITTEN, _OVERRUN, _OVERRUN_DURING_COPY, _BUSY = range(5)


def _address(buffer: memoryview) -> int:
    """The address of a mapping's first byte (read-only mappings included)."""
    return int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)


def _byte_tensor(payload: bytes) -> torch.Tensor:
    if len(payload) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


class SharedMemoryRing:
    """One writer, any number of readers. The writer's calls never block on readers; readers'
    calls never block at all (they return None when nothing new is there). With ``runtime`` (a
    membar.runtime.Runtime) the memory comes from two runtime channels named ``<name>.ring`` and
    ``<name>.snap``; without, from POSIX shared memory ``<name>_ring`` and ``<name>_snap``.

    The two segments hold membar's broadcast ring (``torch.classes.membar.BroadcastRing``, Note
    [Broadcast ring] in include/membar/protocol/broadcast_ring.h): message slots in the first,
    the double-buffered snapshot area in the second. This class maps them; the C++ ring writes and
    reads them."""

    def __init__(self, name: str, create: bool, slot_count: int = 0, slot_bytes: int = 0, snapshot_bytes: int = 0,
                 runtime=None):
        self.name = name
        self.owner = create
        self.transport = "posix" if runtime is None else "channel"
        separator = "_" if runtime is None else "."
        self._native = None
        if create:
            ring_bytes, snapshot_segment_bytes = _BroadcastRing.segment_bytes(slot_count, slot_bytes, snapshot_bytes)
            self._ring = _attach(f"{name}{separator}ring", True, ring_bytes, runtime)
            try:
                self._snapshot = _attach(f"{name}{separator}snap", True, snapshot_segment_bytes, runtime)
            except BaseException:
                self._ring.close()
                raise
            try:
                self._native = _BroadcastRing.create(_address(self._ring.buf), len(self._ring.buf),
                                                     _address(self._snapshot.buf), len(self._snapshot.buf),
                                                     slot_count, slot_bytes, snapshot_bytes)
            except BaseException:
                self.close()
                raise
        else:
            try:
                self._ring = _attach(f"{name}{separator}ring", False, runtime=runtime)
            except FileNotFoundError as error:
                raise FileNotFoundError(f"no LoGRA policy channel named {name!r} (is the trainer publishing?)") from error
            try:
                self._snapshot = _attach(f"{name}{separator}snap", False, runtime=runtime)
            except FileNotFoundError as error:
                self._ring.close()
                raise FileNotFoundError(f"no LoGRA policy channel named {name!r} (is the trainer publishing?)") from error
            try:
                self._native = _BroadcastRing.open(_address(self._ring.buf), len(self._ring.buf),
                                                   _address(self._snapshot.buf), len(self._snapshot.buf))
            except ValueError as error:
                self.close()
                raise ValueError(f"shared memory {name!r} is not a LoGRA policy ring: {error}") from error
        self.slot_count, self.slot_bytes, self.snapshot_bytes = (int(v) for v in self._native.geometry())

    def _ring_end(self):
        if self._native is None:
            raise RuntimeError(f"the LoGRA policy ring {self.name!r} is closed")
        return self._native

    # Writer side (the trainer). Never blocks.
    def write_message(self, payload: bytes) -> int:
        return int(self._ring_end().write_message(_byte_tensor(payload)))

    def latest_sequence(self) -> int:
        """How many messages were ever written."""
        return int(self._ring_end().message_count())

    # Reader side. Never blocks.
    def read_message(self, sequence: int) -> bytes | None:
        """Message `sequence`, None if not written yet; raises SyncOverrun if overwritten."""
        outcome, payload = self._ring_end().read_message(sequence)
        if outcome == _COPIED:
            return payload.numpy().tobytes()
        if outcome == _NOT_WRITTEN:
            return None
        if outcome == _OVERRUN:
            raise SyncOverrun(f"message {sequence} was overwritten (the ring holds {self.slot_count})")
        raise SyncOverrun(f"message {sequence} was overwritten while being read")

    def write_snapshot(self, sequence: int, payload: bytes) -> None:
        """Publishes a snapshot that contains the effect of messages [0, sequence)."""
        self._ring_end().write_snapshot(sequence, _byte_tensor(payload))

    def read_snapshot(self, attempts: int = 100) -> tuple[int, bytes] | None:
        """(sequence, payload) of the newest complete snapshot, None if none was written."""
        outcome, sequence, payload = self._ring_end().read_snapshot(attempts)
        if outcome == _COPIED:
            return int(sequence), payload.numpy().tobytes()
        if outcome == _NOT_WRITTEN:
            return None
        raise TimeoutError("could not read a stable snapshot (the writer keeps replacing it)")

    def close(self) -> None:
        """Detaches; the creating side also unlinks the segments (or drops the channels)."""
        # The C++ ring holds pointers into the mappings: it lets go of them first.
        if self._native is not None:
            self._native.close()
            self._native = None
        for segment in (getattr(self, "_ring", None), getattr(self, "_snapshot", None)):
            if segment is not None and segment.buf is not None:
                segment.close()


# Message format: header (magic u32, version u32, update_index u64, seed u64, step u64,
# matrix count u32, flags u32; bit 0: bf16 targets were rounded stochastically) then per matrix (matrix_id u32, rows u32, rank u32, pad u32) and
# rows * rank fp32 values of alpha * eta * U.
_MESSAGE_HEADER = struct.Struct("<IIQQQII")
_MATRIX_HEADER = struct.Struct("<IIII")
# Snapshot format: (magic u32, version u32, update count u64, matrix count u32, pad u32), then
# per matrix (matrix_id u32, rows u32, columns u32, pad u32) and rows * columns fp32 weights.
_SNAPSHOT_HEADER = struct.Struct("<IIQII")


_FLAG_STOCHASTIC_ROUNDING = 1


@dataclass
class PolicyUpdate:
    update_index: int
    seed: int
    step: int
    matrices: list[tuple[int, torch.Tensor]]  # (matrix_id, alpha * eta * U [d, r] fp32, CPU)
    stochastic_rounding: bool = False


def encode_update(update_index: int, seed: int, step: int, matrices: Sequence[tuple[int, torch.Tensor]],
                  stochastic_rounding: bool = False) -> bytes:
    flags = _FLAG_STOCHASTIC_ROUNDING if stochastic_rounding else 0
    parts = [_MESSAGE_HEADER.pack(_MESSAGE_MAGIC, _VERSION, update_index, seed, step, len(matrices), flags)]
    for matrix_id, values in matrices:
        values = values.detach().to(device="cpu", dtype=torch.float32).contiguous()
        parts.append(_MATRIX_HEADER.pack(matrix_id, values.shape[0], values.shape[1], 0))
        parts.append(values.numpy().tobytes())
    return b"".join(parts)


def decode_update(payload: bytes) -> PolicyUpdate:
    magic, version, update_index, seed, step, count, flags = _MESSAGE_HEADER.unpack_from(payload, 0)
    if magic != _MESSAGE_MAGIC or version != _VERSION:
        raise ValueError("not a version-1 LoGRA update message")
    offset = _MESSAGE_HEADER.size
    matrices = []
    for _ in range(count):
        matrix_id, rows, rank, _ = _MATRIX_HEADER.unpack_from(payload, offset)
        offset += _MATRIX_HEADER.size
        values = torch.frombuffer(bytearray(payload[offset:offset + rows * rank * 4]), dtype=torch.float32)
        matrices.append((matrix_id, values.view(rows, rank)))
        offset += rows * rank * 4
    return PolicyUpdate(update_index, seed, step, matrices, bool(flags & _FLAG_STOCHASTIC_ROUNDING))


def update_message_bytes(shapes: Sequence[tuple[int, int]]) -> int:
    """Bytes of one update message for matrices of (rows d, rank r)."""
    return _MESSAGE_HEADER.size + sum(_MATRIX_HEADER.size + rows * rank * 4 for rows, rank in shapes)


def encode_snapshot(update_count: int, weights: Sequence[tuple[int, torch.Tensor]]) -> bytes:
    parts = [_SNAPSHOT_HEADER.pack(_MESSAGE_MAGIC, _VERSION, update_count, len(weights), 0)]
    for matrix_id, weight in weights:
        values = weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
        parts.append(_MATRIX_HEADER.pack(matrix_id, values.shape[0], values.shape[1], 0))
        parts.append(values.numpy().tobytes())
    return b"".join(parts)


def decode_snapshot(payload: bytes) -> tuple[int, dict[int, torch.Tensor]]:
    magic, version, update_count, count, _ = _SNAPSHOT_HEADER.unpack_from(payload, 0)
    if magic != _MESSAGE_MAGIC or version != _VERSION:
        raise ValueError("not a version-1 LoGRA snapshot")
    offset = _SNAPSHOT_HEADER.size
    weights = {}
    for _ in range(count):
        matrix_id, rows, columns, _ = _MATRIX_HEADER.unpack_from(payload, offset)
        offset += _MATRIX_HEADER.size
        values = torch.frombuffer(bytearray(payload[offset:offset + rows * columns * 4]), dtype=torch.float32)
        weights[matrix_id] = values.view(rows, columns)
        offset += rows * columns * 4
    return update_count, weights


def apply_update(masters: dict[int, torch.Tensor], weights: dict[int, torch.Tensor], keep_masters: bool,
                 update: PolicyUpdate) -> None:
    """A receiver's side of one update: W <- W - U A on each master (the trainer's fused kernel),
    then the model's weight from its master."""
    with torch.no_grad():
        for matrix_id, values in update.matrices:
            if matrix_id not in masters:
                continue
            master = masters[matrix_id]
            values = values.to(master.device)
            # Without masters, a bf16 weight takes the trainer's stochastic rounding (same
            # seed, same bits); with fp32 masters rounding does not arise.
            rounding_seed = 0
            if update.stochastic_rounding and master.dtype == torch.bfloat16:
                rounding_seed = ops.rounding_seed_for(update.seed, update.update_index)
            ops.fused_update_(master, values, 1.0, ops.ProjectionKey(update.seed, matrix_id, update.step),
                              rounding_seed)
            if keep_masters:
                weights[matrix_id].copy_(master)


class PolicyPublisher:
    """Trainer side. ``publish`` is called by LoGRAOptimizer.step(); it copies the update into the
    ring and returns without waiting for anyone. Every ``snapshot_every`` updates (0: never) it
    also writes a full snapshot of the authoritative weights for late joiners and re-anchoring.
    """

    def __init__(self, name: str, logra, slots: int = 64, snapshot_every: int = 16, runtime=None):
        self.logra = logra
        shapes = [(layer.out_features, layer.rank) for layer in logra.layers]
        snapshot_bytes = _SNAPSHOT_HEADER.size + sum(
            _MATRIX_HEADER.size + layer.out_features * layer.in_features * 4 for layer in logra.layers)
        if snapshot_every >= slots:
            raise ValueError(f"snapshot_every ({snapshot_every}) must be below the ring's slot count ({slots}), "
                             "or a re-anchoring reader could find the updates after a snapshot gone")
        self.ring = SharedMemoryRing(name, create=True, slot_count=slots, slot_bytes=update_message_bytes(shapes),
                                     snapshot_bytes=snapshot_bytes, runtime=runtime)
        self.snapshot_every = snapshot_every
        self.payload_bytes = update_message_bytes(shapes)
        self.full_weight_bytes = sum(layer.weight.numel() * layer.weight.element_size() for layer in logra.layers)
        self.publish_snapshot(0)

    def publish(self, update_index: int, seed: int, step: int, matrices: Sequence[tuple[int, torch.Tensor]],
                stochastic_rounding: bool = False) -> None:
        sequence = self.ring.write_message(encode_update(update_index, seed, step, matrices, stochastic_rounding))
        if sequence != update_index:
            raise RuntimeError(f"update {update_index} landed as ring message {sequence}; one publisher per optimizer")
        if self.snapshot_every and (update_index + 1) % self.snapshot_every == 0:
            self.publish_snapshot(update_index + 1)

    def publish_snapshot(self, update_count: int) -> None:
        weights = [(layer.matrix_id, weight) for layer, weight in zip(self.logra.layers, self.logra.authoritative_weights())]
        self.ring.write_snapshot(update_count, encode_snapshot(update_count, weights))

    def close(self) -> None:
        self.ring.close()


class PolicySubscriber:
    """Rollout side. Holds fp32 masters of the targeted weights of its own model copy.

    ``poll()`` applies every update published since the last call and returns how many it applied;
    it never blocks. ``wait_for(n)`` polls until n updates are applied or the timeout passes.
    ``join='start'`` assumes the subscriber's weights equal the trainer's initial weights;
    ``join='snapshot'`` (a late joiner) re-anchors from the newest snapshot first. ``runtime``: the
    membar.runtime.Runtime whose channels the trainer publishes on (the same daemon), else POSIX
    shared memory."""

    def __init__(self, name: str, weights: dict[int, torch.Tensor], rank_by_matrix: dict[int, int] | None = None,
                 join: str = "start", keep_masters: bool = True, runtime=None):
        if join not in ("start", "snapshot"):
            raise ValueError(f"join must be 'start' or 'snapshot', got {join!r}")
        self.ring = SharedMemoryRing(name, create=False, runtime=runtime)
        self.weights = weights
        self.keep_masters = keep_masters
        self.masters = {}
        for matrix_id, weight in weights.items():
            self.masters[matrix_id] = weight.detach().float().clone() if keep_masters else weight.detach()
        self.applied = 0
        self.reanchors = 0
        if join == "snapshot":
            self.reanchor()

    def reanchor(self) -> None:
        """Loads the newest snapshot into the masters and weights."""
        snapshot = self.ring.read_snapshot()
        if snapshot is None:
            raise RuntimeError("no snapshot has been published yet")
        sequence, payload = snapshot
        update_count, weights = decode_snapshot(payload)
        if update_count != sequence:
            raise ValueError("the snapshot's header and its ring entry disagree")
        with torch.no_grad():
            for matrix_id, values in weights.items():
                if matrix_id not in self.masters:
                    continue
                master = self.masters[matrix_id]
                master.copy_(values.to(master.device))
                if self.keep_masters:
                    self.weights[matrix_id].copy_(master)
        self.applied = update_count
        self.reanchors += 1

    def _apply(self, update: PolicyUpdate) -> None:
        apply_update(self.masters, self.weights, self.keep_masters, update)

    def poll(self) -> int:
        count = 0
        while True:
            try:
                payload = self.ring.read_message(self.applied)
            except SyncOverrun:
                self.reanchor()
                continue
            if payload is None:
                return count
            update = decode_update(payload)
            if update.update_index != self.applied:
                raise RuntimeError(f"expected update {self.applied}, the ring holds {update.update_index}")
            self._apply(update)
            self.applied += 1
            count += 1

    def wait_for(self, update_count: int, timeout_s: float = 60.0, interval_s: float = 0.001) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            if self.applied >= update_count:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(interval_s)

    def close(self) -> None:
        self.ring.close()
