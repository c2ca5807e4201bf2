"""Smoke run of examples/logra_rl: SFT, LoGRA RL with a rollout process fed by policy sync, dense
Adam, the reward curve written. Tiny step counts: this checks the plumbing, not the learning
(the full run, `examples/logra_rl/train.py`, shows the reward rising)."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "logra_rl"


def test_example_runs_end_to_end(tmp_path):
    sys.path.insert(0, str(EXAMPLE))
    try:
        import train
    finally:
        sys.path.remove(str(EXAMPLE))
    import torch

    threads = torch.get_num_threads()  # the example pins CPU threads; leave the session as found
    try:
        summary = train.main(["--sft-steps", "4", "--rl-steps", "3", "--prompts", "4", "--group", "4", "--rank", "8",
                              "--device", "cpu", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    written = json.loads((tmp_path / "rewards.json").read_text())
    runs = list(written["runs"].values())
    assert len(runs) == 2 and all(len(run["reward"]) == 3 for run in runs)
    logra_run = next(run for name, run in summary["runs"].items() if name.startswith("LoGRA"))
    assert 0 < logra_run["sync_payload_bytes"] < logra_run["full_weight_bytes"]
    assert all(0 < alpha <= 1.0 for alpha in logra_run["alpha"])
