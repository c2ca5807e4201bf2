"""Policy sync across processes of a torch.distributed job: each LoGRA update travels as (seed,
step, alpha * eta * U) by broadcast from the trainer's rank (NCCL across GPUs and nodes, gloo on
CPUs), not as weights.

Note [Policy sync by broadcast]
  Rationale: rollout processes on other GPUs or nodes must follow the trainer's weights; the
  node-local ring (Note [Policy sync transport] in sync.py) reaches only processes on the trainer's
  node, and membar uses torch.distributed, never a transport of its own, between nodes.
  Approach: BroadcastPublisher.publish (LoGRAOptimizer's publisher hook) broadcasts a header
  (update index, seed, step, flags, matrix count) and one flat fp32 tensor of every matrix's
  alpha * eta * U in the optimizer's layer order, asynchronously: the trainer waits only when more
  than `max_in_flight` updates are unfinished. BroadcastReceiver.receive() joins the same
  broadcasts, checks the header against its own matrices, and applies the update with the
  trainer's fused kernel to fp32 masters (apply_update in sync.py), so receivers on the same
  device type match the trainer's weights bit for bit. close() on the publisher broadcasts a stop
  header (update index -1), on which receive() returns None.
  Limitations: a broadcast is a collective: every process of the group takes every update in
  order, and a receiver that stops receiving eventually stalls the trainer (at `max_in_flight`);
  there are no snapshots for late joiners (the node-local ring has them). Use a group of the
  trainer and its receivers only (torch.distributed.new_group).
  Across nodes, then within one: a receiver may relay every update it applies into its node's ring
  (BroadcastReceiver.relay: a PolicyPublisher over the receiver's masters, on membard channels or
  POSIX shared memory), so one rank per node joins the broadcast and the node's other rollout
  processes follow through PolicySubscriber, late joiners through the relay's snapshots.
"""
from __future__ import annotations

from collections import deque

import torch

from membar.collectives import device_for as _comm_device
from membar.logra.sync import PolicyPublisher, PolicyUpdate, apply_update

_FLAG_STOCHASTIC_ROUNDING = 1
_STOP = -1


class BroadcastPublisher:
    """Trainer side: ``LoGRAOptimizer(..., publisher=BroadcastPublisher(handle, group))``."""

    def __init__(self, logra, group=None, src: int = 0, max_in_flight: int = 4):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("BroadcastPublisher needs torch.distributed initialised (init_process_group).")
        if dist.get_rank() != src:
            raise ValueError(f"BroadcastPublisher runs on the trainer's rank {src}, not on rank {dist.get_rank()}.")
        self.group, self.src, self.max_in_flight = group, src, max(1, int(max_in_flight))
        self.device = _comm_device(group)
        self.shapes = [(layer.matrix_id, layer.out_features, layer.rank) for layer in logra.layers]
        self.payload_bytes = 4 * sum(rows * rank for _, rows, rank in self.shapes)
        self._in_flight: deque = deque()

    def _broadcast(self, header: torch.Tensor, flat: torch.Tensor | None) -> None:
        import torch.distributed as dist

        works = [dist.broadcast(header, self.src, group=self.group, async_op=True)]
        if flat is not None:
            works.append(dist.broadcast(flat, self.src, group=self.group, async_op=True))
        self._in_flight.append((works, header, flat))   # the tensors live until their broadcast is done
        while len(self._in_flight) > self.max_in_flight:
            for work in self._in_flight.popleft()[0]:
                work.wait()

    def publish(self, update_index: int, seed: int, step: int, matrices, stochastic_rounding: bool = False) -> None:
        if [(matrix_id, tuple(values.shape)) for matrix_id, values in matrices] != \
                [(matrix_id, (rows, rank)) for matrix_id, rows, rank in self.shapes]:
            raise ValueError("the update's matrices differ from the LoGRA layers this publisher was made for.")
        flags = _FLAG_STOCHASTIC_ROUNDING if stochastic_rounding else 0
        header = torch.tensor([update_index, seed, step, flags, len(matrices)], dtype=torch.int64, device=self.device)
        flat = torch.cat([values.detach().reshape(-1).to(self.device, torch.float32) for _, values in matrices])
        self._broadcast(header, flat)

    def close(self) -> None:
        """Tells the receivers that no update follows, and waits for every broadcast to finish."""
        self._broadcast(torch.tensor([_STOP, 0, 0, 0, 0], dtype=torch.int64, device=self.device), None)
        while self._in_flight:
            for work in self._in_flight.popleft()[0]:
                work.wait()


