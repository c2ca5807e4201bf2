"""LoGRA with its frozen weights sharded over data-parallel ranks by FSDP2 (gloo on the CPU; Note
[Sharded frozen weights] in membar/logra/sharding.py): the ranks' weights equal one process's, a
receiver applying the published updates to whole weights gets the trainer's bits, and a shard of a
bf16 weight is rounded exactly as those rows of the whole matrix."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from membar import logra
from membar.logra import ops

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from dist_common import global_batch, small_model  # noqa: E402
from test_oomb_distributed import relative_error, run_ranks  # noqa: E402

UPDATES = 3


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def one_process(world: int, dtype: str, masters: bool) -> list[torch.Tensor]:
    """The same updates in one process: each update's batch is the ranks' rows together (the mean
    loss over them is the mean of the ranks' losses, which the ranks' averaged sketches give)."""
    model = small_model().to(getattr(torch, dtype))
    handle = logra.apply_logra(model, rank=8, seed=3, runtime=None, master_weights=masters)
    optimizer = logra.LoGRAOptimizer(handle, lr=1e-2 if masters else 10.0, algorithm="sgd")
    batch = global_batch(world * UPDATES)
    for update in range(UPDATES):
        rows = batch[update * world: (update + 1) * world]
        model(rows, labels=rows).loss.backward()
        optimizer.step()
    return [layer.weight.detach().clone() for layer in handle.layers]


@pytest.mark.parametrize("world", [3])   # 3 ranks: uneven shards (rows that 3 does not divide)
def test_sharded_frozen_weights_train_as_one_process(tmp_path, world):
    results = run_ranks("fsdp", world, tmp_path, "float32", "plain")
    reference = one_process(world, "float32", masters=False)
    initial = [layer.weight.detach() for layer in logra.apply_logra(small_model(), rank=8, seed=3, runtime=None).layers]
    for rank, result in enumerate(results):
        assert result["wrapped"] == 3   # two decoder layers and the model
        rows = result["rows"]
        assert result["local_rows"] == min(-(-rows // world), rows - rank * -(-rows // world))   # its rows only
        for got, want, start in zip(result["weights"], reference, initial):
            assert not torch.equal(want, start)
            assert relative_error(got - start, want - start) <= 1e-4
        # A receiver applying the published updates to whole weights holds the trainer's weights.
        for got, want in zip(result["receiver"], result["weights"]):
            assert torch.equal(got, want)
        # Each update sums the sketches (d x r per matrix), not the gradients, and times it.
        for sent, seconds in result["reduced"]:
            assert sent == result["sketch_bytes"] and seconds > 0


@pytest.mark.parametrize("masters", [False, True], ids=["stochastic-rounding", "fp32-masters"])
def test_bf16_shards_round_as_the_whole_matrix(tmp_path, masters):
    results = run_ranks("fsdp", 2, tmp_path, "bfloat16", "masters" if masters else "plain")
    for result in results:
        moved = sum(int((w != r).sum()) for w, r in zip(result["weights"], result["receiver"]))
        assert moved == 0, "the sharded trainer's bf16 weights differ from a receiver's whole-matrix update"
        assert not torch.equal(result["weights"][0], results[0]["weights"][0] * 0)


def test_a_shard_is_rounded_as_its_rows_of_the_whole_matrix():
    torch.manual_seed(0)
    d, k, r = 10, 12, 4
    weight = (torch.randn(d, k) * 0.1).bfloat16()
    update = torch.randn(d, r) * 1e-3
    key = ops.ProjectionKey(3, 1, 0)
    seed = ops.rounding_seed_for(3, 5)
    whole = weight.clone()
    ops.fused_update_(whole, update, 1.0, key, seed)
    parts = []
    for first, rows in [(0, 4), (4, 3), (7, 3)]:
        part = weight[first: first + rows].clone()
        ops.fused_update_(part, update[first: first + rows].contiguous(), 1.0, key, seed, first_element=first * k)
        parts.append(part)
    assert int((whole != weight).sum()) > 0
    assert torch.equal(torch.cat(parts), whole)
    # Without the shift, a shard takes other rounding bits.
    unshifted = weight[4:7].clone()
    ops.fused_update_(unshifted, update[4:7].contiguous(), 1.0, key, seed)
    assert not torch.equal(unshifted, whole[4:7])
    with pytest.raises(ValueError, match="divisible by 4"):
        ops.fused_update_(weight[1:2].clone(), update[1:2].contiguous(), 1.0, key, seed, first_element=3)
