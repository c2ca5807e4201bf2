"""LoGRA with frozen weights sharded over several processes by PyTorch's FSDP2 (fully_shard).

Note [Sharded frozen weights]
  Rationale: LoGRA keeps the trainable state small (d x r sketches and moments per matrix), but
  the frozen weights are the whole model: a 27B model's bf16 weights do not fit one GPU beside its
  activations. Data-parallel LoGRA ranks can split them, ZeRO-3 style, and gather each layer only
  while it computes. membar uses torch's FSDP2 for that (fully_shard: per-parameter DTensors
  sharded on rows, all-gathered around each wrapped module's forward and backward), not a
  sharding of its own.
  Approach: shard_weights(handle, group) wraps every decoder layer of the model (else every LoGRA
  layer) and then the model with fully_shard over `group`. A LoGRA layer's weight is then a DTensor
  whose rank holds rows [r * ceil(d / N), ...) between steps and the whole matrix inside forward and
  backward, which is all the sketching backward needs. LoGRAOptimizer(process_group=group) averages
  the ranks' sketches (and predicted KLs) before the update, so every rank computes the same U
  [d, r]; each rank then applies only its rows of W -= U A (A [r, k] does not depend on rows) to its
  shard, or to its rows of the fp32 masters, which shard_weights cuts to the same rows. A bf16
  shard without masters is rounded stochastically with the bits the whole matrix would get: the
  rounding words are a SplitMix64 stream over element indices (Note [LoGRA stochastic rounding]),
  and a stream that starts at element first_row * k is the stream of another seed, the inverse mix
  of mix(seed) + first_row * k / 4 * gamma, so the unchanged kernels round a shard exactly as the
  whole matrix (rollout receivers applying (seed, U) to whole weights stay bit-identical).
  Limitations: in_features must be a multiple of 4 for bf16 shards without masters (each row
  starts a rounding word); PolicyPublisher snapshots (whole weights) are refused with sharded
  weights (updates only, or BroadcastPublisher); the model's forward must run on every rank of the
  group together (each wrapped layer all-gathers).
"""
from __future__ import annotations

import torch

from membar.collectives import dist as _dist

def is_sharded(weight) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


def local_rows(weight) -> tuple[torch.Tensor, int]:
    """(this rank's rows of a row-sharded DTensor weight, the first row's index in the matrix)."""
    local = weight.to_local()
    mesh = weight.device_mesh
    rank, size = mesh.get_local_rank(), mesh.size()
    block = -(-weight.shape[0] // size)
    return local, min(rank * block, weight.shape[0])


def shard_weights(handle, group=None) -> int:
    """Shards the frozen weights of a LoGRA model (apply_logra's handle) over `group` (default: the
    default group) with FSDP2 (Note [Sharded frozen weights]); every rank calls it with the same
    weights. Make LoGRAOptimizer(..., process_group=group) afterwards. Returns the number of
    modules wrapped."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    dist = _dist()
    group = group if group is not None else dist.group.WORLD
    model = handle.model
    device = next(model.parameters()).device
    mesh = DeviceMesh.from_group(group, device.type)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    units = list(getattr(decoder, "layers", None) or handle.layers)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for layer in handle.layers:
        if layer.master is not None:
            rows, first = local_rows(layer.weight)
            layer.master = layer.master[first: first + rows.shape[0]].clone()
    handle.process_group = group
    return len(units) + 1


def full_weights(handle) -> list[torch.Tensor]:
    """The LoGRA layers' whole weights on every rank (a collective when they are sharded)."""
    return [layer.weight.full_tensor() if is_sharded(layer.weight) else layer.weight.detach()
            for layer in handle.layers]
