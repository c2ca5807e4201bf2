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
                  rounding_seed: int = 0, exact: bool = False, first_element: int = 0) -> None:
    """weight [d, k] -= coefficient * update [d, r] A, A regenerated tile by tile. For a bf16
    weight, a nonzero ``rounding_seed`` rounds stochastically and deterministically (the same
    seed and kernel give the same bits; Note [LoGRA stochastic rounding]). On the GPU the update
    runs on tensor cores (deterministic, fp32-accurate, not bit-identical to the CPU) unless
    ``exact`` asks for the kernel that is bit-identical to the CPU reference. ``first_element``:
    the weight is rows of a larger matrix starting at that element index (a multiple of 4), and
    is rounded as those rows of the whole matrix would be (Note [Sharded frozen weights])."""
    if not 0 <= rounding_seed < _SEED_LIMIT:
        raise ValueError(f"the rounding seed must be in [0, 2^63), got {rounding_seed}")
    if first_element:
        rounding_seed = shard_rounding_seed(rounding_seed, first_element)
    _ops.logra_fused_update_(weight, update, float(coefficient), key.seed, key.matrix_id, key.step, rounding_seed,
                             bool(exact))


_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix64(value: int) -> int:
    """SplitMix64's finaliser, as logra_mix64 in membar/kernels/logra.h."""
    value = (value + _GAMMA) & _MASK
    value = ((value ^ (value >> 30)) * _C1) & _MASK
    value = ((value ^ (value >> 27)) * _C2) & _MASK
    return value ^ (value >> 31)


def _unmix64(value: int) -> int:
    value = value ^ (value >> 31) ^ (value >> 62)
    value = (value * pow(_C2, -1, 1 << 64)) & _MASK
    value = value ^ (value >> 27) ^ (value >> 54)
    value = (value * pow(_C1, -1, 1 << 64)) & _MASK
    value = value ^ (value >> 30) ^ (value >> 60)
    return (value - _GAMMA) & _MASK


def shard_rounding_seed(rounding_seed: int, first_element: int) -> int:
    """The seed whose rounding stream starts where `rounding_seed`'s stream is at element
    `first_element` (a multiple of 4), as the signed 64-bit value the kernels take (Note [Sharded
    frozen weights]). 0 stays 0 (round to nearest)."""
    if rounding_seed == 0:
        return 0
    if first_element % 4:
        raise ValueError(f"a shard of a bf16 weight must start at an element index divisible by 4 (one stochastic "
                         f"rounding word serves 4 elements); it starts at {first_element}.")
    shifted = _unmix64((_mix64(rounding_seed) + (first_element // 4) * _GAMMA) & _MASK)
    if shifted == 0:
        raise ValueError("the shifted rounding seed is 0 (probability 2^-64): choose another run seed.")
    return shifted - (1 << 64) if shifted >= 1 << 63 else shifted


def rounding_seed_for(seed: int, update_index: int) -> int:
    """The stochastic-rounding seed of update ``update_index`` of a run (never 0, below 2^63).
    Trainer and receivers derive it from what every update message carries."""
    mask = (1 << 64) - 1
    value = (seed * 0x9E3779B97F4A7C15 + (update_index + 1) * 0xD1B54A32D192ED03) & mask
    value ^= value >> 29
    return (value & (_SEED_LIMIT - 1)) | 1
