"""Data-parallel chunk-recurrent training over torch.distributed (gloo on the CPU): the ranks'
gradients, LoGRA sketches and membar-train's updates equal one process's (Note [Data parallel steps]
in membar/oomb/distributed.py); a rank that dies or disagrees is a clear error on the others."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from membar import logra

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from dist_common import global_batch, small_model  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(HERE.parents[1] / "bindings" / "python"),
                                                     env.get("PYTHONPATH", "")] if p)
    return env


def run_ranks(case: str, world: int, out: Path, *args: str) -> list[dict]:
    """Runs `world` ranks of dist_worker.py CASE OUT ARGS... and returns what each saved."""
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, str(HERE / "dist_worker.py"), case, str(out), *args],
                              env=rank_env(rank, world, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(world)]
    outputs = [rank.communicate(timeout=240)[0] for rank in ranks]
    for rank, (process, output) in enumerate(zip(ranks, outputs)):
        assert process.returncode == 0, f"rank {rank}:\n{output}"
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def full_sequence_grads(batch: torch.Tensor) -> tuple[float, dict]:
    model = small_model()
    loss = model(batch, labels=batch).loss
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_gradients_equal_full_sequence_gradients(tmp_path, world):
    results = run_ranks("gradients", world, tmp_path)
    loss, reference = full_sequence_grads(global_batch(world))
    assert results[0]["reduced_bytes"] == sum(g.numel() * 4 for g in reference.values())
    # Most of it was summed while the last chunk's backward ran (Note [Overlapped reduction]).
    assert results[0]["reduced_bytes"] / 2 < results[0]["overlapped_bytes"] <= results[0]["reduced_bytes"]
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(loss, rel=1e-5), rank
        for name, grad in reference.items():
            assert relative_error(result["grads"][name], grad) <= 1e-4, (rank, name)
    # Every rank holds the same summed gradient (so every rank's optimizer takes the same step).
    for result in results[1:]:
        for name in reference:
            assert torch.equal(result["grads"][name], results[0]["grads"][name]), name


def test_gradient_accumulation_over_micro_batches_is_summed_once(tmp_path):
    results = run_ranks("accumulate", 2, tmp_path)
    _, reference = full_sequence_grads(global_batch(4))
    for result in results:
        for name, grad in reference.items():
            assert relative_error(result["grads"][name], grad) <= 1e-4, name


def test_logra_data_parallel_sums_sketches_and_matches_one_process(tmp_path):
    results = run_ranks("logra", 2, tmp_path)
    model = small_model()
    handle = logra.apply_logra(model, rank=8, seed=3, runtime=None)
    batch = global_batch(2)
    model(batch, labels=batch).loss.backward()
    sketches = torch.cat([layer.sketch.flatten().clone() for layer in handle.layers])
    before = [layer.weight.clone() for layer in handle.layers]
    logra.LoGRAOptimizer(handle, lr=100.0, algorithm="sgd").step()
    updates = [layer.weight - weight for layer, weight in zip(handle.layers, before)]
    # What a rank sends per update: the sketches (d x r fp32 per matrix), not d x k gradients.
    assert results[0]["reduced_bytes"] == sketches.numel() * 4
    assert results[0]["reduced_bytes"] < sum(layer.weight.numel() * 4 for layer in handle.layers)
    for result in results:
        assert relative_error(result["sketches"], sketches) <= 1e-4
        for got, want in zip(result["updates"], updates):
            assert relative_error(got, want) <= 1e-4


@pytest.mark.parametrize("world", [2, 3])
def test_logra_updates_broadcast_to_other_ranks_reproduce_the_trainers_weights(tmp_path, world):
    results = run_ranks("broadcast", world, tmp_path)
    trainer = results[0]
    initial = logra.target_weights(small_model())
    assert all(not torch.equal(w, initial[i]) for i, w in enumerate(trainer["weights"]))   # the updates moved them
    for receiver in results[1:]:
        assert receiver["applied"] == 3
        for got, want in zip(receiver["weights"], trainer["weights"]):
            assert torch.equal(got, want)   # same kernel, same device type: the same bits
    # What travels per update: the d x r updates, not the d x k weights.
    assert trainer["payload_bytes"] < sum(w.numel() * 4 for w in trainer["weights"]) / 2


TRAIN = ["--model", "tiny-qwen2", "--seq-len", "384", "--chunk", "128", "--page-tokens", "32", "--device", "cpu",
         "--no-progress", "--json", "--lr", "1e-3"]


def train_ranks(world: int, args: list[list[str]], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-m", "membar.train", *args[rank]], env=rank_env(rank, world, port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    done = []
    for rank in ranks:
        out, err = rank.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(rank.args, rank.returncode, out, err))
    return done


def test_membar_train_two_ranks_compute_the_update_of_one_process_with_twice_the_batch(tmp_path):
    from transformers import AutoModelForCausalLM

    single = subprocess.run([sys.executable, "-m", "membar.train", *TRAIN, "--batch", "2", "--steps", "3",
                             "--save", str(tmp_path / "one")], env=rank_env(0, 1, free_port()),
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr
    ranks = train_ranks(2, [[*TRAIN, "--batch", "1", "--steps", "3", "--save", str(tmp_path / "two")]] * 2)
    for rank, done in enumerate(ranks):
        assert done.returncode == 0, f"rank {rank}: {done.stderr}"
    assert ranks[1].stdout == ""   # rank 0 prints
    one, two = json.loads(single.stdout.splitlines()[-1]), json.loads(ranks[0].stdout.splitlines()[-1])
    assert (two["world_size"], two["tensor_parallel"], two["global_batch"]) == (2, 1, 2)
    assert [s["loss"] for s in two["steps"]] == pytest.approx([s["loss"] for s in one["steps"]], rel=1e-5)
    a = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "one").named_parameters())
    b = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "two").named_parameters())
    for name, parameter in a.items():
        if name.endswith("k_proj.bias"):
            # A key bias shifts all of a query's scores equally: softmax ignores it, its gradient is
            # rounding noise (summed in another order on two ranks), and Adam scales noise to +-lr.
            continue
        assert torch.allclose(b[name], parameter, rtol=1e-4, atol=1e-6), name


def test_ranks_with_different_settings_each_get_one_sentence(tmp_path):
    ranks = train_ranks(2, [[*TRAIN, "--steps", "1"], [*TRAIN, "--steps", "1", "--chunk", "64"]])
    for rank, done in enumerate(ranks):
        assert done.returncode == 2, f"rank {rank}: {done.stderr}"
        lines = done.stderr.strip().splitlines()
        assert lines[-1].startswith(f"membar-train: rank {rank} of 2: rank 1's settings differ from rank 0's (chunk)"), lines


def test_a_rank_that_dies_makes_the_others_fail_with_one_line(tmp_path):
    port = free_port()
    args = [sys.executable, "-m", "membar.train", *TRAIN, "--steps", "100000", "--dist-timeout", "60"]
    ranks = [subprocess.Popen(args, env=rank_env(rank, 2, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in range(2)]
    try:
        deadline = time.monotonic() + 240
        for line in ranks[0].stdout:   # rank 0 prints each step
            if line.startswith("step 2:") or time.monotonic() > deadline:
                break
        assert ranks[0].poll() is None and ranks[1].poll() is None
        ranks[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, err = ranks[0].communicate(timeout=90)
        assert time.monotonic() - killed < 60
        assert ranks[0].returncode == 3, err
        assert err.strip().splitlines()[-1].startswith("membar-train: rank 0 of 2: the job's ranks lost each other"), err
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()


def test_a_receiver_relays_broadcast_updates_into_its_nodes_ring(tmp_path):
    results = run_ranks("relay", 2, tmp_path)
    trainer, receiver = results
    assert receiver["applied"] == 3
    # A rollout process on the receiver's node, following through the ring from the start, and a
    # late one, joining from the relay's snapshot after update 2, both hold the trainer's bits.
    for got, want in zip(receiver["follower"], trainer["weights"]):
        assert torch.equal(got, want)
    assert (receiver["late_reanchors"], receiver["late_applied"]) == (1, 3)
    for got, want in zip(receiver["late"], trainer["weights"]):
        assert torch.equal(got, want)
