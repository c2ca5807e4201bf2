"""Data-parallel chunk-recurrent training over torch.distributed (NCCL on GPUs, gloo on CPUs).

Note [Data parallel steps]
  Rationale: several trainer processes (one per GPU, or per node) each train their own sequences
  and must compute exactly the update one process would compute on all of them: 2 ranks with a
  batch of 1 each equal 1 process with a batch of 2. membar rides on torch.distributed; it has no
  transport of its own.
  Approach: OOMBTrainer(..., process_group=group). A step first all-reduces the number of
  predicted tokens, so every rank weighs its tokens by 1 / (the global count), as one process
  would; after the step's backward, the gradients this step produced (and any buffer registered
  with reduce_also, e.g. LoGRA's flat sketch buffer, which is what LoGRA sends instead of dense
  gradients) are summed over the group, and the returned loss is the global mean (Note [Overlapped
  reduction] says when each sum starts). Gradients accumulated before the step (gradient accumulation) are set aside while
  it runs and added back afterwards, so they are not summed twice.
  Limitations: each rank's model must start from the same weights (same seed or checkpoint): check_same compares a
  fingerprint (config, parameter count and a weight checksum) across ranks before any work.
  Head parallelism is tensor_parallel.py's (Note [Head parallel layers]); both together pass the
  data-parallel group here and the head-parallel group there.

Note [Overlapped reduction]
  Rationale: after stage 2's last backward every rank would otherwise wait for all of its
  gradients (15 GB for a 7B model in bf16) to be summed before the optimizer can run.
  Approach: a parameter's gradient is final once the step's last backward (chunk 0 of the last
  sequence) has accumulated it. StepReduction.arm() registers post-accumulate-grad hooks for that
  backward; each rank walks its parameters in one fixed order (reversed registration order, about
  the order backward finishes them) and starts an asynchronous in-place all-reduce of each as soon
  as it and every parameter before it are ready, so the sums run beside the rest of the backward.
  finish() starts the ones the backward did not reach in the same order (so every rank issues the
  same collectives in the same order, as NCCL needs, even when ranks' graphs differ, e.g. MoE
  experts that one rank's tokens never chose: their gradients become zeros), waits for all, then
  sums in buckets what arm() excluded and the extra buffers (LoGRA's sketches).
  Limitations: one collective per parameter (no flat buckets: a bucket would need a copy of the
  gradients); only the last backward overlaps, since earlier chunks' backwards still add to every
  gradient; partial steps (stage2_chunks) reduce after the backward.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
from typing import Callable, Iterable

import torch

from membar.collectives import device_for as _reduce_device
from membar.collectives import dist as _dist

BUCKET_BYTES = 64 << 20


def world(group=None) -> tuple[int, int]:
    """(rank, world size) in `group` (the default group when None)."""
    dist = _dist()
    return dist.get_rank(group), dist.get_world_size(group)


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env(device: torch.device, timeout_s: float) -> torch.device:
    """Joins the job torchrun describes ($RANK, $WORLD_SIZE, $LOCAL_RANK, $MASTER_ADDR/PORT): NCCL
    for GPUs, gloo for CPUs, with a timeout so that a rank that dies or hangs ends the others'
    collectives with an error. Returns this rank's device (cuda:$LOCAL_RANK on GPUs)."""
    dist = _dist()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if not dist.is_nccl_available():
            raise ValueError("several ranks on GPUs need NCCL, and this PyTorch build has none.")
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local_rank}, but this node shows {torch.cuda.device_count()} GPU(s).")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        if not dist.is_gloo_available():
            raise ValueError("several ranks on CPUs need gloo, and this PyTorch build has none.")
        backend = "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return device


def all_sum_int(value: int, group) -> int:
    dist = _dist()
    tensor = torch.tensor([value], dtype=torch.int64, device=_reduce_device(group))
    dist.all_reduce(tensor, group=group)
    return int(tensor.item())


def all_sum_(tensors: list[torch.Tensor], group) -> None:
    """Sums each tensor over the group in place, in flat buckets of at most BUCKET_BYTES per dtype
    and device (one all_reduce per bucket)."""
    dist = _dist()
    by_kind: dict = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for (dtype, device), group_tensors in by_kind.items():
        bucket, size = [], 0
        for tensor in group_tensors + [None]:
            if tensor is not None and (not bucket or size + tensor.numel() * tensor.element_size() <= BUCKET_BYTES):
                bucket.append(tensor)
                size += tensor.numel() * tensor.element_size()
                continue
            if bucket:
                if len(bucket) == 1 and bucket[0].is_contiguous():
                    dist.all_reduce(bucket[0], group=group)
                else:
                    flat = torch.cat([t.reshape(-1) for t in bucket])
                    dist.all_reduce(flat, group=group)
                    offset = 0
                    for t in bucket:
                        t.copy_(flat[offset: offset + t.numel()].view_as(t))
                        offset += t.numel()
            bucket, size = ([tensor], tensor.numel() * tensor.element_size()) if tensor is not None else ([], 0)


