"""What membar's torch.distributed users share (oomb's data and head parallel steps, LoGRA's
broadcast): the module itself with a clear error when this PyTorch lacks it, and the device a
group's collectives take their tensors on."""
from __future__ import annotations

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
