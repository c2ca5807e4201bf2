"""Thin, checked wrappers over the LoGRA ops in ``torch.ops.membar`` (bindings/csrc/logra_ops.cpp).

Shapes: A [r, k]; x [..., k]; P = x A^T [..., r]; sketch S [d, r] fp32; update U [d, r] fp32;
weight W [d, k] fp32 or bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import membar

_ops = membar.ops

# Seeds travel as signed 64-bit integers through the op schema.
_SEED_LIMIT = 1 << 63


@dataclass(frozen=True)
class ProjectionKey:
    """Names one projection A: the run's seed, the matrix, and which redraw (step)."""

    seed: int
    matrix_id: int
    step: int

    def __post_init__(self) -> None:
        if not 0 <= self.seed < _SEED_LIMIT:
            raise ValueError(f"the seed must be in [0, 2^63), got {self.seed}")
        if self.matrix_id < 0 or self.step < 0:
            raise ValueError(f"matrix_id and step must not be negative, got {self.matrix_id}, {self.step}")


def generate(key: ProjectionKey, rank: int, in_features: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Materialises A [rank, in_features] fp32 (tests and debugging only)."""
    out = torch.empty(rank, in_features, dtype=torch.float32, device=device)
    _ops.logra_generate_(out, key.seed, key.matrix_id, key.step)
    return out


def project(x: torch.Tensor, key: ProjectionKey, rank: int, exact: bool = False) -> torch.Tensor:
    """x [..., k] -> x A^T [..., r] in x's dtype (fp32 accumulation). On the GPU, bf16 x goes
    through tensor cores unless ``exact`` asks for the kernel that is bit-identical to the CPU."""
    return _ops.logra_project(x, key.seed, key.matrix_id, key.step, rank, exact)


def sketch_accumulate_(sketch: torch.Tensor, grad_output: torch.Tensor, projected: torch.Tensor) -> None:
    """sketch [d, r] fp32 += grad_output[..., d]^T projected[..., r]."""
    _ops.logra_sketch_accumulate_(sketch, grad_output, projected)


def fused_update_(weight: torch.Tensor, update: torch.Tensor, coefficient: float, key: ProjectionKey,
                  rounding_seed: int = 0, exact: bool = False) -> None:
    """weight [d, k] -= coefficient * update [d, r] A, A regenerated tile by tile. For a bf16
    weight, a nonzero ``rounding_seed`` rounds stochastically and deterministically (the same
    seed and kernel give the same bits; Note [LoGRA stochastic rounding]). On the GPU the update
    runs on tensor cores (deterministic, fp32-accurate, not bit-identical to the CPU) unless
    ``exact`` asks for the kernel that is bit-identical to the CPU reference."""
    if not 0 <= rounding_seed < _SEED_LIMIT:
        raise ValueError(f"the rounding seed must be in [0, 2^63), got {rounding_seed}")
    _ops.logra_fused_update_(weight, update, float(coefficient), key.seed, key.matrix_id, key.step, rounding_seed,
                             bool(exact))


def rounding_seed_for(seed: int, update_index: int) -> int:
    """The stochastic-rounding seed of update ``update_index`` of a run (never 0, below 2^63).
    Trainer and receivers derive it from what every update message carries."""
    mask = (1 << 64) - 1
    value = (seed * 0x9E3779B97F4A7C15 + (update_index + 1) * 0xD1B54A32D192ED03) & mask
    value ^= value >> 29
    return (value & (_SEED_LIMIT - 1)) | 1
