"""What membar's torch.distributed users share (oomb's data and head parallel steps, LoGRA's
broadcast): the module itself with a clear error when this PyTorch lacks it, and the device a
group's collectives take their tensors on."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def dist():
    """torch.distributed, or ValueError with one sentence when this PyTorch build has none."""
    import torch.distributed as distributed

    if not distributed.is_available():
        raise ValueError("this PyTorch build has no torch.distributed.")
    return distributed


def device_for(group) -> torch.device:
    """Where small tensors of `group`'s collectives live: this process's GPU for NCCL, else the CPU."""
    if dist().get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class WeightSplit:
    """How a head-parallel model keeps one weight (membar.oomb.tensor_parallel, Note [Head parallel
    layers]): this rank's block `rank` of `size` along `dim` (0: rows, 1: columns); for fused
    projections, its block of each consecutive section, `sections` being the whole sizes along
    `dim`. Other libraries (LoGRA) read it with weight_split() to act on the right part of the
    whole weight without depending on how the model was split."""

    group: object
    rank: int
    size: int
    dim: int
    sections: tuple = ()

    def row_ranges(self, rows: int) -> list[tuple[int, int, int]]:
        """For a split along rows: (first local row, first row in the whole matrix, rows) of each
        contiguous run of this rank's `rows` local rows."""
        if self.dim != 0:
            raise ValueError("row_ranges describes a split along rows")
        if not self.sections:
            return [(0, self.rank * rows, rows)]
        ranges, local, whole = [], 0, 0
        for section in self.sections:
            block = section // self.size
            ranges.append((local, whole + self.rank * block, block))
            local += block
            whole += section
        return ranges


def weight_split(weight) -> WeightSplit | None:
    """The WeightSplit a head-parallel model marked this weight with, or None for a whole weight."""
    return getattr(weight, "_membar_split", None)


def mark_split(weight, split: WeightSplit) -> None:
    weight._membar_split = split
