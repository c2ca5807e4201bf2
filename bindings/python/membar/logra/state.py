"""Where LoGRA keeps its per-matrix states (sketches, Adam moments, fp32 masters).

Every state tensor is created by :func:`allocate_state` and by nothing else. Today that is a
plain ``torch.zeros``; the plan (issue 5, item 4) is to hand these out as runtime pages so that
sketches and optimizer moments can be offloaded like KV pages. Keeping the one allocation
function is what lets that move happen without touching the layers or the optimizer.
"""
from __future__ import annotations

from typing import Sequence

import torch

# What a state is for; the runtime will use this to choose placement and offload priority.
STATE_KINDS = ("sketch", "first_moment", "second_moment", "master", "update")


def allocate_state(
    shape: Sequence[int],
    device: torch.device | str,
    kind: str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Returns a zero-filled, contiguous state tensor. Blocks; any thread may call it."""
    if kind not in STATE_KINDS:
        raise ValueError(f"unknown LoGRA state kind {kind!r}; expected one of {STATE_KINDS}")
    return torch.zeros(tuple(shape), device=device, dtype=dtype)
