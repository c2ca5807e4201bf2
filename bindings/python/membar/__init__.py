"""membar: a GPU memory runtime for long-context (OOMB) and low-rank-sketch (LoGRA) training.

Importing the package loads the compiled ops library (``membar/_C.so``, built by ``make``)
into ``torch.ops.membar``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

__version__ = "0.1.0"

_HERE = Path(__file__).resolve().parent


def _find_library() -> Path:
    candidates = [_HERE / "_C.so"]
    env = os.environ.get("MEMBAR_LIBRARY")
    if env:
        candidates.insert(0, Path(env))
    for c in candidates:
        if c.exists():
            return c
    raise ImportError(
        "membar's compiled ops library was not found (looked for "
        + ", ".join(str(c) for c in candidates)
        + "). Build it first: `make build` from the repository root "
        "(or set MEMBAR_LIBRARY to the path of _C.so)."
    )


def _check_torch(library: Path) -> None:
    """Refuses a library built against another torch than the one imported (its C++ ABI differs:
    loading it would crash or fail on a missing symbol)."""
    info = library.with_name(library.stem + ".build.json")
    if not info.exists():
        return
    built = json.loads(info.read_text()).get("torch", "")
    if built and built.split("+")[0] != torch.__version__.split("+")[0]:
        raise ImportError(f"membar's compiled library ({library}) was built against torch {built}, but torch "
                          f"{torch.__version__} is imported. Rebuild membar in this environment (`pip install .` "
                          f"from the source tree, or `make build`).")


_LIBRARY = _find_library()
_check_torch(_LIBRARY)
torch.ops.load_library(str(_LIBRARY))
ops = torch.ops.membar


def has_cuda_kernels() -> bool:
    """Whether the loaded library was built with membar's CUDA kernels (``make gpu-check``, or
    cmake -DMEMBAR_WITH_CUDA=ON); a CPU build runs everything on the CPU."""
    return hasattr(torch.ops.membar, "attention_cuda_layouts")


__all__ = ["ops", "has_cuda_kernels", "__version__"]
