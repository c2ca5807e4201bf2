"""LoGRA ops (bindings/csrc/logra_ops.cpp) against dense references, plus the generator's bits
against an independent Python implementation of Note [LoGRA sign generator]."""
import math

import pytest
import torch

from membar import logra
from membar.logra import ops

MASK = (1 << 64) - 1


def _mix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK
    return value ^ (value >> 31)


def _python_sign_matrix(seed: int, matrix_id: int, step: int, rank: int, in_features: int) -> torch.Tensor:
    key_hash = _mix64(_mix64(_mix64(seed) ^ matrix_id) ^ step)
    out = torch.empty(rank, in_features)
    for row in range(rank):
        for word in range((in_features + 63) // 64):
            bits = _mix64(key_hash ^ _mix64((row << 32) | word))
            for bit in range(min(64, in_features - 64 * word)):
                out[row, 64 * word + bit] = -1.0 if (bits >> bit) & 1 else 1.0
    return out / math.sqrt(rank)


def test_generator_matches_independent_python_implementation():
    for seed, matrix_id, step, rank, k in [(0, 0, 0, 4, 70), (2**62 + 12345, 17, 99, 7, 130)]:
        expected = _python_sign_matrix(seed, matrix_id, step, rank, k)
        got = logra.generate(ops.ProjectionKey(seed, matrix_id, step), rank, k)
        assert torch.equal(got, expected)


def test_stochastic_rounding_bits_follow_the_documented_formula():
    # Note [LoGRA stochastic rounding]: element i adds bits [16 (i % 4), +16) of
    # mix(mix(seed) + (i // 4) * gamma) to its fp32 bits, then truncates to bf16.
    torch.manual_seed(11)
    key = ops.ProjectionKey(3, 1, 4)
    weight = torch.randn(3, 70).to(torch.bfloat16)
    update = torch.randn(3, 8) * 1e-2
    exact = weight.float()
    logra.fused_update_(exact, update, 0.3, key)  # the same fp32 value the bf16 path rounds
    seed = ops.rounding_seed_for(5, 2)
    rounded = weight.clone()
    logra.fused_update_(rounded, update, 0.3, key, seed)
    bits = exact.view(torch.int32).flatten().tolist()
    expected = []
    for index, value in enumerate(bits):
        word = _mix64((_mix64(seed) + (index >> 2) * 0x9E3779B97F4A7C15) & MASK)
        random = (word >> (16 * (index & 3))) & 0xFFFF
        expected.append((((value & 0xFFFFFFFF) + random) >> 16) & 0xFFFF)
    got = [b & 0xFFFF for b in rounded.view(torch.int16).flatten().tolist()]
    assert got == expected


def test_generator_is_deterministic_and_key_sensitive():
    key = ops.ProjectionKey(5, 1, 2)
    a = logra.generate(key, 32, 300)
    assert torch.equal(a, logra.generate(key, 32, 300))
    for other in (ops.ProjectionKey(6, 1, 2), ops.ProjectionKey(5, 2, 2), ops.ProjectionKey(5, 1, 3)):
        agreement = (a == logra.generate(other, 32, 300)).float().mean().item()
        assert 0.45 < agreement < 0.55
    # A leading block of a larger A is the smaller A: shapes do not reshuffle signs.
    assert torch.equal(logra.generate(key, 32, 300)[:8, :100] * math.sqrt(32) / math.sqrt(8),
                       logra.generate(key, 8, 100))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_project_matches_dense(dtype):
    torch.manual_seed(0)
    key = ops.ProjectionKey(11, 4, 7)
    x = torch.randn(3, 41, 150).to(dtype)
    a = logra.generate(key, 24, 150).double()
    reference = x.double() @ a.t()
    got = logra.project(x, key, 24)
    assert got.shape == (3, 41, 24) and got.dtype == dtype
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.double(), reference, rtol=tolerance, atol=tolerance)


