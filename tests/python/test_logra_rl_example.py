"""Smoke run of examples/logra_rl: SFT, LoGRA RL with a rollout process fed by policy sync, dense
Adam, the reward curve written. Tiny step counts: this checks the plumbing, not the learning
(the full run, `examples/logra_rl/train.py`, shows the reward rising)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "logra_rl"


def _run_example(tmp_path, extra=()):
    # The rollout process (spawned) imports this example as `train`: another example's cached
    # `train` module must not stand in for it.
    sys.modules.pop("train", None)
    sys.path.insert(0, str(EXAMPLE))
    try:
        import train
    finally:
        sys.path.remove(str(EXAMPLE))
    import torch

    threads = torch.get_num_threads()  # the example pins CPU threads; leave the session as found
    try:
        summary = train.main(["--sft-steps", "4", "--rl-steps", "3", "--prompts", "4", "--group", "4", "--rank", "8",
                              "--device", "cpu", "--out", str(tmp_path), *extra])
    finally:
        torch.set_num_threads(threads)
    return summary


def test_example_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.delenv("MEMBAR_SOCKET", raising=False)
    summary = _run_example(tmp_path)
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    written = json.loads((tmp_path / "rewards.json").read_text())
    runs = list(written["runs"].values())
    assert len(runs) == 2 and all(len(run["reward"]) == 3 for run in runs)
    logra_run = next(run for name, run in summary["runs"].items() if name.startswith("LoGRA"))
    assert 0 < logra_run["sync_payload_bytes"] < logra_run["full_weight_bytes"]
    assert all(0 < alpha <= 1.0 for alpha in logra_run["alpha"])
    assert logra_run["sync_transport"] == "posix"


def test_example_syncs_through_a_daemon(tmp_path, membard):
    summary = _run_example(tmp_path, ["--socket", membard()])
    logra_run = next(run for name, run in summary["runs"].items() if name.startswith("LoGRA"))
    assert logra_run["sync_transport"] == "channel"
    assert logra_run["states"].startswith("runtime pages (daemon:")
    assert len(logra_run["reward"]) == 3


def test_distributed_example_keeps_rollout_ranks_on_the_trainers_bits(tmp_path):
    """examples/logra_rl/train_distributed.py with 2 trainer ranks (frozen weights sharded by FSDP2)
    and 1 rollout rank (updates by broadcast), gloo: the rollout rank ends with the trainers' weights
    bit for bit, each trainer held half of the frozen weights, and every update was applied."""
    import socket

    import torch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(root / "bindings" / "python"), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, str(EXAMPLE / "train_distributed.py"), "--trainers", "2", "--sft-steps", "4",
               "--rl-steps", "3", "--prompts", "4", "--group", "4", "--rank", "8", "--out", str(tmp_path)]
    ranks = [subprocess.Popen(command, env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(3)]
    outputs = [rank.communicate(timeout=240)[0] for rank in ranks]
    for rank, (process, output) in enumerate(zip(ranks, outputs)):
        assert process.returncode == 0, f"rank {rank}:\n{output}"
    summary = json.loads((tmp_path / "rewards.json").read_text())
    assert summary["rollout"]["applied"] == 3 and len(summary["trainer"]["reward"]) == 3
    assert summary["trainer"]["frozen_weight_bytes_on_this_rank"] * 2 == summary["trainer"]["frozen_weight_bytes"]
    assert summary["trainer"]["sync_bytes_per_update"] < summary["trainer"]["frozen_weight_bytes"] / 4
    weights = [torch.load(tmp_path / f"weights_rank{rank}.pt") for rank in range(3)]
    for other in weights[1:]:
        assert all(torch.equal(a, b) for a, b in zip(weights[0], other))