class StepReduction:
    """What one data-parallel step sums: the gradients of `parameters` it produced and the buffers
    `extra` returns (Note [Data parallel steps]).

    arm() before the step's last backward starts each parameter's all-reduce as soon as that
    backward has finished its gradient (Note [Overlapped reduction]); finish() reduces the rest."""

    def __init__(self, group, parameters: Iterable[torch.nn.Parameter], extra: list[Callable[[], torch.Tensor | None]]):
        self.group = group
        self.parameters = [p for p in parameters if p.requires_grad]
        self.extra = extra
        self._saved_grads: list = []
        self._saved_extra: list = []
        self._order: list = []      # parameters reduced one by one, in this order on every rank
        self._later: list = []      # parameters reduced in finish() only (excluded from arm)
        self._ready: set = set()
        self._next = 0
        self._works: list = []
        self._hooks: list = []
        self.overlapped_bytes = 0

    def __enter__(self) -> "StepReduction":
        self._saved_grads = []
        for parameter in self.parameters:
            self._saved_grads.append(parameter.grad)
            parameter.grad = None
        self._saved_extra = []
        for get in self.extra:
            buffer = get()
            if buffer is not None and bool(buffer.any()):
                self._saved_extra.append(buffer.clone())
                buffer.zero_()
            else:
                self._saved_extra.append(None)
        # Backward finishes the last layers' gradients first.
        self._order, self._later = list(reversed(self.parameters)), []
        self._ready, self._next, self._works, self.overlapped_bytes = set(), 0, [], 0
        return self

    def arm(self, exclude: Iterable[torch.nn.Parameter] = ()) -> None:
        """Call right before the step's last backward: from then on a parameter's gradient is final
        once that backward has accumulated it. `exclude`: parameters whose gradients something else
        still changes after the backward (head parallel's partial ones); finish() reduces them."""
        excluded = {id(p) for p in exclude}
        self._later = [p for p in self._order if id(p) in excluded]
        self._order = [p for p in self._order if id(p) not in excluded]
        for parameter in self._order:
            self._hooks.append(parameter.register_post_accumulate_grad_hook(self._on_ready))

    def _on_ready(self, parameter) -> None:
        self._ready.add(id(parameter))
        dist = _dist()
        while self._next < len(self._order) and id(self._order[self._next]) in self._ready:
            grad = self._order[self._next].grad
            self._works.append(dist.all_reduce(grad, group=self.group, async_op=True))
            self.overlapped_bytes += grad.numel() * grad.element_size()
            self._next += 1

    def finish(self) -> int:
        """Sums the step's gradients and buffers over the group; returns the bytes each rank sent."""
        dist = _dist()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for parameter in self.parameters:
            if parameter.grad is None:   # unused here (e.g. an expert no token of this rank chose)
                parameter.grad = torch.zeros_like(parameter)
        # Every rank issues one all-reduce per parameter of _order in the same order, wherever the
        # backward left off (ranks may differ there); then the rest in buckets.
        for parameter in self._order[self._next:]:
            self._works.append(dist.all_reduce(parameter.grad, group=self.group, async_op=True))
        self._next = len(self._order)
        for work in self._works:
            work.wait()
        self._works = []
        later = [p.grad for p in self._later]
        buffers = [b for b in (get() for get in self.extra) if b is not None]
        all_sum_(later + buffers, self.group)
        everything = [p.grad for p in self.parameters] + buffers
        return sum(t.numel() * t.element_size() for t in everything)

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for parameter, saved in zip(self.parameters, self._saved_grads):
            if saved is None:
                continue
            if parameter.grad is None:
                parameter.grad = saved
            else:
                parameter.grad.add_(saved)
        for get, saved in zip(self.extra, self._saved_extra):
            if saved is not None:
                buffer = get()
                if buffer is not None:
                    buffer.add_(saved)
        self._saved_grads, self._saved_extra = [], []


def fingerprint(model: torch.nn.Module, settings: dict) -> dict:
    """What must agree across ranks: the settings, the parameter count and a weight checksum."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
    parameters = list(model.parameters())
    with torch.no_grad():
        checksum = float(sum(p.detach().float().sum().item() for p in parameters[:: max(len(parameters) // 8, 1)]))
    return {"settings": digest, "parameters": sum(p.numel() for p in parameters), "weights": round(checksum, 3),
            "detail": settings}


def check_same(model: torch.nn.Module, settings: dict, group=None) -> None:
    """A clear error on every rank, before any work, when the ranks' configurations or starting
    weights differ."""
    dist = _dist()
    mine = fingerprint(model, settings)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    first = everyone[0]
    for rank, other in enumerate(everyone):
        if other["settings"] != first["settings"]:
            keys = sorted(k for k in set(first["detail"]) | set(other["detail"])
                          if first["detail"].get(k) != other["detail"].get(k))
            raise ValueError(f"rank {rank}'s settings differ from rank 0's ({', '.join(keys)}): every rank must "
                             f"train the same configuration.")
        if other["parameters"] != first["parameters"] or other["weights"] != first["weights"]:
            raise ValueError(f"rank {rank} starts from other weights than rank 0 (a different model, seed or "
                             f"checkpoint): data-parallel ranks must start from the same weights.")