def test_project_accepts_strided_rows():
    key = ops.ProjectionKey(1, 0, 0)
    base = torch.randn(20, 200)
    x = base[:, 10:110]  # row stride 200
    torch.testing.assert_close(logra.project(x, key, 16), logra.project(x.contiguous(), key, 16))


def test_sketch_accumulate_matches_dense():
    torch.manual_seed(1)
    sketch = torch.randn(30, 12)
    initial = sketch.clone()
    grad_output, projected = torch.randn(4, 9, 30), torch.randn(4, 9, 12)
    logra.sketch_accumulate_(sketch, grad_output, projected)
    torch.testing.assert_close(sketch, initial + grad_output.reshape(-1, 30).t() @ projected.reshape(-1, 12))
    bf16_sketch = initial.clone()
    logra.sketch_accumulate_(bf16_sketch, grad_output.bfloat16(), projected.bfloat16())
    reference = initial + grad_output.bfloat16().float().reshape(-1, 30).t() @ projected.bfloat16().float().reshape(-1, 12)
    torch.testing.assert_close(bf16_sketch, reference, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_update_matches_dense(dtype):
    torch.manual_seed(2)
    key = ops.ProjectionKey(3, 9, 1)
    weight = torch.randn(50, 130).to(dtype)
    update = torch.randn(50, 20)
    before = weight.double()
    logra.fused_update_(weight, update, 0.05, key)
    reference = before - 0.05 * update.double() @ logra.generate(key, 20, 130).double()
    if dtype == torch.float32:
        torch.testing.assert_close(weight.double(), reference, rtol=0, atol=1e-5)
    else:
        # One bf16 rounding of the result.
        assert ((weight.double() - reference).abs() <= reference.abs() / 256 + 1e-6).all()


def test_bad_inputs_raise_sentences():
    key = ops.ProjectionKey(0, 0, 0)
    with pytest.raises(RuntimeError, match="rank must be at least 1"):
        logra.project(torch.randn(3, 4), key, 0)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        logra.project(torch.randn(3, 4, dtype=torch.float64), key, 2)
    with pytest.raises(RuntimeError, match="must equal the sketch's out_features"):
        logra.sketch_accumulate_(torch.zeros(5, 2), torch.randn(3, 4), torch.randn(3, 2))
    with pytest.raises(RuntimeError, match="same leading"):
        logra.sketch_accumulate_(torch.zeros(4, 2), torch.randn(3, 4), torch.randn(2, 2))
    with pytest.raises(RuntimeError, match="the sketch must be float32"):
        logra.sketch_accumulate_(torch.zeros(4, 2, dtype=torch.bfloat16), torch.randn(3, 4), torch.randn(3, 2))
    with pytest.raises(RuntimeError, match="out_features must match"):
        logra.fused_update_(torch.randn(4, 8), torch.randn(5, 2), 1.0, key)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        logra.fused_update_(torch.randn(4, 8, dtype=torch.float16), torch.randn(4, 2), 1.0, key)
    with pytest.raises(RuntimeError, match="update must be float32"):
        logra.fused_update_(torch.randn(4, 8), torch.randn(4, 2, dtype=torch.float64), 1.0, key)
    with pytest.raises(ValueError, match="must not be negative"):
        ops.ProjectionKey(0, -1, 0)


def test_unbiased_sketch_error_shrinks_like_inverse_square_root():
    torch.manual_seed(3)
    gradient = torch.randn(8, 96, dtype=torch.float64)

    def relative_error(samples, offset):
        mean = torch.zeros_like(gradient)
        for n in range(samples):
            a = logra.generate(ops.ProjectionKey(offset + n, 0, 0), 8, 96).double()
            mean += (gradient @ a.t()) @ a / samples
        return ((mean - gradient).norm() / gradient.norm()).item()

    small = sum(relative_error(16, 1000 * run) for run in range(3))
    large = sum(relative_error(256, 10**6 + 1000 * run) for run in range(3))
    assert 2.8 < small / large < 5.7  # 16x the samples: 4x smaller error