class BroadcastReceiver:
    """Rollout side, on another rank of the group: ``weights`` maps matrix ids to the model's
    targeted weights (membar.logra.target_weights(model)), ``rank`` the sketch rank (one int, or
    per matrix id). receive() blocks for the next update, applies it and returns it; None after the
    trainer's close()."""

    def __init__(self, weights: dict[int, torch.Tensor], rank, group=None, src: int = 0, keep_masters: bool = True):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("BroadcastReceiver needs torch.distributed initialised (init_process_group).")
        self.group, self.src = group, src
        self.device = _comm_device(group)
        self.weights, self.keep_masters = weights, keep_masters
        self.masters = {matrix_id: (weight.detach().float().clone() if keep_masters else weight.detach())
                        for matrix_id, weight in weights.items()}
        ranks = rank if isinstance(rank, dict) else {matrix_id: int(rank) for matrix_id in weights}
        self.shapes = [(matrix_id, weights[matrix_id].shape[0], ranks[matrix_id]) for matrix_id in sorted(weights)]
        self.values = sum(rows * r for _, rows, r in self.shapes)
        self.applied = 0
        self.relayed_to: PolicyPublisher | None = None

    def relay(self, name: str, slots: int = 64, snapshot_every: int = 16, runtime=None) -> PolicyPublisher:
        """Publishes every update this receiver applies into a node-local ring `name` (Note [Policy
        sync by broadcast]); call it before the first receive(). Returns the ring's publisher."""
        if self.applied:
            raise ValueError(f"relay() must come before the first update (this receiver applied {self.applied}): the "
                             f"ring numbers its messages from update 0.")
        self.relayed_to = PolicyPublisher(name, _ReceivedModel(self), slots=slots, snapshot_every=snapshot_every,
                                          runtime=runtime)
        return self.relayed_to

    def receive(self) -> PolicyUpdate | None:
        import torch.distributed as dist

        header = torch.empty(5, dtype=torch.int64, device=self.device)
        dist.broadcast(header, self.src, group=self.group)
        update_index, seed, step, flags, count = (int(v) for v in header.tolist())
        if update_index == _STOP:
            return None
        if count != len(self.shapes):
            raise ValueError(f"the trainer sends {count} matrices per update, this receiver has {len(self.shapes)}: "
                             "the models (or LoGRA targets) differ.")
        flat = torch.empty(self.values, dtype=torch.float32, device=self.device)
        dist.broadcast(flat, self.src, group=self.group)
        if update_index != self.applied:
            raise RuntimeError(f"expected update {self.applied}, received {update_index}")
        matrices, offset = [], 0
        for matrix_id, rows, r in self.shapes:
            matrices.append((matrix_id, flat[offset: offset + rows * r].view(rows, r)))
            offset += rows * r
        update = PolicyUpdate(update_index, seed, step, matrices, bool(flags & _FLAG_STOCHASTIC_ROUNDING))
        apply_update(self.masters, self.weights, self.keep_masters, update)
        self.applied += 1
        if self.relayed_to is not None:
            self.relayed_to.publish(update.update_index, update.seed, update.step, update.matrices,
                                    stochastic_rounding=update.stochastic_rounding)
        return update


class _ReceivedMatrix:
    """What PolicyPublisher reads of a LoGRA layer, for one matrix a receiver follows."""

    def __init__(self, matrix_id: int, weight: torch.Tensor, rank: int):
        self.matrix_id, self.weight, self.rank = matrix_id, weight, rank
        self.out_features, self.in_features = weight.shape


class _ReceivedModel:
    """A receiver seen as the LoGRA model PolicyPublisher expects: its matrices in matrix-id order,
    its masters as the authoritative weights (what its snapshots carry)."""

    def __init__(self, receiver: BroadcastReceiver):
        self.receiver = receiver
        self.layers = [_ReceivedMatrix(matrix_id, receiver.weights[matrix_id], r) for matrix_id, _, r in receiver.shapes]

    def authoritative_weights(self) -> list[torch.Tensor]:
        return [self.receiver.masters[layer.matrix_id] for layer in self.layers]
